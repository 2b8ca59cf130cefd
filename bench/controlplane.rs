//! Benchmark: one keel-controlplane under a simulated 5,000-node cluster.
//!
//! Starts the real `keel-controlplane --simulate --listen 127.0.0.1:P` (the
//! release build cargo made for this bench) in a temporary directory, plus
//! eight lightweight simulated agents inside this process (the `common::http`
//! server with a handler that answers every `PUT /jails/{name}` with 200 and
//! checks nothing), then measures, in this order:
//!
//! 1. baseline: a pool of client threads paced at 1,000 `GET /healthz`/s
//!    (unauthenticated, no worker round trip): the transport's cost;
//! 2. 5,000 nodes register (signed with the node key from
//!    `keel-sim/keys/node.key`), their advertise addresses spread over the
//!    eight simulated agents;
//! 3. the same pool sends every node's heartbeat every 5 s, phases spread
//!    uniformly (1,000 heartbeats/s), on keep-alive connections; after two
//!    heartbeat periods of warm-up (the first one sends every node the full
//!    peer list, reported on its own) a measured window reports heartbeat
//!    latency p50/p99, the control plane's CPU share (utime+stime from
//!    `/proc/<pid>/stat`, as % of one core) and its RSS (`VmRSS`). The
//!    heartbeats keep running until the end;
//! 4. baseline: the apply clients `PUT` 50,000 jails straight to one
//!    simulated agent (no control plane): the transport and client cost;
//! 5. 50,000 scheduled applies (`PUT /jails/{name}`, signed with the operator
//!    key) through the control plane from the same concurrent clients, while
//!    the heartbeats go on: applies/s end to end, latency, CPU, and RSS with
//!    5,000 nodes and 50,000 placements.
//!
//! Heartbeats report what the bench placed on each node (from the answers'
//! `X-Keel-Node`) as committed resources, the way an agent reports its
//! jails, so the scheduler sees placements one heartbeat later as it would
//! in a real cluster. Latencies are measured from the moment a request was
//! due, so a client that falls behind its schedule shows up in them.
//!
//! Run with `cargo bench --bench controlplane` (Linux: CPU and RSS come from
//! /proc). `KEEL_BENCH_NODES`, `KEEL_BENCH_APPLIES` and `KEEL_BENCH_WINDOW`
//! (seconds) shrink a run for profiling. Nothing is asserted on time; the
//! bench exits non-zero when the control plane cannot be started or a
//! request fails. It kills the control plane it started (on every path, by
//! its `Child`) and never signals any other process.
//!
//! The load plumbing (keep-alive clients, the paced heartbeat pool, the
//! in-process agents, the `/proc` readers) is `tests/util/load.rs`, shared
//! with the soak (`tests/soak.rs`).

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use keel::common::auth::{self, KeyFilePolicy, Signer};
use keel::common::http::ClientResponse;
use keel::common::wire::{RegisterRequest, Resources};

#[path = "../tests/util/load.rs"]
mod load;
use load::{
    Agents, JAIL_CPU, JAIL_MEMORY, KeepAlive, NO_VERSION, NODE_CPU, NODE_MEMORY, Paced, PacedLoad,
    Running, Sample, cpu_seconds, encode, mib, node_id, proc_status, signed,
};

/// Nodes in the simulated cluster (the targets are stated for 5,000).
const DEFAULT_NODES: usize = 5000;
/// Scheduled applies (the targets are stated for 50,000).
const DEFAULT_APPLIES: usize = 50_000;
/// Measured heartbeat window, seconds.
const DEFAULT_WINDOW_SECS: u64 = 30;
/// Every node heartbeats this often (the agents' default).
const HEARTBEAT_PERIOD: Duration = Duration::from_secs(5);
/// Threads sending heartbeats (and the `/healthz` baseline), one keep-alive
/// connection each.
const HEARTBEAT_CLIENTS: usize = 8;
/// Concurrent clients for registrations and applies, one keep-alive
/// connection each.
const APPLY_CLIENTS: usize = 32;
/// Simulated agents (listeners); node `i` advertises agent `i % AGENTS`.
const AGENTS: usize = 8;
/// Length of the `/healthz` baseline.
const HEALTHZ_WINDOW: Duration = Duration::from_secs(10);
/// How long the control plane gets to answer `/healthz` after starting.
const START_DEADLINE: Duration = Duration::from_secs(20);
/// The targets (bench/README.md).
const CPU_TARGET_PERCENT: f64 = 25.0;
const APPLY_TARGET_PER_SEC: f64 = 2000.0;
const RSS_TARGET_KIB: u64 = 128 * 1024;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn jail_yaml(name: &str) -> String {
    format!(
        "kind: Jail\nmetadata:\n  name: {name}\nspec:\n  base: 14.2-RELEASE\n  resources:\n    cpu: {JAIL_CPU}\n    memory: {JAIL_MEMORY}\n  exec:\n    start: [\"/bin/sleep\", \"3600\"]\n"
    )
}

// ------------------------------------------------------- the control plane

/// The control plane under test; killed on drop.
struct ControlPlane {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl ControlPlane {
    fn start(binary: &Path) -> Result<ControlPlane, String> {
        let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
        // A free port: bind, note, release. Nothing else on this host races us
        // for loopback ports in the second this takes.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("finding a free port: {e}"))?
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let log = std::fs::File::create(dir.path().join("controlplane.log"))
            .map_err(|e| format!("log file: {e}"))?;
        let child = Command::new(binary)
            .args(["--simulate", "--listen", &addr.to_string()])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", binary.display()))?;
        let mut cp = ControlPlane { child, addr, dir };
        let deadline = Instant::now() + START_DEADLINE;
        let mut conn = KeepAlive::new(addr);
        loop {
            if let Ok(r) = conn.exchange(&encode("GET", "/healthz", addr, &[], b"")) {
                if r.status == 200 {
                    return Ok(cp);
                }
            }
            if let Ok(Some(status)) = cp.child.try_wait() {
                return Err(format!(
                    "keel-controlplane exited with {status}:\n{}",
                    cp.log_tail()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "keel-controlplane did not answer /healthz within {}s:\n{}",
                    START_DEADLINE.as_secs(),
                    cp.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn key(&self, file: &str) -> Result<Signer, String> {
        let path: PathBuf = self.dir.path().join("keel-sim/keys").join(file);
        auth::load_key(&path, KeyFilePolicy::for_current_process())
            .map(Signer::new)
            .map_err(|e| e.to_string())
    }

    fn log_tail(&self) -> String {
        let text =
            std::fs::read_to_string(self.dir.path().join("controlplane.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ------------------------------------------------------------- statistics

/// Latencies of one phase, and how it went.
#[derive(Default)]
struct Outcome {
    latencies: Vec<Duration>,
    errors: usize,
    first_error: Option<String>,
}

impl Outcome {
    fn failed(&mut self, e: String) {
        self.errors += 1;
        self.first_error.get_or_insert(e);
    }

    fn merge(&mut self, other: Outcome) {
        self.latencies.extend(other.latencies);
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    /// (p50, p99) in milliseconds.
    fn percentiles(&self) -> (f64, f64) {
        let mut v = self.latencies.clone();
        if v.is_empty() {
            return (f64::NAN, f64::NAN);
        }
        v.sort_unstable();
        let rank = |p: f64| {
            let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
            v[i].as_secs_f64() * 1000.0
        };
        (rank(0.50), rank(0.99))
    }

    fn check(&self, what: &str) -> Result<(), String> {
        match &self.first_error {
            None => Ok(()),
            Some(e) => Err(format!(
                "{what}: {} requests failed; first: {e}",
                self.errors
            )),
        }
    }
}

// ------------------------------------------------------ closed-loop pools

/// `total` requests from `clients` threads, each on its own keep-alive
/// connection to `addr`, as fast as answers come back. `make(i)` builds
/// request `i`; `accept(i, response)` checks its answer.
fn closed_loop(
    addr: SocketAddr,
    clients: usize,
    total: usize,
    make: &(dyn Fn(usize) -> Result<Vec<u8>, String> + Sync),
    accept: &(dyn Fn(usize, &ClientResponse) -> Result<(), String> + Sync),
) -> (Outcome, Duration) {
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let outcome = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Outcome::default();
                    let mut conn = KeepAlive::new(addr);
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= total {
                            return out;
                        }
                        let sent = Instant::now();
                        match make(i)
                            .and_then(|wire| conn.exchange(&wire))
                            .and_then(|r| accept(i, &r))
                        {
                            Ok(()) => out.latencies.push(sent.elapsed()),
                            Err(e) => out.failed(e),
                        }
                    }
                })
            })
            .collect();
        let mut all = Outcome::default();
        for h in handles {
            match h.join() {
                Ok(o) => all.merge(o),
                Err(_) => all.failed("a client thread panicked".into()),
            }
        }
        all
    });
    (outcome, started.elapsed())
}

/// The samples due within `[from, to)`.
fn window(samples: &[Sample], from: Instant, to: Instant) -> Outcome {
    let mut out = Outcome::default();
    for s in samples.iter().filter(|s| s.due >= from && s.due < to) {
        match &s.error {
            None => out.latencies.push(s.latency),
            Some(e) => out.failed(e.clone()),
        }
    }
    out
}

/// How many paced requests were answered (successfully) within `[from, to)`:
/// the rate actually achieved, whatever the schedule asked for.
fn answered(samples: &[Sample], from: Instant, to: Instant) -> usize {
    samples
        .iter()
        .filter(|s| s.error.is_none())
        .map(|s| s.due + s.latency)
        .filter(|done| *done >= from && *done < to)
        .count()
}

/// CPU share of the control plane (% of one core) and its RSS over `wait`.
struct Usage {
    cpu_percent: f64,
    cpu_seconds: f64,
    wall: Duration,
}

fn usage_between(pid: u32, cpu0: Option<f64>, since: Instant) -> Usage {
    let wall = since.elapsed();
    let cpu_seconds = match (cpu0, cpu_seconds(pid)) {
        (Some(a), Some(b)) => b - a,
        _ => f64::NAN,
    };
    Usage {
        cpu_percent: cpu_seconds / wall.as_secs_f64() * 100.0,
        cpu_seconds,
        wall,
    }
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "MISSED" }
}

// ------------------------------------------------------------------ run

fn run() -> Result<(), String> {
    let nodes: usize = env_or("KEEL_BENCH_NODES", DEFAULT_NODES);
    let applies: usize = env_or("KEEL_BENCH_APPLIES", DEFAULT_APPLIES);
    let window_len = Duration::from_secs(env_or("KEEL_BENCH_WINDOW", DEFAULT_WINDOW_SECS));
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_keel-controlplane"));
    println!(
        "controlplane benchmark: {} --simulate; {nodes} nodes heartbeating every {}s, {applies} scheduled applies, {AGENTS} simulated agents",
        binary.display(),
        HEARTBEAT_PERIOD.as_secs()
    );
    let agents = Agents::start(AGENTS)?;
    let cp = ControlPlane::start(&binary)?;
    let pid = cp.pid();
    let node_key = cp.key("node.key")?;
    let operator_key = cp.key("operator.key")?;
    let addr = cp.addr;
    let rate = nodes as f64 / HEARTBEAT_PERIOD.as_secs_f64();
    println!(
        "control plane pid {pid} on {addr}: VmRSS {}",
        mib(proc_status(pid, "VmRSS"))
    );
    let placed: Arc<Vec<AtomicU64>> = Arc::new((0..nodes).map(|_| AtomicU64::new(0)).collect());
    let paced = |kind| PacedLoad {
        kind,
        addr,
        nodes,
        signer: node_key.clone(),
        placed: Arc::clone(&placed),
        versions: (0..nodes).map(|_| AtomicU64::new(NO_VERSION)).collect(),
        period: HEARTBEAT_PERIOD,
        start: Instant::now(),
        stop: AtomicBool::new(false),
    };

    // 1. Baseline: the same paced pool, GET /healthz.
    eprintln!(
        "baseline: GET /healthz at {rate:.0}/s for {}s",
        HEALTHZ_WINDOW.as_secs()
    );
    let cpu0 = cpu_seconds(pid);
    let hz0 = Instant::now();
    let healthz = Running::start(paced(Paced::Healthz), HEARTBEAT_CLIENTS);
    std::thread::sleep(HEALTHZ_WINDOW);
    let healthz_usage = usage_between(pid, cpu0, hz0);
    let healthz_samples = healthz.finish();
    let healthz_out = window(&healthz_samples, hz0, hz0 + HEALTHZ_WINDOW);
    healthz_out.check("GET /healthz")?;

    // 2. Registrations.
    let advertise: Vec<SocketAddr> = agents.addrs.clone();
    let make_register = |i: usize| {
        let body = serde_json::to_vec(&RegisterRequest {
            node_id: node_id(i),
            advertise_addr: advertise[i % advertise.len()],
            capacity: Resources {
                cpu: NODE_CPU,
                memory: NODE_MEMORY,
            },
        })
        .map_err(|e| e.to_string())?;
        signed(
            &node_key,
            "POST",
            "/nodes/register",
            addr,
            "application/json",
            &body,
        )
    };
    let ok_200 = |_: usize, r: &ClientResponse| match r.status {
        200..=299 => Ok(()),
        s => Err(format!("{s}: {}", String::from_utf8_lossy(&r.body))),
    };
    eprintln!("registering {nodes} nodes");
    let cpu0 = cpu_seconds(pid);
    let since = Instant::now();
    let (register_out, register_wall) =
        closed_loop(addr, APPLY_CLIENTS, nodes, &make_register, &ok_200);
    let register_usage = usage_between(pid, cpu0, since);
    register_out.check("POST /nodes/register")?;

    // 3. Heartbeats: two periods of warm-up (the first brings every node's
    // first heartbeat, hence a full peer list), then the measured window.
    eprintln!(
        "heartbeats: {}s warm-up, {}s measured",
        2 * HEARTBEAT_PERIOD.as_secs(),
        window_len.as_secs()
    );
    let heartbeats = Running::start(paced(Paced::Heartbeat), HEARTBEAT_CLIENTS);
    let hb_start = heartbeats.load.start;
    let cpu0 = cpu_seconds(pid);
    std::thread::sleep(HEARTBEAT_PERIOD);
    let warmup_usage = usage_between(pid, cpu0, hb_start);
    // A second period lets a backlog from the first drain before measuring.
    std::thread::sleep(HEARTBEAT_PERIOD);
    let w0 = Instant::now();
    let cpu0 = cpu_seconds(pid);
    std::thread::sleep(window_len);
    let hb_usage = usage_between(pid, cpu0, w0);
    let w1 = Instant::now();
    let hb_rss = proc_status(pid, "VmRSS");

    // 4. Baseline: the apply clients straight to one simulated agent.
    let agent0 = agents.addrs[0];
    let make_direct = |i: usize| {
        let path = format!("/jails/direct-{i:05}");
        signed(
            &operator_key,
            "PUT",
            &path,
            agent0,
            "application/yaml",
            jail_yaml(&format!("direct-{i:05}")).as_bytes(),
        )
    };
    eprintln!("baseline: {applies} PUTs straight to one simulated agent");
    let (direct_out, direct_wall) =
        closed_loop(agent0, APPLY_CLIENTS, applies, &make_direct, &ok_200);
    direct_out.check("direct PUT to a simulated agent")?;

    // 5. Scheduled applies through the control plane, heartbeats going on.
    let puts_before = agents.puts.load(Ordering::Relaxed);
    let make_apply = |i: usize| {
        let name = format!("job-{i:05}");
        signed(
            &operator_key,
            "PUT",
            &format!("/jails/{name}"),
            addr,
            "application/yaml",
            jail_yaml(&name).as_bytes(),
        )
    };
    let record = |i: usize, r: &ClientResponse| {
        ok_200(i, r)?;
        let node = r
            .header("X-Keel-Node")
            .ok_or("no X-Keel-Node in the answer")?;
        let idx: usize = node
            .strip_prefix("node-")
            .and_then(|n| n.parse().ok())
            .filter(|n| *n < nodes)
            .ok_or_else(|| format!("X-Keel-Node {node:?} is not a simulated node"))?;
        placed[idx].fetch_add(1, Ordering::Relaxed);
        Ok(())
    };
    eprintln!("{applies} scheduled applies through the control plane");
    let cpu0 = cpu_seconds(pid);
    let since = Instant::now();
    let (apply_out, apply_wall) = closed_loop(addr, APPLY_CLIENTS, applies, &make_apply, &record);
    let apply_usage = usage_between(pid, cpu0, since);
    let apply_rss = proc_status(pid, "VmRSS");
    let apply_hwm = proc_status(pid, "VmHWM");
    let threads = proc_status(pid, "Threads");
    let forwarded = agents.puts.load(Ordering::Relaxed) - puts_before;
    let samples = heartbeats.finish();
    let hb_out = window(&samples, w0, w1);
    let hb_during_apply = window(&samples, since, since + apply_wall);
    apply_out.check("scheduled PUT /jails/NAME")?;
    hb_out.check("heartbeats")?;

    // Report.
    let (hz50, hz99) = healthz_out.percentiles();
    let (hb50, hb99) = hb_out.percentiles();
    let (hba50, hba99) = hb_during_apply.percentiles();
    let (ap50, ap99) = apply_out.percentiles();
    let (di50, di99) = direct_out.percentiles();
    let hb_rate = answered(&samples, w0, w1) as f64 / window_len.as_secs_f64();
    let hz_rate =
        answered(&healthz_samples, hz0, hz0 + HEALTHZ_WINDOW) as f64 / HEALTHZ_WINDOW.as_secs_f64();
    let apply_rate = applies as f64 / apply_wall.as_secs_f64();
    let direct_rate = applies as f64 / direct_wall.as_secs_f64();
    let per_node: Vec<u64> = placed.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let busiest = per_node.iter().copied().max().unwrap_or(0);
    let used = per_node.iter().filter(|c| **c > 0).count();

    println!();
    println!(
        "registration: {nodes} nodes in {:.2} s ({:.0}/s), p50 {:.2} ms, p99 {:.2} ms, control plane CPU {:.0} % of one core",
        register_wall.as_secs_f64(),
        nodes as f64 / register_wall.as_secs_f64(),
        register_out.percentiles().0,
        register_out.percentiles().1,
        register_usage.cpu_percent
    );
    println!(
        "heartbeat warm-up (first heartbeat of every node, {:.1} s): control plane CPU {:.0} % of one core",
        warmup_usage.wall.as_secs_f64(),
        warmup_usage.cpu_percent
    );
    println!();
    println!(
        "{:<44} {:>10} {:>10} {:>10} {:>12}",
        "paced, 1 keep-alive conn per client thread", "req/s", "p50 ms", "p99 ms", "CPU % core"
    );
    println!(
        "{:<44} {:>10.0} {:>10.3} {:>10.3} {:>12.1}",
        "GET /healthz (baseline)", hz_rate, hz50, hz99, healthz_usage.cpu_percent
    );
    println!(
        "{:<44} {:>10.0} {:>10.3} {:>10.3} {:>12.1}",
        format!("POST heartbeat, {nodes} nodes"),
        hb_rate,
        hb50,
        hb99,
        hb_usage.cpu_percent
    );
    println!(
        "heartbeat / healthz: p50 x{:.1}, CPU x{:.1}; target at {rate:.0} heartbeats/s: under {CPU_TARGET_PERCENT:.0} % of one core: {} ({:.1} CPU-s in {:.1} s)",
        hb50 / hz50,
        hb_usage.cpu_percent / healthz_usage.cpu_percent,
        verdict(hb_usage.cpu_percent < CPU_TARGET_PERCENT),
        hb_usage.cpu_seconds,
        hb_usage.wall.as_secs_f64()
    );
    println!(
        "control plane VmRSS with {nodes} nodes heartbeating: {}",
        mib(hb_rss)
    );
    println!();
    println!(
        "{:<44} {:>10} {:>10} {:>10} {:>12}",
        format!("closed loop, {APPLY_CLIENTS} clients"),
        "applies/s",
        "p50 ms",
        "p99 ms",
        "CPU % core"
    );
    println!(
        "{:<44} {:>10.0} {:>10.3} {:>10.3} {:>12}",
        "PUT straight to one agent (baseline)", direct_rate, di50, di99, "-"
    );
    println!(
        "{:<44} {:>10.0} {:>10.3} {:>10.3} {:>12.1}",
        "PUT /jails/NAME via the control plane", apply_rate, ap50, ap99, apply_usage.cpu_percent
    );
    let hb_cpu_rate = hb_usage.cpu_seconds / hb_usage.wall.as_secs_f64();
    let apply_cpu = apply_usage.cpu_seconds - hb_cpu_rate * apply_usage.wall.as_secs_f64();
    println!(
        "scheduled / direct: throughput x{:.2}, p50 x{:.1}; control plane CPU per apply (heartbeat share removed): {:.0} us; target at least {APPLY_TARGET_PER_SEC:.0}/s: {}",
        apply_rate / direct_rate,
        ap50 / di50,
        apply_cpu / applies as f64 * 1e6,
        verdict(apply_rate >= APPLY_TARGET_PER_SEC)
    );
    println!(
        "heartbeats during the applies: p50 {hba50:.3} ms, p99 {hba99:.3} ms, {} failed",
        hb_during_apply.errors
    );
    println!(
        "forwarded to agents: {forwarded}; nodes used: {used} of {nodes}, most jails on one node: {busiest}"
    );
    println!(
        "control plane with {nodes} nodes and {applies} placements: VmRSS {} (peak VmHWM {}), {} threads; target under 128 MiB: {}",
        mib(apply_rss),
        mib(apply_hwm),
        threads.map_or("n/a".into(), |t| t.to_string()),
        verdict(apply_rss.is_some_and(|k| k < RSS_TARGET_KIB))
    );
    if forwarded != applies as u64 {
        return Err(format!(
            "{applies} applies succeeded but the agents saw {forwarded} PUTs"
        ));
    }
    drop(cp);
    drop(agents);
    Ok(())
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; nothing here takes arguments.
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("controlplane bench: {e}");
            ExitCode::FAILURE
        }
    }
}
