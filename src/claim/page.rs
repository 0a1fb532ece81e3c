//! A page of candidates: the keys one unlocked read found, in the order the
//! takes go through them, and what has become of each.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

use crate::sql::{KeyRange, Lower};
use crate::Error;

/// A page of candidates' positions, in the order its takes go through them,
/// and what has become of them.
///
/// The takes go through a page in one stretch, or in two when it starts
/// further in ([`Page::new`]): from there to its end, then from its head to
/// where they started.
pub(crate) struct Page<K> {
    /// Where the next batch starts: at the first candidate of its stretch, then
    /// past the furthest candidate claimed so far. Not at the cursor: the rows
    /// between it and the first candidate were done when the page was read (by
    /// other workers, often), and a take starting there would step over every
    /// one of them inside its transaction.
    pub(crate) next: Lower<K>,
    /// The candidates in the order the takes go through them: in the claim
    /// order from where the page starts, then from its head.
    pub(crate) keys: Vec<K>,
    /// Where in `keys` the page's head is (`keys.len()` when the page starts
    /// at its head).
    pub(crate) head: usize,
    /// Where in `keys` the takes' stretch ends (exclusive).
    pub(crate) stretch_end: usize,
    pub(crate) position: HashMap<K, usize>,
    pub(crate) processed: Vec<bool>,
    /// Rows processed that were not candidates: inserted since the scan, or,
    /// when open-ended, beyond the page.
    pub(crate) newcomers: HashSet<K>,
    /// Takes run past the page's last key, to its first claimable rows
    /// wherever they are: the page's keys only tell which candidates the takes
    /// passed over. Else takes keep to the page.
    pub(crate) open_ended: bool,
    /// The page has no more to give.
    pub(crate) exhausted: bool,
    /// The last take came back short: nothing more in its range is claimable.
    pub(crate) ran_dry: bool,
    /// How far the takes have gone through the range, inclusive (`None`: to the
    /// end of it, when open-ended).
    pub(crate) reached: Option<K>,
    /// The furthest candidate processed, by its place in the page.
    pub(crate) furthest: Option<usize>,
    /// Made of candidates found locked in the last pass: rows of its range
    /// that are not among them are not handed over.
    pub(crate) retrying: bool,
}

impl<K: Clone + Eq + Hash> Page<K> {
    /// A page of `keys`, in the claim order, whose takes begin at `keys[start]`.
    /// Workers that read the same page at once, each from a place of its own,
    /// take rows apart from one another rather than pass over each other's.
    /// An open-ended page starts at its head.
    pub(crate) fn new(mut keys: Vec<K>, open_ended: bool, start: usize) -> Self {
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
    pub(crate) fn first(&self) -> &K {
        &self.keys[self.head % self.keys.len()]
    }

    /// The page's keys in the claim order.
    pub(crate) fn in_claim_order(&self) -> impl Iterator<Item = &K> {
        self.keys[self.head..].iter().chain(&self.keys[..self.head])
    }

    /// The page's last key in the claim order.
    pub(crate) fn last(&self) -> &K {
        &self.keys[self.head - 1]
    }

    /// The last key of the stretch the takes are in.
    pub(crate) fn stretch_last(&self) -> &K {
        &self.keys[self.stretch_end - 1]
    }

    /// The takes are done with their stretch: they go on from the page's head,
    /// or, past both stretches, the page has no more to give.
    pub(crate) fn end_stretch(&mut self) {
        if self.stretch_end < self.keys.len() {
            self.next = Lower::From(self.keys[self.stretch_end].clone());
            self.stretch_end = self.keys.len();
        } else {
            self.exhausted = true;
        }
    }

    pub(crate) fn whole_range(&self) -> KeyRange<K> {
        KeyRange::new(Lower::From(self.first().clone()), Some(self.last().clone()))
    }

    pub(crate) fn next_range(&self) -> KeyRange<K> {
        let through = (!self.open_ended).then(|| self.stretch_last().clone());
        KeyRange::new(self.next.clone(), through)
    }

    /// Where the scan for candidates goes on from after this page.
    pub(crate) fn scanned_through(&self) -> K {
        match &self.next {
            Lower::After(key) if self.open_ended => key.clone(),
            _ => self.last().clone(),
        }
    }

    /// Unprocessed candidates the takes went past: all of them, unless the
    /// page was left before its end (`max_rows` reached), when those beyond the
    /// furthest one processed, in the order the takes go, were not reached.
    pub(crate) fn passed_over(&self) -> impl Iterator<Item = &K> {
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
    pub(crate) fn taken(&self) -> u64 {
        (self
            .processed
            .iter()
            .filter(|processed| **processed)
            .count()
            + self.newcomers.len()) as u64
    }

    pub(crate) fn unprocessed(&self) -> impl Iterator<Item = &K> {
        self.keys
            .iter()
            .zip(&self.processed)
            .filter(|(_, processed)| !**processed)
            .map(|(key, _)| key)
    }

    /// Records the rows a batch claimed (`limit` asked for) and moves the page
    /// on. `ordered`: the rows tell their own positions (a locking select in
    /// the key's order); `marked`: they were marked.
    pub(crate) fn record<R>(
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
