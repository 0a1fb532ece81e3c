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
//!   one, by name.
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
//! away) cannot roll back: async code cannot run in `drop`. The transaction
//! stays open, with its row locks and its partial writes, on the connection.
//! Two things bound what that costs:
//!
//! - **The server ends it.** Every transaction this module opens (claims, row
//!   locks, leases) tells the server to end the session once the transaction
//!   has sat idle for [`IDLE_TRANSACTION_BOUND`] (30 s), in the statement that
//!   begins it: PostgreSQL's `idle_in_transaction_session_timeout`, for that
//!   transaction only; MariaDB's `idle_transaction_timeout`, lowered for the
//!   session (it stays after the transaction; a lower one the session has is
//!   kept). So a dropped claim holds its locks at most that long after its
//!   last statement, on any pool or connection, even one nobody uses again.
//!   (The bound counts idle time only: a future dropped while a statement
//!   waits for a lock leaves that statement waiting, bounded by the session's
//!   `lock_timeout` or `innodb_lock_wait_timeout`, then 30 s more. A claim
//!   run [inside your own transaction](crate::ClaimBuilder::inside_transaction)
//!   is bounded as your transaction is.) The price: a closure that awaits something else for
//!   longer than the bound inside its transaction loses its session (the
//!   batch fails and rolls back); do such work outside any transaction, with
//!   a [visibility timeout](crate::ClaimBuilder::visibility_timeout). **MySQL**
//!   has no such setting: there only `wait_timeout` (8 hours by default)
//!   bounds an abandoned transaction, so drop such connections yourself.
//! - **The connection is marked broken**, so that a **bb8** pool (diesel-async's
//!   `bb8` feature) discards it as it comes back (the server then rolls the
//!   transaction back and releases the locks at once), a **deadpool** pool
//!   discards it when it next hands it out, and a connection of your own
//!   refuses any further transaction with
//!   [`diesel::result::Error::BrokenTransactionManager`]. Until the bound
//!   passes, **plain queries on such a connection still run, inside the
//!   abandoned transaction** (and see its uncommitted writes): drop it and
//!   connect again (with deadpool, `deadpool::managed::Object::take` it out
//!   of the pool when you cancel a claim, to free its locks at once).
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
mod migrations;
#[cfg(any(feature = "bb8", feature = "deadpool"))]
mod pooled;
mod query;
mod timed;
mod transaction;
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
pub use migrations::run_migrations;
#[cfg(any(feature = "bb8", feature = "deadpool"))]
pub use pooled::{PoolFailure, WorkerPool};
pub use query::{ClaimQuery, MarkQuery, StampQuery};
pub use timed::StampedRow;
pub use versioned::{retry, VersionedDsl};
#[cfg(feature = "postgres_backend")]
pub use worker::notify;
pub use worker::WaitForRows;

/// How long a transaction the async API opens may sit idle before the
/// server ends the session: the bound on how long a future dropped
/// mid-transaction (which cannot roll back) holds its locks. PostgreSQL sets
/// `idle_in_transaction_session_timeout` for each such transaction, in place
/// of the session's own setting for its length; MariaDB
/// lowers the session's `idle_transaction_timeout` to it (a lower one is
/// kept). MySQL has no such setting. See the module documentation, "Dropped
/// futures".
pub const IDLE_TRANSACTION_BOUND: std::time::Duration = std::time::Duration::from_secs(30);

/// The mode of the builders the [`aio::prelude`](prelude)'s traits make: they run
/// on a diesel-async connection, as futures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Async {}

/// The async extension traits, and the crate's other common names.
pub mod prelude {
    pub use super::{scoped, ClaimDsl, LockDsl, LockModelDsl, VersionedDsl};
    pub use crate::{ClaimReport, Error, LockStrength, OnLocked, RetryPolicy};
    pub use scoped_futures::ScopedFutureExt;
}
