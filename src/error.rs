//! The crate's error type and helpers that classify `diesel::result::Error`.

use std::any::Any;
use std::fmt::Display;

use diesel::result::{DatabaseErrorInformation, DatabaseErrorKind};

use crate::trace;

/// The error type of every fallible operation in this crate.
///
/// Variants are named for what happened, so callers can match on the outcome
/// instead of parsing messages. Database errors that this crate recognises (lock
/// not available, deadlock, serialization failure) are turned into their own
/// variants by [`From<diesel::result::Error>`](#impl-From<Error>-for-Error).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The row (or database write lock) was held by another transaction and the
    /// chosen policy was to fail at once, or the lock wait timed out
    /// (PostgreSQL `lock_timeout`, SQLite `busy_timeout`).
    #[error(
        "lock not available: the row (on SQLite, the database) is locked by another \
         transaction, and the call was not to wait (nowait) or waited out its timeout \
         (PostgreSQL lock_timeout, MySQL innodb_lock_wait_timeout, SQLite busy_timeout)"
    )]
    LockNotAvailable,

    /// The database detected a deadlock and aborted this transaction; retrying
    /// the whole transaction usually succeeds.
    #[error("deadlock detected: {0}")]
    Deadlock(#[source] diesel::result::Error),

    /// The transaction could not be serialized with concurrent ones (SQLSTATE
    /// `40001` under `REPEATABLE READ` or `SERIALIZABLE`); retry it.
    #[error("serialization failure: {0}")]
    SerializationFailure(#[source] diesel::result::Error),

    /// A versioned update or delete found the row at another version than
    /// expected.
    ///
    /// `actual` is the version read right after the update matched nothing; it is
    /// `None` when it could not be read in the same breath.
    #[error(
        "version conflict on {table}: expected version {expected}, found {}",
        display_version(.actual)
    )]
    VersionConflict {
        /// The table of the row, as `table!` names it: `orders`, or
        /// `shop.orders` for a table in a schema.
        table: String,
        /// The version the update was guarded with.
        expected: i64,
        /// The version the row had when the conflict was detected.
        actual: Option<i64>,
    },

    /// The version column is at its maximum value and cannot be incremented.
    #[error("version overflow: version {0} is the largest the column can hold")]
    VersionOverflow(i64),

    /// The targeted row does not exist (or no longer matches the query).
    #[error("row not found")]
    NotFound,

    /// A lease was still held by another owner when [`Lease::acquire_within`]
    /// stopped waiting for it.
    ///
    /// [`Lease::acquire_within`]: crate::Lease::acquire_within
    #[error("lease {name:?} is held by another owner")]
    LeaseHeld {
        /// The lease name.
        name: String,
    },

    /// A lease renewal or release was refused because the caller no longer owns
    /// the lease: it expired, or was taken over by a newer holder.
    #[error("lease {name:?} is not owned by token {token}: it expired or has a newer holder")]
    NotLeaseOwner {
        /// The lease name.
        name: String,
        /// The fencing token the caller presented.
        token: i64,
    },

    /// A [visibility-timeout claim](crate::ClaimBuilder::visibility_timeout)'s
    /// write was refused, and nothing was written: the row no longer carries
    /// the claim's stamp. The claim ran out and another worker claimed the
    /// row since (or the application cleared the stamp); the work done under
    /// this claim must not be committed.
    #[error(
        "claim lost on {table} row {key}: the row's claim ran out and the row was claimed again \
         (or its stamp was cleared)"
    )]
    ClaimLost {
        /// The table of the row, as `table!` names it: `invoices`, or
        /// `shop.invoices` for a table in a schema.
        table: String,
        /// The row's primary key, as its value's `Debug` shows it: `42`, or
        /// `(7, "eu")` for a composite key.
        key: String,
    },

    /// An argument was rejected before any SQL was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The database answered with an outcome the operation cannot go on from,
    /// though nothing it was given was invalid: `with_lock`'s query selected
    /// several rows, an `update_versioned` target matched several rows, a mark
    /// left a claimed row matching the query so that it
    /// came back a second time in one call, `GET_LOCK` failed on the server, or
    /// a named lock was no longer held when it was released. What the
    /// operation's transaction wrote is rolled back.
    #[error("unexpected outcome: {0}")]
    UnexpectedOutcome(String),

    /// The database server lacks what the operation needs: MySQL before 8.0.1
    /// and MariaDB before 10.6 have no `SKIP LOCKED` or `NOWAIT`, so their
    /// claims and row locks fail with this rather than block.
    #[error("not supported by this database server: {0}")]
    Unsupported(#[source] diesel::result::Error),

    /// The connection can no longer be used: drop it and use another (a
    /// pool's next checkout replaces it).
    ///
    /// Either the server or the network closed it: the server was restarted
    /// or ended the session (`pg_terminate_backend`, MariaDB's `KILL`, an
    /// idle timeout), or the link broke (libpq's "server closed the
    /// connection unexpectedly", MySQL's "server has gone away", Diesel's
    /// [`ClosedConnection`](diesel::result::DatabaseErrorKind::ClosedConnection)).
    /// Nothing the open transaction wrote was committed, unless the
    /// connection closed during its commit, when the client cannot know.
    ///
    /// Or its transaction manager is broken: a future was dropped while its
    /// transaction was open (see the async API's "Dropped futures"), or a
    /// rollback failed ([`BrokenTransactionManager`](diesel::result::Error::BrokenTransactionManager)).
    /// That transaction may still be open on the server, holding its locks.
    ///
    /// Not [transient](Self::is_transient): the same connection fails again.
    #[error("{}", broken_connection(.0))]
    BrokenConnection(#[source] diesel::result::Error),

    /// A connection pool gave no connection: it timed out waiting for one,
    /// or could not connect to the server. Converted from the pools' errors
    /// (r2d2's `PoolError`, bb8's `RunError`, deadpool's `PoolError`), so
    /// that `pool.get()?` works where this crate's [`Error`] is returned;
    /// the pool's error is the source.
    #[error("no connection from the pool: {}", one_line(.0))]
    Checkout(#[source] Box<dyn std::error::Error + Send + Sync>),

    /// The server ended the session of a transaction the async API opened,
    /// because it sat idle longer than its idle bound
    /// ([`ClaimBuilder::idle_bound`](crate::ClaimBuilder::idle_bound),
    /// [`LockBuilder::idle_bound`](crate::LockBuilder::idle_bound)): a closure
    /// awaited something else for that long inside its claim or lock. Nothing
    /// the transaction wrote was committed, and its row locks went with the
    /// session, **while the closure was still running**: another worker may
    /// have taken the same rows meanwhile. Raise the bound, or do such work
    /// outside the transaction (a visibility timeout). The connection is gone:
    /// use another.
    #[error(
        "the server ended the session after the transaction had been open {open_for:.1?}: it sat \
         idle longer than its idle bound ({bound:?}, set with `idle_bound`); nothing it wrote was \
         committed, and its row locks were released while the closure still ran, so another \
         worker may have taken its rows"
    )]
    IdleBoundExceeded {
        /// The idle bound the transaction began with.
        bound: std::time::Duration,
        /// How long the transaction had been open when its end was found.
        open_for: std::time::Duration,
    },

    /// Any other database error, unchanged.
    #[error(transparent)]
    Database(diesel::result::Error),

    /// A claim's closure panicked, and the claim was set to
    /// [`keep_going`](crate::ClaimBuilder::keep_going): its rows were rolled
    /// back and the call went on. Carries the panic's message.
    #[error("the closure panicked: {0}")]
    ClosurePanicked(String),

    /// A claim's closure ran past its [`timeout`](crate::ClaimBuilder::timeout):
    /// its work was rolled back and its row counted as failed (and recorded
    /// by the claim's failure hook or retry schedule, while the row was still
    /// locked). On diesel-async its future was dropped at the timeout; on a
    /// blocking connection it was treated so once it returned, and on
    /// PostgreSQL each of its statements was ended at the timeout.
    #[error("the closure ran past its timeout of {timeout:?}: its work was rolled back")]
    TimedOut {
        /// The claim's timeout.
        timeout: std::time::Duration,
    },

    /// Running the crate's embedded migrations failed.
    #[cfg(feature = "migrations")]
    #[error("migration failed: {0}")]
    Migration(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// What [`Error::BrokenConnection`] says: why the connection is unusable.
fn broken_connection(error: &diesel::result::Error) -> String {
    if let diesel::result::Error::BrokenTransactionManager = error {
        format!(
            "{error}: this connection's transaction was abandoned (a future dropped \
             mid-transaction, or a failed rollback) and may still hold its locks; drop the \
             connection and use another"
        )
    } else {
        format!(
            "the connection was closed by the server or the network ({}); drop it and use \
             another",
            one_line(error)
        )
    }
}

/// `error`'s message on one line: libpq's messages run over several, with
/// tabs, which would break a log line in two.
fn one_line(error: &dyn Display) -> String {
    error
        .to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn display_version(actual: &Option<i64>) -> String {
    match actual {
        Some(version) => version.to_string(),
        None => "an unknown version".to_owned(),
    }
}

/// A `Result` whose error is this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether retrying the whole operation may succeed: version conflicts,
    /// deadlocks and serialization failures.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::VersionConflict { .. } | Error::Deadlock(_) | Error::SerializationFailure(_)
        )
    }
}

impl From<diesel::result::Error> for Error {
    fn from(error: diesel::result::Error) -> Self {
        // The one place a database error's class is decided: its event.
        match classify(&error) {
            Some(ErrorClass::LockNotAvailable) => {
                trace::info!(%error, "lock not available");
                Error::LockNotAvailable
            }
            Some(ErrorClass::Deadlock) => {
                trace::warning!(%error, "deadlock detected");
                Error::Deadlock(error)
            }
            Some(ErrorClass::SerializationFailure) => {
                trace::debug!(%error, "serialization failure");
                Error::SerializationFailure(error)
            }
            None if matches!(error, diesel::result::Error::NotFound) => Error::NotFound,
            None if matches!(error, diesel::result::Error::BrokenTransactionManager) => {
                Error::BrokenConnection(error)
            }
            None if connection_closed(&error) => {
                trace::warning!(%error, "the connection was closed");
                Error::BrokenConnection(error)
            }
            None if lacks_skip_locked(&error) => Error::Unsupported(error),
            None => Error::Database(error),
        }
    }
}

/// A pool's error: no connection ([`Error::Checkout`]). Diesel's r2d2
/// pool, with a blocking backend (`postgres`, `sqlite`, `mysql`).
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
impl From<diesel::r2d2::PoolError> for Error {
    fn from(error: diesel::r2d2::PoolError) -> Self {
        Error::Checkout(Box::new(error))
    }
}

/// A pool's error: no connection ([`Error::Checkout`]). bb8's (feature
/// `bb8`), as diesel-async's `bb8::Pool::get` returns it.
#[cfg(feature = "bb8")]
impl<E> From<bb8::RunError<E>> for Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    fn from(error: bb8::RunError<E>) -> Self {
        Error::Checkout(Box::new(error))
    }
}

/// A pool's error: no connection ([`Error::Checkout`]). deadpool's
/// (feature `deadpool`), as diesel-async's `deadpool::Pool::get` returns it.
#[cfg(feature = "deadpool")]
impl<E> From<deadpool::managed::PoolError<E>> for Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    fn from(error: deadpool::managed::PoolError<E>) -> Self {
        Error::Checkout(Box::new(error))
    }
}

/// Converts nothing: no type implements [`Unconvertible`]. It is the impl the
/// compiler finds when `?` (or `.into()`) is asked to turn an error the crate
/// has no conversion for into an [`Error`], and its bound is what the
/// compiler then reports: a message that names the feature a pool's error
/// converts with, where there would otherwise be only "`From<…>` is not
/// implemented".
impl<T: Unconvertible> From<T> for Error {
    fn from(never: T) -> Self {
        never.into_error()
    }
}

/// An error type that `?` cannot turn into [`Error`]: implemented by no
/// type, and by none outside the crate (sealed). See `From<T>` for
/// [`Error`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not convert into `diesel_claim::Error`",
    // The label is all that `?` shows of these words, so it names the fix.
    label = "no conversion into `diesel_claim::Error`; a pool's error converts with diesel-claim's \
             feature for the pool: `bb8`, `deadpool`",
    note = "a pool's checkout error converts with diesel-claim's feature for that pool: diesel's \
            r2d2 with a blocking backend (`postgres`, `sqlite`, `mysql`), bb8's `RunError` with \
            `features = [\"bb8\"]`, deadpool's `PoolError` with `features = [\"deadpool\"]`",
    note = "for errors of your own, return a type of yours that implements \
            `From<diesel_claim::Error>` (or `anyhow::Error`)"
)]
pub trait Unconvertible: unconvertible::Sealed {
    /// Never called: there is no value to call it on.
    #[doc(hidden)]
    fn into_error(self) -> Error;
}

mod unconvertible {
    pub trait Sealed {}
}

/// Lets callers whose closures return `diesel::result::Error` use the crate: typed
/// outcomes become database errors that [`is_lock_not_available`] and friends still
/// recognise.
impl From<Error> for diesel::result::Error {
    fn from(error: Error) -> Self {
        match error {
            Error::Database(error)
            | Error::BrokenConnection(error)
            | Error::Unsupported(error)
            | Error::Deadlock(error)
            | Error::SerializationFailure(error) => error,
            Error::NotFound => diesel::result::Error::NotFound,
            Error::LockNotAvailable => diesel::result::Error::DatabaseError(
                DatabaseErrorKind::Unknown,
                Box::new(LOCK_NOT_AVAILABLE_MESSAGE.to_owned()),
            ),
            other => diesel::result::Error::DatabaseError(
                DatabaseErrorKind::Unknown,
                Box::new(other.to_string()),
            ),
        }
    }
}

/// Message of the database error that stands for [`Error::LockNotAvailable`] when it
/// is converted into a `diesel::result::Error`.
const LOCK_NOT_AVAILABLE_MESSAGE: &str = "lock not available: could not obtain lock on row";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ErrorClass {
    LockNotAvailable,
    Deadlock,
    SerializationFailure,
}

/// The one place where database errors are recognised by their text.
///
/// Diesel 2.3 maps PostgreSQL's `55P03` and `40P01` and SQLite's `SQLITE_BUSY` to
/// [`DatabaseErrorKind::Unknown`] without exposing the SQLSTATE or result code, so the
/// server's message is all there is. The messages matched here are the servers' own,
/// stable for decades, and covered by tests against the real servers.
fn classify(error: &diesel::result::Error) -> Option<ErrorClass> {
    let diesel::result::Error::DatabaseError(kind, info) = error else {
        return None;
    };
    if let DatabaseErrorKind::SerializationFailure = kind {
        // Diesel reports MySQL's deadlock (1213) as a serialization failure.
        if info.message().starts_with("Deadlock found") {
            return Some(ErrorClass::Deadlock);
        }
        return Some(ErrorClass::SerializationFailure);
    }
    if !matches!(kind, DatabaseErrorKind::Unknown) {
        return None;
    }
    classify_message(info.as_ref())
}

fn classify_message(info: &dyn DatabaseErrorInformation) -> Option<ErrorClass> {
    let message = info.message();
    // PostgreSQL 55P03: NOWAIT ("could not obtain lock on row in relation ...") and
    // lock_timeout ("canceling statement due to lock timeout"); SQLite SQLITE_BUSY;
    // MySQL and MariaDB 1205 (innodb_lock_wait_timeout, and MariaDB's NOWAIT) and
    // MySQL 3572 (NOWAIT).
    const LOCK_NOT_AVAILABLE: [&str; 6] = [
        "could not obtain lock",
        "canceling statement due to lock timeout",
        "database is locked",
        "Lock wait timeout exceeded",
        "Statement aborted because lock(s) could not be acquired immediately",
        LOCK_NOT_AVAILABLE_MESSAGE,
    ];
    // PostgreSQL 40P01; MySQL and MariaDB 1213, which diesel-async's MySQL
    // connection reports with an unknown kind.
    if message.starts_with("deadlock detected") || message.starts_with("Deadlock found") {
        Some(ErrorClass::Deadlock)
    } else if message.starts_with("could not serialize access") {
        Some(ErrorClass::SerializationFailure)
    } else if LOCK_NOT_AVAILABLE.iter().any(|m| message.starts_with(m)) {
        Some(ErrorClass::LockNotAvailable)
    } else {
        None
    }
}

/// Whether `error` says the server or the network closed the connection.
///
/// Diesel's `PgConnection` reports [`DatabaseErrorKind::ClosedConnection`]
/// when libpq finds the connection bad, but a statement that could not be
/// sent, or whose answer never came, carries only libpq's message; the
/// MySQL connections and diesel-async's report every one by its client's
/// message. These are the clients' own, stable texts, covered by tests that
/// end sessions on the real servers.
fn connection_closed(error: &diesel::result::Error) -> bool {
    let diesel::result::Error::DatabaseError(kind, info) = error else {
        return false;
    };
    if let DatabaseErrorKind::ClosedConnection = kind {
        return true;
    }
    if !matches!(
        kind,
        DatabaseErrorKind::Unknown | DatabaseErrorKind::UnableToSendCommand
    ) {
        return false;
    }
    let message = info.message();
    // libpq ("server closed the connection unexpectedly", "SSL connection has
    // been closed unexpectedly", "no connection to the server"); PostgreSQL's
    // FATAL errors that end a session (57P01 "terminating connection due to
    // administrator command", idle and recovery timeouts); tokio-postgres'
    // "connection closed" and "error communicating with the server: …";
    // mysql_async's "Connection to the server is closed." and "Input/output
    // error: …"; libmysqlclient's and MariaDB's 2013 "Lost connection to
    // (MySQL) server …", 2006 "(MySQL) server has gone away" and 1927
    // "Connection was killed".
    const PREFIXES: [&str; 6] = [
        "terminating connection",
        "no connection to the server",
        "connection closed",
        "error communicating with the server",
        "Lost connection to",
        "Connection was killed",
    ];
    const ANYWHERE: [&str; 5] = [
        "closed the connection unexpectedly",
        "connection has been closed unexpectedly",
        "server has gone away",
        "connection to the server is closed",
        "input/output error",
    ];
    let lowercase = message.to_ascii_lowercase();
    PREFIXES.iter().any(|prefix| message.starts_with(prefix))
        || ANYWHERE.iter().any(|text| lowercase.contains(text))
}

/// Whether `error` is MySQL's or MariaDB's syntax error (1064) at `SKIP LOCKED`
/// or `NOWAIT`: a server older than MySQL 8.0.1 or MariaDB 10.6.
fn lacks_skip_locked(error: &diesel::result::Error) -> bool {
    let diesel::result::Error::DatabaseError(DatabaseErrorKind::Unknown, info) = error else {
        return false;
    };
    let message = info.message().to_ascii_lowercase();
    message.starts_with("you have an error in your sql syntax")
        && ["near 'skip locked", "near 'nowait"]
            .iter()
            .any(|clause| message.contains(clause))
}

/// Whether `error` means a lock could not be taken: PostgreSQL `55P03` (`NOWAIT`,
/// `lock_timeout`), SQLite `SQLITE_BUSY` (`busy_timeout` elapsed), MySQL and
/// MariaDB 1205 (`innodb_lock_wait_timeout`; MariaDB's `NOWAIT`) and MySQL 3572
/// (`NOWAIT`).
pub fn is_lock_not_available(error: &diesel::result::Error) -> bool {
    classify(error) == Some(ErrorClass::LockNotAvailable)
}

/// Whether `error` is a deadlock the database broke by aborting this transaction
/// (PostgreSQL `40P01`, MySQL and MariaDB 1213).
pub fn is_deadlock(error: &diesel::result::Error) -> bool {
    classify(error) == Some(ErrorClass::Deadlock)
}

/// Whether a closure's error, of whatever type, says that the database rolled
/// the closure's transaction back to break a deadlock or a serialization
/// conflict: this crate's [`Error::Deadlock`] or [`Error::SerializationFailure`],
/// or a `diesel::result::Error` of either class. Running the transaction again
/// may succeed; a worker does (see `Backoff::record`).
pub(crate) fn rolled_back_by_the_database<E: 'static>(error: &E) -> bool {
    let error: &dyn Any = error;
    if let Some(error) = error.downcast_ref::<Error>() {
        return matches!(error, Error::Deadlock(_) | Error::SerializationFailure(_));
    }
    error
        .downcast_ref::<diesel::result::Error>()
        .and_then(classify)
        .is_some_and(|class| {
            matches!(
                class,
                ErrorClass::Deadlock | ErrorClass::SerializationFailure
            )
        })
}

/// Whether `error` is PostgreSQL's serialization failure of a row that a
/// concurrent transaction moved to another partition of a partitioned table
/// ("tuple to be locked was already moved to another partition due to
/// concurrent update", and its `updated`/`deleted` twins): the row has left
/// the partition it was read in, so a fresh statement no longer sees it there.
pub(crate) fn moved_to_another_partition(error: &diesel::result::Error) -> bool {
    let diesel::result::Error::DatabaseError(DatabaseErrorKind::SerializationFailure, info) = error
    else {
        return false;
    };
    let message = info.message();
    message.starts_with("tuple to be ") && message.contains("already moved to another partition")
}

/// Whether `error` is a serialization failure (SQLSTATE `40001`).
pub fn is_serialization_failure(error: &diesel::result::Error) -> bool {
    classify(error) == Some(ErrorClass::SerializationFailure)
}

#[cfg(test)]
mod tests;
