//! Fuzz target: YAML spec parsing and validation (`common::spec::parse_documents`),
//! the text `keelctl apply` and `PUT /jails/{name}` accept from users.
//!
//! Beyond "never panics", it checks the documented round trip: every document
//! that parses and validates is written back by `to_yaml` and reads back equal.
#![no_main]

use keel::common::spec::{parse_documents, to_yaml};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(docs) = parse_documents(text) else {
        return;
    };
    for doc in docs {
        let yaml = to_yaml(&doc);
        match parse_documents(&yaml) {
            Ok(again) => assert_eq!(again, vec![doc], "round trip through:\n{yaml}"),
            Err(e) => panic!("to_yaml wrote a document that does not parse: {e}\n{yaml}"),
        }
    }
});
