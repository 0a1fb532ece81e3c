//! The queries an async claim runs: the async twins of
//! [`crate::ClaimQuery`], [`crate::MarkQuery`] and [`crate::StampQuery`],
//! sending the blocking claim's statements on a diesel-async connection.

use std::future::Future;

use diesel::associations::HasTable;
use diesel::dsl;
use diesel::prelude::*;
use diesel::query_builder::{AsQuery, QueryFragment};
use diesel_async::methods::{ExecuteDsl, LoadQuery};
use diesel_async::{AsyncConnection, RunQueryDsl};

use super::backend::AsyncBackend;
use crate::backend::strategy::Strategy;
use crate::claim::query::{
    check_mark, read_by_keys, taken_in_one, update_by_keys, ClaimStatements, MarkByKeys,
    MarkStatement, PrimaryKey, ReadByKeys, ReadStampedByKeys, StampByKeys, StampStatement,
};
use crate::locking::LockClause;
use crate::reusable::Reusable;
use crate::sql::stamp::{NewStamp, StampMicros, StampType};
use crate::sql::{KeyRange, Locked, OrderTerms, Position, QueryOrder};
use crate::Error;

/// A query the async [`claim_each`](super::ClaimDsl::claim_each) can claim rows of type
/// `R` from, on a diesel-async connection `C`: the async twin of
/// [`crate::ClaimQuery`], implemented for the same queries, through the same
/// statements.
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}`",
    note = "the row type must `#[derive(Identifiable)]` (a primary key of one to three columns) and \
            be loadable from the query; with a join, `.select(YourRow::as_select())`; a boxed \
            query cannot be cloned: wrap the code that builds it in `diesel_claim::rebuild(|| …)`"
)]
pub trait ClaimQuery<'q, C: AsyncConnection, R>:
    ClaimStatements<C::Backend, R, Key: Send + Sync>
{
    /// Runs [`keys_query`](ClaimStatements::keys_query).
    #[doc(hidden)]
    fn keys(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
    ) -> impl Future<Output = QueryResult<Vec<Position<Self::Key>>>> + Send;

    /// Runs [`rows_query`](ClaimStatements::rows_query).
    #[doc(hidden)]
    fn rows(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &LockClause,
    ) -> impl Future<Output = QueryResult<Vec<R>>> + Send;
}

impl<'q, Q, C, R> ClaimQuery<'q, C, R> for Q
where
    Q: Reusable<Query: AsQuery<Query: QueryOrder<Terms: OrderTerms>>>,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    Q: ClaimStatements<C::Backend, R>,
    C: Loads<'q, Q::Keys, Q::Loaded> + Loads<'q, Locked<Q::Rows>, R>,
    Q::Loaded: Send + 'static,
    Q::Key: Send + Sync + 'static,
    R: Send + 'static,
{
    fn keys(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
    ) -> impl Future<Output = QueryResult<Vec<Position<Q::Key>>>> + Send {
        let loading = C::load_rows(self.keys_query(range, limit), conn);
        async move {
            let loaded: Vec<Q::Loaded> = loading.await?;
            Ok(loaded.into_iter().map(Q::position).collect())
        }
    }

    fn rows(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &LockClause,
    ) -> impl Future<Output = QueryResult<Vec<R>>> + Send {
        C::load_rows(self.rows_query(range, limit, lock), conn)
    }
}

/// diesel-async's [`LoadQuery`], said of the connection: `T` loads rows `U`
/// on `Self`, as the blocking `Loads` says it (the compiler checks it once it
/// knows the connection, and so names a query the claim refuses, rather than
/// losing itself in Diesel's impls).
pub trait Loads<'q, T, U>: Sized {
    /// Runs `query` on `conn`.
    fn load_rows(query: T, conn: &mut Self) -> impl Future<Output = QueryResult<Vec<U>>> + Send;
}

impl<'q, C, T, U> Loads<'q, T, U> for C
where
    C: AsyncConnection,
    T: LoadQuery<'q, C, U> + 'q,
    U: Send,
{
    fn load_rows(query: T, conn: &mut C) -> impl Future<Output = QueryResult<Vec<U>>> + Send {
        diesel_async::RunQueryDsl::load(query, conn)
    }
}

/// Locks up to `limit` matching rows in `range` and returns their keys: the
/// first of the statements a mark or a stamp takes without `RETURNING`
/// (MySQL), in the batch's transaction; the blocking `lock_keys`, awaited.
pub(super) async fn lock_keys<'a, Q, C, R>(
    query: &Q,
    conn: &mut C,
    range: KeyRange<Position<Q::Key>>,
    limit: i64,
    lock: &LockClause,
) -> QueryResult<Vec<Q::Key>>
where
    Q: ClaimQuery<'a, C, R>,
    C: AsyncConnection,
{
    let mut keys: Vec<Q::Key> = query
        .rows(conn, range, limit, lock)
        .await?
        .iter()
        .map(Q::key)
        .collect();
    keys.dedup();
    Ok(keys)
}

/// A query an async [marking claim](crate::ClaimBuilder::mark) can take rows
/// of type `R` from, on a diesel-async connection `C`, marking them with the
/// changeset `V`: the async twin of [`crate::MarkQuery`].
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}` and marked with `{V}`",
    note = "the row type must be `Identifiable` and `Selectable` from the claimed table, and \
            the changes an `AsChangeset` for that table; a boxed query cannot be cloned: wrap the \
            code that builds it in `diesel_claim::rebuild(|| …)`"
)]
pub trait MarkQuery<'q, C: AsyncConnection, R, V>: ClaimQuery<'q, C, R> {
    /// Rejects a changeset that changes nothing or changes the key.
    #[doc(hidden)]
    fn check_changes(changes: &V) -> Result<(), Error>;

    /// Up to `limit` matching rows in `range`, locked by `lock`, updated by
    /// `changes`, as updated.
    #[doc(hidden)]
    fn mark(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &LockClause,
        changes: &V,
    ) -> impl Future<Output = QueryResult<Vec<R>>> + Send;
}

impl<'q, Q, C, R, V> MarkQuery<'q, C, R, V> for Q
where
    Q: ClaimQuery<'q, C, R> + Sync,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: HasTable + Selectable<C::Backend> + Send,
    // The rows come back from the marking statement, which reads the claimed
    // table alone: a column of a joined table is refused at compile time.
    dsl::AsSelect<R, C::Backend>: AppearsOnTable<R::Table>,
    V: AsChangeset<Target = R::Table> + Clone + Sync,
    V::Changeset: QueryFragment<C::Backend> + Send,
    PrimaryKey<R>: QueryFragment<C::Backend>,
    MarkStatement<R, V, Q::KeyColumns, Q::Key, Q::LockedKeys, C::Backend>: LoadQuery<'q, C, R> + 'q,
    MarkByKeys<R, V, Q::KeyColumns, Q::Key>: ExecuteDsl<C> + 'q,
    ReadByKeys<R, Q::KeyColumns, Q::Key, C::Backend>: LoadQuery<'q, C, R> + 'q,
    Q::KeyColumns: Send,
{
    fn check_changes(changes: &V) -> Result<(), Error> {
        check_mark::<C::Backend, R, V>(changes)
    }

    fn mark(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &LockClause,
        changes: &V,
    ) -> impl Future<Output = QueryResult<Vec<R>>> + Send {
        let changes = || changes.clone().as_changeset();
        async move {
            if <C::Backend as Strategy>::UPDATE_RETURNING {
                let statement = taken_in_one::<_, _, R, _, _>(
                    self,
                    range,
                    limit,
                    lock,
                    changes(),
                    R::as_select(),
                );
                return statement.load(conn).await;
            }
            // Without `RETURNING` (MySQL): lock, mark by key, and read the rows
            // back, in the batch's transaction.
            let keys = lock_keys(self, conn, range, limit, lock).await?;
            if keys.is_empty() {
                return Ok(Vec::new());
            }
            let key = Q::key_columns();
            let update = update_by_keys::<R, _, _, _>(key, keys.clone(), changes());
            update.execute(conn).await?;
            let read_back = read_by_keys::<R, _, _, _>(key, keys, R::as_select());
            read_back.load(conn).await
        }
    }
}

/// A query an async [visibility-timeout
/// claim](crate::ClaimBuilder::visibility_timeout) can take rows of type `R`
/// from, on a diesel-async connection `C`, stamping them in the column
/// `Col`: the async twin of [`crate::StampQuery`].
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}` with a stamp in `{Col}`",
    note = "the row type must be `Identifiable` and `Selectable` from the claimed table, and \
            the stamp a nullable timestamp column of that table; a boxed query cannot be cloned: \
            wrap the code that builds it in `diesel_claim::rebuild(|| …)`"
)]
pub trait StampQuery<'q, C: AsyncConnection, R, Col>: ClaimQuery<'q, C, R> {
    /// Up to `limit` matching rows in `range`, locked by `lock`, stamped by
    /// `stamp`, with the stamp written.
    #[doc(hidden)]
    fn stamp(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &LockClause,
        stamp: &NewStamp<Col>,
    ) -> impl Future<Output = QueryResult<Vec<(R, i64)>>> + Send;
}

impl<'q, Q, C, R, Col> StampQuery<'q, C, R, Col> for Q
where
    Q: ClaimQuery<'q, C, R> + Sync,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: HasTable + Selectable<C::Backend> + Send,
    dsl::AsSelect<R, C::Backend>: AppearsOnTable<R::Table>,
    Col: Column<Table = R::Table> + Copy + Send + Sync,
    Col::SqlType: StampType<C::Backend>,
    StampStatement<R, Col, Q::KeyColumns, Q::Key, Q::LockedKeys, C::Backend>:
        LoadQuery<'q, C, (R, i64)> + 'q,
    StampByKeys<R, Col, Q::KeyColumns, Q::Key>: ExecuteDsl<C> + 'q,
    ReadStampedByKeys<R, Col, Q::KeyColumns, Q::Key, C::Backend>: LoadQuery<'q, C, (R, i64)> + 'q,
    Q::KeyColumns: Send,
{
    fn stamp(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &LockClause,
        stamp: &NewStamp<Col>,
    ) -> impl Future<Output = QueryResult<Vec<(R, i64)>>> + Send {
        let stamp = *stamp;
        let stamped = move || (R::as_select(), StampMicros(stamp.column));
        async move {
            if <C::Backend as Strategy>::UPDATE_RETURNING {
                let statement =
                    taken_in_one::<_, _, R, _, _>(self, range, limit, lock, stamp, stamped());
                return statement.load(conn).await;
            }
            // Without `RETURNING` (MySQL): lock, stamp by key, and read the
            // rows and their stamps back, in the caller's transaction.
            let keys = lock_keys(self, conn, range, limit, lock).await?;
            if keys.is_empty() {
                return Ok(Vec::new());
            }
            let key = Q::key_columns();
            let update = update_by_keys::<R, _, _, _>(key, keys.clone(), stamp);
            update.execute(conn).await?;
            let read_back = read_by_keys::<R, _, _, _>(key, keys, stamped());
            read_back.load(conn).await
        }
    }
}
