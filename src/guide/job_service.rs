//! A job service, end to end: a queue in a PostgreSQL table, producers,
//! an async worker on a pool woken by `LISTEN`, retries kept in the rows, a
//! job timeout, a graceful stop on SIGTERM and Ctrl-C, log lines and
//! metrics for an operator. It is the repository's
//! [`examples/jobs`](https://github.com/diesel-claim/diesel-claim/tree/main/examples/jobs)
//! package, which CI runs against PostgreSQL; this page walks through it.
//! Copy its `queue.rs`, `service.rs` and `telemetry.rs`; its `demo.rs` and
//! `checks.rs` are the example's own scenario and checks.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run --release -p diesel-claim-jobs
//! ```
//!
//! # What it is built of
//!
//! The example is a package of its own, so that what only a service needs
//! is built for it alone. Nothing in it links a C database client library:
//!
//! - `diesel-claim` with `postgres_backend`, `bb8`, `tracing` and `metrics`,
//!   without `migrations`: a job queue needs none of the crate's own tables
//!   (they are the leases').
//! - `diesel` with `postgres_backend` (the backend, without `PgConnection`
//!   and libpq) and `chrono` (a job's run time, read for the pickup
//!   latency); `diesel-async` with `postgres` (its client, `tokio-postgres`,
//!   is written in Rust) and `bb8`.
//! - `tokio` with `signal`; `tracing-subscriber`; `metrics-exporter-prometheus`
//!   with `http-listener` alone (its default push gateway brings a TLS
//!   stack built from C sources).
//!
//! # The queue
//!
//! ```sql
//! CREATE TABLE jobs (
//!     id BIGSERIAL PRIMARY KEY,
//!     priority INTEGER NOT NULL DEFAULT 0,
//!     payload TEXT NOT NULL,
//!     attempts INTEGER NOT NULL DEFAULT 0,
//!     run_at TIMESTAMPTZ NOT NULL DEFAULT now(),
//!     last_error TEXT
//! );
//! CREATE INDEX jobs_queue ON jobs (priority DESC, id);
//! ```
//!
//! - **The order** is the query's, `ORDER BY priority DESC`, the key
//!   breaking ties: among equals, jobs run in the order they arrived. Each
//!   take of the worker reads it from its head through the index, so a job
//!   enqueued at a higher priority is the next one taken, however deep the
//!   queue (the example enqueues an urgent job behind some 1,800 others: it
//!   is sent after a handful of them, those the loops had in hand and took
//!   as it was committed).
//! - **The retry schedule** is three columns the crate writes:
//!   `attempts` (failures so far), `run_at` (when the job may run next; by
//!   default now, so a producer schedules a job for later by giving it a
//!   later `run_at`) and `last_error`. Every take leaves out the jobs not yet
//!   due, by the database's clock, and those out of attempts.
//! - **A job done is deleted**, in the transaction that ran it
//!   ([`then_delete`](crate::ClaimBuilder::then_delete)). Keep what a job
//!   did in a table of your own, written in the job: the example's `sent`.
//!   Deleting in the closure instead costs much on PostgreSQL (see the
//!   [job workers](super::workers#failures-recorded-under-the-lock) page).
//!
//! # Producers
//!
//! A producer inserts jobs and notifies the worker in one transaction,
//! with [`aio::notify`](crate::aio::notify) (or a trigger: see
//! [waiting for jobs](super::workers#waiting-for-jobs)). PostgreSQL delivers
//! the notification as the transaction commits, so the worker it wakes
//! finds the jobs; a job written without one is found at the worker's next
//! poll (every 10 ms while jobs come, up to every second while the queue is
//! empty). The example's producer enqueues 200 jobs one by one, each in its
//! own transaction.
//!
//! # The worker
//!
//! ```no_run
//! # #[cfg(all(feature = "bb8", feature = "postgres_backend"))]
//! # mod service {
//! use std::time::Duration;
//!
//! use diesel::prelude::*;
//! use diesel_async::pooled_connection::bb8::Pool;
//! use diesel_async::AsyncPgConnection;
//! use diesel_claim::aio::prelude::*;
//! use diesel_claim::{Retries, StopHandle};
//!
//! diesel::table! {
//!     jobs (id) {
//!         id -> BigInt,
//!         priority -> Integer,
//!         payload -> Text,
//!         attempts -> Integer,
//!         run_at -> Timestamptz,
//!         last_error -> Nullable<Text>,
//!     }
//! }
//!
//! #[derive(Clone, Queryable, Selectable, Identifiable)]
//! #[diesel(table_name = jobs)]
//! struct Job {
//!     id: i64,
//!     payload: String,
//!     attempts: i32,
//! }
//!
//! async fn serve(
//!     pool: &Pool<AsyncPgConnection>,
//!     stop: &StopHandle,
//! ) -> Result<ClaimReport, diesel_claim::Error> {
//!     let schedule = Retries::new(jobs::attempts, jobs::run_at)
//!         .last_error(jobs::last_error)
//!         .max_attempts(3)
//!         .backoff(Duration::from_millis(250), Duration::from_secs(60));
//!     jobs::table
//!         .order(jobs::priority.desc())
//!         .select(Job::as_select())
//!         .build_claim()
//!         .retries(schedule)
//!         .then_delete()
//!         .worker(stop)
//!         .listen("jobs")
//!         .concurrency(4)
//!         .timeout(Duration::from_secs(1))
//!         .run_pooled(pool, async |conn: &mut AsyncPgConnection, job: Job| {
//!             send_email(conn, job).await
//!         })
//!         .await
//! }
//! # async fn send_email(_: &mut AsyncPgConnection, _: Job) -> Result<(), diesel_claim::Error> {
//! #     Ok(())
//! # }
//! # }
//! ```
//!
//! - [`retries`](crate::ClaimBuilder::retries): a job that fails (returns
//!   an error, panics, or runs past its timeout) is rolled back to a
//!   savepoint, and its attempt, error and next run time are written in its
//!   row, still locked, in its transaction: no worker, in this process or
//!   another, takes it before its delay has passed. The delays double from
//!   the first up to the last, each lengthened at random by up to a tenth.
//!   The example's are short (250 ms, then 500 ms), so that its checks see
//!   the retries within a second; a service facing an outage waits longer
//!   (the crate's default is 1 s doubling up to an hour, 20 attempts). The
//!   row type must be `Clone`: a failure is recorded from the row as the
//!   job got it.
//! - [`worker`](crate::ClaimBuilder::worker) with
//!   [`listen`](crate::ClaimWorker::listen): the loop runs until its
//!   [`StopHandle`](crate::StopHandle) is stopped, woken by the producers'
//!   notifications on the channel. Channels belong to the database, not to
//!   a schema: two queues in one database should name two channels, or
//!   each wakes the other for nothing.
//! - [`concurrency`](crate::ClaimWorker::concurrency): four claim loops,
//!   each taking one job at a time on a connection of the pool, which it
//!   holds only while it runs a job. They share one listener.
//! - [`timeout`](crate::ClaimWorker::timeout): see [timeouts](#timeouts).
//! - [`run_pooled`](crate::ClaimWorker::run_pooled) runs the loops as
//!   futures of the one future it returns, taking turns on its task: right
//!   for jobs that await (a query, an HTTP call). A job that computes for
//!   long between its awaits, or blocks its thread, holds up the other
//!   loops; for those, `spawn_pooled` runs each loop on a task of its own
//!   (its claim and closure must be `'static`: capture `Arc`s, not
//!   references).
//!
//! ## The pool
//!
//! The example's pool is bb8's (diesel-async's feature `bb8`), with a
//! `connection_timeout` of 2 s and room for the loops and for the service's
//! other users (its producers); the listener's connection is made outside
//! the pool's count. bb8 retries a connection that failed after a pause of
//! up to half its `connection_timeout`, and a checkout waits that long:
//! with bb8's default of 30 s, every loop may wait for seconds after a
//! server restart, when the server is back (see
//! [server restarts](super::workers#server-restarts)). deadpool (feature
//! `deadpool`) serves as well, with nothing to set: it connects within the
//! checkout, and waits for nothing of its own.
//!
//! # A job
//!
//! The closure runs in the job's transaction, the job's row locked. What
//! it writes on its connection commits with the job's deletion, or, if it
//! fails, is rolled back to its savepoint: the example writes an email's
//! row in `sent` first, then calls the mail server, and a refused email
//! leaves no row. Its error type converts from [`Error`](crate::Error) and
//! from Diesel's (for `?`), and shows itself (`Display`): that text is the
//! job's `last_error`. The example's `JobError` says why the mail server
//! refused.
//!
//! **What happens outside the database is not rolled back.** An email sent
//! by a job whose transaction then fails to commit (its connection lost,
//! its timeout reached after the send) is sent again by the job's next run.
//! A job runs once per commit, not once: make its outside effects
//! idempotent where they can be (the job's id as the mail's idempotency
//! key).
//!
//! A job that wants its pickup latency measured reports it first thing,
//! from its own column: `diesel_claim::metrics::record_pickup("jobs",
//! job.run_at.into())`. The latency of a backlog is long, by design: the
//! example's 2,000 jobs queued before the service starts wait their turn.
//!
//! # Failures, retries and dead letters
//!
//! A job that used its last attempt is a **dead letter**: it stays in the
//! table, out of the queue, with its attempts and its last error, and the
//! worker logs an `error` event for it. Read them with `SELECT … WHERE
//! attempts >= 3`; send one back with `UPDATE jobs SET attempts = 0, run_at
//! = now() WHERE id = …`. They stay in the queue's index too, where every
//! take passes over them: a service that keeps many moves them to a table
//! of its own, or makes the index partial, `CREATE INDEX … (priority DESC,
//! id) WHERE attempts < 3` (the take writes the limit as a literal, so that
//! PostgreSQL can use it).
//!
//! # Timeouts
//!
//! A job that runs past [`timeout`](crate::ClaimWorker::timeout) is ended:
//! its future is dropped wherever it awaits, and on PostgreSQL its
//! statement in flight is ended by the server; its work is rolled back,
//! and the failure recorded under its lock, as
//! [`Error::TimedOut`](crate::Error::TimedOut), counted in the report's
//! [`timed_out`](crate::ClaimReport::timed_out), the metrics and a warning.
//! The retry schedule then says when it runs again. The example's mail
//! server hangs on one address the first time: the job's first run is
//! ended at 1 s, and its retry sends the email, its row reading "the
//! closure ran past its timeout of 1s".
//!
//! Choose the timeout well above a job's usual duration, and below what an
//! operator waits for a stop (see below). Without one, a job runs for as
//! long as it takes, holding its row's lock and its transaction open; and
//! an async worker's transactions have no idle bound then, so that a slow
//! job is not ended by the server under it (see
//! [long jobs](super::workers#long-jobs)). Work that takes minutes belongs
//! outside a transaction, with a
//! [visibility timeout](crate::ClaimBuilder::visibility_timeout).
//!
//! # Stopping
//!
//! ```no_run
//! # use diesel_claim::{ClaimReport, StopHandle};
//! # async fn serve(_: &StopHandle) -> Result<ClaimReport, diesel_claim::Error> { Ok(ClaimReport::default()) }
//! # async fn next_signal() -> &'static str { "SIGTERM" }
//! use std::pin::pin;
//!
//! async fn run_until_signalled() -> Result<ClaimReport, diesel_claim::Error> {
//!     let stop = StopHandle::new();
//!     let mut worker = pin!(serve(&stop));
//!     tokio::select! {
//!         // It ends on its own only on an error no other connection can mend.
//!         ended = &mut worker => return ended,
//!         signal = next_signal() => {
//!             eprintln!("{signal}: stopping, the jobs in hand finish first");
//!             stop.stop();
//!         }
//!     }
//!     worker.await
//! }
//! ```
//!
//! The service takes SIGTERM (what systemd, Docker and Kubernetes send) and
//! SIGINT (Ctrl-C) over with `tokio::signal::unix::signal` as it starts,
//! before anything can send them: from then on they no longer end the
//! process, and `next_signal` above waits for either. On either, it stops
//! the worker and goes on awaiting it: each loop finishes the job in hand,
//! commits, and the worker returns its report. Jobs still queued stay
//! queued for the next start, and none is half done: a job is either
//! deleted with its effects or left as it was. The example sends itself
//! SIGTERM half-way through its backlog: the worker returned within
//! milliseconds, every email sent was counted in its report, and the
//! restarted service sent the rest, each once.
//!
//! A stop lasts as long as the longest job in hand, at most the timeout:
//! give the orchestrator's grace period (Kubernetes'
//! `terminationGracePeriodSeconds`, 30 s by default) more than that. A
//! process killed outright (SIGKILL, a crash) loses no job either: the
//! server rolls its transactions back when its connections close, and
//! their jobs run again.
//!
//! # Log lines
//!
//! With the crate's `tracing` feature, the worker's start, progress and
//! stop are `info` events, each failed job a warning with its error, each
//! dead letter an `error` (see [tracing](super::tracing)).
//! `tracing-subscriber` writes them, as `RUST_LOG` chooses; the example
//! writes them to stderr, its report to stdout, and without `RUST_LOG`
//! logs `warn,diesel_claim::worker=info,jobs=info`. A loop writes its
//! failed jobs' warnings as its run ends (when a take finds nothing to do,
//! or after 10,000 jobs), so that under a steady stream of jobs they come
//! late, after the dead-letter errors of the same jobs: read a failure's
//! time from its row (`run_at` less its delay), not from its log line.
//!
//! # Metrics
//!
//! With the crate's `metrics` feature, its counters and histograms go to
//! whichever recorder the process installs: here
//! `metrics-exporter-prometheus`'s, which
//! `PrometheusBuilder::new().with_http_listener(addr).install()`, called
//! inside the tokio runtime, installs and serves on `addr` for Prometheus
//! to scrape (the example scrapes it for its checks); then
//! [`describe`](crate::metrics::describe) gives the crate's metrics units
//! and help texts. Each is labelled with its table and the worker's name
//! ([`name`](crate::ClaimWorker::name); by default, the table's):
//! `diesel_claim_rows_processed_total`,
//! `_failed_total`, `_timed_out_total`, and histograms of claim and batch
//! durations and of the pickup latency, which this exporter serves as
//! summaries (quantiles). Counters move as each job's transaction ends.
//! The [`metrics`](crate::metrics) module lists them all.
//!
//! # What the example checks
//!
//! It ends by printing its checks, and exits with status 1 if one failed:
//!
//! - every job done once: each job enqueued has one row in `sent`, and only
//!   the dead letters are left in the queue;
//! - SIGTERM stops the service mid-queue within the timeout, and nothing
//!   is lost across the stop: every job was either sent and deleted, or
//!   still queued, and the report counted every email sent; Ctrl-C stops
//!   the restarted service the same way;
//! - the urgent job is sent after a handful of the jobs queued ahead of it;
//! - each failing job ran its three attempts, each retry no sooner than its
//!   delay after the failure before, and is a dead letter with its error,
//!   its work rolled back;
//! - the hanging job's first run is recorded as timed out, and its second
//!   sends it;
//! - the workers' reports and a scrape of the exporter count the same jobs
//!   processed, failed and timed out as the rows.
