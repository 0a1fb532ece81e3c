//! Retries scheduled in the rows and job timeouts, on diesel-async: four
//! loops on a bb8 pool keep each failing job's schedule by the database's
//! clock, record its attempts and error under its lock, and leave it a dead
//! letter; a long job is ended at its timeout and not started again, and
//! without a timeout it runs once, however long it takes.

use std::sync::Mutex;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{ExpressionMethods, QueryDsl, SelectableHelper};
use diesel_async::pooled_connection::{bb8, deadpool, AsyncDieselConnectionManager};
use diesel_async::AsyncConnection;
use diesel_async::RunQueryDsl;
use diesel_claim::aio::prelude::*;
use diesel_claim::{Error, Retries, StopHandle};

use crate::retries::{assert_runs_kept_the_schedule, Run};

on_async_backends! {
    diesel::table! {
        use diesel::sql_types::*;
        use super::ClaimStamp;

        queued (id) {
            id -> Integer,
            attempts -> Integer,
            run_at -> ClaimStamp,
            last_error -> Nullable<Text>,
            done -> Bool,
        }
    }

    #[derive(Debug, Clone, diesel::Queryable, diesel::Selectable, diesel::Identifiable)]
    #[diesel(table_name = queued)]
    struct Queued {
        id: i32,
    }

    /// The database's clock now, in microseconds since the Unix epoch.
    async fn db_now(conn: &mut Conn) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct Now {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            now: i64,
        }
        let sql = if BACKEND == "pg" {
            "SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::int8 AS now"
        } else {
            "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) AS now"
        };
        diesel::sql_query(sql).get_result::<Now>(conn).await.unwrap().now
    }

    /// Four loops on a pool run six jobs: five fail on every attempt, one
    /// succeeds. Each failing job runs its three attempts no sooner than its
    /// delays after the run before, by the database's clock, and ends a dead
    /// letter with its error; the other is done once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn loops_keep_each_failing_jobs_schedule() {
        let db = TestDb::new();
        let now = if BACKEND == "pg" { "now()" } else { "(UTC_TIMESTAMP(6))" };
        blocking(&db.url)
            .batch_execute(&format!(
                "CREATE TABLE queued (id INTEGER PRIMARY KEY, attempts INTEGER NOT NULL DEFAULT 0, \
                     run_at {CLAIM_STAMP_COLUMN} NOT NULL DEFAULT {now}, last_error TEXT, \
                     done BOOLEAN NOT NULL DEFAULT FALSE);
                 INSERT INTO queued (id) VALUES (1), (2), (3), (4), (5), (6);"
            ))
            .unwrap();
        let pool = bb8::Pool::builder()
            .max_size(5)
            .build(crate::aio::pooled::manager(&db.url, BACKEND == "mysql"))
            .await
            .unwrap();
        let delays = [Duration::from_millis(200), Duration::from_millis(400)];
        let runs = Mutex::new(Vec::<Run>::new());
        let stop = StopHandle::new();
        let report = queued::table
            .filter(queued::done.eq(false))
            .select(Queued::as_select())
            .build_claim()
            .retries(
                Retries::new(queued::attempts, queued::run_at)
                    .last_error(queued::last_error)
                    .max_attempts(3)
                    .schedule(delays),
            )
            .then_update(queued::done.eq(true))
            .worker(&stop)
            .concurrency(4)
            .poll_interval(Duration::from_millis(2), Duration::from_millis(10))
            .run_pooled(&pool, async |conn: &mut Conn, job: Queued| {
                if job.id == 6 {
                    return Ok(());
                }
                let started = db_now(conn).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                let ended = db_now(conn).await;
                let mut runs = runs.lock().unwrap();
                runs.push((job.id, started, ended));
                if runs.len() == 15 {
                    stop.stop();
                }
                Err(Error::InvalidArgument(format!("job {} fails", job.id)))
            })
            .await
            .unwrap();
        assert_eq!((report.processed, report.failed), (1, 15));
        assert_runs_kept_the_schedule(&runs.into_inner().unwrap(), 5, &delays, 3, 0);
        let recorded: Vec<(i32, Option<String>, bool)> = queued::table
            .order(queued::id)
            .select((queued::attempts, queued::last_error, queued::done))
            .load(&mut pool.get().await.unwrap())
            .await
            .unwrap();
        for (id, (attempts, error, done)) in (1..).zip(recorded) {
            if id == 6 {
                assert_eq!((attempts, error, done), (0, None, true));
            } else {
                assert_eq!((attempts, error, done), (3, Some(format!("invalid argument: job {id} fails")), false));
            }
        }
    }
    diesel::table! {
        use diesel::sql_types::*;
        use super::ClaimStamp;

        long_jobs (id) {
            id -> Integer,
            attempts -> Integer,
            run_at -> ClaimStamp,
            last_error -> Nullable<Text>,
            finished -> Integer,
            claimed_until -> Nullable<ClaimStamp>,
        }
    }

    diesel::table! {
        /// One row per start of a long job, written outside its transaction.
        long_job_starts (id) {
            id -> Integer,
            job_id -> Integer,
        }
    }

    #[derive(Debug, Clone, diesel::Queryable, diesel::Selectable, diesel::Identifiable)]
    #[diesel(table_name = long_jobs)]
    struct LongJob {
        id: i32,
    }

    /// A database with `count` long jobs due now; its URL.
    fn long_jobs_db(count: i32) -> (TestDb, String) {
        let db = TestDb::new();
        let now = if BACKEND == "pg" { "now()" } else { "(UTC_TIMESTAMP(6))" };
        let serial = if BACKEND == "pg" { "SERIAL" } else { "INTEGER AUTO_INCREMENT" };
        let rows: Vec<String> = (1..=count).map(|id| format!("({id})")).collect();
        blocking(&db.url)
            .batch_execute(&format!(
                "CREATE TABLE long_jobs (id INTEGER PRIMARY KEY, attempts INTEGER NOT NULL DEFAULT 0, \
                     run_at {CLAIM_STAMP_COLUMN} NOT NULL DEFAULT {now}, last_error TEXT, \
                     finished INTEGER NOT NULL DEFAULT 0, claimed_until {CLAIM_STAMP_COLUMN});
                 CREATE TABLE long_job_starts (id {serial} PRIMARY KEY, job_id INTEGER NOT NULL);
                 INSERT INTO long_jobs (id) VALUES {};",
                rows.join(", ")
            ))
            .unwrap();
        let url = db.url.clone();
        (db, url)
    }

    /// Counts a start of job `id`, outside its transaction (on a connection
    /// of its own, so that the count stays whatever becomes of the job).
    async fn count_start(url: &str, id: i32) {
        let mut other = Conn::establish(url).await.unwrap();
        diesel::insert_into(long_job_starts::table)
            .values(long_job_starts::job_id.eq(id))
            .execute(&mut other)
            .await
            .unwrap();
    }

    /// `(attempts, last_error, starts, finished)` of every job, by id.
    fn long_figures(url: &str) -> Vec<(i32, Option<String>, i64, i32)> {
        let conn = &mut blocking(url);
        let query = long_jobs::table
            .order(long_jobs::id)
            .select((long_jobs::id, long_jobs::attempts, long_jobs::last_error, long_jobs::finished));
        let jobs: Vec<(i32, i32, Option<String>, i32)> = diesel::RunQueryDsl::load(query, conn).unwrap();
        jobs.into_iter()
            .map(|(id, attempts, error, finished)| {
                let starts = long_job_starts::table.filter(long_job_starts::job_id.eq(id)).count();
                (attempts, error, diesel::RunQueryDsl::get_result(starts, conn).unwrap(), finished)
            })
            .collect()
    }

    /// A job of 40 s with a timeout of 2 s, under two workers polling: its
    /// future is dropped at 2 s, its failure recorded once (timed out), and
    /// in the 40 s it would have run it is not started again, its next run
    /// time a minute later.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_job_is_ended_at_its_timeout_and_not_started_again() {
        let (_db, url) = long_jobs_db(1);
        let pool = bb8::Pool::builder()
            .max_size(4)
            .build(crate::aio::pooled::manager(&url, BACKEND == "mysql"))
            .await
            .unwrap();
        let stop = StopHandle::new();
        let began = std::time::Instant::now();
        let worker = || {
            long_jobs::table
                .select(LongJob::as_select())
                .build_claim()
                .retries(
                    Retries::new(long_jobs::attempts, long_jobs::run_at)
                        .last_error(long_jobs::last_error)
                        .backoff(Duration::from_secs(60), Duration::from_secs(60)),
                )
                .worker(&stop)
                .timeout(Duration::from_secs(2))
                .poll_interval(Duration::from_millis(5), Duration::from_millis(20))
                .run_pooled(&pool, async |conn: &mut Conn, job: LongJob| {
                    count_start(&url, job.id).await;
                    tokio::time::sleep(Duration::from_secs(40)).await;
                    diesel::update(long_jobs::table.find(job.id))
                        .set(long_jobs::finished.eq(1))
                        .execute(conn)
                        .await?;
                    Ok::<_, Error>(())
                })
        };
        let watch = async {
            let deadline = began + Duration::from_secs(10);
            while long_figures(&url)[0].0 == 0 {
                assert!(std::time::Instant::now() < deadline, "the timeout was not recorded");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let ended = began.elapsed();
            assert!(ended >= Duration::from_secs(2) && ended < Duration::from_secs(5), "{ended:?}");
            // Two workers keep polling for as long as the job would have
            // run: it is not started again.
            tokio::time::sleep(Duration::from_secs(40).saturating_sub(began.elapsed())).await;
            stop.stop();
        };
        let (first, second, ()) = tokio::join!(worker(), worker(), watch);
        let (first, second) = (first.unwrap(), second.unwrap());
        assert_eq!(first.timed_out + second.timed_out, 1);
        assert_eq!(first.failed + second.failed, 1);
        let late = "the closure ran past its timeout of 2s: its work was rolled back".to_owned();
        assert_eq!(long_figures(&url), [(1, Some(late), 1, 0)]);
    }

    /// Without a timeout, a worker's transactions have no idle bound: a job
    /// that runs 40 s (past the 30 s an async claim's transaction may sit
    /// idle by default) runs exactly once, on bb8 and on deadpool, and
    /// finishes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_a_timeout_a_long_job_runs_once_on_every_pool() {
        let (_db, url) = long_jobs_db(2);
        let bb8 = bb8::Pool::builder()
            .max_size(3)
            .build(crate::aio::pooled::manager(&url, BACKEND == "mysql"))
            .await
            .unwrap();
        let deadpool = deadpool::Pool::builder(crate::aio::pooled::manager(&url, BACKEND == "mysql"))
            .max_size(3)
            .build()
            .unwrap();
        let queue = || {
            long_jobs::table
                .filter(long_jobs::finished.eq(0))
                .select(LongJob::as_select())
                .build_claim()
                .worker(&StopHandle::new())
                .concurrency(2)
                .stop_when_empty()
        };
        let job = async |conn: &mut Conn, job: LongJob| {
            count_start(&url, job.id).await;
            tokio::time::sleep(Duration::from_secs(40)).await;
            diesel::update(long_jobs::table.find(job.id))
                .set(long_jobs::finished.eq(long_jobs::finished + 1))
                .execute(conn)
                .await?;
            Ok::<_, Error>(())
        };
        let both = async { tokio::join!(queue().run_pooled(&bb8, job), queue().run_pooled(&deadpool, job)) };
        // A session ended under a job would have another loop start it again.
        let (on_bb8, on_deadpool) = tokio::time::timeout(Duration::from_secs(70), both)
            .await
            .unwrap_or_else(|_| panic!("the jobs were not each done once in 70 s: {:?}", long_figures(&url)));
        let done = on_bb8.unwrap().processed + on_deadpool.unwrap().processed;
        assert_eq!(done, 2);
        assert_eq!(long_figures(&url), [(0, None, 1, 1), (0, None, 1, 1)]);
    }

    /// An idle bound shorter than a job (set by hand) fires under it: the
    /// server ends the job's session while it runs. The worker on a pool
    /// goes on, on another connection, but not silently: the job's run is
    /// counted as failed, and its failure recorded by its retry schedule on
    /// the next connection (its attempt, the error, its next run time), so
    /// that it is not started again before its delay.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bound_that_fires_under_a_job_is_recorded_as_its_failure() {
        let (_db, url) = long_jobs_db(1);
        let pool = bb8::Pool::builder()
            .max_size(3)
            .build(crate::aio::pooled::manager(&url, BACKEND == "mysql"))
            .await
            .unwrap();
        let stop = StopHandle::new();
        let runs = std::sync::atomic::AtomicUsize::new(0);
        let worker = long_jobs::table
            .filter(long_jobs::finished.eq(0))
            .select(LongJob::as_select())
            .build_claim()
            .retries(
                Retries::new(long_jobs::attempts, long_jobs::run_at)
                    .last_error(long_jobs::last_error)
                    .backoff(Duration::from_secs(60), Duration::from_secs(60)),
            )
            .then_update(long_jobs::finished.eq(1))
            .worker(&stop)
            .idle_bound(Duration::from_secs(1))
            .poll_interval(Duration::from_millis(5), Duration::from_millis(20))
            .run_pooled(&pool, async |_: &mut Conn, _: LongJob| {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2500)).await;
                Ok::<_, Error>(())
            });
        let watch = async {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while long_figures(&url)[0].0 == 0 {
                assert!(std::time::Instant::now() < deadline, "the failure was not recorded");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // The worker keeps polling: the job waits for its next run time.
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop.stop();
        };
        let (report, ()) = tokio::join!(worker, watch);
        let report = report.unwrap();
        assert_eq!(runs.into_inner(), 1);
        assert_eq!((report.processed, report.failed), (0, 1), "{report:?}");
        let (attempts, error, _, finished) = long_figures(&url).remove(0);
        assert_eq!((attempts, finished), (1, 0));
        assert!(error.as_deref().unwrap().contains("idle bound"), "{error:?}");
    }

    /// A job past its timeout whose failure hook fails ends the call, and
    /// is counted neither as failed nor as timed out: the report's timed-out
    /// rows are always among its failed ones. Under the row's lock and with a
    /// claim committed before the job.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_timed_out_job_whose_hook_fails_is_not_counted() {
        let (_db, url) = long_jobs_db(1);
        let conn = &mut Conn::establish(&url).await.unwrap();
        let timeout = Duration::from_millis(50);
        let claim = || long_jobs::table.select(LongJob::as_select()).build_claim().timeout(timeout);
        let hook = async |_: &mut Conn, _: LongJob, _: &Error| Err(Error::InvalidArgument("no room".into()));
        let locked = claim()
            .on_failure(hook)
            .each_outcome(conn, async |_: &mut Conn, _: LongJob| {
                tokio::time::sleep(timeout * 2).await;
                Ok::<_, Error>(())
            })
            .await;
        let committed = claim()
            .visibility_timeout(long_jobs::claimed_until, Duration::from_secs(60))
            .on_failure(hook)
            .each_outcome(conn, async |_: &mut Conn, _: diesel_claim::Claimed<LongJob, _, diesel_claim::aio::Async>| {
                tokio::time::sleep(timeout * 2).await;
                Ok::<_, Error>(())
            })
            .await;
        for outcome in [locked.report, committed.report] {
            assert_eq!((outcome.failed, outcome.timed_out), (0, 0), "{outcome:?}");
        }
        for stopped in [locked.stopped, committed.stopped] {
            let stopped = stopped.expect("the hook's failure ends the call");
            assert!(matches!(stopped.error, Error::InvalidArgument(ref m) if m == "no room"), "{stopped:?}");
        }
    }

    /// The bound fires under the second of three jobs taken in one batch:
    /// the first ran (its completion is lost with the session) and the
    /// second was running, so both are recorded as failed; the third never
    /// ran, keeps its attempts, and is taken again and done.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bound_that_fires_mid_batch_records_only_the_jobs_that_ran() {
        let (_db, url) = long_jobs_db(3);
        let pool = bb8::Pool::builder()
            .max_size(3)
            .build(crate::aio::pooled::manager(&url, BACKEND == "mysql"))
            .await
            .unwrap();
        let stop = StopHandle::new();
        let worker = long_jobs::table
            .filter(long_jobs::finished.eq(0))
            .order(long_jobs::id)
            .select(LongJob::as_select())
            .build_claim()
            .batch(3)
            .retries(
                Retries::new(long_jobs::attempts, long_jobs::run_at)
                    .last_error(long_jobs::last_error)
                    .backoff(Duration::from_secs(60), Duration::from_secs(60)),
            )
            .then_update(long_jobs::finished.eq(1))
            .worker(&stop)
            .idle_bound(Duration::from_secs(1))
            .poll_interval(Duration::from_millis(5), Duration::from_millis(20))
            .run_pooled(&pool, async |_: &mut Conn, job: LongJob| {
                count_start(&url, job.id).await;
                if job.id == 2 {
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                }
                Ok::<_, Error>(())
            });
        let watch = async {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while long_figures(&url)[2].3 == 0 {
                assert!(std::time::Instant::now() < deadline, "job 3 was not done: {:?}", long_figures(&url));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            stop.stop();
        };
        let (report, ()) = tokio::join!(worker, watch);
        let report = report.unwrap();
        assert_eq!((report.processed, report.failed), (1, 2), "{report:?}");
        let figures = long_figures(&url);
        for (attempts, error, starts, finished) in &figures[..2] {
            assert_eq!((*attempts, *starts, *finished), (1, 1, 0), "{figures:?}");
            assert!(error.as_deref().unwrap().contains("idle bound"), "{figures:?}");
        }
        assert_eq!(figures[2], (0, None, 1, 1));
    }

}
