//! The printed report: the median of repeated drains, markdown tables (to paste
//! into BENCHMARKS.md) and the bar checks.

use std::fmt::Write;

use crate::contention::ContentionRun;
use crate::db::BackendKind;
use crate::drain::{DrainRun, EmptyQueueCheck, Mode, ModeId};
use crate::index_effect::{IndexEffect, IndexRun};
use crate::memory::{MemoryMode, MemoryRun};
use crate::pickup::{PickupRun, WakeUp, POLL};

/// Every figure one run measured.
#[derive(Debug, Default)]
pub struct Results {
    /// In mode order, then worker count, per backend.
    pub drains: Vec<DrainRuns>,
    pub contention: Vec<ContentionRun>,
    pub empty_queue: Vec<EmptyQueueCheck>,
    pub memory: Vec<MemoryRun>,
    pub index_effect: Vec<IndexEffect>,
    pub pickup: Vec<PickupRun>,
    /// The job runner's drains (JR) and steady states (JS).
    pub job_drains: Vec<crate::jobs::JobRun>,
    pub job_steady: Vec<crate::jobs::JobRun>,
    /// What could not run, and why (a peer without its runtime, for one).
    pub notes: Vec<String>,
}

/// Every run of one backend, mode and worker count (`--repeat` of them).
#[derive(Debug)]
pub struct DrainRuns {
    pub backend: BackendKind,
    pub mode: Mode,
    pub workers: usize,
    pub runs: Vec<DrainRun>,
}

impl DrainRuns {
    pub fn new(backend: BackendKind, mode: Mode, workers: usize) -> Self {
        DrainRuns {
            backend,
            mode,
            workers,
            runs: Vec::new(),
        }
    }

    /// Rows/s of every run, slowest first.
    fn rates(&self) -> Vec<f64> {
        let mut rates: Vec<f64> = self.runs.iter().map(DrainRun::rows_per_sec).collect();
        rates.sort_by(f64::total_cmp);
        rates
    }

    /// The median rows/s (the mean of the middle two for an even count): what
    /// a typical run does. One run slowed, or sped up, by other work on the
    /// machine hardly moves it, where the fastest is one lucky run.
    pub fn median(&self) -> f64 {
        let rates = self.rates();
        let middle = rates.len() / 2;
        if rates.len() % 2 == 1 {
            rates[middle]
        } else {
            (rates[middle - 1] + rates[middle]) / 2.0
        }
    }

    /// The slowest and the fastest run, in percent off the median.
    fn spread(&self) -> String {
        let rates = self.rates();
        let off = |rate: f64| (rate / self.median() - 1.0) * 100.0;
        format!(
            "{:+.1}%, {:+.1}%",
            off(rates[0]),
            off(rates[rates.len() - 1])
        )
    }

    /// A count summed over every run.
    fn total<T: std::iter::Sum>(&self, count: impl Fn(&DrainRun) -> T) -> T {
        self.runs.iter().map(count).sum()
    }

    /// A count per processed row, over every run.
    fn per_row(&self, count: impl Fn(&DrainRun) -> u64) -> f64 {
        self.total(count) as f64 / self.total(|run| run.processed).max(1) as f64
    }
}

impl Results {
    fn drain(&self, backend: BackendKind, mode: Mode, workers: usize) -> Option<&DrainRuns> {
        self.drains
            .iter()
            .find(|runs| runs.backend == backend && runs.mode == mode && runs.workers == workers)
    }

    /// Median rows/s over its hand-written twin's at the same backend and W.
    pub fn versus_twin(&self, runs: &DrainRuns) -> Option<f64> {
        let twin = self.drain(runs.backend, runs.mode.twin()?, runs.workers)?;
        Some(runs.median() / twin.median())
    }

    /// Median rows/s of `crate_mode` over the peer's at the same backend and
    /// W; `None` when either was not measured, or the pair would compare a
    /// per-row claim with a batched peer.
    pub fn versus_peer(&self, peer: &DrainRuns, crate_mode: Mode) -> Option<f64> {
        if crate_mode.batch == 1 && peer.mode.batch > 1 {
            return None;
        }
        let runs = self.drain(peer.backend, crate_mode, peer.workers)?;
        Some(runs.median() / peer.median())
    }

    /// Every correctness failure, of every run: these, and only these, fail
    /// the run.
    pub fn failures(&self) -> Vec<String> {
        let mut failures: Vec<String> = self
            .drains
            .iter()
            .flat_map(|runs| &runs.runs)
            .flat_map(DrainRun::failures)
            .collect();
        for run in self.contention.iter().filter(|run| run.lost_updates != 0) {
            failures.push(format!(
                "{} B5 {:?} K={} W={}: {} lost updates",
                run.backend.name(),
                run.approach,
                run.hot,
                run.workers,
                run.lost_updates
            ));
        }
        for effect in &self.index_effect {
            failures.extend(effect.failures());
        }
        for check in self.empty_queue.iter().filter(|check| !check.passed()) {
            failures.push(format!("{} empty queue: {check:?}", check.backend.name()));
        }
        failures
    }
}

pub fn drain_table(results: &Results) -> String {
    let mut header = vec![
        ("backend", Text),
        ("mode", Text),
        ("W", Number),
        ("rows/s (median)", Number),
        ("× twin", Number),
        ("commits/row", Number),
        ("statements/row", Number),
        ("duplicates", Number),
        ("leftovers", Number),
    ];
    // A single run has no spread to show.
    let repeated = results.drains.iter().any(|runs| runs.runs.len() > 1);
    if repeated {
        header.insert(4, ("slowest, fastest vs median", Number));
    }
    let rows = results.drains.iter().map(|runs| {
        let twin = results
            .versus_twin(runs)
            .map(|ratio| format!("{ratio:.2} ({})", runs.mode.twin().expect("a twin")))
            .unwrap_or_default();
        let mut row = vec![
            runs.backend.name().to_owned(),
            runs.mode.to_string(),
            runs.workers.to_string(),
            format!("{:.0}", runs.median()),
            twin,
            format!("{:.3}", runs.per_row(|run| run.commits)),
            format!("{:.3}", runs.per_row(|run| run.statements)),
            runs.total(|run| run.checks.duplicates).to_string(),
            runs.total(|run| run.checks.leftovers).to_string(),
        ];
        if repeated {
            row.insert(4, runs.spread());
        }
        row
    });
    markdown_table(&header, rows)
}

/// A line per drain whose transactions (or crate calls) were aborted and ran again.
pub fn aborted_lines(results: &Results) -> String {
    let mut out = String::new();
    for runs in &results.drains {
        let aborted = runs.total(|run| run.aborted);
        if aborted > 0 {
            let _ = writeln!(
                out,
                "- {} {} W={}: {aborted} aborted (deadlock victim, or a row moved to another \
                 partition) and run again, in {} run(s)",
                runs.backend.name(),
                runs.mode,
                runs.workers,
                runs.runs.len()
            );
        }
    }
    out
}

pub const DRAIN_TABLE_NOTES: &str = "\
- statements: every statement the client sent (Diesel `StartQuery` events), `BEGIN` and
  `COMMIT` included; commits: PostgreSQL `pg_stat_database.xact_commit` delta, which
  counts every transaction, read-only and implicit (one per statement outside
  `BEGIN`) ones included; SQLite and MySQL: `COMMIT`s plus writes outside a
  transaction, counted from the statements sent.
- rows/s: the median of the drain's runs (`--repeat`); slowest, fastest (when
  repeated): its slowest and its fastest run, in percent off that median. The
  other columns count every run.
- × twin: median rows/s over the hand-written twin's at the same backend and W
  (B2/B0, B3/B3d at the same n, M1/B1 and M2/B1 at n = 100, O3/O3h at n = 100).
  B3h is B3 without the double check's unlocked read: B3d/B3h is what that read
  costs. O3 claims in priority order (`ORDER BY priority DESC`, the key breaking
  ties); its twin O3h is the one-statement batch `… ORDER BY priority DESC, id
  LIMIT n FOR … SKIP LOCKED`, without a double check.
- partitioned (`--partitioned`): the same mode on an `orders` table partitioned by
  its pending flag (`LIST`, two partitions, the flag in the primary key), so
  that processing a row moves it to the other partition.";

/// The crate modes every peer is held against: per row, batched, and batched
/// with the mark in the claim.
const AGAINST_PEERS: [Mode; 3] = [
    Mode::new(ModeId::B2, 1),
    Mode::new(ModeId::B3, 100),
    Mode::new(ModeId::M1, 100),
];

/// The peers' drains, by backend, then W, then peer.
fn peer_drains(results: &Results) -> Vec<&DrainRuns> {
    let mut peers: Vec<&DrainRuns> = results
        .drains
        .iter()
        .filter(|runs| runs.mode.is_peer())
        .collect();
    let backend = |runs: &DrainRuns| BackendKind::ALL.iter().position(|b| *b == runs.backend);
    let mode = |runs: &DrainRuns| Mode::all().iter().position(|m| *m == runs.mode);
    peers.sort_by_key(|runs| (backend(runs), runs.workers, mode(runs)));
    peers
}

/// One row per peer and W: its figures, and each crate mode's rows/s over
/// the peer's (above 1: the crate is ahead).
pub fn peers_table(results: &Results) -> String {
    let names: Vec<String> = AGAINST_PEERS
        .iter()
        .map(|mode| format!("{mode} ÷ peer"))
        .collect();
    let mut header = vec![
        ("backend", Text),
        ("W", Number),
        ("peer", Text),
        ("rows/s (median)", Number),
        ("commits/row", Number),
        ("statements/row", Number),
    ];
    header.extend(names.iter().map(|name| (name.as_str(), Number)));
    let rows = peer_drains(results).into_iter().map(|runs| {
        let mut row = vec![
            runs.backend.name().to_owned(),
            runs.workers.to_string(),
            runs.mode.to_string(),
            format!("{:.0}", runs.median()),
            format!("{:.3}", runs.per_row(|run| run.commits)),
            format!("{:.3}", runs.per_row(|run| run.statements)),
        ];
        row.extend(AGAINST_PEERS.iter().map(|&mode| {
            results
                .versus_peer(runs, mode)
                .map_or_else(|| "—".to_owned(), |ratio| format!("{ratio:.2}"))
        }));
        row
    });
    markdown_table(&header, rows)
}

/// The cells where a peer is ahead of a crate mode, and what could not run.
pub fn peer_lines(results: &Results) -> String {
    let mut out = String::new();
    for runs in peer_drains(results) {
        for &mode in &AGAINST_PEERS {
            if let Some(ratio) = results.versus_peer(runs, mode).filter(|&r| r < 1.0) {
                let _ = writeln!(
                    out,
                    "- {} W={}: {mode} ÷ {} = {ratio:.2}, the peer ahead by {:.1}%",
                    runs.backend.name(),
                    runs.workers,
                    runs.mode,
                    (1.0 / ratio - 1.0) * 100.0
                );
            }
        }
    }
    for note in &results.notes {
        let _ = writeln!(out, "- {note}");
    }
    out
}

pub const PEERS_NOTES: &str = "\
- The peers do the same work on the same table, each worker with its own connection:
  DJ, the seed's loop in Django 5.2 on psycopg 3 (an unlocked queryset, then per
  order `atomic()` and `select_for_update(of=('self',), skip_locked=True)` on it
  filtered by id, the order's `save()` and its outbox row), one Python process per
  worker; D0, Diesel alone, per row: a transaction around the pending query with
  `.order(id).limit(1).for_update().skip_locked()`, then B0's update and insert, until
  none is found; D3, the same with `.limit(100)` and B3h's writes; FQ, the fang job
  queue (blocking, 0.11): one job per order, enqueued before the clock starts, each
  marking its order and writing its outbox row in a transaction, run by fang's
  `Worker` on a pool of one connection (r2d2's defaults) until a fetch finds none.
- ÷ peer: the crate mode's median rows/s over the peer's at the same backend and W;
  above 1, the crate is ahead. B2 is not held against the batched D3 (—).
- DJ and FQ run on PostgreSQL only (Django on MariaDB would need Python's mysqlclient,
  a C build; fang's blocking queue is PostgreSQL's); D0 and D3 need row locks, which
  SQLite has not (Diesel offers no `FOR UPDATE` there).
- DJ's statements: those Django executed, plus the BEGIN and COMMIT psycopg sends
  around each `atomic()`; FQ's: both of each worker's connections, r2d2's `SELECT 1`
  on each checkout included.";

pub fn contention_table(runs: &[ContentionRun]) -> String {
    let header = [
        ("backend", Text),
        ("K", Number),
        ("W", Number),
        ("approach", Text),
        ("successes/s", Number),
        ("retries/success", Number),
        ("gave up", Number),
        ("lost updates", Number),
    ];
    let rows = runs.iter().map(|run| {
        vec![
            run.backend.name().to_owned(),
            run.hot.to_string(),
            run.workers.to_string(),
            run.approach.name().to_owned(),
            format!("{:.0}", run.successes_per_sec()),
            format!("{:.3}", run.retries_per_success()),
            run.tally.gave_up.to_string(),
            run.lost_updates.to_string(),
        ]
    });
    markdown_table(&header, rows)
}

pub fn empty_queue_lines(checks: &[EmptyQueueCheck]) -> String {
    let mut out = String::new();
    for check in checks {
        let server = check
            .server_transactions
            .map(|n| format!(", {n} transaction(s) counted by the server"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "- {}: one `claim_each` on an empty queue sent {} statement(s), {} BEGIN, {} \
             COMMIT{server}: {}",
            check.backend.name(),
            check.sent.statements,
            check.sent.begins,
            check.sent.commits,
            if check.passed() { "ok" } else { "FAILED" },
        );
    }
    out
}

/// One row per measure and backend: without the index, with it, and how many
/// times faster it is with it.
pub fn index_effect_table(effects: &[IndexEffect]) -> String {
    let header = [
        ("backend", Text),
        ("rows (done + pending)", Text),
        ("measure", Text),
        ("without index", Number),
        ("with index", Number),
        ("× faster with", Number),
    ];
    let millis = |run: &IndexRun| run.empty_call.as_secs_f64() * 1e3;
    type Measure = (&'static str, fn(&IndexRun) -> f64, bool);
    let measures: [Measure; 3] = [
        ("claim_each, nothing pending: ms/call", millis, true),
        (
            "drain, claim_each per row: rows/s",
            |run| run.per_row,
            false,
        ),
        ("drain, batch(100): rows/s", |run| run.batched, false),
    ];
    let rows = effects.iter().flat_map(|effect| {
        measures.iter().map(move |&(what, value, lower_is_better)| {
            let (without, with) = (value(&effect.without), value(&effect.with));
            let faster = if lower_is_better {
                without / with
            } else {
                with / without
            };
            vec![
                effect.backend.name().to_owned(),
                format!("{} + {}", effect.done, effect.pending),
                what.to_owned(),
                format_figure(without),
                format_figure(with),
                format!("{faster:.1}"),
            ]
        })
    });
    markdown_table(&header, rows)
}

/// Three significant figures or so, without a pointless fraction.
fn format_figure(value: f64) -> String {
    match value {
        v if v >= 100.0 => format!("{v:.0}"),
        v if v >= 1.0 => format!("{v:.2}"),
        v => format!("{v:.4}"),
    }
}

/// The plan of the empty call's candidate read, without and with the index.
pub fn index_effect_plans(effects: &[IndexEffect]) -> String {
    let mut out = String::new();
    for effect in effects {
        for (label, run) in effect.runs() {
            let _ = writeln!(
                out,
                "- {}, {label} the index, candidate read ({} empty calls timed): {}",
                effect.backend.name(),
                run.empty_calls,
                run.plan
            );
        }
    }
    out
}

pub fn pickup_table(runs: &[PickupRun]) -> String {
    let header = [
        ("backend", Text),
        ("wake-up", Text),
        ("rows", Number),
        ("median", Number),
        ("p99", Number),
        ("max", Number),
    ];
    let ms = |latency: std::time::Duration| format!("{:.2} ms", latency.as_secs_f64() * 1e3);
    let rows = runs.iter().map(|run| {
        vec![
            run.backend.name().to_owned(),
            run.wake_up.name().to_owned(),
            run.latencies.len().to_string(),
            ms(run.quantile(0.5)),
            ms(run.quantile(0.99)),
            ms(run.max()),
        ]
    });
    markdown_table(&header, rows)
}

pub const PICKUP_NOTES: &str = "\
- latency: from the producer's `COMMIT` returning to the worker's closure starting, one
  row at a time, the queue empty for 20–200 ms between rows; the worker per row
  (`build_claim().worker(&stop)`), polling every 5 ms after rows were found, doubling up
  to every 50 ms while idle; with LISTEN, the producer sends `pg_notify` in the row's
  transaction.";

pub fn memory_table(runs: &[MemoryRun]) -> String {
    let header = [
        ("backend", Text),
        ("what was measured", Text),
        ("pending rows", Number),
        ("rows processed", Number),
        ("peak RSS (VmHWM)", Number),
    ];
    let rows = runs.iter().map(|run| {
        vec![
            run.backend.name().to_owned(),
            run.mode.describe(),
            run.pending.to_string(),
            run.processed.to_string(),
            format!("{} KiB", run.peak_kib),
        ]
    });
    markdown_table(&header, rows)
}

/// How a table column is aligned: text left, numbers right.
#[derive(Clone, Copy)]
pub enum Align {
    Text,
    Number,
}
pub use Align::{Number, Text};

pub fn markdown_table(header: &[(&str, Align)], rows: impl Iterator<Item = Vec<String>>) -> String {
    let line = |cells: Vec<&str>| format!("| {} |\n", cells.join(" | "));
    let mut out = line(header.iter().map(|(name, _)| *name).collect());
    out.push_str(&line(
        header
            .iter()
            .map(|(_, align)| match align {
                Text => "---",
                Number => "--:",
            })
            .collect(),
    ));
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// A bar of the spec and how the run fared against it.
pub struct Bar {
    pub what: String,
    pub value: f64,
    /// The value must be at least this (or at most, with `at_most`).
    pub limit: f64,
    pub at_most: bool,
}

impl Bar {
    fn at_least(what: String, value: f64, limit: f64) -> Self {
        Bar {
            what,
            value,
            limit,
            at_most: false,
        }
    }

    pub fn met(&self) -> bool {
        if self.at_most {
            self.value <= self.limit
        } else {
            self.value >= self.limit
        }
    }

    pub fn verdict(&self) -> String {
        if self.met() {
            "MET".to_owned()
        } else {
            let miss = (self.value / self.limit - 1.0).abs() * 100.0;
            format!("MISSED by {miss:.1}%")
        }
    }
}

/// The bars this run's figures can be held against.
pub fn bars(results: &Results) -> Vec<Bar> {
    let mut bars = Vec::new();
    for runs in results
        .drains
        .iter()
        .filter(|runs| runs.mode.is_crate_mode())
    {
        if let Some(ratio) = results.versus_twin(runs) {
            let twin = runs.mode.twin().expect("a crate mode has a twin");
            bars.push(Bar::at_least(
                format!(
                    "{} {} ≥ 0.9 × {twin}, W={}",
                    runs.backend.name(),
                    runs.mode,
                    runs.workers
                ),
                ratio,
                0.9,
            ));
        }
    }
    for runs in results.drains.iter().filter(|runs| runs.workers == 1) {
        let at_four = results.drain(runs.backend, runs.mode, 4);
        // The peers' scaling is theirs; the bar is the crate's (and its
        // hand-written twins', which it is held against).
        if let (true, true, Some(at_four)) = (
            runs.backend.has_row_locks(),
            runs.mode.skips_locked() && !runs.mode.is_peer(),
            at_four,
        ) {
            bars.push(Bar::at_least(
                format!("{} {}: W=4 ≥ W=1", runs.backend.name(), runs.mode),
                at_four.median() / runs.median(),
                1.0,
            ));
        }
    }
    // The design's bars against the seed's Django loop.
    for django in results
        .drains
        .iter()
        .filter(|runs| runs.mode.id == ModeId::DJ)
    {
        for (mode, times) in [
            (Mode::new(ModeId::B2, 1), 2.0),
            (Mode::new(ModeId::B3, 100), 25.0),
        ] {
            if let Some(ratio) = results.versus_peer(django, mode) {
                bars.push(Bar::at_least(
                    format!(
                        "{} {mode} ≥ {times} × DJ, W={}",
                        django.backend.name(),
                        django.workers
                    ),
                    ratio,
                    times,
                ));
            }
        }
    }
    for (backend, mode) in BackendKind::ALL
        .into_iter()
        .flat_map(|backend| MemoryMode::ALL.map(|mode| (backend, mode)))
    {
        let peak = |pending| {
            results
                .memory
                .iter()
                .find(|run| run.backend == backend && run.mode == mode && run.pending == pending)
                .map(|run| run.peak_kib as f64)
        };
        if let (Some(small), Some(large)) = (peak(10_000), peak(1_000_000)) {
            bars.push(Bar {
                what: format!(
                    "{} peak RSS at 10^6 ≤ 2 × at 10^4: {}",
                    backend.name(),
                    mode.describe()
                ),
                value: large / small,
                limit: 2.0,
                at_most: true,
            });
        }
    }
    for run in &results.pickup {
        let ms = |latency: std::time::Duration| latency.as_secs_f64() * 1e3;
        let (what, value, limit) = match run.wake_up {
            WakeUp::Listen => (
                "p99 pickup with LISTEN ≤ 10 ms",
                ms(run.quantile(0.99)),
                10.0,
            ),
            // The longest wait, then one claim.
            WakeUp::Polling => (
                "max pickup polling ≤ the poll's maximum interval + 10 ms",
                ms(run.max()),
                ms(POLL.1) + 10.0,
            ),
        };
        bars.push(Bar {
            what: format!("{} {what}", run.backend.name()),
            value,
            limit,
            at_most: true,
        });
    }
    bars
}

pub fn bar_lines(bars: &[Bar]) -> String {
    let mut out = String::new();
    for bar in bars {
        let _ = writeln!(out, "- {}: {:.2} — {}", bar.what, bar.value, bar.verdict());
    }
    out
}
