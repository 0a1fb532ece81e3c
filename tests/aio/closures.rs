//! The closures the async API takes, in each form an application writes them:
//! `async` closures (as diesel-async's `transaction` takes), `async move`
//! closures, `async fn`s passed by name, and closures that return a boxed
//! future (`.scope_boxed()`, through `scoped`); their futures spawned on tokio.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel::{ExpressionMethods, QueryDsl};
use diesel_async::pooled_connection::{bb8, AsyncDieselConnectionManager};
use diesel_async::RunQueryDsl;
use diesel_claim::aio::prelude::*;
use diesel_claim::aio::{retry, with_lease, Lease};
use diesel_claim::Error;
use testkit::fixtures::{accounts, orders, Account, Order};

use super::pending;

/// Fails to compile unless `future` is `Send`.
fn assert_send<T: Send>(future: T) -> T {
    future
}

on_async_backends! {
    async fn insert_pending(conn: &mut Conn, count: usize) {
        let rows = vec![(orders::shipped.eq(true),); count];
        diesel::insert_into(orders::table).values(rows).execute(conn).await.unwrap();
    }

    async fn mark_sent(conn: &mut Conn, order: Order) -> Result<(), Error> {
        diesel::update(orders::table.find(order.id))
            .set(orders::email_sent.eq(true))
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn left(conn: &mut Conn) -> i64 {
        pending().count().get_result(conn).await.unwrap()
    }

    /// `async` closures, their argument types inferred or written, per row
    /// and per batch, capturing state by reference.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn async_closures_claim_rows_and_batches() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        insert_pending(&mut conn, 6).await;
        let seen = AtomicUsize::new(0);
        let report = pending()
            .build_claim()
            .max_rows(3)
            .each(&mut *conn, async |conn, order: Order| {
                seen.fetch_add(1, Ordering::SeqCst);
                mark_sent(conn, order).await
            })
            .await
            .unwrap();
        assert_eq!((report.processed, AtomicUsize::load(&seen, Ordering::SeqCst)), (3, 3));

        let sizes = std::sync::Mutex::new(Vec::new());
        let report = pending()
            .build_claim()
            .batch(2)
            .each_batch(&mut *conn, async |conn: &mut Conn, orders: Vec<Order>| {
                sizes.lock().unwrap().push(orders.len());
                for order in orders {
                    mark_sent(conn, order).await?;
                }
                Ok::<_, Error>(())
            })
            .await
            .unwrap();
        assert_eq!(report.processed, 3);
        assert_eq!(sizes.into_inner().unwrap(), [2, 1]);
        assert_eq!(left(&mut conn).await, 0);
    }

    /// `async move` closures: a claim's captures references (its future
    /// borrows nothing of the closure); a row lock's, called once, owns
    /// what it captures.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn async_move_closures_capture_state() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        insert_pending(&mut conn, 4).await;
        let counter = Arc::new(AtomicUsize::new(0));
        let seen = &*counter;
        let report = pending()
            .claim_each(&mut *conn, async move |conn, order: Order| {
                seen.fetch_add(1, Ordering::SeqCst);
                mark_sent(conn, order).await
            })
            .await
            .unwrap();
        assert_eq!((report.processed, AtomicUsize::load(&counter, Ordering::SeqCst)), (4, 4));

        diesel::insert_into(accounts::table)
            .values((accounts::id.eq(1), accounts::balance.eq(10)))
            .execute(&mut *conn)
            .await
            .unwrap();
        let note = String::from("locked");
        let (noted, balance) = accounts::table
            .find(1)
            .with_lock(&mut *conn, async move |conn, account: Account| {
                diesel::update(accounts::table.find(account.id))
                    .set(accounts::balance.eq(account.balance + 5))
                    .execute(conn)
                    .await?;
                Ok::<_, Error>((note, account.balance + 5))
            })
            .await
            .unwrap();
        assert_eq!((noted.as_str(), balance), ("locked", 15));
    }

    /// An `async fn` passed by name, to a claim and to `retry`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_async_fn_passed_by_name() {
        async fn version_of_first(conn: &mut Conn) -> Result<i32, Error> {
            Ok(accounts::table.find(1).select(accounts::version).get_result(conn).await?)
        }

        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        insert_pending(&mut conn, 3).await;
        let report = pending().claim_each(&mut *conn, mark_sent).await.unwrap();
        assert_eq!(report.processed, 3);
        assert_eq!(left(&mut conn).await, 0);

        diesel::insert_into(accounts::table)
            .values((accounts::id.eq(1), accounts::balance.eq(10)))
            .execute(&mut *conn)
            .await
            .unwrap();
        let version = retry(&mut *conn, RetryPolicy::attempts(2), version_of_first).await;
        assert_eq!(version.unwrap(), 0);
    }

    /// Closures that return a boxed future: inline through `scoped`, which
    /// also lets a closure change its own state before its future; and a
    /// function returning one, by name.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn boxed_closures_through_scoped_and_by_name() {
        fn send<'c>(
            conn: &'c mut Conn,
            order: Order,
        ) -> scoped_futures::ScopedBoxFuture<'static, 'c, Result<(), Error>> {
            mark_sent(conn, order).scope_boxed()
        }

        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        insert_pending(&mut conn, 5).await;
        let mut ids = Vec::new();
        let report = pending()
            .build_claim()
            .max_rows(3)
            .each(&mut *conn, scoped(|conn, order: Order| {
                ids.push(order.id);
                async move { mark_sent(conn, order).await }.scope_boxed()
            }))
            .await
            .unwrap();
        assert_eq!((report.processed, ids.len()), (3, 3));

        let report = pending().claim_each(&mut *conn, send).await.unwrap();
        assert_eq!(report.processed, 2);

        diesel::insert_into(accounts::table)
            .values((accounts::id.eq(1), accounts::balance.eq(10)))
            .execute(&mut *conn)
            .await
            .unwrap();
        let balance = accounts::table
            .find(1)
            .with_lock(&mut *conn, scoped(|_, account: Account| {
                async move { Ok::<_, Error>(account.balance) }.scope_boxed()
            }))
            .await
            .unwrap();
        assert_eq!(balance, 10);
    }

    /// The futures of claims, row locks, leases and retries given `async`
    /// closures are `Send`: they run as spawned tasks.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn futures_with_async_closures_are_spawned() {
        let (_db, pool) = test_db(2).await;
        insert_pending(&mut pool.get().await.unwrap(), 4).await;
        let claimer = {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut conn = pool.get_owned().await.unwrap();
                let seen = AtomicUsize::new(0);
                let claim = pending().claim_each(&mut *conn, async |conn, order: Order| {
                    seen.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    mark_sent(conn, order).await
                });
                let report = assert_send(claim).await.unwrap();
                (report.processed, seen.into_inner())
            })
        };
        assert_eq!(claimer.await.unwrap(), (4, 4));

        let others = tokio::spawn(async move {
            let mut conn = pool.get_owned().await.unwrap();
            diesel::insert_into(accounts::table)
                .values((accounts::id.eq(1), accounts::balance.eq(10)))
                .execute(&mut *conn)
                .await
                .unwrap();
            let locked = accounts::table
                .find(1)
                .with_lock(&mut *conn, async |_, account: Account| Ok::<_, Error>(account.id))
                .await
                .unwrap();
            let held = with_lease(&mut *conn, "closures", Duration::from_secs(5), async |conn, lease: &Lease| {
                lease.renew(&mut *conn, Duration::from_secs(5)).await?;
                Ok::<_, Error>(left(conn).await)
            })
            .await
            .unwrap();
            let retried = retry(&mut *conn, RetryPolicy::attempts(2), async |conn| {
                Ok::<_, Error>(left(conn).await)
            })
            .await
            .unwrap();
            (locked, held, retried)
        });
        assert_eq!(others.await.unwrap(), (1, Some(0), 0));
    }
}
