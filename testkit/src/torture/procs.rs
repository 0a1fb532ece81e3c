//! Worker processes: how they are started, how they talk to the runner, and
//! the real faults the runner inflicts on them (SIGKILL, SIGSTOP, SIGCONT).
//!
//! A worker reports on stdout with lines `torture: <event> key=value …`; every
//! other line (the test harness's own chatter) is ignored. Values contain no
//! spaces.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

const PREFIX: &str = "torture: ";

/// The environment variable that turns the integration test binary into a
/// worker: its value is the worker's arguments, one per line.
pub const WORKER_ENV: &str = "DIESEL_CLAIM_TORTURE_WORKER";

/// How to start a worker: by re-running the current executable, either the
/// `torture` example (`torture worker …`) or the test binary (running the one
/// test that called the suite, with the arguments in [`WORKER_ENV`]).
#[derive(Debug, Clone)]
pub enum Launcher {
    Example,
    #[allow(dead_code)] // Made by the test binary only.
    Test {
        name: String,
    },
}

impl Launcher {
    /// Starts a worker with `args`, adding `env` to its environment, in
    /// network namespace `namespace` if one is given.
    pub fn spawn(&self, args: &[String], env: &[(&str, &str)], namespace: Option<&str>) -> Worker {
        let exe = std::env::current_exe().expect("cannot find the current executable");
        let mut command = match namespace {
            // `ip netns exec` becomes the worker: same process, other network.
            Some(namespace) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", namespace]).arg(exe);
                command
            }
            None => Command::new(exe),
        };
        command.envs(env.iter().copied());
        match self {
            Launcher::Example => command.arg("worker").args(args),
            Launcher::Test { name } => command
                .args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"])
                .env(WORKER_ENV, args.join("\n")),
        };
        Worker::start(command)
    }
}

/// A running worker process and the events it has printed.
pub struct Worker {
    child: Child,
    /// The worker's lifeline: it exits when this closes (see [`exit_with_runner`]).
    _stdin: Option<ChildStdin>,
    events: mpsc::Receiver<Fields>,
}

/// How long the runner waits for a worker's next event before calling it hung.
const EVENT_TIMEOUT: Duration = Duration::from_secs(600);

impl Worker {
    fn start(mut command: Command) -> Worker {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("cannot start a worker process");
        let stdout = child.stdout.take().unwrap();
        let (sender, events) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // Not necessarily at the start: the test harness prints
                // "test <name> ... " without a newline before the test runs.
                if let Some((_, event)) = line.split_once(PREFIX) {
                    let _ = sender.send(Fields::parse(event.split_whitespace()));
                }
            }
        });
        Worker {
            _stdin: child.stdin.take(),
            child,
            events,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the next event, which must be `event`.
    pub fn expect(&mut self, event: &str) -> Fields {
        let Ok(fields) = self.events.recv_timeout(EVENT_TIMEOUT) else {
            let status = self.child.try_wait();
            panic!(
                "worker {} ended ({status:?}) or hung before reporting {event:?}",
                self.pid()
            )
        };
        assert_eq!(fields.event(), event, "worker {}: {fields:?}", self.pid());
        fields
    }

    /// SIGKILL: no unwinding, no rollback, no goodbye to the database.
    pub fn kill(mut self) {
        self.child.kill().expect("cannot kill a worker");
        self.child.wait().unwrap();
    }

    pub fn stop(&self) {
        self.signal("-STOP");
    }

    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// SIGTERM: the worker is asked to stop gracefully.
    pub fn terminate(&self) {
        self.signal("-TERM");
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.pid().to_string()])
            .status()
            .expect("cannot run kill");
        assert!(status.success(), "kill {signal} {} failed", self.pid());
    }

    /// Waits for the worker's `done` event and its exit.
    pub fn finish(mut self) -> Fields {
        let fields = self.expect("done");
        let status = self.child.wait().unwrap();
        assert!(
            status.success(),
            "worker {} exited with {status}",
            self.pid()
        );
        fields
    }
}

/// A worker the runner gave up on (its scenario failed) is killed, not left
/// running.
impl Drop for Worker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A worker's event: its name and `key=value` fields; also a worker's arguments.
#[derive(Debug, Clone, Default)]
pub struct Fields(BTreeMap<String, String>);

impl Fields {
    pub fn parse<'a>(words: impl IntoIterator<Item = &'a str>) -> Fields {
        let mut fields = BTreeMap::new();
        for word in words {
            match word.split_once('=') {
                Some((key, value)) => fields.insert(key.to_owned(), value.to_owned()),
                None => fields.insert("event".to_owned(), word.to_owned()),
            };
        }
        Fields(fields)
    }

    pub fn event(&self) -> &str {
        self.get("event").unwrap_or("")
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// A field that must be there.
    pub fn text(&self, key: &str) -> &str {
        self.get(key)
            .unwrap_or_else(|| panic!("no {key:?} in {self:?}"))
    }

    /// A numeric field, 0 when absent.
    pub fn number(&self, key: &str) -> u64 {
        self.get(key).map_or(0, |v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{key}={v} is not a number"))
        })
    }

    /// A `kind:count,kind:count` field.
    pub fn counts(&self, key: &str) -> Vec<(String, u64)> {
        let Some(text) = self.get(key).filter(|text| !text.is_empty()) else {
            return Vec::new();
        };
        text.split(',')
            .filter_map(|pair| pair.split_once(':'))
            .map(|(kind, count)| (kind.to_owned(), count.parse().unwrap_or(0)))
            .collect()
    }

    pub fn set(&mut self, key: &str, value: impl ToString) -> &mut Fields {
        let value = value.to_string();
        assert!(!value.contains(char::is_whitespace), "{key}={value:?}");
        self.0.insert(key.to_owned(), value);
        self
    }

    /// Sets a `kind:count,…` field from counts.
    pub fn set_counts(&mut self, key: &str, counts: &BTreeMap<String, u64>) -> &mut Fields {
        let pairs: Vec<_> = counts.iter().map(|(k, n)| format!("{k}:{n}")).collect();
        self.set(key, pairs.join(","))
    }
}

/// Prints an event for the runner (from a worker process).
pub fn report(event: &str, fields: &Fields) {
    let mut line = format!("{PREFIX}{event}");
    for (key, value) in fields.0.iter().filter(|(key, _)| *key != "event") {
        line.push_str(&format!(" {key}={value}"));
    }
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}").unwrap();
    stdout.flush().unwrap();
}

/// Makes this worker process exit when its runner does (its stdin closes), so
/// that a runner that fails or is killed leaves no worker behind holding locks.
pub fn exit_with_runner() {
    thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(3);
    });
}

/// Polls `ready` every few milliseconds until it holds; returns how long it
/// took, or `None` after `limit`.
pub fn time_until(limit: Duration, mut ready: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if ready() {
            return Some(started.elapsed());
        }
        thread::sleep(Duration::from_millis(5));
    }
    None
}
