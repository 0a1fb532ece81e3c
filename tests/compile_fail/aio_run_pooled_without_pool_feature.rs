//! A worker on diesel-async's bb8 pool, with diesel-claim's `bb8` feature
//! left off: the error names the feature, instead of saying only that the
//! pool is not a `WorkerPool`.
//~ an async worker cannot run on `bb8::api::Pool<AsyncDieselConnectionManager<AsyncPgConnection>>`
//~ with diesel-claim's feature of the same name: `features = ["bb8"]` or `features = ["deadpool"]`
//~# 3 errors in at most 70 lines
use diesel::prelude::*;
use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::AsyncPgConnection;
use diesel_claim::aio::prelude::*;
use diesel_claim::StopHandle;

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

async fn work(pool: &Pool<AsyncPgConnection>, stop: &StopHandle) {
    let _ = jobs::table
        .filter(jobs::done.eq(false))
        .build_claim()
        .worker(stop)
        .run_pooled(pool, async |_, job: Job| {
            let _ = (job.id, job.done);
            Ok::<_, diesel_claim::Error>(())
        })
        .await;
}

fn main() {
    let _ = work;
}
