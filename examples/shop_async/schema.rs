//! The shop's tables and the Rust types rows are loaded into.
//!
//! The `table!` definitions are the same for every backend; only the DDL that
//! creates them differs (see `postgres.rs` and `mysql.rs`).

use diesel::prelude::{Identifiable, Queryable, Selectable};

diesel::table! {
    /// Orders: the confirmation email is due once `shipped` is true, and sent
    /// once `email_sent` is.
    orders (id) {
        id -> Integer,
        customer_email -> Text,
        shipped -> Bool,
        email_sent -> Bool,
    }
}

diesel::table! {
    /// The transactional outbox: a row here is an email handed to the mail
    /// server, written in the same transaction that marks the order.
    ///
    /// There is deliberately no UNIQUE (order_id): the example counts duplicates
    /// itself, so a double send would show up instead of being masked by a
    /// constraint violation.
    outbox (id) {
        id -> Integer,
        order_id -> Integer,
        recipient -> Text,
        worker -> Integer,
    }
}

diesel::table! {
    /// Bank accounts, with the version column that optimistic updates check.
    accounts (id) {
        id -> Integer,
        balance -> BigInt,
        version -> Integer,
    }
}

diesel::table! {
    /// One row per nightly report, written under the lease with its fencing
    /// token.
    reports (id) {
        id -> Integer,
        token -> BigInt,
        worker -> Integer,
    }
}

diesel::joinable!(outbox -> orders (order_id));
diesel::allow_tables_to_appear_in_same_query!(orders, outbox, accounts, reports);

/// What the email tasks need of an order, selected with
/// `.select(Order::as_select())`.
///
/// `Identifiable` is what lets `claim_each` find the row's table and key.
#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = orders)]
pub struct Order {
    pub id: i32,
    pub customer_email: String,
}

#[derive(Debug, Clone, Queryable, Selectable, Identifiable)]
#[diesel(table_name = accounts)]
pub struct Account {
    pub id: i32,
    pub balance: i64,
    pub version: i32,
}
