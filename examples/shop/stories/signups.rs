//! Part 3: concurrent sign-ups reserve a user name under a lease
//! (`with_lease`), the seed's memcached `add` lock done in the database.
//!
//! Names are reused over time (a closed account gives its name back), so the
//! users table cannot have UNIQUE (name); "one *active* user per name" is the
//! application's job. Checking and inserting is a race between two statements;
//! a lease on `signup:<name>` makes it a critical section across threads,
//! processes and machines. The lease expires by the database clock, so a
//! crashed holder blocks the name for at most its TTL.

use std::collections::BTreeMap;
use std::thread;
use std::time::Duration;

use diesel::dsl::{count_star, exists};
use diesel::prelude::*;

use super::{run_workers, Conn, Pool};
use crate::schema::users;
use crate::{BoxError, Checks, Clock, Options};

/// The names everyone wants.
const NAMES: [&str; 4] = ["alice", "bob", "carol", "dave"];
/// Sign-up requests per worker (the internet sends duplicate POSTs).
const REQUESTS_PER_WORKER: usize = 40;

/// What a sign-up request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SignUp {
    /// The user was created, under the lease with this fencing token.
    Created { user_id: i32, token: i64 },
    /// Someone holds the name already.
    NameTaken,
    /// Another request for the same name holds the lease right now: the client
    /// is told to try again (as the seed does when `add` fails).
    Busy,
}

pub fn run(
    pool: &Pool,
    options: &Options,
    clock: Clock,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    println!("\nPart 3: sign-ups reserve a user name with with_lease");
    let mut conn = pool.get()?;
    // An alice from years ago, whose account is closed: her name is free again.
    diesel::insert_into(users::table)
        .values((users::name.eq("alice"), users::active.eq(false)))
        .execute(&mut conn)?;

    let outcomes = run_workers(pool, options.workers, |conn, worker| {
        (0..REQUESTS_PER_WORKER)
            .map(|request| {
                let name = NAMES[(worker as usize + request) % NAMES.len()];
                Ok((name, sign_up(conn, name)?))
            })
            .collect::<Result<Vec<_>, BoxError>>()
    })?;
    let outcomes: Vec<(&str, SignUp)> = outcomes.into_iter().flatten().collect();

    let count = |wanted: fn(&SignUp) -> bool| {
        outcomes
            .iter()
            .filter(|(_, outcome)| wanted(outcome))
            .count()
    };
    clock.log(format_args!(
        "{} requests: {} created, {} found the name taken, {} told to retry (lease busy)",
        outcomes.len(),
        count(|outcome| matches!(outcome, SignUp::Created { .. })),
        count(|outcome| *outcome == SignUp::NameTaken),
        count(|outcome| *outcome == SignUp::Busy),
    ));
    for (name, outcome) in &outcomes {
        if let SignUp::Created { user_id, token } = outcome {
            println!("          {name:<5} created: user #{user_id}, under lease token {token}");
        }
    }

    check_names(&mut conn, checks)
}

/// Creates an active user called `name` unless one exists, holding the lease on
/// `signup:<name>` for the check and the insert.
///
/// The closure returns `diesel_claim::Error`, which `?` makes from Diesel's own
/// errors: no error type of the shop's is needed here.
fn sign_up(conn: &mut Conn, name: &str) -> Result<SignUp, diesel_claim::Error> {
    let lease_name = format!("signup:{name}");
    let outcome =
        diesel_claim::with_lease(conn, &lease_name, Duration::from_secs(10), |conn, lease| {
            let taken = diesel::select(exists(
                users::table
                    .filter(users::name.eq(name))
                    .filter(users::active),
            ))
            .get_result::<bool>(conn)?;
            if taken {
                return Ok(SignUp::NameTaken);
            }
            // Validating the name, asking a spam filter…: this gap between the
            // check and the insert is where duplicate users came from without the
            // lease. It must stay well below the TTL.
            thread::sleep(Duration::from_millis(2));
            // The fencing token goes with the write: a later reader can tell which
            // lease holder wrote the row, and writes can be made conditional on
            // holding the newest token.
            diesel::insert_into(users::table)
                .values((
                    users::name.eq(name),
                    users::active.eq(true),
                    users::lease_token.eq(lease.token()),
                ))
                .execute(conn)?;
            // (name, token) is this holder's alone: tokens never repeat for a name.
            // (Read back rather than `RETURNING`, which MySQL lacks.)
            let user_id = users::table
                .filter(users::name.eq(name))
                .filter(users::lease_token.eq(lease.token()))
                .select(users::id)
                .first(conn)?;
            Ok(SignUp::Created {
                user_id,
                token: lease.token(),
            })
        });
    // `None`: the closure did not run because the lease is held by another
    // request for the same name.
    outcome.map(|created_or_taken| created_or_taken.unwrap_or(SignUp::Busy))
}

fn check_names(conn: &mut Conn, checks: &mut Checks) -> Result<(), BoxError> {
    let active: BTreeMap<String, i64> = users::table
        .filter(users::active)
        .group_by(users::name)
        .select((users::name, count_star()))
        .load::<(String, i64)>(conn)?
        .into_iter()
        .collect();
    let unique =
        active.len() == NAMES.len() && NAMES.iter().all(|name| active.get(*name) == Some(&1));
    checks.check(
        "names unique among active users",
        unique,
        format!("active users per name {active:?}"),
    );

    let alices: i64 = users::table
        .filter(users::name.eq("alice"))
        .count()
        .get_result(conn)?;
    checks.check(
        "a closed account's name was reused",
        alices == 2,
        format!("{alices} users named alice, one of them closed"),
    );
    Ok(())
}
