//! Running the async shop on MySQL or MariaDB, in a database of its own.
//!
//! Every run creates a database named after the process and drops it at the
//! end. Tasks read at `READ COMMITTED`, as claimers on InnoDB should: under
//! `REPEATABLE READ` a locking read also locks the gaps between the rows it
//! passes, which blocks inserts and makes claimers skip more than the rows
//! others hold.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{Connection, MysqlConnection};
use diesel_async::pooled_connection::{bb8, AsyncDieselConnectionManager};
use diesel_async::AsyncMysqlConnection;

use crate::{run_on_connect, BoxError, Checks, Clock, Options};

/// The connection every story works with on this backend.
pub type Conn = AsyncMysqlConnection;
/// The pool the tasks take their connections from.
pub type Pool = bb8::Pool<Conn>;
/// A connection a task owns until it ends (see `stories::run_workers`).
pub type Pooled = bb8::PooledConnection<'static, Conn>;

/// The stories, compiled for MySQL (see the note in `main.rs`).
#[path = "stories/mod.rs"]
mod stories;

const SCHEMA: &str = "
    CREATE TABLE orders (
        id INTEGER AUTO_INCREMENT PRIMARY KEY,
        customer_email TEXT NOT NULL,
        shipped BOOLEAN NOT NULL,
        email_sent BOOLEAN NOT NULL DEFAULT FALSE,
        INDEX orders_pending (shipped, email_sent, id)
    ) ENGINE = InnoDB;
    CREATE TABLE outbox (
        id INTEGER AUTO_INCREMENT PRIMARY KEY,
        order_id INTEGER NOT NULL,
        recipient TEXT NOT NULL,
        worker INTEGER NOT NULL,
        FOREIGN KEY (order_id) REFERENCES orders (id)
    ) ENGINE = InnoDB;
    CREATE TABLE accounts (
        id INTEGER PRIMARY KEY,
        balance BIGINT NOT NULL,
        version INTEGER NOT NULL DEFAULT 0
    ) ENGINE = InnoDB;
    CREATE TABLE reports (
        id INTEGER AUTO_INCREMENT PRIMARY KEY,
        token BIGINT NOT NULL,
        worker INTEGER NOT NULL
    ) ENGINE = InnoDB;
";

const READ_COMMITTED: &str = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";

pub fn run(url: &str, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    crate::common::in_own_mysql_database(url, "shop_async", |database, url| {
        println!(
            "diesel-claim async shop on MySQL/MariaDB (database {database}), {} tasks, {} orders\n",
            options.workers, options.orders
        );
        run_in_database(url, options, clock)
    })
}

fn run_in_database(url: &str, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    // Tables and the crate's lease table (its embedded migrations), set up with a
    // blocking connection before any task runs: migrations are blocking.
    let mut conn = MysqlConnection::establish(url)?;
    conn.batch_execute(SCHEMA)?;
    diesel_claim::run_migrations(&mut conn)?;
    drop(conn);

    crate::runtime()?.block_on(async {
        let manager = AsyncDieselConnectionManager::new_with_config(
            url,
            run_on_connect::<Conn>(READ_COMMITTED.to_owned()),
        );
        let pool = Pool::builder()
            .max_size(options.workers + 1)
            .connection_timeout(Duration::from_secs(30))
            .build(manager)
            .await?;
        stories::run(&pool, options, clock).await
    })
}
