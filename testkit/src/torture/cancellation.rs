//! Scenario 26: async claims (`diesel_claim::aio`) whose futures are dropped
//! mid-transaction, and the worker processes it starts.
//!
//! A dropped future cannot await its rollback (there is no async drop). The
//! dropped transaction still sends its `ROLLBACK` without awaiting it, so
//! its row lock and its uncommitted write go at once, whatever becomes of
//! the connection; behind that, the idle bound every transaction of the
//! async API sets ([`IDLE_TRANSACTION_BOUND`](diesel_claim::aio::IDLE_TRANSACTION_BOUND) by default) and, for a
//! connection handed back to bb8 or deadpool, the pool discarding it. The
//! scenario drops claims (stalled between statements) on all three kinds of
//! connection, keeps some of them where nothing else would free their rows
//! before the bound, and times how long each row stays locked after the
//! drop.
//!
//! The scenario is written once, for the backends of `on_async_backends!`.

use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use diesel::{ConnectionResult, ExpressionMethods, QueryDsl};
use diesel_async::pooled_connection::{bb8, deadpool, AsyncDieselConnectionManager, ManagerConfig};
use diesel_async::{AsyncConnection, RunQueryDsl};
use diesel_claim::aio::prelude::*;
use futures_util::future::{BoxFuture, FutureExt};
use tokio::sync::Notify;

use super::claiming::pending;
use super::procs::Fields;
use super::{Ctx, Figures, Running};
use crate::fixtures::{orders, outbox, Order};

/// How much later than the bound a dropped claim's row may be freed: the
/// server's timer, then the watcher's next poll.
const MARGIN: Duration = Duration::from_secs(5);

/// The connections the tasks claim on, in turn: task `i` uses `KINDS[i % 3]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bb8,
    Deadpool,
    Plain,
}

const KINDS: [Kind; 3] = [Kind::Bb8, Kind::Deadpool, Kind::Plain];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Bb8 => "bb8",
            Kind::Deadpool => "deadpool",
            Kind::Plain => "plain",
        }
    }
}

/// A row a dropped claim left locked, and when it was freed.
struct Held {
    id: i32,
    /// The connection's kind and what became of it: `bb8-returned`, `plain-kept`, …
    fate: String,
    dropped: Instant,
    released: Option<Duration>,
    /// Still locked at the bound and the margin: the watcher stopped waiting.
    overdue: bool,
}

impl Held {
    /// Neither freed yet nor given up on.
    fn waiting(&self) -> bool {
        self.released.is_none() && !self.overdue
    }
}

/// The worker's figures, the dropped claims counted by fate in `dropped`,
/// and in `released` each freed row's fate with the milliseconds it stayed
/// locked (`fate:ms,…`).
fn report(figures: &Figures, held: &[Held]) -> Fields {
    let mut fates = BTreeMap::new();
    for row in held {
        *fates.entry(row.fate.clone()).or_default() += 1;
    }
    let released: Vec<_> = held
        .iter()
        .filter_map(|h| h.released.map(|d| format!("{}:{}", h.fate, d.as_millis())))
        .collect();
    let mut fields = figures.to_fields();
    fields
        .set_counts("dropped", &fates)
        .set("released", released.join(","));
    fields
}

/// The runner's summary of the workers' `released` fields: how long the
/// rows stayed locked after their claims were dropped, the median and the
/// longest, and the longest by fate.
fn summary(released: &[(String, u64)]) -> String {
    let mut all: Vec<u64> = released.iter().map(|(_, ms)| *ms).collect();
    all.sort();
    let mut by_fate = BTreeMap::<&str, (usize, u64)>::new();
    for (fate, ms) in released {
        let (count, max) = by_fate.entry(fate).or_default();
        (*count, *max) = (*count + 1, (*max).max(*ms));
    }
    let by_fate: Vec<String> = by_fate
        .iter()
        .map(|(fate, (count, max))| format!("{fate} ×{count} {max} ms"))
        .collect();
    format!(
        "drop→release median {} ms, max {} ms; max by fate: {}",
        all[all.len() / 2],
        all[all.len() - 1],
        by_fate.join(", ")
    )
}

/// `on_suite_backends!` for the async scenarios: the items once per backend
/// the async API and the suite both cover, in `on_<backend>` modules where
/// `AsyncConn` is the backend's diesel-async connection and `establish`
/// opens one as claimers there should have it.
macro_rules! on_async_backends {
    ($($items:tt)*) => {
        #[cfg(feature = "postgres")]
        pub mod on_postgres {
            use super::*;
            use crate::torture::claiming::on_postgres::{check_emails, database};
            pub type AsyncConn = diesel_async::AsyncPgConnection;
            fn establish(url: &str) -> BoxFuture<'_, ConnectionResult<AsyncConn>> {
                AsyncConn::establish(url).boxed()
            }
            $($items)*
        }
        #[cfg(feature = "mysql")]
        pub mod on_mysql {
            use super::*;
            use crate::torture::claiming::on_mysql::{check_emails, database};
            pub type AsyncConn = diesel_async::AsyncMysqlConnection;
            /// In read committed, as the guide recommends for claimers on
            /// InnoDB.
            fn establish(url: &str) -> BoxFuture<'_, ConnectionResult<AsyncConn>> {
                diesel_claim::aio::establish_read_committed(url)
            }
            $($items)*
        }
    };
}

on_async_backends! {
    /// How long after its drop a dropped claim's row may still be locked:
    /// the margin (its `ROLLBACK` was sent at the drop). The bound would
    /// free it only at `IDLE_TRANSACTION_BOUND`.
    fn limit() -> Duration {
        MARGIN
    }

    /// A connection a task claims on.
    enum Handle {
        Bb8(bb8::PooledConnection<'static, AsyncConn>),
        Deadpool(deadpool::Object<AsyncConn>),
        Plain(AsyncConn),
    }

    impl Deref for Handle {
        type Target = AsyncConn;
        fn deref(&self) -> &AsyncConn {
            match self {
                Handle::Bb8(conn) => conn,
                Handle::Deadpool(conn) => conn,
                Handle::Plain(conn) => conn,
            }
        }
    }

    impl DerefMut for Handle {
        fn deref_mut(&mut self) -> &mut AsyncConn {
            match self {
                Handle::Bb8(conn) => conn,
                Handle::Deadpool(conn) => conn,
                Handle::Plain(conn) => conn,
            }
        }
    }

    /// What a worker's tasks share: the pools, and the rows their dropped
    /// claims left locked, which the watcher times.
    struct Shared {
        url: String,
        bb8: bb8::Pool<AsyncConn>,
        deadpool: deadpool::Pool<AsyncConn>,
        held: Mutex<Vec<Held>>,
        /// Cleared by the watcher when a row outlived the bound: it will not
        /// be claimable, so the tasks stop draining.
        bounded: Running,
        /// Cleared when every task has ended: the watcher's last poll.
        draining: Running,
    }

    impl Shared {
        fn held_before(&self, id: i32) -> bool {
            self.held.lock().unwrap().iter().any(|row| row.id == id)
        }

        /// A connection of `kind`: from its pool, or for `Plain` the task's
        /// own (`own`), connected anew once the task has kept its last one.
        async fn open(&self, kind: Kind, own: &mut Option<AsyncConn>) -> Handle {
            match kind {
                Kind::Bb8 => Handle::Bb8(self.bb8.get_owned().await.expect("no bb8 connection")),
                Kind::Deadpool => Handle::Deadpool(self.deadpool.get().await.expect("no deadpool connection")),
                Kind::Plain => Handle::Plain(match own.take() {
                    Some(conn) => conn,
                    None => connect(&self.url).await,
                }),
            }
        }
    }

    async fn connect(url: &str) -> AsyncConn {
        establish(url).await.unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
    }

    /// The email of `order`, as the blocking scenarios send it: an outbox
    /// row by `worker`, and the flag cleared.
    async fn email(conn: &mut AsyncConn, order: &Order, worker: i32) -> Result<(), Error> {
        diesel::insert_into(outbox::table)
            .values((outbox::order_id.eq(order.id), outbox::worker.eq(worker)))
            .execute(conn)
            .await?;
        diesel::update(order).set(orders::email_sent.eq(true)).execute(conn).await?;
        Ok(())
    }

    /// One task: drains the pending orders on connections of `kind` (a
    /// pooled one taken per claim, as a request handler would; a plain one
    /// kept), claim after claim, until none is left. Its first `drops`
    /// claims are dropped mid-transaction: a row picked at random among its
    /// next few gets its email, signed by `-worker`, and its closure stalls
    /// until a `select!` drops the claim. The connection is then handed back
    /// to its pool or kept, never used again until the end (`keep`, always
    /// for a plain one); the rows it kept are returned with it.
    async fn drain_task(
        shared: Arc<Shared>,
        kind: Kind,
        worker: i32,
        mut drops: u32,
        mut keep: bool,
    ) -> (Figures, Vec<Handle>) {
        let mut figures = Figures::default();
        let mut kept = Vec::new();
        let mut own = None;
        loop {
            let mut conn = shared.open(kind, &mut own).await;
            // Rows until the one this claim stalls on; 0 for none. Rows a
            // dropped claim held before are not counted: one freed at once
            // (by bb8) and held again by another drop would seem held for
            // the bound.
            let countdown = AtomicU32::new(if drops > 0 { fastrand::u32(1..=8) } else { 0 });
            let stalled = Notify::new();
            let stalled_on = OnceLock::new();
            let claim = pending().build_claim().drain().page_size(100).each(
                &mut *conn,
                async |conn: &mut AsyncConn, order: Order| {
                    let stall = !shared.held_before(order.id)
                        && countdown.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)) == Ok(1);
                    email(conn, &order, if stall { -worker } else { worker }).await?;
                    if stall {
                        let _ = stalled_on.set(order.id);
                        stalled.notify_one();
                        std::future::pending::<()>().await;
                    }
                    Ok::<_, Error>(())
                },
            );
            // The claim moves into the `select!`, which drops it if the
            // closure stalls.
            let claimed = tokio::select! {
                claimed = claim => Some(claimed),
                () = stalled.notified() => None,
            };
            match claimed {
                Some(Ok(report)) => figures.ops += report.processed,
                Some(Err(error)) if error.is_transient() => figures.saw(&error),
                Some(Err(error)) => {
                    figures.check(false, format!("worker {worker} ({}): {error}", kind.name()));
                    return (figures, kept);
                }
                None => {
                    // The claim's future is gone; its transaction is open on
                    // `conn`, the row locked, the email written.
                    let keeps = keep || kind == Kind::Plain;
                    let fate = if keeps { "kept" } else { "returned" };
                    shared.held.lock().unwrap().push(Held {
                        id: *stalled_on.get().expect("the stalled closure names its row"),
                        fate: format!("{}-{fate}", kind.name()),
                        dropped: Instant::now(),
                        released: None,
                        overdue: false,
                    });
                    figures.count_error("dropped");
                    if keeps {
                        kept.push(conn);
                    }
                    (drops, keep) = (drops - 1, !keep);
                    continue;
                }
            }
            let left = pending().count().get_result::<i64>(&mut *conn).await;
            if let Handle::Plain(conn) = conn {
                own = Some(conn);
            }
            match left {
                Ok(0) => return (figures, kept),
                _ if !shared.bounded.get() => return (figures, kept),
                // Rows a dropped claim holds: they come back within the bound.
                Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                Err(error) => figures.saw(&error.into()),
            }
        }
    }

    /// Polls the rows the dropped claims left locked, on a connection of its
    /// own, with `FOR UPDATE SKIP LOCKED` (which locks nothing beyond its own
    /// statement): a row it gets is free again. One still locked at the
    /// bound and the margin is a failure, and the drain's end.
    async fn watch(shared: Arc<Shared>) -> Figures {
        let mut figures = Figures::default();
        let mut conn = connect(&shared.url).await;
        let limit = limit();
        loop {
            // Read before the poll: once the tasks are done, one more poll.
            let draining = shared.draining.get();
            let waiting: Vec<i32> = {
                let held = shared.held.lock().unwrap();
                held.iter().filter(|h| h.waiting()).map(|h| h.id).collect()
            };
            if !waiting.is_empty() {
                let free: Vec<i32> = orders::table
                    .filter(orders::id.eq_any(&waiting))
                    .select(orders::id)
                    .for_update()
                    .skip_locked()
                    .load(&mut conn)
                    .await
                    .expect("the watcher's poll failed");
                let mut held = shared.held.lock().unwrap();
                for row in held.iter_mut().filter(|h| h.waiting()) {
                    let elapsed = row.dropped.elapsed();
                    if free.contains(&row.id) {
                        row.released = Some(elapsed);
                    } else if elapsed > limit {
                        row.overdue = true;
                        shared.bounded.stop();
                        let row = format!("row {} ({})", row.id, row.fate);
                        figures.check(false, format!(
                            "{row} still locked {elapsed:.0?} after its claim was dropped (the limit is {limit:?})"
                        ));
                    }
                }
            }
            if !draining {
                return figures;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Worker: `tasks` tokio tasks (on 2 threads), on bb8, deadpool and plain
    /// connections in turn, drain the pending orders; each task's first
    /// `drops` claims are dropped mid-transaction (see `drain_task`).
    /// Reports when every row is done (or one outlived the bound), after
    /// checking that no connection kept after a drop runs a statement in the
    /// abandoned transaction (a statement that runs sees no write of a
    /// dropped claim).
    pub fn cancel_worker(args: &Fields) -> Fields {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("cannot start a tokio runtime");
        runtime.block_on(async {
            let url = args.text("url").to_owned();
            let (tasks, first) = (args.number("tasks") as usize, args.number("first") as i32);
            let drops = args.number("drops") as u32;
            // Room for every task and every connection it may keep.
            let size = (tasks * (1 + drops as usize)) as u32;
            let manager = || {
                let mut config = ManagerConfig::default();
                config.custom_setup = Box::new(establish);
                AsyncDieselConnectionManager::<AsyncConn>::new_with_config(url.clone(), config)
            };
            let shared = Arc::new(Shared {
                bb8: bb8::Pool::builder().max_size(size).build(manager()).await.expect("no bb8 pool"),
                deadpool: deadpool::Pool::builder(manager()).max_size(size as usize).build().expect("no deadpool pool"),
                url,
                held: Mutex::new(Vec::new()),
                bounded: Running::new(),
                draining: Running::new(),
            });
            let watcher = tokio::spawn(watch(shared.clone()));
            let handles: Vec<_> = (0..tasks)
                .map(|index| {
                    // Pooled connections: every other task keeps its first.
                    let keep = index / KINDS.len() % 2 == 1;
                    let kind = KINDS[index % KINDS.len()];
                    tokio::spawn(drain_task(shared.clone(), kind, first + index as i32, drops, keep))
                })
                .collect();
            let mut figures = Figures::default();
            let mut kept = Vec::new();
            for handle in handles {
                let (task, conns) = handle.await.expect("a task panicked");
                figures.merge(task);
                kept.extend(conns);
            }
            shared.draining.stop();
            figures.merge(watcher.await.expect("the watcher panicked"));
            let mut abandoned = 0;
            for conn in &mut kept {
                let dropped_writes = outbox::table.filter(outbox::worker.lt(0)).count();
                let seen = dropped_writes.get_result::<i64>(&mut **conn).await;
                abandoned += usize::from(matches!(seen, Ok(writes) if writes > 0));
            }
            figures.check(abandoned == 0, format!(
                "{abandoned} of {} connections kept after their claims were dropped still run statements, \
                 in the abandoned transactions",
                kept.len()
            ));
            let held = std::mem::take(&mut *shared.held.lock().unwrap());
            report(&figures, &held)
        })
    }

    /// Scenario 26: worker processes each run tokio tasks that drain the
    /// rows with the async claim on bb8, deadpool and plain connections;
    /// some claims, at random rows, write their email and stall until a
    /// `select!` drops them mid-transaction, early in the drain, and their
    /// connections go back to the pool or are kept idle. Every row is
    /// emailed exactly once and none is left; no write of a dropped claim
    /// survives; every row a dropped claim held is free within the margin
    /// with nothing done to its connection (the dropped claim rolled back);
    /// a kept connection runs nothing in the abandoned transaction.
    pub fn dropped_futures(ctx: &Ctx) -> Figures {
        let rows = ctx.rows();
        let (_db, url, pool) = database(2, rows);
        let (processes, tasks, drops) = ctx.scale.pick((2, 6, 1), (4, 6, 2));
        let mut figures = Figures::new(processes * tasks, processes);
        let workers: Vec<_> = (0..processes)
            .map(|p| {
                let args = [
                    ("url", url.clone()),
                    ("tasks", tasks.to_string()),
                    ("first", (1 + p * tasks).to_string()),
                    ("drops", drops.to_string()),
                ];
                ctx.spawn("cancel", &args)
            })
            .collect();
        let (mut dropped, mut released) = (Vec::new(), Vec::new());
        for worker in workers {
            let done = worker.finish();
            figures.absorb(&done);
            dropped.extend(done.counts("dropped"));
            released.extend(done.counts("released"));
        }
        let mut conn = pool.get().unwrap();
        check_emails(&mut conn, &mut figures, rows as u64);
        let survived = outbox::table.filter(outbox::worker.lt(0)).count();
        let survived: i64 = diesel::RunQueryDsl::get_result(survived, &mut *conn).unwrap();
        figures.check(survived == 0, format!("{survived} writes of dropped claims were committed"));
        let count = |kept: bool| -> u64 {
            dropped.iter().filter(|(fate, _)| fate.ends_with("-kept") == kept).map(|(_, n)| n).sum()
        };
        let (kept, returned) = (count(true), count(false));
        figures.check(kept > 0, "no connection was kept after a drop: the kept case went untested");
        let limit = limit();
        let slowest = released.iter().map(|(_, ms)| *ms).max().unwrap_or(0);
        figures.check(
            slowest <= limit.as_millis() as u64,
            format!("a row stayed locked {slowest} ms after its claim was dropped, beyond {limit:?}"),
        );
        figures.note(format!(
            "{rows} rows; {} claims dropped mid-transaction ({returned} connections returned to their pools, {kept} kept), {} rows freed; {}",
            kept + returned,
            released.len(),
            if released.is_empty() { "nothing freed".to_owned() } else { summary(&released) },
        ));
        figures
    }
}
