//! Both preludes in scope, the blocking one first, with a diesel-async
//! connection: the compiler warns that `ClaimDsl` is ambiguous and takes the
//! blocking trait, and the error says to import the async prelude in its
//! place.
//~ `AsyncPgConnection` is not a blocking connection diesel-claim runs on
//~ import `diesel_claim::aio::prelude::*` in place of `diesel_claim::prelude::*`
//~! is not satisfied
//~# 2 errors in at most 80 lines
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_claim::prelude::*;
use diesel_claim::aio::prelude::*;

diesel::table! {
    orders (id) {
        id -> Integer,
        email_sent -> Bool,
    }
}

#[derive(Queryable, Selectable, Identifiable)]
struct Order {
    id: i32,
    email_sent: bool,
}

fn use_async_connection(conn: &mut AsyncPgConnection) {
    let pending = orders::table.filter(orders::email_sent.eq(false));
    let _ = pending.claim_each(conn, async |_: &mut AsyncPgConnection, _: Order| {
        Ok::<_, diesel_claim::Error>(())
    });
}

fn main() {}
