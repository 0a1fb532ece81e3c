//! A queue kept as a ring of partitions, created and rotated on diesel-async
//! (PostgreSQL): the blocking tests' invariants, awaited, and a rotation
//! dropped while it waits for its locks.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Text};
use diesel::{Connection, ExpressionMethods, PgConnection, QueryDsl, SelectableHelper};
use diesel_async::pooled_connection::{bb8, AsyncDieselConnectionManager};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use diesel_claim::aio::prelude::*;
use diesel_claim::ring::Ring;
use diesel_claim::StopHandle;

use crate::ring::{jobs, Job, QUEUE};

async fn queue() -> (testkit::PgTestDb, AsyncPgConnection) {
    let db = testkit::PgTestDb::new();
    PgConnection::establish(&db.url)
        .unwrap()
        .batch_execute(QUEUE)
        .unwrap();
    let conn = AsyncPgConnection::establish(&db.url).await.unwrap();
    (db, conn)
}

async fn enqueue(conn: &mut AsyncPgConnection, count: u32, payload: &str) {
    diesel::sql_query("INSERT INTO jobs (payload) SELECT $1 FROM generate_series(1, $2::bigint)")
        .bind::<Text, _>(payload)
        .bind::<BigInt, _>(i64::from(count))
        .execute(conn)
        .await
        .unwrap();
}

async fn slots(conn: &mut AsyncPgConnection) -> Vec<(i16, i64)> {
    jobs::table
        .group_by(jobs::slot)
        .select((jobs::slot, diesel::dsl::count_star()))
        .order(jobs::slot)
        .load(conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drained_slots_are_truncated_and_their_last_jobs_moved_on() {
    let (_db, mut conn) = queue().await;
    let ring = Ring::new("jobs").slots(4).slot_size(10).max_moved(2);
    ring.create(&mut conn).await.unwrap();
    ring.create(&mut conn).await.unwrap();
    enqueue(&mut conn, 25, "job").await;
    // Slot 0 holds jobs 1 to 9, slot 1 jobs 10 to 19, slot 2 (the current
    // one) 20 to 25. All of slot 0 is done but job 5.
    diesel::delete(jobs::table.filter(jobs::slot.eq(0)).filter(jobs::id.ne(5)))
        .execute(&mut conn)
        .await
        .unwrap();

    let rotation = ring.rotate(&mut conn).await.unwrap();
    assert_eq!(
        (
            rotation.truncated,
            rotation.moved,
            rotation.full,
            rotation.busy
        ),
        (1, 1, 1, false)
    );
    let moved: Job = jobs::table
        .filter(jobs::id.eq(5))
        .first(&mut conn)
        .await
        .unwrap();
    assert_eq!((moved.slot, moved.payload.as_str()), (2, "job"));
    assert_eq!(slots(&mut conn).await, vec![(1, 10), (2, 7)]);

    // Inside a transaction, refused before any SQL is sent.
    let refused = conn
        .transaction(async |conn: &mut AsyncPgConnection| Ok::<_, Error>(ring.rotate(conn).await))
        .await
        .unwrap();
    assert!(
        matches!(refused, Err(Error::InvalidArgument(ref why)) if why.contains("not inside one")),
        "{refused:?}"
    );
    let plain = Ring::new("plain");
    diesel::sql_query("CREATE TABLE plain (id BIGSERIAL PRIMARY KEY, slot SMALLINT NOT NULL)")
        .execute(&mut conn)
        .await
        .unwrap();
    let refused = plain.create(&mut conn).await;
    assert!(
        matches!(refused, Err(Error::InvalidArgument(ref why)) if why.contains("not a partitioned table")),
        "{refused:?}"
    );
}

/// Producers whose inserts commit a while after they were made, an async
/// worker on a pool deleting the jobs it runs, and an async rotation as
/// often as it can: every job is run exactly once, and slots were truncated
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_job_is_lost_to_a_rotation() {
    const PRODUCERS: usize = 3;
    const BATCHES: usize = 60;
    const BATCH: u32 = 7;
    let (db, mut conn) = queue().await;
    let ring = Ring::new("jobs").slots(4).slot_size(30).max_moved(3);
    ring.create(&mut conn).await.unwrap();
    let pool = bb8::Pool::builder()
        .max_size(5)
        .build(AsyncDieselConnectionManager::<AsyncPgConnection>::new(
            db.url.clone(),
        ))
        .await
        .unwrap();
    let run = Mutex::new(Vec::new());
    let stop = StopHandle::new();
    let [truncated, moved] = [(); 2].map(|()| AtomicU64::new(0));
    let all = PRODUCERS * BATCHES * BATCH as usize;

    let producers = futures_util::future::join_all((0..PRODUCERS).map(|_| async {
        let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
        for _ in 0..BATCHES {
            conn.transaction(async |conn: &mut AsyncPgConnection| {
                enqueue(conn, BATCH, "job").await;
                tokio::time::sleep(Duration::from_millis(15)).await;
                Ok::<_, diesel::result::Error>(())
            })
            .await
            .unwrap();
            // Slow enough for the worker to keep up, so that slots drain
            // while jobs are still enqueued.
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }));
    let rotations = async {
        while !stop.is_stopped() {
            let rotation = ring.rotate(&mut conn).await.unwrap();
            truncated.fetch_add(u64::from(rotation.truncated), Ordering::Relaxed);
            moved.fetch_add(rotation.moved, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    let worker = jobs::table
        .select(Job::as_select())
        .build_claim()
        .then_delete()
        .worker(&stop)
        .concurrency(4)
        .poll_interval(Duration::from_millis(5), Duration::from_millis(20))
        .run_pooled(&pool, async |_: &mut AsyncPgConnection, job: Job| {
            run.lock().unwrap().push(job.id);
            Ok::<_, Error>(())
        });
    let until_all_ran = async {
        producers.await;
        let deadline = Instant::now() + Duration::from_secs(60);
        while run.lock().unwrap().len() < all && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The last rotations, then the stop.
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.stop();
    };
    let ((), (), report) = tokio::join!(until_all_ran, rotations, worker);
    report.unwrap();

    let run = run.into_inner().unwrap();
    let distinct: HashSet<i64> = run.iter().copied().collect();
    assert_eq!(distinct.len(), run.len(), "a job ran twice");
    assert_eq!(run.len(), all, "jobs were lost: {} of {all} ran", run.len());
    assert_eq!(distinct, (1..=all as i64).collect());
    let truncated = truncated.into_inner();
    println!(
        "{all} jobs, {truncated} slots truncated, {} jobs moved",
        moved.into_inner()
    );
    assert!(truncated >= 5, "only {truncated} slots were truncated");
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    count: i64,
}

/// A rotation waiting for a slot that a worker's transaction reads is
/// busy once its lock timeout passes; dropped while it waits (a task's
/// timeout, a shutdown), it leaves no lock on the queue behind, though its
/// connection is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotation_dropped_while_it_waits_leaves_the_queue_unlocked() {
    let (db, mut conn) = queue().await;
    let ring = Ring::new("jobs")
        .slots(3)
        .slot_size(5)
        .lock_timeout(Duration::from_millis(50));
    ring.create(&mut conn).await.unwrap();
    enqueue(&mut conn, 6, "job").await;
    diesel::delete(jobs::table.filter(jobs::id.ne(2)))
        .execute(&mut conn)
        .await
        .unwrap();
    // Job 2, in slot 0, locked by a worker still running it.
    let mut worker = PgConnection::establish(&db.url).unwrap();
    worker
        .batch_execute("BEGIN; SELECT * FROM jobs WHERE id = 2 FOR UPDATE")
        .unwrap();
    let rotation = ring.rotate(&mut conn).await.unwrap();
    assert!(rotation.busy && rotation.truncated == 0, "{rotation:?}");

    // Waiting up to 10 s, dropped after 200 ms; the worker's job ends soon
    // after, and the rotation's `LOCK TABLE` is granted on the server.
    let patient = ring.clone().lock_timeout(Duration::from_secs(10));
    let dropped = tokio::time::timeout(Duration::from_millis(200), patient.rotate(&mut conn)).await;
    assert!(dropped.is_err(), "the rotation did not wait: {dropped:?}");
    worker.batch_execute("COMMIT").unwrap();

    let mut other = PgConnection::establish(&db.url).unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let locked = diesel::sql_query(
            "SELECT count(*) AS count FROM pg_locks \
             WHERE relation = 'jobs_slot_0'::regclass AND mode = 'AccessExclusiveLock'",
        );
        let locked = diesel::RunQueryDsl::get_result::<Count>(locked, &mut other)
            .unwrap()
            .count;
        if locked == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dropped rotation still holds the slot's partition"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The queue is read and written as before, and job 2 is still there.
    other
        .batch_execute("INSERT INTO jobs (payload) VALUES ('after')")
        .unwrap();
    let left: Vec<i64> =
        diesel::RunQueryDsl::load(jobs::table.select(jobs::id).order(jobs::id), &mut other)
            .unwrap();
    assert_eq!(left, vec![2, 7]);
    drop(conn);
}
