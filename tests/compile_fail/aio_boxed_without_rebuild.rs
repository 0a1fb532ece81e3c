//! The async claim builds each statement from the query too: a boxed query
//! is refused with a pointer at `rebuild`.
//~ cannot be claimed from `BoxedSelectStatement<
//~ wrap the code that builds it in `diesel_claim::rebuild(|| …)`
//~# 5 errors in at most 150 lines
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
        .into_boxed()
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
