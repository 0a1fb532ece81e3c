//! Claiming: process each row of a query at most once across workers.
//!
//! One builder, [`ClaimBuilder`], carries a claim's options, its kind (how
//! it takes rows: [`kind`]) and its failure hook; every kind runs through
//! the same methods (`run.rs` here, `aio/claim.rs` for diesel-async), which
//! drive the one engine (`engine.rs`) with the kind's statements.

use std::marker::PhantomData;
use std::time::Duration;

use crate::backend::ClaimBackend;
use crate::connection::BlockingConnection;
use crate::locking::LockOptions;

use crate::{Blocking, Error, LockStrength, OnLocked};

pub(crate) mod drive;
pub(crate) mod engine;
pub mod kind;
mod options;
mod page;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
pub(crate) mod pooled;
pub(crate) mod query;
pub(crate) mod report;
pub(crate) mod retries;
pub(crate) mod run;
pub(crate) mod siblings;
pub(crate) mod timed;
pub(crate) mod wait;
pub(crate) mod worker;

use kind::{Delete, Keep, Mark, NoHook, OnFailure, Replica, Select, Set};
pub(crate) use options::failures_in_savepoints;
pub use options::Options;
use options::Reading;
pub use query::ClaimStatements;
pub use query::{ClaimQuery, MarkQuery, StampQuery};
pub use report::{ClaimOutcome, ClaimReport, RowFailure};
pub use timed::{Claimed, StampedRow};
#[cfg(feature = "postgres_backend")]
pub use wait::notify;
pub use wait::WaitForRows;
pub use worker::{ClaimWorker, StopHandle};

/// Adds [`claim_each`](ClaimDsl::claim_each) to Diesel queries.
///
/// See the [guide](crate::guide#claiming-claim_each) for the algorithm and
/// its caveats.
pub trait ClaimDsl: Sized {
    /// Processes each row of this query at most once across every worker that
    /// claims from it, with the default options: skip rows locked by others,
    /// `FOR NO KEY UPDATE OF <table>`, no cap, one pass.
    ///
    /// Each row is re-read under a row lock in a transaction of its own, with the
    /// query's own filter and the row's primary key; if it still matches, `f` runs
    /// in that transaction, which commits when `f` returns `Ok`. An `Err` from `f`
    /// rolls that row back and ends the call with the error; rows committed before
    /// stay committed. Must be called outside a transaction.
    ///
    /// The rows' type identifies the claimed table (`#[derive(Identifiable)]`);
    /// with a join, select that table's struct (`.select(Order::as_select())`).
    fn claim_each<'q, C, R, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Self: ClaimQuery<'q, C, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        self.build_claim().each(conn, f)
    }

    /// Starts a claim with options; run it with [`ClaimBuilder::each`].
    fn build_claim(self) -> ClaimBuilder<Self> {
        ClaimBuilder::new(self)
    }
}

impl<Q: diesel::query_builder::Query> ClaimDsl for Q {}

impl<F> ClaimDsl for crate::Rebuild<F> {}

/// A claim: the query, its options, how it takes rows (its [kind](kind):
/// [`Select`] by default) and what it does with a row whose closure fails
/// ([`NoHook`] by default). Made by [`ClaimDsl::build_claim`]; run by
/// [`each`](Self::each), [`each_batch`](Self::each_batch),
/// [`each_outcome`](Self::each_outcome),
/// [`each_batch_outcome`](Self::each_batch_outcome), or, until stopped, by
/// a [worker](Self::worker). Options may be set in any order.
///
/// ```
/// # include!("../doctest_setup.rs");
/// use diesel_claim::prelude::*;
///
/// # fn main() -> Result<(), diesel_claim::Error> {
/// # let mut conn = establish_connection();
/// let pending = orders::table.filter(orders::shipped.eq(true)).filter(orders::email_sent.eq(false));
/// let report = pending
///     .build_claim()
///     .nowait() // a row locked by someone else is an error, not a skip
///     .max_rows(100)
///     .drain()
///     .each(&mut conn, |conn, order: Order| {
///         diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
///         Ok::<_, diesel_claim::Error>(())
///     })?;
/// assert_eq!(report.processed, 2);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a claim does nothing until `.each(conn, f)` runs it"]
pub struct ClaimBuilder<Q, M = Blocking, T = Select, H = NoHook> {
    pub(crate) query: Q,
    pub(crate) options: Options,
    pub(crate) kind: T,
    pub(crate) hook: H,
    pub(crate) mode: PhantomData<M>,
}

/// The longest [`ClaimBuilder::timeout`]: PostgreSQL counts a statement's
/// in milliseconds in an `int`.
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 24 * 3600);

impl<Q, M> ClaimBuilder<Q, M> {
    pub(crate) fn new(query: Q) -> Self {
        ClaimBuilder {
            query,
            options: Options {
                lock: LockOptions::default(),
                max_rows: None,
                drain: false,
                page_size: None,
                batch: 1,
                nested: false,
                keep_going: false,
                stop: None,
                in_worker: false,
                worker: None,
                failed_again: false,
                retry_schedule: false,
                timeout: None,
                reading: Reading::Chosen,
            },
            kind: Select(Keep),
            hook: NoHook,
            mode: PhantomData,
        }
    }
}

impl<Q, M, T, H> ClaimBuilder<Q, M, T, H> {
    /// The same claim on the query `query` makes of this one's, of the kind
    /// `kind`.
    pub(crate) fn with_kind<P, U>(
        self,
        query: impl FnOnce(Q) -> P,
        kind: U,
    ) -> ClaimBuilder<P, M, U, H> {
        ClaimBuilder {
            query: query(self.query),
            options: self.options,
            kind,
            hook: self.hook,
            mode: PhantomData,
        }
    }

    /// The same claim, with the failure hook `hook`.
    pub(crate) fn with_hook<G>(self, hook: G) -> ClaimBuilder<Q, M, T, G> {
        ClaimBuilder {
            query: self.query,
            options: self.options,
            kind: self.kind,
            hook,
            mode: PhantomData,
        }
    }

    /// Sets what to do with a row another transaction has locked. Choosing two
    /// different policies for one claim is an error reported by [`each`](Self::each).
    pub fn on_locked(mut self, policy: OnLocked) -> Self {
        self.options.lock.on_locked(policy);
        self
    }

    /// Leaves locked rows to whoever holds them (the default).
    pub fn skip_locked(self) -> Self {
        self.on_locked(OnLocked::Skip)
    }

    /// Fails with [`Error::LockNotAvailable`] when a candidate is locked by another
    /// transaction, before processing any row past it (it costs one more,
    /// unlocked, read per batch). It reads candidates in pages: not available
    /// with [`from_head`](Self::from_head), nor with
    /// [`mark_and_commit`](Self::mark_and_commit) and
    /// [`visibility_timeout`](Self::visibility_timeout).
    pub fn nowait(self) -> Self {
        self.on_locked(OnLocked::Fail)
    }

    /// Waits for locked rows; afterwards the row is re-checked against the filter.
    pub fn wait(self) -> Self {
        self.on_locked(OnLocked::Wait)
    }

    /// Sets the lock strength (PostgreSQL): [`NoKeyUpdate`](LockStrength::NoKeyUpdate),
    /// the default, or [`Update`](LockStrength::Update), which also holds off
    /// foreign-key inserts referencing the row. The shared strengths do not
    /// exclude other claimers and are an error.
    pub fn strength(mut self, strength: LockStrength) -> Self {
        if matches!(strength, LockStrength::Share | LockStrength::KeyShare) {
            self.options.lock.reject(format!(
                "a claim needs an exclusive lock: {strength:?} would let other claimers process \
                 the same row"
            ));
        }
        self.options.lock.strength(strength);
        self
    }

    /// Stops after processing `max_rows` rows (at least 1). The call never
    /// reads more candidates than it may still take; when one take can reach
    /// `max_rows` (`max_rows` no larger than the [batch](Self::batch)), it
    /// reads none: it takes [from the head](Self::from_head).
    pub fn max_rows(mut self, max_rows: u64) -> Self {
        if max_rows == 0 {
            self.options
                .lock
                .reject("max_rows must be at least 1".to_owned());
        }
        self.options.max_rows = Some(max_rows);
        self
    }

    /// Claims up to `rows` rows per transaction (at least 1; the default is 1).
    ///
    /// One statement locks the batch, the closure runs for every row of it (or
    /// once for the whole batch, with [`each_batch`](Self::each_batch)), and one
    /// commit ends it. The guarantees are those of a single row — each row is
    /// re-checked under its lock and processed at most once — but an error or a
    /// panic in the closure rolls back the **whole batch** and ends the call:
    /// rows the closure had already handled in it stay pending too, so work
    /// outside the database (an email sent) may be done again by the next
    /// claim. With [`keep_going`](Self::keep_going) or a [failure
    /// hook](Self::on_failure), each row's closure runs in a savepoint of its
    /// own instead, and only a failing row is rolled back. Locks are held
    /// until the batch commits.
    pub fn batch(mut self, rows: u32) -> Self {
        if rows == 0 {
            self.options
                .lock
                .reject("batch must be at least 1 row".to_owned());
        }
        self.options.batch = i64::from(rows);
        self
    }

    /// Repeats until a pass claims nothing new: rows skipped because they were
    /// locked are tried again, and rows added beyond the highest key already
    /// scanned are picked up. (Without it, a pass picks up rows added beyond
    /// only when it comes to them.) [From the head](Self::from_head), the
    /// takes go on until one comes back empty, rather than short.
    ///
    /// A row is never processed twice in one call, even when the closure leaves it
    /// matching the filter: later passes revisit only the rows found locked
    /// (one read per page tells those from rows others processed; those of a
    /// page are then retried as a page of their own, and only they are handed
    /// over from its range; with `mark`, one row at a time) and the rows
    /// beyond the highest key scanned.
    /// To tell what to retry, a drain keeps each batch within the page of
    /// candidates it was read from: with many workers, every worker then reads
    /// every page (see [`page_size`](Self::page_size)).
    pub fn drain(mut self) -> Self {
        self.options.drain = true;
        self
    }

    /// Sets how many candidate keys one read of the unlocked scan fetches
    /// (and so reads candidates in pages). Memory use is bounded by this and
    /// the batch size, not by the number of pending rows.
    ///
    /// By default, 100 keys or one batch, whichever is more: a batch may run
    /// past its page, and the next page is read from where it ended, so workers
    /// do not read the keys others take. A page's first batch starts at its
    /// first candidate, not where the last page ended. When draining, or
    /// marking (whose rows come back in no order), batches keep to their page
    /// and a page holds 1000 keys or ten batches; in an order other than the
    /// key's, 5000 keys or 50 batches. Never more than `max_rows` leaves to
    /// take.
    ///
    /// Once a take has passed over rows other workers hold or took, a claim by
    /// key spreads out for the rest of the call: its pages keep to their ends,
    /// each starts at a place of its own, and they grow while others take most
    /// of them (see [many workers](crate::guide#many-workers)). A page size
    /// set here does not grow.
    pub fn page_size(mut self, page_size: u32) -> Self {
        if page_size == 0 {
            self.options
                .lock
                .reject("page_size must be at least 1".to_owned());
        }
        self.options.page_size = Some(i64::from(page_size));
        self.in_pages()
    }

    /// Takes every batch from the head of the query, in one locking statement,
    /// `… ORDER BY <order>, <key> LIMIT n FOR … SKIP LOCKED`, with no
    /// candidates read first: a row enqueued ahead of the others (a job of
    /// higher priority) is the next one taken, and a call that finds nothing
    /// costs that one statement, in a transaction. [Workers](Self::worker)
    /// take from the head unless told [`in_pages`](Self::in_pages).
    ///
    /// What it gives up: takes of many workers all start at the head, each
    /// passing over the rows the others hold inside its statement, where
    /// pages spread workers out (see [many workers](crate::guide#many-workers));
    /// the report cannot tell rows others hold ([`locked`](ClaimReport::locked))
    /// or took ([`gone`](ClaimReport::gone)), which the statement passes
    /// over unseen; and the call keeps the key of every row it hands over,
    /// so that a row its closure leaves matching is not handed over twice
    /// (such rows, and failing ones, are then left out of the takes: past
    /// 1000 of them, the call ends). A worker's run ends every 10,000 rows,
    /// and the next starts afresh. Not available with
    /// [`nowait`](Self::nowait), [`page_size`](Self::page_size) or
    /// [`candidates_from`](Self::candidates_from), which read pages.
    pub fn from_head(mut self) -> Self {
        if self.options.reading == Reading::Pages {
            self.options.lock.reject(
                "from_head cannot be combined with page_size or in_pages: takes from the head \
                 read no pages"
                    .to_owned(),
            );
        }
        self.options.reading = Reading::Head;
        self
    }

    /// Reads candidates in pages, without locks, and takes each batch from
    /// within a page: the default of a call, and what spreads many workers
    /// out over a large backlog (see [many workers](crate::guide#many-workers)).
    /// A worker told so reads pages too.
    pub fn in_pages(mut self) -> Self {
        if self.options.reading == Reading::Head {
            self.options.lock.reject(
                "from_head cannot be combined with page_size or in_pages: takes from the head \
                 read no pages"
                    .to_owned(),
            );
        }
        self.options.reading = Reading::Pages;
        self
    }

    /// Goes on past a failing row: a closure that returns an error or panics
    /// has its work rolled back (the row stays pending), the row is counted
    /// in [`ClaimReport::failed`] and never tried again in this call, and the
    /// call goes on with the next rows. [`each_outcome`](Self::each_outcome)
    /// returns each failure with its key; [`each`](Self::each) only counts
    /// them. A panic becomes [`Error::ClosurePanicked`], converted into the
    /// closure's error type.
    ///
    /// With [`batch(n)`](Self::batch), each row's closure runs in a savepoint
    /// of the batch's transaction: a failing row is rolled back to its
    /// savepoint, and the other rows of the batch commit; no closure runs
    /// twice in one call. With [`each_batch`](Self::each_batch), the
    /// closure's batch fails whole. A [`mark`](Self::mark) can only be undone
    /// with its batch: without a failure hook, a failing row rolls back its
    /// whole batch (each of its rows counted as failed, none retried in the
    /// call). With [`mark_and_commit`](Self::mark_and_commit) the marks are
    /// committed before the closure runs: a failure is recorded, not undone.
    ///
    /// A row that fails on every attempt fails once per call, and is tried
    /// again by the next: write its attempts, error and next run time with a
    /// [failure hook](Self::on_failure), which implies `keep_going`.
    pub fn keep_going(mut self) -> Self {
        self.options.keep_going = true;
        self
    }

    /// Ends each closure call that runs longer than `timeout` (a row's, or a
    /// batch's with [`each_batch`](Self::each_batch), and with
    /// [`batch(n)`](Self::batch) when no failure hook, retry schedule or
    /// [`keep_going`](Self::keep_going) runs each row in a savepoint of its
    /// own: then the rows of a batch share one call), as a failure: its work
    /// is rolled back, its row counted in [`ClaimReport::failed`] and
    /// [`ClaimReport::timed_out`], and recorded by the claim's
    /// [failure hook](Self::on_failure) or [retry schedule](Self::retries)
    /// under its lock, with [`Error::TimedOut`] as its error; without either,
    /// and without [`keep_going`](Self::keep_going), the call ends with that
    /// error. `timeout` is more than 0 and at most 24 days.
    ///
    /// What it can end:
    ///
    /// - **On diesel-async** (`aio`), the closure's future is dropped at the
    ///   timeout, wherever it awaits. A statement of the closure's in flight
    ///   then is ended by PostgreSQL at the timeout (below); MySQL and
    ///   MariaDB run it to its end before the row's rollback can start.
    /// - **On a blocking connection**, a thread cannot be stopped from the
    ///   outside: a closure that runs past its timeout is a failure once it
    ///   returns, whatever it returned, and its work is rolled back then.
    /// - **On PostgreSQL**, either way, each statement of the closure is
    ///   ended by the server once it has run for the timeout (`SET LOCAL
    ///   statement_timeout`, one more statement per batch; counted from the
    ///   statement's own start, so a statement begun late in the closure can
    ///   run past the closure's timeout by up to the timeout): a closure
    ///   blocked on a slow query or a lock wait gets its error then. With
    ///   [`inside_transaction`](Self::inside_transaction) the setting lasts
    ///   to the end of the caller's transaction. MySQL, MariaDB and SQLite
    ///   have no bound for a transaction alone.
    ///
    /// Async, the timeout also sets the transactions' idle bound (unless
    /// [`idle_bound`](crate::ClaimBuilder::idle_bound) sets one): 30 s above
    /// the timeout, a backstop that the timeout keeps from firing.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        if timeout.is_zero() || timeout > MAX_TIMEOUT {
            self.options.lock.reject(format!(
                "timeout is more than 0 and at most {} days, got {timeout:?}",
                MAX_TIMEOUT.as_secs() / 86_400
            ));
        }
        self.options.timeout = Some(timeout);
        self
    }

    /// Ends the call once `stop` is [triggered](StopHandle::stop), before its
    /// next statement: the row or batch in hand is finished and committed
    /// first. The report counts what was done.
    pub fn stop_on(mut self, stop: &StopHandle) -> Self {
        self.options.stop = Some(stop.clone());
        self
    }

    /// Turns the claim into a worker that runs it over and over, waiting when
    /// nothing is pending, until `stop` is triggered: see [`ClaimWorker`]. A
    /// worker takes [from the head](Self::from_head) unless told
    /// [`in_pages`](Self::in_pages) (or given a page size, `nowait` or a
    /// replica).
    pub fn worker(mut self, stop: &StopHandle) -> ClaimWorker<Self> {
        self.options.in_worker = true;
        ClaimWorker::new(self.stop_on(stop), stop.clone())
    }

    /// Lets the claim run inside a transaction the caller has open, each batch
    /// in a savepoint of it: for tests that wrap each test in a transaction
    /// (`begin_test_transaction`) and roll it back.
    ///
    /// What such a test proves is what the claim does on one connection: which
    /// rows it hands over, in what order, what a failing row rolls back, what
    /// the report says. It proves nothing about concurrency: the row locks
    /// are held until the outer transaction ends, so other workers wait for
    /// it or skip every row it touched, and nothing is committed. Test that
    /// with workers on connections of their own, outside a transaction.
    pub fn inside_transaction(mut self) -> Self {
        self.options.nested = true;
        self
    }
}

impl<Q, M, H> ClaimBuilder<Q, M, Select, H> {
    /// Deletes each row whose closure succeeded, in its batch's transaction,
    /// once the batch's closures have run (one `DELETE … WHERE <key> IN (…)`
    /// for the batch): a job runner's "run it, then delete it", with the
    /// closure left to do the job's own work.
    ///
    /// On PostgreSQL, with a [failure hook](Self::on_failure) or
    /// [`keep_going`](Self::keep_going) (each row's closure then runs in a
    /// savepoint), prefer this to deleting the row in the closure: a row
    /// written in a savepoint of the transaction that locked it gets a
    /// `MultiXact` as its deleter, whose dead versions index scans cannot
    /// mark dead, and takes from the head of the queue slow down as deleted
    /// jobs pile up until vacuum (0.19 to 0.46 × the jobs per second with
    /// 4,000 queued, in [BENCHMARKS.md](https://github.com/diesel-claim/diesel-claim/blob/main/BENCHMARKS.md)). The crate's `DELETE` runs in the
    /// transaction that locked the rows.
    pub fn then_delete(self) -> ClaimBuilder<Q, M, Select<Delete>, H> {
        self.with_kind(|query| query, Select(Delete))
    }

    /// Updates each row whose closure succeeded with `changes`, in its
    /// batch's transaction, once the batch's closures have run (one `UPDATE …
    /// SET changes WHERE <key> IN (…)` for the batch): "run it, then mark it
    /// done". The changes should take the rows out of the query. See
    /// [`then_delete`](Self::then_delete) for why this beats writing the row
    /// in the closure on PostgreSQL.
    pub fn then_update<V>(self, changes: V) -> ClaimBuilder<Q, M, Select<Set<V>>, H> {
        self.with_kind(|query| query, Select(Set(changes)))
    }

    /// Claims and marks rows in one statement per batch, `UPDATE … SET changes
    /// WHERE <key> IN (<the query, locked, skipping locked rows, LIMIT batch>)
    /// RETURNING …`, then hands the rows (as updated) to the closure, all in the
    /// batch's transaction: an error in the closure rolls the mark back.
    ///
    /// The changes should take the rows out of the query (set the flag its filter
    /// tests); rows they leave matching are claimed again by the next call. One
    /// call never hands a row over twice: the batches move on by key, and a row
    /// inserted into a range already claimed from that comes back ends the call
    /// with [`Error::UnexpectedOutcome`]. The rows' type must be
    /// [`Selectable`](diesel::Selectable) from the claimed table. A failure
    /// hook runs with the row still marked (the mark came before the row's
    /// savepoint): the hook writes what a failed row becomes.
    pub fn mark<V>(self, changes: V) -> ClaimBuilder<Q, M, Mark<V>, H> {
        self.with_kind(
            |query| query,
            Mark {
                changes,
                commit_first: false,
            },
        )
    }

    /// Like [`mark`](Self::mark), but the marking statement commits on its own,
    /// before the closure runs: one round trip claims a batch (PostgreSQL: no
    /// `BEGIN`/`COMMIT`; SQLite: `BEGIN IMMEDIATE` around the one statement).
    ///
    /// **The closure's failure cannot un-mark the rows**: if it returns an error
    /// or panics, the batch stays marked and nobody processes it again (a
    /// failure hook runs in a transaction of its own, and may un-mark it). Use
    /// this when the mark is the processing (or when losing a batch to a crash
    /// is acceptable), and [`mark`](Self::mark) when the closure's work must
    /// succeed for the mark to stand.
    pub fn mark_and_commit<V>(self, changes: V) -> ClaimBuilder<Q, M, Mark<V>, H> {
        self.with_kind(
            |query| query,
            Mark {
                changes,
                commit_first: true,
            },
        )
    }

    /// Reads the candidates on `replica`, a connection to a read replica of
    /// the database the claim runs on: the unlocked reads that find rows to
    /// claim leave the primary, while every lock, re-check and write stays on
    /// the connection given to [`each`](ClaimBuilder::each).
    ///
    /// The double check makes this safe: a row is handed over only once the
    /// primary has re-checked it under the row's lock. A replica that lags
    /// costs re-checks of rows others have processed since (they are passed
    /// over as gone), and does not show rows committed on the primary after
    /// its last replay: a claim (a [`drain`](Self::drain) too) ends when the
    /// replica shows no more, and those rows are found by a later call. What
    /// is still pending of a page the claim passed over is read on the primary,
    /// so that [`skipped`](ClaimReport::skipped) counts only rows other workers
    /// hold. The replica's connection needs no transaction; it runs one
    /// `SELECT` of keys per page.
    ///
    /// ```no_run
    /// # include!("../doctest_setup.rs");
    /// use diesel_claim::prelude::*;
    ///
    /// # fn main() -> Result<(), diesel_claim::Error> {
    /// # let mut primary = establish_connection();
    /// # let mut replica = establish_connection();
    /// let pending = orders::table.filter(orders::shipped.eq(true)).filter(orders::email_sent.eq(false));
    /// let report = pending
    ///     .build_claim()
    ///     .batch(100)
    ///     .candidates_from(&mut replica)
    ///     .each(&mut primary, |conn, order: Order| {
    ///         diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
    ///         Ok::<_, diesel_claim::Error>(())
    ///     })?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn candidates_from<Rc>(self, replica: &mut Rc) -> ClaimBuilder<Q, M, Replica<'_, Rc>, H> {
        self.with_kind(|query| query, Replica { replica })
    }
}

impl<Q, T> ClaimBuilder<Q, Blocking, T, NoHook> {
    /// Records a failing row under its lock: when the closure fails (returns
    /// an error or panics), its work is rolled back to a savepoint, and
    /// `hook` runs with the row, as it was handed over, and the error, in the
    /// same transaction, the row still locked: an attempt count, the error
    /// and a next run time are written atomically with the row's release, and
    /// no other worker can take the row in between. The call then goes on
    /// (a hook implies [`keep_going`](Self::keep_going)), and the failure is
    /// reported ([`ClaimReport::failed`], [`ClaimOutcome::failed`]).
    ///
    /// If the hook fails, the batch's transaction rolls back and the call
    /// ends with the hook's error. The rows must be `Clone` (the hook gets
    /// the row as the closure got it), and the hook's row, and its error if
    /// it uses it, need their types named, as below: the hook is checked
    /// where it is given, before the claim's closure fixes the row type, so
    /// the compiler cannot infer them ("type annotations needed"). With a
    /// [visibility timeout](Self::visibility_timeout), the hook runs in a
    /// transaction that clears the row's stamp if the row still carries it
    /// (if not, another worker has the row, and the hook does not run); with
    /// [`mark_and_commit`](Self::mark_and_commit), in a transaction of its
    /// own; with [`mark`](Self::mark), with the row still marked.
    ///
    /// ```
    /// # include!("../doctest_setup.rs");
    /// use diesel_claim::prelude::*;
    ///
    /// # fn main() -> Result<(), diesel_claim::Error> {
    /// # let mut conn = establish_connection();
    /// // The queue: jobs not done, tried fewer than 3 times, by priority.
    /// let queue = jobs::table
    ///     .filter(jobs::done.eq(false))
    ///     .filter(jobs::attempts.lt(3))
    ///     .order(jobs::priority.desc())
    ///     .select(Job::as_select());
    /// let report = queue
    ///     .build_claim()
    ///     .on_failure(|conn, job: Job, error: &diesel_claim::Error| {
    ///         // Under the job's lock: one more attempt, and why.
    ///         diesel::update(&job)
    ///             .set((jobs::attempts.eq(jobs::attempts + 1), jobs::last_error.eq(error.to_string())))
    ///             .execute(conn)?;
    ///         Ok(())
    ///     })
    ///     .each(&mut conn, |conn, job: Job| {
    ///         if job.id == 3 {
    ///             return Err(diesel_claim::Error::InvalidArgument("no address".into()));
    ///         }
    ///         diesel::update(&job).set(jobs::done.eq(true)).execute(conn)?;
    ///         Ok(())
    ///     })?;
    /// assert_eq!((report.processed, report.failed), (2, 1));
    /// let attempts: i32 = jobs::table.find(3).select(jobs::attempts).first(&mut conn)?;
    /// assert_eq!(attempts, 1);
    /// # Ok(())
    /// # }
    /// ```
    pub fn on_failure<C, R, E, F>(self, hook: F) -> ClaimBuilder<Q, Blocking, T, OnFailure<F>>
    where
        F: FnMut(&mut C, R, &E) -> Result<(), E>,
    {
        self.with_hook(OnFailure(hook))
    }
}
