//! The claim engine: one run of a claim as a state machine, with no I/O of its
//! own. It decides which keys to read, which range each locked take covers,
//! which candidates were passed over, when a drain pass ends, and what the
//! report says; a driver (blocking in [`super`], async in `aio`) runs the
//! statements it asks for and reports back what they returned.

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Arc;

use super::page::Page;
use super::report::ClaimReport;
use super::siblings::Sibling;
use crate::locking::LockClause;
use crate::sql::KeyRange;
use crate::trace::{self, Span};
use crate::{Error, StopHandle};

mod head;
mod pages;

/// Keys a claim from the head leaves out of its takes, at most: a run that
/// would leave out more (rows that keep failing, or that its closure leaves
/// matching) ends, and the next run starts afresh. Each is a bound parameter
/// of every take.
pub(crate) const MAX_EXCLUDED: usize = 1000;

/// Rows a worker's run from the head hands over, at most, before the worker
/// starts the next run: a run remembers every key it has handed over, so
/// that none comes back twice in it.
const WORKER_RUN_ROWS: usize = 10_000;

/// The statement a claim takes its rows with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taking {
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
    /// A worker runs the claim over and over: its spans are at trace level,
    /// and the worker reports its rows' failures itself, with their errors.
    pub(crate) in_worker: bool,
    /// Each take re-runs the query from its head, with no candidates read
    /// first.
    pub(crate) from_head: bool,
    /// From the head, a row whose closure failed may be handed over again
    /// in the same call (a worker without a backoff of its own).
    pub(crate) failed_again: bool,
}

/// One run of a claim, as a state machine: [`next`](Self::next) says what to
/// read or claim next, and the driver (blocking here, async in `aio`) reports
/// back what it read. Everything but the I/O and the closure is decided here, so
/// both drivers claim alike.
// Public in name only, as the kinds' trait returns it; not reachable.
#[allow(missing_debug_implementations)]
pub struct Claim<K> {
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
    /// See [`Plan::keep_going`] (for the span).
    #[cfg_attr(not(feature = "tracing"), allow(dead_code))]
    keep_going: bool,
    stop: Option<StopHandle>,
    /// See [`Plan::in_worker`].
    in_worker: bool,
    /// See [`Plan::failed_again`].
    failed_again: bool,
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
    /// Candidate keys a page read may return, at most: the page size, or
    /// fewer when `max_rows` leaves fewer rows to take.
    asked: i64,
    /// Takes go from the head of the query, each in one locking statement;
    /// nothing else is read ([`State::Head`]).
    from_head: bool,
    /// From the head: the keys handed over so far, which a take that meets
    /// them again (the closure left them matching) passes over.
    handed: HashSet<K>,
    /// Keys every statement leaves out, and the same shared by the ranges.
    excluded: Vec<K>,
    excluded_shared: Arc<[K]>,
    /// The only keys every statement may take, if set (see
    /// [`among`](Self::among)).
    among: Option<Arc<[K]>>,
    /// A pooled worker's loop: takes from the head steer around the batches
    /// its other loops hold (see [`beside`](Self::beside)).
    siblings: Option<Sibling<K>>,
    /// From the head: the take to make next, and once made, the one made.
    head: head::HeadTake<K>,
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
    /// Taking from the head of the query, until a take comes back short (or,
    /// draining, empty); on a pool, as [`HeadTake`](head::HeadTake) says.
    Head,
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
            stop: plan.stop,
            in_worker: plan.in_worker,
            failed_again: plan.failed_again,
            batch: plan.batch,
            open_ended,
            page_size: plan.page_size.unwrap_or_else(|| {
                pages::first_page_size(plan.batch, open_ended, plan.ordered_by_key)
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
            asked: 0,
            from_head: plan.from_head,
            handed: HashSet::new(),
            excluded: Vec::new(),
            excluded_shared: Arc::new([]),
            among: None,
            siblings: None,
            head: head::HeadTake::Around,
            report: ClaimReport::default(),
            retry: Vec::new(),
            state: if plan.from_head {
                State::Head
            } else {
                State::Pass
            },
            cursor: None,
            locked: 0,
            processed_before_pass: 0,
        }
    }
}

impl<K> Claim<K> {
    /// The span of one call of this claim on rows of `table`: its options,
    /// and, recorded when it ends ([`ClaimOutcome::record`]), its report.
    ///
    /// [`ClaimOutcome::record`]: super::ClaimOutcome::record
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(crate) fn span(&self, table: &str) -> Span {
        macro_rules! claim_span {
            ($level:ident) => {
                trace::$level!(
                    "claim",
                    table,
                    from_head = self.from_head,
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
                    timed_out = trace::Empty,
                    not_reached = trace::Empty,
                    passes = trace::Empty,
                    stopped = trace::Empty,
                )
            };
        }
        // A worker's runs are many, most of them empty while it is idle: the
        // worker's own span is the one at info level, and its progress line
        // tells what the runs did.
        if self.in_worker {
            claim_span!(trace_span)
        } else {
            claim_span!(info_span)
        }
    }

    /// The span of one batch of up to `limit` rows, inside the claim's; a
    /// worker's are at trace level, as its claims are.
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(crate) fn batch_span(&self, limit: i64) -> Span {
        macro_rules! batch_span {
            ($level:ident) => {
                trace::$level!("batch", limit, taken = trace::Empty, outcome = trace::Empty)
            };
        }
        if self.in_worker {
            batch_span!(trace_span)
        } else {
            batch_span!(debug_span)
        }
    }

    /// The claim is a worker's run (see [`Plan::in_worker`]).
    pub(crate) fn in_worker(&self) -> bool {
        self.in_worker
    }
}

impl<K: Clone + Eq + Hash> Claim<K> {
    /// What to do next.
    pub(crate) fn next(&mut self) -> Step<K> {
        if let Some(sibling) = &self.siblings {
            // Asked between two statements: the last batch has ended.
            sibling.released();
        }
        if self.stop.as_ref().is_some_and(StopHandle::is_stopped) {
            // Between two statements: the last batch has committed.
            return Step::Done;
        }
        let (excluded, among) = (self.excluded_shared.clone(), self.among.clone());
        let left_out = |range: KeyRange<K>| range.excluding(excluded).among(among);
        match self.step() {
            Step::Candidates(range, limit) => Step::Candidates(left_out(range), limit),
            Step::StillMatching(range) => Step::StillMatching(left_out(range)),
            Step::Batch(range, limit) => Step::Batch(left_out(range), limit),
            Step::Done => Step::Done,
        }
    }

    /// What to do next, the ranges without the keys left out.
    fn step(&mut self) -> Step<K> {
        loop {
            match std::mem::replace(&mut self.state, State::Done) {
                State::Head => {
                    if self.remaining == 0 || self.excluded.len() > MAX_EXCLUDED {
                        return Step::Done;
                    }
                    if self.report.passes == 0 {
                        self.report.passes = 1;
                    }
                    self.state = State::Head;
                    return Step::Batch(self.head_range(), self.next_limit());
                }
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
                    // Never more candidates than the call may still take.
                    self.asked = i64::try_from(self.remaining)
                        .map_or(self.page_size, |left| left.min(self.page_size));
                    return Step::Candidates(KeyRange::after(self.cursor.clone()), self.asked);
                }
                State::Scan => self.state = State::PassEnd,
                State::Page(page, then) if self.remaining > 0 && !page.exhausted => {
                    let limit = self.next_limit();
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

    /// How many rows the next take may take: a batch, or what is left of
    /// `max_rows`.
    fn next_limit(&self) -> i64 {
        i64::try_from(self.remaining).map_or(self.batch, |left| left.min(self.batch))
    }

    /// Takes the rows at `keys` alone, each once at most: a worker recording
    /// the failure of rows whose session ended under them.
    pub(crate) fn among(&mut self, keys: Vec<K>) {
        self.remaining = self.remaining.min(keys.len() as u64);
        self.among = Some(keys.into());
    }

    /// Leaves the rows at `keys` out of every statement from here on: rows a
    /// worker backs off from, and, from the head, rows a take met again.
    pub(crate) fn exclude(&mut self, keys: impl IntoIterator<Item = K>) {
        let before = self.excluded.len();
        self.excluded.extend(keys);
        if self.excluded.len() > before {
            self.excluded_shared = self.excluded.iter().cloned().collect();
        }
    }

    /// The keys [`Step::Candidates`] read.
    pub(crate) fn candidates(&mut self, mut keys: Vec<K>) {
        let full_page = keys.len() as i64 == self.asked;
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
        if self.from_head {
            return Ok(self.taken_from_head(rows, limit, key_of));
        }
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

    /// The rows at `keys` failed (their closure returned an error or
    /// panicked) and the call goes on without them. From the head, a take
    /// that meets one again (its failure hook left it matching) passes it
    /// over and leaves it out from then on, as any row handed over before;
    /// unless failed rows may be handed over again ([`Plan::failed_again`]).
    pub(crate) fn failed(&mut self, keys: Vec<K>) {
        self.report.failed += keys.len() as u64;
        if self.failed_again {
            for key in &keys {
                self.handed.remove(key);
            }
        }
    }

    /// Of the rows that failed, `rows` ran past the claim's timeout.
    pub(crate) fn timed_out(&mut self, rows: usize) {
        self.report.timed_out += rows as u64;
    }

    /// A row taken was gone before the closure got it: another worker took
    /// it since (a visibility timeout's stamp ran out).
    pub(crate) fn gone(&mut self) {
        self.report.gone += 1;
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

/// The keys a page holds, by default, when takes keep to their page in the
/// key's order: several batches, so that workers that arrive at a page
/// together take whole batches from it, each passing over the others'.
/// A number below `n` (at least 1), different from call to call: where a
/// worker starts in a page. `RandomState` is seeded at random per thread and
/// moves on with every instance, which is all a place to start needs.
fn random_below(n: usize) -> usize {
    use std::hash::BuildHasher;
    (std::collections::hash_map::RandomState::new().hash_one(n) % n as u64) as usize
}

#[cfg(test)]
mod tests;
