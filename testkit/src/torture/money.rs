//! Money scenarios on every backend: the pessimistic (10) and optimistic (11)
//! banks, the counter (12), the overdraw race (13) and the optimistic edge
//! cases (15); and the bank worker process.
//!
//! Every transfer is logged in the ledger in its own transaction, so a lost
//! update shows as a balance that disagrees with the ledger, even when the
//! total happens to hold.

use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{retry, Error, RetryPolicy};

use super::procs::Fields;
use super::tables::ledger;
use super::{
    connect_patiently, counted_retry, in_threads, tables, Connect, Ctx, Figures, Running, Scale,
};
use crate::fixtures::{account_pair, accounts, Account, BankError};

/// Every account starts with this much.
pub(super) const OPENING: i64 = 1_000;

/// How a bank moves money.
#[derive(Debug, Clone, Copy)]
enum Method {
    /// `with_locks` on both accounts, lower id first.
    Locked,
    /// `update_versioned` on both accounts in one transaction, with `retry`.
    Optimistic,
}

impl Method {
    fn parse(text: &str) -> Method {
        match text {
            "locked" => Method::Locked,
            "optimistic" => Method::Optimistic,
            _ => panic!("unknown bank method {text:?}"),
        }
    }
}

on_suite_backends! {
    fn bank_database(ctx: &Ctx, accounts: usize) -> (impl Sized, String, Pool) {
        let (db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        tables::create(&mut *conn, BACKEND, CLAIM_STAMP_COLUMN);
        seed_accounts(&mut conn, &vec![OPENING; accounts]);
        let _ = ctx;
        let url = db.url.clone();
        (db, url, pool)
    }

    fn read(conn: &mut Conn, id: i32) -> QueryResult<Account> {
        accounts::table.find(id).select(Account::as_select()).first(conn)
    }

    fn log_transfer(conn: &mut Conn, from: i32, to: i32, amount: i64) -> QueryResult<usize> {
        diesel::insert_into(ledger::table)
            .values((ledger::from_id.eq(from), ledger::to_id.eq(to), ledger::amount.eq(amount)))
            .execute(conn)
    }

    /// Moves `amount` holding both rows' locks; the balances written are those
    /// read under the locks.
    fn locked_transfer(conn: &mut Conn, from: i32, to: i32, amount: i64) -> Result<(), BankError> {
        accounts::table
            .filter(accounts::id.eq_any([from, to]))
            .order(accounts::id)
            .with_locks(conn, |conn, both: Vec<Account>| {
                let balance = |id| both.iter().find(|a| a.id == id).map(|a| a.balance).unwrap();
                if balance(from) < amount {
                    return Err(BankError::Insufficient);
                }
                for (id, delta) in [(from, -amount), (to, amount)] {
                    diesel::update(accounts::table.find(id))
                        .set(accounts::balance.eq(balance(id) + delta))
                        .execute(conn)?;
                }
                log_transfer(conn, from, to, amount)?;
                Ok(())
            })
    }

    /// One attempt of an optimistic transfer: read both, then write both with
    /// their versions checked, in one transaction (lower id first).
    fn optimistic_transfer(conn: &mut Conn, from: i32, to: i32, amount: i64) -> Result<(), BankError> {
        let mut moves = [(read(conn, from)?, -amount), (read(conn, to)?, amount)];
        if moves[0].0.balance < amount {
            return Err(BankError::Insufficient);
        }
        moves.sort_by_key(|(account, _)| account.id);
        conn.transaction(|conn| {
            for (account, delta) in moves {
                accounts::table
                    .find(account.id)
                    .update_versioned(accounts::version, account.version, accounts::balance.eq(account.balance + delta))
                    .execute(conn)?;
            }
            log_transfer(conn, from, to, amount)?;
            Ok(())
        })
    }

    /// Worker: `threads` clients make random transfers among `accounts` for
    /// `millis` ms with `method`; with `persist`, a transfer that fails for
    /// any reason is left, and the client goes on on a new connection,
    /// waiting out a server that is down.
    pub fn bank_worker(args: &Fields) -> Figures {
        let threads = args.number("threads") as usize;
        let accounts = args.number("accounts");
        let method = Method::parse(args.text("method"));
        let until = Instant::now() + Duration::from_millis(args.number("millis"));
        let first = args.number("first");
        let persist = args.get("persist").is_some();
        in_threads(threads, |index| {
            let mut figures = Figures::default();
            let mut conn = if persist {
                connect_patiently(args.text("url"), &mut figures)
            } else {
                Conn::connect(args.text("url"))
            };
            let mut random = fastrand::Rng::with_seed(first + index as u64);
            while Instant::now() < until {
                let (from, to) = account_pair(&mut random, accounts);
                let amount = 1 + random.u64(..300) as i64;
                let outcome = counted_retry(&mut conn, &mut figures, |conn| match method {
                    Method::Locked => locked_transfer(conn, from, to, amount),
                    Method::Optimistic => optimistic_transfer(conn, from, to, amount),
                });
                match outcome {
                    Ok(()) => figures.ops += 1,
                    Err(BankError::Insufficient) => figures.count_error("Insufficient"),
                    Err(BankError::Claim(error)) if persist => {
                        figures.saw(&error);
                        conn = connect_patiently(args.text("url"), &mut figures);
                    }
                    Err(BankError::Claim(error)) => figures.check(false, format!("{from}->{to}: {error}")),
                }
            }
            figures
        })
    }

    /// Scenarios 10 and 11: bank worker processes transfer for the run time
    /// while this process keeps reading every balance in one statement.
    fn bank(ctx: &Ctx, method: &str) -> Figures {
        let accounts = 10;
        let (_db, url, pool) = bank_database(ctx, accounts);
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        let total = OPENING * accounts as i64;
        let running = Running::new();
        // Reads every balance until the run ends: the reads, and those that
        // did not add up.
        let keep_reading = |read: fn(&mut Conn) -> Vec<i64>| {
            let mut conn = pool.get().unwrap();
            let (mut reads, mut bad) = (0u64, Vec::new());
            while running.get() {
                let seen = read(&mut conn);
                if seen.iter().sum::<i64>() != total || seen.iter().any(|b| *b < 0) {
                    bad.push(format!("a reader saw {seen:?}"));
                }
                reads += 1;
                thread::sleep(Duration::from_millis(2));
            }
            (reads, bad)
        };
        let ((reads, bad_reads), plain) = thread::scope(|scope| {
            let reader = scope.spawn(|| keep_reading(consistent_balances));
            // MariaDB's plain reads are counted, not checked: they can see a
            // transfer half applied (the guide's section on MySQL and MariaDB).
            let plain_reader = (BACKEND == "mysql").then(|| {
                scope.spawn(|| keep_reading(|conn| accounts::table.select(accounts::balance).load(conn).unwrap()))
            });
            let stop_reader = running.stop_on_drop();
            let args = [
                ("url", url),
                ("method", method.to_owned()),
                ("accounts", accounts.to_string()),
                ("millis", ctx.run_time().as_millis().to_string()),
            ];
            for done in ctx.run_workers("bank", threads, processes, &args) {
                figures.absorb(&done);
            }
            drop(stop_reader);
            (reader.join().unwrap(), plain_reader.map(|plain| plain.join().unwrap()))
        });
        for bad in bad_reads {
            figures.check(false, bad);
        }
        check_ledger(&mut pool.get().unwrap(), &mut figures, accounts, true);
        let per_success = figures.retries as f64 / figures.ops.max(1) as f64;
        figures.note(format!("full reads: {reads}; retries per transfer: {per_success:.3}"));
        if let Some((plain_reads, half_applied)) = plain {
            figures.note(format!("plain reads that saw a transfer half applied: {} of {plain_reads}", half_applied.len()));
        }
        figures
    }

    /// Every balance must be its opening plus the ledger's credits minus its
    /// debits (a lost update breaks this), and the ledger must hold one entry
    /// per transfer reported; not `exact`, at least one (a transfer whose
    /// commit was cut off may have committed unreported, but none reported
    /// may be missing).
    pub fn check_ledger(conn: &mut Conn, figures: &mut Figures, accounts: usize, exact: bool) {
        let mut expected = vec![OPENING; accounts];
        let entries: Vec<(i32, i32, i64)> = ledger::table
            .select((ledger::from_id, ledger::to_id, ledger::amount))
            .load(conn)
            .unwrap();
        for (from, to, amount) in &entries {
            expected[*from as usize - 1] -= amount;
            expected[*to as usize - 1] += amount;
        }
        let balances: Vec<i64> = accounts::table.order(accounts::id).select(accounts::balance).load(conn).unwrap();
        figures.check(balances == expected, format!("lost updates: balances {balances:?}, ledger says {expected:?}"));
        figures.check(balances.iter().all(|b| *b >= 0), format!("negative balance: {balances:?}"));
        let entries = entries.len() as u64;
        figures.check(
            if exact { entries == figures.ops } else { entries >= figures.ops },
            format!("{entries} ledger entries for {} transfers", figures.ops),
        );
    }

    /// Scenario 10.
    pub fn pessimistic_bank(ctx: &Ctx) -> Figures {
        bank(ctx, "locked")
    }

    /// Scenario 11.
    pub fn optimistic_bank(ctx: &Ctx) -> Figures {
        bank(ctx, "optimistic")
    }

    /// Scenario 12: `threads` × `increments` versioned increments of one
    /// counter, retried on conflicts, end at exactly their product.
    pub fn counter(ctx: &Ctx) -> Figures {
        let rounds: &[(usize, usize)] = match ctx.scale {
            Scale::Light => &[(25, 5)],
            Scale::Heavy => &[(25, 5), (100, 100)],
        };
        let mut figures = Figures::new(rounds.iter().map(|r| r.0).max().unwrap(), 1);
        for &(threads, increments) in rounds {
            // PostgreSQL allows 100 connections by default: threads share them.
            let (_db, pool) = test_db(threads.min(40) as u32);
            seed_accounts(&mut pool.get().unwrap(), &[0]);
            let start = Barrier::new(threads);
            figures.merge(in_threads(threads, |_| {
                let mut figures = Figures::default();
                start.wait();
                for _ in 0..increments {
                    let mut conn = pool.get().unwrap();
                    let incremented = counted_retry(&mut *conn, &mut figures, |conn| {
                        let counter = read(conn, 1)?;
                        accounts::table
                            .find(1)
                            .update_versioned(accounts::version, counter.version, accounts::balance.eq(counter.balance + 1))
                            .execute(conn)
                    });
                    match incremented {
                        Ok(_) => figures.ops += 1,
                        Err(error) => figures.check(false, error),
                    }
                }
                figures
            }));
            let end = read(&mut pool.get().unwrap(), 1).unwrap();
            let expected = (threads * increments) as i64;
            figures.check(end.balance == expected, format!("{threads}×{increments}: counter at {}", end.balance));
            figures.note(format!("{threads}×{increments} = {}", end.balance));
        }
        figures
    }

    /// Scenario 13: more withdrawals of 100 than a balance of 300 allows, all
    /// at once, pausing between read and write: exactly three go through, the
    /// others are refused with the domain's error; with locks, then optimistic.
    pub fn overdraw_race(ctx: &Ctx) -> Figures {
        let threads = ctx.scale.pick(8, 64);
        let mut figures = Figures::new(threads, 1);
        for method in [Method::Locked, Method::Optimistic] {
            let (_db, pool) = test_db(threads as u32);
            seed_accounts(&mut pool.get().unwrap(), &[300]);
            let start = Barrier::new(threads);
            let round = in_threads(threads, |_| {
                let mut conn = pool.get().unwrap();
                let mut figures = Figures::default();
                start.wait();
                let withdrawn = match method {
                    Method::Locked => accounts::table.find(1).with_lock(&mut *conn, |conn, account: Account| {
                        withdraw(conn, account)
                    }),
                    Method::Optimistic => counted_retry(&mut *conn, &mut figures, |conn| {
                        let account = read(conn, 1)?;
                        withdraw(conn, account)
                    }),
                };
                match withdrawn {
                    Ok(()) => figures.ops += 1,
                    Err(BankError::Insufficient) => figures.count_error("Insufficient"),
                    Err(BankError::Claim(error)) => figures.check(false, error),
                }
                figures
            });
            let balance = read(&mut pool.get().unwrap(), 1).unwrap().balance;
            figures.check(round.ops == 3 && balance == 0, format!("{method:?}: {} withdrawals went through, balance {balance}", round.ops));
            figures.merge(round);
        }
        figures
    }

    /// Withdraws 100 from `account` as read (under a lock, or by version).
    fn withdraw(conn: &mut Conn, account: Account) -> Result<(), BankError> {
        if account.balance < 100 {
            return Err(BankError::Insufficient);
        }
        thread::sleep(Duration::from_millis(2));
        accounts::table
            .find(account.id)
            .update_versioned(accounts::version, account.version, accounts::balance.eq(account.balance - 100))
            .execute(conn)?;
        Ok(())
    }

    /// Scenario 15, on `repeats` accounts: a stale update fails and keeps
    /// failing; a deleted row is not found; an empty change is refused without
    /// a bump; the largest version cannot be bumped. Never `Ok`.
    pub fn optimistic_edge_cases(ctx: &Ctx) -> Figures {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        let conn: &mut Conn = &mut conn;
        let count = ctx.repeats();
        seed_accounts(conn, &vec![OPENING; count]);
        let mut figures = Figures::new(1, 1);
        for id in 1..=count as i32 {
            accounts::table.find(id).update_versioned(accounts::version, 0, accounts::balance.eq(1)).execute(conn).unwrap();
            let mut attempts = 0;
            let stale = retry(conn, RetryPolicy::attempts(5), |conn| {
                attempts += 1;
                accounts::table.find(id).update_versioned(accounts::version, 0, accounts::balance.eq(2)).execute(conn)
            });
            expect_error(&mut figures, "stale", stale, |e| matches!(e, Error::VersionConflict { expected: 0, actual: Some(1), .. }));
            figures.retries += attempts - 1;

            let empty: Option<diesel::dsl::Eq<accounts::balance, i64>> = None;
            let refused = accounts::table.find(id).update_versioned(accounts::version, 1, empty).execute(conn);
            expect_error(&mut figures, "empty change", refused, |e| matches!(e, Error::InvalidArgument(_)));
            figures.check(read(conn, id).unwrap().version == 1, "an empty change bumped the version");

            diesel::update(accounts::table.find(id)).set(accounts::version.eq(i32::MAX)).execute(conn).unwrap();
            let overflow = accounts::table.find(id).update_versioned(accounts::version, i32::MAX, accounts::balance.eq(3)).execute(conn);
            expect_error(&mut figures, "overflow", overflow, |e| matches!(e, Error::VersionOverflow(_)));

            diesel::delete(accounts::table.find(id)).execute(conn).unwrap();
            let gone = accounts::table.find(id).update_versioned(accounts::version, 0, accounts::balance.eq(4)).execute(conn);
            expect_error(&mut figures, "deleted", gone, |e| matches!(e, Error::NotFound));
            figures.ops += 4;
        }
        figures
    }

    fn expect_error<T: std::fmt::Debug>(
        figures: &mut Figures,
        case: &str,
        result: Result<T, Error>,
        expected: impl Fn(&Error) -> bool,
    ) {
        match &result {
            Err(error) if expected(error) => figures.saw(error),
            _ => figures.check(false, format!("{case}: {result:?}")),
        }
    }
}
