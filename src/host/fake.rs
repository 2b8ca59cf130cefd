//! Shared plumbing of the in-memory Fakes: one call log all Fakes of a test can
//! write to (so tests can assert ordering *across* subsystems, e.g. "unmount
//! before zfs destroy"), and failure injection.
//!
//! Every Fake is a cheap `Clone` handle over shared state: the test keeps one
//! clone to inspect and steer, the reconciler owns another.

use std::sync::{Arc, Mutex};

pub use crate::common::sync::lock;

/// An ordered log of operations, shared between Fakes. Entries read like
/// `"zfs.clone_rootfs web-1"` or `"mount.unmount /jails/web-1/data"`.
#[derive(Debug, Clone, Default)]
pub struct CallLog(Arc<Mutex<Vec<String>>>);

impl CallLog {
    /// A new, empty log.
    pub fn new() -> CallLog {
        CallLog::default()
    }

    /// Appends one entry.
    pub fn push(&self, entry: impl Into<String>) {
        lock(&self.0).push(entry.into());
    }

    /// Everything logged so far.
    pub fn entries(&self) -> Vec<String> {
        lock(&self.0).clone()
    }

    /// Entries starting with `prefix` (e.g. `"zfs."`).
    pub fn matching(&self, prefix: &str) -> Vec<String> {
        lock(&self.0)
            .iter()
            .filter(|e| e.starts_with(prefix))
            .cloned()
            .collect()
    }

    /// Forgets everything logged so far.
    pub fn clear(&self) {
        lock(&self.0).clear();
    }
}

/// Injected failures: an operation name (`"create"`, `"destroy_rootfs"`, ...)
/// and a target (`Some("web-1")`, or `None` for any target), with how many
/// more times it fails (`None` = until cleared).
#[derive(Debug, Clone, Default)]
pub struct Faults(Arc<Mutex<Vec<Fault>>>);

#[derive(Debug, Clone)]
struct Fault {
    op: String,
    target: Option<String>,
    remaining: Option<u32>,
}

impl Faults {
    /// Makes `op` on `target` (any target when `None`) fail until cleared.
    pub fn fail(&self, op: &str, target: Option<&str>) {
        self.push(op, target, None);
    }

    /// Makes `op` on `target` fail the next `times` times.
    pub fn fail_times(&self, op: &str, target: Option<&str>, times: u32) {
        self.push(op, target, Some(times));
    }

    /// Removes every injected failure.
    pub fn clear(&self) {
        lock(&self.0).clear();
    }

    /// True (and one use consumed) when `op` on `target` should fail now.
    pub fn should_fail(&self, op: &str, target: &str) -> bool {
        let mut faults = lock(&self.0);
        let hit = faults.iter_mut().position(|f| {
            f.op == op && f.target.as_deref().is_none_or(|t| t == target) && f.remaining != Some(0)
        });
        match hit {
            Some(i) => {
                if let Some(n) = faults[i].remaining.as_mut() {
                    *n -= 1;
                }
                true
            }
            None => false,
        }
    }

    fn push(&self, op: &str, target: Option<&str>, remaining: Option<u32>) {
        lock(&self.0).push(Fault {
            op: op.to_string(),
            target: target.map(str::to_string),
            remaining,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_faults_run_out() {
        let f = Faults::default();
        f.fail_times("create", Some("web"), 2);
        assert!(!f.should_fail("create", "db"));
        assert!(f.should_fail("create", "web"));
        assert!(f.should_fail("create", "web"));
        assert!(!f.should_fail("create", "web"));
    }

    #[test]
    fn untargeted_faults_hit_everything_until_cleared() {
        let f = Faults::default();
        f.fail("destroy", None);
        assert!(f.should_fail("destroy", "a"));
        assert!(f.should_fail("destroy", "b"));
        f.clear();
        assert!(!f.should_fail("destroy", "a"));
    }
}
