//! A boxed query cannot be cloned: the diagnostic points at `rebuild`.
//~ cannot be claimed from `BoxedSelectStatement<
//~ diesel_claim::rebuild(|| …)
//~! ClaimStatements
//~# 1 error in at most 40 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;

diesel::table! {
    orders (id) {
        id -> Integer,
        done -> Bool,
    }
}

#[derive(Queryable, Selectable, Identifiable)]
struct Order {
    id: i32,
    done: bool,
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = orders::table
        .into_boxed()
        .filter(orders::done.eq(false))
        .claim_each(&mut conn, |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        });
}
