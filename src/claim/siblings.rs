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
//! looks from the head up to the first row of the oldest batch the others
//! hold once in every round of the loops' takes, and before it ends a run
//! whose take past them came back short; a look that fills its batch goes on
//! after it. So a row left free behind them (rolled back, let go by another
//! process, or committed late by its producer, as concurrent producers' rows
//! often are) waits about as long as a batch takes, and many such rows are
//! taken batch after batch. The head of a queue of deleted jobs is also where
//! vacuum has yet to pass: a take that starts past it reads no dead index
//! entries either, and a look ahead does. Other processes' rows are still
//! passed over under lock.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

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
        feature = "bb8",
        feature = "deadpool"
    ))]
    pub(crate) fn new(loops: usize) -> Arc<Self> {
        Arc::new(Siblings {
            slots: Mutex::new(Slots {
                held: (0..loops).map(|_| None).collect(),
                taken: 0,
                furthest: None,
                steered: 0,
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
    /// From the head through `through`: see [`Sibling::ahead_through`].
    Ahead { through: K },
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
        let mut slots = self.all.slots();
        let past = slots.furthest.clone()?;
        let ahead = slots.steered.is_multiple_of(slots.held.len() as u64);
        slots.steered += 1;
        if ahead {
            let through = self.through(&slots).unwrap_or(past);
            Some(Steer::Ahead { through })
        } else {
            Some(Steer::Past(past))
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
        let ahead = |through| Some(Steer::Ahead { through });
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
        assert_eq!(b.around(), Some(Steer::Ahead { through: 1 }));
        drop(run);
        assert_eq!(b.around(), Some(Steer::Past(10)));
        assert_eq!(b.around(), Some(Steer::Ahead { through: 10 }));
    }
}
