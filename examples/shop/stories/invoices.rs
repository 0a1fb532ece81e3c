//! Part 4: invoices mailed outside any transaction, under a visibility
//! timeout (`visibility_timeout`).
//!
//! Mailing an invoice is slow (a PDF to render, a provider's API to call):
//! holding a transaction and a row lock open for it would leave sessions idle
//! in transaction, holding locks. Instead, each worker stamps a batch of
//! invoices `claimed_until = <database now> + ttl` and commits at once, mails
//! them with no transaction open, and marks each one sent by a write fenced on
//! its stamp. A worker that dies mid-batch loses nothing: its invoices come
//! back when their stamps pass. A worker that stalls past its stamp is
//! overtaken, and its late write is refused; the mail itself went out twice,
//! which is the trade every visibility timeout makes (mail providers take an
//! idempotency key for that reason).

use std::thread;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{ClaimReport, Claimed, Error};

use super::{run_workers, ClaimStamp, Conn, Pool};
use crate::{BoxError, Checks, Clock, Options};

diesel::table! {
    use diesel::sql_types::*;
    use super::ClaimStamp;

    /// One invoice per order; `claimed_until` is the claims' own column.
    invoices (id) {
        id -> Integer,
        order_id -> Integer,
        sent -> Bool,
        times_sent -> Integer,
        claimed_until -> Nullable<ClaimStamp>,
    }
}

diesel::table! {
    /// The mail server's log: one row per invoice mailed, written outside any
    /// transaction, as a real mail would leave.
    invoice_mail (id) {
        id -> Integer,
        invoice_id -> Integer,
        worker -> Integer,
    }
}

#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = invoices)]
struct Invoice {
    id: i32,
}

type Claim = Claimed<Invoice, invoices::claimed_until>;

/// How long a claim on an invoice lasts without `extend`.
const TTL: Duration = Duration::from_millis(1500);
/// Invoices a worker stamps at a time.
const BATCH: u32 = 5;

pub fn run(
    pool: &Pool,
    options: &Options,
    clock: Clock,
    checks: &mut Checks,
) -> Result<(), BoxError> {
    println!("\nPart 4: invoices mailed outside any transaction, with visibility_timeout");
    let mut conn = pool.get()?;
    diesel::sql_query("INSERT INTO invoices (id, order_id) SELECT id, id FROM orders")
        .execute(&mut conn)?;
    let count: i64 = invoices::table.count().get_result(&mut conn)?;

    let late_write = stall_past_the_stamp(pool)?;
    match &late_write {
        Err(error) => clock.log(format_args!(
            "a worker that stalled past its stamp was overtaken; its late write was refused: \
             {error}"
        )),
        Ok(()) => clock.log("a worker that stalled past its stamp wrote late, unrefused"),
    }

    let abandoned = die_holding_a_batch(&mut conn)?;
    let died = Instant::now();
    clock.log(format_args!(
        "a worker died holding invoices {abandoned:?}: nobody takes them until their \
         stamps pass, {TTL:?} later"
    ));

    let reports = run_workers(pool, options.workers, |conn, worker| {
        Ok(mail_invoices(conn, worker)?)
    })?;
    let mailed: u64 = reports.iter().map(|report| report.processed).sum();
    // What is left is the dead worker's, claimable once its stamps pass (a
    // little later than `TTL` after its death: SQLite's clock counts whole
    // milliseconds).
    thread::sleep(TTL.saturating_sub(died.elapsed()) + Duration::from_millis(20));
    let swept = mail_invoices(&mut conn, -1)?;
    clock.log(format_args!(
        "{} workers mailed {mailed} invoices, and a claim after the dead worker's \
         stamps passed mailed the {} it had left",
        options.workers, swept.processed
    ));

    let abandoned_mails: i64 = invoice_mail::table
        .filter(invoice_mail::invoice_id.eq_any(&abandoned))
        .count()
        .get_result(&mut conn)?;
    let not_once: i64 = invoices::table
        .filter(invoices::times_sent.ne(1))
        .count()
        .get_result(&mut conn)?;
    let stamped: i64 = invoices::table
        .filter(invoices::claimed_until.is_not_null())
        .count()
        .get_result(&mut conn)?;
    let mails: i64 = invoice_mail::table.count().get_result(&mut conn)?;
    checks.check(
        "invoices: each one marked sent exactly once",
        not_once == 0 && stamped == 0,
        format!("{count} invoices, {not_once} not sent once, {stamped} stamps left"),
    );
    checks.check(
        "invoices: a dead worker's batch came back when its stamps passed",
        !abandoned.is_empty() && abandoned_mails == abandoned.len() as i64,
        format!(
            "{} abandoned, mailed {abandoned_mails} times in all once their stamps passed",
            abandoned.len()
        ),
    );
    checks.check(
        "invoices: a stalled worker's late write was refused",
        matches!(late_write, Err(Error::ClaimLost { .. })) && mails == count + 1,
        format!(
            "{count} invoices, {mails} mails: the overtaken one went out twice, was marked once"
        ),
    );
    Ok(())
}

/// What ends the dying worker's claim.
enum Stop {
    /// The worker died (as a process killed mid-work would).
    Died,
    Failed(Error),
}

impl From<Error> for Stop {
    fn from(error: Error) -> Self {
        Stop::Failed(error)
    }
}

/// A worker stamps a batch of invoices and dies before mailing any: the
/// invoices it held.
fn die_holding_a_batch(conn: &mut Conn) -> Result<Vec<i32>, BoxError> {
    let mut held = Vec::new();
    let died = unsent()
        .build_claim()
        .batch(BATCH)
        .max_rows(BATCH.into())
        .visibility_timeout(invoices::claimed_until, TTL)
        .each_batch(conn, |_, invoices: Vec<Claim>| {
            held = invoices.iter().map(|invoice| invoice.id).collect();
            Err(Stop::Died)
        });
    match died {
        Err(Stop::Died) => Ok(held),
        Err(Stop::Failed(error)) => Err(error.into()),
        Ok(report) => Err(format!("the dying worker claimed nothing: {report:?}").into()),
    }
}

/// Mails every unsent invoice this worker can claim, a batch at a time, with
/// no transaction open while it mails.
fn mail_invoices(conn: &mut Conn, worker: i32) -> Result<ClaimReport, Error> {
    unsent()
        .build_claim()
        .batch(BATCH)
        .drain()
        .visibility_timeout(invoices::claimed_until, TTL)
        .each(conn, |conn, invoice: Claim| {
            mail(conn, &invoice, worker)?;
            send(conn, invoice)
        })
}

/// A worker claims one invoice and mails it, then stalls past its stamp;
/// another takes the invoice over, mails it and marks it sent. What the
/// stalled worker's final write comes to.
fn stall_past_the_stamp(pool: &Pool) -> Result<Result<(), Error>, BoxError> {
    let (mut stalled, mut other) = (pool.get()?, pool.get()?);
    let short = Duration::from_millis(200);
    let mut late_write = None;
    unsent()
        .build_claim()
        .max_rows(1)
        .visibility_timeout(invoices::claimed_until, short)
        .each(&mut stalled, |conn, invoice: Claim| {
            mail(conn, &invoice, 100)?;
            thread::sleep(short * 2);
            unsent()
                .build_claim()
                .max_rows(1)
                .visibility_timeout(invoices::claimed_until, TTL)
                .each(&mut other, |conn, taken: Claim| {
                    mail(conn, &taken, 101)?;
                    send(conn, taken)
                })?;
            late_write = Some(send(conn, invoice));
            Ok::<_, Error>(())
        })?;
    Ok(late_write.ok_or("no invoice was claimed")?)
}

/// The invoices not sent yet.
type Unsent = diesel::dsl::Select<
    diesel::dsl::Filter<invoices::table, diesel::dsl::Eq<invoices::sent, bool>>,
    diesel::dsl::AsSelect<Invoice, <Conn as Connection>::Backend>,
>;

fn unsent() -> Unsent {
    invoices::table
        .filter(invoices::sent.eq(false))
        .select(Invoice::as_select())
}

/// "Mails" the invoice: a row in the mail log, committed on its own, after a
/// pause that stands for the slow part.
fn mail(conn: &mut Conn, invoice: &Invoice, worker: i32) -> QueryResult<()> {
    thread::sleep(Duration::from_millis(1));
    diesel::insert_into(invoice_mail::table)
        .values((
            invoice_mail::invoice_id.eq(invoice.id),
            invoice_mail::worker.eq(worker),
        ))
        .execute(conn)
        .map(drop)
}

/// The final write, fenced on the claim's stamp: sent, counted.
fn send(conn: &mut Conn, invoice: Claim) -> Result<(), Error> {
    invoice.finish(
        conn,
        (
            invoices::sent.eq(true),
            invoices::times_sent.eq(invoices::times_sent + 1),
        ),
    )
}
