//! What the worked examples (`shop`, `shop_async` and the job service) share:
//! the shops' command line and error type, the clock that stamps progress
//! lines, the checks printed at the end, the schema or database of its own
//! each run works in, the exit status, and the bank story's retry policy.
//! What differs between them (blocking or async, which backends, which
//! tables) stays with them.

use std::error::Error as StdError;
use std::fmt::Display;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use diesel_claim::Transient;

/// Command-line options.
#[derive(Debug, Clone, clap::Parser)]
pub struct Options {
    /// Orders placed in part 1 (half of them shipped at first)
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..))]
    pub orders: u32,
    /// Concurrent workers (threads in `shop`, tokio tasks in `shop_async`), each
    /// with a pooled connection of its own
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub workers: u32,
    /// A postgres:// or mysql:// server URL
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

impl Options {
    /// Reads the command line of the example `name`, described by `about`,
    /// with `workers` workers unless it says otherwise; `--help` prints the
    /// options and exits. Where the URL comes from when the command line has
    /// none is up to the caller.
    pub fn from_args(name: &'static str, about: &'static str, workers: u32) -> Options {
        use clap::{CommandFactory, FromArgMatches};
        let matches = Options::command()
            .name(name)
            .about(about)
            .mut_arg("workers", |arg| {
                arg.default_value(workers.to_string()).required(false)
            })
            .get_matches();
        Options::from_arg_matches(&matches).unwrap_or_else(|error| error.exit())
    }
}

pub use crate::url::{is_mysql_url, is_postgres_url};

/// The error of the example's plumbing: anything goes, as long as it can cross
/// threads and tasks (workers return it through `JoinHandle`).
pub type BoxError = Box<dyn StdError + Send + Sync>;

/// The shop's own error type, for code that has domain errors besides database
/// ones.
///
/// To be usable from `with_lock`, `claim_each` and friends it converts from
/// `diesel_claim::Error`; to let `?` work on Diesel calls inside the closures it
/// converts from `diesel::result::Error` too (through `diesel_claim::Error`, which
/// turns lock timeouts, deadlocks and serialization failures into variants of
/// their own); and to be retried by `diesel_claim::retry` (or `aio::retry`) it
/// says which of its values are worth another attempt.
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

/// Time since the start, for progress lines.
#[derive(Debug, Clone, Copy)]
pub struct Clock(Instant);

impl Clock {
    pub fn start() -> Clock {
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

    /// Prints the checks and the verdict; whether all passed.
    pub fn conclude(&self, clock: Clock) -> bool {
        self.print();
        if self.all_passed() {
            println!("\nall checks passed in {:.2}s", clock.seconds());
        } else {
            println!("\nSOME CHECKS FAILED ({:.2}s)", clock.seconds());
        }
        self.all_passed()
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

/// The name of a run's own schema or database, `<prefix>_<pid>_<ns>`, so
/// that runs on a shared server do not see each other.
pub fn run_name(prefix: &str) -> Result<String, BoxError> {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.subsec_nanos();
    Ok(format!("{prefix}_{}_{nanos}", std::process::id()))
}

/// Runs `run` with the URL of a MySQL database of its own, `<prefix>_<pid>_<ns>`,
/// which a connection outside any pool creates before and drops after, whatever
/// happened; a failure to drop is reported after `run`'s own error, which
/// matters more.
#[cfg(feature = "mysql")]
pub fn in_own_mysql_database<T>(
    url: &str,
    prefix: &str,
    run: impl FnOnce(&str, &str) -> Result<T, BoxError>,
) -> Result<T, BoxError> {
    use diesel::connection::SimpleConnection;
    use diesel::Connection;

    let database = run_name(prefix)?;
    let mut admin = diesel::MysqlConnection::establish(url)?;
    admin.batch_execute(&format!("CREATE DATABASE {database}"))?;
    let outcome = run(&database, &crate::url::with_database(url, &database));
    let dropped = admin.batch_execute(&format!("DROP DATABASE {database}"));
    let value = outcome?;
    dropped?;
    Ok(value)
}

/// Runs `run` with the name of a PostgreSQL schema of its own,
/// `<prefix>_<pid>_<ns>`, which a connection outside any pool creates before and
/// drops after, as [`in_own_mysql_database`] does with a database.
#[cfg(feature = "postgres")]
pub fn in_own_postgres_schema<T>(
    url: &str,
    prefix: &str,
    run: impl FnOnce(&str) -> Result<T, BoxError>,
) -> Result<T, BoxError> {
    use diesel::connection::SimpleConnection;
    use diesel::Connection;

    let schema = run_name(prefix)?;
    let mut admin = diesel::PgConnection::establish(url)?;
    admin.batch_execute(&format!("CREATE SCHEMA {schema}"))?;
    let outcome = run(&schema);
    let dropped = admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"));
    let value = outcome?;
    dropped?;
    Ok(value)
}

/// Ends the example: status 0 when every check passed, 1 when one failed, 2
/// with the error and its causes when the run could not finish.
pub fn exit_with(outcome: Result<bool, BoxError>) -> ! {
    match outcome {
        Ok(true) => std::process::exit(0),
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

/// What the bank story of both examples needs. The stories are compiled once
/// per backend, so a `shop` built without any backend feature has no use for it.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod bank {
    use std::time::Duration;

    use diesel_claim::RetryPolicy;

    /// The retry policy for versioned updates: many workers on four rows
    /// conflict a lot, so it allows many quick attempts.
    pub const RETRY_POLICY: RetryPolicy = RetryPolicy {
        max_attempts: 100,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(20),
    };
}
