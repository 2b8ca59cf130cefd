//! Integration tests, linked into one binary (`autotests = false`).
//! Each module is one area; `util` holds the shared helpers.

mod http;
mod util;
