//! PostgreSQL's partitioned tables (22): the drain on orders partitioned by
//! state, whose rows move between partitions under the workers, and by time.

use std::time::Instant;

use diesel::connection::SimpleConnection;
use diesel::PgConnection;

use super::claiming::on_postgres::{check_emails, database};
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
    /// Replaces the shop's `orders` (and the `outbox` referencing it) with a
    /// partitioned table of the same columns, and inserts `rows` pending
    /// orders. The partition key is in the primary key, as PostgreSQL requires.
    fn recreate_orders(self, conn: &mut PgConnection, rows: usize) {
        let (extra_column, key, partitions) = match self {
            Partitioning::ByState => (
                "",
                "id, email_sent",
                "PARTITION BY LIST (email_sent);
                 CREATE TABLE orders_unsent PARTITION OF orders FOR VALUES IN (FALSE);
                 CREATE TABLE orders_sent PARTITION OF orders FOR VALUES IN (TRUE);",
            ),
            Partitioning::ByTime => (
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
        };
        let placed = match self {
            Partitioning::ByState => "",
            // Three months in turn, so that every partition holds candidates.
            Partitioning::ByTime => {
                ", TIMESTAMP '2026-01-01' + (i % 3) * INTERVAL '1 month' + i * INTERVAL '1 second'"
            }
        };
        let placed_column = if placed.is_empty() { "" } else { ", placed" };
        conn.batch_execute(&format!(
            "DROP TABLE outbox, orders;
             CREATE TABLE orders (
                 id SERIAL,
                 customer_id INTEGER REFERENCES customers (id),
                 shipped BOOLEAN NOT NULL DEFAULT TRUE,
                 email_sent BOOLEAN NOT NULL DEFAULT FALSE,
                 {extra_column}
                 PRIMARY KEY ({key})
             ) {partitions}
             CREATE INDEX orders_pending ON orders (email_sent, shipped, id);
             CREATE TABLE outbox (id SERIAL PRIMARY KEY, order_id INTEGER NOT NULL,
                 worker INTEGER NOT NULL);
             INSERT INTO orders (shipped{placed_column})
                 SELECT TRUE{placed} FROM generate_series(1, {rows}) AS i;"
        ))
        .unwrap_or_else(|e| panic!("cannot partition the orders {self:?}: {e}"));
    }
}

/// Scenario 22: the drain on partitioned orders, per row and in batches. When
/// partitioned by state, each email moves its row to the other partition, and
/// a worker locking a row another worker just moved must pass it over as gone:
/// every call returns `Ok` on its first attempt, and the reports add up.
pub fn partitioned_drain(ctx: &Ctx) -> Figures {
    let rows = ctx.rows();
    let (threads, processes) = ctx.workers();
    let mut figures = Figures::new(threads, processes);
    for partitioning in [Partitioning::ByState, Partitioning::ByTime] {
        for batch in [1, 50] {
            let (_db, url, pool) = database(2, 0);
            partitioning.recreate_orders(&mut pool.get().unwrap(), rows);
            let started = Instant::now();
            let mut round = Figures::default();
            let args = [("url", url), ("batch", batch.to_string())];
            for done in ctx.run_workers("drain", threads, processes, &args) {
                round.absorb(&done);
            }
            round.check(
                round.retries == 0 && round.errors.is_empty(),
                format!(
                    "{partitioning:?}, batch {batch}: calls failed ({} retried, errors {:?})",
                    round.retries, round.errors
                ),
            );
            check_emails(&mut pool.get().unwrap(), &mut round, rows as u64);
            figures.note(format!(
                "{partitioning:?}, batch {batch}: {:.1?}",
                started.elapsed()
            ));
            figures.merge(round);
        }
    }
    figures
}
