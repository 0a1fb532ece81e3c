//! Query fragments this crate adds to the caller's queries.
//!
//! Diesel's own locking clauses cannot be named in generic code (their marker types
//! are private) and boxed queries cannot be locked at all, so [`Locked`] appends the
//! clause itself, to any query, rendered by the backend.

use diesel::backend::Backend;
use diesel::expression::{is_aggregate, AppearsOnTable, Expression, ValidGrouping};
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::Bool;
use diesel::{QueryResult, RunQueryDsl};

use crate::backend::ClaimBackend;

/// How strongly a row is locked (PostgreSQL `FOR …` clauses).
///
/// The default, [`NoKeyUpdate`](LockStrength::NoKeyUpdate), is the weakest lock that
/// still excludes every other claimer and every `UPDATE` of the row, while letting
/// foreign-key inserts that reference the row go ahead. SQLite has no row locks and
/// ignores the strength: it always takes the database write lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum LockStrength {
    /// `FOR UPDATE`: also blocks foreign-key checks (`FOR KEY SHARE`) on the row.
    Update,
    /// `FOR NO KEY UPDATE`: excludes writers and other lockers, not FK checks.
    #[default]
    NoKeyUpdate,
    /// `FOR SHARE`: shared with other `FOR SHARE` readers, excludes writers.
    /// For [`with_lock`](crate::LockDsl::with_lock) only: claims need an
    /// exclusive lock.
    Share,
    /// `FOR KEY SHARE`: only excludes deletes and key updates. For
    /// [`with_lock`](crate::LockDsl::with_lock) only.
    KeyShare,
}

/// What to do when the row is already locked by another transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OnLocked {
    /// Leave it to whoever holds it (`SKIP LOCKED`).
    Skip,
    /// Return [`Error::LockNotAvailable`](crate::Error::LockNotAvailable) at once.
    Fail,
    /// Wait for the lock (bounded only by the session's `lock_timeout`).
    Wait,
}

/// A row-locking clause: strength, wait policy, and the table it is restricted to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockClause {
    pub strength: LockStrength,
    /// `SKIP LOCKED` when true, otherwise wait. [`OnLocked::Fail`] is carried out as a
    /// skip followed by an unlocked existence check, which tells "locked" from "gone"
    /// without an error that would abort the caller's transaction.
    pub skip_locked: bool,
    /// Unqualified name of the only table whose rows are locked (`OF …`).
    pub of: Option<std::sync::Arc<str>>,
}

/// The lock options both builders share, and the first invalid choice made on
/// a builder, reported when it runs, before any SQL.
#[derive(Debug, Clone, Default)]
pub struct LockOptions {
    strength: LockStrength,
    on_locked: Option<OnLocked>,
    invalid: Option<String>,
}

impl LockOptions {
    /// Chooses a wait policy; a second, different one is a conflict.
    pub fn on_locked(&mut self, policy: OnLocked) {
        match self.on_locked {
            Some(chosen) if chosen != policy => self.reject(format!(
                "conflicting lock policies: {chosen:?} and {policy:?} were both chosen"
            )),
            _ => self.on_locked = Some(policy),
        }
    }

    pub fn strength(&mut self, strength: LockStrength) {
        self.strength = strength;
    }

    /// Records an invalid choice; the first one is reported.
    pub fn reject(&mut self, reason: String) {
        self.invalid.get_or_insert(reason);
    }

    /// The chosen policy (or `default`) and the clause that carries it out, or
    /// the first invalid choice.
    pub fn resolve(
        self,
        default: OnLocked,
        of: impl FnOnce() -> Result<Option<std::sync::Arc<str>>, crate::Error>,
    ) -> Result<(OnLocked, LockClause), crate::Error> {
        if let Some(reason) = self.invalid {
            return Err(crate::Error::InvalidArgument(reason));
        }
        let on_locked = self.on_locked.unwrap_or(default);
        let clause = LockClause {
            strength: self.strength,
            skip_locked: on_locked != OnLocked::Wait,
            of: of()?,
        };
        Ok((on_locked, clause))
    }
}

/// The caller's query with a locking clause appended.
#[derive(Debug, Clone)]
pub struct Locked<Q> {
    pub query: Q,
    /// `None` reads without locking: the existence check after a skipped row.
    pub clause: Option<LockClause>,
}

impl<Q: QueryId> QueryId for Locked<Q> {
    type QueryId = ();
    // The clause varies at run time; Diesel then caches the statement by its SQL.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Q: Query> Query for Locked<Q> {
    type SqlType = Q::SqlType;
}

impl<Q, DB> QueryFragment<DB> for Locked<Q>
where
    DB: ClaimBackend,
    Q: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        self.query.walk_ast(out.reborrow())?;
        match &self.clause {
            Some(clause) => DB::walk_lock_clause(clause, out),
            None => Ok(()),
        }
    }
}

impl<Q, Conn> RunQueryDsl<Conn> for Locked<Q> {}

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
        let (open, close) = <DB as crate::backend::strategy::Strategy>::KEYS_IN_SUBQUERY;
        self.column.walk_ast(out.reborrow())?;
        out.push_sql(open);
        self.subquery.walk_ast(out.reborrow())?;
        out.push_sql(close);
        Ok(())
    }
}

/// `UPDATE <table> SET <changes> WHERE <filter>`.
///
/// Diesel's own update statement cannot be named in generic code (its `WHERE`
/// clause types are private), so the marking claim renders its own.
#[derive(Debug, Clone)]
pub struct Update<From, Changes, Where> {
    /// The table's `FROM` clause.
    pub from: From,
    pub changes: Changes,
    pub filter: Where,
}

impl<From, Changes, Where> QueryId for Update<From, Changes, Where> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<From, Changes, Where, DB> QueryFragment<DB> for Update<From, Changes, Where>
where
    DB: Backend,
    From: QueryFragment<DB>,
    Changes: QueryFragment<DB>,
    Where: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("UPDATE ");
        self.from.walk_ast(out.reborrow())?;
        out.push_sql(" SET ");
        self.changes.walk_ast(out.reborrow())?;
        out.push_sql(" WHERE ");
        self.filter.walk_ast(out.reborrow())
    }
}

impl<From, Changes, Where, Conn> RunQueryDsl<Conn> for Update<From, Changes, Where> {}

/// `<statement> RETURNING <columns>`.
#[derive(Debug, Clone)]
pub struct Returning<Statement, Columns> {
    pub statement: Statement,
    pub columns: Columns,
}

impl<Statement, Columns> QueryId for Returning<Statement, Columns> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Statement, Columns: Expression> Query for Returning<Statement, Columns> {
    type SqlType = Columns::SqlType;
}

impl<Statement, Columns, DB> QueryFragment<DB> for Returning<Statement, Columns>
where
    DB: Backend,
    Statement: QueryFragment<DB>,
    Columns: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        self.statement.walk_ast(out.reborrow())?;
        out.push_sql(" RETURNING ");
        self.columns.walk_ast(out.reborrow())
    }
}

impl<Statement, Columns, Conn> RunQueryDsl<Conn> for Returning<Statement, Columns> {}

/// `SELECT <columns> FROM <table> WHERE <filter>`.
#[derive(Debug, Clone)]
pub struct SelectWhere<Columns, From, Where> {
    pub columns: Columns,
    /// The table's `FROM` clause.
    pub from: From,
    pub filter: Where,
}

impl<Columns, From, Where> QueryId for SelectWhere<Columns, From, Where> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Columns: Expression, From, Where> Query for SelectWhere<Columns, From, Where> {
    type SqlType = Columns::SqlType;
}

impl<Columns, From, Where, DB> QueryFragment<DB> for SelectWhere<Columns, From, Where>
where
    DB: Backend,
    Columns: QueryFragment<DB>,
    From: QueryFragment<DB>,
    Where: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("SELECT ");
        self.columns.walk_ast(out.reborrow())?;
        out.push_sql(" FROM ");
        self.from.walk_ast(out.reborrow())?;
        out.push_sql(" WHERE ");
        self.filter.walk_ast(out.reborrow())
    }
}

impl<Columns, From, Where, Conn> RunQueryDsl<Conn> for SelectWhere<Columns, From, Where> {}

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

/// `SELECT <version> FROM <table> <where>`: reads the version of the row an update
/// targeted, to tell a conflict from a missing row.
#[derive(Debug, Clone)]
pub struct VersionProbe<From, Where, Column> {
    /// The table's `FROM` clause.
    pub from: From,
    pub where_clause: Where,
    pub column: Column,
}

impl<Table, Where, Column> QueryId for VersionProbe<Table, Where, Column> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Table, Where, Column: Expression> Query for VersionProbe<Table, Where, Column> {
    type SqlType = Column::SqlType;
}

impl<From, Where, Column, DB> QueryFragment<DB> for VersionProbe<From, Where, Column>
where
    DB: Backend,
    From: QueryFragment<DB>,
    Where: QueryFragment<DB>,
    Column: diesel::Column,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("SELECT ");
        out.push_identifier(Column::NAME)?;
        out.push_sql(" FROM ");
        self.from.walk_ast(out.reborrow())?;
        self.where_clause.walk_ast(out.reborrow())
    }
}

impl<Table, Where, Column, Conn> RunQueryDsl<Conn> for VersionProbe<Table, Where, Column> {}

/// The table a locking clause is restricted to (`OF …`), on backends that have it.
pub fn lock_target<T, DB>(table: &T) -> Result<Option<std::sync::Arc<str>>, crate::Error>
where
    T: diesel::Table,
    T::FromClause: QueryFragment<DB>,
    DB: ClaimBackend,
{
    if !<DB as crate::backend::strategy::Strategy>::LOCK_OF {
        return Ok(None);
    }
    Ok(Some(unqualified_table_name::<T, DB>(table)?.into()))
}

/// The unqualified name of a table, as `OF` needs it: the last identifier of its
/// rendered `FROM` clause (`"orders"` or `"shop"."orders"` gives `orders`).
fn unqualified_table_name<T, DB>(table: &T) -> QueryResult<String>
where
    T: diesel::Table,
    T::FromClause: QueryFragment<DB>,
    DB: ClaimBackend,
{
    use diesel::query_builder::QueryBuilder;
    let mut builder = DB::query_builder();
    table.from_clause().to_sql(&mut builder, &DB::default())?;
    let rendered = builder.finish();
    last_identifier(&rendered).ok_or_else(|| {
        diesel::result::Error::QueryBuilderError(
            format!("cannot find the table name in `{rendered}`").into(),
        )
    })
}

/// The last identifier of a dotted, possibly quoted name; quotes are `"` or `` ` ``
/// and doubled inside a quoted name.
fn last_identifier(name: &str) -> Option<String> {
    let name = name.trim();
    let Some(quote) = name.chars().last().filter(|c| *c == '"' || *c == '`') else {
        return name
            .rsplit('.')
            .next()
            .filter(|s| !s.is_empty())
            .map(str::to_owned);
    };
    let body = &name[..name.len() - 1];
    let mut identifier = String::new();
    let mut chars = body.chars().rev().peekable();
    while let Some(c) = chars.next() {
        if c != quote {
            identifier.push(c);
        } else if chars.peek() == Some(&quote) {
            chars.next();
            identifier.push(quote);
        } else {
            return Some(identifier.chars().rev().collect());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::last_identifier;

    #[test]
    fn last_identifier_of_rendered_table_names() {
        assert_eq!(last_identifier(r#""orders""#).as_deref(), Some("orders"));
        assert_eq!(
            last_identifier(r#""shop"."orders""#).as_deref(),
            Some("orders")
        );
        assert_eq!(
            last_identifier(r#""a""b"."c.""d""#).as_deref(),
            Some(r#"c."d"#)
        );
        assert_eq!(
            last_identifier("`shop`.`orders`").as_deref(),
            Some("orders")
        );
        assert_eq!(last_identifier("shop.orders").as_deref(), Some("orders"));
        assert_eq!(last_identifier(r#"unterminated""#), None);
    }
}
