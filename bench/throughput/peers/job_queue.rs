//! FQ: the fang job queue (its blocking queue, on Diesel and PostgreSQL), one
//! job per pending order. A job marks its order done and writes its outbox
//! row, in a transaction, on a connection of its worker thread's own; each
//! worker runs fang's `Worker` on a queue whose pool holds one connection.
//!
//! fang's `WorkerPool` runs until the process ends and sleeps while the queue
//! is empty; each worker here is its loop instead, fetching and running jobs
//! with fang's own `fetch_and_touch_task` and `Worker::run`, until a fetch
//! finds none, as the other modes drain.

use std::cell::{Cell, RefCell};
use std::sync::{Arc, Barrier};
use std::time::Instant;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use diesel::PgConnection;
use fang::typetag;
use fang::{FangError, Queue, Queueable, Runnable, Worker};

use super::PeerOutcome;
use crate::counting::{count_statements, stop_counting, Counters};
use crate::database::BenchDb;
use crate::db::BenchConn;
use crate::drain::{start_together, DrainRun, Mode, ModeId};

/// The job: ship the email of one order.
#[derive(fang::Serialize, fang::Deserialize)]
#[serde(crate = "fang::serde")]
struct ShipEmail {
    order_id: i64,
}

thread_local! {
    /// The connection jobs run on, opened by each worker thread before the
    /// clock starts.
    static JOB_CONN: RefCell<Option<PgConnection>> = const { RefCell::new(None) };
    /// Jobs this thread has run to the end.
    static JOBS_DONE: Cell<u64> = const { Cell::new(0) };
}

#[typetag::serde]
impl Runnable for ShipEmail {
    fn run(&self, _queue: &dyn Queueable) -> Result<(), FangError> {
        JOB_CONN
            .with_borrow_mut(|conn| {
                let conn = conn.as_mut().expect("the worker opened it");
                conn.transaction(|conn| conn.process_row(self.order_id))
            })
            .map_err(|e| FangError {
                description: e.to_string(),
            })?;
        JOBS_DONE.set(JOBS_DONE.get() + 1);
        Ok(())
    }
}

/// Counts the statements of each connection fang's pool opens, from its
/// first checkout on (as `connect_counted` does for the other modes).
#[derive(Debug)]
struct Counted(Arc<Counters>);

impl CustomizeConnection<PgConnection, diesel::r2d2::Error> for Counted {
    fn on_acquire(&self, conn: &mut PgConnection) -> Result<(), diesel::r2d2::Error> {
        conn.flush_stats()
            .map_err(diesel::r2d2::Error::QueryError)?;
        count_statements(conn, self.0.clone(), "fang queue".to_owned());
        Ok(())
    }
}

/// One job per pending order, as fang's `insert_task` would write them, in
/// one statement: the job's JSON is typetag's, `{"type": "ShipEmail", …}`.
const ENQUEUE: &str = "TRUNCATE fang_tasks;
    INSERT INTO fang_tasks (metadata, task_type)
        SELECT jsonb_build_object('type', 'ShipEmail', 'order_id', id), 'common'
        FROM orders ORDER BY id";

/// Enqueues a job per pending order (refilled already) and times `workers`
/// fang workers running them all.
pub fn drain<C: BenchConn>(
    db: &mut BenchDb<C>,
    workers: usize,
    rows: i64,
) -> Result<DrainRun, String> {
    let url = db.url.clone();
    enqueue(&url)?;
    let counters = Counters::new(false, false);
    let (commits_before, started, outcomes) = start_together(
        workers,
        || db.server_commits(),
        |_, ready, go| worker(&url, &counters, ready, go),
    );
    let outcomes = outcomes.into_iter().collect::<Result<Vec<_>, _>>()?;
    let outcome = PeerOutcome {
        started,
        finished: outcomes.iter().map(|o| o.1).max().unwrap_or(started),
        processed: outcomes.iter().map(|o| o.0).sum(),
        // Less the test `SELECT 1` of each worker's last checkout, to flush.
        statements: counters.counts().statements - workers as u64,
        commits_before: commits_before?,
        // Per worker: that `SELECT 1` and the flush on the queue's connection,
        // and the flush on the jobs' connection.
        extra_commits: 3 * workers as i64,
    };
    outcome.into_run(db, Mode::new(ModeId::FQ, 1), workers, rows)
}

/// Creates fang's table (its own migrations) and enqueues one job per order;
/// then tidies up as after every refill, so that FQ starts as the other modes.
fn enqueue(url: &str) -> Result<(), String> {
    let mut conn = PgConnection::establish(url).map_err(|e| e.to_string())?;
    fang::run_migrations_postgres(&mut conn).map_err(|e| format!("fang's migrations: {e}"))?;
    // One at a time: `VACUUM` cannot run in the implicit transaction of
    // several statements sent together.
    for sql in [ENQUEUE, "VACUUM ANALYZE fang_tasks", "CHECKPOINT"] {
        conn.batch_execute(sql).map_err(|e| e.to_string())?;
    }
    conn.flush_stats().map_err(|e| e.to_string())
}

/// One worker: jobs run, and when it found none left.
fn worker(
    url: &str,
    counters: &Arc<Counters>,
    ready: &Barrier,
    go: &Barrier,
) -> Result<(u64, Instant), String> {
    // Both barriers are reached whatever happens, so that nobody waits forever.
    let connected = connect(url, counters);
    ready.wait();
    go.wait();
    let queue = connected?;
    let worker: Worker<Queue> = Worker::builder().queue(queue.clone()).build();
    JOBS_DONE.set(0);
    loop {
        match queue.fetch_and_touch_task(fang::runnable::COMMON_TYPE.to_owned()) {
            Ok(Some(task)) => worker.run(&task).map_err(|e| e.description)?,
            Ok(None) => break,
            Err(e) => return Err(format!("FQ: {e:?}")),
        }
    }
    let finished = Instant::now();
    let flush = |conn: &mut PgConnection| {
        stop_counting(conn);
        conn.flush_stats().map_err(|e| e.to_string())
    };
    JOB_CONN.with_borrow_mut(|conn| flush(conn.as_mut().expect("opened")))?;
    let mut pooled = queue.get_connection().map_err(|e| format!("{e:?}"))?;
    flush(&mut pooled)?;
    Ok((JOBS_DONE.get(), finished))
}

/// The worker's queue, its pool of one connection open, and its jobs'
/// connection; both counted.
fn connect(url: &str, counters: &Arc<Counters>) -> Result<Queue, String> {
    let mut conn = PgConnection::establish(url).map_err(|e| format!("cannot connect: {e}"))?;
    conn.flush_stats().map_err(|e| e.to_string())?;
    count_statements(&mut conn, counters.clone(), "fang job".to_owned());
    JOB_CONN.set(Some(conn));
    // r2d2's defaults otherwise, as fang's documentation builds its pool
    // (a `SELECT 1` on each checkout included).
    let pool = Pool::builder()
        .max_size(1)
        .connection_customizer(Box::new(Counted(counters.clone())))
        .build(ConnectionManager::<PgConnection>::new(url))
        .map_err(|e| format!("cannot connect: {e}"))?;
    Ok(Queue::builder().connection_pool(pool).build())
}
