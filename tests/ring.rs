//! A queue kept as a ring of partitions (PostgreSQL): drained slots are
//! truncated, their last jobs moved on, and no job is lost to a truncation
//! however the inserts, the takes and the rotations interleave.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel_claim::prelude::*;
use diesel_claim::ring::Ring;
use diesel_claim::{Error, StopHandle};

diesel::table! {
    /// The queue of these tests and of the async ones.
    jobs (id, slot) {
        id -> BigInt,
        slot -> SmallInt,
        payload -> Text,
    }
}

#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(primary_key(id, slot))]
pub(crate) struct Job {
    pub(crate) id: i64,
    pub(crate) slot: i16,
    pub(crate) payload: String,
}

/// The queue of these tests, partitioned as a ring needs.
pub(crate) const QUEUE: &str = "CREATE TABLE jobs (id BIGSERIAL, slot SMALLINT NOT NULL, \
                     payload TEXT NOT NULL, PRIMARY KEY (id, slot)) PARTITION BY LIST (slot)";

fn queue() -> (testkit::PgTestDb, PgConnection) {
    let db = testkit::PgTestDb::new();
    let mut conn = PgConnection::establish(&db.url).unwrap();
    conn.batch_execute(QUEUE).unwrap();
    (db, conn)
}

fn enqueue(conn: &mut PgConnection, count: u32, payload: &str) {
    diesel::sql_query("INSERT INTO jobs (payload) SELECT $1 FROM generate_series(1, $2::bigint)")
        .bind::<Text, _>(payload)
        .bind::<BigInt, _>(i64::from(count))
        .execute(conn)
        .unwrap();
}

fn slots(conn: &mut PgConnection) -> Vec<(i16, i64)> {
    jobs::table
        .group_by(jobs::slot)
        .select((jobs::slot, diesel::dsl::count_star()))
        .order(jobs::slot)
        .load(conn)
        .unwrap()
}

#[derive(QueryableByName)]
struct Bytes {
    #[diesel(sql_type = BigInt)]
    bytes: i64,
}

/// The bytes the ring's partitions and their indexes take on disk.
fn ring_bytes(conn: &mut PgConnection) -> i64 {
    diesel::sql_query(
        "SELECT coalesce(sum(pg_total_relation_size(inhrelid)), 0)::int8 AS bytes \
         FROM pg_inherits WHERE inhparent = 'jobs'::regclass",
    )
    .get_result::<Bytes>(conn)
    .unwrap()
    .bytes
}

/// What the rotations of a test did, added up.
#[derive(Default)]
struct Rotated {
    truncated: AtomicU64,
    moved: AtomicU64,
    full: AtomicU64,
    busy: AtomicU64,
}

/// Rotates `ring` on a connection of its own every 2 ms until `stop`,
/// adding up what it did in `rotated`.
fn keep_rotating(ring: &Ring, url: &str, stop: &StopHandle, rotated: &Rotated) {
    let mut conn = PgConnection::establish(url).unwrap();
    while !stop.is_stopped() {
        let rotation = ring.rotate(&mut conn).unwrap();
        let add = |total: &AtomicU64, count: u64| total.fetch_add(count, Ordering::Relaxed);
        add(&rotated.truncated, u64::from(rotation.truncated));
        add(&rotated.moved, rotation.moved);
        add(&rotated.full, u64::from(rotation.full));
        add(&rotated.busy, u64::from(rotation.busy));
        thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn create_adds_a_partition_per_slot_and_does_nothing_the_second_time() {
    let (_db, mut conn) = queue();
    let ring = Ring::new("jobs").slots(4).slot_size(3);
    ring.create(&mut conn).unwrap();
    enqueue(&mut conn, 5, "first");
    ring.create(&mut conn).unwrap();
    enqueue(&mut conn, 5, "second");
    // Jobs 1 and 2 in slot 0, then three a slot, in order of insertion.
    assert_eq!(slots(&mut conn), vec![(0, 2), (1, 3), (2, 3), (3, 2)]);
    let partitions: i64 = diesel::select(diesel::dsl::sql::<BigInt>(
        "(SELECT count(*) FROM pg_inherits WHERE inhparent = 'jobs'::regclass)",
    ))
    .get_result(&mut conn)
    .unwrap();
    assert_eq!(partitions, 4);
}

/// Replicas of a service that start together each create the ring: they
/// take turns, and all of them find it made. Creating it at once without
/// turns fails in some of them (`CREATE … IF NOT EXISTS` is not safe
/// against another session creating the same name).
#[test]
fn replicas_creating_one_ring_at_once_take_turns() {
    let (db, _conn) = queue();
    let start = std::sync::Barrier::new(6);
    thread::scope(|scope| {
        for _ in 0..6 {
            scope.spawn(|| {
                let mut conn = PgConnection::establish(&db.url).unwrap();
                start.wait();
                Ring::new("jobs").slots(16).create(&mut conn).unwrap();
            });
        }
    });
    let mut conn = PgConnection::establish(&db.url).unwrap();
    let partitions: i64 = diesel::select(diesel::dsl::sql::<BigInt>(
        "(SELECT count(*) FROM pg_inherits WHERE inhparent = 'jobs'::regclass)",
    ))
    .get_result(&mut conn)
    .unwrap();
    assert_eq!(partitions, 16);
}

#[test]
fn tables_and_settings_a_ring_cannot_use_are_refused() {
    let (_db, mut conn) = queue();
    conn.batch_execute(
        "CREATE TABLE plain (id BIGSERIAL PRIMARY KEY, slot SMALLINT NOT NULL);
         CREATE TABLE ranged (id BIGINT NOT NULL, slot SMALLINT NOT NULL) PARTITION BY RANGE (slot);
         CREATE TABLE by_id (id BIGINT NOT NULL, slot SMALLINT NOT NULL) PARTITION BY LIST (id);
         CREATE TABLE shared (id BIGINT NOT NULL, slot SMALLINT NOT NULL) PARTITION BY LIST (slot);
         CREATE TABLE shared_archive PARTITION OF shared FOR VALUES IN (100);",
    )
    .unwrap();
    let refused = |ring: Ring, conn: &mut PgConnection, says: &str| match ring.create(conn) {
        Err(Error::InvalidArgument(message)) => {
            assert!(message.contains(says), "{message:?} does not say {says:?}")
        }
        other => panic!("{ring:?} was not refused: {other:?}"),
    };
    refused(
        Ring::new("plain"),
        &mut conn,
        "plain is not a partitioned table",
    );
    refused(
        Ring::new("missing"),
        &mut conn,
        "missing is not a partitioned table",
    );
    refused(
        Ring::new("ranged"),
        &mut conn,
        "partitioned by RANGE (slot)",
    );
    refused(Ring::new("by_id"), &mut conn, "partitioned by LIST (id)");
    refused(Ring::new("shared"), &mut conn, "shared_archive");
    refused(Ring::new("jobs").slots(2), &mut conn, "at least 3 slots");
    refused(
        Ring::new("jobs").slot_size(0),
        &mut conn,
        "at least one job",
    );
    refused(Ring::new(&"j".repeat(60)), &mut conn, "at most 63 bytes");

    // A ring of 8 slots, then one of 4 on the same table.
    Ring::new("jobs").create(&mut conn).unwrap();
    refused(Ring::new("jobs").slots(4), &mut conn, "jobs_slot_4");

    let rotated_inside = conn.transaction(|conn| Ring::new("jobs").rotate(conn));
    assert!(
        matches!(rotated_inside, Err(Error::InvalidArgument(ref m)) if m.contains("not inside one")),
        "{rotated_inside:?}"
    );
    // Nothing of the refused rings was created.
    let sequences: i64 = diesel::select(diesel::dsl::sql::<BigInt>(
        "(SELECT count(*) FROM pg_class WHERE relkind = 'S' AND relname LIKE '%slot_seq')",
    ))
    .get_result(&mut conn)
    .unwrap();
    assert_eq!(sequences, 1);
}

#[test]
fn a_hostile_table_name_is_a_name() {
    let (_db, mut conn) = queue();
    let name = "we\"ird'; DROP TABLE jobs; --";
    conn.batch_execute(&format!(
        "CREATE TABLE \"{}\" (id BIGSERIAL, slot SMALLINT NOT NULL, payload TEXT NOT NULL) \
         PARTITION BY LIST (slot)",
        name.replace('"', "\"\"")
    ))
    .unwrap();
    let ring = Ring::new(name).slots(3).slot_size(2);
    ring.create(&mut conn).unwrap();
    conn.batch_execute(&format!(
        "INSERT INTO \"{}\" (payload) SELECT 'x' FROM generate_series(1, 3);
         DELETE FROM \"{0}\" WHERE id = 1;",
        name.replace('"', "\"\"")
    ))
    .unwrap();
    let rotation = ring.rotate(&mut conn).unwrap();
    assert_eq!(rotation.truncated, 1, "{rotation:?}");
    // The queue of the other tests is still there.
    assert_eq!(slots(&mut conn), vec![]);
}

#[test]
fn drained_slots_are_truncated_and_their_last_jobs_moved_on() {
    let (_db, mut conn) = queue();
    let ring = Ring::new("jobs").slots(4).slot_size(10).max_moved(2);
    ring.create(&mut conn).unwrap();
    enqueue(&mut conn, 25, "job");
    // Slot 0 holds jobs 1 to 9, slot 1 jobs 10 to 19, slot 2 (the current
    // one) 20 to 25. All of slot 0 is done but job 5, waiting for a retry.
    diesel::update(jobs::table.filter(jobs::id.eq(5)))
        .set(jobs::payload.eq("retry"))
        .execute(&mut conn)
        .unwrap();
    diesel::delete(jobs::table.filter(jobs::slot.eq(0)).filter(jobs::id.ne(5)))
        .execute(&mut conn)
        .unwrap();

    let rotation = ring.rotate(&mut conn).unwrap();
    assert_eq!(
        (rotation.truncated, rotation.moved, rotation.full),
        (1, 1, 1)
    );
    assert!(!rotation.busy);
    let moved: Job = jobs::table.filter(jobs::id.eq(5)).first(&mut conn).unwrap();
    assert_eq!((moved.slot, moved.payload.as_str()), (2, "retry"));
    assert_eq!(slots(&mut conn), vec![(1, 10), (2, 7)]);
    let slot_0: i64 = diesel::select(diesel::dsl::sql::<BigInt>(
        "pg_relation_size('jobs_slot_0')",
    ))
    .get_result(&mut conn)
    .unwrap();
    assert_eq!(slot_0, 0, "slot 0 was not truncated");

    // With nothing left to reclaim, the next rotation locks nothing.
    let again = ring.rotate(&mut conn).unwrap();
    assert_eq!((again.truncated, again.moved, again.full), (0, 0, 1));
}

#[test]
fn a_slot_another_transaction_reads_is_left_for_the_next_rotation() {
    let (db, mut conn) = queue();
    let ring = Ring::new("jobs")
        .slots(3)
        .slot_size(5)
        .lock_timeout(Duration::from_millis(50));
    ring.create(&mut conn).unwrap();
    enqueue(&mut conn, 6, "job");
    diesel::delete(jobs::table.filter(jobs::id.ne(2)))
        .execute(&mut conn)
        .unwrap();

    // A job of slot 0, locked by a worker still running it.
    let mut worker = PgConnection::establish(&db.url).unwrap();
    worker
        .batch_execute("BEGIN; SELECT * FROM jobs WHERE id = 2 FOR UPDATE")
        .unwrap();
    let started = Instant::now();
    let rotation = ring.rotate(&mut conn).unwrap();
    let waited = started.elapsed();
    assert!(rotation.busy && rotation.truncated == 0, "{rotation:?}");
    assert!(
        waited < Duration::from_secs(2),
        "the rotation waited {waited:?}"
    );

    worker.batch_execute("COMMIT").unwrap();
    let rotation = ring.rotate(&mut conn).unwrap();
    assert_eq!((rotation.truncated, rotation.moved), (1, 1), "{rotation:?}");
    assert_eq!(slots(&mut conn), vec![(1, 1)]);
}

/// Producers whose inserts commit a while after they were made, workers
/// deleting the jobs they run, and a rotation as often as it can: every job
/// enqueued is run exactly once, and slots were truncated meanwhile. A
/// rotation that counted a slot's jobs without having the slot to itself
/// would truncate the jobs of inserts committed after its count.
#[test]
fn no_job_is_lost_to_a_rotation() {
    const PRODUCERS: usize = 3;
    const BATCHES: usize = 60;
    const BATCH: u32 = 7;
    let (db, mut conn) = queue();
    let ring = Ring::new("jobs").slots(4).slot_size(30).max_moved(3);
    ring.create(&mut conn).unwrap();
    let pool = testkit::pg_pool(&db.url, 5);
    let run = Mutex::new(Vec::new());
    let stop = StopHandle::new();
    let rotated = Rotated::default();

    thread::scope(|scope| {
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|_| {
                scope.spawn(|| {
                    let mut conn = PgConnection::establish(&db.url).unwrap();
                    for _ in 0..BATCHES {
                        conn.transaction(|conn| {
                            enqueue(conn, BATCH, "job");
                            thread::sleep(Duration::from_millis(15));
                            Ok::<_, diesel::result::Error>(())
                        })
                        .unwrap();
                        // As fast as the workers take them, so that slots
                        // drain while jobs are still enqueued.
                        thread::sleep(Duration::from_millis(10));
                    }
                })
            })
            .collect();
        scope.spawn(|| keep_rotating(&ring, &db.url, &stop, &rotated));
        let worker = scope.spawn(|| {
            jobs::table
                .select(Job::as_select())
                .build_claim()
                .then_delete()
                .worker(&stop)
                .concurrency(4)
                .poll_interval(Duration::from_millis(5), Duration::from_millis(20))
                .run_pooled(&pool, |_: &mut PgConnection, job: Job| {
                    run.lock().unwrap().push(job.id);
                    Ok::<_, Error>(())
                })
                .unwrap()
        });
        for producer in producers {
            producer.join().unwrap();
        }
        let all = (PRODUCERS * BATCHES) as u32 * BATCH;
        let deadline = Instant::now() + Duration::from_secs(60);
        while run.lock().unwrap().len() < all as usize && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        // The last rotations, then the stop.
        thread::sleep(Duration::from_millis(100));
        stop.stop();
        worker.join().unwrap();
    });

    let all = PRODUCERS * BATCHES * BATCH as usize;
    let run = run.into_inner().unwrap();
    let distinct: HashSet<i64> = run.iter().copied().collect();
    assert_eq!(distinct.len(), run.len(), "a job ran twice");
    assert_eq!(run.len(), all, "jobs were lost: {} of {all} ran", run.len());
    assert_eq!(distinct, (1..=all as i64).collect());
    let truncated = rotated.truncated.into_inner();
    println!(
        "{all} jobs, {truncated} slots truncated, {} jobs moved; {} full slots passed over, \
         {} rotations busy",
        rotated.moved.into_inner(),
        rotated.full.into_inner(),
        rotated.busy.into_inner()
    );
    assert!(truncated >= 5, "only {truncated} slots were truncated");
}

/// A queue taken in order of priority leaves its low-priority jobs behind
/// in older slots while the high-priority ones keep coming: a slot is
/// truncated once those are down to `max_moved`, which move on to the
/// current slot, and every job still runs exactly once.
#[test]
fn a_queue_taken_by_priority_moves_its_waiting_jobs_on() {
    const BATCHES: usize = 40;
    let (db, mut conn) = queue();
    let ring = Ring::new("jobs").slots(4).slot_size(40).max_moved(10);
    ring.create(&mut conn).unwrap();
    let pool = testkit::pg_pool(&db.url, 3);
    let run = Mutex::new(Vec::new());
    let stop = StopHandle::new();
    let rotated = Rotated::default();

    thread::scope(|scope| {
        let producer = scope.spawn(|| {
            let mut conn = PgConnection::establish(&db.url).unwrap();
            for _ in 0..BATCHES {
                // Nine urgent jobs ("a…") for one that can wait ("z…").
                enqueue(&mut conn, 9, "a urgent");
                enqueue(&mut conn, 1, "z can wait");
                thread::sleep(Duration::from_millis(15));
            }
        });
        scope.spawn(|| keep_rotating(&ring, &db.url, &stop, &rotated));
        let worker = scope.spawn(|| {
            jobs::table
                .select(Job::as_select())
                .order((jobs::payload, jobs::id))
                .build_claim()
                .then_delete()
                .worker(&stop)
                .concurrency(2)
                .poll_interval(Duration::from_millis(5), Duration::from_millis(20))
                .run_pooled(&pool, |_: &mut PgConnection, job: Job| {
                    // Slow enough that the jobs that can wait do.
                    thread::sleep(Duration::from_micros(500));
                    run.lock().unwrap().push(job.id);
                    Ok::<_, Error>(())
                })
                .unwrap()
        });
        producer.join().unwrap();
        let all = BATCHES * 10;
        let deadline = Instant::now() + Duration::from_secs(60);
        while run.lock().unwrap().len() < all && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        thread::sleep(Duration::from_millis(100));
        stop.stop();
        worker.join().unwrap();
    });

    let all = BATCHES * 10;
    let run = run.into_inner().unwrap();
    let distinct: HashSet<i64> = run.iter().copied().collect();
    assert_eq!(distinct.len(), run.len(), "a job ran twice");
    assert_eq!(distinct, (1..=all as i64).collect(), "jobs were lost");
    let (truncated, moved) = (rotated.truncated.into_inner(), rotated.moved.into_inner());
    println!("{all} jobs, {truncated} slots truncated, {moved} jobs moved");
    assert!(truncated >= 3, "only {truncated} slots were truncated");
    assert!(moved > 0, "no job that could wait was moved on");
}

/// While a transaction holds vacuum back, 200,000 jobs enqueued and done
/// leave the ring's partitions as small as a few slots of jobs: a table of
/// one partition keeps every done job's row and index entry until the
/// transaction ends (some 20 MB here).
#[test]
fn jobs_done_while_vacuum_is_held_back_leave_no_bloat() {
    const ROUNDS: u32 = 100;
    const JOBS: u32 = 2_000;
    let (db, mut conn) = queue();
    let ring = Ring::new("jobs").slots(4).slot_size(JOBS);
    ring.create(&mut conn).unwrap();
    let mut holder = PgConnection::establish(&db.url).unwrap();
    holder
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT txid_current()")
        .unwrap();

    let mut peak = 0;
    let mut truncated = 0;
    for _ in 0..ROUNDS {
        enqueue(&mut conn, JOBS, "a job of some length, as a payload is");
        diesel::delete(jobs::table).execute(&mut conn).unwrap();
        // At its largest just before the rotation, and just after it.
        peak = peak.max(ring_bytes(&mut conn));
        truncated += ring.rotate(&mut conn).unwrap().truncated;
        peak = peak.max(ring_bytes(&mut conn));
    }
    // The last jobs through the crate's worker.
    enqueue(&mut conn, 500, "job");
    let report = jobs::table
        .select(Job::as_select())
        .build_claim()
        .then_delete()
        .each(&mut conn, |_, _: Job| Ok::<_, Error>(()))
        .unwrap();
    assert_eq!(report.processed, 500);

    // A slot of 2,000 jobs is about 250 kB with its index: the current
    // slot, the one before it, and the slack of a page or two each.
    let one_slot_bytes = {
        let mut probe = PgConnection::establish(&db.url).unwrap();
        probe.batch_execute(
            "CREATE TABLE probe (id BIGSERIAL, slot SMALLINT NOT NULL, payload TEXT NOT NULL, PRIMARY KEY (id, slot));
             INSERT INTO probe (slot, payload) SELECT 0, 'a job of some length, as a payload is' FROM generate_series(1, 2000);",
        )
        .unwrap();
        diesel::sql_query("SELECT pg_total_relation_size('probe')::int8 AS bytes")
            .get_result::<Bytes>(&mut probe)
            .unwrap()
            .bytes
    };
    println!(
        "{} jobs done: {truncated} slots truncated, the ring at most {peak} bytes \
         (a slot of jobs {one_slot_bytes})",
        ROUNDS * JOBS + 500
    );
    assert!(
        truncated >= ROUNDS - 1,
        "only {truncated} slots were truncated"
    );
    assert!(
        peak <= 4 * one_slot_bytes,
        "the ring grew to {peak} bytes, {} slots of jobs",
        peak / one_slot_bytes
    );
    holder.batch_execute("ROLLBACK").unwrap();
}
