//! How a connection waits for new rows between a worker's claims: polling,
//! or PostgreSQL's `LISTEN`; and `notify`, which wakes listening workers.

use std::time::Duration;

use diesel::connection::LoadConnection;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
use diesel::r2d2::{ConnectionManager, PooledConnection, R2D2Connection};

use super::worker::StopHandle;
use crate::Error;

/// How a connection waits for new rows between a worker's claims.
///
/// Implemented for Diesel's connections and their r2d2 pooled connections:
/// PostgreSQL listens for notifications, the others sleep.
#[diagnostic::on_unimplemented(
    message = "a blocking claim worker cannot wait for rows on `{Self}`",
    note = "blocking workers run on Diesel's connections and their r2d2 pooled connections; on a \
            diesel-async connection, import `diesel_claim::aio::prelude::*` in place of \
            `diesel_claim::prelude::*`"
)]
pub trait WaitForRows: LoadConnection {
    /// Starts listening on `channel`: PostgreSQL `LISTEN`; elsewhere
    /// [`Error::InvalidArgument`].
    fn listen(&mut self, channel: &str) -> Result<(), Error>;

    /// Stops listening on `channel`.
    fn unlisten(&mut self, channel: &str) -> Result<(), Error>;

    /// Waits up to `timeout`, less if `stop` is triggered or (when listening)
    /// a notification arrives; whether one did. Notifications that arrived
    /// before count too.
    fn wait_for_rows(&mut self, timeout: Duration, stop: &StopHandle) -> Result<bool, Error>;
}

#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
/// How often a waiting worker looks at its stop handle (and, on PostgreSQL,
/// at its socket for notifications: a read, no round trip).
const WAKE_UP_EVERY: Duration = Duration::from_millis(1);

/// A worker's wait between claims, in both APIs: until a deadline, cut short
/// by its stop handle.
#[cfg(any(
    feature = "postgres",
    feature = "sqlite",
    feature = "mysql",
    all(
        feature = "async",
        any(feature = "postgres_backend", feature = "mysql_backend")
    )
))]
pub(crate) struct Wait<'a> {
    deadline: std::time::Instant,
    stop: &'a StopHandle,
}

#[cfg(any(
    feature = "postgres",
    feature = "sqlite",
    feature = "mysql",
    all(
        feature = "async",
        any(feature = "postgres_backend", feature = "mysql_backend")
    )
))]
impl<'a> Wait<'a> {
    pub(crate) fn new(timeout: Duration, stop: &'a StopHandle) -> Self {
        Wait {
            deadline: std::time::Instant::now() + timeout,
            stop,
        }
    }

    /// How long to sleep before looking again, at most `step`; `None` once
    /// the wait is over or stopped.
    pub(crate) fn next_step(&self, step: Duration) -> Option<Duration> {
        let left = self
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        (!left.is_zero() && !self.stop.is_stopped()).then(|| left.min(step))
    }
}

#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
/// Sleeps up to `timeout` in short steps, until `stop` is triggered or
/// `notified` says so; whether it did.
fn wait_until(
    timeout: Duration,
    stop: &StopHandle,
    mut notified: impl FnMut() -> Result<bool, Error>,
) -> Result<bool, Error> {
    let wait = Wait::new(timeout, stop);
    loop {
        if notified()? {
            return Ok(true);
        }
        let Some(pause) = wait.next_step(WAKE_UP_EVERY) else {
            return Ok(false);
        };
        std::thread::sleep(pause);
    }
}

#[cfg(any(
    feature = "sqlite",
    feature = "mysql",
    all(feature = "async", feature = "mysql_backend")
))]
pub(crate) fn no_notifications(channel: &str) -> Result<(), Error> {
    Err(Error::InvalidArgument(format!(
        "cannot listen on {channel:?}: LISTEN and NOTIFY are PostgreSQL's; poll instead"
    )))
}

/// A channel name PostgreSQL accepts: an identifier of at most 63 bytes.
pub(crate) fn check_channel(channel: &str) -> Result<(), Error> {
    if channel.is_empty() || channel.len() > 63 || channel.contains('\0') {
        return Err(Error::InvalidArgument(format!(
            "a notification channel is 1 to 63 bytes without NUL, got {channel:?}"
        )));
    }
    Ok(())
}

/// `channel` as a quoted identifier, for `LISTEN` and `UNLISTEN`.
#[cfg(any(
    feature = "postgres",
    all(feature = "async", feature = "postgres_backend")
))]
pub(crate) fn quoted(channel: &str) -> String {
    format!("\"{}\"", channel.replace('"', "\"\""))
}

#[cfg(feature = "postgres")]
mod pg {
    use diesel::connection::SimpleConnection;
    use diesel::PgConnection;

    use super::*;

    impl WaitForRows for PgConnection {
        fn listen(&mut self, channel: &str) -> Result<(), Error> {
            check_channel(channel)?;
            Ok(self.batch_execute(&format!("LISTEN {}", quoted(channel)))?)
        }

        fn unlisten(&mut self, channel: &str) -> Result<(), Error> {
            check_channel(channel)?;
            Ok(self.batch_execute(&format!("UNLISTEN {}", quoted(channel)))?)
        }

        fn wait_for_rows(&mut self, timeout: Duration, stop: &StopHandle) -> Result<bool, Error> {
            wait_until(timeout, stop, || {
                let mut notified = false;
                // Every notification waiting: one claim serves them all.
                for notification in self.notifications_iter() {
                    notification?;
                    notified = true;
                }
                Ok(notified)
            })
        }
    }
}

/// Sends a notification on `channel`, for workers that
/// [listen](crate::ClaimWorker::listen) on it: in the transaction that writes
/// the rows, PostgreSQL delivers it when that commits. A trigger can send
/// it instead: `PERFORM pg_notify('channel', '')` in a function run
/// `AFTER INSERT … FOR EACH STATEMENT`.
#[cfg(feature = "postgres_backend")]
pub fn notify<C>(conn: &mut C, channel: &str) -> Result<(), Error>
where
    C: diesel::Connection<Backend = diesel::pg::Pg>,
{
    use diesel::RunQueryDsl;

    check_channel(channel)?;
    diesel::sql_query("SELECT pg_notify($1, '')")
        .bind::<diesel::sql_types::Text, _>(channel)
        .execute(conn)?;
    Ok(())
}

/// Connections without notifications: waiting is sleeping.
#[cfg(any(feature = "sqlite", feature = "mysql"))]
macro_rules! sleeps_while_waiting {
    ($($conn:ty),*) => {$(
        impl WaitForRows for $conn {
            fn listen(&mut self, channel: &str) -> Result<(), Error> {
                no_notifications(channel)
            }

            fn unlisten(&mut self, channel: &str) -> Result<(), Error> {
                no_notifications(channel)
            }

            fn wait_for_rows(&mut self, timeout: Duration, stop: &StopHandle) -> Result<bool, Error> {
                wait_until(timeout, stop, || Ok(false))
            }
        }
    )*};
}

#[cfg(feature = "sqlite")]
sleeps_while_waiting!(diesel::SqliteConnection);
#[cfg(feature = "mysql")]
sleeps_while_waiting!(diesel::MysqlConnection);

#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
impl<C> WaitForRows for PooledConnection<ConnectionManager<C>>
where
    C: WaitForRows + R2D2Connection + Send + 'static,
    PooledConnection<ConnectionManager<C>>: LoadConnection,
{
    fn listen(&mut self, channel: &str) -> Result<(), Error> {
        (**self).listen(channel)
    }

    fn unlisten(&mut self, channel: &str) -> Result<(), Error> {
        (**self).unlisten(channel)
    }

    fn wait_for_rows(&mut self, timeout: Duration, stop: &StopHandle) -> Result<bool, Error> {
        (**self).wait_for_rows(timeout, stop)
    }
}
