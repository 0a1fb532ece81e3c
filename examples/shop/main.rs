//! The worked example of `diesel-claim`: a small shop whose workers run
//! concurrently against a real database.
//!
//! 1. **Shipping emails** (`claim_each`): workers claim shipped orders and send
//!    each confirmation email exactly once; an outbox table stands in for the
//!    mail server.
//! 2. **Bank accounts** (`with_lock`, then `update_versioned` + `retry`):
//!    concurrent deposits and withdrawals never lose money and never overdraw.
//! 3. **Sign-ups** (`with_lease`): concurrent requests for the same user name
//!    create one active user, on a table that cannot have a UNIQUE constraint.
//!
//! It ends by printing the checks it made and exits with status 1 if any failed.
//!
//! ```text
//! cargo run --release --all-features --example shop                # SQLite file
//! DATABASE_URL=postgres://user@host/db \
//!     cargo run --release --all-features --example shop            # PostgreSQL
//! DATABASE_URL=mysql://user@host/db \
//!     cargo run --release --all-features --example shop            # MySQL, MariaDB
//! cargo run --release --all-features --example shop -- --help
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

use std::error::Error as StdError;
use std::fmt::Display;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use diesel_claim::Transient;

mod schema;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// The error of the example's plumbing: anything goes, as long as it can cross
/// threads (workers return it through `JoinHandle`).
pub type BoxError = Box<dyn StdError + Send + Sync>;

/// The shop's own error type, for code that has domain errors besides database
/// ones.
///
/// To be usable from `with_lock`, `claim_each` and friends it converts from
/// `diesel_claim::Error`; to let `?` work on Diesel calls inside the closures it
/// converts from `diesel::result::Error` too (through `diesel_claim::Error`, which
/// turns lock timeouts, deadlocks and serialization failures into variants of
/// their own); and to be retried by `diesel_claim::retry` it says which of its
/// values are worth another attempt.
#[derive(Debug, thiserror::Error)]
pub enum ShopError {
    /// A withdrawal larger than the balance: rejected, nothing is written.
    #[error("account {account} holds {balance}, cannot withdraw {amount}")]
    InsufficientFunds {
        account: i32,
        balance: i64,
        amount: i64,
    },

    #[error(transparent)]
    Database(#[from] diesel_claim::Error),
}

impl From<diesel::result::Error> for ShopError {
    fn from(error: diesel::result::Error) -> Self {
        ShopError::Database(error.into())
    }
}

impl Transient for ShopError {
    /// Version conflicts, deadlocks and serialization failures are worth a retry;
    /// an overdraft is not: the balance will not grow by asking again.
    fn is_transient(&self) -> bool {
        match self {
            ShopError::Database(error) => error.is_transient(),
            ShopError::InsufficientFunds { .. } => false,
        }
    }
}

/// Command-line options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Orders placed in part 1 (half of them shipped at first).
    pub orders: u32,
    /// Concurrent worker threads, each with a pooled connection of its own.
    pub workers: u32,
    /// A `postgres://` or `mysql://` URL; SQLite is used without one.
    pub database_url: Option<String>,
}

const USAGE: &str = "\
usage: shop [--orders N] [--workers N] [--database-url postgres://…|mysql://…]

Runs the diesel-claim shop example on a fresh SQLite file, or on PostgreSQL or
MySQL/MariaDB when --database-url or DATABASE_URL names a postgres:// or
mysql:// database (the example works in a schema, or a database, of its own
there and drops it at the end).

  --orders N        orders to place and email (default 2000)
  --workers N       concurrent workers (default 4)
  --database-url U  server URL (default: $DATABASE_URL if postgres:// or mysql://)";

impl Options {
    fn from_args() -> Result<Options, BoxError> {
        let mut options = Options {
            orders: 2000,
            workers: 4,
            database_url: None,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
            match arg.as_str() {
                "--orders" => options.orders = value("--orders")?.parse()?,
                "--workers" => options.workers = value("--workers")?.parse()?,
                "--database-url" => options.database_url = Some(value("--database-url")?),
                "-h" | "--help" => {
                    println!("{USAGE}");
                    std::process::exit(0);
                }
                other => return Err(format!("unknown argument {other:?}\n\n{USAGE}").into()),
            }
        }
        if options.workers == 0 || options.orders == 0 {
            return Err("--orders and --workers must be at least 1".into());
        }
        // DATABASE_URL is often set for other tools (diesel CLI, .env files); only
        // a server URL is taken from it, never a path to someone's SQLite file.
        if options.database_url.is_none() {
            options.database_url = std::env::var("DATABASE_URL")
                .ok()
                .filter(|url| is_postgres_url(url) || is_mysql_url(url));
        }
        Ok(options)
    }
}

fn is_postgres_url(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

fn is_mysql_url(url: &str) -> bool {
    url.starts_with("mysql://")
}

fn main() {
    match run() {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(error) => {
            eprintln!("error: {error}");
            let mut cause = error.source();
            while let Some(error) = cause {
                eprintln!("  caused by: {error}");
                cause = error.source();
            }
            std::process::exit(2);
        }
    }
}

/// Runs the stories and prints the checks; `Ok(false)` if one failed.
fn run() -> Result<bool, BoxError> {
    let options = Options::from_args()?;
    let clock = Clock::start();

    let checks = match &options.database_url {
        Some(url) if is_postgres_url(url) => run_postgres(url, &options, clock)?,
        Some(url) if is_mysql_url(url) => run_mysql(url, &options, clock)?,
        Some(url) => return Err(format!("not a postgres:// or mysql:// URL: {url}").into()),
        None => run_sqlite(&options, clock)?,
    };

    checks.print();
    if checks.all_passed() {
        println!("\nall checks passed in {:.2}s", clock.seconds());
    } else {
        println!("\nSOME CHECKS FAILED ({:.2}s)", clock.seconds());
    }
    Ok(checks.all_passed())
}

#[cfg(feature = "sqlite")]
fn run_sqlite(options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    sqlite::run(options, clock)
}

#[cfg(not(feature = "sqlite"))]
fn run_sqlite(_: &Options, _: Clock) -> Result<Checks, BoxError> {
    Err(
        "this build has no SQLite support: run it with `--features sqlite` (or \
         `--all-features`), or give a PostgreSQL URL with --database-url"
            .into(),
    )
}

#[cfg(feature = "postgres")]
fn run_postgres(url: &str, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    postgres::run(url, options, clock)
}

#[cfg(not(feature = "postgres"))]
fn run_postgres(_: &str, _: &Options, _: Clock) -> Result<Checks, BoxError> {
    Err(
        "this build has no PostgreSQL support: run it with `--features postgres` (or \
         `--all-features`)"
            .into(),
    )
}

#[cfg(feature = "mysql")]
fn run_mysql(url: &str, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    mysql::run(url, options, clock)
}

#[cfg(not(feature = "mysql"))]
fn run_mysql(_: &str, _: &Options, _: Clock) -> Result<Checks, BoxError> {
    Err(
        "this build has no MySQL support: run it with `--features mysql` (or \
         `--all-features`)"
            .into(),
    )
}

/// Time since the start, for progress lines.
#[derive(Debug, Clone, Copy)]
pub struct Clock(Instant);

impl Clock {
    fn start() -> Clock {
        Clock(Instant::now())
    }

    pub fn seconds(&self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }

    /// Prints a progress line stamped with the elapsed time.
    pub fn log(&self, message: impl Display) {
        println!("[{:>6.2}s] {message}", self.seconds());
    }
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
        if count % self.every == 0 {
            self.clock.log(format_args!("{count} {}", self.what));
        }
    }
}

/// The checks the example made, printed at the end.
#[derive(Debug, Default)]
pub struct Checks(Vec<Check>);

#[derive(Debug)]
struct Check {
    name: String,
    passed: bool,
    detail: String,
}

impl Checks {
    /// Records a check; `detail` says what was counted, pass or fail.
    pub fn check(&mut self, name: &str, passed: bool, detail: impl Into<String>) {
        self.0.push(Check {
            name: name.to_owned(),
            passed,
            detail: detail.into(),
        });
    }

    pub fn all_passed(&self) -> bool {
        self.0.iter().all(|check| check.passed)
    }

    fn print(&self) {
        println!("\nChecks");
        let width = self
            .0
            .iter()
            .map(|check| check.name.len())
            .max()
            .unwrap_or(0)
            + 10;
        for check in &self.0 {
            let verdict = if check.passed { "ok" } else { "FAILED" };
            let name = format!("check {} ", check.name);
            println!("  {name:.<width$} {verdict}  ({})", check.detail);
        }
    }
}
