//! A queue's ring of partitions, created and rotated on a diesel-async
//! connection: the async twin of [`crate::ring`].

use std::future::Future;
use std::time::Duration;

use diesel::pg::Pg;
use diesel_async::{AsyncConnection, RunQueryDsl};
use scoped_futures::ScopedFutureExt;

use super::transaction::{locking_transaction, transaction_depth};
use crate::locking::IdleBound;
use crate::ring::{Ring, Rotation};
use crate::Error;

/// How long a ring's transaction may sit idle. Its statements follow each
/// other with nothing awaited between them; a future dropped in between
/// sends its `ROLLBACK` at once, and this ends the transaction, and the
/// partitions' locks that hold every take of the queue back, should that
/// `ROLLBACK` not leave.
const RING_IDLE_BOUND: IdleBound = IdleBound(Some(Duration::from_secs(5)));

/// A ring's creation and rotation on a diesel-async connection, in
/// [`aio::prelude`](super::prelude): the same as the blocking
/// [`RingDsl`](crate::ring::RingDsl)'s, awaited.
///
/// ```no_run
/// use diesel_async::AsyncPgConnection;
/// use diesel_claim::aio::prelude::*;
/// use diesel_claim::ring::Ring;
///
/// async fn keep_the_ring(conn: &mut AsyncPgConnection) -> Result<(), diesel_claim::Error> {
///     let ring = Ring::new("jobs");
///     ring.create(conn).await?;
///     let mut every = tokio::time::interval(std::time::Duration::from_secs(1));
///     loop {
///         every.tick().await;
///         ring.rotate(conn).await?;
///     }
/// }
/// ```
pub trait RingDsl {
    /// Creates what the ring needs beside your table: see
    /// [`crate::ring::RingDsl::create`].
    fn create<C>(&self, conn: &mut C) -> impl Future<Output = Result<(), Error>> + Send
    where
        C: AsyncConnection<Backend = Pg>;

    /// Truncates the slots whose jobs are done: see
    /// [`crate::ring::RingDsl::rotate`].
    fn rotate<C>(&self, conn: &mut C) -> impl Future<Output = Result<Rotation, Error>> + Send
    where
        C: AsyncConnection<Backend = Pg>;
}

impl RingDsl for Ring {
    fn create<C>(&self, conn: &mut C) -> impl Future<Output = Result<(), Error>> + Send
    where
        C: AsyncConnection<Backend = Pg>,
    {
        async move {
            self.check()?;
            locking_transaction(conn, RING_IDLE_BOUND, |conn| {
                async move {
                    conn.batch_execute(&self.taking_turns()).await?;
                    self.check_partitioning(self.partitioning().load(conn).await?)?;
                    conn.batch_execute(&self.creation()).await?;
                    Ok(())
                }
                .scope_boxed()
            })
            .await
        }
    }

    fn rotate<C>(&self, conn: &mut C) -> impl Future<Output = Result<Rotation, Error>> + Send
    where
        C: AsyncConnection<Backend = Pg>,
    {
        async move {
            self.check_rotation(transaction_depth(conn)?)?;
            let found = self.survey(self.surveying(self.all_slots()).load(conn).await?);
            if found.drained.is_empty() {
                return Ok(found.rotation());
            }
            let locked = locking_transaction(conn, RING_IDLE_BOUND, |conn| {
                let found = &found;
                async move {
                    conn.batch_execute(&self.locking(&found.drained)).await?;
                    let surveyed = self.surveying(found.drained.iter().copied());
                    let under_lock = self.survey(surveyed.load(conn).await?);
                    let (moved, truncating) = if under_lock.jobs > 0 {
                        let moved_to = self.moving(&under_lock.drained).load(conn).await?;
                        self.moved(moved_to, &under_lock.drained)
                    } else {
                        (0, under_lock.drained.clone())
                    };
                    if !truncating.is_empty() {
                        conn.batch_execute(&self.truncating(&truncating)).await?;
                    }
                    Ok(under_lock.truncated(&truncating, moved))
                }
                .scope_boxed()
            })
            .await;
            found.rotated(locked)
        }
    }
}
