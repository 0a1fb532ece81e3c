//! Integration tests of diesel-claim against real databases.
//!
//! Run them with `cargo nextest run --all-features`. PostgreSQL tests use
//! `PG_DATABASE_URL` (see `testkit::pg_url` for the fallbacks); SQLite tests
//! need nothing; MySQL tests use `MYSQL_DATABASE_URL` (see `testkit::mysql_url`).
//! Without a backend feature there is nothing to test.

#![cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]

// Throwaway databases, the shop schema and `on_every_backend!`, shared with
// the examples and the benchmark.
extern crate diesel_claim_testkit as testkit;

#[cfg(all(feature = "async", any(feature = "postgres", feature = "mysql")))]
mod aio;
mod claim;
mod jobs;
// Programs that must not compile; they use PostgreSQL and SQLite.
#[cfg(all(feature = "postgres", feature = "sqlite"))]
mod compile_fail;
// Sessions the server ends under a claim, and pools that give no connection:
// PostgreSQL and MariaDB (an SQLite file has no sessions to end).
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod errors;
mod lease;
mod lock;
// The counters and histograms of the `metrics` feature.
#[cfg(feature = "metrics")]
mod metrics;
mod migrations;
// Partitioned tables: PostgreSQL and MariaDB.
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod partitions;
mod pooled;
mod retries;
// Queues kept as a ring of partitions: PostgreSQL.
#[cfg(feature = "postgres")]
mod ring;
// Candidates read on a streaming replica the test starts.
#[cfg(feature = "postgres")]
mod replica;
mod timed;
mod timeouts;
mod torture;
// The spans and events of the `tracing` feature.
#[cfg(feature = "tracing")]
mod tracing;
mod versioned;

/// Stops a worker when it goes, however it goes: a failed assertion beside
/// a running worker ends its test rather than leaving the test waiting for
/// a worker nothing will stop.
struct StopsOnDrop<'a>(&'a diesel_claim::StopHandle);

impl Drop for StopsOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// Checks out every connection of `pool` at once, one per thread, and runs
/// `check` on each of them concurrently.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn on_every_connection_at_once<M>(
    pool: &diesel::r2d2::Pool<M>,
    check: impl Fn(&mut M::Connection) + Sync,
) where
    M: diesel::r2d2::ManageConnection,
{
    let size = pool.max_size() as usize;
    let all_checked_out = std::sync::Barrier::new(size);
    std::thread::scope(|scope| {
        for _ in 0..size {
            scope.spawn(|| {
                let mut conn = pool.get().expect("cannot check out a connection");
                all_checked_out.wait();
                check(&mut conn);
            });
        }
    });
}

#[cfg(feature = "postgres")]
#[test]
fn common_pg_database_roundtrip() {
    use diesel::dsl::{exists, select};
    use diesel::prelude::*;
    use diesel::sql_types::Integer;

    table! {
        pg_database (oid) {
            oid -> Oid,
            datname -> Text,
        }
    }

    let database_exists = |name: &str| -> bool {
        let mut admin = PgConnection::establish(&testkit::pg_url()).expect("admin connection");
        select(exists(
            pg_database::table.filter(pg_database::datname.eq(name)),
        ))
        .get_result(&mut admin)
        .expect("query pg_database")
    };

    let db = testkit::PgTestDb::new();
    let name = db.name().to_owned();
    assert!(database_exists(&name));
    assert!(db.url.contains(&name));

    let pool = testkit::pg_pool(&db.url, 4);
    on_every_connection_at_once(&pool, |conn| {
        let one: i32 = select(1.into_sql::<Integer>())
            .get_result(conn)
            .expect("SELECT 1");
        assert_eq!(one, 1);
    });

    // Connections still open must not keep the database from being dropped.
    drop(db);
    assert!(!database_exists(&name));
}

#[cfg(feature = "sqlite")]
#[test]
fn common_sqlite_pool_roundtrip() {
    use diesel::dsl::{select, sql};
    use diesel::prelude::*;
    use diesel::sql_types::{Integer, Text};

    fn pragma(conn: &mut SqliteConnection, name: &str) -> String {
        select(sql::<Text>(&format!("(SELECT * FROM pragma_{name})")))
            .get_result(conn)
            .unwrap_or_else(|e| panic!("PRAGMA {name}: {e}"))
    }

    let db = testkit::SqliteTestDb::new();
    let pool = testkit::sqlite_pool(&db.url, 4);
    on_every_connection_at_once(&pool, |conn| {
        let one: i32 = select(1.into_sql::<Integer>())
            .get_result(conn)
            .expect("SELECT 1");
        assert_eq!(one, 1);

        assert_eq!(pragma(conn, "busy_timeout"), "30000");
        assert_eq!(pragma(conn, "journal_mode"), "wal");
        assert_eq!(pragma(conn, "foreign_keys"), "1");
    });
    assert!(db.path.is_file());

    let dir = db.path.parent().expect("database directory").to_owned();
    drop(pool);
    drop(db);
    assert!(!dir.exists());
}
