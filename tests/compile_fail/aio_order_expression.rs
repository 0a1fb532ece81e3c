//! An async claim pages by its order's columns too: an order by an
//! expression is refused, saying what a claim can follow.
//~ a claim cannot follow the order `Desc<Add<priority
//~ order a claim by up to three NOT NULL columns of the query
//~# 3 errors in at most 130 lines
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_claim::aio::prelude::*;

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

async fn claim(conn: &mut AsyncPgConnection) {
    let _ = jobs::table
        .filter(jobs::done.eq(false))
        .order((jobs::priority + 1).desc())
        .claim_each(conn, async |_, job: Job| {
            let _ = (job.id, job.priority, job.done);
            Ok::<_, diesel_claim::Error>(())
        })
        .await;
}

fn main() {
    let _ = claim;
}
