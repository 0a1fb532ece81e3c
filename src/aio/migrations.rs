//! The crate's migrations, run from async code.

use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
use diesel_async::AsyncConnection;

use crate::backend::ClaimBackend;
use crate::Error;

/// Creates (or brings up to date) the crate's tables on `conn`'s database, as
/// [`crate::run_migrations`] does, from async code, and hands the connection
/// back.
///
/// Diesel's migrations are blocking: they run on diesel-async's
/// `AsyncConnectionWrapper` around `conn`, in a task of tokio's blocking
/// pool, so that the runtime's threads go on meanwhile (any runtime, the
/// current-thread one included). The connection moves into that task, so it
/// is one of its own (`AsyncPgConnection::establish`) or a pooled one that
/// owns its place in the pool: a deadpool `Object`, or bb8's `get_owned`. It
/// needs no blocking client library: this is the way to the crate's tables
/// with only `postgres_backend` or `mysql_backend`.
///
/// ```no_run
/// # #[cfg(feature = "postgres_backend")]
/// # async fn start(database_url: &str) -> Result<(), Box<dyn std::error::Error>> {
/// use diesel_async::{AsyncConnection, AsyncPgConnection};
/// use std::time::Duration;
///
/// let conn = AsyncPgConnection::establish(database_url).await?;
/// let mut conn = diesel_claim::aio::run_migrations(conn).await?;
/// // The lease table is there.
/// let lease = diesel_claim::aio::Lease::acquire(&mut conn, "nightly", Duration::from_secs(60)).await?;
/// # Ok(())
/// # }
/// ```
pub async fn run_migrations<C>(conn: C) -> Result<C, Error>
where
    C: AsyncConnection + 'static,
    C::Backend: ClaimBackend,
{
    let migrated = tokio::task::spawn_blocking(move || {
        let mut wrapped = AsyncConnectionWrapper::<C>::from(conn);
        crate::run_migrations(&mut wrapped).map(|()| wrapped.into_inner())
    });
    match migrated.await {
        Ok(migrated) => migrated,
        Err(failed) if failed.is_panic() => std::panic::resume_unwind(failed.into_panic()),
        // The runtime shut down before the task ran.
        Err(cancelled) => Err(Error::Migration(Box::new(cancelled))),
    }
}
