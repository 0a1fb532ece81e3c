//! The crate's migration history, kept apart from yours: the harness that
//! applies the crate's migrations and records them in
//! `diesel_claim_schema_migrations`, never in Diesel's
//! `__diesel_schema_migrations`.

use diesel::connection::LoadConnection;
use diesel::migration::{Migration, MigrationVersion};
use diesel::prelude::*;
use diesel_migrations::{EmbeddedMigrations, MigrationHarness};

use crate::Error;

diesel::table! {
    /// The versions of the crate's migrations applied to this database.
    diesel_claim_schema_migrations (version) {
        version -> Text,
    }
}

/// Records a migration's version as applied.
#[diesel::dsl::auto_type]
fn record(recorded: String) -> _ {
    diesel::dsl::insert_into(diesel_claim_schema_migrations::table)
        .values(diesel_claim_schema_migrations::version.eq(recorded))
}

/// Forgets a migration's version, reverted.
#[diesel::dsl::auto_type]
fn forget(recorded: String) -> _ {
    diesel::dsl::delete(diesel_claim_schema_migrations::table.find(recorded))
}

/// The versions applied.
#[diesel::dsl::auto_type]
fn applied() -> _ {
    diesel_claim_schema_migrations::table.select(diesel_claim_schema_migrations::version)
}

/// A migration harness that keeps its history in
/// `diesel_claim_schema_migrations`. (Public in a private module: the
/// backends' `run_migrations` name it in their bounds.)
#[derive(Debug)]
pub struct CrateHistory<'c, C>(&'c mut C);

impl<C> CrateHistory<'_, C>
where
    C: LoadConnection + 'static,
{
    /// Runs `step` and records (or forgets) the migration's version, in one
    /// transaction where the migration asks for one.
    fn apply(
        &mut self,
        migration: &dyn Migration<C::Backend>,
        step: impl FnOnce(&mut C, String) -> diesel::migration::Result<()>,
    ) -> diesel::migration::Result<MigrationVersion<'static>> {
        let version = migration.name().version().as_owned();
        let recorded = version.to_string();
        if migration.metadata().run_in_transaction() {
            self.0.transaction(|conn| step(conn, recorded))?;
        } else {
            step(self.0, recorded)?;
        }
        Ok(version)
    }
}

impl<C> MigrationHarness<C::Backend> for CrateHistory<'_, C>
where
    C: LoadConnection + 'static,
    record: diesel::query_dsl::methods::ExecuteDsl<C>,
    forget: diesel::query_dsl::methods::ExecuteDsl<C>,
    for<'q> applied: diesel::query_dsl::LoadQuery<'q, C, String>,
{
    fn run_migration(
        &mut self,
        migration: &dyn Migration<C::Backend>,
    ) -> diesel::migration::Result<MigrationVersion<'static>> {
        self.apply(migration, |conn, recorded| {
            migration.run(conn)?;
            record(recorded).execute(conn)?;
            Ok(())
        })
    }

    fn revert_migration(
        &mut self,
        migration: &dyn Migration<C::Backend>,
    ) -> diesel::migration::Result<MigrationVersion<'static>> {
        self.apply(migration, |conn, recorded| {
            migration.revert(conn)?;
            forget(recorded).execute(conn)?;
            Ok(())
        })
    }

    fn applied_migrations(&mut self) -> diesel::migration::Result<Vec<MigrationVersion<'static>>> {
        self.0.batch_execute(
            "CREATE TABLE IF NOT EXISTS diesel_claim_schema_migrations \
             (version VARCHAR(50) NOT NULL PRIMARY KEY)",
        )?;
        let versions: Vec<String> = applied().load(self.0)?;
        Ok(versions.into_iter().map(MigrationVersion::from).collect())
    }
}

/// Applies the pending ones of `migrations`, recording them in the crate's
/// history.
pub(crate) fn run<C>(conn: &mut C, migrations: EmbeddedMigrations) -> Result<(), Error>
where
    C: LoadConnection + 'static,
    for<'c> CrateHistory<'c, C>: MigrationHarness<C::Backend>,
{
    CrateHistory(conn)
        .run_pending_migrations(migrations)
        .map_err(Error::Migration)?;
    Ok(())
}
