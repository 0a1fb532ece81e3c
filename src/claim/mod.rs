//! Claiming: process each row of a query at most once across workers.

use std::hash::Hash;
use std::marker::PhantomData;
use std::panic::{self, AssertUnwindSafe};

use diesel::connection::LoadConnection;
use diesel::prelude::*;
use diesel::query_builder::Query;

use crate::backend::ClaimBackend;
use crate::connection::BlockingConnection;
use crate::locking::{LockClause, LockOptions};
use crate::sql::{KeyRange, Position};
use crate::trace;
use crate::transaction::{
    again_if_moved, locking_read, locking_transaction, transaction_depth, transaction_outcome,
};
use crate::{Blocking, Error, LockStrength, OnLocked};

pub(crate) mod engine;
pub(crate) mod query;
mod report;
pub(crate) mod timed;
pub(crate) mod worker;

use engine::{Claim, Plan, Step, Taking};
pub(crate) use query::ClaimStatements;
pub use query::{ClaimQuery, MarkQuery, StampQuery};
pub use report::{ClaimOutcome, ClaimReport, RowFailure};
pub use timed::{Claimed, StampedRow, TimedClaim, TimedWorker};
#[cfg(feature = "postgres_backend")]
pub use worker::notify;
pub use worker::{ClaimWorker, StopHandle, WaitForRows};

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

impl<Q: Query> ClaimDsl for Q {}

impl<F> ClaimDsl for crate::Rebuild<F> {}

/// A claim and its options, made by [`ClaimDsl::build_claim`].
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
pub struct ClaimBuilder<Q, M = Blocking> {
    pub(crate) query: Q,
    lock: LockOptions,
    max_rows: Option<u64>,
    drain: bool,
    /// `None`: the default, which depends on the batch size.
    page_size: Option<i64>,
    batch: i64,
    /// Runs inside the caller's transaction, each batch in a savepoint.
    nested: bool,
    keep_going: bool,
    stop: Option<StopHandle>,
    /// Run by a worker, over and over (its spans are quieter).
    in_worker: bool,
    mode: PhantomData<M>,
}

impl<Q, M> ClaimBuilder<Q, M> {
    pub(crate) fn new(query: Q) -> Self {
        ClaimBuilder {
            query,
            lock: LockOptions::default(),
            max_rows: None,
            drain: false,
            page_size: None,
            batch: 1,
            nested: false,
            keep_going: false,
            stop: None,
            in_worker: false,
            mode: PhantomData,
        }
    }

    /// Sets what to do with a row another transaction has locked. Choosing two
    /// different policies for one claim is an error reported by [`each`](Self::each).
    pub fn on_locked(mut self, policy: OnLocked) -> Self {
        self.lock.on_locked(policy);
        self
    }

    /// Leaves locked rows to whoever holds them (the default).
    pub fn skip_locked(self) -> Self {
        self.on_locked(OnLocked::Skip)
    }

    /// Fails with [`Error::LockNotAvailable`] when a candidate is locked by another
    /// transaction, before processing any row past it (it costs one more,
    /// unlocked, read per batch). Not available with
    /// [`mark_and_commit`](Self::mark_and_commit).
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
            self.lock.reject(format!(
                "a claim needs an exclusive lock: {strength:?} would let other claimers process \
                 the same row"
            ));
        }
        self.lock.strength(strength);
        self
    }

    /// Stops after processing `max_rows` rows (at least 1).
    pub fn max_rows(mut self, max_rows: u64) -> Self {
        if max_rows == 0 {
            self.lock.reject("max_rows must be at least 1".to_owned());
        }
        self.max_rows = Some(max_rows);
        self
    }

    /// Claims up to `rows` rows per transaction (at least 1; the default is 1).
    ///
    /// One statement locks the batch, the closure runs for every row of it (or
    /// once for the whole batch, with [`each_batch`](Self::each_batch)), and one
    /// commit ends it. The guarantees are those of a single row — each row is
    /// re-checked under its lock and processed at most once — but an error or a
    /// panic in the closure rolls back the **whole batch**: rows the closure had
    /// already handled in it stay pending too, so work outside the database (an
    /// email sent) may be done again by the next claim. Locks are held until the
    /// batch commits.
    pub fn batch(mut self, rows: u32) -> Self {
        if rows == 0 {
            self.lock.reject("batch must be at least 1 row".to_owned());
        }
        self.batch = i64::from(rows);
        self
    }

    /// Repeats until a pass claims nothing new: rows skipped because they were
    /// locked are tried again, and rows added beyond the highest key already
    /// scanned are picked up. (Without it, a pass picks up rows added beyond
    /// only when it comes to them.)
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
        self.drain = true;
        self
    }

    /// Sets how many candidate keys one read of the unlocked scan fetches. Memory
    /// use is bounded by this and the batch size, not by the number of pending
    /// rows.
    ///
    /// By default, 100 keys or one batch, whichever is more: a batch may run
    /// past its page, and the next page is read from where it ended, so workers
    /// do not read the keys others take. A page's first batch starts at its
    /// first candidate, not where the last page ended. When draining, or
    /// marking (whose rows come back in no order), batches keep to their page
    /// and a page holds 1000 keys or ten batches.
    ///
    /// Once a take has passed over rows other workers hold or took, a claim by
    /// key spreads out for the rest of the call: its pages keep to their ends,
    /// each starts at a place of its own, and they grow while others take most
    /// of them (see [many workers](crate::guide#many-workers)). A page size
    /// set here does not grow.
    pub fn page_size(mut self, page_size: u32) -> Self {
        if page_size == 0 {
            self.lock.reject("page_size must be at least 1".to_owned());
        }
        self.page_size = Some(i64::from(page_size));
        self
    }

    /// Goes on past a failing row: a closure that returns an error or panics
    /// has its transaction rolled back (the row stays pending), the row is
    /// counted in [`ClaimReport::failed`] and never tried again in this call,
    /// and the call goes on with the next rows.
    /// [`each_outcome`](Self::each_outcome) returns each failure with its key;
    /// [`each`](Self::each) only counts them. A panic becomes
    /// [`Error::ClosurePanicked`], converted into the closure's error type.
    ///
    /// With [`batch(n)`](Self::batch), a failing batch is rolled back whole
    /// and its rows are then claimed again one at a time, each in a
    /// transaction of its own, so that one bad row holds back none of the
    /// others: the closure runs again for the rows it had handled before the
    /// failure (work outside the database may be done twice), and each retried
    /// row costs a transaction, as per-row claims do. A row another worker
    /// took meanwhile counts as [`gone`](ClaimReport::gone). With
    /// [`mark_and_commit`](Self::mark_and_commit) the marks are committed
    /// before the closure runs: a failing batch is recorded, not retried.
    ///
    /// A row that fails on every attempt fails once per call: keep a count of
    /// attempts in the row, and a dead-letter state, to stop retrying it
    /// across calls (see the [guide](crate::guide#rows-that-keep-failing)).
    pub fn keep_going(mut self) -> Self {
        self.keep_going = true;
        self
    }

    /// Ends the call once `stop` is [triggered](StopHandle::stop), before its
    /// next statement: the row or batch in hand is finished and committed
    /// first. The report counts what was done.
    pub fn stop_on(mut self, stop: &StopHandle) -> Self {
        self.stop = Some(stop.clone());
        self
    }

    /// Turns the claim into a worker that runs it over and over, waiting when
    /// nothing is pending, until `stop` is triggered: see [`ClaimWorker`].
    pub fn worker(self, stop: &StopHandle) -> ClaimWorker<Q, M> {
        ClaimWorker::new(self.in_worker(stop), stop.clone())
    }

    /// The claim as a worker runs it: until `stop`, its runs traced at
    /// debug level, inside the worker's span.
    pub(crate) fn in_worker(mut self, stop: &StopHandle) -> Self {
        self.in_worker = true;
        self.stop_on(stop)
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
        self.nested = true;
        self
    }

    /// Checks the options, the claimed table (the locking clause's `OF`) and the
    /// connection's transaction depth, and sets up one run of the claim, taking
    /// its rows with the statement `taking` describes.
    pub(crate) fn start<DB: ClaimBackend, R, S: ClaimStatements<DB, R>>(
        &self,
        taking: Taking,
        query: &S,
        transaction_depth: u32,
    ) -> Result<Claim<Position<S::Key>>, Error> {
        let (on_locked, clause) = self
            .lock
            .clone()
            .resolve(OnLocked::Skip, || query.claimed_table())?;
        if taking == Taking::MarkAndCommit && on_locked == OnLocked::Fail {
            return Err(Error::InvalidArgument(
                "nowait cannot be combined with mark_and_commit or visibility_timeout: their \
                 claims commit before a locked row could roll them back"
                    .to_owned(),
            ));
        }
        if transaction_depth > 0 && !self.nested {
            return Err(Error::InvalidArgument(
                "a claim must run outside a transaction: each batch needs a transaction of \
                 its own, committed before the next (for tests that run in a transaction, \
                 see .inside_transaction())"
                    .to_owned(),
            ));
        }
        Ok(Claim::new(Plan {
            clause,
            taking,
            row_locks: DB::ROW_LOCKS,
            update_returning: DB::UPDATE_RETURNING,
            grow_contended_pages: DB::GROW_CONTENDED_PAGES,
            fail_on_locked: on_locked == OnLocked::Fail,
            batch: self.batch,
            page_size: self.page_size,
            drain: self.drain,
            max_rows: self.max_rows,
            ordered_by_key: S::ORDERED_BY_KEY,
            keep_going: self.keep_going,
            stop: self.stop.clone(),
            in_worker: self.in_worker,
        }))
    }
}

impl<Q> ClaimBuilder<Q> {
    /// Runs the claim, calling `f` for every claimed row: see
    /// [`ClaimDsl::claim_each`] and [`batch`](Self::batch).
    pub fn each<'q, C, R, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Q: ClaimQuery<'q, C, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch_outcome(conn, per_row(f)).into_result()
    }

    /// Runs the claim, calling `f` once per claimed batch with its rows, in the
    /// claim order (see the [guide](crate::guide#the-claim-order)), inside the
    /// batch's transaction.
    pub fn each_batch<'q, C, R, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Q: ClaimQuery<'q, C, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch_outcome(conn, f).into_result()
    }

    /// Runs the claim as [`each`](Self::each) does, and returns everything it
    /// did: the report, counted up to where the call ended (also when an error
    /// ended it), the failures passed over with
    /// [`keep_going`](Self::keep_going), and what ended the call early, with
    /// the keys of the rows it rolled back.
    pub fn each_outcome<'q, C, R, E, F, Inferred>(
        self,
        conn: &mut C,
        f: F,
    ) -> ClaimOutcome<Q::Key, E>
    where
        Q: ClaimQuery<'q, C, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch_outcome(conn, per_row(f))
    }

    /// Runs the claim as [`each_batch`](Self::each_batch) does, and returns
    /// everything it did: see [`each_outcome`](Self::each_outcome).
    pub fn each_batch_outcome<'q, C, R, E, F, Inferred>(
        self,
        conn: &mut C,
        f: F,
    ) -> ClaimOutcome<Q::Key, E>
    where
        Q: ClaimQuery<'q, C, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
        E: From<Error>,
    {
        self.run(conn, f)
    }

    /// One run of the claim, as [`each_batch_outcome`](Self::each_batch_outcome).
    pub(crate) fn run<'q, C, R, E, F>(&self, conn: &mut C, f: F) -> ClaimOutcome<Q::Key, E>
    where
        Q: ClaimQuery<'q, C, R>,
        C: LoadConnection,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
        E: From<Error>,
    {
        let query = &self.query;
        let claim = transaction_depth(conn)
            .map_err(Error::from)
            .and_then(|depth| self.start::<C::Backend, R, _>(Taking::Select, query, depth));
        let select = |conn: &mut C, range, limit, clause: &LockClause| {
            query.rows(conn, range, limit, clause)
        };
        match claim {
            Ok(claim) => drive(claim, query, conn, select, on_primary(query), f),
            Err(error) => ClaimOutcome::refused(error.into()),
        }
    }
}

impl<Q, M> ClaimBuilder<Q, M> {
    /// Reads the candidates on `replica`, a connection to a read replica of
    /// the database the claim runs on: the unlocked reads that find rows to
    /// claim leave the primary, while every lock, re-check and write stays on
    /// the connection given to [`each`](ReplicaClaim::each).
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
    pub fn candidates_from<Rc>(self, replica: &mut Rc) -> ReplicaClaim<'_, Q, Rc, M> {
        ReplicaClaim {
            claim: self,
            replica,
        }
    }
}

/// A claim that reads its candidates on a replica, made by
/// [`ClaimBuilder::candidates_from`].
#[must_use = "a claim does nothing until `.each(conn, f)` runs it"]
pub struct ReplicaClaim<'r, Q, Rc, M = Blocking> {
    pub(crate) claim: ClaimBuilder<Q, M>,
    pub(crate) replica: &'r mut Rc,
}

impl<Q: std::fmt::Debug, Rc, M: std::fmt::Debug> std::fmt::Debug for ReplicaClaim<'_, Q, Rc, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaClaim")
            .field("claim", &self.claim)
            .finish_non_exhaustive()
    }
}

impl<Q, Rc> ReplicaClaim<'_, Q, Rc> {
    /// Runs the claim on `conn`, calling `f` for every claimed row: see
    /// [`ClaimBuilder::each`].
    pub fn each<'q, C, R, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Q: ClaimQuery<'q, C, R> + ClaimQuery<'q, Rc, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        Rc: LoadConnection<Backend = C::Backend>,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch_outcome(conn, per_row(f)).into_result()
    }

    /// Runs the claim on `conn`, calling `f` once per claimed batch: see
    /// [`ClaimBuilder::each_batch`].
    pub fn each_batch<'q, C, R, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Q: ClaimQuery<'q, C, R> + ClaimQuery<'q, Rc, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        Rc: LoadConnection<Backend = C::Backend>,
        F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch_outcome(conn, f).into_result()
    }

    /// Runs the claim as [`each`](Self::each) does, and returns everything it
    /// did: see [`ClaimBuilder::each_outcome`].
    pub fn each_outcome<'q, C, R, E, F, Inferred>(
        self,
        conn: &mut C,
        f: F,
    ) -> ClaimOutcome<<Q as ClaimStatements<C::Backend, R>>::Key, E>
    where
        Q: ClaimQuery<'q, C, R> + ClaimQuery<'q, Rc, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        Rc: LoadConnection<Backend = C::Backend>,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch_outcome(conn, per_row(f))
    }

    /// Runs the claim as [`each_batch`](Self::each_batch) does, and returns
    /// everything it did: see [`ClaimBuilder::each_outcome`].
    pub fn each_batch_outcome<'q, C, R, E, F, Inferred>(
        self,
        conn: &mut C,
        f: F,
    ) -> ClaimOutcome<<Q as ClaimStatements<C::Backend, R>>::Key, E>
    where
        Q: ClaimQuery<'q, C, R> + ClaimQuery<'q, Rc, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        Rc: LoadConnection<Backend = C::Backend>,
        F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
        E: From<Error>,
    {
        let ReplicaClaim { claim, replica } = self;
        let query = &claim.query;
        let run = transaction_depth(conn)
            .map_err(Error::from)
            .and_then(|depth| claim.start::<C::Backend, R, _>(Taking::Select, query, depth));
        let select = |conn: &mut C, range, limit, clause: &LockClause| {
            ClaimQuery::<'q, C, R>::rows(query, conn, range, limit, clause)
        };
        let candidates =
            |_: &mut C, range, limit| ClaimQuery::<'q, Rc, R>::keys(query, replica, range, limit);
        match run {
            Ok(run) => drive(run, query, conn, select, candidates, f),
            Err(error) => ClaimOutcome::refused(error.into()),
        }
    }
}

impl<Q, M> ClaimBuilder<Q, M> {
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
    /// [`Selectable`](diesel::Selectable) from the claimed table.
    pub fn mark<V>(self, changes: V) -> MarkedClaim<Q, V, M> {
        MarkedClaim {
            claim: self,
            changes,
            taking: Taking::Mark,
        }
    }

    /// Like [`mark`](Self::mark), but the marking statement commits on its own,
    /// before the closure runs: one round trip claims a batch (PostgreSQL: no
    /// `BEGIN`/`COMMIT`; SQLite: `BEGIN IMMEDIATE` around the one statement).
    ///
    /// **The closure's failure cannot un-mark the rows**: if it returns an error
    /// or panics, the batch stays marked and nobody processes it again. Use this
    /// when the mark is the processing (or when losing a batch to a crash is
    /// acceptable), and [`mark`](Self::mark) when the closure's work must succeed
    /// for the mark to stand.
    pub fn mark_and_commit<V>(self, changes: V) -> MarkedClaim<Q, V, M> {
        MarkedClaim {
            claim: self,
            changes,
            taking: Taking::MarkAndCommit,
        }
    }
}

/// A claim that marks its rows in the statement that claims them, made by
/// [`ClaimBuilder::mark`] or [`ClaimBuilder::mark_and_commit`].
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
///     .batch(100)
///     .mark(orders::email_sent.eq(true))
///     .each_batch(&mut conn, |conn, orders: Vec<Order>| {
///         assert!(orders.iter().all(|order| order.email_sent));
///         Ok::<_, diesel_claim::Error>(())
///     })?;
/// assert_eq!(report.processed, 2);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a claim does nothing until `.each(conn, f)` runs it"]
pub struct MarkedClaim<Q, V, M = Blocking> {
    pub(crate) claim: ClaimBuilder<Q, M>,
    pub(crate) changes: V,
    pub(crate) taking: Taking,
}

impl<Q, V> MarkedClaim<Q, V> {
    /// Runs the claim, calling `f` for every claimed (and marked) row.
    pub fn each<'q, C, R, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Q: MarkQuery<'q, C, R, V>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch_outcome(conn, per_row(f)).into_result()
    }

    /// Runs the claim, calling `f` once per claimed (and marked) batch, its rows
    /// in the claim order (a row inserted since the page was read, last).
    pub fn each_batch<'q, C, R, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Q: MarkQuery<'q, C, R, V>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch_outcome(conn, f).into_result()
    }

    /// Runs the claim as [`each`](Self::each) does, and returns everything it
    /// did: see [`ClaimBuilder::each_outcome`].
    pub fn each_outcome<'q, C, R, E, F, Inferred>(
        self,
        conn: &mut C,
        f: F,
    ) -> ClaimOutcome<Q::Key, E>
    where
        Q: MarkQuery<'q, C, R, V>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch_outcome(conn, per_row(f))
    }

    /// Runs the claim as [`each_batch`](Self::each_batch) does, and returns
    /// everything it did: see [`ClaimBuilder::each_outcome`].
    pub fn each_batch_outcome<'q, C, R, E, F, Inferred>(
        self,
        conn: &mut C,
        f: F,
    ) -> ClaimOutcome<Q::Key, E>
    where
        Q: MarkQuery<'q, C, R, V>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
        E: From<Error>,
    {
        let MarkedClaim {
            claim,
            changes,
            taking,
        } = self;
        let query = &claim.query;
        let run = Q::check_changes(&changes)
            .and_then(|()| transaction_depth(conn).map_err(Error::from))
            .and_then(|depth| claim.start::<C::Backend, R, _>(taking, query, depth));
        let mark = |conn: &mut C, range, limit, clause: &LockClause| {
            query.mark(conn, range, limit, clause, &changes)
        };
        match run {
            Ok(run) => drive(run, query, conn, mark, on_primary(query), f),
            Err(error) => ClaimOutcome::refused(error.into()),
        }
    }
}

/// A batch closure that calls `f` for each row of the batch, in order.
pub(crate) fn per_row<C, R, E>(
    mut f: impl FnMut(&mut C, R) -> Result<(), E>,
) -> impl FnMut(&mut C, Vec<R>) -> Result<(), E> {
    move |conn, rows| rows.into_iter().try_for_each(|row| f(&mut *conn, row))
}

/// Runs a claim on a blocking connection: its reads, and its batches each in a
/// transaction of their own, claimed by `take`.
fn drive<'q, Q, C, R, K, T, G, E, F>(
    mut claim: Claim<Position<K>>,
    query: &Q,
    conn: &mut C,
    mut take: T,
    mut candidates: G,
    mut f: F,
) -> ClaimOutcome<K, E>
where
    Q: ClaimQuery<'q, C, R, Key = K>,
    K: Clone + Eq + Hash,
    C: LoadConnection,
    C::Backend: ClaimBackend,
    T: FnMut(&mut C, KeyRange<Position<K>>, i64, &LockClause) -> QueryResult<Vec<R>>,
    G: ReadCandidates<C, K>,
    F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
    E: From<Error>,
{
    let span = claim.span::<Q, C::Backend, R>();
    let mut failed = Vec::new();
    let (take, candidates) = (&mut take, &mut candidates);
    let stopped = span
        .in_scope(|| {
            run_steps(
                &mut claim,
                query,
                conn,
                take,
                candidates,
                &mut f,
                &mut failed,
            )
        })
        .err();
    ClaimOutcome::ended(claim.report(), failed, stopped, &span)
}

/// The loop of [`drive`]: runs the claim's steps until it is done, recording
/// the failures passed over; an error ends it.
#[allow(clippy::too_many_arguments)]
fn run_steps<'q, Q, C, R, K, T, G, E, F>(
    claim: &mut Claim<Position<K>>,
    query: &Q,
    conn: &mut C,
    take: &mut T,
    candidates: &mut G,
    f: &mut F,
    failed: &mut Vec<RowFailure<K, E>>,
) -> Result<(), RowFailure<K, E>>
where
    Q: ClaimQuery<'q, C, R, Key = K>,
    K: Clone + Eq + Hash,
    C: LoadConnection,
    C::Backend: ClaimBackend,
    T: FnMut(&mut C, KeyRange<Position<K>>, i64, &LockClause) -> QueryResult<Vec<R>>,
    G: ReadCandidates<C, K>,
    F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
    E: From<Error>,
{
    let outside = |error| RowFailure::new(Vec::new(), E::from(error));
    let catch_panics = claim.keep_going;
    while let Some((range, limit)) =
        next_batch_reading(claim, query, conn, candidates).map_err(outside)?
    {
        // The keys of the rows handed to the closure, once it has failed.
        let mut failing: Option<Vec<K>> = None;
        let span = trace::debug_span!("batch", limit, taken = trace::Empty, outcome = trace::Empty);
        let batch = {
            let _entered = span.enter();
            if claim.taking == Taking::MarkAndCommit {
                let rows = take_and_commit(claim, conn, take, range, limit, position_of::<Q, _, _>)
                    .map_err(outside)?;
                let processed = rows.len();
                // The mark committed on its own: the closure's failure cannot undo it.
                span.record("taken", processed)
                    .record("outcome", "committed");
                let called = match processed {
                    0 => Ok(()),
                    _ => {
                        let keys = rows.iter().map(Q::key).collect();
                        call(|| f(conn, rows), catch_panics).inspect_err(|_| failing = Some(keys))
                    }
                };
                called.map(|()| processed)
            } else {
                let batch = again_if_moved(|moved| {
                    failing = None;
                    locking_transaction(conn, claim.nowait, |conn| {
                        let rows = take(conn, range.clone(), limit, &claim.clause);
                        let rows = locking_read(rows, moved)?;
                        let rows = claim.taken(rows, limit, position_of::<Q, _, _>)?;
                        span.record("taken", rows.len());
                        if let Some(range) = claim.locked_check(range.clone()) {
                            let keys = query.keys(conn, range, i64::MAX).map_err(Error::from)?;
                            claim.verify_none_locked(keys, &rows, position_of::<Q, _, _>)?;
                        }
                        let processed = rows.len();
                        if processed > 0 {
                            let keys = rows.iter().map(Q::key).collect();
                            call(|| f(conn, rows), catch_panics)
                                .inspect_err(|_| failing = Some(keys))?;
                        }
                        Ok::<_, E>(processed)
                    })
                });
                span.record("outcome", transaction_outcome(&batch));
                batch
            }
        };
        match (batch, failing) {
            (Ok(processed), _) => claim.processed(processed),
            (Err(error), Some(keys)) if claim.keep_going => {
                if keys.len() > 1 && claim.taking != Taking::MarkAndCommit {
                    // Which row failed is unknown: each is claimed again alone.
                    for key in keys {
                        retry_alone(claim, conn, take, f, failed, key)?;
                    }
                } else {
                    claim.failed(keys.len());
                    failed.push(RowFailure::new(keys, error));
                }
            }
            (Err(error), keys) => return Err(RowFailure::new(keys.unwrap_or_default(), error)),
        }
    }
    Ok(())
}

/// The range of a batch, and how many rows it may take.
pub(crate) type NextBatch<K> = (KeyRange<Position<K>>, i64);

/// Carries out the claim's unlocked reads until it asks for a batch: the
/// batch's range and row limit, or `None` once the claim is done.
pub(crate) fn next_batch<'q, Q, C, R, K>(
    claim: &mut Claim<Position<K>>,
    query: &Q,
    conn: &mut C,
) -> Result<Option<NextBatch<K>>, Error>
where
    Q: ClaimQuery<'q, C, R, Key = K>,
    K: Clone + Eq + Hash,
    C: LoadConnection,
    C::Backend: ClaimBackend,
{
    next_batch_reading(claim, query, conn, &mut on_primary(query))
}

/// Reads a page of candidates' keys, without locks: `(conn, range, limit)`,
/// where `conn` is the connection the claim locks rows on.
pub(crate) trait ReadCandidates<C, K>:
    FnMut(&mut C, KeyRange<Position<K>>, i64) -> QueryResult<Vec<Position<K>>>
{
}

impl<C, K, G> ReadCandidates<C, K> for G where
    G: FnMut(&mut C, KeyRange<Position<K>>, i64) -> QueryResult<Vec<Position<K>>>
{
}

/// Candidates read on the connection that locks the rows.
fn on_primary<'a, 'q, Q, C, R>(query: &'a Q) -> impl ReadCandidates<C, Q::Key> + 'a
where
    Q: ClaimQuery<'q, C, R>,
    C: Connection,
{
    move |conn: &mut C, range, limit| query.keys(conn, range, limit)
}

/// [`next_batch`], with the candidates read by `candidates` (on a replica,
/// say); what still matches of a page is read on `conn`, as it must be exact.
pub(crate) fn next_batch_reading<'q, Q, C, R, K, G>(
    claim: &mut Claim<Position<K>>,
    query: &Q,
    conn: &mut C,
    candidates: &mut G,
) -> Result<Option<NextBatch<K>>, Error>
where
    Q: ClaimQuery<'q, C, R, Key = K>,
    K: Clone + Eq + Hash,
    C: LoadConnection,
    C::Backend: ClaimBackend,
    G: ReadCandidates<C, K>,
{
    loop {
        match claim.next() {
            Step::Candidates(range, limit) => claim.candidates(candidates(conn, range, limit)?),
            Step::StillMatching(range) => {
                claim.still_matching(query.keys(conn, range, i64::MAX)?);
            }
            Step::Batch(range, limit) => return Ok(Some((range, limit))),
            Step::Done => return Ok(None),
        }
    }
}

/// Claims a batch with a statement that commits on its own (or in a
/// transaction of its own, where the backend needs one), before any closure
/// runs: a mark that is committed, or a visibility-timeout stamp.
pub(crate) fn take_and_commit<C, R, K, T>(
    claim: &mut Claim<Position<K>>,
    conn: &mut C,
    take: &mut T,
    range: KeyRange<Position<K>>,
    limit: i64,
    position_of: impl Fn(&R) -> Position<K>,
) -> Result<Vec<R>, Error>
where
    K: Clone + Eq + Hash,
    C: LoadConnection,
    C::Backend: ClaimBackend,
    T: FnMut(&mut C, KeyRange<Position<K>>, i64, &LockClause) -> QueryResult<Vec<R>>,
{
    let rows = again_if_moved(|moved| {
        let mut take =
            |conn: &mut C| locking_read(take(conn, range.clone(), limit, &claim.clause), moved);
        if claim.one_statement_mark {
            take(conn)
        } else {
            // SQLite: a lone `UPDATE` would read first and then fail to take
            // the write lock if another writer got in between. MySQL: the
            // mark is three statements.
            locking_transaction(conn, claim.nowait, take)
        }
    })?;
    claim.taken(rows, limit, position_of)
}

/// Claims the row at `key` of a failed batch again, alone, in a transaction of
/// its own, and runs the closure for it ([`ClaimBuilder::keep_going`]).
fn retry_alone<C, R, K, T, E, F>(
    claim: &mut Claim<Position<K>>,
    conn: &mut C,
    take: &mut T,
    f: &mut F,
    failed: &mut Vec<RowFailure<K, E>>,
    key: K,
) -> Result<(), RowFailure<K, E>>
where
    K: Clone + Eq + Hash,
    C: LoadConnection,
    C::Backend: ClaimBackend,
    T: FnMut(&mut C, KeyRange<Position<K>>, i64, &LockClause) -> QueryResult<Vec<R>>,
    F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
    E: From<Error>,
{
    let Some(range) = claim.only(&Position::of_key(key.clone())) else {
        claim.left_pending();
        return Ok(());
    };
    let mut closure_failed = false;
    let span = trace::debug_span!(
        "batch",
        limit = 1,
        taken = trace::Empty,
        outcome = trace::Empty
    );
    let retried = span.in_scope(|| {
        again_if_moved(|moved| {
            closure_failed = false;
            locking_transaction(conn, claim.nowait, |conn| {
                let rows = locking_read(take(conn, range.clone(), 1, &claim.clause), moved)?;
                let processed = rows.len();
                span.record("taken", processed);
                if processed > 0 {
                    call(|| f(conn, rows), true).inspect_err(|_| closure_failed = true)?;
                }
                Ok::<_, E>(processed)
            })
        })
    });
    span.record("outcome", transaction_outcome(&retried));
    match retried {
        Ok(0) => claim.gone(),
        Ok(processed) => claim.processed(processed),
        Err(error) if closure_failed => {
            claim.failed(1);
            failed.push(RowFailure::new(vec![key], error));
        }
        Err(error) => return Err(RowFailure::new(Vec::new(), error)),
    }
    Ok(())
}

/// Runs the closure (on a batch, or a row); with `catch_panics`, a panic is
/// its error ([`Error::ClosurePanicked`]).
pub(crate) fn call<E: From<Error>>(
    f: impl FnOnce() -> Result<(), E>,
    catch_panics: bool,
) -> Result<(), E> {
    if !catch_panics {
        return f();
    }
    panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| Err(panicked(&*payload)))
}

/// A closure's panic, as its error ([`Error::ClosurePanicked`]).
pub(crate) fn panicked<E: From<Error>>(payload: &(dyn std::any::Any + Send)) -> E {
    let message = panic_message(payload);
    trace::warning!(panic = %message, "a closure panicked (keep_going)");
    Error::ClosurePanicked(message).into()
}

/// The message a panic was raised with.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// A claimed row's key, as the claim engine compares positions (by key).
pub(crate) fn position_of<Q: ClaimStatements<DB, R>, DB, R>(row: &R) -> Position<Q::Key> {
    Position::of_key(Q::key(row))
}
