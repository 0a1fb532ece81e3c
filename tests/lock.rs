//! Pessimistic locking: `with_lock` (scenarios 10, 13, 14, the lock parts of 6
//! and 9, and the conflicting-options bad input).

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::{Connection, SimpleConnection, TransactionManager};
use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{Error, OnLocked};

use testkit::fixtures::{accounts, on_every_backend, run_bank, Account, BankError};

/// How deep the connection's transaction nesting is (0: none open).
fn transaction_depth<C: Connection>(conn: &mut C) -> u32 {
    C::TransactionManager::transaction_manager_status_mut(conn)
        .transaction_depth()
        .expect("transaction manager in error state")
        .map_or(0, |depth| depth.get())
}

on_every_backend! {

    fn balances(conn: &mut Conn) -> Vec<i64> {
        accounts::table.order(accounts::id).select(accounts::balance).load(conn).unwrap()
    }

    /// Moves `amount` under the locks of both accounts, taken lower id first
    /// (the inner `with_lock` is a savepoint of the outer's transaction). The
    /// balances are written back from what was read: only the locks make that
    /// safe.
    fn locked_transfer(conn: &mut Conn, from: i32, to: i32, amount: i64) -> Result<(), BankError> {
        let (low, high) = (from.min(to), from.max(to));
        accounts::table.find(low).with_lock(conn, |conn, low_account: Account| {
            accounts::table.find(high).with_lock(conn, |conn, high_account: Account| {
                let (source, target) = if from == low {
                    (low_account, high_account)
                } else {
                    (high_account, low_account)
                };
                if source.balance < amount {
                    return Err(BankError::Insufficient);
                }
                diesel::update(accounts::table.find(from))
                    .set(accounts::balance.eq(source.balance - amount))
                    .execute(conn)?;
                diesel::update(accounts::table.find(to))
                    .set(accounts::balance.eq(target.balance + amount))
                    .execute(conn)?;
                Ok(())
            })
        })
    }

    /// Scenario 10. Without the locks, two transfers touching one account would
    /// both write back the balance they read and one update would be lost:
    /// the final total would differ from 10,000. Without the transaction,
    /// the readers would catch a debit without its credit.
    #[test]
    fn pessimistic_bank_conserves_money() {
        const THREADS: usize = 8;
        let per_thread = if ROW_LOCKS { 500 } else { 100 };
        let (_db, pool) = test_db(THREADS as u32 + 2);
        seed_accounts(&mut pool.get().unwrap(), &[1_000; 10]);
        let total = 10_000i64;

        let figures = run_bank(&pool, 10, total, THREADS, per_thread, consistent_balances, |conn, from, to, amount| {
            let outcome = locked_transfer(conn, from, to, amount);
            assert_eq!(transaction_depth(conn), 0);
            (outcome, 0)
        });
        eprintln!(
            "pessimistic bank: {} transfers, {} refused, {} full reads, {:?}",
            figures.transfers, figures.refused, figures.reads, figures.elapsed
        );
    }

    /// Scenario 13. Each withdrawal reads the balance, pauses, and writes back
    /// the balance minus 30. Without the lock all 8 would read 100 and succeed,
    /// leaving 70; with it exactly 3 succeed and 5 are refused.
    #[test]
    fn overdraw_race_lets_exactly_three_of_eight_withdrawals_through() {
        const THREADS: usize = 8;
        let (_db, pool) = test_db(THREADS as u32);
        seed_accounts(&mut pool.get().unwrap(), &[100]);

        let start = Barrier::new(THREADS);
        let outcomes: Vec<Result<i64, BankError>> = thread::scope(|scope| {
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    scope.spawn(|| {
                        let mut pooled = pool.get().unwrap();
                        let conn: &mut Conn = &mut pooled;
                        start.wait();
                        accounts::table.find(1).with_lock(conn, |conn, account: Account| {
                            if account.balance < 30 {
                                return Err(BankError::Insufficient);
                            }
                            thread::sleep(Duration::from_millis(5));
                            let left = account.balance - 30;
                            diesel::update(accounts::table.find(1)).set(accounts::balance.eq(left)).execute(conn)?;
                            Ok(left)
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });

        let mut left: Vec<i64> = outcomes.iter().filter_map(|o| o.as_ref().ok().copied()).collect();
        left.sort();
        let refused = outcomes.iter().filter(|o| matches!(o, Err(BankError::Insufficient))).count();
        assert_eq!(left, vec![10, 40, 70], "{outcomes:?}");
        assert_eq!(refused, 5, "{outcomes:?}");
        assert_eq!(balances(&mut pool.get().unwrap()), vec![10]);
    }

    /// A loaded model locks its row and gets it back fresh: eight threads
    /// holding the same stale copy each add 10 through `model.with_lock`,
    /// and none of the additions is lost. (With the stale copy's balance
    /// instead of the fresh one's, the total would end at 110.)
    #[test]
    fn a_loaded_model_is_locked_and_read_again() {
        const THREADS: usize = 8;
        let (_db, pool) = test_db(THREADS as u32 + 1);
        let mut pooled = pool.get().unwrap();
        seed_accounts(&mut pooled, &[100]);
        let stale: Account = accounts::table.find(1).select(Account::as_select()).first(&mut pooled).unwrap();
        let start = Barrier::new(THREADS);
        thread::scope(|scope| {
            for _ in 0..THREADS {
                scope.spawn(|| {
                    let mut pooled = pool.get().unwrap();
                    let conn: &mut Conn = &mut pooled;
                    start.wait();
                    stale
                        .with_lock(conn, |conn, fresh: Account| {
                            thread::sleep(Duration::from_millis(2));
                            diesel::update(&fresh).set(accounts::balance.eq(fresh.balance + 10)).execute(conn)?;
                            Ok::<_, Error>(())
                        })
                        .unwrap();
                });
            }
        });
        assert_eq!(balances(&mut pooled), vec![180]);

        // A row deleted since it was loaded is not found; the closure never runs.
        diesel::delete(accounts::table.find(1)).execute(&mut pooled).unwrap();
        let gone = stale.with_lock(&mut pooled, |_, _: Account| -> Result<(), Error> { unreachable!() });
        assert!(matches!(gone, Err(Error::NotFound)), "{gone:?}");
    }

    /// A boxed query is locked through `rebuild`, `nowait` included (which
    /// reads the rows twice).
    #[test]
    fn boxed_queries_are_locked_through_rebuild() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100, 200]);
        let wanted = std::hint::black_box(2);
        let balance = diesel_claim::rebuild(|| accounts::table.into_boxed().filter(accounts::id.eq(wanted)))
            .build_lock()
            .nowait()
            .run(conn, |_, account: Account| Ok::<_, Error>(account.balance))
            .unwrap();
        assert_eq!(balance, 200);
    }

    #[test]
    fn missing_row_is_not_found_and_many_rows_are_refused() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100, 200]);

        let mut ran = false;
        let missing = accounts::table.find(42).with_lock(conn, |_, _: Account| {
            ran = true;
            Ok::<_, Error>(())
        });
        assert!(matches!(missing, Err(Error::NotFound)), "{missing:?}");
        assert!(!ran);

        // Two rows: refused before the closure runs, nothing committed.
        let many = accounts::table.filter(accounts::balance.gt(0)).with_lock(conn, |conn, _: Account| {
            ran = true;
            diesel::update(accounts::table).set(accounts::balance.eq(0)).execute(conn)?;
            Ok::<_, Error>(())
        });
        assert!(matches!(&many, Err(Error::UnexpectedOutcome(m)) if m.contains('2')), "{many:?}");
        assert!(!ran);
        assert_eq!(transaction_depth(conn), 0);
        assert_eq!(balances(conn), vec![100, 200]);

        // The connection is fine afterwards.
        let balance = accounts::table.find(2).with_lock(conn, |_, a: Account| Ok::<_, Error>(a.balance)).unwrap();
        assert_eq!(balance, 200);
    }

    /// `with_locks` hands over every selected row, locked, in the query's order;
    /// no row is an empty `Vec`, not an error.
    #[test]
    fn with_locks_passes_every_row() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100, 50]);

        accounts::table
            .order(accounts::id)
            .with_locks(conn, |conn, accounts: Vec<Account>| {
                let [from, to] = &accounts[..] else {
                    panic!("expected two accounts, got {accounts:?}");
                };
                diesel::update(from).set(accounts::balance.eq(from.balance - 30)).execute(conn)?;
                diesel::update(to).set(accounts::balance.eq(to.balance + 30)).execute(conn)?;
                Ok::<_, Error>(())
            })
            .unwrap();
        let balances: Vec<i64> = accounts::table.order(accounts::id).select(accounts::balance).load(conn).unwrap();
        assert_eq!(balances, [70, 80]);

        let none = accounts::table
            .filter(accounts::id.gt(10))
            .with_locks(conn, |_, rows: Vec<Account>| Ok::<_, Error>(rows.len()))
            .unwrap();
        assert_eq!(none, 0);
        assert_eq!(transaction_depth(conn), 0);
    }

    /// Conflicting wait policies are refused before any SQL: on a missing row
    /// any SQL would have said NotFound.
    #[test]
    fn conflicting_lock_policies_are_refused_before_sql() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100]);

        let builders = [
            accounts::table.find(42).build_lock().nowait().wait(),
            accounts::table.find(42).build_lock().on_locked(OnLocked::Skip).nowait(),
            accounts::table.find(42).build_lock().wait().on_locked(OnLocked::Skip),
        ];
        for builder in builders {
            let mut ran = false;
            let result = builder.run(conn, |_, _: Account| {
                ran = true;
                Ok::<_, Error>(())
            });
            assert!(matches!(&result, Err(Error::InvalidArgument(m)) if m.contains("conflicting")), "{result:?}");
            assert!(!ran);
        }
        assert_eq!(transaction_depth(conn), 0);

        // The same policy twice is no conflict.
        let balance = accounts::table
            .find(1)
            .build_lock()
            .nowait()
            .nowait()
            .run(conn, |_, a: Account| Ok::<_, Error>(a.balance))
            .unwrap();
        assert_eq!(balance, 100);
    }

    /// Inside the caller's transaction `with_lock` is a savepoint: its failure
    /// rolls back its own writes only, and the caller's transaction goes on.
    #[test]
    fn inside_a_transaction_with_lock_is_a_savepoint() {
        let (_db, pool) = test_db(2);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100, 200]);

        conn.transaction::<_, Error, _>(|conn| {
            diesel::update(accounts::table.find(2)).set(accounts::balance.eq(201)).execute(conn)?;
            let refused = accounts::table.find(1).with_lock(conn, |conn, _: Account| {
                diesel::update(accounts::table.find(1)).set(accounts::balance.eq(0)).execute(conn)?;
                Err::<(), _>(BankError::Insufficient)
            });
            assert!(matches!(refused, Err(BankError::Insufficient)), "{refused:?}");
            assert_eq!(transaction_depth(conn), 1);
            accounts::table.find(1).with_lock(conn, |conn, account: Account| {
                assert_eq!(account.balance, 100, "the failed savepoint's write is visible");
                diesel::update(accounts::table.find(1)).set(accounts::balance.eq(101)).execute(conn)?;
                Ok::<_, Error>(())
            })?;
            Ok(())
        })
        .unwrap();
        assert_eq!(transaction_depth(conn), 0);
        assert_eq!(balances(&mut pool.get().unwrap()), vec![101, 201]);
    }

    /// A panic in the closure propagates, rolls back the closure's writes and
    /// releases the lock; the connection is left outside any transaction.
    #[test]
    fn panic_in_with_lock_rolls_back_and_leaves_the_connection_usable() {
        let (_db, pool) = test_db(2);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100]);

        let caught = panic::catch_unwind(AssertUnwindSafe(|| {
            accounts::table.find(1).with_lock(&mut *conn, |conn, _: Account| -> Result<(), Error> {
                diesel::update(accounts::table.find(1)).set(accounts::balance.eq(0)).execute(conn)?;
                panic!("boom inside with_lock");
            })
        }));
        let payload = caught.expect_err("the panic did not propagate");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"boom inside with_lock"));

        assert_eq!(transaction_depth(conn), 0);
        assert_eq!(balances(conn), vec![100]);

        // The lock is gone: another connection gets it without waiting long.
        let mut other = pool.get().unwrap();
        let other: &mut Conn = &mut other;
        other
            .batch_execute(SHORT_LOCK_WAIT)
            .unwrap();
        assert_eq!(balances(other), vec![100]);
        accounts::table
            .find(1)
            .with_lock(other, |_, a: Account| Ok::<_, Error>(a.balance))
            .expect("the panicked with_lock still holds its lock");

        // The same connection locks and commits again, visibly to others.
        accounts::table
            .find(1)
            .with_lock(conn, |conn, account: Account| {
                diesel::update(accounts::table.find(1)).set(accounts::balance.eq(account.balance + 5)).execute(conn)?;
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!(transaction_depth(conn), 0);
        assert_eq!(balances(other), vec![105]);
    }
}

/// SQLite has no row locks: `with_lock` takes the database write lock
/// (`BEGIN IMMEDIATE`), so a `with_lock` on another row waits too.
#[cfg(feature = "sqlite")]
mod sqlite_only {
    use super::*;

    /// `nowait` on SQLite fails at once when another connection holds the
    /// write lock, as it does on a row-locked database, instead of waiting
    /// out `busy_timeout` (30 s on the test pool); the connection keeps its
    /// busy timeout; and once the lock is free, `nowait` goes through.
    #[test]
    fn nowait_does_not_wait_for_the_write_lock() {
        #[derive(QueryableByName)]
        struct BusyTimeout {
            #[diesel(sql_type = diesel::sql_types::Integer)]
            timeout: i32,
        }

        let db = testkit::SqliteTestDb::new();
        let pool = testkit::sqlite_pool(&db.url, 2);
        testkit::fixtures::create_schema(
            &mut pool.get().unwrap(),
            testkit::fixtures::SQLITE_SCHEMA,
        );
        diesel::insert_into(accounts::table)
            .values((accounts::id.eq(1), accounts::balance.eq(100i64)))
            .execute(&mut pool.get().unwrap())
            .unwrap();
        let mut holder = pool.get().unwrap();
        let mut conn = pool.get().unwrap();
        holder.batch_execute("BEGIN IMMEDIATE").unwrap();

        let asked = Instant::now();
        let locked = accounts::table
            .find(1)
            .build_lock()
            .nowait()
            .run(&mut *conn, |_, _: Account| Ok::<_, Error>(()));
        assert!(matches!(locked, Err(Error::LockNotAvailable)), "{locked:?}");
        let claimed = accounts::table
            .filter(accounts::balance.gt(0))
            .build_claim()
            .nowait()
            .each(&mut *conn, |_, _: Account| Ok::<_, Error>(()));
        assert!(
            matches!(claimed, Err(Error::LockNotAvailable)),
            "{claimed:?}"
        );
        assert!(
            asked.elapsed() < Duration::from_secs(5),
            "waited {:?}",
            asked.elapsed()
        );
        let timeout = diesel::sql_query("PRAGMA busy_timeout")
            .get_result::<BusyTimeout>(&mut *conn)
            .unwrap();
        assert_eq!(timeout.timeout, 30_000);

        holder.batch_execute("COMMIT").unwrap();
        let balance = accounts::table
            .find(1)
            .build_lock()
            .nowait()
            .run(&mut *conn, |_, a: Account| Ok::<_, Error>(a.balance));
        assert_eq!(balance.unwrap(), 100);
    }

    /// Thread A holds `with_lock` on row 1 for 200 ms; thread B, started once
    /// A is inside, locks row 2 and must only get in after A left. Under a
    /// plain deferred `BEGIN`, B's closure would start at once (WAL readers
    /// do not wait) and the sequence would be A-in, B-in, A-out.
    #[test]
    fn with_lock_holds_the_database_write_lock() {
        let db = testkit::SqliteTestDb::new();
        let pool = testkit::sqlite_pool(&db.url, 2);
        testkit::fixtures::create_schema(
            &mut pool.get().unwrap(),
            testkit::fixtures::SQLITE_SCHEMA,
        );
        diesel::insert_into(accounts::table)
            .values(&vec![
                (accounts::id.eq(1), accounts::balance.eq(100i64)),
                (accounts::id.eq(2), accounts::balance.eq(100i64)),
            ])
            .execute(&mut pool.get().unwrap())
            .unwrap();

        let sequence = AtomicU32::new(0);
        let a_inside = Barrier::new(2);
        let (a_in, a_out, b_in, b_waited) = thread::scope(|scope| {
            let a = scope.spawn(|| {
                let mut conn = pool.get().unwrap();
                accounts::table
                    .find(1)
                    .with_lock(&mut *conn, |conn, _: Account| {
                        let a_in = sequence.fetch_add(1, Ordering::SeqCst);
                        a_inside.wait();
                        thread::sleep(Duration::from_millis(200));
                        diesel::update(accounts::table.find(1))
                            .set(accounts::balance.eq(90))
                            .execute(conn)?;
                        Ok::<_, Error>((a_in, sequence.fetch_add(1, Ordering::SeqCst)))
                    })
                    .unwrap()
            });
            let b = scope.spawn(|| {
                let mut conn = pool.get().unwrap();
                a_inside.wait();
                let asked = Instant::now();
                accounts::table
                    .find(2)
                    .with_lock(&mut *conn, |_, _: Account| {
                        Ok::<_, Error>((sequence.fetch_add(1, Ordering::SeqCst), asked.elapsed()))
                    })
                    .unwrap()
            });
            let (a_in, a_out) = a.join().unwrap();
            let (b_in, b_waited) = b.join().unwrap();
            (a_in, a_out, b_in, b_waited)
        });
        eprintln!("sqlite write lock: B waited {b_waited:?} for A");
        assert_eq!(
            (a_in, a_out, b_in),
            (0, 1, 2),
            "B's closure ran while A held the write lock"
        );
        assert!(
            b_waited >= Duration::from_millis(150),
            "B waited only {b_waited:?}"
        );
    }
}

// Row locks, wait policies, lock timeouts and deadlocks: PostgreSQL and MySQL.
on_every_backend! {
    row_locks;

    use diesel_claim::{is_deadlock, is_lock_not_available, retry, LockStrength, RetryPolicy};

    /// A fresh database with accounts 1 and 2 holding 100 each.
    pub fn accounts_db(size: u32) -> (impl Sized, Pool) {
        let (db, pool) = test_db(size);
        seed_accounts(&mut pool.get().unwrap(), &[100, 100]);
        (db, pool)
    }

    pub fn balances(conn: &mut Conn) -> Vec<i64> {
        accounts::table
            .order(accounts::id)
            .select(accounts::balance)
            .load(conn)
            .unwrap()
    }

    /// Runs `body` while another connection holds a transaction that ran
    /// `lock_sql`, and releases that transaction afterwards (also when `body`
    /// panics).
    pub fn while_held<R>(pool: &Pool, lock_sql: &str, body: impl FnOnce() -> R) -> R {
        let locked = Barrier::new(2);
        let release = Barrier::new(2);
        thread::scope(|scope| {
            let holder = scope.spawn(|| {
                let mut conn = pool.get().unwrap();
                conn.transaction(|conn| {
                    let taken = diesel::sql_query(lock_sql).execute(conn);
                    locked.wait();
                    release.wait();
                    taken.map(drop)
                })
            });
            locked.wait();
            let result = panic::catch_unwind(AssertUnwindSafe(body));
            release.wait();
            holder
                .join()
                .unwrap()
                .expect("the holder could not take its lock");
            result.unwrap_or_else(|payload| panic::resume_unwind(payload))
        })
    }

    pub const HOLD_ROW_1: &str = "SELECT id FROM accounts WHERE id = 1 FOR UPDATE";

    /// With several rows, `nowait` fails when any one of them is locked, for
    /// `with_locks` and for `with_lock` alike: skip-locked must not quietly hand
    /// the closure a subset.
    #[test]
    fn nowait_fails_when_any_selected_row_is_locked() {
        let (_db, pool) = accounts_db(2);
        let mut conn = pool.get().unwrap();
        let conn: &mut Conn = &mut conn;
        let both = || {
            accounts::table
                .filter(accounts::id.eq_any([1, 2]))
                .order(accounts::id)
        };

        let (all, one) = while_held(
            &pool,
            "SELECT * FROM accounts WHERE id = 2 FOR UPDATE",
            || {
                let all = both()
                    .build_lock()
                    .nowait()
                    .run_all(conn, |_, rows: Vec<Account>| Ok::<_, Error>(rows.len()));
                let one = both()
                    .build_lock()
                    .on_locked(OnLocked::Skip)
                    .run(conn, |_, a: Account| Ok::<_, Error>(a.id));
                (all, one)
            },
        );
        assert!(matches!(all, Err(Error::LockNotAvailable)), "{all:?}");
        assert!(matches!(one, Err(Error::LockNotAvailable)), "{one:?}");
        assert_eq!(transaction_depth(conn), 0);

        let ids = both()
            .with_locks(conn, |_, rows: Vec<Account>| {
                Ok::<_, Error>(rows.iter().map(|a| a.id).collect::<Vec<_>>())
            })
            .unwrap();
        assert_eq!(ids, [1, 2]);
    }

    #[test]
    fn nowait_and_skip_fail_at_once_on_a_locked_row() {
        let (_db, pool) = accounts_db(2);
        let mut conn = pool.get().unwrap();
        let conn: &mut Conn = &mut conn;

        let (nowait, skip, elapsed, other_row) = while_held(&pool, HOLD_ROW_1, || {
            let started = Instant::now();
            let nowait = accounts::table
                .find(1)
                .build_lock()
                .nowait()
                .run(conn, |_, a: Account| Ok::<_, Error>(a.balance));
            let skip = accounts::table
                .find(1)
                .build_lock()
                .on_locked(OnLocked::Skip)
                .run(conn, |_, a: Account| Ok::<_, Error>(a.balance));
            let elapsed = started.elapsed();
            // Row locks: the row next door is free.
            let other_row = accounts::table
                .find(2)
                .build_lock()
                .nowait()
                .run(conn, |_, a: Account| Ok::<_, Error>(a.balance));
            (nowait, skip, elapsed, other_row)
        });
        eprintln!("nowait + skip on a locked row: {elapsed:?}");
        assert!(matches!(nowait, Err(Error::LockNotAvailable)), "{nowait:?}");
        assert!(matches!(skip, Err(Error::LockNotAvailable)), "{skip:?}");
        assert!(
            elapsed < Duration::from_secs(1),
            "failing at once took {elapsed:?}"
        );
        assert_eq!(other_row.unwrap(), 100);
        assert_eq!(transaction_depth(conn), 0);

        // Released: the same lock is granted.
        let balance = accounts::table
            .find(1)
            .build_lock()
            .nowait()
            .run(conn, |_, a: Account| Ok::<_, Error>(a.balance))
            .unwrap();
        assert_eq!(balance, 100);
    }

    /// Waiting is bounded by the session's `lock_timeout`, which surfaces as
    /// `LockNotAvailable` (and is recognised in a plain diesel error), after
    /// which the connection works.
    #[test]
    fn lock_timeout_is_lock_not_available_and_the_connection_survives() {
        let (_db, pool) = accounts_db(2);
        let mut conn = pool.get().unwrap();
        let conn: &mut Conn = &mut conn;
        conn.batch_execute(SHORT_LOCK_WAIT).unwrap();

        let (typed, waited, raw) = while_held(&pool, HOLD_ROW_1, || {
            let started = Instant::now();
            let typed = accounts::table.find(1).with_lock(conn, |conn, a: Account| {
                diesel::update(accounts::table.find(1))
                    .set(accounts::balance.eq(a.balance + 1))
                    .execute(conn)?;
                Ok::<_, Error>(())
            });
            let waited = started.elapsed();
            let raw = accounts::table.find(1).with_lock(conn, |_, a: Account| {
                Ok::<_, diesel::result::Error>(a.balance)
            });
            (typed, waited, raw)
        });
        eprintln!("{SHORT_LOCK_WAIT}: gave up after {waited:?}");
        assert!(matches!(typed, Err(Error::LockNotAvailable)), "{typed:?}");
        assert!(
            waited >= Duration::from_millis(180) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        let raw = raw.unwrap_err();
        assert!(is_lock_not_available(&raw), "{raw:?}");

        assert_eq!(transaction_depth(conn), 0);
        assert_eq!(balances(conn), vec![100, 100]);
        let balance = accounts::table
            .find(1)
            .with_lock(conn, |_, a: Account| Ok::<_, Error>(a.balance))
            .unwrap();
        assert_eq!(balance, 100);
    }

    /// The server's own NOWAIT error, in a plain diesel error, is classified.
    #[test]
    fn raw_nowait_error_is_classified() {
        let (_db, pool) = accounts_db(2);
        let mut conn = pool.get().unwrap();
        let raw = while_held(&pool, HOLD_ROW_1, || {
            conn.transaction(|conn| {
                diesel::sql_query("SELECT id FROM accounts WHERE id = 1 FOR UPDATE NOWAIT")
                    .execute(conn)
            })
        });
        let raw = raw.unwrap_err();
        assert!(is_lock_not_available(&raw), "{raw:?}");
        assert!(!is_deadlock(&raw));
        assert!(matches!(Error::from(raw), Error::LockNotAvailable));
    }

    /// A nowait failure inside the caller's transaction does not abort it.
    #[test]
    fn nowait_failure_leaves_the_callers_transaction_usable() {
        let (_db, pool) = accounts_db(2);
        let mut conn = pool.get().unwrap();
        let conn: &mut Conn = &mut conn;

        let (inner, outer) = while_held(&pool, HOLD_ROW_1, || {
            let mut inner = None;
            let outer = conn.transaction::<_, Error, _>(|conn| {
                inner = Some(
                    accounts::table
                        .find(1)
                        .build_lock()
                        .nowait()
                        .run(conn, |_, a: Account| Ok::<_, Error>(a.balance)),
                );
                diesel::update(accounts::table.find(2))
                    .set(accounts::balance.eq(777))
                    .execute(conn)?;
                let balance: i64 = accounts::table
                    .find(2)
                    .select(accounts::balance)
                    .first(conn)?;
                Ok(balance)
            });
            (inner, outer)
        });
        assert!(
            matches!(inner, Some(Err(Error::LockNotAvailable))),
            "{inner:?}"
        );
        assert_eq!(outer.unwrap(), 777);
        assert_eq!(transaction_depth(conn), 0);
        assert_eq!(balances(conn), vec![100, 777]);
    }

    /// Row locks lock rows: unlike SQLite's write lock (see
    /// `sqlite_only::with_lock_holds_the_database_write_lock`), `with_lock` on
    /// another row goes ahead while the first is held.
    #[test]
    fn with_lock_on_another_row_does_not_wait() {
        let (_db, pool) = accounts_db(2);
        let sequence = AtomicU32::new(0);
        let a_inside = Barrier::new(2);
        let b_done = Barrier::new(2);
        let (a_in, a_out, b_in) = thread::scope(|scope| {
            let a = scope.spawn(|| {
                let mut conn = pool.get().unwrap();
                accounts::table
                    .find(1)
                    .with_lock(&mut *conn, |_, _: Account| {
                        let a_in = sequence.fetch_add(1, Ordering::SeqCst);
                        a_inside.wait();
                        b_done.wait();
                        Ok::<_, Error>((a_in, sequence.fetch_add(1, Ordering::SeqCst)))
                    })
                    .unwrap()
            });
            let mut conn = pool.get().unwrap();
            a_inside.wait();
            let b_in = accounts::table
                .find(2)
                .with_lock(&mut *conn, |_, _: Account| {
                    Ok::<_, Error>(sequence.fetch_add(1, Ordering::SeqCst))
                });
            b_done.wait();
            let (a_in, a_out) = a.join().unwrap();
            (a_in, a_out, b_in.unwrap())
        });
        assert_eq!((a_in, b_in, a_out), (0, 1, 2));
    }

    /// Locks `first`, waits at `barrier` (when given) and then locks `second`,
    /// moving `amount` from `first` to `second`.
    fn lock_both<E>(
        conn: &mut Conn,
        first: i32,
        second: i32,
        amount: i64,
        barrier: Option<&Barrier>,
    ) -> Result<(), E>
    where
        E: From<Error> + From<diesel::result::Error>,
    {
        accounts::table
            .find(first)
            .with_lock(conn, |conn, a: Account| {
                if let Some(barrier) = barrier {
                    barrier.wait();
                }
                accounts::table
                    .find(second)
                    .with_lock(conn, |conn, b: Account| {
                        diesel::update(accounts::table.find(first))
                            .set(accounts::balance.eq(a.balance - amount))
                            .execute(conn)?;
                        diesel::update(accounts::table.find(second))
                            .set(accounts::balance.eq(b.balance + amount))
                            .execute(conn)?;
                        Ok(())
                    })
            })
    }

    /// Scenario 14: opposite lock orders deadlock; exactly one side gets the
    /// typed error and the other's transfer completes.
    #[test]
    fn deadlock_surfaces_typed() {
        let (_db, pool) = accounts_db(2);
        let barrier = Barrier::new(2);
        let (forward, backward) = thread::scope(|scope| {
            let forward = scope
                .spawn(|| lock_both::<Error>(&mut pool.get().unwrap(), 1, 2, 10, Some(&barrier)));
            let backward = scope
                .spawn(|| lock_both::<Error>(&mut pool.get().unwrap(), 2, 1, 25, Some(&barrier)));
            (forward.join().unwrap(), backward.join().unwrap())
        });
        let after = balances(&mut pool.get().unwrap());
        match (&forward, &backward) {
            (Ok(()), Err(Error::Deadlock(_))) => assert_eq!(after, vec![90, 110]),
            (Err(Error::Deadlock(_)), Ok(())) => assert_eq!(after, vec![125, 75]),
            other => panic!("expected one deadlock and one success, got {other:?}"),
        }
        let deadlock = forward.err().or(backward.err()).unwrap();
        assert!(deadlock.is_transient());
    }

    /// Scenario 14 with `retry`: the deadlocked side runs again and both
    /// transfers complete.
    #[test]
    fn deadlock_is_recovered_by_retry() {
        let (_db, pool) = accounts_db(2);
        let barrier = Barrier::new(2);
        let deadlocks = AtomicU32::new(0);
        let attempts = AtomicU32::new(0);
        let started = Instant::now();
        thread::scope(|scope| {
            for (first, second, amount) in [(1, 2, 10), (2, 1, 25)] {
                let (pool, barrier, deadlocks, attempts) = (&pool, &barrier, &deadlocks, &attempts);
                scope.spawn(move || {
                    let mut conn = pool.get().unwrap();
                    let mut attempt = 0;
                    retry(&mut *conn, RetryPolicy::default(), |conn| {
                        attempt += 1;
                        attempts.fetch_add(1, Ordering::Relaxed);
                        let result = lock_both::<Error>(
                            conn,
                            first,
                            second,
                            amount,
                            (attempt == 1).then_some(barrier),
                        );
                        if let Err(Error::Deadlock(_)) = result {
                            deadlocks.fetch_add(1, Ordering::Relaxed);
                        }
                        result
                    })
                    .unwrap();
                });
            }
        });
        eprintln!("deadlock + retry: {:?}", started.elapsed());
        // A retry can meet the other side again before that side has taken
        // the lock the deadlock freed (a loaded machine): each deadlock costs
        // exactly one more attempt.
        let deadlocks = deadlocks.into_inner();
        assert!(deadlocks >= 1);
        assert_eq!(attempts.into_inner(), 2 + deadlocks);
        assert_eq!(balances(&mut pool.get().unwrap()), vec![115, 85]);
    }

    /// A deadlock in plain diesel code, and through `with_lock` with a
    /// `diesel::result::Error` closure, is recognised by `is_deadlock`.
    #[test]
    fn raw_deadlock_error_is_classified() {
        let (_db, pool) = accounts_db(2);

        let barrier = Barrier::new(2);
        let plain = |first: i32, second: i32| {
            let mut conn = pool.get().unwrap();
            conn.transaction(|conn| {
                diesel::sql_query(format!(
                    "SELECT id FROM accounts WHERE id = {first} FOR UPDATE"
                ))
                .execute(conn)?;
                barrier.wait();
                diesel::sql_query(format!(
                    "SELECT id FROM accounts WHERE id = {second} FOR UPDATE"
                ))
                .execute(conn)?;
                Ok::<_, diesel::result::Error>(())
            })
        };
        let results = thread::scope(|scope| {
            let a = scope.spawn(|| plain(1, 2));
            let b = scope.spawn(|| plain(2, 1));
            [a.join().unwrap(), b.join().unwrap()]
        });
        let errors: Vec<_> = results.into_iter().filter_map(Result::err).collect();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            is_deadlock(&errors[0]) && !is_lock_not_available(&errors[0]),
            "{errors:?}"
        );

        let results = thread::scope(|scope| {
            let a = scope.spawn(|| {
                lock_both::<diesel::result::Error>(
                    &mut pool.get().unwrap(),
                    1,
                    2,
                    10,
                    Some(&barrier),
                )
            });
            let b = scope.spawn(|| {
                lock_both::<diesel::result::Error>(
                    &mut pool.get().unwrap(),
                    2,
                    1,
                    25,
                    Some(&barrier),
                )
            });
            [a.join().unwrap(), b.join().unwrap()]
        });
        let errors: Vec<_> = results.into_iter().filter_map(Result::err).collect();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(is_deadlock(&errors[0]), "{errors:?}");
        let typed = Error::from(errors.into_iter().next().unwrap());
        assert!(matches!(typed, Error::Deadlock(_)), "{typed:?}");
    }
}

/// Lock strengths only PostgreSQL has.
#[cfg(feature = "postgres")]
mod pg_only {
    use super::pg::Conn;
    use super::pg_row_locks::{accounts_db, while_held};
    use super::*;
    use diesel_claim::LockStrength;

    /// The default strength, `FOR NO KEY UPDATE`, coexists with a foreign-key
    /// check's `FOR KEY SHARE`; `FOR UPDATE` does not.
    #[test]
    fn lock_strength_is_applied() {
        let (_db, pool) = accounts_db(2);
        let mut conn = pool.get().unwrap();
        let conn: &mut Conn = &mut conn;

        let (default, update) = while_held(
            &pool,
            "SELECT id FROM accounts WHERE id = 1 FOR KEY SHARE",
            || {
                let default = accounts::table
                    .find(1)
                    .build_lock()
                    .nowait()
                    .run(conn, |_, a: Account| Ok::<_, Error>(a.balance));
                let update = accounts::table
                    .find(1)
                    .build_lock()
                    .strength(LockStrength::Update)
                    .nowait()
                    .run(conn, |_, a: Account| Ok::<_, Error>(a.balance));
                (default, update)
            },
        );
        assert_eq!(default.unwrap(), 100);
        assert!(matches!(update, Err(Error::LockNotAvailable)), "{update:?}");
    }
}
