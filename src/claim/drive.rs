//! The blocking driver of a claim: the engine's steps carried out with a
//! kind's statements on a blocking connection, each batch in a transaction
//! of its own (or committed before its closure runs), and the failures
//! passed over on the way. The async driver (`aio/drive.rs`) carries out the
//! same steps on a diesel-async connection.

use std::hash::Hash;
use std::time::{Duration, Instant};

use diesel::connection::{Connection, LoadConnection, TransactionManager};
use diesel::QueryResult;

use super::engine::{Claim, Step, Taking};
use super::kind::{FailureHook, Takes};
use super::report::RowFailure;
use super::run::{call, calls, within, Closure};
use super::worker::{Backoff, PassedOver};
use super::{failures_in_savepoints, Options};
use crate::backend::strategy::Strategy;
use crate::backend::ClaimBackend;
use crate::locking::LockClause;
use crate::metrics::ClaimMetrics;
use crate::sql::{KeyRange, Position};
use crate::trace;
use crate::transaction::{
    again_if_moved, locking_read, locking_transaction, roll_back_to, transaction_depth,
    transaction_outcome,
};
use crate::Error;

/// The range of a claim's next batch, and how many rows it may take.
pub(crate) type NextBatch<K> = (KeyRange<Position<K>>, i64);

/// One run of a claim on a blocking connection: the engine's steps carried
/// out with the kind's statements, and the failures passed over so far.
pub(super) struct Driver<'d, Q, T, H, K, E> {
    pub(super) claim: &'d mut Claim<Position<K>>,
    pub(super) query: &'d Q,
    pub(super) kind: &'d mut T,
    pub(super) hook: &'d mut H,
    pub(super) options: &'d Options,
    pub(super) failed: PassedOver<'d, K, E>,
    /// The error that ended the run is one of the crate's statements', and
    /// running again mends it (see [`ClaimOutcome::transient`](crate::ClaimOutcome::transient)).
    pub(super) transient: bool,
    /// A worker's backoff: failing rows are recorded in it before their
    /// transaction ends, and rows it holds are passed over.
    pub(super) backoff: Option<&'d Backoff<K>>,
    pub(super) metrics: ClaimMetrics,
    /// The claimed table, and the worker that runs the claim (if one
    /// does), as the run's events name them.
    pub(super) table: String,
    pub(super) worker: Option<String>,
}

/// How a batch whose closure failed ends the transaction it ran in.
pub(crate) enum Failing<K> {
    /// The closure failed, and the call may go on without the batch's rows
    /// (`keep_going`).
    Closure(Vec<K>),
    /// The call ends: a failure that was not caught, a failure hook's own, or
    /// a savepoint that could not be rolled back to.
    Ends(Vec<K>),
}

impl<'q, Q, T, H, K, E> Driver<'_, Q, T, H, K, E>
where
    K: Clone + Eq + Hash + std::fmt::Debug,
    E: From<Error>,
{
    /// Runs the claim's steps until it is done; an error ends it.
    pub(super) fn run<C, I, F>(&mut self, conn: &mut C, f: &mut F) -> Result<(), RowFailure<K, E>>
    where
        T: Takes<'q, Q, C, I, Key = K>,
        H: FailureHook<C, I, T::Row, E>,
        C: LoadConnection,
        C::Backend: ClaimBackend,
        F: Closure<C, I, E>,
    {
        while let Some((range, limit)) = self.next_batch(conn).map_err(|e| self.outside(e))? {
            let span = self.claim.batch_span(limit);
            let _entered = span.enter();
            let began = Instant::now();
            let batch = if self.claim.taking == Taking::MarkAndCommit {
                self.hand_committed(conn, f, range, limit, &span)
            } else {
                self.take_and_hand(conn, f, range, limit, &span)
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

    /// Carries out the claim's unlocked reads until it asks for a batch: the
    /// batch's range and row limit, or `None` once the claim is done.
    fn next_batch<C, I>(&mut self, conn: &mut C) -> Result<Option<NextBatch<K>>, Error>
    where
        T: Takes<'q, Q, C, I, Key = K>,
        C: LoadConnection,
    {
        loop {
            match self.claim.next() {
                Step::Candidates(range, limit) => {
                    let keys = self.kind.keys(self.query, conn, range, limit, false)?;
                    self.claim.candidates(keys);
                }
                Step::StillMatching(range) => {
                    // Exact, so on the connection that locks the rows.
                    let keys = self.kind.keys(self.query, conn, range, i64::MAX, true)?;
                    self.claim.still_matching(keys);
                }
                Step::Batch(range, limit) => return Ok(Some((range, limit))),
                Step::Done => return Ok(None),
            }
        }
    }

    /// Takes a batch in a transaction of its own and hands it to the closure
    /// in it; with failures caught in savepoints, a failing call is rolled
    /// back alone and its failure hook runs, the rows still locked.
    fn take_and_hand<C, I, F>(
        &mut self,
        conn: &mut C,
        f: &mut F,
        range: KeyRange<Position<K>>,
        limit: i64,
        span: &trace::Span,
    ) -> Result<(), RowFailure<K, E>>
    where
        T: Takes<'q, Q, C, I, Key = K>,
        H: FailureHook<C, I, T::Row, E>,
        C: LoadConnection,
        C::Backend: ClaimBackend,
        F: Closure<C, I, E>,
    {
        let Driver {
            claim,
            query,
            kind,
            hook,
            options,
            failed,
            transient,
            backoff,
            metrics: _,
            table,
            worker,
        } = self;
        let (table, worker) = (table.as_str(), worker.as_deref());
        let catch = options.keep_going || H::SET;
        let savepoints = failures_in_savepoints(options, claim.taking, H::SET, F::PER_ROW);
        let timeout = options.timeout;
        let mut failing = None;
        let mut caught = Vec::new();
        let mut own_failed_transiently = false;
        let mut timed_out = 0;
        let mut handed = Vec::new();
        let batch = again_if_moved(|moved| {
            (failing, caught, own_failed_transiently, timed_out) = (None, Vec::new(), false, 0);
            handed.clear();
            locking_transaction(conn, claim.nowait, |conn| {
                let rows = kind.take(query, conn, range.clone(), limit, &claim.clause);
                let rows = locking_read(rows, moved)
                    .inspect_err(|error| own_failed_transiently = error.is_transient())?;
                let mut rows =
                    claim.taken(rows, limit, |row| Position::of_key(T::taken_key(row)))?;
                if claim.taking == Taking::Select {
                    pass_over_backed_off(claim, *backoff, &mut rows, T::taken_key);
                }
                span.record("taken", rows.len());
                if let Some(range) = claim.locked_check(range.clone()) {
                    let keys = kind
                        .keys(query, conn, range, i64::MAX, true)
                        .map_err(Error::from)?;
                    let key_of = |row: &T::Taken| Position::of_key(T::taken_key(row));
                    claim.verify_none_locked(keys, &rows, key_of)?;
                }
                if let Some(bound) = timeout.filter(|_| !rows.is_empty()) {
                    bound_statements::<C>(conn, bound)?;
                }
                let now = Instant::now();
                let items: Vec<I> = rows.into_iter().map(|row| kind.hand(row, now)).collect();
                let batch_keys: Vec<K> = items.iter().map(T::item_key).collect();
                let mut succeeded = Vec::new();
                for items in calls(items, savepoints && F::PER_ROW) {
                    let keys: Vec<K> = items.iter().map(T::item_key).collect();
                    // A failure that ends the batch names the rows that ran,
                    // not those still waiting their turn.
                    handed.extend(keys.iter().cloned());
                    let kept: Vec<Option<I>> = match savepoints {
                        true => items.iter().map(H::keep).collect(),
                        false => Vec::new(),
                    };
                    let rows = keys.len();
                    let run = |conn: &mut C| {
                        let told = |timeout| trace::ran_late(table, worker, &keys, timeout);
                        within(timeout, told, || call(|| f.call(conn, items), catch))
                            .inspect_err(|(_, late)| timed_out += usize::from(*late) * rows)
                            .map_err(|(error, _)| error)
                    };
                    if !savepoints {
                        let called = run(conn);
                        called.inspect_err(|_| {
                            if catch {
                                backed_off(*backoff, &batch_keys);
                            }
                            failing = Some(Failing::Closure(batch_keys.clone()))
                        })?;
                        succeeded.extend(keys);
                        continue;
                    }
                    match in_savepoint(conn, run)? {
                        Saved::Done => succeeded.extend(keys),
                        Saved::RolledBack(error) => {
                            backed_off(*backoff, &keys);
                            for item in kept.into_iter().flatten() {
                                let key = T::item_key(&item);
                                let hooked = hook.failed(conn, T::into_row(item), &error);
                                let dead = hooked.inspect_err(|_| {
                                    failing = Some(Failing::Ends(handed.clone()))
                                })?;
                                if let Some(dead) = dead {
                                    trace::dead_letter(table, worker, &key, dead.attempts);
                                }
                            }
                            caught.push(RowFailure::new(keys, error));
                        }
                        Saved::Lost(error) => {
                            failing = Some(Failing::Ends(handed.clone()));
                            return Err(error);
                        }
                    }
                }
                let processed = succeeded.len();
                if T::FINISHES && processed > 0 {
                    let finished = kind.finish(conn, succeeded).map_err(Error::from);
                    finished.inspect_err(|error| own_failed_transiently = error.is_transient())?;
                }
                Ok::<_, E>(processed)
            })
        });
        span.record("outcome", transaction_outcome(&batch));
        match (batch, failing) {
            (Ok(processed), _) => {
                claim.processed(processed);
                claim.timed_out(timed_out);
                for failure in caught {
                    failed.add(claim, T::table_name, failure);
                }
            }
            (Err(error), Some(Failing::Closure(keys))) if catch => {
                claim.timed_out(timed_out);
                failed.add(claim, T::table_name, RowFailure::new(keys, error));
            }
            (Err(error), Some(Failing::Closure(keys) | Failing::Ends(keys))) => {
                return Err(RowFailure::new(keys, error))
            }
            // The crate's own statement failed: after the closures, the rows
            // they ran on are rolled back.
            (Err(error), None) => {
                *transient = own_failed_transiently;
                return Err(RowFailure::new(handed, error));
            }
        }
        Ok(())
    }

    /// Takes a batch with a statement that commits before any closure runs (a
    /// mark committed on its own, or a visibility-timeout stamp), then hands
    /// it over outside any transaction; a failure hook runs in a transaction
    /// of its own, which first ends the row's claim (see [`Takes::settle`]).
    fn hand_committed<C, I, F>(
        &mut self,
        conn: &mut C,
        f: &mut F,
        range: KeyRange<Position<K>>,
        limit: i64,
        span: &trace::Span,
    ) -> Result<(), RowFailure<K, E>>
    where
        T: Takes<'q, Q, C, I, Key = K>,
        H: FailureHook<C, I, T::Row, E>,
        C: LoadConnection,
        C::Backend: ClaimBackend,
        F: Closure<C, I, E>,
    {
        let catch = self.options.keep_going || H::SET;
        let sent = Instant::now();
        let (query, kind) = (self.query, &mut *self.kind);
        let take = |conn: &mut C, range, limit, clause: &LockClause| {
            kind.take(query, conn, range, limit, clause)
        };
        let key_of = |row: &T::Taken| Position::of_key(T::taken_key(row));
        let rows = take_and_commit(self.claim, conn, take, range, limit, key_of);
        let rows = rows.map_err(|e| self.outside(e))?;
        // The rows are committed: the batch's span ends with them, before the
        // closure runs outside any transaction.
        span.record("taken", rows.len())
            .record("outcome", "committed");
        let items: Vec<I> = rows
            .into_iter()
            .map(|row| self.kind.hand(row, sent))
            .collect();
        let mut processed = 0;
        let ended = (|| {
            for (index, mut items) in calls(items, F::PER_ROW).into_iter().enumerate() {
                if index > 0
                    && !self
                        .kind
                        .refresh(&mut items[0], conn)
                        .map_err(|e| self.outside(e))?
                {
                    self.claim.gone();
                    continue;
                }
                let keys: Vec<K> = items.iter().map(T::item_key).collect();
                let kept: Vec<Option<I>> = items.iter().map(H::keep).collect();
                let timeout = self.options.timeout;
                let (table, worker) = (self.table.as_str(), self.worker.as_deref());
                let told = |timeout| trace::ran_late(table, worker, &keys, timeout);
                let (error, late) =
                    match within(timeout, told, || call(|| f.call(conn, items), catch)) {
                        Ok(()) => {
                            processed += keys.len();
                            continue;
                        }
                        Err(failed) if catch => failed,
                        Err((error, _)) => return Err(RowFailure::new(keys, error)),
                    };
                backed_off(self.backoff, &keys);
                if H::SET {
                    let (kind, hook) = (&*self.kind, &mut *self.hook);
                    let hooked = locking_transaction(conn, false, |conn| {
                        for item in kept.into_iter().flatten() {
                            if kind.settle(&item, conn)? {
                                let key = T::item_key(&item);
                                if let Some(dead) = hook.failed(conn, T::into_row(item), &error)? {
                                    trace::dead_letter(table, worker, &key, dead.attempts);
                                }
                            }
                        }
                        Ok::<_, E>(())
                    });
                    hooked.map_err(|hook_error| RowFailure::new(keys.clone(), hook_error))?;
                }
                // Counted with the failure it is part of: a hook that fails
                // ends the call with neither.
                self.claim.timed_out(usize::from(late) * keys.len());
                let failure = RowFailure::new(keys, error);
                self.failed.add(self.claim, T::table_name, failure);
            }
            Ok(())
        })();
        self.claim.processed(processed);
        ended
    }
}

/// Records rows whose closure failed in a worker's backoff, before their
/// transaction ends (both APIs): a loop whose take locks them once it has
/// ended finds them there.
pub(crate) fn backed_off<K: Clone + Eq + Hash>(backoff: Option<&Backoff<K>>, keys: &[K]) {
    if let Some(backoff) = backoff {
        backoff.failed(keys);
    }
}

/// Passes over the rows of a take that a worker's backoff holds (both APIs):
/// their failure was recorded after this take began, and they stay out of the
/// rest of the run. Only for rows a select took: a mark or a stamp has
/// already changed its rows, which must reach the closure.
pub(crate) fn pass_over_backed_off<K, R>(
    claim: &mut Claim<Position<K>>,
    backoff: Option<&Backoff<K>>,
    rows: &mut Vec<R>,
    key_of: impl Fn(&R) -> K,
) where
    K: Clone + Eq + Hash,
{
    let Some(backoff) = backoff else { return };
    let mut held = Vec::new();
    rows.retain(|row| {
        let key = key_of(row);
        let free = !backoff.holds(&key);
        if !free {
            held.push(Position::of_key(key));
        }
        free
    });
    claim.exclude(held);
}

/// Claims a batch with a statement that commits on its own (or in a
/// transaction of its own, where the backend needs one), before any closure
/// runs: a mark that is committed, or a visibility-timeout stamp.
pub(crate) fn take_and_commit<C, R, K>(
    claim: &mut Claim<Position<K>>,
    conn: &mut C,
    mut take: impl FnMut(&mut C, KeyRange<Position<K>>, i64, &LockClause) -> QueryResult<Vec<R>>,
    range: KeyRange<Position<K>>,
    limit: i64,
    position_of: impl Fn(&R) -> Position<K>,
) -> Result<Vec<R>, Error>
where
    K: Clone + Eq + Hash,
    C: LoadConnection,
    C::Backend: ClaimBackend,
{
    let rows = again_if_moved(|moved| {
        let mut take =
            |conn: &mut C| locking_read(take(conn, range.clone(), limit, &claim.clause), moved);
        if claim.one_statement_mark {
            take(conn)
        } else {
            // SQLite: a lone `UPDATE` would read first and then fail to take
            // the write lock if another writer got in between. MySQL: the
            // mark is three statements.
            locking_transaction(conn, claim.nowait, take)
        }
    })?;
    claim.taken(rows, limit, position_of)
}

/// What became of a closure run in a savepoint.
enum Saved<E> {
    /// It succeeded: the savepoint is released.
    Done,
    /// It failed, and its work is rolled back to the savepoint: the rows the
    /// transaction took before are still locked.
    RolledBack(E),
    /// It failed, and the rollback to the savepoint failed too: the
    /// transaction is lost (a deadlock victim's, on MySQL).
    Lost(E),
}

/// Runs `body` in a savepoint of the transaction open on `conn`.
fn in_savepoint<C, E>(
    conn: &mut C,
    body: impl FnOnce(&mut C) -> Result<(), E>,
) -> Result<Saved<E>, Error>
where
    C: Connection,
{
    let depth = transaction_depth(conn)?;
    C::TransactionManager::begin_transaction(conn)?;
    match body(conn) {
        Ok(()) => {
            C::TransactionManager::commit_transaction(conn)?;
            Ok(Saved::Done)
        }
        Err(error) if roll_back_to(conn, depth) => Ok(Saved::RolledBack(error)),
        Err(error) => Ok(Saved::Lost(error)),
    }
}

/// Bounds the statements of the rest of the transaction open on `conn` by
/// a claim's `timeout`, where the backend can (PostgreSQL).
fn bound_statements<C: Connection>(conn: &mut C, timeout: Duration) -> Result<(), Error>
where
    C::Backend: ClaimBackend,
{
    if let Some(sql) = <C::Backend as Strategy>::bound_statements(timeout) {
        conn.batch_execute(&sql)?;
    }
    Ok(())
}
