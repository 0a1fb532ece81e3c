//! CPU time spent during a run, split between the benchmark's own processes
//! and the database server's, read from Linux's `/proc`.
//!
//! On two cores a run of many workers is bound by the CPU, not by round
//! trips: who spends the time per job says where a gap between two runners
//! comes from. Times include processes that ended during the run: a
//! server's exited backends are in their parent's reaped-children times, a
//! worker process's in this one's once it is waited for.

use std::fs;
use std::time::Duration;

/// CPU time used so far, by the benchmark and by the database servers.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTimes {
    pub bench: Duration,
    pub server: Duration,
}

impl CpuTimes {
    /// Now, or zero where `/proc` cannot be read (not Linux).
    pub fn now() -> CpuTimes {
        let mut times = CpuTimes {
            bench: process_times("self").unwrap_or_default(),
            server: Duration::ZERO,
        };
        let Ok(processes) = fs::read_dir("/proc") else {
            return times;
        };
        for entry in processes.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            else {
                continue;
            };
            if is_server(pid) {
                times.server += process_times(pid).unwrap_or_default();
            }
        }
        times
    }

    /// What was spent from `earlier` to `self`.
    pub fn since(self, earlier: CpuTimes) -> CpuTimes {
        CpuTimes {
            bench: self.bench.saturating_sub(earlier.bench),
            server: self.server.saturating_sub(earlier.server),
        }
    }
}

/// Whether process `pid` is PostgreSQL's or MariaDB's.
fn is_server(pid: &str) -> bool {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .is_ok_and(|comm| matches!(comm.trim_end(), "postgres" | "mariadbd" | "mysqld"))
}

/// User and system time of process `pid` and of its children it has waited
/// for.
fn process_times(pid: &str) -> Option<Duration> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may hold spaces and parentheses: fields count from the
    // last ')'. utime, stime, cutime and cstime are fields 14 to 17.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    let ticks: u64 = fields
        .get(11..15)?
        .iter()
        .filter_map(|f| f.parse::<u64>().ok())
        .sum();
    // Linux reports them in USER_HZ, 100 on every architecture it runs.
    Some(Duration::from_millis(ticks * 10))
}
