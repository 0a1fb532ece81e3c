//! The SQL nodes this crate adds to the caller's queries, and the statements it
//! renders itself.
//!
//! Diesel's own locking clauses cannot be named in generic code (their marker types
//! are private) and boxed queries cannot be locked at all, so [`Locked`] appends the
//! clause itself, to any query, rendered by the backend.

mod keys;
mod statements;

pub use keys::{InList, InRange, KeyRange, KeysIn, Lower};
pub use statements::{Returning, SelectWhere, Update, VersionProbe};

use std::sync::Arc;

use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::{QueryResult, RunQueryDsl};

use crate::backend::{strategy::Strategy, ClaimBackend};
use crate::locking::LockClause;
use crate::Error;

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

/// The table a locking clause is restricted to (`OF …`), on backends that have it.
pub fn lock_target<T, DB>(table: &T) -> Result<Option<Arc<str>>, Error>
where
    T: diesel::Table,
    T::FromClause: QueryFragment<DB>,
    DB: ClaimBackend,
{
    if !<DB as Strategy>::LOCK_OF {
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
