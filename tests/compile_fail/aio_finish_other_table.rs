//! The async `then_update` writes the claimed rows: changes for another
//! table are refused, saying what they must be.
//~ cannot be written once done with `
//~ `then_update(changes)` takes an `AsChangeset` for that table
//~# 3 errors in at most 80 lines
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_claim::aio::prelude::*;

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

async fn claim(conn: &mut AsyncPgConnection) {
    let _ = orders::table
        .filter(orders::done.eq(false))
        .build_claim()
        .then_update(customers::name.eq("done"))
        .each(conn, async |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        })
        .await;
}

fn main() {
    let _ = claim;
}
