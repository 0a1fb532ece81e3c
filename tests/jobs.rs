//! Job workers: the next job from the head of the queue, a failing job's
//! attempt recorded under its lock, a backoff for failing jobs, dead letters,
//! and batches whose failing rows are rolled back alone.

use std::collections::HashMap;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{Error, StopHandle};

use testkit::fixtures::{insert_jobs, jobs, on_every_backend, Job};

/// A job that fails on every attempt is left out of the queue after this many.
const MAX_ATTEMPTS: i32 = 3;

on_every_backend! {
    /// The queue: jobs not done and not dead-lettered, by priority, then due
    /// time.
    /// The queue's type.
    pub type Queue = diesel::dsl::Order<
        diesel::dsl::Select<
            diesel::dsl::Filter<
                jobs::table,
                diesel::dsl::And<diesel::dsl::Eq<jobs::done, bool>, diesel::dsl::Lt<jobs::attempts, i32>>,
            >,
            diesel::dsl::AsSelect<Job, <Conn as Connection>::Backend>,
        >,
        (diesel::dsl::Desc<jobs::priority>, jobs::due),
    >;

    pub fn queue() -> Queue {
        jobs::table
            .filter(jobs::done.eq(false).and(jobs::attempts.lt(MAX_ATTEMPTS)))
            .select(Job::as_select())
            .order((jobs::priority.desc(), jobs::due))
    }

    /// How many jobs the queue holds.
    fn queued(conn: &mut Conn) -> i64 {
        jobs::table
            .filter(jobs::done.eq(false).and(jobs::attempts.lt(MAX_ATTEMPTS)))
            .count()
            .get_result(conn)
            .unwrap()
    }

    /// Does a job: marks it done and counts how often it was done.
    pub fn finish(conn: &mut Conn, job: &Job) -> Result<(), Error> {
        diesel::update(job)
            .set((jobs::done.eq(true), jobs::times_done.eq(jobs::times_done + 1)))
            .execute(conn)?;
        Ok(())
    }

    /// The failure hook of these tests: one more attempt, recorded with the
    /// job's lock still held.
    fn record_attempt(conn: &mut Conn, job: Job, _error: &Error) -> Result<(), Error> {
        diesel::update(&job)
            .set(jobs::attempts.eq(jobs::attempts + 1))
            .execute(conn)?;
        Ok(())
    }

    /// `(times_done, attempts)` of every job, by id.
    pub fn figures(conn: &mut Conn) -> HashMap<i32, (i32, i32)> {
        jobs::table
            .select((jobs::id, jobs::times_done, jobs::attempts))
            .load::<(i32, i32, i32)>(conn)
            .unwrap()
            .into_iter()
            .map(|(id, done, attempts)| (id, (done, attempts)))
            .collect()
    }

    /// Claimers on MySQL and MariaDB run at `READ COMMITTED`, as the guide
    /// advises: under `REPEATABLE READ`, a take keeps the locks of the done
    /// rows it passed, and MariaDB's `SKIP LOCKED` then waits for some of
    /// them, deadlocking with other claimers.
    pub fn read_committed(conn: &mut Conn) {
        if BACKEND == "mysql" {
            diesel::connection::SimpleConnection::batch_execute(
                conn,
                "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
            )
            .unwrap();
        }
    }

    /// A job enqueued ahead of the others while a worker runs is the next
    /// one the worker takes: each take starts from the head of the queue.
    /// (Enqueued in the transaction of the job in hand, so that it commits
    /// before the next take on every backend, SQLite's one writer included.)
    #[test]
    fn a_job_enqueued_ahead_is_the_next_one_taken() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        let expected = insert_jobs(conn, 12);
        let stop = StopHandle::new();
        let mut seen = Vec::new();
        let report = queue()
            .build_claim()
            .worker(&stop)
            .poll_interval(Duration::from_millis(1), Duration::from_millis(5))
            .run(conn, |conn, job: Job| {
                seen.push(job.id);
                if seen.len() == 2 {
                    diesel::insert_into(jobs::table)
                        .values((
                            jobs::id.eq(100),
                            jobs::priority.eq(9),
                            jobs::due.eq(diesel::dsl::sql("'2026-01-01 09:00:00'")),
                        ))
                        .execute(conn)?;
                }
                if seen.len() == 13 {
                    stop.stop();
                }
                finish(conn, &job)
            })
            .unwrap();
        assert_eq!(report.processed, 13);
        let mut queue_order = expected[..2].to_vec();
        queue_order.push(100);
        queue_order.extend(&expected[2..]);
        assert_eq!(seen, queue_order);
    }

    /// Under many workers, a job that fails has its attempt recorded before
    /// any other worker can take it: each of its runs sees the attempts of
    /// the runs before it, 0, 1, 2, never one twice; after `MAX_ATTEMPTS` it
    /// leaves the queue (a dead letter). Every other job is done once. Half
    /// the workers take batches, whose failing rows are rolled back alone.
    #[test]
    fn failing_jobs_are_recorded_under_their_lock_and_dead_lettered() {
        let (workers, count) = if ROW_LOCKS { (8, 240) } else { (4, 80) };
        let (_db, pool) = test_db(workers + 1);
        insert_jobs(&mut *pool.get().unwrap(), count);
        let failing = |id: i32| id % 5 == 0;
        let runs: Mutex<HashMap<i32, Vec<i32>>> = Mutex::default();
        let stop = StopHandle::new();
        thread::scope(|scope| {
            for worker in 0..workers {
                let (pool, runs, stop) = (&pool, &runs, &stop);
                scope.spawn(move || {
                    let mut pooled = pool.get().unwrap();
                    let conn: &mut Conn = &mut pooled;
                    read_committed(conn);
                    queue()
                        .build_claim()
                        .batch(if worker % 2 == 0 { 1 } else { 4 })
                        .on_failure(record_attempt)
                        .worker(stop)
                        .poll_interval(Duration::from_millis(1), Duration::from_millis(5))
                        .failure_backoff(Duration::from_millis(1), Duration::from_millis(1))
                        .run(conn, |conn, job: Job| {
                            runs.lock().unwrap().entry(job.id).or_default().push(job.attempts);
                            if failing(job.id) {
                                // Written, then rolled back with the failure.
                                finish(conn, &job)?;
                                return Err(Error::InvalidArgument(format!("job {} fails", job.id)));
                            }
                            finish(conn, &job)
                        })
                        .unwrap()
                });
            }
            let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
            let deadline = Instant::now() + Duration::from_secs(60);
            while queued(conn) > 0 {
                assert!(Instant::now() < deadline, "the workers did not empty the queue");
                thread::sleep(Duration::from_millis(20));
            }
            stop.stop();
        });
        let runs = runs.into_inner().unwrap();
        let figures = figures(&mut pool.get().unwrap());
        for id in 1..=count {
            let attempts_seen = &runs[&id];
            if failing(id) {
                assert_eq!(attempts_seen, &[0, 1, 2], "job {id}: the attempts its runs saw");
                assert_eq!(figures[&id], (0, MAX_ATTEMPTS), "job {id}");
            } else {
                assert_eq!(attempts_seen, &[0], "job {id}");
                assert_eq!(figures[&id], (1, 0), "job {id}");
            }
        }
    }

    /// A worker leaves a job whose closure failed (and whose hook left it in
    /// the queue) out of its claims for its backoff: it retries it no faster.
    #[test]
    fn a_worker_retries_a_failing_job_no_faster_than_its_backoff() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        insert_jobs(conn, 1);
        let backoff = Duration::from_millis(150);
        let stop = StopHandle::new();
        let started = Instant::now();
        let mut runs = Vec::new();
        let report = jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .build_claim()
            .on_failure(record_attempt)
            .worker(&stop)
            .poll_interval(Duration::from_millis(1), Duration::from_millis(2))
            .failure_backoff(backoff, backoff)
            .run(conn, |_, job: Job| {
                runs.push(Instant::now());
                if started.elapsed() > Duration::from_millis(1000) {
                    stop.stop();
                }
                Err(Error::InvalidArgument(format!("job {} fails", job.id)))
            })
            .unwrap();
        assert_eq!(report.failed as usize, runs.len());
        assert!((4..=8).contains(&runs.len()), "{} runs in about a second", runs.len());
        for pair in runs.windows(2) {
            let gap = pair[1] - pair[0];
            assert!(gap >= backoff, "retried after {gap:?}, before its backoff of {backoff:?}");
        }
    }

    /// In a batch, a failing row is rolled back to its own savepoint and its
    /// hook runs; the other rows of the batch commit; no closure runs twice
    /// for a row in the call. Selected, marked (the hook puts the row back),
    /// and marked and committed.
    #[test]
    fn a_failing_row_of_a_batch_is_rolled_back_alone_and_recorded() {
        for way in ["select", "mark", "mark_and_commit"] {
            let (_db, pool) = test_db(1);
            let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
            insert_jobs(conn, 10);
            let mut seen: HashMap<i32, u32> = HashMap::new();
            let mut work = |conn: &mut Conn, job: Job| {
                *seen.entry(job.id).or_default() += 1;
                if let 3 | 7 = job.id {
                    // Written, then rolled back with the failure (unless
                    // the mark committed before the closure ran).
                    diesel::update(&job)
                        .set(jobs::times_done.eq(jobs::times_done + 1))
                        .execute(conn)?;
                    return Err(Error::InvalidArgument(format!("job {} fails", job.id)));
                }
                finish(conn, &job)
            };
            let claim = queue().build_claim().batch(4).drain();
            // A marked job is done already: the hook puts it back.
            let put_back = |conn: &mut Conn, job: Job, _: &Error| {
                diesel::update(&job)
                    .set((jobs::done.eq(false), jobs::attempts.eq(jobs::attempts + 1)))
                    .execute(conn)?;
                Ok::<_, Error>(())
            };
            let outcome = match way {
                "select" => claim.on_failure(record_attempt).each_outcome(conn, &mut work),
                "mark" => claim
                    .mark(jobs::done.eq(true))
                    .on_failure(put_back)
                    .each_outcome(conn, &mut work),
                _ => claim
                    .mark_and_commit(jobs::done.eq(true))
                    .on_failure(put_back)
                    .each_outcome(conn, &mut work),
            };
            assert!(outcome.stopped.is_none(), "{way}: {:?}", outcome.stopped);
            let failed: Vec<&[i32]> = outcome.failed.iter().map(|failure| &failure.keys[..]).collect();
            assert_eq!(failed, [&[3][..], &[7]], "{way}");
            assert_eq!((outcome.report.processed, outcome.report.failed), (8, 2), "{way}");
            assert!(seen.values().all(|&times| times == 1), "{way}: {seen:?}");
            let figures = figures(conn);
            for id in 1..=10 {
                let expected = match id {
                    // Marked and committed, the closure runs outside any
                    // transaction: its write stays; the hook undid the mark.
                    3 | 7 if way == "mark_and_commit" => (1, 1),
                    3 | 7 => (0, 1),
                    _ => (1, 0),
                };
                assert_eq!(figures[&id], expected, "{way}: job {id}");
            }
            let mut pending: Vec<i32> = queue().load(conn).unwrap().iter().map(|job: &Job| job.id).collect();
            pending.sort();
            assert_eq!(pending, [3, 7], "{way}: the failed jobs are back in the queue");
        }
    }

    /// `then_delete` and `then_update` write the rows whose closure
    /// succeeded, in the batch's transaction, after the closures: the failing
    /// rows are left to their hook, the others deleted (or marked done).
    #[test]
    fn then_delete_and_then_update_finish_the_rows_that_succeeded() {
        for way in ["delete", "update"] {
            let (_db, pool) = test_db(1);
            let mut pooled = pool.get().unwrap();
            let conn: &mut Conn = &mut pooled;
            insert_jobs(conn, 10);
            let claim = queue().build_claim().batch(4).on_failure(record_attempt);
            let work = |_: &mut Conn, job: Job| match job.id {
                3 | 7 => Err(Error::InvalidArgument(format!("job {} fails", job.id))),
                _ => Ok(()),
            };
            let report = match way {
                "delete" => claim.then_delete().each(conn, work),
                _ => claim.then_update(jobs::done.eq(true)).each(conn, work),
            }
            .unwrap();
            assert_eq!((report.processed, report.failed), (8, 2), "{way}");
            let left: Vec<(i32, bool, i32)> = jobs::table
                .select((jobs::id, jobs::done, jobs::attempts))
                .order(jobs::id)
                .load(conn)
                .unwrap();
            let expected: Vec<(i32, bool, i32)> = match way {
                "delete" => vec![(3, false, 1), (7, false, 1)],
                _ => (1..=10).map(|id| (id, id != 3 && id != 7, i32::from(id == 3 || id == 7))).collect(),
            };
            assert_eq!(left, expected, "{way}");
        }
    }

    /// A take that finds nothing calls no closure: a batch closure never
    /// gets an empty batch, from the head or in pages, with or without
    /// savepoints.
    #[test]
    fn a_batch_closure_never_gets_an_empty_batch() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        for (head, hook) in [(true, false), (true, true), (false, false), (false, true)] {
            diesel::delete(jobs::table).execute(conn).unwrap();
            insert_jobs(conn, 10);
            let claim = queue().build_claim().batch(4).drain();
            let claim = if head { claim.from_head() } else { claim.in_pages() };
            let mut batches = Vec::new();
            let work = |conn: &mut Conn, jobs: Vec<Job>| {
                batches.push(jobs.len());
                jobs.iter().try_for_each(|job| finish(conn, job))
            };
            let report = match hook {
                true => claim.on_failure(record_attempt).each_batch(conn, work),
                false => claim.each_batch(conn, work),
            }
            .unwrap();
            assert_eq!(report.processed, 10, "head {head}, hook {hook}");
            assert!(batches.iter().all(|&len| len > 0), "head {head}, hook {hook}: {batches:?}");
        }
    }

    /// A failure hook that fails ends the call with its own error, and its
    /// batch is rolled back whole: nothing of it is lost or half written. The
    /// failure names the rows that ran (the batch's third never did).
    #[test]
    fn a_failing_hook_ends_the_call_and_rolls_its_batch_back() {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        insert_jobs(conn, 6);
        let order = insert_jobs_order(6);
        let outcome = queue()
            .build_claim()
            .batch(3)
            .on_failure(|_: &mut Conn, job: Job, _: &Error| {
                Err(Error::InvalidArgument(format!("cannot record job {}", job.id)))
            })
            .each_outcome(conn, |conn, job: Job| match job.id == order[1] {
                true => Err(Error::NotFound),
                false => finish(conn, &job),
            });
        let stopped = outcome.stopped.expect("the hook's failure ends the call");
        assert!(matches!(&stopped.error, Error::InvalidArgument(m) if m.starts_with("cannot record")));
        assert_eq!(stopped.keys, order[..2]);
        assert_eq!(outcome.report.processed, 0);
        let figures = figures(conn);
        assert!(figures.values().all(|&f| f == (0, 0)), "{figures:?}");
    }

    /// The claim order of `insert_jobs(count)`, without inserting.
    fn insert_jobs_order(count: i32) -> Vec<i32> {
        let minutes = |id: i32| id * 7 % 60;
        let mut order: Vec<i32> = (1..=count).collect();
        order.sort_by_key(|&id| (std::cmp::Reverse(id % 4), minutes(id), id));
        order
    }

    /// Options that read candidates in pages cannot take from the head: the
    /// call is refused before any SQL.
    #[test]
    fn from_head_refuses_options_that_read_pages() {
        let (_db, pool) = test_db(2);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        let mut replica = pool.get().unwrap();
        insert_jobs(conn, 3);
        let refused = |result: Result<diesel_claim::ClaimReport, Error>| {
            assert!(matches!(result, Err(Error::InvalidArgument(_))), "{result:?}");
        };
        let work = |conn: &mut Conn, job: Job| finish(conn, &job);
        refused(queue().build_claim().from_head().nowait().each(conn, work));
        refused(queue().build_claim().from_head().page_size(10).each(conn, work));
        refused(queue().build_claim().page_size(10).from_head().each(conn, work));
        refused(queue().build_claim().in_pages().from_head().each(conn, work));
        refused(queue().build_claim().from_head().candidates_from(&mut replica).each(conn, work));
        assert_eq!(queued(conn), 3);
    }
}

on_every_backend! {
    row_locks;

    use testkit::fixtures::accounts;

    /// A worker whose closure is a deadlock's victim goes on: the database
    /// rolled the job's transaction back, and the worker runs the job again,
    /// where it used to end on the error. The first job's closure locks
    /// account 1 and then waits for account 2, which another transaction holds
    /// and which then waits for account 1. The closure waits first (on PostgreSQL the
    /// other transaction watches for it), so PostgreSQL's
    /// check (after `deadlock_timeout`) breaks the cycle in the closure's
    /// session; the other transaction has written more rows, so InnoDB rolls
    /// back the closure's, the smaller.
    #[test]
    fn a_worker_runs_a_job_again_when_its_closure_is_a_deadlocks_victim() {
        let (db, pool) = test_db(2);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        read_committed(conn);
        seed_accounts(conn, &[100; 202]);
        insert_jobs(conn, 3);
        let add_one = |conn: &mut Conn, id: i32| {
            diesel::update(accounts::table.find(id))
                .set(accounts::balance.eq(accounts::balance + 1))
                .execute(conn)
        };
        let (other_holds_two, holds_two) = std::sync::mpsc::channel();
        let (closure_holds_one, holds_one) = std::sync::mpsc::channel();
        let other = thread::spawn({
            let (pool, url) = (pool.clone(), db.url.clone());
            move || {
                let mut conn = pool.get().unwrap();
                conn.transaction(|conn| {
                    diesel::update(accounts::table.filter(accounts::id.ge(3)))
                        .set(accounts::balance.eq(accounts::balance + 1))
                        .execute(conn)?;
                    add_one(conn, 2)?;
                    other_holds_two.send(()).unwrap();
                    holds_one.recv().unwrap();
                    testkit::sessions::wait_for_a_lock_waiter(&url);
                    add_one(conn, 1)
                })
            }
        });
        holds_two.recv().unwrap();
        let stop = StopHandle::new();
        let (mut calls, mut deadlocks) = (0, 0);
        let report = queue()
            .build_claim()
            .worker(&stop)
            .poll_interval(Duration::from_millis(1), Duration::from_millis(5))
            .stop_when_empty()
            .run(conn, |conn, job: Job| {
                calls += 1;
                if calls == 1 {
                    add_one(conn, 1)?;
                    closure_holds_one.send(()).unwrap();
                    add_one(conn, 2).inspect_err(|error| {
                        deadlocks += usize::from(diesel_claim::is_deadlock(error));
                    })?;
                }
                finish(conn, &job)
            })
            .unwrap();
        let other = other.join().unwrap();
        assert!(other.is_ok(), "the other transaction failed: {other:?}");
        assert_eq!(deadlocks, 1, "the closure was not the deadlock's victim");
        assert_eq!((report.processed, calls), (3, 4));
        let done: Vec<(i32, i32)> = figures(conn).into_values().collect();
        assert!(done.iter().all(|&(times_done, _)| times_done == 1), "{done:?}");
        // The closure's write to account 1 was rolled back with its job.
        let balances: Vec<i64> = accounts::table
            .filter(accounts::id.le(2))
            .order(accounts::id)
            .select(accounts::balance)
            .load(conn)
            .unwrap();
        assert_eq!(balances, [101, 101]);
    }
}
