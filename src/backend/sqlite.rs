//! SQLite: no row locks; the database write lock (`BEGIN IMMEDIATE`) instead,
//! and leases by SQLite's own clock.

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

    fn lease_statement<C>(conn: &mut C, statement: LeaseStatement<'_>) -> QueryResult<Option<i64>>
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
