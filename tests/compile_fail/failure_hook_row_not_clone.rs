//! A failure hook gets the row as it was handed over, so the rows must be
//! `Clone`: a hook on rows that are not is refused, saying what a hook is.
//~ the failure hook does not fit this claim
//~ a failure hook is a closure `|conn, row: Row, error: &E| -> Result<(), E>`
//~ rows that are `Clone`
//~# 1 error in at most 50 lines
use diesel::prelude::*;
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
    let _ = orders::table
        .filter(orders::done.eq(false))
        .build_claim()
        .on_failure(|_: &mut PgConnection, order: Order, _: &diesel_claim::Error| {
            let _ = order.id;
            Ok(())
        })
        .each(&mut conn, |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        });
}
