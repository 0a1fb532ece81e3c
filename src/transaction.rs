//! The transaction a claim or a row lock runs in, on a blocking connection;
//! and how deep a connection's transactions are, which both APIs read.

use std::panic::{self, AssertUnwindSafe};

use diesel::connection::{
    CacheSize, Connection, LoadConnection, TransactionManager, TransactionManagerStatus,
};
use diesel::QueryResult;

use crate::backend::{strategy::Strategy, ClaimBackend};
use crate::error::moved_to_another_partition;
use crate::trace;
use crate::Error;

/// How often a transaction is run again, at most, after its locking read met
/// a row moved to another partition (see [`locking_read`]). Each time is
/// another transaction's commit that moved a row out of the read's range.
pub(crate) const MOVED_ROW_RETRIES: u32 = 100;

/// A locking read's result, recording in `moved` whether it failed on a row a
/// concurrent transaction moved to another partition (PostgreSQL, SQLSTATE
/// `40001`). The read's transaction is then worth running again: the row no
/// longer matches in the partition it was read in, and a fresh read passes it
/// over, as it passes over any row that stopped matching. Nothing of the
/// caller's has run yet, as the locking read comes first.
pub(crate) fn locking_read<T>(read: QueryResult<T>, moved: &mut bool) -> Result<T, Error> {
    read.map_err(|error| {
        *moved = moved_to_another_partition(&error);
        Error::from(error)
    })
}

/// How a transaction ended, for its span: it commits on `Ok`.
pub(crate) fn transaction_outcome<T, E>(result: &Result<T, E>) -> &'static str {
    match result {
        Ok(_) => "committed",
        Err(_) => "rolled back",
    }
}

/// Runs `attempt` (a transaction whose locking read goes through
/// [`locking_read`]) again while it fails on a moved row, up to
/// [`MOVED_ROW_RETRIES`] times.
pub(crate) fn again_if_moved<T, E>(
    mut attempt: impl FnMut(&mut bool) -> Result<T, E>,
) -> Result<T, E> {
    for again in 1..=MOVED_ROW_RETRIES {
        let mut moved = false;
        match attempt(&mut moved) {
            Err(_) if moved => trace::moved_row(again),
            done => return done,
        }
    }
    attempt(&mut false)
}

/// How deep a transaction manager's nesting is (0: no transaction open). A
/// manager left in its error state (a rollback failed) is an error.
///
/// Diesel and diesel-async share the status type, so both APIs read it here.
pub(crate) fn depth(status: &mut TransactionManagerStatus) -> QueryResult<u32> {
    Ok(status.transaction_depth()?.map_or(0, |depth| depth.get()))
}

/// How deep the connection's transaction nesting is (0: none open).
pub(crate) fn transaction_depth<C: Connection>(conn: &mut C) -> QueryResult<u32> {
    depth(C::TransactionManager::transaction_manager_status_mut(conn))
}

/// Runs `body` in a transaction opened by the backend's locking strategy; commits
/// on `Ok`, rolls back on `Err`. With `nowait`, a backend whose transaction
/// takes a lock up front (SQLite's write lock) fails at once if it is held.
///
/// Unlike `Connection::transaction`, a panic in `body` also rolls back before it
/// resumes unwinding — every level `body` opened, since Diesel's own
/// `transaction` leaves its level open when a panic goes through it — so the
/// connection is left as it was, with no lock held, whether or not the caller
/// catches the panic.
pub(crate) fn locking_transaction<C, T, E>(
    conn: &mut C,
    nowait: bool,
    body: impl FnOnce(&mut C) -> Result<T, E>,
) -> Result<T, E>
where
    C: LoadConnection,
    C::Backend: ClaimBackend,
    E: From<Error>,
{
    let depth = transaction_depth(conn).map_err(Error::from)?;
    C::Backend::begin_locking_transaction(conn, depth, nowait).map_err(Error::from)?;
    match panic::catch_unwind(AssertUnwindSafe(|| body(&mut *conn))) {
        Ok(Ok(value)) => {
            C::TransactionManager::commit_transaction(conn).map_err(Error::from)?;
            Ok(value)
        }
        Ok(Err(error)) => {
            // The body's error is the one to report: a rollback that fails too
            // (a broken connection, say) leaves the transaction manager in its
            // error state, which the next use of the connection reports.
            roll_back_to(conn, depth);
            drop_stranded_statements(conn);
            Err(error)
        }
        Err(payload) => {
            // Nothing can be reported past a panic; a pool discards a connection
            // whose rollback failed, as it is still in a transaction.
            roll_back_to(conn, depth);
            drop_stranded_statements(conn);
            panic::resume_unwind(payload)
        }
    }
}

/// After a locking transaction failed, on a backend whose client cannot run
/// a statement again once a read of it failed partway (MySQL, MariaDB):
/// empties the connection's statement cache, closing every statement in it,
/// so that the next take prepares its statement afresh. Which statement
/// failed is not known here (the crate's locking read, or one of the
/// closure's); a failed transaction is rare beside the takes the cache
/// saves a prepare on. The cache is left on, whatever it was before.
fn drop_stranded_statements<C: Connection>(conn: &mut C)
where
    C::Backend: ClaimBackend,
{
    if C::Backend::FAILED_READS_STRAND_STATEMENTS {
        conn.set_prepared_statement_cache_size(CacheSize::Disabled);
        conn.set_prepared_statement_cache_size(CacheSize::Unbounded);
    }
}

/// Rolls back every transaction level above `depth`, stopping at the first
/// rollback that fails; whether it got back to `depth`.
pub(crate) fn roll_back_to<C: Connection>(conn: &mut C, depth: u32) -> bool {
    loop {
        match transaction_depth(conn) {
            Ok(current) if current > depth => {
                if C::TransactionManager::rollback_transaction(conn).is_err() {
                    return false;
                }
            }
            Ok(_) => return true,
            Err(_) => return false,
        }
    }
}
