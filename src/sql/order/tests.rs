//! How positions compare in a claim's ranges, term by term.

use super::*;
use crate::sql::keys::{KeyRange, One, Row};
use crate::sql::InRange;

diesel::table! {
    jobs (id) {
        id -> Integer,
        priority -> Integer,
        due -> Text,
    }
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
        column: Positioned::<Order, _>::new(One(jobs::id), false),
        range: KeyRange::between(Some(at(&[5, 1], 7)), at(&[2, 3], 9)),
    };
    assert_eq!(
        sql::<diesel::pg::Pg>(&range),
        r#"(("jobs"."priority" <= $1 AND ("jobs"."priority" < $2 OR ("jobs"."due" >= $3 AND ("jobs"."due" > $4 OR "jobs"."id" > $5)))) AND ("jobs"."priority" >= $6 AND ("jobs"."priority" > $7 OR ("jobs"."due" <= $8 AND ("jobs"."due" < $9 OR "jobs"."id" <= $10)))))"#
    );
    let composite = InRange {
        column: Positioned::<Desc<jobs::priority>, _>::new(Row((jobs::id, jobs::priority)), false),
        range: KeyRange::after(Some(Position {
            values: vec![OrderValue::Integer(5)],
            key: (1, 2),
        })),
    };
    assert_eq!(
        sql::<diesel::mysql::Mysql>(&composite),
        "((`jobs`.`priority` <= ? AND (`jobs`.`priority` < ? OR (`jobs`.`id` >= ? AND \
         (`jobs`.`id` > ? OR `jobs`.`priority` > ?)))))"
    );
}

/// Ordered by the key (last, or with other terms before it), rows tied
/// on every term are one row: the last term is compared alone, strictly
/// past a position and inclusively from or up to one.
#[test]
fn an_order_that_holds_the_key_compares_it_once() {
    let by_key = InRange {
        column: Positioned::<Desc<jobs::id>, _>::new(One(jobs::id), true),
        range: KeyRange::between(Some(at(&[7], 7)), at(&[3], 3)),
    };
    assert_eq!(
        sql::<diesel::pg::Pg>(&by_key),
        r#"("jobs"."id" < $1 AND "jobs"."id" >= $2)"#
    );
    type Order = (Desc<jobs::priority>, Asc<jobs::id>);
    let then_key = InRange {
        column: Positioned::<Order, _>::new(One(jobs::id), true),
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
        column: Positioned::<Desc<jobs::priority>, _>::new(One(jobs::id), false),
        range: KeyRange::after(Some(Position::of_key(1))),
    };
    assert!(crate::sql::rendered::render::<diesel::pg::Pg>(&range).is_err());
}
