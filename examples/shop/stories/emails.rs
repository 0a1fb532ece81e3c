//! Part 1: shipping confirmation emails, each sent exactly once (`claim_each`).
//!
//! Workers run the seed article's `send_pending_order_shipped_emails()` at the
//! same time. Each pending order is re-checked under a lock in a transaction of
//! its own, and the email (a row in the outbox) is written in that same
//! transaction with the flag that takes the order out of the query: an order is
//! emailed by whichever worker locks it first, and by nobody else.

use diesel::dsl::{count_star, exists, not, now};
use diesel::prelude::*;
use diesel::sql_types::Bool;
use std::thread;
use std::time::{Duration, Instant};

use diesel_claim::prelude::*;
use diesel_claim::{ClaimReport, StopHandle};

use super::{notify_new_orders, run_workers, Conn, Pool, NEW_ORDERS_CHANNEL};

type Backend = <Conn as Connection>::Backend;
use crate::schema::{orders, outbox, Order};
use crate::{BoxError, Checks, Clock, Options, Progress};

/// Orders inserted per statement while setting up.
const INSERT_CHUNK: usize = 1000;

/// The email domain of the partner shop's customers (one order in ten).
const PARTNER_DOMAIN: &str = "partner.example";

/// Failed attempts after which an order's email is no longer tried: the order
/// is a dead letter.
const MAX_EMAIL_ATTEMPTS: i32 = 3;

/// Orders placed while the warehouse worker runs, in rounds of 20.
const LATE_ORDERS: u32 = 100;

/// One order in fifty has an address the mail server refuses (no domain): its
/// email fails on every attempt.
fn undeliverable(n: u32) -> bool {
    n % 50 == 7
}

pub fn run(
    pool: &Pool,
    options: &Options,
    clock: Clock,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    println!("Part 1: shipping emails with claim_each");
    let mut conn = pool.get()?;
    let shipped = options.orders / 2;
    place_orders(&mut conn, 0..options.orders, shipped)?;
    clock.log(format_args!(
        "{} orders placed, {shipped} of them shipped",
        options.orders
    ));

    let progress = Progress::new(500, "emails sent so far, in all runs", clock);
    let mut express_first = ExpressFirst::default();
    clock.log(format_args!(
        "the email job, on {} workers at once:",
        options.workers
    ));
    let runs_from = last_email(&mut conn)?;
    let (first, _) = send_emails_concurrently(pool, options, &progress, None)?;
    express_first.count(&mut conn, runs_from)?;

    // Nobody may have emailed an order that has not shipped yet.
    let early: i64 = outbox::table
        .inner_join(orders::table)
        .filter(orders::shipped_at.is_null())
        .count()
        .get_result(&mut conn)?;
    checks.check(
        "no email before shipping",
        early == 0,
        format!(
            "{} unshipped orders, {early} emails for them",
            options.orders - shipped
        ),
    );

    let shipped_by_worker = run_the_warehouse(pool, options.orders, checks)?;
    clock.log(format_args!(
        "a warehouse worker shipped the other {shipped_by_worker} orders as they came, \
         {LATE_ORDERS} of them placed while it worked; then it was stopped"
    ));
    // Customers of the partner shop are told first: the same job, with a
    // filter chosen at run time.
    clock.log(format_args!(
        "the email job for {PARTNER_DOMAIN} customers first, on {} workers:",
        options.workers
    ));
    let runs_from = last_email(&mut conn)?;
    let (partners, _) = send_emails_concurrently(pool, options, &progress, Some(PARTNER_DOMAIN))?;
    express_first.count(&mut conn, runs_from)?;
    clock.log(format_args!(
        "{partners} emails to {PARTNER_DOMAIN} customers"
    ));
    // The job runs again while orders fail: each run tries a failing order
    // once per worker, until its attempts reach the limit.
    clock.log(format_args!(
        "the email job for everyone, run again until no email fails (an order is a dead \
         letter after {MAX_EMAIL_ATTEMPTS} failed attempts):"
    ));
    let runs_from = last_email(&mut conn)?;
    let (mut second, mut runs) = (0, 0);
    loop {
        runs += 1;
        println!("          run {runs}:");
        let (sent, failed) = send_emails_concurrently(pool, options, &progress, None)?;
        second += sent;
        if failed == 0 {
            break;
        }
    }
    clock.log(format_args!(
        "{runs} runs, until the failing orders were dead letters"
    ));
    express_first.count(&mut conn, runs_from)?;
    express_first.check(checks);

    check_emails(&mut conn, first + partners + second, checks)?;
    check_dead_letters(&mut conn, options.orders + LATE_ORDERS, checks)?;
    Ok(())
}

/// The seed's `send_pending_order_shipped_emails()`, in Rust, for the customers
/// of one email domain when given one.
///
/// Safe to run in any number of processes at once: each order is processed at
/// most once, and the work spreads over the workers by itself.
fn send_pending_order_shipped_emails(
    conn: &mut Conn,
    worker: i32,
    progress: &Progress,
    domain: Option<&str>,
) -> Result<ClaimReport, diesel_claim::Error> {
    // The query is written once. `claim_each` runs it without locks to find
    // candidates (a single read when nothing is pending), then again for each
    // candidate, restricted to its key and locked (`FOR NO KEY UPDATE OF orders
    // SKIP LOCKED` on PostgreSQL; SQLite takes the write lock), to re-check that
    // the order is still pending before the closure sees it.
    //
    // Express orders are emailed first: the claim follows the query's order,
    // the key breaking ties.
    //
    // The domain filter is chosen at run time, so it is boxed. A boxed filter
    // cannot be cloned, so `rebuild` takes the code that builds the query and
    // runs it for each statement the claim sends. (The filter is boxed, not the
    // query: a boxed query's order cannot be read, and a claim refuses it.)
    let orders_to_email = diesel_claim::rebuild(|| {
        let in_domain: Box<dyn BoxableExpression<orders::table, Backend, SqlType = Bool>> =
            match domain {
                Some(domain) => Box::new(orders::customer_email.like(format!("%@{domain}"))),
                None => Box::new(true.into_sql::<Bool>()),
            };
        orders::table
            .filter(orders::shipped_at.is_not_null())
            .filter(orders::shipped_email_sent.eq(false))
            .filter(orders::email_attempts.lt(MAX_EMAIL_ATTEMPTS))
            .filter(in_domain)
            .order(orders::priority.desc())
            .select(Order::as_select())
    });

    // A failing order does not stop the job: its work is rolled back to a
    // savepoint, and the failure hook counts the attempt in the same
    // transaction, the order still locked, so that no other worker can try it
    // before the attempt is counted. At the limit the query leaves the order
    // out (a dead letter).
    let report = orders_to_email
        .build_claim()
        .on_failure(|conn, order: Order, _error: &diesel_claim::Error| {
            diesel::update(&order)
                .set(orders::email_attempts.eq(orders::email_attempts + 1))
                .execute(conn)?;
            Ok(())
        })
        .each(conn, |conn, order: Order| {
            // Runs in the order's own transaction: the email and the flag commit
            // together, or (on an error, or a panic) not at all and the order stays
            // pending for the next run.
            send_shipped_email(conn, &order, worker)?;
            // Clearing the filter is what makes the next claimer skip this order.
            diesel::update(&order)
                .set(orders::shipped_email_sent.eq(true))
                .execute(conn)?;
            progress.tick();
            Ok(())
        })?;
    Ok(report)
}

/// Hands the email to the "mail server": a row in the outbox. An address
/// without a domain is refused.
fn send_shipped_email(
    conn: &mut Conn,
    order: &Order,
    worker: i32,
) -> Result<(), diesel_claim::Error> {
    if !order.customer_email.contains('@') {
        return Err(diesel_claim::Error::InvalidArgument(format!(
            "undeliverable address {:?}",
            order.customer_email
        )));
    }
    diesel::insert_into(outbox::table)
        .values((
            outbox::order_id.eq(order.id),
            outbox::recipient.eq(&order.customer_email),
            outbox::subject.eq(format!("Your order #{} has shipped", order.id)),
            outbox::worker.eq(worker),
        ))
        .execute(conn)?;
    Ok(())
}

/// Runs the email job on every worker at once; returns the emails sent, and
/// the orders whose email failed.
fn send_emails_concurrently(
    pool: &Pool,
    options: &Options,
    progress: &Progress,
    domain: Option<&str>,
) -> Result<(u64, u64), BoxError> {
    let reports = run_workers(pool, options.workers, |conn, worker| {
        Ok(send_pending_order_shipped_emails(
            conn, worker, progress, domain,
        )?)
    })?;
    // Candidates another worker got to first are `gone` (emailed, or a dead
    // letter, when this worker came to lock them) or `locked` (by it, at the
    // time); orders whose email failed are `failed`, their attempt counted.
    for (worker, report) in reports.iter().enumerate() {
        println!(
            "          email worker {worker}: {:>4} emailed, {:>4} gone (another worker got to them \
             first), {:>3} locked (another worker held them), {:>2} failed (attempt counted)",
            report.processed, report.gone, report.locked, report.failed
        );
    }
    let total = |count: fn(&ClaimReport) -> u64| reports.iter().map(count).sum();
    Ok((total(|r| r.processed), total(|r| r.failed)))
}

/// The warehouse: a worker claims unshipped orders and ships them, and waits
/// for more when none are left (woken by a notification on PostgreSQL,
/// polling elsewhere), while late orders come in; once all are shipped it is
/// told to stop, finishes the batch in hand and reports. Returns the orders it
/// shipped.
fn run_the_warehouse(pool: &Pool, placed: u32, checks: &mut Checks) -> Result<u64, BoxError> {
    let unshipped = || orders::table.filter(orders::shipped_at.is_null());
    let mut conn = pool.get()?;
    let waiting: i64 = unshipped().count().get_result(&mut conn)?;
    let stop = StopHandle::new();
    let report = thread::scope(|scope| {
        let warehouse = scope.spawn(|| -> Result<ClaimReport, BoxError> {
            let mut conn = pool.get()?;
            let worker = unshipped()
                .select(Order::as_select())
                .build_claim()
                .batch(50)
                .worker(&stop)
                .poll_interval(Duration::from_millis(5), Duration::from_millis(200));
            let worker = match NEW_ORDERS_CHANNEL {
                Some(channel) => worker.listen(channel),
                None => worker,
            };
            Ok(worker.run(&mut conn, |conn, order: Order| {
                diesel::update(&order)
                    .set(orders::shipped_at.eq(now))
                    .execute(conn)?;
                Ok::<_, diesel_claim::Error>(())
            })?)
        });
        // Stopped on any way out, an error included, so the worker ends.
        let _stop = StopOnDrop(&stop);
        for round in 0..LATE_ORDERS / 20 {
            thread::sleep(Duration::from_millis(30));
            place_orders(&mut conn, placed + round * 20..placed + (round + 1) * 20, 0)?;
            notify_new_orders(&mut conn)?;
        }
        let started = Instant::now();
        while unshipped().count().get_result::<i64>(&mut conn)? > 0 {
            if started.elapsed() > Duration::from_secs(30) {
                return Err("orders still unshipped after 30 s".into());
            }
            thread::sleep(Duration::from_millis(5));
        }
        stop.stop();
        warehouse
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })?;
    let left: i64 = unshipped().count().get_result(&mut conn)?;
    let expected = waiting as u64 + u64::from(LATE_ORDERS);
    checks.check(
        "the warehouse worker shipped every order, then stopped",
        left == 0 && report.processed == expected,
        format!(
            "{} shipped of {waiting} waiting + {LATE_ORDERS} late, {left} left",
            report.processed
        ),
    );
    Ok(report.processed)
}

/// Triggers a stop handle when dropped.
struct StopOnDrop<'a>(&'a StopHandle);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// Places the orders numbered `numbers`, the first `shipped` of them already
/// shipped.
fn place_orders(conn: &mut Conn, numbers: std::ops::Range<u32>, shipped: u32) -> QueryResult<()> {
    let shipped = numbers.start + shipped;
    let total = numbers.end;
    let email = |n: u32| {
        let domain = if n.is_multiple_of(10) {
            PARTNER_DOMAIN
        } else {
            "example.com"
        };
        orders::customer_email.eq(match undeliverable(n) {
            true => format!("customer{n}"),
            false => format!("customer{n}@{domain}"),
        })
    };
    // One order in seven is an express order.
    let priority = |n: u32| orders::priority.eq(i32::from(n.is_multiple_of(7)));
    conn.transaction(|conn| {
        let shipped_orders: Vec<_> = (numbers.start..shipped)
            .map(|n| (email(n), priority(n), orders::shipped_at.eq(now)))
            .collect();
        for chunk in shipped_orders.chunks(INSERT_CHUNK) {
            diesel::insert_into(orders::table)
                .values(chunk)
                .execute(conn)?;
        }
        let open_orders: Vec<_> = (shipped..total).map(|n| (email(n), priority(n))).collect();
        for chunk in open_orders.chunks(INSERT_CHUNK) {
            diesel::insert_into(orders::table)
                .values(chunk)
                .execute(conn)?;
        }
        Ok(())
    })
}

/// The outbox's last row, before a run of the job.
fn last_email(conn: &mut Conn) -> QueryResult<i32> {
    outbox::table
        .select(diesel::dsl::max(outbox::id))
        .first::<Option<i32>>(conn)
        .map(Option::unwrap_or_default)
}

/// Each worker claims in the query's order: in every run of the email job,
/// each worker emailed its express orders before any other.
#[derive(Debug, Default)]
struct ExpressFirst {
    emails: usize,
    out_of_order: usize,
}

impl ExpressFirst {
    /// Counts the emails of the runs that followed the outbox row `after`.
    fn count(&mut self, conn: &mut Conn, after: i32) -> QueryResult<()> {
        let sent: Vec<(i32, i32)> = outbox::table
            .inner_join(orders::table)
            .filter(outbox::id.gt(after))
            .order(outbox::id)
            .select((outbox::worker, orders::priority))
            .load(conn)?;
        let mut last_priority = std::collections::HashMap::new();
        self.out_of_order += sent
            .iter()
            .filter(|(worker, priority)| {
                let last = last_priority.insert(*worker, *priority);
                last.is_some_and(|last| last < *priority)
            })
            .count();
        self.emails += sent.len();
        Ok(())
    }

    fn check(&self, checks: &mut Checks) {
        checks.check(
            "each worker emails express orders first",
            self.out_of_order == 0,
            format!(
                "{} emails in all runs, {} after a lower priority's",
                self.emails, self.out_of_order
            ),
        );
    }
}

/// Every order with an undeliverable address ends as a dead letter: tried
/// [`MAX_EMAIL_ATTEMPTS`] times, never emailed, and no longer claimed; no
/// other order is one.
fn check_dead_letters(conn: &mut Conn, orders: u32, checks: &mut Checks) -> QueryResult<()> {
    let undeliverable = (0..orders).filter(|&n| undeliverable(n)).count() as i64;
    let dead: Vec<(String, i32, bool)> = orders::table
        .filter(orders::email_attempts.gt(0))
        .select((
            orders::customer_email,
            orders::email_attempts,
            orders::shipped_email_sent,
        ))
        .load(conn)?;
    let well_formed = dead
        .iter()
        .filter(|(email, ..)| email.contains('@'))
        .count();
    let below_limit = dead
        .iter()
        .filter(|(_, attempts, _)| *attempts < MAX_EMAIL_ATTEMPTS)
        .count();
    let sent = dead.iter().filter(|(.., sent)| *sent).count();
    checks.check(
        "undeliverable orders end as dead letters",
        dead.len() as i64 == undeliverable && well_formed + below_limit + sent == 0,
        format!(
            "{undeliverable} undeliverable, {} dead letters ({well_formed} with a valid \
             address, {below_limit} below {MAX_EMAIL_ATTEMPTS} attempts, {sent} emailed)",
            dead.len()
        ),
    );
    Ok(())
}

fn check_emails(conn: &mut Conn, processed: u64, checks: &mut Checks) -> Result<(), BoxError> {
    let shipped: i64 = orders::table
        .filter(orders::shipped_at.is_not_null())
        .count()
        .get_result(conn)?;
    let emails: i64 = outbox::table.count().get_result(conn)?;
    let duplicated: Vec<i32> = outbox::table
        .group_by(outbox::order_id)
        .having(count_star().gt(1))
        .select(outbox::order_id)
        .load(conn)?;
    let missing: i64 = orders::table
        .filter(orders::shipped_at.is_not_null())
        .filter(orders::email_attempts.lt(MAX_EMAIL_ATTEMPTS))
        .filter(not(exists(
            outbox::table.filter(outbox::order_id.eq(orders::id)),
        )))
        .count()
        .get_result(conn)?;
    let unmarked: i64 = orders::table
        .filter(orders::shipped_email_sent.eq(false))
        .filter(orders::email_attempts.lt(MAX_EMAIL_ATTEMPTS))
        .count()
        .get_result(conn)?;
    let dead_letters: i64 = orders::table
        .filter(orders::email_attempts.ge(MAX_EMAIL_ATTEMPTS))
        .count()
        .get_result(conn)?;

    checks.check(
        "emails sent once each",
        missing == 0 && duplicated.is_empty() && emails == shipped - dead_letters,
        format!(
            "{shipped} shipped, {emails} emails, {dead_letters} dead letters, {missing} missing, \
             {} duplicated",
            duplicated.len()
        ),
    );
    checks.check(
        "claim reports add up",
        unmarked == 0 && processed == emails as u64,
        format!("{processed} processed, {unmarked} orders left unmarked"),
    );
    Ok(())
}
