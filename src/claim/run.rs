//! Running a claim on a blocking connection: the methods every kind of claim
//! runs through, and its closure as the driver (`drive.rs`) calls it: per
//! row or per batch, under the claim's timeout, its panics caught.

use std::panic::{self, AssertUnwindSafe};
use std::time::{Duration, Instant};

use diesel::connection::LoadConnection;

use super::drive::Driver;
use super::kind::{FailureHook, Takes};
use super::report::{ClaimOutcome, ClaimReport};
use super::worker::{LeftOut, PassedOver};
use super::ClaimBuilder;
use crate::backend::ClaimBackend;
use crate::connection::BlockingConnection;
use crate::metrics::{ClaimMetrics, InWorker};
use crate::sql::Position;
use crate::trace;
use crate::transaction::transaction_depth;
use crate::{Blocking, Error};

impl<Q, T, H> ClaimBuilder<Q, Blocking, T, H> {
    /// Runs the claim, calling `f` for every claimed row: see
    /// [`ClaimDsl::claim_each`](crate::ClaimDsl::claim_each) and
    /// [`batch`](Self::batch). `f` gets each row as the query loads it, or,
    /// with a [visibility timeout](Self::visibility_timeout), a
    /// [`Claimed`](crate::Claimed) handle on it.
    pub fn each<'q, C, I, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        T: Takes<'q, Q, C, I>,
        H: FailureHook<C, I, T::Row, E>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, I) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_outcome(conn, f).into_result()
    }

    /// Runs the claim, calling `f` once per claimed batch with its rows, in the
    /// claim order (see the [guide](crate::guide#the-claim-order); rows a mark
    /// or a stamp took come in the order of the page they were read from, a
    /// row inserted since last, or, from the head, in no particular order).
    /// With a transaction (not `mark_and_commit`, nor a visibility timeout),
    /// `f` runs inside the batch's transaction.
    pub fn each_batch<'q, C, I, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<ClaimReport, E>
    where
        T: Takes<'q, Q, C, I>,
        H: FailureHook<C, I, T::Row, E>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Vec<I>) -> Result<(), E>,
        E: From<Error>,
    {
        self.each_batch_outcome(conn, f).into_result()
    }

    /// Runs the claim as [`each`](Self::each) does, and returns everything it
    /// did: the report, counted up to where the call ended (also when an error
    /// ended it), the failures passed over with
    /// [`keep_going`](Self::keep_going) or a [failure hook](Self::on_failure),
    /// and what ended the call early, with the keys of the rows it rolled
    /// back.
    pub fn each_outcome<'q, C, I, E, F, Inferred>(
        mut self,
        conn: &mut C,
        f: F,
    ) -> ClaimOutcome<T::Key, E>
    where
        T: Takes<'q, Q, C, I>,
        H: FailureHook<C, I, T::Row, E>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, I) -> Result<(), E>,
        E: From<Error>,
    {
        self.run_once(conn, &mut PerRow(f), LeftOut::nothing())
    }

    /// Runs the claim as [`each_batch`](Self::each_batch) does, and returns
    /// everything it did: see [`each_outcome`](Self::each_outcome).
    pub fn each_batch_outcome<'q, C, I, E, F, Inferred>(
        mut self,
        conn: &mut C,
        f: F,
    ) -> ClaimOutcome<T::Key, E>
    where
        T: Takes<'q, Q, C, I>,
        H: FailureHook<C, I, T::Row, E>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnMut(&mut C, Vec<I>) -> Result<(), E>,
        E: From<Error>,
    {
        self.run_once(conn, &mut PerBatch(f), LeftOut::nothing())
    }

    /// One run of the claim, leaving out a worker's rows (see [`LeftOut`]).
    pub(crate) fn run_once<'q, C, I, E, F>(
        &mut self,
        conn: &mut C,
        f: &mut F,
        left_out: LeftOut<'_, T::Key, E>,
    ) -> ClaimOutcome<T::Key, E>
    where
        T: Takes<'q, Q, C, I>,
        H: FailureHook<C, I, T::Row, E>,
        C: LoadConnection,
        C::Backend: ClaimBackend,
        F: Closure<C, I, E>,
        E: From<Error>,
    {
        let started = transaction_depth(conn)
            .map_err(Error::from)
            .and_then(|depth| self.kind.start(&self.query, &self.options, depth));
        let mut claim = match started {
            Ok(claim) => claim,
            Err(error) => return ClaimOutcome::refused(error.into()),
        };
        if let Some(backoff) = &left_out.backoff {
            claim.exclude(backoff.excluded().into_iter().map(Position::of_key));
        }
        if let Some(sibling) = left_out.sibling {
            claim.beside(sibling);
        }
        if let Some(keys) = left_out.only {
            claim.among(keys.into_iter().map(Position::of_key).collect());
        }
        let table = T::table_name();
        let span = claim.span(&table);
        let worker = claim.in_worker().then(|| self.options.worker_name(&table));
        let began = Instant::now();
        let metrics = ClaimMetrics::new(&table, worker.as_deref());
        let in_worker = InWorker::new(worker.as_deref());
        let mut driver = Driver {
            claim: &mut claim,
            query: &self.query,
            kind: &mut self.kind,
            hook: &mut self.hook,
            options: &self.options,
            failed: PassedOver::new(left_out.tell),
            transient: false,
            backoff: left_out.backoff.as_deref(),
            metrics,
            table,
            worker,
        };
        let stopped = in_worker
            .around(|| span.in_scope(|| driver.run(conn, f)))
            .err();
        let (failed, transient, mut metrics) =
            (driver.failed.failures, driver.transient, driver.metrics);
        let report = claim.report();
        metrics.claim_ended(began, report.counts(), claim.in_worker());
        ClaimOutcome::ended(report, failed, stopped, transient, &span)
    }
}

/// A claim's closure, as the driver calls it: with each row, or with each
/// batch.
pub(crate) trait Closure<C, I, E> {
    /// The closure takes one row at a time.
    const PER_ROW: bool;

    /// Calls the closure for `items`, in order: once per row, or once.
    fn call(&mut self, conn: &mut C, items: Vec<I>) -> Result<(), E>;
}

/// A closure called with each row.
pub(crate) struct PerRow<F>(pub(crate) F);

/// A closure called with each batch.
pub(crate) struct PerBatch<F>(pub(crate) F);

impl<C, I, E, F: FnMut(&mut C, I) -> Result<(), E>> Closure<C, I, E> for PerRow<F> {
    const PER_ROW: bool = true;

    fn call(&mut self, conn: &mut C, items: Vec<I>) -> Result<(), E> {
        items.into_iter().try_for_each(|item| (self.0)(conn, item))
    }
}

impl<C, I, E, F: FnMut(&mut C, Vec<I>) -> Result<(), E>> Closure<C, I, E> for PerBatch<F> {
    const PER_ROW: bool = false;

    fn call(&mut self, conn: &mut C, items: Vec<I>) -> Result<(), E> {
        (self.0)(conn, items)
    }
}

/// Splits a batch into the closure's calls: one per row when each row's
/// failure is to be told apart, else one (none for an empty batch).
pub(crate) fn calls<I>(items: Vec<I>, one_per_row: bool) -> Vec<Vec<I>> {
    if one_per_row {
        items.into_iter().map(|item| vec![item]).collect()
    } else if items.is_empty() {
        // A take that found nothing calls no closure.
        Vec::new()
    } else {
        vec![items]
    }
}

/// Runs a closure's `call` under the claim's `timeout`: a call that ran past
/// it failed, with [`Error::TimedOut`], whatever it returned (a thread cannot
/// be stopped; its work is rolled back once it returns), and is told of with
/// `told` as it happens. The error says whether the call ran late.
pub(crate) fn within<E: From<Error>>(
    timeout: Option<Duration>,
    told: impl FnOnce(Duration),
    call: impl FnOnce() -> Result<(), E>,
) -> Result<(), (E, bool)> {
    let began = Instant::now();
    let called = call();
    match timeout {
        Some(timeout) if began.elapsed() >= timeout => {
            told(timeout);
            Err((Error::TimedOut { timeout }.into(), true))
        }
        _ => called.map_err(|error| (error, false)),
    }
}

/// Runs the closure (on a batch, or a row); with `catch_panics`, a panic is
/// its error ([`Error::ClosurePanicked`]).
pub(crate) fn call<E: From<Error>>(
    f: impl FnOnce() -> Result<(), E>,
    catch_panics: bool,
) -> Result<(), E> {
    if !catch_panics {
        return f();
    }
    panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| Err(panicked(&*payload)))
}

/// A closure's panic, as its error ([`Error::ClosurePanicked`]).
pub(crate) fn panicked<E: From<Error>>(payload: &(dyn std::any::Any + Send)) -> E {
    let message = panic_message(payload);
    trace::warning!(panic = %message, "a closure panicked");
    Error::ClosurePanicked(message).into()
}

/// The message a panic was raised with.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a panic without a message".to_owned())
}
