//! An async visibility-timeout claim builds its statements from the query
//! too: a boxed query is refused where the column is given and by the
//! stamp's error, both with a pointer at `rebuild`.
//~ cannot be cloned, and the crate builds each statement from a copy of the query
//~ wrap the code that builds it in `diesel_claim::rebuild(|| …)`
//~ rows of type `_` cannot be claimed from `Unclaimed<BoxedSelectStatement<
//~ with a stamp in `columns::claimed_until`
//~ the stamp a nullable timestamp column of that table; a boxed query cannot be cloned: wrap the code that builds it in `diesel_claim::rebuild(|| …)`
//~# 3 errors in at most 90 lines
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_claim::aio::prelude::*;
use std::time::Duration;

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

async fn claim(conn: &mut AsyncPgConnection) {
    let _ = jobs::table
        .filter(jobs::id.gt(0))
        .into_boxed()
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
