//! Visibility-timeout claims on diesel-async: the blocking tests' invariants
//! (each row worked on once by concurrent tasks, the closure outside any
//! transaction, a stalled claim's late write refused, rows that come back
//! when their stamps pass), awaited.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use diesel::{ExpressionMethods, QueryDsl, SelectableHelper};
use diesel_async::pooled_connection::{bb8, AsyncDieselConnectionManager};
use diesel_async::RunQueryDsl;
use diesel_claim::aio::prelude::*;
use diesel_claim::aio::Async;
use diesel_claim::{Claimed, Error};

on_async_backends! {
    diesel::table! {
        use diesel::sql_types::*;
        use super::ClaimStamp;

        invoices (id) {
            id -> Integer,
            sent -> Bool,
            times_sent -> Integer,
            claimed_until -> Nullable<ClaimStamp>,
        }
    }

    diesel::table! {
        /// One row per time a closure worked on an invoice.
        invoice_work (id) {
            id -> Integer,
            invoice_id -> Integer,
            worker -> Integer,
        }
    }

    #[derive(Debug, Clone, diesel::Queryable, diesel::Selectable, diesel::Identifiable)]
    #[diesel(table_name = invoices)]
    struct Invoice {
        id: i32,
        sent: bool,
    }

    type Claim = Claimed<Invoice, invoices::claimed_until, Async>;

    type Unsent = diesel::dsl::Select<
        diesel::dsl::Filter<invoices::table, diesel::dsl::Eq<invoices::sent, bool>>,
        diesel::dsl::AsSelect<Invoice, <Conn as diesel_async::AsyncConnectionCore>::Backend>,
    >;

    fn unsent() -> Unsent {
        invoices::table.filter(invoices::sent.eq(false)).select(Invoice::as_select())
    }

    /// A database with `count` unsent invoices, `1..=count`, and a pool of
    /// `size` connections to it.
    async fn invoices_db(count: i32, size: u32) -> (impl Sized, Pool) {
        let (db, pool) = test_db(size).await;
        let serial = match BACKEND {
            "pg" => "SERIAL PRIMARY KEY",
            _ => "INTEGER AUTO_INCREMENT PRIMARY KEY",
        };
        let mut conn = pool.get().await.unwrap();
        for statement in [
            format!(
                "CREATE TABLE invoices (id INTEGER PRIMARY KEY, sent BOOLEAN NOT NULL, \
                 times_sent INTEGER NOT NULL, claimed_until {CLAIM_STAMP_COLUMN})"
            ),
            format!(
                "CREATE TABLE invoice_work (id {serial}, invoice_id INTEGER NOT NULL, \
                 worker INTEGER NOT NULL)"
            ),
        ] {
            diesel::sql_query(statement).execute(&mut *conn).await.unwrap();
        }
        let rows: Vec<_> = (1..=count)
            .map(|id| (invoices::id.eq(id), invoices::sent.eq(false), invoices::times_sent.eq(0)))
            .collect();
        for chunk in rows.chunks(500) {
            diesel::insert_into(invoices::table).values(chunk.to_vec()).execute(&mut *conn).await.unwrap();
        }
        drop(conn);
        (db, pool)
    }

    /// The final write: sent, counted.
    async fn send(conn: &mut Conn, invoice: Claim) -> Result<(), Error> {
        invoice
            .finish(conn, (invoices::sent.eq(true), invoices::times_sent.eq(invoices::times_sent + 1)))
            .await
    }

    /// `(invoices sent more than once, invoices unsent, stamps left)`.
    async fn invoice_figures(conn: &mut Conn) -> (i64, i64, i64) {
        let twice = invoices::table.filter(invoices::times_sent.gt(1)).count().get_result(conn).await.unwrap();
        let unsent = invoices::table.filter(invoices::sent.eq(false)).count().get_result(conn).await.unwrap();
        let stamped = invoices::table
            .filter(invoices::claimed_until.is_not_null())
            .count()
            .get_result(conn)
            .await
            .unwrap();
        (twice, unsent, stamped)
    }

    /// Moves every stamp into the past, as if its time had gone by: tests of
    /// what comes back once a stamp passes then hang on no machine's speed.
    async fn let_stamps_pass(conn: &mut Conn) {
        diesel::sql_query("UPDATE invoices SET claimed_until = '2000-01-01 00:00:00' WHERE claimed_until IS NOT NULL")
            .execute(conn)
            .await
            .unwrap();
    }

    /// Tasks claiming the same invoices, per row and in batches, with the
    /// work outside any transaction: each invoice is worked on once and sent
    /// once, and no stamp is left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_tasks_work_on_each_row_once() {
        const TASKS: usize = 8;
        const INVOICES: i32 = 400;
        for batch in [1, 20] {
            let (_db, pool) = invoices_db(INVOICES, TASKS as u32 + 1).await;
            let tasks: Vec<_> = (0..TASKS)
                .map(|task| {
                    let pool = pool.clone();
                    tokio::spawn(async move {
                        let mut conn = pool.get_owned().await.unwrap();
                        let worker = task as i32;
                        unsent()
                            .build_claim()
                            .batch(batch)
                            .drain()
                            .visibility_timeout(invoices::claimed_until, Duration::from_secs(60))
                            .each(&mut *conn, async |conn: &mut Conn, invoice: Claim| {
                                diesel::insert_into(invoice_work::table)
                                    .values((invoice_work::invoice_id.eq(invoice.id), invoice_work::worker.eq(worker)))
                                    .execute(&mut *conn)
                                    .await?;
                                send(conn, invoice).await
                            })
                            .await
                            .unwrap()
                            .processed
                    })
                })
                .collect();
            let mut processed = 0;
            for task in tasks {
                processed += task.await.unwrap();
            }
            let mut conn = pool.get().await.unwrap();
            let worked: i64 = invoice_work::table.count().get_result(&mut *conn).await.unwrap();
            assert_eq!(processed, INVOICES as u64, "batch {batch}");
            assert_eq!(worked, INVOICES as i64, "batch {batch}: an invoice was worked on twice");
            assert_eq!(invoice_figures(&mut conn).await, (0, 0, 0), "batch {batch}");
        }
    }

    /// Each row of a batch comes to the closure with its whole time to live,
    /// its stamp renewed as it is handed over: a task polling all along
    /// takes none of them, and every final write lands.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_row_of_a_batch_comes_with_its_whole_ttl() {
        let (_db, pool) = invoices_db(4, 2).await;
        let ttl = Duration::from_secs(2);
        // The poller starts once the batch is taken, and stops once it is
        // done.
        let first_started = std::sync::Arc::new(tokio::sync::Notify::new());
        let first_done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let poller = {
            let (pool, first_started, first_done) = (pool.clone(), first_started.clone(), first_done.clone());
            tokio::spawn(async move {
                let mut conn = pool.get_owned().await.unwrap();
                first_started.notified().await;
                let mut taken = 0;
                while !std::sync::atomic::AtomicBool::load(&first_done, std::sync::atomic::Ordering::Acquire) {
                    taken += unsent()
                        .build_claim()
                        .visibility_timeout(invoices::claimed_until, ttl)
                        .each(&mut *conn, async |conn: &mut Conn, invoice: Claim| send(conn, invoice).await)
                        .await
                        .unwrap()
                        .processed;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                taken
            })
        };
        let mut conn = pool.get().await.unwrap();
        let remaining = std::sync::Mutex::new(Vec::new());
        let report = unsent()
            .build_claim()
            .batch(4)
            .visibility_timeout(invoices::claimed_until, ttl)
            .each(&mut *conn, async |conn: &mut Conn, invoice: Claim| {
                remaining.lock().unwrap().push(invoice.remaining());
                first_started.notify_one();
                tokio::time::sleep(Duration::from_millis(500)).await;
                send(conn, invoice).await
            })
            .await;
        first_done.store(true, std::sync::atomic::Ordering::Release);
        assert_eq!(report.unwrap().processed, 4);
        assert_eq!(poller.await.unwrap(), 0);
        let remaining = remaining.into_inner().unwrap();
        let slack = Duration::from_millis(250);
        assert!(remaining.iter().all(|left| *left > ttl - slack), "{remaining:?}");
        assert_eq!(invoice_figures(&mut conn).await, (0, 0, 0));
    }

    /// An `async` failure hook records a failing row and releases its stamp,
    /// in one transaction.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failure_hook_records_a_failing_row_and_releases_it() {
        let (_db, pool) = invoices_db(3, 1).await;
        let mut conn = pool.get().await.unwrap();
        let outcome = unsent()
            .build_claim()
            .visibility_timeout(invoices::claimed_until, Duration::from_secs(60))
            .on_failure(async |conn: &mut Conn, invoice: Invoice, _: &Error| {
                diesel::update(&invoice).set(invoices::times_sent.eq(-1)).execute(conn).await?;
                Ok(())
            })
            .each_outcome(&mut *conn, async |conn: &mut Conn, invoice: Claim| match invoice.id {
                2 => Err(Error::InvalidArgument("invoice 2 fails".to_owned())),
                _ => send(conn, invoice).await,
            })
            .await;
        assert!(outcome.stopped.is_none(), "{:?}", outcome.stopped);
        let failed: Vec<&[i32]> = outcome.failed.iter().map(|failure| &failure.keys[..]).collect();
        assert_eq!(failed, [&[2][..]]);
        let rows: Vec<(i32, bool, i32, bool)> = invoices::table
            .select((invoices::id, invoices::sent, invoices::times_sent, invoices::claimed_until.is_null()))
            .order(invoices::id)
            .load(&mut *conn)
            .await
            .unwrap();
        assert_eq!(rows, [(1, true, 1, true), (2, false, -1, true), (3, true, 1, true)]);
    }

    /// The closure runs outside any transaction: another session updates
    /// the claimed row at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_closure_holds_no_transaction_and_no_lock() {
        use diesel_async::{AsyncConnection, TransactionManager};
        let (_db, pool) = invoices_db(2, 2).await;
        let mut conn = pool.get().await.unwrap();
        let mut other = pool.get_owned().await.unwrap();
        diesel::sql_query(SHORT_LOCK_WAIT).execute(&mut *other).await.unwrap();
        let other = &Mutex::new(other);
        let report = unsent()
            .build_claim()
            .visibility_timeout(invoices::claimed_until, Duration::from_secs(60))
            .each(&mut *conn, async |conn: &mut Conn, invoice: Claim| {
                let depth = <Conn as AsyncConnection>::TransactionManager::transaction_manager_status_mut(conn)
                    .transaction_depth()?;
                assert_eq!(depth, None, "the closure runs in a transaction");
                diesel::update(invoices::table.find(invoice.id))
                    .set(invoices::times_sent.eq(invoices::times_sent + 10))
                    .execute(&mut **other.lock().await)
                    .await
                    .expect("the claimed row is locked");
                send(conn, invoice).await
            })
            .await
            .unwrap();
        assert_eq!(report.processed, 2);
        let times_sent: Vec<i32> = invoices::table.select(invoices::times_sent).load(&mut *conn).await.unwrap();
        assert_eq!(times_sent, [11, 11]);
    }

    /// A claim that stalls past its stamp is taken over by another task; its
    /// `extend` and late final write are refused with `ClaimLost`, and the row
    /// carries the new claim's write alone. Before that, `extend` kept it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_claim_is_taken_over_and_its_late_writes_refused() {
        let (_db, pool) = invoices_db(1, 2).await;
        let mut stalled = pool.get().await.unwrap();
        let fresh = &Mutex::new(pool.get_owned().await.unwrap());
        let ttl = Duration::from_millis(600);
        let claim = || unsent().build_claim().visibility_timeout(invoices::claimed_until, ttl);
        let late = &Mutex::new(None);
        claim()
            .each(&mut *stalled, async |conn: &mut Conn, mut invoice: Claim| {
                let first = invoice.stamp();
                let started = Instant::now();
                while started.elapsed() < 2 * ttl {
                    tokio::time::sleep(ttl / 3).await;
                    invoice.extend(conn).await?;
                    let report = claim()
                        .each(&mut **fresh.lock().await, async |_: &mut Conn, _: Claim| {
                            Ok::<_, Error>(())
                        })
                        .await?;
                    assert_eq!(report.processed, 0, "an extended claim was taken");
                }
                assert!(invoice.stamp() > first, "extend did not move the stamp on");
                tokio::time::sleep(ttl + Duration::from_millis(200)).await;
                let stamp = invoice.stamp();
                let report = claim()
                    .each(&mut **fresh.lock().await, async |conn: &mut Conn, taken: Claim| {
                        assert!(taken.stamp() > stamp, "a new claim's stamp is later");
                        send(conn, taken).await
                    })
                    .await?;
                assert_eq!(report.processed, 1, "the row was not taken over");
                let extended = invoice.extend(conn).await;
                assert!(matches!(extended, Err(Error::ClaimLost { .. })), "{extended:?}");
                *late.lock().await = Some(send(conn, invoice).await);
                Ok::<_, Error>(())
            })
            .await
            .unwrap();
        let late = late.lock().await.take().expect("the closure ran");
        // The table as `table!` names it, and the row's key.
        assert!(matches!(&late, Err(Error::ClaimLost { table, key }) if table == "invoices" && key == "1"), "{late:?}");
        assert!(late.unwrap_err().to_string().starts_with("claim lost on invoices row 1:"));
        let times_sent: i32 = invoices::table.select(invoices::times_sent).first(&mut *stalled).await.unwrap();
        assert_eq!(times_sent, 1, "the late write landed");
        assert_eq!(invoice_figures(&mut stalled).await, (0, 0, 0));
    }

    /// Rows whose closure failed, panicked or dropped its claim come back
    /// once their stamps pass, never twice in one call; a released row comes
    /// back at once; a failing batch ends the call.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unfinished_rows_come_back_when_their_stamps_pass() {
        let (_db, pool) = invoices_db(5, 1).await;
        let mut conn = pool.get().await.unwrap();
        // Far longer than the call, however slowly a loaded machine prints
        // the panic's backtrace; the stamps are then let pass by hand.
        let ttl = Duration::from_secs(60);
        let claim = || unsent().build_claim().drain().keep_going().visibility_timeout(invoices::claimed_until, ttl);
        // 1 fails, 2 panics, 3 is dropped, 4 is released, 5 is sent.
        let outcome = claim()
            .each_outcome(&mut *conn, async |conn: &mut Conn, invoice: Claim| {
                match invoice.id {
                    1 => Err(Error::InvalidArgument("declined".into())),
                    2 => panic!("a bug in the closure"),
                    3 => {
                        let _row: Invoice = invoice.into_row();
                        Ok(())
                    }
                    4 => invoice.release(conn).await,
                    _ => send(conn, invoice).await,
                }
            })
            .await;
        assert!(outcome.stopped.is_none(), "{:?}", outcome.stopped);
        assert_eq!((outcome.report.processed, outcome.report.failed), (3, 2));
        let failed: Vec<_> = outcome.failed.iter().map(|failure| failure.keys.clone()).collect();
        assert_eq!(failed, [vec![1], vec![2]]);
        assert!(matches!(&outcome.failed[1].error, Error::ClosurePanicked(m) if m.contains("a bug")));
        // Only the released row is claimable now.
        let mut now = Vec::new();
        claim()
            .each(&mut *conn, scoped(|_: &mut Conn, invoice: Claim| {
                now.push(invoice.id);
                async { Ok::<_, Error>(()) }.scope_boxed()
            }))
            .await
            .unwrap();
        assert_eq!(now, [4]);
        let_stamps_pass(&mut conn).await;
        let later = &Mutex::new(HashSet::new());
        let report = claim()
            .each_batch(&mut *conn, async |conn: &mut Conn, invoices: Vec<Claim>| {
                for invoice in invoices {
                    assert!(later.lock().await.insert(invoice.id), "row {} handed over twice in one call", invoice.id);
                    send(conn, invoice).await?;
                }
                Ok::<_, Error>(())
            })
            .await
            .unwrap();
        assert_eq!(report.processed, 4);
        assert_eq!(invoice_figures(&mut conn).await, (0, 0, 0));
    }

    /// A worker task claims what is claimable, then a row abandoned by a dead
    /// claim once its stamp passes, and stops when told.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_picks_up_abandoned_rows_once_their_stamps_pass() {
        let (_db, pool) = invoices_db(5, 2).await;
        let mut conn = pool.get().await.unwrap();
        let ttl = Duration::from_millis(300);
        unsent()
            .build_claim()
            .max_rows(1)
            .visibility_timeout(invoices::claimed_until, ttl)
            .each(&mut *conn, async |_: &mut Conn, invoice: Claim| {
                let _abandoned: Invoice = invoice.into_row();
                Ok::<_, Error>(())
            })
            .await
            .unwrap();
        let abandoned = Instant::now();
        let stop = diesel_claim::StopHandle::new();
        let worker = {
            let (pool, stop) = (pool.clone(), stop.clone());
            tokio::spawn(async move {
                let mut conn = pool.get_owned().await.unwrap();
                unsent()
                    .build_claim()
                    .visibility_timeout(invoices::claimed_until, ttl)
                    .worker(&stop)
                    .poll_interval(Duration::from_millis(5), Duration::from_millis(50))
                    .run(&mut *conn, send)
                    .await
            })
        };
        while invoice_figures(&mut conn).await.1 > 0 {
            assert!(abandoned.elapsed() < Duration::from_secs(10), "rows left unsent");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // (Half the timeout: the stamp was set a moment before `abandoned`.)
        assert!(abandoned.elapsed() >= ttl / 2, "a live claim was taken");
        assert!(!worker.is_finished(), "the worker stopped by itself");
        stop.stop();
        let report = worker.await.unwrap().unwrap();
        assert_eq!(report.processed, 5);
        assert_eq!(invoice_figures(&mut conn).await, (0, 0, 0));
    }

    /// Bad options and writes are refused with the blocking API's typed
    /// errors.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_options_and_writes_are_refused() {
        let (_db, pool) = invoices_db(2, 1).await;
        let mut conn = pool.get().await.unwrap();
        let refused = unsent()
            .build_claim()
            .visibility_timeout(invoices::claimed_until, Duration::from_micros(999))
            .each(&mut *conn, async |_: &mut Conn, _: Claim| { Ok::<_, Error>(()) })
            .await;
        assert!(matches!(&refused, Err(Error::InvalidArgument(m)) if m.contains("1 ms")), "{refused:?}");
        let refused = unsent()
            .build_claim()
            .nowait()
            .visibility_timeout(invoices::claimed_until, Duration::from_secs(1))
            .each(&mut *conn, async |_: &mut Conn, _: Claim| { Ok::<_, Error>(()) })
            .await;
        assert!(matches!(&refused, Err(Error::InvalidArgument(m)) if m.contains("visibility_timeout")), "{refused:?}");
        let outcomes = &Mutex::new(Vec::new());
        unsent()
            .build_claim()
            .visibility_timeout(invoices::claimed_until, Duration::from_secs(60))
            .each(&mut *conn, async |conn: &mut Conn, invoice: Claim| {
                if invoice.id == 1 {
                    let null = diesel::dsl::sql::<diesel::sql_types::Nullable<ClaimStamp>>("NULL");
                    outcomes.lock().await.push(invoice.finish(conn, invoices::claimed_until.eq(null)).await);
                } else {
                    diesel::delete(invoices::table.find(invoice.id)).execute(&mut *conn).await?;
                    outcomes.lock().await.push(send(conn, invoice).await);
                }
                Ok::<_, Error>(())
            })
            .await
            .unwrap();
        let outcomes = outcomes.lock().await;
        assert!(matches!(&outcomes[0], Err(Error::InvalidArgument(m)) if m.contains("claimed_until")), "{outcomes:?}");
        assert!(matches!(&outcomes[1], Err(Error::NotFound)), "{outcomes:?}");
    }
}
