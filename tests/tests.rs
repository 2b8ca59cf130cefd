//! Integration tests, linked into one binary.
