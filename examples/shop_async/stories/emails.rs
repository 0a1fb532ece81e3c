//! Part 1: shipping confirmation emails, each sent exactly once.
//!
//! All tasks drain the shipped orders at the same time: first one order per
//! transaction (`claim_each`), then, once the warehouse has shipped the rest,
//! fifty per transaction (`build_claim().batch(50).each`): fewer commits and
//! round trips, but an error rolls back the whole batch. Either way the email (a
//! row in the outbox) and the flag that takes the order out of the query commit
//! together, so an order is emailed by whichever task locks it first, and by
//! nobody else.

use diesel::dsl::{count_star, exists, not};
use diesel::prelude::*;
use diesel_async::{AsyncConnection, RunQueryDsl};
use diesel_claim::aio::prelude::*;

use super::{run_workers, Conn, Pool};
use crate::schema::{orders, outbox, Order};
use crate::{BoxError, Checks, Clock, Options};

/// Orders inserted per statement while setting up.
const INSERT_CHUNK: usize = 1000;
/// Orders per transaction in the second round.
const BATCH: u32 = 50;

/// How the tasks claim orders.
#[derive(Debug, Clone, Copy)]
enum Claiming {
    /// `claim_each`: one order per transaction.
    PerRow,
    /// `build_claim().batch(BATCH).each`: `BATCH` orders per transaction.
    Batches,
}

impl Claiming {
    fn name(self) -> &'static str {
        match self {
            Claiming::PerRow => "claim_each",
            Claiming::Batches => "batch(50).each",
        }
    }
}

pub async fn run(
    pool: &Pool,
    options: &Options,
    clock: Clock,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    println!("Part 1: shipping emails with claim_each, then in batches of {BATCH}");
    let mut conn = pool.get().await?;
    let shipped = options.orders / 2;
    place_orders(&mut conn, options.orders, shipped).await?;
    clock.log(format_args!(
        "{} orders placed, {shipped} of them shipped",
        options.orders
    ));

    let first = send_emails_concurrently(pool, options, clock, Claiming::PerRow).await?;

    // Nobody may have emailed an order that has not shipped yet.
    let early: i64 = outbox::table
        .inner_join(orders::table)
        .filter(orders::shipped.eq(false))
        .count()
        .get_result(&mut conn)
        .await?;
    checks.check(
        "no email before shipping",
        early == 0,
        format!(
            "{} unshipped orders, {early} emails for them",
            options.orders - shipped
        ),
    );

    let rest = diesel::update(orders::table.filter(orders::shipped.eq(false)))
        .set(orders::shipped.eq(true))
        .execute(&mut conn)
        .await?;
    clock.log(format_args!("the warehouse ships the other {rest} orders"));
    let second = send_emails_concurrently(pool, options, clock, Claiming::Batches).await?;

    check_emails(&mut conn, first + second, checks).await
}

/// One task's run of the email job. Safe to run in any number of tasks or
/// processes at once: each order is processed at most once.
async fn send_pending_emails(
    conn: &mut Conn,
    worker: i32,
    claiming: Claiming,
) -> Result<ClaimReport, diesel_claim::Error> {
    let pending = orders::table
        .filter(orders::shipped.eq(true))
        .filter(orders::email_sent.eq(false))
        .select(Order::as_select());

    // An `async` closure per order, with the connection borrowed for just that
    // long; its future is `Send`, so the task running the claim can be spawned.
    match claiming {
        Claiming::PerRow => {
            pending
                .claim_each(conn, async |conn, order| {
                    send_email(conn, order, worker).await
                })
                .await
        }
        Claiming::Batches => {
            pending
                .build_claim()
                .batch(BATCH)
                .each(conn, async |conn, order| {
                    send_email(conn, order, worker).await
                })
                .await
        }
    }
}

/// Sends one order's email. Runs inside the order's (or its batch's)
/// transaction, with the order locked and re-checked: the email and the flag
/// commit together, or (on an error) not at all and the order stays pending.
async fn send_email(conn: &mut Conn, order: Order, worker: i32) -> Result<(), diesel_claim::Error> {
    diesel::insert_into(outbox::table)
        .values((
            outbox::order_id.eq(order.id),
            outbox::recipient.eq(&order.customer_email),
            outbox::worker.eq(worker),
        ))
        .execute(conn)
        .await?;
    // Clearing the filter is what makes later claimers skip this order.
    diesel::update(&order)
        .set(orders::email_sent.eq(true))
        .execute(conn)
        .await?;
    Ok(())
}

/// Runs the email job on every task at once; returns the emails sent.
async fn send_emails_concurrently(
    pool: &Pool,
    options: &Options,
    clock: Clock,
    claiming: Claiming,
) -> Result<u64, BoxError> {
    let reports = run_workers(pool, options.workers, |mut conn, worker| async move {
        Ok(send_pending_emails(&mut conn, worker, claiming).await?)
    })
    .await?;
    let processed = reports.iter().map(|report| report.processed).sum();
    clock.log(format_args!("{}: {processed} emails sent", claiming.name()));
    // `skipped` counts candidates another task got to first: locked by it at
    // the time, or already emailed when this task came to lock them.
    for (worker, report) in reports.iter().enumerate() {
        println!(
            "          email task {worker}: {:>5} emailed, {:>5} skipped (another task got to \
             them first)",
            report.processed, report.skipped
        );
    }
    Ok(processed)
}

/// Places `total` orders, the first `shipped` of them already shipped.
async fn place_orders(conn: &mut Conn, total: u32, shipped: u32) -> QueryResult<()> {
    let new_orders: Vec<_> = (0..total)
        .map(|n| {
            (
                orders::customer_email.eq(format!("customer{n}@example.com")),
                orders::shipped.eq(n < shipped),
            )
        })
        .collect();
    conn.transaction(async |conn: &mut Conn| {
        for chunk in new_orders.chunks(INSERT_CHUNK) {
            diesel::insert_into(orders::table)
                .values(chunk)
                .execute(conn)
                .await?;
        }
        Ok(())
    })
    .await
}

async fn check_emails(
    conn: &mut Conn,
    processed: u64,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    let placed: i64 = orders::table.count().get_result(conn).await?;
    let emails: i64 = outbox::table.count().get_result(conn).await?;
    let duplicated: Vec<i32> = outbox::table
        .group_by(outbox::order_id)
        .having(count_star().gt(1))
        .select(outbox::order_id)
        .load(conn)
        .await?;
    let missing: i64 = orders::table
        .filter(not(exists(
            outbox::table.filter(outbox::order_id.eq(orders::id)),
        )))
        .count()
        .get_result(conn)
        .await?;
    let leftovers: i64 = orders::table
        .filter(orders::email_sent.eq(false))
        .count()
        .get_result(conn)
        .await?;

    checks.check(
        "emails sent once each",
        emails == placed && duplicated.is_empty() && missing == 0,
        format!(
            "{placed} orders, {emails} emails, {} duplicated, {missing} missing",
            duplicated.len()
        ),
    );
    checks.check(
        "no order left pending",
        leftovers == 0 && processed == emails as u64,
        format!("{processed} processed by the claims, {leftovers} orders left unmarked"),
    );
    Ok(())
}
