//! The async `mark` builds its statements from the query too: a boxed query
//! is refused by the mark's error, with a pointer at `rebuild`.
//~ rows of type `_` cannot be claimed from `BoxedSelectStatement<
//~ and marked with `Grouped<Eq<done
//~ the changes an `AsChangeset` for that table; a boxed query cannot be cloned: wrap the code that builds it in `diesel_claim::rebuild(|| …)`
//~# 5 errors in at most 160 lines
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
        .into_boxed()
        .build_claim()
        .mark(orders::done.eq(true))
        .each(conn, async |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        })
        .await;
}

fn main() {
    let _ = claim;
}
