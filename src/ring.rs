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
//! slot); once the jobs of a slot are done, [`rotate`](RingDsl::rotate) truncates it.
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
//! On a diesel-async connection, the same calls are awaited: with
//! [`aio::prelude`](crate::aio::prelude) in scope, `ring.rotate(&mut conn).await`
//! ([`aio::RingDsl`](crate::aio::RingDsl)).
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
//!   left to vacuum as in a table of one partition. A queue taken in order
//!   of priority leaves its waiting low-priority jobs in older slots: each
//!   is truncated once they are down to `max_moved`, and they move on to
//!   the current slot. Set `max_moved` to about as many as wait per slot.
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
use diesel::query_builder::SqlQuery;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel::{QueryableByName, RunQueryDsl};

use crate::lease::advisory;
use crate::transaction::transaction_depth;
use crate::{BlockingConnection, Error};

/// The longest name PostgreSQL keeps: longer ones are cut, and two
/// partitions' names could then be one.
const MAX_IDENTIFIER_LEN: usize = 63;

/// A queue table partitioned into a ring of slots by insertion order, whose
/// drained slots [`rotate`](RingDsl::rotate) truncates: see the
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

/// What one [`rotate`](RingDsl::rotate) did.
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
    /// held them that long): the next call tries again.
    pub busy: bool,
}

/// A ring's creation and rotation on a blocking connection, in the
/// [prelude](crate::prelude). (On a diesel-async connection, the trait of the
/// same name in [`aio::prelude`](crate::aio::prelude) awaits them.)
pub trait RingDsl {
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
    fn create<C, I>(&self, conn: &mut C) -> Result<(), Error>
    where
        C: BlockingConnection<I> + LoadConnection<Backend = Pg>;

    /// Truncates the slots whose jobs are done, all in one transaction: it
    /// takes their partitions to itself (waiting at most
    /// [`lock_timeout`](Ring::lock_timeout)), checks under that lock that
    /// each holds at most [`max_moved`](Ring::max_moved) jobs and is not the
    /// slot new jobs go to, moves those jobs to the current slot, and
    /// truncates the slots. Slots with nothing to reclaim are passed over
    /// without a lock: a rotation with nothing to do is one query.
    ///
    /// Call it every second or so, on a connection of its own (a pool's):
    /// each call holds the queue's takes back while it waits for the
    /// transactions in flight to end, once for all the slots it truncates.
    /// Rotations of one ring take turns across processes: one called while
    /// another holds the ring waits for it as long as for the partitions.
    /// [`Error::InvalidArgument`] inside a transaction, which would keep
    /// the partitions locked until it ends.
    fn rotate<C, I>(&self, conn: &mut C) -> Result<Rotation, Error>
    where
        C: BlockingConnection<I> + LoadConnection<Backend = Pg>;
}

impl RingDsl for Ring {
    fn create<C, I>(&self, conn: &mut C) -> Result<(), Error>
    where
        C: BlockingConnection<I> + LoadConnection<Backend = Pg>,
    {
        self.check()?;
        conn.transaction(|conn| {
            conn.batch_execute(&self.taking_turns())?;
            self.check_partitioning(self.partitioning().load(conn)?)?;
            conn.batch_execute(&self.creation())?;
            Ok(())
        })
    }

    fn rotate<C, I>(&self, conn: &mut C) -> Result<Rotation, Error>
    where
        C: BlockingConnection<I> + LoadConnection<Backend = Pg>,
    {
        self.check_rotation(transaction_depth(conn)?)?;
        let found = self.survey(self.surveying(self.all_slots()).load(conn)?);
        if found.drained.is_empty() {
            return Ok(found.rotation());
        }
        let locked = conn.transaction(|conn| {
            conn.batch_execute(&self.locking(&found.drained))?;
            let under_lock = self.survey(self.surveying(found.drained.iter().copied()).load(conn)?);
            let (moved, truncating) = if under_lock.jobs > 0 {
                let moved_to = self.moving(&under_lock.drained).load(conn)?;
                self.moved(moved_to, &under_lock.drained)
            } else {
                (0, under_lock.drained.clone())
            };
            if !truncating.is_empty() {
                conn.batch_execute(&self.truncating(&truncating))?;
            }
            Ok(under_lock.truncated(&truncating, moved))
        });
        found.rotated(locked)
    }
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

    // What follows is the SQL of a creation and a rotation, and what is
    // decided between its statements, for both the blocking and the async
    // `RingDsl`: each sends these in the same order.

    /// The statement with which a creation or a rotation takes the ring to
    /// itself, for the rest of its transaction.
    pub(crate) fn taking_turns(&self) -> String {
        format!(
            "SELECT pg_advisory_xact_lock({})",
            advisory::key(&self.lock_name())
        )
    }

    /// The statements creating the ring's sequence, default and partitions.
    pub(crate) fn creation(&self) -> String {
        let sequence = quoted(&self.sequence());
        let mut statements = vec![
            format!("CREATE SEQUENCE IF NOT EXISTS {sequence}"),
            format!(
                "ALTER TABLE {} ALTER COLUMN {} SET DEFAULT ((nextval({}::regclass) / {}) % {})",
                quoted(&self.table),
                quoted(&self.slot_column),
                literal(&sequence),
                self.slot_size,
                self.slots,
            ),
        ];
        statements.extend((0..self.slots).map(|slot| {
            format!(
                "CREATE TABLE IF NOT EXISTS {} PARTITION OF {} FOR VALUES IN ({slot})",
                quoted(&self.partition(slot)),
                quoted(&self.table),
            )
        }));
        statements.join(";\n")
    }

    /// How the table is partitioned: one row if it is.
    pub(crate) fn partitioning(&self) -> SqlQuery {
        diesel::sql_query(format!(
            "SELECT p.partstrat::text AS strategy, \
             array_to_string(ARRAY(SELECT a.attname::text FROM unnest(p.partattrs::int2[]) \
             AS k(attnum) LEFT JOIN pg_attribute a ON a.attrelid = p.partrelid \
             AND a.attnum = k.attnum), ',') AS columns, \
             ARRAY(SELECT c.relname::text FROM pg_inherits i JOIN pg_class c \
             ON c.oid = i.inhrelid WHERE i.inhparent = p.partrelid ORDER BY 1) AS partitions \
             FROM pg_partitioned_table p WHERE p.partrelid = to_regclass({})",
            literal(&quoted(&self.table))
        ))
    }

    /// Checks the table is partitioned as a ring needs, and has no
    /// partitions but the ring's.
    pub(crate) fn check_partitioning(&self, partitioned: Vec<Partitioned>) -> Result<(), Error> {
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

    /// Refuses a rotation that cannot work, at a connection `depth`
    /// transactions deep, before any SQL is sent.
    pub(crate) fn check_rotation(&self, depth: u32) -> Result<(), Error> {
        self.check()?;
        if depth > 0 {
            return Err(Error::InvalidArgument(
                "a ring's rotation runs in transactions of its own, not inside one".to_owned(),
            ));
        }
        Ok(())
    }

    pub(crate) fn all_slots(&self) -> std::ops::Range<u16> {
        0..self.slots
    }

    /// A query of the `slots`' sizes and jobs (up to one more than
    /// [`max_moved`](Self::max_moved)), with the last insertion's place.
    pub(crate) fn surveying(&self, slots: impl Iterator<Item = u16>) -> SqlQuery {
        let rows = slots
            .map(|slot| {
                let partition = quoted(&self.partition(slot));
                format!(
                    "SELECT {slot}::int4 AS slot, pg_relation_size({}::regclass) AS bytes, \
                     (SELECT count(*) FROM (SELECT FROM {partition} LIMIT {}) AS kept) AS jobs",
                    literal(&partition),
                    u64::from(self.max_moved) + 1,
                )
            })
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        diesel::sql_query(format!(
            "SELECT slots.*, (SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END \
             FROM {}) AS last FROM ({rows}) AS slots",
            quoted(&self.sequence())
        ))
    }

    /// Which of the surveyed slots can be truncated: those with bytes to
    /// reclaim, few jobs left, and no new jobs coming (not the current
    /// slot).
    pub(crate) fn survey(&self, slots: Vec<SlotState>) -> Survey {
        let mut survey = Survey::default();
        for slot in slots {
            let current = slot.last.max(0) / i64::from(self.slot_size) % i64::from(self.slots);
            if i64::from(slot.slot) == current {
                continue;
            }
            if slot.jobs > i64::from(self.max_moved) {
                survey.full += 1;
            } else if slot.bytes > 0 {
                survey.drained.push(slot.slot as u16);
                survey.jobs += slot.jobs;
            }
        }
        survey
    }

    /// The statements that take the `drained` slots to the rotation's
    /// transaction, waiting at most the lock timeout for each lock.
    pub(crate) fn locking(&self, drained: &[u16]) -> String {
        // Milliseconds, as the setting counts them; at least one, since 0
        // would mean waiting for ever.
        let wait = self.lock_timeout.as_millis().clamp(1, u128::from(u32::MAX));
        format!(
            "SET LOCAL lock_timeout = {wait}; {}; LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
            self.taking_turns(),
            self.partitions(drained),
        )
    }

    /// The statement moving the jobs left in the `drained` slots to the
    /// current one, returning the slots they went to.
    pub(crate) fn moving(&self, drained: &[u16]) -> SqlQuery {
        diesel::sql_query(format!(
            "UPDATE {} SET {column} = DEFAULT WHERE {column} IN ({}) RETURNING {column}::int4 AS slot",
            quoted(&self.table),
            drained
                .iter()
                .map(u16::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            column = quoted(&self.slot_column),
        ))
    }

    /// How many jobs were moved, and which of the `drained` slots are still
    /// to be truncated: not one the moved jobs went to. The moved jobs take
    /// the slot of the next insertion, and inserts whose place in the ring
    /// was drawn meanwhile may have brought it round to a drained slot
    /// (their own inserts wait for the lock): such a slot is kept, with the
    /// jobs, for a later rotation.
    pub(crate) fn moved(&self, moved_to: Vec<Slot>, drained: &[u16]) -> (u64, Vec<u16>) {
        let kept = |slot: u16| moved_to.iter().any(|moved| moved.slot == i32::from(slot));
        let truncating = drained
            .iter()
            .copied()
            .filter(|&slot| !kept(slot))
            .collect();
        (moved_to.len() as u64, truncating)
    }

    pub(crate) fn truncating(&self, drained: &[u16]) -> String {
        format!("TRUNCATE {}", self.partitions(drained))
    }

    /// The slots' partitions, as a list of names.
    fn partitions(&self, slots: &[u16]) -> String {
        slots
            .iter()
            .map(|&slot| quoted(&self.partition(slot)))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Refuses a ring that cannot work before any SQL is sent.
    pub(crate) fn check(&self) -> Result<(), Error> {
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

/// The slots a survey found to truncate, and those it passed over.
#[derive(Debug, Default)]
pub(crate) struct Survey {
    /// Slots to truncate.
    pub(crate) drained: Vec<u16>,
    /// Jobs left in them, to move.
    pub(crate) jobs: i64,
    /// Slots with too many jobs left.
    full: u32,
}

impl Survey {
    /// A rotation that found nothing to truncate.
    pub(crate) fn rotation(&self) -> Rotation {
        Rotation {
            full: self.full,
            ..Rotation::default()
        }
    }

    /// What the survey, under the lock, let the rotation do: `truncated`
    /// slots truncated, `moved` jobs moved.
    pub(crate) fn truncated(&self, truncated: &[u16], moved: u64) -> Rotation {
        Rotation {
            truncated: truncated.len() as u32,
            moved,
            full: self.full,
            busy: false,
        }
    }

    /// The rotation, from this survey (before the lock) and the outcome of
    /// the locked transaction.
    pub(crate) fn rotated(&self, locked: Result<Rotation, Error>) -> Result<Rotation, Error> {
        let locked = match locked {
            Ok(locked) => locked,
            Err(Error::LockNotAvailable) => Rotation {
                busy: true,
                ..Rotation::default()
            },
            Err(error) => return Err(error),
        };
        Ok(Rotation {
            full: self.full + locked.full,
            ..locked
        })
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

/// A slot's size and jobs, as [`Ring::surveying`] reads them.
#[derive(QueryableByName)]
pub(crate) struct SlotState {
    #[diesel(sql_type = Integer)]
    slot: i32,
    #[diesel(sql_type = BigInt)]
    bytes: i64,
    #[diesel(sql_type = BigInt)]
    jobs: i64,
    /// The sequence's last value: the last insertion's place.
    #[diesel(sql_type = BigInt)]
    last: i64,
}

/// The slot a job was moved to.
#[derive(QueryableByName)]
pub(crate) struct Slot {
    #[diesel(sql_type = Integer)]
    slot: i32,
}

#[derive(QueryableByName)]
pub(crate) struct Partitioned {
    #[diesel(sql_type = Text)]
    strategy: String,
    #[diesel(sql_type = Text)]
    columns: String,
    #[diesel(sql_type = diesel::sql_types::Array<Text>)]
    partitions: Vec<String>,
}
