//! Running the shop on an embedded SQLite file, in a temporary directory
//! removed at the end.
//!
//! SQLite has no row locks: `claim_each` and `with_lock` take the database write
//! lock (`BEGIN IMMEDIATE`) instead, so workers queue for it rather than skip
//! each other's rows. Still at most once per row; just less parallel.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::r2d2::{self, ConnectionManager, CustomizeConnection, PooledConnection};
use diesel::SqliteConnection;

use crate::{BoxError, Checks, Clock, Options};

/// The connection every story works with on this backend.
pub type Conn = PooledConnection<ConnectionManager<SqliteConnection>>;
/// The pool the workers take their connections from.
pub type Pool = r2d2::Pool<ConnectionManager<SqliteConnection>>;

/// SQLite has no notifications: the warehouse worker polls.
pub const NEW_ORDERS_CHANNEL: Option<&str> = None;

/// Nothing to send: the warehouse worker polls.
pub fn notify_new_orders(_: &mut Conn) -> Result<(), diesel_claim::Error> {
    Ok(())
}

/// The invoices' visibility-timeout stamp (`claimed_until`): `TIMESTAMP`.
pub type ClaimStamp = diesel::sql_types::Timestamp;

/// The stories, compiled for SQLite (see the note in `main.rs`).
#[path = "stories/mod.rs"]
mod stories;

const SCHEMA: &str = "
    CREATE TABLE orders (
        id INTEGER PRIMARY KEY,
        customer_email TEXT NOT NULL,
        shipped_at TIMESTAMP,
        shipped_email_sent BOOLEAN NOT NULL DEFAULT FALSE,
        priority INTEGER NOT NULL DEFAULT 0,
        email_attempts INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE outbox (
        id INTEGER PRIMARY KEY,
        order_id INTEGER NOT NULL REFERENCES orders (id),
        recipient TEXT NOT NULL,
        subject TEXT NOT NULL,
        worker INTEGER NOT NULL
    );
    CREATE TABLE accounts (
        id INTEGER PRIMARY KEY,
        owner TEXT NOT NULL,
        balance BIGINT NOT NULL,
        version INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE ledger (
        id INTEGER PRIMARY KEY,
        account_id INTEGER NOT NULL REFERENCES accounts (id),
        amount BIGINT NOT NULL,
        method TEXT NOT NULL
    );
    CREATE TABLE users (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL,
        active BOOLEAN NOT NULL,
        lease_token BIGINT
    );
    CREATE TABLE invoices (
        id INTEGER PRIMARY KEY,
        order_id INTEGER NOT NULL REFERENCES orders (id),
        sent BOOLEAN NOT NULL DEFAULT FALSE,
        times_sent INTEGER NOT NULL DEFAULT 0,
        claimed_until TIMESTAMP
    );
    CREATE TABLE invoice_mail (
        id INTEGER PRIMARY KEY,
        invoice_id INTEGER NOT NULL,
        worker INTEGER NOT NULL
    );
";

/// Settings every pooled connection needs.
#[derive(Debug)]
struct Pragmas;

impl CustomizeConnection<SqliteConnection, r2d2::Error> for Pragmas {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), r2d2::Error> {
        // busy_timeout: a claim waits for the write lock instead of failing at
        //   once with "database is locked" (SQLite's default timeout is zero).
        // WAL: readers (the unlocked candidate scan) do not block the writer.
        // synchronous = NORMAL: the usual companion of WAL; commits stay atomic
        //   and durable across a crash of the process, not of the machine.
        // foreign_keys: SQLite leaves them off unless asked.
        conn.batch_execute(
            "PRAGMA busy_timeout = 30000;
             PRAGMA journal_mode = WAL;
             PRAGMA synchronous = NORMAL;
             PRAGMA foreign_keys = ON;",
        )
        .map_err(r2d2::Error::QueryError)
    }
}

pub fn run(options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    // A directory of its own, removed with the database (and its `-wal` and
    // `-shm` files) when the run ends, whatever the outcome.
    let dir = tempfile::Builder::new()
        .prefix("diesel-claim-shop-")
        .tempdir()?;
    let path = dir.path().join("shop.sqlite");
    let url = path
        .to_str()
        .ok_or("the temporary directory's path is not UTF-8")?;
    println!(
        "diesel-claim shop on SQLite (a temporary file, removed at the end), {} workers, {} \
         orders\n",
        options.workers, options.orders
    );

    let pool = Pool::builder()
        .max_size(options.workers + 1)
        .connection_timeout(Duration::from_secs(30))
        .connection_customizer(Box::new(Pragmas))
        .build(ConnectionManager::new(url))?;

    let mut conn = pool.get()?;
    conn.batch_execute(SCHEMA)?;
    // The lease table of `with_lease`, from the crate's embedded migrations.
    diesel_claim::run_migrations(&mut conn)?;
    drop(conn);

    let checks = stories::run(&pool, options, clock);
    // Every connection closed before the directory goes; a failure to remove
    // it is reported after the run's own error, which matters more.
    drop(pool);
    let removed = dir.close();
    let checks = checks?;
    removed?;
    Ok(checks)
}
