//! A worker on a pool runs a copy of its claim in each loop: a `rebuild`
//! closure that holds what cannot be cloned says so, and what to do.
//~ a worker on a pool runs a copy of its claim in each loop, and this claim cannot be copied
//~ or an `Arc` of what is not
//~! cannot be claimed from
//~# 1 error in at most 40 lines
use std::sync::Mutex;

use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel_claim::prelude::*;

diesel::table! {
    jobs (id) {
        id -> Integer,
        kind -> Integer,
    }
}

#[derive(Queryable, Selectable, Identifiable, Clone)]
struct Job {
    id: i32,
    kind: i32,
}

fn main() {
    let pool = Pool::new(ConnectionManager::<PgConnection>::new("postgres://")).unwrap();
    let kinds = Mutex::new(vec![1, 2]);
    let queue = diesel_claim::rebuild(move || {
        let kinds = kinds.lock().unwrap().clone();
        jobs::table.filter(jobs::kind.eq_any(kinds)).into_boxed()
    });
    let _ = queue
        .build_claim()
        .worker(&diesel_claim::StopHandle::new())
        .concurrency(4)
        .run_pooled(&pool, |_: &mut PgConnection, job: Job| {
            let _ = (job.id, job.kind);
            Ok::<_, diesel_claim::Error>(())
        });
}
