//! diesel-claim (WIP)
#![deny(missing_docs)]

mod backend;
mod claim;
mod error;
mod lease;
mod lock;
pub mod migrations;
mod query;
mod transaction;
mod versioned;

pub use backend::ClaimBackend;
pub use claim::{ClaimBuilder, ClaimDsl, ClaimQuery, ClaimReport};
pub use error::{is_deadlock, is_lock_not_available, is_serialization_failure, Error, Result};
#[cfg(feature = "postgres")]
pub use lease::advisory;
pub use lease::{with_lease, Lease, MAX_NAME_LEN, MAX_TTL};
pub use lock::{LockBuilder, LockDsl, LockQuery};
pub use migrations::run_migrations;
pub use query::{LockStrength, OnLocked};
pub use versioned::{retry, RetryPolicy, Transient, Version, VersionedDsl, VersionedUpdate};

/// The extension traits, to `use diesel_claim::prelude::*;`.
pub mod prelude {
    pub use crate::claim::ClaimDsl;
    pub use crate::lock::LockDsl;
    pub use crate::versioned::VersionedDsl;
}
