//! The async API's backends: PostgreSQL and MySQL, running the lease
//! statements of `crate::backend` on diesel-async connections.

use std::future::Future;
use std::time::Duration;

use diesel_async::AsyncConnection;
#[cfg(any(feature = "postgres_backend", feature = "mysql_backend"))]
use diesel_async::RunQueryDsl;

use crate::backend::LeaseStatement;

/// A backend the async API runs on: PostgreSQL and MySQL. (SQLite claims need
/// `BEGIN IMMEDIATE`, which diesel-async's transactions do not send.) Sealed.
#[diagnostic::on_unimplemented(
    message = "diesel-claim's async API does not support the backend `{Self}`",
    note = "the async API runs on PostgreSQL and MySQL (features `postgres_backend`, \
            `mysql_backend`, or `postgres`, `mysql` which include them)"
)]
pub trait AsyncBackend: crate::ClaimBackend {
    /// `BEGIN`, and the bound on how long the transaction may sit idle
    /// (`None`: the session's own).
    #[doc(hidden)]
    fn begin(idle_bound: Option<Duration>) -> String;

    /// Runs one lease statement; `Some(token)` when it took effect.
    #[doc(hidden)]
    fn run<C>(
        conn: &mut C,
        statement: LeaseStatement<'_>,
    ) -> impl Future<Output = diesel::QueryResult<Option<i64>>> + Send
    where
        C: AsyncConnection<Backend = Self>;
}

#[cfg(feature = "postgres_backend")]
impl AsyncBackend for diesel::pg::Pg {
    // For this transaction only, in place of the session's own setting: a
    // `SET` costs next to nothing beside the `BEGIN`, in the same round trip.
    fn begin(idle_bound: Option<Duration>) -> String {
        match idle_bound {
            Some(bound) => format!(
                "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {}",
                bound.as_millis().max(1)
            ),
            None => "BEGIN".to_owned(),
        }
    }

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

#[cfg(feature = "mysql_backend")]
impl AsyncBackend for diesel::mysql::Mysql {
    // MariaDB (10.3 and later) only, in the executable comment; MySQL has no
    // such bound and sets a throwaway variable. The setting is the session's
    // and stays after the transaction, so the session's own is kept aside the
    // first time, and put back for a transaction without a bound. MariaDB
    // counts it in whole seconds.
    fn begin(idle_bound: Option<Duration>) -> String {
        // A user variable never set is a `NULL` string: the cast makes the
        // value a number either way.
        const SESSIONS_OWN: &str =
            "CAST(COALESCE(@diesel_claim_idle, @@idle_transaction_timeout) AS UNSIGNED)";
        let setting = match idle_bound {
            Some(bound) => format!(
                "@diesel_claim_idle = {SESSIONS_OWN}, SESSION idle_transaction_timeout = {}",
                bound.as_secs() + u64::from(bound.subsec_nanos() > 0)
            ),
            None => format!("SESSION idle_transaction_timeout = {SESSIONS_OWN}"),
        };
        format!("BEGIN; SET @diesel_claim_bound = 0 /*M!100300 , {setting} */")
    }

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
            let bound = crate::locking::IdleBound::default();
            super::transaction::locking_transaction(conn, bound, |conn| {
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

/// Connects to MySQL or MariaDB with the session at `READ COMMITTED`, as
/// claiming connections should be (see the guide's "MySQL and MariaDB"): a
/// pool's setup for every connection it opens, with diesel-async's bb8 or
/// deadpool pools.
///
/// ```no_run
/// # async fn pools(url: &str) {
/// use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
/// use diesel_async::AsyncMysqlConnection;
///
/// let mut config = ManagerConfig::default();
/// config.custom_setup = Box::new(diesel_claim::aio::establish_read_committed);
/// let manager = AsyncDieselConnectionManager::<AsyncMysqlConnection>::new_with_config(url, config);
/// let pool = diesel_async::pooled_connection::bb8::Pool::builder().build(manager).await;
/// # }
/// ```
#[cfg(feature = "mysql_backend")]
pub fn establish_read_committed(
    url: &str,
) -> futures_util::future::BoxFuture<'_, diesel::ConnectionResult<diesel_async::AsyncMysqlConnection>>
{
    use diesel_async::{AsyncConnection, SimpleAsyncConnection};
    use futures_util::FutureExt;

    async move {
        let mut conn = diesel_async::AsyncMysqlConnection::establish(url).await?;
        conn.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .await
            .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
        Ok(conn)
    }
    .boxed()
}

#[cfg(all(test, any(feature = "postgres_backend", feature = "mysql_backend")))]
mod tests {
    use std::time::Duration;

    use super::AsyncBackend;

    /// The statements bound idle transactions by the caller's bound, in the
    /// servers' units, or leave the session's own.
    #[test]
    fn the_begin_statements_set_the_callers_bound() {
        let bound = Some(Duration::from_millis(2_500));
        #[cfg(feature = "postgres_backend")]
        {
            use diesel::pg::Pg;
            assert!(Pg::begin(bound).ends_with("idle_in_transaction_session_timeout = 2500"));
            assert_eq!(Pg::begin(None), "BEGIN");
        }
        #[cfg(feature = "mysql_backend")]
        {
            use diesel::mysql::Mysql;
            assert!(Mysql::begin(bound).contains("SESSION idle_transaction_timeout = 3 */"));
            assert!(Mysql::begin(None).contains("= CAST(COALESCE(@diesel_claim_idle"));
        }
    }
}
