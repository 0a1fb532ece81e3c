//! The crate's own tables, as embedded Diesel migrations, one set per backend,
//! and the harness that applies them without touching your migrations' history.
//!
//! [`run_migrations`] records what it applied in a table of its own,
//! `diesel_claim_schema_migrations`, never in Diesel's
//! `__diesel_schema_migrations`: your `revert_last_migration` and `diesel
//! migration redo` then only ever see your own migrations.
//!
//! To keep the lease table in your own migrations instead, copy the backend's
//! `up.sql` and `down.sql` ([`migrations/<backend>/…_diesel_claim_leases/`](https://github.com/diesel-claim/diesel-claim/tree/main/migrations))
//! into a migration of yours, do not call [`run_migrations`], and leave the
//! feature `migrations` off: then neither this module nor diesel_migrations
//! is built. The constants below
//! serve a harness of your own; it records them where it records yours.

use crate::backend::strategy::Strategy;
use crate::connection::BlockingConnection;
use crate::Error;

/// The migrations for PostgreSQL, to run with your own
/// [`MigrationHarness`](diesel_migrations::MigrationHarness).
#[cfg(feature = "postgres_backend")]
pub const POSTGRES: diesel_migrations::EmbeddedMigrations =
    <diesel::pg::Pg as Strategy>::MIGRATIONS;

/// The migrations for SQLite, to run with your own
/// [`MigrationHarness`](diesel_migrations::MigrationHarness).
#[cfg(feature = "sqlite")]
pub const SQLITE: diesel_migrations::EmbeddedMigrations =
    <diesel::sqlite::Sqlite as Strategy>::MIGRATIONS;

/// The migrations for MySQL and MariaDB, to run with your own
/// [`MigrationHarness`](diesel_migrations::MigrationHarness).
#[cfg(feature = "mysql_backend")]
pub const MYSQL: diesel_migrations::EmbeddedMigrations =
    <diesel::mysql::Mysql as Strategy>::MIGRATIONS;

/// Creates (or brings up to date) the crate's tables on `conn`'s database:
/// today the `diesel_claim_leases` table that named leases need.
///
/// Applied versions are recorded in `diesel_claim_schema_migrations`, apart
/// from your own migrations' history, so running it again is a no-op and your
/// harness never meets a version it does not know.
pub fn run_migrations<C, Inferred>(conn: &mut C) -> Result<(), Error>
where
    C: BlockingConnection<Inferred> + 'static,
{
    <C::Backend as Strategy>::run_migrations(conn)
}
