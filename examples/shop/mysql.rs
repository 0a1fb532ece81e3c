//! Running the shop on MySQL or MariaDB, in a database of its own.
//!
//! Every run creates a database named after the process and drops it at the
//! end, so runs on a shared server neither see nor disturb each other. Workers
//! read at `READ COMMITTED`, as claimers on InnoDB should: under `REPEATABLE
//! READ` a locking read also locks the gaps between the rows it passes, which
//! blocks inserts and makes claimers skip more than the rows others hold.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::r2d2::{self, ConnectionManager, CustomizeConnection, PooledConnection};
use diesel::MysqlConnection;

use crate::{BoxError, Checks, Clock, Options};

/// The connection every story works with on this backend.
pub type Conn = PooledConnection<ConnectionManager<MysqlConnection>>;
/// The pool the workers take their connections from.
pub type Pool = r2d2::Pool<ConnectionManager<MysqlConnection>>;

/// MySQL has no notifications: the warehouse worker polls.
pub const NEW_ORDERS_CHANNEL: Option<&str> = None;

/// Nothing to send: the warehouse worker polls.
pub fn notify_new_orders(_: &mut Conn) -> Result<(), diesel_claim::Error> {
    Ok(())
}

/// The invoices' visibility-timeout stamp (`claimed_until`): `DATETIME(6)`.
pub type ClaimStamp = diesel::sql_types::Datetime;

/// The stories, compiled for MySQL (see the note in `main.rs`).
#[path = "stories/mod.rs"]
mod stories;

const SCHEMA: &str = "
    CREATE TABLE orders (
        id INTEGER AUTO_INCREMENT PRIMARY KEY,
        customer_email TEXT NOT NULL,
        shipped_at TIMESTAMP NULL,
        shipped_email_sent BOOLEAN NOT NULL DEFAULT FALSE,
        priority INTEGER NOT NULL DEFAULT 0,
        email_attempts INTEGER NOT NULL DEFAULT 0,
        -- The claim reads pending orders by priority: an index in that order
        -- keeps InnoDB from sorting, which would lock every row it sorts.
        INDEX orders_pending (shipped_email_sent, priority DESC, id)
    ) ENGINE = InnoDB;
    CREATE TABLE outbox (
        id INTEGER AUTO_INCREMENT PRIMARY KEY,
        order_id INTEGER NOT NULL,
        recipient TEXT NOT NULL,
        subject TEXT NOT NULL,
        worker INTEGER NOT NULL,
        FOREIGN KEY (order_id) REFERENCES orders (id)
    ) ENGINE = InnoDB;
    CREATE TABLE accounts (
        id INTEGER AUTO_INCREMENT PRIMARY KEY,
        owner TEXT NOT NULL,
        balance BIGINT NOT NULL,
        version INTEGER NOT NULL DEFAULT 0
    ) ENGINE = InnoDB;
    CREATE TABLE ledger (
        id INTEGER AUTO_INCREMENT PRIMARY KEY,
        account_id INTEGER NOT NULL,
        amount BIGINT NOT NULL,
        method TEXT NOT NULL,
        FOREIGN KEY (account_id) REFERENCES accounts (id)
    ) ENGINE = InnoDB;
    CREATE TABLE users (
        id INTEGER AUTO_INCREMENT PRIMARY KEY,
        name TEXT NOT NULL,
        active BOOLEAN NOT NULL,
        lease_token BIGINT
    ) ENGINE = InnoDB;
    CREATE TABLE invoices (
        id INTEGER PRIMARY KEY,
        order_id INTEGER NOT NULL REFERENCES orders (id),
        sent BOOLEAN NOT NULL DEFAULT FALSE,
        times_sent INTEGER NOT NULL DEFAULT 0,
        claimed_until DATETIME(6)
    ) ENGINE = InnoDB;
    CREATE TABLE invoice_mail (
        id INTEGER AUTO_INCREMENT PRIMARY KEY,
        invoice_id INTEGER NOT NULL,
        worker INTEGER NOT NULL
    ) ENGINE = InnoDB;
";

/// Sets every pooled connection's isolation level.
#[derive(Debug)]
struct ReadCommitted;

impl CustomizeConnection<MysqlConnection, r2d2::Error> for ReadCommitted {
    fn on_acquire(&self, conn: &mut MysqlConnection) -> Result<(), r2d2::Error> {
        conn.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .map_err(r2d2::Error::QueryError)
    }
}

pub fn run(url: &str, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    crate::common::in_own_mysql_database(url, "shop", |database, url| {
        println!(
            "diesel-claim shop on MySQL/MariaDB (database {database}), {} workers, {} orders\n",
            options.workers, options.orders
        );
        run_in_database(url, options, clock)
    })
}

fn run_in_database(url: &str, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    let pool = Pool::builder()
        .max_size(options.workers + 1)
        .connection_timeout(Duration::from_secs(30))
        .connection_customizer(Box::new(ReadCommitted))
        .build(ConnectionManager::new(url))?;

    let mut conn = pool.get()?;
    conn.batch_execute(SCHEMA)?;
    // The lease table of `with_lease`, from the crate's embedded migrations.
    diesel_claim::run_migrations(&mut conn)?;
    drop(conn);

    stories::run(&pool, options, clock)
}
