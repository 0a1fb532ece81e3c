//! Named leases: a lock on a name, held across processes and machines, that
//! expires by the database clock and fences stale holders with a token.

use std::fmt::{self, Display};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::LoadConnection;

use crate::backend::{strategy::Strategy, ClaimBackend, LeaseStatement};
use crate::connection::{BlockingConnection, RenewingConnection};
use crate::trace::{self, Span};
use crate::transaction::transaction_depth;
use crate::Error;

/// The span of a lease held for a closure (`with_lease`,
/// `with_lease_kept_alive`, blocking or async).
macro_rules! lease_span {
    ($name:expr, $ttl:expr) => {
        $crate::trace::info_span!(
            "lease",
            name = $name,
            ttl = ?$ttl,
            token = $crate::trace::Empty,
            outcome = $crate::trace::Empty,
        )
    };
}
// The async API's leases make it too.
#[cfg_attr(not(feature = "async"), allow(unused_imports))]
pub(crate) use lease_span;

/// The longest accepted lease name, in bytes.
pub const MAX_NAME_LEN: usize = 255;

/// The longest accepted time to live: one week.
pub const MAX_TTL: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// A lease this process holds on a name, until it expires or is released.
///
/// The [`token`](Lease::token) strictly increases with every acquisition of the
/// same name, across releases and expiries: pass it along with writes the lease
/// protects and have them rejected when a newer token has been seen (fencing), so
/// a holder that stalled past its TTL cannot overwrite its successor's work.
///
/// ```
/// # include!("doctest_setup.rs");
/// use std::time::Duration;
/// use diesel_claim::{Error, Lease};
///
/// # fn main() -> Result<(), Error> {
/// # let mut conn = establish_connection();
/// let ttl = Duration::from_secs(30);
/// let lease = Lease::acquire(&mut conn, "nightly-report", ttl)?.expect("nobody else holds it");
/// assert!(Lease::acquire(&mut conn, "nightly-report", ttl)?.is_none());
///
/// lease.renew(&mut conn, ttl)?; // a long job keeps it alive
/// let token = lease.token();
/// lease.release(&mut conn)?;
///
/// let next = Lease::acquire(&mut conn, "nightly-report", ttl)?.unwrap();
/// assert!(next.token() > token);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a lease is held until it expires or is released"]
pub struct Lease {
    name: String,
    token: i64,
}

impl Lease {
    /// The leased name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fencing token of this acquisition.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// The statement that takes the lease on `name` for `ttl`, checked, on a
    /// connection `transaction_depth` transactions deep.
    pub(crate) fn acquiring(
        name: &str,
        ttl: Duration,
        transaction_depth: u32,
    ) -> Result<LeaseStatement<'_>, Error> {
        check_name(name)?;
        no_transaction(transaction_depth)?;
        Ok(LeaseStatement::Acquire {
            name,
            ttl_micros: ttl_micros(ttl)?,
        })
    }

    /// The lease an acquiring statement took, if it took one.
    pub(crate) fn acquired(name: &str, token: Option<i64>, span: &Span) -> Option<Self> {
        span.record("token", token).record(
            "outcome",
            match token {
                Some(_) => "acquired",
                None => "held by another",
            },
        );
        token.map(|token| Lease {
            name: name.to_owned(),
            token,
        })
    }

    pub(crate) fn renewing(
        &self,
        ttl: Duration,
        transaction_depth: u32,
    ) -> Result<LeaseStatement<'_>, Error> {
        no_transaction(transaction_depth)?;
        Ok(LeaseStatement::Expire {
            name: &self.name,
            token: self.token,
            after_micros: ttl_micros(ttl)?,
        })
    }

    /// The span of a renewal of this lease.
    pub(crate) fn span_renewing(&self) -> Span {
        trace::debug_span!(
            "renew_lease",
            name = self.name,
            token = self.token,
            outcome = trace::Empty,
        )
    }

    /// The span of the release of this lease.
    pub(crate) fn span_releasing(&self) -> Span {
        trace::debug_span!(
            "release_lease",
            name = self.name,
            token = self.token,
            outcome = trace::Empty,
        )
    }

    pub(crate) fn releasing(&self, transaction_depth: u32) -> Result<LeaseStatement<'_>, Error> {
        no_transaction(transaction_depth)?;
        // Released: expiring now, so that the row keeps its token.
        Ok(LeaseStatement::Expire {
            name: &self.name,
            token: self.token,
            after_micros: 0,
        })
    }

    /// Whether a renewing or releasing statement found the lease still ours.
    /// The answer to a renewal or release (`done`), recorded on its span.
    pub(crate) fn answered(
        &self,
        token: Option<i64>,
        span: &Span,
        done: &'static str,
    ) -> Result<(), Error> {
        span.record("outcome", if token.is_some() { done } else { "lost" });
        self.owned(token)
    }

    pub(crate) fn owned(&self, token: Option<i64>) -> Result<(), Error> {
        match token {
            Some(_) => Ok(()),
            None => Err(Error::NotLeaseOwner {
                name: self.name.clone(),
                token: self.token,
            }),
        }
    }
}

impl Lease {
    /// Takes the lease on `name` for `ttl` if it is free or its last holder's lease
    /// has expired; `Ok(None)` if someone else holds it.
    ///
    /// Outside a transaction only ([`Error::InvalidArgument`] inside one), so that
    /// others see the lease at once and its token is never handed out twice.
    pub fn acquire<C, Inferred>(
        conn: &mut C,
        name: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, Error>
    where
        C: BlockingConnection<Inferred>,
    {
        let span = trace::debug_span!(
            "acquire_lease",
            name,
            ttl = ?ttl,
            token = trace::Empty,
            outcome = trace::Empty,
        );
        let _entered = span.enter();
        let statement = Lease::acquiring(name, ttl, transaction_depth(conn)?)?;
        let token = <C::Backend as Strategy>::lease_statement(conn, statement)?;
        Ok(Lease::acquired(name, token, &span))
    }

    /// Takes the lease on `name` for `ttl`, waiting up to `patience` for its
    /// holder to release it or let it expire; [`Error::LeaseHeld`] if it is still
    /// held by then.
    ///
    /// Waiting is polling, from every 5 ms up to every 100 ms: fine for a lock
    /// held for a request or a job, not a queue for many waiters. A `patience`
    /// of `Duration::MAX` waits without a deadline.
    pub fn acquire_within<C, Inferred>(
        conn: &mut C,
        name: &str,
        ttl: Duration,
        patience: Duration,
    ) -> Result<Lease, Error>
    where
        C: BlockingConnection<Inferred>,
    {
        let mut patience = Patience::new(patience);
        loop {
            if let Some(lease) = Lease::acquire(conn, name, ttl)? {
                return Ok(lease);
            }
            thread::sleep(patience.pause(name)?);
        }
    }

    /// Extends the lease to `ttl` from now (by the database clock).
    ///
    /// [`Error::NotLeaseOwner`] if it has expired, even if nobody took it since.
    pub fn renew<C, Inferred>(&self, conn: &mut C, ttl: Duration) -> Result<(), Error>
    where
        C: BlockingConnection<Inferred>,
    {
        let span = self.span_renewing();
        let _entered = span.enter();
        let statement = self.renewing(ttl, transaction_depth(conn)?)?;
        let renewed = <C::Backend as Strategy>::lease_statement(conn, statement)?;
        self.answered(renewed, &span, "renewed")
    }

    /// Ends the lease so others can take it at once.
    ///
    /// [`Error::NotLeaseOwner`] if it had already expired: what it protected may
    /// have been done concurrently by a newer holder.
    pub fn release<C, Inferred>(self, conn: &mut C) -> Result<(), Error>
    where
        C: BlockingConnection<Inferred>,
    {
        let span = self.span_releasing();
        let _entered = span.enter();
        let statement = self.releasing(transaction_depth(conn)?)?;
        let released = <C::Backend as Strategy>::lease_statement(conn, statement)?;
        self.answered(released, &span, "released")
    }
}

/// How long [`Lease::acquire_within`] waits between attempts, and until when.
pub(crate) struct Patience {
    deadline: Option<Instant>,
    next: Duration,
}

impl Patience {
    pub(crate) fn new(patience: Duration) -> Self {
        Patience {
            // A patience too long for an `Instant` (`Duration::MAX`) has no
            // deadline.
            deadline: Instant::now().checked_add(patience),
            next: Duration::from_millis(5),
        }
    }

    /// The pause before the next attempt on `name`; [`Error::LeaseHeld`] when
    /// patience has run out.
    pub(crate) fn pause(&mut self, name: &str) -> Result<Duration, Error> {
        let left = self.deadline.map_or(Duration::MAX, |deadline| {
            deadline.saturating_duration_since(Instant::now())
        });
        if left.is_zero() {
            return Err(Error::LeaseHeld {
                name: name.to_owned(),
            });
        }
        let pause = self.next.min(left);
        self.next = (self.next * 2).min(Duration::from_millis(100));
        Ok(pause)
    }
}

/// Runs `f` while holding the lease on `name`, or returns `Ok(None)` at once if
/// someone else holds it.
///
/// The lease is released when `f` returns or panics. If it expired while `f`
/// ran, the result is [`Error::NotLeaseOwner`] (converted into `E`) even when `f`
/// succeeded: the critical section may not have been exclusive. An error from
/// `f` is returned as it is, after the release; if that release fails too (the
/// connection died, say), the lease is left to expire at its TTL. `f` must not
/// leave a transaction open: the release would then be refused.
///
/// ```text
/// with_lease(&mut conn, "signup:alice", Duration::from_secs(10), |conn, lease| { … })
/// ```
pub fn with_lease<C, T, E, F, Inferred>(
    conn: &mut C,
    name: &str,
    ttl: Duration,
    f: F,
) -> Result<Option<T>, E>
where
    C: BlockingConnection<Inferred>,
    F: FnOnce(&mut C, &Lease) -> Result<T, E>,
    E: From<Error>,
{
    let span = lease_span!(name, ttl);
    let _entered = span.enter();
    let Some(lease) = Lease::acquire(conn, name, ttl)? else {
        span.record("outcome", "held by another");
        return Ok(None);
    };
    span.record("token", lease.token());
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| f(&mut *conn, &lease)));
    let released = lease.release(conn);
    lease_outcome(outcome, released, &span)
}

/// A lease kept alive while a closure runs, by [`with_lease_kept_alive`]: the
/// closure asks it whether the lease is still held.
///
/// The lease counts as lost once its TTL has passed, on this process's
/// monotonic clock, since the start of the last renewal that worked (or of
/// the acquisition), less a thousandth of the TTL for the clocks' drift
/// (see [`with_lease_kept_alive`]); or as soon as a renewal finds it is no
/// longer ours. Once lost, it stays lost.
#[derive(Debug)]
pub struct KeptLease {
    lease: Lease,
    ttl: Duration,
    /// When the lease may have expired, by the local clock: the start of the
    /// last renewal that worked, plus the TTL less the drift allowance.
    expires: Mutex<Instant>,
    lost: AtomicBool,
}

impl KeptLease {
    /// `lease`, taken for `ttl` by a statement sent at `acquiring`.
    pub(crate) fn new(lease: Lease, ttl: Duration, acquiring: Instant) -> Self {
        KeptLease {
            lease,
            ttl,
            expires: Mutex::new(Self::expiry(acquiring, ttl)),
            lost: AtomicBool::new(false),
        }
    }

    /// The leased name.
    pub fn name(&self) -> &str {
        self.lease.name()
    }

    /// The fencing token of this acquisition: pass it with the writes the lease
    /// protects, which stays the guarantee (see [`Lease`]).
    pub fn token(&self) -> i64 {
        self.lease.token()
    }

    /// Whether the lease is lost: a renewal found it is someone else's, or
    /// its TTL has passed on the local clock since the start of the last
    /// renewal that worked, whatever the renewing is doing meanwhile (a
    /// renewal stuck on a dead link counts for nothing). Someone else may
    /// own the lease now, and the work should stop.
    pub fn is_lost(&self) -> bool {
        if self.lost.load(Ordering::Acquire) {
            return true;
        }
        let expires = self.expires.lock().unwrap_or_else(PoisonError::into_inner);
        if Instant::now() >= *expires {
            self.lose(&TtlPassed(self.ttl));
        }
        self.lost.load(Ordering::Acquire)
    }

    /// [`Error::NotLeaseOwner`] once the lease [is lost](Self::is_lost): call
    /// it between steps of the work, with `?`.
    pub fn ensure_held(&self) -> Result<(), Error> {
        match self.is_lost() {
            true => self.lease.owned(None),
            false => Ok(()),
        }
    }

    pub(crate) fn lease(&self) -> &Lease {
        &self.lease
    }

    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How often the lease is renewed: three times per TTL, so that one failed
    /// renewal (a network blip) still leaves time for the next.
    pub(crate) fn period(ttl: Duration) -> Duration {
        ttl / 3
    }

    /// How long a renewal still running when the closure ends is waited for
    /// before it is left to finish on its own: a third of the TTL or a
    /// second, whichever is shorter. A renewal on a working link takes
    /// milliseconds.
    pub(crate) fn grace(ttl: Duration) -> Duration {
        Self::period(ttl).min(Duration::from_secs(1))
    }

    /// When a lease taken or renewed for `ttl` by a statement sent at
    /// `started` may have expired, by the local clock.
    ///
    /// The database counts the TTL from when the statement runs, which is
    /// after it was sent: `started + ttl` comes first in real time, as long
    /// as both clocks run at the same rate. They may not quite: NTP slews a
    /// clock by at most 500 ppm, so two differ by at most a thousandth.
    fn expiry(started: Instant, ttl: Duration) -> Instant {
        started + (ttl - ttl / 1000)
    }

    /// Records that the lease is lost, `why`, once.
    fn lose(&self, why: &dyn Display) {
        if !self.lost.swap(true, Ordering::AcqRel) {
            trace::lease_lost(self.name(), self.token(), why);
        }
    }

    /// Records what a renewal sent at `started` returned; whether the
    /// renewing goes on. A renewal that worked but came back after the local
    /// expiry does not win the lease back: the closure may have been told.
    pub(crate) fn renewed(&self, renewed: Result<(), Error>, started: Instant) -> bool {
        match renewed {
            Ok(()) => {
                let mut expires = self.expires.lock().unwrap_or_else(PoisonError::into_inner);
                if Instant::now() >= *expires {
                    self.lose(&TtlPassed(self.ttl));
                } else {
                    *expires = Self::expiry(started, self.ttl);
                }
            }
            Err(error @ Error::NotLeaseOwner { .. }) => self.lose(&error),
            Err(error) => trace::renewal_failed(self.name(), self.token(), &error),
        }
        !self.is_lost()
    }
}

/// Why a kept lease was lost when no renewal said so.
struct TtlPassed(Duration);

impl Display for TtlPassed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "its TTL of {:?} passed without a renewal that worked",
            self.0
        )
    }
}

/// Runs `f` while holding the lease on `name`, renewed in the background so
/// that it outlives its `ttl` for as long as `f` runs; `Ok(None)` at once if
/// someone else holds it.
///
/// A thread renews the lease every third of its TTL on `renewer`, a second
/// connection (a pooled one, say), which it owns: `conn` stays `f`'s alone,
/// free to run long statements and transactions. The renewing stops when `f`
/// returns or panics, and the lease is then released on `conn`, as
/// [`with_lease`] does, with the same outcomes.
///
/// The lease is lost — `f` is told through [`KeptLease::is_lost`] and
/// [`KeptLease::ensure_held`], and should stop, as another holder may be at
/// work — when a renewal finds it is someone else's, or when its TTL has
/// passed on this process's monotonic clock since the start of the last
/// renewal that worked (or of the acquisition), whatever the renewal under
/// way is doing: one stuck on a dead link does not keep the lease "held".
/// The database counts the TTL from when the statement ran, later than it
/// was sent, so the closure is told before a successor can take the lease;
/// a thousandth of the TTL is taken off for the two clocks' rates, which NTP
/// keeps within that. A step of the database server's wall clock is not
/// covered: a leap forward there expires every lease early.
///
/// When `f` ends, the call waits for a renewal under way at most a third of
/// the TTL or a second, whichever is shorter; one that takes longer (a dead
/// link) is left to finish on its own, on its thread, which then drops
/// `renewer` (a pooled connection goes back to its pool, or is found broken
/// there). It cannot extend the lease past its release: a release ends it,
/// and a renewal is refused once a lease has ended. The call then releases
/// the lease on `conn`, so it returns within that bound plus the release's
/// own time.
///
/// The fencing token stays the guarantee: a holder that stalls (a stopped
/// process, a long pause) checks nothing, and its writes must be refused by
/// token. On SQLite, a renewal waits for the database's write lock: keep
/// `f`'s write transactions shorter than a third of the TTL.
///
/// ```text
/// with_lease_kept_alive(&mut conn, pool.get()?, "nightly-report", Duration::from_secs(30),
///     |conn, lease| { for step in steps { lease.ensure_held()?; step.run(conn)?; } Ok(()) })
/// ```
pub fn with_lease_kept_alive<C, R, T, E, F, Inferred>(
    conn: &mut C,
    renewer: R,
    name: &str,
    ttl: Duration,
    f: F,
) -> Result<Option<T>, E>
where
    C: BlockingConnection<Inferred>,
    R: RenewingConnection,
    F: FnOnce(&mut C, &KeptLease) -> Result<T, E>,
    E: From<Error>,
{
    let span = lease_span!(name, ttl);
    let _entered = span.enter();
    let acquiring = Instant::now();
    let Some(lease) = Lease::acquire(conn, name, ttl)? else {
        span.record("outcome", "held by another");
        return Ok(None);
    };
    span.record("token", lease.token());
    let kept = Arc::new(KeptLease::new(lease, ttl, acquiring));
    let (stop, stopped) = mpsc::channel::<()>();
    let (ended, renewing_ended) = mpsc::channel::<()>();
    let renewing = {
        let (kept, span) = (Arc::clone(&kept), span.clone());
        thread::spawn(move || {
            // The renewals' spans and events belong to the lease's.
            span.in_scope(|| keep_alive(renewer, &kept, &stopped));
            drop(ended);
        })
    };
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| f(&mut *conn, &kept)));
    drop(stop);
    // Nothing is sent: the thread's end drops the sender.
    if let Err(RecvTimeoutError::Timeout) = renewing_ended.recv_timeout(KeptLease::grace(ttl)) {
        // Stuck on its renewal: left to end on its own.
        trace::renewal_abandoned(kept.name(), kept.token());
    } else {
        // Renewing never panics but through a bug in a connection: the lease
        // is released below whatever happened to it.
        let _ = renewing.join();
    }
    let released = kept.lease().clone().release(conn);
    lease_outcome(outcome, released, &span)
}

/// Renews `kept` on `renewer` every third of its TTL until `stop` is dropped
/// or the lease is lost; drops `renewer` then.
fn keep_alive<R>(mut renewer: R, kept: &KeptLease, stop: &mpsc::Receiver<()>)
where
    R: LoadConnection,
    R::Backend: ClaimBackend,
{
    let period = KeptLease::period(kept.ttl());
    while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(period) {
        if kept.is_lost() {
            return;
        }
        let started = Instant::now();
        let renewed = kept.lease().renew(&mut renewer, kept.ttl());
        if !kept.renewed(renewed, started) {
            return;
        }
    }
}

/// What [`with_lease`] returns: `f`'s error, else the release's, else `f`'s value;
/// `f`'s panic resumes after the release.
pub(crate) fn lease_outcome<T, E: From<Error>>(
    outcome: thread::Result<Result<T, E>>,
    released: Result<(), Error>,
    span: &Span,
) -> Result<Option<T>, E> {
    span.record(
        "outcome",
        match &released {
            Ok(()) => "released",
            Err(Error::NotLeaseOwner { .. }) => "lost",
            Err(_) => "release failed",
        },
    );
    match outcome {
        Ok(Ok(value)) => {
            released?;
            Ok(Some(value))
        }
        Ok(Err(error)) => Err(error),
        Err(payload) => panic::resume_unwind(payload),
    }
}

/// Leases are taken, renewed and released outside transactions: inside one,
/// others would not see the change until it commits (and would block on the row
/// meanwhile), and a rollback would hand out the same fencing token again.
fn no_transaction(transaction_depth: u32) -> Result<(), Error> {
    if transaction_depth > 0 {
        return Err(Error::InvalidArgument(
            "leases must be acquired, renewed and released outside a transaction".to_owned(),
        ));
    }
    Ok(())
}

fn check_name(name: &str) -> Result<(), Error> {
    let problem = if name.is_empty() {
        "is empty"
    } else if name.len() > MAX_NAME_LEN {
        "is longer than 255 bytes"
    } else if name.contains('\0') {
        "contains a NUL character"
    } else {
        return Ok(());
    };
    Err(Error::InvalidArgument(format!("lease name {problem}")))
}

fn ttl_micros(ttl: Duration) -> Result<i64, Error> {
    if ttl.is_zero() || ttl > MAX_TTL {
        return Err(Error::InvalidArgument(format!(
            "lease ttl must be positive and at most {} s, got {ttl:?}",
            MAX_TTL.as_secs()
        )));
    }
    // At least one microsecond: the unit the databases store.
    Ok((ttl.as_micros() as i64).max(1))
}

#[cfg(feature = "postgres_backend")]
pub mod advisory;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_names_and_ttls_are_rejected_before_sql() {
        assert!(matches!(check_name(""), Err(Error::InvalidArgument(_))));
        assert!(matches!(check_name("a\0b"), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            check_name(&"x".repeat(256)),
            Err(Error::InvalidArgument(_))
        ));
        assert!(check_name(&"x".repeat(255)).is_ok());
        assert!(check_name("'; DROP TABLE diesel_claim_leases; --").is_ok());
        assert!(matches!(
            ttl_micros(Duration::ZERO),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            ttl_micros(MAX_TTL + Duration::from_secs(1)),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(ttl_micros(Duration::from_nanos(1)).unwrap(), 1);
        assert_eq!(ttl_micros(Duration::from_secs(2)).unwrap(), 2_000_000);
    }
}
