//! Retrying an operation that failed transiently: version conflicts,
//! deadlocks, serialization failures.

use std::hash::{BuildHasher, RandomState};
use std::time::Duration;

use crate::trace;
use crate::Error;

/// How often and how patiently [`retry`] tries again.
///
/// Attempt `n` (from 1) that fails with a transient error sleeps a random time
/// up to `min(max_backoff, initial_backoff × 2ⁿ⁻¹)` ("full jitter") before the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (at least 1).
    pub max_attempts: u32,
    /// Upper bound of the first backoff.
    pub initial_backoff: Duration,
    /// Upper bound of every backoff.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    /// 16 attempts, backoff from up to 1 ms growing to at most 250 ms.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 16,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(250),
        }
    }
}

impl RetryPolicy {
    /// A policy of `max_attempts` attempts with the default backoff. 0 is
    /// refused when the policy is used.
    pub fn attempts(max_attempts: u32) -> Self {
        RetryPolicy {
            max_attempts,
            ..RetryPolicy::default()
        }
    }

    fn backoff(&self, attempt: u32, jitter: &RandomState) -> Duration {
        let ceiling = self
            .initial_backoff
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20))
            .min(self.max_backoff);
        let random = jitter.hash_one(attempt);
        ceiling.mul_f64(random as f64 / u64::MAX as f64)
    }
}

/// Errors [`retry`] can tell transient failures from final ones in.
///
/// Implemented for the crate's [`Error`], Diesel's, `Box<dyn Error + Send +
/// Sync>` and `Box<dyn Error>`, and with the `anyhow` feature for
/// `anyhow::Error`: the boxed ones are transient when [`is_transient`] finds a
/// transient cause in their chain of sources. An application's own error type
/// implements it in a few lines:
///
/// ```
/// #[derive(Debug, thiserror::Error)]
/// enum AppError {
///     #[error(transparent)]
///     Claim(#[from] diesel_claim::Error),
///     #[error("insufficient funds")]
///     Insufficient,
/// }
///
/// impl diesel_claim::Transient for AppError {
///     fn is_transient(&self) -> bool {
///         matches!(self, AppError::Claim(error) if error.is_transient())
///     }
/// }
/// ```
///
/// (Where the crate's error is a [`source`](std::error::Error::source) of
/// yours, `diesel_claim::is_transient(self)` finds it; `#[error(transparent)]`
/// passes the source on, not the wrapped error itself.)
pub trait Transient {
    /// Whether running the operation again may succeed.
    fn is_transient(&self) -> bool;
}

impl Transient for Error {
    fn is_transient(&self) -> bool {
        Error::is_transient(self)
    }
}

impl Transient for diesel::result::Error {
    fn is_transient(&self) -> bool {
        crate::is_deadlock(self) || crate::is_serialization_failure(self)
    }
}

impl Transient for Box<dyn std::error::Error + Send + Sync> {
    fn is_transient(&self) -> bool {
        is_transient(&**self)
    }
}

impl Transient for Box<dyn std::error::Error> {
    fn is_transient(&self) -> bool {
        is_transient(&**self)
    }
}

#[cfg(feature = "anyhow")]
#[cfg_attr(docsrs, doc(cfg(feature = "anyhow")))]
impl Transient for anyhow::Error {
    fn is_transient(&self) -> bool {
        is_transient(self.as_ref())
    }
}

/// Whether `error`, or any error in its chain of [`source`]s, is a transient
/// failure: a transient [`Error`] (version conflict, deadlock, serialization
/// failure) or a Diesel error that is a deadlock or a serialization failure.
///
/// [`source`]: std::error::Error::source
pub fn is_transient(error: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(error), |error| error.source()).any(|cause| {
        if let Some(error) = cause.downcast_ref::<Error>() {
            return error.is_transient();
        }
        cause
            .downcast_ref::<diesel::result::Error>()
            .is_some_and(Transient::is_transient)
    })
}

/// Runs `operation` until it succeeds, fails with an error that is not
/// [transient](Transient), or has been tried `policy.max_attempts` times; then
/// returns its last result.
///
/// Each attempt must re-read what it depends on: on a version conflict the row
/// changed since it was read. Transient errors are version conflicts, deadlocks
/// and serialization failures. Run it outside a transaction (or make `operation`
/// a transaction of its own): PostgreSQL aborts the surrounding transaction on a
/// deadlock, and every later attempt inside it would fail.
///
/// A policy of 0 attempts is [`Error::InvalidArgument`], without an attempt.
pub fn retry<C, T, E, F>(conn: &mut C, policy: RetryPolicy, mut operation: F) -> Result<T, E>
where
    F: FnMut(&mut C) -> Result<T, E>,
    E: Transient + From<Error>,
{
    let mut attempts = Attempts::new(policy)?;
    loop {
        match operation(conn) {
            Err(error) => match attempts.pause_after(&error) {
                Some(pause) => std::thread::sleep(pause),
                None => return Err(error),
            },
            done => return done,
        }
    }
}

/// The attempts of one [`retry`]: whether to try again after an error, and
/// after what pause.
pub(crate) struct Attempts {
    policy: RetryPolicy,
    jitter: RandomState,
    made: u32,
}

impl Attempts {
    /// The attempts of `policy`; [`Error::InvalidArgument`] if it allows none.
    pub(crate) fn new(policy: RetryPolicy) -> Result<Self, Error> {
        if policy.max_attempts == 0 {
            return Err(Error::InvalidArgument(
                "a retry policy needs at least one attempt: max_attempts is 0".to_owned(),
            ));
        }
        Ok(Attempts {
            policy,
            jitter: RandomState::new(),
            made: 1,
        })
    }

    /// The pause before the next attempt after `error`; `None` gives up.
    pub(crate) fn pause_after<E: Transient>(&mut self, error: &E) -> Option<Duration> {
        if !error.is_transient() {
            return None;
        }
        let (attempt, max_attempts) = (self.made, self.policy.max_attempts);
        if attempt >= max_attempts {
            trace::warning!(
                attempt,
                max_attempts,
                "a transient error persisted: retries exhausted"
            );
            return None;
        }
        let pause = self.policy.backoff(attempt, &self.jitter);
        trace::debug!(
            attempt,
            max_attempts,
            ?pause,
            "a transient error: trying again"
        );
        self.made += 1;
        Some(pause)
    }
}
