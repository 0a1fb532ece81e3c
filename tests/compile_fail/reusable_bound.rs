//! A helper generic over the queries the crate can build its statements
//! from (`Reusable`), given a boxed query: the error says why a boxed query
//! is not one, and names `rebuild`.
//~ cannot be cloned, and the crate builds each statement from a copy of the query
//~ a query that cannot be cloned
//~ wrap the code that builds it in `diesel_claim::rebuild(|| …)`
//~# 2 errors in at most 50 lines
use diesel::prelude::*;
use diesel_claim::Reusable;

diesel::table! {
    jobs (id) {
        id -> Integer,
        done -> Bool,
    }
}

fn twice<Q: Reusable>(query: Q) -> [Q::Query; 2] {
    [query.query(), query.query()]
}

fn main() {
    let pending = jobs::table.filter(jobs::done.eq(false)).into_boxed::<diesel::pg::Pg>();
    let _ = twice(pending);
}
