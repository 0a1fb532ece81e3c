//! The async API, on [`diesel_async`] (feature `async`, with `postgres` for
//! `AsyncPgConnection` and `mysql` for `AsyncMysqlConnection`).
//!
//! The same capabilities under the same names, as futures: bring
//! [`aio::prelude`](prelude) into scope instead of the crate's prelude (as you
//! would `diesel_async::RunQueryDsl` instead of Diesel's). Where the blocking API
//! takes a closure, this one takes a closure that returns a boxed future
//! borrowing the connection, as diesel-async's `transaction` long did:
//! `|conn, row| async move { … }.scope_boxed()` (from
//! [`scoped_futures`], re-exported in the prelude). That keeps every future of
//! this module `Send`, so claims run in `tokio::spawn`ed tasks and axum
//! handlers. Options, SQL and outcomes are those of the blocking API: both drive
//! the same code, so everything the crate documentation says holds here too.
//!
//! Queries must own what they bind, or outlive the future (it holds them).
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
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
//!         .each(conn, |conn, order: Order| {
//!             async move {
//!                 diesel::update(&order)
//!                     .set(orders::email_sent.eq(true))
//!                     .execute(conn)
//!                     .await?;
//!                 Ok::<_, diesel_claim::Error>(())
//!             }
//!             .scope_boxed()
//!         })
//!         .await?;
//!     Ok(report.processed)
//! }
//! # }
//! ```
//!
//! What is here: [`ClaimDsl::claim_each`] and the claim builder's `each` and
//! `each_batch` (per row and batched; not yet `mark`), claims with a
//! [visibility timeout](crate::ClaimBuilder::visibility_timeout) (the
//! closure gets a [`Claimed`](crate::Claimed)`<_, _, Async>`, whose `extend`,
//! `finish` and `release` are awaited), the worker loop
//! ([`ClaimWorker::run`](crate::ClaimWorker#method.run-1)), [`LockDsl::with_lock`]
//! and [`with_locks`](LockDsl::with_locks), [`VersionedDsl::update_versioned`]
//! with [`retry`], and leases ([`Lease`], [`with_lease`]), on
//! `AsyncPgConnection` and `AsyncMysqlConnection`, alone or from a bb8 or
//! deadpool pool. The crate's migrations are run with a blocking connection
//! ([`run_migrations`](crate::run_migrations)); `named_lock` and `advisory` are
//! blocking only.
//!
//! # Dropped futures
//!
//! A future dropped while its transaction is open (a timeout, a `select!` that
//! took another branch, an aborted task) cannot roll back: async code cannot run
//! in `drop`. The transaction stays open, with its row locks and its partial
//! writes, on the connection, and this crate marks the connection's transaction
//! manager broken, so that:
//!
//! - a **bb8** pool (diesel-async's `bb8` feature) discards the connection as it
//!   comes back: the server ends the session, rolls the transaction back and
//!   releases the locks at once;
//! - a **deadpool** pool discards it when it next recycles it, on a later `get`:
//!   until then the locks stay held. Drop such a connection yourself
//!   (`deadpool::managed::Object::take`) when you cancel a claim;
//! - a connection of your own refuses any further transaction with
//!   [`diesel::result::Error::BrokenTransactionManager`]: drop it (closing it
//!   ends the transaction) and connect again.
//!
//! Nothing is ever committed half-way: a batch commits whole, after its closure,
//! or not at all.

// Public functions spell their futures out, `impl Future + Send`: an `async fn`
// cannot promise `Send`, and without the promise a caller's `tokio::spawn`
// must prove it through higher-ranked lifetimes, which the compiler cannot yet.
#![allow(clippy::manual_async_fn)]

mod backend;
mod claim;
mod lease;
mod lock;
mod timed;
mod transaction;
mod versioned;
mod worker;

pub use backend::AsyncBackend;
pub use claim::{ClaimDsl, ClaimQuery};
pub use lease::{with_lease, with_lease_kept_alive, Lease};
pub use lock::{LockDsl, LockModelDsl, LockQuery};
pub use timed::{StampQuery, StampedRow};
pub use versioned::{retry, VersionedDsl};
pub use worker::WaitForRows;

/// The mode of the builders the [`aio::prelude`](prelude)'s traits make: they run
/// on a diesel-async connection, as futures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Async {}

/// The async extension traits, and the crate's other common names.
pub mod prelude {
    pub use super::{ClaimDsl, LockDsl, LockModelDsl, VersionedDsl};
    pub use crate::{ClaimReport, Error, LockStrength, OnLocked, RetryPolicy};
    pub use scoped_futures::ScopedFutureExt;
}
