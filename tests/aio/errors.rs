//! Errors as the crate names them, from async code: a session the server
//! ends under a claim is `Error::BrokenConnection` on PostgreSQL and
//! MariaDB, and a bb8 or deadpool pool that gives no connection is
//! `Error::Checkout`, which `?` converts its error into; a locking read that
//! fails partway leaves its connection able to claim again.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::sql_types::BigInt;
use diesel::{ExpressionMethods, QueryDsl};
use diesel_async::pooled_connection::{bb8, AsyncDieselConnectionManager};
use diesel_async::RunQueryDsl;
use diesel_claim::aio::prelude::*;
use diesel_claim::Error;

use testkit::fixtures::{orders, Order};

/// The orders whose email is not sent.
fn unsent() -> diesel::dsl::Filter<orders::table, diesel::dsl::Eq<orders::email_sent, bool>> {
    orders::table.filter(orders::email_sent.eq(false))
}

on_async_backends! {
    /// Ends session `id` from a connection of its own, as an administrator
    /// would: PostgreSQL's `pg_terminate_backend`, waiting up to 5 s for
    /// the session to end, MariaDB's `KILL`.
    fn end_session(url: &str, id: i64) {
        let end = if BACKEND == "pg" {
            testkit::sessions::terminate_and_wait_sql(id)
        } else {
            format!("KILL {id}")
        };
        blocking(url).batch_execute(&end).unwrap();
    }

    /// The server ends the session while a claim's closure works on its
    /// row: the closure's next statement (through `?`) and the claim fail
    /// with `BrokenConnection`, and so does the next claim on that
    /// connection; nothing was committed, and the row is still pending.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_ended_mid_claim_is_a_broken_connection() {
        let (db, pool) = test_db(2).await;
        let mut conn = pool.get().await.unwrap();
        diesel::insert_into(orders::table)
            .values(orders::shipped.eq(true))
            .execute(&mut *conn)
            .await
            .unwrap();
        let id = if BACKEND == "pg" { "CAST(pg_backend_pid() AS BIGINT)" } else { "CONNECTION_ID()" };
        let id: i64 = diesel::select(diesel::dsl::sql::<BigInt>(id)).get_result(&mut *conn).await.unwrap();
        let url = db.url.clone();
        let claimed = unsent()
            .claim_each(&mut *conn, async |conn: &mut Conn, order: Order| {
                let url = url.clone();
                tokio::task::spawn_blocking(move || end_session(&url, id)).await.unwrap();
                diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn).await?;
                Ok::<_, Error>(())
            })
            .await;
        let error = claimed.unwrap_err();
        assert!(matches!(error, Error::BrokenConnection(_)), "{error:?}");
        assert!(!error.is_transient());
        let again = unsent()
            .claim_each(&mut *conn, async |_: &mut Conn, _: Order| Ok::<_, Error>(()))
            .await;
        assert!(matches!(again, Err(Error::BrokenConnection(_))), "{again:?}");
        let pending: i64 = tokio::task::spawn_blocking(move || {
            diesel::RunQueryDsl::get_result(unsent().count(), &mut blocking(&db.url)).unwrap()
        })
        .await
        .unwrap();
        assert_eq!(pending, 1, "the ended session's write was committed");
    }

    /// A locking read that fails after sending some of its rows (a lock wait
    /// timeout at the third row) leaves the connection able to claim again,
    /// with the same statement: the async client reads the error as the end
    /// of the result set (the blocking MySQL client does not: see the
    /// blocking test of the same name).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_locking_read_that_fails_midway_leaves_the_connection_usable() {
        let (db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        let orders: Vec<_> = (0..4).map(|_| orders::shipped.eq(true)).collect();
        diesel::insert_into(orders::table).values(orders).execute(&mut *conn).await.unwrap();
        diesel::sql_query(SHORT_LOCK_WAIT).execute(&mut *conn).await.unwrap();
        let (locked_tx, locked_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let url = db.url.clone();
        let holder = std::thread::spawn(move || {
            let mut other = blocking(&url);
            other.batch_execute("BEGIN; SELECT * FROM orders WHERE id = 3 FOR UPDATE").unwrap();
            locked_tx.send(()).unwrap();
            let _ = release_rx.recv();
            other.batch_execute("COMMIT").unwrap();
        });
        locked_rx.recv().unwrap();
        async fn claim(conn: &mut Conn) -> Result<u64, Error> {
            let report = unsent()
                .build_claim()
                .wait()
                .batch(10)
                .each(conn, async |conn: &mut Conn, order: Order| {
                    diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn).await?;
                    Ok::<_, Error>(())
                })
                .await?;
            Ok(report.processed)
        }
        let failed = claim(&mut conn).await;
        assert!(matches!(failed, Err(Error::LockNotAvailable)), "{failed:?}");
        drop(release_tx);
        holder.join().unwrap();
        let again = tokio::time::timeout(Duration::from_secs(20), claim(&mut conn)).await;
        assert_eq!(again.expect("the second claim on the connection hung").unwrap(), 4);
    }
}

/// A URL no server answers on: loopback port 1.
#[cfg(all(feature = "postgres", any(feature = "bb8", feature = "deadpool")))]
const UNREACHABLE_PG: &str = "postgres://postgres@127.0.0.1:1/test";

/// A bb8 pool whose server cannot be reached gives no connection, and
/// `pool.get().await?` turns its error into `Error::Checkout`.
#[cfg(all(feature = "postgres", feature = "bb8"))]
#[tokio::test]
async fn an_unreachable_bb8_pool_is_a_checkout_error() {
    use diesel_async::AsyncPgConnection;

    async fn check_out(pool: &bb8::Pool<AsyncPgConnection>) -> Result<(), Error> {
        let _conn = pool.get().await?;
        Ok(())
    }

    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(UNREACHABLE_PG);
    let pool = bb8::Pool::builder()
        .connection_timeout(Duration::from_millis(300))
        .build_unchecked(manager);
    crate::errors::assert_checkout_from::<bb8::RunError>(&check_out(&pool).await.unwrap_err());
}

/// A deadpool pool whose server cannot be reached gives no connection, and
/// `pool.get().await?` turns its error into `Error::Checkout`.
#[cfg(all(feature = "postgres", feature = "deadpool"))]
#[tokio::test]
async fn an_unreachable_deadpool_pool_is_a_checkout_error() {
    use diesel_async::pooled_connection::deadpool;
    use diesel_async::AsyncPgConnection;

    async fn check_out(pool: &deadpool::Pool<AsyncPgConnection>) -> Result<(), Error> {
        let _conn = pool.get().await?;
        Ok(())
    }

    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(UNREACHABLE_PG);
    let pool = deadpool::Pool::builder(manager)
        .max_size(1)
        .build()
        .unwrap();
    crate::errors::assert_checkout_from::<deadpool::PoolError>(
        &check_out(&pool).await.unwrap_err(),
    );
}
