//! The `ORDER BY` of a claim's statements on an ordered query: the order's
//! terms, then the columns of the primary key that break their ties.
//!
//! A key column that is one of the terms breaks no tie after them (rows tied
//! on every term have the same value in it), so it is left out: ordered by
//! its key, a query is `ORDER BY id DESC`, not `ORDER BY id DESC, id`. The
//! order is the same, and a database need not read the column twice.

use diesel::backend::Backend;
use diesel::expression::{AppearsOnTable, Expression, ValidGrouping};
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::QueryResult;

use super::keys::{One, Row, WrappedKey};
use super::order::OrderTerms;

/// The order's terms `T`, then the columns of the key `W` (a [`One`] or a
/// [`Row`]) that are not among them. As an expression, it is Diesel's tuple
/// of the terms and the key, which Diesel checks against the query.
#[derive(Debug, Clone, Copy)]
pub struct ThenKey<T, W> {
    terms: T,
    key: W,
    /// Whether each of the key's columns, in order, is a term. Known when
    /// it is made, so that its SQL asks nothing more of the terms than
    /// Diesel's tuple would: an order a claim cannot follow is told as
    /// such, not as SQL this cannot render.
    among_terms: [bool; 3],
}

impl<T: OrderTerms, W: KeyAmongTerms> ThenKey<T, W> {
    pub fn new(terms: T, key: W) -> Self {
        ThenKey {
            terms,
            key,
            among_terms: W::among::<T>(),
        }
    }
}

/// Which columns of a key ([`One`], [`Row`]) are terms of an order.
pub trait KeyAmongTerms {
    /// Whether each of the key's columns, in order, is a term of `T`.
    fn among<T: OrderTerms>() -> [bool; 3];
}

impl<C: 'static> KeyAmongTerms for One<C> {
    fn among<T: OrderTerms>() -> [bool; 3] {
        [T::holds::<C>(), false, false]
    }
}

impl<C0: 'static, C1: 'static> KeyAmongTerms for Row<(C0, C1)> {
    fn among<T: OrderTerms>() -> [bool; 3] {
        [T::holds::<C0>(), T::holds::<C1>(), false]
    }
}

impl<C0: 'static, C1: 'static, C2: 'static> KeyAmongTerms for Row<(C0, C1, C2)> {
    fn among<T: OrderTerms>() -> [bool; 3] {
        [T::holds::<C0>(), T::holds::<C1>(), T::holds::<C2>()]
    }
}

/// The terms and the key, as Diesel's own `ORDER BY` of them would be.
type Both<T, W> = (T, <W as WrappedKey>::Columns);

impl<T, W> Expression for ThenKey<T, W>
where
    W: WrappedKey,
    Both<T, W>: Expression,
{
    type SqlType = <Both<T, W> as Expression>::SqlType;
}

impl<T, W, QS> AppearsOnTable<QS> for ThenKey<T, W>
where
    W: WrappedKey,
    Both<T, W>: AppearsOnTable<QS>,
{
}

impl<T, W, GroupBy> ValidGrouping<GroupBy> for ThenKey<T, W>
where
    W: WrappedKey,
    Both<T, W>: ValidGrouping<GroupBy>,
{
    type IsAggregate = <Both<T, W> as ValidGrouping<GroupBy>>::IsAggregate;
}

impl<T, W> QueryId for ThenKey<T, W> {
    // Its SQL is not that of the tuple Diesel knows by its type.
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

/// `, column`, unless it is a term.
fn then_column<'b, C, DB>(
    column: &'b C,
    among_terms: bool,
    mut out: AstPass<'_, 'b, DB>,
) -> QueryResult<()>
where
    C: QueryFragment<DB>,
    DB: Backend,
{
    if among_terms {
        return Ok(());
    }
    out.push_sql(", ");
    column.walk_ast(out)
}

impl<T, C, DB> QueryFragment<DB> for ThenKey<T, One<C>>
where
    T: QueryFragment<DB>,
    C: QueryFragment<DB>,
    DB: Backend,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        self.terms.walk_ast(out.reborrow())?;
        then_column(&self.key.0, self.among_terms[0], out)
    }
}

macro_rules! then_row {
    ($($column:ident $index:tt),+) => {
        impl<T, $($column,)+ DB> QueryFragment<DB> for ThenKey<T, Row<($($column,)+)>>
        where
            T: QueryFragment<DB>,
            $($column: QueryFragment<DB>,)+
            DB: Backend,
        {
            fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
                self.terms.walk_ast(out.reborrow())?;
                $(then_column(&(self.key.0).$index, self.among_terms[$index], out.reborrow())?;)+
                Ok(())
            }
        }
    };
}

then_row!(C0 0, C1 1);
then_row!(C0 0, C1 1, C2 2);

#[cfg(all(test, feature = "postgres_backend", feature = "mysql_backend"))]
mod tests {
    use diesel::helper_types::{Asc, Desc};
    use diesel::mysql::Mysql;
    use diesel::pg::Pg;
    use diesel::ExpressionMethods;

    use super::*;
    use crate::sql::rendered::render;

    diesel::table! {
        /// Lines of orders, by priority.
        lines (order_id, line_no) {
            priority -> Integer,
            order_id -> Integer,
            line_no -> Integer,
        }
    }

    /// The key's columns follow the terms, those among them left out,
    /// whatever their direction there.
    #[test]
    fn the_key_breaks_ties_with_the_columns_the_terms_lack() {
        let key = Row((lines::order_id, lines::line_no));
        let by_priority: Desc<lines::priority> = lines::priority.desc();
        assert_eq!(
            render::<Pg>(&ThenKey::new(by_priority, key)).unwrap(),
            r#""lines"."priority" DESC, "lines"."order_id", "lines"."line_no""#
        );
        let by_order: (Desc<lines::order_id>, Asc<lines::priority>) =
            (lines::order_id.desc(), lines::priority.asc());
        assert_eq!(
            render::<Mysql>(&ThenKey::new(by_order, key)).unwrap(),
            "`lines`.`order_id` DESC, `lines`.`priority` ASC, `lines`.`line_no`"
        );
        let by_key: (Asc<lines::line_no>, Desc<lines::order_id>) =
            (lines::line_no.asc(), lines::order_id.desc());
        assert_eq!(
            render::<Pg>(&ThenKey::new(by_key, key)).unwrap(),
            r#""lines"."line_no" ASC, "lines"."order_id" DESC"#
        );
        let by_one: Desc<lines::order_id> = lines::order_id.desc();
        let one = One(lines::order_id);
        assert_eq!(
            render::<Pg>(&ThenKey::new(by_one, one)).unwrap(),
            r#""lines"."order_id" DESC"#
        );
    }
}
