//! Golden transcripts of `RctlUsage` (tests/golden/usage_*.txt): one
//! `rctl -u` for several jails, split back into one usage per jail, and the
//! two refusals that make the sampler stop asking.

use keel::common::config::CommandPaths;
use keel::host::usage::{JailUsage, NAMES_PER_COMMAND, RctlUsage, UsageError, UsageProbe};

use crate::util::golden;

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|n| n.to_string()).collect()
}

#[test]
fn one_rctl_reads_several_jails_in_argv_order() {
    golden::check("usage_sample", |runner| {
        let usage = RctlUsage::new(runner, CommandPaths::default())
            .sample(&names(&["web-1", "db-0"]))
            .expect("read");
        assert_eq!(
            usage["web-1"],
            JailUsage {
                cpu_seconds: 37.0,
                memory_bytes: 18_804_736,
            }
        );
        assert_eq!(
            usage["db-0"],
            JailUsage {
                cpu_seconds: 0.0,
                memory_bytes: 0,
            }
        );
    });
}

#[test]
fn racct_disabled_is_unavailable_and_names_the_tunable() {
    golden::check("usage_racct_disabled", |runner| {
        let err = RctlUsage::new(runner, CommandPaths::default())
            .sample(&names(&["web-1"]))
            .expect_err("no accounting");
        assert!(matches!(err, UsageError::Unavailable(_)), "{err:?}");
        assert!(err.to_string().contains("kern.racct.enable=1"), "{err}");
    });
}

#[test]
fn a_jailed_agent_is_unavailable_too() {
    golden::check("usage_not_permitted", |runner| {
        let err = RctlUsage::new(runner, CommandPaths::default())
            .sample(&names(&["web-1"]))
            .expect_err("not permitted");
        assert!(matches!(err, UsageError::Unavailable(_)), "{err:?}");
        assert!(err.to_string().contains("outside any jail"), "{err}");
    });
}

/// Many jails are read a bounded number at a time, each batch one process.
#[test]
fn many_jails_take_one_rctl_per_batch() {
    use keel::common::cmd::{CmdOutput, CommandRunner};
    use std::sync::Mutex;

    struct Zeroes(Mutex<Vec<usize>>);
    impl CommandRunner for Zeroes {
        fn run(
            &self,
            argv: &[String],
            _stdin: Option<&[u8]>,
            _timeout: std::time::Duration,
        ) -> Result<CmdOutput, keel::common::cmd::CmdError> {
            let filters = argv.len() - 2;
            self.0.lock().expect("lock").push(filters);
            Ok(CmdOutput {
                status: 0,
                stdout: "cputime=1\nmemoryuse=2\n".repeat(filters),
                stderr: String::new(),
            })
        }
    }
    let runner = std::sync::Arc::new(Zeroes(Mutex::new(Vec::new())));
    let all: Vec<String> = (0..NAMES_PER_COMMAND + 10)
        .map(|i| format!("j{i}"))
        .collect();
    let usage = RctlUsage::new(runner.clone(), CommandPaths::default())
        .sample(&all)
        .expect("read");
    assert_eq!(usage.len(), all.len());
    assert_eq!(*runner.0.lock().expect("lock"), [NAMES_PER_COMMAND, 10]);
}
