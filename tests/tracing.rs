//! The `tracing` feature: the spans and events a claim, a lease and a retry
//! leave, as a subscriber of the test's own records them.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::tracing::field::{Field, Visit};
use ::tracing::span::{Attributes, Id, Record};
use ::tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{Layer, Registry};

use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{retry, with_lease, Error, RetryPolicy};

use testkit::fixtures::{accounts, on_every_backend, orders, Account, Order};

/// A span as the subscriber saw it: its name, its fields (those recorded
/// later included) and its parent's name.
#[derive(Debug, Clone)]
struct SpanSeen {
    name: &'static str,
    target: &'static str,
    level: Level,
    fields: HashMap<&'static str, String>,
    parent: Option<&'static str>,
}

/// An event: its level, its fields (`message` included) and the span it
/// happened in.
#[derive(Debug, Clone)]
struct EventSeen {
    target: &'static str,
    level: Level,
    fields: HashMap<&'static str, String>,
    span: Option<&'static str>,
}

impl EventSeen {
    fn message(&self) -> &str {
        self.fields.get("message").map_or("", String::as_str)
    }
}

/// Everything a block of code left, in order.
#[derive(Default)]
struct Seen {
    spans: Vec<SpanSeen>,
    events: Vec<EventSeen>,
}

impl Seen {
    /// The events whose message is `message`, in order.
    fn saying(&self, message: &str) -> Vec<&EventSeen> {
        self.events
            .iter()
            .filter(|event| event.message() == message)
            .collect()
    }

    fn spans(&self, name: &str) -> Vec<&SpanSeen> {
        self.spans.iter().filter(|span| span.name == name).collect()
    }

    fn the_span(&self, name: &str) -> &SpanSeen {
        match self.spans(name)[..] {
            [span] => span,
            ref spans => panic!("{} `{name}` spans: {:#?}", spans.len(), self.spans),
        }
    }
}

/// Records every field as text: strings as they are, the rest by `Debug`.
struct Fields<'a>(&'a mut HashMap<&'static str, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }
}

/// The layer that records; spans are kept by their index in `Seen::spans`.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Seen>>);

struct Index(usize);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Recorder {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("a new span is registered");
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        let mut seen = self.0.lock().unwrap();
        seen.spans.push(SpanSeen {
            name: span.name(),
            target: attrs.metadata().target(),
            level: *attrs.metadata().level(),
            fields,
            parent: span.parent().map(|parent| parent.name()),
        });
        span.extensions_mut().insert(Index(seen.spans.len() - 1));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("a recorded span is registered");
        let extensions = span.extensions();
        let Index(index) = extensions.get::<Index>().expect("every span is indexed");
        let mut seen = self.0.lock().unwrap();
        values.record(&mut Fields(&mut seen.spans[*index].fields));
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().events.push(EventSeen {
            target: event.metadata().target(),
            level: *event.metadata().level(),
            fields,
            span: ctx.event_span(event).map(|span| span.name()),
        });
    }
}

/// Runs `f` with the recording subscriber as this thread's default.
fn traced<T>(f: impl FnOnce() -> T) -> (T, Seen) {
    let recorder = Recorder::default();
    let subscriber = Registry::default().with(recorder.clone());
    let value = ::tracing::subscriber::with_default(subscriber, f);
    let seen = std::mem::take(&mut *recorder.0.lock().unwrap());
    (value, seen)
}

/// The warnings of failed rows and the closures' own "sending" events, in
/// the order they came.
fn failures_and_work(seen: &Seen) -> Vec<String> {
    seen.events
        .iter()
        .filter_map(|event| match event.level {
            Level::WARN => Some(format!(
                "order {} failed: {}",
                event.fields["keys"], event.fields["error"]
            )),
            _ if event.message().starts_with("sending") => Some(event.message().to_owned()),
            _ => None,
        })
        .collect()
}

fn pending() -> diesel::dsl::Filter<
    diesel::dsl::Filter<orders::table, diesel::dsl::Eq<orders::shipped, bool>>,
    diesel::dsl::Eq<orders::email_sent, bool>,
> {
    orders::table
        .filter(orders::shipped.eq(true))
        .filter(orders::email_sent.eq(false))
}

on_every_backend! {
    fn insert_pending(conn: &mut Conn, count: usize) {
        diesel::insert_into(orders::table)
            .values(vec![orders::shipped.eq(true); count])
            .execute(conn)
            .unwrap();
    }

    fn mark_sent(conn: &mut Conn, order: &Order) -> QueryResult<()> {
        diesel::update(order).set(orders::email_sent.eq(true)).execute(conn)?;
        Ok(())
    }

    /// Runs `worker` under the recording subscriber, on a connection to a
    /// database of its own holding `orders` pending orders, with a stop
    /// handle for it: what it returns, and what it left.
    fn traced_worker<T>(
        orders: usize,
        worker: impl FnOnce(&mut Conn, &diesel_claim::StopHandle) -> T,
    ) -> (T, Seen) {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, orders);
        let stop = diesel_claim::StopHandle::new();
        traced(|| worker(&mut conn, &stop))
    }

    #[test]
    fn a_claim_is_one_span_with_its_table_options_and_report() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 7);
        let (report, seen) = traced(|| {
            pending()
                .build_claim()
                .batch(3)
                .each(&mut conn, |conn, order: Order| Ok::<_, Error>(mark_sent(conn, &order)?))
                .unwrap()
        });
        assert_eq!(report.processed, 7);

        let claim = seen.the_span("claim");
        assert_eq!(claim.level, Level::INFO);
        assert_eq!(claim.fields["table"], "orders");
        assert_eq!(claim.fields["batch"], "3");
        assert_eq!(claim.fields["on_locked"], "skip");
        assert_eq!(claim.fields["keep_going"], "false");
        assert_eq!(claim.fields["processed"], "7");
        assert_eq!(claim.fields["failed"], "0");
        assert_eq!(claim.fields["stopped"], "false");

        let batches = seen.spans("batch");
        assert!(batches.iter().all(|batch| batch.parent == Some("claim")), "{batches:#?}");
        assert!(batches.iter().all(|batch| batch.fields["limit"] == "3"), "{batches:#?}");
        let taken: Vec<&str> = batches
            .iter()
            .map(|batch| batch.fields["taken"].as_str())
            .filter(|taken| *taken != "0")
            .collect();
        assert_eq!(taken, ["3", "3", "1"]);
        assert!(batches.iter().all(|batch| batch.fields["outcome"] == "committed"));
    }

    diesel::table! {
        use diesel::sql_types::*;
        use super::ClaimStamp;

        tried (id) {
            id -> Integer,
            attempts -> Integer,
            run_at -> ClaimStamp,
        }
    }

    #[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
    #[diesel(table_name = tried)]
    struct Tried {
        id: i32,
    }

    /// Creates `tried`, with the jobs 1 and 2 due.
    fn create_tried(conn: &mut Conn) {
        use diesel::connection::SimpleConnection;

        let now = match BACKEND {
            "pg" => "now()",
            "mysql" => "(UTC_TIMESTAMP(6))",
            _ => "(strftime('%Y-%m-%d %H:%M:%f', 'now'))",
        };
        conn.batch_execute(&format!(
            "CREATE TABLE tried (id INTEGER PRIMARY KEY, attempts INTEGER NOT NULL DEFAULT 0, \
                 run_at {CLAIM_STAMP_COLUMN} NOT NULL DEFAULT {now});
             INSERT INTO tried (id) VALUES (1), (2);"
        ))
        .unwrap();
    }

    /// A closure past its timeout is a warning event with its table and
    /// keys, counted on the claim's span; a job that used its last attempt
    /// under its retry schedule is an error event with its table, key and
    /// attempts. Neither names a worker: none runs the claim.
    #[test]
    fn a_timeout_and_a_dead_letter_are_events() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        create_tried(&mut conn);
        let (report, seen) = traced(|| {
            tried::table
                .select(Tried::as_select())
                .build_claim()
                .retries(diesel_claim::Retries::new(tried::attempts, tried::run_at).max_attempts(1))
                .timeout(Duration::from_millis(50))
                .each(&mut conn, |_, job: Tried| {
                    if job.id == 1 {
                        std::thread::sleep(Duration::from_millis(80));
                    }
                    Err::<(), _>(Error::InvalidArgument("fails".to_owned()))
                })
                .unwrap()
        });
        assert_eq!((report.failed, report.timed_out), (2, 1));
        let late = seen.saying("a closure ran past its timeout: its work is rolled back");
        assert!(matches!(late[..], [event] if event.level == Level::WARN), "{:#?}", seen.events);
        assert_eq!(late[0].target, "diesel_claim::claim");
        assert_eq!((late[0].fields["table"].as_str(), late[0].fields["keys"].as_str()), ("tried", "[1]"));
        assert_eq!(late[0].fields["timeout"], "50ms");
        let dead = seen.saying("a job used its last attempt: it is a dead letter, out of the queue");
        assert_eq!(dead.len(), 2, "{:#?}", seen.events);
        for (key, event) in ["1", "2"].iter().zip(dead) {
            assert_eq!(event.level, Level::ERROR);
            assert_eq!((event.fields["table"].as_str(), event.fields["key"].as_str()), ("tried", *key));
            assert_eq!(event.fields["attempts"], "1");
        }
        for event in seen.events.iter().filter(|event| event.level <= Level::WARN) {
            assert!(!event.fields.contains_key("worker"), "{event:#?}");
        }
        assert_eq!(seen.the_span("claim").fields["timed_out"], "1");
    }

    /// A worker's timeouts and dead letters carry its name, as its other
    /// events do.
    #[test]
    fn a_workers_timeout_and_dead_letters_name_it() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        create_tried(&mut conn);
        let stop = diesel_claim::StopHandle::new();
        let (report, seen) = traced(|| {
            tried::table
                .select(Tried::as_select())
                .build_claim()
                .retries(diesel_claim::Retries::new(tried::attempts, tried::run_at).max_attempts(1))
                .timeout(Duration::from_millis(50))
                .worker(&stop)
                .name("retrier")
                .stop_when_empty()
                .run(&mut conn, |_, job: Tried| {
                    if job.id == 1 {
                        std::thread::sleep(Duration::from_millis(80));
                    }
                    Err::<(), _>(Error::InvalidArgument("fails".to_owned()))
                })
                .unwrap()
        });
        assert_eq!((report.failed, report.timed_out), (2, 1));
        let late = seen.saying("a closure ran past its timeout: its work is rolled back");
        let dead = seen.saying("a job used its last attempt: it is a dead letter, out of the queue");
        assert_eq!((late.len(), dead.len()), (1, 2), "{:#?}", seen.events);
        assert_eq!(late[0].fields["keys"], "[1]");
        for event in late.iter().chain(&dead) {
            assert_eq!(event.fields["table"], "tried", "{event:#?}");
            assert_eq!(event.fields.get("worker").map(String::as_str), Some("retrier"), "{event:#?}");
        }
    }

    diesel::table! {
        use diesel::sql_types::*;
        use super::ClaimStamp;

        invoices (id) {
            id -> Integer,
            sent -> Bool,
            claimed_until -> Nullable<ClaimStamp>,
        }
    }

    #[derive(Debug, Queryable, Selectable, Identifiable)]
    #[diesel(table_name = invoices)]
    struct Invoice {
        id: i32,
    }

    /// A visibility-timeout claim is a claim span too; its batch spans end
    /// committed with their stamps, before the closure runs.
    #[test]
    fn a_visibility_timeout_claim_is_a_claim_span_with_committed_batches() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        diesel::sql_query(format!(
            "CREATE TABLE invoices (id INTEGER PRIMARY KEY, sent BOOLEAN NOT NULL, \
             claimed_until {CLAIM_STAMP_COLUMN})"
        ))
        .execute(&mut conn)
        .unwrap();
        let rows: Vec<_> = (1..=5).map(|id| (invoices::id.eq(id), invoices::sent.eq(false))).collect();
        diesel::insert_into(invoices::table).values(rows).execute(&mut conn).unwrap();
        let (report, seen) = traced(|| {
            invoices::table
                .filter(invoices::sent.eq(false))
                .select(Invoice::as_select())
                .build_claim()
                .batch(2)
                .visibility_timeout(invoices::claimed_until, Duration::from_secs(60))
                .each(&mut conn, |conn, invoice: diesel_claim::Claimed<Invoice, _>| {
                    invoice.finish(conn, invoices::sent.eq(true))
                })
                .unwrap()
        });
        assert_eq!(report.processed, 5);

        let claim = seen.the_span("claim");
        assert_eq!(claim.fields["table"], "invoices");
        assert_eq!(claim.fields["processed"], "5");
        let batches = seen.spans("batch");
        assert!(batches.iter().all(|batch| batch.parent == Some("claim")), "{batches:#?}");
        assert!(batches.iter().all(|batch| batch.fields["outcome"] == "committed"), "{batches:#?}");
        let taken: Vec<&str> = batches
            .iter()
            .map(|batch| batch.fields["taken"].as_str())
            .filter(|taken| *taken != "0")
            .collect();
        assert_eq!(taken, ["2", "2", "1"]);
    }

    #[test]
    fn a_failing_row_under_keep_going_is_a_warning_and_counted() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        insert_pending(&mut conn, 3);
        let (report, seen) = traced(|| {
            pending()
                .build_claim()
                .keep_going()
                .each(&mut conn, |conn, order: Order| {
                    if order.id == 2 {
                        return Err(Error::InvalidArgument("order 2 is bad".to_owned()));
                    }
                    mark_sent(conn, &order).map_err(Error::from)
                })
                .unwrap()
        });
        assert_eq!((report.processed, report.failed), (2, 1));

        let claim = seen.the_span("claim");
        assert_eq!(claim.fields["keep_going"], "true");
        assert_eq!(claim.fields["failed"], "1");
        assert_eq!(claim.fields["processed"], "2");
        let warnings: Vec<&EventSeen> =
            seen.events.iter().filter(|event| event.level == Level::WARN).collect();
        assert_eq!(warnings.len(), 1, "{warnings:#?}");
        assert_eq!(warnings[0].fields["table"], "orders");
        assert_eq!(warnings[0].fields["keys"], "[2]");
        assert_eq!(warnings[0].fields["rows"], "1");
        assert_eq!(warnings[0].span, Some("batch"));
        // `each` cannot show an error type that may have no `Display`: the
        // caller has it (`each_outcome`).
        assert!(!warnings[0].fields.contains_key("error"), "{warnings:#?}");
        let rolled_back = seen
            .spans("batch")
            .into_iter()
            .filter(|batch| batch.fields.get("outcome").map(String::as_str) == Some("rolled back"))
            .count();
        assert_eq!(rolled_back, 1);
    }

    #[test]
    fn a_lease_is_a_span_with_its_name_and_token() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        let ((token, refused), seen) = traced(|| {
            let ttl = Duration::from_secs(5);
            let held = with_lease(&mut conn, "nightly-report", ttl, |_, lease| {
                let mut other = pool.get().unwrap();
                let refused = with_lease(&mut other, "nightly-report", ttl, |_, _| Ok::<_, Error>(()))?;
                Ok::<_, Error>((lease.token(), refused))
            });
            held.unwrap().unwrap()
        });
        assert!(refused.is_none());

        let leases = seen.spans("lease");
        assert_eq!(leases.len(), 2, "{leases:#?}");
        let (held, refused) = (leases[0], leases[1]);
        assert_eq!(held.fields["name"], "nightly-report");
        assert_eq!(held.fields["ttl"], "5s");
        assert_eq!(held.fields["token"], token.to_string());
        assert_eq!(held.fields["outcome"], "released");
        assert_eq!(refused.parent, Some("lease"));
        assert_eq!(refused.fields["outcome"], "held by another");
        assert!(!refused.fields.contains_key("token"));

        let acquired = seen.spans("acquire_lease");
        assert_eq!(acquired.len(), 2);
        assert_eq!(acquired[0].fields["token"], token.to_string());
        assert_eq!(acquired[0].fields["outcome"], "acquired");
        assert_eq!(acquired[1].fields["outcome"], "held by another");
        let released = seen.the_span("release_lease");
        assert_eq!(released.fields["token"], token.to_string());
        assert_eq!(released.fields["outcome"], "released");
    }

    /// A worker is one span at info level, with its name (by default its
    /// table's), its table and its totals; the claims it runs over and over
    /// are spans inside it, at trace level.
    #[test]
    fn a_worker_is_an_info_span_around_trace_claims() {
        let (report, seen) = traced_worker(3, |conn, stop| {
            pending()
                .build_claim()
                .worker(stop)
                .poll_interval(Duration::from_millis(1), Duration::from_millis(2))
                .run(conn, |conn, order: Order| {
                    mark_sent(conn, &order)?;
                    if order.id == 3 {
                        stop.stop();
                    }
                    Ok::<_, Error>(())
                })
                .unwrap()
        });
        assert_eq!(report.processed, 3);
        let worker = seen.the_span("worker");
        assert_eq!((worker.level, worker.target), (Level::INFO, "diesel_claim::worker"));
        assert_eq!(worker.fields["table"], "orders");
        assert_eq!(worker.fields["worker"], "orders");
        assert_eq!(worker.fields["processed"], "3");
        let claims = seen.spans("claim");
        assert!(!claims.is_empty());
        assert!(
            claims.iter().all(|claim| claim.level == Level::TRACE && claim.parent == Some("worker")),
            "{claims:#?}"
        );
        let batches = seen.spans("batch");
        assert!(batches.iter().all(|batch| batch.level == Level::TRACE), "{batches:#?}");
    }

    /// A worker says when it starts and stops, shows a failed row's table,
    /// key and error, and reports its progress at info level every
    /// `progress_interval`, each event with the worker's name.
    #[test]
    fn a_worker_reports_its_failures_with_their_errors_and_its_progress() {
        let (report, seen) = traced_worker(3, |conn, stop| {
            let stopper = stop.clone();
            std::thread::scope(|scope| {
                scope.spawn(move || {
                    std::thread::sleep(Duration::from_millis(300));
                    stopper.stop();
                });
                pending()
                    .build_claim()
                    .keep_going()
                    .worker(stop)
                    .name("mailer")
                    .poll_interval(Duration::from_millis(1), Duration::from_millis(5))
                    .progress_interval(Duration::from_millis(40))
                    .run(conn, |conn, order: Order| {
                        if order.id == 2 {
                            return Err(Error::InvalidArgument("order 2 is bad".to_owned()));
                        }
                        Ok::<_, Error>(mark_sent(conn, &order)?)
                    })
                    .unwrap()
            })
        });
        assert_eq!((report.processed, report.failed), (2, 1));

        let failed = seen.saying("a closure failed: its rows are rolled back and passed over");
        assert_eq!(failed.len(), 1, "{:#?}", seen.events);
        assert_eq!(failed[0].level, Level::WARN);
        assert_eq!(failed[0].fields["table"], "orders");
        assert_eq!(failed[0].fields["keys"], "[2]");
        assert_eq!(failed[0].fields["error"], "invalid argument: order 2 is bad");

        let started = seen.saying("a worker starts");
        assert_eq!(started.len(), 1, "{:#?}", seen.events);
        // What a user filters the workers' lines by, as the guide says.
        for event in [started[0], seen.saying("a worker stops")[0], seen.saying("worker progress")[0]] {
            assert_eq!(event.target, "diesel_claim::worker", "{event:#?}");
        }
        assert_eq!(failed[0].target, "diesel_claim::claim");
        assert_eq!((started[0].level, started[0].fields["table"].as_str()), (Level::INFO, "orders"));
        assert_eq!(started[0].fields["progress_every"], "40ms");
        let stopped = seen.saying("a worker stops");
        assert_eq!(stopped.len(), 1, "{:#?}", seen.events);
        assert_eq!(stopped[0].level, Level::INFO);
        assert_eq!(stopped[0].fields["table"], "orders");
        assert_eq!(stopped[0].fields["why"], "stopped");
        assert_eq!((stopped[0].fields["processed"].as_str(), stopped[0].fields["failed"].as_str()), ("2", "1"));

        // Every 40 ms or so over 300 ms; the rows were done in the first.
        let progress = seen.saying("worker progress");
        assert!(progress.len() >= 2, "{:#?}", seen.events);
        let mut processed = 0;
        let mut failed = 0;
        for line in &progress {
            assert_eq!(line.level, Level::INFO);
            assert_eq!(line.fields["table"], "orders");
            assert!(line.fields.contains_key("idle") && line.fields.contains_key("over"), "{line:#?}");
            processed += line.fields["processed"].parse::<u64>().unwrap();
            failed += line.fields["failed"].parse::<u64>().unwrap();
        }
        assert_eq!((processed, failed), (2, 1), "{progress:#?}");
        // Its last lines find it idle: the rows took a few milliseconds.
        assert!(progress.last().unwrap().fields["idle"] != "0ns", "{progress:#?}");
        // Every line of the worker's says which worker it is, the failed
        // row's too.
        let worker_lines: Vec<_> = seen
            .events
            .iter()
            .filter(|event| event.target == "diesel_claim::worker" || event.level == Level::WARN)
            .collect();
        assert!(worker_lines.len() >= 5, "{worker_lines:#?}");
        for event in worker_lines {
            assert_eq!(event.fields.get("worker").map(String::as_str), Some("mailer"), "{event:#?}");
        }
        assert_eq!(seen.the_span("worker").fields["worker"], "mailer");
    }

    /// A worker warns of a failed row as it passes the row over, before the
    /// next row's work, not once its claim's run ends: a run takes batch
    /// after batch until none is left.
    #[test]
    fn a_worker_warns_of_a_failed_row_before_the_next_rows_work() {
        let (report, seen) = traced_worker(3, |conn, stop| {
            pending()
                .build_claim()
                .batch(1)
                .keep_going()
                .worker(stop)
                .stop_when_empty()
                .run(conn, |conn, order: Order| {
                    if order.id == 1 {
                        return Err(Error::InvalidArgument("order 1 is bad".to_owned()));
                    }
                    ::tracing::info!("sending order {}", order.id);
                    Ok::<_, Error>(mark_sent(conn, &order)?)
                })
                .unwrap()
        });
        assert_eq!((report.processed, report.failed), (2, 1));
        assert_eq!(failures_and_work(&seen), ["order [1] failed: invalid argument: order 1 is bad", "sending order 2", "sending order 3"]);
    }

    /// Two workers of one table, named, are told apart: each one's span and
    /// events carry its name, failed rows' included.
    #[test]
    fn two_workers_of_one_table_are_told_apart_by_their_names() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        let stop = diesel_claim::StopHandle::new();
        let ((), seen) = traced(|| {
            for name in ["mailer", "reporter"] {
                // Two orders of its own: the other worker's failed one is sent.
                diesel::update(orders::table).set(orders::email_sent.eq(true)).execute(&mut conn).unwrap();
                insert_pending(&mut conn, 2);
                let report = pending()
                    .build_claim()
                    .keep_going()
                    .worker(&stop)
                    .name(name)
                    .stop_when_empty()
                    .run(&mut conn, |conn, order: Order| {
                        if order.id % 2 == 0 {
                            return Err(Error::InvalidArgument(format!("order {} is bad", order.id)));
                        }
                        Ok::<_, Error>(mark_sent(conn, &order)?)
                    })
                    .unwrap();
                assert_eq!((report.processed, report.failed), (1, 1), "{name}");
            }
        });
        let named = |events: Vec<&EventSeen>| -> Vec<String> {
            events.iter().map(|event| event.fields["worker"].clone()).collect()
        };
        let workers: Vec<&str> = seen.spans("worker").iter().map(|span| span.fields["worker"].as_str()).collect();
        assert_eq!(workers, ["mailer", "reporter"]);
        assert_eq!(named(seen.saying("a worker starts")), ["mailer", "reporter"]);
        assert_eq!(named(seen.saying("a worker stops")), ["mailer", "reporter"]);
        let failed = seen.saying("a closure failed: its rows are rolled back and passed over");
        assert_eq!(named(failed.clone()), ["mailer", "reporter"]);
        let keys: Vec<&str> = failed.iter().map(|event| event.fields["keys"].as_str()).collect();
        assert_eq!(keys, ["[2]", "[4]"]);
        for event in seen.saying("a worker stops") {
            assert_eq!((event.fields["table"].as_str(), event.fields["processed"].as_str()), ("orders", "1"));
        }
    }

    /// A worker whose closure fails without `keep_going` stops, and says
    /// why: the table, the row's key, the error.
    #[test]
    fn a_worker_stopped_by_an_error_says_so() {
        let (ended, seen) = traced_worker(1, |conn, stop| {
            pending()
                .build_claim()
                .worker(stop)
                .run(conn, |_, _: Order| Err(Error::InvalidArgument("no mail server".to_owned())))
        });
        assert!(matches!(ended, Err(Error::InvalidArgument(_))), "{ended:?}");
        let stopped = seen.saying("a worker stops on an error");
        assert_eq!(stopped.len(), 1, "{:#?}", seen.events);
        assert_eq!(stopped[0].level, Level::WARN);
        assert_eq!(stopped[0].fields["table"], "orders");
        assert_eq!(stopped[0].fields["worker"], "orders");
        assert_eq!(stopped[0].fields["keys"], "[1]");
        assert_eq!(stopped[0].fields["error"], "invalid argument: no mail server");
    }

    /// An idle worker's polls leave nothing above trace level: its span,
    /// and its start and stop, are all a debug subscriber sees.
    #[test]
    fn an_idle_worker_is_silent_at_debug() {
        let (report, seen) = traced_worker(0, |conn, stop| {
            let stopper = stop.clone();
            std::thread::scope(|scope| {
                scope.spawn(move || {
                    std::thread::sleep(Duration::from_millis(100));
                    stopper.stop();
                });
                pending()
                    .build_claim()
                    .worker(stop)
                    .poll_interval(Duration::from_millis(1), Duration::from_millis(2))
                    .run(conn, |conn, order: Order| Ok::<_, Error>(mark_sent(conn, &order)?))
                    .unwrap()
            })
        });
        assert_eq!(report.processed, 0);
        // It did poll, many times, at trace level.
        assert!(seen.spans("claim").len() >= 5, "{}", seen.spans("claim").len());
        let loud: Vec<&str> = seen
            .spans
            .iter()
            .filter(|span| span.level != Level::TRACE)
            .map(|span| span.name)
            .collect();
        assert_eq!(loud, ["worker"]);
        let loud: Vec<&str> = seen
            .events
            .iter()
            .filter(|event| event.level != Level::TRACE)
            .map(EventSeen::message)
            .collect();
        assert_eq!(loud, ["a worker starts", "a worker stops"]);
    }

    /// A row lock is a span naming its table on every backend, with the rows
    /// it locked and how its transaction ended.
    #[test]
    fn a_row_lock_is_a_span_with_its_table() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        seed_accounts(&mut conn, &[100, 200]);
        let (balance, seen) = traced(|| {
            accounts::table
                .find(2)
                .with_lock(&mut conn, |_, account: Account| Ok::<_, Error>(account.balance))
                .unwrap()
        });
        assert_eq!(balance, 200);
        let lock = seen.the_span("lock");
        assert_eq!(lock.fields["table"], "accounts");
        assert_eq!(lock.fields["rows"], "1");
        assert_eq!(lock.fields["outcome"], "committed");
    }

    #[test]
    fn a_retried_conflict_leaves_its_attempts() {
        let (_db, pool) = test_db(1);
        let mut conn = pool.get().unwrap();
        seed_accounts(&mut conn, &[100]);
        let mut attempts = 0;
        let (version, seen) = traced(|| {
            retry(&mut conn, RetryPolicy::attempts(5), |conn| {
                attempts += 1;
                let account: Account = accounts::table.find(1).first(conn)?;
                // The first two attempts write as if they had read an older
                // version: a conflict each.
                let seen_version = if attempts <= 2 { account.version + 10 } else { account.version };
                accounts::table
                    .find(1)
                    .update_versioned(accounts::version, seen_version, accounts::balance.eq(90))
                    .execute(conn)
            })
            .unwrap()
        });
        assert_eq!((attempts, version), (3, 1));

        let conflicts = seen.saying("version conflict");
        assert_eq!(conflicts.len(), 2, "{:#?}", seen.events);
        assert!(conflicts[0].fields["error"].contains("expected version 10"), "{conflicts:#?}");
        let retries: Vec<&str> = seen
            .events
            .iter()
            .filter(|event| event.message().contains("trying again"))
            .map(|event| {
                assert_eq!(event.level, Level::DEBUG);
                assert_eq!(event.fields["max_attempts"], "5");
                assert!(event.fields.contains_key("pause"));
                event.fields["attempt"].as_str()
            })
            .collect();
        assert_eq!(retries, ["1", "2"]);
    }
}

/// The async API's claims leave the same spans, on PostgreSQL and MySQL.
#[cfg(feature = "async")]
macro_rules! on_async_backends {
    ($($backend:ident ($stamp:ident): $feature:literal, $conn:ty, $db:ty, $test_db:ident, $schema:ident;)*) => {$(
        #[cfg(feature = $feature)]
        mod $backend {
            use diesel::{ExpressionMethods, QueryDsl};
            use diesel_async::{AsyncConnection, RunQueryDsl};
            use diesel_claim::aio::prelude::*;
            use diesel_claim::Error;
            use testkit::fixtures::{orders, Order};
            use tracing_subscriber::layer::SubscriberExt;
            use tracing_subscriber::Registry;

            use super::{failures_and_work, pending, Recorder};

            /// A database of its own with `count` shipped orders, and a
            /// connection to it.
            async fn with_orders(count: usize) -> (testkit::$test_db, $conn) {
                let db = testkit::$test_db::new();
                let mut setup = <$db as diesel::Connection>::establish(&db.url).unwrap();
                testkit::fixtures::create_schema(&mut setup, testkit::fixtures::$schema);
                let mut conn = <$conn>::establish(&db.url).await.unwrap();
                diesel::insert_into(orders::table)
                    .values(vec![orders::shipped.eq(true); count])
                    .execute(&mut conn)
                    .await
                    .unwrap();
                (db, conn)
            }

            #[tokio::test(flavor = "current_thread")]
            async fn an_async_claim_is_the_same_span() {
                let (_db, mut conn) = with_orders(5).await;

                // The runtime runs the claim on this thread: the default
                // subscriber sees it.
                let recorder = Recorder::default();
                let subscriber = Registry::default().with(recorder.clone());
                let default = ::tracing::subscriber::set_default(subscriber);
                let report = pending()
                    .build_claim()
                    .batch(2)
                    .each(&mut conn, async |conn, order: Order| {
                        diesel::update(orders::table.find(order.id))
                            .set(orders::email_sent.eq(true))
                            .execute(conn)
                            .await?;
                        Ok::<_, Error>(())
                    })
                    .await
                    .unwrap();
                drop(default);
                assert_eq!(report.processed, 5);

                let seen = std::mem::take(&mut *recorder.0.lock().unwrap());
                let claim = seen.the_span("claim");
                assert_eq!(claim.fields["table"], "orders");
                assert_eq!(claim.fields["batch"], "2");
                assert_eq!(claim.fields["processed"], "5");
                let taken: Vec<&str> = seen
                    .spans("batch")
                    .iter()
                    .inspect(|batch| assert_eq!(batch.parent, Some("claim")))
                    .map(|batch| batch.fields["taken"].as_str())
                    .filter(|taken| *taken != "0")
                    .collect();
                assert_eq!(taken, ["2", "2", "1"]);
            }

            /// An async worker too warns of a failed row before the next
            /// row's work.
            #[tokio::test(flavor = "current_thread")]
            async fn an_async_worker_warns_of_a_failed_row_before_the_next_rows_work() {
                let (_db, mut conn) = with_orders(3).await;

                let recorder = Recorder::default();
                let subscriber = Registry::default().with(recorder.clone());
                let default = ::tracing::subscriber::set_default(subscriber);
                let stop = diesel_claim::StopHandle::new();
                let report = pending()
                    .build_claim()
                    .batch(1)
                    .keep_going()
                    .worker(&stop)
                    .stop_when_empty()
                    .run(&mut conn, async |conn: &mut $conn, order: Order| {
                        if order.id == 1 {
                            return Err(Error::InvalidArgument("order 1 is bad".to_owned()));
                        }
                        ::tracing::info!("sending order {}", order.id);
                        diesel::update(orders::table.find(order.id))
                            .set(orders::email_sent.eq(true))
                            .execute(conn)
                            .await?;
                        Ok::<_, Error>(())
                    })
                    .await
                    .unwrap();
                drop(default);
                assert_eq!((report.processed, report.failed), (2, 1));

                let seen = std::mem::take(&mut *recorder.0.lock().unwrap());
                assert_eq!(
                    failures_and_work(&seen),
                    ["order [1] failed: invalid argument: order 1 is bad", "sending order 2", "sending order 3"]
                );
            }

            type ClaimStamp = testkit::fixtures::claim_stamp!($stamp);

            diesel::table! {
                use diesel::sql_types::*;
                use super::ClaimStamp;

                invoices (id) {
                    id -> Integer,
                    sent -> Bool,
                    claimed_until -> Nullable<ClaimStamp>,
                }
            }

            #[derive(Debug, diesel::Queryable, diesel::Selectable, diesel::Identifiable)]
            #[diesel(table_name = invoices)]
            struct Invoice {
                id: i32,
            }

            #[tokio::test(flavor = "current_thread")]
            async fn an_async_visibility_timeout_claim_is_the_same_span() {
                use diesel::SelectableHelper;
                let db = testkit::$test_db::new();
                let mut conn = <$conn>::establish(&db.url).await.unwrap();
                let column = testkit::fixtures::claim_stamp!(column $stamp);
                diesel::sql_query(format!(
                    "CREATE TABLE invoices (id INTEGER PRIMARY KEY, sent BOOLEAN NOT NULL, \
                     claimed_until {column})"
                ))
                .execute(&mut conn)
                .await
                .unwrap();
                let rows: Vec<_> = (1..=3).map(|id| (invoices::id.eq(id), invoices::sent.eq(false))).collect();
                diesel::insert_into(invoices::table).values(rows).execute(&mut conn).await.unwrap();

                let recorder = Recorder::default();
                let subscriber = Registry::default().with(recorder.clone());
                let default = ::tracing::subscriber::set_default(subscriber);
                let report = invoices::table
                    .filter(invoices::sent.eq(false))
                    .select(Invoice::as_select())
                    .build_claim()
                    .visibility_timeout(invoices::claimed_until, std::time::Duration::from_secs(60))
                    .each(&mut conn, async |conn, invoice: diesel_claim::Claimed<Invoice, _, diesel_claim::aio::Async>| {
                        invoice.finish(conn, invoices::sent.eq(true)).await
                    })
                    .await
                    .unwrap();
                drop(default);
                assert_eq!(report.processed, 3);

                let seen = std::mem::take(&mut *recorder.0.lock().unwrap());
                let claim = seen.the_span("claim");
                assert_eq!(claim.fields["table"], "invoices");
                assert_eq!(claim.fields["processed"], "3");
                let batches = seen.spans("batch");
                assert_eq!(batches.iter().filter(|batch| batch.fields["taken"] == "1").count(), 3);
                assert!(batches.iter().all(|batch| batch.parent == Some("claim") && batch.fields["outcome"] == "committed"));
            }

            diesel::table! {
                use diesel::sql_types::*;
                use super::ClaimStamp;

                tried (id) {
                    id -> Integer,
                    attempts -> Integer,
                    run_at -> ClaimStamp,
                }
            }

            #[derive(Debug, Clone, diesel::Queryable, diesel::Selectable, diesel::Identifiable)]
            #[diesel(table_name = tried)]
            struct Tried {
                id: i32,
            }

            /// An async worker's timeouts and dead letters carry its name, as
            /// a blocking worker's do.
            #[tokio::test(flavor = "current_thread")]
            async fn an_async_workers_timeout_and_dead_letters_name_it() {
                use diesel::SelectableHelper;
                let db = testkit::$test_db::new();
                let mut conn = <$conn>::establish(&db.url).await.unwrap();
                let column = testkit::fixtures::claim_stamp!(column $stamp);
                let now = if stringify!($stamp) == "pg" { "now()" } else { "(UTC_TIMESTAMP(6))" };
                diesel::sql_query(format!(
                    "CREATE TABLE tried (id INTEGER PRIMARY KEY, attempts INTEGER NOT NULL DEFAULT 0, \
                     run_at {column} NOT NULL DEFAULT {now})"
                ))
                .execute(&mut conn)
                .await
                .unwrap();
                diesel::sql_query("INSERT INTO tried (id) VALUES (1), (2)").execute(&mut conn).await.unwrap();

                let recorder = Recorder::default();
                let subscriber = Registry::default().with(recorder.clone());
                let default = ::tracing::subscriber::set_default(subscriber);
                let stop = diesel_claim::StopHandle::new();
                let report = tried::table
                    .select(Tried::as_select())
                    .build_claim()
                    .retries(diesel_claim::Retries::new(tried::attempts, tried::run_at).max_attempts(1))
                    .timeout(std::time::Duration::from_millis(50))
                    .worker(&stop)
                    .name("retrier")
                    .stop_when_empty()
                    .run(&mut conn, async |_: &mut $conn, job: Tried| {
                        if job.id == 1 {
                            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                        }
                        Err::<(), _>(Error::InvalidArgument("fails".to_owned()))
                    })
                    .await
                    .unwrap();
                drop(default);
                assert_eq!((report.failed, report.timed_out), (2, 1));

                let seen = std::mem::take(&mut *recorder.0.lock().unwrap());
                let late = seen.saying("a closure ran past its timeout: its work is rolled back");
                let dead = seen.saying("a job used its last attempt: it is a dead letter, out of the queue");
                assert_eq!((late.len(), dead.len()), (1, 2), "{:#?}", seen.events);
                assert_eq!(late[0].fields["keys"], "[1]");
                for event in late.iter().chain(&dead) {
                    assert_eq!(event.fields["table"], "tried", "{event:#?}");
                    assert_eq!(event.fields.get("worker").map(String::as_str), Some("retrier"), "{event:#?}");
                }
            }
        }
    )*};
}

#[cfg(feature = "async")]
on_async_backends! {
    pg_async (pg): "postgres", diesel_async::AsyncPgConnection, diesel::PgConnection, PgTestDb,
        POSTGRES_SCHEMA;
    mysql_async (mysql): "mysql", diesel_async::AsyncMysqlConnection, diesel::MysqlConnection,
        MysqlTestDb, MYSQL_SCHEMA;
}

/// A worker on a pool (PostgreSQL, listening): the events of its loops and
/// of its listener, on threads of its own, reach a subscriber set for the
/// calling thread alone, and say which connection failed, why, and when the
/// worker works again.
#[cfg(feature = "postgres")]
mod pooled_pg {
    use std::thread;
    use std::time::{Duration, Instant};

    use diesel::prelude::*;
    use diesel::r2d2::{ConnectionManager, Pool};
    use diesel_claim::prelude::*;
    use diesel_claim::{Error, StopHandle};
    use testkit::fixtures::{orders, Order};
    use tracing::Level;

    use super::{pending, traced};
    use crate::StopsOnDrop;

    fn place_order(conn: &mut PgConnection) {
        conn.transaction(|conn| {
            diesel::insert_into(orders::table)
                .values(orders::shipped.eq(true))
                .execute(conn)?;
            diesel_claim::notify(conn, "orders")
        })
        .unwrap();
    }

    #[test]
    fn a_pooled_worker_says_when_it_loses_its_connections_and_works_again() {
        let db = testkit::PgTestDb::new();
        // Three connections: the listener's, the loop's, and one to spare.
        let pool = Pool::builder()
            .max_size(3)
            .connection_timeout(Duration::from_millis(200))
            .build(ConnectionManager::<PgConnection>::new(&db.url))
            .unwrap();
        testkit::fixtures::create_schema(
            &mut pool.get().unwrap(),
            testkit::fixtures::POSTGRES_SCHEMA,
        );
        let stop = StopHandle::new();
        let (report, seen) = traced(|| {
            thread::scope(|scope| {
                scope.spawn(|| {
                    // Whatever happens here, the worker stops.
                    let _stops = StopsOnDrop(&stop);
                    thread::sleep(Duration::from_millis(300));
                    // The listener's session ends; it finds out within a second.
                    let ended = testkit::sessions::terminate_all_but_mine(&db.url, db.name());
                    assert!(ended > 0, "no session to end");
                    let mut admin = PgConnection::establish(&db.url).unwrap();
                    thread::sleep(Duration::from_millis(1_500));
                    // Every connection the listener leaves is held: the
                    // loop's checkouts time out until they are given back.
                    let held: Vec<_> = (0..2).map(|_| pool.get().unwrap()).collect();
                    thread::sleep(Duration::from_millis(700));
                    drop(held);
                    place_order(&mut admin);
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while pending().count().get_result::<i64>(&mut admin).unwrap() > 0 {
                        assert!(
                            Instant::now() < deadline,
                            "the order placed was not emailed"
                        );
                        thread::sleep(Duration::from_millis(10));
                    }
                });
                pending()
                    .build_claim()
                    .worker(&stop)
                    .name("mailer")
                    .listen("orders")
                    .poll_interval(Duration::from_millis(5), Duration::from_millis(20))
                    .run_pooled(&pool, |conn: &mut PgConnection, order: Order| {
                        diesel::update(&order)
                            .set(orders::email_sent.eq(true))
                            .execute(conn)?;
                        Ok::<_, Error>(())
                    })
                    .unwrap()
            })
        });
        assert_eq!(report.processed, 1, "{report:?}");
        // The loop's and the listener's threads, too, say which worker they
        // are, in every line of the worker's.
        let worker_lines: Vec<_> = seen
            .events
            .iter()
            .filter(|event| event.target == "diesel_claim::worker")
            .collect();
        assert!(
            worker_lines.iter().any(|event| event.level == Level::WARN),
            "{:#?}",
            seen.events
        );
        for event in worker_lines {
            assert_eq!(
                event.fields.get("worker").map(String::as_str),
                Some("mailer"),
                "{event:#?}"
            );
        }

        let listening = seen.saying("a worker listens for notifications");
        assert!(listening.len() >= 2, "{:#?}", seen.events);
        for event in &listening {
            assert_eq!(event.level, Level::INFO);
            assert_eq!(
                (
                    event.fields["table"].as_str(),
                    event.fields["worker"].as_str(),
                    event.fields["channel"].as_str()
                ),
                ("orders", "mailer", "orders")
            );
        }
        assert_eq!(listening[0].fields["failures"], "0");
        assert_ne!(listening[1].fields["failures"], "0", "{listening:#?}");

        let listener_lost =
            seen.saying("a worker's listener on \"orders\" lost its connection: trying again on another connection");
        let checkout_failed = seen.saying(
            "a worker could not check out a connection: trying again on another connection",
        );
        for event in listener_lost.iter().chain(&checkout_failed) {
            assert_eq!(event.level, Level::WARN);
            assert_eq!(event.fields["table"], "orders");
            assert!(
                !event.fields["error"].is_empty() && event.fields.contains_key("pause"),
                "{event:#?}"
            );
        }
        assert!(!listener_lost.is_empty(), "{:#?}", seen.events);
        assert!(!checkout_failed.is_empty(), "{:#?}", seen.events);

        // Each streak of failures of the loop's connections ends in one line
        // that counts them (a claim may also have lost its session).
        let claim_lost = seen.saying(
            "a worker's claim lost its connection, and its rows were rolled back: trying again on another connection",
        );
        let not_answering = seen
            .saying("a worker's connection does not answer: trying again on another connection");
        let working = seen.saying("a worker's claims have a working connection again");
        assert!(!working.is_empty(), "{:#?}", seen.events);
        let mut mended = 0;
        for event in &working {
            assert_eq!(
                (event.level, event.fields["table"].as_str()),
                (Level::INFO, "orders")
            );
            mended += event.fields["failures"].parse::<usize>().unwrap();
        }
        assert_eq!(
            mended,
            checkout_failed.len() + claim_lost.len() + not_answering.len(),
            "{working:#?}"
        );
    }
}
