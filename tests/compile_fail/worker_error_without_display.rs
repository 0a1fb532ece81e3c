//! A worker whose closure's error type is not `Display`: the error says
//! why a worker needs it, in place of the compiler's plain message.
//~ `JobError` cannot be the error type of a worker's jobs
//~ a worker writes each failed job's error into its events and logs, so the type must implement `std::fmt::Display`
//~ `diesel_claim::Error` and `anyhow::Error` are both; so is an error enum of your own that implements both, as `#[derive(thiserror::Error)]` with a `#[from] diesel_claim::Error` variant does
//~# 1 error in at most 40 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;

diesel::table! {
    jobs (id) {
        id -> Integer,
        done -> Bool,
    }
}

#[derive(Queryable, Selectable, Identifiable)]
struct Job {
    id: i32,
    done: bool,
}

#[derive(Debug)]
enum JobError {
    Claim(diesel_claim::Error),
}

impl From<diesel_claim::Error> for JobError {
    fn from(error: diesel_claim::Error) -> Self {
        JobError::Claim(error)
    }
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let stop = diesel_claim::StopHandle::new();
    let _ = jobs::table
        .filter(jobs::done.eq(false))
        .build_claim()
        .worker(&stop)
        .run(&mut conn, |_, job: Job| {
            let _ = (job.id, job.done);
            Ok::<_, JobError>(())
        });
}
