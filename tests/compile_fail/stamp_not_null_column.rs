//! A visibility-timeout column that is `NOT NULL`: the error is where the
//! column is given and says what it must be, instead of an overflow that
//! asks for a higher recursion limit, and lists none of the crate's impls.
//~ the visibility-timeout column must be a nullable timestamp column, and `columns::claimed_until` is of type `diesel::sql_types::Timestamptz`
//~ not a nullable timestamp column
//~ declare the column `Nullable<Timestamptz>` or `Nullable<Timestamp>` on PostgreSQL
//~! the following other types implement trait
//~# 1 error in at most 25 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;
use std::time::Duration;

diesel::table! {
    jobs (id) {
        id -> Integer,
        claimed_until -> Timestamptz,
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
        .select(Job::as_select())
        .build_claim()
        .visibility_timeout(jobs::claimed_until, Duration::from_secs(60))
        .each(&mut conn, |_, job: diesel_claim::Claimed<Job, jobs::claimed_until>| {
            let _ = job.id;
            Ok::<_, diesel_claim::Error>(())
        });
}
