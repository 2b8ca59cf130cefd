//! Helpers shared by the integration tests.

#![allow(dead_code)]

use std::io;
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

pub mod acme;
pub mod agent;
pub mod cluster;
pub mod controlplane;
pub mod etcd;
pub mod golden;
pub mod load;
pub mod netns;
pub mod nginx;
pub mod pki;
pub mod seeded;
pub mod traffic;

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

/// python3 on `PATH` (the workload of the fixtures in tests/fixtures;
/// .ci/run installs it), if any.
pub fn python3() -> Option<PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("python3"))
        .find(|p| p.is_file())
}

/// [`python3`], for tests whose workload it is: missing, the test fails
/// saying so.
pub fn require_python3() -> PathBuf {
    python3().expect("python3 on PATH (the replicas' workload; .ci/run installs it)")
}

/// A `kind: Service` document with `replicas` replicas on `port`, each
/// running `start` (YAML flow-list items, already quoted where needed).
pub fn service_doc(name: &str, replicas: u32, port: u16, start: &str) -> String {
    format!(
        "kind: Service
metadata: {{name: {name}}}
spec:
  replicas: {replicas}
  port: {port}
  template:
    base: 14.2-RELEASE
    resources: {{cpu: 0.1}}
    exec:
      start: [{start}]
"
    )
}

/// A [`service_doc`] whose replicas run the python3 fixture
/// `tests/fixtures/{fixture}` with the service's port as its argument.
pub fn fixture_service(
    name: &str,
    fixture: &str,
    replicas: u32,
    port: u16,
    python: &std::path::Path,
) -> String {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(fixture);
    let start = format!("{}, {}, '{port}'", python.display(), script.display());
    service_doc(name, replicas, port, &start)
}

/// Raises this process's file descriptor limit towards `want` (the hard
/// limit too when allowed) and returns the soft limit now in force.
#[allow(unsafe_code)]
pub fn raise_nofile(want: libc::rlim_t) -> io::Result<libc::rlim_t> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur >= want {
        return Ok(lim.rlim_cur);
    }
    for raised in [
        libc::rlimit {
            rlim_cur: want,
            rlim_max: lim.rlim_max.max(want),
        },
        // Raising the hard limit needs privilege; the soft one up to the
        // hard one does not.
        libc::rlimit {
            rlim_cur: want.min(lim.rlim_max),
            rlim_max: lim.rlim_max,
        },
    ] {
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return Ok(raised.rlim_cur);
        }
    }
    Err(io::Error::last_os_error())
}
