//! The kinds of claim on a diesel-async connection: the async twin of
//! [`crate::kind::Takes`], each kind's statements (a mark's and a stamp's
//! among them), and the async failure hook.

use std::hash::Hash;
use std::time::Instant;

use diesel::associations::HasTable;
use diesel::prelude::*;
use diesel_async::methods::ExecuteDsl;
use diesel_async::{AsyncConnection, RunQueryDsl};
use futures_util::future::{self, BoxFuture};

use super::backend::AsyncBackend;
use super::closure::AsyncFnMut3;
use super::query::{ClaimQuery, MarkQuery, StampQuery};
use super::timed::StampedRow;
use super::Async;
use crate::claim::engine::Claim;
use crate::claim::kind::{
    hands_rows_as_they_are, start, DeadLetter, Delete, Keep, Kind, Mark, NoHook, OnFailure,
    Replica, Select, Set, Stamp,
};
use crate::claim::query::{update_by_keys, DeleteByKeys, MarkByKeys};
use crate::claim::{ClaimStatements, Options};
use crate::locking::LockClause;
use crate::sql::{Delete as DeleteStatement, InList, KeyRange, Position};
use crate::{ClaimBuilder, Claimed, Error};

/// How a kind of claim runs on a diesel-async connection `C`, from the query
/// `Q`, for a closure that gets `I` for each row: the async twin of
/// [`crate::kind::Takes`], implemented by the same kinds for the same queries.
#[diagnostic::on_unimplemented(
    message = "`{I}` cannot be claimed from `{Q}` on `{C}`",
    note = "the closure gets the rows of the query (a `#[derive(Identifiable)]` type loadable from \
            it), or, with a visibility timeout, `Claimed<Row, _, Async>`"
)]
pub trait Takes<'a, Q, C: AsyncConnection, I>: Kind + Send + Sync {
    /// The rows, as a failure hook gets them.
    #[doc(hidden)]
    type Row: Send;
    /// The claimed table's primary-key value.
    #[doc(hidden)]
    type Key: Clone + Eq + Hash + std::fmt::Debug + Send + Sync;
    /// What the taking statement returns per row.
    #[doc(hidden)]
    type Taken: Send;

    /// Checks the query and the options, and sets up one run.
    #[doc(hidden)]
    fn start(
        &self,
        query: &Q,
        options: &Options,
        depth: u32,
    ) -> Result<Claim<Position<Self::Key>>, Error>;

    /// The claimed table's name, for spans and events.
    #[doc(hidden)]
    fn table_name() -> String;

    /// Up to `limit` positions of matching rows in `range`, without locks,
    /// read on `conn` (`exact`), or on the replica if the kind has one.
    #[doc(hidden)]
    fn keys<'c>(
        &'c mut self,
        query: &'c Q,
        conn: &'c mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        exact: bool,
    ) -> BoxFuture<'c, QueryResult<Vec<Position<Self::Key>>>>
    where
        'a: 'c,
        I: 'c,
        Self::Key: 'c;

    /// Takes up to `limit` rows of `range` under `lock`.
    #[doc(hidden)]
    fn take<'c>(
        &'c self,
        query: &'c Q,
        conn: &'c mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &'c LockClause,
    ) -> BoxFuture<'c, QueryResult<Vec<Self::Taken>>>
    where
        'a: 'c,
        I: 'c,
        Self::Key: 'c;

    /// A taken row's key.
    #[doc(hidden)]
    fn taken_key(taken: &Self::Taken) -> Self::Key;

    /// What the closure gets of a row taken by a statement sent at `sent`.
    #[doc(hidden)]
    fn hand(&self, taken: Self::Taken, sent: Instant) -> I;

    /// The key of what the closure gets.
    #[doc(hidden)]
    fn item_key(item: &I) -> Self::Key;

    /// The row of what the closure gets, for a failure hook.
    #[doc(hidden)]
    fn into_row(item: I) -> Self::Row;

    /// See [`crate::kind::Takes::refresh`].
    #[doc(hidden)]
    fn refresh<'c>(
        &'c self,
        _item: &'c mut I,
        _conn: &'c mut C,
    ) -> BoxFuture<'c, Result<bool, Error>> {
        Box::pin(future::ready(Ok(true)))
    }

    /// See [`crate::kind::Takes::settle`].
    #[doc(hidden)]
    fn settle<'c>(&'c self, _item: &'c I, _conn: &'c mut C) -> BoxFuture<'c, Result<bool, Error>> {
        Box::pin(future::ready(Ok(true)))
    }

    /// See [`crate::kind::Takes::FINISHES`].
    #[doc(hidden)]
    const FINISHES: bool = false;

    /// See [`crate::kind::Takes::finish`].
    #[doc(hidden)]
    fn finish<'c>(
        &'c self,
        _conn: &'c mut C,
        _keys: Vec<Self::Key>,
    ) -> BoxFuture<'c, QueryResult<()>>
    where
        'a: 'c,
        I: 'c,
        Self::Key: 'c,
    {
        Box::pin(future::ready(Ok(())))
    }
}

/// What becomes of a selected row once its closure has succeeded, on a
/// diesel-async connection: the async twin of [`crate::kind::Finish`].
#[diagnostic::on_unimplemented(
    message = "the rows of `{Q}` cannot be written once done with `{Self}`",
    note = "`then_delete` deletes rows of the claimed table by key; `then_update(changes)` \
            takes an `AsChangeset` for that table"
)]
pub trait Finish<'a, Q, C: AsyncConnection, R>: Send + Sync {
    /// Whether there is a statement to run.
    #[doc(hidden)]
    const FINISHES: bool;

    /// Writes the rows at `keys`.
    #[doc(hidden)]
    fn finish<'c>(
        &'c self,
        conn: &'c mut C,
        keys: Vec<<Q as ClaimStatements<C::Backend, R>>::Key>,
    ) -> BoxFuture<'c, QueryResult<()>>
    where
        Q: ClaimStatements<C::Backend, R>,
        'a: 'c,
        R: 'c;
}

impl<'a, Q, C: AsyncConnection, R> Finish<'a, Q, C, R> for Keep {
    const FINISHES: bool = false;

    fn finish<'c>(
        &'c self,
        _conn: &'c mut C,
        _keys: Vec<<Q as ClaimStatements<C::Backend, R>>::Key>,
    ) -> BoxFuture<'c, QueryResult<()>>
    where
        Q: ClaimStatements<C::Backend, R>,
        'a: 'c,
        R: 'c,
    {
        Box::pin(future::ready(Ok(())))
    }
}

// A statement Diesel cannot build is told as what `then_delete` does.
#[diagnostic::do_not_recommend]
impl<'a, Q, C, R> Finish<'a, Q, C, R> for Delete
where
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: HasTable,
    Q: ClaimStatements<C::Backend, R, Key: Send, KeyColumns: Send>,
    DeleteByKeys<R, Q::KeyColumns, Q::Key>: ExecuteDsl<C> + Send + 'a,
{
    const FINISHES: bool = true;

    fn finish<'c>(&'c self, conn: &'c mut C, keys: Vec<Q::Key>) -> BoxFuture<'c, QueryResult<()>>
    where
        'a: 'c,
        R: 'c,
    {
        let delete = DeleteStatement {
            from: R::table().from_clause(),
            filter: InList {
                column: Q::key_columns(),
                keys,
            },
        };
        Box::pin(async move { delete.execute(conn).await.map(drop) })
    }
}

// Changes for another table, or a statement Diesel cannot build from
// them, are told as what `then_update` takes.
#[diagnostic::do_not_recommend]
impl<'a, Q, C, R, V> Finish<'a, Q, C, R> for Set<V>
where
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: HasTable,
    Q: ClaimStatements<C::Backend, R, Key: Send, KeyColumns: Send>,
    V: AsChangeset<Target = R::Table> + Clone + Send + Sync,
    MarkByKeys<R, V, Q::KeyColumns, Q::Key>: ExecuteDsl<C> + Send + 'a,
{
    const FINISHES: bool = true;

    fn finish<'c>(&'c self, conn: &'c mut C, keys: Vec<Q::Key>) -> BoxFuture<'c, QueryResult<()>>
    where
        'a: 'c,
        R: 'c,
    {
        let update =
            update_by_keys::<R, _, _, _>(Q::key_columns(), keys, self.0.clone().as_changeset());
        Box::pin(async move { update.execute(conn).await.map(drop) })
    }
}

impl<'a, Q, C, R, D> Takes<'a, Q, C, R> for Select<D>
where
    Q: ClaimQuery<'a, C, R> + Sync,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: Send,
    D: Finish<'a, Q, C, R>,
{
    hands_rows_as_they_are!(Q::Key);

    const FINISHES: bool = D::FINISHES;

    fn finish<'c>(&'c self, conn: &'c mut C, keys: Vec<Q::Key>) -> BoxFuture<'c, QueryResult<()>>
    where
        'a: 'c,
        R: 'c,
        Q::Key: 'c,
    {
        self.0.finish(conn, keys)
    }

    fn keys<'c>(
        &'c mut self,
        query: &'c Q,
        conn: &'c mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        _exact: bool,
    ) -> BoxFuture<'c, QueryResult<Vec<Position<Q::Key>>>>
    where
        'a: 'c,
        R: 'c,
        Self::Key: 'c,
    {
        Box::pin(query.keys(conn, range, limit))
    }

    fn take<'c>(
        &'c self,
        query: &'c Q,
        conn: &'c mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &'c LockClause,
    ) -> BoxFuture<'c, QueryResult<Vec<R>>>
    where
        'a: 'c,
        R: 'c,
        Self::Key: 'c,
    {
        Box::pin(query.rows(conn, range, limit, lock))
    }
}

impl<'a, Q, C, R, Rc, K> Takes<'a, Q, C, R> for Replica<'_, Rc>
where
    Q: ClaimQuery<'a, C, R, Key = K> + ClaimQuery<'a, Rc, R, Key = K> + Sync,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    Rc: AsyncConnection<Backend = C::Backend> + Sync,
    R: Send,
    K: Clone + Eq + Hash + std::fmt::Debug + Send + Sync,
{
    hands_rows_as_they_are!(K);

    fn keys<'c>(
        &'c mut self,
        query: &'c Q,
        conn: &'c mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        exact: bool,
    ) -> BoxFuture<'c, QueryResult<Vec<Position<Self::Key>>>>
    where
        'a: 'c,
        R: 'c,
        Self::Key: 'c,
    {
        if exact {
            Box::pin(ClaimQuery::<'a, C, R>::keys(query, conn, range, limit))
        } else {
            Box::pin(ClaimQuery::<'a, Rc, R>::keys(
                query,
                self.replica,
                range,
                limit,
            ))
        }
    }

    fn take<'c>(
        &'c self,
        query: &'c Q,
        conn: &'c mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &'c LockClause,
    ) -> BoxFuture<'c, QueryResult<Vec<R>>>
    where
        'a: 'c,
        R: 'c,
        Self::Key: 'c,
    {
        Box::pin(ClaimQuery::<'a, C, R>::rows(
            query, conn, range, limit, lock,
        ))
    }
}

impl<'a, Q, C, R, V> Takes<'a, Q, C, R> for Mark<V>
where
    Q: MarkQuery<'a, C, R, V> + Sync,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: Send,
    V: Send + Sync,
{
    hands_rows_as_they_are!(Q::Key, |mark: &Self| Q::check_changes(&mark.changes));

    fn keys<'c>(
        &'c mut self,
        query: &'c Q,
        conn: &'c mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        _exact: bool,
    ) -> BoxFuture<'c, QueryResult<Vec<Position<Q::Key>>>>
    where
        'a: 'c,
        R: 'c,
        Self::Key: 'c,
    {
        Box::pin(query.keys(conn, range, limit))
    }

    fn take<'c>(
        &'c self,
        query: &'c Q,
        conn: &'c mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &'c LockClause,
    ) -> BoxFuture<'c, QueryResult<Vec<R>>>
    where
        'a: 'c,
        R: 'c,
        Self::Key: 'c,
    {
        Box::pin(query.mark(conn, range, limit, lock, &self.changes))
    }
}

impl<'a, Q, C, R, Col> Takes<'a, Q, C, Claimed<R, Col, Async>> for Stamp<Col>
where
    Q: StampQuery<'a, C, R, Col> + Sync,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: StampedRow<C, Col> + HasTable + Send + Sync,
    Col: Copy + Send + Sync,
{
    type Row = R;
    type Key = Q::Key;
    type Taken = (R, i64);

    fn start(
        &self,
        query: &Q,
        options: &Options,
        depth: u32,
    ) -> Result<Claim<Position<Q::Key>>, Error> {
        start::<C::Backend, R, Q, Self>(self, query, options, depth)
    }

    fn table_name() -> String {
        Q::table_name()
    }

    fn keys<'c>(
        &'c mut self,
        query: &'c Q,
        conn: &'c mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        _exact: bool,
    ) -> BoxFuture<'c, QueryResult<Vec<Position<Q::Key>>>>
    where
        'a: 'c,
        Claimed<R, Col, Async>: 'c,
        Self::Key: 'c,
    {
        Box::pin(query.keys(conn, range, limit))
    }

    fn take<'c>(
        &'c self,
        query: &'c Q,
        conn: &'c mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &'c LockClause,
    ) -> BoxFuture<'c, QueryResult<Vec<(R, i64)>>>
    where
        'a: 'c,
        Claimed<R, Col, Async>: 'c,
        Self::Key: 'c,
    {
        Box::pin(query.stamp(conn, range, limit, lock, &self.stamp))
    }

    fn taken_key((row, _): &(R, i64)) -> Q::Key {
        Q::key(row)
    }

    fn hand(&self, (row, stamp): (R, i64), sent: Instant) -> Claimed<R, Col, Async> {
        Claimed::new(row, stamp, self.stamp, sent)
    }

    fn item_key(item: &Claimed<R, Col, Async>) -> Q::Key {
        Q::key(&item.row)
    }

    fn into_row(item: Claimed<R, Col, Async>) -> R {
        item.row
    }

    fn refresh<'c>(
        &'c self,
        item: &'c mut Claimed<R, Col, Async>,
        conn: &'c mut C,
    ) -> BoxFuture<'c, Result<bool, Error>> {
        Box::pin(async move {
            match item.extend(conn).await {
                Ok(()) => Ok(true),
                Err(Error::ClaimLost { .. } | Error::NotFound) => Ok(false),
                Err(error) => Err(error),
            }
        })
    }

    fn settle<'c>(
        &'c self,
        item: &'c Claimed<R, Col, Async>,
        conn: &'c mut C,
    ) -> BoxFuture<'c, Result<bool, Error>> {
        Box::pin(async move { Ok(R::unstamp(item, conn, None::<()>).await? > 0) })
    }
}

/// A failure hook on a diesel-async connection `C`: the async twin of
/// [`crate::kind::FailureHook`]: [`NoHook`], or [`OnFailure`] with an
/// `async` closure `async |conn, row: Row, error: &E| -> Result<(), E>`.
#[diagnostic::on_unimplemented(
    message = "the failure hook does not fit this claim",
    note = "an async failure hook is an `async` closure `async |conn, row: Row, error: &E| -> \
            Result<(), E>`, with the rows and the error type of the claim's closure, and rows \
            that are `Clone` (the hook gets the row as it was handed over)"
)]
pub trait FailureHook<C, I, Row, E>: Send {
    /// Whether there is a hook to run.
    #[doc(hidden)]
    const SET: bool;

    /// A copy of what the closure gets, kept for the hook.
    #[doc(hidden)]
    fn keep(item: &I) -> Option<I>;

    /// Runs the hook: the row is a dead letter if it says so.
    #[doc(hidden)]
    fn failed<'c>(
        &'c mut self,
        conn: &'c mut C,
        row: Row,
        error: &'c E,
    ) -> BoxFuture<'c, Result<Option<DeadLetter>, E>>
    where
        Row: 'c;
}

impl<C, I, Row, E: Send> FailureHook<C, I, Row, E> for NoHook {
    const SET: bool = false;

    fn keep(_item: &I) -> Option<I> {
        None
    }

    fn failed<'c>(
        &'c mut self,
        _conn: &'c mut C,
        _row: Row,
        _error: &'c E,
    ) -> BoxFuture<'c, Result<Option<DeadLetter>, E>>
    where
        Row: 'c,
    {
        Box::pin(future::ready(Ok(None)))
    }
}

// A hook of another shape, or rows that are not `Clone`, are told as what
// a failure hook is.
#[diagnostic::do_not_recommend]
impl<C, I, Row, E, F> FailureHook<C, I, Row, E> for OnFailure<F>
where
    I: Clone,
    for<'c, 'e> F: AsyncFnMut(&'c mut C, Row, &'e E) -> Result<(), E>
        + AsyncFnMut3<&'c mut C, Row, &'e E, Result<(), E>, Fut: Send>
        + Send,
{
    const SET: bool = true;

    fn keep(item: &I) -> Option<I> {
        Some(item.clone())
    }

    fn failed<'c>(
        &'c mut self,
        conn: &'c mut C,
        row: Row,
        error: &'c E,
    ) -> BoxFuture<'c, Result<Option<DeadLetter>, E>>
    where
        Row: 'c,
    {
        let hooked = (self.0)(conn, row, error);
        Box::pin(async move { hooked.await.map(|()| None) })
    }
}

impl<Q, T> ClaimBuilder<Q, Async, T, NoHook> {
    /// Records a failing row under its lock, as the blocking
    /// [`on_failure`](ClaimBuilder::on_failure) does, with an `async`
    /// closure: `async |conn, job: Job, error: &MyError| { … }`.
    ///
    /// The row, and the error if the hook uses it, need their types named,
    /// as there: the hook is checked where it is given, before the claim's
    /// closure fixes the row type, and the compiler, unable to infer the
    /// row's, asks for the method's type parameters instead ("type
    /// annotations needed").
    pub fn on_failure<C, R, E, F>(self, hook: F) -> ClaimBuilder<Q, Async, T, OnFailure<F>>
    where
        for<'c, 'e> F: AsyncFnMut(&'c mut C, R, &'e E) -> Result<(), E>
            + AsyncFnMut3<&'c mut C, R, &'e E, Result<(), E>, Fut: Send>
            + Send,
    {
        self.with_hook(OnFailure(hook))
    }
}
