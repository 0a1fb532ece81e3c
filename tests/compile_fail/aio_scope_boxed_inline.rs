//! A claim closure written as diesel-async's `transaction` took them before
//! 0.9, `|conn, row| async move { … }.scope_boxed()`, inline. The compiler
//! refuses it with words no attribute can add to (a lifetime the closure's
//! type cannot express, not a trait left unimplemented), so the crate's docs
//! quote these words where they name the fix, `diesel_claim::aio::scoped`
//! (the module's Closures section, and `scoped` itself); this program
//! checks the words are still the ones quoted.
//~ implementation of `AsyncFnMut` is not general enough
//~# 9 errors in at most 210 lines
use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_claim::aio::prelude::*;
use diesel_claim::Error;

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

async fn claim(conn: &mut AsyncPgConnection) {
    let _ = orders::table
        .filter(orders::done.eq(false))
        .claim_each(conn, |_, order: Order| {
            async move {
                let _ = (order.id, order.done);
                Ok::<_, Error>(())
            }
            .scope_boxed()
        })
        .await;
}

fn main() {
    let _ = claim;
}
