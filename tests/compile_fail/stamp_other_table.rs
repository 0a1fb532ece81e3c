//! A visibility-timeout column of another table: one error, where the
//! column is given, naming the column's table (and the compiler's help the
//! claim's), not which tables may appear together, and none for the calls
//! on the claim that follow.
//~ the visibility-timeout column `runs::columns::claimed_until` is a column of `runs::table`, and the claim does not take its rows from `runs::table` alone
//~! cannot be cloned
//~! rebuild
//~! AppearsInFromClause
//~! TableNotEqual
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
        .select(Job::as_select())
        .build_claim()
        .visibility_timeout(runs::claimed_until, Duration::from_secs(60))
        .each(&mut conn, |_, job: diesel_claim::Claimed<Job, _>| {
            let _ = job.id;
            Ok::<_, diesel_claim::Error>(())
        });
}
