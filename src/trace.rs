//! Spans and events, through `tracing` with the `tracing` feature, and nothing
//! without it: the macros below then expand to nothing (their arguments are
//! not even evaluated) and [`Span`] is an empty type whose methods do nothing,
//! so the drivers use them without a `cfg` of their own.
//!
//! Spans and events are made where they happen, so that their target is the
//! module's path (`diesel_claim::claim`, `diesel_claim::lease`, …); the guide
//! lists them (`guide#tracing`). The few events whose values nothing else
//! uses are functions here, so that nothing is left unused without the feature.

#[cfg(feature = "tracing")]
mod enabled {
    pub(crate) use tracing::field::Empty;
    #[cfg(feature = "async")]
    pub(crate) use tracing::Instrument;
    pub(crate) use tracing::Span;

    macro_rules! info_span { ($($arg:tt)*) => { ::tracing::info_span!($($arg)*) } }
    macro_rules! debug_span { ($($arg:tt)*) => { ::tracing::debug_span!($($arg)*) } }
    macro_rules! warning { ($($arg:tt)*) => { ::tracing::warn!($($arg)*) } }
    macro_rules! info { ($($arg:tt)*) => { ::tracing::info!($($arg)*) } }
    macro_rules! debug { ($($arg:tt)*) => { ::tracing::debug!($($arg)*) } }

    pub(crate) use {debug, debug_span, info, info_span, warning};

    /// A locking read met a row moved to another partition: its transaction
    /// runs again, for the `again`th time.
    pub(crate) fn moved_row(again: u32) {
        tracing::debug!(
            again,
            "a locked row moved to another partition: running the transaction again"
        );
    }

    /// A kept-alive lease's renewal failed (it is kept until its TTL runs out).
    pub(crate) fn renewal_failed(error: &dyn std::fmt::Display) {
        tracing::warn!(%error, "a lease renewal failed");
    }

    /// A worker's run was ended by a deadlock or a serialization failure of
    /// the crate's own statements; the worker goes on.
    pub(crate) fn passed_over_transient() {
        tracing::warn!(
            "a claim was rolled back by a deadlock or a serialization failure: running it again"
        );
    }

    /// A closure failed on `rows` rows of `table`, which the call passes over.
    pub(crate) fn passed_over(table: &str, rows: usize) {
        tracing::warn!(
            table,
            rows,
            "a closure failed: its rows are rolled back and passed over"
        );
    }
}

#[cfg(not(feature = "tracing"))]
mod disabled {
    /// A span that is never recorded.
    #[derive(Debug, Clone)]
    pub(crate) struct Span;

    impl Span {
        pub(crate) fn record<V>(&self, _field: &str, _value: V) -> &Self {
            self
        }

        pub(crate) fn in_scope<T>(&self, f: impl FnOnce() -> T) -> T {
            f()
        }

        pub(crate) fn enter(&self) -> Entered {
            Entered
        }
    }

    /// What entering a [`Span`] returns: nothing to leave.
    pub(crate) struct Entered;

    /// `tracing::Instrument`, leaving the future as it is.
    #[cfg(feature = "async")]
    pub(crate) trait Instrument: std::future::Future + Sized {
        fn instrument(self, _span: Span) -> Self {
            self
        }
    }

    #[cfg(feature = "async")]
    impl<F: std::future::Future> Instrument for F {}

    macro_rules! info_span {
        ($($arg:tt)*) => {
            $crate::trace::Span
        };
    }
    macro_rules! debug_span {
        ($($arg:tt)*) => {
            $crate::trace::Span
        };
    }
    macro_rules! warning {
        ($($arg:tt)*) => {};
    }
    macro_rules! info {
        ($($arg:tt)*) => {};
    }
    macro_rules! debug {
        ($($arg:tt)*) => {};
    }

    pub(crate) use {debug, debug_span, info, info_span, warning};

    pub(crate) fn moved_row(_again: u32) {}

    pub(crate) fn renewal_failed(_error: &dyn std::fmt::Display) {}

    pub(crate) fn passed_over(_table: &str, _rows: usize) {}

    pub(crate) fn passed_over_transient() {}
}

#[cfg(feature = "tracing")]
pub(crate) use enabled::*;

#[cfg(not(feature = "tracing"))]
pub(crate) use disabled::*;
