//! Optimistic updates and deletes guarded by a version column.

use std::marker::PhantomData;

use diesel::connection::LoadConnection;
use diesel::dsl;
use diesel::expression::AsExpression;
use diesel::prelude::*;
use diesel::query_builder::{AsChangeset, AsQuery, IntoUpdateTarget, QueryFragment};
use diesel::query_dsl::methods::{ExecuteDsl, FilterDsl};
use diesel::query_dsl::LoadQuery;
use diesel::sql_types::SingleValue;

use crate::backend::ClaimBackend;
use crate::connection::BlockingConnection;
use crate::sql::{rendered, VersionProbe};
use crate::trace;
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

/// Adds [`update_versioned`](VersionedDsl::update_versioned) and
/// [`delete_versioned`](VersionedDsl::delete_versioned) to everything
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

    /// Prepares `DELETE FROM … WHERE <self> AND <version> = expected`; run it
    /// with [`VersionedDelete::execute`].
    ///
    /// The same outcomes as [`update_versioned`](Self::update_versioned): a
    /// row changed since it was read is [`Error::VersionConflict`] and stays,
    /// a row already gone is [`Error::NotFound`]; never `Ok` for nothing
    /// deleted.
    fn delete_versioned<Col, V>(
        self,
        version_column: Col,
        expected: V,
    ) -> VersionedDelete<Self, Col, V>
    where
        Col: Column<Table = Self::Table>,
        V: Version,
    {
        VersionedDelete::new(self, version_column, expected)
    }
}

impl<T: IntoUpdateTarget + Clone> VersionedDsl for T {}

/// A version-checked update, made by [`VersionedDsl::update_versioned`].
#[derive(Debug, Clone)]
#[must_use = "a versioned update does nothing until it is executed"]
pub struct VersionedUpdate<Target, Col, V, Changes, M = Blocking> {
    pub(crate) check: VersionCheck<Target, Col, V>,
    changes: Changes,
    mode: PhantomData<M>,
}

impl<Target, Col, V, Changes, M> VersionedUpdate<Target, Col, V, Changes, M> {
    pub(crate) fn new(target: Target, version_column: Col, expected: V, changes: Changes) -> Self {
        VersionedUpdate {
            check: VersionCheck {
                target,
                version_column,
                expected,
            },
            changes,
            mode: PhantomData,
        }
    }
}

/// A version-checked delete, made by [`VersionedDsl::delete_versioned`].
#[derive(Debug, Clone)]
#[must_use = "a versioned delete does nothing until it is executed"]
pub struct VersionedDelete<Target, Col, V, M = Blocking> {
    pub(crate) check: VersionCheck<Target, Col, V>,
    mode: PhantomData<M>,
}

impl<Target, Col, V, M> VersionedDelete<Target, Col, V, M> {
    pub(crate) fn new(target: Target, version_column: Col, expected: V) -> Self {
        VersionedDelete {
            check: VersionCheck {
                target,
                version_column,
                expected,
            },
            mode: PhantomData,
        }
    }
}

/// What a versioned update or delete checks: the target row, and the version
/// it is expected at.
#[derive(Debug, Clone)]
pub(crate) struct VersionCheck<Target, Col, V> {
    target: Target,
    version_column: Col,
    expected: V,
}

type Bump<Col, V> = dsl::Eq<Col, V>;
pub(crate) type Statement<Target, Col, V, Changes> =
    dsl::Filter<dsl::Update<Target, (Changes, Bump<Col, V>)>, dsl::Eq<Col, V>>;
pub(crate) type DeleteStatement<Target, Col, V> = dsl::Filter<dsl::delete<Target>, dsl::Eq<Col, V>>;
pub(crate) type FromClauseOf<Target> =
    <<Target as diesel::associations::HasTable>::Table as diesel::QuerySource>::FromClause;
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
    pub fn execute<'q, C, Inferred>(self, conn: &mut C) -> Result<V, Error>
    where
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        Changes::Changeset: QueryFragment<C::Backend>,
        Target::WhereClause: QueryFragment<C::Backend>,
        PrimaryKey<Target>: QueryFragment<C::Backend>,
        FromClauseOf<Target>: QueryFragment<C::Backend>,
        Statement<Target, Col, V, Changes>: ExecuteDsl<C>,
        Probe<Target, Col>: LoadQuery<'q, C, V>,
    {
        let next = self.next_version()?;
        let statement = self.statement::<C::Backend>(next)?;
        self.check.execute(conn, statement, "update_versioned")?;
        Ok(next)
    }

    /// Runs the update and returns the updated row (`RETURNING`), with the
    /// same guard as [`execute`](Self::execute).
    pub fn get_result<'q, R, C>(self, conn: &mut C) -> Result<R, Error>
    where
        C: LoadConnection,
        C::Backend: ClaimBackend,
        Changes::Changeset: QueryFragment<C::Backend>,
        Target::WhereClause: QueryFragment<C::Backend>,
        PrimaryKey<Target>: QueryFragment<C::Backend>,
        FromClauseOf<Target>: QueryFragment<C::Backend>,
        Statement<Target, Col, V, Changes>: LoadQuery<'q, C, R>,
        Probe<Target, Col>: LoadQuery<'q, C, V>,
    {
        let statement = self.statement::<C::Backend>(self.next_version()?)?;
        let one_row = self.check.targets_one_row::<C::Backend>()?;
        let row = guarded(conn, one_row, "update_versioned", |conn| {
            let rows: Vec<R> = statement.load(conn)?;
            Ok((rows.len(), rows.into_iter().next()))
        })?;
        row.ok_or_else(|| {
            let probed = self.check.probe().get_result(conn).optional();
            self.check.no_match::<C::Backend>(probed)
        })
    }
}

/// Runs a versioned statement, which gives the rows it changed and its
/// outcome: on its own when the target is one row by its key, else in a
/// transaction (a savepoint in the caller's) that rolls back if it changed
/// several.
fn guarded<C, T>(
    conn: &mut C,
    one_row: bool,
    operation: &str,
    run: impl FnOnce(&mut C) -> QueryResult<(usize, T)>,
) -> Result<T, Error>
where
    C: LoadConnection,
    C::Backend: ClaimBackend,
{
    if one_row {
        return Ok(run(conn)?.1);
    }
    locking_transaction(conn, false, |conn| {
        let (rows, outcome) = run(conn)?;
        changed_at_most_one(operation, rows)?;
        Ok(outcome)
    })
}

/// `Err` if a versioned update or delete (`operation`) changed more than one
/// row: its transaction then rolls the changes back.
pub(crate) fn changed_at_most_one(operation: &str, rows: usize) -> Result<(), Error> {
    if rows > 1 {
        return Err(Error::UnexpectedOutcome(format!(
            "the target of {operation} matched {rows} rows: it must be one row, such as \
             `table.find(key)` or `&model`; nothing was changed"
        )));
    }
    Ok(())
}

impl<Target, Col, V> VersionedDelete<Target, Col, V>
where
    Target: IntoUpdateTarget + Clone,
    Target::Table: Table,
    Col: Column<Table = Target::Table> + ExpressionMethods + Copy,
    Col::SqlType: SingleValue,
    V: Version + AsExpression<Col::SqlType>,
    dsl::delete<Target>: FilterDsl<dsl::Eq<Col, V>>,
{
    /// Runs the delete. A target that is not one row by its primary key is
    /// deleted in a transaction that is rolled back, with
    /// [`Error::UnexpectedOutcome`], if it deleted more than one row.
    pub fn execute<'q, C, Inferred>(self, conn: &mut C) -> Result<(), Error>
    where
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        Target::WhereClause: QueryFragment<C::Backend>,
        PrimaryKey<Target>: QueryFragment<C::Backend>,
        FromClauseOf<Target>: QueryFragment<C::Backend>,
        DeleteStatement<Target, Col, V>: ExecuteDsl<C>,
        Probe<Target, Col>: LoadQuery<'q, C, V>,
    {
        self.check
            .execute(conn, self.check.delete(), "delete_versioned")
    }
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
        let expected = self.check.expected;
        expected
            .next()
            .ok_or(Error::VersionOverflow(expected.into()))
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
        let VersionCheck {
            target,
            version_column,
            expected,
        } = self.check.clone();
        Ok(diesel::update(target)
            .set((self.changes.clone(), version_column.eq(next)))
            .filter(version_column.eq(expected)))
    }
}

impl<Target, Col, V> VersionCheck<Target, Col, V>
where
    Target: IntoUpdateTarget + Clone,
    Target::Table: Table,
    Col: Column<Table = Target::Table> + ExpressionMethods + Copy,
    Col::SqlType: SingleValue,
    V: Version + AsExpression<Col::SqlType>,
{
    /// `DELETE FROM … WHERE <target> AND <version> = expected`.
    pub(crate) fn delete(&self) -> DeleteStatement<Target, Col, V>
    where
        dsl::delete<Target>: FilterDsl<dsl::Eq<Col, V>>,
    {
        diesel::delete(self.target.clone()).filter(self.version_column.eq(self.expected))
    }

    /// Runs a versioned update or delete (`operation`) that returns no rows,
    /// guarded against changing several; changing none is the probe's error.
    fn execute<'q, C, S>(&self, conn: &mut C, statement: S, operation: &str) -> Result<(), Error>
    where
        C: LoadConnection,
        C::Backend: ClaimBackend,
        S: ExecuteDsl<C>,
        Target::WhereClause: QueryFragment<C::Backend>,
        PrimaryKey<Target>: QueryFragment<C::Backend>,
        FromClauseOf<Target>: QueryFragment<C::Backend>,
        Probe<Target, Col>: LoadQuery<'q, C, V>,
    {
        let one_row = self.targets_one_row::<C::Backend>()?;
        let rows = guarded(conn, one_row, operation, |conn| {
            let rows = ExecuteDsl::execute(statement, conn)?;
            Ok((rows, rows))
        })?;
        match rows {
            0 => Err(self.no_match::<C::Backend>(self.probe().get_result(conn).optional())),
            _ => Ok(()),
        }
    }

    /// Whether the target is one row by its primary key, so that the
    /// statement needs no guard against changing several.
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

    /// The read of the row's version that tells, when the statement matched
    /// no row, a conflict from a missing row.
    pub(crate) fn probe(&self) -> Probe<Target, Col> {
        let target = self.target.clone().into_update_target();
        VersionProbe {
            from: target.table.from_clause(),
            where_clause: target.where_clause,
            column: self.version_column,
        }
    }

    /// What the [`probe`](Self::probe) found, as the statement's error.
    pub(crate) fn no_match<DB>(&self, probed: QueryResult<Option<V>>) -> Error
    where
        DB: ClaimBackend,
        FromClauseOf<Target>: QueryFragment<DB>,
    {
        match probed {
            Ok(Some(actual)) => match rendered::table_name::<_, DB>(&Target::table()) {
                Ok(table) => {
                    let conflict = Error::VersionConflict {
                        table,
                        expected: self.expected.into(),
                        actual: Some(actual.into()),
                    };
                    trace::debug!(error = %conflict, "version conflict");
                    conflict
                }
                Err(error) => Error::from(error),
            },
            Ok(None) => Error::NotFound,
            Err(error) => Error::from(error),
        }
    }
}
