//! The scan: pages of candidate keys read without locks, each taken in
//! batches, and, draining, passes that retry the candidates others held.

use std::collections::HashSet;
use std::hash::Hash;

use super::pages::Paging;
use super::{Plan, Progress, Step};
use crate::claim::page::Page;
use crate::sql::KeyRange;
use crate::Error;

/// A claim's scan of the query in pages of candidates.
pub(super) struct Scan<K> {
    state: State<K>,
    paging: Paging,
    /// The highest key scanned for candidates so far.
    cursor: Option<K>,
    /// Candidate keys the last page read asked for: the page size, or fewer
    /// when `max_rows` leaves fewer rows to take.
    asked: i64,
    /// Candidates found locked by others in this pass, to retry in the next
    /// (only when draining, on backends with row locks): those of each page,
    /// in the claim order, make a page of their own.
    retry: Vec<Vec<K>>,
    /// Candidates found locked by others, over every pass.
    pub(super) locked: u64,
    processed_before_pass: u64,
    /// The backend has row locks: candidates a take passed over may be
    /// locked by others rather than gone.
    row_locks: bool,
    /// Rows come back in the claim order and tell their own positions: a
    /// take goes on from its last row.
    rows_tell_positions: bool,
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

impl<K> Scan<K> {
    /// The scan of a claim whose rows come back in the claim order and tell
    /// their positions if `rows_tell_positions`.
    pub(super) fn new(plan: &Plan, rows_tell_positions: bool) -> Self {
        Scan {
            state: State::Pass,
            // Rows that come back in key order tell how far a take went, so
            // takes can run past the page; a drain keeps to its pages, whose
            // candidates it retries.
            paging: Paging::new(plan, rows_tell_positions && !plan.drain),
            cursor: None,
            asked: 0,
            retry: Vec::new(),
            locked: 0,
            processed_before_pass: 0,
            row_locks: plan.row_locks,
            rows_tell_positions,
        }
    }

    /// The page being taken from, if any.
    pub(super) fn page(&self) -> Option<&Page<K>> {
        match &self.state {
            State::Page(page, _) => Some(page),
            _ => None,
        }
    }

    /// A [`Paging`] seen by the tests.
    #[cfg(test)]
    pub(super) fn paging(&self) -> &Paging {
        &self.paging
    }
}

impl<K: Clone + Eq + Hash> Scan<K> {
    /// What to do next, the ranges without the keys left out: each state
    /// either asks for a statement or moves on to the next state.
    pub(super) fn next(&mut self, progress: &mut Progress) -> Step<K> {
        loop {
            let step = match std::mem::replace(&mut self.state, State::Done) {
                State::Pass => self.begin_pass(progress),
                State::Retry(pages) => self.retry(pages),
                State::Scan => self.read_page(progress),
                State::Page(page, then) => self.take_from(page, then, progress),
                State::PassEnd => self.end_pass(progress),
                State::Done => Some(Step::Done),
                State::Scanning | State::Sorting(..) => {
                    unreachable!("a claim's driver skipped a read it was asked for")
                }
            };
            if let Some(step) = step {
                return step;
            }
        }
    }

    /// A pass begins. Rows processed before are never visited again: only
    /// the rows found locked, then rows beyond the highest key seen.
    fn begin_pass(&mut self, progress: &mut Progress) -> Option<Step<K>> {
        progress.report.passes += 1;
        self.processed_before_pass = progress.report.processed;
        self.locked = 0;
        self.state = State::Retry(std::mem::take(&mut self.retry).into_iter());
        None
    }

    /// The next page of candidates found locked in the last pass, if any.
    fn retry(&mut self, mut pages: std::vec::IntoIter<Vec<K>>) -> Option<Step<K>> {
        self.state = match pages.next() {
            Some(keys) => {
                // Taken as a page, not one transaction per key: the rows
                // others held are mostly done by now, and a take passes
                // over those in one read.
                let start = self.paging.start(keys.len(), false);
                let mut page = Page::new(keys, false, start);
                page.retrying = true;
                State::Page(page, Then::Retry(pages))
            }
            None => State::Scan,
        };
        None
    }

    /// Reads the next page of candidates, if the call may take more rows.
    fn read_page(&mut self, progress: &Progress) -> Option<Step<K>> {
        if progress.remaining == 0 {
            self.state = State::PassEnd;
            return None;
        }
        self.state = State::Scanning;
        // Never more candidates than the call may still take.
        self.asked = i64::try_from(progress.remaining)
            .map_or(self.paging.size, |left| left.min(self.paging.size));
        Some(Step::Candidates(
            KeyRange::after(self.cursor.clone()),
            self.asked,
        ))
    }

    /// The keys [`Step::Candidates`] read: a page to take from.
    pub(super) fn candidates(&mut self, mut keys: Vec<K>) {
        let full_page = keys.len() as i64 == self.asked;
        // A join to many rows repeats a key.
        let mut seen = HashSet::with_capacity(keys.len());
        keys.retain(|key| seen.insert(key.clone()));
        if keys.is_empty() {
            self.state = State::PassEnd;
            return;
        }
        let open_ended = self.paging.open_ended;
        let start = self.paging.start(keys.len(), open_ended);
        let page = Page::new(keys, open_ended, start);
        // Closed pages end where they end; open-ended ones where the takes got to.
        let then = if open_ended || full_page {
            Then::Scan
        } else {
            Then::PassEnd
        };
        self.state = State::Page(page, then);
    }

    /// The next batch of the page, or, once the page is done or the call
    /// may take no more rows, its end.
    fn take_from(
        &mut self,
        page: Page<K>,
        then: Then<K>,
        progress: &mut Progress,
    ) -> Option<Step<K>> {
        if progress.remaining == 0 || page.exhausted {
            return self.end_page(page, then, progress);
        }
        let limit = progress.next_limit();
        let range = page.next_range();
        self.state = State::Page(page, then);
        Some(Step::Batch(range, limit))
    }

    /// Records the rows a [`Step::Batch`] claimed from the page (it asked
    /// for `limit`; a mark or a stamp if `marked`), and returns them as the
    /// closure gets them.
    pub(super) fn taken<R>(
        &mut self,
        rows: Vec<R>,
        limit: i64,
        marked: bool,
        key_of: impl Fn(&R) -> K,
    ) -> Result<Vec<R>, Error> {
        let State::Page(page, _) = &mut self.state else {
            unreachable!("rows taken outside a page");
        };
        page.record(rows, limit, self.rows_tell_positions, marked, key_of)
    }

    /// A page is done: the scan moves past it, and the candidates its takes
    /// passed over are counted, or, with row locks, read again to sort them.
    fn end_page(
        &mut self,
        page: Page<K>,
        then: Then<K>,
        progress: &mut Progress,
    ) -> Option<Step<K>> {
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
        progress.report.not_reached += page.unprocessed().count() as u64 - passed_over;
        if passed_over > 0 && self.row_locks {
            self.paging
                .contended(page.keys.len() as u64, passed_over, page.taken());
            // One read tells the candidates locked by others (still
            // matching) from those gone (processed by others, or changed)
            // since.
            let range = page.whole_range();
            self.state = State::Sorting(page, then);
            return Some(Step::StillMatching(range));
        }
        // One writer at a time (SQLite): a candidate a take passed over no
        // longer matched.
        progress.report.gone += passed_over;
        self.state = then.into();
        None
    }

    /// The keys [`Step::StillMatching`] read: the page's passed-over
    /// candidates were locked by others if they still match, gone if not.
    pub(super) fn still_matching(&mut self, keys: Vec<K>, progress: &mut Progress) {
        let State::Sorting(page, then) = std::mem::replace(&mut self.state, State::Done) else {
            unreachable!("still_matching without a page to sort");
        };
        let still_matching: HashSet<K> = keys.into_iter().collect();
        let (locked, gone): (Vec<&K>, Vec<&K>) = page
            .passed_over()
            .partition(|key| still_matching.contains(*key));
        // Rows others hold fill more than a quarter of the page: larger pages
        // leave workers that start at places of their own room between them.
        if self.paging.contended && locked.len() * 4 > page.keys.len() {
            self.paging.grow();
        }
        self.locked += locked.len() as u64;
        progress.report.gone += gone.len() as u64;
        if progress.drain && progress.remaining > 0 && !locked.is_empty() {
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

    /// The pass is over: a drain that claimed rows in it and may claim more
    /// begins another.
    fn end_pass(&mut self, progress: &Progress) -> Option<Step<K>> {
        let claimed_nothing_new = progress.report.processed == self.processed_before_pass;
        if !progress.drain || claimed_nothing_new || progress.remaining == 0 {
            return Some(Step::Done);
        }
        self.state = State::Pass;
        None
    }
}
