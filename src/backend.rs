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
mod postgres {
    use super::strategy::Strategy;
    use super::*;
    use super::{LeaseQuery, LeaseStatement};
    use crate::query::LockClause;
    use crate::LockStrength;
    use diesel::connection::LoadConnection;
    use diesel::pg::Pg;
    use diesel::query_builder::AstPass;
    use diesel::{OptionalExtension, RunQueryDsl};

    impl ClaimBackend for Pg {}

    impl Strategy for Pg {
        const ROW_LOCKS: bool = true;
        const LOCK_OF: bool = true;
        const UPDATE_RETURNING: bool = true;

        // `ARRAY(subquery)` is an init plan, run exactly once.
        const KEYS_IN_SUBQUERY: (&'static str, &'static str) = (" = ANY(ARRAY(", "))");

        const MIGRATIONS: diesel_migrations::EmbeddedMigrations =
            diesel_migrations::embed_migrations!("migrations/postgres");

        fn walk_lock_clause(clause: &LockClause, mut out: AstPass<'_, '_, Pg>) -> QueryResult<()> {
            out.push_sql(match clause.strength {
                LockStrength::Update => " FOR UPDATE",
                LockStrength::NoKeyUpdate => " FOR NO KEY UPDATE",
                LockStrength::Share => " FOR SHARE",
                LockStrength::KeyShare => " FOR KEY SHARE",
            });
            if let Some(table) = &clause.of {
                out.push_sql(" OF ");
                out.push_identifier(table)?;
            }
            if clause.skip_locked {
                out.push_sql(" SKIP LOCKED");
            }
            Ok(())
        }

        fn query_builder() -> diesel::pg::PgQueryBuilder {
            Default::default()
        }

        fn begin_locking_transaction<C>(conn: &mut C) -> QueryResult<()>
        where
            C: Connection<Backend = Pg>,
        {
            C::TransactionManager::begin_transaction(conn)
        }

        // The database clock decides: `clock_timestamp()` rather than `now()`, which
        // is frozen at the start of a caller's surrounding transaction.
        fn lease_statement<C>(
            conn: &mut C,
            statement: LeaseStatement<'_>,
        ) -> QueryResult<Option<i64>>
        where
            C: LoadConnection<Backend = Self>,
        {
            LeaseQuery::new::<Self>(statement)
                .get_result(conn)
                .optional()
        }

        const LEASE_ACQUIRE: &'static str = "\
            INSERT INTO diesel_claim_leases AS lease (name, token, expires_at) \
            VALUES (?, 1, clock_timestamp() + ? * interval '1 microsecond') \
            ON CONFLICT (name) DO UPDATE \
            SET token = lease.token + 1, expires_at = excluded.expires_at \
            WHERE lease.expires_at <= clock_timestamp() \
            RETURNING token";
        const LEASE_RENEW: &'static str = "\
            UPDATE diesel_claim_leases \
            SET expires_at = clock_timestamp() + ? * interval '1 microsecond' \
            WHERE name = ? AND token = ? AND expires_at > clock_timestamp() \
            RETURNING token";
        const LEASE_RELEASE: &'static str = "\
            UPDATE diesel_claim_leases SET expires_at = clock_timestamp() \
            WHERE name = ? AND token = ? AND expires_at > clock_timestamp() \
            RETURNING token";
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::strategy::Strategy;
    use super::*;
    use super::{LeaseQuery, LeaseStatement};
    use crate::query::LockClause;
    use diesel::connection::LoadConnection;
    use diesel::connection::{TransactionDepthChange, TransactionManagerStatus};
    use diesel::query_builder::AstPass;
    use diesel::sqlite::Sqlite;
    use diesel::{OptionalExtension, RunQueryDsl};

    impl ClaimBackend for Sqlite {}

    /// Microseconds since the Unix epoch by SQLite's clock (`julianday` has
    /// millisecond precision).
    macro_rules! sqlite_now_micros {
        () => {
            "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)"
        };
    }

    impl Strategy for Sqlite {
        const ROW_LOCKS: bool = false;
        const LOCK_OF: bool = false;
        const UPDATE_RETURNING: bool = true;

        const KEYS_IN_SUBQUERY: (&'static str, &'static str) = (" IN (", ")");

        const MIGRATIONS: diesel_migrations::EmbeddedMigrations =
            diesel_migrations::embed_migrations!("migrations/sqlite");

        fn walk_lock_clause(_: &LockClause, _: AstPass<'_, '_, Sqlite>) -> QueryResult<()> {
            // No row locks: the transaction holds the database write lock instead.
            Ok(())
        }

        fn query_builder() -> diesel::sqlite::SqliteQueryBuilder {
            Default::default()
        }

        fn begin_locking_transaction<C>(conn: &mut C) -> QueryResult<()>
        where
            C: Connection<Backend = Sqlite>,
        {
            // Nested: a savepoint inside the caller's transaction, whose own lock
            // mode then decides. Top level: `BEGIN IMMEDIATE`, which takes the write
            // lock before the re-check reads, so two claimers cannot both see the
            // row as pending. Diesel's `immediate_transaction` is not available for
            // pooled connections, so the transaction manager is told by hand.
            if transaction_depth(conn)? > 0 {
                return C::TransactionManager::begin_transaction(conn);
            }
            // (`transaction_depth` above has also refused a broken transaction
            // manager, before any SQL.)
            conn.batch_execute("BEGIN IMMEDIATE")?;
            match C::TransactionManager::transaction_manager_status_mut(conn) {
                TransactionManagerStatus::Valid(status) => {
                    status.change_transaction_depth(TransactionDepthChange::IncreaseDepth)
                }
                TransactionManagerStatus::InError => {
                    Err(diesel::result::Error::BrokenTransactionManager)
                }
            }
        }

        fn lease_statement<C>(
            conn: &mut C,
            statement: LeaseStatement<'_>,
        ) -> QueryResult<Option<i64>>
        where
            C: LoadConnection<Backend = Self>,
        {
            LeaseQuery::new::<Self>(statement)
                .get_result(conn)
                .optional()
        }

        const LEASE_ACQUIRE: &'static str = concat!(
            "INSERT INTO diesel_claim_leases (name, token, expires_at) VALUES (?, 1, ",
            sqlite_now_micros!(),
            " + ?) ON CONFLICT (name) DO UPDATE \
            SET token = diesel_claim_leases.token + 1, expires_at = excluded.expires_at \
            WHERE diesel_claim_leases.expires_at <= ",
            sqlite_now_micros!(),
            " RETURNING token"
        );
        const LEASE_RENEW: &'static str = concat!(
            "UPDATE diesel_claim_leases SET expires_at = ",
            sqlite_now_micros!(),
            " + ? WHERE name = ? AND token = ? AND expires_at > ",
            sqlite_now_micros!(),
            " RETURNING token"
        );
        const LEASE_RELEASE: &'static str = concat!(
            "UPDATE diesel_claim_leases SET expires_at = ",
            sqlite_now_micros!(),
            " WHERE name = ? AND token = ? AND expires_at > ",
            sqlite_now_micros!(),
            " RETURNING token"
        );
    }
}

#[cfg(feature = "mysql")]
pub(crate) mod mysql {
    use super::strategy::Strategy;
    use super::LeaseStatement;
    use super::*;
    use crate::query::LockClause;
    use crate::LockStrength;
    use diesel::connection::LoadConnection;
    use diesel::mysql::Mysql;
    use diesel::query_builder::AstPass;
    use diesel::RunQueryDsl;

    impl ClaimBackend for Mysql {}

    /// Microseconds since the Unix epoch by the server's clock, whatever the
    /// session's time zone. `SYSDATE` rather than `NOW`, which is frozen for the
    /// statement (and replicated as such).
    macro_rules! mysql_now_micros {
        () => {
            "CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED)"
        };
    }

    impl Strategy for Mysql {
        const ROW_LOCKS: bool = true;
        // MySQL 8 has `OF`, MariaDB has not; the crate sends what both take.
        const LOCK_OF: bool = false;
        const UPDATE_RETURNING: bool = false;

        // MySQL refuses `LIMIT` in an `IN` subquery; marks are made by key there.
        const KEYS_IN_SUBQUERY: (&'static str, &'static str) = (" IN (", ")");

        const MIGRATIONS: diesel_migrations::EmbeddedMigrations =
            diesel_migrations::embed_migrations!("migrations/mysql");

        fn walk_lock_clause(
            clause: &LockClause,
            mut out: AstPass<'_, '_, Mysql>,
        ) -> QueryResult<()> {
            // A locking read can fail after sending some of its rows (a lock
            // wait timeout, a deadlock). MariaDB Connector/C then re-executes
            // the same prepared statement only after waiting for the rest of a
            // result set that the error ended: it hangs for ever. So locking
            // reads are prepared afresh each time, never cached.
            out.unsafe_to_cache_prepared();
            // InnoDB has no `NO KEY UPDATE` (a foreign-key check takes a shared
            // lock, which `FOR UPDATE` blocks) and, on MariaDB, no `FOR SHARE`.
            out.push_sql(match clause.strength {
                LockStrength::Update | LockStrength::NoKeyUpdate => " FOR UPDATE",
                LockStrength::Share | LockStrength::KeyShare => " LOCK IN SHARE MODE",
            });
            if clause.skip_locked {
                out.push_sql(" SKIP LOCKED");
            }
            Ok(())
        }

        fn query_builder() -> diesel::mysql::MysqlQueryBuilder {
            Default::default()
        }

        fn begin_locking_transaction<C>(conn: &mut C) -> QueryResult<()>
        where
            C: Connection<Backend = Mysql>,
        {
            C::TransactionManager::begin_transaction(conn)
        }

        // No `RETURNING`: see `lease_sql`.
        fn lease_statement<C>(
            conn: &mut C,
            statement: LeaseStatement<'_>,
        ) -> QueryResult<Option<i64>>
        where
            C: LoadConnection<Backend = Self>,
        {
            use lease_sql::{AfterTake, Token};
            let LeaseStatement::Acquire { name, ttl_micros } = statement else {
                let (update, token) = lease_sql::update(statement);
                return Ok(lease_sql::owned(update.execute(conn)?, token));
            };
            conn.batch_execute(lease_sql::READ_COMMITTED)?;
            conn.transaction(|conn| {
                let taken = lease_sql::take_expired(name, ttl_micros).execute(conn)?;
                Ok(match lease_sql::after_take(taken) {
                    AfterTake::ReadToken => {
                        let token: Token = lease_sql::read_token(name).get_result(conn)?;
                        Some(token.token)
                    }
                    AfterTake::InsertNew => {
                        lease_sql::inserted(lease_sql::insert_new(name, ttl_micros).execute(conn)?)
                    }
                })
            })
        }

        const LEASE_ACQUIRE: &'static str = concat!(
            "INSERT IGNORE INTO diesel_claim_leases (name, token, expires_at) VALUES (?, 1, ",
            mysql_now_micros!(),
            " + ?)"
        );
        const LEASE_RENEW: &'static str = concat!(
            "UPDATE diesel_claim_leases SET expires_at = ",
            mysql_now_micros!(),
            " + ? WHERE name = ? AND token = ? AND expires_at > ",
            mysql_now_micros!()
        );
        const LEASE_RELEASE: &'static str = concat!(
            "UPDATE diesel_claim_leases SET expires_at = ",
            mysql_now_micros!(),
            " WHERE name = ? AND token = ? AND expires_at > ",
            mysql_now_micros!()
        );
    }

    /// MySQL's lease statements, without `RETURNING`: they succeed by affected
    /// rows (Diesel counts the rows an `UPDATE` matched), and the acquiring
    /// `UPDATE`'s new token is read back under its row lock. Acquiring is one
    /// transaction at `READ COMMITTED`: without gap locks (which `REPEATABLE
    /// READ` takes), two acquirers of a new name would deadlock on their inserts.
    /// The blocking and the async drivers both run these, in this order:
    ///
    /// 1. [`READ_COMMITTED`], then in a transaction [`take_expired`]: an expired
    ///    lease taken over, under the row's lock;
    /// 2. as [`after_take`] says: [`read_token`] of the lease just taken, or
    ///    [`insert_new`] for a new name (token 1), whose affected rows
    ///    [`inserted`] reads: a live lease is left be.
    ///
    /// Renewing and releasing are one [`update`] each, read by [`owned`].
    pub(crate) mod lease_sql {
        use super::super::strategy::Strategy;
        use super::super::LeaseStatement;
        use diesel::mysql::Mysql;
        use diesel::query_builder::{BoxedSqlQuery, SqlQuery};
        use diesel::sql_types::{BigInt, Text};

        pub const READ_COMMITTED: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

        /// A statement with its arguments bound.
        pub type LeaseSql<'a> = BoxedSqlQuery<'a, Mysql, SqlQuery>;

        fn sql_query(sql: &str) -> LeaseSql<'_> {
            diesel::sql_query(sql).into_boxed()
        }

        pub fn take_expired(name: &str, ttl_micros: i64) -> LeaseSql<'_> {
            sql_query(MYSQL_TAKE_EXPIRED)
                .bind::<BigInt, _>(ttl_micros)
                .bind::<Text, _>(name)
        }

        /// What follows [`take_expired`] having changed `taken` rows.
        pub enum AfterTake {
            ReadToken,
            InsertNew,
        }

        pub fn after_take(taken: usize) -> AfterTake {
            if taken == 1 {
                AfterTake::ReadToken
            } else {
                AfterTake::InsertNew
            }
        }

        pub fn read_token(name: &str) -> LeaseSql<'_> {
            sql_query(MYSQL_TOKEN).bind::<Text, _>(name)
        }

        pub fn insert_new(name: &str, ttl_micros: i64) -> LeaseSql<'_> {
            sql_query(<Mysql as Strategy>::LEASE_ACQUIRE)
                .bind::<Text, _>(name)
                .bind::<BigInt, _>(ttl_micros)
        }

        /// The token a new name's lease starts at, if the insert took it.
        pub fn inserted(rows: usize) -> Option<i64> {
            (rows == 1).then_some(1)
        }

        /// The statement that renews or releases (not acquires), and the
        /// lease's token.
        pub fn update(statement: LeaseStatement<'_>) -> (LeaseSql<'_>, i64) {
            match statement {
                LeaseStatement::Renew {
                    name,
                    token,
                    ttl_micros,
                } => (
                    sql_query(<Mysql as Strategy>::LEASE_RENEW)
                        .bind::<BigInt, _>(ttl_micros)
                        .bind::<Text, _>(name)
                        .bind::<BigInt, _>(token),
                    token,
                ),
                LeaseStatement::Release { name, token } => (
                    sql_query(<Mysql as Strategy>::LEASE_RELEASE)
                        .bind::<Text, _>(name)
                        .bind::<BigInt, _>(token),
                    token,
                ),
                LeaseStatement::Acquire { .. } => unreachable!("acquiring is not an update"),
            }
        }

        /// The token, if the update changed the lease's row.
        pub fn owned(rows: usize, token: i64) -> Option<i64> {
            (rows == 1).then_some(token)
        }

        pub const MYSQL_TAKE_EXPIRED: &str = concat!(
            "UPDATE diesel_claim_leases SET token = token + 1, expires_at = ",
            mysql_now_micros!(),
            " + ? WHERE name = ? AND expires_at <= ",
            mysql_now_micros!()
        );
        pub const MYSQL_TOKEN: &str = "SELECT token FROM diesel_claim_leases WHERE name = ?";

        #[derive(diesel::QueryableByName)]
        pub struct Token {
            #[diesel(sql_type = BigInt)]
            pub token: i64,
        }
    }
}
