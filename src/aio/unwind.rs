//! A panic in a future, caught: futures-util's `catch_unwind`, which needs
//! that crate's `std` feature. Turning it on would rebuild futures-util, and
//! every crate of the application's above it, for these few lines.

use std::future::{poll_fn, Future};
use std::panic::{self, AssertUnwindSafe};
use std::pin::pin;
use std::task::Poll;

/// Awaits `future`; a panic in one of its polls ends it, and its payload is
/// the result, as `std::panic::catch_unwind` gives it. The future is not
/// polled again after it panicked.
pub(super) async fn catch_unwind<F: Future>(future: F) -> std::thread::Result<F::Output> {
    let mut future = pin!(future);
    poll_fn(
        move |cx| match panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(payload) => Poll::Ready(Err(payload)),
        },
    )
    .await
}
