//! The transaction a claim, a row lock or a lease step runs in, on a
//! diesel-async connection: the async twin of `crate::transaction`.

use std::panic;

use std::num::NonZeroU32;
use std::time::Instant;

use diesel::connection::{InstrumentationEvent, TransactionDepthChange};
use diesel_async::{AsyncConnection, TransactionManager};
use futures_util::FutureExt;
use scoped_futures::{ScopedBoxFuture, ScopedFutureExt};

use super::backend::AsyncBackend;
use super::unwind::catch_unwind;
use crate::claim::Options;
use crate::locking::IdleBound;
use crate::{trace, Error};

impl Options {
    /// The idle bound of the claim's transactions on diesel-async: the one
    /// chosen; else 30 s above the claim's timeout; else none for a worker,
    /// whose jobs may run for as long as they take (a bound below a job
    /// ends its session while it runs, and another worker starts it again);
    /// else the default, [`IDLE_TRANSACTION_BOUND`](crate::aio::IDLE_TRANSACTION_BOUND).
    pub(crate) fn idle_bound(&self) -> IdleBound {
        if let Some(chosen) = self.lock.chosen_bound() {
            return chosen;
        }
        match self.timeout {
            Some(timeout) => IdleBound(Some(timeout + super::IDLE_TRANSACTION_BOUND)),
            None if self.in_worker => IdleBound(None),
            None => IdleBound::default(),
        }
    }
}

/// How many transactions deep the connection is.
pub(crate) fn transaction_depth<C: AsyncConnection>(conn: &mut C) -> Result<u32, Error> {
    let status = C::TransactionManager::transaction_manager_status_mut(conn);
    Ok(crate::transaction::depth(status)?)
}

/// Runs `body` in a transaction; commits on `Ok`, rolls back on `Err` and on a
/// panic (then resumes it), like the blocking `locking_transaction`. PostgreSQL
/// and MySQL need no lock up front: a plain `BEGIN`, with the idle bound.
///
/// If the future is dropped before the transaction ends, it sends
/// `ROLLBACK` without awaiting it (at the top level), and the connection's
/// transaction manager is left marked broken: see the module documentation.
pub(crate) async fn locking_transaction<'a, C, T, E, F>(
    conn: &mut C,
    bound: IdleBound,
    body: F,
) -> Result<T, E>
where
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    F: for<'c> FnOnce(&'c mut C) -> ScopedBoxFuture<'a, 'c, Result<T, E>> + Send,
    T: Send,
    E: From<Error> + Send,
{
    // The transaction itself is compiled once per connection type, not once
    // per body: the body's outcome goes through `outcome`, and the
    // transaction sees only whether it succeeded.
    let mut outcome = None;
    let slot = &mut outcome;
    let ended = transaction(
        conn,
        bound,
        Box::new(move |conn| {
            async move {
                let result = body(conn).await;
                let succeeded = result.is_ok();
                *slot = Some(result);
                succeeded
            }
            .scope_boxed()
        }),
    )
    .await;
    match ended {
        Ok(()) => outcome.expect("a transaction that ended ran its body"),
        Err(error) => Err(error.into()),
    }
}

/// A transaction's body, as [`transaction`] runs it: whether it succeeded.
type Body<'s, C> = Box<dyn for<'c> FnOnce(&'c mut C) -> ScopedBoxFuture<'s, 'c, bool> + Send + 's>;

/// Runs `body` in a transaction, as [`locking_transaction`] describes: `Ok`
/// when the body's own outcome stands (it succeeded and the transaction
/// committed, or it failed and the transaction rolled back), or the crate's
/// error that ended the transaction instead (it could not begin, or commit,
/// or the idle bound ended its session).
async fn transaction<C>(conn: &mut C, bound: IdleBound, body: Body<'_, C>) -> Result<(), Error>
where
    C: AsyncConnection,
    C::Backend: AsyncBackend,
{
    let depth = transaction_depth(conn)?;
    // Until the transaction has ended, a dropped future leaves `open` to end
    // it and mark the connection broken.
    let mut open = OpenTransaction {
        conn: Some(conn),
        top_level: depth == 0,
    };
    if let Err(error) = begin(open.conn(), depth, bound).await {
        // `begin` leaves no transaction open, or marks the connection broken.
        open.close();
        return Err(error);
    }
    let began = Instant::now();
    let ended = match catch_unwind(body(open.conn())).await {
        Ok(true) => match C::TransactionManager::commit_transaction(open.conn()).await {
            Ok(()) => Ok(()),
            Err(error) => Err(idle_bound_ended(open.conn(), depth, bound, began)
                .await
                .unwrap_or_else(|| Error::from(error))),
        },
        Ok(false) => {
            if roll_back_to(open.conn(), depth).await {
                Ok(())
            } else {
                let ended = idle_bound_ended(open.conn(), depth, bound, began).await;
                ended.map_or(Ok(()), Err)
            }
        }
        Err(payload) => {
            roll_back_to(open.conn(), depth).await;
            open.close();
            panic::resume_unwind(payload)
        }
    };
    open.close();
    ended
}

/// A transaction's depth at the top level.
const TOP_LEVEL: NonZeroU32 = NonZeroU32::MIN;

/// Whether a transaction that ran longer than its idle bound failed because
/// the server ended its session for sitting idle: then the error that says
/// so. Asked only once the transaction could not be ended normally at the top
/// level, it costs a round trip then, to see whether the session is gone.
async fn idle_bound_ended<C>(
    conn: &mut C,
    depth: u32,
    IdleBound(bound): IdleBound,
    began: Instant,
) -> Option<Error>
where
    C: AsyncConnection,
{
    let bound = bound?;
    let open_for = began.elapsed();
    if depth > 0 || open_for < bound || conn.batch_execute("SELECT 1").await.is_ok() {
        return None;
    }
    let error = Error::IdleBoundExceeded { bound, open_for };
    trace::warning!(%error, "a transaction's session was ended by its idle bound");
    Some(error)
}

/// Begins a transaction at `depth`. At the top level it is `BEGIN` with the
/// bound on how long the transaction may sit idle (the backstop for a
/// dropped future whose `ROLLBACK` could not leave), in one round trip,
/// after which the transaction manager counts the transaction, and its
/// instrumentation sees it begin, as with the manager's own `BEGIN`.
async fn begin<C>(conn: &mut C, depth: u32, IdleBound(bound): IdleBound) -> Result<(), Error>
where
    C: AsyncConnection,
    C::Backend: AsyncBackend,
{
    if depth > 0 {
        return Ok(C::TransactionManager::begin_transaction(conn).await?);
    }
    conn.instrumentation()
        .on_connection_event(InstrumentationEvent::begin_transaction(TOP_LEVEL));
    if let Err(error) = conn.batch_execute(&C::Backend::begin(bound)).await {
        // The `BEGIN` may have run and the bound failed: end it, or, if that
        // fails too, leave nothing to run in it.
        if conn.batch_execute("ROLLBACK").await.is_err() {
            C::TransactionManager::transaction_manager_status_mut(conn).set_in_error();
        }
        return Err(error.into());
    }
    let status = C::TransactionManager::transaction_manager_status_mut(conn);
    Ok(status
        .transaction_state()?
        .change_transaction_depth(TransactionDepthChange::IncreaseDepth)?)
}

/// Rolls back every transaction level above `depth`, stopping at the first
/// rollback that fails (which leaves the transaction manager in its error
/// state); whether it got back to `depth`.
pub(crate) async fn roll_back_to<C: AsyncConnection>(conn: &mut C, depth: u32) -> bool {
    loop {
        match transaction_depth(conn) {
            Ok(current) if current > depth => {
                if C::TransactionManager::rollback_transaction(conn)
                    .await
                    .is_err()
                {
                    return false;
                }
            }
            Ok(_) => return true,
            Err(_) => return false,
        }
    }
}

/// A transaction begun and not yet ended. Dropped before
/// [`close`](Self::close) — its future was dropped mid-transaction — it sends
/// `ROLLBACK` without waiting for its answer (at the top level only: a
/// savepoint's rollback belongs to the caller's transaction), and marks the
/// connection's transaction manager broken, so that the caller's transaction
/// refuses to go on and pools discard the connection.
struct OpenTransaction<'c, C: AsyncConnection> {
    /// `None` once closed.
    conn: Option<&'c mut C>,
    top_level: bool,
}

impl<'c, C: AsyncConnection> OpenTransaction<'c, C> {
    fn conn(&mut self) -> &mut C {
        self.conn.as_deref_mut().expect("the transaction is open")
    }

    /// The transaction has ended: nothing to mark.
    fn close(mut self) {
        self.conn = None;
    }
}

impl<C: AsyncConnection> Drop for OpenTransaction<'_, C> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.as_deref_mut() {
            if self.top_level {
                // Polled once, the statement is on its way: PostgreSQL's
                // connection queues it for its own task, MySQL's writes it to
                // the socket, both behind whatever statement is in flight.
                // Its answer is not waited for; should it not leave, the idle
                // bound ends the transaction.
                let _ = conn.batch_execute("ROLLBACK").now_or_never();
            }
            C::TransactionManager::transaction_manager_status_mut(conn).set_in_error();
        }
    }
}
