//! The kinds of claim: how a claim takes its rows, and what its closure gets.
//!
//! A [`ClaimBuilder`](crate::ClaimBuilder) names its kind in its third type
//! parameter, and its failure hook in its fourth; the builder's methods choose
//! them ([`mark`](crate::ClaimBuilder::mark),
//! [`visibility_timeout`](crate::ClaimBuilder::visibility_timeout),
//! [`candidates_from`](crate::ClaimBuilder::candidates_from),
//! [`on_failure`](crate::ClaimBuilder::on_failure)), and every kind runs
//! through the same methods (`each`, `each_batch`, `each_outcome`,
//! `each_batch_outcome`, and a worker's `run`). You rarely write these types
//! yourself.

use std::fmt;
use std::hash::Hash;
use std::time::Instant;

use diesel::associations::HasTable;
use diesel::connection::{Connection, LoadConnection};
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::{AsChangeset, QueryResult, QuerySource, RunQueryDsl};

use super::engine::{Claim, Taking};
use super::query::{
    update_by_keys, ClaimQuery, ClaimStatements, DeleteByKeys, MarkByKeys, MarkQuery, StampQuery,
};
use super::timed::{Claimed, StampedRow};
use super::Options;
use crate::backend::ClaimBackend;
use crate::locking::LockClause;
use crate::sql::stamp::NewStamp;
use crate::sql::{Delete as DeleteStatement, InList, KeyRange, Position};
use crate::Error;

/// Rows taken by a locking select and handed over in its transaction: the
/// default kind. `D` is what becomes of a row once its closure has
/// succeeded: nothing more than the closure wrote ([`Keep`]), or a statement
/// of the crate's, in the same transaction ([`Delete`], [`Set`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Select<D = Keep>(pub(crate) D);

/// Rows whose closure succeeded are left as the closure left them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Keep;

/// Rows whose closure succeeded are deleted
/// ([`then_delete`](crate::ClaimBuilder::then_delete)).
#[derive(Debug, Clone, Copy, Default)]
pub struct Delete;

/// Rows whose closure succeeded are updated with the changes `V`
/// ([`then_update`](crate::ClaimBuilder::then_update)).
#[derive(Debug, Clone, Copy)]
pub struct Set<V>(pub(crate) V);

/// Rows taken and marked by one statement, then handed over in its
/// transaction ([`mark`](crate::ClaimBuilder::mark)), or after it has
/// committed ([`mark_and_commit`](crate::ClaimBuilder::mark_and_commit)).
#[derive(Debug, Clone)]
pub struct Mark<V> {
    pub(crate) changes: V,
    pub(crate) commit_first: bool,
}

/// Rows stamped by a statement that commits at once, then handed over
/// outside any transaction as [`Claimed`] handles
/// ([`visibility_timeout`](crate::ClaimBuilder::visibility_timeout)).
#[derive(Debug, Clone, Copy)]
pub struct Stamp<Col> {
    pub(crate) stamp: NewStamp<Col>,
}

/// Rows selected as [`Select`] does, their candidates read on a replica
/// ([`candidates_from`](crate::ClaimBuilder::candidates_from)).
pub struct Replica<'r, Rc> {
    pub(crate) replica: &'r mut Rc,
}

impl<Rc> fmt::Debug for Replica<'_, Rc> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replica").finish_non_exhaustive()
    }
}

pub use super::retries::Retry;

/// No failure hook: a failing closure's rows are rolled back and left as
/// they were.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHook;

/// A failure hook, set by [`on_failure`](crate::ClaimBuilder::on_failure).
#[derive(Clone)]
pub struct OnFailure<F>(pub(crate) F);

impl<F> fmt::Debug for OnFailure<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OnFailure").finish_non_exhaustive()
    }
}

/// What a failure hook says of a row whose failure it recorded as the last
/// of its attempts under a retry schedule: a dead letter, out of the queue,
/// which the claim's driver tells of with the row's table, key and worker.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct DeadLetter {
    /// The attempts the row used.
    pub(crate) attempts: u32,
}

/// What every kind says of itself, in both APIs.
pub trait Kind {
    /// The statement that takes a batch, as the engine knows it.
    #[doc(hidden)]
    fn taking(&self) -> Taking;

    /// Candidates are read on another connection than the one rows are
    /// locked on.
    #[doc(hidden)]
    const READS_REPLICA: bool = false;

    /// The statement that takes a batch changes the rows (a mark).
    #[doc(hidden)]
    const MARKS: bool = false;
}

impl<D> Kind for Select<D> {
    fn taking(&self) -> Taking {
        Taking::Select
    }
}

impl<V> Kind for Mark<V> {
    fn taking(&self) -> Taking {
        if self.commit_first {
            Taking::MarkAndCommit
        } else {
            Taking::Mark
        }
    }

    const MARKS: bool = true;
}

impl<Col> Kind for Stamp<Col> {
    fn taking(&self) -> Taking {
        Taking::MarkAndCommit
    }
}

impl<Rc> Kind for Replica<'_, Rc> {
    fn taking(&self) -> Taking {
        Taking::Select
    }

    const READS_REPLICA: bool = true;
}

/// How a kind of claim runs on a blocking connection `C`, from the query
/// `Q`, for a closure that gets `I` for each row: the statement that takes a
/// batch, and what is handed over.
///
/// Implemented by each kind for the queries it can claim; the methods are
/// the crate's own.
#[diagnostic::on_unimplemented(
    message = "`{I}` cannot be claimed from `{Q}` on `{C}`",
    note = "the closure gets the rows of the query (a `#[derive(Identifiable)]` type loadable from \
            it), or, with a visibility timeout, `Claimed<Row, _>`"
)]
pub trait Takes<'q, Q, C: Connection, I>: Kind {
    /// The rows, as a failure hook gets them.
    #[doc(hidden)]
    type Row;
    /// The claimed table's primary-key value.
    #[doc(hidden)]
    type Key: Clone + Eq + Hash + fmt::Debug;
    /// What the taking statement returns per row.
    #[doc(hidden)]
    type Taken;

    /// Checks the query and the options, and sets up one run.
    #[doc(hidden)]
    fn start(
        &self,
        query: &Q,
        options: &Options,
        depth: u32,
    ) -> Result<Claim<Position<Self::Key>>, Error>;

    /// The claimed table's name, for spans and events.
    #[doc(hidden)]
    fn table_name() -> String;

    /// Up to `limit` positions of matching rows in `range`, without locks,
    /// read on `conn` (`exact`), or on the replica if the kind has one.
    #[doc(hidden)]
    fn keys(
        &mut self,
        query: &Q,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        exact: bool,
    ) -> QueryResult<Vec<Position<Self::Key>>>;

    /// Takes up to `limit` rows of `range` under `lock`.
    #[doc(hidden)]
    fn take(
        &mut self,
        query: &Q,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &LockClause,
    ) -> QueryResult<Vec<Self::Taken>>;

    /// A taken row's key.
    #[doc(hidden)]
    fn taken_key(taken: &Self::Taken) -> Self::Key;

    /// What the closure gets of a row taken by a statement sent at `sent`.
    #[doc(hidden)]
    fn hand(&self, taken: Self::Taken, sent: Instant) -> I;

    /// The key of what the closure gets.
    #[doc(hidden)]
    fn item_key(item: &I) -> Self::Key;

    /// The row of what the closure gets, for a failure hook.
    #[doc(hidden)]
    fn into_row(item: I) -> Self::Row;

    /// Readies a row taken earlier in its batch to be handed over: a stamp is
    /// moved on, so that the row comes with its whole time to live. `false`:
    /// the row is no longer this claim's.
    #[doc(hidden)]
    fn refresh(&self, _item: &mut I, _conn: &mut C) -> Result<bool, Error> {
        Ok(true)
    }

    /// After its closure failed, in the transaction its failure hook runs in,
    /// ends the claim of a row taken by a statement that committed on its
    /// own: a stamp is cleared, if the row still carries it. `false`: the row
    /// is no longer this claim's, and the hook does not run.
    #[doc(hidden)]
    fn settle(&self, _item: &I, _conn: &mut C) -> Result<bool, Error> {
        Ok(true)
    }

    /// The kind writes the rows whose closure succeeded, with
    /// [`finish`](Self::finish).
    #[doc(hidden)]
    const FINISHES: bool = false;

    /// Writes the rows at `keys`, whose closure succeeded, in the batch's
    /// transaction, after their savepoints: see [`Finish`].
    #[doc(hidden)]
    fn finish(&self, _conn: &mut C, _keys: Vec<Self::Key>) -> QueryResult<()> {
        Ok(())
    }
}

/// What becomes of a selected row once its closure has succeeded, on a
/// blocking connection: [`Keep`], [`Delete`] or [`Set`].
///
/// The crate's statement runs in the batch's transaction, after the rows'
/// savepoints, one for the batch: the row is written by the transaction that
/// locked it. On PostgreSQL that matters when failures are caught in
/// savepoints: a row locked by a transaction and written in a savepoint of
/// it gets a `MultiXact` as its deleter, and index scans cannot mark such
/// dead versions dead, so takes from the head of a queue slow down as done
/// rows pile up until vacuum (see the [job workers](crate::guide::workers)
/// page).
#[diagnostic::on_unimplemented(
    message = "the rows of `{Q}` cannot be written once done with `{Self}`",
    note = "`then_delete` deletes rows of the claimed table by key; `then_update(changes)` \
            takes an `AsChangeset` for that table"
)]
pub trait Finish<'q, Q, C: Connection, R> {
    /// Whether there is a statement to run.
    #[doc(hidden)]
    const FINISHES: bool;

    /// Writes the rows at `keys`.
    #[doc(hidden)]
    fn finish(
        &self,
        conn: &mut C,
        keys: Vec<<Q as ClaimStatements<C::Backend, R>>::Key>,
    ) -> QueryResult<()>
    where
        Q: ClaimStatements<C::Backend, R>;
}

impl<'q, Q, C: Connection, R> Finish<'q, Q, C, R> for Keep {
    const FINISHES: bool = false;

    fn finish(
        &self,
        _conn: &mut C,
        _keys: Vec<<Q as ClaimStatements<C::Backend, R>>::Key>,
    ) -> QueryResult<()>
    where
        Q: ClaimStatements<C::Backend, R>,
    {
        Ok(())
    }
}

// A statement Diesel cannot build is told as what `then_delete` does.
#[diagnostic::do_not_recommend]
impl<'q, Q, C, R> Finish<'q, Q, C, R> for Delete
where
    C: Connection,
    C::Backend: ClaimBackend,
    R: HasTable,
    Q: ClaimStatements<C::Backend, R>,
    DeleteByKeys<R, Q::KeyColumns, Q::Key>: ExecuteDsl<C>,
{
    const FINISHES: bool = true;

    fn finish(&self, conn: &mut C, keys: Vec<Q::Key>) -> QueryResult<()> {
        let delete = DeleteStatement {
            from: R::table().from_clause(),
            filter: InList {
                column: Q::key_columns(),
                keys,
            },
        };
        delete.execute(conn).map(drop)
    }
}

// Changes for another table, or a statement Diesel cannot build from
// them, are told as what `then_update` takes.
#[diagnostic::do_not_recommend]
impl<'q, Q, C, R, V> Finish<'q, Q, C, R> for Set<V>
where
    C: Connection,
    C::Backend: ClaimBackend,
    R: HasTable,
    Q: ClaimStatements<C::Backend, R>,
    V: AsChangeset<Target = R::Table> + Clone,
    MarkByKeys<R, V, Q::KeyColumns, Q::Key>: ExecuteDsl<C>,
{
    const FINISHES: bool = true;

    fn finish(&self, conn: &mut C, keys: Vec<Q::Key>) -> QueryResult<()> {
        let changes = self.0.clone().as_changeset();
        update_by_keys::<R, _, _, _>(Q::key_columns(), keys, changes)
            .execute(conn)
            .map(drop)
    }
}

/// The parts of a kind's `Takes` (in either API) that pass the query's own
/// on, for a kind whose closure gets the rows themselves: the key, the row,
/// the table's name, and the start, after `$check` (a mark's changes).
macro_rules! hands_rows_as_they_are {
    ($key:ty $(, $check:expr)?) => {
        type Row = R;
        type Key = $key;
        type Taken = R;

        fn taken_key(taken: &R) -> $key {
            <Q as $crate::claim::ClaimStatements<C::Backend, R>>::key(taken)
        }

        fn hand(&self, taken: R, _sent: std::time::Instant) -> R {
            taken
        }

        fn item_key(item: &R) -> $key {
            <Q as $crate::claim::ClaimStatements<C::Backend, R>>::key(item)
        }

        fn into_row(item: R) -> R {
            item
        }

        fn table_name() -> String {
            <Q as $crate::claim::ClaimStatements<C::Backend, R>>::table_name()
        }

        fn start(
            &self,
            query: &Q,
            options: &$crate::claim::Options,
            depth: u32,
        ) -> Result<$crate::claim::engine::Claim<$crate::sql::Position<$key>>, $crate::Error> {
            $(($check)(self)?;)?
            $crate::claim::kind::start::<C::Backend, R, Q, Self>(self, query, options, depth)
        }
    };
}

#[cfg(feature = "async")]
pub(crate) use hands_rows_as_they_are;

/// The run of a claim of `S`'s rows `R` with these options, for the kind
/// `kind`: the checks and the engine's setup, shared by every kind.
pub(crate) fn start<DB, R, S, K>(
    kind: &K,
    query: &S,
    options: &Options,
    depth: u32,
) -> Result<Claim<Position<S::Key>>, Error>
where
    DB: ClaimBackend,
    S: ClaimStatements<DB, R>,
    K: Kind,
{
    if options.retry_schedule && K::MARKS {
        return Err(Error::InvalidArgument(
            "a retry schedule cannot be combined with a mark: the mark takes a row out of the \
             queue before its closure runs, and stays when it fails; finish rows with \
             then_update instead"
                .to_owned(),
        ));
    }
    options.start::<DB, R, S>(kind.taking(), K::READS_REPLICA, query, depth)
}

impl<'q, Q, C, R, D> Takes<'q, Q, C, R> for Select<D>
where
    C: LoadConnection,
    C::Backend: ClaimBackend,
    Q: ClaimQuery<'q, C, R>,
    D: Finish<'q, Q, C, R>,
{
    hands_rows_as_they_are!(Q::Key);
    const FINISHES: bool = D::FINISHES;

    fn finish(&self, conn: &mut C, keys: Vec<Q::Key>) -> QueryResult<()> {
        self.0.finish(conn, keys)
    }

    fn keys(
        &mut self,
        query: &Q,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        _exact: bool,
    ) -> QueryResult<Vec<Position<Q::Key>>> {
        query.keys(conn, range, limit)
    }

    fn take(
        &mut self,
        query: &Q,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &LockClause,
    ) -> QueryResult<Vec<R>> {
        query.rows(conn, range, limit, lock)
    }
}

impl<'q, Q, C, R, Rc> Takes<'q, Q, C, R> for Replica<'_, Rc>
where
    C: LoadConnection,
    C::Backend: ClaimBackend,
    Rc: LoadConnection<Backend = C::Backend>,
    Q: ClaimQuery<'q, C, R> + ClaimQuery<'q, Rc, R>,
{
    hands_rows_as_they_are!(<Q as ClaimStatements<C::Backend, R>>::Key);

    fn keys(
        &mut self,
        query: &Q,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        exact: bool,
    ) -> QueryResult<Vec<Position<Self::Key>>> {
        if exact {
            ClaimQuery::<'q, C, R>::keys(query, conn, range, limit)
        } else {
            ClaimQuery::<'q, Rc, R>::keys(query, self.replica, range, limit)
        }
    }

    fn take(
        &mut self,
        query: &Q,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &LockClause,
    ) -> QueryResult<Vec<R>> {
        ClaimQuery::<'q, C, R>::rows(query, conn, range, limit, lock)
    }
}

impl<'q, Q, C, R, V> Takes<'q, Q, C, R> for Mark<V>
where
    C: LoadConnection,
    C::Backend: ClaimBackend,
    Q: MarkQuery<'q, C, R, V>,
{
    hands_rows_as_they_are!(Q::Key, |mark: &Self| Q::check_changes(&mark.changes));

    fn keys(
        &mut self,
        query: &Q,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        _exact: bool,
    ) -> QueryResult<Vec<Position<Q::Key>>> {
        query.keys(conn, range, limit)
    }

    fn take(
        &mut self,
        query: &Q,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &LockClause,
    ) -> QueryResult<Vec<R>> {
        query.mark(conn, range, limit, lock, &self.changes)
    }
}

impl<'q, Q, C, R, Col> Takes<'q, Q, C, Claimed<R, Col>> for Stamp<Col>
where
    C: LoadConnection,
    C::Backend: ClaimBackend,
    Q: StampQuery<'q, C, R, Col>,
    R: StampedRow<C, Col> + diesel::associations::HasTable,
    Col: Copy,
{
    type Row = R;
    type Key = Q::Key;
    type Taken = (R, i64);

    fn start(
        &self,
        query: &Q,
        options: &Options,
        depth: u32,
    ) -> Result<Claim<Position<Q::Key>>, Error> {
        start::<C::Backend, R, Q, Self>(self, query, options, depth)
    }

    fn table_name() -> String {
        Q::table_name()
    }

    fn keys(
        &mut self,
        query: &Q,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        _exact: bool,
    ) -> QueryResult<Vec<Position<Q::Key>>> {
        query.keys(conn, range, limit)
    }

    fn take(
        &mut self,
        query: &Q,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &LockClause,
    ) -> QueryResult<Vec<(R, i64)>> {
        query.stamp(conn, range, limit, lock, &self.stamp)
    }

    fn taken_key((row, _): &(R, i64)) -> Q::Key {
        Q::key(row)
    }

    fn hand(&self, (row, stamp): (R, i64), sent: Instant) -> Claimed<R, Col> {
        Claimed::new(row, stamp, self.stamp, sent)
    }

    fn item_key(item: &Claimed<R, Col>) -> Q::Key {
        Q::key(&item.row)
    }

    fn into_row(item: Claimed<R, Col>) -> R {
        item.row
    }

    fn refresh(&self, item: &mut Claimed<R, Col>, conn: &mut C) -> Result<bool, Error> {
        match item.extend(conn) {
            Ok(()) => Ok(true),
            Err(Error::ClaimLost { .. } | Error::NotFound) => Ok(false),
            Err(error) => Err(error),
        }
    }

    fn settle(&self, item: &Claimed<R, Col>, conn: &mut C) -> Result<bool, Error> {
        Ok(R::unstamp(item, conn, None::<()>)? > 0)
    }
}

/// A failure hook on a blocking connection `C`, for a closure that gets `I`
/// for rows `Row`, with errors `E`: [`NoHook`], or [`OnFailure`] with a
/// closure `FnMut(&mut C, Row, &E) -> Result<(), E>`.
#[diagnostic::on_unimplemented(
    message = "the failure hook does not fit this claim",
    note = "a failure hook is a closure `|conn, row: Row, error: &E| -> Result<(), E>`, with the \
            rows and the error type of the claim's closure, and rows that are `Clone` (the hook \
            gets the row as it was handed over)"
)]
pub trait FailureHook<C, I, Row, E> {
    /// Whether there is a hook to run.
    #[doc(hidden)]
    const SET: bool;

    /// A copy of what the closure gets, kept for the hook.
    #[doc(hidden)]
    fn keep(item: &I) -> Option<I>;

    /// Runs the hook: the row is a dead letter if it says so.
    #[doc(hidden)]
    fn failed(&mut self, conn: &mut C, row: Row, error: &E) -> Result<Option<DeadLetter>, E>;
}

impl<C, I, Row, E> FailureHook<C, I, Row, E> for NoHook {
    const SET: bool = false;

    fn keep(_item: &I) -> Option<I> {
        None
    }

    fn failed(&mut self, _conn: &mut C, _row: Row, _error: &E) -> Result<Option<DeadLetter>, E> {
        Ok(None)
    }
}

// A hook of another shape, or rows that are not `Clone`, are told as what
// a failure hook is.
#[diagnostic::do_not_recommend]
impl<C, I, Row, E, F> FailureHook<C, I, Row, E> for OnFailure<F>
where
    I: Clone,
    F: FnMut(&mut C, Row, &E) -> Result<(), E>,
{
    const SET: bool = true;

    fn keep(item: &I) -> Option<I> {
        Some(item.clone())
    }

    fn failed(&mut self, conn: &mut C, row: Row, error: &E) -> Result<Option<DeadLetter>, E> {
        (self.0)(conn, row, error).map(|()| None)
    }
}
