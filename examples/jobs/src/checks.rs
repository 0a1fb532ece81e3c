//! The checks the example prints: the rows, the workers' reports, the runs
//! and a scrape of the exporter, against what the scenario did.

use diesel::dsl::count;
use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::demo::{Seen, Stopped};
use crate::queue::{jobs, sent};
use crate::service::{FIRST_RETRY, JOB_TIMEOUT, MAX_ATTEMPTS};
use crate::telemetry::series;
use crate::{BoxError, Checks};

/// Makes every check, from the database behind `conn`, what the scenario
/// `seen`, and the exporter's `scraped` text.
pub async fn make(
    conn: &mut AsyncPgConnection,
    seen: &Seen,
    scraped: &str,
) -> Result<Checks, BoxError> {
    let mut checks = Checks::default();
    every_job_done_once(conn, seen, &mut checks).await?;
    stops(seen, &mut checks);
    urgent_first(conn, seen, &mut checks).await?;
    retries(conn, seen, &mut checks).await?;
    timed_out(conn, seen, &mut checks).await?;
    counted(seen, scraped, &mut checks);
    Ok(checks)
}

async fn every_job_done_once(
    conn: &mut AsyncPgConnection,
    seen: &Seen,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    let emails: i64 = sent::table.count().get_result(conn).await?;
    let jobs_sent: i64 = sent::table
        .select(count(sent::job_id).aggregate_distinct())
        .get_result(conn)
        .await?;
    let left: i64 = jobs::table.count().get_result(conn).await?;
    let dead = seen.undeliverable.len() as i64;
    let enqueued = seen.second.enqueued;
    checks.check(
        "every job done once",
        jobs_sent == enqueued - dead && emails == jobs_sent && left == dead,
        format!("{enqueued} jobs enqueued, {emails} emails sent for {jobs_sent} of them, {left} left queued"),
    );
    Ok(())
}

/// The signals stopped the service at once, and the first stop lost
/// nothing: each job was either sent (and gone from the queue) or queued.
fn stops(seen: &Seen, checks: &mut Checks) {
    let first = &seen.first;
    checks.check(
        "SIGTERM stops it mid-queue, gracefully",
        first.queued > 0 && first.took < JOB_TIMEOUT,
        format!(
            "stopped in {:.3}s with {} jobs queued",
            first.took.as_secs_f64(),
            first.queued
        ),
    );
    checks.check(
        "nothing lost across the stop",
        nothing_lost(first),
        format!(
            "{} enqueued, {} sent (reported {}), {} queued, {} both",
            first.enqueued, first.sent, first.report.processed, first.queued, first.sent_and_queued
        ),
    );
    checks.check(
        "Ctrl-C stops it again",
        seen.second.took < JOB_TIMEOUT,
        format!("stopped in {:.3}s", seen.second.took.as_secs_f64()),
    );
}

fn nothing_lost(first: &Stopped) -> bool {
    first.sent_and_queued == 0
        && first.sent + first.queued == first.enqueued
        && first.sent == first.report.processed as i64
}

async fn urgent_first(
    conn: &mut AsyncPgConnection,
    seen: &Seen,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    let urgent = &seen.urgent;
    let sent_as: Option<i64> = sent::table
        .filter(sent::job_id.eq(urgent.id))
        .select(sent::id)
        .first(conn)
        .await
        .optional()?;
    // The emails sent after it was enqueued and before it.
    let mut overtaken_by = None;
    if let Some(sent_as) = sent_as {
        let sent_before: i64 = sent::table
            .filter(sent::id.lt(sent_as))
            .count()
            .get_result(conn)
            .await?;
        overtaken_by = Some(sent_before - urgent.sent_before);
    }
    checks.check(
        "an urgent job jumps the queue",
        overtaken_by.is_some_and(|overtaken_by| overtaken_by < urgent.behind / 10),
        match overtaken_by {
            Some(n) => format!(
                "enqueued behind {} jobs, sent after {n} of them",
                urgent.behind
            ),
            None => format!("enqueued behind {} jobs, never sent", urgent.behind),
        },
    );
    Ok(())
}

/// Each undeliverable job ran its attempts, each retry no sooner than its
/// delay after the failure before, and ended a dead letter: in the table
/// with its attempts and error, its work rolled back.
async fn retries(
    conn: &mut AsyncPgConnection,
    seen: &Seen,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    let mut on_schedule = true;
    let mut shortest = vec![f64::INFINITY; MAX_ATTEMPTS as usize - 1];
    for &job in &seen.undeliverable {
        let runs = seen.runs.of(job);
        on_schedule &= runs.len() == MAX_ATTEMPTS as usize;
        for (failures, pair) in runs.windows(2).enumerate() {
            let delay = FIRST_RETRY * 2u32.pow(failures as u32);
            let gap = pair[1].started.saturating_duration_since(pair[0].ended);
            on_schedule &= gap >= delay;
            if let Some(soonest) = shortest.get_mut(failures) {
                *soonest = soonest.min(gap.as_secs_f64());
            }
        }
    }
    let gaps: Vec<String> = shortest.iter().map(|gap| format!("{gap:.3}s")).collect();
    checks.check(
        "failing jobs retried on schedule",
        on_schedule,
        format!(
            "{} jobs, {MAX_ATTEMPTS} runs each, retried after {} at the soonest ({:?} doubling)",
            seen.undeliverable.len(),
            gaps.join(", "),
            FIRST_RETRY
        ),
    );

    let dead: Vec<(i32, Option<String>)> = jobs::table
        .filter(jobs::id.eq_any(&seen.undeliverable))
        .select((jobs::attempts, jobs::last_error))
        .load(conn)
        .await?;
    let their_emails: i64 = sent::table
        .filter(sent::job_id.eq_any(&seen.undeliverable))
        .count()
        .get_result(conn)
        .await?;
    let recorded = dead.iter().all(|(attempts, error)| {
        *attempts == MAX_ATTEMPTS as i32 && error.as_deref().is_some_and(|e| e.contains("refused"))
    });
    let last_error = dead.iter().find_map(|(_, error)| error.clone());
    checks.check(
        "then dead letters, their work rolled back",
        dead.len() == seen.undeliverable.len() && recorded && their_emails == 0,
        format!(
            "{} left with {MAX_ATTEMPTS} attempts, {their_emails} emails; last error {:?}",
            dead.len(),
            last_error.unwrap_or_default()
        ),
    );
    Ok(())
}

/// The hanging job's first attempt was ended at the timeout and recorded;
/// its retry sent it.
async fn timed_out(
    conn: &mut AsyncPgConnection,
    seen: &Seen,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    let reported = seen.first.report.timed_out + seen.second.report.timed_out;
    let emails: Vec<(i32, Option<String>)> = sent::table
        .filter(sent::job_id.eq(seen.hangs_once))
        .select((sent::attempt, sent::previous_error))
        .load(conn)
        .await?;
    let retried = match emails.as_slice() {
        [(2, Some(error))] => error.contains("timeout"),
        _ => false,
    };
    checks.check(
        "a timed-out job recorded, then sent",
        reported == 1 && retried,
        format!("{reported} timed out; sent as (attempt, previous error) {emails:?}"),
    );
    Ok(())
}

/// The workers' reports and the exporter's counters say what the rows say.
fn counted(seen: &Seen, scraped: &str, checks: &mut Checks) {
    let (first, second) = (&seen.first.report, &seen.second.report);
    let processed = first.processed + second.processed;
    let failed = first.failed + second.failed;
    // Each undeliverable job fails every attempt; the hanging one, once.
    let failures = seen.undeliverable.len() as u64 * u64::from(MAX_ATTEMPTS) + 1;
    checks.check(
        "the workers report every job",
        processed as i64 == seen.second.sent && failed == failures,
        format!("{processed} processed, {failed} failed"),
    );

    let metric = |name: &str| series(scraped, name, &[r#"table="jobs""#]).unwrap_or(-1.0);
    let exported = (
        metric("diesel_claim_rows_processed_total"),
        metric("diesel_claim_rows_failed_total"),
        metric("diesel_claim_rows_timed_out_total"),
    );
    let pickups = metric("diesel_claim_pickup_latency_seconds_count");
    checks.check(
        "the exporter serves the same counts",
        exported == (processed as f64, failed as f64, 1.0),
        format!(
            "processed {}, failed {}, timed out {}; {pickups} pickups timed",
            exported.0, exported.1, exported.2
        ),
    );
}
