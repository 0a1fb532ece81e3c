//! Retries scheduled in the rows, on a diesel-async connection: the blocking
//! schedule's statements, awaited.

use std::fmt::Display;
use std::future::Future;

use diesel::associations::HasTable;
use diesel::deserialize::FromSql;
use diesel::prelude::*;
use diesel::query_builder::QueryFragment;
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, Bool, HasSqlType};
use diesel_async::{AsyncConnection, RunQueryDsl};
use futures_util::future::BoxFuture;

use super::backend::AsyncBackend;
use super::kind::FailureHook;
use crate::backend::strategy::Strategy;
use crate::claim::kind::DeadLetter;
use crate::claim::query::FromClause;
use crate::claim::retries::{failure_statements, Retry};
use crate::sql::retry::{ErrorColumn, RecordFailure};
use crate::sql::stamp::StampType;
use crate::sql::{IdShape, InList, KeyColumns, KeyShape, Returning, SelectWhere};
use crate::Error;

/// Rows whose failures a retry schedule records on a diesel-async
/// connection `C`: the async twin of [`crate::bounds::RetriedRow`].
#[diagnostic::on_unimplemented(
    message = "a retry schedule in `{A}` and `{R}` cannot record failures of rows `{Self}` on `{C}`",
    note = "the rows must `#[derive(Identifiable)]`, and the attempts, next run time and error \
            columns be columns of their table"
)]
pub trait RetriedRow<C: AsyncConnection, A, R, E>: Sized {
    /// Records a failure of this row with `write` (see the blocking twin).
    #[doc(hidden)]
    fn record_failure<'c>(
        &'c self,
        conn: &'c mut C,
        write: RecordFailure<A, R, E>,
        max_attempts: u32,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'c;
}

type Shape<R> = <<&'static R as Identifiable>::Id as IdShape>::Shape;
type Key<R> = <Shape<R> as KeyShape<R>>::Key;
type Wrapped<R> = <Shape<R> as KeyShape<R>>::Columns;

// A failure in here is told as the `RetriedRow` the hook asked for.
#[diagnostic::do_not_recommend]
impl<Row, C, A, R, E> RetriedRow<C, A, R, E> for Row
where
    C: AsyncConnection,
    C::Backend: AsyncBackend + HasSqlType<BigInt> + HasSqlType<Bool> + 'static,
    i64: ToSql<BigInt, C::Backend>,
    bool: FromSql<Bool, C::Backend>,
    Row: HasTable + Send + Sync + 'static,
    &'static Row: Identifiable,
    <&'static Row as Identifiable>::Id: IdShape,
    Shape<Row>: KeyShape<Row>,
    Key<Row>: Send + Sync,
    Wrapped<Row>: KeyColumns<Key<Row>, C::Backend> + Send,
    FromClause<Row>: QueryFragment<C::Backend> + Send,
    A: Column<Table = Row::Table> + Copy + QueryFragment<C::Backend> + Send + Sync + 'static,
    R: Column<Table = Row::Table> + Copy + Send + Sync + 'static,
    R::SqlType: StampType<C::Backend>,
    E: ErrorColumn<C::Backend> + Send + Sync + 'static,
{
    fn record_failure<'c>(
        &'c self,
        conn: &'c mut C,
        write: RecordFailure<A, R, E>,
        max_attempts: u32,
    ) -> impl Future<Output = Result<bool, Error>> + Send + 'c {
        async move {
            let (update, spent) = failure_statements(self, write, max_attempts);
            let spent: Option<bool> = if <C::Backend as Strategy>::UPDATE_RETURNING {
                let returning = Returning {
                    statement: update,
                    columns: spent,
                };
                returning.get_result(conn).await.optional()?
            } else if update.execute(conn).await? == 0 {
                None
            } else {
                // MySQL: read back under the row's lock, which the claim holds.
                let read = SelectWhere {
                    columns: spent,
                    from: Row::table().from_clause(),
                    filter: InList {
                        column: Shape::<Row>::columns(),
                        keys: vec![Shape::<Row>::key(self)],
                    },
                };
                Some(read.get_result(conn).await?)
            };
            Ok(spent == Some(true))
        }
    }
}

impl<C, I, Row, E, A, R, Ec> FailureHook<C, I, Row, E> for Retry<A, R, Ec>
where
    C: AsyncConnection,
    I: Clone,
    Row: RetriedRow<C, A, R, Ec> + Send,
    E: From<Error> + Display + Send + Sync,
    A: Copy + Send,
    R: Copy + Send,
    Ec: Copy + Send,
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
        let (write, attempts) = (self.retries.write(error), self.retries.max_attempts);
        Box::pin(async move {
            let spent = row.record_failure(conn, write, attempts).await?;
            Ok(spent.then_some(DeadLetter { attempts }))
        })
    }
}
