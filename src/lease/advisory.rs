//! PostgreSQL advisory locks keyed by a stable hash of a name.
//!
//! Transaction-scoped: taken inside a transaction, released when it ends, with no
//! table and no cleanup. Unlike a [`Lease`](crate::Lease) they have no TTL and no fencing token:
//! they protect work that happens inside that one transaction.
//!
//! ```
//! use diesel::prelude::*;
//! use diesel_claim::{advisory, Error};
//!
//! # fn main() -> Result<(), Error> {
//! # let url = std::env::var("PG_DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into());
//! let mut conn = PgConnection::establish(&url).expect("PostgreSQL at PG_DATABASE_URL");
//! let mut other = PgConnection::establish(&url).expect("PostgreSQL at PG_DATABASE_URL");
//! conn.transaction(|conn| {
//!     assert!(advisory::try_lock(conn, "rebuild-search-index")?);
//!     // Another session cannot take it until this transaction ends.
//!     assert!(!other.transaction(|other| advisory::try_lock(other, "rebuild-search-index"))?);
//!     Ok::<_, Error>(())
//! })?;
//! assert!(other.transaction(|other| advisory::try_lock(other, "rebuild-search-index"))?);
//! # Ok(())
//! # }
//! ```

use diesel::connection::{Connection, LoadConnection};
use diesel::pg::Pg;
use diesel::sql_types::{BigInt, Bool};
use diesel::{QueryableByName, RunQueryDsl};

use crate::transaction::transaction_depth;
use crate::Error;

/// The advisory-lock key of `name`: the 64-bit FNV-1a hash of its UTF-8
/// bytes, as a signed integer.
///
/// Stable across processes, versions and platforms (unlike PostgreSQL's
/// `hashtext`), so other programs can compute the same key:
/// offset basis `0xcbf29ce484222325`, prime `0x100000001b3`.
pub fn key(name: &str) -> i64 {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    hash as i64
}

#[derive(QueryableByName)]
struct Acquired {
    #[diesel(sql_type = Bool)]
    acquired: bool,
}

/// Takes the transaction-scoped advisory lock on `name` if it is free
/// (`pg_try_advisory_xact_lock`); it is released when the transaction ends.
///
/// [`Error::InvalidArgument`] outside a transaction, where the lock would be
/// released as soon as it was taken.
pub fn try_lock<C>(conn: &mut C, name: &str) -> Result<bool, Error>
where
    C: LoadConnection<Backend = Pg>,
{
    require_transaction(conn)?;
    let row = diesel::sql_query("SELECT pg_try_advisory_xact_lock($1) AS acquired")
        .bind::<BigInt, _>(key(name))
        .get_result::<Acquired>(conn)?;
    Ok(row.acquired)
}

/// Waits for the transaction-scoped advisory lock on `name`
/// (`pg_advisory_xact_lock`), bounded by the session's `lock_timeout`.
pub fn lock<C>(conn: &mut C, name: &str) -> Result<(), Error>
where
    C: Connection<Backend = Pg>,
{
    require_transaction(conn)?;
    diesel::sql_query("SELECT pg_advisory_xact_lock($1)")
        .bind::<BigInt, _>(key(name))
        .execute(conn)?;
    Ok(())
}

fn require_transaction<C: Connection>(conn: &mut C) -> Result<(), Error> {
    if transaction_depth(conn)? == 0 {
        return Err(Error::InvalidArgument(
            "transaction-scoped advisory locks need an open transaction".to_owned(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_are_fnv1a_64() {
        // Reference values of FNV-1a 64.
        assert_eq!(super::key(""), 0xcbf2_9ce4_8422_2325_u64 as i64);
        assert_eq!(super::key("a"), 0xaf63_dc4c_8601_ec8c_u64 as i64);
        assert_eq!(super::key("foobar"), 0x8594_4171_f739_67e8_u64 as i64);
    }
}
