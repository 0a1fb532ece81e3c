//! The server crashes (27), on PostgreSQL and MariaDB: a server of the
//! scenario's own (never the machine's shared one) is SIGKILLed mid-drain,
//! mid-bank, while a lease is held and under worker loops, then started
//! again on its data, through crash recovery.

use std::thread;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{Error, Lease};

use super::claiming::{insert_timed_jobs, pending, try_insert_orders, CHANNEL};
use super::money::OPENING;
use super::procs::time_until;
use super::{connect_patiently, Connect, Ctx, Figures, Running};
use crate::fixtures::{outbox, Order};

on_row_lock_backends! {
    /// Scenario 27: the server is SIGKILLed and started again, while
    /// workers in several processes drain the orders (persisting: a failed
    /// claim starts over on a new connection, waiting out the outage), while
    /// they move money between accounts with row locks (the same), while a
    /// lease is held, and while worker loops keep up with a producer.
    /// Commits are acknowledged only once durable (the servers' defaults).
    /// Invariants after recovery: no row emailed twice, none left, no commit
    /// a worker saw lost (the rows workers report as committed never exceed
    /// the emails, the transfers never the ledger's entries), money conserved
    /// and every balance as the ledger says, the claim of a connection the
    /// crash broke fails at once (never an empty report), a pool hands out
    /// working connections again, the lease is neither lost nor doubled by
    /// the crash, and fencing tokens keep increasing across it.
    pub fn server_crash(ctx: &Ctx) -> Figures {
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        let server = start_private_server(true);
        let url = torture_database(&server, "torture", ctx.rows());
        crash_mid_drain(ctx, &server, &url, &mut figures);
        crash_mid_bank(ctx, &server, &url, &mut figures);
        crash_with_a_lease(ctx, &server, &url, &mut figures);
        crash_under_worker_loops(ctx, &server, &mut figures);
        crash_under_visibility_timeouts(ctx, &server, &mut figures);
        crash_under_a_kept_lease(ctx, &server, &url, &mut figures);
        figures
    }

    /// A database `name` on `server` with the shop schema, the torture
    /// tables and `rows` pending orders; its URL.
    fn torture_database(server: &crate::PrivateServer, name: &str, rows: usize) -> String {
        let url = server.url(name);
        create_database(&server.admin_url, name, &url, rows);
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
                // A pool whose idle connections the crash breaks: r2d2 tests
                // each on checkout and replaces the broken ones.
                let pool = Pool::builder()
                    .max_size(2)
                    .connection_timeout(Duration::from_secs(10))
                    .build(diesel::r2d2::ConnectionManager::new(url))
                    .unwrap();
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
                    let pooled = pool.get().map_err(|e| e.to_string()).and_then(|mut conn| {
                        pending().count().get_result::<i64>(&mut conn).map_err(|e| e.to_string())
                    });
                    figures.check(pooled.is_ok(), format!("crash {crash}: the pool after the restart: {pooled:?}"));
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
            let drained = draining.stop_on_drop();
            for done in ctx.run_workers("drain", threads, processes, &args) {
                figures.absorb(&done);
            }
            drop(drained);
            figures.merge(crasher.join().expect("the crashing thread panicked"));
        });
        check_emails(&mut Conn::connect(url), figures, rows as u64);
    }

    /// Crashes the server `repeats` times, evenly through the run time, while
    /// bank workers transfer money between 10 accounts with `with_locks`.
    fn crash_mid_bank(ctx: &Ctx, server: &crate::PrivateServer, url: &str, figures: &mut Figures) {
        let accounts = 10;
        seed_accounts(&mut Conn::connect(url), &vec![OPENING; accounts]);
        let (threads, processes) = ctx.workers();
        let crashes = ctx.repeats();
        let mut bank = Figures::default();
        thread::scope(|scope| {
            let crasher = scope.spawn(|| {
                for _ in 0..crashes {
                    thread::sleep(ctx.run_time() / (crashes as u32 + 1));
                    server.crash();
                    thread::sleep(outage(ctx));
                    server.start();
                }
            });
            let args = [
                ("url", url.to_owned()),
                ("method", "locked".to_owned()),
                ("accounts", accounts.to_string()),
                ("millis", ctx.run_time().as_millis().to_string()),
                ("persist", "1".to_owned()),
            ];
            for done in ctx.run_workers("bank", threads, processes, &args) {
                bank.absorb(&done);
            }
            crasher.join().expect("the crashing thread panicked");
        });
        check_ledger(&mut Conn::connect(url), &mut bank, accounts, false);
        figures.note(format!("{crashes} crashes mid-bank: {} transfers reported", bank.ops));
        figures.merge(bank);
    }

    /// Crashes the server `repeats` times while workers on r2d2 pools in
    /// several processes (`run_pooled`, going on by themselves through the
    /// lost connections and the restarts) keep up with a producer; then
    /// stops them with SIGTERM. Every order in the
    /// table, however many the producer's cut-off inserts placed, is emailed
    /// exactly once.
    fn crash_under_worker_loops(ctx: &Ctx, server: &crate::PrivateServer, figures: &mut Figures) {
        let url = torture_database(server, "loops", 0);
        let (threads, processes) = ctx.workers();
        let share = (threads / processes).max(1);
        let workers: Vec<_> = (0..processes)
            .map(|p| {
                let args = [
                    ("url", url.clone()),
                    ("threads", share.to_string()),
                    ("first", (1 + p * share).to_string()),
                    ("pooled", "1".to_owned()),
                ];
                let mut worker = ctx.spawn("loop", &args);
                worker.expect("ready");
                worker
            })
            .collect();
        let mut loops = Figures::default();
        let (rows, chunk, crashes) = (ctx.rows(), 20, ctx.repeats());
        let mut producer: Conn = connect_patiently(&url, &mut loops);
        let (mut placed, mut crashed) = (0, 0);
        while placed < rows {
            if try_insert_orders(&mut producer, BACKEND, chunk).is_err() {
                // The server is down: its insert may or may not have landed.
                producer = connect_patiently(&url, &mut loops);
                continue;
            }
            placed += chunk;
            if BACKEND == "pg" {
                let _ = diesel::sql_query(format!("SELECT pg_notify('{CHANNEL}', '')")).execute(&mut producer);
            }
            if crashed < crashes && placed >= rows * (crashed + 1) / (crashes + 1) {
                server.crash();
                thread::sleep(outage(ctx));
                server.start();
                // A batch whose commit the crash cut off may have committed
                // unheard: the loops go on without counting it, so their
                // reports may fall short of the emails (never above).
                loops.count_error("crashed");
                crashed += 1;
            }
            thread::sleep(Duration::from_millis(5));
        }
        let mut conn: Conn = connect_patiently(&url, &mut loops);
        let drained = time_until(Duration::from_secs(60), || {
            pending().count().get_result::<i64>(&mut conn).is_ok_and(|left| left == 0)
        });
        loops.check(drained.is_some(), "rows still pending 60 s after the last was placed");
        for worker in &workers {
            worker.terminate();
        }
        for worker in workers {
            loops.absorb(&worker.finish());
        }
        let orders: i64 = crate::fixtures::orders::table.count().get_result(&mut conn).unwrap();
        check_emails(&mut conn, &mut loops, orders as u64);
        figures.note(format!(
            "{crashes} crashes under pooled workers: {orders} orders placed in chunks of {chunk}, pending rows gone {:.0?} after the last",
            drained.unwrap_or_default()
        ));
        figures.merge(loops);
    }

    /// Crashes the server `repeats` times while workers in several processes
    /// claim jobs with a visibility timeout (500 ms, batches of 5, their work
    /// outside any transaction), starting over after any error. Every job's
    /// final write lands exactly once, and no stamp is left.
    fn crash_under_visibility_timeouts(ctx: &Ctx, server: &crate::PrivateServer, figures: &mut Figures) {
        let url = torture_database(server, "timed", 0);
        insert_timed_jobs(&mut Conn::connect(&url), BACKEND, ctx.rows());
        let (threads, processes) = ctx.workers();
        let (rows, crashes) = (ctx.rows(), ctx.repeats());
        let finishing = Running::new();
        let mut timed = Figures::default();
        thread::scope(|scope| {
            let crasher = scope.spawn(|| {
                let mut figures = Figures::default();
                for crash in 1..=crashes {
                    let mut watcher = Conn::connect(&url);
                    let share = (rows * crash / (crashes + 1)) as i64;
                    let done = timed_jobs::table.filter(timed_jobs::done.eq(true));
                    let reached = time_until(Duration::from_secs(300), || {
                        !finishing.get() || done.count().get_result::<i64>(&mut watcher).is_ok_and(|done| done >= share)
                    });
                    if reached.is_none() || !finishing.get() {
                        figures.check(false, format!("crash {crash}: the jobs ended, or stalled for 300 s, before {share} were done"));
                        break;
                    }
                    server.crash();
                    thread::sleep(outage(ctx));
                    server.start();
                }
                figures
            });
            let args = [
                ("url", url.clone()),
                ("ttl_ms", "500".to_owned()),
                ("pause_ms", ctx.scale.pick("20", "2").to_owned()),
                ("batch", "5".to_owned()),
                ("persist", "1".to_owned()),
            ];
            let finished = finishing.stop_on_drop();
            for done in ctx.run_workers("timed", threads, processes, &args) {
                timed.absorb(&done);
            }
            drop(finished);
            timed.merge(crasher.join().expect("the crashing thread panicked"));
        });
        let mut conn = Conn::connect(&url);
        let (twice, left) = check_timed_jobs(&mut conn, &mut timed);
        figures.note(format!("{crashes} crashes under claims with a visibility timeout: {rows} jobs, {twice} final writes twice, {left} left"));
        figures.merge(timed);
    }

    /// `with_lease_kept_alive` (TTL 2 s) in a worker process while the server
    /// crashes and comes back at once: its renewing connection is broken for
    /// good, so the holder must be told the lease is lost within a TTL and a
    /// renewal period of its last renewal, and a successor gets it, with a
    /// larger token, only once it has expired.
    fn crash_under_a_kept_lease(ctx: &Ctx, server: &crate::PrivateServer, url: &str, figures: &mut Figures) {
        let ttl = Duration::from_secs(2);
        let mut tokens = Vec::new();
        for round in 0..ctx.repeats() {
            let name = format!("torture:kept-crash:{round}");
            let args = [
                ("url", url.to_owned()),
                ("name", name.clone()),
                ("ttl_ms", ttl.as_millis().to_string()),
                ("work_ms", (30 * ttl).as_millis().to_string()),
            ];
            let mut holder = ctx.spawn("kept-holder", &args);
            let token = holder.expect("leased").number("token") as i64;
            // A renewal or two first, so that the crash comes mid-lease.
            thread::sleep(ttl / 2);
            server.crash();
            let crashed = Instant::now();
            server.start();
            let mut taker: Conn = connect_patiently(url, figures);
            let mut successor = None;
            let waited = time_until(2 * ttl + Duration::from_secs(10), || {
                successor = Lease::acquire(&mut taker, &name, ttl).unwrap();
                successor.is_some()
            });
            let outcome = holder.expect("outcome");
            holder.finish();
            figures.check(outcome.text("lost") == "true", format!("{name}: the holder was not told it lost the lease: {outcome:?}"));
            let Some(successor) = successor.filter(|_| waited.is_some()) else {
                figures.check(false, format!("{name}: not free 10 s after two TTLs"));
                continue;
            };
            // Its last renewal was at most a third of a TTL before the crash.
            figures.check(
                crashed.elapsed() + ttl / 3 >= ttl,
                format!("{name}: taken {:?} after the crash, TTL {ttl:?}", crashed.elapsed()),
            );
            figures.check(successor.token() > token, format!("{name}: token {} after {token}", successor.token()));
            tokens.extend([token, successor.token()]);
            successor.release(&mut taker).unwrap();
            figures.ops += 1;
        }
        figures.note(format!("{} crashes under a kept-alive lease: holders told, tokens {tokens:?}", ctx.repeats()));
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
