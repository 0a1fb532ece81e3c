//! The queue: its table, a job as the worker loads it, enqueueing, and what
//! a job does (it sends an email, through a stand-in for a mail server).

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

/// The queue's table, and the table its jobs write to.
pub const SCHEMA: &str = "
    CREATE TABLE jobs (
        id BIGSERIAL PRIMARY KEY,
        -- Higher first; among equals, the key: the order of arrival.
        priority INTEGER NOT NULL DEFAULT 0,
        -- What to do: here, the address an email goes to.
        payload TEXT NOT NULL,
        -- The retry schedule, written by the crate under the job's lock:
        -- failures so far, when the job may run next, and why it failed last.
        attempts INTEGER NOT NULL DEFAULT 0,
        run_at TIMESTAMPTZ NOT NULL DEFAULT now(),
        last_error TEXT
    );
    -- The queue's order: every take reads it from its head.
    CREATE INDEX jobs_queue ON jobs (priority DESC, id);

    -- The emails sent, each written in its job's transaction. No UNIQUE
    -- (job_id): the checks count duplicates, which a constraint would hide.
    CREATE TABLE sent (
        id BIGSERIAL PRIMARY KEY,
        job_id BIGINT NOT NULL,
        attempt INTEGER NOT NULL,
        previous_error TEXT
    );
";

diesel::table! {
    jobs (id) {
        id -> BigInt,
        priority -> Integer,
        payload -> Text,
        attempts -> Integer,
        run_at -> Timestamptz,
        last_error -> Nullable<Text>,
    }
}

diesel::table! {
    sent (id) {
        id -> BigInt,
        job_id -> BigInt,
        attempt -> Integer,
        previous_error -> Nullable<Text>,
    }
}

diesel::allow_tables_to_appear_in_same_query!(jobs, sent);

/// The channel the producers notify and the worker listens on. Channels
/// are the database's, not a schema's: services that share a database
/// and name the same channel wake each other (for nothing, as the woken
/// worker's take finds no job of its own).
pub const CHANNEL: &str = "jobs";

/// The addresses the mail server refuses: every attempt fails, and the job
/// ends a dead letter.
pub const UNDELIVERABLE: &str = "@mail.invalid";

/// The address the mail server hangs on the first time: the job's timeout
/// ends that attempt, and the retry goes through.
pub const HANGS_ONCE: &str = "hangs-once@example.com";

/// A job, as the worker hands it over: locked, in its transaction.
#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = jobs)]
pub struct Job {
    pub id: i64,
    pub payload: String,
    pub attempts: i32,
    pub run_at: DateTime<Utc>,
    pub last_error: Option<String>,
}

#[derive(Debug, Clone, Insertable)]
#[diesel(table_name = jobs)]
pub struct NewJob {
    pub priority: i32,
    pub payload: String,
}

impl NewJob {
    /// An email to `to`, at the usual priority.
    pub fn email(to: impl Into<String>) -> NewJob {
        NewJob {
            priority: 0,
            payload: to.into(),
        }
    }

    /// The same job, ahead of every job at the usual priority.
    pub fn urgent(self) -> NewJob {
        NewJob {
            priority: 10,
            ..self
        }
    }
}

/// Enqueues `new_jobs` in one transaction, which notifies the worker as it
/// commits: a waiting worker wakes at once rather than at its next poll, and
/// finds them. Their ids, in order.
pub async fn enqueue(
    conn: &mut AsyncPgConnection,
    new_jobs: &[NewJob],
) -> Result<Vec<i64>, diesel_claim::Error> {
    conn.transaction(async |conn| {
        let mut ids = Vec::with_capacity(new_jobs.len());
        // Two binds a job: PostgreSQL takes up to 65,535 in a statement.
        for chunk in new_jobs.chunks(1000) {
            let inserted: Vec<i64> = diesel::insert_into(jobs::table)
                .values(chunk)
                .returning(jobs::id)
                .get_results(conn)
                .await?;
            ids.extend(inserted);
        }
        diesel_claim::aio::notify(conn, CHANNEL).await?;
        Ok(ids)
    })
    .await
}

/// Why a job failed. The worker writes its text in the job's `last_error`.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("the mail server refused {address}")]
    Refused { address: String },

    #[error(transparent)]
    Database(#[from] diesel_claim::Error),
}

/// For `?` on Diesel's calls; through the crate's error, which tells
/// deadlocks and lost connections apart.
impl From<diesel::result::Error> for JobError {
    fn from(error: diesel::result::Error) -> Self {
        JobError::Database(error.into())
    }
}

/// Runs a job: sends its email. The worker calls it in the job's
/// transaction, with the job locked; the job's row is deleted in the same
/// transaction once this returns `Ok`, and on an error everything written
/// here is rolled back to a savepoint, and the failure recorded in the row.
pub async fn send_email(
    conn: &mut AsyncPgConnection,
    job: Job,
    runs: &Runs,
) -> Result<(), JobError> {
    // How long the job waited once it was due, for the exporter.
    diesel_claim::metrics::record_pickup("jobs", SystemTime::from(job.run_at));
    let started = Instant::now();
    // Written first, so that the email and its record go together: the
    // record commits with the job's deletion, or rolls back with a failure.
    diesel::insert_into(sent::table)
        .values((
            sent::job_id.eq(job.id),
            sent::attempt.eq(job.attempts + 1),
            sent::previous_error.eq(&job.last_error),
        ))
        .execute(conn)
        .await?;
    let delivered = mail_server(&job).await;
    runs.record(job.id, started);
    delivered
}

/// A stand-in for the mail server: 2 ms an email; it refuses the addresses
/// of [`UNDELIVERABLE`], and hangs the first time it is sent to
/// [`HANGS_ONCE`].
async fn mail_server(job: &Job) -> Result<(), JobError> {
    if job.payload.ends_with(UNDELIVERABLE) {
        return Err(JobError::Refused {
            address: job.payload.clone(),
        });
    }
    if job.payload == HANGS_ONCE && job.attempts == 0 {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    tokio::time::sleep(Duration::from_millis(2)).await;
    Ok(())
}

/// The runs of jobs that ended on their own (not those a timeout ended),
/// on this process's clock: for the checks, which read how often a job
/// failed from its row, and when from here. A service has no need of it.
#[derive(Debug, Default)]
pub struct Runs(Mutex<Vec<Run>>);

/// One run of a job.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub job: i64,
    pub started: Instant,
    pub ended: Instant,
}

impl Runs {
    fn record(&self, job: i64, started: Instant) {
        let run = Run {
            job,
            started,
            ended: Instant::now(),
        };
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(run);
    }

    /// The runs of `job`, in the order they started.
    pub fn of(&self, job: i64) -> Vec<Run> {
        let runs = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut of_job: Vec<Run> = runs.iter().filter(|run| run.job == job).copied().collect();
        of_job.sort_by_key(|run| run.started);
        of_job
    }
}
