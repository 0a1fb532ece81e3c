//! An async failure hook too is checked before the claim's closure fixes
//! the row type: a hook whose row's type is not named is refused, the
//! compiler asking for the method's type parameters (the closure's own type
//! among them, which cannot be written) where naming the row's type is the
//! fix.
//~ error[E0282]: type annotations needed
//~ cannot infer type of the type parameter `R` declared on the method `on_failure`
//~# 1 error in at most 20 lines
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_claim::aio::prelude::*;

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

async fn claim(conn: &mut AsyncPgConnection) {
    let _ = orders::table
        .filter(orders::done.eq(false))
        .select(Order::as_select())
        .build_claim()
        .on_failure(async |conn, order, _error| {
            diesel_async::RunQueryDsl::execute(
                diesel::update(orders::table.find(order.id))
                    .set(orders::attempts.eq(orders::attempts + 1)),
                conn,
            )
            .await?;
            Ok(())
        })
        .each(conn, async |_, order: Order| {
            let _ = (order.id, order.done);
            Ok::<_, Error>(())
        })
        .await;
}

fn main() {
    let _ = claim;
}
