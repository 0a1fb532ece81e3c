//! The SQL nodes this crate adds to the caller's queries, and the statements it
//! renders itself.
//!
//! Diesel's own locking clauses cannot be named in generic code (their marker types
//! are private) and boxed queries cannot be locked at all, so [`Locked`] appends the
//! clause itself, to any query, rendered by the backend.

mod comparison;
mod keys;
pub(crate) mod order;
mod order_by;
mod ranged;
pub mod rendered;
pub(crate) mod retry;
pub mod stamp;
mod statements;

pub use comparison::Comparison;
pub use keys::{IdShape, InList, InRange, KeyColumns, KeyRange, KeyShape, KeysIn, Lower};
pub use order::{ClaimOrder, OrderTerms, Position, Positioned, QueryOrder};
pub use ranged::{BuildOn, Ordered, Ranged, Selected};
pub use statements::{Delete, Returning, SelectWhere, Update, VersionProbe};

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
    Ok(Some(
        rendered::unqualified_table_name::<T, DB>(table)?.into(),
    ))
}
