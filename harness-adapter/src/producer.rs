//! The producer: bulk inserts of up to `PRODUCER_BATCH_MAX` jobs, paced by
//! the harness's `ENQUEUE <n>` lines, by its own clock, or by the queue's
//! depth.

use std::io::BufRead;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use diesel::{Connection, PgConnection};
use diesel_claim::StopHandle;

use crate::jobs;
use crate::samples::Stats;
use crate::settings::{Pacing, ProducerMode, Settings};

/// How long the producer waits after an insert failed before trying again.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// How long a depth-target producer waits when the queue is full.
const FULL_PAUSE: Duration = Duration::from_millis(10);

/// The inserts of up to `PRODUCER_BATCH_MAX` a depth-target producer makes
/// in one transaction, with one notification. At 64 workers on two cores, a
/// transaction per 128 jobs (begin, copy, notify, commit) enqueued some 2,500
/// to 2,900 jobs/s and left the queue a few hundred deep; eight per
/// transaction, some 9,000.
const DEPTH_BATCHES_PER_TRANSACTION: usize = 8;

/// How often a depth-target producer's queue is counted, on a thread and a
/// connection of their own, as the harness's other adapters poll theirs. In
/// between the producer follows the depth by what it enqueued and what the
/// workers committed, rather than count before each insert a table that many
/// workers delete from: a count reads every dead row, and took 80 to 120 ms
/// at 64 workers, time in which a producer that counted itself inserted
/// nothing.
const DEPTH_COUNT_EVERY: Duration = Duration::from_millis(200);

/// Reads the harness's `ENQUEUE <n>` lines from stdin on a thread of its
/// own, when it paces a fixed rate; the channel closes with stdin.
pub fn harness_tokens(settings: &Settings) -> Option<Receiver<usize>> {
    if settings.producer_mode != ProducerMode::Fixed || settings.pacing != Pacing::Harness {
        return None;
    }
    let (tokens, received) = mpsc::channel();
    thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            let count = line.trim().strip_prefix("ENQUEUE ").map(str::parse);
            if let Some(Ok(count)) = count {
                if tokens.send(count).is_err() {
                    break;
                }
            }
        }
    });
    Some(received)
}

/// Enqueues jobs as `settings` says until `stop`.
pub fn produce(
    settings: &Settings,
    stats: &Stats,
    stop: &StopHandle,
    tokens: Option<Receiver<usize>>,
) {
    let mut producer = Producer::new(settings, stats, stop);
    match (settings.producer_mode, tokens) {
        (ProducerMode::DepthTarget, _) => producer.keep_depth(),
        (ProducerMode::Fixed, Some(tokens)) => producer.as_told(&tokens),
        (ProducerMode::Fixed, None) => producer.at_own_pace(),
    }
}

/// The queue's depth as last counted, followed since by the jobs enqueued
/// and done.
#[derive(Debug)]
struct Depth {
    counted: i64,
    /// [`Stats::moved`] just before the count.
    moved_then: (u64, u64),
}

impl Depth {
    fn counted(rows: i64, moved: (u64, u64)) -> Depth {
        Depth {
            counted: rows,
            moved_then: moved,
        }
    }

    /// The depth now, given [`Stats::moved`] now.
    fn now(&self, (enqueued, done): (u64, u64)) -> i64 {
        let since =
            |now: u64, then: u64| i64::try_from(now.saturating_sub(then)).unwrap_or(i64::MAX);
        self.counted
            .saturating_add(since(enqueued, self.moved_then.0))
            .saturating_sub(since(done, self.moved_then.1))
    }
}

/// What the depth-target producers share: the queue's [`Depth`] as last
/// counted, and the jobs their transactions are enqueueing now, so that one
/// producer does not insert again what another is inserting.
#[derive(Debug, Default)]
struct Filling {
    counted: Mutex<Option<Depth>>,
    in_flight: AtomicI64,
}

impl Filling {
    /// The jobs missing from `target` now, given [`Stats::moved`] now: none
    /// before the first count, or when the queue is full.
    fn missing(&self, target: i64, moved: (u64, u64)) -> Option<usize> {
        let depth = lock(&self.counted).as_ref()?.now(moved);
        let missing = target - depth - self.in_flight.load(Ordering::Relaxed);
        usize::try_from(missing).ok().filter(|&missing| missing > 0)
    }

    /// Counts `jobs` as being enqueued until the guard drops.
    fn enqueueing(&self, jobs: usize) -> InFlight<'_> {
        let jobs = i64::try_from(jobs).unwrap_or(i64::MAX);
        self.in_flight.fetch_add(jobs, Ordering::Relaxed);
        InFlight {
            in_flight: &self.in_flight,
            jobs,
        }
    }
}

/// Jobs a producer is enqueueing, counted in [`Filling`] while it lives.
struct InFlight<'a> {
    in_flight: &'a AtomicI64,
    jobs: i64,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(self.jobs, Ordering::Relaxed);
    }
}

/// A fixed rate's jobs owed so far: the rate times the time that really
/// passed, less the whole jobs already due.
#[derive(Debug, Default)]
struct Credit(f64);

impl Credit {
    /// The whole jobs due after `elapsed` more at `rate` jobs/s; a rate of
    /// zero or less owes nothing, and forgets what was owed.
    fn add(&mut self, rate: f64, elapsed: Duration) -> usize {
        if rate <= 0.0 {
            self.0 = 0.0;
            return 0;
        }
        self.0 += rate * elapsed.as_secs_f64();
        let due = self.0.floor();
        self.0 -= due;
        due as usize
    }
}

struct Producer<'a> {
    settings: &'a Settings,
    stats: &'a Stats,
    stop: &'a StopHandle,
    /// Its own connection, made again after a failure.
    conn: Option<PgConnection>,
    payload: String,
}

impl<'a> Producer<'a> {
    fn new(settings: &'a Settings, stats: &'a Stats, stop: &'a StopHandle) -> Producer<'a> {
        Producer {
            settings,
            stats,
            stop,
            conn: None,
            payload: "x".repeat(settings.payload_bytes),
        }
    }

    /// Enqueues what the harness's tokens add up to, in inserts of up to
    /// `batch_max`, until stdin closes.
    fn as_told(&mut self, tokens: &Receiver<usize>) {
        while !self.stop.is_stopped() {
            let mut owed = match tokens.recv_timeout(Duration::from_millis(100)) {
                Ok(count) => count,
                Err(RecvTimeoutError::Timeout) => continue,
                // The harness closes stdin as it stops the adapter.
                Err(RecvTimeoutError::Disconnected) => return,
            };
            // Tokens that came while the last insert ran.
            owed += tokens.try_iter().sum::<usize>();
            self.enqueue(owed, self.settings.batch_max);
        }
    }

    /// Enqueues at the rate of the control file (else `PRODUCER_RATE`),
    /// credited on the time that really passed since the last tick, so that
    /// a slow insert does not lower the rate offered.
    fn at_own_pace(&mut self) {
        let period = self.settings.batch_period.max(Duration::from_millis(1));
        let mut last_tick = Instant::now();
        let mut credit = Credit::default();
        while !self.stop.is_stopped() {
            thread::sleep((last_tick + period).saturating_duration_since(Instant::now()));
            let now = Instant::now();
            let due = credit.add(self.rate(), now.duration_since(last_tick));
            last_tick = now;
            self.enqueue(due, self.settings.batch_max);
        }
    }

    /// Keeps `TARGET_DEPTH` jobs in the queue, with `depth_producers`
    /// threads (this one among them) and a [`Depth`] that a thread of its own
    /// counts every [`DEPTH_COUNT_EVERY`].
    fn keep_depth(&mut self) {
        let producers = self.settings.depth_producers;
        let filling = Filling::default();
        let (settings, stats, stop) = (self.settings, self.stats, self.stop);
        thread::scope(|scope| {
            scope.spawn(|| count_depth(settings, stats, stop, &filling.counted));
            for _ in 1..producers {
                scope.spawn(|| Producer::new(settings, stats, stop).fill(&filling));
            }
            self.fill(&filling);
        });
    }

    /// Enqueues what is missing from `TARGET_DEPTH`, in transactions of up to
    /// [`DEPTH_BATCHES_PER_TRANSACTION`] inserts, until the producer stops.
    fn fill(&mut self, filling: &Filling) {
        let per_transaction = DEPTH_BATCHES_PER_TRANSACTION * self.settings.batch_max;
        while !self.stop.is_stopped() {
            let missing = filling.missing(self.settings.target_depth, self.stats.moved());
            let Some(batch) = missing.map(|missing| missing.min(per_transaction)) else {
                thread::sleep(FULL_PAUSE);
                continue;
            };
            let _in_flight = filling.enqueueing(batch);
            self.enqueue(batch, per_transaction);
        }
    }

    /// The fixed rate the harness asks for now.
    fn rate(&self) -> f64 {
        self.settings
            .rate_control_file
            .as_ref()
            .and_then(|path| std::fs::read_to_string(path).ok())
            .and_then(|text| text.trim().parse::<f64>().ok())
            .unwrap_or(self.settings.producer_rate)
    }

    /// Enqueues `count` jobs in transactions of up to `per_transaction`, in
    /// inserts of up to `batch_max`, each transaction tried again until it
    /// commits or the producer stops.
    fn enqueue(&mut self, mut count: usize, per_transaction: usize) {
        let batch_max = self.settings.batch_max;
        while count > 0 && !self.stop.is_stopped() {
            let batch = count.min(per_transaction);
            let payload = std::mem::take(&mut self.payload);
            let done = self.with_connection(|conn| jobs::enqueue(conn, batch, batch_max, &payload));
            self.payload = payload;
            if done.is_some() {
                self.stats.enqueued(batch);
                count -= batch;
            } else {
                thread::sleep(RETRY_PAUSE);
            }
        }
    }

    /// Runs `f` on the producer's connection (see [`on_connection`]).
    fn with_connection<T, E: std::fmt::Display>(
        &mut self,
        f: impl FnOnce(&mut PgConnection) -> Result<T, E>,
    ) -> Option<T> {
        on_connection(&mut self.conn, &self.settings.database_url, "producer", f)
    }
}

/// Counts the queue every [`DEPTH_COUNT_EVERY`] until `stop`, on a connection
/// of its own, and leaves the count in `counted`: beside the producer, as the
/// harness's other adapters poll their depth, so that no insert waits for a
/// count.
fn count_depth(
    settings: &Settings,
    stats: &Stats,
    stop: &StopHandle,
    counted: &Mutex<Option<Depth>>,
) {
    let mut conn = None;
    while !stop.is_stopped() {
        let began = Instant::now();
        let moved = stats.moved();
        if let Some(rows) = on_connection(&mut conn, &settings.database_url, "depth", jobs::depth) {
            *lock(counted) = Some(Depth::counted(rows, moved));
        }
        thread::sleep(DEPTH_COUNT_EVERY.saturating_sub(began.elapsed()));
    }
}

/// Runs `f` on `conn`, connecting to `url` first if needed; on failure, says
/// why (as `who`) and drops the connection.
fn on_connection<T, E: std::fmt::Display>(
    conn: &mut Option<PgConnection>,
    url: &str,
    who: &str,
    f: impl FnOnce(&mut PgConnection) -> Result<T, E>,
) -> Option<T> {
    if conn.is_none() {
        match PgConnection::establish(url) {
            Ok(connected) => *conn = Some(connected),
            Err(error) => {
                eprintln!("[diesel-claim] {who} cannot connect: {error}");
                return None;
            }
        }
    }
    match f(conn.as_mut().expect("connected above")) {
        Ok(value) => Some(value),
        Err(error) => {
            eprintln!("[diesel-claim] {who}: {error}");
            *conn = None;
            None
        }
    }
}

/// The count, whether or not a thread panicked holding it.
fn lock(counted: &Mutex<Option<Depth>>) -> std::sync::MutexGuard<'_, Option<Depth>> {
    counted
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credit_follows_the_time_that_passed_not_the_ticks() {
        let mut credit = Credit::default();
        // Ticks of a nominal 25 ms that ran long or short, 10 s in all.
        let ticks_ms = [25, 40, 3, 100, 25, 807].repeat(10);
        assert_eq!(ticks_ms.iter().sum::<u64>(), 10_000);
        let due: usize = ticks_ms
            .into_iter()
            .map(|ms| credit.add(800.0, Duration::from_millis(ms)))
            .sum();
        assert!((7_999..=8_000).contains(&due), "{due} jobs due");
    }

    #[test]
    fn the_depth_follows_what_was_enqueued_and_done_since_the_count() {
        let depth = Depth::counted(4_000, (10_000, 6_500));
        assert_eq!(depth.now((10_000, 6_500)), 4_000);
        assert_eq!(depth.now((10_128, 6_500)), 4_128);
        assert_eq!(depth.now((10_128, 9_000)), 1_628);
    }

    #[test]
    fn producers_do_not_enqueue_again_what_another_is_enqueueing() {
        let filling = Filling::default();
        // Nothing before the first count.
        assert_eq!(filling.missing(4_000, (0, 0)), None);
        *lock(&filling.counted) = Some(Depth::counted(1_000, (0, 0)));
        assert_eq!(filling.missing(4_000, (0, 0)), Some(3_000));
        let one = filling.enqueueing(1_024);
        let two = filling.enqueueing(1_024);
        assert_eq!(filling.missing(4_000, (0, 0)), Some(952));
        // Committed, the jobs count as enqueued instead.
        drop(one);
        assert_eq!(filling.missing(4_000, (1_024, 0)), Some(952));
        drop(two);
        assert_eq!(filling.missing(4_000, (2_048, 500)), Some(1_452));
        assert_eq!(filling.missing(4_000, (3_000, 0)), None);
    }

    #[test]
    fn a_stopped_rate_forgets_what_was_owed() {
        let mut credit = Credit::default();
        assert_eq!(credit.add(10.0, Duration::from_millis(150)), 1);
        assert_eq!(credit.add(0.0, Duration::from_secs(1)), 0);
        assert_eq!(credit.add(10.0, Duration::from_millis(50)), 0);
    }
}
