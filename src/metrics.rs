//! Counters and histograms of claims, through the
//! [`metrics`](https://docs.rs/metrics) facade (feature `metrics`): the
//! exporter the application installs (Prometheus, StatsD, OpenTelemetry, …)
//! gets them, and without one they cost next to nothing.
//!
//! | metric | kind | what |
//! |---|---|---|
//! | `diesel_claim_rows_processed_total` | counter | rows whose closure succeeded and whose transaction committed ([`ClaimReport::processed`](crate::ClaimReport::processed)) |
//! | `diesel_claim_rows_failed_total` | counter | rows whose closure failed and which the claim passed over ([`keep_going`](crate::ClaimBuilder::keep_going), a failure hook: [`ClaimReport::failed`](crate::ClaimReport::failed)) |
//! | `diesel_claim_rows_timed_out_total` | counter | rows whose closure ran past the claim's [`timeout`](crate::ClaimBuilder::timeout), counted as failed too ([`ClaimReport::timed_out`](crate::ClaimReport::timed_out)) |
//! | `diesel_claim_rows_gone_total` | counter | candidates no longer matching when the claim came to lock them ([`ClaimReport::gone`](crate::ClaimReport::gone)) |
//! | `diesel_claim_rows_locked_total` | counter | candidates locked by someone else, left to them ([`ClaimReport::locked`](crate::ClaimReport::locked)) |
//! | `diesel_claim_claim_duration_seconds` | histogram | a claim call, from its first statement to its end; a worker's claims that found no row (its polls) are left out |
//! | `diesel_claim_batch_duration_seconds` | histogram | a batch that handed rows to the closure: taking its rows, the closure, and the commit |
//! | `diesel_claim_pickup_latency_seconds` | histogram | from the time a row became runnable to the time its closure started, as the application reports it with [`record_pickup`] |
//!
//! Every metric has the label `table`: the claimed table's name,
//! unqualified, as the `tracing` events show it. Those of a worker's claims
//! have the label `worker` too: its [name](crate::ClaimWorker::name), by
//! default its table's, so that two workers of one table are told apart;
//! so has a pickup latency recorded in a worker's closure. Counters move as
//! each batch ends, so a long drain is seen as it goes; `locked` is counted
//! when the call ends, once the rows it found locked were tried again.
//!
//! Call [`describe`] once, after installing the recorder, for the metrics'
//! units and descriptions (exporters show them as help text).
//!
//! The crate cannot know when a row became runnable: that is the queue's own
//! column (`run_at`, `enqueued_at`), in the row the closure gets. A worker's
//! closure that wants the pickup latency reports it first thing:
//!
//! ```
//! # include!("doctest_setup.rs");
//! use std::time::{Duration, SystemTime};
//! use diesel_claim::prelude::*;
//!
//! # fn main() -> Result<(), diesel_claim::Error> {
//! # let mut conn = establish_connection();
//! # let stop = diesel_claim::StopHandle::new();
//! # let stopper = stop.clone();
//! let pending = orders::table.filter(orders::shipped.eq(true)).filter(orders::email_sent.eq(false));
//! pending
//!     .build_claim()
//!     .worker(&stop)
//!     .run(&mut conn, |conn, order: Order| {
//!         // The time the order became runnable, from its own column
//!         // (here, a stand-in).
//!         let runnable_at = SystemTime::now() - Duration::from_millis(20);
//!         diesel_claim::metrics::record_pickup("orders", runnable_at);
//!         diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
//!         # stopper.stop();
//!         Ok::<_, diesel_claim::Error>(())
//!     })?;
//! # Ok(())
//! # }
//! ```
//!
//! The latency is measured on the application's clock: a `run_at` written
//! with the database's `now()` is off by the two clocks' difference.
//!
//! Metrics are recorded on the thread that runs the claim (for async claims,
//! wherever their futures are polled): a recorder installed globally
//! (`metrics::set_global_recorder`, as exporters do) sees them all.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use metrics::{counter, describe_counter, describe_histogram, histogram};
use metrics::{Counter, Histogram, Unit};

use crate::claim::report::Counts;

/// The rows processed.
const ROWS_PROCESSED: &str = "diesel_claim_rows_processed_total";
/// The rows that failed and were passed over.
const ROWS_FAILED: &str = "diesel_claim_rows_failed_total";
/// The rows whose closure ran past its timeout (counted as failed too).
const ROWS_TIMED_OUT: &str = "diesel_claim_rows_timed_out_total";
/// The candidates gone before they were locked.
const ROWS_GONE: &str = "diesel_claim_rows_gone_total";
/// The candidates locked by someone else.
const ROWS_LOCKED: &str = "diesel_claim_rows_locked_total";
/// How long a claim call took.
const CLAIM_DURATION: &str = "diesel_claim_claim_duration_seconds";
/// How long a batch took.
const BATCH_DURATION: &str = "diesel_claim_batch_duration_seconds";
/// From runnable to picked up.
const PICKUP_LATENCY: &str = "diesel_claim_pickup_latency_seconds";

/// Gives the installed recorder each metric's unit and description:
/// call it once, after installing the recorder.
pub fn describe() {
    describe_counter!(
        ROWS_PROCESSED,
        Unit::Count,
        "Rows whose closure succeeded and whose transaction committed."
    );
    describe_counter!(
        ROWS_FAILED,
        Unit::Count,
        "Rows whose closure failed and which the claim passed over (keep_going, a failure hook)."
    );
    describe_counter!(
        ROWS_TIMED_OUT,
        Unit::Count,
        "Rows whose closure ran past the claim's timeout (counted as failed too)."
    );
    describe_counter!(
        ROWS_GONE,
        Unit::Count,
        "Candidates no longer matching the query when the claim came to lock them."
    );
    describe_counter!(
        ROWS_LOCKED,
        Unit::Count,
        "Candidates locked by another transaction, left to it."
    );
    describe_histogram!(
        CLAIM_DURATION,
        Unit::Seconds,
        "Duration of a claim call (a worker's claims that found no row are left out)."
    );
    describe_histogram!(
        BATCH_DURATION,
        Unit::Seconds,
        "Duration of a batch that handed rows to the closure: the take, the closure, the commit."
    );
    describe_histogram!(
        PICKUP_LATENCY,
        Unit::Seconds,
        "From the time a row became runnable to the time its closure started."
    );
}

/// Records that a row of `table` (the claimed table's name, unqualified)
/// which became runnable at `runnable_at` was picked up now: call it
/// first thing in the closure. A time in the future counts as zero. In a
/// worker's closure (on the thread the worker calls it on, or in the future
/// it awaits, not in a task the closure spawns), the latency has the label
/// `worker` too, as the worker's other metrics do.
pub fn record_pickup(table: &str, runnable_at: SystemTime) {
    let latency = SystemTime::now()
        .duration_since(runnable_at)
        .unwrap_or_default();
    let mut labels = vec![("table", table.to_owned())];
    let worker = WORKER.with_borrow(Clone::clone);
    labels.extend(worker.map(|worker| ("worker", worker.to_string())));
    histogram!(PICKUP_LATENCY, &labels).record(latency);
}

thread_local! {
    /// The worker whose claim runs on this thread now, if any: the one
    /// whose closure records a pickup, which cannot name it.
    static WORKER: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
}

/// The worker a claim runs in, if any, for the pickups its closure records.
pub(crate) struct InWorker(Option<Arc<str>>);

impl InWorker {
    pub(crate) fn new(worker: Option<&str>) -> Self {
        InWorker(worker.map(Arc::from))
    }

    /// Runs `f` with the pickups recorded on this thread counted as the
    /// worker's.
    pub(crate) fn around<T>(&self, f: impl FnOnce() -> T) -> T {
        let _restored = Restored(WORKER.replace(self.0.clone()));
        f()
    }

    /// Awaits `future`, each of its polls [`around`](Self::around).
    #[cfg(feature = "async")]
    pub(crate) async fn around_polls<F: std::future::Future>(&self, future: F) -> F::Output {
        use std::future::poll_fn;
        use std::pin::pin;

        let mut future = pin!(future);
        poll_fn(|cx| self.around(|| future.as_mut().poll(cx))).await
    }
}

/// The worker of this thread's claim before one ran, put back when that
/// one ends, or unwinds.
struct Restored(Option<Arc<str>>);

impl Drop for Restored {
    fn drop(&mut self) {
        WORKER.set(self.0.take());
    }
}

/// The metrics of one claim call on a table: its handles, registered
/// once per call, and what it has counted so far.
pub(crate) struct ClaimMetrics {
    processed: Counter,
    failed: Counter,
    timed_out: Counter,
    gone: Counter,
    locked: Counter,
    claim: Histogram,
    batch: Histogram,
    counted: Counts,
}

impl ClaimMetrics {
    /// The metrics of a claim on `table`, run by the `worker` named, if any.
    pub(crate) fn new(table: &str, worker: Option<&str>) -> Self {
        let mut labels = vec![("table", table.to_owned())];
        labels.extend(worker.map(|worker| ("worker", worker.to_owned())));
        ClaimMetrics {
            processed: counter!(ROWS_PROCESSED, &labels),
            failed: counter!(ROWS_FAILED, &labels),
            timed_out: counter!(ROWS_TIMED_OUT, &labels),
            gone: counter!(ROWS_GONE, &labels),
            locked: counter!(ROWS_LOCKED, &labels),
            claim: histogram!(CLAIM_DURATION, &labels),
            batch: histogram!(BATCH_DURATION, &labels),
            counted: Counts::default(),
        }
    }

    /// A batch begun at `began` has ended, the call having done `so_far`:
    /// counts what moved, and times the batch if it handed rows over.
    pub(crate) fn batch_ended(&mut self, began: Instant, so_far: Counts) {
        if self.count(so_far) {
            self.batch.record(began.elapsed());
        }
    }

    /// The call begun at `began` has ended, having done `report`; a
    /// worker's (`polled`) that handed no row over is not timed.
    pub(crate) fn claim_ended(&mut self, began: Instant, report: Counts, polled: bool) {
        self.count(report);
        self.locked.increment(report.locked);
        if !polled || report.processed + report.failed > 0 {
            self.claim.record(began.elapsed());
        }
    }

    /// `rows` failed outside any claim's count: a worker's batch whose
    /// session the server ended under its job.
    #[cfg_attr(not(any(feature = "bb8", feature = "deadpool")), allow(dead_code))]
    pub(crate) fn failed_outside_the_claim(&mut self, rows: u64) {
        self.failed.increment(rows);
    }

    /// Adds what moved since last counted (`locked` is the call's end's
    /// alone); whether rows were handed over since.
    fn count(&mut self, now: Counts) -> bool {
        let before = self.counted;
        self.processed.increment(now.processed - before.processed);
        self.failed.increment(now.failed - before.failed);
        self.timed_out.increment(now.timed_out - before.timed_out);
        self.gone.increment(now.gone - before.gone);
        self.counted = now;
        now.processed + now.failed > before.processed + before.failed
    }
}

#[cfg(test)]
mod tests {
    /// The table of the module's docs has a row for every metric the
    /// module names (its `const`s).
    #[test]
    fn the_docs_list_every_metric() {
        let source = include_str!("metrics.rs");
        let names: Vec<&str> = source
            .lines()
            .filter(|line| line.starts_with("const "))
            .filter_map(|line| line.split('"').nth(1))
            .collect();
        assert_eq!(names.len(), 8, "{names:?}");
        for name in names {
            let row = format!("//! | `{name}` |");
            assert!(source.contains(&row), "the table has no row for {name}");
        }
    }
}
