//! The database the benchmark works in: a database of its own on the
//! PostgreSQL or MySQL server (dropped at the end) or an SQLite file in a
//! temporary directory.

use std::marker::PhantomData;

use diesel::prelude::*;

use crate::db::{BackendKind, BenchConn};
use crate::schema;

/// The server a backend's runs use: `<PREFIX>_DATABASE_URL`, else
/// `DATABASE_URL` if it is that backend's URL, else the local default.
pub fn server_url(backend: BackendKind) -> String {
    let (variable, scheme, default) = match backend {
        BackendKind::Postgres => (
            "PG_DATABASE_URL",
            "postgres",
            "postgres://postgres@127.0.0.1:5432/test",
        ),
        BackendKind::Mysql => (
            "MYSQL_DATABASE_URL",
            "mysql",
            "mysql://root@127.0.0.1:3306/test",
        ),
        BackendKind::Sqlite => unreachable!("SQLite has no server"),
    };
    std::env::var(variable)
        .ok()
        .or_else(|| {
            std::env::var("DATABASE_URL")
                .ok()
                .filter(|url| url.starts_with(scheme))
        })
        .unwrap_or_else(|| default.to_owned())
}

/// The database the benchmark creates for itself on a server, dropped when
/// this is dropped, also when the run fails.
pub struct ServerDatabase<C: BenchConn> {
    name: String,
    admin_url: String,
    url: String,
    _conn: PhantomData<fn() -> C>,
}

impl<C: BenchConn> ServerDatabase<C> {
    fn create(admin: &mut C, admin_url: &str) -> QueryResult<Self> {
        let name = format!("diesel_claim_bench_{}", std::process::id());
        // A database left by an earlier run of the same pid, killed before it
        // could drop it, goes first.
        admin.batch_execute(&Self::drop_statement(&name))?;
        admin.batch_execute(&format!("CREATE DATABASE {}", Self::quoted(&name)))?;
        Ok(ServerDatabase {
            url: with_database(admin_url, &name),
            name,
            admin_url: admin_url.to_owned(),
            _conn: PhantomData,
        })
    }

    fn quoted(name: &str) -> String {
        match C::BACKEND {
            BackendKind::Mysql => format!("`{name}`"),
            _ => format!(r#""{name}""#),
        }
    }

    fn drop_statement(name: &str) -> String {
        // PostgreSQL refuses to drop a database others are connected to;
        // `FORCE` ends them (a failed run may have left a worker connected).
        let force = match C::BACKEND {
            BackendKind::Postgres => " WITH (FORCE)",
            _ => "",
        };
        format!("DROP DATABASE IF EXISTS {}{force}", Self::quoted(name))
    }
}

impl<C: BenchConn> Drop for ServerDatabase<C> {
    fn drop(&mut self) {
        let dropped = C::open(&self.admin_url)
            .map_err(|e| e.to_string())
            .and_then(|mut admin| {
                admin
                    .batch_execute(&Self::drop_statement(&self.name))
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = dropped {
            eprintln!("could not drop the benchmark database {}: {e}", self.name);
        }
    }
}

/// `url` with its database name replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let authority = base.find("://").map_or(0, |i| i + 3);
    let path = base[authority..]
        .find('/')
        .map_or(base.len(), |i| authority + i);
    let query = query.map(|q| format!("?{q}")).unwrap_or_default();
    format!("{}/{database}{query}", &base[..path])
}

/// A database holding the workload's tables, for connections of type `C`.
pub struct BenchDb<C: BenchConn> {
    pub url: String,
    /// PostgreSQL and MySQL: the database, and a connection to the server's
    /// other database (PostgreSQL reads `pg_stat_database` from it, so that
    /// reading it does not count as a transaction of the benchmark's database).
    server: Option<(ServerDatabase<C>, C)>,
    _sqlite_dir: Option<tempfile::TempDir>,
}

impl<C: BenchConn> BenchDb<C> {
    pub fn create() -> Result<Self, String> {
        let mut db = match C::BACKEND {
            BackendKind::Postgres | BackendKind::Mysql => {
                let admin_url = server_url(C::BACKEND);
                let mut admin = C::open(&admin_url)
                    .map_err(|e| format!("cannot connect to {admin_url}: {e}"))?;
                let database = ServerDatabase::create(&mut admin, &admin_url)
                    .map_err(|e| format!("cannot create the benchmark database: {e}"))?;
                BenchDb {
                    url: database.url.clone(),
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
        db.setup(|conn: &mut C| conn.batch_execute(&schema::create_tables(C::BACKEND)))?;
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
                    database.name
                ))
            })
            .map(Some)
            .map_err(|e| format!("cannot read pg_stat_database: {e}"))
    }
}
