//! How positions compare in a claim's ranges, term by term.

use super::*;
use crate::sql::keys::{KeyRange, One, Row};
use crate::sql::order_by::KeyAmongTerms;
use crate::sql::InRange;

diesel::table! {
    jobs (id) {
        id -> Integer,
        priority -> Integer,
        due -> Text,
    }
}

diesel::table! {
    lines (order_id, line_no) {
        order_id -> Integer,
        line_no -> Integer,
        priority -> Integer,
    }
}

diesel::table! {
    stock (site, bin, item) {
        site -> Integer,
        bin -> Integer,
        item -> Integer,
    }
}

/// The columns of the order `T` and the key `key`, as a claim compares them.
fn positioned<T: OrderTerms, W: KeyAmongTerms>(key: W) -> Positioned<T, W> {
    Positioned::new(key, W::among::<T>())
}

fn sql<DB: crate::backend::ClaimBackend>(fragment: &impl QueryFragment<DB>) -> String {
    crate::sql::rendered::render::<DB>(fragment).unwrap()
}

fn at(values: &[i64], key: i32) -> Position<i32> {
    Position {
        values: values
            .iter()
            .map(|value| OrderValue::Integer(*value))
            .collect(),
        key,
    }
}

/// `ORDER BY priority DESC, due, id`: after a position means a lower
/// priority, or the same and a later due date, or both the same and a
/// higher key; up to one, the other way round.
#[test]
fn positions_compare_term_by_term_in_each_terms_direction() {
    type Order = (Desc<jobs::priority>, Asc<jobs::due>);
    let range = InRange {
        column: positioned::<Order, _>(One(jobs::id)),
        range: KeyRange::between(Some(at(&[5, 1], 7)), at(&[2, 3], 9)),
    };
    assert_eq!(
        sql::<diesel::pg::Pg>(&range),
        r#"(("jobs"."priority" <= $1 AND ("jobs"."priority" < $2 OR ("jobs"."due" >= $3 AND ("jobs"."due" > $4 OR "jobs"."id" > $5)))) AND ("jobs"."priority" >= $6 AND ("jobs"."priority" > $7 OR ("jobs"."due" <= $8 AND ("jobs"."due" < $9 OR "jobs"."id" <= $10)))))"#
    );
    let composite = InRange {
        column: positioned::<Desc<lines::priority>, _>(Row((lines::order_id, lines::line_no))),
        range: KeyRange::after(Some(Position {
            values: vec![OrderValue::Integer(5)],
            key: (1, 2),
        })),
    };
    assert_eq!(
        sql::<diesel::mysql::Mysql>(&composite),
        "((`lines`.`priority` <= ? AND (`lines`.`priority` < ? OR (`lines`.`order_id` >= ? AND \
         (`lines`.`order_id` > ? OR `lines`.`line_no` > ?)))))"
    );
}

/// After the terms, every term equals its value: a key of several columns
/// compares the columns that are not terms, whichever their place in the
/// key and the term's direction, as a row value of those left (column by
/// column on MySQL), or as the one column left.
#[test]
fn a_key_after_the_terms_compares_the_columns_they_leave() {
    let lines_key = || Row((lines::order_id, lines::line_no));
    let line_at = |values: &[i64], key: (i32, i32)| Position {
        values: values
            .iter()
            .map(|value| OrderValue::Integer(*value))
            .collect(),
        key,
    };
    let by_order = InRange {
        column: positioned::<Desc<lines::order_id>, _>(lines_key()),
        range: KeyRange::after(Some(line_at(&[5], (5, 2)))),
    };
    let expected =
        r#"(("lines"."order_id" <= $1 AND ("lines"."order_id" < $2 OR "lines"."line_no" > $3)))"#;
    assert_eq!(sql::<diesel::pg::Pg>(&by_order), expected);
    let by_line = InRange {
        column: positioned::<Asc<lines::line_no>, _>(lines_key()),
        range: KeyRange::between(Some(line_at(&[2], (5, 2))), line_at(&[4], (1, 4))),
    };
    assert_eq!(
        sql::<diesel::mysql::Mysql>(&by_line),
        "((`lines`.`line_no` >= ? AND (`lines`.`line_no` > ? OR `lines`.`order_id` > ?)) AND \
         (`lines`.`line_no` <= ? AND (`lines`.`line_no` < ? OR `lines`.`order_id` <= ?)))"
    );
    let then_order = InRange {
        column: positioned::<(Desc<lines::priority>, Asc<lines::order_id>), _>(lines_key()),
        range: KeyRange::after(Some(line_at(&[9, 5], (5, 2)))),
    };
    assert_eq!(
        sql::<diesel::pg::Pg>(&then_order),
        r#"(("lines"."priority" <= $1 AND ("lines"."priority" < $2 OR ("lines"."order_id" >= $3 AND ("lines"."order_id" > $4 OR "lines"."line_no" > $5)))))"#
    );

    // A key of three, its middle column a term: the two others are left.
    let by_bin = InRange {
        column: positioned::<Desc<stock::bin>, _>(Row((stock::site, stock::bin, stock::item))),
        range: KeyRange::after(Some(Position {
            values: vec![OrderValue::Integer(3)],
            key: (1, 3, 7),
        })),
    };
    assert_eq!(
        sql::<diesel::pg::Pg>(&by_bin),
        r#"(("stock"."bin" <= $1 AND ("stock"."bin" < $2 OR ("stock"."site", "stock"."item") > ($3, $4))))"#
    );
    assert_eq!(
        sql::<diesel::mysql::Mysql>(&by_bin),
        "((`stock`.`bin` <= ? AND (`stock`.`bin` < ? OR (`stock`.`site` >= ? AND \
         (`stock`.`site` > ? OR `stock`.`item` > ?)))))"
    );
}

/// Ordered by the key (last, or with other terms before it), rows tied
/// on every term are one row: the last term is compared alone, strictly
/// past a position and inclusively from or up to one.
#[test]
fn an_order_that_holds_the_key_compares_it_once() {
    let by_key = InRange {
        column: positioned::<Desc<jobs::id>, _>(One(jobs::id)),
        range: KeyRange::between(Some(at(&[7], 7)), at(&[3], 3)),
    };
    assert_eq!(
        sql::<diesel::pg::Pg>(&by_key),
        r#"("jobs"."id" < $1 AND "jobs"."id" >= $2)"#
    );
    type Order = (Desc<jobs::priority>, Asc<jobs::id>);
    let then_key = InRange {
        column: positioned::<Order, _>(One(jobs::id)),
        range: KeyRange::after(Some(at(&[5, 7], 7))),
    };
    assert_eq!(
        sql::<diesel::mysql::Mysql>(&then_key),
        "((`jobs`.`priority` <= ? AND (`jobs`.`priority` < ? OR `jobs`.`id` > ?)))"
    );
}

/// A position read in key order has no values: one taken for an order
/// with terms is a bug, reported rather than rendered wrong.
#[test]
fn a_position_without_its_order_values_is_an_error() {
    let range = InRange {
        column: positioned::<Desc<jobs::priority>, _>(One(jobs::id)),
        range: KeyRange::after(Some(Position::of_key(1))),
    };
    assert!(crate::sql::rendered::render::<diesel::pg::Pg>(&range).is_err());
}
