//! The three backends: connections, the SQL that differs between them, and
//! everything the benchmark does through a connection.

use std::sync::OnceLock;

use diesel::connection::{Connection, SimpleConnection};
use diesel::prelude::*;
use diesel::{sql_query, MysqlConnection, PgConnection};

use crate::schema::{self, Order, PENDING};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Postgres,
    Sqlite,
    /// MySQL 8 or MariaDB 10.6+ (the crate's `mysql` feature).
    Mysql,
}

/// How a hand-written claim treats rows locked by someone else (PostgreSQL,
/// MySQL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowLock {
    /// `FOR NO KEY UPDATE SKIP LOCKED` (MySQL: `FOR UPDATE SKIP LOCKED`)
    SkipLocked,
    /// `FOR UPDATE`: wait for the lock (the B4 negative control).
    Wait,
}

impl BackendKind {
    pub const ALL: [BackendKind; 3] = [
        BackendKind::Postgres,
        BackendKind::Sqlite,
        BackendKind::Mysql,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Postgres => "PostgreSQL",
            BackendKind::Sqlite => "SQLite",
            BackendKind::Mysql => "MySQL",
        }
    }

    /// The backend's name on the command line (`--backend`).
    pub fn flag(self) -> &'static str {
        match self {
            BackendKind::Postgres => "postgres",
            BackendKind::Sqlite => "sqlite",
            BackendKind::Mysql => "mysql",
        }
    }

    pub fn has_row_locks(self) -> bool {
        self != BackendKind::Sqlite
    }

    /// Whether tables can be partitioned (SQLite has no partitions).
    pub fn has_partitions(self) -> bool {
        self != BackendKind::Sqlite
    }

    /// Whether the server counts transactions per database (PostgreSQL's
    /// `pg_stat_database`); elsewhere the client counts them from the
    /// statements it sends.
    pub fn counts_commits(self) -> bool {
        self == BackendKind::Postgres
    }

    /// How a hand-written claiming transaction begins. SQLite takes the write
    /// lock up front, as the crate does, so that two claimers cannot both read a
    /// row as pending.
    pub fn begin(self) -> &'static str {
        match self {
            BackendKind::Postgres | BackendKind::Mysql => "BEGIN",
            BackendKind::Sqlite => "BEGIN IMMEDIATE",
        }
    }

    /// `SELECT <columns>` of the first `limit` pending orders, locked as asked
    /// where there are row locks.
    pub fn select_pending(self, columns: &str, limit: u32, lock: RowLock) -> String {
        self.select_pending_from(columns, None, limit, Some(lock))
    }

    /// `SELECT <columns>` of the first `limit` pending orders from id `from` on,
    /// locked as asked where there are row locks (`None`: read without locks).
    pub fn select_pending_from(
        self,
        columns: &str,
        from: Option<i64>,
        limit: u32,
        lock: Option<RowLock>,
    ) -> String {
        let clause = match (self, lock) {
            (BackendKind::Sqlite, _) | (_, None) => "",
            (BackendKind::Postgres, Some(RowLock::SkipLocked)) => " FOR NO KEY UPDATE SKIP LOCKED",
            // InnoDB has no `NO KEY UPDATE`; the crate sends `FOR UPDATE` too.
            (BackendKind::Mysql, Some(RowLock::SkipLocked)) => " FOR UPDATE SKIP LOCKED",
            (_, Some(RowLock::Wait)) => " FOR UPDATE",
        };
        let from = from.map_or(String::new(), |id| format!(" AND id >= {id}"));
        // SQLite's planner satisfies `ORDER BY id LIMIT n` by scanning the table
        // in rowid order, past every row already done, rather than through the
        // partial index: each claim would cost O(rows done) and the baselines
        // would slow down as the queue drains. Named, the index is used.
        let index = match self {
            BackendKind::Postgres | BackendKind::Mysql => "",
            BackendKind::Sqlite => " INDEXED BY orders_pending",
        };
        format!(
            "SELECT {columns} FROM orders{index} WHERE {PENDING}{from} ORDER BY id LIMIT \
             {limit}{clause}"
        )
    }

    /// O3h's claim: `SELECT <columns>` of the first `limit` pending orders by
    /// priority, highest first, then by id, skipping locked rows.
    pub fn select_pending_by_priority(self, columns: &str, limit: u32) -> String {
        let (index, clause) = match self {
            BackendKind::Postgres => ("", " FOR NO KEY UPDATE SKIP LOCKED"),
            BackendKind::Sqlite => (" INDEXED BY orders_pending_by_priority", ""),
            BackendKind::Mysql => ("", " FOR UPDATE SKIP LOCKED"),
        };
        format!(
            "SELECT {columns} FROM orders{index} WHERE {PENDING} ORDER BY priority DESC, id \
             LIMIT {limit}{clause}"
        )
    }

    /// B1's one statement: claims and marks up to `n` orders, returning their
    /// ids. `None` on MySQL, which has no `UPDATE … RETURNING`: one statement
    /// cannot both claim and tell which rows it claimed.
    pub fn claim_and_mark_batch(self, n: u32) -> Option<String> {
        let claim = self.select_pending("id", n, RowLock::SkipLocked);
        match self {
            BackendKind::Postgres => Some(format!(
                "WITH c AS ({claim}) \
                 UPDATE orders o SET shipped_email_sent = TRUE FROM c WHERE o.id = c.id \
                 RETURNING o.id"
            )),
            BackendKind::Sqlite => Some(format!(
                "UPDATE orders SET shipped_email_sent = TRUE WHERE id IN ({claim}) RETURNING id"
            )),
            BackendKind::Mysql => None,
        }
    }

    /// Whether B1's claiming statement needs a transaction of its own: on
    /// SQLite a lone `UPDATE` reads before it takes the write lock, and fails
    /// if another writer commits in between; `BEGIN IMMEDIATE` takes the lock
    /// first.
    pub fn claim_needs_transaction(self) -> bool {
        self == BackendKind::Sqlite
    }

    /// A row source of integers `i` from 1 to `count`.
    pub fn series(self, count: i64) -> String {
        match self {
            BackendKind::Postgres => format!("generate_series(1, {count}) AS s(i)"),
            BackendKind::Sqlite => format!(
                "(WITH RECURSIVE s(i) AS \
                 (SELECT 1 WHERE {count} >= 1 UNION ALL SELECT i + 1 FROM s WHERE i < {count}) \
                 SELECT i FROM s) AS s"
            ),
            // MySQL 8 stops recursive CTEs at 1000 levels unless told otherwise,
            // and MariaDB's `seq_1_to_n` tables are MariaDB's alone: a cross join
            // of digit tables works on both.
            BackendKind::Mysql => {
                let digits = count.max(1).to_string().len();
                let digit = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL \
                     SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL \
                     SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9)";
                let tables: Vec<String> = (0..digits).map(|k| format!("{digit} AS d{k}")).collect();
                let number: Vec<String> = (0..digits)
                    .map(|k| format!("{} * d{k}.d", 10_i64.pow(k as u32)))
                    .collect();
                format!(
                    "(SELECT i FROM (SELECT 1 + {} AS i FROM {}) AS n WHERE i <= {count}) AS s",
                    number.join(" + "),
                    tables.join(" CROSS JOIN ")
                )
            }
        }
    }

    /// `'customer ' || i`: MySQL reads `||` as `OR`, and SQLite 3.40 has no
    /// `concat`.
    pub fn customer_name(self) -> &'static str {
        match self {
            BackendKind::Postgres | BackendKind::Sqlite => "'customer ' || i",
            BackendKind::Mysql => "CONCAT('customer ', i)",
        }
    }

    /// Housekeeping after refilling the tables, so that every mode starts
    /// alike: fresh statistics, no dead rows, no checkpoint due.
    fn maintenance(self) -> &'static [&'static str] {
        match self {
            BackendKind::Postgres => &[
                "VACUUM ANALYZE orders",
                "VACUUM ANALYZE outbox",
                "CHECKPOINT",
            ],
            BackendKind::Sqlite => &["ANALYZE", "PRAGMA wal_checkpoint(TRUNCATE)"],
            // `TRUNCATE` has rebuilt the tables: no purge is due.
            BackendKind::Mysql => &["ANALYZE TABLE orders, outbox"],
        }
    }
}

/// What the benchmark does through a connection, one implementation per backend
/// (by [`impl_bench_conn`]). The mode loops in `drain.rs` and `contention.rs`
/// are generic over it; only this layer names concrete Diesel types.
pub trait BenchConn: Connection + Send + Sized + 'static {
    const BACKEND: BackendKind;

    fn open(url: &str) -> ConnectionResult<Self>;

    /// Runs a hand-written statement returning a column `id`.
    fn load_ids(&mut self, sql: &str) -> QueryResult<Vec<i64>>;
    /// Runs a hand-written statement returning [`schema::ORDER_COLUMNS`].
    fn load_orders(&mut self, sql: &str) -> QueryResult<Vec<Order>>;
    /// Runs a statement returning one `BIGINT` column `n`.
    fn load_count(&mut self, sql: &str) -> QueryResult<i64>;
    /// Runs a statement returning one `TEXT` column `t`.
    fn load_text(&mut self, sql: &str) -> QueryResult<String>;
    fn load_checks(&mut self) -> QueryResult<Checks>;
    /// The plan of a statement, one line per row: `EXPLAIN (ANALYZE, BUFFERS)`
    /// on PostgreSQL (which runs it), `EXPLAIN QUERY PLAN` on SQLite, and
    /// nothing on MySQL (whose plans are read by hand, see `BENCHMARKS.md`).
    fn load_plan(&mut self, sql: &str) -> QueryResult<Vec<String>>;

    // The processing every mode shares, so that modes differ only in how they
    // claim: mark orders done, and write their outbox rows.
    fn mark_row(&mut self, id: i64) -> QueryResult<()>;
    fn mark_rows(&mut self, ids: &[i64]) -> QueryResult<()>;
    fn write_outbox(&mut self, ids: &[i64]) -> QueryResult<()>;

    /// Processes one order: marks it done and writes its outbox row.
    fn process_row(&mut self, id: i64) -> QueryResult<()> {
        self.mark_row(id)?;
        self.write_outbox(&[id])
    }

    /// Processes a batch with one `UPDATE` and one multi-row `INSERT`.
    fn process_batch(&mut self, ids: &[i64]) -> QueryResult<()> {
        self.mark_rows(ids)?;
        self.write_outbox(ids)
    }

    // The crate's modes, one call each; they return the rows processed.
    /// B2: `claim_each`, per row (capped at `max_rows` for the memory runs).
    fn claim_rows(&mut self, max_rows: Option<u64>) -> Result<u64, diesel_claim::Error>;
    /// B3: batches of `n`, one transaction each.
    fn claim_batches(&mut self, n: u32) -> Result<u64, diesel_claim::Error>;
    /// H2 (`n` = 1) and H3: B2 and B3 taking each batch from the head of the
    /// query (`from_head`), with no candidates read.
    fn claim_from_head(&mut self, n: u32) -> Result<u64, diesel_claim::Error>;
    /// PL: the crate's worker, per row, until `stop`: polling every `min` up
    /// to `max` while idle, woken on `channel` if given; `picked(id)` as each
    /// row's closure starts.
    fn run_worker(
        &mut self,
        stop: &diesel_claim::StopHandle,
        poll: (std::time::Duration, std::time::Duration),
        channel: Option<&str>,
        picked: &mut dyn FnMut(i64),
    ) -> Result<u64, diesel_claim::Error>;
    /// O3: B3 in priority order.
    fn claim_batches_by_priority(&mut self, n: u32) -> Result<u64, diesel_claim::Error>;
    /// M1 and M2: batches of `n` claimed and marked by one `UPDATE … RETURNING`;
    /// with `commit_first` (M1) it commits on its own before the closure
    /// runs, otherwise (M2) the mark and the closure share one transaction.
    fn claim_marked(&mut self, n: u32, commit_first: bool) -> Result<u64, diesel_claim::Error>;

    /// D0 (`n` = 1) and D3: Diesel alone, as a user would write the claim
    /// without the crate: a transaction around the pending query with
    /// `.limit(n).for_update().skip_locked()`, then the processing. Returns
    /// the rows processed, 0 once none is found. Not on SQLite, which has no
    /// row locks (Diesel has no `FOR UPDATE` there).
    fn diesel_alone(&mut self, n: u32) -> QueryResult<u64>;

    // B5: add 1 to an account's balance.
    /// With `update_versioned` under `retry`; `attempts` counts closure runs.
    fn add_one_optimistic(
        &mut self,
        id: i32,
        attempts: &mut u64,
    ) -> Result<(), diesel_claim::Error>;
    /// With `with_lock`.
    fn add_one_pessimistic(&mut self, id: i32) -> Result<(), diesel_claim::Error>;

    /// PostgreSQL counts a backend's transactions in `pg_stat_database` only
    /// when it flushes its statistics, which it does lazily: this makes it
    /// flush now, this statement's own transaction included.
    fn flush_stats(&mut self) -> QueryResult<()> {
        match Self::BACKEND {
            BackendKind::Postgres => self.batch_execute("SELECT pg_stat_force_next_flush()"),
            BackendKind::Sqlite | BackendKind::Mysql => Ok(()),
        }
    }
}

/// What every drain must end with.
#[derive(Debug, Clone, Copy, QueryableByName)]
pub struct Checks {
    /// Outbox rows beyond one per order: rows processed twice.
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub duplicates: i64,
    /// Orders still pending.
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub leftovers: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub outbox_rows: i64,
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
}

/// The one column `n` of a counting statement.
#[derive(QueryableByName)]
pub struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub n: i64,
}

#[derive(QueryableByName)]
struct Text {
    #[diesel(sql_type = diesel::sql_types::Text)]
    t: String,
}

/// A line of PostgreSQL's `EXPLAIN`.
#[derive(QueryableByName)]
struct PlanLine {
    #[diesel(sql_type = diesel::sql_types::Text, column_name = "QUERY PLAN")]
    plan: String,
}

/// A step of SQLite's `EXPLAIN QUERY PLAN`.
#[derive(QueryableByName)]
struct PlanStep {
    #[diesel(sql_type = diesel::sql_types::Text)]
    detail: String,
}

fn outbox_body(id: i64) -> String {
    format!("Order {id} has shipped")
}

/// Implements [`BenchConn`] for one connection type; `$db` is its backend,
/// `$open` opens a connection, and `$locks` (`row_locks` or `no_row_locks`)
/// says whether Diesel can lock rows there.
macro_rules! impl_bench_conn {
    ($conn:ty, $db:ty, $kind:expr, $open:expr, $locks:ident) => {
        impl BenchConn for $conn {
            const BACKEND: BackendKind = $kind;

            fn open(url: &str) -> ConnectionResult<Self> {
                $open(url)
            }

            fn load_ids(&mut self, sql: &str) -> QueryResult<Vec<i64>> {
                let rows: Vec<Id> = sql_query(sql).load(self)?;
                Ok(rows.into_iter().map(|row| row.id).collect())
            }

            fn load_orders(&mut self, sql: &str) -> QueryResult<Vec<Order>> {
                sql_query(sql).load(self)
            }

            fn load_count(&mut self, sql: &str) -> QueryResult<i64> {
                sql_query(sql)
                    .get_result::<Count>(self)
                    .map(|count| count.n)
            }

            fn load_text(&mut self, sql: &str) -> QueryResult<String> {
                sql_query(sql).get_result::<Text>(self).map(|text| text.t)
            }

            fn load_checks(&mut self) -> QueryResult<Checks> {
                sql_query(schema::checks()).get_result(self)
            }

            fn load_plan(&mut self, sql: &str) -> QueryResult<Vec<String>> {
                Ok(match Self::BACKEND {
                    BackendKind::Postgres => {
                        let explain = format!("EXPLAIN (ANALYZE, BUFFERS) {sql}");
                        let lines: Vec<PlanLine> = sql_query(explain).load(self)?;
                        lines.into_iter().map(|line| line.plan).collect()
                    }
                    BackendKind::Sqlite => {
                        let explain = format!("EXPLAIN QUERY PLAN {sql}");
                        let steps: Vec<PlanStep> = sql_query(explain).load(self)?;
                        steps.into_iter().map(|step| step.detail).collect()
                    }
                    BackendKind::Mysql => Vec::new(),
                })
            }

            fn mark_row(&mut self, id: i64) -> QueryResult<()> {
                use schema::orders;
                diesel::update(orders::table.find(id))
                    .set(orders::shipped_email_sent.eq(true))
                    .execute(self)
                    .map(drop)
            }

            fn mark_rows(&mut self, ids: &[i64]) -> QueryResult<()> {
                use schema::orders;
                diesel::update(orders::table.filter(orders::id.eq_any(ids)))
                    .set(orders::shipped_email_sent.eq(true))
                    .execute(self)
                    .map(drop)
            }

            fn write_outbox(&mut self, ids: &[i64]) -> QueryResult<()> {
                use schema::outbox;
                let rows: Vec<_> = ids
                    .iter()
                    .map(|&id| (outbox::order_id.eq(id), outbox::body.eq(outbox_body(id))))
                    .collect();
                diesel::insert_into(outbox::table)
                    .values(rows)
                    .execute(self)
                    .map(drop)
            }

            fn run_worker(
                &mut self,
                stop: &diesel_claim::StopHandle,
                (min, max): (std::time::Duration, std::time::Duration),
                channel: Option<&str>,
                picked: &mut dyn FnMut(i64),
            ) -> Result<u64, diesel_claim::Error> {
                use diesel_claim::prelude::*;
                let worker = pending!($db)
                    .build_claim()
                    .worker(stop)
                    .poll_interval(min, max);
                let worker = match channel {
                    Some(channel) => worker.listen(channel),
                    None => worker,
                };
                let report = worker.run(self, |conn, order: Order| {
                    picked(order.id);
                    conn.process_row(order.id)?;
                    Ok::<_, diesel_claim::Error>(())
                })?;
                Ok(report.processed)
            }

            fn claim_rows(&mut self, max_rows: Option<u64>) -> Result<u64, diesel_claim::Error> {
                use diesel_claim::prelude::*;
                let claim = pending!($db).build_claim();
                let claim = match max_rows {
                    Some(max_rows) => claim.max_rows(max_rows),
                    None => claim,
                };
                let report = claim.each(self, |conn, order: Order| {
                    conn.process_row(order.id)?;
                    Ok::<_, diesel_claim::Error>(())
                })?;
                Ok(report.processed)
            }

            fn claim_from_head(&mut self, n: u32) -> Result<u64, diesel_claim::Error> {
                use diesel_claim::prelude::*;
                let report = pending!($db)
                    .build_claim()
                    .from_head()
                    .batch(n)
                    .each_batch(self, |conn, orders: Vec<Order>| {
                        match orders.as_slice() {
                            // One row: B2's statements.
                            [order] => conn.process_row(order.id)?,
                            orders => conn.process_batch(&ids_of(orders))?,
                        }
                        Ok::<_, diesel_claim::Error>(())
                    })?;
                Ok(report.processed)
            }

            fn claim_batches(&mut self, n: u32) -> Result<u64, diesel_claim::Error> {
                use diesel_claim::prelude::*;
                let report = pending!($db).build_claim().batch(n).each_batch(
                    self,
                    |conn, orders: Vec<Order>| {
                        conn.process_batch(&ids_of(&orders))?;
                        Ok::<_, diesel_claim::Error>(())
                    },
                )?;
                Ok(report.processed)
            }

            fn claim_batches_by_priority(&mut self, n: u32) -> Result<u64, diesel_claim::Error> {
                use diesel_claim::prelude::*;
                let report = pending!($db)
                    .order(schema::orders::priority.desc())
                    .build_claim()
                    .batch(n)
                    .each_batch(self, |conn, orders: Vec<Order>| {
                        conn.process_batch(&ids_of(&orders))?;
                        Ok::<_, diesel_claim::Error>(())
                    })?;
                Ok(report.processed)
            }

            fn claim_marked(
                &mut self,
                n: u32,
                commit_first: bool,
            ) -> Result<u64, diesel_claim::Error> {
                use diesel_claim::prelude::*;
                let claim = pending!($db).build_claim().batch(n);
                let done = schema::orders::shipped_email_sent.eq(true);
                let marked = if commit_first {
                    claim.mark_and_commit(done)
                } else {
                    claim.mark(done)
                };
                let report = marked.each_batch(self, |conn, orders: Vec<Order>| {
                    // The claim has marked the orders already.
                    conn.write_outbox(&ids_of(&orders))?;
                    Ok::<_, diesel_claim::Error>(())
                })?;
                Ok(report.processed)
            }

            fn diesel_alone(&mut self, n: u32) -> QueryResult<u64> {
                diesel_alone!($locks, $db, self, n)
            }

            fn add_one_optimistic(
                &mut self,
                account: i32,
                attempts: &mut u64,
            ) -> Result<(), diesel_claim::Error> {
                use diesel_claim::prelude::*;
                use schema::{accounts, Account};
                diesel_claim::retry(self, diesel_claim::RetryPolicy::default(), |conn| {
                    *attempts += 1;
                    let seen: Account = accounts::table
                        .find(account)
                        .select(Account::as_select())
                        .first(conn)?;
                    accounts::table
                        .find(account)
                        .update_versioned(
                            accounts::version,
                            seen.version,
                            accounts::balance.eq(seen.balance + 1),
                        )
                        .execute(conn)
                })
                .map(drop)
            }

            fn add_one_pessimistic(&mut self, account: i32) -> Result<(), diesel_claim::Error> {
                use diesel_claim::prelude::*;
                use schema::{accounts, Account};
                accounts::table
                    .find(account)
                    .select(Account::as_select())
                    .with_lock(self, |conn, seen: Account| {
                        diesel::update(accounts::table.find(seen.id))
                            .set(accounts::balance.eq(seen.balance + 1))
                            .execute(conn)?;
                        Ok::<_, diesel_claim::Error>(())
                    })
            }
        }
    };
}

/// The body of [`BenchConn::diesel_alone`]: Diesel's `.for_update()` exists
/// only where the backend has row locks.
macro_rules! diesel_alone {
    (row_locks, $db:ty, $conn:expr, $n:expr) => {
        $conn.transaction(|conn| {
            // The same query the crate modes claim from, in key order, as the
            // hand-written twins read it.
            let orders: Vec<Order> = pending!($db)
                .order(schema::orders::id)
                .limit(i64::from($n))
                .for_update()
                .skip_locked()
                .load(conn)?;
            match orders.as_slice() {
                [] => {}
                // One row: the same `UPDATE … WHERE id = ?` and `INSERT` as B0.
                [order] => conn.process_row(order.id)?,
                orders => conn.process_batch(&ids_of(orders))?,
            }
            Ok(orders.len() as u64)
        })
    };
    (no_row_locks, $db:ty, $conn:expr, $n:expr) => {{
        let _ = ($conn, $n);
        unreachable!("Diesel alone runs where there are row locks only")
    }};
}

/// The pending orders, as a user of the crate would write the query: the
/// filter matches the partial index's predicate (`NOT shipped_email_sent`
/// rather than `= false`, which would be a bind parameter the planner cannot
/// match against the index), selecting [`Order`]'s columns.
macro_rules! pending {
    ($db:ty) => {
        schema::orders::table
            .filter(schema::orders::shipped_at.is_not_null())
            .filter(diesel::dsl::not(schema::orders::shipped_email_sent))
            .select(<Order as SelectableHelper<$db>>::as_select())
    };
}

pub fn ids_of(orders: &[Order]) -> Vec<i64> {
    orders.iter().map(|order| order.id).collect()
}

impl_bench_conn!(
    PgConnection,
    diesel::pg::Pg,
    BackendKind::Postgres,
    PgConnection::establish,
    row_locks
);
impl_bench_conn!(
    diesel::SqliteConnection,
    diesel::sqlite::Sqlite,
    BackendKind::Sqlite,
    open_sqlite,
    no_row_locks
);
impl_bench_conn!(
    MysqlConnection,
    diesel::mysql::Mysql,
    BackendKind::Mysql,
    open_mysql,
    row_locks
);

/// An SQLite connection that waits for the write lock instead of failing.
fn open_sqlite(path: &str) -> ConnectionResult<diesel::SqliteConnection> {
    let mut conn = diesel::SqliteConnection::establish(path)?;
    conn.batch_execute("PRAGMA busy_timeout = 30000; PRAGMA journal_mode = WAL;")
        .map_err(|e| ConnectionError::BadConnection(e.to_string()))?;
    Ok(conn)
}

/// The isolation levels MySQL connections can run at (`--mysql-isolation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Isolation {
    /// What claimers on InnoDB should use, and the default here.
    #[value(alias = "rc")]
    ReadCommitted,
    /// InnoDB's default, for comparison.
    #[value(alias = "rr")]
    RepeatableRead,
}

impl Isolation {
    pub fn sql(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE READ",
        }
    }
}

/// The level every MySQL connection of this process runs at, set once from the
/// command line before the first one opens: a process-wide setting, because
/// [`BenchConn::open`] takes nothing but a URL.
static MYSQL_ISOLATION: OnceLock<Isolation> = OnceLock::new();

pub fn set_mysql_isolation(level: Isolation) {
    // Set once, before any connection: a second call changes nothing.
    let _ = MYSQL_ISOLATION.set(level);
}

pub fn mysql_isolation() -> Isolation {
    MYSQL_ISOLATION
        .get()
        .copied()
        .unwrap_or(Isolation::ReadCommitted)
}

/// A MySQL connection at [`mysql_isolation`], by default `READ COMMITTED`, as
/// claimers on InnoDB should run: under `REPEATABLE READ` a locking read keeps
/// the locks of every row it passed and of the gaps between them, so claimers
/// skip more than the rows others hold.
pub fn open_mysql(url: &str) -> ConnectionResult<MysqlConnection> {
    let mut conn = MysqlConnection::establish(url)?;
    conn.batch_execute(&mysql_session())
        .map_err(|e| ConnectionError::BadConnection(e.to_string()))?;
    Ok(conn)
}

/// What a MySQL connection of the benchmark is set up with: its isolation
/// level (`--mysql-isolation`).
pub fn mysql_session() -> String {
    let level = mysql_isolation().sql();
    format!("SET SESSION TRANSACTION ISOLATION LEVEL {level}")
}

/// Whether SQLite's drains run with the statistics `ANALYZE` gathers right
/// after a refill (`--sqlite-analyze`), set once from the command line.
static SQLITE_ANALYZE: OnceLock<bool> = OnceLock::new();

pub fn set_sqlite_analyze(analyze: bool) {
    let _ = SQLITE_ANALYZE.set(analyze);
}

pub fn sqlite_analyze() -> bool {
    SQLITE_ANALYZE.get().copied().unwrap_or(false)
}

/// Empties the tables, inserts `rows` pending orders and tidies up.
pub fn reset_orders<C: BenchConn>(conn: &mut C, rows: i64) -> QueryResult<()> {
    conn.batch_execute(&schema::refill_orders(C::BACKEND, rows))?;
    tidy_up(conn);
    if C::BACKEND == BackendKind::Sqlite && !sqlite_analyze() {
        // Statistics gathered now say that the partial index holds every row,
        // and SQLite then reads the crate's key ranges by rowid, past the rows
        // other workers have done, where the hand-written SQL names the index.
        // SQLite gathers no statistics unless asked, and without them it takes
        // the partial index.
        conn.batch_execute("DROP TABLE IF EXISTS sqlite_stat1")?;
    }
    Ok(())
}

/// The backend's housekeeping after the tables were rewritten, so that
/// every measurement starts alike.
pub fn tidy_up<C: BenchConn>(conn: &mut C) {
    for statement in C::BACKEND.maintenance() {
        // Best effort: these only make the modes start alike (CHECKPOINT, for
        // one, needs privileges the user may not have).
        if let Err(e) = conn.batch_execute(statement) {
            eprintln!("warning: `{statement}` failed: {e}");
        }
    }
}
