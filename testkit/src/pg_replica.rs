//! A private PostgreSQL primary with a streaming replica, both started from
//! the local server binaries in a temporary directory, for the claims that
//! read their candidates on a replica.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_query;
use diesel::sql_types::Bool;

use crate::pg::{free_port, postgres_bin_dir, run, server_command, SERVER_TOOLS};

/// A primary and a hot standby that streams from it and applies each commit
/// `apply_delay` after the primary made it (`recovery_min_apply_delay`), so
/// that it lags by about that much. Both stop, and their data goes, when
/// this value is dropped.
pub struct PgReplicaPair {
    /// The primary's `postgres` database.
    pub primary_url: String,
    /// The replica's `postgres` database.
    pub replica_url: String,
    bin_dir: PathBuf,
    dir: tempfile::TempDir,
}

impl PgReplicaPair {
    /// Starts both servers.
    /// Panics, saying why, when the server binaries are missing or refuse.
    pub fn start(apply_delay: Duration) -> Self {
        let tools = [SERVER_TOOLS.as_slice(), &["pg_basebackup"]].concat();
        let bin_dir = postgres_bin_dir(&tools).expect(
            "the replica tests start their own PostgreSQL servers: install the server \
             binaries (`initdb`, `pg_ctl`, `pg_basebackup`)",
        );
        let dir = tempfile::Builder::new()
            .prefix("diesel-claim-replica")
            .tempdir()
            .expect("cannot make a temporary directory");
        // The servers run as `postgres` when the tests run as root.
        let _ = Command::new("chown")
            .arg("postgres:")
            .arg(dir.path())
            .status();
        let (primary_port, replica_port) = (free_port(), free_port());
        let pair = PgReplicaPair {
            primary_url: format!("postgres://postgres@127.0.0.1:{primary_port}/postgres"),
            replica_url: format!("postgres://postgres@127.0.0.1:{replica_port}/postgres"),
            bin_dir,
            dir,
        };
        let primary = pair.data_dir("primary");
        pair.tool("initdb")
            .args([
                "--auth=trust",
                "--username=postgres",
                "--no-sync",
                "--pgdata",
            ])
            .arg(&primary)
            .run_or_panic("initialize the primary");
        configure(
            &primary,
            &format!(
                "port = {primary_port}\n\
                 wal_level = replica\n\
                 max_wal_senders = 4\n"
            ),
        );
        pair.start_server(&primary, &pair.primary_url);

        // `--write-recovery-conf`: a standby that streams from the primary.
        let replica = pair.data_dir("replica");
        pair.tool("pg_basebackup")
            .args(["--host=127.0.0.1", "--username=postgres", "--no-sync"])
            .arg(format!("--port={primary_port}"))
            .args(["--write-recovery-conf", "--wal-method=stream", "--pgdata"])
            .arg(&replica)
            .run_or_panic("copy the primary into the replica");
        configure(
            &replica,
            &format!(
                "port = {replica_port}\n\
                 recovery_min_apply_delay = '{}ms'\n\
                 hot_standby = on\n\
                 # Replay waits for the replica's reads rather than cancel them.\n\
                 max_standby_streaming_delay = -1\n\
                 hot_standby_feedback = on\n",
                apply_delay.as_millis()
            ),
        );
        pair.start_server(&replica, &pair.replica_url);
        pair
    }

    /// The same database on both servers (it must exist on the primary).
    pub fn urls(&self, database: &str) -> (String, String) {
        (
            crate::url::with_database(&self.primary_url, database),
            crate::url::with_database(&self.replica_url, database),
        )
    }

    /// Waits until the replica has applied everything the primary had
    /// committed when this was called; panics after `within`.
    pub fn wait_for_replay(&self, within: Duration) {
        #[derive(QueryableByName)]
        struct Lsn {
            #[diesel(sql_type = diesel::sql_types::Text)]
            lsn: String,
        }
        #[derive(QueryableByName)]
        struct Replayed {
            #[diesel(sql_type = Bool)]
            replayed: bool,
        }
        let mut primary = self.connect(&self.primary_url);
        let target = sql_query("SELECT pg_current_wal_lsn()::text AS lsn")
            .get_result::<Lsn>(&mut primary)
            .expect("cannot read the primary's WAL position")
            .lsn;
        let mut replica = self.connect(&self.replica_url);
        let check = format!("SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn AS replayed");
        let deadline = Instant::now() + within;
        loop {
            let replayed = sql_query(&check)
                .get_result::<Replayed>(&mut replica)
                .map(|row| row.replayed)
                .unwrap_or(false);
            if replayed {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the replica did not replay {target} within {within:?}"
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn connect(&self, url: &str) -> PgConnection {
        PgConnection::establish(url).unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
    }

    fn data_dir(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn tool(&self, name: &str) -> Command {
        server_command(&self.bin_dir.join(name))
    }

    fn start_server(&self, data_dir: &Path, url: &str) {
        self.tool("pg_ctl")
            .args(["start", "--wait", "--timeout=60", "--pgdata"])
            .arg(data_dir)
            .arg("--log")
            .arg(data_dir.join("server.log"))
            .run_or_panic("start a server");
        let deadline = Instant::now() + Duration::from_secs(60);
        while let Err(e) = PgConnection::establish(url) {
            if Instant::now() > deadline {
                let log = fs::read_to_string(data_dir.join("server.log")).unwrap_or_default();
                panic!(
                    "the server in {} does not accept connections ({e}):\n{log}",
                    data_dir.display()
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for PgReplicaPair {
    fn drop(&mut self) {
        for name in ["replica", "primary"] {
            let data_dir = self.data_dir(name);
            if data_dir.join("postmaster.pid").exists() {
                let _ = run(self
                    .tool("pg_ctl")
                    .args(["stop", "--mode=immediate", "--pgdata"])
                    .arg(&data_dir));
            }
        }
    }
}

/// Appends `settings` to the server's configuration (later lines win).
fn configure(data_dir: &Path, settings: &str) {
    let settings = format!(
        "\n# diesel-claim replica test\n\
         listen_addresses = '127.0.0.1'\n\
         unix_socket_directories = ''\n\
         fsync = off\n\
         {settings}"
    );
    OpenOptions::new()
        .append(true)
        .open(data_dir.join("postgresql.conf"))
        .and_then(|mut conf| conf.write_all(settings.as_bytes()))
        .unwrap_or_else(|e| panic!("cannot configure {}: {e}", data_dir.display()));
}

trait RunOrPanic {
    fn run_or_panic(&mut self, what: &str);
}

impl RunOrPanic for Command {
    fn run_or_panic(&mut self, what: &str) {
        run(self).unwrap_or_else(|e| panic!("cannot {what}: {e}"));
    }
}
