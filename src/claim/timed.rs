//! Claims with a visibility timeout: each row is stamped `claimed_until =
//! <database now> + ttl` by a statement that commits at once, the closure
//! runs outside any transaction, and the claim's final write applies only
//! while the row still carries its stamp.

use std::marker::PhantomData;
use std::ops::Deref;
use std::time::{Duration, Instant};

use diesel::associations::HasTable;
use diesel::connection::LoadConnection;
use diesel::deserialize::FromSql;
use diesel::dsl;
use diesel::prelude::*;
use diesel::query_builder::QueryFragment;
use diesel::query_dsl::methods::FilterDsl;
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, HasSqlType};

use super::kind::{Select, Stamp};
use super::ClaimBuilder;
use crate::backend::ClaimBackend;
use crate::reusable::{QueryPerLoop, Reusable};
use crate::sql::rendered;
use crate::sql::stamp::{
    Checked, ColumnOf, CountRows, NewStamp, NullableTimestamp, StampColumn, StampMicros,
    StampPassed, StampType, StampedQuery, StillStamped, TableOf, ThenUnstamp, Timestamped,
};
use crate::sql::{IdShape, InList, KeyColumns, KeyShape, Returning, SelectWhere, Update};
use crate::{Blocking, Error};

/// The claim [`visibility_timeout`](ClaimBuilder::visibility_timeout) makes
/// of a claim of `Q` with the column `Col`.
type StampClaim<Q, Col, M, H> =
    ClaimBuilder<Unclaimed<Q, Checked<Col, Q>>, M, Stamp<Checked<Col, Q>>, H>;

/// The caller's query, restricted to rows that are not claimed or whose claim
/// has run out. (Not `Clone`: it is rebuilt from the caller's query for each
/// statement, and copied per loop of a worker on a pool as that query is.)
#[derive(Debug)]
pub struct Unclaimed<Q, Col> {
    query: Q,
    column: Col,
}

#[diagnostic::do_not_recommend]
impl<Q, Col> Reusable for Unclaimed<Q, Col>
where
    Col: StampColumn,
    Q: Reusable,
    Q::Query: FilterDsl<StampPassed<Col>>,
    Col: Copy,
{
    type Query = dsl::Filter<Q::Query, StampPassed<Col>>;

    fn query(&self) -> Self::Query {
        FilterDsl::filter(self.query.query(), StampPassed(self.column))
    }
}

impl<Q: QueryPerLoop, Col: Copy> QueryPerLoop for Unclaimed<Q, Col> {
    fn per_loop(&self) -> Self {
        Unclaimed {
            query: self.query.per_loop(),
            column: self.column,
        }
    }
}

/// A row taken by a [visibility-timeout claim](ClaimBuilder::visibility_timeout):
/// the row as it was stamped, and the stamp, which is this claim's fencing
/// token. It derefs to the row.
///
/// Nothing is locked while the closure holds it. The claim lasts until the
/// stamp passes, by the database clock: [`remaining`](Self::remaining) says
/// how long that is, and [`extend`](Self::extend) moves it on. Each row comes
/// to the closure with its whole time to live ahead of it: the rows of a
/// batch after the first are stamped again as they are handed over.
/// [`finish`](Self::finish) writes the row's outcome and ends the claim, and
/// [`release`](Self::release) gives the row back; both apply only while the row
/// still carries this claim's stamp, and fail with [`Error::ClaimLost`] once
/// another worker has claimed it since. A `Claimed` dropped without either
/// leaves the stamp in place: the row is claimed again once it passes, as a
/// crashed worker's would be.
#[derive(Debug, Clone)]
pub struct Claimed<R, Col, M = Blocking> {
    pub(crate) row: R,
    pub(crate) stamp: i64,
    pub(crate) renew: NewStamp<Col>,
    /// When the statement that wrote the stamp was sent: the claim runs out
    /// no sooner than its time to live after that.
    pub(crate) sent: Instant,
    pub(crate) mode: PhantomData<M>,
}

impl<Q, M, H> ClaimBuilder<Q, M, Select, H> {
    /// Claims rows for `ttl` at a time, in the nullable timestamp `column` of
    /// the claimed table, instead of holding a transaction open while the
    /// closure works: for slow side effects (rendering a document, calling a
    /// payment API) that should hold no lock and no transaction open.
    ///
    /// The query's filter is extended with `(column IS NULL OR column <
    /// now)`, and each batch is taken by one statement that sets `column =
    /// now + ttl` and commits at once, `now` being the database's clock. The
    /// closure then gets each row as a [`Claimed`], outside any transaction,
    /// with its whole `ttl` ahead of it (the rows of a batch after the first
    /// are stamped again, one statement each, as they are handed over); its
    /// final write ([`Claimed::finish`]) applies only while the row still
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
    /// rows. The column is of the table the query reads, which it reads
    /// alone (no join; a subquery in its filter may read other tables).
    /// `ttl` is at least a millisecond and at most
    /// [`MAX_TTL`](crate::MAX_TTL). A closure that fails leaves its row
    /// stamped: it is claimed again once the stamp passes, no sooner (so never
    /// twice in one call); with a [failure hook](Self::on_failure), the hook
    /// runs in a transaction that first clears the stamp, if the row still
    /// carries it, so that the hook decides when the row runs again. Not
    /// available with [`nowait`](Self::nowait).
    pub fn visibility_timeout<Col>(self, column: Col, ttl: Duration) -> StampClaim<Q, Col, M, H>
    where
        Col: Column,
        Col::SqlType: NullableTimestamp<Col>,
        Col: StampedQuery<Q>,
        TableOf<Q, Col>: ColumnOf<<Col as Column>::Table, Timestamped<Col>, Column: Copy>,
    {
        // The column as the claim's type, known only for a nullable
        // timestamp column of the claimed table: see `ColumnOf`.
        let column = <Col::SqlType as NullableTimestamp<Col>>::column(column);
        let column = <TableOf<Q, Col> as ColumnOf<<Col as Column>::Table, _>>::column(column);
        let stamp = NewStamp {
            column,
            micros: i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX),
        };
        let mut claim = self.with_kind(|query| Unclaimed { query, column }, Stamp { stamp });
        if ttl < Duration::from_millis(1) || ttl > crate::MAX_TTL {
            claim.options.lock.reject(format!(
                "a visibility timeout must be at least 1 ms and at most {:?}, not {ttl:?}",
                crate::MAX_TTL
            ));
        }
        claim
    }
}

impl<R, Col, M> Deref for Claimed<R, Col, M> {
    type Target = R;

    fn deref(&self) -> &R {
        &self.row
    }
}

impl<R, Col, M> Claimed<R, Col, M> {
    /// A row stamped `stamp` by a statement sent at `sent`, of a claim that
    /// stamps with `renew`.
    pub(crate) fn new(row: R, stamp: i64, renew: NewStamp<Col>, sent: Instant) -> Self {
        Claimed {
            row,
            stamp,
            renew,
            sent,
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

    /// How long this claim has left, at least, by this process's monotonic
    /// clock: the time to live, less the time since the statement that wrote
    /// the stamp was sent. Zero once it has run out: another worker may have
    /// the row by then.
    pub fn remaining(&self) -> Duration {
        let ttl = Duration::from_micros(self.renew.micros.unsigned_abs());
        ttl.saturating_sub(self.sent.elapsed())
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
        let sent = Instant::now();
        self.stamp = R::renew(self, conn)?;
        self.sent = sent;
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
        match R::unstamp(&self, conn, changes)? {
            0 => Err(R::lost(&self, conn)),
            _ => Ok(()),
        }
    }

    /// Gives the row back: clears its stamp, if it still carries this
    /// claim's, so that the next claim takes it at once. Fails as
    /// [`finish`](Self::finish) does.
    pub fn release<C>(self, conn: &mut C) -> Result<(), Error>
    where
        C: Connection,
        R: StampedRow<C, Col>,
    {
        match R::unstamp(&self, conn, None::<()>)? {
            0 => Err(R::lost(&self, conn)),
            _ => Ok(()),
        }
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
    note = "the rows must `#[derive(Identifiable)]`, the stamp be a nullable timestamp column \
            of their table, and the connection of the backend the claim ran on",
    note = "code generic over the connection says so in its bounds: \
            `Row: diesel_claim::StampedRow<C, StampColumn>`"
)]
pub trait StampedRow<C: Connection, Col>: Sized {
    /// Moves the claim's stamp on: the new stamp.
    #[doc(hidden)]
    fn renew(claimed: &Claimed<Self, Col>, conn: &mut C) -> Result<i64, Error>;

    /// Writes `changes`, if any, and clears the stamp, if the row still
    /// carries it: how many rows it did (0 or 1).
    #[doc(hidden)]
    fn unstamp<Ch: QueryFragment<C::Backend>>(
        claimed: &Claimed<Self, Col>,
        conn: &mut C,
        changes: Option<Ch>,
    ) -> Result<usize, Error>;

    /// Why a write guarded by the stamp matched nothing: the row was claimed
    /// again ([`Error::ClaimLost`]), or is gone.
    #[doc(hidden)]
    fn lost(claimed: &Claimed<Self, Col>, conn: &mut C) -> Error;
}

type Shape<R> = <<&'static R as Identifiable>::Id as IdShape>::Shape;
type Key<R> = <Shape<R> as KeyShape<R>>::Key;
type Wrapped<R> = <Shape<R> as KeyShape<R>>::Columns;
type FromClause<R> = <<R as HasTable>::Table as diesel::QuerySource>::FromClause;

// A failure in here is told as the `StampedRow` the write asked for, whose
// message names what writing a claimed row needs.
#[diagnostic::do_not_recommend]
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
    ) -> Result<usize, Error> {
        let updated = Update {
            from: R::table().from_clause(),
            changes: ThenUnstamp {
                changes,
                column: PhantomData::<Col>,
            },
            filter: claimed.still_stamped(),
        }
        .execute(conn)?;
        Ok(updated)
    }

    fn lost(claimed: &Claimed<R, Col>, conn: &mut C) -> Error {
        claimed.lost(conn)
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
        match rendered::table_name::<_, DB>(&R::table()) {
            Ok(table) => Error::ClaimLost {
                table,
                key: format!("{:?}", Shape::<R>::key(&self.row)),
            },
            Err(error) => Error::from(error),
        }
    }
}
