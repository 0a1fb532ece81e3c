//! A `#[derive(MultiConnection)]` backend: the diagnostic says it is not
//! supported and what to do.
//~ diesel-claim does not support the backend
//~ `#[derive(MultiConnection)]` backend is not supported
//~# 2 errors in at most 70 lines
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

#[derive(diesel::MultiConnection)]
enum AnyConnection {
    Postgresql(PgConnection),
    Sqlite(SqliteConnection),
}

fn main() {
    let mut conn = AnyConnection::establish("postgres://").unwrap();
    let _ = orders::table
        .filter(orders::done.eq(false))
        .claim_each(&mut conn, |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        });
}
