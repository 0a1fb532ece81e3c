//! A worker on an r2d2 pool: claim loops that check a connection out for
//! each claim and return it while idle, a listener on a connection of its
//! own, and both going on through lost connections and server restarts.

use std::fmt::{Debug, Display};
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::r2d2::{ConnectionManager, Pool, R2D2Connection};

use super::kind::{FailureHook, Takes};
use super::run::PerRow;
use super::siblings::{Sibling, Siblings};
use super::worker::on_a_pool::{summed, Reconnect, Shared};
use super::worker::{tally, Backoff, ClaimPerLoop, LeftOut, Polling, WorkerError};
use super::{ClaimBuilder, ClaimOutcome, ClaimReport, ClaimWorker, RowFailure, WaitForRows};
use crate::backend::ClaimBackend;
use crate::sql::Position;
use crate::trace::{CallersSubscriber, WorkerTrace};
use crate::{Blocking, Error};

impl<Q, T, H> ClaimWorker<ClaimBuilder<Q, Blocking, T, H>> {
    /// Runs `concurrency` claim loops on `pool` until stopped (or, with
    /// [`stop_when_empty`](Self::stop_when_empty), until nothing is
    /// pending), calling `f` for every claimed row as
    /// [`ClaimBuilder::each`] does; returns the report of everything they did.
    ///
    /// Each claim checks a connection out of the pool and returns it before
    /// the loop waits, so idle loops hold none, and the pool is shared with
    /// the rest of the application (the jobs' own queries among them). Size
    /// it for the loops that run claims at once, the listener, and whatever
    /// else the application runs: a closure that checks out a second
    /// connection while its claim holds one needs room for both.
    ///
    /// With [`listen`](Self::listen), one connection of the pool listens for
    /// all the loops, for as long as the worker runs.
    ///
    /// In the key's order, with row locks, the loops' takes start past the
    /// rows the loops have taken rather than pass over each of them under
    /// lock, and a take looks ahead of them once in each round of theirs and
    /// before a run ends: see [on a pool](crate::guide::workers#on-a-pool)
    /// for what a job left behind them waits.
    ///
    /// **Lost connections** do not end it: a claim that fails on a connection
    /// that no longer answers, a checkout that fails and a listener whose
    /// connection dies are retried on another connection after a pause (from
    /// 50 ms doubling up to 5 s while they keep failing, the loops taking
    /// turns to try every 250 ms between them), with a warning event; a
    /// server restart is waited out, and the first loop whose connection
    /// answers again wakes the others (see
    /// [restarts](crate::guide::workers#server-restarts), and give the pool a
    /// `connection_timeout` of a second or two). Nothing is lost: a claim
    /// whose connection died had not committed, and its rows are taken
    /// again. It ends on an error that another connection cannot mend — a
    /// closure's error (without [`keep_going`](ClaimBuilder::keep_going) or
    /// a failure hook), an invalid option, an error of the query on a
    /// connection that answers — and then the other loops finish their rows
    /// and stop.
    ///
    /// r2d2 tests every connection it hands out (`test_on_check_out`), a
    /// round trip per claim: a busy worker's pool may turn it off, as the
    /// worker finds a dead connection itself.
    ///
    /// `f` is cloned for each loop.
    pub fn run_pooled<'q, C, I, E, F>(
        self,
        pool: &Pool<ConnectionManager<C>>,
        f: F,
    ) -> Result<ClaimReport, E>
    where
        ClaimBuilder<Q, Blocking, T, H>: ClaimPerLoop,
        T: Takes<'q, Q, C, I>,
        T::Key: Send,
        H: FailureHook<C, I, T::Row, E>,
        C: WaitForRows + R2D2Connection + Send + 'static,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, I) -> Result<(), E> + Clone + Send,
        E: WorkerError + Send,
    {
        let ClaimWorker { claim, polling } = self;
        let shared = Shared::new(&polling);
        // One backoff for all the loops: a row that failed in one is not
        // retried by another sooner.
        let backoff = Backoff::new(polling.backoff);
        let siblings = Siblings::new(polling.concurrency);
        let labels = claim.options.worker_labels(T::table_name());
        let span = polling.span(&labels);
        let _entered = span.enter();
        polling.check(true, &labels)?;
        let events = polling.events(labels);
        let subscriber = &CallersSubscriber::of_this_thread();
        let ended = std::thread::scope(|scope| {
            if let Some(channel) = &polling.channel {
                let (shared, events, span) = (&shared, &events, &span);
                scope.spawn(move || {
                    subscriber.in_span(span, || listen(pool, channel, shared, events))
                });
            }
            let loops: Vec<_> = (0..polling.concurrency)
                .map(|index| {
                    let (mut claim, mut f) = (claim.per_loop(), PerRow(f.clone()));
                    let sibling = siblings.slot(index);
                    let (shared, polling, span) = (&shared, &polling, &span);
                    let (backoff, events) = (&backoff, &events);
                    scope.spawn(move || {
                        let _halts = HaltOnPanic(shared);
                        subscriber.in_span(span, || {
                            let once = |conn: &mut C, left_out: LeftOut<'_, _, _>| {
                                claim.run_once(conn, &mut f, left_out)
                            };
                            claim_loop(pool, polling, shared, backoff, events, sibling, once)
                        })
                    })
                })
                .collect();
            let ended: Vec<_> = loops
                .into_iter()
                .map(|handle| {
                    handle
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                })
                .collect();
            // The loops have ended: so does the listener.
            shared.halt.stop();
            ended
        });
        let ended = summed(&polling, ended);
        Polling::ended(&span, &events, &ended);
        ended
            .map(|(total, _)| total)
            .map_err(|failure| failure.error)
    }
}

/// Stops the other loops and the listener when its loop panics, so that
/// the panic reaches the caller rather than waiting on them forever.
struct HaltOnPanic<'a>(&'a Shared);

impl Drop for HaltOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.halt.stop();
        }
    }
}

/// How often a waiting loop looks at its stop handles and wake-ups.
const LOOK_EVERY: Duration = Duration::from_millis(1);

/// Sleeps for `pause`, less when stopped or woken past `seen`.
fn sleep(shared: &Shared, pause: Duration, seen: u64) {
    let deadline = Instant::now() + pause;
    while let Some(step) = shared.next_step(deadline, seen, LOOK_EVERY) {
        std::thread::sleep(step);
    }
}

/// One claim loop: checks out a connection, claims, returns it, waits.
fn claim_loop<C, K, E>(
    pool: &Pool<ConnectionManager<C>>,
    polling: &Polling,
    shared: &Shared,
    backoff: &Arc<Backoff<K>>,
    events: &WorkerTrace,
    sibling: Sibling<Position<K>>,
    mut claim_once: impl FnMut(&mut C, LeftOut<'_, K, E>) -> ClaimOutcome<K, E>,
) -> Result<ClaimReport, RowFailure<K, E>>
where
    C: R2D2Connection + Send + 'static,
    K: Clone + Eq + Hash + Debug + Send,
    E: From<Error> + Display + 'static,
{
    let tell = |keys: &[K], error: &E| events.passed_over(keys, error);
    let mut total = ClaimReport::default();
    let mut pause = polling.min_poll;
    let mut reconnect = Reconnect::new();
    // Takes steer around the other loops' batches, but the last claim of a
    // loop that stops once nothing is pending takes from the whole query.
    let mut steering = polling.concurrency > 1;
    while !shared.stopping() {
        let mut seen = shared.woken();
        let mut conn = match pool.get().map_err(Error::from) {
            Ok(conn) => conn,
            Err(error) => {
                let what = "a worker could not check out a connection";
                sleep(shared, reconnect.failed(shared, events, what, &error), seen);
                continue;
            }
        };
        if reconnect.failing() {
            // Back after failures: once a connection answers, so does the
            // server, and the loops pausing try again at once. (Before the
            // claim, whose jobs may be long.)
            if let Err(error) = conn.batch_execute("SELECT 1") {
                let what = "a worker's connection does not answer";
                sleep(shared, reconnect.failed(shared, events, what, &error), seen);
                continue;
            }
            events.reconnected(reconnect.mended());
            seen = shared.wake();
        }
        let left_out = LeftOut {
            sibling: steering.then(|| sibling.clone()),
            ..LeftOut::backed_off(backoff, &tell)
        };
        let outcome = claim_once(&mut conn, left_out);
        let lost = outcome.stopped.is_some()
            && !outcome.transient
            && conn.batch_execute("SELECT 1").is_err();
        drop(conn);
        let took = match tally(&mut total, outcome, events) {
            Ok(took) => took,
            Err(failure) if lost => {
                let what = "a worker's claim lost its connection, and its rows were rolled back";
                let pause = reconnect.failed(shared, events, what, &failure.error);
                sleep(shared, pause, seen);
                continue;
            }
            Err(failure) => {
                shared.halt.stop();
                return Err(failure);
            }
        };
        if polling.until_empty && !took {
            if steering {
                steering = false;
                continue;
            }
            break;
        }
        steering = polling.concurrency > 1;
        if let Some(wait) = polling.next_pause(took, &mut pause) {
            let waiting = Instant::now();
            let deadline = waiting + wait;
            while let Some(step) = shared.next_step(deadline, seen, LOOK_EVERY) {
                std::thread::sleep(step);
            }
            events.idled(waiting.elapsed());
            if shared.woken() != seen {
                pause = polling.min_poll;
            }
        }
    }
    Ok(total)
}

/// The listener: a connection of the pool that listens on `channel` and
/// wakes the loops, taken again when it fails, until the worker stops.
fn listen<C>(
    pool: &Pool<ConnectionManager<C>>,
    channel: &str,
    shared: &Shared,
    events: &WorkerTrace,
) where
    C: WaitForRows + R2D2Connection + Send + 'static,
{
    let mut reconnect = Reconnect::new();
    while !shared.stopping() {
        let listened = match pool.get() {
            Ok(mut conn) => conn
                .listen(channel)
                .and_then(|()| {
                    // Rows may have come while nobody listened.
                    shared.wake();
                    events.listening(channel, reconnect.mended());
                    wait_for_notifications(&mut conn, shared)?;
                    // Back to the pool without it.
                    conn.unlisten(channel)
                })
                .map_err(|error| error.to_string()),
            Err(error) => Err(Error::from(error).to_string()),
        };
        if let Err(error) = listened {
            let what = format!("a worker's listener on {channel:?} lost its connection");
            let pause = reconnect.failed(shared, events, &what, &error);
            sleep(shared, pause, shared.woken());
        }
    }
}

/// How long a listener waits before it checks that its connection answers.
const LISTENER_CHECK_EVERY: Duration = Duration::from_secs(1);

/// Wakes the loops on every notification, until the worker stops or the
/// connection fails.
fn wait_for_notifications<C: WaitForRows>(conn: &mut C, shared: &Shared) -> Result<(), Error> {
    while !shared.stopping() {
        if conn.wait_for_rows(LISTENER_CHECK_EVERY, &shared.halt)? {
            shared.wake();
        } else if !shared.stopping() {
            // A dead connection may stay silent: ask it.
            conn.batch_execute("SELECT 1")?;
        }
    }
    Ok(())
}
