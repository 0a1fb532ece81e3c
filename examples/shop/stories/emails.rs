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
use diesel_claim::prelude::*;
use diesel_claim::ClaimReport;

use super::{run_workers, Conn, Pool};

type Backend = <Conn as Connection>::Backend;
use crate::schema::{orders, outbox, Order};
use crate::{BoxError, Checks, Clock, Options, Progress};

/// Orders inserted per statement while setting up.
const INSERT_CHUNK: usize = 1000;

/// The email domain of the partner shop's customers (one order in ten).
const PARTNER_DOMAIN: &str = "partner.example";

pub fn run(
    pool: &Pool,
    options: &Options,
    clock: Clock,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    println!("Part 1: shipping emails with claim_each");
    let mut conn = pool.get()?;
    let shipped = options.orders / 2;
    place_orders(&mut conn, options.orders, shipped)?;
    clock.log(format_args!(
        "{} orders placed, {shipped} of them shipped",
        options.orders
    ));

    let progress = Progress::new(500, "emails sent", clock);
    let runs_from = last_email(&mut conn)?;
    let first = send_emails_concurrently(pool, options, &progress, None)?;
    check_express_first(&mut conn, runs_from, checks)?;

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

    let rest = diesel::update(orders::table.filter(orders::shipped_at.is_null()))
        .set(orders::shipped_at.eq(now))
        .execute(&mut conn)?;
    clock.log(format_args!("the warehouse ships the other {rest} orders"));
    // Customers of the partner shop are told first: the same job, with a
    // filter chosen at run time.
    let runs_from = last_email(&mut conn)?;
    let partners = send_emails_concurrently(pool, options, &progress, Some(PARTNER_DOMAIN))?;
    clock.log(format_args!(
        "{partners} emails to {PARTNER_DOMAIN} customers first"
    ));
    check_express_first(&mut conn, runs_from, checks)?;
    let runs_from = last_email(&mut conn)?;
    let second = send_emails_concurrently(pool, options, &progress, None)?;
    check_express_first(&mut conn, runs_from, checks)?;

    check_emails(&mut conn, first + partners + second, checks)
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
            .filter(in_domain)
            .order(orders::priority.desc())
            .select(Order::as_select())
    });

    orders_to_email.claim_each(conn, |conn, order: Order| {
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
    })
}

/// Hands the email to the "mail server": a row in the outbox.
fn send_shipped_email(conn: &mut Conn, order: &Order, worker: i32) -> QueryResult<()> {
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

/// Runs the email job on every worker at once; returns the emails sent.
fn send_emails_concurrently(
    pool: &Pool,
    options: &Options,
    progress: &Progress,
    domain: Option<&str>,
) -> Result<u64, BoxError> {
    let reports = run_workers(pool, options.workers, |conn, worker| {
        Ok(send_pending_order_shipped_emails(
            conn, worker, progress, domain,
        )?)
    })?;
    // Candidates another worker got to first: already emailed when this worker
    // came to lock them (`gone`), or locked by it at the time (`locked`).
    for (worker, report) in reports.iter().enumerate() {
        println!(
            "          worker {worker}: processed {:>5}, gone {:>5}, locked {:>3}",
            report.processed, report.gone, report.locked
        );
    }
    Ok(reports.iter().map(|report| report.processed).sum())
}

/// Places `total` orders, the first `shipped` of them already shipped.
fn place_orders(conn: &mut Conn, total: u32, shipped: u32) -> QueryResult<()> {
    let email = |n: u32| {
        let domain = if n % 10 == 0 {
            PARTNER_DOMAIN
        } else {
            "example.com"
        };
        orders::customer_email.eq(format!("customer{n}@{domain}"))
    };
    // One order in seven is an express order.
    let priority = |n: u32| orders::priority.eq(i32::from(n % 7 == 0));
    conn.transaction(|conn| {
        let shipped_orders: Vec<_> = (0..shipped)
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

/// Each worker claims in the query's order: in the run whose emails follow
/// the outbox row `after`, every worker emailed its express orders before any
/// other.
fn check_express_first(conn: &mut Conn, after: i32, checks: &mut Checks) -> QueryResult<()> {
    let sent: Vec<(i32, i32)> = outbox::table
        .inner_join(orders::table)
        .filter(outbox::id.gt(after))
        .order(outbox::id)
        .select((outbox::worker, orders::priority))
        .load(conn)?;
    let mut last_priority = std::collections::HashMap::new();
    let out_of_order = sent
        .iter()
        .filter(|(worker, priority)| {
            let last = last_priority.insert(*worker, *priority);
            last.is_some_and(|last| last < *priority)
        })
        .count();
    checks.check(
        "each worker emails express orders first",
        out_of_order == 0,
        format!(
            "{} emails, {out_of_order} after a lower priority's",
            sent.len()
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
        .filter(not(exists(
            outbox::table.filter(outbox::order_id.eq(orders::id)),
        )))
        .count()
        .get_result(conn)?;
    let unmarked: i64 = orders::table
        .filter(orders::shipped_email_sent.eq(false))
        .count()
        .get_result(conn)?;

    checks.check(
        "emails sent once each",
        missing == 0 && duplicated.is_empty() && emails == shipped,
        format!(
            "{shipped} shipped, {emails} emails, {missing} missing, {} duplicated",
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
