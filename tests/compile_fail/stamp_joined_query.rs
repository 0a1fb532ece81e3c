//! A visibility-timeout claim of a joined query: one error, which says the
//! claim reads one table, and how to choose its rows by a join instead,
//! naming the column's table and the join in short, without the join's
//! paths through Diesel's modules.
//~ the visibility-timeout column `jobs::columns::claimed_until` is a column of `jobs::table`, and the claim does not take its rows from `jobs::table` alone
//~ a claim with a visibility timeout reads that one table: where a join chooses its rows, filter the table by a subquery instead (`.filter(id.eq_any(…))`)
//~! query_source::joins
//~! add it to
//~# 1 error in at most 30 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;
use std::time::Duration;

diesel::table! {
    jobs (id) {
        id -> Integer,
        queue_id -> Integer,
        claimed_until -> Nullable<Timestamptz>,
    }
}

diesel::table! {
    queues (id) {
        id -> Integer,
        paused -> Bool,
    }
}

diesel::joinable!(jobs -> queues (queue_id));
diesel::allow_tables_to_appear_in_same_query!(jobs, queues);

#[derive(Queryable, Selectable, Identifiable)]
struct Job {
    id: i32,
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = jobs::table
        .inner_join(queues::table)
        .filter(queues::paused.eq(false))
        .select(Job::as_select())
        .build_claim()
        .visibility_timeout(jobs::claimed_until, Duration::from_secs(60))
        .each(&mut conn, |_, job: diesel_claim::Claimed<Job, _>| {
            let _ = job.id;
            Ok::<_, diesel_claim::Error>(())
        });
}
