//! The async driver of a claim: the engine's steps carried out with a kind's
//! statements on a diesel-async connection, as the blocking driver
//! (`claim/drive.rs`) carries them out on a blocking one.

use std::hash::Hash;
use std::time::Instant;

use diesel_async::{AsyncConnection, TransactionManager};
use scoped_futures::ScopedFutureExt;

use super::backend::AsyncBackend;
use super::claim::{call, within, Closure};
use super::kind::{FailureHook, Takes};
use super::transaction::{locking_transaction, roll_back_to, transaction_depth};
use crate::backend::strategy::Strategy;
use crate::claim::drive::{backed_off, pass_over_backed_off, Failing, NextBatch};
use crate::claim::engine::{Claim, Step, Taking};
use crate::claim::run::calls;
use crate::claim::worker::{Backoff, PassedOver};
use crate::claim::{failures_in_savepoints, Options};
use crate::metrics::ClaimMetrics;
use crate::sql::{KeyRange, Position};
use crate::trace::{self, Instrument};
use crate::transaction::{locking_read, transaction_outcome, MOVED_ROW_RETRIES};
use crate::{Error, RowFailure};

/// One run of a claim on a diesel-async connection, and the failures passed
/// over so far.
pub(super) struct Driver<'d, Q, T, H, K, E> {
    pub(super) claim: &'d mut Claim<Position<K>>,
    pub(super) query: &'d Q,
    pub(super) kind: &'d mut T,
    pub(super) hook: &'d mut H,
    pub(super) options: &'d Options,
    pub(super) failed: PassedOver<'d, K, E>,
    /// See the blocking driver's.
    pub(super) transient: bool,
    /// See the blocking driver's.
    pub(super) backoff: Option<&'d Backoff<K>>,
    pub(super) metrics: ClaimMetrics,
    /// See the blocking driver's.
    pub(super) table: String,
    pub(super) worker: Option<String>,
}

impl<'a, Q, T, H, K, E> Driver<'_, Q, T, H, K, E>
where
    Q: Sync,
    K: Clone + Eq + Hash + std::fmt::Debug + Send + Sync,
    E: From<Error> + Send,
{
    /// Runs the claim's steps until it is done; an error ends it.
    pub(super) async fn run<C, I, F>(
        &mut self,
        conn: &mut C,
        f: &mut F,
    ) -> Result<(), RowFailure<K, E>>
    where
        T: Takes<'a, Q, C, I, Key = K>,
        H: FailureHook<C, I, T::Row, E>,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        I: Send,
        F: Closure<C, I, E>,
    {
        while let Some((range, limit)) = self.next_batch(conn).await.map_err(|e| self.outside(e))? {
            let span = self.claim.batch_span(limit);
            let began = Instant::now();
            let batch = if self.claim.taking == Taking::MarkAndCommit {
                self.hand_committed(conn, f, range, limit, &span).await
            } else {
                self.take_and_hand(conn, f, range, limit, &span)
                    .instrument(span.clone())
                    .await
            };
            self.metrics
                .batch_ended(began, self.claim.report().counts());
            batch?;
        }
        Ok(())
    }

    /// An error of the crate's own, outside any closure, that ends the run.
    fn outside(&mut self, error: Error) -> RowFailure<K, E> {
        self.transient = error.is_transient();
        RowFailure::new(Vec::new(), E::from(error))
    }

    /// Reads candidates until the claim's next batch is known, as the
    /// blocking driver does: its range and limit, or `None` once the claim is
    /// done.
    async fn next_batch<C, I>(&mut self, conn: &mut C) -> Result<Option<NextBatch<K>>, Error>
    where
        T: Takes<'a, Q, C, I, Key = K>,
        C: AsyncConnection,
    {
        loop {
            match self.claim.next() {
                Step::Candidates(range, limit) => {
                    let keys = self
                        .kind
                        .keys(self.query, conn, range, limit, false)
                        .await?;
                    self.claim.candidates(keys);
                }
                Step::StillMatching(range) => {
                    let keys = self
                        .kind
                        .keys(self.query, conn, range, i64::MAX, true)
                        .await?;
                    self.claim.still_matching(keys);
                }
                Step::Batch(range, limit) => return Ok(Some((range, limit))),
                Step::Done => return Ok(None),
            }
        }
    }

    /// Takes a batch in a transaction of its own and hands it to the closure
    /// in it, as the blocking driver's `take_and_hand` does.
    async fn take_and_hand<C, I, F>(
        &mut self,
        conn: &mut C,
        f: &mut F,
        range: KeyRange<Position<K>>,
        limit: i64,
        span: &trace::Span,
    ) -> Result<(), RowFailure<K, E>>
    where
        T: Takes<'a, Q, C, I, Key = K>,
        H: FailureHook<C, I, T::Row, E>,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        I: Send,
        F: Closure<C, I, E>,
    {
        let catch = self.options.keep_going || H::SET;
        let savepoints =
            failures_in_savepoints(self.options, self.claim.taking, H::SET, F::PER_ROW);
        let timeout = self.options.timeout;
        let mut attempts = 0;
        let (batch, failing, caught, own_failed_transiently, timed_out, handed) = loop {
            let (mut moved, mut failing, mut caught) = (false, None, Vec::new());
            let (mut own_failed_transiently, mut timed_out, mut handed) = (false, 0, Vec::new());
            let (moved_read, failing_at, caught_in) = (&mut moved, &mut failing, &mut caught);
            let (own_failed_at, late, handed_over) =
                (&mut own_failed_transiently, &mut timed_out, &mut handed);
            let (claim, kind, hook, query, f, range) = (
                &mut *self.claim,
                &mut *self.kind,
                &mut *self.hook,
                self.query,
                &mut *f,
                range.clone(),
            );
            let backoff = self.backoff;
            let (table, worker) = (self.table.as_str(), self.worker.as_deref());
            let batch = locking_transaction(conn, self.options.idle_bound(), |conn| {
                async move {
                    let rows = kind
                        .take(query, conn, range.clone(), limit, &claim.clause)
                        .await;
                    let rows = locking_read(rows, moved_read)
                        .inspect_err(|error| *own_failed_at = error.is_transient())?;
                    let mut rows =
                        claim.taken(rows, limit, |row| Position::of_key(T::taken_key(row)))?;
                    if claim.taking == Taking::Select {
                        pass_over_backed_off(claim, backoff, &mut rows, T::taken_key);
                    }
                    span.record("taken", rows.len());
                    if let Some(range) = claim.locked_check(range) {
                        let keys = kind.keys(query, conn, range, i64::MAX, true).await;
                        let key_of = |row: &T::Taken| Position::of_key(T::taken_key(row));
                        claim.verify_none_locked(keys.map_err(Error::from)?, &rows, key_of)?;
                    }
                    if let Some(bound) = timeout.filter(|_| !rows.is_empty()) {
                        if let Some(sql) = <C::Backend as Strategy>::bound_statements(bound) {
                            conn.batch_execute(&sql).await.map_err(Error::from)?;
                        }
                    }
                    let now = Instant::now();
                    let items: Vec<I> = rows.into_iter().map(|row| kind.hand(row, now)).collect();
                    let batch_keys: Vec<K> = items.iter().map(T::item_key).collect();
                    let mut succeeded = Vec::new();
                    for items in calls(items, savepoints && F::PER_ROW) {
                        let keys: Vec<K> = items.iter().map(T::item_key).collect();
                        // A failure that ends the batch names the rows that
                        // ran, not those still waiting their turn.
                        handed_over.extend(keys.iter().cloned());
                        let rows = keys.len();
                        let count_late = |(error, ran_late): (E, bool)| {
                            *late += usize::from(ran_late) * rows;
                            error
                        };
                        let told = |timeout| trace::ran_late(table, worker, &keys, timeout);
                        if !savepoints {
                            let called =
                                within(timeout, told, call(f.call(conn, items), catch)).await;
                            called.map_err(count_late).inspect_err(|_| {
                                if catch {
                                    backed_off(backoff, &batch_keys);
                                }
                                *failing_at = Some(Failing::Closure(batch_keys.clone()))
                            })?;
                            succeeded.extend(keys);
                            continue;
                        }
                        let kept: Vec<Option<I>> = items.iter().map(H::keep).collect();
                        let depth = transaction_depth(conn)?;
                        C::TransactionManager::begin_transaction(conn)
                            .await
                            .map_err(Error::from)?;
                        let called = within(timeout, told, call(f.call(conn, items), catch)).await;
                        match called.map_err(count_late) {
                            Ok(()) => {
                                C::TransactionManager::commit_transaction(conn)
                                    .await
                                    .map_err(Error::from)?;
                                succeeded.extend(keys);
                            }
                            Err(error) => {
                                backed_off(backoff, &keys);
                                if !roll_back_to(conn, depth).await {
                                    *failing_at = Some(Failing::Ends(handed_over.clone()));
                                    return Err(error);
                                }
                                for item in kept.into_iter().flatten() {
                                    let key = T::item_key(&item);
                                    let hooked = hook.failed(conn, T::into_row(item), &error).await;
                                    let dead = hooked.inspect_err(|_| {
                                        *failing_at = Some(Failing::Ends(handed_over.clone()))
                                    })?;
                                    if let Some(dead) = dead {
                                        trace::dead_letter(table, worker, &key, dead.attempts);
                                    }
                                }
                                caught_in.push(RowFailure::new(keys, error));
                            }
                        }
                    }
                    let processed = succeeded.len();
                    if T::FINISHES && processed > 0 {
                        let finished = kind.finish(conn, succeeded).await.map_err(Error::from);
                        finished.inspect_err(|error| *own_failed_at = error.is_transient())?;
                    }
                    Ok::<_, E>(processed)
                }
                .scope_boxed()
            })
            .await;
            match batch {
                Err(_) if moved && attempts < MOVED_ROW_RETRIES => {
                    attempts += 1;
                    trace::moved_row(attempts);
                }
                batch => {
                    break (
                        batch,
                        failing,
                        caught,
                        own_failed_transiently,
                        timed_out,
                        handed,
                    )
                }
            }
        };
        span.record("outcome", transaction_outcome(&batch));
        match (batch, failing) {
            (Ok(processed), _) => {
                self.claim.processed(processed);
                self.claim.timed_out(timed_out);
                for failure in caught {
                    self.failed.add(self.claim, T::table_name, failure);
                }
            }
            (Err(error), Some(Failing::Closure(keys))) if catch => {
                self.claim.timed_out(timed_out);
                let failure = RowFailure::new(keys, error);
                self.failed.add(self.claim, T::table_name, failure);
            }
            (Err(error), Some(Failing::Closure(keys) | Failing::Ends(keys))) => {
                return Err(RowFailure::new(keys, error))
            }
            // The crate's own statement failed: after the closures, the
            // rows they ran on are rolled back.
            (Err(error), None) => {
                self.transient = own_failed_transiently;
                return Err(RowFailure::new(handed, error));
            }
        }
        Ok(())
    }

    /// Takes a batch with a statement that commits before any closure runs,
    /// then hands it over outside any transaction, as the blocking driver's
    /// `hand_committed` does.
    async fn hand_committed<C, I, F>(
        &mut self,
        conn: &mut C,
        f: &mut F,
        range: KeyRange<Position<K>>,
        limit: i64,
        span: &trace::Span,
    ) -> Result<(), RowFailure<K, E>>
    where
        T: Takes<'a, Q, C, I, Key = K>,
        H: FailureHook<C, I, T::Row, E>,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
        I: Send,
        F: Closure<C, I, E>,
    {
        let catch = self.options.keep_going || H::SET;
        let sent = Instant::now();
        let rows = self
            .take_and_commit(conn, range, limit)
            .instrument(span.clone())
            .await
            .map_err(|e| self.outside(e))?;
        span.record("taken", rows.len())
            .record("outcome", "committed");
        let items: Vec<I> = rows
            .into_iter()
            .map(|row| self.kind.hand(row, sent))
            .collect();
        let mut processed = 0;
        let mut ended = Ok(());
        for (index, mut items) in calls(items, F::PER_ROW).into_iter().enumerate() {
            if index > 0 {
                match self.kind.refresh(&mut items[0], conn).await {
                    Ok(true) => {}
                    Ok(false) => {
                        self.claim.gone();
                        continue;
                    }
                    Err(error) => {
                        ended = Err(self.outside(error));
                        break;
                    }
                }
            }
            let keys: Vec<K> = items.iter().map(T::item_key).collect();
            let kept: Vec<Option<I>> = items.iter().map(H::keep).collect();
            let timeout = self.options.timeout;
            let (table, worker) = (self.table.as_str(), self.worker.as_deref());
            let told = |timeout| trace::ran_late(table, worker, &keys, timeout);
            let (error, late) = match within(timeout, told, call(f.call(conn, items), catch)).await
            {
                Ok(()) => {
                    processed += keys.len();
                    continue;
                }
                Err(failed) if catch => failed,
                Err((error, _)) => {
                    ended = Err(RowFailure::new(keys, error));
                    break;
                }
            };
            backed_off(self.backoff, &keys);
            let error = if H::SET {
                // The error goes into the hook's transaction, and comes back.
                let (kind, hook) = (&*self.kind, &mut *self.hook);
                let hooked = locking_transaction(conn, self.options.idle_bound(), |conn| {
                    async move {
                        for item in kept.into_iter().flatten() {
                            if kind.settle(&item, conn).await? {
                                let key = T::item_key(&item);
                                let row = T::into_row(item);
                                if let Some(dead) = hook.failed(conn, row, &error).await? {
                                    trace::dead_letter(table, worker, &key, dead.attempts);
                                }
                            }
                        }
                        Ok::<_, E>(error)
                    }
                    .scope_boxed()
                })
                .await;
                match hooked {
                    Ok(error) => error,
                    Err(hook_error) => {
                        ended = Err(RowFailure::new(keys, hook_error));
                        break;
                    }
                }
            } else {
                error
            };
            // Counted with the failure it is part of: a hook that fails ends
            // the call with neither.
            self.claim.timed_out(usize::from(late) * keys.len());
            let failure = RowFailure::new(keys, error);
            self.failed.add(self.claim, T::table_name, failure);
        }
        self.claim.processed(processed);
        ended
    }

    /// Takes a batch with a statement that commits on its own (or with
    /// MySQL's three statements, in a transaction of their own): a mark that
    /// is committed, or a visibility-timeout stamp; the blocking
    /// `take_and_commit`, awaited. A take that meets a row moved to another
    /// partition runs again (see `crate::transaction::locking_read`).
    async fn take_and_commit<C, I>(
        &mut self,
        conn: &mut C,
        range: KeyRange<Position<K>>,
        limit: i64,
    ) -> Result<Vec<T::Taken>, Error>
    where
        T: Takes<'a, Q, C, I, Key = K>,
        C: AsyncConnection,
        C::Backend: AsyncBackend,
    {
        let mut attempts = 0;
        let rows = loop {
            let mut moved = false;
            let (kind, query, range, clause) =
                (&*self.kind, self.query, range.clone(), &self.claim.clause);
            let taken = if self.claim.one_statement_mark {
                let rows = kind.take(query, conn, range, limit, clause).await;
                locking_read(rows, &mut moved)
            } else {
                let moved = &mut moved;
                locking_transaction(conn, self.options.idle_bound(), |conn| {
                    async move {
                        locking_read(kind.take(query, conn, range, limit, clause).await, moved)
                    }
                    .scope_boxed()
                })
                .await
            };
            match taken {
                Err(_) if moved && attempts < MOVED_ROW_RETRIES => {
                    attempts += 1;
                    trace::moved_row(attempts);
                }
                done => break done?,
            }
        };
        self.claim
            .taken(rows, limit, |row| Position::of_key(T::taken_key(row)))
    }
}
