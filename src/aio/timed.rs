//! Visibility-timeout claims on a diesel-async connection: the blocking
//! [`TimedClaim`]'s twin, on the same statements and the same engine.

use std::future::Future;
use std::marker::PhantomData;

use diesel::associations::HasTable;
use diesel::deserialize::FromSql;
use diesel::dsl;
use diesel::prelude::*;
use diesel::query_builder::QueryFragment;
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, HasSqlType};
use diesel_async::methods::{ExecuteDsl, LoadQuery};
use diesel_async::{AsyncConnection, RunQueryDsl};
use futures_util::future::{BoxFuture, FutureExt};
use scoped_futures::ScopedFutureExt;

use super::backend::AsyncBackend;
use super::claim::{call, lock_keys, next_batch, take_and_commit, ClaimQuery, TakeRows};
use super::closure::AsyncFnMut2;
use super::transaction::{locking_transaction, transaction_depth};
use super::worker::{ClaimOnce, ClaimRows, WaitForRows};
use super::Async;
use crate::backend::strategy::Strategy;
use crate::claim::engine::{Claim, Taking};
use crate::claim::query::{
    read_by_keys, taken_in_one, update_by_keys, FromClause, ReadStampedByKeys, StampByKeys,
    StampStatement,
};
use crate::claim::timed::{final_changes, Handed, Unclaimed};
use crate::claim::ClaimStatements;
use crate::locking::LockClause;
use crate::sql::stamp::{CountRows, NewStamp, StampMicros, StampType, ThenUnstamp};
use crate::sql::{IdShape, KeyColumns, KeyRange, KeyShape, Position, Returning};
use crate::sql::{SelectWhere, Update};
use crate::trace::Instrument;
use crate::{ClaimOutcome, ClaimReport, Claimed, Error, RowFailure, TimedClaim, TimedWorker};

/// The key of the rows `R` of the claimed query `Q`, on the connection `C`.
type KeyOf<Q, C, R> =
    <Q as ClaimStatements<<C as diesel_async::AsyncConnectionCore>::Backend, R>>::Key;

impl<Q, Col: Copy> TimedClaim<Q, Col, Async> {
    /// Runs the claim, awaiting `f` for every claimed row, outside any
    /// transaction: see the blocking [`TimedClaim::each`].
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres_backend")]
    /// # mod shop {
    /// use std::time::Duration;
    /// use diesel::prelude::*;
    /// use diesel_async::AsyncPgConnection;
    /// use diesel_claim::aio::{prelude::*, Async};
    /// use diesel_claim::Claimed;
    ///
    /// diesel::table! {
    ///     invoices (id) {
    ///         id -> Integer,
    ///         sent -> Bool,
    ///         claimed_until -> Nullable<Timestamptz>,
    ///     }
    /// }
    ///
    /// #[derive(Queryable, Selectable, Identifiable)]
    /// struct Invoice {
    ///     id: i32,
    ///     sent: bool,
    /// }
    ///
    /// async fn mail(_: &Invoice) -> Result<(), diesel_claim::Error> {
    ///     Ok(())
    /// }
    ///
    /// async fn send_invoices(conn: &mut AsyncPgConnection) -> Result<u64, diesel_claim::Error> {
    ///     let unsent = invoices::table.filter(invoices::sent.eq(false)).select(Invoice::as_select());
    ///     let report = unsent
    ///         .build_claim()
    ///         .visibility_timeout(invoices::claimed_until, Duration::from_secs(300))
    ///         .each(conn, async |conn, invoice: Claimed<Invoice, _, Async>| {
    ///             mail(&invoice).await?; // no transaction, no lock
    ///             invoice.finish(conn, invoices::sent.eq(true)).await
    ///         })
    ///         .await?;
    ///     Ok(report.processed)
    /// }
    /// # }
    /// ```
    pub fn each<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        Unclaimed<Q, Col>: StampQuery<'a, C, R, Col> + Send + Sync + 'a,
        Col: Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, Claimed<R, Col, Async>) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, Claimed<R, Col, Async>, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run(conn, EachClaim(f)).map(ClaimOutcome::into_result)
    }

    /// Runs the claim, awaiting `f` once per claimed batch with its rows, in
    /// the claim order, outside any transaction: see the blocking
    /// [`TimedClaim::each_batch`].
    pub fn each_batch<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        Unclaimed<Q, Col>: StampQuery<'a, C, R, Col> + Send + Sync + 'a,
        Col: Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, Vec<Claimed<R, Col, Async>>) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, Vec<Claimed<R, Col, Async>>, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run(conn, EachClaimBatch(f))
            .map(ClaimOutcome::into_result)
    }

    /// Runs the claim as [`each`](TimedClaim#method.each-1) does, and returns
    /// everything it did: see [`crate::ClaimBuilder::each_outcome`].
    pub fn each_outcome<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = ClaimOutcome<KeyOf<Unclaimed<Q, Col>, C, R>, E>> + Send + 'a
    where
        Unclaimed<Q, Col>: StampQuery<'a, C, R, Col> + Send + Sync + 'a,
        Col: Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, Claimed<R, Col, Async>) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, Claimed<R, Col, Async>, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run(conn, EachClaim(f))
    }

    /// Runs the claim as [`each_batch`](TimedClaim#method.each_batch-1) does,
    /// and returns everything it did: see
    /// [`crate::ClaimBuilder::each_outcome`].
    pub fn each_batch_outcome<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = ClaimOutcome<KeyOf<Unclaimed<Q, Col>, C, R>, E>> + Send + 'a
    where
        Unclaimed<Q, Col>: StampQuery<'a, C, R, Col> + Send + Sync + 'a,
        Col: Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, Vec<Claimed<R, Col, Async>>) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, Vec<Claimed<R, Col, Async>>, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        self.run(conn, EachClaimBatch(f))
    }

    fn run<'a, C, R, E, H>(
        self,
        conn: &'a mut C,
        hand: H,
    ) -> impl Future<Output = ClaimOutcome<KeyOf<Unclaimed<Q, Col>, C, R>, E>> + Send + 'a
    where
        Unclaimed<Q, Col>: StampQuery<'a, C, R, Col> + Send + Sync + 'a,
        Col: Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        H: HandClaims<C, R, Col, KeyOf<Unclaimed<Q, Col>, C, R>, E> + 'a,
        E: From<Error> + Send + 'a,
    {
        async move {
            let mut hand = hand;
            self.once(conn, &mut hand).await
        }
    }

    /// One run of the claim: each batch stamped and committed, then handed
    /// to `hand`.
    async fn once<'a, C, R, E, H>(
        &self,
        conn: &mut C,
        hand: &mut H,
    ) -> ClaimOutcome<KeyOf<Unclaimed<Q, Col>, C, R>, E>
    where
        Unclaimed<Q, Col>: StampQuery<'a, C, R, Col> + Send + Sync + 'a,
        Col: Send + Sync + 'a,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        H: HandClaims<C, R, Col, KeyOf<Unclaimed<Q, Col>, C, R>, E> + 'a,
        E: From<Error> + Send + 'a,
    {
        let TimedClaim { claim, stamp } = self;
        let query = &claim.query;
        let started = transaction_depth(conn)
            .and_then(|depth| claim.start::<C::Backend, R, _>(Taking::MarkAndCommit, query, depth));
        let mut run = match started {
            Ok(run) => run,
            Err(error) => return ClaimOutcome::refused(error.into()),
        };
        let span = run.span::<Unclaimed<Q, Col>, C::Backend, R>();
        let mut failed = Vec::new();
        let stopped = drive(&mut run, query, conn, stamp, hand, &mut failed)
            .instrument(span.clone())
            .await
            .err();
        ClaimOutcome::ended(run.report(), failed, stopped, &span)
    }
}

impl<Q, Col: Copy> TimedWorker<Q, Col, Async> {
    /// Runs the worker until stopped, awaiting `f` for every claimed row as
    /// [`TimedClaim::each`](TimedClaim#method.each-1) does: see the blocking
    /// [`TimedWorker::run`] and the async
    /// [`ClaimWorker::run`](crate::ClaimWorker#method.run-1).
    pub fn run<'a, C, R, E, F>(
        self,
        conn: &'a mut C,
        f: F,
    ) -> impl Future<Output = Result<ClaimReport, E>> + Send + 'a
    where
        Q: 'a,
        Unclaimed<Q, Col>: StampQuery<'a, C, R, Col> + Send + Sync + 'a,
        Col: Send + Sync + 'a,
        C: WaitForRows,
        C::Backend: AsyncBackend,
        R: Send + 'a,
        for<'c> F: AsyncFnMut(&'c mut C, Claimed<R, Col, Async>) -> Result<(), E>
            + AsyncFnMut2<&'c mut C, Claimed<R, Col, Async>, Result<(), E>, Fut: Send>
            + Send
            + 'a,
        E: From<Error> + Send + 'a,
    {
        async move {
            let mut once = ClaimRows {
                claim: &self.claim,
                handler: EachClaim(f),
                types: PhantomData,
            };
            self.polling.serve(conn, &mut once).await
        }
    }
}

impl<'a, Q, Col, C, R, E, H> ClaimOnce<C> for ClaimRows<'_, 'a, TimedClaim<Q, Col, Async>, H, R, E>
where
    Unclaimed<Q, Col>: StampQuery<'a, C, R, Col> + Send + Sync + 'a,
    Col: Copy + Send + Sync + 'a,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: Send + 'a,
    H: HandClaims<C, R, Col, KeyOf<Unclaimed<Q, Col>, C, R>, E> + 'a,
    E: From<Error> + Send + 'a,
{
    type Key = KeyOf<Unclaimed<Q, Col>, C, R>;
    type Error = E;

    fn claim_once<'c>(&'c mut self, conn: &'c mut C) -> BoxFuture<'c, ClaimOutcome<Self::Key, E>> {
        Box::pin(self.claim.once(conn, &mut self.handler))
    }
}

/// What a timed claim hands its batches to: it awaits the closure on the
/// claims, given how to read a row's key, and says what came of it.
pub(super) trait HandClaims<C, R, Col, K, E>: Send {
    fn hand<'c>(
        &'c mut self,
        conn: &'c mut C,
        rows: Vec<Claimed<R, Col, Async>>,
        key_of: fn(&R) -> K,
        keep_going: bool,
    ) -> BoxFuture<'c, Handed<K, E>>
    where
        R: 'c,
        Col: 'c,
        K: 'c,
        E: 'c;
}

/// Awaits the closure for each claim of the batch, in order.
struct EachClaim<F>(F);

/// Awaits the closure once with the whole batch.
struct EachClaimBatch<F>(F);

impl<C, R, Col, K, E, F> HandClaims<C, R, Col, K, E> for EachClaim<F>
where
    C: Send,
    R: Send,
    Col: Send,
    K: Send,
    E: From<Error> + Send,
    for<'c> F: AsyncFnMut(&'c mut C, Claimed<R, Col, Async>) -> Result<(), E>
        + AsyncFnMut2<&'c mut C, Claimed<R, Col, Async>, Result<(), E>, Fut: Send>
        + Send,
{
    fn hand<'c>(
        &'c mut self,
        conn: &'c mut C,
        rows: Vec<Claimed<R, Col, Async>>,
        key_of: fn(&R) -> K,
        keep_going: bool,
    ) -> BoxFuture<'c, Handed<K, E>>
    where
        R: 'c,
        Col: 'c,
        K: 'c,
        E: 'c,
    {
        Box::pin(async move {
            let mut handed = Handed::default();
            for row in rows {
                let key = key_of(&row.row);
                // Called inside the caught future: a panic before the
                // closure's own future is caught too.
                let done = call(async { (self.0)(&mut *conn, row).await }, keep_going).await;
                if !handed.record(vec![key], done, keep_going) {
                    break;
                }
            }
            handed
        })
    }
}

impl<C, R, Col, K, E, F> HandClaims<C, R, Col, K, E> for EachClaimBatch<F>
where
    C: Send,
    R: Send,
    Col: Send,
    K: Send,
    E: From<Error> + Send,
    for<'c> F: AsyncFnMut(&'c mut C, Vec<Claimed<R, Col, Async>>) -> Result<(), E>
        + AsyncFnMut2<&'c mut C, Vec<Claimed<R, Col, Async>>, Result<(), E>, Fut: Send>
        + Send,
{
    fn hand<'c>(
        &'c mut self,
        conn: &'c mut C,
        rows: Vec<Claimed<R, Col, Async>>,
        key_of: fn(&R) -> K,
        keep_going: bool,
    ) -> BoxFuture<'c, Handed<K, E>>
    where
        R: 'c,
        Col: 'c,
        K: 'c,
        E: 'c,
    {
        Box::pin(async move {
            let keys = rows.iter().map(|row| key_of(&row.row)).collect();
            let mut handed = Handed::default();
            let done = call(async { (self.0)(conn, rows).await }, keep_going).await;
            handed.record(keys, done, keep_going);
            handed
        })
    }
}

/// Runs a visibility-timeout claim's steps until it is done, as the blocking
/// driver does: each batch is stamped by a statement that commits on its
/// own, then handed over.
async fn drive<'a, Q, C, R, Col, E, H>(
    claim: &mut Claim<Position<Q::Key>>,
    query: &Q,
    conn: &mut C,
    stamp: &NewStamp<Col>,
    hand: &mut H,
    failed: &mut Vec<RowFailure<Q::Key, E>>,
) -> Result<(), RowFailure<Q::Key, E>>
where
    Q: StampQuery<'a, C, R, Col> + Sync,
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: Send,
    Col: Copy + Send + Sync,
    H: HandClaims<C, R, Col, Q::Key, E>,
    E: From<Error> + Send,
{
    let outside = |error| RowFailure::new(Vec::new(), E::from(error));
    while let Some((range, limit)) = next_batch(claim, query, conn, None::<&mut C>)
        .await
        .map_err(outside)?
    {
        let taker = Stamp(query, stamp, PhantomData);
        let position_of = |(row, _): &(R, i64)| Position::of_key(Q::key(row));
        let rows = take_and_commit(claim, &taker, conn, range, limit, position_of)
            .await
            .map_err(outside)?;
        if rows.is_empty() {
            continue;
        }
        let rows = rows
            .into_iter()
            .map(|(row, stamped)| Claimed::new(row, stamped, *stamp))
            .collect();
        let keep_going = claim.keep_going;
        let handed = hand.hand(conn, rows, Q::key, keep_going).await;
        handed.count(claim, failed)?;
    }
    Ok(())
}

/// The query's rows, stamped. (`'a` is the query's: the future holds it.)
struct Stamp<'q, 'a, Q, Col>(&'q Q, &'q NewStamp<Col>, PhantomData<&'a ()>);

impl<'a, Q, C, R, Col> TakeRows<C, (R, i64), Q::Key> for Stamp<'_, 'a, Q, Col>
where
    Q: StampQuery<'a, C, R, Col> + Sync,
    C: AsyncConnection,
    Col: Sync,
{
    fn take_rows<'c>(
        &'c self,
        conn: &'c mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &'c LockClause,
    ) -> BoxFuture<'c, QueryResult<Vec<(R, i64)>>>
    where
        (R, i64): 'c,
        Q::Key: 'c,
    {
        Box::pin(self.0.stamp(conn, range, limit, lock, self.1))
    }
}

/// A query an async [visibility-timeout
/// claim](crate::ClaimBuilder::visibility_timeout) can take rows of type `R`
/// from, on a diesel-async connection `C`, stamping them in the column
/// `Col`: the async twin of [`crate::StampQuery`].
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}` with a stamp in `{Col}`",
    note = "the row type must be `Identifiable` and `Selectable` from the claimed table, and \
            the stamp a nullable timestamp column of that table"
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

impl<R: HasTable + Send + Sync, Col: Send + Sync> Claimed<R, Col, Async> {
    /// Moves the claim on, as the blocking [`Claimed::extend`] does.
    pub fn extend<'c, C>(
        &'c mut self,
        conn: &'c mut C,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'c
    where
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: StampedRow<C, Col>,
    {
        async move {
            let renewed = if <C::Backend as Strategy>::UPDATE_RETURNING {
                R::renew(self, conn).await.optional()?
            } else {
                // MySQL: the new stamp is read back under the row lock the
                // update took, before anyone else can claim the row.
                let claimed = &*self;
                locking_transaction(conn, |conn| {
                    async move {
                        if R::renew_in_place(claimed, conn).await? == 0 {
                            return Ok::<_, Error>(None);
                        }
                        Ok(Some(R::read_stamp(claimed, conn).await?))
                    }
                    .scope_boxed()
                })
                .await?
            };
            match renewed {
                Some(stamp) => {
                    self.stamp = stamp;
                    Ok(())
                }
                None => Err(self.reason_lost(conn).await),
            }
        }
    }

    /// The claim's final write, as the blocking [`Claimed::finish`] does:
    /// `changes` and the stamp cleared, only while the row still carries
    /// this claim's stamp.
    pub fn finish<'c, C, V>(
        self,
        conn: &'c mut C,
        changes: V,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'c
    where
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: StampedRow<C, Col> + 'c,
        Col: diesel::Column + 'c,
        V: AsChangeset<Target = R::Table>,
        V::Changeset: QueryFragment<C::Backend> + Send + 'c,
    {
        let changes = final_changes::<C::Backend, Col, _>(changes.as_changeset());
        async move { self.unstamp(conn, changes?).await }
    }

    /// Gives the row back, as the blocking [`Claimed::release`] does.
    pub fn release<'c, C>(
        self,
        conn: &'c mut C,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'c
    where
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        R: StampedRow<C, Col> + 'c,
        Col: 'c,
    {
        async move { self.unstamp(conn, None::<()>).await }
    }

    /// Writes `changes`, if any, and clears the stamp, if the row still
    /// carries this claim's.
    async fn unstamp<C, Ch>(&self, conn: &mut C, changes: Option<Ch>) -> Result<(), Error>
    where
        C: AsyncConnection,
        R: StampedRow<C, Col>,
        Ch: QueryFragment<C::Backend> + Send,
    {
        match R::unstamp(self, conn, changes).await? {
            0 => Err(self.reason_lost(conn).await),
            _ => Ok(()),
        }
    }

    /// Why a write guarded by the stamp matched nothing: the row was claimed
    /// again, or is gone.
    async fn reason_lost<C>(&self, conn: &mut C) -> Error
    where
        C: AsyncConnection,
        R: StampedRow<C, Col>,
    {
        match R::count(self, conn).await {
            Ok(1..) => R::lost_to_another(self),
            Ok(_) => Error::NotFound,
            Err(error) => Error::from(error),
        }
    }
}

/// Rows whose async [`Claimed`] handle can write on a diesel-async
/// connection `C`, with the stamp in `Col`: the async twin of
/// [`crate::StampedRow`]. Its methods are the statements, one each.
#[diagnostic::on_unimplemented(
    message = "a claim of rows `{Self}` stamped in `{Col}` cannot write on `{C}`",
    note = "the rows must `#[derive(Identifiable)]`, and the stamp be a nullable timestamp \
            column of their table"
)]
pub trait StampedRow<C: AsyncConnection, Col>: Sized {
    /// Moves the stamp on and returns it (`RETURNING`).
    #[doc(hidden)]
    fn renew<'c>(
        claimed: &'c Claimed<Self, Col, Async>,
        conn: &'c mut C,
    ) -> impl Future<Output = QueryResult<i64>> + Send + 'c;

    /// Moves the stamp on: how many rows it did.
    #[doc(hidden)]
    fn renew_in_place<'c>(
        claimed: &'c Claimed<Self, Col, Async>,
        conn: &'c mut C,
    ) -> impl Future<Output = QueryResult<usize>> + Send + 'c;

    /// The row's stamp.
    #[doc(hidden)]
    fn read_stamp<'c>(
        claimed: &'c Claimed<Self, Col, Async>,
        conn: &'c mut C,
    ) -> impl Future<Output = QueryResult<i64>> + Send + 'c;

    /// Writes `changes`, if any, and clears the stamp: how many rows it did.
    #[doc(hidden)]
    fn unstamp<'c, Ch: QueryFragment<C::Backend> + Send + 'c>(
        claimed: &'c Claimed<Self, Col, Async>,
        conn: &'c mut C,
        changes: Option<Ch>,
    ) -> impl Future<Output = QueryResult<usize>> + Send + 'c;

    /// How many rows have the claimed row's key (0 or 1).
    #[doc(hidden)]
    fn count<'c>(
        claimed: &'c Claimed<Self, Col, Async>,
        conn: &'c mut C,
    ) -> impl Future<Output = QueryResult<i64>> + Send + 'c;

    /// [`Error::ClaimLost`], naming the table.
    #[doc(hidden)]
    fn lost_to_another(claimed: &Claimed<Self, Col, Async>) -> Error;
}

type Shape<R> = <<&'static R as Identifiable>::Id as IdShape>::Shape;
type Key<R> = <Shape<R> as KeyShape<R>>::Key;
type Wrapped<R> = <Shape<R> as KeyShape<R>>::Columns;

impl<R, C, Col> StampedRow<C, Col> for R
where
    C: AsyncConnection,
    C::Backend: AsyncBackend + HasSqlType<BigInt> + 'static,
    i64: ToSql<BigInt, C::Backend> + FromSql<BigInt, C::Backend>,
    R: HasTable + Send + Sync + 'static,
    &'static R: Identifiable,
    <&'static R as Identifiable>::Id: IdShape,
    Shape<R>: KeyShape<R>,
    Key<R>: Send + Sync,
    Wrapped<R>: KeyColumns<Key<R>, C::Backend> + Send,
    FromClause<R>: QueryFragment<C::Backend> + Send,
    Col: Column<Table = R::Table> + Copy + QueryFragment<C::Backend> + Send + Sync,
    Col::SqlType: StampType<C::Backend>,
{
    fn renew<'c>(
        claimed: &'c Claimed<R, Col, Async>,
        conn: &'c mut C,
    ) -> impl Future<Output = QueryResult<i64>> + Send + 'c {
        Returning {
            statement: Update {
                from: R::table().from_clause(),
                changes: claimed.renew,
                filter: claimed.still_stamped(),
            },
            columns: StampMicros(claimed.renew.column),
        }
        .get_result(conn)
    }

    fn renew_in_place<'c>(
        claimed: &'c Claimed<R, Col, Async>,
        conn: &'c mut C,
    ) -> impl Future<Output = QueryResult<usize>> + Send + 'c {
        Update {
            from: R::table().from_clause(),
            changes: claimed.renew,
            filter: claimed.still_stamped(),
        }
        .execute(conn)
    }

    fn read_stamp<'c>(
        claimed: &'c Claimed<R, Col, Async>,
        conn: &'c mut C,
    ) -> impl Future<Output = QueryResult<i64>> + Send + 'c {
        SelectWhere {
            columns: StampMicros(claimed.renew.column),
            from: R::table().from_clause(),
            filter: claimed.only_row(),
        }
        .get_result(conn)
    }

    fn unstamp<'c, Ch: QueryFragment<C::Backend> + Send + 'c>(
        claimed: &'c Claimed<R, Col, Async>,
        conn: &'c mut C,
        changes: Option<Ch>,
    ) -> impl Future<Output = QueryResult<usize>> + Send + 'c {
        Update {
            from: R::table().from_clause(),
            changes: ThenUnstamp {
                changes,
                column: PhantomData::<Col>,
            },
            filter: claimed.still_stamped(),
        }
        .execute(conn)
    }

    fn count<'c>(
        claimed: &'c Claimed<R, Col, Async>,
        conn: &'c mut C,
    ) -> impl Future<Output = QueryResult<i64>> + Send + 'c {
        SelectWhere {
            columns: CountRows,
            from: R::table().from_clause(),
            filter: claimed.only_row(),
        }
        .get_result(conn)
    }

    fn lost_to_another(claimed: &Claimed<R, Col, Async>) -> Error {
        claimed.lost_to_another::<C::Backend>()
    }
}
