//! The transaction a claim or a row lock runs in.

use std::panic::{self, AssertUnwindSafe};

use diesel::connection::{Connection, TransactionManager};

use crate::backend::ClaimBackend;
use crate::Error;

/// Runs `body` in a transaction opened by the backend's locking strategy; commits
/// on `Ok`, rolls back on `Err`.
///
/// Unlike `Connection::transaction`, a panic in `body` also rolls back before it
/// resumes unwinding, so the connection is left with no open transaction and no
/// lock held, whether or not the caller catches the panic.
pub(crate) fn locking_transaction<C, T, E>(
    conn: &mut C,
    body: impl FnOnce(&mut C) -> Result<T, E>,
) -> Result<T, E>
where
    C: Connection,
    C::Backend: ClaimBackend,
    E: From<Error>,
{
    <C::Backend as crate::backend::strategy::Strategy>::begin_locking_transaction(conn)
        .map_err(Error::from)?;
    match panic::catch_unwind(AssertUnwindSafe(|| body(&mut *conn))) {
        Ok(Ok(value)) => {
            C::TransactionManager::commit_transaction(conn).map_err(Error::from)?;
            Ok(value)
        }
        Ok(Err(error)) => {
            // The body's error is the one to report: a rollback that fails too
            // (a broken connection, say) leaves the transaction manager in its
            // error state, which the next use of the connection reports.
            let _ = C::TransactionManager::rollback_transaction(conn);
            Err(error)
        }
        Err(payload) => {
            // The rollback's own failure cannot be reported past a panic; the pool
            // discards a connection left in a transaction in any case.
            let _ = C::TransactionManager::rollback_transaction(conn);
            panic::resume_unwind(payload)
        }
    }
}
