//! Filled by the foundation issue.
