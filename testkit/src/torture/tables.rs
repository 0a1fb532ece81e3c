//! Tables the scenarios need beyond the tests' shop schema (the claiming
//! scenarios declare `timed_jobs`, whose stamp column's type is the
//! backend's). None of them has a UNIQUE constraint the invariant could lean
//! on: the crate alone must keep it.

diesel::table! {
    /// Every committed transfer, to find lost updates: each balance must equal
    /// its start plus what the ledger says came in minus what went out.
    ledger (id) {
        id -> Integer,
        from_id -> Integer,
        to_id -> Integer,
        amount -> BigInt,
    }
}

diesel::table! {
    /// How many lease holders are inside the critical section right now.
    occupancy (id) {
        id -> Integer,
        inside -> Integer,
    }
}

diesel::table! {
    /// A downstream resource that accepts a write only with a fencing token at
    /// least as new as the last one it has seen.
    fenced (id) {
        id -> Integer,
        token -> BigInt,
        writer -> Text,
    }
}

diesel::table! {
    /// Reserved user names: one active row per name, kept by a lease.
    reservations (id) {
        id -> Integer,
        name -> Text,
        holder -> Integer,
    }
}

diesel::table! {
    /// Every run of a timed job's work, outside any transaction: the runs
    /// of claims that were lost stay.
    timed_work (id) {
        id -> Integer,
        job_id -> Integer,
        worker -> Integer,
    }
}

diesel::allow_tables_to_appear_in_same_query!(ledger, occupancy, fenced, reservations);

/// The SQL creating the tables above on `backend` (`pg`, `sqlite` or
/// `mysql`), `timed_jobs` with its stamp in a column of type `stamp_column`,
/// and the index the claim's candidate scan needs (as the crate's
/// documentation says): without it each page of the scan reads every row after
/// the cursor, and a drain of 10^5 rows slows to a crawl at its end, when few
/// rows are left pending.
pub fn create_sql(backend: &str, stamp_column: &str) -> String {
    let serial = match backend {
        "pg" => "SERIAL PRIMARY KEY",
        "mysql" => "INTEGER AUTO_INCREMENT PRIMARY KEY",
        _ => "INTEGER PRIMARY KEY",
    };
    format!(
        "CREATE TABLE ledger (id {serial}, from_id INTEGER NOT NULL, to_id INTEGER NOT NULL, \
             amount BIGINT NOT NULL);
         CREATE TABLE occupancy (id INTEGER PRIMARY KEY, inside INTEGER NOT NULL);
         INSERT INTO occupancy (id, inside) VALUES (1, 0);
         CREATE TABLE fenced (id INTEGER PRIMARY KEY, token BIGINT NOT NULL, writer TEXT NOT NULL);
         INSERT INTO fenced (id, token, writer) VALUES (1, 0, 'nobody');
         CREATE TABLE reservations (id {serial}, name TEXT NOT NULL, holder INTEGER NOT NULL);
         CREATE TABLE timed_jobs (id INTEGER PRIMARY KEY, done BOOLEAN NOT NULL, \
             times_done INTEGER NOT NULL, claimed_until {stamp_column} NULL);
         CREATE TABLE timed_work (id {serial}, job_id INTEGER NOT NULL, worker INTEGER NOT NULL);
         CREATE INDEX orders_pending ON orders (email_sent, shipped, id);"
    )
}

/// Creates the tables above in a database of `backend` that has the shop
/// schema, the claim stamp's column of type `stamp_column`.
pub fn create(
    conn: &mut impl diesel::connection::SimpleConnection,
    backend: &str,
    stamp_column: &str,
) {
    conn.batch_execute(&create_sql(backend, stamp_column))
        .expect("cannot create the torture tables");
}
