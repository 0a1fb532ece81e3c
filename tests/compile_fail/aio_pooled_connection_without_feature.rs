//! A worker on a connection checked out of diesel-async's deadpool pool,
//! with diesel-claim's `deadpool` feature left off: the error names the
//! feature.
//~ an async claim worker cannot wait for rows on `deadpool::managed::object::Object<AsyncDieselConnectionManager<AsyncPgConnection>>`
//~ with diesel-claim's feature of the same name: `features = ["bb8"]` or `features = ["deadpool"]`
//~# 3 errors in at most 90 lines
use diesel::prelude::*;
use diesel_async::pooled_connection::deadpool::Pool;
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
    let mut conn = pool.get().await.unwrap();
    let _ = jobs::table
        .filter(jobs::done.eq(false))
        .build_claim()
        .worker(stop)
        .run(&mut conn, async |_, job: Job| {
            let _ = (job.id, job.done);
            Ok::<_, diesel_claim::Error>(())
        })
        .await;
}

fn main() {
    let _ = work;
}
