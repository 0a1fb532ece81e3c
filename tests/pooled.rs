//! Workers on a pool: a small pool shared by many claim loops and the
//! application's own queries, `stop_when_empty`, loops in the key's order
//! steering around each other's batches (and a job left behind them taken
//! while the queue is busy), sessions terminated under a running worker, a
//! server killed and started again, and a server stopped for long enough
//! that the loops' reconnect pauses reach their longest, after which the
//! loops take jobs again together; and 200,000 done jobs that vacuum may
//! not remove, which leave the loops' takes as cheap as on a clean queue.

use std::sync::atomic::{AtomicBool, Ordering};
#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::sync::{atomic::AtomicUsize, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use diesel_claim::prelude::*;
use diesel_claim::{Error, StopHandle};

use testkit::fixtures::{insert_jobs, jobs, on_every_backend, Job};

use crate::StopsOnDrop;

/// Claimers on MySQL and MariaDB run at `READ COMMITTED` (see the guide);
/// SQLite waits for its one writer.
#[derive(Debug)]
struct Session(&'static str);

impl<C: SimpleConnection> CustomizeConnection<C, diesel::r2d2::Error> for Session {
    fn on_acquire(&self, conn: &mut C) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute(self.0)
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// What a session of each backend is set up with.
pub fn session_setup(backend: &str) -> &'static str {
    match backend {
        "mysql" => "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
        "sqlite" => "PRAGMA busy_timeout = 10000",
        _ => "SELECT 1",
    }
}

/// A pool of `size` connections to `url`, each set up for claiming.
pub fn pool_of<C>(url: &str, size: u32, backend: &'static str) -> Pool<ConnectionManager<C>>
where
    C: diesel::r2d2::R2D2Connection + SimpleConnection + Send + 'static,
{
    Pool::builder()
        .max_size(size)
        .connection_timeout(Duration::from_secs(5))
        .connection_customizer(Box::new(Session(session_setup(backend))))
        .build_unchecked(ConnectionManager::new(url))
}

/// Checks the runs `(job, started, ended)` of `jobs` jobs that failed on
/// every run for about 1.5 s, with a backoff from `first` doubling to `max`:
/// no job ran again before its backoff had passed since its last run ended
/// (so no two runs overlap), and each ran about as often as the backoff
/// allows (60 + 120 + 240 + 240 … ms: about 7 runs, where loops that each
/// kept their own backoff would run it about 4 times as often).
pub fn assert_each_run_after_its_backoff(
    runs: &[(i32, Instant, Instant)],
    jobs: i32,
    (first, max): (Duration, Duration),
) {
    for id in 1..=jobs {
        let of_job: Vec<_> = runs.iter().filter(|run| run.0 == id).collect();
        assert!(
            (4..=9).contains(&of_job.len()),
            "job {id} ran {} times",
            of_job.len()
        );
        for (failures, pair) in of_job.windows(2).enumerate() {
            let backoff = (first * (1 << failures.min(8))).min(max);
            let gap = pair[1].1.saturating_duration_since(pair[0].2);
            assert!(
                gap >= backoff,
                "job {id} ran again {gap:?} after failing, before its backoff of {backoff:?}"
            );
        }
    }
}

/// The loops of a worker on a pool that a restart test runs.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub const RESTART_LOOPS: usize = 8;

/// How long a restart test keeps its server down: long enough for the
/// loops' reconnect pauses to reach their longest (5 s, after 6.35 s of
/// failures).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub const DOWN_FOR: Duration = Duration::from_secs(10);

/// The connection timeout of a restart test's r2d2 and bb8 pools, short as
/// the guide asks of a worker's pool: it bounds the pool's own pause
/// between its tries to connect, to half of it.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a restart test waits for every loop to take a job again.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub const BACK_WITHIN: Duration = Duration::from_secs(30);

/// When each loop of a worker on a pool took its jobs: each loop runs a
/// clone of the worker's closure, and the clone that holds this numbers its
/// loop on its first job.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug, Clone, Default)]
pub struct LoopTakes {
    loops: Arc<AtomicUsize>,
    taken: Arc<Mutex<Vec<(usize, Instant)>>>,
    /// This clone's loop, once it took a job.
    index: Option<usize>,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl LoopTakes {
    /// This clone's loop took a job, now; returns the loop's number.
    pub fn took(&mut self) -> usize {
        let loops = &self.loops;
        let index = *self
            .index
            .get_or_insert_with(|| loops.fetch_add(1, Ordering::Relaxed));
        self.taken.lock().unwrap().push((index, Instant::now()));
        index
    }

    /// How long the jobs of loop `index` take: each loop's a time of its
    /// own, so that the loops find the server gone at different times and
    /// try to reconnect at different times, as jobs of mixed lengths make
    /// them.
    pub fn job_length(index: usize) -> Duration {
        Duration::from_millis(2 + 300 * index as u64)
    }

    /// When each of the [`RESTART_LOOPS`] loops first took a job after
    /// `since`, if it did.
    pub fn first_since(&self, since: Instant) -> Vec<Option<Instant>> {
        let mut firsts = vec![None; RESTART_LOOPS];
        for &(index, at) in self.taken.lock().unwrap().iter() {
            if let Some(first) = firsts.get_mut(index).filter(|_| at > since) {
                *first = Some(first.map_or(at, |earlier: Instant| earlier.min(at)));
            }
        }
        firsts
    }

    /// Whether every loop took a job after `since`, or [`BACK_WITHIN`]
    /// passed since.
    pub fn all_since(&self, since: Instant) -> bool {
        since.elapsed() > BACK_WITHIN || self.first_since(since).iter().all(Option::is_some)
    }
}

/// Stops `server` for [`DOWN_FOR`] and starts it again; returns when it was
/// stopped, and when it accepted connections again (the first of `accepts`,
/// tried every 10 ms from before it starts, that returns true: the server
/// may accept a client's connections before `start` has seen it).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub fn restart(
    server: &testkit::PrivateServer,
    accepts: impl Fn() -> bool + Sync,
) -> (Instant, Instant) {
    server.stop();
    let stopped = Instant::now();
    thread::sleep(DOWN_FOR);
    let back = thread::scope(|scope| {
        let probe = scope.spawn(|| {
            while !accepts() {
                thread::sleep(Duration::from_millis(10));
            }
            Instant::now()
        });
        server.start();
        probe.join().unwrap()
    });
    (stopped, back)
}

/// Checks that every loop took jobs again after the server `stopped` and
/// came `back`, within a second of the first that did; says when the first
/// and the last took their first job, from the server's accepting
/// connections again.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub fn assert_the_loops_came_back_together(
    takes: &LoopTakes,
    (stopped, back): (Instant, Instant),
    pool: &str,
) {
    let firsts = takes.first_since(stopped);
    let after_back = |at: &Instant| match at.checked_duration_since(back) {
        Some(after) => format!("{:.0} ms", after.as_secs_f64() * 1e3),
        None => format!("-{:.0} ms", (back - *at).as_secs_f64() * 1e3),
    };
    let came: Vec<Instant> = firsts.iter().flatten().copied().collect();
    let all: Vec<String> = firsts
        .iter()
        .map(|first| first.as_ref().map_or("none".to_owned(), after_back))
        .collect();
    assert_eq!(
        came.len(),
        RESTART_LOOPS,
        "on {pool}, loops took no job within {BACK_WITHIN:?} of the restart: {all:?}"
    );
    let (first, last) = (came.iter().min().unwrap(), came.iter().max().unwrap());
    println!(
        "restart on {pool}: from accepting connections to the first job {}, to all {RESTART_LOOPS} loops' {}",
        after_back(first),
        after_back(last)
    );
    assert!(
        *last - *first <= Duration::from_secs(1),
        "on {pool}, the loops took their first jobs after the restart at {all:?}, from its accepting connections"
    );
}

on_every_backend! {
    /// Jobs not done, by priority.
    type Pending = diesel::dsl::Order<
        diesel::dsl::Select<
            diesel::dsl::Filter<jobs::table, diesel::dsl::Eq<jobs::done, bool>>,
            diesel::dsl::AsSelect<Job, <Conn as Connection>::Backend>,
        >,
        diesel::dsl::Desc<jobs::priority>,
    >;

    fn pending() -> Pending {
        jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .order(jobs::priority.desc())
    }

    /// Does a job: marks it done, counting how often it was done.
    fn finish(conn: &mut Conn, job: Job) -> Result<(), Error> {
        diesel::update(&job)
            .set((jobs::done.eq(true), jobs::times_done.eq(jobs::times_done + 1)))
            .execute(conn)?;
        Ok(())
    }

    /// Jobs done more than once, and jobs not done.
    fn duplicates_and_left(conn: &mut Conn) -> (i64, i64) {
        let twice = jobs::table.filter(jobs::times_done.gt(1)).count().get_result(conn).unwrap();
        let left = jobs::table.filter(jobs::done.eq(false)).count().get_result(conn).unwrap();
        (twice, left)
    }

    fn pool(db_url: &str, size: u32) -> Pool {
        pool_of::<Conn>(db_url, size, BACKEND)
    }

    /// Eight claim loops share a pool of four with a producer that inserts
    /// the jobs while they run, and with the jobs' own queries: every job is
    /// done once, and the worker stops when told.
    #[test]
    fn eight_loops_share_a_pool_of_four_with_the_application() {
        let (db, _) = test_db(1);
        let pool = pool(&db.url, 4);
        let stop = StopHandle::new();
        const JOBS: i32 = 400;
        let report = thread::scope(|scope| {
            let producer = scope.spawn(|| {
                for first in (1..=JOBS).step_by(20) {
                    let rows: Vec<_> = (first..first + 20)
                        .map(|id| (jobs::id.eq(id), jobs::priority.eq(id % 3), jobs::due.eq(diesel::dsl::now)))
                        .collect();
                    let mut conn = pool.get().unwrap();
                    diesel::insert_into(jobs::table).values(&rows).execute(&mut conn).unwrap();
                    drop(conn);
                    thread::sleep(Duration::from_millis(5));
                }
            });
            let watcher = scope.spawn(|| {
                let _stops = StopsOnDrop(&stop);
                producer.join().unwrap();
                let deadline = Instant::now() + Duration::from_secs(120);
                while duplicates_and_left(&mut pool.get().unwrap()).1 > 0 {
                    assert!(Instant::now() < deadline, "the jobs were not done in time");
                    thread::sleep(Duration::from_millis(20));
                }
                stop.stop();
            });
            let report = pending()
                .build_claim()
                .worker(&stop)
                .concurrency(8)
                .poll_interval(Duration::from_millis(5), Duration::from_millis(50))
                .run_pooled(&pool, |conn: &mut Conn, job: Job| {
                    // The job's own queries, on its claim's connection.
                    let _: i64 = jobs::table.count().get_result(conn)?;
                    finish(conn, job)
                });
            watcher.join().unwrap();
            report
        })
        .unwrap();
        assert_eq!(report.processed, JOBS as u64);
        assert_eq!(duplicates_and_left(&mut pool.get().unwrap()), (0, 0));
        // Idle loops hold no connection: the pool has them all back.
        assert_eq!(pool.state().idle_connections, pool.state().connections);
    }

    /// `stop_when_empty` returns once nothing is pending, on a pool and on
    /// one connection, with every job done once.
    #[test]
    fn stop_when_empty_returns_once_the_queue_is_empty() {
        let (db, _) = test_db(1);
        let pool = pool(&db.url, 3);
        insert_jobs(&mut pool.get().unwrap(), 60);
        let stop = StopHandle::new();
        let report = pending()
            .build_claim()
            .worker(&stop)
            .concurrency(2)
            .stop_when_empty()
            .run_pooled(&pool, finish)
            .unwrap();
        assert_eq!(report.processed, 60);
        assert_eq!(duplicates_and_left(&mut pool.get().unwrap()), (0, 0));

        diesel::update(jobs::table).set(jobs::done.eq(false)).execute(&mut pool.get().unwrap()).unwrap();
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        let report = pending()
            .build_claim()
            .worker(&stop)
            .stop_when_empty()
            .run(conn, finish)
            .unwrap();
        assert_eq!(report.processed, 60);
        // One connection runs one loop.
        let refused = pending().build_claim().worker(&stop).concurrency(2).run(conn, finish);
        assert!(matches!(refused, Err(Error::InvalidArgument(message)) if message.contains("run_pooled")));
    }

    /// Eight loops in the key's order, which steer their takes around each
    /// other's batches, drain the queue with `stop_when_empty`: every job is
    /// done once, and so is a job that failed once and that its failure hook
    /// left in the queue with no backoff, behind the loops.
    #[test]
    fn loops_in_key_order_drain_the_queue_around_each_other() {
        let (db, _) = test_db(1);
        let pool = pool(&db.url, 8);
        insert_jobs(&mut pool.get().unwrap(), 600);
        let failed = AtomicBool::new(false);
        let report = jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .build_claim()
            .on_failure(|_: &mut Conn, _: Job, _: &Error| Ok(()))
            .worker(&StopHandle::new())
            .concurrency(8)
            .failure_backoff(Duration::ZERO, Duration::ZERO)
            .stop_when_empty()
            .run_pooled(&pool, |conn: &mut Conn, job: Job| {
                if job.id == 7 && !failed.swap(true, Ordering::SeqCst) {
                    return Err(Error::InvalidArgument("fails once".into()));
                }
                finish(conn, job)
            })
            .unwrap();
        assert_eq!((report.processed, report.failed), (600, 1));
        assert_eq!(duplicates_and_left(&mut pool.get().unwrap()), (0, 0));
    }

    /// Four loops on a pool share one backoff for failing jobs: no loop runs
    /// a job before its backoff (recorded when its last run failed, doubling)
    /// has passed, so no two loops take a failing job at one instant, and no
    /// two runs of a job overlap.
    #[test]
    fn loops_share_the_backoff_of_a_failing_job() {
        let (db, _) = test_db(1);
        let pool = pool(&db.url, 5);
        insert_jobs(&mut pool.get().unwrap(), 3);
        let (first, max) = (Duration::from_millis(60), Duration::from_millis(240));
        let runs = std::sync::Mutex::new(Vec::<(i32, Instant, Instant)>::new());
        let stop = StopHandle::new();
        let began = Instant::now();
        let report = pending()
            .build_claim()
            .on_failure(|_: &mut Conn, _: Job, _: &Error| Ok(()))
            .worker(&stop)
            .concurrency(4)
            .poll_interval(Duration::from_millis(1), Duration::from_millis(2))
            .failure_backoff(first, max)
            .run_pooled(&pool, |_: &mut Conn, job: Job| {
                let started = Instant::now();
                if began.elapsed() > Duration::from_millis(1500) {
                    stop.stop();
                }
                runs.lock().unwrap().push((job.id, started, Instant::now()));
                Err(Error::InvalidArgument(format!("job {} fails", job.id)))
            })
            .unwrap();
        let runs = runs.into_inner().unwrap();
        assert_eq!(report.failed as usize, runs.len());
        assert_each_run_after_its_backoff(&runs, 3, (first, max));
    }

    /// A boxed queue, its filter chosen at run time (the job kinds a
    /// service runs, as a `Box<dyn BoxableExpression>`), runs on a pool
    /// through `rebuild`: four loops take every job of those kinds once, and
    /// none of the others.
    #[test]
    fn a_rebuilt_boxed_queue_runs_on_a_pool() {
        let (db, _) = test_db(1);
        let pool = pool(&db.url, 5);
        insert_jobs(&mut pool.get().unwrap(), 400);
        let kinds: Vec<i32> = vec![0, 1, 3];
        type Backend = <Conn as Connection>::Backend;
        let queue = diesel_claim::rebuild(move || {
            let of_kinds: Box<dyn BoxableExpression<jobs::table, Backend, SqlType = diesel::sql_types::Bool>> =
                Box::new(jobs::priority.eq_any(kinds.clone()));
            jobs::table
                .filter(jobs::done.eq(false))
                .filter(of_kinds)
                .order(jobs::priority.desc())
                .select(Job::as_select())
        });
        let report = queue
            .build_claim()
            .then_update(jobs::done.eq(true))
            .worker(&StopHandle::new())
            .concurrency(4)
            .stop_when_empty()
            .run_pooled(&pool, |conn: &mut Conn, job: Job| {
                diesel::update(&job).set(jobs::times_done.eq(jobs::times_done + 1)).execute(conn)?;
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!(report.processed, 300);
        let conn = &mut pool.get().unwrap();
        let twice: i64 = jobs::table.filter(jobs::times_done.gt(1)).count().get_result(conn).unwrap();
        let other_kind_done: i64 =
            jobs::table.filter(jobs::priority.eq(2).and(jobs::times_done.gt(0))).count().get_result(conn).unwrap();
        let left: i64 = jobs::table.filter(jobs::done.eq(false).and(jobs::priority.ne(2))).count().get_result(conn).unwrap();
        assert_eq!((twice, other_kind_done, left), (0, 0, 0));
    }
}

macro_rules! with_row_locks {
    ($module:ident, $feature:literal, $conn:ty, $test_db:ident, $backend:literal) => {
        #[cfg(feature = $feature)]
        mod $module {
            use super::*;

            type Conn = $conn;

            fn finish(conn: &mut Conn, job: Job) -> Result<(), Error> {
                diesel::update(&job)
                    .set((
                        jobs::done.eq(true),
                        jobs::times_done.eq(jobs::times_done + 1),
                    ))
                    .execute(conn)?;
                Ok(())
            }

            fn counts(conn: &mut Conn) -> (i64, i64) {
                let twice = jobs::table
                    .filter(jobs::times_done.gt(1))
                    .count()
                    .get_result(conn)
                    .unwrap();
                let left = jobs::table
                    .filter(jobs::done.eq(false))
                    .count()
                    .get_result(conn)
                    .unwrap();
                (twice, left)
            }

            /// Whether job `id` is done, and how many jobs are not.
            fn done_and_pending(conn: &mut Conn, id: i32) -> (bool, i64) {
                let done = jobs::table.find(id).select(jobs::done).first(conn).unwrap();
                let pending = jobs::table
                    .filter(jobs::done.eq(false))
                    .count()
                    .get_result(conn)
                    .unwrap();
                (done, pending)
            }

            /// A job that another process held while the loops (in the key's
            /// order, steering past each other's batches) went by, and then
            /// let go, is taken while the queue stays busy, with a producer
            /// adding jobs faster than the loops take them.
            #[test]
            fn a_job_let_go_behind_the_loops_is_taken_while_the_queue_stays_busy() {
                let db = testkit::$test_db::new();
                // One connection each for the holder, the producer, the four
                // loops and the test's own checks: a loaded machine's loops
                // would otherwise keep the checks waiting for one.
                let pool = pool_of::<Conn>(&db.url, 7, $backend);
                testkit::fixtures::create_schema(
                    &mut pool.get().unwrap(),
                    testkit::fixtures::schema_of($backend),
                );
                insert_jobs(&mut pool.get().unwrap(), 200);
                let mut other = pool.get().unwrap();
                other.batch_execute("BEGIN").unwrap();
                let held: Vec<i32> = jobs::table
                    .find(3)
                    .select(jobs::id)
                    .for_update()
                    .load(&mut other)
                    .unwrap();
                assert_eq!(held, [3]);
                let mut conn = pool.get().unwrap();
                let stop = StopHandle::new();
                let report = thread::scope(|scope| {
                    let _stops = StopsOnDrop(&stop);
                    let producer = scope.spawn(|| {
                        let mut conn = pool.get().unwrap();
                        for first in (201..).step_by(25) {
                            if stop.is_stopped() {
                                break;
                            }
                            let rows: Vec<_> = (first..first + 25)
                                .map(|id| {
                                    (
                                        jobs::id.eq(id),
                                        jobs::priority.eq(0),
                                        jobs::due.eq(diesel::dsl::now),
                                    )
                                })
                                .collect();
                            diesel::insert_into(jobs::table)
                                .values(&rows)
                                .execute(&mut conn)
                                .unwrap();
                            thread::sleep(Duration::from_millis(10));
                        }
                    });
                    let worker = scope.spawn(|| {
                        jobs::table
                            .filter(jobs::done.eq(false))
                            .select(Job::as_select())
                            .build_claim()
                            .worker(&stop)
                            .concurrency(4)
                            .poll_interval(Duration::from_millis(5), Duration::from_millis(50))
                            .run_pooled(&pool, |conn: &mut Conn, job: Job| {
                                thread::sleep(Duration::from_millis(2));
                                finish(conn, job)
                            })
                    });
                    // The loops go well past job 3.
                    let deadline = Instant::now() + Duration::from_secs(60);
                    while jobs::table
                        .filter(jobs::done.eq(true))
                        .count()
                        .get_result::<i64>(&mut conn)
                        .unwrap()
                        < 300
                    {
                        assert!(Instant::now() < deadline, "the loops did not get going");
                        thread::sleep(Duration::from_millis(20));
                    }
                    assert_eq!(done_and_pending(&mut conn, 3).0, false);
                    other.batch_execute("ROLLBACK").unwrap();
                    let let_go = Instant::now();
                    let (taken, pending) = loop {
                        let (done, pending) = done_and_pending(&mut conn, 3);
                        if done || let_go.elapsed() > Duration::from_secs(10) {
                            break (done.then(|| let_go.elapsed()), pending);
                        }
                        thread::sleep(Duration::from_millis(5));
                    };
                    stop.stop();
                    producer.join().unwrap();
                    let report = worker.join().unwrap().unwrap();
                    assert!(
                        taken.is_some(),
                        "job 3 was not taken within 10 s of being let go"
                    );
                    assert!(pending > 100, "the queue was not busy: {pending} pending");
                    report
                });
                let (twice, _) = counts(&mut pool.get().unwrap());
                assert_eq!(twice, 0, "{report:?}");
            }

            /// Runs a pooled worker of 4 loops on `url` over 600 slow jobs
            /// while `disrupt` runs beside it, ending its sessions `ends`
            /// times; every job is done once.
            fn drain_through(url: &str, ends: u64, disrupt: impl FnOnce(&StopHandle) + Send) {
                let pool = pool_of::<Conn>(url, 5, $backend);
                testkit::fixtures::create_schema(
                    &mut pool.get().unwrap(),
                    testkit::fixtures::schema_of($backend),
                );
                insert_jobs(&mut pool.get().unwrap(), 600);
                let stop = StopHandle::new();
                let report = thread::scope(|scope| {
                    let _stops = StopsOnDrop(&stop);
                    let worker = scope.spawn(|| {
                        // In the key's order: the loops steer around each
                        // other's batches, and find the rows a lost
                        // connection rolled back behind them.
                        jobs::table
                            .filter(jobs::done.eq(false))
                            .select(Job::as_select())
                            .build_claim()
                            .worker(&stop)
                            .concurrency(4)
                            .stop_when_empty()
                            .run_pooled(&pool, |conn: &mut Conn, job: Job| {
                                thread::sleep(Duration::from_millis(5));
                                finish(conn, job)
                            })
                    });
                    disrupt(&stop);
                    worker.join().unwrap()
                })
                .unwrap();
                let (twice, left) = counts(&mut pool.get().unwrap());
                assert_eq!((twice, left), (0, 0), "{report:?}");
                // A commit the server made as its session ended may never answer:
                // its job is done once, but not counted (one per loop at most,
                // each time the sessions end).
                assert!(
                    (600 - 4 * ends..=600).contains(&report.processed),
                    "{report:?}"
                );
            }

            /// The server is stopped for as long as the loops' reconnect
            /// pauses take to reach their longest, and started again, with
            /// jobs queued: the loops take jobs again within a second of the
            /// first that does, though they lost their connections at
            /// different times (see `LoopTakes::job_length`).
            #[test]
            fn the_loops_take_jobs_again_together_after_a_server_restart() {
                let (server, url) = testkit::sessions::private_server($backend);
                let pool = Pool::builder()
                    .max_size(RESTART_LOOPS as u32 + 1)
                    .connection_timeout(CONNECTION_TIMEOUT)
                    .connection_customizer(Box::new(Session(session_setup($backend))))
                    .build_unchecked(ConnectionManager::<Conn>::new(&url));
                testkit::fixtures::create_schema(
                    &mut pool.get().unwrap(),
                    testkit::fixtures::schema_of($backend),
                );
                insert_jobs(&mut pool.get().unwrap(), 20_000);
                let stop = StopHandle::new();
                let takes = LoopTakes::default();
                let mut took = takes.clone();
                let restarted = thread::scope(|scope| {
                    let worker = scope.spawn(|| {
                        jobs::table
                            .filter(jobs::done.eq(false))
                            .select(Job::as_select())
                            .build_claim()
                            .worker(&stop)
                            .concurrency(RESTART_LOOPS)
                            .run_pooled(&pool, move |conn: &mut Conn, job: Job| {
                                thread::sleep(LoopTakes::job_length(took.took()));
                                finish(conn, job)
                            })
                    });
                    let started = Instant::now();
                    while !takes.all_since(started) {
                        thread::sleep(Duration::from_millis(10));
                    }
                    let restarted = restart(&server, || Conn::establish(&url).is_ok());
                    while !takes.all_since(restarted.0) {
                        thread::sleep(Duration::from_millis(10));
                    }
                    stop.stop();
                    worker.join().unwrap().unwrap();
                    restarted
                });
                assert_the_loops_came_back_together(&takes, restarted, concat!("r2d2, ", $backend));
            }

            /// Every session of the worker's database is ended, three times,
            /// while it runs: it goes on on new connections.
            #[test]
            fn a_pooled_worker_survives_its_sessions_being_terminated() {
                let db = testkit::$test_db::new();
                drain_through(&db.url, 3, |_| {
                    for _ in 0..3 {
                        thread::sleep(Duration::from_millis(300));
                        let ended = testkit::sessions::terminate_all_but_mine(&db.url, db.name());
                        assert!(ended > 0, "no session to end");
                    }
                });
            }

            /// The server is killed (SIGKILL) and started again while the
            /// worker runs: it waits the restart out and finishes the queue.
            #[test]
            fn a_pooled_worker_survives_a_server_crash_and_restart() {
                let (server, url) = testkit::sessions::private_server($backend);
                drain_through(&url, 1, |_| {
                    thread::sleep(Duration::from_millis(400));
                    server.crash();
                    thread::sleep(Duration::from_millis(500));
                    server.start();
                });
            }
        }
    };
}

with_row_locks!(pg_locking, "postgres", PgConnection, PgTestDb, "pg");
with_row_locks!(
    mysql_locking,
    "mysql",
    MysqlConnection,
    MysqlTestDb,
    "mysql"
);

/// A pooled worker listening (PostgreSQL): with polls too rare to matter,
/// notifications wake its loops, through the listener's session being ended.
#[cfg(feature = "postgres")]
mod pg_listen {
    use super::*;

    #[test]
    fn the_listener_wakes_the_loops_and_comes_back_after_its_session_ends() {
        let db = testkit::PgTestDb::new();
        let pool = pool_of::<PgConnection>(&db.url, 4, "pg");
        testkit::fixtures::create_schema(
            &mut pool.get().unwrap(),
            testkit::fixtures::POSTGRES_SCHEMA,
        );
        let mut admin = PgConnection::establish(&db.url).unwrap();
        let stop = StopHandle::new();
        let enqueue = |conn: &mut PgConnection, id: i32| {
            conn.transaction(|conn| {
                diesel::insert_into(jobs::table)
                    .values((
                        jobs::id.eq(id),
                        jobs::priority.eq(0),
                        jobs::due.eq(diesel::dsl::now),
                    ))
                    .execute(conn)?;
                diesel_claim::notify(conn, "jobs")
            })
            .unwrap();
        };
        let done = |conn: &mut PgConnection, id: i32| -> bool {
            jobs::table
                .find(id)
                .select(jobs::done)
                .get_result(conn)
                .unwrap()
        };
        let report = thread::scope(|scope| {
            let _stops = StopsOnDrop(&stop);
            let worker = scope.spawn(|| {
                jobs::table
                    .filter(jobs::done.eq(false))
                    .select(Job::as_select())
                    .build_claim()
                    .worker(&stop)
                    .concurrency(2)
                    .listen("jobs")
                    .poll_interval(Duration::from_secs(30), Duration::from_secs(30))
                    .run_pooled(&pool, |conn: &mut PgConnection, job: Job| {
                        diesel::update(&job)
                            .set((
                                jobs::done.eq(true),
                                jobs::times_done.eq(jobs::times_done + 1),
                            ))
                            .execute(conn)?;
                        Ok::<_, Error>(())
                    })
            });
            // The first claims find nothing; then the loops wait 30 s.
            thread::sleep(Duration::from_millis(300));
            for round in 0..3 {
                let id = round + 1;
                enqueue(&mut admin, id);
                // Far below the 30 s polls, with room for a loaded machine: the
                // listener finds its dead connection within a second.
                let deadline = Instant::now() + Duration::from_secs(10);
                while !done(&mut admin, id) {
                    assert!(
                        Instant::now() < deadline,
                        "job {id} was not woken for (round {round})"
                    );
                    thread::sleep(Duration::from_millis(10));
                }
                // Every session but the producer's ends, the listener's among them.
                assert!(testkit::sessions::terminate_all_but_mine(&db.url, db.name()) > 0);
                admin = PgConnection::establish(&db.url).unwrap();
                thread::sleep(Duration::from_millis(300));
            }
            stop.stop();
            worker.join().unwrap()
        })
        .unwrap();
        assert_eq!(report.processed, 3);
    }
}

/// A pooled worker's takes on a queue whose head holds many done jobs that
/// vacuum may not remove, as long as a transaction older than their deletes
/// is open (PostgreSQL).
#[cfg(feature = "postgres")]
mod pg_vacuum_held {
    use super::*;
    use diesel::sql_types::{BigInt, Text};

    const JOBS: i32 = 10_000;
    const DONE_AT_THE_HEAD: i32 = 200_000;

    #[derive(QueryableByName)]
    struct Blocks {
        #[diesel(sql_type = BigInt)]
        blocks: i64,
    }

    /// The jobs table's blocks read or found in shared buffers so far, heap
    /// and indexes, once every other session of the database but `held`
    /// (which reads nothing) has ended and flushed its counts.
    fn jobs_blocks(conn: &mut PgConnection, held: i32) -> i64 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let others: i64 = diesel::select(diesel::dsl::sql::<BigInt>(&format!(
                "count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND pid NOT IN (pg_backend_pid(), {held})"
            )))
            .get_result(conn)
            .unwrap();
            if others == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{others} sessions are still open"
            );
            thread::sleep(Duration::from_millis(20));
        }
        let read = |conn: &mut PgConnection| {
            conn.batch_execute("SELECT pg_stat_clear_snapshot()")
                .unwrap();
            diesel::sql_query(
                "SELECT (coalesce(heap_blks_read, 0) + coalesce(heap_blks_hit, 0) \
                 + coalesce(idx_blks_read, 0) + coalesce(idx_blks_hit, 0))::int8 AS blocks \
                 FROM pg_statio_user_tables WHERE relname = 'jobs'",
            )
            .get_result::<Blocks>(conn)
            .unwrap()
            .blocks
        };
        // PostgreSQL before 15 counts through its statistics collector, a
        // moment later.
        let mut last = read(conn);
        loop {
            thread::sleep(Duration::from_millis(700));
            let now = read(conn);
            if now == last {
                return now;
            }
            last = now;
        }
    }

    /// Inserts jobs `ids` on a connection of their own.
    fn insert(url: &str, ids: std::ops::RangeInclusive<i32>) {
        PgConnection::establish(url)
            .unwrap()
            .batch_execute(&format!(
                "INSERT INTO jobs (id, priority, due) \
                 SELECT id, 0, now() FROM generate_series({}, {}) AS id",
                ids.start(),
                ids.end()
            ))
            .unwrap();
    }

    /// Four loops on a pool of their own do `JOBS` queued jobs, deleting
    /// each; returns the jobs table's blocks per job and the seconds taken.
    fn drain(url: &str, admin: &mut PgConnection, held: i32) -> (f64, f64) {
        let before = jobs_blocks(admin, held);
        let pool = pool_of::<PgConnection>(url, 4, "pg");
        let (stop, done) = (StopHandle::new(), AtomicUsize::new(0));
        let started = Instant::now();
        let report = jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .build_claim()
            .then_delete()
            .worker(&stop)
            .concurrency(4)
            .run_pooled(&pool, |_: &mut PgConnection, _: Job| {
                if done.fetch_add(1, Ordering::SeqCst) + 1 == JOBS as usize {
                    stop.stop();
                }
                Ok::<_, Error>(())
            })
            .unwrap();
        let seconds = started.elapsed().as_secs_f64();
        assert_eq!(report.processed, JOBS as u64);
        drop(pool);
        let blocks = jobs_blocks(admin, held) - before;
        (blocks as f64 / f64::from(JOBS), seconds)
    }

    /// The blocks of one take from the head, through every done job.
    fn from_the_head(url: &str) -> i64 {
        let plan: String = diesel::sql_query(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT id FROM jobs \
             WHERE NOT done ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED",
        )
        .get_result::<Plan>(&mut PgConnection::establish(url).unwrap())
        .unwrap()
        .plan;
        let buffers = |name: &str| -> i64 {
            let at = plan.find(&format!("\"{name}\": ")).unwrap() + name.len() + 4;
            let digits: String = plan[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().unwrap()
        };
        buffers("Shared Hit Blocks") + buffers("Shared Read Blocks")
    }

    #[derive(QueryableByName)]
    struct Plan {
        #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
        plan: String,
    }

    /// While a transaction holds vacuum back, 200,000 jobs done at the head
    /// of the queue leave the cost of the loops' takes as it was: their looks
    /// ahead start where the last looks ended, and a catch-up look from the
    /// head comes at most once a second. Loops that looked from the head
    /// once in every round of their takes read the index entry and the row
    /// of every done job in one take of four (about 60 times the blocks per
    /// job here).
    #[test]
    fn done_jobs_that_vacuum_cannot_remove_leave_the_takes_cost_flat() {
        let db = testkit::PgTestDb::new();
        let mut admin = PgConnection::establish(&db.url).unwrap();
        testkit::fixtures::create_schema(&mut admin, testkit::fixtures::POSTGRES_SCHEMA);
        // Autovacuum could not remove the done jobs anyway; nor does it read
        // the table in between.
        admin
            .batch_execute("ALTER TABLE jobs SET (autovacuum_enabled = false)")
            .unwrap();
        let mut holder = PgConnection::establish(&db.url).unwrap();
        holder
            .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
            .unwrap();
        let held: i32 = diesel::select(diesel::dsl::sql::<diesel::sql_types::Integer>(
            "pg_backend_pid()",
        ))
        .get_result(&mut holder)
        .unwrap();

        insert(&db.url, 1..=JOBS);
        let (clean, clean_seconds) = drain(&db.url, &mut admin, held);

        let head = JOBS + 1..=JOBS + DONE_AT_THE_HEAD;
        insert(&db.url, head.clone());
        admin
            .batch_execute(&format!(
                "DELETE FROM jobs WHERE id BETWEEN {} AND {}",
                head.start(),
                head.end()
            ))
            .unwrap();
        let queued = JOBS + DONE_AT_THE_HEAD + 1..=2 * JOBS + DONE_AT_THE_HEAD;
        insert(&db.url, queued);
        let walk = from_the_head(&db.url);
        let (bloated, seconds) = drain(&db.url, &mut admin, held);

        // The takes' own blocks, and a walk through the done jobs a second
        // (and two more: the loops' first take, and rounding).
        let bound = 2.0 * clean + (seconds + 2.0) * walk as f64 / f64::from(JOBS);
        println!(
            "blocks per job: {clean:.1} on a clean queue ({clean_seconds:.1} s), \
             {bloated:.1} behind {DONE_AT_THE_HEAD} done jobs ({seconds:.1} s; \
             a take from the head reads {walk}); bound {bound:.1}"
        );
        assert!(
            walk as f64 > 50.0 * clean,
            "a take from the head read only {walk} blocks"
        );
        assert!(
            bloated <= bound,
            "behind {DONE_AT_THE_HEAD} done jobs, the takes read {bloated:.1} blocks per job, \
             on a clean queue {clean:.1}; bound {bound:.1}"
        );
        holder.batch_execute("ROLLBACK").unwrap();
    }
}
