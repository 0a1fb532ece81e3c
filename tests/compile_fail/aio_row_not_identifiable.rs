//! An async claim of a row type without `Identifiable`: the error is the
//! claim's, names `#[derive(Identifiable)]`, and lists none of the crate's
//! own tables.
//~ rows of type `Order` cannot be claimed from `SelectStatement<
//~ the row type must `#[derive(Identifiable)]`
//~! HasTable
//~# 3 errors in at most 70 lines
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_claim::aio::prelude::*;

diesel::table! {
    orders (id) {
        id -> Integer,
        done -> Bool,
    }
}

#[derive(Queryable, Selectable)]
struct Order {
    id: i32,
    done: bool,
}

async fn claim(conn: &mut AsyncPgConnection) {
    let _ = orders::table
        .filter(orders::done.eq(false))
        .claim_each(conn, async |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        })
        .await;
}

fn main() {
    let _ = claim;
}
