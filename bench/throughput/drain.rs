//! Draining the queue: the modes B0–B4, M1, M2, O3 and O3h (and some of them
//! on partitioned orders), the peers DJ, D0, D3 and FQ (see `peers`), the
//! timed run of one mode, and the empty-queue check.

use std::fmt;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use diesel::QueryResult;

use crate::counting::{count_statements, stop_counting, Counters, Counts};
use crate::database::BenchDb;
use crate::db::{ids_of, reset_orders, BackendKind, BenchConn, Checks, RowLock};
use crate::peers;
use crate::schema::ORDER_COLUMNS;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeId {
    /// Hand-written, one row per transaction, skip-locked.
    B0,
    /// Hand-written, one statement claims and marks a batch (MySQL: a
    /// transaction, see [`hand_written_statement`]).
    B1,
    /// The crate's `claim_each`, per row.
    B2,
    /// The crate's batched claim.
    B3,
    /// B2 from the head of the query (`from_head`): one locking statement
    /// per row, no candidates read.
    H2,
    /// B3 from the head of the query.
    H3,
    /// B3's hand-written twin: the same statements (see
    /// [`hand_written_double_checked`]).
    B3d,
    /// B3 without the crate's double check: only the locking transactions.
    B3h,
    /// The crate's batched claim marking in one round trip, committed at once.
    M1,
    /// M1 with the mark and the closure in one transaction.
    M2,
    /// Negative control: B0 with a plain `FOR UPDATE` (waits, no skip).
    B4,
    /// Hand-written batches in priority order: `… ORDER BY priority DESC, id
    /// LIMIT n FOR … SKIP LOCKED`, then B3h's writes.
    O3h,
    /// The crate's batched claim of a query ordered by `priority DESC`.
    O3,
    /// Peer: the seed's loop in Django, one Python process per worker (see
    /// `peers::django`).
    DJ,
    /// Peer: Diesel alone, per row: a transaction around the pending query
    /// with `.limit(1).for_update().skip_locked()`, until it finds none.
    D0,
    /// Peer: D0 with `.limit(100)`.
    D3,
    /// Peer: the fang job queue, one job per order (see `peers::job_queue`).
    FQ,
}

/// The batch sizes B3, B3d and B3h run at (unless `--batches` says otherwise).
pub const BATCH_SIZES: [u32; 3] = [10, 100, 1000];

/// The peers, in the order they run, after every other mode.
pub const PEERS: [Mode; 4] = [
    Mode::new(ModeId::DJ, 1),
    Mode::new(ModeId::D0, 1),
    Mode::new(ModeId::D3, 100),
    Mode::new(ModeId::FQ, 1),
];

/// A mode, its batch size (1 for the per-row modes), and whether it drains
/// the orders table partitioned by its pending flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mode {
    pub id: ModeId,
    pub batch: u32,
    /// Runs on the database whose `orders` is partitioned by its pending flag
    /// (see [`schema::create_tables`](crate::schema::create_tables)): each
    /// processed row moves to the other partition.
    pub partitioned: bool,
}

/// The crate modes that also run, with their twins, on partitioned orders
/// (`--partitioned`).
const PARTITIONED: [ModeId; 2] = [ModeId::B2, ModeId::B3];

impl Mode {
    pub const fn new(id: ModeId, batch: u32) -> Self {
        Mode {
            id,
            batch,
            partitioned: false,
        }
    }

    /// This mode on the partitioned orders.
    pub const fn on_partitions(self) -> Self {
        Mode {
            partitioned: true,
            ..self
        }
    }

    /// Every mode, in the order they run: each crate mode right after its twin,
    /// so that the two meet the same conditions on a noisy machine, and the
    /// pair on partitioned orders right after the pair on the plain table.
    pub fn all() -> Vec<Mode> {
        use ModeId::*;
        let mut plain = vec![
            Mode::new(B0, 1),
            Mode::new(B2, 1),
            Mode::new(H2, 1),
            Mode::new(B4, 1),
            Mode::new(B1, 100),
            Mode::new(M1, 100),
            Mode::new(M2, 100),
            Mode::new(O3h, 100),
            Mode::new(O3, 100),
        ];
        for n in BATCH_SIZES {
            plain.extend([
                Mode::new(B3h, n),
                Mode::new(B3d, n),
                Mode::new(B3, n),
                Mode::new(H3, n),
            ]);
        }
        let mut modes = Vec::new();
        for mode in plain {
            modes.push(mode);
            if let Some(twin) = mode.twin().filter(|_| PARTITIONED.contains(&mode.id)) {
                modes.extend([twin.on_partitions(), mode.on_partitions()]);
            }
        }
        // The peers last: each is compared with several crate modes, which
        // have all run at the same worker count just before.
        modes.extend(PEERS);
        modes
    }

    /// Whether the mode is one of the batched claims run at each of
    /// [`BATCH_SIZES`] (B3, B3d, B3h).
    pub fn is_sized(self) -> bool {
        matches!(self.id, ModeId::B3 | ModeId::B3d | ModeId::B3h | ModeId::H3)
    }

    pub fn id_name(self) -> String {
        format!("{:?}", self.id)
    }

    /// The hand-written mode a crate mode is measured against.
    pub fn twin(self) -> Option<Mode> {
        let id = match self.id {
            ModeId::B2 | ModeId::H2 => ModeId::B0,
            ModeId::B3 => ModeId::B3d,
            ModeId::H3 => ModeId::B3h,
            ModeId::M1 | ModeId::M2 => ModeId::B1,
            ModeId::O3 => ModeId::O3h,
            _ => return None,
        };
        Some(Mode { id, ..self })
    }

    pub fn is_crate_mode(self) -> bool {
        self.twin().is_some()
    }

    /// Whether the mode is one of the peers: the same work done without the
    /// crate, the way its users would otherwise do it.
    pub fn is_peer(self) -> bool {
        matches!(self.id, ModeId::DJ | ModeId::D0 | ModeId::D3 | ModeId::FQ)
    }

    /// Whether workers leave each other's rows alone: every mode but the
    /// negative control.
    pub fn skips_locked(self) -> bool {
        self.id != ModeId::B4
    }

    pub fn runs_on(self, backend: BackendKind) -> bool {
        let needs_row_locks = matches!(self.id, ModeId::B4 | ModeId::D0 | ModeId::D3);
        // Django is measured on PostgreSQL only (on MariaDB it would need
        // Python's mysqlclient, a C build), and fang's blocking queue is
        // PostgreSQL's alone.
        let postgres_only = matches!(self.id, ModeId::DJ | ModeId::FQ);
        (!needs_row_locks || backend.has_row_locks())
            && (!postgres_only || backend == BackendKind::Postgres)
            && (!self.partitioned || backend.has_partitions())
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.id {
            ModeId::B0
            | ModeId::B2
            | ModeId::H2
            | ModeId::B4
            | ModeId::DJ
            | ModeId::D0
            | ModeId::FQ => write!(f, "{:?}", self.id)?,
            _ => write!(f, "{:?} n={}", self.id, self.batch)?,
        }
        if self.partitioned {
            f.write_str(" partitioned")?;
        }
        Ok(())
    }
}

/// What one connection's drain did.
#[derive(Debug, Clone, Copy, Default)]
pub struct Drained {
    pub processed: u64,
    /// Transactions (or crate calls) the server aborted, as deadlock victims
    /// or (hand-written modes on partitions) for locking a row another worker
    /// had just moved to the other partition, and that were run again.
    pub aborted: u64,
    /// A crate call (or a B3d round of several transactions) was aborted,
    /// taking its count of committed rows with it: `processed` is a lower
    /// bound.
    pub uncounted: bool,
}

/// Processes pending orders in `mode` until a round finds none.
pub fn drain<C: BenchConn>(conn: &mut C, mode: Mode) -> Result<Drained, diesel_claim::Error> {
    let mut drained = Drained::default();
    loop {
        match round(conn, mode) {
            Ok(0) => return Ok(drained),
            Ok(rows) => drained.processed += rows,
            // A deadlock victim is run again, as any worker would: a hand-written
            // transaction, or the crate's call, whose batch was rolled back and
            // stays pending (on InnoDB, B4's waiting `FOR UPDATE` readers
            // deadlock with the updates of the rows they wait for, and batched
            // claims now and then with the closures' updates of the pending
            // flag's index). Such a crate call's report is lost with it, rows it
            // committed before included, as is the count of a B3d round's
            // earlier transactions: the drain's count is then a lower bound,
            // and the outbox is what is checked. On partitioned orders,
            // a hand-written `FOR … SKIP LOCKED` that meets a row another worker
            // has just processed, and so moved to the other partition, fails
            // with a serialization failure (the crate passes such rows over).
            Err(
                diesel_claim::Error::Deadlock(_) | diesel_claim::Error::SerializationFailure(_),
            ) => {
                drained.aborted += 1;
                drained.uncounted |= mode.is_crate_mode() || mode.id == ModeId::B3d;
            }
            Err(error) => return Err(error),
        }
    }
}

/// One unit of work: a transaction (hand-written modes) or one call of the
/// crate, which goes through every candidate it finds.
fn round<C: BenchConn>(conn: &mut C, mode: Mode) -> Result<u64, diesel_claim::Error> {
    let n = mode.batch;
    Ok(match mode.id {
        ModeId::B0 => hand_written_row(conn, RowLock::SkipLocked)?,
        ModeId::B4 => hand_written_row(conn, RowLock::Wait)?,
        ModeId::B1 => hand_written_statement(conn, n)?,
        ModeId::B3h => hand_written_batch(conn, n, Select::Orders)?,
        ModeId::B3d => hand_written_double_checked(conn, n)?,
        ModeId::O3h => hand_written_by_priority(conn, n)?,
        ModeId::B2 => conn.claim_rows(None)?,
        ModeId::B3 => conn.claim_batches(n)?,
        ModeId::H2 | ModeId::H3 => conn.claim_from_head(n)?,
        ModeId::O3 => conn.claim_batches_by_priority(n)?,
        ModeId::M1 => conn.claim_marked(n, true)?,
        ModeId::M2 => conn.claim_marked(n, false)?,
        ModeId::D0 | ModeId::D3 => conn.diesel_alone(n)?,
        ModeId::DJ | ModeId::FQ => unreachable!("{mode} runs in `peers`, not in a drain loop"),
    })
}

/// B0 and B4: `BEGIN; SELECT id … LIMIT 1 FOR …; UPDATE; INSERT; COMMIT`.
fn hand_written_row<C: BenchConn>(conn: &mut C, lock: RowLock) -> QueryResult<u64> {
    let claim = C::BACKEND.select_pending("id", 1, lock);
    in_transaction(conn, |conn| {
        let ids = conn.load_ids(&claim)?;
        for &id in &ids {
            conn.process_row(id)?;
        }
        Ok(ids.len() as u64)
    })
}

/// B1: `WITH c AS (SELECT … SKIP LOCKED) UPDATE … RETURNING id`, committed on
/// its own (SQLite: in `BEGIN IMMEDIATE … COMMIT`), then the outbox rows in one
/// `INSERT`. MySQL has no `UPDATE … RETURNING`, so there B1 is the transaction
/// that comes closest: B3h's, selecting only ids.
fn hand_written_statement<C: BenchConn>(conn: &mut C, n: u32) -> QueryResult<u64> {
    let Some(claim) = C::BACKEND.claim_and_mark_batch(n) else {
        return hand_written_batch(conn, n, Select::Ids);
    };
    let ids = if C::BACKEND.claim_needs_transaction() {
        in_transaction(conn, |conn| conn.load_ids(&claim))?
    } else {
        conn.load_ids(&claim)?
    };
    if !ids.is_empty() {
        conn.write_outbox(&ids)?;
    }
    Ok(ids.len() as u64)
}

/// What a hand-written batch claim selects.
#[derive(Clone, Copy)]
enum Select {
    /// The columns of an order, as the crate's batches load them (B3h).
    Orders,
    /// Only the key (B1 on MySQL).
    Ids,
}

/// B3h: `BEGIN; SELECT <order> … LIMIT n FOR NO KEY UPDATE SKIP LOCKED;
/// UPDATE … WHERE id = ANY(…); INSERT …; COMMIT` (MySQL: `FOR UPDATE SKIP
/// LOCKED`, `id IN (…)`).
fn hand_written_batch<C: BenchConn>(conn: &mut C, n: u32, select: Select) -> QueryResult<u64> {
    let columns = match select {
        Select::Orders => ORDER_COLUMNS,
        Select::Ids => "id",
    };
    let claim = C::BACKEND.select_pending(columns, n, RowLock::SkipLocked);
    in_transaction(conn, |conn| {
        let ids = match select {
            Select::Orders => ids_of(&conn.load_orders(&claim)?),
            Select::Ids => conn.load_ids(&claim)?,
        };
        if !ids.is_empty() {
            conn.process_batch(&ids)?;
        }
        Ok(ids.len() as u64)
    })
}

/// O3h: `BEGIN; SELECT <order> … ORDER BY priority DESC, id LIMIT n FOR …
/// SKIP LOCKED; UPDATE …; INSERT …; COMMIT`.
fn hand_written_by_priority<C: BenchConn>(conn: &mut C, n: u32) -> QueryResult<u64> {
    let claim = C::BACKEND.select_pending_by_priority(ORDER_COLUMNS, n);
    in_transaction(conn, |conn| {
        let ids = ids_of(&conn.load_orders(&claim)?);
        if !ids.is_empty() {
            conn.process_batch(&ids)?;
        }
        Ok(ids.len() as u64)
    })
}

/// B3d: what the crate's batched claim sends, by hand. An unlocked read of a
/// page of candidate ids (100, or `n` when more), then batches `BEGIN; SELECT
/// <order> … AND id >= ? LIMIT n FOR NO KEY UPDATE SKIP LOCKED; UPDATE …;
/// INSERT …; COMMIT` from the page's first id on, each past the last, until one
/// ends at or past the page's last id or comes back short. (The crate goes on
/// from where the page ended; a round here starts from the first pending id,
/// which the partial index makes as cheap.)
fn hand_written_double_checked<C: BenchConn>(conn: &mut C, n: u32) -> QueryResult<u64> {
    let page = C::BACKEND.select_pending_from("id", None, n.max(100), None);
    let candidates = conn.load_ids(&page)?;
    let (Some(&first), Some(&last)) = (candidates.first(), candidates.last()) else {
        return Ok(0);
    };
    let mut from = first;
    let mut processed = 0;
    loop {
        let claim =
            C::BACKEND.select_pending_from(ORDER_COLUMNS, Some(from), n, Some(RowLock::SkipLocked));
        let ids = in_transaction(conn, |conn| {
            let ids = ids_of(&conn.load_orders(&claim)?);
            if !ids.is_empty() {
                conn.process_batch(&ids)?;
            }
            Ok(ids)
        })?;
        processed += ids.len() as u64;
        match ids.last() {
            Some(&reached) if ids.len() == n as usize && reached < last => from = reached + 1,
            _ => return Ok(processed),
        }
    }
}

/// Runs `body` between the backend's `BEGIN` and `COMMIT`, as hand-written
/// SQL would; rolls back on error.
fn in_transaction<C: BenchConn, T>(
    conn: &mut C,
    body: impl FnOnce(&mut C) -> QueryResult<T>,
) -> QueryResult<T> {
    conn.batch_execute(C::BACKEND.begin())?;
    match body(conn) {
        Ok(value) => conn.batch_execute("COMMIT").map(|()| value),
        Err(error) => {
            // The body's error is the one worth reporting.
            let _ = conn.batch_execute("ROLLBACK");
            Err(error)
        }
    }
}

/// One timed drain of one mode by some workers, and what it left behind.
#[derive(Debug, Clone)]
pub struct DrainRun {
    pub backend: BackendKind,
    pub mode: Mode,
    pub workers: usize,
    pub rows: i64,
    pub elapsed: Duration,
    pub processed: u64,
    pub statements: u64,
    pub commits: u64,
    pub aborted: u64,
    /// Some crate call, or B3d round, was aborted: `processed` is a lower bound.
    pub uncounted: bool,
    pub checks: Checks,
}

impl DrainRun {
    pub fn rows_per_sec(&self) -> f64 {
        self.processed as f64 / self.elapsed.as_secs_f64()
    }

    /// What went wrong with correctness; empty when all is well.
    pub fn failures(&self) -> Vec<String> {
        let mut failures = Vec::new();
        let mut check = |ok: bool, what: String| {
            if !ok {
                failures.push(format!(
                    "{} {} W={}: {what}",
                    self.backend.name(),
                    self.mode,
                    self.workers
                ));
            }
        };
        let checks = &self.checks;
        check(
            checks.duplicates == 0,
            format!("{} rows processed twice", checks.duplicates),
        );
        check(
            checks.leftovers == 0,
            format!("{} rows left pending", checks.leftovers),
        );
        let processed_adds_up = if self.uncounted {
            self.processed <= self.rows as u64
        } else {
            self.processed == self.rows as u64
        };
        check(
            processed_adds_up && checks.outbox_rows == self.rows,
            format!(
                "{} rows processed and {} outbox rows, of {}",
                self.processed, checks.outbox_rows, self.rows
            ),
        );
        failures
    }
}

/// Runs `work(index, ready, go)` on `workers` threads, each of which waits on
/// `ready` once connected and on `go` to start: `before_go` runs once all are
/// ready (the server's commit count), then the clock starts. Returns what
/// `before_go` returned, when the clock started, and each thread's result.
pub fn start_together<B, T: Send>(
    workers: usize,
    before_go: impl FnOnce() -> B,
    work: impl Fn(usize, &Barrier, &Barrier) -> T + Sync,
) -> (B, Instant, Vec<T>) {
    let (ready, go) = (Barrier::new(workers + 1), Barrier::new(workers + 1));
    thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|index| {
                let (work, ready, go) = (&work, &ready, &go);
                scope.spawn(move || work(index, ready, go))
            })
            .collect();
        ready.wait();
        let before = before_go();
        go.wait();
        let started = Instant::now();
        let results = handles
            .into_iter()
            .map(|handle| handle.join().expect("a worker panicked"))
            .collect();
        (before, started, results)
    })
}

/// Refills the queue with `rows` pending orders and times `workers` threads,
/// each with a connection of its own, draining it in `mode`.
pub fn run_drain<C: BenchConn>(
    db: &mut BenchDb<C>,
    mode: Mode,
    workers: usize,
    rows: i64,
    trace: bool,
) -> Result<DrainRun, String> {
    db.setup(|conn| reset_orders(conn, rows))?;
    // The Django loop and the job queue bring their own workers.
    match mode.id {
        ModeId::DJ => return peers::django::drain(db, workers, rows),
        ModeId::FQ => return peers::job_queue::drain(db, workers, rows),
        _ => {}
    }
    if trace {
        eprintln!("{} {mode} W={workers}, statements sent:", C::BACKEND.name());
    }
    let url = db.url.clone();
    let counters = Counters::new(!C::BACKEND.counts_commits(), trace);
    let (commits_before, started, outcomes) = start_together(
        workers,
        || db.server_commits(),
        |index, ready, go| worker::<C>(index, &url, mode, &counters, ready, go),
    );
    let outcomes = outcomes.into_iter().collect::<Result<Vec<_>, _>>()?;
    let commits = match (commits_before?, db.server_commits()?) {
        // Less each worker's final statistics flush.
        (Some(before), Some(after)) => (after - before - workers as i64).max(0) as u64,
        _ => counters.counts().commits,
    };
    let finished = outcomes.iter().map(|o| o.finished).max().unwrap_or(started);
    Ok(DrainRun {
        backend: C::BACKEND,
        mode,
        workers,
        rows,
        elapsed: finished.saturating_duration_since(started),
        processed: outcomes.iter().map(|o| o.drained.processed).sum(),
        aborted: outcomes.iter().map(|o| o.drained.aborted).sum(),
        uncounted: outcomes.iter().any(|o| o.drained.uncounted),
        statements: counters.counts().statements,
        commits,
        checks: db.setup(|conn| conn.load_checks())?,
    })
}

struct WorkerOutcome {
    drained: Drained,
    finished: Instant,
}

fn worker<C: BenchConn>(
    index: usize,
    url: &str,
    mode: Mode,
    counters: &Arc<Counters>,
    ready: &Barrier,
    go: &Barrier,
) -> Result<WorkerOutcome, String> {
    // Both barriers are reached whatever happens, so that nobody waits forever.
    let conn = connect_counted::<C>(url, counters, format!("worker {index}"));
    ready.wait();
    go.wait();
    let mut conn = conn?;
    let drained = drain(&mut conn, mode).map_err(|e| format!("{mode}: {e}"))?;
    let finished = Instant::now();
    stop_counting(&mut conn);
    conn.flush_stats().map_err(|e| e.to_string())?;
    Ok(WorkerOutcome { drained, finished })
}

/// A connection whose statements from now on are counted in `counters`; the
/// transactions of connecting are not.
fn connect_counted<C: BenchConn>(
    url: &str,
    counters: &Arc<Counters>,
    name: String,
) -> Result<C, String> {
    let mut conn = C::open(url).map_err(|e| format!("cannot connect: {e}"))?;
    conn.flush_stats().map_err(|e| e.to_string())?;
    count_statements(&mut conn, counters.clone(), name);
    Ok(conn)
}

/// What one `claim_each` call on an empty queue sent.
#[derive(Debug, Clone)]
pub struct EmptyQueueCheck {
    pub backend: BackendKind,
    /// What the client sent (statements classified).
    pub sent: Counts,
    /// PostgreSQL's count of the call's transactions, implicit ones included
    /// (`None` elsewhere).
    pub server_transactions: Option<i64>,
}

impl EmptyQueueCheck {
    /// One statement, no transaction opened, nothing committed: PostgreSQL
    /// still counts the statement's own implicit transaction, and only that.
    pub fn passed(&self) -> bool {
        self.sent.statements == 1
            && self.sent.begins == 0
            && self.sent.commits == 0
            && self.server_transactions.is_none_or(|n| n <= 1)
    }
}

pub fn check_empty_queue<C: BenchConn>(db: &mut BenchDb<C>) -> Result<EmptyQueueCheck, String> {
    db.setup(|conn| reset_orders(conn, 0))?;
    let counters = Counters::new(true, false);
    let mut conn = C::open(&db.url).map_err(|e| format!("cannot connect: {e}"))?;
    // A worker polls an empty queue over and over on one connection: measure
    // the second call, once the statement is prepared (PostgreSQL counts the
    // preparing round trip as a transaction of its own).
    conn.claim_rows(None).map_err(|e| e.to_string())?;
    conn.flush_stats().map_err(|e| e.to_string())?;
    let before = db.server_commits()?;
    count_statements(&mut conn, counters.clone(), "empty queue".to_owned());
    let processed = conn.claim_rows(None).map_err(|e| e.to_string())?;
    stop_counting(&mut conn);
    conn.flush_stats().map_err(|e| e.to_string())?;
    let after = db.server_commits()?;
    if processed != 0 {
        return Err(format!(
            "the empty-queue check found {processed} rows pending"
        ));
    }
    Ok(EmptyQueueCheck {
        backend: C::BACKEND,
        sent: counters.counts(),
        // Less the flush's own transaction.
        server_transactions: before.zip(after).map(|(b, a)| a - b - 1),
    })
}
