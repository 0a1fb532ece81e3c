//! The claims' metrics without the `metrics` feature: they go nowhere, and
//! compile to nothing.

use std::time::Instant;

use crate::claim::report::Counts;

/// A claim's metrics, which go nowhere.
pub(crate) struct ClaimMetrics;

impl ClaimMetrics {
    pub(crate) fn new(_table: &str, _worker: Option<&str>) -> Self {
        ClaimMetrics
    }

    pub(crate) fn batch_ended(&mut self, _began: Instant, _so_far: Counts) {}

    pub(crate) fn claim_ended(&mut self, _began: Instant, _report: Counts, _polled: bool) {}

    #[cfg_attr(not(any(feature = "bb8", feature = "deadpool")), allow(dead_code))]
    pub(crate) fn failed_outside_the_claim(&mut self, _rows: u64) {}
}

/// The worker a claim runs in, which no pickup is recorded for.
pub(crate) struct InWorker;

impl InWorker {
    pub(crate) fn new(_worker: Option<&str>) -> Self {
        InWorker
    }

    pub(crate) fn around<T>(&self, f: impl FnOnce() -> T) -> T {
        f()
    }

    #[cfg(feature = "async")]
    pub(crate) fn around_polls<F: std::future::Future>(&self, future: F) -> F {
        future
    }
}
