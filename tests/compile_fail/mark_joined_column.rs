//! `mark` reads the marked rows from the claimed table alone: a row type with
//! a joined table's column does not compile (it would fail in the database).
//~ to implement `MarkQuery<
//~# 1 error in at most 30 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;

diesel::table! {
    customers (id) {
        id -> Integer,
        name -> Text,
    }
}

diesel::table! {
    orders (id) {
        id -> Integer,
        customer_id -> Integer,
        done -> Bool,
    }
}

diesel::joinable!(orders -> customers (customer_id));
diesel::allow_tables_to_appear_in_same_query!(orders, customers);

#[derive(Queryable, Selectable, Identifiable)]
#[diesel(table_name = orders)]
struct OrderWithName {
    id: i32,
    #[diesel(select_expression = customers::name)]
    name: String,
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = orders::table
        .inner_join(customers::table)
        .filter(orders::done.eq(false))
        .select(OrderWithName::as_select())
        .build_claim()
        .mark(orders::done.eq(true))
        .each(&mut conn, |_, order: OrderWithName| {
            let _ = (order.id, order.name);
            Ok::<_, diesel_claim::Error>(())
        });
}
