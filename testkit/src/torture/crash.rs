//! The server crashes (27), on PostgreSQL and MariaDB: a server of the
//! scenario's own (never the machine's shared one) is SIGKILLed mid-drain
//! and while a lease is held, then started again on its data, through crash
//! recovery.

use std::thread;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{Error, Lease};

use super::claiming::{insert_orders, pending};
use super::procs::time_until;
use super::{connect_patiently, tables, Connect, Ctx, Figures, Running};
use crate::fixtures::{outbox, Order};

on_row_lock_backends! {
    /// Scenario 27: the server is SIGKILLed and started again, while
    /// workers in several processes drain the orders (persisting: a failed
    /// claim starts over on a new connection, waiting out the outage), and
    /// while a lease is held. Commits are acknowledged only once durable (the
    /// servers' defaults). Invariants after recovery: no row emailed twice,
    /// none left, no commit a worker saw lost (the rows workers report as
    /// committed never exceed the emails), the claim of a connection the
    /// crash broke fails at once (never an empty report), the lease is
    /// neither lost nor doubled by the crash, and fencing tokens keep
    /// increasing across it.
    pub fn server_crash(ctx: &Ctx) -> Figures {
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        let server = start_private_server(true);
        let url = torture_database(&server, ctx.rows());
        crash_mid_drain(ctx, &server, &url, &mut figures);
        crash_with_a_lease(ctx, &server, &url, &mut figures);
        figures
    }

    /// A database `torture` on `server` with the shop schema, the torture
    /// tables and `rows` pending orders; its URL.
    fn torture_database(server: &crate::PrivateServer, rows: usize) -> String {
        let mut admin = Conn::connect(&server.admin_url);
        diesel::sql_query("CREATE DATABASE torture").execute(&mut admin).unwrap();
        let url = server.url("torture");
        let mut conn = Conn::connect(&url);
        crate::fixtures::create_schema(&mut conn, SCHEMA);
        tables::create(&mut conn, BACKEND);
        insert_orders(&mut conn, BACKEND, rows);
        url
    }

    /// How long the server stays down after each crash.
    fn outage(ctx: &Ctx) -> Duration {
        ctx.scale.pick(Duration::from_millis(300), Duration::from_secs(2))
    }

    /// Crashes the server `repeats` times, evenly through the drain.
    fn crash_mid_drain(ctx: &Ctx, server: &crate::PrivateServer, url: &str, figures: &mut Figures) {
        let rows = ctx.rows();
        let (threads, processes) = ctx.workers();
        let crashes = ctx.repeats();
        let draining = Running::new();
        thread::scope(|scope| {
            let crasher = scope.spawn(|| {
                let mut figures = Figures::default();
                let (mut slowest_failure, mut slowest_restart) = (Duration::ZERO, Duration::ZERO);
                for crash in 1..=crashes {
                    let mut watcher = Conn::connect(url);
                    let share = (rows * crash / (crashes + 1)) as i64;
                    let reached = time_until(Duration::from_secs(300), || {
                        !draining.get() || outbox::table.count().get_result::<i64>(&mut watcher).is_ok_and(|sent| sent >= share)
                    });
                    if reached.is_none() || !draining.get() {
                        figures.check(false, format!("crash {crash}: the drain ended, or stalled for 300 s, before {share} rows were emailed"));
                        break;
                    }
                    let mut broken = Conn::connect(url);
                    server.crash();
                    let crashed = Instant::now();
                    // What a caller sees while the server is down: errors, soon.
                    match pending().claim_each(&mut broken, |conn, order: Order| email_by(conn, &order, 0)) {
                        Ok(report) => figures.check(false, format!("a claim while the server was down: Ok({report:?})")),
                        Err(error) => figures.saw(&error),
                    }
                    figures.check(Conn::try_connect(url).is_err(), "connected to a server that was down");
                    slowest_failure = slowest_failure.max(crashed.elapsed());
                    thread::sleep(outage(ctx));
                    let restarting = Instant::now();
                    server.start();
                    slowest_restart = slowest_restart.max(restarting.elapsed());
                }
                figures.note(format!(
                    "{crashes} crashes mid-drain, down {:?} each: a claim on a broken connection failed within {slowest_failure:.0?}; restart and recovery took up to {slowest_restart:.1?}",
                    outage(ctx)
                ));
                figures
            });
            // Slowed down enough that the light drain outlasts its crashes.
            let pause = ctx.scale.pick("20", "1").to_owned();
            let args = [("url", url.to_owned()), ("persist", "1".to_owned()), ("pause_ms", pause)];
            let _drained = draining.stop_on_drop();
            for done in ctx.run_workers("drain", threads, processes, &args) {
                figures.absorb(&done);
            }
            drop(_drained);
            figures.merge(crasher.join().expect("the crashing thread panicked"));
        });
        check_emails(&mut Conn::connect(url), figures, rows as u64);
    }

    /// A lease is taken, the server crashes and comes back: the lease is
    /// still held until its TTL has passed, then a successor gets a larger
    /// token, and the former holder can neither renew nor write with its own.
    fn crash_with_a_lease(ctx: &Ctx, server: &crate::PrivateServer, url: &str, figures: &mut Figures) {
        let ttl = Duration::from_secs(3);
        let name = "torture:crash";
        let mut tokens = Vec::new();
        for _ in 0..ctx.repeats() {
            let mut holder = Conn::connect(url);
            let lease = Lease::acquire(&mut holder, name, ttl).unwrap().expect("the lease is free");
            let acquired = Instant::now();
            figures.check(fenced_write(&mut holder, lease.token(), "holder").unwrap(), "the holder's fenced write was refused");
            server.crash();
            server.start();
            let mut taker: Conn = connect_patiently(url, figures);
            let early = Lease::acquire(&mut taker, name, ttl).unwrap();
            // The crash did not free it (allowing for the time the restart took).
            if acquired.elapsed() < ttl {
                figures.check(early.is_none(), format!("{name}: taken {:?} after it was, within its TTL", acquired.elapsed()));
            }
            let mut successor = early;
            let waited = time_until(ttl + Duration::from_secs(10), || {
                successor = successor.take().or_else(|| Lease::acquire(&mut taker, name, ttl).unwrap());
                successor.is_some()
            });
            let Some(successor) = successor.filter(|_| waited.is_some()) else {
                figures.check(false, format!("{name}: not free 10 s after its TTL"));
                continue;
            };
            figures.check(
                successor.token() > lease.token(),
                format!("{name}: token {} after {} across the crash", successor.token(), lease.token()),
            );
            figures.check(fenced_write(&mut taker, successor.token(), "successor").unwrap(), "the successor's fenced write was refused");
            let mut holder: Conn = connect_patiently(url, figures);
            match lease.renew(&mut holder, ttl) {
                Err(error @ Error::NotLeaseOwner { .. }) => figures.saw(&error),
                other => figures.check(false, format!("{name}: the former holder renewed: {other:?}")),
            }
            figures.check(!fenced_write(&mut holder, lease.token(), "stale").unwrap(), "a stale fenced write was accepted");
            tokens.extend([lease.token(), successor.token()]);
            successor.release(&mut taker).unwrap();
            figures.ops += 1;
        }
        figures.check(tokens.windows(2).all(|pair| pair[0] < pair[1]), format!("tokens {tokens:?} do not increase"));
        figures.note(format!("{} crashes with a lease held: tokens {tokens:?}", ctx.repeats()));
    }
}
