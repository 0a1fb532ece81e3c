//! The peers: the same drain done without the crate, the way its users would
//! otherwise do it, measured in the same run as the crate's modes and reported
//! beside them (see `report::peers_table`).
//!
//! - DJ, the seed's Django loop: Python processes, in [`django`];
//! - D0 and D3, Diesel alone: ordinary drain loops
//!   (`BenchConn::diesel_alone`), per row and in batches of 100;
//! - FQ, the fang job queue: its workers, in [`job_queue`].

pub mod django;
pub mod job_queue;

use std::time::Instant;

use crate::database::BenchDb;
use crate::db::BenchConn;
use crate::drain::{DrainRun, Mode};

/// What the workers of a peer that runs outside the drain loop did.
pub struct PeerOutcome {
    pub started: Instant,
    pub finished: Instant,
    pub processed: u64,
    pub statements: u64,
    /// PostgreSQL's commit count before the clock started.
    pub commits_before: Option<i64>,
    /// Transactions the workers ran after the drain, only to report (each
    /// flush of a connection's statistics, for one): left out of the commits.
    pub extra_commits: i64,
}

impl PeerOutcome {
    /// The drain's run, with the checks every drain ends with.
    pub fn into_run<C: BenchConn>(
        self,
        db: &mut BenchDb<C>,
        mode: Mode,
        workers: usize,
        rows: i64,
    ) -> Result<DrainRun, String> {
        let commits = match (self.commits_before, db.server_commits()?) {
            (Some(before), Some(after)) => (after - before - self.extra_commits).max(0) as u64,
            _ => 0,
        };
        Ok(DrainRun {
            backend: C::BACKEND,
            mode,
            workers,
            rows,
            elapsed: self.finished.saturating_duration_since(self.started),
            processed: self.processed,
            statements: self.statements,
            commits,
            aborted: 0,
            uncounted: false,
            checks: db.setup(|conn| conn.load_checks())?,
        })
    }
}
