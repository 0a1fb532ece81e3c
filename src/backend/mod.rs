//! What differs between databases, behind one sealed trait.

use diesel::backend::Backend;
use diesel::deserialize::{self, FromSql, Queryable};
use diesel::sql_types::SingleValue;

/// A database backend this crate supports: `diesel::pg::Pg` (feature
/// `postgres` or `postgres_backend`), `diesel::sqlite::Sqlite` (feature
/// `sqlite`) and `diesel::mysql::Mysql` (feature `mysql` or `mysql_backend`,
/// for MySQL 8.0.1+ and MariaDB 10.6+).
///
/// The trait is sealed; its methods are the crate's internal backend strategy.
#[diagnostic::on_unimplemented(
    message = "diesel-claim does not support the backend `{Self}`",
    note = "enable the diesel-claim feature of your backend: `postgres`, `sqlite` or `mysql` \
            (`postgres_backend`, `mysql_backend` without Diesel's blocking connections); \
            a `#[derive(MultiConnection)]` backend is not supported: match on your connection \
            enum and claim through the connection inside it"
)]
pub trait ClaimBackend: Backend + Default + strategy::Strategy {}

pub(crate) mod strategy {
    use diesel::backend::Backend;
    use diesel::connection::LoadConnection;
    use diesel::query_builder::AstPass;
    use diesel::QueryResult;

    use super::LeaseStatement;
    use crate::locking::LockClause;

    /// How a backend locks rows and stores leases. Not nameable outside the crate.
    pub trait Strategy: Backend {
        /// Whether the backend has row locks (and a locking clause to append).
        const ROW_LOCKS: bool;

        /// Whether the locking clause can name the one table to lock (`OF`).
        const LOCK_OF: bool;

        /// Whether `UPDATE … RETURNING` exists.
        const UPDATE_RETURNING: bool;

        /// Whether a contended claim's pages grow (see the claim engine's
        /// `Paging::grow`): larger pages spread many workers over more rows,
        /// at the cost of reading more keys per page.
        const GROW_CONTENDED_PAGES: bool;

        /// The SQL on either side of a subquery of keys, as in
        /// `<key><open>subquery<close>`, run once per statement.
        const KEYS_IN_SUBQUERY: (&'static str, &'static str);

        /// Whether a row-value comparison of a key of several columns,
        /// `(a, b) > ($1, $2)`, is read with the key's index.
        const ROW_VALUE_INDEXES: bool;

        /// The same for a key of several columns, `(a, b)<open>subquery<close>`.
        const ROW_KEYS_IN_SUBQUERY: (&'static str, &'static str);

        /// Whether a prepared statement whose read failed partway cannot be
        /// run again on a blocking connection, so that the statements a
        /// connection caches are dropped after a locking transaction fails
        /// (`transaction::drop_stranded_statements`).
        const FAILED_READS_STRAND_STATEMENTS: bool = false;

        /// The crate's embedded migrations for this backend.
        #[cfg(feature = "migrations")]
        const MIGRATIONS: diesel_migrations::EmbeddedMigrations;

        /// The statement that bounds how long each statement after it, in
        /// the transaction it runs in, may take: a claim's
        /// [`timeout`](crate::ClaimBuilder::timeout), for the statements of
        /// its closure. `None` where the backend has no such bound for a
        /// transaction alone (MySQL, MariaDB, SQLite).
        fn bound_statements(_timeout: std::time::Duration) -> Option<String> {
            None
        }

        /// Appends the locking clause (after the query's own `LIMIT`).
        fn walk_lock_clause(clause: &LockClause, out: AstPass<'_, '_, Self>) -> QueryResult<()>;

        /// A fresh query builder, to render SQL outside a statement.
        fn query_builder() -> Self::QueryBuilder;

        /// Opens the transaction a claim or `with_lock` runs in, on a connection
        /// `depth` transactions deep, taking whatever lock the backend needs up
        /// front (SQLite: the database write lock; with `nowait`, at once or
        /// not at all).
        fn begin_locking_transaction<C>(conn: &mut C, depth: u32, nowait: bool) -> QueryResult<()>
        where
            C: LoadConnection<Backend = Self>;

        /// Applies the crate's pending migrations, recorded in its own history
        /// (`history.rs`).
        #[cfg(feature = "migrations")]
        fn run_migrations<C>(conn: &mut C) -> Result<(), crate::Error>
        where
            C: LoadConnection<Backend = Self> + 'static;

        /// Runs one lease statement; `Some(token)` when it took effect.
        fn lease_statement<C>(
            conn: &mut C,
            statement: LeaseStatement<'_>,
        ) -> QueryResult<Option<i64>>
        where
            C: LoadConnection<Backend = Self>;
    }
}

/// A statement on the lease table, with its arguments.
#[derive(Debug, Clone, Copy)]
pub enum LeaseStatement<'a> {
    /// Takes the lease on `name` if it is free or has expired, with a new token.
    Acquire { name: &'a str, ttl_micros: i64 },
    /// Makes a live lease still held with `token` expire `after_micros` from
    /// now: a renewal, or with 0 a release.
    Expire {
        name: &'a str,
        token: i64,
        after_micros: i64,
    },
}

#[cfg(any(
    feature = "postgres_backend",
    feature = "sqlite",
    feature = "mysql_backend"
))]
pub(crate) use lease_query::{LeaseQuery, LeaseSql};

#[cfg(any(
    feature = "postgres_backend",
    feature = "sqlite",
    feature = "mysql_backend"
))]
mod lease_query {
    use diesel::backend::Backend;
    use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
    use diesel::{QueryResult, RunQueryDsl};

    /// A lease statement written with Diesel's DSL, its type left unnamed
    /// (`impl Trait`): this wrapper makes it runnable by both APIs' `RunQueryDsl`.
    #[derive(Debug, Clone)]
    pub struct LeaseQuery<Q>(pub Q);

    /// What a backend's lease statement is: SQL with its binds, safe to prepare
    /// once and cache, and to hold across an `.await`.
    pub trait LeaseSql<DB: Backend>: QueryFragment<DB> + QueryId + Send {}

    impl<T, DB: Backend> LeaseSql<DB> for T where T: QueryFragment<DB> + QueryId + Send {}

    impl<Q: QueryId> QueryId for LeaseQuery<Q> {
        type QueryId = Q::QueryId;
        const HAS_STATIC_QUERY_ID: bool = Q::HAS_STATIC_QUERY_ID;
    }

    impl<Q: Query> Query for LeaseQuery<Q> {
        type SqlType = Q::SqlType;
    }

    impl<Q: QueryFragment<DB>, DB: Backend> QueryFragment<DB> for LeaseQuery<Q> {
        fn walk_ast<'b>(&'b self, pass: AstPass<'_, 'b, DB>) -> QueryResult<()> {
            self.0.walk_ast(pass)
        }
    }

    impl<Q, Conn> RunQueryDsl<Conn> for LeaseQuery<Q> {}
}

/// Runs a lease statement on a backend whose statements return the lease's
/// token (`RETURNING`), built by its `acquire` and `expire`.
#[cfg(any(feature = "postgres_backend", feature = "sqlite"))]
fn run_returning<'s, C, A, X>(
    conn: &mut C,
    statement: LeaseStatement<'s>,
    acquire: impl FnOnce(&'s str, i64) -> A,
    expire: impl FnOnce(&'s str, i64, i64) -> X,
) -> diesel::QueryResult<Option<i64>>
where
    C: diesel::connection::LoadConnection,
    A: diesel::query_dsl::LoadQuery<'s, C, i64>,
    X: diesel::query_dsl::LoadQuery<'s, C, i64>,
{
    use diesel::OptionalExtension;
    match statement {
        LeaseStatement::Acquire { name, ttl_micros } => acquire(name, ttl_micros).get_result(conn),
        LeaseStatement::Expire {
            name,
            token,
            after_micros,
        } => expire(name, token, after_micros).get_result(conn),
    }
    .optional()
}

#[cfg(all(
    feature = "migrations",
    any(
        feature = "postgres_backend",
        feature = "sqlite",
        feature = "mysql_backend"
    )
))]
mod history;

#[cfg(feature = "postgres_backend")]
pub(crate) mod pg;

#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "mysql_backend")]
pub(crate) mod mysql;

/// A value of an order column, as the database sent it, to bind back with the
/// column's type (each backend's file reads and writes it).
#[derive(Debug, Clone)]
pub enum OrderValue {
    /// PostgreSQL's binary format, MySQL's bind buffer, an SQLite blob.
    Bytes(Vec<u8>),
    /// A MySQL integer of any width, an SQLite integer.
    Integer(i64),
    /// An SQLite real.
    Real(f64),
    /// An SQLite text.
    Text(String),
}

/// Loaded as itself, from any one column (what `#[derive(FromSqlRow)]` would
/// write, for every column type at once).
impl<ST, DB> Queryable<ST, DB> for OrderValue
where
    DB: Backend,
    ST: SingleValue,
    OrderValue: FromSql<ST, DB>,
{
    type Row = Self;

    fn build(value: Self) -> deserialize::Result<Self> {
        Ok(value)
    }
}
