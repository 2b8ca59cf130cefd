//! Benchmark: keel-agentd in simulate mode holding 1,000 jails.
//!
//! Starts the real `keel-agentd --simulate` (the release build cargo made for
//! this bench) in a temporary directory, applies 1,000 jails whose workload is
//! `/bin/sleep 3600` with `PUT /jails/{name}` over the agent's Unix socket
//! (through `keel::common::http::Client`, the client keelctl uses), and
//! reports:
//!
//! - the agent's memory (`VmRSS` and its peak `VmHWM` from
//!   `/proc/<pid>/status`) after the applies and after one more reconcile pass
//!   over all 1,000 jails; target: under 48 MiB;
//! - the apply round trip (median and p99 of the PUT latency). The baseline
//!   printed next to it is a `GET /healthz` round trip over the same socket,
//!   sent right after each PUT, so the ratio shows what an apply costs beyond
//!   the transport.
//!
//! Run with `cargo bench --bench agent_sim` (Linux: RSS comes from /proc).
//! `KEEL_BENCH_JAILS` changes the number of jails. The benchmark exits
//! non-zero when the RSS target is missed, the agent cannot be started, an
//! apply fails, or the jails do not all run; the round trips are printed
//! against their baseline and checked against nothing.
//!
//! Cleanup, also on every error path ([`Agent`]'s `Drop`): the agent is
//! killed, then every simulated jail, by the process groups recorded in
//! `keel-sim/agentd/sim/sim-jails.json` (each jail runs in a process group of
//! its own). A group is signalled only while its leader is still the process
//! the agent started (same pid and start time), so a reused pid is never hit.
//! This benchmark must never signal any other process.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use keel::common::http::{Client, Endpoint};

/// Jails applied (the target is stated for 1,000).
const DEFAULT_JAILS: usize = 1000;
/// Target for the agent's resident memory with all jails applied.
const RSS_TARGET_KIB: u64 = 48 * 1024;
/// How long the agent gets to bind its socket.
const START_DEADLINE: Duration = Duration::from_secs(20);
/// How long the jails' processes get to disappear after SIGKILL.
const CLEANUP_DEADLINE: Duration = Duration::from_secs(10);
/// Requests answered by the agent may queue behind a reconcile pass.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

fn jail_yaml(name: &str) -> String {
    format!(
        "kind: Jail
metadata:
  name: {name}
spec:
  base: 14.2-RELEASE
  exec:
    start: [\"/bin/sleep\", \"3600\"]
"
    )
}

/// One field of `/proc/<pid>/status` in KiB (`VmRSS`, `VmHWM`), or a count
/// (`Threads`).
fn proc_status(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Field 22 of `/proc/<pid>/stat` (start time in clock ticks since boot),
/// counted after the last `)` since the command name may hold anything.
fn start_time(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The agent's worker thread (`keel-worker`, which runs every apply and
/// pass): nanoseconds on a CPU and nanoseconds waiting for one
/// (`/proc/<pid>/task/<tid>/schedstat`). Between two readings, an apply's
/// wall time minus both is time the worker was blocked (disk: fsync).
fn worker_schedstat(pid: u32) -> Option<(u64, u64)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() == "keel-worker" {
            let stat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
            let mut fields = stat.split_whitespace().map(|f| f.parse::<u64>().ok());
            return Some((fields.next()??, fields.next()??));
        }
    }
    None
}

/// kill(2) on a process group, refused for ids that would mean our own
/// group, init or every process.
#[allow(unsafe_code)]
fn kill_group(pgid: u32) -> bool {
    let Some(id) = i32::try_from(pgid).ok().filter(|&i| i > 1) else {
        return false;
    };
    // SAFETY: kill(2) reads its two integer arguments only; -id is a
    // negative process-group id other than -1, never 0.
    unsafe { libc::kill(-id, libc::SIGKILL) == 0 }
}

/// The running agent and everything it started; killed on drop.
struct Agent {
    child: Child,
    dir: tempfile::TempDir,
    client: Client,
}

impl Agent {
    fn start(binary: &Path, jails: usize) -> Result<Agent, String> {
        let dir = tempfile::tempdir().map_err(|e| format!("tempdir: {e}"))?;
        let log = std::fs::File::create(dir.path().join("agentd.log"))
            .map_err(|e| format!("agent log: {e}"))?;
        // A /24 has 253 jail addresses; give the node a subnet that fits.
        let prefix = if jails <= 250 { 24 } else { 20 };
        let child = Command::new(binary)
            .args([
                "--simulate",
                "--node-subnet",
                &format!("127.64.0.0/{prefix}"),
            ])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("could not start {}: {e}", binary.display()))?;
        let socket = dir.path().join("keel-sim/agentd.sock");
        let client = Client::new(Endpoint::Unix(socket)).with_timeout(REQUEST_TIMEOUT);
        let mut agent = Agent { child, dir, client };
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            if let Ok(r) = agent.client.request("GET", "/healthz", &[], b"")
                && r.status == 200
            {
                return Ok(agent);
            }
            if let Ok(Some(status)) = agent.child.try_wait() {
                return Err(format!(
                    "keel-agentd exited with {status} before answering; its log:\n{}",
                    agent.log()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "keel-agentd did not answer /healthz within {START_DEADLINE:?}; its log:\n{}",
                    agent.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agentd.log")).unwrap_or_default()
    }

    fn sim_file(&self) -> PathBuf {
        self.dir.path().join("keel-sim/agentd/sim/sim-jails.json")
    }

    /// GET `path`, the response status and body and the round-trip time.
    fn get(&self, path: &str) -> Result<(u16, String, Duration), String> {
        let start = Instant::now();
        let r = self
            .client
            .request("GET", path, &[], b"")
            .map_err(|e| format!("GET {path}: {e}"))?;
        Ok((
            r.status,
            String::from_utf8_lossy(&r.body).into_owned(),
            start.elapsed(),
        ))
    }

    fn put_jail(&self, name: &str) -> Result<Duration, String> {
        let body = jail_yaml(name);
        let start = Instant::now();
        let r = self
            .client
            .request("PUT", &format!("/jails/{name}"), &[], body.as_bytes())
            .map_err(|e| format!("PUT /jails/{name}: {e}"))?;
        let took = start.elapsed();
        if r.status != 200 {
            return Err(format!(
                "PUT /jails/{name}: {} {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            ));
        }
        Ok(took)
    }

    /// A metric's value from `GET /metrics`.
    fn metric(&self, name: &str) -> Result<f64, String> {
        let (_, body, _) = self.get("/metrics")?;
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| format!("no {name} in /metrics"))
    }

    /// The simulated jails' (pid, start time) from the sim state file.
    fn jail_processes(&self) -> Vec<(u32, Option<u64>)> {
        let Ok(text) = std::fs::read_to_string(self.sim_file()) else {
            return Vec::new();
        };
        let Ok(value) = serde_json::from_str::<serde_json::Value>(&text) else {
            return Vec::new();
        };
        let Some(jails) = value.get("jails").and_then(|j| j.as_object()) else {
            return Vec::new();
        };
        jails
            .values()
            .filter_map(|j| {
                let pid = u32::try_from(j.get("pid")?.as_u64()?).ok()?;
                Some((pid, j.get("start_time").and_then(|s| s.as_u64())))
            })
            .collect()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let ours: Vec<u32> = self
            .jail_processes()
            .into_iter()
            .filter(|(pid, recorded)| recorded.is_none() || start_time(*pid) == *recorded)
            .map(|(pid, _)| pid)
            .collect();
        for pid in &ours {
            kill_group(*pid);
        }
        // The jails were the agent's children; with the agent gone they are
        // reparented and reaped by init (or the subreaper).
        let deadline = Instant::now() + CLEANUP_DEADLINE;
        let alive = |pid: &u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| {
                    !s.rsplit(')')
                        .next()
                        .unwrap_or("")
                        .trim_start()
                        .starts_with('Z')
                })
                .unwrap_or(false)
        };
        while ours.iter().any(alive) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        // Every simulated jail runs in its directory under our temp dir: a
        // process still there is one we leaked, whatever the sim file says.
        let root = self.dir.path().to_path_buf();
        let leaked = std::fs::read_dir("/proc")
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
                    .filter(|e| {
                        std::fs::read_link(e.path().join("cwd")).is_ok_and(|c| c.starts_with(&root))
                    })
                    .count()
            })
            .unwrap_or(0);
        let left = ours.iter().filter(|p| alive(p)).count();
        if left > 0 || leaked > 0 {
            eprintln!(
                "cleanup: {left} simulated jail processes still alive, {leaked} processes still in {}",
                root.display()
            );
        } else {
            eprintln!(
                "cleanup: agent and {} simulated jail process groups killed; no process left in {}",
                ours.len(),
                root.display()
            );
        }
    }
}

/// Median and p99 (nearest rank) of some durations, in milliseconds.
fn percentiles(times: &[Duration]) -> (f64, f64) {
    let mut v: Vec<Duration> = times.to_vec();
    v.sort();
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let rank = |p: f64| {
        let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[i].as_secs_f64() * 1000.0
    };
    (rank(0.50), rank(0.99))
}

fn mib(kib: Option<u64>) -> String {
    kib.map(|k| format!("{:.1} MiB", k as f64 / 1024.0))
        .unwrap_or_else(|| "n/a".into())
}

fn run() -> Result<(), String> {
    let jails = std::env::var("KEEL_BENCH_JAILS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_JAILS);
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_keel-agentd"));
    println!(
        "agent_sim benchmark: {} --simulate, {jails} jails running /bin/sleep 3600",
        binary.display()
    );
    let agent = Agent::start(&binary, jails)?;
    let pid = agent.pid();
    println!(
        "agent started: VmRSS {} (threads {})",
        mib(proc_status(pid, "VmRSS")),
        proc_status(pid, "Threads").map_or("n/a".into(), |t| t.to_string())
    );

    let mut puts = Vec::with_capacity(jails);
    let mut healthz = Vec::with_capacity(jails);
    let mut milestones: BTreeMap<usize, Option<u64>> = BTreeMap::new();
    let worker_before = worker_schedstat(pid);
    let started = Instant::now();
    for i in 0..jails {
        puts.push(agent.put_jail(&format!("sim-{i}"))?);
        let (status, _, took) = agent.get("/healthz")?;
        if status != 200 {
            return Err(format!("GET /healthz: {status}"));
        }
        healthz.push(took);
        if (i + 1) % (jails / 4).max(1) == 0 {
            milestones.insert(i + 1, proc_status(pid, "VmRSS"));
        }
    }
    let apply_wall = started.elapsed();
    let worker_after = worker_schedstat(pid);

    // One full timer pass over every jail after the last apply, so the RSS
    // below includes a pass's working set.
    let passes = agent.metric("keel_reconcile_duration_seconds_count")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while agent.metric("keel_reconcile_duration_seconds_count")? <= passes {
        if Instant::now() > deadline {
            return Err("no reconcile pass within 30 s after the applies".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let running = agent.metric("keel_jails_running")?;
    let pass_sum = agent.metric("keel_reconcile_duration_seconds_sum")?;
    let pass_count = agent.metric("keel_reconcile_duration_seconds_count")?;
    let rss = proc_status(pid, "VmRSS");
    let hwm = proc_status(pid, "VmHWM");
    let threads = proc_status(pid, "Threads");
    let (_, list_body, list_took) = agent.get("/jails")?;

    let (put_p50, put_p99) = percentiles(&puts);
    let (hz_p50, hz_p99) = percentiles(&healthz);
    let tenth = (jails / 10).max(1);
    let (first_p50, _) = percentiles(&puts[..tenth]);
    let (last_p50, _) = percentiles(&puts[jails - tenth..]);

    println!(
        "applied {jails} jails in {:.1} s; jails running at the last pass: {running}",
        apply_wall.as_secs_f64()
    );
    for (n, kib) in &milestones {
        println!("  VmRSS after {n:>5} applies: {}", mib(*kib));
    }
    println!(
        "agent memory with {jails} jails, after a full pass: VmRSS {} (peak VmHWM {}), {} threads; target under 48 MiB: {}",
        mib(rss),
        mib(hwm),
        threads.map_or("n/a".into(), |t| t.to_string()),
        match rss {
            Some(k) if k < RSS_TARGET_KIB => "met",
            Some(_) => "MISSED",
            None => "not measured",
        }
    );
    println!(
        "PUT /jails/NAME round trip: median {put_p50:.2} ms, p99 {put_p99:.2} ms (first {tenth}: median {first_p50:.2} ms; last {tenth}: median {last_p50:.2} ms)"
    );
    println!(
        "baseline GET /healthz round trip: median {hz_p50:.3} ms, p99 {hz_p99:.3} ms; apply/healthz median ratio {:.0}",
        put_p50 / hz_p50
    );
    println!(
        "reconcile passes so far: {pass_count}, mean {:.1} ms; GET /jails with {jails} jails: {:.1} ms, {} bytes",
        pass_sum / pass_count.max(1.0) * 1000.0,
        list_took.as_secs_f64() * 1000.0,
        list_body.len()
    );
    if let (Some((cpu0, wait0)), Some((cpu1, wait1))) = (worker_before, worker_after) {
        // Timer passes ran during the applies too; they are part of the
        // worker's load while an apply waits.
        let per = |ns: u64| ns as f64 / 1e6 / jails as f64;
        let sum: f64 = puts.iter().map(|d| d.as_secs_f64() * 1000.0).sum::<f64>() / jails as f64;
        let (cpu, wait) = (per(cpu1 - cpu0), per(wait1 - wait0));
        println!(
            "worker thread per apply (mean, timer passes included): {cpu:.2} ms on CPU, {wait:.2} ms waiting for a CPU, about {:.2} ms blocked (disk), of a mean PUT round trip of {sum:.2} ms",
            (sum - cpu - wait).max(0.0)
        );
    }
    if running < jails as f64 {
        return Err(format!("only {running} of {jails} jails running"));
    }
    drop(agent);
    match rss {
        Some(k) if k >= RSS_TARGET_KIB => Err(format!(
            "target missed: VmRSS {} with {jails} jails (target under 48 MiB)",
            mib(rss)
        )),
        _ => Ok(()),
    }
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; nothing here takes arguments.
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agent_sim: {e}");
            ExitCode::FAILURE
        }
    }
}
