//! Counting the statements and transactions a client sends, with Diesel's
//! instrumentation.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use diesel::connection::{Connection, InstrumentationEvent};

/// Statements and transactions a set of connections sent, counted by
/// [`count_statements`].
#[derive(Debug, Default)]
pub struct Counters {
    /// Whether to read each statement, to count transactions where the
    /// server does not (SQLite). It costs formatting every statement, so
    /// PostgreSQL runs leave it off.
    classify: bool,
    /// Whether to print each statement (`--trace`).
    trace: bool,
    statements: AtomicU64,
    begins: AtomicU64,
    commits: AtomicU64,
}

/// A reading of [`Counters`].
#[derive(Debug, Clone, Copy)]
pub struct Counts {
    pub statements: u64,
    /// Counted only when classifying.
    pub begins: u64,
    /// Counted only when classifying: `COMMIT`s, plus writes outside a transaction.
    pub commits: u64,
}

impl Counters {
    pub fn new(classify: bool, trace: bool) -> Arc<Self> {
        Arc::new(Counters {
            classify,
            trace,
            ..Counters::default()
        })
    }

    pub fn counts(&self) -> Counts {
        Counts {
            statements: self.statements.load(Relaxed),
            begins: self.begins.load(Relaxed),
            commits: self.commits.load(Relaxed),
        }
    }
}

/// Counts every statement `conn` sends: each is one Diesel `StartQuery` event,
/// `BEGIN` and `COMMIT` included (Diesel's transaction manager sends them as
/// statements too). `name` labels the connection's statements when tracing.
pub fn count_statements<C: Connection>(conn: &mut C, counters: Arc<Counters>, name: String) {
    let mut in_transaction = false;
    conn.set_instrumentation(move |event: InstrumentationEvent<'_>| {
        let InstrumentationEvent::StartQuery { query, .. } = event else {
            return;
        };
        counters.statements.fetch_add(1, Relaxed);
        if !(counters.classify || counters.trace) {
            return;
        }
        let sql = query.to_string();
        if counters.trace {
            eprintln!("    [{name}] {sql}");
        }
        match StatementKind::of(&sql) {
            StatementKind::Begin => {
                in_transaction = true;
                counters.begins.fetch_add(1, Relaxed);
            }
            StatementKind::Commit => {
                in_transaction = false;
                counters.commits.fetch_add(1, Relaxed);
            }
            StatementKind::Rollback => in_transaction = false,
            StatementKind::Write if !in_transaction => {
                counters.commits.fetch_add(1, Relaxed);
            }
            StatementKind::Write | StatementKind::Other => {}
        }
    });
}

pub fn stop_counting<C: Connection>(conn: &mut C) {
    conn.set_instrumentation(|_: InstrumentationEvent<'_>| {});
}

enum StatementKind {
    Begin,
    Commit,
    Rollback,
    /// A statement that writes (`WITH` counts: here it is always B1's update).
    Write,
    Other,
}

impl StatementKind {
    fn of(sql: &str) -> Self {
        let sql = sql.trim_start().to_ascii_uppercase();
        let first_word = sql.split(|c: char| !c.is_ascii_alphabetic()).next();
        match first_word.unwrap_or_default() {
            "BEGIN" => StatementKind::Begin,
            "COMMIT" | "END" => StatementKind::Commit,
            // `ROLLBACK TO SAVEPOINT` leaves the transaction open.
            "ROLLBACK" if !sql.contains(" TO ") => StatementKind::Rollback,
            "INSERT" | "UPDATE" | "DELETE" | "REPLACE" | "WITH" => StatementKind::Write,
            _ => StatementKind::Other,
        }
    }
}

/// Records the text of every statement `conn` sends from now on, as Diesel
/// shows it (`<sql> -- binds: [<values>]`), until [`stop_counting`].
pub fn record_statements<C: Connection>(conn: &mut C) -> Arc<Mutex<Vec<String>>> {
    let recorded = Arc::new(Mutex::new(Vec::new()));
    let sink = recorded.clone();
    conn.set_instrumentation(move |event: InstrumentationEvent<'_>| {
        if let InstrumentationEvent::StartQuery { query, .. } = event {
            sink.lock()
                .expect("the recorder never panics")
                .push(query.to_string());
        }
    });
    recorded
}
