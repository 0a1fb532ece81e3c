//! Part 3: a nightly report that must never run twice at once
//! (`aio::with_lease`).
//!
//! Every task tries, again and again, to run the report. The lease on
//! `nightly-report` lets one holder in at a time, across tasks here as it would
//! across processes and machines; the others are told at once that it is busy.
//! A counter of the tasks inside the report, kept in memory beside the lease,
//! catches any overlap the lease would let through.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel::prelude::*;
use diesel_async::RunQueryDsl;
use diesel_claim::aio::with_lease;

use super::{run_workers, Conn, Pool};
use crate::schema::reports;
use crate::{BoxError, Checks, Clock, Options};

const LEASE: &str = "nightly-report";
/// Far longer than a report takes: the lease expires only if its holder dies.
const TTL: Duration = Duration::from_secs(10);
/// Tries per task to run the report.
const TRIES_PER_WORKER: u32 = 25;

/// The report's critical section, as seen from this process.
#[derive(Debug, Default)]
struct Section {
    /// Tasks inside the report right now.
    inside: AtomicUsize,
    /// Entries that found another task already inside.
    overlaps: AtomicUsize,
}

pub async fn run(
    pool: &Pool,
    options: &Options,
    clock: Clock,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    println!("\nPart 3: a nightly report under with_lease");
    let section = Arc::new(Section::default());
    let outcomes = run_workers(pool, options.workers, |mut conn, worker| {
        let section = Arc::clone(&section);
        async move {
            let (mut runs, mut busy) = (0u64, 0u64);
            for _ in 0..TRIES_PER_WORKER {
                match run_report(&mut conn, worker, &section).await? {
                    Some(()) => runs += 1,
                    None => busy += 1,
                }
                // A pause between tries, as a scheduler would make.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok((runs, busy))
        }
    })
    .await?;
    let runs: u64 = outcomes.iter().map(|(runs, _)| runs).sum();
    let busy: u64 = outcomes.iter().map(|(_, busy)| busy).sum();
    clock.log(format_args!(
        "{} tries: {runs} ran the report, {busy} found the lease busy",
        runs + busy
    ));

    // Spelt out: `.load(…)` would be `RunQueryDsl::load`, which every type has.
    let overlaps = AtomicUsize::load(&section.overlaps, Ordering::SeqCst);
    checks.check(
        "report never ran twice at once",
        overlaps == 0,
        format!("{runs} runs, {overlaps} overlapping"),
    );

    let mut conn = pool.get().await?;
    let tokens: Vec<i64> = reports::table
        .order(reports::id)
        .select(reports::token)
        .load(&mut conn)
        .await?;
    let increasing = tokens.windows(2).all(|pair| pair[0] < pair[1]);
    checks.check(
        "each report under a newer token",
        runs > 0 && tokens.len() as u64 == runs && increasing,
        format!(
            "{} reports written, fencing tokens {}",
            tokens.len(),
            if increasing {
                "increasing"
            } else {
                "NOT increasing"
            }
        ),
    );
    Ok(())
}

/// Runs the report if nobody else is; `None` if the lease is held.
async fn run_report(
    conn: &mut Conn,
    worker: i32,
    section: &Section,
) -> Result<Option<()>, diesel_claim::Error> {
    with_lease(conn, LEASE, TTL, async |conn, lease| {
        // Anyone already inside means two holders at once.
        if section.inside.fetch_add(1, Ordering::SeqCst) > 0 {
            section.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        // The report's work. Awaiting lets the other tasks run meanwhile,
        // and try to get in.
        tokio::time::sleep(Duration::from_millis(2)).await;
        // The fencing token goes with the write: a reader can tell which
        // holder wrote it, and a stale holder's write could be refused.
        let written = diesel::insert_into(reports::table)
            .values((reports::token.eq(lease.token()), reports::worker.eq(worker)))
            .execute(conn)
            .await;
        // Left before the lease is released (when this future ends), so the
        // next holder never finds this one inside.
        section.inside.fetch_sub(1, Ordering::SeqCst);
        written?;
        Ok(())
    })
    .await
}
