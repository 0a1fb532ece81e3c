//! `then_update` writes the claimed rows: changes for another table are
//! refused, saying what they must be.
//~ the rows of `
//~ cannot be written once done with `
//~ `then_update(changes)` takes an `AsChangeset` for that table
//~# 1 error in at most 40 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;

diesel::table! {
    customers (id) {
        id -> Integer,
        name -> Text,
    }
}

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
        .then_update(customers::name.eq("done"))
        .each(&mut conn, |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        });
}
