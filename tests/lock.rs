//! Tests of lock.
