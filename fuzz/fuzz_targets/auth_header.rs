//! Fuzz target: the `Authorization: Keel-HMAC-SHA256 ...` parser
//! (`common::auth::parse_authorization`), which sees every TCP request
//! before its signature is checked.
//!
//! Beyond "never panics", it checks that a parsed header prints back (its
//! `Display`, the form signers send) to a value that parses to the same
//! header.
#![no_main]

use keel::common::auth::parse_authorization;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(header) = parse_authorization(text) {
        let printed = header.to_string();
        assert_eq!(parse_authorization(&printed).ok(), Some(header));
    }
});
