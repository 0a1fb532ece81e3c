//! A claim pages by its order columns' values: a nullable column is refused,
//! saying why.
//~ a claim cannot follow a nullable column
//~ order the claim by NOT NULL columns
//~! ClaimStatements
//~# 1 error in at most 40 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;

diesel::table! {
    jobs (id) {
        id -> Integer,
        priority -> Nullable<Integer>,
        done -> Bool,
    }
}

#[derive(Queryable, Selectable, Identifiable)]
struct Job {
    id: i32,
    priority: Option<i32>,
    done: bool,
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = jobs::table
        .filter(jobs::done.eq(false))
        .order(jobs::priority.desc())
        .claim_each(&mut conn, |_, job: Job| {
            let _ = (job.id, job.priority, job.done);
            Ok::<_, diesel_claim::Error>(())
        });
}
