//! The async API's backends: PostgreSQL and MySQL, running the lease
//! statements of `crate::backend` on diesel-async connections.

use std::future::Future;

use diesel_async::{AsyncConnection, RunQueryDsl};

use crate::backend::LeaseStatement;

/// A backend the async API runs on: PostgreSQL and MySQL. (SQLite claims need
/// `BEGIN IMMEDIATE`, which diesel-async's transactions do not send.) Sealed.
#[diagnostic::on_unimplemented(
    message = "diesel-claim's async API does not support the backend `{Self}`",
    note = "the async API runs on PostgreSQL and MySQL (features `postgres`, `mysql`)"
)]
pub trait AsyncBackend: crate::ClaimBackend {
    /// Runs one lease statement; `Some(token)` when it took effect.
    #[doc(hidden)]
    fn run<C>(
        conn: &mut C,
        statement: LeaseStatement<'_>,
    ) -> impl Future<Output = diesel::QueryResult<Option<i64>>> + Send
    where
        C: AsyncConnection<Backend = Self>;
}

#[cfg(feature = "postgres")]
impl AsyncBackend for diesel::pg::Pg {
    async fn run<C>(conn: &mut C, statement: LeaseStatement<'_>) -> diesel::QueryResult<Option<i64>>
    where
        C: AsyncConnection<Backend = Self>,
    {
        use crate::backend::pg::{acquire, expire};
        use diesel::OptionalExtension;

        match statement {
            LeaseStatement::Acquire { name, ttl_micros } => {
                acquire(name, ttl_micros).get_result(conn).await
            }
            LeaseStatement::Expire {
                name,
                token,
                after_micros,
            } => expire(name, token, after_micros).get_result(conn).await,
        }
        .optional()
    }
}

#[cfg(feature = "mysql")]
impl AsyncBackend for diesel::mysql::Mysql {
    fn run<C>(
        conn: &mut C,
        statement: LeaseStatement<'_>,
    ) -> impl Future<Output = diesel::QueryResult<Option<i64>>> + Send
    where
        C: AsyncConnection<Backend = Self>,
    {
        use crate::backend::mysql::{
            expire, insert_new, inserted, owned, take_expired, token_of, took_expired,
            READ_COMMITTED,
        };
        use scoped_futures::ScopedFutureExt;

        // The blocking driver's steps: see `backend/mysql.rs`.
        async move {
            let (name, ttl_micros) = match statement {
                LeaseStatement::Acquire { name, ttl_micros } => (name, ttl_micros),
                LeaseStatement::Expire {
                    name,
                    token,
                    after_micros,
                } => {
                    let rows = expire(name, token, after_micros).execute(conn).await?;
                    return Ok(owned(rows, token));
                }
            };
            conn.batch_execute(READ_COMMITTED).await?;
            super::transaction::locking_transaction(conn, |conn| {
                async move {
                    if took_expired(take_expired(name, ttl_micros).execute(conn).await?) {
                        return Ok(Some(token_of(name).get_result(conn).await?));
                    }
                    let rows = insert_new(name, ttl_micros).execute(conn).await?;
                    Ok::<_, crate::Error>(inserted(rows))
                }
                .scope_boxed()
            })
            .await
            .map_err(diesel::result::Error::from)
        }
    }
}
