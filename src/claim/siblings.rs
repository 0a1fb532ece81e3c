//! What a pooled worker's claim loops hold and have taken, shared by the
//! loops, so that their takes from the head start past each other's rows
//! rather than pass over each of them under lock.
//!
//! Loops that all take from the head of the same queue meet each other's
//! rows first: a take with `SKIP LOCKED` tries the lock of every row the
//! other loops hold before it reaches one it can lock, and PostgreSQL tries
//! each through its lock manager and under an exclusive lock on the row's
//! page, the pages every other loop reads. That work grows with the loops,
//! per row taken: at a full queue, 64 loops spent all of the server's time
//! there (lock-manager waits were most of what their sessions waited on).
//!
//! Loops of one process know what the others took. Most takes start after the
//! last row of the last batch taken past the others, held or done. A loop
//! looks ahead of them, up to the first row of the oldest batch the others
//! hold, once in every round of the loops' takes, and before it ends a run
//! whose take past them came back short; a look that fills its batch goes on
//! after it. So a row left free behind them (rolled back, let go by another
//! process, or committed late by its producer, as concurrent producers' rows
//! often are) waits about as long as a batch takes, and many such rows are
//! taken batch after batch. Other processes' rows are still passed over
//! under lock.
//!
//! The head of a queue of deleted jobs is where vacuum has yet to pass, and
//! while a transaction anywhere on the server is older than the deletes, it
//! cannot: a scan from the head reads the index entry and the row of every
//! job done since, each time. So a look ahead does not start at the head: it
//! starts where the look before the last one ended (its *low water*), one
//! look behind, for rows committed a little late. A *catch-up* look from the
//! head comes at most once a second, and no more often than keeps its own
//! time under a twentieth of the time between two: it finds the rows left
//! free behind the low water (a job that failed and was let go, one whose
//! run time came, one committed long after its key was drawn), which wait
//! for it. The cost of a take then stays that of the rows it takes, however
//! many jobs were done since the last vacuum.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Catch-up looks from the head come at most this often.
const CATCH_UP_EVERY: Duration = Duration::from_secs(1);

/// A catch-up look takes at most this share of the time until the next one:
/// on a table of many dead rows, it comes less often.
const CATCH_UP_SHARE: u32 = 20;

/// What a worker's loops hold and have taken, shared by the loops.
#[derive(Debug)]
pub(crate) struct Siblings<K> {
    slots: Mutex<Slots<K>>,
}

#[derive(Debug)]
struct Slots<K> {
    /// The batch each loop holds: a slot per loop.
    held: Vec<Option<Held<K>>>,
    /// Batches taken so far: the next batch's number.
    taken: u64,
    /// The last row of the last batch taken past the others, held or done:
    /// where the next take past them starts.
    furthest: Option<K>,
    /// Takes steered around the others so far.
    steered: u64,
    /// Where looks ahead start between catch-ups: where the look before the
    /// last one ended (none: at the head).
    low: Option<K>,
    /// Where the last look ahead ended: the next one's `low`.
    reached: Option<K>,
    /// When the next catch-up look from the head is due (none yet: at once).
    catch_up_at: Option<Instant>,
    /// The loop making a catch-up look, and when it began.
    catching_up: Option<(usize, Instant)>,
}

/// A batch a loop's transaction holds: its first row in the claim order, and
/// its number in the order the loops took their batches.
#[derive(Debug)]
struct Held<K> {
    number: u64,
    first: K,
}

impl<K> Siblings<K> {
    /// Slots for `loops` loops, none holding anything.
    #[cfg(any(
        test,
        feature = "postgres",
        feature = "sqlite",
        feature = "mysql",
        feature = "async"
    ))]
    pub(crate) fn new(loops: usize) -> Arc<Self> {
        Arc::new(Siblings {
            slots: Mutex::new(Slots {
                held: (0..loops).map(|_| None).collect(),
                taken: 0,
                furthest: None,
                steered: 0,
                low: None,
                reached: None,
                catch_up_at: None,
                catching_up: None,
            }),
        })
    }

    /// The slot of loop `index` (below the number of loops).
    pub(crate) fn slot(self: &Arc<Self>, index: usize) -> Sibling<K> {
        Sibling {
            all: Arc::clone(self),
            index,
        }
    }

    fn slots(&self) -> MutexGuard<'_, Slots<K>> {
        // A slot is written whole: a panic elsewhere leaves none half written.
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One loop's slot: the batch it holds, and what the others do. A run of the
/// loop's claim gets a clone; dropped, the slot holds nothing, as the run's
/// transaction has ended.
#[derive(Debug)]
pub(crate) struct Sibling<K> {
    all: Arc<Siblings<K>>,
    index: usize,
}

impl<K> Clone for Sibling<K> {
    fn clone(&self) -> Self {
        self.all.slot(self.index)
    }
}

/// How a take from the head steers around the rows the loops have taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Steer<K> {
    /// After `from` (from the head: none) through `through`: see
    /// [`Sibling::ahead_from`] and [`Sibling::ahead_through`].
    Ahead { from: Option<K>, through: K },
    /// After `past`: see [`Sibling::past`].
    Past(K),
}

impl<K: Clone> Sibling<K> {
    /// This loop's transaction has locked a batch whose rows, in the claim
    /// order, run from `first` to `last`; a take `ahead` of the others took
    /// it, else one past them (or one of the whole query).
    pub(crate) fn holds(&self, first: K, last: K, ahead: bool) {
        let mut slots = self.all.slots();
        let number = slots.taken;
        slots.taken += 1;
        slots.held[self.index] = Some(Held { number, first });
        if !ahead {
            slots.furthest = Some(last);
        }
    }

    /// How the next take of a run steers around the rows the loops have
    /// taken, once they have taken any. Most takes start past them; once in
    /// every round of the loops' takes, one looks ahead of what the others
    /// hold, so that a row left free behind them (rolled back, or committed
    /// late by its producer) waits about as long as a batch takes. (A run
    /// whose take past them came back short also looks ahead before it ends:
    /// the claim engine's `HeadTake`.)
    pub(crate) fn around(&self) -> Option<Steer<K>> {
        self.around_at(Instant::now())
    }

    fn around_at(&self, now: Instant) -> Option<Steer<K>> {
        let mut slots = self.all.slots();
        let past = slots.furthest.clone()?;
        let ahead = slots.steered.is_multiple_of(slots.held.len() as u64);
        slots.steered += 1;
        if ahead {
            let through = self.through(&slots).unwrap_or(past);
            let from = self.low_water(&mut slots, now);
            Some(Steer::Ahead { from, through })
        } else {
            Some(Steer::Past(past))
        }
    }

    /// Where a look ahead of the others starts: after the low water, or at
    /// the head when a catch-up look is due (or no look has set it yet).
    pub(crate) fn ahead_from(&self) -> Option<K> {
        self.ahead_from_at(Instant::now())
    }

    fn ahead_from_at(&self, now: Instant) -> Option<K> {
        self.low_water(&mut self.all.slots(), now)
    }

    fn low_water(&self, slots: &mut Slots<K>, now: Instant) -> Option<K> {
        let due = slots.catch_up_at.is_none_or(|at| now >= at);
        if due || slots.low.is_none() {
            slots.catch_up_at = Some(now + CATCH_UP_EVERY);
            slots.catching_up = Some((self.index, now));
            return None;
        }
        slots.low.clone()
    }

    /// This loop's look ahead has come back: having run out its range
    /// through `through`, or with a full batch (none), the look going on.
    /// A catch-up look's time sets when the next is due.
    pub(crate) fn looked_ahead(&self, through: Option<K>) {
        self.looked_ahead_at(through, Instant::now());
    }

    fn looked_ahead_at(&self, through: Option<K>, now: Instant) {
        let mut slots = self.all.slots();
        if let Some((index, began)) = slots.catching_up {
            if index == self.index {
                slots.catching_up = None;
                let spent = now.saturating_duration_since(began);
                slots.catch_up_at = Some(began + CATCH_UP_EVERY.max(spent * CATCH_UP_SHARE));
            }
        }
        if let Some(through) = through {
            // One look behind: a row committed while this look passed its
            // place is still ahead of the next one's start.
            slots.low = slots.reached.replace(through);
        }
    }

    /// Where a take past the others starts: after the last row of the last
    /// batch taken past them, held or done.
    pub(crate) fn past(&self) -> Option<K> {
        self.all.slots().furthest.clone()
    }

    /// Where a look ahead of the others ends: at the first row of the oldest
    /// batch they hold, or when they hold none, at the last row taken past
    /// them.
    pub(crate) fn ahead_through(&self) -> Option<K> {
        self.through(&self.all.slots())
    }

    fn through(&self, slots: &Slots<K>) -> Option<K> {
        let others = slots
            .held
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != self.index);
        let oldest = others
            .filter_map(|(_, held)| held.as_ref())
            .min_by_key(|held| held.number);
        oldest
            .map(|held| held.first.clone())
            .or_else(|| slots.furthest.clone())
    }
}

impl<K> Sibling<K> {
    /// This loop's transaction has ended: its rows are done, or free again.
    pub(crate) fn released(&self) {
        self.all.slots().held[self.index] = None;
    }
}

impl<K> Drop for Sibling<K> {
    fn drop(&mut self) {
        self.released();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_start_past_the_last_batch_and_one_a_round_looks_ahead() {
        let siblings = Siblings::new(3);
        let (a, b, c) = (siblings.slot(0), siblings.slot(1), siblings.slot(2));
        // Nothing taken yet: the whole query.
        assert_eq!(c.around(), None);
        assert_eq!((c.past(), c.ahead_through()), (None, None));
        a.holds(1, 10, false);
        b.holds(11, 20, false);
        let ahead = |through| {
            Some(Steer::Ahead {
                from: None,
                through,
            })
        };
        // One take in each round of three looks ahead of the others' oldest
        // batch; its own batch is not one of them.
        assert_eq!(c.around(), ahead(1));
        assert_eq!(c.around(), Some(Steer::Past(20)));
        assert_eq!(a.around(), Some(Steer::Past(20)));
        assert_eq!(a.around(), ahead(11));
        assert_eq!((a.past(), a.ahead_through()), (Some(20), Some(11)));
        // A batch taken ahead does not move where takes past start.
        c.holds(5, 6, true);
        a.released();
        a.holds(21, 30, false);
        assert_eq!(b.around(), Some(Steer::Past(30)));
        assert_eq!(b.around(), Some(Steer::Past(30)));
        assert_eq!(b.around(), ahead(5));
        // Once every batch is done, takes still start past the last one, and
        // looks ahead go through it.
        for sibling in [&a, &b, &c] {
            sibling.released();
        }
        assert_eq!(c.around(), Some(Steer::Past(30)));
        assert_eq!(c.around(), Some(Steer::Past(30)));
        assert_eq!(c.around(), ahead(30));
        assert_eq!(c.ahead_through(), Some(30));
    }

    #[test]
    fn a_dropped_slot_holds_nothing() {
        let siblings = Siblings::new(2);
        let (a, b) = (siblings.slot(0), siblings.slot(1));
        let run = a.clone();
        run.holds(1, 10, false);
        let ahead = |through| {
            Some(Steer::Ahead {
                from: None,
                through,
            })
        };
        assert_eq!(b.around(), ahead(1));
        drop(run);
        assert_eq!(b.around(), Some(Steer::Past(10)));
        assert_eq!(b.around(), ahead(10));
    }

    #[test]
    fn looks_ahead_start_one_look_behind_and_catch_up_from_the_head_once_a_second() {
        let siblings = Siblings::new(2);
        let (a, b) = (siblings.slot(0), siblings.slot(1));
        let start = Instant::now();
        let at = |millis| start + Duration::from_millis(millis);
        a.holds(1, 10, false);
        // The first looks start at the head: no look has ended yet.
        assert_eq!(b.around_at(at(0)), ahead(None, 1));
        b.looked_ahead_at(Some(1), at(2));
        assert_eq!(b.around_at(at(3)), Some(Steer::Past(10)));
        a.released();
        b.holds(11, 20, false);
        assert_eq!(a.around_at(at(4)), ahead(None, 11));
        a.looked_ahead_at(Some(11), at(5));
        // From here on, after where the look before the last ended.
        assert_eq!(a.around_at(at(6)), Some(Steer::Past(20)));
        assert_eq!(a.around_at(at(7)), ahead(Some(1), 11));
        // A look that fills its batch goes on: the low water stays.
        a.looked_ahead_at(None, at(8));
        assert_eq!(a.ahead_from_at(at(9)), Some(1));
        a.looked_ahead_at(Some(11), at(10));
        assert_eq!(a.ahead_from_at(at(11)), Some(11));
        // A second after the last catch-up began, the next look is one.
        assert_eq!(a.ahead_from_at(at(1_003)), Some(11));
        assert_eq!(b.ahead_from_at(at(1_004)), None);
        assert_eq!(a.ahead_from_at(at(1_005)), Some(11));
        // A catch-up that took 100 ms makes the next wait 2 s.
        b.looked_ahead_at(Some(20), at(1_104));
        assert_eq!(a.ahead_from_at(at(3_003)), Some(11));
        assert_eq!(a.ahead_from_at(at(3_004)), None);
    }

    fn ahead(from: Option<i32>, through: i32) -> Option<Steer<i32>> {
        Some(Steer::Ahead { from, through })
    }
}
