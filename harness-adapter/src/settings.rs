//! What the harness asks of a run, read from the environment it launches the
//! adapter with (`CONTRIBUTING_ADAPTERS.md`, "Env in"), with its defaults.

use std::path::PathBuf;
use std::time::Duration;

/// The workers a depth-target producer thread fills the queue for, unless
/// `DIESEL_CLAIM_DEPTH_PRODUCERS` says otherwise. A producer thread and its
/// server session get their share of the cores as each claim loop and its
/// session do: one producer beside 64 loops on two cores did not keep the
/// queue full (its depth fell below 1,000 of the 4,000 asked), and the cell
/// measured the enqueueing instead of the worker.
const WORKERS_PER_DEPTH_PRODUCER: usize = 16;

/// How the producer decides how many jobs to enqueue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProducerMode {
    /// A fixed rate of jobs per second (`PRODUCER_MODE=fixed`).
    Fixed,
    /// Keep `TARGET_DEPTH` jobs waiting (`PRODUCER_MODE=depth-target`): the
    /// workers' greatest completion rate.
    DepthTarget,
}

/// Who paces a fixed-rate producer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pacing {
    /// The harness, with `ENQUEUE <n>` lines on stdin (`PRODUCER_PACING=harness`).
    Harness,
    /// The adapter, crediting the rate on the time that really passed
    /// (`PRODUCER_PACING=adapter`); the rate is read again from
    /// `PRODUCER_RATE_CONTROL_FILE` on every tick, which is how the
    /// harness's high-load phases raise it.
    Adapter,
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub database_url: String,
    pub producer_mode: ProducerMode,
    pub pacing: Pacing,
    /// Jobs per second at a fixed rate, until the control file says otherwise.
    pub producer_rate: f64,
    /// Where the harness writes the current fixed rate.
    pub rate_control_file: Option<PathBuf>,
    /// The most rows one insert statement writes.
    pub batch_max: usize,
    /// A self-paced producer's tick.
    pub batch_period: Duration,
    pub target_depth: i64,
    /// Claim loops, each running one job at a time.
    pub workers: usize,
    /// Rows one claim takes and runs before it commits (`DIESEL_CLAIM_BATCH`,
    /// this adapter's own setting).
    pub claim_batch: u32,
    /// Producer threads, each with its connection, that keep a depth target
    /// (`DIESEL_CLAIM_DEPTH_PRODUCERS`, this adapter's own setting; by
    /// default one per [`WORKERS_PER_DEPTH_PRODUCER`] workers).
    pub depth_producers: usize,
    pub payload_bytes: usize,
    /// How long each job works, in its transaction.
    pub work: Duration,
    pub sample_every: Duration,
    pub instance_id: u32,
}

impl Settings {
    /// The settings in the environment, or what is wrong with them.
    pub fn from_env() -> Result<Settings, String> {
        let database_url =
            std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set".to_owned())?;
        let scenario = text("SCENARIO", "long_horizon");
        if scenario != "long_horizon" {
            return Err(format!(
                "SCENARIO={scenario}: only long_horizon is supported"
            ));
        }
        let producer_mode = match text("PRODUCER_MODE", "fixed").as_str() {
            "fixed" => ProducerMode::Fixed,
            "depth-target" => ProducerMode::DepthTarget,
            other => {
                return Err(format!(
                    "PRODUCER_MODE={other}: expected fixed or depth-target"
                ))
            }
        };
        let pacing = match text("PRODUCER_PACING", "harness").as_str() {
            "harness" => Pacing::Harness,
            "adapter" => Pacing::Adapter,
            other => {
                return Err(format!(
                    "PRODUCER_PACING={other}: expected harness or adapter"
                ))
            }
        };
        let workers = number("WORKER_COUNT", 32)?;
        let settings = Settings {
            database_url,
            producer_mode,
            pacing,
            producer_rate: number("PRODUCER_RATE", 800.0)?,
            rate_control_file: std::env::var_os("PRODUCER_RATE_CONTROL_FILE").map(PathBuf::from),
            batch_max: number("PRODUCER_BATCH_MAX", 128)?,
            batch_period: Duration::from_millis(number("PRODUCER_BATCH_MS", 25)?),
            target_depth: number("TARGET_DEPTH", 1000)?,
            workers,
            claim_batch: number("DIESEL_CLAIM_BATCH", 10)?,
            depth_producers: number(
                "DIESEL_CLAIM_DEPTH_PRODUCERS",
                workers.div_ceil(WORKERS_PER_DEPTH_PRODUCER),
            )?,
            payload_bytes: number("JOB_PAYLOAD_BYTES", 256)?,
            work: Duration::from_millis(number("JOB_WORK_MS", 1)?),
            sample_every: Duration::from_secs(number("SAMPLE_EVERY_S", 5)?),
            instance_id: number("BENCH_INSTANCE_ID", 0)?,
        };
        if settings.batch_max == 0
            || settings.workers == 0
            || settings.claim_batch == 0
            || settings.depth_producers == 0
        {
            return Err("PRODUCER_BATCH_MAX, WORKER_COUNT, DIESEL_CLAIM_BATCH and \
                 DIESEL_CLAIM_DEPTH_PRODUCERS must be at least 1"
                .into());
        }
        if settings.sample_every.is_zero() {
            return Err("SAMPLE_EVERY_S must be at least 1".into());
        }
        Ok(settings)
    }

    /// The database's name, the last part of the URL's path.
    pub fn db_name(&self) -> &str {
        let path = self.database_url.split('?').next().unwrap_or_default();
        path.rsplit('/').next().unwrap_or_default()
    }
}

fn text(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn number<T: std::str::FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Ok(value) => value
            .trim()
            .parse()
            .map_err(|_| format!("{name}={value}: not a number of the expected kind")),
        Err(_) => Ok(default),
    }
}
