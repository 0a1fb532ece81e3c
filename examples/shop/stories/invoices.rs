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
use std::time::Duration;

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
/// The worker that dies after stamping its first batch.
const DYING_WORKER: i32 = 0;

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
    clock.log(format_args!(
        "a worker that stalled past its stamp was overtaken; its late write: {late_write:?}"
    ));

    let reports = run_workers(pool, options.workers, |conn, worker| {
        match mail_invoices(conn, worker) {
            Err(ShopStop::Died) => Ok(ClaimReport::default()),
            done => done.map_err(Into::into),
        }
    })?;
    let mailed: u64 = reports.iter().map(|report| report.processed).sum();
    let left = invoices::table
        .filter(invoices::sent.eq(false))
        .count()
        .get_result::<i64>(&mut conn)?;
    clock.log(format_args!(
        "{} workers mailed {mailed} invoices; worker {DYING_WORKER} died holding \
         {left} (stamped, nobody else takes them until the stamps pass)",
        options.workers
    ));

    // The dead worker's stamps pass; the next claim takes its invoices.
    thread::sleep(TTL);
    let swept = mail_invoices(&mut conn, -1).map_err(BoxError::from)?;
    clock.log(format_args!(
        "after {TTL:?}, a new claim mailed the {} invoices the dead worker left",
        swept.processed
    ));

    let twice: i64 = invoices::table
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
        twice == 0 && stamped == 0,
        format!("{count} invoices, {twice} not sent once, {stamped} stamps left"),
    );
    checks.check(
        "invoices: a dead worker's batch came back when its stamps passed",
        left > 0 && swept.processed == left as u64,
        format!(
            "{left} left stamped, {} mailed after the stamps passed",
            swept.processed
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

/// Why a worker's claim ended early.
#[derive(Debug)]
enum ShopStop {
    /// The worker died (as a process killed mid-work would).
    Died,
    Failed(Error),
}

impl From<Error> for ShopStop {
    fn from(error: Error) -> Self {
        ShopStop::Failed(error)
    }
}

impl From<diesel::result::Error> for ShopStop {
    fn from(error: diesel::result::Error) -> Self {
        ShopStop::Failed(error.into())
    }
}

impl From<ShopStop> for BoxError {
    fn from(stop: ShopStop) -> Self {
        match stop {
            ShopStop::Died => "the worker died".into(),
            ShopStop::Failed(error) => error.into(),
        }
    }
}

/// Mails every unsent invoice this worker can claim, a batch at a time, with
/// no transaction open while it mails. The dying worker stops at its first
/// invoice, leaving its batch stamped.
fn mail_invoices(conn: &mut Conn, worker: i32) -> Result<ClaimReport, ShopStop> {
    unsent()
        .build_claim()
        .batch(BATCH)
        .drain()
        .visibility_timeout(invoices::claimed_until, TTL)
        .each(conn, |conn, invoice: Claim| {
            if worker == DYING_WORKER {
                return Err(ShopStop::Died);
            }
            mail(conn, &invoice, worker)?;
            Ok(send(conn, invoice)?)
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
