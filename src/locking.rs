//! Row-locking choices: how strongly a row is locked, what happens when it is
//! already locked, and the clause that carries both out. Plain data: each
//! backend renders the clause in its own SQL (`backend/`), and the SQL nodes
//! append it to a query (`sql/`).

use std::sync::Arc;

use crate::trace::{self, Span};
use crate::Error;

/// How strongly a row is locked (PostgreSQL `FOR …` clauses).
///
/// The default, [`NoKeyUpdate`](LockStrength::NoKeyUpdate), is the weakest lock that
/// still excludes every other claimer and every `UPDATE` of the row, while letting
/// foreign-key inserts that reference the row go ahead. SQLite has no row locks and
/// ignores the strength: it always takes the database write lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum LockStrength {
    /// `FOR UPDATE`: also blocks foreign-key checks (`FOR KEY SHARE`) on the row.
    Update,
    /// `FOR NO KEY UPDATE`: excludes writers and other lockers, not FK checks.
    #[default]
    NoKeyUpdate,
    /// `FOR SHARE`: shared with other `FOR SHARE` readers, excludes writers.
    /// For [`with_lock`](crate::LockDsl::with_lock) only: claims need an
    /// exclusive lock.
    Share,
    /// `FOR KEY SHARE`: only excludes deletes and key updates. For
    /// [`with_lock`](crate::LockDsl::with_lock) only.
    KeyShare,
}

/// What to do when the row is already locked by another transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OnLocked {
    /// Leave it to whoever holds it (`SKIP LOCKED`).
    Skip,
    /// Return [`Error::LockNotAvailable`](Error::LockNotAvailable) at once.
    Fail,
    /// Wait for the lock (bounded only by the session's `lock_timeout`).
    Wait,
}

/// A row-locking clause: strength, wait policy, and the table it is restricted to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockClause {
    pub strength: LockStrength,
    /// `SKIP LOCKED` when true, otherwise wait. [`OnLocked::Fail`] is carried out as a
    /// skip followed by an unlocked existence check, which tells "locked" from "gone"
    /// without an error that would abort the caller's transaction.
    pub skip_locked: bool,
    /// Unqualified name of the only table whose rows are locked (`OF …`).
    pub of: Option<Arc<str>>,
}

impl LockClause {
    /// The span of a row lock taken with this clause (`with_lock`) on
    /// `table` (named only when the span is recorded), and once it ends, the
    /// rows locked and how its transaction ended.
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(crate) fn span(&self, table: impl FnOnce() -> String) -> Span {
        trace::debug_span!(
            "lock",
            table = %table(),
            strength = ?self.strength,
            on_locked = if self.skip_locked { "fail" } else { "wait" },
            rows = trace::Empty,
            outcome = trace::Empty,
        )
    }
}

/// The lock options both builders share, and the first invalid choice made on
/// a builder, reported when it runs, before any SQL.
#[derive(Debug, Clone, Default)]
pub struct LockOptions {
    strength: LockStrength,
    on_locked: Option<OnLocked>,
    invalid: Option<String>,
    /// The idle bound chosen, if one was.
    #[cfg(feature = "async")]
    idle_bound: Option<IdleBound>,
}

/// How long a transaction the async API opens may sit idle before the server
/// ends its session; `None` leaves the session's own setting.
#[cfg(feature = "async")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IdleBound(pub(crate) Option<std::time::Duration>);

#[cfg(feature = "async")]
impl Default for IdleBound {
    fn default() -> Self {
        IdleBound(Some(crate::aio::IDLE_TRANSACTION_BOUND))
    }
}

/// The longest idle bound: PostgreSQL counts it in milliseconds in an `int`.
#[cfg(feature = "async")]
const LONGEST_IDLE_BOUND: std::time::Duration = std::time::Duration::from_secs(24 * 24 * 3600);

impl LockOptions {
    /// Chooses a wait policy; a second, different one is a conflict.
    pub fn on_locked(&mut self, policy: OnLocked) {
        match self.on_locked {
            Some(chosen) if chosen != policy => self.reject(format!(
                "conflicting lock policies: {chosen:?} and {policy:?} were both chosen"
            )),
            _ => self.on_locked = Some(policy),
        }
    }

    /// Whether a lock held by another transaction is to fail the call at once
    /// (`Fail` or `Skip`) rather than be waited for (`Wait`, or `default`).
    pub fn fails_at_once(&self, default: OnLocked) -> bool {
        self.on_locked.unwrap_or(default) != OnLocked::Wait
    }

    pub fn strength(&mut self, strength: LockStrength) {
        self.strength = strength;
    }

    /// Chooses the idle bound of the transactions the async API opens.
    #[cfg(feature = "async")]
    pub(crate) fn idle_bound(&mut self, bound: Option<std::time::Duration>) {
        match bound {
            Some(bound) if bound.is_zero() || bound > LONGEST_IDLE_BOUND => self.reject(format!(
                "idle_bound is more than 0 and at most {} days, got {bound:?} (None sets no bound)",
                LONGEST_IDLE_BOUND.as_secs() / 86_400
            )),
            _ => self.idle_bound = Some(IdleBound(bound)),
        }
    }

    /// The idle bound chosen, or the default.
    #[cfg(feature = "async")]
    pub(crate) fn bound(&self) -> IdleBound {
        self.idle_bound.unwrap_or_default()
    }

    /// The idle bound chosen, if one was.
    #[cfg(feature = "async")]
    pub(crate) fn chosen_bound(&self) -> Option<IdleBound> {
        self.idle_bound
    }

    /// Records an invalid choice; the first one is reported.
    pub fn reject(&mut self, reason: String) {
        self.invalid.get_or_insert(reason);
    }

    /// The chosen policy (or `default`) and the clause that carries it out, or
    /// the first invalid choice.
    pub fn resolve(
        self,
        default: OnLocked,
        of: impl FnOnce() -> Result<Option<Arc<str>>, Error>,
    ) -> Result<(OnLocked, LockClause), Error> {
        if let Some(reason) = self.invalid {
            return Err(Error::InvalidArgument(reason));
        }
        let on_locked = self.on_locked.unwrap_or(default);
        let clause = LockClause {
            strength: self.strength,
            skip_locked: on_locked != OnLocked::Wait,
            of: of()?,
        };
        Ok((on_locked, clause))
    }
}
