//! The worked example of `diesel-claim`: a small shop whose workers run
//! concurrently against a real database.
//!
//! 1. **Shipping emails** (`claim_each`): workers claim shipped orders and send
//!    each confirmation email exactly once; an outbox table stands in for the
//!    mail server. An order whose email fails does not stop the job
//!    (`keep_going`); after three failed attempts it is a dead letter. A
//!    warehouse worker (`worker(&stop)`) ships orders as they come in,
//!    woken by `LISTEN` on PostgreSQL, and is stopped gracefully.
//! 2. **Bank accounts** (`with_lock`, then `update_versioned` + `retry`):
//!    concurrent deposits and withdrawals never lose money and never overdraw.
//! 3. **Sign-ups** (`with_lease`): concurrent requests for the same user name
//!    create one active user, on a table that cannot have a UNIQUE constraint.
//! 4. **Invoices** (`visibility_timeout`): workers mail invoices with no
//!    transaction open, each marked sent by a write fenced on its claim's
//!    stamp; a dead worker's invoices come back when their stamps pass, and a
//!    stalled worker's late write is refused.
//!
//! It ends by printing the checks it made and exits with status 1 if any failed.
//!
//! ```text
//! cargo run --release -p diesel-claim-shop                       # a temporary SQLite file
//! DATABASE_URL=postgres://user@host/db \
//!     cargo run --release -p diesel-claim-shop --features postgres # PostgreSQL
//! DATABASE_URL=mysql://user@host/db \
//!     cargo run --release -p diesel-claim-shop --features mysql    # MySQL, MariaDB
//! cargo run --release -p diesel-claim-shop -- --help
//! RUST_LOG=diesel_claim=info \
//!     cargo run --release -p diesel-claim-shop --features tracing  # with the crate's spans
//! ```
//!
//! On PostgreSQL everything happens in a schema of its own (`shop_<pid>_…`), on
//! MySQL in a database of its own, dropped at the end, so runs on a shared
//! server do not see each other.
//!
//! Diesel checks queries per backend at compile time, so the stories in
//! `stories/` are written against a concrete connection type and compiled once
//! per backend: `sqlite.rs`, `postgres.rs` and `mysql.rs` each include them with `#[path]`
//! after saying what `Conn` and `Pool` are. Generic code over
//! `C: Connection` would need a `where` clause per query; this needs none.

// Loading `stories/` once per backend is the point (see above).
#![allow(clippy::duplicate_mod)]

use std::sync::atomic::{AtomicU64, Ordering};

// The command line, error type, clock, checks and per-run schema or database,
// shared with the other worked example.
use common::{is_mysql_url, is_postgres_url};
pub use common::{BoxError, Checks, Clock, Options, ShopError};
use diesel_claim_testkit::shop as common;

mod schema;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

const ABOUT: &str = "\
Runs the diesel-claim shop example on a temporary SQLite file, removed at the
end, or on PostgreSQL or MySQL/MariaDB when --database-url or DATABASE_URL
names a postgres:// or mysql:// database (the example works in a schema, or a
database, of its own there and drops it at the end).";

/// The command line, with the server URL taken from `DATABASE_URL` when the
/// command line names none.
fn options() -> Options {
    let mut options = Options::from_args("shop", ABOUT, 4);
    // DATABASE_URL is often set for other tools (diesel CLI, .env files); only
    // a server URL is taken from it, never a path to someone's SQLite file.
    if options.database_url.is_none() {
        options.database_url = std::env::var("DATABASE_URL")
            .ok()
            .filter(|url| is_postgres_url(url) || is_mysql_url(url));
    }
    options
}

fn main() {
    log_spans();
    common::exit_with(run());
}

/// With the crate's `tracing` feature, writes its spans to stderr as each
/// closes (a claim call with its report, a lease with its token, a worker with
/// its total), and its events, at the levels `RUST_LOG` asks for
/// (`RUST_LOG=diesel_claim=info`; `diesel_claim=debug` adds batches, row
/// locks, lease renewals and retries).
#[cfg(feature = "tracing")]
fn log_spans() {
    use tracing_subscriber::fmt::format::FmtSpan;
    use tracing_subscriber::EnvFilter;

    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::from_default_env())
        .with_span_events(FmtSpan::CLOSE)
        .with_writer(std::io::stderr)
        .init();
}

#[cfg(not(feature = "tracing"))]
fn log_spans() {}

/// Runs the stories and prints the checks; `Ok(false)` if one failed.
fn run() -> Result<bool, BoxError> {
    let options = options();
    let clock = Clock::start();

    let checks = match &options.database_url {
        Some(url) if is_postgres_url(url) => run_postgres(url, &options, clock)?,
        Some(url) if is_mysql_url(url) => run_mysql(url, &options, clock)?,
        Some(url) => return Err(format!("not a postgres:// or mysql:// URL: {url}").into()),
        None => run_sqlite(&options, clock)?,
    };

    Ok(checks.conclude(clock))
}

#[cfg(feature = "sqlite")]
fn run_sqlite(options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    sqlite::run(options, clock)
}

#[cfg(not(feature = "sqlite"))]
fn run_sqlite(_: &Options, _: Clock) -> Result<Checks, BoxError> {
    Err(
        "this build has no SQLite support: run it with `--features sqlite` (the \
         default), or give a PostgreSQL URL with --database-url"
            .into(),
    )
}

#[cfg(feature = "postgres")]
fn run_postgres(url: &str, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    postgres::run(url, options, clock)
}

#[cfg(not(feature = "postgres"))]
fn run_postgres(_: &str, _: &Options, _: Clock) -> Result<Checks, BoxError> {
    Err("this build has no PostgreSQL support: run it with `--features postgres`".into())
}

#[cfg(feature = "mysql")]
fn run_mysql(url: &str, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    mysql::run(url, options, clock)
}

#[cfg(not(feature = "mysql"))]
fn run_mysql(_: &str, _: &Options, _: Clock) -> Result<Checks, BoxError> {
    Err("this build has no MySQL support: run it with `--features mysql`".into())
}

/// A counter shared by workers that prints a line every `every` increments.
#[derive(Debug)]
pub struct Progress {
    count: AtomicU64,
    every: u64,
    what: &'static str,
    clock: Clock,
}

impl Progress {
    pub fn new(every: u64, what: &'static str, clock: Clock) -> Progress {
        Progress {
            count: AtomicU64::new(0),
            every,
            what,
            clock,
        }
    }

    pub fn tick(&self) {
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        if count.is_multiple_of(self.every) {
            self.clock.log(format_args!("{count} {}", self.what));
        }
    }
}
