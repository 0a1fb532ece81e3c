//! A visibility-timeout claim hands over `Claimed` rows: a closure that takes
//! the bare row is told the signature it must have.
//~ type mismatch in closure arguments
//~ expected closure signature `for<'a> fn(&'a mut diesel::PgConnection, Claimed<_, columns::claimed_until>) -> _`
//~# 1 error in at most 30 lines
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
        .each(&mut conn, |_, job: Job| {
            let _ = job.id;
            Ok::<_, diesel_claim::Error>(())
        });
}
