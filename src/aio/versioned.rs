//! Optimistic updates and retries on a diesel-async connection.

use std::future::Future;

use diesel::dsl;
use diesel::expression::AsExpression;
use diesel::prelude::*;
use diesel::query_builder::{AsChangeset, AsQuery, IntoUpdateTarget, QueryFragment};
use diesel::query_dsl::methods::FilterDsl;
use diesel::sql_types::SingleValue;
use diesel_async::methods::{ExecuteDsl, LoadQuery};
use diesel_async::{AsyncConnection, RunQueryDsl};
use scoped_futures::ScopedFutureExt;

use super::backend::AsyncBackend;
use super::closure::AsyncFnMut1;
use super::transaction::locking_transaction;
use super::Async;
use crate::locking::IdleBound;
use crate::retry::Attempts;
use crate::versioned::{
    changed_at_most_one, DeleteStatement, FromClauseOf, PrimaryKey, Probe, Statement, VersionCheck,
};
use crate::{Error, RetryPolicy, Transient, Version, VersionedDelete, VersionedUpdate};

/// Adds [`update_versioned`](VersionedDsl::update_versioned) to update targets,
/// for diesel-async connections: the async twin of [`crate::VersionedDsl`].
pub trait VersionedDsl: IntoUpdateTarget + Clone {
    /// A version-checked update: see [`crate::VersionedDsl::update_versioned`].
    /// Run it with [`execute`](VersionedUpdate#method.execute-1) or
    /// [`get_result`](VersionedUpdate#method.get_result-1).
    fn update_versioned<Col, V, Changes>(
        self,
        version_column: Col,
        expected: V,
        changes: Changes,
    ) -> VersionedUpdate<Self, Col, V, Changes, Async>
    where
        Col: Column<Table = Self::Table>,
        V: Version,
    {
        VersionedUpdate::new(self, version_column, expected, changes)
    }

    /// A version-checked delete: see [`crate::VersionedDsl::delete_versioned`].
    /// Run it with [`execute`](VersionedDelete#method.execute-1).
    fn delete_versioned<Col, V>(
        self,
        version_column: Col,
        expected: V,
    ) -> VersionedDelete<Self, Col, V, Async>
    where
        Col: Column<Table = Self::Table>,
        V: Version,
    {
        VersionedDelete::new(self, version_column, expected)
    }
}

impl<T: IntoUpdateTarget + Clone> VersionedDsl for T {}

impl<Target, Col, V> VersionedDelete<Target, Col, V, Async>
where
    Target: IntoUpdateTarget + Clone,
    Target::Table: Table,
    Col: Column<Table = Target::Table> + ExpressionMethods + Copy,
    Col::SqlType: SingleValue,
    V: Version + AsExpression<Col::SqlType> + Send + 'static,
    dsl::delete<Target>: FilterDsl<dsl::Eq<Col, V>>,
{
    /// Runs the delete: see [`crate::VersionedDelete::execute`].
    pub fn execute<'a, C>(
        self,
        conn: &'a mut C,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        Self: 'a,
        Target: Send,
        Col: Send,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        Target::WhereClause: QueryFragment<C::Backend>,
        PrimaryKey<Target>: QueryFragment<C::Backend>,
        FromClauseOf<Target>: QueryFragment<C::Backend>,
        DeleteStatement<Target, Col, V>: ExecuteDsl<C> + Send + 'a,
        Probe<Target, Col>: LoadQuery<'a, C, V> + 'a,
    {
        async move {
            let statement = self.check.delete();
            self.check
                .execute_async(conn, statement, "delete_versioned")
                .await
        }
    }
}

type Bump<Col, V> = dsl::Eq<Col, V>;

impl<Target, Col, V, Changes> VersionedUpdate<Target, Col, V, Changes, Async>
where
    Target: IntoUpdateTarget + Clone,
    Target::Table: Table,
    Col: Column<Table = Target::Table> + ExpressionMethods + Copy,
    Col::SqlType: SingleValue,
    V: Version + AsExpression<Col::SqlType> + Send + 'static,
    Changes: AsChangeset<Target = Target::Table> + Clone,
    (Changes, Bump<Col, V>): AsChangeset<Target = Target::Table>,
    dsl::Update<Target, (Changes, Bump<Col, V>)>: AsQuery,
    dsl::Update<Target, (Changes, Bump<Col, V>)>: FilterDsl<dsl::Eq<Col, V>>,
{
    /// Runs the update and returns the new version: see
    /// [`crate::VersionedUpdate::execute`].
    pub fn execute<'a, C>(
        self,
        conn: &'a mut C,
    ) -> impl Future<Output = Result<V, Error>> + Send + 'a
    where
        Self: Send + 'a,
        Target: Send,
        Col: Send,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        Changes::Changeset: QueryFragment<C::Backend>,
        Target::WhereClause: QueryFragment<C::Backend>,
        PrimaryKey<Target>: QueryFragment<C::Backend>,
        FromClauseOf<Target>: QueryFragment<C::Backend>,
        Statement<Target, Col, V, Changes>: ExecuteDsl<C> + Send + 'a,
        Probe<Target, Col>: LoadQuery<'a, C, V> + 'a,
    {
        async move {
            let next = self.next_version()?;
            let statement = self.statement::<C::Backend>(next)?;
            self.check
                .execute_async(conn, statement, "update_versioned")
                .await?;
            Ok(next)
        }
    }

    /// Runs the update and returns the updated row (`RETURNING`): see
    /// [`crate::VersionedUpdate::get_result`].
    pub fn get_result<'a, R, C>(
        self,
        conn: &'a mut C,
    ) -> impl Future<Output = Result<R, Error>> + Send + 'a
    where
        Self: Send + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        Changes::Changeset: QueryFragment<C::Backend>,
        Target::WhereClause: QueryFragment<C::Backend>,
        PrimaryKey<Target>: QueryFragment<C::Backend>,
        FromClauseOf<Target>: QueryFragment<C::Backend>,
        Statement<Target, Col, V, Changes>: LoadQuery<'a, C, R> + Send + 'a,
        Probe<Target, Col>: LoadQuery<'a, C, V> + 'a,
    {
        async move {
            let statement = self.statement::<C::Backend>(self.next_version()?)?;
            let row = if self.check.targets_one_row::<C::Backend>()? {
                RunQueryDsl::get_result(statement, conn).await.optional()?
            } else {
                locking_transaction(conn, IdleBound::default(), |conn| {
                    async move {
                        let rows: Vec<R> = RunQueryDsl::load(statement, conn).await?;
                        changed_at_most_one("update_versioned", rows.len())?;
                        Ok::<_, Error>(rows.into_iter().next())
                    }
                    .scope_boxed()
                })
                .await?
            };
            match row {
                Some(row) => Ok(row),
                None => {
                    let probed = self.check.probe().get_result(conn).await.optional();
                    Err(self.check.no_match::<C::Backend>(probed))
                }
            }
        }
    }
}

/// Awaits `operation` until it succeeds, fails with an error that is not
/// [transient](Transient), or has been tried `policy.max_attempts` times: the
/// async twin of [`crate::retry`], pausing with `tokio::time::sleep`. Each
/// attempt is an `async` closure, `async |conn| { … }`.
pub fn retry<'a, C, T, E, F>(
    conn: &'a mut C,
    policy: RetryPolicy,
    mut operation: F,
) -> impl Future<Output = Result<T, E>> + Send + 'a
where
    C: Send,
    T: Send + 'a,
    for<'c> F: AsyncFnMut(&'c mut C) -> Result<T, E>
        + AsyncFnMut1<&'c mut C, Result<T, E>, Fut: Send>
        + Send
        + 'a,
    E: Transient + From<Error> + Send + 'a,
{
    async move {
        let mut attempts = Attempts::new(policy)?;
        loop {
            match operation(conn).await {
                Err(error) => match attempts.pause_after(&error) {
                    Some(pause) => tokio::time::sleep(pause).await,
                    None => return Err(error),
                },
                done => return done,
            }
        }
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
    /// The async twin of the blocking `VersionCheck::execute`: runs a
    /// versioned update or delete (`operation`) guarded against changing
    /// several rows; changing none is the probe's error.
    async fn execute_async<'a, C, S>(
        self,
        conn: &'a mut C,
        statement: S,
        operation: &str,
    ) -> Result<(), Error>
    where
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        S: ExecuteDsl<C> + Send + 'a,
        Target::WhereClause: QueryFragment<C::Backend>,
        PrimaryKey<Target>: QueryFragment<C::Backend>,
        FromClauseOf<Target>: QueryFragment<C::Backend>,
        Probe<Target, Col>: LoadQuery<'a, C, V> + 'a,
        V: Send + 'static,
    {
        let rows = if self.targets_one_row::<C::Backend>()? {
            RunQueryDsl::execute(statement, conn).await?
        } else {
            locking_transaction(conn, IdleBound::default(), |conn| {
                async move {
                    let rows = RunQueryDsl::execute(statement, conn).await?;
                    changed_at_most_one(operation, rows)?;
                    Ok::<_, Error>(rows)
                }
                .scope_boxed()
            })
            .await?
        };
        match rows {
            0 => {
                let probed = self.probe().get_result(conn).await.optional();
                Err(self.no_match::<C::Backend>(probed))
            }
            _ => Ok(()),
        }
    }
}
