//! Database servers of their own, started from the local binaries in a
//! temporary directory, for the scenarios that crash the server or cut its
//! network: never the machine's shared one.
//!
//! Both keep their durability defaults (PostgreSQL `fsync` and
//! `synchronous_commit` on; InnoDB `innodb_flush_log_at_trx_commit = 1`), so
//! that a commit a client saw must survive the crash.

use std::fs;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use diesel::Connection;

/// Which server, and where its programs are.
enum Kind {
    #[cfg(feature = "postgres")]
    Postgres { bin_dir: PathBuf },
    #[cfg(feature = "mysql")]
    Mariadb,
}

/// A server of its own on a free port of 127.0.0.1 (or behind a
/// [`TestNetwork`](crate::TestNetwork)), its data in a temporary directory.
/// [`crash`](Self::crash) kills it as a power cut would kill the process
/// (SIGKILL, no shutdown), [`start`](Self::start) starts it again on the same
/// data, through crash recovery. Dropping it kills it and removes its data.
pub struct PrivateServer {
    kind: Kind,
    dir: tempfile::TempDir,
    /// The server's process when this one started it directly (MariaDB),
    /// to be reaped when it dies.
    child: Mutex<Option<Child>>,
    /// The network namespace the server runs in, if not this one.
    namespace: Option<String>,
    /// The address `admin_url` reaches the server at.
    host: String,
    /// A URL of the server's administrative database (`postgres`, `mysql`).
    pub admin_url: String,
}

/// Where a server runs: here on 127.0.0.1, or in a test network's server
/// namespace, listening on both its links.
struct Place {
    namespace: Option<String>,
    listen: String,
    host: String,
}

impl Place {
    fn here() -> Place {
        Place {
            namespace: None,
            listen: "127.0.0.1".to_owned(),
            host: "127.0.0.1".to_owned(),
        }
    }

    fn behind(network: &crate::TestNetwork) -> Place {
        Place {
            namespace: Some(network.server_namespace.clone()),
            listen: "0.0.0.0".to_owned(),
            host: network.healthy_address.clone(),
        }
    }
}

impl PrivateServer {
    /// A PostgreSQL cluster made with `initdb`, trusting local connections,
    /// with `settings` added to its configuration; started.
    #[cfg(feature = "postgres")]
    pub fn postgres(settings: &str) -> Self {
        Self::postgres_at(Place::here(), settings)
    }

    /// [`postgres`](Self::postgres), in `network`'s server namespace.
    #[cfg(feature = "postgres")]
    pub fn postgres_behind(network: &crate::TestNetwork, settings: &str) -> Self {
        Self::postgres_at(Place::behind(network), settings)
    }

    #[cfg(feature = "postgres")]
    fn postgres_at(place: Place, settings: &str) -> Self {
        use std::fs::OpenOptions;
        use std::io::Write;

        let bin_dir = crate::pg::postgres_bin_dir(&crate::pg::SERVER_TOOLS).expect(
            "the crash scenarios start their own PostgreSQL server: install the server \
             binaries (`initdb`, `pg_ctl`)",
        );
        let dir = temporary_directory("diesel-claim-crash-pg");
        // The server runs as `postgres` when the suite runs as root.
        let _ = Command::new("chown")
            .arg("postgres:")
            .arg(dir.path())
            .status();
        let port = free_port();
        let data = dir.path().join("data");
        pg_tool(&bin_dir, "initdb")
            .args(["--auth=trust", "--username=postgres", "--pgdata"])
            .arg(&data)
            .run_or_panic("initialize a PostgreSQL cluster");
        let settings = format!(
            "\n# diesel-claim crash scenarios\n\
             port = {port}\n\
             listen_addresses = '{}'\n\
             unix_socket_directories = ''\n\
             max_connections = 200\n\
             {settings}\n",
            place.listen
        );
        OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .and_then(|mut conf| conf.write_all(settings.as_bytes()))
            .unwrap_or_else(|e| panic!("cannot configure {}: {e}", data.display()));
        // Behind a test network, clients come from its other addresses.
        if place.namespace.is_some() {
            OpenOptions::new()
                .append(true)
                .open(data.join("pg_hba.conf"))
                .and_then(|mut hba| hba.write_all(b"\nhost all all 10.231.0.0/16 trust\n"))
                .unwrap_or_else(|e| panic!("cannot configure {}: {e}", data.display()));
        }
        let server = PrivateServer {
            kind: Kind::Postgres { bin_dir },
            child: Mutex::new(None),
            admin_url: format!("postgres://postgres@{}:{port}/postgres", place.host),
            namespace: place.namespace,
            host: place.host,
            dir,
        };
        server.start();
        server
    }

    /// A MariaDB server made with `mariadb-install-db`, `root` without a
    /// password, with `options` added to `mariadbd`'s command line; started.
    #[cfg(feature = "mysql")]
    pub fn mariadb(options: &[&str]) -> Self {
        Self::mariadb_at(Place::here(), options)
    }

    /// [`mariadb`](Self::mariadb), in `network`'s server namespace.
    #[cfg(feature = "mysql")]
    pub fn mariadb_behind(network: &crate::TestNetwork, options: &[&str]) -> Self {
        Self::mariadb_at(Place::behind(network), options)
    }

    #[cfg(feature = "mysql")]
    fn mariadb_at(place: Place, options: &[&str]) -> Self {
        let dir = temporary_directory("diesel-claim-crash-mariadb");
        let port = free_port();
        let server = PrivateServer {
            kind: Kind::Mariadb,
            child: Mutex::new(None),
            admin_url: format!("mysql://root@{}:{port}/mysql", place.host),
            namespace: place.namespace,
            host: place.host,
            dir,
        };
        let options: Vec<String> = [
            format!("--port={port}"),
            format!("--bind-address={}", place.listen),
            format!("--socket={}", server.dir.path().join("socket").display()),
            format!("--pid-file={}", server.dir.path().join("pid").display()),
            format!("--log-error={}", server.log_path().display()),
            "--user=root".to_owned(),
        ]
        .into_iter()
        .chain(options.iter().map(|option| option.to_string()))
        .collect();
        fs::write(server.dir.path().join("options"), options.join("\n"))
            .expect("cannot keep the server's options");
        Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", server.data_dir().display()))
            .args([
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--user=root",
            ])
            .run_or_panic("initialize a MariaDB data directory (is mariadb-server installed?)");
        server.start();
        if server.namespace.is_some() {
            use diesel::connection::SimpleConnection;

            // Behind a test network, `root` comes from its other addresses.
            diesel::MysqlConnection::establish(&server.socket_url())
                .and_then(|mut conn| {
                    conn.batch_execute(
                        "CREATE USER 'root'@'10.231.%'; \
                         GRANT ALL PRIVILEGES ON *.* TO 'root'@'10.231.%' WITH GRANT OPTION",
                    )
                    .map_err(diesel::ConnectionError::CouldntSetupConfiguration)
                })
                .unwrap_or_else(|e| panic!("cannot let the test network's clients in: {e}"));
        }
        server
    }

    /// A URL of the MariaDB server's `mysql` database through its socket,
    /// which works from any network namespace.
    #[cfg(feature = "mysql")]
    fn socket_url(&self) -> String {
        format!(
            "mysql://root@localhost/mysql?unix_socket={}",
            self.dir.path().join("socket").display()
        )
    }

    /// The URL of `database` on this server.
    pub fn url(&self, database: &str) -> String {
        crate::url::with_database(&self.admin_url, database)
    }

    /// The URL of `database` on this server, reached at `address` (another
    /// link of its network) with `query` (`key=value&…`, or empty).
    pub fn url_via(&self, address: &str, database: &str, query: &str) -> String {
        let url =
            self.url(database)
                .replacen(&format!("@{}:", self.host), &format!("@{address}:"), 1);
        if query.is_empty() {
            url
        } else {
            format!("{url}?{query}")
        }
    }

    /// Starts the server on its data directory and waits until it accepts
    /// connections; panics with its log after a minute.
    pub fn start(&self) {
        match &self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres { bin_dir } => {
                let mut pg_ctl = pg_tool(bin_dir, "pg_ctl");
                pg_ctl
                    .args(["start", "--timeout=60", "--pgdata"])
                    .arg(self.data_dir())
                    .arg("--log")
                    .arg(self.log_path());
                self.here(pg_ctl)
                    .run_or_panic("start the PostgreSQL server");
            }
            #[cfg(feature = "mysql")]
            Kind::Mariadb => {
                let options = fs::read_to_string(self.dir.path().join("options"))
                    .expect("cannot read the server's options");
                let mut mariadbd = Command::new("mariadbd");
                mariadbd
                    .arg("--no-defaults")
                    .arg(format!("--datadir={}", self.data_dir().display()))
                    .args(options.lines());
                // `ip netns exec` becomes the server: the child is mariadbd.
                let child = self
                    .here(mariadbd)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("cannot start mariadbd");
                *self.child.lock().unwrap() = Some(child);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while let Err(error) = self.accepts() {
            if Instant::now() > deadline {
                let log = fs::read_to_string(self.log_path()).unwrap_or_default();
                panic!("the server does not accept connections ({error}); its log:\n{log}");
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Shuts the server down as a container's stop does (PostgreSQL's fast
    /// shutdown, SIGINT: sessions are ended, transactions rolled back, a
    /// checkpoint is written) and waits until it is gone;
    /// [`start`](Self::start) starts it again.
    pub fn stop(&self) {
        match &self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres { bin_dir } => {
                let mut pg_ctl = pg_tool(bin_dir, "pg_ctl");
                pg_ctl
                    .args(["stop", "--mode=fast", "--timeout=60", "--pgdata"])
                    .arg(self.data_dir());
                self.here(pg_ctl).run_or_panic("stop the PostgreSQL server");
            }
            #[cfg(feature = "mysql")]
            Kind::Mariadb => {
                if let Some(mut child) = self.child.lock().unwrap().take() {
                    signal("TERM", &[child.id()]);
                    let _ = child.wait();
                }
            }
        }
    }

    /// Kills every process of the server with SIGKILL, at once, and waits
    /// until they are gone: nothing is shut down, flushed or checkpointed.
    pub fn crash(&self) {
        let Some(main) = self.main_pid() else { return };
        // Stopped first, so that it starts no process while its children are
        // being listed.
        signal("STOP", &[main]);
        let mut doomed = children(main);
        doomed.push(main);
        signal("KILL", &doomed);
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while doomed.iter().any(|&pid| alive(pid)) {
            assert!(
                Instant::now() < deadline,
                "server processes {doomed:?} outlived SIGKILL"
            );
            thread::sleep(Duration::from_millis(10));
        }
        // A machine that crashed comes back without the dead server's
        // processes. Here the postmaster may linger as a zombie until init
        // reaps it, and PostgreSQL would take its lock file for a live server.
        match self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres { .. } => {
                let _ = fs::remove_file(self.data_dir().join("postmaster.pid"));
            }
            #[cfg(feature = "mysql")]
            Kind::Mariadb => {}
        }
    }

    /// Whether the server accepts a connection now.
    fn accepts(&self) -> Result<(), diesel::ConnectionError> {
        match &self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres { .. } => diesel::PgConnection::establish(&self.admin_url).map(drop),
            #[cfg(feature = "mysql")]
            Kind::Mariadb => diesel::MysqlConnection::establish(&self.socket_url()).map(drop),
        }
    }

    /// The pid of the server's main process, if it runs.
    fn main_pid(&self) -> Option<u32> {
        let pid_file = match &self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres { .. } => self.data_dir().join("postmaster.pid"),
            #[cfg(feature = "mysql")]
            Kind::Mariadb => self.dir.path().join("pid"),
        };
        let pid = fs::read_to_string(pid_file)
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()?;
        alive(pid).then_some(pid)
    }

    /// `command`, run where the server runs.
    fn here(&self, command: Command) -> Command {
        match &self.namespace {
            Some(namespace) => crate::TestNetwork::command_in(namespace, &command),
            None => command,
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }
}

/// PostgreSQL's program `name`, run as the `postgres` user when this is root.
#[cfg(feature = "postgres")]
fn pg_tool(bin_dir: &std::path::Path, name: &str) -> Command {
    crate::pg::server_command(&bin_dir.join(name))
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.crash();
    }
}

fn temporary_directory(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("cannot make a temporary directory")
}

/// A port of 127.0.0.1 that nothing listens on.
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("cannot find a free port")
        .port()
}

/// Whether process `pid` runs: it exists and is not a zombie (a dead
/// process its parent has not reaped, which may be an init that never does).
fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| Some(stat.rsplit_once(')')?.1.split_whitespace().next()? != "Z"))
        .unwrap_or(false)
}

/// The processes whose parent is `parent`.
fn children(parent: u32) -> Vec<u32> {
    let parent = parent.to_string();
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = fs::read_to_string(entry.path().join("stat")).ok()?;
            // "pid (name) state ppid …": the name may hold spaces and parentheses.
            let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?;
            (ppid == parent).then_some(pid)
        })
        .collect()
}

fn signal(name: &str, pids: &[u32]) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .args(pids.iter().map(u32::to_string))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

trait RunOrPanic {
    fn run_or_panic(&mut self, what: &str);
}

impl RunOrPanic for Command {
    fn run_or_panic(&mut self, what: &str) {
        let output = self
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot {what}: cannot run {self:?}: {e}"));
        assert!(
            output.status.success(),
            "cannot {what}: {self:?} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Starts, crashes, restarts and drops `server`, checking that what was
    /// committed survives the crash and that nothing is left once it goes.
    fn crash_and_recover<C: Connection>(server: PrivateServer) {
        let mut conn = C::establish(&server.admin_url).unwrap();
        conn.batch_execute(
            "CREATE TABLE survivors (id INTEGER PRIMARY KEY); INSERT INTO survivors VALUES (1)",
        )
        .unwrap();
        let main = server.main_pid().expect("the server runs");
        server.crash();
        assert!(!alive(main));
        assert!(
            conn.batch_execute("SELECT 1").is_err(),
            "a connection survived the crash"
        );
        server.start();
        let mut conn = C::establish(&server.admin_url).unwrap();
        conn.batch_execute("DELETE FROM survivors WHERE id = 1")
            .unwrap();
        let restarted = server.main_pid().expect("the server runs again");
        let dir = server.dir.path().to_owned();
        drop(server);
        assert!(!alive(restarted), "the server outlived its value");
        assert!(!dir.exists(), "its data outlived its value");
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn a_private_postgres_server_survives_a_crash_and_goes_when_dropped() {
        crash_and_recover::<diesel::PgConnection>(PrivateServer::postgres(""));
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn a_private_mariadb_server_survives_a_crash_and_goes_when_dropped() {
        crash_and_recover::<diesel::MysqlConnection>(PrivateServer::mariadb(&[]));
    }
}
