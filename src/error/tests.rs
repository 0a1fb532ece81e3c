//! How errors are classified, described and carried through Diesel's.

use super::*;

fn database_error(message: &str) -> diesel::result::Error {
    diesel::result::Error::DatabaseError(DatabaseErrorKind::Unknown, Box::new(message.to_owned()))
}

/// A closure's error says the database rolled its transaction back when
/// it is this crate's or diesel's deadlock or serialization failure, and
/// only then.
#[test]
fn closure_errors_rolled_back_by_the_database_are_recognised() {
    let serialization = || {
        let message = "could not serialize access due to concurrent update".to_owned();
        diesel::result::Error::DatabaseError(
            DatabaseErrorKind::SerializationFailure,
            Box::new(message),
        )
    };
    assert!(rolled_back_by_the_database(&database_error(
        "deadlock detected"
    )));
    assert!(rolled_back_by_the_database(&serialization()));
    assert!(rolled_back_by_the_database(&Error::from(database_error(
        "deadlock detected"
    ))));
    assert!(rolled_back_by_the_database(&Error::from(serialization())));
    let conflict = Error::VersionConflict {
        table: "accounts".to_owned(),
        expected: 1,
        actual: Some(2),
    };
    assert!(!rolled_back_by_the_database(&conflict));
    assert!(!rolled_back_by_the_database(&Error::LockNotAvailable));
    assert!(!rolled_back_by_the_database(&database_error(
        "relation \"nope\" does not exist"
    )));
    assert!(!rolled_back_by_the_database(
        &"deadlock detected".to_owned()
    ));
}

#[test]
fn server_messages_are_classified() {
    let nowait = database_error(r#"could not obtain lock on row in relation "orders""#);
    let timeout = database_error("canceling statement due to lock timeout");
    let busy = database_error("database is locked");
    let deadlock = database_error("deadlock detected");
    let mysql_timeout = database_error("Lock wait timeout exceeded; try restarting transaction");
    let mysql_nowait = database_error(
        "Statement aborted because lock(s) could not be acquired immediately and NOWAIT \
         is set.",
    );
    let mysql_deadlock = diesel::result::Error::DatabaseError(
        DatabaseErrorKind::SerializationFailure,
        Box::new("Deadlock found when trying to get lock; try restarting transaction".to_owned()),
    );
    assert!(is_lock_not_available(&mysql_timeout) && is_lock_not_available(&mysql_nowait));
    assert!(is_deadlock(&mysql_deadlock) && !is_serialization_failure(&mysql_deadlock));
    let async_mysql_deadlock =
        database_error("Deadlock found when trying to get lock; try restarting transaction");
    assert!(matches!(
        Error::from(async_mysql_deadlock),
        Error::Deadlock(_)
    ));
    let other = database_error(r#"relation "nope" does not exist"#);
    assert!(is_lock_not_available(&nowait));
    assert!(is_lock_not_available(&timeout));
    assert!(is_lock_not_available(&busy));
    assert!(is_deadlock(&deadlock) && !is_lock_not_available(&deadlock));
    assert!(!is_lock_not_available(&other) && !is_deadlock(&other));
    assert!(matches!(Error::from(other), Error::Database(_)));
    assert!(matches!(Error::from(deadlock), Error::Deadlock(_)));
    assert!(matches!(
        Error::from(diesel::result::Error::NotFound),
        Error::NotFound
    ));
    let serialization = |message: &str| {
        diesel::result::Error::DatabaseError(
            DatabaseErrorKind::SerializationFailure,
            Box::new(message.to_owned()),
        )
    };
    for verb in ["locked", "updated", "deleted"] {
        let moved = serialization(&format!(
            "tuple to be {verb} was already moved to another partition due to concurrent \
             update"
        ));
        assert!(moved_to_another_partition(&moved) && is_serialization_failure(&moved));
    }
    let plain = serialization("could not serialize access due to concurrent update");
    assert!(!moved_to_another_partition(&plain));
}

#[test]
fn old_servers_without_skip_locked_are_unsupported() {
    let mariadb_10_5 = database_error(
        "You have an error in your SQL syntax; check the manual that corresponds to your \
         MariaDB server version for the right syntax to use near 'SKIP LOCKED' at line 1",
    );
    let mysql_5_7 = database_error(
        "You have an error in your SQL syntax; check the manual that corresponds to your \
         MySQL server version for the right syntax to use near 'NOWAIT' at line 1",
    );
    let other_syntax = database_error(
        "You have an error in your SQL syntax; check the manual that corresponds to your \
         MariaDB server version for the right syntax to use near 'FORM orders' at line 1",
    );
    assert!(matches!(Error::from(mariadb_10_5), Error::Unsupported(_)));
    assert!(matches!(Error::from(mysql_5_7), Error::Unsupported(_)));
    assert!(matches!(Error::from(other_syntax), Error::Database(_)));
}

#[test]
fn closed_connections_are_broken_connections() {
    let closed = [
        // libpq, through PgConnection, after `pg_terminate_backend`.
        "SSL connection has been closed unexpectedly",
        "server closed the connection unexpectedly\n\tThis probably means the server \
         terminated abnormally\n\tbefore or while processing the request.",
        "no connection to the server\n",
        "terminating connection due to administrator command",
        "terminating connection due to idle-in-transaction timeout",
        // tokio-postgres, through AsyncPgConnection.
        "connection closed",
        "error communicating with the server: Connection reset by peer (os error 104)",
        // libmysqlclient (MariaDB's and MySQL's) and mysql_async.
        "Lost connection to server during query",
        "Lost connection to MySQL server during query",
        "Server has gone away",
        "MySQL server has gone away",
        "Connection was killed",
        "Driver error: `Connection to the server is closed.'",
        "Input/output error: broken pipe",
    ];
    for message in closed {
        for kind in [
            DatabaseErrorKind::Unknown,
            DatabaseErrorKind::UnableToSendCommand,
        ] {
            let error = diesel::result::Error::DatabaseError(kind, Box::new(message.to_owned()));
            let error = Error::from(error);
            assert!(
                matches!(error, Error::BrokenConnection(_)),
                "{message}: {error:?}"
            );
            assert!(!error.is_transient());
            let shown = error.to_string();
            assert!(shown.contains("closed by the server or the network"));
            // One log line, however many libpq's message runs over.
            assert!(!shown.contains(['\n', '\t']), "{shown:?}");
        }
    }
    let diesel_closed = diesel::result::Error::DatabaseError(
        DatabaseErrorKind::ClosedConnection,
        Box::new("any message".to_owned()),
    );
    assert!(matches!(
        Error::from(diesel_closed),
        Error::BrokenConnection(_)
    ));
    // A statement's own failure is not a closed connection, even where
    // its text says "connection".
    let open = [
        r#"relation "connection closed" does not exist"#,
        "Too many connections",
        "canceling statement due to statement timeout",
    ];
    for message in open {
        assert!(
            matches!(Error::from(database_error(message)), Error::Database(_)),
            "{message}"
        );
    }
    let unique = diesel::result::Error::DatabaseError(
        DatabaseErrorKind::UniqueViolation,
        Box::new("connection closed".to_owned()),
    );
    assert!(matches!(Error::from(unique), Error::Database(_)));
    let refused = "connection to server at \"127.0.0.1\", port 5432 failed: Connection \
                   refused\n\tIs the server running on that host and accepting TCP/IP connections?\n";
    let checkout = Error::Checkout(Box::new(std::io::Error::other(refused)));
    assert_eq!(
        checkout.to_string(),
        "no connection from the pool: connection to server at \"127.0.0.1\", port 5432 \
         failed: Connection refused Is the server running on that host and accepting TCP/IP \
         connections?"
    );
    let abandoned = Error::from(diesel::result::Error::BrokenTransactionManager);
    assert!(matches!(abandoned, Error::BrokenConnection(_)));
    assert!(abandoned.to_string().contains("may still hold its locks"));
}

#[test]
fn typed_errors_survive_a_round_trip_through_diesel_errors() {
    let as_diesel = diesel::result::Error::from(Error::LockNotAvailable);
    assert!(is_lock_not_available(&as_diesel));
    assert!(matches!(Error::from(as_diesel), Error::LockNotAvailable));
}
