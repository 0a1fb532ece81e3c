//! Optimistic updates guarded by a version column, and the retry helper.

use std::hash::{BuildHasher, RandomState};
use std::marker::PhantomData;
use std::time::Duration;

use diesel::connection::Connection;
use diesel::dsl;
use diesel::expression::AsExpression;
use diesel::prelude::*;
use diesel::query_builder::{AsChangeset, AsQuery, IntoUpdateTarget, QueryFragment};
use diesel::query_dsl::methods::{ExecuteDsl, FilterDsl};
use diesel::query_dsl::LoadQuery;
use diesel::sql_types::SingleValue;

use crate::backend::ClaimBackend;
use crate::sql::{rendered, VersionProbe};
use crate::transaction::locking_transaction;
use crate::{Blocking, Error};

/// An integer type a version column can hold. Incrementing past its maximum is
/// [`Error::VersionOverflow`], never a wrap.
pub trait Version: Copy + Into<i64> + sealed::Sealed {
    /// The next version, or `None` at the type's maximum.
    fn next(self) -> Option<Self>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for i16 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
}

macro_rules! impl_version {
    ($($t:ty)*) => {$(
        impl Version for $t {
            fn next(self) -> Option<Self> {
                self.checked_add(1)
            }
        }
    )*};
}
impl_version!(i16 i32 i64);

/// Adds [`update_versioned`](VersionedDsl::update_versioned) to everything
/// `diesel::update` accepts: `table.find(id)`, `table.filter(…)`, `&model`.
pub trait VersionedDsl: IntoUpdateTarget + Clone {
    /// Prepares `UPDATE … SET <changes>, <version> = expected + 1 WHERE <self> AND
    /// <version> = expected`; run it with [`VersionedUpdate::execute`] or
    /// [`VersionedUpdate::get_result`].
    ///
    /// Zero rows updated is never `Ok`: it is [`Error::VersionConflict`] when the
    /// row is there at another version, [`Error::NotFound`] when it is gone. The
    /// target should identify one row.
    fn update_versioned<Col, V, Changes>(
        self,
        version_column: Col,
        expected: V,
        changes: Changes,
    ) -> VersionedUpdate<Self, Col, V, Changes>
    where
        Col: Column<Table = Self::Table>,
        V: Version,
    {
        VersionedUpdate::new(self, version_column, expected, changes)
    }
}

impl<T: IntoUpdateTarget + Clone> VersionedDsl for T {}

/// A version-checked update, made by [`VersionedDsl::update_versioned`].
#[derive(Debug, Clone)]
#[must_use = "a versioned update does nothing until it is executed"]
pub struct VersionedUpdate<Target, Col, V, Changes, M = Blocking> {
    target: Target,
    version_column: Col,
    expected: V,
    changes: Changes,
    mode: PhantomData<M>,
}

impl<Target, Col, V, Changes, M> VersionedUpdate<Target, Col, V, Changes, M> {
    pub(crate) fn new(target: Target, version_column: Col, expected: V, changes: Changes) -> Self {
        VersionedUpdate {
            target,
            version_column,
            expected,
            changes,
            mode: PhantomData,
        }
    }
}

type Bump<Col, V> = dsl::Eq<Col, V>;
pub(crate) type Statement<Target, Col, V, Changes> =
    dsl::Filter<dsl::Update<Target, (Changes, Bump<Col, V>)>, dsl::Eq<Col, V>>;
pub(crate) type PrimaryKey<Target> =
    <<Target as diesel::associations::HasTable>::Table as Table>::PrimaryKey;
/// Reads the target row's version.
pub(crate) type Probe<Target, Col> = VersionProbe<
    <<Target as diesel::associations::HasTable>::Table as diesel::QuerySource>::FromClause,
    <Target as IntoUpdateTarget>::WhereClause,
    Col,
>;

impl<Target, Col, V, Changes> VersionedUpdate<Target, Col, V, Changes>
where
    Target: IntoUpdateTarget + Clone,
    Target::Table: Table,
    Col: Column<Table = Target::Table> + ExpressionMethods + Copy,
    Col::SqlType: SingleValue,
    V: Version + AsExpression<Col::SqlType>,
    Changes: AsChangeset<Target = Target::Table> + Clone,
    (Changes, Bump<Col, V>): AsChangeset<Target = Target::Table>,
    dsl::Update<Target, (Changes, Bump<Col, V>)>: AsQuery,
    dsl::Update<Target, (Changes, Bump<Col, V>)>: FilterDsl<dsl::Eq<Col, V>>,
{
    /// Runs the update and returns the new version.
    ///
    /// A target that is not one row by its primary key (`table.find(key)`,
    /// `&model`, a filter with `key.eq(…)`) is updated in a transaction (a
    /// savepoint inside yours) that is rolled back, with
    /// [`Error::UnexpectedOutcome`], if it changed more than one row.
    pub fn execute<'q, C>(self, conn: &mut C) -> Result<V, Error>
    where
        C: Connection,
        C::Backend: ClaimBackend,
        Changes::Changeset: QueryFragment<C::Backend>,
        Target::WhereClause: QueryFragment<C::Backend>,
        PrimaryKey<Target>: QueryFragment<C::Backend>,
        Statement<Target, Col, V, Changes>: ExecuteDsl<C>,
        Probe<Target, Col>: LoadQuery<'q, C, V>,
    {
        let next = self.next_version()?;
        let statement = self.statement::<C::Backend>(next)?;
        let rows = if self.targets_one_row::<C::Backend>()? {
            ExecuteDsl::execute(statement, conn)?
        } else {
            locking_transaction(conn, |conn| {
                let rows = ExecuteDsl::execute(statement, conn)?;
                changed_at_most_one(rows)?;
                Ok::<_, Error>(rows)
            })?
        };
        match rows {
            0 => Err(self.no_match(self.probe().get_result(conn).optional())),
            _ => Ok(next),
        }
    }

    /// Runs the update and returns the updated row (`RETURNING`), with the
    /// same guard as [`execute`](Self::execute).
    pub fn get_result<'q, R, C>(self, conn: &mut C) -> Result<R, Error>
    where
        C: Connection,
        C::Backend: ClaimBackend,
        Changes::Changeset: QueryFragment<C::Backend>,
        Target::WhereClause: QueryFragment<C::Backend>,
        PrimaryKey<Target>: QueryFragment<C::Backend>,
        Statement<Target, Col, V, Changes>: LoadQuery<'q, C, R>,
        Probe<Target, Col>: LoadQuery<'q, C, V>,
    {
        let statement = self.statement::<C::Backend>(self.next_version()?)?;
        let row = if self.targets_one_row::<C::Backend>()? {
            statement.get_result(conn).optional()?
        } else {
            locking_transaction(conn, |conn| {
                let rows: Vec<R> = statement.load(conn)?;
                changed_at_most_one(rows.len())?;
                Ok::<_, Error>(rows.into_iter().next())
            })?
        };
        row.ok_or_else(|| self.no_match(self.probe().get_result(conn).optional()))
    }
}

/// `Err` if a versioned update changed more than one row: its transaction
/// then rolls the changes back.
pub(crate) fn changed_at_most_one(rows: usize) -> Result<(), Error> {
    if rows > 1 {
        return Err(Error::UnexpectedOutcome(format!(
            "the target of update_versioned matched {rows} rows: it must be one row, such as \
             `table.find(key)` or `&model`; nothing was changed"
        )));
    }
    Ok(())
}

impl<Target, Col, V, Changes, M> VersionedUpdate<Target, Col, V, Changes, M>
where
    Target: IntoUpdateTarget + Clone,
    Target::Table: Table,
    Col: Column<Table = Target::Table> + ExpressionMethods + Copy,
    Col::SqlType: SingleValue,
    V: Version + AsExpression<Col::SqlType>,
    Changes: AsChangeset<Target = Target::Table> + Clone,
    (Changes, Bump<Col, V>): AsChangeset<Target = Target::Table>,
    dsl::Update<Target, (Changes, Bump<Col, V>)>: AsQuery,
    dsl::Update<Target, (Changes, Bump<Col, V>)>: FilterDsl<dsl::Eq<Col, V>>,
{
    pub(crate) fn next_version(&self) -> Result<V, Error> {
        self.expected
            .next()
            .ok_or(Error::VersionOverflow(self.expected.into()))
    }

    pub(crate) fn statement<DB>(&self, next: V) -> Result<Statement<Target, Col, V, Changes>, Error>
    where
        DB: ClaimBackend,
        Changes::Changeset: QueryFragment<DB>,
    {
        let changeset = self.changes.clone().as_changeset();
        // An empty changeset would only bump the version: a no-op that other
        // writers would see as a conflict.
        if changeset.is_noop(&DB::default())? {
            return Err(Error::InvalidArgument(
                "the changeset is empty: a versioned update must change something".to_owned(),
            ));
        }
        // The version is the crate's to set; the databases disagree on what
        // a second assignment means (an error, or the last one wins).
        if rendered::assigns::<DB>(&rendered::render(&changeset)?, Col::NAME)? {
            return Err(Error::InvalidArgument(format!(
                "the changeset sets the version column `{}` itself: update_versioned sets it \
                 to the expected version + 1",
                Col::NAME
            )));
        }
        let column = self.version_column;
        Ok(diesel::update(self.target.clone())
            .set((self.changes.clone(), column.eq(next)))
            .filter(column.eq(self.expected)))
    }

    /// Whether the target is one row by its primary key, so that the update
    /// needs no guard against changing several.
    pub(crate) fn targets_one_row<DB>(&self) -> Result<bool, Error>
    where
        DB: ClaimBackend,
        Target::WhereClause: QueryFragment<DB>,
        PrimaryKey<Target>: QueryFragment<DB>,
    {
        let target = self.target.clone().into_update_target();
        let key = rendered::render::<DB>(&target.table.primary_key())?;
        let where_clause = rendered::render::<DB>(&target.where_clause)?;
        Ok(rendered::one_row_by_key(&where_clause, &key))
    }

    /// The read of the row's version that tells, when the update matched no
    /// row, a conflict from a missing row.
    pub(crate) fn probe(&self) -> Probe<Target, Col> {
        let target = self.target.clone().into_update_target();
        VersionProbe {
            from: target.table.from_clause(),
            where_clause: target.where_clause,
            column: self.version_column,
        }
    }

    /// What the [`probe`](Self::probe) found, as the update's error.
    pub(crate) fn no_match(&self, probed: QueryResult<Option<V>>) -> Error {
        match probed {
            Ok(Some(actual)) => Error::VersionConflict {
                expected: self.expected.into(),
                actual: Some(actual.into()),
            },
            Ok(None) => Error::NotFound,
            Err(error) => Error::from(error),
        }
    }
}

/// How often and how patiently [`retry`] tries again.
///
/// Attempt `n` (from 1) that fails with a transient error sleeps a random time
/// up to `min(max_backoff, initial_backoff × 2ⁿ⁻¹)` ("full jitter") before the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (at least 1).
    pub max_attempts: u32,
    /// Upper bound of the first backoff.
    pub initial_backoff: Duration,
    /// Upper bound of every backoff.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    /// 16 attempts, backoff from up to 1 ms growing to at most 250 ms.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 16,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(250),
        }
    }
}

impl RetryPolicy {
    /// A policy of `max_attempts` attempts with the default backoff. 0 is
    /// refused when the policy is used.
    pub fn attempts(max_attempts: u32) -> Self {
        RetryPolicy {
            max_attempts,
            ..RetryPolicy::default()
        }
    }

    fn backoff(&self, attempt: u32, jitter: &RandomState) -> Duration {
        let ceiling = self
            .initial_backoff
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20))
            .min(self.max_backoff);
        let random = jitter.hash_one(attempt);
        ceiling.mul_f64(random as f64 / u64::MAX as f64)
    }
}

/// Errors [`retry`] can tell transient failures from final ones in.
///
/// Implemented for the crate's [`Error`], Diesel's, `Box<dyn Error + Send +
/// Sync>` and `Box<dyn Error>`, and with the `anyhow` feature for
/// `anyhow::Error`: the boxed ones are transient when [`is_transient`] finds a
/// transient cause in their chain of sources. An application's own error type
/// implements it in a few lines:
///
/// ```
/// #[derive(Debug, thiserror::Error)]
/// enum AppError {
///     #[error(transparent)]
///     Claim(#[from] diesel_claim::Error),
///     #[error("insufficient funds")]
///     Insufficient,
/// }
///
/// impl diesel_claim::Transient for AppError {
///     fn is_transient(&self) -> bool {
///         matches!(self, AppError::Claim(error) if error.is_transient())
///     }
/// }
/// ```
///
/// (Where the crate's error is a [`source`](std::error::Error::source) of
/// yours, `diesel_claim::is_transient(self)` finds it; `#[error(transparent)]`
/// passes the source on, not the wrapped error itself.)
pub trait Transient {
    /// Whether running the operation again may succeed.
    fn is_transient(&self) -> bool;
}

impl Transient for Error {
    fn is_transient(&self) -> bool {
        Error::is_transient(self)
    }
}

impl Transient for diesel::result::Error {
    fn is_transient(&self) -> bool {
        crate::is_deadlock(self) || crate::is_serialization_failure(self)
    }
}

impl Transient for Box<dyn std::error::Error + Send + Sync> {
    fn is_transient(&self) -> bool {
        is_transient(&**self)
    }
}

impl Transient for Box<dyn std::error::Error> {
    fn is_transient(&self) -> bool {
        is_transient(&**self)
    }
}

#[cfg(feature = "anyhow")]
#[cfg_attr(docsrs, doc(cfg(feature = "anyhow")))]
impl Transient for anyhow::Error {
    fn is_transient(&self) -> bool {
        is_transient(self.as_ref())
    }
}

/// Whether `error`, or any error in its chain of [`source`]s, is a transient
/// failure: a transient [`Error`] (version conflict, deadlock, serialization
/// failure) or a Diesel error that is a deadlock or a serialization failure.
///
/// [`source`]: std::error::Error::source
pub fn is_transient(error: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(error), |error| error.source()).any(|cause| {
        if let Some(error) = cause.downcast_ref::<Error>() {
            return error.is_transient();
        }
        cause
            .downcast_ref::<diesel::result::Error>()
            .is_some_and(Transient::is_transient)
    })
}

/// Runs `operation` until it succeeds, fails with an error that is not
/// [transient](Transient), or has been tried `policy.max_attempts` times; then
/// returns its last result.
///
/// Each attempt must re-read what it depends on: on a version conflict the row
/// changed since it was read. Transient errors are version conflicts, deadlocks
/// and serialization failures. Run it outside a transaction (or make `operation`
/// a transaction of its own): PostgreSQL aborts the surrounding transaction on a
/// deadlock, and every later attempt inside it would fail.
///
/// A policy of 0 attempts is [`Error::InvalidArgument`], without an attempt.
pub fn retry<C, T, E, F>(conn: &mut C, policy: RetryPolicy, mut operation: F) -> Result<T, E>
where
    F: FnMut(&mut C) -> Result<T, E>,
    E: Transient + From<Error>,
{
    let mut attempts = Attempts::new(policy)?;
    loop {
        match operation(conn) {
            Err(error) => match attempts.pause_after(&error) {
                Some(pause) => std::thread::sleep(pause),
                None => return Err(error),
            },
            done => return done,
        }
    }
}

/// The attempts of one [`retry`]: whether to try again after an error, and
/// after what pause.
pub(crate) struct Attempts {
    policy: RetryPolicy,
    jitter: RandomState,
    made: u32,
}

impl Attempts {
    /// The attempts of `policy`; [`Error::InvalidArgument`] if it allows none.
    pub(crate) fn new(policy: RetryPolicy) -> Result<Self, Error> {
        if policy.max_attempts == 0 {
            return Err(Error::InvalidArgument(
                "a retry policy needs at least one attempt: max_attempts is 0".to_owned(),
            ));
        }
        Ok(Attempts {
            policy,
            jitter: RandomState::new(),
            made: 1,
        })
    }

    /// The pause before the next attempt after `error`; `None` gives up.
    pub(crate) fn pause_after<E: Transient>(&mut self, error: &E) -> Option<Duration> {
        if !error.is_transient() || self.made >= self.policy.max_attempts {
            return None;
        }
        let pause = self.policy.backoff(self.made, &self.jitter);
        self.made += 1;
        Some(pause)
    }
}
