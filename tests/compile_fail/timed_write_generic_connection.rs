//! A helper that gives a claimed row back through any connection, written
//! without saying that the row can be written on it: the error is the
//! claimed row's, says what writing it needs, and the compiler offers the
//! bound to add.
//~ a claim of rows `Job` stamped in `columns::claimed_until` cannot write on `C`
//~ the stamp be a nullable timestamp column of their table
//~ code generic over the connection says so in its bounds: `Row: diesel_claim::StampedRow<C, StampColumn>`
//~ Job: diesel_claim::StampedRow<C, columns::claimed_until>
//~# 1 error in at most 40 lines
use diesel::prelude::*;
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

fn give_back<C: Connection>(
    job: Claimed<Job, jobs::claimed_until>,
    conn: &mut C,
) -> Result<(), diesel_claim::Error> {
    let _ = job.row().id;
    job.release(conn)
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = give_back::<PgConnection>;
    let _ = &mut conn;
}
