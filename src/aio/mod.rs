//! The async API, on [`diesel_async`](https://docs.rs/diesel-async) (feature `async`, with
//! `postgres_backend` for `AsyncPgConnection` and `mysql_backend` for
//! `AsyncMysqlConnection`; `postgres` and `mysql` include them, with Diesel's
//! blocking connections and their C client libraries).
//!
//! The same capabilities under the same names, as futures: bring
//! [`aio::prelude`](prelude) into scope instead of the crate's prelude (as you
//! would `diesel_async::RunQueryDsl` instead of Diesel's). Where the blocking API
//! takes a closure, this one takes an `async` closure, as diesel-async's
//! `transaction` does: `async |conn, row| { … }` (see [Closures](#closures)).
//! Every future of this module is `Send` when the closure's is, so claims run
//! in `tokio::spawn`ed tasks and axum handlers. Options, SQL and outcomes are those of the blocking API: both drive
//! the same code, so everything the crate documentation says holds here too,
//! with one addition, the bound on idle transactions (see "Dropped futures").
//!
//! Queries must own what they bind, or outlive the future (it holds them).
//!
//! With the crate's blocking prelude in scope instead, `claim_each`,
//! `with_lock` or `update_versioned` on an `AsyncPgConnection` or
//! `AsyncMysqlConnection` fails with "`AsyncPgConnection` is not a blocking
//! connection diesel-claim runs on", and a note to import
//! `diesel_claim::aio::prelude::*` in its place, not beside it: with both,
//! the names are ambiguous (the compiler warns, and takes the first).
//!
//! ```no_run
//! # #[cfg(feature = "postgres_backend")]
//! # mod shop {
//! use diesel::prelude::*;
//! use diesel_async::{AsyncPgConnection, RunQueryDsl};
//! use diesel_claim::aio::prelude::*;
//!
//! diesel::table! {
//!     orders (id) {
//!         id -> Integer,
//!         shipped -> Bool,
//!         email_sent -> Bool,
//!     }
//! }
//!
//! #[derive(Queryable, Selectable, Identifiable)]
//! struct Order {
//!     id: i32,
//!     shipped: bool,
//!     email_sent: bool,
//! }
//!
//! async fn send_emails(conn: &mut AsyncPgConnection) -> Result<u64, diesel_claim::Error> {
//!     let pending = orders::table
//!         .filter(orders::shipped.eq(true))
//!         .filter(orders::email_sent.eq(false));
//!     let report = pending
//!         .build_claim()
//!         .batch(100)
//!         .each(conn, async |conn, order: Order| {
//!             diesel::update(&order)
//!                 .set(orders::email_sent.eq(true))
//!                 .execute(conn)
//!                 .await?;
//!             Ok::<_, diesel_claim::Error>(())
//!         })
//!         .await?;
//!     Ok(report.processed)
//! }
//! # }
//! ```
//!
//! What is here: [`ClaimDsl::claim_each`] and the claim builder's `each` and
//! `each_batch` (per row and batched), claims that mark their rows
//! ([`mark`](crate::ClaimBuilder::mark),
//! [`mark_and_commit`](crate::ClaimBuilder::mark_and_commit)), claims with a
//! [visibility timeout](crate::ClaimBuilder::visibility_timeout) (the
//! closure gets a [`Claimed`](crate::Claimed)`<_, _, Async>`, whose `extend`,
//! `finish` and `release` are awaited), the worker loop
//! ([`ClaimWorker::run`](crate::ClaimWorker#method.run-1)), [`LockDsl::with_lock`]
//! and [`with_locks`](LockDsl::with_locks), [`VersionedDsl::update_versioned`]
//! with [`retry`], and leases ([`Lease`], [`with_lease`]), on
//! `AsyncPgConnection` and `AsyncMysqlConnection`, alone or from a bb8 or
//! deadpool pool. The crate's migrations run from async code with
//! [`run_migrations`], which needs no blocking client library; `named_lock`
//! and `advisory` are blocking only.
//!
//! # Closures
//!
//! Each closure is an `async` closure (`AsyncFnMut` where it is called for
//! every row or attempt, `AsyncFnOnce` for row locks and leases):
//!
//! - `async |conn, row: Order| { … }`, capturing what it uses by reference;
//! - `async move |conn, row: Order| { … }`, capturing references, or, called
//!   once (row locks, leases), owning what it captures;
//! - an `async fn` passed by name: `.claim_each(conn, send_email)`;
//! - a closure that returns a boxed future, `|conn, row| async move { … }.scope_boxed()`
//!   (diesel-async's form before 0.9; [`ScopedFutureExt`](scoped_futures::ScopedFutureExt)
//!   is in the prelude), passed through [`scoped`], or a function that returns
//!   one, by name. Inline, without [`scoped`], the compiler refuses it, saying
//!   "implementation of `AsyncFnMut` is not general enough".
//!
//! **The limit**: a closure called more than once cannot return a future that
//! borrows the closure's own state, as an `async move` closure that uses what it
//! owns does (`async move |conn, row| { sender.send(row).await }`), or one that
//! changes what it captured (`count += 1`). The type of such a future cannot be
//! named on stable Rust, so nothing can require it to be `Send`, and the
//! compiler says "async closure does not implement `FnMut` because it captures
//! state from its environment". Capture a reference instead (`let sender =
//! &sender;` before an `async move` closure, or a plain `async` closure), share
//! state through a `Mutex` or an atomic, or change the state in a [`scoped`]
//! closure before it returns its boxed future.
//!
//! # Dropped futures
//!
//! A future dropped while its transaction is open (a timeout, a `select!` that
//! took another branch, an aborted task, an axum handler whose client went
//! away) cannot await its rollback: async code cannot run in `drop`. What
//! happens to the transaction, its row locks and its partial writes:
//!
//! - **The dropped transaction sends `ROLLBACK`**, without waiting for the
//!   answer (the statement leaves when its future is first polled: PostgreSQL's
//!   connection queues it for its own task, MySQL's writes it behind any
//!   statement still in flight). The locks go within milliseconds, or when a
//!   statement in flight ends, on a bb8 or deadpool connection and on one of
//!   your own alike, whether or not the connection is used again. Nothing is
//!   committed. (A claim run
//!   [inside your own transaction](crate::ClaimBuilder::inside_transaction)
//!   sends nothing: your transaction owns its rollback.)
//! - **The idle bound is the backstop.** Every transaction this module opens
//!   (claims, row locks, leases) tells the server to end the session once the
//!   transaction has sat idle for its bound, in the statement that begins it:
//!   [`IDLE_TRANSACTION_BOUND`] (30 s) by default, or the claim's or lock's
//!   own ([`idle_bound`](crate::ClaimBuilder::idle_bound)); PostgreSQL's
//!   `idle_in_transaction_session_timeout` for the transaction, MariaDB's
//!   `idle_transaction_timeout` for the session. It ends a transaction whose
//!   `ROLLBACK` could not leave (a connection whose socket would not take
//!   it), and one whose closure awaits something that never finishes. MySQL
//!   has no such setting: there only `wait_timeout` (8 hours by default)
//!   bounds such a transaction. (The bound counts idle time only: a
//!   statement waiting for a lock is bounded by the session's `lock_timeout`
//!   or `innodb_lock_wait_timeout`.)
//! - **The connection is marked broken**, so that a **bb8** pool (diesel-async's
//!   `bb8` feature) discards it as it comes back, a **deadpool** pool
//!   discards it when it next hands it out, and a connection of your own
//!   refuses any further transaction with
//!   [`diesel::result::Error::BrokenTransactionManager`]: drop it and connect
//!   again. (Its plain queries run outside any transaction on PostgreSQL; on
//!   MySQL they fail, the `ROLLBACK`'s answer being unread.)
//!
//! **The bound has a price**: a closure that awaits something else for longer
//! than the bound inside its transaction loses its session, and with it its
//! row locks, while it still runs; another worker may then take the same
//! rows. The call fails with [`Error::IdleBoundExceeded`](crate::Error::IdleBoundExceeded).
//! Give a claim that runs long jobs a bound above the longest
//! ([`idle_bound`](crate::ClaimBuilder::idle_bound), `None` for none), or do
//! the work outside any transaction, with a
//! [visibility timeout](crate::ClaimBuilder::visibility_timeout).
//!
//! Nothing is ever committed half-way: a batch commits whole, after its closure,
//! or not at all.

// Public functions spell their futures out, `impl Future + Send`: an `async fn`
// cannot promise `Send`, and without the promise a caller's `tokio::spawn`
// must prove it through higher-ranked lifetimes, which the compiler cannot yet.
#![allow(clippy::manual_async_fn)]

mod backend;
mod claim;
mod closure;
mod drive;
mod kind;
mod lease;
mod lock;
#[cfg(feature = "migrations")]
mod migrations;
mod pooled;
mod query;
mod retries;
#[cfg(feature = "postgres_backend")]
mod ring;
mod timed;
mod transaction;
mod unwind;
mod versioned;
mod worker;

#[cfg(feature = "mysql_backend")]
pub use backend::establish_read_committed;
pub use backend::AsyncBackend;
pub use claim::ClaimDsl;
pub use closure::{scoped, AsyncFnMut1, AsyncFnMut2, AsyncFnMut3, AsyncFnOnce2};
pub use kind::{FailureHook, Finish, Takes};
pub use lease::{with_lease, with_lease_kept_alive, Lease};
pub use lock::{LockDsl, LockModelDsl, LockQuery};
#[cfg(feature = "migrations")]
pub use migrations::run_migrations;
pub use pooled::WorkerPool;
pub use query::{ClaimQuery, MarkQuery, StampQuery};
pub use retries::RetriedRow;
#[cfg(feature = "postgres_backend")]
pub use ring::RingDsl;
pub use timed::StampedRow;
pub use versioned::{retry, VersionedDsl};
#[cfg(feature = "postgres_backend")]
pub use worker::notify;
pub use worker::WaitForRows;

/// How long a transaction the async API opens may sit idle before the
/// server ends its session, unless the claim or lock says otherwise
/// ([`idle_bound`](crate::ClaimBuilder::idle_bound)). See the module
/// documentation, "Dropped futures".
///
/// Why 30 s: it weighs what a dropped or hung claim costs against what a
/// long job needs. Too short, and a job that awaits something slow inside
/// its claim loses its lock while it runs, and may run twice. Too long, and
/// a claim whose closure hangs (or whose dropped `ROLLBACK` could not leave)
/// keeps its rows locked that long (they are not lost: taken again
/// afterwards). A dropped claim does not wait for the bound: it rolls back
/// as it is dropped (measured at 2–6 ms on bb8, deadpool and kept
/// connections, PostgreSQL and MariaDB). Thirty seconds is longer than a
/// request handler's or an HTTP client's usual timeout, so a claim in a
/// request path keeps the default; a job worker whose jobs await longer
/// sets its own.
pub const IDLE_TRANSACTION_BOUND: std::time::Duration = std::time::Duration::from_secs(30);

/// The mode of the builders the [`aio::prelude`](prelude)'s traits make: they run
/// on a diesel-async connection, as futures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Async {}

/// The async extension traits, and the crate's other common names.
pub mod prelude {
    #[cfg(feature = "postgres_backend")]
    pub use super::RingDsl;
    pub use super::{scoped, ClaimDsl, LockDsl, LockModelDsl, VersionedDsl};
    pub use crate::{ClaimReport, Error, LockStrength, OnLocked, RetryPolicy};
    pub use scoped_futures::ScopedFutureExt;
}
