//! The shop's three stories, written against this backend's `Conn` and `Pool`.

use std::future::Future;

use crate::{BoxError, Checks, Clock, Options};

pub use super::{Conn, Pool, Pooled};

mod bank;
mod emails;
mod lease;

/// Runs the stories one after the other, collecting their checks.
pub async fn run(pool: &Pool, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    let mut checks = Checks::default();
    emails::run(pool, options, clock, &mut checks).await?;
    bank::run(pool, options, clock, &mut checks).await?;
    lease::run(pool, options, clock, &mut checks).await?;
    Ok(checks)
}

/// Runs `job` on `workers` tokio tasks at once, each with a pooled connection
/// of its own, and returns their results in worker order (the first error
/// wins).
///
/// Every connection is taken before the first task is spawned, so that the
/// tasks really start together and contend for the same rows. A task owns its
/// connection (`tokio::spawn` wants `'static` futures) and gives it back to the
/// pool when it ends.
pub async fn run_workers<T, F, Fut>(pool: &Pool, workers: u32, job: F) -> Result<Vec<T>, BoxError>
where
    F: Fn(Pooled, i32) -> Fut,
    Fut: Future<Output = Result<T, BoxError>> + Send + 'static,
    T: Send + 'static,
{
    let mut conns = Vec::new();
    for _ in 0..workers {
        conns.push(pool.get_owned().await?);
    }
    let tasks: Vec<_> = (0..)
        .zip(conns)
        .map(|(worker, conn)| tokio::spawn(job(conn, worker)))
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await??);
    }
    Ok(results)
}
