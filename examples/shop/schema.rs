//! The shop's tables and the Rust types rows are loaded into.
//!
//! The `table!` definitions are the same for every backend; only the DDL that
//! creates them differs (see `sqlite.rs` and `postgres.rs`).

use diesel::prelude::*;

diesel::table! {
    /// Orders, as in the seed article: an order is shipped once `shipped_at` is
    /// set, and its confirmation email is sent once `shipped_email_sent` is true.
    orders (id) {
        id -> Integer,
        customer_email -> Text,
        shipped_at -> Nullable<Timestamp>,
        shipped_email_sent -> Bool,
        /// Express orders (1) are emailed before the others (0).
        priority -> Integer,
        /// Failed attempts at the shipping email: at the limit, the order is a
        /// dead letter, left out of the job for someone to look at.
        email_attempts -> Integer,
    }
}

diesel::table! {
    /// The transactional outbox: a row here is an email handed to the mail
    /// server. It is written in the same transaction that marks the order, so
    /// "sent" and "marked as sent" commit or roll back together.
    ///
    /// There is deliberately no UNIQUE (order_id): the example checks for
    /// duplicates itself, so a double send would show up instead of being
    /// masked by a constraint violation.
    outbox (id) {
        id -> Integer,
        order_id -> Integer,
        recipient -> Text,
        subject -> Text,
        worker -> Integer,
    }
}

diesel::table! {
    /// Bank accounts, as in the seed article, plus the version column that
    /// optimistic updates check.
    accounts (id) {
        id -> Integer,
        owner -> Text,
        balance -> BigInt,
        version -> Integer,
    }
}

diesel::table! {
    /// One row per booked movement of money, written in the same transaction as
    /// the balance change; an account's balance must equal the sum of its rows.
    ledger (id) {
        id -> Integer,
        account_id -> Integer,
        amount -> BigInt,
        method -> Text,
    }
}

diesel::table! {
    /// User accounts. A name may be reused once its previous holder is gone, so
    /// (as in the seed article) there is no UNIQUE (name): the sign-up code must
    /// make sure there is only one *active* user per name.
    users (id) {
        id -> Integer,
        name -> Text,
        active -> Bool,
        lease_token -> Nullable<BigInt>,
    }
}

diesel::joinable!(outbox -> orders (order_id));
diesel::joinable!(ledger -> accounts (account_id));
diesel::allow_tables_to_appear_in_same_query!(orders, outbox, accounts, ledger, users);

/// What the email workers need of an order. `shipped_at` is left out (reading a
/// `Timestamp` would need Diesel's `chrono` or `time` feature), so queries
/// select it with `.select(Order::as_select())`.
///
/// `Identifiable` is what lets `claim_each` find the row's table and key.
#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = orders)]
pub struct Order {
    pub id: i32,
    pub customer_email: String,
    pub shipped_email_sent: bool,
}

#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = accounts)]
pub struct Account {
    pub id: i32,
    pub owner: String,
    pub balance: i64,
    pub version: i32,
}
