//! The "Bad input" list: every case gets a clear typed error (before any SQL
//! where it can be told without the database) or is stored literally, and the
//! schema is the same afterwards.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::connection::{Instrumentation, InstrumentationEvent};
use diesel::prelude::*;
use diesel::sql_types::Text;
use diesel_claim::prelude::*;
use diesel_claim::{Error, Lease, LockStrength, MAX_NAME_LEN, MAX_TTL};

use super::claiming::pending;
use super::{panic_message, Ctx, Figures};
use crate::fixtures::{accounts, Account, Order};

diesel::table! {
    diesel_claim_leases (name) {
        name -> Text,
        token -> BigInt,
    }
}

/// Counts the statements a connection sends.
#[derive(Clone, Default)]
struct StatementCount(Arc<AtomicU64>);

impl Instrumentation for StatementCount {
    fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
        if let InstrumentationEvent::StartQuery { .. } = event {
            self.0.fetch_add(1, Relaxed);
        }
    }
}

#[derive(QueryableByName, PartialEq, Debug)]
struct SchemaItem {
    #[diesel(sql_type = Text)]
    item: String,
}

/// Pieces hostile names are made of: quotes, comment and statement
/// separators, escapes, LIKE wildcards, placeholders, multi-byte and
/// direction-changing characters, NUL.
const HOSTILE: &[&str] = &[
    "'",
    "\"",
    ";",
    "--",
    "/*",
    "*/",
    "\\",
    "%",
    "_",
    "$1",
    "?",
    " ",
    "\n",
    "\t",
    "名",
    "🦀",
    "\u{202e}",
    "\u{feff}",
    "é",
    "\0",
    "'; DROP TABLE diesel_claim_leases; --",
    "' OR '1'='1",
    "x",
];

/// A name of up to `max_pieces` random hostile pieces.
fn hostile_name(random: &mut fastrand::Rng, max_pieces: u64) -> String {
    let pieces = random.u64(..max_pieces + 1);
    (0..pieces)
        .map(|_| HOSTILE[random.u64(..HOSTILE.len() as u64) as usize])
        .collect()
}

/// Whether the crate must refuse `name` (and with `InvalidArgument`).
fn invalid_name(name: &str) -> bool {
    name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0')
}

/// Checks that `result` is `Error::InvalidArgument` and that no SQL was sent.
fn expect_invalid<T: std::fmt::Debug>(
    figures: &mut Figures,
    statements: &StatementCount,
    case: &str,
    attempt: impl FnOnce() -> Result<T, Error>,
) {
    let before = statements.0.load(Relaxed);
    let result = attempt();
    let sent = statements.0.load(Relaxed) - before;
    match &result {
        Err(error @ Error::InvalidArgument(_)) => figures.saw(error),
        _ => figures.check(false, format!("{case}: {result:?}")),
    }
    figures.check(
        sent == 0,
        format!("{case}: {sent} statements sent before the refusal"),
    );
    figures.ops += 1;
}

on_suite_backends! {
    fn schema(conn: &mut Conn) -> Vec<SchemaItem> {
        let sql = match BACKEND {
            "pg" => "SELECT table_name || '.' || column_name || ':' || data_type AS item \
                 FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1",
            "mysql" => "SELECT CONCAT(table_name, '.', column_name, ':', column_type) AS item \
                 FROM information_schema.columns WHERE table_schema = DATABASE() ORDER BY 1",
            _ => "SELECT type || ':' || name || ':' || coalesce(sql, '') AS item FROM sqlite_master ORDER BY 1",
        };
        diesel::sql_query(sql).load(conn).unwrap()
    }

    /// Every case of the list, and `repeats` × 100 random hostile lease names
    /// plus some of 10 kB.
    pub fn bad_input(ctx: &Ctx) -> Figures {
        let (_db, pool) = test_db(1);
        let mut pooled = pool.get().unwrap();
        let conn: &mut Conn = &mut pooled;
        seed_accounts(conn, &[100]);
        let mut figures = Figures::new(1, 1);
        let statements = StatementCount::default();
        conn.set_instrumentation(statements.clone());
        let schema_before = schema(conn);

        refused_options(conn, &mut figures, &statements);
        refused_leases(conn, &mut figures, &statements);
        hostile_names(conn, &mut figures, &statements, 100 * ctx.repeats());
        not_owner_and_not_found(conn, &mut figures);
        unreachable_databases(&mut figures);

        figures.check(schema(conn) == schema_before, "the schema changed");
        figures
    }

    fn refused_options(conn: &mut Conn, figures: &mut Figures, statements: &StatementCount) {
        let nothing = |_: &mut Conn, _: Order| Ok::<_, Error>(());
        expect_invalid(figures, statements, "skip_locked + nowait", || {
            pending().build_claim().skip_locked().nowait().each(conn, nothing)
        });
        expect_invalid(figures, statements, "shared claim strength", || {
            pending().build_claim().strength(LockStrength::Share).each(conn, nothing)
        });
        expect_invalid(figures, statements, "max_rows(0)", || {
            pending().build_claim().max_rows(0).each(conn, nothing)
        });
        expect_invalid(figures, statements, "page_size(0)", || {
            pending().build_claim().page_size(0).each(conn, nothing)
        });
        expect_invalid(figures, statements, "batch(0)", || {
            pending().build_claim().batch(0).each(conn, nothing)
        });
        expect_invalid(figures, statements, "with_lock nowait + wait", || {
            accounts::table.find(1).build_lock().nowait().wait().run(conn, |_, _: Account| Ok::<_, Error>(()))
        });
    }

    fn refused_leases(conn: &mut Conn, figures: &mut Figures, statements: &StatementCount) {
        let names = ["".to_owned(), "x".repeat(MAX_NAME_LEN + 1), "x".repeat(10_000), "a\0b".to_owned()];
        for name in &names {
            expect_invalid(figures, statements, &format!("lease name of {} bytes", name.len()), || {
                Lease::acquire(conn, name, Duration::from_secs(1))
            });
        }
        for ttl in [Duration::ZERO, MAX_TTL + Duration::from_secs(1), Duration::MAX] {
            expect_invalid(figures, statements, &format!("ttl {ttl:?}"), || Lease::acquire(conn, "ok", ttl));
        }
        // Found by this suite: a patience too long for an `Instant` panicked
        // ("overflow when adding duration to instant") instead of waiting.
        let patient = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Lease::acquire_within(conn, "patient", Duration::from_secs(1), Duration::MAX)
        }));
        match patient {
            Ok(Ok(lease)) => figures.check(lease.release(conn).is_ok(), "patient lease: release failed"),
            Ok(Err(error)) => figures.check(false, format!("patience Duration::MAX on a free name: {error}")),
            Err(panic) => figures.check(false, format!("patience Duration::MAX panicked: {}", panic_message(&panic))),
        }
        figures.ops += 1;
    }

    /// Random hostile names, and names of 10 kB: refused exactly when invalid,
    /// otherwise taken, stored byte for byte, and released.
    fn hostile_names(conn: &mut Conn, figures: &mut Figures, statements: &StatementCount, count: usize) {
        let mut random = fastrand::Rng::with_seed(4);
        let long = (0..5).map(|_| HOSTILE[0].repeat(10_000));
        let names: Vec<String> = (0..count).map(|_| hostile_name(&mut random, 12)).chain(long).collect();
        let mut stored = 0;
        for name in &names {
            if invalid_name(name) {
                expect_invalid(figures, statements, &format!("name {name:?}"), || {
                    Lease::acquire(conn, name, Duration::from_secs(5))
                });
                continue;
            }
            let lease = match Lease::acquire(conn, name, Duration::from_secs(5)) {
                Ok(Some(lease)) => lease,
                other => {
                    figures.check(false, format!("name {name:?}: {other:?}"));
                    continue;
                }
            };
            let found: Vec<String> = diesel_claim_leases::table
                .filter(diesel_claim_leases::name.eq(name))
                .select(diesel_claim_leases::name)
                .load(conn)
                .unwrap();
            figures.check(found == [name.clone()], format!("name {name:?} stored as {found:?}"));
            figures.check(lease.release(conn).is_ok(), format!("name {name:?}: release failed"));
            stored += 1;
            figures.ops += 1;
        }
        figures.note(format!("hostile names: {} stored literally, {} refused", stored, names.len() - stored));
    }

    fn not_owner_and_not_found(conn: &mut Conn, figures: &mut Figures) {
        let lease = Lease::acquire(conn, "owned", Duration::from_millis(50)).unwrap().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let taker = Lease::acquire(conn, "owned", Duration::from_secs(5)).unwrap();
        for (case, result) in [("renew", lease.renew(conn, Duration::from_secs(1))), ("release", lease.release(conn))] {
            match result {
                Err(error @ Error::NotLeaseOwner { .. }) => figures.saw(&error),
                other => figures.check(false, format!("{case} by a non-owner: {other:?}")),
            }
        }
        if let Some(taker) = taker {
            taker.release(conn).unwrap();
        }
        let nothing = accounts::table.find(42).update_versioned(accounts::version, 0, accounts::balance.eq(1)).execute(conn);
        match nothing {
            Err(error @ Error::NotFound) => figures.saw(&error),
            other => figures.check(false, format!("versioned update of nothing: {other:?}")),
        }
        figures.ops += 3;
    }

    /// Databases that are down or unreachable: an error soon, naming the host.
    fn unreachable_databases(figures: &mut Figures) {
        let urls: &[(&str, &str)] = match BACKEND {
            "pg" => &[
                ("postgres://postgres@127.0.0.1:1/test", "127.0.0.1"),
                ("postgres://postgres@10.255.255.1:5432/test?connect_timeout=2", "10.255.255.1"),
            ],
            // Diesel's MySQL URLs take no connection timeout: an unroutable
            // host would wait for the system's TCP timeout.
            "mysql" => &[("mysql://root@127.0.0.1:1/test", "127.0.0.1")],
            _ => &[("/nonexistent-directory/torture.sqlite", "")],
        };
        for (url, host) in urls {
            let started = Instant::now();
            let outcome = Conn::establish(url);
            let took = started.elapsed();
            match outcome {
                Ok(_) => figures.check(false, format!("{url}: connected")),
                Err(error) => {
                    figures.check(error.to_string().contains(host), format!("{url}: {error} does not name {host}"));
                    figures.count_error("ConnectionError");
                }
            }
            figures.check(took < Duration::from_secs(10), format!("{url}: {took:?} to fail"));
            figures.note(format!("{url} failed in {took:.0?}"));
            figures.ops += 1;
        }
    }
}
