//! A PostgreSQL queue table kept as a ring of partitions, whose done jobs
//! are truncated away instead of left for vacuum.
//!
//! Every job a worker finishes and deletes leaves a dead row version behind,
//! and an index entry pointing at it. Vacuum removes them, but only those
//! older than every open transaction: while one transaction stays open
//! elsewhere (an analytics query, a forgotten `BEGIN` in a console, a
//! replica's feedback), nothing is removed, and the queue's table and index
//! grow with every job done. `TRUNCATE` does not wait for that horizon: it
//! replaces a table's files at once. A [`Ring`] makes that usable for a
//! queue. The table is partitioned by a slot column into a ring of
//! partitions; each new job goes to the slot of its place in the order of
//! insertion (a sequence's value, [`slot_size`](Ring::slot_size) jobs a
//! slot); once the jobs of a slot are done, [`Ring::rotate`] truncates it.
//! Its dead rows, however many, go with it.
//!
//! ```sql
//! -- Your migration: the queue, partitioned by its slot. The ring adds the
//! -- partitions, a sequence, and the slot's default.
//! CREATE TABLE jobs (
//!     id BIGSERIAL,
//!     slot SMALLINT NOT NULL,
//!     payload TEXT NOT NULL,
//!     PRIMARY KEY (id, slot)
//! ) PARTITION BY LIST (slot);
//! ```
//!
//! ```
//! use diesel::prelude::*;
//! use diesel_claim::prelude::*;
//! use diesel_claim::ring::Ring;
//!
//! diesel::table! {
//!     jobs (id, slot) {
//!         id -> BigInt,
//!         slot -> SmallInt,
//!         payload -> Text,
//!     }
//! }
//!
//! #[derive(Queryable, Selectable, Identifiable)]
//! #[diesel(primary_key(id, slot))]
//! struct Job {
//!     id: i64,
//!     slot: i16,
//!     payload: String,
//! }
//!
//! # fn main() -> Result<(), diesel_claim::Error> {
//! # use diesel::connection::SimpleConnection;
//! # let mut conn = PgConnection::establish(&diesel_claim_testkit::pg_url()).unwrap();
//! # conn.batch_execute(
//! #     "SET search_path TO pg_temp;
//! #      CREATE TABLE jobs (id BIGSERIAL, slot SMALLINT NOT NULL, payload TEXT NOT NULL,
//! #          PRIMARY KEY (id, slot)) PARTITION BY LIST (slot);",
//! # )?;
//! let ring = Ring::new("jobs");
//! ring.create(&mut conn)?; // at start: it does nothing the second time
//!
//! diesel::insert_into(jobs::table)
//!     .values(jobs::payload.eq("send the invoice"))
//!     .execute(&mut conn)?;
//! let report = jobs::table
//!     .select(Job::as_select())
//!     .build_claim()
//!     .then_delete()
//!     .each(&mut conn, |_, job: Job| {
//!         println!("{} (slot {})", job.payload, job.slot);
//!         Ok::<_, diesel_claim::Error>(())
//!     })?;
//! assert_eq!(report.processed, 1);
//!
//! // Every second or so, from one thread of the service (or of each of its
//! // processes: rotations of one ring take turns):
//! let rotation = ring.rotate(&mut conn)?;
//! assert!(!rotation.busy);
//! # Ok(())
//! # }
//! ```
//!
//! What a ring asks of its queue, and the caveats:
//!
//! - **Jobs are deleted when done** ([`then_delete`](crate::ClaimBuilder::then_delete),
//!   or your closure deletes them). A slot is truncated only when every job
//!   in it is done; rows kept as done would keep their slot forever.
//! - **The ring holds the queue's usual depth**: `slots × slot_size` jobs
//!   (8 × 2,000 by default) span the ring, and jobs are taken roughly in
//!   their order of insertion. A slot still holding more than
//!   [`max_moved`](Ring::max_moved) jobs is not truncated; when the queue
//!   is deeper than the ring, no slot drains, and the queue's dead rows are
//!   left to vacuum as in a table of one partition.
//! - **Stragglers move on.** A slot's last few jobs (one waiting for its
//!   retry, a dead letter, up to [`max_moved`](Ring::max_moved)) are moved to
//!   the current slot (`UPDATE … SET slot = DEFAULT`) in the transaction that
//!   truncates the slot: they keep their key's other columns and everything
//!   else. Keep dead letters few, or move them to a table of their own.
//! - **A rotation waits for the transactions that read the queue.** It
//!   needs the drained slots' partitions to itself (`ACCESS EXCLUSIVE`), and
//!   a take from the queue reads every partition, so it waits until the
//!   transactions in flight end, and the takes that start meanwhile wait
//!   behind it: once per call, for all the slots it truncates, at most
//!   [`lock_timeout`](Ring::lock_timeout) (100 ms by default), after which
//!   it gives up until its next call ([`Rotation::busy`]). Jobs that run
//!   for long in their row's lock (the default claim) hold the ring back
//!   for as long: give long jobs a
//!   [visibility timeout](crate::ClaimBuilder::visibility_timeout), whose
//!   claims commit before the job runs.
//! - **`TRUNCATE` is not MVCC-safe**: a transaction that took its snapshot
//!   before a truncation and reads the slot's partition only afterwards
//!   sees it empty. A queue's done jobs are what it would have missed.
//! - **MariaDB** has no such need: InnoDB's purge removes deleted rows once
//!   no read view needs them, and an index scan passes over delete-marked
//!   entries without visiting their rows. A long transaction there holds
//!   purge back in the same way (the history list grows), and the guide's
//!   MySQL section says what that costs.

use std::time::Duration;

use diesel::connection::LoadConnection;
use diesel::pg::Pg;
use diesel::sql_types::{BigInt, Text};
use diesel::{QueryableByName, RunQueryDsl};

use crate::lease::advisory;
use crate::transaction::transaction_depth;
use crate::Error;

/// The longest name PostgreSQL keeps: longer ones are cut, and two
/// partitions' names could then be one.
const MAX_IDENTIFIER_LEN: usize = 63;

/// A queue table partitioned into a ring of slots by insertion order, whose
/// drained slots [`rotate`](Self::rotate) truncates: see the
/// [module](self).
///
/// The partitions are `<table>_slot_0` to `<table>_slot_<n - 1>`, the
/// sequence `<table>_slot_seq`; the table is named as it is in the
/// database (unquoted, on the connection's `search_path`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ring {
    table: String,
    slot_column: String,
    slots: u16,
    slot_size: u32,
    max_moved: u32,
    lock_timeout: Duration,
}

/// What one [`Ring::rotate`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rotation {
    /// Slots truncated.
    pub truncated: u32,
    /// Jobs moved from the truncated slots to the current one.
    pub moved: u64,
    /// Slots holding more than [`Ring::max_moved`] jobs still to do, left
    /// as they are.
    pub full: u32,
    /// Whether the rotation could not have the drained slots to itself
    /// within [`Ring::lock_timeout`] (or another rotation of the same ring
    /// was under way): the next call tries again.
    pub busy: bool,
}

impl Ring {
    /// The ring of the table `table`, partitioned by `LIST (slot)`: 8 slots
    /// of 2,000 jobs.
    pub fn new(table: &str) -> Ring {
        Ring {
            table: table.to_owned(),
            slot_column: "slot".to_owned(),
            slots: 8,
            slot_size: 2_000,
            max_moved: 100,
            lock_timeout: Duration::from_millis(100),
        }
    }

    /// The column the table is partitioned by (`slot` by default): an
    /// integer column, `NOT NULL`, whose default the ring sets.
    pub fn slot_column(mut self, column: &str) -> Ring {
        self.slot_column = column.to_owned();
        self
    }

    /// How many slots the ring has, at least 3 (8 by default). Every take
    /// of the queue looks into each slot's index, so more slots cost every
    /// take a little; fewer hold less of a backlog.
    pub fn slots(mut self, slots: u16) -> Ring {
        self.slots = slots;
        self
    }

    /// How many jobs, in order of insertion, go to one slot before the next
    /// (2,000 by default): about as many dead rows as a slot leaves until
    /// it is truncated.
    pub fn slot_size(mut self, jobs: u32) -> Ring {
        self.slot_size = jobs;
        self
    }

    /// How many jobs still to do a slot may hold and yet be truncated, the
    /// jobs moved to the current slot first (100 by default).
    pub fn max_moved(mut self, jobs: u32) -> Ring {
        self.max_moved = jobs;
        self
    }

    /// How long a rotation waits to have the drained slots to itself (100 ms
    /// by default), while the takes that start meanwhile wait behind it.
    pub fn lock_timeout(mut self, timeout: Duration) -> Ring {
        self.lock_timeout = timeout;
        self
    }

    /// Creates what the ring needs beside your table: its sequence, the
    /// slot column's default, and a partition for each slot. Does nothing
    /// that is already there, so it can run at every start; a slot size
    /// changed since applies to the jobs inserted from then on. Processes
    /// that create one ring at once take turns.
    ///
    /// [`Error::InvalidArgument`] if the table is not partitioned by
    /// `LIST` on the slot column alone, has partitions other than the
    /// ring's (a ring of another number of slots among them), or if the
    /// ring's names would be longer than PostgreSQL keeps.
    pub fn create<C>(&self, conn: &mut C) -> Result<(), Error>
    where
        C: LoadConnection<Backend = Pg>,
    {
        self.check()?;
        conn.transaction(|conn| {
            // Replicas of a service starting together create the ring one
            // after the other: the others find it there.
            advisory::lock(conn, &self.lock_name())?;
            self.check_table(conn)?;
            let sequence = self.sequence();
            diesel::sql_query(format!(
                "CREATE SEQUENCE IF NOT EXISTS {}",
                quoted(&sequence)
            ))
            .execute(conn)?;
            diesel::sql_query(format!(
                "ALTER TABLE {} ALTER COLUMN {} SET DEFAULT ((nextval({}::regclass) / {}) % {})",
                quoted(&self.table),
                quoted(&self.slot_column),
                literal(&quoted(&sequence)),
                self.slot_size,
                self.slots,
            ))
            .execute(conn)?;
            for slot in 0..self.slots {
                diesel::sql_query(format!(
                    "CREATE TABLE IF NOT EXISTS {} PARTITION OF {} FOR VALUES IN ({slot})",
                    quoted(&self.partition(slot)),
                    quoted(&self.table),
                ))
                .execute(conn)?;
            }
            Ok(())
        })
    }

    /// Truncates the slots whose jobs are done, all in one transaction: it
    /// takes their partitions to itself (waiting at most
    /// [`lock_timeout`](Self::lock_timeout)), checks under that lock that
    /// each holds at most [`max_moved`](Self::max_moved) jobs and is not the
    /// slot new jobs go to, moves those jobs to the current slot, and
    /// truncates the slots. Slots with nothing to reclaim are passed over
    /// without a lock.
    ///
    /// Call it every second or so, on a connection of its own (a pool's):
    /// each call holds the queue's takes back while it waits for the
    /// transactions in flight to end, once for all the slots it truncates.
    /// One rotation of a ring runs at a time, across processes; another
    /// called meanwhile returns at once ([`Rotation::busy`]).
    /// [`Error::InvalidArgument`] inside a transaction, which would keep
    /// the partitions locked until it ends.
    pub fn rotate<C>(&self, conn: &mut C) -> Result<Rotation, Error>
    where
        C: LoadConnection<Backend = Pg>,
    {
        self.check()?;
        if transaction_depth(conn)? > 0 {
            return Err(Error::InvalidArgument(
                "a ring's rotation runs in transactions of its own, not inside one".to_owned(),
            ));
        }
        let mut rotation = Rotation::default();
        let current = self.current_slot(conn)?;
        let mut drained = Vec::new();
        for slot in (0..self.slots).filter(|&slot| slot != current) {
            let state = diesel::sql_query(format!(
                "SELECT pg_relation_size({}::regclass) AS bytes, {} AS jobs",
                literal(&quoted(&self.partition(slot))),
                self.count_jobs(slot),
            ))
            .get_result::<SlotState>(conn)?;
            if state.jobs > i64::from(self.max_moved) {
                rotation.full += 1;
            } else if state.bytes > 0 {
                drained.push(slot);
            }
        }
        if drained.is_empty() {
            return Ok(rotation);
        }
        match conn.transaction(|conn| self.truncate(conn, &drained, &mut rotation)) {
            Ok(()) => {}
            Err(Error::LockNotAvailable) => rotation.busy = true,
            Err(error) => return Err(error),
        }
        Ok(rotation)
    }

    /// Truncates the `drained` slots that still are under their lock, in
    /// the transaction `conn` is in, and counts what it did in `rotation`.
    fn truncate<C>(
        &self,
        conn: &mut C,
        drained: &[u16],
        rotation: &mut Rotation,
    ) -> Result<(), Error>
    where
        C: LoadConnection<Backend = Pg>,
    {
        // Milliseconds, as the setting counts them; at least one, since 0
        // would mean waiting for ever.
        let wait = self.lock_timeout.as_millis().clamp(1, u128::from(u32::MAX));
        diesel::sql_query(format!("SET LOCAL lock_timeout = {wait}")).execute(conn)?;
        if !advisory::try_lock(conn, &self.lock_name())? {
            rotation.busy = true;
            return Ok(());
        }
        let partitions = |slots: &[u16]| {
            slots
                .iter()
                .map(|&slot| quoted(&self.partition(slot)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        diesel::sql_query(format!(
            "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
            partitions(drained)
        ))
        .execute(conn)?;
        // Under the lock no job can be inserted into these slots, taken from
        // them or committed to them: what is counted now is what would be
        // lost.
        let current = self.current_slot(conn)?;
        let mut truncated = Vec::new();
        let mut jobs = 0;
        for &slot in drained.iter().filter(|&&slot| slot != current) {
            let left = diesel::sql_query(format!("SELECT {} AS jobs", self.count_jobs(slot)))
                .get_result::<Jobs>(conn)?
                .jobs;
            if left > i64::from(self.max_moved) {
                rotation.full += 1;
            } else {
                truncated.push(slot);
                jobs += left;
            }
        }
        if truncated.is_empty() {
            return Ok(());
        }
        let slots = truncated
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        if jobs > 0 {
            rotation.moved = diesel::sql_query(format!(
                "UPDATE {} SET {column} = DEFAULT WHERE {column} IN ({slots})",
                quoted(&self.table),
                column = quoted(&self.slot_column),
            ))
            .execute(conn)? as u64;
            // The default is the slot of the next insertion: had the ring
            // come round to one of these slots meanwhile, jobs would be back
            // in it, and truncated with it.
            let back = diesel::sql_query(format!(
                "SELECT count(*) AS jobs FROM {} WHERE {} IN ({slots})",
                quoted(&self.table),
                quoted(&self.slot_column),
            ))
            .get_result::<Jobs>(conn)?
            .jobs;
            if back > 0 {
                return Err(Error::UnexpectedOutcome(format!(
                    "jobs moved out of the drained slots of the ring of {} came back to them",
                    self.table
                )));
            }
        }
        diesel::sql_query(format!("TRUNCATE {}", partitions(&truncated))).execute(conn)?;
        rotation.truncated = truncated.len() as u32;
        Ok(())
    }

    /// An expression counting the jobs in `slot`, up to one more than
    /// [`max_moved`](Self::max_moved).
    fn count_jobs(&self, slot: u16) -> String {
        format!(
            "(SELECT count(*) FROM (SELECT FROM {} LIMIT {}) AS kept)",
            quoted(&self.partition(slot)),
            u64::from(self.max_moved) + 1,
        )
    }

    /// The slot the last job inserted went to.
    fn current_slot<C>(&self, conn: &mut C) -> Result<u16, Error>
    where
        C: LoadConnection<Backend = Pg>,
    {
        let last = diesel::sql_query(format!(
            "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END AS last \
             FROM {}",
            quoted(&self.sequence())
        ))
        .get_result::<Last>(conn)?
        .last;
        let slot = last.max(0) / i64::from(self.slot_size) % i64::from(self.slots);
        Ok(slot as u16)
    }

    /// Checks the table is partitioned as a ring needs, and has no
    /// partitions but the ring's.
    fn check_table<C>(&self, conn: &mut C) -> Result<(), Error>
    where
        C: LoadConnection<Backend = Pg>,
    {
        let partitioned = diesel::sql_query(
            "SELECT p.partstrat::text AS strategy, \
             array_to_string(ARRAY(SELECT a.attname::text FROM unnest(p.partattrs::int2[]) \
             AS k(attnum) LEFT JOIN pg_attribute a ON a.attrelid = p.partrelid \
             AND a.attnum = k.attnum), ',') AS columns, \
             ARRAY(SELECT c.relname::text FROM pg_inherits i JOIN pg_class c \
             ON c.oid = i.inhrelid WHERE i.inhparent = p.partrelid ORDER BY 1) AS partitions \
             FROM pg_partitioned_table p WHERE p.partrelid = to_regclass($1)",
        )
        .bind::<Text, _>(quoted(&self.table))
        .get_results::<Partitioned>(conn)?;
        let Some(partitioned) = partitioned.into_iter().next() else {
            return Err(Error::InvalidArgument(format!(
                "a ring needs a table partitioned by LIST ({}), and {} is not a partitioned table",
                self.slot_column, self.table
            )));
        };
        if partitioned.strategy != "l" || partitioned.columns != self.slot_column {
            return Err(Error::InvalidArgument(format!(
                "a ring needs a table partitioned by LIST ({}), and {} is partitioned by {} ({})",
                self.slot_column,
                self.table,
                match partitioned.strategy.as_str() {
                    "r" => "RANGE",
                    "h" => "HASH",
                    _ => "LIST",
                },
                partitioned.columns
            )));
        }
        let ours: Vec<String> = (0..self.slots).map(|slot| self.partition(slot)).collect();
        if let Some(other) = partitioned.partitions.iter().find(|p| !ours.contains(p)) {
            return Err(Error::InvalidArgument(format!(
                "{} has a partition that is not one of the {} slots of its ring: {other}",
                self.table, self.slots
            )));
        }
        Ok(())
    }

    /// Refuses a ring that cannot work before any SQL is sent.
    fn check(&self) -> Result<(), Error> {
        if self.slots < 3 {
            return Err(Error::InvalidArgument(format!(
                "a ring needs at least 3 slots, not {}",
                self.slots
            )));
        }
        if self.slot_size == 0 {
            return Err(Error::InvalidArgument(
                "a ring's slots hold at least one job".to_owned(),
            ));
        }
        let longest = self.partition(self.slots - 1);
        if self.table.is_empty()
            || self.slot_column.is_empty()
            || longest.len() > MAX_IDENTIFIER_LEN
        {
            return Err(Error::InvalidArgument(format!(
                "a ring's table and slot column need names, and its partitions' names \
                 ({longest}) at most {MAX_IDENTIFIER_LEN} bytes"
            )));
        }
        Ok(())
    }

    /// The advisory lock a ring's creation and rotations take.
    fn lock_name(&self) -> String {
        format!("diesel_claim ring {}", self.table)
    }

    fn partition(&self, slot: u16) -> String {
        format!("{}_slot_{slot}", self.table)
    }

    fn sequence(&self) -> String {
        format!("{}_slot_seq", self.table)
    }
}

/// `name` as a PostgreSQL identifier, whatever it holds.
fn quoted(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `text` as a PostgreSQL string literal.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

#[derive(QueryableByName)]
struct SlotState {
    #[diesel(sql_type = BigInt)]
    bytes: i64,
    #[diesel(sql_type = BigInt)]
    jobs: i64,
}

#[derive(QueryableByName)]
struct Jobs {
    #[diesel(sql_type = BigInt)]
    jobs: i64,
}

#[derive(QueryableByName)]
struct Last {
    #[diesel(sql_type = BigInt)]
    last: i64,
}

#[derive(QueryableByName)]
struct Partitioned {
    #[diesel(sql_type = Text)]
    strategy: String,
    #[diesel(sql_type = Text)]
    columns: String,
    #[diesel(sql_type = diesel::sql_types::Array<Text>)]
    partitions: Vec<String>,
}
