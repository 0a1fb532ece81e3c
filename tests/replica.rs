//! Claims that read their candidates on a streaming replica: a real one,
//! started from the local PostgreSQL binaries, that applies each commit
//! 1.5 s after the primary made it.

use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use diesel::connection::{Instrumentation, InstrumentationEvent};
use diesel::prelude::*;
use diesel::sql_query;
use diesel_claim::prelude::*;
use diesel_claim::ClaimReport;

use testkit::fixtures::{create_schema, orders, outbox, Order, POSTGRES_SCHEMA};
use testkit::PgReplicaPair;

const APPLY_DELAY: Duration = Duration::from_millis(1500);
const ROWS: i32 = 3_000;
/// Rows placed on the primary while the workers drain.
const LATE_ROWS: i32 = 600;
const WORKERS: i32 = 4;

fn pending() -> diesel::dsl::Filter<
    diesel::dsl::Filter<orders::table, diesel::dsl::Eq<orders::shipped, bool>>,
    diesel::dsl::Eq<orders::email_sent, bool>,
> {
    orders::table
        .filter(orders::shipped.eq(true))
        .filter(orders::email_sent.eq(false))
}

/// The unlocked reads of keys a connection sends: `(candidates, still
/// matching)`, told apart by their limit (the second has none).
#[derive(Clone, Default)]
struct KeyReads(Arc<Mutex<(u64, u64)>>);

impl Instrumentation for KeyReads {
    fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
        if let InstrumentationEvent::StartQuery { query, .. } = event {
            let sql = query.to_string();
            if sql.starts_with("SELECT") && !sql.contains(" FOR ") {
                let mut reads = self.0.lock().unwrap();
                if sql.contains(&i64::MAX.to_string()) {
                    reads.1 += 1;
                } else {
                    reads.0 += 1;
                }
            }
        }
    }
}

impl KeyReads {
    fn get(&self) -> (u64, u64) {
        *self.0.lock().unwrap()
    }
}

fn connect(url: &str, reads: &KeyReads) -> PgConnection {
    let mut conn = PgConnection::establish(url).unwrap();
    conn.set_instrumentation(reads.clone());
    conn
}

fn place(conn: &mut PgConnection, rows: i32) {
    let new: Vec<_> = (0..rows)
        .map(|_| (orders::shipped.eq(true), orders::email_sent.eq(false)))
        .collect();
    diesel::insert_into(orders::table)
        .values(&new)
        .execute(conn)
        .unwrap();
}

fn pending_rows(url: &str) -> i64 {
    let mut conn = PgConnection::establish(url).unwrap();
    pending().count().get_result(&mut conn).unwrap()
}

/// Processing: one outbox row, then the row marked done.
fn email(conn: &mut PgConnection, order: &Order, worker: i32) -> diesel::QueryResult<()> {
    diesel::insert_into(outbox::table)
        .values((outbox::order_id.eq(order.id), outbox::worker.eq(worker)))
        .execute(conn)?;
    diesel::update(order)
        .set(orders::email_sent.eq(true))
        .execute(conn)?;
    Ok(())
}

/// One drain by `worker` on the primary: per row for even workers, in
/// batches of 20 for odd ones; candidates from the replica when given.
fn drain(
    primary: &mut PgConnection,
    replica: Option<&mut PgConnection>,
    worker: i32,
) -> ClaimReport {
    let claim = pending()
        .build_claim()
        .drain()
        .batch(if worker % 2 == 0 { 1 } else { 20 });
    let f = |conn: &mut PgConnection, order: Order| email(conn, &order, worker);
    match replica {
        Some(replica) => claim.candidates_from(replica).each(primary, f),
        None => claim.each(primary, f),
    }
    .unwrap()
}

/// `WORKERS` threads drain `ROWS` rows while `LATE_ROWS` more are placed;
/// returns the primary's and the replica's key reads, and the reports.
fn drain_while_placing(
    primary_url: &str,
    replica_url: Option<&str>,
) -> ((u64, u64), (u64, u64), Vec<ClaimReport>) {
    let (primary_reads, replica_reads) = (KeyReads::default(), KeyReads::default());
    let placing = {
        let url = primary_url.to_owned();
        thread::spawn(move || {
            let mut conn = PgConnection::establish(&url).unwrap();
            for _ in 0..LATE_ROWS / 20 {
                place(&mut conn, 20);
                thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let reports = thread::scope(|scope| {
        let workers: Vec<_> = (0..WORKERS)
            .map(|worker| {
                let (primary_reads, replica_reads) = (&primary_reads, &replica_reads);
                scope.spawn(move || {
                    let mut primary = connect(primary_url, primary_reads);
                    let mut replica = replica_url.map(|url| connect(url, replica_reads));
                    drain(&mut primary, replica.as_mut(), worker)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().unwrap())
            .collect::<Vec<_>>()
    });
    placing.join().unwrap();
    (primary_reads.get(), replica_reads.get(), reports)
}

/// Every row emailed exactly once: `(outbox rows, distinct orders)`.
fn emails(url: &str) -> (i64, i64) {
    use diesel::dsl::{count_star, sql};
    use diesel::sql_types::BigInt;
    let mut conn = PgConnection::establish(url).unwrap();
    outbox::table
        .select((count_star(), sql::<BigInt>("COUNT(DISTINCT order_id)")))
        .get_result(&mut conn)
        .unwrap()
}

/// Workers that read their candidates on a replica seconds behind the
/// primary process every row once: rows the replica still shows pending
/// after others processed them are re-checked on the primary and passed
/// over, and rows it has not shown yet are claimed by a later call. The
/// primary runs none of the candidate reads. Without the lock's re-check on
/// the primary, the stale candidates would be emailed twice.
#[test]
fn candidates_read_on_a_lagging_replica_are_claimed_once_each() {
    let pair = PgReplicaPair::start(APPLY_DELAY);
    let mut admin = PgConnection::establish(&pair.primary_url).unwrap();
    sql_query("CREATE DATABASE claims")
        .execute(&mut admin)
        .unwrap();
    let (primary_url, replica_url) = pair.urls("claims");
    let mut primary = PgConnection::establish(&primary_url).unwrap();
    create_schema(&mut primary, POSTGRES_SCHEMA);

    // First on the primary alone, for the reads it runs; then with the replica.
    place(&mut primary, ROWS);
    let (alone, _, _) = drain_while_placing(&primary_url, None);
    let left = pending_rows(&primary_url);
    drain(&mut primary, None, 0);
    assert_eq!(pending_rows(&primary_url), 0);
    let emailed_alone = i64::from(ROWS + LATE_ROWS);
    assert_eq!(emails(&primary_url), (emailed_alone, emailed_alone));
    eprintln!("primary alone: candidate reads {}, still-matching reads {}, {left} rows left to a later call", alone.0, alone.1);

    place(&mut primary, ROWS);
    pair.wait_for_replay(Duration::from_secs(30));
    let (on_primary, on_replica, reports) = drain_while_placing(&primary_url, Some(&replica_url));
    let processed: u64 = reports.iter().map(|report| report.processed).sum();
    let gone: u64 = reports.iter().map(|report| report.gone).sum();
    // The replica was behind: it still shows rows the primary has processed.
    let (left, stale) = (pending_rows(&primary_url), pending_rows(&replica_url));
    assert!(
        stale > left,
        "the replica was not behind: {stale} pending there, {left} on the primary"
    );
    eprintln!(
        "with the replica: primary candidate reads {}, still-matching reads {}; replica candidate \
         reads {}; {processed} processed, {gone} stale candidates passed over, {left} left to a \
         later call (the replica showed {stale})",
        on_primary.0, on_primary.1, on_replica.0,
    );
    assert_eq!(on_primary.0, 0, "candidates were read on the primary");
    assert!(on_replica.0 > 0);

    // Later calls find what the replica had not shown.
    let mut replica = PgConnection::establish(&replica_url).unwrap();
    for _ in 0..10 {
        if pending_rows(&primary_url) == 0 {
            break;
        }
        pair.wait_for_replay(Duration::from_secs(30));
        drain(&mut primary, Some(&mut replica), 0);
    }
    assert_eq!(pending_rows(&primary_url), 0, "rows left pending");
    let emailed = emailed_alone + i64::from(ROWS + LATE_ROWS);
    assert_eq!(
        emails(&primary_url),
        (emailed, emailed),
        "(outbox rows, orders emailed)"
    );
}

#[cfg(feature = "async")]
mod aio {
    use std::time::Duration;

    use diesel::connection::SimpleConnection;
    use diesel::prelude::*;
    use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
    use diesel_claim::aio::prelude::*;

    use super::{
        emails, pending, pending_rows, place, KeyReads, APPLY_DELAY, LATE_ROWS, ROWS, WORKERS,
    };
    use testkit::fixtures::{create_schema, orders, outbox, Order, POSTGRES_SCHEMA};
    use testkit::PgReplicaPair;

    /// The same on diesel-async: candidates from the replica, every row once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn async_candidates_read_on_a_lagging_replica_are_claimed_once_each() {
        async fn connect(url: &str, reads: &KeyReads) -> AsyncPgConnection {
            let mut conn = AsyncPgConnection::establish(url).await.unwrap();
            conn.set_instrumentation(reads.clone());
            conn
        }
        async fn drain(
            primary: &mut AsyncPgConnection,
            replica: &mut AsyncPgConnection,
            worker: i32,
        ) -> ClaimReport {
            pending()
                .build_claim()
                .drain()
                .batch(if worker % 2 == 0 { 1 } else { 20 })
                .candidates_from(replica)
                .each(
                    primary,
                    async |conn: &mut AsyncPgConnection, order: Order| {
                        diesel::insert_into(outbox::table)
                            .values((outbox::order_id.eq(order.id), outbox::worker.eq(worker)))
                            .execute(conn)
                            .await?;
                        diesel::update(&order)
                            .set(orders::email_sent.eq(true))
                            .execute(conn)
                            .await?;
                        Ok::<_, diesel_claim::Error>(())
                    },
                )
                .await
                .unwrap()
        }

        let pair = PgReplicaPair::start(APPLY_DELAY);
        let mut admin = PgConnection::establish(&pair.primary_url).unwrap();
        admin.batch_execute("CREATE DATABASE claims").unwrap();
        let (primary_url, replica_url) = pair.urls("claims");
        let mut primary = PgConnection::establish(&primary_url).unwrap();
        create_schema(&mut primary, POSTGRES_SCHEMA);
        place(&mut primary, ROWS);
        pair.wait_for_replay(Duration::from_secs(30));

        let (primary_reads, replica_reads) = (KeyReads::default(), KeyReads::default());
        let workers = (0..WORKERS).map(|worker| {
            let (primary_url, replica_url) = (primary_url.clone(), replica_url.clone());
            let (primary_reads, replica_reads) = (primary_reads.clone(), replica_reads.clone());
            tokio::spawn(async move {
                let mut primary = connect(&primary_url, &primary_reads).await;
                let mut replica = connect(&replica_url, &replica_reads).await;
                drain(&mut primary, &mut replica, worker).await
            })
        });
        let workers: Vec<_> = workers.collect();
        place(&mut primary, LATE_ROWS);
        let mut processed = 0;
        for worker in workers {
            processed += worker.await.unwrap().processed;
        }
        let (left, stale) = (pending_rows(&primary_url), pending_rows(&replica_url));
        assert!(
            stale > left,
            "the replica was not behind: {stale} pending there, {left} on the primary"
        );
        assert_eq!(
            primary_reads.get().0,
            0,
            "candidates were read on the primary"
        );
        assert!(replica_reads.get().0 > 0);
        eprintln!(
            "async: {processed} processed, {left} left to a later call (the replica showed {stale})"
        );

        let mut primary = connect(&primary_url, &KeyReads::default()).await;
        let mut replica = connect(&replica_url, &KeyReads::default()).await;
        for _ in 0..10 {
            if pending_rows(&primary_url) == 0 {
                break;
            }
            pair.wait_for_replay(Duration::from_secs(30));
            drain(&mut primary, &mut replica, 0).await;
        }
        assert_eq!(pending_rows(&primary_url), 0, "rows left pending");
        let emailed = i64::from(ROWS + LATE_ROWS);
        assert_eq!(
            emails(&primary_url),
            (emailed, emailed),
            "(outbox rows, orders emailed)"
        );
    }
}
