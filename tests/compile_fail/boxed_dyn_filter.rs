//! A `Box<dyn BoxableExpression>` filter cannot be cloned: the error is the
//! claim's, and points at `rebuild`, not at `Clone` for the boxed filter.
//~ rows of type `_` cannot be claimed from `SelectStatement<
//~ wrap the code that builds it in `diesel_claim::rebuild(|| …)`
//~! Clone` is not satisfied
//~! ClaimStatements
//~! Unclaimed
//~# 1 error in at most 40 lines
use diesel::pg::Pg;
use diesel::prelude::*;
use diesel::sql_types::Bool;
use diesel_claim::prelude::*;

diesel::table! {
    orders (id) {
        id -> Integer,
        done -> Bool,
    }
}

#[derive(Queryable, Selectable, Identifiable)]
struct Order {
    id: i32,
    done: bool,
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let pending: Box<dyn BoxableExpression<orders::table, Pg, SqlType = Bool>> =
        Box::new(orders::done.eq(false));
    let _ = orders::table
        .filter(pending)
        .claim_each(&mut conn, |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        });
}
