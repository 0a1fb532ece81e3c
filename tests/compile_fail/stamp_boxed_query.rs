//! A visibility-timeout claim builds its statements from the query too: a
//! boxed query is refused where the column is given and by the stamp's
//! error, both with a pointer at `rebuild`, and neither says only that the
//! column is wrong.
//~ cannot be cloned, and the crate builds each statement from a copy of the query
//~ wrap the code that builds it in `diesel_claim::rebuild(|| …)`
//~ rows of type `_` cannot be claimed from `Unclaimed<BoxedSelectStatement<
//~ with a stamp in `columns::claimed_until`
//~ the stamp a nullable timestamp column of that table; a boxed query cannot be cloned: wrap the code that builds it in `diesel_claim::rebuild(|| …)`
//~# 2 errors in at most 60 lines
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
        .into_boxed()
        .build_claim()
        .visibility_timeout(jobs::claimed_until, Duration::from_secs(60))
        .each(&mut conn, |_, job: diesel_claim::Claimed<Job, jobs::claimed_until>| {
            let _ = job.id;
            Ok::<_, diesel_claim::Error>(())
        });
}
