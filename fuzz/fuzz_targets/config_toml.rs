//! Fuzz target: keel.toml loading (`Config::from_toml_str` then `validate`).
//!
//! Beyond "never panics", it checks the documented round trip: a valid
//! configuration printed by `to_toml` loads back to an equal one.
#![no_main]

use keel::common::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = Config::from_toml_str(text) else {
        return;
    };
    if cfg.validate().is_err() {
        return;
    }
    let printed = cfg.to_toml();
    match Config::from_toml_str(&printed) {
        Ok(again) => assert_eq!(again, cfg, "round trip through:\n{printed}"),
        Err(e) => panic!("to_toml printed a configuration that does not load: {e}\n{printed}"),
    }
});
