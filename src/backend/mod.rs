//! What differs between databases, behind one sealed trait.

use diesel::backend::Backend;
use diesel::connection::{Connection, TransactionManager};
use diesel::QueryResult;

/// A database backend this crate supports: `diesel::pg::Pg` (feature
/// `postgres`), `diesel::sqlite::Sqlite` (feature `sqlite`) and
/// `diesel::mysql::Mysql` (feature `mysql`, for MySQL 8.0.1+ and MariaDB 10.6+).
///
/// The trait is sealed; its methods are the crate's internal backend strategy.
#[diagnostic::on_unimplemented(
    message = "diesel-claim does not support the backend `{Self}`",
    note = "enable the diesel-claim feature of your backend: `postgres`, `sqlite` or `mysql`"
)]
pub trait ClaimBackend: Backend + Default + strategy::Strategy {}

pub(crate) mod strategy {
    use super::*;
    use crate::query::LockClause;
    use diesel::connection::LoadConnection;
    use diesel::query_builder::AstPass;

    /// How a backend locks rows and stores leases. Not nameable outside the crate.
    pub trait Strategy: Backend {
        /// Whether the backend has row locks (and a locking clause to append).
        const ROW_LOCKS: bool;

        /// Whether the locking clause can name the one table to lock (`OF`).
        const LOCK_OF: bool;

        /// Whether `UPDATE … RETURNING` exists.
        const UPDATE_RETURNING: bool;

        /// The SQL on either side of a subquery of keys, as in
        /// `<key><open>subquery<close>`, run once per statement.
        const KEYS_IN_SUBQUERY: (&'static str, &'static str);

        /// The crate's embedded migrations for this backend.
        const MIGRATIONS: diesel_migrations::EmbeddedMigrations;

        /// Appends the locking clause (after the query's own `LIMIT`).
        fn walk_lock_clause(clause: &LockClause, out: AstPass<'_, '_, Self>) -> QueryResult<()>;

        /// A fresh query builder, to render SQL outside a statement.
        fn query_builder() -> Self::QueryBuilder;

        /// Opens the transaction a claim or `with_lock` runs in, taking whatever
        /// lock the backend needs up front (SQLite: the database write lock).
        fn begin_locking_transaction<C>(conn: &mut C) -> QueryResult<()>
        where
            C: Connection<Backend = Self>;

        /// Runs one lease statement; `Some(token)` when it took effect.
        fn lease_statement<C>(
            conn: &mut C,
            statement: LeaseStatement<'_>,
        ) -> QueryResult<Option<i64>>
        where
            C: LoadConnection<Backend = Self>;

        // The lease statements' SQL, with `?` where the arguments go, in the
        // order `LeaseStatement::arguments` gives them.
        /// `(name, ttl in µs) -> token`: takes a free or expired lease.
        const LEASE_ACQUIRE: &'static str;
        /// `(ttl in µs, name, token) -> token`: extends a live lease still owned.
        const LEASE_RENEW: &'static str;
        /// `(name, token) -> token`: ends a live lease still owned.
        const LEASE_RELEASE: &'static str;
    }
}

/// A statement on the lease table, with its arguments.
#[derive(Debug, Clone, Copy)]
pub enum LeaseStatement<'a> {
    Acquire {
        name: &'a str,
        ttl_micros: i64,
    },
    Renew {
        name: &'a str,
        token: i64,
        ttl_micros: i64,
    },
    Release {
        name: &'a str,
        token: i64,
    },
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) use lease_query::LeaseQuery;

/// Lease statements as queries; only backends with `RETURNING` run them.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod lease_query {
    use super::*;
    use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
    use diesel::serialize::ToSql;
    use diesel::sql_types::{BigInt, HasSqlType, Text};
    use diesel::RunQueryDsl;

    impl LeaseStatement<'_> {
        /// The arguments, in the order the statements' SQL takes them.
        fn arguments(&self) -> Vec<Argument<'_>> {
            match self {
                LeaseStatement::Acquire { name, ttl_micros } => {
                    vec![Argument::Text(name), Argument::BigInt(ttl_micros)]
                }
                LeaseStatement::Renew {
                    name,
                    token,
                    ttl_micros,
                } => vec![
                    Argument::BigInt(ttl_micros),
                    Argument::Text(name),
                    Argument::BigInt(token),
                ],
                LeaseStatement::Release { name, token } => {
                    vec![Argument::Text(name), Argument::BigInt(token)]
                }
            }
        }
    }

    enum Argument<'a> {
        Text(&'a str),
        BigInt(&'a i64),
    }

    /// A lease statement as a query Diesel prepares once per connection and caches:
    /// the backend's SQL, each `?` in it replaced by the next argument's bind.
    pub struct LeaseQuery<'a> {
        sql: &'static str,
        statement: LeaseStatement<'a>,
    }

    impl<'a> LeaseQuery<'a> {
        pub fn new<DB: strategy::Strategy>(statement: LeaseStatement<'a>) -> Self {
            let sql = match statement {
                LeaseStatement::Acquire { .. } => DB::LEASE_ACQUIRE,
                LeaseStatement::Renew { .. } => DB::LEASE_RENEW,
                LeaseStatement::Release { .. } => DB::LEASE_RELEASE,
            };
            LeaseQuery { sql, statement }
        }
    }

    impl QueryId for LeaseQuery<'_> {
        type QueryId = ();
        // Three statements share the type; Diesel then caches each by its SQL.
        const HAS_STATIC_QUERY_ID: bool = false;
    }

    impl Query for LeaseQuery<'_> {
        type SqlType = BigInt;
    }

    impl<DB> QueryFragment<DB> for LeaseQuery<'_>
    where
        DB: Backend + HasSqlType<Text> + HasSqlType<BigInt>,
        str: ToSql<Text, DB>,
        i64: ToSql<BigInt, DB>,
    {
        fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
            let mut pieces = self.sql.split('?');
            out.push_sql(pieces.next().unwrap_or_default());
            for (argument, piece) in self.statement.arguments().into_iter().zip(pieces) {
                match argument {
                    Argument::Text(text) => out.push_bind_param::<Text, str>(text)?,
                    Argument::BigInt(number) => out.push_bind_param::<BigInt, i64>(number)?,
                }
                out.push_sql(piece);
            }
            Ok(())
        }
    }

    impl<Conn> RunQueryDsl<Conn> for LeaseQuery<'_> {}
}

/// How deep the connection's transaction nesting is (0: none open).
pub(crate) fn transaction_depth<C: Connection>(conn: &mut C) -> QueryResult<u32> {
    let status = C::TransactionManager::transaction_manager_status_mut(conn);
    Ok(status.transaction_depth()?.map_or(0, |depth| depth.get()))
}

#[cfg(feature = "postgres")]
mod pg;

#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "mysql")]
pub(crate) mod mysql;
