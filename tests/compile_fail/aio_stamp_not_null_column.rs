//! An async visibility-timeout claim on a `NOT NULL` column: the error is
//! where the column is given and says what it must be.
//~ the visibility-timeout column must be a nullable timestamp column, and `columns::claimed_until` is of type `diesel::sql_types::Timestamptz`
//~! the following other types implement trait
//~# 1 error in at most 25 lines
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_claim::aio::prelude::*;
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

async fn claim(conn: &mut AsyncPgConnection) {
    let _ = jobs::table
        .filter(jobs::id.gt(0))
        .select(Job::as_select())
        .build_claim()
        .visibility_timeout(jobs::claimed_until, Duration::from_secs(60))
        .each(conn, async |_, job| {
            let _ = job.id;
            Ok::<_, diesel_claim::Error>(())
        })
        .await;
}

fn main() {
    let _ = claim;
}
