//! B5: optimistic (`update_versioned` + `retry`) against pessimistic
//! (`with_lock`) updates on a hot set of accounts.

use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use crate::database::BenchDb;
use crate::db::{BackendKind, BenchConn};
use crate::schema;

/// How many accounts the workers fight over.
pub const HOT_SETS: [i64; 3] = [1, 10, 1000];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Approach {
    Optimistic,
    Pessimistic,
}

impl Approach {
    pub const ALL: [Approach; 2] = [Approach::Optimistic, Approach::Pessimistic];

    pub fn name(self) -> &'static str {
        match self {
            Approach::Optimistic => "optimistic (update_versioned + retry)",
            Approach::Pessimistic => "pessimistic (with_lock)",
        }
    }
}

#[derive(Debug, Clone)]
pub struct ContentionRun {
    pub backend: BackendKind,
    pub approach: Approach,
    pub hot: i64,
    pub workers: usize,
    pub elapsed: Duration,
    pub tally: Tally,
    /// Successful increments missing from the final balances: must be 0.
    pub lost_updates: i64,
}

/// What the workers did.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tally {
    pub successes: u64,
    /// Runs of the operation, retries included.
    pub attempts: u64,
    /// Operations `retry` gave up on after its last attempt.
    pub gave_up: u64,
}

impl Tally {
    fn add(self, other: Tally) -> Tally {
        Tally {
            successes: self.successes + other.successes,
            attempts: self.attempts + other.attempts,
            gave_up: self.gave_up + other.gave_up,
        }
    }
}

impl ContentionRun {
    pub fn successes_per_sec(&self) -> f64 {
        self.tally.successes as f64 / self.elapsed.as_secs_f64()
    }

    /// Attempts beyond one per success.
    pub fn retries_per_success(&self) -> f64 {
        let retries = self.tally.attempts.saturating_sub(self.tally.successes);
        retries as f64 / self.tally.successes.max(1) as f64
    }
}

/// `workers` threads add 1 to random accounts among `hot` for `duration`.
pub fn run_contention<C: BenchConn>(
    db: &mut BenchDb<C>,
    approach: Approach,
    hot: i64,
    workers: usize,
    duration: Duration,
) -> Result<ContentionRun, String> {
    db.setup(|conn| conn.batch_execute(&schema::refill_accounts(C::BACKEND, hot)))?;
    let url = db.url.clone();
    let start = Barrier::new(workers + 1);
    let (started, tallies) = thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|seed| {
                let (url, start) = (&url, &start);
                scope.spawn(move || contend::<C>(url, approach, hot, seed as u64, duration, start))
            })
            .collect();
        start.wait();
        let started = Instant::now();
        let tallies: Vec<_> = handles
            .into_iter()
            .map(|handle| handle.join().expect("a worker panicked"))
            .collect();
        (started, tallies)
    });
    let elapsed = started.elapsed();
    let tally = tallies
        .into_iter()
        .try_fold(Tally::default(), |sum, tally| tally.map(|t| sum.add(t)))?;
    let total = db.setup(|conn| conn.load_count(schema::total_balance(C::BACKEND)))?;
    Ok(ContentionRun {
        backend: C::BACKEND,
        approach,
        hot,
        workers,
        elapsed,
        tally,
        lost_updates: tally.successes as i64 - total,
    })
}

fn contend<C: BenchConn>(
    url: &str,
    approach: Approach,
    hot: i64,
    seed: u64,
    duration: Duration,
    start: &Barrier,
) -> Result<Tally, String> {
    let conn = C::open(url).map_err(|e| format!("cannot connect: {e}"));
    start.wait();
    let mut conn = conn?;
    let mut random = fastrand::Rng::with_seed(seed);
    let mut tally = Tally::default();
    let deadline = Instant::now() + duration;
    while Instant::now() < deadline {
        let account = 1 + random.u64(..hot as u64) as i32;
        let outcome = match approach {
            Approach::Optimistic => conn.add_one_optimistic(account, &mut tally.attempts),
            Approach::Pessimistic => {
                tally.attempts += 1;
                conn.add_one_pessimistic(account)
            }
        };
        match outcome {
            Ok(()) => tally.successes += 1,
            // `retry` ran out of attempts: a cost of contention, not a fault.
            Err(error) if error.is_transient() => tally.gave_up += 1,
            Err(error) => return Err(format!("B5 {approach:?}: {error}")),
        }
    }
    Ok(tally)
}
