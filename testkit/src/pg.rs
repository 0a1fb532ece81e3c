//! Throwaway PostgreSQL databases: a database of its own per test, on a
//! server named by the environment or on a private one the tests start.

use std::cmp::Reverse;
use std::env;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{self, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_query;

pub(crate) use crate::private_server::free_port;

/// The URL of a PostgreSQL server the tests may create databases on.
///
/// In order of preference:
///
/// 1. `PG_DATABASE_URL`,
/// 2. `DATABASE_URL`, if it is a `postgres://` or `postgresql://` URL,
/// 3. a private server started from the PostgreSQL binaries of
///    `PG_BIN_DIR`, or else found under `/usr/lib/postgresql/*/bin` or on
///    `PATH`.
///
/// The private server keeps its data in the system temporary directory
/// (`/tmp/diesel-claim-test-pg<major>`), listens on 127.0.0.1 only and
/// is left running when the tests finish, so that the next test process
/// (nextest runs one per test) and the next test run reuse it.
/// Stop it with `pg_ctl stop -D /tmp/diesel-claim-test-pg<major>`.
///
/// Panics if none of the three is available: PostgreSQL tests are never
/// skipped silently.
pub fn pg_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if let Ok(url) = env::var("PG_DATABASE_URL") {
            return url;
        }
        if let Ok(url) = env::var("DATABASE_URL") {
            if url.starts_with("postgres") {
                return url;
            }
        }
        match postgres_bin_dir(&SERVER_TOOLS) {
            Some(bin_dir) => start_private_server(&bin_dir),
            None => panic!(
                "the PostgreSQL tests need a server: set \
                 PG_DATABASE_URL=postgres://user@host/db (the user must be \
                 allowed to create databases), or install the PostgreSQL \
                 server binaries (`initdb`, `pg_ctl`) so that the tests can \
                 start a private one"
            ),
        }
    })
    .clone()
}

/// A database of its own for one test, dropped when this value is dropped.
pub struct PgTestDb {
    /// Connection URL of the new database.
    pub url: String,
    name: String,
    admin_url: String,
}

impl PgTestDb {
    /// Creates a uniquely named, empty database on the server of [`pg_url`].
    pub fn new() -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);

        let admin_url = pg_url();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("system clock is before 1970")
            .subsec_nanos();
        let name = format!(
            "dc_test_{}_{}_{}",
            process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            nanos,
        );

        let mut admin = PgConnection::establish(&admin_url)
            .unwrap_or_else(|e| panic!("cannot connect to {admin_url}: {e}"));
        sql_query(format!(r#"CREATE DATABASE "{name}""#))
            .execute(&mut admin)
            .unwrap_or_else(|e| panic!("cannot create database {name}: {e}"));

        PgTestDb {
            url: crate::url::with_database(&admin_url, &name),
            name,
            admin_url,
        }
    }

    /// Name of the database.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for PgTestDb {
    fn drop(&mut self) {
        // The database's sessions are ended first, as `DROP DATABASE … WITH
        // (FORCE)` would, which PostgreSQL 12 lacks (it came in 13); the
        // drop waits up to 5 s for them to go.
        let dropped = PgConnection::establish(&self.admin_url)
            .map_err(|e| e.to_string())
            .and_then(|mut admin| {
                sql_query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = $1 AND pid <> pg_backend_pid()",
                )
                .bind::<diesel::sql_types::Text, _>(&self.name)
                .execute(&mut admin)
                .and_then(|_| {
                    sql_query(format!(r#"DROP DATABASE IF EXISTS "{}""#, self.name))
                        .execute(&mut admin)
                })
                .map_err(|e| e.to_string())
            });
        if let Err(e) = dropped {
            eprintln!("could not drop test database {}: {e}", self.name);
        }
    }
}

/// A pool of `size` connections to `url`.
pub fn pg_pool(url: &str, size: u32) -> Pool<ConnectionManager<PgConnection>> {
    Pool::builder()
        .max_size(size)
        .connection_timeout(Duration::from_secs(10))
        .build(ConnectionManager::new(url))
        .unwrap_or_else(|e| panic!("cannot build a pool for {url}: {e}"))
}

/// The server programs the private servers run: `initdb`, `pg_ctl` and
/// `postgres`, the replica also `pg_basebackup`.
pub(crate) const SERVER_TOOLS: [&str; 3] = ["initdb", "pg_ctl", "postgres"];

/// A directory holding every program of `tools`: `PG_BIN_DIR` if it does,
/// else the newest version's under `/usr/lib/postgresql`, else one on `PATH`.
///
/// `PG_BIN_DIR` is how a run on another major version (`cargo xtask test
/// --pg`) has the servers the tests start of their own run that version
/// too. Its builds lack `pg_basebackup`: the replica tests then run on the
/// machine's version, as the servers of a pair must share one.
pub(crate) fn postgres_bin_dir(tools: &[&str]) -> Option<PathBuf> {
    let holds_every_tool = |dir: &PathBuf| tools.iter().all(|tool| dir.join(tool).is_file());
    let named = env::var_os("PG_BIN_DIR").map(PathBuf::from);
    let mut versioned: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .collect();
    versioned.sort_by_key(|(version, _)| Reverse(*version));

    let on_path = env::var_os("PATH")
        .map(|path| env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default();

    named
        .into_iter()
        .chain(versioned.into_iter().map(|(_, dir)| dir))
        .chain(on_path)
        .find(holds_every_tool)
}

/// Makes sure the private server of `bin_dir` runs and returns its URL.
fn start_private_server(bin_dir: &Path) -> String {
    let data_dir = env::temp_dir().join(format!("diesel-claim-test-pg{}", major_version(bin_dir)));
    if !data_dir.exists() {
        init_data_dir(bin_dir, &data_dir);
    }
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        configured_port(&data_dir)
    );

    if PgConnection::establish(&url).is_err() {
        // Another test process may be starting the same server right now;
        // then this start fails, and waiting below is all that is needed.
        let _ = run(server_command(&bin_dir.join("pg_ctl"))
            .args(["start", "--wait", "--timeout=60", "--pgdata"])
            .arg(&data_dir)
            .arg("--log")
            .arg(data_dir.join("server.log")));
        wait_until_accepting(&url, &data_dir);
    }
    url
}

/// Creates a data directory for a trust-authenticated server on a free
/// port. Concurrent test processes may race here: each initializes its
/// own staging directory and the first one renamed into place wins.
fn init_data_dir(bin_dir: &Path, data_dir: &Path) {
    let staging = data_dir.with_extension(process::id().to_string());
    let _ = fs::remove_dir_all(&staging);

    run(server_command(&bin_dir.join("initdb"))
        .args([
            "--auth=trust",
            "--username=postgres",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
            "--pgdata",
        ])
        .arg(&staging))
    .unwrap_or_else(|e| panic!("cannot initialize a PostgreSQL data directory: {e}"));

    let settings = format!(
        "\n# diesel-claim test server\n\
         port = {}\n\
         listen_addresses = '127.0.0.1'\n\
         unix_socket_directories = ''\n\
         max_connections = 200\n\
         fsync = off\n\
         synchronous_commit = off\n\
         full_page_writes = off\n",
        free_port()
    );
    OpenOptions::new()
        .append(true)
        .open(staging.join("postgresql.conf"))
        .and_then(|mut conf| conf.write_all(settings.as_bytes()))
        .expect("cannot configure the PostgreSQL test server");

    if fs::rename(&staging, data_dir).is_err() {
        // Lost the race: another process put its directory in place first.
        let _ = fs::remove_dir_all(&staging);
    }
}

fn wait_until_accepting(url: &str, data_dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Err(e) = PgConnection::establish(url) {
        if Instant::now() > deadline {
            let log = fs::read_to_string(data_dir.join("server.log")).unwrap_or_default();
            panic!(
                "the PostgreSQL test server in {} does not accept connections \
                 ({e}); delete that directory to start over, or set \
                 PG_DATABASE_URL=postgres://user@host/db. Server log:\n{log}",
                data_dir.display(),
            );
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// Major version of the server binaries, e.g. `15`.
fn major_version(bin_dir: &Path) -> String {
    let output = Command::new(bin_dir.join("pg_ctl"))
        .arg("--version")
        .output()
        .expect("cannot run pg_ctl --version");
    // "pg_ctl (PostgreSQL) 15.19 (Debian 15.19-0+deb12u1)"
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .nth(2)
        .and_then(|version| version.split('.').next())
        .expect("unexpected output from pg_ctl --version")
        .to_owned()
}

fn configured_port(data_dir: &Path) -> u16 {
    let conf = fs::read_to_string(data_dir.join("postgresql.conf"))
        .expect("cannot read postgresql.conf of the PostgreSQL test server");
    conf.lines()
        .filter_map(|line| line.strip_prefix("port = "))
        .next_back()
        .and_then(|port| port.trim().parse().ok())
        .expect("no port in postgresql.conf of the PostgreSQL test server")
}

/// PostgreSQL refuses to run as root, so as root the server tools run as
/// the `postgres` system user.
pub(crate) fn server_command(program: &Path) -> Command {
    let running_as_root = fs::metadata("/proc/self").is_ok_and(|proc| proc.uid() == 0);
    let mut command = if running_as_root {
        let mut runuser = Command::new("runuser");
        runuser.args(["-u", "postgres", "--"]).arg(program);
        runuser
    } else {
        Command::new(program)
    };
    // The `postgres` user may not be allowed into the current directory.
    command.current_dir(env::temp_dir());
    command
}

pub(crate) fn run(command: &mut Command) -> Result<(), String> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {command:?}: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{command:?} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}
