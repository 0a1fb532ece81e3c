//! Throwaway MySQL and MariaDB databases: a database of its own per test.

use std::env;
use std::process;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_query;

/// The URL of a MySQL or MariaDB server the tests may create databases on:
/// `MYSQL_DATABASE_URL`, or `DATABASE_URL` if it is a `mysql://` URL, or
/// `mysql://root@127.0.0.1:3306/test`. A server that cannot be reached fails
/// the MySQL tests: they are never skipped silently.
pub fn mysql_url() -> String {
    if let Ok(url) = env::var("MYSQL_DATABASE_URL") {
        return url;
    }
    match env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("mysql") => url,
        _ => "mysql://root@127.0.0.1:3306/test".to_owned(),
    }
}

/// A database of its own for one test, dropped when this value is dropped.
pub struct MysqlTestDb {
    /// Connection URL of the new database.
    pub url: String,
    name: String,
    admin_url: String,
}

impl MysqlTestDb {
    /// Creates a uniquely named, empty database on the server of [`mysql_url`].
    pub fn new() -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let admin_url = mysql_url();
        let name = format!(
            "dc_test_{}_{}",
            process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = MysqlConnection::establish(&admin_url).unwrap_or_else(|e| {
            panic!(
                "cannot connect to {admin_url}: {e}; the MySQL tests need a server: set \
                 MYSQL_DATABASE_URL=mysql://user@host/db (the user must be allowed to create \
                 databases)"
            )
        });
        sql_query(format!("CREATE DATABASE `{name}`"))
            .execute(&mut admin)
            .unwrap_or_else(|e| panic!("cannot create database {name}: {e}"));
        MysqlTestDb {
            url: crate::url::with_database(&admin_url, &name),
            name,
            admin_url,
        }
    }

    /// Name of the database.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for MysqlTestDb {
    fn drop(&mut self) {
        let dropped = MysqlConnection::establish(&self.admin_url)
            .map_err(|e| e.to_string())
            .and_then(|mut admin| {
                sql_query(format!("DROP DATABASE IF EXISTS `{}`", self.name))
                    .execute(&mut admin)
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = dropped {
            eprintln!("could not drop test database {}: {e}", self.name);
        }
    }
}

/// A pool of `size` connections to `url`.
pub fn mysql_pool(url: &str, size: u32) -> Pool<ConnectionManager<MysqlConnection>> {
    Pool::builder()
        .max_size(size)
        .connection_timeout(Duration::from_secs(10))
        .build(ConnectionManager::new(url))
        .unwrap_or_else(|e| panic!("cannot build a pool for {url}: {e}"))
}
