//! A PostgreSQL server of its own for a harness run, started from the
//! machine's server binaries (as the `postgres` user when run as root) on a
//! free port of 127.0.0.1, with a configuration file appended to its own:
//! `private-postgres <postgres.conf> [<control socket>]`, the harness's.
//!
//! It prints the URL of the server's `postgres` database on a line of its
//! own once the server accepts connections, then takes commands, one a line,
//! on stdin and, when a control socket's path is given, from the processes
//! that connect to that Unix socket; it answers each with `ok` once done:
//!
//! - `stop`: shuts the server down as a container's stop does (fast
//!   shutdown);
//! - `crash`: kills every process of the server with SIGKILL;
//! - `start`: starts it again on the same data (through crash recovery
//!   after `crash`), and waits until it accepts connections.
//!
//! `private-postgres --send <control socket> <command>` sends one command
//! and waits for its answer: what the harness's `postgres-restart` phase
//! runs (`BENCH_PG_STOP_CMD`, `BENCH_PG_START_CMD`).
//!
//! When stdin closes, or on SIGTERM or SIGINT, it stops the server and
//! removes its data.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use diesel_claim_testkit::PrivateServer;

/// A command, and where its answer goes.
struct Command {
    line: String,
    answer: Box<dyn FnOnce(&str) + Send>,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let outcome = match args.as_slice() {
        [flag, socket, command] if flag == "--send" => send(socket, command),
        [conf] => serve(conf, None),
        [conf, socket] => serve(conf, Some(socket)),
        _ => Err(
            "usage: private-postgres <postgres.conf> [<control socket>]\n       \
             private-postgres --send <control socket> stop|crash|start"
                .to_owned(),
        ),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("private-postgres: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Sends `command` to the server process listening on `socket`, and waits
/// for it to be done.
fn send(socket: &str, command: &str) -> Result<(), String> {
    let mut stream =
        UnixStream::connect(socket).map_err(|error| format!("cannot reach {socket}: {error}"))?;
    writeln!(stream, "{command}").map_err(|error| format!("cannot send {command}: {error}"))?;
    let mut answer = String::new();
    BufReader::new(stream)
        .read_line(&mut answer)
        .map_err(|error| format!("no answer to {command}: {error}"))?;
    match answer.trim() {
        "ok" => Ok(()),
        other => Err(format!("{command} failed: {other}")),
    }
}

/// Runs the server until stdin closes or a signal comes, carrying out the
/// commands of stdin and of `socket`.
fn serve(conf_path: &str, socket: Option<&String>) -> Result<(), String> {
    let conf = std::fs::read_to_string(conf_path)
        .map_err(|error| format!("cannot read {conf_path}: {error}"))?;
    let stopping = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, Arc::clone(&stopping))
            .map_err(|error| format!("cannot handle signal {signal}: {error}"))?;
    }
    let (commands, received) = mpsc::channel();
    if let Some(socket) = socket {
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket)
            .map_err(|error| format!("cannot listen on {socket}: {error}"))?;
        let commands = commands.clone();
        thread::spawn(move || accept(&listener, &commands));
    }
    // The file's settings, then this server's own address again: the
    // harness's file listens everywhere, for a container.
    let settings = format!("# {conf_path}\n{conf}\nlisten_addresses = '127.0.0.1'\n");
    let server = PrivateServer::postgres(&settings);
    println!("{}", server.url("postgres"));

    // Commands come on threads of their own, so that a signal is heard
    // while they are quiet. The end of stdin ends the server too.
    let stdin_closed = Arc::clone(&stopping);
    thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            let answer = Box::new(|answer: &str| {
                println!("{answer}");
                let _ = std::io::stdout().flush();
            });
            if commands.send(Command { line, answer }).is_err() {
                break;
            }
        }
        stdin_closed.store(true, Ordering::Relaxed);
    });
    while !stopping.load(Ordering::Relaxed) {
        match received.recv_timeout(Duration::from_millis(100)) {
            Ok(Command { line, answer }) => match line.trim() {
                "stop" => answer(&run(|| server.stop())),
                "crash" => answer(&run(|| server.crash())),
                "start" => answer(&run(|| server.start())),
                other => answer(&format!("unknown command {other:?}")),
            },
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    if let Some(socket) = socket {
        let _ = std::fs::remove_file(socket);
    }
    // Dropping the server stops it and removes its data.
    drop(server);
    Ok(())
}

/// Hands each line a client of `listener` sends to `commands`, answering on
/// the client's stream.
fn accept(listener: &UnixListener, commands: &Sender<Command>) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let mut line = String::new();
        let Ok(mut writer) = stream.try_clone() else {
            continue;
        };
        if BufReader::new(stream).read_line(&mut line).is_err() {
            continue;
        }
        let answer = Box::new(move |answer: &str| {
            let _ = writeln!(writer, "{answer}");
        });
        if commands.send(Command { line, answer }).is_err() {
            break;
        }
    }
}

/// `ok` once `command` is done, or what it panicked with.
fn run(command: impl FnOnce()) -> String {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(command)) {
        Ok(()) => "ok".to_owned(),
        Err(panic) => panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("the command panicked")
            .replace('\n', " "),
    }
}
