//! The `metrics` feature: the counters and histograms claims leave, read
//! through a recorder installed on the test's own thread (so that tests
//! running at once do not see each other's).

use std::time::{Duration, SystemTime};

use ::metrics::Unit;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;

use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{Error, StopHandle};

use testkit::fixtures::{on_every_backend, orders, Order};

/// One metric as the recorder holds it.
#[derive(Debug)]
pub(crate) struct Metric {
    name: String,
    kind: MetricKind,
    labels: Vec<(String, String)>,
    unit: Option<Unit>,
    description: Option<String>,
    value: DebugValue,
}

/// Everything a block of code recorded.
#[derive(Debug)]
pub(crate) struct Recorded(Vec<Metric>);

impl Recorded {
    pub(crate) fn the(&self, name: &str) -> &Metric {
        match &self
            .0
            .iter()
            .filter(|metric| metric.name == name)
            .collect::<Vec<_>>()[..]
        {
            [metric] => metric,
            metrics => panic!("{} `{name}` metrics: {:#?}", metrics.len(), self.0),
        }
    }

    /// The metric `name` labelled with the table `orders` alone, or, of a
    /// worker's claims, with the table and the worker's name.
    fn labelled(&self, name: &str, worker: Option<&str>) -> &Metric {
        let mut labels = vec![("table".to_owned(), "orders".to_owned())];
        labels.extend(worker.map(|worker| ("worker".to_owned(), worker.to_owned())));
        match &self
            .0
            .iter()
            .filter(|metric| metric.name == name && metric.labels == labels)
            .collect::<Vec<_>>()[..]
        {
            [metric] => metric,
            metrics => panic!(
                "{} `{name}` metrics labelled {labels:?}: {:#?}",
                metrics.len(),
                self.0
            ),
        }
    }

    /// A counter's value, of a claim on the table `orders`.
    pub(crate) fn counter(&self, name: &str) -> u64 {
        counted(self.labelled(name, None))
    }

    /// A counter's value, of the claims of the worker `worker` on `orders`.
    pub(crate) fn worker_counter(&self, name: &str, worker: &str) -> u64 {
        counted(self.labelled(name, Some(worker)))
    }

    /// A histogram's samples, in seconds, of a claim on the table `orders`.
    pub(crate) fn samples(&self, name: &str) -> Vec<f64> {
        sampled(self.labelled(name, None))
    }

    /// A histogram's samples, in seconds, of the claims of the worker
    /// `worker` on `orders`.
    pub(crate) fn worker_samples(&self, name: &str, worker: &str) -> Vec<f64> {
        sampled(self.labelled(name, Some(worker)))
    }
}

fn counted(metric: &Metric) -> u64 {
    match (&metric.kind, &metric.value) {
        (MetricKind::Counter, DebugValue::Counter(value)) => *value,
        _ => panic!("not a counter: {metric:?}"),
    }
}

fn sampled(metric: &Metric) -> Vec<f64> {
    match (&metric.kind, &metric.value) {
        (MetricKind::Histogram, DebugValue::Histogram(samples)) => {
            samples.iter().map(|sample| sample.0).collect()
        }
        _ => panic!("not a histogram: {metric:?}"),
    }
}

/// Runs `f` with a recorder of its own as this thread's.
pub(crate) fn measured<T>(f: impl FnOnce() -> T) -> (T, Recorded) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let value = ::metrics::with_local_recorder(&recorder, f);
    let recorded = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, unit, description, value)| {
            let (kind, key) = key.into_parts();
            Metric {
                name: key.name().to_owned(),
                kind,
                labels: key
                    .labels()
                    .map(|label| (label.key().to_owned(), label.value().to_owned()))
                    .collect(),
                unit,
                description: description.map(|text| text.to_string()),
                value,
            }
        })
        .collect();
    (value, Recorded(recorded))
}

/// What a claim of five orders leaves when order 1's closure also sends
/// order 3 (gone) and order 2's fails (passed over): counts as its report
/// says, one timed call, and a timed batch for each of orders 1, 2, 4 and
/// 5, each within the call.
pub(crate) fn assert_five_orders_counted(report: &diesel_claim::ClaimReport, recorded: &Recorded) {
    assert_eq!(
        (report.processed, report.failed, report.gone, report.locked),
        (3, 1, 1, 0)
    );
    assert_eq!(recorded.counter(PROCESSED), 3);
    assert_eq!(recorded.counter(FAILED), 1);
    assert_eq!(recorded.counter(GONE), 1);
    assert_eq!(recorded.counter(LOCKED), 0);
    let claim = recorded.samples(CLAIM_DURATION);
    let batches = recorded.samples(BATCH_DURATION);
    assert_eq!(batches.len(), 4, "{batches:?}");
    assert!(
        matches!(claim[..], [whole] if batches.iter().all(|batch| *batch > 0.0 && *batch <= whole)),
        "{claim:?} {batches:?}"
    );
}

pub(crate) const PROCESSED: &str = "diesel_claim_rows_processed_total";
pub(crate) const FAILED: &str = "diesel_claim_rows_failed_total";
pub(crate) const GONE: &str = "diesel_claim_rows_gone_total";
pub(crate) const TIMED_OUT: &str = "diesel_claim_rows_timed_out_total";
pub(crate) const LOCKED: &str = "diesel_claim_rows_locked_total";
pub(crate) const CLAIM_DURATION: &str = "diesel_claim_claim_duration_seconds";
pub(crate) const BATCH_DURATION: &str = "diesel_claim_batch_duration_seconds";
pub(crate) const PICKUP_LATENCY: &str = "diesel_claim_pickup_latency_seconds";

fn pending() -> diesel::dsl::Filter<
    diesel::dsl::Filter<orders::table, diesel::dsl::Eq<orders::shipped, bool>>,
    diesel::dsl::Eq<orders::email_sent, bool>,
> {
    orders::table
        .filter(orders::shipped.eq(true))
        .filter(orders::email_sent.eq(false))
}

on_every_backend! {
    pub fn insert_pending(conn: &mut Conn, count: usize) {
        diesel::insert_into(orders::table)
            .values(vec![orders::shipped.eq(true); count])
            .execute(conn)
            .unwrap();
    }

    pub fn mark_sent(conn: &mut Conn, id: i32) -> QueryResult<()> {
        diesel::update(orders::table.find(id)).set(orders::email_sent.eq(true)).execute(conn)?;
        Ok(())
    }

    /// A claim counts its rows as its report does, per table, times itself
    /// and each batch that handed rows over; `describe` gives each metric
    /// its unit and description.
    #[test]
    fn a_claim_counts_its_rows_and_times_itself_and_its_batches() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 5);
        let (report, recorded) = measured(|| {
            diesel_claim::metrics::describe();
            diesel_claim::metrics::record_pickup("orders", SystemTime::now() - Duration::from_secs(2));
            pending()
                .build_claim()
                .keep_going()
                .each(&mut conn, |conn, order: Order| {
                    match order.id {
                        // Order 3 is sent along with order 1: gone when
                        // the claim comes to it.
                        1 => mark_sent(conn, 3)?,
                        2 => return Err(Error::InvalidArgument("order 2 is bad".to_owned())),
                        _ => {}
                    }
                    Ok(mark_sent(conn, order.id)?)
                })
                .unwrap()
        });
        assert_five_orders_counted(&report, &recorded);
        let pickup = recorded.samples(PICKUP_LATENCY);
        assert!(matches!(pickup[..], [latency] if (2.0..3.0).contains(&latency)), "{pickup:?}");

        assert_eq!(recorded.counter(TIMED_OUT), 0);
        for name in [PROCESSED, FAILED, TIMED_OUT, GONE, LOCKED] {
            let metric = recorded.the(name);
            assert_eq!(metric.unit, Some(Unit::Count), "{metric:?}");
            assert!(metric.description.as_ref().is_some_and(|text| !text.is_empty()), "{metric:?}");
        }
        for name in [CLAIM_DURATION, BATCH_DURATION, PICKUP_LATENCY] {
            let metric = recorded.the(name);
            assert_eq!(metric.unit, Some(Unit::Seconds), "{metric:?}");
            assert!(metric.description.as_ref().is_some_and(|text| !text.is_empty()), "{metric:?}");
        }
    }

    /// A closure that runs past its claim's timeout is counted as failed and
    /// as timed out, as the report counts it.
    #[test]
    fn a_closure_past_its_timeout_is_counted() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 2);
        let (report, recorded) = measured(|| {
            pending()
                .build_claim()
                .keep_going()
                .timeout(Duration::from_millis(50))
                .each(&mut conn, |conn, order: Order| {
                    if order.id == 1 {
                        std::thread::sleep(Duration::from_millis(80));
                    }
                    Ok::<_, Error>(mark_sent(conn, order.id)?)
                })
                .unwrap()
        });
        assert_eq!((report.processed, report.failed, report.timed_out), (1, 1, 1));
        assert_eq!(recorded.counter(FAILED), 1);
        assert_eq!(recorded.counter(TIMED_OUT), 1);
    }

    /// A worker's claims count as any claim's, labelled with its name (by
    /// default its table's), but those that found nothing (its polls) are
    /// not timed.
    #[test]
    fn a_worker_times_the_claims_that_took_rows_alone() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 3);
        let stop = StopHandle::new();
        let stopper = stop.clone();
        let (report, recorded) = measured(|| {
            std::thread::scope(|scope| {
                // Long enough for many empty polls once the rows are done.
                scope.spawn(move || {
                    std::thread::sleep(Duration::from_millis(200));
                    stopper.stop();
                });
                pending()
                    .build_claim()
                    .worker(&stop)
                    .poll_interval(Duration::from_millis(1), Duration::from_millis(2))
                    .run(&mut conn, |conn, order: Order| Ok::<_, Error>(mark_sent(conn, order.id)?))
                    .unwrap()
            })
        });
        assert_eq!(report.processed, 3);
        assert_eq!(recorded.worker_counter(PROCESSED, "orders"), 3);
        assert_eq!(recorded.worker_samples(BATCH_DURATION, "orders").len(), 3);
        let claims = recorded.worker_samples(CLAIM_DURATION, "orders");
        assert!((1..=3).contains(&claims.len()), "{claims:?}");
    }

    /// Two workers of one table, named, are told apart by the label
    /// `worker` of their metrics, the pickups their closures record
    /// included.
    #[test]
    fn two_workers_of_one_table_are_told_apart_by_their_names() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        let stop = StopHandle::new();
        let ((), recorded) = measured(|| {
            for (name, rows) in [("mailer", 3), ("reporter", 2)] {
                insert_pending(&mut conn, rows);
                let report = pending()
                    .build_claim()
                    .worker(&stop)
                    .name(name)
                    .stop_when_empty()
                    .run(&mut conn, |conn, order: Order| {
                        diesel_claim::metrics::record_pickup("orders", SystemTime::now());
                        Ok::<_, Error>(mark_sent(conn, order.id)?)
                    })
                    .unwrap();
                assert_eq!(report.processed, rows as u64);
            }
        });
        for (name, rows) in [("mailer", 3), ("reporter", 2)] {
            assert_eq!(recorded.worker_counter(PROCESSED, name), rows, "{name}");
            assert_eq!(recorded.worker_samples(BATCH_DURATION, name).len(), rows as usize, "{name}");
            assert_eq!(recorded.worker_samples(PICKUP_LATENCY, name).len(), rows as usize, "{name}");
        }
        // No claim of theirs is counted without its worker's name.
        assert!(
            recorded.0.iter().all(|metric| metric.labels.iter().any(|(label, _)| label == "worker")),
            "{recorded:#?}"
        );
    }
}

// Rows locked by another transaction: PostgreSQL and MySQL.
on_every_backend! {
    row_locks;

    /// A row locked by another transaction is counted when the call ends.
    #[test]
    fn a_locked_row_is_counted() {
        use diesel::connection::SimpleConnection;

        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 3);
        let mut holder = pool.get().unwrap();
        holder.batch_execute("BEGIN; SELECT * FROM orders WHERE id = 2 FOR UPDATE").unwrap();
        let (report, recorded) = measured(|| {
            pending()
                .claim_each(&mut conn, |conn, order: Order| Ok::<_, Error>(mark_sent(conn, order.id)?))
                .unwrap()
        });
        holder.batch_execute("COMMIT").unwrap();
        assert_eq!((report.processed, report.locked), (2, 1));
        assert_eq!(recorded.counter(PROCESSED), 2);
        assert_eq!(recorded.counter(LOCKED), 1);
        assert_eq!(recorded.counter(GONE), 0);
    }
}
