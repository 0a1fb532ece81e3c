//! Queries the crate runs more than once: a claim reads keys, then locks rows,
//! page after page, and `with_lock` may read its rows twice. A typed Diesel
//! query is cloned for each statement; a boxed one cannot be, so
//! [`rebuild`] takes the code that builds it and runs it for each statement.

/// A query the crate can build each of its statements from.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be cloned, and the crate builds each statement from a copy of the query",
    label = "a query that cannot be cloned",
    note = "a query with a boxed part (`into_boxed()`, a `Box<dyn BoxableExpression>` filter) \
            cannot be cloned: wrap the code that builds it in `diesel_claim::rebuild(|| …)`"
)]
pub trait Reusable {
    /// The query each statement starts from.
    type Query;

    /// A copy of the query, for one statement.
    fn query(&self) -> Self::Query;
}

#[diagnostic::do_not_recommend]
impl<Q: Clone> Reusable for Q {
    type Query = Q;

    fn query(&self) -> Q {
        self.clone()
    }
}

/// A query rebuilt for every statement of a claim or a row lock, made by
/// [`rebuild`]. A worker on a pool runs a copy in each of its loops, made by
/// cloning the closure ([`QueryPerLoop`]).
#[derive(Debug)]
#[must_use = "a query does nothing until it is claimed or locked"]
pub struct Rebuild<F>(F);

/// Makes a query that cannot be cloned, such as a boxed one with filters
/// chosen at run time, claimable and lockable: `build` is called for every
/// statement the crate sends, so it must build the same query each time.
///
/// ```
/// # include!("doctest_setup.rs");
/// use diesel_claim::prelude::*;
///
/// # fn main() -> Result<(), diesel_claim::Error> {
/// # let mut conn = establish_connection();
/// let only_shipped = true; // from the request
/// let pending = diesel_claim::rebuild(|| {
///     let mut query = orders::table.filter(orders::email_sent.eq(false)).into_boxed();
///     if only_shipped {
///         query = query.filter(orders::shipped.eq(true));
///     }
///     query
/// });
/// let report = pending.claim_each(&mut conn, |conn, order: Order| {
///     diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
///     Ok::<_, diesel_claim::Error>(())
/// })?;
/// assert_eq!(report.processed, 2);
/// # Ok(())
/// # }
/// ```
pub fn rebuild<F, Q>(build: F) -> Rebuild<F>
where
    F: Fn() -> Q,
{
    Rebuild(build)
}

impl<F, Q> Reusable for Rebuild<F>
where
    F: Fn() -> Q,
{
    type Query = Q;

    fn query(&self) -> Q {
        (self.0)()
    }
}

/// A query a worker on a pool can run in each of its loops: a clone of a
/// typed query, a `rebuild` query whose closure is `Clone` (when what it
/// captures is), or a visibility timeout's narrowing of either.
pub trait QueryPerLoop: Sized {
    /// A copy for one loop.
    #[doc(hidden)]
    fn per_loop(&self) -> Self;
}

impl<Q: Clone> QueryPerLoop for Q {
    fn per_loop(&self) -> Q {
        self.clone()
    }
}

impl<F: Clone> QueryPerLoop for Rebuild<F> {
    fn per_loop(&self) -> Self {
        Rebuild(self.0.clone())
    }
}
