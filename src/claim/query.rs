//! The queries a claim runs on: what a claimable query must be able to do
//! (read keys, take rows under a lock, mark them), and the statements built
//! from the caller's query for it.

use std::hash::Hash;
use std::marker::PhantomData;
use std::sync::Arc;

use diesel::associations::HasTable;
use diesel::connection::Connection;
use diesel::dsl;
use diesel::prelude::*;
use diesel::query_builder::{AsQuery, QueryFragment};
use diesel::query_dsl::methods::ExecuteDsl;
use diesel::query_dsl::methods::FilterDsl;
use diesel::query_dsl::LoadQuery;

use crate::backend::strategy::Strategy;
use crate::backend::ClaimBackend;
use crate::locking::LockClause;
use crate::reusable::Reusable;
use crate::sql::stamp::{NewStamp, StampMicros, StampType};
use crate::sql::{
    lock_target, rendered, BuildOn, ClaimOrder, Delete, IdShape, InList, InRange, KeyRange,
    KeyShape, KeysIn, Locked, OrderTerms, Ordered, Position, Positioned, QueryOrder, Ranged,
    Returning, SelectWhere, Selected, Update,
};
use crate::Error;

/// The statements a claim runs, built from the caller's query for rows of
/// type `R` on the backend `DB`: implemented for the queries and rows of
/// [`ClaimQuery`], which asks for this on every connection of `DB`.
///
/// An error that names it means what [`ClaimQuery`]'s does: the row type must
/// `#[derive(Identifiable)]` (a primary key of one to three columns) and be
/// loadable from the query, which must be `Clone` (or built by
/// [`rebuild`](crate::rebuild)).
// The statements do not depend on the connection, so one implementation
// serves the blocking `ClaimQuery` and the async `aio::ClaimQuery` alike.
// Told as `ClaimQuery` is, where the compiler stops here (see the impl).
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}`",
    label = "rows of type `{R}` cannot be claimed from this query",
    note = "the row type must `#[derive(Identifiable)]` (a primary key of one to three columns) and \
            be loadable from the query; with a join, `.select(YourRow::as_select())`; a boxed \
            query cannot be cloned: wrap the code that builds it in `diesel_claim::rebuild(|| …)`"
)]
pub trait ClaimStatements<DB, R>: Reusable {
    /// The claimed table's primary-key value.
    #[doc(hidden)]
    type Key: Clone + Eq + Hash + std::fmt::Debug;
    /// The claimed table's primary key, wrapped for the key predicates.
    #[doc(hidden)]
    type KeyColumns: Copy;
    /// The query reading positions (see [`Position`]).
    #[doc(hidden)]
    type Keys;
    /// What it loads, for [`position`](Self::position).
    #[doc(hidden)]
    type Loaded;
    /// The query reading keys alone, in the claim order, to lock.
    #[doc(hidden)]
    type LockedKeys;
    /// The query reading rows, to lock.
    #[doc(hidden)]
    type Rows;
    /// The claim order is the key's (the query has no `ORDER BY`).
    #[doc(hidden)]
    const ORDERED_BY_KEY: bool;

    /// The locking clause's `OF` table, where the backend has row locks,
    /// once the query is known to be claimable as written (no `DISTINCT`,
    /// `LIMIT` or `OFFSET`).
    #[doc(hidden)]
    fn claimed_table(&self) -> Result<Option<Arc<str>>, Error>;

    /// The claimed table's name, unqualified, on every backend: for the
    /// claim's span.
    #[doc(hidden)]
    fn table_name() -> String;

    /// The key of a row.
    #[doc(hidden)]
    fn key(row: &R) -> Self::Key;

    /// The claimed table's primary key, wrapped.
    #[doc(hidden)]
    fn key_columns() -> Self::KeyColumns;

    /// A position as [`keys_query`](Self::keys_query) loads it.
    #[doc(hidden)]
    fn position(loaded: Self::Loaded) -> Position<Self::Key>;

    /// Up to `limit` positions of matching rows in `range`, in the claim
    /// order, read without locks.
    #[doc(hidden)]
    fn keys_query(&self, range: KeyRange<Position<Self::Key>>, limit: i64) -> Self::Keys;

    /// Up to `limit` keys of matching rows in `range`, in the claim order, for
    /// a locking subquery.
    #[doc(hidden)]
    fn locked_keys_query(
        &self,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
    ) -> Self::LockedKeys;

    /// Up to `limit` matching rows in `range`, in the claim order, locked by
    /// `lock`.
    #[doc(hidden)]
    fn rows_query(
        &self,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &LockClause,
    ) -> Locked<Self::Rows>;
}

/// A query [`claim_each`](crate::ClaimDsl::claim_each) can claim rows of type `R` from, on a
/// connection `C`.
///
/// Implemented for every Diesel select query (tables, `filter`ed queries, joins)
/// whose rows identify the claimed table by `#[derive(Identifiable)]`, with a
/// primary key of one to three columns, and are `'static` (own their data).
/// The methods are the crate's own; callers only name the trait in bounds.
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}`",
    label = "rows of type `{R}` cannot be claimed from this query",
    note = "the row type must `#[derive(Identifiable)]` (a primary key of one to three columns) and \
            be loadable from the query; with a join, `.select(YourRow::as_select())`; a boxed \
            query cannot be cloned: wrap the code that builds it in `diesel_claim::rebuild(|| …)`"
)]
pub trait ClaimQuery<'q, C: Connection, R>: ClaimStatements<C::Backend, R> {
    /// Runs [`keys_query`](ClaimStatements::keys_query).
    #[doc(hidden)]
    fn keys(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
    ) -> QueryResult<Vec<Position<Self::Key>>>;

    /// Runs [`rows_query`](ClaimStatements::rows_query).
    #[doc(hidden)]
    fn rows(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &LockClause,
    ) -> QueryResult<Vec<R>>;
}

/// A query [`mark`](crate::ClaimBuilder::mark) can claim rows of type `R` from, on a
/// connection `C`, marking them with the changeset `V`.
///
/// Implemented for the queries of [`ClaimQuery`] whose rows are also
/// [`Selectable`](diesel::Selectable) from the claimed table, with changesets
/// for that table.
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}` and marked with `{V}`",
    note = "the row type must be `Identifiable` and `Selectable` from the claimed table, and \
            the changes an `AsChangeset` for that table; a boxed query cannot be cloned: wrap the \
            code that builds it in `diesel_claim::rebuild(|| …)`"
)]
pub trait MarkQuery<'q, C: Connection, R, V>: ClaimQuery<'q, C, R> {
    /// Rejects a changeset that changes nothing.
    #[doc(hidden)]
    fn check_changes(changes: &V) -> Result<(), Error>;

    /// Up to `limit` matching rows in `range`, locked by `lock`, updated by
    /// `changes`, as updated.
    #[doc(hidden)]
    fn mark(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &LockClause,
        changes: &V,
    ) -> QueryResult<Vec<R>>;
}

/// A query a [visibility-timeout claim](crate::ClaimBuilder::visibility_timeout)
/// can take rows of type `R` from, on a connection `C`, stamping them in the
/// column `Col`.
///
/// Implemented for the queries of [`ClaimQuery`] whose rows are also
/// [`Selectable`](diesel::Selectable) from the claimed table, with a stamp
/// column of that table.
#[diagnostic::on_unimplemented(
    message = "rows of type `{R}` cannot be claimed from `{Self}` with a stamp in `{Col}`",
    note = "the row type must be `Identifiable` and `Selectable` from the claimed table, and \
            the stamp a nullable timestamp column of that table; a boxed query cannot be cloned: \
            wrap the code that builds it in `diesel_claim::rebuild(|| …)`"
)]
pub trait StampQuery<'q, C: Connection, R, Col>: ClaimQuery<'q, C, R> {
    /// Up to `limit` matching rows in `range`, locked by `lock`, stamped by
    /// `stamp`, with the stamp written.
    #[doc(hidden)]
    fn stamp(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &LockClause,
        stamp: &NewStamp<Col>,
    ) -> QueryResult<Vec<(R, i64)>>;
}

pub(crate) type PrimaryKey<R> = <<R as HasTable>::Table as Table>::PrimaryKey;
/// `Q` within a range of positions, in the order `O`, whose key's columns are
/// `W` (the primary key wrapped for the key predicates) and values `K`.
pub(crate) type InQuery<Q, O, W, K> = dsl::Filter<Q, InRange<Positioned<O, W>, Position<K>>>;
type ClaimOrdering<O, W, K> = <O as ClaimOrder<W, K>>::Ordering;
type Selection<O, W, K> = <O as ClaimOrder<W, K>>::Selection;
/// The statement `S` of a claim, on `Q` whole or within a range of positions.
type Either<S, Q, O, W, K> =
    Ranged<<S as BuildOn<Q>>::Output, <S as BuildOn<InQuery<Q, O, W, K>>>::Output>;
pub(crate) type KeysQuery<Q, O, W, K> =
    Either<Selected<Selection<O, W, K>, ClaimOrdering<O, W, K>>, Q, O, W, K>;
pub(crate) type LockedKeysQuery<Q, O, Pk, W, K> =
    Either<Selected<Pk, ClaimOrdering<O, W, K>>, Q, O, W, K>;
pub(crate) type RowsQuery<Q, O, W, K> = Either<Ordered<ClaimOrdering<O, W, K>>, Q, O, W, K>;
pub(crate) type FromClause<R> = <<R as HasTable>::Table as diesel::QuerySource>::FromClause;
/// [`taken_in_one`]: changes `Ch` on the rows at the locked keys `KQ`,
/// returning `S`.
pub(crate) type TakenInOne<R, Ch, W, K, KQ, S> =
    Returning<Update<FromClause<R>, Ch, KeysIn<W, Locked<KQ>, K>>, S>;
pub(crate) type MarkStatement<R, V, W, K, KQ, DB> =
    TakenInOne<R, <V as AsChangeset>::Changeset, W, K, KQ, dsl::AsSelect<R, DB>>;
pub(crate) type MarkByKeys<R, V, W, K> =
    Update<FromClause<R>, <V as AsChangeset>::Changeset, InList<W, K>>;
pub(crate) type DeleteByKeys<R, W, K> = Delete<FromClause<R>, InList<W, K>>;
pub(crate) type ReadByKeys<R, W, K, DB> =
    SelectWhere<dsl::AsSelect<R, DB>, FromClause<R>, InList<W, K>>;
pub(crate) type Stamped<R, Col, DB> = (dsl::AsSelect<R, DB>, StampMicros<Col>);
pub(crate) type StampStatement<R, Col, W, K, KQ, DB> =
    TakenInOne<R, NewStamp<Col>, W, K, KQ, Stamped<R, Col, DB>>;
pub(crate) type StampByKeys<R, Col, W, K> = Update<FromClause<R>, NewStamp<Col>, InList<W, K>>;
pub(crate) type ReadStampedByKeys<R, Col, W, K, DB> =
    SelectWhere<Stamped<R, Col, DB>, FromClause<R>, InList<W, K>>;
/// The shape of the claimed rows' key, from their `Identifiable::Id`.
type Shape<R> = <<&'static R as Identifiable>::Id as IdShape>::Shape;
type Key<R> = <Shape<R> as KeyShape<R>>::Key;
type Wrapped<R> = <Shape<R> as KeyShape<R>>::Columns;

// A failure in here is told as the `ClaimQuery` the caller asked for, whose
// message names what a claimed query and row need; the order, whose message
// says more, is checked there first.
#[diagnostic::do_not_recommend]
impl<Q, DB, R, Pk, O> ClaimStatements<DB, R> for Q
where
    Q: Reusable,
    Q::Query: FilterDsl<InRange<Positioned<O, Wrapped<R>>, Position<Key<R>>>>,
    Q::Query: AsQuery + QueryFragment<DB>,
    <Q::Query as AsQuery>::Query: QueryOrder<Terms = O>,
    O: ClaimOrder<Wrapped<R>, Key<R>, Selection: Expression, Ordering: Expression>,
    DB: ClaimBackend,
    R: HasTable,
    R::Table: Table<PrimaryKey = Pk>,
    <R::Table as diesel::QuerySource>::FromClause: QueryFragment<DB>,
    R: 'static,
    &'static R: Identifiable,
    <&'static R as Identifiable>::Id: IdShape,
    Shape<R>: KeyShape<R>,
    Pk: Expression + Copy,
    Selected<O::Selection, O::Ordering>:
        BuildOn<Q::Query> + BuildOn<InQuery<Q::Query, O, Wrapped<R>, Key<R>>>,
    Selected<Pk, O::Ordering>:
        BuildOn<Q::Query> + BuildOn<InQuery<Q::Query, O, Wrapped<R>, Key<R>>>,
    Ordered<O::Ordering>: BuildOn<Q::Query> + BuildOn<InQuery<Q::Query, O, Wrapped<R>, Key<R>>>,
{
    type Key = Key<R>;
    type KeyColumns = Wrapped<R>;
    type Keys = KeysQuery<Q::Query, O, Wrapped<R>, Key<R>>;
    type Loaded = O::Loaded;
    type LockedKeys = LockedKeysQuery<Q::Query, O, Pk, Wrapped<R>, Key<R>>;
    type Rows = RowsQuery<Q::Query, O, Wrapped<R>, Key<R>>;
    const ORDERED_BY_KEY: bool = O::LEN == 0;

    fn claimed_table(&self) -> Result<Option<Arc<str>>, Error> {
        let query = rendered::render::<DB>(&self.query())?;
        rendered::check_claimable(&query, Self::ORDERED_BY_KEY)?;
        lock_target::<_, DB>(&R::table())
    }

    fn table_name() -> String {
        // A label: a name that cannot be read (never seen) shows as empty.
        rendered::unqualified_table_name::<_, DB>(&R::table()).unwrap_or_default()
    }

    fn key(row: &R) -> Self::Key {
        Shape::<R>::key(row)
    }

    fn key_columns() -> Self::KeyColumns {
        Shape::<R>::columns()
    }

    fn position(loaded: O::Loaded) -> Position<Self::Key> {
        O::position(loaded)
    }

    fn keys_query(&self, range: KeyRange<Position<Self::Key>>, limit: i64) -> Self::Keys {
        let key = Self::key_columns();
        let order = O::ordering(key);
        self.ranged(range).build(Selected {
            columns: O::selection(key),
            rows: Ordered { order, limit },
        })
    }

    fn locked_keys_query(
        &self,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
    ) -> Self::LockedKeys {
        let order = O::ordering(Self::key_columns());
        self.ranged(range).build(Selected {
            columns: primary_key::<R>(),
            rows: Ordered { order, limit },
        })
    }

    fn rows_query(
        &self,
        range: KeyRange<Position<Self::Key>>,
        limit: i64,
        lock: &LockClause,
    ) -> Locked<Self::Rows> {
        let order = O::ordering(Self::key_columns());
        Locked {
            query: self.ranged(range).build(Ordered { order, limit }),
            clause: Some(lock.clone()),
        }
    }
}

/// The caller's query in the claim order's positions: whole when a range
/// bounds nothing, else within the range.
trait InPositions<R, O>: Reusable {
    #[allow(clippy::type_complexity)]
    fn ranged(
        &self,
        range: KeyRange<Position<Key<R>>>,
    ) -> Ranged<Self::Query, InQuery<Self::Query, O, Wrapped<R>, Key<R>>>
    where
        R: HasTable + 'static,
        &'static R: Identifiable,
        <&'static R as Identifiable>::Id: IdShape,
        Shape<R>: KeyShape<R>,
        O: ClaimOrder<Wrapped<R>, Key<R>>,
        Self::Query: FilterDsl<InRange<Positioned<O, Wrapped<R>>, Position<Key<R>>>>,
    {
        if range.bounds_nothing() {
            return Ranged::Whole(self.query());
        }
        let in_range = InRange {
            column: Positioned::new(Shape::<R>::columns(), O::key_among_terms()),
            range,
        };
        Ranged::Within(FilterDsl::filter(self.query(), in_range))
    }
}

impl<Q: Reusable, R, O> InPositions<R, O> for Q {}

impl<'q, Q, C, R> ClaimQuery<'q, C, R> for Q
where
    Q: Reusable<Query: AsQuery<Query: QueryOrder<Terms: OrderTerms>>>,
    C: Connection,
    C::Backend: ClaimBackend,
    Q: ClaimStatements<C::Backend, R>,
    C: Loads<'q, Q::Keys, Q::Loaded> + Loads<'q, Locked<Q::Rows>, R>,
{
    fn keys(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
    ) -> QueryResult<Vec<Position<Q::Key>>> {
        let loaded: Vec<Q::Loaded> = C::load_rows(self.keys_query(range, limit), conn)?;
        Ok(loaded.into_iter().map(Q::position).collect())
    }

    fn rows(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &LockClause,
    ) -> QueryResult<Vec<R>> {
        C::load_rows(self.rows_query(range, limit, lock), conn)
    }
}

/// Diesel's [`LoadQuery`], said of the connection: `T` loads rows `U` on
/// `Self`. The claim's own bounds name the connection first, so that the
/// compiler checks them once it knows the connection: checked before, with a
/// query the claim refuses, they lose the compiler in Diesel's impls
/// ("overflow evaluating the requirement") instead of naming what is wrong.
pub trait Loads<'q, T, U>: Sized {
    /// Runs `query` on `conn`.
    fn load_rows(query: T, conn: &mut Self) -> QueryResult<Vec<U>>;
}

impl<'q, C, T, U> Loads<'q, T, U> for C
where
    T: LoadQuery<'q, C, U>,
{
    fn load_rows(query: T, conn: &mut C) -> QueryResult<Vec<U>> {
        query.load(conn)
    }
}

impl<'q, Q, C, R, V> MarkQuery<'q, C, R, V> for Q
where
    Q: ClaimQuery<'q, C, R>,
    C: Connection,
    C::Backend: ClaimBackend,
    R: HasTable + Selectable<C::Backend>,
    // The rows come back from the marking statement, which reads the claimed
    // table alone: a column of a joined table is refused here, at compile
    // time, not by the database.
    dsl::AsSelect<R, C::Backend>: AppearsOnTable<R::Table>,
    V: AsChangeset<Target = R::Table> + Clone,
    V::Changeset: QueryFragment<C::Backend>,
    PrimaryKey<R>: QueryFragment<C::Backend>,
    MarkStatement<R, V, Q::KeyColumns, Q::Key, Q::LockedKeys, C::Backend>: LoadQuery<'q, C, R>,
    MarkByKeys<R, V, Q::KeyColumns, Q::Key>: ExecuteDsl<C>,
    ReadByKeys<R, Q::KeyColumns, Q::Key, C::Backend>: LoadQuery<'q, C, R>,
{
    fn check_changes(changes: &V) -> Result<(), Error> {
        check_mark::<C::Backend, R, V>(changes)
    }

    fn mark(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &LockClause,
        changes: &V,
    ) -> QueryResult<Vec<R>> {
        let changes = || changes.clone().as_changeset();
        if <C::Backend as Strategy>::UPDATE_RETURNING {
            return taken_in_one::<_, _, R, _, _>(
                self,
                range,
                limit,
                lock,
                changes(),
                R::as_select(),
            )
            .load(conn);
        }
        // Without `RETURNING` (MySQL): lock, mark by key, and read the rows back,
        // in the caller's transaction.
        let keys = lock_keys(self, conn, range, limit, lock)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let key = Q::key_columns();
        let update = update_by_keys::<R, _, _, _>(key, keys.clone(), changes());
        update.execute(conn)?;
        let read_back = read_by_keys::<R, _, _, _>(key, keys, R::as_select());
        read_back.load(conn)
    }
}

impl<'q, Q, C, R, Col> StampQuery<'q, C, R, Col> for Q
where
    Q: ClaimQuery<'q, C, R>,
    C: Connection,
    C::Backend: ClaimBackend,
    R: HasTable + Selectable<C::Backend>,
    dsl::AsSelect<R, C::Backend>: AppearsOnTable<R::Table>,
    Col: Column<Table = R::Table> + Copy,
    Col::SqlType: StampType<C::Backend>,
    StampStatement<R, Col, Q::KeyColumns, Q::Key, Q::LockedKeys, C::Backend>:
        LoadQuery<'q, C, (R, i64)>,
    StampByKeys<R, Col, Q::KeyColumns, Q::Key>: ExecuteDsl<C>,
    ReadStampedByKeys<R, Col, Q::KeyColumns, Q::Key, C::Backend>: LoadQuery<'q, C, (R, i64)>,
{
    fn stamp(
        &self,
        conn: &mut C,
        range: KeyRange<Position<Q::Key>>,
        limit: i64,
        lock: &LockClause,
        stamp: &NewStamp<Col>,
    ) -> QueryResult<Vec<(R, i64)>> {
        let stamped = (R::as_select(), StampMicros(stamp.column));
        if <C::Backend as Strategy>::UPDATE_RETURNING {
            return taken_in_one::<_, _, R, _, _>(self, range, limit, lock, *stamp, stamped)
                .load(conn);
        }
        // Without `RETURNING` (MySQL): lock, stamp by key, and read the rows
        // and their stamps back, in the caller's transaction.
        let keys = lock_keys(self, conn, range, limit, lock)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let key = Q::key_columns();
        let update = update_by_keys::<R, _, _, _>(key, keys.clone(), *stamp);
        update.execute(conn)?;
        let read_back = read_by_keys::<R, _, _, _>(key, keys, stamped);
        read_back.load(conn)
    }
}

/// A mark or a stamp in one statement: `UPDATE <table> SET changes WHERE
/// <key> IN (<up to limit keys of matching rows in range, locked>) RETURNING
/// columns`. Both APIs run it.
pub(crate) fn taken_in_one<Q, DB, R, Ch, S>(
    query: &Q,
    range: KeyRange<Position<Q::Key>>,
    limit: i64,
    lock: &LockClause,
    changes: Ch,
    columns: S,
) -> TakenInOne<R, Ch, Q::KeyColumns, Q::Key, Q::LockedKeys, S>
where
    Q: ClaimStatements<DB, R>,
    R: HasTable,
{
    Returning {
        statement: Update {
            from: R::table().from_clause(),
            changes,
            filter: locked_keys_subquery(query, range, limit, lock),
        },
        columns,
    }
}

/// A mark or a stamp without `RETURNING` (MySQL), once the rows at `keys`
/// are locked: the update by key, `UPDATE <table> SET changes WHERE <key> IN
/// (keys)`.
pub(crate) fn update_by_keys<R, Ch, W, K>(
    key_columns: W,
    keys: Vec<K>,
    changes: Ch,
) -> Update<FromClause<R>, Ch, InList<W, K>>
where
    R: HasTable,
{
    Update {
        from: R::table().from_clause(),
        changes,
        filter: InList {
            column: key_columns,
            keys,
        },
    }
}

/// The rows a mark or a stamp without `RETURNING` updated, read back:
/// `SELECT columns FROM <table> WHERE <key> IN (keys)`.
pub(crate) fn read_by_keys<R, S, W, K>(
    key_columns: W,
    keys: Vec<K>,
    columns: S,
) -> SelectWhere<S, FromClause<R>, InList<W, K>>
where
    R: HasTable,
{
    SelectWhere {
        columns,
        from: R::table().from_clause(),
        filter: InList {
            column: key_columns,
            keys,
        },
    }
}

/// `<key> IN (<up to limit keys of matching rows in range, locked>)`: the
/// rows a mark or a stamp takes, in one statement.
fn locked_keys_subquery<Q, DB, R>(
    query: &Q,
    range: KeyRange<Position<Q::Key>>,
    limit: i64,
    lock: &LockClause,
) -> KeysIn<Q::KeyColumns, Locked<Q::LockedKeys>, Q::Key>
where
    Q: ClaimStatements<DB, R>,
{
    KeysIn {
        column: Q::key_columns(),
        subquery: Locked {
            query: query.locked_keys_query(range, limit),
            clause: Some(lock.clone()),
        },
        key: PhantomData,
    }
}

/// Locks up to `limit` matching rows in `range` and returns their keys: the
/// first of the statements a mark or a stamp takes without `RETURNING`
/// (MySQL), in the caller's transaction.
fn lock_keys<'q, Q, C, R>(
    query: &Q,
    conn: &mut C,
    range: KeyRange<Position<Q::Key>>,
    limit: i64,
    lock: &LockClause,
) -> QueryResult<Vec<Q::Key>>
where
    Q: ClaimQuery<'q, C, R>,
    C: Connection,
{
    let mut keys: Vec<Q::Key> = query
        .rows(conn, range, limit, lock)?
        .iter()
        .map(Q::key)
        .collect();
    keys.dedup();
    Ok(keys)
}

fn primary_key<R: HasTable>() -> PrimaryKey<R> {
    R::table().primary_key()
}

/// Refuses a mark that changes nothing, or that changes a column of the
/// claimed table's key: the checks of `MarkQuery::check_changes`, in both
/// APIs.
pub(crate) fn check_mark<DB, R, V>(changes: &V) -> Result<(), Error>
where
    DB: ClaimBackend,
    R: HasTable,
    V: AsChangeset<Target = R::Table> + Clone,
    V::Changeset: QueryFragment<DB>,
    PrimaryKey<R>: QueryFragment<DB>,
{
    let changeset = changes.clone().as_changeset();
    if changeset.is_noop(&DB::default())? {
        return Err(Error::InvalidArgument(
            "the mark is empty: it must change what the query's filter tests".to_owned(),
        ));
    }
    // A claim follows its rows by their keys (and MySQL reads marked rows
    // back by them): a mark of a key column would hand over rows the claim
    // cannot place, or, on MySQL, none.
    let changeset = rendered::render::<DB>(&changeset)?;
    let key = rendered::render::<DB>(&R::table().primary_key())?;
    if rendered::assigns_key::<DB>(&changeset, &key)? {
        return Err(Error::InvalidArgument(
            "a mark cannot change a column of the claimed table's primary key, by which \
             the claim follows its rows (a table partitioned by state has the state in \
             its key): set that column in the closure instead, or declare the key as the \
             table's own id in `table!`"
                .to_owned(),
        ));
    }
    Ok(())
}
