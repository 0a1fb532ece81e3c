//! The torture suite of `diesel-claim`: the reliability scenarios of
//! `RELIABILITY.md`, with real worker processes and real faults, each checking
//! its invariant and printing its figures.
//!
//! ```text
//! cargo run --release --all-features --example torture -- --scenario all --scale heavy
//! cargo run --release --all-features --example torture -- --scenario 1,4,lease-fencing --backend sqlite
//! ```
//!
//! Prints one line per scenario and exits with status 1 if any failed. The
//! light scale also runs in the test suite (`tests/torture.rs`). PostgreSQL is
//! found as the tests find it (`PG_DATABASE_URL`); every scenario works in a
//! database of its own, dropped at the end.

// The suite is written for both backends; with fewer, parts of it go unused.
#![cfg_attr(
    not(all(feature = "postgres", feature = "sqlite")),
    allow(
        dead_code,
        unreachable_code,
        unused_imports,
        unused_macros,
        unused_variables
    )
)]

use std::process::ExitCode;

// The tests' helpers: throwaway databases, the shop schema, `on_every_backend!`.
#[allow(dead_code, unused_imports)]
#[path = "../../tests/common/mod.rs"]
mod common;
#[allow(dead_code, unused_imports)]
#[path = "../../tests/fixtures.rs"]
mod fixtures;
mod suite;

use suite::{procs::Launcher, Backend, Scale};

const USAGE: &str = "\
usage: torture [--scenario all|N,N,…|name,…] [--scale light|heavy] [--backend postgres|sqlite|all]

Runs the reliability scenarios (see RELIABILITY.md) and prints one line per
scenario with its figures and PASS or FAIL; exits with status 1 on any FAIL.
Defaults: --scenario all --scale light --backend all.";

struct Options {
    selection: String,
    scale: Scale,
    backends: Vec<Backend>,
}

fn parse_options(mut args: impl Iterator<Item = String>) -> Result<Options, String> {
    let mut options = Options {
        selection: "all".to_owned(),
        scale: Scale::Light,
        backends: Backend::parse_list("all").unwrap_or_default(),
    };
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--scenario" => options.selection = value()?,
            "--scale" => {
                let text = value()?;
                options.scale = Scale::parse(&text).ok_or(format!("unknown scale {text:?}"))?;
            }
            "--backend" => {
                let text = value()?;
                options.backends = Backend::parse_list(&text)
                    .ok_or(format!("unknown or disabled backend {text:?}"))?;
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(options)
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1).peekable();
    // Hidden: the runner re-runs this executable as `torture worker …`.
    if args.peek().map(String::as_str) == Some("worker") {
        let args: Vec<String> = args.skip(1).collect();
        return ExitCode::from(suite::worker_main(&args) as u8);
    }
    if args
        .peek()
        .is_some_and(|arg| arg == "-h" || arg == "--help")
    {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let options = match parse_options(args) {
        Ok(options) => options,
        Err(problem) => {
            eprintln!("{problem}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let outcomes = suite::run(
        &options.selection,
        options.scale,
        &options.backends,
        &Launcher::Example,
    );
    let failed = outcomes.iter().filter(|o| !o.passed()).count();
    println!(
        "{} scenario runs, {} passed, {failed} failed",
        outcomes.len(),
        outcomes.len() - failed
    );
    if outcomes.is_empty() || failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
