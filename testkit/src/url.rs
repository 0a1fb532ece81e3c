//! Database URLs: which server a URL names, and the same server with another
//! database.

/// Whether `url` names a PostgreSQL server (it knows both schemes).
pub fn is_postgres_url(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// Whether `url` names a MySQL or MariaDB server.
pub fn is_mysql_url(url: &str) -> bool {
    url.starts_with("mysql://")
}

/// `url` with its path, the database name, replaced by `database`; the query
/// string, if any, is kept.
///
/// Panics if `url` has no `scheme://`.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_start = base
        .find("://")
        .unwrap_or_else(|| panic!("not a database URL: {url}"))
        + "://".len();
    let authority_end = base[authority_start..]
        .find('/')
        .map_or(base.len(), |i| authority_start + i);

    let mut result = format!("{}/{database}", &base[..authority_end]);
    if let Some(query) = query {
        result.push('?');
        result.push_str(query);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_database_replaces_only_the_path() {
        assert_eq!(
            with_database("postgres://u@h:5432/test", "other"),
            "postgres://u@h:5432/other"
        );
        assert_eq!(
            with_database("mysql://root@127.0.0.1:3306", "x"),
            "mysql://root@127.0.0.1:3306/x"
        );
        assert_eq!(
            with_database("postgres://h/db?sslmode=disable", "x"),
            "postgres://h/x?sslmode=disable"
        );
    }
}
