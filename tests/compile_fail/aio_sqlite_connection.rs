//! A diesel-async SQLite connection (`SyncConnectionWrapper`) with the async
//! prelude: the error says the async API does not run on that backend, and
//! on which it does.
//~ diesel-claim's async API does not support the backend `Sqlite`
//~ the async API runs on PostgreSQL and MySQL
//~! is not satisfied
//~# 3 errors in at most 90 lines
use diesel::prelude::*;
use diesel::sqlite::SqliteConnection;
use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
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

async fn claim(conn: &mut SyncConnectionWrapper<SqliteConnection>) {
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
