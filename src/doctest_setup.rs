// Shared by the documentation examples: a small shop on the backend the build
// enables (PostgreSQL first, then MySQL, then SQLite), in tables that live as
// long as the connection, so that examples running at once never meet and
// nothing is left behind: temporary tables on PostgreSQL and MySQL (servers
// found as the tests find theirs), a database in memory on SQLite.
use diesel::connection::SimpleConnection;
use diesel::prelude::*;

diesel::table! {
    orders (id) {
        id -> Integer,
        shipped -> Bool,
        email_sent -> Bool,
    }
}

/// The type of a claim stamp column on the backend the build enables.
#[cfg(feature = "postgres")]
pub type ClaimStamp = diesel::sql_types::Timestamptz;
#[cfg(all(feature = "mysql", not(feature = "postgres")))]
pub type ClaimStamp = diesel::sql_types::Datetime;
#[cfg(all(feature = "sqlite", not(any(feature = "postgres", feature = "mysql"))))]
pub type ClaimStamp = diesel::sql_types::Timestamp;

diesel::table! {
    use diesel::sql_types::*;
    use super::ClaimStamp;

    invoices (id) {
        id -> Integer,
        sent -> Bool,
        claimed_until -> Nullable<ClaimStamp>,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use super::ClaimStamp;

    /// A job queue: jobs run by priority; `attempts` counts failures, and a
    /// job runs no sooner than `run_at`.
    jobs (id) {
        id -> Integer,
        priority -> Integer,
        attempts -> Integer,
        run_at -> ClaimStamp,
        last_error -> Nullable<Text>,
        done -> Bool,
    }
}

diesel::table! {
    accounts (id) {
        id -> Integer,
        balance -> BigInt,
        version -> Integer,
    }
}

#[derive(Debug, Queryable, Selectable, Identifiable)]
#[diesel(table_name = orders)]
pub struct Order {
    pub id: i32,
    pub shipped: bool,
    pub email_sent: bool,
}

#[derive(Debug, Queryable, Selectable, Identifiable)]
#[diesel(table_name = invoices)]
pub struct Invoice {
    pub id: i32,
    pub sent: bool,
}

#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = jobs)]
pub struct Job {
    pub id: i32,
    pub priority: i32,
    pub attempts: i32,
}

#[derive(Debug, Queryable, Selectable, Identifiable)]
#[diesel(table_name = accounts)]
pub struct Account {
    pub id: i32,
    pub balance: i64,
    pub version: i32,
}

const DOCTEST_ROWS: &str = "
    INSERT INTO orders (shipped, email_sent) VALUES (TRUE, FALSE), (TRUE, FALSE), (FALSE, FALSE);
    INSERT INTO accounts (balance, version) VALUES (100, 0), (50, 0);
    INSERT INTO invoices (sent) VALUES (FALSE), (FALSE), (TRUE);
    INSERT INTO jobs (priority) VALUES (0), (5), (0);";

#[cfg(feature = "postgres")]
fn establish_connection() -> PgConnection {
    let mut conn = PgConnection::establish(&diesel_claim_testkit::pg_url()).unwrap();
    // Everything the session creates, the lease table included, goes into its
    // own temporary schema.
    conn.batch_execute(
        "SET search_path TO pg_temp;
         CREATE TABLE orders (id SERIAL PRIMARY KEY, shipped BOOLEAN NOT NULL, email_sent BOOLEAN NOT NULL);
         CREATE TABLE accounts (id SERIAL PRIMARY KEY, balance BIGINT NOT NULL, version INTEGER NOT NULL);
         CREATE TABLE invoices (id SERIAL PRIMARY KEY, sent BOOLEAN NOT NULL, claimed_until TIMESTAMPTZ);
         CREATE TABLE jobs (id SERIAL PRIMARY KEY, priority INTEGER NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, run_at TIMESTAMPTZ NOT NULL DEFAULT now(), last_error TEXT, done BOOLEAN NOT NULL DEFAULT FALSE);",
    )
    .unwrap();
    conn.batch_execute(DOCTEST_ROWS).unwrap();
    diesel_claim::run_migrations(&mut conn).unwrap();
    conn
}

#[cfg(all(feature = "mysql", not(feature = "postgres")))]
fn establish_connection() -> MysqlConnection {
    let mut conn = MysqlConnection::establish(&diesel_claim_testkit::mysql_url()).unwrap();
    // The crate's migrations would create a lasting lease table; the session's
    // own temporary one has the same columns.
    conn.batch_execute(
        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED;
         CREATE TEMPORARY TABLE orders (id INTEGER AUTO_INCREMENT PRIMARY KEY, shipped BOOLEAN NOT NULL, email_sent BOOLEAN NOT NULL) ENGINE = InnoDB;
         CREATE TEMPORARY TABLE accounts (id INTEGER AUTO_INCREMENT PRIMARY KEY, balance BIGINT NOT NULL, version INTEGER NOT NULL) ENGINE = InnoDB;
         CREATE TEMPORARY TABLE invoices (id INTEGER AUTO_INCREMENT PRIMARY KEY, sent BOOLEAN NOT NULL, claimed_until DATETIME(6)) ENGINE = InnoDB;
         CREATE TEMPORARY TABLE jobs (id INTEGER AUTO_INCREMENT PRIMARY KEY, priority INTEGER NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, run_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)), last_error TEXT, done BOOLEAN NOT NULL DEFAULT FALSE) ENGINE = InnoDB;
         CREATE TEMPORARY TABLE diesel_claim_leases (name VARBINARY(255) NOT NULL PRIMARY KEY, token BIGINT NOT NULL, expires_at BIGINT NOT NULL) ENGINE = InnoDB;",
    )
    .unwrap();
    conn.batch_execute(DOCTEST_ROWS).unwrap();
    conn
}

#[cfg(all(feature = "sqlite", not(any(feature = "postgres", feature = "mysql"))))]
fn establish_connection() -> SqliteConnection {
    let mut conn = SqliteConnection::establish(":memory:").unwrap();
    conn.batch_execute(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, shipped BOOLEAN NOT NULL, email_sent BOOLEAN NOT NULL);
         CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance BIGINT NOT NULL, version INTEGER NOT NULL);
         CREATE TABLE invoices (id INTEGER PRIMARY KEY, sent BOOLEAN NOT NULL, claimed_until TIMESTAMP);
         CREATE TABLE jobs (id INTEGER PRIMARY KEY, priority INTEGER NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, run_at TIMESTAMP NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')), last_error TEXT, done BOOLEAN NOT NULL DEFAULT FALSE);",
    )
    .unwrap();
    conn.batch_execute(DOCTEST_ROWS).unwrap();
    diesel_claim::run_migrations(&mut conn).unwrap();
    conn
}

#[allow(dead_code)]
fn send_shipped_email(_order: &Order) -> Result<(), diesel_claim::Error> {
    Ok(())
}

#[allow(dead_code)]
fn send_shipped_emails(_orders: &[Order]) -> Result<(), diesel_claim::Error> {
    Ok(())
}

/// The application's own error type, in the examples.
#[allow(dead_code)]
type MyError = diesel_claim::Error;
