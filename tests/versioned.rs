//! Optimistic updates: `update_versioned` and the `retry` helper (scenarios 11, 12
//! and 15 of the design, plus the "matches nothing" bad input).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{retry, Error, RetryPolicy};

use testkit::fixtures::{accounts, on_every_backend, run_bank, Account, BankError, BankFigures};

/// A changeset whose fields may all be `None`: then it is empty.
#[derive(Debug, Clone, AsChangeset)]
#[diesel(table_name = accounts)]
struct BalanceChange {
    balance: Option<i64>,
}

/// A patient policy for the heavily contended tests.
fn patient() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 200,
        ..RetryPolicy::default()
    }
}

on_every_backend! {

    fn read(conn: &mut Conn, id: i32) -> QueryResult<Account> {
        accounts::table.find(id).select(Account::as_select()).first(conn)
    }

    fn all(conn: &mut Conn) -> Vec<Account> {
        accounts::table.order(accounts::id).select(Account::as_select()).load(conn).unwrap()
    }

    /// Moves `amount` with two versioned updates in one transaction, after
    /// reading both accounts (outside it) and waiting `pause` between read and
    /// write. The whole of it is one attempt: `retry` wraps this function.
    fn optimistic_transfer(
        conn: &mut Conn,
        from: i32,
        to: i32,
        amount: i64,
        pause: Duration,
    ) -> Result<(), BankError> {
        let source = read(conn, from)?;
        let target = read(conn, to)?;
        if source.balance < amount {
            return Err(BankError::Insufficient);
        }
        if !pause.is_zero() {
            thread::sleep(pause);
        }
        // Lower id first: PostgreSQL's row locks, taken by the updates, are
        // then always acquired in one order and cannot deadlock (a deadlock
        // would be retried too, but only after `deadlock_timeout`, 1 s).
        let mut updates = [(source, -amount), (target, amount)];
        updates.sort_by_key(|(account, _)| account.id);
        conn.transaction(|conn| {
            for (account, delta) in updates {
                accounts::table
                    .find(account.id)
                    .update_versioned(accounts::version, account.version, accounts::balance.eq(account.balance + delta))
                    .execute(conn)?;
            }
            Ok(())
        })
    }

    /// `threads` clients each make `per_thread` random transfers among
    /// `balances.len()` accounts with `optimistic_transfer` + `retry`, while
    /// one more thread keeps summing all balances. Checks conservation at
    /// every read and at the end, and that every successful transfer bumped
    /// exactly two versions.
    fn optimistic_bank(balances: &[i64], threads: usize, per_thread: usize, pause: Duration) -> BankFigures {
        let (_db, pool) = test_db(threads as u32 + 2);
        seed_accounts(&mut pool.get().unwrap(), balances);
        let total: i64 = balances.iter().sum();
        let figures = run_bank(&pool, balances.len() as u64, total, threads, per_thread, consistent_balances, |conn, from, to, amount| {
            let mut attempts = 0;
            let outcome = retry(conn, patient(), |conn| {
                attempts += 1;
                optimistic_transfer(conn, from, to, amount, pause)
            });
            (outcome, attempts - 1)
        });
        let after = all(&mut pool.get().unwrap());
        // Every successful transfer bumped exactly two versions, once each.
        assert_eq!(after.iter().map(|a| a.version as u64).sum::<u64>(), 2 * figures.transfers);
        figures
    }

    #[test]
    fn update_versioned_outcomes() {
        let (_db, pool) = test_db(2);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100, 50]);

        // Updated: the new version comes back and the row has it.
        let version = accounts::table
            .find(1)
            .update_versioned(accounts::version, 0, accounts::balance.eq(110))
            .execute(conn)
            .unwrap();
        assert_eq!(version, 1);
        assert_eq!(read(conn, 1).unwrap(), Account { id: 1, balance: 110, version: 1 });

        // Stale: a conflict naming both versions, again and again; nothing written.
        for _ in 0..3 {
            let stale = accounts::table
                .find(1)
                .update_versioned(accounts::version, 0, accounts::balance.eq(999))
                .execute(conn);
            match stale {
                Err(Error::VersionConflict { expected: 0, actual: Some(1), .. }) => {}
                other => panic!("expected a version conflict 0 vs 1, got {other:?}"),
            }
        }
        let stale = accounts::table
            .find(1)
            .update_versioned(accounts::version, 0, accounts::balance.eq(999))
            .execute(conn)
            .unwrap_err();
        assert!(stale.is_transient());
        // The table as `table!` names it, without the backend's quotes.
        assert!(matches!(&stale, Error::VersionConflict { table, .. } if table == "accounts"), "{stale:?}");
        assert_eq!(stale.to_string(), "version conflict on accounts: expected version 0, found 1");
        assert_eq!(read(conn, 1).unwrap(), Account { id: 1, balance: 110, version: 1 });

        // Another connection's write makes this one's read stale.
        let seen = read(conn, 2).unwrap();
        let mut other = pool.get().unwrap();
        accounts::table
            .find(2)
            .update_versioned(accounts::version, seen.version, accounts::balance.eq(60))
            .execute(&mut *other)
            .unwrap();
        let lost = accounts::table
            .find(2)
            .update_versioned(accounts::version, seen.version, accounts::balance.eq(seen.balance + 1))
            .execute(conn);
        assert!(matches!(lost, Err(Error::VersionConflict { expected: 0, actual: Some(1), .. })), "{lost:?}");
        assert_eq!(read(conn, 2).unwrap().balance, 60);

        let version = accounts::table
            .find(1)
            .update_versioned(accounts::version, 1, accounts::balance.eq(120))
            .execute(conn)
            .unwrap();
        assert_eq!(version, 2);

        // Gone, or never there: not found, never Ok and never a conflict.
        diesel::delete(accounts::table.find(2)).execute(conn).unwrap();
        for id in [2, 42] {
            let gone = accounts::table
                .find(id)
                .update_versioned(accounts::version, 1, accounts::balance.eq(1))
                .execute(conn);
            assert!(matches!(gone, Err(Error::NotFound)), "id {id}: {gone:?}");
        }

        // An empty changeset is refused and does not bump the version.
        let empty = accounts::table
            .find(1)
            .update_versioned(accounts::version, 2, BalanceChange { balance: None })
            .execute(conn);
        assert!(matches!(empty, Err(Error::InvalidArgument(_))), "{empty:?}");
        assert_eq!(read(conn, 1).unwrap(), Account { id: 1, balance: 120, version: 2 });
        let some = accounts::table
            .find(1)
            .update_versioned(accounts::version, 2, BalanceChange { balance: Some(7) })
            .execute(conn)
            .unwrap();
        assert_eq!(some, 3);
        assert_eq!(read(conn, 1).unwrap(), Account { id: 1, balance: 7, version: 3 });

        // Up to the maximum, and no further: overflow is an error, not a wrap.
        diesel::update(accounts::table.find(1))
            .set(accounts::version.eq(i32::MAX - 1))
            .execute(conn)
            .unwrap();
        let last = accounts::table
            .find(1)
            .update_versioned(accounts::version, i32::MAX - 1, accounts::balance.eq(8))
            .execute(conn)
            .unwrap();
        assert_eq!(last, i32::MAX);
        let overflow = accounts::table
            .find(1)
            .update_versioned(accounts::version, i32::MAX, accounts::balance.eq(9))
            .execute(conn);
        assert!(matches!(overflow, Err(Error::VersionOverflow(v)) if v == i64::from(i32::MAX)), "{overflow:?}");
        assert_eq!(read(conn, 1).unwrap(), Account { id: 1, balance: 8, version: i32::MAX });
    }

    /// A loaded model (`&model`), a borrowed changeset and borrowed binds are
    /// targets like any other: nothing has to be `'static`.
    #[test]
    fn borrowed_models_changesets_and_binds() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100, 50]);

        let account = read(conn, 1).unwrap();
        let change = BalanceChange { balance: Some(130) };
        let version = (&account)
            .update_versioned(accounts::version, account.version, &change)
            .execute(conn)
            .unwrap();
        assert_eq!(version, 1);
        assert_eq!(read(conn, 1).unwrap(), Account { id: 1, balance: 130, version: 1 });
        // The model is now stale: a conflict, and nothing written.
        let stale = (&account)
            .update_versioned(accounts::version, account.version, &change)
            .execute(conn);
        assert!(matches!(stale, Err(Error::VersionConflict { expected: 0, actual: Some(1), .. })), "{stale:?}");

        let wanted = String::from("2");
        let id: i32 = wanted.parse().unwrap();
        let version = accounts::table
            .filter(accounts::id.eq(&id))
            .update_versioned(accounts::version, 0, accounts::balance.eq(&account.balance))
            .execute(conn)
            .unwrap();
        assert_eq!(version, 1);
        assert_eq!(read(conn, 2).unwrap(), Account { id: 2, balance: 100, version: 1 });
    }

    #[test]
    fn retry_gives_up_after_max_attempts_on_a_stale_version() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[5]);
        diesel::update(accounts::table.find(1)).set(accounts::version.eq(3)).execute(conn).unwrap();

        // An operation that never re-reads keeps conflicting: retry returns the
        // last conflict after exactly max_attempts attempts.
        let mut attempts = 0;
        let result = retry(conn, RetryPolicy::attempts(4), |conn| {
            attempts += 1;
            accounts::table.find(1).update_versioned(accounts::version, 1, accounts::balance.eq(6)).execute(conn)
        });
        assert!(matches!(result, Err(Error::VersionConflict { expected: 1, actual: Some(3), .. })), "{result:?}");
        assert_eq!(attempts, 4);

        // Not-found is not transient: one attempt only.
        let mut attempts = 0;
        let result = retry(conn, RetryPolicy::attempts(4), |conn| {
            attempts += 1;
            accounts::table.find(9).update_versioned(accounts::version, 0, accounts::balance.eq(6)).execute(conn)
        });
        assert!(matches!(result, Err(Error::NotFound)), "{result:?}");
        assert_eq!(attempts, 1);
        assert_eq!(read(conn, 1).unwrap(), Account { id: 1, balance: 5, version: 3 });
    }

    /// The version is the crate's to set: a changeset that sets it too is
    /// refused the same way on every backend, and nothing changes.
    #[test]
    fn a_changeset_that_sets_the_version_is_refused() {
        #[derive(Clone, AsChangeset)]
        #[diesel(table_name = accounts)]
        struct Everything {
            balance: i64,
            version: i32,
        }

        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100]);
        let expected = "invalid argument: the changeset sets the version column `version` itself: \
                        update_versioned sets it to the expected version + 1";
        let tuple = accounts::table
            .find(1)
            .update_versioned(accounts::version, 0, (accounts::balance.eq(1), accounts::version.eq(5)))
            .execute(conn)
            .unwrap_err();
        assert!(matches!(tuple, Error::InvalidArgument(_)), "{tuple:?}");
        assert_eq!(tuple.to_string(), expected);
        let model = accounts::table
            .find(1)
            .update_versioned(accounts::version, 0, Everything { balance: 2, version: 0 })
            .execute(conn)
            .unwrap_err();
        assert_eq!(model.to_string(), expected);
        assert_eq!(read(conn, 1).unwrap(), Account { id: 1, balance: 100, version: 0 });
    }

    /// A target that matches several rows is refused and changes nothing, in
    /// a transaction of the caller's or not; one that matches one row by
    /// another column than the key goes through.
    #[test]
    fn a_target_matching_several_rows_changes_nothing() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100, 100, 50]);
        let several = accounts::table
            .filter(accounts::balance.eq(100))
            .update_versioned(accounts::version, 0, accounts::balance.eq(7))
            .execute(conn)
            .unwrap_err();
        assert!(matches!(several, Error::UnexpectedOutcome(_)), "{several:?}");
        assert_eq!(
            several.to_string(),
            "unexpected outcome: the target of update_versioned matched 2 rows: it must be one row, \
             such as `table.find(key)` or `&model`; nothing was changed"
        );
        let untouched = [
            Account { id: 1, balance: 100, version: 0 },
            Account { id: 2, balance: 100, version: 0 },
            Account { id: 3, balance: 50, version: 0 },
        ];
        assert_eq!(all(conn), untouched);

        // Inside the caller's transaction: refused, and the transaction goes on.
        conn.transaction(|conn| {
            let several = accounts::table
                .filter(accounts::balance.gt(0))
                .update_versioned(accounts::version, 0, accounts::balance.eq(7))
                .execute(conn);
            assert!(matches!(several, Err(Error::UnexpectedOutcome(_))), "{several:?}");
            assert_eq!(all(conn), untouched);
            accounts::table
                .filter(accounts::balance.eq(50))
                .update_versioned(accounts::version, 0, accounts::balance.eq(60))
                .execute(conn)
        })
        .unwrap();
        assert_eq!(read(conn, 3).unwrap(), Account { id: 3, balance: 60, version: 1 });
    }

    /// A versioned delete has the update's three outcomes: deleted, a
    /// conflict that leaves the changed row, not found; and a target of
    /// several rows deletes nothing.
    #[test]
    fn delete_versioned_outcomes() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100, 50, 50, 50]);
        let first = read(conn, 1).unwrap();
        accounts::table
            .find(1)
            .update_versioned(accounts::version, 0, accounts::balance.eq(90))
            .execute(conn)
            .unwrap();

        // Read at version 0, changed since: a conflict, and the row stays.
        let stale = (&first).delete_versioned(accounts::version, first.version).execute(conn);
        assert!(matches!(stale, Err(Error::VersionConflict { expected: 0, actual: Some(1), .. })), "{stale:?}");
        assert_eq!(read(conn, 1).unwrap().balance, 90);

        (&first).delete_versioned(accounts::version, 1).execute(conn).unwrap();
        assert!(matches!(read(conn, 1), Err(diesel::result::Error::NotFound)));
        let gone = accounts::table.find(1).delete_versioned(accounts::version, 1).execute(conn);
        assert!(matches!(gone, Err(Error::NotFound)), "{gone:?}");

        let several = accounts::table
            .filter(accounts::balance.eq(50))
            .delete_versioned(accounts::version, 0)
            .execute(conn)
            .unwrap_err();
        assert_eq!(
            several.to_string(),
            "unexpected outcome: the target of delete_versioned matched 3 rows: it must be one row, \
             such as `table.find(key)` or `&model`; nothing was changed"
        );
        assert_eq!(all(conn).len(), 3);
    }

    /// `retry` takes the error types applications use: `anyhow::Error` (with
    /// or without context), boxed errors, and the crate's; a transient cause
    /// anywhere in the chain is retried, anything else returned at once.
    #[test]
    fn retry_takes_anyhow_and_boxed_errors() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[5]);
        diesel::update(accounts::table.find(1)).set(accounts::version.eq(2)).execute(conn).unwrap();

        // Attempt n expects version n - 1: two conflicts, then the update.
        let mut attempts = 0;
        let version = retry(conn, RetryPolicy::attempts(5), |conn| {
            attempts += 1;
            accounts::table
                .find(1)
                .update_versioned(accounts::version, attempts - 1, accounts::balance.eq(6))
                .execute(conn)
                .map_err(Box::<dyn std::error::Error + Send + Sync>::from)
        })
        .unwrap();
        assert_eq!((attempts, version), (3, 3));

        #[cfg(feature = "anyhow")]
        retry_anyhow(conn);
    }

    /// `retry` with `anyhow::Error`, with and without context (feature `anyhow`).
    #[cfg(feature = "anyhow")]
    fn retry_anyhow(conn: &mut Conn) {
        use anyhow::Context;

        let mut attempts = 0;
        let version = retry(conn, RetryPolicy::attempts(5), |conn| -> anyhow::Result<i32> {
            attempts += 1;
            let version = accounts::table
                .find(1)
                .update_versioned(accounts::version, attempts + 1, accounts::balance.eq(7))
                .execute(conn)
                .context("bumping the balance")?;
            Ok(version)
        })
        .unwrap();
        assert_eq!((attempts, version), (2, 4));

        // Not transient: returned after one attempt.
        let mut attempts = 0;
        let missing = retry(conn, RetryPolicy::attempts(5), |conn| -> anyhow::Result<i32> {
            attempts += 1;
            Ok(accounts::table
                .find(9)
                .update_versioned(accounts::version, 0, accounts::balance.eq(1))
                .execute(conn)?)
        });
        assert_eq!(attempts, 1);
        assert!(matches!(missing.unwrap_err().downcast::<Error>(), Ok(Error::NotFound)));
        assert_eq!(read(conn, 1).unwrap(), Account { id: 1, balance: 7, version: 4 });
    }

    /// A policy of no attempts is refused, and the operation never runs.
    #[test]
    fn retry_refuses_zero_attempts() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        let mut ran = false;
        let refused = retry(conn, RetryPolicy::attempts(0), |_| -> Result<(), Error> {
            ran = true;
            Ok(())
        });
        match refused {
            Err(Error::InvalidArgument(message)) => {
                assert_eq!(message, "a retry policy needs at least one attempt: max_attempts is 0")
            }
            other => panic!("expected an invalid argument, got {other:?}"),
        }
        assert!(!ran);
    }

    /// Scenario 12. Without the version check the 25 threads, released together,
    /// would overwrite each other's increments and the counter would end below 125.
    #[test]
    fn counter_25_threads_times_5_increments_is_exactly_125() {
        const THREADS: usize = 25;
        const INCREMENTS: u32 = 5;
        let (_db, pool) = test_db(THREADS as u32);
        seed_accounts(&mut pool.get().unwrap(), &[0]);

        let retries = AtomicU32::new(0);
        let start = Barrier::new(THREADS);
        let started = Instant::now();
        thread::scope(|scope| {
            for _ in 0..THREADS {
                scope.spawn(|| {
                    let mut pooled = pool.get().unwrap();
                    let conn: &mut Conn = &mut pooled;
                    start.wait();
                    for _ in 0..INCREMENTS {
                        let mut attempts = 0;
                        retry(conn, patient(), |conn| {
                            attempts += 1;
                            let counter = read(conn, 1)?;
                            accounts::table
                                .find(1)
                                .update_versioned(accounts::version, counter.version, accounts::balance.eq(counter.balance + 1))
                                .execute(conn)
                        })
                        .unwrap_or_else(|e| panic!("increment failed after {attempts} attempts: {e:?}"));
                        retries.fetch_add(attempts - 1, Ordering::Relaxed);
                    }
                });
            }
        });
        let total = THREADS as u32 * INCREMENTS;
        let counter = read(&mut pool.get().unwrap(), 1).unwrap();
        eprintln!(
            "counter: {total} increments, {} retries ({:.2} per success), {:?}",
            retries.load(Ordering::Relaxed),
            f64::from(retries.load(Ordering::Relaxed)) / f64::from(total),
            started.elapsed(),
        );
        assert_eq!(counter, Account { id: 1, balance: 125, version: 125 });
    }

    /// Scenario 11. Without the version check, concurrent transfers would
    /// overwrite each other's balances and the final total would not be
    /// 10,000 (see `naive_read_modify_write_loses_money` for the proof on
    /// PostgreSQL); without the transaction, readers would see a debit without
    /// its credit.
    #[test]
    fn optimistic_bank_conserves_money() {
        let per_thread = if ROW_LOCKS { 500 } else { 100 };
        let figures = optimistic_bank(&[1_000; 10], 8, per_thread, Duration::ZERO);
        eprintln!(
            "optimistic bank: {} transfers, {} refused, {} retries ({:.3} per success), {} full reads, {:?}",
            figures.transfers,
            figures.refused,
            figures.retries,
            figures.retries as f64 / figures.transfers as f64,
            figures.reads,
            figures.elapsed,
        );
    }

    /// The same bank on two accounts with a pause between read and write:
    /// maximal contention, every lost race must end in a retry, never a lost update.
    #[test]
    fn optimistic_bank_under_maximal_contention() {
        let figures = optimistic_bank(&[1_000, 1_000], 8, 10, Duration::from_millis(1));
        eprintln!(
            "contended optimistic bank: {} transfers, {} refused, {} retries, {:?}",
            figures.transfers, figures.refused, figures.retries, figures.elapsed,
        );
        assert!(figures.retries > 0, "8 threads on 2 accounts never conflicted: {figures:?}");
    }
}

/// `get_result` needs `UPDATE … RETURNING`, which MySQL lacks.
mod returning {
    use super::*;

    on_every_backend! {
        except_mysql;

        /// `get_result` returns the updated row, and the same typed outcomes as
        /// `execute` when nothing is updated.
        #[test]
        fn get_result_returns_the_updated_row() {
            let (_db, pool) = test_db(1);
            let mut pooled = pool.get().unwrap();
            let conn: &mut Conn = &mut pooled;
            seed_accounts(conn, &[100]);
            let row: Account = accounts::table
                .find(1)
                .update_versioned(accounts::version, 0, accounts::balance.eq(120))
                .get_result(conn)
                .unwrap();
            assert_eq!(row, Account { id: 1, balance: 120, version: 1 });
            let stale = accounts::table
                .find(1)
                .update_versioned(accounts::version, 0, accounts::balance.eq(999))
                .get_result::<Account, _>(conn);
            assert!(
                matches!(stale, Err(Error::VersionConflict { expected: 0, actual: Some(1), .. })),
                "{stale:?}"
            );
            let gone = accounts::table
                .find(42)
                .update_versioned(accounts::version, 1, accounts::balance.eq(1))
                .get_result::<Account, _>(conn);
            assert!(matches!(gone, Err(Error::NotFound)), "{gone:?}");
            let now: Account = accounts::table.find(1).first(conn).unwrap();
            assert_eq!(now, Account { id: 1, balance: 120, version: 1 });
        }

        /// `get_result` refuses a target of several rows too, changing nothing.
        #[test]
        fn get_result_of_several_rows_changes_nothing() {
            let (_db, pool) = test_db(1);
            let mut pooled = pool.get().unwrap();
            let conn: &mut Conn = &mut pooled;
            seed_accounts(conn, &[100, 100]);
            let several = accounts::table
                .filter(accounts::balance.eq(100))
                .update_versioned(accounts::version, 0, accounts::balance.eq(7))
                .get_result::<Account, _>(conn);
            assert!(matches!(several, Err(Error::UnexpectedOutcome(_))), "{several:?}");
            let balances: Vec<i64> = accounts::table.select(accounts::balance).load(conn).unwrap();
            assert_eq!(balances, [100, 100]);
        }
    }
}
