//! The connections the blocking API runs on, named by one trait so that the
//! compiler, handed a diesel-async connection, names the prelude to import.

use diesel::connection::LoadConnection;

use crate::ClaimBackend;

/// A blocking Diesel connection of a backend the crate supports: any
/// [`LoadConnection`] whose backend is a [`ClaimBackend`], pooled ones
/// included. Every blocking entry point of the crate takes one. Implemented
/// for all of them; there is nothing to implement.
///
/// `Inferred` is never written: the compiler infers it. It is there for the
/// error a connection of another kind gets. Given diesel-async's
/// `AsyncPgConnection` with the crate's blocking prelude in scope, the
/// compiler says that it is not a connection the blocking API runs on and
/// that `diesel_claim::aio::prelude` is the one to import, where it would
/// otherwise report a `LoadConnection` bound some layers down. (Claims,
/// locks and versioned updates also bound `C::Backend: ClaimBackend` on its
/// own, so that a connection of an unsupported backend, such as a
/// `#[derive(MultiConnection)]` one, hears that too.)
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a blocking connection diesel-claim runs on",
    label = "the blocking API needs one of Diesel's connections here",
    note = "diesel-claim's blocking API runs on Diesel's `PgConnection`, `SqliteConnection` and \
            `MysqlConnection`, and on their r2d2 pooled connections",
    note = "on a diesel-async connection, import `diesel_claim::aio::prelude::*` in place of \
            `diesel_claim::prelude::*`, and take `Lease`, `with_lease` and `run_migrations` \
            from `diesel_claim::aio`"
)]
pub trait BlockingConnection<Inferred>: LoadConnection<Backend: ClaimBackend> {}

/// The types of [`BlockingConnection`]'s parameter, which no caller names.
mod inferred {
    /// The parameter of every blocking connection.
    #[derive(Debug)]
    pub enum Blocking {}

    /// The parameter of an impl that never applies: no type implements
    /// [`Unimplemented`].
    #[derive(Debug)]
    pub enum Never {}

    /// Implemented by no type.
    pub trait Unimplemented {}
}

impl<C: LoadConnection<Backend: ClaimBackend>> BlockingConnection<inferred::Blocking> for C {}

// Never applies, and is there for the diagnostic: with two candidate impls
// that both fail, the compiler reports `BlockingConnection` itself, with its
// note, where with one it would report the first bound of that impl to fail
// (`LoadConnection`).
#[doc(hidden)]
impl<C> BlockingConnection<inferred::Never> for C where
    C: LoadConnection<Backend: ClaimBackend> + inferred::Unimplemented
{
}

/// The connection [`with_lease_kept_alive`](crate::with_lease_kept_alive)
/// renews its lease on: a blocking connection of its own, given by value,
/// that moves to the renewing thread. Implemented for all of them; there is
/// nothing to implement.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot renew a lease: the renewing connection is given by value",
    label = "a connection of its own, moved to the thread that renews the lease",
    note = "pass the second connection itself (`second`, not `&mut second`) or one checked out of \
            a pool (`pool.get()?`): the renewing thread owns it and drops it when the lease ends"
)]
pub trait RenewingConnection: LoadConnection<Backend: ClaimBackend> + Send + 'static {}

#[diagnostic::do_not_recommend]
impl<C: LoadConnection<Backend: ClaimBackend> + Send + 'static> RenewingConnection for C {}
