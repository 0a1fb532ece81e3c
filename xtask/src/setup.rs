//! Makes a machine ready for the tests: the client libraries the backends
//! link against, cargo-nextest, and a PostgreSQL and a MariaDB (or MySQL)
//! server to create throwaway databases on.
//!
//! - **Servers named by the environment** (`PG_DATABASE_URL`,
//!   `MYSQL_DATABASE_URL`) are used as they are; nothing is started for
//!   them. The server programs are installed all the same: the torture
//!   suite starts, crashes and restarts private servers of its own, some
//!   behind network namespaces it makes (which needs root, `ip`, `tc` and
//!   `iptables`).
//! - **Otherwise the local servers**, on 127.0.0.1:5432 and :3306. On Debian,
//!   what is missing is installed with `apt-get` (as root, or through `sudo`),
//!   and a server that is installed but stopped is started.
//! - **A server installed here** gets what the tests expect: PostgreSQL a
//!   password for `postgres` on TCP and a database `test`, MariaDB `root`
//!   without a password on TCP and a database `test`.
//!
//! On another system, install the libraries and servers yourself, or name
//! servers in the environment; the task says what it is missing.

use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::Error;

const LOCAL_POSTGRES: &str = "postgres://postgres@127.0.0.1:5432/test";
/// The URL for a PostgreSQL cluster this task installed, which Debian
/// sets up to want a password on TCP.
const INSTALLED_POSTGRES: &str = "postgres://postgres:postgres@127.0.0.1:5432/test";
const LOCAL_MYSQL: &str = "mysql://root@127.0.0.1:3306/test";

/// The servers the tests run against.
#[derive(Debug)]
pub struct Servers {
    pub postgres: String,
    pub mysql: String,
}

/// Installs what is missing and starts the servers; the URLs to test against.
pub fn machine() -> Result<Servers, Error> {
    let named_postgres = std::env::var("PG_DATABASE_URL").ok();
    let named_mysql = std::env::var("MYSQL_DATABASE_URL").ok();

    println!("==> client libraries and servers");
    // Client libraries: libpq for PostgreSQL, MariaDB's libmysqlclient for
    // MySQL (found through pkg-config). SQLite is built from source.
    // The torture suite's network scenario makes its own network namespaces
    // (`ip`, `tc`, `sysctl`) and firewall rules (`iptables`).
    let mut wanted = vec![
        "libpq-dev",
        "default-libmysqlclient-dev",
        "pkg-config",
        "iproute2",
        "iptables",
        "procps",
    ];
    // The server programs, also when the tests use servers named in the
    // environment: the torture suite crashes private servers of its own.
    if !has_postgres_server() {
        wanted.push("postgresql");
    }
    if !Path::new("/usr/sbin/mariadbd").exists() {
        wanted.push("mariadb-server");
    }
    let installed = install_debian_packages(&wanted)?;

    let postgres = match named_postgres {
        Some(url) => url,
        None => local_postgres(installed.contains(&"postgresql"))?,
    };
    let mysql = match named_mysql {
        Some(url) => url,
        None => local_mysql(installed.contains(&"mariadb-server"))?,
    };
    println!("PG_DATABASE_URL={postgres}\nMYSQL_DATABASE_URL={mysql}");

    if !succeeds(Command::new(crate::cargo_program()).args(["nextest", "--version"])) {
        println!("\n==> cargo install cargo-nextest --locked");
        run(Command::new(crate::cargo_program()).args(["install", "cargo-nextest", "--locked"]))?;
    }
    Ok(Servers { postgres, mysql })
}

fn has_postgres_server() -> bool {
    postgres_versions().next().is_some()
}

/// The installed PostgreSQL server versions (`/usr/lib/postgresql/<v>/bin/pg_ctl`).
fn postgres_versions() -> impl Iterator<Item = String> {
    std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.path().join("bin/pg_ctl").exists())
        .filter_map(|entry| entry.file_name().into_string().ok())
}

/// Installs the Debian packages of `wanted` that are missing; which ones it
/// installed.
pub(crate) fn install_debian_packages<'a>(wanted: &[&'a str]) -> Result<Vec<&'a str>, Error> {
    if !succeeds(Command::new("dpkg").arg("--version")) {
        println!(
            "not Debian: make sure these are installed: {}",
            wanted.join(" ")
        );
        return Ok(Vec::new());
    }
    let missing: Vec<&str> = wanted
        .iter()
        .copied()
        .filter(|package| !succeeds(Command::new("dpkg").args(["-s", package])))
        .collect();
    if missing.is_empty() {
        println!("installed: {}", wanted.join(" "));
        return Ok(missing);
    }
    println!("missing: {}", missing.join(" "));
    let Some(mut apt_get) = as_root("apt-get") else {
        return Err(format!(
            "missing Debian packages, and neither root nor sudo to install them: \
             sudo apt-get install {}",
            missing.join(" ")
        )
        .into());
    };
    println!("installing them with apt-get");
    run_quietly(apt_get.args(["update", "-qq"]))?;
    let mut apt_get = as_root("apt-get").ok_or("lost root")?;
    run_quietly(
        apt_get
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing),
    )?;
    Ok(missing)
}

/// The local PostgreSQL, started if it is installed but stopped.
fn local_postgres(just_installed: bool) -> Result<String, Error> {
    if !accepts(5432) {
        let version = postgres_versions().max_by_key(|v| v.parse::<u32>().unwrap_or(0));
        let version = version.ok_or("no PostgreSQL server is installed")?;
        println!("starting PostgreSQL {version}");
        let mut start = as_root("pg_ctlcluster").ok_or(
            "PostgreSQL is not running on 127.0.0.1:5432 and starting it needs root: \
             start it, or set PG_DATABASE_URL",
        )?;
        run(start.args(["--skip-systemctl-redirect", &version, "main", "start"]))?;
        wait_until_accepting("PostgreSQL", 5432)?;
    }
    if !just_installed {
        return Ok(LOCAL_POSTGRES.to_owned());
    }
    // Debian's new cluster wants a password on 127.0.0.1 and has no `test`.
    let psql = |sql: &str| -> Result<(), Error> {
        let mut psql = as_root("runuser").ok_or("lost root")?;
        run(psql.args(["-u", "postgres", "--", "psql", "-q", "-c", sql]))
    };
    psql("ALTER ROLE postgres PASSWORD 'postgres'")?;
    if psql("CREATE DATABASE test").is_err() {
        println!("(database test exists)");
    }
    Ok(INSTALLED_POSTGRES.to_owned())
}

/// The local MariaDB, started if it is installed but stopped.
fn local_mysql(just_installed: bool) -> Result<String, Error> {
    if !accepts(3306) {
        println!("starting MariaDB");
        let not_root = "MariaDB is not running on 127.0.0.1:3306 and starting it needs root: \
                        start it, or set MYSQL_DATABASE_URL";
        let mut runtime_dir = as_root("install").ok_or(not_root)?;
        run(runtime_dir.args(["-d", "-o", "mysql", "-g", "mysql", "/run/mysqld"]))?;
        let mut start = as_root("start-stop-daemon").ok_or(not_root)?;
        run(start.args([
            "--start",
            "--oknodo",
            "--background",
            "--exec",
            "/usr/sbin/mariadbd",
        ]))?;
        wait_until_accepting("MariaDB", 3306)?;
    }
    if just_installed {
        // Debian's root logs in through the Unix socket only; the tests log in
        // over TCP, without a password, and create databases.
        let mut mariadb = as_root("mariadb").ok_or("lost root")?;
        run(mariadb.args([
            "-e",
            "ALTER USER root@localhost IDENTIFIED VIA unix_socket OR mysql_native_password \
             USING PASSWORD(''); CREATE DATABASE IF NOT EXISTS test",
        ]))?;
    }
    Ok(LOCAL_MYSQL.to_owned())
}

fn accepts(port: u16) -> bool {
    TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)).is_ok()
}

pub(crate) fn wait_until_accepting(server: &str, port: u16) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !accepts(port) {
        if Instant::now() > deadline {
            return Err(
                format!("{server} did not accept connections on port {port} in 60 s").into(),
            );
        }
        thread::sleep(Duration::from_millis(500));
    }
    Ok(())
}

/// `program` run as root: directly when this is root, else through sudo
/// (without asking for a password); `None` when neither can be.
fn as_root(program: &str) -> Option<Command> {
    if is_root() {
        return Some(Command::new(program));
    }
    if succeeds(Command::new("sudo").args(["-n", "true"])) {
        let mut sudo = Command::new("sudo");
        sudo.args(["-n", program]);
        return Some(sudo);
    }
    None
}

/// Whether this task runs as root.
pub(crate) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|uid| String::from_utf8_lossy(&uid.stdout).trim() == "0")
}

pub(crate) fn succeeds(command: &mut Command) -> bool {
    command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Runs `command`, showing its output only if it fails: dpkg's progress and
/// debconf's notes say nothing when all goes well.
fn run_quietly(command: &mut Command) -> Result<(), Error> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {:?}: {e}", command.get_program()))?;
    if output.status.success() {
        return Ok(());
    }
    eprint!("{}", String::from_utf8_lossy(&output.stdout));
    eprint!("{}", String::from_utf8_lossy(&output.stderr));
    Err(format!("{command:?} failed ({})", output.status).into())
}

pub(crate) fn run(command: &mut Command) -> Result<(), Error> {
    let status = command
        .stdin(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run {:?}: {e}", command.get_program()))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{command:?} failed ({status})").into())
    }
}
