//! A PostgreSQL server of its own for a harness run, started from the
//! machine's server binaries (as the `postgres` user when run as root) on a
//! free port of 127.0.0.1, with a configuration file appended to its own:
//! `private-postgres <postgres.conf>`, the harness's.
//!
//! It prints the URL of the server's `postgres` database on a line of its
//! own once the server accepts connections, then reads commands on stdin,
//! one a line, answering each with `ok`:
//!
//! - `crash`: kills every process of the server with SIGKILL;
//! - `start`: starts it again on the same data, through crash recovery.
//!
//! When stdin closes, or on SIGTERM or SIGINT, it stops the server and
//! removes its data.

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel_claim_testkit::PrivateServer;

fn main() -> ExitCode {
    let Some(conf_path) = std::env::args().nth(1) else {
        eprintln!("usage: private-postgres <postgres.conf>");
        return ExitCode::FAILURE;
    };
    let conf = match std::fs::read_to_string(&conf_path) {
        Ok(conf) => conf,
        Err(error) => {
            eprintln!("private-postgres: cannot read {conf_path}: {error}");
            return ExitCode::FAILURE;
        }
    };
    let stopping = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Err(error) = signal_hook::flag::register(signal, Arc::clone(&stopping)) {
            eprintln!("private-postgres: cannot handle signal {signal}: {error}");
            return ExitCode::FAILURE;
        }
    }
    // The file's settings, then this server's own address again: the
    // harness's file listens everywhere, for a container.
    let settings = format!("# {conf_path}\n{conf}\nlisten_addresses = '127.0.0.1'\n");
    let server = PrivateServer::postgres(&settings);
    println!("{}", server.url("postgres"));

    // Commands come on a thread of their own, so that a signal is heard
    // while stdin is quiet.
    let (commands, received) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if commands.send(line).is_err() {
                break;
            }
        }
    });
    while !stopping.load(Ordering::Relaxed) {
        match received.recv_timeout(Duration::from_millis(100)) {
            Ok(command) => {
                match command.trim() {
                    "crash" => server.crash(),
                    "start" => server.start(),
                    other => {
                        eprintln!("private-postgres: unknown command {other:?}");
                        continue;
                    }
                }
                println!("ok");
                let _ = std::io::stdout().flush();
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // Dropping the server stops it and removes its data.
    drop(server);
    ExitCode::SUCCESS
}
