//! A claim run over and over until stopped: the stop handle, the worker's
//! options and its blocking loop, and the backoff that keeps a worker from
//! retrying a failing row at once.

use std::collections::HashMap;
use std::fmt::{Debug, Display};
use std::hash::Hash;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::engine::MAX_EXCLUDED;
use super::kind::{FailureHook, Takes};
use super::run::PerRow;
use super::siblings::Sibling;
use super::{ClaimBuilder, ClaimOutcome, ClaimReport, RowFailure, WaitForRows};
use crate::backend::ClaimBackend;
use crate::error::rolled_back_by_the_database;
use crate::reusable::QueryPerLoop;
use crate::sql::Position;
use crate::trace::{self, Span, WorkerTrace};
use crate::{Blocking, Error};

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
/// [`ClaimBuilder::worker`] from a claim of any kind: it claims what is
/// pending, and when nothing is, waits — polling, from every `min` up to
/// every `max` while it stays idle ([`poll_interval`](Self::poll_interval)),
/// and on PostgreSQL woken at once by a notification on a channel
/// ([`listen`](Self::listen)).
///
/// A worker takes [from the head](ClaimBuilder::from_head) of its query:
/// each take re-runs the query in its order, so a job enqueued ahead of the
/// others is the next one taken. (The loops of a worker on a pool, in the
/// key's order, steer their takes around each other's batches instead: see
/// [on a pool](crate::guide::workers#on-a-pool).) A row whose closure fails is left out of
/// this worker's claims for a while ([`failure_backoff`](Self::failure_backoff)),
/// so that a row a [failure hook](ClaimBuilder::on_failure) leaves runnable
/// is not retried at once.
///
/// [`StopHandle::stop`] ends it gracefully: the row or batch in hand is
/// finished and committed, and [`run`](Self::run) returns the report of
/// everything the worker did. A closure's error ends it too, unless the claim
/// [keeps going](ClaimBuilder::keep_going) or has a failure hook, or the error
/// is a deadlock or a serialization failure ([`Error::Deadlock`],
/// [`Error::SerializationFailure`], or a `diesel::result::Error` of either
/// class): the database rolled the closure's transaction back, and the worker
/// goes on. Rows locked in that transaction are taken again; rows a
/// [`mark_and_commit`](ClaimBuilder::mark_and_commit) or a visibility timeout
/// claimed stay claimed, as after any failure of their closure.
///
/// The closure's error type shows itself (`Display`): with the `tracing`
/// feature, a worker's events say what failed, as it passes the errors over
/// (see the [guide](crate::guide#tracing), and
/// [`progress_interval`](Self::progress_interval) for its progress line).
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
pub struct ClaimWorker<B> {
    pub(crate) claim: B,
    pub(crate) polling: Polling,
}

/// A claim a worker on a pool can run in each of its loops: each loop runs a
/// copy of it, so its query must be [`QueryPerLoop`] (a typed query, or a
/// [`rebuild`](crate::rebuild) closure that is `Clone`), its kind and its
/// failure hook `Clone`, and all of it `Send`.
#[diagnostic::on_unimplemented(
    message = "a worker on a pool runs a copy of its claim in each loop, and this claim cannot be \
               copied",
    label = "this claim cannot be copied for each loop",
    note = "a `rebuild(|| …)` query is copied with its closure: move into it only what is `Clone` \
            and `Send` (the values its filters compare with), or an `Arc` of what is not",
    note = "a failure hook is copied for each loop too, and must be `Clone` and `Send`"
)]
pub trait ClaimPerLoop: Send + Sized {
    /// A copy for one loop.
    #[doc(hidden)]
    fn per_loop(&self) -> Self;
}

#[diagnostic::do_not_recommend]
impl<Q, M, T, H> ClaimPerLoop for ClaimBuilder<Q, M, T, H>
where
    Q: QueryPerLoop + Send,
    T: Clone + Send,
    H: Clone + Send,
    M: Send,
{
    fn per_loop(&self) -> Self {
        ClaimBuilder {
            query: self.query.per_loop(),
            options: self.options.clone(),
            kind: self.kind.clone(),
            hook: self.hook.clone(),
            mode: PhantomData,
        }
    }
}

/// How a worker waits between its claims, and backs off from failing rows.
#[derive(Debug, Clone)]
pub(crate) struct Polling {
    pub(crate) stop: StopHandle,
    pub(crate) min_poll: Duration,
    pub(crate) max_poll: Duration,
    pub(crate) channel: Option<String>,
    /// A failing row is left out for the first, doubling up to the second.
    pub(crate) backoff: (Duration, Duration),
    /// Ends the worker once a claim finds nothing to take.
    pub(crate) until_empty: bool,
    /// The claim loops of a worker on a pool.
    pub(crate) concurrency: usize,
    /// How often the worker reports its progress (with `tracing`).
    pub(crate) progress_every: Duration,
}

/// How often a worker reports its progress, by default.
const PROGRESS_EVERY: Duration = Duration::from_secs(60);

impl<Q, M, T, H> ClaimWorker<ClaimBuilder<Q, M, T, H>> {
    pub(crate) fn new(claim: ClaimBuilder<Q, M, T, H>, stop: StopHandle) -> Self {
        // Rows that carry their retry schedule need no backoff of the worker's.
        let backoff = if claim.options.retry_schedule {
            (Duration::ZERO, Duration::ZERO)
        } else {
            (Duration::from_secs(1), Duration::from_secs(300))
        };
        ClaimWorker {
            claim,
            polling: Polling {
                stop,
                min_poll: Duration::from_millis(10),
                max_poll: Duration::from_secs(1),
                channel: None,
                backoff,
                until_empty: false,
                concurrency: 1,
                progress_every: PROGRESS_EVERY,
            },
        }
    }

    /// How long to wait between claims while nothing is pending: `min` after
    /// rows were found, doubling on every empty claim up to `max` (by default
    /// 10 ms up to 1 s). With [`listen`](Self::listen), the polls are the
    /// fallback for a notification that was never sent.
    pub fn poll_interval(mut self, min: Duration, max: Duration) -> Self {
        self.polling.min_poll = min;
        self.polling.max_poll = max;
        self
    }

    /// Listens on `channel` (PostgreSQL `LISTEN`), and claims at once when a
    /// notification arrives instead of waiting for the next poll. Send one
    /// with the rows, in their transaction ([`notify`](crate::notify), or a
    /// trigger). Other backends refuse it with [`Error::InvalidArgument`].
    pub fn listen(mut self, channel: &str) -> Self {
        self.polling.channel = Some(channel.to_owned());
        self
    }

    /// How long this worker leaves a row out of its claims after the row's
    /// closure failed: `first` after its first failure here, doubling with
    /// each failure after it up to `max` (by default 1 s up to 5 min).
    ///
    /// The backoff is kept in memory, one for all the claim loops of a
    /// worker on a pool: a failing row is recorded in it before its
    /// transaction ends (while the row is still locked), and a take that
    /// locks a row the backoff holds passes it over, so no loop of the
    /// worker runs a row again before its backoff has passed. Workers in
    /// other processes do not see it: to retry a row no sooner than a time of
    /// your choosing across workers and processes, write that time in the
    /// row (a failure hook, and a filter on it: `run_at <= now`). A worker
    /// leaves out at most 500 rows at a time, those that failed last. (A row
    /// taken by a [`mark`](ClaimBuilder::mark) is marked before the backoff
    /// is checked, and reaches the closure.)
    ///
    /// With `first` zero, the worker has no backoff of its own: a row the
    /// hook leaves in the queue may be taken again at once, even in the same
    /// run. Choose it when the hook writes a next run time that the query's
    /// filter tests.
    pub fn failure_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.polling.backoff = (first, max);
        self.claim.options.failed_again = first.is_zero();
        self
    }

    /// Ends the worker, with its report, once a claim finds no row to take,
    /// instead of waiting for more: for test suites and one-shot jobs that
    /// drain a queue. Rows the worker is backing off from
    /// ([`failure_backoff`](Self::failure_backoff)) do not count as pending,
    /// nor do rows a failure hook rescheduled out of the query's filter. A
    /// stop still ends it first.
    pub fn stop_when_empty(mut self) -> Self {
        self.polling.until_empty = true;
        self
    }

    /// How many claim loops a worker on a pool runs at once (`run_pooled`;
    /// by default 1): each runs one claim at a time on a connection of its
    /// own, and they share the worker's listener and its backoff. Blocking,
    /// each loop is a thread; async, the loops are futures of the worker's
    /// own future, taking turns on its task
    /// ([`run_pooled`](Self::run_pooled)), or each a task of its own
    /// (`spawn_pooled`), so that a job that blocks its thread holds up no
    /// other loop.
    pub fn concurrency(mut self, loops: usize) -> Self {
        self.polling.concurrency = loops;
        self
    }

    /// Ends each job that runs longer than `timeout`, as a failure recorded
    /// under its lock by the claim's failure hook or retry schedule (without
    /// either, or [`keep_going`](ClaimBuilder::keep_going), the worker ends
    /// with [`Error::TimedOut`](crate::Error::TimedOut)): see
    /// [`ClaimBuilder::timeout`] for what a timeout can end, blocking and
    /// async. Without one, a job runs for as long as it
    /// takes, and an async worker's transactions have no idle bound (unless
    /// [`idle_bound`](crate::ClaimBuilder::idle_bound) sets one): a bound shorter than a job
    /// would end its session while it runs, free its row, and let another
    /// worker start it again.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.claim = self.claim.timeout(timeout);
        self
    }

    /// How often the worker reports its progress (by default every 60 s):
    /// with the `tracing` feature, an `info` event `worker progress` with
    /// its table, the rows it processed and the rows that failed since the
    /// last one, and how long it was idle in that time (waiting for rows;
    /// on a pool, per claim loop). It is reported once the interval has
    /// passed, when the worker's claim or wait in hand ends: at most
    /// [`poll_interval`](Self::poll_interval)'s `max` late while idle.
    pub fn progress_interval(mut self, every: Duration) -> Self {
        self.polling.progress_every = every;
        self
    }
}

impl<Q, T, H> ClaimWorker<ClaimBuilder<Q, Blocking, T, H>> {
    /// Runs the worker until stopped, calling `f` for every claimed row as
    /// [`ClaimBuilder::each`] does; returns the report of everything it did.
    pub fn run<'q, C, I, E, F>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        T: Takes<'q, Q, C, I>,
        H: FailureHook<C, I, T::Row, E>,
        C: WaitForRows,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, I) -> Result<(), E>,
        E: From<Error> + Display + 'static,
    {
        let ClaimWorker { mut claim, polling } = self;
        let mut f = PerRow(f);
        polling.serve(conn, T::table_name(), |conn, left_out| {
            claim.run_once(conn, &mut f, left_out)
        })
    }
}

impl Polling {
    /// The options, checked before anything is sent, for a worker on a pool
    /// or on one connection.
    pub(crate) fn check(&self, pooled: bool) -> Result<(), Error> {
        if !pooled && self.concurrency != 1 {
            return Err(Error::InvalidArgument(format!(
                "concurrency is for workers on a pool (run_pooled): run on one connection runs \
                 one claim loop, got {}",
                self.concurrency
            )));
        }
        if self.min_poll.is_zero() || self.min_poll > self.max_poll {
            return Err(Error::InvalidArgument(format!(
                "poll_interval needs 0 < min <= max, got {:?} and {:?}",
                self.min_poll, self.max_poll
            )));
        }
        let (first, max) = self.backoff;
        if first > max {
            return Err(Error::InvalidArgument(format!(
                "failure_backoff needs first <= max, got {first:?} and {max:?}"
            )));
        }
        if let Some(channel) = &self.channel {
            super::wait::check_channel(channel)?;
        }
        if self.concurrency == 0 {
            return Err(Error::InvalidArgument(
                "concurrency needs at least 1 claim loop, got 0".to_owned(),
            ));
        }
        if self.progress_every.is_zero() {
            return Err(Error::InvalidArgument(
                "progress_interval needs an interval above zero".to_owned(),
            ));
        }
        Ok(())
    }

    /// The span of the worker's loop on `table`, around its claims' spans.
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(crate) fn span(&self, table: &str) -> Span {
        trace::info_span!(
            target: trace::WORKER,
            "worker",
            table,
            channel = self.channel.as_deref(),
            min_poll = ?self.min_poll,
            max_poll = ?self.max_poll,
            processed = trace::Empty,
            failed = trace::Empty,
        )
    }

    /// The events of the worker on `table`, once its options are checked:
    /// it says that it starts.
    pub(crate) fn events(&self, table: String) -> WorkerTrace {
        let events = WorkerTrace::new(table, self.progress_every, self.concurrency);
        let polls = (self.min_poll, self.max_poll);
        events.started(self.channel.as_deref(), polls);
        events
    }

    /// Says why the worker ended, and records its totals on its span.
    pub(crate) fn ended<K: Debug, E: Display>(
        span: &Span,
        events: &WorkerTrace,
        ended: &Result<(ClaimReport, &str), RowFailure<K, E>>,
    ) {
        match ended {
            Ok((total, why)) => {
                events.stopped(why, total.processed, total.failed);
                span.record("processed", total.processed)
                    .record("failed", total.failed);
            }
            Err(failure) => events.failed(&failure.keys, &failure.error),
        }
    }

    /// The wait after a claim: none after it `took` rows (whether they
    /// succeeded or failed), else `pause`, doubled for the next time.
    pub(crate) fn next_pause(&self, took: bool, pause: &mut Duration) -> Option<Duration> {
        if took {
            *pause = self.min_poll;
            return None;
        }
        let now = *pause;
        *pause = (now * 2).min(self.max_poll);
        Some(now)
    }

    /// The worker loop, blocking: runs `claim_once` until stopped, leaving
    /// out the rows it backs off from, waiting between runs that found
    /// nothing, listening on the channel if one was given; returns the
    /// report of all the runs.
    pub(crate) fn serve<C, K, E>(
        &self,
        conn: &mut C,
        table: String,
        mut claim_once: impl FnMut(&mut C, LeftOut<K>) -> ClaimOutcome<K, E>,
    ) -> Result<ClaimReport, E>
    where
        C: WaitForRows,
        K: Clone + Eq + Hash + Debug,
        E: From<Error> + Display + 'static,
    {
        let span = self.span(&table);
        let _entered = span.enter();
        self.check(false)?;
        let events = self.events(table);
        let outside = |error: Error| RowFailure::new(Vec::new(), E::from(error));
        let mut worked = || -> Result<(ClaimReport, &str), RowFailure<K, E>> {
            if let Some(channel) = &self.channel {
                conn.listen(channel).map_err(outside)?;
            }
            let mut total = ClaimReport::default();
            let mut pause = self.min_poll;
            let backoff = Backoff::new(self.backoff);
            loop {
                if self.stop.is_stopped() {
                    return Ok((total, STOPPED));
                }
                let outcome = claim_once(conn, LeftOut::backed_off(&backoff));
                let took = tally(&mut total, outcome, &events)?;
                if self.until_empty && !took {
                    return Ok((total, NOTHING_PENDING));
                }
                if let Some(wait) = self.next_pause(took, &mut pause) {
                    let waiting = Instant::now();
                    let woken = conn.wait_for_rows(wait, &self.stop);
                    events.idled(waiting.elapsed());
                    if woken.map_err(outside)? {
                        pause = self.min_poll;
                    }
                }
            }
        };
        let worked = worked();
        Polling::ended(&span, &events, &worked);
        if let Some(channel) = &self.channel {
            // A pooled connection goes back to the pool without it.
            let unlistened = conn.unlisten(channel);
            if worked.is_ok() {
                unlistened?;
            }
        }
        worked
            .map(|(total, _)| total)
            .map_err(|failure| failure.error)
    }
}

/// Why a worker ended: its stop handle was triggered.
pub(crate) const STOPPED: &str = "stopped";

/// Why a worker ended: `stop_when_empty`, and a claim found nothing.
pub(crate) const NOTHING_PENDING: &str = "nothing pending";

/// The rows a worker leaves out of its claims after their closures failed,
/// each until its backoff has passed: one for all the loops of a worker on a
/// pool, shared with each run of its claim.
///
/// A run records a failing row here while the row is still locked, before
/// its transaction ends, and passes over the rows a take locked that the
/// backoff holds: so no loop runs a row again before its backoff has passed,
/// not even one whose take began before the failure was recorded.
#[derive(Debug)]
pub(crate) struct Backoff<K> {
    first: Duration,
    max: Duration,
    /// Per row: its failures here, and when it may be taken again.
    rows: Mutex<HashMap<K, (u32, Instant)>>,
}

/// Rows a worker leaves out of a claim, at most: the rest of the claim's
/// room is for the rows that fail during it.
const MAX_BACKED_OFF: usize = MAX_EXCLUDED / 2;

impl<K: Clone + Eq + Hash> Backoff<K> {
    pub(crate) fn new((first, max): (Duration, Duration)) -> Arc<Self> {
        Arc::new(Backoff {
            first,
            max,
            rows: Mutex::new(HashMap::new()),
        })
    }

    fn rows(&self) -> MutexGuard<'_, HashMap<K, (u32, Instant)>> {
        // Each entry is written whole: a panic elsewhere leaves none half
        // written.
        self.rows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The rows at `keys` failed: each is left out until its backoff passes.
    pub(crate) fn failed(&self, keys: &[K]) {
        if self.first.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut rows = self.rows();
        for key in keys {
            let (failures, until) = rows.entry(key.clone()).or_insert((0, now));
            let doublings = (*failures).min(31);
            *failures += 1;
            *until = now + self.first.saturating_mul(1 << doublings).min(self.max);
        }
    }

    /// Whether the row at `key` is still backed off from.
    pub(crate) fn holds(&self, key: &K) -> bool {
        let now = Instant::now();
        self.rows().get(key).is_some_and(|(_, until)| *until > now)
    }

    /// The rows to leave out now: those whose backoff has not passed, the
    /// latest first, at most [`MAX_BACKED_OFF`]. Rows whose backoff passed
    /// longer than the longest backoff ago are forgotten.
    pub(crate) fn excluded(&self) -> Vec<K> {
        let now = Instant::now();
        let max = self.max;
        let mut rows = self.rows();
        rows.retain(|_, (_, until)| now.saturating_duration_since(*until) <= max);
        let mut waiting: Vec<(&K, Instant)> = rows
            .iter()
            .filter(|(_, (_, until))| *until > now)
            .map(|(key, (_, until))| (key, *until))
            .collect();
        waiting.sort_by_key(|(_, until)| std::cmp::Reverse(*until));
        waiting
            .into_iter()
            .take(MAX_BACKED_OFF)
            .map(|(key, _)| key.clone())
            .collect()
    }
}

/// What a worker's run of its claim leaves out of its takes.
#[derive(Debug)]
pub(crate) struct LeftOut<K> {
    /// The worker's backoff: the rows it leaves out after they failed, and
    /// where the run records the rows that fail in it.
    pub(crate) backoff: Option<Arc<Backoff<K>>>,
    /// On a pool, the loop's slot: where the other loops' batches lie.
    pub(crate) sibling: Option<Sibling<Position<K>>>,
    /// The only rows to take, if set: those whose failure the run records.
    pub(crate) only: Option<Vec<K>>,
}

impl<K> LeftOut<K> {
    /// Nothing: a claim that is not a worker's.
    pub(crate) fn nothing() -> Self {
        LeftOut {
            backoff: None,
            sibling: None,
            only: None,
        }
    }

    /// The rows `backoff` holds, the worker's on one connection.
    pub(crate) fn backed_off(backoff: &Arc<Backoff<K>>) -> Self {
        LeftOut {
            backoff: Some(Arc::clone(backoff)),
            sibling: None,
            only: None,
        }
    }
}

/// Counts what a worker's run did into `total`, saying so in the worker's
/// `events`: the rows it processed and those it passed over, or the failure
/// that ended it; whether it took any row, or was rolled back before it knew
/// (a run whose rows all failed is not an idle one). A run ended by a
/// deadlock or a serialization failure, of the crate's own statements or of
/// the closure's, was rolled back by the database: it is not the worker's
/// end.
pub(crate) fn tally<K: Debug, E: Display + 'static>(
    total: &mut ClaimReport,
    outcome: ClaimOutcome<K, E>,
    events: &WorkerTrace,
) -> Result<bool, RowFailure<K, E>> {
    total.add(&outcome.report);
    events.ran(outcome.report.processed, outcome.report.failed);
    for failure in &outcome.failed {
        events.passed_over(&failure.keys, &failure.error);
    }
    let took = outcome.report.processed > 0 || !outcome.failed.is_empty();
    match outcome.stopped {
        // Rolled back, nothing lost: the next run takes the rows again.
        Some(failure) if outcome.transient || rolled_back_by_the_database(&failure.error) => {
            events.rolled_back(&failure.error);
            Ok(true)
        }
        Some(failure) => Err(failure),
        None => Ok(took),
    }
}

/// What the workers on a pool, blocking and async, share.
#[cfg(any(
    feature = "postgres",
    feature = "sqlite",
    feature = "mysql",
    feature = "bb8",
    feature = "deadpool"
))]
pub(crate) mod on_a_pool {
    use std::sync::atomic::AtomicU64;

    use super::*;

    /// What a pooled worker's loops and its listener share.
    pub(crate) struct Shared {
        /// The caller's stop.
        pub(crate) stop: StopHandle,
        /// Stops the loops and the listener when one loop ends on an error, or
        /// when the loops are done.
        pub(crate) halt: StopHandle,
        /// Bumped by the listener on every notification, and when it
        /// (re)connects, and by a loop whose connection answers again after
        /// failures: idle loops claim at once when it moves, and loops
        /// pausing after a failed connection try again at once.
        pub(crate) wakeups: AtomicU64,
        /// The last of the turns the loops and the listener take to try for
        /// a connection while connections fail (see [`Shared::retry_in`]).
        last_turn: Mutex<Option<Instant>>,
        /// Wakes async loops waiting for `wakeups` to move.
        #[cfg(feature = "async")]
        pub(crate) woken_up: tokio::sync::Notify,
    }

    impl Shared {
        pub(crate) fn new(polling: &Polling) -> Self {
            Shared {
                stop: polling.stop.clone(),
                halt: StopHandle::new(),
                wakeups: AtomicU64::new(0),
                last_turn: Mutex::new(None),
                #[cfg(feature = "async")]
                woken_up: tokio::sync::Notify::new(),
            }
        }

        pub(crate) fn stopping(&self) -> bool {
            self.stop.is_stopped() || self.halt.is_stopped()
        }

        pub(crate) fn woken(&self) -> u64 {
            self.wakeups.load(Ordering::Acquire)
        }

        /// Wakes the loops waiting; returns the wake-ups so far, this one
        /// with them.
        pub(crate) fn wake(&self) -> u64 {
            let woken = self.wakeups.fetch_add(1, Ordering::AcqRel) + 1;
            #[cfg(feature = "async")]
            self.woken_up.notify_waiters();
            woken
        }

        /// How long to sleep before looking again, at most `step`, in a wait
        /// that ends at `deadline` or when woken past `seen`; `None` once over.
        pub(crate) fn next_step(
            &self,
            deadline: Instant,
            seen: u64,
            step: Duration,
        ) -> Option<Duration> {
            let left = deadline.saturating_duration_since(Instant::now());
            let over = left.is_zero() || self.stopping() || self.woken() != seen;
            (!over).then(|| left.min(step))
        }

        /// How long a loop or the listener whose connection failed waits
        /// before it tries again, its own `pause` being up: that pause, or
        /// less, until the worker's next turn. The turns are [`TRY_EVERY`]
        /// apart, one try each, and taken only by those whose own pause ends
        /// later: while the server is down, a worker tries about four times a
        /// second however many loops it has, and once the one that gets
        /// through wakes the others ([`Shared::wake`]), none waits out the
        /// rest of its pause.
        pub(crate) fn retry_in(&self, pause: Duration) -> Duration {
            let now = Instant::now();
            let mut last = self
                .last_turn
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let turn = last.map_or(now, |last| last + TRY_EVERY);
            let turn = turn.max(now + RECONNECT_PAUSES.0);
            if turn >= now + pause {
                return pause;
            }
            *last = Some(turn);
            turn - now
        }
    }

    /// The pause after a lost connection: the first, doubling up to the last
    /// while connections keep failing.
    pub(crate) const RECONNECT_PAUSES: (Duration, Duration) =
        (Duration::from_millis(50), Duration::from_secs(5));

    /// How often a worker's loops, between them, try for a connection once
    /// their own pauses are longer ([`Shared::retry_in`]): a server that is
    /// back is tried within it, and one that is down gets about four tries
    /// a second from a worker, however many loops it has.
    ///
    /// A pool's own waits come on top, and a worker cannot shorten them:
    /// r2d2 and bb8 make their connections in the background, retrying one
    /// that failed after a pause doubling up to half their
    /// `connection_timeout` (15 s by default), and a checkout (r2d2's
    /// `get_timeout` too) only waits for those; deadpool connects within the
    /// checkout. So a loop waiting in a checkout takes a connection as soon
    /// as the pool has one, a loop pausing is woken by the first that gets
    /// through, and what is left after a restart is the pool's own pause:
    /// the guide asks for a `connection_timeout` of a second or two on a
    /// worker's r2d2 or bb8 pool.
    pub(crate) const TRY_EVERY: Duration = Duration::from_millis(250);

    /// The pauses between attempts to get a working connection again.
    pub(crate) struct Reconnect {
        next: Duration,
        /// The connections that failed since one last worked.
        failures: u32,
    }

    impl Reconnect {
        pub(crate) fn new() -> Self {
            Reconnect {
                next: RECONNECT_PAUSES.0,
                failures: 0,
            }
        }

        /// Whether connections failed since one last worked.
        pub(crate) fn failing(&self) -> bool {
            self.failures > 0
        }

        /// A connection worked: the next failure pauses briefly again. The
        /// connections that failed before it.
        pub(crate) fn mended(&mut self) -> u32 {
            self.next = RECONNECT_PAUSES.0;
            std::mem::take(&mut self.failures)
        }

        /// A connection failed: says that `what` failed, and returns how
        /// long to wait before the next try (see [`Shared::retry_in`]). Its
        /// own pause doubles the one after it.
        pub(crate) fn failed(
            &mut self,
            shared: &Shared,
            events: &WorkerTrace,
            what: &str,
            error: &dyn Display,
        ) -> Duration {
            self.failures = self.failures.saturating_add(1);
            let pause = self.next;
            self.next = (pause * 2).min(RECONNECT_PAUSES.1);
            let pause = shared.retry_in(pause);
            events.reconnecting(what, error, pause);
            pause
        }
    }

    /// The report of a worker's loops and why they ended, or the first
    /// error that ended one.
    pub(crate) fn summed<K, E>(
        polling: &Polling,
        ended: impl IntoIterator<Item = Result<ClaimReport, RowFailure<K, E>>>,
    ) -> Result<(ClaimReport, &'static str), RowFailure<K, E>> {
        let mut total = ClaimReport::default();
        for ended in ended {
            total.add(&ended?);
        }
        let stopped = polling.stop.is_stopped() || !polling.until_empty;
        Ok((total, if stopped { STOPPED } else { NOTHING_PENDING }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failing row is left out for the first backoff, doubling with each
    /// failure up to the longest; it comes back once its backoff has passed.
    #[test]
    fn failing_rows_are_left_out_until_their_backoff_passes() {
        let first = Duration::from_millis(40);
        let backoff = Backoff::new((first, first * 3));
        backoff.failed(&[1, 2]);
        let mut excluded = backoff.excluded();
        excluded.sort();
        assert_eq!(excluded, [1, 2]);
        assert!(backoff.holds(&1) && !backoff.holds(&3));
        std::thread::sleep(first + Duration::from_millis(10));
        assert!(backoff.excluded().is_empty());
        assert!(!backoff.holds(&1));
        // The second failure doubles the backoff, the third caps it.
        backoff.failed(&[1]);
        backoff.failed(&[1]);
        let (failures, until) = backoff.rows()[&1];
        assert_eq!(failures, 3);
        let left = until.saturating_duration_since(Instant::now());
        assert!(left > first * 2 && left <= first * 3, "{left:?}");
    }

    /// At most half the claim's room for left-out rows goes to the backoff,
    /// the rows that failed last.
    #[test]
    fn a_worker_leaves_out_a_bounded_number_of_rows() {
        let backoff = Backoff::new((Duration::from_secs(60), Duration::from_secs(60)));
        let keys: Vec<i32> = (0..(MAX_BACKED_OFF as i32 + 10)).collect();
        for key in &keys {
            backoff.failed(&[*key]);
        }
        let excluded = backoff.excluded();
        assert_eq!(excluded.len(), MAX_BACKED_OFF);
        assert!(excluded.contains(keys.last().unwrap()));
    }

    /// Without a backoff, a failing row is not left out at all.
    #[test]
    fn no_backoff_holds_nothing() {
        let backoff = Backoff::new((Duration::ZERO, Duration::ZERO));
        backoff.failed(&[1]);
        assert!(!backoff.holds(&1) && backoff.excluded().is_empty());
    }
}
