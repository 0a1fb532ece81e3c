//! Job workers on diesel-async: the next job from the head of the queue, a
//! failing job's attempt recorded under its lock by an `async` hook, the
//! backoff, dead letters, and batches whose failing rows are rolled back
//! alone; the blocking tests' invariants, awaited.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::{BoolExpressionMethods, ExpressionMethods, QueryDsl, SelectableHelper};
use diesel_async::pooled_connection::{bb8, AsyncDieselConnectionManager};
use diesel_async::RunQueryDsl;
use diesel_claim::aio::prelude::*;
use diesel_claim::{Error, StopHandle};

use testkit::fixtures::{insert_jobs, jobs, Job};

/// A job that fails on every attempt leaves the queue after this many.
const MAX_ATTEMPTS: i32 = 3;

on_async_backends! {
    /// The queue: jobs not done and not dead-lettered, by priority, then due
    /// time.
    /// The queue's type.
    type Queue = diesel::dsl::Order<
        diesel::dsl::Select<
            diesel::dsl::Filter<
                jobs::table,
                diesel::dsl::And<diesel::dsl::Eq<jobs::done, bool>, diesel::dsl::Lt<jobs::attempts, i32>>,
            >,
            diesel::dsl::AsSelect<Job, <Conn as diesel_async::AsyncConnectionCore>::Backend>,
        >,
        (diesel::dsl::Desc<jobs::priority>, jobs::due),
    >;

    fn queue() -> Queue {
        jobs::table
            .filter(jobs::done.eq(false).and(jobs::attempts.lt(MAX_ATTEMPTS)))
            .select(Job::as_select())
            .order((jobs::priority.desc(), jobs::due))
    }

    /// How many jobs the queue holds.
    async fn queued(conn: &mut Conn) -> i64 {
        jobs::table
            .filter(jobs::done.eq(false).and(jobs::attempts.lt(MAX_ATTEMPTS)))
            .count()
            .get_result(conn)
            .await
            .unwrap()
    }

    /// A database with `count` jobs (see `insert_jobs`), and a pool.
    async fn jobs_db(count: i32, size: u32) -> (impl Sized, Pool) {
        let (db, pool) = test_db(size).await;
        insert_jobs(&mut blocking(&db.url), count);
        (db, pool)
    }

    /// Does a job: marks it done and counts how often it was done.
    async fn finish(conn: &mut Conn, job: &Job) -> Result<(), Error> {
        diesel::update(job)
            .set((jobs::done.eq(true), jobs::times_done.eq(jobs::times_done + 1)))
            .execute(conn)
            .await?;
        Ok(())
    }

    /// The failure hook: one more attempt, recorded under the job's lock.
    async fn record_attempt(conn: &mut Conn, job: Job, _error: &Error) -> Result<(), Error> {
        diesel::update(&job)
            .set(jobs::attempts.eq(jobs::attempts + 1))
            .execute(conn)
            .await?;
        Ok(())
    }

    /// `(times_done, attempts)` of every job, by id.
    async fn figures(conn: &mut Conn) -> HashMap<i32, (i32, i32)> {
        jobs::table
            .select((jobs::id, jobs::times_done, jobs::attempts))
            .load::<(i32, i32, i32)>(conn)
            .await
            .unwrap()
            .into_iter()
            .map(|(id, done, attempts)| (id, (done, attempts)))
            .collect()
    }

    /// A job enqueued ahead of the others while a worker task runs is the
    /// next one it takes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_enqueued_ahead_is_the_next_one_taken() {
        let (_db, pool) = jobs_db(12, 1).await;
        let expected = insert_jobs_order(12);
        let mut conn = pool.get().await.unwrap();
        let stop = StopHandle::new();
        let seen = Mutex::new(Vec::new());
        let report = queue()
            .build_claim()
            .worker(&stop)
            .poll_interval(Duration::from_millis(1), Duration::from_millis(5))
            .run(&mut *conn, async |conn: &mut Conn, job: Job| {
                let taken = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(job.id);
                    seen.len()
                };
                if taken == 2 {
                    diesel::insert_into(jobs::table)
                        .values((
                            jobs::id.eq(100),
                            jobs::priority.eq(9),
                            jobs::due.eq(diesel::dsl::sql("'2026-01-01 09:00:00'")),
                        ))
                        .execute(conn)
                        .await?;
                }
                if taken == 13 {
                    stop.stop();
                }
                finish(conn, &job).await
            })
            .await
            .unwrap();
        assert_eq!(report.processed, 13);
        let mut queue_order = expected[..2].to_vec();
        queue_order.push(100);
        queue_order.extend(&expected[2..]);
        assert_eq!(*seen.lock().unwrap(), queue_order);
    }

    /// The claim order of `insert_jobs(count)`.
    fn insert_jobs_order(count: i32) -> Vec<i32> {
        let minutes = |id: i32| id * 7 % 60;
        let mut order: Vec<i32> = (1..=count).collect();
        order.sort_by_key(|&id| (std::cmp::Reverse(id % 4), minutes(id), id));
        order
    }

    /// Under many worker tasks, a failing job's attempt is recorded before
    /// any other task can take it: its runs see 0, 1, 2 attempts, never one
    /// twice, and it leaves the queue after `MAX_ATTEMPTS`. Every other job
    /// is done once; half the tasks take batches.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn failing_jobs_are_recorded_under_their_lock_and_dead_lettered() {
        let (tasks, count) = (8, 240);
        let (_db, pool) = jobs_db(count, tasks + 1).await;
        let failing = |id: i32| id % 5 == 0;
        let runs: Arc<Mutex<HashMap<i32, Vec<i32>>>> = Arc::default();
        let stop = StopHandle::new();
        let handles: Vec<_> = (0..tasks)
            .map(|task| {
                let (pool, runs, stop) = (pool.clone(), Arc::clone(&runs), stop.clone());
                tokio::spawn(async move {
                    let mut conn = pool.get_owned().await.unwrap();
                    let runs = &runs;
                    queue()
                        .build_claim()
                        .batch(if task % 2 == 0 { 1 } else { 4 })
                        .on_failure(record_attempt)
                        .worker(&stop)
                        .poll_interval(Duration::from_millis(1), Duration::from_millis(5))
                        .failure_backoff(Duration::from_millis(1), Duration::from_millis(1))
                        .run(&mut *conn, async |conn: &mut Conn, job: Job| {
                            runs.lock().unwrap().entry(job.id).or_default().push(job.attempts);
                            if failing(job.id) {
                                finish(conn, &job).await?;
                                return Err(Error::InvalidArgument(format!("job {} fails", job.id)));
                            }
                            finish(conn, &job).await
                        })
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut conn = pool.get().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while queued(&mut conn).await > 0 {
            assert!(Instant::now() < deadline, "the workers did not empty the queue");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.stop();
        for handle in handles {
            handle.await.unwrap();
        }
        let runs = runs.lock().unwrap().clone();
        let figures = figures(&mut conn).await;
        for id in 1..=count {
            if failing(id) {
                assert_eq!(runs[&id], [0, 1, 2], "job {id}: the attempts its runs saw");
                assert_eq!(figures[&id], (0, MAX_ATTEMPTS), "job {id}");
            } else {
                assert_eq!(runs[&id], [0], "job {id}");
                assert_eq!(figures[&id], (1, 0), "job {id}");
            }
        }
    }

    /// A worker task retries a failing job no faster than its backoff.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_retries_a_failing_job_no_faster_than_its_backoff() {
        let (_db, pool) = jobs_db(1, 1).await;
        let mut conn = pool.get().await.unwrap();
        let backoff = Duration::from_millis(150);
        let stop = StopHandle::new();
        let started = Instant::now();
        let runs = Mutex::new(Vec::new());
        let report = jobs::table
            .filter(jobs::done.eq(false))
            .select(Job::as_select())
            .build_claim()
            .on_failure(record_attempt)
            .worker(&stop)
            .poll_interval(Duration::from_millis(1), Duration::from_millis(2))
            .failure_backoff(backoff, backoff)
            .run(&mut *conn, async |_: &mut Conn, job: Job| {
                runs.lock().unwrap().push(Instant::now());
                if started.elapsed() > Duration::from_millis(1000) {
                    stop.stop();
                }
                Err(Error::InvalidArgument(format!("job {} fails", job.id)))
            })
            .await
            .unwrap();
        let runs = runs.into_inner().unwrap();
        assert_eq!(report.failed as usize, runs.len());
        assert!((4..=8).contains(&runs.len()), "{} runs in about a second", runs.len());
        for pair in runs.windows(2) {
            let gap = pair[1] - pair[0];
            assert!(gap >= backoff, "retried after {gap:?}, before its backoff of {backoff:?}");
        }
    }

    /// `then_delete` deletes the rows whose closure succeeded, in the batch's
    /// transaction; the failing rows are left to their hook.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn then_delete_finishes_the_rows_that_succeeded() {
        let (_db, pool) = jobs_db(10, 1).await;
        let mut conn = pool.get().await.unwrap();
        let report = queue()
            .build_claim()
            .batch(4)
            .on_failure(record_attempt)
            .then_delete()
            .each(&mut *conn, async |_: &mut Conn, job: Job| match job.id {
                3 | 7 => Err(Error::InvalidArgument(format!("job {} fails", job.id))),
                _ => Ok(()),
            })
            .await
            .unwrap();
        assert_eq!((report.processed, report.failed), (8, 2));
        let left: Vec<(i32, i32)> = jobs::table
            .select((jobs::id, jobs::attempts))
            .order(jobs::id)
            .load(&mut *conn)
            .await
            .unwrap();
        assert_eq!(left, [(3, 1), (7, 1)]);
    }

    /// In a batch, a failing row is rolled back to its own savepoint and its
    /// `async` hook runs; the other rows commit; no closure runs twice for a
    /// row in the call. Selected, marked, and marked and committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_row_of_a_batch_is_rolled_back_alone_and_recorded() {
        for way in ["select", "mark", "mark_and_commit"] {
            let (_db, pool) = jobs_db(10, 1).await;
            let mut conn = pool.get().await.unwrap();
            let seen: Mutex<HashMap<i32, u32>> = Mutex::default();
            let work = async |conn: &mut Conn, job: Job| {
                *seen.lock().unwrap().entry(job.id).or_default() += 1;
                if let 3 | 7 = job.id {
                    diesel::update(&job)
                        .set(jobs::times_done.eq(jobs::times_done + 1))
                        .execute(conn)
                        .await?;
                    return Err(Error::InvalidArgument(format!("job {} fails", job.id)));
                }
                finish(conn, &job).await
            };
            let put_back = async |conn: &mut Conn, job: Job, _: &Error| {
                diesel::update(&job)
                    .set((jobs::done.eq(false), jobs::attempts.eq(jobs::attempts + 1)))
                    .execute(conn)
                    .await?;
                Ok::<_, Error>(())
            };
            let claim = queue().build_claim().batch(4).drain();
            let outcome = match way {
                "select" => claim.on_failure(record_attempt).each_outcome(&mut *conn, work).await,
                "mark" => {
                    claim
                        .mark(jobs::done.eq(true))
                        .on_failure(put_back)
                        .each_outcome(&mut *conn, work)
                        .await
                }
                _ => {
                    claim
                        .mark_and_commit(jobs::done.eq(true))
                        .on_failure(put_back)
                        .each_outcome(&mut *conn, work)
                        .await
                }
            };
            assert!(outcome.stopped.is_none(), "{way}: {:?}", outcome.stopped);
            let failed: Vec<&[i32]> = outcome.failed.iter().map(|failure| &failure.keys[..]).collect();
            assert_eq!(failed, [&[3][..], &[7]], "{way}");
            assert_eq!((outcome.report.processed, outcome.report.failed), (8, 2), "{way}");
            assert!(seen.lock().unwrap().values().all(|&times| times == 1), "{way}");
            let figures = figures(&mut conn).await;
            for id in 1..=10 {
                let expected = match id {
                    3 | 7 if way == "mark_and_commit" => (1, 1),
                    3 | 7 => (0, 1),
                    _ => (1, 0),
                };
                assert_eq!(figures[&id], expected, "{way}: job {id}");
            }
            assert_eq!(queued(&mut conn).await, 2, "{way}: the failed jobs are back in the queue");
        }
    }

    /// A worker task whose closure is a deadlock's victim goes on and runs
    /// the job again, as the blocking worker does (`jobs.rs`, whose test this
    /// is, awaited): the first job's closure locks account 1 and then waits
    /// for account 2, held by a heavier blocking transaction that then waits
    /// for account 1 once the closure waits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_runs_a_job_again_when_its_closure_is_a_deadlocks_victim() {
        use diesel::Connection;
        use testkit::fixtures::accounts;

        let (db, pool) = test_db(1).await;
        let mut setup = blocking(&db.url);
        let url = db.url.clone();
        insert_jobs(&mut setup, 3);
        let seeded: Vec<_> =
            (1..=202).map(|id| (accounts::id.eq(id), accounts::balance.eq(100_i64))).collect();
        let seed = diesel::insert_into(accounts::table).values(&seeded);
        diesel::RunQueryDsl::execute(seed, &mut setup).unwrap();
        let (other_holds_two, holds_two) = std::sync::mpsc::channel();
        let (closure_holds_one, holds_one) = std::sync::mpsc::channel();
        let other = std::thread::spawn(move || {
            let add_one = |conn: &mut Db, ids| {
                let accounts = accounts::table.filter(ids);
                let update = diesel::update(accounts).set(accounts::balance.eq(accounts::balance + 1));
                diesel::RunQueryDsl::execute(update, conn)
            };
            setup.transaction(|conn| {
                add_one(conn, accounts::id.between(2, 202))?;
                other_holds_two.send(()).unwrap();
                holds_one.recv().unwrap();
                testkit::sessions::wait_for_a_lock_waiter(&url);
                add_one(conn, accounts::id.between(1, 1))
            })
        });
        holds_two.recv().unwrap();
        let add_one = async |conn: &mut Conn, id: i32| {
            diesel::update(accounts::table.find(id))
                .set(accounts::balance.eq(accounts::balance + 1))
                .execute(conn)
                .await
        };
        let mut conn = pool.get().await.unwrap();
        let stop = StopHandle::new();
        let (calls, deadlocks) = (Mutex::new(0), Mutex::new(0));
        let report = queue()
            .build_claim()
            .worker(&stop)
            .poll_interval(Duration::from_millis(1), Duration::from_millis(5))
            .stop_when_empty()
            .run(&mut *conn, async |conn: &mut Conn, job: Job| {
                let first = {
                    let mut calls = calls.lock().unwrap();
                    *calls += 1;
                    *calls == 1
                };
                if first {
                    add_one(conn, 1).await?;
                    closure_holds_one.send(()).unwrap();
                    add_one(conn, 2).await.inspect_err(|error| {
                        *deadlocks.lock().unwrap() += usize::from(diesel_claim::is_deadlock(error));
                    })?;
                }
                finish(conn, &job).await
            })
            .await
            .unwrap();
        let other = other.join().unwrap();
        assert!(other.is_ok(), "the other transaction failed: {other:?}");
        assert_eq!(*deadlocks.lock().unwrap(), 1, "the closure was not the deadlock's victim");
        assert_eq!((report.processed, *calls.lock().unwrap()), (3, 4));
        let done: Vec<(i32, i32)> = figures(&mut conn).await.into_values().collect();
        assert!(done.iter().all(|&(times_done, _)| times_done == 1), "{done:?}");
        // The closure's write to account 1 was rolled back with its job.
        let balances: Vec<i64> = accounts::table
            .filter(accounts::id.le(2))
            .order(accounts::id)
            .select(accounts::balance)
            .load(&mut conn)
            .await
            .unwrap();
        assert_eq!(balances, [101, 101]);
    }
}
