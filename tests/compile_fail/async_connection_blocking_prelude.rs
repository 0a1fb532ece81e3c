//! A diesel-async connection with the blocking prelude: each of the seven
//! calls gets one error, which says the connection is not one the blocking
//! API runs on and which prelude to import, not which of Diesel's traits some
//! inner bound missed.
//~ `AsyncPgConnection` is not a blocking connection diesel-claim runs on
//~ import `diesel_claim::aio::prelude::*` in place of `diesel_claim::prelude::*`
//~ a blocking claim worker cannot wait for rows on `AsyncPgConnection`
//~ due to 7 previous errors
//~! is not satisfied
//~# 7 errors in at most 170 lines
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_claim::prelude::*;

diesel::table! {
    orders (id) {
        id -> Integer,
        email_sent -> Bool,
        version -> Integer,
    }
}

#[derive(Queryable, Selectable, Identifiable)]
struct Order {
    id: i32,
    email_sent: bool,
    version: i32,
}

fn pending() -> diesel::dsl::Filter<orders::table, diesel::dsl::Eq<orders::email_sent, bool>> {
    orders::table.filter(orders::email_sent.eq(false))
}

fn use_async_connection(conn: &mut AsyncPgConnection) {
    let _ = pending().claim_each(conn, |_, _: Order| Ok::<_, diesel_claim::Error>(()));
    let _ = pending().build_claim().batch(10).each(conn, |_, _: Order| Ok::<_, diesel_claim::Error>(()));
    let _ = orders::table.find(1).with_lock(conn, |_, _: Order| Ok::<_, diesel_claim::Error>(()));
    let _ = orders::table
        .find(1)
        .update_versioned(orders::version, 1, orders::email_sent.eq(true))
        .execute(conn);
    let _ = diesel_claim::Lease::acquire(conn, "name", std::time::Duration::from_secs(1));
    let _ = diesel_claim::run_migrations(conn);
    let stop = diesel_claim::StopHandle::new();
    let _ = pending().build_claim().worker(&stop).run(conn, |_, _: Order| Ok::<_, diesel_claim::Error>(()));
}

fn main() {}
