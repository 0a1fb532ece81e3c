//! Scenarios of the backends with row locks, PostgreSQL and MariaDB:
//! isolation levels (3), killed connections (5), lock interference (7),
//! joined queries (8), timeouts (9) and deadlocks (14). SQLite has no row
//! locks, sessions to kill, or lock waits that deadlock.
//!
//! Where the servers differ, each scenario says how: the SQL that kills a
//! session or sets a timeout, the lock modes there are, and what a locking
//! read through a join holds.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::BigInt;
use diesel_claim::prelude::*;
use diesel_claim::Error;

use super::claiming::pending;
use super::procs::time_until;
use super::{counted_retry, in_threads, Connect, Ctx, Figures, Running};
use crate::fixtures::{accounts, customers, orders, outbox, Account, Order};

/// A random session of the drain's workers killed, or none.
#[derive(QueryableByName)]
struct Session {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

on_row_lock_backends! {
    /// The shop's email, sent by worker 0.
    fn email(conn: &mut Conn, order: &Order) -> Result<(), Error> {
        email_by(conn, order, 0)
    }

    fn connect(url: &str) -> Conn {
        Conn::connect(url)
    }

    /// A connection to claim on: on MariaDB in read committed, as the guide
    /// recommends.
    fn claimer(url: &str) -> Conn {
        let mut conn = connect(url);
        if BACKEND == "mysql" {
            conn.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED").unwrap();
        }
        conn
    }

    /// The server's id of `conn`'s session.
    fn session_id(conn: &mut Conn) -> i64 {
        let id = match BACKEND {
            "pg" => "CAST(pg_backend_pid() AS BIGINT)",
            _ => "CAST(CONNECTION_ID() AS SIGNED)",
        };
        diesel::select(diesel::dsl::sql::<BigInt>(id)).get_result(conn).unwrap()
    }

    /// Ends session `id` from another session (`admin`): `pg_terminate_backend`,
    /// or MariaDB's `KILL CONNECTION`, waiting until the session is gone (MariaDB
    /// kills it asynchronously).
    fn terminate(admin: &mut Conn, id: i64) {
        if BACKEND == "pg" {
            diesel::sql_query(format!("SELECT pg_terminate_backend({id})")).execute(admin).unwrap();
            return;
        }
        // The session may have ended on its own meanwhile: "Unknown thread id".
        let _ = diesel::sql_query(format!("KILL CONNECTION {id}")).execute(admin);
        let gone = time_until(Duration::from_secs(10), || {
            diesel::sql_query(format!("SELECT ID AS id FROM information_schema.PROCESSLIST WHERE ID = {id}"))
                .load::<super::Session>(admin)
                .unwrap()
                .is_empty()
        });
        assert!(gone.is_some(), "session {id} still there 10 s after KILL");
    }

    /// Kills one of the drain's sessions at random; returns how many it killed
    /// (none when no worker is connected).
    fn kill_a_drain_session(killer: &mut Conn) -> u64 {
        let sessions = match BACKEND {
            "pg" => "SELECT CAST(pid AS BIGINT) AS id FROM pg_stat_activity \
                     WHERE datname = current_database() AND application_name = 'torture-drain' \
                     ORDER BY random() LIMIT 1",
            // MariaDB sessions have no name: any other session of the scenario's
            // database (the pool's idle connections too, which r2d2 replaces).
            _ => "SELECT CAST(ID AS SIGNED) AS id FROM information_schema.PROCESSLIST \
                  WHERE DB = DATABASE() AND ID <> CONNECTION_ID() ORDER BY RAND() LIMIT 1",
        };
        let found = diesel::sql_query(sessions).load::<super::Session>(killer).unwrap();
        for session in &found {
            let kill = match BACKEND {
                "pg" => format!("SELECT pg_terminate_backend({})", session.id),
                _ => format!("KILL CONNECTION {}", session.id),
            };
            // It may have ended on its own meanwhile.
            let _ = diesel::sql_query(kill).execute(killer);
        }
        found.len() as u64
    }

    /// SQL making a session give up waiting for a row lock after `seconds`
    /// (whole seconds: MariaDB's `innodb_lock_wait_timeout` takes no less).
    fn lock_wait_timeout(seconds: u32) -> String {
        match BACKEND {
            "pg" => format!("SET lock_timeout = '{seconds}s'"),
            _ => format!("SET SESSION innodb_lock_wait_timeout = {seconds}"),
        }
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
            // Read committed on MariaDB too: under repeatable read its range
            // locks would also lock the gap to the next row.
            let sql = match BACKEND {
                "mysql" => format!("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; BEGIN; {sql}"),
                _ => format!("BEGIN; {sql}"),
            };
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
    /// (PostgreSQL) and deadlocks (MariaDB) surface typed and `retry` recovers
    /// from them.
    pub fn isolation_levels(ctx: &Ctx) -> Figures {
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

    /// Scenario 5: claimers' connections are terminated (`pg_terminate_backend`,
    /// MariaDB's `KILL CONNECTION`) while idle, inside a row's transaction, and at
    /// random under a drain. Each kill is an error to the claimer, never an empty
    /// report; the killed row stays pending; nothing is processed twice.
    pub fn connection_killed(ctx: &Ctx) -> Figures {
        let rows = ctx.rows();
        let (_db, url, pool) = database(2, rows);
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        let mut admin = connect(&url);
        for _ in 0..ctx.repeats() {
            // Killed while idle: the next claim must fail, not report nothing.
            let mut conn = connect(&url);
            terminate(&mut admin, session_id(&mut conn));
            let idle = pending().claim_each(&mut conn, |conn, order: Order| email(conn, &order));
            expect_failure(&mut figures, "idle kill", idle);

            // Killed inside a row's transaction, before the row's write.
            let mut conn = connect(&url);
            let pid = session_id(&mut conn);
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
                    kills.fetch_add(kill_a_drain_session(&mut killer), Relaxed);
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

    /// Records the error of a call that had to fail.
    fn expect_failure<T: std::fmt::Debug>(figures: &mut Figures, case: &str, result: Result<T, Error>) {
        match result {
            Err(error) => figures.saw(&error),
            Ok(value) => figures.check(false, format!("{case}: Ok({value:?})")),
        }
    }

    /// Scenario 7: `FOR SHARE`, `FOR KEY SHARE` and an open `UPDATE` on candidate
    /// rows never make the claim wait (a wait would hit the lock timeout); the
    /// rows they conflict with are skipped, the others claimed. On PostgreSQL the
    /// claimed rows' emails are inserted from another session: a foreign-key
    /// insert the claim's lock must not block. MariaDB has `LOCK IN SHARE MODE`
    /// and no key-share lock (its rows 11–20 are not held), and a foreign-key
    /// insert there waits for the claim's commit (as the guide says), so the
    /// emails go through the claim's own connection.
    pub fn lock_interference(ctx: &Ctx) -> Figures {
        let rows = 40;
        let (_db, url, pool) = database(2, rows);
        let mut figures = Figures::new(4, 1);
        let mut conn = claimer(&url);
        let mut fk_inserter = connect(&url);
        for session in [&mut conn, &mut fk_inserter] {
            session.batch_execute(&lock_wait_timeout(1)).unwrap();
        }
        let held = match BACKEND {
            "pg" => [
                "SELECT 1 FROM orders WHERE id BETWEEN 1 AND 10 FOR SHARE",
                "SELECT 1 FROM orders WHERE id BETWEEN 11 AND 20 FOR KEY SHARE",
                "UPDATE orders SET customer_id = NULL WHERE id BETWEEN 21 AND 30",
            ]
            .as_slice(),
            _ => [
                "SELECT 1 FROM orders WHERE id BETWEEN 1 AND 10 LOCK IN SHARE MODE",
                "UPDATE orders SET customer_id = NULL WHERE id BETWEEN 21 AND 30",
            ]
            .as_slice(),
        };
        let mut slowest = Duration::ZERO;
        for _ in 0..ctx.repeats() {
            let holders: Vec<Holder> = held.iter().map(|sql| Holder::new(&url, sql)).collect();
            let started = Instant::now();
            let claimed = pending().claim_each(&mut conn, |conn, order: Order| {
                let email = diesel::insert_into(outbox::table)
                    .values((outbox::order_id.eq(order.id), outbox::worker.eq(7)));
                if BACKEND == "pg" {
                    email.execute(&mut fk_inserter)?;
                } else {
                    email.execute(conn)?;
                }
                diesel::update(&order)
                    .set(orders::email_sent.eq(true))
                    .execute(conn)?;
                Ok::<_, Error>(())
            });
            slowest = slowest.max(started.elapsed());
            match claimed {
                // Rows 11–20 (KEY SHARE does not conflict; MariaDB: not held)
                // and 31–40 the first time; nothing new the next, as the held
                // rows are still held.
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
            "slowest claim among held rows: {slowest:.0?} (lock timeout 1s)"
        ));
        check_emails(&mut pool.get().unwrap(), &mut figures, rows as u64);
        figures
    }

    /// Scenario 8: workers claim through a join with `customers` while an updater
    /// keeps updating those customers with a short lock timeout. On PostgreSQL
    /// the claim locks only `orders`, so no update is ever blocked. MariaDB's
    /// locking read locks the joined customer too (it has no `OF`, as the guide
    /// says): there updates wait for claims, claims pass over orders whose
    /// customer the updater holds, and claims the server picks as deadlock
    /// victims are retried; every row is still emailed once.
    pub fn joined_queries(ctx: &Ctx) -> Figures {
        let rows = ctx.rows() / 2;
        let (_db, url, pool) = database(2, rows);
        let (threads, _) = ctx.workers();
        let mut figures = Figures::new(threads, 1);
        let mut conn = connect(&url);
        let customers: Vec<String> = (1..=10).map(|i| format!("('customer {i}', TRUE)")).collect();
        conn.batch_execute(&format!(
            "INSERT INTO customers (name, vip) VALUES {}; UPDATE orders SET customer_id = id % 10 + 1;",
            customers.join(", ")
        ))
        .unwrap();
        let draining = Running::new();
        let (updates, blocked) = (AtomicU64::new(0), AtomicU64::new(0));
        thread::scope(|scope| {
            scope.spawn(|| {
                let mut updater = connect(&url);
                updater.batch_execute(&lock_wait_timeout(1)).unwrap();
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
                let mut conn = claimer(&url);
                let mut figures = Figures::default();
                // Claims deadlock on MariaDB (the guide says why): retried.
                let mut committed = 0;
                let claimed = counted_retry(&mut conn, &mut figures, |conn| {
                    let outcome = pending()
                        .inner_join(customers::table)
                        .filter(customers::vip.eq(true))
                        .select(Order::as_select())
                        .build_claim()
                        .drain()
                        .each_outcome(conn, |conn, order: Order| {
                            thread::sleep(Duration::from_millis(1));
                            email_by(conn, &order, worker as i32)
                        });
                    committed += outcome.report.processed;
                    outcome.into_result()
                });
                figures.ops += committed;
                if let Err(error) = claimed {
                    figures.check(false, error);
                }
                figures
            }));
        });
        let blocked = blocked.into_inner();
        if BACKEND == "pg" {
            figures.check(
                blocked == 0,
                format!("{blocked} customer updates were blocked by the claim"),
            );
        } else {
            figures.note(format!("customer updates that waited 1 s for a claim and gave up: {blocked}"));
        }
        figures.note(format!(
            "customer updates during the drain: {}",
            updates.into_inner()
        ));
        check_emails(&mut pool.get().unwrap(), &mut figures, rows as u64);
        figures
    }

    /// Scenario 9: a lock wait timeout, a statement timeout and an idle-in-
    /// transaction timeout on real sessions each end the claim with an error (no
    /// hang, no empty report), leave the row pending, and the session (or the
    /// pool, for a session the server ended) is usable afterwards. PostgreSQL:
    /// `lock_timeout`, `statement_timeout`, `idle_in_transaction_session_timeout`;
    /// MariaDB: `innodb_lock_wait_timeout`, `max_statement_time`,
    /// `idle_transaction_timeout` (whole seconds, so its run is slower).
    pub fn timeouts(ctx: &Ctx) -> Figures {
        let rows = 3 * ctx.repeats();
        let (_db, url, pool) = database(2, rows);
        let mut figures = Figures::new(2, 1);
        let mut conn = claimer(&url);
        let (statement_timeout, no_timeouts, sleep, idle_timeout, idle) = match BACKEND {
            "pg" => (
                "SET lock_timeout = 0; SET statement_timeout = '200ms'",
                "SET statement_timeout = 0",
                "SELECT pg_sleep(5)",
                "SET idle_in_transaction_session_timeout = '200ms'",
                Duration::from_millis(600),
            ),
            _ => (
                "SET SESSION innodb_lock_wait_timeout = 50; SET SESSION max_statement_time = 0.2",
                "SET SESSION max_statement_time = 0",
                "SELECT SLEEP(5)",
                "SET SESSION idle_transaction_timeout = 1",
                Duration::from_millis(1500),
            ),
        };
        for round in 0..ctx.repeats() as i32 {
            let [lock_row, statement_row, idle_row] = [1, 2, 3].map(|n| 3 * round + n);
            let one = |id: i32| pending().filter(orders::id.eq(id));

            let holder = Holder::new(
                &url,
                &format!("SELECT 1 FROM orders WHERE id = {lock_row} FOR UPDATE"),
            );
            conn.batch_execute(&lock_wait_timeout(1)).unwrap();
            let waited = one(lock_row)
                .build_claim()
                .wait()
                .each(&mut conn, |conn, order: Order| email(conn, &order));
            figures.check(
                matches!(waited, Err(Error::LockNotAvailable)),
                format!("lock wait timeout: {waited:?}"),
            );
            expect_failure(&mut figures, "lock wait timeout", waited);
            drop(holder);
            conn.batch_execute(statement_timeout).unwrap();

            let slow = one(statement_row).claim_each(&mut conn, |conn, _: Order| {
                diesel::sql_query(sleep).execute(conn)?;
                Ok::<_, Error>(())
            });
            expect_failure(&mut figures, "statement timeout", slow);
            conn.batch_execute(no_timeouts).unwrap();
            // Reusable: the rows the timeouts left are claimed on the same session.
            let retried = pending()
                .filter(orders::id.eq_any([lock_row, statement_row]))
                .claim_each(&mut conn, |conn, order: Order| email(conn, &order));
            figures.check(
                matches!(retried, Ok(ref r) if r.processed == 2),
                format!("after the timeouts: {retried:?}"),
            );

            let mut pooled = pool.get().unwrap();
            pooled.batch_execute(idle_timeout).unwrap();
            let idled = one(idle_row).claim_each(&mut *pooled, |conn, order: Order| {
                thread::sleep(idle);
                email(conn, &order)
            });
            expect_failure(&mut figures, "idle-in-transaction timeout", idled);
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
    /// the locks. The server breaks the deadlocks (PostgreSQL's `deadlock_timeout`
    /// lowered to 50 ms to keep the run short; InnoDB finds them at once); they
    /// surface as `Error::Deadlock` and `retry` completes every transfer; the
    /// total holds.
    pub fn deadlock(ctx: &Ctx) -> Figures {
        let (threads, rounds) = ctx.scale.pick((2, 10), (8, 50));
        let (_db, url, pool) = database(2, 0);
        pool.get()
            .unwrap()
            .batch_execute("INSERT INTO accounts (id, balance) VALUES (1, 1000), (2, 1000)")
            .unwrap();
        let mut figures = Figures::new(threads, 1);
        figures.merge(in_threads(threads, |index| {
            let mut conn = connect(&url);
            if BACKEND == "pg" {
                conn.batch_execute("SET deadlock_timeout = '50ms'").unwrap();
            }
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
}
