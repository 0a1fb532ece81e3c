//! PostgreSQL-only scenarios: isolation levels (3), killed connections (5),
//! lock interference (7), joined queries (8), timeouts (9), deadlocks (14) and
//! partitioned queues (22). SQLite has no row locks, sessions to kill, lock
//! waits that deadlock, or partitions.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::Integer;
use diesel::PgConnection;
use diesel_claim::prelude::*;
use diesel_claim::Error;

use super::claiming::on_postgres::{check_emails, database, email as email_by};
use super::claiming::pending;
use super::{counted_retry, in_threads, Ctx, Figures, Running, Scenario};
use crate::fixtures::{accounts, customers, orders, outbox, Account, Order};

pub fn scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            number: 3,
            name: "isolation-levels",
            run: isolation_levels,
        },
        Scenario {
            number: 5,
            name: "connection-killed",
            run: connection_killed,
        },
        Scenario {
            number: 7,
            name: "lock-interference",
            run: lock_interference,
        },
        Scenario {
            number: 8,
            name: "joined-queries",
            run: joined_queries,
        },
        Scenario {
            number: 9,
            name: "timeouts",
            run: timeouts,
        },
        Scenario {
            number: 14,
            name: "deadlock",
            run: deadlock,
        },
        Scenario {
            number: 22,
            name: "partitioned-drain",
            run: partitioned_drain,
        },
    ]
}

/// The shop's email, sent by worker 0.
fn email(conn: &mut PgConnection, order: &Order) -> Result<(), Error> {
    email_by(conn, order, 0)
}

fn connect(url: &str) -> PgConnection {
    PgConnection::establish(url).unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
}

fn backend_pid(conn: &mut PgConnection) -> i32 {
    diesel::select(diesel::dsl::sql::<Integer>("pg_backend_pid()"))
        .get_result(conn)
        .unwrap()
}

/// Terminates backend `pid` from another session (`admin`).
fn terminate(admin: &mut PgConnection, pid: i32) {
    diesel::sql_query(format!("SELECT pg_terminate_backend({pid})"))
        .execute(admin)
        .unwrap();
}

/// A transaction on a session of its own that holds what `sql` locked until
/// it is dropped.
struct Holder {
    release: Option<mpsc::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Holder {
    fn new(url: &str, sql: &str) -> Holder {
        let mut conn = connect(url);
        let sql = format!("BEGIN; {sql}");
        let (locked, is_locked) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let thread = thread::spawn(move || {
            conn.batch_execute(&sql).unwrap();
            locked.send(()).unwrap();
            let _ = released.recv();
            conn.batch_execute("COMMIT").unwrap();
        });
        is_locked.recv().expect("the holder failed to lock");
        Holder {
            release: Some(release),
            thread: Some(thread),
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        drop(self.release.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Scenario 3: the drain under each isolation level. Serialization failures
/// surface typed and `retry` recovers from them.
fn isolation_levels(ctx: &Ctx) -> Figures {
    let (threads, processes) = ctx.workers();
    let mut figures = Figures::new(threads, processes);
    let rows = ctx.rows() / 2;
    for level in ["read-committed", "repeatable-read", "serializable"] {
        let (_db, url, pool) = database(2, rows);
        let mut round = Figures::default();
        // With 32 SERIALIZABLE workers PostgreSQL can run out of room to track
        // conflicts (SQLSTATE 53200, `Error::Database`): counted, and carried on.
        let args = [
            ("url", url),
            ("isolation", level.to_owned()),
            ("persist", "1".to_owned()),
        ];
        for done in ctx.run_workers("drain", threads, processes, &args) {
            round.absorb(&done);
        }
        check_emails(&mut pool.get().unwrap(), &mut round, rows as u64);
        figures.note(format!("{level}: {} retries", round.retries));
        figures.merge(round);
    }
    figures
}

/// Scenario 5: claimers' connections are terminated (`pg_terminate_backend`)
/// while idle, inside a row's transaction, and at random under a drain. Each
/// kill is an error to the claimer, never an empty report; the killed row
/// stays pending; nothing is processed twice.
fn connection_killed(ctx: &Ctx) -> Figures {
    let rows = ctx.rows();
    let (_db, url, pool) = database(2, rows);
    let (threads, processes) = ctx.workers();
    let mut figures = Figures::new(threads, processes);
    let mut admin = connect(&url);
    for _ in 0..ctx.repeats() {
        // Killed while idle: the next claim must fail, not report nothing.
        let mut conn = connect(&url);
        terminate(&mut admin, backend_pid(&mut conn));
        let idle = pending().claim_each(&mut conn, |conn, order: Order| email(conn, &order));
        expect_failure(&mut figures, "idle kill", idle);

        // Killed inside a row's transaction, before the row's write.
        let mut conn = connect(&url);
        let pid = backend_pid(&mut conn);
        let mut killed_row = None;
        let in_row = pending()
            .build_claim()
            .max_rows(1)
            .each(&mut conn, |conn, order: Order| {
                killed_row = Some(order.id);
                terminate(&mut admin, pid);
                email(conn, &order)
            });
        expect_failure(&mut figures, "kill inside a row", in_row);
        let again = pending().claim_each(&mut conn, |conn, order: Order| email(conn, &order));
        expect_failure(&mut figures, "claim on the dead connection", again);
        let id = killed_row.expect("no row was claimed");
        let still_pending: i64 = pending().find(id).count().get_result(&mut admin).unwrap();
        figures.check(
            still_pending == 1,
            format!("row {id} killed mid-claim is not pending"),
        );
    }

    // Under a drain: kill a random claimer's session every 20 ms.
    let draining = Running::new();
    let kills = AtomicU64::new(0);
    thread::scope(|scope| {
        scope.spawn(|| {
            let mut killer = connect(&url);
            while draining.get() {
                let killed: Vec<bool> = diesel::sql_query(
                    "SELECT pg_terminate_backend(pid) AS killed FROM pg_stat_activity \
                     WHERE datname = current_database() AND application_name = 'torture-drain' \
                     ORDER BY random() LIMIT 1",
                )
                .load::<Killed>(&mut killer)
                .unwrap()
                .into_iter()
                .map(|row| row.killed)
                .collect();
                kills.fetch_add(killed.len() as u64, Relaxed);
                thread::sleep(Duration::from_millis(20));
            }
        });
        let _stop_killer = draining.stop_on_drop();
        let args = [
            ("url", url.clone()),
            ("pause_ms", "1".to_owned()),
            ("persist", "1".to_owned()),
        ];
        for done in ctx.run_workers("drain", threads, processes, &args) {
            figures.absorb(&done);
        }
    });
    figures.note(format!(
        "sessions killed under the drain: {}",
        kills.into_inner()
    ));
    check_emails(&mut pool.get().unwrap(), &mut figures, rows as u64);
    figures
}

#[derive(QueryableByName)]
struct Killed {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    killed: bool,
}

/// Records the error of a call that had to fail.
fn expect_failure<T: std::fmt::Debug>(figures: &mut Figures, case: &str, result: Result<T, Error>) {
    match result {
        Err(error) => figures.saw(&error),
        Ok(value) => figures.check(false, format!("{case}: Ok({value:?})")),
    }
}

/// Scenario 7: `FOR SHARE`, `FOR KEY SHARE` and an open `UPDATE` on candidate
/// rows never make the claim wait (a wait would hit `lock_timeout`); the rows
/// they conflict with are skipped, the others claimed. The claimed rows' emails
/// are inserted from another session: a foreign-key insert the claim's lock
/// must not block.
fn lock_interference(ctx: &Ctx) -> Figures {
    let rows = 40;
    let (_db, url, pool) = database(2, rows);
    let mut figures = Figures::new(4, 1);
    let mut conn = connect(&url);
    let mut fk_inserter = connect(&url);
    for session in [&mut conn, &mut fk_inserter] {
        session.batch_execute("SET lock_timeout = '1s'").unwrap();
    }
    let mut slowest = Duration::ZERO;
    for _ in 0..ctx.repeats() {
        let holders = [
            Holder::new(
                &url,
                "SELECT 1 FROM orders WHERE id BETWEEN 1 AND 10 FOR SHARE",
            ),
            Holder::new(
                &url,
                "SELECT 1 FROM orders WHERE id BETWEEN 11 AND 20 FOR KEY SHARE",
            ),
            Holder::new(
                &url,
                "UPDATE orders SET customer_id = NULL WHERE id BETWEEN 21 AND 30",
            ),
        ];
        let started = Instant::now();
        let claimed = pending().claim_each(&mut conn, |conn, order: Order| {
            diesel::insert_into(outbox::table)
                .values((outbox::order_id.eq(order.id), outbox::worker.eq(7)))
                .execute(&mut fk_inserter)?;
            diesel::update(&order)
                .set(orders::email_sent.eq(true))
                .execute(conn)?;
            Ok::<_, Error>(())
        });
        slowest = slowest.max(started.elapsed());
        match claimed {
            // Rows 11–20 (KEY SHARE does not conflict) and 31–40 the first
            // time; nothing new the next, as the held rows are still held.
            Ok(report) => {
                figures.ops += report.processed;
                figures.check(
                    report.skipped == 20,
                    format!("skipped {} rows, not the 20 held", report.skipped),
                );
            }
            Err(error) => figures.check(false, format!("the claim failed (blocked?): {error}")),
        }
        let nowait = pending()
            .build_claim()
            .nowait()
            .each(&mut conn, |_, _: Order| Ok::<_, Error>(()));
        expect_failure(&mut figures, "nowait on held rows", nowait);
        drop(holders);
    }
    let rest = pending()
        .claim_each(&mut conn, |conn, order: Order| email(conn, &order))
        .unwrap();
    figures.ops += rest.processed;
    figures.note(format!(
        "slowest claim among held rows: {slowest:.0?} (lock_timeout 1s)"
    ));
    check_emails(&mut pool.get().unwrap(), &mut figures, rows as u64);
    figures
}

/// Scenario 8: workers claim through a join with `customers` while an updater
/// keeps updating those customers with a short `lock_timeout`: the claim locks
/// only `orders`, so no update is ever blocked.
fn joined_queries(ctx: &Ctx) -> Figures {
    let rows = ctx.rows() / 2;
    let (_db, url, pool) = database(2, rows);
    let (threads, _) = ctx.workers();
    let mut figures = Figures::new(threads, 1);
    let mut conn = connect(&url);
    conn.batch_execute(
        "INSERT INTO customers (name, vip) SELECT 'customer ' || i, TRUE FROM generate_series(1, 10) i; \
         UPDATE orders SET customer_id = id % 10 + 1;",
    )
    .unwrap();
    let draining = Running::new();
    let (updates, blocked) = (AtomicU64::new(0), AtomicU64::new(0));
    thread::scope(|scope| {
        scope.spawn(|| {
            let mut updater = connect(&url);
            updater.batch_execute("SET lock_timeout = '500ms'").unwrap();
            for id in (1..=10).cycle() {
                if !draining.get() {
                    break;
                }
                let updated = diesel::update(customers::table.find(id))
                    .set(customers::name.eq(format!("customer {id}, updated")))
                    .execute(&mut updater);
                let counter = if updated.is_ok() { &updates } else { &blocked };
                counter.fetch_add(1, Relaxed);
            }
        });
        let _stop_updater = draining.stop_on_drop();
        figures.merge(in_threads(threads, |worker| {
            let mut conn = connect(&url);
            let mut figures = Figures::default();
            let claimed = pending()
                .inner_join(customers::table)
                .filter(customers::vip.eq(true))
                .select(Order::as_select())
                .build_claim()
                .drain()
                .each(&mut conn, |conn, order: Order| {
                    thread::sleep(Duration::from_millis(1));
                    email_by(conn, &order, worker as i32)
                });
            match claimed {
                Ok(report) => figures.ops += report.processed,
                Err(error) => figures.check(false, error),
            }
            figures
        }));
    });
    let blocked = blocked.into_inner();
    figures.check(
        blocked == 0,
        format!("{blocked} customer updates were blocked by the claim"),
    );
    figures.note(format!(
        "customer updates during the drain: {}",
        updates.into_inner()
    ));
    check_emails(&mut pool.get().unwrap(), &mut figures, rows as u64);
    figures
}

/// Scenario 9: `lock_timeout`, `statement_timeout` and
/// `idle_in_transaction_session_timeout` on real sessions each end the claim
/// with an error (no hang, no empty report), leave the row pending, and the
/// session (or the pool, for a session the server ended) is usable afterwards.
fn timeouts(ctx: &Ctx) -> Figures {
    let rows = 3 * ctx.repeats();
    let (_db, url, pool) = database(2, rows);
    let mut figures = Figures::new(2, 1);
    let mut conn = connect(&url);
    for round in 0..ctx.repeats() as i32 {
        let [lock_row, statement_row, idle_row] = [1, 2, 3].map(|n| 3 * round + n);
        let one = |id: i32| pending().filter(orders::id.eq(id));

        let holder = Holder::new(
            &url,
            &format!("SELECT 1 FROM orders WHERE id = {lock_row} FOR UPDATE"),
        );
        conn.batch_execute("SET lock_timeout = '200ms'").unwrap();
        let waited = one(lock_row)
            .build_claim()
            .wait()
            .each(&mut conn, |conn, order: Order| email(conn, &order));
        figures.check(
            matches!(waited, Err(Error::LockNotAvailable)),
            format!("lock_timeout: {waited:?}"),
        );
        expect_failure(&mut figures, "lock_timeout", waited);
        drop(holder);
        conn.batch_execute("SET lock_timeout = 0; SET statement_timeout = '200ms'")
            .unwrap();

        let slow = one(statement_row).claim_each(&mut conn, |conn, _: Order| {
            diesel::sql_query("SELECT pg_sleep(5)").execute(conn)?;
            Ok::<_, Error>(())
        });
        expect_failure(&mut figures, "statement_timeout", slow);
        conn.batch_execute("SET statement_timeout = 0").unwrap();
        // Reusable: the rows the timeouts left are claimed on the same session.
        let retried = pending()
            .filter(orders::id.eq_any([lock_row, statement_row]))
            .claim_each(&mut conn, |conn, order: Order| email(conn, &order));
        figures.check(
            matches!(retried, Ok(ref r) if r.processed == 2),
            format!("after the timeouts: {retried:?}"),
        );

        let mut pooled = pool.get().unwrap();
        pooled
            .batch_execute("SET idle_in_transaction_session_timeout = '200ms'")
            .unwrap();
        let idle = one(idle_row).claim_each(&mut *pooled, |conn, order: Order| {
            thread::sleep(Duration::from_millis(600));
            email(conn, &order)
        });
        expect_failure(&mut figures, "idle_in_transaction_session_timeout", idle);
        drop(pooled);
        // The server ended that session; the pool hands out a working one.
        let mut pooled = pool.get().unwrap();
        let retried =
            one(idle_row).claim_each(&mut *pooled, |conn, order: Order| email(conn, &order));
        figures.check(
            matches!(retried, Ok(ref r) if r.processed == 1),
            format!("after the idle timeout: {retried:?}"),
        );
        figures.ops += 3;
    }
    check_emails(&mut pool.get().unwrap(), &mut figures, rows as u64);
    figures
}

/// Scenario 14: clients lock two accounts in opposite orders, pausing between
/// the locks. PostgreSQL breaks the deadlocks (`deadlock_timeout` lowered to
/// 50 ms to keep the run short); they surface as `Error::Deadlock` and
/// `retry` completes every transfer; the total holds.
fn deadlock(ctx: &Ctx) -> Figures {
    let (threads, rounds) = ctx.scale.pick((2, 10), (8, 50));
    let (_db, url, pool) = database(2, 0);
    pool.get()
        .unwrap()
        .batch_execute("INSERT INTO accounts (id, balance) VALUES (1, 1000), (2, 1000)")
        .unwrap();
    let mut figures = Figures::new(threads, 1);
    figures.merge(in_threads(threads, |index| {
        let mut conn = connect(&url);
        conn.batch_execute("SET deadlock_timeout = '50ms'").unwrap();
        let (first, second) = if index % 2 == 0 { (1, 2) } else { (2, 1) };
        let mut figures = Figures::default();
        for _ in 0..rounds {
            let moved = counted_retry(&mut conn, &mut figures, |conn| {
                accounts::table
                    .find(first)
                    .with_lock(conn, |conn, _: Account| {
                        thread::sleep(Duration::from_millis(10));
                        accounts::table
                            .find(second)
                            .with_lock(conn, |conn, _: Account| {
                                diesel::update(accounts::table.find(first))
                                    .set(accounts::balance.eq(accounts::balance - 1))
                                    .execute(conn)?;
                                diesel::update(accounts::table.find(second))
                                    .set(accounts::balance.eq(accounts::balance + 1))
                                    .execute(conn)?;
                                Ok::<_, Error>(())
                            })
                    })
            });
            match moved {
                Ok(()) => figures.ops += 1,
                Err(error) => figures.check(false, error),
            }
        }
        figures
    }));
    let balances: Vec<i64> = accounts::table
        .select(accounts::balance)
        .load(&mut pool.get().unwrap())
        .unwrap();
    figures.check(
        balances.iter().sum::<i64>() == 2000,
        format!("balances {balances:?}"),
    );
    figures.check(
        figures.errors.contains_key("Deadlock"),
        "no deadlock happened: the scenario tested nothing",
    );
    figures.check(
        figures.ops == (threads * rounds) as u64,
        "transfers were lost",
    );
    figures
}

/// How scenario 22 partitions the orders.
#[derive(Clone, Copy, Debug)]
enum Partitioning {
    /// By the pending flag: sending the email moves the row to the other
    /// partition, under the feet of every worker that read it as a candidate.
    ByState,
    /// By the time the order was placed, in three months: rows stay put.
    ByTime,
}

impl Partitioning {
    /// Replaces the shop's `orders` (and the `outbox` referencing it) with a
    /// partitioned table of the same columns, and inserts `rows` pending
    /// orders. The partition key is in the primary key, as PostgreSQL requires.
    fn recreate_orders(self, conn: &mut PgConnection, rows: usize) {
        let (extra_column, key, partitions) = match self {
            Partitioning::ByState => (
                "",
                "id, email_sent",
                "PARTITION BY LIST (email_sent);
                 CREATE TABLE orders_unsent PARTITION OF orders FOR VALUES IN (FALSE);
                 CREATE TABLE orders_sent PARTITION OF orders FOR VALUES IN (TRUE);",
            ),
            Partitioning::ByTime => (
                "placed TIMESTAMP NOT NULL,",
                "id, placed",
                "PARTITION BY RANGE (placed);
                 CREATE TABLE orders_2026_01 PARTITION OF orders
                     FOR VALUES FROM (MINVALUE) TO ('2026-02-01');
                 CREATE TABLE orders_2026_02 PARTITION OF orders
                     FOR VALUES FROM ('2026-02-01') TO ('2026-03-01');
                 CREATE TABLE orders_2026_03 PARTITION OF orders
                     FOR VALUES FROM ('2026-03-01') TO (MAXVALUE);",
            ),
        };
        let placed = match self {
            Partitioning::ByState => "",
            // Three months in turn, so that every partition holds candidates.
            Partitioning::ByTime => {
                ", TIMESTAMP '2026-01-01' + (i % 3) * INTERVAL '1 month' + i * INTERVAL '1 second'"
            }
        };
        let placed_column = if placed.is_empty() { "" } else { ", placed" };
        conn.batch_execute(&format!(
            "DROP TABLE outbox, orders;
             CREATE TABLE orders (
                 id SERIAL,
                 customer_id INTEGER REFERENCES customers (id),
                 shipped BOOLEAN NOT NULL DEFAULT TRUE,
                 email_sent BOOLEAN NOT NULL DEFAULT FALSE,
                 {extra_column}
                 PRIMARY KEY ({key})
             ) {partitions}
             CREATE INDEX orders_pending ON orders (email_sent, shipped, id);
             CREATE TABLE outbox (id SERIAL PRIMARY KEY, order_id INTEGER NOT NULL,
                 worker INTEGER NOT NULL);
             INSERT INTO orders (shipped{placed_column})
                 SELECT TRUE{placed} FROM generate_series(1, {rows}) AS i;"
        ))
        .unwrap_or_else(|e| panic!("cannot partition the orders {self:?}: {e}"));
    }
}

/// Scenario 22: the drain on partitioned orders, per row and in batches. When
/// partitioned by state, each email moves its row to the other partition, and
/// a worker locking a row another worker just moved must pass it over as gone:
/// every call returns `Ok` on its first attempt, and the reports add up.
fn partitioned_drain(ctx: &Ctx) -> Figures {
    let rows = ctx.rows();
    let (threads, processes) = ctx.workers();
    let mut figures = Figures::new(threads, processes);
    for partitioning in [Partitioning::ByState, Partitioning::ByTime] {
        for batch in [1, 50] {
            let (_db, url, pool) = database(2, 0);
            partitioning.recreate_orders(&mut pool.get().unwrap(), rows);
            let started = Instant::now();
            let mut round = Figures::default();
            let args = [("url", url), ("batch", batch.to_string())];
            for done in ctx.run_workers("drain", threads, processes, &args) {
                round.absorb(&done);
            }
            round.check(
                round.retries == 0 && round.errors.is_empty(),
                format!(
                    "{partitioning:?}, batch {batch}: calls failed ({} retried, errors {:?})",
                    round.retries, round.errors
                ),
            );
            check_emails(&mut pool.get().unwrap(), &mut round, rows as u64);
            figures.note(format!(
                "{partitioning:?}, batch {batch}: {:.1?}",
                started.elapsed()
            ));
            figures.merge(round);
        }
    }
    figures
}
