//! The shop schema the tests work on, and a macro that runs each test on every
//! backend.

use diesel::prelude::*;
use diesel_claim::{Error, Transient};

diesel::table! {
    customers (id) {
        id -> Integer,
        name -> Text,
        vip -> Bool,
    }
}

diesel::table! {
    orders (id) {
        id -> Integer,
        customer_id -> Nullable<Integer>,
        shipped -> Bool,
        email_sent -> Bool,
    }
}

diesel::table! {
    outbox (id) {
        id -> Integer,
        order_id -> Integer,
        worker -> Integer,
    }
}

diesel::table! {
    accounts (id) {
        id -> Integer,
        balance -> BigInt,
        version -> Integer,
    }
}

diesel::table! {
    /// Lines of orders, keyed by two columns.
    order_lines (order_id, line_no) {
        order_id -> Integer,
        line_no -> Integer,
        packed -> Bool,
        times_packed -> Integer,
    }
}

diesel::table! {
    /// Jobs run by priority, then by due time; `attempts` counts failed runs.
    jobs (id) {
        id -> Integer,
        priority -> Integer,
        due -> Timestamp,
        done -> Bool,
        times_done -> Integer,
        attempts -> Integer,
    }
}

diesel::joinable!(orders -> customers (customer_id));
diesel::joinable!(outbox -> orders (order_id));
diesel::allow_tables_to_appear_in_same_query!(customers, orders, outbox, accounts);

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Identifiable)]
#[diesel(table_name = orders)]
pub struct Order {
    pub id: i32,
    pub customer_id: Option<i32>,
    pub shipped: bool,
    pub email_sent: bool,
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Identifiable)]
#[diesel(table_name = order_lines, primary_key(order_id, line_no))]
pub struct OrderLine {
    pub order_id: i32,
    pub line_no: i32,
    pub packed: bool,
    pub times_packed: i32,
}

/// A job, without its due time (read only by the claim order).
#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Identifiable)]
#[diesel(table_name = jobs)]
pub struct Job {
    pub id: i32,
    pub priority: i32,
    pub done: bool,
    pub times_done: i32,
    pub attempts: i32,
}

/// Inserts jobs `1..=count`: priority `id % 4`, due `id * 7 % 60` minutes past
/// 08:00, so priorities and due times tie, and only the key tells some jobs
/// apart. Returns their ids in the order `priority DESC, due, id`.
pub fn insert_jobs<C>(conn: &mut C, count: i32) -> Vec<i32>
where
    C: diesel::Connection,
{
    let minutes = |id: i32| id * 7 % 60;
    let values: Vec<String> = (1..=count)
        .map(|id| format!("({id}, {}, '2026-01-01 08:{:02}:00')", id % 4, minutes(id)))
        .collect();
    for chunk in values.chunks(500) {
        let sql = format!(
            "INSERT INTO jobs (id, priority, due) VALUES {}",
            chunk.join(", ")
        );
        conn.batch_execute(&sql).expect("cannot insert jobs");
    }
    let mut order: Vec<i32> = (1..=count).collect();
    order.sort_by_key(|&id| (std::cmp::Reverse(id % 4), minutes(id), id));
    order
}

#[derive(Debug, Clone, PartialEq, Queryable, Selectable, Identifiable)]
#[diesel(table_name = accounts)]
pub struct Account {
    pub id: i32,
    pub balance: i64,
    pub version: i32,
}

/// The shop schema of `backend` (`pg`, `sqlite` or `mysql`).
pub fn schema_of(backend: &str) -> &'static str {
    match backend {
        #[cfg(feature = "postgres")]
        "pg" => POSTGRES_SCHEMA,
        #[cfg(feature = "sqlite")]
        "sqlite" => SQLITE_SCHEMA,
        #[cfg(feature = "mysql")]
        "mysql" => MYSQL_SCHEMA,
        other => panic!("no schema for {other:?}"),
    }
}

#[cfg(feature = "postgres")]
pub const POSTGRES_SCHEMA: &str = "
    CREATE TABLE customers (id SERIAL PRIMARY KEY, name TEXT NOT NULL, vip BOOLEAN NOT NULL DEFAULT FALSE);
    CREATE TABLE orders (
        id SERIAL PRIMARY KEY,
        customer_id INTEGER REFERENCES customers (id),
        shipped BOOLEAN NOT NULL DEFAULT TRUE,
        email_sent BOOLEAN NOT NULL DEFAULT FALSE
    );
    CREATE TABLE outbox (id SERIAL PRIMARY KEY, order_id INTEGER NOT NULL REFERENCES orders (id), worker INTEGER NOT NULL);
    CREATE TABLE accounts (id SERIAL PRIMARY KEY, balance BIGINT NOT NULL, version INTEGER NOT NULL DEFAULT 0);
    CREATE TABLE order_lines (
        order_id INTEGER NOT NULL,
        line_no INTEGER NOT NULL,
        packed BOOLEAN NOT NULL DEFAULT FALSE,
        times_packed INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (order_id, line_no)
    );
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY,
        priority INTEGER NOT NULL,
        due TIMESTAMP NOT NULL,
        done BOOLEAN NOT NULL DEFAULT FALSE,
        times_done INTEGER NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0
    );
";

#[cfg(feature = "sqlite")]
pub const SQLITE_SCHEMA: &str = "
    CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, vip BOOLEAN NOT NULL DEFAULT FALSE);
    CREATE TABLE orders (
        id INTEGER PRIMARY KEY,
        customer_id INTEGER REFERENCES customers (id),
        shipped BOOLEAN NOT NULL DEFAULT TRUE,
        email_sent BOOLEAN NOT NULL DEFAULT FALSE
    );
    CREATE TABLE outbox (id INTEGER PRIMARY KEY, order_id INTEGER NOT NULL REFERENCES orders (id), worker INTEGER NOT NULL);
    CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance BIGINT NOT NULL, version INTEGER NOT NULL DEFAULT 0);
    CREATE TABLE order_lines (
        order_id INTEGER NOT NULL,
        line_no INTEGER NOT NULL,
        packed BOOLEAN NOT NULL DEFAULT FALSE,
        times_packed INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (order_id, line_no)
    );
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY,
        priority INTEGER NOT NULL,
        due TIMESTAMP NOT NULL,
        done BOOLEAN NOT NULL DEFAULT FALSE,
        times_done INTEGER NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0
    );
";

#[cfg(feature = "mysql")]
pub const MYSQL_SCHEMA: &str = "
    CREATE TABLE customers (
        id INTEGER AUTO_INCREMENT PRIMARY KEY, name TEXT NOT NULL, vip BOOLEAN NOT NULL DEFAULT FALSE
    ) ENGINE = InnoDB;
    CREATE TABLE orders (
        id INTEGER AUTO_INCREMENT PRIMARY KEY,
        customer_id INTEGER,
        shipped BOOLEAN NOT NULL DEFAULT TRUE,
        email_sent BOOLEAN NOT NULL DEFAULT FALSE,
        FOREIGN KEY (customer_id) REFERENCES customers (id)
    ) ENGINE = InnoDB;
    CREATE TABLE outbox (
        id INTEGER AUTO_INCREMENT PRIMARY KEY,
        order_id INTEGER NOT NULL,
        worker INTEGER NOT NULL,
        FOREIGN KEY (order_id) REFERENCES orders (id)
    ) ENGINE = InnoDB;
    CREATE TABLE accounts (
        id INTEGER AUTO_INCREMENT PRIMARY KEY, balance BIGINT NOT NULL, version INTEGER NOT NULL DEFAULT 0
    ) ENGINE = InnoDB;
    CREATE TABLE order_lines (
        order_id INTEGER NOT NULL,
        line_no INTEGER NOT NULL,
        packed BOOLEAN NOT NULL DEFAULT FALSE,
        times_packed INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (order_id, line_no)
    ) ENGINE = InnoDB;
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY,
        priority INTEGER NOT NULL,
        due DATETIME(6) NOT NULL,
        done BOOLEAN NOT NULL DEFAULT FALSE,
        times_done INTEGER NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0,
        INDEX by_claim_order (priority DESC, due, id)
    ) ENGINE = InnoDB;
";

/// The error of a transfer: the domain's own refusal, or the crate's error.
#[derive(Debug)]
pub enum BankError {
    /// The source account does not hold the amount: a refusal, not a failure.
    Insufficient,
    Claim(Error),
}

impl From<Error> for BankError {
    fn from(error: Error) -> Self {
        BankError::Claim(error)
    }
}

impl From<diesel::result::Error> for BankError {
    fn from(error: diesel::result::Error) -> Self {
        BankError::Claim(error.into())
    }
}

impl Transient for BankError {
    fn is_transient(&self) -> bool {
        matches!(self, BankError::Claim(error) if error.is_transient())
    }
}

/// What a bank run did.
#[derive(Debug)]
pub struct BankFigures {
    pub transfers: u64,
    pub refused: u64,
    pub retries: u64,
    pub reads: u64,
    pub elapsed: std::time::Duration,
}

/// `threads` clients each make `per_thread` random transfers of 1 to 300 among
/// accounts `1..=accounts` with `transfer` (which says how it went and how many
/// retries it took), while one more client keeps reading every balance with
/// `read_balances`. Every read, and the end state, must sum to `total` with no
/// negative balance; any error but a refusal fails the run.
#[allow(clippy::too_many_arguments)]
pub fn run_bank<M>(
    pool: &diesel::r2d2::Pool<M>,
    accounts: u64,
    total: i64,
    threads: usize,
    per_thread: usize,
    read_balances: impl Fn(&mut M::Connection) -> Vec<i64> + Sync,
    transfer: impl Fn(&mut M::Connection, i32, i32, i64) -> (Result<(), BankError>, u64) + Sync,
) -> BankFigures
where
    M: diesel::r2d2::ManageConnection,
{
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    use std::sync::Barrier;
    use std::thread;
    use std::time::{Duration, Instant};

    let [transfers, refused, retries, reads] = [(); 4].map(|()| AtomicU64::new(0));
    let running = AtomicBool::new(true);
    let start = Barrier::new(threads + 1);
    let check = |seen: &[i64], when: &str| {
        assert_eq!(
            seen.iter().sum::<i64>(),
            total,
            "{when}: money appeared or vanished: {seen:?}"
        );
        assert!(
            seen.iter().all(|b| *b >= 0),
            "{when}: a negative balance: {seen:?}"
        );
    };
    let started = Instant::now();
    thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut conn = pool.get().unwrap();
            start.wait();
            while running.load(Relaxed) {
                check(&read_balances(&mut conn), "a reader");
                reads.fetch_add(1, Relaxed);
                thread::sleep(Duration::from_millis(1));
            }
        });
        let clients: Vec<_> = (0..threads)
            .map(|t| {
                let (start, transfer) = (&start, &transfer);
                let (transfers, refused, retries) = (&transfers, &refused, &retries);
                scope.spawn(move || {
                    let mut conn = pool.get().unwrap();
                    let mut rng = fastrand::Rng::with_seed(t as u64 + 1);
                    start.wait();
                    for _ in 0..per_thread {
                        let (from, to) = account_pair(&mut rng, accounts);
                        let amount = 1 + rng.u64(..300) as i64;
                        let (outcome, retried) = transfer(&mut conn, from, to, amount);
                        retries.fetch_add(retried, Relaxed);
                        match outcome {
                            Ok(()) => transfers.fetch_add(1, Relaxed),
                            Err(BankError::Insufficient) => refused.fetch_add(1, Relaxed),
                            Err(BankError::Claim(e)) => {
                                panic!("transfer {from} -> {to} failed: {e:?}")
                            }
                        };
                    }
                })
            })
            .collect();
        for client in clients {
            client.join().unwrap();
        }
        running.store(false, Relaxed);
        reader.join().unwrap();
    });
    check(&read_balances(&mut pool.get().unwrap()), "at the end");
    let figures = BankFigures {
        transfers: transfers.into_inner(),
        refused: refused.into_inner(),
        retries: retries.into_inner(),
        reads: reads.into_inner(),
        elapsed: started.elapsed(),
    };
    assert_eq!(
        figures.transfers + figures.refused,
        (threads * per_thread) as u64
    );
    assert!(figures.transfers > 0 && figures.reads > 0, "{figures:?}");
    figures
}

/// Two distinct account ids in `1..=accounts`, picked at random.
pub fn account_pair(random: &mut fastrand::Rng, accounts: u64) -> (i32, i32) {
    let from = random.u64(..accounts);
    let to = (from + 1 + random.u64(..accounts - 1)) % accounts;
    (from as i32 + 1, to as i32 + 1)
}

/// Expands its test functions once per enabled backend, in modules `pg`,
/// `sqlite` and `mysql` (`except_mysql;` first: tests that need `RETURNING`,
/// which MySQL lacks; `row_locks;`: see below). Inside, `Conn` is the backend's connection type, `Pool`
/// its r2d2 pool, `ROW_LOCKS` says whether it has row locks, and `test_db(size)`
/// gives a fresh database with the shop schema and the crate's migrations, plus
/// a pool of `size` connections to it.
#[macro_export]
macro_rules! on_every_backend {
    (@backend $module:ident, $conn:ty, $row_locks:expr,
        $test_db:ident, $pool:ident, $schema:ident, $($tests:tt)*) => {
        mod $module {
            #![allow(unused_imports, dead_code)]
            use super::*;
            pub type Conn = $conn;
            pub type Pool = diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<Conn>>;
            pub const ROW_LOCKS: bool = $row_locks;
            /// The backend: `pg`, `sqlite` or `mysql`.
            pub const BACKEND: &str = stringify!($module);
            /// Makes the session give up waiting for a lock after a short while.
            pub const SHORT_LOCK_WAIT: &str = $crate::fixtures::short_lock_wait!($module);
            /// The SQL type of a claim stamp column, and its column type.
            pub type ClaimStamp = $crate::fixtures::claim_stamp!($module);
            pub const CLAIM_STAMP_COLUMN: &str = $crate::fixtures::claim_stamp!(column $module);
            /// The SQL creating the shop schema on this backend.
            pub const SCHEMA: &str = $crate::fixtures::$schema;

            pub fn test_db(size: u32) -> ($crate::$test_db, Pool) {
                let db = $crate::$test_db::new();
                let pool = $crate::$pool(&db.url, size);
                $crate::fixtures::create_schema(&mut pool.get().unwrap(), $crate::fixtures::$schema);
                (db, pool)
            }

            /// Accounts `1..=balances.len()` with the given balances, all at version 0.
            pub fn seed_accounts(conn: &mut Conn, balances: &[i64]) {
                use diesel::prelude::*;
                use $crate::fixtures::accounts;
                let rows: Vec<_> = balances
                    .iter()
                    .enumerate()
                    .map(|(i, balance)| (accounts::id.eq(i as i32 + 1), accounts::balance.eq(*balance)))
                    .collect();
                diesel::insert_into(accounts::table).values(&rows).execute(conn).unwrap();
            }

            /// Every account's balance, in id order, as of one moment while
            /// transfers run. On MariaDB under a shared lock: there a plain
            /// read of several rows can see a transfer made under row locks
            /// half applied (the guide's section on MySQL and MariaDB).
            pub fn consistent_balances(conn: &mut Conn) -> Vec<i64> {
                use diesel::prelude::*;
                use diesel_claim::prelude::*;
                use $crate::fixtures::{accounts, Account};
                let all = accounts::table.order(accounts::id);
                if BACKEND != "mysql" {
                    return all.select(accounts::balance).load(conn).unwrap();
                }
                all.select(Account::as_select())
                    .build_lock()
                    .strength(diesel_claim::LockStrength::Share)
                    .run_all(conn, |_, rows: Vec<Account>| {
                        Ok::<_, diesel_claim::Error>(rows.into_iter().map(|a| a.balance).collect())
                    })
                    .unwrap()
            }

            $($tests)*
        }
    };
    // Tests of row-lock behaviour, for the backends that have row locks, in
    // modules `pg_row_locks` and `mysql_row_locks` that see everything the
    // file's main block (`pg`, `mysql`) defines.
    (row_locks; $($tests:tt)*) => {
        #[cfg(feature = "postgres")]
        mod pg_row_locks {
            #![allow(unused_imports)]
            use super::*;
            use super::pg::*;
            $($tests)*
        }
        #[cfg(feature = "mysql")]
        mod mysql_row_locks {
            #![allow(unused_imports)]
            use super::*;
            use super::mysql::*;
            $($tests)*
        }
    };
    (except_mysql; $($tests:tt)*) => {
        #[cfg(feature = "postgres")]
        $crate::fixtures::on_every_backend!(@backend pg, diesel::PgConnection, true,
            PgTestDb, pg_pool, POSTGRES_SCHEMA, $($tests)*);
        #[cfg(feature = "sqlite")]
        $crate::fixtures::on_every_backend!(@backend sqlite, diesel::SqliteConnection, false,
            SqliteTestDb, sqlite_pool, SQLITE_SCHEMA, $($tests)*);
    };
    ($($tests:tt)*) => {
        $crate::fixtures::on_every_backend!(except_mysql; $($tests)*);
        #[cfg(feature = "mysql")]
        $crate::fixtures::on_every_backend!(@backend mysql, diesel::MysqlConnection, true,
            MysqlTestDb, mysql_pool, MYSQL_SCHEMA, $($tests)*);
    };
}
pub use crate::on_every_backend;

/// SQL that makes a session of the backend give up waiting for a lock soon.
#[doc(hidden)]
#[macro_export]
macro_rules! short_lock_wait {
    (pg) => {
        "SET lock_timeout = '200ms'"
    };
    (sqlite) => {
        "PRAGMA busy_timeout = 200"
    };
    // Whole seconds only.
    (mysql) => {
        "SET SESSION innodb_lock_wait_timeout = 1"
    };
}
pub use crate::short_lock_wait;

/// A visibility-timeout claim's stamp column on each backend: its SQL type,
/// and (`column`) its type in `CREATE TABLE`.
#[macro_export]
macro_rules! claim_stamp {
    (pg) => {
        diesel::sql_types::Timestamptz
    };
    (sqlite) => {
        diesel::sql_types::Timestamp
    };
    (mysql) => {
        diesel::sql_types::Datetime
    };
    (column pg) => {
        "TIMESTAMPTZ"
    };
    (column sqlite) => {
        "TIMESTAMP"
    };
    (column mysql) => {
        "DATETIME(6)"
    };
}
pub use crate::claim_stamp;

pub fn create_schema<C>(conn: &mut C, schema: &str)
where
    C: diesel::connection::LoadConnection + 'static,
    C::Backend: diesel_claim::ClaimBackend,
{
    conn.batch_execute(schema)
        .expect("cannot create the test schema");
    diesel_claim::run_migrations(conn).expect("cannot run diesel-claim's migrations");
}
