//! The torture suite: the scenarios of `RELIABILITY.md`, each run against a
//! fresh database, its invariant checked and its figures reported.
//!
//! The same code runs from two places: the `torture` example (one command, any
//! scale) and the integration test `torture::light_*` (light scale, every CI
//! run).
//!
//! Scenarios that need real processes start workers by re-running the current
//! executable: see [`procs::Launcher`].

use std::collections::BTreeMap;
use std::fmt::{self, Display};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

pub mod procs;

/// `on_every_backend!` (of the tests' fixtures) for the backends the suite
/// covers, whose modules it also makes reachable from here as `on_postgres`,
/// `on_sqlite` and `on_mysql` (`on_every_backend!` keeps its own modules
/// private).
macro_rules! on_suite_backends {
    ($($items:tt)*) => {
        #[cfg(feature = "postgres")]
        crate::fixtures::on_every_backend!(@backend pg, diesel::PgConnection, true,
            PgTestDb, pg_pool, POSTGRES_SCHEMA, $($items)*);
        #[cfg(feature = "sqlite")]
        crate::fixtures::on_every_backend!(@backend sqlite, diesel::SqliteConnection, false,
            SqliteTestDb, sqlite_pool, SQLITE_SCHEMA, $($items)*);
        #[cfg(feature = "mysql")]
        crate::fixtures::on_every_backend!(@backend mysql, diesel::MysqlConnection, true,
            MysqlTestDb, mysql_pool, MYSQL_SCHEMA, $($items)*);

        #[cfg(feature = "postgres")]
        pub mod on_postgres {
            pub use super::pg::*;
        }
        #[cfg(feature = "sqlite")]
        pub mod on_sqlite {
            pub use super::sqlite::*;
        }
        #[cfg(feature = "mysql")]
        pub mod on_mysql {
            pub use super::mysql::*;
        }
    };
}

/// `on_every_backend!` for the backends with row locks and servers to crash,
/// PostgreSQL and MariaDB, in modules `on_postgres` and `on_mysql` that see
/// the claiming, lease and money scenarios' helpers of their backend, and:
/// - `start_private_server(durable)`: a server of their own (see
///   [`PrivateServer`](crate::PrivateServer)), with its durability defaults
///   or (`false`) with commits acknowledged before their log is written;
/// - `start_server_behind(network)` and `SERVER_SYSCTLS`: a server behind a
///   [`TestNetwork`](crate::TestNetwork), and the TCP settings of its
///   namespace, that drop a silent client's session within seconds.
macro_rules! on_row_lock_backends {
    ($($items:tt)*) => {
        #[cfg(feature = "postgres")]
        crate::fixtures::on_every_backend!(@backend pg, diesel::PgConnection, true,
            PgTestDb, pg_pool, POSTGRES_SCHEMA,
            use super::super::claiming::on_postgres::{
                check_emails, check_timed_jobs, create_database, database, email as email_by, timed_jobs,
            };
            use super::super::leases::on_postgres::fenced_write;
            use super::super::money::on_postgres::check_ledger;
            fn start_private_server(durable: bool) -> crate::PrivateServer {
                crate::PrivateServer::postgres(if durable { "" } else { "synchronous_commit = off" })
            }
            /// A server in `network`'s server namespace that drops the
            /// sessions of clients it no longer hears from within seconds.
            fn start_server_behind(network: &crate::TestNetwork) -> crate::PrivateServer {
                crate::PrivateServer::postgres_behind(
                    network,
                    "tcp_keepalives_idle = 1\ntcp_keepalives_interval = 1\ntcp_keepalives_count = 3\n\
                     tcp_user_timeout = 5000",
                )
            }
            /// The TCP settings of the server's namespace: none, PostgreSQL
            /// sets its own per connection.
            const SERVER_SYSCTLS: &[&str] = &[];
            /// Behind a test network: none in the workers' namespace either,
            /// their bounds are in the URL.
            const CLIENT_SYSCTLS: &[&str] = &[];
            const CLIENT_QUERY: &str =
                "keepalives_idle=1&keepalives_interval=1&keepalives_count=3&tcp_user_timeout=5000&connect_timeout=5";
            $($items)*);
        #[cfg(feature = "mysql")]
        crate::fixtures::on_every_backend!(@backend mysql, diesel::MysqlConnection, true,
            MysqlTestDb, mysql_pool, MYSQL_SCHEMA,
            use super::super::claiming::on_mysql::{
                check_emails, check_timed_jobs, create_database, database, email as email_by, timed_jobs,
            };
            use super::super::leases::on_mysql::fenced_write;
            use super::super::money::on_mysql::check_ledger;
            fn start_private_server(durable: bool) -> crate::PrivateServer {
                crate::PrivateServer::mariadb(if durable { &[] } else { &["--innodb-flush-log-at-trx-commit=0"] })
            }
            fn start_server_behind(network: &crate::TestNetwork) -> crate::PrivateServer {
                crate::PrivateServer::mariadb_behind(
                    network,
                    &["--tcp-keepalive-time=1", "--tcp-keepalive-interval=1", "--tcp-keepalive-probes=3"],
                )
            }
            /// MariaDB has no per-connection bound on unacknowledged data:
            /// the database host's retransmission limit, about 12 s.
            const SERVER_SYSCTLS: &[&str] = &["net.ipv4.tcp_retries2=5"];
            /// Diesel's MySQL connection takes no timeout: the workers'
            /// host bounds their calls.
            const CLIENT_SYSCTLS: &[&str] = &[
                "net.ipv4.tcp_retries2=5",
                "net.ipv4.tcp_syn_retries=2",
                "net.ipv4.tcp_keepalive_time=1",
                "net.ipv4.tcp_keepalive_intvl=1",
                "net.ipv4.tcp_keepalive_probes=3",
            ];
            const CLIENT_QUERY: &str = "";
            $($items)*);

        #[cfg(feature = "postgres")]
        pub mod on_postgres {
            pub use super::pg::*;
        }
        #[cfg(feature = "mysql")]
        pub mod on_mysql {
            pub use super::mysql::*;
        }
    };
}

mod bad_input;
#[cfg(feature = "async")]
mod cancellation;
mod claiming;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod crash;
mod leases;
mod money;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod network;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod partitions;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod row_locks;
mod tables;

use procs::{Fields, Launcher, Worker};

/// How hard to push: light runs in the test suite, heavy on demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    Light,
    Heavy,
}

impl Scale {
    pub fn parse(text: &str) -> Option<Scale> {
        match text {
            "light" => Some(Scale::Light),
            "heavy" => Some(Scale::Heavy),
            _ => None,
        }
    }

    /// `light` or `heavy`, whichever this scale is.
    fn pick<T>(self, light: T, heavy: T) -> T {
        match self {
            Scale::Light => light,
            Scale::Heavy => heavy,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
    Mysql,
}

impl Backend {
    /// The backends compiled in, or the one named.
    pub fn parse_list(text: &str) -> Option<Vec<Backend>> {
        let all = [
            #[cfg(feature = "postgres")]
            Backend::Postgres,
            #[cfg(feature = "sqlite")]
            Backend::Sqlite,
            #[cfg(feature = "mysql")]
            Backend::Mysql,
        ];
        match text {
            "all" => Some(all.to_vec()),
            _ => all.into_iter().find(|b| b.name() == text).map(|b| vec![b]),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
            Backend::Mysql => "mysql",
        }
    }
}

/// What a scenario run gets: its scale, and how to start worker processes.
pub struct Ctx<'a> {
    pub scale: Scale,
    pub backend: Backend,
    launcher: &'a Launcher,
}

impl Ctx<'_> {
    /// Concurrent workers (threads) in all, and the processes they are spread over.
    pub fn workers(&self) -> (usize, usize) {
        match (self.scale, self.backend) {
            (Scale::Light, _) => (4, 2),
            (Scale::Heavy, Backend::Postgres | Backend::Mysql) => (32, 4),
            // SQLite commits one writer at a time: more workers only queue.
            (Scale::Heavy, Backend::Sqlite) => (8, 4),
        }
    }

    /// Rows to drain.
    pub fn rows(&self) -> usize {
        match (self.scale, self.backend) {
            (Scale::Light, Backend::Postgres | Backend::Mysql) => 400,
            (Scale::Light, Backend::Sqlite) => 200,
            (Scale::Heavy, Backend::Postgres | Backend::Mysql) => 100_000,
            (Scale::Heavy, Backend::Sqlite) => 10_000,
        }
    }

    /// How long timed runs (banks, lease hammering) last.
    pub fn run_time(&self) -> Duration {
        self.scale
            .pick(Duration::from_secs(2), Duration::from_secs(60))
    }

    /// How many times a one-off fault (a kill, a stall) is repeated.
    pub fn repeats(&self) -> usize {
        self.scale.pick(2, 10)
    }

    /// Starts a worker process running `kind` for this backend.
    pub fn spawn(&self, kind: &str, args: &[(&str, String)]) -> Worker {
        self.spawn_with_env(kind, args, &[])
    }

    /// Starts a worker process running `kind`, adding `env` to its environment.
    pub fn spawn_with_env(
        &self,
        kind: &str,
        args: &[(&str, String)],
        env: &[(&str, &str)],
    ) -> Worker {
        self.spawn_in(None, kind, args, env)
    }

    /// Starts a worker process running `kind`, in network namespace
    /// `namespace` if one is given, adding `env` to its environment.
    pub fn spawn_in(
        &self,
        namespace: Option<&str>,
        kind: &str,
        args: &[(&str, String)],
        env: &[(&str, &str)],
    ) -> Worker {
        let mut all = vec![self.backend.name().to_owned(), kind.to_owned()];
        all.extend(args.iter().map(|(key, value)| format!("{key}={value}")));
        self.launcher.spawn(&all, env, namespace)
    }

    /// Starts `processes` workers of `kind` sharing `threads` threads, numbered
    /// from 1, and waits for each to finish; returns what each reported.
    pub fn run_workers(
        &self,
        kind: &str,
        threads: usize,
        processes: usize,
        args: &[(&str, String)],
    ) -> Vec<Fields> {
        let workers: Vec<Worker> = (0..processes)
            .map(|p| {
                let mut args = args.to_vec();
                let share = threads / processes + usize::from(p < threads % processes);
                args.push(("threads", share.to_string()));
                args.push(("first", (1 + p * threads.div_ceil(processes)).to_string()));
                self.spawn(kind, &args)
            })
            .collect();
        workers.into_iter().map(Worker::finish).collect()
    }
}

/// The figures of one scenario run, and whatever went wrong.
#[derive(Debug, Default)]
pub struct Figures {
    pub workers: usize,
    pub processes: usize,
    /// Rows processed, transfers made, leases taken: the scenario's unit of work.
    pub ops: u64,
    /// Work done twice (rows processed twice, names reserved twice).
    pub duplicates: u64,
    /// Work left undone that should have been done.
    pub leftovers: u64,
    /// Broken invariants other than duplicates and leftovers.
    pub violations: u64,
    /// Attempts beyond the first made by `retry` (or the scenario's own loop).
    pub retries: u64,
    /// Typed errors seen, by kind.
    pub errors: BTreeMap<String, u64>,
    /// Measurements worth printing (delays, timings).
    pub notes: Vec<String>,
    /// What each violation was.
    pub failures: Vec<String>,
}

impl Figures {
    pub fn new(workers: usize, processes: usize) -> Figures {
        Figures {
            workers,
            processes,
            ..Figures::default()
        }
    }

    /// Records a violation unless `ok`.
    pub fn check(&mut self, ok: bool, what: impl Display) {
        if !ok {
            self.violations += 1;
            self.failures.push(what.to_string());
        }
    }

    /// Counts an error seen, by its kind.
    pub fn saw(&mut self, error: &diesel_claim::Error) {
        self.count_error(error_kind(error));
    }

    pub fn count_error(&mut self, kind: impl Into<String>) {
        *self.errors.entry(kind.into()).or_default() += 1;
    }

    pub fn note(&mut self, note: impl Display) {
        self.notes.push(note.to_string());
    }

    /// Adds what a worker process reported in its `done` line.
    pub fn absorb(&mut self, fields: &Fields) {
        self.ops += fields.number("ops");
        self.retries += fields.number("retries");
        for (kind, count) in fields.counts("errors") {
            *self.errors.entry(kind).or_default() += count;
        }
        if let Some(failure) = fields.get("failure") {
            self.check(false, format!("a worker failed: {failure}"));
        }
    }

    /// Adds another thread's figures (counts only; workers and processes stay).
    pub fn merge(&mut self, other: Figures) {
        self.ops += other.ops;
        self.duplicates += other.duplicates;
        self.leftovers += other.leftovers;
        self.violations += other.violations;
        self.retries += other.retries;
        for (kind, count) in other.errors {
            *self.errors.entry(kind).or_default() += count;
        }
        self.notes.extend(other.notes);
        self.failures.extend(other.failures);
    }

    /// What a worker process reports in its `done` line (see [`Figures::absorb`]).
    pub fn to_fields(&self) -> Fields {
        let mut fields = Fields::default();
        fields
            .set("ops", self.ops)
            .set("retries", self.retries)
            .set_counts("errors", &self.errors);
        if !self.failures.is_empty() {
            fields.set(
                "failure",
                self.failures.join("|").replace(char::is_whitespace, "_"),
            );
        }
        fields
    }

    fn passed(&self) -> bool {
        self.failures.is_empty()
            && self.duplicates == 0
            && self.leftovers == 0
            && self.violations == 0
    }
}

/// A short name for an error's kind, as counted in the figures.
pub fn error_kind(error: &diesel_claim::Error) -> String {
    use diesel::result::Error as Diesel;
    use diesel_claim::Error::*;
    match error {
        LockNotAvailable => "LockNotAvailable".into(),
        Deadlock(_) => "Deadlock".into(),
        SerializationFailure(_) => "SerializationFailure".into(),
        VersionConflict { .. } => "VersionConflict".into(),
        VersionOverflow(_) => "VersionOverflow".into(),
        NotFound => "NotFound".into(),
        LeaseHeld { .. } => "LeaseHeld".into(),
        NotLeaseOwner { .. } => "NotLeaseOwner".into(),
        InvalidArgument(_) => "InvalidArgument".into(),
        Database(Diesel::DatabaseError(kind, _)) => format!("Database({kind:?})"),
        BrokenConnection(_) => "BrokenConnection".into(),
        // Diesel's own error, by its variant: `RollbackErrorOnCommit`, say.
        Database(other) => {
            let variant = format!("{other:?}");
            format!(
                "Database({})",
                variant.split(['(', ' ', '{']).next().unwrap_or_default()
            )
        }
        Migration(_) => "Migration".into(),
        _ => "other".into(),
    }
}

/// Errors whose kind the figures count.
pub trait ErrorKind {
    fn kind(&self) -> String;
}

impl ErrorKind for diesel_claim::Error {
    fn kind(&self) -> String {
        error_kind(self)
    }
}

impl ErrorKind for crate::fixtures::BankError {
    fn kind(&self) -> String {
        match self {
            crate::fixtures::BankError::Insufficient => "Insufficient".into(),
            crate::fixtures::BankError::Claim(error) => error_kind(error),
        }
    }
}

/// The retry policy of the scenarios: patient, because they contend on purpose.
pub const PATIENT: diesel_claim::RetryPolicy = diesel_claim::RetryPolicy {
    max_attempts: 1000,
    initial_backoff: Duration::from_millis(1),
    max_backoff: Duration::from_millis(100),
};

/// [`diesel_claim::retry`] with the [`PATIENT`] policy, counting into `figures` the
/// retries it took and the kind of every transient error it recovered from.
pub fn counted_retry<C, T, E>(
    conn: &mut C,
    figures: &mut Figures,
    mut operation: impl FnMut(&mut C) -> Result<T, E>,
) -> Result<T, E>
where
    E: diesel_claim::Transient + From<diesel_claim::Error> + ErrorKind,
{
    let mut attempts = 0;
    let result = diesel_claim::retry(conn, PATIENT, |conn| {
        attempts += 1;
        let result = operation(conn);
        if let Err(error) = &result {
            if error.is_transient() {
                figures.count_error(error.kind());
            }
        }
        result
    });
    figures.retries += attempts - 1;
    result
}

/// A flag that background threads (updaters, readers, killers) poll while the
/// foreground work runs. Clear it through [`Running::stop_on_drop`], so that a
/// panic in the foreground stops them too instead of leaving `thread::scope`
/// waiting for them forever.
pub struct Running(AtomicBool);

impl Running {
    pub fn new() -> Running {
        Running(AtomicBool::new(true))
    }

    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Clears the flag now (from a thread that decides to stop the others).
    pub fn stop(&self) {
        self.0.store(false, Ordering::Relaxed);
    }

    /// Clears the flag when the returned guard goes, however it goes.
    pub fn stop_on_drop(&self) -> impl Drop + '_ {
        struct Stop<'a>(&'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Relaxed);
            }
        }
        Stop(&self.0)
    }
}

/// Runs `body(thread_index)` on `threads` threads at once and adds up their figures.
pub fn in_threads(threads: usize, body: impl Fn(usize) -> Figures + Sync) -> Figures {
    let body = &body;
    let mut total = Figures::default();
    thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|index| scope.spawn(move || body(index)))
            .collect();
        for handle in handles {
            total.merge(handle.join().expect("a thread panicked"));
        }
    });
    total
}

/// One scenario of `RELIABILITY.md` on one backend.
pub struct Scenario {
    pub number: u32,
    pub name: &'static str,
    run: fn(&Ctx) -> Figures,
}

/// The scenarios every backend runs, from its `on_<backend>` modules.
macro_rules! shared_scenarios {
    ($backend:ident) => {
        shared_scenarios!($backend:
            1 "drain" claiming::drain,
            2 "double-check" claiming::double_check,
            4 "worker-killed" claiming::worker_killed,
            6 "closure-error-panic" claiming::closure_error_and_panic,
            10 "pessimistic-bank" money::pessimistic_bank,
            11 "optimistic-bank" money::optimistic_bank,
            12 "counter" money::counter,
            13 "overdraw-race" money::overdraw_race,
            15 "optimistic-edges" money::optimistic_edge_cases,
            16 "lease-exclusion" leases::mutual_exclusion,
            17 "lease-ttl" leases::ttl,
            18 "lease-owner" leases::owner_check,
            19 "lease-fencing" leases::fencing,
            20 "unique-name" leases::unique_name,
            21 "bad-input" bad_input::bad_input,
            23 "kept-lease" leases::kept_lease,
            24 "worker-loop" claiming::worker_loop,
            25 "visibility-timeout" claiming::visibility_timeout,
        )
    };
    ($backend:ident: $($number:literal $name:literal $module:ident::$function:ident,)*) => {
        vec![$(Scenario {
            number: $number,
            name: $name,
            run: $module::$backend::$function,
        },)*]
    };
}

/// The scenarios of the backends with row locks and servers to crash.
macro_rules! row_lock_scenarios {
    ($backend:ident) => {
        shared_scenarios!($backend:
            3 "isolation-levels" row_locks::isolation_levels,
            5 "connection-killed" row_locks::connection_killed,
            7 "lock-interference" row_locks::lock_interference,
            8 "joined-queries" row_locks::joined_queries,
            9 "timeouts" row_locks::timeouts,
            14 "deadlock" row_locks::deadlock,
            22 "partitioned-drain" partitions::partitioned_drain,
            27 "server-crash" crash::server_crash,
            28 "network-faults" network::network_faults,
            29 "stalled-renewals" network::stalled_renewals,
        )
    };
}

/// Every scenario of a database server: the shared ones, those of row locks
/// and servers to crash, and, with the async API, dropped async claims.
macro_rules! server_scenarios {
    ($backend:ident) => {{
        let mut all = shared_scenarios!($backend);
        all.extend(row_lock_scenarios!($backend));
        #[cfg(feature = "async")]
        all.push(Scenario {
            number: 26,
            name: "async-cancellation",
            run: cancellation::$backend::dropped_futures,
        });
        all.sort_by_key(|s| s.number);
        all
    }};
}

/// The scenarios that apply to `backend`, in order.
pub fn scenarios(backend: Backend) -> Vec<Scenario> {
    match backend {
        #[cfg(feature = "postgres")]
        Backend::Postgres => server_scenarios!(on_postgres),
        #[cfg(feature = "sqlite")]
        Backend::Sqlite => shared_scenarios!(on_sqlite),
        #[cfg(feature = "mysql")]
        Backend::Mysql => server_scenarios!(on_mysql),
        #[allow(unreachable_patterns)]
        _ => Vec::new(),
    }
}

/// Which scenarios to run: `all`, numbers and names separated by commas.
pub fn selected(selection: &str, scenario: &Scenario) -> bool {
    selection.split(',').any(|wanted| {
        wanted == "all" || wanted == scenario.name || wanted == scenario.number.to_string()
    })
}

/// The result of one scenario run.
pub struct Outcome {
    pub backend: Backend,
    pub number: u32,
    pub name: &'static str,
    pub elapsed: Duration,
    pub figures: Figures,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.figures.passed()
    }
}

impl Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fig = &self.figures;
        let errors = if fig.errors.is_empty() {
            "-".to_owned()
        } else {
            let counts: Vec<_> = fig.errors.iter().map(|(k, n)| format!("{k}:{n}")).collect();
            counts.join(",")
        };
        write!(
            f,
            "{:>2} {:<20} {:<8} {} workers={} procs={} ops={} {:.2}s dup={} left={} viol={} \
             retries={} errors={}",
            self.number,
            self.name,
            self.backend.name(),
            if self.passed() { "PASS" } else { "FAIL" },
            fig.workers,
            fig.processes,
            fig.ops,
            self.elapsed.as_secs_f64(),
            fig.duplicates,
            fig.leftovers,
            fig.violations,
            fig.retries,
            errors,
        )?;
        if !fig.notes.is_empty() {
            write!(f, " | {}", fig.notes.join("; "))?;
        }
        for failure in &fig.failures {
            write!(f, "\n     ! {failure}")?;
        }
        Ok(())
    }
}

/// No scenario may take longer than this: a hang is a failure, not a stuck CI.
fn deadline(scale: Scale) -> Duration {
    scale.pick(Duration::from_secs(120), Duration::from_secs(1200))
}

/// Runs the selected scenarios on each backend, printing one line per scenario
/// as it finishes; returns every outcome.
pub fn run(
    selection: &str,
    scale: Scale,
    backends: &[Backend],
    launcher: &Launcher,
) -> Vec<Outcome> {
    quiet_deliberate_panics();
    let mut outcomes = Vec::new();
    for &backend in backends {
        let ctx = Ctx {
            scale,
            backend,
            launcher,
        };
        for scenario in scenarios(backend) {
            if !selected(selection, &scenario) {
                continue;
            }
            let outcome = run_one(&ctx, &scenario);
            println!("{outcome}");
            outcomes.push(outcome);
        }
    }
    outcomes
}

/// Panic messages of the scenarios' deliberate panics start with this; the
/// panic hook keeps them quiet.
pub const DELIBERATE: &str = "deliberate panic";

/// Installs a panic hook that reports every panic but the deliberate ones.
fn quiet_deliberate_panics() {
    let report = panic::take_hook();
    panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied());
        if !message.is_some_and(|m| m.starts_with(DELIBERATE)) {
            report(info);
        }
    }));
}

/// Runs one scenario under a watchdog; a panic is a failure with its message.
fn run_one(ctx: &Ctx, scenario: &Scenario) -> Outcome {
    let (finished, watchdog) = watchdog(
        format!("{} {}", scenario.number, scenario.name),
        deadline(ctx.scale),
    );
    let started = Instant::now();
    let figures =
        panic::catch_unwind(AssertUnwindSafe(|| (scenario.run)(ctx))).unwrap_or_else(|payload| {
            let mut figures = Figures::default();
            figures.check(false, format!("panicked: {}", panic_message(&payload)));
            figures
        });
    drop(finished);
    watchdog.join().unwrap();
    Outcome {
        backend: ctx.backend,
        number: scenario.number,
        name: scenario.name,
        elapsed: started.elapsed(),
        figures,
    }
}

/// Ends the process with a failure if the returned sender is not dropped within
/// `limit`: a hung scenario cannot report, and must not hang CI.
fn watchdog(what: String, limit: Duration) -> (mpsc::Sender<()>, thread::JoinHandle<()>) {
    let (finished, done) = mpsc::channel::<()>();
    let handle = thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = done.recv_timeout(limit) {
            eprintln!("FAIL: scenario {what} hung for more than {limit:?}");
            std::process::exit(2);
        }
    });
    (finished, handle)
}

pub fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a non-string panic".to_owned())
}

/// The entry point of a worker process: `<backend> <kind> key=value…`. Returns
/// the exit code.
pub fn worker_main(args: &[String]) -> i32 {
    let [backend, kind, rest @ ..] = args else {
        eprintln!("usage: worker <backend> <kind> key=value…");
        return 2;
    };
    procs::exit_with_runner();
    let fields = Fields::parse(rest.iter().map(String::as_str));
    let run = |worker: fn(&Fields) -> Figures| procs::report("done", &worker(&fields).to_fields());
    macro_rules! dispatch {
        ($backend:ident) => {
            match kind.as_str() {
                "drain" => run(claiming::$backend::drain_worker),
                "hold" => run(claiming::$backend::hold_worker),
                "loop" => run(claiming::$backend::loop_worker),
                "timed" => run(claiming::$backend::timed_worker),
                "bank" => run(money::$backend::bank_worker),
                "exclusion" => run(leases::$backend::exclusion_worker),
                "lease-holder" => run(leases::$backend::holder_worker),
                "kept-holder" => run(leases::$backend::kept_holder_worker),
                _ => {
                    eprintln!("unknown worker kind {kind:?}");
                    return 2;
                }
            }
        };
    }
    // Behind a test network, on the backends it runs.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    if kind == "stalled-holder" {
        match backend.as_str() {
            #[cfg(feature = "postgres")]
            "postgres" => run(network::on_postgres::stalled_holder_worker),
            #[cfg(feature = "mysql")]
            "mysql" => run(network::on_mysql::stalled_holder_worker),
            _ => {
                eprintln!("no test network for {backend:?}");
                return 2;
            }
        }
        return 0;
    }
    // The async workers report fields of their own (see `cancellation`).
    #[cfg(feature = "async")]
    if kind == "cancel" {
        let worker = match backend.as_str() {
            #[cfg(feature = "postgres")]
            "postgres" => cancellation::on_postgres::cancel_worker,
            #[cfg(feature = "mysql")]
            "mysql" => cancellation::on_mysql::cancel_worker,
            _ => {
                eprintln!("no async claims on {backend:?}");
                return 2;
            }
        };
        procs::report("done", &worker(&fields));
        return 0;
    }
    match backend.as_str() {
        #[cfg(feature = "postgres")]
        "postgres" => dispatch!(on_postgres),
        #[cfg(feature = "sqlite")]
        "sqlite" => dispatch!(on_sqlite),
        #[cfg(feature = "mysql")]
        "mysql" => dispatch!(on_mysql),
        _ => {
            eprintln!("unknown backend {backend:?}");
            return 2;
        }
    }
    0
}

/// A connection to `url`, set up as the tests set theirs up, opened on the
/// calling thread.
///
/// The suite's threads open their own connections rather than take them from
/// an r2d2 pool: r2d2 opens connections on background threads of its own,
/// which nobody joins (a `get` on an empty pool starts one, and it goes on
/// even when a connection handed back serves the caller first). A worker
/// process that returned from `main` while one of them was in libpq's TLS
/// handshake crashed: `exit` runs OpenSSL's `atexit` cleanup, which frees the
/// locks the handshake then takes (SIGSEGV in `CRYPTO_THREAD_write_lock`).
/// On the calling thread, every connection is opened and closed by a thread
/// the worker joins before it exits.
pub trait Connect: diesel::Connection + 'static {
    fn try_connect(url: &str) -> diesel::ConnectionResult<Self>;

    /// Sets a new connection up as the suite's connections are.
    fn set_up(_conn: &mut Self) -> diesel::QueryResult<()> {
        Ok(())
    }

    fn connect(url: &str) -> Self {
        Self::try_connect(url).unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
    }
}

#[cfg(feature = "postgres")]
impl Connect for diesel::PgConnection {
    fn try_connect(url: &str) -> diesel::ConnectionResult<Self> {
        diesel::Connection::establish(url)
    }
}

#[cfg(feature = "sqlite")]
impl Connect for diesel::SqliteConnection {
    fn try_connect(url: &str) -> diesel::ConnectionResult<Self> {
        let mut conn: Self = diesel::Connection::establish(url)?;
        Self::set_up(&mut conn).expect("cannot set up the connection");
        Ok(conn)
    }

    fn set_up(conn: &mut Self) -> diesel::QueryResult<()> {
        crate::sqlite::set_pragmas(conn)
    }
}

/// An r2d2 pool of `size` connections to `url`, set up as the suite's, that
/// builds even while the server is down.
pub fn pool_of<C>(url: &str, size: u32) -> diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<C>>
where
    C: Connect + diesel::r2d2::R2D2Connection + Send,
{
    #[derive(Debug)]
    struct SetUp;
    impl<C: Connect> diesel::r2d2::CustomizeConnection<C, diesel::r2d2::Error> for SetUp {
        fn on_acquire(&self, conn: &mut C) -> Result<(), diesel::r2d2::Error> {
            C::set_up(conn).map_err(diesel::r2d2::Error::QueryError)
        }
    }
    diesel::r2d2::Pool::builder()
        .max_size(size)
        .connection_timeout(Duration::from_secs(2))
        .connection_customizer(Box::new(SetUp))
        .build_unchecked(diesel::r2d2::ConnectionManager::new(url))
}

/// A connection to `url`, waiting out a server that is down or restarting
/// as a worker should: a new attempt every 100 ms, each refusal counted as a
/// `ConnectionError`, for at most a minute.
pub fn connect_patiently<C: Connect>(url: &str, figures: &mut Figures) -> C {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match C::try_connect(url) {
            Ok(conn) => return conn,
            Err(_) if Instant::now() < deadline => {
                figures.count_error("ConnectionError");
                thread::sleep(Duration::from_millis(100));
            }
            Err(error) => panic!("{url} refused connections for a minute: {error}"),
        }
    }
}

#[cfg(feature = "mysql")]
impl Connect for diesel::MysqlConnection {
    fn try_connect(url: &str) -> diesel::ConnectionResult<Self> {
        diesel::Connection::establish(url)
    }
}
