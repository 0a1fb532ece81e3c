//! Job workers: a queue of jobs in a table of yours, and workers that take
//! the next job, run it, delete it or record its failure, for months.
//!
//! ```
//! # include!("../doctest_setup.rs");
//! use std::time::Duration;
//! use diesel_claim::prelude::*;
//! use diesel_claim::{Retries, StopHandle};
//!
//! # fn main() -> Result<(), diesel_claim::Error> {
//! # let mut conn = establish_connection();
//! let stop = StopHandle::new(); // stop.stop() on SIGTERM
//! # let stopper = stop.clone();
//! // The jobs not done, highest priority first.
//! let queue = jobs::table
//!     .filter(jobs::done.eq(false))
//!     .order(jobs::priority.desc())
//!     .select(Job::as_select());
//! let report = queue
//!     .build_claim()
//!     // A failing job is recorded under its lock (one more attempt, its
//!     // error, its next run time: 1 s, 2 s, 4 s … up to an hour later), and
//!     // no worker in any process takes it before then; after 5 attempts it
//!     // is a dead letter, out of the queue.
//!     .retries(
//!         Retries::new(jobs::attempts, jobs::run_at)
//!             .last_error(jobs::last_error)
//!             .max_attempts(5),
//!     )
//!     // Once the job's work has succeeded, in the same transaction.
//!     .then_update(jobs::done.eq(true))
//!     .worker(&stop)
//!     // A job that runs longer is ended, and recorded as a failure.
//!     .timeout(Duration::from_secs(60))
//!     .run(&mut conn, |conn, job: Job| {
//!         // … the job's work, in its transaction (and a savepoint) …
//!         # if job.id == 3 { stopper.stop(); }
//!         Ok::<_, diesel_claim::Error>(())
//!     })?;
//! assert_eq!(report.processed, 3);
//! # Ok(())
//! # }
//! ```
//!
//! The [job service](super::job_service) page puts these pieces together
//! in an async service on a pool, with its signals, log lines and metrics.
//!
//! # The next job, from the head of the queue
//!
//! A worker takes its rows from the head of the query: each take is one
//! locking statement, `SELECT … WHERE <your filter> ORDER BY <your order>,
//! <key> LIMIT n FOR NO KEY UPDATE SKIP LOCKED` (MySQL: `FOR UPDATE SKIP
//! LOCKED`; SQLite: the database write lock), re-run for every take; the key
//! breaks the order's ties, its columns left out where the order names them
//! (`ORDER BY id DESC`, not `ORDER BY id DESC, id`), and a queue with no
//! order is taken by key. A job enqueued ahead of the others (a higher
//! priority) is the next one taken, whoever is running what; an empty queue
//! costs that one statement, in a transaction.
//! [`max_rows`](crate::ClaimBuilder::max_rows) no larger than a batch takes
//! from the head too, and any claim does with
//! [`from_head`](crate::ClaimBuilder::from_head).
//!
//! A call of `claim_each` reads candidates in pages instead: a page of keys
//! without locks, then takes within it. Pages are what spread many workers
//! over a large backlog by key, each taking from a place of its own, where
//! workers at the head all pass over the rows the others hold, inside their
//! statements (see [many workers](super#many-workers)); they read an ordered
//! queue as it was when the page was read, so a job enqueued ahead of the
//! page waits for the next call. So drains of a backlog keep their pages, and
//! workers, whose promise is the queue's order, take from the head (tell one
//! [`in_pages`](crate::ClaimBuilder::in_pages) to drain a backlog by key). The
//! [BENCHMARKS.md](https://github.com/diesel-claim/diesel-claim/blob/main/BENCHMARKS.md) measures both.
//!
//! A call from the head keeps the key of each row it hands over, so that a
//! row its closure leaves matching is passed over, not handed over again;
//! such rows, and failing ones, are then left out of the call's takes (`AND
//! NOT <key> IN (…)`), and a call that would leave out more than 1000 ends.
//! A worker starts a fresh run every 10,000 rows.
//!
//! Index the queue in its order, after its filter: `CREATE INDEX ON jobs
//! (priority DESC, id) WHERE NOT done` (MySQL: `INDEX (priority DESC, id)`).
//! On MySQL and MariaDB, read the plan of your queue's query with a realistic
//! number of rows: a server that sorts the queue rather than walking the
//! index (as it may when few rows are pending) reads and locks every pending
//! row, and other workers' takes wait on some of them; run claimers at `READ
//! COMMITTED` ([`MySQL and MariaDB`](super#mysql-and-mariadb)).
//!
//! # Failures, recorded under the lock
//!
//! A job that fails must be recorded: its attempts, its error, when to try it
//! next. Recorded after the claim has released the row, another worker can
//! take the row first, and run it again as if it had never failed. So the
//! failure is written in the row's transaction instead: the closure's work is
//! rolled back to a savepoint taken before it ran, the failure is written,
//! the row still locked, and it commits with the row's release.
//!
//! **A retry schedule** ([`retries`](crate::ClaimBuilder::retries), with
//! [`Retries`](crate::Retries)) is the crate's own way, in three columns of
//! the queue's table: the attempts, the next run time, and the last error.
//! A failure writes all three in one statement (`attempts + 1`, `now +` the
//! schedule's delay for that attempt, the error's text), by the database's
//! clock; every take of every worker, in every process, adds `attempts <
//! max AND run_at <= now` to the queue's filter. The delays double from a
//! first one up to a cap (1 s up to an hour by default), or follow a list
//! of your own, each lengthened at random by up to a tenth so that jobs that
//! failed together come back spread out, and never shortened. A job that
//! used its last attempt is a dead letter: left in the table, out of the
//! queue, with an `error` event; set its attempts lower and its run time to
//! now to send it back. In the crate's [tests](https://github.com/diesel-claim/diesel-claim/tree/main/tests), four worker
//! processes of four loops each ran jobs that failed on every attempt under
//! a schedule of 1 s, 2 s and 4 s: each job ran exactly its four attempts,
//! each no sooner than its delay after the one before ended, by the
//! database's clock, and ended a dead letter.
//!
//! **A failure hook** ([`on_failure`](crate::ClaimBuilder::on_failure)) is
//! the way for anything else: it runs with the row (as the closure got it)
//! and the error, under the same lock, and writes what it wants: a state
//! column, a row in a table of failures, a schedule of your own. Filter the
//! query on what it writes (`attempts < 3`, `run_at <= now()`), so that the
//! hook takes a failed row out of the queue for as long as it should be.
//!
//! - **A schedule or a hook implies
//!   [`keep_going`](crate::ClaimBuilder::keep_going)**: the call goes on, and
//!   counts the row in [`failed`](crate::ClaimReport::failed);
//!   [`each_outcome`](crate::ClaimBuilder::each_outcome) returns each failure
//!   with its key and error. A hook that fails itself ends the call with its
//!   error, and its batch is rolled back whole. A panic in the closure is a
//!   failure ([`Error::ClosurePanicked`](crate::Error::ClosurePanicked)), and
//!   so is a closure that ran past the claim's
//!   [`timeout`](crate::ClaimBuilder::timeout)
//!   ([`Error::TimedOut`](crate::Error::TimedOut); see [long jobs](#long-jobs)).
//! - **Batches**: with [`batch(n)`](crate::ClaimBuilder::batch), each row's
//!   closure runs in a savepoint of its own: a failing row is rolled back
//!   alone, its hook runs, and the other rows commit. No closure runs twice
//!   for a row in one call. (With [`each_batch`](crate::ClaimBuilder::each_batch),
//!   the closure's batch fails whole, and the hook runs for each of its rows.)
//! - **Marks**: with [`mark`](crate::ClaimBuilder::mark), the mark comes
//!   before the row's savepoint: the hook finds the row marked, and writes
//!   what a failed row becomes (back in the queue, or a dead letter). With
//!   [`mark_and_commit`](crate::ClaimBuilder::mark_and_commit), the hook runs
//!   in a transaction of its own.
//! - **Visibility timeouts**: the hook runs in a transaction that first
//!   clears the row's stamp, if the row still carries it; if another worker
//!   has claimed it since, the hook does not run.
//! - **The cost**: a savepoint and its release per row, as the hand-written
//!   loop of a job runner sends them.
//! - **Done jobs**: delete or mark a job with
//!   [`then_delete`](crate::ClaimBuilder::then_delete) or
//!   [`then_update`](crate::ClaimBuilder::then_update) rather than in the
//!   closure: the crate then writes the rows whose closure succeeded after
//!   their savepoints, one statement for the batch, in the transaction that
//!   locked them, as a hand-written runner deletes its job after the job's
//!   savepoint. On PostgreSQL this matters: a row locked by a transaction
//!   and written in a savepoint of it gets a `MultiXact` as its deleter, and
//!   index scans cannot mark such dead rows dead (PostgreSQL's
//!   `HeapTupleIsSurelyDead`), so that every take from the head of the
//!   queue walks all the jobs done since the last vacuum. Draining 4,000
//!   queued jobs, workers that deleted their jobs in the closure ran at 0.19
//!   to 0.46 × the hand-written loop (1 to 16 workers); with `then_delete`,
//!   0.92 to 0.99 × per job and 1.11 to 1.19 × in batches of 10
//!   ([BENCHMARKS.md](https://github.com/diesel-claim/diesel-claim/blob/main/BENCHMARKS.md), "Job runners").
//!
//! A worker without a retry schedule also leaves a row whose closure failed
//! out of its takes for a while,
//! [`failure_backoff`](crate::ClaimWorker::failure_backoff) (1 s, doubling
//! with each failure up to 5 min), so that a row the hook leaves in the
//! queue is not run again at once. It is kept in memory, one for all the
//! loops of a worker on a pool: a failing row is recorded in it before its
//! transaction ends, and a take that locks a row it holds passes the row
//! over, so no two loops take a failing row at one instant. Workers in other
//! processes do not see it: the rows' own schedule is what holds across
//! them. With a retry schedule the worker has none (it would only delay
//! rows the schedule says are due), and with a hook that writes a next run
//! time, `failure_backoff(Duration::ZERO, Duration::ZERO)` turns it off.
//!
//! # Waiting for jobs
//!
//! A worker runs until its [`StopHandle`](crate::StopHandle) is triggered:
//! it takes what is pending and, when nothing is, waits. Waiting is polling,
//! from every 10 ms after rows were found, doubling up to every second while
//! the queue stays empty ([`poll_interval`](crate::ClaimWorker::poll_interval)
//! sets both). On PostgreSQL, [`listen`](crate::ClaimWorker::listen) also
//! wakes the worker at once when a notification arrives on a channel: send it
//! from the transaction that writes the rows with [`notify`](crate::notify),
//! or from a trigger:
//!
//! ```sql
//! CREATE FUNCTION notify_jobs() RETURNS trigger LANGUAGE plpgsql AS
//!     $$ BEGIN PERFORM pg_notify('jobs', ''); RETURN NULL; END $$;
//! CREATE TRIGGER jobs_enqueued AFTER INSERT OR UPDATE ON jobs
//!     FOR EACH STATEMENT EXECUTE FUNCTION notify_jobs();
//! ```
//!
//! PostgreSQL delivers notifications when their transaction commits, and
//! folds identical ones within a transaction into one. A waiting worker looks
//! at its connection for them every millisecond (a read of its socket, no
//! round trip); the polls stay, as the fallback for rows written without a
//! notification. The benchmark measured the pickup (commit to closure) at a
//! median of under a millisecond with `LISTEN`, and within the maximum poll
//! interval without it ([BENCHMARKS.md](https://github.com/diesel-claim/diesel-claim/blob/main/BENCHMARKS.md)).
//!
//! [`StopHandle::stop`](crate::StopHandle::stop) is one atomic store: call it
//! from a signal handler. The worker then finishes the row or batch in hand,
//! commits it, and returns the report of all it did. An error from the
//! closure ends the worker unless the claim has a failure hook or
//! [keeps going](crate::ClaimBuilder::keep_going). A deadlock or a
//! serialization failure does not: the database rolled the transaction back,
//! and the worker goes on (rows locked in it are taken again). That holds
//! for the crate's own statements, and for the closure's when its error is
//! [`Error::Deadlock`](crate::Error::Deadlock),
//! [`Error::SerializationFailure`](crate::Error::SerializationFailure), or a
//! `diesel::result::Error` of either class; an error type of your own that
//! wraps one of them ends the worker, as any other closure error does, since
//! the worker cannot see inside it. [`run`](crate::ClaimWorker::run) holds its one
//! connection (and, listening, its session) for as long as it runs; a worker
//! [on a pool](#on-a-pool) does not. The async twin (`diesel_claim::aio`)
//! runs the same loop as a future, waiting with tokio timers and, on
//! PostgreSQL, on diesel-async's notification stream; async producers notify
//! with [`aio::notify`](crate::aio::notify), in their transaction too.
//!
//! A worker made to [`stop_when_empty`](crate::ClaimWorker::stop_when_empty)
//! returns once a claim finds nothing to take: for test suites and one-shot
//! drains. Rows it is backing off from, and rows a hook rescheduled out of
//! the query, do not count as pending.
//!
//! # On a pool
//!
//! [`run_pooled`](crate::ClaimWorker::run_pooled) runs a worker on an r2d2
//! pool, and its async twin on a bb8 or deadpool pool (features `bb8`,
//! `deadpool`), as a service runs it for months:
//!
//! - Each claim checks a connection out and returns it before the worker
//!   waits: idle workers hold no connection, and the pool is shared with the
//!   rest of the application. [`concurrency`](crate::ClaimWorker::concurrency)
//!   runs several claim loops in one worker, sharing one listener and one
//!   backoff: threads, blocking; async, futures of one future
//!   (`run_pooled`), which take turns on one task, or each a task of its own
//!   (`spawn_pooled`, for a claim and a closure that are `'static`), which a
//!   multi-threaded runtime runs in parallel, so that a job that blocks its
//!   thread (inside `tokio::task::block_in_place`, as tokio asks of blocking
//!   code) holds up no other loop. The crate's tests block one loop's thread
//!   so for a second: with spawned loops, the other loop did the queue's
//!   other jobs meanwhile; as futures of one future, none.
//! - Listening, one connection listens for all the loops (one of an r2d2
//!   pool's; a connection a bb8 or deadpool pool makes outside its count),
//!   and wakes them on every notification.
//! - A lost connection does not end it. A claim whose connection stopped
//!   answering had not committed: its rows are taken again, on another
//!   connection, after a pause (50 ms, doubling to 5 s while connections
//!   keep failing), with a warning event; a checkout that fails, or a
//!   listener whose connection dies, the same. A server restart is waited
//!   out (see [server restarts](#server-restarts) for how soon the loops
//!   are back). The worker ends when stopped, or on an error another
//!   connection cannot mend: the closure's (without a hook or `keep_going`,
//!   and other than a deadlock or a serialization failure), an invalid
//!   option, an error of the query on a connection that answers.
//! - In the key's order (a query with no order, or ordered by its key) and
//!   with row locks (PostgreSQL, MySQL, MariaDB), the loops steer their takes
//!   around each other's batches, which they know within the process. Most
//!   takes start past the last row any loop took (`… AND id > $1`). A loop
//!   looks from the head up to the oldest batch the others hold once in every
//!   round of the loops' takes, and before it ends a run whose take past them
//!   came back short; a look that fills its batch goes on from there. Loops
//!   that all took from the head would each pass over every row the others
//!   hold, trying each row's lock: at a full queue, 64 loops spent all of the
//!   server's time so (see
//!   [BENCHMARKS.md](https://github.com/diesel-claim/diesel-claim/blob/main/BENCHMARKS.md)).
//!   The looks ahead do not start at the head either, but where the look
//!   before the last one ended (the loops' *low water*): the head of a queue
//!   of deleted jobs is where vacuum has yet to pass, and while any
//!   transaction on the database is older than the deletes (an analytics
//!   query, a `BEGIN` left open in a console, a replica's feedback), it
//!   cannot, so that a scan from the head reads the index entry and the row
//!   of every job done since, each time. Once a second at most, one look
//!   catches up from the head, and less often when that walk is long: its
//!   time is kept under a twentieth of the time between two. With 200,000
//!   done jobs held so, the takes read 16 blocks per job where a clean
//!   queue's read 10, and loops that looked from the head read 554 (the
//!   crate's tests measure it). MariaDB's InnoDB keeps a deleted row's index
//!   records until its purge passes, which an open transaction holds back
//!   the same way; the loops steer past them there too.
//!   The cost: a job left free behind the loops' batches (rolled back, let
//!   go by another process, or committed by its producer after jobs with
//!   higher keys, as concurrent producers' jobs often are) waits for a look
//!   ahead, about as long as a batch takes, rather than being the very next
//!   one taken; one left free behind the low water (a failed job let go,
//!   one whose run time came, one committed long after its key was drawn)
//!   waits for the next catch-up, up to a second or so; and a loop that finds the queue empty sends two statements
//!   before it waits again (its take past the others and its last look;
//!   three when the round's look ahead is its turn), where a loop of the
//!   whole query sends one. A notification wakes every waiting loop, so an
//!   idle worker answers each one with two or three short statements a
//!   loop. Workers in other processes still pass over each other's rows, and
//!   a queue in another order (by priority) takes from the head as above. A
//!   loop made to [`stop_when_empty`](crate::ClaimWorker::stop_when_empty)
//!   takes its last look at the whole query.
//!
//! Size the pool for the loops, the listener and the rest of the
//! application: a closure that checks out a second connection while its
//! claim holds one needs room for both (the claim's own connection, the
//! closure's first argument, is the one to use). The crate's [tests](https://github.com/diesel-claim/diesel-claim/tree/main/tests) run
//! eight loops on a pool of four beside a producer using the same pool, and
//! end every session, or SIGKILL the server and start it again, under a
//! draining worker: every job is done once.
//!
//! ```rust,no_run
//! # include!("../doctest_setup.rs");
//! use std::time::Duration;
//! use diesel::r2d2::{ConnectionManager, Pool};
//! use diesel_claim::prelude::*;
//! use diesel_claim::StopHandle;
//!
//! # #[cfg(not(feature = "postgres"))]
//! # fn main() {}
//! # #[cfg(feature = "postgres")]
//! # fn main() -> Result<(), diesel_claim::Error> {
//! # let url = "";
//! use diesel::PgConnection;
//!
//! let pool = Pool::new(ConnectionManager::<PgConnection>::new(url)).expect("a pool");
//! let stop = StopHandle::new();
//! let pending = orders::table.filter(orders::shipped.eq(true)).filter(orders::email_sent.eq(false));
//! let report = pending
//!     .build_claim()
//!     .worker(&stop)
//!     .concurrency(4)
//!     .run_pooled(&pool, |conn: &mut PgConnection, order: Order| {
//!         diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
//!         Ok::<_, diesel_claim::Error>(())
//!     })?;
//! # Ok(())
//! # }
//! ```
//!
//! # Names
//!
//! A worker's span, its events and its claims' metrics carry its name
//! (`worker`) beside its table: the table's name unless the worker is given
//! one (not empty: an empty name is refused with
//! [`Error::InvalidArgument`](crate::Error::InvalidArgument)). Name the
//! workers of one table, so that their lines and metrics are told apart (see
//! the guide's [tracing](super::tracing) and the `metrics` module):
//!
//! ```
//! # include!("../doctest_setup.rs");
//! use diesel_claim::prelude::*;
//! use diesel_claim::StopHandle;
//!
//! # fn main() -> Result<(), diesel_claim::Error> {
//! # let mut conn = establish_connection();
//! let stop = StopHandle::new();
//! # let stopper = stop.clone();
//! let pending = orders::table.filter(orders::shipped.eq(true)).filter(orders::email_sent.eq(false));
//! // Its lines say worker="mailer" table="orders"; its metrics have both labels.
//! let report = pending
//!     .build_claim()
//!     .worker(&stop)
//!     .name("mailer")
//!     .run(&mut conn, |conn, order: Order| {
//!         diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
//!         # stopper.stop();
//!         Ok::<_, diesel_claim::Error>(())
//!     })?;
//! assert_eq!(report.processed, 1);
//! # Ok(())
//! # }
//! ```
//!
//! # Long jobs
//!
//! A job runs in its row's transaction, which holds the row's lock and
//! holds back vacuum while it runs. A job that takes minutes is better run
//! outside any transaction, with a
//! [visibility timeout](super#long-work-outside-a-transaction-visibility-timeouts):
//! each row comes to the closure with its whole time to live ahead of it
//! (the rows of a batch after the first are stamped again as they are handed
//! over), [`Claimed::remaining`](crate::Claimed::remaining) says how much is
//! left, and [`extend`](crate::Claimed::extend) buys more.
//!
//! **A timeout** ([`timeout`](crate::ClaimWorker::timeout)) bounds how
//! long a job may run: past it, the job is ended as a failure, its work
//! rolled back to its savepoint and the failure recorded under its lock
//! ([`Error::TimedOut`](crate::Error::TimedOut), counted in
//! [`timed_out`](crate::ClaimReport::timed_out), the metrics and a warning
//! event), and its retry schedule says when it runs again. What it can end
//! differs:
//!
//! - **Async**, the job's future is dropped at the timeout, wherever it
//!   awaits: an HTTP call, a sleep, a query.
//! - **Blocking**, a thread cannot be stopped from the outside: the job is a
//!   failure once it returns, whatever it returned. Write long blocking work
//!   to check the time itself, or give it a bound of its own (a client's
//!   request timeout).
//! - **On PostgreSQL**, either way, each of the job's statements is ended by
//!   the server at the timeout (`SET LOCAL statement_timeout`, one statement
//!   more per batch), so a job blocked on a slow query or a lock wait gets its
//!   error then. MySQL, MariaDB and SQLite have no such bound for one
//!   transaction: there a statement in flight at the timeout runs to its end
//!   before the job's rollback can start.
//!
//! **Without a timeout**, a job runs for as long as it takes, and nothing
//! starts it again while it runs: its row stays locked until it ends. That
//! is why an async worker's transactions have **no idle bound** by default,
//! where other async claims have one of 30 s
//! ([`IDLE_TRANSACTION_BOUND`](crate::aio::IDLE_TRANSACTION_BOUND)): a bound
//! is the server ending the session of a transaction that sat idle too long,
//! and a job that awaits something slow inside its transaction sits idle; a
//! bound below a job would free its row while it runs, and another worker
//! would start it again. With a timeout, the bound is 30 s above it, a
//! backstop the timeout keeps from firing, which still frees the rows of a
//! future dropped mid-transaction whose `ROLLBACK` could not leave (see
//! [`aio`'s "Dropped futures"](crate::aio#dropped-futures)). A bound set by
//! hand ([`idle_bound`](crate::ClaimBuilder::idle_bound)) that fires under a
//! job anyway is never a silent retry: a worker on a pool counts the job as
//! failed, with an `error` event, and on its next connection records the
//! failure through its failure hook or retry schedule, under the job's lock,
//! if the job still matches and nobody has taken it since (its rows were
//! freed when the session ended); a worker on one connection returns
//! [`Error::IdleBoundExceeded`](crate::Error::IdleBoundExceeded).
//!
//! # Done jobs that leave nothing to vacuum
//!
//! Each job deleted leaves a dead row and its index entry until vacuum
//! passes, and vacuum cannot pass while any transaction on the database is
//! older than the deletes. On PostgreSQL, a queue table kept as a
//! [ring of partitions](crate::ring) has none to wait for:
//! [`create`](crate::ring::RingDsl::create) partitions it into slots by
//! order of insertion, and [`rotate`](crate::ring::RingDsl::rotate),
//! called every second or so from a thread or task of the service
//! (awaited on diesel-async, [`aio::RingDsl`](crate::aio::RingDsl)),
//! truncates each slot whose jobs are all done, its dead rows with it. The
//! worker is the same (its order, the retry schedule,
//! [`then_delete`](crate::ClaimBuilder::then_delete), `LISTEN`); the
//! queue's key holds the slot column beside its own. Held 10 minutes, a
//! transaction left open elsewhere cost a queue kept 4,000 deep at 16
//! workers half its jobs per second on a plain table, and 8 % on a ring
//! (see
//! [BENCHMARKS.md](https://github.com/diesel-claim/diesel-claim/blob/main/BENCHMARKS.md),
//! "A ring of partitions"). The [ring's documentation](crate::ring) says
//! what it asks of the queue: jobs deleted when done, a ring that holds the
//! queue's usual depth, long jobs that hold the ring back.
//!
//! # When the database goes away
//!
//! A connection does not outlive its session: when the server crashes or
//! restarts, fails over, or ends the session, every call on that connection
//! fails. A worker [on a pool](#on-a-pool) goes on, on new connections, once
//! the server answers again. A worker on one connection returns
//! [`Error::BrokenConnection`](crate::Error::BrokenConnection), on every
//! backend, blocking or async, whatever the client called the loss (libpq's
//! "server closed the connection unexpectedly" or "SSL connection has been
//! closed unexpectedly", MariaDB's "Lost connection to server during query"
//! or "Server has gone away"); never a report that says nothing is pending.
//! Drop that connection and use another.
//!
//! What a worker saw committed stays committed if the server keeps its
//! durable defaults (PostgreSQL `synchronous_commit = on`, InnoDB
//! `innodb_flush_log_at_trx_commit = 1`): turned off, a crash loses
//! acknowledged commits, and their rows are claimed and processed again. A
//! commit the crash cut off may have happened without the worker hearing of
//! it: the call ends with the error and does not count the row, though it was
//! processed. Leases live in a table: a crash neither frees one nor lets its
//! fencing tokens go back. The crate's torture suite SIGKILLs
//! PostgreSQL and MariaDB servers under a drain, a bank, worker loops,
//! visibility timeouts and leases ([RELIABILITY.md](https://github.com/diesel-claim/diesel-claim/blob/main/RELIABILITY.md), scenario 27).
//!
//! ## Server restarts
//!
//! While connections fail, a pooled worker's loops (and its listener) pause
//! between their tries as [above](#on-a-pool), and take turns: once their
//! own pauses are longer, one of them tries every 250 ms, so that a server
//! that is down gets about four tries a second from a worker however many
//! loops it has, and a server that is back is tried within 250 ms. The
//! first loop whose connection answers again wakes the others, which try
//! at once instead of waiting out their pauses: the loops come back
//! together, not one by one over the next 5 s.
//!
//! A pool's own waits come on top. r2d2 and bb8 make their connections in
//! the background, and retry one that failed after a pause that doubles up
//! to half the pool's `connection_timeout` (15 s with their default of
//! 30 s), while a checkout waits up to that timeout for a connection: after
//! a restart, such a pool may have none to give for seconds after the
//! server is back, and every loop waits for it. Give a worker's r2d2 or bb8
//! pool a `connection_timeout` of a second or two
//! (`.connection_timeout(Duration::from_secs(1))` on its builder): the
//! pool's pause between its tries is then at most half that, and a
//! checkout that times out while the server is down is one more failed try
//! of the loop's. deadpool connects within the checkout and waits for
//! nothing of its own (without `timeouts`), so the loops' turns are all
//! there is.
//!
//! The crate's tests stop a private server for 10 s under a worker of eight
//! loops whose jobs take from 2 ms to 2.1 s, so that the loops lose their
//! connections at different times, and start it again: on r2d2, bb8 and
//! deadpool, on PostgreSQL and MariaDB, all eight took jobs again within
//! 0.52 s of the server's accepting connections in 18 runs, where they had
//! come back one by one over 3 s ([RELIABILITY.md](https://github.com/diesel-claim/diesel-claim/blob/main/RELIABILITY.md), scenario 27).
//!
//! # When the network drops
//!
//! A cut network is worse than a crash, as nobody is told. A worker whose
//! link goes dark while it holds rows keeps them locked until the server gives
//! up on it, and its own next call waits for an answer that cannot come.
//! Neither wait ends unless something bounds it:
//!
//! - **On the database server**, drop the sessions of clients gone silent.
//!   PostgreSQL: `tcp_keepalives_idle`, `tcp_keepalives_interval` and
//!   `tcp_keepalives_count`, and `tcp_user_timeout` for data the client never
//!   acknowledged. MariaDB: `tcp_keepalive_time`, `tcp_keepalive_interval` and
//!   `tcp_keepalive_probes`; it has no bound of its own on unacknowledged
//!   data, so set the host's `net.ipv4.tcp_retries2` (5 gives up after about
//!   12 s). `idle_in_transaction_session_timeout` (PostgreSQL) and
//!   `idle_transaction_timeout` (MariaDB) bound a silent holder whatever
//!   silenced it.
//! - **On the workers**, PostgreSQL's bounds go in the URL:
//!   `?keepalives_idle=1&keepalives_interval=1&keepalives_count=3&tcp_user_timeout=5000`.
//!   Diesel's MySQL connection takes no timeout, so the worker host's
//!   `net.ipv4.tcp_retries2` and keepalive settings are what bounds a call.
//!
//! With these, the crate's torture suite cut a worker off while it held a
//! row: the server freed the row within seconds, another worker processed it
//! once, and the cut worker's call failed with an error; a lease holder cut
//! off past its TTL was replaced, and its fenced write refused once the link
//! healed ([RELIABILITY.md](https://github.com/diesel-claim/diesel-claim/blob/main/RELIABILITY.md), scenario 28).
