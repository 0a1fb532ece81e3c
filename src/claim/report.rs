//! What a claim call reports: the engine counts, both drivers return it.

/// What one call of [`claim_each`](crate::ClaimDsl::claim_each) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimReport {
    /// Rows the closure processed and whose transaction committed.
    pub processed: u64,
    /// Candidates this call read and did not process: locked by someone else, or
    /// no longer matching the query when it came to lock them. (Rows a locking
    /// statement passes over past the candidates read are not counted.)
    pub skipped: u64,
    /// Candidates this call read and did not get to, because it had processed
    /// [`max_rows`](crate::ClaimBuilder::max_rows): left for the next call,
    /// not to others.
    pub not_reached: u64,
    /// Passes over the candidates (more than one only when draining).
    pub passes: u32,
}
