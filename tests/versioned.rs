//! Tests of versioned.
