//! Fuzz target: the HTTP request framing both daemons run on every connection
//! (`common::http::parse_request_head`: httparse, the target rules, the
//! framing and limit checks).
//!
//! Beyond "never panics", it checks what handlers rely on: a request that
//! gets through has a path starting with `/`, with no `%`, no control
//! character and no `.` or `..` segment, and a body exactly as long as its
//! Content-Length; a refusal is a 4xx.
#![no_main]

use keel::common::http::{ServerLimits, parse_request_head};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Small limits so the fuzzer reaches 413 and 431 with small inputs.
    let limits = ServerLimits {
        max_header_bytes: 512,
        max_body_bytes: 64,
        ..ServerLimits::default()
    };
    match parse_request_head(data, &limits) {
        Ok(None) => {}
        Err((status, _)) => assert!((400..500).contains(&status), "status {status}"),
        Ok(Some(req)) => {
            assert!(req.path.starts_with('/'), "{:?}", req.path);
            assert!(!req.path.contains('%'), "{:?}", req.path);
            assert!(!req.path.chars().any(char::is_control), "{:?}", req.path);
            assert!(
                !req.path.split('/').any(|s| s == "." || s == ".."),
                "{:?}",
                req.path
            );
            assert!(req.body.len() <= limits.max_body_bytes);
            let declared = req
                .header("content-length")
                .map(|v| v.parse::<usize>().expect("a checked Content-Length"))
                .unwrap_or(0);
            assert_eq!(req.body.len(), declared);
            assert!(req.header("transfer-encoding").is_none());
        }
    }
});
