//! Peak memory at 10^4 and 10^6 pending rows (PostgreSQL, MySQL).
//!
//! Each measurement runs in a child process of its own (this program, re-run
//! with a hidden flag), so that its peak resident set (`VmHWM`) is its alone.

use std::process::Command;
use std::time::Instant;

use crate::cli::MEMORY_CHILD;
use crate::db::{reset_orders, BackendKind, BenchConn};
use crate::drain::{drain, Mode, ModeId};

pub const SIZES: [i64; 2] = [10_000, 1_000_000];

/// Per-row claiming processes at most this many rows per child: all of 10^6
/// rows one transaction at a time would take minutes. The candidate scan
/// pages through keys either way, which is what could grow with the queue.
pub const PER_ROW_CAP: u64 = 10_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryMode {
    /// B3 with n = 1000, draining the whole queue.
    Batched,
    /// `claim_each` with the default page size, capped at [`PER_ROW_CAP`] rows.
    PerRow,
}

impl MemoryMode {
    pub const ALL: [MemoryMode; 2] = [MemoryMode::Batched, MemoryMode::PerRow];

    pub fn flag(self) -> &'static str {
        match self {
            MemoryMode::Batched => "batched",
            MemoryMode::PerRow => "per-row",
        }
    }

    pub fn describe(self) -> String {
        match self {
            MemoryMode::Batched => "batched claim, n = 1000, whole queue drained".to_owned(),
            MemoryMode::PerRow => {
                format!("claim_each, default page size, first {PER_ROW_CAP} rows")
            }
        }
    }

    fn from_flag(flag: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|mode| mode.flag() == flag)
            .ok_or_else(|| format!("unknown memory mode `{flag}`"))
    }
}

#[derive(Debug, Clone)]
pub struct MemoryRun {
    pub backend: BackendKind,
    pub mode: MemoryMode,
    pub pending: i64,
    pub processed: u64,
    pub peak_kib: u64,
}

/// Runs one child per mode and size on the database at `url`.
pub fn measure<C: BenchConn>(url: &str) -> Result<Vec<MemoryRun>, String> {
    let program = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut runs = Vec::new();
    for mode in MemoryMode::ALL {
        for pending in SIZES {
            let backend = C::BACKEND;
            eprintln!(
                "{} memory: {} at {pending} pending rows…",
                backend.name(),
                mode.flag()
            );
            let output = Command::new(&program)
                .arg(format!("--{MEMORY_CHILD}"))
                .args([backend.flag(), url])
                .args([&pending.to_string(), mode.flag()])
                .output()
                .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
            let stdout = String::from_utf8_lossy(&output.stdout);
            if !output.status.success() {
                return Err(format!(
                    "the memory child ({} at {pending}) failed: {}{}",
                    mode.flag(),
                    stdout,
                    String::from_utf8_lossy(&output.stderr)
                ));
            }
            runs.push(MemoryRun {
                backend,
                mode,
                pending,
                processed: field(&stdout, "processed:")?,
                peak_kib: field(&stdout, "VmHWM:")?,
            });
        }
    }
    Ok(runs)
}

/// The number after `name` on the line that starts with it.
fn field(text: &str, name: &str) -> Result<u64, String> {
    text.lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| format!("no `{name}` in the child's output: {text}"))
}

/// In the child: fills the queue with `pending` rows, claims as `mode` says,
/// checks the outcome and prints what it processed and its peak memory.
pub fn child<C: BenchConn>(url: &str, pending: i64, mode: &str) -> Result<(), String> {
    let mode = MemoryMode::from_flag(mode)?;
    let mut conn = C::open(url).map_err(|e| format!("cannot connect: {e}"))?;
    reset_orders(&mut conn, pending).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let processed = match mode {
        MemoryMode::Batched => {
            drain(&mut conn, Mode::new(ModeId::B3, 1000)).map(|drained| drained.processed)
        }
        MemoryMode::PerRow => conn.claim_rows(Some(PER_ROW_CAP)),
    }
    .map_err(|e| e.to_string())?;
    let expected = match mode {
        MemoryMode::Batched => pending as u64,
        MemoryMode::PerRow => PER_ROW_CAP.min(pending as u64),
    };
    if processed != expected {
        return Err(format!("processed {processed} rows, expected {expected}"));
    }
    println!(
        "processed: {processed} in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    let peak = status
        .lines()
        .find(|line| line.starts_with("VmHWM:"))
        .ok_or("no VmHWM in /proc/self/status")?;
    println!("{peak}");
    Ok(())
}
