//! `cargo xtask harness`: diesel-claim beside the job queues users pick
//! instead, in `postgresql-job-queue-benchmarking` (GitHub:
//! hardbyte/postgresql-job-queue-benchmarking), a harness this repository
//! did not write.
//!
//! It builds the adapter (`harness-adapter/`) in release, registers it with
//! the harness checkout given (`harness-adapter/external-adapters.patch`,
//! applied once: the harness has no other way to learn of an adapter kept
//! outside it), and runs
//! the cells asked for, each system alone on a fresh private PostgreSQL
//! server configured with the harness's `postgres.conf` (as the harness
//! gives each system a fresh server of its own), then combines each cell's
//! runs into one report and prints the medians of the repeats.
//!
//! The checkout must be at the commit the patch is made for (93677ca), have
//! its `.venv` (`uv sync --extra dev`), and run without Docker: use a server
//! it did not start (`BENCH_EXTERNAL_PG`) and run adapters as host processes
//! (`BENCH_NATIVE_ADAPTERS`). The harness does not do that itself; a patch
//! that makes it do so is given with `--no-docker-patch` and applied once.
//! Other systems than diesel-claim need their own setup there
//! (`harness-adapter/README.md`).

use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use clap::ValueEnum;

use crate::{cargo_program, shown, Error};

/// The system the adapter registers.
const SYSTEM: &str = "diesel-claim";

/// What `cargo run` sets for the program it runs (besides `CARGO_PKG_*`),
/// and this workspace's target directory.
const CARGO_RUN_VARIABLES: &[&str] = &[
    "CARGO",
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_CRATE_NAME",
    "CARGO_BIN_NAME",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_TARGET_DIR",
];

/// Where the harness prints its run's directory, on stderr.
const RESULTS_AT: &str = "[harness] results at: ";

/// What to run.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The harness checkout
    #[arg(long)]
    harness: PathBuf,
    /// A patch that lets the harness run without Docker (`BENCH_EXTERNAL_PG`,
    /// `BENCH_NATIVE_ADAPTERS`), applied to the checkout if it lacks them
    #[arg(long)]
    no_docker_patch: Option<PathBuf>,
    /// The systems, each run alone on a server of its own, in this order
    #[arg(long, value_delimiter = ',', default_value = SYSTEM)]
    systems: Vec<String>,
    /// The sets of cells to run
    #[arg(long, value_delimiter = ',', default_value = "smoke")]
    cells: Vec<CellSet>,
    /// How many times each cell runs
    #[arg(long, default_value_t = 1)]
    repeats: u32,
    /// Each measured phase's length, as the harness writes durations (90s,
    /// 5m); by default 60s for smoke, 30m for soak, 5m otherwise
    #[arg(long)]
    length: Option<String>,
    /// The warmup's length; by default 20s for smoke, 60s otherwise
    #[arg(long)]
    warmup: Option<String>,
    /// The jobs each of the adapter's claims takes (its `DIESEL_CLAIM_BATCH`;
    /// by default the adapter's, 10)
    #[arg(long)]
    claim_batch: Option<usize>,
    /// Instead of cells: one cell of these `bench run` arguments, as given
    /// (the phases and producer settings; the systems come from --systems)
    #[arg(last = true)]
    bench_args: Vec<String>,
}

/// The named sets of cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CellSet {
    /// 200 jobs/s at 16 workers, short phases: that everything works
    Smoke,
    /// 200 and 1,000 jobs/s at 16 workers
    Fixed,
    /// A queue kept 4,000 deep, at 4, 16 and 64 workers
    Depth,
    /// Workers killed (two replicas), sessions ended, connections exhausted
    Chaos,
    /// A transaction left idle, and 1.5 times the offered load (the
    /// harness's `--high-load-multiplier`)
    Pressure,
    /// 200 jobs/s at 16 workers for 30 minutes: dead tuples over time
    Soak,
    /// Every set but smoke
    All,
}

/// One cell: the arguments of `bench run` that make it.
struct Cell {
    name: String,
    args: Vec<String>,
    /// The high-load phase raises the rate through the control file, which
    /// only a self-paced producer reads.
    self_paced: bool,
}

impl Cell {
    fn new(name: &str, args: &[&str], phases: &[String]) -> Cell {
        let mut all: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
        for phase in phases {
            all.extend(["--phase".to_owned(), phase.clone()]);
        }
        Cell {
            name: name.to_owned(),
            args: all,
            self_paced: false,
        }
    }
}

/// The cells of `set`, with phases of `length` after a warmup of `warmup`.
fn cells(set: CellSet, length_asked: Option<&str>, warmup_asked: Option<&str>) -> Vec<Cell> {
    let (default_length, default_warmup) = match set {
        CellSet::Smoke => ("60s", "20s"),
        CellSet::Soak => ("30m", "60s"),
        _ => ("5m", "60s"),
    };
    let length = length_asked.unwrap_or(default_length);
    let warmup = format!("warmup=warmup:{}", warmup_asked.unwrap_or(default_warmup));
    let phases = |rest: &[&str]| -> Vec<String> {
        std::iter::once(warmup.clone())
            .chain(rest.iter().map(|phase| format!("{phase}:{length}")))
            .collect()
    };
    let steady = |rate: &'static str| ["--producer-rate", rate, "--worker-count", "16"];
    match set {
        CellSet::Smoke => vec![Cell::new(
            "smoke-200",
            &steady("200"),
            &phases(&["clean=clean"]),
        )],
        CellSet::Fixed => ["200", "1000"]
            .into_iter()
            .map(|rate| {
                Cell::new(
                    &format!("fixed-{rate}"),
                    &steady(rate),
                    &phases(&["clean=clean"]),
                )
            })
            .collect(),
        CellSet::Depth => ["4", "16", "64"]
            .into_iter()
            .map(|workers| {
                Cell::new(
                    &format!("depth-4000-w{workers}"),
                    &[
                        "--producer-mode",
                        "depth-target",
                        "--target-depth",
                        "4000",
                        "--worker-count",
                        workers,
                    ],
                    &phases(&["clean=clean"]),
                )
            })
            .collect(),
        CellSet::Chaos => {
            // Two replicas at 100 jobs/s each: one carries the load while
            // the other is killed.
            let replicas = [
                "--replicas",
                "2",
                "--producer-rate",
                "100",
                "--worker-count",
                "16",
            ];
            let one = steady("200");
            vec![
                Cell::new(
                    "chaos-kill-worker",
                    &replicas,
                    &phases(&[
                        "baseline=clean",
                        "kill=kill-worker(instance=0)",
                        "restart=start-worker(instance=0)",
                        "recovery=clean",
                    ]),
                ),
                Cell::new(
                    "chaos-repeated-kill",
                    &replicas,
                    &phases(&[
                        "baseline=clean",
                        "repeated=repeated-kill(instance=0,period=20s)",
                        "recovery=clean",
                    ]),
                ),
                Cell::new(
                    "chaos-pg-backend-kill",
                    &one,
                    &phases(&[
                        "baseline=clean",
                        "kills=pg-backend-kill(rate=2)",
                        "recovery=clean",
                    ]),
                ),
                Cell::new(
                    "chaos-pool-exhaustion",
                    &one,
                    &phases(&[
                        "baseline=clean",
                        "exhaustion=pool-exhaustion(idle_conns=300)",
                        "recovery=clean",
                    ]),
                ),
                // Down for the first half of the phase, then up again.
                Cell::new(
                    "chaos-postgres-restart",
                    &one,
                    &phases(&[
                        "baseline=clean",
                        "restart=postgres-restart",
                        "recovery=clean",
                    ]),
                ),
            ]
        }
        CellSet::Pressure => {
            let one = steady("200");
            let idle = Cell::new(
                "pressure-idle-in-tx",
                &one,
                &phases(&["clean_1=clean", "idle_1=idle-in-tx", "recovery_1=recovery"]),
            );
            let mut high = Cell::new(
                "pressure-high-load",
                &one,
                &phases(&["clean_1=clean", "pressure_1=high-load", "recovery_1=clean"]),
            );
            high.self_paced = true;
            vec![idle, high]
        }
        CellSet::Soak => {
            vec![Cell::new(
                "soak-200",
                &steady("200"),
                &phases(&["clean=clean"]),
            )]
        }
        CellSet::All => [
            CellSet::Fixed,
            CellSet::Depth,
            CellSet::Chaos,
            CellSet::Pressure,
            CellSet::Soak,
        ]
        .into_iter()
        .flat_map(|set| cells(set, length_asked, warmup_asked))
        .collect(),
    }
}

/// Runs the task.
pub fn run(args: &Args) -> Result<(), Error> {
    let harness = args
        .harness
        .canonicalize()
        .map_err(|e| format!("no harness checkout at {}: {e}", args.harness.display()))?;
    let bench = harness.join(".venv/bin/bench");
    if !bench.is_file() {
        return Err(format!(
            "{} is missing: run `uv sync --extra dev` in the checkout first",
            bench.display()
        )
        .into());
    }
    let cells: Vec<Cell> = if args.bench_args.is_empty() {
        args.cells
            .iter()
            .copied()
            .flat_map(|set| cells(set, args.length.as_deref(), args.warmup.as_deref()))
            .collect()
    } else {
        vec![Cell {
            name: "custom".to_owned(),
            // High-load phases, named or in a scenario's name; a scenario
            // that hides one needs `PRODUCER_PACING=adapter` set by hand.
            self_paced: args
                .bench_args
                .iter()
                .any(|arg| arg.contains("high-load") || arg.contains("high_load")),
            args: args.bench_args.clone(),
        }]
    };

    let workspace = workspace_root();
    let adapter_dir = workspace.join("harness-adapter");
    register(&harness, &adapter_dir, args.no_docker_patch.as_deref())?;
    let release = build(&workspace)?;
    let adapter_bin = release.join("diesel-claim-bench");
    let server_bin = release.join("private-postgres");
    // The harness passes adapters only the settings it knows of: the
    // adapter's own goes through `env`.
    let mut argv = Vec::new();
    if let Some(batch) = args.claim_batch {
        argv.extend(["env".to_owned(), format!("DIESEL_CLAIM_BATCH={batch}")]);
    }
    argv.push(adapter_bin.to_string_lossy().into_owned());
    let argv: Vec<String> = argv.iter().map(|arg| json_string(arg)).collect();
    let external = format!(
        r#"{{"{SYSTEM}": {{"dir": {}, "argv": [{}]}}}}"#,
        json_string(&adapter_dir.to_string_lossy()),
        argv.join(", "),
    );

    let stamp = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let out = harness.join("results").join(format!("xtask-{stamp}"));
    std::fs::create_dir_all(&out)?;
    let index_path = out.join("index.tsv");
    let mut index = String::from("cell\trepeat\tsystem\trun\n");
    let mut failed = Vec::new();
    for cell in &cells {
        for repeat in 1..=args.repeats {
            let mut runs = Vec::new();
            for system in &args.systems {
                let what = format!("{} #{repeat} {system}", cell.name);
                println!("\n==> cell {what}");
                match run_cell(&harness, &server_bin, &external, cell, system) {
                    Ok(run) => {
                        writeln!(
                            index,
                            "{}\t{repeat}\t{system}\t{}",
                            cell.name,
                            run.display()
                        )?;
                        std::fs::write(&index_path, &index)?;
                        runs.push(run);
                    }
                    Err(error) => {
                        eprintln!("xtask: cell {what} failed: {error}");
                        failed.push(what);
                    }
                }
            }
            if runs.len() > 1 {
                let combined = out.join(format!("{}-r{repeat}", cell.name));
                let mut combine = Command::new(&bench);
                combine
                    .current_dir(&harness)
                    .arg("combine")
                    .arg("--out")
                    .arg(&combined)
                    .args(&runs);
                if let Err(error) = status(&mut combine) {
                    eprintln!("xtask: {error}");
                }
            }
        }
    }
    println!("\nruns listed in {}", index_path.display());
    summarize(&harness, &index_path)?;
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("cells failed: {}", failed.join(", ")).into())
    }
}

/// The workspace's root: xtask's parent.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_owned()
}

/// Applies to the checkout what it lacks: running without Docker (the
/// user's `no_docker_patch`) and `external-adapters.patch` (this adapter,
/// kept outside it).
fn register(
    harness: &Path,
    adapter_dir: &Path,
    no_docker_patch: Option<&Path>,
) -> Result<(), Error> {
    let lacks = |file: &str, mark: &str| -> Result<bool, Error> {
        Ok(!std::fs::read_to_string(harness.join(file))?.contains(mark))
    };
    if lacks("bench_harness/orchestrator.py", "BENCH_EXTERNAL_PG")? {
        let patch = no_docker_patch.ok_or(
            "the harness checkout starts its servers and adapters in Docker: give \
             --no-docker-patch <file>, a patch that adds BENCH_EXTERNAL_PG and \
             BENCH_NATIVE_ADAPTERS to bench_harness/",
        )?;
        apply(harness, &patch.canonicalize()?)?;
    }
    if lacks("bench_harness/adapters.py", "BENCH_EXTERNAL_ADAPTERS")? {
        apply(harness, &adapter_dir.join("external-adapters.patch"))?;
    } else if lacks("bench_harness/hooks.py", "BENCH_PG_STOP_CMD")? {
        return Err(
            "the checkout holds an older external-adapters.patch, without the \
                    native postgres-restart: `git checkout bench_harness/` there, and run \
                    the task again"
                .into(),
        );
    }
    Ok(())
}

/// `git apply`s `patch` in the checkout.
fn apply(harness: &Path, patch: &Path) -> Result<(), Error> {
    status(
        Command::new("git")
            .arg("apply")
            .arg(patch)
            .current_dir(harness),
    )
}

/// Builds the adapter and the private server's program in release; the
/// directory that holds them.
fn build(workspace: &Path) -> Result<PathBuf, Error> {
    let revision = revision(workspace);
    status(
        Command::new(cargo_program())
            .args(["build", "--release", "--package", "diesel-claim-harness"])
            .env("DIESEL_CLAIM_REVISION", &revision)
            .current_dir(workspace),
    )?;
    Ok(crate::target_dir(workspace).join("release"))
}

/// The workspace's commit, and whether files differ from it: what the
/// adapter reports as its version.
fn revision(workspace: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(workspace)
            .output()
            .ok()
            .filter(|output| output.status.success())
            .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
    };
    match (
        git(&["rev-parse", "--short", "HEAD"]),
        git(&["status", "--porcelain"]),
    ) {
        (Some(commit), Some(changes)) if changes.is_empty() => format!("diesel-claim {commit}"),
        (Some(commit), _) => format!("diesel-claim {commit} with local changes"),
        (None, _) => "diesel-claim (no git revision)".to_owned(),
    }
}

/// Runs one cell for one system on a fresh private server; the harness's
/// run directory.
fn run_cell(
    harness: &Path,
    server_bin: &Path,
    external: &str,
    cell: &Cell,
    system: &str,
) -> Result<PathBuf, Error> {
    let server = PrivatePostgres::start(server_bin, &harness.join("postgres.conf"))?;
    let control = |verb: &str| {
        format!(
            "{} --send {} {verb}",
            server_bin.display(),
            server.control.display()
        )
    };
    let mut command = Command::new(harness.join(".venv/bin/bench"));
    command
        .current_dir(harness)
        // The `postgres-restart` phase, on the private server.
        .env("BENCH_PG_STOP_CMD", control("stop"))
        .env("BENCH_PG_START_CMD", control("start"))
        .env("BENCH_EXTERNAL_PG", "1")
        .env("BENCH_NATIVE_ADAPTERS", "1")
        .env("BENCH_PG_HOST", "127.0.0.1")
        .env("BENCH_PG_PORT", &server.port)
        .env("BENCH_PG_USER", "postgres")
        .env("BENCH_PG_PASSWORD", "postgres")
        .env("BENCH_EXTERNAL_ADAPTERS", external)
        .args(["run", "--systems", system, "--pg-image", "private-postgres"])
        .args(&cell.args)
        .stderr(Stdio::piped());
    if cell.self_paced {
        command.env("PRODUCER_PACING", "adapter");
    }
    // What cargo told this task about itself is not the harness's business,
    // and its Rust adapters' builds would take it for a change: `ring`'s
    // build script runs again when `CARGO_MANIFEST_DIR` changes.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if CARGO_RUN_VARIABLES.contains(&name.as_ref()) || name.starts_with("CARGO_PKG_") {
            command.env_remove(name.as_ref());
        }
    }
    println!("\n==> {}", shown(&command));
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", shown(&command)))?;
    // The harness's log passes through; its last words name the run.
    let mut run_dir = None;
    for line in BufReader::new(child.stderr.take().expect("piped")).lines() {
        let line = line?;
        eprintln!("{line}");
        if let Some(dir) = line.strip_prefix(RESULTS_AT) {
            run_dir = Some(PathBuf::from(dir.trim()));
        }
    }
    let exit = child.wait()?;
    drop(server);
    match run_dir {
        Some(dir) if exit.success() => Ok(dir),
        _ => Err(format!("bench run ended with {exit}").into()),
    }
}

/// The adapter's `private-postgres` program, serving while its stdin is
/// open.
struct PrivatePostgres {
    child: Child,
    stdin: Option<ChildStdin>,
    port: String,
    /// Its control socket, to which `private-postgres --send` sends `stop`
    /// and `start`.
    control: PathBuf,
}

impl PrivatePostgres {
    fn start(program: &Path, conf: &Path) -> Result<PrivatePostgres, Error> {
        let control = std::env::temp_dir().join(format!(
            "diesel-claim-private-postgres-{}.sock",
            std::process::id()
        ));
        let mut child = Command::new(program)
            .arg(conf)
            .arg(&control)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
        let stdin = child.stdin.take();
        let mut url = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut url)?;
        // postgres://postgres@127.0.0.1:<port>/postgres
        let port = url
            .trim()
            .rsplit_once(':')
            .and_then(|(_, rest)| rest.split('/').next())
            .filter(|port| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| format!("the private server did not start (it printed {url:?})"))?
            .to_owned();
        println!("\n==> private PostgreSQL at {}", url.trim());
        Ok(PrivatePostgres {
            child,
            stdin,
            port,
            control,
        })
    }
}

impl Drop for PrivatePostgres {
    /// Closes its stdin, on which it stops the server and removes its data,
    /// and waits for it.
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

/// Prints, per cell, system and measured phase, the medians over the
/// repeats of each run's phase medians.
fn summarize(harness: &Path, index: &Path) -> Result<(), Error> {
    let python = harness.join(".venv/bin/python");
    let mut command = Command::new(python);
    command.arg("-c").arg(SUMMARY).arg(index);
    status(&mut command)
}

/// The summary, in the harness's Python, which reads its own `summary.json`.
const SUMMARY: &str = r#"
import csv, json, statistics, sys
from collections import defaultdict
rows = defaultdict(list)
for entry in csv.DictReader(open(sys.argv[1]), delimiter="\t"):
    summary = json.load(open(f"{entry['run']}/summary.json"))
    for system, body in summary["systems"].items():
        for phase, block in body["phases"].items():
            rows[(entry["cell"], system, phase)].append(block)
def median(blocks, metric, field="median"):
    values = [(b["metrics"].get(metric) or {}).get(field) for b in blocks]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
def shown(value):
    return "-" if value is None else f"{value:,.1f}"
print(f"{'cell':24} {'system':14} {'phase':12} {'n':>2} {'enq/s':>8} {'done/s':>8} "
      f"{'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>9} {'depth pk':>9} {'dead pk':>9}")
for (cell, system, phase), blocks in rows.items():
    dead = [b.get("peak_dead_tup") for b in blocks if b.get("peak_dead_tup") is not None]
    print(f"{cell:24} {system:14} {phase:12} {len(blocks):>2} "
          f"{shown(median(blocks, 'enqueue_rate')):>8} {shown(median(blocks, 'completion_rate')):>8} "
          f"{shown(median(blocks, 'claim_p50_ms')):>8} {shown(median(blocks, 'claim_p95_ms')):>8} "
          f"{shown(median(blocks, 'claim_p99_ms')):>9} {shown(median(blocks, 'queue_depth', 'peak')):>9} "
          f"{shown(statistics.median(dead) if dead else None):>9}")
"#;

/// Runs `command`, failing if it does.
fn status(command: &mut Command) -> Result<(), Error> {
    let exit = command
        .status()
        .map_err(|e| format!("cannot run {}: {e}", shown(command)))?;
    if exit.success() {
        Ok(())
    } else {
        Err(format!("{} failed ({exit})", shown(command)).into())
    }
}

/// `text` as a JSON string.
fn json_string(text: &str) -> String {
    let mut quoted = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(quoted, "\\u{:04x}", c as u32);
            }
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `--phase` values of `cell`.
    fn phases(cell: &Cell) -> Vec<&str> {
        cell.args
            .windows(2)
            .filter(|pair| pair[0] == "--phase")
            .map(|pair| pair[1].as_str())
            .collect()
    }

    #[test]
    fn every_cell_starts_with_a_warmup_and_names_its_phases_as_the_harness_reads_them() {
        let all = cells(CellSet::All, None, None);
        assert_eq!(all.len(), 2 + 3 + 5 + 2 + 1);
        for cell in all.iter().chain(&cells(CellSet::Smoke, None, None)) {
            let phases = phases(cell);
            assert!(phases.len() >= 2, "{}", cell.name);
            assert!(phases[0].starts_with("warmup=warmup:"), "{}", cell.name);
            for phase in phases {
                let (label, rest) = phase.split_once('=').unwrap();
                assert!(label.starts_with(|c: char| c.is_ascii_alphabetic()));
                assert!(label.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
                let duration = rest.rsplit_once(':').unwrap().1;
                assert!(duration.ends_with(['s', 'm']), "{phase}");
            }
        }
    }

    #[test]
    fn lengths_asked_for_apply_to_every_set_and_defaults_stay_per_set() {
        let all = cells(CellSet::All, None, None);
        let soak = all.iter().find(|cell| cell.name == "soak-200").unwrap();
        assert_eq!(phases(soak), ["warmup=warmup:60s", "clean=clean:30m"]);
        let fixed = all.iter().find(|cell| cell.name == "fixed-1000").unwrap();
        assert_eq!(phases(fixed), ["warmup=warmup:60s", "clean=clean:5m"]);
        let smoke = &cells(CellSet::Smoke, None, None)[0];
        assert_eq!(phases(smoke), ["warmup=warmup:20s", "clean=clean:60s"]);
        for cell in cells(CellSet::All, Some("90s"), Some("10s")) {
            let phases = phases(&cell);
            assert_eq!(phases[0], "warmup=warmup:10s");
            assert!(phases[1..].iter().all(|phase| phase.ends_with(":90s")));
        }
    }

    #[test]
    fn the_server_restart_is_a_chaos_cell_of_its_own() {
        let chaos = cells(CellSet::Chaos, Some("60s"), Some("20s"));
        let restart = chaos
            .iter()
            .find(|cell| cell.name == "chaos-postgres-restart")
            .unwrap();
        assert_eq!(
            phases(restart),
            [
                "warmup=warmup:20s",
                "baseline=clean:60s",
                "restart=postgres-restart:60s",
                "recovery=clean:60s"
            ]
        );
    }

    #[test]
    fn only_the_high_load_cell_paces_itself() {
        let paced: Vec<_> = cells(CellSet::All, None, None)
            .into_iter()
            .filter(|cell| cell.self_paced)
            .map(|cell| cell.name)
            .collect();
        assert_eq!(paced, ["pressure-high-load"]);
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(json_string("tab\t"), r#""tab\u0009""#);
    }
}
