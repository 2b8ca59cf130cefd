//! A real `keel-agentd --simulate` for process tests: started in a temp dir
//! (so its `./keel-sim/` state and socket are private to the test), waited for
//! until it answers `GET /healthz`, and on drop stopped together with every
//! simulated jail it started.
//!
//! Simulated jails run in process groups of their own and outlive the agent
//! (as real jails do), so stopping the agent is not enough: after the agent
//! has exited, the helper opens the same jail table the agent kept
//! (`{state_dir}/sim/sim-jails.json`) with the simulated host's own
//! [`SimJails`] and removes every jail, which signals each whole process group
//! only after proving the group is the one that was started. The agent is
//! stopped with SIGTERM first, so it finishes the command in progress and no
//! jail is left started but unrecorded.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use keel::common::http::{Client, ClientResponse, Endpoint};
use keel::host::JailRuntime;
use keel::host::jail::Removal;
use keel::host::sim::SimJails;

use super::cluster::{Run, run};

/// The agent binary under test.
pub const AGENTD: &str = env!("CARGO_BIN_EXE_keel-agentd");

/// The keelctl binary under test.
const KEELCTL: &str = env!("CARGO_BIN_EXE_keelctl");

/// How long the agent gets to start, or to stop after SIGTERM.
const STARTUP: Duration = Duration::from_secs(20);
const STOP: Duration = Duration::from_secs(10);

/// A running (or crashed, see [`Agent::kill9`]) `keel-agentd --simulate`.
pub struct Agent {
    dir: tempfile::TempDir,
    args: Vec<String>,
    child: Option<Child>,
}

impl Agent {
    /// Starts `keel-agentd` with `args` (which must include `--simulate`) in a
    /// fresh temp dir and waits until it answers.
    pub fn start(args: &[&str]) -> Agent {
        assert!(
            args.contains(&"--simulate"),
            "the helper knows where a simulated agent keeps its files: {args:?}"
        );
        let mut agent = Agent {
            dir: tempfile::tempdir().expect("tempdir"),
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
        };
        agent.launch();
        agent
    }

    /// The agent's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The agent's working directory (the README's "checkout").
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Its API socket (`./keel-sim/agentd.sock`).
    pub fn socket(&self) -> PathBuf {
        self.dir().join("keel-sim").join("agentd.sock")
    }

    /// Its state directory (`./keel-sim/agentd`).
    pub fn state_dir(&self) -> PathBuf {
        self.dir().join("keel-sim").join("agentd")
    }

    /// What it wrote on stderr, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn log_path(&self) -> PathBuf {
        self.dir().join("agentd.log")
    }

    /// The pid of every simulated jail's workload, as the agent recorded it in
    /// `{state_dir}/sim/sim-jails.json`.
    pub fn jail_pids(&self) -> BTreeMap<String, u32> {
        sim_jail_pids(&self.state_dir())
    }

    /// The real keelctl against this agent (`$KEEL_SOCKET`, run in its
    /// directory), fed `stdin` if given.
    pub fn keelctl(&self, args: &[&str], stdin: Option<&str>) -> Run {
        let mut cmd = Command::new(KEELCTL);
        cmd.args(args)
            .current_dir(self.dir())
            .env("KEEL_SOCKET", self.socket());
        run(cmd, stdin)
    }

    /// One request to the agent's API.
    pub fn request(&self, method: &str, path: &str) -> ClientResponse {
        Client::new(Endpoint::Unix(self.socket()))
            .with_timeout(Duration::from_secs(10))
            .request(method, path, &[], b"")
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\nagent log:\n{}", self.log()))
    }

    /// `keel_reconcile_duration_seconds_count` from `GET /metrics`: how many
    /// timer passes this agent process has run.
    pub fn reconcile_passes(&self) -> u64 {
        let metrics = String::from_utf8(self.request("GET", "/metrics").body).expect("utf-8");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("keel_reconcile_duration_seconds_count "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no pass count in the metrics:\n{metrics}"))
    }

    /// `kill -9` of the agent alone: its jails keep running, its socket stays
    /// behind, as after a crash.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL the agent");
            child.wait().expect("reap the agent");
        }
    }

    /// Starts the agent again with the same arguments on the same directory.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop the agent before restarting it");
        self.launch();
    }

    fn launch(&mut self) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("agent log file");
        let child = Command::new(AGENTD)
            .args(&self.args)
            .current_dir(self.dir())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone log handle"))
            .stderr(log)
            .spawn()
            .expect("spawn keel-agentd");
        self.child = Some(child);
        let deadline = Instant::now() + STARTUP;
        let client = Client::new(Endpoint::Unix(self.socket())).with_timeout(STOP);
        loop {
            // A 503 is an agent whose worker is still in its first pass.
            if client
                .request("GET", "/healthz", &[], b"")
                .is_ok_and(|r| r.status == 200)
            {
                return;
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                self.child = None;
                panic!(
                    "keel-agentd exited with {status} while starting:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "keel-agentd did not answer on {} within {STARTUP:?}:\n{}",
                self.socket().display(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited in time.
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if terminate(child.id()).is_ok() {
            let deadline = Instant::now() + STOP;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
        // Only now, with no agent left to start one, is the jail table final.
        let Ok(jails) = SimJails::new(&self.state_dir().join("sim")) else {
            eprintln!(
                "cannot open the simulated jail table to clean up; jails may be left running"
            );
            return;
        };
        for jail in jails.list().unwrap_or_default() {
            if let Err(e) = jails.remove(&jail.name, &jail.path, Removal::Force) {
                eprintln!("cleaning up simulated jail {}: {e}", jail.name);
            }
        }
    }
}

/// The pid of every simulated jail's workload of the agent whose state
/// directory is `state_dir`, as it recorded them in `sim/sim-jails.json`.
pub fn sim_jail_pids(state_dir: &Path) -> BTreeMap<String, u32> {
    let file = state_dir.join("sim").join("sim-jails.json");
    let Ok(text) = std::fs::read_to_string(&file) else {
        return BTreeMap::new();
    };
    let state: serde_json::Value = serde_json::from_str(&text).expect("sim-jails.json is JSON");
    state["jails"]
        .as_object()
        .map(|jails| {
            jails
                .iter()
                .map(|(name, j)| {
                    let pid = j["pid"].as_u64().expect("a jail record has a pid");
                    (name.clone(), u32::try_from(pid).expect("pid fits u32"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// SIGTERM to one process (a daemon the tests spawned, our own child).
pub fn terminate(pid: u32) -> std::io::Result<()> {
    signal(pid, libc::SIGTERM)
}

/// Sends `sig` to one process (a daemon the tests spawned, our own child).
#[allow(unsafe_code)]
pub fn signal(pid: u32, sig: libc::c_int) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid)
        .ok()
        .filter(|&p| p > 1)
        .ok_or_else(|| std::io::Error::other(format!("refusing to signal pid {pid}")))?;
    // SAFETY: kill(2) reads only its two integer arguments; `pid` is a child
    // we spawned and have not reaped, so it cannot name another process, and
    // it is never 0, 1 or negative (a group or every process).
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// True while `pid` is a live process. A zombie is not live: a workload
/// orphaned by `kill -9` of its agent and stopped later is reaped only by
/// init.
#[cfg(target_os = "linux")]
pub fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next();
        !matches!(state, Some("Z" | "X") | None)
    })
}

/// True while `pid` exists (zombies included: there is no cheap way to tell
/// them apart without /proc).
#[cfg(not(target_os = "linux"))]
#[allow(unsafe_code)]
pub fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 delivers nothing; kill(2) only checks the pid exists.
    pid > 1 && unsafe { libc::kill(pid, 0) } == 0
}
