//! What a claim call reports: the engine counts, both drivers return it.

use crate::trace::Span;

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
    /// Rows whose closure failed (returned an error, or panicked) and whose
    /// transaction rolled back, with [`keep_going`](crate::ClaimBuilder::keep_going):
    /// left pending, never tried again in the same call. (Without it, the first
    /// failure ends the call. With a
    /// [visibility timeout](crate::ClaimBuilder::visibility_timeout), nothing
    /// rolls back: the row keeps its stamp until it passes.)
    pub failed: u64,
    /// Of the [`failed`](Self::failed) rows, those whose closure ran past
    /// the claim's [`timeout`](crate::ClaimBuilder::timeout).
    pub timed_out: u64,
    /// Candidates this call read and did not get to, because it had processed
    /// [`max_rows`](crate::ClaimBuilder::max_rows): left for the next call,
    /// not to others. (Also, rarely, a row of a failed batch that
    /// [`keep_going`](crate::ClaimBuilder::keep_going) could not claim again
    /// alone: one inserted since its page was read, in a claim ordered by
    /// other columns than the key.)
    pub not_reached: u64,
    /// Passes over the candidates (more than one only when draining).
    pub passes: u32,
}

impl ClaimReport {
    /// Adds what another call did to this report (a worker's calls).
    pub(crate) fn add(&mut self, other: &ClaimReport) {
        self.processed += other.processed;
        self.skipped += other.skipped;
        self.locked += other.locked;
        self.gone += other.gone;
        self.failed += other.failed;
        self.timed_out += other.timed_out;
        self.not_reached += other.not_reached;
        self.passes += other.passes;
    }

    /// The counts the claim's metrics take.
    pub(crate) fn counts(&self) -> Counts {
        Counts {
            processed: self.processed,
            failed: self.failed,
            timed_out: self.timed_out,
            gone: self.gone,
            locked: self.locked,
        }
    }
}

/// Everything one claim call did, failures included: returned by
/// [`each_outcome`](crate::ClaimBuilder::each_outcome) and its siblings, where
/// [`each`](crate::ClaimBuilder::each) returns only the report or the error.
///
/// `K` is the claimed table's primary key (a tuple for a composite key), `E`
/// the closure's error type.
#[derive(Debug)]
#[non_exhaustive]
pub struct ClaimOutcome<K, E> {
    /// What the call committed, counted up to where it ended, early or not.
    pub report: ClaimReport,
    /// The rows rolled back and passed over, in the order they failed, with
    /// [`keep_going`](crate::ClaimBuilder::keep_going).
    pub failed: Vec<RowFailure<K, E>>,
    /// What ended the call early, if anything did: a closure's failure (the
    /// keys its transaction rolled back), or an error outside any closure (a
    /// lost connection: no keys, or, once rows were handed over, theirs).
    pub stopped: Option<RowFailure<K, E>>,
    /// The call was ended by one of the crate's own statements failing in a
    /// way that running again mends (a deadlock, a serialization failure):
    /// its batch was rolled back, and a worker goes on.
    pub(crate) transient: bool,
}

/// A failure in a claim call, and the rows it rolled back.
#[derive(Debug)]
#[non_exhaustive]
pub struct RowFailure<K, E> {
    /// The keys of the rows whose transaction rolled back: the failing row's
    /// alone when claiming per row, or when
    /// [`keep_going`](crate::ClaimBuilder::keep_going) retried a failing batch
    /// row by row; when a batch failed and the call stopped, every row of it
    /// that the closure was given, up to the failing one (the rows after it
    /// never ran, and are taken again as any rolled-back row is). Empty when
    /// the error came from outside any closure before any row was handed
    /// over; after, the rows handed over (a failed commit, or the server
    /// ending the session under them).
    pub keys: Vec<K>,
    /// The error: the closure's own, or (for a panic, with `keep_going`)
    /// [`Error::ClosurePanicked`](crate::Error::ClosurePanicked) converted into
    /// it.
    pub error: E,
}

impl<K, E> RowFailure<K, E> {
    pub(crate) fn new(keys: Vec<K>, error: E) -> Self {
        RowFailure { keys, error }
    }
}

impl<K, E> ClaimOutcome<K, E> {
    /// A call refused before it claimed anything.
    pub(crate) fn refused(error: E) -> Self {
        ClaimOutcome {
            report: ClaimReport::default(),
            failed: Vec::new(),
            stopped: Some(RowFailure::new(Vec::new(), error)),
            transient: false,
        }
    }

    /// What a call did, once it has ended, recorded on its span
    /// (`Claim::span`).
    pub(crate) fn ended(
        report: ClaimReport,
        failed: Vec<RowFailure<K, E>>,
        stopped: Option<RowFailure<K, E>>,
        transient: bool,
        span: &Span,
    ) -> Self {
        let outcome = ClaimOutcome {
            transient: transient && stopped.is_some(),
            report,
            failed,
            stopped,
        };
        outcome.record(span);
        outcome
    }

    fn record(&self, span: &Span) {
        let report = &self.report;
        span.record("processed", report.processed)
            .record("skipped", report.skipped)
            .record("locked", report.locked)
            .record("gone", report.gone)
            .record("failed", report.failed)
            .record("timed_out", report.timed_out)
            .record("not_reached", report.not_reached)
            .record("passes", report.passes)
            .record("stopped", self.stopped.is_some());
    }

    /// The report, or the error that ended the call: what
    /// [`each`](crate::ClaimBuilder::each) returns. Failures passed over with
    /// [`keep_going`](crate::ClaimBuilder::keep_going) are counted in the
    /// report, their errors dropped.
    pub fn into_result(self) -> Result<ClaimReport, E> {
        match self.stopped {
            Some(failure) => Err(failure.error),
            None => Ok(self.report),
        }
    }
}

/// What a claim call has counted so far, as its metrics take it: the
/// [`ClaimReport`]'s counts (never smaller than before).
#[derive(Debug, Clone, Copy, Default)]
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) struct Counts {
    pub(crate) processed: u64,
    pub(crate) failed: u64,
    pub(crate) timed_out: u64,
    pub(crate) gone: u64,
    pub(crate) locked: u64,
}
