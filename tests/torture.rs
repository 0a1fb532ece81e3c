//! The torture suite at light scale (see `diesel_claim_testkit::torture`,
//! the `torture` example and `RELIABILITY.md`): every scenario on every backend, with real worker
//! processes and real faults, on every test run.
//!
//! Worker processes are this test binary run again on the same test (`<name>
//! --exact`), told by an environment variable to act as a worker; that works
//! under nextest (a process per test) and `cargo test` alike.

use suite::procs::{Launcher, WORKER_ENV};
use suite::{Backend, Scale};
use testkit::torture as suite;

/// Runs every scenario that applies to `backend` at light scale, or, in a
/// worker process, the worker it was started as.
fn light(backend: &str, test_name: &str) {
    if let Ok(args) = std::env::var(WORKER_ENV) {
        let args: Vec<String> = args.lines().map(str::to_owned).collect();
        std::process::exit(suite::worker_main(&args));
    }
    let backends = Backend::parse_list(backend).expect("the backend is enabled");
    let launcher = Launcher::Test {
        name: test_name.to_owned(),
    };
    let outcomes = suite::run("all", Scale::Light, &backends, &launcher);
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|outcome| !outcome.passed())
        .map(ToString::to_string)
        .collect();
    assert!(!outcomes.is_empty(), "no scenario ran");
    assert!(
        failed.is_empty(),
        "failed scenarios:\n{}",
        failed.join("\n")
    );
}

#[cfg(feature = "postgres")]
#[test]
fn light_postgres() {
    light("postgres", "torture::light_postgres");
}

#[cfg(feature = "sqlite")]
#[test]
fn light_sqlite() {
    light("sqlite", "torture::light_sqlite");
}

#[cfg(feature = "mysql")]
#[test]
fn light_mysql() {
    light("mysql", "torture::light_mysql");
}
