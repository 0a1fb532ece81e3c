//! A retry schedule's columns of another table than the claimed one.
//~ the retry schedule's columns must be columns of the claimed table, and `(runs::columns::attempts, runs::columns::run_at)` are not, or the query cannot be cloned
//~# 6 errors in at most 230 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::Retries;

diesel::table! {
    jobs (id) {
        id -> Integer,
        attempts -> Integer,
        run_at -> Timestamptz,
    }
}

diesel::table! {
    runs (id) {
        id -> Integer,
        attempts -> Integer,
        run_at -> Timestamptz,
    }
}

#[derive(Queryable, Selectable, Identifiable, Clone)]
struct Job {
    id: i32,
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = jobs::table
        .select(Job::as_select())
        .build_claim()
        .retries(Retries::new(runs::attempts, runs::run_at))
        .each(&mut conn, |_, job: Job| {
            let _ = job.id;
            Ok::<_, diesel_claim::Error>(())
        });
}
