//! The database the benchmark works in: a database of its own on the
//! PostgreSQL or MySQL server (dropped at the end) or an SQLite file in a
//! temporary directory.

use diesel::prelude::*;

use crate::db::{BackendKind, BenchConn};
use crate::schema;

/// The server a backend's runs use: as the tests find theirs
/// (`PG_DATABASE_URL`, `MYSQL_DATABASE_URL`, …; see `diesel_claim_testkit`).
pub fn server_url(backend: BackendKind) -> String {
    match backend {
        BackendKind::Postgres => testkit::pg_url(),
        BackendKind::Mysql => testkit::mysql_url(),
        BackendKind::Sqlite => unreachable!("SQLite has no server"),
    }
}

/// The database the benchmark creates for itself on a server, dropped when
/// this is dropped, also when the run fails.
enum ServerDatabase {
    Postgres(testkit::PgTestDb),
    Mysql(testkit::MysqlTestDb),
}

impl ServerDatabase {
    fn create(backend: BackendKind) -> Self {
        match backend {
            BackendKind::Postgres => ServerDatabase::Postgres(testkit::PgTestDb::new()),
            BackendKind::Mysql => ServerDatabase::Mysql(testkit::MysqlTestDb::new()),
            BackendKind::Sqlite => unreachable!("SQLite has no server"),
        }
    }

    fn url(&self) -> &str {
        match self {
            ServerDatabase::Postgres(db) => &db.url,
            ServerDatabase::Mysql(db) => &db.url,
        }
    }

    fn name(&self) -> &str {
        match self {
            ServerDatabase::Postgres(db) => db.name(),
            ServerDatabase::Mysql(db) => db.name(),
        }
    }
}

/// A database holding the workload's tables, for connections of type `C`.
pub struct BenchDb<C: BenchConn> {
    pub url: String,
    /// PostgreSQL and MySQL: the database, and a connection to the server's
    /// other database (PostgreSQL reads `pg_stat_database` from it, so that
    /// reading it does not count as a transaction of the benchmark's database).
    server: Option<(ServerDatabase, C)>,
    _sqlite_dir: Option<tempfile::TempDir>,
}

impl<C: BenchConn> BenchDb<C> {
    /// A new database with the workload's tables, `orders` partitioned by its
    /// pending flag if `partitioned`.
    pub fn create(partitioned: bool) -> Result<Self, String> {
        let mut db = match C::BACKEND {
            BackendKind::Postgres | BackendKind::Mysql => {
                let admin_url = server_url(C::BACKEND);
                let admin = C::open(&admin_url)
                    .map_err(|e| format!("cannot connect to {admin_url}: {e}"))?;
                let database = ServerDatabase::create(C::BACKEND);
                BenchDb {
                    url: database.url().to_owned(),
                    server: Some((database, admin)),
                    _sqlite_dir: None,
                }
            }
            BackendKind::Sqlite => {
                let dir = tempfile::Builder::new()
                    .prefix("diesel-claim-bench-")
                    .tempdir()
                    .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
                BenchDb {
                    url: dir
                        .path()
                        .join("bench.sqlite")
                        .to_string_lossy()
                        .into_owned(),
                    server: None,
                    _sqlite_dir: Some(dir),
                }
            }
        };
        db.setup(|conn: &mut C| {
            conn.batch_execute(&schema::create_tables(C::BACKEND, partitioned))
        })?;
        Ok(db)
    }

    /// Runs `f` on a connection of its own whose transactions are counted
    /// before the next measurement starts (its statistics are flushed before
    /// it closes).
    pub fn setup<T>(&mut self, f: impl FnOnce(&mut C) -> QueryResult<T>) -> Result<T, String> {
        let mut conn = C::open(&self.url).map_err(|e| format!("cannot connect: {e}"))?;
        let value = f(&mut conn).map_err(|e| e.to_string())?;
        conn.flush_stats().map_err(|e| e.to_string())?;
        Ok(value)
    }

    /// Transactions committed in this database so far (PostgreSQL), as of the
    /// last statistics flush of each connection.
    pub fn server_commits(&mut self) -> Result<Option<i64>, String> {
        let Some((database, admin)) = self.server.as_mut().filter(|_| C::BACKEND.counts_commits())
        else {
            return Ok(None);
        };
        // The view is read from a snapshot taken once per transaction.
        admin
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .and_then(|()| {
                admin.load_count(&format!(
                    "SELECT xact_commit AS n FROM pg_stat_database WHERE datname = '{}'",
                    database.name()
                ))
            })
            .map(Some)
            .map_err(|e| format!("cannot read pg_stat_database: {e}"))
    }
}
