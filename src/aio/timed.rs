//! Visibility-timeout claims on a diesel-async connection: the awaited
//! [`Claimed`] handle (`extend`, `finish`, `release`), on the blocking
//! claim's statements.

use std::future::Future;
use std::marker::PhantomData;
use std::time::Instant;

use diesel::associations::HasTable;
use diesel::deserialize::FromSql;
use diesel::prelude::*;
use diesel::query_builder::QueryFragment;
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, HasSqlType};
use diesel_async::{AsyncConnection, RunQueryDsl};
use scoped_futures::ScopedFutureExt;

use super::backend::AsyncBackend;
use super::transaction::locking_transaction;
use super::Async;
use crate::backend::strategy::Strategy;
use crate::claim::query::FromClause;
use crate::claim::timed::final_changes;
use crate::locking::IdleBound;
use crate::sql::stamp::{CountRows, StampMicros, StampType, ThenUnstamp};
use crate::sql::{IdShape, KeyColumns, KeyShape, Returning};
use crate::sql::{SelectWhere, Update};
use crate::{Claimed, Error};

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
            let sent = Instant::now();
            let renewed = if <C::Backend as Strategy>::UPDATE_RETURNING {
                R::renew(self, conn).await.optional()?
            } else {
                // MySQL: the new stamp is read back under the row lock the
                // update took, before anyone else can claim the row.
                let claimed = &*self;
                locking_transaction(conn, IdleBound::default(), |conn| {
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
                    self.sent = sent;
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
    note = "the rows must `#[derive(Identifiable)]`, the stamp be a nullable timestamp column \
            of their table, and the connection of the backend the claim ran on",
    note = "code generic over the connection says so in its bounds: \
            `Row: diesel_claim::aio::StampedRow<C, StampColumn>`"
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

// A failure in here is told as the `StampedRow` the write asked for, whose
// message names what writing a claimed row needs.
#[diagnostic::do_not_recommend]
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
