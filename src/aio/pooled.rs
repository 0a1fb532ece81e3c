//! The async worker on a bb8 or deadpool pool: the twin of the blocking
//! `run_pooled`, its claim loops futures of one future (`run_pooled`) or
//! each on a task of its own (`spawn_pooled`), its listener on a connection
//! the pool makes outside its own count.

use std::borrow::Borrow;
use std::fmt::{Debug, Display};
use std::future::Future;
use std::hash::Hash;
use std::ops::DerefMut;
use std::pin::pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::{AsyncConnection, SimpleAsyncConnection};
use futures_util::future::{self, BoxFuture, Either};

use super::backend::AsyncBackend;
use super::claim::{Closure, PerRow};
use super::closure::AsyncFnMut2;
use super::kind::{FailureHook, Takes};
use super::worker::{ClaimOnce, Runs, WaitForRows};
use super::Async;
use crate::claim::siblings::{Sibling, Siblings};
use crate::claim::worker::on_a_pool::{summed, Reconnect, Shared};
use crate::claim::worker::{tally, Backoff, ClaimPerLoop, Labels, LeftOut, Polling, WorkerError};
use crate::metrics::ClaimMetrics;
use crate::sql::Position;
use crate::trace::{Instrument, WorkerTrace};
use crate::{ClaimBuilder, ClaimReport, ClaimWorker, Error, RowFailure, StopHandle};

/// A pool an async worker runs on: diesel-async's bb8 pool (feature `bb8`)
/// and deadpool pool (feature `deadpool`). Sealed.
#[diagnostic::on_unimplemented(
    message = "an async worker cannot run on `{Self}`",
    label = "not a pool diesel-claim runs workers on",
    note = "async workers run on diesel-async's bb8 and deadpool pools, with diesel-claim's \
            feature of the same name: `features = [\"bb8\"]` or `features = [\"deadpool\"]`"
)]
pub trait WorkerPool: Sync + private::Sealed {
    /// The connection the pool holds.
    type Connection: WaitForRows + Send;

    /// A connection checked out of the pool, going back when dropped.
    type Pooled<'p>: DerefMut<Target = Self::Connection> + Send
    where
        Self: 'p;

    /// Checks a connection out; [`Error::Checkout`] when the pool gives none.
    #[doc(hidden)]
    fn check_out(&self) -> impl Future<Output = Result<Self::Pooled<'_>, Error>> + Send;

    /// A new connection of the pool's kind that is not counted in the pool:
    /// the listener's, held for as long as the worker runs;
    /// [`Error::Checkout`] when it cannot be made.
    #[doc(hidden)]
    fn connect(&self) -> impl Future<Output = Result<Self::Connection, Error>> + Send;
}

mod private {
    pub trait Sealed {}
}

#[cfg(feature = "bb8")]
impl<M> private::Sealed for bb8::Pool<M> where M: bb8::ManageConnection {}

#[cfg(feature = "bb8")]
impl<M> WorkerPool for bb8::Pool<M>
where
    M: bb8::ManageConnection,
    M::Connection: WaitForRows,
    M::Error: std::error::Error + Sync,
{
    type Connection = M::Connection;
    type Pooled<'p> = bb8::PooledConnection<'p, M>;

    fn check_out(&self) -> impl Future<Output = Result<Self::Pooled<'_>, Error>> + Send {
        async move { Ok(self.get().await?) }
    }

    fn connect(&self) -> impl Future<Output = Result<Self::Connection, Error>> + Send {
        async move {
            let connected = self.dedicated_connection().await;
            connected.map_err(|error| Error::Checkout(Box::new(error)))
        }
    }
}

#[cfg(feature = "deadpool")]
impl<M> private::Sealed for deadpool::managed::Pool<M> where M: deadpool::managed::Manager {}

#[cfg(feature = "deadpool")]
impl<M> WorkerPool for deadpool::managed::Pool<M>
where
    M: deadpool::managed::Manager + 'static,
    M::Type: WaitForRows,
    M::Error: std::error::Error + Send + Sync,
{
    type Connection = M::Type;
    type Pooled<'p> = deadpool::managed::Object<M>;

    fn check_out(&self) -> impl Future<Output = Result<Self::Pooled<'_>, Error>> + Send {
        async move { Ok(self.get().await?) }
    }

    fn connect(&self) -> impl Future<Output = Result<Self::Connection, Error>> + Send {
        async move {
            let connected = self.manager().create().await;
            connected.map_err(|error| Error::Checkout(Box::new(error)))
        }
    }
}

impl<Q, T, H> ClaimWorker<ClaimBuilder<Q, Async, T, H>> {
    /// Runs `concurrency` claim loops on `pool` until stopped (or, with
    /// [`stop_when_empty`](ClaimWorker::stop_when_empty), until nothing is
    /// pending), awaiting `f` for every claimed row: the twin of the
    /// blocking [`run_pooled`](ClaimWorker#method.run_pooled), on a bb8 or
    /// deadpool pool of diesel-async connections (features `bb8`,
    /// `deadpool`). The loops are futures of the returned future, taking
    /// turns on its task: a job that blocks its thread, or computes for long
    /// between its awaits, holds up the other loops. Where the claim, the
    /// closure and the pool can be moved to other tasks (`'static`),
    /// [`spawn_pooled`](Self::spawn_pooled) runs each loop on a task of its
    /// own instead.
    ///
    /// With [`listen`](ClaimWorker::listen), the listener is a connection
    /// the pool makes outside its count (bb8's `dedicated_connection`,
    /// deadpool's manager), made again whenever it fails.
    ///
    /// In the key's order, with row locks, the loops steer their takes
    /// around each other's batches as the blocking loops do (see
    /// [on a pool](crate::guide::workers#on-a-pool)).
    ///
    /// `f` is cloned for each loop; an `async` closure that captures only
    /// references clones as they do.
    pub fn run_pooled<'a, P, I, E, F>(
        self,
        pool: &'a P,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        P: WorkerPool,
        P::Connection: 'a,
        ClaimBuilder<Q, Async, T, H>: ClaimPerLoop + 'a,
        Q: Send + Sync + 'a,
        T: Takes<'a, Q, P::Connection, I> + 'a,
        T::Key: Send + Sync,
        H: FailureHook<P::Connection, I, T::Row, E> + 'a,
        <P::Connection as diesel_async::AsyncConnectionCore>::Backend: AsyncBackend,
        I: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut P::Connection, I) -> Result<(), E>
            + AsyncFnMut2<&'c mut P::Connection, I, Result<(), E>, Fut: Send>
            + Clone
            + Send
            + 'a,
        E: WorkerError + Send,
    {
        self.run_loops::<_, P, _, _, _, _, _>(pool, f, |loops, _| future::join_all(loops))
    }

    /// Runs the worker as [`run_pooled`](Self::run_pooled) does, each claim
    /// loop on a tokio task of its own (`tokio::spawn`), so that on a
    /// multi-threaded runtime the loops run in parallel, and a job that
    /// blocks its thread holds up no other loop, when it blocks inside
    /// `tokio::task::block_in_place` as tokio asks of blocking code (a task
    /// the blocked thread was about to run next may otherwise wait for it;
    /// with `run_pooled`, every loop waits whatever the job does). The
    /// listener runs in the returned future, which ends once every loop has
    /// ended; dropped before, it aborts the loops' tasks (each loop's claim
    /// in hand is rolled back, as any dropped claim is). A loop that panics
    /// stops the others, and its panic is resumed by the returned future.
    ///
    /// The pool is cloned (bb8's and deadpool's pools are handles), and the
    /// claim, `f` and what they hold must be `'static`, as a task's are.
    pub fn spawn_pooled<P, I, E, F>(
        self,
        pool: &P,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'static
    where
        P: WorkerPool + Clone + Send + 'static,
        ClaimBuilder<Q, Async, T, H>: ClaimPerLoop + 'static,
        Q: Send + Sync + 'static,
        T: Takes<'static, Q, P::Connection, I> + 'static,
        T::Key: Send + Sync,
        H: FailureHook<P::Connection, I, T::Row, E> + 'static,
        <P::Connection as diesel_async::AsyncConnectionCore>::Backend: AsyncBackend,
        I: Send + 'static,
        for<'c> F: AsyncFnMut(&'c mut P::Connection, I) -> Result<(), E>
            + AsyncFnMut2<&'c mut P::Connection, I, Result<(), E>, Fut: Send>
            + Clone
            + Send
            + 'static,
        E: WorkerError + Send,
    {
        self.run_loops::<_, P, _, _, _, _, _>(pool.clone(), f, |loops, halt| async move {
            let mut tasks = tokio::task::JoinSet::new();
            let mut ended = Vec::new();
            for (index, one) in loops.into_iter().enumerate() {
                tasks.spawn(async move { (index, one.await) });
            }
            let mut panicked = None;
            while let Some(joined) = tasks.join_next().await {
                match joined {
                    Ok(one) => ended.push(one),
                    // The others stop at the halt, then the panic goes on.
                    Err(error) if error.is_panic() => {
                        halt.stop();
                        panicked.get_or_insert(error.into_panic());
                    }
                    Err(error) => panic!("a worker's loop task was cancelled: {error}"),
                }
            }
            if let Some(payload) = panicked {
                std::panic::resume_unwind(payload);
            }
            ended.sort_by_key(|(index, _)| *index);
            ended.into_iter().map(|(_, one)| one).collect()
        })
    }

    /// The worker's loops on `pool` (a pool, or a reference to one), each
    /// with a copy of the claim and of `f`, run by `run` (joined in one
    /// future, or spawned), beside the listener.
    fn run_loops<'a, PP, P, I, E, F, R, Run>(
        self,
        pool: PP,
        f: F,
        run: R,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        PP: Borrow<P> + Send + Sync + 'a,
        P: WorkerPool,
        ClaimBuilder<Q, Async, T, H>: ClaimPerLoop + 'a,
        Q: Send + Sync + 'a,
        T: Takes<'a, Q, P::Connection, I> + 'a,
        T::Key: Send + Sync,
        H: FailureHook<P::Connection, I, T::Row, E> + 'a,
        <P::Connection as diesel_async::AsyncConnectionCore>::Backend: AsyncBackend,
        I: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut P::Connection, I) -> Result<(), E>
            + AsyncFnMut2<&'c mut P::Connection, I, Result<(), E>, Fut: Send>
            + Clone
            + Send
            + 'a,
        E: From<Error> + Display + Send + 'static,
        P::Connection: 'a,
        R: FnOnce(Vec<LoopFuture<'a, T::Key, E>>, StopHandle) -> Run + Send + 'a,
        Run: Future<Output = Vec<Result<ClaimReport, RowFailure<T::Key, E>>>> + Send + 'a,
    {
        async move {
            let ClaimWorker { claim, polling } = self;
            let labels = claim.options.worker_labels(T::table_name());
            let span = polling.span(&labels);
            polling.check(true, &labels)?;
            let events = span.in_scope(|| polling.events(labels));
            let worker = Arc::new(PooledWorker {
                shared: Shared::new(&polling),
                backoff: Backoff::new(polling.backoff),
                polling,
                events,
                pool,
            });
            let siblings = Siblings::new(worker.polling.concurrency);
            // Copied up front: the loops' futures hold no reference to the
            // originals, which need not be `Sync`.
            let loops: Vec<LoopFuture<'a, T::Key, E>> = (0..worker.polling.concurrency)
                .map(|index| {
                    let (mut claim, f) = (claim.per_loop(), PerRow(f.clone()));
                    let (worker, sibling) = (Arc::clone(&worker), siblings.slot(index));
                    let span = span.clone();
                    let one = async move {
                        worker
                            .claim_loop(sibling, &mut Runs::new(&mut claim, f))
                            .await
                    };
                    Box::pin(one.instrument(span)) as LoopFuture<'a, T::Key, E>
                })
                .collect();
            drop((claim, f));
            let loops = async {
                let ended = run(loops, worker.shared.halt.clone()).await;
                // The loops have ended: so does the listener.
                worker.shared.halt.stop();
                ended
            };
            let listener = async {
                if let Some(channel) = &worker.polling.channel {
                    listen(
                        worker.pool.borrow(),
                        channel,
                        &worker.shared,
                        &worker.events,
                    )
                    .await;
                }
            };
            let ((), ended) = future::join(listener, loops).instrument(span.clone()).await;
            let ended = summed(&worker.polling, ended);
            span.in_scope(|| Polling::ended(&span, &worker.events, &ended));
            ended
                .map(|(total, _)| total)
                .map_err(|failure| failure.error)
        }
    }
}

/// An idle bound that fired under a run: the error it ended the run with,
/// [`Error::IdleBoundExceeded`], as a value that makes it again.
#[derive(Debug, Clone, Copy)]
pub(super) struct BoundFired {
    pub(super) bound: Duration,
    pub(super) open_for: Duration,
}

impl BoundFired {
    /// What `error` says, if it is the crate's [`Error::IdleBoundExceeded`].
    pub(super) fn of<E: 'static>(error: &E) -> Option<Self> {
        match (error as &dyn std::any::Any).downcast_ref::<Error>() {
            Some(Error::IdleBoundExceeded { bound, open_for }) => Some(BoundFired {
                bound: *bound,
                open_for: *open_for,
            }),
            _ => None,
        }
    }

    pub(super) fn error(self) -> Error {
        Error::IdleBoundExceeded {
            bound: self.bound,
            open_for: self.open_for,
        }
    }
}

/// A worker's closure `F`, or, for a run that records failures already
/// known (of rows a session that has since ended ran), a closure that fails
/// each row at once with the error `failing` makes, so that the claim's
/// failure path records it under the row's lock. Both runs call one type of
/// closure: the claim's code is compiled once for a worker, not once more
/// for its failures.
pub(super) struct OrFails<F> {
    pub(super) f: F,
    pub(super) failing: Option<BoundFired>,
}

impl<C, I, E, F> Closure<C, I, E> for OrFails<F>
where
    F: Closure<C, I, E>,
    E: From<Error> + Send,
{
    const PER_ROW: bool = F::PER_ROW;

    fn call<'c>(&'c mut self, conn: &'c mut C, items: Vec<I>) -> BoxFuture<'c, Result<(), E>>
    where
        I: 'c,
    {
        match self.failing {
            Some(fired) => Box::pin(async move { Err(E::from(fired.error())) }),
            None => self.f.call(conn, items),
        }
    }
}

/// One claim loop of a worker on a pool, as a future: what it did, or the
/// failure that ended it.
type LoopFuture<'a, K, E> = BoxFuture<'a, Result<ClaimReport, RowFailure<K, E>>>;

/// What a pooled worker's loops and its listener share: the pool (or a
/// reference to it), the options, the stop and wake-ups, the backoff, the
/// events.
struct PooledWorker<PP, K> {
    pool: PP,
    polling: Polling,
    shared: Shared,
    backoff: Arc<Backoff<K>>,
    events: WorkerTrace,
}

/// How often a waiting loop looks at its stop handles.
const LOOK_EVERY: Duration = Duration::from_millis(5);

/// Sleeps until `deadline`, less when stopped or woken past `seen`.
async fn sleep_until(shared: &Shared, deadline: Instant, seen: u64) {
    loop {
        let woken = pin!(shared.woken_up.notified());
        let Some(step) = shared.next_step(deadline, seen, LOOK_EVERY) else {
            return;
        };
        let _ = future::select(woken, pin!(tokio::time::sleep(step))).await;
    }
}

impl<PP, K> PooledWorker<PP, K> {
    /// One claim loop: checks out a connection, claims, returns it, waits.
    async fn claim_loop<P, E>(
        &self,
        sibling: Sibling<Position<K>>,
        once: &mut (dyn ClaimOnce<P::Connection, Key = K, Error = E> + '_),
    ) -> Result<ClaimReport, RowFailure<K, E>>
    where
        PP: Borrow<P>,
        P: WorkerPool,
        K: Clone + Eq + Hash + Debug + Send,
        E: From<Error> + Display + 'static,
    {
        let PooledWorker {
            pool,
            polling,
            shared,
            backoff,
            events,
        } = self;
        let tell = |keys: &[K], error: &E| events.passed_over(keys, error);
        let mut total = ClaimReport::default();
        let mut pause = polling.min_poll;
        let mut reconnect = Reconnect::new();
        let Labels { table, name } = once.labels();
        let mut metrics = ClaimMetrics::new(&table, Some(&name));
        // Rows a session ended under, whose failure is yet to be recorded.
        let mut unrecorded: Option<(Vec<K>, BoundFired)> = None;
        // Takes steer around the other loops' batches, but the last claim of a
        // loop that stops once nothing is pending takes from the whole query.
        let mut steering = polling.concurrency > 1;
        while !shared.stopping() {
            let mut seen = shared.woken();
            let checked_out = {
                // Only a stop ends the wait for a connection: a wake-up (the
                // listener's) must not end the loop.
                let pool: &P = pool.borrow();
                match future::select(pin!(pool.check_out()), pin!(until_stopped(shared))).await {
                    Either::Left((checked_out, _)) => checked_out,
                    Either::Right(_) => break,
                }
            };
            let mut conn = match checked_out {
                Ok(conn) => conn,
                Err(error) => {
                    let what = "a worker could not check out a connection";
                    let pause = reconnect.failed(shared, events, what, &error);
                    sleep_until(shared, Instant::now() + pause, seen).await;
                    continue;
                }
            };
            if reconnect.failing() {
                // Back after failures: once a connection answers, so does
                // the server, and the loops pausing try again at once.
                // (Before the claim, whose jobs may be long.)
                if let Err(error) = conn.batch_execute("SELECT 1").await {
                    let what = "a worker's connection does not answer";
                    let pause = reconnect.failed(shared, events, what, &error);
                    sleep_until(shared, Instant::now() + pause, seen).await;
                    continue;
                }
                events.reconnected(reconnect.mended());
                seen = shared.wake();
            }
            if let Some((keys, fired)) = unrecorded.take() {
                let left = record_failures(once, &mut conn, keys, fired, events).await;
                metrics.failed_outside_the_claim(left);
            }
            let left_out = LeftOut {
                sibling: steering.then(|| sibling.clone()),
                ..LeftOut::backed_off(backoff, &tell)
            };
            let outcome = once.claim_once(&mut conn, left_out).await;
            let lost = outcome.stopped.is_some()
                && !outcome.transient
                && conn.batch_execute("SELECT 1").await.is_err();
            drop(conn);
            let recorded = tally(&mut total, outcome, events);
            let took = match recorded {
                Ok(took) => took,
                Err(failure) if lost => {
                    if let Some(fired) = BoundFired::of(&failure.error) {
                        // Never a silent retry: the job ran past its bound.
                        // Its failure is recorded on the next connection, if
                        // it can still be.
                        total.failed += failure.keys.len() as u64;
                        events.bound_fired(&failure.keys, &failure.error);
                        unrecorded = Some((failure.keys.clone(), fired));
                    }
                    let what =
                        "a worker's claim lost its connection, and its rows were rolled back";
                    let pause = reconnect.failed(shared, events, what, &failure.error);
                    sleep_until(shared, Instant::now() + pause, seen).await;
                    continue;
                }
                Err(failure) => {
                    shared.halt.stop();
                    return Err(failure);
                }
            };
            if polling.until_empty && !took {
                if steering {
                    steering = false;
                    continue;
                }
                break;
            }
            steering = polling.concurrency > 1;
            if let Some(wait) = polling.next_pause(took, &mut pause) {
                let waiting = Instant::now();
                sleep_until(shared, waiting + wait, seen).await;
                events.idled(waiting.elapsed());
                if shared.woken() != seen {
                    pause = polling.min_poll;
                }
            }
        }
        if let Some((keys, _)) = unrecorded {
            events.unrecorded(&keys, &"the worker stopped before it could record it");
            metrics.failed_outside_the_claim(keys.len() as u64);
        }
        Ok(total)
    }
}

/// Records the failure of the rows at `keys`, whose session the server
/// ended under their job when its transaction outlived its idle bound
/// (`fired`), through the claim's failure path on `conn`; returns how many
/// rows it could not record (the claim has no failure hook or schedule, or
/// a row no longer matches, or another worker holds it), which the claim's
/// metrics have not counted as failed.
async fn record_failures<C, K, E>(
    once: &mut (dyn ClaimOnce<C, Key = K, Error = E> + '_),
    conn: &mut C,
    keys: Vec<K>,
    fired: BoundFired,
    events: &WorkerTrace,
) -> u64
where
    K: Clone + Eq + Hash + Debug + Send,
    E: Display,
{
    let rows = keys.len() as u64;
    let Some(recording) = once.record_failures(conn, keys.clone(), fired) else {
        return rows;
    };
    let outcome = recording.await;
    let recorded = outcome.report.failed;
    match outcome.stopped {
        Some(failure) => events.unrecorded(&keys, &failure.error),
        None if recorded < rows => events.unrecorded(
            &keys,
            &"a row no longer matched the queue, or another worker held it",
        ),
        None => {}
    }
    rows - recorded.min(rows)
}

/// Waits until the worker stops; wake-ups do not end it.
async fn until_stopped(shared: &Shared) {
    while !shared.stopping() {
        tokio::time::sleep(LOOK_EVERY).await;
    }
}

/// The listener: a connection of its own that listens on `channel` and
/// wakes the loops, made again when it fails, until the worker stops.
async fn listen<P: WorkerPool>(pool: &P, channel: &str, shared: &Shared, events: &WorkerTrace) {
    let mut reconnect = Reconnect::new();
    while !shared.stopping() {
        let listened = match pool.connect().await {
            Ok(mut conn) => match conn.listen(channel).await {
                Ok(()) => {
                    // Rows may have come while nobody listened.
                    shared.wake();
                    events.listening(channel, reconnect.mended());
                    wait_for_notifications(&mut conn, shared).await
                }
                Err(error) => Err(error.to_string()),
            },
            Err(error) => Err(error.to_string()),
        };
        if let Err(error) = listened {
            let what = format!("a worker's listener on {channel:?} lost its connection");
            let pause = reconnect.failed(shared, events, &what, &error);
            sleep_until(shared, Instant::now() + pause, shared.woken()).await;
        }
    }
}

/// How long a listener waits before it checks that its connection answers.
const LISTENER_CHECK_EVERY: Duration = Duration::from_secs(1);

/// Wakes the loops on every notification, until the worker stops or the
/// connection fails.
async fn wait_for_notifications<C>(conn: &mut C, shared: &Shared) -> Result<(), String>
where
    C: WaitForRows + AsyncConnection,
{
    while !shared.stopping() {
        match conn.wait_for_rows(LISTENER_CHECK_EVERY, &shared.halt).await {
            Ok(true) => {
                shared.wake();
            }
            // A dead connection may stay silent: ask it.
            Ok(false) if !shared.stopping() => {
                conn.batch_execute("SELECT 1")
                    .await
                    .map_err(|error| error.to_string())?;
            }
            Ok(false) => {}
            Err(error) => return Err(error.to_string()),
        }
    }
    Ok(())
}
