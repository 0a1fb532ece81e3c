//! Throwaway SQLite databases: a file of its own per test, in a temporary
//! directory.

use std::path::PathBuf;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::r2d2::{self, ConnectionManager, CustomizeConnection, Pool};
use diesel::{QueryResult, SqliteConnection};

/// A fresh SQLite database file, deleted together with its directory
/// when this value is dropped.
pub struct SqliteTestDb {
    /// Path of the database file (not created until first connection).
    pub path: PathBuf,
    /// Connection URL of the database.
    pub url: String,
    _dir: tempfile::TempDir,
}

impl SqliteTestDb {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("diesel-claim-test-")
            .tempdir()
            .expect("cannot create a temporary directory");
        let path = dir.path().join("test.sqlite");
        let url = path
            .to_str()
            .expect("temporary directory path is not UTF-8")
            .to_owned();
        SqliteTestDb {
            path,
            url,
            _dir: dir,
        }
    }
}

/// A pool of `size` connections to `url`, set up so that concurrent
/// writers wait for each other instead of failing with `SQLITE_BUSY`.
pub fn sqlite_pool(url: &str, size: u32) -> Pool<ConnectionManager<SqliteConnection>> {
    Pool::builder()
        .max_size(size)
        .connection_timeout(Duration::from_secs(10))
        .connection_customizer(Box::new(SqlitePragmas))
        .build(ConnectionManager::new(url))
        .unwrap_or_else(|e| panic!("cannot build a pool for {url}: {e}"))
}

/// Sets up `conn` as [`sqlite_pool`] sets up its connections.
pub fn set_pragmas(conn: &mut SqliteConnection) -> QueryResult<()> {
    conn.batch_execute(
        "PRAGMA busy_timeout = 30000; \
         PRAGMA journal_mode = WAL; \
         PRAGMA foreign_keys = ON;",
    )
}

#[derive(Debug)]
struct SqlitePragmas;

impl CustomizeConnection<SqliteConnection, r2d2::Error> for SqlitePragmas {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), r2d2::Error> {
        set_pragmas(conn).map_err(r2d2::Error::QueryError)
    }
}
