//! Command-line options.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::Parser;

use crate::db::{BackendKind, Isolation};
use crate::drain::{Mode, BATCH_SIZES};

/// The id `--only` knows the index-effect measurement by.
pub const INDEX_EFFECT: &str = "IX";

/// The id `--only` knows the pickup-latency measurement by.
pub const PICKUP: &str = "PL";

/// The ids `--only` knows the job runner's drain and steady state by.
pub const JOB_DRAIN: &str = "JR";
pub const JOB_STEADY: &str = "JS";

/// The id `--only` knows the seed's Django loop by: left out of `--quick`.
const DJANGO: &str = "DJ";

/// Hidden option: run one memory measurement and print `VmHWM` (see
/// `memory.rs`): `--memory-child BACKEND URL ROWS MODE`.
pub const MEMORY_CHILD: &str = "memory-child";

/// Hidden option: run one of the job runner's worker processes (see
/// `jobs.rs`): `--job-worker BACKEND URL LOOPS BATCH LISTEN FAIL_EVERY`.
pub const JOB_WORKER: &str = "job-worker";

/// Where the servers are, shown after the options by `--help`.
const ENVIRONMENT: &str = "\
PostgreSQL: PG_DATABASE_URL, else DATABASE_URL if it is a postgres URL, else
postgres://postgres@127.0.0.1:5432/test. MySQL/MariaDB: MYSQL_DATABASE_URL, else
DATABASE_URL if it is a mysql URL, else mysql://root@127.0.0.1:3306/test. On both
servers the benchmark works in a database of its own, created and dropped by itself.";

/// Throughput of claiming, side by side with hand-written SQL (see BENCHMARKS.md).
#[derive(Debug, Parser)]
#[command(
    name = "throughput",
    override_usage = "cargo bench -p diesel-claim-bench -- [OPTIONS]",
    after_help = ENVIRONMENT,
    // A repeated option's last value counts (the lists add up) rather than
    // being an error.
    args_override_self = true
)]
pub struct Options {
    /// Smoke test: ~300 rows, workers 1,2,4, short B5 runs, no SVG unless --svg
    /// is given, no DJ unless --only names it; checks correctness only
    #[arg(long)]
    pub quick: bool,
    /// Pending rows per drain (300 with --quick)
    #[arg(
        long,
        value_name = "N",
        value_parser = number::<i64>,
        default_value = "10000",
        default_value_if("quick", "true", "300")
    )]
    pub rows: i64,
    /// Worker counts (1,2,4 with --quick)
    #[arg(
        long,
        value_name = "1,2,4,8",
        value_delimiter = ',',
        value_parser = number::<usize>,
        default_value = "1,2,4,8",
        default_value_if("quick", "true", "1,2,4")
    )]
    pub workers: Vec<usize>,
    /// postgres (pg), sqlite, mysql (mariadb) or all
    #[arg(long = "backend", value_name = "B", value_parser = backends, default_value = "all")]
    // Qualified, so that clap takes one value (a backend or all), not a list.
    pub backends: std::vec::Vec<BackendKind>,
    /// Run only these: B0 B1 B2 B3 B3d B3h H2 H3 M1 M2 B4 O3 O3h, the peers DJ (the seed's
    /// Django loop) D0 D3 (Diesel alone, per row and n=100) FQ (the fang job queue),
    /// B5 (contention), IX (the index effect), PL (the worker loop's pickup latency),
    /// JR and JS (a job runner's drain and steady state, PostgreSQL and MySQL)
    #[arg(long, value_name = "MODE,...", value_delimiter = ',')]
    only: Vec<String>,
    /// Batch sizes of B3, B3d and B3h
    #[arg(
        long,
        value_name = "10,100,1000",
        value_delimiter = ',',
        value_parser = number::<u32>,
        default_values_t = BATCH_SIZES
    )]
    pub batches: Vec<u32>,
    /// Run the index effect (10^6 done rows, with and without the partial index;
    /// PostgreSQL and SQLite); alone, only it. The full run includes it, --quick
    /// does not
    #[arg(long)]
    index_effect: bool,
    /// Also measure peak memory at 10^4 and 10^6 pending rows (PostgreSQL and
    /// MySQL, in child processes)
    #[arg(long)]
    pub memory: bool,
    /// Write the plot there (none with --quick unless given; a relative path
    /// is the benchmark package's, as cargo runs it from there)
    #[arg(
        long,
        value_name = "PATH",
        default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/throughput.svg"),
        default_value_if("quick", "true", None)
    )]
    pub svg: Option<PathBuf>,
    /// Also run B0, B2, B3d and B3 on a second database whose orders table is
    /// partitioned by its pending flag (PostgreSQL, MySQL), each right after
    /// the same mode on the plain table
    #[arg(long)]
    pub partitioned: bool,
    /// The isolation level of every MySQL connection
    #[arg(long, value_name = "LEVEL", value_enum, default_value_t = Isolation::ReadCommitted)]
    pub mysql_isolation: Isolation,
    /// Run SQLite's drains with the statistics ANALYZE gathers after the refill
    /// (every row pending) instead of none
    #[arg(long)]
    pub sqlite_analyze: bool,
    /// Run every drain R times, interleaved, and report the median rows/s and
    /// the slowest and fastest run
    #[arg(
        long,
        value_name = "R",
        default_value_t = 1,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub repeat: u32,
    /// Queued jobs per job-runner drain, JR (200 with --quick)
    #[arg(
        long,
        value_name = "N",
        value_parser = number::<usize>,
        default_value = "4000",
        default_value_if("quick", "true", "200")
    )]
    pub jobs: usize,
    /// Jobs a second the job runner's producer enqueues, JS (100 with --quick)
    #[arg(
        long,
        value_name = "R",
        value_parser = number::<u32>,
        default_value = "500",
        default_value_if("quick", "true", "100")
    )]
    pub job_rate: u32,
    /// Seconds the job runner's producer runs, JS (1 with --quick)
    #[arg(
        long,
        value_name = "S",
        value_parser = number::<u32>,
        default_value = "10",
        default_value_if("quick", "true", "1")
    )]
    pub job_seconds: u32,
    /// One job in this many fails its first attempt, in JR and JS (0: none;
    /// the crate then also runs on a pool without a failure hook, whose jobs
    /// run without a savepoint)
    #[arg(long, value_name = "N", value_parser = number::<u64>, default_value = "20")]
    pub job_fail_every: u64,
    /// Print every statement the drains send (with few --rows)
    #[arg(long)]
    pub trace: bool,
    /// Install a tracing subscriber (diesel_claim=info, spans printed as they
    /// close, to nowhere) and a metrics recorder first, as a service that reads
    /// them does (needs the tracing and metrics features)
    #[arg(long)]
    pub telemetry: bool,
    /// Ignored: `cargo bench` passes it to every bench target.
    #[arg(long, hide = true)]
    bench: bool,
    #[arg(
        long = MEMORY_CHILD,
        hide = true,
        num_args = 4,
        value_names = ["BACKEND", "URL", "ROWS", "MODE"]
    )]
    memory_child: Option<Vec<String>>,
    #[arg(
        long = JOB_WORKER,
        hide = true,
        num_args = 7,
        value_names = ["BACKEND", "URL", "RUNNER", "LOOPS", "BATCH", "LISTEN", "FAIL_EVERY"]
    )]
    job_worker: Option<Vec<String>>,
}

/// One of the job runner's worker processes.
pub struct JobWorker {
    pub backend: BackendKind,
    pub url: String,
    /// The hand-written loops (`twin`), else the crate's worker on a pool.
    pub twin: bool,
    pub loops: usize,
    pub batch: u32,
    pub listen: bool,
    pub fail_every: u64,
}

/// One memory measurement, in a child process.
pub struct MemoryChild {
    pub backend: BackendKind,
    pub url: String,
    pub rows: i64,
    pub mode: String,
}

impl Options {
    /// The memory measurement `--memory-child` asks for, if it does.
    pub fn memory_child(&self) -> Option<Result<MemoryChild, String>> {
        let [backend, url, rows, mode] = self.memory_child.as_deref()? else {
            unreachable!("clap takes four values");
        };
        Some(backend_named(backend).and_then(|backend| {
            Ok(MemoryChild {
                backend,
                url: url.clone(),
                rows: number(rows)?,
                mode: mode.clone(),
            })
        }))
    }

    /// The job runner's worker process `--job-worker` asks for, if it does.
    pub fn job_worker(&self) -> Option<Result<JobWorker, String>> {
        let [backend, url, runner, loops, batch, listen, fail_every] =
            self.job_worker.as_deref()?
        else {
            unreachable!("clap takes seven values");
        };
        Some(backend_named(backend).and_then(|backend| {
            Ok(JobWorker {
                backend,
                url: url.clone(),
                twin: runner == "twin",
                loops: number(loops)?,
                batch: number(batch)?,
                listen: listen == "listen",
                fail_every: number(fail_every)?,
            })
        }))
    }

    /// How long each B5 configuration runs.
    pub fn contention_time(&self) -> Duration {
        Duration::from_millis(if self.quick { 200 } else { 2000 })
    }

    /// Whether this drain mode is to run.
    pub fn runs_mode(&self, mode: Mode) -> bool {
        self.runs(&mode.id_name())
            && (!mode.is_sized() || self.batches.contains(&mode.batch))
            && (!mode.partitioned || self.partitioned)
    }

    /// Whether the mode with this id (`B0`, `B3h`, `B5`, `IX`, …) is to run.
    pub fn runs(&self, id: &str) -> bool {
        if self.only.is_empty() && !self.index_effect {
            // The index effect fills a million rows, and the Django loop may
            // first install Django from PyPI: neither in a smoke test.
            return !(self.quick && (id == INDEX_EFFECT || id == DJANGO));
        }
        (self.index_effect && id == INDEX_EFFECT)
            || self.only.iter().any(|o| o.trim().eq_ignore_ascii_case(id))
    }
}

/// A number, with `_` allowed between digits (`--rows 100_000`).
fn number<T: FromStr>(text: &str) -> Result<T, String> {
    text.trim()
        .replace('_', "")
        .parse()
        .map_err(|_| format!("not a number: `{text}`"))
}

fn backends(text: &str) -> Result<Vec<BackendKind>, String> {
    match text {
        "all" => Ok(BackendKind::ALL.to_vec()),
        one => backend_named(one).map(|backend| vec![backend]),
    }
}

fn backend_named(text: &str) -> Result<BackendKind, String> {
    let text = match text {
        "pg" => "postgres",
        "mariadb" => "mysql",
        text => text,
    };
    BackendKind::ALL
        .into_iter()
        .find(|backend| backend.flag() == text)
        .ok_or_else(|| format!("unknown backend `{text}`"))
}
