//! The repository's own tasks, run as `cargo xtask <task>` (an alias in
//! `.cargo/config.toml`):
//!
//! - `cargo xtask test`: makes the machine ready (see [`setup`]), then runs
//!   every test of the workspace on every backend, and the doc tests.
//!   `cargo xtask test --pg 12,18` runs the PostgreSQL tests instead, on
//!   each major version asked (see [`pg_versions`]).
//! - `cargo xtask check`: what CI checks besides the tests (`.ci/run` runs
//!   both): that no file of `src/` passes [`MAX_LINES`], formatting, clippy
//!   on every feature set, that the async-only build has no C client
//!   library, the docs, the package as a registry user builds it (on the
//!   declared `rust-version`), the benchmark's quick mode, the worked
//!   examples on every backend, and the job service.
//!
//! Both stop at the first step that fails, and exit with status 1.
//!
//! `cargo xtask harness --harness <checkout>` measures diesel-claim beside
//! other job queues in the postgresql-job-queue-benchmarking harness (see
//! [`harness`]).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

mod harness;
mod pg_versions;
mod setup;

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "diesel-claim's own tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Installs what is missing, starts the database servers, runs every test
    Test {
        /// Instead, the PostgreSQL tests on each of these major versions
        /// (12 to 18), on a server of their own: `--pg 12,18`
        #[arg(long, value_delimiter = ',', value_name = "VERSIONS")]
        pg: Vec<u32>,
        /// Passed on to `cargo nextest run`, e.g. a filter: `-- claim::pg`
        #[arg(last = true)]
        nextest: Vec<String>,
    },
    /// File lengths, formatting, lints, docs, the benchmark's quick mode, the worked
    /// examples on every backend and the job service
    Check,
    /// Runs diesel-claim beside other job queues in the
    /// postgresql-job-queue-benchmarking harness, each on a private PostgreSQL
    Harness(harness::Args),
}

/// An error that ends the task: what failed, for the user to read.
type Error = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.task {
        Task::Test { pg, nextest } if pg.is_empty() => {
            setup::machine().and_then(|servers| test(&servers, &nextest))
        }
        Task::Test { pg, nextest } => {
            setup::machine().and_then(|servers| pg_versions::test(&servers, &pg, &nextest))
        }
        Task::Check => setup::machine().and_then(|servers| check(&servers)),
        Task::Harness(args) => harness::run(&args),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("\nxtask: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Every test on every backend: the integration tests and unit tests under
/// nextest, then the doc tests (which nextest does not run) once per backend:
/// they run on PostgreSQL when it is enabled, else on MySQL, else on SQLite.
fn test(servers: &setup::Servers, nextest_args: &[String]) -> Result<(), Error> {
    println!("{LONG_TESTS}");
    cargo(
        servers,
        ["nextest", "run", "--workspace", "--all-features"],
        nextest_args,
    )?;
    for features in ["--all-features", "--features=mysql", "--features=sqlite"] {
        cargo(servers, ["test", "--doc", features], &[])?;
    }
    Ok(())
}

/// What the test run says before it starts, so that its long tests are
/// expected (`.config/nextest.toml` gives them their time).
const LONG_TESTS: &str = "\nThe tests take about 10 minutes on 2 cores. The longest: \
     torture::light_postgres and torture::light_mysql (every failure scenario in turn on a \
     server: workers killed, sessions cut, the server restarted; about 2 minutes each), and \
     compile_fail::refusals_at_compile_time_say_what_to_do (programs the crate must refuse, \
     compiled on their own; about 2 minutes the first time).";

/// Every feature set the crate promises to compile, lint-free: none, each
/// backend alone (with its blocking connection or without), the async API
/// alone and with each of its backends (with the blocking connection or
/// without), and tracing and anyhow beside them.
const FEATURE_SETS: &[&[&str]] = &[
    &["--no-default-features"],
    &["--features", "postgres"],
    &["--features", "sqlite"],
    &["--features", "mysql"],
    &["--features", "postgres_backend"],
    &["--features", "mysql_backend"],
    &["--features", "async"],
    &["--features", "async,postgres"],
    &["--features", "async,mysql"],
    &["--features", "async,postgres_backend"],
    &["--features", "async,mysql_backend"],
    &["--features", "bb8,postgres_backend"],
    &["--features", "deadpool,mysql_backend,tracing"],
    &["--features", "tracing,anyhow,sqlite"],
    &["--features", "metrics,sqlite"],
    &["--features", ASYNC_ONLY],
];

/// Everything an async-only service can enable.
const ASYNC_ONLY: &str = "async,postgres_backend,mysql_backend,tracing,metrics,anyhow";

/// What only Diesel's blocking connections need: libpq, libmysqlclient and
/// the r2d2 pool, none of which an async-only build may depend on.
const BLOCKING_ONLY: [&str; 3] = ["pq-sys", "mysqlclient-sys", "r2d2"];

fn check(servers: &setup::Servers) -> Result<(), Error> {
    short_files()?;
    cargo(servers, ["fmt", "--all", "--", "--check"], &[])?;
    cargo(
        servers,
        ["clippy", "--workspace", "--all-targets", "--all-features"],
        &["--", "-D", "warnings"].map(String::from),
    )?;
    for &features in FEATURE_SETS {
        let mut args = vec!["clippy", "--all-targets"];
        args.extend(features);
        cargo(servers, args, &["--", "-D", "warnings"].map(String::from))?;
    }
    async_only_dependencies()?;
    shared_features()?;
    sqlite_example_dependencies()?;
    job_service_dependencies()?;
    // The crate without `migrations`, which the tests' dev-dependencies turn
    // on in every build above.
    cargo(
        servers,
        [
            "clippy",
            "--lib",
            "--no-default-features",
            "--features",
            "postgres,sqlite,mysql,async,bb8,deadpool",
        ],
        &["--", "-D", "warnings"].map(String::from),
    )?;
    step(
        servers,
        Command::new(cargo_program())
            .args(["doc", "--no-deps", "--all-features"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    packaged(servers)?;
    // The benchmark's smoke test: every mode on every backend, checking only
    // that nothing is processed twice or left behind; timings never fail it.
    cargo(
        servers,
        ["bench", "--package", "diesel-claim-bench"],
        &["--", "--quick", "--partitioned"].map(String::from),
    )?;
    // The worked examples: the README's command on SQLite, where no C
    // database client library can be found, then every server.
    step(
        servers,
        &mut without_c_clients(&["run", "--release", "--package", SHOP]),
    )?;
    for url in [&servers.postgres, &servers.mysql] {
        let shop = ["run", "--release", "--package", SHOP];
        let shop_async = ["run", "--release", "--example", "shop_async"];
        for (example, features) in [
            (&shop[..], "postgres,mysql"),
            (&shop_async[..], "async,postgres,mysql"),
        ] {
            step(
                servers,
                Command::new(cargo_program())
                    .args(example)
                    .args(["--features", features])
                    .env("DATABASE_URL", url),
            )?;
        }
    }
    // The job service example, a package of its own, on PostgreSQL.
    step(
        servers,
        Command::new(cargo_program())
            .args(["run", "--release", "--package", JOB_SERVICE])
            .env("DATABASE_URL", &servers.postgres),
    )?;
    println!("\nall checks passed");
    Ok(())
}

/// The most lines a file of the crate's `src/` may have: a file that passes
/// it usually holds two concepts, and is split where they part.
const MAX_LINES: usize = 700;

/// Fails if any file under `src/` has more than [`MAX_LINES`] lines, naming
/// each.
fn short_files() -> Result<(), Error> {
    println!("\n==> every file of src/ in at most {MAX_LINES} lines");
    let mut long = Vec::new();
    let mut dirs = vec![workspace_root().join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let lines = std::fs::read_to_string(&path)?.lines().count();
            if lines > MAX_LINES {
                long.push(format!("{} ({lines} lines)", path.display()));
            }
        }
    }
    if long.is_empty() {
        return Ok(());
    }
    long.sort();
    Err(format!(
        "files of src/ longer than {MAX_LINES} lines, to be split: {}",
        long.join(", ")
    )
    .into())
}

/// The feature sets a registry user's build of the packaged crate is
/// checked with: backends with `migrations`, the defaults alone (none), and
/// an async-only service that keeps the lease table in its own migrations
/// (no diesel_migrations).
const PACKAGED_FEATURE_SETS: [&str; 3] = [
    "diesel-claim/migrations,diesel-claim/postgres,diesel-claim/sqlite,diesel-claim/async",
    "diesel-claim/default",
    "diesel-claim/postgres_backend,diesel-claim/async",
];

/// Packages the crate as `cargo publish` would, then builds it from the
/// `.crate` as a registry user's project does, with the workspace's
/// `Cargo.lock` (so that nothing new resolves), on the toolchain of the
/// declared `rust-version`: the package must carry all it needs, and that
/// version must build it.
fn packaged(servers: &setup::Servers) -> Result<(), Error> {
    let root = workspace_root();
    // The working tree as it is (CI's is a clean clone); cargo's own
    // verification is the registry user's build below.
    cargo(
        servers,
        [
            "package",
            "--package",
            "diesel-claim",
            "--allow-dirty",
            "--no-verify",
        ],
        &[],
    )?;
    let version = package_field(&root, "version")?;
    let target = target_dir(&root);
    let crate_file = target.join(format!("package/diesel-claim-{version}.crate"));
    let user = target.join("registry-user");
    if user.exists() {
        std::fs::remove_dir_all(&user)?;
    }
    std::fs::create_dir_all(user.join("src"))?;
    step(
        servers,
        Command::new("tar")
            .arg("-xzf")
            .arg(&crate_file)
            .arg("-C")
            .arg(&user),
    )?;
    std::fs::write(
        user.join("Cargo.toml"),
        format!(
            "[package]\nname = \"registry-user\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
             publish = false\n\n[dependencies]\ndiesel-claim = {{ path = \"diesel-claim-{version}\", \
             default-features = false }}\n\n[workspace]\n"
        ),
    )?;
    std::fs::write(user.join("src/lib.rs"), "pub use diesel_claim::Error;\n")?;
    std::fs::copy(root.join("Cargo.lock"), user.join("Cargo.lock"))?;
    let toolchain = declared_toolchain(&root)?;
    for features in PACKAGED_FEATURE_SETS {
        step(
            servers,
            Command::new("rustup")
                .args(["run", &toolchain, "cargo", "build", "--features", features])
                .current_dir(&user)
                // The workspace's build cache: the same locked dependencies.
                .env("CARGO_TARGET_DIR", &target),
        )?;
    }
    // Without `migrations`, nothing of diesel_migrations is built.
    let without = PACKAGED_FEATURE_SETS[2];
    let mut tree = Command::new(cargo_program());
    tree.args([
        "tree",
        "--edges",
        "normal",
        "--prefix",
        "none",
        "--features",
        without,
    ])
    .current_dir(&user);
    println!("\n==> {}", shown(&tree));
    let output = tree.output()?;
    let listed = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() || !listed.contains("diesel-claim") {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(format!("{} failed ({}):\n{stderr}", shown(&tree), output.status).into());
    }
    if listed
        .lines()
        .any(|line| line.starts_with("diesel_migrations "))
    {
        return Err(format!("the package with {without} depends on diesel_migrations").into());
    }
    println!("the package builds from its .crate on Rust {toolchain}, without diesel_migrations");
    Ok(())
}

/// The toolchain of the crate's declared `rust-version` (`1.95` is
/// `1.95.0`), installed through rustup if this machine lacks it.
fn declared_toolchain(root: &Path) -> Result<String, Error> {
    let declared = package_field(root, "rust-version")?;
    let toolchain = if declared.matches('.').count() == 1 {
        format!("{declared}.0")
    } else {
        declared
    };
    let installed = Command::new("rustup")
        .args(["run", &toolchain, "rustc", "--version"])
        .output()
        .is_ok_and(|output| output.status.success());
    if !installed {
        let mut install = Command::new("rustup");
        install.args(["toolchain", "install", &toolchain, "--profile", "minimal"]);
        println!("\n==> {}", shown(&install));
        if !install.status().is_ok_and(|status| status.success()) {
            return Err(format!(
                "no Rust {toolchain} (the declared rust-version) to build the package on"
            )
            .into());
        }
    }
    Ok(toolchain)
}

/// A string field of the crate's `[package]` table (`version = "0.1.0"`).
fn package_field(root: &Path, field: &str) -> Result<String, Error> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml"))?;
    let package = manifest
        .lines()
        .skip_while(|line| line.trim() != "[package]")
        .skip(1)
        .take_while(|line| !line.trim_start().starts_with('['));
    for line in package {
        if let Some((key, value)) = line.split_once('=') {
            if key.trim() == field {
                return Ok(value.trim().trim_matches('"').to_owned());
            }
        }
    }
    Err(format!("Cargo.toml's [package] has no {field}").into())
}

/// The workspace's root: the parent of this crate's directory.
fn workspace_root() -> PathBuf {
    let xtask = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask.parent().unwrap_or(xtask).to_owned()
}

/// Where cargo builds the workspace: `CARGO_TARGET_DIR` (relative to the
/// workspace when it is relative), or its `target/`.
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(|dir| root.join(dir))
        .unwrap_or_else(|| root.join("target"))
}

/// Fails if the crate's dependencies with [`ASYNC_ONLY`] (not its
/// dev-dependencies, which the tests need) include any of [`BLOCKING_ONLY`].
fn async_only_dependencies() -> Result<(), Error> {
    let edges = ["--edges", "normal", "--features", ASYNC_ONLY];
    let tree = dependencies("diesel-claim", &edges)?;
    lacks(&tree, "diesel-async", &BLOCKING_ONLY, ASYNC_ONLY)
}

/// Features of dependencies an application shares that the crate must not
/// turn on, for its code needs none of them: each would rebuild that
/// dependency, and every crate of the application above it, when the crate is
/// added. `(dependency, feature, why not)`.
const SHARED_FEATURES_LEFT_OFF: [(&str, &str, &str); 3] = [
    ("futures-util", "std", "catch_unwind is aio/unwind.rs"),
    ("bb8", "parking_lot", "turns on tokio's"),
    (
        "diesel-async",
        "async-connection-wrapper",
        "only aio::run_migrations uses it, with `migrations`",
    ),
];

/// Fails if the crate, with every feature an async PostgreSQL service may
/// pick but `migrations`, turns on any of [`SHARED_FEATURES_LEFT_OFF`]. Not
/// with `mysql_backend`: diesel-async's MySQL client turns on futures-util's
/// `std` itself.
fn shared_features() -> Result<(), Error> {
    let features = "async,postgres_backend,bb8,deadpool,tracing,metrics,anyhow";
    let mut command = Command::new(cargo_program());
    command.args(["tree", "--package", "diesel-claim", "--no-default-features"]);
    command.args(["--edges", "normal", "--features", features]);
    command.args(["--prefix", "none", "--format", "{p} [{f}]"]);
    println!("\n==> {}", shown(&command));
    let output = command.output()?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(format!("{} failed ({}):\n{stderr}", shown(&command), output.status).into());
    }
    let listed = String::from_utf8_lossy(&output.stdout);
    for (dependency, feature, why) in SHARED_FEATURES_LEFT_OFF {
        // Each line is `name vX.Y.Z [feature,…]`, maybe followed by `(*)`.
        let mut lines = listed
            .lines()
            .filter(|line| line.split(' ').next() == Some(dependency))
            .peekable();
        if lines.peek().is_none() {
            return Err(format!("the tree with {features} lists no {dependency}").into());
        }
        for line in lines {
            let on = line
                .split_once('[')
                .and_then(|(_, on)| on.split_once(']'))
                .map_or("", |(on, _)| on);
            if on.split(',').any(|listed| listed == feature) {
                return Err(format!(
                    "with {features}, the crate turns on {dependency}'s `{feature}` ({why}): {line}"
                )
                .into());
            }
        }
    }
    println!("none of {SHARED_FEATURES_LEFT_OFF:?} with {features}");
    Ok(())
}

/// What a C database client library links; the worked example on SQLite
/// (the README's first command) must build where neither can be found.
const C_CLIENT_LIBRARIES: [&str; 2] = ["pq-sys", "mysqlclient-sys"];

/// The worked example's package.
const SHOP: &str = "diesel-claim-shop";

/// Fails if what the worked example builds with its default features (the
/// README's first command) includes any of [`C_CLIENT_LIBRARIES`].
fn sqlite_example_dependencies() -> Result<(), Error> {
    let tree = dependencies(SHOP, &["--edges", "normal,build"])?;
    lacks(
        &tree,
        "libsqlite3-sys",
        &C_CLIENT_LIBRARIES,
        "the worked example on SQLite",
    )
}

/// Hides the C database client libraries, their headers and their
/// `*_config` programs (each directory holding them is overlaid with one in
/// which they are deleted), checks that a C program can link none of them,
/// then runs the given cargo command. Only this command, in a mount
/// namespace of its own, sees them gone.
const WITHOUT_C_CLIENTS: &str = r#"
set -e
scratch=$(mktemp -d)
hide() {
    dir=$1
    shift
    layer=$scratch/$(echo "$dir" | tr / _)
    mkdir -p "$layer/upper" "$layer/work"
    hidden=0
    for pattern in "$@"; do
        for entry in "$dir"/$pattern; do
            whiteout=$layer/upper/${entry##*/}
            if { [ -e "$entry" ] || [ -L "$entry" ]; } && [ ! -e "$whiteout" ]; then
                mknod "$whiteout" c 0 0
                hidden=$((hidden + 1))
            fi
        done
    done
    if [ "$hidden" -gt 0 ]; then
        mount -t overlay overlay             -o "lowerdir=$dir,upperdir=$layer/upper,workdir=$layer/work" "$dir"
        echo "hid $hidden of $dir"
    fi
}
for dir in /usr/lib /usr/lib/*-linux-gnu; do
    hide "$dir" 'libpq.*' 'libmysqlclient*' 'libmariadb*' 'libperconaserverclient*'
done
hide /usr/include postgresql mysql mariadb 'libpq-fe.h'
hide /usr/bin pg_config mysql_config mariadb_config
for library in pq mysqlclient mariadb; do
    if echo 'int main(void) { return 0; }' | cc -x c - "-l$library" -o "$scratch/linked" 2>/dev/null; then
        echo "lib$library can still be linked" >&2
        exit 1
    fi
done
echo "no C database client library can be found"
exec "$@"
"#;

/// `cargo <args>` where no C database client library can be found, in a
/// target directory of its own, so that everything is built (and linked)
/// without them: as root in a mount namespace of its own, else in a user
/// namespace too.
fn without_c_clients(args: &[&str]) -> Command {
    let mut command = Command::new("unshare");
    if !setup::is_root() {
        command.arg("--map-root-user");
    }
    command
        .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .args([WITHOUT_C_CLIENTS, "sh", &cargo_program()])
        .args(args)
        .args(["--target-dir", "target/without-c-clients"]);
    command
}

/// The job service example's package.
const JOB_SERVICE: &str = "diesel-claim-jobs";

/// Fails if what the job service builds includes any of
/// [`C_CLIENT_LIBRARIES`]: it runs on diesel-async's PostgreSQL client,
/// written in Rust.
fn job_service_dependencies() -> Result<(), Error> {
    let tree = dependencies(JOB_SERVICE, &["--edges", "normal,build"])?;
    lacks(
        &tree,
        "tokio-postgres",
        &C_CLIENT_LIBRARIES,
        "the job service",
    )
}

/// The names of the packages `cargo tree` lists for `package` with `args`.
fn dependencies(package: &str, args: &[&str]) -> Result<Vec<String>, Error> {
    let mut command = Command::new(cargo_program());
    command.args(["tree", "--package", package]);
    command.args(args);
    command.args(["--prefix", "none", "--format", "{p}"]);
    println!("\n==> {}", shown(&command));
    let output = command
        .output()
        .map_err(|e| format!("cannot run {}: {e}", shown(&command)))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(format!("{} failed ({}):\n{stderr}", shown(&command), output.status).into());
    }
    // Each line is `name vX.Y.Z`, maybe followed by a path or `(*)`.
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split(' ').next())
        .map(str::to_owned)
        .collect())
}

/// Fails unless `tree` lists `expected` (else it is not the tree asked for)
/// and none of `forbidden`.
fn lacks(tree: &[String], expected: &str, forbidden: &[&str], built: &str) -> Result<(), Error> {
    if !tree.iter().any(|name| name == expected) {
        return Err(format!("the tree of {built} lists no {expected}: {tree:?}").into());
    }
    let found: Vec<&str> = forbidden
        .iter()
        .copied()
        .filter(|name| tree.iter().any(|listed| listed == name))
        .collect();
    if !found.is_empty() {
        return Err(format!("the build with {built} depends on {found:?}").into());
    }
    println!("no {forbidden:?} with {built}");
    Ok(())
}

/// Runs `cargo <args> <more>` with the servers' URLs in its environment.
fn cargo<'a>(
    servers: &setup::Servers,
    args: impl IntoIterator<Item = &'a str>,
    more: &[String],
) -> Result<(), Error> {
    step(servers, Command::new(cargo_program()).args(args).args(more))
}

/// The cargo that runs this task, so that a toolchain chosen by rustup for it
/// runs the steps too.
fn cargo_program() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Prints `command` as a step, runs it with the servers' URLs, and fails if
/// it does.
fn step(servers: &setup::Servers, command: &mut Command) -> Result<(), Error> {
    command
        .env("PG_DATABASE_URL", &servers.postgres)
        .env("MYSQL_DATABASE_URL", &servers.mysql);
    println!("\n==> {}", shown(command));
    let status = command
        .status()
        .map_err(|e| format!("cannot run {}: {e}", shown(command)))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{} failed ({status})", shown(command)).into())
    }
}

/// `command` as it would be typed, environment additions first.
fn shown(command: &Command) -> String {
    let env = command
        .get_envs()
        .filter(|(name, _)| !name.to_string_lossy().ends_with("_DATABASE_URL"))
        .filter_map(|(name, value)| Some(format!("{}={}", name.to_str()?, value?.to_str()?)));
    // `cargo`, not the toolchain's full path to it.
    let program = Path::new(command.get_program()).file_name();
    let words = program.into_iter().chain(command.get_args());
    env.chain(words.map(OsStr::to_string_lossy).map(|word| quoted(&word)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `word` as a shell reads it back: in single quotes when it holds what the
/// shell would split or expand (a nextest filter expression does).
fn quoted(word: &str) -> String {
    if word.contains(|c: char| c.is_whitespace() || "|&;()<>*?$'\"\\".contains(c)) {
        format!("'{}'", word.replace('\'', r"'\''"))
    } else {
        word.to_owned()
    }
}
