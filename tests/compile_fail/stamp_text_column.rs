//! A visibility-timeout column of another type (text): the error says the
//! column must be a nullable timestamp, and the closure's row type may be
//! left to inference as usual.
//~ the visibility-timeout column must be a nullable timestamp column, and `columns::note` is of type `diesel::sql_types::Nullable<diesel::sql_types::Text>`
//~ `Nullable<Datetime>` (`DATETIME(6)`) on MySQL, `Nullable<Timestamp>` on SQLite
//~! the following other types implement trait
//~# 1 error in at most 25 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;
use std::time::Duration;

diesel::table! {
    jobs (id) {
        id -> Integer,
        note -> Nullable<Text>,
    }
}

#[derive(Queryable, Selectable, Identifiable)]
struct Job {
    id: i32,
    note: Option<String>,
}

fn run(conn: &mut PgConnection, job: &Job) {
    let _ = (conn, job.id, &job.note);
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = jobs::table
        .filter(jobs::id.gt(0))
        .build_claim()
        .visibility_timeout(jobs::note, Duration::from_secs(60))
        .each(&mut conn, |conn, job| {
            run(conn, &job);
            Ok::<_, diesel_claim::Error>(())
        });
}
