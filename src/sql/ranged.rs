//! A claim's statements on the caller's query as a whole, or within a range
//! of positions.
//!
//! Diesel adds a filter to a query's `WHERE` with an `AND`, so a range, once
//! added, must say something: a range that bounds nothing (a take from the
//! head of the query, a first page) would add a placeholder that is always
//! true. Such a statement is built on the caller's query alone instead: a
//! claim's statement is either ([`Ranged`]), each built on its query the
//! same way ([`BuildOn`]).

use diesel::backend::Backend;
use diesel::dsl;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::query_dsl::methods::{LimitDsl, OrderDsl, SelectDsl};
use diesel::{Expression, QueryResult, RunQueryDsl};

/// A statement on the caller's query as a whole, or on it within a range.
#[derive(Debug, Clone)]
pub enum Ranged<Whole, Within> {
    Whole(Whole),
    Within(Within),
}

impl<Whole, Within> Ranged<Whole, Within> {
    /// `statement`, built on the query, whole or within its range.
    #[allow(clippy::type_complexity)]
    pub fn build<S>(
        self,
        statement: S,
    ) -> Ranged<<S as BuildOn<Whole>>::Output, <S as BuildOn<Within>>::Output>
    where
        S: BuildOn<Whole> + BuildOn<Within>,
    {
        match self {
            Ranged::Whole(query) => Ranged::Whole(BuildOn::<Whole>::build_on(statement, query)),
            Ranged::Within(query) => Ranged::Within(BuildOn::<Within>::build_on(statement, query)),
        }
    }
}

impl<Whole, Within> QueryId for Ranged<Whole, Within> {
    // Either statement, known at run time: Diesel then caches it by its SQL.
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

/// Both read the same columns: the range only filters.
impl<Whole: Query, Within: Query<SqlType = Whole::SqlType>> Query for Ranged<Whole, Within> {
    type SqlType = Whole::SqlType;
}

impl<Whole, Within, DB> QueryFragment<DB> for Ranged<Whole, Within>
where
    DB: Backend,
    Whole: QueryFragment<DB>,
    Within: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        match self {
            Ranged::Whole(query) => query.walk_ast(out),
            Ranged::Within(query) => query.walk_ast(out),
        }
    }
}

impl<Whole, Within, Conn> RunQueryDsl<Conn> for Ranged<Whole, Within> {}

/// A statement a claim builds on a query `Q`, the caller's whole or within a
/// range.
pub trait BuildOn<Q> {
    type Output;

    fn build_on(self, query: Q) -> Self::Output;
}

/// The rows of a query in the claim order `Ord`, up to `limit`.
#[derive(Debug, Clone, Copy)]
pub struct Ordered<Ord> {
    pub order: Ord,
    pub limit: i64,
}

impl<Q, Ord> BuildOn<Q> for Ordered<Ord>
where
    Ord: Expression,
    Q: OrderDsl<Ord>,
    dsl::Order<Q, Ord>: LimitDsl,
{
    type Output = dsl::Limit<dsl::Order<Q, Ord>>;

    fn build_on(self, query: Q) -> Self::Output {
        query.order(self.order).limit(self.limit)
    }
}

/// The `columns` of a query's rows (their positions, or their keys), in the
/// claim order, up to a limit.
#[derive(Debug, Clone, Copy)]
pub struct Selected<Columns, Ord> {
    pub columns: Columns,
    pub rows: Ordered<Ord>,
}

impl<Q, Columns, Ord> BuildOn<Q> for Selected<Columns, Ord>
where
    Columns: Expression,
    Q: SelectDsl<Columns>,
    Ordered<Ord>: BuildOn<dsl::Select<Q, Columns>>,
{
    type Output = <Ordered<Ord> as BuildOn<dsl::Select<Q, Columns>>>::Output;

    fn build_on(self, query: Q) -> Self::Output {
        self.rows.build_on(SelectDsl::select(query, self.columns))
    }
}
