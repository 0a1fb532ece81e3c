//! A row type without `Identifiable`: the error is the claim's, names
//! `#[derive(Identifiable)]`, and lists none of the crate's own tables.
//~ rows of type `Order` cannot be claimed from `SelectStatement<
//~ the row type must `#[derive(Identifiable)]`
//~! HasTable
//~! __diesel_schema_migrations
//~# 1 error in at most 30 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;

diesel::table! {
    customers (id) {
        id -> Integer,
    }
}

diesel::table! {
    orders (id) {
        id -> Integer,
        done -> Bool,
    }
}

#[derive(Queryable, Selectable, Identifiable)]
struct Customer {
    id: i32,
}

#[derive(Queryable, Selectable)]
struct Order {
    id: i32,
    done: bool,
}

fn main() {
    let _ = Customer { id: 0 }.id;
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = orders::table
        .filter(orders::done.eq(false))
        .claim_each(&mut conn, |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        });
}
