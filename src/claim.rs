//! Claiming: process each row of a query at most once across workers.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::marker::PhantomData;
use std::sync::Arc;

use diesel::associations::HasTable;
use diesel::connection::Connection;
use diesel::dsl;
use diesel::prelude::*;
use diesel::query_builder::{Query, QueryFragment};
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::query_dsl::methods::{FilterDsl, LimitDsl, OrderDsl, SelectDsl};
use diesel::query_dsl::LoadQuery;

use crate::backend::strategy::Strategy;
use crate::backend::{transaction_depth, ClaimBackend};
use crate::query::{
    lock_target, InList, InRange, KeyRange, KeysIn, LockClause, LockOptions, Locked, Lower,
    Returning, SelectWhere, Update,
};
use crate::transaction::locking_transaction;
use crate::{Blocking, Error, LockStrength, OnLocked};

/// Rows read per page of the unlocked candidate scan, unless batches are large.
const DEFAULT_PAGE_SIZE: i64 = 1000;

/// Rows read per page of the candidate scan, at least, when takes may run
/// past their page.
const MIN_OPEN_PAGE_SIZE: i64 = 100;

/// Batches per page of the candidate scan, by default, when takes keep to
/// their page.
const BATCHES_PER_PAGE: i64 = 10;

/// What one call of [`claim_each`](ClaimDsl::claim_each) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimReport {
    /// Rows the closure processed and whose transaction committed.
    pub processed: u64,
    /// Candidates this call read and did not process: locked by someone else, or
    /// no longer matching the query when it came to lock them. (Rows a locking
    /// statement passes over past the candidates read are not counted.)
    pub skipped: u64,
    /// Passes over the candidates (more than one only when draining).
    pub passes: u32,
}

/// Adds [`claim_each`](ClaimDsl::claim_each) to Diesel queries.
///
/// See the [crate documentation](crate#claiming-claim_each) for the algorithm and
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
    fn claim_each<'q, C, R, E, F>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Self: ClaimQuery<'q, C, R>,
        C: Connection,
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

/// A claim and its options, made by [`ClaimDsl::build_claim`].
///
/// ```
/// # include!("doctest_setup.rs");
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
    /// (one read per page tells those from rows others processed; they are then
    /// retried one row at a time) and the rows beyond the highest key scanned.
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
    pub fn page_size(mut self, page_size: u32) -> Self {
        if page_size == 0 {
            self.lock.reject("page_size must be at least 1".to_owned());
        }
        self.page_size = Some(i64::from(page_size));
        self
    }

    /// Checks the options, the claimed table (the locking clause's `OF`) and the
    /// connection's transaction depth, and sets up one run of the claim, taking
    /// its rows with the statement `taking` describes.
    pub(crate) fn start<DB: ClaimBackend, K>(
        &self,
        taking: Taking,
        claimed_table: Result<Option<Arc<str>>, Error>,
        transaction_depth: u32,
    ) -> Result<Claim<K>, Error> {
        let (on_locked, clause) = self
            .lock
            .clone()
            .resolve(OnLocked::Skip, || claimed_table)?;
        if taking == Taking::MarkAndCommit && on_locked == OnLocked::Fail {
            return Err(Error::InvalidArgument(
                "nowait cannot be combined with mark_and_commit: the mark commits before a \
                 locked row could roll it back"
                    .to_owned(),
            ));
        }
        if transaction_depth > 0 {
            return Err(Error::InvalidArgument(
                "a claim must run outside a transaction: each batch needs a transaction of \
                 its own, committed before the next"
                    .to_owned(),
            ));
        }
        let row_locks = DB::ROW_LOCKS;
        // Rows that come back in key order tell how far a take went, so takes
        // can run past the page; a drain keeps to its pages, whose candidates
        // it retries.
        let open_ended = taking == Taking::Select && !self.drain;
        Ok(Claim {
            clause,
            taking,
            row_locks,
            one_statement_mark: row_locks && DB::UPDATE_RETURNING,
            fail_on_locked: row_locks && on_locked == OnLocked::Fail,
            batch: self.batch,
            open_ended,
            page_size: self.page_size.unwrap_or(if open_ended {
                // Takes move on by themselves: reading much further ahead than
                // a batch would only re-read keys other workers take first.
                MIN_OPEN_PAGE_SIZE.max(self.batch)
            } else {
                // Pages of several batches: workers that arrive at a page
                // together then take whole batches from it, each passing
                // over the others'.
                DEFAULT_PAGE_SIZE.max(self.batch.saturating_mul(BATCHES_PER_PAGE))
            }),
            drain: self.drain,
            remaining: self.max_rows.unwrap_or(u64::MAX),
            report: ClaimReport::default(),
            retry: Vec::new(),
            state: State::Pass,
            cursor: None,
            skipped: 0,
            processed_before_pass: 0,
        })
    }
}

impl<Q> ClaimBuilder<Q> {
    /// Runs the claim, calling `f` for every claimed row: see
    /// [`ClaimDsl::claim_each`] and [`batch`](Self::batch).
    pub fn each<'q, C, R, E, F>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Q: ClaimQuery<'q, C, R>,
        C: Connection,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch(conn, per_row(f))
    }

    /// Runs the claim, calling `f` once per claimed batch with its rows, in key
    /// order, inside the batch's transaction.
    pub fn each_batch<'q, C, R, E, F>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Q: ClaimQuery<'q, C, R>,
        C: Connection,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
        E: From<Error>,
    {
        let query = &self.query;
        let depth = transaction_depth(conn).map_err(Error::from)?;
        let claim = self.start::<C::Backend, _>(Taking::Select, query.claimed_table(), depth)?;
        let select = |conn: &mut C, range, limit, clause: &LockClause| {
            query.rows(conn, range, limit, clause)
        };
        drive(claim, query, conn, select, f)
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
    /// [`Selectable`](diesel::Selectable) from the claimed table.
    pub fn mark<V>(self, changes: V) -> MarkedClaim<Q, V> {
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
    pub fn mark_and_commit<V>(self, changes: V) -> MarkedClaim<Q, V> {
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
/// # include!("doctest_setup.rs");
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
pub struct MarkedClaim<Q, V> {
    claim: ClaimBuilder<Q>,
    changes: V,
    taking: Taking,
}

/// The statement a claim takes its rows with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Taking {
    /// A locking select: rows come back in key order.
    Select,
    /// A marking `UPDATE … RETURNING`: rows come back in no particular order.
    Mark,
    /// The same, committed on its own before the closure runs.
    MarkAndCommit,
}

impl<Q, V> MarkedClaim<Q, V> {
    /// Runs the claim, calling `f` for every claimed (and marked) row.
    pub fn each<'q, C, R, E, F>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Q: MarkQuery<'q, C, R, V>,
        C: Connection,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch(conn, per_row(f))
    }

    /// Runs the claim, calling `f` once per claimed (and marked) batch, rows in no
    /// particular order.
    pub fn each_batch<'q, C, R, E, F>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Q: MarkQuery<'q, C, R, V>,
        C: Connection,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
        E: From<Error>,
    {
        let MarkedClaim {
            claim,
            changes,
            taking,
        } = self;
        Q::check_changes(&changes)?;
        let query = &claim.query;
        let depth = transaction_depth(conn).map_err(Error::from)?;
        let run = claim.start::<C::Backend, _>(taking, query.claimed_table(), depth)?;
        let mark = |conn: &mut C, range, limit, clause: &LockClause| {
            query.mark(conn, range, limit, clause, &changes)
        };
        drive(run, query, conn, mark, f)
    }
}

/// A batch closure that calls `f` for each row of the batch, in order.
fn per_row<C, R, E>(
    mut f: impl FnMut(&mut C, R) -> Result<(), E>,
) -> impl FnMut(&mut C, Vec<R>) -> Result<(), E> {
    move |conn, rows| rows.into_iter().try_for_each(|row| f(&mut *conn, row))
}

/// One run of a claim, as a state machine: [`next`](Self::next) says what to
/// read or claim next, and the driver (blocking here, async in `aio`) reports
/// back what it read. Everything but the I/O and the closure is decided here, so
/// both drivers claim alike.
pub(crate) struct Claim<K> {
    pub(crate) clause: LockClause,
    pub(crate) taking: Taking,
    row_locks: bool,
    /// A mark is one statement that is atomic on its own (`UPDATE … RETURNING`
    /// with row locks).
    pub(crate) one_statement_mark: bool,
    fail_on_locked: bool,
    batch: i64,
    /// Takes run past the end of their page: see [`Page::open_ended`].
    open_ended: bool,
    page_size: i64,
    drain: bool,
    remaining: u64,
    report: ClaimReport,
    /// Candidates found locked by others in this pass, to retry in the next
    /// (only when draining, on backends with row locks).
    retry: Vec<K>,
    state: State<K>,
    /// The highest key scanned for candidates so far.
    cursor: Option<K>,
    /// Candidates passed over in this pass.
    skipped: u64,
    processed_before_pass: u64,
}

/// What a claim does next, for its driver to carry out.
pub(crate) enum Step<K> {
    /// Read up to `limit` keys of the query's rows in the range, without locks,
    /// and hand them to [`Claim::candidates`].
    Candidates(KeyRange<K>, i64),
    /// Read every key of the query's rows in the range, without locks, and hand
    /// them to [`Claim::still_matching`].
    StillMatching(KeyRange<K>),
    /// Claim up to `limit` rows of the range, in a transaction of the batch's
    /// own (see [`Claim::taken`]), run the closure, and report to
    /// [`Claim::processed`].
    Batch(KeyRange<K>, i64),
    /// The claim is over.
    Done(ClaimReport),
}

enum State<K> {
    /// A pass begins: the candidates found locked in the last pass come first.
    Pass,
    /// Retrying those, one page each.
    Retry(std::vec::IntoIter<K>),
    /// Reading the next page of candidates.
    Scan,
    /// Waiting for a page of candidates.
    Scanning,
    /// Claiming batches from a page; `then` comes after it.
    Page(Page<K>, Then<K>),
    /// Waiting to learn which of the page's unprocessed candidates still match.
    Sorting(Page<K>, Then<K>),
    /// The pass is over.
    PassEnd,
    Done,
}

/// Where a claim goes after a page.
enum Then<K> {
    Retry(std::vec::IntoIter<K>),
    Scan,
    PassEnd,
}

impl<K> From<Then<K>> for State<K> {
    fn from(then: Then<K>) -> Self {
        match then {
            Then::Retry(keys) => State::Retry(keys),
            Then::Scan => State::Scan,
            Then::PassEnd => State::PassEnd,
        }
    }
}

impl<K: Clone + Eq + Hash> Claim<K> {
    /// What to do next.
    pub(crate) fn next(&mut self) -> Step<K> {
        loop {
            match std::mem::replace(&mut self.state, State::Done) {
                State::Pass => {
                    self.report.passes += 1;
                    self.processed_before_pass = self.report.processed;
                    self.skipped = 0;
                    // Rows processed before are never visited again: only the
                    // rows found locked, then rows beyond the highest key seen.
                    self.state = State::Retry(std::mem::take(&mut self.retry).into_iter());
                }
                State::Retry(mut keys) => {
                    self.state = match keys.next() {
                        Some(key) => {
                            let page = Page::new(vec![key], false);
                            State::Page(page, Then::Retry(keys))
                        }
                        None => State::Scan,
                    };
                }
                State::Scan if self.remaining > 0 => {
                    self.state = State::Scanning;
                    return Step::Candidates(KeyRange::after(self.cursor.clone()), self.page_size);
                }
                State::Scan => self.state = State::PassEnd,
                State::Page(page, then) if self.remaining > 0 && !page.exhausted => {
                    let limit = i64::try_from(self.remaining)
                        .map_or(self.batch, |left| left.min(self.batch));
                    let range = page.next_range();
                    self.state = State::Page(page, then);
                    return Step::Batch(range, limit);
                }
                State::Page(page, then) => {
                    let then = match then {
                        Then::Retry(keys) => Then::Retry(keys),
                        // An open-ended take that came back short found nothing
                        // claimable beyond.
                        _ if self.open_ended && page.ran_dry => Then::PassEnd,
                        scanned => scanned,
                    };
                    if !matches!(then, Then::Retry(_)) {
                        self.cursor = Some(page.scanned_through());
                    }
                    let unprocessed = page.unprocessed().count() as u64;
                    self.skipped += unprocessed;
                    if self.drain && self.row_locks && unprocessed > 0 && self.remaining > 0 {
                        // One read tells the candidates locked by others (still
                        // matching) from those others have processed since.
                        let range = page.whole_range();
                        self.state = State::Sorting(page, then);
                        return Step::StillMatching(range);
                    }
                    self.state = then.into();
                }
                State::PassEnd => {
                    let claimed_nothing_new = self.report.processed == self.processed_before_pass;
                    if !self.drain || claimed_nothing_new || self.remaining == 0 {
                        self.report.skipped = self.skipped;
                        return Step::Done(self.report);
                    }
                    self.state = State::Pass;
                }
                State::Done => return Step::Done(self.report),
                State::Scanning | State::Sorting(..) => {
                    unreachable!("a claim's driver skipped a read it was asked for")
                }
            }
        }
    }

    /// The keys [`Step::Candidates`] read.
    pub(crate) fn candidates(&mut self, mut keys: Vec<K>) {
        let full_page = keys.len() as i64 == self.page_size;
        // A join to many rows repeats a key; keys come sorted.
        keys.dedup();
        if keys.is_empty() {
            self.state = State::PassEnd;
            return;
        }
        let page = Page::new(keys, self.open_ended);
        // Closed pages end where they end; open-ended ones where the takes got to.
        let then = if self.open_ended || full_page {
            Then::Scan
        } else {
            Then::PassEnd
        };
        self.state = State::Page(page, then);
    }

    /// The keys [`Step::StillMatching`] read.
    pub(crate) fn still_matching(&mut self, keys: Vec<K>) {
        let State::Sorting(page, then) = std::mem::replace(&mut self.state, State::Done) else {
            unreachable!("still_matching without a page to sort");
        };
        let still_matching: HashSet<K> = keys.into_iter().collect();
        let locked = page
            .unprocessed()
            .filter(|key| still_matching.contains(key));
        self.retry.extend(locked.cloned());
        self.state = then.into();
    }

    /// Records the rows a [`Step::Batch`] claimed (it asked for `limit`), in its
    /// transaction, and returns them as the closure gets them.
    pub(crate) fn taken<R>(
        &mut self,
        rows: Vec<R>,
        limit: i64,
        key_of: impl Fn(&R) -> K,
    ) -> Result<Vec<R>, Error> {
        let ordered = self.taking == Taking::Select;
        let State::Page(page, _) = &mut self.state else {
            unreachable!("rows taken outside a page");
        };
        page.record(rows, limit, ordered, key_of)
    }

    /// With [`nowait`](ClaimBuilder::nowait), the range to read keys of (without
    /// locks) after [`taken`](Self::taken), for
    /// [`verify_none_locked`](Self::verify_none_locked): the batch's range up to
    /// where it reached.
    pub(crate) fn locked_check(&self, mut range: KeyRange<K>) -> Option<KeyRange<K>> {
        let State::Page(page, _) = &self.state else {
            return None;
        };
        range.through = page.reached.clone();
        self.fail_on_locked.then_some(range)
    }

    /// Fails if a key [`locked_check`](Self::locked_check)'s range still
    /// matches the query but is not in the batch: someone else holds its lock.
    pub(crate) fn verify_none_locked<R>(
        &self,
        keys: Vec<K>,
        rows: &[R],
        key_of: impl Fn(&R) -> K,
    ) -> Result<(), Error> {
        let taken: HashSet<K> = rows.iter().map(key_of).collect();
        if keys.iter().any(|key| !taken.contains(key)) {
            return Err(Error::LockNotAvailable);
        }
        Ok(())
    }

    /// The batch committed with `rows` processed.
    pub(crate) fn processed(&mut self, rows: usize) {
        self.report.processed += rows as u64;
        self.remaining -= rows as u64;
    }
}

/// Runs a claim on a blocking connection: its reads, and its batches each in a
/// transaction of their own, claimed by `take`.
fn drive<'q, Q, C, R, K, T, E, F>(
    mut claim: Claim<K>,
    query: &Q,
    conn: &mut C,
    mut take: T,
    mut f: F,
) -> Result<ClaimReport, E>
where
    Q: ClaimQuery<'q, C, R, Key = K>,
    K: Clone + Eq + Hash,
    C: Connection,
    C::Backend: ClaimBackend,
    T: FnMut(&mut C, KeyRange<K>, i64, &LockClause) -> QueryResult<Vec<R>>,
    F: FnMut(&mut C, Vec<R>) -> Result<(), E>,
    E: From<Error>,
{
    loop {
        match claim.next() {
            Step::Candidates(range, limit) => {
                let keys = query.keys(conn, range, limit).map_err(Error::from)?;
                claim.candidates(keys);
            }
            Step::StillMatching(range) => {
                let keys = query.keys(conn, range, i64::MAX).map_err(Error::from)?;
                claim.still_matching(keys);
            }
            Step::Batch(range, limit) if claim.taking == Taking::MarkAndCommit => {
                let rows = if claim.one_statement_mark {
                    take(conn, range, limit, &claim.clause).map_err(Error::from)?
                } else {
                    // SQLite: a lone `UPDATE` would read first and then fail to
                    // take the write lock if another writer got in between.
                    // MySQL: the mark is three statements.
                    locking_transaction(conn, |conn| {
                        take(conn, range, limit, &claim.clause).map_err(Error::from)
                    })?
                };
                let rows = claim.taken(rows, limit, Q::key)?;
                let processed = rows.len();
                if processed > 0 {
                    f(conn, rows)?;
                }
                claim.processed(processed);
            }
            Step::Batch(range, limit) => {
                let processed = locking_transaction(conn, |conn| {
                    let rows =
                        take(conn, range.clone(), limit, &claim.clause).map_err(Error::from)?;
                    let rows = claim.taken(rows, limit, Q::key)?;
                    if let Some(range) = claim.locked_check(range) {
                        let keys = query.keys(conn, range, i64::MAX).map_err(Error::from)?;
                        claim.verify_none_locked(keys, &rows, Q::key)?;
                    }
                    let processed = rows.len();
                    if processed > 0 {
                        f(conn, rows)?;
                    }
                    Ok::<_, E>(processed)
                })?;
                claim.processed(processed);
            }
            Step::Done(report) => return Ok(report),
        }
    }
}

/// A page of candidate keys, in key order, and what has become of them.
struct Page<K> {
    /// Where the next batch starts: at the first candidate, then past the
    /// furthest candidate claimed so far. Not at the cursor: the rows between
    /// it and the first candidate were done when the page was read (by other
    /// workers, often), and a take starting there would step over every one of
    /// them inside its transaction.
    next: Lower<K>,
    keys: Vec<K>,
    position: HashMap<K, usize>,
    processed: Vec<bool>,
    /// Rows processed that were not candidates: inserted since the scan, or,
    /// when open-ended, beyond the page.
    newcomers: HashSet<K>,
    /// Takes run past the page's last key, to its first claimable rows
    /// wherever they are: the page's keys only tell which candidates the takes
    /// passed over. Else takes keep to the page.
    open_ended: bool,
    /// The page has no more to give.
    exhausted: bool,
    /// The last take came back short: nothing more in its range is claimable.
    ran_dry: bool,
    /// How far the takes have gone through the range, inclusive (`None`: to the
    /// end of it, when open-ended).
    reached: Option<K>,
}

impl<K: Clone + Eq + Hash> Page<K> {
    fn new(keys: Vec<K>, open_ended: bool) -> Self {
        let position = keys.iter().cloned().zip(0..).collect();
        Page {
            next: Lower::From(keys.first().expect("a page has at least one key").clone()),
            processed: vec![false; keys.len()],
            keys,
            position,
            newcomers: HashSet::new(),
            open_ended,
            exhausted: false,
            ran_dry: false,
            reached: None,
        }
    }

    fn first(&self) -> &K {
        self.keys.first().expect("a page has at least one key")
    }

    fn last(&self) -> &K {
        self.keys.last().expect("a page has at least one key")
    }

    fn whole_range(&self) -> KeyRange<K> {
        KeyRange {
            lower: Lower::From(self.first().clone()),
            through: Some(self.last().clone()),
        }
    }

    fn next_range(&self) -> KeyRange<K> {
        KeyRange {
            lower: self.next.clone(),
            through: (!self.open_ended).then(|| self.last().clone()),
        }
    }

    /// Where the scan for candidates goes on from after this page.
    fn scanned_through(&self) -> K {
        match &self.next {
            Lower::After(key) if self.open_ended => key.clone(),
            _ => self.last().clone(),
        }
    }

    fn unprocessed(&self) -> impl Iterator<Item = &K> {
        self.keys
            .iter()
            .zip(&self.processed)
            .filter(|(_, processed)| !**processed)
            .map(|(key, _)| key)
    }

    /// Records the rows a batch claimed (`limit` asked for) and moves the page on.
    fn record<R>(
        &mut self,
        mut rows: Vec<R>,
        limit: i64,
        ordered: bool,
        key_of: impl Fn(&R) -> K,
    ) -> Result<Vec<R>, Error> {
        // Fewer rows than asked for: nothing more in the range is claimable now.
        self.ran_dry = (rows.len() as i64) < limit;
        self.exhausted = self.ran_dry;
        let whole_range = self.next_range().through;
        // A join to many rows repeats a key, next to each other in key order.
        rows.dedup_by(|a, b| key_of(a) == key_of(b));
        let mut furthest = None;
        for row in &rows {
            let key = key_of(row);
            let seen_before = match self.position.get(&key) {
                Some(&index) => {
                    furthest = furthest.max(Some(index));
                    std::mem::replace(&mut self.processed[index], true)
                }
                None => !self.newcomers.insert(key),
            };
            // Only possible when rows come back in no order (a mark), from a key
            // range the page has not gone past yet.
            if seen_before {
                return Err(Error::UnexpectedOutcome(
                    "a claimed row came back a second time in one call: the mark must take \
                     rows out of the query (set what its filter tests)"
                        .to_owned(),
                ));
            }
        }
        let next = if ordered {
            rows.last().map(&key_of)
        } else {
            // No order to go by: past the furthest candidate claimed. A batch that
            // claimed no candidate made no progress through the page.
            self.exhausted |= furthest.is_none();
            furthest.map(|index| self.keys[index].clone())
        };
        self.reached = match &next {
            Some(next) if !self.ran_dry => Some(next.clone()),
            _ => whole_range,
        };
        if let Some(next) = next {
            // Open-ended, a take that ended on a key not in the page went past
            // it (or, rarely, on a row inserted into it since the scan): the
            // scan goes on from there.
            self.exhausted |=
                &next == self.last() || (self.open_ended && !self.position.contains_key(&next));
            self.next = Lower::After(next);
        }
        Ok(rows)
    }
}

/// A query [`claim_each`](ClaimDsl::claim_each) can claim rows of type `R` from, on a
/// connection `C`.
///
/// Implemented for every Diesel select query (tables, `filter`ed queries, joins)
/// whose rows identify the claimed table by `#[derive(Identifiable)]` with a
/// single-column primary key. The methods are the crate's own; callers only
/// name the trait in bounds.
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}`",
    note = "the row type must `#[derive(Identifiable)]` (with a single-column primary key) and \
            be loadable from the query; with a join, `.select(YourRow::as_select())`"
)]
pub trait ClaimQuery<'q, C, R> {
    /// The claimed table's primary-key value.
    type Key: Clone + Eq + Hash;

    /// The locking clause's `OF` table, where the backend has row locks.
    #[doc(hidden)]
    fn claimed_table(&self) -> Result<Option<Arc<str>>, Error>;

    /// The key of a row.
    #[doc(hidden)]
    fn key(row: &R) -> Self::Key;

    /// Up to `limit` keys of matching rows in `range`, in key order, read
    /// without locks.
    #[doc(hidden)]
    fn keys(
        &self,
        conn: &mut C,
        range: KeyRange<Self::Key>,
        limit: i64,
    ) -> QueryResult<Vec<Self::Key>>;

    /// Up to `limit` matching rows in `range`, in key order, locked by `lock`.
    #[doc(hidden)]
    fn rows(
        &self,
        conn: &mut C,
        range: KeyRange<Self::Key>,
        limit: i64,
        lock: &LockClause,
    ) -> QueryResult<Vec<R>>;
}

/// A query [`mark`](ClaimBuilder::mark) can claim rows of type `R` from, on a
/// connection `C`, marking them with the changeset `V`.
///
/// Implemented for the queries of [`ClaimQuery`] whose rows are also
/// [`Selectable`](diesel::Selectable) from the claimed table, with changesets
/// for that table.
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}` and marked with `{V}`",
    note = "the row type must be `Identifiable` and `Selectable` from the claimed table, and \
            the changes an `AsChangeset` for that table"
)]
pub trait MarkQuery<'q, C, R, V>: ClaimQuery<'q, C, R> {
    /// Rejects a changeset that changes nothing.
    #[doc(hidden)]
    fn check_changes(changes: &V) -> Result<(), Error>;

    /// Up to `limit` matching rows in `range`, locked by `lock`, updated by
    /// `changes`, as updated.
    #[doc(hidden)]
    fn mark(
        &self,
        conn: &mut C,
        range: KeyRange<Self::Key>,
        limit: i64,
        lock: &LockClause,
        changes: &V,
    ) -> QueryResult<Vec<R>>;
}

pub(crate) type PrimaryKey<R> = <<R as HasTable>::Table as Table>::PrimaryKey;
pub(crate) type InQuery<Q, Pk, K> = dsl::Filter<Q, InRange<Pk, K>>;
pub(crate) type KeysQuery<Q, Pk, K> =
    dsl::Limit<dsl::Order<dsl::Select<InQuery<Q, Pk, K>, Pk>, Pk>>;
pub(crate) type RowsQuery<Q, Pk, K> = dsl::Limit<dsl::Order<InQuery<Q, Pk, K>, Pk>>;
type FromClause<R> = <<R as HasTable>::Table as diesel::QuerySource>::FromClause;
type MarkStatement<R, V, KQ, DB> = Returning<
    Update<FromClause<R>, <V as AsChangeset>::Changeset, KeysIn<PrimaryKey<R>, Locked<KQ>>>,
    dsl::AsSelect<R, DB>,
>;
type ByKeys<R, K> = InList<PrimaryKey<R>, K>;
type MarkByKeys<R, V, K> = Update<FromClause<R>, <V as AsChangeset>::Changeset, ByKeys<R, K>>;
type ReadByKeys<R, K, DB> = SelectWhere<dsl::AsSelect<R, DB>, FromClause<R>, ByKeys<R, K>>;

impl<'q, Q, C, R, K, Pk> ClaimQuery<'q, C, R> for Q
where
    Q: Clone + FilterDsl<InRange<Pk, K>>,
    C: Connection,
    C::Backend: ClaimBackend,
    R: HasTable,
    R::Table: Table<PrimaryKey = Pk>,
    <R::Table as diesel::QuerySource>::FromClause: QueryFragment<C::Backend>,
    for<'a> &'a R: Identifiable<Id = &'a K>,
    K: Clone + Eq + Hash,
    Pk: Column + Copy,
    InQuery<Q, Pk, K>: SelectDsl<Pk> + OrderDsl<Pk>,
    dsl::Select<InQuery<Q, Pk, K>, Pk>: OrderDsl<Pk>,
    dsl::Order<dsl::Select<InQuery<Q, Pk, K>, Pk>, Pk>: LimitDsl,
    dsl::Order<InQuery<Q, Pk, K>, Pk>: LimitDsl,
    KeysQuery<Q, Pk, K>: LoadQuery<'q, C, K>,
    Locked<RowsQuery<Q, Pk, K>>: LoadQuery<'q, C, R>,
{
    type Key = K;

    fn claimed_table(&self) -> Result<Option<Arc<str>>, Error> {
        lock_target::<_, C::Backend>(&R::table())
    }

    fn key(row: &R) -> K {
        row.id().clone()
    }

    fn keys(&self, conn: &mut C, range: KeyRange<K>, limit: i64) -> QueryResult<Vec<K>> {
        keys_query::<Q, R, K>(self, range, limit).load(conn)
    }

    fn rows(
        &self,
        conn: &mut C,
        range: KeyRange<K>,
        limit: i64,
        lock: &LockClause,
    ) -> QueryResult<Vec<R>> {
        rows_query::<Q, R, K>(self, range, limit, lock).load(conn)
    }
}

impl<'q, Q, C, R, V, K, Pk> MarkQuery<'q, C, R, V> for Q
where
    Q: ClaimQuery<'q, C, R, Key = K> + Clone + FilterDsl<InRange<Pk, K>>,
    C: Connection,
    C::Backend: ClaimBackend,
    R: HasTable + Selectable<C::Backend>,
    R::Table: Table<PrimaryKey = Pk>,
    K: Clone + Eq + Hash,
    Pk: Column + Copy,
    V: AsChangeset<Target = R::Table> + Clone,
    V::Changeset: QueryFragment<C::Backend>,
    InQuery<Q, Pk, K>: SelectDsl<Pk>,
    dsl::Select<InQuery<Q, Pk, K>, Pk>: OrderDsl<Pk>,
    dsl::Order<dsl::Select<InQuery<Q, Pk, K>, Pk>, Pk>: LimitDsl,
    MarkStatement<R, V, KeysQuery<Q, Pk, K>, C::Backend>: LoadQuery<'q, C, R>,
    MarkByKeys<R, V, K>: ExecuteDsl<C>,
    ReadByKeys<R, K, C::Backend>: LoadQuery<'q, C, R>,
{
    fn check_changes(changes: &V) -> Result<(), Error> {
        if changes
            .clone()
            .as_changeset()
            .is_noop(&C::Backend::default())?
        {
            return Err(Error::InvalidArgument(
                "the mark is empty: it must change what the query's filter tests".to_owned(),
            ));
        }
        Ok(())
    }

    fn mark(
        &self,
        conn: &mut C,
        range: KeyRange<K>,
        limit: i64,
        lock: &LockClause,
        changes: &V,
    ) -> QueryResult<Vec<R>> {
        let key = primary_key::<R>();
        if <C::Backend as Strategy>::UPDATE_RETURNING {
            let claimed = KeysIn {
                column: key,
                subquery: Locked {
                    query: keys_query::<Q, R, K>(self, range, limit),
                    clause: Some(lock.clone()),
                },
            };
            return Returning {
                statement: Update {
                    from: R::table().from_clause(),
                    changes: changes.clone().as_changeset(),
                    filter: claimed,
                },
                columns: R::as_select(),
            }
            .load(conn);
        }
        // Without `RETURNING` (MySQL): lock, mark by key, and read the rows back,
        // in the caller's transaction.
        let mut keys: Vec<K> = self
            .rows(conn, range, limit, lock)?
            .iter()
            .map(Q::key)
            .collect();
        keys.dedup();
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let by_keys = || InList {
            column: key,
            keys: keys.clone(),
        };
        Update {
            from: R::table().from_clause(),
            changes: changes.clone().as_changeset(),
            filter: by_keys(),
        }
        .execute(conn)?;
        SelectWhere {
            columns: R::as_select(),
            from: R::table().from_clause(),
            filter: by_keys(),
        }
        .load(conn)
    }
}

/// Up to `limit` of the query's rows in `range`, in key order, locked by `lock`.
pub(crate) fn rows_query<Q, R, K>(
    query: &Q,
    range: KeyRange<K>,
    limit: i64,
    lock: &LockClause,
) -> Locked<RowsQuery<Q, PrimaryKey<R>, K>>
where
    Q: Clone + FilterDsl<InRange<PrimaryKey<R>, K>>,
    R: HasTable,
    PrimaryKey<R>: Copy,
    InQuery<Q, PrimaryKey<R>, K>: OrderDsl<PrimaryKey<R>>,
    dsl::Order<InQuery<Q, PrimaryKey<R>, K>, PrimaryKey<R>>: LimitDsl,
{
    let key = primary_key::<R>();
    Locked {
        query: FilterDsl::filter(query.clone(), InRange { column: key, range })
            .order(key)
            .limit(limit),
        clause: Some(lock.clone()),
    }
}

/// Up to `limit` keys of the query's rows in `range`, in key order.
pub(crate) fn keys_query<Q, R, K>(
    query: &Q,
    range: KeyRange<K>,
    limit: i64,
) -> KeysQuery<Q, PrimaryKey<R>, K>
where
    Q: Clone + FilterDsl<InRange<PrimaryKey<R>, K>>,
    R: HasTable,
    PrimaryKey<R>: Copy,
    InQuery<Q, PrimaryKey<R>, K>: SelectDsl<PrimaryKey<R>>,
    dsl::Select<InQuery<Q, PrimaryKey<R>, K>, PrimaryKey<R>>: OrderDsl<PrimaryKey<R>>,
    dsl::Order<dsl::Select<InQuery<Q, PrimaryKey<R>, K>, PrimaryKey<R>>, PrimaryKey<R>>: LimitDsl,
{
    let key = primary_key::<R>();
    FilterDsl::filter(query.clone(), InRange { column: key, range })
        .select(key)
        .order(key)
        .limit(limit)
}

fn primary_key<R: HasTable>() -> PrimaryKey<R> {
    R::table().primary_key()
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::*;

    /// A claim of rows that are their own keys, per row, pages of two keys.
    fn claim(drain: bool) -> Claim<i64> {
        let builder = ClaimBuilder::<(), Blocking>::new(()).page_size(2);
        let builder = if drain { builder.drain() } else { builder };
        builder
            .start::<diesel::pg::Pg, i64>(Taking::Select, Ok(None), 0)
            .unwrap()
    }

    /// Reads the page `keys` and claims every row offered until the page is done.
    fn claim_page(claim: &mut Claim<i64>, keys: Vec<i64>) -> Vec<Lower<i64>> {
        let Step::Candidates(..) = claim.next() else {
            panic!("expected a candidate read");
        };
        let mut takes_from = Vec::new();
        claim.candidates(keys.clone());
        for key in keys {
            let Step::Batch(range, limit) = claim.next() else {
                panic!("expected a batch");
            };
            takes_from.push(range.lower);
            let rows = claim.taken(vec![key], limit, |row| *row).unwrap();
            claim.processed(rows.len());
        }
        takes_from
    }

    /// Rows between the end of one page and the first candidate of the next were
    /// done when the page was read: the takes start at the candidate, rather than
    /// step over them.
    #[test]
    fn takes_start_at_the_first_candidate_of_their_page() {
        for drain in [false, true] {
            let mut claim = claim(drain);
            let takes_from = claim_page(&mut claim, vec![1, 2]);
            assert!(
                matches!(takes_from[..], [Lower::From(1), Lower::After(1)]),
                "drain {drain}: {takes_from:?}"
            );
            // Rows 3 to 5 were claimed by someone else meanwhile.
            let takes_from = claim_page(&mut claim, vec![6, 7]);
            assert!(
                matches!(takes_from[..], [Lower::From(6), Lower::After(6)]),
                "drain {drain}: {takes_from:?}"
            );
        }
    }
}
