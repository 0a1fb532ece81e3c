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

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};
use diesel::{MysqlConnection, PgConnection};
use diesel_claim::{Error, Retries, StopHandle, WaitForRows};

use crate::cpu::CpuTimes;
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

/// Who runs the jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runner {
    /// The hand-written loop.
    Twin,
    /// The hand-written loops in 4 processes of `W / 4` each (one at
    /// W = 1): the twin of `CrateScheduledProcesses`.
    TwinProcesses,
    /// The crate's worker, deleting each job with `then_delete`.
    Crate,
    /// The crate's worker, the closure deleting its job (in the savepoint
    /// the failure hook needs).
    CrateDeletingInClosure,
    /// The crate's worker on an r2d2 pool (`run_pooled`): one worker whose
    /// `W` claim loops check a connection out per claim, on a pool of `W`
    /// connections and one for the listener; with `then_delete`.
    CratePooled,
    /// The same, failures recorded by the crate's own retry schedule in the
    /// rows (`retries`) rather than a hook of the bench's.
    CrateScheduled,
    /// The same, in 4 worker processes of `W / 4` loops each (one at W = 1).
    CrateScheduledProcesses,
    /// On a pool with no failure hook (`keep_going`): no savepoint per job.
    /// Only when no job fails (`--job-fail-every 0`).
    CratePooledNoHook,
}

/// How the crate's worker on a pool records a failing job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failures {
    /// A hook of the bench's, writing what the twin writes.
    Hook,
    /// The crate's retry schedule in the rows.
    Schedule,
    /// Not at all: no hook, so no savepoint (no job fails).
    Unrecorded,
}

/// The worker processes of `TwinProcesses` and `CrateScheduledProcesses`.
const PROCESSES: usize = 4;

/// What a worker process prints once its pool is open.
const READY: &str = "ready";

/// One way of running jobs: the runner, and the jobs per transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobMode {
    pub runner: Runner,
    pub batch: u32,
}

impl JobMode {
    /// Every mode, for jobs of which one in `fail_every` fails (0: none).
    pub fn all(fail_every: u64) -> Vec<JobMode> {
        let mut modes = vec![
            JobMode::new(Runner::Twin, 1),
            JobMode::new(Runner::Crate, 1),
            JobMode::new(Runner::CratePooled, 1),
            JobMode::new(Runner::CrateScheduled, 1),
            JobMode::new(Runner::TwinProcesses, 1),
            JobMode::new(Runner::CrateScheduledProcesses, 1),
        ];
        if fail_every == 0 {
            modes.push(JobMode::new(Runner::CratePooledNoHook, 1));
        }
        modes.extend([
            JobMode::new(Runner::CrateDeletingInClosure, 1),
            JobMode::new(Runner::Twin, 10),
            JobMode::new(Runner::Crate, 10),
        ]);
        modes
    }

    const fn new(runner: Runner, batch: u32) -> Self {
        JobMode { runner, batch }
    }

    pub fn name(self) -> String {
        let runner = match self.runner {
            Runner::Twin => "hand-written",
            Runner::TwinProcesses => "hand-written in 4 processes",
            Runner::Crate => "diesel-claim",
            Runner::CrateDeletingInClosure => "diesel-claim, delete in the closure",
            Runner::CratePooled => "diesel-claim on a pool",
            Runner::CrateScheduled => "diesel-claim on a pool, retries in the rows",
            Runner::CrateScheduledProcesses => {
                "diesel-claim on pools in 4 processes, retries in the rows"
            }
            Runner::CratePooledNoHook => "diesel-claim on a pool, no hook (no savepoint)",
        };
        format!("{runner}, {} per transaction", self.batch)
    }
}

/// What the workers saw of the jobs: when each was first picked up (by the
/// wall clock, which worker processes share), and how often; and how many
/// jobs are done.
pub struct Ledger {
    first_pick: Mutex<Vec<Option<SystemTime>>>,
    picks: Vec<AtomicU32>,
    done: AtomicU64,
    /// One job in this many fails its first attempt (0: none).
    fail_every: u64,
}

impl Ledger {
    fn new(jobs: usize, fail_every: u64) -> Self {
        Ledger {
            first_pick: Mutex::new(vec![None; jobs]),
            picks: (0..jobs).map(|_| AtomicU32::new(0)).collect(),
            done: AtomicU64::new(0),
            fail_every,
        }
    }

    /// Whether job `seq` is one of those that fail their first attempt.
    fn failing(&self, seq: usize) -> bool {
        self.fail_every > 0 && (seq as u64).is_multiple_of(self.fail_every)
    }

    /// A worker's closure starts on `job`.
    fn picked(&self, job: &BenchJob) {
        let seq = job.seq as usize;
        if self.picks[seq].fetch_add(1, Ordering::Relaxed) == 0 {
            self.first_pick.lock().unwrap()[seq] = Some(SystemTime::now());
        }
    }

    /// Runs `job`: fails it (the failing ones, the first time), or counts it
    /// done.
    fn run(&self, job: &BenchJob) -> Result<(), Error> {
        self.picked(job);
        if self.failing(job.seq as usize) && job.attempts == 0 {
            return Err(Error::InvalidArgument(format!("job {} failed", job.seq)));
        }
        self.done.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// What a worker process saw, as it prints it: a line per job it
    /// picked, `pick <seq> <times> <first pick, µs since the epoch>`.
    fn print_picks(&self) {
        let first_pick = self.first_pick.lock().unwrap();
        let mut out = std::io::stdout().lock();
        for (seq, picks) in self.picks.iter().enumerate() {
            let picks = picks.load(Ordering::Relaxed);
            if let (true, Some(at)) = (picks > 0, first_pick[seq]) {
                let micros = at
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap()
                    .as_micros();
                writeln!(out, "pick {seq} {picks} {micros}").unwrap();
            }
        }
    }

    /// Adds a worker process's line of [`print_picks`](Self::print_picks).
    fn absorb(&self, line: &str) -> Result<(), String> {
        let fields: Vec<u128> = line
            .strip_prefix("pick ")
            .ok_or_else(|| format!("a worker process said {line:?}"))?
            .split(' ')
            .map(|field| {
                field
                    .parse()
                    .map_err(|_| format!("a worker process said {line:?}"))
            })
            .collect::<Result<_, _>>()?;
        let [seq, picks, micros] = fields[..] else {
            return Err(format!("a worker process said {line:?}"));
        };
        let at = SystemTime::UNIX_EPOCH + Duration::from_micros(micros as u64);
        let seq = seq as usize;
        self.picks[seq].fetch_add(picks as u32, Ordering::Relaxed);
        let mut first_pick = self.first_pick.lock().unwrap();
        first_pick[seq] = Some(first_pick[seq].map_or(at, |before| before.min(at)));
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
                let expected = if self.failing(seq) { 2 } else { 1 };
                let picks = picks.load(Ordering::Relaxed);
                let wrong = picks < expected || (picks > expected && !reruns_allowed);
                wrong.then(|| format!("job {seq} run {picks} times"))
            })
            .collect()
    }
}

/// What a connection does for the job runners, per backend.
pub trait JobConn: Connection + R2D2Connection + WaitForRows + Send + Sized + 'static {
    const BACKEND: BackendKind;

    fn open(url: &str) -> ConnectionResult<Self>;

    /// The jobs table, new and empty.
    fn create_jobs_table(&mut self) -> QueryResult<()>;

    /// Enqueues the jobs `seqs`, in one transaction (with a notification).
    fn enqueue(&mut self, seqs: std::ops::Range<i64>) -> QueryResult<()>;

    fn queued(&mut self) -> QueryResult<i64>;

    /// Whether any job is left: the drain's end, asked often while worker
    /// processes run, so it reads up to the first job left rather than
    /// counting them all (a count every few milliseconds cost the server a
    /// fifth of a core, which the other runners did not pay).
    fn any_queued(&mut self) -> QueryResult<bool>;

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

    /// The pool of a worker of `loops` claim loops: its W + 1 connections
    /// to `url` opened, as the twin's are, before a run's clock starts.
    fn pool(url: &str, loops: usize) -> Result<Pool<ConnectionManager<Self>>, Error>;

    /// The crate's worker on `pool`, `loops` claim loops, with
    /// `then_delete`, recording failures as `failures` says, until `stop`.
    #[allow(clippy::too_many_arguments)]
    fn pooled_worker(
        pool: &Pool<ConnectionManager<Self>>,
        loops: usize,
        batch: u32,
        failures: Failures,
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

            fn any_queued(&mut self) -> QueryResult<bool> {
                diesel::select(diesel::dsl::exists(
                    bench_jobs::table.select(bench_jobs::id),
                ))
                .get_result(self)
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

            fn pool(url: &str, loops: usize) -> Result<Pool<ConnectionManager<Self>>, Error> {
                // The worker finds dead connections itself: no test query
                // per checkout.
                Pool::builder()
                    .max_size(loops as u32 + 1)
                    .test_on_check_out(false)
                    .connection_customizer(Box::new(SetUp($setup)))
                    .build(ConnectionManager::<$conn>::new(url))
                    .map_err(|error| Error::InvalidArgument(error.to_string()))
            }

            fn pooled_worker(
                pool: &Pool<ConnectionManager<Self>>,
                loops: usize,
                batch: u32,
                failures: Failures,
                stop: &StopHandle,
                listen: bool,
                ledger: &Ledger,
            ) -> Result<u64, Error> {
                use diesel_claim::prelude::*;
                let no_backoff = Duration::ZERO;
                let run = |conn: &mut $conn, job: BenchJob| {
                    let _ = conn;
                    ledger.run(&job)
                };
                // Each way of recording failures is its own claim type.
                macro_rules! run_pooled {
                    ($claim:expr) => {{
                        let worker = $claim
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
                        worker.run_pooled(pool, run)?.processed
                    }};
                }
                let claim = queue!($db).build_claim().batch(batch);
                Ok(match failures {
                    Failures::Hook => run_pooled!(claim.on_failure(
                        |conn: &mut $conn, job: BenchJob, error: &Error| {
                            diesel::update(&job).set(failed!(error)).execute(conn)?;
                            Ok(())
                        }
                    )),
                    // The rows' schedule: run again at once, as the twin's.
                    Failures::Schedule => run_pooled!(bench_jobs::table
                        .order((bench_jobs::priority.desc(), bench_jobs::id))
                        .select(<BenchJob as SelectableHelper<$db>>::as_select())
                        .build_claim()
                        .batch(batch)
                        .retries(
                            Retries::new(bench_jobs::attempts, bench_jobs::run_at)
                                .last_error(bench_jobs::last_error)
                                .schedule([Duration::ZERO])
                        )),
                    Failures::Unrecorded => run_pooled!(claim.keep_going()),
                })
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
    if matches!(mode.runner, Runner::Crate | Runner::CrateDeletingInClosure) {
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
    /// Drains only: the CPU time each run spent per job, in the benchmark's
    /// processes and in the server's.
    pub cpu_per_job: Vec<CpuTimes>,
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
            cpu_per_job: Vec::new(),
            pickups: Vec::new(),
        }
    }

    /// The median jobs/s of the runs.
    pub fn jobs_per_sec(&self) -> f64 {
        median(self.rates.clone())
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
    listen: bool,
    ledger: &Ledger,
    feed: impl FnOnce(&Ledger) -> Result<(), String>,
) -> Result<(), String> {
    let stop = StopHandle::new();
    let ready = Barrier::new(workers + 1);
    let failures = match mode.runner {
        Runner::CratePooled => Some(Failures::Hook),
        Runner::CrateScheduled => Some(Failures::Schedule),
        Runner::CratePooledNoHook => Some(Failures::Unrecorded),
        Runner::TwinProcesses | Runner::CrateScheduledProcesses => {
            return in_processes::<C>(url, mode, workers, listen, ledger, feed)
                .and_then(|()| checked::<C>(url, mode, ledger));
        }
        Runner::Twin | Runner::Crate | Runner::CrateDeletingInClosure => None,
    };
    if let Some(failures) = failures {
        // One worker, its loops the W workers, on a pool opened before the
        // clock starts.
        let pool = C::pool(url, workers).map_err(|e| format!("{}: {e}", mode.name()))?;
        let fed = thread::scope(|scope| {
            let (stop, pool) = (&stop, &pool);
            let worker = scope.spawn(move || {
                C::pooled_worker(pool, workers, mode.batch, failures, stop, listen, ledger)
                    .map_err(|e| format!("{}: {e}", mode.name()))
            });
            let fed = feed(ledger);
            stop.stop();
            worker.join().expect("the pooled worker panicked")?;
            fed
        });
        return fed.and_then(|()| checked::<C>(url, mode, ledger));
    }
    let fed = thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                let (stop, ready) = (&stop, &ready);
                scope.spawn(move || {
                    let connected = C::open(url).map_err(|e| e.to_string());
                    ready.wait();
                    work(url, &mut connected?, mode, stop, listen, ledger)
                })
            })
            .collect();
        ready.wait();
        let fed = feed(ledger);
        stop.stop();
        for handle in handles {
            handle.join().expect("a worker panicked")?;
        }
        fed
    });
    fed?;
    checked::<C>(url, mode, ledger)
}

/// Runs the workers in [`PROCESSES`] processes of `workers / PROCESSES`
/// loops each (one process at W = 1), this program run again with
/// `--job-worker`, each a worker on a pool with the retry schedule in the
/// rows; `feed` beside them. Each process runs until its standard input
/// closes, then says which jobs it picked and when, into `ledger`.
fn in_processes<C: JobConn>(
    url: &str,
    mode: JobMode,
    workers: usize,
    listen: bool,
    ledger: &Ledger,
    feed: impl FnOnce(&Ledger) -> Result<(), String>,
) -> Result<(), String> {
    let processes = PROCESSES.min(workers);
    let program = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children: Vec<Child> = (0..processes)
        .map(|index| {
            let loops = workers / processes + usize::from(index < workers % processes);
            Command::new(&program)
                .arg(format!("--{}", crate::cli::JOB_WORKER))
                .args([
                    C::BACKEND.flag().to_owned(),
                    url.to_owned(),
                    if mode.runner == Runner::TwinProcesses {
                        "twin"
                    } else {
                        "crate"
                    }
                    .to_owned(),
                    loops.to_string(),
                    mode.batch.to_string(),
                    if listen { "listen" } else { "poll" }.to_owned(),
                    ledger.fail_every.to_string(),
                ])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot start a worker process: {e}"))
        })
        .collect::<Result<_, _>>()?;
    // Each process opens its pool, says so, and waits for the word to go.
    let mut outputs = Vec::with_capacity(children.len());
    for child in &mut children {
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        out.read_line(&mut line).map_err(|e| e.to_string())?;
        if line.trim_end() != READY {
            let status = child.wait().map_err(|e| e.to_string())?;
            return Err(format!(
                "{}: a worker process ended before it was ready ({status})",
                mode.name()
            ));
        }
        outputs.push(out);
    }
    for child in &mut children {
        let input = child.stdin.as_mut().expect("piped");
        input.write_all(b"go\n").map_err(|e| e.to_string())?;
    }
    let fed = feed(ledger);
    for child in &mut children {
        // Closing its input stops the worker.
        drop(child.stdin.take());
    }
    for (mut child, out) in children.into_iter().zip(outputs) {
        for line in out.lines() {
            ledger.absorb(&line.map_err(|e| e.to_string())?)?;
        }
        let status = child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!(
                "{}: a worker process failed ({status})",
                mode.name()
            ));
        }
    }
    fed
}

/// One worker process (`--job-worker`): the hand-written loops, each on a
/// connection of its own, or a worker on a pool with the retry schedule in
/// the rows, from a first line on its standard input until the input
/// closes; then it prints the jobs it picked.
pub fn worker_process<C: JobConn>(process: &crate::cli::JobWorker) -> Result<(), String> {
    let ledger = Ledger::new(1 << 20, process.fail_every);
    let stop = StopHandle::new();
    let url = process.url.as_str();
    // Connections are opened before the word to go, as in one process.
    enum Opened<C: R2D2Connection + 'static> {
        Twin(Vec<C>),
        Pool(Pool<ConnectionManager<C>>),
    }
    let opened = if process.twin {
        let conns = (0..process.loops).map(|_| C::open(url));
        Opened::Twin(conns.collect::<Result<_, _>>().map_err(|e| e.to_string())?)
    } else {
        Opened::Pool(C::pool(url, process.loops).map_err(|e| e.to_string())?)
    };
    println!("{READY}");
    let mut input = String::new();
    std::io::stdin()
        .read_line(&mut input)
        .map_err(|e| e.to_string())?;
    let stopper = stop.clone();
    thread::spawn(move || {
        while std::io::stdin()
            .read_line(&mut input)
            .is_ok_and(|read| read > 0)
        {}
        stopper.stop();
    });
    match opened {
        Opened::Twin(conns) => {
            let mode = JobMode::new(Runner::Twin, process.batch);
            let (stop, ledger) = (&stop, &ledger);
            thread::scope(|scope| {
                let loops: Vec<_> = conns
                    .into_iter()
                    .map(|mut conn| {
                        scope
                            .spawn(move || work(url, &mut conn, mode, stop, process.listen, ledger))
                    })
                    .collect();
                loops
                    .into_iter()
                    .try_for_each(|handle| handle.join().expect("a worker panicked"))
            })?;
        }
        Opened::Pool(pool) => {
            C::pooled_worker(
                &pool,
                process.loops,
                process.batch,
                Failures::Schedule,
                &stop,
                process.listen,
                &ledger,
            )
            .map_err(|e| e.to_string())?;
        }
    }
    ledger.print_picks();
    Ok(())
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
/// closures have said so (those of this process: workers in other processes
/// say so at their end), and (a rolled-back batch's jobs are counted twice)
/// `conn` sees none left.
fn until_done<C: JobConn>(
    conn: &mut C,
    mode: JobMode,
    ledger: &Ledger,
    jobs: u64,
    bound: Duration,
) -> Result<Instant, String> {
    let deadline = Instant::now() + bound;
    let in_processes = matches!(
        mode.runner,
        Runner::TwinProcesses | Runner::CrateScheduledProcesses
    );
    loop {
        if (in_processes || ledger.done.load(Ordering::Acquire) >= jobs)
            && !conn.any_queued().map_err(|e| e.to_string())?
        {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{} of {jobs} jobs done after {bound:?}",
                ledger.done.load(Ordering::Acquire)
            ));
        }
        // Workers in other processes are counted by the table alone: asked
        // less often, so that the count does not load the server they share.
        let every = if in_processes { 5_000 } else { 200 };
        thread::sleep(Duration::from_micros(every));
    }
}

/// JR: drains a backlog of `jobs` jobs; the jobs done per second, and the
/// CPU time spent per job.
pub fn drain<C: JobConn>(
    url: &str,
    mode: JobMode,
    workers: usize,
    jobs: usize,
    fail_every: u64,
) -> Result<(f64, CpuTimes), String> {
    let mut conn = C::open(url).map_err(|e| e.to_string())?;
    conn.create_jobs_table().map_err(|e| e.to_string())?;
    conn.enqueue(0..jobs as i64).map_err(|e| e.to_string())?;
    let mut elapsed = Duration::ZERO;
    let ledger = Ledger::new(jobs, fail_every);
    let before = CpuTimes::now();
    run_workers::<C>(url, mode, workers, false, &ledger, |ledger| {
        let started = Instant::now();
        let bound = Duration::from_secs(600);
        elapsed = until_done(&mut conn, mode, ledger, jobs as u64, bound)? - started;
        Ok(())
    })?;
    let spent = CpuTimes::now().since(before);
    let per_job = CpuTimes {
        bench: spent.bench / jobs as u32,
        server: spent.server / jobs as u32,
    };
    Ok((jobs as f64 / elapsed.as_secs_f64(), per_job))
}

/// JS: a producer enqueues `rate` jobs per second for `seconds`, one per
/// transaction; workers listen where they can. Adds the jobs done per
/// second and the pickups to `run`.
pub fn steady<C: JobConn>(
    url: &str,
    run: &mut JobRun,
    rate: u32,
    seconds: u32,
    fail_every: u64,
) -> Result<(), String> {
    let (mode, workers) = (run.mode, run.workers);
    let jobs = (rate * seconds) as usize;
    let mut producer = C::open(url).map_err(|e| e.to_string())?;
    producer.create_jobs_table().map_err(|e| e.to_string())?;
    let listen = C::BACKEND == BackendKind::Postgres;
    let mut committed = vec![SystemTime::now(); jobs];
    let mut elapsed = Duration::ZERO;
    let ledger = Ledger::new(jobs, fail_every);
    run_workers::<C>(url, mode, workers, listen, &ledger, |ledger| {
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
            *committed = SystemTime::now();
        }
        let bound = Duration::from_secs(120);
        elapsed = until_done(&mut producer, mode, ledger, jobs as u64, bound)? - started;
        Ok(())
    })?;
    // Read once the worker processes, if any, have said theirs.
    let first_pick = ledger.first_pick.lock().unwrap().clone();
    let pickups: Vec<Duration> = first_pick
        .iter()
        .zip(&committed)
        .map(|(picked, committed)| {
            picked.map_or(Duration::ZERO, |at| {
                at.duration_since(*committed).unwrap_or_default()
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
  deleted when done; one in 20 (`--job-fail-every`; 0: none) fails its first attempt, and the
  failure (attempts, error, next run time) is written under the job's lock. hand-written: the
  registry runner's loop (`SELECT … LIMIT n FOR UPDATE SKIP LOCKED`, each job in a savepoint,
  then its `DELETE` or the failure's `UPDATE`); diesel-claim: `.worker(&stop)` from the head of
  the queue, with `on_failure` and `then_delete` (\"delete in the closure\": the closure deletes
  its job, in the savepoint the failure hook needs); \"on a pool\": one worker, `run_pooled` on
  an r2d2 pool of W + 1 connections (`test_on_check_out` off), its W claim loops checking a
  connection out per claim, one listener; \"retries in the rows\": the same, failures written by
  the crate's retry schedule (`retries`, no delay) instead of the hook; \"in 4 processes\": that
  worker, or the hand-written loops, run in 4 processes of W / 4 loops each (one process at
  W = 1); \"no hook\": no failure hook, so no savepoint per job (only when no job fails). Idle
  workers poll every 1 ms, doubling to 20 ms; JS's workers listen on PostgreSQL (the producer
  notifies in each job's transaction).
- × hand-written: the crate's drains over the hand-written loop's in as many processes (the
  loop in 4 processes over the loop in one), run by run, each run next to its twin's (every
  other repetition in the reverse order): the median of the ratios. CPU µs/job: the user and
  system time the benchmark's processes and the database server spent in a drain, over its
  jobs (from /proc; medians); on two cores a drain of 16 workers is bound by them.
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
        ("CPU µs/job: bench", Number),
        ("server", Number),
    ];
    let median_micros = |run: &JobRun, side: fn(&CpuTimes) -> Duration| {
        if run.cpu_per_job.is_empty() {
            return String::new();
        }
        let micros = run.cpu_per_job.iter().map(|t| side(t).as_secs_f64() * 1e6);
        format!("{:.0}", median(micros.collect()))
    };
    let rows = runs.iter().map(|run| {
        vec![
            run.backend.name().to_owned(),
            run.mode.name(),
            run.workers.to_string(),
            format!("{:.0}", run.jobs_per_sec()),
            run.spread(),
            paired_ratio(runs, run),
            median_micros(run, |t| t.bench),
            median_micros(run, |t| t.server),
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

/// The run `run` is measured against: the hand-written loop of the same
/// batch and worker count, in as many processes (none for the loop itself).
fn twin_of<'r>(runs: &'r [JobRun], run: &JobRun) -> Option<&'r JobRun> {
    let twin = match run.mode.runner {
        Runner::Twin => return None,
        Runner::CrateScheduledProcesses => Runner::TwinProcesses,
        _ => Runner::Twin,
    };
    runs.iter().find(|other| {
        other.backend == run.backend
            && other.workers == run.workers
            && other.mode
                == JobMode {
                    runner: twin,
                    ..run.mode
                }
    })
}

/// `figure` of a run over its twin's in the same run.
fn twin_ratio(runs: &[JobRun], run: &JobRun, figure: impl Fn(&JobRun) -> f64) -> String {
    twin_of(runs, run).map_or(String::new(), |twin| {
        format!("{:.2}", figure(run) / figure(twin))
    })
}

/// A drain's rate over its twin's, run by run (each run next to its twin's,
/// so that the machine's drift between repetitions cancels out): the median
/// of the ratios.
fn paired_ratio(runs: &[JobRun], run: &JobRun) -> String {
    twin_of(runs, run).map_or(String::new(), |twin| {
        let ratios = run.rates.iter().zip(&twin.rates).map(|(r, t)| r / t);
        format!("{:.2}", median(ratios.collect()))
    })
}

/// The median of `values`, of which there is at least one.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    match values.len() % 2 {
        1 => values[middle],
        _ => (values[middle - 1] + values[middle]) / 2.0,
    }
}

/// `runs` in order on even repetitions, in the reverse order on odd ones.
fn alternating(runs: &mut [JobRun], repetition: u32) -> Vec<&mut JobRun> {
    let mut order: Vec<&mut JobRun> = runs.iter_mut().collect();
    if repetition % 2 == 1 {
        order.reverse();
    }
    order
}

/// Every job run asked for, on one backend: the drains, then the steady
/// states, each crate mode next to its twin.
pub fn run_all<C: JobConn>(
    url: &str,
    options: &crate::cli::Options,
) -> Result<(Vec<JobRun>, Vec<JobRun>), String> {
    let every = |asked: bool| -> Vec<JobRun> {
        let runs = options.workers.iter().flat_map(|&workers| {
            JobMode::all(options.job_fail_every)
                .into_iter()
                .map(move |mode| JobRun::new(C::BACKEND, mode, workers))
        });
        runs.filter(|_| asked).collect()
    };
    let mut drains = every(options.runs(crate::cli::JOB_DRAIN));
    let mut steady_runs = every(options.runs(crate::cli::JOB_STEADY));
    // Repetitions outermost, so that a crate mode runs next to its twin
    // every time; every other repetition in the reverse order, so that
    // neither runs first more often (on a noisy two-core machine, the same
    // pooled worker measured 0.88 x its twin run after it, 1.01 x run
    // before it).
    for repetition in 0..options.repeat {
        for run in alternating(&mut drains, repetition) {
            let (rate, cpu_per_job) = drain::<C>(
                url,
                run.mode,
                run.workers,
                options.jobs,
                options.job_fail_every,
            )?;
            eprintln!(
                "{} JR {} W={}: {rate:.0} jobs/s",
                C::BACKEND.name(),
                run.mode.name(),
                run.workers
            );
            run.rates.push(rate);
            run.cpu_per_job.push(cpu_per_job);
        }
    }
    for repetition in 0..options.repeat {
        for run in alternating(&mut steady_runs, repetition) {
            steady::<C>(
                url,
                run,
                options.job_rate,
                options.job_seconds,
                options.job_fail_every,
            )?;
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
