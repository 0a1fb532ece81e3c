//! The backoff of a worker from its failing rows.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::claim::engine::MAX_EXCLUDED;

/// The rows a worker leaves out of its claims after their closures failed,
/// each until its backoff has passed: one for all the loops of a worker on a
/// pool, shared with each run of its claim.
///
/// A run records a failing row here while the row is still locked, before
/// its transaction ends, and passes over the rows a take locked that the
/// backoff holds: so no loop runs a row again before its backoff has passed,
/// not even one whose take began before the failure was recorded.
#[derive(Debug)]
pub(crate) struct Backoff<K> {
    first: Duration,
    max: Duration,
    /// Per row: its failures here, and when it may be taken again.
    rows: Mutex<HashMap<K, (u32, Instant)>>,
}

/// Rows a worker leaves out of a claim, at most: the rest of the claim's
/// room is for the rows that fail during it.
const MAX_BACKED_OFF: usize = MAX_EXCLUDED / 2;

impl<K: Clone + Eq + Hash> Backoff<K> {
    pub(crate) fn new((first, max): (Duration, Duration)) -> Arc<Self> {
        Arc::new(Backoff {
            first,
            max,
            rows: Mutex::new(HashMap::new()),
        })
    }

    fn rows(&self) -> MutexGuard<'_, HashMap<K, (u32, Instant)>> {
        // Each entry is written whole: a panic elsewhere leaves none half
        // written.
        self.rows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The rows at `keys` failed: each is left out until its backoff passes.
    pub(crate) fn failed(&self, keys: &[K]) {
        if self.first.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut rows = self.rows();
        for key in keys {
            let (failures, until) = rows.entry(key.clone()).or_insert((0, now));
            let doublings = (*failures).min(31);
            *failures += 1;
            *until = now + self.first.saturating_mul(1 << doublings).min(self.max);
        }
    }

    /// Whether the row at `key` is still backed off from.
    pub(crate) fn holds(&self, key: &K) -> bool {
        let now = Instant::now();
        self.rows().get(key).is_some_and(|(_, until)| *until > now)
    }

    /// The rows to leave out now: those whose backoff has not passed, the
    /// latest first, at most [`MAX_BACKED_OFF`]. Rows whose backoff passed
    /// longer than the longest backoff ago are forgotten.
    pub(crate) fn excluded(&self) -> Vec<K> {
        let now = Instant::now();
        let max = self.max;
        let mut rows = self.rows();
        rows.retain(|_, (_, until)| now.saturating_duration_since(*until) <= max);
        let mut waiting: Vec<(&K, Instant)> = rows
            .iter()
            .filter(|(_, (_, until))| *until > now)
            .map(|(key, (_, until))| (key, *until))
            .collect();
        waiting.sort_by_key(|(_, until)| std::cmp::Reverse(*until));
        waiting
            .into_iter()
            .take(MAX_BACKED_OFF)
            .map(|(key, _)| key.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failing row is left out for the first backoff, doubling with each
    /// failure up to the longest; it comes back once its backoff has passed.
    #[test]
    fn failing_rows_are_left_out_until_their_backoff_passes() {
        let first = Duration::from_millis(40);
        let backoff = Backoff::new((first, first * 3));
        backoff.failed(&[1, 2]);
        let mut excluded = backoff.excluded();
        excluded.sort();
        assert_eq!(excluded, [1, 2]);
        assert!(backoff.holds(&1) && !backoff.holds(&3));
        std::thread::sleep(first + Duration::from_millis(10));
        assert!(backoff.excluded().is_empty());
        assert!(!backoff.holds(&1));
        // The second failure doubles the backoff, the third caps it.
        backoff.failed(&[1]);
        backoff.failed(&[1]);
        let (failures, until) = backoff.rows()[&1];
        assert_eq!(failures, 3);
        let left = until.saturating_duration_since(Instant::now());
        assert!(left > first * 2 && left <= first * 3, "{left:?}");
    }

    /// At most half the claim's room for left-out rows goes to the backoff,
    /// the rows that failed last.
    #[test]
    fn a_worker_leaves_out_a_bounded_number_of_rows() {
        let backoff = Backoff::new((Duration::from_secs(60), Duration::from_secs(60)));
        let keys: Vec<i32> = (0..(MAX_BACKED_OFF as i32 + 10)).collect();
        for key in &keys {
            backoff.failed(&[*key]);
        }
        let excluded = backoff.excluded();
        assert_eq!(excluded.len(), MAX_BACKED_OFF);
        assert!(excluded.contains(keys.last().unwrap()));
    }

    /// Without a backoff, a failing row is not left out at all.
    #[test]
    fn no_backoff_holds_nothing() {
        let backoff = Backoff::new((Duration::ZERO, Duration::ZERO));
        backoff.failed(&[1]);
        assert!(!backoff.holds(&1) && backoff.excluded().is_empty());
    }
}
