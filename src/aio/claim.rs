//! Claiming on a diesel-async connection: the methods every kind of claim
//! runs through, as futures, on the blocking claim's engine and statements.

use std::future::Future;
use std::time::{Duration, Instant};

use diesel::query_builder::Query;
use diesel_async::AsyncConnection;
use futures_util::future::{BoxFuture, FutureExt};

use super::backend::AsyncBackend;
use super::closure::AsyncFnMut2;
use super::drive::Driver;
use super::kind::{FailureHook, Takes};
use super::query::ClaimQuery;
use super::transaction::transaction_depth;
use super::unwind::catch_unwind;
use super::Async;
use crate::claim::run::panicked;
use crate::claim::worker::{LeftOut, PassedOver};
use crate::metrics::{ClaimMetrics, InWorker};
use crate::sql::Position;
use crate::trace::Instrument;
use crate::{ClaimBuilder, ClaimOutcome, ClaimReport, Error};

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

impl<Q, T, H> ClaimBuilder<Q, Async, T, H> {
    /// How long each of the claim's transactions may sit idle — its closure
    /// awaiting something other than the database, such as an HTTP call or a
    /// long computation — before the server ends its session:
    /// `Some(duration)`, by default
    /// [`IDLE_TRANSACTION_BOUND`](super::IDLE_TRANSACTION_BOUND) (30 s), or
    /// `None` for the session's own setting (on PostgreSQL and MariaDB, none
    /// unless configured). PostgreSQL counts it in milliseconds, MariaDB in
    /// whole seconds (rounded up); MySQL has no such setting.
    ///
    /// The bound is the backstop that frees the rows of a claim whose closure
    /// hangs, or whose future was dropped and its `ROLLBACK` could not leave
    /// (see the module documentation, "Dropped futures"); a dropped claim
    /// otherwise rolls back as it is dropped.
    ///
    /// **When it fires**, the server ends the session: the transaction rolls
    /// back and its row locks go **while the closure is still running**, so
    /// another worker may take the same rows and run them again. The call
    /// then fails with [`Error::IdleBoundExceeded`], which says how long the
    /// transaction was open. A job that may await longer than the bound
    /// inside its claim needs a larger bound, or `None`; or run it outside
    /// the transaction with a [visibility timeout](Self::visibility_timeout).
    ///
    /// ```no_run
    /// # include!("../doctest_setup_async.rs");
    /// # fn main() {}
    /// # #[cfg(feature = "postgres_backend")]
    /// # async fn run(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), MyError> {
    /// use std::time::Duration;
    /// use diesel::{ExpressionMethods, QueryDsl};
    /// use diesel_async::RunQueryDsl;
    /// use diesel_claim::aio::prelude::*;
    ///
    /// let pending = orders::table.filter(orders::shipped.eq(true)).filter(orders::email_sent.eq(false));
    /// pending
    ///     .build_claim()
    ///     // The mail server may take minutes to answer.
    ///     .idle_bound(Duration::from_secs(15 * 60))
    ///     .each(conn, async |conn: &mut diesel_async::AsyncPgConnection, order: Order| {
    ///         send_shipped_email(&order).await?;
    ///         diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn).await?;
    ///         Ok::<_, MyError>(())
    ///     })
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn idle_bound(mut self, bound: impl Into<Option<std::time::Duration>>) -> Self {
        self.options.lock.idle_bound(bound.into());
        self
    }

    /// Runs the claim, awaiting `f` for every claimed row: see
    /// [`crate::ClaimBuilder::each`] and [`ClaimDsl::claim_each`].
    pub fn each<'a, C, I, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        Q: Send + Sync + 'a,
        T: Takes<'a, Q, C, I> + 'a,
        H: FailureHook<C, I, T::Row, E> + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        I: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, I) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, I, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.each_outcome(conn, f).map(ClaimOutcome::into_result)
    }

    /// Runs the claim, awaiting `f` once per claimed batch with its rows:
    /// see [`crate::ClaimBuilder::each_batch`].
    pub fn each_batch<'a, C, I, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        Q: Send + Sync + 'a,
        T: Takes<'a, Q, C, I> + 'a,
        H: FailureHook<C, I, T::Row, E> + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        I: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, Vec<I>) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, Vec<I>, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.each_batch_outcome(conn, f)
            .map(ClaimOutcome::into_result)
    }

    /// Runs the claim as [`each`](ClaimBuilder#method.each-1) does, and returns
    /// everything it did: see [`crate::ClaimBuilder::each_outcome`].
    pub fn each_outcome<'a, C, I, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = ClaimOutcome<T::Key, E>> + Send + 'a
    where
        Q: Send + Sync + 'a,
        T: Takes<'a, Q, C, I> + 'a,
        H: FailureHook<C, I, T::Row, E> + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        I: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, I) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, I, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        async move {
            let mut claim = self;
            claim
                .run_once(conn, &mut PerRow(f), LeftOut::nothing())
                .await
        }
    }

    /// Runs the claim as [`each_batch`](ClaimBuilder#method.each_batch-1) does,
    /// and returns everything it did: see [`crate::ClaimBuilder::each_outcome`].
    pub fn each_batch_outcome<'a, C, I, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = ClaimOutcome<T::Key, E>> + Send + 'a
    where
        Q: Send + Sync + 'a,
        T: Takes<'a, Q, C, I> + 'a,
        H: FailureHook<C, I, T::Row, E> + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        I: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, Vec<I>) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, Vec<I>, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        async move {
            let mut claim = self;
            claim
                .run_once(conn, &mut PerBatch(f), LeftOut::nothing())
                .await
        }
    }

    /// One run of the claim, leaving out a worker's rows (see [`LeftOut`]).
    pub(super) async fn run_once<'a, C, I, E, F>(
        &mut self,
        conn: &mut C,
        f: &mut F,
        left_out: LeftOut<'_, T::Key, E>,
    ) -> ClaimOutcome<T::Key, E>
    where
        Q: Sync,
        T: Takes<'a, Q, C, I>,
        H: FailureHook<C, I, T::Row, E>,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        I: Send,
        F: Closure<C, I, E>,
        E: From<Error> + Send,
    {
        let started = transaction_depth(conn)
            .and_then(|depth| self.kind.start(&self.query, &self.options, depth));
        let mut claim = match started {
            Ok(claim) => claim,
            Err(error) => return ClaimOutcome::refused(error.into()),
        };
        if let Some(backoff) = &left_out.backoff {
            claim.exclude(backoff.excluded().into_iter().map(Position::of_key));
        }
        if let Some(sibling) = left_out.sibling {
            claim.beside(sibling);
        }
        if let Some(keys) = left_out.only {
            claim.among(keys.into_iter().map(Position::of_key).collect());
        }
        let table = T::table_name();
        let span = claim.span(&table);
        let worker = claim.in_worker().then(|| self.options.worker_name(&table));
        let began = Instant::now();
        let metrics = ClaimMetrics::new(&table, worker.as_deref());
        let in_worker = InWorker::new(worker.as_deref());
        let mut driver = Driver {
            claim: &mut claim,
            query: &self.query,
            kind: &mut self.kind,
            hook: &mut self.hook,
            options: &self.options,
            failed: PassedOver::new(left_out.tell),
            transient: false,
            backoff: left_out.backoff.as_deref(),
            metrics,
            table,
            worker,
        };
        let run = driver.run(conn, f).instrument(span.clone());
        let stopped = in_worker.around_polls(run).await.err();
        let (failed, transient, mut metrics) =
            (driver.failed.failures, driver.transient, driver.metrics);
        let report = claim.report();
        metrics.claim_ended(began, report.counts(), claim.in_worker());
        ClaimOutcome::ended(report, failed, stopped, transient, &span)
    }
}

/// A claim's closure, as the async driver calls it: with each row, or with
/// each batch (the blocking `Closure`'s twin).
pub(super) trait Closure<C, I, E>: Send {
    /// The closure takes one row at a time.
    const PER_ROW: bool;

    /// Awaits the closure for `items`, in order: once per row, or once.
    fn call<'c>(&'c mut self, conn: &'c mut C, items: Vec<I>) -> BoxFuture<'c, Result<(), E>>
    where
        I: 'c;
}

/// A closure awaited for each row.
pub(super) struct PerRow<F>(pub(super) F);

/// A closure awaited for each batch.
pub(super) struct PerBatch<F>(pub(super) F);

impl<C, I, E, F> Closure<C, I, E> for PerRow<F>
where
    C: Send,
    I: Send,
    E: Send,
    for<'c> F: AsyncFnMut(&'c mut C, I) -> Result<(), E>
        + AsyncFnMut2<&'c mut C, I, Result<(), E>, Fut: Send>
        + Send,
{
    const PER_ROW: bool = true;

    fn call<'c>(&'c mut self, conn: &'c mut C, items: Vec<I>) -> BoxFuture<'c, Result<(), E>>
    where
        I: 'c,
    {
        Box::pin(async move {
            for item in items {
                (self.0)(&mut *conn, item).await?;
            }
            Ok(())
        })
    }
}

impl<C, I, E, F> Closure<C, I, E> for PerBatch<F>
where
    C: Send,
    I: Send,
    E: Send,
    for<'c> F: AsyncFnMut(&'c mut C, Vec<I>) -> Result<(), E>
        + AsyncFnMut2<&'c mut C, Vec<I>, Result<(), E>, Fut: Send>
        + Send,
{
    const PER_ROW: bool = false;

    fn call<'c>(&'c mut self, conn: &'c mut C, items: Vec<I>) -> BoxFuture<'c, Result<(), E>>
    where
        I: 'c,
    {
        Box::pin(async move { (self.0)(conn, items).await })
    }
}

/// Awaits a closure's `call` under the claim's `timeout`: at the timeout its
/// future is dropped, wherever it awaits, the call failed with
/// [`Error::TimedOut`], and it is told of with `told`. The error says
/// whether the call ran late.
pub(super) async fn within<E: From<Error>>(
    timeout: Option<Duration>,
    told: impl FnOnce(Duration),
    call: impl Future<Output = Result<(), E>>,
) -> Result<(), (E, bool)> {
    let Some(timeout) = timeout else {
        return call.await.map_err(|error| (error, false));
    };
    match tokio::time::timeout(timeout, call).await {
        Ok(called) => called.map_err(|error| (error, false)),
        Err(_) => {
            told(timeout);
            Err((Error::TimedOut { timeout }.into(), true))
        }
    }
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
    catch_unwind(f)
        .await
        .unwrap_or_else(|payload| Err(panicked(&*payload)))
}
