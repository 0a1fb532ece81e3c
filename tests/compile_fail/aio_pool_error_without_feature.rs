//! `?` on a bb8 pool's checkout in a function that returns the crate's
//! error, with diesel-claim's `bb8` feature left off: the error names the
//! feature the conversion comes with.
//~ `bb8::api::RunError<PoolError>: Unconvertible` is not satisfied
//~ a pool's error converts with diesel-claim's feature for the pool: `bb8`, `deadpool`
//~# 1 error in at most 30 lines
use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::AsyncPgConnection;

async fn check_out(pool: &Pool<AsyncPgConnection>) -> Result<(), diesel_claim::Error> {
    let _conn = pool.get().await?;
    Ok(())
}

fn main() {
    let _ = check_out;
}
