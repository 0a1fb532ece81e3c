//! Retries scheduled in the rows: the take honours each job's next run time
//! by the database's clock, a failure is recorded under the job's lock
//! (attempts, next run time, error), a job that used its attempts is a dead
//! letter, and a fleet of worker processes on pools never runs a job twice
//! at once, nor sooner than its schedule.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{Error, Retries, StopHandle};

use testkit::fixtures::on_every_backend;

/// Set in a worker process of the fleet test: the database's URL.
const FLEET_WORKER: &str = "DIESEL_CLAIM_FLEET_WORKER";

/// How a worker process of the fleet test prints a run.
const RUN: &str = "fleet run: ";

/// A run of a job, by the database's clock: `(job, started, ended)`, in
/// microseconds since the Unix epoch.
pub type Run = (i32, i64, i64);

/// Checks the runs of `jobs` jobs that failed on every run under the
/// schedule `delays` with `max_attempts`: each ran exactly `max_attempts`
/// times, and each run started no sooner than the delay after the run
/// before it ended (so no two runs overlap). `slack` is the database clock's
/// resolution (SQLite keeps milliseconds).
pub fn assert_runs_kept_the_schedule(
    runs: &[Run],
    jobs: i32,
    delays: &[Duration],
    max_attempts: usize,
    slack: i64,
) {
    let mut by_job: BTreeMap<i32, Vec<(i64, i64)>> = BTreeMap::new();
    for (job, started, ended) in runs {
        by_job.entry(*job).or_default().push((*started, *ended));
    }
    assert_eq!(by_job.len(), jobs as usize, "jobs run: {by_job:?}");
    for (job, mut runs) in by_job {
        runs.sort();
        assert_eq!(
            runs.len(),
            max_attempts,
            "job {job} ran {} times: {runs:?}",
            runs.len()
        );
        for (failures, pair) in runs.windows(2).enumerate() {
            let delay = delays[failures.min(delays.len() - 1)].as_micros() as i64;
            let gap = pair[1].0 - pair[0].1;
            assert!(
                gap + slack >= delay,
                "job {job} ran again {gap} µs after its failure, before its delay of {delay} µs: {runs:?}"
            );
        }
    }
}

on_every_backend! {
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

    #[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
    #[diesel(table_name = queued)]
    struct Queued {
        id: i32,
    }

    type Queue = diesel::dsl::Select<
        diesel::dsl::Filter<queued::table, diesel::dsl::Eq<queued::done, bool>>,
        diesel::dsl::AsSelect<Queued, <Conn as Connection>::Backend>,
    >;

    fn queue() -> Queue {
        queued::table.filter(queued::done.eq(false)).select(Queued::as_select())
    }

    /// The database's clock now, in microseconds since the Unix epoch.
    fn db_now(conn: &mut Conn) -> i64 {
        let sql = match BACKEND {
            "pg" => "SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::int8 AS now",
            "mysql" => "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) AS now",
            _ => "SELECT CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER) AS now",
        };
        #[derive(QueryableByName)]
        struct Now {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            now: i64,
        }
        diesel::sql_query(sql).get_result::<Now>(conn).unwrap().now
    }

    /// A database with `count` jobs due now, none tried yet: the database
    /// (dropped at the end), a pool, and its URL.
    fn jobs_db(count: i32, pool_size: u32) -> (impl Sized, Pool, String) {
        let (db, pool) = test_db(pool_size);
        let now = match BACKEND {
            "pg" => "now()",
            "mysql" => "(UTC_TIMESTAMP(6))",
            _ => "(strftime('%Y-%m-%d %H:%M:%f', 'now'))",
        };
        let rows: Vec<String> = (1..=count).map(|id| format!("({id})")).collect();
        pool.get().unwrap().batch_execute(&format!(
            "CREATE TABLE queued (id INTEGER PRIMARY KEY, attempts INTEGER NOT NULL DEFAULT 0, \
                 run_at {CLAIM_STAMP_COLUMN} NOT NULL DEFAULT {now}, last_error TEXT, \
                 done BOOLEAN NOT NULL DEFAULT FALSE);
             INSERT INTO queued (id) VALUES {};",
            rows.join(", ")
        ))
        .unwrap();
        let url = db.url.clone();
        (db, pool, url)
    }

    /// `(attempts, last_error)` of every job, by id.
    fn recorded(conn: &mut Conn) -> Vec<(i32, Option<String>)> {
        queued::table
            .order(queued::id)
            .select((queued::attempts, queued::last_error))
            .load(conn)
            .unwrap()
    }

    /// A worker runs a job that fails on every attempt: each failure is
    /// recorded under the job's lock (one more attempt, the error), the job
    /// runs again no sooner than its delay after it, by the database's clock,
    /// and after its last attempt it is a dead letter, left in the table and
    /// out of the queue. Jobs that succeed are done once.
    #[test]
    fn a_failing_job_runs_on_its_schedule_and_ends_a_dead_letter() {
        let (_db, pool, _) = jobs_db(3, 2);
        let delays = [Duration::from_millis(150), Duration::from_millis(300)];
        let stop = StopHandle::new();
        let mut runs: Vec<Run> = Vec::new();
        let report = queue()
            .build_claim()
            .retries(
                Retries::new(queued::attempts, queued::run_at)
                    .last_error(queued::last_error)
                    .max_attempts(4)
                    .schedule(delays),
            )
            .then_update(queued::done.eq(true))
            .worker(&stop)
            .poll_interval(Duration::from_millis(2), Duration::from_millis(10))
            .run(&mut *pool.get().unwrap(), |conn, job: Queued| {
                if job.id != 2 {
                    return Ok(());
                }
                let started = db_now(conn);
                let ended = db_now(conn);
                runs.push((job.id, started, ended));
                if runs.len() == 4 {
                    stop.stop();
                }
                Err(Error::InvalidArgument(format!("job {} fails", job.id)))
            })
            .unwrap();
        assert_eq!((report.processed, report.failed), (2, 4));
        let slack = if BACKEND == "sqlite" { 2_000 } else { 0 };
        assert_runs_kept_the_schedule(&runs, 1, &delays, 4, slack);
        let conn = &mut pool.get().unwrap();
        let error = Some("invalid argument: job 2 fails".to_owned());
        assert_eq!(recorded(conn), [(0, None), (4, error), (0, None)]);
        // A dead letter: in the table, not done, out of the queue.
        let runnable = queue()
            .build_claim()
            .retries(Retries::new(queued::attempts, queued::run_at).max_attempts(4))
            .each(conn, |_, _: Queued| Ok::<_, Error>(()))
            .unwrap();
        assert_eq!(runnable.processed, 0);
        // Sent back by lowering its attempts, it runs again.
        let now = match BACKEND {
            "pg" => "now()",
            "mysql" => "UTC_TIMESTAMP(6)",
            _ => "strftime('%Y-%m-%d %H:%M:%f', 'now')",
        };
        conn.batch_execute(&format!("UPDATE queued SET attempts = 3, run_at = {now} WHERE id = 2")).unwrap();
        let sent_back = queue()
            .build_claim()
            .retries(Retries::new(queued::attempts, queued::run_at).max_attempts(4))
            .then_update(queued::done.eq(true))
            .each(conn, |_, _: Queued| Ok::<_, Error>(()))
            .unwrap();
        assert_eq!(sent_back.processed, 1);
    }

    /// A job whose next run time lies ahead is not taken, by any claim,
    /// until it comes; one due now is.
    #[test]
    fn a_job_is_not_taken_before_its_run_at() {
        let (_db, pool, _) = jobs_db(2, 1);
        let conn = &mut pool.get().unwrap();
        let later = match BACKEND {
            "pg" => "now() + interval '1 hour'",
            "mysql" => "UTC_TIMESTAMP(6) + INTERVAL 1 HOUR",
            _ => "strftime('%Y-%m-%d %H:%M:%f', 'now', '+1 hour')",
        };
        conn.batch_execute(&format!("UPDATE queued SET run_at = {later} WHERE id = 1")).unwrap();
        let mut taken = Vec::new();
        queue()
            .build_claim()
            .retries(Retries::new(queued::attempts, queued::run_at))
            .drain()
            .each(conn, |_, job: Queued| {
                taken.push(job.id);
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!(taken, [2]);
    }

    /// Options that cannot work are refused before any statement, and a
    /// mark, which a failure would leave in place, is refused beside a
    /// retry schedule.
    #[test]
    fn bad_schedules_and_marks_are_refused() {
        let (_db, pool, _) = jobs_db(1, 1);
        let conn = &mut pool.get().unwrap();
        let schedule = || Retries::new(queued::attempts, queued::run_at);
        let refusals = [
            schedule().max_attempts(0),
            schedule().jitter(-0.5),
            schedule().backoff(Duration::from_secs(9), Duration::from_secs(1)),
            schedule().schedule([]),
        ];
        for retries in refusals {
            let refused = queue()
                .build_claim()
                .retries(retries)
                .each(conn, |_, _: Queued| Ok::<_, Error>(()));
            assert!(matches!(refused, Err(Error::InvalidArgument(_))), "{refused:?}");
        }
        let marked = queue()
            .build_claim()
            .retries(schedule())
            .mark(queued::done.eq(true))
            .each(conn, |_, _: Queued| Ok::<_, Error>(()));
        assert!(
            matches!(&marked, Err(Error::InvalidArgument(message)) if message.contains("then_update")),
            "{marked:?}"
        );
        assert_eq!(recorded(conn), [(0, None)], "nothing was written");
    }

    /// Four worker processes of four loops each, on pools, run jobs that
    /// fail on every attempt under a schedule of 1 s, 2 s and 4 s: each job
    /// runs exactly its 4 attempts, each run no sooner than its delay after
    /// the last one ended, by the database's clock (so no two runs of a job
    /// overlap, and no two loops or processes take it at once), and each
    /// ends a dead letter with its last error.
    #[test]
    fn a_fleet_of_worker_processes_keeps_each_jobs_schedule() {
        let delays = [1, 2, 4].map(Duration::from_secs);
        if let Ok(url) = std::env::var(FLEET_WORKER) {
            fleet_worker(&url, &delays);
            std::process::exit(0);
        }
        const JOBS: i32 = 8;
        let (_db, pool, url) = jobs_db(JOBS, 1);
        let name = format!(
            "{}::a_fleet_of_worker_processes_keeps_each_jobs_schedule",
            module_path!().split_once("::").unwrap().1
        );
        let workers: Vec<_> = (0..4)
            .map(|_| {
                Command::new(std::env::current_exe().unwrap())
                    .args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"])
                    .env(FLEET_WORKER, &url)
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut runs: Vec<Run> = Vec::new();
        for mut worker in workers {
            let out = BufReader::new(worker.stdout.take().unwrap());
            for line in out.lines().map_while(Result::ok) {
                // The test harness may have begun the line.
                let Some((_, run)) = line.split_once(RUN) else { continue };
                let fields: Vec<i64> = run.split(' ').map(|field| field.parse().unwrap()).collect();
                runs.push((fields[0] as i32, fields[1], fields[2]));
            }
            assert!(worker.wait().unwrap().success(), "a worker process failed");
        }
        let slack = if BACKEND == "sqlite" { 2_000 } else { 0 };
        assert_runs_kept_the_schedule(&runs, JOBS, &delays, 4, slack);
        let conn = &mut pool.get().unwrap();
        for (attempts, error) in recorded(conn) {
            assert_eq!(attempts, 4);
            assert!(error.unwrap().ends_with("fails"));
        }
    }

    /// One process of the fleet: a worker of four loops on a pool, until
    /// every job is a dead letter; it prints each run it made.
    fn fleet_worker(url: &str, delays: &[Duration]) {
        let pool = crate::pooled::pool_of::<Conn>(url, 5, BACKEND);
        let stop = StopHandle::new();
        let runs = Mutex::new(Vec::<Run>::new());
        let began = Instant::now();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut conn = pool.get().unwrap();
                let left = |conn: &mut Conn| -> i64 {
                    queued::table.filter(queued::attempts.lt(4)).count().get_result(conn).unwrap()
                };
                while !stop.is_stopped() && left(&mut conn) > 0 {
                    assert!(began.elapsed() < Duration::from_secs(120), "the jobs did not run out");
                    std::thread::sleep(Duration::from_millis(20));
                }
                stop.stop();
            });
            let worked = queue()
                .build_claim()
                .retries(
                    Retries::new(queued::attempts, queued::run_at)
                        .last_error(queued::last_error)
                        .max_attempts(4)
                        .schedule(delays.iter().copied()),
                )
                .worker(&stop)
                .concurrency(4)
                .poll_interval(Duration::from_millis(5), Duration::from_millis(20))
                .run_pooled(&pool, |conn: &mut Conn, job: Queued| {
                    let started = db_now(conn);
                    std::thread::sleep(Duration::from_millis(30));
                    runs.lock().unwrap().push((job.id, started, db_now(conn)));
                    Err(Error::InvalidArgument(format!("job {} fails", job.id)))
                });
            // The watcher stops with the worker, whatever ended it.
            stop.stop();
            worked.unwrap();
        });
        for (job, started, ended) in runs.into_inner().unwrap() {
            println!("{RUN}{job} {started} {ended}");
        }
    }
}

/// On MySQL and MariaDB, a next run time in a `TIMESTAMP(6)` column (kept in
/// UTC, shown in the session's time zone) is compared with the session's
/// clock: in a session far from UTC, a failing job is not taken before its
/// delay has passed, and is taken once it has.
#[cfg(feature = "mysql")]
#[test]
fn mysql_timestamp_columns_keep_a_schedule() {
    diesel::table! {
        stamped_jobs (id) {
            id -> Integer,
            attempts -> Integer,
            run_at -> Timestamp,
        }
    }

    #[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
    #[diesel(table_name = stamped_jobs)]
    struct StampedJob {
        id: i32,
    }

    let db = testkit::MysqlTestDb::new();
    let conn = &mut MysqlConnection::establish(&db.url).unwrap();
    conn.batch_execute(
        "SET time_zone = '+09:00';
         CREATE TABLE stamped_jobs (id INTEGER PRIMARY KEY, attempts INTEGER NOT NULL DEFAULT 0, \
             run_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6));
         INSERT INTO stamped_jobs (id) VALUES (1);",
    )
    .unwrap();
    let delay = Duration::from_millis(700);
    let mut runs = 0;
    let mut claim = |conn: &mut MysqlConnection| {
        stamped_jobs::table
            .select(StampedJob::as_select())
            .build_claim()
            .retries(
                Retries::new(stamped_jobs::attempts, stamped_jobs::run_at)
                    .schedule([delay])
                    .jitter(0.0),
            )
            .each(conn, |_, _: StampedJob| {
                runs += 1;
                Err::<(), _>(Error::InvalidArgument("fails".to_owned()))
            })
            .unwrap()
    };
    let failed_at = Instant::now();
    assert_eq!(claim(conn).failed, 1);
    assert_eq!(claim(conn).failed, 0, "taken again before its delay");
    std::thread::sleep(delay.saturating_sub(failed_at.elapsed()) + Duration::from_millis(50));
    assert_eq!(claim(conn).failed, 1, "not taken once its delay had passed");
    assert_eq!(runs, 2);
}
