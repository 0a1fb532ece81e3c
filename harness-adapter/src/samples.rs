//! What the adapter tells the harness on stdout, one JSON object a line: the
//! descriptor at start, then every `SAMPLE_EVERY_S` the pickup latency's
//! percentiles over the last 30 s, the enqueue and completion rates, and the
//! queue's depth.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use diesel::PgConnection;
use diesel_claim::StopHandle;
use hdrhistogram::Histogram;
use metrics::{Counter, Gauge, Key, KeyName, Metadata, SharedString, Unit};
use serde_json::{json, Value};

use crate::jobs;
use crate::settings::Settings;

/// The system's name in every record.
pub const SYSTEM: &str = "diesel-claim";

/// The span the latency percentiles cover, as the contract asks.
const LATENCY_WINDOW: Duration = Duration::from_secs(30);

/// The largest pickup latency told apart, in microseconds (an hour); longer
/// ones count as an hour.
const LATENCY_MAX_US: u64 = 3_600_000_000;

/// Counters shared by the producer, the workers and the sampler.
pub struct Stats {
    enqueued: AtomicU64,
    /// The jobs done, as the crate's metrics count them (see
    /// [`Stats::count_completions`]).
    completed: Arc<AtomicU64>,
    /// Pickup latencies since the last sample, in microseconds.
    latencies: Mutex<Histogram<u64>>,
}

impl Stats {
    pub fn new() -> Stats {
        Stats {
            enqueued: AtomicU64::new(0),
            completed: Arc::new(AtomicU64::new(0)),
            latencies: Mutex::new(latency_histogram()),
        }
    }

    /// `count` jobs were enqueued (their transaction committed).
    pub fn enqueued(&self, count: usize) {
        self.enqueued.fetch_add(count as u64, Ordering::Relaxed);
    }

    /// The jobs enqueued and the jobs done so far.
    pub fn moved(&self) -> (u64, u64) {
        (
            self.enqueued.load(Ordering::Relaxed),
            self.completed.load(Ordering::Relaxed),
        )
    }

    /// A worker started a job enqueued `latency_us` ago.
    pub fn picked_up(&self, latency_us: i64) {
        let latency_us = u64::try_from(latency_us).unwrap_or(0).max(1);
        let mut latencies = self.latencies.lock().unwrap_or_else(|e| e.into_inner());
        latencies.saturating_record(latency_us);
    }

    /// Counts the jobs done from now on, through the crate's
    /// `diesel_claim_rows_processed_total`: it moves once a batch's
    /// transaction has committed (the jobs deleted), so a job whose commit
    /// fails, as when its session is ended, is not counted, and is counted
    /// once when it runs again. Installs the process's metrics recorder:
    /// call it once.
    pub fn count_completions(&self) -> Result<(), String> {
        metrics::set_global_recorder(CompletionRecorder(Arc::clone(&self.completed)))
            .map_err(|error| format!("cannot install the metrics recorder: {error}"))
    }

    /// The latencies recorded since the last call.
    fn take_latencies(&self) -> Histogram<u64> {
        let mut latencies = self.latencies.lock().unwrap_or_else(|e| e.into_inner());
        let taken = latencies.clone();
        latencies.reset();
        taken
    }
}

/// A recorder of the crate's metrics that keeps the processed rows alone.
struct CompletionRecorder(Arc<AtomicU64>);

impl metrics::Recorder for CompletionRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        if key.name() == "diesel_claim_rows_processed_total" {
            Counter::from_arc(Arc::clone(&self.0))
        } else {
            Counter::noop()
        }
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

fn latency_histogram() -> Histogram<u64> {
    // Three significant figures, as the contract asks.
    Histogram::new_with_bounds(1, LATENCY_MAX_US, 3).expect("valid histogram bounds")
}

/// Prints the descriptor record: what runs, on which tables.
pub fn emit_descriptor(settings: &Settings, version: &str) {
    emit(&json!({
        "kind": "descriptor",
        "system": SYSTEM,
        "event_tables": jobs::partitions(),
        "event_indexes": jobs::partitions().iter().map(|table| format!("{table}_pkey")).collect::<Vec<_>>(),
        "extensions": [],
        "version": version,
        "schema_version": jobs::SCHEMA_VERSION,
        "db_name": settings.db_name(),
        "started_at": timestamp(SystemTime::now()),
        "worker": "run_pooled on r2d2 (blocking), listening, then_delete, a ring of 8 partitions",
        "worker_count": settings.workers,
        "claim_batch": settings.claim_batch,
        "depth_producers": settings.depth_producers,
    }));
}

/// The pickup latencies of the last [`LATENCY_WINDOW`], in slices of one
/// sample each: memory bounded by the number of slices, whatever the rate.
#[derive(Default)]
struct LatencyWindow {
    /// Each slice with the time it ended, oldest first.
    slices: VecDeque<(Instant, Histogram<u64>)>,
}

impl LatencyWindow {
    /// Adds the latencies recorded up to `now`, and forgets those of slices
    /// that ended a whole window ago.
    fn push(&mut self, now: Instant, slice: Histogram<u64>) {
        self.slices.push_back((now, slice));
        while self
            .slices
            .front()
            .is_some_and(|(ended, _)| now.duration_since(*ended) >= LATENCY_WINDOW)
        {
            self.slices.pop_front();
        }
    }

    /// The 50th, 95th and 99th percentiles in milliseconds, if any latency
    /// was recorded in the window.
    fn percentiles_ms(&self) -> Option<[f64; 3]> {
        let mut all = latency_histogram();
        for (_, slice) in &self.slices {
            all.add(slice).expect("histograms of the same bounds");
        }
        if all.is_empty() {
            return None;
        }
        Some([0.50, 0.95, 0.99].map(|quantile| all.value_at_quantile(quantile) as f64 / 1000.0))
    }
}

/// Prints a sample every `settings.sample_every`, on the wall clock's
/// multiples of it (so that every system's samples line up), until `stop`.
pub fn sample(settings: &Settings, stats: &Stats, stop: &StopHandle) {
    let every = settings.sample_every;
    let mut depth_conn: Option<PgConnection> = None;
    let mut window = LatencyWindow::default();
    let (enqueued, completed) = stats.moved();
    let mut last = (Instant::now(), enqueued, completed);
    while sleep_until_boundary(every, stop) {
        let now = Instant::now();
        let t = timestamp(SystemTime::now());
        let (enqueued, completed) = stats.moved();
        let elapsed = now.duration_since(last.0).as_secs_f64().max(1e-3);
        let enqueue_rate = (enqueued - last.1) as f64 / elapsed;
        let completion_rate = (completed - last.2) as f64 / elapsed;
        last = (now, enqueued, completed);

        window.push(now, stats.take_latencies());
        let rate_window = every.as_secs_f64();
        if let Some(percentiles) = window.percentiles_ms() {
            let metrics = ["claim_p50_ms", "claim_p95_ms", "claim_p99_ms"];
            for (metric, ms) in metrics.into_iter().zip(percentiles) {
                emit_metric(&t, settings, metric, ms, LATENCY_WINDOW.as_secs_f64());
            }
        }
        emit_metric(&t, settings, "enqueue_rate", enqueue_rate, rate_window);
        emit_metric(
            &t,
            settings,
            "completion_rate",
            completion_rate,
            rate_window,
        );
        match queue_depth(&settings.database_url, &mut depth_conn) {
            Ok(depth) => emit_metric(&t, settings, "queue_depth", depth as f64, 0.0),
            Err(error) => eprintln!("[diesel-claim] cannot read the queue's depth: {error}"),
        }
    }
}

/// The queue's depth, on a connection of the sampler's own, made again when
/// it fails.
fn queue_depth(url: &str, conn: &mut Option<PgConnection>) -> Result<i64, String> {
    use diesel::Connection;

    if conn.is_none() {
        *conn = Some(PgConnection::establish(url).map_err(|e| e.to_string())?);
    }
    let depth = jobs::depth(conn.as_mut().expect("just made"));
    if depth.is_err() {
        *conn = None;
    }
    depth.map_err(|e| e.to_string())
}

/// Sleeps to the next multiple of `every` since the Unix epoch; false if
/// stopped first.
fn sleep_until_boundary(every: Duration, stop: &StopHandle) -> bool {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let every_ns = every.as_nanos().max(1);
    let into_period = Duration::from_nanos((since_epoch.as_nanos() % every_ns) as u64);
    let deadline = Instant::now() + (every - into_period);
    while !stop.is_stopped() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
    false
}

fn emit_metric(t: &str, settings: &Settings, metric: &str, value: f64, window_s: f64) {
    emit(&json!({
        "t": t,
        "system": SYSTEM,
        "instance_id": settings.instance_id,
        "kind": "adapter",
        "subject_kind": "adapter",
        "subject": "",
        "metric": metric,
        "value": value,
        "window_s": window_s,
    }));
}

/// One record, one line, written whole under stdout's lock (a harness gone
/// away is not this process's business: the write's error is dropped).
fn emit(record: &Value) {
    use std::io::Write;

    let _ = writeln!(std::io::stdout().lock(), "{record}");
}

/// RFC 3339 in UTC, to the millisecond, as the harness's records have it.
fn timestamp(at: SystemTime) -> String {
    humantime::format_rfc3339_millis(at).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice_of_ms(values_ms: impl IntoIterator<Item = u64>) -> Histogram<u64> {
        let mut slice = latency_histogram();
        for ms in values_ms {
            slice.record(ms * 1000).unwrap();
        }
        slice
    }

    fn close(actual: f64, expected: f64) -> bool {
        // Three significant figures.
        (actual - expected).abs() <= expected * 1e-3
    }

    #[test]
    fn percentiles_cover_every_slice_of_the_window() {
        let start = Instant::now();
        let mut window = LatencyWindow::default();
        assert_eq!(window.percentiles_ms(), None);
        window.push(start, slice_of_ms(1..=50));
        window.push(start + Duration::from_secs(5), slice_of_ms(51..=100));
        let [p50, p95, p99] = window.percentiles_ms().unwrap();
        assert!(close(p50, 50.0), "p50 {p50}");
        assert!(close(p95, 95.0), "p95 {p95}");
        assert!(close(p99, 99.0), "p99 {p99}");
    }

    #[test]
    fn slices_leave_the_window_after_it_has_passed() {
        let start = Instant::now();
        let mut window = LatencyWindow::default();
        window.push(start, slice_of_ms([5_000]));
        window.push(start + Duration::from_secs(25), slice_of_ms([2]));
        assert!(close(window.percentiles_ms().unwrap()[2], 5_000.0));
        window.push(start + LATENCY_WINDOW, slice_of_ms([1]));
        assert_eq!(window.slices.len(), 2);
        let [p50, _, p99] = window.percentiles_ms().unwrap();
        assert!(close(p50, 1.0) && close(p99, 2.0), "p50 {p50}, p99 {p99}");
    }

    #[test]
    fn latencies_beyond_the_range_count_as_its_top() {
        let stats = Stats::new();
        stats.picked_up(i64::MAX);
        stats.picked_up(-5);
        let taken = stats.take_latencies();
        assert_eq!(taken.len(), 2);
        assert!(close(taken.max() as f64, LATENCY_MAX_US as f64));
        assert_eq!(taken.min(), 1);
        assert!(stats.take_latencies().is_empty());
    }
}
