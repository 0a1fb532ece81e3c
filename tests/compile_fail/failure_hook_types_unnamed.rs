//! A failure hook is checked where it is given, before the claim's closure
//! fixes the row type: a hook whose row's type is not named is refused, and
//! the compiler says to name it.
//~ error[E0282]: type annotations needed
//~ help: consider giving this closure parameter an explicit type
//~ order: /* Type */
//~# 1 error in at most 20 lines
use diesel::prelude::*;
use diesel_claim::prelude::*;

diesel::table! {
    orders (id) {
        id -> Integer,
        attempts -> Integer,
        done -> Bool,
    }
}

#[derive(Clone, Queryable, Selectable, Identifiable)]
struct Order {
    id: i32,
    done: bool,
}

fn main() {
    let mut conn = PgConnection::establish("postgres://").unwrap();
    let _ = orders::table
        .filter(orders::done.eq(false))
        .select(Order::as_select())
        .build_claim()
        .on_failure(|conn, order, _error| {
            diesel::update(orders::table.find(order.id))
                .set(orders::attempts.eq(orders::attempts + 1))
                .execute(conn)?;
            Ok(())
        })
        .each(&mut conn, |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, diesel_claim::Error>(())
        });
}
