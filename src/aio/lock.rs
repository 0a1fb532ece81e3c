//! Row locks on a diesel-async connection.

use std::future::Future;
use std::sync::Arc;

use diesel::associations::HasTable;
use diesel::query_builder::{Query, QueryFragment};
use diesel::{Identifiable, Selectable};
use diesel_async::methods::LoadQuery;
use diesel_async::AsyncConnection;
use scoped_futures::ScopedFutureExt;

use super::backend::AsyncBackend;
use super::closure::AsyncFnOnce2;
use super::transaction::locking_transaction;
use super::Async;
use crate::lock::{fresh_row, none_left_out, the_one_row, FreshRow};
use crate::locking::LockClause;
use crate::sql::{IdShape, KeyShape};
use crate::trace::{self, Instrument};
use crate::transaction::{locking_read, transaction_outcome, MOVED_ROW_RETRIES};

/// The shape of a model's key, from its `Identifiable::Id`.
type Shape<M> = <<&'static M as Identifiable>::Id as IdShape>::Shape;
use crate::reusable::Reusable;
use crate::sql::{lock_target, rendered, Locked};
use crate::{Error, LockBuilder};

/// Adds [`with_lock`](LockDsl::with_lock) and [`with_locks`](LockDsl::with_locks) to
/// Diesel queries, for diesel-async connections: the async twin of
/// [`crate::LockDsl`].
pub trait LockDsl: Sized {
    /// Locks the one row this query selects and awaits `f` with it, in a
    /// transaction: see [`crate::LockDsl::with_lock`]. `f` is an `async`
    /// closure, `async |conn, row| { … }`: see [Closures](super#closures).
    fn with_lock<'a, C, R, T, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<T, E>> + Send + 'a
    where
        Self: LockQuery<'a, C, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        T: Send + 'a,
        for<'c> F: AsyncFnOnce(&'c mut C, R) -> Result<T, E>
            + AsyncFnOnce2<&'c mut C, R, Result<T, E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.build_lock().run(conn, f)
    }

    /// Locks every row this query selects and awaits `f` with them: see
    /// [`crate::LockDsl::with_locks`].
    fn with_locks<'a, C, R, T, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<T, E>> + Send + 'a
    where
        Self: LockQuery<'a, C, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        T: Send + 'a,
        for<'c> F: AsyncFnOnce(&'c mut C, Vec<R>) -> Result<T, E>
            + AsyncFnOnce2<&'c mut C, Vec<R>, Result<T, E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.build_lock().run_all(conn, f)
    }

    /// Starts a row lock with options; run it with
    /// [`LockBuilder::run`](LockBuilder#method.run-1) or
    /// [`LockBuilder::run_all`](LockBuilder#method.run_all-1).
    fn build_lock(self) -> LockBuilder<Self, Async> {
        LockBuilder::new(self)
    }
}

impl<Q: Query> LockDsl for Q {}

impl<F> LockDsl for crate::Rebuild<F> {}

/// Adds [`with_lock`](LockModelDsl::with_lock) to a loaded model, for
/// diesel-async connections: the async twin of [`crate::LockModelDsl`].
pub trait LockModelDsl: HasTable + Sized {
    /// The model's primary-key value.
    type Key: Clone + Send + Sync;
    /// The model's primary key, wrapped for the key predicates.
    #[doc(hidden)]
    type KeyColumns;

    /// Locks this model's row, reads it again and awaits `f` with the fresh
    /// copy, in a transaction: see [`crate::LockModelDsl::with_lock`].
    fn with_lock<'a, C, T, E, F>(
        &self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<T, E>> + Send + 'a
    where
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        Self: Selectable<C::Backend> + Send + 'a,
        FreshRow<Self, Self::KeyColumns, Self::Key, C::Backend>:
            LockQuery<'a, C, Self> + Send + Sync + 'a,
        T: Send + 'a,
        for<'c> F: AsyncFnOnce(&'c mut C, Self) -> Result<T, E>
            + AsyncFnOnce2<&'c mut C, Self, Result<T, E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a;
}

impl<M> LockModelDsl for M
where
    M: HasTable + 'static,
    &'static M: Identifiable,
    <&'static M as Identifiable>::Id: IdShape,
    Shape<M>: KeyShape<M, Key: Send + Sync>,
{
    type Key = <Shape<M> as KeyShape<M>>::Key;
    type KeyColumns = <Shape<M> as KeyShape<M>>::Columns;

    fn with_lock<'a, C, T, E, F>(
        &self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<T, E>> + Send + 'a
    where
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        Self: Selectable<C::Backend> + Send + 'a,
        FreshRow<Self, Self::KeyColumns, Self::Key, C::Backend>:
            LockQuery<'a, C, Self> + Send + Sync + 'a,
        T: Send + 'a,
        for<'c> F: AsyncFnOnce(&'c mut C, Self) -> Result<T, E>
            + AsyncFnOnce2<&'c mut C, Self, Result<T, E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        LockBuilder::<_, Async>::new(fresh_row(self)).run(conn, f)
    }
}

impl<Q> LockBuilder<Q, Async> {
    /// How long the lock's transaction may sit idle — its closure awaiting
    /// something other than the database — before the server ends its
    /// session: `Some(duration)`, by default
    /// [`IDLE_TRANSACTION_BOUND`](super::IDLE_TRANSACTION_BOUND), or `None`
    /// for the session's own setting. See the module documentation,
    /// "Dropped futures"; the claim's
    /// [`idle_bound`](crate::ClaimBuilder::idle_bound) says what happens
    /// when it fires.
    pub fn idle_bound(mut self, bound: impl Into<Option<std::time::Duration>>) -> Self {
        self.lock.idle_bound(bound.into());
        self
    }

    /// Awaits `f` with the locked row: see [`crate::LockDsl::with_lock`].
    pub fn run<'a, C, R, T, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<T, E>> + Send + 'a
    where
        Q: LockQuery<'a, C, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        T: Send + 'a,
        for<'c> F: AsyncFnOnce(&'c mut C, R) -> Result<T, E>
            + AsyncFnOnce2<&'c mut C, R, Result<T, E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run_all(conn, async move |conn: &mut C, rows: Vec<R>| {
            f(conn, the_one_row(rows)?).await
        })
    }

    /// Awaits `f` with all the locked rows: see [`crate::LockDsl::with_locks`].
    pub fn run_all<'a, C, R, T, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<T, E>> + Send + 'a
    where
        Q: LockQuery<'a, C, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        T: Send + 'a,
        for<'c> F: AsyncFnOnce(&'c mut C, Vec<R>) -> Result<T, E>
            + AsyncFnOnce2<&'c mut C, Vec<R>, Result<T, E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        async move {
            let clause = self.clause(self.query.locked_table())?;
            let skip_locked = clause.skip_locked;
            let query = &self.query;
            // `f` runs once, after the locking read, which is all a moved row
            // can make run again (see `crate::transaction::locking_read`).
            let mut f = Some(f);
            let span = clause.span(|| query.table_name());
            let bound = self.lock.bound();
            let mut attempts = 0;
            let locked = async {
                loop {
                    let mut moved = false;
                    let (moved_read, f, span) = (&mut moved, &mut f, &span);
                    let clause = clause.clone();
                    let locked = locking_transaction(conn, bound, |conn| {
                        async move {
                            let rows = query.rows(conn, Some(clause)).await;
                            let rows = locking_read(rows, moved_read)?;
                            if skip_locked {
                                let all = query.rows(conn, None).await.map_err(Error::from)?;
                                none_left_out(&rows, &all)?;
                            }
                            span.record("rows", rows.len());
                            let f = f.take().expect("a lock's closure runs once");
                            f(conn, rows).await
                        }
                        .scope_boxed()
                    })
                    .await;
                    match locked {
                        Err(_) if moved && attempts < MOVED_ROW_RETRIES => {
                            attempts += 1;
                            trace::moved_row(attempts);
                        }
                        done => return done,
                    }
                }
            }
            .instrument(span.clone())
            .await;
            span.record("outcome", transaction_outcome(&locked));
            locked
        }
    }
}

/// A query the async [`with_lock`](LockDsl::with_lock) can lock rows of type `R`
/// of, on a diesel-async connection `C`: the async twin of [`crate::LockQuery`].
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be locked through `{Self}`",
    note = "the row type must name its table (`#[derive(Identifiable)]`) and be loadable from \
            the query; a boxed query cannot be cloned: wrap the code that builds it in \
            `diesel_claim::rebuild(|| …)`"
)]
pub trait LockQuery<'q, C, R> {
    /// The locking clause's `OF` table, where the backend has row locks.
    #[doc(hidden)]
    fn locked_table(&self) -> Result<Option<Arc<str>>, Error>;

    /// The locked table's name, unqualified, on every backend: for the
    /// lock's span.
    #[doc(hidden)]
    fn table_name(&self) -> String;

    /// The query's rows, locked by `lock`.
    #[doc(hidden)]
    fn rows(
        &self,
        conn: &mut C,
        lock: Option<LockClause>,
    ) -> impl Future<Output = diesel::QueryResult<Vec<R>>> + Send;
}

impl<'q, Q, C, R> LockQuery<'q, C, R> for Q
where
    Q: Reusable,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: HasTable + Send + 'static,
    <R::Table as diesel::QuerySource>::FromClause: QueryFragment<C::Backend>,
    Locked<Q::Query>: LoadQuery<'q, C, R> + 'q,
{
    fn locked_table(&self) -> Result<Option<Arc<str>>, Error> {
        lock_target::<_, C::Backend>(&R::table())
    }

    fn table_name(&self) -> String {
        // A label: a name that cannot be read (never seen) shows as empty.
        rendered::unqualified_table_name::<_, C::Backend>(&R::table()).unwrap_or_default()
    }

    fn rows(
        &self,
        conn: &mut C,
        lock: Option<LockClause>,
    ) -> impl Future<Output = diesel::QueryResult<Vec<R>>> + Send {
        let locked = Locked {
            query: self.query(),
            clause: lock,
        };
        diesel_async::RunQueryDsl::load(locked, conn)
    }
}
