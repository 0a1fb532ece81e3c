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
//! light scale also runs in the test suite (`tests/torture.rs`); the
//! scenarios live in `diesel_claim_testkit::torture`. PostgreSQL and MariaDB
//! are found as the tests find them (`PG_DATABASE_URL`, `MYSQL_DATABASE_URL`);
//! every scenario works in a database of its own, dropped at the end, and the
//! server crashes and network faults on servers of their own.

use std::process::ExitCode;

use clap::Parser;
use diesel_claim_testkit::torture::{self as suite, procs::Launcher, Backend, Scale};

/// Runs the reliability scenarios (see RELIABILITY.md) and prints one line per
/// scenario with its figures and PASS or FAIL; exits with status 1 on any FAIL.
#[derive(Debug, Parser)]
#[command(name = "torture")]
struct Options {
    /// `all`, or scenarios by number or name, separated by commas
    #[arg(long = "scenario", default_value = "all")]
    selection: String,
    /// `light` (as in the tests) or `heavy`
    #[arg(long, default_value = "light", value_parser = scale)]
    scale: Scale,
    /// `postgres`, `sqlite`, `mysql` or `all` (the backends this build has)
    #[arg(long = "backend", default_value = "all", value_parser = backends)]
    backends: Backends,
}

#[derive(Debug, Clone)]
struct Backends(Vec<Backend>);

fn scale(text: &str) -> Result<Scale, String> {
    Scale::parse(text).ok_or_else(|| format!("unknown scale {text:?}: light or heavy"))
}

fn backends(text: &str) -> Result<Backends, String> {
    Backend::parse_list(text)
        .map(Backends)
        .ok_or_else(|| format!("unknown or disabled backend {text:?}"))
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1).peekable();
    // Hidden: the runner re-runs this executable as `torture worker …`.
    if args.peek().map(String::as_str) == Some("worker") {
        let args: Vec<String> = args.skip(1).collect();
        return ExitCode::from(suite::worker_main(&args) as u8);
    }
    let options = Options::parse();
    let outcomes = suite::run(
        &options.selection,
        options.scale,
        &options.backends.0,
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
