//! The crate's own tables, as embedded Diesel migrations, one set per backend.

use diesel::connection::Connection;
use diesel_migrations::MigrationHarness;

use crate::backend::{strategy::Strategy, ClaimBackend};
use crate::Error;

/// The migrations for PostgreSQL, to run with your own [`MigrationHarness`].
#[cfg(feature = "postgres")]
pub const POSTGRES: diesel_migrations::EmbeddedMigrations =
    <diesel::pg::Pg as Strategy>::MIGRATIONS;

/// The migrations for SQLite, to run with your own [`MigrationHarness`].
#[cfg(feature = "sqlite")]
pub const SQLITE: diesel_migrations::EmbeddedMigrations =
    <diesel::sqlite::Sqlite as Strategy>::MIGRATIONS;

/// The migrations for MySQL and MariaDB, to run with your own [`MigrationHarness`].
#[cfg(feature = "mysql")]
pub const MYSQL: diesel_migrations::EmbeddedMigrations =
    <diesel::mysql::Mysql as Strategy>::MIGRATIONS;

/// Creates (or brings up to date) the crate's tables on `conn`'s database:
/// today the `diesel_claim_leases` table that named leases need.
///
/// Applied versions are recorded in Diesel's `__diesel_schema_migrations`, beside
/// your own, so running it again is a no-op.
pub fn run_migrations<C>(conn: &mut C) -> Result<(), Error>
where
    C: Connection + MigrationHarness<C::Backend>,
    C::Backend: ClaimBackend,
{
    conn.run_pending_migrations(<C::Backend as Strategy>::MIGRATIONS)
        .map_err(Error::Migration)?;
    Ok(())
}
