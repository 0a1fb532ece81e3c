//! Named leases on a diesel-async connection.

use std::future::Future;
use std::pin::pin;
use std::time::{Duration, Instant};

use diesel_async::AsyncConnection;
use futures_util::future::{self, BoxFuture, Either};
use tokio::sync::watch;

use super::backend::AsyncBackend;
use super::closure::AsyncFnOnce2;
use super::transaction::transaction_depth;
use super::unwind::catch_unwind;
use crate::lease::{lease_outcome, lease_span, Patience};
use crate::trace::{self, Instrument};
use crate::{Error, KeptLease};

/// A lease held through a diesel-async connection: the async twin of
/// [`crate::Lease`], with the same names, tokens and rules.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a lease is held until it expires or is released"]
pub struct Lease(crate::Lease);

impl Lease {
    /// The leased name.
    pub fn name(&self) -> &str {
        self.0.name()
    }

    /// The fencing token of this acquisition.
    pub fn token(&self) -> i64 {
        self.0.token()
    }

    /// Takes the lease on `name` for `ttl` if it is free or has expired;
    /// `Ok(None)` if someone else holds it: see [`crate::Lease::acquire`].
    pub async fn acquire<C>(conn: &mut C, name: &str, ttl: Duration) -> Result<Option<Lease>, Error>
    where
        C: AsyncConnection,
        C::Backend: AsyncBackend,
    {
        let span = trace::debug_span!(
            "acquire_lease",
            name,
            ttl = ?ttl,
            token = trace::Empty,
            outcome = trace::Empty,
        );
        async {
            let statement = crate::Lease::acquiring(name, ttl, transaction_depth(conn)?)?;
            let token = C::Backend::run(conn, statement).await?;
            Ok(crate::Lease::acquired(name, token, &span).map(Lease))
        }
        .instrument(span.clone())
        .await
    }

    /// Takes the lease, waiting up to `patience` for it: see
    /// [`crate::Lease::acquire_within`]. Waits with `tokio::time::sleep`.
    pub async fn acquire_within<C>(
        conn: &mut C,
        name: &str,
        ttl: Duration,
        patience: Duration,
    ) -> Result<Lease, Error>
    where
        C: AsyncConnection,
        C::Backend: AsyncBackend,
    {
        let mut patience = Patience::new(patience);
        loop {
            if let Some(lease) = Lease::acquire(conn, name, ttl).await? {
                return Ok(lease);
            }
            tokio::time::sleep(patience.pause(name)?).await;
        }
    }

    /// Extends the lease to `ttl` from now: see [`crate::Lease::renew`].
    pub async fn renew<C>(&self, conn: &mut C, ttl: Duration) -> Result<(), Error>
    where
        C: AsyncConnection,
        C::Backend: AsyncBackend,
    {
        renew(&self.0, conn, ttl).await
    }

    /// Ends the lease so others can take it at once: see [`crate::Lease::release`].
    pub async fn release<C>(self, conn: &mut C) -> Result<(), Error>
    where
        C: AsyncConnection,
        C::Backend: AsyncBackend,
    {
        let span = self.0.span_releasing();
        async {
            let statement = self.0.releasing(transaction_depth(conn)?)?;
            let released = C::Backend::run(conn, statement).await?;
            self.0.answered(released, &span, "released")
        }
        .instrument(span.clone())
        .await
    }
}

/// Awaits `f` while holding the lease on `name`, or returns `Ok(None)` at once if
/// someone else holds it: see [`crate::with_lease`]. The lease is released when
/// `f` returns or panics; if the future is dropped, the lease is left to expire
/// at its TTL. `f` is an `async` closure, `async |conn, lease| { … }`.
pub fn with_lease<'a, C, T, E, F>(
    conn: &'a mut C,
    name: &'a str,
    ttl: Duration,
    f: F,
) -> impl Future<Output = Result<Option<T>, E>> + Send + 'a
where
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    T: Send + 'a,
    for<'c> F: AsyncFnOnce(&'c mut C, &'c Lease) -> Result<T, E>
        + AsyncFnOnce2<&'c mut C, &'c Lease, Result<T, E>, Fut: Send>
        + Send
        + 'a,
    E: From<Error> + Send + 'a,
{
    let span = lease_span!(name, ttl);
    let entered = span.clone();
    async move {
        let Some(lease) = Lease::acquire(conn, name, ttl).await? else {
            span.record("outcome", "held by another");
            return Ok(None);
        };
        span.record("token", lease.token());
        // Boxed where its `Send` is known: the future borrows the lease too,
        // and the compiler cannot carry that bound through the `async` block.
        let work: BoxFuture<'_, _> = Box::pin(f(&mut *conn, &lease));
        let outcome = catch_unwind(work).await;
        let released = lease.release(conn).await;
        lease_outcome(outcome, released, &span)
    }
    .instrument(entered)
}

/// Extends `lease` to `ttl` from now, on `conn`.
async fn renew<C>(lease: &crate::Lease, conn: &mut C, ttl: Duration) -> Result<(), Error>
where
    C: AsyncConnection,
    C::Backend: AsyncBackend,
{
    let span = lease.span_renewing();
    async {
        let statement = lease.renewing(ttl, transaction_depth(conn)?)?;
        let renewed = C::Backend::run(conn, statement).await?;
        lease.answered(renewed, &span, "renewed")
    }
    .instrument(span.clone())
    .await
}

/// Awaits `f` while holding the lease on `name`, renewed every third of its
/// `ttl` on `renewer` for as long as `f` runs: see
/// [`crate::with_lease_kept_alive`], whose rule for a lost lease (its TTL
/// passed on the local clock since the start of the last renewal that
/// worked, whatever the renewal under way is doing) holds here too. The
/// renewing runs beside `f` in the same task. When `f` returns or panics, a
/// renewal under way gets a third of the TTL or a second, whichever is
/// shorter, to finish; one still running then (a dead link) is dropped, as
/// any cancelled future is, and `renewer` may be left in the middle of its
/// statement: do not use it again for anything but dropping. The lease is
/// then released on `conn`. If the call's future is dropped, both stop and
/// the lease is left to expire at its TTL. `f` is an `async` closure,
/// `async |conn, lease| { … }`.
pub fn with_lease_kept_alive<'a, C, R, T, E, F>(
    conn: &'a mut C,
    renewer: &'a mut R,
    name: &'a str,
    ttl: Duration,
    f: F,
) -> impl Future<Output = Result<Option<T>, E>> + Send + 'a
where
    C: AsyncConnection,
    C::Backend: AsyncBackend,
    R: AsyncConnection,
    R::Backend: AsyncBackend,
    T: Send + 'a,
    for<'c> F: AsyncFnOnce(&'c mut C, &'c KeptLease) -> Result<T, E>
        + AsyncFnOnce2<&'c mut C, &'c KeptLease, Result<T, E>, Fut: Send>
        + Send
        + 'a,
    E: From<Error> + Send + 'a,
{
    let span = lease_span!(name, ttl);
    let entered = span.clone();
    async move {
        let acquiring = Instant::now();
        let Some(lease) = Lease::acquire(conn, name, ttl).await? else {
            span.record("outcome", "held by another");
            return Ok(None);
        };
        span.record("token", lease.token());
        let kept = KeptLease::new(lease.0, ttl, acquiring);
        let (stop, stopped) = watch::channel(false);
        let work = async {
            let work: BoxFuture<'_, _> = Box::pin(f(&mut *conn, &kept));
            let outcome = catch_unwind(work).await;
            stop.send_replace(true);
            outcome
        };
        let (outcome, ()) = future::join(work, keep_alive(renewer, &kept, stopped)).await;
        let released = Lease(kept.lease().clone()).release(conn).await;
        lease_outcome(outcome, released, &span)
    }
    .instrument(entered)
}

/// Renews `kept` on `renewer` every third of its TTL until `stopped` turns
/// true or the lease is lost; a renewal under way when it turns true gets
/// [`KeptLease::grace`] to finish.
async fn keep_alive<R>(renewer: &mut R, kept: &KeptLease, mut stopped: watch::Receiver<bool>)
where
    R: AsyncConnection,
    R::Backend: AsyncBackend,
{
    let ttl = kept.ttl();
    loop {
        let pause = pin!(tokio::time::sleep(KeptLease::period(ttl)));
        if let Either::Right(_) = future::select(pause, pin!(until_true(&mut stopped))).await {
            return;
        }
        if kept.is_lost() {
            return;
        }
        let started = Instant::now();
        let renewal = pin!(renew(kept.lease(), renewer, ttl));
        let cut_short = pin!(async {
            until_true(&mut stopped).await;
            tokio::time::sleep(KeptLease::grace(ttl)).await;
        });
        let renewed = match future::select(renewal, cut_short).await {
            Either::Left((renewed, _)) => renewed,
            Either::Right(_) => {
                trace::renewal_abandoned(kept.name(), kept.token());
                return;
            }
        };
        if !kept.renewed(renewed, started) {
            return;
        }
    }
}

/// Waits until `flag` is true (or its sender is gone).
async fn until_true(flag: &mut watch::Receiver<bool>) {
    let _ = flag.wait_for(|&set| set).await;
}
