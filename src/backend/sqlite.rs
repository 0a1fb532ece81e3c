//! SQLite: no row locks; the database write lock (`BEGIN IMMEDIATE`) instead,
//! and leases by SQLite's own clock.

use diesel::connection::{
    LoadConnection, TransactionDepthChange, TransactionManager, TransactionManagerStatus,
};
use diesel::deserialize::{self, FromSql};
use diesel::prelude::*;
use diesel::query_builder::{AstPass, Query};
use diesel::serialize::{self, IsNull, Output, ToSql};
use diesel::sql_types::{BigInt, HasSqlType, SingleValue, Text};
use diesel::sqlite::{Sqlite, SqliteType, SqliteValue};
use diesel::upsert::excluded;

use super::strategy::Strategy;
use super::OrderValue;
use super::{run_returning, ClaimBackend, LeaseQuery, LeaseSql, LeaseStatement};
use crate::locking::LockClause;

impl ClaimBackend for Sqlite {}

impl Strategy for Sqlite {
    const ROW_LOCKS: bool = false;
    const LOCK_OF: bool = false;
    const UPDATE_RETURNING: bool = true;
    // One writer at a time: claims are never contended.
    const GROW_CONTENDED_PAGES: bool = false;

    const KEYS_IN_SUBQUERY: (&'static str, &'static str) = (" IN (", ")");
    const ROW_VALUE_INDEXES: bool = true;
    const ROW_KEYS_IN_SUBQUERY: (&'static str, &'static str) = (" IN (", ")");

    #[cfg(feature = "migrations")]
    const MIGRATIONS: diesel_migrations::EmbeddedMigrations =
        diesel_migrations::embed_migrations!("migrations/sqlite");

    fn walk_lock_clause(_: &LockClause, _: AstPass<'_, '_, Sqlite>) -> QueryResult<()> {
        // No row locks: the transaction holds the database write lock instead.
        Ok(())
    }

    fn query_builder() -> diesel::sqlite::SqliteQueryBuilder {
        Default::default()
    }

    fn begin_locking_transaction<C>(conn: &mut C, depth: u32, nowait: bool) -> QueryResult<()>
    where
        C: LoadConnection<Backend = Self>,
    {
        // Nested: a savepoint inside the caller's transaction, whose own lock
        // mode then decides. Top level: `BEGIN IMMEDIATE`, which takes the write
        // lock before the re-check reads, so two claimers cannot both see the
        // row as pending. Diesel's `immediate_transaction` is not available for
        // pooled connections, so the transaction manager is told by hand.
        if depth > 0 {
            return C::TransactionManager::begin_transaction(conn);
        }
        // (The caller's reading of `depth` has also refused a broken
        // transaction manager, before any SQL.)
        if nowait {
            begin_immediate_at_once(conn)?;
        } else {
            conn.batch_execute("BEGIN IMMEDIATE")?;
        }
        match C::TransactionManager::transaction_manager_status_mut(conn) {
            TransactionManagerStatus::Valid(status) => {
                status.change_transaction_depth(TransactionDepthChange::IncreaseDepth)
            }
            TransactionManagerStatus::InError => {
                Err(diesel::result::Error::BrokenTransactionManager)
            }
        }
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

/// `BEGIN IMMEDIATE` with the connection's busy timeout set to 0 for it, then
/// set back: `nowait` fails at once, as on a database with row locks, instead
/// of waiting `busy_timeout` for another writer.
fn begin_immediate_at_once<C>(conn: &mut C) -> QueryResult<()>
where
    C: LoadConnection<Backend = Sqlite>,
{
    #[derive(QueryableByName)]
    struct BusyTimeout {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        timeout: i32,
    }

    let previous = diesel::sql_query("PRAGMA busy_timeout").get_result::<BusyTimeout>(conn)?;
    conn.batch_execute("PRAGMA busy_timeout = 0")?;
    let begun = conn.batch_execute("BEGIN IMMEDIATE");
    conn.batch_execute(&format!("PRAGMA busy_timeout = {}", previous.timeout))?;
    begun
}

diesel::table! {
    /// The lease table, as the crate's migration creates it: `expires_at` in
    /// microseconds since the Unix epoch.
    diesel_claim_leases (name) {
        name -> Text,
        token -> BigInt,
        expires_at -> BigInt,
    }
}

diesel::define_sql_function! {
    /// The Julian day number of a time (`'now'`: SQLite's clock).
    fn julianday(time: Text) -> Double;
}

/// Microseconds since the Unix epoch by SQLite's clock (`julianday` has
/// millisecond precision; 2440587.5 is the epoch's Julian day).
macro_rules! now_micros {
    () => {
        ((julianday("now") - 2_440_587.5) * 86_400_000_000.0).cast::<BigInt>()
    };
}

/// Takes the lease on `name` for `ttl_micros` if it is free or has expired:
/// its new token, or no row.
fn acquire(
    lease: &str,
    ttl_micros: i64,
) -> LeaseQuery<impl LeaseSql<Sqlite> + Query<SqlType = BigInt> + '_> {
    use self::diesel_claim_leases::dsl::*;
    // (`FilterDsl` spelled out: the prelude's `QueryDsl::filter` is for selects.)
    let upsert = diesel::insert_into(diesel_claim_leases)
        .values((
            name.eq(lease),
            token.eq(1),
            expires_at.eq(now_micros!() + ttl_micros),
        ))
        .on_conflict(name)
        .do_update()
        .set((token.eq(token + 1), expires_at.eq(excluded(expires_at))));
    LeaseQuery(
        diesel::query_dsl::methods::FilterDsl::filter(upsert, expires_at.le(now_micros!()))
            .returning(token),
    )
}

/// Makes the live lease on `name` held with `held` expire `after_micros` from
/// now: its token, or no row if it has expired or been taken.
fn expire(
    lease: &str,
    held: i64,
    after_micros: i64,
) -> LeaseQuery<impl LeaseSql<Sqlite> + Query<SqlType = BigInt> + '_> {
    use self::diesel_claim_leases::dsl::*;
    let live = diesel_claim_leases
        .find(lease)
        .filter(token.eq(held))
        .filter(expires_at.gt(now_micros!()));
    LeaseQuery(
        diesel::update(live)
            .set(expires_at.eq(now_micros!() + after_micros))
            .returning(token),
    )
}

/// An order value as SQLite stored it: a column's values may be of several
/// storage classes, and each is bound back in its own, so it compares as
/// SQLite compared it.
impl<ST: SingleValue> FromSql<ST, Sqlite> for OrderValue {
    fn from_sql(mut value: SqliteValue<'_, '_, '_>) -> deserialize::Result<Self> {
        Ok(match value.value_type() {
            Some(SqliteType::Text) => OrderValue::Text(value.read_text().to_owned()),
            Some(SqliteType::Binary) => OrderValue::Bytes(value.read_blob().to_vec()),
            Some(SqliteType::Double | SqliteType::Float) => OrderValue::Real(value.read_double()),
            Some(_) => OrderValue::Integer(value.read_long()),
            None => return Err("an order column is NULL".into()),
        })
    }
}

/// Diesel binds a value only as its column's declared type: one stored in
/// another class is refused, as it would compare otherwise.
impl<ST: SingleValue> ToSql<ST, Sqlite> for OrderValue
where
    Sqlite: HasSqlType<ST>,
{
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Sqlite>) -> serialize::Result {
        match (<Sqlite as HasSqlType<ST>>::metadata(&mut ()), self) {
            (SqliteType::SmallInt | SqliteType::Integer, OrderValue::Integer(value)) => {
                out.set_value(i32::try_from(*value)?)
            }
            (SqliteType::Long, OrderValue::Integer(value)) => out.set_value(*value),
            (SqliteType::Float | SqliteType::Double, OrderValue::Real(value)) => {
                out.set_value(*value)
            }
            (SqliteType::Text, OrderValue::Text(text)) => out.set_value(text.as_str()),
            (SqliteType::Binary, OrderValue::Bytes(bytes)) => out.set_value(bytes.as_slice()),
            (declared, value) => {
                return Err(format!(
                    "an order column declared {declared:?} holds {value:?}: a claim can only \
                     follow columns whose values have their declared type"
                )
                .into())
            }
        }
        Ok(IsNull::No)
    }
}
