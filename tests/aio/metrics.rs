//! The `metrics` feature from async claims: the same counters and
//! histograms as blocking ones, recorded where the claim's future is polled
//! (here a current-thread runtime, on the thread that holds the recorder).
//! A worker's head-of-queue claims pass over locked rows without reading
//! them, so only a plain claim counts one.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{ExpressionMethods, QueryDsl};
use diesel_async::pooled_connection::{bb8, AsyncDieselConnectionManager};
use diesel_async::RunQueryDsl;
use diesel_claim::aio::prelude::*;
use diesel_claim::{Error, StopHandle};

use testkit::fixtures::{orders, Order};

use super::pending;
use crate::metrics::{
    assert_five_orders_counted, measured, BATCH_DURATION, CLAIM_DURATION, GONE, LOCKED,
    PICKUP_LATENCY, PROCESSED,
};

/// Runs `future` to its end on a runtime of this thread's.
fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(future)
}

on_async_backends! {
    async fn insert_pending(conn: &mut Conn, count: usize) {
        diesel::insert_into(orders::table)
            .values(vec![orders::shipped.eq(true); count])
            .execute(conn)
            .await
            .unwrap();
    }

    async fn mark_sent(conn: &mut Conn, id: i32) -> diesel::QueryResult<()> {
        diesel::update(orders::table.find(id)).set(orders::email_sent.eq(true)).execute(conn).await?;
        Ok(())
    }

    /// An async claim counts its rows as its report does, and times itself
    /// and each batch that handed rows over.
    #[test]
    fn an_async_claim_counts_its_rows_and_times_itself_and_its_batches() {
        let (report, recorded) = measured(|| {
            block_on(async {
                let (_db, pool) = test_db(1).await;
                let mut conn = pool.get().await.unwrap();
                insert_pending(&mut conn, 5).await;
                pending()
                    .build_claim()
                    .keep_going()
                    .each(&mut *conn, async |conn: &mut Conn, order: Order| {
                        match order.id {
                            // Order 3 is sent along with order 1: gone when
                            // the claim comes to it.
                            1 => mark_sent(conn, 3).await?,
                            2 => return Err(Error::InvalidArgument("order 2 is bad".to_owned())),
                            _ => {}
                        }
                        Ok(mark_sent(conn, order.id).await?)
                    })
                    .await
                    .unwrap()
            })
        });
        assert_five_orders_counted(&report, &recorded);
    }

    /// An async worker's claims count as any claim's, labelled with its
    /// name, as are the pickups its closure records; but those that found
    /// nothing (its polls) are not timed.
    #[test]
    fn an_async_worker_times_the_claims_that_took_rows_alone() {
        let (report, recorded) = measured(|| {
            block_on(async {
                let (_db, pool) = test_db(1).await;
                let mut conn = pool.get().await.unwrap();
                insert_pending(&mut conn, 3).await;
                let stop = StopHandle::new();
                let stopper = stop.clone();
                let stopping = tokio::spawn(async move {
                    // Long enough for many empty polls once the rows are done.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    stopper.stop();
                });
                let report = pending()
                    .build_claim()
                    .worker(&stop)
                    .name("mailer")
                    .poll_interval(Duration::from_millis(1), Duration::from_millis(2))
                    .run(&mut *conn, async |conn: &mut Conn, order: Order| {
                        diesel_claim::metrics::record_pickup("orders", std::time::SystemTime::now());
                        Ok::<_, Error>(mark_sent(conn, order.id).await?)
                    })
                    .await
                    .unwrap();
                stopping.await.unwrap();
                report
            })
        });
        assert_eq!(report.processed, 3);
        assert!(report.passes > 3, "too few empty polls to tell: {report:?}");
        assert_eq!(recorded.worker_counter(PROCESSED, "mailer"), 3);
        assert_eq!(recorded.worker_samples(BATCH_DURATION, "mailer").len(), 3);
        assert_eq!(recorded.worker_samples(PICKUP_LATENCY, "mailer").len(), 3);
        let claims = recorded.worker_samples(CLAIM_DURATION, "mailer");
        assert!((1..=3).contains(&claims.len()), "{claims:?}");
    }

    /// A row another transaction holds is counted as locked when the call
    /// ends.
    #[test]
    fn an_async_claim_counts_a_locked_row() {
        let (report, recorded) = measured(|| {
            block_on(async {
                let (db, pool) = test_db(1).await;
                let mut conn = pool.get().await.unwrap();
                insert_pending(&mut conn, 3).await;
                let mut holder = blocking(&db.url);
                holder.batch_execute("BEGIN; SELECT * FROM orders WHERE id = 2 FOR UPDATE").unwrap();
                let report = pending()
                    .claim_each(&mut *conn, async |conn: &mut Conn, order: Order| {
                        Ok::<_, Error>(mark_sent(conn, order.id).await?)
                    })
                    .await
                    .unwrap();
                holder.batch_execute("COMMIT").unwrap();
                report
            })
        });
        assert_eq!((report.processed, report.locked), (2, 1));
        assert_eq!(recorded.counter(PROCESSED), 2);
        assert_eq!(recorded.counter(LOCKED), 1);
        assert_eq!(recorded.counter(GONE), 0);
    }
}
