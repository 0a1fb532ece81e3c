//! The traits and query types the crate's bounds are made of, where the
//! compiler's errors name them.
//!
//! User code never implements, calls or names these: the crate implements
//! each for what it supports. They are public so that an error about a query,
//! a row type, an order or a stamp column names a page that says what it asks
//! for, rather than a path into the crate's private modules. Each error also
//! says in its own words what to change; see each item here for the rule.
//!
//! Their methods are the crate's own and may change in any release.

pub use crate::claim::retries::{
    AttemptsColumn, ErrorTextColumn, IntegerType, RetriedRow, Retrying, RunAtColumn,
    ScheduleColumns, TimestampType,
};
pub use crate::claim::timed::Unclaimed;
pub use crate::claim::worker::{ClaimPerLoop, WorkerError};
pub use crate::claim::ClaimStatements;
pub use crate::connection::RenewingConnection;
pub use crate::error::Unconvertible;
pub use crate::reusable::QueryPerLoop;
pub use crate::sql::order::{ClaimOrder, Directed, KeyOrder, NotNullColumn, OrderTerms};
pub use crate::sql::retry::{DueNow, ErrorColumn, NoColumn, TextType};
pub use crate::sql::stamp::{
    ColumnOf, NullableTimestamp, QueryTable, StampColumn, StampType, StampedQuery,
};
