//! PL: pickup latency of the crate's worker loop (`ClaimWorker`). One row at
//! a time is inserted and committed while the worker waits; the latency runs
//! from the commit returning to the worker's closure starting. Between rows
//! the queue stays empty for 20–200 ms, so that a polling worker's backoff
//! reaches its maximum interval now and then.

use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use diesel_claim::StopHandle;

use crate::database::BenchDb;
use crate::db::{reset_orders, BackendKind, BenchConn};
use crate::schema::PENDING;

/// The channel a listening worker waits on.
const CHANNEL: &str = "bench_orders";

/// The worker's poll interval while idle: from `min`, doubling up to `max`.
pub const POLL: (Duration, Duration) = (Duration::from_millis(5), Duration::from_millis(50));

/// How the worker learned of new rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeUp {
    Polling,
    /// PostgreSQL `LISTEN`, the producer sending `pg_notify` in the row's
    /// transaction (the polls stay, as the fallback).
    Listen,
}

impl WakeUp {
    pub fn name(self) -> &'static str {
        match self {
            WakeUp::Polling => "polling",
            WakeUp::Listen => "LISTEN + polling",
        }
    }
}

/// The latencies of one worker and wake-up.
#[derive(Debug, Clone)]
pub struct PickupRun {
    pub backend: BackendKind,
    pub wake_up: WakeUp,
    /// Commit to closure, one per row, in the order measured.
    pub latencies: Vec<Duration>,
}

impl PickupRun {
    /// The `q` quantile (nearest rank) of the latencies.
    pub fn quantile(&self, q: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        sorted[rank - 1]
    }

    pub fn max(&self) -> Duration {
        self.latencies.iter().copied().max().unwrap_or_default()
    }
}

/// The wake-ups the backend has: polling everywhere, `LISTEN` on PostgreSQL.
pub fn wake_ups(backend: BackendKind) -> Vec<WakeUp> {
    match backend {
        BackendKind::Postgres => vec![WakeUp::Listen, WakeUp::Polling],
        BackendKind::Sqlite | BackendKind::Mysql => vec![WakeUp::Polling],
    }
}

/// Measures `rows` pickups with each wake-up the backend has.
pub fn measure<C: BenchConn>(db: &mut BenchDb<C>, rows: usize) -> Result<Vec<PickupRun>, String> {
    wake_ups(C::BACKEND)
        .into_iter()
        .map(|wake_up| measure_one(db, rows, wake_up))
        .collect()
}

fn measure_one<C: BenchConn>(
    db: &mut BenchDb<C>,
    rows: usize,
    wake_up: WakeUp,
) -> Result<PickupRun, String> {
    db.setup(|conn| reset_orders(conn, 0))?;
    let channel = (wake_up == WakeUp::Listen).then_some(CHANNEL);
    let url = db.url.clone();
    let stop = StopHandle::new();
    let picked = Mutex::new(Vec::with_capacity(rows));
    let latencies = thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let mut conn = C::open(&url).map_err(|e| e.to_string())?;
            let mut record = |_| picked.lock().unwrap().push(Instant::now());
            conn.run_worker(&stop, POLL, channel, &mut record)
                .map_err(|e| e.to_string())
        });
        let produced = produce::<C>(&url, rows, channel, &picked);
        stop.stop();
        let processed = worker.join().expect("the worker panicked")?;
        let latencies = produced?;
        if processed != rows as u64 {
            return Err(format!("the worker processed {processed} of {rows} rows"));
        }
        Ok(latencies)
    })?;
    let left = db.setup(|conn| {
        conn.load_count(&format!("SELECT COUNT(*) AS n FROM orders WHERE {PENDING}"))
    })?;
    if left > 0 {
        return Err(format!("{left} rows left pending after the pickups"));
    }
    Ok(PickupRun {
        backend: C::BACKEND,
        wake_up,
        latencies,
    })
}

/// Inserts `rows` pending orders one at a time, each committed (with a
/// notification on `channel`) once the last was picked; returns each one's
/// latency.
fn produce<C: BenchConn>(
    url: &str,
    rows: usize,
    channel: Option<&str>,
    picked: &Mutex<Vec<Instant>>,
) -> Result<Vec<Duration>, String> {
    let mut conn = C::open(url).map_err(|e| e.to_string())?;
    let now = match C::BACKEND {
        BackendKind::Postgres | BackendKind::Mysql => "now()",
        BackendKind::Sqlite => "datetime('now')",
    };
    let notify = channel.map_or(String::new(), |channel| {
        format!("SELECT pg_notify('{channel}', '');")
    });
    let insert = format!(
        "{}; INSERT INTO orders (shipped_at, shipped_email_sent, priority, customer, \
         total_cents, note) VALUES ({now}, FALSE, 0, 'pickup', 100, 'x'); {notify} COMMIT",
        C::BACKEND.begin()
    );
    let mut random = fastrand::Rng::with_seed(7);
    let mut latencies = Vec::with_capacity(rows);
    // The worker has found the queue empty and waits.
    thread::sleep(Duration::from_millis(100));
    for row in 0..rows {
        conn.batch_execute(&insert).map_err(|e| e.to_string())?;
        let committed = Instant::now();
        let deadline = committed + Duration::from_secs(10);
        let picked_at = loop {
            if let Some(&at) = picked.lock().unwrap().get(row) {
                break at;
            }
            if Instant::now() > deadline {
                return Err(format!("row {row} not picked up within 10 s"));
            }
            thread::sleep(Duration::from_micros(200));
        };
        latencies.push(picked_at.saturating_duration_since(committed));
        thread::sleep(Duration::from_millis(random.u64(20..200)));
    }
    Ok(latencies)
}
