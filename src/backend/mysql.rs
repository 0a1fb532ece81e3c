//! MySQL and MariaDB: row locks without `OF`, and leases without `RETURNING`.

use diesel::connection::{LoadConnection, TransactionManager};
use diesel::deserialize::{self, FromSql};
use diesel::mysql::{Mysql, MysqlType, MysqlValue};
use diesel::prelude::*;
use diesel::query_builder::{AstPass, Query};
use diesel::serialize::{self, IsNull, Output, ToSql};
use diesel::sql_types::{BigInt, HasSqlType, SingleValue};
use std::io::Write;

use super::strategy::Strategy;
use super::OrderValue;
use super::{ClaimBackend, LeaseQuery, LeaseSql, LeaseStatement};
use crate::locking::{LockClause, LockStrength};

impl ClaimBackend for Mysql {}

impl Strategy for Mysql {
    const ROW_LOCKS: bool = true;
    // MySQL 8 has `OF`, MariaDB has not; the crate sends what both take.
    const LOCK_OF: bool = false;
    const UPDATE_RETURNING: bool = false;
    // Measured on MariaDB (BENCHMARKS.md, "Many workers on MariaDB"): with
    // pages of a thousand keys, 32 and 64 workers claimed 1.25 to 2 times as
    // many rows per second as with grown ones, per row and in batches, for
    // more (cheaper) statements per row; 4 workers, about the same.
    const GROW_CONTENDED_PAGES: bool = false;

    // MySQL refuses `LIMIT` in an `IN` subquery; marks are made by key there.
    const KEYS_IN_SUBQUERY: (&'static str, &'static str) = (" IN (", ")");
    // MySQL and MariaDB scan the table for them, locking what they read.
    const ROW_VALUE_INDEXES: bool = false;
    const ROW_KEYS_IN_SUBQUERY: (&'static str, &'static str) = (" IN (", ")");

    #[cfg(feature = "migrations")]
    const MIGRATIONS: diesel_migrations::EmbeddedMigrations =
        diesel_migrations::embed_migrations!("migrations/mysql");

    // A locking read can fail after sending some of its rows (a lock wait
    // timeout, a deadlock). MariaDB Connector/C then re-executes that
    // prepared statement only after reading the rest of a result set the
    // error ended: it waits for ever. The statement is closed instead, with
    // every statement the connection caches, once its transaction has
    // failed; until then it is cached, which saves a prepare per take.
    const FAILED_READS_STRAND_STATEMENTS: bool = true;

    fn walk_lock_clause(clause: &LockClause, mut out: AstPass<'_, '_, Mysql>) -> QueryResult<()> {
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

    // Row locks are taken by the statements, with their own wait policy.
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
        let (name, ttl_micros) = match statement {
            LeaseStatement::Acquire { name, ttl_micros } => (name, ttl_micros),
            LeaseStatement::Expire {
                name,
                token,
                after_micros,
            } => {
                return Ok(owned(
                    expire(name, token, after_micros).execute(conn)?,
                    token,
                ))
            }
        };
        conn.batch_execute(READ_COMMITTED)?;
        conn.transaction(|conn| {
            if took_expired(take_expired(name, ttl_micros).execute(conn)?) {
                return token_of(name).get_result(conn).map(Some);
            }
            Ok(inserted(insert_new(name, ttl_micros).execute(conn)?))
        })
    }
}

// MySQL has no `RETURNING`: its lease statements succeed by affected rows
// (Diesel counts the rows an `UPDATE` matched), and a lease taken over has
// its new token read back under the row's lock. Acquiring is one transaction
// at `READ COMMITTED`: without gap locks (which `REPEATABLE READ` takes), two
// acquirers of a new name would deadlock on their inserts. The blocking and
// the async drivers both run these steps, in this order:
//
// 1. `READ_COMMITTED`, then in a transaction `take_expired`: an expired lease
//    taken over, under the row's lock;
// 2. if `took_expired`, `token_of` the lease just taken; else `insert_new` for
//    a new name (token 1), whose affected rows `inserted` reads: a live lease
//    is left be.
//
// Renewing and releasing are one `expire` each, read by `owned`.

diesel::table! {
    /// The lease table, as the crate's migration creates it: `expires_at` in
    /// microseconds since the Unix epoch.
    diesel_claim_leases (name) {
        name -> Text,
        token -> BigInt,
        expires_at -> BigInt,
    }
}

pub(crate) const READ_COMMITTED: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// Microseconds since the Unix epoch by the server's clock, whatever the
/// session's time zone. `SYSDATE` rather than `NOW`, which is frozen for the
/// statement (and replicated as such); SQL rather than a Diesel function,
/// as MySQL takes `SYSDATE`'s precision only as a literal, not a bind.
fn now_micros() -> diesel::expression::SqlLiteral<BigInt> {
    diesel::dsl::sql("CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED)")
}

/// Takes over the lease on `name` for `ttl_micros` if it has expired.
pub(crate) fn take_expired(lease: &str, ttl_micros: i64) -> LeaseQuery<impl LeaseSql<Mysql> + '_> {
    use self::diesel_claim_leases::dsl::*;
    let expired = diesel_claim_leases
        .find(lease)
        .filter(expires_at.le(now_micros()));
    LeaseQuery(diesel::update(expired).set((
        token.eq(token + 1),
        expires_at.eq(now_micros() + ttl_micros),
    )))
}

/// Whether [`take_expired`], having changed `rows` rows, took the lease.
pub(crate) fn took_expired(rows: usize) -> bool {
    rows == 1
}

/// The lease's token.
pub(crate) fn token_of(
    lease: &str,
) -> LeaseQuery<impl LeaseSql<Mysql> + Query<SqlType = BigInt> + '_> {
    use self::diesel_claim_leases::dsl::*;
    LeaseQuery(diesel_claim_leases.find(lease).select(token))
}

/// Inserts a new name's lease, token 1, unless the name has a row.
pub(crate) fn insert_new(lease: &str, ttl_micros: i64) -> LeaseQuery<impl LeaseSql<Mysql> + '_> {
    use self::diesel_claim_leases::dsl::*;
    LeaseQuery(diesel::insert_or_ignore_into(diesel_claim_leases).values((
        name.eq(lease),
        token.eq(1),
        expires_at.eq(now_micros() + ttl_micros),
    )))
}

/// The token a new name's lease starts at, if [`insert_new`] took it.
pub(crate) fn inserted(rows: usize) -> Option<i64> {
    (rows == 1).then_some(1)
}

/// Makes the live lease on `name` held with `held` expire `after_micros` from
/// now.
pub(crate) fn expire(
    lease: &str,
    held: i64,
    after_micros: i64,
) -> LeaseQuery<impl LeaseSql<Mysql> + '_> {
    use self::diesel_claim_leases::dsl::*;
    let live = diesel_claim_leases
        .find(lease)
        .filter(token.eq(held))
        .filter(expires_at.gt(now_micros()));
    LeaseQuery(diesel::update(live).set(expires_at.eq(now_micros() + after_micros)))
}

/// The token, if [`expire`], having changed `rows` rows, found the lease ours.
pub(crate) fn owned(rows: usize, token: i64) -> Option<i64> {
    (rows == 1).then_some(token)
}

/// An order value as MySQL sent it: integers by value, as their width may
/// differ between a read and a bind (diesel-async reads every integer into
/// 64 bits), anything else as its bind buffer.
impl<ST: SingleValue> FromSql<ST, Mysql> for OrderValue {
    fn from_sql(value: MysqlValue<'_>) -> deserialize::Result<Self> {
        let bytes = value.as_bytes();
        let unsigned = match value.value_type() {
            MysqlType::Tiny | MysqlType::Short | MysqlType::Long | MysqlType::LongLong => false,
            MysqlType::UnsignedTiny
            | MysqlType::UnsignedShort
            | MysqlType::UnsignedLong
            | MysqlType::UnsignedLongLong => true,
            _ => return Ok(OrderValue::Bytes(bytes.to_vec())),
        };
        let integer = match (bytes.len(), unsigned) {
            (1, false) => i64::from(i8::from_ne_bytes(bytes.try_into()?)),
            (1, true) => i64::from(u8::from_ne_bytes(bytes.try_into()?)),
            (2, false) => i64::from(i16::from_ne_bytes(bytes.try_into()?)),
            (2, true) => i64::from(u16::from_ne_bytes(bytes.try_into()?)),
            (4, false) => i64::from(i32::from_ne_bytes(bytes.try_into()?)),
            (4, true) => i64::from(u32::from_ne_bytes(bytes.try_into()?)),
            (8, false) => i64::from_ne_bytes(bytes.try_into()?),
            (8, true) => i64::try_from(u64::from_ne_bytes(bytes.try_into()?))?,
            (width, _) => return Err(format!("an integer of {width} bytes").into()),
        };
        Ok(OrderValue::Integer(integer))
    }
}

impl<ST: SingleValue> ToSql<ST, Mysql> for OrderValue
where
    Mysql: HasSqlType<ST>,
{
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Mysql>) -> serialize::Result {
        let integer = match self {
            OrderValue::Bytes(bytes) => {
                out.write_all(bytes)?;
                return Ok(IsNull::No);
            }
            OrderValue::Integer(integer) => *integer,
            other => return Err(format!("not an order value MySQL sent: {other:?}").into()),
        };
        match <Mysql as HasSqlType<ST>>::metadata(&mut ()) {
            MysqlType::Tiny => out.write_all(&i8::try_from(integer)?.to_ne_bytes())?,
            MysqlType::UnsignedTiny => out.write_all(&u8::try_from(integer)?.to_ne_bytes())?,
            MysqlType::Short => out.write_all(&i16::try_from(integer)?.to_ne_bytes())?,
            MysqlType::UnsignedShort => out.write_all(&u16::try_from(integer)?.to_ne_bytes())?,
            MysqlType::Long => out.write_all(&i32::try_from(integer)?.to_ne_bytes())?,
            MysqlType::UnsignedLong => out.write_all(&u32::try_from(integer)?.to_ne_bytes())?,
            MysqlType::LongLong => out.write_all(&integer.to_ne_bytes())?,
            other => {
                return Err(format!("an integer order value bound as {other:?}").into());
            }
        }
        Ok(IsNull::No)
    }
}
