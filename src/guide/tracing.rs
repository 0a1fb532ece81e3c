//! Tracing: the spans and events of the `tracing` feature, with their
//! targets, levels and fields, and how to print them.
//!
//! With the `tracing` feature, the crate reports what it does through
//! [`tracing`](https://docs.rs/tracing): a span for each claim call, batch,
//! worker, lease and row lock, and an event where something went wrong, is
//! tried again, or a worker starts, stops, reconnects or reports its
//! progress. Without the feature, none of it is compiled. Spans and events
//! have targets under `diesel_claim` (`diesel_claim::claim::engine`,
//! `diesel_claim::lease`, …); a worker's span and events have
//! `diesel_claim::worker`, so that `RUST_LOG=diesel_claim::worker=info`
//! shows the workers alone. Events carry the table and the keys of the rows
//! they are about, and a worker's its name (`worker`, by default its table:
//! see [`name`](crate::ClaimWorker::name)), so that a line read alone says
//! what happened, and which of two workers of a table it is about.
//!
//! A span is printed when it closes, with its fields, only if the
//! subscriber is asked to: with `tracing-subscriber`'s `fmt`, that is
//! `with_span_events(FmtSpan::CLOSE)`; without it, only events are printed.
//!
//! ```no_run
//! use tracing_subscriber::fmt::format::FmtSpan;
//! use tracing_subscriber::EnvFilter;
//!
//! tracing_subscriber::fmt()
//!     // RUST_LOG=diesel_claim=info: calls, workers and warnings.
//!     .with_env_filter(EnvFilter::from_default_env())
//!     // A line per span as it closes: a claim with its report, a worker
//!     // with its totals.
//!     .with_span_events(FmtSpan::CLOSE)
//!     .init();
//! ```
//!
//! `RUST_LOG=diesel_claim=info` then shows each claim call, each worker's
//! start, stop and progress, and every warning; `diesel_claim=debug` adds
//! each batch (its transaction) of the claim calls, and the retries; a
//! worker's own claims and batches, most of them empty polls while it is
//! idle, are at `trace`, and its progress line says what they did. The
//! [worked example](https://github.com/diesel-claim/diesel-claim/tree/main/examples/shop) prints
//! them: `RUST_LOG=diesel_claim=info cargo run -p diesel-claim-shop
//! --features tracing`.
//!
//! | span | level | fields |
//! |---|---|---|
//! | `claim` | info (trace when a worker runs it) | `table` (the claimed table, unqualified), `from_head`, `batch`, `max_rows`, `drain`, `keep_going`, `on_locked` (`skip`, `fail`, `wait`), `strength`; when the call ends, the [`ClaimReport`](crate::ClaimReport)'s `processed`, `skipped`, `locked`, `gone`, `failed`, `not_reached`, `passes`, and `stopped` (an error ended the call) |
//! | `batch` | debug (trace in a worker) | `limit` (rows it may take), `taken`, `outcome` (`committed`, `rolled back`); one per transaction that takes rows, inside `claim`; with `mark_and_commit` and a visibility timeout, it ends when the mark or the stamps commit, before the closure runs |
//! | `worker` | info | `worker` (its name), `table`, `channel`, `min_poll`, `max_poll`; when it stops, `processed` and `failed` in all; around its `claim` spans |
//! | `lease` | info | `name`, `ttl`, `token` (once acquired), `outcome` (`held by another`, `released`, `lost`, `release failed`): [`with_lease`](crate::with_lease), [`with_lease_kept_alive`](crate::with_lease_kept_alive) |
//! | `acquire_lease`, `renew_lease`, `release_lease` | debug | `name`, `token`, `outcome` (`acquired`, `held by another`, `renewed`, `released`, `lost`); `acquire_lease` also `ttl` |
//! | `lock` | debug | `table` (the locked table, unqualified), `strength`, `on_locked` (`fail`, `wait`), `rows`, `outcome`: [`with_lock`](crate::LockDsl::with_lock) |
//!
//! | event | level |
//! |---|---|
//! | a job used its last attempt under its [retry schedule](crate::ClaimBuilder::retries), a dead letter, out of the queue: `table`, `key`, `attempts`, and in a worker `worker` | error |
//! | a closure failed and its rows are passed over ([`keep_going`](crate::ClaimBuilder::keep_going), a failure hook), said as they are passed over, before the next batch is taken: `table`, `keys` (the first ten), `rows`, and in a worker `worker` and `error` (the closure's, by `Display`) | warn |
//! | a closure panicked: `panic` (its message); with `keep_going`, the event above follows | warn |
//! | a closure ran past its [`timeout`](crate::ClaimBuilder::timeout), its work rolled back: `table`, `keys`, `rows`, `timeout`, and in a worker `worker` | warn |
//! | a worker's claim was rolled back by a deadlock or a serialization failure, and runs again: `table`, `worker`, `error` | warn |
//! | a worker stops on an error (a closure's, without `keep_going` or a hook; a lost connection, on one connection): `table`, `worker`, `keys` (the rows rolled back), `error` | warn |
//! | a worker on a pool lost a connection, or could not check one out, and tries again on another: `table`, `worker`, `error`, `pause` | warn |
//! | deadlock detected (the database's message) | warn |
//! | a kept-alive lease's renewal failed, the lease lost, a renewal still running when the closure ended left to finish: `name`, `token`, `error` (the error, or why the lease was lost) | warn |
//! | [`retry`](crate::retry()) gave up on a transient error: `attempt`, `max_attempts` | warn |
//! | a worker starts: `table`, `worker`, `loops`, `channel`, `min_poll`, `max_poll`, `progress_every` | info |
//! | `worker progress`, every [`progress_interval`](crate::ClaimWorker::progress_interval) (60 s by default): `table`, `worker`, `processed` and `failed` since the last, `idle` (the time spent waiting for rows, per claim loop), `over` (the time since the last) | info |
//! | a worker stops: `table`, `worker`, `why` (`stopped`, `nothing pending`), `processed`, `failed` | info |
//! | a worker on a pool has a working connection again, after `failures`; its listener listens on `channel` (at the start, and after `failures`): `table`, `worker` | info |
//! | lock not available (`nowait`, a lock timeout, SQLite's busy timeout) | info |
//! | [`retry`](crate::retry()) tries again: `attempt`, `max_attempts`, `pause` | debug |
//! | a version conflict (the error, with both versions); a serialization failure | debug |
//! | a locked row moved to another partition: the transaction runs `again` | debug |
//!
//! A `retry` event follows the event that says what failed: the crate's
//! errors (deadlock, serialization failure, version conflict) are reported
//! where the crate tells them apart, as [`Transient`](crate::Transient) says only whether to
//! try again. A failed row's event from a claim call does not show the
//! closure's error, whose type may have no `Display`:
//! [`each_outcome`](crate::ClaimBuilder::each_outcome) returns it with the row's
//! key. A worker passes its errors over where nobody else sees them: its
//! error type shows itself (`Display`), and its events show them. A call
//! refused before any SQL (invalid options) has no span; its error is
//! returned. Async calls are the same spans, entered only while their
//! futures are polled. A worker on an r2d2 pool runs its loops and its
//! listener on threads of its own, with the subscriber of the thread that
//! called `run_pooled`: one set for that thread alone
//! (`tracing::subscriber::with_default`) sees them too.
//!
//! A worker's progress line tells an operator that it is alive and what it
//! did. With the subscriber above and `RUST_LOG=diesel_claim=info`, a worker
//! named `mailer` leaves lines such as these (span fields cut short):
//!
//! ```text
//! INFO worker{worker="mailer" table="orders" …}: diesel_claim::worker: a worker starts table="orders" worker="mailer" loops=4 channel="orders" …
//! INFO worker{worker="mailer" table="orders" …}: diesel_claim::worker: worker progress table="orders" worker="mailer" processed=1520 failed=2 idle=41.3s over=60.002s
//! WARN worker{worker="mailer" table="orders" …}: diesel_claim::claim: a closure failed: its rows are rolled back and passed over table="orders" worker="mailer" keys=[1207] rows=1 error=no mail server
//! INFO worker{worker="mailer" table="orders" …}: diesel_claim::worker: a worker stops table="orders" worker="mailer" why="stopped" processed=90411 failed=17
//! ```
//!
//! Counters and histograms of the same (rows processed, failed, timed out,
//! gone and locked; claim, batch and pickup times, per table and worker)
//! come with the `metrics` feature, through the `metrics` facade: see the
//! `metrics` module.
