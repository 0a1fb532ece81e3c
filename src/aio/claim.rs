//! Claiming on a diesel-async connection: the blocking claim's engine, driven
//! by futures.

use std::future::Future;
use std::hash::Hash;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;

use diesel::prelude::*;
use diesel::query_builder::Query;
use diesel_async::methods::LoadQuery;
use diesel_async::AsyncConnection;
use futures_util::future::{BoxFuture, FutureExt};
use scoped_futures::ScopedFutureExt;

use super::backend::AsyncBackend;
use super::closure::AsyncFnMut2;
use super::transaction::{locking_transaction, transaction_depth};
use super::Async;
use crate::claim::engine::{Claim, Step, Taking};
use crate::claim::query::ClaimStatements;
use crate::claim::{panicked, position_of, NextBatch};
use crate::locking::LockClause;
use crate::sql::{KeyRange, Locked, Position};
use crate::trace::{self, Instrument};
use crate::transaction::{locking_read, transaction_outcome, MOVED_ROW_RETRIES};
use crate::{ClaimBuilder, ClaimOutcome, ClaimReport, Error, ReplicaClaim, RowFailure};

/// Adds [`claim_each`](ClaimDsl::claim_each) to Diesel queries, for diesel-async
/// connections: the async twin of [`crate::ClaimDsl`].
pub trait ClaimDsl: Sized {
    /// Processes each row of this query at most once across every worker that
    /// claims from it, as [`crate::ClaimDsl::claim_each`] does, awaiting the
    /// future `f` returns for each row inside the row's transaction.
    ///
    /// `f` is an `async` closure, `async |conn, row| { … }`, as diesel-async's
    /// `transaction` takes: see [Closures](super#closures).
    fn claim_each<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        Self: ClaimQuery<'a, C, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, R) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, R, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.build_claim().each(conn, f)
    }

    /// Starts a claim with options; run it with
    /// [`ClaimBuilder::each`](ClaimBuilder#method.each-1).
    fn build_claim(self) -> ClaimBuilder<Self, Async> {
        ClaimBuilder::new(self)
    }
}

impl<Q: Query> ClaimDsl for Q {}

impl<F> ClaimDsl for crate::Rebuild<F> {}

impl<Q> ClaimBuilder<Q, Async> {
    /// Runs the claim, awaiting `f` for every claimed row: see
    /// [`crate::ClaimBuilder::each`] and [`ClaimDsl::claim_each`].
    pub fn each<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        Q: ClaimQuery<'a, C, R> + Send + Sync + 'a,
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

    /// Runs the claim, awaiting `f` once per claimed batch with its rows, in key
    /// order, inside the batch's transaction: see
    /// [`crate::ClaimBuilder::each_batch`].
    pub fn each_batch<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        Q: ClaimQuery<'a, C, R> + Send + Sync + 'a,
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

    /// Runs the claim as [`each`](ClaimBuilder#method.each-1) does, and returns
    /// everything it did: see [`crate::ClaimBuilder::each_outcome`].
    pub fn each_outcome<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = ClaimOutcome<Q::Key, E>> + Send + 'a
    where
        Q: ClaimQuery<'a, C, R> + Send + Sync + 'a,
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

    /// Runs the claim as [`each_batch`](ClaimBuilder#method.each_batch-1) does,
    /// and returns everything it did: see [`crate::ClaimBuilder::each_outcome`].
    pub fn each_batch_outcome<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = ClaimOutcome<Q::Key, E>> + Send + 'a
    where
        Q: ClaimQuery<'a, C, R> + Send + Sync + 'a,
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
        Q: ClaimQuery<'a, C, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        H: Handler<C, R, E> + 'a,
        E: From<Error> + Send + 'a,
    {
        async move {
            let mut handler = handler;
            self.once(conn, &mut handler).await
        }
    }

    /// One run of the claim, handing the rows to `handler`.
    pub(super) async fn once<'a, C, R, E, H>(
        &self,
        conn: &mut C,
        handler: &mut H,
    ) -> ClaimOutcome<Q::Key, E>
    where
        Q: ClaimQuery<'a, C, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        H: Handler<C, R, E> + 'a,
        E: From<Error> + Send + 'a,
    {
        let claim = transaction_depth(conn)
            .and_then(|depth| self.start::<C::Backend, R, _>(Taking::Select, &self.query, depth));
        match claim {
            Ok(claim) => {
                let select = Select(&self.query, PhantomData);
                drive(claim, &self.query, &select, conn, None::<&mut C>, handler).await
            }
            Err(error) => ClaimOutcome::refused(error.into()),
        }
    }
}

impl<'r, Q, Rc> ReplicaClaim<'r, Q, Rc, Async> {
    /// Runs the claim on `conn`, awaiting `f` for every claimed row, with the
    /// candidates read on the replica: see
    /// [`ClaimBuilder::candidates_from`](crate::ClaimBuilder::candidates_from).
    pub fn each<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        'r: 'a,
        Q: ClaimQuery<'a, C, R> + ClaimQuery<'a, Rc, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        Rc: AsyncConnection<Backend = C::Backend>,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, R) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, R, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run(conn, EachRow(f)).map(ClaimOutcome::into_result)
    }

    /// Runs the claim on `conn`, awaiting `f` once per claimed batch, with the
    /// candidates read on the replica.
    pub fn each_batch<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        'r: 'a,
        Q: ClaimQuery<'a, C, R> + ClaimQuery<'a, Rc, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        Rc: AsyncConnection<Backend = C::Backend>,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, Vec<R>) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, Vec<R>, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run(conn, EachBatch(f)).map(ClaimOutcome::into_result)
    }

    /// Runs the claim as [`each`](ReplicaClaim#method.each-1) does, and
    /// returns everything it did: see [`crate::ClaimBuilder::each_outcome`].
    pub fn each_outcome<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = ClaimOutcome<<Q as ClaimStatements<C::Backend, R>>::Key, E>> + Send + 'a
    where
        'r: 'a,
        Q: ClaimQuery<'a, C, R> + ClaimQuery<'a, Rc, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        Rc: AsyncConnection<Backend = C::Backend>,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, R) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, R, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run(conn, EachRow(f))
    }

    /// Runs the claim as [`each_batch`](ReplicaClaim#method.each_batch-1)
    /// does, and returns everything it did.
    pub fn each_batch_outcome<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = ClaimOutcome<<Q as ClaimStatements<C::Backend, R>>::Key, E>> + Send + 'a
    where
        'r: 'a,
        Q: ClaimQuery<'a, C, R> + ClaimQuery<'a, Rc, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        Rc: AsyncConnection<Backend = C::Backend>,
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
        mut handler: H,
    ) -> impl Future<Output = ClaimOutcome<<Q as ClaimStatements<C::Backend, R>>::Key, E>> + Send + 'a
    where
        'r: 'a,
        Q: ClaimQuery<'a, C, R> + ClaimQuery<'a, Rc, R> + Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        Rc: AsyncConnection<Backend = C::Backend>,
        R: Send + 'a,
        H: Handler<C, R, E> + 'a,
        E: From<Error> + Send + 'a,
    {
        async move {
            let ReplicaClaim { claim, replica } = self;
            let query = &claim.query;
            let started = transaction_depth(conn)
                .and_then(|depth| claim.start::<C::Backend, R, _>(Taking::Select, query, depth));
            match started {
                Ok(run) => {
                    let select = Select(query, PhantomData);
                    drive(run, query, &select, conn, Some(replica), &mut handler).await
                }
                Err(error) => ClaimOutcome::refused(error.into()),
            }
        }
    }
}

/// What a claim does with the rows of a batch, in the batch's transaction.
pub(super) trait Handler<C, R, E>: Send {
    fn handle<'c>(&'c mut self, conn: &'c mut C, rows: Vec<R>) -> BoxFuture<'c, Result<(), E>>
    where
        R: 'c;
}

/// Calls the closure for each row of the batch, in order.
pub(super) struct EachRow<F>(pub(super) F);

/// Calls the closure once with the whole batch.
pub(super) struct EachBatch<F>(pub(super) F);

impl<C, R, E, F> Handler<C, R, E> for EachRow<F>
where
    C: Send,
    R: Send,
    E: Send,
    for<'c> F: AsyncFnMut(&'c mut C, R) -> Result<(), E>
        + AsyncFnMut2<&'c mut C, R, Result<(), E>, Fut: Send>
        + Send,
{
    fn handle<'c>(&'c mut self, conn: &'c mut C, rows: Vec<R>) -> BoxFuture<'c, Result<(), E>>
    where
        R: 'c,
    {
        Box::pin(async move {
            for row in rows {
                (self.0)(&mut *conn, row).await?;
            }
            Ok(())
        })
    }
}

impl<C, R, E, F> Handler<C, R, E> for EachBatch<F>
where
    C: Send,
    R: Send,
    E: Send,
    for<'c> F: AsyncFnMut(&'c mut C, Vec<R>) -> Result<(), E>
        + AsyncFnMut2<&'c mut C, Vec<R>, Result<(), E>, Fut: Send>
        + Send,
{
    fn handle<'c>(&'c mut self, conn: &'c mut C, rows: Vec<R>) -> BoxFuture<'c, Result<(), E>>
    where
        R: 'c,
    {
        Box::pin(async move { (self.0)(conn, rows).await })
    }
}

/// Runs a claim on an async connection: the blocking driver's steps, awaited;
/// the candidates read on `replica` when there is one.
pub(super) async fn drive<'a, Q, T, C, Rc, R, K, E, H>(
    mut claim: Claim<Position<K>>,
    query: &Q,
    taker: &T,
    conn: &mut C,
    replica: Option<&mut Rc>,
    handler: &mut H,
) -> ClaimOutcome<K, E>
where
    Q: ClaimQuery<'a, C, R, Key = K> + ClaimQuery<'a, Rc, R, Key = K> + Sync,
    T: TakeRows<C, R, K>,
    K: Clone + Eq + Hash + Send + Sync,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    Rc: AsyncConnection<Backend = C::Backend>,
    R: Send,
    H: Handler<C, R, E>,
    E: From<Error> + Send,
{
    let span = claim.span::<Q, C::Backend, R>();
    let mut failed = Vec::new();
    let steps = run_steps(
        &mut claim,
        query,
        taker,
        conn,
        replica,
        handler,
        &mut failed,
    );
    let stopped = steps.instrument(span.clone()).await.err();
    ClaimOutcome::ended(claim.report(), failed, stopped, &span)
}

/// The loop of [`drive`], as in the blocking driver.
#[allow(clippy::too_many_arguments)]
async fn run_steps<'a, Q, T, C, Rc, R, K, E, H>(
    claim: &mut Claim<Position<K>>,
    query: &Q,
    taker: &T,
    conn: &mut C,
    mut replica: Option<&mut Rc>,
    handler: &mut H,
    failed: &mut Vec<RowFailure<K, E>>,
) -> Result<(), RowFailure<K, E>>
where
    Q: ClaimQuery<'a, C, R, Key = K> + ClaimQuery<'a, Rc, R, Key = K> + Sync,
    T: TakeRows<C, R, K>,
    K: Clone + Eq + Hash + Send + Sync,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    Rc: AsyncConnection<Backend = C::Backend>,
    R: Send,
    H: Handler<C, R, E>,
    E: From<Error> + Send,
{
    let outside = |error| RowFailure::new(Vec::new(), E::from(error));
    while let Some((range, limit)) = next_batch(claim, query, conn, replica.as_deref_mut())
        .await
        .map_err(outside)?
    {
        let mut failing = None;
        let batch = if claim.taking == Taking::MarkAndCommit {
            let rows = take_and_commit(claim, taker, conn, range, limit, position_of::<Q, _, _>)
                .await
                .map_err(outside)?;
            let processed = rows.len();
            if processed > 0 {
                let keys = rows.iter().map(Q::key).collect();
                let handled = call(handler.handle(conn, rows), claim.keep_going).await;
                handled.inspect_err(|_| failing = Some(keys))
            } else {
                Ok(())
            }
            .map(|()| processed)
        } else {
            let batch = Take::Batch(range, limit);
            take(claim, query, taker, conn, handler, batch, &mut failing).await
        };
        match (batch, failing) {
            (Ok(processed), _) => claim.processed(processed),
            (Err(error), Some(keys)) if claim.keep_going => {
                if keys.len() > 1 && claim.taking != Taking::MarkAndCommit {
                    // Which row failed is unknown: each is claimed again alone.
                    for key in keys {
                        let Some(range) = claim.only(&Position::of_key(key.clone())) else {
                            claim.left_pending();
                            continue;
                        };
                        let mut failing = None;
                        let retry = Take::Alone(range);
                        let retried =
                            take(claim, query, taker, conn, handler, retry, &mut failing).await;
                        match (retried, failing) {
                            (Ok(0), _) => claim.gone(),
                            (Ok(processed), _) => claim.processed(processed),
                            (Err(error), Some(_)) => {
                                claim.failed(1);
                                failed.push(RowFailure::new(vec![key], error));
                            }
                            (Err(error), None) => return Err(RowFailure::new(Vec::new(), error)),
                        }
                    }
                } else {
                    claim.failed(keys.len());
                    failed.push(RowFailure::new(keys, error));
                }
            }
            (Err(error), keys) => return Err(RowFailure::new(keys.unwrap_or_default(), error)),
        }
    }
    Ok(())
}

/// Reads candidates until the claim's next batch is known, as the blocking
/// `next_batch` does: its range and limit, or `None` once the claim is done.
/// The candidates are read on `replica` when there is one; what still matches
/// of a page, on `conn`, as it must be exact.
pub(super) async fn next_batch<'a, Q, C, Rc, R, K>(
    claim: &mut Claim<Position<K>>,
    query: &Q,
    conn: &mut C,
    mut replica: Option<&mut Rc>,
) -> Result<Option<NextBatch<K>>, Error>
where
    Q: ClaimQuery<'a, C, R, Key = K> + ClaimQuery<'a, Rc, R, Key = K> + Sync,
    K: Clone + Eq + Hash + Send + Sync,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    Rc: AsyncConnection<Backend = C::Backend>,
{
    loop {
        match claim.next() {
            Step::Candidates(range, limit) => {
                let keys = match replica.as_deref_mut() {
                    Some(replica) => {
                        ClaimQuery::<'a, Rc, R>::keys(query, replica, range, limit).await
                    }
                    None => ClaimQuery::<'a, C, R>::keys(query, conn, range, limit).await,
                };
                claim.candidates(keys?);
            }
            Step::StillMatching(range) => {
                let keys = ClaimQuery::<'a, C, R>::keys(query, conn, range, i64::MAX).await;
                claim.still_matching(keys?);
            }
            Step::Batch(range, limit) => return Ok(Some((range, limit))),
            Step::Done => return Ok(None),
        }
    }
}

/// What [`take`] claims.
enum Take<K> {
    /// The claim's next batch: up to `limit` rows of the range.
    Batch(KeyRange<K>, i64),
    /// A row of a failed batch, again, alone (its range holds only it).
    Alone(KeyRange<K>),
}

/// Claims rows in a transaction of their own and hands them to the handler; a
/// take that meets a row moved to another partition runs again (see
/// `crate::transaction::locking_read`). If the handler fails, `failing` holds
/// the keys of the rows it was given.
async fn take<'a, Q, T, C, R, K, E, H>(
    claim: &mut Claim<Position<K>>,
    query: &Q,
    taker: &T,
    conn: &mut C,
    handler: &mut H,
    take: Take<Position<K>>,
    failing: &mut Option<Vec<K>>,
) -> Result<usize, E>
where
    Q: ClaimQuery<'a, C, R, Key = K> + Sync,
    T: TakeRows<C, R, K>,
    K: Clone + Eq + Hash + Send + Sync,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: Send,
    H: Handler<C, R, E>,
    E: From<Error> + Send,
{
    let catch_panics = claim.keep_going;
    let (range, limit, alone) = match take {
        Take::Batch(range, limit) => (range, limit, false),
        Take::Alone(range) => (range, 1, true),
    };
    let span = trace::debug_span!("batch", limit, taken = trace::Empty, outcome = trace::Empty);
    let mut attempts = 0;
    let taken = async {
        loop {
            let mut moved = false;
            *failing = None;
            let (moved_read, range, failing) = (&mut moved, range.clone(), &mut *failing);
            let (taking, handler, span) = (&mut *claim, &mut *handler, &span);
            let batch = locking_transaction(conn, |conn| {
                async move {
                    let rows = taker
                        .take_rows(conn, range.clone(), limit, &taking.clause)
                        .await;
                    let mut rows = locking_read(rows, moved_read)?;
                    if !alone {
                        rows = taking.taken(rows, limit, position_of::<Q, _, _>)?;
                    }
                    span.record("taken", rows.len());
                    if let Some(range) = taking.locked_check(range).filter(|_| !alone) {
                        let keys = query
                            .keys(conn, range, i64::MAX)
                            .await
                            .map_err(Error::from)?;
                        taking.verify_none_locked(keys, &rows, position_of::<Q, _, _>)?;
                    }
                    let processed = rows.len();
                    if processed > 0 {
                        let keys = rows.iter().map(Q::key).collect();
                        let handled = call(handler.handle(conn, rows), catch_panics).await;
                        handled.inspect_err(|_| *failing = Some(keys))?;
                    }
                    Ok::<_, E>(processed)
                }
                .scope_boxed()
            })
            .await;
            match batch {
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
    span.record("outcome", transaction_outcome(&taken));
    taken
}

/// How a batch's rows are taken: selected under the claim's lock, marked, or
/// stamped.
pub(super) trait TakeRows<C, R, K>: Sync {
    fn take_rows<'c>(
        &'c self,
        conn: &'c mut C,
        range: KeyRange<Position<K>>,
        limit: i64,
        lock: &'c LockClause,
    ) -> BoxFuture<'c, QueryResult<Vec<R>>>
    where
        R: 'c,
        K: 'c;
}

/// The query's rows, selected under the claim's lock. (`'a` is the query's:
/// the future holds it.)
pub(super) struct Select<'q, 'a, Q>(pub(super) &'q Q, pub(super) PhantomData<&'a ()>);

impl<'a, Q, C, R> TakeRows<C, R, Q::Key> for Select<'_, 'a, Q>
where
    Q: ClaimQuery<'a, C, R> + Sync,
    C: AsyncConnection,
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
        Box::pin(self.0.rows(conn, range, limit, lock))
    }
}

/// Takes a batch with a statement that commits before any closure runs (or
/// with MySQL's three statements, in a transaction of their own): a mark that
/// is committed, or a visibility-timeout stamp; the blocking
/// `take_and_commit`, awaited. A take that meets a row moved to another
/// partition runs again (see `crate::transaction::locking_read`).
pub(super) async fn take_and_commit<T, C, R, K>(
    claim: &mut Claim<Position<K>>,
    taker: &T,
    conn: &mut C,
    range: KeyRange<Position<K>>,
    limit: i64,
    position_of: impl Fn(&R) -> Position<K>,
) -> Result<Vec<R>, Error>
where
    T: TakeRows<C, R, K>,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: Send,
    K: Clone + Eq + Hash + Send + Sync,
{
    let span = trace::debug_span!("batch", limit, taken = trace::Empty, outcome = trace::Empty);
    let mut attempts = 0;
    let rows = loop {
        let mut moved = false;
        let (range, clause) = (range.clone(), &claim.clause);
        let taken = if claim.one_statement_mark {
            let rows = taker
                .take_rows(conn, range, limit, clause)
                .instrument(span.clone());
            locking_read(rows.await, &mut moved)
        } else {
            let moved = &mut moved;
            locking_transaction(conn, |conn| {
                async move { locking_read(taker.take_rows(conn, range, limit, clause).await, moved) }
                    .scope_boxed()
            })
            .instrument(span.clone())
            .await
        };
        match taken {
            Err(_) if moved && attempts < MOVED_ROW_RETRIES => {
                attempts += 1;
                trace::moved_row(attempts);
            }
            done => break done?,
        }
    };
    // The rows are committed: the batch's span ends with them, before the
    // closure runs.
    span.record("taken", rows.len())
        .record("outcome", "committed");
    claim.taken(rows, limit, position_of)
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

/// Awaits a closure's future; with `catch_panics`, a panic in it becomes
/// [`Error::ClosurePanicked`] (the blocking `call`, awaited).
pub(super) async fn call<E: From<Error>>(
    f: impl Future<Output = Result<(), E>>,
    catch_panics: bool,
) -> Result<(), E> {
    if !catch_panics {
        return f.await;
    }
    AssertUnwindSafe(f)
        .catch_unwind()
        .await
        .unwrap_or_else(|payload| Err(panicked(&*payload)))
}

/// A query the async [`claim_each`](ClaimDsl::claim_each) can claim rows of type
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
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    Q: ClaimStatements<C::Backend, R>,
    Q::Keys: LoadQuery<'q, C, Q::Loaded> + 'q,
    Q::Loaded: Send + 'static,
    Locked<Q::Rows>: LoadQuery<'q, C, R> + 'q,
    Q::Key: Send + Sync + 'static,
    R: Send + 'static,
{
    fn keys(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
    ) -> impl Future<Output = QueryResult<Vec<Position<Q::Key>>>> + Send {
        let loading = diesel_async::RunQueryDsl::load(self.keys_query(range, limit), conn);
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
        diesel_async::RunQueryDsl::load(self.rows_query(range, limit, lock), conn)
    }
}
