//! MySQL and MariaDB named locks (`GET_LOCK`), held by a session.

use std::panic::{self, AssertUnwindSafe};
use std::time::Duration;

use diesel::connection::LoadConnection;
use diesel::mysql::Mysql;
use diesel::sql_types::{Double, Nullable, Text};
use diesel::{QueryableByName, RunQueryDsl};

use crate::Error;

/// The longest name MySQL accepts, in characters.
pub const MAX_NAME_CHARS: usize = 64;

#[derive(QueryableByName)]
struct Outcome {
    #[diesel(sql_type = Nullable<diesel::sql_types::Integer>)]
    outcome: Option<i32>,
}

/// Runs `f` while holding the named lock `name` (`GET_LOCK`), waiting up to
/// `wait` for it, and releases it afterwards (`RELEASE_LOCK`), also when `f`
/// fails or panics. `Ok(None)`: the lock stayed held by another session for
/// the whole wait, and `f` did not run.
///
/// A named lock belongs to the connection's session, not to a transaction: it
/// holds across commits and is released by the server when the session ends,
/// so a crashed process frees it at once. That also makes it a liveness hint
/// only: with no fencing token, a holder that lost its connection cannot tell.
/// Where writes must reject a stale holder, use a [`Lease`](crate::Lease).
///
/// Names are compared as the server's collation compares them; at most
/// [`MAX_NAME_CHARS`] characters, not empty. `wait` is rounded to microseconds;
/// zero tries once.
///
/// ```no_run
/// # fn demo(conn: &mut diesel::MysqlConnection) -> Result<(), diesel_claim::Error> {
/// use std::time::Duration;
///
/// let ran = diesel_claim::named_lock::with_named_lock(conn, "nightly-report", Duration::ZERO, |conn| {
///     // Only one session at a time gets here.
///     Ok::<_, diesel_claim::Error>(())
/// })?;
/// if ran.is_none() {
///     println!("another worker is writing the report");
/// }
/// # Ok(())
/// # }
/// ```
pub fn with_named_lock<C, T, E, F>(
    conn: &mut C,
    name: &str,
    wait: Duration,
    f: F,
) -> Result<Option<T>, E>
where
    C: LoadConnection<Backend = Mysql>,
    F: FnOnce(&mut C) -> Result<T, E>,
    E: From<Error>,
{
    check_name(name)?;
    let acquired = diesel::sql_query("SELECT GET_LOCK(?, ?) AS outcome")
        .bind::<Text, _>(name)
        .bind::<Double, _>(wait.as_secs_f64())
        .get_result::<Outcome>(conn)
        .map_err(Error::from)?;
    match acquired.outcome {
        Some(1) => {}
        Some(_) => return Ok(None),
        None => {
            return Err(Error::UnexpectedOutcome(format!(
                "GET_LOCK({name:?}) failed on the server (out of memory, or the session was killed)"
            ))
            .into())
        }
    }
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| f(&mut *conn)));
    let released = diesel::sql_query("SELECT RELEASE_LOCK(?) AS outcome")
        .bind::<Text, _>(name)
        .get_result::<Outcome>(conn);
    let value = match outcome {
        Ok(value) => value?,
        // If the release failed, the session is broken and its end frees the lock.
        Err(payload) => panic::resume_unwind(payload),
    };
    match released.map_err(Error::from)?.outcome {
        Some(1) => Ok(Some(value)),
        _ => Err(Error::UnexpectedOutcome(format!(
            "the named lock {name:?} was no longer held by this session when released \
             (released inside the closure?)"
        ))
        .into()),
    }
}

fn check_name(name: &str) -> Result<(), Error> {
    let chars = name.chars().count();
    if chars == 0 || chars > MAX_NAME_CHARS {
        return Err(Error::InvalidArgument(format!(
            "a named lock's name has 1 to {MAX_NAME_CHARS} characters, not {chars}"
        )));
    }
    Ok(())
}
