//! The partial index's effect where it matters: many done rows, few pending.
//!
//! The crate's documentation tells users to index the pending predicate over
//! the key (`CREATE INDEX orders_pending ON orders (id) WHERE <pending>`). This
//! fills `orders` with [`DONE_ROWS`] done orders and [`PENDING_ROWS`] pending
//! ones spread evenly through the keys, then measures on one connection, first
//! without the index, then with it:
//!
//! - a `claim_each` call with nothing pending (its one unlocked read), averaged
//!   over many calls;
//! - draining the pending rows with `claim_each` (per row) and with
//!   `batch(100)`, in rows/s.
//!
//! One worker: the index changes what each read walks, not how workers meet.
//! PostgreSQL and SQLite only: MySQL has no partial indexes.

use std::time::{Duration, Instant};

use diesel::QueryResult;

use crate::counting::{record_statements, stop_counting};
use crate::database::BenchDb;
use crate::db::{tidy_up, BackendKind, BenchConn};
use crate::drain::{drain, Mode, ModeId};
use crate::schema::{self, PENDING};

pub const DONE_ROWS: i64 = 1_000_000;
pub const PENDING_ROWS: i64 = 1_000;
/// Empty calls are repeated for this long (at least [`MIN_EMPTY_CALLS`] of them).
const EMPTY_CALL_BUDGET: Duration = Duration::from_secs(2);
const MIN_EMPTY_CALLS: u32 = 5;
const MAX_EMPTY_CALLS: u32 = 2_000;
const BATCH: u32 = 100;

pub fn applies(backend: BackendKind) -> bool {
    backend != BackendKind::Mysql
}

/// What one backend measured, without and then with the index.
#[derive(Debug, Clone)]
pub struct IndexEffect {
    pub backend: BackendKind,
    pub done: i64,
    pub pending: i64,
    pub without: IndexRun,
    pub with: IndexRun,
}

/// The measurements with or without the index.
#[derive(Debug, Clone)]
pub struct IndexRun {
    /// Mean time of a `claim_each` call with nothing pending.
    pub empty_call: Duration,
    pub empty_calls: u32,
    /// Rows/s draining the pending rows per row and in batches.
    pub per_row: f64,
    pub batched: f64,
    /// The plan of the candidate read with nothing pending, summarised.
    pub plan: String,
    pub failures: Vec<String>,
}

impl IndexEffect {
    /// Both runs, labelled for the report.
    pub fn runs(&self) -> [(&'static str, &IndexRun); 2] {
        [("without", &self.without), ("with", &self.with)]
    }

    pub fn failures(&self) -> Vec<String> {
        let name = self.backend.name();
        self.runs()
            .into_iter()
            .flat_map(|(label, run)| {
                run.failures
                    .iter()
                    .map(move |f| format!("{name} index effect, {label} the index: {f}"))
            })
            .collect()
    }
}

pub fn measure<C: BenchConn>(db: &mut BenchDb<C>) -> Result<IndexEffect, String> {
    let total = DONE_ROWS + PENDING_ROWS;
    // Every `step`-th order is pending: exactly PENDING_ROWS of them.
    let step = total / PENDING_ROWS;
    eprintln!(
        "{} index effect: filling {DONE_ROWS} done and {PENDING_ROWS} pending orders…",
        C::BACKEND.name()
    );
    let pending = db.setup(|conn| {
        conn.batch_execute(&schema::refill_orders_where(
            C::BACKEND,
            total,
            &format!("i % {step} = 0"),
        ))?;
        conn.batch_execute("DROP INDEX orders_pending")?;
        // Nor may the key-order reads fall back on the priority order's index.
        conn.batch_execute("DROP INDEX orders_pending_by_priority")?;
        tidy_up(conn);
        conn.load_count(&format!("SELECT count(*) AS n FROM orders WHERE {PENDING}"))
    })?;
    let without = measure_run(db, pending)?;
    db.setup(|conn| {
        conn.batch_execute(&schema::pending_index(C::BACKEND))?;
        conn.batch_execute(&schema::priority_index(C::BACKEND))?;
        tidy_up(conn);
        Ok(())
    })?;
    let with = measure_run(db, pending)?;
    Ok(IndexEffect {
        backend: C::BACKEND,
        done: total - pending,
        pending,
        without,
        with,
    })
}

/// Drains per row, times empty calls, refills and drains in batches.
fn measure_run<C: BenchConn>(db: &mut BenchDb<C>, pending: i64) -> Result<IndexRun, String> {
    let mut failures = Vec::new();
    let per_row = timed_drain(db, Mode::new(ModeId::B2, 1), pending, &mut failures)?;
    let (empty_call, empty_calls, plan) = time_empty_calls(db)?;
    restore_pending(db)?;
    let batched = timed_drain(db, Mode::new(ModeId::B3, BATCH), pending, &mut failures)?;
    restore_pending(db)?;
    Ok(IndexRun {
        empty_call,
        empty_calls,
        per_row,
        batched,
        plan,
        failures,
    })
}

/// Drains the pending rows in `mode` on one connection; returns rows/s and
/// notes what went wrong in `failures`.
fn timed_drain<C: BenchConn>(
    db: &mut BenchDb<C>,
    mode: Mode,
    pending: i64,
    failures: &mut Vec<String>,
) -> Result<f64, String> {
    let mut conn = C::open(&db.url).map_err(|e| format!("cannot connect: {e}"))?;
    let started = Instant::now();
    let processed = drain(&mut conn, mode)
        .map_err(|e| format!("{mode}: {e}"))?
        .processed;
    let elapsed = started.elapsed();
    let checks = db.setup(|conn| conn.load_checks())?;
    if processed != pending as u64 || checks.duplicates != 0 || checks.leftovers != 0 {
        failures.push(format!(
            "{mode}: {processed} of {pending} rows processed, {} twice, {} left pending",
            checks.duplicates, checks.leftovers
        ));
    }
    Ok(processed as f64 / elapsed.as_secs_f64())
}

/// Times `claim_each` on a queue with nothing pending, and summarises the plan
/// of the one statement it sends.
fn time_empty_calls<C: BenchConn>(db: &mut BenchDb<C>) -> Result<(Duration, u32, String), String> {
    let mut conn = C::open(&db.url).map_err(|e| format!("cannot connect: {e}"))?;
    let error = |e: diesel_claim::Error| e.to_string();
    // The first call prepares the statement, as a polling worker's does once.
    let recorded = record_statements(&mut conn);
    conn.claim_rows(None).map_err(error)?;
    stop_counting(&mut conn);
    let candidate_read = recorded.lock().expect("not poisoned").first().cloned();
    let started = Instant::now();
    let mut calls = 0;
    while calls < MIN_EMPTY_CALLS
        || (calls < MAX_EMPTY_CALLS && started.elapsed() < EMPTY_CALL_BUDGET)
    {
        conn.claim_rows(None).map_err(error)?;
        calls += 1;
    }
    let mean = started.elapsed() / calls;
    let plan = match candidate_read {
        Some(statement) => plan_summary(&mut conn, &statement).map_err(|e| e.to_string())?,
        None => "no statement sent".to_owned(),
    };
    Ok((mean, calls, plan))
}

/// Puts the processed orders back to pending and empties the outbox.
fn restore_pending<C: BenchConn>(db: &mut BenchDb<C>) -> Result<(), String> {
    db.setup(|conn| {
        conn.batch_execute(
            "UPDATE orders SET shipped_email_sent = FALSE \
             WHERE id IN (SELECT order_id FROM outbox); DELETE FROM outbox",
        )?;
        tidy_up(conn);
        Ok(())
    })
}

/// The lines of a statement's plan that say how it found its rows: on
/// PostgreSQL the first scan, the buffers the statement touched and its
/// execution time; on SQLite every step.
fn plan_summary<C: BenchConn>(conn: &mut C, recorded: &str) -> QueryResult<String> {
    let lines = conn.load_plan(&with_binds_inlined(C::BACKEND, recorded))?;
    let summary: Vec<&str> = match C::BACKEND {
        BackendKind::Postgres => ["Scan", "Buffers:", "Execution Time"]
            .iter()
            .filter_map(|word| lines.iter().find(|line| line.contains(word)))
            .map(|line| line.trim().trim_start_matches("->").trim_start())
            .collect(),
        _ => lines.iter().map(String::as_str).collect(),
    };
    Ok(summary.join("; "))
}

/// A statement as Diesel shows it (`<sql> -- binds: [<values>]`) with the
/// values in place of its placeholders (`$1`… on PostgreSQL, `?` on SQLite).
/// The values here are integers and booleans, whose debug form is SQL.
fn with_binds_inlined(backend: BackendKind, recorded: &str) -> String {
    let (sql, binds) = recorded
        .rsplit_once(" -- binds: ")
        .unwrap_or((recorded, "[]"));
    let binds: Vec<&str> = binds
        .trim_matches(['[', ']'])
        .split(", ")
        .filter(|bind| !bind.is_empty())
        .collect();
    match backend {
        // From the last, so that `$1` does not match the start of `$10`.
        BackendKind::Postgres => binds
            .iter()
            .enumerate()
            .rev()
            .fold(sql.to_owned(), |sql, (i, bind)| {
                sql.replace(&format!("${}", i + 1), bind)
            }),
        _ => {
            let mut binds = binds.into_iter();
            sql.split('?')
                .enumerate()
                .map(|(i, piece)| match i {
                    0 => piece.to_owned(),
                    _ => format!("{}{piece}", binds.next().unwrap_or("NULL")),
                })
                .collect()
        }
    }
}
