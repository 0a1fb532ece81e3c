//! A visibility-timeout column of another table: the error says the column
//! must be one of the claimed table, not which tables may appear together.
//~ the visibility-timeout column must be a nullable timestamp column of the claimed table, and `runs::columns::claimed_until` is not
//~! AppearsInFromClause
//~! TableNotEqual
use diesel::prelude::*;
use diesel_claim::prelude::*;
use std::time::Duration;

diesel::table! {
    jobs (id) {
        id -> Integer,
        claimed_until -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    runs (id) {
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
        .visibility_timeout(runs::claimed_until, Duration::from_secs(60))
        .each(&mut conn, |_, job: diesel_claim::Claimed<Job, runs::claimed_until>| {
            let _ = job.id;
            Ok::<_, diesel_claim::Error>(())
        });
}
