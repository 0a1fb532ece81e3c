//! Takes from the head of the query: a worker's, and those of a pooled
//! worker's loops, which steer around each other's batches.

use std::hash::Hash;

use super::{Claim, State, WORKER_RUN_ROWS};
use crate::claim::siblings::{Sibling, Steer};
use crate::sql::{KeyRange, Lower};

/// A take from the head by a loop of a pooled worker, which steers around
/// the batches its other loops hold (see [`siblings`](crate::claim::siblings)): the
/// take to make next, and once made, the one made.
pub(super) enum HeadTake<K> {
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

impl<K: Clone + Eq + Hash> Claim<K> {
    /// The range of the next take from the head: the whole query, or, once
    /// the worker's loops have taken rows, the part ahead of what the others
    /// hold or the part past what they took (see [`HeadTake`]).
    pub(super) fn head_range(&mut self) -> KeyRange<K> {
        let Some(sibling) = &self.siblings else {
            return KeyRange::whole();
        };
        if let HeadTake::Around = self.head {
            match sibling.around() {
                Some(Steer::Ahead { from, through }) => {
                    self.head = HeadTake::Ahead {
                        from,
                        through: Some(through),
                        last: false,
                    };
                }
                Some(Steer::Past(past)) => {
                    self.head = HeadTake::Past;
                    return KeyRange::after(Some(past));
                }
                None => return KeyRange::whole(),
            }
        } else if let HeadTake::Ahead { through, .. } = &mut self.head {
            *through = sibling.ahead_through();
        }
        match &self.head {
            HeadTake::Ahead { from, through, .. } => {
                let lower = from.clone().map_or(Lower::Unbounded, Lower::After);
                KeyRange::new(lower, through.clone())
            }
            HeadTake::Past | HeadTake::Around => KeyRange::after(sibling.past()),
        }
    }

    /// Takes from the head steer around the batches `sibling`'s other loops
    /// hold, and tell it the batches they take (see
    /// [`siblings`](crate::claim::siblings)): when the claim order is the key's, a
    /// row locked by others is passed over, and rows stay locked, coming back
    /// in the claim order, until their batch ends.
    pub(crate) fn beside(&mut self, sibling: Sibling<K>) {
        let passed_over = self.clause.skip_locked && !self.fail_on_locked;
        if self.from_head && self.rows_tell_positions && self.row_locks && passed_over {
            self.siblings = Some(sibling);
        }
    }

    /// [`taken`](Self::taken), from the head: rows handed over before in this
    /// call (left matching by their closure) are passed over, and left out of
    /// the next takes. A take that came back short ends the run (draining,
    /// one that came back empty); steered around sibling loops, only the last
    /// look ahead or a take of the whole query does (see [`HeadTake`]). So
    /// does a worker's run past [`WORKER_RUN_ROWS`], whose next run starts
    /// afresh.
    pub(super) fn taken_from_head<R>(
        &mut self,
        mut rows: Vec<R>,
        limit: i64,
        key_of: impl Fn(&R) -> K,
    ) -> Vec<R> {
        let returned = rows.len() as i64;
        let last_key = rows.last().map(&key_of);
        if let (Some(sibling), Some(first), Some(last)) =
            (&self.siblings, rows.first(), rows.last())
        {
            let ahead = matches!(self.head, HeadTake::Ahead { .. });
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
        self.exclude(again);
        let ran_dry = if self.drain {
            returned == 0
        } else {
            returned < limit
        };
        if let (Some(sibling), HeadTake::Ahead { through, .. }) = (&self.siblings, &self.head) {
            // Run dry, the look has found all it could through its end.
            sibling.looked_ahead(through.clone().filter(|_| ran_dry));
        }
        let next = match std::mem::replace(&mut self.head, HeadTake::Around) {
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
                self.head = next;
                false
            }
            None => true,
        };
        if run_ends || (self.in_worker && self.handed.len() >= WORKER_RUN_ROWS) {
            self.state = State::Done;
        }
        rows
    }
}
