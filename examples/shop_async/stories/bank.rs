//! Part 2: transfers between accounts that never create or lose money, nor
//! overdraw: pessimistically (`with_locks`, then nested `with_lock`) and
//! optimistically (`update_versioned` + `aio::retry`).
//!
//! Every task makes random transfers among four accounts, so they collide all
//! the time. A transfer larger than the payer's balance is rejected with a
//! domain error, `ShopError::InsufficientFunds`, which rolls back and is not
//! retried. Transfers only move money, so the accounts must always hold what
//! they were opened with.

use std::ops::AddAssign;
use std::sync::atomic::{AtomicU64, Ordering};

use diesel::prelude::*;
use diesel_async::{AsyncConnection, RunQueryDsl};
use diesel_claim::aio::prelude::*;

use super::{run_workers, Conn, Pool};
use crate::common::bank::RETRY_POLICY;
use crate::schema::{accounts, Account};
use crate::{BoxError, Checks, Clock, Options, ShopError};

/// Few accounts and small balances: plenty of contention and overdrafts.
const ACCOUNTS: i32 = 4;
const OPENING_BALANCE: i64 = 100;
/// Transfers per task, in each round.
const TRANSFERS_PER_WORKER: u32 = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    WithLocks,
    WithLock,
    Versioned,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::WithLocks => "with_locks",
            Method::WithLock => "with_lock",
            Method::Versioned => "update_versioned",
        }
    }
}

pub async fn run(
    pool: &Pool,
    options: &Options,
    clock: Clock,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    println!("\nPart 2: transfers with with_locks, with_lock, then update_versioned + retry");
    let mut conn = pool.get().await?;
    open_accounts(&mut conn).await?;
    for method in [Method::WithLocks, Method::WithLock, Method::Versioned] {
        let tally = transfer_concurrently(pool, options.workers, method).await?;
        clock.log(format_args!(
            "{}: {} transfers ({} moved), {} overdrafts rejected, {} retries",
            method.name(),
            tally.transfers,
            tally.moved,
            tally.rejected,
            tally.attempts - tally.transfers - tally.rejected,
        ));
        check_money(&mut conn, method, checks).await?;
    }
    Ok(())
}

/// Pessimistic: both accounts are locked in one statement, then read, checked
/// and written. Other transfers touching either account wait for the locks, so
/// none acts on a stale balance.
async fn transfer_with_locks(
    conn: &mut Conn,
    from: i32,
    to: i32,
    amount: i64,
) -> Result<(), ShopError> {
    accounts::table
        .filter(accounts::id.eq_any([from, to]))
        // Rows are locked in the order they are read. Every transfer takes its
        // two in key order, so two transfers in opposite directions never hold
        // one each while waiting for the other: no deadlock.
        .order(accounts::id)
        .with_locks(conn, async |conn, locked| {
            let (payer, payee) = payer_and_payee(locked, from)?;
            pay(conn, &payer, &payee, amount).await
        })
        .await
}

/// Pessimistic, one row at a time: the second `with_lock` runs inside the
/// first one's transaction (as a savepoint), so both locks are held until the
/// outer transaction commits. Key order again, for the same reason.
async fn transfer_with_lock(
    conn: &mut Conn,
    from: i32,
    to: i32,
    amount: i64,
) -> Result<(), ShopError> {
    let (low, high) = (from.min(to), from.max(to));
    accounts::table
        .find(low)
        .with_lock(conn, async |conn, low: Account| {
            accounts::table
                .find(high)
                .with_lock(conn, async |conn, high: Account| {
                    let (payer, payee) = payer_and_payee(vec![low, high], from)?;
                    pay(conn, &payer, &payee, amount).await
                })
                .await
        })
        .await
}

/// Moves `amount` from `payer` to `payee`, both read under their locks.
async fn pay(
    conn: &mut Conn,
    payer: &Account,
    payee: &Account,
    amount: i64,
) -> Result<(), ShopError> {
    check_funds(payer, amount)?;
    for (account, change) in [(payer, -amount), (payee, amount)] {
        // The version is bumped here too: optimistic writers on the same table
        // must notice that a pessimistic one changed the row.
        diesel::update(account)
            .set((
                accounts::balance.eq(account.balance + change),
                accounts::version.eq(accounts::version + 1),
            ))
            .execute(conn)
            .await?;
    }
    Ok(())
}

/// Optimistic: read without locks, then write each account only if it is
/// still at the version read; on a conflict, read again and re-decide.
///
/// `attempts` counts every try, so the caller can report the retries.
async fn transfer_versioned(
    conn: &mut Conn,
    from: i32,
    to: i32,
    amount: i64,
    attempts: &mut u64,
) -> Result<(), ShopError> {
    // Counted through a shared reference: an `async` closure that changed
    // `attempts` itself could not promise its future `Send`.
    let tries = AtomicU64::new(0);
    let paid = diesel_claim::aio::retry(conn, RETRY_POLICY, async |conn| {
        tries.fetch_add(1, Ordering::Relaxed);
        pay_if_unchanged(conn, from, to, amount).await
    })
    .await;
    *attempts += tries.into_inner();
    paid
}

/// One attempt of `transfer_versioned`.
async fn pay_if_unchanged(
    conn: &mut Conn,
    from: i32,
    to: i32,
    amount: i64,
) -> Result<(), ShopError> {
    // No lock and no transaction: others may change the rows meanwhile.
    let read: Vec<Account> = accounts::table
        .filter(accounts::id.eq_any([from, to]))
        .order(accounts::id)
        .select(Account::as_select())
        .load(conn)
        .await?;
    let (payer, payee) = payer_and_payee(read, from)?;
    // Decided on what was read; the versioned updates make sure it still holds
    // when written. An overdraft is not transient: `retry` gives up at once.
    check_funds(&payer, amount)?;
    let mut changes = [(&payer, -amount), (&payee, amount)];
    // Updates lock rows too: key order, as with the pessimistic transfers.
    changes.sort_by_key(|(account, _)| account.id);
    // Both accounts or neither: a conflict on the second rolls back the first.
    conn.transaction(async |conn: &mut Conn| {
        for (account, change) in changes {
            // `UPDATE … SET balance = …, version = read + 1 WHERE id = … AND
            // version = read`. Zero rows is `Error::VersionConflict` (transient,
            // so `retry` tries again), never `Ok`.
            accounts::table
                .find(account.id)
                .update_versioned(
                    accounts::version,
                    account.version,
                    accounts::balance.eq(account.balance + change),
                )
                .execute(conn)
                .await?;
        }
        Ok::<_, ShopError>(())
    })
    .await
}

/// The two accounts of a transfer from `from`, as (payer, payee).
fn payer_and_payee(accounts: Vec<Account>, from: i32) -> Result<(Account, Account), ShopError> {
    let [a, b]: [Account; 2] = accounts
        .try_into()
        .map_err(|_| diesel_claim::Error::NotFound)?;
    Ok(if a.id == from { (a, b) } else { (b, a) })
}

/// The domain rule: no overdraft.
fn check_funds(payer: &Account, amount: i64) -> Result<(), ShopError> {
    if payer.balance < amount {
        return Err(ShopError::InsufficientFunds {
            account: payer.id,
            balance: payer.balance,
            amount,
        });
    }
    Ok(())
}

/// What the tasks did, in total.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    transfers: u64,
    moved: i64,
    rejected: u64,
    attempts: u64,
}

impl AddAssign for Tally {
    fn add_assign(&mut self, other: Tally) {
        self.transfers += other.transfers;
        self.moved += other.moved;
        self.rejected += other.rejected;
        self.attempts += other.attempts;
    }
}

async fn transfer_concurrently(
    pool: &Pool,
    workers: u32,
    method: Method,
) -> Result<Tally, BoxError> {
    let tallies = run_workers(pool, workers, |mut conn, worker| async move {
        // A different sequence per task and per round.
        let mut random = fastrand::Rng::with_seed(worker as u64 * 3 + method as u64 + 1);
        let mut tally = Tally::default();
        for _ in 0..TRANSFERS_PER_WORKER {
            let from = random.u64(..ACCOUNTS as u64) as i32 + 1;
            // Any account but `from`.
            let to = (from + random.u64(..ACCOUNTS as u64 - 1) as i32) % ACCOUNTS + 1;
            let amount = random.u64(..60) as i64 + 1;
            let outcome = match method {
                Method::WithLocks => {
                    tally.attempts += 1;
                    transfer_with_locks(&mut conn, from, to, amount).await
                }
                Method::WithLock => {
                    tally.attempts += 1;
                    transfer_with_lock(&mut conn, from, to, amount).await
                }
                Method::Versioned => {
                    transfer_versioned(&mut conn, from, to, amount, &mut tally.attempts).await
                }
            };
            match outcome {
                Ok(()) => {
                    tally.transfers += 1;
                    tally.moved += amount;
                }
                Err(ShopError::InsufficientFunds { .. }) => tally.rejected += 1,
                Err(error) => return Err(error.into()),
            }
        }
        Ok(tally)
    })
    .await?;
    let mut total = Tally::default();
    for tally in tallies {
        total += tally;
    }
    Ok(total)
}

/// Opens the accounts with their opening balance. Keys are chosen here rather
/// than returned by the insert: MySQL has no `RETURNING`.
async fn open_accounts(conn: &mut Conn) -> QueryResult<()> {
    let rows: Vec<_> = (1..=ACCOUNTS)
        .map(|id| (accounts::id.eq(id), accounts::balance.eq(OPENING_BALANCE)))
        .collect();
    diesel::insert_into(accounts::table)
        .values(&rows)
        .execute(conn)
        .await?;
    Ok(())
}

async fn check_money(conn: &mut Conn, method: Method, checks: &mut Checks) -> Result<(), BoxError> {
    let balances: Vec<i64> = accounts::table
        .order(accounts::id)
        .select(accounts::balance)
        .load(conn)
        .await?;
    let opening = OPENING_BALANCE * i64::from(ACCOUNTS);
    let total: i64 = balances.iter().sum();
    checks.check(
        &format!("money conserved ({})", method.name()),
        total == opening,
        format!("opened with {opening}, accounts hold {total}: {balances:?}"),
    );
    let lowest = balances.iter().copied().min().unwrap_or(0);
    checks.check(
        &format!("no negative balance ({})", method.name()),
        lowest >= 0,
        format!("lowest balance {lowest}"),
    );
    Ok(())
}
