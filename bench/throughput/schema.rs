//! The workload's tables and the SQL that creates and refills them.

use diesel::prelude::*;

use crate::db::BackendKind;

diesel::table! {
    orders (id) {
        id -> BigInt,
        // Never loaded: the filter only asks whether it is set.
        shipped_at -> Nullable<Timestamptz>,
        shipped_email_sent -> Bool,
        priority -> Integer,
        customer -> Text,
        total_cents -> BigInt,
        note -> Text,
    }
}

diesel::table! {
    outbox (id) {
        id -> BigInt,
        order_id -> BigInt,
        body -> Text,
    }
}

diesel::table! {
    accounts (id) {
        id -> Integer,
        balance -> BigInt,
        version -> Integer,
    }
}

/// A pending order as the claimers see it.
#[derive(Debug, Clone, Queryable, QueryableByName, Selectable, Identifiable)]
#[diesel(table_name = orders)]
pub struct Order {
    pub id: i64,
    pub customer: String,
    pub total_cents: i64,
    pub note: String,
}

/// The columns of [`Order`], for the hand-written statements.
pub const ORDER_COLUMNS: &str = "id, customer, total_cents, note";

#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = accounts)]
pub struct Account {
    pub id: i32,
    pub balance: i64,
    pub version: i32,
}

/// The pending predicate, word for word the partial index's, so that the
/// planner can use that index.
pub const PENDING: &str = "shipped_at IS NOT NULL AND NOT shipped_email_sent";

/// Payload of each order's `note`: the rows are not empty.
const NOTE_LEN: usize = 40;

/// The tables, with `orders` partitioned by its pending flag if `partitioned`
/// (PostgreSQL and MySQL).
pub fn create_tables(backend: BackendKind, partitioned: bool) -> String {
    let (key, timestamp, table_options) = match backend {
        // Autovacuum is off because every mode starts with an explicit VACUUM
        // ANALYZE: a vacuum starting halfway through one mode would skew it.
        BackendKind::Postgres => (
            "BIGSERIAL PRIMARY KEY",
            "TIMESTAMPTZ",
            " WITH (autovacuum_enabled = false)",
        ),
        BackendKind::Sqlite => ("INTEGER PRIMARY KEY", "TEXT", ""),
        BackendKind::Mysql => (
            "BIGINT AUTO_INCREMENT PRIMARY KEY",
            "TIMESTAMP NULL",
            " ENGINE = InnoDB",
        ),
    };
    let orders_columns = "shipped_email_sent BOOLEAN NOT NULL DEFAULT FALSE,
            priority INTEGER NOT NULL,
            customer TEXT NOT NULL,
            total_cents BIGINT NOT NULL,
            note TEXT NOT NULL";
    let orders = match (partitioned, backend) {
        (false, _) => format!(
            "CREATE TABLE orders (id {key}, shipped_at {timestamp}, {orders_columns}){table_options}"
        ),
        // The partitioning column must be in the primary key; the options go
        // to the partitions, which hold the rows.
        (true, BackendKind::Postgres) => format!(
            "CREATE TABLE orders (id BIGSERIAL, shipped_at {timestamp}, {orders_columns},
                PRIMARY KEY (id, shipped_email_sent)) PARTITION BY LIST (shipped_email_sent);
            CREATE TABLE orders_unsent PARTITION OF orders FOR VALUES IN (FALSE){table_options};
            CREATE TABLE orders_sent PARTITION OF orders FOR VALUES IN (TRUE){table_options}"
        ),
        (true, BackendKind::Mysql) => format!(
            "CREATE TABLE orders (id BIGINT AUTO_INCREMENT, shipped_at {timestamp}, {orders_columns},
                PRIMARY KEY (id, shipped_email_sent)){table_options}
            PARTITION BY LIST (shipped_email_sent)
                (PARTITION unsent VALUES IN (0), PARTITION sent VALUES IN (1))"
        ),
        (true, BackendKind::Sqlite) => unreachable!("SQLite has no partitions"),
    };
    format!(
        "{orders};
        {index};
        {priority_index};
        -- No unique constraint on order_id: a row processed twice must show up
        -- as a duplicate, not as an error.
        CREATE TABLE outbox (id {key}, order_id BIGINT NOT NULL, body TEXT NOT NULL){table_options};
        CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance BIGINT NOT NULL, version INTEGER NOT NULL){table_options};",
        index = pending_index(backend),
        priority_index = priority_index(backend),
    )
}

/// The index the pending reads in priority order walk (O3, O3h), as
/// [`pending_index`] is for key order.
pub fn priority_index(backend: BackendKind) -> String {
    match backend {
        BackendKind::Postgres | BackendKind::Sqlite => format!(
            "CREATE INDEX orders_pending_by_priority ON orders (priority DESC, id) WHERE {PENDING}"
        ),
        BackendKind::Mysql => "CREATE INDEX orders_pending_by_priority \
             ON orders (shipped_email_sent, priority DESC, id)"
            .to_owned(),
    }
}

/// The index the pending reads walk: partial, over the key, where there are
/// partial indexes. MySQL has none; its pending rows are those of one flag
/// value, so the flag leads and the key follows, in order.
pub fn pending_index(backend: BackendKind) -> String {
    match backend {
        BackendKind::Postgres | BackendKind::Sqlite => {
            format!("CREATE INDEX orders_pending ON orders (id) WHERE {PENDING}")
        }
        BackendKind::Mysql => {
            "CREATE INDEX orders_pending ON orders (shipped_email_sent, id)".to_owned()
        }
    }
}

/// Empties both tables and inserts `rows` pending orders with ids from 1.
pub fn refill_orders(backend: BackendKind, rows: i64) -> String {
    refill_orders_where(backend, rows, "TRUE")
}

/// Empties both tables and inserts `rows` orders with ids from 1, order `i`
/// done unless `pending` (an SQL condition on `i`) holds.
pub fn refill_orders_where(backend: BackendKind, rows: i64, pending: &str) -> String {
    let empty = match backend {
        BackendKind::Postgres => "TRUNCATE orders, outbox RESTART IDENTITY",
        BackendKind::Sqlite => "DELETE FROM orders; DELETE FROM outbox",
        // `TRUNCATE` restarts `AUTO_INCREMENT` too.
        BackendKind::Mysql => "TRUNCATE orders; TRUNCATE outbox",
    };
    let now = match backend {
        BackendKind::Postgres | BackendKind::Mysql => "now()",
        BackendKind::Sqlite => "datetime('now')",
    };
    let note = "x".repeat(NOTE_LEN);
    format!(
        "{empty};
        INSERT INTO orders (shipped_at, shipped_email_sent, priority, customer, total_cents, note)
            SELECT {now}, NOT ({pending}), i * 7 % 10, {customer}, i * 100, '{note}' FROM {series};",
        customer = backend.customer_name(),
        series = backend.series(rows),
    )
}

/// Accounts `1..=count`, each with balance 0 at version 0.
pub fn refill_accounts(backend: BackendKind, count: i64) -> String {
    format!(
        "DELETE FROM accounts;
        INSERT INTO accounts (id, balance, version) SELECT i, 0, 0 FROM {};",
        backend.series(count)
    )
}

/// `(rows processed twice, pending rows left, outbox rows)`, in one statement.
pub fn checks() -> String {
    format!(
        "SELECT
            (SELECT count(*) - count(DISTINCT order_id) FROM outbox) AS duplicates,
            (SELECT count(*) FROM orders WHERE {PENDING}) AS leftovers,
            (SELECT count(*) FROM outbox) AS outbox_rows"
    )
}

/// The sum of all balances, as a `BIGINT` column `n`.
pub fn total_balance(backend: BackendKind) -> &'static str {
    match backend {
        BackendKind::Postgres | BackendKind::Sqlite => {
            "SELECT CAST(COALESCE(SUM(balance), 0) AS BIGINT) AS n FROM accounts"
        }
        // `SUM` is a `DECIMAL` there, and `CAST` knows no `BIGINT`.
        BackendKind::Mysql => "SELECT CAST(COALESCE(SUM(balance), 0) AS SIGNED) AS n FROM accounts",
    }
}
