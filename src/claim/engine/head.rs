//! Takes from the head of the query: a worker's, and those of a pooled
//! worker's loops, which steer around each other's batches.

use std::collections::HashSet;
use std::hash::Hash;

use super::{Plan, Progress, Step, MAX_EXCLUDED};
use crate::claim::siblings::{Sibling, Steer};
use crate::sql::{KeyRange, Lower};

/// Rows a worker's run from the head hands over, at most, before the worker
/// starts the next run: a run remembers every key it has handed over, so
/// that none comes back twice in it.
const WORKER_RUN_ROWS: usize = 10_000;

/// A claim's takes from the head of the query, until a take comes back
/// short (or, draining, empty); on a pool, as [`HeadTake`] says.
pub(super) struct HeadTakes<K> {
    /// The keys handed over so far, which a take that meets them again (the
    /// closure left them matching) passes over.
    handed: HashSet<K>,
    /// See [`Plan::failed_again`].
    failed_again: bool,
    /// A worker's run, which ends past [`WORKER_RUN_ROWS`].
    in_worker: bool,
    /// Takes may steer around a pooled worker's other loops: the claim order
    /// is the key's, a row locked by others is passed over, and rows stay
    /// locked, coming back in the claim order, until their batch ends.
    may_steer: bool,
    /// A pooled worker's loop: takes steer around the batches its other
    /// loops hold (see [`beside`](Self::beside)).
    siblings: Option<Sibling<K>>,
    /// The take to make next, and once made, the one made.
    take: HeadTake<K>,
    /// A take ended the run.
    over: bool,
}

/// A take from the head by a loop of a pooled worker, which steers around
/// the batches its other loops hold (see [`siblings`](crate::claim::siblings)): the
/// take to make next, and once made, the one made.
enum HeadTake<K> {
    /// As [`Sibling::around`] says: ahead of them or past them, or the whole
    /// query when they have taken nothing.
    Around,
    /// After the last row taken past them ([`Sibling::past`]).
    Past,
    /// Ahead of them: after `from` (the low water, or the last row of the
    /// take ahead before it; from the head: none), through
    /// [`Sibling::ahead_through`], once made `through` the end it had. The
    /// run ends when it comes back short if it is the run's `last` look, made
    /// because a take past them came back short.
    Ahead {
        from: Option<K>,
        through: Option<K>,
        last: bool,
    },
}

impl<K> HeadTakes<K> {
    /// The takes of a claim whose rows come back in the claim order and
    /// tell their positions if `rows_tell_positions`.
    pub(super) fn new(plan: &Plan, rows_tell_positions: bool) -> Self {
        let passed_over = plan.clause.skip_locked && !(plan.row_locks && plan.fail_on_locked);
        HeadTakes {
            handed: HashSet::new(),
            failed_again: plan.failed_again,
            in_worker: plan.in_worker,
            may_steer: rows_tell_positions && plan.row_locks && passed_over,
            siblings: None,
            take: HeadTake::Around,
            over: false,
        }
    }

    /// Takes steer around the batches `sibling`'s other loops hold, and tell
    /// it the batches they take (see [`siblings`](crate::claim::siblings)),
    /// if they may.
    pub(super) fn beside(&mut self, sibling: Sibling<K>) {
        if self.may_steer {
            self.siblings = Some(sibling);
        }
    }

    /// Between two statements: the last batch has ended.
    pub(super) fn released(&self) {
        if let Some(sibling) = &self.siblings {
            sibling.released();
        }
    }
}

impl<K: Clone + Eq + Hash> HeadTakes<K> {
    /// The next take, unless the run is over: it ran out of rows to take,
    /// or would leave out more than [`MAX_EXCLUDED`] keys.
    pub(super) fn next(&mut self, progress: &mut Progress, excluded: usize) -> Step<K> {
        if self.over || progress.remaining == 0 || excluded > MAX_EXCLUDED {
            self.over = true;
            return Step::Done;
        }
        if progress.report.passes == 0 {
            progress.report.passes = 1;
        }
        Step::Batch(self.range(), progress.next_limit())
    }

    /// The range of the next take: the whole query, or, once the worker's
    /// loops have taken rows, the part ahead of what the others hold or the
    /// part past what they took (see [`HeadTake`]).
    fn range(&mut self) -> KeyRange<K> {
        let Some(sibling) = &self.siblings else {
            return KeyRange::whole();
        };
        if let HeadTake::Around = self.take {
            match sibling.around() {
                Some(Steer::Ahead { from, through }) => {
                    self.take = HeadTake::Ahead {
                        from,
                        through: Some(through),
                        last: false,
                    };
                }
                Some(Steer::Past(past)) => {
                    self.take = HeadTake::Past;
                    return KeyRange::after(Some(past));
                }
                None => return KeyRange::whole(),
            }
        } else if let HeadTake::Ahead { through, .. } = &mut self.take {
            *through = sibling.ahead_through();
        }
        match &self.take {
            HeadTake::Ahead { from, through, .. } => {
                let lower = from.clone().map_or(Lower::Unbounded, Lower::After);
                KeyRange::new(lower, through.clone())
            }
            HeadTake::Past | HeadTake::Around => KeyRange::after(sibling.past()),
        }
    }

    /// The rows a take of up to `limit` claimed, but those handed over
    /// before in this call (left matching by their closure), which are
    /// passed over and returned apart, to be left out of the next takes. A
    /// take that came back short ends the run (draining, one that came back
    /// empty); steered around sibling loops, only the last look ahead or a
    /// take of the whole query does (see [`HeadTake`]). So does a worker's
    /// run past [`WORKER_RUN_ROWS`], whose next run starts afresh.
    pub(super) fn taken<R>(
        &mut self,
        mut rows: Vec<R>,
        limit: i64,
        progress: &Progress,
        key_of: impl Fn(&R) -> K,
    ) -> (Vec<R>, Vec<K>) {
        let returned = rows.len() as i64;
        let last_key = rows.last().map(&key_of);
        if let (Some(sibling), Some(first), Some(last)) =
            (&self.siblings, rows.first(), rows.last())
        {
            let ahead = matches!(self.take, HeadTake::Ahead { .. });
            sibling.holds(key_of(first), key_of(last), ahead);
        }
        let mut again = Vec::new();
        rows.retain(|row| {
            let key = key_of(row);
            let new = self.handed.insert(key.clone());
            if !new {
                again.push(key);
            }
            new
        });
        let ran_dry = if progress.drain {
            returned == 0
        } else {
            returned < limit
        };
        if let (Some(sibling), HeadTake::Ahead { through, .. }) = (&self.siblings, &self.take) {
            // Run dry, the look has found all it could through its end.
            sibling.looked_ahead(through.clone().filter(|_| ran_dry));
        }
        let next = match std::mem::replace(&mut self.take, HeadTake::Around) {
            // Rows may lie on behind the siblings' batches: look on from here.
            HeadTake::Ahead { last, .. } if !ran_dry => Some(HeadTake::Ahead {
                from: last_key,
                through: None,
                last,
            }),
            HeadTake::Ahead { last: true, .. } => None,
            HeadTake::Ahead { last: false, .. } => Some(HeadTake::Past),
            HeadTake::Past | HeadTake::Around if !ran_dry => Some(HeadTake::Around),
            // Past the siblings the queue ran dry: a last look ahead of them,
            // for rows left free there (committed late, or let go), before
            // the run ends.
            HeadTake::Past => Some(HeadTake::Ahead {
                from: self.siblings.as_ref().and_then(Sibling::ahead_from),
                through: None,
                last: true,
            }),
            HeadTake::Around => None,
        };
        let run_ends = match next {
            Some(next) => {
                self.take = next;
                false
            }
            None => true,
        };
        if run_ends || (self.in_worker && self.handed.len() >= WORKER_RUN_ROWS) {
            self.over = true;
        }
        (rows, again)
    }

    /// The rows at `keys` failed: they may be handed over again if
    /// [`Plan::failed_again`].
    pub(super) fn failed(&mut self, keys: &[K]) {
        if self.failed_again {
            for key in keys {
                self.handed.remove(key);
            }
        }
    }
}
