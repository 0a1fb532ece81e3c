//! Claiming scenarios on every backend: drain (1), double check (2), worker
//! killed (4), closure error and panic (6), the worker loop (24), claims with
//! a visibility timeout (25); and the worker processes they start.
//!
//! "Sending an email" inserts an outbox row, which has no UNIQUE constraint:
//! a row processed twice shows up as two outbox rows.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::Error;

use super::procs::{self, Fields};
use super::tables::timed_work;
use super::{
    connect_patiently, counted_retry, error_kind, in_threads, tables, Connect, Ctx, Figures,
    Running, DELIBERATE,
};
use crate::fixtures::{orders, outbox, Order};

/// Shipped orders whose email is not sent yet: what the scenarios claim.
#[diesel::dsl::auto_type]
pub fn pending() -> _ {
    orders::table
        .filter(orders::shipped.eq(true))
        .filter(orders::email_sent.eq(false))
}

/// The channel the worker loops listen on (PostgreSQL).
pub(super) const CHANNEL: &str = "torture_orders";

/// Inserts `count` pending orders in one statement, on `backend` (`pg`,
/// `sqlite` or `mysql`).
pub(super) fn insert_orders(conn: &mut impl SimpleConnection, backend: &str, count: usize) {
    insert_numbered(conn, backend, count, "orders (shipped)", "TRUE");
}

/// Inserts `count` rows into `table_columns` in one statement, one for each
/// `i` in `1..=count`, with the values `select` makes of `i`.
pub(super) fn insert_numbered(
    conn: &mut impl SimpleConnection,
    backend: &str,
    count: usize,
    table_columns: &str,
    select: &str,
) {
    try_insert_numbered(conn, backend, count, table_columns, select)
        .unwrap_or_else(|e| panic!("cannot insert into {table_columns}: {e}"));
}

/// Inserts `count` jobs not done, with ids `1..=count`, for the claims with a
/// visibility timeout.
pub(super) fn insert_timed_jobs(conn: &mut impl SimpleConnection, backend: &str, count: usize) {
    insert_numbered(
        conn,
        backend,
        count,
        "timed_jobs (id, done, times_done)",
        "i, FALSE, 0",
    );
}

/// [`insert_orders`], for a server that may be down.
pub(super) fn try_insert_orders(
    conn: &mut impl SimpleConnection,
    backend: &str,
    count: usize,
) -> QueryResult<()> {
    try_insert_numbered(conn, backend, count, "orders (shipped)", "TRUE")
}

fn try_insert_numbered(
    conn: &mut impl SimpleConnection,
    backend: &str,
    count: usize,
    table_columns: &str,
    select: &str,
) -> QueryResult<()> {
    if count == 0 {
        return Ok(());
    }
    let numbers =
        format!("RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {count})");
    let sql = match backend {
        // MariaDB stops a recursion at 1,000 rows unless told otherwise, and
        // puts the `WITH` after the `INSERT`.
        "mysql" => format!(
            "SET SESSION max_recursive_iterations = {count}; \
             INSERT INTO {table_columns} WITH {numbers} SELECT {select} FROM n"
        ),
        _ => format!("WITH {numbers} INSERT INTO {table_columns} SELECT {select} FROM n"),
    };
    conn.batch_execute(&sql)
}

on_suite_backends! {
    /// A fresh database with the shop schema, the torture tables and `rows`
    /// pending orders.
    pub fn database(size: u32, rows: usize) -> (impl Sized, String, Pool) {
        let (db, pool) = test_db(size);
        let mut conn = pool.get().unwrap();
        tables::create(&mut *conn, BACKEND, CLAIM_STAMP_COLUMN);
        insert_orders(&mut *conn, BACKEND, rows);
        let url = db.url.clone();
        (db, url, pool)
    }

    /// A database `name` made on the server of `admin_url`, reached at `url`,
    /// with what [`database`] has.
    pub fn create_database(admin_url: &str, name: &str, url: &str, rows: usize) {
        diesel::sql_query(format!("CREATE DATABASE {name}")).execute(&mut Conn::connect(admin_url)).unwrap();
        let mut conn = Conn::connect(url);
        crate::fixtures::create_schema(&mut conn, SCHEMA);
        tables::create(&mut conn, BACKEND, CLAIM_STAMP_COLUMN);
        insert_orders(&mut conn, BACKEND, rows);
    }

    /// The email of `order`: an outbox row by `worker`, and the flag cleared.
    pub fn email(conn: &mut Conn, order: &Order, worker: i32) -> Result<(), Error> {
        diesel::insert_into(outbox::table)
            .values((outbox::order_id.eq(order.id), outbox::worker.eq(worker)))
            .execute(conn)?;
        diesel::update(order).set(orders::email_sent.eq(true)).execute(conn)?;
        Ok(())
    }

    /// Checks the outbox against `expected` rows: each emailed once, none
    /// left. Workers must have reported every row they processed; after errors
    /// they may have reported fewer (a claim that ends with an error does not
    /// say how many rows it committed before), never more.
    pub fn check_emails(conn: &mut Conn, figures: &mut Figures, expected: u64) {
        let sent: i64 = outbox::table.count().get_result(conn).unwrap();
        let distinct: i64 = outbox::table
            .select(diesel::dsl::count(outbox::order_id).aggregate_distinct())
            .get_result(conn)
            .unwrap();
        let left: i64 = pending().count().get_result(conn).unwrap();
        let sent = sent as u64;
        figures.duplicates += sent - distinct as u64;
        figures.leftovers += left as u64;
        figures.check(sent == expected, format!("{sent} emails for {expected} rows"));
        let reported = figures.ops;
        let exact = figures.errors.is_empty();
        figures.check(
            if exact { reported == sent } else { reported <= sent },
            format!("workers reported {reported} rows processed, {sent} emailed"),
        );
        if reported < sent {
            figures.note(format!("commits not reported by a claim that then failed: {}", sent - reported));
        }
        figures.ops = sent;
    }

    /// Worker: `threads` threads each drain the pending orders (claims retried
    /// on transient errors), `batch` rows per transaction (default 1), reading
    /// candidates `page_size` at a time (default 100, so that a light run has
    /// several pages; `default`: the crate's own paging), optionally under
    /// `isolation` and pausing `pause_ms` in each transaction; with `persist`,
    /// a claim that fails for any reason starts over on a new connection,
    /// waiting out a server that is down. Reports the rows each call
    /// committed, counted up to where it ended (its outcome).
    pub fn drain_worker(args: &Fields) -> Figures {
        let threads = args.number("threads") as usize;
        let first = args.number("first") as i32;
        let pause = Duration::from_millis(args.number("pause_ms"));
        let persist = args.get("persist").is_some();
        let batch = args.get("batch").map_or(1, |rows| rows.parse().unwrap());
        let page_size = match args.get("page_size") {
            Some("default") => None,
            Some(keys) => Some(keys.parse().unwrap()),
            None => Some(100),
        };
        in_threads(threads, |index| {
            let worker = first + index as i32;
            let mut figures = Figures::default();
            loop {
                let mut conn = if persist {
                    connect_patiently::<Conn>(args.text("url"), &mut figures)
                } else {
                    Conn::connect(args.text("url"))
                };
                let mut committed = 0;
                let claimed = prepare_session(&mut conn, args.get("isolation")).and_then(|()| {
                    counted_retry(&mut conn, &mut figures, |conn| {
                        let claim = pending().build_claim().drain().batch(batch);
                        let outcome = match page_size {
                            Some(keys) => claim.page_size(keys),
                            None => claim,
                        }
                        .each_batch_outcome(conn, |conn, orders: Vec<Order>| {
                            thread::sleep(pause);
                            orders.iter().try_for_each(|order| email(conn, order, worker))
                        });
                        committed += outcome.report.processed;
                        outcome.into_result()
                    })
                });
                figures.ops += committed;
                match claimed {
                    Ok(_) => return figures,
                    // Each call makes progress: rows committed before a failure
                    // stay committed. A transient error that outlasted `retry`
                    // is worth another call; with `persist`, so is any error (a
                    // killed connection, a server out of SERIALIZABLE
                    // bookkeeping), on a new connection.
                    Err(error) if persist || error.is_transient() => figures.saw(&error),
                    Err(error) => {
                        figures.check(false, format!("worker {worker}: {error}"));
                        return figures;
                    }
                }
            }
        })
    }

    /// Names the session for the connection-killing scenario (PostgreSQL)
    /// and sets its isolation level (PostgreSQL and MariaDB; read committed
    /// unless told otherwise, as the crate's documentation recommends).
    fn prepare_session(conn: &mut Conn, isolation: Option<&str>) -> Result<(), Error> {
        let level = isolation.unwrap_or("read-committed").replace('-', " ");
        match BACKEND {
            "pg" => conn.batch_execute(&format!(
                "SET application_name = 'torture-drain'; \
                 SET default_transaction_isolation = '{level}'"
            ))?,
            "mysql" => conn.batch_execute(&format!("SET SESSION TRANSACTION ISOLATION LEVEL {level}"))?,
            _ => {}
        }
        Ok(())
    }

    /// Worker: claims one row, writes its email, says `locked id=…` and
    /// waits in the row's transaction to be killed; or, given `pause_ms`,
    /// waits that long (the network scenario cuts its link meanwhile), runs
    /// one more statement in the transaction, and says `outcome result=…
    /// waited_ms=…`: how the claim ended, and how long that statement took.
    pub fn hold_worker(args: &Fields) -> Figures {
        let mut conn = Conn::connect(args.text("url"));
        let pause = args.get("pause_ms").map(|ms| Duration::from_millis(ms.parse().unwrap()));
        let mut asked = None;
        let claimed: Result<_, Error> = pending().build_claim().max_rows(1).each(&mut conn, |conn, order: Order| {
            email(conn, &order, -1)?;
            procs::report("locked", Fields::default().set("id", order.id));
            let Some(pause) = pause else {
                loop {
                    thread::sleep(Duration::from_secs(3600));
                }
            };
            thread::sleep(pause);
            asked = Some(Instant::now());
            diesel::select(1.into_sql::<diesel::sql_types::Integer>()).execute(conn)?;
            Ok(())
        });
        let mut figures = Figures::default();
        if pause.is_none() {
            figures.check(false, format!("the claim ended without being killed: {claimed:?}"));
            return figures;
        }
        let result = claimed.map_or_else(|error| error_kind(&error), |_| "ok".to_owned());
        let waited = asked.map_or(0, |asked| asked.elapsed().as_millis());
        procs::report("outcome", Fields::default().set("result", result).set("waited_ms", waited));
        figures
    }

    /// Worker: `threads` threads each run the claim as a worker loop
    /// (batches of 10, polling every 2 ms up to every 50 ms, and on
    /// PostgreSQL listening on `torture_orders`) until SIGTERM, which they
    /// handle by stopping gracefully; says `ready` once the handler is in.
    /// With `pooled`, one worker on an r2d2 pool runs the loops instead
    /// (`run_pooled`, `threads` loops and one listener), going on through
    /// lost connections and server restarts by itself.
    pub fn loop_worker(args: &Fields) -> Figures {
        let threads = args.number("threads") as usize;
        let first = args.number("first") as i32;
        let terminated = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        signal_hook::flag::register(signal_hook::consts::SIGTERM, terminated.clone())
            .expect("cannot handle SIGTERM");
        let stop = diesel_claim::StopHandle::from(terminated);
        procs::report("ready", &Fields::default());
        let worker_loop = || {
            let claim = pending()
                .build_claim()
                .batch(10)
                .worker(&stop)
                .poll_interval(Duration::from_millis(2), Duration::from_millis(50));
            if BACKEND == "pg" { claim.listen(CHANNEL) } else { claim }
        };
        if args.get("pooled").is_some() {
            let mut figures = Figures::default();
            let pool = crate::torture::pool_of::<Conn>(args.text("url"), threads as u32 + 1);
            // Each loop's rows are emailed as worker `first`: the pool, not
            // the thread, hands the connections out.
            let ran = worker_loop()
                .concurrency(threads)
                .run_pooled(&pool, |conn: &mut Conn, order: Order| email(conn, &order, first));
            match ran {
                Ok(report) => figures.ops += report.processed,
                Err(error) => figures.check(false, format!("pooled worker {first}: {error}")),
            }
            return figures;
        }
        in_threads(threads, |index| {
            let worker = first + index as i32;
            let mut figures = Figures::default();
            let mut conn = Conn::connect(args.text("url"));
            match worker_loop().run(&mut conn, |conn, order: Order| email(conn, &order, worker)) {
                Ok(report) => figures.ops += report.processed,
                Err(error) => figures.check(false, format!("worker {worker}: {error}")),
            }
            figures
        })
    }

    /// Scenario 24: worker loops in several processes keep up with a
    /// producer, while one process is SIGKILLed (and replaced) and another
    /// SIGSTOPped for a while; then all are sent SIGTERM, and each finishes its
    /// batch and reports. Every row is emailed exactly once.
    pub fn worker_loop(ctx: &Ctx) -> Figures {
        let rows = ctx.rows();
        let (_db, url, pool) = database(2, 0);
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        let share = (threads / processes).max(1);
        let spawn = |first: usize| {
            let args = [("url", url.clone()), ("threads", share.to_string()), ("first", first.to_string())];
            let mut worker = ctx.spawn("loop", &args);
            worker.expect("ready");
            worker
        };
        let mut workers: Vec<_> = (0..processes).map(|p| spawn(1 + p * share)).collect();
        let mut conn = pool.get().unwrap();
        let chunk = 20;
        let (mut placed, mut faults) = (0, 0);
        while placed < rows {
            let count = chunk.min(rows - placed);
            insert_orders(&mut *conn, BACKEND, count);
            if BACKEND == "pg" {
                diesel::sql_query(format!("SELECT pg_notify('{CHANNEL}', '')")).execute(&mut *conn).unwrap();
            }
            placed += count;
            thread::sleep(Duration::from_millis(5));
            if faults == 0 && placed >= rows / 3 {
                // SIGKILLed mid-work: its batch rolls back, a new process
                // takes its place, its report is lost.
                let killed = workers.remove(0);
                killed.kill();
                figures.count_error("killed");
                workers.push(spawn(1 + processes * share));
                faults += 1;
            } else if faults == 1 && placed >= 2 * rows / 3 && processes > 1 {
                let stalled = &workers[0];
                stalled.stop();
                thread::sleep(Duration::from_millis(300));
                stalled.resume();
                faults += 1;
            }
        }
        let drained = procs::time_until(Duration::from_secs(60), || {
            pending().count().get_result::<i64>(&mut *conn).is_ok_and(|left| left == 0)
        });
        figures.check(drained.is_some(), "rows still pending 60 s after the last was placed");
        for worker in &workers {
            worker.terminate();
        }
        for worker in workers {
            figures.absorb(&worker.finish());
        }
        figures.note(format!(
            "{rows} rows placed in chunks of {chunk}; 1 worker process SIGKILLed and replaced, 1 SIGSTOPped for 300 ms; the rest stopped by SIGTERM; pending rows gone {:.0?} after the last was placed",
            drained.unwrap_or_default()
        ));
        check_emails(&mut conn, &mut figures, rows as u64);
        figures
    }

    diesel::table! {
        use diesel::sql_types::*;
        use super::ClaimStamp;

        /// Jobs claimed with a visibility timeout: `times_done` counts the
        /// final writes that landed, which must be one per job. The stamp
        /// column is of the backend's claim stamp type (`CLAIM_STAMP_COLUMN`).
        timed_jobs (id) {
            id -> Integer,
            done -> Bool,
            times_done -> Integer,
            claimed_until -> Nullable<ClaimStamp>,
        }
    }

    /// Counts the jobs whose final write landed more than once as duplicates,
    /// those not done as leftovers, and a stamp left as a violation; returns
    /// the first two counts.
    pub fn check_timed_jobs(conn: &mut Conn, figures: &mut Figures) -> (i64, i64) {
        let jobs = timed_jobs::table;
        let twice: i64 = jobs.filter(timed_jobs::times_done.gt(1)).count().get_result(conn).unwrap();
        let left: i64 = jobs.filter(timed_jobs::done.eq(false)).count().get_result(conn).unwrap();
        let stamped: i64 = jobs.filter(timed_jobs::claimed_until.is_not_null()).count().get_result(conn).unwrap();
        figures.duplicates += twice as u64;
        figures.leftovers += left as u64;
        figures.check(stamped == 0, format!("{stamped} stamps left"));
        (twice, left)
    }

    /// A job of [`visibility_timeout`], as its claims load it.
    #[derive(Debug, Queryable, Selectable, Identifiable)]
    #[diesel(table_name = timed_jobs)]
    pub struct TimedJob {
        id: i32,
    }

    /// Worker: `threads` threads each claim the jobs not done with a
    /// visibility timeout of `ttl_ms`, `batch` at a time, log each run of the
    /// work (outside any transaction), pause `pause_ms`, and
    /// finish the job; a finish refused as `ClaimLost` is counted. They claim
    /// again until no job is left undone. With `persist`, a thread starts
    /// over on a new connection after any error, waiting out a server that
    /// is down.
    pub fn timed_worker(args: &Fields) -> Figures {
        let threads = args.number("threads") as usize;
        let first = args.number("first") as i32;
        let (ttl, pause) = (Duration::from_millis(args.number("ttl_ms")), Duration::from_millis(args.number("pause_ms")));
        let batch = args.number("batch") as u32;
        let persist = args.get("persist").is_some();
        in_threads(threads, |index| {
            let worker = first + index as i32;
            let mut figures = Figures::default();
            let connect = |figures: &mut Figures| {
                if persist {
                    connect_patiently(args.text("url"), figures)
                } else {
                    Conn::connect(args.text("url"))
                }
            };
            let mut conn = connect(&mut figures);
            let undone = || timed_jobs::table.filter(timed_jobs::done.eq(false));
            loop {
                let claimed = undone()
                    .select(TimedJob::as_select())
                    .build_claim()
                    .batch(batch)
                    .drain()
                    .visibility_timeout(timed_jobs::claimed_until, ttl)
                    .each(&mut conn, |conn, job: diesel_claim::Claimed<TimedJob, _>| {
                        diesel::insert_into(timed_work::table)
                            .values((timed_work::job_id.eq(job.id), timed_work::worker.eq(worker)))
                            .execute(conn)?;
                        thread::sleep(pause);
                        let done = (timed_jobs::done.eq(true), timed_jobs::times_done.eq(timed_jobs::times_done + 1));
                        match job.finish(conn, done) {
                            Err(Error::ClaimLost { .. }) => {
                                figures.count_error("ClaimLost");
                                Ok(())
                            }
                            finished => finished,
                        }
                    });
                match claimed {
                    Ok(report) => figures.ops += report.processed,
                    Err(error) if error.is_transient() => figures.saw(&error),
                    Err(error) if persist => {
                        figures.saw(&error);
                        conn = connect(&mut figures);
                    }
                    Err(error) => {
                        figures.check(false, format!("worker {worker}: {error}"));
                        return figures;
                    }
                }
                match undone().count().get_result::<i64>(&mut conn) {
                    Ok(0) => return figures,
                    // Rows whose claim has not passed yet: their stamps
                    // belong to a stalled or dead worker, or to a busy one.
                    Ok(_) => thread::sleep(Duration::from_millis(20)),
                    Err(error) => {
                        figures.saw(&error.into());
                        if persist {
                            conn = connect(&mut figures);
                        }
                    }
                }
            }
        })
    }

    /// Scenario 25: workers in several processes claim jobs with a visibility
    /// timeout, in batches, doing their work outside any transaction; one
    /// process is SIGKILLed mid-work (and replaced), another SIGSTOPped for
    /// twice the timeout and resumed. Every job's final write lands exactly
    /// once: the stalled process's late writes are refused, and the killed
    /// one's rows come back when their stamps pass. Work runs more than once
    /// only on the rows the faults hit.
    pub fn visibility_timeout(ctx: &Ctx) -> Figures {
        let rows = ctx.rows();
        let (_db, url, pool) = database(2, 0);
        let mut conn = pool.get().unwrap();
        insert_timed_jobs(&mut *conn, BACKEND, rows);
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        let share = (threads / processes).max(1);
        let ttl = Duration::from_millis(500);
        let spawn = |first: usize| {
            let args = [
                ("url", url.clone()),
                ("threads", share.to_string()),
                ("first", first.to_string()),
                ("ttl_ms", ttl.as_millis().to_string()),
                ("pause_ms", "2".to_owned()),
                ("batch", "5".to_owned()),
            ];
            ctx.spawn("timed", &args)
        };
        let started = std::time::Instant::now();
        let mut workers: Vec<_> = (0..processes).map(|p| spawn(1 + p * share)).collect();
        let done = |conn: &mut Conn| {
            timed_jobs::table.filter(timed_jobs::done.eq(true)).count().get_result::<i64>(conn).unwrap() as usize
        };
        let reached = |conn: &mut Conn, share: usize| {
            procs::time_until(Duration::from_secs(100), || done(conn) >= share).is_some()
        };
        figures.check(reached(&mut conn, rows / 3), "a third of the jobs not done in 100 s");
        // SIGKILLed mid-work: its claims stay stamped until they pass.
        workers.remove(0).kill();
        figures.count_error("killed");
        workers.push(spawn(1 + processes * share));
        if processes > 1 {
            figures.check(reached(&mut conn, 2 * rows / 3), "two thirds of the jobs not done in 100 s");
            let stalled = &workers[0];
            stalled.stop();
            thread::sleep(2 * ttl);
            stalled.resume();
        }
        for worker in workers {
            figures.absorb(&worker.finish());
        }
        let twice: i64 = timed_jobs::table.filter(timed_jobs::times_done.ne(1)).count().get_result(&mut *conn).unwrap();
        let stamped: i64 = timed_jobs::table.filter(timed_jobs::claimed_until.is_not_null()).count().get_result(&mut *conn).unwrap();
        let runs: i64 = timed_work::table.count().get_result(&mut *conn).unwrap();
        let undone = rows - done(&mut conn);
        figures.duplicates += twice as u64;
        figures.leftovers += undone as u64;
        figures.check(twice == 0, format!("{twice} jobs whose final write landed other than once"));
        figures.check(undone == 0 && stamped == 0, format!("{undone} jobs not done, {stamped} still stamped"));
        figures.note(format!(
            "{rows} jobs, visibility timeout {ttl:?}, batches of 5; 1 process SIGKILLed and replaced, 1 SIGSTOPped for {:?}; work ran {runs} times ({} repeats on rows the faults hit); {:.1?}",
            2 * ttl,
            runs - rows as i64,
            started.elapsed()
        ));
        figures.ops = rows as u64;
        figures
    }

    /// Scenario 1: workers in several processes drain the rows, one per
    /// transaction and then (on a fresh database) in batches; each row is
    /// emailed exactly once.
    pub fn drain(ctx: &Ctx) -> Figures {
        let rows = ctx.rows();
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        // Heavy runs page as a user's claim would: with pages of 100 keys,
        // which 32 workers all read, most candidates are held by others and
        // are retried in the next pass (see RELIABILITY.md, scenario 1).
        let page_size = ctx.scale.pick("100", "default").to_owned();
        for batch in [1, 50] {
            let (_db, url, pool) = database(2, rows);
            let started = std::time::Instant::now();
            let mut round = Figures::default();
            let args = [
                ("url", url),
                ("batch", batch.to_string()),
                ("page_size", page_size.clone()),
            ];
            for done in ctx.run_workers("drain", threads, processes, &args) {
                round.absorb(&done);
            }
            check_emails(&mut pool.get().unwrap(), &mut round, rows as u64);
            figures.note(format!("batch {batch}: {:.1?}", started.elapsed()));
            figures.merge(round);
        }
        figures
    }

    /// Scenario 2: while workers claim, an updater takes pending rows out of the
    /// filter. A row emailed must have matched when it was locked: no emailed
    /// row may be one the updater took out. On MariaDB the updater's
    /// statement is sometimes chosen as a deadlock victim (it locks the
    /// pending index before the row, a claim the row before the index): it
    /// is counted and the update left undone, as an application would retry it.
    pub fn double_check(ctx: &Ctx) -> Figures {
        let rows = ctx.rows();
        let (_db, url, pool) = database(2, rows);
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        let running = Running::new();
        let (flipped, victims) = (AtomicU64::new(0), AtomicU64::new(0));
        thread::scope(|scope| {
            scope.spawn(|| {
                let mut conn = pool.get().unwrap();
                let mut random = fastrand::Rng::with_seed(7);
                while running.get() {
                    let id = 1 + random.u64(..rows as u64) as i32;
                    match diesel::update(pending().filter(orders::id.eq(id)))
                        .set(orders::shipped.eq(false))
                        .execute(&mut *conn)
                        .map_err(Error::from)
                    {
                        Ok(taken_out) => flipped.fetch_add(taken_out as u64, Relaxed),
                        Err(Error::Deadlock(_)) if BACKEND == "mysql" => victims.fetch_add(1, Relaxed),
                        Err(error) => panic!("the updater failed: {error}"),
                    };
                }
            });
            let _stop_updater = running.stop_on_drop();
            let args = [("url", url), ("pause_ms", "1".to_owned())];
            for done in ctx.run_workers("drain", threads, processes, &args) {
                figures.absorb(&done);
            }
        });
        let mut conn = pool.get().unwrap();
        let emailed_after_taken_out: i64 = outbox::table
            .inner_join(orders::table)
            .filter(orders::shipped.eq(false))
            .count()
            .get_result(&mut *conn)
            .unwrap();
        figures.check(
            emailed_after_taken_out == 0,
            format!("{emailed_after_taken_out} rows processed after they stopped matching"),
        );
        let flipped = flipped.into_inner();
        figures.note(format!("taken out of the filter: {flipped}"));
        let victims = victims.into_inner();
        if victims > 0 {
            figures.note(format!("updates chosen as deadlock victims: {victims}"));
        }
        check_emails(&mut conn, &mut figures, rows as u64 - flipped);
        figures
    }

    /// Scenario 4: a worker process claims a row, writes, and is SIGKILLed
    /// before it commits. The row must be claimable again, its write gone.
    pub fn worker_killed(ctx: &Ctx) -> Figures {
        let rows = ctx.rows();
        let (_db, url, pool) = database(2, rows);
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        let mut conn = pool.get().unwrap();
        let mut slowest = Duration::ZERO;
        for _ in 0..ctx.repeats() {
            let mut holder = ctx.spawn("hold", &[("url", url.clone())]);
            let id: i32 = holder.expect("locked").text("id").parse().unwrap();
            holder.kill();
            let reclaimed = procs::time_until(Duration::from_secs(30), || {
                pending()
                    .filter(orders::id.eq(id))
                    .claim_each(&mut *conn, |conn, order: Order| email(conn, &order, 0))
                    .is_ok_and(|report| report.processed == 1)
            });
            figures.check(reclaimed.is_some(), format!("row {id} not reclaimed within 30 s"));
            slowest = slowest.max(reclaimed.unwrap_or_default());
            figures.ops += 1;
        }
        figures.note(format!("kills: {}, slowest reclaim: {slowest:.0?}", ctx.repeats()));
        for done in ctx.run_workers("drain", threads, processes, &[("url", url)]) {
            figures.absorb(&done);
        }
        check_emails(&mut conn, &mut figures, rows as u64);
        figures
    }

    /// Scenario 6: a closure that fails or panics after writing leaves its row
    /// pending and nothing written, and the pooled connection usable.
    pub fn closure_error_and_panic(ctx: &Ctx) -> Figures {
        let rows = 2 * ctx.repeats();
        let (_db, _url, pool) = database(1, rows);
        let mut figures = Figures::new(1, 1);
        for (failing, panics) in (1..=rows as i32).map(|id| (id, id % 2 == 0)) {
            let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
                pending().claim_each(&mut *pool.get().unwrap(), |conn, order: Order| {
                    email(conn, &order, 0)?;
                    match order.id == failing {
                        true if panics => panic!("{DELIBERATE} on row {failing}"),
                        true => Err(Error::InvalidArgument(format!("deliberate error on row {failing}"))),
                        false => Ok(()),
                    }
                })
            }));
            match outcome {
                Err(_) => figures.count_error("panic"),
                Ok(Err(error)) => figures.saw(&error),
                Ok(Ok(report)) => figures.check(false, format!("row {failing}: Ok({report:?})")),
            }
            let mut conn = pool.get().unwrap();
            let emails_for_it: i64 = outbox::table
                .filter(outbox::order_id.eq(failing))
                .count()
                .get_result(&mut *conn)
                .unwrap();
            figures.check(emails_for_it == 0, format!("row {failing}: its write was kept"));
            let still_pending = pending().find(failing).count().get_result::<i64>(&mut *conn);
            figures.check(still_pending == Ok(1), format!("row {failing} is not pending"));
            // Done by hand, so the next round fails on the next row.
            pending()
                .filter(orders::id.eq(failing))
                .claim_each(&mut *conn, |conn, order: Order| email(conn, &order, 0))
                .unwrap();
        }
        figures.ops = rows as u64;
        check_emails(&mut pool.get().unwrap(), &mut figures, rows as u64);
        figures
    }
}
