//! Partitioned queue tables, on PostgreSQL and MariaDB: a row its finisher
//! moves to another partition is gone for every other claimer, not an error.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{ClaimReport, Error};

diesel::table! {
    /// Partitioned by `done` (list) or by `created` (range): the partition
    /// key is in the primary key, as PostgreSQL and MariaDB require of a
    /// partitioned table's unique keys.
    tasks (id, done) {
        id -> Integer,
        done -> Bool,
        created -> Integer,
    }
}

diesel::table! {
    /// The same table, keyed by `id` alone (unique in practice): the key a
    /// claim follows its rows by then stays when a mark sets `done`.
    #[sql_name = "tasks"]
    tasks_by_id (id) {
        id -> Integer,
        done -> Bool,
        created -> Integer,
    }
}

diesel::table! {
    task_log (id) {
        id -> Integer,
        task_id -> Integer,
    }
}

#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = tasks, primary_key(id, done))]
struct Task {
    id: i32,
    done: bool,
    #[allow(dead_code)]
    created: i32,
}

#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = tasks_by_id)]
struct TaskById {
    id: i32,
    #[allow(dead_code)]
    done: bool,
    #[allow(dead_code)]
    created: i32,
}

/// The two ways queues are partitioned: by their own state, so that finishing
/// a task moves it, and by time, so that it stays.
#[derive(Debug, Clone, Copy)]
enum Partitioning {
    ByState,
    ByTime,
}

fn pending() -> diesel::dsl::Filter<tasks::table, diesel::dsl::Eq<tasks::done, bool>> {
    tasks::table.filter(tasks::done.eq(false))
}

const ROWS: i32 = 3_000;
const WORKERS: usize = 6;

/// Expands the tests for each backend with partitioned tables, in modules
/// `pg` and `mysql`, with `Conn`, `queue(partitioning, rows, pool size)`, and
/// `AsyncConn`.
macro_rules! on_partitioned_backends {
    (@backend $module:ident, $feature:literal, $conn:ty, $async_conn:ty, $test_db:ident,
        $pool:ident, $schema:expr, $log:literal, $session:literal, $($tests:tt)*) => {
        #[cfg(feature = $feature)]
        mod $module {
            use super::*;
            use testkit::{$pool, $test_db};

            type Conn = $conn;
            /// What each claimer's session sets first.
            const CLAIMER_SESSION: &str = $session;
            #[cfg(feature = "async")]
            type AsyncConn = $async_conn;
            type Pool = diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<Conn>>;

            /// A database whose `tasks` are partitioned as asked, holding
            /// tasks `1..=rows`, and a pool on it.
            fn queue(partitioning: Partitioning, rows: i32, pool_size: u32) -> ($test_db, Pool) {
                let db = $test_db::new();
                let pool = $pool(&db.url, pool_size);
                let mut conn = pool.get().unwrap();
                let schema: fn(Partitioning) -> &'static str = $schema;
                conn.batch_execute(schema(partitioning)).unwrap();
                conn.batch_execute($log).unwrap();
                let tasks: Vec<_> = (1..=rows)
                    .map(|id| (tasks::id.eq(id), tasks::created.eq(id)))
                    .collect();
                for chunk in tasks.chunks(500) {
                    diesel::insert_into(tasks::table).values(chunk).execute(&mut conn).unwrap();
                }
                (db, pool)
            }

            $($tests)*
        }
    };
    ($($tests:tt)*) => {
        on_partitioned_backends!(@backend pg, "postgres", PgConnection,
            diesel_async::AsyncPgConnection, PgTestDb, pg_pool,
            |partitioning| match partitioning {
                Partitioning::ByState => {
                    "CREATE TABLE tasks (id INTEGER NOT NULL, done BOOLEAN NOT NULL DEFAULT FALSE,
                         created INTEGER NOT NULL, PRIMARY KEY (id, done)) PARTITION BY LIST (done);
                     CREATE TABLE tasks_pending PARTITION OF tasks FOR VALUES IN (FALSE);
                     CREATE TABLE tasks_done PARTITION OF tasks FOR VALUES IN (TRUE);"
                }
                Partitioning::ByTime => {
                    "CREATE TABLE tasks (id INTEGER NOT NULL, done BOOLEAN NOT NULL DEFAULT FALSE,
                         created INTEGER NOT NULL, PRIMARY KEY (id, done, created))
                         PARTITION BY RANGE (created);
                     CREATE TABLE tasks_early PARTITION OF tasks FOR VALUES FROM (0) TO (500);
                     CREATE TABLE tasks_late PARTITION OF tasks FOR VALUES FROM (500) TO (1000000);"
                }
            },
            "CREATE TABLE task_log (id SERIAL PRIMARY KEY, task_id INTEGER NOT NULL);",
            "",
            $($tests)*);
        on_partitioned_backends!(@backend mysql, "mysql", diesel::MysqlConnection,
            diesel_async::AsyncMysqlConnection, MysqlTestDb, mysql_pool,
            |partitioning| match partitioning {
                Partitioning::ByState => {
                    "CREATE TABLE tasks (id INTEGER NOT NULL, done BOOLEAN NOT NULL DEFAULT FALSE,
                         created INTEGER NOT NULL, PRIMARY KEY (id, done)) ENGINE = InnoDB
                         PARTITION BY LIST (done)
                         (PARTITION pending VALUES IN (0), PARTITION finished VALUES IN (1));"
                }
                Partitioning::ByTime => {
                    "CREATE TABLE tasks (id INTEGER NOT NULL, done BOOLEAN NOT NULL DEFAULT FALSE,
                         created INTEGER NOT NULL, PRIMARY KEY (id, done, created)) ENGINE = InnoDB
                         PARTITION BY RANGE (created)
                         (PARTITION early VALUES LESS THAN (500), PARTITION late VALUES LESS THAN MAXVALUE);"
                }
            },
            "CREATE TABLE task_log (id INTEGER AUTO_INCREMENT PRIMARY KEY, task_id INTEGER NOT NULL)
                 ENGINE = InnoDB;",
            // As the crate recommends for claimers on InnoDB.
            "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
            $($tests)*);
    };
}

on_partitioned_backends! {
    /// Logs the task and finishes it (which, partitioned by state, moves it).
    fn finish(conn: &mut Conn, task: &Task) -> QueryResult<()> {
        diesel::insert_into(task_log::table)
            .values(task_log::task_id.eq(task.id))
            .execute(conn)?;
        diesel::update(tasks::table.filter(tasks::id.eq(task.id)))
            .set(tasks::done.eq(true))
            .execute(conn)?;
        Ok(())
    }

    /// `(log rows, tasks logged twice, tasks left pending)`.
    fn figures(conn: &mut Conn) -> (i64, i64, i64) {
        let logged: i64 = task_log::table.count().get_result(conn).unwrap();
        let distinct = task_log::table
            .select(task_log::task_id)
            .distinct()
            .load::<i32>(conn)
            .unwrap()
            .len() as i64;
        let left: i64 = pending().count().get_result(conn).unwrap();
        (logged, logged - distinct, left)
    }

    /// Six workers drain the queue, per row, in batches, marked and marked
    /// and committed (where a mark may set a key column): every call returns
    /// `Ok`, the reports add up to the rows, none twice, none left.
    #[test]
    fn rows_moved_to_another_partition_are_gone_not_errors() {
        for partitioning in [Partitioning::ByState, Partitioning::ByTime] {
            let (_db, pool) = queue(partitioning, ROWS, WORKERS as u32 + 1);
            let start = std::sync::Barrier::new(WORKERS);
            let reports: Vec<Result<ClaimReport, Error>> = std::thread::scope(|scope| {
                let workers: Vec<_> = (0..WORKERS)
                    .map(|worker| {
                        let (pool, start) = (&pool, &start);
                        scope.spawn(move || {
                            let mut pooled = pool.get().unwrap();
                            let conn: &mut Conn = &mut pooled;
                            if !CLAIMER_SESSION.is_empty() {
                                conn.batch_execute(CLAIMER_SESSION).unwrap();
                            }
                            start.wait();
                            let claim = pending().build_claim().drain();
                            let log = |conn: &mut Conn, task: TaskById| {
                                diesel::insert_into(task_log::table)
                                    .values(task_log::task_id.eq(task.id))
                                    .execute(conn)?;
                                Ok::<_, Error>(())
                            };
                            let by_id = tasks_by_id::table
                                .filter(tasks_by_id::done.eq(false))
                                .build_claim()
                                .drain()
                                .batch(10);
                            match worker % 4 {
                                0 => claim.each(conn, |conn, task: Task| {
                                    finish(conn, &task).map_err(Error::from)
                                }),
                                1 => claim.batch(10).each(conn, |conn, task: Task| {
                                    finish(conn, &task).map_err(Error::from)
                                }),
                                2 => by_id.mark(tasks_by_id::done.eq(true)).each(conn, log),
                                _ => by_id
                                    .mark_and_commit(tasks_by_id::done.eq(true))
                                    .each(conn, log),
                            }
                        })
                    })
                    .collect();
                workers.into_iter().map(|w| w.join().unwrap()).collect()
            });
            let failed: Vec<_> = reports.iter().filter_map(|r| r.as_ref().err()).collect();
            assert!(failed.is_empty(), "{partitioning:?}: {failed:?}");
            let processed: u64 = reports.iter().map(|r| r.as_ref().unwrap().processed).sum();
            let figures = figures(&mut pool.get().unwrap());
            assert_eq!(
                (processed, figures),
                (ROWS as u64, (ROWS as i64, 0, 0)),
                "{partitioning:?}"
            );
        }
    }

    /// Moves task `id` to the done partition in a transaction of another
    /// connection, which holds the row's lock for 300 ms before it commits.
    fn move_away_soon(pool: &Pool, id: i32) -> std::thread::JoinHandle<()> {
        let mut mover = pool.get().unwrap();
        mover
            .batch_execute(&format!("BEGIN; UPDATE tasks SET done = TRUE WHERE id = {id}"))
            .unwrap();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            mover.batch_execute("COMMIT").unwrap();
        })
    }

    /// A mark that sets a column of the claimed table's key is refused before
    /// any SQL: the claim follows its rows by their keys (and MySQL reads
    /// marked rows back by them).
    #[test]
    fn a_mark_of_a_key_column_is_refused() {
        let (_db, pool) = queue(Partitioning::ByState, 3, 1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        let marked = pending()
            .build_claim()
            .mark(tasks::done.eq(true))
            .each(conn, |_, _: Task| Ok::<_, Error>(()));
        assert!(
            matches!(&marked, Err(Error::InvalidArgument(m)) if m.contains("primary key")),
            "{marked:?}"
        );
        assert_eq!(figures(conn), (0, 0, 3));
    }

    /// A row lock whose row its holder moves to another partition before
    /// letting go: the waiting `with_lock` reads again and finds no row,
    /// `NotFound` (on PostgreSQL, rather than a serialization failure). A row
    /// that stays is locked.
    #[test]
    fn a_lock_on_a_row_moved_away_is_not_found() {
        let (_db, pool) = queue(Partitioning::ByState, 2, 2);
        let mut conn = pool.get().unwrap();
        let committer = move_away_soon(&pool, 1);
        // Waits for the mover's lock, then meets the row gone from the
        // pending partition.
        let moved = pending()
            .filter(tasks::id.eq(1))
            .with_lock(&mut conn, |_, task: Task| Ok::<_, Error>(task.id));
        committer.join().unwrap();
        assert!(matches!(moved, Err(Error::NotFound)), "{moved:?}");
        let stayed = pending()
            .filter(tasks::id.eq(2))
            .with_lock(&mut conn, |conn, task: Task| {
                finish(conn, &task)?;
                Ok::<_, Error>(task.id)
            });
        assert_eq!(stayed.unwrap(), 2);
    }

    /// The async `with_lock` on a row its holder moves away: `NotFound`.
    #[cfg(feature = "async")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_async_lock_on_a_row_moved_away_is_not_found() {
        use diesel_async::AsyncConnection;

        let (db, pool) = queue(Partitioning::ByState, 1, 1);
        let committer = move_away_soon(&pool, 1);
        let mut conn = AsyncConn::establish(&db.url).await.unwrap();
        let moved = diesel_claim::aio::LockDsl::with_lock(
            pending().filter(tasks::id.eq(1)),
            &mut conn,
            async |_: &mut AsyncConn, task: Task| { Ok::<_, Error>(task.id) },
        )
        .await;
        committer.join().unwrap();
        assert!(matches!(moved, Err(Error::NotFound)), "{moved:?}");
    }

    /// The async claim on a queue partitioned by state: tasks drain it, per
    /// row and in batches, every call `Ok`, each task once.
    #[cfg(feature = "async")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn async_claims_pass_over_rows_moved_away() {
        use diesel_async::pooled_connection::{bb8, AsyncDieselConnectionManager};

        let (db, _blocking) = queue(Partitioning::ByState, ROWS, 1);
        let manager = AsyncDieselConnectionManager::<AsyncConn>::new(db.url.clone());
        let pool = bb8::Pool::builder().max_size(WORKERS as u32).build(manager).await.unwrap();
        let tasks: Vec<_> = (0..WORKERS)
            .map(|worker| {
                let pool = pool.clone();
                tokio::spawn(async move {
                    let mut conn = pool.get_owned().await.unwrap();
                    if !CLAIMER_SESSION.is_empty() {
                        diesel_async::SimpleAsyncConnection::batch_execute(&mut *conn, CLAIMER_SESSION)
                            .await
                            .unwrap();
                    }
                    let claim = diesel_claim::aio::ClaimDsl::build_claim(pending()).drain();
                    let claim = if worker % 2 == 0 { claim } else { claim.batch(10) };
                    claim
                        .each(&mut *conn, async |conn: &mut AsyncConn, task: Task| {
                            diesel_async::RunQueryDsl::execute(
                                diesel::insert_into(task_log::table)
                                    .values(task_log::task_id.eq(task.id)),
                                conn,
                            )
                            .await?;
                            diesel_async::RunQueryDsl::execute(
                                diesel::update(tasks::table.filter(tasks::id.eq(task.id)))
                                    .set(tasks::done.eq(true)),
                                conn,
                            )
                            .await?;
                            Ok::<_, Error>(())
                        })
                        .await
                })
            })
            .collect();
        let mut processed = 0;
        for task in tasks {
            processed += task.await.unwrap().unwrap().processed;
        }
        let figures = figures(&mut <Conn as Connection>::establish(&db.url).unwrap());
        assert_eq!((processed, figures), (ROWS as u64, (ROWS as i64, 0, 0)));
    }
}
