//! Job timeouts on a blocking connection: a closure that runs past its
//! claim's timeout is a failure once it returns, its work rolled back and
//! recorded under its row's lock; on PostgreSQL its statements are ended at
//! the timeout.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{Error, Retries, StopHandle};

use testkit::fixtures::on_every_backend;

on_every_backend! {
    diesel::table! {
        use diesel::sql_types::*;
        use super::ClaimStamp;

        slow_jobs (id) {
            id -> Integer,
            attempts -> Integer,
            run_at -> ClaimStamp,
            last_error -> Nullable<Text>,
            runs -> Integer,
            done -> Bool,
            claimed_until -> Nullable<ClaimStamp>,
        }
    }

    #[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
    #[diesel(table_name = slow_jobs)]
    pub struct SlowJob {
        pub id: i32,
    }

    /// A database with `count` jobs due now.
    pub fn slow_jobs_db(count: i32) -> (impl Sized, Pool) {
        let (db, pool) = test_db(2);
        let now = match BACKEND {
            "pg" => "now()",
            "mysql" => "(UTC_TIMESTAMP(6))",
            _ => "(strftime('%Y-%m-%d %H:%M:%f', 'now'))",
        };
        let rows: Vec<String> = (1..=count).map(|id| format!("({id})")).collect();
        pool.get().unwrap().batch_execute(&format!(
            "CREATE TABLE slow_jobs (id INTEGER PRIMARY KEY, attempts INTEGER NOT NULL DEFAULT 0, \
                 run_at {CLAIM_STAMP_COLUMN} NOT NULL DEFAULT {now}, last_error TEXT, \
                 runs INTEGER NOT NULL DEFAULT 0, done BOOLEAN NOT NULL DEFAULT FALSE, \
                 claimed_until {CLAIM_STAMP_COLUMN});
             INSERT INTO slow_jobs (id) VALUES {};",
            rows.join(", ")
        ))
        .unwrap();
        (db, pool)
    }

    /// `(attempts, last_error, runs, done)` of every job, by id.
    pub fn slow_figures(conn: &mut Conn) -> Vec<(i32, Option<String>, i32, bool)> {
        slow_jobs::table
            .order(slow_jobs::id)
            .select((slow_jobs::attempts, slow_jobs::last_error, slow_jobs::runs, slow_jobs::done))
            .load(conn)
            .unwrap()
    }

    /// A job that returns after its timeout failed, whatever it returned: its
    /// write is rolled back, its attempt and error recorded under its lock by
    /// the retry schedule, and it is counted as timed out. A job within its
    /// timeout succeeds.
    #[test]
    fn a_job_past_its_timeout_is_rolled_back_and_recorded() {
        let (_db, pool) = slow_jobs_db(2);
        let timeout = Duration::from_millis(300);
        let report = slow_jobs::table
            .filter(slow_jobs::done.eq(false))
            .select(SlowJob::as_select())
            .build_claim()
            .retries(
                Retries::new(slow_jobs::attempts, slow_jobs::run_at)
                    .last_error(slow_jobs::last_error)
                    .backoff(Duration::from_secs(60), Duration::from_secs(60)),
            )
            .then_update(slow_jobs::done.eq(true))
            .worker(&StopHandle::new())
            .timeout(timeout)
            .stop_when_empty()
            .run(&mut *pool.get().unwrap(), |conn, job: SlowJob| {
                diesel::update(slow_jobs::table.find(job.id))
                    .set(slow_jobs::runs.eq(slow_jobs::runs + 1))
                    .execute(conn)?;
                if job.id == 1 {
                    std::thread::sleep(timeout + Duration::from_millis(100));
                }
                Ok::<_, Error>(())
            })
            .unwrap();
        assert_eq!((report.processed, report.failed, report.timed_out), (1, 1, 1));
        let late = format!("the closure ran past its timeout of {timeout:?}: its work was rolled back");
        assert_eq!(
            slow_figures(&mut pool.get().unwrap()),
            [(1, Some(late), 0, false), (0, None, 1, true)]
        );
    }

    /// A job past its timeout whose failure hook fails ends the call, and
    /// is counted neither as failed nor as timed out: the report's timed-out
    /// rows are always among its failed ones. Under the row's lock and with a
    /// claim committed before the job.
    #[test]
    fn a_timed_out_job_whose_hook_fails_is_not_counted() {
        let (_db, pool) = slow_jobs_db(1);
        let conn = &mut pool.get().unwrap();
        let timeout = Duration::from_millis(50);
        let slow = |_: &mut Conn, _: SlowJob| {
            std::thread::sleep(timeout * 2);
            Ok::<_, Error>(())
        };
        let hook = |_: &mut Conn, _: SlowJob, _: &Error| Err(Error::InvalidArgument("no room".into()));
        let claim = || slow_jobs::table.select(SlowJob::as_select()).build_claim().timeout(timeout);
        let locked = claim().on_failure(hook).each_outcome(&mut **conn, slow);
        let committed = claim()
            .visibility_timeout(slow_jobs::claimed_until, Duration::from_secs(60))
            .on_failure(hook)
            .each_outcome(&mut **conn, |conn, job: diesel_claim::Claimed<SlowJob, _>| slow(conn, job.into_row()));
        for outcome in [locked.report, committed.report] {
            assert_eq!((outcome.failed, outcome.timed_out), (0, 0), "{outcome:?}");
        }
        for stopped in [locked.stopped, committed.stopped] {
            let stopped = stopped.expect("the hook's failure ends the call");
            assert!(matches!(stopped.error, Error::InvalidArgument(ref m) if m == "no room"), "{stopped:?}");
        }
    }

    /// Without a failure hook or `keep_going`, a job past its timeout ends
    /// the call with `Error::TimedOut`, and its work is rolled back.
    #[test]
    fn a_timeout_without_a_hook_ends_the_call() {
        let (_db, pool) = slow_jobs_db(1);
        let conn = &mut pool.get().unwrap();
        let ended = slow_jobs::table
            .select(SlowJob::as_select())
            .build_claim()
            .timeout(Duration::from_millis(50))
            .each(&mut **conn, |conn, job: SlowJob| {
                diesel::update(slow_jobs::table.find(job.id))
                    .set(slow_jobs::runs.eq(slow_jobs::runs + 1))
                    .execute(conn)?;
                std::thread::sleep(Duration::from_millis(100));
                Ok::<_, Error>(())
            });
        assert!(matches!(ended, Err(Error::TimedOut { .. })), "{ended:?}");
        assert_eq!(slow_figures(conn), [(0, None, 0, false)]);
        let refused = slow_jobs::table
            .select(SlowJob::as_select())
            .build_claim()
            .timeout(Duration::ZERO)
            .each(&mut **conn, |_, _: SlowJob| Ok::<_, Error>(()));
        assert!(matches!(refused, Err(Error::InvalidArgument(_))), "{refused:?}");
    }
}

/// On PostgreSQL, a job blocked in a slow statement is ended by the server
/// at its timeout, not when the statement would have finished: the failure
/// is recorded within about the timeout.
#[cfg(feature = "postgres")]
#[test]
fn postgres_ends_a_jobs_statement_at_its_timeout() {
    use self::pg::{slow_figures, slow_jobs, slow_jobs_db, SlowJob};
    let (_db, pool) = slow_jobs_db(1);
    let began = std::time::Instant::now();
    let report = slow_jobs::table
        .select(SlowJob::as_select())
        .build_claim()
        .retries(
            Retries::new(slow_jobs::attempts, slow_jobs::run_at).last_error(slow_jobs::last_error),
        )
        .timeout(Duration::from_millis(500))
        .each(&mut *pool.get().unwrap(), |conn, _: SlowJob| {
            conn.batch_execute("SELECT pg_sleep(20)")?;
            Ok::<_, Error>(())
        })
        .unwrap();
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
    assert_eq!((report.failed, report.timed_out), (1, 1));
    let figures = slow_figures(&mut pool.get().unwrap());
    assert_eq!(figures[0].0, 1);
    assert!(
        figures[0].1.as_deref().unwrap().contains("timeout"),
        "{figures:?}"
    );
}
