//! Benchmark: how long the control plane takes to replace every replica a
//! lost node held, when that is a thousand of them.
//!
//! Starts the release `keel-controlplane --simulate` (heartbeat 1 s,
//! `dead_after` 3 s, so the measure is the healing and not the lease) and
//! ten simulated agents inside this process: each its own `common::http`
//! listener that answers `PUT` and `DELETE /jails/{name}` with 200 and keeps
//! the jails it was given, and a heartbeat thread that reports them every
//! second, running and ready, the way an agent reports its placed jails.
//! It creates `KEEL_BENCH_SERVICES` services (default 3,334) of three
//! replicas each through `PUT /services/{name}` (the `ServiceApply` keelctl
//! sends), about 1,000 replicas per node, and waits until every service has
//! its three ready replicas. Then:
//!
//! 1. baseline, in the same run: as many `PUT /jails/{name}` as the victim
//!    holds, sent straight to one simulated agent from 32 concurrent
//!    clients (the transport's and the agents' own cost of the same number
//!    of placements);
//! 2. the node holding the most replicas stops heartbeating (its listener
//!    keeps answering, as a partitioned node's would not matter here: the
//!    control plane never sends a lost node anything);
//! 3. measured from the lease's expiry: when `GET /nodes` shows it Dead,
//!    when the other agents have
//!    received a replacement for every replica it held (their PUT counts),
//!    and when `GET /services` shows every service with three ready
//!    replicas and none on the lost node (the replacements reported by the
//!    next heartbeats).
//!
//! Target (bench/README.md): every replica replaced and ready within 30 s
//! of the lost node's lease expiry (its last heartbeat sent plus
//! `dead_after`: an upper bound, since the lease began on receipt). The bench prints the replacement rate
//! against the baseline's and exits non-zero when the target is missed, a
//! daemon cannot be started, or a request fails. It kills the control plane
//! it started on every path (by its `Child`) and signals no other process.
//!
//! Run with `cargo bench --bench heal`; `KEEL_BENCH_SERVICES=334` (about 100
//! replicas a node) is a quick mode of under a minute.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use keel::common::auth::Signer;
use keel::common::http::{Request, Response, Server, ShutdownSignal};
use keel::common::spec;
use keel::common::sync::lock;
use keel::common::wire::{
    COMMITTED_HEADER, EPOCH_HEADER, HeartbeatRequest, Liveness, NodeStatus, PlacedJail,
    RegisterRequest, Resources, ServiceStatus, format_committed,
};

#[path = "../tests/util/load.rs"]
mod load;
use load::{ControlPlane, KeepAlive, encode, node_id, signed, stand_in_limits};

/// Simulated nodes.
const NODES: usize = 10;
/// Services of three replicas: 3,334 of them put about 1,000 on each node.
const DEFAULT_SERVICES: usize = 3334;
const REPLICAS: u32 = 3;
/// Heartbeat period of the simulated agents and the control plane.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// The control plane's `dead_after`.
const DEAD_AFTER: Duration = Duration::from_secs(3);
/// Concurrent clients creating services, and of the baseline.
const CLIENTS: usize = 32;
/// Longest wait for the cluster to settle (all replicas ready) or heal.
const SETTLE_DEADLINE: Duration = Duration::from_secs(600);
/// The target: all replaced and ready within this of the node's death.
const HEAL_TARGET: Duration = Duration::from_secs(30);
/// Node sizes: roomy enough for every replica the services ask for.
const NODE_CPU: f64 = 4096.0;
const NODE_MEMORY: u64 = 16 << 40;
/// What each replica's template requests: the scheduler spreads replicas
/// by the headroom the agents report (in each apply's answer and in
/// heartbeats).
const JAIL_CPU: f64 = 0.25;
const JAIL_MEMORY: u64 = 64 << 20;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// ------------------------------------------------------- the control plane

/// A signed operator `GET`, decoded.
fn get<T: serde::de::DeserializeOwned>(
    cp: &ControlPlane,
    conn: &mut KeepAlive,
    operator: &Signer,
    path: &str,
) -> Result<T, String> {
    let wire = signed(operator, "GET", path, cp.addr, "application/json", b"")?;
    let r = conn.exchange(&wire)?;
    if r.status != 200 {
        return Err(format!(
            "GET {path}: {}: {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        ));
    }
    serde_json::from_slice(&r.body).map_err(|e| format!("GET {path}: {e}"))
}

// ------------------------------------------------------ simulated agents

/// One simulated node: a listener that keeps the jails it is given, and
/// the jails, for its heartbeats.
struct Node {
    id: String,
    addr: SocketAddr,
    jails: Arc<Mutex<BTreeMap<String, Held>>>,
    puts: Arc<AtomicU64>,
}

/// A jail a simulated node was given: its epoch, and the address it got
/// (a replica is ready only with one; each node hands out its own).
#[derive(Clone, Copy)]
struct Held {
    epoch: u64,
    address: Ipv4Addr,
}

/// The simulated nodes' listeners; stopped on drop.
struct Nodes {
    nodes: Vec<Node>,
    shutdown: ShutdownSignal,
    threads: Vec<JoinHandle<()>>,
}

impl Nodes {
    fn start(count: usize) -> Result<Nodes, String> {
        let shutdown = ShutdownSignal::new();
        let limits = stand_in_limits();
        let mut nodes = Vec::new();
        let mut threads = Vec::new();
        for i in 0..count {
            let jails: Arc<Mutex<BTreeMap<String, Held>>> = Arc::default();
            let puts = Arc::new(AtomicU64::new(0));
            let subnet = 10 + i as u8;
            let (kept, counted) = (Arc::clone(&jails), Arc::clone(&puts));
            let handler = move |req: Request| -> Response {
                let epoch = req
                    .header(EPOCH_HEADER)
                    .and_then(|e| e.parse().ok())
                    .unwrap_or(0);
                match (req.method.as_str(), req.segments().as_slice()) {
                    ("PUT", ["jails", name]) => {
                        let n = counted.fetch_add(1, Ordering::Relaxed);
                        let address =
                            Ipv4Addr::new(10, subnet, (n / 250 % 256) as u8, (n % 250) as u8 + 2);
                        let held = {
                            let mut jails = lock(&kept);
                            jails.insert(name.to_string(), Held { epoch, address });
                            jails.len()
                        };
                        // As a real agent does: what its jails commit now,
                        // so the control plane ranks it before its next
                        // heartbeat.
                        Response::json(
                            200,
                            &serde_json::json!({ "name": name, "state": "Running" }),
                        )
                        .with_header(COMMITTED_HEADER, &format_committed(&committed(held)))
                    }
                    ("DELETE", ["jails", name]) => {
                        lock(&kept).remove(*name);
                        Response::json(200, &serde_json::json!({ "deleted": name }))
                    }
                    _ => Response::error(404, "simulated agent: PUT and DELETE /jails/NAME", None),
                }
            };
            let server = Server::new(Arc::new(handler), limits.clone(), shutdown.clone());
            let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            let addr = listener.local_addr().map_err(|e| e.to_string())?;
            threads.push(server.serve_tcp(listener).map_err(|e| e.to_string())?);
            nodes.push(Node {
                id: node_id(i),
                addr,
                jails,
                puts,
            });
        }
        Ok(Nodes {
            nodes,
            shutdown,
            threads,
        })
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        self.shutdown.trigger();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// What `jails` replicas commit of a node.
fn committed(jails: usize) -> Resources {
    Resources {
        cpu: JAIL_CPU * jails as f64,
        memory: JAIL_MEMORY * jails as u64,
    }
}

/// What node `node` reports: every jail it was given, running and ready,
/// with its address.
fn heartbeat_body(node: &Node) -> Result<Vec<u8>, String> {
    let jails = lock(&node.jails);
    let placed: Vec<PlacedJail> = jails
        .iter()
        .map(|(name, held)| PlacedJail {
            name: name.clone(),
            epoch: held.epoch,
            running: true,
            ready: Some(true),
            address: Some(held.address),
        })
        .collect();
    let request = HeartbeatRequest {
        committed: committed(placed.len()),
        jails: placed.len() as u32,
        placed,
        peers_version: None,
        endpoints_generation: None,
        connections: Vec::new(),
        peer_changes: true,
        endpoint_changes: false,
        endpoints_held: None,
        events_seq: None,
    };
    serde_json::to_vec(&request).map_err(|e| e.to_string())
}

/// Every node heartbeats each [`HEARTBEAT`] on its own thread while its
/// flag is up; the threads end when `stop` is set.
struct Heartbeats {
    alive: Vec<Arc<AtomicBool>>,
    /// When each node last sent a heartbeat.
    last_sent: Vec<Arc<Mutex<Option<Instant>>>>,
    stop: Arc<AtomicBool>,
    errors: Arc<AtomicUsize>,
    threads: Vec<JoinHandle<()>>,
}

impl Heartbeats {
    fn start(nodes: &Arc<Nodes>, cp: SocketAddr, key: &Signer) -> Heartbeats {
        let stop = Arc::new(AtomicBool::new(false));
        let errors = Arc::new(AtomicUsize::new(0));
        let mut alive = Vec::new();
        let mut last_sent = Vec::new();
        let mut threads = Vec::new();
        for i in 0..nodes.nodes.len() {
            let flag = Arc::new(AtomicBool::new(true));
            alive.push(Arc::clone(&flag));
            let sent_at: Arc<Mutex<Option<Instant>>> = Arc::default();
            last_sent.push(Arc::clone(&sent_at));
            let (nodes, stop, errors, key) = (
                Arc::clone(nodes),
                Arc::clone(&stop),
                Arc::clone(&errors),
                key.clone(),
            );
            threads.push(std::thread::spawn(move || {
                let node = &nodes.nodes[i];
                let path = format!("/nodes/{}/heartbeat", node.id);
                let mut conn = KeepAlive::new(cp);
                while !stop.load(Ordering::Relaxed) {
                    let next = Instant::now() + HEARTBEAT;
                    if flag.load(Ordering::Relaxed) {
                        *lock(&sent_at) = Some(Instant::now());
                        let sent = heartbeat_body(node)
                            .and_then(|b| signed(&key, "POST", &path, cp, "application/json", &b))
                            .and_then(|wire| conn.exchange(&wire));
                        if !matches!(sent, Ok(ref r) if r.status == 200) {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    std::thread::sleep(next.saturating_duration_since(Instant::now()));
                }
            }));
        }
        Heartbeats {
            alive,
            last_sent,
            stop,
            errors,
            threads,
        }
    }
}

impl Drop for Heartbeats {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

// ------------------------------------------------------------------ steps

fn service_body(name: &str, port: u16) -> Result<Vec<u8>, String> {
    let yaml = format!(
        "kind: Service\nmetadata: {{name: {name}}}\nspec:\n  replicas: {REPLICAS}\n  port: {port}\n  template:\n    base: 14.2-RELEASE\n    resources: {{cpu: {JAIL_CPU}, memory: {JAIL_MEMORY}}}\n    exec:\n      start: [/bin/sleep, \"3600\"]\n"
    );
    let service = spec::parse_service(&yaml).map_err(|e| e.to_string())?;
    serde_json::to_vec(&keel::ctl::api::service_apply(&service)).map_err(|e| e.to_string())
}

/// `total` requests from [`CLIENTS`] threads on keep-alive connections to
/// `addr`, `make(i)` building request `i`; the first failure, if any.
fn closed_loop(
    addr: SocketAddr,
    total: usize,
    make: &(dyn Fn(usize) -> Result<Vec<u8>, String> + Sync),
) -> Result<Duration, String> {
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let failure: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..CLIENTS {
            s.spawn(|| {
                let mut conn = KeepAlive::new(addr);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total || lock(&failure).is_some() {
                        return;
                    }
                    match make(i).and_then(|wire| conn.exchange(&wire)) {
                        Ok(r) if (200..300).contains(&r.status) => {}
                        Ok(r) => {
                            lock(&failure).get_or_insert(format!(
                                "request {i}: {}: {}",
                                r.status,
                                String::from_utf8_lossy(&r.body)
                            ));
                        }
                        Err(e) => {
                            lock(&failure).get_or_insert(format!("request {i}: {e}"));
                        }
                    }
                }
            });
        }
    });
    match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(started.elapsed()),
    }
}

/// Waits until `done` says so, polling every 200 ms, at most `limit`.
fn wait_until(
    what: &str,
    limit: Duration,
    mut done: impl FnMut() -> Result<bool, String>,
) -> Result<Instant, String> {
    let deadline = Instant::now() + limit;
    loop {
        if done()? {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            return Err(format!("{what}: not within {}s", limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every service has its replicas ready, none on `lost`.
fn all_ready(services: &[ServiceStatus], expected: usize, lost: Option<&str>) -> bool {
    services.len() == expected
        && services.iter().all(|s| {
            s.ready == REPLICAS
                && s.replicas
                    .iter()
                    .filter(|r| r.ready && Some(r.node.as_str()) != lost)
                    .count()
                    == REPLICAS as usize
        })
}

fn run() -> Result<bool, String> {
    let services: usize = env_or("KEEL_BENCH_SERVICES", DEFAULT_SERVICES);
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_keel-controlplane"));
    let heartbeat = format!("{}ms", HEARTBEAT.as_millis());
    let dead_after = format!("{}s", DEAD_AFTER.as_secs());
    let cp = ControlPlane::start(
        &binary,
        &[
            "--heartbeat-interval",
            &heartbeat,
            "--dead-after",
            &dead_after,
        ],
    )?;
    let node_key = cp.key("node.key")?;
    let operator = cp.key("operator.key")?;
    let nodes = Arc::new(Nodes::start(NODES)?);
    let mut conn = KeepAlive::new(cp.addr);

    for node in &nodes.nodes {
        let body = serde_json::to_vec(&RegisterRequest {
            node_id: node.id.clone(),
            advertise_addr: node.addr,
            capacity: Resources {
                cpu: NODE_CPU,
                memory: NODE_MEMORY,
            },
        })
        .map_err(|e| e.to_string())?;
        let wire = signed(
            &node_key,
            "POST",
            "/nodes/register",
            cp.addr,
            "application/json",
            &body,
        )?;
        let r = conn.exchange(&wire)?;
        if r.status != 200 {
            return Err(format!("register {}: {}", node.id, r.status));
        }
    }
    let heartbeats = Heartbeats::start(&nodes, cp.addr, &node_key);
    wait_until("every node Alive", SETTLE_DEADLINE, || {
        let list: Vec<NodeStatus> = get(&cp, &mut conn, &operator, "/nodes")?;
        Ok(list.iter().all(|n| n.status == Liveness::Alive))
    })?;

    eprintln!(
        "creating {services} services of {REPLICAS} replicas on {NODES} nodes ({CLIENTS} clients)"
    );
    let created = closed_loop(cp.addr, services, &|i| {
        let name = format!("svc-{i}");
        let body = service_body(&name, 10_000 + (i % 50_000) as u16)?;
        signed(
            &operator,
            "PUT",
            &format!("/services/{name}"),
            cp.addr,
            "application/json",
            &body,
        )
    })?;
    let placed = services * REPLICAS as usize;
    eprintln!(
        "created in {:.1}s ({:.0} replicas/s); waiting for every replica ready",
        created.as_secs_f64(),
        placed as f64 / created.as_secs_f64()
    );
    wait_until("every replica ready", SETTLE_DEADLINE, || {
        let list: Vec<ServiceStatus> = get(&cp, &mut conn, &operator, "/services")?;
        Ok(all_ready(&list, services, None))
    })
    .map_err(|e| format!("{e}\n{}", cp.log_tail()))?;

    let (victim_index, victim) = nodes
        .nodes
        .iter()
        .enumerate()
        .max_by_key(|(_, n)| lock(&n.jails).len())
        .ok_or("no node")?;
    let lost = lock(&victim.jails).len();

    // 1. Baseline: the same number of placements straight to one agent.
    let target = nodes.nodes[(victim_index + 1) % NODES].addr;
    let baseline = closed_loop(target, lost, &|i| {
        Ok(encode(
            "PUT",
            &format!("/jails/baseline-{i}"),
            target,
            &[],
            b"{}",
        ))
    })?;
    for node in &nodes.nodes {
        lock(&node.jails).retain(|name, _| !name.starts_with("baseline-"));
    }

    // 2. The victim stops heartbeating.
    let puts_each: Vec<u64> = nodes
        .nodes
        .iter()
        .map(|n| n.puts.load(Ordering::Relaxed))
        .collect();
    let puts_before: u64 = puts_each.iter().sum();
    eprintln!(
        "node {} (holding {lost} replicas) stops heartbeating",
        victim.id
    );
    heartbeats.alive[victim_index].store(false, Ordering::Relaxed);
    let silenced = Instant::now();

    // 3. Dead, replaced, ready.
    let dead = wait_until("the node Dead", SETTLE_DEADLINE, || {
        let list: Vec<NodeStatus> = get(&cp, &mut conn, &operator, "/nodes")?;
        Ok(list
            .iter()
            .any(|n| n.node_id == victim.id && n.status == Liveness::Dead))
    })?;
    let mut replaced_at = None;
    let healed = wait_until("every replica replaced and ready", SETTLE_DEADLINE, || {
        if replaced_at.is_none() {
            let puts: u64 = nodes
                .nodes
                .iter()
                .map(|n| n.puts.load(Ordering::Relaxed))
                .sum();
            if puts - puts_before >= lost as u64 {
                replaced_at = Some(Instant::now());
            }
        }
        let list: Vec<ServiceStatus> = get(&cp, &mut conn, &operator, "/services")?;
        Ok(all_ready(&list, services, Some(&victim.id)))
    })?;
    let replaced = replaced_at.unwrap_or(healed);
    // Sent before the control plane received it: the lease it began ran
    // out no earlier than this, so figures from here are upper bounds.
    let expired = lock(&heartbeats.last_sent[victim_index])
        .map(|t| t + DEAD_AFTER)
        .unwrap_or(silenced);
    let heartbeat_errors = heartbeats.errors.load(Ordering::Relaxed);
    drop(heartbeats);

    let spread: Vec<u64> = nodes
        .nodes
        .iter()
        .zip(&puts_each)
        .filter(|(n, _)| n.id != victim.id)
        .map(|(n, before)| n.puts.load(Ordering::Relaxed) - before)
        .collect();
    let secs = |d: Duration| d.as_secs_f64();
    let heal = healed.saturating_duration_since(expired);
    let put_phase = replaced.saturating_duration_since(expired);
    println!(
        "heal of {lost} replicas on {} other nodes, from the lease's expiry (last heartbeat sent + dead_after {}s):",
        NODES - 1,
        DEAD_AFTER.as_secs()
    );
    println!(
        "  GET /nodes shows it Dead  {:6.2} s (polled every 200 ms)",
        secs(dead.saturating_duration_since(expired))
    );
    println!(
        "  all PUTs received         {:6.2} s ({:.0} replacements/s)",
        secs(put_phase),
        lost as f64 / secs(put_phase).max(0.001)
    );
    println!(
        "  all ready                 {:6.2} s (the next heartbeats report them)",
        secs(heal)
    );
    println!(
        "  replacements per surviving node: {} to {}",
        spread.iter().min().unwrap_or(&0),
        spread.iter().max().unwrap_or(&0)
    );
    println!(
        "  baseline: {lost} PUTs straight to one agent, {CLIENTS} clients: {:.2} s ({:.0}/s); heal PUT phase / baseline = {:.1}",
        secs(baseline),
        lost as f64 / secs(baseline).max(0.001),
        secs(put_phase) / secs(baseline).max(0.001)
    );
    if heartbeat_errors > 0 {
        return Err(format!("{heartbeat_errors} heartbeats failed"));
    }
    let met = heal <= HEAL_TARGET;
    println!(
        "target: all {lost} replaced and ready within {}s of the lease's expiry: {:.2}s, {}",
        HEAL_TARGET.as_secs(),
        secs(heal),
        if met { "met" } else { "MISSED" }
    );
    Ok(met)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("heal bench failed: {e}");
            ExitCode::FAILURE
        }
    }
}
