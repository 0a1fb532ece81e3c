//! The SQL of a retry schedule kept in the rows: which rows are due, the
//! write that records a failure, and whether a row has used its last
//! attempt. Every time is the database's clock, never a client's.

use diesel::backend::Backend;
use diesel::expression::{is_aggregate, AppearsOnTable, Expression, ValidGrouping};
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, Bool, HasSqlType, Nullable, Text};
use diesel::{Column, QueryResult};

use super::stamp::StampType;

/// `(<attempts> < <max> AND <run_at> <= <now>)`: a row whose next run time
/// has come and whose attempts are not spent (a nullable `run_at` that is
/// null has come).
#[derive(Debug, Clone, Copy)]
pub struct DueNow<A, R> {
    pub(crate) attempts: A,
    pub(crate) run_at: R,
    pub(crate) max_attempts: u32,
}

/// `<attempts> >= <max>`: the row has used its last attempt.
#[derive(Debug, Clone, Copy)]
pub struct AttemptsSpent<A> {
    pub attempts: A,
    pub max_attempts: u32,
}

/// `<attempts> = <attempts> + 1, <run_at> = <now + the delay after the
/// row's attempts so far>, <error> = <message>`: a failure recorded, as an
/// assignment. `delays[n]` is the delay after a row's `n + 1`th failure, in
/// microseconds; the last holds for every failure after it.
#[derive(Debug, Clone)]
pub struct RecordFailure<A, R, E> {
    pub attempts: A,
    pub run_at: R,
    pub error: E,
    pub delays: Vec<i64>,
    pub message: String,
}

/// A column a retry schedule writes its failures' errors in: a text column
/// of the claimed table, nullable or not, or [`NoColumn`] for none.
pub trait ErrorColumn<DB: Backend>: Copy {
    /// `, <column> = <message>`, or nothing.
    fn walk_assign<'b>(&'b self, message: &'b str, out: AstPass<'_, 'b, DB>) -> QueryResult<()>;
}

/// No column: a retry schedule that writes no error.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoColumn;

impl<DB: Backend> ErrorColumn<DB> for NoColumn {
    fn walk_assign<'b>(&'b self, _: &'b str, _: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        Ok(())
    }
}

/// The SQL types an error column may have.
pub trait TextType {}

impl TextType for Text {}

impl TextType for Nullable<Text> {}

impl<DB, Col> ErrorColumn<DB> for Col
where
    DB: Backend + HasSqlType<Text>,
    str: ToSql<Text, DB>,
    Col: Column + Copy,
    Col::SqlType: TextType,
{
    fn walk_assign<'b>(
        &'b self,
        message: &'b str,
        mut out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()> {
        out.push_sql(", ");
        out.push_identifier(Col::NAME)?;
        out.push_sql(" = ");
        out.push_bind_param::<Text, str>(message)
    }
}

impl<A, R> QueryId for DueNow<A, R> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<A> QueryId for AttemptsSpent<A> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<A, R, E> QueryId for RecordFailure<A, R, E> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<A, R> Expression for DueNow<A, R> {
    type SqlType = Bool;
}

impl<A: AppearsOnTable<QS>, R: AppearsOnTable<QS>, QS> AppearsOnTable<QS> for DueNow<A, R> {}

impl<A, R, GroupBy> ValidGrouping<GroupBy> for DueNow<A, R> {
    type IsAggregate = is_aggregate::Never;
}

impl<A> Expression for AttemptsSpent<A> {
    type SqlType = Bool;
}

impl<A: AppearsOnTable<QS>, QS> AppearsOnTable<QS> for AttemptsSpent<A> {}

impl<A, GroupBy> ValidGrouping<GroupBy> for AttemptsSpent<A> {
    type IsAggregate = is_aggregate::Never;
}

impl<A, R, DB> QueryFragment<DB> for DueNow<A, R>
where
    DB: Backend,
    A: QueryFragment<DB>,
    R: Column + QueryFragment<DB>,
    R::SqlType: StampType<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("(");
        self.attempts.walk_ast(out.reborrow())?;
        // A literal: the count is the caller's option, not data.
        out.push_sql(&format!(" < {} AND ", self.max_attempts));
        if R::SqlType::NULLABLE {
            out.push_sql("(");
            self.run_at.walk_ast(out.reborrow())?;
            out.push_sql(" IS NULL OR ");
        }
        self.run_at.walk_ast(out.reborrow())?;
        out.push_sql(" <= ");
        R::SqlType::walk_now(out.reborrow())?;
        if R::SqlType::NULLABLE {
            out.push_sql(")");
        }
        out.push_sql(")");
        Ok(())
    }
}

impl<A, DB> QueryFragment<DB> for AttemptsSpent<A>
where
    DB: Backend,
    A: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("(");
        self.attempts.walk_ast(out.reborrow())?;
        out.push_sql(&format!(" >= {})", self.max_attempts));
        Ok(())
    }
}

impl<A, R, E, DB> QueryFragment<DB> for RecordFailure<A, R, E>
where
    DB: Backend + HasSqlType<BigInt>,
    i64: ToSql<BigInt, DB>,
    A: Column + QueryFragment<DB>,
    R: Column,
    R::SqlType: StampType<DB>,
    E: ErrorColumn<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_identifier(A::NAME)?;
        out.push_sql(" = ");
        out.push_identifier(A::NAME)?;
        out.push_sql(" + 1, ");
        out.push_identifier(R::NAME)?;
        out.push_sql(" = ");
        // Every value of the right-hand side is the row's before the update:
        // the attempts so far pick the delay.
        let delay = |mut out: AstPass<'_, 'b, DB>| -> QueryResult<()> {
            let Some((last, before)) = self.delays.split_last() else {
                out.push_sql("0");
                return Ok(());
            };
            if before.is_empty() {
                return out.push_bind_param::<BigInt, i64>(last);
            }
            out.push_sql("CASE ");
            out.push_identifier(A::NAME)?;
            for (failures, delay) in before.iter().enumerate() {
                out.push_sql(&format!(" WHEN {failures} THEN "));
                out.push_bind_param::<BigInt, i64>(delay)?;
            }
            out.push_sql(" ELSE ");
            out.push_bind_param::<BigInt, i64>(last)?;
            out.push_sql(" END");
            Ok(())
        };
        R::SqlType::walk_after(&delay, out.reborrow())?;
        self.error.walk_assign(&self.message, out)
    }
}
