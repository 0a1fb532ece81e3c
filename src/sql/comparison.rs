//! How columns are compared with values: by a [`Comparison`] (before,
//! through, equal, from or after), one column alone, several as a row value
//! `(a, b) > ($1, $2)`, or in turn, `(a >= $1 AND (a > $2 OR b > $3))`, each
//! column bounding an index range where the one before it is tied.

use diesel::backend::Backend;
use diesel::query_builder::AstPass;
use diesel::QueryResult;

/// How a key, or a claim order's position, is compared with a value: the
/// comparison's side of the value in the order of the compared column (a
/// descending column is compared [`reversed`](Self::reversed)).
#[derive(Debug, Clone, Copy)]
pub enum Comparison {
    /// Strictly before the value: `<`.
    Before,
    /// Up to the value, the value included: `<=`.
    Through,
    /// The value itself: `=`.
    Equal,
    /// From the value on, the value included: `>=`.
    From,
    /// Strictly after the value: `>`.
    After,
}

impl Comparison {
    /// The operator, with a space either side.
    pub fn sql(self) -> &'static str {
        match self {
            Comparison::Before => " < ",
            Comparison::Through => " <= ",
            Comparison::Equal => " = ",
            Comparison::From => " >= ",
            Comparison::After => " > ",
        }
    }

    /// The same side of the value in the reverse order.
    pub fn reversed(self) -> Self {
        match self {
            Comparison::Before => Comparison::After,
            Comparison::Through => Comparison::From,
            Comparison::Equal => Comparison::Equal,
            Comparison::From => Comparison::Through,
            Comparison::After => Comparison::Before,
        }
    }

    /// On a leading column of several compared in turn, what bounds the
    /// column itself: the value included, on the comparison's side.
    pub fn inclusive(self) -> Self {
        match self {
            Comparison::Before | Comparison::Through => Comparison::Through,
            Comparison::Equal => Comparison::Equal,
            Comparison::From | Comparison::After => Comparison::From,
        }
    }

    /// On a leading column of several compared in turn, what settles the
    /// comparison without the later columns: the value excluded, on the
    /// comparison's side (none for equality, which every column must meet).
    pub fn strict(self) -> Option<Self> {
        match self {
            Comparison::Before | Comparison::Through => Some(Comparison::Before),
            Comparison::Equal => None,
            Comparison::From | Comparison::After => Some(Comparison::After),
        }
    }
}

/// Renders one column, or one value, of a key of several.
pub(super) type Part<'p, 'b, DB> = &'p dyn Fn(AstPass<'_, 'b, DB>) -> QueryResult<()>;

/// `a`, or `(a, b)`.
pub(super) fn walk_parts<'b, DB: Backend>(
    parts: &[Part<'_, 'b, DB>],
    mut out: AstPass<'_, 'b, DB>,
) -> QueryResult<()> {
    if let [part] = parts {
        return part(out);
    }
    let mut separator = "(";
    for part in parts {
        out.push_sql(separator);
        part(out.reborrow())?;
        separator = ", ";
    }
    out.push_sql(")");
    Ok(())
}

/// The parts of the columns `tied` leaves, or all of them if it leaves none.
pub(super) fn untied<'p, 'b, DB: Backend>(
    parts: &[Part<'p, 'b, DB>],
    tied: [bool; 3],
) -> Vec<Part<'p, 'b, DB>> {
    let untied: Vec<_> = (parts.iter().zip(tied))
        .filter(|(_, tied)| !tied)
        .map(|(part, _)| *part)
        .collect();
    if untied.is_empty() {
        parts.to_vec()
    } else {
        untied
    }
}

/// Columns compared in turn, for a backend that reads a row-value
/// comparison without its index (MySQL, MariaDB): `(a, b) > (x, y)` is
/// written `(a >= x AND (a > x OR b > y))`.
pub(super) fn walk_expanded<'b, DB: Backend>(
    comparison: Comparison,
    columns: &[Part<'_, 'b, DB>],
    values: &[Part<'_, 'b, DB>],
    out: AstPass<'_, 'b, DB>,
) -> QueryResult<()> {
    let [column, later_columns @ ..] = columns else {
        return Ok(());
    };
    let [value, later_values @ ..] = values else {
        return Ok(());
    };
    let compare = |comparison: Comparison, mut out: AstPass<'_, 'b, DB>| {
        column(out.reborrow())?;
        out.push_sql(comparison.sql());
        value(out)
    };
    if later_columns.is_empty() {
        return compare(comparison, out);
    }
    let later =
        |out: AstPass<'_, 'b, DB>| walk_expanded(comparison, later_columns, later_values, out);
    walk_in_turn(comparison, compare, later, out)
}

/// A leading column compared by `comparison`, the later ones (`later`) where
/// it is tied: `(c >= v AND (c > v OR later))`, whose first condition bounds
/// an index range on the column, or `(c = v AND later)`. `compare` renders
/// the column compared with its value.
pub(super) fn walk_in_turn<'b, DB: Backend>(
    comparison: Comparison,
    compare: impl Fn(Comparison, AstPass<'_, 'b, DB>) -> QueryResult<()>,
    later: impl FnOnce(AstPass<'_, 'b, DB>) -> QueryResult<()>,
    mut out: AstPass<'_, 'b, DB>,
) -> QueryResult<()> {
    let strict = comparison.strict();
    out.push_sql("(");
    compare(comparison.inclusive(), out.reborrow())?;
    out.push_sql(" AND ");
    if let Some(strict) = strict {
        out.push_sql("(");
        compare(strict, out.reborrow())?;
        out.push_sql(" OR ");
    }
    later(out.reborrow())?;
    if strict.is_some() {
        out.push_sql(")");
    }
    out.push_sql(")");
    Ok(())
}
