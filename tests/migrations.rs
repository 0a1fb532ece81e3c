//! The crate's migrations: applied once, recorded in a history of their own,
//! and never in the way of the application's migrations.

use diesel::prelude::*;
use diesel::sql_types::Text;
use diesel_migrations::{FileBasedMigrations, MigrationHarness};

use testkit::fixtures::on_every_backend;

#[derive(QueryableByName, Debug, PartialEq)]
struct Version {
    #[diesel(sql_type = Text)]
    version: String,
}

/// An application's own migrations: one that creates `widgets`.
fn app_migrations() -> (tempfile::TempDir, FileBasedMigrations) {
    let dir = tempfile::tempdir().unwrap();
    let migration = dir.path().join("2026-12-01-000000_create_widgets");
    std::fs::create_dir(&migration).unwrap();
    std::fs::write(
        migration.join("up.sql"),
        "CREATE TABLE widgets (id INTEGER PRIMARY KEY)",
    )
    .unwrap();
    std::fs::write(migration.join("down.sql"), "DROP TABLE widgets").unwrap();
    let migrations = FileBasedMigrations::from_path(dir.path()).unwrap();
    (dir, migrations)
}

on_every_backend! {

    fn versions(conn: &mut Conn, table: &str) -> Vec<String> {
        diesel::sql_query(format!("SELECT version FROM {table} ORDER BY version"))
            .load::<Version>(conn)
            .unwrap()
            .into_iter()
            .map(|row| row.version)
            .collect()
    }

    /// The application runs its migrations and the crate's, in either order;
    /// reverting the application's last migration reverts its own, and the
    /// crate's history stays apart. (With the crate's version in Diesel's
    /// history, `revert_last_migration` would fail: the version is not in the
    /// application's migrations directory.)
    #[test]
    fn the_apps_migration_history_holds_only_its_own() {
        // `test_db` has run the crate's migrations already.
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        let (_dir, app) = app_migrations();
        conn.run_pending_migrations(app.clone()).unwrap();
        diesel_claim::run_migrations(conn).unwrap();

        assert_eq!(versions(conn, "__diesel_schema_migrations"), ["20261201000000"]);
        assert_eq!(versions(conn, "diesel_claim_schema_migrations"), ["20261122000000"]);

        let reverted = conn.revert_last_migration(app.clone()).unwrap();
        assert_eq!(reverted.to_string(), "20261201000000");
        assert!(versions(conn, "__diesel_schema_migrations").is_empty());
        assert!(diesel::sql_query("SELECT id FROM widgets").execute(conn).is_err());
        // The lease table is still there, and leases work.
        let lease = diesel_claim::Lease::acquire(conn, "migrated", std::time::Duration::from_secs(5))
            .unwrap()
            .expect("a fresh name is free");
        lease.release(conn).unwrap();
        assert_eq!(versions(conn, "diesel_claim_schema_migrations"), ["20261122000000"]);
    }
}
