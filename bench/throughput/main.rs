//! Throughput of claiming, side by side with hand-written SQL.
//!
//! ```sh
//! cargo bench -p diesel-claim-bench -- [--quick] [--rows N] \
//!     [--workers 1,2,4,8] [--backend postgres|sqlite|mysql|all] [--only MODE,...] \
//!     [--batches 10,100,1000] [--index-effect] [--memory] [--svg PATH] [--repeat R] \
//!     [--trace] [--mysql-isolation read-committed|repeatable-read] [--sqlite-analyze] \
//!     [--telemetry]
//! ```
//!
//! (`-- --help` describes them.)
//!
//! N pending orders are drained by W workers, each with a connection of its
//! own; processing an order marks it done and writes one outbox row. The
//! baselines B0–B5 and the bars the crate is held to are described in
//! `BENCHMARKS.md`. Every drain ends with correctness checks (no order
//! processed twice, none left pending), and so does the contention run B5 (no
//! lost update), and so do the index effect's drains. Those checks, and the
//! empty-queue check, are the only things that make the program fail; the bars
//! are reported as met or missed. Timings on a shared machine are noisy: compare
//! modes within one run, where each crate mode runs right after its hand-written
//! twin, and repeat the run (`--repeat R`): every drain then runs R times,
//! interleaved, and the report gives the median rows/s of each and its slowest
//! and fastest run, and compares medians. `BENCHMARKS.md` explains the figures.
//!
//! Layout: `cli` (options), `schema` (tables and their SQL), `db` (what a
//! connection does, per backend), `database` (the benchmark's own database),
//! `counting` (statements and transactions sent), `drain` (the modes and a
//! timed drain), `peers` (the Django loop and the fang job queue, which drain
//! outside the modes' loop), `contention` (B5), `index_effect` (claiming with and without
//! the partial index), `memory` (peak RSS, in child processes), `pickup` (the
//! worker loop's pickup latency), `jobs` (a job runner's workload, JR and
//! JS), `report`
//! (medians, tables and bars), `svg` (the plot) and `telemetry` (a
//! subscriber and a recorder, to measure what the crate's events and
//! metrics cost).

// Throwaway databases, shared with the tests and examples.
extern crate diesel_claim_testkit as testkit;

mod cli;
mod contention;
mod counting;
mod cpu;
mod database;
mod db;
mod drain;
mod index_effect;
mod jobs;
mod memory;
mod peers;
mod pickup;
mod report;
mod schema;
mod svg;
mod telemetry;

use std::process::ExitCode;

use clap::Parser;
use diesel::{MysqlConnection, PgConnection, SqliteConnection};

use cli::{MemoryChild, Options};
use contention::{run_contention, Approach, HOT_SETS};
use database::BenchDb;
use db::{BackendKind, BenchConn};
use drain::{check_empty_queue, run_drain, Mode, ModeId};
use report::{DrainRuns, Results};

fn main() -> ExitCode {
    let options = Options::parse();
    let outcome = match (options.memory_child(), options.job_worker()) {
        (Some(child), _) => child.and_then(memory_child),
        (None, Some(process)) => process.and_then(|process| job_worker(&process)),
        (None, None) => bench(&options),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// One memory measurement, in the child process `memory::measure` started.
fn memory_child(child: MemoryChild) -> Result<(), String> {
    let (url, rows, mode) = (&child.url, child.rows, &child.mode);
    match child.backend {
        BackendKind::Postgres => memory::child::<PgConnection>(url, rows, mode),
        BackendKind::Mysql => memory::child::<MysqlConnection>(url, rows, mode),
        BackendKind::Sqlite => Err("memory is measured on servers only".to_owned()),
    }
}

/// One of the job runner's worker processes (see `jobs::in_processes`).
fn job_worker(process: &cli::JobWorker) -> Result<(), String> {
    match process.backend {
        BackendKind::Postgres => jobs::worker_process::<PgConnection>(process),
        BackendKind::Mysql => jobs::worker_process::<MysqlConnection>(process),
        BackendKind::Sqlite => Err("the job runner runs on servers only".to_owned()),
    }
}

/// Runs everything asked for, prints the report, and fails on any
/// correctness failure.
fn bench(options: &Options) -> Result<(), String> {
    if options.telemetry {
        telemetry::install()?;
    }
    db::set_mysql_isolation(options.mysql_isolation);
    db::set_sqlite_analyze(options.sqlite_analyze);
    let mut results = Results::default();
    let mut machine = machine_description();
    let load_before = load_average();
    for &backend in &options.backends {
        let version = match backend {
            BackendKind::Postgres => run_backend::<PgConnection>(options, &mut results)?,
            BackendKind::Sqlite => run_backend::<SqliteConnection>(options, &mut results)?,
            BackendKind::Mysql => run_backend::<MysqlConnection>(options, &mut results)?,
        };
        machine.push_str(&format!("- {}: {version}\n", backend.name()));
        let jobs = match backend {
            BackendKind::Postgres => run_jobs::<PgConnection>(options)?,
            BackendKind::Mysql => run_jobs::<MysqlConnection>(options)?,
            BackendKind::Sqlite => Default::default(),
        };
        results.job_drains.extend(jobs.0);
        results.job_steady.extend(jobs.1);
    }
    // Other work on a shared machine is what makes timings noisy.
    machine.push_str(&format!(
        "- load average (1 min) at the start: {load_before}, at the end: {}\n",
        load_average()
    ));
    print_report(options, &machine, &results);
    if let Some(path) = options.svg.as_ref().filter(|_| !results.drains.is_empty()) {
        let mut title = format!("diesel-claim: draining {} pending rows", options.rows);
        if options.repeat > 1 {
            title.push_str(&format!(", median of {} runs", options.repeat));
        }
        if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        std::fs::write(path, svg::plot(&results, &title)?)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        println!("\nPlot written to {}", path.display());
    }
    let failures = results.failures();
    if failures.is_empty() {
        return Ok(());
    }
    Err(format!(
        "correctness checks failed:\n  {}",
        failures.join("\n  ")
    ))
}

/// The job runner's workload (JR, JS) on a database of its own, if asked for.
fn run_jobs<C: BenchConn + jobs::JobConn>(
    options: &Options,
) -> Result<(Vec<jobs::JobRun>, Vec<jobs::JobRun>), String> {
    if !options.runs(cli::JOB_DRAIN) && !options.runs(cli::JOB_STEADY) {
        return Ok(Default::default());
    }
    let db = BenchDb::<C>::create(false)?;
    jobs::run_all::<C>(&db.url, options)
}

/// Runs everything asked for on one backend; returns the server's version.
fn run_backend<C: BenchConn>(options: &Options, results: &mut Results) -> Result<String, String> {
    let mut db = BenchDb::<C>::create(false)?;
    let version = db.setup(|conn| conn.load_text(&server_version_query(C::BACKEND)))?;
    let mut partitioned = match options.partitioned && C::BACKEND.has_partitions() {
        true => Some(BenchDb::<C>::create(true)?),
        false => None,
    };
    run_drains(&mut db, partitioned.as_mut(), options, results)?;
    if options.runs("B5") {
        run_contentions(&mut db, options, results)?;
    }
    results.empty_queue.push(check_empty_queue(&mut db)?);
    if options.runs(cli::PICKUP) {
        let rows = if options.quick { 10 } else { 200 };
        results.pickup.extend(pickup::measure(&mut db, rows)?);
    }
    if options.runs(cli::INDEX_EFFECT) && index_effect::applies(C::BACKEND) {
        results.index_effect.push(index_effect::measure(&mut db)?);
    }
    // SQLite's page cache lives in the process and would be measured with it.
    if options.memory && C::BACKEND != BackendKind::Sqlite {
        results.memory.extend(memory::measure::<C>(&db.url)?);
    }
    Ok(version)
}

/// Runs the drains; a mode on partitioned orders runs in `partitioned`.
fn run_drains<C: BenchConn>(
    db: &mut BenchDb<C>,
    mut partitioned: Option<&mut BenchDb<C>>,
    options: &Options,
    results: &mut Results,
) -> Result<(), String> {
    let modes: Vec<Mode> = Mode::all()
        .into_iter()
        .filter(|mode| mode.runs_on(C::BACKEND) && options.runs_mode(*mode))
        .filter(|mode| can_run(*mode, results))
        .collect();
    // Not reported: the first mode measured in each database should not pay
    // for cold caches.
    if let Some(&first) = modes.iter().find(|mode| !mode.partitioned) {
        run_drain(db, first, 1, options.rows, false)?;
    }
    if let Some((&first, partitioned)) = modes
        .iter()
        .find(|mode| mode.partitioned)
        .zip(partitioned.as_deref_mut())
    {
        run_drain(partitioned, first, 1, options.rows, false)?;
    }
    // Every mode at every worker count, each crate mode right after its twin;
    // repetitions outermost, so that a twin and its crate mode run back to back,
    // under the same conditions, every time.
    let mut drains: Vec<DrainRuns> = options
        .workers
        .iter()
        .flat_map(|&workers| {
            modes
                .iter()
                .map(move |&mode| DrainRuns::new(C::BACKEND, mode, workers))
        })
        .collect();
    for _ in 0..options.repeat {
        for drain in &mut drains {
            let (mode, workers) = (drain.mode, drain.workers);
            let db = match (mode.partitioned, partitioned.as_deref_mut()) {
                (true, Some(partitioned)) => partitioned,
                (true, None) => unreachable!("partitioned modes run only with their database"),
                (false, _) => &mut *db,
            };
            let run = run_drain(db, mode, workers, options.rows, options.trace)?;
            eprintln!(
                "{} {mode} W={workers}: {:.0} rows/s",
                C::BACKEND.name(),
                run.rows_per_sec()
            );
            drain.runs.push(run);
        }
    }
    let order = |mode: &Mode| Mode::all().iter().position(|m| m == mode);
    drains.sort_by_key(|drain| (order(&drain.mode), drain.workers));
    results.drains.extend(drains);
    Ok(())
}

/// Whether the mode can run here: DJ needs Python with Django (see
/// `peers::django`). When it cannot, the run says why, in the report too, and
/// goes on without it.
fn can_run(mode: Mode, results: &mut Results) -> bool {
    if mode.id != ModeId::DJ {
        return true;
    }
    match peers::django::python() {
        Ok(_) => true,
        Err(why) => {
            let note = format!("DJ (the seed's Django loop) skipped: {why}");
            eprintln!("{note}");
            if !results.notes.contains(&note) {
                results.notes.push(note);
            }
            false
        }
    }
}

fn run_contentions<C: BenchConn>(
    db: &mut BenchDb<C>,
    options: &Options,
    results: &mut Results,
) -> Result<(), String> {
    for hot in HOT_SETS {
        for approach in Approach::ALL {
            for &workers in &options.workers {
                let run = run_contention(db, approach, hot, workers, options.contention_time())?;
                eprintln!(
                    "{} B5 {approach:?} K={hot} W={workers}: {:.0} successes/s",
                    C::BACKEND.name(),
                    run.successes_per_sec()
                );
                results.contention.push(run);
            }
        }
    }
    Ok(())
}

fn server_version_query(backend: BackendKind) -> String {
    match backend {
        BackendKind::Postgres => "SELECT version() || ', fsync ' || current_setting('fsync') \
             || ', synchronous_commit ' || current_setting('synchronous_commit') AS t"
            .to_owned(),
        BackendKind::Sqlite => format!(
            "SELECT 'SQLite ' || sqlite_version() || ', WAL, synchronous ' \
             || (SELECT synchronous FROM pragma_synchronous) || ', drains {}' AS t",
            if db::sqlite_analyze() {
                "ANALYZEd after each refill"
            } else {
                "without statistics"
            }
        ),
        // The connections set their own isolation level (see `db::open_mysql`).
        BackendKind::Mysql => format!(
            "SELECT CONCAT(VERSION(), ', innodb_flush_log_at_trx_commit ', \
             @@innodb_flush_log_at_trx_commit, ', connections at {}') AS t",
            db::mysql_isolation().sql()
        ),
    }
}

/// Cores and CPU model of this machine.
fn machine_description() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|line| line.strip_prefix("model name"))
                .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    format!("- {cores} cores: {cpu}\n")
}

/// The 1-minute load average, from `/proc/loadavg`.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".to_owned())
}

fn print_report(options: &Options, machine: &str, results: &Results) {
    if options.quick {
        println!("\nQuick run: a smoke test of correctness; its timings mean little.");
    }
    println!("\n## Machine\n\n{machine}");
    if !results.drains.is_empty() {
        println!(
            "## Draining {} pending rows\n\n{}\n{}{}\n",
            options.rows,
            report::drain_table(results),
            report::aborted_lines(results),
            report::DRAIN_TABLE_NOTES
        );
    }
    if results.drains.iter().any(|runs| runs.mode.is_peer()) || !results.notes.is_empty() {
        println!(
            "## Against the peers\n\n{}\n{}{}\n",
            report::peers_table(results),
            report::peer_lines(results),
            report::PEERS_NOTES
        );
    }
    if !results.contention.is_empty() {
        println!(
            "## B5: hot accounts, {:.1} s per configuration\n\n{}\n\
             - retries/success: runs of the closure beyond one per success; gave up: \
             operations `retry` stopped after its last attempt.\n",
            options.contention_time().as_secs_f64(),
            report::contention_table(&results.contention)
        );
    }
    println!(
        "## Nothing pending\n\n{}",
        report::empty_queue_lines(&results.empty_queue)
    );
    if !results.index_effect.is_empty() {
        println!(
            "## The partial index's effect\n\n{}\n{}\n",
            report::index_effect_table(&results.index_effect),
            report::index_effect_plans(&results.index_effect)
        );
    }
    if !results.pickup.is_empty() {
        println!(
            "## PL: pickup latency of the worker loop\n\n{}\n{}",
            report::pickup_table(&results.pickup),
            report::PICKUP_NOTES
        );
    }
    if !results.job_drains.is_empty() {
        println!(
            "## JR: a job runner draining {} queued jobs\n\n{}\n{}",
            options.jobs,
            jobs::drain_table(&results.job_drains),
            jobs::JOB_NOTES
        );
    }
    if !results.job_steady.is_empty() {
        println!(
            "## JS: a job runner fed {} jobs/s for {} s\n\n{}\n{}",
            options.job_rate,
            options.job_seconds,
            jobs::steady_table(&results.job_steady),
            jobs::JOB_NOTES
        );
    }
    if !results.memory.is_empty() {
        println!(
            "## Peak memory\n\n{}",
            report::memory_table(&results.memory)
        );
    }
    let bars = report::bars(results);
    if !bars.is_empty() {
        println!("## Bars\n\n{}", report::bar_lines(&bars));
    }
}
