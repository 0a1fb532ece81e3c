//! A claim's options, whatever its kind, and how they set up one run of
//! the claim's engine.

use std::time::Duration;

use super::engine::{Claim, Plan, Taking};
use super::{ClaimStatements, StopHandle};
use crate::backend::ClaimBackend;
use crate::locking::LockOptions;
use crate::sql::Position;
use crate::{Error, OnLocked};

/// A claim's options, whatever its kind.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct Options {
    pub(crate) lock: LockOptions,
    pub(super) max_rows: Option<u64>,
    pub(super) drain: bool,
    /// `None`: the default, which depends on the batch size.
    pub(super) page_size: Option<i64>,
    pub(crate) batch: i64,
    /// Runs inside the caller's transaction, each batch in a savepoint.
    pub(super) nested: bool,
    pub(crate) keep_going: bool,
    pub(super) stop: Option<StopHandle>,
    /// Run by a worker, over and over (its spans are quieter, and it takes
    /// from the head unless told otherwise).
    pub(crate) in_worker: bool,
    /// The name given to that worker ([`ClaimWorker::name`](super::ClaimWorker::name)), if any.
    pub(crate) worker: Option<String>,
    /// A row whose closure failed may be taken again in the same run: a
    /// worker without a backoff of its own.
    pub(crate) failed_again: bool,
    /// The rows carry a retry schedule ([`retries`](super::ClaimBuilder::retries)).
    pub(crate) retry_schedule: bool,
    /// How long a closure may run ([`ClaimBuilder::timeout`](super::ClaimBuilder::timeout)).
    pub(crate) timeout: Option<Duration>,
    pub(super) reading: Reading,
}

/// Where a claim's takes start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reading {
    /// From the head for a worker, and for a call whose `max_rows` one take
    /// can reach; in pages otherwise.
    Chosen,
    /// Every take from the head of the query ([`ClaimBuilder::from_head`](super::ClaimBuilder::from_head)).
    Head,
    /// Pages of candidates ([`ClaimBuilder::in_pages`](super::ClaimBuilder::in_pages)).
    Pages,
}

impl Options {
    /// Checks the options, the claimed table (the locking clause's `OF`) and the
    /// connection's transaction depth, and sets up one run of the claim, taking
    /// its rows with the statement `taking` describes, reading its candidates
    /// on a replica if `replica`.
    pub(crate) fn start<DB: ClaimBackend, R, S: ClaimStatements<DB, R>>(
        &self,
        taking: Taking,
        replica: bool,
        query: &S,
        transaction_depth: u32,
    ) -> Result<Claim<Position<S::Key>>, Error> {
        let (on_locked, clause) = self
            .lock
            .clone()
            .resolve(OnLocked::Skip, || query.claimed_table())?;
        let nowait = on_locked == OnLocked::Fail;
        if taking == Taking::MarkAndCommit && nowait {
            return Err(Error::InvalidArgument(
                "nowait cannot be combined with mark_and_commit or visibility_timeout: their \
                 claims commit before a locked row could roll them back"
                    .to_owned(),
            ));
        }
        let needs_pages = nowait || replica || self.page_size.is_some();
        let from_head = match self.reading {
            Reading::Head if needs_pages => {
                return Err(Error::InvalidArgument(
                    "from_head cannot be combined with nowait or candidates_from: they read \
                     candidates in pages"
                        .to_owned(),
                ))
            }
            Reading::Head => true,
            Reading::Pages => false,
            Reading::Chosen => {
                let one_take = self.max_rows.is_some_and(|rows| rows <= self.batch as u64);
                !needs_pages && (self.in_worker || one_take)
            }
        };
        if transaction_depth > 0 && !self.nested {
            return Err(Error::InvalidArgument(
                "a claim must run outside a transaction: each batch needs a transaction of \
                 its own, committed before the next (for tests that run in a transaction, \
                 see .inside_transaction())"
                    .to_owned(),
            ));
        }
        Ok(Claim::new(Plan {
            clause,
            taking,
            row_locks: DB::ROW_LOCKS,
            update_returning: DB::UPDATE_RETURNING,
            grow_contended_pages: DB::GROW_CONTENDED_PAGES,
            fail_on_locked: nowait,
            batch: self.batch,
            page_size: self.page_size,
            drain: self.drain,
            max_rows: self.max_rows,
            ordered_by_key: S::ORDERED_BY_KEY,
            keep_going: self.keep_going,
            stop: self.stop.clone(),
            in_worker: self.in_worker,
            failed_again: self.failed_again,
            from_head,
        }))
    }
}

/// Whether a claim with these options rolls back only a failing closure's
/// work, in a savepoint, rather than its whole batch: always with a hook
/// (the row must stay locked while it runs), and with `keep_going` when a
/// batch's rows go to the closure one at a time and can be told apart (not a
/// mark, which only its batch's rollback undoes).
pub(crate) fn failures_in_savepoints(
    options: &Options,
    taking: Taking,
    hook: bool,
    per_row: bool,
) -> bool {
    hook || (options.keep_going && per_row && options.batch > 1 && taking == Taking::Select)
}
