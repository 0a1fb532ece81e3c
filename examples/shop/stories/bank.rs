//! Part 2: deposits and withdrawals that never lose money, done twice, as in
//! the seed article: pessimistically (`with_lock`) and optimistically
//! (`update_versioned` + `retry`).
//!
//! Every worker books random deposits and withdrawals on a handful of accounts,
//! so they collide all the time. A withdrawal larger than the balance is
//! rejected with a domain error, `ShopError::InsufficientFunds`, which rolls
//! back and is not retried. Each booking also writes a ledger row in the same
//! transaction, so the checks can compare every balance with its history.

use std::ops::AddAssign;

use diesel::prelude::*;
use diesel_claim::prelude::*;

use super::{run_workers, Conn, Pool};
use crate::common::bank::RETRY_POLICY;
use crate::schema::{accounts, ledger, Account};
use crate::{BoxError, Checks, Clock, Options, ShopError};

/// Few accounts and small balances: plenty of contention and overdrafts.
const ACCOUNTS: [(&str, i64); 4] = [
    ("ada", 100),
    ("grace", 100),
    ("edsger", 100),
    ("barbara", 100),
];
/// Bookings per worker, in each of the two rounds.
const BOOKINGS_PER_WORKER: u32 = 250;

pub fn run(
    pool: &Pool,
    options: &Options,
    clock: Clock,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    println!("\nPart 2: bank accounts with with_lock, then update_versioned + retry");
    let mut conn = pool.get()?;
    let ids = open_accounts(&mut conn)?;
    let opening: i64 = ACCOUNTS.iter().map(|(_, balance)| balance).sum();
    let mut booked = Tally::default();

    for method in [Method::WithLock, Method::Versioned] {
        let tally = book_concurrently(pool, options.workers, &ids, method)?;
        clock.log(format_args!(
            "{}: {} deposits, {} withdrawals, {} overdrafts rejected, {} retries",
            method.name(),
            tally.deposits,
            tally.withdrawals,
            tally.rejected,
            tally.attempts - tally.bookings(),
        ));
        booked += tally;
        check_money(&mut conn, opening, &booked, method, checks)?;
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    WithLock,
    Versioned,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::WithLock => "with_lock",
            Method::Versioned => "update_versioned",
        }
    }
}

/// The seed's pessimistic `deposit` / `withdraw` in one: lock the account's row,
/// check, write. Other bookings on the same account wait for the lock (on
/// SQLite: for the database write lock), so none can act on a stale balance.
///
/// A negative `amount` is a withdrawal.
fn book_with_lock(conn: &mut Conn, account_id: i32, amount: i64) -> Result<i64, ShopError> {
    accounts::table
        .find(account_id)
        .with_lock(conn, |conn, account: Account| {
            // An `Err` here rolls the transaction back and releases the lock.
            let balance = balance_after(&account, amount)?;
            // The version is bumped here too: optimistic writers on the same
            // table must notice that a pessimistic one changed the row.
            diesel::update(&account)
                .set((
                    accounts::balance.eq(balance),
                    accounts::version.eq(accounts::version + 1),
                ))
                .execute(conn)?;
            record(conn, account.id, amount, Method::WithLock)?;
            Ok(balance)
        })
}

/// The seed's optimistic version: read without a lock, then write only if the
/// row is still at the version read; on a conflict, read again and re-decide.
///
/// `attempts` counts every try, so the caller can report the retries.
fn book_versioned(
    conn: &mut Conn,
    account_id: i32,
    amount: i64,
    attempts: &mut u64,
) -> Result<i64, ShopError> {
    diesel_claim::retry(conn, RETRY_POLICY, |conn| {
        *attempts += 1;
        // No lock and no transaction: others may change the row meanwhile.
        let account: Account = accounts::table.find(account_id).first(conn)?;
        // Decided on what was read; the versioned update below makes sure it is
        // still true when written. Overdrafts are not transient: not retried.
        let balance = balance_after(&account, amount)?;
        conn.transaction(|conn| {
            // `UPDATE … SET balance = $1, version = read + 1 WHERE id = $2 AND
            // version = read`. Zero rows is `Error::VersionConflict` (transient,
            // so `retry` tries again) or `Error::NotFound`, never `Ok`.
            accounts::table
                .find(account.id)
                .update_versioned(
                    accounts::version,
                    account.version,
                    accounts::balance.eq(balance),
                )
                .execute(conn)?;
            record(conn, account.id, amount, Method::Versioned)?;
            Ok(balance)
        })
    })
}

/// The balance after booking `amount`, or the domain error for an overdraft.
fn balance_after(account: &Account, amount: i64) -> Result<i64, ShopError> {
    match account.balance + amount {
        balance if balance >= 0 => Ok(balance),
        _ => Err(ShopError::InsufficientFunds {
            account: account.id,
            balance: account.balance,
            amount: -amount,
        }),
    }
}

fn record(conn: &mut Conn, account_id: i32, amount: i64, method: Method) -> QueryResult<()> {
    diesel::insert_into(ledger::table)
        .values((
            ledger::account_id.eq(account_id),
            ledger::amount.eq(amount),
            ledger::method.eq(method.name()),
        ))
        .execute(conn)?;
    Ok(())
}

/// What the workers booked, in total.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    deposits: u64,
    withdrawals: u64,
    deposited: i64,
    withdrawn: i64,
    rejected: u64,
    attempts: u64,
}

impl Tally {
    fn bookings(&self) -> u64 {
        self.deposits + self.withdrawals + self.rejected
    }
}

impl AddAssign for Tally {
    fn add_assign(&mut self, other: Tally) {
        self.deposits += other.deposits;
        self.withdrawals += other.withdrawals;
        self.deposited += other.deposited;
        self.withdrawn += other.withdrawn;
        self.rejected += other.rejected;
        self.attempts += other.attempts;
    }
}

fn book_concurrently(
    pool: &Pool,
    workers: u32,
    ids: &[i32],
    method: Method,
) -> Result<Tally, BoxError> {
    let tallies = run_workers(pool, workers, |conn, worker| {
        // A different sequence per worker and per round.
        let mut random = fastrand::Rng::with_seed(worker as u64 * 2 + method as u64 + 1);
        let mut tally = Tally::default();
        for _ in 0..BOOKINGS_PER_WORKER {
            let account = ids[random.u64(..ids.len() as u64) as usize];
            // -100 ..= 100, never 0.
            let amount = random.u64(..100) as i64 + 1;
            let amount = if random.u64(..2) == 0 {
                amount
            } else {
                -amount
            };
            let outcome = match method {
                Method::WithLock => {
                    tally.attempts += 1;
                    book_with_lock(conn, account, amount)
                }
                Method::Versioned => book_versioned(conn, account, amount, &mut tally.attempts),
            };
            match outcome {
                Ok(_) if amount > 0 => {
                    tally.deposits += 1;
                    tally.deposited += amount;
                }
                Ok(_) => {
                    tally.withdrawals += 1;
                    tally.withdrawn -= amount;
                }
                Err(ShopError::InsufficientFunds { .. }) => tally.rejected += 1,
                Err(error) => return Err(error.into()),
            }
        }
        Ok(tally)
    })?;
    let mut total = Tally::default();
    for tally in tallies {
        total += tally;
    }
    Ok(total)
}

/// Opens the accounts, each with a ledger row for its opening balance.
fn open_accounts(conn: &mut Conn) -> QueryResult<Vec<i32>> {
    conn.transaction(|conn| {
        let mut ids = Vec::new();
        // Keys chosen here rather than returned by the insert: MySQL has no
        // `RETURNING`.
        for (id, (owner, balance)) in (1..).zip(ACCOUNTS) {
            diesel::insert_into(accounts::table)
                .values((
                    accounts::id.eq(id),
                    accounts::owner.eq(owner),
                    accounts::balance.eq(balance),
                ))
                .execute(conn)?;
            diesel::insert_into(ledger::table)
                .values((
                    ledger::account_id.eq(id),
                    ledger::amount.eq(balance),
                    ledger::method.eq("opening"),
                ))
                .execute(conn)?;
            ids.push(id);
        }
        Ok(ids)
    })
}

fn check_money(
    conn: &mut Conn,
    opening: i64,
    booked: &Tally,
    method: Method,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    let accounts: Vec<Account> = accounts::table.order(accounts::id).load(conn)?;
    let entries: Vec<(i32, i64)> = ledger::table
        .select((ledger::account_id, ledger::amount))
        .load(conn)?;
    let total: i64 = accounts.iter().map(|account| account.balance).sum();
    let expected = opening + booked.deposited - booked.withdrawn;
    checks.check(
        &format!("money conserved ({})", method.name()),
        total == expected,
        format!(
            "{opening} + {} deposited - {} withdrawn = {expected}, accounts hold {total}",
            booked.deposited, booked.withdrawn
        ),
    );

    let lowest = accounts
        .iter()
        .map(|account| account.balance)
        .min()
        .unwrap_or(0);
    checks.check(
        &format!("no negative balance ({})", method.name()),
        lowest >= 0,
        format!("lowest balance {lowest}"),
    );

    let mismatched: Vec<i32> = accounts
        .iter()
        .filter(|account| {
            let history: i64 = entries
                .iter()
                .filter(|(id, _)| *id == account.id)
                .map(|(_, amount)| amount)
                .sum();
            history != account.balance
        })
        .map(|account| account.id)
        .collect();
    checks.check(
        &format!("balances match the ledger ({})", method.name()),
        mismatched.is_empty(),
        format!(
            "{} ledger rows, mismatched accounts {mismatched:?}",
            entries.len()
        ),
    );
    Ok(())
}
