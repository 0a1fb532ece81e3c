//! What the tests, the examples and the benchmark of `diesel-claim` share; not
//! published.
//!
//! - Throwaway databases and pools, one module per backend: [`PgTestDb`] (a
//!   database of its own on the server of [`pg_url`], or on a private server
//!   started from the local PostgreSQL binaries), [`SqliteTestDb`] (a file in a
//!   temporary directory) and [`MysqlTestDb`] (a database of its own on the
//!   server of [`mysql_url`]); each is dropped with its value.
//! - [`fixtures`]: the shop schema the tests work on, and
//!   [`on_every_backend!`], which runs a test module once per enabled backend.
//! - [`torture`]: the reliability scenarios of `RELIABILITY.md`, run at light
//!   scale by the tests and at any scale by the `torture` example.
//! - [`shop`]: the plumbing of the two worked examples.
//!
//! Its features (`postgres`, `sqlite`, `mysql`, `async`) follow the crate's:
//! the crate's own features turn them on for its tests, examples and
//! benchmark. `async` adds the scenarios of the async API.

// A throwaway database or a scenario's state is made for one use, never
// defaulted.
#![allow(clippy::new_without_default)]

pub mod fixtures;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod network;
#[cfg(feature = "postgres")]
mod pg;
#[cfg(feature = "postgres")]
mod pg_replica;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod private_server;
pub mod shop;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
// The suite is written for every backend; without one of them, parts go unused.
#[cfg_attr(
    not(all(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(
        dead_code,
        unreachable_code,
        unused_imports,
        unused_macros,
        unused_variables
    )
)]
pub mod torture;
pub mod url;

#[cfg(feature = "mysql")]
pub use mysql::{mysql_pool, mysql_url, MysqlTestDb};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub use network::TestNetwork;
#[cfg(feature = "postgres")]
pub use pg::{pg_pool, pg_url, PgTestDb};
#[cfg(feature = "postgres")]
pub use pg_replica::PgReplicaPair;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub use private_server::PrivateServer;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub mod sessions;
#[cfg(feature = "sqlite")]
pub use sqlite::{sqlite_pool, SqliteTestDb};
