//! Running the async shop on PostgreSQL, in a schema of its own.
//!
//! Every run creates a schema named after the process, points each pooled
//! connection's `search_path` at it, and drops it at the end. The crate's
//! migrations land in that schema too, since they follow the `search_path` like
//! any unqualified name.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use diesel_async::pooled_connection::{bb8, AsyncDieselConnectionManager};
use diesel_async::AsyncPgConnection;

use crate::{run_on_connect, BoxError, Checks, Clock, Options};

/// The connection every story works with on this backend.
pub type Conn = AsyncPgConnection;
/// The pool the tasks take their connections from.
pub type Pool = bb8::Pool<Conn>;
/// A connection a task owns until it ends (see `stories::run_workers`).
pub type Pooled = bb8::PooledConnection<'static, Conn>;

/// The stories, compiled for PostgreSQL (see the note in `main.rs`).
#[path = "stories/mod.rs"]
mod stories;

const SCHEMA: &str = "
    CREATE TABLE orders (
        id SERIAL PRIMARY KEY,
        customer_email TEXT NOT NULL,
        shipped BOOLEAN NOT NULL,
        email_sent BOOLEAN NOT NULL DEFAULT FALSE
    );
    CREATE TABLE outbox (
        id SERIAL PRIMARY KEY,
        order_id INTEGER NOT NULL REFERENCES orders (id),
        recipient TEXT NOT NULL,
        worker INTEGER NOT NULL
    );
    CREATE TABLE accounts (
        id INTEGER PRIMARY KEY,
        balance BIGINT NOT NULL,
        version INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE reports (
        id SERIAL PRIMARY KEY,
        token BIGINT NOT NULL,
        worker INTEGER NOT NULL
    );
";

pub fn run(url: &str, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    crate::common::in_own_postgres_schema(url, "shop_async", |schema| {
        println!(
            "diesel-claim async shop on PostgreSQL (schema {schema}), {} tasks, {} orders\n",
            options.workers, options.orders
        );
        run_in_schema(url, schema, options, clock)
    })
}

fn run_in_schema(
    url: &str,
    schema: &str,
    options: &Options,
    clock: Clock,
) -> Result<Checks, BoxError> {
    // The name is ours (letters, digits, `_`), so it needs no quoting.
    let search_path = format!("SET search_path TO {schema}");

    // Tables and the crate's lease table (its embedded migrations), set up with
    // a blocking connection before any task runs: migrations are blocking.
    let mut conn = PgConnection::establish(url)?;
    conn.batch_execute(&search_path)?;
    conn.batch_execute(SCHEMA)?;
    diesel_claim::run_migrations(&mut conn)?;
    drop(conn);

    crate::runtime()?.block_on(async {
        let manager =
            AsyncDieselConnectionManager::new_with_config(url, run_on_connect::<Conn>(search_path));
        let pool = Pool::builder()
            .max_size(options.workers + 1)
            .connection_timeout(Duration::from_secs(30))
            .build(manager)
            .await?;

        stories::run(&pool, options, clock).await
    })
}
