//! An async visibility-timeout claim hands over `Claimed<Row, _, Async>`:
//! when the closure's row type is fixed before the closure is read (here by
//! naming the call's type parameters), the error is the claim's, and says
//! what the closure gets.
//~ `Job` cannot be claimed from `Unclaimed<
//~ on `AsyncPgConnection`
//~ or, with a visibility timeout, `Claimed<Row, _, Async>`
//~# 3 errors in at most 110 lines
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_claim::aio::prelude::*;
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

async fn claim(conn: &mut AsyncPgConnection) {
    let _ = jobs::table
        .filter(jobs::id.gt(0))
        .build_claim()
        .visibility_timeout(jobs::claimed_until, Duration::from_secs(60))
        .each::<AsyncPgConnection, Job, diesel_claim::Error, _>(conn, async |_, job| {
            let _ = job.id;
            Ok(())
        })
        .await;
}

fn main() {
    let _ = claim;
}
