//! PostgreSQL: row locks with `OF` and `SKIP LOCKED`, leases by the
//! server's `clock_timestamp()`.

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
    fn lease_statement<C>(conn: &mut C, statement: LeaseStatement<'_>) -> QueryResult<Option<i64>>
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
