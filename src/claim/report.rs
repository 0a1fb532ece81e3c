//! What a claim call reports: the engine counts, both drivers return it.

/// What one call of [`claim_each`](crate::ClaimDsl::claim_each) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimReport {
    /// Rows the closure processed and whose transaction committed.
    pub processed: u64,
    /// Candidates this call read and did not process: [`locked`](Self::locked)
    /// plus [`gone`](Self::gone). (Rows a locking statement passes over past
    /// the candidates read are not counted.)
    pub skipped: u64,
    /// Candidates locked by someone else when this call came to them, and
    /// still matching the query after: left to others, or to the next call.
    /// (With [`drain`](crate::ClaimBuilder::drain), those still locked in the
    /// last pass.) Always 0 on SQLite, whose claims take turns.
    pub locked: u64,
    /// Candidates no longer matching the query when this call came to lock
    /// them: processed by another worker, or changed, since they were read.
    pub gone: u64,
    /// Candidates this call read and did not get to, because it had processed
    /// [`max_rows`](crate::ClaimBuilder::max_rows): left for the next call,
    /// not to others.
    pub not_reached: u64,
    /// Passes over the candidates (more than one only when draining).
    pub passes: u32,
}
