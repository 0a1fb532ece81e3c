//! An error of the application's own turned into the crate's error: the
//! refusal says there is no conversion, names the pools' features (the
//! conversions most often missed) and what to do with errors of one's own.
//~ `std::io::Error` does not convert into `diesel_claim::Error`
//~ a pool's checkout error converts with diesel-claim's feature for that pool
//~ for errors of your own, return a type of yours that implements `From<diesel_claim::Error>` (or `anyhow::Error`)
//~# 1 error in at most 40 lines
fn main() {
    let _ = diesel_claim::Error::from(std::io::Error::other("disk full"));
}
