//! Claiming: process each row of a query at most once across workers.

use std::sync::Arc;

use diesel::associations::HasTable;
use diesel::connection::Connection;
use diesel::dsl;
use diesel::expression::AsExpression;
use diesel::prelude::*;
use diesel::query_builder::{Query, QueryFragment};
use diesel::query_dsl::methods::{FilterDsl, LimitDsl, OrderDsl, SelectDsl};
use diesel::query_dsl::LoadQuery;
use diesel::sql_types::SingleValue;

use crate::backend::{transaction_depth, ClaimBackend};
use crate::query::{lock_target, After, LockClause, LockOptions, Locked};
use crate::transaction::locking_transaction;
use crate::{Error, LockStrength, OnLocked};

/// Rows read per page of the unlocked candidate scan.
const DEFAULT_PAGE_SIZE: i64 = 1000;

/// What one call of [`claim_each`](ClaimDsl::claim_each) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimReport {
    /// Rows the closure processed and whose transaction committed.
    pub processed: u64,
    /// Candidates this call did not process: locked by someone else, or no longer
    /// matching the query when it came to lock them.
    pub skipped: u64,
    /// Passes over the candidates (more than one only when draining).
    pub passes: u32,
}

/// Adds [`claim_each`](ClaimDsl::claim_each) to Diesel queries.
///
/// See the [crate documentation](crate#claiming-claim_each) for the algorithm and
/// its caveats.
pub trait ClaimDsl: Sized {
    /// Processes each row of this query at most once across every worker that
    /// claims from it, with the default options: skip rows locked by others,
    /// `FOR NO KEY UPDATE OF <table>`, no cap, one pass.
    ///
    /// Each row is re-read under a row lock in a transaction of its own, with the
    /// query's own filter and the row's primary key; if it still matches, `f` runs
    /// in that transaction, which commits when `f` returns `Ok`. An `Err` from `f`
    /// rolls that row back and ends the call with the error; rows committed before
    /// stay committed. Must be called outside a transaction.
    ///
    /// The rows' type identifies the claimed table (`#[derive(Identifiable)]`);
    /// with a join, select that table's struct (`.select(Order::as_select())`).
    fn claim_each<'q, C, R, E, F>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Self: ClaimQuery<'q, C, R>,
        C: Connection,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        self.build_claim().each(conn, f)
    }

    /// Starts a claim with options; run it with [`ClaimBuilder::each`].
    fn build_claim(self) -> ClaimBuilder<Self> {
        ClaimBuilder::new(self)
    }
}

impl<Q: Query> ClaimDsl for Q {}

/// A claim and its options, made by [`ClaimDsl::build_claim`].
///
/// ```
/// # include!("doctest_setup.rs");
/// use diesel_claim::prelude::*;
///
/// # fn main() -> Result<(), diesel_claim::Error> {
/// # let mut conn = establish_connection();
/// let pending = orders::table.filter(orders::shipped.eq(true)).filter(orders::email_sent.eq(false));
/// let report = pending
///     .build_claim()
///     .nowait() // a row locked by someone else is an error, not a skip
///     .max_rows(100)
///     .drain()
///     .each(&mut conn, |conn, order: Order| {
///         diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
///         Ok::<_, diesel_claim::Error>(())
///     })?;
/// assert_eq!(report.processed, 2);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a claim does nothing until `.each(conn, f)` runs it"]
pub struct ClaimBuilder<Q> {
    query: Q,
    lock: LockOptions,
    max_rows: Option<u64>,
    drain: bool,
    page_size: i64,
}

impl<Q> ClaimBuilder<Q> {
    fn new(query: Q) -> Self {
        ClaimBuilder {
            query,
            lock: LockOptions::default(),
            max_rows: None,
            drain: false,
            page_size: DEFAULT_PAGE_SIZE,
        }
    }

    /// Sets what to do with a row another transaction has locked. Choosing two
    /// different policies for one claim is an error reported by [`each`](Self::each).
    pub fn on_locked(mut self, policy: OnLocked) -> Self {
        self.lock.on_locked(policy);
        self
    }

    /// Leaves locked rows to whoever holds them (the default).
    pub fn skip_locked(self) -> Self {
        self.on_locked(OnLocked::Skip)
    }

    /// Fails with [`Error::LockNotAvailable`] on the first candidate that is locked
    /// by another transaction.
    pub fn nowait(self) -> Self {
        self.on_locked(OnLocked::Fail)
    }

    /// Waits for locked rows; afterwards the row is re-checked against the filter.
    pub fn wait(self) -> Self {
        self.on_locked(OnLocked::Wait)
    }

    /// Sets the lock strength (PostgreSQL): [`NoKeyUpdate`](LockStrength::NoKeyUpdate),
    /// the default, or [`Update`](LockStrength::Update), which also holds off
    /// foreign-key inserts referencing the row. The shared strengths do not
    /// exclude other claimers and are an error.
    pub fn strength(mut self, strength: LockStrength) -> Self {
        if matches!(strength, LockStrength::Share | LockStrength::KeyShare) {
            self.lock.reject(format!(
                "a claim needs an exclusive lock: {strength:?} would let other claimers process \
                 the same row"
            ));
        }
        self.lock.strength(strength);
        self
    }

    /// Stops after processing `max_rows` rows (at least 1).
    pub fn max_rows(mut self, max_rows: u64) -> Self {
        if max_rows == 0 {
            self.lock.reject("max_rows must be at least 1".to_owned());
        }
        self.max_rows = Some(max_rows);
        self
    }

    /// Repeats until a pass claims nothing new: rows skipped because they were
    /// locked are tried again, and rows added after the scan are picked up.
    /// (A skipped row costs one more read, to tell "locked" from "done by
    /// someone else"; only locked ones are kept, so memory stays bounded.)
    ///
    /// A row is never processed twice in one call, even when the closure leaves it
    /// matching the filter: later passes revisit only the rows skipped before and
    /// the rows beyond the highest key already scanned.
    pub fn drain(mut self) -> Self {
        self.drain = true;
        self
    }

    /// Sets how many candidate keys one read of the unlocked scan fetches (default
    /// 1000). Memory use is bounded by this, not by the number of pending rows.
    pub fn page_size(mut self, page_size: u32) -> Self {
        if page_size == 0 {
            self.lock.reject("page_size must be at least 1".to_owned());
        }
        self.page_size = i64::from(page_size);
        self
    }

    /// Runs the claim: see [`ClaimDsl::claim_each`].
    pub fn each<'q, C, R, E, F>(self, conn: &mut C, mut f: F) -> Result<ClaimReport, E>
    where
        Q: ClaimQuery<'q, C, R>,
        C: Connection,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        let (on_locked, clause) = self
            .lock
            .resolve(OnLocked::Skip, || self.query.claimed_table())?;
        if transaction_depth(conn).map_err(Error::from)? > 0 {
            return Err(Error::InvalidArgument(
                "claim_each must run outside a transaction: each row needs a transaction of \
                 its own, committed before the next"
                    .to_owned(),
            )
            .into());
        }
        let mut claim = Claim {
            query: &self.query,
            clause,
            check_locked: on_locked == OnLocked::Fail,
            remaining: self.max_rows.unwrap_or(u64::MAX),
            report: ClaimReport::default(),
            skipped_keys: self.drain.then(Vec::new),
            skipped_in_pass: 0,
        };

        let mut cursor = None;
        loop {
            claim.report.passes += 1;
            claim.skipped_in_pass = 0;
            let processed_before = claim.report.processed;
            // Draining: first the rows skipped last pass, then rows beyond the
            // highest key seen. Rows processed before are never visited again.
            let retry = claim.skipped_keys.as_mut().map(std::mem::take);
            for key in retry.iter().flatten() {
                claim.row(conn, key, &mut f)?;
            }
            while claim.remaining > 0 {
                let mut keys = self
                    .query
                    .candidates(conn, cursor.clone(), self.page_size)
                    .map_err(Error::from)?;
                let full_page = keys.len() as i64 == self.page_size;
                // A join to many rows repeats a key; keys come sorted.
                keys.dedup();
                for key in keys {
                    claim.row(conn, &key, &mut f)?;
                    cursor = Some(key);
                }
                if !full_page {
                    break;
                }
            }
            let claimed_nothing_new = claim.report.processed == processed_before;
            if !self.drain || claimed_nothing_new || claim.remaining == 0 {
                claim.report.skipped = claim.skipped_in_pass;
                return Ok(claim.report);
            }
        }
    }
}

/// What became of one candidate.
enum Claimed {
    Processed,
    /// Still matching, but locked by someone else.
    Locked,
    /// Locked by someone else or no longer matching, not told apart.
    Skipped,
}

/// The state of one `each` call.
struct Claim<'a, Q, K> {
    query: &'a Q,
    clause: LockClause,
    check_locked: bool,
    remaining: u64,
    report: ClaimReport,
    /// Keys found locked in this pass, kept only when draining, to try again.
    skipped_keys: Option<Vec<K>>,
    skipped_in_pass: u64,
}

impl<Q, K: Clone> Claim<'_, Q, K> {
    /// Claims one candidate in a transaction of its own.
    fn row<'q, C, R, E, F>(&mut self, conn: &mut C, key: &K, f: &mut F) -> Result<(), E>
    where
        Q: ClaimQuery<'q, C, R, Key = K>,
        C: Connection,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, R) -> Result<(), E>,
        E: From<Error>,
    {
        if self.remaining == 0 {
            return Ok(());
        }
        let claimed = locking_transaction(conn, |conn| {
            match self
                .query
                .row(conn, key, Some(&self.clause))
                .map_err(Error::from)?
            {
                Some(row) => f(conn, row).map(|()| Claimed::Processed),
                // Skip-locked found nothing: the row is locked by someone, or no
                // longer matches. Where it matters (failing on locked rows, or
                // keeping them to try again) an unlocked read tells which, without
                // an error that would abort the transaction.
                None if self.check_locked || self.skipped_keys.is_some() => {
                    match self.query.row(conn, key, None) {
                        Ok(Some(_)) if self.check_locked => Err(Error::LockNotAvailable.into()),
                        Ok(Some(_)) => Ok(Claimed::Locked),
                        Ok(None) => Ok(Claimed::Skipped),
                        Err(error) => Err(Error::from(error).into()),
                    }
                }
                None => Ok(Claimed::Skipped),
            }
        })?;
        match claimed {
            Claimed::Processed => {
                self.report.processed += 1;
                self.remaining -= 1;
            }
            Claimed::Locked => {
                self.skipped_in_pass += 1;
                if let Some(keys) = &mut self.skipped_keys {
                    keys.push(key.clone());
                }
            }
            Claimed::Skipped => self.skipped_in_pass += 1,
        }
        Ok(())
    }
}

/// A query [`claim_each`](ClaimDsl::claim_each) can claim rows of type `R` from, on a
/// connection `C`.
///
/// Implemented for every Diesel select query (tables, `filter`ed queries, joins)
/// whose rows identify the claimed table by `#[derive(Identifiable)]` with a
/// single-column primary key. The methods are the crate's own; callers only
/// name the trait in bounds.
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}`",
    note = "the row type must `#[derive(Identifiable)]` (with a single-column primary key) and \
            be loadable from the query; with a join, `.select(YourRow::as_select())`"
)]
pub trait ClaimQuery<'q, C, R> {
    /// The claimed table's primary-key value.
    type Key: Clone + PartialEq;

    /// The locking clause's `OF` table, where the backend has row locks.
    #[doc(hidden)]
    fn claimed_table(&self) -> Result<Option<Arc<str>>, Error>;

    /// Up to `limit` keys after `after`, in key order, read without locks.
    #[doc(hidden)]
    fn candidates(
        &self,
        conn: &mut C,
        after: Option<Self::Key>,
        limit: i64,
    ) -> QueryResult<Vec<Self::Key>>;

    /// The row with this key if it still matches the query, locked by `lock`.
    #[doc(hidden)]
    fn row(
        &self,
        conn: &mut C,
        key: &Self::Key,
        lock: Option<&LockClause>,
    ) -> QueryResult<Option<R>>;
}

type PrimaryKey<R> = <<R as HasTable>::Table as Table>::PrimaryKey;
type CandidatesQuery<Q, Pk, K> =
    dsl::Limit<dsl::Order<dsl::Select<dsl::Filter<Q, After<Pk, K>>, Pk>, Pk>>;
type RowQuery<Q, Pk, K> = dsl::Filter<Q, dsl::Eq<Pk, K>>;

impl<'q, Q, C, R, K, Pk> ClaimQuery<'q, C, R> for Q
where
    Q: Clone + FilterDsl<After<Pk, K>> + FilterDsl<dsl::Eq<Pk, K>>,
    C: Connection,
    C::Backend: ClaimBackend,
    R: HasTable,
    R::Table: Table<PrimaryKey = Pk>,
    <R::Table as diesel::QuerySource>::FromClause: QueryFragment<C::Backend>,
    for<'a> &'a R: Identifiable<Id = &'a K>,
    K: Clone + PartialEq + AsExpression<Pk::SqlType>,
    Pk: Column + ExpressionMethods + Copy,
    Pk::SqlType: SingleValue,
    dsl::Filter<Q, After<Pk, K>>: SelectDsl<Pk>,
    dsl::Select<dsl::Filter<Q, After<Pk, K>>, Pk>: OrderDsl<Pk>,
    dsl::Order<dsl::Select<dsl::Filter<Q, After<Pk, K>>, Pk>, Pk>: LimitDsl,
    CandidatesQuery<Q, Pk, K>: LoadQuery<'q, C, K>,
    Locked<RowQuery<Q, Pk, K>>: LoadQuery<'q, C, R>,
{
    type Key = K;

    fn claimed_table(&self) -> Result<Option<Arc<str>>, Error> {
        lock_target::<_, C::Backend>(&R::table())
    }

    fn candidates(&self, conn: &mut C, after: Option<K>, limit: i64) -> QueryResult<Vec<K>> {
        let key = primary_key::<R>();
        let after = After {
            column: key,
            cursor: after,
        };
        FilterDsl::filter(self.clone(), after)
            .select(key)
            .order(key)
            .limit(limit)
            .load(conn)
    }

    fn row(&self, conn: &mut C, key: &K, lock: Option<&LockClause>) -> QueryResult<Option<R>> {
        let query = FilterDsl::filter(self.clone(), primary_key::<R>().eq(key.clone()));
        let locked = Locked {
            query,
            clause: lock.cloned(),
        };
        let mut rows = locked.load::<R>(conn)?;
        Ok(rows.pop())
    }
}

fn primary_key<R: HasTable>() -> PrimaryKey<R> {
    R::table().primary_key()
}
