//! Command-line options.

use std::path::PathBuf;
use std::time::Duration;

use crate::db::{BackendKind, Isolation};
use crate::drain::{Mode, BATCH_SIZES};

pub const USAGE: &str = "\
usage: cargo bench --bench throughput --all-features -- [options]

  --quick              smoke test: ~300 rows, workers 1,2,4, short B5 runs, no SVG
                       unless --svg is given; checks correctness only
  --rows N             pending rows per drain (default 10000)
  --workers 1,2,4,8    worker counts (default 1,2,4,8)
  --backend B          postgres, sqlite, mysql or all (default all)
  --only MODE,...      run only these: B0 B1 B2 B3 B3d B3h M1 M2 B4, B5 (contention),
                       IX (the index effect)
  --batches 10,100,1000
                       batch sizes of B3, B3d and B3h (default 10,100,1000)
  --index-effect       run the index effect (10^6 done rows, with and without
                       the partial index; PostgreSQL and SQLite); alone, only it.
                       The full run includes it, --quick does not
  --memory             also measure peak memory at 10^4 and 10^6 pending rows
                       (PostgreSQL and MySQL, in child processes)
  --svg PATH           write the plot there (default docs/throughput.svg, not
                       with --quick)
  --mysql-isolation L  read-committed (default, what claimers on InnoDB should
                       use) or repeatable-read (InnoDB's default), for every
                       MySQL connection
  --sqlite-analyze     run SQLite's drains with the statistics ANALYZE gathers
                       after the refill (every row pending) instead of none
  --repeat R           run every drain R times, interleaved, and report the
                       fastest (default 1)
  --trace              print every statement the drains send (with few --rows)

PostgreSQL: PG_DATABASE_URL, else DATABASE_URL if it is a postgres URL, else
postgres://postgres@127.0.0.1:5432/test. MySQL/MariaDB: MYSQL_DATABASE_URL, else
DATABASE_URL if it is a mysql URL, else mysql://root@127.0.0.1:3306/test. On both
servers the benchmark works in a database of its own, created and dropped by itself.";

/// The id `--only` knows the index-effect measurement by.
pub const INDEX_EFFECT: &str = "IX";

/// Hidden flag: run one memory measurement and print `VmHWM` (see `memory.rs`):
/// `--memory-child BACKEND URL ROWS MODE`.
pub const MEMORY_CHILD_FLAG: &str = "--memory-child";

#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    pub rows: i64,
    pub workers: Vec<usize>,
    pub backends: Vec<BackendKind>,
    /// Mode ids to run (`B0`, `B3h`, `B5`, `IX`, …); `None` runs them all
    /// (all but `IX` with `--quick`).
    pub only: Option<Vec<String>>,
    /// Batch sizes of B3, B3d and B3h.
    pub batches: Vec<u32>,
    pub memory: bool,
    pub svg: Option<PathBuf>,
    pub trace: bool,
    /// Runs of each drain; the fastest is reported.
    pub repeat: u32,
    pub mysql_isolation: Isolation,
    /// SQLite's drains run with statistics (`--sqlite-analyze`).
    pub sqlite_analyze: bool,
    /// How long each B5 configuration runs.
    pub contention_time: Duration,
}

/// What the command line asks for.
pub enum Command {
    Bench(Options),
    /// One memory measurement, in a child process.
    MemoryChild {
        backend: BackendKind,
        url: String,
        rows: i64,
        mode: String,
    },
    Help,
}

pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Command, String> {
    let mut args = args.into_iter();
    let mut quick = false;
    let mut rows = None;
    let mut workers = None;
    let mut backends = BackendKind::ALL.to_vec();
    let mut only = None;
    let mut batches = BATCH_SIZES.to_vec();
    let mut memory = false;
    let mut svg = None;
    let mut trace = false;
    let mut repeat = 1;
    let mut mysql_isolation = Isolation::ReadCommitted;
    let mut sqlite_analyze = false;
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            // `cargo bench` passes `--bench` to every bench target.
            "--bench" => {}
            "--quick" => quick = true,
            "--rows" => rows = Some(parse_number(&value()?)?),
            "--workers" => workers = Some(parse_list(&value()?, parse_number)?),
            "--backend" => backends = parse_backends(&value()?)?,
            "--only" => {
                let ids = parse_list(&value()?, |id| Ok(id.to_owned()))?;
                only.get_or_insert_with(Vec::new).extend(ids);
            }
            "--batches" => batches = parse_list(&value()?, parse_number)?,
            "--index-effect" => only
                .get_or_insert_with(Vec::new)
                .push(INDEX_EFFECT.to_owned()),
            "--memory" => memory = true,
            "--svg" => svg = Some(PathBuf::from(value()?)),
            "--trace" => trace = true,
            "--repeat" => repeat = parse_number::<u32>(&value()?)?.max(1),
            "--mysql-isolation" => mysql_isolation = parse_isolation(&value()?)?,
            "--sqlite-analyze" => sqlite_analyze = true,
            "-h" | "--help" => return Ok(Command::Help),
            MEMORY_CHILD_FLAG => {
                return Ok(Command::MemoryChild {
                    backend: parse_backend(&value()?)?,
                    url: value()?,
                    rows: parse_number(&value()?)?,
                    mode: value()?,
                })
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if svg.is_none() && !quick {
        svg = Some(PathBuf::from("docs/throughput.svg"));
    }
    Ok(Command::Bench(Options {
        quick,
        rows: rows.unwrap_or(if quick { 300 } else { 10_000 }),
        workers: workers.unwrap_or(if quick {
            vec![1, 2, 4]
        } else {
            vec![1, 2, 4, 8]
        }),
        backends,
        only,
        batches,
        memory,
        svg,
        trace,
        repeat,
        mysql_isolation,
        sqlite_analyze,
        contention_time: Duration::from_millis(if quick { 200 } else { 2000 }),
    }))
}

impl Options {
    /// Whether this drain mode is to run.
    pub fn runs_mode(&self, mode: Mode) -> bool {
        self.runs(&mode.id_name()) && (!mode.is_sized() || self.batches.contains(&mode.batch))
    }

    /// Whether the mode with this id (`B0`, `B3h`, `B5`, `IX`, …) is to run.
    pub fn runs(&self, id: &str) -> bool {
        match &self.only {
            Some(only) => only.iter().any(|o| o.eq_ignore_ascii_case(id)),
            // The index effect fills a million rows: not in a smoke test.
            None => !(self.quick && id == INDEX_EFFECT),
        }
    }
}

fn parse_number<T: std::str::FromStr>(text: &str) -> Result<T, String> {
    text.replace('_', "")
        .parse()
        .map_err(|_| format!("not a number: `{text}`"))
}

fn parse_list<T>(text: &str, item: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>, String> {
    text.split(',').map(str::trim).map(item).collect()
}

fn parse_backends(text: &str) -> Result<Vec<BackendKind>, String> {
    match text {
        "all" => Ok(BackendKind::ALL.to_vec()),
        one => parse_backend(one).map(|backend| vec![backend]),
    }
}

fn parse_isolation(text: &str) -> Result<Isolation, String> {
    match text {
        "read-committed" | "rc" => Ok(Isolation::ReadCommitted),
        "repeatable-read" | "rr" => Ok(Isolation::RepeatableRead),
        other => Err(format!("unknown isolation level `{other}`")),
    }
}

fn parse_backend(text: &str) -> Result<BackendKind, String> {
    let text = match text {
        "pg" => "postgres",
        "mariadb" => "mysql",
        text => text,
    };
    BackendKind::ALL
        .into_iter()
        .find(|backend| backend.flag() == text)
        .ok_or_else(|| format!("unknown backend `{text}`"))
}
