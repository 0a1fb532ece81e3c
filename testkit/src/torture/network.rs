//! The network drops (28) and a kept-alive lease's stalled renewals (29), on
//! PostgreSQL and MariaDB: the server runs behind
//! a [`TestNetwork`](crate::TestNetwork) of the scenario's own, and the link
//! between it and some of the workers is cut, made lossy and slow, under
//! claims, leases, claims with a visibility timeout and worker loops.
//!
//! What bounds each wait is what the documentation tells users to set:
//!
//! - the server drops the session of a client it no longer hears from, which
//!   frees its locks: TCP keepalives of 1 s, three probes (PostgreSQL
//!   `tcp_keepalives_idle`, `_interval`, `_count`; MariaDB
//!   `tcp_keepalive_time`, `_interval`, `_probes`) for a silent client, and a
//!   bound on data it sent that is never acknowledged (PostgreSQL
//!   `tcp_user_timeout`; MariaDB has none, so the database host's
//!   `net.ipv4.tcp_retries2 = 5`, set in the server namespace only);
//! - a client's call ends with an error instead of waiting for an answer that
//!   cannot come: on PostgreSQL libpq's `tcp_user_timeout` and `keepalives_*`
//!   in the URL; Diesel's MySQL connection takes no timeout, so there the
//!   worker host's TCP settings bound it (`net.ipv4.tcp_retries2 = 5`,
//!   keepalives after 1 s), set in the client namespace only.

use std::process::Command;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{with_lease_kept_alive, Error, Lease};

use super::claiming::{insert_orders, insert_timed_jobs, pending, CHANNEL};
use super::procs::{self, time_until, Fields};
use super::{error_kind, Connect, Ctx, Figures};
use crate::fixtures::{orders, outbox, Order};
use crate::TestNetwork;

/// What a call on a cut link may take before it fails, at most: a few
/// retransmissions or keepalive probes (about 12 s for `tcp_retries2 = 5`),
/// with room for a loaded machine.
const CALL_BOUND: Duration = Duration::from_secs(30);

/// What the server may take to free the locks of a client it no longer
/// hears from: three keepalive probes a second apart, or, when it has sent
/// data the client never acknowledged, its retransmission bound (about 5 s
/// on PostgreSQL, 12 s on MariaDB), with room for a loaded machine.
const RELEASE_BOUND: Duration = Duration::from_secs(30);

/// Microseconds since the Unix epoch by the machine's clock, which the
/// runner and its workers share: their events, put on it, are in one order.
fn shared_clock() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_micros() as u64
}

/// Drops every packet of the one TCP connection a client behind the
/// faulty link opened from `port`, both ways, leaving it open at both
/// ends: nothing is relayed and nothing says so. [`TestNetwork::heal`]
/// lifts it.
fn stall_connection(network: &TestNetwork, port: u16) {
    let (server, port) = (network.faulty_address.as_str(), port.to_string());
    for rule in [
        [
            "-A", "INPUT", "-d", server, "-p", "tcp", "--sport", &port, "-j", "DROP",
        ],
        [
            "-A", "OUTPUT", "-s", server, "-p", "tcp", "--dport", &port, "-j", "DROP",
        ],
    ] {
        let mut iptables = Command::new("iptables");
        iptables.args(rule);
        let status = TestNetwork::command_in(&network.server_namespace, &iptables).status();
        assert!(
            status.as_ref().is_ok_and(|status| status.success()),
            "iptables {rule:?} failed: {status:?}"
        );
    }
}

on_row_lock_backends! {
    /// The local port of `conn`'s TCP connection, as the server sees it.
    fn client_port(conn: &mut Conn) -> u16 {
        #[derive(QueryableByName)]
        struct Port {
            #[diesel(sql_type = diesel::sql_types::Text)]
            port: String,
        }
        let query = match BACKEND {
            "pg" => "SELECT inet_client_port()::text AS port",
            _ => "SELECT SUBSTRING_INDEX(host, ':', -1) AS port \
                  FROM information_schema.processlist WHERE id = CONNECTION_ID()",
        };
        let port = diesel::sql_query(query).get_result::<Port>(conn).unwrap().port;
        port.parse().unwrap_or_else(|_| panic!("not a port: {port:?}"))
    }

    /// Worker: holds lease `name` with `with_lease_kept_alive` (TTL
    /// `ttl_ms`), its renewer a connection of its own, and says `leased
    /// token=… port=…` (the renewer's port). It asks `is_lost` every
    /// millisecond until told the lease is lost (at most `work_ms`), and
    /// ends the closure then. Says `outcome held_until=… told=… ended=…
    /// returned=… result=…`, times in microseconds on the shared clock:
    /// when the last `is_lost` that said "held" started, when the first
    /// that said "lost" ended (0 if none did), when the closure ended, and
    /// when the call returned.
    pub fn stalled_holder_worker(args: &Fields) -> Figures {
        let (mut conn, mut renewer) = (Conn::connect(args.text("url")), Conn::connect(args.text("url")));
        let port = client_port(&mut renewer);
        let ttl = Duration::from_millis(args.number("ttl_ms"));
        let work = Duration::from_millis(args.number("work_ms"));
        let (mut held_until, mut told, mut ended) = (0, 0, 0);
        let held = with_lease_kept_alive(&mut conn, renewer, args.text("name"), ttl, |_: &mut Conn, lease| {
            procs::report("leased", Fields::default().set("token", lease.token()).set("port", port));
            let started = Instant::now();
            while started.elapsed() < work {
                let asked = shared_clock();
                if lease.is_lost() {
                    told = shared_clock();
                    break;
                }
                held_until = asked;
                thread::sleep(Duration::from_millis(1));
            }
            ended = shared_clock();
            Ok::<_, Error>(())
        });
        let returned = shared_clock();
        let result = match held {
            Ok(Some(())) => "ok".to_owned(),
            Ok(None) => "held".to_owned(),
            Err(error) => error_kind(&error),
        };
        let mut outcome = Fields::default();
        outcome
            .set("held_until", held_until)
            .set("told", told)
            .set("ended", ended)
            .set("returned", returned)
            .set("result", result);
        procs::report("outcome", &outcome);
        Figures::default()
    }

    /// Scenario 29: a kept-alive lease (TTL 2 s) whose renewer's TCP
    /// connection stalls silently (its packets dropped both ways, the
    /// connection left open), at a random point of the renewal cycle,
    /// while the holder's own connection stays healthy. A successor on the
    /// healthy link takes the lease as soon as it expires. Every round:
    /// the holder's last "held" answer came before the successor had the
    /// lease; it was told within a TTL of the stall; and its call returned
    /// within the bound the documentation gives (a third of the TTL, plus
    /// its release on a healthy connection) after the closure ended,
    /// although the stuck renewal had not come back.
    pub fn stalled_renewals(ctx: &Ctx) -> Figures {
        let network = TestNetwork::new(CLIENT_SYSCTLS, SERVER_SYSCTLS);
        let server = start_server_behind(&network);
        let url = server.url("torture");
        create_database(&server.admin_url, "torture", &url, 0);
        let behind_the_link = server.url_via(&network.faulty_address, "torture", CLIENT_QUERY);
        let ttl = Duration::from_secs(2);
        // How long the call may wait for a stuck renewal, and what its
        // release on a healthy connection may take on a loaded machine.
        let (grace, release) = (ttl / 3, Duration::from_millis(500));
        let mut conn = Conn::connect(&url);
        let mut figures = Figures::new(1, 1);
        let (mut closest, mut slowest_return, mut latest_told) = (u64::MAX, 0, 0);
        for round in 0..ctx.repeats() {
            let name = format!("torture:stalled:{round}");
            let args = [
                ("url", behind_the_link.clone()),
                ("name", name.clone()),
                ("ttl_ms", ttl.as_millis().to_string()),
                ("work_ms", (10 * ttl).as_millis().to_string()),
            ];
            let mut holder = ctx.spawn_in(Some(&network.client_namespace), "stalled-holder", &args, &[]);
            let leased = holder.expect("leased");
            let token = leased.number("token") as i64;
            thread::sleep(ttl.mul_f64(fastrand::f64()));
            stall_connection(&network, leased.number("port") as u16);
            let stalled = shared_clock();
            let (mut successor, mut acquired) = (None, 0);
            time_until(ttl + Duration::from_secs(10), || {
                successor = Lease::acquire(&mut conn, &name, Duration::from_secs(60)).unwrap();
                acquired = shared_clock();
                successor.is_some()
            });
            let outcome = holder.expect("outcome");
            network.heal();
            holder.finish();
            let Some(successor) = successor else {
                figures.check(false, format!("{name}: not free 10 s after its TTL"));
                continue;
            };
            figures.check(successor.token() > token, format!("{name}: token {} after {token}", successor.token()));
            let (held_until, told) = (outcome.number("held_until"), outcome.number("told"));
            let (ended, returned) = (outcome.number("ended"), outcome.number("returned"));
            figures.check(told > 0, format!("{name}: the holder was never told its lease was lost: {outcome:?}"));
            figures.check(
                held_until < acquired,
                format!("{name}: the holder was told \"held\" {} ms after its successor took the lease", held_until.saturating_sub(acquired) / 1000),
            );
            figures.check(
                told <= stalled + (ttl + release).as_micros() as u64,
                format!("{name}: the holder was told {} ms after the stall", told.saturating_sub(stalled) / 1000),
            );
            let took = returned.saturating_sub(ended);
            figures.check(
                took <= (grace + release).as_micros() as u64,
                format!("{name}: the call returned {} ms after its closure ended", took / 1000),
            );
            figures.count_error(format!("holder:{}", outcome.text("result")));
            closest = closest.min(acquired.saturating_sub(held_until));
            slowest_return = slowest_return.max(took);
            latest_told = latest_told.max(told.saturating_sub(stalled));
            successor.release(&mut conn).unwrap();
            figures.ops += 1;
        }
        figures.note(format!(
            "TTL {ttl:?}, renewer stalled silently: last \"held\" at least {:.1} ms before the successor had the lease; told within {} ms of the stall; the call returned within {} ms of its closure",
            closest as f64 / 1000.0,
            latest_told / 1000,
            slowest_return / 1000
        ));
        figures
    }

    /// Scenario 28: the link between the server and some workers is cut
    /// while a worker holds a row, made lossy and slow under a drain, and cut
    /// under a lease holder, a kept-alive lease, claims with a visibility
    /// timeout and worker loops. A cut worker's call fails within
    /// [`CALL_BOUND`] with a typed error; the server frees its row within
    /// [`RELEASE_BOUND`], and another worker, on the healthy link, processes
    /// it once; the drain over the bad link processes every row once; a cut
    /// lease holder's successor takes over after the TTL, and the cut
    /// holder's fenced write is refused once the link heals; every job's
    /// final write and every looped row lands once.
    pub fn network_faults(ctx: &Ctx) -> Figures {
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        let network = TestNetwork::new(CLIENT_SYSCTLS, SERVER_SYSCTLS);
        let query = CLIENT_QUERY;
        let server = start_server_behind(&network);
        let url = server.url("torture");
        create_database(&server.admin_url, "torture", &url, ctx.rows());
        let behind_the_cut = server.url_via(&network.faulty_address, "torture", query);
        cut_while_holding(ctx, &network, &url, &behind_the_cut, &mut figures);
        drain_over_a_bad_link(ctx, &network, &url, &behind_the_cut, &mut figures);
        lease_holder_cut_off(ctx, &network, &url, &behind_the_cut, &mut figures);
        kept_lease_cut_off(ctx, &network, &url, &behind_the_cut, &mut figures);
        let timed = server.url("timed");
        create_database(&server.admin_url, "timed", &timed, 0);
        insert_timed_jobs(&mut Conn::connect(&timed), BACKEND, ctx.rows());
        let timed_behind_the_cut = server.url_via(&network.faulty_address, "timed", query);
        visibility_timeouts_cut_off(ctx, &network, &timed, &timed_behind_the_cut, &mut figures);
        let loops = server.url("loops");
        create_database(&server.admin_url, "loops", &loops, 0);
        let loops_behind_the_cut = server.url_via(&network.faulty_address, "loops", query);
        worker_loops_cut_off(ctx, &network, &loops, &loops_behind_the_cut, &mut figures);
        figures
    }

    /// Worker loops keep up with a producer, one process behind the link,
    /// which is cut for a few seconds mid-run: the cut loop fails, waits
    /// and starts over once the link heals (as the guide shows), the rows it
    /// held go to the others, and every row is emailed once.
    fn worker_loops_cut_off(ctx: &Ctx, network: &TestNetwork, url: &str, behind_the_cut: &str, figures: &mut Figures) {
        let (threads, processes) = ctx.workers();
        let per_process = (threads / processes).max(1);
        let workers: Vec<_> = (0..processes.max(2))
            .map(|p| {
                let (namespace, url) = if p == 0 { (Some(network.client_namespace.as_str()), behind_the_cut) } else { (None, url) };
                let args = [
                    ("url", url.to_owned()),
                    ("threads", per_process.to_string()),
                    ("first", (1 + p * per_process).to_string()),
                    ("pooled", "1".to_owned()),
                ];
                let mut worker = ctx.spawn_in(namespace, "loop", &args, &[]);
                worker.expect("ready");
                worker
            })
            .collect();
        let mut producer = Conn::connect(url);
        let (rows, chunk) = (ctx.rows(), 20);
        let cut_for = ctx.scale.pick(Duration::from_secs(3), Duration::from_secs(10));
        let mut placed = 0;
        while placed < rows {
            insert_orders(&mut producer, BACKEND, chunk);
            if BACKEND == "pg" {
                diesel::sql_query(format!("SELECT pg_notify('{CHANNEL}', '')")).execute(&mut producer).unwrap();
            }
            placed += chunk;
            if placed == rows / 2 / chunk * chunk {
                network.cut();
                thread::sleep(cut_for);
                network.heal();
            }
            thread::sleep(Duration::from_millis(5));
        }
        let drained = time_until(Duration::from_secs(60), || {
            pending().count().get_result::<i64>(&mut producer).is_ok_and(|left| left == 0)
        });
        let mut loops = Figures::default();
        loops.check(drained.is_some(), "rows still pending 60 s after the last was placed");
        for worker in &workers {
            worker.terminate();
        }
        for worker in workers {
            loops.absorb(&worker.finish());
        }
        check_emails(&mut producer, &mut loops, rows as u64);
        figures.note(format!(
            "worker loops, one process cut off for {cut_for:?}: {rows} rows, pending rows gone {:.0?} after the last",
            drained.unwrap_or_default()
        ));
        figures.merge(loops);
    }

    /// How many times each cut is made: once at light scale, where a cut
    /// call on MariaDB takes its 13 s.
    fn rounds(ctx: &Ctx) -> usize {
        ctx.scale.pick(1, ctx.repeats())
    }

    /// `with_lease_kept_alive` (TTL 2 s) behind the cut, renewing over the
    /// cut link too: a successor on the healthy link takes the lease once it
    /// has expired, and the cut holder is told it lost it.
    fn kept_lease_cut_off(ctx: &Ctx, network: &TestNetwork, url: &str, behind_the_cut: &str, figures: &mut Figures) {
        let ttl = Duration::from_secs(2);
        let mut conn = Conn::connect(url);
        for round in 0..rounds(ctx) {
            let name = format!("torture:kept-cut:{round}");
            let holder = Holder { kind: "kept-holder", url: behind_the_cut, name: &name, ttl, busy: ("work_ms", 30 * ttl) };
            let (mut holder, successor) = cut_off_a_holder(ctx, network, &mut conn, holder, figures);
            let outcome = holder.expect("outcome");
            network.heal();
            holder.finish();
            figures.check(outcome.text("lost") == "true", format!("{name}: the cut holder was not told it lost the lease: {outcome:?}"));
            let Some(successor) = successor else { continue };
            successor.release(&mut conn).unwrap();
            figures.ops += 1;
        }
        figures.note(format!("{} kept-alive leases cut off: successors took over, holders told", rounds(ctx)));
    }

    /// Workers claim jobs with a visibility timeout (500 ms, batches of 5),
    /// one process behind the link, which is cut for three timeouts mid-run:
    /// its jobs come back to the healthy workers when their stamps pass, its
    /// late finishes are refused, and every job's final write lands once.
    fn visibility_timeouts_cut_off(ctx: &Ctx, network: &TestNetwork, url: &str, behind_the_cut: &str, figures: &mut Figures) {
        let (threads, processes) = ctx.workers();
        let per_process = (threads / processes).max(1);
        let rows = ctx.rows();
        let spawn = |p: usize| {
            let (namespace, url) = if p == 0 { (Some(network.client_namespace.as_str()), behind_the_cut) } else { (None, url) };
            let args = [
                ("url", url.to_owned()),
                ("threads", per_process.to_string()),
                ("first", (1 + p * per_process).to_string()),
                ("ttl_ms", "500".to_owned()),
                ("pause_ms", "10".to_owned()),
                ("batch", "5".to_owned()),
                ("persist", "1".to_owned()),
            ];
            ctx.spawn_in(namespace, "timed", &args, &[])
        };
        let workers: Vec<_> = (0..processes.max(2)).map(spawn).collect();
        let mut conn = Conn::connect(url);
        let done = timed_jobs::table.filter(timed_jobs::done.eq(true));
        let reached = time_until(Duration::from_secs(300), || {
            done.count().get_result::<i64>(&mut conn).is_ok_and(|done| done as usize >= rows / 4)
        });
        figures.check(reached.is_some(), "a quarter of the jobs not done in 300 s");
        network.cut();
        thread::sleep(Duration::from_millis(1500));
        network.heal();
        let mut timed = Figures::default();
        for worker in workers {
            timed.absorb(&worker.finish());
        }
        let (twice, left) = check_timed_jobs(&mut conn, &mut timed);
        figures.note(format!(
            "claims with a visibility timeout, one process cut off for 1.5 s: {rows} jobs, {twice} final writes twice, {left} left, {} late finishes refused",
            timed.errors.get("ClaimLost").copied().unwrap_or(0)
        ));
        figures.merge(timed);
    }

    /// A worker behind the cut claims a row, writes and says so; the link
    /// is cut; its next statement must fail, and the row must come free.
    fn cut_while_holding(ctx: &Ctx, network: &TestNetwork, url: &str, behind_the_cut: &str, figures: &mut Figures) {
        let mut conn = Conn::connect(url);
        let (mut slowest_release, mut slowest_failure) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..rounds(ctx) {
            let args = [("url", behind_the_cut.to_owned()), ("pause_ms", "500".to_owned())];
            let mut victim = ctx.spawn_in(Some(&network.client_namespace), "hold", &args, &[]);
            let id = victim.expect("locked").number("id") as i32;
            network.cut();
            // The cut worker's lock holds the row at first: without it, the
            // row would come "free" at once and the bound check nothing.
            let first = pending().filter(orders::id.eq(id)).claim_each(&mut conn, |conn, order: Order| email_by(conn, &order, 0));
            figures.check(
                matches!(first, Ok(ref report) if report.locked == 1),
                format!("row {id} was not locked when its worker was cut off: {first:?}"),
            );
            let mut taken = None;
            let freed = time_until(RELEASE_BOUND, || {
                let claimed = pending()
                    .filter(orders::id.eq(id))
                    .claim_each(&mut conn, |conn, order: Order| email_by(conn, &order, 0));
                taken = Some(claimed);
                matches!(taken, Some(Ok(ref report)) if report.processed == 1)
            });
            match freed {
                Some(after) => slowest_release = slowest_release.max(after),
                None => figures.check(false, format!("row {id} still locked {RELEASE_BOUND:?} after the cut: {taken:?}")),
            }
            let outcome = victim.expect("outcome");
            network.heal();
            victim.finish();
            let waited = Duration::from_millis(outcome.number("waited_ms"));
            slowest_failure = slowest_failure.max(waited);
            figures.check(outcome.text("result") != "ok", format!("a call on a cut link succeeded: {outcome:?}"));
            figures.check(waited <= CALL_BOUND, format!("a call on a cut link took {waited:?}"));
            figures.count_error(outcome.text("result"));
            let emails: Vec<i32> = outbox::table.filter(outbox::order_id.eq(id)).select(outbox::worker).load(&mut conn).unwrap();
            figures.check(emails == [0], format!("row {id} emailed by workers {emails:?}, not once by the healthy one"));
            figures.ops += 1;
        }
        figures.note(format!(
            "{} cuts while a worker held a row: the server freed it within {slowest_release:.1?}, the cut worker's call failed within {slowest_failure:.1?}",
            rounds(ctx)
        ));
    }

    /// Workers behind a link that loses 10% of its packets each way and
    /// carries 1 Mbit/s from the server, and workers on the healthy link,
    /// drain the rest of the rows together.
    fn drain_over_a_bad_link(ctx: &Ctx, network: &TestNetwork, url: &str, behind_the_cut: &str, figures: &mut Figures) {
        network.lose(0.1);
        network.slow(1024);
        let (threads, processes) = ctx.workers();
        let per_process = (threads / processes).max(1);
        let sides = [(Some(network.client_namespace.as_str()), behind_the_cut), (None, url)];
        let started = Instant::now();
        let spawn = |p: usize| {
            let (namespace, url) = sides[p % 2];
            let args = [
                ("url", url.to_owned()),
                ("threads", per_process.to_string()),
                ("first", (1 + p * per_process).to_string()),
                ("persist", "1".to_owned()),
                ("batch", "5".to_owned()),
                ("pause_ms", "10".to_owned()),
            ];
            ctx.spawn_in(namespace, "drain", &args, &[])
        };
        let cut_off: Vec<i32> = (0..processes.max(2))
            .step_by(2)
            .flat_map(|p| (1 + p * per_process..1 + (p + 1) * per_process).map(|worker| worker as i32))
            .collect();
        let mut conn = Conn::connect(url);
        let rows_over_the_bad_link = |conn: &mut Conn| -> i64 {
            outbox::table.filter(outbox::worker.eq_any(&cut_off)).count().get_result(conn).unwrap()
        };
        // The bad link's workers first, alone until one of them has written:
        // the healthy ones would otherwise drain everything before the others
        // got a row. Over a lossy link, connecting alone can take seconds
        // (a lost handshake packet waits out TCP's retransmission timeout).
        let mut workers: Vec<_> = (0..processes.max(2)).step_by(2).map(spawn).collect();
        let first_row = time_until(CALL_BOUND, || rows_over_the_bad_link(&mut conn) > 0);
        workers.extend((1..processes.max(2)).step_by(2).map(spawn));
        for worker in workers {
            figures.absorb(&worker.finish());
        }
        network.heal();
        // Every row: those the cuts left to the healthy worker, and these.
        let rows: i64 = orders::table.count().get_result(&mut conn).unwrap();
        check_emails(&mut conn, figures, rows as u64);
        // A row once written stays: a first row means rows over the link.
        figures.check(first_row.is_some(), format!("no row came over the bad link within {CALL_BOUND:?}"));
        let over_the_bad_link = rows_over_the_bad_link(&mut conn);
        let first_row = first_row.map_or("never".to_owned(), |after| format!("{after:.1?}"));
        figures.note(format!(
            "a drain over a lossy, slow link and a healthy one: {:.1?}, {over_the_bad_link} rows over the bad link, the first after {first_row}",
            started.elapsed()
        ));
    }

    /// A lease holder behind the cut takes the lease, the link is cut for
    /// longer than its TTL, a successor on the healthy link takes over and
    /// writes, and the link heals: the cut holder's fenced write is refused
    /// and so is its release.
    fn lease_holder_cut_off(ctx: &Ctx, network: &TestNetwork, url: &str, behind_the_cut: &str, figures: &mut Figures) {
        let ttl = Duration::from_secs(2);
        let mut conn = Conn::connect(url);
        for round in 0..rounds(ctx) {
            let name = format!("torture:cut:{round}");
            let holder = Holder { kind: "lease-holder", url: behind_the_cut, name: &name, ttl, busy: ("pause_ms", 2 * ttl) };
            let (mut holder, successor) = cut_off_a_holder(ctx, network, &mut conn, holder, figures);
            let Some(successor) = successor else {
                network.heal();
                continue;
            };
            figures.check(fenced_write(&mut conn, successor.token(), "successor").unwrap(), "the successor's write was refused");
            network.heal();
            let outcome = holder.expect("outcome");
            holder.finish();
            figures.check(outcome.text("written") != "true", format!("{name}: the cut holder's stale write was accepted"));
            figures.check(outcome.text("released") != "ok", format!("{name}: the cut holder released its successor's lease"));
            figures.count_error(format!("stale-release:{}", outcome.text("released")));
            successor.release(&mut conn).unwrap();
            figures.ops += 1;
        }
    }

    /// A lease holder to cut off: its worker kind, its URL behind the link,
    /// its lease, and how long it stays busy (`work_ms`, `pause_ms`).
    struct Holder<'a> {
        kind: &'a str,
        url: &'a str,
        name: &'a str,
        ttl: Duration,
        busy: (&'a str, Duration),
    }

    /// Starts `holder` behind the link, which it cuts once the holder says
    /// `leased token=…`; returns the holder's process and the lease's
    /// successor, taken on `conn` once the holder's TTL has passed (checked
    /// to carry a larger token), or `None`, recorded as a failure, if the
    /// lease did not come free. The successor's TTL is a minute: it is still
    /// held when the cut holder, back on the network, tries its release.
    fn cut_off_a_holder(
        ctx: &Ctx,
        network: &TestNetwork,
        conn: &mut Conn,
        holder: Holder,
        figures: &mut Figures,
    ) -> (procs::Worker, Option<Lease>) {
        let Holder { kind, url, name, ttl, busy: (busy, busy_for) } = holder;
        let args = [
            ("url", url.to_owned()),
            ("name", name.to_owned()),
            ("ttl_ms", ttl.as_millis().to_string()),
            (busy, busy_for.as_millis().to_string()),
        ];
        let mut holder = ctx.spawn_in(Some(&network.client_namespace), kind, &args, &[]);
        let token = holder.expect("leased").number("token") as i64;
        network.cut();
        let mut successor = None;
        let waited = time_until(ttl + Duration::from_secs(10), || {
            successor = Lease::acquire(conn, name, Duration::from_secs(60)).unwrap();
            successor.is_some()
        });
        let successor = successor.filter(|_| waited.is_some());
        match &successor {
            Some(successor) => figures.check(successor.token() > token, format!("{name}: token {} after {token}", successor.token())),
            None => figures.check(false, format!("{name}: not free 10 s after its TTL")),
        }
        (holder, successor)
    }
}
