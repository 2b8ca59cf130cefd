//! Integration tests, linked into one binary (`autotests = false`).
//! Each module is one area; `util` holds the shared helpers.

mod golden_jail;
mod golden_zfs;
mod util;
