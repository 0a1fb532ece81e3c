//! The async worked example of `diesel-claim`: a smaller version of the `shop`
//! example on diesel-async, where tokio tasks share a bb8 pool and run
//! concurrently against a real database.
//!
//! 1. **Shipping emails** (`claim_each`, then `build_claim().batch(50).each`):
//!    tasks claim shipped orders and send each confirmation email exactly once;
//!    an outbox table stands in for the mail server.
//! 2. **Bank transfers** (`with_locks` and `with_lock`, then `update_versioned`
//!    with `aio::retry`): concurrent transfers neither create nor lose money,
//!    and never overdraw an account.
//! 3. **Nightly report** (`aio::with_lease`): tasks contend for one lease, and
//!    no two of them are ever in the report at the same time.
//!
//! It ends by printing the checks it made and exits with status 1 if any failed.
//!
//! ```text
//! DATABASE_URL=postgres://user@host/db \
//!     cargo run --release --all-features --example shop_async     # PostgreSQL
//! DATABASE_URL=mysql://user@host/db \
//!     cargo run --release --all-features --example shop_async     # MySQL, MariaDB
//! cargo run --release --all-features --example shop_async -- --help
//! ```
//!
//! Without `DATABASE_URL` it connects to `postgres://postgres@127.0.0.1:5432/test`.
//! On PostgreSQL everything happens in a schema of its own (`shop_async_<pid>_…`),
//! on MySQL in a database of its own, dropped at the end, so runs on a shared
//! server do not see each other.
//!
//! Setting up (tables, the crate's migrations) uses a blocking Diesel
//! connection, before the tokio runtime starts; the stories use the async pool
//! only.
//!
//! The closures given to the crate are `async` closures, `async |conn, row| { … }`,
//! as diesel-async's `transaction` takes: their futures are `Send`, so the tasks
//! that await them can be spawned.
//!
//! As in `shop`, the stories in `stories/` are written against a concrete
//! connection type and compiled once per backend (`postgres.rs` and `mysql.rs`
//! include them with `#[path]`), since Diesel checks queries per backend.

// Loading `stories/` once per backend is the point (see above).
#![allow(clippy::duplicate_mod)]

use diesel_async::pooled_connection::ManagerConfig;
use diesel_async::AsyncConnection;

// The command line, error type, clock, checks and per-run schema or database,
// shared with the other worked example.
use common::{is_mysql_url, is_postgres_url};
pub use common::{BoxError, Checks, Clock, Options, ShopError};
use diesel_claim_testkit::shop as common;

mod mysql;
mod postgres;
mod schema;

const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

const ABOUT: &str = "\
Runs the diesel-claim async shop example on PostgreSQL or MySQL/MariaDB, in a
schema (or a database) of its own that is dropped at the end. The server is
--database-url, else $DATABASE_URL, else postgres://postgres@127.0.0.1:5432/test.";

fn main() {
    common::exit_with(run());
}

/// Runs the stories and prints the checks; `Ok(false)` if one failed.
fn run() -> Result<bool, BoxError> {
    let mut options = Options::from_args("shop_async", ABOUT, 8);
    // Without --database-url: DATABASE_URL, whatever it names, else the default.
    let url = options
        .database_url
        .get_or_insert_with(|| std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.into()))
        .clone();
    let clock = Clock::start();

    let checks = if is_postgres_url(&url) {
        postgres::run(&url, &options, clock)?
    } else if is_mysql_url(&url) {
        mysql::run(&url, &options, clock)?
    } else {
        return Err(format!("not a postgres:// or mysql:// URL: {url}").into());
    };

    Ok(checks.conclude(clock))
}

/// The runtime the stories run on: multi-threaded, so that tasks really run in
/// parallel and not only interleave at their `.await`s.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}

/// A pool configuration whose connections run `sql` as soon as they are
/// established, before the pool hands them out: the async counterpart of an
/// r2d2 connection customizer.
pub fn run_on_connect<C>(sql: String) -> ManagerConfig<C>
where
    C: AsyncConnection + 'static,
{
    let mut config = ManagerConfig::default();
    config.custom_setup = Box::new(move |url| {
        let sql = sql.clone();
        Box::pin(async move {
            let mut conn = C::establish(url).await?;
            conn.batch_execute(&sql)
                .await
                .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
            Ok(conn)
        })
    });
    config
}
