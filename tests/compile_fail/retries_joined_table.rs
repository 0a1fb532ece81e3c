//! A retry schedule in a joined table's columns: the query reads them, but
//! a failure is recorded in the claimed rows' own table.
//~ a retry schedule in `customers::columns::attempts` and `customers::columns::run_at` cannot record failures of rows `Order`
//~ the attempts, next run time and error columns be columns of their table
//~# 1 error in at most 50 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::Retries;

diesel::table! {
    orders (id) {
        id -> Integer,
        customer_id -> Integer,
    }
}

diesel::table! {
    customers (id) {
        id -> Integer,
        attempts -> Integer,
        run_at -> Timestamptz,
    }
}

diesel::joinable!(orders -> customers (customer_id));
diesel::allow_tables_to_appear_in_same_query!(orders, customers);

#[derive(Queryable, Selectable, Identifiable, Clone)]
struct Order {
    id: i32,
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = orders::table
        .inner_join(customers::table)
        .select(Order::as_select())
        .build_claim()
        .retries(Retries::new(customers::attempts, customers::run_at))
        .each(&mut conn, |_, order: Order| {
            let _ = order.id;
            Ok::<_, diesel_claim::Error>(())
        });
}
