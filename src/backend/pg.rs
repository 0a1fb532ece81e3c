//! PostgreSQL: row locks with `OF` and `SKIP LOCKED`, leases by the
//! server's `clock_timestamp()`.

use diesel::connection::{LoadConnection, TransactionManager};
use diesel::deserialize::{self, FromSql};
use diesel::dsl::IntervalDsl;
use diesel::pg::Pg;
use diesel::pg::PgValue;
use diesel::prelude::*;
use diesel::query_builder::{AstPass, Query};
use diesel::serialize::{self, IsNull, Output, ToSql};
use diesel::sql_types::{BigInt, SingleValue};
use diesel::upsert::excluded;
use std::io::Write;

use super::strategy::Strategy;
use super::OrderValue;
use super::{run_returning, ClaimBackend, LeaseQuery, LeaseSql, LeaseStatement};
use crate::locking::{LockClause, LockStrength};

impl ClaimBackend for Pg {}

impl Strategy for Pg {
    const ROW_LOCKS: bool = true;
    const LOCK_OF: bool = true;
    const UPDATE_RETURNING: bool = true;
    const GROW_CONTENDED_PAGES: bool = true;

    // `ARRAY(subquery)` is an init plan, run exactly once.
    const KEYS_IN_SUBQUERY: (&'static str, &'static str) = (" = ANY(ARRAY(", "))");
    // A row of the key from each of the subquery's rows, in an array built
    // once, as for one column.
    const ROW_VALUE_INDEXES: bool = true;
    const ROW_KEYS_IN_SUBQUERY: (&'static str, &'static str) =
        (" = ANY(ARRAY(SELECT ROW(k.*) FROM (", ") AS k))");

    #[cfg(feature = "migrations")]
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

    // Row locks are taken by the statements, with their own wait policy.
    // For this transaction only (the caller's, for a claim inside it),
    // after which the session's own applies.
    fn bound_statements(timeout: std::time::Duration) -> Option<String> {
        Some(format!(
            "SET LOCAL statement_timeout = {}",
            timeout.as_millis().max(1)
        ))
    }

    fn begin_locking_transaction<C>(conn: &mut C, _depth: u32, _nowait: bool) -> QueryResult<()>
    where
        C: LoadConnection<Backend = Self>,
    {
        C::TransactionManager::begin_transaction(conn)
    }

    #[cfg(feature = "migrations")]
    fn run_migrations<C>(conn: &mut C) -> Result<(), crate::Error>
    where
        C: LoadConnection<Backend = Self> + 'static,
    {
        super::history::run(conn, Self::MIGRATIONS)
    }

    fn lease_statement<C>(conn: &mut C, statement: LeaseStatement<'_>) -> QueryResult<Option<i64>>
    where
        C: LoadConnection<Backend = Self>,
    {
        run_returning(conn, statement, acquire, expire)
    }
}

diesel::table! {
    /// The lease table, as the crate's migration creates it.
    diesel_claim_leases (name) {
        name -> Text,
        token -> BigInt,
        expires_at -> Timestamptz,
    }
}

diesel::define_sql_function! {
    /// The time as the statement runs. The database clock decides, and
    /// `now()` would be frozen at the start of a caller's transaction.
    fn clock_timestamp() -> Timestamptz;
}

// `clock_timestamp() + interval`.
diesel::operator_allowed!(clock_timestamp, Add, add);

/// Takes the lease on `name` for `ttl_micros` if it is free or has expired:
/// its new token, or no row.
pub(crate) fn acquire(
    lease: &str,
    ttl_micros: i64,
) -> LeaseQuery<impl LeaseSql<Pg> + Query<SqlType = BigInt> + '_> {
    use self::diesel_claim_leases::dsl::*;
    // (`FilterDsl` spelled out: the prelude's `QueryDsl::filter` is for selects.)
    let upsert = diesel::insert_into(diesel_claim_leases)
        .values((
            name.eq(lease),
            token.eq(1),
            expires_at.eq(clock_timestamp() + ttl_micros.microseconds()),
        ))
        .on_conflict(name)
        .do_update()
        .set((token.eq(token + 1), expires_at.eq(excluded(expires_at))));
    LeaseQuery(
        diesel::query_dsl::methods::FilterDsl::filter(upsert, expires_at.le(clock_timestamp()))
            .returning(token),
    )
}

/// Makes the live lease on `name` held with `held` expire `after_micros` from
/// now: its token, or no row if it has expired or been taken.
pub(crate) fn expire(
    lease: &str,
    held: i64,
    after_micros: i64,
) -> LeaseQuery<impl LeaseSql<Pg> + Query<SqlType = BigInt> + '_> {
    use self::diesel_claim_leases::dsl::*;
    let live = diesel_claim_leases
        .find(lease)
        .filter(token.eq(held))
        .filter(expires_at.gt(clock_timestamp()));
    LeaseQuery(
        diesel::update(live)
            .set(expires_at.eq(clock_timestamp() + after_micros.microseconds()))
            .returning(token),
    )
}

/// An order value in PostgreSQL's binary format, bound back as read: the
/// bind has the column's type, as the value had.
impl<ST: SingleValue> FromSql<ST, Pg> for OrderValue {
    fn from_sql(value: PgValue<'_>) -> deserialize::Result<Self> {
        Ok(OrderValue::Bytes(value.as_bytes().to_vec()))
    }
}

impl<ST: SingleValue> ToSql<ST, Pg> for OrderValue {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> serialize::Result {
        let OrderValue::Bytes(bytes) = self else {
            return Err(format!("not an order value PostgreSQL sent: {self:?}").into());
        };
        out.write_all(bytes)?;
        Ok(IsNull::No)
    }
}
