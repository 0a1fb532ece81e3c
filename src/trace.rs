//! Spans and events, through `tracing` with the `tracing` feature, and nothing
//! without it: the macros below then expand to nothing (their arguments are
//! not even evaluated) and [`Span`] is an empty type whose methods do nothing,
//! so the drivers use them without a `cfg` of their own.
//!
//! Spans and events are made where they happen, so that their target is the
//! module's path (`diesel_claim::claim`, `diesel_claim::lease`, …); the guide
//! lists them (`guide::tracing`). The few events whose values nothing else
//! uses are functions here, so that nothing is left unused without the feature,
//! and so are a worker's events ([`WorkerTrace`]): its table and its name,
//! its progress since it last reported, and what became of its connections.
//! Those name the target of what they are about, not this module's.
//!
//! Events name the table and the keys of the rows they are about (and a
//! worker's, the worker), so that a line read on its own, without the spans
//! around it, says what happened.

#[cfg(feature = "tracing")]
mod enabled {
    pub(crate) use tracing::field::Empty;
    #[cfg(feature = "async")]
    pub(crate) use tracing::Instrument;
    pub(crate) use tracing::Span;

    macro_rules! info_span { ($($arg:tt)*) => { ::tracing::info_span!($($arg)*) } }
    macro_rules! debug_span { ($($arg:tt)*) => { ::tracing::debug_span!($($arg)*) } }
    macro_rules! trace_span { ($($arg:tt)*) => { ::tracing::trace_span!($($arg)*) } }
    macro_rules! warning { ($($arg:tt)*) => { ::tracing::warn!($($arg)*) } }
    macro_rules! info { ($($arg:tt)*) => { ::tracing::info!($($arg)*) } }
    macro_rules! debug { ($($arg:tt)*) => { ::tracing::debug!($($arg)*) } }

    pub(crate) use {debug, debug_span, info, info_span, trace_span, warning};

    use std::fmt::{self, Debug, Display};
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    use crate::claim::worker::Labels;

    /// The targets of the events made here rather than where they happen:
    /// the module a user filters on for them, not this one's.
    const CLAIM: &str = "diesel_claim::claim";
    const LEASE: &str = "diesel_claim::lease";
    /// A worker's, its span's too (the span is made where its options are).
    pub(crate) const WORKER: &str = "diesel_claim::worker";

    /// A locking read met a row moved to another partition: its transaction
    /// runs again, for the `again`th time.
    pub(crate) fn moved_row(again: u32) {
        tracing::debug!(
            target: CLAIM,
            again,
            "a locked row moved to another partition: running the transaction again"
        );
    }

    /// A renewal of the kept-alive lease `name` (`token`) failed with
    /// `error`; the lease counts as held until its TTL runs out.
    pub(crate) fn renewal_failed(name: &str, token: i64, error: &dyn std::fmt::Display) {
        tracing::warn!(target: LEASE, name, token, %error, "a lease renewal failed");
    }

    /// The kept-alive lease `name` (`token`) is lost, `why` (a renewal's
    /// error, or its TTL passed on the local clock).
    pub(crate) fn lease_lost(name: &str, token: i64, why: &dyn std::fmt::Display) {
        tracing::warn!(
            target: LEASE,
            name,
            token,
            error = %why,
            "a kept-alive lease was lost: the closure no longer holds it"
        );
    }

    /// A renewal of the kept-alive lease `name` (`token`) was still running
    /// when its closure ended, and was left to end on its own.
    pub(crate) fn renewal_abandoned(name: &str, token: i64) {
        tracing::warn!(
            target: LEASE,
            name,
            token,
            "a lease renewal was still running when the closure ended: left to finish on its own"
        );
    }

    /// A closure failed on the rows at `keys` of `table`, which the call
    /// (of the `worker` named, if a worker's) passes over; `error` is the
    /// closure's, where its type can show it.
    pub(crate) fn passed_over<K: Debug>(
        table: &str,
        worker: Option<&str>,
        keys: &[K],
        error: Option<&dyn Display>,
    ) {
        tracing::warn!(
            target: CLAIM,
            table,
            worker,
            keys = %KeyList(keys),
            rows = keys.len(),
            error = error.map(tracing::field::display),
            "a closure failed: its rows are rolled back and passed over"
        );
    }

    /// The closure on the rows at `keys` of `table` ran past the claim's
    /// `timeout`, in the call (of the `worker` named, if a worker's).
    pub(crate) fn ran_late<K: Debug>(
        table: &str,
        worker: Option<&str>,
        keys: &[K],
        timeout: Duration,
    ) {
        tracing::warn!(
            target: CLAIM,
            table,
            worker,
            keys = %KeyList(keys),
            rows = keys.len(),
            ?timeout,
            "a closure ran past its timeout: its work is rolled back"
        );
    }

    /// The row at `key` of `table` failed for the `attempts`th time, its
    /// last under its retry schedule, in the call (of the `worker` named, if
    /// a worker's): a dead letter, out of the queue.
    pub(crate) fn dead_letter<K: Debug>(table: &str, worker: Option<&str>, key: &K, attempts: u32) {
        tracing::error!(
            target: CLAIM,
            table,
            worker,
            key = ?key,
            attempts,
            "a job used its last attempt: it is a dead letter, out of the queue"
        );
    }

    /// Keys as an event shows them: `[3, 7]`, the first few of a long list.
    struct KeyList<'a, K>(&'a [K]);

    /// The keys an event shows, at most.
    const KEYS_SHOWN: usize = 10;

    impl<K: Debug> Display for KeyList<'_, K> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("[")?;
            for (index, key) in self.0.iter().take(KEYS_SHOWN).enumerate() {
                if index > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{key:?}")?;
            }
            if self.0.len() > KEYS_SHOWN {
                write!(f, ", … {} in all", self.0.len())?;
            }
            f.write_str("]")
        }
    }

    /// A worker's events: its table and its name on every one, and its
    /// progress, reported at `info` every `every` (rows processed and failed,
    /// time idle) by whichever of its loops notices the interval has passed.
    pub(crate) struct WorkerTrace {
        table: String,
        worker: String,
        every: Duration,
        loops: u32,
        interval: Mutex<Interval>,
    }

    /// What a worker did since it last reported.
    struct Interval {
        began: Instant,
        processed: u64,
        failed: u64,
        /// Summed over the worker's loops.
        idle: Duration,
    }

    impl WorkerTrace {
        /// The events of a worker (its table, its name) with `loops` claim
        /// loops, reporting its progress every `every`.
        pub(crate) fn new(labels: Labels, every: Duration, loops: usize) -> Self {
            WorkerTrace {
                table: labels.table,
                worker: labels.name,
                every,
                loops: u32::try_from(loops.max(1)).unwrap_or(u32::MAX),
                interval: Mutex::new(Interval {
                    began: Instant::now(),
                    processed: 0,
                    failed: 0,
                    idle: Duration::ZERO,
                }),
            }
        }

        /// The worker starts.
        pub(crate) fn started(
            &self,
            channel: Option<&str>,
            (min_poll, max_poll): (Duration, Duration),
        ) {
            tracing::info!(
                target: WORKER,
                table = self.table,
                worker = self.worker,
                loops = self.loops,
                channel,
                ?min_poll,
                ?max_poll,
                progress_every = ?self.every,
                "a worker starts"
            );
        }

        /// A claim of the worker ran: `processed` rows committed, `failed`
        /// passed over.
        pub(crate) fn ran(&self, processed: u64, failed: u64) {
            let mut interval = self.interval();
            interval.processed += processed;
            interval.failed += failed;
            self.report_if_due(&mut interval);
        }

        /// A loop of the worker waited `idle` for rows.
        pub(crate) fn idled(&self, idle: Duration) {
            let mut interval = self.interval();
            interval.idle += idle;
            self.report_if_due(&mut interval);
        }

        fn interval(&self) -> std::sync::MutexGuard<'_, Interval> {
            // Counts are all a panicking loop could have left half-done.
            self.interval
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        }

        fn report_if_due(&self, interval: &mut Interval) {
            let over = interval.began.elapsed();
            if over < self.every {
                return;
            }
            // Per loop: a worker idle all along was idle for `over`.
            let idle = interval.idle / self.loops;
            tracing::info!(
                target: WORKER,
                table = self.table,
                worker = self.worker,
                processed = interval.processed,
                failed = interval.failed,
                idle = ?Rounded(idle),
                over = ?Rounded(over),
                "worker progress"
            );
            *interval = Interval {
                began: Instant::now(),
                processed: 0,
                failed: 0,
                idle: Duration::ZERO,
            };
        }

        /// A closure failed on the rows at `keys`, which the worker passes
        /// over (`keep_going`, a failure hook) and backs off from.
        pub(crate) fn passed_over<K: Debug>(&self, keys: &[K], error: &dyn Display) {
            passed_over(&self.table, Some(&self.worker), keys, Some(error));
        }

        /// A claim was rolled back by a deadlock or a serialization failure of
        /// the crate's own statements (`error`): the worker runs it again.
        pub(crate) fn rolled_back(&self, error: &dyn Display) {
            tracing::warn!(
                target: WORKER,
                table = self.table,
                worker = self.worker,
                %error,
                "a claim was rolled back by a deadlock or a serialization failure: running it again"
            );
        }

        /// The worker stops: stopped, or with nothing pending; `processed`
        /// and `failed` in all.
        pub(crate) fn stopped(&self, why: &str, processed: u64, failed: u64) {
            tracing::info!(
                target: WORKER,
                table = self.table,
                worker = self.worker,
                why,
                processed,
                failed,
                "a worker stops"
            );
        }

        /// The worker stops on `error`, which ended a claim that rolled back
        /// the rows at `keys` (none for an error outside any closure).
        pub(crate) fn failed<K: Debug>(&self, keys: &[K], error: &dyn Display) {
            tracing::warn!(
                target: WORKER,
                table = self.table,
                worker = self.worker,
                keys = %KeyList(keys),
                %error,
                "a worker stops on an error"
            );
        }
    }

    /// The events of a worker on a pool alone (unused without a pool's
    /// feature).
    #[cfg_attr(
        not(any(
            feature = "postgres",
            feature = "sqlite",
            feature = "mysql",
            feature = "bb8",
            feature = "deadpool"
        )),
        allow(dead_code)
    )]
    impl WorkerTrace {
        /// The transaction of the rows at `keys` outlived its idle bound
        /// (`error`): the server ended its session while the job ran.
        #[cfg_attr(not(any(feature = "bb8", feature = "deadpool")), allow(dead_code))]
        pub(crate) fn bound_fired<K: Debug>(&self, keys: &[K], error: &dyn Display) {
            tracing::error!(
                target: WORKER,
                table = self.table,
                worker = self.worker,
                keys = %KeyList(keys),
                %error,
                "a job outlived its transaction's idle bound: its work was rolled back, its row \
                 freed while it ran (another worker may have started it again), and its \
                 failure is recorded on another connection if it still can be"
            );
        }

        /// The failure of the rows at `keys`, whose session ended under
        /// them, could not be recorded (`error`).
        #[cfg_attr(not(any(feature = "bb8", feature = "deadpool")), allow(dead_code))]
        pub(crate) fn unrecorded<K: Debug>(&self, keys: &[K], error: &dyn Display) {
            tracing::warn!(
                target: WORKER,
                table = self.table,
                worker = self.worker,
                keys = %KeyList(keys),
                %error,
                "the failure of a job whose session ended under it could not be recorded"
            );
        }

        /// A connection of a worker on a pool failed (`what` failed): it
        /// tries again on another after `pause`.
        pub(crate) fn reconnecting(&self, what: &str, error: &dyn Display, pause: Duration) {
            tracing::warn!(
                target: WORKER,
                table = self.table,
                worker = self.worker,
                %error,
                ?pause,
                "{what}: trying again on another connection"
            );
        }

        /// The worker's claims work again after `failures` failed
        /// connections.
        pub(crate) fn reconnected(&self, failures: u32) {
            tracing::info!(
                target: WORKER,
                table = self.table,
                worker = self.worker,
                failures,
                "a worker's claims have a working connection again"
            );
        }

        /// The worker's listener listens on `channel`, after `failures`
        /// failed connections.
        pub(crate) fn listening(&self, channel: &str, failures: u32) {
            tracing::info!(
                target: WORKER,
                table = self.table,
                worker = self.worker,
                channel,
                failures,
                "a worker listens for notifications"
            );
        }
    }

    /// The subscriber of the thread that started a worker, for the threads
    /// the worker starts: a subscriber set for the caller's thread alone
    /// (`tracing::subscriber::with_default`) sees what they do too.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) struct CallersSubscriber(tracing::Dispatch);

    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    impl CallersSubscriber {
        pub(crate) fn of_this_thread() -> Self {
            CallersSubscriber(tracing::dispatcher::get_default(Clone::clone))
        }

        /// Runs `f` in `span`, with the caller's subscriber as this thread's.
        pub(crate) fn in_span<T>(&self, span: &Span, f: impl FnOnce() -> T) -> T {
            tracing::dispatcher::with_default(&self.0, || span.in_scope(f))
        }
    }

    /// A duration to the millisecond, as a progress line shows it.
    struct Rounded(Duration);

    impl Debug for Rounded {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            let millis = self.0.as_millis().min(u64::MAX.into()) as u64;
            Debug::fmt(&Duration::from_millis(millis), f)
        }
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

    /// No subscriber to carry to a worker's threads.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) struct CallersSubscriber;

    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    impl CallersSubscriber {
        pub(crate) fn of_this_thread() -> Self {
            CallersSubscriber
        }

        pub(crate) fn in_span<T>(&self, _span: &Span, f: impl FnOnce() -> T) -> T {
            f()
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
    macro_rules! trace_span {
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

    pub(crate) use {debug, debug_span, info, info_span, trace_span, warning};

    use std::fmt::{Debug, Display};
    use std::time::Duration;

    use crate::claim::worker::Labels;

    pub(crate) fn moved_row(_again: u32) {}

    pub(crate) fn renewal_failed(_name: &str, _token: i64, _error: &dyn std::fmt::Display) {}

    pub(crate) fn lease_lost(_name: &str, _token: i64, _why: &dyn std::fmt::Display) {}

    pub(crate) fn renewal_abandoned(_name: &str, _token: i64) {}

    pub(crate) fn passed_over<K: Debug>(
        _table: &str,
        _worker: Option<&str>,
        _keys: &[K],
        _error: Option<&dyn Display>,
    ) {
    }

    pub(crate) fn ran_late<K: Debug>(
        _table: &str,
        _worker: Option<&str>,
        _keys: &[K],
        _timeout: Duration,
    ) {
    }

    pub(crate) fn dead_letter<K: Debug>(
        _table: &str,
        _worker: Option<&str>,
        _key: &K,
        _attempts: u32,
    ) {
    }

    /// A worker's events, which go nowhere.
    pub(crate) struct WorkerTrace;

    impl WorkerTrace {
        pub(crate) fn new(_labels: Labels, _every: Duration, _loops: usize) -> Self {
            WorkerTrace
        }

        pub(crate) fn started(&self, _channel: Option<&str>, _polls: (Duration, Duration)) {}

        pub(crate) fn ran(&self, _processed: u64, _failed: u64) {}

        pub(crate) fn idled(&self, _idle: Duration) {}

        pub(crate) fn passed_over<K: Debug>(&self, _keys: &[K], _error: &dyn Display) {}

        pub(crate) fn rolled_back(&self, _error: &dyn Display) {}

        pub(crate) fn stopped(&self, _why: &str, _processed: u64, _failed: u64) {}

        pub(crate) fn failed<K: Debug>(&self, _keys: &[K], _error: &dyn Display) {}
    }

    #[cfg_attr(
        not(any(
            feature = "postgres",
            feature = "sqlite",
            feature = "mysql",
            feature = "bb8",
            feature = "deadpool"
        )),
        allow(dead_code)
    )]
    impl WorkerTrace {
        #[cfg_attr(not(any(feature = "bb8", feature = "deadpool")), allow(dead_code))]
        pub(crate) fn bound_fired<K: Debug>(&self, _keys: &[K], _error: &dyn Display) {}

        #[cfg_attr(not(any(feature = "bb8", feature = "deadpool")), allow(dead_code))]
        pub(crate) fn unrecorded<K: Debug>(&self, _keys: &[K], _error: &dyn Display) {}

        pub(crate) fn reconnecting(&self, _what: &str, _error: &dyn Display, _pause: Duration) {}

        pub(crate) fn reconnected(&self, _failures: u32) {}

        pub(crate) fn listening(&self, _channel: &str, _failures: u32) {}
    }
}

#[cfg(feature = "tracing")]
pub(crate) use enabled::*;

#[cfg(not(feature = "tracing"))]
pub(crate) use disabled::*;
