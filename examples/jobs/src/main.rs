//! A job service on `diesel-claim`, to copy: a queue in a PostgreSQL table,
//! producers, and an async worker on a bb8 pool that runs its jobs until
//! SIGTERM or Ctrl-C, with the crate's retry schedule in the rows, a job
//! timeout, log lines through `tracing-subscriber`, and the crate's metrics
//! served for Prometheus. The guide's "job service" page walks through it.
//!
//! - `queue.rs`: the table (priority, run time, attempts, last error), a
//!   job, enqueueing with `NOTIFY`, and what a job does;
//! - `service.rs`: the pool, the worker, and how signals stop it;
//! - `telemetry.rs`: the log lines and the exporter;
//! - `demo.rs` and `checks.rs`: the example's own scenario and checks,
//!   which a service has no need of.
//!
//! The scenario: 2,000 jobs wait when the service starts; an urgent job
//! is enqueued behind them; SIGTERM stops the service half-way; it starts
//! again while producers enqueue jobs one by one, three that the mail
//! server always refuses and one it hangs on once; and Ctrl-C stops it when
//! only the dead letters are left. It ends by printing its checks (every
//! job done once, nothing lost across the stop, the urgent job first, the
//! failing jobs retried on schedule then dead letters, the timed-out job
//! recorded then sent, the reports and the exporter counting the same) and
//! exits with status 1 if one failed.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run --release -p diesel-claim-jobs
//! cargo run --release -p diesel-claim-jobs -- --help
//! ```
//!
//! Without `DATABASE_URL` it connects to
//! `postgres://postgres@127.0.0.1:5432/test`. It works in a schema of its
//! own (`jobs_<pid>_…`), dropped at the end. Log lines go to stderr
//! (`RUST_LOG` chooses them), the report to stdout.

mod checks;
mod demo;
mod queue;
mod service;
mod telemetry;

use std::net::{Ipv4Addr, SocketAddr, TcpListener};

use clap::Parser;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use diesel_claim_testkit::shop::{exit_with, run_name};
pub use diesel_claim_testkit::shop::{BoxError, Checks, Clock};
use diesel_claim_testkit::url::is_postgres_url;

const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// Runs diesel-claim's job service example on PostgreSQL, in a schema of
/// its own that is dropped at the end. The server is --database-url, else
/// $DATABASE_URL, else postgres://postgres@127.0.0.1:5432/test.
#[derive(Debug, Parser)]
#[command(name = "jobs")]
struct Options {
    /// Jobs queued before the service starts
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(100..))]
    jobs: u32,
    /// The worker's claim loops
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..))]
    loops: u16,
    /// Where the exporter serves the metrics (else a free port of 127.0.0.1)
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// A postgres:// server URL
    #[arg(long, value_name = "URL")]
    database_url: Option<String>,
}

fn main() {
    exit_with(run());
}

/// Runs the scenario and prints the checks; `Ok(false)` if one failed.
fn run() -> Result<bool, BoxError> {
    let options = Options::parse();
    let url = options
        .database_url
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .unwrap_or_else(|| DEFAULT_URL.to_owned());
    if !is_postgres_url(&url) {
        return Err(format!("not a postgres:// URL: {url}").into());
    }
    let metrics_addr = match options.metrics_addr {
        Some(addr) => addr,
        None => TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?,
    };
    let (backlog, loops) = (options.jobs as usize, usize::from(options.loops));
    telemetry::log_to_stderr();
    let clock = Clock::start();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        telemetry::serve_metrics(metrics_addr)?;
        let checks = in_own_schema(&url, async |schema, url| {
            println!(
                "diesel-claim job service on PostgreSQL (schema {schema}), \
                 metrics on http://{metrics_addr}/metrics\n"
            );
            let pool = service::pool(url, loops).await?;
            pool.get().await?.batch_execute(queue::SCHEMA).await?;
            let seen = demo::run(&pool, backlog, loops, clock).await?;
            let scraped = telemetry::scrape(metrics_addr).await?;
            let mut conn = pool.get().await?;
            let made = checks::make(&mut conn, &seen, &scraped).await?;
            Ok(made)
        })
        .await?;
        Ok::<_, BoxError>(checks.conclude(clock))
    })
}

/// Runs `run` with the name of a schema of its own and a URL whose
/// connections work in it; a connection outside the run creates the schema
/// before and drops it after, whatever happened.
async fn in_own_schema<T>(
    url: &str,
    run: impl AsyncFnOnce(&str, &str) -> Result<T, BoxError>,
) -> Result<T, BoxError> {
    let schema = run_name("jobs")?;
    let mut admin = AsyncPgConnection::establish(url).await?;
    admin
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .await?;
    // Every connection made from this URL (the pool's, the listener's)
    // starts with its `search_path` there, so that the service's
    // unqualified names are the schema's. The name needs no quoting.
    let separator = if url.contains('?') { '&' } else { '?' };
    let in_schema = format!("{url}{separator}options=-c%20search_path%3D{schema}");
    let outcome = run(&schema, &in_schema).await;
    let dropped = admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await;
    let value = outcome?;
    dropped?;
    Ok(value)
}
