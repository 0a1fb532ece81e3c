//! A claim pages by its order's columns: an order by an expression is
//! refused, saying what a claim can follow.
//~ a claim cannot follow the order `Desc<Add<priority
//~ order a claim by up to three NOT NULL columns of the query
//~# 1 error in at most 50 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;

diesel::table! {
    jobs (id) {
        id -> Integer,
        priority -> Integer,
        done -> Bool,
    }
}

#[derive(Queryable, Selectable, Identifiable)]
struct Job {
    id: i32,
    priority: i32,
    done: bool,
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = jobs::table
        .filter(jobs::done.eq(false))
        .order((jobs::priority + 1).desc())
        .claim_each(&mut conn, |_, job: Job| {
            let _ = (job.id, job.priority, job.done);
            Ok::<_, diesel_claim::Error>(())
        });
}
