//! Claims with a visibility timeout: each row is stamped `claimed_until =
//! <database now> + ttl` by a statement that commits at once, the closure
//! runs outside any transaction, and the claim's final write applies only
//! while the row still carries its stamp.

use std::hash::Hash;
use std::marker::PhantomData;
use std::ops::Deref;
use std::time::Duration;

use diesel::associations::HasTable;
use diesel::connection::LoadConnection;
use diesel::deserialize::FromSql;
use diesel::dsl;
use diesel::prelude::*;
use diesel::query_builder::QueryFragment;
use diesel::query_dsl::methods::FilterDsl;
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, HasSqlType};

use super::engine::{Claim, Taking};
use super::report::{ClaimOutcome, RowFailure};
use super::{
    call, next_batch, take_and_commit, ClaimBuilder, ClaimReport, ClaimStatements, ClaimWorker,
    StampQuery, StopHandle, WaitForRows,
};
use crate::backend::ClaimBackend;
use crate::connection::BlockingConnection;
use crate::locking::LockClause;
use crate::reusable::Reusable;
use crate::sql::rendered;
use crate::sql::stamp::{
    CountRows, NewStamp, StampMicros, StampPassed, StampType, StillStamped, ThenUnstamp,
};
use crate::sql::{IdShape, InList, KeyColumns, KeyShape, Position, Returning, SelectWhere, Update};
use crate::trace;
use crate::transaction::transaction_depth;
use crate::{Blocking, Error};

/// The caller's query, restricted to rows that are not claimed or whose claim
/// has run out. (Not `Clone`: it is rebuilt from the caller's query for each
/// statement.)
#[derive(Debug)]
pub struct Unclaimed<Q, Col> {
    query: Q,
    column: Col,
}

impl<Q, Col> Reusable for Unclaimed<Q, Col>
where
    Q: Reusable,
    Q::Query: FilterDsl<StampPassed<Col>>,
    Col: Copy,
{
    type Query = dsl::Filter<Q::Query, StampPassed<Col>>;

    fn query(&self) -> Self::Query {
        FilterDsl::filter(self.query.query(), StampPassed(self.column))
    }
}

/// A claim whose rows are stamped and committed before the closure runs, made
/// by [`ClaimBuilder::visibility_timeout`]: the closure gets each row as a
/// [`Claimed`], outside any transaction.
///
/// ```
/// # include!("../doctest_setup.rs");
/// use std::time::Duration;
/// use diesel_claim::prelude::*;
/// use diesel_claim::Claimed;
///
/// # fn main() -> Result<(), diesel_claim::Error> {
/// # let mut conn = establish_connection();
/// // invoices: id, sent, claimed_until (a nullable timestamp)
/// let unsent = invoices::table.filter(invoices::sent.eq(false)).select(Invoice::as_select());
/// let report = unsent
///     .build_claim()
///     .visibility_timeout(invoices::claimed_until, Duration::from_secs(60))
///     .each(&mut conn, |conn, invoice: Claimed<Invoice, _>| {
///         // Slow work here holds no transaction and no lock, for up to 60 s;
///         // `invoice.extend(conn)?` buys another 60 s.
///         invoice.finish(conn, invoices::sent.eq(true))
///     })?;
/// assert_eq!(report.processed, 2);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "a claim does nothing until `.each(conn, f)` runs it"]
pub struct TimedClaim<Q, Col, M = Blocking> {
    pub(crate) claim: ClaimBuilder<Unclaimed<Q, Col>, M>,
    pub(crate) stamp: NewStamp<Col>,
}

/// A row taken by a [visibility-timeout claim](ClaimBuilder::visibility_timeout):
/// the row as it was stamped, and the stamp, which is this claim's fencing
/// token. It derefs to the row.
///
/// Nothing is locked while the closure holds it. The claim lasts until the
/// stamp passes, by the database clock: [`extend`](Self::extend) moves it on.
/// [`finish`](Self::finish) writes the row's outcome and ends the claim, and
/// [`release`](Self::release) gives the row back; both apply only while the row
/// still carries this claim's stamp, and fail with [`Error::ClaimLost`] once
/// another worker has claimed it since. A `Claimed` dropped without either
/// leaves the stamp in place: the row is claimed again once it passes, as a
/// crashed worker's would be.
#[derive(Debug)]
pub struct Claimed<R, Col, M = Blocking> {
    pub(crate) row: R,
    pub(crate) stamp: i64,
    pub(crate) renew: NewStamp<Col>,
    pub(crate) mode: PhantomData<M>,
}

impl<Q, M> ClaimBuilder<Q, M> {
    /// The same claim, on the query `f` makes of this one's.
    fn map_query<P>(self, f: impl FnOnce(Q) -> P) -> ClaimBuilder<P, M> {
        ClaimBuilder {
            query: f(self.query),
            lock: self.lock,
            max_rows: self.max_rows,
            drain: self.drain,
            page_size: self.page_size,
            batch: self.batch,
            nested: self.nested,
            keep_going: self.keep_going,
            stop: self.stop,
            in_worker: self.in_worker,
            mode: self.mode,
        }
    }
}

impl<Q, M> ClaimBuilder<Q, M> {
    /// Claims rows for `ttl` at a time, in the nullable timestamp `column` of
    /// the claimed table, instead of holding a transaction open while the
    /// closure works: for slow side effects (rendering a document, calling a
    /// payment API) that should hold no lock and no transaction open.
    ///
    /// The query's filter is extended with `(column IS NULL OR column <
    /// now)`, and each batch is taken by one statement that sets `column =
    /// now + ttl` and commits at once, `now` being the database's clock. The
    /// closure then gets each row as a [`Claimed`], outside any transaction;
    /// its final write ([`Claimed::finish`]) applies only while the row still
    /// carries this claim's stamp. A worker that dies, or stalls past the
    /// stamp, loses nothing: the row is claimed again once its stamp has
    /// passed, and the stalled worker's late write is refused
    /// ([`Error::ClaimLost`]).
    ///
    /// What this trades for it: a row can be worked on more than once (by a
    /// worker whose claim ran out before it finished, and by the next one), so
    /// work outside the database must tolerate a repeat, as with any queue's
    /// visibility timeout; the database write is fenced, and only one
    /// finishes. Choose `ttl` well above the work's duration, or
    /// [`extend`](Claimed::extend) it as the work goes on.
    ///
    /// The column is the claims' own: the application should only ever set it
    /// back to null (to hand a row back at once). Its type: `timestamptz` or
    /// `timestamp` (PostgreSQL), `DATETIME(6)` (MySQL), `TIMESTAMP` (SQLite,
    /// as text); it rarely needs an index, as the query's own filter picks the
    /// rows. `ttl` is at least a millisecond and at most
    /// [`MAX_TTL`](crate::MAX_TTL). A closure that fails leaves its row
    /// stamped: it is claimed again once the stamp passes, no sooner (so never
    /// twice in one call). Not available with [`nowait`](Self::nowait). Set
    /// the claim's other options ([`batch`](Self::batch), [`drain`](Self::drain),
    /// [`keep_going`](Self::keep_going), [`max_rows`](Self::max_rows),
    /// [`stop_on`](Self::stop_on)) before this call.
    pub fn visibility_timeout<Col: Copy>(
        self,
        column: Col,
        ttl: Duration,
    ) -> TimedClaim<Q, Col, M> {
        let mut claim = self.map_query(|query| Unclaimed { query, column });
        if ttl < Duration::from_millis(1) || ttl > crate::MAX_TTL {
            claim.lock.reject(format!(
                "a visibility timeout must be at least 1 ms and at most {:?}, not {ttl:?}",
                crate::MAX_TTL
            ));
        }
        TimedClaim {
            claim,
            stamp: NewStamp {
                column,
                micros: i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX),
            },
        }
    }
}

impl<Q, Col: Copy> TimedClaim<Q, Col> {
    /// Runs the claim, calling `f` for every claimed row, outside any
    /// transaction. An error from `f` ends the call (the row keeps its stamp
    /// until it passes, as do the rest of its batch); with
    /// [`keep_going`](ClaimBuilder::keep_going), the call goes on with the
    /// next row. The report's `processed` counts the rows for which `f`
    /// returned `Ok`.
    pub fn each<'q, C, R, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Unclaimed<Q, Col>: StampQuery<'q, C, R, Col>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Claimed<R, Col>) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_outcome(conn, f).into_result()
    }

    /// Runs the claim, calling `f` once per claimed batch with its rows, in
    /// the claim order, outside any transaction.
    pub fn each_batch<'q, C, R, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        Unclaimed<Q, Col>: StampQuery<'q, C, R, Col>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Vec<Claimed<R, Col>>) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch_outcome(conn, f).into_result()
    }

    /// Runs the claim as [`each`](Self::each) does, and returns everything it
    /// did: see [`ClaimBuilder::each_outcome`].
    pub fn each_outcome<'q, C, R, E, F, Inferred>(
        self,
        conn: &mut C,
        mut f: F,
    ) -> ClaimOutcome<KeyOf<Unclaimed<Q, Col>, C, R>, E>
    where
        Unclaimed<Q, Col>: StampQuery<'q, C, R, Col>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Claimed<R, Col>) -> Result<(), E>,
        E: From<Error>,
    {
        self.run(conn, each_row(&mut f, self.claim.keep_going))
    }

    /// Runs the claim as [`each_batch`](Self::each_batch) does, and returns
    /// everything it did: see [`ClaimBuilder::each_outcome`].
    pub fn each_batch_outcome<'q, C, R, E, F, Inferred>(
        self,
        conn: &mut C,
        mut f: F,
    ) -> ClaimOutcome<KeyOf<Unclaimed<Q, Col>, C, R>, E>
    where
        Unclaimed<Q, Col>: StampQuery<'q, C, R, Col>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Vec<Claimed<R, Col>>) -> Result<(), E>,
        E: From<Error>,
    {
        let keep_going = self.claim.keep_going;
        self.run(conn, |conn, rows, key_of| {
            let keys = rows.iter().map(|row| key_of(&row.row)).collect();
            let mut handed = Handed::default();
            handed.record(keys, call(|| f(&mut *conn, rows), keep_going), keep_going);
            handed
        })
    }

    /// One run of the claim: each batch stamped and committed, then handed
    /// to `hand`, which runs the closure and says what came of it.
    fn run<'q, C, R, E, H>(
        &self,
        conn: &mut C,
        mut hand: H,
    ) -> ClaimOutcome<KeyOf<Unclaimed<Q, Col>, C, R>, E>
    where
        Unclaimed<Q, Col>: StampQuery<'q, C, R, Col>,
        C: LoadConnection,
        C::Backend: ClaimBackend,
        H: FnMut(
            &mut C,
            Vec<Claimed<R, Col>>,
            fn(&R) -> KeyOf<Unclaimed<Q, Col>, C, R>,
        ) -> Handed<KeyOf<Unclaimed<Q, Col>, C, R>, E>,
        E: From<Error>,
    {
        let TimedClaim { claim, stamp } = self;
        let query = &claim.query;
        let started = transaction_depth(conn)
            .map_err(Error::from)
            .and_then(|depth| claim.start::<C::Backend, R, _>(Taking::MarkAndCommit, query, depth));
        let mut run = match started {
            Ok(run) => run,
            Err(error) => return ClaimOutcome::refused(error.into()),
        };
        let span = run.span::<Unclaimed<Q, Col>, C::Backend, R>();
        let mut failed = Vec::new();
        let stopped = span
            .in_scope(|| drive(&mut run, query, conn, stamp, &mut hand, &mut failed))
            .err();
        ClaimOutcome::ended(run.report(), failed, stopped, &span)
    }
}

impl<Q, Col, M> TimedClaim<Q, Col, M> {
    /// Turns the claim into a worker that runs it over and over, waiting when
    /// nothing is claimable, until `stop` is triggered: the worker loop of
    /// [`ClaimWorker`], with the closure outside any transaction. Rows whose
    /// stamps belong to a dead worker are claimed at the first poll after
    /// their stamps pass.
    pub fn worker(mut self, stop: &StopHandle) -> TimedWorker<Q, Col, M> {
        self.claim = self.claim.in_worker(stop);
        TimedWorker {
            claim: self,
            polling: ClaimWorker::new(ClaimBuilder::new(()), stop.clone()),
        }
    }
}

/// A [visibility-timeout claim](ClaimBuilder::visibility_timeout) run until
/// stopped, made by [`TimedClaim::worker`]: see [`ClaimWorker`], whose
/// options it has.
#[derive(Debug)]
#[must_use = "a worker does nothing until `.run(conn, f)` runs it"]
pub struct TimedWorker<Q, Col, M = Blocking> {
    pub(crate) claim: TimedClaim<Q, Col, M>,
    /// The loop's options: polling and listening.
    pub(crate) polling: ClaimWorker<(), M>,
}

impl<Q, Col, M> TimedWorker<Q, Col, M> {
    /// See [`ClaimWorker::poll_interval`].
    pub fn poll_interval(mut self, min: Duration, max: Duration) -> Self {
        self.polling = self.polling.poll_interval(min, max);
        self
    }

    /// See [`ClaimWorker::listen`].
    pub fn listen(mut self, channel: &str) -> Self {
        self.polling = self.polling.listen(channel);
        self
    }
}

impl<Q, Col: Copy> TimedWorker<Q, Col> {
    /// Runs the worker until stopped, calling `f` for every claimed row as
    /// [`TimedClaim::each`] does; returns the report of everything it did.
    pub fn run<'q, C, R, E, F>(self, conn: &mut C, mut f: F) -> Result<ClaimReport, E>
    where
        Unclaimed<Q, Col>: StampQuery<'q, C, R, Col>,
        C: WaitForRows,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Claimed<R, Col>) -> Result<(), E>,
        E: From<Error>,
    {
        let keep_going = self.claim.claim.keep_going;
        let mut hand = each_row(&mut f, keep_going);
        self.polling
            .serve(conn, |conn| self.claim.run(conn, &mut hand))
    }
}

/// What a timed claim hands its batches to: it runs the closure on the
/// claims, given how to read a row's key, and says what came of it.
trait HandBatch<C, R, Col, K, E>:
    FnMut(&mut C, Vec<Claimed<R, Col>>, fn(&R) -> K) -> Handed<K, E>
{
}

impl<T, C, R, Col, K, E> HandBatch<C, R, Col, K, E> for T where
    T: FnMut(&mut C, Vec<Claimed<R, Col>>, fn(&R) -> K) -> Handed<K, E>
{
}

/// Hands each row of a batch to `f` in turn: a failure ends the call, or,
/// with `keep_going`, is recorded and the next row goes on.
fn each_row<C, R, Col, K, E: From<Error>>(
    mut f: impl FnMut(&mut C, Claimed<R, Col>) -> Result<(), E>,
    keep_going: bool,
) -> impl HandBatch<C, R, Col, K, E> {
    move |conn, rows, key_of| {
        let mut handed = Handed::default();
        for row in rows {
            let key = key_of(&row.row);
            let done = call(|| f(&mut *conn, row), keep_going);
            if !handed.record(vec![key], done, keep_going) {
                break;
            }
        }
        handed
    }
}

/// The key of the rows `R` of the claimed query `Q`, on the connection `C`.
type KeyOf<Q, C, R> = <Q as ClaimStatements<<C as diesel::Connection>::Backend, R>>::Key;

/// What the closure made of a batch of claimed rows.
pub(crate) struct Handed<K, E> {
    /// Rows it returned `Ok` for.
    pub(crate) finished: usize,
    /// Failures passed over ([`keep_going`](ClaimBuilder::keep_going)).
    pub(crate) failed: Vec<RowFailure<K, E>>,
    /// The failure that ends the call.
    pub(crate) stopped: Option<RowFailure<K, E>>,
}

impl<K, E> Default for Handed<K, E> {
    fn default() -> Self {
        Handed {
            finished: 0,
            failed: Vec::new(),
            stopped: None,
        }
    }
}

/// Runs a visibility-timeout claim's steps until it is done: each batch is
/// stamped by a statement that commits on its own, then handed over.
fn drive<'q, Q, C, R, Col, E, H>(
    claim: &mut Claim<Position<Q::Key>>,
    query: &Q,
    conn: &mut C,
    stamp: &NewStamp<Col>,
    hand: &mut H,
    failed: &mut Vec<RowFailure<Q::Key, E>>,
) -> Result<(), RowFailure<Q::Key, E>>
where
    Q: StampQuery<'q, C, R, Col>,
    C: LoadConnection,
    C::Backend: ClaimBackend,
    Col: Copy,
    H: FnMut(&mut C, Vec<Claimed<R, Col>>, fn(&R) -> Q::Key) -> Handed<Q::Key, E>,
    E: From<Error>,
{
    let outside = |error| RowFailure::new(Vec::new(), E::from(error));
    let mut take = |conn: &mut C, range, limit, clause: &LockClause| {
        query.stamp(conn, range, limit, clause, stamp)
    };
    let position_of = |(row, _): &(R, i64)| Position::of_key(Q::key(row));
    while let Some((range, limit)) = next_batch(claim, query, conn).map_err(outside)? {
        // The stamps commit on their own: the batch's span ends with them,
        // before the closure runs outside any transaction.
        let span = trace::debug_span!("batch", limit, taken = trace::Empty, outcome = trace::Empty);
        let rows = span
            .in_scope(|| take_and_commit(claim, conn, &mut take, range, limit, position_of))
            .map_err(outside)?;
        span.record("taken", rows.len())
            .record("outcome", "committed");
        if rows.is_empty() {
            continue;
        }
        let rows = rows
            .into_iter()
            .map(|(row, stamped)| Claimed::new(row, stamped, *stamp))
            .collect();
        hand(conn, rows, Q::key).count(claim, failed)?;
    }
    Ok(())
}

impl<K, E> Handed<K, E> {
    /// Records what the closure made of the rows with keys `keys`; whether
    /// the call goes on.
    pub(crate) fn record(&mut self, keys: Vec<K>, done: Result<(), E>, keep_going: bool) -> bool {
        match done {
            Ok(()) => self.finished += keys.len(),
            Err(error) if keep_going => self.failed.push(RowFailure::new(keys, error)),
            Err(error) => {
                self.stopped = Some(RowFailure::new(keys, error));
                return false;
            }
        }
        true
    }
}

impl<K: Clone + Eq + Hash, E> Handed<K, E> {
    /// Counts what came of a batch in the claim's report, and keeps the
    /// failures passed over: the failure that ends the call, if any, is the
    /// error.
    pub(crate) fn count(
        self,
        claim: &mut Claim<Position<K>>,
        failed: &mut Vec<RowFailure<K, E>>,
    ) -> Result<(), RowFailure<K, E>> {
        claim.processed(self.finished);
        for failure in &self.failed {
            claim.failed(failure.keys.len());
        }
        failed.extend(self.failed);
        self.stopped.map_or(Ok(()), Err)
    }
}

impl<R, Col, M> Deref for Claimed<R, Col, M> {
    type Target = R;

    fn deref(&self) -> &R {
        &self.row
    }
}

impl<R, Col, M> Claimed<R, Col, M> {
    /// A row just stamped `stamp` by a claim that stamps with `renew`.
    pub(crate) fn new(row: R, stamp: i64, renew: NewStamp<Col>) -> Self {
        Claimed {
            row,
            stamp,
            renew,
            mode: PhantomData,
        }
    }

    /// The row, as it was when it was stamped.
    pub fn row(&self) -> &R {
        &self.row
    }

    /// The row, leaving its stamp in place: it is claimed again once the
    /// stamp passes.
    pub fn into_row(self) -> R {
        self.row
    }

    /// The stamp: when this claim runs out, in microseconds since the Unix
    /// epoch by the database clock (SQLite keeps milliseconds). It is also
    /// the claim's fencing token: a later claim of the row has a later stamp.
    pub fn stamp(&self) -> i64 {
        self.stamp
    }
}

impl<R: HasTable, Col> Claimed<R, Col> {
    /// Moves the claim on: the stamp becomes the database's `now` plus the
    /// claim's time to live, if the row still carries this claim's stamp.
    /// Call it between the steps of long work; it commits at once.
    ///
    /// Fails with [`Error::ClaimLost`] if another worker has claimed the row
    /// since (this claim ran out): stop working on it then.
    pub fn extend<C>(&mut self, conn: &mut C) -> Result<(), Error>
    where
        C: Connection,
        R: StampedRow<C, Col>,
    {
        self.stamp = R::renew(self, conn)?;
        Ok(())
    }

    /// The claim's final write: applies `changes` to the row and clears its
    /// stamp, in one statement, only if the row still carries this claim's
    /// stamp. The changes should take the row out of the claimed query (set
    /// what its filter tests); rows they leave matching are claimed again.
    ///
    /// Fails with [`Error::ClaimLost`] if another worker has claimed the row
    /// since (this claim ran out), and writes nothing; with
    /// [`Error::NotFound`] if the row is gone; and with
    /// [`Error::InvalidArgument`] if `changes` set the stamp column.
    pub fn finish<C, V>(self, conn: &mut C, changes: V) -> Result<(), Error>
    where
        C: Connection,
        R: StampedRow<C, Col>,
        V: AsChangeset<Target = R::Table>,
        V::Changeset: QueryFragment<C::Backend>,
        C::Backend: ClaimBackend,
        Col: diesel::Column,
    {
        let changes = final_changes::<C::Backend, Col, _>(changes.as_changeset())?;
        R::unstamp(&self, conn, changes)
    }

    /// Gives the row back: clears its stamp, if it still carries this
    /// claim's, so that the next claim takes it at once. Fails as
    /// [`finish`](Self::finish) does.
    pub fn release<C>(self, conn: &mut C) -> Result<(), Error>
    where
        C: Connection,
        R: StampedRow<C, Col>,
    {
        R::unstamp(&self, conn, None::<()>)
    }
}

/// The changes of a claim's final write, `None` if they change nothing;
/// refused if they set the stamp column `Col`, which the write clears.
pub(crate) fn final_changes<DB, Col, Ch>(changeset: Ch) -> Result<Option<Ch>, Error>
where
    DB: ClaimBackend,
    Col: diesel::Column,
    Ch: QueryFragment<DB>,
{
    if changeset.is_noop(&DB::default())? {
        return Ok(None);
    }
    let rendered = rendered::render::<DB>(&changeset)?;
    if rendered::assigns::<DB>(&rendered, Col::NAME)? {
        return Err(Error::InvalidArgument(format!(
            "a claim's final write cannot set its stamp column `{}`: the claim clears it",
            Col::NAME
        )));
    }
    Ok(Some(changeset))
}

/// Rows whose [`Claimed`] handle can write on a connection `C`, with the
/// stamp in `Col`: rows of a table with a primary key of one to three
/// columns, on a supported backend, with a stamp column of that table.
#[diagnostic::on_unimplemented(
    message = "a claim of rows `{Self}` stamped in `{Col}` cannot write on `{C}`",
    note = "the rows must `#[derive(Identifiable)]`, and the stamp be a nullable timestamp \
            column of their table"
)]
pub trait StampedRow<C: Connection, Col>: Sized {
    /// Moves the claim's stamp on: the new stamp.
    #[doc(hidden)]
    fn renew(claimed: &Claimed<Self, Col>, conn: &mut C) -> Result<i64, Error>;

    /// Writes `changes`, if any, and clears the stamp.
    #[doc(hidden)]
    fn unstamp<Ch: QueryFragment<C::Backend>>(
        claimed: &Claimed<Self, Col>,
        conn: &mut C,
        changes: Option<Ch>,
    ) -> Result<(), Error>;
}

type Shape<R> = <<&'static R as Identifiable>::Id as IdShape>::Shape;
type Key<R> = <Shape<R> as KeyShape<R>>::Key;
type Wrapped<R> = <Shape<R> as KeyShape<R>>::Columns;
type FromClause<R> = <<R as HasTable>::Table as diesel::QuerySource>::FromClause;

impl<R, C, Col> StampedRow<C, Col> for R
where
    C: LoadConnection,
    C::Backend: ClaimBackend + HasSqlType<BigInt> + 'static,
    i64: ToSql<BigInt, C::Backend> + FromSql<BigInt, C::Backend>,
    R: HasTable + 'static,
    &'static R: Identifiable,
    <&'static R as Identifiable>::Id: IdShape,
    Shape<R>: KeyShape<R>,
    Wrapped<R>: KeyColumns<Key<R>, C::Backend>,
    FromClause<R>: QueryFragment<C::Backend>,
    Col: Column<Table = R::Table> + Copy + QueryFragment<C::Backend>,
    Col::SqlType: StampType<C::Backend>,
{
    fn renew(claimed: &Claimed<R, Col>, conn: &mut C) -> Result<i64, Error> {
        let update = Update {
            from: R::table().from_clause(),
            changes: claimed.renew,
            filter: claimed.still_stamped(),
        };
        let stamp = StampMicros(claimed.renew.column);
        let renewed = if <C::Backend as crate::backend::strategy::Strategy>::UPDATE_RETURNING {
            Returning {
                statement: update,
                columns: stamp,
            }
            .get_result(conn)
            .optional()
        } else {
            // MySQL: the new stamp is read back under the row lock the
            // update took, before anyone else can claim the row.
            conn.transaction(|conn| {
                if update.execute(conn)? == 0 {
                    return Ok(None);
                }
                SelectWhere {
                    columns: stamp,
                    from: R::table().from_clause(),
                    filter: claimed.only_row(),
                }
                .get_result(conn)
                .map(Some)
            })
        };
        renewed?.ok_or_else(|| claimed.lost(conn))
    }

    fn unstamp<Ch: QueryFragment<C::Backend>>(
        claimed: &Claimed<R, Col>,
        conn: &mut C,
        changes: Option<Ch>,
    ) -> Result<(), Error> {
        let updated = Update {
            from: R::table().from_clause(),
            changes: ThenUnstamp {
                changes,
                column: PhantomData::<Col>,
            },
            filter: claimed.still_stamped(),
        }
        .execute(conn)?;
        match updated {
            0 => Err(claimed.lost(conn)),
            _ => Ok(()),
        }
    }
}

impl<R, Col: Copy, M> Claimed<R, Col, M>
where
    R: HasTable + 'static,
    &'static R: Identifiable,
    <&'static R as Identifiable>::Id: IdShape,
    Shape<R>: KeyShape<R>,
{
    /// The row, while it carries this claim's stamp.
    pub(crate) fn still_stamped(&self) -> StillStamped<Wrapped<R>, Key<R>, Col> {
        StillStamped {
            key_columns: Shape::<R>::columns(),
            key: Shape::<R>::key(&self.row),
            column: self.renew.column,
            stamp: self.stamp,
        }
    }

    /// The row, whatever its stamp.
    pub(crate) fn only_row(&self) -> InList<Wrapped<R>, Key<R>> {
        InList {
            column: Shape::<R>::columns(),
            keys: vec![Shape::<R>::key(&self.row)],
        }
    }

    /// Why a write guarded by the stamp matched nothing: the row was claimed
    /// again, or is gone.
    fn lost<C>(&self, conn: &mut C) -> Error
    where
        C: LoadConnection,
        C::Backend: ClaimBackend + HasSqlType<BigInt> + 'static,
        i64: FromSql<BigInt, C::Backend>,
        Wrapped<R>: KeyColumns<Key<R>, C::Backend>,
        FromClause<R>: QueryFragment<C::Backend>,
    {
        let probe = SelectWhere {
            columns: CountRows,
            from: R::table().from_clause(),
            filter: self.only_row(),
        };
        match probe.get_result::<i64>(conn) {
            Ok(1..) => self.lost_to_another::<C::Backend>(),
            Ok(_) => Error::NotFound,
            Err(error) => Error::from(error),
        }
    }

    /// The row is there, with another claim's stamp: [`Error::ClaimLost`].
    pub(crate) fn lost_to_another<DB>(&self) -> Error
    where
        DB: ClaimBackend,
        FromClause<R>: QueryFragment<DB>,
    {
        match rendered::render::<DB>(&R::table().from_clause()) {
            Ok(table) => Error::ClaimLost { table },
            Err(error) => Error::from(error),
        }
    }
}
