//! A visibility-timeout claim hands over `Claimed` rows: when the closure's
//! row type is fixed before the closure is read (here by naming the call's
//! type parameters), the error is the claim's, and says what the closure
//! gets.
//~ `Job` cannot be claimed from `Unclaimed<
//~ on `diesel::PgConnection`
//~ the closure gets the rows of the query (a `#[derive(Identifiable)]` type loadable from it), or, with a visibility timeout, `Claimed<Row, _>`
//~# 1 error in at most 40 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;
use std::time::Duration;

diesel::table! {
    jobs (id) {
        id -> Integer,
        claimed_until -> Nullable<Timestamptz>,
    }
}

#[derive(Queryable, Selectable, Identifiable)]
struct Job {
    id: i32,
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = jobs::table
        .filter(jobs::id.gt(0))
        .build_claim()
        .visibility_timeout(jobs::claimed_until, Duration::from_secs(60))
        .each::<PgConnection, Job, diesel_claim::Error, _, _>(&mut conn, |_, job| {
            let _ = job.id;
            Ok(())
        });
}
