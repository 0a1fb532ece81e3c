//! Predicates on the primary key, of one column or several: the key ranges a
//! claim pages through, and the key lists and subqueries it locks or marks by.
//! A key of several columns is compared as a row value, `(a, b) > ($1, $2)`,
//! which PostgreSQL, SQLite (3.15+), MySQL and MariaDB all read in the order of
//! the key's columns.

use diesel::associations::HasTable;
use diesel::backend::Backend;
use diesel::expression::{is_aggregate, AppearsOnTable, Expression, ValidGrouping};
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::serialize::ToSql;
use diesel::sql_types::{Bool, HasSqlType, SqlType};
use diesel::{Column, Identifiable, QueryResult, Table};

use std::sync::Arc;

use super::comparison::{untied, walk_expanded, walk_parts, Comparison, Part};
use super::order::RangeColumns;
use crate::backend::{strategy::Strategy, ClaimBackend};

/// A table's primary key as the key predicates compare and bind it, with `K`
/// its value: [`One`] column, or a [`Row`] of two or three.
pub trait KeyColumns<K, DB: Backend>: Copy {
    /// The number of columns.
    const COLUMNS: usize;
    /// Whether the key has several columns, compared as a row value.
    const ROW: bool = Self::COLUMNS > 1;

    /// `"t"."id"`, or `("t"."a", "t"."b")`.
    fn walk_columns<'b>(&'b self, out: AstPass<'_, 'b, DB>) -> QueryResult<()>;

    /// `$1`, or `($1, $2)`.
    fn walk_value<'b>(value: &'b K, out: AstPass<'_, 'b, DB>) -> QueryResult<()>;

    /// The key compared with `value` by `comparison`, in the order of the
    /// key's columns.
    fn walk_compare<'b>(
        &'b self,
        comparison: Comparison,
        value: &'b K,
        out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()> {
        self.walk_compare_untied(comparison, value, [false; 3], out)
    }

    /// The key compared with `value` by `comparison`, less the columns that
    /// `tied` marks (in the key's order): where the key is compared, they
    /// are known to equal their values (they are order terms, compared
    /// before it), and comparing them again would only repeat it. A key
    /// with every column tied is compared whole.
    fn walk_compare_untied<'b>(
        &'b self,
        comparison: Comparison,
        value: &'b K,
        tied: [bool; 3],
        out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()>;
}

/// A primary key of one column.
#[derive(Debug, Clone, Copy)]
pub struct One<C>(pub C);

/// A primary key of several columns, a tuple.
#[derive(Debug, Clone, Copy)]
pub struct Row<C>(pub C);

impl<C, K, DB> KeyColumns<K, DB> for One<C>
where
    DB: Backend + HasSqlType<C::SqlType>,
    C: Column + QueryFragment<DB> + Copy,
    C::SqlType: SqlType,
    K: ToSql<C::SqlType, DB>,
{
    const COLUMNS: usize = 1;

    fn walk_columns<'b>(&'b self, out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        self.0.walk_ast(out)
    }

    fn walk_value<'b>(value: &'b K, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_bind_param::<C::SqlType, K>(value)
    }

    /// Its one column tied, the key is compared whole (an order that holds
    /// the key is compared without it: [`Positioned`](super::Positioned)).
    fn walk_compare_untied<'b>(
        &'b self,
        comparison: Comparison,
        value: &'b K,
        _: [bool; 3],
        mut out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()> {
        self.0.walk_ast(out.reborrow())?;
        out.push_sql(comparison.sql());
        Self::walk_value(value, out)
    }
}

macro_rules! row_key {
    ($($column:ident $value:ident $index:tt),+) => {
        impl<$($column, $value,)+ DB> KeyColumns<($($value,)+), DB> for Row<($($column,)+)>
        where
            DB: ClaimBackend $(+ HasSqlType<$column::SqlType>)+,
            $(
                $column: Column + QueryFragment<DB> + Copy,
                $column::SqlType: SqlType,
                $value: ToSql<$column::SqlType, DB>,
            )+
        {
            const COLUMNS: usize = [$($index),+].len();

            fn walk_columns<'b>(&'b self, out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
                walk_parts(&[$(&|out| self.0.$index.walk_ast(out)),+], out)
            }

            fn walk_value<'b>(value: &'b ($($value,)+), out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
                walk_parts(&[$(
                    &|mut out| out.push_bind_param::<$column::SqlType, $value>(&value.$index)
                ),+], out)
            }

            fn walk_compare_untied<'b>(
                &'b self,
                comparison: Comparison,
                value: &'b ($($value,)+),
                tied: [bool; 3],
                mut out: AstPass<'_, 'b, DB>,
            ) -> QueryResult<()> {
                let columns: &[Part<'_, 'b, DB>] = &[$(&|out| self.0.$index.walk_ast(out)),+];
                let values: &[Part<'_, 'b, DB>] = &[$(
                    &|mut out| out.push_bind_param::<$column::SqlType, $value>(&value.$index)
                ),+];
                let (columns, values) = (untied(columns, tied), untied(values, tied));
                if <DB as Strategy>::ROW_VALUE_INDEXES {
                    walk_parts(&columns, out.reborrow())?;
                    out.push_sql(comparison.sql());
                    return walk_parts(&values, out);
                }
                walk_expanded(comparison, &columns, &values, out)
            }
        }
    };
}

row_key!(C0 K0 0, C1 K1 1);
row_key!(C0 K0 0, C1 K1 1, C2 K2 2);

/// A wrapped primary key, unwrapped for Diesel's `SELECT` and `ORDER BY`:
/// its column, or its tuple of columns.
pub trait WrappedKey: Copy {
    /// The column, or the tuple.
    type Columns: Copy;

    /// The key's columns, unwrapped.
    fn columns(self) -> Self::Columns;
}

impl<C: Copy> WrappedKey for One<C> {
    type Columns = C;

    fn columns(self) -> C {
        self.0
    }
}

impl<C: Copy> WrappedKey for Row<C> {
    type Columns = C;

    fn columns(self) -> C {
        self.0
    }
}

/// How the crate reads the key of rows `R` and wraps their table's primary key
/// for the key predicates, per shape of key: [`OneColumn`] for `&K` ids (a
/// single-column key), [`Columns2`] and [`Columns3`] for composite keys. The
/// shape comes from the rows' `Identifiable::Id` through [`IdShape`] (a
/// projection, which the compiler follows, where choosing among impls by
/// their bounds would leave it undecided).
pub trait KeyShape<R: HasTable> {
    /// The key's value: `K`, or a tuple of the columns' values (`Debug`:
    /// events show the keys of the rows they are about).
    type Key: Clone + Eq + std::hash::Hash + std::fmt::Debug;
    /// [`One`] or [`Row`] of the table's primary key.
    type Columns: WrappedKey;

    /// The key of a row.
    fn key(row: &R) -> Self::Key;

    /// The table's primary key, wrapped.
    fn columns() -> Self::Columns;
}

/// What an `Identifiable::Id` tells of its key's shape: `&K` is one column, a
/// tuple of references several.
pub trait IdShape {
    /// [`OneColumn`], [`Columns2`] or [`Columns3`].
    type Shape;
}

impl<K> IdShape for &K {
    type Shape = OneColumn;
}

impl<K0, K1> IdShape for (&K0, &K1) {
    type Shape = Columns2;
}

impl<K0, K1, K2> IdShape for (&K0, &K1, &K2) {
    type Shape = Columns3;
}

/// The shape of a single-column primary key.
#[derive(Debug, Clone, Copy)]
pub enum OneColumn {}

/// The shape of a primary key of two columns.
#[derive(Debug, Clone, Copy)]
pub enum Columns2 {}

/// The shape of a primary key of three columns.
#[derive(Debug, Clone, Copy)]
pub enum Columns3 {}

type PrimaryKey<R> = <<R as HasTable>::Table as Table>::PrimaryKey;

impl<R, K> KeyShape<R> for OneColumn
where
    R: HasTable,
    PrimaryKey<R>: Copy,
    for<'a> &'a R: Identifiable<Id = &'a K>,
    K: Clone + Eq + std::hash::Hash + std::fmt::Debug,
{
    type Key = K;
    type Columns = One<PrimaryKey<R>>;

    fn key(row: &R) -> K {
        row.id().clone()
    }

    fn columns() -> Self::Columns {
        One(R::table().primary_key())
    }
}

macro_rules! row_shape {
    ($shape:ident: $($value:ident $index:tt),+) => {
        impl<R, $($value),+> KeyShape<R> for $shape
        where
            R: HasTable,
            PrimaryKey<R>: Copy,
            for<'a> &'a R: Identifiable<Id = ($(&'a $value,)+)>,
            $($value: Clone + Eq + std::hash::Hash + std::fmt::Debug,)+
        {
            type Key = ($($value,)+);
            type Columns = Row<PrimaryKey<R>>;

            fn key(row: &R) -> Self::Key {
                let id = row.id();
                ($(id.$index.clone(),)+)
            }

            fn columns() -> Self::Columns {
                Row(R::table().primary_key())
            }
        }
    };
}

row_shape!(Columns2: K0 0, K1 1);
row_shape!(Columns3: K0 0, K1 1, K2 2);

/// The `Expression` side of a predicate on the key: a boolean that appears
/// on the key's table, is never an aggregate, and whose SQL is only known at
/// run time (Diesel then caches its statement by the SQL text).
macro_rules! key_predicate {
    ($name:ident<Column, $other:ident>) => {
        impl<Column, $other> Expression for $name<Column, $other> {
            type SqlType = Bool;
        }

        impl<Column, $other, QS> AppearsOnTable<QS> for $name<Column, $other> where
            Column: KeyOn<QS>
        {
        }

        impl<Column, $other, GroupBy> ValidGrouping<GroupBy> for $name<Column, $other> {
            type IsAggregate = is_aggregate::Never;
        }

        impl<Column, $other> QueryId for $name<Column, $other> {
            type QueryId = ();
            const HAS_STATIC_QUERY_ID: bool = false;
        }
    };
}

key_predicate!(InRange<Column, K>);
key_predicate!(InList<Column, K>);

/// A wrapped key whose columns are all of `QS`.
pub trait KeyOn<QS> {}

impl<C: AppearsOnTable<QS>, QS> KeyOn<QS> for One<C> {}

impl<C: AppearsOnTable<QS>, QS> KeyOn<QS> for Row<C> {}

/// A range of primary-key values, in the database's order of the key, less
/// the keys it excludes.
#[derive(Debug, Clone)]
pub struct KeyRange<K> {
    pub lower: Lower<K>,
    /// Inclusive upper bound.
    pub through: Option<K>,
    /// Keys left out wherever they fall: rows a worker backs off from, and
    /// rows a claim from the head of the queue has handed over already.
    pub excluded: Arc<[K]>,
    /// The only keys the range may hold, if it holds no others: the rows a
    /// worker records a failure of once the session that ran them is gone.
    pub among: Option<Arc<[K]>>,
}

/// The lower end of a [`KeyRange`].
#[derive(Debug, Clone)]
pub enum Lower<K> {
    Unbounded,
    /// Exclusive: the keyset cursor after the last key seen.
    After(K),
    /// Inclusive.
    From(K),
}

impl<K: Clone> KeyRange<K> {
    /// Keys from `lower` up to `through`, inclusive (no upper bound: `None`).
    pub fn new(lower: Lower<K>, through: Option<K>) -> Self {
        KeyRange {
            lower,
            through,
            excluded: Arc::new([]),
            among: None,
        }
    }

    /// Every key after `cursor` (every key when there is none).
    pub fn after(cursor: Option<K>) -> Self {
        Self::new(cursor.map_or(Lower::Unbounded, Lower::After), None)
    }

    /// Every key.
    pub fn whole() -> Self {
        Self::after(None)
    }

    /// Keys after `cursor` up to `through`, inclusive.
    pub fn between(cursor: Option<K>, through: K) -> Self {
        KeyRange {
            through: Some(through),
            ..Self::after(cursor)
        }
    }

    /// Just `key`.
    pub fn exactly(key: K) -> Self {
        Self::new(Lower::From(key.clone()), Some(key))
    }

    /// The same range, less `excluded`.
    pub fn excluding(self, excluded: Arc<[K]>) -> Self {
        KeyRange { excluded, ..self }
    }

    /// The same range, holding `among` alone (if `Some`).
    pub fn among(self, among: Option<Arc<[K]>>) -> Self {
        KeyRange { among, ..self }
    }
}

impl<K> KeyRange<K> {
    /// Whether the range holds every key: a statement in it is one on the
    /// whole query, with no condition of the range's.
    pub fn bounds_nothing(&self) -> bool {
        matches!(self.lower, Lower::Unbounded)
            && self.through.is_none()
            && self.excluded.is_empty()
            && self.among.is_none()
    }
}

/// `column` within a [`KeyRange`]: keyset pagination in the claim order (see
/// [`Positioned`](super::Positioned)), with one statement shape per kind of
/// range. A range that [bounds nothing](KeyRange::bounds_nothing) is no
/// condition: the statement is built without it ([`Ranged`](super::Ranged)).
#[derive(Debug, Clone)]
pub struct InRange<Column, K> {
    pub column: Column,
    pub range: KeyRange<K>,
}

impl<Column, K, DB> QueryFragment<DB> for InRange<Column, K>
where
    DB: Backend,
    Column: RangeColumns<K, DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        let lower = match &self.range.lower {
            Lower::Unbounded => None,
            Lower::After(key) => Some((Comparison::After, key)),
            Lower::From(key) => Some((Comparison::From, key)),
        };
        let through = (self.range.through.as_ref()).map(|key| (Comparison::Through, key));
        let bounds = [lower, through];
        let mut bounds = bounds.iter().flatten().peekable();
        let excluded = &self.range.excluded;
        let among = match self.range.among.as_deref() {
            Some([]) => {
                out.push_sql("1 = 0");
                return Ok(());
            }
            among => among.unwrap_or_default(),
        };
        if self.range.bounds_nothing() {
            return Err(diesel::result::Error::QueryBuilderError(
                "a claim's statement was given a range that bounds nothing".into(),
            ));
        }
        out.push_sql("(");
        let mut first = true;
        while let Some(&(comparison, key)) = bounds.next() {
            first = false;
            self.column.walk_compare(comparison, key, out.reborrow())?;
            if bounds.peek().is_some() {
                out.push_sql(" AND ");
            }
        }
        for (not, keys) in [("NOT ", &**excluded), ("", among)] {
            if keys.is_empty() {
                continue;
            }
            // The statement's text depends on the number of keys.
            out.unsafe_to_cache_prepared();
            if !std::mem::take(&mut first) {
                out.push_sql(" AND ");
            }
            out.push_sql(not);
            self.column.walk_among(keys, out.reborrow())?;
        }
        out.push_sql(")");
        Ok(())
    }
}

/// The key among the keys a subquery selects, evaluated once per statement:
/// PostgreSQL `= ANY(ARRAY(…))` (an `IN (…)` subquery with `LIMIT` and `SKIP
/// LOCKED` may be re-run by the planner and lock more rows than its limit),
/// SQLite `IN (…)`. `K` is the key's value type.
#[derive(Debug, Clone)]
pub struct KeysIn<Column, Subquery, K> {
    pub column: Column,
    pub subquery: Subquery,
    pub key: std::marker::PhantomData<K>,
}

impl<Column, Subquery, K, DB> QueryFragment<DB> for KeysIn<Column, Subquery, K>
where
    DB: ClaimBackend,
    Column: KeyColumns<K, DB>,
    Subquery: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        let (open, close) = if Column::ROW {
            <DB as Strategy>::ROW_KEYS_IN_SUBQUERY
        } else {
            <DB as Strategy>::KEYS_IN_SUBQUERY
        };
        self.column.walk_columns(out.reborrow())?;
        out.push_sql(open);
        self.subquery.walk_ast(out.reborrow())?;
        out.push_sql(close);
        Ok(())
    }
}

/// The key among a list: `column IN (?, ?, …)`, or for a key of several
/// columns `((a, b) = (?, ?) OR …)` (SQLite takes no list of row values
/// after `IN`). At least one key.
#[derive(Debug, Clone)]
pub struct InList<Column, K> {
    pub column: Column,
    pub keys: Vec<K>,
}

impl<Column, K, DB> QueryFragment<DB> for InList<Column, K>
where
    DB: Backend,
    Column: KeyColumns<K, DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        // The statement's text depends on the number of keys: Diesel caches
        // it by its text, one statement per length, up to a few keys (the
        // rows a job worker finishes one at a time among them), so that a
        // connection never holds more than a few such statements.
        if self.keys.len() > CACHED_LIST_LEN {
            out.unsafe_to_cache_prepared();
        }
        walk_in_list(&self.column, self.keys.iter(), out)
    }
}

/// Lists of keys up to this long are in statements Diesel may cache.
const CACHED_LIST_LEN: usize = 16;

/// `column IN (?, ?, …)`, or `((a, b) = (?, ?) OR …)` for a key of several
/// columns, in parentheses either way; at least one key.
pub(crate) fn walk_in_list<'b, Column, K, DB>(
    column: &'b Column,
    keys: impl Iterator<Item = &'b K>,
    mut out: AstPass<'_, 'b, DB>,
) -> QueryResult<()>
where
    DB: Backend,
    Column: KeyColumns<K, DB>,
    K: 'b,
{
    out.push_sql("(");
    if Column::ROW {
        for (index, key) in keys.enumerate() {
            if index > 0 {
                out.push_sql(" OR ");
            }
            column.walk_compare(Comparison::Equal, key, out.reborrow())?;
        }
    } else {
        column.walk_columns(out.reborrow())?;
        out.push_sql(" IN (");
        for (index, key) in keys.enumerate() {
            if index > 0 {
                out.push_sql(", ");
            }
            Column::walk_value(key, out.reborrow())?;
        }
        out.push_sql(")");
    }
    out.push_sql(")");
    Ok(())
}

#[cfg(all(test, feature = "postgres_backend", feature = "mysql_backend"))]
mod tests {
    use super::*;
    use crate::sql::order::{KeyOrder, Position, Positioned};

    diesel::table! {
        lines (order_id, line_no) {
            order_id -> Integer,
            line_no -> Integer,
        }
    }

    fn sql<DB: ClaimBackend>(fragment: &impl QueryFragment<DB>) -> String {
        crate::sql::rendered::render::<DB>(fragment).unwrap()
    }

    #[test]
    fn keys_of_two_columns_compare_as_row_values_or_column_by_column() {
        let range = InRange {
            column: Positioned::<KeyOrder, _>::new(
                Row((lines::order_id, lines::line_no)),
                [false; 3],
            ),
            range: KeyRange::between(Some(Position::of_key((1, 2))), Position::of_key((5, 6))),
        };
        assert_eq!(
            sql::<diesel::pg::Pg>(&range),
            r#"(("lines"."order_id", "lines"."line_no") > ($1, $2) AND ("lines"."order_id", "lines"."line_no") <= ($3, $4))"#
        );
        assert_eq!(
            sql::<diesel::mysql::Mysql>(&range),
            "((`lines`.`order_id` >= ? AND (`lines`.`order_id` > ? OR `lines`.`line_no` > ?)) AND \
             (`lines`.`order_id` <= ? AND (`lines`.`order_id` < ? OR `lines`.`line_no` <= ?)))"
        );
        let list = InList {
            column: Row((lines::order_id, lines::line_no)),
            keys: vec![(1, 2), (3, 4)],
        };
        assert_eq!(
            sql::<diesel::mysql::Mysql>(&list),
            "((`lines`.`order_id` = ? AND `lines`.`line_no` = ?) OR (`lines`.`order_id` = ? AND `lines`.`line_no` = ?))"
        );
        let one = InList {
            column: One(lines::order_id),
            keys: vec![1, 2],
        };
        assert_eq!(
            sql::<diesel::pg::Pg>(&one),
            r#"("lines"."order_id" IN ($1, $2))"#
        );
    }

    #[test]
    fn a_range_leaves_its_excluded_keys_out_and_holds_among_alone() {
        let column = || Positioned::<KeyOrder, _>::new(One(lines::order_id), [false; 3]);
        let whole = |among: Option<Arc<[Position<i32>]>>| InRange {
            column: column(),
            range: KeyRange::whole()
                .excluding(Arc::new([Position::of_key(3)]))
                .among(among),
        };
        assert_eq!(
            sql::<diesel::pg::Pg>(&whole(Some(Arc::new([Position::of_key(4)])))),
            r#"(NOT ("lines"."order_id" IN ($1)) AND ("lines"."order_id" IN ($2)))"#
        );
        assert_eq!(
            sql::<diesel::pg::Pg>(&whole(None)),
            r#"(NOT ("lines"."order_id" IN ($1)))"#
        );
        // Among no keys, no row.
        assert_eq!(sql::<diesel::pg::Pg>(&whole(Some(Arc::new([])))), "1 = 0");
        // Every key is no condition: the statement is built without it.
        let every = InRange {
            column: column(),
            range: KeyRange::<Position<i32>>::whole(),
        };
        assert!(every.range.bounds_nothing());
        assert!(crate::sql::rendered::render::<diesel::pg::Pg>(&every).is_err());
    }
}
