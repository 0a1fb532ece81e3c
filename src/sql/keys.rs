//! Predicates on the primary key: the key ranges a claim pages through, and
//! the key lists and subqueries it locks or marks by.

use diesel::backend::Backend;
use diesel::expression::{is_aggregate, AppearsOnTable, Expression, ValidGrouping};
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::sql_types::Bool;
use diesel::QueryResult;

use crate::backend::{strategy::Strategy, ClaimBackend};

/// The `Expression` side of a predicate on a key column: a boolean that
/// appears on the column's table, is never an aggregate, and whose SQL is only
/// known at run time (Diesel then caches its statement by the SQL text).
macro_rules! key_predicate {
    ($name:ident<Column, $other:ident>) => {
        impl<Column: Expression, $other> Expression for $name<Column, $other> {
            type SqlType = Bool;
        }

        impl<Column, $other, QS> AppearsOnTable<QS> for $name<Column, $other>
        where
            Self: Expression,
            Column: AppearsOnTable<QS>,
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
key_predicate!(KeysIn<Column, Subquery>);
key_predicate!(InList<Column, K>);

/// A range of primary-key values, in the database's order of the key.
#[derive(Debug, Clone)]
pub struct KeyRange<K> {
    pub lower: Lower<K>,
    /// Inclusive upper bound.
    pub through: Option<K>,
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
    /// Every key after `cursor` (every key when there is none).
    pub fn after(cursor: Option<K>) -> Self {
        KeyRange {
            lower: cursor.map_or(Lower::Unbounded, Lower::After),
            through: None,
        }
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
        KeyRange {
            lower: Lower::From(key.clone()),
            through: Some(key),
        }
    }
}

/// `column` within a [`KeyRange`]: keyset pagination over the primary key, with
/// one statement shape per kind of range.
#[derive(Debug, Clone)]
pub struct InRange<Column, K> {
    pub column: Column,
    pub range: KeyRange<K>,
}

impl<Column, K, DB> QueryFragment<DB> for InRange<Column, K>
where
    DB: Backend,
    Column: QueryFragment<DB> + Expression,
    K: diesel::serialize::ToSql<Column::SqlType, DB>,
    Column::SqlType: diesel::sql_types::SqlType,
    DB: diesel::sql_types::HasSqlType<Column::SqlType>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        let lower = match &self.range.lower {
            Lower::Unbounded => None,
            Lower::After(key) => Some((" > ", key)),
            Lower::From(key) => Some((" >= ", key)),
        };
        let through = self.range.through.as_ref().map(|key| (" <= ", key));
        let bounds = [lower, through];
        let mut bounds = bounds.iter().flatten().peekable();
        if bounds.peek().is_none() {
            out.push_sql("1 = 1");
            return Ok(());
        }
        out.push_sql("(");
        while let Some((operator, key)) = bounds.next() {
            self.column.walk_ast(out.reborrow())?;
            out.push_sql(operator);
            out.push_bind_param::<Column::SqlType, _>(*key)?;
            if bounds.peek().is_some() {
                out.push_sql(" AND ");
            }
        }
        out.push_sql(")");
        Ok(())
    }
}

/// `column` among the keys a subquery selects, evaluated once per statement:
/// PostgreSQL `= ANY(ARRAY(…))` (an `IN (…)` subquery with `LIMIT` and `SKIP
/// LOCKED` may be re-run by the planner and lock more rows than its limit),
/// SQLite `IN (…)`.
#[derive(Debug, Clone)]
pub struct KeysIn<Column, Subquery> {
    pub column: Column,
    pub subquery: Subquery,
}

impl<Column, Subquery, DB> QueryFragment<DB> for KeysIn<Column, Subquery>
where
    DB: ClaimBackend,
    Column: QueryFragment<DB>,
    Subquery: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        let (open, close) = <DB as Strategy>::KEYS_IN_SUBQUERY;
        self.column.walk_ast(out.reborrow())?;
        out.push_sql(open);
        self.subquery.walk_ast(out.reborrow())?;
        out.push_sql(close);
        Ok(())
    }
}

/// `column IN (?, ?, …)`, one bind per key (at least one key).
#[derive(Debug, Clone)]
pub struct InList<Column, K> {
    pub column: Column,
    pub keys: Vec<K>,
}

impl<Column, K, DB> QueryFragment<DB> for InList<Column, K>
where
    DB: Backend,
    Column: QueryFragment<DB> + Expression,
    K: diesel::serialize::ToSql<Column::SqlType, DB>,
    Column::SqlType: diesel::sql_types::SqlType,
    DB: diesel::sql_types::HasSqlType<Column::SqlType>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        // The statement's text depends on the number of keys.
        out.unsafe_to_cache_prepared();
        self.column.walk_ast(out.reborrow())?;
        out.push_sql(" IN (");
        for (index, key) in self.keys.iter().enumerate() {
            if index > 0 {
                out.push_sql(", ");
            }
            out.push_bind_param::<Column::SqlType, _>(key)?;
        }
        out.push_sql(")");
        Ok(())
    }
}
