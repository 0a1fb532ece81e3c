//! How many candidate keys a page of the unlocked scan reads: by default,
//! and as other workers are seen claiming beside this one.

use super::Claim;

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
/// other workers are seen claiming beside this one (see [`Claim::contended`]).
const CONTENDED_BATCHES_PER_PAGE: i64 = 256;
const CONTENDED_PAGE_SIZE: (i64, i64) = (16_384, 65_536);

/// A contended page of which this worker got fewer rows than this is read
/// again four times larger (see [`Claim::contended`]).
const MIN_ROWS_PER_PAGE: u64 = 64;

/// The page size of a claim that did not set one: takes that run past their
/// page (`open_ended`), in an order other than the key's, or keeping to
/// pages of `batch`-row takes.
pub(super) fn first_page_size(batch: i64, open_ended: bool, ordered_by_key: bool) -> i64 {
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

impl<K> Claim<K> {
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
    pub(super) fn grow_pages(&mut self) {
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
}
