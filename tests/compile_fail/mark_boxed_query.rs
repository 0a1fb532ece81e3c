//! `mark` builds its statements from the query too: a boxed query is refused
//! by the mark's error, with a pointer at `rebuild`.
//~ rows of type `_` cannot be claimed from `BoxedSelectStatement<
//~ and marked with `Grouped<Eq<done
//~ the changes an `AsChangeset` for that table; a boxed query cannot be cloned: wrap the code that builds it in `diesel_claim::rebuild(|| …)`
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
        .filter(orders::done.eq(false))
        .into_boxed()
        .build_claim()
        .mark(orders::done.eq(true))
        .each(&mut conn, |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        });
}
