//! Retries scheduled in the rows: a queue's attempts, next run time and last
//! error, written under the failing row's lock and honoured by the take of
//! every worker in every process.

use std::fmt::Display;
use std::hash::{BuildHasher, RandomState};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use diesel::associations::HasTable;
use diesel::connection::LoadConnection;
use diesel::deserialize::FromSql;
use diesel::dsl;
use diesel::prelude::*;
use diesel::query_builder::{Query, QueryFragment};
use diesel::query_dsl::methods::FilterDsl;
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, Bool, HasSqlType};

use super::kind::{DeadLetter, FailureHook, NoHook};
use super::ClaimBuilder;
use crate::backend::strategy::Strategy;
use crate::backend::ClaimBackend;
use crate::reusable::{QueryPerLoop, Reusable};
use crate::sql::retry::{AttemptsSpent, DueNow, ErrorColumn, NoColumn, RecordFailure, TextType};
use crate::sql::stamp::StampType;
use crate::sql::{IdShape, InList, KeyColumns, KeyShape, Returning, SelectWhere, Update};
use crate::Error;

/// A queue's retry schedule, kept in its rows: how many times a job has
/// failed (`attempts`, an integer column), when it may run next (`run_at`,
/// a timestamp column), and, if given, why it failed last
/// ([`last_error`](Self::last_error), a text column). Give it to a claim
/// with [`ClaimBuilder::retries`].
///
/// - **The take** of every worker, in every process, runs the query's
///   filter and `attempts < max AND run_at <= now`, by the database's clock:
///   no worker takes a job before its next run time.
/// - **A failure** (the closure returned an error, panicked, or ran past its
///   [timeout](crate::ClaimBuilder::timeout)) is written while the job is
///   still locked, in its transaction, after its work was rolled back to a
///   savepoint: `attempts = attempts + 1`, `run_at = now + delay`, and the
///   error's text. Its release commits with it: no other worker can take the
///   job in between, or run it before the delay has passed.
/// - **The delay** after a job's `n`th failure: by default 1 s, doubling
///   with each failure up to 1 hour ([`backoff`](Self::backoff)), or the
///   `n`th of a [`schedule`](Self::schedule) of your own, and then up to a
///   tenth more, at random ([`jitter`](Self::jitter)), so that jobs that
///   failed together do not all come back at once. A delay is never shorter
///   than the schedule's.
/// - **A dead letter**: a job that has failed
///   [`max_attempts`](Self::max_attempts) times (20 by default) is out of
///   the queue, and stays in the table for you to read, fix, and send back
///   by setting its attempts lower. With the `tracing` feature its last
///   failure is an `error` event, `a job used its last attempt`.
///
/// ```
/// # include!("../doctest_setup.rs");
/// use std::time::Duration;
/// use diesel_claim::prelude::*;
/// use diesel_claim::Retries;
///
/// # fn main() -> Result<(), diesel_claim::Error> {
/// # let mut conn = establish_connection();
/// let queue = jobs::table.filter(jobs::done.eq(false)).order(jobs::priority.desc());
/// let report = queue
///     .select(Job::as_select())
///     .build_claim()
///     .retries(
///         Retries::new(jobs::attempts, jobs::run_at)
///             .last_error(jobs::last_error)
///             .max_attempts(5)
///             .backoff(Duration::from_secs(10), Duration::from_secs(3600)),
///     )
///     .then_update(jobs::done.eq(true))
///     .each(&mut conn, |_, job: Job| {
///         if job.id == 2 {
///             return Err(diesel_claim::Error::InvalidArgument("no address".into()));
///         }
///         Ok(())
///     })?;
/// assert_eq!((report.processed, report.failed), (2, 1));
/// // Job 2 runs again in 10 to 11 s, by the database's clock.
/// let (attempts, error): (i32, Option<String>) =
///     jobs::table.find(2).select((jobs::attempts, jobs::last_error)).first(&mut conn)?;
/// assert_eq!((attempts, error.as_deref()), (1, Some("invalid argument: no address")));
/// # Ok(())
/// # }
/// ```
///
/// The columns' types: `attempts` `SMALLINT`, `INTEGER` or `BIGINT`;
/// `run_at` `timestamptz` or `timestamp` (kept in UTC) on PostgreSQL,
/// `DATETIME(6)` (in UTC) or `TIMESTAMP(6)` on MySQL and MariaDB,
/// `TIMESTAMP` on SQLite (text, UTC), nullable or not (null: due now); the error `TEXT`, nullable or not
/// (an error's text is cut to [`MAX_ERROR_LEN`] bytes). Index the queue
/// as its order needs; `run_at` rarely needs an index of its own, as the
/// take reads the queue in its order and passes over the rows not yet due.
#[derive(Debug, Clone)]
pub struct Retries<A, R, E = NoColumn> {
    attempts: A,
    run_at: R,
    error: E,
    pub(crate) max_attempts: u32,
    schedule: Schedule,
    jitter: f64,
}

/// The delays of a retry schedule.
#[derive(Debug, Clone, PartialEq)]
enum Schedule {
    /// `first` after the first failure, doubling up to `max`.
    Doubling { first: Duration, max: Duration },
    /// The `n`th after the `n`th failure, the last after every later one.
    Steps(Arc<[Duration]>),
}

/// The longest text of an error a retry schedule writes, in bytes (cut at a
/// character's boundary).
pub const MAX_ERROR_LEN: usize = 2000;

/// The longest delay a retry schedule may give.
const MAX_DELAY: Duration = Duration::from_secs(365 * 24 * 60 * 60);

impl<A, R> Retries<A, R> {
    /// A schedule in the columns `attempts` and `run_at` of the claimed
    /// table: 20 attempts, 1 s after the first failure doubling up to 1 hour,
    /// a tenth of jitter, and no error column.
    pub fn new(attempts: A, run_at: R) -> Self
    where
        A: AttemptsColumn,
        R: RunAtColumn,
    {
        Retries {
            attempts,
            run_at,
            error: NoColumn,
            max_attempts: 20,
            schedule: Schedule::Doubling {
                first: Duration::from_secs(1),
                max: Duration::from_secs(60 * 60),
            },
            jitter: 0.1,
        }
    }
}

impl<A, R, E> Retries<A, R, E> {
    /// Attempts in all, the first included (at least 1): once a job has
    /// failed this many times it is a dead letter, out of the queue.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Delays that double: `first` after a job's first failure, twice that
    /// after its second, and so on up to `max`.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.schedule = Schedule::Doubling { first, max };
        self
    }

    /// Delays of your own: the `n`th after a job's `n`th failure, the last
    /// after every later one (`[1 s, 2 s, 4 s]`, say).
    pub fn schedule(mut self, delays: impl IntoIterator<Item = Duration>) -> Self {
        self.schedule = Schedule::Steps(delays.into_iter().collect());
        self
    }

    /// How much longer than the schedule's a delay may be, at random, as a
    /// fraction of it (from 0 to 1; a tenth by default): jobs that failed
    /// together then come back spread out. A delay is never shorter than the
    /// schedule's.
    pub fn jitter(mut self, fraction: f64) -> Self {
        self.jitter = fraction;
        self
    }

    /// Writes each failure's error (its `Display` text) in `column`, a text
    /// column of the claimed table.
    pub fn last_error<Col>(self, column: Col) -> Retries<A, R, Col>
    where
        Col: ErrorTextColumn,
    {
        Retries {
            attempts: self.attempts,
            run_at: self.run_at,
            error: column,
            max_attempts: self.max_attempts,
            schedule: self.schedule,
            jitter: self.jitter,
        }
    }

    /// What is wrong with the options, if anything.
    fn problem(&self) -> Option<String> {
        if self.max_attempts == 0 {
            return Some("a retry schedule needs max_attempts of at least 1".to_owned());
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Some(format!(
                "a retry schedule's jitter is a fraction from 0 to 1, not {}",
                self.jitter
            ));
        }
        let longest = match &self.schedule {
            Schedule::Doubling { first, max } if first > max => {
                return Some(format!(
                    "a retry schedule's backoff needs first <= max, got {first:?} and {max:?}"
                ))
            }
            Schedule::Doubling { max, .. } => *max,
            Schedule::Steps(delays) if delays.is_empty() => {
                return Some("a retry schedule needs at least one delay".to_owned())
            }
            Schedule::Steps(delays) => delays.iter().copied().max().unwrap_or_default(),
        };
        (longest > MAX_DELAY).then(|| {
            format!("a retry schedule's delays are at most {MAX_DELAY:?}, not {longest:?}")
        })
    }

    /// The delay after a job's `failures`th failure, before jitter.
    fn delay(&self, failures: u32) -> Duration {
        let nth = failures.saturating_sub(1);
        match &self.schedule {
            Schedule::Doubling { first, max } => first.saturating_mul(1 << nth.min(31)).min(*max),
            Schedule::Steps(delays) => delays[(nth as usize).min(delays.len() - 1)],
        }
    }

    /// The delays after a job's first, second, … failure, in microseconds,
    /// each longer by one draw of the jitter; the last holds for every
    /// failure after it. No more than the attempts, nor than the schedule
    /// takes to reach its last delay.
    fn delays(&self) -> Vec<i64> {
        let stretch = 1.0 + self.jitter * random_fraction();
        let distinct = match &self.schedule {
            Schedule::Doubling { first, max } => {
                let mut steps = 1;
                while steps < 32 && first.saturating_mul(1 << (steps - 1)) < *max {
                    steps += 1;
                }
                steps
            }
            Schedule::Steps(delays) => delays.len() as u32,
        };
        (1..=distinct.min(self.max_attempts))
            .map(|failures| {
                let micros = self.delay(failures).as_micros() as f64 * stretch;
                micros.min(i64::MAX as f64) as i64
            })
            .collect()
    }
}

/// A random fraction in `[0, 1)`.
fn random_fraction() -> f64 {
    (RandomState::new().hash_one(()) >> 11) as f64 / (1u64 << 53) as f64
}

/// An integer column a retry schedule counts a job's failures in.
#[diagnostic::on_unimplemented(
    message = "a retry schedule counts attempts in an integer column, and `{Self}` is not one",
    note = "declare the column `SmallInt`, `Integer` or `BigInt` (not null) in the claimed table"
)]
pub trait AttemptsColumn: Column + Copy {}

#[diagnostic::do_not_recommend]
impl<Col: Column + Copy> AttemptsColumn for Col where Col::SqlType: IntegerType {}

/// The SQL types an attempts column may have.
pub trait IntegerType {}

impl IntegerType for diesel::sql_types::SmallInt {}

impl IntegerType for diesel::sql_types::Integer {}

impl IntegerType for BigInt {}

/// A timestamp column a retry schedule keeps a job's next run time in.
#[diagnostic::on_unimplemented(
    message = "a retry schedule keeps the next run time in a timestamp column, and `{Self}` is not \
               one",
    note = "declare the column `Timestamptz` or `Timestamp` on PostgreSQL, `Datetime` \
            (`DATETIME(6)`) on MySQL, `Timestamp` on SQLite, nullable or not, in the claimed table"
)]
pub trait RunAtColumn: Column + Copy {}

#[diagnostic::do_not_recommend]
impl<Col: Column + Copy> RunAtColumn for Col where Col::SqlType: TimestampType {}

/// The SQL types a next run time may be kept in, on one backend or another.
pub trait TimestampType {}

impl TimestampType for diesel::sql_types::Timestamp {}

#[cfg(feature = "postgres_backend")]
impl TimestampType for diesel::sql_types::Timestamptz {}

#[cfg(feature = "mysql_backend")]
impl TimestampType for diesel::sql_types::Datetime {}

impl<T: TimestampType> TimestampType for diesel::sql_types::Nullable<T> {}

/// A text column a retry schedule writes a failure's error in.
#[diagnostic::on_unimplemented(
    message = "a retry schedule writes errors in a text column, and `{Self}` is not one",
    note = "declare the column `Text` or `Nullable<Text>` in the claimed table"
)]
pub trait ErrorTextColumn: Column + Copy {}

#[diagnostic::do_not_recommend]
impl<Col: Column + Copy> ErrorTextColumn for Col where Col::SqlType: TextType {}

/// The caller's query, restricted to rows whose next run time has come and
/// whose attempts are not spent: a claim with [`Retries`].
#[derive(Debug)]
pub struct Retrying<Q, A, R> {
    query: Q,
    due: DueNow<A, R>,
}

#[diagnostic::do_not_recommend]
impl<Q, A, R> Reusable for Retrying<Q, A, R>
where
    Q: Reusable,
    Q::Query: FilterDsl<DueNow<A, R>>,
    A: Copy,
    R: Copy,
{
    type Query = dsl::Filter<Q::Query, DueNow<A, R>>;

    fn query(&self) -> Self::Query {
        FilterDsl::filter(self.query.query(), self.due)
    }
}

impl<Q: QueryPerLoop, A: Copy, R: Copy> QueryPerLoop for Retrying<Q, A, R> {
    fn per_loop(&self) -> Self {
        Retrying {
            query: self.query.per_loop(),
            due: self.due,
        }
    }
}

/// A retry schedule's columns, `(attempts, run_at)`, for a claim of the
/// query `Q`: columns of a table the query reads.
#[diagnostic::on_unimplemented(
    message = "the retry schedule's columns must be columns of the claimed table, and `{Self}` \
               are not, or the query cannot be cloned",
    label = "not columns of the claimed table, or a query that cannot be cloned",
    note = "the attempts and the next run time are columns of the table the claim takes its rows \
            from",
    note = "a boxed query cannot be cloned: wrap the code that builds it in \
            `diesel_claim::rebuild(|| …)`"
)]
pub trait ScheduleColumns<Q> {}

#[diagnostic::do_not_recommend]
impl<Q, A, R> ScheduleColumns<Q> for (A, R)
where
    Q: Reusable,
    Q::Query: FilterDsl<DueNow<A, R>>,
    dsl::Filter<Q::Query, DueNow<A, R>>: Query,
{
}

/// The failure hook of a claim with a [retry schedule](Retries): it records
/// the failure in the row. Set by [`ClaimBuilder::retries`].
#[derive(Debug, Clone)]
pub struct Retry<A, R, E> {
    pub(crate) retries: Retries<A, R, E>,
}

/// A claim with a retry schedule.
type WithRetries<Q, M, T, A, R, E> = ClaimBuilder<Retrying<Q, A, R>, M, T, Retry<A, R, E>>;

impl<Q, M, T> ClaimBuilder<Q, M, T, NoHook> {
    /// Keeps the queue's retry schedule in its rows (see [`Retries`]): the
    /// takes leave out rows whose next run time is still ahead, by the
    /// database's clock, and rows that have used their attempts; a failing
    /// row's attempt, next run time and error are written under its lock,
    /// after its work was rolled back to a savepoint, before any worker can
    /// take it again. Like a [failure hook](Self::on_failure), it implies
    /// [`keep_going`](Self::keep_going), and the rows must be `Clone`.
    ///
    /// A worker of such a claim has no in-memory backoff of its own
    /// ([`failure_backoff`](crate::ClaimWorker::failure_backoff) is zero
    /// unless set): the rows carry the schedule, across workers and
    /// processes. Not available with a mark ([`mark`](Self::mark),
    /// [`mark_and_commit`](Self::mark_and_commit)), whose changes take a row
    /// out of the queue before its closure runs, and which a failure would
    /// leave in place: use [`then_update`](Self::then_update) instead.
    pub fn retries<A, R, E>(self, retries: Retries<A, R, E>) -> WithRetries<Q, M, T, A, R, E>
    where
        (A, R): ScheduleColumns<Q>,
        A: Copy,
        R: Copy,
    {
        let due = DueNow {
            attempts: retries.attempts,
            run_at: retries.run_at,
            max_attempts: retries.max_attempts,
        };
        let problem = retries.problem();
        let mut claim = ClaimBuilder {
            query: Retrying {
                query: self.query,
                due,
            },
            options: self.options,
            kind: self.kind,
            hook: Retry { retries },
            mode: PhantomData,
        };
        claim.options.retry_schedule = true;
        claim.options.failed_again = true;
        if let Some(problem) = problem {
            claim.options.lock.reject(problem);
        }
        claim
    }
}

impl<C, I, Row, E, A, R, Ec> FailureHook<C, I, Row, E> for Retry<A, R, Ec>
where
    C: diesel::Connection,
    I: Clone,
    Row: RetriedRow<C, A, R, Ec>,
    E: From<Error> + Display,
    A: Copy,
    R: Copy,
    Ec: Copy,
{
    const SET: bool = true;

    fn keep(item: &I) -> Option<I> {
        Some(item.clone())
    }

    fn failed(&mut self, conn: &mut C, row: Row, error: &E) -> Result<Option<DeadLetter>, E> {
        let (write, attempts) = (self.retries.write(error), self.retries.max_attempts);
        let spent = row.record_failure(conn, write, attempts)?;
        Ok(spent.then_some(DeadLetter { attempts }))
    }
}

impl<A: Copy, R: Copy, E: Copy> Retries<A, R, E> {
    /// The write that records a failure with `error`.
    pub(crate) fn write(&self, error: &dyn Display) -> RecordFailure<A, R, E> {
        RecordFailure {
            attempts: self.attempts,
            run_at: self.run_at,
            error: self.error,
            delays: self.delays(),
            message: error_text(error),
        }
    }
}

/// `error`'s text, cut to [`MAX_ERROR_LEN`] bytes at a character's
/// boundary.
pub(crate) fn error_text(error: &dyn Display) -> String {
    let mut text = error.to_string();
    if text.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// Rows whose failures a retry schedule in `A` (attempts), `R` (next run
/// time) and `E` (error, or [`NoColumn`](crate::bounds::NoColumn)) records, on a connection `C`: rows of a
/// table with a primary key of one to three columns, on a supported
/// backend, with the schedule's columns in that table.
#[diagnostic::on_unimplemented(
    message = "a retry schedule in `{A}` and `{R}` cannot record failures of rows `{Self}` on `{C}`",
    note = "the rows must `#[derive(Identifiable)]`, and the attempts, next run time and error \
            columns be columns of their table"
)]
pub trait RetriedRow<C, A, R, E>: Sized {
    /// Records a failure of this row with `write`: whether the row has used
    /// its last attempt, a dead letter. A row that is gone records nothing,
    /// and is none.
    #[doc(hidden)]
    fn record_failure(
        &self,
        conn: &mut C,
        write: RecordFailure<A, R, E>,
        max_attempts: u32,
    ) -> Result<bool, Error>;
}

type Shape<R> = <<&'static R as Identifiable>::Id as IdShape>::Shape;
type Key<R> = <Shape<R> as KeyShape<R>>::Key;
type Wrapped<R> = <Shape<R> as KeyShape<R>>::Columns;

/// The statement that records a failure of `row`, and the expression that
/// tells whether the row has used its last of `max_attempts`: both APIs
/// send them.
pub(crate) fn failure_statements<Row, A, R, E>(
    row: &Row,
    write: RecordFailure<A, R, E>,
    max_attempts: u32,
) -> (FailureWrite<Row, A, R, E>, AttemptsSpent<A>)
where
    Row: HasTable + 'static,
    &'static Row: Identifiable,
    <&'static Row as Identifiable>::Id: IdShape,
    Shape<Row>: KeyShape<Row>,
    A: Copy,
{
    let spent = AttemptsSpent {
        attempts: write.attempts,
        max_attempts,
    };
    let update = Update {
        from: Row::table().from_clause(),
        changes: write,
        filter: InList {
            column: Shape::<Row>::columns(),
            keys: vec![Shape::<Row>::key(row)],
        },
    };
    (update, spent)
}

type FromClause<R> = <<R as HasTable>::Table as diesel::QuerySource>::FromClause;
/// The statement that records a failure of a row of `Row`.
pub(crate) type FailureWrite<Row, A, R, E> =
    Update<FromClause<Row>, RecordFailure<A, R, E>, InList<Wrapped<Row>, Key<Row>>>;

// A failure in here is told as the `RetriedRow` the hook asked for, whose
// message names what recording a failure needs.
#[diagnostic::do_not_recommend]
impl<Row, C, A, R, E> RetriedRow<C, A, R, E> for Row
where
    C: LoadConnection,
    C::Backend: ClaimBackend + HasSqlType<BigInt> + HasSqlType<Bool> + 'static,
    i64: ToSql<BigInt, C::Backend>,
    bool: FromSql<Bool, C::Backend>,
    Row: HasTable + 'static,
    &'static Row: Identifiable,
    <&'static Row as Identifiable>::Id: IdShape,
    Shape<Row>: KeyShape<Row>,
    Wrapped<Row>: KeyColumns<Key<Row>, C::Backend>,
    FromClause<Row>: QueryFragment<C::Backend>,
    A: Column<Table = Row::Table> + Copy + QueryFragment<C::Backend>,
    R: Column<Table = Row::Table> + Copy,
    R::SqlType: StampType<C::Backend>,
    E: ErrorColumn<C::Backend>,
{
    fn record_failure(
        &self,
        conn: &mut C,
        write: RecordFailure<A, R, E>,
        max_attempts: u32,
    ) -> Result<bool, Error> {
        let (update, spent) = failure_statements(self, write, max_attempts);
        let spent: Option<bool> = if <C::Backend as Strategy>::UPDATE_RETURNING {
            Returning {
                statement: update,
                columns: spent,
            }
            .get_result(conn)
            .optional()?
        } else {
            // MySQL: read back under the row's lock, which the claim holds.
            if update.execute(conn)? == 0 {
                None
            } else {
                let read = SelectWhere {
                    columns: spent,
                    from: Row::table().from_clause(),
                    filter: InList {
                        column: Shape::<Row>::columns(),
                        keys: vec![Shape::<Row>::key(self)],
                    },
                };
                Some(read.get_result(conn)?)
            }
        };
        Ok(spent == Some(true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    diesel::table! {
        jobs (id) {
            id -> Integer,
            attempts -> Integer,
            run_at -> Timestamp,
        }
    }

    fn retries() -> Retries<jobs::attempts, jobs::run_at> {
        Retries::new(jobs::attempts, jobs::run_at).jitter(0.0)
    }

    /// Delays double from the first up to the longest, which then holds;
    /// no more are kept than the attempts need.
    #[test]
    fn doubling_delays_reach_their_cap() {
        let second = 1_000_000;
        let doubling = retries().backoff(Duration::from_secs(1), Duration::from_secs(5));
        assert_eq!(
            doubling.delays(),
            [second, 2 * second, 4 * second, 5 * second]
        );
        assert_eq!(
            doubling.clone().max_attempts(2).delays(),
            [second, 2 * second]
        );
        assert_eq!(doubling.delay(30), Duration::from_secs(5));
        let steps = retries().schedule([1, 2, 4].map(Duration::from_secs));
        assert_eq!(steps.delays(), [second, 2 * second, 4 * second]);
        assert_eq!(steps.delay(9), Duration::from_secs(4));
    }

    /// Jitter lengthens every delay of a write by one draw, never shortens
    /// it, and by no more than its fraction.
    #[test]
    fn jitter_only_lengthens_delays() {
        let schedule = retries().schedule([Duration::from_secs(1)]).jitter(0.5);
        let draws: Vec<i64> = (0..200).map(|_| schedule.delays()[0]).collect();
        assert!(draws
            .iter()
            .all(|micros| (1_000_000..1_500_000).contains(micros)));
        assert!(
            draws.iter().any(|micros| *micros != draws[0]),
            "no jitter drawn"
        );
    }

    #[test]
    fn bad_schedules_are_refused() {
        let problems = [
            retries().max_attempts(0).problem(),
            retries().jitter(1.5).problem(),
            retries().jitter(f64::NAN).problem(),
            retries()
                .backoff(Duration::from_secs(2), Duration::from_secs(1))
                .problem(),
            retries().schedule([]).problem(),
            retries().schedule([MAX_DELAY * 2]).problem(),
        ];
        for problem in problems {
            assert!(problem.is_some());
        }
        assert_eq!(retries().problem(), None);
    }

    #[test]
    fn long_errors_are_cut_at_a_character() {
        let long = "é".repeat(MAX_ERROR_LEN);
        let cut = error_text(&long);
        assert!(cut.len() <= MAX_ERROR_LEN && cut.len() > MAX_ERROR_LEN - 2);
        assert_eq!(error_text(&"short"), "short");
    }
}
