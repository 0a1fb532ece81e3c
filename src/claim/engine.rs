//! The claim engine: one run of a claim as a state machine, with no I/O of its
//! own. It decides which keys to read, which range each locked take covers,
//! which candidates were passed over, when a drain pass ends, and what the
//! report says; a driver (blocking in [`super`], async in `aio`) runs the
//! statements it asks for and reports back what they returned.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

use super::query::ClaimStatements;
use super::report::ClaimReport;
use crate::locking::LockClause;
use crate::sql::{KeyRange, Lower};
use crate::trace::{self, Span};
use crate::{Error, StopHandle};

/// Rows read per page of the unlocked candidate scan, unless batches are large.
const DEFAULT_PAGE_SIZE: i64 = 1000;

/// Rows read per page of the candidate scan, at least, when takes may run
/// past their page.
const MIN_OPEN_PAGE_SIZE: i64 = 100;

/// Batches per page of the candidate scan, by default, when takes keep to
/// their page.
const BATCHES_PER_PAGE: i64 = 10;

/// Rows, and batches, per page of the candidate scan, by default, in an order
/// other than the key's. Its takes keep to their page, and each worker's last
/// take from a page comes back short where others took rows first: larger
/// pages make such takes (and page reads) rarer. A position holds the order
/// columns' values, so a page of them stays a few hundred kilobytes.
const ORDERED_PAGE_SIZE: i64 = 5000;
const ORDERED_BATCHES_PER_PAGE: i64 = 50;

/// How large pages grow, in batches, and in keys at least and at most, once
/// other workers are seen claiming beside this one (see [`Claim::contended`]).
const CONTENDED_BATCHES_PER_PAGE: i64 = 256;
const CONTENDED_PAGE_SIZE: (i64, i64) = (16_384, 65_536);

/// A contended page of which this worker got fewer rows than this is read
/// again four times larger (see [`Claim::contended`]).
const MIN_ROWS_PER_PAGE: u64 = 64;

/// The statement a claim takes its rows with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Taking {
    /// A locking select: rows come back in the claim order.
    Select,
    /// A marking `UPDATE … RETURNING`: rows come back in no particular order,
    /// and are put in the claim order.
    Mark,
    /// The same, committed on its own before the closure runs.
    MarkAndCommit,
}

/// What one run of a claim is set up with: the builder's options, checked,
/// and what the backend can do.
pub(crate) struct Plan {
    pub(crate) clause: LockClause,
    pub(crate) taking: Taking,
    /// The backend has row locks (not SQLite's database write lock).
    pub(crate) row_locks: bool,
    /// The backend has `UPDATE … RETURNING`.
    pub(crate) update_returning: bool,
    /// Contended pages grow on this backend.
    pub(crate) grow_contended_pages: bool,
    /// A row locked by someone else fails the call rather than being skipped.
    pub(crate) fail_on_locked: bool,
    pub(crate) batch: i64,
    pub(crate) page_size: Option<i64>,
    pub(crate) drain: bool,
    pub(crate) max_rows: Option<u64>,
    /// The claim order is the key's, so a row's key is its position.
    pub(crate) ordered_by_key: bool,
    /// A failing closure's rows are rolled back and passed over, and the call
    /// goes on.
    pub(crate) keep_going: bool,
    /// Once triggered, the claim ends before its next statement.
    pub(crate) stop: Option<StopHandle>,
    /// A worker runs the claim over and over: its span is at debug level.
    pub(crate) in_worker: bool,
}

/// One run of a claim, as a state machine: [`next`](Self::next) says what to
/// read or claim next, and the driver (blocking here, async in `aio`) reports
/// back what it read. Everything but the I/O and the closure is decided here, so
/// both drivers claim alike.
pub(crate) struct Claim<K> {
    pub(crate) clause: LockClause,
    pub(crate) taking: Taking,
    /// Rows come back in the claim order and tell their own positions: a
    /// take goes on from its last row.
    rows_tell_positions: bool,
    row_locks: bool,
    /// A mark is one statement that is atomic on its own (`UPDATE … RETURNING`
    /// with row locks).
    pub(crate) one_statement_mark: bool,
    fail_on_locked: bool,
    /// `nowait` was asked for: a lock taken up front (SQLite's write lock) is
    /// not waited for either.
    pub(crate) nowait: bool,
    /// See [`Plan::keep_going`].
    pub(crate) keep_going: bool,
    ordered_by_key: bool,
    stop: Option<StopHandle>,
    /// See [`Plan::in_worker`].
    in_worker: bool,
    batch: i64,
    /// Takes run past the end of their page: see [`Page::open_ended`].
    open_ended: bool,
    page_size: i64,
    /// The page size was the caller's: it does not grow.
    page_size_given: bool,
    /// The backend's pages grow once contended.
    grow_contended_pages: bool,
    /// Pages may start anywhere in them (see [`Page::new`]): the claim order is
    /// the key's, a row locked by others is passed over, not an error, and
    /// rows stay locked while the closure runs.
    may_stripe: bool,
    /// Other workers were seen claiming the same rows (see
    /// [`contended`](Self::contended)): pages start at places of their own.
    contended: bool,
    drain: bool,
    remaining: u64,
    report: ClaimReport,
    /// Candidates found locked by others in this pass, to retry in the next
    /// (only when draining, on backends with row locks): those of each page,
    /// in the claim order, make a page of their own.
    retry: Vec<Vec<K>>,
    state: State<K>,
    /// The highest key scanned for candidates so far.
    cursor: Option<K>,
    /// Candidates found locked by others in this pass.
    locked: u64,
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
    Done,
}

enum State<K> {
    /// A pass begins: the candidates found locked in the last pass come first.
    Pass,
    /// Retrying those, page by page.
    Retry(std::vec::IntoIter<Vec<K>>),
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
    Retry(std::vec::IntoIter<Vec<K>>),
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

impl<K> Claim<K> {
    /// A claim run that has not read anything yet.
    pub(crate) fn new(plan: Plan) -> Self {
        // Rows that come back in key order tell how far a take went, so takes
        // can run past the page; a drain keeps to its pages, whose candidates
        // it retries.
        let rows_tell_positions = plan.taking == Taking::Select && plan.ordered_by_key;
        let open_ended = rows_tell_positions && !plan.drain;
        Claim {
            clause: plan.clause,
            taking: plan.taking,
            rows_tell_positions,
            row_locks: plan.row_locks,
            one_statement_mark: plan.row_locks && plan.update_returning,
            fail_on_locked: plan.row_locks && plan.fail_on_locked,
            nowait: plan.fail_on_locked,
            keep_going: plan.keep_going,
            ordered_by_key: plan.ordered_by_key,
            stop: plan.stop,
            in_worker: plan.in_worker,
            batch: plan.batch,
            open_ended,
            page_size: plan.page_size.unwrap_or(if open_ended {
                // Takes move on by themselves: reading much further ahead than
                // a batch would only re-read keys other workers take first.
                MIN_OPEN_PAGE_SIZE.max(plan.batch)
            } else if !plan.ordered_by_key {
                ORDERED_PAGE_SIZE.max(plan.batch.saturating_mul(ORDERED_BATCHES_PER_PAGE))
            } else {
                closed_page_size(plan.batch)
            }),
            page_size_given: plan.page_size.is_some(),
            grow_contended_pages: plan.grow_contended_pages,
            // A mark committed on its own holds its rows' locks only while it
            // runs: others meet rows it marked, which no longer match, rather
            // than rows it holds, and larger pages would only be read more.
            may_stripe: plan.row_locks
                && plan.ordered_by_key
                && !plan.fail_on_locked
                && plan.taking != Taking::MarkAndCommit,
            contended: false,
            drain: plan.drain,
            remaining: plan.max_rows.unwrap_or(u64::MAX),
            report: ClaimReport::default(),
            retry: Vec::new(),
            state: State::Pass,
            cursor: None,
            locked: 0,
            processed_before_pass: 0,
        }
    }
}

impl<K> Claim<K> {
    /// The span of one call of this claim on rows of `S`'s table: its options,
    /// and, recorded when it ends ([`ClaimOutcome::record`]), its report.
    ///
    /// [`ClaimOutcome::record`]: super::ClaimOutcome::record
    pub(crate) fn span<S: ClaimStatements<DB, R>, DB, R>(&self) -> Span {
        macro_rules! claim_span {
            ($level:ident) => {
                trace::$level!(
                    "claim",
                    table = %S::table_name(),
                    batch = self.batch,
                    max_rows = (self.remaining < u64::MAX).then_some(self.remaining),
                    drain = self.drain,
                    keep_going = self.keep_going,
                    on_locked = match (self.nowait, self.clause.skip_locked) {
                        (true, _) => "fail",
                        (false, true) => "skip",
                        (false, false) => "wait",
                    },
                    strength = ?self.clause.strength,
                    processed = trace::Empty,
                    skipped = trace::Empty,
                    locked = trace::Empty,
                    gone = trace::Empty,
                    failed = trace::Empty,
                    not_reached = trace::Empty,
                    passes = trace::Empty,
                    stopped = trace::Empty,
                )
            };
        }
        // A worker's runs are many, most of them empty while it is idle: the
        // worker's own span is the one at info level.
        if self.in_worker {
            claim_span!(debug_span)
        } else {
            claim_span!(info_span)
        }
    }
}

impl<K: Clone + Eq + Hash> Claim<K> {
    /// What to do next.
    pub(crate) fn next(&mut self) -> Step<K> {
        if self.stop.as_ref().is_some_and(StopHandle::is_stopped) {
            // Between two statements: the last batch has committed.
            return Step::Done;
        }
        loop {
            match std::mem::replace(&mut self.state, State::Done) {
                State::Pass => {
                    self.report.passes += 1;
                    self.processed_before_pass = self.report.processed;
                    self.locked = 0;
                    // Rows processed before are never visited again: only the
                    // rows found locked, then rows beyond the highest key seen.
                    self.state = State::Retry(std::mem::take(&mut self.retry).into_iter());
                }
                State::Retry(mut pages) => {
                    self.state = match pages.next() {
                        Some(keys) => {
                            // Taken as a page, not one transaction per key: the
                            // rows others held are mostly done by now, and a
                            // take passes over those in one read.
                            let start = if self.contended {
                                random_below(keys.len())
                            } else {
                                0
                            };
                            let mut page = Page::new(keys, false, start);
                            page.retrying = true;
                            State::Page(page, Then::Retry(pages))
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
                        _ if page.open_ended && page.ran_dry => Then::PassEnd,
                        scanned => scanned,
                    };
                    if !matches!(then, Then::Retry(_)) {
                        self.cursor = Some(page.scanned_through());
                    }
                    let passed_over = page.passed_over().count() as u64;
                    self.report.not_reached += page.unprocessed().count() as u64 - passed_over;
                    if passed_over > 0 && self.row_locks {
                        self.contended(page.keys.len() as u64, passed_over, page.taken());
                        // One read tells the candidates locked by others (still
                        // matching) from those gone (processed by others, or
                        // changed) since.
                        let range = page.whole_range();
                        self.state = State::Sorting(page, then);
                        return Step::StillMatching(range);
                    }
                    // One writer at a time (SQLite): a candidate a take passed
                    // over no longer matched.
                    self.report.gone += passed_over;
                    self.state = then.into();
                }
                State::PassEnd => {
                    let claimed_nothing_new = self.report.processed == self.processed_before_pass;
                    if !self.drain || claimed_nothing_new || self.remaining == 0 {
                        return Step::Done;
                    }
                    self.state = State::Pass;
                }
                State::Done => return Step::Done,
                State::Scanning | State::Sorting(..) => {
                    unreachable!("a claim's driver skipped a read it was asked for")
                }
            }
        }
    }

    /// A page's takes passed over `passed_over` of its `candidates`, which
    /// other workers held or had taken, and took `taken` rows: the claim is
    /// contended. Workers that all start at the head of the same page pass over
    /// each other's rows inside their locked takes, so that the work per row
    /// grows with the number of workers; from here on each page starts at a
    /// place of its own ([`Page::new`]) and keeps to its end. Pages grow while
    /// this worker got only a few rows of one that others took most of: the
    /// statements per page are then spread over more rows.
    fn contended(&mut self, candidates: u64, passed_over: u64, taken: u64) {
        if !self.may_stripe {
            return;
        }
        self.contended = true;
        if self.open_ended && !self.page_size_given {
            self.open_ended = false;
            self.page_size = closed_page_size(self.batch);
        } else if taken < MIN_ROWS_PER_PAGE && passed_over.saturating_mul(2) > candidates {
            self.grow_pages();
        }
    }

    /// Pages four times larger, up to [`CONTENDED_PAGE_SIZE`], unless the
    /// caller set their size or the backend's pages keep theirs (MySQL).
    /// (A contended claim's pages are closed unless the caller set their
    /// size.)
    fn grow_pages(&mut self) {
        if self.page_size_given || !self.grow_contended_pages {
            return;
        }
        let (least, most) = CONTENDED_PAGE_SIZE;
        let most = self
            .batch
            .saturating_mul(CONTENDED_BATCHES_PER_PAGE)
            .clamp(least, most)
            .max(self.page_size);
        self.page_size = self.page_size.saturating_mul(4).min(most);
    }

    /// The keys [`Step::Candidates`] read.
    pub(crate) fn candidates(&mut self, mut keys: Vec<K>) {
        let full_page = keys.len() as i64 == self.page_size;
        // A join to many rows repeats a key.
        let mut seen = HashSet::with_capacity(keys.len());
        keys.retain(|key| seen.insert(key.clone()));
        if keys.is_empty() {
            self.state = State::PassEnd;
            return;
        }
        let start = if self.contended && !self.open_ended {
            random_below(keys.len())
        } else {
            0
        };
        let page = Page::new(keys, self.open_ended, start);
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
        let (locked, gone): (Vec<&K>, Vec<&K>) = page
            .passed_over()
            .partition(|key| still_matching.contains(*key));
        // Rows others hold fill more than a quarter of the page: larger pages
        // leave workers that start at places of their own room between them.
        if self.contended && locked.len() * 4 > page.keys.len() {
            self.grow_pages();
        }
        self.locked += locked.len() as u64;
        self.report.gone += gone.len() as u64;
        if self.drain && self.remaining > 0 && !locked.is_empty() {
            let locked: HashSet<&K> = locked.into_iter().collect();
            let in_claim_order = page.in_claim_order().filter(|key| locked.contains(key));
            if self.rows_tell_positions {
                self.retry.push(in_claim_order.cloned().collect());
            } else {
                // A mark or a stamp changes every row its statement takes,
                // before the rows could be told apart, and rows that do not
                // tell their positions could not move the takes past the
                // ones not handed over: one key per page, which holds no row
                // this call has taken before.
                self.retry
                    .extend(in_claim_order.map(|key| vec![key.clone()]));
            }
        }
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
        let (ordered, marked) = (self.rows_tell_positions, self.taking != Taking::Select);
        let State::Page(page, _) = &mut self.state else {
            unreachable!("rows taken outside a page");
        };
        page.record(rows, limit, ordered, marked, key_of)
    }

    /// With [`nowait`](crate::ClaimBuilder::nowait), the range to read keys of (without
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
            trace::info!("lock not available: a candidate is locked by another transaction");
            return Err(Error::LockNotAvailable);
        }
        Ok(())
    }

    /// The batch committed with `rows` processed.
    pub(crate) fn processed(&mut self, rows: usize) {
        self.report.processed += rows as u64;
        self.remaining -= rows as u64;
    }

    /// `rows` taken were rolled back by their closure's failure and are passed
    /// over ([`Plan::keep_going`]).
    pub(crate) fn failed(&mut self, rows: usize) {
        trace::warning!(
            rows,
            "a closure failed: its rows are passed over (keep_going)"
        );
        self.report.failed += rows as u64;
    }

    /// A row of a failed batch, retried alone, was no longer there to take.
    pub(crate) fn gone(&mut self) {
        self.report.gone += 1;
    }

    /// A row of a failed batch could not be retried alone: it stays pending.
    pub(crate) fn left_pending(&mut self) {
        self.report.not_reached += 1;
    }

    /// The range holding only the row at `key`, of the page being claimed, for
    /// a take that retries that row alone; `None` if its position in the claim
    /// order is unknown (a row that was not a candidate, in an order other
    /// than the key's).
    pub(crate) fn only(&self, key: &K) -> Option<KeyRange<K>> {
        let position = match &self.state {
            State::Page(page, _) => page.position.get(key).map(|&index| &page.keys[index]),
            _ => None,
        };
        let position = position.or(self.ordered_by_key.then_some(key))?;
        Some(KeyRange {
            lower: Lower::From(position.clone()),
            through: Some(position.clone()),
        })
    }

    /// What the claim has done so far; once it is done, its report.
    pub(crate) fn report(&self) -> ClaimReport {
        // Rows found locked in earlier passes were tried again.
        let locked = self.locked;
        ClaimReport {
            locked,
            skipped: locked + self.report.gone,
            ..self.report
        }
    }
}

/// A page of candidates' positions, in the order its takes go through them,
/// and what has become of them.
///
/// The takes go through a page in one stretch, or in two when it starts
/// further in ([`Page::new`]): from there to its end, then from its head to
/// where they started.
struct Page<K> {
    /// Where the next batch starts: at the first candidate of its stretch, then
    /// past the furthest candidate claimed so far. Not at the cursor: the rows
    /// between it and the first candidate were done when the page was read (by
    /// other workers, often), and a take starting there would step over every
    /// one of them inside its transaction.
    next: Lower<K>,
    /// The candidates in the order the takes go through them: in the claim
    /// order from where the page starts, then from its head.
    keys: Vec<K>,
    /// Where in `keys` the page's head is (`keys.len()` when the page starts
    /// at its head).
    head: usize,
    /// Where in `keys` the takes' stretch ends (exclusive).
    stretch_end: usize,
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
    /// The furthest candidate processed, by its place in the page.
    furthest: Option<usize>,
    /// Made of candidates found locked in the last pass: rows of its range
    /// that are not among them are not handed over.
    retrying: bool,
}

impl<K: Clone + Eq + Hash> Page<K> {
    /// A page of `keys`, in the claim order, whose takes begin at `keys[start]`.
    /// Workers that read the same page at once, each from a place of its own,
    /// take rows apart from one another rather than pass over each other's.
    /// An open-ended page starts at its head.
    fn new(mut keys: Vec<K>, open_ended: bool, start: usize) -> Self {
        debug_assert!(start < keys.len() && (start == 0 || !open_ended));
        keys.rotate_left(start);
        let head = keys.len() - start;
        let position = keys.iter().cloned().zip(0..).collect();
        Page {
            next: Lower::From(keys.first().expect("a page has at least one key").clone()),
            processed: vec![false; keys.len()],
            head,
            stretch_end: head,
            keys,
            position,
            newcomers: HashSet::new(),
            open_ended,
            exhausted: false,
            ran_dry: false,
            reached: None,
            furthest: None,
            retrying: false,
        }
    }

    /// The page's first key in the claim order.
    fn first(&self) -> &K {
        &self.keys[self.head % self.keys.len()]
    }

    /// The page's keys in the claim order.
    fn in_claim_order(&self) -> impl Iterator<Item = &K> {
        self.keys[self.head..].iter().chain(&self.keys[..self.head])
    }

    /// The page's last key in the claim order.
    fn last(&self) -> &K {
        &self.keys[self.head - 1]
    }

    /// The last key of the stretch the takes are in.
    fn stretch_last(&self) -> &K {
        &self.keys[self.stretch_end - 1]
    }

    /// The takes are done with their stretch: they go on from the page's head,
    /// or, past both stretches, the page has no more to give.
    fn end_stretch(&mut self) {
        if self.stretch_end < self.keys.len() {
            self.next = Lower::From(self.keys[self.stretch_end].clone());
            self.stretch_end = self.keys.len();
        } else {
            self.exhausted = true;
        }
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
            through: (!self.open_ended).then(|| self.stretch_last().clone()),
        }
    }

    /// Where the scan for candidates goes on from after this page.
    fn scanned_through(&self) -> K {
        match &self.next {
            Lower::After(key) if self.open_ended => key.clone(),
            _ => self.last().clone(),
        }
    }

    /// Unprocessed candidates the takes went past: all of them, unless the
    /// page was left before its end (`max_rows` reached), when those beyond the
    /// furthest one processed, in the order the takes go, were not reached.
    fn passed_over(&self) -> impl Iterator<Item = &K> {
        let end = if self.exhausted {
            self.keys.len()
        } else {
            self.furthest.map_or(0, |index| index + 1)
        };
        self.keys[..end]
            .iter()
            .zip(&self.processed)
            .filter(|(_, processed)| !**processed)
            .map(|(key, _)| key)
    }

    /// Rows the page's takes processed, candidates or not.
    fn taken(&self) -> u64 {
        (self
            .processed
            .iter()
            .filter(|processed| **processed)
            .count()
            + self.newcomers.len()) as u64
    }

    fn unprocessed(&self) -> impl Iterator<Item = &K> {
        self.keys
            .iter()
            .zip(&self.processed)
            .filter(|(_, processed)| !**processed)
            .map(|(key, _)| key)
    }

    /// Records the rows a batch claimed (`limit` asked for) and moves the page
    /// on. `ordered`: the rows tell their own positions (see
    /// [`Claim::rows_tell_positions`]); `marked`: they were marked.
    fn record<R>(
        &mut self,
        mut rows: Vec<R>,
        limit: i64,
        ordered: bool,
        marked: bool,
        key_of: impl Fn(&R) -> K,
    ) -> Result<Vec<R>, Error> {
        // Fewer rows than asked for: nothing more in the range is claimable now.
        self.ran_dry = (rows.len() as i64) < limit;
        let whole_range = self.next_range().through;
        // A join to many rows repeats a key.
        let mut in_batch = HashSet::with_capacity(rows.len());
        rows.retain(|row| in_batch.insert(key_of(row)));
        if marked {
            // Marked rows come back in no order: hand them over in the claim
            // order, newcomers last.
            let place = |row: &R| self.position.get(&key_of(row)).copied();
            rows.sort_by_cached_key(|row| place(row).unwrap_or(usize::MAX));
        }
        let last = rows.last().map(&key_of);
        let mut furthest = None;
        let mut seen_before = Vec::with_capacity(rows.len());
        for row in &rows {
            let key = key_of(row);
            seen_before.push(match self.position.get(&key) {
                Some(&index) => {
                    furthest = furthest.max(Some(index));
                    std::mem::replace(&mut self.processed[index], true)
                }
                // A retried page's range holds rows this call processed
                // before, which the closure may have left matching: only its
                // own keys are handed over (the others' locks go at commit).
                None if self.retrying => true,
                None => !self.newcomers.insert(key),
            });
        }
        // Only possible when the takes go on from the furthest candidate (a
        // mark, or an order other than the key's): a row that moved into the
        // range since it was read, or was inserted into it, may lie beyond.
        if seen_before.contains(&true) {
            if marked {
                return Err(Error::UnexpectedOutcome(
                    "a claimed row came back a second time in one call: the mark must take \
                     rows out of the query (set what its filter tests)"
                        .to_owned(),
                ));
            }
            // Rows the closure left matching: not handed over twice.
            let mut seen_before = seen_before.into_iter();
            rows.retain(|_| !seen_before.next().unwrap_or(false));
        }
        self.furthest = self.furthest.max(furthest);
        let next = if ordered {
            // The last row taken, handed over or not: the takes go on past it.
            last
        } else {
            // Rows that do not tell their positions: past the furthest candidate
            // claimed. A batch that claimed no candidate made no progress
            // through the page.
            furthest.map(|index| self.keys[index].clone())
        };
        self.reached = match &next {
            Some(next) if !self.ran_dry => Some(next.clone()),
            _ => whole_range,
        };
        let mut stretch_done = self.ran_dry || next.is_none();
        if let Some(next) = next {
            // Open-ended, a take that ended on a key not in the page went past
            // it (or, rarely, on a row inserted into it since the scan): the
            // scan goes on from there.
            stretch_done |= &next == self.stretch_last()
                || (self.open_ended && !self.position.contains_key(&next));
            self.next = Lower::After(next);
        }
        if stretch_done {
            self.end_stretch();
        }
        Ok(rows)
    }
}

/// The keys a page holds, by default, when takes keep to their page in the
/// key's order: several batches, so that workers that arrive at a page
/// together take whole batches from it, each passing over the others'.
fn closed_page_size(batch: i64) -> i64 {
    DEFAULT_PAGE_SIZE.max(batch.saturating_mul(BATCHES_PER_PAGE))
}

/// A number below `n` (at least 1), different from call to call: where a
/// worker starts in a page. `RandomState` is seeded at random per thread and
/// moves on with every instance, which is all a place to start needs.
fn random_below(n: usize) -> usize {
    use std::hash::BuildHasher;
    (std::collections::hash_map::RandomState::new().hash_one(n) % n as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LockStrength;
    use std::collections::{BTreeSet, HashMap};

    /// A claim of rows that are their own keys, per row, pages of two keys,
    /// with row locks.
    fn claim(drain: bool) -> Claim<i64> {
        Claim::new(Plan {
            clause: LockClause {
                strength: LockStrength::NoKeyUpdate,
                skip_locked: true,
                of: None,
            },
            taking: Taking::Select,
            row_locks: true,
            update_returning: true,
            grow_contended_pages: true,
            fail_on_locked: false,
            batch: 1,
            page_size: Some(2),
            drain,
            max_rows: None,
            ordered_by_key: true,
            keep_going: false,
            stop: None,
            in_worker: false,
        })
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

    /// The keys of `pending` in `range`.
    fn in_range<'a>(
        pending: &'a BTreeSet<i64>,
        range: &KeyRange<i64>,
    ) -> impl Iterator<Item = i64> + 'a {
        use std::ops::Bound;
        let lower = match range.lower {
            Lower::Unbounded => Bound::Unbounded,
            Lower::After(key) => Bound::Excluded(key),
            Lower::From(key) => Bound::Included(key),
        };
        let upper = range.through.map_or(Bound::Unbounded, Bound::Included);
        pending.range((lower, upper)).copied()
    }

    /// Runs `claim` to its end as a database would: `pending` rows match, of
    /// which `held` are locked by others; a take gets the first `limit` rows
    /// of its range that match and are not held, and processes them. Returns
    /// the sizes of the pages read and where each take began.
    fn run(
        claim: &mut Claim<i64>,
        pending: &mut BTreeSet<i64>,
        held: &HashSet<i64>,
    ) -> (Vec<i64>, Vec<Lower<i64>>) {
        let (mut pages, mut takes) = (Vec::new(), Vec::new());
        loop {
            match claim.next() {
                Step::Candidates(range, limit) => {
                    pages.push(limit);
                    claim.candidates(in_range(pending, &range).take(limit as usize).collect());
                }
                Step::StillMatching(range) => {
                    claim.still_matching(in_range(pending, &range).collect());
                }
                Step::Batch(range, limit) => {
                    let rows: Vec<i64> = in_range(pending, &range)
                        .filter(|key| !held.contains(key))
                        .take(limit as usize)
                        .collect();
                    takes.push(range.lower);
                    let rows = claim.taken(rows, limit, |row| *row).unwrap();
                    for row in &rows {
                        pending.remove(row);
                    }
                    claim.processed(rows.len());
                }
                Step::Done => return (pages, takes),
            }
        }
    }

    /// A claim by key, per row, with row locks and the default pages.
    fn default_claim(drain: bool) -> Claim<i64> {
        let mut claim = claim(drain);
        claim.page_size_given = false;
        claim.page_size = if drain {
            DEFAULT_PAGE_SIZE
        } else {
            MIN_OPEN_PAGE_SIZE
        };
        claim
    }

    /// A drain retries the candidates it found locked as pages, each take
    /// passing over as many rows as a batch holds, rather than one
    /// transaction per row; rows of a retried page's range that the call
    /// processed before and the closure left matching are not handed over
    /// again.
    #[test]
    fn a_drain_retries_the_rows_it_found_locked_page_by_page() {
        let mut claim = default_claim(true);
        claim.batch = 10;
        let mut pending: BTreeSet<i64> = (1..=100).collect();
        // Held by other workers during the first pass.
        let held = |key: &i64| key % 2 == 0;
        // Left matching by the closure.
        let left_matching = |key: &i64| key % 10 == 1;
        let mut handed: HashMap<i64, u32> = HashMap::new();
        let mut takes_in_pass: HashMap<u32, u32> = HashMap::new();
        loop {
            match claim.next() {
                Step::Candidates(range, limit) => {
                    claim.candidates(in_range(&pending, &range).take(limit as usize).collect());
                }
                Step::StillMatching(range) => {
                    claim.still_matching(in_range(&pending, &range).collect());
                }
                Step::Batch(range, limit) => {
                    let first_pass = claim.report.passes == 1;
                    let rows: Vec<i64> = in_range(&pending, &range)
                        .filter(|key| !(first_pass && held(key)))
                        .take(limit as usize)
                        .collect();
                    *takes_in_pass.entry(claim.report.passes).or_default() += 1;
                    let rows = claim.taken(rows, limit, |row| *row).unwrap();
                    for row in &rows {
                        *handed.entry(*row).or_default() += 1;
                        if !left_matching(row) {
                            pending.remove(row);
                        }
                    }
                    claim.processed(rows.len());
                }
                Step::Done => break,
            }
        }
        assert_eq!(handed.len(), 100, "every row handed over");
        assert!(handed.values().all(|times| *times == 1), "{handed:?}");
        assert_eq!(claim.report.processed, 100);
        // 50 rows retried in batches of 10: a few takes, not 50.
        let retry_takes = takes_in_pass[&2];
        assert!(retry_takes <= 10, "{retry_takes} takes retried 50 rows");
    }

    /// A page that starts further in is taken from there to its end, then from
    /// its head to where it started, every candidate once.
    #[test]
    fn a_page_starting_further_in_is_taken_in_two_stretches() {
        let mut page = Page::new((1..=10).collect(), false, 4);
        assert!(matches!(
            page.next_range(),
            KeyRange {
                lower: Lower::From(5),
                through: Some(10)
            }
        ));
        page.record(vec![5, 6, 7], 3, true, false, |row| *row)
            .unwrap();
        assert!(matches!(
            page.next_range(),
            KeyRange {
                lower: Lower::After(7),
                through: Some(10)
            }
        ));
        // Row 9 is held by another worker.
        page.record(vec![8, 10], 3, true, false, |row| *row)
            .unwrap();
        assert!(matches!(
            page.next_range(),
            KeyRange {
                lower: Lower::From(1),
                through: Some(4)
            }
        ));
        assert!(!page.exhausted);
        page.record(vec![1, 2], 3, true, false, |row| *row).unwrap();
        assert!(page.exhausted);
        assert_eq!(page.passed_over().copied().collect::<Vec<_>>(), [9, 3, 4]);
        assert!(matches!(
            page.whole_range(),
            KeyRange {
                lower: Lower::From(1),
                through: Some(10)
            }
        ));
        assert_eq!(page.scanned_through(), 10);
    }

    /// A page left before its end passes over only what its takes went
    /// through, in the order they went.
    #[test]
    fn a_page_left_early_passes_over_what_its_takes_went_through() {
        let mut page = Page::new((1..=10).collect(), false, 7);
        // Row 8 is held by another worker; rows 9 and 10 are taken.
        page.record(vec![9, 10], 2, true, false, |row| *row)
            .unwrap();
        assert_eq!(page.passed_over().copied().collect::<Vec<_>>(), [8]);
        assert_eq!(page.unprocessed().count(), 8);
    }

    /// Alone, a claim goes through its pages from their heads, in key order.
    #[test]
    fn a_claim_alone_takes_rows_in_key_order() {
        for drain in [false, true] {
            let mut claim = default_claim(drain);
            let mut pending = (1..=3000).collect();
            let (_, takes) = run(&mut claim, &mut pending, &HashSet::new());
            assert!(pending.is_empty());
            assert!(!claim.contended, "drain {drain}");
            // Where each take could first find a row.
            let from: Vec<i64> = takes
                .iter()
                .map(|lower| match lower {
                    Lower::From(key) => *key,
                    Lower::After(key) => key + 1,
                    Lower::Unbounded => i64::MIN,
                })
                .collect();
            assert_eq!(
                from[..3000],
                (1..=3000).collect::<Vec<_>>(),
                "drain {drain}"
            );
        }
    }

    /// Runs `claim` over 40,000 pending rows of which others hold the first
    /// 50 and every row but one in eight: the claim is contended, leaves no
    /// free row, and processes every free one. Returns `run`'s pages and takes;
    /// the first page is the open-ended one.
    fn run_among_others(claim: &mut Claim<i64>) -> (Vec<i64>, Vec<Lower<i64>>) {
        let held: HashSet<i64> = (1..=50)
            .chain((51..=40_000).filter(|key| key % 8 != 0))
            .collect();
        let mut pending: BTreeSet<i64> = (1..=40_000).collect();
        let (pages, takes) = run(claim, &mut pending, &held);
        assert!(claim.contended);
        assert!(
            pending.iter().all(|key| held.contains(key)),
            "a free row was left"
        );
        assert_eq!(claim.report().processed, 40_000 / 8 - 6);
        assert_eq!(pages[0], MIN_OPEN_PAGE_SIZE);
        (pages, takes)
    }

    /// Once a take has passed over rows others hold, the next pages start at
    /// places of their own, grow while others take most of them, and still
    /// offer every row that matches and is not held.
    #[test]
    fn a_contended_claim_spreads_out_over_its_pages() {
        let mut starts = HashSet::new();
        for _ in 0..3 {
            let mut claim = default_claim(false);
            let (pages, takes) = run_among_others(&mut claim);
            // The open-ended first page, then closed ones that grow.
            assert!(
                pages[1..].windows(2).all(|pair| pair[0] <= pair[1]),
                "{pages:?}"
            );
            assert!(pages[1] >= DEFAULT_PAGE_SIZE && pages[pages.len() - 1] > pages[1]);
            // The first page after the open-ended one starts where it will.
            starts.extend(takes.iter().find_map(|lower| match lower {
                Lower::From(key) if *key > 100 => Some(*key),
                _ => None,
            }));
        }
        assert!(
            starts.len() > 1,
            "every page started at its head: {starts:?}"
        );
    }

    /// On a backend whose contended pages do not grow (MySQL), the same
    /// claim spreads out over pages of the default size, and still offers
    /// every row that matches and is not held.
    #[test]
    fn a_contended_claim_keeps_its_page_size_where_pages_do_not_grow() {
        let mut claim = default_claim(false);
        claim.grow_contended_pages = false;
        let (pages, _) = run_among_others(&mut claim);
        assert!(
            pages[1..].iter().all(|&page| page == DEFAULT_PAGE_SIZE),
            "{pages:?}"
        );
    }
}
