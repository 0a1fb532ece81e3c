//! `with_lease_kept_alive` given its renewing connection by reference, as
//! it once took it: the error says the connection is given by value.
//~ `&mut diesel::PgConnection` cannot renew a lease: the renewing connection is given by value
//~ pass the second connection itself (`second`, not `&mut second`)
//~# 1 error in at most 40 lines
use diesel::prelude::*;
use std::time::Duration;

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let mut second = PgConnection::establish("postgres://").unwrap();
    let _ = diesel_claim::with_lease_kept_alive(
        &mut conn,
        &mut second,
        "nightly-report",
        Duration::from_secs(30),
        |_, lease| {
            lease.ensure_held()?;
            Ok::<_, diesel_claim::Error>(())
        },
    );
}
