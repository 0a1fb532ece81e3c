//! Async workers on bb8 and deadpool pools: many claim loops on a small pool
//! shared with the application, `stop_when_empty`, loops in the key's order
//! steering around each other's batches, `run` on the pools'
//! connections as they are, sessions terminated under a running worker, a
//! server killed and started again, a server stopped and started after
//! which the loops take jobs again together, and (PostgreSQL) a listener
//! woken by `aio::notify` that comes back after its session ends.

use std::time::{Duration, Instant};

use diesel::{ExpressionMethods, QueryDsl, SelectableHelper};
use diesel_async::pooled_connection::{bb8, deadpool, AsyncDieselConnectionManager, ManagerConfig};
use diesel_async::{AsyncConnection, RunQueryDsl};
use diesel_claim::aio::prelude::*;
use diesel_claim::{Error, StopHandle};
use scoped_futures::ScopedFutureExt;

use testkit::fixtures::{insert_jobs, jobs, Job};

use crate::pooled::{
    assert_the_loops_came_back_together, LoopTakes, CONNECTION_TIMEOUT, RESTART_LOOPS,
};

/// A connection manager for `url`: on MySQL, sessions at `READ COMMITTED`.
pub fn manager<C>(url: &str, mysql: bool) -> AsyncDieselConnectionManager<C>
where
    C: diesel_async::pooled_connection::PoolableConnection + 'static,
{
    let mut config = ManagerConfig::default();
    if mysql {
        #[cfg(feature = "mysql")]
        {
            config.custom_setup = Box::new(|url| {
                use futures_util::FutureExt;
                async move {
                    let mut conn = C::establish(url).await?;
                    conn.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .await
                        .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
                    Ok(conn)
                }
                .boxed()
            });
        }
    }
    AsyncDieselConnectionManager::new_with_config(url, config)
}

on_async_backends! {
    /// Jobs not done, by priority.
    type Pending = diesel::dsl::Order<
        diesel::dsl::Select<
            diesel::dsl::Filter<jobs::table, diesel::dsl::Eq<jobs::done, bool>>,
            diesel::dsl::AsSelect<Job, <Conn as diesel_async::AsyncConnectionCore>::Backend>,
        >,
        diesel::dsl::Desc<jobs::priority>,
    >;

    fn pending() -> Pending {
        jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .order(jobs::priority.desc())
    }

    async fn finish(conn: &mut Conn, job: Job) -> Result<(), Error> {
        diesel::update(&job)
            .set((jobs::done.eq(true), jobs::times_done.eq(jobs::times_done + 1)))
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Jobs done more than once, and jobs not done.
    async fn duplicates_and_left(conn: &mut Conn) -> (i64, i64) {
        let twice = jobs::table.filter(jobs::times_done.gt(1)).count().get_result(conn).await.unwrap();
        let left = jobs::table.filter(jobs::done.eq(false)).count().get_result(conn).await.unwrap();
        (twice, left)
    }

    async fn bb8_pool(url: &str, size: u32) -> bb8::Pool<Conn> {
        bb8::Pool::builder()
            .max_size(size)
            .connection_timeout(Duration::from_secs(5))
            .build(manager(url, BACKEND == "mysql"))
            .await
            .unwrap()
    }

    fn deadpool_pool(url: &str, size: usize) -> deadpool::Pool<Conn> {
        deadpool::Pool::builder(manager(url, BACKEND == "mysql"))
            .max_size(size)
            .build()
            .unwrap()
    }

    /// Eight claim loops share a bb8 pool of four with a producer that
    /// inserts the jobs while they run: every job is done once, and the idle
    /// loops hold no connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn eight_loops_share_a_pool_of_four_with_the_application() {
        let db = TestDb::new();
        testkit::fixtures::create_schema(&mut blocking(&db.url), testkit::fixtures::schema_of(BACKEND));
        let pool = bb8_pool(&db.url, 4).await;
        let stop = StopHandle::new();
        const JOBS: i32 = 400;
        let producer = async {
            for first in (1..=JOBS).step_by(20) {
                let rows: Vec<_> = (first..first + 20)
                    .map(|id| (jobs::id.eq(id), jobs::priority.eq(id % 3), jobs::due.eq(diesel::dsl::now)))
                    .collect();
                let mut conn = pool.get().await.unwrap();
                diesel::insert_into(jobs::table).values(&rows).execute(&mut *conn).await.unwrap();
                drop(conn);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let deadline = Instant::now() + Duration::from_secs(120);
            while duplicates_and_left(&mut pool.get().await.unwrap()).await.1 > 0 {
                assert!(Instant::now() < deadline, "the jobs were not done in time");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            stop.stop();
        };
        let worker = pending()
            .build_claim()
            .worker(&stop)
            .concurrency(8)
            .poll_interval(Duration::from_millis(5), Duration::from_millis(50))
            .run_pooled(&pool, async |conn: &mut Conn, job: Job| {
                // The job's own queries, on its claim's connection.
                let _: i64 = jobs::table.count().get_result(conn).await?;
                finish(conn, job).await
            });
        let ((), report) = tokio::join!(producer, worker);
        assert_eq!(report.unwrap().processed, JOBS as u64);
        assert_eq!(duplicates_and_left(&mut pool.get().await.unwrap()).await, (0, 0));
        let state = pool.state();
        assert_eq!(state.idle_connections, state.connections);
    }

    /// `stop_when_empty` on a deadpool pool, and `run` on the pools'
    /// connections as they are (no `&mut *`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stop_when_empty_and_run_on_pooled_connections() {
        let db = TestDb::new();
        testkit::fixtures::create_schema(&mut blocking(&db.url), testkit::fixtures::schema_of(BACKEND));
        insert_jobs(&mut blocking(&db.url), 60);
        let stop = StopHandle::new();
        let deadpool = deadpool_pool(&db.url, 3);
        let report = pending()
            .build_claim()
            .worker(&stop)
            .concurrency(2)
            .stop_when_empty()
            .run_pooled(&deadpool, async |conn: &mut Conn, job: Job| finish(conn, job).await)
            .await
            .unwrap();
        assert_eq!(report.processed, 60);
        let mut object = deadpool.get().await.unwrap();
        assert_eq!(duplicates_and_left(&mut object).await, (0, 0));

        let reset = || diesel::update(jobs::table).set(jobs::done.eq(false));
        reset().execute(&mut *object).await.unwrap();
        let report = pending()
            .build_claim()
            .worker(&stop)
            .stop_when_empty()
            .run(&mut object, async |conn: &mut deadpool::Object<Conn>, job: Job| {
                finish(conn, job).await
            })
            .await
            .unwrap();
        assert_eq!(report.processed, 60);

        let bb8 = bb8_pool(&db.url, 1).await;
        let mut pooled = bb8.get().await.unwrap();
        reset().execute(&mut *pooled).await.unwrap();
        let report = pending()
            .build_claim()
            .worker(&stop)
            .stop_when_empty()
            .run(&mut pooled, async |conn: &mut bb8::PooledConnection<'_, Conn>, job: Job| {
                finish(conn, job).await
            })
            .await
            .unwrap();
        assert_eq!(report.processed, 60);
    }

    /// Eight loops in the key's order, which steer their takes around each
    /// other's batches, drain the queue with `stop_when_empty` on a bb8 pool:
    /// every job is done once, and so is a job that failed once and that its
    /// failure hook left in the queue with no backoff, behind the loops.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn loops_in_key_order_drain_the_queue_around_each_other() {
        let db = TestDb::new();
        testkit::fixtures::create_schema(&mut blocking(&db.url), testkit::fixtures::schema_of(BACKEND));
        insert_jobs(&mut blocking(&db.url), 600);
        let pool = bb8_pool(&db.url, 8).await;
        let failed = std::sync::atomic::AtomicBool::new(false);
        let report = jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .build_claim()
            .on_failure(async |_: &mut Conn, _: Job, _: &Error| Ok(()))
            .worker(&StopHandle::new())
            .concurrency(8)
            .failure_backoff(Duration::ZERO, Duration::ZERO)
            .stop_when_empty()
            .run_pooled(&pool, async |conn: &mut Conn, job: Job| {
                if job.id == 7 && !failed.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    return Err(Error::InvalidArgument("fails once".into()));
                }
                finish(conn, job).await
            })
            .await
            .unwrap();
        assert_eq!((report.processed, report.failed), (600, 1));
        assert_eq!(duplicates_and_left(&mut pool.get().await.unwrap()).await, (0, 0));
    }

    /// Loops spawned each on a task of their own run in parallel: while one
    /// loop's job blocks its thread for a second (in `block_in_place`, as
    /// tokio asks of blocking code), another loop does every other job, on
    /// deadpool; every job is done once. (Loops that are futures of one
    /// future do none meanwhile.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn spawned_loops_go_on_while_one_blocks_its_thread() {
        let db = TestDb::new();
        testkit::fixtures::create_schema(&mut blocking(&db.url), testkit::fixtures::schema_of(BACKEND));
        insert_jobs(&mut blocking(&db.url), 40);
        let pool = deadpool_pool(&db.url, 3);
        let blocked = std::sync::Arc::new(std::sync::Mutex::new(None::<(Instant, Instant)>));
        let others = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
        let (blocked_at, others_at) = (blocked.clone(), others.clone());
        let report = jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .build_claim()
            .worker(&StopHandle::new())
            .concurrency(2)
            .stop_when_empty()
            // A `'static` closure that captures state: each call clones
            // what its future needs (see the `aio` docs' "Closures").
            .spawn_pooled(
                &pool,
                diesel_claim::aio::scoped(move |conn: &mut Conn, job: Job| {
                    let (blocked_at, others_at) = (blocked_at.clone(), others_at.clone());
                    async move {
                        if job.id == 1 {
                            let began = Instant::now();
                            tokio::task::block_in_place(|| std::thread::sleep(Duration::from_secs(1)));
                            *blocked_at.lock().unwrap() = Some((began, Instant::now()));
                        } else {
                            others_at.lock().unwrap().push(Instant::now());
                        }
                        finish(conn, job).await
                    }
                    .scope_boxed()
                }),
            )
            .await
            .unwrap();
        assert_eq!(report.processed, 40);
        assert_eq!(duplicates_and_left(&mut pool.get().await.unwrap()).await, (0, 0));
        let (began, ended) = blocked.lock().unwrap().expect("job 1 ran");
        let during = others.lock().unwrap().iter().filter(|at| **at > began && **at < ended).count();
        assert!(during >= 10, "only {during} of 39 jobs were done while job 1 blocked its thread");
    }

    /// A spawned loop whose job panics stops the others: the worker's
    /// future ends with the panic at once, where the caller's stop would
    /// otherwise never come.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_spawned_loop_that_panics_stops_the_others() {
        let db = TestDb::new();
        testkit::fixtures::create_schema(&mut blocking(&db.url), testkit::fixtures::schema_of(BACKEND));
        insert_jobs(&mut blocking(&db.url), 5);
        let pool = deadpool_pool(&db.url, 3);
        // The first job run, by either loop, panics, and no other: the
        // other loop could go on for ever.
        let panicked = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let worker = jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .build_claim()
            .worker(&StopHandle::new())
            .concurrency(2)
            .poll_interval(Duration::from_millis(5), Duration::from_millis(20))
            .spawn_pooled(
                &pool,
                diesel_claim::aio::scoped(move |conn: &mut Conn, job: Job| {
                    let first = !panicked.swap(true, std::sync::atomic::Ordering::SeqCst);
                    async move {
                        if first {
                            panic!("job {} panics", job.id);
                        }
                        finish(conn, job).await
                    }
                    .scope_boxed()
                }),
            );
        let ended = tokio::time::timeout(Duration::from_secs(20), tokio::spawn(worker)).await;
        let joined = ended.expect("the other loop went on after one panicked");
        assert!(joined.is_err_and(|error| error.is_panic()));
    }

    /// Four loops on a bb8 pool share one backoff for failing jobs: no loop
    /// runs a job before its backoff (recorded when its last run failed,
    /// doubling) has passed, and no two runs of a job overlap.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn loops_share_the_backoff_of_a_failing_job() {
        let db = TestDb::new();
        testkit::fixtures::create_schema(&mut blocking(&db.url), testkit::fixtures::schema_of(BACKEND));
        insert_jobs(&mut blocking(&db.url), 3);
        let pool = bb8_pool(&db.url, 5).await;
        let (first, max) = (Duration::from_millis(60), Duration::from_millis(240));
        let runs = std::sync::Mutex::new(Vec::<(i32, Instant, Instant)>::new());
        let stop = StopHandle::new();
        let began = Instant::now();
        let report = pending()
            .build_claim()
            .on_failure(async |_: &mut Conn, _: Job, _: &Error| Ok(()))
            .worker(&stop)
            .concurrency(4)
            .poll_interval(Duration::from_millis(1), Duration::from_millis(2))
            .failure_backoff(first, max)
            .run_pooled(&pool, async |_: &mut Conn, job: Job| {
                let started = Instant::now();
                if began.elapsed() > Duration::from_millis(1500) {
                    stop.stop();
                }
                tokio::task::yield_now().await;
                runs.lock().unwrap().push((job.id, started, Instant::now()));
                Err(Error::InvalidArgument(format!("job {} fails", job.id)))
            })
            .await
            .unwrap();
        let runs = runs.into_inner().unwrap();
        assert_eq!(report.failed as usize, runs.len());
        crate::pooled::assert_each_run_after_its_backoff(&runs, 3, (first, max));
    }

    /// A boxed queue, its filter chosen at run time (the job kinds a
    /// service runs), runs on bb8 and on deadpool through `rebuild`: four
    /// loops take every job of those kinds once, and none of the others. (A
    /// boxed query is claimed in key order: its own order cannot be read.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rebuilt_boxed_queue_runs_on_bb8_and_deadpool() {
        let db = TestDb::new();
        let setup = &mut blocking(&db.url);
        testkit::fixtures::create_schema(setup, testkit::fixtures::schema_of(BACKEND));
        let kinds: Vec<i32> = vec![0, 1, 3];
        let queue = move || {
            let kinds = kinds.clone();
            diesel_claim::rebuild(move || {
                jobs::table
                    .filter(jobs::done.eq(false))
                    .select(Job::as_select())
                    .into_boxed()
                    .filter(jobs::priority.eq_any(kinds.clone()))
            })
        };
        let count = |done: bool, priority: i32, conn: &mut Db| -> i64 {
            use diesel::BoolExpressionMethods;
            let query = jobs::table.filter(jobs::done.eq(done).and(jobs::priority.eq(priority))).count();
            diesel::RunQueryDsl::get_result(query, conn).unwrap()
        };
        async fn count_once(conn: &mut Conn, job: Job) -> Result<(), Error> {
            diesel::update(&job).set(jobs::times_done.eq(jobs::times_done + 1)).execute(conn).await?;
            Ok(())
        }
        let bb8 = bb8_pool(&db.url, 5).await;
        let deadpool = deadpool_pool(&db.url, 5);
        for on_deadpool in [false, true] {
            diesel::RunQueryDsl::execute(diesel::delete(jobs::table), setup).unwrap();
            insert_jobs(setup, 400);
            let worker = queue()
                .build_claim()
                .then_update(jobs::done.eq(true))
                .worker(&StopHandle::new())
                .concurrency(4)
                .stop_when_empty();
            let report = if on_deadpool {
                worker.run_pooled(&deadpool, async |conn: &mut Conn, job: Job| count_once(conn, job).await).await
            } else {
                worker.run_pooled(&bb8, async |conn: &mut Conn, job: Job| count_once(conn, job).await).await
            };
            assert_eq!(report.unwrap().processed, 300, "on deadpool: {on_deadpool}");
            let twice: i64 = diesel::RunQueryDsl::get_result(
                jobs::table.filter(jobs::times_done.gt(1)).count(),
                setup,
            )
            .unwrap();
            let left: i64 = [0, 1, 3].into_iter().map(|kind| count(false, kind, setup)).sum();
            assert_eq!((twice, left, count(true, 2, setup)), (0, 0, 0), "on deadpool: {on_deadpool}");
        }
    }

    /// Runs a pooled worker of 4 loops on `url` over 600 slow jobs while
    /// `disrupt` runs beside it, ending its sessions `ends` times; every job
    /// is done once.
    async fn drain_through(url: &str, ends: u64, disrupt: impl std::future::Future<Output = ()>) {
        let setup = &mut blocking(url);
        testkit::fixtures::create_schema(setup, testkit::fixtures::schema_of(BACKEND));
        insert_jobs(setup, 600);
        let pool = bb8_pool(url, 5).await;
        let stop = StopHandle::new();
        // In the key's order: the loops steer around each other's batches,
        // and find the rows a lost connection rolled back behind them.
        let worker = jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .build_claim()
            .worker(&stop)
            .concurrency(4)
            .stop_when_empty()
            .run_pooled(&pool, async |conn: &mut Conn, job: Job| {
                tokio::time::sleep(Duration::from_millis(5)).await;
                finish(conn, job).await
            });
        let (report, ()) = tokio::join!(worker, disrupt);
        let report = report.unwrap();
        let mut conn = Conn::establish(url).await.unwrap();
        assert_eq!(duplicates_and_left(&mut conn).await, (0, 0), "{report:?}");
        // A commit the server made as its session ended may never answer:
        // its job is done once, but not counted (one per loop at most, each
        // time the sessions end).
        assert!((600 - 4 * ends..=600).contains(&report.processed), "{report:?}");
    }

    /// Every session of the worker's database is ended, three times, while
    /// it runs: it goes on on new connections.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pooled_worker_survives_its_sessions_being_terminated() {
        let db = TestDb::new();
        let database = db.name().to_owned();
        let url = db.url.clone();
        drain_through(&db.url, 3, async move {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let (url, database) = (url.clone(), database.clone());
                let ended = tokio::task::spawn_blocking(move || {
                    testkit::sessions::terminate_all_but_mine(&url, &database)
                })
                .await
                .unwrap();
                assert!(ended > 0, "no session to end");
            }
        })
        .await;
    }

    /// Waits until every loop took a job after `since` (see
    /// `LoopTakes::all_since`).
    async fn wait_for_all_since(takes: &LoopTakes, since: Instant) {
        while !takes.all_since(since) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Runs `worker`, whose loops record their jobs in `takes`, while
    /// `server` (at `url`) is restarted (`crate::pooled::restart`); stops it
    /// once every loop took a job since, and returns when the server stopped
    /// and came back.
    async fn through_a_restart(
        server: testkit::PrivateServer,
        url: String,
        takes: &LoopTakes,
        stop: &StopHandle,
        worker: impl std::future::Future<Output = Result<diesel_claim::ClaimReport, Error>>,
    ) -> (Instant, Instant) {
        let restart = async {
            wait_for_all_since(takes, Instant::now()).await;
            let restarted = tokio::task::spawn_blocking(move || {
                let accepts = || <Db as diesel::Connection>::establish(&url).is_ok();
                (crate::pooled::restart(&server, accepts), server)
            });
            let (restarted, server) = restarted.await.unwrap();
            wait_for_all_since(takes, restarted.0).await;
            stop.stop();
            (restarted, server)
        };
        let (report, (restarted, _server)) = tokio::join!(worker, restart);
        report.unwrap();
        restarted
    }

    /// A restart test's server, with a queue deep enough for its worker to
    /// be busy all along.
    fn restart_server() -> (testkit::PrivateServer, String) {
        let (server, url) = testkit::sessions::private_server(BACKEND);
        let setup = &mut blocking(&url);
        testkit::fixtures::create_schema(setup, testkit::fixtures::schema_of(BACKEND));
        insert_jobs(setup, 20_000);
        (server, url)
    }

    /// The server is stopped for as long as the loops' reconnect pauses take
    /// to reach their longest, and started again, with jobs queued: the
    /// loops of a worker on bb8 (futures of one future) take jobs again
    /// within a second of the first that does, though they lost their
    /// connections at different times (see `LoopTakes::job_length`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_loops_take_jobs_again_together_after_a_server_restart_on_bb8() {
        let (server, url) = restart_server();
        let pool = bb8::Pool::builder()
            .max_size(RESTART_LOOPS as u32 + 1)
            .connection_timeout(CONNECTION_TIMEOUT)
            .build(manager(&url, BACKEND == "mysql"))
            .await
            .unwrap();
        let (stop, takes) = (StopHandle::new(), LoopTakes::default());
        let mut took = takes.clone();
        let worker = jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .build_claim()
            .worker(&stop)
            .concurrency(RESTART_LOOPS)
            .run_pooled(
                &pool,
                diesel_claim::aio::scoped(move |conn: &mut Conn, job: Job| {
                    let length = LoopTakes::job_length(took.took());
                    async move {
                        tokio::time::sleep(length).await;
                        finish(conn, job).await
                    }
                    .scope_boxed()
                }),
            );
        let restarted = through_a_restart(server, url.clone(), &takes, &stop, worker).await;
        let pool = format!("bb8, {BACKEND}");
        assert_the_loops_came_back_together(&takes, restarted, &pool);
    }

    /// The restart above, with the loops on deadpool, each on a task of its
    /// own (`spawn_pooled`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_loops_take_jobs_again_together_after_a_server_restart_on_deadpool() {
        let (server, url) = restart_server();
        let pool = deadpool_pool(&url, RESTART_LOOPS + 1);
        let (stop, takes) = (StopHandle::new(), LoopTakes::default());
        let mut took = takes.clone();
        let worker = jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .build_claim()
            .worker(&stop)
            .concurrency(RESTART_LOOPS)
            .spawn_pooled(
                &pool,
                diesel_claim::aio::scoped(move |conn: &mut Conn, job: Job| {
                    let length = LoopTakes::job_length(took.took());
                    async move {
                        tokio::time::sleep(length).await;
                        finish(conn, job).await
                    }
                    .scope_boxed()
                }),
            );
        let restarted = through_a_restart(server, url.clone(), &takes, &stop, worker).await;
        let pool = format!("deadpool, {BACKEND}");
        assert_the_loops_came_back_together(&takes, restarted, &pool);
    }

    /// The server is killed (SIGKILL) and started again while the worker
    /// runs: it waits the restart out and finishes the queue.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pooled_worker_survives_a_server_crash_and_restart() {
        let (server, url) = testkit::sessions::private_server(BACKEND);
        let server = std::sync::Arc::new(server);
        let restarted = std::sync::Arc::clone(&server);
        drain_through(&url, 1, async move {
            tokio::time::sleep(Duration::from_millis(400)).await;
            tokio::task::spawn_blocking(move || {
                restarted.crash();
                std::thread::sleep(Duration::from_millis(500));
                restarted.start();
            })
            .await
            .unwrap();
        })
        .await;
        drop(server);
    }
}

/// A fresh PostgreSQL database with the shop schema, and a deadpool pool of
/// `size` async connections to it.
#[cfg(feature = "postgres")]
fn pg_deadpool(
    size: usize,
) -> (
    testkit::PgTestDb,
    deadpool::Pool<diesel_async::AsyncPgConnection>,
) {
    let db = testkit::PgTestDb::new();
    testkit::fixtures::create_schema(
        &mut <diesel::PgConnection as diesel::Connection>::establish(&db.url).unwrap(),
        testkit::fixtures::POSTGRES_SCHEMA,
    );
    let pool = deadpool::Pool::builder(manager(&db.url, false))
        .max_size(size)
        .build()
        .unwrap();
    (db, pool)
}

/// Inserts job `id`, due now, and notifies channel `jobs` in the same
/// transaction.
#[cfg(feature = "postgres")]
async fn enqueue_and_notify(producer: &mut diesel_async::AsyncPgConnection, id: i32) {
    producer
        .transaction(async |conn: &mut diesel_async::AsyncPgConnection| {
            diesel::insert_into(jobs::table)
                .values((
                    jobs::id.eq(id),
                    jobs::priority.eq(0),
                    jobs::due.eq(diesel::dsl::now),
                ))
                .execute(conn)
                .await?;
            diesel_claim::aio::notify(conn, "jobs").await
        })
        .await
        .unwrap();
}

/// A pooled worker listening (PostgreSQL): with polls too rare to matter,
/// `aio::notify` sent in the producer's transaction wakes its loops, through
/// the listener's session being ended.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_wakes_the_loops_and_comes_back_after_its_session_ends() {
    use diesel_async::AsyncPgConnection;
    let (db, pool) = pg_deadpool(3);
    let mut producer = AsyncPgConnection::establish(&db.url).await.unwrap();
    let stop = StopHandle::new();
    let worker = jobs::table
        .filter(jobs::done.eq(false))
        .select(Job::as_select())
        .build_claim()
        .worker(&stop)
        .concurrency(2)
        .listen("jobs")
        .poll_interval(Duration::from_secs(30), Duration::from_secs(30))
        .run_pooled(&pool, async |conn: &mut AsyncPgConnection, job: Job| {
            diesel::update(&job)
                .set((
                    jobs::done.eq(true),
                    jobs::times_done.eq(jobs::times_done + 1),
                ))
                .execute(conn)
                .await?;
            Ok::<_, Error>(())
        });
    let rounds = async {
        // The first claims find nothing; then the loops wait 30 s.
        tokio::time::sleep(Duration::from_millis(300)).await;
        for id in 1..=3 {
            enqueue_and_notify(&mut producer, id).await;
            // Far below the 30 s polls, with room for a loaded machine: the
            // listener finds its dead connection within a second.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let done: bool = jobs::table
                    .find(id)
                    .select(jobs::done)
                    .get_result(&mut producer)
                    .await
                    .unwrap();
                if done {
                    break;
                }
                assert!(Instant::now() < deadline, "job {id} was not woken for");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let (url, name) = (db.url.clone(), db.name().to_owned());
            let ended = tokio::task::spawn_blocking(move || {
                testkit::sessions::terminate_all_but_mine(&url, &name)
            })
            .await
            .unwrap();
            assert!(ended > 0);
            // The producer's session was ended too.
            producer = AsyncPgConnection::establish(&db.url).await.unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        stop.stop();
    };
    let (report, ()) = tokio::join!(worker, rounds);
    assert_eq!(report.unwrap().processed, 3);
}

/// A wake-up while a loop waits for a connection does not end the loop
/// (PostgreSQL): the application holds the pool's one connection while the
/// listener, outside the pool, starts listening (which wakes the loops) and
/// a job's notification comes; once the connection is given back, the loop
/// claims the job. (Were a wake-up to end the wait as a stop does, the
/// worker would have ended with nothing done.)
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_while_a_loop_waits_for_a_connection_does_not_end_it() {
    use diesel_async::AsyncPgConnection;
    let (db, pool) = pg_deadpool(1);
    let held = pool.get().await.unwrap();
    let mut producer = AsyncPgConnection::establish(&db.url).await.unwrap();
    let stop = StopHandle::new();
    let worker = jobs::table
        .filter(jobs::done.eq(false))
        .select(Job::as_select())
        .build_claim()
        .worker(&stop)
        .listen("jobs")
        .poll_interval(Duration::from_secs(30), Duration::from_secs(30))
        .run_pooled(&pool, async |conn: &mut AsyncPgConnection, job: Job| {
            diesel::update(&job)
                .set(jobs::done.eq(true))
                .execute(conn)
                .await?;
            Ok::<_, Error>(())
        });
    let rounds = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        enqueue_and_notify(&mut producer, 1).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(held);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let done: bool = jobs::table
                .find(1)
                .select(jobs::done)
                .get_result(&mut producer)
                .await
                .unwrap();
            if done {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the job was not claimed once the connection came back"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.stop();
    };
    let (report, ()) = tokio::join!(worker, rounds);
    assert_eq!(report.unwrap().processed, 1);
}
