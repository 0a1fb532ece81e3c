//! Claiming: each row at most once, across workers.

use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::Duration;

use diesel::connection::{Instrumentation, InstrumentationEvent};
use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{ClaimReport, Error, LockStrength};

use testkit::fixtures::{
    customers, insert_jobs, jobs, on_every_backend, order_lines, orders, outbox, Job, Order,
    OrderLine,
};

type Pending = diesel::dsl::Filter<
    diesel::dsl::Filter<orders::table, diesel::dsl::Eq<orders::shipped, bool>>,
    diesel::dsl::Eq<orders::email_sent, bool>,
>;

fn pending() -> Pending {
    orders::table
        .filter(orders::shipped.eq(true))
        .filter(orders::email_sent.eq(false))
}

/// The keys of the pending orders, claimed on any blocking connection by
/// code written once with the bounds generic code names (as the guide's
/// "Diesel's `MultiConnection`" shows): the crate's own connection trait is
/// inferred from them.
fn claimed_keys<C>(conn: &mut C) -> Result<Vec<i32>, Error>
where
    C: diesel::connection::LoadConnection,
    C::Backend: diesel_claim::ClaimBackend,
    for<'q> Pending: diesel_claim::ClaimQuery<'q, C, Order>,
{
    let mut keys = Vec::new();
    pending().claim_each(conn, |_, order: Order| {
        keys.push(order.id);
        Ok::<_, Error>(())
    })?;
    Ok(keys)
}

/// Records the SQL a connection sends and the transactions it opens.
#[derive(Clone, Default)]
struct StatementLog(Arc<Mutex<Vec<String>>>);

impl StatementLog {
    fn entries(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

impl Instrumentation for StatementLog {
    fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
        let entry = match event {
            InstrumentationEvent::StartQuery { query, .. } => format!("query: {query}"),
            InstrumentationEvent::BeginTransaction { .. } => "begin".to_owned(),
            _ => return,
        };
        self.0.lock().unwrap().push(entry);
    }
}

/// The ways to claim a batch.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// `batch(n).each`: the closure per row, one transaction per batch.
    EachRow(u32),
    /// `batch(n).each_batch`.
    EachBatch(u32),
    /// `batch(n).mark(..)`: marked and processed in one transaction.
    Mark(u32),
    /// `batch(n).mark_and_commit(..)`: marked and committed, then processed.
    MarkAndCommit(u32),
}

const MODES: [Mode; 4] = [
    Mode::EachRow(7),
    Mode::EachBatch(50),
    Mode::Mark(25),
    Mode::MarkAndCommit(25),
];

/// Counts the transactions a connection opened, by their `BEGIN` statements
/// (SQLite's `BEGIN IMMEDIATE` is not reported as a transaction by Diesel).
fn begins(log: &StatementLog) -> usize {
    let begin = |entry: &&String| entry.starts_with("query: BEGIN");
    log.entries().iter().filter(begin).count()
}

/// The reads of rows a connection sent since it was last asked (page reads
/// and takes, not the closures' reads by key), from their `FROM` on,
/// without their binds.
fn reads_since(log: &StatementLog) -> Vec<String> {
    let entries = std::mem::take(&mut *log.0.lock().unwrap());
    entries
        .iter()
        .filter_map(|entry| entry.strip_prefix("query: SELECT "))
        .filter(|statement| statement.contains(" LIMIT "))
        .map(|statement| {
            let sql = statement.split(" -- binds: ").next().unwrap_or_default();
            sql[sql.find("FROM ").unwrap_or(0)..].to_owned()
        })
        .collect()
}

/// `statement`, written as PostgreSQL gets it, as `backend` gets it: SQLite
/// and MySQL bind `?` and quote names with backquotes (as Diesel writes
/// them); MySQL locks `FOR UPDATE`, without `OF`; SQLite has no row locks.
fn as_sent_to(backend: &str, statement: &str) -> String {
    if backend == "pg" {
        return statement.to_owned();
    }
    let mut sql = String::with_capacity(statement.len());
    let mut chars = statement.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '$' {
            sql.push(c);
            continue;
        }
        while chars.next_if(char::is_ascii_digit).is_some() {}
        sql.push('?');
    }
    let locking = sql
        .find(" FOR NO KEY UPDATE OF ")
        .map(|at| sql.split_off(at));
    let sql = sql.replace('"', "`");
    match locking {
        Some(_) if backend == "mysql" => sql + " FOR UPDATE SKIP LOCKED",
        _ => sql,
    }
}

on_every_backend! {
    /// Inserts `count` shipped orders whose email is not sent yet.
    pub fn insert_pending(conn: &mut Conn, count: usize) {
        for chunk in vec![(orders::shipped.eq(true),); count].chunks(500) {
            diesel::insert_into(orders::table)
                .values(chunk.to_vec())
                .execute(conn)
                .expect("cannot insert orders");
        }
    }

    /// "Sends" the email: one outbox row, then marks the order done.
    pub fn send_email(conn: &mut Conn, order: &Order, worker: i32) -> QueryResult<()> {
        diesel::insert_into(outbox::table)
            .values((outbox::order_id.eq(order.id), outbox::worker.eq(worker)))
            .execute(conn)?;
        diesel::update(order)
            .set(orders::email_sent.eq(true))
            .execute(conn)?;
        Ok(())
    }

    /// `(emails sent, duplicate emails beyond one per order, shipped orders still pending)`.
    pub fn email_figures(conn: &mut Conn) -> (i64, i64, i64) {
        let sent: i64 = outbox::table.count().get_result(conn).unwrap();
        let distinct: i64 = outbox::table
            .select(outbox::order_id)
            .distinct()
            .load::<i32>(conn)
            .unwrap()
            .len() as i64;
        let left: i64 = pending().count().get_result(conn).unwrap();
        (sent, sent - distinct, left)
    }

    /// Runs `work` on `workers` threads, each with a pooled connection of its
    /// own, released together by a barrier so that they contend; returns
    /// what each returned, in worker order.
    pub fn on_workers<T: Send>(pool: &Pool, workers: usize, work: impl Fn(&mut Conn, usize) -> T + Sync) -> Vec<T> {
        let start = Barrier::new(workers);
        thread::scope(|scope| {
            let handles: Vec<_> = (0..workers)
                .map(|worker| {
                    let (start, work) = (&start, &work);
                    scope.spawn(move || {
                        let mut pooled = pool.get().unwrap();
                        start.wait();
                        work(&mut pooled, worker)
                    })
                })
                .collect();
            handles.into_iter().map(|handle| handle.join().unwrap()).collect()
        })
    }
    /// Orders, workers (and pool size) for the concurrent drain: SQLite commits
    /// one writer at a time, so it gets a smaller run.
    const WORKERS: usize = if ROW_LOCKS { 8 } else { 4 };
    const ORDERS: usize = if ROW_LOCKS { 2_000 } else { 400 };

    /// Workers each draining the same query: duplicates 0, leftovers 0. Without
    /// the lock, `naive_workers_process_rows_twice` shows the same workload
    /// double-processing.
    #[test]
    fn concurrent_workers_process_each_row_exactly_once() {
        let (_db, pool) = test_db(WORKERS as u32 + 1);
        insert_pending(&mut pool.get().unwrap(), ORDERS);

        let reports: Vec<ClaimReport> = on_workers(&pool, WORKERS, |conn, worker| {
            pending()
                .claim_each(conn, |conn, order: Order| {
                    send_email(conn, &order, worker as i32)?;
                    Ok::<_, Error>(())
                })
                .unwrap()
        });

        let mut conn = pool.get().unwrap();
        let (sent, duplicates, left) = email_figures(&mut conn);
        let processed: u64 = reports.iter().map(|r| r.processed).sum();
        let busy_workers = reports.iter().filter(|r| r.processed > 0).count();
        eprintln!(
            "{WORKERS} workers, {ORDERS} orders: processed {processed}, emails {sent}, \
             duplicates {duplicates}, left {left}, workers that claimed rows {busy_workers}"
        );
        assert_eq!((sent, duplicates, left), (ORDERS as i64, 0, 0));
        assert_eq!(processed, ORDERS as u64);
    }

    /// Code generic over the connection claims on a pooled connection and
    /// on the connection inside it.
    #[test]
    fn generic_code_claims_on_any_blocking_connection() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        insert_pending(&mut pooled, 3);
        assert_eq!(claimed_keys(&mut pooled).unwrap(), [1, 2, 3]);
        assert_eq!(claimed_keys(&mut *pooled).unwrap(), [1, 2, 3]);
    }

    /// Boxed queries, built at run time, are claimed through `rebuild`: the
    /// same guarantees with the filter chosen at run time, per row, in
    /// batches and marked.
    #[test]
    fn boxed_queries_are_claimed_through_rebuild() {
        let (_db, pool) = test_db(WORKERS as u32 + 1);
        insert_pending(&mut pool.get().unwrap(), ORDERS);
        let only_shipped = std::hint::black_box(true);
        let boxed = || {
            let mut query = orders::table.filter(orders::email_sent.eq(false)).into_boxed();
            if only_shipped {
                query = query.filter(orders::shipped.eq(true));
            }
            query
        };
        let start = Barrier::new(WORKERS);
        let processed: u64 = thread::scope(|scope| {
            let workers: Vec<_> = (0..WORKERS)
                .map(|worker| {
                    let (pool, start) = (&pool, &start);
                    scope.spawn(move || {
                        let mut conn = pool.get().unwrap();
                        start.wait();
                        let pending = diesel_claim::rebuild(boxed);
                        let report = match worker % 3 {
                            0 => pending.claim_each(&mut conn, |conn, order: Order| {
                                send_email(conn, &order, worker as i32)
                            }),
                            1 => pending.build_claim().batch(7).each(&mut conn, |conn, order: Order| {
                                send_email(conn, &order, worker as i32)
                            }),
                            _ => pending
                                .build_claim()
                                .batch(7)
                                .mark(orders::email_sent.eq(true))
                                .each(&mut conn, |conn, order: Order| {
                                    diesel::insert_into(outbox::table)
                                        .values((outbox::order_id.eq(order.id), outbox::worker.eq(worker as i32)))
                                        .execute(conn)
                                        .map(drop)
                                }),
                        };
                        report.unwrap().processed
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum()
        });
        let mut conn = pool.get().unwrap();
        assert_eq!(email_figures(&mut conn), (ORDERS as i64, 0, 0));
        assert_eq!(processed, ORDERS as u64);

        // What the boxed query refuses is refused through `rebuild` too.
        let limited = diesel_claim::rebuild(|| orders::table.into_boxed().limit(3))
            .claim_each(&mut conn, |_, _: Order| Ok::<_, Error>(()));
        assert!(matches!(limited, Err(Error::InvalidArgument(_))), "{limited:?}");
    }

    /// A primary key of two columns: candidates are paged and locked by
    /// `(order_id, line_no)` as a row value, and concurrent workers pack each
    /// line once, per row, in batches and marked; a loaded line is locked and
    /// read again by its two columns.
    #[test]
    fn composite_keys_are_claimed_once() {
        const ORDERS_WITH_LINES: i32 = 40;
        const LINES: i32 = 5;
        let (_db, pool) = test_db(WORKERS as u32 + 1);
        let rows: Vec<_> = (1..=ORDERS_WITH_LINES)
            .flat_map(|order| (1..=LINES).map(move |line| (order_lines::order_id.eq(order), order_lines::line_no.eq(line))))
            .collect();
        diesel::insert_into(order_lines::table).values(&rows).execute(&mut pool.get().unwrap()).unwrap();
        let unpacked = || order_lines::table.filter(order_lines::packed.eq(false));
        let pack = |conn: &mut Conn, line: &OrderLine, mark: bool| -> QueryResult<()> {
            if mark {
                diesel::update(line).set(order_lines::times_packed.eq(order_lines::times_packed + 1)).execute(conn)?;
            } else {
                diesel::update(line)
                    .set((order_lines::packed.eq(true), order_lines::times_packed.eq(order_lines::times_packed + 1)))
                    .execute(conn)?;
            }
            Ok(())
        };
        let processed: u64 = on_workers(&pool, WORKERS, |conn, worker| {
            let report = match worker % 3 {
                0 => unpacked().claim_each(conn, |conn, line: OrderLine| pack(conn, &line, false)),
                1 => unpacked().build_claim().batch(7).each(conn, |conn, line: OrderLine| pack(conn, &line, false)),
                _ => unpacked()
                    .build_claim()
                    .batch(7)
                    .mark(order_lines::packed.eq(true))
                    .each(conn, |conn, line: OrderLine| pack(conn, &line, true)),
            };
            report.unwrap().processed
        })
        .into_iter()
        .sum();
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        let lines: Vec<OrderLine> = order_lines::table.select(OrderLine::as_select()).load(conn).unwrap();
        assert_eq!(processed, (ORDERS_WITH_LINES * LINES) as u64);
        assert!(lines.iter().all(|line| line.packed && line.times_packed == 1), "{lines:?}");

        let line = lines[7].clone();
        let fresh = line
            .with_lock(conn, |conn, fresh: OrderLine| {
                diesel::update(&fresh).set(order_lines::times_packed.eq(fresh.times_packed + 1)).execute(conn)?;
                Ok::<_, Error>(fresh)
            })
            .unwrap();
        assert_eq!((fresh.order_id, fresh.line_no), (line.order_id, line.line_no));
        let after: OrderLine = order_lines::table.find((line.order_id, line.line_no)).first(conn).unwrap();
        assert_eq!(after.times_packed, 2);
    }

    /// The control for the test above: the same workload with the re-check but
    /// without the lock sends some emails twice, so the figures above would catch
    /// a claim that stopped locking.
    /// Finishes a job, counting how often it was done.
    pub fn finish_job(conn: &mut Conn, job: &Job) -> QueryResult<()> {
        diesel::update(job)
            .set((jobs::done.eq(true), jobs::times_done.eq(jobs::times_done + 1)))
            .execute(conn)
            .map(drop)
    }

    /// The query's `ORDER BY` is the claim order, the key breaking ties (the
    /// jobs tie on priority and due time): per row, across small pages, in
    /// batches, draining, marked, through `rebuild` with a boxed filter, and
    /// `max_rows` takes the first rows in that order. Terms may be bare,
    /// `.asc()` or `.desc()`, in a tuple or added by `then_order_by`.
    #[test]
    fn claims_follow_the_query_order() {
        type Backend = <Conn as Connection>::Backend;
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        let queue = || {
            jobs::table
                .filter(jobs::done.eq(false))
                .order((jobs::priority.desc(), jobs::due))
                .select(Job::as_select())
        };
        let boxed_filter = || -> Box<dyn BoxableExpression<jobs::table, Backend, SqlType = diesel::sql_types::Bool>> {
            Box::new(jobs::done.eq(false))
        };
        for way in 0..10 {
            diesel::delete(jobs::table).execute(conn).unwrap();
            let expected = insert_jobs(conn, 60);
            let seen = std::cell::RefCell::new(Vec::new());
            let record = |conn: &mut Conn, job: Job| {
                seen.borrow_mut().push(job.id);
                finish_job(conn, &job)
            };
            let report = match way {
                0 => queue().claim_each(conn, record),
                1 => queue().build_claim().page_size(7).each(conn, record),
                2 => queue().build_claim().batch(4).page_size(10).each(conn, record),
                3 => queue().build_claim().drain().batch(3).page_size(8).each(conn, record),
                4 => queue()
                    .build_claim()
                    .batch(5)
                    .page_size(12)
                    .mark(jobs::done.eq(true))
                    .each_batch(conn, |conn, batch: Vec<Job>| {
                        batch.into_iter().try_for_each(|job| record(conn, job))
                    }),
                5 => diesel_claim::rebuild(|| {
                    jobs::table
                        .filter(boxed_filter())
                        .order_by(jobs::priority.desc())
                        .then_order_by(jobs::due.asc())
                        .select(Job::as_select())
                })
                .build_claim()
                .batch(6)
                .each(conn, record),
                7 => queue().build_claim().from_head().each(conn, record),
                8 => queue().build_claim().from_head().batch(7).drain().each(conn, record),
                _ => {
                    let report = queue().build_claim().max_rows(10).each(conn, record).unwrap();
                    assert_eq!(*seen.borrow(), expected[..10], "max_rows");
                    // No more candidates read than it may take.
                    assert_eq!((report.processed, report.not_reached), (10, 0));
                    continue;
                }
            }
            .unwrap();
            assert_eq!(*seen.borrow(), expected, "way {way}");
            assert_eq!(report.processed, 60, "way {way}");
            let done: Vec<i32> = jobs::table.select(jobs::times_done).load(conn).unwrap();
            assert!(done.iter().all(|times| *times == 1), "way {way}: {done:?}");
        }
        // Nothing pending: one statement, no transaction.
        diesel::update(jobs::table).set(jobs::done.eq(true)).execute(conn).unwrap();
        let log = StatementLog::default();
        conn.set_instrumentation(log.clone());
        let report = queue().claim_each(conn, |conn, job: Job| finish_job(conn, &job)).unwrap();
        assert_eq!(report.processed, 0);
        let entries = log.entries();
        assert_eq!(entries.len(), 1, "{entries:#?}");
        assert!(entries[0].starts_with("query: SELECT"), "{entries:#?}");
    }

    /// The statements as this backend gets them: a take orders by the
    /// query's order, then by the key's columns that order leaves tied, each
    /// column once (a key column among the order's terms is not repeated
    /// after them, whichever its direction); a take or a page from the head
    /// of the query adds nothing to its filter, and one past a position adds
    /// the range. Plain, ordered and composite-key queries, from a worker's
    /// takes and from a call's pages.
    #[test]
    fn statements_order_by_each_column_once_and_add_no_empty_condition() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        let log = StatementLog::default();
        conn.set_instrumentation(log.clone());
        let stop = diesel_claim::StopHandle::new();
        let work = |conn: &mut Conn, job: Job| finish_job(conn, &job);
        let pack = |conn: &mut Conn, line: OrderLine| {
            diesel::update(&line).set(order_lines::packed.eq(true)).execute(conn).map(drop)
        };
        let jobs_left = |conn: &mut Conn| {
            diesel::delete(jobs::table).execute(conn).unwrap();
            insert_jobs(conn, 3);
            let _ = reads_since(&log);
        };
        // Tied on either key column across a page of two: ordered by one of
        // them, the second page finds its row by the other.
        let lines_left = |conn: &mut Conn| {
            diesel::delete(order_lines::table).execute(conn).unwrap();
            let rows: Vec<_> = [(1, 1), (1, 2), (2, 1)]
                .map(|(order, line)| (order_lines::order_id.eq(order), order_lines::line_no.eq(line)))
                .to_vec();
            diesel::insert_into(order_lines::table).values(&rows).execute(conn).unwrap();
            let _ = reads_since(&log);
        };
        let pending = || jobs::table.filter(jobs::done.eq(false)).select(Job::as_select());
        let unpacked = || order_lines::table.filter(order_lines::packed.eq(false)).select(OrderLine::as_select());
        let (mut first_takes, mut later_pages) = (Vec::new(), Vec::new());
        macro_rules! statements {
            ($reset:ident, $queue:expr, $work:expr) => {{
                $reset(conn);
                $queue.build_claim().worker(&stop).stop_when_empty().run(conn, $work).unwrap();
                first_takes.push(reads_since(&log).remove(0));
                // In pages of two: the first page, its two takes, then the
                // second page, past the first.
                $reset(conn);
                let report = $queue.build_claim().page_size(2).each(conn, $work).unwrap();
                assert_eq!(report.processed, 3);
                later_pages.push(reads_since(&log).remove(3));
            }};
        }
        statements!(jobs_left, pending(), work);
        statements!(jobs_left, pending().order(jobs::priority.desc()), work);
        statements!(jobs_left, pending().order(jobs::id), work);
        statements!(jobs_left, pending().order(jobs::id.desc()), work);
        statements!(jobs_left, pending().order((jobs::priority.desc(), jobs::id.desc())), work);
        statements!(lines_left, unpacked(), pack);
        statements!(lines_left, unpacked().order(order_lines::order_id.desc()), pack);
        statements!(lines_left, unpacked().order(order_lines::line_no), pack);
        statements!(lines_left, unpacked().order((order_lines::line_no, order_lines::order_id)), pack);
        let table_of = |order: &str| if order.contains("order_lines") { "order_lines" } else { "jobs" };
        let filter_of = |table: &str| {
            if table == "jobs" { r#"("jobs"."done" = $1)"# } else { r#"("order_lines"."packed" = $1)"# }
        };
        let take = |order: &str| {
            let table = table_of(order);
            let filter = filter_of(table);
            as_sent_to(
                BACKEND,
                &format!(r#"FROM "{table}" WHERE {filter} ORDER BY {order} LIMIT $2 FOR NO KEY UPDATE OF "{table}" SKIP LOCKED"#),
            )
        };
        // A page past a position: its range's binds follow the filter's.
        let page = |order: &str, past: &str| {
            let table = table_of(order);
            let filter = filter_of(table);
            let limit = past.matches('$').count() + 2;
            as_sent_to(BACKEND, &format!(r#"FROM "{table}" WHERE ({filter} AND ({past})) ORDER BY {order} LIMIT ${limit}"#))
        };
        let expected = [
            take(r#""jobs"."id""#),
            take(r#""jobs"."priority" DESC, "jobs"."id""#),
            take(r#""jobs"."id" ASC"#),
            take(r#""jobs"."id" DESC"#),
            take(r#""jobs"."priority" DESC, "jobs"."id" DESC"#),
            take(r#""order_lines"."order_id", "order_lines"."line_no""#),
            take(r#""order_lines"."order_id" DESC, "order_lines"."line_no""#),
            take(r#""order_lines"."line_no" ASC, "order_lines"."order_id""#),
            take(r#""order_lines"."line_no" ASC, "order_lines"."order_id" ASC"#),
        ];
        assert_eq!(first_takes, expected);
        // The key compared once: where the order holds it, its last term is
        // compared alone; where it holds some of its columns, the key
        // compares the others alone, whichever the term's direction. A
        // composite key after a position is a row value, which MySQL reads
        // without its index, so it gets it column by column.
        let lines_after = |first: usize| {
            let (order_id, line_no) = (r#""order_lines"."order_id""#, r#""order_lines"."line_no""#);
            let (second, third) = (first + 1, first + 2);
            match BACKEND {
                "mysql" => format!("({order_id} >= ${first} AND ({order_id} > ${second} OR {line_no} > ${third}))"),
                _ => format!("({order_id}, {line_no}) > (${first}, ${second})"),
            }
        };
        let expected = [
            page(r#""jobs"."id""#, r#""jobs"."id" > $2"#),
            page(
                r#""jobs"."priority" DESC, "jobs"."id""#,
                r#"("jobs"."priority" <= $2 AND ("jobs"."priority" < $3 OR "jobs"."id" > $4))"#,
            ),
            page(r#""jobs"."id" ASC"#, r#""jobs"."id" > $2"#),
            page(r#""jobs"."id" DESC"#, r#""jobs"."id" < $2"#),
            page(
                r#""jobs"."priority" DESC, "jobs"."id" DESC"#,
                r#"("jobs"."priority" <= $2 AND ("jobs"."priority" < $3 OR "jobs"."id" < $4))"#,
            ),
            page(r#""order_lines"."order_id", "order_lines"."line_no""#, &lines_after(2)),
            page(
                r#""order_lines"."order_id" DESC, "order_lines"."line_no""#,
                r#"("order_lines"."order_id" <= $2 AND ("order_lines"."order_id" < $3 OR "order_lines"."line_no" > $4))"#,
            ),
            page(
                r#""order_lines"."line_no" ASC, "order_lines"."order_id""#,
                r#"("order_lines"."line_no" >= $2 AND ("order_lines"."line_no" > $3 OR "order_lines"."order_id" > $4))"#,
            ),
            page(
                r#""order_lines"."line_no" ASC, "order_lines"."order_id" ASC"#,
                r#"("order_lines"."line_no" >= $2 AND ("order_lines"."line_no" > $3 OR "order_lines"."order_id" > $4))"#,
            ),
        ];
        assert_eq!(later_pages, expected);

        // A call in pages of two: the first page from the head, a take within
        // it (from its first row through its last), and the next page, past
        // it.
        jobs_left(conn);
        pending().order(jobs::priority.desc()).build_claim().page_size(2).each(conn, work).unwrap();
        let reads = reads_since(&log);
        let order = r#"ORDER BY "jobs"."priority" DESC, "jobs"."id""#;
        let from = r#"("jobs"."priority" <= $2 AND ("jobs"."priority" < $3 OR "jobs"."id" >= $4))"#;
        let through = r#"("jobs"."priority" >= $5 AND ("jobs"."priority" > $6 OR "jobs"."id" <= $7))"#;
        let past = r#"("jobs"."priority" <= $2 AND ("jobs"."priority" < $3 OR "jobs"."id" > $4))"#;
        let expected = [
            format!(r#"FROM "jobs" WHERE ("jobs"."done" = $1) {order} LIMIT $2"#),
            format!(
                r#"FROM "jobs" WHERE (("jobs"."done" = $1) AND ({from} AND {through})) {order} LIMIT $8 FOR NO KEY UPDATE OF "jobs" SKIP LOCKED"#
            ),
            format!(r#"FROM "jobs" WHERE (("jobs"."done" = $1) AND ({past})) {order} LIMIT $5"#),
        ];
        let expected = expected.map(|statement| as_sent_to(BACKEND, &statement));
        assert_eq!([&reads[0], &reads[1], &reads[3]], expected.each_ref(), "{reads:#?}");
    }

    /// Workers claiming the same queue in priority order, per row, in
    /// batches and marked, do every job once.
    #[test]
    fn ordered_claims_by_concurrent_workers_do_each_job_once() {
        let jobs_count: i32 = if ROW_LOCKS { 600 } else { 200 };
        let (_db, pool) = test_db(WORKERS as u32 + 1);
        insert_jobs(&mut pool.get().unwrap(), jobs_count);
        let queue = || {
            jobs::table
                .filter(jobs::done.eq(false))
                .order((jobs::priority.desc(), jobs::due))
                .select(Job::as_select())
        };
        let processed: u64 = on_workers(&pool, WORKERS, |conn, worker| {
            let report = match worker % 3 {
                0 => queue().claim_each(conn, |conn, job: Job| finish_job(conn, &job)),
                1 => queue().build_claim().batch(5).each(conn, |conn, job: Job| finish_job(conn, &job)),
                _ => queue()
                    .build_claim()
                    .batch(5)
                    .mark(jobs::done.eq(true))
                    .each(conn, |conn, job: Job| finish_job(conn, &job)),
            };
            report.unwrap().processed
        })
        .into_iter()
        .sum();
        let done: Vec<i32> = jobs::table.select(jobs::times_done).load(&mut pool.get().unwrap()).unwrap();
        assert_eq!(processed, jobs_count as u64);
        assert!(done.iter().all(|times| *times == 1), "{done:?}");
    }

    /// A boxed query's order is not in its type, so a claim cannot follow it:
    /// refused before any SQL, saying what to write instead.
    #[test]
    fn a_boxed_query_with_an_order_is_refused_before_any_sql() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_jobs(&mut conn, 5);
        let log = StatementLog::default();
        conn.set_instrumentation(log.clone());
        let boxed = diesel_claim::rebuild(|| {
            jobs::table
                .filter(jobs::done.eq(false))
                .order(jobs::priority.desc())
                .select(Job::as_select())
                .into_boxed()
        });
        let refused = boxed.claim_each(&mut conn, |conn, job: Job| finish_job(conn, &job)).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "invalid argument: the order of a boxed query cannot be read, so a claim cannot \
             follow it: box the filter instead of the query (`.filter(dynamic_filter)` with a \
             `Box<dyn BoxableExpression<…>>`, then `.order_by(…)`), or drop the order to claim \
             in key order"
        );
        assert_eq!(log.entries(), Vec::<String>::new());
    }

    #[test]
    fn naive_workers_process_rows_twice() {
        let (_db, pool) = test_db(5);
        insert_pending(&mut pool.get().unwrap(), 100);
        let start = Barrier::new(4);
        thread::scope(|scope| {
            for worker in 0..4 {
                let (pool, start) = (&pool, &start);
                scope.spawn(move || {
                    let mut conn = pool.get().unwrap();
                    start.wait();
                    let candidates: Vec<i32> = pending().select(orders::id).load(&mut conn).unwrap();
                    for id in candidates {
                        let still_pending: Option<Order> = pending()
                            .filter(orders::id.eq(id))
                            .select(Order::as_select())
                            .first(&mut conn)
                            .optional()
                            .unwrap();
                        if let Some(order) = still_pending {
                            thread::sleep(Duration::from_millis(1));
                            send_email(&mut conn, &order, worker).unwrap();
                        }
                    }
                });
            }
        });
        let (_, duplicates, left) = email_figures(&mut pool.get().unwrap());
        eprintln!("without the lock: {duplicates} duplicate emails for 100 orders");
        assert_eq!(left, 0);
        assert!(duplicates > 0, "the unlocked control should double-process");
    }

    #[test]
    fn nothing_pending_is_one_query_and_no_transaction() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        let log = StatementLog::default();
        conn.set_instrumentation(log.clone());
        let report = pending().claim_each(&mut conn, |_, _: Order| Ok::<_, Error>(())).unwrap();
        assert_eq!((report.processed, report.skipped, report.passes), (0, 0, 1));
        let entries = log.entries();
        assert_eq!(entries.len(), 1, "{entries:#?}");
        assert!(entries[0].starts_with("query: SELECT"), "{entries:#?}");
    }

    /// A call whose `max_rows` one take can reach reads no candidates: its
    /// only statements are the take and the closure's own. An ordered queue
    /// read `max_rows(1)` at a time is the job runner's loop.
    #[test]
    fn a_claim_that_one_take_can_finish_reads_no_candidates() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        insert_jobs(conn, 20);
        let queue = || jobs::table.filter(jobs::done.eq(false)).order(jobs::priority.desc()).select(Job::as_select());
        let log = StatementLog::default();
        conn.set_instrumentation(log.clone());
        for (max_rows, batch) in [(1, 1), (3, 5)] {
            let mut taken = Vec::new();
            let report = queue()
                .build_claim()
                .batch(batch)
                .max_rows(max_rows)
                .each(conn, |conn, job: Job| {
                    taken.push(job.id);
                    finish_job(conn, &job)
                })
                .unwrap();
            assert_eq!(report.processed, max_rows);
            let selects: Vec<String> = log
                .entries()
                .into_iter()
                .filter(|entry| entry.starts_with("query: SELECT"))
                .collect();
            assert_eq!(selects.len(), 1, "{selects:#?}");
            assert!(selects[0].contains("LIMIT"), "{selects:#?}");
            log.0.lock().unwrap().clear();
        }
        // The first four of the queue: priority 3, the key breaking ties.
        let done: Vec<i32> =
            jobs::table.filter(jobs::done.eq(true)).select(jobs::id).order(jobs::id).load(conn).unwrap();
        assert_eq!(done, [3, 7, 11, 15]);
    }

    #[test]
    fn closure_error_rolls_back_that_row_and_ends_the_call() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 5);
        let result = pending().claim_each(&mut conn, |conn, order: Order| {
            send_email(conn, &order, 0)?;
            if order.id == 3 {
                return Err(Error::InvalidArgument("mail server down".into()));
            }
            Ok(())
        });
        assert!(matches!(result, Err(Error::InvalidArgument(message)) if message == "mail server down"));
        let still_pending: Vec<i32> = pending().select(orders::id).load(&mut conn).unwrap();
        assert_eq!(still_pending, [3, 4, 5]);
        let emails: Vec<i32> = outbox::table.select(outbox::order_id).order(outbox::order_id).load(&mut conn).unwrap();
        assert_eq!(emails, [1, 2], "the failed row's write is rolled back");
    }

    #[test]
    fn panic_rolls_back_and_leaves_the_connection_usable() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 2);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pending().claim_each(&mut conn, |conn, order: Order| {
                send_email(conn, &order, 0)?;
                panic!("worker bug");
                #[allow(unreachable_code)]
                Ok::<_, Error>(())
            })
        }));
        assert!(panicked.is_err());
        // Not left in a transaction: claiming again is allowed and finds both.
        let mut seen = Vec::new();
        let report = pending()
            .claim_each(&mut conn, |_, order: Order| {
                seen.push(order.id);
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!((report.processed, seen), (2, vec![1, 2]));
        let emails: i64 = outbox::table.count().get_result(&mut conn).unwrap();
        assert_eq!(emails, 0, "no partial write survives the panic");
    }

    /// Diesel's `transaction` does not roll back when a panic goes through it;
    /// the claim still unwinds every level it opened.
    #[test]
    fn panic_inside_a_nested_transaction_unwinds_every_level() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 1);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pending().claim_each(&mut conn, |conn, order: Order| {
                conn.transaction(|conn| {
                    send_email(conn, &order, 0)?;
                    panic!("worker bug");
                    #[allow(unreachable_code)]
                    Ok::<_, Error>(())
                })
            })
        }));
        assert!(panicked.is_err());
        // Another worker can claim the row: no lock is left behind.
        let mut other = pool.get().unwrap();
        let report = pending()
            .build_claim()
            .nowait()
            .each(&mut other, |_, _: Order| Ok::<_, Error>(()))
            .unwrap();
        assert_eq!(report.processed, 1);
        let emails: i64 = outbox::table.count().get_result(&mut other).unwrap();
        assert_eq!(emails, 0, "no partial write survives the panic");
        // And the panicking connection is not left in a transaction.
        pending()
            .claim_each(&mut conn, |_, _: Order| Ok::<_, Error>(()))
            .unwrap();
    }

    #[test]
    fn max_rows_caps_the_call_and_small_pages_see_every_row() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 10);
        let capped = pending()
            .build_claim()
            .max_rows(3)
            .each(&mut conn, |conn, order: Order| Ok::<_, Error>(send_email(conn, &order, 0)?))
            .unwrap();
        // The call reads no more candidates than it may take: none is left
        // unreached, and none skipped.
        assert_eq!((capped.processed, capped.skipped, capped.not_reached), (3, 0, 0));
        let rest = pending()
            .build_claim()
            .page_size(3)
            .each(&mut conn, |conn, order: Order| Ok::<_, Error>(send_email(conn, &order, 0)?))
            .unwrap();
        assert_eq!(rest.processed, 7);
        assert_eq!(email_figures(&mut conn), (10, 0, 0));
    }

    /// Candidates a call did not process are told apart: gone (no longer
    /// matching when the call came to them), not locked; and with `max_rows`,
    /// a call reads no more candidates than it may take, so none is left
    /// unreached.
    #[test]
    fn skipped_candidates_are_gone_or_not_reached() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 6);
        let report = pending()
            .build_claim()
            .max_rows(3)
            .each(&mut conn, |conn, order: Order| {
                if order.id == 1 {
                    // Order 2 is done in this transaction, as if by another job.
                    diesel::update(orders::table.find(2)).set(orders::email_sent.eq(true)).execute(conn)?;
                }
                Ok::<_, Error>(send_email(conn, &order, 0)?)
            })
            .unwrap();
        assert_eq!(
            (report.processed, report.gone, report.locked, report.skipped, report.not_reached),
            (3, 1, 0, 1, 0),
            "{report:?}"
        );
    }

    /// A closure that forgets to clear the filter must not loop: each row once per
    /// call, with or without draining.
    #[test]
    fn a_row_left_matching_is_processed_once_per_call() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 5);
        for claim in [pending().build_claim(), pending().build_claim().drain()] {
            let mut seen = Vec::new();
            let report = claim
                .page_size(2)
                .each(&mut conn, |_, order: Order| {
                    seen.push(order.id);
                    Ok::<_, Error>(())
                })
                .unwrap();
            assert_eq!(seen, [1, 2, 3, 4, 5]);
            assert_eq!(report.processed, 5);
        }
        // From the head too: each take meets the rows left matching first.
        for claim in [pending().build_claim().from_head(), pending().build_claim().from_head().drain()] {
            let mut seen = Vec::new();
            let report = claim
                .batch(2)
                .each(&mut conn, |_, order: Order| {
                    seen.push(order.id);
                    Ok::<_, Error>(())
                })
                .unwrap();
            assert_eq!(seen, [1, 2, 3, 4, 5]);
            assert_eq!(report.processed, 5);
        }
    }

    /// Rows that became pending during the call: draining picks them up in passes of
    /// their own, one pass when its takes come to them.
    #[test]
    fn drain_picks_up_rows_added_during_the_call() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        for drain in [false, true] {
            diesel::delete(outbox::table).execute(&mut conn).unwrap();
            diesel::delete(orders::table).execute(&mut conn).unwrap();
            insert_pending(&mut conn, 3);
            let claim = pending().build_claim();
            let claim = if drain { claim.drain() } else { claim };
            let mut added = false;
            let report = claim
                .each(&mut conn, |conn, order: Order| {
                    if !added {
                        insert_pending(conn, 1);
                        added = true;
                    }
                    Ok::<_, Error>(send_email(conn, &order, 0)?)
                })
                .unwrap();
            // One pass takes the rows beyond the page too, once it comes to
            // them; a drain (whose batches keep to their page) reads them in a
            // pass of their own.
            let expected = if drain { (4, 3) } else { (4, 1) };
            assert_eq!((report.processed, report.passes), expected, "drain: {drain}");
        }
    }

    /// A join to many rows repeats each order; it is still claimed once per call.
    #[test]
    fn one_to_many_joins_claim_each_row_once() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 3);
        let orders_with_emails = pending()
            .inner_join(outbox::table)
            .select(Order::as_select());
        for order_id in [1, 1, 2, 2, 3, 3] {
            diesel::insert_into(outbox::table)
                .values((outbox::order_id.eq(order_id), outbox::worker.eq(0)))
                .execute(&mut conn)
                .unwrap();
        }
        let mut seen = Vec::new();
        orders_with_emails
            .claim_each(&mut conn, |_, order: Order| {
                seen.push(order.id);
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!(seen, [1, 2, 3]);
    }

    #[test]
    fn join_queries_claim_the_selected_table() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        diesel::insert_into(customers::table)
            .values(vec![
                (customers::name.eq("ada"), customers::vip.eq(true)),
                (customers::name.eq("bob"), customers::vip.eq(false)),
            ])
            .execute(&mut conn)
            .unwrap();
        diesel::insert_into(orders::table)
            .values(vec![orders::customer_id.eq(Some(1)), orders::customer_id.eq(Some(2))])
            .execute(&mut conn)
            .unwrap();
        let vip_pending = pending()
            .inner_join(customers::table)
            .filter(customers::vip.eq(true))
            .select(Order::as_select());
        let mut seen = Vec::new();
        vip_pending
            .claim_each(&mut conn, |conn, order: Order| {
                seen.push(order.id);
                send_email(conn, &order, 0)?;
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!(seen, [1]);
    }

    #[test]
    fn bad_options_and_call_sites_are_rejected_before_any_sql() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        let log = StatementLog::default();
        conn.set_instrumentation(log.clone());
        let run = |claim: diesel_claim::ClaimBuilder<_>, conn: &mut Conn| {
            claim.each(conn, |_, _: Order| Ok::<_, Error>(()))
        };
        for claim in [
            pending().build_claim().skip_locked().nowait(),
            pending().build_claim().nowait().wait(),
            pending().build_claim().max_rows(0),
            pending().build_claim().page_size(0),
            // Shared locks would let two claimers process the same row.
            pending().build_claim().strength(LockStrength::Share),
            pending().build_claim().strength(LockStrength::KeyShare),
        ] {
            assert!(matches!(run(claim, &mut conn), Err(Error::InvalidArgument(_))));
        }
        assert_eq!(log.entries(), Vec::<String>::new());

        // Inside a transaction every row's lock would be held to the end.
        let inside = conn.transaction(|conn| {
            Ok::<_, Error>(pending().claim_each(conn, |_, _: Order| Ok::<_, Error>(())))
        });
        assert!(matches!(inside, Ok(Err(Error::InvalidArgument(_)))));
    }

    /// What a claim cannot honour in the query is refused before any SQL,
    /// with a message that says what to do instead; nothing is processed.
    #[test]
    fn distinct_limit_and_offset_are_refused_before_any_sql() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 20);
        let log = StatementLog::default();
        conn.set_instrumentation(log.clone());
        let limit = "invalid argument: a claimed query cannot have a LIMIT or OFFSET, which the \
                     claim's own statements would replace: cap the rows of a call with \
                     .build_claim().max_rows(n) instead";
        let distinct = "invalid argument: a claimed query cannot be DISTINCT: a claim locks and \
                        hands over each row once already; remove .distinct()";
        let ran = std::cell::Cell::new(0);
        let mut count = |_: &mut _, _: Order| {
            ran.set(ran.get() + 1);
            Ok::<_, Error>(())
        };
        let refusals = [
            (pending().limit(5).claim_each(&mut conn, &mut count), limit),
            (pending().limit(5).build_claim().batch(10).each(&mut conn, &mut count), limit),
            (pending().distinct().claim_each(&mut conn, &mut count), distinct),
            (
                pending()
                    .distinct()
                    .build_claim()
                    .mark(orders::email_sent.eq(true))
                    .each(&mut conn, &mut count),
                distinct,
            ),
        ];
        for (refused, message) in refusals {
            assert_eq!(refused.unwrap_err().to_string(), message);
        }
        assert_eq!(ran.get(), 0);
        assert_eq!(log.entries(), Vec::<String>::new());
        // What was refused is all still there.
        let report = pending().claim_each(&mut conn, |conn, order: Order| send_email(conn, &order, 1)).unwrap();
        assert_eq!(report.processed, 20);
    }

    /// In a test transaction, a claim runs when asked to, each batch in a
    /// savepoint: a failing row rolls back to its savepoint, the transaction
    /// goes on, and its rollback undoes everything. Without being asked it is
    /// refused, pointing at the option.
    #[test]
    fn inside_a_test_transaction_on_request() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        conn.begin_test_transaction().unwrap();
        insert_pending(&mut conn, 6);

        let refused = pending().claim_each(&mut conn, |conn, order: Order| {
            send_email(conn, &order, 1)?;
            Ok::<_, Error>(())
        });
        assert!(
            matches!(&refused, Err(Error::InvalidArgument(m)) if m.contains(".inside_transaction()")),
            "{refused:?}"
        );

        let failing = pending().build_claim().inside_transaction().each(&mut conn, |conn, order: Order| {
            send_email(conn, &order, 1)?;
            if order.id % 3 == 0 {
                return Err(Error::InvalidArgument("no address".into()));
            }
            Ok(())
        });
        assert!(matches!(failing, Err(Error::InvalidArgument(_))), "{failing:?}");
        // Rows before the failing one stay processed; the failing one was
        // rolled back to its savepoint.
        let (sent, duplicates, left) = email_figures(&mut conn);
        assert_eq!((sent, duplicates, left), (2, 0, 4));

        let report = pending()
            .build_claim()
            .inside_transaction()
            .batch(2)
            .each(&mut conn, |conn, order: Order| {
                send_email(conn, &order, 2)?;
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!(report.processed, 4);
        assert_eq!(email_figures(&mut conn), (6, 0, 0));
    }

    /// Works with `E = diesel::result::Error` too.
    #[test]
    fn closures_may_return_diesel_errors() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 2);
        let report = pending()
            .claim_each(&mut conn, |conn, order: Order| send_email(conn, &order, 0))
            .unwrap();
        assert_eq!(report.processed, 2);
    }

    // Batches and marks.

    /// One outbox row per order, for orders a mark has already flagged.
    fn write_emails(conn: &mut Conn, orders: &[Order], worker: i32) -> QueryResult<()> {
        assert!(orders.iter().all(|order| order.email_sent), "rows come back marked");
        let rows: Vec<_> = orders
            .iter()
            .map(|order| (outbox::order_id.eq(order.id), outbox::worker.eq(worker)))
            .collect();
        diesel::insert_into(outbox::table).values(rows).execute(conn)?;
        Ok(())
    }

    /// Runs one claim in `mode`: every row gets one email and is marked done.
    fn claim(mode: Mode, conn: &mut Conn, worker: i32) -> Result<ClaimReport, Error> {
        let done = orders::email_sent.eq(true);
        let emails = |conn: &mut Conn, batch: Vec<Order>| Ok(write_emails(conn, &batch, worker)?);
        match mode {
            Mode::EachRow(n) => pending().build_claim().batch(n).each(conn, |conn, order: Order| {
                Ok(send_email(conn, &order, worker)?)
            }),
            Mode::EachBatch(n) => {
                pending().build_claim().batch(n).each_batch(conn, |conn, batch: Vec<Order>| {
                    assert!(batch.len() <= n as usize);
                    assert!(batch.windows(2).all(|w| w[0].id < w[1].id), "key order");
                    for order in &batch {
                        send_email(conn, order, worker)?;
                    }
                    Ok(())
                })
            }
            Mode::Mark(n) => pending().build_claim().batch(n).mark(done).each_batch(conn, emails),
            Mode::MarkAndCommit(n) => pending()
                .build_claim()
                .batch(n)
                .mark_and_commit(done)
                .each_batch(conn, emails),
        }
    }

    /// Every batched mode, many workers: duplicates 0, leftovers 0, Σ processed = N.
    #[test]
    fn concurrent_batched_workers_process_each_row_exactly_once() {
        for mode in MODES {
            let (_db, pool) = test_db(WORKERS as u32 + 1);
            insert_pending(&mut pool.get().unwrap(), ORDERS);
            let processed: u64 = on_workers(&pool, WORKERS, |conn, worker| {
                claim(mode, conn, worker as i32).unwrap().processed
            })
            .into_iter()
            .sum();
            let (sent, duplicates, left) = email_figures(&mut pool.get().unwrap());
            eprintln!(
                "{mode:?}, {WORKERS} workers, {ORDERS} orders: processed {processed}, \
                 emails {sent}, duplicates {duplicates}, left {left}"
            );
            assert_eq!((sent, duplicates, left), (ORDERS as i64, 0, 0), "{mode:?}");
            assert_eq!(processed, ORDERS as u64, "{mode:?}");
        }
    }

    /// A batch is one transaction: `n` rows a commit, and no transaction spent on
    /// the end of the candidates. Nothing pending is one query in every mode.
    #[test]
    fn a_batch_is_one_transaction() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        for mode in MODES {
            let log = StatementLog::default();
            conn.set_instrumentation(log.clone());
            let report = claim(mode, &mut conn, 0).unwrap();
            assert_eq!((report.processed, report.skipped), (0, 0), "{mode:?}");
            assert_eq!(log.entries().len(), 1, "{mode:?}: {:#?}", log.entries());
        }
        for (mode, transactions) in [
            (Mode::EachRow(1), 25),
            (Mode::EachRow(10), 3),
            (Mode::EachBatch(25), 1),
            (Mode::Mark(10), 3),
            // PostgreSQL: the marking statement is a transaction of its own.
            // SQLite: `BEGIN IMMEDIATE` around it; MySQL: around its three.
            (Mode::MarkAndCommit(10), if BACKEND == "pg" { 0 } else { 3 }),
        ] {
            diesel::delete(outbox::table).execute(&mut conn).unwrap();
            diesel::delete(orders::table).execute(&mut conn).unwrap();
            insert_pending(&mut conn, 25);
            let log = StatementLog::default();
            conn.set_instrumentation(log.clone());
            let report = claim(mode, &mut conn, 0).unwrap();
            assert_eq!(report.processed, 25, "{mode:?}");
            assert_eq!(begins(&log), transactions, "{mode:?}: {:#?}", log.entries());
            assert_eq!(email_figures(&mut conn), (25, 0, 0), "{mode:?}");
        }
    }

    /// An error in the closure rolls back the whole batch, rows handled before it
    /// in the batch included; batches committed before stay committed.
    #[test]
    fn an_error_rolls_back_the_whole_batch() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 10);
        let result = pending()
            .build_claim()
            .batch(4)
            .each(&mut conn, |conn, order: Order| {
                send_email(conn, &order, 0)?;
                if order.id == 7 {
                    return Err(Error::InvalidArgument("no address".to_owned()));
                }
                Ok(())
            });
        assert!(matches!(result, Err(Error::InvalidArgument(_))), "{result:?}");
        let left: Vec<i32> = pending().select(orders::id).order(orders::id).load(&mut conn).unwrap();
        assert_eq!(left, [5, 6, 7, 8, 9, 10]);
        assert_eq!(email_figures(&mut conn), (4, 0, 6));

        // A panic too, and the connection is usable afterwards.
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pending().build_claim().batch(4).each_batch(
                &mut conn,
                |conn, batch: Vec<Order>| -> Result<(), Error> {
                    for order in &batch {
                        send_email(conn, order, 0)?;
                    }
                    panic!("the mail server caught fire");
                },
            )
        }));
        assert!(panicked.is_err());
        assert_eq!(email_figures(&mut conn), (4, 0, 6));
        let report = claim(Mode::EachBatch(4), &mut conn, 0).unwrap();
        assert_eq!(report.processed, 6);
    }

    /// After an error ends the call, its outcome says what the call committed
    /// and which rows the failure rolled back: per row the row, batched the
    /// batch; a call refused before any SQL names no row.
    #[test]
    fn the_outcome_of_a_failed_call_says_what_it_committed() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 10);
        let failing_on = |failing: i32| {
            move |conn: &mut Conn, order: Order| {
                send_email(conn, &order, 0)?;
                if order.id == failing {
                    return Err(Error::InvalidArgument(format!("no address for {failing}")));
                }
                Ok(())
            }
        };
        let outcome = pending().build_claim().each_outcome(&mut *conn, failing_on(3));
        assert_eq!((outcome.report.processed, outcome.failed.len()), (2, 0));
        let stopped = outcome.stopped.expect("the error ended the call");
        assert_eq!(stopped.keys, [3]);
        assert!(matches!(stopped.error, Error::InvalidArgument(m) if m == "no address for 3"));

        // Batches of 4 from row 3: [3, 4, 5, 6] commits, [7, 8, 9, 10] fails.
        let outcome = pending().build_claim().batch(4).each_outcome(&mut *conn, failing_on(9));
        assert_eq!(outcome.report.processed, 4);
        assert_eq!(outcome.stopped.expect("the error ended the call").keys, [7, 8, 9, 10]);
        assert_eq!(email_figures(&mut conn), (6, 0, 4));

        // `each` is the outcome's report or its error.
        let result = pending().claim_each(&mut *conn, failing_on(8));
        assert!(matches!(result, Err(Error::InvalidArgument(m)) if m == "no address for 8"));

        let outcome = pending().build_claim().batch(0).each_outcome(&mut *conn, failing_on(0));
        assert_eq!(outcome.report, ClaimReport::default());
        let stopped = outcome.stopped.expect("refused");
        assert!(stopped.keys.is_empty());
        assert!(matches!(stopped.error, Error::InvalidArgument(_)), "{:?}", stopped.error);
    }

    /// The ways `keep_going_past_rows_3_and_7` claims: per row, batched (each
    /// row in a savepoint of its own), a closure per batch, marked, and marked
    /// and committed.
    const KEEP_GOING_MODES: [Mode; 5] = [
        Mode::EachRow(1),
        Mode::EachRow(4),
        Mode::EachBatch(4),
        Mode::Mark(4),
        Mode::MarkAndCommit(4),
    ];

    /// Drains the pending orders with `keep_going` in `mode`: the closure
    /// writes each row's email, then fails on row 3 and panics on row 7.
    /// Returns the outcome and how many times the closure saw each row.
    fn keep_going_past_rows_3_and_7(
        mode: Mode,
        conn: &mut Conn,
    ) -> (diesel_claim::ClaimOutcome<i32, Error>, std::collections::HashMap<i32, u32>) {
        let mut seen = std::collections::HashMap::new();
        let mut handle = |conn: &mut Conn, orders: Vec<Order>| -> Result<(), Error> {
            for order in &orders {
                *seen.entry(order.id).or_insert(0) += 1;
                if order.email_sent {
                    write_emails(conn, std::slice::from_ref(order), 0)?;
                } else {
                    send_email(conn, order, 0)?;
                }
                match order.id {
                    3 => return Err(Error::InvalidArgument("no address".to_owned())),
                    7 => panic!("deliberate panic on row 7"),
                    _ => {}
                }
            }
            Ok(())
        };
        let claim = pending().build_claim().keep_going().drain();
        let done = orders::email_sent.eq(true);
        let outcome = match mode {
            Mode::EachRow(n) => claim.batch(n).each_outcome(conn, |conn, order| handle(conn, vec![order])),
            Mode::EachBatch(n) => claim.batch(n).each_batch_outcome(conn, &mut handle),
            Mode::Mark(n) => claim.batch(n).mark(done).each_batch_outcome(conn, &mut handle),
            Mode::MarkAndCommit(n) => claim.batch(n).mark_and_commit(done).each_batch_outcome(conn, &mut handle),
        };
        (outcome, seen)
    }

    /// With `keep_going`, a failing row (an error or a panic) is rolled back,
    /// reported with its key and error, and never tried again in the call;
    /// every other row is processed, and no closure runs twice for a row.
    /// Per row, a batch's failing row is rolled back to its own savepoint and
    /// the rest of its batch commits; a closure given the whole batch, or a
    /// mark (which only its batch's rollback undoes), fails the whole batch.
    /// Without `keep_going`, the first failure ends the call
    /// (`the_outcome_of_a_failed_call_says_what_it_committed`).
    #[test]
    fn keep_going_passes_over_failing_rows() {
        for mode in KEEP_GOING_MODES {
            let (_db, pool) = test_db(1);
            let mut conn = pool.get().unwrap();
            insert_pending(&mut conn, 10);
            let (outcome, seen) = keep_going_past_rows_3_and_7(mode, &mut conn);
            assert!(outcome.stopped.is_none(), "{mode:?}: {:?}", outcome.stopped);
            let failed: Vec<&[i32]> = outcome.failed.iter().map(|f| &f.keys[..]).collect();
            let pending_ids: Vec<i32> = pending().select(orders::id).order(orders::id).load(&mut conn).unwrap();
            let report = outcome.report;
            // Whatever the mode, the closure saw each row once, and nothing
            // was skipped.
            assert!(seen.values().all(|&tries| tries == 1), "{mode:?}: {seen:?}");
            assert_eq!(report.skipped, 0, "{mode:?}");
            match mode {
                Mode::MarkAndCommit(_) => {
                    // The marks commit before the closure runs: a failing batch
                    // stays marked and is recorded whole; the emails written
                    // before the failure stay written.
                    assert_eq!(failed, [&[1, 2, 3, 4][..], &[5, 6, 7, 8]], "{mode:?}");
                    assert_eq!((report.processed, report.failed), (2, 8), "{mode:?}");
                    assert_eq!((email_figures(&mut conn), pending_ids), ((8, 0, 0), vec![]), "{mode:?}");
                }
                Mode::EachBatch(_) | Mode::Mark(_) => {
                    // The failing batches are rolled back whole, and left
                    // pending for the next call.
                    assert_eq!(failed, [&[1, 2, 3, 4][..], &[5, 6, 7, 8]], "{mode:?}");
                    assert_eq!((report.processed, report.failed), (2, 8), "{mode:?}");
                    let expected = ((2, 0, 8), (1..=8).collect::<Vec<_>>());
                    assert_eq!((email_figures(&mut conn), pending_ids), expected, "{mode:?}");
                }
                Mode::EachRow(_) => {
                    assert_eq!(failed, [&[3][..], &[7]], "{mode:?}");
                    assert!(matches!(&outcome.failed[0].error, Error::InvalidArgument(m) if m == "no address"));
                    assert!(
                        matches!(&outcome.failed[1].error, Error::ClosurePanicked(m) if m == "deliberate panic on row 7"),
                        "{mode:?}: {:?}",
                        outcome.failed[1].error
                    );
                    assert_eq!((report.processed, report.failed), (8, 2), "{mode:?}");
                    // The failing rows' writes are rolled back and they stay
                    // pending; every other row is emailed once.
                    assert_eq!((email_figures(&mut conn), pending_ids), ((8, 0, 2), vec![3, 7]), "{mode:?}");
                }
            }
        }
    }

    /// Workers that keep going past failing rows still process every other row
    /// exactly once, retried batches included, and fail no row twice in a call.
    #[test]
    fn concurrent_workers_keep_going_past_failing_rows() {
        let (_db, pool) = test_db(WORKERS as u32 + 1);
        insert_pending(&mut pool.get().unwrap(), ORDERS);
        let failing = |id: i32| id % 50 == 0;
        let outcomes = on_workers(&pool, WORKERS, |conn, worker| {
            pending()
                .build_claim()
                .batch(5)
                .keep_going()
                .each_outcome(conn, |conn, order: Order| {
                    send_email(conn, &order, worker as i32)?;
                    match failing(order.id) {
                        true => Err(Error::InvalidArgument(format!("row {}", order.id))),
                        false => Ok(()),
                    }
                })
        });
        let failing_rows = (1..=ORDERS as i32).filter(|&id| failing(id)).count();
        let processed: u64 = outcomes.iter().map(|o| o.report.processed).sum();
        // A row another call failed is pending again, so each call may fail
        // it once in turn, but never twice.
        let mut failed = std::collections::BTreeSet::new();
        for outcome in &outcomes {
            assert!(outcome.stopped.is_none(), "{:?}", outcome.stopped);
            let mut in_call = std::collections::HashSet::new();
            for failure in &outcome.failed {
                assert!(in_call.insert(failure.keys[0]), "row {:?} failed twice in one call", failure.keys);
                failed.insert(failure.keys[0]);
            }
        }
        assert_eq!(processed, (ORDERS - failing_rows) as u64);
        assert!(failed.iter().copied().eq((1..=ORDERS as i32).filter(|&id| failing(id))));
        let (sent, duplicates, left) = email_figures(&mut pool.get().unwrap());
        assert_eq!((sent, duplicates, left), ((ORDERS - failing_rows) as i64, 0, failing_rows as i64));
    }

    /// Runs a worker on its own thread and connection, emailing every order
    /// it claims; returns the thread, which yields the worker's result.
    fn spawn_worker(
        pool: &Pool,
        stop: &diesel_claim::StopHandle,
        batch: u32,
        on_row: impl Fn(&Order) + Send + 'static,
    ) -> thread::JoinHandle<Result<ClaimReport, Error>> {
        let (pool, stop) = (pool.clone(), stop.clone());
        thread::spawn(move || {
            let mut conn = pool.get().unwrap();
            pending()
                .build_claim()
                .batch(batch)
                .worker(&stop)
                .poll_interval(Duration::from_millis(2), Duration::from_millis(20))
                .run(&mut *conn, |conn, order: Order| {
                    on_row(&order);
                    Ok(send_email(conn, &order, 0)?)
                })
        })
    }

    /// Waits up to 10 s for no order to be pending.
    fn until_none_pending(pool: &Pool) {
        let started = std::time::Instant::now();
        while pending().count().get_result::<i64>(&mut pool.get().unwrap()).unwrap() > 0 {
            assert!(started.elapsed() < Duration::from_secs(10), "rows left pending");
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// A worker claims what is pending, waits, picks up rows inserted while it
    /// waits, and stops when told: its report counts every row.
    #[test]
    fn a_worker_claims_new_rows_until_stopped() {
        let (_db, pool) = test_db(3);
        insert_pending(&mut pool.get().unwrap(), 20);
        let stop = diesel_claim::StopHandle::new();
        let worker = spawn_worker(&pool, &stop, 1, |_| ());
        for _ in 0..3 {
            until_none_pending(&pool);
            // The worker is idle, polling; new rows come in.
            thread::sleep(Duration::from_millis(50));
            insert_pending(&mut pool.get().unwrap(), 10);
        }
        until_none_pending(&pool);
        assert!(!worker.is_finished(), "the worker stopped by itself");
        stop.stop();
        let report = worker.join().unwrap().unwrap();
        assert_eq!(report.processed, 50);
        assert_eq!(email_figures(&mut pool.get().unwrap()), (50, 0, 0));
    }

    /// Stopping finishes the batch in hand, commits it, and claims nothing
    /// more.
    #[test]
    fn stopping_a_worker_finishes_the_batch_in_hand() {
        let (_db, pool) = test_db(2);
        insert_pending(&mut pool.get().unwrap(), 30);
        let stop = diesel_claim::StopHandle::new();
        let stopper = stop.clone();
        let worker = spawn_worker(&pool, &stop, 10, move |order| {
            if order.id == 15 {
                stopper.stop();
            }
        });
        let report = worker.join().unwrap().unwrap();
        assert_eq!(report.processed, 20, "the second batch was finished and committed");
        assert_eq!(email_figures(&mut pool.get().unwrap()), (20, 0, 10));
    }

    /// A closure's error ends the worker with it, unless the claim keeps
    /// going; bad options are refused before any SQL.
    #[test]
    fn worker_errors_and_bad_options() {
        let (_db, pool) = test_db(2);
        insert_pending(&mut pool.get().unwrap(), 3);
        let mut conn = pool.get().unwrap();
        let stop = diesel_claim::StopHandle::new();
        let failed = pending().build_claim().worker(&stop).run(&mut *conn, |_, order: Order| {
            Err(Error::InvalidArgument(format!("row {}", order.id)))
        });
        assert!(matches!(&failed, Err(Error::InvalidArgument(m)) if m == "row 1"), "{failed:?}");

        let log = StatementLog::default();
        conn.set_instrumentation(log.clone());
        let never = |_: &mut _, _: Order| Ok::<_, Error>(());
        let worker = || pending().build_claim().worker(&stop);
        let stopped = diesel_claim::StopHandle::new();
        stopped.stop();
        for (what, refused) in [
            ("a zero interval", worker().poll_interval(Duration::ZERO, Duration::from_secs(1)).run(&mut *conn, never)),
            ("min above max", worker().poll_interval(Duration::from_secs(2), Duration::from_secs(1)).run(&mut *conn, never)),
            ("an empty channel", worker().listen("").run(&mut *conn, never)),
            // Stopped already: a worker that took the name would end at once.
            ("an empty name", pending().build_claim().worker(&stopped).name("").run(&mut *conn, never)),
        ] {
            assert!(matches!(refused, Err(Error::InvalidArgument(_))), "{what}: {refused:?}");
        }
        if BACKEND != "pg" {
            let refused = worker().listen("orders").run(&mut *conn, never);
            assert!(matches!(&refused, Err(Error::InvalidArgument(m)) if m.contains("PostgreSQL")), "{refused:?}");
        }
        assert!(log.entries().is_empty(), "{:#?}", log.entries());
    }

    /// `mark`: the closure's failure un-marks the batch. `mark_and_commit`: it
    /// cannot; the batch stays marked, and the error still reaches the caller.
    #[test]
    fn only_the_transactional_mark_is_undone_by_a_failing_closure() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 6);
        let fail = |_: &mut _, _: Vec<Order>| Err::<(), _>(Error::InvalidArgument("no".into()));
        let done = orders::email_sent.eq(true);

        let result = pending().build_claim().batch(4).mark(done).each_batch(&mut conn, fail);
        assert!(matches!(result, Err(Error::InvalidArgument(_))), "{result:?}");
        assert_eq!(pending().count().get_result::<i64>(&mut conn).unwrap(), 6);

        let result = pending()
            .build_claim()
            .batch(4)
            .mark_and_commit(done)
            .each_batch(&mut conn, fail);
        assert!(matches!(result, Err(Error::InvalidArgument(_))), "{result:?}");
        assert_eq!(pending().count().get_result::<i64>(&mut conn).unwrap(), 2);
    }

    /// A mark that leaves rows matching still never hands a row over twice in one
    /// call. Candidates are passed by key; rows inserted since the scan (here by
    /// the closure, into the page's key range) are caught coming back, and the
    /// call stops.
    #[test]
    fn a_mark_that_leaves_rows_matching_never_hands_a_row_over_twice() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        let with_ids = |ids: &[i32]| -> Vec<_> { ids.iter().map(|id| orders::id.eq(*id)).collect() };
        diesel::insert_into(orders::table)
            .values(with_ids(&[1, 2, 5, 10]))
            .execute(&mut conn)
            .unwrap();
        let keep_matching = orders::customer_id.eq(None::<i32>);

        let mut seen = Vec::new();
        let result = pending()
            .build_claim()
            .batch(2)
            .mark(keep_matching)
            .each_batch(&mut conn, |conn, batch: Vec<Order>| {
                seen.extend(batch.iter().map(|order| order.id));
                if seen.len() == 2 {
                    diesel::insert_into(orders::table).values(with_ids(&[6])).execute(conn)?;
                }
                Ok::<_, Error>(())
            });
        assert!(matches!(result, Err(Error::UnexpectedOutcome(_))), "{result:?}");
        seen.sort();
        assert_eq!(seen, [1, 2, 5, 6]);
    }

    /// A claim through a join marks only the rows the join selects.
    #[test]
    fn a_mark_through_a_join_marks_what_the_join_selects() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        diesel::insert_into(customers::table)
            .values(vec![
                (customers::id.eq(1), customers::name.eq("ada"), customers::vip.eq(true)),
                (customers::id.eq(2), customers::name.eq("bob"), customers::vip.eq(false)),
            ])
            .execute(&mut conn)
            .unwrap();
        let order_of = |customer: i32| orders::customer_id.eq(Some(customer));
        diesel::insert_into(orders::table)
            .values(vec![order_of(1), order_of(2), order_of(1), order_of(2)])
            .execute(&mut conn)
            .unwrap();
        let vip_pending = pending()
            .inner_join(customers::table)
            .filter(customers::vip.eq(true))
            .select(Order::as_select());
        let mut marked = Vec::new();
        let report = vip_pending
            .build_claim()
            .batch(10)
            .mark_and_commit(orders::email_sent.eq(true))
            .each(&mut conn, |_, order: Order| {
                marked.push(order.id);
                Ok::<_, Error>(())
            })
            .unwrap();
        marked.sort();
        assert_eq!((marked, report.processed), (vec![1, 3], 2));
        let left: Vec<i32> = pending().select(orders::id).order(orders::id).load(&mut conn).unwrap();
        assert_eq!(left, [2, 4]);
    }

    #[test]
    fn bad_batch_options_are_rejected_before_any_sql() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 1);
        let log = StatementLog::default();
        conn.set_instrumentation(log.clone());
        let ok = |_: &mut _, _: Vec<Order>| Ok::<_, Error>(());
        let done = orders::email_sent.eq(true);
        let nothing = None::<diesel::dsl::Eq<orders::email_sent, bool>>;
        let results = [
            pending().build_claim().batch(0).each_batch(&mut conn, ok),
            pending().build_claim().batch(0).mark(done).each_batch(&mut conn, ok),
            pending().build_claim().mark(nothing).each_batch(&mut conn, ok),
            // The mark would be committed before a locked row could undo it.
            pending().build_claim().nowait().mark_and_commit(done).each_batch(&mut conn, ok),
        ];
        for result in results {
            assert!(matches!(result, Err(Error::InvalidArgument(_))), "{result:?}");
        }
        assert_eq!(log.entries(), Vec::<String>::new());
    }
}

/// Runs `sql` in a transaction on a connection of its own and holds what it
/// locks until the returned sender is dropped or signalled.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn hold<C>(
    pool: &diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<C>>,
    sql: &str,
) -> (std::sync::mpsc::Sender<()>, thread::JoinHandle<()>)
where
    C: diesel::r2d2::R2D2Connection + Send + 'static,
{
    use diesel::connection::SimpleConnection;
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let mut conn = pool.get().unwrap();
    let sql = sql.to_owned();
    let holder = thread::spawn(move || {
        conn.batch_execute(&format!("BEGIN; {sql}")).unwrap();
        locked_tx.send(()).unwrap();
        let _ = release_rx.recv();
        conn.batch_execute("COMMIT").unwrap();
    });
    locked_rx.recv().unwrap();
    (release_tx, holder)
}

// Row locks: PostgreSQL and MySQL.
on_every_backend! {
    row_locks;

    /// A locked row is skipped, and told apart from one that was gone by the
    /// time the call came to it, per row and in batches.
    #[test]
    fn locked_rows_are_skipped_by_default() {
        for batch in [1, 10] {
            let (_db, pool) = test_db(3);
            let mut conn = pool.get().unwrap();
            insert_pending(&mut conn, 4);
            let (release, holder) = hold(&pool, "SELECT * FROM orders WHERE id = 2 FOR UPDATE");
            // Order 3 is emailed by someone else while this call processes order 1
            // (per row: before its take; in a batch: before the batch's re-check).
            let mut other = pool.get().unwrap();
            let mut first = true;
            let report = pending()
                .build_claim()
                .batch(batch)
                .each(&mut conn, |conn, order: Order| {
                    if std::mem::take(&mut first) && batch == 1 {
                        diesel::update(orders::table.find(3)).set(orders::email_sent.eq(true)).execute(&mut other)?;
                    }
                    Ok::<_, Error>(send_email(conn, &order, 0)?)
                })
                .unwrap();
            drop(release);
            holder.join().unwrap();
            if batch == 1 {
                assert_eq!(
                    (report.processed, report.locked, report.gone, report.skipped),
                    (2, 1, 1, 2),
                    "{report:?}"
                );
            } else {
                assert_eq!((report.processed, report.locked, report.gone, report.skipped), (3, 1, 0, 1), "{report:?}");
            }
            let left: Vec<i32> = pending().select(orders::id).load(&mut conn).unwrap();
            assert_eq!(
                left,
                [2],
                "at most once may be zero times: the locked row is left"
            );
        }
    }


    /// A row skipped because it was locked is tried again by the next pass of a
    /// draining claim, and processed once its holder is gone.
    #[test]
    fn drain_retries_rows_that_were_locked() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 3);
        let mut holder = Some(hold(&pool, "SELECT * FROM orders WHERE id = 1 FOR UPDATE"));
        let mut seen = Vec::new();
        let report = pending()
            .build_claim()
            .drain()
            .each(&mut conn, |conn, order: Order| {
                seen.push(order.id);
                if order.id == 3 {
                    let (release, thread) = holder.take().unwrap();
                    drop(release);
                    thread.join().unwrap();
                }
                Ok::<_, Error>(send_email(conn, &order, 0)?)
            })
            .unwrap();
        assert_eq!(seen, [2, 3, 1]);
        assert_eq!((report.processed, report.skipped), (3, 0));
    }


    #[test]
    fn nowait_fails_on_a_locked_row_with_a_typed_error() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 2);
        let (release, holder) = hold(&pool, "SELECT * FROM orders WHERE id = 1 FOR UPDATE");
        let result = pending()
            .build_claim()
            .nowait()
            .each(&mut conn, |_, _: Order| Ok::<_, Error>(()));
        assert!(matches!(result, Err(Error::LockNotAvailable)), "{result:?}");
        drop(release);
        holder.join().unwrap();
        // The connection is clean and the rows are still there to claim.
        let report = pending()
            .build_claim()
            .nowait()
            .each(&mut conn, |_, _: Order| Ok::<_, Error>(()))
            .unwrap();
        assert_eq!(report.processed, 2);
    }

    /// Scenario "double check": a row changed by its lock holder no longer matches
    /// once the lock is released, and a waiting claimer must not process it.
    #[test]
    fn waiting_claimers_recheck_the_filter_after_the_lock_is_released() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 2);
        let (release, holder) = hold(&pool, "UPDATE orders SET email_sent = TRUE WHERE id = 1");
        let releaser = thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            drop(release);
        });
        let mut seen = Vec::new();
        let report = pending()
            .build_claim()
            .wait()
            .each(&mut conn, |_, order: Order| {
                seen.push(order.id);
                Ok::<_, Error>(())
            })
            .unwrap();
        releaser.join().unwrap();
        holder.join().unwrap();
        assert_eq!(seen, [2]);
        assert_eq!((report.processed, report.skipped), (1, 1));
    }



    // Batches and marks.

    /// Rows others hold are jumped in the statement that claims the next row, not
    /// re-checked one transaction each: 5 rows processed in 5 transactions, 5
    /// locked rows skipped. With pages of 2 keys the statement runs past its page,
    /// and only the 2 locked rows read as candidates count as skipped.
    #[test]
    fn claims_jump_past_locked_rows_in_one_statement() {
        for (page_size, skipped) in [(None, 5), (Some(2), 2)] {
            let (_db, pool) = test_db(2);
            jump_past_locked_rows(&pool, page_size, skipped);
        }
    }

    fn jump_past_locked_rows(pool: &Pool, page_size: Option<u32>, skipped: u64) {
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 10);
        let (release, holder) = hold(
            pool,
            // One key at a time: a range or a scan would lock more under InnoDB's
            // `REPEATABLE READ`, which locks every row it reads.
            &(1..=5)
                .map(|id| format!("SELECT * FROM orders WHERE id = {id} FOR UPDATE;"))
                .collect::<String>(),
        );
        let log = StatementLog::default();
        conn.set_instrumentation(log.clone());
        let claim = pending().build_claim();
        let claim = match page_size {
            Some(keys) => claim.page_size(keys),
            None => claim,
        };
        let report = claim
            .each(&mut conn, |conn, order: Order| {
                Ok::<_, Error>(send_email(conn, &order, 0)?)
            })
            .unwrap();
        assert_eq!((report.processed, report.skipped), (5, skipped), "{page_size:?}");
        assert_eq!(begins(&log), 5, "{page_size:?}: {:#?}", log.entries());
        drop(release);
        holder.join().unwrap();
    }

    /// `nowait` with batches: the batch that meets a locked row fails whole, before
    /// its closure runs; batches before it stay committed.
    #[test]
    fn nowait_fails_the_batch_that_meets_a_locked_row() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 10);
        let (release, holder) = hold(&pool, "SELECT * FROM orders WHERE id = 6 FOR UPDATE");
        let result = pending()
            .build_claim()
            .batch(4)
            .nowait()
            .each(&mut conn, |conn, order: Order| {
                Ok::<_, Error>(send_email(conn, &order, 0)?)
            });
        assert!(matches!(result, Err(Error::LockNotAvailable)), "{result:?}");
        assert_eq!(email_figures(&mut conn), (4, 0, 6));
        drop(release);
        holder.join().unwrap();
    }

    /// Marking skips rows others hold, and leaves them pending.
    #[test]
    fn marks_skip_locked_rows() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 10);
        let (release, holder) = hold(&pool, "SELECT * FROM orders WHERE id IN (2, 9) FOR UPDATE");
        let report = pending()
            .build_claim()
            .batch(3)
            .mark_and_commit(orders::email_sent.eq(true))
            .each_batch(&mut conn, |_, _: Vec<Order>| Ok::<_, Error>(()))
            .unwrap();
        assert_eq!((report.processed, report.skipped), (8, 2));
        drop(release);
        holder.join().unwrap();
        let left: Vec<i32> = pending()
            .select(orders::id)
            .order(orders::id)
            .load(&mut conn)
            .unwrap();
        assert_eq!(left, [2, 9]);
    }

    /// Draining with batches retries the rows that were locked.
    #[test]
    fn draining_batches_retry_rows_that_were_locked() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 3);
        let mut holder = Some(hold(&pool, "SELECT * FROM orders WHERE id = 1 FOR UPDATE"));
        let mut seen = Vec::new();
        let report = pending()
            .build_claim()
            .batch(2)
            .drain()
            .each(&mut conn, |conn, order: Order| {
                seen.push(order.id);
                if order.id == 3 {
                    let (release, thread) = holder.take().unwrap();
                    drop(release);
                    thread.join().unwrap();
                }
                Ok::<_, Error>(send_email(conn, &order, 0)?)
            })
            .unwrap();
        assert_eq!(seen, [2, 3, 1]);
        assert_eq!((report.processed, report.skipped, report.passes), (3, 0, 3));
    }
}

/// Row-lock behaviour only PostgreSQL has.
#[cfg(feature = "postgres")]
mod pg_only {
    use diesel::connection::SimpleConnection;

    use super::pg::{insert_pending, send_email, test_db, Conn};
    use super::*;

    /// A listening worker polls only every 10 s, yet claims a row within
    /// milliseconds of the commit that notified it (without the wake-up it
    /// would wait out its poll).
    #[test]
    fn a_listening_worker_wakes_up_on_notify() {
        let (_db, pool) = test_db(3);
        let stop = diesel_claim::StopHandle::new();
        let claimed_at = Arc::new(Mutex::new(Vec::new()));
        let worker = {
            let (pool, stop, claimed_at) = (pool.clone(), stop.clone(), claimed_at.clone());
            thread::spawn(move || {
                let mut conn = pool.get().unwrap();
                pending()
                    .build_claim()
                    .worker(&stop)
                    .poll_interval(Duration::from_secs(10), Duration::from_secs(10))
                    .listen("orders pending")
                    .run(&mut *conn, |conn, order: Order| {
                        claimed_at.lock().unwrap().push(std::time::Instant::now());
                        Ok::<_, Error>(send_email(conn, &order, 0)?)
                    })
            })
        };
        // Let the worker find nothing and start its 10 s wait.
        thread::sleep(Duration::from_millis(200));
        let mut conn = pool.get().unwrap();
        let mut latencies = Vec::new();
        for round in 1..=3 {
            let committed = conn
                .transaction(|conn| {
                    diesel::insert_into(orders::table)
                        .values(orders::shipped.eq(true))
                        .execute(conn)?;
                    diesel_claim::notify(conn, "orders pending")
                })
                .map(|()| std::time::Instant::now())
                .unwrap();
            let started = std::time::Instant::now();
            while claimed_at.lock().unwrap().len() < round {
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "round {round}: not woken up"
                );
                thread::sleep(Duration::from_millis(1));
            }
            let claimed = claimed_at.lock().unwrap()[round - 1];
            latencies.push(claimed.saturating_duration_since(committed));
            thread::sleep(Duration::from_millis(50));
        }
        stop.stop();
        let report = worker.join().unwrap().unwrap();
        eprintln!("pickup latencies: {latencies:?}");
        assert_eq!(report.processed, 3);
        assert!(
            latencies.iter().all(|l| *l < Duration::from_secs(1)),
            "{latencies:?}"
        );
        // The pooled connection went back without its LISTEN.
        let listening: i64 = diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(
            "(SELECT count(*) FROM pg_listening_channels())",
        ))
        .get_result(&mut *pool.get().unwrap())
        .unwrap();
        assert_eq!(listening, 0);
    }

    /// Even `FOR SHARE` and `FOR KEY SHARE` holders never block a skip-locked claim.
    #[test]
    fn shared_lock_holders_do_not_block_the_claim() {
        let (_db, pool) = test_db(3);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 2);
        let (share, share_holder) = hold(&pool, "SELECT * FROM orders WHERE id = 1 FOR SHARE");
        let (key_share, key_share_holder) =
            hold(&pool, "SELECT * FROM orders WHERE id = 2 FOR KEY SHARE");
        conn.batch_execute("SET lock_timeout = '2s'").unwrap();
        let report = pending()
            .claim_each(&mut conn, |_, _: Order| Ok::<_, Error>(()))
            .unwrap();
        // FOR SHARE conflicts with FOR NO KEY UPDATE: skipped, not waited for.
        // FOR KEY SHARE does not conflict: claimed.
        assert_eq!((report.processed, report.skipped), (1, 1));
        drop((share, key_share));
        share_holder.join().unwrap();
        key_share_holder.join().unwrap();
    }

    /// A claimer whose connection is killed gets an error, never "nothing to do".
    #[test]
    fn a_terminated_connection_is_an_error_not_an_empty_report() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 1);
        let pid: i32 = diesel::select(diesel::dsl::sql::<diesel::sql_types::Integer>(
            "pg_backend_pid()",
        ))
        .get_result(&mut conn)
        .unwrap();
        diesel::sql_query(format!("SELECT pg_terminate_backend({pid})"))
            .execute(&mut pool.get().unwrap())
            .unwrap();
        let result = pending().claim_each(&mut conn, |_, _: Order| Ok::<_, Error>(()));
        assert!(
            matches!(result, Err(Error::BrokenConnection(_))),
            "{result:?}"
        );
    }

    /// Under `REPEATABLE READ` a row its lock holder changed while the claimer
    /// waited cannot be re-read at its new version: the claim fails with a typed
    /// serialization failure (nothing is processed), and `retry` recovers.
    #[test]
    fn repeatable_read_surfaces_serialization_failures() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 1);
        conn.batch_execute("SET default_transaction_isolation = 'repeatable read'")
            .unwrap();
        let (release, holder) = hold(&pool, "UPDATE orders SET shipped = TRUE WHERE id = 1");
        let releaser = thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            drop(release);
        });
        let claim = |conn: &mut Conn| {
            pending()
                .build_claim()
                .wait()
                .each(conn, |_, _: Order| Ok::<_, Error>(()))
        };
        let result = claim(&mut conn);
        releaser.join().unwrap();
        holder.join().unwrap();
        assert!(
            matches!(result, Err(Error::SerializationFailure(_))),
            "{result:?}"
        );
        let report =
            diesel_claim::retry(&mut *conn, diesel_claim::RetryPolicy::default(), claim).unwrap();
        assert_eq!(report.processed, 1);
    }

    /// While a row is claimed through a join, the joined customer can still be
    /// updated (`OF orders`), and an outbox row referencing the claimed order can
    /// still be inserted (`FOR NO KEY UPDATE` lets FK checks through). With
    /// `FOR UPDATE` the same insert is blocked: the check has teeth.
    #[test]
    fn claims_block_neither_joined_rows_nor_foreign_key_inserts() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        conn.batch_execute(
            "INSERT INTO customers (name, vip) VALUES ('ada', TRUE); \
             INSERT INTO orders (customer_id) VALUES (1), (1);",
        )
        .unwrap();
        let vip_pending = || {
            pending()
                .inner_join(customers::table)
                .filter(customers::vip.eq(true))
                .select(Order::as_select())
        };
        let mut other = pool.get().unwrap();
        other.batch_execute("SET lock_timeout = '500ms'").unwrap();

        let mut outcomes = Vec::new();
        vip_pending()
            .build_claim()
            .max_rows(1)
            .each(&mut conn, |_, order: Order| {
                let customer_update = diesel::update(customers::table.find(1))
                    .set(customers::name.eq("ada lovelace"))
                    .execute(&mut other);
                let fk_insert = diesel::insert_into(outbox::table)
                    .values((outbox::order_id.eq(order.id), outbox::worker.eq(9)))
                    .execute(&mut other);
                outcomes.push((customer_update.is_ok(), fk_insert.is_ok()));
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!(outcomes, [(true, true)]);

        let mut blocked_insert = None;
        vip_pending()
            .build_claim()
            .strength(LockStrength::Update)
            .max_rows(1)
            .each(&mut conn, |_, order: Order| {
                let insert = diesel::insert_into(outbox::table)
                    .values((outbox::order_id.eq(order.id), outbox::worker.eq(9)))
                    .execute(&mut other);
                blocked_insert = Some(insert.map_err(|e| diesel_claim::is_lock_not_available(&e)));
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!(
            blocked_insert,
            Some(Err(true)),
            "FOR UPDATE blocks the FK check"
        );
    }
}

/// MySQL and MariaDB: InnoDB's isolation levels and killed connections.
#[cfg(feature = "mysql")]
mod mysql_only {
    use diesel::connection::SimpleConnection;

    use super::mysql::{email_figures, insert_pending, send_email, test_db, Conn};
    use super::*;

    /// The isolation trap: under `REPEATABLE READ` (InnoDB's default) a plain
    /// read sees the transaction's snapshot, so a re-check that did not lock
    /// could pass a row another worker has just processed. The claim's re-check
    /// is a locking read, which sees the latest version: at most once under
    /// both levels, per row and batched.
    #[test]
    fn claims_are_at_most_once_under_repeatable_read_and_read_committed() {
        const WORKERS: usize = 8;
        const ORDERS: usize = 1_000;
        for isolation in ["REPEATABLE READ", "READ COMMITTED"] {
            for batch in [1, 10] {
                let (_db, pool) = test_db(WORKERS as u32 + 1);
                insert_pending(&mut pool.get().unwrap(), ORDERS);
                let start = Barrier::new(WORKERS);
                let processed: u64 = thread::scope(|scope| {
                    let workers: Vec<_> = (0..WORKERS)
                        .map(|worker| {
                            let (pool, start) = (&pool, &start);
                            scope.spawn(move || {
                                let mut conn = pool.get().unwrap();
                                conn.batch_execute(&format!(
                                    "SET SESSION TRANSACTION ISOLATION LEVEL {isolation}"
                                ))
                                .unwrap();
                                start.wait();
                                pending()
                                    .build_claim()
                                    .batch(batch)
                                    .each(&mut conn, |conn, order: Order| {
                                        Ok::<_, Error>(send_email(conn, &order, worker as i32)?)
                                    })
                                    .unwrap()
                                    .processed
                            })
                        })
                        .collect();
                    workers.into_iter().map(|w| w.join().unwrap()).sum()
                });
                let (sent, duplicates, left) = email_figures(&mut pool.get().unwrap());
                eprintln!(
                    "{isolation}, batch {batch}: processed {processed}, emails {sent}, \
                     duplicates {duplicates}, left {left}"
                );
                assert_eq!(
                    (sent, duplicates, left),
                    (ORDERS as i64, 0, 0),
                    "{isolation}"
                );
                assert_eq!(processed, ORDERS as u64, "{isolation}");
            }
        }
    }

    /// A claim's statements are ones Diesel caches: twenty claims of a row
    /// each, on one connection, prepare the locking read and the final
    /// update once, not twenty times (a round trip and a parse saved each).
    #[test]
    fn the_locking_read_is_prepared_once_per_connection() {
        #[derive(QueryableByName)]
        struct Status {
            #[diesel(sql_type = diesel::sql_types::Text, column_name = "Value")]
            value: String,
        }
        fn prepared(conn: &mut Conn) -> u64 {
            let status: Status = diesel::sql_query("SHOW SESSION STATUS LIKE 'Com_stmt_prepare'")
                .get_result(conn)
                .unwrap();
            status.value.parse().unwrap()
        }
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 20);
        // Once round, so that the statements every call sends are cached.
        let claim_one = |conn: &mut Conn| {
            pending()
                .build_claim()
                .max_rows(1)
                .then_update(orders::email_sent.eq(true))
                .each(conn, |_, _: Order| Ok::<_, Error>(()))
                .unwrap()
                .processed
        };
        assert_eq!(claim_one(&mut conn), 1);
        let before = prepared(&mut conn);
        let processed: u64 = (0..19).map(|_| claim_one(&mut conn)).sum();
        assert_eq!(processed, 19);
        // The status query itself is prepared each time it runs.
        let prepares = prepared(&mut conn) - before - 1;
        eprintln!("19 claims prepared {prepares} statements");
        assert!(prepares < 5, "19 claims prepared {prepares} statements");
        assert_eq!(pending().count().get_result::<i64>(&mut conn).unwrap(), 0);
    }

    /// A locking read that fails after sending some of its rows (here a lock
    /// wait timeout at the third row) must leave the connection able to claim
    /// again. MariaDB Connector/C re-executing the same prepared statement
    /// then waits for the rest of a result set that ended with the error, for
    /// ever: the crate closes the statements the connection cached once the
    /// claim's transaction failed.
    #[test]
    fn a_locking_read_that_fails_midway_leaves_the_connection_usable() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 4);
        conn.batch_execute("SET SESSION innodb_lock_wait_timeout = 1")
            .unwrap();
        let (release, holder) = hold(&pool, "SELECT * FROM orders WHERE id = 3 FOR UPDATE");
        let claim = |conn: &mut Conn| {
            pending()
                .build_claim()
                .wait()
                .batch(10)
                .each(conn, |conn, order: Order| {
                    Ok::<_, Error>(send_email(conn, &order, 0)?)
                })
        };
        let result = claim(&mut conn);
        assert!(matches!(result, Err(Error::LockNotAvailable)), "{result:?}");
        drop(release);
        holder.join().unwrap();
        // Again on the same connection, in a thread, so that a hang fails the
        // test instead of stalling it.
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        thread::spawn(move || {
            let _ = done_tx.send(claim(&mut conn).map(|report| report.processed));
        });
        let result = done_rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("the second claim on the connection hung");
        assert_eq!(result.unwrap(), 4);
        assert_eq!(email_figures(&mut pool.get().unwrap()), (4, 0, 0));
    }

    /// A claimer whose connection is killed gets an error, never "nothing to do".
    #[test]
    fn a_killed_connection_is_an_error_not_an_empty_report() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 1);
        let id: i64 = diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(
            "CONNECTION_ID()",
        ))
        .get_result(&mut conn)
        .unwrap();
        pool.get()
            .unwrap()
            .batch_execute(&format!("KILL {id}"))
            .unwrap();
        let result = pending().claim_each(&mut conn, |_, _: Order| Ok::<_, Error>(()));
        assert!(
            matches!(result, Err(Error::BrokenConnection(_))),
            "{result:?}"
        );
    }
}
