//! `with_lock` reads its rows twice: a boxed query, which cannot be cloned,
//! is refused with a pointer at `rebuild`.
//~ rows of type `_` cannot be locked through `BoxedSelectStatement<
//~ wrap the code that builds it in `diesel_claim::rebuild(|| …)`
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
        .filter(orders::id.eq(1))
        .into_boxed()
        .with_lock(&mut conn, |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        });
}
