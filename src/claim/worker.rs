//! A claim run over and over until stopped: the worker loop, the stop handle,
//! and how a connection waits for new rows (polling, or PostgreSQL's `LISTEN`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel::connection::LoadConnection;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
use diesel::r2d2::{ConnectionManager, PooledConnection, R2D2Connection};

use super::{per_row, ClaimBuilder, ClaimOutcome, ClaimQuery, ClaimReport};
use crate::backend::ClaimBackend;
use crate::trace::{self, Span};
use crate::Error;

/// Asks claims and workers to stop: cloneable, shared between threads, and
/// safe to trigger from a signal handler (triggering is one atomic store).
///
/// A claim given it ([`ClaimBuilder::stop_on`]) ends before its next
/// statement, once the row or batch in hand has committed; a
/// [`ClaimWorker`] also stops waiting for new rows.
///
/// A handle made from a flag is triggered when the flag is set, by whatever
/// sets it: with the `signal-hook` crate,
/// `signal_hook::flag::register(SIGTERM, flag.clone())` and
/// `StopHandle::from(flag)` stop the workers on `SIGTERM`.
#[derive(Debug, Clone, Default)]
pub struct StopHandle(Arc<AtomicBool>);

impl StopHandle {
    /// A handle not yet triggered.
    pub fn new() -> Self {
        StopHandle::default()
    }

    /// Asks everything holding a clone of this handle to stop.
    pub fn stop(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Whether [`stop`](Self::stop) was called on this handle or a clone.
    pub fn is_stopped(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

impl From<Arc<AtomicBool>> for StopHandle {
    /// A handle triggered when `flag` is set.
    fn from(flag: Arc<AtomicBool>) -> Self {
        StopHandle(flag)
    }
}

/// A claim that runs over and over until stopped, made by
/// [`ClaimBuilder::worker`]: it claims what is pending, and when nothing is,
/// waits — polling, from every `min` up to every `max` while it stays idle
/// ([`poll_interval`](Self::poll_interval)), and on PostgreSQL woken at once
/// by a notification on a channel ([`listen`](Self::listen)).
///
/// [`StopHandle::stop`] ends it gracefully: the row or batch in hand is
/// finished and committed, and [`run`](Self::run) returns the report of
/// everything the worker did. A closure's error ends it too, unless the claim
/// [keeps going](ClaimBuilder::keep_going): with it, a failing row is counted
/// and tried again no sooner than the next poll.
///
/// ```
/// # include!("../doctest_setup.rs");
/// use std::time::Duration;
/// use diesel_claim::prelude::*;
/// use diesel_claim::StopHandle;
///
/// # fn main() -> Result<(), diesel_claim::Error> {
/// # let mut conn = establish_connection();
/// let stop = StopHandle::new();
/// // Elsewhere, on SIGTERM: stop.stop()
/// # let stopper = stop.clone();
/// let pending = orders::table.filter(orders::shipped.eq(true)).filter(orders::email_sent.eq(false));
/// let report = pending
///     .build_claim()
///     .keep_going()
///     .worker(&stop)
///     .poll_interval(Duration::from_millis(10), Duration::from_secs(1))
///     .run(&mut conn, |conn, order: Order| {
///         diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
///         # stopper.stop();
///         Ok::<_, diesel_claim::Error>(())
///     })?;
/// assert_eq!(report.processed, 1);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a worker does nothing until `.run(conn, f)` runs it"]
pub struct ClaimWorker<Q, M = crate::Blocking> {
    pub(crate) claim: ClaimBuilder<Q, M>,
    pub(crate) stop: StopHandle,
    pub(crate) min_poll: Duration,
    pub(crate) max_poll: Duration,
    pub(crate) channel: Option<String>,
}

impl<Q, M> ClaimWorker<Q, M> {
    pub(crate) fn new(claim: ClaimBuilder<Q, M>, stop: StopHandle) -> Self {
        ClaimWorker {
            claim,
            stop,
            min_poll: Duration::from_millis(10),
            max_poll: Duration::from_secs(1),
            channel: None,
        }
    }

    /// How long to wait between claims while nothing is pending: `min` after
    /// rows were found, doubling on every empty claim up to `max` (by default
    /// 10 ms up to 1 s). With [`listen`](Self::listen), the polls are the
    /// fallback for a notification that was never sent.
    pub fn poll_interval(mut self, min: Duration, max: Duration) -> Self {
        self.min_poll = min;
        self.max_poll = max;
        self
    }

    /// Listens on `channel` (PostgreSQL `LISTEN`), and claims at once when a
    /// notification arrives instead of waiting for the next poll. Send one
    /// with the rows, in their transaction ([`notify`](crate::notify), or a
    /// trigger). Other backends refuse it with [`Error::InvalidArgument`].
    pub fn listen(mut self, channel: &str) -> Self {
        self.channel = Some(channel.to_owned());
        self
    }

    /// The options, checked before anything is sent.
    pub(crate) fn check(&self) -> Result<(), Error> {
        if self.min_poll.is_zero() || self.min_poll > self.max_poll {
            return Err(Error::InvalidArgument(format!(
                "poll_interval needs 0 < min <= max, got {:?} and {:?}",
                self.min_poll, self.max_poll
            )));
        }
        if let Some(channel) = &self.channel {
            check_channel(channel)?;
        }
        Ok(())
    }

    /// The span of the worker's loop, around its claims' spans.
    pub(crate) fn span(&self) -> Span {
        trace::info_span!(
            "worker",
            channel = self.channel.as_deref(),
            min_poll = ?self.min_poll,
            max_poll = ?self.max_poll,
            processed = trace::Empty,
            failed = trace::Empty,
        )
    }

    /// The wait after a claim that processed `processed` rows: none after
    /// rows were found, else `pause`, doubled for the next time.
    pub(crate) fn next_pause(&self, processed: u64, pause: &mut Duration) -> Option<Duration> {
        if processed > 0 {
            *pause = self.min_poll;
            return None;
        }
        let now = *pause;
        *pause = (now * 2).min(self.max_poll);
        Some(now)
    }
}

impl<Q> ClaimWorker<Q> {
    /// Runs the worker until stopped, calling `f` for every claimed row as
    /// [`ClaimBuilder::each`] does; returns the report of everything it did.
    pub fn run<'q, C, R, E, F>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Q: ClaimQuery<'q, C, R>,
        C: WaitForRows,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        let mut f = per_row(f);
        self.serve(conn, |conn| self.claim.run(conn, &mut f))
    }
}

impl<Q> ClaimWorker<Q> {
    /// The worker loop, blocking: runs `claim_once` until stopped, waiting
    /// between runs that found nothing, listening on the channel if one was
    /// given; returns the report of all the runs.
    pub(crate) fn serve<C, K, E>(
        &self,
        conn: &mut C,
        mut claim_once: impl FnMut(&mut C) -> ClaimOutcome<K, E>,
    ) -> Result<ClaimReport, E>
    where
        C: WaitForRows,
        E: From<Error>,
    {
        let span = self.span();
        let _entered = span.enter();
        self.check()?;
        if let Some(channel) = &self.channel {
            conn.listen(channel)?;
        }
        let mut worked = || {
            let mut total = ClaimReport::default();
            let mut pause = self.min_poll;
            while !self.stop.is_stopped() {
                let outcome = claim_once(conn);
                total.add(&outcome.report);
                if let Some(failure) = outcome.stopped {
                    return Err(failure.error);
                }
                if let Some(wait) = self.next_pause(outcome.report.processed, &mut pause) {
                    if conn.wait_for_rows(wait, &self.stop)? {
                        pause = self.min_poll;
                    }
                }
            }
            Ok(total)
        };
        let worked = worked();
        if let Some(channel) = &self.channel {
            // A pooled connection goes back to the pool without it.
            let unlistened = conn.unlisten(channel);
            if worked.is_ok() {
                unlistened?;
            }
        }
        if let Ok(total) = &worked {
            span.record("processed", total.processed)
                .record("failed", total.failed);
        }
        worked
    }
}

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
/// [listen](ClaimWorker::listen) on it: in the transaction that writes
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
