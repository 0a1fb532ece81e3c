//! The guide: how each capability works, what it costs, and the caveats that
//! come with it. The [crate root](crate) has the overview. Three pages go
//! further: [job workers](workers); [a job service](job_service) end to
//! end, from the queue's table to a graceful stop and the metrics; and
//! [tracing], every span and event with its fields.
//!
//! # Claiming: `claim_each`
//!
//! ```
//! # include!("doctest_setup.rs");
//! use diesel_claim::prelude::*;
//!
//! # fn main() -> Result<(), diesel_claim::Error> {
//! # let mut conn = establish_connection();
//! let pending = orders::table
//!     .filter(orders::shipped.eq(true))
//!     .filter(orders::email_sent.eq(false));
//!
//! let report = pending.claim_each(&mut conn, |conn, order: Order| {
//!     send_shipped_email(&order)?;
//!     diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
//!     Ok::<_, diesel_claim::Error>(())
//! })?;
//! assert_eq!((report.processed, report.skipped), (2, 0));
//! # Ok(())
//! # }
//! ```
//!
//! This is double-checked locking. An unlocked read pages through the query's
//! primary keys (so nothing pending costs one query and no transaction, and memory
//! does not grow with the number of pending rows). Then, in a transaction of its
//! own, the *same* query, restricted to keys past those already gone through, is
//! re-run in key order (or in the query's order: see below) under
//! `FOR NO KEY UPDATE OF <table> SKIP LOCKED LIMIT 1`:
//! the first row that still matches and that nobody else holds is locked. Rows
//! other workers have taken or are holding are passed over inside that one
//! statement, not re-checked one transaction each, and the next page is read from
//! past the row locked, so workers neither slow each other down nor read the
//! candidates others take.
//! The closure runs in the transaction, which then commits. It sees the row as it
//! is under the lock, not as the unlocked read saw it.
//!
//! Options are set with [`build_claim`](ClaimDsl::build_claim): what to do with a
//! locked row (skip, fail with [`Error::LockNotAvailable`], or wait and re-check),
//! lock strength, a cap on processed rows, the page size, draining (repeat until a
//! pass claims nothing new, never processing a row twice in one call), and batches.
//!
//! ## The claim order
//!
//! A query with an `ORDER BY` is claimed in that order, the primary key
//! breaking ties: a queue by priority or due time is one `.order(…)` away.
//!
//! ```
//! # include!("doctest_setup.rs");
//! use diesel_claim::prelude::*;
//!
//! # fn main() -> Result<(), diesel_claim::Error> {
//! # let mut conn = establish_connection();
//! // Orders not shipped yet first (`false` sorts first), then shipped ones; by
//! // key within each.
//! let pending = orders::table
//!     .filter(orders::email_sent.eq(false))
//!     .order(orders::shipped.asc());
//! let mut claimed = Vec::new();
//! pending.claim_each(&mut conn, |conn, order: Order| {
//!     claimed.push(order.id);
//!     diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
//!     Ok::<_, diesel_claim::Error>(())
//! })?;
//! assert_eq!(claimed, [3, 1, 2]);
//! # Ok(())
//! # }
//! ```
//!
//! The pages then go by *position*: the order columns' values, then the key.
//! The unlocked read selects them next to the key, and each page, and each
//! locked take, starts past a position, `(priority < $1 OR (priority = $1 AND
//! id > $2))` for `priority DESC`. The values are bound back as the database
//! sent them, so any column type can order a claim. What a claim can follow:
//!
//! - up to three `NOT NULL` columns of the query (a joined table's included),
//!   each bare, `.asc()` or `.desc()`, in a tuple or added by `then_order_by`;
//!   a bare column of a custom SQL type needs its `.asc()`. A nullable column
//!   does not compile: a `NULL` has no place to page past.
//! - not a boxed query's order, which its type does not tell: such a query is
//!   refused with [`Error::InvalidArgument`] before any SQL. Box the filter
//!   instead (a `Box<dyn BoxableExpression<…>>` in `.filter(…)`), and claim it
//!   through [`rebuild`](crate::rebuild).
//!
//! A row whose order columns change while a call runs is met where it is when
//! a page is read: a closure that moves a row later in the order and leaves it
//! matching the query meets it again in the same call, so clear the filter in
//! the closure (as a claim wants anyway). Index the order after the filter
//! (`CREATE INDEX … ON jobs (priority DESC, id) WHERE NOT done`); on MySQL and
//! MariaDB this matters for more than speed: without an index in the order's
//! direction, InnoDB sorts, locking every row it reads, and other workers pass
//! those rows over ([`ClaimReport::locked`]).
//!
//! ## Batches, and claiming in one statement
//!
//! [`batch(n)`](ClaimBuilder::batch) claims up to `n` rows per transaction: one
//! locking read and one commit for the batch. The closure runs per row
//! ([`each`](ClaimBuilder::each)) or once per batch
//! ([`each_batch`](ClaimBuilder::each_batch)); an error in it rolls back the whole
//! batch and ends the call, unless the call [keeps going](ClaimBuilder::keep_going)
//! or has a [failure hook](ClaimBuilder::on_failure): then each row's closure
//! runs in a savepoint of its own, and only a failing row is rolled back.
//!
//! When the work on the database's side is a plain column update, the claim can
//! make it in the statement that claims the rows: [`mark`](ClaimBuilder::mark)
//! sends `UPDATE … SET <changes> WHERE <key> = ANY(ARRAY(SELECT <key> FROM <your
//! query> … LIMIT n FOR NO KEY UPDATE SKIP LOCKED)) RETURNING …` and hands the rows,
//! as updated, to the closure in the same transaction;
//! [`mark_and_commit`](ClaimBuilder::mark_and_commit) lets that statement commit on
//! its own first, so a batch costs one round trip.
//!
//! ```
//! # include!("doctest_setup.rs");
//! use diesel_claim::prelude::*;
//!
//! # fn main() -> Result<(), diesel_claim::Error> {
//! # let mut conn = establish_connection();
//! let pending = orders::table
//!     .filter(orders::shipped.eq(true))
//!     .filter(orders::email_sent.eq(false));
//!
//! let report = pending
//!     .build_claim()
//!     .batch(100)
//!     .mark_and_commit(orders::email_sent.eq(true))
//!     .each_batch(&mut conn, |_conn, orders: Vec<Order>| {
//!         send_shipped_emails(&orders) // the rows are already marked, and committed
//!     })?;
//! assert_eq!(report.processed, 2);
//! # Ok(())
//! # }
//! ```
//!
//! Whether the closure's failure (an `Err` or a panic) puts the rows back:
//!
//! | | rows back to pending | transactions per batch |
//! |---|---|---|
//! | [`each`](ClaimBuilder::each), [`each_batch`](ClaimBuilder::each_batch) | yes, the whole batch | one |
//! | [`mark(…)`](ClaimBuilder::mark) | yes, the whole batch | one |
//! | [`mark_and_commit(…)`](ClaimBuilder::mark_and_commit) | **no**: the batch stays marked and nobody processes it | none of the crate's (PostgreSQL); `BEGIN IMMEDIATE` around the statement (SQLite) |
//!
//! Things to know, all of them consequences of the design:
//!
//! - **At most once, possibly zero times.** Under skip-locked, a row locked by
//!   anyone else — another claimer, or an unrelated transaction holding
//!   `FOR SHARE` — is skipped without error ([`ClaimReport::locked`] counts them,
//!   and [`ClaimReport::gone`] the rows others processed first).
//!   The claimer assumes everyone else is more important than itself. Run it again
//!   (from the next job, or with [`drain`](ClaimBuilder::drain)), or use
//!   [`nowait`](ClaimBuilder::nowait) to be told.
//! - **Once per successful commit.** Side effects outside the database (an email)
//!   happen before the commit; if the commit fails, the row stays pending and may
//!   be processed again. Make such effects idempotent where you can.
//! - **Clear the filter.** The closure must make the row stop matching (set the
//!   flag) in its transaction; a row left matching is processed again by the next
//!   call (never twice in one call).
//! - **Outside a transaction.** Each row needs a transaction of its own; calling it
//!   inside one is [`Error::InvalidArgument`].
//! - **Isolation.** The re-check relies on `READ COMMITTED` (PostgreSQL's
//!   default), where a locked row is re-read at its latest version. Under
//!   `REPEATABLE READ` or `SERIALIZABLE`, a row changed since the transaction's
//!   snapshot fails with [`Error::SerializationFailure`] instead, which is safe but
//!   must be retried.
//! - **Cost.** Per row: `BEGIN`, one locked read, the closure, `COMMIT`; plus one
//!   unlocked read per page (100 keys, or a batch). Batches divide the
//!   transactions by their size. Index the pending predicate over the primary
//!   key, for example `CREATE INDEX orders_pending ON orders (id) WHERE shipped AND
//!   NOT email_sent`: both reads then walk only pending rows, however many rows
//!   are done. [BENCHMARKS.md](https://github.com/diesel-claim/diesel-claim/blob/main/BENCHMARKS.md) has the figures.
//! - **SQLite's statistics.** SQLite gathers statistics only on `ANALYZE` (or
//!   `PRAGMA optimize`). Gathered while nearly every row was pending, they tell
//!   it the partial index holds the whole table, and it then reads candidates
//!   by rowid, past every row other workers have done since: four and eight
//!   workers claiming batches of 1000 ran at two thirds of the speed of the
//!   same statements naming the index. Without statistics, or with statistics
//!   of the table in its usual state, it takes the index.
//! - **Joins lock one table.** Only the claimed table's rows are locked
//!   (`OF <table>`), so a claim never blocks updates of joined rows. The rows'
//!   type names that table (`#[derive(Identifiable)]`); with a join, select it
//!   (`.select(Order::as_select())`). The query's own `LIMIT` is refused: cap a
//!   call with [`max_rows`](ClaimBuilder::max_rows).
//! - **Candidates from a replica.** The unlocked candidate reads may go to a
//!   read replica ([`candidates_from`](ClaimBuilder::candidates_from)); the
//!   locked re-check, the closure and the commit stay on the primary, which is
//!   what makes the replica safe. A lagging replica costs re-checks of rows
//!   others have processed since, and leaves rows it has not replayed yet to a
//!   later call. Never run the whole claim on a replica: it cannot lock rows.
//! - **Errors and panics.** An `Err` from the closure rolls back that row (or
//!   batch) and ends the call with it; rows committed before stay committed. A
//!   panic rolls back, leaves no lock held and no transaction open, and resumes
//!   unwinding. To go on past failing rows, and to learn what a failed call
//!   committed, see [Rows that fail](#rows-that-fail).
//! - **SQLite** has no row locks: each row's transaction is `BEGIN IMMEDIATE`,
//!   which takes the database write lock before the re-check. Still at most once;
//!   claimers queue (set a `busy_timeout`) rather than skip, and the lock options
//!   have no effect there.
//!
//! ## Many workers
//!
//! Workers that claim the same query meet at its head. Each locked take passes
//! over the rows the others hold before it finds free ones, so with `W`
//! workers a take steps over about `W - 1` batches inside its transaction, and
//! the work per row grows with `W`. A hand-written `… LIMIT n FOR UPDATE SKIP
//! LOCKED` does the same. A claim by key that sees it happen (a take passed
//! over candidates others held or had taken) spreads out for the rest of the
//! call:
//!
//! - Each page of candidates starts at a place of its own, picked at random.
//!   The takes go from there to the page's end, then from its head to where
//!   they began, so every candidate is still offered once, and workers that
//!   read the same page take rows apart from one another.
//! - On PostgreSQL, pages grow fourfold, up to 256 batches (at least 16,384
//!   keys, at most 65,536), while others hold more than a quarter of a page,
//!   or while this worker got fewer than 64 rows of a page that others took
//!   most of. The statements each page costs (its read, the read that tells
//!   locked rows from gone ones, a short take at each end) are then spread
//!   over more rows. On MySQL and MariaDB pages keep their size: there, 32
//!   and 64 workers claimed 1.25 to 2 times as many rows per second with
//!   pages of a thousand keys as with grown ones, for more statements per
//!   row (and, per row, 6 to 11% of transactions that commit nothing).
//!
//! Workers, and claims told [`from_head`](ClaimBuilder::from_head), read no
//! pages: each take starts from the head of the query, as the hand-written
//! loop does, so that the next row taken is always the first in the query's
//! order (see the [job workers](workers) page). That is the promise of a job
//! queue; pages are what a large drain by key wants.
//!
//! Alone, a claim goes through its pages from their heads, in key order. These
//! do not spread out: a query's `ORDER BY`, whose order is the claim's promise;
//! [`nowait`](ClaimBuilder::nowait); [`mark_and_commit`](ClaimBuilder::mark_and_commit),
//! which holds its rows only while it marks them, so that others meet rows it
//! marked rather than rows it holds; and a [`page_size`](ClaimBuilder::page_size)
//! set by the caller, which does not grow. [BENCHMARKS.md](https://github.com/diesel-claim/diesel-claim/blob/main/BENCHMARKS.md)
//! has the figures, up to 64 workers.
//!
//! ## Rows that fail
//!
//! [`each`](ClaimBuilder::each) returns the report or the first error. Its
//! siblings [`each_outcome`](ClaimBuilder::each_outcome) and
//! [`each_batch_outcome`](ClaimBuilder::each_batch_outcome) return a
//! [`ClaimOutcome`](crate::ClaimOutcome): the report, counted up to where the
//! call ended (also when an error ended it), and each failure with the keys of
//! the rows it rolled back. With [`keep_going`](ClaimBuilder::keep_going) a
//! failing row (an `Err` or a panic) is rolled back, counted in
//! [`ClaimReport::failed`] and passed over, and the call goes on; a failing
//! batch is retried row by row, so that one bad row holds back none of the
//! others.
//!
//! ```
//! # include!("doctest_setup.rs");
//! use diesel_claim::prelude::*;
//!
//! # fn main() -> Result<(), diesel_claim::Error> {
//! # let mut conn = establish_connection();
//! let pending = orders::table.filter(orders::shipped.eq(true)).filter(orders::email_sent.eq(false));
//! let outcome = pending.build_claim().batch(10).keep_going().each_outcome(
//!     &mut conn,
//!     |conn, order: Order| {
//!         if order.id == 1 {
//!             return Err(diesel_claim::Error::InvalidArgument("no address".into()));
//!         }
//!         diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
//!         Ok(())
//!     },
//! );
//! assert_eq!((outcome.report.processed, outcome.report.failed), (1, 1));
//! for failure in &outcome.failed {
//!     eprintln!("order {:?} failed: {}", failure.keys, failure.error);
//! }
//! assert!(outcome.stopped.is_none());
//! # Ok(())
//! # }
//! ```
//!
//! ### Rows that keep failing
//!
//! A row whose closure fails stays pending: the next call tries it again, and
//! a row that can never succeed (a malformed address) is tried on every call
//! forever. Record each failure with a [failure hook](ClaimBuilder::on_failure),
//! which runs under the row's lock, its work rolled back to a savepoint, so
//! that the attempt is counted before any other worker can take the row; and
//! take the row out of the query after a few attempts (a dead letter). The
//! [job workers](workers) page shows the whole pattern; the
//! [worked example](https://github.com/diesel-claim/diesel-claim/tree/main/examples/shop) counts failed emails so.
//!
//! ## Workers that wait for rows
//!
//! [`ClaimBuilder::worker`] turns a claim into a loop that runs until its
//! [`StopHandle`](crate::StopHandle) is triggered, taking the next rows from
//! the head of the query and waiting while none is pending: a job runner.
//! The [job workers](workers) page has it all: the head of the queue, failure
//! hooks and backoff, waiting with polls and `LISTEN`, and what a worker sees
//! when the database or the network goes away. The [job service](job_service)
//! page walks through a whole service built on one.
//!
//! ## Long work outside a transaction: visibility timeouts
//!
//! A claim holds its row's transaction open while the closure runs: for a
//! slow side effect (rendering a document, calling a payment API) that is a
//! session idle in a transaction, holding its locks and holding back
//! vacuum. [`visibility_timeout`](ClaimBuilder::visibility_timeout) claims
//! rows for a while instead, in a nullable timestamp column of their table:
//!
//! ```sql
//! ALTER TABLE invoices ADD COLUMN claimed_until timestamptz; -- MySQL: DATETIME(6)
//! ```
//!
//! The query's filter is extended with `claimed_until IS NULL OR
//! claimed_until < now`, and each batch is taken by one statement that sets
//! `claimed_until = now + ttl` and commits at once; `now` is always the
//! database's clock, so clients' clocks, and their sessions' time zones, play
//! no part. The closure gets each row as a [`Claimed`](crate::Claimed)
//! handle, outside any transaction, with its whole TTL ahead of it (the rows
//! of a batch after the first are stamped again as they are handed over, one
//! statement each; a row whose batch stamp ran out before its turn, and that
//! another worker took, is passed over as [gone](ClaimReport::gone));
//! [`remaining`](crate::Claimed::remaining) says how long is left. It ends
//! the claim with [`finish`](crate::Claimed::finish): its changes and `claimed_until =
//! NULL`, in one statement that applies only while the row still carries
//! this claim's stamp. [`extend`](crate::Claimed::extend) moves the stamp on
//! during long work; [`release`](crate::Claimed::release) hands the row
//! back at once.
//!
//! A claim stamps a row only where the old stamp is past, and stamps it
//! later than that, in the same statement: each claim of a row has a later
//! stamp than the last, so the stamp is the claim's fencing token. A worker
//! that dies leaves its rows stamped, and they are claimed again once their
//! stamps pass. A worker that stalls past its stamp (a long pause, a
//! `SIGSTOP`, a lost network) loses the row to the next claim, and its late
//! `finish` fails with [`Error::ClaimLost`] and writes nothing. A closure that
//! returns an error, or drops its `Claimed`, leaves the stamp in place: the
//! row comes back when it passes (a backoff for failing rows, and never twice
//! in one call); a [failure hook](ClaimBuilder::on_failure) runs in a
//! transaction that clears the stamp first, if the row still carries it.
//!
//! What this trades for it: the work itself may run twice, by the stalled
//! worker and by the one that took over; only the database write is fenced.
//! Choose the TTL well above the work's duration, `extend` as the work goes
//! on, and make the work repeatable (an idempotency key for the payment API).
//! The claiming statement is the batch claim's (`SKIP LOCKED` on PostgreSQL and
//! MySQL; one writer at a time on SQLite), so claimers never wait on each
//! other's stamps. [`worker`](ClaimBuilder::worker) runs such a claim until
//! stopped, as any claim's, and claims a dead worker's rows at its first poll
//! after their stamps pass. The async
//! API has the same claim on diesel-async (PostgreSQL and MySQL): the closure
//! gets a `Claimed<_, _, aio::Async>`, whose `extend`, `finish` and `release`
//! are futures. In the
//! crate's torture suite, workers SIGKILLed and
//! SIGSTOPped past their TTL left every job's final write landing exactly once
//! ([RELIABILITY.md](https://github.com/diesel-claim/diesel-claim/blob/main/RELIABILITY.md), scenario 25).
//!
//! # MySQL and MariaDB
//!
//! The same guarantees, tested on MariaDB, with these differences:
//!
//! - **`FOR UPDATE`, and no `OF`.** InnoDB has no `FOR NO KEY UPDATE` (a
//!   foreign-key insert referencing a claimed row waits for the claim's commit),
//!   and MariaDB has no `OF`, so the crate sends what both servers take. A locking
//!   read locks every row it reads, joined rows included: a claim through a join
//!   holds the joined rows too, for the length of its batch, and skips candidates
//!   whose joined rows someone else holds.
//! - **`READ COMMITTED` for claimers.** The re-check is a locking read, which
//!   reads the newest version of the row, so a claim is at most once under
//!   `REPEATABLE READ` (InnoDB's default) as under `READ COMMITTED`. But under
//!   `REPEATABLE READ` a locking read keeps the locks of every row it passed,
//!   done ones included, and of the gaps between them, which holds off inserts
//!   and makes other claimers skip more. Set `SET SESSION TRANSACTION ISOLATION
//!   LEVEL READ COMMITTED` on claiming connections (with an r2d2 pool, in a
//!   `CustomizeConnection`; with diesel-async's bb8 and deadpool pools,
//!   `ManagerConfig::custom_setup` takes `aio::establish_read_committed`).
//! - **No `UPDATE … RETURNING`.** [`mark`](ClaimBuilder::mark) locks the batch
//!   with a select, updates it by key and reads it back, in the batch's
//!   transaction; [`mark_and_commit`](ClaimBuilder::mark_and_commit) runs the same
//!   three statements in a transaction of their own.
//!   [`VersionedUpdate::get_result`] is not available.
//! - **No partial indexes.** Index `(flag, id)` for a query filtering on `flag`.
//! - **Deadlocks between claimers.** InnoDB locks a row's entry in each index
//!   separately, so a claim whose locking read goes through the flag's index can
//!   deadlock with another claim's closure updating that flag. The victim's batch
//!   is rolled back and stays pending, and the call ends with
//!   [`Error::Deadlock`]: call again (it is transient; [`retry`] does it, and
//!   a [worker](crate::ClaimWorker) does, whichever side was the victim). It
//!   is rare, and more likely where a scan visits several indexes: 32
//!   workers draining a table partitioned by time (one index per partition)
//!   saw 15 deadlocks in 4 × 10^5 calls
//!   ([RELIABILITY.md](https://github.com/diesel-claim/diesel-claim/blob/main/RELIABILITY.md), scenario 22).
//! - **Statements closed after a failed transaction.** A locking read can
//!   fail after sending some of its rows (a lock wait timeout, a deadlock),
//!   and MariaDB Connector/C (what Debian installs as `libmysqlclient`) then
//!   hangs when the same prepared statement runs again. So when a claim's or
//!   a lock's transaction fails on a blocking connection, the crate closes
//!   every statement Diesel has cached on that connection (and leaves the
//!   cache on, even where you had turned it off); the next take prepares its
//!   statement again. Until then the crate's locking reads are cached like
//!   any other, a prepare saved per take. A locking read of your own that
//!   fails so outside the crate's transactions: drop the connection rather
//!   than run that read on it again. diesel-async's MySQL client has no such
//!   trouble.
//! - **A plain read of several rows can see a transfer half applied.** On
//!   MariaDB 10.11, one `SELECT` of every balance, run beside clients that
//!   move money between two rows under `FOR UPDATE`, now and then saw one
//!   transfer's credit without its debit: 3 of 264,000 reads, under
//!   `REPEATABLE READ` and `READ COMMITTED` alike, in plain SQL without the
//!   crate (32 clients, 150 s). Where a read must add up, lock what it reads:
//!   `.build_lock().strength(LockStrength::Share).run_all(…)` sends `LOCK IN
//!   SHARE MODE`, which waits for the transfers it crosses and saw no such
//!   state; the crate's bank tests read so on MariaDB (on PostgreSQL their
//!   plain reads never saw one). The crate's guarantees do not rest on plain
//!   reads: its re-checks and locks are locking reads.
//! - **Errors.** `innodb_lock_wait_timeout` and `NOWAIT` are
//!   [`Error::LockNotAvailable`], 1213 is [`Error::Deadlock`], and a server
//!   without `SKIP LOCKED` (MySQL before 8.0.1, MariaDB before 10.6) gives
//!   [`Error::Unsupported`] rather than waiting.
//! - **Leases** use the server's clock (`SYSDATE(6)`) and compare names as bytes.
//!   `named_lock::with_named_lock` wraps `GET_LOCK`: held by the session, freed
//!   when it ends, without a fencing token.
//!
//! # Diesel's `MultiConnection`
//!
//! A connection enum made with `#[derive(MultiConnection)]` (PostgreSQL in
//! production, SQLite in development, say) is not a backend this crate can
//! claim through: its backend type is generated in your crate, where the
//! crate's sealed backend trait cannot be implemented, and what a claim
//! sends differs per database (the locking clause, `BEGIN IMMEDIATE`, how a
//! marking statement selects its rows) in ways a statement built once for
//! the enum cannot follow. Match on the enum and claim through the connection
//! inside it, with the code written once in a generic function:
//!
//! ```text
//! fn send_emails<C>(conn: &mut C) -> Result<ClaimReport, Error>
//! where
//!     C: LoadConnection,
//!     C::Backend: ClaimBackend,
//!     for<'q> Pending: ClaimQuery<'q, C, Order>,
//!     // … and whatever the closure's own statements need
//! { pending().claim_each(conn, |conn, order: Order| { … }) }
//!
//! match &mut conn {
//!     AnyConnection::Postgresql(conn) => send_emails(conn),
//!     AnyConnection::Sqlite(conn) => send_emails(conn),
//! }
//! ```
//!
//! # Optimistic updates: `update_versioned`
//!
//! ```
//! # include!("doctest_setup.rs");
//! use diesel_claim::prelude::*;
//! use diesel_claim::{retry, Error, RetryPolicy};
//!
//! # fn main() -> Result<(), Error> {
//! # let mut conn = establish_connection();
//! let new_version = retry(&mut conn, RetryPolicy::default(), |conn| {
//!     let account: Account = accounts::table.find(1).select(Account::as_select()).first(conn)?;
//!     accounts::table
//!         .find(account.id)
//!         .update_versioned(accounts::version, account.version, accounts::balance.eq(account.balance + 50))
//!         .execute(conn)
//! })?;
//! assert_eq!(new_version, 1);
//!
//! let stale = accounts::table
//!     .find(1)
//!     .update_versioned(accounts::version, 0, accounts::balance.eq(0))
//!     .execute(&mut conn);
//! assert!(matches!(stale, Err(Error::VersionConflict { expected: 0, actual: Some(1), .. })));
//! # Ok(())
//! # }
//! ```
//!
//! Zero rows updated is never `Ok`: it is a [`Error::VersionConflict`] carrying
//! the version found, or [`Error::NotFound`]. The version is set to `expected + 1`,
//! and an `expected` at the type's maximum is [`Error::VersionOverflow`]. Every
//! writer of the table must go through the version check (or bump the version);
//! a plain `UPDATE` elsewhere defeats it. Under heavy contention on the same rows
//! retries add up: prefer [`with_lock`](LockDsl::with_lock) there.
//!
//! The target is one row: `table.find(key)`, `&model`, or a filter. One that
//! is not one row by its primary key runs in a transaction (a savepoint inside
//! yours) and is rolled back with [`Error::UnexpectedOutcome`] if it changed
//! several rows. A changeset that sets the version column itself is refused:
//! the crate sets it. [`delete_versioned`](VersionedDsl::delete_versioned)
//! deletes with the same check and the same outcomes.
//!
//! [`retry`]'s closure may return the crate's [`Error`], a `Box<dyn Error>`,
//! `anyhow::Error` (feature `anyhow`) or an error type of your own that
//! implements [`Transient`]; a transient cause is found anywhere in the chain
//! of sources ([`is_transient`]). Its error type must convert from [`Error`],
//! which reports a policy of no attempts before any is made.
//!
//! # Pessimistic locks: `with_lock`
//!
//! ```
//! # include!("doctest_setup.rs");
//! use diesel_claim::prelude::*;
//! use diesel_claim::Error;
//!
//! # fn main() -> Result<(), Error> {
//! # let mut conn = establish_connection();
//! accounts::table.find(2).with_lock(&mut conn, |conn, account: Account| {
//!     diesel::update(&account).set(accounts::balance.eq(account.balance - 30)).execute(conn)?;
//!     Ok::<_, Error>(())
//! })?;
//! # Ok(())
//! # }
//! ```
//!
//! The row stays locked until the closure returns; a missing row is
//! [`Error::NotFound`]. [`with_locks`](LockDsl::with_locks) locks every row a
//! query selects (order it by key) and hands them over as a `Vec`. With [`nowait`](LockBuilder::nowait), a row locked by
//! someone else is [`Error::LockNotAvailable`] at once, without aborting a
//! surrounding transaction. Lock rows in a consistent order (by key) to avoid
//! deadlocks; those that still happen are [`Error::Deadlock`], which [`retry`]
//! retries.
//!
//! # Named leases
//!
//! ```
//! # include!("doctest_setup.rs");
//! use std::time::Duration;
//!
//! # fn main() -> Result<(), diesel_claim::Error> {
//! # let mut conn = establish_connection();
//! // diesel_claim::run_migrations(&mut conn)?; // creates the lease table, once
//! let reserved = diesel_claim::with_lease(&mut conn, "signup:ada", Duration::from_secs(10), |conn, lease| {
//!     // Check that the name is free and insert the user, storing `lease.token()`
//!     // with the write so that a stale holder's later write can be rejected.
//!     Ok::<_, diesel_claim::Error>(lease.token())
//! })?;
//! assert_eq!(reserved, Some(1));
//! # Ok(())
//! # }
//! ```
//!
//! A lease replaces the memcached `add` lock: one holder per name at a time, an
//! expiry judged by the database clock (so clients' clocks do not matter), and a
//! release or renewal that only the current holder can make. A lease is a
//! liveness hint, not a guarantee: a holder that stalls past its TTL loses it
//! while it may still be working. Writes that must not interleave should check
//! the [fencing token](Lease::token), which strictly increases per name.
//! Leases are taken, renewed and released outside transactions, so that others
//! see them at once; [`Lease::acquire_within`] waits for a held lease up to a
//! deadline. The lease table comes from the crate's [`migrations`].
//!
//! ## Leases that stay alive
//!
//! Work that may outlast any TTL worth choosing (a report that takes minutes
//! or hours) holds the lease with [`with_lease_kept_alive`]: a short TTL, so
//! that a crashed holder is replaced soon, renewed every third of it on a
//! second connection while the closure runs, as etcd's `KeepAlive` and
//! Redisson's watchdog do. The closure learns through
//! [`KeptLease::is_lost`] or [`KeptLease::ensure_held`] that the lease is
//! lost, and should stop: when a renewal finds it is someone else's, or when
//! its TTL has passed on this process's monotonic clock since the start of
//! the last renewal that worked (or of the acquisition), whatever the
//! renewal under way is doing. A renewal stuck on a link that relays
//! nothing (a half-open connection, a stalled proxy) thus keeps nothing
//! "held". The database counts the TTL from when the statement ran, after
//! it was sent, so the closure is told before anyone else can take the
//! lease, with a thousandth of the TTL kept for the two clocks' rates; a
//! step of the database server's clock (a leap forward) is not covered.
//! When the closure ends, the call waits for a renewal under way at most a
//! third of the TTL or a second, whichever is shorter, then releases the
//! lease on `conn`: a renewal stuck on a dead link is left to finish on its
//! own, and cannot extend a released lease. The renewing connection is
//! given to the call, which drops it when the renewing ends (a pooled one
//! goes back to its pool). A process that stalls checks nothing, so the
//! fencing token stays the guarantee.
//!
//! ```no_run
//! # include!("doctest_setup.rs");
//! use std::time::Duration;
//!
//! # fn main() -> Result<(), diesel_claim::Error> {
//! # let mut conn = establish_connection();
//! let second = establish_connection(); // or `pool.get()?`
//! let ttl = Duration::from_secs(10);
//! let done = diesel_claim::with_lease_kept_alive(&mut conn, second, "nightly-report", ttl, |conn, lease| {
//!     for _step in 0..3 {
//!         lease.ensure_held()?; // stop once another holder may be at work
//!         // … a step of the work, its writes carrying `lease.token()` …
//!     }
//!     Ok::<_, diesel_claim::Error>(lease.token())
//! })?;
//! assert_eq!(done, Some(1));
//! # Ok(())
//! # }
//! ```
//!
//! # Tracing
//!
//! With the `tracing` feature, the crate reports each claim call, batch,
//! worker, lease and row lock as a span, and what went wrong, is tried
//! again, or a worker does as an event, each naming its table, rows and
//! worker: the [tracing] page lists them, with their targets,
//! levels and fields, and how to print them.
//!

#![allow(unused_imports)]
pub mod job_service;
pub mod tracing;
pub mod workers;

// What the guide's links name (used by its docs alone).
#[cfg(feature = "postgres_backend")]
use crate::advisory;
#[cfg(feature = "migrations")]
use crate::migrations;
use crate::{
    is_transient, retry, with_lease_kept_alive, ClaimBuilder, ClaimDsl, ClaimReport, Error,
    KeptLease, Lease, LockBuilder, LockDsl, Transient, VersionedDsl, VersionedUpdate,
};
