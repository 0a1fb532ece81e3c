//! The async twin of `timed_write_generic_connection`: a helper that gives a
//! claimed row back through any async connection, written without saying
//! that the row can be written on it.
//~ a claim of rows `Job` stamped in `columns::claimed_until` cannot write on `C`
//~ code generic over the connection says so in its bounds: `Row: diesel_claim::aio::StampedRow<C, StampColumn>`
//~# 6 errors in at most 150 lines
use diesel::prelude::*;
use diesel_async::AsyncConnection;
use diesel_claim::aio::Async;
use diesel_claim::Claimed;

diesel::table! {
    jobs (id) {
        id -> Integer,
        claimed_until -> Nullable<Timestamptz>,
    }
}

#[derive(Queryable, Selectable, Identifiable)]
struct Job {
    id: i32,
}

async fn give_back<C: AsyncConnection>(
    job: Claimed<Job, jobs::claimed_until, Async>,
    conn: &mut C,
) -> Result<(), diesel_claim::Error> {
    let _ = job.row().id;
    job.release(conn).await
}

fn main() {
    let _ = give_back::<diesel_async::AsyncPgConnection>;
}
