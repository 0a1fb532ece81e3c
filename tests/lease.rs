//! Tests of lease.
