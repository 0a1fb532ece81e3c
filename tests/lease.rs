//! Tests of lease: named leases with fencing tokens (scenarios 16–20 and the
//! lease part of "Bad input").

use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel_claim::{with_lease, with_lease_kept_alive, Error, Lease, MAX_NAME_LEN, MAX_TTL};

use testkit::fixtures::{accounts, customers, on_every_backend, orders, outbox};

diesel::table! {
    diesel_claim_leases (name) {
        name -> Text,
        token -> BigInt,
    }
}

// A table like the seed's `users`: no UNIQUE constraint on the name, so only
// the lease keeps names unique.
diesel::table! {
    reserved_names (name) {
        name -> Text,
        holder -> Integer,
    }
}

// A downstream resource that rejects writes carrying an older fencing token
// than the last one it has seen.
diesel::table! {
    fenced (id) {
        id -> Integer,
        token -> BigInt,
        value -> Text,
    }
}

const LONG: Duration = Duration::from_secs(5);

fn is_not_owner(result: &Result<(), Error>, lease: &Lease) -> bool {
    matches!(result, Err(Error::NotLeaseOwner { name, token })
        if name == lease.name() && *token == lease.token())
}

/// An error type of the caller's own, as closures passed to `with_lease` have.
#[derive(Debug)]
enum AppError {
    Lease(Error),
    Boom,
}

impl From<Error> for AppError {
    fn from(error: Error) -> Self {
        AppError::Lease(error)
    }
}

on_every_backend! {
    fn lease_rows(conn: &mut Conn) -> Vec<(String, i64)> {
        diesel_claim_leases::table
            .select((diesel_claim_leases::name, diesel_claim_leases::token))
            .order(diesel_claim_leases::name)
            .load(conn)
            .unwrap()
    }

    fn acquire(conn: &mut Conn, name: &str, ttl: Duration) -> Option<Lease> {
        Lease::acquire(conn, name, ttl).unwrap()
    }

    /// "Reserve `name` if free": check, then insert — racy unless something
    /// serializes it. The sleep widens the window between check and insert.
    fn reserve(conn: &mut Conn, name: &str, holder: i32) -> QueryResult<bool> {
        let taken: i64 = reserved_names::table
            .filter(reserved_names::name.eq(name))
            .count()
            .get_result(conn)?;
        if taken > 0 {
            return Ok(false);
        }
        thread::sleep(Duration::from_millis(2));
        diesel::insert_into(reserved_names::table)
            .values((reserved_names::name.eq(name), reserved_names::holder.eq(holder)))
            .execute(conn)?;
        Ok(true)
    }

    /// Scenario 16. Eight clients hammer one name for two seconds; each critical
    /// section checks nobody else is inside and logs its interval and token.
    /// Without the lease the sections overlap at once (see the control at the
    /// end, which runs the same loop unguarded and must observe overlaps).
    #[test]
    fn mutual_exclusion() {
        const THREADS: usize = 8;
        let (_db, pool) = test_db(THREADS as u32);
        let holders = AtomicU32::new(0);
        let violations = AtomicU32::new(0);
        let sections = Mutex::new(Vec::new());
        let errors = Mutex::new(Vec::new());
        let deadline = Instant::now() + Duration::from_secs(2);
        let per_thread: Vec<u32> = thread::scope(|scope| {
            let workers: Vec<_> = (0..THREADS)
                .map(|_| {
                    scope.spawn(|| {
                        let mut pooled = pool.get().unwrap();
                        let conn: &mut Conn = &mut pooled;
                        let mut acquired = 0;
                        while Instant::now() < deadline {
                            let held = with_lease(conn, "mutex", LONG, |_, lease| {
                                if holders.fetch_add(1, SeqCst) != 0 {
                                    violations.fetch_add(1, SeqCst);
                                }
                                let start = Instant::now();
                                thread::sleep(Duration::from_millis(1));
                                let end = Instant::now();
                                holders.fetch_sub(1, SeqCst);
                                sections.lock().unwrap().push((start, end, lease.token()));
                                Ok::<_, Error>(())
                            });
                            // Errors are collected rather than unwrapped, so a broken
                            // lease shows up as the violations it causes.
                            match held {
                                Ok(Some(())) => acquired += 1,
                                Ok(None) => thread::sleep(Duration::from_micros(200)),
                                Err(error) => errors.lock().unwrap().push(error.to_string()),
                            }
                        }
                        acquired
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        let total: u32 = per_thread.iter().sum();
        println!("mutual exclusion: {total} acquisitions in 2 s, per client {per_thread:?}");
        assert_eq!(violations.load(SeqCst), 0, "two holders were inside at once");
        let errors = errors.into_inner().unwrap();
        assert!(errors.is_empty(), "{} errors, the first: {:?}", errors.len(), errors.first());
        assert!(total >= 50, "only {total} acquisitions in 2 s");

        // The logged critical sections do not overlap, and their tokens increase
        // in time order without gaps: failed acquisitions do not consume tokens.
        let mut sections = sections.into_inner().unwrap();
        sections.sort_by_key(|&(start, _, _)| start);
        assert_eq!(sections.len(), total as usize);
        for pair in sections.windows(2) {
            let ((_, end, token), (start, _, next_token)) = (pair[0], pair[1]);
            assert!(end <= start, "critical sections of tokens {token} and {next_token} overlap");
        }
        let tokens: Vec<i64> = sections.iter().map(|&(_, _, token)| token).collect();
        assert_eq!(tokens, (1..=i64::from(total)).collect::<Vec<_>>());

        // Teeth: the same loop without the lease (a database round trip instead)
        // has several clients inside at once.
        let overlaps = AtomicU32::new(0);
        let deadline = Instant::now() + Duration::from_millis(300);
        thread::scope(|scope| {
            for _ in 0..THREADS {
                scope.spawn(|| {
                    let mut conn = pool.get().unwrap();
                    while Instant::now() < deadline {
                        diesel::sql_query("SELECT 1").execute(&mut conn).unwrap();
                        if holders.fetch_add(1, SeqCst) != 0 {
                            overlaps.fetch_add(1, SeqCst);
                        }
                        thread::sleep(Duration::from_millis(1));
                        holders.fetch_sub(1, SeqCst);
                    }
                });
            }
        });
        println!("control without the lease: {} overlaps in 300 ms", overlaps.load(SeqCst));
        assert!(overlaps.load(SeqCst) > 0, "the control saw no overlap: the test has no teeth");
    }

    /// Scenario 19. Tokens strictly increase per name across releases and
    /// expiries; a write guarded by an old token is rejected.
    #[test]
    fn fencing_tokens_increase_across_release_and_expiry() {
        let (_db, pool) = test_db(2);
        let mut a = pool.get().unwrap();
        let mut b = pool.get().unwrap();

        let mut tokens = Vec::new();
        for _ in 0..5 {
            let lease = acquire(&mut a, "fence", LONG).expect("free lease");
            assert_eq!(lease.name(), "fence");
            tokens.push(lease.token());
            lease.release(&mut a).unwrap();
        }
        assert_eq!(tokens, vec![1, 2, 3, 4, 5]);

        // A holder that expires without releasing: the next one gets a higher token.
        let stale = acquire(&mut a, "fence", Duration::from_millis(50)).unwrap();
        assert_eq!(stale.token(), 6);
        thread::sleep(Duration::from_millis(100));
        let fresh = acquire(&mut b, "fence", LONG).expect("expired lease is free");
        assert!(fresh.token() > stale.token());
        assert_eq!(fresh.token(), 7);

        // Independent names have independent counters.
        let other = acquire(&mut b, "another name", LONG).unwrap();
        assert_eq!(other.token(), 1);

        // Fencing a downstream write: the resource keeps the highest token seen.
        a.batch_execute(
            "CREATE TABLE fenced (id INTEGER PRIMARY KEY, token BIGINT NOT NULL, value TEXT NOT NULL)",
        )
        .unwrap();
        diesel::insert_into(fenced::table)
            .values((fenced::id.eq(1), fenced::token.eq(0), fenced::value.eq("initial")))
            .execute(&mut a)
            .unwrap();
        let fenced_write = |conn: &mut Conn, lease: &Lease, value: &str| -> usize {
            diesel::update(fenced::table.filter(fenced::id.eq(1)).filter(fenced::token.le(lease.token())))
                .set((fenced::token.eq(lease.token()), fenced::value.eq(value)))
                .execute(conn)
                .unwrap()
        };
        assert_eq!(fenced_write(&mut b, &fresh, "by the new holder"), 1);
        assert_eq!(fenced_write(&mut a, &stale, "by the stale holder"), 0);
        let value: String = fenced::table.select(fenced::value).first(&mut a).unwrap();
        assert_eq!(value, "by the new holder");

        let rows = lease_rows(&mut a);
        assert_eq!(rows, vec![("another name".to_owned(), 1), ("fence".to_owned(), 7)]);
    }

    /// Scenario 17. A holder that dies (never releases) is replaced once its TTL
    /// has passed by the database clock, not before.
    #[test]
    fn dead_holder_is_replaced_after_its_ttl() {
        let (_db, pool) = test_db(2);
        let mut dead = pool.get().unwrap();
        let mut next = pool.get().unwrap();
        let ttl = Duration::from_millis(300);

        let lease = acquire(&mut dead, "ttl", ttl).expect("free lease");
        let acquired_at = Instant::now();
        drop(dead); // The holder "dies" without releasing.
        assert!(acquire(&mut next, "ttl", LONG).is_none(), "taken over before its TTL");

        let successor = loop {
            if let Some(successor) = acquire(&mut next, "ttl", LONG) {
                break successor;
            }
            assert!(acquired_at.elapsed() < Duration::from_secs(3), "never replaced");
            thread::sleep(Duration::from_millis(5));
        };
        let delay = acquired_at.elapsed();
        println!("dead holder with a 300 ms TTL replaced after {delay:?}");
        assert!(delay >= Duration::from_millis(250), "replaced after only {delay:?}");
        assert!(delay < Duration::from_millis(1000), "replaced only after {delay:?}");
        assert_eq!(successor.token(), lease.token() + 1);
    }

    /// Inside a transaction a lease would be invisible to others until commit,
    /// and a rollback would hand its fencing token out again: refused.
    #[test]
    fn leases_are_refused_inside_a_transaction() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        let lease = acquire(&mut conn, "outside", LONG).expect("free lease");
        conn.transaction(|conn| {
            let inside = Lease::acquire(conn, "inside", LONG);
            assert!(matches!(inside, Err(Error::InvalidArgument(_))), "{inside:?}");
            let ran = with_lease(conn, "inside", LONG, |_, _| Ok::<_, Error>(()));
            assert!(matches!(ran, Err(Error::InvalidArgument(_))), "{ran:?}");
            let renewed = lease.renew(conn, LONG);
            assert!(matches!(renewed, Err(Error::InvalidArgument(_))), "{renewed:?}");
            let released = lease.clone().release(conn);
            assert!(matches!(released, Err(Error::InvalidArgument(_))), "{released:?}");
            Ok::<_, Error>(())
        })
        .unwrap();
        assert_eq!(lease_rows(&mut conn), [("outside".to_owned(), 1)]);
        lease.release(&mut conn).unwrap();
    }

    /// Waiting for a lease: `LeaseHeld` once patience runs out, the lease as soon
    /// as its holder releases it.
    #[test]
    fn acquire_within_waits_for_the_holder() {
        let (_db, pool) = test_db(2);
        let mut holder = pool.get().unwrap();
        let mut waiter = pool.get().unwrap();
        let held = acquire(&mut holder, "report", LONG).expect("free lease");

        let started = Instant::now();
        let impatient = Lease::acquire_within(&mut waiter, "report", LONG, Duration::from_millis(50));
        assert!(matches!(&impatient, Err(Error::LeaseHeld { name }) if name == "report"), "{impatient:?}");
        assert!(started.elapsed() >= Duration::from_millis(50));

        let (released_tx, released_rx) = std::sync::mpsc::channel();
        let releaser = thread::spawn(move || {
            thread::sleep(Duration::from_millis(150));
            // Taken before the release: the waiter cannot get the lease earlier.
            let releasing_at = Instant::now();
            held.release(&mut holder).unwrap();
            released_tx.send(releasing_at).unwrap();
        });
        let lease = Lease::acquire_within(&mut waiter, "report", LONG, Duration::from_secs(5)).unwrap();
        let acquired_at = Instant::now();
        releaser.join().unwrap();
        let released_at = released_rx.recv().unwrap();
        assert!(acquired_at >= released_at, "acquired before the release");
        // Polling catches the release within its longest pause (100 ms).
        println!("acquired {:?} after the release", acquired_at - released_at);
        assert!(acquired_at - released_at < Duration::from_millis(500));
        lease.release(&mut waiter).unwrap();
    }

    /// Scenario 18. An expired holder's renew and release fail typed, whether or
    /// not someone took the lease since; the new holder is unaffected.
    #[test]
    fn only_the_owner_can_renew_or_release() {
        let (_db, pool) = test_db(2);
        let mut a = pool.get().unwrap();
        let mut b = pool.get().unwrap();
        let short = Duration::from_millis(50);

        // Expired, nobody took it since: renew still fails.
        let expired = acquire(&mut a, "owner", short).unwrap();
        thread::sleep(Duration::from_millis(100));
        let renewed = expired.renew(&mut a, LONG);
        assert!(is_not_owner(&renewed, &expired), "{renewed:?}");

        // A chain of holders that all expired, then B takes over for good.
        let mut stale = vec![expired];
        for _ in 0..3 {
            let lease = acquire(&mut a, "owner", short).expect("expired lease is free");
            thread::sleep(Duration::from_millis(100));
            stale.push(lease);
        }
        let holder = acquire(&mut b, "owner", LONG).expect("expired lease is free");

        let mut foreign_successes = 0;
        for lease in stale {
            let renewed = lease.renew(&mut a, LONG);
            assert!(is_not_owner(&renewed, &lease), "{renewed:?}");
            foreign_successes += usize::from(renewed.is_ok());
            let copy = lease.clone();
            let released = lease.release(&mut a);
            assert!(is_not_owner(&released, &copy), "{released:?}");
            foreign_successes += usize::from(released.is_ok());
        }
        assert_eq!(foreign_successes, 0);

        // B still holds it: nobody else can acquire it, and B can renew and release.
        assert!(acquire(&mut a, "owner", LONG).is_none());
        holder.renew(&mut b, LONG).unwrap();
        assert!(acquire(&mut a, "owner", LONG).is_none());
        let copy = holder.clone();
        holder.release(&mut b).unwrap();

        // Released means gone: a second release or a renew by the same token fails.
        let again = copy.clone().release(&mut b);
        assert!(is_not_owner(&again, &copy), "{again:?}");
        let renewed = copy.renew(&mut b, LONG);
        assert!(is_not_owner(&renewed, &copy), "{renewed:?}");
        let next = acquire(&mut a, "owner", LONG).expect("released lease is free");
        assert_eq!(next.token(), copy.token() + 1);

        // Renewing really extends: a 200 ms lease renewed for 5 s outlives 200 ms.
        let renewing = acquire(&mut b, "renewed", Duration::from_millis(200)).unwrap();
        renewing.renew(&mut b, LONG).unwrap();
        thread::sleep(Duration::from_millis(300));
        assert!(acquire(&mut a, "renewed", LONG).is_none(), "renewal did not extend the lease");
        renewing.release(&mut b).unwrap();
    }

    /// Scenario 20. C × K concurrent "reserve name if free" on a table without a
    /// UNIQUE constraint: under the lease, exactly one row per name. The control
    /// runs the same check-then-insert without the lease and gets duplicates.
    #[test]
    fn unique_name_reservation() {
        const CLIENTS: usize = 8;
        const ATTEMPTS: usize = 20;
        const NAMES: [&str; 3] = ["alice", "bob", "carol"];
        let (_db, pool) = test_db(CLIENTS as u32 + 1);
        pool.get()
            .unwrap()
            .batch_execute("CREATE TABLE reserved_names (name TEXT NOT NULL, holder INTEGER NOT NULL)")
            .unwrap();

        // Every client checks out its connection before any starts, so a failure
        // there panics here instead of leaving the others waiting.
        let conns: Vec<_> = (0..CLIENTS).map(|_| pool.get().unwrap()).collect();
        let wins = AtomicU32::new(0);
        thread::scope(|scope| {
            for (client, mut pooled) in conns.into_iter().enumerate() {
                let wins = &wins;
                scope.spawn(move || {
                    let conn: &mut Conn = &mut pooled;
                    for attempt in 0..ATTEMPTS {
                        let name = NAMES[(client + attempt) % NAMES.len()];
                        let lease_name = format!("signup:{name}");
                        let won = loop {
                            let outcome = with_lease(conn, &lease_name, LONG, |conn, _| {
                                reserve(conn, name, client as i32).map_err(Error::from)
                            });
                            match outcome.unwrap() {
                                Some(won) => break won,
                                None => thread::sleep(Duration::from_micros(200)),
                            }
                        };
                        if won {
                            wins.fetch_add(1, SeqCst);
                        }
                    }
                });
            }
        });
        let mut conn = pool.get().unwrap();
        let names: Vec<String> = reserved_names::table.select(reserved_names::name).load(&mut conn).unwrap();
        let mut per_name: HashMap<String, usize> = HashMap::new();
        for name in names {
            *per_name.entry(name).or_default() += 1;
        }
        println!("{} reservations succeeded of {}; rows per name {per_name:?}", wins.load(SeqCst), CLIENTS * ATTEMPTS);
        assert_eq!(wins.load(SeqCst), NAMES.len() as u32);
        assert_eq!(per_name.len(), NAMES.len());
        assert!(per_name.values().all(|&rows| rows == 1), "duplicate names: {per_name:?}");

        // Teeth: without the lease, clients started together all pass the check.
        // Each round starts at a fixed instant (no barrier a panicking client
        // could leave the others waiting at).
        let conns: Vec<_> = (0..CLIENTS).map(|_| pool.get().unwrap()).collect();
        let t0 = Instant::now() + Duration::from_millis(50);
        thread::scope(|scope| {
            for (client, mut pooled) in conns.into_iter().enumerate() {
                scope.spawn(move || {
                    for (round, name) in ["control:alice", "control:bob", "control:carol"].into_iter().enumerate() {
                        let start = t0 + Duration::from_millis(100) * round as u32;
                        thread::sleep(start.saturating_duration_since(Instant::now()));
                        reserve(&mut pooled, name, client as i32).unwrap();
                    }
                });
            }
        });
        let duplicated: i64 = reserved_names::table
            .filter(reserved_names::name.like("control:%"))
            .count()
            .get_result(&mut conn)
            .unwrap();
        println!("control without the lease: {duplicated} rows for 3 names");
        assert!(duplicated > 3, "the control made no duplicate: the test has no teeth");
    }

    /// Bad input: bad names and TTLs are refused before any SQL; hostile names
    /// are stored literally and leave the schema alone.
    #[test]
    fn bad_names_and_ttls_are_invalid_arguments() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        let invalid = |result: Result<Option<Lease>, Error>| {
            matches!(result, Err(Error::InvalidArgument(_)))
        };

        let too_long_multibyte = "é".repeat(128); // 256 bytes, 128 characters
        let bad_names = [
            String::new(),
            "a\0b".to_owned(),
            "\0".to_owned(),
            "x".repeat(MAX_NAME_LEN + 1),
            too_long_multibyte,
            "x".repeat(10_000),
        ];
        for name in &bad_names {
            let result = Lease::acquire(&mut conn, name, LONG);
            let message = result.as_ref().map(|_| ()).unwrap_err().to_string();
            assert!(invalid(result), "name of {} bytes: {message}", name.len());
            assert!(message.len() < 200, "the error repeats the name: {message}");
        }
        for ttl in [Duration::ZERO, MAX_TTL + Duration::from_nanos(1), MAX_TTL * 2, Duration::MAX] {
            assert!(invalid(Lease::acquire(&mut conn, "ttl", ttl)), "ttl {ttl:?}");
        }
        let mut ran = false;
        let outcome = with_lease(&mut conn, "", LONG, |_, _| {
            ran = true;
            Ok::<_, Error>(())
        });
        assert!(matches!(outcome, Err(Error::InvalidArgument(_))) && !ran);
        assert!(lease_rows(&mut conn).is_empty(), "a rejected call wrote a row");

        // Renewing with a bad TTL is refused too, and leaves the lease alone.
        let lease = acquire(&mut conn, "ttl", LONG).unwrap();
        for ttl in [Duration::ZERO, MAX_TTL + Duration::from_secs(1)] {
            assert!(matches!(lease.renew(&mut conn, ttl), Err(Error::InvalidArgument(_))));
        }
        lease.renew(&mut conn, MAX_TTL).unwrap();
        lease.release(&mut conn).unwrap();
        // The smallest TTL is accepted (one microsecond).
        let brief = acquire(&mut conn, "brief", Duration::from_nanos(1)).expect("tiny ttl accepted");
        thread::sleep(Duration::from_millis(5));
        assert!(acquire(&mut conn, "brief", LONG).unwrap().token() > brief.token());

        let limit = format!("{}é", "x".repeat(MAX_NAME_LEN - 2)); // exactly 255 bytes
        let hostile = [
            "'; DROP TABLE diesel_claim_leases; --",
            "Robert'); DROP TABLE orders; --",
            "\"quoted\" 'single' `back`",
            "%",
            "_",
            "\\",
            "$1 ? :name",
            "名前🔒 ünïcödé",
            " padded ",
            limit.as_str(),
        ];
        for name in hostile {
            let lease = acquire(&mut conn, name, LONG).unwrap_or_else(|| panic!("{name:?} is held"));
            assert_eq!(lease.name(), name);
            assert_eq!(lease.token(), 1, "{name:?} shares a counter with another name");
            assert!(acquire(&mut conn, name, LONG).is_none(), "{name:?} acquired twice");
        }
        let stored: Vec<String> = diesel_claim_leases::table
            .select(diesel_claim_leases::name)
            .filter(diesel_claim_leases::name.ne_all(["ttl", "brief"]))
            .load(&mut conn)
            .unwrap();
        let mut expected: Vec<String> = hostile.iter().map(|name| name.to_string()).collect();
        let mut stored_sorted = stored;
        stored_sorted.sort();
        expected.sort();
        assert_eq!(stored_sorted, expected);

        // The schema is unchanged: every table is still there.
        let counts = [
            diesel_claim_leases::table.count().get_result::<i64>(&mut conn),
            orders::table.count().get_result(&mut conn),
            customers::table.count().get_result(&mut conn),
            outbox::table.count().get_result(&mut conn),
            accounts::table.count().get_result(&mut conn),
        ];
        assert!(counts.iter().all(Result::is_ok), "{counts:?}");
        assert_eq!(counts[0].as_ref().unwrap(), &(hostile.len() as i64 + 2));
    }

    /// The TTL of the kept-alive leases below, renewed every third of it: a
    /// renewal may come up to two thirds of it late before the lease expires.
    const KEPT_TTL: Duration = Duration::from_millis(600);

    /// `with_lease_kept_alive`: while the closure runs four TTLs long, the
    /// lease is renewed on the second connection and nobody else can take it;
    /// it is released afterwards. (Without the renewing, another holder takes
    /// it after one TTL, as `with_lease_outcomes` shows.)
    #[test]
    fn a_kept_lease_outlives_its_ttl_while_the_closure_runs() {
        let (_db, pool) = test_db(4);
        let (mut pooled, mut other) = (pool.get().unwrap(), pool.get().unwrap());
        let (conn, other): (&mut Conn, &mut Conn) = (&mut pooled, &mut other);
        let started = Instant::now();
        let kept = with_lease_kept_alive(conn, pool.get().unwrap(), "report", KEPT_TTL, |_, lease| {
            let mut taken_by_others = 0;
            while started.elapsed() < 4 * KEPT_TTL {
                thread::sleep(KEPT_TTL / 6);
                lease.ensure_held()?;
                taken_by_others += u32::from(acquire(other, "report", LONG).is_some());
            }
            Ok::<_, Error>((lease.token(), taken_by_others))
        });
        assert_eq!(kept.unwrap(), Some((1, 0)));
        let next = acquire(other, "report", LONG).expect("released afterwards");
        assert_eq!(next.token(), 2);
        // Held elsewhere: the closure does not run.
        let skipped = with_lease_kept_alive(conn, pool.get().unwrap(), "report", KEPT_TTL, |_, _| Ok::<_, Error>(()));
        assert!(matches!(skipped, Ok(None)), "{skipped:?}");
        next.release(other).unwrap();
    }

    /// When the lease is taken from it (here the row's token moves on, as
    /// when another holder takes an expired lease), the next renewal fails
    /// and the closure is told at once: `is_lost`, `ensure_held` is
    /// `NotLeaseOwner`, and so is the call.
    #[test]
    fn a_kept_lease_tells_the_closure_it_was_lost() {
        let (_db, pool) = test_db(3);
        let (mut pooled, mut other) = (pool.get().unwrap(), pool.get().unwrap());
        let (conn, other): (&mut Conn, &mut Conn) = (&mut pooled, &mut other);
        let mut told_after = None;
        let lost = with_lease_kept_alive(conn, pool.get().unwrap(), "report", KEPT_TTL, |_, lease| {
            assert!(!lease.is_lost());
            diesel::update(diesel_claim_leases::table.find("report"))
                .set(diesel_claim_leases::token.eq(diesel_claim_leases::token + 1))
                .execute(other)?;
            let taken = Instant::now();
            while !lease.is_lost() {
                assert!(taken.elapsed() < 4 * KEPT_TTL, "the closure was never told");
                thread::sleep(Duration::from_millis(5));
            }
            told_after = Some(taken.elapsed());
            lease.ensure_held()?;
            Ok::<_, Error>("went on without the lease")
        });
        assert!(matches!(&lost, Err(Error::NotLeaseOwner { name, token: 1 }) if name == "report"), "{lost:?}");
        // Told at the first renewal after the takeover.
        assert!(told_after.unwrap() <= KEPT_TTL / 3 + Duration::from_millis(300), "{told_after:?}");
    }

    /// A renewal that hangs (here on the lease's row, locked by another
    /// transaction) keeps nothing "held": the closure is told the lease is
    /// lost once its TTL has passed on the local clock since it was taken,
    /// not when the renewal comes back.
    #[test]
    fn a_kept_lease_is_lost_at_its_ttl_while_a_renewal_hangs() {
        let (_db, pool) = test_db(3);
        let (mut pooled, mut other) = (pool.get().unwrap(), pool.get().unwrap());
        let (conn, other): (&mut Conn, &mut Conn) = (&mut pooled, &mut other);
        let taking = Instant::now();
        let lost = with_lease_kept_alive(conn, pool.get().unwrap(), "report", KEPT_TTL, |_, lease| {
            // Every renewal waits on the row (on SQLite, on the write lock)
            // until this transaction ends.
            let (held_at_half, told_after) = hang_renewals(other, || {
                thread::sleep((KEPT_TTL / 2).saturating_sub(taking.elapsed()));
                let held_at_half = !lease.is_lost();
                while !lease.is_lost() && taking.elapsed() < 3 * KEPT_TTL {
                    thread::sleep(Duration::from_millis(2));
                }
                (held_at_half, lease.is_lost().then(|| taking.elapsed()))
            });
            assert!(held_at_half, "lost before its TTL");
            let told_after = told_after.expect("not told three TTLs after the lease was taken");
            // Its TTL less the thousandth kept for the clocks' drift.
            assert!(told_after >= KEPT_TTL - KEPT_TTL / 1000, "told {told_after:?} after");
            assert!(told_after <= KEPT_TTL + Duration::from_millis(100), "told {told_after:?} after");
            lease.ensure_held()?;
            Ok::<_, Error>(())
        });
        assert!(matches!(&lost, Err(Error::NotLeaseOwner { name, token: 1 }) if name == "report"), "{lost:?}");
    }

    /// Runs `f` while a transaction on `conn` keeps the lease table's rows
    /// from being written: it has updated them (on SQLite, it holds the
    /// database's write lock).
    fn hang_renewals<T>(conn: &mut Conn, f: impl FnOnce() -> T) -> T {
        conn.batch_execute(if BACKEND == "sqlite" { "BEGIN IMMEDIATE" } else { "BEGIN" }).unwrap();
        conn.batch_execute("UPDATE diesel_claim_leases SET token = token").unwrap();
        let done = f();
        conn.batch_execute("ROLLBACK").unwrap();
        done
    }

    /// `with_lease`: skipped when held, releases after an error and after a
    /// panic, and reports a lease that expired while the closure ran.
    #[test]
    fn with_lease_outcomes() {
        let (_db, pool) = test_db(2);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        let mut other_pooled = pool.get().unwrap();
        let other: &mut Conn = &mut other_pooled;

        // Acquired: the closure sees the lease and its value is returned.
        let seen = with_lease(conn, "job", LONG, |_, lease| Ok::<_, Error>((lease.name().to_owned(), lease.token())));
        assert_eq!(seen.unwrap(), Some(("job".to_owned(), 1)));
        // ... and released afterwards.
        let held = acquire(other, "job", LONG).expect("released after success");

        // Held elsewhere: Ok(None), the closure does not run.
        let mut ran = false;
        let skipped = with_lease(conn, "job", LONG, |_, _| {
            ran = true;
            Ok::<_, Error>(())
        });
        assert!(matches!(skipped, Ok(None)) && !ran);
        held.release(other).unwrap();

        // The closure's own error is returned as it is, and the lease released.
        let failed = with_lease(conn, "job", LONG, |_, _| Err::<(), _>(AppError::Boom));
        assert!(matches!(failed, Err(AppError::Boom)), "{failed:?}");
        acquire(other, "job", LONG).expect("released after an error").release(other).unwrap();

        // A panic propagates, and the lease is released on the way.
        let panicked = panic::catch_unwind(AssertUnwindSafe(|| {
            with_lease(conn, "job", LONG, |_, _| -> Result<(), Error> { panic!("boom in the critical section") })
        }));
        let payload = panicked.expect_err("the panic was swallowed");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"boom in the critical section"));
        let after_panic = acquire(other, "job", LONG).expect("released after a panic");
        after_panic.release(other).unwrap();

        // Expired while the closure ran and taken by another holder meanwhile:
        // NotLeaseOwner even though the closure succeeded; the new holder keeps it.
        let mut successor = None;
        let expired = with_lease(conn, "job", Duration::from_millis(50), |_, lease| {
            thread::sleep(Duration::from_millis(120));
            successor = acquire(other, "job", LONG);
            Ok::<_, Error>(lease.token())
        });
        let successor = successor.expect("expired lease was not free");
        match expired {
            Err(Error::NotLeaseOwner { name, token }) => {
                assert_eq!(name, "job");
                assert_eq!(token, successor.token() - 1);
            }
            other => panic!("expected NotLeaseOwner, got {other:?}"),
        }
        assert!(acquire(conn, "job", LONG).is_none(), "the successor lost its lease");
        successor.renew(other, LONG).unwrap();
        successor.release(other).unwrap();

        // Expired (nobody took it) with a closure of the caller's error type: the
        // not-owner error arrives converted.
        let expired = with_lease(conn, "job", Duration::from_millis(50), |_, _| {
            thread::sleep(Duration::from_millis(120));
            Ok::<_, AppError>(())
        });
        assert!(matches!(expired, Err(AppError::Lease(Error::NotLeaseOwner { .. }))), "{expired:?}");
    }
}

/// The database clock decides on SQLite: the stored expiry is SQLite's own
/// `julianday('now')` plus the TTL.
#[cfg(feature = "sqlite")]
mod sqlite_only {
    use super::*;
    use diesel::sql_types::BigInt;

    #[derive(QueryableByName)]
    struct Remaining {
        #[diesel(sql_type = BigInt)]
        micros: i64,
    }

    #[test]
    fn expiry_is_computed_by_the_database_clock() {
        let db = testkit::SqliteTestDb::new();
        let pool = testkit::sqlite_pool(&db.url, 1);
        let mut conn = pool.get().unwrap();
        testkit::fixtures::create_schema(&mut conn, testkit::fixtures::SQLITE_SCHEMA);
        let _lease = Lease::acquire(&mut conn, "clock", Duration::from_secs(10))
            .unwrap()
            .unwrap();
        let remaining: Remaining = diesel::sql_query(
            "SELECT expires_at - CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER) AS micros \
             FROM diesel_claim_leases WHERE name = 'clock'",
        )
        .get_result(&mut conn)
        .unwrap();
        println!(
            "sqlite: lease of 10 s expires in {} µs by the database clock",
            remaining.micros
        );
        assert!(
            (9_500_000..=10_000_000).contains(&remaining.micros),
            "{}",
            remaining.micros
        );
    }
}

#[cfg(feature = "postgres")]
mod pg_only {
    use super::*;
    use diesel::sql_types::{Double, Text};
    use diesel_claim::advisory;
    use testkit::fixtures::{create_schema, POSTGRES_SCHEMA};
    use testkit::{pg_pool, PgTestDb};

    type Pool = diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<PgConnection>>;

    fn test_db(size: u32) -> (PgTestDb, Pool) {
        let db = PgTestDb::new();
        let pool = pg_pool(&db.url, size);
        create_schema(&mut pool.get().unwrap(), POSTGRES_SCHEMA);
        (db, pool)
    }

    /// The TTL of the kept-alive lease below.
    const STALLED_TTL: Duration = Duration::from_millis(600);

    /// A renewal that does not come back (its statement sleeps, as one on a
    /// dead link waits): the closure is told the lease is lost at its TTL,
    /// and once it ends the call returns within the bound its documentation
    /// gives (a third of the TTL), releasing on `conn`, while the renewal
    /// finishes later on its own and cannot revive the lease.
    #[test]
    fn a_kept_lease_call_returns_while_a_renewal_is_stuck() {
        let (_db, pool) = test_db(3);
        let (mut conn, mut other) = (pool.get().unwrap(), pool.get().unwrap());
        // Statements changing leases sleep 2 s on the renewer's session only.
        conn.batch_execute(
            "CREATE FUNCTION stall_renewals() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
                 IF current_setting('application_name') = 'stalled renewer' THEN PERFORM pg_sleep(2); END IF;
                 RETURN NULL;
             END $$;
             CREATE TRIGGER stall_renewals BEFORE UPDATE ON diesel_claim_leases
                 FOR EACH STATEMENT EXECUTE FUNCTION stall_renewals();",
        )
        .unwrap();
        let mut renewer = pool.get().unwrap();
        renewer
            .batch_execute("SET application_name = 'stalled renewer'")
            .unwrap();
        let taking = Instant::now();
        let (mut told_after, mut ended) = (None, None);
        let outcome =
            with_lease_kept_alive(&mut *conn, renewer, "report", STALLED_TTL, |_, lease| {
                while !lease.is_lost() && taking.elapsed() < 3 * STALLED_TTL {
                    thread::sleep(Duration::from_millis(2));
                }
                told_after = Some(taking.elapsed());
                ended = Some(Instant::now());
                Ok::<_, Error>(())
            });
        let returned_after = ended.unwrap().elapsed();
        // Released, or found expired already: the database's TTL ends a
        // little after the local one.
        assert!(
            matches!(outcome, Ok(Some(())) | Err(Error::NotLeaseOwner { .. })),
            "{outcome:?}"
        );
        let told_after = told_after.unwrap();
        assert!(
            told_after <= STALLED_TTL + Duration::from_millis(100),
            "told {told_after:?} after"
        );
        assert!(
            returned_after <= STALLED_TTL / 3 + Duration::from_millis(150),
            "returned {returned_after:?} after"
        );
        // Released: free at once; the stuck renewal, refused, leaves it so.
        let next = Lease::acquire(&mut *other, "report", LONG)
            .unwrap()
            .expect("released");
        thread::sleep(Duration::from_secs(2));
        next.renew(&mut *other, LONG).unwrap();
    }

    #[test]
    fn advisory_keys_are_stable_fnv1a() {
        assert_eq!(advisory::key(""), 0xcbf2_9ce4_8422_2325_u64 as i64);
        assert_eq!(advisory::key("a"), 0xaf63_dc4c_8601_ec8c_u64 as i64);
        assert_eq!(advisory::key("foobar"), 0x8594_4171_f739_67e8_u64 as i64);
        assert_eq!(advisory::key("signup:alice"), advisory::key("signup:alice"));
        assert_ne!(advisory::key("signup:alice"), advisory::key("signup:alicf"));
    }

    #[test]
    fn advisory_locks_need_a_transaction() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        assert!(matches!(
            advisory::try_lock(&mut conn, "x"),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            advisory::lock(&mut conn, "x"),
            Err(Error::InvalidArgument(_))
        ));
        // Inside a transaction (and a nested one) they work, and are re-entrant.
        conn.transaction::<_, Error, _>(|conn| {
            assert!(advisory::try_lock(conn, "x")?);
            advisory::lock(conn, "x")?;
            conn.transaction::<_, Error, _>(|conn| {
                assert!(advisory::try_lock(conn, "x")?);
                Ok(())
            })
        })
        .unwrap();
    }

    #[test]
    fn advisory_locks_exclude_other_sessions_until_commit() {
        let (_db, pool) = test_db(2);
        let mut a = pool.get().unwrap();
        let mut b = pool.get().unwrap();

        a.transaction::<_, Error, _>(|a| {
            assert!(advisory::try_lock(a, "adv")?);
            // B cannot take it, neither at once nor within its lock_timeout.
            let taken = b.transaction::<_, Error, _>(|b| advisory::try_lock(b, "adv"));
            assert!(!taken.unwrap());
            let waited = b.transaction::<_, Error, _>(|b| {
                diesel::sql_query("SET LOCAL lock_timeout = '100ms'").execute(b)?;
                advisory::lock(b, "adv")
            });
            assert!(matches!(waited, Err(Error::LockNotAvailable)), "{waited:?}");
            // Other names are independent.
            assert!(b
                .transaction::<_, Error, _>(|b| advisory::try_lock(b, "other"))
                .unwrap());
            Ok(())
        })
        .unwrap();
        // Committed: the lock is gone.
        assert!(b
            .transaction::<_, Error, _>(|b| advisory::try_lock(b, "adv"))
            .unwrap());

        // Rolled back: gone too.
        let _ = a.transaction::<(), Error, _>(|a| {
            assert!(advisory::try_lock(a, "adv")?);
            Err(Error::NotFound)
        });
        assert!(b
            .transaction::<_, Error, _>(|b| advisory::try_lock(b, "adv"))
            .unwrap());

        // `lock` waits until the holder commits.
        let (locked, is_locked) = std::sync::mpsc::channel();
        let waited = thread::scope(|scope| {
            scope.spawn(|| {
                // Owned here, so that a panic before sending drops it.
                let locked = locked;
                a.transaction::<_, Error, _>(|a| {
                    advisory::lock(a, "adv")?;
                    locked.send(()).unwrap();
                    thread::sleep(Duration::from_millis(300));
                    Ok(())
                })
                .unwrap();
            });
            // Fails instead of hanging if the holder panicked before sending.
            is_locked.recv().expect("the holder did not take the lock");
            let started = Instant::now();
            b.transaction::<_, Error, _>(|b| advisory::lock(b, "adv"))
                .unwrap();
            started.elapsed()
        });
        println!("advisory lock waited {waited:?} for a holder that kept it 300 ms");
        assert!(
            waited >= Duration::from_millis(250),
            "lock returned after {waited:?}"
        );
    }

    #[derive(QueryableByName)]
    struct Remaining {
        #[diesel(sql_type = Double)]
        by_clock: f64,
    }

    fn remaining(conn: &mut PgConnection, name: &str) -> Remaining {
        diesel::sql_query(
            "SELECT EXTRACT(EPOCH FROM expires_at - clock_timestamp())::float8 AS by_clock \
             FROM diesel_claim_leases WHERE name = $1",
        )
        .bind::<Text, _>(name)
        .get_result(conn)
        .unwrap()
    }

    /// Scenario 17, the clock: the expiry is the server's `clock_timestamp()` plus
    /// the TTL, not the client's clock.
    #[test]
    fn expiry_is_computed_by_the_database_clock() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        let _lease = Lease::acquire(&mut conn, "clock", Duration::from_secs(10))
            .unwrap()
            .unwrap();
        let left = remaining(&mut conn, "clock");
        println!(
            "lease of 10 s expires in {:.4} s by the server clock",
            left.by_clock
        );
        assert!((9.5..=10.0).contains(&left.by_clock), "{}", left.by_clock);
    }
}

/// MySQL and MariaDB named locks (`GET_LOCK`).
#[cfg(feature = "mysql")]
mod mysql_only {
    use std::sync::atomic::AtomicBool;

    use super::mysql::test_db;
    use super::*;
    use diesel_claim::named_lock::{with_named_lock, MAX_NAME_CHARS};

    /// Held by one session, a named lock is refused to another, at once and
    /// after waiting, until it is released.
    #[test]
    fn named_locks_exclude_other_sessions_until_released() {
        let (_db, pool) = test_db(2);
        let (mut a, mut b) = (pool.get().unwrap(), pool.get().unwrap());
        let (at_once, after_waiting, waited) =
            with_named_lock(&mut *a, "nightly-report", Duration::ZERO, |_| {
                let at_once = with_named_lock(&mut *b, "nightly-report", Duration::ZERO, |_| {
                    Ok::<_, Error>(())
                })?;
                let started = Instant::now();
                let after_waiting = with_named_lock(
                    &mut *b,
                    "nightly-report",
                    Duration::from_millis(300),
                    |_| Ok::<_, Error>(()),
                )?;
                Ok::<_, Error>((at_once, after_waiting, started.elapsed()))
            })
            .unwrap()
            .expect("a free named lock is taken");
        assert_eq!((at_once, after_waiting), (None, None));
        assert!(waited >= Duration::from_millis(250), "{waited:?}");
        let now = with_named_lock(&mut *b, "nightly-report", Duration::ZERO, |_| {
            Ok::<_, Error>(7)
        });
        assert_eq!(now.unwrap(), Some(7), "released after the closure");
    }

    /// An error or a panic in the closure releases the lock too.
    #[test]
    fn errors_and_panics_release_the_named_lock() {
        let (_db, pool) = test_db(2);
        let (mut a, mut b) = (pool.get().unwrap(), pool.get().unwrap());
        let failed = with_named_lock(&mut *a, "n", Duration::ZERO, |_| {
            Err::<(), _>(Error::InvalidArgument("no".into()))
        });
        assert!(
            matches!(failed, Err(Error::InvalidArgument(_))),
            "{failed:?}"
        );
        let panicked = panic::catch_unwind(AssertUnwindSafe(|| {
            with_named_lock(&mut *a, "n", Duration::ZERO, |_| -> Result<(), Error> {
                panic!("boom")
            })
        }));
        assert!(panicked.is_err());
        let free = with_named_lock(&mut *b, "n", Duration::ZERO, |_| Ok::<_, Error>(()));
        assert_eq!(free.unwrap(), Some(()));
    }

    /// A lock the closure released itself is no longer held when the call
    /// releases it: the call says so rather than report success.
    #[test]
    fn a_named_lock_released_inside_the_closure_is_an_unexpected_outcome() {
        let (_db, pool) = test_db(2);
        let (mut a, mut b) = (pool.get().unwrap(), pool.get().unwrap());
        let released_early = with_named_lock(&mut *a, "n", Duration::ZERO, |conn| {
            diesel::sql_query("DO RELEASE_LOCK('n')").execute(conn)?;
            Ok::<_, Error>(())
        });
        assert!(
            matches!(&released_early, Err(Error::UnexpectedOutcome(m)) if m.contains("no longer held")),
            "{released_early:?}"
        );
        let free = with_named_lock(&mut *b, "n", Duration::ZERO, |_| Ok::<_, Error>(()));
        assert_eq!(free.unwrap(), Some(()));
    }

    /// Eight sessions on one name: critical sections never overlap.
    #[test]
    fn named_locks_are_mutually_exclusive() {
        let (_db, pool) = test_db(8);
        let inside = AtomicBool::new(false);
        let (entered, overlaps) = (AtomicU32::new(0), AtomicU32::new(0));
        thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    let mut conn = pool.get().unwrap();
                    for _ in 0..25 {
                        with_named_lock(&mut *conn, "counter", Duration::from_secs(10), |_| {
                            if inside.swap(true, SeqCst) {
                                overlaps.fetch_add(1, SeqCst);
                            }
                            entered.fetch_add(1, SeqCst);
                            thread::sleep(Duration::from_micros(200));
                            inside.store(false, SeqCst);
                            Ok::<_, Error>(())
                        })
                        .unwrap()
                        .expect("acquired within 10 s");
                    }
                });
            }
        });
        eprintln!(
            "named lock: {} critical sections, {} overlaps",
            entered.load(SeqCst),
            overlaps.load(SeqCst)
        );
        assert_eq!((entered.load(SeqCst), overlaps.load(SeqCst)), (200, 0));
    }

    #[test]
    fn bad_named_lock_names_are_invalid_arguments() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        for name in [String::new(), "x".repeat(MAX_NAME_CHARS + 1)] {
            let refused =
                with_named_lock(&mut *conn, &name, Duration::ZERO, |_| Ok::<_, Error>(()));
            assert!(
                matches!(refused, Err(Error::InvalidArgument(_))),
                "{refused:?}"
            );
        }
        let longest = "é".repeat(MAX_NAME_CHARS);
        let taken = with_named_lock(&mut *conn, &longest, Duration::ZERO, |_| Ok::<_, Error>(()));
        assert_eq!(taken.unwrap(), Some(()));
    }

    /// A syntax error at `SKIP LOCKED`, as servers without it report the claim's
    /// statement, is `Unsupported` (the real server's message, provoked here
    /// with a clause it does not accept twice).
    #[test]
    fn a_server_rejecting_skip_locked_is_unsupported() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        let raw = diesel::sql_query("SELECT 1 FROM DUAL FOR UPDATE SKIP LOCKED SKIP LOCKED")
            .execute(&mut *conn)
            .unwrap_err();
        assert!(matches!(Error::from(raw), Error::Unsupported(_)));
    }
}
