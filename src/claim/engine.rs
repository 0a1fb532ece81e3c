//! The claim engine: one run of a claim as a state machine, with no I/O of its
//! own. It decides which keys to read, which range each locked take covers,
//! which candidates were passed over, when a drain pass ends, and what the
//! report says; a driver (blocking in [`super`], async in `aio`) runs the
//! statements it asks for and reports back what they returned.
//!
//! A claim takes from the head of the query ([`head`]) or scans it in pages
//! of candidates ([`scan`], its pages laid out by [`pages`]); [`Claim`] keeps
//! what the two share.

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Arc;

use self::head::HeadTakes;
use self::scan::Scan;
use super::report::ClaimReport;
use super::siblings::Sibling;
use crate::locking::LockClause;
use crate::sql::KeyRange;
use crate::trace::{self, Span};
use crate::{Error, StopHandle};

mod head;
mod pages;
mod scan;

/// Keys a claim from the head leaves out of its takes, at most: a run that
/// would leave out more (rows that keep failing, or that its closure leaves
/// matching) ends, and the next run starts afresh. Each is a bound parameter
/// of every take.
pub(crate) const MAX_EXCLUDED: usize = 1000;

/// The statement a claim takes its rows with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taking {
    /// A locking select: rows come back in the claim order.
    Select,
    /// A marking `UPDATE … RETURNING`: rows come back in no particular order,
    /// and are put in the claim order.
    Mark,
    /// The same, committed on its own before the closure runs.
    MarkAndCommit,
}

/// What one run of a claim is set up with: the builder's options, checked,
/// and what the backend can do.
pub(crate) struct Plan {
    pub(crate) clause: LockClause,
    pub(crate) taking: Taking,
    /// The backend has row locks (not SQLite's database write lock).
    pub(crate) row_locks: bool,
    /// The backend has `UPDATE … RETURNING`.
    pub(crate) update_returning: bool,
    /// Contended pages grow on this backend.
    pub(crate) grow_contended_pages: bool,
    /// A row locked by someone else fails the call rather than being skipped.
    pub(crate) fail_on_locked: bool,
    pub(crate) batch: i64,
    pub(crate) page_size: Option<i64>,
    pub(crate) drain: bool,
    pub(crate) max_rows: Option<u64>,
    /// The claim order is the key's, so a row's key is its position.
    pub(crate) ordered_by_key: bool,
    /// A failing closure's rows are rolled back and passed over, and the call
    /// goes on.
    pub(crate) keep_going: bool,
    /// Once triggered, the claim ends before its next statement.
    pub(crate) stop: Option<StopHandle>,
    /// A worker runs the claim over and over: its spans are at trace level,
    /// and the worker reports its rows' failures itself, with their errors.
    pub(crate) in_worker: bool,
    /// Each take re-runs the query from its head, with no candidates read
    /// first.
    pub(crate) from_head: bool,
    /// From the head, a row whose closure failed may be handed over again
    /// in the same call (a worker without a backoff of its own).
    pub(crate) failed_again: bool,
}

/// One run of a claim, as a state machine: [`next`](Self::next) says what to
/// read or claim next, and the driver (blocking here, async in `aio`) reports
/// back what it read. Everything but the I/O and the closure is decided here, so
/// both drivers claim alike. What both modes share is here; what only takes
/// from the head or only the scan of pages keep is in its [`Mode`].
// Public in name only, as the kinds' trait returns it; not reachable.
#[allow(missing_debug_implementations)]
pub struct Claim<K> {
    pub(crate) clause: LockClause,
    pub(crate) taking: Taking,
    /// A mark is one statement that is atomic on its own (`UPDATE … RETURNING`
    /// with row locks).
    pub(crate) one_statement_mark: bool,
    fail_on_locked: bool,
    /// `nowait` was asked for: a lock taken up front (SQLite's write lock) is
    /// not waited for either.
    pub(crate) nowait: bool,
    /// See [`Plan::keep_going`] (for the span).
    #[cfg_attr(not(feature = "tracing"), allow(dead_code))]
    keep_going: bool,
    stop: Option<StopHandle>,
    /// See [`Plan::in_worker`].
    in_worker: bool,
    progress: Progress,
    /// Keys every statement leaves out, and the same shared by the ranges.
    excluded: Vec<K>,
    excluded_shared: Arc<[K]>,
    /// The only keys every statement may take, if set (see
    /// [`among`](Self::among)).
    among: Option<Arc<[K]>>,
    mode: Mode<K>,
}

/// How a claim finds its rows, with what only that way keeps.
// One per claim: boxing the scan would only add an allocation to each call.
#[allow(clippy::large_enum_variant)]
enum Mode<K> {
    /// Each take re-runs the query from its head, with no candidates read
    /// first ([`Plan::from_head`]).
    Head(HeadTakes<K>),
    /// Pages of candidates are read without locks, and taken in batches.
    Scan(Scan<K>),
}

/// How far a call has got and how far it may go, which both modes keep to.
struct Progress {
    batch: i64,
    drain: bool,
    /// Rows the call may still take (`max_rows`).
    remaining: u64,
    report: ClaimReport,
}

impl Progress {
    /// How many rows the next take may take: a batch, or what is left of
    /// `max_rows`.
    fn next_limit(&self) -> i64 {
        i64::try_from(self.remaining).map_or(self.batch, |left| left.min(self.batch))
    }
}

/// What a claim does next, for its driver to carry out.
pub(crate) enum Step<K> {
    /// Read up to `limit` keys of the query's rows in the range, without locks,
    /// and hand them to [`Claim::candidates`].
    Candidates(KeyRange<K>, i64),
    /// Read every key of the query's rows in the range, without locks, and hand
    /// them to [`Claim::still_matching`].
    StillMatching(KeyRange<K>),
    /// Claim up to `limit` rows of the range, in a transaction of the batch's
    /// own (see [`Claim::taken`]), run the closure, and report to
    /// [`Claim::processed`].
    Batch(KeyRange<K>, i64),
    /// The claim is over.
    Done,
}

impl<K> Claim<K> {
    /// A claim run that has not read anything yet.
    pub(crate) fn new(plan: Plan) -> Self {
        // A locking select's rows come back in the claim order, which, the
        // key's, tells each row's position.
        let rows_tell_positions = plan.taking == Taking::Select && plan.ordered_by_key;
        let mode = if plan.from_head {
            Mode::Head(HeadTakes::new(&plan, rows_tell_positions))
        } else {
            Mode::Scan(Scan::new(&plan, rows_tell_positions))
        };
        Claim {
            clause: plan.clause,
            taking: plan.taking,
            one_statement_mark: plan.row_locks && plan.update_returning,
            fail_on_locked: plan.row_locks && plan.fail_on_locked,
            nowait: plan.fail_on_locked,
            keep_going: plan.keep_going,
            stop: plan.stop,
            in_worker: plan.in_worker,
            progress: Progress {
                batch: plan.batch,
                drain: plan.drain,
                remaining: plan.max_rows.unwrap_or(u64::MAX),
                report: ClaimReport::default(),
            },
            excluded: Vec::new(),
            excluded_shared: Arc::new([]),
            among: None,
            mode,
        }
    }
}

impl<K> Claim<K> {
    /// The span of one call of this claim on rows of `table`: its options,
    /// and, recorded when it ends ([`ClaimOutcome::record`]), its report.
    ///
    /// [`ClaimOutcome::record`]: super::ClaimOutcome::record
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(crate) fn span(&self, table: &str) -> Span {
        macro_rules! claim_span {
            ($level:ident) => {
                trace::$level!(
                    "claim",
                    table,
                    from_head = matches!(self.mode, Mode::Head(_)),
                    batch = self.progress.batch,
                    max_rows = (self.progress.remaining < u64::MAX)
                        .then_some(self.progress.remaining),
                    drain = self.progress.drain,
                    keep_going = self.keep_going,
                    on_locked = match (self.nowait, self.clause.skip_locked) {
                        (true, _) => "fail",
                        (false, true) => "skip",
                        (false, false) => "wait",
                    },
                    strength = ?self.clause.strength,
                    processed = trace::Empty,
                    skipped = trace::Empty,
                    locked = trace::Empty,
                    gone = trace::Empty,
                    failed = trace::Empty,
                    timed_out = trace::Empty,
                    not_reached = trace::Empty,
                    passes = trace::Empty,
                    stopped = trace::Empty,
                )
            };
        }
        // A worker's runs are many, most of them empty while it is idle: the
        // worker's own span is the one at info level, and its progress line
        // tells what the runs did.
        if self.in_worker {
            claim_span!(trace_span)
        } else {
            claim_span!(info_span)
        }
    }

    /// The span of one batch of up to `limit` rows, inside the claim's; a
    /// worker's are at trace level, as its claims are.
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(crate) fn batch_span(&self, limit: i64) -> Span {
        macro_rules! batch_span {
            ($level:ident) => {
                trace::$level!("batch", limit, taken = trace::Empty, outcome = trace::Empty)
            };
        }
        if self.in_worker {
            batch_span!(trace_span)
        } else {
            batch_span!(debug_span)
        }
    }

    /// The claim is a worker's run (see [`Plan::in_worker`]).
    pub(crate) fn in_worker(&self) -> bool {
        self.in_worker
    }
}

impl<K: Clone + Eq + Hash> Claim<K> {
    /// What to do next.
    pub(crate) fn next(&mut self) -> Step<K> {
        if let Mode::Head(head) = &self.mode {
            // Asked between two statements: the last batch has ended.
            head.released();
        }
        if self.stop.as_ref().is_some_and(StopHandle::is_stopped) {
            // Between two statements: the last batch has committed.
            return Step::Done;
        }
        let step = match &mut self.mode {
            Mode::Head(head) => head.next(&mut self.progress, self.excluded.len()),
            Mode::Scan(scan) => scan.next(&mut self.progress),
        };
        let (excluded, among) = (self.excluded_shared.clone(), self.among.clone());
        let left_out = |range: KeyRange<K>| range.excluding(excluded).among(among);
        match step {
            Step::Candidates(range, limit) => Step::Candidates(left_out(range), limit),
            Step::StillMatching(range) => Step::StillMatching(left_out(range)),
            Step::Batch(range, limit) => Step::Batch(left_out(range), limit),
            Step::Done => Step::Done,
        }
    }

    /// Takes the rows at `keys` alone, each once at most: a worker recording
    /// the failure of rows whose session ended under them.
    pub(crate) fn among(&mut self, keys: Vec<K>) {
        self.progress.remaining = self.progress.remaining.min(keys.len() as u64);
        self.among = Some(keys.into());
    }

    /// Leaves the rows at `keys` out of every statement from here on: rows a
    /// worker backs off from, and, from the head, rows a take met again.
    pub(crate) fn exclude(&mut self, keys: impl IntoIterator<Item = K>) {
        let before = self.excluded.len();
        self.excluded.extend(keys);
        if self.excluded.len() > before {
            self.excluded_shared = self.excluded.iter().cloned().collect();
        }
    }

    /// Takes from the head steer around the batches `sibling`'s other loops
    /// hold, and tell it the batches they take (see
    /// [`siblings`](crate::claim::siblings)), where they can
    /// ([`HeadTakes::beside`]).
    pub(crate) fn beside(&mut self, sibling: Sibling<K>) {
        if let Mode::Head(head) = &mut self.mode {
            head.beside(sibling);
        }
    }

    /// The keys [`Step::Candidates`] read.
    pub(crate) fn candidates(&mut self, keys: Vec<K>) {
        let Mode::Scan(scan) = &mut self.mode else {
            unreachable!("candidates read by a claim from the head");
        };
        scan.candidates(keys);
    }

    /// The keys [`Step::StillMatching`] read.
    pub(crate) fn still_matching(&mut self, keys: Vec<K>) {
        let Mode::Scan(scan) = &mut self.mode else {
            unreachable!("still_matching read by a claim from the head");
        };
        scan.still_matching(keys, &mut self.progress);
    }

    /// Records the rows a [`Step::Batch`] claimed (it asked for `limit`), in its
    /// transaction, and returns them as the closure gets them.
    pub(crate) fn taken<R>(
        &mut self,
        rows: Vec<R>,
        limit: i64,
        key_of: impl Fn(&R) -> K,
    ) -> Result<Vec<R>, Error> {
        match &mut self.mode {
            Mode::Head(head) => {
                let (rows, again) = head.taken(rows, limit, &self.progress, key_of);
                self.exclude(again);
                Ok(rows)
            }
            Mode::Scan(scan) => scan.taken(rows, limit, self.taking != Taking::Select, key_of),
        }
    }

    /// With [`nowait`](crate::ClaimBuilder::nowait), the range to read keys of (without
    /// locks) after [`taken`](Self::taken), for
    /// [`verify_none_locked`](Self::verify_none_locked): the batch's range up to
    /// where it reached.
    pub(crate) fn locked_check(&self, mut range: KeyRange<K>) -> Option<KeyRange<K>> {
        let Mode::Scan(scan) = &self.mode else {
            return None;
        };
        range.through = scan.page()?.reached.clone();
        self.fail_on_locked.then_some(range)
    }

    /// Fails if a key [`locked_check`](Self::locked_check)'s range still
    /// matches the query but is not in the batch: someone else holds its lock.
    pub(crate) fn verify_none_locked<R>(
        &self,
        keys: Vec<K>,
        rows: &[R],
        key_of: impl Fn(&R) -> K,
    ) -> Result<(), Error> {
        let taken: HashSet<K> = rows.iter().map(key_of).collect();
        if keys.iter().any(|key| !taken.contains(key)) {
            trace::info!("lock not available: a candidate is locked by another transaction");
            return Err(Error::LockNotAvailable);
        }
        Ok(())
    }

    /// The batch committed with `rows` processed.
    pub(crate) fn processed(&mut self, rows: usize) {
        self.progress.report.processed += rows as u64;
        self.progress.remaining -= rows as u64;
    }

    /// The rows at `keys` failed (their closure returned an error or
    /// panicked) and the call goes on without them. From the head, a take
    /// that meets one again (its failure hook left it matching) passes it
    /// over and leaves it out from then on, as any row handed over before;
    /// unless failed rows may be handed over again ([`Plan::failed_again`]).
    pub(crate) fn failed(&mut self, keys: Vec<K>) {
        self.progress.report.failed += keys.len() as u64;
        if let Mode::Head(head) = &mut self.mode {
            head.failed(&keys);
        }
    }

    /// Of the rows that failed, `rows` ran past the claim's timeout.
    pub(crate) fn timed_out(&mut self, rows: usize) {
        self.progress.report.timed_out += rows as u64;
    }

    /// A row taken was gone before the closure got it: another worker took
    /// it since (a visibility timeout's stamp ran out).
    pub(crate) fn gone(&mut self) {
        self.progress.report.gone += 1;
    }

    /// What the claim has done so far; once it is done, its report.
    pub(crate) fn report(&self) -> ClaimReport {
        // Rows found locked in earlier passes were tried again.
        let locked = match &self.mode {
            Mode::Head(_) => 0,
            Mode::Scan(scan) => scan.locked,
        };
        let report = self.progress.report;
        ClaimReport {
            locked,
            skipped: locked + report.gone,
            ..report
        }
    }
}

#[cfg(test)]
mod tests;
