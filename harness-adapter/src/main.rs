//! diesel-claim as a job queue, for the long-horizon runs of
//! `postgresql-job-queue-benchmarking` (GitHub:
//! hardbyte/postgresql-job-queue-benchmarking): one long-running process
//! that speaks the harness's adapter contract (`CONTRIBUTING_ADAPTERS.md`
//! there). `cargo xtask harness` builds it, registers it with a harness
//! checkout and runs it; see this folder's `README.md`.
//!
//! It runs the queue as a service written on the crate's public API would:
//!
//! - **The queue** is a table of its own, `diesel_claim_jobs` (`id BIGSERIAL`
//!   and its slot in the ring as the key, the enqueue time, a payload of
//!   `JOB_PAYLOAD_BYTES`), created by the adapter's embedded Diesel
//!   migrations at start.
//! - **The worker** is the crate's head-of-queue worker on an r2d2 pool,
//!   blocking: [`run_pooled`](diesel_claim::ClaimWorker::run_pooled) with
//!   `WORKER_COUNT` claim loops (threads), each taking up to
//!   `DIESEL_CLAIM_BATCH` (default 10) jobs in the queue's order in one
//!   locking statement, running them one after the other (the job's work is
//!   `JOB_WORK_MS` of sleep, in its transaction), deleting the done ones with
//!   [`then_delete`](diesel_claim::ClaimBuilder::then_delete) and
//!   committing. The loops listen for the producer's notifications. Blocking,
//!   because that is the crate's API on libpq and r2d2 that the repository's
//!   own job-runner benchmark and crash scenarios measure: a thread per loop
//!   is what a worker process of this size runs, and the async twin on
//!   diesel-async would add its own driver to what is measured.
//! - **Done jobs are deleted**, as a job runner on a plain table does, from
//!   a table kept as a [ring of partitions](diesel_claim::ring): eight
//!   slots of 2,000 jobs in order of insertion, a thread of the adapter
//!   truncating the slots whose jobs are done twice a second. The
//!   harness samples the ring's partitions: their dead tuples are the
//!   deletes not yet truncated away (or vacuumed).
//! - **The producer** enqueues with bulk inserts (`COPY … FROM STDIN`) of
//!   up to `PRODUCER_BATCH_MAX` rows, each in a transaction that notifies the
//!   workers (up to eight inserts per transaction when it fills the queue to
//!   its depth, from a thread and a connection per 16 workers: see
//!   `DIESEL_CLAIM_DEPTH_PRODUCERS`), paced by the harness's `ENQUEUE <n>` lines
//!   (`PRODUCER_PACING=harness`), by its own clock on the rate in
//!   `PRODUCER_RATE_CONTROL_FILE` (`PRODUCER_PACING=adapter`, which the
//!   high-load phases need), or by the queue's depth
//!   (`PRODUCER_MODE=depth-target`).
//! - **Pickup latency** is from the producer's insert (its clock, just
//!   before the statement) to the worker's closure starting; its
//!   percentiles come from HDR histograms of the last 30 s.
//! - **A job counts as completed** once the transaction that deleted it
//!   has committed: the adapter reads the crate's own
//!   `diesel_claim_rows_processed_total` (feature `metrics`) through a
//!   recorder of its own, so a batch rolled back by a crash or a lost
//!   session is not counted, and its jobs count once when they run again.
//! - **SIGTERM or SIGINT** stops the worker, which commits the jobs in hand,
//!   and the process exits 0.

mod jobs;
mod producer;
mod samples;
mod settings;

use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use diesel_claim::StopHandle;

use crate::samples::Stats;
use crate::settings::Settings;

/// How long the adapter waits for the database at start: well inside the
/// harness's minute for the descriptor.
const STARTUP_PATIENCE: Duration = Duration::from_secs(30);

/// What the descriptor reports as the version: the revision `cargo xtask
/// harness` built.
const VERSION: &str = match option_env!("DIESEL_CLAIM_REVISION") {
    Some(revision) => revision,
    None => "unknown revision",
};

fn main() -> ExitCode {
    match Settings::from_env().and_then(|settings| run(&settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("[diesel-claim] {error}");
            ExitCode::FAILURE
        }
    }
}

fn run(settings: &Settings) -> Result<(), String> {
    let stopping = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, Arc::clone(&stopping))
            .map_err(|error| format!("cannot handle signal {signal}: {error}"))?;
    }
    let stop = StopHandle::from(stopping);

    let mut conn = jobs::connect(&settings.database_url, STARTUP_PATIENCE)?;
    jobs::migrate(&mut conn)?;
    drop(conn);
    let pool = jobs::pool(&settings.database_url, settings.workers)?;
    samples::emit_descriptor(settings, VERSION);

    let stats = Stats::new();
    stats.count_completions()?;
    let tokens = producer::harness_tokens(settings);
    let worked = thread::scope(|scope| {
        scope.spawn(|| producer::produce(settings, &stats, &stop, tokens));
        scope.spawn(|| samples::sample(settings, &stats, &stop));
        scope.spawn(|| jobs::rotate(&settings.database_url, &stop));
        let worked = jobs::work(&pool, settings, &stop, &stats);
        // The worker ends when stopped, or on an error no connection
        // mends: either way the producer and the sampler end with it.
        stop.stop();
        worked
    });
    let report = worked.map_err(|error| format!("the worker failed: {error}"))?;
    eprintln!(
        "[diesel-claim] stopped: {} jobs done, {} failed",
        report.processed, report.failed
    );
    Ok(())
}
