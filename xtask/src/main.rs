//! The repository's own tasks, run as `cargo xtask <task>` (an alias in
//! `.cargo/config.toml`):
//!
//! - `cargo xtask test`: makes the machine ready (see [`setup`]), then runs
//!   every test of the workspace on every backend, and the doc tests.
//! - `cargo xtask check`: what CI checks besides the tests (`.ci/run` runs
//!   both): formatting, clippy on every feature set, that the async-only
//!   build has no C client library, the docs, the benchmark's quick mode, and
//!   the worked examples on every backend.
//!
//! Both stop at the first step that fails, and exit with status 1.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

mod setup;

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "diesel-claim's own tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Installs what is missing, starts the database servers, runs every test
    Test {
        /// Passed on to `cargo nextest run`, e.g. a filter: `-- claim::pg`
        #[arg(last = true)]
        nextest: Vec<String>,
    },
    /// Formatting, lints, docs, the benchmark's quick mode and the worked
    /// examples on every backend
    Check,
}

/// An error that ends the task: what failed, for the user to read.
type Error = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.task {
        Task::Test { nextest } => setup::machine().and_then(|servers| test(&servers, &nextest)),
        Task::Check => setup::machine().and_then(|servers| check(&servers)),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("\nxtask: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Every test on every backend: the integration tests and unit tests under
/// nextest, then the doc tests (which nextest does not run) once per backend:
/// they run on PostgreSQL when it is enabled, else on MySQL, else on SQLite.
fn test(servers: &setup::Servers, nextest_args: &[String]) -> Result<(), Error> {
    cargo(
        servers,
        ["nextest", "run", "--workspace", "--all-features"],
        nextest_args,
    )?;
    for features in ["--all-features", "--features=mysql", "--features=sqlite"] {
        cargo(servers, ["test", "--doc", features], &[])?;
    }
    Ok(())
}

/// Every feature set the crate promises to compile, lint-free: none, each
/// backend alone (with its blocking connection or without), the async API
/// alone and with each of its backends (with the blocking connection or
/// without), and tracing and anyhow beside them.
const FEATURE_SETS: &[&[&str]] = &[
    &["--no-default-features"],
    &["--features", "postgres"],
    &["--features", "sqlite"],
    &["--features", "mysql"],
    &["--features", "postgres_backend"],
    &["--features", "mysql_backend"],
    &["--features", "async"],
    &["--features", "async,postgres"],
    &["--features", "async,mysql"],
    &["--features", "async,postgres_backend"],
    &["--features", "async,mysql_backend"],
    &["--features", "bb8,postgres_backend"],
    &["--features", "deadpool,mysql_backend,tracing"],
    &["--features", "tracing,anyhow,sqlite"],
    &["--features", ASYNC_ONLY],
];

/// Everything an async-only service can enable.
const ASYNC_ONLY: &str = "async,postgres_backend,mysql_backend,tracing,anyhow";

/// What only Diesel's blocking connections need: libpq, libmysqlclient and
/// the r2d2 pool, none of which an async-only build may depend on.
const BLOCKING_ONLY: [&str; 3] = ["pq-sys", "mysqlclient-sys", "r2d2"];

fn check(servers: &setup::Servers) -> Result<(), Error> {
    cargo(servers, ["fmt", "--all", "--", "--check"], &[])?;
    cargo(
        servers,
        ["clippy", "--workspace", "--all-targets", "--all-features"],
        &["--", "-D", "warnings"].map(String::from),
    )?;
    for &features in FEATURE_SETS {
        let mut args = vec!["clippy", "--all-targets"];
        args.extend(features);
        cargo(servers, args, &["--", "-D", "warnings"].map(String::from))?;
    }
    async_only_dependencies()?;
    step(
        servers,
        Command::new(cargo_program())
            .args(["doc", "--no-deps", "--all-features"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    // The benchmark's smoke test: every mode on every backend, checking only
    // that nothing is processed twice or left behind; timings never fail it.
    cargo(
        servers,
        ["bench", "--bench", "throughput", "--all-features"],
        &["--", "--quick", "--partitioned"].map(String::from),
    )?;
    // The worked examples: the README's command on SQLite, then every server.
    cargo(
        servers,
        [
            "run",
            "--release",
            "--features",
            "sqlite",
            "--example",
            "shop",
        ],
        &[],
    )?;
    for url in [&servers.postgres, &servers.mysql] {
        for (example, features) in [
            ("shop", "postgres,mysql"),
            ("shop_async", "async,postgres,mysql"),
        ] {
            step(
                servers,
                Command::new(cargo_program())
                    .args([
                        "run",
                        "--release",
                        "--features",
                        features,
                        "--example",
                        example,
                    ])
                    .env("DATABASE_URL", url),
            )?;
        }
    }
    println!("\nall checks passed");
    Ok(())
}

/// Fails if the crate's dependencies with [`ASYNC_ONLY`] (not its
/// dev-dependencies, which the tests need) include any of [`BLOCKING_ONLY`].
fn async_only_dependencies() -> Result<(), Error> {
    let mut command = Command::new(cargo_program());
    command.args(["tree", "--edges", "normal", "--package", "diesel-claim"]);
    command.args([
        "--features",
        ASYNC_ONLY,
        "--prefix",
        "none",
        "--format",
        "{p}",
    ]);
    println!("\n==> {}", shown(&command));
    let output = command
        .output()
        .map_err(|e| format!("cannot run {}: {e}", shown(&command)))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(format!("{} failed ({}):\n{stderr}", shown(&command), output.status).into());
    }
    let tree = String::from_utf8_lossy(&output.stdout);
    // Each line is `name vX.Y.Z`, maybe followed by a path or `(*)`.
    let names: Vec<&str> = tree
        .lines()
        .filter_map(|line| line.split(' ').next())
        .collect();
    // A tree without diesel-async is not the one asked for: nothing to conclude.
    if !names.contains(&"diesel-async") {
        return Err(format!("{} lists no diesel-async:\n{tree}", shown(&command)).into());
    }
    let found: Vec<&str> = BLOCKING_ONLY
        .into_iter()
        .filter(|name| names.contains(name))
        .collect();
    if !found.is_empty() {
        return Err(format!("the async-only build ({ASYNC_ONLY}) depends on {found:?}").into());
    }
    println!("no {BLOCKING_ONLY:?} with {ASYNC_ONLY}");
    Ok(())
}

/// Runs `cargo <args> <more>` with the servers' URLs in its environment.
fn cargo<'a>(
    servers: &setup::Servers,
    args: impl IntoIterator<Item = &'a str>,
    more: &[String],
) -> Result<(), Error> {
    step(servers, Command::new(cargo_program()).args(args).args(more))
}

/// The cargo that runs this task, so that a toolchain chosen by rustup for it
/// runs the steps too.
fn cargo_program() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Prints `command` as a step, runs it with the servers' URLs, and fails if
/// it does.
fn step(servers: &setup::Servers, command: &mut Command) -> Result<(), Error> {
    command
        .env("PG_DATABASE_URL", &servers.postgres)
        .env("MYSQL_DATABASE_URL", &servers.mysql);
    println!("\n==> {}", shown(command));
    let status = command
        .status()
        .map_err(|e| format!("cannot run {}: {e}", shown(command)))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{} failed ({status})", shown(command)).into())
    }
}

/// `command` as it would be typed, environment additions first.
fn shown(command: &Command) -> String {
    let env = command
        .get_envs()
        .filter(|(name, _)| !name.to_string_lossy().ends_with("_DATABASE_URL"))
        .filter_map(|(name, value)| Some(format!("{}={}", name.to_str()?, value?.to_str()?)));
    // `cargo`, not the toolchain's full path to it.
    let program = Path::new(command.get_program()).file_name();
    let words = program.into_iter().chain(command.get_args());
    env.chain(words.map(OsStr::to_string_lossy).map(String::from))
        .collect::<Vec<_>>()
        .join(" ")
}
