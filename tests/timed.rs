//! Claims with a visibility timeout: rows stamped and committed at once, the
//! closure outside any transaction, the final write fenced on the stamp.

use std::collections::HashSet;
use std::thread;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{Claimed, Error};

use testkit::fixtures::on_every_backend;

on_every_backend! {
    diesel::table! {
        use diesel::sql_types::*;
        use super::ClaimStamp;

        invoices (id) {
            id -> Integer,
            sent -> Bool,
            times_sent -> Integer,
            claimed_until -> Nullable<ClaimStamp>,
        }
    }

    diesel::table! {
        /// One row per time a closure worked on an invoice (outside any
        /// transaction: rows of runs whose claim was lost stay).
        invoice_work (id) {
            id -> Integer,
            invoice_id -> Integer,
            worker -> Integer,
        }
    }

    #[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
    #[diesel(table_name = invoices)]
    struct Invoice {
        id: i32,
        sent: bool,
    }

    type Unsent = diesel::dsl::Select<
        diesel::dsl::Filter<invoices::table, diesel::dsl::Eq<invoices::sent, bool>>,
        diesel::dsl::AsSelect<Invoice, <Conn as diesel::Connection>::Backend>,
    >;

    fn unsent() -> Unsent {
        invoices::table.filter(invoices::sent.eq(false)).select(Invoice::as_select())
    }

    /// A database with `count` unsent invoices, `1..=count`.
    fn invoices_db(count: i32, pool_size: u32) -> (impl Sized, Pool) {
        let (db, pool) = test_db(pool_size);
        let mut conn = pool.get().unwrap();
        let serial = match BACKEND {
            "pg" => "SERIAL PRIMARY KEY",
            "mysql" => "INTEGER AUTO_INCREMENT PRIMARY KEY",
            _ => "INTEGER PRIMARY KEY",
        };
        conn.batch_execute(&format!(
            "CREATE TABLE invoices (id INTEGER PRIMARY KEY, sent BOOLEAN NOT NULL, \
                 times_sent INTEGER NOT NULL, claimed_until {CLAIM_STAMP_COLUMN});
             CREATE TABLE invoice_work (id {serial}, invoice_id INTEGER NOT NULL, \
                 worker INTEGER NOT NULL);"
        ))
        .unwrap();
        let rows: Vec<_> = (1..=count)
            .map(|id| (invoices::id.eq(id), invoices::sent.eq(false), invoices::times_sent.eq(0)))
            .collect();
        for chunk in rows.chunks(500) {
            diesel::insert_into(invoices::table).values(chunk).execute(&mut conn).unwrap();
        }
        (db, pool)
    }

    /// Records that `worker` worked on the invoice, outside any transaction.
    fn work_on(conn: &mut Conn, invoice: &Invoice, worker: i32) -> QueryResult<()> {
        diesel::insert_into(invoice_work::table)
            .values((invoice_work::invoice_id.eq(invoice.id), invoice_work::worker.eq(worker)))
            .execute(conn)
            .map(drop)
    }

    /// The final write: sent, counted.
    fn send(conn: &mut Conn, invoice: Claimed<Invoice, invoices::claimed_until>) -> Result<(), Error> {
        invoice.finish(conn, (invoices::sent.eq(true), invoices::times_sent.eq(invoices::times_sent + 1)))
    }

    /// `(invoices sent more than once, invoices unsent, stamps left)`.
    fn invoice_figures(conn: &mut Conn) -> (i64, i64, i64) {
        let twice = invoices::table.filter(invoices::times_sent.gt(1)).count().get_result(conn).unwrap();
        let unsent = invoices::table.filter(invoices::sent.eq(false)).count().get_result(conn).unwrap();
        let stamped = invoices::table.filter(invoices::claimed_until.is_not_null()).count().get_result(conn).unwrap();
        (twice, unsent, stamped)
    }

    /// Moves every stamp into the past, as if its time had gone by: tests of
    /// what comes back once a stamp passes then hang on no machine's speed.
    fn let_stamps_pass(conn: &mut Conn) {
        diesel::sql_query("UPDATE invoices SET claimed_until = '2000-01-01 00:00:00' WHERE claimed_until IS NOT NULL")
            .execute(conn)
            .unwrap();
    }

    fn times_sent(conn: &mut Conn, id: i32) -> i32 {
        invoices::table.find(id).select(invoices::times_sent).get_result(conn).unwrap()
    }

    /// Workers claiming the same invoices with a visibility timeout: each is
    /// worked on once and sent once, and no stamp is left.
    #[test]
    fn concurrent_workers_work_on_each_row_once() {
        let (workers, count) = if ROW_LOCKS { (6, 600) } else { (3, 150) };
        for batch in [1, 20] {
            let (_db, pool) = invoices_db(count, workers as u32 + 1);
            let reports = testkit_workers(&pool, workers, |conn, worker| {
                unsent()
                    .build_claim()
                    .batch(batch)
                    .drain()
                    .visibility_timeout(invoices::claimed_until, Duration::from_secs(60))
                    .each(conn, |conn, invoice| {
                        work_on(conn, &invoice, worker as i32)?;
                        send(conn, invoice)
                    })
                    .unwrap()
            });
            let mut conn = pool.get().unwrap();
            let processed: u64 = reports.iter().map(|report| report.processed).sum();
            let worked: i64 = invoice_work::table.count().get_result(&mut conn).unwrap();
            assert_eq!(processed, count as u64, "batch {batch}");
            assert_eq!(worked, count as i64, "batch {batch}: an invoice was worked on twice");
            assert_eq!(invoice_figures(&mut conn), (0, 0, 0), "batch {batch}");
        }
    }

    /// Runs `work` on `workers` threads at once, each with a connection of
    /// its own.
    fn testkit_workers<T: Send>(pool: &Pool, workers: usize, work: impl Fn(&mut Conn, usize) -> T + Sync) -> Vec<T> {
        let start = std::sync::Barrier::new(workers);
        thread::scope(|scope| {
            let handles: Vec<_> = (0..workers)
                .map(|worker| {
                    let (start, work) = (&start, &work);
                    scope.spawn(move || {
                        let mut conn = pool.get().unwrap();
                        start.wait();
                        work(&mut conn, worker)
                    })
                })
                .collect();
            handles.into_iter().map(|handle| handle.join().unwrap()).collect()
        })
    }

    /// Each row of a batch comes to the closure with its whole time to live:
    /// the rows after the first are stamped again as they are handed over.
    /// A second worker polling all along takes none of them, and every final
    /// write lands. (With one stamp for the batch, the fourth row would come
    /// with a quarter of its time left, and the poller would take it while
    /// the first worker still worked on it.)
    #[test]
    fn each_row_of_a_batch_comes_with_its_whole_ttl() {
        let (_db, pool) = invoices_db(4, 2);
        let ttl = Duration::from_secs(2);
        let work = Duration::from_millis(500);
        // The poller starts once the batch is taken, and stops once it is
        // done.
        let first_started = std::sync::Barrier::new(2);
        let first_done = std::sync::atomic::AtomicBool::new(false);
        let (report, remaining, polled) = thread::scope(|scope| {
            let poller = scope.spawn(|| {
                let mut conn = pool.get().unwrap();
                first_started.wait();
                let mut taken = 0;
                while !first_done.load(std::sync::atomic::Ordering::Acquire) {
                    taken += unsent()
                        .build_claim()
                        .visibility_timeout(invoices::claimed_until, ttl)
                        .each(&mut conn, |conn, invoice| {
                            work_on(conn, &invoice, 2)?;
                            send(conn, invoice)
                        })
                        .unwrap()
                        .processed;
                    thread::sleep(Duration::from_millis(20));
                }
                taken
            });
            let mut conn = pool.get().unwrap();
            let mut remaining = Vec::new();
            let report = unsent()
                .build_claim()
                .batch(4)
                .visibility_timeout(invoices::claimed_until, ttl)
                .each(&mut conn, |conn, invoice| {
                    remaining.push(invoice.remaining());
                    if remaining.len() == 1 {
                        first_started.wait();
                    }
                    thread::sleep(work);
                    work_on(conn, &invoice, 1)?;
                    send(conn, invoice)
                });
            first_done.store(true, std::sync::atomic::Ordering::Release);
            (report, remaining, poller.join().unwrap())
        });
        assert_eq!(report.unwrap().processed, 4);
        assert_eq!(polled, 0);
        let slack = Duration::from_millis(250);
        assert!(remaining.iter().all(|left| *left > ttl - slack), "{remaining:?}");
        let mut conn = pool.get().unwrap();
        let worked: Vec<i32> = invoice_work::table.select(invoice_work::worker).load(&mut conn).unwrap();
        assert_eq!(worked, [1, 1, 1, 1]);
        assert_eq!(invoice_figures(&mut conn), (0, 0, 0));
    }

    /// With a failure hook, a failing row's stamp is cleared and the hook
    /// runs in one transaction, so that the hook decides when the row runs
    /// again; a row whose claim was lost (another worker stamped it since)
    /// is not the hook's to write: it does not run, and the failure is
    /// reported all the same.
    #[test]
    fn a_failure_hook_records_a_failing_row_and_releases_it() {
        let (_db, pool) = invoices_db(4, 2);
        let mut conn = pool.get().unwrap();
        let mut other = pool.get().unwrap();
        let outcome = unsent()
            .build_claim()
            .visibility_timeout(invoices::claimed_until, Duration::from_secs(60))
            .on_failure(|conn: &mut Conn, invoice: Invoice, _: &Error| {
                diesel::update(&invoice).set(invoices::times_sent.eq(-1)).execute(conn)?;
                Ok(())
            })
            .each_outcome(&mut conn, |conn, invoice: Claimed<Invoice, invoices::claimed_until>| {
                match invoice.id {
                    2 => Err(Error::InvalidArgument("invoice 2 fails".to_owned())),
                    3 => {
                        // Another worker's claim, as if this one had run out.
                        diesel::update(invoices::table.find(3))
                            .set(invoices::claimed_until.eq(diesel::dsl::sql("NULL")))
                            .execute(&mut other)?;
                        Err(Error::InvalidArgument("invoice 3 fails".to_owned()))
                    }
                    _ => send(conn, invoice),
                }
            });
        assert!(outcome.stopped.is_none(), "{:?}", outcome.stopped);
        let failed: Vec<&[i32]> = outcome.failed.iter().map(|failure| &failure.keys[..]).collect();
        assert_eq!(failed, [&[2][..], &[3]]);
        assert_eq!((outcome.report.processed, outcome.report.failed), (2, 2));
        let rows: Vec<(i32, bool, i32, bool)> = invoices::table
            .select((invoices::id, invoices::sent, invoices::times_sent, invoices::claimed_until.is_null()))
            .order(invoices::id)
            .load(&mut conn)
            .unwrap();
        assert_eq!(
            rows,
            [(1, true, 1, true), (2, false, -1, true), (3, false, 0, true), (4, true, 1, true)]
        );
    }

    /// The closure runs outside any transaction and holds no lock: another
    /// session updates the row at once while the closure works on it.
    #[test]
    fn the_closure_holds_no_transaction_and_no_lock() {
        let (_db, pool) = invoices_db(2, 2);
        let mut conn = pool.get().unwrap();
        let mut other = pool.get().unwrap();
        other.batch_execute(SHORT_LOCK_WAIT).unwrap();
        let report = unsent()
            .build_claim()
            .visibility_timeout(invoices::claimed_until, Duration::from_secs(60))
            .each(&mut *conn, |conn, invoice| {
                use diesel::connection::{AnsiTransactionManager, TransactionManager};
                let depth = AnsiTransactionManager::transaction_manager_status_mut(conn)
                    .transaction_depth()
                    .unwrap();
                assert_eq!(depth, None, "the closure runs in a transaction");
                diesel::update(invoices::table.find(invoice.id))
                    .set(invoices::times_sent.eq(invoices::times_sent + 10))
                    .execute(&mut *other)
                    .expect("the claimed row is locked");
                send(conn, invoice)
            })
            .unwrap();
        assert_eq!(report.processed, 2);
        assert_eq!(times_sent(&mut conn, 1), 11);
    }

    /// A claim that stalls past its stamp is taken over, and its late final
    /// write is refused with `ClaimLost`; the row carries the new claim's
    /// write alone. (Without the fence, the late write would send the invoice
    /// a second time.)
    #[test]
    fn a_stalled_claim_is_taken_over_and_its_late_write_refused() {
        let (_db, pool) = invoices_db(1, 2);
        let mut stalled = pool.get().unwrap();
        let mut fresh = pool.get().unwrap();
        let ttl = Duration::from_millis(300);
        let mut late = None;
        unsent()
            .build_claim()
            .visibility_timeout(invoices::claimed_until, ttl)
            .each(&mut *stalled, |conn, invoice| {
                // While the stamp holds, nobody else can claim the row.
                let report = unsent()
                    .build_claim()
                    .visibility_timeout(invoices::claimed_until, ttl)
                    .each(&mut *fresh, |_, _| Ok::<_, Error>(()))?;
                assert_eq!(report.processed, 0, "a live claim was taken");
                thread::sleep(ttl + Duration::from_millis(200));
                // The stamp has passed: another worker takes the row over.
                let report = unsent()
                    .build_claim()
                    .visibility_timeout(invoices::claimed_until, ttl)
                    .each(&mut *fresh, |conn, taken: Claimed<Invoice, _>| {
                        assert!(taken.stamp() > invoice.stamp(), "a new claim's stamp is later");
                        send(conn, taken)
                    })?;
                assert_eq!(report.processed, 1, "the row was not taken over");
                late = Some(send(conn, invoice));
                Ok::<_, Error>(())
            })
            .unwrap();
        let late = late.expect("the closure ran");
        // The table as `table!` names it, and the row's key.
        assert!(matches!(&late, Err(Error::ClaimLost { table, key }) if table == "invoices" && key == "1"), "{late:?}");
        assert!(late.unwrap_err().to_string().starts_with("claim lost on invoices row 1:"));
        assert_eq!(times_sent(&mut stalled, 1), 1, "the late write landed");
        assert_eq!(invoice_figures(&mut stalled), (0, 0, 0));
    }

    /// `extend` keeps the row from others past its first stamp; after a
    /// takeover, `extend` fails with `ClaimLost` as `finish` does.
    #[test]
    fn extend_keeps_the_claim_and_fails_once_it_is_lost() {
        let (_db, pool) = invoices_db(1, 2);
        let mut conn = pool.get().unwrap();
        let mut other = pool.get().unwrap();
        let ttl = Duration::from_millis(300);
        let mut try_to_take = || {
            unsent()
                .build_claim()
                .visibility_timeout(invoices::claimed_until, ttl)
                .each(&mut *other, |conn, invoice: Claimed<Invoice, _>| invoice.release(conn))
                .unwrap()
                .processed
        };
        unsent()
            .build_claim()
            .visibility_timeout(invoices::claimed_until, ttl)
            .each(&mut *conn, |conn, mut invoice| {
                let first = invoice.stamp();
                let started = Instant::now();
                while started.elapsed() < 3 * ttl {
                    thread::sleep(ttl / 3);
                    invoice.extend(conn)?;
                    assert_eq!(try_to_take(), 0, "an extended claim was taken");
                }
                assert!(invoice.stamp() > first);
                thread::sleep(ttl + Duration::from_millis(100));
                // Taken and released by the other session: the stamp is gone.
                assert_eq!(try_to_take(), 1);
                let lost = invoice.extend(conn);
                assert!(matches!(lost, Err(Error::ClaimLost { .. })), "{lost:?}");
                let lost = send(conn, invoice);
                assert!(matches!(lost, Err(Error::ClaimLost { .. })), "{lost:?}");
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!(times_sent(&mut conn, 1), 0);
    }

    /// A claim dropped without its final write (a failing closure, a dead
    /// worker) leaves the row stamped: it comes back once the stamp passes,
    /// not before, and never twice in one call. `release` gives it back at
    /// once.
    #[test]
    fn unfinished_rows_come_back_when_their_stamp_passes() {
        let (_db, pool) = invoices_db(4, 1);
        let mut conn = pool.get().unwrap();
        // Far longer than the call on a loaded machine; the stamps are then
        // let pass by hand.
        let ttl = Duration::from_secs(60);
        let claim = || unsent().build_claim().drain().keep_going().visibility_timeout(invoices::claimed_until, ttl);
        // 1 fails, 2 is dropped, 3 is released, 4 is sent.
        let outcome = claim().each_outcome(&mut *conn, |conn, invoice| match invoice.id {
            1 => Err(Error::InvalidArgument("declined".into())),
            2 => {
                // Dropped: the stamp stays.
                let _row: Invoice = invoice.into_row();
                Ok(())
            }
            3 => invoice.release(conn),
            _ => send(conn, invoice),
        });
        assert!(outcome.stopped.is_none(), "{:?}", outcome.stopped);
        assert_eq!((outcome.report.processed, outcome.report.failed), (3, 1));
        assert_eq!(outcome.failed.iter().map(|failure| failure.keys.clone()).collect::<Vec<_>>(), [vec![1]]);
        // Only the released row is claimable now.
        let mut seen = Vec::new();
        claim()
            .each(&mut *conn, |_, invoice| {
                seen.push(invoice.id);
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!(seen, [3]);
        let_stamps_pass(&mut conn);
        let mut seen = HashSet::new();
        let report = claim()
            .each(&mut *conn, |conn, invoice| {
                assert!(seen.insert(invoice.id), "row {} handed over twice in one call", invoice.id);
                send(conn, invoice)
            })
            .unwrap();
        assert_eq!(report.processed, 3);
        assert_eq!(invoice_figures(&mut conn), (0, 0, 0));
    }

    /// A worker claims what is claimable, then a row abandoned by a dead
    /// claim once its stamp passes, and stops when told.
    #[test]
    fn a_worker_picks_up_abandoned_rows_once_their_stamps_pass() {
        let (_db, pool) = invoices_db(5, 2);
        let mut conn = pool.get().unwrap();
        let ttl = Duration::from_millis(300);
        // A claim that dies with invoice 1 in hand.
        unsent()
            .build_claim()
            .max_rows(1)
            .visibility_timeout(invoices::claimed_until, ttl)
            .each(&mut *conn, |_, invoice: Claimed<Invoice, _>| {
                let _abandoned: Invoice = invoice.into_row();
                Ok::<_, Error>(())
            })
            .unwrap();
        let abandoned = Instant::now();
        let stop = diesel_claim::StopHandle::new();
        let worker = {
            let (pool, stop) = (pool.clone(), stop.clone());
            thread::spawn(move || {
                let mut conn = pool.get().unwrap();
                unsent()
                    .build_claim()
                    .visibility_timeout(invoices::claimed_until, ttl)
                    .worker(&stop)
                    .poll_interval(Duration::from_millis(5), Duration::from_millis(50))
                    .run(&mut *conn, send)
            })
        };
        while invoice_figures(&mut conn).1 > 0 {
            assert!(abandoned.elapsed() < Duration::from_secs(10), "rows left unsent");
            thread::sleep(Duration::from_millis(5));
        }
        // (Half the timeout: the stamp was set a moment before `abandoned`.)
        assert!(abandoned.elapsed() >= ttl / 2, "a live claim was taken");
        assert!(!worker.is_finished(), "the worker stopped by itself");
        stop.stop();
        let report = worker.join().unwrap().unwrap();
        assert_eq!(report.processed, 5);
        assert_eq!(invoice_figures(&mut conn), (0, 0, 0));
    }

    /// A visibility-timeout worker runs on a pool: four loops, each with a
    /// copy of the claim, send every invoice once and leave no stamp.
    #[test]
    fn a_visibility_timeout_worker_runs_on_a_pool() {
        let (_db, pool) = invoices_db(200, 5);
        let report = unsent()
            .build_claim()
            .visibility_timeout(invoices::claimed_until, Duration::from_secs(60))
            .worker(&diesel_claim::StopHandle::new())
            .concurrency(4)
            .stop_when_empty()
            .run_pooled(&pool, |conn: &mut Conn, invoice: Claimed<Invoice, _>| {
                work_on(conn, &invoice, 0)?;
                send(conn, invoice)
            })
            .unwrap();
        let mut conn = pool.get().unwrap();
        let worked: i64 = invoice_work::table.count().get_result(&mut conn).unwrap();
        assert_eq!((report.processed, worked), (200, 200));
        assert_eq!(invoice_figures(&mut conn), (0, 0, 0));
    }

    /// Batches: the closure gets the batch's claims, in key order, outside
    /// any transaction; an error ends the call, its rows stay stamped.
    #[test]
    fn batches_of_claims() {
        let (_db, pool) = invoices_db(25, 1);
        let mut conn = pool.get().unwrap();
        let claim = || unsent().build_claim().batch(10).visibility_timeout(invoices::claimed_until, Duration::from_secs(60));
        let mut sizes = Vec::new();
        let failed = claim().each_batch(&mut *conn, |conn, invoices: Vec<Claimed<Invoice, _>>| {
            sizes.push(invoices.len());
            if sizes.len() == 2 {
                return Err(Error::InvalidArgument("second batch".into()));
            }
            assert!(invoices.windows(2).all(|pair| pair[0].id < pair[1].id));
            invoices.into_iter().try_for_each(|invoice| send(conn, invoice))
        });
        assert!(matches!(failed, Err(Error::InvalidArgument(_))), "{failed:?}");
        assert_eq!(sizes, [10, 10]);
        let report = claim().each_batch(&mut *conn, |conn, invoices| invoices.into_iter().try_for_each(|i| send(conn, i))).unwrap();
        assert_eq!(report.processed, 5, "the failed batch's rows were claimed again");
        let stamped = invoice_figures(&mut conn).2;
        assert_eq!(stamped, 10);
    }

    /// Session time zones far apart claim the same rows by one clock, the
    /// database's: a claim made at +13:00 holds against a session at -12:00.
    #[test]
    fn sessions_in_different_time_zones_share_one_clock() {
        if BACKEND == "sqlite" {
            return; // One clock, no session time zones.
        }
        let (_db, pool) = invoices_db(1, 2);
        let (mut east, mut west) = (pool.get().unwrap(), pool.get().unwrap());
        let zone = |offset: &str| match BACKEND {
            "pg" => format!("SET TIME ZONE INTERVAL '{offset}' HOUR TO MINUTE"),
            _ => format!("SET time_zone = '{offset}'"),
        };
        east.batch_execute(&zone("+13:00")).unwrap();
        west.batch_execute(&zone("-12:00")).unwrap();
        let ttl = Duration::from_millis(500);
        let claim = || unsent().build_claim().visibility_timeout(invoices::claimed_until, ttl);
        claim()
            .each(&mut *east, |conn, invoice| {
                let report = claim().each(&mut *west, |_, _| Ok::<_, Error>(()))?;
                assert_eq!(report.processed, 0, "a live claim was taken from another time zone");
                thread::sleep(ttl + Duration::from_millis(200));
                let report = claim().each(&mut *west, send)?;
                assert_eq!(report.processed, 1, "a passed claim was not taken over");
                let lost = send(conn, invoice);
                assert!(matches!(lost, Err(Error::ClaimLost { .. })), "{lost:?}");
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!(invoice_figures(&mut west), (0, 0, 0));
    }

    /// Bad options and writes are refused with typed errors, before any SQL
    /// for the options.
    #[test]
    fn bad_options_and_writes_are_refused() {
        let (_db, pool) = invoices_db(2, 1);
        let mut conn = pool.get().unwrap();
        let never = |_: &mut Conn, _: Claimed<Invoice, _>| Ok::<_, Error>(());
        let refused = unsent().build_claim().visibility_timeout(invoices::claimed_until, Duration::from_micros(999)).each(&mut *conn, never);
        assert!(matches!(&refused, Err(Error::InvalidArgument(m)) if m.contains("1 ms")), "{refused:?}");
        let refused = unsent().build_claim().visibility_timeout(invoices::claimed_until, Duration::from_secs(8 * 24 * 3600)).each(&mut *conn, never);
        assert!(matches!(refused, Err(Error::InvalidArgument(_))), "{refused:?}");
        let refused = unsent().build_claim().nowait().visibility_timeout(invoices::claimed_until, Duration::from_secs(1)).each(&mut *conn, never);
        assert!(matches!(&refused, Err(Error::InvalidArgument(m)) if m.contains("visibility_timeout")), "{refused:?}");
        let refused = Conn::transaction(&mut conn, |conn| {
            unsent().build_claim().visibility_timeout(invoices::claimed_until, Duration::from_secs(1)).each(conn, never)
        });
        assert!(matches!(refused, Err(Error::InvalidArgument(_))), "{refused:?}");

        let mut outcomes = Vec::new();
        unsent()
            .build_claim()
            .visibility_timeout(invoices::claimed_until, Duration::from_secs(60))
            .each(&mut *conn, |conn, invoice| {
                if invoice.id == 1 {
                    let null = diesel::dsl::sql::<diesel::sql_types::Nullable<ClaimStamp>>("NULL");
                    outcomes.push(invoice.finish(conn, invoices::claimed_until.eq(null)));
                } else {
                    diesel::delete(invoices::table.find(invoice.id)).execute(conn)?;
                    outcomes.push(send(conn, invoice));
                }
                Ok::<_, Error>(())
            })
            .unwrap();
        assert!(matches!(&outcomes[0], Err(Error::InvalidArgument(m)) if m.contains("claimed_until")), "{outcomes:?}");
        assert!(matches!(&outcomes[1], Err(Error::NotFound)), "{outcomes:?}");
    }
}
