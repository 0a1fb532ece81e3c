//! The scenario the example puts the service through, as a deploy meets
//! it: a backlog queued while the service was down; an urgent job enqueued
//! behind it; SIGTERM half-way through; a restart while producers enqueue
//! more, some of which fail for good and one of which hangs; and Ctrl-C
//! once only the dead letters are left. What it saw goes to the checks.

use std::time::{Duration, Instant};

use diesel::dsl::count_star;
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use diesel_claim::ClaimReport;

use crate::queue::{enqueue, jobs, sent, NewJob, Runs, HANGS_ONCE, UNDELIVERABLE};
use crate::service::{self, Pool, Signals, MAX_ATTEMPTS};
use crate::{BoxError, Clock};

/// Jobs enqueued one by one, each in a transaction of its own, while the
/// restarted service runs: each is picked up as its notification arrives.
const TRICKLE: usize = 200;
/// Jobs that every attempt fails: each ends a dead letter.
const UNDELIVERABLE_JOBS: usize = 3;
/// How long the scenario waits for what it expects before it gives up.
const PATIENCE: Duration = Duration::from_secs(60);

/// What the scenario did and saw.
pub struct Seen {
    /// The job enqueued ahead of the backlog.
    pub urgent: Urgent,
    /// The service's first run, stopped by SIGTERM half-way.
    pub first: Stopped,
    /// The restart, stopped by SIGINT once only dead letters were left.
    pub second: Stopped,
    /// The jobs every attempt of which fails.
    pub undeliverable: Vec<i64>,
    /// The job whose first attempt hangs.
    pub hangs_once: i64,
    /// The runs of jobs that ended on their own.
    pub runs: Runs,
}

/// The urgent job, and the queue when it was enqueued.
pub struct Urgent {
    pub id: i64,
    /// Jobs queued ahead of it (before it, at the same priority or lower).
    pub behind: i64,
    /// Emails sent before it was enqueued.
    pub sent_before: i64,
}

/// A run of the service, and the queue once it had stopped.
pub struct Stopped {
    pub report: ClaimReport,
    /// Jobs enqueued by then, in all.
    pub enqueued: i64,
    /// From the signal to the worker's return.
    pub took: Duration,
    /// Jobs left in the queue.
    pub queued: i64,
    /// Emails sent, in all.
    pub sent: i64,
    /// Jobs both sent and still queued: a job half done, which must not be.
    pub sent_and_queued: i64,
}

/// Runs the scenario on `pool`, whose database holds the queue's tables.
pub async fn run(
    pool: &Pool,
    backlog: usize,
    loops: usize,
    clock: Clock,
) -> Result<Seen, BoxError> {
    // Before any signal is sent: from here on, signals stop the service.
    let mut signals = Signals::listen()?;
    let runs = Runs::default();
    let mut conn = pool.get().await?;
    let new_jobs: Vec<_> = (0..backlog)
        .map(|n| NewJob::email(format!("customer{n}@example.com")))
        .collect();
    enqueue(&mut conn, &new_jobs).await?;
    clock.log(format_args!(
        "{backlog} jobs queued while the service was down; it starts with {loops} loops"
    ));

    let (report, midway) = tokio::join!(
        service::run_until_signalled(pool, &mut signals, loops, &runs),
        stop_midway(&mut conn, backlog, clock),
    );
    let (urgent, signalled) = midway?;
    let enqueued = backlog as i64 + 1;
    let first = stopped(&mut conn, report?, signalled, enqueued).await?;
    clock.log(format_args!(
        "stopped {:.3}s after SIGTERM: {} emails sent, {} jobs left queued",
        first.took.as_secs_f64(),
        first.report.processed,
        first.queued
    ));

    clock.log("the service starts again; producers enqueue jobs as it runs");
    let (report, produced) = tokio::join!(
        service::run_until_signalled(pool, &mut signals, loops, &runs),
        produce_then_interrupt(&mut conn, clock),
    );
    let (undeliverable, hangs_once, signalled) = produced?;
    let enqueued = enqueued + (UNDELIVERABLE_JOBS + 1 + TRICKLE) as i64;
    let second = stopped(&mut conn, report?, signalled, enqueued).await?;
    clock.log(format_args!(
        "stopped {:.3}s after SIGINT: {} emails sent, {} jobs failed",
        second.took.as_secs_f64(),
        second.report.processed,
        second.report.failed
    ));

    Ok(Seen {
        urgent,
        first,
        second,
        undeliverable,
        hangs_once,
        runs,
    })
}

/// Enqueues an urgent job once a tenth of the backlog is sent, then sends
/// SIGTERM once half of it is (and at once if anything failed before, so
/// that the service stops all the same).
async fn stop_midway(
    conn: &mut AsyncPgConnection,
    backlog: usize,
    clock: Clock,
) -> Result<(Urgent, Instant), BoxError> {
    let urgent = enqueue_urgent(conn, backlog, clock).await;
    let mut halfway = Ok(());
    if urgent.is_ok() {
        halfway = wait_for("half the backlog sent", async || {
            Ok(sent_count(conn).await? >= backlog as i64 / 2)
        })
        .await;
    }
    clock.log("SIGTERM, as a deploy sends it");
    let signalled = send_to_self("TERM").await?;
    halfway?;
    Ok((urgent?, signalled))
}

/// Enqueues the urgent job once a tenth of the backlog is sent.
async fn enqueue_urgent(
    conn: &mut AsyncPgConnection,
    backlog: usize,
    clock: Clock,
) -> Result<Urgent, BoxError> {
    wait_for("a tenth of the backlog sent", async || {
        Ok(sent_count(conn).await? >= backlog as i64 / 10)
    })
    .await?;
    let sent_before = sent_count(conn).await?;
    let behind = jobs::table.count().get_result(conn).await?;
    let ids = enqueue(conn, &[NewJob::email("urgent@example.com").urgent()]).await?;
    clock.log(format_args!(
        "an urgent job is enqueued behind {behind} others"
    ));
    Ok(Urgent {
        id: ids[0],
        behind,
        sent_before,
    })
}

/// Enqueues the jobs that fail and the one that hangs, then trickles jobs
/// in one by one, then sends SIGINT once nothing but dead letters is left
/// (and at once if anything failed before).
async fn produce_then_interrupt(
    conn: &mut AsyncPgConnection,
    clock: Clock,
) -> Result<(Vec<i64>, i64, Instant), BoxError> {
    let produced = produce(conn, clock).await;
    let mut settled = Ok(());
    if produced.is_ok() {
        settled = wait_for("only dead letters left", async || {
            let live = jobs::table.filter(jobs::attempts.lt(MAX_ATTEMPTS as i32));
            Ok(live.count().get_result::<i64>(conn).await? == 0)
        })
        .await;
    }
    clock.log("Ctrl-C (SIGINT), once only the dead letters are left");
    let signalled = send_to_self("INT").await?;
    settled?;
    let (undeliverable, hangs_once) = produced?;
    Ok((undeliverable, hangs_once, signalled))
}

/// The restart's producers: the failing jobs and the hanging one, then
/// [`TRICKLE`] jobs, one every 5 ms. The ids of the first ones.
async fn produce(conn: &mut AsyncPgConnection, clock: Clock) -> Result<(Vec<i64>, i64), BoxError> {
    let failing: Vec<_> = (0..UNDELIVERABLE_JOBS)
        .map(|n| NewJob::email(format!("nobody{n}{UNDELIVERABLE}")))
        .collect();
    let undeliverable = enqueue(conn, &failing).await?;
    let hangs_once = enqueue(conn, &[NewJob::email(HANGS_ONCE)]).await?[0];
    clock.log(format_args!(
        "{UNDELIVERABLE_JOBS} jobs the mail server refuses, and one it hangs on once"
    ));
    for n in 0..TRICKLE {
        enqueue(conn, &[NewJob::email(format!("new{n}@example.com"))]).await?;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    clock.log(format_args!("{TRICKLE} jobs enqueued one by one"));
    Ok((undeliverable, hangs_once))
}

/// The queue once a run has stopped.
async fn stopped(
    conn: &mut AsyncPgConnection,
    report: ClaimReport,
    signalled: Instant,
    enqueued: i64,
) -> Result<Stopped, BoxError> {
    let took = signalled.elapsed();
    let sent_and_queued = sent::table
        .inner_join(jobs::table.on(jobs::id.eq(sent::job_id)))
        .select(count_star())
        .get_result(conn)
        .await?;
    Ok(Stopped {
        report,
        enqueued,
        took,
        queued: jobs::table.count().get_result(conn).await?,
        sent: sent_count(conn).await?,
        sent_and_queued,
    })
}

async fn sent_count(conn: &mut AsyncPgConnection) -> QueryResult<i64> {
    sent::table.count().get_result(conn).await
}

/// Waits until `reached` says so, asking every 10 ms; an error after
/// [`PATIENCE`].
async fn wait_for(
    what: &str,
    mut reached: impl AsyncFnMut() -> Result<bool, BoxError>,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + PATIENCE;
    while !reached().await? {
        if Instant::now() > deadline {
            return Err(format!("not {what} within {PATIENCE:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Sends `signal` (`TERM`, `INT`) to this process, as an orchestrator or a
/// terminal would; when it was sent.
async fn send_to_self(signal: &str) -> Result<Instant, BoxError> {
    let pid = std::process::id().to_string();
    let sent_at = Instant::now();
    let status = tokio::process::Command::new("kill")
        .args(["-s", signal, &pid])
        .status()
        .await?;
    if !status.success() {
        return Err(format!("kill -s {signal} {pid} failed ({status})").into());
    }
    Ok(sent_at)
}
