//! What the workers on a pool, blocking and async, share: the stop and
//! wake-ups of their loops and listener, the turns they take to try for a
//! connection while connections fail, and their report.

use std::fmt::Display;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{Polling, StopHandle, NOTHING_PENDING, STOPPED};
use crate::trace::WorkerTrace;
use crate::{ClaimReport, RowFailure};

/// What a pooled worker's loops and its listener share.
pub(crate) struct Shared {
    /// The caller's stop.
    pub(crate) stop: StopHandle,
    /// Stops the loops and the listener when one loop ends on an error, or
    /// when the loops are done.
    pub(crate) halt: StopHandle,
    /// Bumped by the listener on every notification, and when it
    /// (re)connects, and by a loop whose connection answers again after
    /// failures: idle loops claim at once when it moves, and loops
    /// pausing after a failed connection try again at once.
    pub(crate) wakeups: AtomicU64,
    /// The last of the turns the loops and the listener take to try for
    /// a connection while connections fail (see [`Shared::retry_in`]).
    last_turn: Mutex<Option<Instant>>,
    /// Wakes async loops waiting for `wakeups` to move.
    #[cfg(feature = "async")]
    pub(crate) woken_up: tokio::sync::Notify,
}

impl Shared {
    pub(crate) fn new(polling: &Polling) -> Self {
        Shared {
            stop: polling.stop.clone(),
            halt: StopHandle::new(),
            wakeups: AtomicU64::new(0),
            last_turn: Mutex::new(None),
            #[cfg(feature = "async")]
            woken_up: tokio::sync::Notify::new(),
        }
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.is_stopped() || self.halt.is_stopped()
    }

    pub(crate) fn woken(&self) -> u64 {
        self.wakeups.load(Ordering::Acquire)
    }

    /// Wakes the loops waiting; returns the wake-ups so far, this one
    /// with them.
    pub(crate) fn wake(&self) -> u64 {
        let woken = self.wakeups.fetch_add(1, Ordering::AcqRel) + 1;
        #[cfg(feature = "async")]
        self.woken_up.notify_waiters();
        woken
    }

    /// How long to sleep before looking again, at most `step`, in a wait
    /// that ends at `deadline` or when woken past `seen`; `None` once over.
    pub(crate) fn next_step(
        &self,
        deadline: Instant,
        seen: u64,
        step: Duration,
    ) -> Option<Duration> {
        let left = deadline.saturating_duration_since(Instant::now());
        let over = left.is_zero() || self.stopping() || self.woken() != seen;
        (!over).then(|| left.min(step))
    }

    /// How long a loop or the listener whose connection failed waits
    /// before it tries again, its own `pause` being up: that pause, or
    /// less, until the worker's next turn. The turns are [`TRY_EVERY`]
    /// apart, one try each, and taken only by those whose own pause ends
    /// later: while the server is down, a worker tries about four times a
    /// second however many loops it has, and once the one that gets
    /// through wakes the others ([`Shared::wake`]), none waits out the
    /// rest of its pause.
    pub(crate) fn retry_in(&self, pause: Duration) -> Duration {
        let now = Instant::now();
        let mut last = self
            .last_turn
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let turn = last.map_or(now, |last| last + TRY_EVERY);
        let turn = turn.max(now + RECONNECT_PAUSES.0);
        if turn >= now + pause {
            return pause;
        }
        *last = Some(turn);
        turn - now
    }
}

/// The pause after a lost connection: the first, doubling up to the last
/// while connections keep failing.
pub(crate) const RECONNECT_PAUSES: (Duration, Duration) =
    (Duration::from_millis(50), Duration::from_secs(5));

/// How often a worker's loops, between them, try for a connection once
/// their own pauses are longer ([`Shared::retry_in`]): a server that is
/// back is tried within it, and one that is down gets about four tries
/// a second from a worker, however many loops it has.
///
/// A pool's own waits come on top, and a worker cannot shorten them:
/// r2d2 and bb8 make their connections in the background, retrying one
/// that failed after a pause doubling up to half their
/// `connection_timeout` (15 s by default), and a checkout (r2d2's
/// `get_timeout` too) only waits for those; deadpool connects within the
/// checkout. So a loop waiting in a checkout takes a connection as soon
/// as the pool has one, a loop pausing is woken by the first that gets
/// through, and what is left after a restart is the pool's own pause:
/// the guide asks for a `connection_timeout` of a second or two on a
/// worker's r2d2 or bb8 pool.
pub(crate) const TRY_EVERY: Duration = Duration::from_millis(250);

/// The pauses between attempts to get a working connection again.
pub(crate) struct Reconnect {
    next: Duration,
    /// The connections that failed since one last worked.
    failures: u32,
}

impl Reconnect {
    pub(crate) fn new() -> Self {
        Reconnect {
            next: RECONNECT_PAUSES.0,
            failures: 0,
        }
    }

    /// Whether connections failed since one last worked.
    pub(crate) fn failing(&self) -> bool {
        self.failures > 0
    }

    /// A connection worked: the next failure pauses briefly again. The
    /// connections that failed before it.
    pub(crate) fn mended(&mut self) -> u32 {
        self.next = RECONNECT_PAUSES.0;
        std::mem::take(&mut self.failures)
    }

    /// A connection failed: says that `what` failed, and returns how
    /// long to wait before the next try (see [`Shared::retry_in`]). Its
    /// own pause doubles the one after it.
    pub(crate) fn failed(
        &mut self,
        shared: &Shared,
        events: &WorkerTrace,
        what: &str,
        error: &dyn Display,
    ) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let pause = self.next;
        self.next = (pause * 2).min(RECONNECT_PAUSES.1);
        let pause = shared.retry_in(pause);
        events.reconnecting(what, error, pause);
        pause
    }
}

/// The report of a worker's loops and why they ended, or the first
/// error that ended one.
pub(crate) fn summed<K, E>(
    polling: &Polling,
    ended: impl IntoIterator<Item = Result<ClaimReport, RowFailure<K, E>>>,
) -> Result<(ClaimReport, &'static str), RowFailure<K, E>> {
    let mut total = ClaimReport::default();
    for ended in ended {
        total.add(&ended?);
    }
    let stopped = polling.stop.is_stopped() || !polling.until_empty;
    Ok((total, if stopped { STOPPED } else { NOTHING_PENDING }))
}
