//! The worker loop on a diesel-async connection: the blocking
//! [`ClaimWorker`]'s twin, waiting with tokio timers and, on PostgreSQL,
//! diesel-async's notification stream.

use std::fmt::{Debug, Display};
use std::future::Future;
use std::hash::Hash;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use diesel_async::AsyncConnection;
use futures_util::future::BoxFuture;

use super::backend::AsyncBackend;
use super::claim::{Closure, PerRow};
use super::closure::AsyncFnMut2;
use super::kind::{FailureHook, Takes};
use super::pooled::{BoundFired, OrFails};
use super::Async;
#[cfg(any(feature = "postgres_backend", feature = "mysql_backend"))]
use crate::claim::wait::Wait;
use crate::claim::worker::{
    tally, Backoff, Labels, LeftOut, Polling, WorkerError, NOTHING_PENDING, STOPPED,
};
use crate::trace::Instrument;
use crate::{ClaimBuilder, ClaimOutcome, ClaimReport, ClaimWorker, Error, RowFailure, StopHandle};

/// How often a waiting worker looks at its stop handle.
#[cfg(any(feature = "postgres_backend", feature = "mysql_backend"))]
const STOP_CHECK_EVERY: Duration = Duration::from_millis(5);

impl<Q, T, H> ClaimWorker<ClaimBuilder<Q, Async, T, H>> {
    /// The idle bound of the worker's claims: see
    /// [`ClaimBuilder::idle_bound`](crate::ClaimBuilder::idle_bound). A
    /// worker whose jobs await something slow inside their claims needs a
    /// bound above the longest, or `None`.
    pub fn idle_bound(mut self, bound: impl Into<Option<Duration>>) -> Self {
        self.claim = self.claim.idle_bound(bound);
        self
    }

    /// Runs the worker until stopped, awaiting `f` for every claimed row:
    /// see the blocking [`ClaimWorker`] (its error type shows itself, for
    /// the worker's events). Idle, it waits with tokio timers; listening
    /// (PostgreSQL), it wakes when diesel-async receives the notification.
    pub fn run<'a, C, I, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        Q: Send + Sync + 'a,
        T: Takes<'a, Q, C, I> + 'a,
        H: FailureHook<C, I, T::Row, E> + 'a,
        C: WaitForRows,
        C::Backend: AsyncBackend,
        I: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, I) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, I, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: WorkerError + Send,
    {
        async move {
            let ClaimWorker { mut claim, polling } = self;
            serve(&polling, conn, &mut Runs::new(&mut claim, PerRow(f))).await
        }
    }
}

/// One claim of a worker's loop, run over and over on a connection `C`,
/// leaving out the rows the worker backs off from (and on a pool, those the
/// other loops hold).
pub(super) trait ClaimOnce<C>: Send {
    type Key: Clone + Eq + Hash + Debug + Send;
    type Error;

    /// The claimed table and the worker's name, for the worker's events and
    /// metrics.
    fn labels(&self) -> Labels;

    fn claim_once<'c>(
        &'c mut self,
        conn: &'c mut C,
        left_out: LeftOut<'c, Self::Key, Self::Error>,
    ) -> BoxFuture<'c, ClaimOutcome<Self::Key, Self::Error>>;

    /// Records the failure of the rows at `keys`, which a run handed over on
    /// a session the server ended under them when the transaction outlived
    /// its idle bound (`fired`): a run of the claim taking those rows alone,
    /// if they still match and nobody holds them, whose closure fails at
    /// once, so that the failure path records it under each row's lock.
    /// `None` when the claim has no failure hook or schedule to record it
    /// with.
    fn record_failures<'c>(
        &'c mut self,
        conn: &'c mut C,
        keys: Vec<Self::Key>,
        fired: BoundFired,
    ) -> Option<BoxFuture<'c, ClaimOutcome<Self::Key, Self::Error>>>;
}

/// A claim whose rows go to the closure `f`, once per
/// [`claim_once`](ClaimOnce::claim_once). (`'a`, `I` and `E` are the
/// claim's: its future holds them.)
pub(super) struct Runs<'w, 'a, B, F, I, E> {
    claim: &'w mut B,
    f: OrFails<F>,
    types: PhantomData<Holds<'a, I, E>>,
}

impl<'w, B, F, I, E> Runs<'w, '_, B, F, I, E> {
    pub(super) fn new(claim: &'w mut B, f: F) -> Self {
        Runs {
            claim,
            f: OrFails { f, failing: None },
            types: PhantomData,
        }
    }
}

/// The lifetime and the row and error types a claim's future holds.
pub(super) type Holds<'a, I, E> = (&'a (), fn() -> (I, E));

impl<'a, Q, T, H, C, I, E, F> ClaimOnce<C> for Runs<'_, 'a, ClaimBuilder<Q, Async, T, H>, F, I, E>
where
    Q: Send + Sync + 'a,
    T: Takes<'a, Q, C, I> + 'a,
    H: FailureHook<C, I, T::Row, E> + 'a,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    I: Send + 'a,
    F: Closure<C, I, E> + 'a,
    E: From<Error> + Send + 'a,
{
    type Key = T::Key;
    type Error = E;

    fn labels(&self) -> Labels {
        self.claim.options.worker_labels(T::table_name())
    }

    fn claim_once<'c>(
        &'c mut self,
        conn: &'c mut C,
        left_out: LeftOut<'c, T::Key, E>,
    ) -> BoxFuture<'c, ClaimOutcome<T::Key, E>> {
        // Set for every claim: a run recording failures may have been
        // dropped before it ended.
        self.f.failing = None;
        Box::pin(self.claim.run_once(conn, &mut self.f, left_out))
    }

    fn record_failures<'c>(
        &'c mut self,
        conn: &'c mut C,
        keys: Vec<T::Key>,
        fired: BoundFired,
    ) -> Option<BoxFuture<'c, ClaimOutcome<T::Key, E>>> {
        if !H::SET {
            return None;
        }
        let left_out = LeftOut {
            only: Some(keys),
            ..LeftOut::nothing()
        };
        self.f.failing = Some(fired);
        Some(Box::pin(self.claim.run_once(conn, &mut self.f, left_out)))
    }
}

/// The worker loop: runs `once` until stopped, leaving out the rows it backs
/// off from, waiting when it claimed nothing; the twin of the blocking
/// `Polling::serve`.
async fn serve<C, K, E>(
    polling: &Polling,
    conn: &mut C,
    once: &mut (dyn ClaimOnce<C, Key = K, Error = E> + '_),
) -> Result<ClaimReport, E>
where
    C: WaitForRows,
    K: Clone + Eq + Hash + Debug + Send,
    E: From<Error> + Display + 'static,
{
    let labels = once.labels();
    let span = polling.span(&labels);
    let totals = span.clone();
    let worked = async {
        polling.check(false, &labels)?;
        let events = polling.events(labels);
        let tell = |keys: &[K], error: &E| events.passed_over(keys, error);
        let outside = |error: Error| RowFailure::new(Vec::new(), E::from(error));
        let worked: Result<(ClaimReport, &str), RowFailure<K, E>> = async {
            if let Some(channel) = &polling.channel {
                conn.listen(channel).await.map_err(outside)?;
            }
            let mut total = ClaimReport::default();
            let mut pause = polling.min_poll;
            let backoff = Backoff::new(polling.backoff);
            loop {
                if polling.stop.is_stopped() {
                    return Ok((total, STOPPED));
                }
                let outcome = once
                    .claim_once(conn, LeftOut::backed_off(&backoff, &tell))
                    .await;
                let took = tally(&mut total, outcome, &events)?;
                if polling.until_empty && !took {
                    return Ok((total, NOTHING_PENDING));
                }
                if let Some(wait) = polling.next_pause(took, &mut pause) {
                    let waiting = Instant::now();
                    let woken = conn.wait_for_rows(wait, &polling.stop).await;
                    events.idled(waiting.elapsed());
                    if woken.map_err(outside)? {
                        pause = polling.min_poll;
                    }
                }
            }
        }
        .await;
        Polling::ended(&totals, &events, &worked);
        if let Some(channel) = &polling.channel {
            // A pooled connection goes back to the pool without it.
            let unlistened = conn.unlisten(channel).await;
            if worked.is_ok() {
                unlistened?;
            }
        }
        worked
            .map(|(total, _)| total)
            .map_err(|failure| failure.error)
    }
    .instrument(span)
    .await;
    worked
}

/// How a diesel-async connection waits for new rows between a worker's
/// claims: the async twin of [`crate::WaitForRows`], implemented for
/// `AsyncPgConnection` (which listens) and `AsyncMysqlConnection` (which
/// sleeps), and (features `bb8` and `deadpool`) for their connections from
/// diesel-async's pools.
#[diagnostic::on_unimplemented(
    message = "an async claim worker cannot wait for rows on `{Self}`",
    note = "async workers run on diesel-async's `AsyncPgConnection` and `AsyncMysqlConnection`, \
            and on their connections from bb8 and deadpool pools with diesel-claim's feature of \
            the same name: `features = [\"bb8\"]` or `features = [\"deadpool\"]`",
    note = "on one of Diesel's blocking connections, import `diesel_claim::prelude::*` in place \
            of `diesel_claim::aio::prelude::*`"
)]
pub trait WaitForRows: AsyncConnection {
    /// Starts listening on `channel`: PostgreSQL `LISTEN`; elsewhere
    /// [`Error::InvalidArgument`].
    fn listen(&mut self, channel: &str) -> impl Future<Output = Result<(), Error>> + Send;

    /// Stops listening on `channel`.
    fn unlisten(&mut self, channel: &str) -> impl Future<Output = Result<(), Error>> + Send;

    /// Waits up to `timeout`, less if `stop` is triggered or (when listening)
    /// a notification arrives; whether one did. Notifications that arrived
    /// before count too.
    fn wait_for_rows(
        &mut self,
        timeout: Duration,
        stop: &StopHandle,
    ) -> impl Future<Output = Result<bool, Error>> + Send;
}

/// Sleeps up to `timeout` in short steps, until `stop` is triggered.
#[cfg(feature = "mysql_backend")]
async fn sleep_until_stopped(timeout: Duration, stop: &StopHandle) {
    let wait = Wait::new(timeout, stop);
    while let Some(pause) = wait.next_step(STOP_CHECK_EVERY) {
        tokio::time::sleep(pause).await;
    }
}

/// Sends a notification on `channel`, for async workers that
/// [listen](crate::ClaimWorker::listen) on it (and blocking ones): the twin
/// of [`crate::notify`]. Sent in the transaction that writes the rows, it is
/// delivered when that commits, so a woken worker finds them.
///
/// ```no_run
/// # #[cfg(feature = "postgres_backend")]
/// # async fn enqueue(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), diesel_claim::Error> {
/// use diesel_async::AsyncConnection;
/// use diesel_claim::aio::prelude::*;
///
/// conn.transaction(async |conn| {
///     // … insert the jobs …
///     diesel_claim::aio::notify(conn, "jobs").await
/// })
/// .await
/// # }
/// ```
#[cfg(feature = "postgres_backend")]
pub fn notify<'c, C>(
    conn: &'c mut C,
    channel: &'c str,
) -> impl Future<Output = Result<(), Error>> + Send + 'c
where
    C: AsyncConnection<Backend = diesel::pg::Pg>,
{
    use diesel_async::RunQueryDsl;

    async move {
        crate::claim::wait::check_channel(channel)?;
        diesel::sql_query("SELECT pg_notify($1, '')")
            .bind::<diesel::sql_types::Text, _>(channel)
            .execute(conn)
            .await?;
        Ok(())
    }
}

#[cfg(feature = "postgres_backend")]
mod pg {
    use std::pin::pin;

    use futures_util::future::{self, Either};
    use futures_util::{FutureExt, StreamExt};

    use super::*;
    use crate::claim::wait::{check_channel, quoted};

    /// Runs `LISTEN` or `UNLISTEN` (`verb`) on `channel`.
    async fn listening(
        conn: &mut diesel_async::AsyncPgConnection,
        verb: &str,
        channel: &str,
    ) -> Result<(), Error> {
        check_channel(channel)?;
        let sql = format!("{verb} {}", quoted(channel));
        Ok(diesel_async::SimpleAsyncConnection::batch_execute(conn, &sql).await?)
    }

    impl WaitForRows for diesel_async::AsyncPgConnection {
        fn listen(&mut self, channel: &str) -> impl Future<Output = Result<(), Error>> + Send {
            listening(self, "LISTEN", channel)
        }

        fn unlisten(&mut self, channel: &str) -> impl Future<Output = Result<(), Error>> + Send {
            listening(self, "UNLISTEN", channel)
        }

        fn wait_for_rows(
            &mut self,
            timeout: Duration,
            stop: &StopHandle,
        ) -> impl Future<Output = Result<bool, Error>> + Send {
            async move {
                let wait = Wait::new(timeout, stop);
                let mut notifications = pin!(self.notifications_stream());
                let mut notified = false;
                // Every notification waiting: one claim serves them all.
                while let Some(Some(notification)) = notifications.next().now_or_never() {
                    notification?;
                    notified = true;
                }
                while !notified {
                    let Some(pause) = wait.next_step(STOP_CHECK_EVERY) else {
                        break;
                    };
                    let pause = pin!(tokio::time::sleep(pause));
                    match future::select(notifications.next(), pause).await {
                        Either::Left((Some(notification), _)) => {
                            notification?;
                            notified = true;
                        }
                        // The connection's task has ended: the next claim will
                        // say why.
                        Either::Left((None, _)) => break,
                        Either::Right(_) => {}
                    }
                }
                Ok(notified)
            }
        }
    }
}

#[cfg(feature = "mysql_backend")]
impl WaitForRows for diesel_async::AsyncMysqlConnection {
    fn listen(&mut self, channel: &str) -> impl Future<Output = Result<(), Error>> + Send {
        futures_util::future::ready(crate::claim::wait::no_notifications(channel))
    }

    fn unlisten(&mut self, channel: &str) -> impl Future<Output = Result<(), Error>> + Send {
        futures_util::future::ready(crate::claim::wait::no_notifications(channel))
    }

    fn wait_for_rows(
        &mut self,
        timeout: Duration,
        stop: &StopHandle,
    ) -> impl Future<Output = Result<bool, Error>> + Send {
        async move {
            sleep_until_stopped(timeout, stop).await;
            Ok(false)
        }
    }
}

/// A pool's connection waits as the connection it holds.
macro_rules! waits_as_its_connection {
    ($feature:literal, $pooled:ty, $manager:path, $held:ident) => {
        #[cfg(feature = $feature)]
        impl<M> WaitForRows for $pooled
        where
            M: $manager,
            M::$held: WaitForRows,
        {
            fn listen(&mut self, channel: &str) -> impl Future<Output = Result<(), Error>> + Send {
                (**self).listen(channel)
            }

            fn unlisten(
                &mut self,
                channel: &str,
            ) -> impl Future<Output = Result<(), Error>> + Send {
                (**self).unlisten(channel)
            }

            fn wait_for_rows(
                &mut self,
                timeout: Duration,
                stop: &StopHandle,
            ) -> impl Future<Output = Result<bool, Error>> + Send {
                (**self).wait_for_rows(timeout, stop)
            }
        }
    };
}

waits_as_its_connection!(
    "bb8",
    bb8::PooledConnection<'_, M>,
    bb8::ManageConnection,
    Connection
);
waits_as_its_connection!(
    "deadpool",
    deadpool::managed::Object<M>,
    deadpool::managed::Manager,
    Type
);
