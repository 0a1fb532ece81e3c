//! How the scan's pages are laid out: how many candidate keys a page reads,
//! by default and as other workers are seen claiming beside this one, and
//! where in a page its takes start.

use super::{Plan, Taking};

/// Rows read per page of the unlocked candidate scan, unless batches are large.
pub(super) const DEFAULT_PAGE_SIZE: i64 = 1000;

/// Rows read per page of the candidate scan, at least, when takes may run
/// past their page.
pub(super) const MIN_OPEN_PAGE_SIZE: i64 = 100;

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
/// other workers are seen claiming beside this one (see [`Paging::contended`]).
const CONTENDED_BATCHES_PER_PAGE: i64 = 256;
const CONTENDED_PAGE_SIZE: (i64, i64) = (16_384, 65_536);

/// A contended page of which this worker got fewer rows than this is read
/// again four times larger (see [`Paging::contended`]).
const MIN_ROWS_PER_PAGE: u64 = 64;

/// How the scan lays out its pages.
pub(super) struct Paging {
    /// The rows a take asks for, of which a page holds several.
    batch: i64,
    /// Takes run past the end of their page: see
    /// [`Page::open_ended`](crate::claim::page::Page::open_ended).
    pub(super) open_ended: bool,
    /// Candidate keys a page read asks for, at most.
    pub(super) size: i64,
    /// The page size was the caller's: it does not grow.
    size_given: bool,
    /// The backend's pages grow once contended.
    grow_contended: bool,
    /// Pages may start anywhere in them (see
    /// [`Page::new`](crate::claim::page::Page::new)): the claim order is the
    /// key's, a row locked by others is passed over, not an error, and rows
    /// stay locked while the closure runs.
    may_stripe: bool,
    /// Other workers were seen claiming the same rows (see
    /// [`contended`](Self::contended)): pages start at places of their own.
    pub(super) contended: bool,
}

impl Paging {
    /// The pages of a claim whose takes run past them if `open_ended`.
    pub(super) fn new(plan: &Plan, open_ended: bool) -> Self {
        Paging {
            batch: plan.batch,
            open_ended,
            size: plan
                .page_size
                .unwrap_or_else(|| first_page_size(plan.batch, open_ended, plan.ordered_by_key)),
            size_given: plan.page_size.is_some(),
            grow_contended: plan.grow_contended_pages,
            // A mark committed on its own holds its rows' locks only while it
            // runs: others meet rows it marked, which no longer match, rather
            // than rows it holds, and larger pages would only be read more.
            may_stripe: plan.row_locks
                && plan.ordered_by_key
                && !plan.fail_on_locked
                && plan.taking != Taking::MarkAndCommit,
            contended: false,
        }
    }

    /// Where the takes from a page of `keys` keys start: at its head, or,
    /// once contended, at a place of their own, unless the page is
    /// `open_ended`.
    pub(super) fn start(&self, keys: usize, open_ended: bool) -> usize {
        if self.contended && !open_ended {
            random_below(keys)
        } else {
            0
        }
    }

    /// A page's takes passed over `passed_over` of its `candidates`, which
    /// other workers held or had taken, and took `taken` rows: the claim is
    /// contended. Workers that all start at the head of the same page pass over
    /// each other's rows inside their locked takes, so that the work per row
    /// grows with the number of workers; from here on each page starts at a
    /// place of its own ([`Page::new`](crate::claim::page::Page::new)) and keeps to its end. Pages grow while
    /// this worker got only a few rows of one that others took most of: the
    /// statements per page are then spread over more rows.
    pub(super) fn contended(&mut self, candidates: u64, passed_over: u64, taken: u64) {
        if !self.may_stripe {
            return;
        }
        self.contended = true;
        if self.open_ended && !self.size_given {
            self.open_ended = false;
            self.size = closed_page_size(self.batch);
        } else if taken < MIN_ROWS_PER_PAGE && passed_over.saturating_mul(2) > candidates {
            self.grow();
        }
    }

    /// Pages four times larger, up to [`CONTENDED_PAGE_SIZE`], unless the
    /// caller set their size or the backend's pages keep theirs (MySQL).
    /// (A contended claim's pages are closed unless the caller set their
    /// size.)
    pub(super) fn grow(&mut self) {
        if self.size_given || !self.grow_contended {
            return;
        }
        let (least, most) = CONTENDED_PAGE_SIZE;
        let most = self
            .batch
            .saturating_mul(CONTENDED_BATCHES_PER_PAGE)
            .clamp(least, most)
            .max(self.size);
        self.size = self.size.saturating_mul(4).min(most);
    }
}

/// The page size of a claim that did not set one: takes that run past their
/// page (`open_ended`), in an order other than the key's, or keeping to
/// pages of `batch`-row takes.
fn first_page_size(batch: i64, open_ended: bool, ordered_by_key: bool) -> i64 {
    if open_ended {
        // Takes move on by themselves: reading much further ahead than a
        // batch would only re-read keys other workers take first.
        MIN_OPEN_PAGE_SIZE.max(batch)
    } else if !ordered_by_key {
        ORDERED_PAGE_SIZE.max(batch.saturating_mul(ORDERED_BATCHES_PER_PAGE))
    } else {
        closed_page_size(batch)
    }
}

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
