//! Retries scheduled in the rows, on diesel-async: four loops on a bb8 pool
//! keep each failing job's schedule by the database's clock, record its
//! attempts and error under its lock, and leave it a dead letter.

use std::sync::Mutex;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{ExpressionMethods, QueryDsl, SelectableHelper};
use diesel_async::pooled_connection::{bb8, AsyncDieselConnectionManager};
use diesel_async::RunQueryDsl;
use diesel_claim::aio::prelude::*;
use diesel_claim::{Error, Retries, StopHandle};

use crate::retries::{assert_runs_kept_the_schedule, Run};

on_async_backends! {
    diesel::table! {
        use diesel::sql_types::*;
        use super::ClaimStamp;

        queued (id) {
            id -> Integer,
            attempts -> Integer,
            run_at -> ClaimStamp,
            last_error -> Nullable<Text>,
            done -> Bool,
        }
    }

    #[derive(Debug, Clone, diesel::Queryable, diesel::Selectable, diesel::Identifiable)]
    #[diesel(table_name = queued)]
    struct Queued {
        id: i32,
    }

    /// The database's clock now, in microseconds since the Unix epoch.
    async fn db_now(conn: &mut Conn) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct Now {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            now: i64,
        }
        let sql = if BACKEND == "pg" {
            "SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::int8 AS now"
        } else {
            "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) AS now"
        };
        diesel::sql_query(sql).get_result::<Now>(conn).await.unwrap().now
    }

    /// Four loops on a pool run six jobs: five fail on every attempt, one
    /// succeeds. Each failing job runs its three attempts no sooner than its
    /// delays after the run before, by the database's clock, and ends a dead
    /// letter with its error; the other is done once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn loops_keep_each_failing_jobs_schedule() {
        let db = TestDb::new();
        let now = if BACKEND == "pg" { "now()" } else { "(UTC_TIMESTAMP(6))" };
        blocking(&db.url)
            .batch_execute(&format!(
                "CREATE TABLE queued (id INTEGER PRIMARY KEY, attempts INTEGER NOT NULL DEFAULT 0, \
                     run_at {CLAIM_STAMP_COLUMN} NOT NULL DEFAULT {now}, last_error TEXT, \
                     done BOOLEAN NOT NULL DEFAULT FALSE);
                 INSERT INTO queued (id) VALUES (1), (2), (3), (4), (5), (6);"
            ))
            .unwrap();
        let pool = bb8::Pool::builder()
            .max_size(5)
            .build(crate::aio::pooled::manager(&db.url, BACKEND == "mysql"))
            .await
            .unwrap();
        let delays = [Duration::from_millis(200), Duration::from_millis(400)];
        let runs = Mutex::new(Vec::<Run>::new());
        let stop = StopHandle::new();
        let report = queued::table
            .filter(queued::done.eq(false))
            .select(Queued::as_select())
            .build_claim()
            .retries(
                Retries::new(queued::attempts, queued::run_at)
                    .last_error(queued::last_error)
                    .max_attempts(3)
                    .schedule(delays),
            )
            .then_update(queued::done.eq(true))
            .worker(&stop)
            .concurrency(4)
            .poll_interval(Duration::from_millis(2), Duration::from_millis(10))
            .run_pooled(&pool, async |conn: &mut Conn, job: Queued| {
                if job.id == 6 {
                    return Ok(());
                }
                let started = db_now(conn).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                let ended = db_now(conn).await;
                let mut runs = runs.lock().unwrap();
                runs.push((job.id, started, ended));
                if runs.len() == 15 {
                    stop.stop();
                }
                Err(Error::InvalidArgument(format!("job {} fails", job.id)))
            })
            .await
            .unwrap();
        assert_eq!((report.processed, report.failed), (1, 15));
        assert_runs_kept_the_schedule(&runs.into_inner().unwrap(), 5, &delays, 3, 0);
        let recorded: Vec<(i32, Option<String>, bool)> = queued::table
            .order(queued::id)
            .select((queued::attempts, queued::last_error, queued::done))
            .load(&mut pool.get().await.unwrap())
            .await
            .unwrap();
        for (id, (attempts, error, done)) in (1..).zip(recorded) {
            if id == 6 {
                assert_eq!((attempts, error, done), (0, None, true));
            } else {
                assert_eq!((attempts, error, done), (3, Some(format!("invalid argument: job {id} fails")), false));
            }
        }
    }
}
