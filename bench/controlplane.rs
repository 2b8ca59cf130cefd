//! Benchmark: one keel-controlplane under a simulated cluster of 5,000 and
//! 10,000 nodes, checking its own targets.
//!
//! Three modes (`KEEL_BENCH_MODE`):
//!
//! **realistic** (the default), once per cluster size (`KEEL_BENCH_NODES`,
//! a comma-separated list; default 5,000 then 10,000), each against a fresh
//! `keel-controlplane --simulate --dead-after 30s`:
//!
//! 1. baseline: `GET /healthz` paced at the heartbeat rate (nodes / 5 s),
//!    unauthenticated, no worker round trip: the transport's cost;
//! 2. every node registers, each advertising its own in-process simulated
//!    agent (one listener per node, answering `PUT /jails/{name}` with the
//!    node's committed resources as a real agent does, and keeping what it
//!    was sent with its epoch);
//! 3. every node heartbeats every 5 s, phases spread uniformly, the way
//!    `agentd::cluster` builds its requests: the jails its agent holds as
//!    placed (name, epoch, running, ready, an address of its subnet),
//!    committed resources from them, the peer list version and endpoint
//!    table stamp of the previous answer (kept as `PeerCache` and
//!    `EndpointCache` keep them), `peer_changes` and `endpoint_changes`;
//!    stale jails named in an
//!    answer are deleted from the agent;
//! 4. 1,000 services with 3 replicas each (`KEEL_BENCH_SERVICES`) are
//!    created through `PUT /services/{name}` by 32 concurrent clients while
//!    the heartbeats run, then two periods let the replicas' reports reach
//!    the endpoint table;
//! 5. once every client thread is back on schedule (the first full lists
//!    leave them behind for a while at 10,000 nodes) and one more period,
//!    a steady window (`KEEL_BENCH_WINDOW`, default 30 s): heartbeat
//!    latency, answer sizes, the control plane's CPU share (utime+stime
//!    from `/proc/<pid>/stat`, % of one core);
//! 6. the membership changes: the node holding the most replicas stops
//!    heartbeating and a new node registers and starts. The window after
//!    the join is one heartbeat period (every node answered once); the
//!    silent node is declared dead 25 to 30 s later (the first answer whose
//!    peer changes say so), its replicas are healed onto other nodes (their
//!    agents are sent them), and one more period is measured after each.
//!
//! Targets, each printed with met/MISSED (the bench exits non-zero when one
//! is missed): control plane CPU in the steady window under 25 % of one
//! core at 1,000 heartbeats/s with 1,000 services (checked at sizes of at
//! most 1,000 heartbeats/s); answer body size in the period after the join
//! under 2 KB for every node but the new one (max and p99); heartbeat p99
//! in the period after the join and after the death at most twice the
//! steady p99 of the same run; and, so those ratios mean something, the
//! steady window answered the scheduled rate within 5 %. A quick run under two minutes:
//! `KEEL_BENCH_NODES=1000 KEEL_BENCH_SERVICES=200 KEEL_BENCH_WINDOW=10`.
//!
//! **plain** (the earlier figures), 5,000 nodes:
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
//! **backends**: the plain mode twice in one run, first on the embedded
//! journal, then with the state on a real 3-member etcd on loopback
//! (Debian's etcd-server, started and killed by the bench through
//! `tests/util/etcd.rs`), and the ratios etcd / journal of scheduled
//! applies/s, CPU per apply, heartbeat CPU and heartbeat p99. No target is
//! stated for the ratios; they are recorded.
//!
//! There heartbeats report what the bench placed on each node (from the answers'
//! `X-Keel-Node`) as committed resources, the way an agent reports its
//! jails, so the scheduler sees placements one heartbeat later as it would
//! in a real cluster. Latencies are measured from the moment a request was
//! due, so a client that falls behind its schedule shows up in them.
//!
//! Run with `cargo bench --bench controlplane` (Linux: CPU and RSS come from
//! /proc). In the plain mode `KEEL_BENCH_NODES`, `KEEL_BENCH_APPLIES` and
//! `KEEL_BENCH_WINDOW` (seconds) shrink a run; in the realistic mode
//! `KEEL_BENCH_TRACE=file` also writes every heartbeat's latency and answer
//! size as CSV, timed from the steady window and from the death, to tell a
//! stall (slow answers together) from load (spread out). Nothing is asserted on time
//! but the targets; the bench also exits non-zero when the control plane
//! cannot be started, a request fails or a heal does not happen within two
//! minutes. It kills the control plane it started (on every path, by its
//! `Child`) and never signals any other process.
//!
//! The load plumbing (keep-alive clients, the paced heartbeat pool, the
//! in-process agents, the `/proc` readers) is `tests/util/load.rs`, shared
//! with the soak (`tests/soak.rs`); the bench includes the process tests'
//! `tests/util` whole, for it and for the etcd cluster.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel::common::auth::Signer;
use keel::common::http::ClientResponse;
use keel::common::sync::lock;
use keel::common::wire::{
    EndpointsStamp, HeartbeatRequest, HeartbeatResponse, PlacedJail, RegisterRequest,
    RegisterResponse, ReplicaRequest, Resources, ServiceApply,
};

// The process tests' helpers: the stand-in load, and for the backends
// mode a real etcd cluster (`util::etcd`).
#[path = "../tests/util/mod.rs"]
mod util;
use util::etcd::EtcdCluster;
use util::load::{
    Agents, ControlPlane, JAIL_CPU, JAIL_MEMORY, KeepAlive, NO_VERSION, NODE_CPU, NODE_MEMORY,
    Paced, PacedLoad, Running, Sample, cpu_seconds, mib, node_id, pace, proc_status, signed,
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

/// What the plain mode measured, for the backends mode's comparison.
struct PlainFigures {
    /// Scheduled applies per second through the control plane.
    apply_rate: f64,
    /// Control plane CPU per apply, the heartbeat share removed, in µs.
    apply_cpu_us: f64,
    /// Control plane CPU during the heartbeat window, % of one core.
    heartbeat_cpu: f64,
    /// Heartbeat p99 in the window, ms.
    heartbeat_p99: f64,
}

/// The plain mode on the default backend (the journal).
fn plain() -> Result<(), String> {
    plain_on(&[]).map(|_| ())
}

/// The backends mode: the plain mode on the journal and then on a real
/// 3-member etcd (Debian's etcd-server), one after the other in one run,
/// and the ratios. No target is stated for the ratios: they are recorded;
/// each run's own targets are checked as in the plain mode.
fn backends() -> Result<bool, String> {
    let etcd = EtcdCluster::start("the controlplane bench's backends mode", 3)
        .ok_or("etcd is not installed (Debian package etcd-server)")?;
    let endpoints = etcd.endpoints().join(",");
    println!("== the embedded journal");
    let journal = plain_on(&[])?;
    println!();
    println!("== etcd, 3 members on loopback: {endpoints}");
    let on_etcd = plain_on(&["--etcd-endpoints", &endpoints])?;
    println!();
    println!(
        "etcd / journal: scheduled applies/s x{:.2} ({:.0} against {:.0}), CPU per apply x{:.2} ({:.0} against {:.0} us), heartbeat CPU x{:.2} ({:.1} against {:.1} % of one core), heartbeat p99 x{:.2} ({:.3} against {:.3} ms)",
        on_etcd.apply_rate / journal.apply_rate,
        on_etcd.apply_rate,
        journal.apply_rate,
        on_etcd.apply_cpu_us / journal.apply_cpu_us,
        on_etcd.apply_cpu_us,
        journal.apply_cpu_us,
        on_etcd.heartbeat_cpu / journal.heartbeat_cpu,
        on_etcd.heartbeat_cpu,
        journal.heartbeat_cpu,
        on_etcd.heartbeat_p99 / journal.heartbeat_p99,
        on_etcd.heartbeat_p99,
        journal.heartbeat_p99,
    );
    Ok(true)
}

/// The plain mode: heartbeats without jails, then scheduled applies, with
/// `flags` added to the control plane's.
fn plain_on(flags: &[&str]) -> Result<PlainFigures, String> {
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
    let cp = ControlPlane::start(&binary, flags)?;
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
    Ok(PlainFigures {
        apply_rate,
        apply_cpu_us: apply_cpu / applies as f64 * 1e6,
        heartbeat_cpu: hb_usage.cpu_percent,
        heartbeat_p99: hb99,
    })
}

// ------------------------------------------------------- realistic mode

/// Cluster sizes of the realistic mode when `KEEL_BENCH_NODES` names none.
const DEFAULT_SIZES: &[usize] = &[5000, 10_000];
/// Services created through the API, each with [`REPLICAS`] replicas.
const DEFAULT_SERVICES: usize = 1000;
const REPLICAS: u32 = 3;
/// `--dead-after` of the realistic mode: the silent node dies within the
/// run, after the window that follows the join (its last heartbeat is at
/// most one period before the join, so it dies at least 25 s after it).
/// Not shorter: at 10,000 nodes the first heartbeat of every node carries
/// the full peer list (9 GB in all), which two shared cores deliver in more
/// than one period, and with 12 s nodes registered first died before their
/// first answer, and every death and return sent the lists again.
const DEAD_AFTER: Duration = Duration::from_secs(30);
/// Every answer but the new node's after one node joins.
const ANSWER_TARGET_BYTES: usize = 2048;
/// Heartbeat p99 after a membership change, over the steady p99.
const P99_RATIO_TARGET: f64 = 2.0;
/// The CPU target is stated for this heartbeat rate (5,000 nodes).
const CPU_TARGET_RATE: f64 = 1000.0;
/// How long the bench waits for the placements it learns of, the death
/// and the heal before calling the run failed.
const SETTLE_DEADLINE: Duration = Duration::from_secs(120);
/// A client is on schedule when its last answer came this soon after it
/// was due.
const ON_SCHEDULE: Duration = Duration::from_millis(50);
/// The steady window counts only when the answers kept to the schedule's
/// rate within this fraction.
const STEADY_RATE_TOLERANCE: f64 = 0.05;
/// How often the bench checks for what it waits on.
const RESOLVE_EVERY: Duration = Duration::from_millis(250);

/// What a simulated agent holds between heartbeats (its jails are its
/// listener's in [`Agents::jails`]).
#[derive(Default)]
struct SimNode {
    /// As `PeerCache::version`: the peer list version held.
    peers_version: Option<u64>,
    /// As `EndpointCache::held`: the endpoint table held.
    endpoints: Option<EndpointsStamp>,
    /// The first address of its subnet, from its registration.
    subnet: Option<Ipv4Addr>,
}

/// The parts of a heartbeat answer an agent's caches keep (the peers and
/// services themselves are skipped unread but for a death's delta).
#[derive(serde::Deserialize)]
struct AnswerHead {
    #[serde(default)]
    stale: Vec<String>,
    #[serde(default)]
    peers_version: Option<u64>,
    #[serde(default)]
    peers_unchanged: bool,
    #[serde(default)]
    peers_changed: Option<u64>,
    #[serde(default)]
    peers_removed: Vec<String>,
    #[serde(default)]
    endpoints_generation: Option<u64>,
    #[serde(default)]
    endpoints_origin: Option<u64>,
    #[serde(default)]
    endpoints_unchanged: bool,
    #[serde(default)]
    services_changed: Option<u64>,
}

/// Simulated agents heartbeating the way `agentd::cluster` does: placed
/// jails reported, the versions of the previous answer sent back, changes
/// asked for.
struct Fleet {
    addr: SocketAddr,
    signer: Signer,
    nodes: usize,
    period: Duration,
    start: Instant,
    stop: AtomicBool,
    state: Vec<Mutex<SimNode>>,
    /// Node `i`'s jails: what its simulated agent was sent.
    jails: Arc<Vec<Mutex<BTreeMap<String, u64>>>>,
    /// Whether node `i` heartbeats now.
    beating: Vec<AtomicBool>,
    /// The node that goes silent, and when an answer first said it is
    /// dead.
    silent: AtomicUsize,
    death_seen: Mutex<Option<Instant>>,
    /// Per client thread, how late (from its due time) its last answer
    /// came, in microseconds: the fleet is on schedule when all are small.
    lag_us: Vec<AtomicU64>,
}

impl Fleet {
    /// True when every client thread's last answer came within `within`
    /// of its due time.
    fn on_schedule(&self, within: Duration) -> bool {
        let bound = u64::try_from(within.as_micros()).unwrap_or(u64::MAX);
        self.lag_us
            .iter()
            .all(|l| l.load(Ordering::Relaxed) < bound)
    }
}

impl Fleet {
    fn run(&self, t: usize, threads: usize) -> Vec<Sample> {
        let mut samples = Vec::new();
        let mut conn = KeepAlive::new(self.addr);
        pace(
            t,
            threads,
            self.nodes,
            self.period,
            self.start,
            &self.stop,
            |i, due| {
                if !self.beating[i].load(Ordering::Relaxed) {
                    return;
                }
                let result = self.request(i).and_then(|wire| conn.exchange(&wire));
                let bytes = result.as_ref().map_or(0, |r| r.body.len());
                let error = match result {
                    Ok(r) if r.status == 200 => self.absorb(i, &r.body).err(),
                    Ok(r) => Some(format!(
                        "heartbeat of {} answered {}: {}",
                        node_id(i),
                        r.status,
                        String::from_utf8_lossy(&r.body)
                    )),
                    Err(e) => Some(format!("heartbeat of {}: {e}", node_id(i))),
                };
                let latency = due.elapsed();
                self.lag_us[t].store(
                    u64::try_from(latency.as_micros()).unwrap_or(u64::MAX),
                    Ordering::Relaxed,
                );
                samples.push(Sample {
                    due,
                    latency,
                    error,
                    node: i,
                    bytes,
                });
            },
        );
        samples
    }

    fn request(&self, i: usize) -> Result<Vec<u8>, String> {
        let body = {
            let node = lock(&self.state[i]);
            // Running and ready, each at an address of the node's subnet
            // that stays the same as jails come and go.
            let placed: Vec<PlacedJail> = lock(&self.jails[i])
                .iter()
                .map(|(name, epoch)| PlacedJail {
                    name: name.clone(),
                    epoch: *epoch,
                    running: true,
                    ready: Some(true),
                    address: node
                        .subnet
                        .map(|s| Ipv4Addr::from(u32::from(s) + 2 + host_of(name))),
                })
                .collect();
            let jails = placed.len() as u64;
            serde_json::to_vec(&HeartbeatRequest {
                committed: Resources {
                    cpu: jails as f64 * JAIL_CPU,
                    memory: jails * JAIL_MEMORY,
                },
                jails: u32::try_from(jails).unwrap_or(u32::MAX),
                placed,
                peers_version: node.peers_version,
                // The proxy applied every table it was given at once.
                endpoints_generation: node.endpoints.map(|s| s.generation),
                connections: Vec::new(),
                peer_changes: true,
                endpoints_held: node.endpoints,
                events_seq: Some(0),
                endpoint_changes: true,
            })
            .map_err(|e| e.to_string())?
        };
        let path = format!("/nodes/{}/heartbeat", node_id(i));
        signed(
            &self.signer,
            "POST",
            &path,
            self.addr,
            "application/json",
            &body,
        )
    }

    /// Takes in an answer as `PeerCache::absorb`, `EndpointCache::absorb`
    /// and the fence (stale jails deleted) do.
    fn absorb(&self, i: usize, body: &[u8]) -> Result<(), String> {
        let a: AnswerHead = serde_json::from_slice(&without_peers(body))
            .map_err(|e| format!("heartbeat answer of {}: {e}", node_id(i)))?;
        {
            let mut node = lock(&self.state[i]);
            node.peers_version = if a.peers_unchanged {
                node.peers_version.filter(|v| Some(*v) == a.peers_version)
            } else if let Some(since) = a.peers_changed {
                a.peers_version
                    .filter(|_| node.peers_version == Some(since))
            } else {
                a.peers_version
            };
            let stamp = a
                .endpoints_origin
                .zip(a.endpoints_generation)
                .map(|(origin, generation)| EndpointsStamp { origin, generation });
            node.endpoints = if a.endpoints_unchanged {
                node.endpoints.filter(|held| Some(*held) == stamp)
            } else if let Some(since) = a.services_changed {
                stamp.filter(|s| {
                    node.endpoints
                        .is_some_and(|h| h.origin == s.origin && h.generation == since)
                })
            } else {
                stamp
            };
        }
        // The agent deletes what the control plane fenced.
        lock(&self.jails[i]).retain(|name, _| !a.stale.contains(name));
        let silent = self.silent.load(Ordering::Relaxed);
        if a.peers_changed.is_some()
            && silent != usize::MAX
            && !self.beating[silent].load(Ordering::Relaxed)
            && lock(&self.death_seen).is_none()
        {
            let id = node_id(silent);
            let full: HeartbeatResponse = serde_json::from_slice(body)
                .map_err(|e| format!("heartbeat answer of {}: {e}", node_id(i)))?;
            let dead = a.peers_removed.contains(&id)
                || full.peers.iter().any(|p| p.node_id == id && !p.alive);
            if dead {
                lock(&self.death_seen).get_or_insert_with(Instant::now);
            }
        }
        Ok(())
    }
}

/// A heartbeat answer without its peer list, which is read only for a
/// death: a full list of 10,000 peers is about 900 KB, and reading 10,000 of
/// them in the first period on the control plane's two cores made the
/// bench, not the control plane, late enough for nodes to die. No peer
/// entry holds a `]` (ids, addresses and subnets), so the first one ends
/// the list. Anything else is returned whole.
fn without_peers(body: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    const HEAD: &[u8] = br#"{"peers":["#;
    let Some(rest) = body.strip_prefix(HEAD) else {
        return body.into();
    };
    let Some(end) = rest.iter().position(|b| *b == b']') else {
        return body.into();
    };
    let after = &rest[end + 1..];
    let after = after.strip_prefix(b",").unwrap_or(after);
    let mut out = b"{".to_vec();
    out.extend_from_slice(after);
    out.into()
}

/// A jail's host number in its node's /24, from its name: 0..250.
fn host_of(name: &str) -> u32 {
    // FNV-1a: stable across runs, unlike the std hasher.
    let h = name.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    h % 250
}

/// Whether `name` is held by a node other than `except`.
fn held_elsewhere(jails: &[Mutex<BTreeMap<String, u64>>], name: &str, except: usize) -> bool {
    jails
        .iter()
        .enumerate()
        .any(|(k, m)| k != except && lock(m).contains_key(name))
}

/// One target's figure and verdict.
struct Target {
    what: String,
    met: bool,
}

/// p99 and max of byte counts.
fn bytes_p99_max(samples: &[&Sample]) -> (usize, usize) {
    let mut v: Vec<usize> = samples.iter().map(|s| s.bytes).collect();
    if v.is_empty() {
        return (0, 0);
    }
    v.sort_unstable();
    let i = ((0.99 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    (v[i], v[v.len() - 1])
}

fn service_apply(name: &str) -> ServiceApply {
    ServiceApply {
        document: format!(
            "kind: Service\nmetadata:\n  name: {name}\nspec:\n  replicas: {REPLICAS}\n  port: 8080\n  template:\n    base: 14.2-RELEASE\n    resources:\n      cpu: {JAIL_CPU}\n      memory: {JAIL_MEMORY}\n    exec:\n      start: [\"/usr/local/bin/{name}\"]\n"
        ),
        replicas: REPLICAS,
        port: 8080,
        stateful: false,
        template_digest: format!("{:064x}", name.len()),
        volumes: Vec::new(),
        policy: Default::default(),
        // As keelctl states it from the template's resources.
        resources: Some(ReplicaRequest {
            cpu_millicores: (JAIL_CPU * 1000.0).round() as u64,
            memory: JAIL_MEMORY,
        }),
    }
}

/// Waits until `done` holds, checking every [`RESOLVE_EVERY`], at most
/// [`SETTLE_DEADLINE`].
fn settle(what: &str, mut done: impl FnMut() -> Result<bool, String>) -> Result<Duration, String> {
    let since = Instant::now();
    loop {
        if done()? {
            return Ok(since.elapsed());
        }
        if since.elapsed() > SETTLE_DEADLINE {
            return Err(format!("{what}: not within {}s", SETTLE_DEADLINE.as_secs()));
        }
        std::thread::sleep(RESOLVE_EVERY);
    }
}

/// One realistic run with `nodes` nodes; returns its targets.
fn realistic(binary: &Path, nodes: usize) -> Result<Vec<Target>, String> {
    let services: usize = env_or("KEEL_BENCH_SERVICES", DEFAULT_SERVICES);
    let window_len = Duration::from_secs(env_or("KEEL_BENCH_WINDOW", DEFAULT_WINDOW_SECS));
    let rate = nodes as f64 / HEARTBEAT_PERIOD.as_secs_f64();
    println!(
        "\n== realistic: {nodes} nodes heartbeating every {}s ({rate:.0}/s) with their replicas, {services} services x {REPLICAS}, then one node joins and one stops (--dead-after {}s)",
        HEARTBEAT_PERIOD.as_secs(),
        DEAD_AFTER.as_secs()
    );
    // One simulated agent per node, the one that joins included.
    let agents = Agents::per_node(nodes + 1)?;
    let dead_after = format!("{}s", DEAD_AFTER.as_secs());
    let cp = ControlPlane::start(binary, &["--dead-after", &dead_after])?;
    let (pid, addr) = (cp.pid(), cp.addr);
    let node_key = cp.key("node.key")?;
    let operator_key = cp.key("operator.key")?;

    // Baseline: /healthz at the heartbeat rate.
    let healthz_window = HEALTHZ_WINDOW.min(window_len);
    eprintln!(
        "baseline: GET /healthz at {rate:.0}/s for {}s",
        healthz_window.as_secs()
    );
    let healthz = Running::start(
        PacedLoad {
            kind: Paced::Healthz,
            addr,
            nodes,
            signer: node_key.clone(),
            placed: Arc::new(Vec::new()),
            versions: Vec::new(),
            period: HEARTBEAT_PERIOD,
            start: Instant::now(),
            stop: AtomicBool::new(false),
        },
        HEARTBEAT_CLIENTS,
    );
    let (cpu0, hz0) = (cpu_seconds(pid), Instant::now());
    std::thread::sleep(healthz_window);
    let healthz_usage = usage_between(pid, cpu0, hz0);
    let healthz_samples = healthz.finish();
    let healthz_out = window(&healthz_samples, hz0, hz0 + healthz_window);
    healthz_out.check("GET /healthz")?;
    let healthz_rate =
        answered(&healthz_samples, hz0, hz0 + healthz_window) as f64 / healthz_window.as_secs_f64();

    // Registrations of every node but the one that joins later.
    let joiner = nodes;
    let fleet = Arc::new(Fleet {
        addr,
        signer: node_key.clone(),
        nodes: nodes + 1,
        period: HEARTBEAT_PERIOD,
        start: Instant::now(),
        stop: AtomicBool::new(false),
        state: (0..=nodes)
            .map(|_| Mutex::new(SimNode::default()))
            .collect(),
        jails: Arc::clone(&agents.jails),
        beating: (0..=nodes).map(|i| AtomicBool::new(i != joiner)).collect(),
        silent: AtomicUsize::new(usize::MAX),
        death_seen: Mutex::new(None),
        lag_us: (0..HEARTBEAT_CLIENTS)
            .map(|_| AtomicU64::new(u64::MAX))
            .collect(),
    });
    let advertise = agents.addrs.clone();
    let make_register = |i: usize| {
        let body = serde_json::to_vec(&RegisterRequest {
            node_id: node_id(i),
            advertise_addr: advertise[i],
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
    let registered = |i: usize, r: &ClientResponse| -> Result<(), String> {
        if r.status != 200 {
            return Err(format!(
                "{}: {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            ));
        }
        let answer: RegisterResponse =
            serde_json::from_slice(&r.body).map_err(|e| format!("registration answer: {e}"))?;
        let subnet = answer
            .pod_cidr
            .split('/')
            .next()
            .and_then(|a| a.parse::<Ipv4Addr>().ok())
            .ok_or_else(|| format!("pod_cidr {:?} is not IPv4/len", answer.pod_cidr))?;
        lock(&fleet.state[i]).subnet = Some(subnet);
        Ok(())
    };
    eprintln!("registering {nodes} nodes");
    let (register_out, register_wall) =
        closed_loop(addr, APPLY_CLIENTS, nodes, &make_register, &registered);
    register_out.check("POST /nodes/register")?;

    // Heartbeats from now to the end; one period for the first (full) ones.
    let threads: Vec<_> = (0..HEARTBEAT_CLIENTS)
        .map(|t| {
            let fleet = Arc::clone(&fleet);
            std::thread::spawn(move || fleet.run(t, HEARTBEAT_CLIENTS))
        })
        .collect();
    let finish = |threads: Vec<std::thread::JoinHandle<Vec<Sample>>>| {
        fleet.stop.store(true, Ordering::Relaxed);
        threads
            .into_iter()
            .filter_map(|t| t.join().ok())
            .flatten()
            .collect::<Vec<Sample>>()
    };
    std::thread::sleep(HEARTBEAT_PERIOD);

    // Services, while the heartbeats go on.
    eprintln!("creating {services} services x {REPLICAS} replicas");
    let make_service = |i: usize| {
        let name = format!("svc-{i:04}");
        let body = serde_json::to_vec(&service_apply(&name)).map_err(|e| e.to_string())?;
        signed(
            &operator_key,
            "PUT",
            &format!("/services/{name}"),
            addr,
            "application/json",
            &body,
        )
    };
    let ok_200 = |_: usize, r: &ClientResponse| match r.status {
        200..=299 => Ok(()),
        s => Err(format!("{s}: {}", String::from_utf8_lossy(&r.body))),
    };
    let (service_out, service_wall) =
        closed_loop(addr, APPLY_CLIENTS, services, &make_service, &ok_200);
    if let Err(e) = service_out.check("PUT /services/NAME") {
        drop(finish(threads));
        return Err(e);
    }
    let replicas = services * REPLICAS as usize;
    // Two periods for the reports to reach the endpoint table and every
    // node to be given it.
    std::thread::sleep(2 * HEARTBEAT_PERIOD);
    let with_replicas = fleet.jails.iter().filter(|m| !lock(m).is_empty()).count();
    let mut busiest: Vec<(usize, usize)> = (0..nodes)
        .map(|i| (lock(&fleet.jails[i]).len(), i))
        .filter(|(n, _)| *n > 0)
        .collect();
    busiest.sort_unstable_by(|a, b| b.cmp(a));
    eprintln!(
        "busiest nodes (replicas, node): {:?}",
        &busiest[..busiest.len().min(8)]
    );

    // The first full lists and tables can leave the clients behind their
    // schedule for longer (at 10,000 nodes): the steady window starts one
    // period after every client is on time again.
    if let Err(e) = settle("heartbeats back on schedule", || {
        Ok(fleet.on_schedule(ON_SCHEDULE))
    }) {
        drop(finish(threads));
        return Err(e);
    }
    std::thread::sleep(HEARTBEAT_PERIOD);

    // The steady window.
    eprintln!("steady window: {}s", window_len.as_secs());
    let (cpu0, s0) = (cpu_seconds(pid), Instant::now());
    std::thread::sleep(window_len);
    let steady_usage = usage_between(pid, cpu0, s0);
    let s1 = Instant::now();
    let steady_rss = proc_status(pid, "VmRSS");

    // One node stops; one joins.
    // The worst case for the heal: the node holding the most replicas.
    let silent = (0..nodes)
        .max_by_key(|i| (lock(&fleet.jails[*i]).len(), std::cmp::Reverse(*i)))
        .filter(|i| !lock(&fleet.jails[*i]).is_empty())
        .ok_or("no node holds a replica")?;
    let silent_replicas: Vec<String> = lock(&fleet.jails[silent]).keys().cloned().collect();
    fleet.silent.store(silent, Ordering::Relaxed);
    fleet.beating[silent].store(false, Ordering::Relaxed);
    let silenced = Instant::now();
    eprintln!(
        "{} stops heartbeating ({} replicas), {} joins",
        node_id(silent),
        silent_replicas.len(),
        node_id(joiner)
    );
    let mut join_conn = KeepAlive::new(addr);
    let join = make_register(joiner)
        .and_then(|wire| join_conn.exchange(&wire))
        .and_then(|r| registered(joiner, &r));
    if let Err(e) = join {
        drop(finish(threads));
        return Err(format!("registering {}: {e}", node_id(joiner)));
    }
    let t0 = Instant::now();
    fleet.beating[joiner].store(true, Ordering::Relaxed);

    // The death, then the heal: every replica of the silent node reported
    // by another one.
    let waited = settle("an answer naming the silent node dead", || {
        Ok(lock(&fleet.death_seen).is_some())
    })
    .and_then(|_| {
        settle("the silent node's replicas placed elsewhere", || {
            Ok(silent_replicas
                .iter()
                .all(|r| held_elsewhere(&fleet.jails, r, silent)))
        })
    });
    if let Err(e) = waited {
        drop(finish(threads));
        return Err(e);
    }
    let td = lock(&fleet.death_seen).unwrap_or_else(Instant::now);
    let healed_at = Instant::now();
    // A whole period after the death and after the heal, so every node
    // heartbeats once after each.
    let end = (td.max(healed_at) + HEARTBEAT_PERIOD).max(t0 + HEARTBEAT_PERIOD);
    std::thread::sleep(end.saturating_duration_since(Instant::now()) + Duration::from_millis(500));
    let samples = finish(threads);
    let rss_end = proc_status(pid, "VmRSS");

    // Figures.
    let steady = window(&samples, s0, s1);
    steady.check("steady heartbeats")?;
    let in_window = |from: Instant, to: Instant, skip: usize| -> Vec<&Sample> {
        samples
            .iter()
            .filter(|s| s.due >= from && s.due < to && s.node != skip)
            .collect()
    };
    let outcome_of = |picked: &[&Sample]| {
        let mut out = Outcome::default();
        for s in picked {
            match &s.error {
                None => out.latencies.push(s.latency),
                Some(e) => out.failed(e.clone()),
            }
        }
        out
    };
    let after_join = in_window(t0, t0 + HEARTBEAT_PERIOD, joiner);
    let joiner_first = samples
        .iter()
        .filter(|s| s.node == joiner)
        .min_by_key(|s| s.due)
        .map_or(0, |s| s.bytes);
    let after_death = in_window(td, td + HEARTBEAT_PERIOD, usize::MAX);
    let after_heal = in_window(healed_at, healed_at + HEARTBEAT_PERIOD, usize::MAX);
    let join_out = outcome_of(&after_join);
    let death_out = outcome_of(&after_death);
    join_out.check("heartbeats after the join")?;
    death_out.check("heartbeats after the death")?;
    let (_, steady_p99) = steady.percentiles();
    let (hz50, hz99) = healthz_out.percentiles();
    let (st50, _) = steady.percentiles();
    let (jn50, jn99) = join_out.percentiles();
    let (de50, de99) = death_out.percentiles();
    let steady_bytes = bytes_p99_max(&in_window(s0, s1, usize::MAX));
    let (join_b99, join_bmax) = bytes_p99_max(&after_join);
    let death_bytes = bytes_p99_max(&after_death);
    let heal_bytes = bytes_p99_max(&after_heal);
    let steady_rate = answered(&samples, s0, s1) as f64 / (s1 - s0).as_secs_f64();
    if let Ok(path) = std::env::var("KEEL_BENCH_TRACE") {
        write_trace(&path, &samples, s0, td)?;
    }

    println!(
        "registration: {nodes} nodes in {:.2} s; {services} services in {:.2} s ({:.0}/s); {with_replicas} nodes hold the {replicas} replicas",
        register_wall.as_secs_f64(),
        service_wall.as_secs_f64(),
        services as f64 / service_wall.as_secs_f64()
    );
    println!(
        "{:<48} {:>9} {:>9} {:>9} {:>11} {:>11}",
        "paced, 1 keep-alive conn per client thread",
        "req/s",
        "p50 ms",
        "p99 ms",
        "CPU % core",
        "answer p99/max B"
    );
    println!(
        "{:<48} {:>9.0} {:>9.3} {:>9.3} {:>11.1}",
        "GET /healthz (baseline)", healthz_rate, hz50, hz99, healthz_usage.cpu_percent
    );
    println!(
        "{:<48} {:>9.0} {:>9.3} {:>9.3} {:>11.1} {:>6}/{}",
        format!("heartbeat, steady ({}s)", (s1 - s0).as_secs()),
        steady_rate,
        st50,
        steady_p99,
        steady_usage.cpu_percent,
        steady_bytes.0,
        steady_bytes.1
    );
    println!(
        "{:<48} {:>9} {:>9.3} {:>9.3} {:>11} {:>6}/{}",
        "heartbeat, one period after the join",
        after_join.len(),
        jn50,
        jn99,
        "-",
        join_b99,
        join_bmax
    );
    println!(
        "{:<48} {:>9} {:>9.3} {:>9.3} {:>11} {:>6}/{}",
        "heartbeat, one period after the death",
        after_death.len(),
        de50,
        de99,
        "-",
        death_bytes.0,
        death_bytes.1
    );
    println!(
        "{:<48} {:>9} {:>9} {:>9} {:>11} {:>6}/{}",
        "heartbeat, one period after the heal",
        after_heal.len(),
        "",
        "",
        "-",
        heal_bytes.0,
        heal_bytes.1
    );
    println!(
        "the new node's first answer: {joiner_first} B; {} declared dead {:.1} s after its silence, its {} replicas reported elsewhere {:.1} s after that; heartbeat / healthz p50 x{:.1}, CPU x{:.1}; VmRSS {} steady, {} at the end",
        node_id(silent),
        td.saturating_duration_since(silenced).as_secs_f64(),
        silent_replicas.len(),
        healed_at.saturating_duration_since(td).as_secs_f64(),
        st50 / hz50,
        steady_usage.cpu_percent / healthz_usage.cpu_percent,
        mib(steady_rss),
        mib(rss_end)
    );

    let mut targets = Vec::new();
    // A window that answered more or fewer heartbeats than scheduled was
    // catching up or falling behind: its figures do not stand for a
    // steady state, and no ratio to them counts.
    targets.push(Target {
        what: format!(
            "{nodes} nodes: the steady window kept to the schedule: {steady_rate:.0} answers/s for {rate:.0} due (within {:.0} %)",
            STEADY_RATE_TOLERANCE * 100.0
        ),
        met: (steady_rate / rate - 1.0).abs() <= STEADY_RATE_TOLERANCE,
    });
    if rate <= CPU_TARGET_RATE {
        targets.push(Target {
            what: format!(
                "{nodes} nodes: control plane CPU at {rate:.0} heartbeats/s with {services} services {:.1} % of one core (< {CPU_TARGET_PERCENT:.0} %; {:.1} CPU-s in {:.1} s)",
                steady_usage.cpu_percent,
                steady_usage.cpu_seconds,
                steady_usage.wall.as_secs_f64()
            ),
            met: steady_usage.cpu_percent < CPU_TARGET_PERCENT,
        });
    }
    targets.push(Target {
        what: format!(
            "{nodes} nodes: answer bytes in the period after the join, every node but the new one: p99 {join_b99} B, max {join_bmax} B (< {ANSWER_TARGET_BYTES} B)"
        ),
        met: join_bmax < ANSWER_TARGET_BYTES && !after_join.is_empty(),
    });
    for (what, p99) in [("join", jn99), ("death", de99)] {
        targets.push(Target {
            what: format!(
                "{nodes} nodes: heartbeat p99 in the period after the {what} {p99:.3} ms, x{:.2} the steady p99 {steady_p99:.3} ms (<= x{P99_RATIO_TARGET:.0})",
                p99 / steady_p99
            ),
            met: p99 <= P99_RATIO_TARGET * steady_p99,
        });
    }
    drop(cp);
    drop(agents);
    Ok(targets)
}

/// `KEEL_BENCH_TRACE=path`: every heartbeat sample as CSV (seconds since
/// the steady window's start and since the death, latency in ms, answer
/// bytes, node), to see whether a period's slow answers come together (a
/// stall) or spread out (load).
fn write_trace(path: &str, samples: &[Sample], s0: Instant, td: Instant) -> Result<(), String> {
    let since = |from: Instant, t: Instant| {
        t.saturating_duration_since(from).as_secs_f64()
            - from.saturating_duration_since(t).as_secs_f64()
    };
    let mut out = String::from("since_steady_s,since_death_s,latency_ms,bytes,node\n");
    for s in samples.iter().filter(|s| s.error.is_none()) {
        out.push_str(&format!(
            "{:.6},{:.6},{:.3},{},{}\n",
            since(s0, s.due),
            since(td, s.due),
            s.latency.as_secs_f64() * 1e3,
            s.bytes,
            s.node
        ));
    }
    std::fs::write(path, out).map_err(|e| format!("KEEL_BENCH_TRACE {path}: {e}"))
}

/// The realistic mode at every size asked for; false when a target was
/// missed.
fn realistic_sizes() -> Result<bool, String> {
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_keel-controlplane"));
    let sizes: Vec<usize> = match std::env::var("KEEL_BENCH_NODES") {
        Ok(v) => v
            .split(',')
            .map(|n| {
                n.trim()
                    .parse()
                    .map_err(|e| format!("KEEL_BENCH_NODES {v:?}: {e}"))
            })
            .collect::<Result<_, _>>()?,
        Err(_) => DEFAULT_SIZES.to_vec(),
    };
    println!(
        "controlplane benchmark, realistic mode: {} --simulate, sizes {sizes:?}",
        binary.display()
    );
    let mut all = Vec::new();
    for n in sizes {
        // A size that cannot be run through is a missed target; the next
        // size still runs.
        match realistic(&binary, n) {
            Ok(targets) => all.extend(targets),
            Err(e) => all.push(Target {
                what: format!("{n} nodes: the run did not complete: {e}"),
                met: false,
            }),
        }
    }
    println!();
    for t in &all {
        println!("target {}: {}", t.what, verdict(t.met));
    }
    Ok(all.iter().all(|t| t.met))
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; nothing here takes arguments.
    let outcome = match std::env::var("KEEL_BENCH_MODE").as_deref() {
        Ok("plain") => plain().map(|()| true),
        Ok("backends") => backends(),
        Ok("realistic") | Err(_) => realistic_sizes(),
        Ok(other) => Err(format!(
            "KEEL_BENCH_MODE {other:?}: use realistic (the default), plain or backends"
        )),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("controlplane bench: a target was missed");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("controlplane bench: {e}");
            ExitCode::FAILURE
        }
    }
}
