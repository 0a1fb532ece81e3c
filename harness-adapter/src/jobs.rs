//! The queue: its table and migrations, enqueueing, its depth, and the
//! worker that runs its jobs, all on the crate's public API.

use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::PgConnection;
use diesel_claim::prelude::*;
use diesel_claim::ring::Ring;
use diesel_claim::{ClaimReport, StopHandle};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

use crate::samples::Stats;
use crate::settings::Settings;

diesel::table! {
    diesel_claim_jobs (id, slot) {
        id -> BigInt,
        slot -> SmallInt,
        enqueued_at_us -> BigInt,
        payload -> Text,
    }
}

/// The adapter's schema, run at start.
const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

/// The name of the newest migration, reported as the schema's version.
pub const SCHEMA_VERSION: &str = "2026-12-07-000000_jobs";

/// The channel the producer notifies in each enqueueing transaction, and the
/// worker listens on.
const CHANNEL: &str = "diesel_claim_jobs";

/// A job as a worker loads it.
#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = diesel_claim_jobs, primary_key(id, slot))]
pub struct Job {
    pub id: i64,
    pub slot: i16,
    pub enqueued_at_us: i64,
    pub payload: String,
}

#[derive(Insertable)]
#[diesel(table_name = diesel_claim_jobs)]
// What `COPY` asks of the rows it writes: every column a value.
#[diesel(treat_none_as_default_value = false)]
struct NewJob<'a> {
    enqueued_at_us: i64,
    payload: &'a str,
}

/// Connects to `url`, trying again for up to `patience` while the server
/// does not answer yet.
pub fn connect(url: &str, patience: Duration) -> Result<PgConnection, String> {
    let deadline = Instant::now() + patience;
    loop {
        match PgConnection::establish(url) {
            Ok(conn) => return Ok(conn),
            Err(error) if Instant::now() < deadline => {
                eprintln!("[diesel-claim] waiting for the database: {error}");
                thread::sleep(Duration::from_millis(500));
            }
            Err(error) => return Err(format!("cannot connect to the database: {error}")),
        }
    }
}

/// Runs the pending migrations, one replica at a time.
pub fn migrate(conn: &mut PgConnection) -> Result<(), String> {
    conn.transaction(|conn| {
        // Replicas of one run start together: the first migrates, the
        // others wait for it and find nothing pending.
        diesel::sql_query("SELECT pg_advisory_xact_lock(hashtext('diesel_claim_jobs'))")
            .execute(conn)?;
        conn.run_pending_migrations(MIGRATIONS)
            .map(drop)
            .map_err(diesel::result::Error::QueryBuilderError)?;
        ring().create(conn)
    })
    .map_err(|error: diesel_claim::Error| format!("cannot migrate: {error}"))
}

/// The queue's ring: 8 slots of 2,000 jobs, the crate's default, which hold
/// the depth target's 4,000 jobs in two or three slots.
pub fn ring() -> Ring {
    Ring::new("diesel_claim_jobs").slots(RING_SLOTS)
}

/// The tables the harness samples: the ring's partitions (the table itself
/// holds no rows of its own).
pub fn partitions() -> Vec<String> {
    (0..RING_SLOTS)
        .map(|slot| format!("public.diesel_claim_jobs_slot_{slot}"))
        .collect()
}

/// The number of slots of [`ring`].
const RING_SLOTS: u16 = 8;

/// Truncates the ring's drained slots until `stop`, twice a second (each
/// rotation holds the takes back while the transactions in flight end; a
/// slot of 2,000 jobs fills in a fifth of a second at the full queue's
/// rate), on a connection of its own, connecting again after a failure.
pub fn rotate(url: &str, stop: &StopHandle) {
    let ring = ring();
    let mut conn = None;
    while !stop.is_stopped() {
        if conn.is_none() {
            conn = PgConnection::establish(url).ok();
        }
        if let Some(connected) = conn.as_mut() {
            if let Err(error) = ring.rotate(connected) {
                eprintln!("[diesel-claim] the ring's rotation failed: {error}");
                conn = None;
            }
        }
        thread::sleep(Duration::from_millis(500));
    }
}

/// The workers' pool: a connection per claim loop and one for the listener.
/// r2d2's test query on every checkout is off, as the worker finds dead
/// connections itself. A short connection timeout, as the guide asks of a
/// worker's pool: r2d2 retries a failed connection after a pause growing to
/// half of it, which after a server restart is time the workers wait.
pub fn pool(url: &str, workers: usize) -> Result<Pool<ConnectionManager<PgConnection>>, String> {
    let size = u32::try_from(workers + 1).map_err(|_| "too many workers".to_owned())?;
    Pool::builder()
        .max_size(size)
        .test_on_check_out(false)
        .connection_timeout(Duration::from_secs(2))
        .build(ConnectionManager::new(url))
        .map_err(|error| format!("cannot open the workers' pool: {error}"))
}

/// Now, in microseconds since the Unix epoch.
pub fn now_us() -> i64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX)
}

/// Enqueues `count` jobs in `COPY … FROM STDIN`s (PostgreSQL's bulk insert)
/// of up to `batch_max` rows each, and notifies the workers, in one
/// transaction.
pub fn enqueue(
    conn: &mut PgConnection,
    count: usize,
    batch_max: usize,
    payload: &str,
) -> Result<(), diesel_claim::Error> {
    let enqueued_at_us = now_us();
    let rows: Vec<_> = (0..count)
        .map(|_| NewJob {
            enqueued_at_us,
            payload,
        })
        .collect();
    conn.transaction(|conn| {
        for batch in rows.chunks(batch_max.max(1)) {
            diesel::copy_from(diesel_claim_jobs::table)
                .from_insertable(batch)
                .execute(conn)?;
        }
        diesel_claim::notify(conn, CHANNEL)
    })
}

/// The jobs not yet done: waiting, and those running in a worker's
/// transaction (at most a claim batch per loop).
pub fn depth(conn: &mut PgConnection) -> QueryResult<i64> {
    diesel_claim_jobs::table.count().get_result(conn)
}

/// Runs the queue's jobs until `stop`: `settings.workers` claim loops on
/// `pool`, each taking up to `settings.claim_batch` jobs from the head of the
/// queue in one transaction, running them one by one and deleting them when
/// they are done, then committing. The loops listen for the producer's
/// notifications, and poll as the crate's default says when none come.
pub fn work(
    pool: &Pool<ConnectionManager<PgConnection>>,
    settings: &Settings,
    stop: &StopHandle,
    stats: &Stats,
) -> Result<ClaimReport, diesel_claim::Error> {
    let work = settings.work;
    diesel_claim_jobs::table
        .select(Job::as_select())
        .build_claim()
        .batch(settings.claim_batch)
        .then_delete()
        .worker(stop)
        .listen(CHANNEL)
        .concurrency(settings.workers)
        .run_pooled(pool, move |_: &mut PgConnection, job: Job| {
            stats.picked_up(now_us().saturating_sub(job.enqueued_at_us));
            // The job's work: the harness's synthetic `JOB_WORK_MS`.
            std::hint::black_box(&job.payload);
            if !work.is_zero() {
                thread::sleep(work);
            }
            // Counted done once its batch commits (`Stats::count_completions`).
            Ok::<_, diesel_claim::Error>(())
        })
}
