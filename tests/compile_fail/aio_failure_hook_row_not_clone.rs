//! An async failure hook gets the row as it was handed over, so the rows
//! must be `Clone`: a hook on rows that are not is refused, saying what a
//! hook is.
//~ the failure hook does not fit this claim
//~ rows that are `Clone`
//~# 3 errors in at most 120 lines
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_claim::aio::prelude::*;

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
        .on_failure(async |_: &mut AsyncPgConnection, order: Order, _: &Error| {
            let _ = order.id;
            Ok(())
        })
        .each(conn, async |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, Error>(())
        })
        .await;
}

fn main() {
    let _ = claim;
}
