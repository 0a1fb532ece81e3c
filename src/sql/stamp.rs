//! The claim stamp of a visibility-timeout claim: a timestamp column of the
//! caller's table that holds, while a row is claimed, when its claim runs
//! out, by the database clock.
//!
//! Every stamp is written and compared by the database, never by a client's
//! clock. A claim stamps a row only where its stamp is null or already past
//! `now`, and stamps it `now + ttl` in the same statement, so a new stamp is
//! always later than the one it replaces: a row's stamp tells its claims
//! apart, and serves as the fencing token of the claim that wrote it. The
//! crate reads a stamp as microseconds since the Unix epoch (SQLite keeps
//! milliseconds), in SQL, so no date-time crate is needed to hold it.

use std::marker::PhantomData;

use diesel::backend::Backend;
use diesel::expression::{is_aggregate, AppearsOnTable, Expression, ValidGrouping};
use diesel::query_builder::{
    AsQuery, AstPass, BoxedSelectStatement, FromClause, QueryFragment, QueryId, SelectStatement,
};
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, Bool, HasSqlType, Nullable, Timestamp};
use diesel::{Column, QueryResult, QuerySource};

use crate::reusable::Reusable;

/// A column type a visibility-timeout claim can keep its stamp in, on the
/// backend `DB`: a nullable timestamp (null: not claimed).
///
/// - PostgreSQL: `timestamptz` or `timestamp` (kept in UTC);
/// - MySQL and MariaDB: `DATETIME(6)` (kept in UTC; without the `(6)`,
///   stamps lose their fractions of a second), or `TIMESTAMP(6)` (declared
///   `Timestamp`, compared with the session's clock);
/// - SQLite: `TIMESTAMP`, as text `YYYY-MM-DD HH:MM:SS.SSS` (UTC).
///
/// A column of another type is refused where it is given to
/// `visibility_timeout`, by [`NullableTimestamp`], which says so.
pub trait StampType<DB: Backend> {
    /// The type holds nulls.
    #[doc(hidden)]
    const NULLABLE: bool;

    /// The database clock now, as a value of the column's type.
    #[doc(hidden)]
    fn walk_now(out: AstPass<'_, '_, DB>) -> QueryResult<()>;

    /// The database clock `micros` microseconds from now, as a value of the
    /// column's type.
    #[doc(hidden)]
    fn walk_later<'b>(micros: &'b i64, out: AstPass<'_, 'b, DB>) -> QueryResult<()>;

    /// The database clock `offset` (an expression of microseconds) from
    /// now, as a value of the column's type.
    #[doc(hidden)]
    fn walk_after<'b>(offset: Offset<'_, 'b, DB>, out: AstPass<'_, 'b, DB>) -> QueryResult<()>;

    /// `column`'s value as microseconds since the Unix epoch.
    #[doc(hidden)]
    fn walk_micros<'b>(
        column: &'b dyn QueryFragment<DB>,
        out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()>;
}

/// A column a visibility-timeout claim can keep its stamp in: a nullable
/// timestamp column.
pub trait StampColumn: Column + Copy {}

impl<Col> StampColumn for Col
where
    Col: Column + Copy,
    Col::SqlType: NullableTimestamp<Col>,
{
}

/// What a typed query reads: `T` of its `FROM T`, a table, or a join (of
/// which no column is [`ColumnOf`]).
pub trait QueryTable {
    /// The table.
    type Table;
}

impl<T, S, D, W, O, LOf, G, H, LC> QueryTable
    for SelectStatement<FromClause<T>, S, D, W, O, LOf, G, H, LC>
where
    T: QuerySource,
{
    type Table = T;
}

impl<T, ST, DB, G> QueryTable for BoxedSelectStatement<'_, ST, FromClause<T>, DB, G>
where
    T: QuerySource,
{
    type Table = T;
}

/// A visibility-timeout column given to a claim of the query `Q`, which
/// the crate builds each statement from ([`Reusable`]), and which reads one
/// table. (The column is `Self` so that the compiler checks this where the
/// column is given, and says there why a boxed query is refused.)
pub trait StampedQuery<Q> {
    /// The table the query reads.
    type ClaimedTable;
}

impl<Col, Q> StampedQuery<Q> for Col
where
    Q: Reusable<Query: AsQuery<Query: QueryTable>>,
{
    type ClaimedTable = <<Q::Query as AsQuery>::Query as QueryTable>::Table;
}

/// The table a query given to a visibility-timeout claim with the column
/// `Col` reads.
pub type TableOf<Q, Col> = <Col as StampedQuery<Q>>::ClaimedTable;

/// Implemented by what a claim's query reads where it is the table `T` of
/// its visibility-timeout column `Col`. Where the column is of another
/// table, or the query reads a join, the claim's column is left unknown
/// ([`Column`](Self::Column) is told only for `T` itself), and the compiler
/// reports this error alone, and none for the later calls on the claim.
/// (`Self` is what the query reads and `T` the column's table: the
/// refusal shows a join in short, where a parameter would show it with
/// every path.)
#[diagnostic::on_unimplemented(
    message = "the visibility-timeout column `{Col}` is a column of `{T}`, and the claim does \
               not take its rows from `{T}` alone",
    label = "the claim does not read this column's table alone",
    note = "the stamp column belongs to the one table the claim's query reads: give \
            `visibility_timeout` a column of that table",
    note = "a claim with a visibility timeout reads that one table: where a join chooses its \
            rows, filter the table by a subquery instead (`.filter(id.eq_any(…))`)"
)]
pub trait ColumnOf<T, Col> {
    /// `Col`.
    type Column;

    /// `column`, as [`Column`](Self::Column).
    #[doc(hidden)]
    fn column(column: Col) -> Self::Column;
}

// `Self` is what the query reads, so that only the column's table finds this
// impl.
impl<T, Col> ColumnOf<T, Col> for T {
    type Column = Col;

    fn column(column: Col) -> Col {
        column
    }
}

/// `Col`, where it is a nullable timestamp column of the table `Q` reads.
pub type Checked<Col, Q> =
    <TableOf<Q, Col> as ColumnOf<<Col as Column>::Table, Timestamped<Col>>>::Column;

/// `Col`, where it is a nullable timestamp column.
pub type Timestamped<Col> = <<Col as Expression>::SqlType as NullableTimestamp<Col>>::Column;

/// The SQL types a claim stamp can be kept in, on one backend or another
/// ([`StampType`] says which backend takes which), as the type of the
/// column `Col`. Where a column of another type is given, the claim's column
/// is left unknown ([`Column`](Self::Column) is told only for these types),
/// and the compiler reports this error alone, and none for the later calls
/// on the claim.
#[diagnostic::on_unimplemented(
    message = "the visibility-timeout column must be a nullable timestamp column, and `{Col}` is \
               of type `{Self}`",
    label = "not a nullable timestamp column",
    note = "declare the column `Nullable<Timestamptz>` or `Nullable<Timestamp>` on PostgreSQL, \
            `Nullable<Datetime>` (`DATETIME(6)`) on MySQL, `Nullable<Timestamp>` on SQLite"
)]
pub trait NullableTimestamp<Col> {
    /// `Col`.
    type Column;

    /// `column`, as [`Column`](Self::Column).
    #[doc(hidden)]
    fn column(column: Col) -> Self::Column;
}

/// The impl of [`NullableTimestamp`] for each of `$sql_type`s.
macro_rules! nullable_timestamp {
    ($($(#[$cfg:meta])* $sql_type:ty),*) => {$(
        $(#[$cfg])*
        // The refusal's note names these types, as the backends take them.
        #[diagnostic::do_not_recommend]
        impl<Col> NullableTimestamp<Col> for Nullable<$sql_type> {
            type Column = Col;

            fn column(column: Col) -> Col {
                column
            }
        }
    )*};
}

nullable_timestamp!(
    Timestamp,
    #[cfg(feature = "postgres_backend")]
    diesel::sql_types::Timestamptz,
    #[cfg(feature = "mysql_backend")]
    diesel::sql_types::Datetime
);

// A nullable type is read and written as its values' type: a nullable
// column's null is tested apart (`IS NULL`). Told as the nullable type it
// is, where the compiler stops here.
#[diagnostic::do_not_recommend]
impl<DB: Backend, T: StampType<DB>> StampType<DB> for Nullable<T> {
    const NULLABLE: bool = true;

    fn walk_now(out: AstPass<'_, '_, DB>) -> QueryResult<()> {
        T::walk_now(out)
    }

    fn walk_later<'b>(micros: &'b i64, out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        T::walk_later(micros, out)
    }

    fn walk_after<'b>(offset: Offset<'_, 'b, DB>, out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        T::walk_after(offset, out)
    }

    fn walk_micros<'b>(
        column: &'b dyn QueryFragment<DB>,
        out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()> {
        T::walk_micros(column, out)
    }
}

/// Renders an offset from the database clock now, in microseconds: a
/// bound count, or an expression of the row's columns.
pub type Offset<'o, 'b, DB> = &'o dyn Fn(AstPass<'_, 'b, DB>) -> QueryResult<()>;

/// Renders `micros`, bound.
#[cfg(any(
    feature = "postgres_backend",
    feature = "mysql_backend",
    feature = "sqlite"
))]
fn bound_micros<'b, DB>(micros: &'b i64) -> impl Fn(AstPass<'_, 'b, DB>) -> QueryResult<()>
where
    DB: Backend + HasSqlType<BigInt>,
    i64: ToSql<BigInt, DB>,
{
    move |mut out| out.push_bind_param::<BigInt, i64>(micros)
}

#[cfg(feature = "postgres_backend")]
mod pg {
    use super::*;
    use diesel::pg::Pg;
    use diesel::sql_types::{Timestamp, Timestamptz};

    /// `statement_timestamp()` rather than `now()`: it moves on with each
    /// statement, also inside a caller's transaction, yet is one value within
    /// a statement, so the stamp a claim writes is later than the `now` it
    /// compared the old stamp with.
    fn walk_micros_pg<'b>(
        column: &'b dyn QueryFragment<Pg>,
        mut out: AstPass<'_, 'b, Pg>,
    ) -> QueryResult<()> {
        // Exact: a timestamp is a count of microseconds.
        out.push_sql("round(EXTRACT(EPOCH FROM ");
        column.walk_ast(out.reborrow())?;
        out.push_sql(") * 1000000)::int8");
        Ok(())
    }

    fn walk_after_pg<'b>(
        now: &'static str,
        offset: Offset<'_, 'b, Pg>,
        mut out: AstPass<'_, 'b, Pg>,
    ) -> QueryResult<()> {
        out.push_sql("(");
        out.push_sql(now);
        out.push_sql(" + (");
        offset(out.reborrow())?;
        out.push_sql(") * INTERVAL '1 microsecond')");
        Ok(())
    }

    const NOW_TZ: &str = "statement_timestamp()";
    const NOW_UTC: &str = "(statement_timestamp() AT TIME ZONE 'UTC')";

    /// `timestamptz` and `timestamp` (kept in UTC), read from `$now`.
    macro_rules! pg_clock {
        ($($sql_type:ty => $now:expr),+) => {$(
            impl StampType<Pg> for $sql_type {
                const NULLABLE: bool = false;

                fn walk_now(mut out: AstPass<'_, '_, Pg>) -> QueryResult<()> {
                    out.push_sql($now);
                    Ok(())
                }

                fn walk_later<'b>(micros: &'b i64, out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
                    walk_after_pg($now, &bound_micros(micros), out)
                }

                fn walk_after<'b>(
                    offset: Offset<'_, 'b, Pg>,
                    out: AstPass<'_, 'b, Pg>,
                ) -> QueryResult<()> {
                    walk_after_pg($now, offset, out)
                }

                fn walk_micros<'b>(
                    column: &'b dyn QueryFragment<Pg>,
                    out: AstPass<'_, 'b, Pg>,
                ) -> QueryResult<()> {
                    walk_micros_pg(column, out)
                }
            }
        )+};
    }

    pg_clock!(Timestamptz => NOW_TZ, Timestamp => NOW_UTC);
}

#[cfg(feature = "mysql_backend")]
mod mysql {
    use super::*;
    use diesel::mysql::Mysql;
    use diesel::sql_types::{Datetime, Timestamp};

    fn walk_after_mysql<'b>(
        now: &'static str,
        offset: Offset<'_, 'b, Mysql>,
        mut out: AstPass<'_, 'b, Mysql>,
    ) -> QueryResult<()> {
        out.push_sql("(");
        out.push_sql(now);
        out.push_sql(" + INTERVAL (");
        offset(out.reborrow())?;
        out.push_sql(") MICROSECOND)");
        Ok(())
    }

    /// `DATETIME(6)`, kept in UTC whatever the session's time zone; MySQL
    /// reads the clock once per statement.
    impl StampType<Mysql> for Datetime {
        const NULLABLE: bool = false;

        fn walk_now(mut out: AstPass<'_, '_, Mysql>) -> QueryResult<()> {
            out.push_sql("UTC_TIMESTAMP(6)");
            Ok(())
        }

        fn walk_later<'b>(micros: &'b i64, out: AstPass<'_, 'b, Mysql>) -> QueryResult<()> {
            Self::walk_after(&bound_micros(micros), out)
        }

        fn walk_after<'b>(
            offset: Offset<'_, 'b, Mysql>,
            out: AstPass<'_, 'b, Mysql>,
        ) -> QueryResult<()> {
            walk_after_mysql("UTC_TIMESTAMP(6)", offset, out)
        }

        fn walk_micros<'b>(
            column: &'b dyn QueryFragment<Mysql>,
            mut out: AstPass<'_, 'b, Mysql>,
        ) -> QueryResult<()> {
            out.push_sql("TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', ");
            column.walk_ast(out.reborrow())?;
            out.push_sql(")");
            Ok(())
        }
    }

    /// `TIMESTAMP(6)`, which MySQL keeps in UTC and shows in the session's
    /// time zone: compared with the session's `NOW(6)`, and read as a count
    /// since the epoch whatever the zone.
    impl StampType<Mysql> for Timestamp {
        const NULLABLE: bool = false;

        fn walk_now(mut out: AstPass<'_, '_, Mysql>) -> QueryResult<()> {
            out.push_sql("NOW(6)");
            Ok(())
        }

        fn walk_later<'b>(micros: &'b i64, out: AstPass<'_, 'b, Mysql>) -> QueryResult<()> {
            Self::walk_after(&bound_micros(micros), out)
        }

        fn walk_after<'b>(
            offset: Offset<'_, 'b, Mysql>,
            out: AstPass<'_, 'b, Mysql>,
        ) -> QueryResult<()> {
            walk_after_mysql("NOW(6)", offset, out)
        }

        fn walk_micros<'b>(
            column: &'b dyn QueryFragment<Mysql>,
            mut out: AstPass<'_, 'b, Mysql>,
        ) -> QueryResult<()> {
            out.push_sql("CAST(UNIX_TIMESTAMP(");
            column.walk_ast(out.reborrow())?;
            out.push_sql(") * 1000000 AS SIGNED)");
            Ok(())
        }
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use diesel::sql_types::Timestamp;
    use diesel::sqlite::Sqlite;

    /// Text in one fixed format, so that stamps compare as strings. SQLite
    /// reads `'now'` once per statement.
    const FORMAT: &str = "strftime('%Y-%m-%d %H:%M:%f', ";

    impl StampType<Sqlite> for Timestamp {
        const NULLABLE: bool = false;

        fn walk_now(mut out: AstPass<'_, '_, Sqlite>) -> QueryResult<()> {
            out.push_sql(FORMAT);
            out.push_sql("'now')");
            Ok(())
        }

        fn walk_later<'b>(micros: &'b i64, out: AstPass<'_, 'b, Sqlite>) -> QueryResult<()> {
            Self::walk_after(&bound_micros(micros), out)
        }

        fn walk_after<'b>(
            offset: Offset<'_, 'b, Sqlite>,
            mut out: AstPass<'_, 'b, Sqlite>,
        ) -> QueryResult<()> {
            out.push_sql(FORMAT);
            out.push_sql("julianday('now') + (");
            offset(out.reborrow())?;
            out.push_sql(") / 86400000000.0)");
            Ok(())
        }

        fn walk_micros<'b>(
            column: &'b dyn QueryFragment<Sqlite>,
            mut out: AstPass<'_, 'b, Sqlite>,
        ) -> QueryResult<()> {
            // `julianday` keeps whole milliseconds; its double is within a
            // twentieth of one, so the rounding is exact.
            out.push_sql("(CAST(ROUND((julianday(");
            column.walk_ast(out.reborrow())?;
            out.push_sql(") - 2440587.5) * 86400000.0) AS INTEGER) * 1000)");
            Ok(())
        }
    }
}

/// `(<column> IS NULL OR <column> < <now>)`: the row is not claimed, or its
/// claim has run out.
#[derive(Debug, Clone, Copy)]
pub struct StampPassed<Col>(pub Col);

/// `<column>` as microseconds since the Unix epoch.
#[derive(Debug, Clone, Copy)]
pub struct StampMicros<Col>(pub Col);

/// `<column> = <now + micros>`: a new stamp, as an assignment.
#[derive(Debug, Clone, Copy)]
pub struct NewStamp<Col> {
    pub column: Col,
    pub micros: i64,
}

/// `<changes>, <column> = NULL` (just the latter when `changes` is empty):
/// the claim's final write, which ends it.
#[derive(Debug, Clone)]
pub struct ThenUnstamp<Changes, Col> {
    pub changes: Option<Changes>,
    pub column: PhantomData<Col>,
}

/// `<key> = <value> AND <stamp micros> = <stamp>`: the claimed row, while it
/// still carries this claim's stamp.
#[derive(Debug, Clone)]
pub struct StillStamped<KeyColumns, K, Col> {
    pub key_columns: KeyColumns,
    pub key: K,
    pub column: Col,
    pub stamp: i64,
}

/// The SQL of these nodes is only known at run time (Diesel then caches
/// their statements by the SQL text).
macro_rules! query_id_at_run_time {
    ($($node:ident$(<$($param:ident),+>)?),+) => {$(
        impl$(<$($param),+>)? QueryId for $node$(<$($param),+>)? {
            type QueryId = ();
            const HAS_STATIC_QUERY_ID: bool = false;
        }
    )+};
}

query_id_at_run_time!(
    StampPassed<Col>,
    StampMicros<Col>,
    NewStamp<Col>,
    ThenUnstamp<Changes, Col>,
    StillStamped<KeyColumns, K, Col>,
    CountRows
);

/// An expression on one column of a table, never an aggregate, of the SQL
/// type given.
macro_rules! column_expression {
    ($($node:ident: $sql_type:ty),+) => {$(
        impl<Col> Expression for $node<Col> {
            type SqlType = $sql_type;
        }

        impl<Col: AppearsOnTable<QS>, QS> AppearsOnTable<QS> for $node<Col> {}

        impl<Col, GroupBy> ValidGrouping<GroupBy> for $node<Col> {
            type IsAggregate = is_aggregate::Never;
        }
    )+};
}

column_expression!(StampPassed: Bool, StampMicros: BigInt);

impl<Col, DB> QueryFragment<DB> for StampPassed<Col>
where
    DB: Backend,
    Col: Column + QueryFragment<DB>,
    Col::SqlType: StampType<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("(");
        self.0.walk_ast(out.reborrow())?;
        out.push_sql(" IS NULL OR ");
        self.0.walk_ast(out.reborrow())?;
        out.push_sql(" < ");
        Col::SqlType::walk_now(out.reborrow())?;
        out.push_sql(")");
        Ok(())
    }
}

impl<Col, DB> QueryFragment<DB> for StampMicros<Col>
where
    DB: Backend,
    Col: Column + QueryFragment<DB>,
    Col::SqlType: StampType<DB>,
{
    fn walk_ast<'b>(&'b self, out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        Col::SqlType::walk_micros(&self.0, out)
    }
}

impl<Col, DB> QueryFragment<DB> for NewStamp<Col>
where
    DB: Backend,
    Col: Column,
    Col::SqlType: StampType<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_identifier(Col::NAME)?;
        out.push_sql(" = ");
        Col::SqlType::walk_later(&self.micros, out)
    }
}

impl<Changes, Col, DB> QueryFragment<DB> for ThenUnstamp<Changes, Col>
where
    DB: Backend,
    Changes: QueryFragment<DB>,
    Col: Column,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        if let Some(changes) = &self.changes {
            changes.walk_ast(out.reborrow())?;
            out.push_sql(", ");
        }
        out.push_identifier(Col::NAME)?;
        out.push_sql(" = NULL");
        Ok(())
    }
}

impl<KeyColumns, K, Col, DB> QueryFragment<DB> for StillStamped<KeyColumns, K, Col>
where
    DB: Backend + HasSqlType<BigInt>,
    i64: ToSql<BigInt, DB>,
    KeyColumns: super::KeyColumns<K, DB>,
    Col: Column + QueryFragment<DB>,
    Col::SqlType: StampType<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        self.key_columns
            .walk_compare(super::Comparison::Equal, &self.key, out.reborrow())?;
        out.push_sql(" AND ");
        Col::SqlType::walk_micros(&self.column, out.reborrow())?;
        out.push_sql(" = ");
        out.push_bind_param::<BigInt, i64>(&self.stamp)
    }
}

/// `COUNT(*)`: what a probe for a row selects.
#[derive(Debug, Clone, Copy)]
pub struct CountRows;

impl Expression for CountRows {
    type SqlType = BigInt;
}

impl<DB: Backend> QueryFragment<DB> for CountRows {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("COUNT(*)");
        Ok(())
    }
}
