//! A claim run over and over until stopped: the stop handle, the worker's
//! options (its name among them) and its blocking loop; the backoff that
//! keeps a worker from retrying a failing row at once (`backoff`), and what
//! the loops of a worker on a pool share (`on_a_pool`).

use std::fmt::{Debug, Display};
use std::hash::Hash;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::engine::Claim;
use super::kind::{FailureHook, Takes};
use super::run::PerRow;
use super::siblings::Sibling;
use super::{ClaimBuilder, ClaimOutcome, ClaimReport, Options, RowFailure, WaitForRows};
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
/// (see the [guide](crate::guide::tracing), and
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

/// The error type of a worker's closure: the crate's own errors convert into
/// it, and it is `Display`, for the events and logs that name each failed
/// job's error.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the error type of a worker's jobs",
    label = "the closure's error type is `{Self}`",
    note = "a worker writes each failed job's error into its events and logs, so the type must \
            implement `std::fmt::Display`; and it ends on the crate's own errors, so it must \
            implement `From<diesel_claim::Error>`",
    note = "`diesel_claim::Error` and `anyhow::Error` are both; so is an error enum of your own \
            that implements both, as `#[derive(thiserror::Error)]` with a `#[from] \
            diesel_claim::Error` variant does"
)]
pub trait WorkerError: From<Error> + Display + 'static {}

#[diagnostic::do_not_recommend]
impl<E: From<Error> + Display + 'static> WorkerError for E {}

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

/// What tells a worker apart in its span and events (read by nothing
/// without the `tracing` feature).
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "tracing"), allow(dead_code))]
pub(crate) struct Labels {
    /// Its claimed table.
    pub(crate) table: String,
    /// Its name: the one it was given, else its table's.
    pub(crate) name: String,
}

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

    /// Names the worker (by default, its claimed table's name), so that two
    /// workers of one table are told apart: with the `tracing` feature, the
    /// worker's span and each of its events carry it as `worker`; with the
    /// `metrics` feature, its claims' metrics have it as the label `worker`.
    /// See the guide's [names](crate::guide::workers#names). An empty name
    /// would tell nothing apart: the worker refuses it with
    /// [`Error::InvalidArgument`] before any SQL.
    pub fn name(mut self, name: &str) -> Self {
        self.claim.options.worker = Some(name.to_owned());
        self
    }
}

impl Options {
    /// The name of the worker that runs the claim, in its events and
    /// metrics: the one it was given, else the claimed table's.
    pub(crate) fn worker_name(&self, table: &str) -> String {
        self.worker.clone().unwrap_or_else(|| table.to_owned())
    }

    /// The labels of the worker that runs the claim, on `table`.
    pub(crate) fn worker_labels(&self, table: String) -> Labels {
        let name = self.worker_name(&table);
        Labels { table, name }
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
        E: WorkerError,
    {
        let ClaimWorker { mut claim, polling } = self;
        let mut f = PerRow(f);
        let labels = claim.options.worker_labels(T::table_name());
        polling.serve(conn, labels, |conn, left_out| {
            claim.run_once(conn, &mut f, left_out)
        })
    }
}

impl Polling {
    /// The options, checked before anything is sent, for a worker on a pool
    /// or on one connection, and its name.
    pub(crate) fn check(&self, pooled: bool, labels: &Labels) -> Result<(), Error> {
        // A table's name is never empty: an empty one was given by `name`.
        if labels.name.is_empty() {
            return Err(Error::InvalidArgument(
                "name needs at least one character (without one, a worker has its table's name)"
                    .to_owned(),
            ));
        }
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

    /// The span of the worker's loop, around its claims' spans.
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(crate) fn span(&self, labels: &Labels) -> Span {
        trace::info_span!(
            target: trace::WORKER,
            "worker",
            worker = labels.name,
            table = labels.table,
            channel = self.channel.as_deref(),
            min_poll = ?self.min_poll,
            max_poll = ?self.max_poll,
            processed = trace::Empty,
            failed = trace::Empty,
        )
    }

    /// The events of the worker, once its options are checked: it says that
    /// it starts.
    pub(crate) fn events(&self, labels: Labels) -> WorkerTrace {
        let events = WorkerTrace::new(labels, self.progress_every, self.concurrency);
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
        labels: Labels,
        mut claim_once: impl FnMut(&mut C, LeftOut<'_, K, E>) -> ClaimOutcome<K, E>,
    ) -> Result<ClaimReport, E>
    where
        C: WaitForRows,
        K: Clone + Eq + Hash + Debug,
        E: From<Error> + Display + 'static,
    {
        let span = self.span(&labels);
        let _entered = span.enter();
        self.check(false, &labels)?;
        let events = self.events(labels);
        let tell = |keys: &[K], error: &E| events.passed_over(keys, error);
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
                let outcome = claim_once(conn, LeftOut::backed_off(&backoff, &tell));
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

mod backoff;
pub(crate) use backoff::Backoff;

/// Why a worker ended: its stop handle was triggered.
pub(crate) const STOPPED: &str = "stopped";

/// Why a worker ended: `stop_when_empty`, and a claim found nothing.
pub(crate) const NOTHING_PENDING: &str = "nothing pending";

/// What a worker gives one run of its claim: the rows the run leaves out of
/// its takes, and where it tells of the rows it passes over.
pub(crate) struct LeftOut<'w, K, E> {
    /// The worker's backoff: the rows it leaves out after they failed, and
    /// where the run records the rows that fail in it.
    pub(crate) backoff: Option<Arc<Backoff<K>>>,
    /// On a pool, the loop's slot: where the other loops' batches lie.
    pub(crate) sibling: Option<Sibling<Position<K>>>,
    /// The only rows to take, if set: those whose failure the run records.
    pub(crate) only: Option<Vec<K>>,
    /// The worker's warning of rows whose closure failed, with the error.
    pub(crate) tell: Option<Tell<'w, K, E>>,
}

/// How a worker tells of rows passed over after their closure failed, with
/// the error, which the worker can show (its error type is `Display`).
pub(crate) type Tell<'w, K, E> = &'w (dyn Fn(&[K], &E) + Sync);

impl<'w, K, E> LeftOut<'w, K, E> {
    /// Nothing: a claim that is not a worker's.
    pub(crate) fn nothing() -> Self {
        LeftOut {
            backoff: None,
            sibling: None,
            only: None,
            tell: None,
        }
    }

    /// The rows `backoff` holds, the worker's on one connection, which
    /// tells of the rows it passes over with `tell`.
    pub(crate) fn backed_off(backoff: &Arc<Backoff<K>>, tell: Tell<'w, K, E>) -> Self {
        LeftOut {
            backoff: Some(Arc::clone(backoff)),
            tell: Some(tell),
            ..LeftOut::nothing()
        }
    }
}

/// The failures a run of a claim goes on past, each told of as it happens:
/// a worker's run takes batch after batch until none is left, and a warning
/// kept until it ends would come after the work of the rows after it.
pub(crate) struct PassedOver<'w, K, E> {
    pub(crate) failures: Vec<RowFailure<K, E>>,
    tell: Option<Tell<'w, K, E>>,
}

impl<'w, K: Clone + Eq + Hash + Debug, E> PassedOver<'w, K, E> {
    pub(crate) fn new(tell: Option<Tell<'w, K, E>>) -> Self {
        PassedOver {
            failures: Vec::new(),
            tell,
        }
    }

    /// Counts `failure` in `claim`, of the table `table` names, and says so
    /// (a worker with the error; a call without it, as its error type may
    /// not show); keeps it for the run's outcome.
    pub(crate) fn add(
        &mut self,
        claim: &mut Claim<Position<K>>,
        table: impl FnOnce() -> String,
        failure: RowFailure<K, E>,
    ) {
        match self.tell {
            Some(tell) => tell(&failure.keys, &failure.error),
            // A worker's run recording failures outside its loop tells nothing.
            None if claim.in_worker() => {}
            None => trace::passed_over(&table(), None, &failure.keys, None),
        }
        claim.failed(failure.keys.iter().cloned().map(Position::of_key).collect());
        self.failures.push(failure);
    }
}

/// Counts what a worker's run did into `total`, saying so in the worker's
/// `events`: the rows it processed and those it passed over (each of which
/// it told of as it happened), or the failure that ended it; whether it took any row, or was rolled back before it knew
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

#[cfg(any(
    feature = "postgres",
    feature = "sqlite",
    feature = "mysql",
    feature = "async"
))]
pub(crate) mod on_a_pool;
