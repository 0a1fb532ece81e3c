//! JR and JS: a job runner's workload, the crate's worker beside the loop a
//! job runner writes by hand (the Rust package registry's background-job
//! runner's, in Diesel).
//!
//! Jobs are run in priority order (`ORDER BY priority DESC, id`), the next
//! one taken each time by whichever worker is free; a job that succeeds is
//! deleted; one in 20 fails on its first attempt, and its failure is
//! recorded (attempts, error, next run time) under its lock, to run again at
//! once. The hand-written twin is the registry runner's: a transaction,
//! `SELECT … ORDER BY priority DESC, id LIMIT n FOR UPDATE SKIP LOCKED`,
//! each job run in a savepoint, then its `DELETE` or the failure's `UPDATE`,
//! and `COMMIT`. The crate runs the same queue with a worker from the head
//! of the queue, `on_failure` writing the same `UPDATE`.
//!
//! - JR drains a backlog of queued jobs.
//! - JS feeds the workers from a producer at a fixed rate (one job per
//!   transaction, with `pg_notify` on PostgreSQL, where the workers listen;
//!   MySQL polls) and measures the pickup latency, from the producer's
//!   commit returning to the job's closure starting.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::{MysqlConnection, PgConnection};
use diesel_claim::{Error, StopHandle, WaitForRows};

use crate::db::BackendKind;
use crate::report::{markdown_table, Number, Text};

diesel::table! {
    bench_jobs (id) {
        id -> BigInt,
        priority -> Integer,
        run_at -> Timestamp,
        attempts -> Integer,
        last_error -> Nullable<Text>,
        seq -> BigInt,
        payload -> Text,
    }
}

/// A job as the workers load it.
#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = bench_jobs)]
pub struct BenchJob {
    pub id: i64,
    pub priority: i32,
    pub attempts: i32,
    pub seq: i64,
    pub payload: String,
}

/// The channel the workers listen on (PostgreSQL).
const CHANNEL: &str = "bench_jobs";

/// How often an idle worker looks for jobs: from `min`, doubling up to
/// `max` (both runners).
const POLL: (Duration, Duration) = (Duration::from_millis(1), Duration::from_millis(20));

/// Whether a job fails on this attempt: one in 20, on its first.
fn fails(job: &BenchJob) -> bool {
    job.seq % 20 == 0 && job.attempts == 0
}

/// Who runs the jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runner {
    /// The hand-written loop.
    Twin,
    /// The crate's worker, deleting each job with `then_delete`.
    Crate,
    /// The crate's worker, the closure deleting its job (in the savepoint
    /// the failure hook needs).
    CrateDeletingInClosure,
    /// The crate's worker on an r2d2 pool (`run_pooled`): one worker whose
    /// `W` claim loops check a connection out per claim, on a pool of `W`
    /// connections and one for the listener; with `then_delete`.
    CratePooled,
}

/// One way of running jobs: the runner, and the jobs per transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobMode {
    pub runner: Runner,
    pub batch: u32,
}

impl JobMode {
    pub const ALL: [JobMode; 6] = [
        JobMode::new(Runner::Twin, 1),
        JobMode::new(Runner::Crate, 1),
        JobMode::new(Runner::CratePooled, 1),
        JobMode::new(Runner::CrateDeletingInClosure, 1),
        JobMode::new(Runner::Twin, 10),
        JobMode::new(Runner::Crate, 10),
    ];

    const fn new(runner: Runner, batch: u32) -> Self {
        JobMode { runner, batch }
    }

    pub fn name(self) -> String {
        let runner = match self.runner {
            Runner::Twin => "hand-written",
            Runner::Crate => "diesel-claim",
            Runner::CrateDeletingInClosure => "diesel-claim, delete in the closure",
            Runner::CratePooled => "diesel-claim on a pool",
        };
        format!("{runner}, {} per transaction", self.batch)
    }
}

/// What the workers saw of the jobs: when each was first picked up, and
/// how often; and how many jobs are done.
pub struct Ledger {
    first_pick: Mutex<Vec<Option<Instant>>>,
    picks: Vec<AtomicU32>,
    done: AtomicU64,
}

impl Ledger {
    fn new(jobs: usize) -> Self {
        Ledger {
            first_pick: Mutex::new(vec![None; jobs]),
            picks: (0..jobs).map(|_| AtomicU32::new(0)).collect(),
            done: AtomicU64::new(0),
        }
    }

    /// A worker's closure starts on `job`.
    fn picked(&self, job: &BenchJob) {
        let seq = job.seq as usize;
        if self.picks[seq].fetch_add(1, Ordering::Relaxed) == 0 {
            self.first_pick.lock().unwrap()[seq] = Some(Instant::now());
        }
    }

    /// Runs `job`: fails it (one in 20, the first time), or counts it done.
    fn run(&self, job: &BenchJob) -> Result<(), Error> {
        self.picked(job);
        if fails(job) {
            return Err(Error::InvalidArgument(format!("job {} failed", job.seq)));
        }
        self.done.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// Jobs picked other than once (twice for those that failed once); with
    /// `reruns_allowed`, only those picked fewer times: a deadlock victim's
    /// batch is rolled back and run again (MySQL).
    fn misrun(&self, reruns_allowed: bool) -> Vec<String> {
        self.picks
            .iter()
            .enumerate()
            .filter_map(|(seq, picks)| {
                let expected = if seq % 20 == 0 { 2 } else { 1 };
                let picks = picks.load(Ordering::Relaxed);
                let wrong = picks < expected || (picks > expected && !reruns_allowed);
                wrong.then(|| format!("job {seq} run {picks} times"))
            })
            .collect()
    }
}

/// What a connection does for the job runners, per backend.
pub trait JobConn: Connection + WaitForRows + Send + Sized + 'static {
    const BACKEND: BackendKind;

    fn open(url: &str) -> ConnectionResult<Self>;

    /// The jobs table, new and empty.
    fn create_jobs_table(&mut self) -> QueryResult<()>;

    /// Enqueues the jobs `seqs`, in one transaction (with a notification).
    fn enqueue(&mut self, seqs: std::ops::Range<i64>) -> QueryResult<()>;

    fn queued(&mut self) -> QueryResult<i64>;

    /// The twin: takes up to `batch` jobs in one transaction and runs them;
    /// how many it took.
    fn twin_take(&mut self, batch: i64, ledger: &Ledger) -> QueryResult<usize>;

    /// The crate's worker, until `stop`; the closure deletes its job itself
    /// if `delete_in_closure`, else `then_delete` does.
    fn crate_worker(
        &mut self,
        batch: u32,
        delete_in_closure: bool,
        stop: &StopHandle,
        listen: bool,
        ledger: &Ledger,
    ) -> Result<u64, Error>;

    /// The crate's worker on a pool of connections to `url`, `loops` claim
    /// loops, with `then_delete`, until `stop`.
    fn pooled_worker(
        url: &str,
        loops: usize,
        batch: u32,
        stop: &StopHandle,
        listen: bool,
        ledger: &Ledger,
    ) -> Result<u64, Error>;
}

/// Sets a pooled connection up as `open` sets up the others (the SQL, if
/// any).
#[derive(Debug)]
struct SetUp(Option<String>);

impl<C: SimpleConnection> diesel::r2d2::CustomizeConnection<C, diesel::r2d2::Error> for SetUp {
    fn on_acquire(&self, conn: &mut C) -> Result<(), diesel::r2d2::Error> {
        match &self.0 {
            Some(sql) => conn
                .batch_execute(sql)
                .map_err(diesel::r2d2::Error::QueryError),
            None => Ok(()),
        }
    }
}

/// The queue, as both runners read it.
macro_rules! queue {
    ($db:ty) => {
        bench_jobs::table
            .filter(bench_jobs::run_at.le(diesel::dsl::now))
            .order((bench_jobs::priority.desc(), bench_jobs::id))
            .select(<BenchJob as SelectableHelper<$db>>::as_select())
    };
}

/// What a failed job's record becomes: one more attempt, the error, and a
/// next run time (now: the failure was the bench's own).
macro_rules! failed {
    ($error:expr) => {
        (
            bench_jobs::attempts.eq(bench_jobs::attempts + 1),
            bench_jobs::last_error.eq($error.to_string()),
            bench_jobs::run_at.eq(diesel::dsl::now),
        )
    };
}

macro_rules! impl_job_conn {
    ($conn:ty, $db:ty, $kind:expr, $open:expr, $setup:expr, $table:expr, $notify:expr) => {
        impl JobConn for $conn {
            const BACKEND: BackendKind = $kind;

            fn open(url: &str) -> ConnectionResult<Self> {
                $open(url)
            }

            fn create_jobs_table(&mut self) -> QueryResult<()> {
                self.batch_execute($table)
            }

            fn enqueue(&mut self, seqs: std::ops::Range<i64>) -> QueryResult<()> {
                self.transaction(|conn| {
                    let rows: Vec<_> = seqs
                        .map(|seq| {
                            (
                                bench_jobs::priority.eq((seq % 4) as i32),
                                bench_jobs::seq.eq(seq),
                                bench_jobs::payload.eq("{\"crate\":\"diesel-claim\"}"),
                            )
                        })
                        .collect();
                    for chunk in rows.chunks(1000) {
                        diesel::insert_into(bench_jobs::table)
                            .values(chunk)
                            .execute(conn)?;
                    }
                    conn.batch_execute($notify)
                })
            }

            fn queued(&mut self) -> QueryResult<i64> {
                bench_jobs::table.count().get_result(self)
            }

            fn twin_take(&mut self, batch: i64, ledger: &Ledger) -> QueryResult<usize> {
                self.transaction(|conn| {
                    let jobs: Vec<BenchJob> = queue!($db)
                        .limit(batch)
                        .for_update()
                        .skip_locked()
                        .load(conn)?;
                    for job in &jobs {
                        let ran = conn.transaction(|_| ledger.run(job).map_err(JobFailed));
                        match ran {
                            Ok(()) => diesel::delete(job).execute(conn)?,
                            Err(JobFailed(error)) => {
                                diesel::update(job).set(failed!(error)).execute(conn)?
                            }
                        };
                    }
                    Ok(jobs.len())
                })
            }

            fn crate_worker(
                &mut self,
                batch: u32,
                delete_in_closure: bool,
                stop: &StopHandle,
                listen: bool,
                ledger: &Ledger,
            ) -> Result<u64, Error> {
                use diesel_claim::prelude::*;
                let claim = queue!($db).build_claim().batch(batch).on_failure(
                    |conn: &mut $conn, job: BenchJob, error: &Error| {
                        diesel::update(&job).set(failed!(error)).execute(conn)?;
                        Ok(())
                    },
                );
                // The failure's run time is the queue's own backoff.
                let no_backoff = Duration::ZERO;
                if delete_in_closure {
                    let worker = claim
                        .worker(stop)
                        .poll_interval(POLL.0, POLL.1)
                        .failure_backoff(no_backoff, no_backoff);
                    let worker = if listen {
                        worker.listen(CHANNEL)
                    } else {
                        worker
                    };
                    let report = worker.run(self, |conn, job: BenchJob| {
                        ledger.run(&job)?;
                        diesel::delete(&job).execute(conn)?;
                        Ok(())
                    })?;
                    return Ok(report.processed);
                }
                let worker = claim
                    .then_delete()
                    .worker(stop)
                    .poll_interval(POLL.0, POLL.1)
                    .failure_backoff(no_backoff, no_backoff);
                let worker = if listen {
                    worker.listen(CHANNEL)
                } else {
                    worker
                };
                let report = worker.run(self, |_, job: BenchJob| ledger.run(&job))?;
                Ok(report.processed)
            }

            fn pooled_worker(
                url: &str,
                loops: usize,
                batch: u32,
                stop: &StopHandle,
                listen: bool,
                ledger: &Ledger,
            ) -> Result<u64, Error> {
                use diesel_claim::prelude::*;
                // The worker finds dead connections itself: no test query
                // per checkout.
                let pool = diesel::r2d2::Pool::builder()
                    .max_size(loops as u32 + 1)
                    .test_on_check_out(false)
                    .connection_customizer(Box::new(SetUp($setup)))
                    .build(diesel::r2d2::ConnectionManager::<$conn>::new(url))
                    .map_err(|error| Error::InvalidArgument(error.to_string()))?;
                let no_backoff = Duration::ZERO;
                let worker = queue!($db)
                    .build_claim()
                    .batch(batch)
                    .on_failure(|conn: &mut $conn, job: BenchJob, error: &Error| {
                        diesel::update(&job).set(failed!(error)).execute(conn)?;
                        Ok(())
                    })
                    .then_delete()
                    .worker(stop)
                    .poll_interval(POLL.0, POLL.1)
                    .failure_backoff(no_backoff, no_backoff)
                    .concurrency(loops);
                let worker = if listen {
                    worker.listen(CHANNEL)
                } else {
                    worker
                };
                let report =
                    worker.run_pooled(&pool, |_: &mut $conn, job: BenchJob| ledger.run(&job))?;
                Ok(report.processed)
            }
        }
    };
}

/// A job's failure, as the twin's savepoint returns it (Diesel's
/// `transaction` wants an error that converts from its own).
struct JobFailed(Error);

impl From<diesel::result::Error> for JobFailed {
    fn from(error: diesel::result::Error) -> Self {
        JobFailed(error.into())
    }
}

impl_job_conn!(
    PgConnection,
    diesel::pg::Pg,
    BackendKind::Postgres,
    PgConnection::establish,
    None,
    "DROP TABLE IF EXISTS bench_jobs;
     CREATE TABLE bench_jobs (
         id BIGSERIAL PRIMARY KEY,
         priority INTEGER NOT NULL,
         run_at TIMESTAMP NOT NULL DEFAULT '2000-01-01',
         attempts INTEGER NOT NULL DEFAULT 0,
         last_error TEXT,
         seq BIGINT NOT NULL,
         payload TEXT NOT NULL
     );
     CREATE INDEX bench_jobs_queue ON bench_jobs (priority DESC, id);",
    "SELECT pg_notify('bench_jobs', '')"
);

impl_job_conn!(
    MysqlConnection,
    diesel::mysql::Mysql,
    BackendKind::Mysql,
    // At `READ COMMITTED`, as the drains' connections (`--mysql-isolation`).
    crate::db::open_mysql,
    Some(crate::db::mysql_session()),
    "DROP TABLE IF EXISTS bench_jobs;
     CREATE TABLE bench_jobs (
         id BIGINT AUTO_INCREMENT PRIMARY KEY,
         priority INTEGER NOT NULL,
         run_at DATETIME(6) NOT NULL DEFAULT '2000-01-01',
         attempts INTEGER NOT NULL DEFAULT 0,
         last_error TEXT,
         seq BIGINT NOT NULL,
         payload TEXT NOT NULL,
         INDEX bench_jobs_queue (priority DESC, id)
     ) ENGINE = InnoDB;",
    "DO 0"
);

/// One worker of either runner, until `stop`: the crate's worker, or the
/// twin's loop, which waits as the crate's does (through the crate's
/// `WaitForRows`: a read of the socket for notifications, or a sleep).
fn work<C: JobConn>(
    url: &str,
    conn: &mut C,
    mode: JobMode,
    stop: &StopHandle,
    listen: bool,
    ledger: &Ledger,
) -> Result<(), String> {
    let fail = |error: &dyn std::fmt::Display| format!("{}: {error}", mode.name());
    if mode.runner != Runner::Twin && mode.runner != Runner::CratePooled {
        let delete_in_closure = mode.runner == Runner::CrateDeletingInClosure;
        return conn
            .crate_worker(mode.batch, delete_in_closure, stop, listen, ledger)
            .map(drop)
            .map_err(|e| fail(&e));
    }
    if listen {
        conn.listen(CHANNEL).map_err(|e| fail(&e))?;
    }
    let mut pause = POLL.0;
    while !stop.is_stopped() {
        let taken = match conn.twin_take(i64::from(mode.batch), ledger) {
            // Rolled back: the loop takes the jobs again, as the crate's
            // worker does, on a new connection (MariaDB Connector/C hangs
            // when a locking read that failed midway runs again on its
            // cached statement, see the guide's "MySQL and MariaDB").
            Err(error) if diesel_claim::is_deadlock(&error) => {
                *conn = C::open(url).map_err(|e| fail(&e))?;
                if listen {
                    conn.listen(CHANNEL).map_err(|e| fail(&e))?;
                }
                continue;
            }
            taken => taken.map_err(|e| fail(&e))?,
        };
        if taken > 0 {
            pause = POLL.0;
            continue;
        }
        if conn.wait_for_rows(pause, stop).map_err(|e| fail(&e))? {
            pause = POLL.0;
        } else {
            pause = (pause * 2).min(POLL.1);
        }
    }
    Ok(())
}

/// What the runs of one mode and worker count measured (`--repeat` of
/// them, interleaved with the other modes').
#[derive(Debug, Clone)]
pub struct JobRun {
    pub backend: BackendKind,
    pub mode: JobMode,
    pub workers: usize,
    /// Jobs done per second, per run: a drain's backlog over its time, or a
    /// steady state's jobs over the time from the first insert to the last
    /// done.
    pub rates: Vec<f64>,
    /// Steady state only: commit to closure, per job, of every run, sorted.
    pub pickups: Vec<Duration>,
}

impl JobRun {
    fn new(backend: BackendKind, mode: JobMode, workers: usize) -> Self {
        JobRun {
            backend,
            mode,
            workers,
            rates: Vec::new(),
            pickups: Vec::new(),
        }
    }

    /// The median jobs/s of the runs.
    pub fn jobs_per_sec(&self) -> f64 {
        let mut rates = self.rates.clone();
        rates.sort_by(f64::total_cmp);
        let middle = rates.len() / 2;
        match rates.len() % 2 {
            1 => rates[middle],
            _ => (rates[middle - 1] + rates[middle]) / 2.0,
        }
    }

    /// The slowest and fastest run's jobs/s.
    fn spread(&self) -> String {
        let min = self.rates.iter().copied().fold(f64::INFINITY, f64::min);
        let max = self.rates.iter().copied().fold(0.0, f64::max);
        format!("{min:.0}–{max:.0}")
    }

    /// The `q` quantile (nearest rank) of every run's pickups.
    fn quantile(&self, q: f64) -> Duration {
        let rank = ((q * self.pickups.len() as f64).ceil() as usize).clamp(1, self.pickups.len());
        self.pickups[rank - 1]
    }
}

/// Runs `workers` workers of `mode` and `feed` beside them, which returns
/// once every job it enqueued is done; then checks that every job was run
/// once (twice if it failed once; on MySQL, a deadlock victim's jobs run
/// again after its rollback) and that none is left.
fn run_workers<C: JobConn>(
    url: &str,
    mode: JobMode,
    workers: usize,
    jobs: usize,
    listen: bool,
    feed: impl FnOnce(&Ledger) -> Result<(), String>,
) -> Result<(), String> {
    let ledger = Ledger::new(jobs);
    let stop = StopHandle::new();
    let ready = Barrier::new(workers + 1);
    if mode.runner == Runner::CratePooled {
        // One worker, its loops the W workers; it connects as it claims.
        let fed = thread::scope(|scope| {
            let (ledger, stop) = (&ledger, &stop);
            let worker = scope.spawn(move || {
                C::pooled_worker(url, workers, mode.batch, stop, listen, ledger)
                    .map_err(|e| format!("{}: {e}", mode.name()))
            });
            let fed = feed(ledger);
            stop.stop();
            worker.join().expect("the pooled worker panicked")?;
            fed
        });
        return fed.and_then(|()| checked::<C>(url, mode, &ledger));
    }
    let fed = thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                let (ledger, stop, ready) = (&ledger, &stop, &ready);
                scope.spawn(move || {
                    let connected = C::open(url).map_err(|e| e.to_string());
                    ready.wait();
                    work(url, &mut connected?, mode, stop, listen, ledger)
                })
            })
            .collect();
        ready.wait();
        let fed = feed(&ledger);
        stop.stop();
        for handle in handles {
            handle.join().expect("a worker panicked")?;
        }
        fed
    });
    fed?;
    checked::<C>(url, mode, &ledger)
}

/// Whether every job ran as it should and none is left.
fn checked<C: JobConn>(url: &str, mode: JobMode, ledger: &Ledger) -> Result<(), String> {
    let misrun = ledger.misrun(C::BACKEND == BackendKind::Mysql);
    if !misrun.is_empty() {
        return Err(format!(
            "{}: {}",
            mode.name(),
            misrun[..misrun.len().min(5)].join(", ")
        ));
    }
    let mut conn = C::open(url).map_err(|e| e.to_string())?;
    match conn.queued().map_err(|e| e.to_string())? {
        0 => Ok(()),
        left => Err(format!("{}: {left} jobs left", mode.name())),
    }
}

/// Waits until the workers have done `jobs` jobs, for at most `bound`: the
/// closures have said so, and (a rolled-back batch's jobs are counted twice)
/// `conn` sees none left.
fn until_done<C: JobConn>(
    conn: &mut C,
    ledger: &Ledger,
    jobs: u64,
    bound: Duration,
) -> Result<Instant, String> {
    let deadline = Instant::now() + bound;
    loop {
        if ledger.done.load(Ordering::Acquire) >= jobs
            && conn.queued().map_err(|e| e.to_string())? == 0
        {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{} of {jobs} jobs done after {bound:?}",
                ledger.done.load(Ordering::Acquire)
            ));
        }
        thread::sleep(Duration::from_micros(200));
    }
}

/// JR: drains a backlog of `jobs` jobs; the jobs done per second.
pub fn drain<C: JobConn>(
    url: &str,
    mode: JobMode,
    workers: usize,
    jobs: usize,
) -> Result<f64, String> {
    let mut conn = C::open(url).map_err(|e| e.to_string())?;
    conn.create_jobs_table().map_err(|e| e.to_string())?;
    conn.enqueue(0..jobs as i64).map_err(|e| e.to_string())?;
    let mut elapsed = Duration::ZERO;
    run_workers::<C>(url, mode, workers, jobs, false, |ledger| {
        let started = Instant::now();
        elapsed = until_done(&mut conn, ledger, jobs as u64, Duration::from_secs(600))? - started;
        Ok(())
    })?;
    Ok(jobs as f64 / elapsed.as_secs_f64())
}

/// JS: a producer enqueues `rate` jobs per second for `seconds`, one per
/// transaction; workers listen where they can. Adds the jobs done per
/// second and the pickups to `run`.
pub fn steady<C: JobConn>(
    url: &str,
    run: &mut JobRun,
    rate: u32,
    seconds: u32,
) -> Result<(), String> {
    let (mode, workers) = (run.mode, run.workers);
    let jobs = (rate * seconds) as usize;
    let mut producer = C::open(url).map_err(|e| e.to_string())?;
    producer.create_jobs_table().map_err(|e| e.to_string())?;
    let listen = C::BACKEND == BackendKind::Postgres;
    let mut committed = vec![Instant::now(); jobs];
    let mut elapsed = Duration::ZERO;
    let mut first_pick = Vec::new();
    run_workers::<C>(url, mode, workers, jobs, listen, |ledger| {
        // The workers have found the queue empty and wait.
        thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        let every = Duration::from_secs(1) / rate;
        for (seq, committed) in committed.iter_mut().enumerate() {
            let due = started + every * seq as u32;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                thread::sleep(wait);
            }
            producer
                .enqueue(seq as i64..seq as i64 + 1)
                .map_err(|e| e.to_string())?;
            *committed = Instant::now();
        }
        elapsed =
            until_done(&mut producer, ledger, jobs as u64, Duration::from_secs(120))? - started;
        first_pick = ledger.first_pick.lock().unwrap().clone();
        Ok(())
    })?;
    let pickups: Vec<Duration> = first_pick
        .iter()
        .zip(&committed)
        .map(|(picked, committed)| {
            picked.map_or(Duration::ZERO, |at| {
                at.saturating_duration_since(*committed)
            })
        })
        .collect();
    run.rates.push(jobs as f64 / elapsed.as_secs_f64());
    run.pickups.extend(pickups);
    run.pickups.sort();
    Ok(())
}

pub const JOB_NOTES: &str = "\
- jobs in priority order (`ORDER BY priority DESC, id`), one or ten per transaction, each
  deleted when done; one in 20 fails its first attempt, and the failure (attempts, error, next
  run time) is written under the job's lock. hand-written: the registry runner's loop
  (`SELECT … LIMIT n FOR UPDATE SKIP LOCKED`, each job in a savepoint, then its `DELETE` or the
  failure's `UPDATE`); diesel-claim: `.worker(&stop)` from the head of the queue, with
  `on_failure` and `then_delete` (\"delete in the closure\": the closure deletes its job, in
  the savepoint the failure hook needs); \"on a pool\": one worker, `run_pooled` on an r2d2 pool
  of W + 1 connections (`test_on_check_out` off), its W claim loops checking a connection out per
  claim, one listener. Idle workers poll every 1 ms, doubling to 20 ms; JS's workers listen on
  PostgreSQL (the producer notifies in each job's transaction).
- pickup: from the producer's `COMMIT` returning to the job's closure starting.";

/// The report of the drains: jobs/s per mode and worker count, each crate
/// mode beside its twin.
pub fn drain_table(runs: &[JobRun]) -> String {
    let header = [
        ("backend", Text),
        ("runner", Text),
        ("W", Number),
        ("jobs/s", Number),
        ("slowest–fastest", Number),
        ("× hand-written", Number),
    ];
    let rows = runs.iter().map(|run| {
        vec![
            run.backend.name().to_owned(),
            run.mode.name(),
            run.workers.to_string(),
            format!("{:.0}", run.jobs_per_sec()),
            run.spread(),
            twin_ratio(runs, run, JobRun::jobs_per_sec),
        ]
    });
    markdown_table(&header, rows)
}

/// The report of the steady states: completion rate and pickup latency.
pub fn steady_table(runs: &[JobRun]) -> String {
    let header = [
        ("backend", Text),
        ("runner", Text),
        ("W", Number),
        ("done/s", Number),
        ("pickup p50", Number),
        ("p99", Number),
        ("max", Number),
        ("p99 × hand-written", Number),
    ];
    let ms = |latency: Duration| format!("{:.2} ms", latency.as_secs_f64() * 1e3);
    let rows = runs.iter().map(|run| {
        vec![
            run.backend.name().to_owned(),
            run.mode.name(),
            run.workers.to_string(),
            format!("{:.0}", run.jobs_per_sec()),
            ms(run.quantile(0.5)),
            ms(run.quantile(0.99)),
            ms(run.pickups[run.pickups.len() - 1]),
            twin_ratio(runs, run, |run| run.quantile(0.99).as_secs_f64()),
        ]
    });
    markdown_table(&header, rows)
}

/// `figure` of a crate run over its twin's in the same run.
fn twin_ratio(runs: &[JobRun], run: &JobRun, figure: impl Fn(&JobRun) -> f64) -> String {
    if run.mode.runner == Runner::Twin {
        return String::new();
    }
    let twin = runs.iter().find(|other| {
        other.backend == run.backend
            && other.workers == run.workers
            && other.mode
                == JobMode {
                    runner: Runner::Twin,
                    ..run.mode
                }
    });
    twin.map_or(String::new(), |twin| {
        format!("{:.2}", figure(run) / figure(twin))
    })
}

/// Every job run asked for, on one backend: the drains, then the steady
/// states, each crate mode right after its twin.
pub fn run_all<C: JobConn>(
    url: &str,
    options: &crate::cli::Options,
) -> Result<(Vec<JobRun>, Vec<JobRun>), String> {
    let every = |asked: bool| -> Vec<JobRun> {
        let runs = options.workers.iter().flat_map(|&workers| {
            JobMode::ALL
                .into_iter()
                .map(move |mode| JobRun::new(C::BACKEND, mode, workers))
        });
        runs.filter(|_| asked).collect()
    };
    let mut drains = every(options.runs(crate::cli::JOB_DRAIN));
    let mut steady_runs = every(options.runs(crate::cli::JOB_STEADY));
    // Repetitions outermost, so that a crate mode runs right after its twin
    // every time.
    for _ in 0..options.repeat {
        for run in &mut drains {
            let rate = drain::<C>(url, run.mode, run.workers, options.jobs)?;
            eprintln!(
                "{} JR {} W={}: {rate:.0} jobs/s",
                C::BACKEND.name(),
                run.mode.name(),
                run.workers
            );
            run.rates.push(rate);
        }
    }
    for _ in 0..options.repeat {
        for run in &mut steady_runs {
            steady::<C>(url, run, options.job_rate, options.job_seconds)?;
            eprintln!(
                "{} JS {} W={}: p99 so far {:?}",
                C::BACKEND.name(),
                run.mode.name(),
                run.workers,
                run.quantile(0.99)
            );
        }
    }
    Ok((drains, steady_runs))
}
