//! Checks made on the SQL a fragment renders to, before any statement is
//! sent: what Diesel's types do not tell generic code (a table's name, which
//! columns a changeset sets, whether a target is one row by its key).
//! Diesel renders these fragments in a regular shape: identifiers quoted,
//! values as placeholders, each condition of a `WHERE` in parentheses.

use diesel::query_builder::{QueryBuilder, QueryFragment};
use diesel::QueryResult;

use crate::backend::ClaimBackend;
use crate::Error;

/// The unqualified name of a table, as `OF` needs it: the last identifier of its
/// rendered `FROM` clause (`"orders"` or `"shop"."orders"` gives `orders`).
pub fn unqualified_table_name<T, DB>(table: &T) -> QueryResult<String>
where
    T: diesel::Table,
    T::FromClause: QueryFragment<DB>,
    DB: ClaimBackend,
{
    let rendered = render::<DB>(&table.from_clause())?;
    last_identifier(&rendered).ok_or_else(|| {
        diesel::result::Error::QueryBuilderError(
            format!("cannot find the table name in `{rendered}`").into(),
        )
    })
}

/// A table's name as `table!` writes it, for errors that name the table:
/// its rendered `FROM` clause without the quotes (`"orders"` gives `orders`,
/// `"shop"."orders"` gives `shop.orders`).
pub fn table_name<T, DB>(table: &T) -> QueryResult<String>
where
    T: diesel::Table,
    T::FromClause: QueryFragment<DB>,
    DB: ClaimBackend,
{
    Ok(unquoted(&render::<DB>(&table.from_clause())?))
}

/// A dotted name without its identifiers' quotes (`"` or `` ` ``, doubled
/// inside a quoted name).
fn unquoted(name: &str) -> String {
    let mut unquoted = String::with_capacity(name.len());
    let mut open: Option<char> = None;
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        match open {
            Some(quote) if c == quote && chars.peek() == Some(&quote) => {
                chars.next();
                unquoted.push(quote);
            }
            Some(quote) if c == quote => open = None,
            None if c == '"' || c == '`' => open = Some(c),
            _ => unquoted.push(c),
        }
    }
    unquoted
}

/// The SQL `fragment` renders to on `DB`, binds left as placeholders: for
/// checks made before any statement is sent.
pub fn render<DB: ClaimBackend>(fragment: &impl QueryFragment<DB>) -> QueryResult<String> {
    let mut builder = DB::query_builder();
    fragment.to_sql(&mut builder, &DB::default())?;
    Ok(builder.finish())
}

/// Whether a rendered changeset (`a = …, b = …`) assigns the column `name`.
pub fn assigns<DB: ClaimBackend>(changeset: &str, name: &str) -> QueryResult<bool> {
    let mut builder = DB::query_builder();
    builder.push_identifier(name)?;
    let assignment = format!("{} = ", builder.finish());
    Ok(changeset.starts_with(&assignment) || changeset.contains(&format!(", {assignment}")))
}

/// Whether a rendered changeset assigns any column of a rendered primary key
/// (`"t"."id"`, or `"t"."a", "t"."b"`).
pub fn assigns_key<DB: ClaimBackend>(changeset: &str, key: &str) -> QueryResult<bool> {
    for column in split_top_level(key, ", ") {
        let name = last_identifier(column).ok_or_else(|| {
            diesel::result::Error::QueryBuilderError(
                format!("cannot find the column name in `{column}`").into(),
            )
        })?;
        if assigns::<DB>(changeset, &name)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Refuses what a claim cannot honour in a rendered query, before any SQL:
/// `DISTINCT`, a `LIMIT` or `OFFSET` of its own, which the claim's statements
/// would replace with theirs, and an `ORDER BY` when the claim orders by key
/// (a boxed query's order, which its type does not tell).
pub fn check_claimable(query: &str, ordered_by_key: bool) -> Result<(), Error> {
    let refusal = if query.starts_with("SELECT DISTINCT") {
        "a claimed query cannot be DISTINCT: a claim locks and hands over each row once \
         already; remove .distinct()"
    } else if contains_top_level(query, " LIMIT ") || contains_top_level(query, " OFFSET ") {
        "a claimed query cannot have a LIMIT or OFFSET, which the claim's own statements \
         would replace: cap the rows of a call with .build_claim().max_rows(n) instead"
    } else if ordered_by_key && contains_top_level(query, " ORDER BY ") {
        "the order of a boxed query cannot be read, so a claim cannot follow it: box the \
         filter instead of the query (`.filter(dynamic_filter)` with a \
         `Box<dyn BoxableExpression<…>>`, then `.order_by(…)`), or drop the order to claim in \
         key order"
    } else {
        return Ok(());
    };
    Err(Error::InvalidArgument(refusal.to_owned()))
}

fn contains_top_level(text: &str, word: &str) -> bool {
    split_top_level(text, word).len() > 1
}

/// Whether a rendered `WHERE` clause restricts the table to at most one row
/// by its primary key: among the conditions it `AND`s together, each column of
/// `key` (the rendered primary key, `"t"."id"` or `"t"."a", "t"."b"`) is
/// compared equal to a value. Anything else (`OR`, no `WHERE`, another
/// column) is not proof, though it may still match one row.
pub fn one_row_by_key(where_clause: &str, key: &str) -> bool {
    let Some(condition) = where_clause.trim().strip_prefix("WHERE ") else {
        return false;
    };
    let mut equalities = Vec::new();
    conditions(condition, &mut equalities);
    split_top_level(key, ", ").iter().all(|column| {
        equalities
            .iter()
            .any(|condition| is_equal_to_value(condition, column))
    })
}

/// The conditions `AND`ed together in `condition`, through any parentheses.
fn conditions<'a>(condition: &'a str, found: &mut Vec<&'a str>) {
    let condition = condition.trim();
    if let Some(inner) = parenthesized(condition) {
        return conditions(inner, found);
    }
    let terms = split_top_level(condition, " AND ");
    if terms.len() == 1 {
        found.push(condition);
    } else {
        terms.into_iter().for_each(|term| conditions(term, found));
    }
}

/// `column = $n` or `column = ?`.
fn is_equal_to_value(condition: &str, column: &str) -> bool {
    let Some(value) = condition
        .strip_prefix(column)
        .and_then(|rest| rest.strip_prefix(" = "))
    else {
        return false;
    };
    value == "?"
        || value
            .strip_prefix('$')
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The inside of `text` if one pair of parentheses encloses all of it (not
/// `(a) AND (b)`).
fn parenthesized(text: &str) -> Option<&str> {
    if !text.starts_with('(') {
        return None;
    }
    let (mut depth, mut end) = (0_i32, 0);
    for (c, quoted) in scan(text) {
        end += c.len_utf8();
        match c {
            '(' if !quoted => depth += 1,
            ')' if !quoted => depth -= 1,
            _ => {}
        }
        if depth == 0 {
            return (end == text.len()).then(|| &text[1..end - 1]);
        }
    }
    None
}

/// `text` split at each `separator` outside parentheses and quotes.
fn split_top_level<'a>(text: &'a str, separator: &str) -> Vec<&'a str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0_i32, 0);
    let mut index = 0;
    for (c, quoted) in scan(text) {
        if !quoted {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                _ => {}
            }
            // (`index >= start`: not inside the separator just taken.)
            if depth == 0 && index >= start && text[index..].starts_with(separator) {
                parts.push(&text[start..index]);
                start = index + separator.len();
            }
        }
        index += c.len_utf8();
    }
    parts.push(&text[start..]);
    parts
}

/// Each character of `text`, and whether it is inside a quoted identifier or
/// string (`"…"`, `` `…` `` or `'…'`, a doubled quote escaping itself).
fn scan(text: &str) -> impl Iterator<Item = (char, bool)> + '_ {
    let mut open: Option<char> = None;
    text.chars().map(move |c| match open {
        Some(quote) if c == quote => {
            // A doubled quote closes and reopens: the same as staying inside.
            open = None;
            (c, true)
        }
        Some(_) => (c, true),
        None if matches!(c, '"' | '`' | '\'') => {
            open = Some(c);
            (c, true)
        }
        None => (c, false),
    })
}

/// The last identifier of a dotted, possibly quoted name; quotes are `"` or `` ` ``
/// and doubled inside a quoted name.
fn last_identifier(name: &str) -> Option<String> {
    let name = name.trim();
    let Some(quote) = name.chars().last().filter(|c| *c == '"' || *c == '`') else {
        return name
            .rsplit('.')
            .next()
            .filter(|s| !s.is_empty())
            .map(str::to_owned);
    };
    let body = &name[..name.len() - 1];
    let mut identifier = String::new();
    let mut chars = body.chars().rev().peekable();
    while let Some(c) = chars.next() {
        if c != quote {
            identifier.push(c);
        } else if chars.peek() == Some(&quote) {
            chars.next();
            identifier.push(quote);
        } else {
            return Some(identifier.chars().rev().collect());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_row_by_key_needs_every_key_column_equal_to_a_value() {
        let id = r#""accounts"."id""#;
        let one = [
            r#"WHERE ("accounts"."id" = $2)"#,
            r#"WHERE (("accounts"."id" = $2) AND ("accounts"."balance" > $3))"#,
            r#"WHERE ((("accounts"."balance" > $1) AND ("accounts"."id" = $2)) AND ("accounts"."version" = $3))"#,
            "WHERE (`accounts`.`id` = ?)".trim_start(),
        ];
        for where_clause in one {
            let key = if where_clause.contains('`') {
                "`accounts`.`id`"
            } else {
                id
            };
            assert!(one_row_by_key(where_clause, key), "{where_clause}");
        }
        let not_proven = [
            "",
            r#"WHERE ("accounts"."balance" = $1)"#,
            r#"WHERE ("accounts"."id" > $1)"#,
            r#"WHERE (("accounts"."id" = $1) OR ("accounts"."id" = $2))"#,
            r#"WHERE ("accounts"."id" = $1 OR "accounts"."id" = $2)"#,
            r#"WHERE ("accounts"."id" = "accounts"."version")"#,
            r#"WHERE ("accounts"."id" = $1) OR ("accounts"."id" = $2)"#,
            r#"WHERE ("other"."id" = $1)"#,
        ];
        for where_clause in not_proven {
            assert!(!one_row_by_key(where_clause, id), "{where_clause}");
        }
        let key = r#""lines"."order_id", "lines"."line_no""#;
        assert!(one_row_by_key(
            r#"WHERE (("lines"."order_id" = $1) AND ("lines"."line_no" = $2))"#,
            key
        ));
        assert!(!one_row_by_key(r#"WHERE ("lines"."order_id" = $1)"#, key));
    }

    #[test]
    fn claims_refuse_distinct_limit_offset_and_unreadable_order_of_the_query_itself() {
        let fine = [
            r#"SELECT "orders"."id" FROM "orders" WHERE ("orders"."shipped" = $1)"#,
            r#"SELECT "o"."id" FROM "o" WHERE "o"."id" IN (SELECT "x"."id" FROM "x" LIMIT $1)"#,
            r#"SELECT "o"."id" FROM "o" WHERE ("o"."note" = ' LIMIT ')"#,
            r#"SELECT "o"."id" FROM "o" ORDER BY "o"."priority" DESC"#,
        ];
        for query in fine {
            assert!(check_claimable(query, false).is_ok(), "{query}");
        }
        // A query ordered by key must not carry an order of its own (a boxed
        // one, whose order its type does not tell); a subquery's may.
        let ordered = r#"SELECT "o"."id" FROM "o" ORDER BY "o"."priority" DESC"#;
        assert!(matches!(
            check_claimable(ordered, true),
            Err(Error::InvalidArgument(message)) if message.contains("box the filter")
        ));
        let sub = r#"SELECT "o"."id" FROM "o" WHERE "o"."id" IN (SELECT "x"."id" FROM "x" ORDER BY "x"."id")"#;
        assert!(check_claimable(sub, true).is_ok());
        let refused = [
            r#"SELECT DISTINCT "orders"."id" FROM "orders""#,
            r#"SELECT DISTINCT ON ("orders"."id") "orders"."id" FROM "orders""#,
            r#"SELECT "orders"."id" FROM "orders" LIMIT $1"#,
            "SELECT `orders`.`id` FROM `orders` LIMIT ? OFFSET ?",
            r#"SELECT "orders"."id" FROM "orders" OFFSET $1"#,
        ];
        for query in refused {
            assert!(
                matches!(
                    check_claimable(query, false),
                    Err(Error::InvalidArgument(_))
                ),
                "{query}"
            );
        }
    }

    #[test]
    fn quoted_text_does_not_split_or_nest() {
        assert_eq!(
            split_top_level(r#"("a AND b") AND 'c AND (d' AND e"#, " AND "),
            [r#"("a AND b")"#, "'c AND (d'", "e"]
        );
        assert_eq!(parenthesized("(a) AND (b)"), None);
        assert_eq!(parenthesized("((a) AND (b))"), Some("(a) AND (b)"));
        assert_eq!(parenthesized(r#"("(")"#), Some(r#""(""#));
    }

    #[test]
    fn table_names_lose_their_quotes() {
        assert_eq!(unquoted(r#""invoices""#), "invoices");
        assert_eq!(unquoted(r#""shop"."invoices""#), "shop.invoices");
        assert_eq!(unquoted("`shop`.`invoices`"), "shop.invoices");
        assert_eq!(unquoted(r#""say ""hi""""#), r#"say "hi""#);
        assert_eq!(unquoted("plain"), "plain");
    }

    use super::last_identifier;

    #[test]
    fn last_identifier_of_rendered_table_names() {
        assert_eq!(last_identifier(r#""orders""#).as_deref(), Some("orders"));
        assert_eq!(
            last_identifier(r#""shop"."orders""#).as_deref(),
            Some("orders")
        );
        assert_eq!(
            last_identifier(r#""a""b"."c.""d""#).as_deref(),
            Some(r#"c."d"#)
        );
        assert_eq!(
            last_identifier("`shop`.`orders`").as_deref(),
            Some("orders")
        );
        assert_eq!(last_identifier("shop.orders").as_deref(), Some("orders"));
        assert_eq!(last_identifier(r#"unterminated""#), None);
    }
}
