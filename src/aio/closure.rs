//! The closures the async API takes: `async` closures, bounded so that the
//! futures they return can be required to be `Send`.
//!
//! The crate's own futures promise `Send` (so that claims run in
//! `tokio::spawn`ed tasks and axum handlers), which needs the closure's
//! future to be `Send`. An `AsyncFnMut` bound alone cannot say so: the type
//! of the future it returns (`AsyncFnMut::CallRefFuture`) cannot be named on
//! stable Rust. These traits name it, as diesel-async's `AsyncFunc` does for
//! its `transaction`: an `async` closure whose future borrows nothing from
//! the closure itself is also an `FnMut` (or `FnOnce`) returning that future,
//! whose type [`Fut`](AsyncFnMut2::Fut) names. Every bound that uses them
//! also says `AsyncFnMut(…) -> …`, which is what lets the compiler infer an
//! `async` closure's argument types.

use std::future::Future;

use scoped_futures::ScopedBoxFuture;

/// An `async` closure of one argument, called any number of times, whose
/// future type is named, so that a bound can require it to be `Send`: see
/// [`AsyncFnMut2`].
pub trait AsyncFnMut1<A, T>:
    AsyncFnMut(A) -> T + FnMut(A) -> <Self as AsyncFnMut1<A, T>>::Fut
{
    /// The future the closure returns.
    type Fut: Future<Output = T>;
}

impl<F, A, T, Fut> AsyncFnMut1<A, T> for F
where
    F: AsyncFnMut(A) -> T + FnMut(A) -> Fut,
    Fut: Future<Output = T>,
{
    type Fut = Fut;
}

/// An `async` closure of two arguments, called any number of times, whose
/// future type is named, so that a bound can require it to be `Send`.
///
/// An `AsyncFnMut` bound alone cannot require that: the type of the future
/// the closure returns cannot be named on stable Rust. An `async` closure
/// whose future borrows nothing from the closure itself is also an `FnMut`
/// returning that future, whose type [`Fut`](Self::Fut) names (as
/// diesel-async's `AsyncFunc` does for its `transaction`). The async API's
/// bounds say `AsyncFnMut(…) -> …` beside it: that is what lets the compiler
/// infer an `async` closure's argument types. Implemented for every such
/// closure; see [Closures](super#closures) for what it excludes.
pub trait AsyncFnMut2<A, B, T>:
    AsyncFnMut(A, B) -> T + FnMut(A, B) -> <Self as AsyncFnMut2<A, B, T>>::Fut
{
    /// The future the closure returns.
    type Fut: Future<Output = T>;
}

impl<F, A, B, T, Fut> AsyncFnMut2<A, B, T> for F
where
    F: AsyncFnMut(A, B) -> T + FnMut(A, B) -> Fut,
    Fut: Future<Output = T>,
{
    type Fut = Fut;
}

/// An `async` closure of three arguments, called any number of times, whose
/// future type is named, so that a bound can require it to be `Send`: see
/// [`AsyncFnMut2`]. The async failure hooks are such closures.
pub trait AsyncFnMut3<A, B, D, T>:
    AsyncFnMut(A, B, D) -> T + FnMut(A, B, D) -> <Self as AsyncFnMut3<A, B, D, T>>::Fut
{
    /// The future the closure returns.
    type Fut: Future<Output = T>;
}

impl<F, A, B, D, T, Fut> AsyncFnMut3<A, B, D, T> for F
where
    F: AsyncFnMut(A, B, D) -> T + FnMut(A, B, D) -> Fut,
    Fut: Future<Output = T>,
{
    type Fut = Fut;
}

/// An `async` closure of two arguments, called once, whose future type is
/// named, so that a bound can require it to be `Send`: see [`AsyncFnMut2`].
pub trait AsyncFnOnce2<A, B, T>:
    AsyncFnOnce(A, B) -> T + FnOnce(A, B) -> <Self as AsyncFnOnce2<A, B, T>>::Fut
{
    /// The future the closure returns.
    type Fut: Future<Output = T>;
}

impl<F, A, B, T, Fut> AsyncFnOnce2<A, B, T> for F
where
    F: AsyncFnOnce(A, B) -> T + FnOnce(A, B) -> Fut,
    Fut: Future<Output = T>,
{
    type Fut = Fut;
}

/// Passes on a closure that returns a boxed future,
/// `|conn, row| async move { … }.scope_boxed()` (the form diesel-async's
/// `transaction` took before 0.9), with the signature the async API needs:
/// inline, the compiler cannot see that the boxed future's type depends on
/// the borrow of the connection, and refuses the closure ("implementation of
/// `AsyncFnMut` is not general enough"). For closures of a connection and a
/// value: claims, workers and row locks.
///
/// It is also the way to a closure that changes its own state and then
/// returns a future: an `async` closure that does both cannot promise its
/// future `Send` (see [Closures](super#closures)).
pub fn scoped<'a, C, A, T, F>(f: F) -> F
where
    F: for<'c> FnMut(&'c mut C, A) -> ScopedBoxFuture<'a, 'c, T>,
{
    f
}
