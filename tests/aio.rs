//! The async API (`diesel_claim::aio`) on diesel-async, against PostgreSQL and
//! MariaDB: the invariants of the blocking tests, with many tasks on a
//! multi-threaded runtime, and futures dropped mid-claim.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel::{ExpressionMethods, QueryDsl, SelectableHelper};
use diesel_async::pooled_connection::bb8;
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AsyncConnection, RunQueryDsl};
use diesel_claim::aio::prelude::*;
use diesel_claim::aio::{retry, with_lease, with_lease_kept_alive, Lease};

diesel::table! {
    #[sql_name = "diesel_claim_leases"]
    leases (name) {
        name -> Text,
        token -> BigInt,
    }
}

use testkit::fixtures::{
    accounts, insert_jobs, jobs, order_lines, orders, outbox, Account, Job, Order, OrderLine,
};

/// The shipped orders whose email is not sent.
fn pending() -> diesel::dsl::Filter<
    diesel::dsl::Filter<orders::table, diesel::dsl::Eq<orders::shipped, bool>>,
    diesel::dsl::Eq<orders::email_sent, bool>,
> {
    orders::table
        .filter(orders::shipped.eq(true))
        .filter(orders::email_sent.eq(false))
}

/// Expands the tests once per backend diesel-async supports, in modules `pg` and
/// `mysql`. Inside, `Conn` is the async connection type, `Db` the blocking one,
/// and `test_db(size)` a fresh database with the shop schema and the crate's
/// migrations, plus a bb8 pool of `size` connections to it.
macro_rules! on_async_backends {
    (@backend $module:ident, $conn:ty, $db:ty, $test_db:ident, $schema:ident, $($tests:tt)*) => {
        mod $module {
            #![allow(dead_code)]
            use super::*;
            pub type Conn = $conn;
            pub type Db = $db;
            /// The module's name: `pg` or `mysql`.
            pub const BACKEND: &str = stringify!($module);
            pub type Pool = bb8::Pool<Conn>;
            /// A fresh database of the backend's, without tables.
            pub type TestDb = testkit::$test_db;
            /// A visibility-timeout claim's stamp column: its SQL type and
            /// its type in `CREATE TABLE`.
            pub type ClaimStamp = testkit::fixtures::claim_stamp!($module);
            pub const CLAIM_STAMP_COLUMN: &str = testkit::fixtures::claim_stamp!(column $module);
            /// Makes a session wait briefly for row locks.
            pub const SHORT_LOCK_WAIT: &str = testkit::fixtures::short_lock_wait!($module);

            pub async fn test_db(size: u32) -> (testkit::$test_db, Pool) {
                let db = testkit::$test_db::new();
                let mut setup = <Db as diesel::Connection>::establish(&db.url).unwrap();
                testkit::fixtures::create_schema(&mut setup, testkit::fixtures::$schema);
                let manager = AsyncDieselConnectionManager::<Conn>::new(db.url.clone());
                let pool = bb8::Pool::builder()
                    .max_size(size)
                    .connection_timeout(Duration::from_secs(10))
                    .build(manager)
                    .await
                    .unwrap();
                (db, pool)
            }

            /// A blocking connection to the test database, to check what the
            /// async code left behind.
            pub fn blocking(url: &str) -> Db {
                <Db as diesel::Connection>::establish(url).unwrap()
            }

            $($tests)*
        }
    };
    ($($tests:tt)*) => {
        #[cfg(feature = "postgres")]
        on_async_backends!(@backend pg, diesel_async::AsyncPgConnection, diesel::PgConnection,
            PgTestDb, POSTGRES_SCHEMA, $($tests)*);
        #[cfg(feature = "mysql")]
        on_async_backends!(@backend mysql, diesel_async::AsyncMysqlConnection,
            diesel::MysqlConnection, MysqlTestDb, MYSQL_SCHEMA, $($tests)*);
    };
}

on_async_backends! {
    const TASKS: usize = 32;
    const ORDERS: usize = 5_000;

    /// Runs `work` in `tasks` spawned tasks, each with a pooled connection of
    /// its own, and sums the rows they report processed.
    async fn processed_by_tasks<F, Fut>(pool: &Pool, tasks: usize, work: F) -> u64
    where
        F: Fn(bb8::PooledConnection<'static, Conn>) -> Fut
            + Send
            + Sync
            + 'static,
        Fut: std::future::Future<Output = u64> + Send + 'static,
    {
        let work = Arc::new(work);
        let handles: Vec<_> = (0..tasks)
            .map(|_| {
                let (pool, work) = (pool.clone(), Arc::clone(&work));
                tokio::spawn(async move { work(pool.get_owned().await.unwrap()).await })
            })
            .collect();
        let mut processed = 0;
        for handle in handles {
            processed += handle.await.unwrap();
        }
        processed
    }

    async fn insert_pending(conn: &mut Conn, count: usize) {
        for chunk in vec![(orders::shipped.eq(true),); count].chunks(1000) {
            diesel::insert_into(orders::table)
                .values(chunk.to_vec())
                .execute(conn)
                .await
                .unwrap();
        }
    }

    /// "Sends" the email: one outbox row, then marks the order done.
    async fn send_email(conn: &mut Conn, order: &Order, task: i32) -> diesel::QueryResult<()> {
        diesel::insert_into(outbox::table)
            .values((outbox::order_id.eq(order.id), outbox::worker.eq(task)))
            .execute(conn)
            .await?;
        diesel::update(orders::table.find(order.id))
            .set(orders::email_sent.eq(true))
            .execute(conn)
            .await?;
        Ok(())
    }

    /// `(emails sent, duplicate emails beyond one per order, orders still pending)`.
    async fn email_figures(conn: &mut Conn) -> (i64, i64, i64) {
        let sent: i64 = outbox::table.count().get_result(conn).await.unwrap();
        let distinct = outbox::table
            .select(outbox::order_id)
            .distinct()
            .load::<i32>(conn)
            .await
            .unwrap()
            .len() as i64;
        let left: i64 = pending().count().get_result(conn).await.unwrap();
        (sent, sent - distinct, left)
    }

    /// 32 tasks drain 5,000 orders, per row and in batches of 50: every order
    /// gets exactly one email. Without the row lock this fails (checked by
    /// removing it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn tasks_drain_each_row_exactly_once() {
        for batch in [1, 50] {
            let (_db, pool) = test_db(TASKS as u32 + 1).await;
            insert_pending(&mut pool.get().await.unwrap(), ORDERS).await;
            let tasks: Vec<_> = (0..TASKS)
                .map(|task| {
                    let pool = pool.clone();
                    tokio::spawn(async move {
                        let mut conn = pool.get_owned().await.unwrap();
                        let report = pending()
                            .build_claim()
                            .batch(batch)
                            .each(&mut *conn, async |conn: &mut Conn, order: Order| {
                                send_email(conn, &order, task as i32).await?;
                                Ok::<_, diesel_claim::Error>(())
                            })
                            .await
                            .unwrap();
                        report.processed
                    })
                })
                .collect();
            let mut processed = 0;
            for task in tasks {
                processed += task.await.unwrap();
            }
            let (sent, duplicates, left) = email_figures(&mut pool.get().await.unwrap()).await;
            eprintln!(
                "batch {batch}: {TASKS} tasks, {ORDERS} orders: processed {processed}, emails \
                 {sent}, duplicates {duplicates}, left {left}"
            );
            assert_eq!(
                (sent, duplicates, left),
                (ORDERS as i64, 0, 0),
                "batch {batch}"
            );
            assert_eq!(processed, ORDERS as u64, "batch {batch}");
        }
    }

    /// `claim_each` and `each_batch` hand over rows as the blocking API does,
    /// and nothing pending is one statement's work.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claim_each_and_each_batch() {
        let (_db, pool) = test_db(2).await;
        let mut conn = pool.get().await.unwrap();
        insert_pending(&mut conn, 7).await;
        let report = pending()
            .claim_each(&mut *conn, async |conn: &mut Conn, order: Order| {
                send_email(conn, &order, 0).await?;
                Ok::<_, diesel_claim::Error>(())
            })
            .await
            .unwrap();
        assert_eq!((report.processed, report.skipped, report.passes), (7, 0, 1));

        insert_pending(&mut conn, 7).await;
        let batches = &std::sync::Mutex::new(Vec::new());
        let report = pending()
            .build_claim()
            .batch(3)
            .each_batch(&mut *conn, async |conn: &mut Conn, orders: Vec<Order>| {
                batches.lock().unwrap().push(orders.len());
                for order in &orders {
                    send_email(conn, order, 0).await?;
                }
                Ok::<_, diesel_claim::Error>(())
            })
            .await
            .unwrap();
        assert_eq!(report.processed, 7);
        assert_eq!(*batches.lock().unwrap(), [3, 3, 1]);
        assert_eq!(email_figures(&mut conn).await, (14, 0, 0));

        let nothing = pending()
            .claim_each(&mut *conn, async |_: &mut Conn, _: Order| {
                Ok::<_, diesel_claim::Error>(())
            })
            .await
            .unwrap();
        assert_eq!((nothing.processed, nothing.skipped), (0, 0));
    }

    /// `mark` and `mark_and_commit`: 8 tasks claim batches marked in the
    /// statement that takes them; each row comes back marked and is handed
    /// over once, in its batch's transaction (`mark`) or after its mark
    /// committed (`mark_and_commit`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn marked_claims_hand_each_row_over_once() {
        for commit_first in [false, true] {
            let (_db, pool) = test_db(9).await;
            insert_pending(&mut pool.get().await.unwrap(), 1000).await;
            let processed = processed_by_tasks(&pool, 8, move |mut conn| async move {
                let claim = pending().build_claim().batch(20).drain();
                let done = orders::email_sent.eq(true);
                let claim = match commit_first {
                    true => claim.mark_and_commit(done),
                    false => claim.mark(done),
                };
                claim
                    .each_batch(&mut *conn, async |conn: &mut Conn, orders: Vec<Order>| {
                        assert!(orders.iter().all(|order| order.email_sent), "not as marked");
                        for order in &orders {
                            write_email(conn, order).await?;
                        }
                        Ok::<_, diesel_claim::Error>(())
                    })
                    .await
                    .unwrap()
                    .processed
            })
            .await;
            let mut conn = pool.get().await.unwrap();
            assert_eq!(processed, 1000, "mark_and_commit: {commit_first}");
            assert_eq!(email_figures(&mut conn).await, (1000, 0, 0), "mark_and_commit: {commit_first}");
        }
    }

    /// The email alone, for claims whose mark sets `email_sent`.
    async fn write_email(conn: &mut Conn, order: &Order) -> diesel::QueryResult<()> {
        diesel::insert_into(outbox::table)
            .values((outbox::order_id.eq(order.id), outbox::worker.eq(0)))
            .execute(conn)
            .await
            .map(drop)
    }

    /// A failing closure rolls `mark`'s mark back with its batch; the mark
    /// of `mark_and_commit` stands (the batch is reported failed, whole, with
    /// `keep_going`). Bad marks are refused before any SQL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_closure_rolls_back_mark_but_not_mark_and_commit() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        insert_pending(&mut conn, 3).await;
        /// A closure that fails every batch.
        fn decline<'a, 'c>(
            _: &'c mut Conn,
            _: Vec<Order>,
        ) -> scoped_futures::ScopedBoxFuture<'a, 'c, Result<(), diesel_claim::Error>> {
            async { Err(diesel_claim::Error::InvalidArgument("declined".into())) }.scope_boxed()
        }
        let done = orders::email_sent.eq(true);
        let failed = pending().build_claim().batch(3).mark(done).each_batch(&mut *conn, decline).await;
        assert!(matches!(failed, Err(diesel_claim::Error::InvalidArgument(_))), "{failed:?}");
        assert_eq!(email_figures(&mut conn).await, (0, 0, 3), "mark's mark was not rolled back");

        let outcome = pending()
            .build_claim()
            .batch(3)
            .keep_going()
            .mark_and_commit(done)
            .each_batch_outcome(&mut *conn, decline)
            .await;
        assert!(outcome.stopped.is_none(), "{:?}", outcome.stopped);
        assert_eq!(outcome.report.failed, 3);
        let failed: Vec<_> = outcome.failed.iter().map(|failure| failure.keys.clone()).collect();
        assert_eq!(failed, [vec![1, 2, 3]]);
        assert_eq!(email_figures(&mut conn).await, (0, 0, 0), "mark_and_commit's mark was undone");

        insert_pending(&mut conn, 1).await;
        let key_mark = pending().build_claim().mark(orders::id.eq(99)).each_batch(&mut *conn, decline).await;
        assert!(
            matches!(&key_mark, Err(diesel_claim::Error::InvalidArgument(m)) if m.contains("primary key")),
            "{key_mark:?}"
        );
        let nowait = pending().build_claim().nowait().mark_and_commit(done).each_batch(&mut *conn, decline).await;
        assert!(matches!(nowait, Err(diesel_claim::Error::InvalidArgument(_))), "{nowait:?}");
        assert_eq!(email_figures(&mut conn).await, (0, 0, 1), "a refused claim took a row");
    }

    /// An error from the closure rolls back its whole batch and ends the call
    /// with it; a panic rolls back too and leaves the connection usable.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn errors_and_panics_roll_back_the_batch() {
        let (_db, pool) = test_db(2).await;
        let mut conn = pool.get_owned().await.unwrap();
        insert_pending(&mut conn, 4).await;
        let result = pending()
            .build_claim()
            .batch(4)
            .each(&mut *conn, async |conn: &mut Conn, order: Order| {
                send_email(conn, &order, 0).await?;
                if order.id == 3 {
                    return Err(diesel_claim::Error::InvalidArgument("refused".to_owned()));
                }
                Ok(())
            })
            .await;
        assert!(matches!(
            result,
            Err(diesel_claim::Error::InvalidArgument(_))
        ));
        assert_eq!(email_figures(&mut conn).await, (0, 0, 4));

        let panicked = tokio::spawn(async move {
            let _ = pending()
                .claim_each(&mut *conn, async |conn: &mut Conn, order: Order| {
                    send_email(conn, &order, 0).await?;
                    panic!("the closure panics after its write");
                    #[allow(unreachable_code)]
                    Ok::<_, diesel_claim::Error>(())
                })
                .await;
        })
        .await;
        assert!(panicked.unwrap_err().is_panic());
        // The panic unwound through the claim, which rolled back: the pooled
        // connection went back to the pool usable, and nothing was written.
        let mut conn = pool.get().await.unwrap();
        assert_eq!(email_figures(&mut conn).await, (0, 0, 4));
        let report = pending()
            .claim_each(&mut *conn, async |conn: &mut Conn, order: Order| {
                send_email(conn, &order, 0).await?;
                Ok::<_, diesel_claim::Error>(())
            })
            .await
            .unwrap();
        assert_eq!(report.processed, 4);
    }

    /// `keep_going`: a failing row (error or panic) is rolled back, reported
    /// with its key and passed over, per row and in batches retried row by
    /// row; without it, the outcome of a failed call says what it committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failing_rows_are_passed_over_or_end_the_call_with_its_outcome() {
        for batch in [1, 4] {
            let (_db, pool) = test_db(1).await;
            let mut conn = pool.get().await.unwrap();
            insert_pending(&mut conn, 10).await;
            let outcome = pending()
                .build_claim()
                .batch(batch)
                .keep_going()
                .each_outcome(&mut *conn, async |conn: &mut Conn, order: Order| {
                    send_email(conn, &order, 0).await?;
                    match order.id {
                        3 => Err(diesel_claim::Error::InvalidArgument("no address".to_owned())),
                        7 => panic!("deliberate panic on row 7"),
                        _ => Ok(()),
                    }
                })
                .await;
            assert!(outcome.stopped.is_none(), "batch {batch}: {:?}", outcome.stopped);
            let failed: Vec<&[i32]> = outcome.failed.iter().map(|f| &f.keys[..]).collect();
            assert_eq!(failed, [&[3][..], &[7]], "batch {batch}");
            assert!(matches!(
                &outcome.failed[1].error,
                diesel_claim::Error::ClosurePanicked(m) if m == "deliberate panic on row 7"
            ));
            assert_eq!((outcome.report.processed, outcome.report.failed), (8, 2), "batch {batch}");
            assert_eq!(email_figures(&mut conn).await, (8, 0, 2), "batch {batch}");

            let outcome = pending()
                .build_claim()
                .each_outcome(&mut *conn, async |conn: &mut Conn, order: Order| {
                    send_email(conn, &order, 0).await?;
                    Err(diesel_claim::Error::InvalidArgument(format!("row {}", order.id)))
                })
                .await;
            assert_eq!(outcome.report.processed, 0);
            let stopped = outcome.stopped.expect("the error ended the call");
            assert_eq!(stopped.keys, [3]);
            assert!(matches!(stopped.error, diesel_claim::Error::InvalidArgument(m) if m == "row 3"));
            assert_eq!(email_figures(&mut conn).await, (8, 0, 2), "batch {batch}");
        }
    }

    /// The worker loop, as a task: it claims rows inserted while it waits
    /// and stops when told, its report counting every row. On PostgreSQL a
    /// listening worker polling every 10 s is woken by the notification
    /// within a second; elsewhere listening is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_task_claims_new_rows_until_stopped() {
        let (_db, pool) = test_db(3).await;
        let stop = diesel_claim::StopHandle::new();
        let listening = BACKEND == "pg";
        let worker = {
            let (pool, stop) = (pool.clone(), stop.clone());
            tokio::spawn(async move {
                let mut conn = pool.get_owned().await.unwrap();
                let worker = pending().build_claim().worker(&stop);
                let worker = match listening {
                    true => worker
                        .poll_interval(Duration::from_secs(10), Duration::from_secs(10))
                        .listen("orders"),
                    false => worker.poll_interval(Duration::from_millis(2), Duration::from_millis(20)),
                };
                worker
                    .run(&mut *conn, async |conn: &mut Conn, order: Order| {
                        Ok::<_, diesel_claim::Error>(send_email(conn, &order, 0).await?)
                    })
                    .await
            })
        };
        let mut conn = pool.get().await.unwrap();
        for round in 1..=3 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            insert_pending(&mut conn, 5).await;
            if listening {
                diesel::sql_query("SELECT pg_notify('orders', '')").execute(&mut *conn).await.unwrap();
            }
            let inserted = std::time::Instant::now();
            while email_figures(&mut conn).await.2 > 0 {
                assert!(inserted.elapsed() < Duration::from_secs(1), "round {round}: rows left waiting");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        stop.stop();
        let report = worker.await.unwrap().unwrap();
        assert_eq!(report.processed, 15);
        assert_eq!(email_figures(&mut conn).await, (15, 0, 0));
        if !listening {
            let refused = pending()
                .build_claim()
                .worker(&stop)
                .listen("orders")
                .run(&mut *conn, async |_: &mut Conn, _: Order| { Ok::<_, diesel_claim::Error>(()) })
                .await;
            assert!(matches!(refused, Err(diesel_claim::Error::InvalidArgument(_))), "{refused:?}");
        }
    }

    /// Bad input gets the blocking API's typed errors, before any SQL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_input_is_refused() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        let in_transaction = (*conn)
            .transaction(async |conn: &mut Conn| {
                pending()
                    .claim_each(conn, async |_: &mut Conn, _: Order| {
                        Ok::<_, diesel_claim::Error>(())
                    })
                    .await
            })
            .await;
        assert!(matches!(
            in_transaction,
            Err(diesel_claim::Error::InvalidArgument(_))
        ));
        let no_batch = pending()
            .build_claim()
            .batch(0)
            .each(&mut *conn, async |_: &mut Conn, _: Order| {
                Ok::<_, diesel_claim::Error>(())
            })
            .await;
        assert!(matches!(
            no_batch,
            Err(diesel_claim::Error::InvalidArgument(_))
        ));
        // Stopped already: a worker that took the name would end at once.
        let stop = diesel_claim::StopHandle::new();
        stop.stop();
        let unnamed = pending()
            .build_claim()
            .worker(&stop)
            .name("")
            .run(&mut *conn, async |_: &mut Conn, _: Order| {
                Ok::<_, diesel_claim::Error>(())
            })
            .await;
        assert!(
            matches!(&unnamed, Err(diesel_claim::Error::InvalidArgument(m)) if m.contains("name")),
            "{unnamed:?}"
        );
        let missing = accounts::table
            .find(42)
            .with_lock(&mut *conn, async |_: &mut Conn, _: Account| {
                Ok::<_, diesel_claim::Error>(())
            })
            .await;
        assert!(matches!(missing, Err(diesel_claim::Error::NotFound)));
    }

    /// A claim future dropped mid-batch (a timeout) with a bb8 pool: the pool
    /// discards the connection, so the row lock goes with it and the write the
    /// closure made before it stalled is never committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_claim_releases_its_lock_through_the_pool() {
        let (db, pool) = test_db(1).await;
        insert_pending(&mut pool.get().await.unwrap(), 1).await;
        stall_mid_claim(&mut pool.get().await.unwrap()).await;
        // The pool's one connection was discarded, so its session ends and a
        // new connection can lock the row (MariaDB frees the locks a few
        // milliseconds after the socket closes) and sees no email.
        let mut conn = pool.get().await.unwrap();
        assert!(
            pending_row_gets_free(&mut conn, Duration::from_secs(5)).await,
            "the lock outlived the discarded connection"
        );
        assert_eq!(email_figures(&mut conn).await, (0, 0, 1));
        drop(db);
    }

    /// The tables of the crate, as a blocking connection sees them: the
    /// versions in the crate's own history, and whether Diesel's exists.
    fn migrated(url: &str) -> (Vec<String>, bool) {
        #[derive(diesel::QueryableByName)]
        struct Version {
            #[diesel(sql_type = diesel::sql_types::Text)]
            version: String,
        }
        let mut conn = blocking(url);
        let history = diesel::sql_query("SELECT version FROM diesel_claim_schema_migrations");
        let versions = diesel::RunQueryDsl::load::<Version>(history, &mut conn).unwrap();
        let diesels = diesel::sql_query("SELECT version FROM __diesel_schema_migrations");
        let diesels = diesel::RunQueryDsl::execute(diesels, &mut conn).is_ok();
        (versions.into_iter().map(|row| row.version).collect(), diesels)
    }

    /// The crate's tables are created from async code, on a connection of
    /// its own, on the current-thread runtime (the migrations run in a
    /// blocking task, which needs the runtime's thread free to drive the
    /// connection); run again, nothing changes, and leases work at once.
    #[tokio::test]
    async fn migrations_run_from_async_code() {
        let db = TestDb::new();
        let conn = Conn::establish(&db.url).await.unwrap();
        let conn = diesel_claim::aio::run_migrations(conn).await.unwrap();
        let mut conn = diesel_claim::aio::run_migrations(conn).await.unwrap();
        assert_eq!(migrated(&db.url), (vec!["20261122000000".to_owned()], false));
        let lease = Lease::acquire(&mut conn, "migrated", Duration::from_secs(5))
            .await
            .unwrap()
            .expect("a fresh name is free");
        lease.release(&mut conn).await.unwrap();
    }

    /// The same through pools, whose owned connections move into the
    /// blocking task and come back: a deadpool object and bb8's
    /// `get_owned`, on the multi-thread runtime.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn migrations_run_on_pooled_connections() {
        use diesel_async::pooled_connection::deadpool::Pool as Deadpool;
        let db = TestDb::new();
        let manager = AsyncDieselConnectionManager::<Conn>::new(db.url.clone());
        let deadpool = Deadpool::builder(manager).max_size(1).build().unwrap();
        let object = deadpool.get().await.unwrap();
        let mut object = diesel_claim::aio::run_migrations(object).await.unwrap();
        assert_eq!(migrated(&db.url), (vec!["20261122000000".to_owned()], false));
        // Held until it expires: not released.
        let _held = Lease::acquire(&mut object, "pooled", Duration::from_secs(5))
            .await
            .unwrap()
            .expect("a fresh name is free");
        drop(object);

        let manager = AsyncDieselConnectionManager::<Conn>::new(db.url.clone());
        let pool = bb8::Pool::builder().max_size(1).build(manager).await.unwrap();
        let owned = pool.get_owned().await.unwrap();
        let mut owned = diesel_claim::aio::run_migrations(owned).await.unwrap();
        assert_eq!(migrated(&db.url), (vec!["20261122000000".to_owned()], false));
        let taken = Lease::acquire(&mut owned, "pooled", Duration::from_secs(5)).await.unwrap();
        assert!(taken.is_none(), "the lease taken through deadpool is still held");
    }

    /// A deadpool pool: tasks drain rows through it, and a claim dropped
    /// mid-batch leaves its connection in the pool until the next `get`, which
    /// discards it (it is broken): then the lock is gone and nothing was written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn works_with_deadpool() {
        use diesel_async::pooled_connection::deadpool::Pool as Deadpool;
        let (db, bb8_pool) = test_db(1).await;
        insert_pending(&mut bb8_pool.get().await.unwrap(), 1000).await;
        let manager = AsyncDieselConnectionManager::<Conn>::new(db.url.clone());
        let pool = Deadpool::builder(manager).max_size(8).build().unwrap();
        let tasks: Vec<_> = (0..8)
            .map(|task| {
                let pool = pool.clone();
                tokio::spawn(async move {
                    let mut conn = pool.get().await.unwrap();
                    pending()
                        .build_claim()
                        .batch(10)
                        .each(&mut *conn, async |conn: &mut Conn, order: Order| {
                            send_email(conn, &order, task).await?;
                            Ok::<_, diesel_claim::Error>(())
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
        let mut conn = bb8_pool.get().await.unwrap();
        assert_eq!(processed, 1000);
        assert_eq!(email_figures(&mut conn).await, (1000, 0, 0));

        insert_pending(&mut conn, 1).await;
        let pool = Deadpool::builder(AsyncDieselConnectionManager::<Conn>::new(db.url.clone()))
            .max_size(1)
            .build()
            .unwrap();
        stall_mid_claim(&mut pool.get().await.unwrap()).await;
        let mut recycled = pool.get().await.unwrap();
        assert!(
            pending_row_gets_free(&mut recycled, Duration::from_secs(5)).await,
            "the lock outlived the recycled connection"
        );
        assert_eq!(email_figures(&mut conn).await, (1000, 0, 1));
    }

    /// The same on a connection of one's own: it refuses further transactions
    /// rather than nest them in the abandoned one, and the dropped claim
    /// rolled back as it was dropped, so the lock is already free.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_claim_breaks_a_plain_connection() {
        let (db, pool) = test_db(1).await;
        insert_pending(&mut pool.get().await.unwrap(), 1).await;
        let mut own = Conn::establish(&db.url).await.unwrap();
        stall_mid_claim(&mut own).await;
        // Not a savepoint inside the abandoned transaction: an error.
        let again = own
            .transaction(async |_: &mut Conn| Ok::<_, diesel::result::Error>(()))
            .await;
        assert!(
            matches!(again, Err(diesel::result::Error::BrokenTransactionManager)),
            "a broken connection must refuse: {again:?}"
        );
        // The crate's own calls say what to do about it.
        let refused = pending()
            .claim_each(&mut own, async |_: &mut Conn, _: Order| {
                Ok::<_, diesel_claim::Error>(())
            })
            .await;
        match refused {
            Err(error @ diesel_claim::Error::BrokenConnection(_)) => {
                assert!(error.to_string().contains("drop the connection"), "{error}");
            }
            other => panic!("a broken connection must refuse a claim: {other:?}"),
        }
        let mut conn = pool.get().await.unwrap();
        assert!(
            pending_row_gets_free(&mut conn, Duration::from_secs(1)).await,
            "the dropped claim did not roll back"
        );
        assert_eq!(email_figures(&mut conn).await, (0, 0, 1));
        drop(own);
    }

    /// A claim dropped mid-transaction, with no further use of the pool or
    /// the connection, rolls back as it is dropped: on a bb8 connection, on
    /// one that stays idle in a deadpool pool, and on a connection of one's
    /// own that is kept, the lock goes at once, and nothing the closure wrote
    /// is committed. (Without the `ROLLBACK` sent at the drop, the deadpool
    /// and kept connections would hold the lock until the idle bound.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_claim_rolls_back_at_once_on_every_pool() {
        use diesel_async::pooled_connection::deadpool::Pool as Deadpool;
        let (db, pool) = test_db(2).await;
        let mut conn = pool.get().await.unwrap();
        insert_pending(&mut conn, 1).await;
        let at_once = Duration::from_secs(1);

        stall_mid_claim(&mut pool.get().await.unwrap()).await;
        lock_held_after_the_drop(&mut conn, at_once, "bb8").await;

        let deadpool = Deadpool::builder(AsyncDieselConnectionManager::<Conn>::new(db.url.clone()))
            .max_size(4)
            .build()
            .unwrap();
        let idle: Vec<_> = futures_util::future::join_all((0..4).map(|_| deadpool.get())).await;
        let mut idle: Vec<_> = idle.into_iter().map(Result::unwrap).collect();
        stall_mid_claim(&mut idle[0]).await;
        drop(idle);
        lock_held_after_the_drop(&mut conn, at_once, "deadpool, 4 idle").await;
        assert_eq!(email_figures(&mut conn).await, (0, 0, 1));

        let mut own = Conn::establish(&db.url).await.unwrap();
        stall_mid_claim(&mut own).await;
        lock_held_after_the_drop(&mut conn, at_once, "own connection, kept").await;
        // Nothing runs in the abandoned transaction: on PostgreSQL the kept
        // connection's statements run outside it and see none of its
        // writes; MySQL's connection, which never read the `ROLLBACK`'s
        // answer, fails them.
        let seen = outbox::table.count().get_result::<i64>(&mut own).await;
        match seen {
            Ok(writes) => assert_eq!(writes, 0),
            Err(error) => assert_eq!(BACKEND, "mysql", "{error}"),
        }
        assert_eq!(email_figures(&mut conn).await, (0, 0, 1));
        drop(deadpool);
    }

    /// A claim dropped while a statement of its closure runs: its `ROLLBACK`
    /// goes behind the statement, and the lock goes when the statement ends
    /// (the idle bound is the backstop, should the `ROLLBACK` not leave), on
    /// a connection kept and never used again; nothing is committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_dropped_mid_statement_is_freed_within_its_bound() {
        let (db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        insert_pending(&mut conn, 1).await;
        let mut own = Conn::establish(&db.url).await.unwrap();
        let (statement, bound) = (Duration::from_secs(3), Duration::from_secs(2));
        let sleep = match BACKEND {
            "pg" => "SELECT pg_sleep(3)",
            _ => "SELECT SLEEP(3)",
        };
        let stalled = tokio::time::timeout(Duration::from_millis(500), async {
            pending()
                .build_claim()
                .idle_bound(bound)
                .each(&mut own, async |conn: &mut Conn, order: Order| {
                    send_email(conn, &order, 0).await?;
                    diesel::sql_query(sleep).execute(conn).await?;
                    Ok::<_, diesel_claim::Error>(())
                })
                .await
        })
        .await;
        assert!(stalled.is_err(), "the claim should have been dropped mid-statement");
        let within = statement + bound + Duration::from_secs(5);
        let held = lock_held_after_the_drop(&mut conn, within, "mid-statement, kept").await;
        assert!(held >= statement - Duration::from_secs(1), "freed after {held:?}: before the statement ended");
        assert_eq!(email_figures(&mut conn).await, (0, 0, 1));
        drop(own);
    }

    /// How long the pending row stays locked after a claim was just dropped
    /// on a connection held `how` (printed); fails if it stays locked
    /// `within` that time.
    async fn lock_held_after_the_drop(conn: &mut Conn, within: Duration, how: &str) -> Duration {
        let dropped = std::time::Instant::now();
        assert!(pending_row_gets_free(conn, within).await, "{how}: the lock outlived {within:?}");
        let held = dropped.elapsed();
        eprintln!("{BACKEND}: {how}, no further use of the pool: lock held {held:?} after the drop");
        held
    }

    /// Every transaction the async API opens carries the caller's bound, by
    /// default `IDLE_TRANSACTION_BOUND`; `None` leaves the session's own
    /// setting. On PostgreSQL the bound is the transaction's alone; on
    /// MariaDB it is the session's, put back for a transaction without one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_transaction_is_bounded_as_the_caller_says() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        seed_accounts(&mut conn, &[100]).await;
        let (show, session) = match BACKEND {
            "pg" => (
                "SELECT current_setting('idle_in_transaction_session_timeout') AS bound",
                "SET idle_in_transaction_session_timeout = '7s'",
            ),
            _ => (
                "SELECT CAST(@@idle_transaction_timeout AS CHAR) AS bound",
                "SET SESSION idle_transaction_timeout = 7",
            ),
        };
        #[derive(diesel::QueryableByName)]
        struct Bound {
            #[diesel(sql_type = diesel::sql_types::Text)]
            bound: String,
        }
        /// The bound, as a transaction of `with_lock` bounded by `bound` sees it.
        async fn bound_in_lock(
            conn: &mut Conn,
            show: &'static str,
            bound: Option<Option<Duration>>,
        ) -> Result<String, diesel_claim::Error> {
            let lock = accounts::table.find(1).build_lock();
            let lock = match bound {
                Some(bound) => lock.idle_bound(bound),
                None => lock,
            };
            lock.run(conn, async move |conn: &mut Conn, _: Account| {
                Ok(diesel::sql_query(show).get_result::<Bound>(conn).await?.bound)
            })
            .await
        }
        diesel::sql_query(session).execute(&mut *conn).await.unwrap();
        let seconds = |pg: &str, mysql: &str| if BACKEND == "pg" { pg.to_owned() } else { mysql.to_owned() };
        assert_eq!(bound_in_lock(&mut conn, show, None).await.unwrap(), seconds("30s", "30"));
        let five = Some(Some(Duration::from_millis(4_500)));
        assert_eq!(bound_in_lock(&mut conn, show, five).await.unwrap(), seconds("4500ms", "5"));
        // No bound of the crate's: the session's own, 7 s.
        assert_eq!(bound_in_lock(&mut conn, show, Some(None)).await.unwrap(), seconds("7s", "7"));
        let outside = diesel::sql_query(show).get_result::<Bound>(&mut *conn).await.unwrap().bound;
        assert_eq!(outside, seconds("7s", "7"));
        // A bound of zero, or past what the servers take, is refused.
        for bad in [Duration::ZERO, Duration::from_secs(25 * 86_400)] {
            let refused = bound_in_lock(&mut conn, show, Some(Some(bad))).await;
            assert!(
                matches!(&refused, Err(diesel_claim::Error::InvalidArgument(m)) if m.contains("idle_bound")),
                "{refused:?}"
            );
        }
    }

    /// A closure that awaits something else for longer than its claim's
    /// idle bound: the server ends the session, and the call fails with the
    /// error that names the bound and how long the transaction was open;
    /// nothing it wrote is committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_closure_idle_past_its_bound_fails_with_the_error_that_names_it() {
        let (_db, pool) = test_db(2).await;
        insert_pending(&mut pool.get().await.unwrap(), 1).await;
        let mut conn = pool.get().await.unwrap();
        let bound = Duration::from_secs(2);
        let claimed = pending()
            .build_claim()
            .idle_bound(bound)
            .each(&mut *conn, async |conn: &mut Conn, order: Order| {
                send_email(conn, &order, 0).await?;
                tokio::time::sleep(Duration::from_secs(3)).await;
                diesel::sql_query("SELECT 1").execute(conn).await?;
                Ok::<_, diesel_claim::Error>(())
            })
            .await;
        match claimed {
            Err(error @ diesel_claim::Error::IdleBoundExceeded { .. }) => {
                let diesel_claim::Error::IdleBoundExceeded { bound: told, open_for } = &error else {
                    unreachable!()
                };
                assert_eq!(*told, bound);
                assert!(*open_for >= Duration::from_secs(3), "{open_for:?}");
                let message = error.to_string();
                assert!(message.contains("idle_bound") && message.contains("2s"), "{message}");
            }
            other => panic!("the bound should have ended the claim: {other:?}"),
        }
        drop(conn);
        let mut conn = pool.get().await.unwrap();
        assert_eq!(email_figures(&mut conn).await, (0, 0, 1));
    }

    /// A job that awaits 40 s inside its claim, with the bound off, runs
    /// exactly once while two other workers poll the queue (their claims
    /// skip its locked row); with the bound at 30 s it would have lost its
    /// lock, and run again, at 30 s.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_awaiting_40_s_in_its_claim_runs_once_with_the_bound_off() {
        let (_db, pool) = test_db(4).await;
        insert_pending(&mut pool.get().await.unwrap(), 1).await;
        let stop = diesel_claim::StopHandle::new();
        // The pollers start once the long claim holds the row.
        let (held, holding) = tokio::sync::watch::channel(false);
        let poller = |task: i32| {
            let (pool, stop, mut holding) = (&pool, &stop, holding.clone());
            async move {
                holding.wait_for(|held| *held).await.unwrap();
                let mut conn = pool.get().await.unwrap();
                let task = &task;
                pending()
                    .build_claim()
                    .worker(stop)
                    .poll_interval(Duration::from_millis(20), Duration::from_millis(100))
                    .run(&mut *conn, async |conn: &mut Conn, order: Order| {
                        send_email(conn, &order, *task).await?;
                        Ok::<_, diesel_claim::Error>(())
                    })
                    .await
            }
        };
        let long = async {
            let mut conn = pool.get().await.unwrap();
            let report = pending()
                .build_claim()
                .idle_bound(None)
                .each(&mut *conn, async |conn: &mut Conn, order: Order| {
                    held.send_replace(true);
                    tokio::time::sleep(Duration::from_secs(40)).await;
                    send_email(conn, &order, 0).await?;
                    Ok::<_, diesel_claim::Error>(())
                })
                .await;
            stop.stop();
            report
        };
        let (long, first, second) = tokio::join!(long, poller(1), poller(2));
        assert_eq!(long.unwrap().processed, 1);
        assert_eq!(first.unwrap().processed + second.unwrap().processed, 0);
        assert_eq!(email_figures(&mut pool.get().await.unwrap()).await, (1, 0, 0));
    }

    /// Claims the pending row, writes its email and stalls in the closure,
    /// until a timeout drops the claim's future mid-transaction.
    async fn stall_mid_claim(conn: &mut Conn) {
        let stalled = tokio::time::timeout(Duration::from_millis(300), async {
            pending()
                .claim_each(conn, async |conn: &mut Conn, order: Order| {
                    send_email(conn, &order, 0).await?;
                    std::future::pending::<()>().await;
                    Ok::<_, diesel_claim::Error>(())
                })
                .await
        })
        .await;
        assert!(stalled.is_err(), "the claim should have stalled");
    }

    /// Whether the pending row, still pending and without its email, can be
    /// locked at once `within` the given time (the server ends a closed
    /// connection's session, and frees its locks, a moment after the socket
    /// closes). Only `LockNotAvailable` is waited out; any other outcome fails
    /// the test.
    async fn pending_row_gets_free(conn: &mut Conn, within: Duration) -> bool {
        let started = std::time::Instant::now();
        while started.elapsed() < within {
            let lock = pending()
                .build_lock()
                .nowait()
                .run(&mut *conn, async |_: &mut Conn, order: Order| {
                    Ok::<_, diesel_claim::Error>(order)
                })
                .await;
            match lock {
                Ok(order) => {
                    assert!(!order.email_sent, "the abandoned write was committed");
                    return true;
                }
                Err(diesel_claim::Error::LockNotAvailable) => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(other) => panic!("locking the pending row failed: {other:?}"),
            }
        }
        false
    }

    /// 16 tasks move money between 5 accounts with `with_locks`, refusing
    /// overdrafts: the total never changes and no balance goes negative.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn pessimistic_bank_keeps_every_cent() {
        const TRANSFERS: usize = 40;
        let (_db, pool) = test_db(17).await;
        seed_accounts(&mut pool.get().await.unwrap(), &[100; 5]).await;
        let tasks: Vec<_> = (0..16)
            .map(|task| {
                let pool = pool.clone();
                tokio::spawn(async move {
                    let mut conn = pool.get_owned().await.unwrap();
                    let mut done = 0;
                    for i in 0..TRANSFERS {
                        let from = ((task + i) % 5 + 1) as i32;
                        let to = ((task + 2 * i + 1) % 5 + 1) as i32;
                        if from == to {
                            continue;
                        }
                        let amount = 7 + (i % 30) as i64;
                        let moved = accounts::table
                            .filter(accounts::id.eq_any([from, to]))
                            .order(accounts::id)
                            .with_locks(&mut *conn, async |conn: &mut Conn, rows: Vec<Account>| {
                                let source = rows.iter().find(|a| a.id == from).unwrap();
                                if source.balance < amount {
                                    return Ok(false);
                                }
                                move_money(conn, from, to, amount).await?;
                                Ok::<_, diesel_claim::Error>(true)
                            })
                            .await
                            .unwrap();
                        done += usize::from(moved);
                    }
                    done
                })
            })
            .collect();
        let mut transfers = 0;
        for task in tasks {
            transfers += task.await.unwrap();
        }
        let balances = balances(&mut pool.get().await.unwrap()).await;
        eprintln!("pessimistic: {transfers} transfers, balances {balances:?}");
        assert_eq!(balances.iter().sum::<i64>(), 500);
        assert!(balances.iter().all(|&b| b >= 0));
        assert!(transfers > 0);
    }

    /// 25 tasks each add 1 to one counter 5 times with `update_versioned` and
    /// `retry`: exactly 125, however many conflicts it took.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn optimistic_counter_loses_no_increment() {
        let (_db, pool) = test_db(26).await;
        seed_accounts(&mut pool.get().await.unwrap(), &[0]).await;
        let retries = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..25)
            .map(|_| {
                let (pool, retries) = (pool.clone(), retries.clone());
                tokio::spawn(async move {
                    let mut conn = pool.get_owned().await.unwrap();
                    for _ in 0..5 {
                        let attempts = &AtomicUsize::new(0);
                        retry(
                            &mut *conn,
                            RetryPolicy::attempts(1000),
                            async |conn: &mut Conn| {
                                attempts.fetch_add(1, Ordering::Relaxed);
                                let account: Account = accounts::table
                                    .find(1)
                                    .select(Account::as_select())
                                    .get_result(conn)
                                    .await?;
                                accounts::table
                                    .find(1)
                                    .update_versioned(
                                        accounts::version,
                                        account.version,
                                        accounts::balance.eq(account.balance + 1),
                                    )
                                    .execute(conn)
                                    .await
                            },
                        )
                        .await
                        .unwrap();
                        retries.fetch_add(
                            AtomicUsize::load(attempts, Ordering::Relaxed) - 1,
                            Ordering::Relaxed,
                        );
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let balances = balances(&mut pool.get().await.unwrap()).await;
        eprintln!(
            "optimistic: 125 increments, {} retries, counter {}",
            AtomicUsize::load(&retries, Ordering::Relaxed),
            balances[0]
        );
        assert_eq!(balances, [125]);
    }

    /// Two tasks lock two accounts in opposite orders: the server picks a
    /// victim, which gets `Error::Deadlock` (on MySQL too, whose async driver
    /// reports it with an unknown kind), and `retry` gets both transfers done.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deadlocks_are_typed_and_retry_recovers() {
        let (_db, pool) = test_db(2).await;
        seed_accounts(&mut pool.get().await.unwrap(), &[100, 100]).await;
        let both_hold_one = Arc::new(tokio::sync::Barrier::new(2));
        let deadlocks = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = [(1, 2), (2, 1)]
            .into_iter()
            .map(|(first, second)| {
                let (pool, both_hold_one, deadlocks) =
                    (pool.clone(), both_hold_one.clone(), deadlocks.clone());
                tokio::spawn(async move {
                    let mut conn = pool.get_owned().await.unwrap();
                    let (both_hold_one, deadlocks) = (&*both_hold_one, &*deadlocks);
                    let first_attempt = &std::sync::atomic::AtomicBool::new(true);
                    retry(&mut *conn, RetryPolicy::attempts(20), async |conn: &mut Conn| {
                        let moved = accounts::table
                            .find(first)
                            .with_lock(conn, async |conn: &mut Conn, _: Account| {
                                if first_attempt.swap(false, Ordering::SeqCst) {
                                    both_hold_one.wait().await;
                                }
                                move_money(conn, first, second, 10).await?;
                                Ok::<_, diesel_claim::Error>(())
                            })
                            .await;
                        if matches!(moved, Err(diesel_claim::Error::Deadlock(_))) {
                            deadlocks.fetch_add(1, Ordering::SeqCst);
                        }
                        moved
                    })
                    .await
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        let deadlocks = AtomicUsize::load(&deadlocks, Ordering::SeqCst);
        eprintln!("deadlocks: {deadlocks}");
        assert!(deadlocks >= 1);
        assert_eq!(balances(&mut pool.get().await.unwrap()).await, [100, 100]);
    }

    /// A stale version is a typed conflict, a missing row `NotFound`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn versioned_outcomes() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        seed_accounts(&mut conn, &[10]).await;
        let next = accounts::table
            .find(1)
            .update_versioned(accounts::version, 0, accounts::balance.eq(11))
            .execute(&mut *conn)
            .await
            .unwrap();
        assert_eq!(next, 1);
        let stale = accounts::table
            .find(1)
            .update_versioned(accounts::version, 0, accounts::balance.eq(12))
            .execute(&mut *conn)
            .await;
        assert!(matches!(
            stale,
            Err(diesel_claim::Error::VersionConflict {
                expected: 0,
                actual: Some(1),
                ..
            })
        ));
        let missing = accounts::table
            .find(2)
            .update_versioned(accounts::version, 0, accounts::balance.eq(1))
            .execute(&mut *conn)
            .await;
        assert!(matches!(missing, Err(diesel_claim::Error::NotFound)));
    }

    /// A loaded model (`&model`) and borrowed binds are targets, as in the
    /// blocking API.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn versioned_updates_of_borrowed_models_and_binds() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        seed_accounts(&mut conn, &[10, 20]).await;
        let account: Account = accounts::table
            .find(1)
            .select(Account::as_select())
            .first(&mut *conn)
            .await
            .unwrap();
        let next = (&account)
            .update_versioned(accounts::version, account.version, accounts::balance.eq(&account.balance))
            .execute(&mut *conn)
            .await
            .unwrap();
        assert_eq!(next, 1);
        let stale = (&account)
            .update_versioned(accounts::version, account.version, accounts::balance.eq(0))
            .execute(&mut *conn)
            .await;
        assert!(matches!(
            stale,
            Err(diesel_claim::Error::VersionConflict { expected: 0, actual: Some(1), .. })
        ));
        let id = 2;
        let next = accounts::table
            .filter(accounts::id.eq(&id))
            .update_versioned(accounts::version, 0, accounts::balance.eq(21))
            .execute(&mut *conn)
            .await
            .unwrap();
        assert_eq!(next, 1);
    }

    /// A loaded model locks its row and gets it back fresh: 8 tasks holding
    /// the same stale copy each add 10, and none is lost.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_loaded_model_is_locked_and_read_again() {
        let (_db, pool) = test_db(9).await;
        let mut conn = pool.get().await.unwrap();
        seed_accounts(&mut conn, &[100]).await;
        let stale: Account = accounts::table
            .find(1)
            .select(Account::as_select())
            .first(&mut *conn)
            .await
            .unwrap();
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (pool, stale) = (pool.clone(), stale.clone());
                tokio::spawn(async move {
                    let mut conn = pool.get_owned().await.unwrap();
                    stale
                        .with_lock(&mut *conn, async |conn: &mut Conn, fresh: Account| {
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            diesel::update(accounts::table.find(fresh.id))
                                .set(accounts::balance.eq(fresh.balance + 10))
                                .execute(conn)
                                .await?;
                            Ok::<_, diesel_claim::Error>(())
                        })
                        .await
                        .unwrap();
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(balances(&mut conn).await, [180]);
    }

    /// A versioned delete: a stale version conflicts and keeps the row, the
    /// right one deletes it, and then it is not found.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn delete_versioned_outcomes() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        seed_accounts(&mut conn, &[10, 20]).await;
        let stale = accounts::table
            .find(1)
            .delete_versioned(accounts::version, 3)
            .execute(&mut *conn)
            .await;
        assert!(matches!(
            stale,
            Err(diesel_claim::Error::VersionConflict { expected: 3, actual: Some(0), .. })
        ));
        accounts::table
            .find(1)
            .delete_versioned(accounts::version, 0)
            .execute(&mut *conn)
            .await
            .unwrap();
        let gone = accounts::table
            .find(1)
            .delete_versioned(accounts::version, 0)
            .execute(&mut *conn)
            .await;
        assert!(matches!(gone, Err(diesel_claim::Error::NotFound)), "{gone:?}");
        assert_eq!(balances(&mut conn).await, [20]);
    }

    /// A boxed query with a filter chosen at run time is claimed through
    /// `rebuild` by many tasks: each row once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn boxed_queries_are_claimed_through_rebuild() {
        let (_db, pool) = test_db(9).await;
        insert_pending(&mut pool.get().await.unwrap(), 500).await;
        let only_shipped = std::hint::black_box(true);
        let tasks: Vec<_> = (0..8)
            .map(|task| {
                let pool = pool.clone();
                tokio::spawn(async move {
                    let mut conn = pool.get_owned().await.unwrap();
                    let pending = diesel_claim::rebuild(move || {
                        let mut query = orders::table.filter(orders::email_sent.eq(false)).into_boxed();
                        if only_shipped {
                            query = query.filter(orders::shipped.eq(true));
                        }
                        query
                    });
                    pending
                        .build_claim()
                        .batch(10)
                        .each(&mut *conn, async |conn: &mut Conn, order: Order| {
                            send_email(conn, &order, task).await?;
                            Ok::<_, diesel_claim::Error>(())
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
        assert_eq!(processed, 500);
        assert_eq!(email_figures(&mut pool.get().await.unwrap()).await, (500, 0, 0));
    }

    /// Rows keyed by two columns, claimed by 8 tasks in batches: each once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn composite_keys_are_claimed_once() {
        let (_db, pool) = test_db(9).await;
        let rows: Vec<_> = (1..=30)
            .flat_map(|order| (1..=4).map(move |line| (order_lines::order_id.eq(order), order_lines::line_no.eq(line))))
            .collect();
        diesel::insert_into(order_lines::table)
            .values(&rows)
            .execute(&mut pool.get().await.unwrap())
            .await
            .unwrap();
        let processed = processed_by_tasks(&pool, 8, |mut conn| async move {
                    order_lines::table
                        .filter(order_lines::packed.eq(false))
                        .build_claim()
                        .batch(5)
                        .each(&mut *conn, async |conn: &mut Conn, line: OrderLine| {
                            diesel::update(&line)
                                .set((
                                    order_lines::packed.eq(true),
                                    order_lines::times_packed.eq(order_lines::times_packed + 1),
                                ))
                                .execute(conn)
                                .await?;
                            Ok::<_, diesel_claim::Error>(())
                        })
                        .await
                        .unwrap()
                        .processed
        })
        .await;
        assert_eq!(processed, 120);
        let times: Vec<i32> = order_lines::table
            .select(order_lines::times_packed)
            .load(&mut *pool.get().await.unwrap())
            .await
            .unwrap();
        assert!(times.len() == 120 && times.iter().all(|&t| t == 1), "{times:?}");
    }

    /// The query's `ORDER BY` is the claim order, the key breaking ties; tasks
    /// claiming in that order do every job once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claims_follow_the_query_order() {
        let (db, pool) = test_db(7).await;
        let queue = || {
            jobs::table
                .filter(jobs::done.eq(false))
                .order((jobs::priority.desc(), jobs::due.asc()))
                .select(Job::as_select())
        };
        async fn finish(conn: &mut Conn, job: &Job) -> diesel::QueryResult<()> {
            diesel::update(job)
                .set((jobs::done.eq(true), jobs::times_done.eq(jobs::times_done + 1)))
                .execute(conn)
                .await
                .map(drop)
        }
        let expected = insert_jobs(&mut blocking(&db.url), 50);
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut conn = pool.get().await.unwrap();
        let report = queue()
            .build_claim()
            .batch(3)
            .page_size(8)
            .each(&mut *conn, async |conn: &mut Conn, job: Job| {
                seen.lock().unwrap().push(job.id);
                finish(conn, &job).await
            })
            .await
            .unwrap();
        drop(conn);
        assert_eq!(report.processed, 50);
        assert_eq!(*seen.lock().unwrap(), expected);

        diesel::delete(jobs::table).execute(&mut *pool.get().await.unwrap()).await.unwrap();
        insert_jobs(&mut blocking(&db.url), 300);
        let processed = processed_by_tasks(&pool, 6, move |mut conn| async move {
                    queue()
                        .build_claim()
                        .batch(4)
                        .each(&mut *conn, async |conn: &mut Conn, job: Job| {
                            finish(conn, &job).await
                        })
                        .await
                        .unwrap()
                        .processed
        })
        .await;
        assert_eq!(processed, 300);
        let times: Vec<i32> = jobs::table
            .select(jobs::times_done)
            .load(&mut *pool.get().await.unwrap())
            .await
            .unwrap();
        assert!(times.len() == 300 && times.iter().all(|&t| t == 1), "{times:?}");
    }

    /// Candidates the claim passed over are told apart: locked by another
    /// session, or gone (done since the page was read). A boxed query's order
    /// is refused before any SQL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn skipped_candidates_are_locked_or_gone_and_a_boxed_order_is_refused() {
        use diesel::connection::SimpleConnection;
        let (db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        insert_pending(&mut conn, 4).await;
        let mut holder = blocking(&db.url);
        holder
            .batch_execute("BEGIN; SELECT * FROM orders WHERE id = 2 FOR UPDATE")
            .unwrap();
        let report = pending()
            .claim_each(&mut *conn, async |conn: &mut Conn, order: Order| {
                if order.id == 1 {
                    // Order 3 is emailed by "someone else", in this transaction.
                    diesel::update(orders::table.find(3))
                        .set(orders::email_sent.eq(true))
                        .execute(conn)
                        .await?;
                }
                send_email(conn, &order, 0).await?;
                Ok::<_, diesel_claim::Error>(())
            })
            .await
            .unwrap();
        holder.batch_execute("COMMIT").unwrap();
        assert_eq!(
            (report.processed, report.locked, report.gone, report.skipped),
            (2, 1, 1, 2),
            "{report:?}"
        );

        let boxed = diesel_claim::rebuild(|| pending().order(orders::id.desc()).into_boxed());
        let refused = boxed
            .claim_each(&mut *conn, async |_, _: Order| {
                Ok::<_, diesel_claim::Error>(())
            })
            .await;
        assert!(
            matches!(&refused, Err(diesel_claim::Error::InvalidArgument(m)) if m.contains("box the filter")),
            "{refused:?}"
        );
    }

    /// A query with its own `LIMIT` or `DISTINCT` is refused before any SQL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn limit_and_distinct_are_refused() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        insert_pending(&mut conn, 5).await;
        let limited = pending()
            .limit(2)
            .claim_each(&mut *conn, async |_, _: Order| {
                Ok::<_, diesel_claim::Error>(())
            })
            .await;
        assert!(
            matches!(&limited, Err(diesel_claim::Error::InvalidArgument(m)) if m.contains("max_rows")),
            "{limited:?}"
        );
        let distinct = pending()
            .distinct()
            .claim_each(&mut *conn, async |_, _: Order| {
                Ok::<_, diesel_claim::Error>(())
            })
            .await;
        assert!(matches!(distinct, Err(diesel_claim::Error::InvalidArgument(_))), "{distinct:?}");
        assert_eq!(email_figures(&mut conn).await, (0, 0, 5));
    }

    /// A target of several rows and a changeset that sets the version are
    /// refused, and nothing changes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn versioned_refusals_change_nothing() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        seed_accounts(&mut conn, &[10, 10]).await;
        let several = accounts::table
            .filter(accounts::balance.eq(10))
            .update_versioned(accounts::version, 0, accounts::balance.eq(11))
            .execute(&mut *conn)
            .await;
        assert!(matches!(several, Err(diesel_claim::Error::UnexpectedOutcome(_))), "{several:?}");
        let versioned_twice = accounts::table
            .find(1)
            .update_versioned(accounts::version, 0, (accounts::balance.eq(12), accounts::version.eq(3)))
            .execute(&mut *conn)
            .await;
        assert!(matches!(versioned_twice, Err(diesel_claim::Error::InvalidArgument(_))), "{versioned_twice:?}");
        assert_eq!(balances(&mut conn).await, [10, 10]);
        let versions: Vec<i32> = accounts::table
            .select(accounts::version)
            .load(&mut *conn)
            .await
            .unwrap();
        assert_eq!(versions, [0, 0]);
    }

    /// The async `retry` takes `anyhow::Error` and refuses a policy of no
    /// attempts before running the operation.
    #[cfg(feature = "anyhow")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retry_takes_anyhow_and_refuses_zero_attempts() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        seed_accounts(&mut conn, &[10]).await;
        diesel::update(accounts::table.find(1))
            .set(accounts::version.eq(1))
            .execute(&mut *conn)
            .await
            .unwrap();
        let attempts = AtomicUsize::new(0);
        let version = retry(&mut *conn, RetryPolicy::attempts(3), async |conn| {
            let attempt = attempts.fetch_add(1, Ordering::SeqCst) as i32;
            let version = accounts::table
                .find(1)
                .update_versioned(accounts::version, attempt, accounts::balance.eq(11))
                .execute(conn)
                .await?;
            Ok::<_, anyhow::Error>(version)
        })
        .await
        .unwrap();
        assert_eq!((AtomicUsize::load(&attempts, Ordering::SeqCst), version), (2, 2));

        let refused = retry(&mut *conn, RetryPolicy::attempts(0), async |_| {
            attempts.fetch_add(1, Ordering::SeqCst);
            Ok::<_, diesel_claim::Error>(())
        })
        .await;
        assert!(matches!(refused, Err(diesel_claim::Error::InvalidArgument(_))), "{refused:?}");
        assert_eq!(AtomicUsize::load(&attempts, Ordering::SeqCst), 2);
    }

    async fn seed_accounts(conn: &mut Conn, balances: &[i64]) {
        let rows: Vec<_> = balances
            .iter()
            .enumerate()
            .map(|(i, b)| (accounts::id.eq(i as i32 + 1), accounts::balance.eq(*b)))
            .collect();
        diesel::insert_into(accounts::table)
            .values(&rows)
            .execute(conn)
            .await
            .unwrap();
    }

    async fn move_money(
        conn: &mut Conn,
        from: i32,
        to: i32,
        amount: i64,
    ) -> diesel::QueryResult<()> {
        diesel::update(accounts::table.find(from))
            .set(accounts::balance.eq(accounts::balance - amount))
            .execute(conn)
            .await?;
        diesel::update(accounts::table.find(to))
            .set(accounts::balance.eq(accounts::balance + amount))
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn balances(conn: &mut Conn) -> Vec<i64> {
        accounts::table
            .order(accounts::id)
            .select(accounts::balance)
            .load(conn)
            .await
            .unwrap()
    }

    /// `with_lease_kept_alive`: renewed beside the closure on a second
    /// connection, the lease outlives four TTLs and nobody else takes it;
    /// released afterwards. Taken from it (the token moved on), the closure
    /// is told, and the call is `NotLeaseOwner`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_lease_outlives_its_ttl_and_tells_when_lost() {
        let (_db, pool) = test_db(3).await;
        let (mut conn, mut renewer, other) =
            (pool.get().await.unwrap(), pool.get().await.unwrap(), pool.get().await.unwrap());
        let other = tokio::sync::Mutex::new(other);
        let ttl = Duration::from_millis(600);
        let started = std::time::Instant::now();
        let other_ref = &other;
        let kept = with_lease_kept_alive(&mut *conn, &mut *renewer, "report", ttl, async |_: &mut Conn, lease| {
            let mut taken_by_others = 0;
            while started.elapsed() < 4 * ttl {
                tokio::time::sleep(ttl / 6).await;
                lease.ensure_held()?;
                let mut other = other_ref.lock().await;
                taken_by_others += u32::from(Lease::acquire(&mut **other, "report", ttl).await?.is_some());
            }
            Ok::<_, diesel_claim::Error>(taken_by_others)
        })
        .await;
        assert_eq!(kept.unwrap(), Some(0));

        let lost = with_lease_kept_alive(&mut *conn, &mut *renewer, "report", ttl, async |_: &mut Conn, lease| {
            let mut other = other_ref.lock().await;
            diesel::update(leases::table.find("report"))
                .set(leases::token.eq(leases::token + 1))
                .execute(&mut **other)
                .await?;
            let taken = std::time::Instant::now();
            while !lease.is_lost() {
                assert!(taken.elapsed() < 4 * ttl, "the closure was never told");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            lease.ensure_held()?;
            Ok::<_, diesel_claim::Error>(())
        })
        .await;
        assert!(matches!(lost, Err(diesel_claim::Error::NotLeaseOwner { token: 2, .. })), "{lost:?}");
    }

    /// A renewal that hangs (on the lease's row, which another transaction
    /// has updated) keeps nothing "held": the closure is told the lease is
    /// lost once its TTL has passed on the local clock since it was taken.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_lease_is_lost_at_its_ttl_while_a_renewal_hangs() {
        use diesel_async::SimpleAsyncConnection;

        let (_db, pool) = test_db(3).await;
        let (mut conn, mut renewer, mut other) =
            (pool.get().await.unwrap(), pool.get().await.unwrap(), pool.get().await.unwrap());
        let ttl = Duration::from_millis(600);
        let taking = std::time::Instant::now();
        let other = &mut *other;
        let lost = with_lease_kept_alive(&mut *conn, &mut *renewer, "report", ttl, async |_: &mut Conn, lease| {
            other.batch_execute("BEGIN").await?;
            other.batch_execute("UPDATE diesel_claim_leases SET token = token").await?;
            tokio::time::sleep((ttl / 2).saturating_sub(taking.elapsed())).await;
            let held_at_half = !lease.is_lost();
            while !lease.is_lost() && taking.elapsed() < 3 * ttl {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let told_after = lease.is_lost().then(|| taking.elapsed());
            other.batch_execute("ROLLBACK").await?;
            assert!(held_at_half, "lost before its TTL");
            let told_after = told_after.expect("not told three TTLs after the lease was taken");
            assert!(told_after >= ttl - ttl / 1000, "told {told_after:?} after");
            assert!(told_after <= ttl + Duration::from_millis(100), "told {told_after:?} after");
            lease.ensure_held()?;
            Ok::<_, diesel_claim::Error>(())
        })
        .await;
        assert!(matches!(lost, Err(diesel_claim::Error::NotLeaseOwner { token: 1, .. })), "{lost:?}");
    }

    /// 8 tasks contend for one name for 1.5 s: never two inside at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn leases_exclude_each_other() {
        let (_db, pool) = test_db(8).await;
        let inside = Arc::new(AtomicUsize::new(0));
        let overlaps = Arc::new(AtomicUsize::new(0));
        let entered = Arc::new(AtomicUsize::new(0));
        let deadline = tokio::time::Instant::now() + Duration::from_millis(1500);
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (pool, inside, overlaps, entered) = (
                    pool.clone(),
                    inside.clone(),
                    overlaps.clone(),
                    entered.clone(),
                );
                tokio::spawn(async move {
                    let mut conn = pool.get_owned().await.unwrap();
                    let (inside, overlaps, entered) = (&*inside, &*overlaps, &*entered);
                    while tokio::time::Instant::now() < deadline {
                        let ttl = Duration::from_secs(10);
                        with_lease(&mut *conn, "report", ttl, async |_: &mut Conn, _: &Lease| {
                            if inside.fetch_add(1, Ordering::SeqCst) > 0 {
                                overlaps.fetch_add(1, Ordering::SeqCst);
                            }
                            entered.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(1)).await;
                            inside.fetch_sub(1, Ordering::SeqCst);
                            Ok::<_, diesel_claim::Error>(())
                        })
                        .await
                        .unwrap();
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let entered = AtomicUsize::load(&entered, Ordering::SeqCst);
        let overlaps = AtomicUsize::load(&overlaps, Ordering::SeqCst);
        eprintln!("leases: {entered} critical sections, {overlaps} overlaps");
        assert_eq!(overlaps, 0);
        assert!(entered > 0);
    }

    /// Tokens grow, a second acquirer is refused, and an expired holder can
    /// neither renew nor release.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lease_lifecycle() {
        let (_db, pool) = test_db(1).await;
        let mut conn = pool.get().await.unwrap();
        let ttl = Duration::from_secs(30);
        let first = Lease::acquire(&mut *conn, "job", ttl)
            .await
            .unwrap()
            .unwrap();
        assert!(Lease::acquire(&mut *conn, "job", ttl)
            .await
            .unwrap()
            .is_none());
        first.renew(&mut *conn, ttl).await.unwrap();
        let token = first.token();
        first.release(&mut *conn).await.unwrap();
        let short = Lease::acquire_within(&mut *conn, "job", Duration::from_millis(50), ttl)
            .await
            .unwrap();
        assert!(short.token() > token);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(matches!(
            short.renew(&mut *conn, ttl).await,
            Err(diesel_claim::Error::NotLeaseOwner { .. })
        ));
        assert!(matches!(
            Lease::acquire(&mut *conn, "", ttl).await,
            Err(diesel_claim::Error::InvalidArgument(_))
        ));
    }
}

// Each form of closure the API takes, on the backends above.
mod closures;
// Job workers: the head of the queue, failure hooks, backoff.
mod workers;
// Workers on bb8 and deadpool pools, through lost connections.
#[cfg(all(feature = "bb8", feature = "deadpool"))]
mod pooled;
// Retries scheduled in the rows, on a pool of loops.
#[cfg(all(feature = "bb8", feature = "deadpool"))]
mod retries;
// Queues kept as a ring of partitions: PostgreSQL.
#[cfg(all(feature = "postgres", feature = "bb8"))]
mod ring;
// Visibility-timeout claims, on the backends above.
mod timed;
// Sessions the server ends under a claim, and pools that give no connection.
mod errors;
// The counters and histograms of the `metrics` feature, from async claims.
#[cfg(feature = "metrics")]
mod metrics;

/// A renewal that does not come back (its statement sleeps, as one on a
/// dead link waits) is dropped a grace (a third of the TTL) after the
/// closure ends: the call returns within that bound, having released on
/// `conn`, and the closure was told the lease was lost at its TTL.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_lease_call_returns_while_a_renewal_is_stuck() {
    use diesel_async::SimpleAsyncConnection;

    let (_db, pool) = pg::test_db(3).await;
    let (mut conn, mut renewer, mut other) = (
        pool.get().await.unwrap(),
        pool.get().await.unwrap(),
        pool.get().await.unwrap(),
    );
    // Statements changing leases sleep 2 s on the renewer's session only.
    conn.batch_execute(
        "CREATE FUNCTION stall_renewals() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
             IF current_setting('application_name') = 'stalled renewer' THEN PERFORM pg_sleep(2); END IF;
             RETURN NULL;
         END $$;
         CREATE TRIGGER stall_renewals BEFORE UPDATE ON diesel_claim_leases
             FOR EACH STATEMENT EXECUTE FUNCTION stall_renewals();",
    )
    .await
    .unwrap();
    renewer
        .batch_execute("SET application_name = 'stalled renewer'")
        .await
        .unwrap();
    let ttl = Duration::from_millis(600);
    let taking = std::time::Instant::now();
    let (mut told_after, mut ended) = (None, None);
    let (told, end) = (&mut told_after, &mut ended);
    let outcome = with_lease_kept_alive(
        &mut *conn,
        &mut *renewer,
        "report",
        ttl,
        async |_: &mut pg::Conn, lease| {
            while !lease.is_lost() && taking.elapsed() < 3 * ttl {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            *told = Some(taking.elapsed());
            *end = Some(std::time::Instant::now());
            Ok::<_, diesel_claim::Error>(())
        },
    )
    .await;
    let returned_after = ended.unwrap().elapsed();
    // Released, or found expired already: the database's TTL ends a little
    // after the local one.
    assert!(
        matches!(
            outcome,
            Ok(Some(())) | Err(diesel_claim::Error::NotLeaseOwner { .. })
        ),
        "{outcome:?}"
    );
    let told_after = told_after.unwrap();
    assert!(
        told_after <= ttl + Duration::from_millis(100),
        "told {told_after:?} after"
    );
    // The grace and the release, with room for a loaded machine: the stuck
    // renewal alone would hold the call 2 s.
    assert!(
        returned_after <= ttl / 3 + Duration::from_millis(400),
        "returned {returned_after:?} after"
    );
    let next = Lease::acquire(&mut *other, "report", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(next.is_some(), "not released");
}

/// A MySQL or MariaDB pool set up with `establish_read_committed` hands out
/// connections at `READ COMMITTED`, from bb8 and from deadpool; a plain
/// connection keeps the server's default.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_pools_set_up_for_claimers_run_at_read_committed() {
    use diesel_async::pooled_connection::{deadpool, ManagerConfig};
    use diesel_async::AsyncMysqlConnection;

    #[derive(diesel::QueryableByName)]
    struct Variable {
        #[diesel(sql_type = diesel::sql_types::Text, column_name = Variable_name)]
        name: String,
        #[diesel(sql_type = diesel::sql_types::Text, column_name = Value)]
        value: String,
    }

    /// The session's isolation level (`tx_isolation` on MariaDB,
    /// `transaction_isolation` on MySQL 8).
    async fn isolation(conn: &mut AsyncMysqlConnection) -> String {
        let variables: Vec<Variable> =
            diesel::sql_query("SHOW SESSION VARIABLES LIKE '%isolation'")
                .load(conn)
                .await
                .unwrap();
        let level = variables.into_iter().find(|variable| {
            variable.name == "tx_isolation" || variable.name == "transaction_isolation"
        });
        level.expect("no isolation variable").value
    }

    let db = testkit::MysqlTestDb::new();
    let manager = || {
        let mut config = ManagerConfig::default();
        config.custom_setup = Box::new(diesel_claim::aio::establish_read_committed);
        AsyncDieselConnectionManager::<AsyncMysqlConnection>::new_with_config(
            db.url.clone(),
            config,
        )
    };
    let bb8 = bb8::Pool::builder()
        .max_size(2)
        .build(manager())
        .await
        .unwrap();
    assert_eq!(
        isolation(&mut bb8.get().await.unwrap()).await,
        "READ-COMMITTED"
    );
    let deadpool = deadpool::Pool::builder(manager())
        .max_size(2)
        .build()
        .unwrap();
    assert_eq!(
        isolation(&mut deadpool.get().await.unwrap()).await,
        "READ-COMMITTED"
    );
    let mut plain = AsyncMysqlConnection::establish(&db.url).await.unwrap();
    assert_eq!(isolation(&mut plain).await, "REPEATABLE-READ");
}
