//! Marking claims on a diesel-async connection: the blocking
//! [`MarkedClaim`]'s twin, on the same statements and the same engine.

use std::future::Future;
use std::marker::PhantomData;

use diesel::associations::HasTable;
use diesel::dsl;
use diesel::prelude::*;
use diesel::query_builder::QueryFragment;
use diesel_async::methods::{ExecuteDsl, LoadQuery};
use diesel_async::{AsyncConnection, RunQueryDsl};
use futures_util::future::{BoxFuture, FutureExt};

use super::backend::AsyncBackend;
use super::claim::{drive, lock_keys, ClaimQuery, EachBatch, EachRow, Handler, TakeRows};
use super::closure::AsyncFnMut2;
use super::transaction::transaction_depth;
use super::Async;
use crate::backend::strategy::Strategy;
use crate::claim::query::{
    check_mark, read_by_keys, taken_in_one, update_by_keys, MarkByKeys, MarkStatement, PrimaryKey,
    ReadByKeys,
};
use crate::locking::LockClause;
use crate::sql::{KeyRange, Position};
use crate::{ClaimOutcome, ClaimReport, Error, MarkedClaim};

impl<Q, V> MarkedClaim<Q, V, Async> {
    /// Runs the claim, awaiting `f` for every claimed (and marked) row: see
    /// [`crate::ClaimBuilder::mark`] and [`crate::ClaimBuilder::mark_and_commit`].
    pub fn each<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        Q: MarkQuery<'a, C, R, V> + Send + Sync + 'a,
        V: Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, R) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, R, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run(conn, EachRow(f)).map(ClaimOutcome::into_result)
    }

    /// Runs the claim, awaiting `f` once per claimed (and marked) batch: see
    /// the blocking [`MarkedClaim::each_batch`].
    pub fn each_batch<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        Q: MarkQuery<'a, C, R, V> + Send + Sync + 'a,
        V: Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, Vec<R>) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, Vec<R>, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run(conn, EachBatch(f)).map(ClaimOutcome::into_result)
    }

    /// Runs the claim as [`each`](MarkedClaim#method.each-1) does, and
    /// returns everything it did: see [`crate::ClaimBuilder::each_outcome`].
    pub fn each_outcome<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = ClaimOutcome<Q::Key, E>> + Send + 'a
    where
        Q: MarkQuery<'a, C, R, V> + Send + Sync + 'a,
        V: Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, R) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, R, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run(conn, EachRow(f))
    }

    /// Runs the claim as [`each_batch`](MarkedClaim#method.each_batch-1)
    /// does, and returns everything it did: see
    /// [`crate::ClaimBuilder::each_outcome`].
    pub fn each_batch_outcome<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = ClaimOutcome<Q::Key, E>> + Send + 'a
    where
        Q: MarkQuery<'a, C, R, V> + Send + Sync + 'a,
        V: Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, Vec<R>) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, Vec<R>, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run(conn, EachBatch(f))
    }

    fn run<'a, C, R, E, H>(
        self,
        conn: &'a mut C,
        handler: H,
    ) -> impl Future<Output = ClaimOutcome<Q::Key, E>> + Send + 'a
    where
        Q: MarkQuery<'a, C, R, V> + Send + Sync + 'a,
        V: Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        H: Handler<C, R, E> + 'a,
        E: From<Error> + Send + 'a,
    {
        async move {
            let mut handler = handler;
            let MarkedClaim {
                claim,
                changes,
                taking,
            } = &self;
            let query = &claim.query;
            let started = Q::check_changes(changes)
                .and_then(|()| transaction_depth(conn))
                .and_then(|depth| claim.start::<C::Backend, R, _>(*taking, query, depth));
            match started {
                Ok(run) => {
                    let mark = Mark(query, changes, PhantomData);
                    drive(run, query, &mark, conn, None::<&mut C>, &mut handler).await
                }
                Err(error) => ClaimOutcome::refused(error.into()),
            }
        }
    }
}

/// The query's rows, marked with the changes. (`'a` is the query's: the
/// future holds it.)
struct Mark<'q, 'a, Q, V>(&'q Q, &'q V, PhantomData<&'a ()>);

impl<'a, Q, C, R, V> TakeRows<C, R, Q::Key> for Mark<'_, 'a, Q, V>
where
    Q: MarkQuery<'a, C, R, V> + Sync,
    C: AsyncConnection,
    V: Sync,
{
    fn take_rows<'c>(
        &'c self,
        conn: &'c mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &'c LockClause,
    ) -> BoxFuture<'c, QueryResult<Vec<R>>>
    where
        R: 'c,
        Q::Key: 'c,
    {
        Box::pin(self.0.mark(conn, range, limit, lock, self.1))
    }
}

/// A query an async [marking claim](crate::ClaimBuilder::mark) can take rows
/// of type `R` from, on a diesel-async connection `C`, marking them with the
/// changeset `V`: the async twin of [`crate::MarkQuery`].
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}` and marked with `{V}`",
    note = "the row type must be `Identifiable` and `Selectable` from the claimed table, and \
            the changes an `AsChangeset` for that table"
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
