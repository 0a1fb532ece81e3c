//! The claim order: the caller's `ORDER BY`, with the primary key breaking
//! ties, as the place of each row in a claim's keyset pages.
//!
//! A claim pages through its rows by their *position*: the order columns'
//! values, then the key. The values are kept as the database sent them
//! ([`OrderValue`]) and bound back unchanged in the next page's range, so any
//! column type orders a claim, custom ones included. The order is read from
//! the query's type: up to three `NOT NULL` columns, each bare, `.asc()` or
//! `.desc()`.

use std::any::TypeId;
use std::hash::{Hash, Hasher};
use std::marker::PhantomData;

use diesel::backend::Backend;
use diesel::expression::expression_types::NotSelectable;
use diesel::helper_types::{Asc, Desc};
use diesel::query_builder::{AstPass, BoxedSelectStatement, NoOrderClause, OrderClause};
use diesel::query_builder::{QueryFragment, SelectStatement};
use diesel::serialize::ToSql;
use diesel::sql_types::is_nullable::NotNull;
use diesel::sql_types::{self, HasSqlType, SqlType};
use diesel::{Column, Expression, ExpressionMethods, QueryResult};

use super::comparison::{walk_in_turn, Comparison};
use super::keys::{KeyColumns, KeyOn, WrappedKey};
use super::order_by::{KeyAmongTerms, ThenKey};
use crate::backend::OrderValue;

/// A row's place in the claim order: its order columns' values, then its key.
/// Two positions are the same row when their keys are equal.
#[derive(Debug, Clone)]
pub struct Position<K> {
    pub values: Vec<OrderValue>,
    pub key: K,
}

impl<K> Position<K> {
    /// The place of a row in key order, or a row's key alone.
    pub fn of_key(key: K) -> Self {
        Position {
            values: Vec::new(),
            key,
        }
    }
}

impl<K: PartialEq> PartialEq for Position<K> {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl<K: Eq> Eq for Position<K> {}

impl<K: Hash> Hash for Position<K> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key.hash(state);
    }
}

/// The order of a query without one: its primary key.
#[derive(Debug, Clone, Copy)]
pub struct KeyOrder;

/// What a claim reads of a query's order: its terms, before the key.
#[diagnostic::on_unimplemented(
    message = "a claim cannot follow the order `{Self}`",
    note = "order a claim by up to three NOT NULL columns of the query, each bare, `.asc()` or \
            `.desc()`: `.order_by(priority.desc())`, `.order((priority.desc(), due_at))`; the \
            primary key breaks ties"
)]
pub trait OrderTerms {
    /// The number of terms.
    #[doc(hidden)]
    const LEN: usize;
    /// The terms' columns.
    #[doc(hidden)]
    type Columns: Copy;

    #[doc(hidden)]
    fn columns() -> Self::Columns;

    /// Whether a term is the column `C`.
    #[doc(hidden)]
    fn holds<C: 'static>() -> bool;
}

/// An order a claim can follow: each term a `NOT NULL` column with its
/// direction, alone or in a tuple (`.order((a.desc(), b.asc()))`, or
/// `.order_by(a.desc()).then_order_by(b.asc())`).
#[diagnostic::on_unimplemented(
    message = "a claim cannot follow the order `{Self}`",
    note = "order a claim by up to three NOT NULL columns of the query, each bare, `.asc()` or \
            `.desc()`: `.order_by(priority.desc())`, `.order((priority.desc(), due_at))`; the \
            primary key breaks ties"
)]
pub trait Directed: OrderTerms {
    /// The terms' values, as read.
    #[doc(hidden)]
    type Values;

    /// The order clause, rebuilt from its type.
    #[doc(hidden)]
    fn ordering() -> Self;

    /// Appends `values` to a position's, in the order of the terms.
    #[doc(hidden)]
    fn push_values(values: Self::Values, into: &mut Vec<OrderValue>);
}

/// The nullability of a column a claim can follow: `NOT NULL` (comparing a
/// `NULL` to a position's value would pass its row over).
#[diagnostic::on_unimplemented(
    message = "a claim cannot follow a nullable column",
    note = "a claim pages through its rows by their order columns' values, which a NULL does \
            not have: order the claim by NOT NULL columns"
)]
pub trait NotNullColumn {}

impl NotNullColumn for NotNull {}

/// How a claim renders its order's terms on `DB`.
pub trait WalkTerms<DB: Backend>: OrderTerms {
    /// Whether term `index` is descending.
    fn descending(index: usize) -> bool;

    /// Term `index`'s column.
    fn walk_column<'b>(
        columns: &'b Self::Columns,
        index: usize,
        out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()>;

    /// A value of term `index`, bound with its column's type.
    fn walk_value<'b>(
        index: usize,
        value: &'b OrderValue,
        out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()>;
}

impl OrderTerms for KeyOrder {
    const LEN: usize = 0;
    type Columns = ();

    fn columns() {}

    fn holds<C: 'static>() -> bool {
        false
    }
}

impl<DB: Backend> WalkTerms<DB> for KeyOrder {
    fn descending(_: usize) -> bool {
        false
    }

    fn walk_column<'b>(_: &'b (), _: usize, _: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        Ok(())
    }

    fn walk_value<'b>(_: usize, _: &'b OrderValue, _: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        Ok(())
    }
}

macro_rules! directed_column {
    ($wrapper:ident, $method:ident, $descending:expr) => {
        // A term that is not a column is told as the order it is in.
        #[diagnostic::do_not_recommend]
        impl<C> OrderTerms for $wrapper<C>
        where
            C: Column + Default + Copy + 'static,
        {
            const LEN: usize = 1;
            type Columns = C;

            fn columns() -> C {
                C::default()
            }

            fn holds<Other: 'static>() -> bool {
                TypeId::of::<C>() == TypeId::of::<Other>()
            }
        }

        impl<C> Directed for $wrapper<C>
        where
            C: Column + Default + Copy + ExpressionMethods + 'static,
            C::SqlType: SqlType,
            <C::SqlType as SqlType>::IsNull: NotNullColumn,
        {
            type Values = OrderValue;

            fn ordering() -> Self {
                C::default().$method()
            }

            fn push_values(value: OrderValue, into: &mut Vec<OrderValue>) {
                into.push(value);
            }
        }

        impl<C, DB> WalkTerms<DB> for $wrapper<C>
        where
            DB: Backend + HasSqlType<C::SqlType>,
            C: Column + Default + Copy + QueryFragment<DB> + 'static,
            OrderValue: ToSql<C::SqlType, DB>,
        {
            fn descending(_: usize) -> bool {
                $descending
            }

            fn walk_column<'b>(
                column: &'b C,
                _: usize,
                out: AstPass<'_, 'b, DB>,
            ) -> QueryResult<()> {
                column.walk_ast(out)
            }

            fn walk_value<'b>(
                _: usize,
                value: &'b OrderValue,
                mut out: AstPass<'_, 'b, DB>,
            ) -> QueryResult<()> {
                out.push_bind_param::<C::SqlType, OrderValue>(value)
            }
        }
    };
}

directed_column!(Asc, asc, false);
directed_column!(Desc, desc, true);

macro_rules! directed_tuple {
    ($($term:ident $index:tt),+) => {
        impl<$($term: OrderTerms),+> OrderTerms for ($($term,)+) {
            const LEN: usize = 0 $(+ $term::LEN)+;
            type Columns = ($($term::Columns,)+);

            fn columns() -> Self::Columns {
                ($($term::columns(),)+)
            }

            fn holds<C: 'static>() -> bool {
                false $(|| $term::holds::<C>())+
            }
        }

        impl<$($term: Directed),+> Directed for ($($term,)+) {
            type Values = ($($term::Values,)+);

            fn ordering() -> Self {
                ($($term::ordering(),)+)
            }

            fn push_values(values: Self::Values, into: &mut Vec<OrderValue>) {
                $($term::push_values(values.$index, into);)+
            }
        }

        impl<DB: Backend, $($term: WalkTerms<DB>),+> WalkTerms<DB> for ($($term,)+) {
            fn descending(mut index: usize) -> bool {
                $(
                    if index < $term::LEN {
                        return $term::descending(index);
                    }
                    index -= $term::LEN;
                )+
                unreachable!("order term {index} past the end")
            }

            fn walk_column<'b>(
                columns: &'b Self::Columns,
                mut index: usize,
                out: AstPass<'_, 'b, DB>,
            ) -> QueryResult<()> {
                $(
                    if index < $term::LEN {
                        return $term::walk_column(&columns.$index, index, out);
                    }
                    index -= $term::LEN;
                )+
                unreachable!("order term {index} past the end")
            }

            fn walk_value<'b>(
                mut index: usize,
                value: &'b OrderValue,
                out: AstPass<'_, 'b, DB>,
            ) -> QueryResult<()> {
                $(
                    if index < $term::LEN {
                        return $term::walk_value(index, value, out);
                    }
                    index -= $term::LEN;
                )+
                unreachable!("order term {index} past the end")
            }
        }
    };
}

directed_tuple!(T0 0, T1 1);
directed_tuple!(T0 0, T1 1, T2 2);

/// The order a query asks for, from its type: its `ORDER BY`'s terms, or
/// [`KeyOrder`] when it has none. A boxed query's order cannot be read from
/// its type: it is [`KeyOrder`], and a claim refuses the query when its SQL
/// has an `ORDER BY`.
pub trait QueryOrder {
    /// Checked where it is used, so that an order a claim cannot follow is
    /// named in the error.
    type Terms;
}

impl<F, S, D, W, LOf, G, H, LC> QueryOrder
    for SelectStatement<F, S, D, W, NoOrderClause, LOf, G, H, LC>
{
    type Terms = KeyOrder;
}

impl<F, S, D, W, E, LOf, G, H, LC> QueryOrder
    for SelectStatement<F, S, D, W, OrderClause<E>, LOf, G, H, LC>
where
    E: Expression,
    E::SqlType: TermKind<E>,
{
    type Terms = <E::SqlType as TermKind<E>>::Terms;
}

/// The terms of an order clause `E`, told apart by its SQL type (`Self`):
/// `.asc()` and `.desc()` are not selectable, a tuple has a tuple of types,
/// and a bare column has its column's type, and is ascending. (Diesel's own
/// types: a bare column of a custom type needs its `.asc()`.)
pub trait TermKind<E> {
    type Terms;
}

impl<E> TermKind<E> for NotSelectable {
    type Terms = E;
}

macro_rules! tuple_terms {
    ($($term:ident $sql:ident),+) => {
        impl<$($term, $sql: TermKind<$term>),+> TermKind<($($term,)+)> for ($($sql,)+) {
            type Terms = ($($sql::Terms,)+);
        }
    };
}

tuple_terms!(T0 S0, T1 S1);
tuple_terms!(T0 S0, T1 S1, T2 S2);

macro_rules! bare_column {
    ($($(#[$cfg:meta])* $sql:ty),+ $(,)?) => {$(
        $(#[$cfg])*
        impl<E> TermKind<E> for $sql {
            type Terms = Asc<E>;
        }
    )+};
}

bare_column!(
    sql_types::Bool,
    sql_types::SmallInt,
    sql_types::Integer,
    sql_types::BigInt,
    sql_types::Float,
    sql_types::Double,
    sql_types::Numeric,
    sql_types::Text,
    sql_types::Binary,
    sql_types::Date,
    sql_types::Time,
    sql_types::Timestamp,
    #[cfg(feature = "postgres_backend")]
    sql_types::Timestamptz,
    #[cfg(feature = "postgres_backend")]
    sql_types::Uuid,
    #[cfg(feature = "mysql_backend")]
    sql_types::Datetime,
    #[cfg(feature = "mysql_backend")]
    sql_types::TinyInt,
    #[cfg(feature = "mysql_backend")]
    sql_types::Unsigned<sql_types::TinyInt>,
    #[cfg(feature = "mysql_backend")]
    sql_types::Unsigned<sql_types::SmallInt>,
    #[cfg(feature = "mysql_backend")]
    sql_types::Unsigned<sql_types::Integer>,
    #[cfg(feature = "mysql_backend")]
    sql_types::Unsigned<sql_types::BigInt>,
);

/// A bare nullable column: refused with the reason (see [`NotNullColumn`]).
impl<ST, E> TermKind<E> for sql_types::Nullable<ST> {
    type Terms = Asc<E>;
}

impl<ST, QS, DB, GB> QueryOrder for BoxedSelectStatement<'_, ST, QS, DB, GB> {
    type Terms = KeyOrder;
}

/// What a claim's statements select and order by, for an order and a primary
/// key `W` (wrapped for the key predicates) whose values are `K`.
#[diagnostic::on_unimplemented(
    message = "a claim cannot follow the order `{Self}`",
    note = "order a claim by up to three NOT NULL columns of the query, each bare, `.asc()` or \
            `.desc()`: `.order_by(priority.desc())`, `.order((priority.desc(), due_at))`; the \
            primary key breaks ties"
)]
pub trait ClaimOrder<W: WrappedKey, K>: OrderTerms {
    /// What the candidate scan selects: the key, or the order's columns and
    /// the key.
    #[doc(hidden)]
    type Selection: Copy;
    /// What it loads.
    #[doc(hidden)]
    type Loaded;
    /// The statements' `ORDER BY`: the key, or the order's terms and the
    /// key's columns they leave tied.
    #[doc(hidden)]
    type Ordering;

    #[doc(hidden)]
    fn selection(key: W) -> Self::Selection;
    #[doc(hidden)]
    fn ordering(key: W) -> Self::Ordering;
    #[doc(hidden)]
    fn position(loaded: Self::Loaded) -> Position<K>;
    /// Whether each of the key's columns, in order, is a term: compared
    /// after the terms, the key need not compare it again, and when every
    /// one is, no two rows are tied on all of the terms.
    #[doc(hidden)]
    fn key_among_terms() -> [bool; 3];
}

impl<W: WrappedKey, K> ClaimOrder<W, K> for KeyOrder {
    type Selection = W::Columns;
    type Loaded = K;
    type Ordering = W::Columns;

    fn selection(key: W) -> W::Columns {
        key.columns()
    }

    fn ordering(key: W) -> W::Columns {
        key.columns()
    }

    fn position(key: K) -> Position<K> {
        Position::of_key(key)
    }

    fn key_among_terms() -> [bool; 3] {
        [false; 3]
    }
}

/// One impl per shape of order, not one for every [`Directed`] order: an order
/// of another shape then matches no impl, and the error names it, rather than
/// the compiler guessing at the one impl and losing itself in Diesel's.
macro_rules! claim_order {
    ($($order:ident<$($term:ident),+>;)+) => {$(
        impl<$($term,)+ W: WrappedKey + KeyAmongTerms, K> ClaimOrder<W, K> for $order<$($term),+>
        where
            Self: Directed,
        {
            type Selection = (<Self as OrderTerms>::Columns, W::Columns);
            type Loaded = (<Self as Directed>::Values, K);
            type Ordering = ThenKey<Self, W>;

            fn selection(key: W) -> Self::Selection {
                (<Self as OrderTerms>::columns(), key.columns())
            }

            fn ordering(key: W) -> Self::Ordering {
                ThenKey::new(<Self as Directed>::ordering(), key)
            }

            fn position((values, key): Self::Loaded) -> Position<K> {
                let mut position = Position {
                    values: Vec::with_capacity(Self::LEN),
                    key,
                };
                Self::push_values(values, &mut position.values);
                position
            }

            fn key_among_terms() -> [bool; 3] {
                W::among::<Self>()
            }
        }
    )+};
}

/// Tuples by name, for the macro's `Name<Terms…>` pattern.
type Pair<A, B> = (A, B);
type Triple<A, B, C> = (A, B, C);

claim_order! {
    Asc<C>;
    Desc<C>;
    Pair<T0, T1>;
    Triple<T0, T1, T2>;
}

/// The columns a claim's ranges compare: the order's `T`, then the key `Key`
/// (wrapped for the key predicates).
#[derive(Debug)]
pub struct Positioned<T: OrderTerms, Key> {
    pub terms: T::Columns,
    pub key: Key,
    /// Which of the key's columns are terms ([`ClaimOrder::key_among_terms`]).
    key_among_terms: [bool; 3],
    order: PhantomData<T>,
}

impl<T: OrderTerms, Key: Copy> Clone for Positioned<T, Key> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: OrderTerms, Key: Copy> Copy for Positioned<T, Key> {}

impl<T: OrderTerms, Key> Positioned<T, Key> {
    /// The columns of the order `T` and the key `key`, whose columns are
    /// terms where `key_among_terms` says so.
    pub fn new(key: Key, key_among_terms: [bool; 3]) -> Self {
        Positioned {
            terms: T::columns(),
            key,
            key_among_terms,
            order: PhantomData,
        }
    }
}

/// The order's columns come from the query's own `ORDER BY`, which Diesel has
/// checked against the query's tables.
impl<T: OrderTerms, Key: KeyOn<QS>, QS> KeyOn<QS> for Positioned<T, Key> {}

/// Columns a range of positions compares, in the claim order.
pub trait RangeColumns<P, DB: Backend> {
    /// The columns compared with `value` by `comparison`, in the claim
    /// order.
    fn walk_compare<'b>(
        &'b self,
        comparison: Comparison,
        value: &'b P,
        out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()>;

    /// The key among the keys of `positions` (at least one), in parentheses.
    fn walk_among<'b>(&'b self, positions: &'b [P], out: AstPass<'_, 'b, DB>) -> QueryResult<()>;
}

impl<T, Key, K, DB> RangeColumns<Position<K>, DB> for Positioned<T, Key>
where
    DB: Backend,
    T: WalkTerms<DB>,
    Key: KeyColumns<K, DB>,
{
    fn walk_compare<'b>(
        &'b self,
        comparison: Comparison,
        value: &'b Position<K>,
        out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()> {
        self.walk_from(0, comparison, value, out)
    }

    fn walk_among<'b>(
        &'b self,
        positions: &'b [Position<K>],
        out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()> {
        let keys = positions.iter().map(|position| &position.key);
        super::keys::walk_in_list(&self.key, keys, out)
    }
}

impl<T: OrderTerms, Key> Positioned<T, Key> {
    /// The comparison from term `index` on, as `(t >= v AND (t > v OR …))` (a
    /// descending term the other way), whose first condition bounds an index
    /// range on the term; after the last term, the key's own comparison, of
    /// the key's columns that are not terms (there, a term equals its value:
    /// comparing it again would repeat it). When the terms hold the whole
    /// key, rows tied on every term are one row, the position's own, and the
    /// last term is compared alone (`t > v`, or `t >= v` to take the
    /// position's row in).
    fn walk_from<'b, K, DB>(
        &'b self,
        index: usize,
        comparison: Comparison,
        position: &'b Position<K>,
        out: AstPass<'_, 'b, DB>,
    ) -> QueryResult<()>
    where
        DB: Backend,
        T: WalkTerms<DB>,
        Key: KeyColumns<K, DB>,
    {
        if index == T::LEN {
            let tied = self.key_among_terms;
            return self
                .key
                .walk_compare_untied(comparison, &position.key, tied, out);
        }
        let Some(value) = position.values.get(index) else {
            return Err(diesel::result::Error::QueryBuilderError(
                "a claim's position lacks a value of its order".into(),
            ));
        };
        let on_term = if T::descending(index) {
            comparison.reversed()
        } else {
            comparison
        };
        let compare = |on_term: Comparison, mut out: AstPass<'_, 'b, DB>| {
            T::walk_column(&self.terms, index, out.reborrow())?;
            out.push_sql(on_term.sql());
            T::walk_value(index, value, out)
        };
        let terms_hold_the_key = self.key_among_terms[..Key::COLUMNS]
            .iter()
            .all(|&among| among);
        if index + 1 == T::LEN && terms_hold_the_key {
            return compare(on_term, out);
        }
        let later = |out: AstPass<'_, 'b, DB>| self.walk_from(index + 1, comparison, position, out);
        walk_in_turn(on_term, compare, later, out)
    }
}

#[cfg(all(test, feature = "postgres_backend", feature = "mysql_backend"))]
mod tests;
