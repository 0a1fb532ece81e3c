//! A retry schedule's columns of the wrong types: each says what type its
//! column must have.
//~ a retry schedule counts attempts in an integer column, and `columns::note` is not one
//~ a retry schedule keeps the next run time in a timestamp column, and `columns::note` is not one
//~ a retry schedule writes errors in a text column, and `columns::attempts` is not one
//~ declare the column `Timestamptz` or `Timestamp` on PostgreSQL
//~# 3 errors in at most 80 lines
use diesel_claim::Retries;

diesel::table! {
    jobs (id) {
        id -> Integer,
        attempts -> Integer,
        run_at -> Timestamptz,
        note -> Text,
    }
}

fn main() {
    let _ = Retries::new(jobs::note, jobs::run_at);
    let _ = Retries::new(jobs::attempts, jobs::note);
    let _ = Retries::new(jobs::attempts, jobs::run_at).last_error(jobs::attempts);
}
