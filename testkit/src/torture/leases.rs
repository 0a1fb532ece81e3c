//! Lease scenarios on every backend: mutual exclusion (16), TTL (17), owner
//! check (18), fencing (19), unique name (20), kept-alive leases (23); and the
//! lease worker processes.

use std::thread;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_claim::{with_lease_kept_alive, Error, Lease};

use super::procs::{self, Fields};
use super::tables::{fenced, occupancy, reservations};
use super::{error_kind, in_threads, tables, Connect, Ctx, Figures, Scale};

/// Long enough never to expire during the scenarios that do not want it to.
const LONG: Duration = Duration::from_secs(30);

/// The TTL of the scenarios that let leases expire.
fn short_ttl(scale: Scale) -> Duration {
    scale.pick(Duration::from_millis(800), Duration::from_secs(2))
}

on_suite_backends! {
    fn lease_database() -> (impl Sized, String, Pool) {
        let (db, pool) = test_db(2);
        tables::create(&mut *pool.get().unwrap(), BACKEND, CLAIM_STAMP_COLUMN);
        let url = db.url.clone();
        (db, url, pool)
    }

    /// Writes to the fenced resource with `token`; whether it was accepted.
    pub fn fenced_write(conn: &mut Conn, token: i64, writer: &str) -> QueryResult<bool> {
        let written = diesel::update(fenced::table.find(1).filter(fenced::token.le(token)))
            .set((fenced::token.eq(token), fenced::writer.eq(writer)))
            .execute(conn)?;
        Ok(written == 1)
    }

    /// Worker: `threads` clients take and release lease `name` for `millis` ms.
    /// Inside, each counts itself in the occupancy row: a count above one is
    /// two holders at once.
    pub fn exclusion_worker(args: &Fields) -> Figures {
        let threads = args.number("threads") as usize;
        let until = Instant::now() + Duration::from_millis(args.number("millis"));
        let name = args.text("name");
        in_threads(threads, |_| {
            let conn = &mut Conn::connect(args.text("url"));
            let mut figures = Figures::default();
            while Instant::now() < until {
                let Some(lease) = Lease::acquire(conn, name, LONG).unwrap() else {
                    figures.count_error("held");
                    thread::sleep(Duration::from_millis(1));
                    continue;
                };
                // The count this holder's increment made, read under its row
                // lock (MySQL has no `RETURNING`).
                let inside: i32 = conn
                    .transaction(|conn| {
                        diesel::update(occupancy::table.find(1))
                            .set(occupancy::inside.eq(occupancy::inside + 1))
                            .execute(conn)?;
                        occupancy::table.find(1).select(occupancy::inside).get_result(conn)
                    })
                    .unwrap();
                figures.check(inside == 1, format!("{inside} holders inside at once"));
                thread::sleep(Duration::from_micros(200));
                diesel::update(occupancy::table.find(1))
                    .set(occupancy::inside.eq(occupancy::inside - 1))
                    .execute(conn)
                    .unwrap();
                if let Err(error) = lease.release(conn) {
                    figures.check(false, format!("release failed: {error}"));
                }
                figures.ops += 1;
            }
            figures
        })
    }

    /// Worker: takes lease `name` for `ttl_ms`, says `leased token=…`, then
    /// pauses `pause_ms` (the runner stops it meanwhile, or kills it), then
    /// tries a fenced write and a release and says `outcome written=… released=…`
    /// (`written=error` when the write failed).
    /// On MariaDB its session runs in `mysql_time_zone`, if given.
    pub fn holder_worker(args: &Fields) -> Figures {
        let conn = &mut Conn::connect(args.text("url"));
        // MariaDB's session time zone (PostgreSQL's comes from `PGTZ`).
        if let (Some(zone), "mysql") = (args.get("mysql_time_zone"), BACKEND) {
            diesel::sql_query(format!("SET time_zone = '{zone}'")).execute(conn).unwrap();
        }
        let ttl = Duration::from_millis(args.number("ttl_ms"));
        let lease = Lease::acquire(conn, args.text("name"), ttl).unwrap().expect("the lease is free");
        procs::report("leased", Fields::default().set("token", lease.token()));
        thread::sleep(Duration::from_millis(args.number("pause_ms")));
        let written = fenced_write(conn, lease.token(), "stale").map_or("error".to_owned(), |w| w.to_string());
        let released = match lease.release(conn) {
            Ok(()) => "ok".to_owned(),
            Err(error) => error_kind(&error),
        };
        procs::report("outcome", Fields::default().set("written", written).set("released", released));
        Figures::default()
    }

    /// Worker: holds lease `name` with `with_lease_kept_alive` (TTL `ttl_ms`,
    /// renewed on a second connection) for `work_ms`, saying `leased token=…`
    /// first; stops early when told the lease is lost. A step that finds it
    /// slept far past its due time (the process was stopped) writes to the
    /// fenced resource with its token at once. Says `outcome result=… lost=…
    /// stalled_write=…` (`none` when it never stalled).
    pub fn kept_holder_worker(args: &Fields) -> Figures {
        let (mut conn, renewer) = (Conn::connect(args.text("url")), Conn::connect(args.text("url")));
        let ttl = Duration::from_millis(args.number("ttl_ms"));
        let work = Duration::from_millis(args.number("work_ms"));
        let (mut lost, mut stalled_write) = (false, None);
        let held = with_lease_kept_alive(&mut conn, renewer, args.text("name"), ttl, |conn: &mut Conn, lease| {
            procs::report("leased", Fields::default().set("token", lease.token()));
            let started = Instant::now();
            while started.elapsed() < work && !lease.is_lost() {
                let step = Instant::now();
                thread::sleep(Duration::from_millis(20));
                if step.elapsed() > ttl / 2 {
                    stalled_write = Some(fenced_write(conn, lease.token(), "stalled")?);
                }
            }
            lost = lease.is_lost();
            Ok::<_, Error>(())
        });
        let result = match held {
            Ok(Some(())) => "ok".to_owned(),
            Ok(None) => "held".to_owned(),
            Err(error) => error_kind(&error),
        };
        let stalled_write = stalled_write.map_or("none".to_owned(), |written| written.to_string());
        let mut outcome = Fields::default();
        outcome.set("result", result).set("lost", lost).set("stalled_write", stalled_write);
        procs::report("outcome", &outcome);
        Figures::default()
    }

    /// Scenario 23: `with_lease_kept_alive` in a worker process, TTL short.
    /// Alive, it keeps the lease four TTLs long against a client trying to
    /// take it; SIGKILLed, the lease is free a TTL after its last renewal,
    /// by the database clock; SIGSTOPped past its TTL, a successor takes the
    /// lease and writes, and once resumed the stalled holder's fenced write
    /// is rejected (or it finds the lease lost by its own clock first, and
    /// does not write), it is told the lease is lost, and its call fails
    /// with `NotLeaseOwner`.
    pub fn kept_lease(ctx: &Ctx) -> Figures {
        let (_db, url, pool) = lease_database();
        let mut conn = pool.get().unwrap();
        let conn: &mut Conn = &mut conn;
        let ttl = short_ttl(ctx.scale);
        let mut figures = Figures::new(2, 2);
        let (mut taken_while_alive, mut slowest_takeover) = (0, Duration::ZERO);
        let (mut refused_writes, mut told_first) = (0, 0);
        for round in 0..ctx.repeats() {
            let name = format!("torture:kept:{round}");
            let args = |work: Duration| {
                [
                    ("url", url.clone()),
                    ("name", name.clone()),
                    ("ttl_ms", ttl.as_millis().to_string()),
                    ("work_ms", work.as_millis().to_string()),
                ]
            };

            // Alive: held for four TTLs, never taken meanwhile, released after.
            let mut holder = ctx.spawn("kept-holder", &args(4 * ttl));
            holder.expect("leased");
            let leased = Instant::now();
            while leased.elapsed() < 3 * ttl {
                if let Some(taken) = Lease::acquire(conn, &name, LONG).unwrap() {
                    taken_while_alive += 1;
                    taken.release(conn).unwrap();
                }
                thread::sleep(Duration::from_millis(50));
            }
            let outcome = holder.expect("outcome");
            holder.finish();
            figures.check(outcome.text("result") == "ok" && outcome.text("lost") == "false",
                format!("{name}: a live holder ended with {outcome:?}"));
            match Lease::acquire(conn, &name, LONG).unwrap() {
                Some(after) => after.release(conn).unwrap(),
                None => figures.check(false, format!("{name}: not released after the work")),
            }

            // SIGKILLed: free within a TTL of its last renewal, not before two
            // thirds of one (renewals come every third).
            let mut holder = ctx.spawn("kept-holder", &args(LONG * 100));
            holder.expect("leased");
            thread::sleep(ttl);
            holder.kill();
            let killed = Instant::now();
            let taken = procs::time_until(ttl + Duration::from_secs(10), || {
                Lease::acquire(conn, &name, LONG).unwrap().is_some_and(|lease| lease.release(conn).is_ok())
            });
            let delay = killed.elapsed();
            figures.check(taken.is_some(), format!("{name}: not free 10 s after the kill"));
            figures.check(delay + Duration::from_millis(250) >= ttl * 2 / 3, format!("{name}: taken {delay:?} after the kill, TTL {ttl:?}"));
            slowest_takeover = slowest_takeover.max(delay);

            // SIGSTOPped past its TTL: a successor takes over and writes; the
            // stalled holder, resumed, is refused and told.
            let mut holder = ctx.spawn("kept-holder", &args(LONG * 100));
            holder.expect("leased");
            // Halfway between two renewals (every third of the TTL from when
            // it said `leased`): a process stopped inside a write would hold
            // SQLite's write lock, and the successor could not take over.
            thread::sleep(ttl / 2);
            holder.stop();
            let mut successor = None;
            procs::time_until(ttl + Duration::from_secs(10), || {
                successor = Lease::acquire(conn, &name, LONG).unwrap();
                successor.is_some()
            });
            let Some(successor) = successor else {
                figures.check(false, format!("{name}: never free while its holder was stopped"));
                holder.resume();
                continue;
            };
            figures.check(fenced_write(conn, successor.token(), "successor").unwrap(), "the successor's write was rejected");
            holder.resume();
            let outcome = holder.expect("outcome");
            holder.finish();
            // Resumed, it writes with its stale token and is refused; or, when
            // the stop came outside its pause, it sees the lease lost by its
            // own clock first and does not write at all.
            match outcome.text("stalled_write") {
                "false" => refused_writes += 1,
                "none" => told_first += 1,
                written => figures.check(false, format!("{name}: stalled write {written}")),
            }
            figures.check(outcome.text("lost") == "true", format!("{name}: the resumed holder was not told it lost the lease"));
            figures.check(outcome.text("result") == "NotLeaseOwner", format!("{name}: resumed holder's call ended {}", outcome.text("result")));
            let writer: String = fenced::table.find(1).select(fenced::writer).first(conn).unwrap();
            figures.check(writer == "successor", format!("{name}: the fenced resource was last written by {writer}"));
            successor.release(conn).unwrap();
            figures.ops += 3;
        }
        figures.check(taken_while_alive == 0, format!("kept leases taken while their holder was alive: {taken_while_alive}"));
        figures.note(format!(
            "TTL {ttl:?}; taken from live holders over 4 TTLs: {taken_while_alive}; free after a kill within {} ms; \
             stopped holders' writes refused: {refused_writes}, holders told before writing: {told_first}",
            slowest_takeover.as_millis()
        ));
        figures
    }

    /// Scenario 16: clients in several processes take and release one name for
    /// the run time; nobody is ever inside together with another holder.
    pub fn mutual_exclusion(ctx: &Ctx) -> Figures {
        let (_db, url, _pool) = lease_database();
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        let args = [
            ("url", url),
            ("name", "torture:exclusive".to_owned()),
            ("millis", ctx.run_time().as_millis().to_string()),
        ];
        for done in ctx.run_workers("exclusion", threads, processes, &args) {
            figures.absorb(&done);
        }
        figures.check(figures.ops > 0, "no lease was ever taken");
        // Contention is the point, not an error.
        let held = figures.errors.remove("held").unwrap_or(0);
        figures.note(format!("acquisitions refused while held: {held}"));
        figures
    }

    /// Scenario 17: a holder process is SIGKILLed right after taking a lease;
    /// another client gets it once the TTL has passed, not before. The holder's
    /// session runs 14 hours ahead and the taker's 12 hours behind (time
    /// zones): only the database clock may count.
    pub fn ttl(ctx: &Ctx) -> Figures {
        let (_db, url, pool) = lease_database();
        let mut conn = pool.get().unwrap();
        let conn: &mut Conn = &mut conn;
        match BACKEND {
            "pg" => diesel::sql_query("SET TIME ZONE 'Etc/GMT+12'").execute(conn).unwrap(),
            "mysql" => diesel::sql_query("SET time_zone = '-12:00'").execute(conn).unwrap(),
            _ => 0,
        };
        let ttl = short_ttl(ctx.scale);
        let mut figures = Figures::new(2, 2);
        let (mut earliest, mut latest) = (Duration::MAX, Duration::ZERO);
        for round in 0..ctx.repeats() {
            let name = format!("torture:ttl:{round}");
            let args = [
                ("url", url.clone()),
                ("name", name.clone()),
                ("ttl_ms", ttl.as_millis().to_string()),
                ("pause_ms", "3600000".to_owned()),
                ("mysql_time_zone", "+13:00".to_owned()),
            ];
            let skew = [("PGTZ", "Pacific/Kiritimati"), ("TZ", "Pacific/Kiritimati")];
            let mut holder = ctx.spawn_with_env("lease-holder", &args, &skew);
            holder.expect("leased");
            let leased = Instant::now();
            holder.kill();
            let taken = procs::time_until(ttl + Duration::from_secs(10), || {
                Lease::acquire(conn, &name, LONG).unwrap().is_some()
            });
            let delay = leased.elapsed();
            figures.check(taken.is_some(), format!("{name}: not free 10 s after its TTL"));
            // The holder took it shortly before saying so: allow for that.
            figures.check(delay + Duration::from_millis(250) >= ttl, format!("{name}: taken after {delay:?}, TTL {ttl:?}"));
            (earliest, latest) = (earliest.min(delay), latest.max(delay));
            figures.ops += 1;
        }
        figures.note(format!("TTL {ttl:?}; replaced after {earliest:.0?} to {latest:.0?} (kill to takeover)"));
        figures
    }

    /// Scenario 18: once a lease has expired and been taken over, its former
    /// holder can neither renew nor release it, however many try at once.
    pub fn owner_check(ctx: &Ctx) -> Figures {
        let (_db, url, pool) = lease_database();
        let stale_holders = 4;
        let mut figures = Figures::new(stale_holders, 1);
        let ttl = Duration::from_millis(100);
        for round in 0..ctx.repeats() {
            let mut conn = pool.get().unwrap();
            let name = format!("torture:owner:{round}");
            let old = Lease::acquire(&mut *conn, &name, ttl).unwrap().unwrap();
            thread::sleep(ttl * 2);
            let new = Lease::acquire(&mut *conn, &name, LONG).unwrap();
            figures.check(new.as_ref().is_some_and(|new| new.token() > old.token()), "no takeover with a newer token");
            figures.merge(in_threads(stale_holders, |_| {
                let mut conn = Conn::connect(&url);
                let mut figures = Figures::default();
                for result in [old.renew(&mut conn, LONG), old.clone().release(&mut conn)] {
                    match result {
                        Err(error @ Error::NotLeaseOwner { .. }) => figures.saw(&error),
                        other => figures.check(false, format!("a stale holder got {other:?}")),
                    }
                    figures.ops += 1;
                }
                figures
            }));
            let still_held = Lease::acquire(&mut *conn, &name, LONG).unwrap();
            figures.check(still_held.is_none(), "the new holder lost its lease");
            if let Some(new) = new {
                figures.check(new.release(&mut *conn).is_ok(), "the new holder could not release");
            }
        }
        figures
    }

    /// Scenario 19: a holder process is SIGSTOPped past its TTL, a newer holder
    /// writes with its token, then the stale one is SIGCONTed and writes with
    /// its own: the resource rejects it, and its release is refused.
    pub fn fencing(ctx: &Ctx) -> Figures {
        let (_db, url, pool) = lease_database();
        let mut conn = pool.get().unwrap();
        let conn: &mut Conn = &mut conn;
        let ttl = short_ttl(ctx.scale);
        let mut figures = Figures::new(2, 2);
        let mut tokens = Vec::new();
        let mut stall = Duration::ZERO;
        for _ in 0..ctx.repeats() {
            let args = [
                ("url", url.clone()),
                ("name", "torture:fenced".to_owned()),
                ("ttl_ms", ttl.as_millis().to_string()),
                ("pause_ms", (ttl / 2).as_millis().to_string()),
            ];
            let mut holder = ctx.spawn("lease-holder", &args);
            let stale: i64 = holder.expect("leased").text("token").parse().unwrap();
            holder.stop();
            let stopped = Instant::now();
            let mut successor = None;
            procs::time_until(ttl + Duration::from_secs(10), || {
                successor = Lease::acquire(conn, "torture:fenced", LONG).unwrap();
                successor.is_some()
            });
            let successor = successor.expect("the lease was never free again");
            let accepted = fenced_write(conn, successor.token(), "successor").unwrap();
            figures.check(accepted, "the successor's write was rejected");
            holder.resume();
            stall = stall.max(stopped.elapsed());
            let outcome = holder.expect("outcome");
            holder.finish();
            figures.check(outcome.text("written") == "false", "a stale holder's fenced write was accepted");
            figures.check(outcome.text("released") == "NotLeaseOwner", format!("stale release: {}", outcome.text("released")));
            figures.count_error(format!("stale-release:{}", outcome.text("released")));
            tokens.extend([stale, successor.token()]);
            successor.release(conn).unwrap();
            figures.ops += 1;
        }
        figures.check(tokens.windows(2).all(|w| w[0] < w[1]), format!("tokens not increasing: {tokens:?}"));
        figures.note(format!("TTL {ttl:?}; longest stall {stall:.0?}; tokens {}..{}", tokens[0], tokens[tokens.len() - 1]));
        figures
    }

    /// Scenario 20: clients reserve the same names at once, each "if free"
    /// under the name's lease: exactly one reservation per name.
    pub fn unique_name(ctx: &Ctx) -> Figures {
        let (threads, names) = ctx.scale.pick((8, 20), (32, 200));
        let (_db, url, pool) = lease_database();
        let mut figures = Figures::new(threads, 1);
        figures.merge(in_threads(threads, |index| {
            let conn = &mut Conn::connect(&url);
            let mut figures = Figures::default();
            for n in 0..names {
                // Each client goes through the names in its own order.
                let name = format!("user:{}", (n + index * 7) % names);
                let lease = Lease::acquire_within(conn, &name, LONG, LONG).unwrap();
                let taken: i64 = reservations::table
                    .filter(reservations::name.eq(&name))
                    .count()
                    .get_result(conn)
                    .unwrap();
                if taken == 0 {
                    thread::sleep(Duration::from_micros(500));
                    diesel::insert_into(reservations::table)
                        .values((reservations::name.eq(&name), reservations::holder.eq(index as i32)))
                        .execute(conn)
                        .unwrap();
                    figures.ops += 1;
                }
                lease.release(conn).unwrap();
            }
            figures
        }));
        let reserved: Vec<String> = reservations::table
            .select(reservations::name)
            .load(&mut *pool.get().unwrap())
            .unwrap();
        let distinct: std::collections::BTreeSet<_> = reserved.iter().collect();
        figures.duplicates = (reserved.len() - distinct.len()) as u64;
        figures.leftovers = (names - distinct.len()) as u64;
        figures
    }
}
