// Shared by the documentation examples: an in-memory SQLite shop.
use diesel::connection::SimpleConnection;
use diesel::prelude::*;

diesel::table! {
    orders (id) {
        id -> Integer,
        shipped -> Bool,
        email_sent -> Bool,
    }
}

diesel::table! {
    accounts (id) {
        id -> Integer,
        balance -> BigInt,
        version -> Integer,
    }
}

#[derive(Debug, Queryable, Selectable, Identifiable)]
#[diesel(table_name = orders)]
pub struct Order {
    pub id: i32,
    pub shipped: bool,
    pub email_sent: bool,
}

#[derive(Debug, Queryable, Selectable, Identifiable)]
#[diesel(table_name = accounts)]
pub struct Account {
    pub id: i32,
    pub balance: i64,
    pub version: i32,
}

fn establish_connection() -> SqliteConnection {
    let mut conn = SqliteConnection::establish(":memory:").unwrap();
    conn.batch_execute(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, shipped BOOLEAN NOT NULL, email_sent BOOLEAN NOT NULL);
         INSERT INTO orders (shipped, email_sent) VALUES (TRUE, FALSE), (TRUE, FALSE), (FALSE, FALSE);
         CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance BIGINT NOT NULL, version INTEGER NOT NULL);
         INSERT INTO accounts (balance, version) VALUES (100, 0), (50, 0);",
    )
    .unwrap();
    diesel_claim::run_migrations(&mut conn).unwrap();
    conn
}

#[allow(dead_code)]
fn send_shipped_email(_order: &Order) -> Result<(), diesel_claim::Error> {
    Ok(())
}

#[allow(dead_code)]
fn send_shipped_emails(_orders: &[Order]) -> Result<(), diesel_claim::Error> {
    Ok(())
}
