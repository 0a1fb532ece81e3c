//! Whole statements the crate renders itself, where Diesel's own cannot be
//! named in generic code (their clause types are private).

use diesel::backend::Backend;
use diesel::expression::Expression;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::{QueryResult, RunQueryDsl};

/// `UPDATE <table> SET <changes> WHERE <filter>`.
///
/// Diesel's own update statement cannot be named in generic code (its `WHERE`
/// clause types are private), so the marking claim renders its own.
#[derive(Debug, Clone)]
pub struct Update<From, Changes, Where> {
    /// The table's `FROM` clause.
    pub from: From,
    pub changes: Changes,
    pub filter: Where,
}

impl<From, Changes, Where> QueryId for Update<From, Changes, Where> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<From, Changes, Where, DB> QueryFragment<DB> for Update<From, Changes, Where>
where
    DB: Backend,
    From: QueryFragment<DB>,
    Changes: QueryFragment<DB>,
    Where: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("UPDATE ");
        self.from.walk_ast(out.reborrow())?;
        out.push_sql(" SET ");
        self.changes.walk_ast(out.reborrow())?;
        out.push_sql(" WHERE ");
        self.filter.walk_ast(out.reborrow())
    }
}

impl<From, Changes, Where, Conn> RunQueryDsl<Conn> for Update<From, Changes, Where> {}

/// `DELETE FROM <table> WHERE <filter>`: the rows a claim deletes once their
/// closure has succeeded ([`then_delete`](crate::ClaimBuilder::then_delete)).
#[derive(Debug, Clone)]
pub struct Delete<From, Where> {
    /// The table's `FROM` clause.
    pub from: From,
    pub filter: Where,
}

impl<From, Where> QueryId for Delete<From, Where> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<From, Where, DB> QueryFragment<DB> for Delete<From, Where>
where
    DB: Backend,
    From: QueryFragment<DB>,
    Where: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("DELETE FROM ");
        self.from.walk_ast(out.reborrow())?;
        out.push_sql(" WHERE ");
        self.filter.walk_ast(out.reborrow())
    }
}

impl<From, Where, Conn> RunQueryDsl<Conn> for Delete<From, Where> {}

/// `<statement> RETURNING <columns>`.
#[derive(Debug, Clone)]
pub struct Returning<Statement, Columns> {
    pub statement: Statement,
    pub columns: Columns,
}

impl<Statement, Columns> QueryId for Returning<Statement, Columns> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Statement, Columns: Expression> Query for Returning<Statement, Columns> {
    type SqlType = Columns::SqlType;
}

impl<Statement, Columns, DB> QueryFragment<DB> for Returning<Statement, Columns>
where
    DB: Backend,
    Statement: QueryFragment<DB>,
    Columns: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        self.statement.walk_ast(out.reborrow())?;
        out.push_sql(" RETURNING ");
        self.columns.walk_ast(out.reborrow())
    }
}

impl<Statement, Columns, Conn> RunQueryDsl<Conn> for Returning<Statement, Columns> {}

/// `SELECT <columns> FROM <table> WHERE <filter>`.
#[derive(Debug, Clone)]
pub struct SelectWhere<Columns, From, Where> {
    pub columns: Columns,
    /// The table's `FROM` clause.
    pub from: From,
    pub filter: Where,
}

impl<Columns, From, Where> QueryId for SelectWhere<Columns, From, Where> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Columns: Expression, From, Where> Query for SelectWhere<Columns, From, Where> {
    type SqlType = Columns::SqlType;
}

impl<Columns, From, Where, DB> QueryFragment<DB> for SelectWhere<Columns, From, Where>
where
    DB: Backend,
    Columns: QueryFragment<DB>,
    From: QueryFragment<DB>,
    Where: QueryFragment<DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("SELECT ");
        self.columns.walk_ast(out.reborrow())?;
        out.push_sql(" FROM ");
        self.from.walk_ast(out.reborrow())?;
        out.push_sql(" WHERE ");
        self.filter.walk_ast(out.reborrow())
    }
}

impl<Columns, From, Where, Conn> RunQueryDsl<Conn> for SelectWhere<Columns, From, Where> {}

/// `SELECT <version> FROM <table> <where>`: reads the version of the row an update
/// targeted, to tell a conflict from a missing row.
#[derive(Debug, Clone)]
pub struct VersionProbe<From, Where, Column> {
    /// The table's `FROM` clause.
    pub from: From,
    pub where_clause: Where,
    pub column: Column,
}

impl<Table, Where, Column> QueryId for VersionProbe<Table, Where, Column> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Table, Where, Column: Expression> Query for VersionProbe<Table, Where, Column> {
    type SqlType = Column::SqlType;
}

impl<From, Where, Column, DB> QueryFragment<DB> for VersionProbe<From, Where, Column>
where
    DB: Backend,
    From: QueryFragment<DB>,
    Where: QueryFragment<DB>,
    Column: diesel::Column,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        out.push_sql("SELECT ");
        out.push_identifier(Column::NAME)?;
        out.push_sql(" FROM ");
        self.from.walk_ast(out.reborrow())?;
        self.where_clause.walk_ast(out.reborrow())
    }
}

impl<Table, Where, Column, Conn> RunQueryDsl<Conn> for VersionProbe<Table, Where, Column> {}
