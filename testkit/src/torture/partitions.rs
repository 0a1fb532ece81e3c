//! Partitioned tables (22), on PostgreSQL and MariaDB: the drain on orders
//! partitioned by state, whose rows move between partitions under the
//! workers, and by time.

use std::time::Instant;

use diesel::connection::SimpleConnection;

use super::claiming::insert_numbered;
use super::{Ctx, Figures};

/// How scenario 22 partitions the orders.
#[derive(Clone, Copy, Debug)]
enum Partitioning {
    /// By the pending flag: sending the email moves the row to the other
    /// partition, under the feet of every worker that read it as a candidate.
    ByState,
    /// By the time the order was placed, in three months: rows stay put.
    ByTime,
}

impl Partitioning {
    /// The SQL replacing the shop's `orders` (and the `outbox` referencing
    /// it) on `backend` (`pg` or `mysql`) with a partitioned table of the
    /// same columns, `placed` added when partitioned by time. The partition
    /// key is in the primary key, as both servers require; MariaDB has no
    /// foreign keys on partitioned tables, so neither table has one there.
    fn orders_sql(self, backend: &str) -> String {
        let pg = backend == "pg";
        let (placed, key, partitions) = match (self, pg) {
            (Partitioning::ByState, true) => (
                "",
                "id, email_sent",
                "PARTITION BY LIST (email_sent);
                 CREATE TABLE orders_unsent PARTITION OF orders FOR VALUES IN (FALSE);
                 CREATE TABLE orders_sent PARTITION OF orders FOR VALUES IN (TRUE);",
            ),
            (Partitioning::ByState, false) => (
                "",
                "id, email_sent",
                "ENGINE = InnoDB PARTITION BY LIST (email_sent)
                     (PARTITION unsent VALUES IN (0), PARTITION sent VALUES IN (1));",
            ),
            (Partitioning::ByTime, true) => (
                "placed TIMESTAMP NOT NULL,",
                "id, placed",
                "PARTITION BY RANGE (placed);
                 CREATE TABLE orders_2026_01 PARTITION OF orders
                     FOR VALUES FROM (MINVALUE) TO ('2026-02-01');
                 CREATE TABLE orders_2026_02 PARTITION OF orders
                     FOR VALUES FROM ('2026-02-01') TO ('2026-03-01');
                 CREATE TABLE orders_2026_03 PARTITION OF orders
                     FOR VALUES FROM ('2026-03-01') TO (MAXVALUE);",
            ),
            (Partitioning::ByTime, false) => (
                "placed DATETIME NOT NULL,",
                "id, placed",
                "ENGINE = InnoDB PARTITION BY RANGE COLUMNS (placed) (
                     PARTITION orders_2026_01 VALUES LESS THAN ('2026-02-01'),
                     PARTITION orders_2026_02 VALUES LESS THAN ('2026-03-01'),
                     PARTITION orders_2026_03 VALUES LESS THAN (MAXVALUE));",
            ),
        };
        let (id, customer, serial, engine) = if pg {
            (
                "SERIAL",
                "INTEGER REFERENCES customers (id)",
                "SERIAL PRIMARY KEY",
                "",
            )
        } else {
            (
                "INTEGER AUTO_INCREMENT",
                "INTEGER",
                "INTEGER AUTO_INCREMENT PRIMARY KEY",
                "ENGINE = InnoDB",
            )
        };
        format!(
            "DROP TABLE outbox, orders;
             CREATE TABLE orders (
                 id {id} NOT NULL,
                 customer_id {customer},
                 shipped BOOLEAN NOT NULL DEFAULT TRUE,
                 email_sent BOOLEAN NOT NULL DEFAULT FALSE,
                 {placed}
                 PRIMARY KEY ({key})
             ) {partitions}
             CREATE INDEX orders_pending ON orders (email_sent, shipped, id);
             CREATE TABLE outbox (id {serial}, order_id INTEGER NOT NULL,
                 worker INTEGER NOT NULL) {engine};"
        )
    }

    /// Replaces the orders on `backend` as [`orders_sql`](Self::orders_sql)
    /// says, and inserts `rows` pending orders.
    fn recreate_orders(self, conn: &mut impl SimpleConnection, backend: &str, rows: usize) {
        conn.batch_execute(&self.orders_sql(backend))
            .unwrap_or_else(|e| panic!("cannot partition the orders {self:?}: {e}"));
        match self {
            Partitioning::ByState => {
                insert_numbered(conn, backend, rows, "orders (shipped)", "TRUE")
            }
            // Three months in turn, so that every partition holds candidates.
            Partitioning::ByTime => {
                let placed = if backend == "pg" {
                    "TIMESTAMP '2026-01-01' + (i % 3) * INTERVAL '1 month' + i * INTERVAL '1 second'"
                } else {
                    "TIMESTAMP '2026-01-01 00:00:00' + INTERVAL (i % 3) MONTH + INTERVAL i SECOND"
                };
                let select = format!("TRUE, {placed}");
                insert_numbered(conn, backend, rows, "orders (shipped, placed)", &select)
            }
        }
    }
}

on_row_lock_backends! {
    /// Scenario 22: the drain on partitioned orders, per row and in batches.
    /// When partitioned by state, each email moves its row to the other
    /// partition, and a worker locking a row another worker just moved must
    /// pass it over as gone: on PostgreSQL every call returns `Ok` on its
    /// first attempt, and the reports add up. MariaDB's claimers can deadlock
    /// there (a locking read of one waits on an index record of a row
    /// another is updating): those calls fail as `Error::Deadlock`, are
    /// retried and counted, and nothing else may fail.
    pub fn partitioned_drain(ctx: &Ctx) -> Figures {
        let rows = ctx.rows();
        let (threads, processes) = ctx.workers();
        let mut figures = Figures::new(threads, processes);
        for partitioning in [Partitioning::ByState, Partitioning::ByTime] {
            for batch in [1, 50] {
                let (_db, url, pool) = database(2, 0);
                partitioning.recreate_orders(&mut *pool.get().unwrap(), BACKEND, rows);
                let started = Instant::now();
                let mut round = Figures::default();
                let args = [("url", url), ("batch", batch.to_string())];
                for done in ctx.run_workers("drain", threads, processes, &args) {
                    round.absorb(&done);
                }
                let deadlocks = match BACKEND {
                    "mysql" => round.errors.get("Deadlock").copied().unwrap_or(0),
                    _ => 0,
                };
                round.check(
                    round.retries == deadlocks && round.errors.values().sum::<u64>() == deadlocks,
                    format!(
                        "{partitioning:?}, batch {batch}: calls failed ({} retried, errors {:?})",
                        round.retries, round.errors
                    ),
                );
                check_emails(&mut pool.get().unwrap(), &mut round, rows as u64);
                figures.note(format!(
                    "{partitioning:?}, batch {batch}: {:.1?}, {deadlocks} deadlocks retried",
                    started.elapsed()
                ));
                figures.merge(round);
            }
        }
        figures
    }
}
