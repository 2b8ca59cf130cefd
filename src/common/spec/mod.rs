//! Specs: filled by the foundation issue.
