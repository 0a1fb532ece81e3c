//! Pessimistic locking: hold a row lock for the duration of a closure.

use std::marker::PhantomData;
use std::sync::Arc;

use diesel::associations::HasTable;
use diesel::connection::LoadConnection;
use diesel::dsl;
use diesel::prelude::*;
use diesel::query_builder::{Query, QueryFragment};
use diesel::query_dsl::LoadQuery;
use diesel::QuerySource;

use crate::backend::ClaimBackend;
use crate::connection::BlockingConnection;
use crate::locking::{LockClause, LockOptions};
use crate::reusable::{Rebuild, Reusable};
use crate::sql::{lock_target, rendered, IdShape, InList, KeyShape, Locked, SelectWhere};
use crate::trace;
use crate::transaction::{again_if_moved, locking_read, locking_transaction, transaction_outcome};
use crate::{Blocking, Error, LockStrength, OnLocked};

/// Adds [`with_lock`](LockDsl::with_lock) and [`with_locks`](LockDsl::with_locks) to
/// Diesel queries.
pub trait LockDsl: Sized {
    /// Locks the one row this query selects and runs `f` with it, in a transaction
    /// that commits when `f` returns `Ok` and rolls back otherwise (or on panic).
    ///
    /// Waits for the lock (PostgreSQL `FOR NO KEY UPDATE OF <table>`, SQLite the
    /// database write lock). No row is [`Error::NotFound`]; more than one is
    /// [`Error::UnexpectedOutcome`] (and nothing is committed). Inside a transaction
    /// of the caller's it runs as a savepoint.
    fn with_lock<'q, C, R, T, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<T, E>
    where
        Self: LockQuery<'q, C, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnOnce(&mut C, R) -> Result<T, E>,
        E: From<Error>,
    {
        self.build_lock().run(conn, f)
    }

    /// Locks every row this query selects and runs `f` with them, like
    /// [`with_lock`](LockDsl::with_lock); no row is an empty `Vec`, not an error.
    ///
    /// Rows are locked in the order the database reads them: order the query by
    /// key (`.order(accounts::id)`) so that concurrent callers lock in the same
    /// order and do not deadlock.
    fn with_locks<'q, C, R, T, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<T, E>
    where
        Self: LockQuery<'q, C, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnOnce(&mut C, Vec<R>) -> Result<T, E>,
        E: From<Error>,
    {
        self.build_lock().run_all(conn, f)
    }

    /// Starts a row lock with options; run it with [`LockBuilder::run`] or
    /// [`LockBuilder::run_all`].
    fn build_lock(self) -> LockBuilder<Self> {
        LockBuilder::new(self)
    }
}

impl<Q: Query> LockDsl for Q {}

impl<F> LockDsl for Rebuild<F> {}

/// Adds [`with_lock`](LockModelDsl::with_lock) to a loaded model: its row
/// locked and read again, as Rails' `record.with_lock` and Django's
/// `select_for_update().get(pk=…)`.
///
/// ```
/// # include!("doctest_setup.rs");
/// use diesel_claim::prelude::*;
///
/// # fn main() -> Result<(), diesel_claim::Error> {
/// # let mut conn = establish_connection();
/// let account: Account = accounts::table.find(1).select(Account::as_select()).first(&mut conn)?;
/// // … the row may change meanwhile; `fresh` is what it holds under the lock.
/// account.with_lock(&mut conn, |conn, fresh: Account| {
///     diesel::update(&fresh)
///         .set(accounts::balance.eq(fresh.balance + 10))
///         .execute(conn)?;
///     Ok::<_, diesel_claim::Error>(())
/// })?;
/// # Ok(())
/// # }
/// ```
pub trait LockModelDsl: HasTable + Sized {
    /// The model's primary-key value.
    type Key: Clone;
    /// The model's primary key, wrapped for the key predicates.
    #[doc(hidden)]
    type KeyColumns;

    /// Locks this model's row, reads it again and runs `f` with the fresh copy,
    /// in a transaction, as [`LockDsl::with_lock`] on `table.find(key)` does.
    /// A row deleted since it was loaded is [`Error::NotFound`].
    fn with_lock<'q, C, T, E, F, Inferred>(&self, conn: &mut C, f: F) -> Result<T, E>
    where
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        Self: Selectable<C::Backend>,
        FreshRow<Self, Self::KeyColumns, Self::Key, C::Backend>: LockQuery<'q, C, Self>,
        F: FnOnce(&mut C, Self) -> Result<T, E>,
        E: From<Error>;
}

impl<M> LockModelDsl for M
where
    M: HasTable + 'static,
    &'static M: Identifiable,
    <&'static M as Identifiable>::Id: IdShape,
    Shape<M>: KeyShape<M>,
{
    type Key = <Shape<M> as KeyShape<M>>::Key;
    type KeyColumns = <Shape<M> as KeyShape<M>>::Columns;

    fn with_lock<'q, C, T, E, F, Inferred>(&self, conn: &mut C, f: F) -> Result<T, E>
    where
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        Self: Selectable<C::Backend>,
        FreshRow<Self, Self::KeyColumns, Self::Key, C::Backend>: LockQuery<'q, C, Self>,
        F: FnOnce(&mut C, Self) -> Result<T, E>,
        E: From<Error>,
    {
        LockBuilder::<_, Blocking>::new(fresh_row(self)).run(conn, f)
    }
}

/// The row of a loaded model, read again: `SELECT <its columns> FROM <its
/// table> WHERE <key> IN (<its key>)`.
pub type FreshRow<M, W, K, DB> = SelectWhere<
    dsl::AsSelect<M, DB>,
    <<M as HasTable>::Table as QuerySource>::FromClause,
    InList<W, K>,
>;

/// The shape of a model's key, from its `Identifiable::Id`.
type Shape<M> = <<&'static M as Identifiable>::Id as IdShape>::Shape;
/// [`FreshRow`] for a model of its own key's shape.
type FreshRowOf<M, DB> =
    FreshRow<M, <Shape<M> as KeyShape<M>>::Columns, <Shape<M> as KeyShape<M>>::Key, DB>;

pub(crate) fn fresh_row<M, DB>(model: &M) -> FreshRowOf<M, DB>
where
    M: HasTable + Selectable<DB> + 'static,
    &'static M: Identifiable,
    <&'static M as Identifiable>::Id: IdShape,
    Shape<M>: KeyShape<M>,
    DB: diesel::backend::Backend,
{
    SelectWhere {
        columns: M::as_select(),
        from: M::table().from_clause(),
        filter: InList {
            column: Shape::<M>::columns(),
            keys: vec![Shape::<M>::key(model)],
        },
    }
}

/// A row lock and its options, made by [`LockDsl::build_lock`].
///
/// ```
/// # include!("doctest_setup.rs");
/// use diesel_claim::prelude::*;
/// use diesel_claim::{Error, LockStrength};
///
/// # fn main() -> Result<(), Error> {
/// # let mut conn = establish_connection();
/// let balance = accounts::table
///     .find(1)
///     .build_lock()
///     .nowait()
///     .strength(LockStrength::Update)
///     .run(&mut conn, |_, account: Account| Ok::<_, Error>(account.balance))?;
/// assert_eq!(balance, 100);
///
/// let missing = accounts::table.find(42).with_lock(&mut conn, |_, _: Account| Ok::<_, Error>(()));
/// assert!(matches!(missing, Err(Error::NotFound)));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a lock does nothing until `.run(conn, f)` runs it"]
pub struct LockBuilder<Q, M = Blocking> {
    pub(crate) query: Q,
    pub(crate) lock: LockOptions,
    mode: PhantomData<M>,
}

impl<Q, M> LockBuilder<Q, M> {
    pub(crate) fn new(query: Q) -> Self {
        LockBuilder {
            query,
            lock: LockOptions::default(),
            mode: PhantomData,
        }
    }

    /// Sets what to do when a row is locked by another transaction (default:
    /// wait). [`OnLocked::Fail`] and [`OnLocked::Skip`] both return
    /// [`Error::LockNotAvailable`] at once if any row the query selects is locked,
    /// without an error inside the transaction: a caller's surrounding
    /// transaction stays usable. (They cost one more, unlocked, read.)
    pub fn on_locked(mut self, policy: OnLocked) -> Self {
        self.lock.on_locked(policy);
        self
    }

    /// Fails at once with [`Error::LockNotAvailable`] when the row is locked.
    pub fn nowait(self) -> Self {
        self.on_locked(OnLocked::Fail)
    }

    /// Waits for the lock (the default), bounded by the session's `lock_timeout`.
    pub fn wait(self) -> Self {
        self.on_locked(OnLocked::Wait)
    }

    /// Sets the lock strength (PostgreSQL; default `FOR NO KEY UPDATE`).
    pub fn strength(mut self, strength: LockStrength) -> Self {
        self.lock.strength(strength);
        self
    }

    /// The locking clause for rows of `locked_table` (the clause's `OF`).
    pub(crate) fn clause(
        &self,
        locked_table: Result<Option<Arc<str>>, Error>,
    ) -> Result<LockClause, Error> {
        let (_, clause) = self.lock.clone().resolve(OnLocked::Wait, || locked_table)?;
        Ok(clause)
    }
}

impl<Q> LockBuilder<Q> {
    /// Runs `f` with the locked row: see [`LockDsl::with_lock`].
    pub fn run<'q, C, R, T, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<T, E>
    where
        Q: LockQuery<'q, C, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnOnce(&mut C, R) -> Result<T, E>,
        E: From<Error>,
    {
        self.run_all(conn, |conn, rows: Vec<R>| f(conn, the_one_row(rows)?))
    }

    /// Runs `f` with all the locked rows: see [`LockDsl::with_locks`].
    pub fn run_all<'q, C, R, T, E, F, Inferred>(self, conn: &mut C, f: F) -> Result<T, E>
    where
        Q: LockQuery<'q, C, R>,
        C: BlockingConnection<Inferred>,
        C::Backend: ClaimBackend,
        F: FnOnce(&mut C, Vec<R>) -> Result<T, E>,
        E: From<Error>,
    {
        let clause = self.clause(self.query.locked_table())?;
        let skip_locked = clause.skip_locked;
        let nowait = self.lock.fails_at_once(OnLocked::Wait);
        // `f` runs once, after the locking read, which is all a moved row can
        // make run again.
        let mut f = Some(f);
        let span = clause.span(|| self.query.table_name());
        let locked = span.in_scope(|| {
            again_if_moved(|moved| {
                locking_transaction(conn, nowait, |conn| {
                    let rows = locking_read(self.query.rows(conn, Some(clause.clone())), moved)?;
                    if skip_locked {
                        let all = self.query.rows(conn, None).map_err(Error::from)?;
                        none_left_out(&rows, &all)?;
                    }
                    span.record("rows", rows.len());
                    let f = f.take().expect("a lock's closure runs once");
                    f(conn, rows)
                })
            })
        });
        span.record("outcome", transaction_outcome(&locked));
        locked
    }
}

/// The row `with_lock` runs with: no row is [`Error::NotFound`], more than one
/// [`Error::UnexpectedOutcome`].
pub(crate) fn the_one_row<R>(mut rows: Vec<R>) -> Result<R, Error> {
    match (rows.pop(), rows.len()) {
        (Some(row), 0) => Ok(row),
        (None, _) => Err(Error::NotFound),
        (Some(_), others) => Err(Error::UnexpectedOutcome(format!(
            "with_lock expects one row, the query selected {}",
            others + 1
        ))),
    }
}

/// Skip-locked leaves out the rows someone else holds. An unlocked read of `all`
/// the rows tells whether it left any out, without an error that would abort the
/// transaction.
pub(crate) fn none_left_out<R>(locked: &[R], all: &[R]) -> Result<(), Error> {
    if all.len() > locked.len() {
        trace::info!("lock not available: a row is locked by another transaction");
        return Err(Error::LockNotAvailable);
    }
    Ok(())
}

/// A query [`with_lock`](LockDsl::with_lock) can lock rows of type `R` of, on a
/// connection `C`: any Diesel select query whose row type names its table
/// (`#[derive(Identifiable)]` or `HasTable`).
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be locked through `{Self}`",
    note = "the row type must name its table (`#[derive(Identifiable)]`) and be loadable from \
            the query; a boxed query cannot be cloned: wrap the code that builds it in \
            `diesel_claim::rebuild(|| …)`"
)]
pub trait LockQuery<'q, C, R> {
    /// The locking clause's `OF` table, where the backend has row locks.
    #[doc(hidden)]
    fn locked_table(&self) -> Result<Option<std::sync::Arc<str>>, Error>;

    /// The locked table's name, unqualified, on every backend: for the
    /// lock's span.
    #[doc(hidden)]
    fn table_name(&self) -> String;

    /// The query's rows, locked by `lock`.
    #[doc(hidden)]
    fn rows(&self, conn: &mut C, lock: Option<LockClause>) -> diesel::QueryResult<Vec<R>>;
}

impl<'q, Q, C, R> LockQuery<'q, C, R> for Q
where
    Q: Reusable,
    C: LoadConnection,
    C::Backend: ClaimBackend,
    R: HasTable,
    <R::Table as diesel::QuerySource>::FromClause: QueryFragment<C::Backend>,
    Locked<Q::Query>: LoadQuery<'q, C, R>,
{
    fn locked_table(&self) -> Result<Option<std::sync::Arc<str>>, Error> {
        lock_target::<_, C::Backend>(&R::table())
    }

    fn table_name(&self) -> String {
        // A label: a name that cannot be read (never seen) shows as empty.
        rendered::unqualified_table_name::<_, C::Backend>(&R::table()).unwrap_or_default()
    }

    fn rows(&self, conn: &mut C, lock: Option<LockClause>) -> diesel::QueryResult<Vec<R>> {
        diesel::RunQueryDsl::load(
            Locked {
                query: self.query(),
                clause: lock,
            },
            conn,
        )
    }
}
