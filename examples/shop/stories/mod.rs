//! The shop's four stories, written against this backend's `Conn` and `Pool`.

use std::sync::Barrier;
use std::thread;

use crate::{BoxError, Checks, Clock, Options};

pub use super::{notify_new_orders, ClaimStamp, Conn, Pool, NEW_ORDERS_CHANNEL};

mod bank;
mod emails;
mod invoices;
mod signups;

/// Runs the stories one after the other, collecting their checks.
pub fn run(pool: &Pool, options: &Options, clock: Clock) -> Result<Checks, BoxError> {
    let mut checks = Checks::default();
    emails::run(pool, options, clock, &mut checks)?;
    bank::run(pool, options, clock, &mut checks)?;
    signups::run(pool, options, clock, &mut checks)?;
    invoices::run(pool, options, clock, &mut checks)?;
    Ok(checks)
}

/// Runs `job` on `workers` threads at once, each with a pooled connection of its
/// own, and returns their results in worker order (the first error wins).
///
/// A barrier holds every worker until all have their connection, so they really
/// start together and contend for the same rows.
fn run_workers<T, F>(pool: &Pool, workers: u32, job: F) -> Result<Vec<T>, BoxError>
where
    T: Send,
    F: Fn(&mut Conn, i32) -> Result<T, BoxError> + Sync,
{
    let start = Barrier::new(workers as usize);
    thread::scope(|scope| {
        let handles: Vec<_> = (0..workers as i32)
            .map(|worker| {
                let (job, start) = (&job, &start);
                scope.spawn(move || {
                    let conn = pool.get();
                    start.wait();
                    job(&mut conn?, worker)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    })
}
