//! Errors as the crate names them: a session the server ends under a claim
//! is `Error::BrokenConnection` on PostgreSQL and MariaDB, as the guide
//! says, and a pool that gives no connection is `Error::Checkout`, which `?`
//! converts its error into.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::BigInt;
use diesel_claim::prelude::*;
use diesel_claim::Error;

use testkit::fixtures::{on_every_backend, orders, Order};

/// The orders whose email is not sent.
fn unsent() -> diesel::dsl::Filter<orders::table, diesel::dsl::Eq<orders::email_sent, bool>> {
    orders::table.filter(orders::email_sent.eq(false))
}

on_every_backend! {
    /// The server's id of `conn`'s session.
    pub fn session_id(conn: &mut Conn) -> i64 {
        let id = if BACKEND == "pg" { "CAST(pg_backend_pid() AS BIGINT)" } else { "CONNECTION_ID()" };
        diesel::select(diesel::dsl::sql::<BigInt>(id)).get_result(conn).unwrap()
    }

    /// Ends session `id` from another connection, as an administrator
    /// would: PostgreSQL's `pg_terminate_backend`, waiting up to 5 s for
    /// the session to end, MariaDB's `KILL`.
    pub fn end_session(pool: &Pool, id: i64) {
        let end = if BACKEND == "pg" {
            testkit::sessions::terminate_and_wait_sql(id)
        } else {
            format!("KILL {id}")
        };
        pool.get().unwrap().batch_execute(&end).unwrap();
    }
}

on_every_backend! { row_locks;
    /// The server ends the session while a claim's closure works on its
    /// row: the closure's next statement (through `?`) and the claim fail
    /// with `BrokenConnection`, and so does the next claim on that
    /// connection; nothing was committed, and the row is still pending.
    #[test]
    fn a_session_ended_mid_claim_is_a_broken_connection() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        diesel::insert_into(orders::table)
            .values(orders::shipped.eq(true))
            .execute(&mut conn)
            .unwrap();
        let id = session_id(&mut conn);
        let mut ran = 0;
        let claimed = unsent().claim_each(&mut conn, |conn, order: Order| {
            ran += 1;
            end_session(&pool, id);
            diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
            Ok::<_, Error>(())
        });
        assert_eq!(ran, 1, "the closure did not run");
        let error = claimed.unwrap_err();
        assert!(matches!(error, Error::BrokenConnection(_)), "{error:?}");
        assert!(!error.is_transient());
        let again = unsent().claim_each(&mut conn, |_, _: Order| Ok::<_, Error>(()));
        assert!(matches!(again, Err(Error::BrokenConnection(_))), "{again:?}");
        let pending: i64 = unsent().count().get_result(&mut pool.get().unwrap()).unwrap();
        assert_eq!(pending, 1, "the ended session's write was committed");
    }
}

/// A URL no server answers on: loopback port 1.
#[cfg(feature = "postgres")]
const UNREACHABLE_PG: &str = "postgres://postgres@127.0.0.1:1/test";

/// An r2d2 pool whose server cannot be reached times out, and `pool.get()?`
/// turns that into `Error::Checkout`, r2d2's error as its source.
#[cfg(feature = "postgres")]
#[test]
fn an_unreachable_r2d2_pool_is_a_checkout_error() {
    use diesel::r2d2::{ConnectionManager, Pool, PoolError};
    use std::time::Duration;

    type PgPool = Pool<ConnectionManager<PgConnection>>;
    fn check_out(pool: &PgPool) -> Result<(), Error> {
        let _conn = pool.get()?;
        Ok(())
    }

    let pool = Pool::builder()
        .connection_timeout(Duration::from_millis(300))
        .build_unchecked(ConnectionManager::<PgConnection>::new(UNREACHABLE_PG));
    assert_checkout_from::<PoolError>(&check_out(&pool).unwrap_err());
}

/// `error` is `Error::Checkout`, with the pool's error `P` as its source,
/// and says so.
#[cfg(feature = "postgres")]
pub fn assert_checkout_from<P: std::error::Error + 'static>(error: &Error) {
    assert!(
        matches!(error, Error::Checkout(source) if source.downcast_ref::<P>().is_some()),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .starts_with("no connection from the pool: "),
        "{error}"
    );
}
