//! DJ: the seed's double-checked loop in Django 5.2 on psycopg 3, one Python
//! process per worker: each has its own interpreter, so that the GIL does not
//! serialize the workers, and its own connection. The loop is
//! `peers/django_loop.py`; the Python it runs on is a virtual environment the
//! benchmark makes once and reuses.

use std::io::{BufRead, BufReader, Lines, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

use super::PeerOutcome;
use crate::database::BenchDb;
use crate::db::BenchConn;
use crate::drain::{DrainRun, Mode, ModeId};

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/throughput/peers/django_loop.py"
);

/// What the virtual environment holds: Django 5.2 on psycopg 3.
const REQUIREMENTS: [&str; 2] = ["Django>=5.2,<5.3", "psycopg[binary]"];

/// Where the virtual environment is made unless this names another.
const VENV_VARIABLE: &str = "DIESEL_CLAIM_BENCH_VENV";

/// The virtual environment's Python, made on first use; the error says why
/// there is none, and DJ is then skipped.
pub fn python() -> Result<&'static Path, String> {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PYTHON.get_or_init(prepare).as_deref().map_err(Clone::clone)
}

/// `$DIESEL_CLAIM_BENCH_VENV`, else `peers-venv` in the target directory the
/// benchmark was built in (it runs from `<target>/release/deps/`), where it
/// outlives the run and goes with `cargo clean`.
fn venv_dir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os(VENV_VARIABLE) {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe().map_err(|e| format!("where is this program? {e}"))?;
    exe.ancestors()
        .nth(3)
        .map(|target| target.join("peers-venv"))
        .ok_or_else(|| format!("no target directory above {}", exe.display()))
}

fn prepare() -> Result<PathBuf, String> {
    let venv = venv_dir()?;
    let python = venv.join("bin").join("python");
    if has_django(&python) {
        return Ok(python);
    }
    eprintln!(
        "DJ: making a Python virtual environment with {} in {} (once; set {VENV_VARIABLE} \
         to put it elsewhere)",
        REQUIREMENTS.join(" and "),
        venv.display()
    );
    run(
        Command::new("python3").args(["-m", "venv"]).arg(&venv),
        "`python3 -m venv` failed: is Python 3 installed, with its venv module (Debian: \
         apt-get install python3-venv)?",
    )?;
    run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(REQUIREMENTS),
        "`pip install` failed (is PyPI reachable?)",
    )?;
    match has_django(&python) {
        true => Ok(python),
        false => Err(format!(
            "{} cannot import Django 5.2 and psycopg",
            python.display()
        )),
    }
}

fn has_django(python: &Path) -> bool {
    Command::new(python)
        .args([
            "-c",
            "import django, psycopg; assert django.VERSION[:2] == (5, 2)",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Runs a setup command, its output on stderr (stdout is the report's).
fn run(command: &mut Command, failed: &str) -> Result<(), String> {
    let status = command.stdout(Stdio::null()).status();
    match status {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!("{failed} ({status})")),
        Err(e) => Err(format!("{failed} ({e})")),
    }
}

/// One Python worker: its process and the two ends of its conversation.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Worker {
    fn start(python: &Path, url: &str) -> Result<Self, String> {
        let mut child = Command::new(python)
            .arg(SCRIPT)
            .env("BENCH_DATABASE_URL", url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("DJ: cannot start {}: {e}", python.display()))?;
        let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
        Ok(Worker {
            child,
            stdin: stdin.expect("piped"),
            lines: BufReader::new(stdout.expect("piped")).lines(),
        })
    }

    /// The next line, which must start with `word`; the rest of it.
    fn expect(&mut self, word: &str) -> Result<String, String> {
        let line = self.lines.next().transpose().map_err(|e| e.to_string())?;
        line.as_deref()
            .and_then(|line| line.strip_prefix(word))
            .map(|rest| rest.trim().to_owned())
            .ok_or_else(|| format!("DJ: a worker said {line:?} where `{word}` was due"))
    }
}

/// Times `workers` Python processes draining the queue (already refilled).
pub fn drain<C: BenchConn>(
    db: &mut BenchDb<C>,
    workers: usize,
    rows: i64,
) -> Result<DrainRun, String> {
    let python = python()?;
    let mut started_workers = Vec::new();
    let mut outcome = Ok(());
    while started_workers.len() < workers && outcome.is_ok() {
        outcome = Worker::start(python, &db.url).map(|worker| started_workers.push(worker));
    }
    let outcome = outcome.and_then(|()| converse(db, &mut started_workers));
    for worker in &mut started_workers {
        // On failure, the others would wait for `go` forever; on success,
        // they have already exited.
        if outcome.is_err() {
            let _ = worker.child.kill();
        }
        let _ = worker.child.wait();
    }
    outcome?.into_run(db, Mode::new(ModeId::DJ, 1), workers, rows)
}

fn converse<C: BenchConn>(
    db: &mut BenchDb<C>,
    workers: &mut [Worker],
) -> Result<PeerOutcome, String> {
    // Everyone imports Django and connects first; the clock starts when all go.
    for worker in workers.iter_mut() {
        worker.expect("ready")?;
    }
    let commits_before = db.server_commits()?;
    for worker in workers.iter_mut() {
        writeln!(worker.stdin, "go").map_err(|e| format!("DJ: {e}"))?;
    }
    let started = Instant::now();
    // Read in start order, the clock stops at the last `done`, whoever sent it.
    let mut finished = started;
    for worker in workers.iter_mut() {
        worker.expect("done")?;
        finished = Instant::now();
    }
    let (mut processed, mut statements) = (0, 0);
    for worker in workers.iter_mut() {
        let counts = worker.expect("counts")?;
        let numbers: Vec<u64> = counts
            .split_whitespace()
            .map(|n| n.parse().map_err(|_| format!("DJ: bad counts {counts:?}")))
            .collect::<Result<_, _>>()?;
        let [rows, statements_sent] = numbers[..] else {
            return Err(format!("DJ: bad counts {counts:?}"));
        };
        processed += rows;
        statements += statements_sent;
    }
    Ok(PeerOutcome {
        started,
        finished,
        processed,
        statements,
        commits_before,
        // Each worker's flush of its statistics after `done`.
        extra_commits: workers.len() as i64,
    })
}
