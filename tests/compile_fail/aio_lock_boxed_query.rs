//! The async `with_lock` reads its rows twice: a boxed query is refused with
//! a pointer at `rebuild`.
//~ rows of type `_` cannot be locked through `BoxedSelectStatement<
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

async fn lock(conn: &mut AsyncPgConnection) {
    let _ = orders::table
        .filter(orders::id.eq(1))
        .into_boxed()
        .with_lock(conn, async |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        })
        .await;
}

fn main() {
    let _ = lock;
}
