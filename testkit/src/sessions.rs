//! Sessions ended from outside, and servers of their own, for the tests of
//! workers that go on through lost connections.

use diesel::prelude::*;

/// Ends every session of `database` on the server at `url` but the one this
/// opens for it (PostgreSQL `pg_terminate_backend`, MariaDB `KILL
/// CONNECTION`); how many it ended.
pub fn terminate_all_but_mine(url: &str, database: &str) -> usize {
    #[cfg(feature = "postgres")]
    if crate::url::is_postgres_url(url) {
        let mut conn = PgConnection::establish(url).unwrap();
        return diesel::sql_query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind::<diesel::sql_types::Text, _>(database)
        .execute(&mut conn)
        .unwrap();
    }
    #[cfg(feature = "mysql")]
    if crate::url::is_mysql_url(url) {
        use diesel::connection::SimpleConnection;

        #[derive(QueryableByName)]
        struct Id {
            #[diesel(sql_type = diesel::sql_types::Unsigned<diesel::sql_types::BigInt>)]
            id: u64,
        }
        let mut conn = MysqlConnection::establish(url).unwrap();
        let ids: Vec<Id> = diesel::sql_query(
            "SELECT id FROM information_schema.processlist \
             WHERE db = ? AND id <> CONNECTION_ID() AND command <> 'Daemon'",
        )
        .bind::<diesel::sql_types::Text, _>(database)
        .load(&mut conn)
        .unwrap();
        return ids
            .iter()
            .filter(|Id { id }| conn.batch_execute(&format!("KILL CONNECTION {id}")).is_ok())
            .count();
    }
    panic!("no server of a backend this build has at {url}")
}

/// PostgreSQL SQL that ends session `pid` and waits until it is gone (5 s at
/// most), as `pg_terminate_backend(pid, 5000)` does from PostgreSQL 14 on;
/// older servers' `pg_terminate_backend` only signals it. The activity
/// snapshot is cleared on each look, or the loop would read the first one
/// again.
pub fn terminate_and_wait_sql(pid: i64) -> String {
    format!(
        "DO $$ BEGIN \
           PERFORM pg_terminate_backend({pid}); \
           FOR attempt IN 1..500 LOOP \
             PERFORM pg_stat_clear_snapshot(); \
             EXIT WHEN NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = {pid}); \
             PERFORM pg_sleep(0.01); \
           END LOOP; \
         END $$"
    )
}

/// On PostgreSQL, waits (10 s at most) until a session of the database at
/// `url` waits for a lock: the first to wait is its deadlock's victim there.
/// Elsewhere it returns at once (InnoDB picks the victim by the rows written,
/// whoever waited first).
#[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
pub fn wait_for_a_lock_waiter(url: &str) {
    #[cfg(feature = "postgres")]
    if crate::url::is_postgres_url(url) {
        let mut conn = PgConnection::establish(url).unwrap();
        let waiters = diesel::dsl::sql::<diesel::sql_types::BigInt>(
            "(SELECT count(*) FROM pg_stat_activity \
              WHERE datname = current_database() AND wait_event_type = 'Lock')",
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while diesel::select(waiters.clone())
            .get_result::<i64>(&mut conn)
            .unwrap()
            == 0
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

/// A server of its own for `backend` (`pg` or `mysql`), and the URL of a
/// database on it to use.
pub fn private_server(backend: &str) -> (crate::PrivateServer, String) {
    match backend {
        #[cfg(feature = "postgres")]
        "pg" => {
            let server = crate::PrivateServer::postgres("");
            let url = server.url("postgres");
            (server, url)
        }
        #[cfg(feature = "mysql")]
        "mysql" => {
            use diesel::connection::SimpleConnection;

            let server = crate::PrivateServer::mariadb(&[]);
            MysqlConnection::establish(&server.admin_url)
                .unwrap()
                .batch_execute("CREATE DATABASE claim_test")
                .unwrap();
            let url = server.url("claim_test");
            (server, url)
        }
        other => panic!("no private server for {other:?}"),
    }
}
