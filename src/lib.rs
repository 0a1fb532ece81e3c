#![doc = include_str!("../README.md")]
// Feature-gated items say which feature they need, on docs.rs.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]
#![warn(missing_debug_implementations)]

#[cfg(feature = "async")]
pub mod aio;
mod backend;
pub mod bounds;
mod claim;
mod connection;
mod error;
pub mod guide;
mod lease;
mod lock;
mod locking;
#[cfg(feature = "metrics")]
pub mod metrics;
// Without the feature, the claims' metrics are a no-op twin (and the public
// module, with its docs, does not exist).
#[cfg(not(feature = "metrics"))]
#[path = "metrics_off.rs"]
mod metrics;
#[cfg(feature = "migrations")]
pub mod migrations;
#[cfg(feature = "mysql_backend")]
pub mod named_lock;
mod retry;
mod reusable;
#[cfg(feature = "postgres_backend")]
pub mod ring;
mod sql;
mod trace;
mod transaction;
mod versioned;

/// The mode of the builders the [`prelude`]'s traits make: they run on a blocking
/// Diesel [`Connection`](diesel::Connection). (`aio::Async` is the other.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocking {}

pub use backend::ClaimBackend;
pub use claim::kind;
#[cfg(feature = "postgres_backend")]
pub use claim::notify;
pub use claim::retries::{Retries, MAX_ERROR_LEN};
pub use claim::{
    ClaimBuilder, ClaimDsl, ClaimOutcome, ClaimQuery, ClaimReport, ClaimWorker, Claimed, MarkQuery,
    RowFailure, StampQuery, StampedRow, StopHandle, WaitForRows,
};
pub use connection::BlockingConnection;
pub use error::{is_deadlock, is_lock_not_available, is_serialization_failure, Error, Result};
#[cfg(feature = "postgres_backend")]
pub use lease::advisory;
pub use lease::{with_lease, with_lease_kept_alive, KeptLease, Lease, MAX_NAME_LEN, MAX_TTL};
pub use lock::{FreshRow, LockBuilder, LockDsl, LockModelDsl, LockQuery};
pub use locking::{LockStrength, OnLocked};
#[cfg(feature = "migrations")]
pub use migrations::run_migrations;
pub use retry::{is_transient, retry, RetryPolicy, Transient};
pub use reusable::{rebuild, Rebuild, Reusable};
pub use versioned::{Version, VersionedDelete, VersionedDsl, VersionedUpdate};

/// The extension traits, for `use diesel_claim::prelude::*;`.
pub mod prelude {
    pub use crate::claim::ClaimDsl;
    pub use crate::lock::{LockDsl, LockModelDsl};
    #[cfg(feature = "postgres_backend")]
    pub use crate::ring::RingDsl;
    pub use crate::versioned::VersionedDsl;
}
