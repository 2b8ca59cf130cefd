//! Helpers shared by the integration tests.

#![allow(dead_code)]

use std::thread;
use std::time::{Duration, Instant};

pub mod agent;
pub mod cluster;
pub mod controlplane;
pub mod golden;
pub mod load;
pub mod nginx;
pub mod pki;

/// Bound on waiting for a real peer (a daemon starting, a port opening, an
/// order finishing): generous, since the machine may be busy with builds.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Polls `done` until it holds; fails the test naming `what` after
/// [`DEADLINE`].
pub fn poll_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(50));
    }
}
