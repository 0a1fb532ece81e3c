//! The service: its pool, its worker, and how it stops.

use std::pin::pin;
use std::time::Duration;

use diesel::prelude::*;
use diesel_async::pooled_connection::{bb8, AsyncDieselConnectionManager, PoolError};
use diesel_async::AsyncPgConnection;
use diesel_claim::aio::prelude::*;
use diesel_claim::{Retries, StopHandle};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::queue::{jobs, send_email, Job, JobError, Runs, CHANNEL};

/// The pool the worker checks a connection out of for each claim.
pub type Pool = bb8::Pool<AsyncPgConnection>;

/// A job that runs longer is ended (its future dropped, its statements
/// ended by the server), rolled back, and recorded as a failure.
pub const JOB_TIMEOUT: Duration = Duration::from_secs(1);

/// Attempts in all: a job that fails this many times is a dead letter.
pub const MAX_ATTEMPTS: u32 = 3;

/// The delay after a job's first failure, doubling after each failure up to
/// [`LONGEST_RETRY`]. Short, so that the example's checks see the retries
/// within seconds; a service facing an outage waits longer (the crate's
/// default is 1 s, up to an hour).
pub const FIRST_RETRY: Duration = Duration::from_millis(250);
/// The longest delay between two attempts of a job.
pub const LONGEST_RETRY: Duration = Duration::from_secs(60);

/// A pool for a worker of `loops` claim loops, with room for the
/// service's other users (here, the producers). The listener's connection
/// is made outside the pool's count.
///
/// bb8 retries a connection that failed after a pause of up to half its
/// `connection_timeout`, and a checkout waits that long: after a server
/// restart, a timeout of 30 s (bb8's default) can keep every loop waiting
/// for seconds after the server is back. With 2 s, a failed checkout is one
/// more try of the worker's own, which it repeats.
pub async fn pool(url: &str, loops: usize) -> Result<Pool, PoolError> {
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(url);
    Pool::builder()
        .max_size(u32::try_from(loops + 2).unwrap_or(u32::MAX))
        .connection_timeout(Duration::from_secs(2))
        .build(manager)
        .await
}

/// Runs the queue's jobs until `stop`: `loops` claim loops on `pool`, each
/// taking the next job from the head of the queue (highest priority, then
/// oldest), woken by the producers' notifications.
///
/// A job that fails, panics or runs past [`JOB_TIMEOUT`] is rolled back to
/// its savepoint, and its attempt, error and next run time are written in
/// its row before its lock is released: no worker, in any process, takes it
/// before then. A job done is deleted in its transaction.
pub async fn serve(
    pool: &Pool,
    stop: &StopHandle,
    loops: usize,
    runs: &Runs,
) -> Result<ClaimReport, JobError> {
    let schedule = Retries::new(jobs::attempts, jobs::run_at)
        .last_error(jobs::last_error)
        .max_attempts(MAX_ATTEMPTS)
        .backoff(FIRST_RETRY, LONGEST_RETRY);
    jobs::table
        .order(jobs::priority.desc())
        .select(Job::as_select())
        .build_claim()
        .retries(schedule)
        .then_delete()
        .worker(stop)
        .listen(CHANNEL)
        .concurrency(loops)
        .timeout(JOB_TIMEOUT)
        .run_pooled(pool, async |conn: &mut AsyncPgConnection, job: Job| {
            send_email(conn, job, runs).await
        })
        .await
}

/// The signals that stop the service: SIGTERM, which systemd, Docker and
/// Kubernetes send, and SIGINT, Ctrl-C's.
pub struct Signals {
    terminate: Signal,
    interrupt: Signal,
}

impl Signals {
    /// Takes both signals over from now on: they no longer end the process,
    /// and [`next`](Self::next) sees them, however long after they came.
    pub fn listen() -> std::io::Result<Signals> {
        Ok(Signals {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    /// Waits for the next of the signals; its name.
    pub async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}

/// Runs the service until a signal, then stops it gracefully: each loop
/// finishes the job in hand (or the timeout ends it) and commits, and the
/// worker returns the report of all it did. Jobs still queued stay queued,
/// for the next start.
pub async fn run_until_signalled(
    pool: &Pool,
    signals: &mut Signals,
    loops: usize,
    runs: &Runs,
) -> Result<ClaimReport, JobError> {
    let stop = StopHandle::new();
    let mut worker = pin!(serve(pool, &stop, loops, runs));
    tokio::select! {
        // It ends on its own only on an error no other connection can mend.
        ended = &mut worker => return ended,
        signal = signals.next() => {
            tracing::info!(signal, "stopping: the jobs in hand finish first");
            stop.stop();
        }
    }
    worker.await
}
