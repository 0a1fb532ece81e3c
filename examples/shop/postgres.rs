//! Running the shop on PostgreSQL, in a schema of its own.
//!
//! Every run creates a schema named after the process, points each pooled
//! connection's `search_path` at it, and drops it at the end: runs on a shared
//! database (CI's, or a colleague's) neither see nor disturb each other. The
//! crate's migrations land in that schema too, `__diesel_schema_migrations`
//! included, since they follow the `search_path` like any unqualified name.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::r2d2::{self, ConnectionManager, CustomizeConnection, PooledConnection};
use diesel::PgConnection;

use crate::{BoxError, Checks, Clock, Options};

/// The connection every story works with on this backend.
pub type Conn = PooledConnection<ConnectionManager<PgConnection>>;
/// The pool the workers take their connections from.
pub type Pool = r2d2::Pool<ConnectionManager<PgConnection>>;

/// The channel the warehouse worker listens on for new orders.
pub const NEW_ORDERS_CHANNEL: Option<&str> = Some("orders_placed");

/// Tells the warehouse worker that orders were placed.
pub fn notify_new_orders(conn: &mut Conn) -> Result<(), diesel_claim::Error> {
    diesel_claim::notify(conn, "orders_placed")
}

/// The invoices' visibility-timeout stamp (`claimed_until`): `TIMESTAMPTZ`.
pub type ClaimStamp = diesel::sql_types::Timestamptz;

/// The stories, compiled for PostgreSQL (see the note in `main.rs`).
#[path = "stories/mod.rs"]
mod stories;

const SCHEMA: &str = "
    CREATE TABLE orders (
        id SERIAL PRIMARY KEY,
        customer_email TEXT NOT NULL,
        shipped_at TIMESTAMP,
        shipped_email_sent BOOLEAN NOT NULL DEFAULT FALSE,
        priority INTEGER NOT NULL DEFAULT 0,
        email_attempts INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE outbox (
        id SERIAL PRIMARY KEY,
        order_id INTEGER NOT NULL REFERENCES orders (id),
        recipient TEXT NOT NULL,
        subject TEXT NOT NULL,
        worker INTEGER NOT NULL
    );
    CREATE TABLE accounts (
        id SERIAL PRIMARY KEY,
        owner TEXT NOT NULL,
        balance BIGINT NOT NULL,
        version INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE ledger (
        id SERIAL PRIMARY KEY,
        account_id INTEGER NOT NULL REFERENCES accounts (id),
        amount BIGINT NOT NULL,
        method TEXT NOT NULL
    );
    CREATE TABLE users (
        id SERIAL PRIMARY KEY,
        name TEXT NOT NULL,
        active BOOLEAN NOT NULL,
        lease_token BIGINT
    );
    CREATE TABLE invoices (
        id INTEGER PRIMARY KEY,
        order_id INTEGER NOT NULL REFERENCES orders (id),
        sent BOOLEAN NOT NULL DEFAULT FALSE,
        times_sent INTEGER NOT NULL DEFAULT 0,
        claimed_until TIMESTAMPTZ
    );
    CREATE TABLE invoice_mail (
        id SERIAL PRIMARY KEY,
        invoice_id INTEGER NOT NULL,
        worker INTEGER NOT NULL
    );
";

/// Puts every pooled connection in the run's schema.
#[derive(Debug)]
struct SearchPath(String);

impl CustomizeConnection<PgConnection, r2d2::Error> for SearchPath {
    fn on_acquire(&self, conn: &mut PgConnection) -> Result<(), r2d2::Error> {
        // The name is ours (letters, digits, `_`), so it needs no quoting.
        conn.batch_execute(&format!("SET search_path TO {}", self.0))
            .map_err(r2d2::Error::QueryError)
    }
}

pub fn run(url: &str, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    crate::common::in_own_postgres_schema(url, "shop", |schema| {
        println!(
            "diesel-claim shop on PostgreSQL (schema {schema}), {} workers, {} orders\n",
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
    let pool = Pool::builder()
        .max_size(options.workers + 1)
        .connection_timeout(Duration::from_secs(30))
        .connection_customizer(Box::new(SearchPath(schema.to_owned())))
        .build(ConnectionManager::new(url))?;

    let mut conn = pool.get()?;
    conn.batch_execute(SCHEMA)?;
    // The lease table of `with_lease`, from the crate's embedded migrations.
    diesel_claim::run_migrations(&mut conn)?;
    drop(conn);

    stories::run(&pool, options, clock)
}
