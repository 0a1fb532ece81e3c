//! MySQL and MariaDB: row locks without `OF`, and leases without `RETURNING`.

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

    fn walk_lock_clause(clause: &LockClause, mut out: AstPass<'_, '_, Mysql>) -> QueryResult<()> {
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
    fn lease_statement<C>(conn: &mut C, statement: LeaseStatement<'_>) -> QueryResult<Option<i64>>
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
