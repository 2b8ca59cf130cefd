//! Benchmark: how long a service takes to get its full replica count back,
//! and how long until a client's traffic reaches the replacement, after a
//! node is lost at a random moment of its heartbeat period; and how many of
//! the client's requests fail meanwhile.
//!
//! Starts the release `keel-controlplane --simulate` and three
//! `keel-agentd --simulate` in a temporary directory with the default
//! heartbeat interval and `dead_after` (nothing overridden: the figure is the
//! one an admin gets), each agent's proxy on its own loopback address. It
//! applies a three-replica service whose replicas are this bench binary
//! itself (`failover replica PORT`: every connection is answered with the
//! replica's name and address, so a client can tell a replacement from the
//! replica it replaces, which keeps the name), waits until all three are
//! ready, and then, per trial:
//!
//! 1. picks a victim node that holds exactly one replica (after a trial the
//!    returned node holds none and another one two), and a client node that
//!    survives; a client sends requests through the client node's proxy
//!    every 10 ms for the whole trial;
//! 2. waits for one of the victim's heartbeats to pass on its way to the
//!    control plane (each agent reaches the control plane through a small
//!    relay in this process, [`HeartbeatTap`], which notes when), and then
//!    for the trial's phase, a random fraction of the heartbeat interval; then `kill -9` of the victim's agent and of every
//!    jail it runs (the simulated host's own `SimJails::remove`), with the
//!    client held between two requests (a connection already relayed to a
//!    replica that dies is lost with any L4 proxy; what the proxy must
//!    cover is every request that starts after the kill);
//! 3. measures from the kill: when `GET /nodes` first shows the node Dead,
//!    when `GET /services/web` shows three ready replicas with none on the
//!    lost node (the control plane's figure), and when the client is first
//!    answered by a replica that did not exist before the kill (traffic
//!    moved); counts the client's failed requests;
//! 4. restarts the lost node's agent and waits until fencing removed its
//!    stale replicas, so the next trial starts from a whole cluster.
//!
//! The phases are seeded and stratified: with N trials, each trial's phase
//! lies in its own N-th of the period (in a shuffled order), so every run
//! samples the whole period, including its first N-th, where the worst case
//! lies (a kill right after a heartbeat leaves the longest time until the
//! lease expires). The seed is printed; `KEEL_BENCH_SEED` replays a run.
//!
//! Targets, checked on the worst trial (a target counts only when every
//! trial meets it); the bench exits non-zero when one is missed:
//! - full replica count within `dead_after` + 2 heartbeat intervals (the
//!   lease expires, the next heartbeat places the replacement, the one after
//!   reports it running);
//! - traffic moved within `dead_after` + 3 heartbeat intervals (one more:
//!   the client node's proxy learns the new endpoint list on its next
//!   heartbeat);
//! - zero failed requests (refused connects to the dead replica are retried
//!   on another one by the proxy).
//!
//! Kubernetes' and Nomad's defaults for the same event are printed beside
//! the figures as anchors (see bench/README.md for their sources).
//!
//! Run with `cargo bench --bench failover`. `KEEL_BENCH_TRIALS` sets the
//! number of trials (default 10, about 35 s each); `KEEL_BENCH_QUICK=1`
//! scales every timing down by 5 (heartbeat 1 s, `dead_after` 3 s, the
//! bounds with them) for a run of about a minute and a half. The bench
//! exits non-zero when a daemon cannot be started or the service never
//! recovers (5 minutes). Every daemon and simulated jail it started is
//! killed on every path (by `Drop`).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel::common::auth::{self, KeyFilePolicy, Signer};
use keel::common::config::Config;
use keel::common::http::{Client, Endpoint};
use keel::common::wire::{JailStatus, Liveness, NodeStatus, ServiceStatus};
use keel::host::JailRuntime;
use keel::host::jail::Removal;
use keel::host::sim::SimJails;

// The phases replay from the printed seed; the crash campaign's stream.
#[path = "../tests/util/seeded.rs"]
mod seeded;
use seeded::{SplitMix64, stratified};

const CONTROLPLANE: &str = env!("CARGO_BIN_EXE_keel-controlplane");
const AGENTD: &str = env!("CARGO_BIN_EXE_keel-agentd");
const KEELCTL: &str = env!("CARGO_BIN_EXE_keelctl");

const NODES: u8 = 3;
const REPLICAS: u32 = 3;
const SERVICE: &str = "web";
/// Bound on a daemon answering after it was started.
const START_DEADLINE: Duration = Duration::from_secs(30);
/// Bound on any one wait for the cluster to converge.
const CONVERGE_DEADLINE: Duration = Duration::from_secs(300);
const POLL: Duration = Duration::from_millis(100);
/// The client's pace: 100 requests a second, so with three replicas in
/// rotation the replacement is reached within about 30 ms of the proxy
/// knowing it.
const CLIENT_PACE: Duration = Duration::from_millis(10);
/// Bound on one client request through a proxy.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The timings divided by this in quick mode (`KEEL_BENCH_QUICK=1`).
const QUICK_FACTOR: u32 = 5;

// Anchors: the defaults of Kubernetes and Nomad for a lost node, in seconds.
/// kube-controller-manager `--node-monitor-grace-period` (40 s; 50 s since
/// Kubernetes 1.32): the node is NotReady/Unknown this long after its last
/// status update.
const K8S_GRACE: f64 = 40.0;
/// kube-apiserver `--default-unreachable-toleration-seconds` and
/// `--default-not-ready-toleration-seconds`: pods are evicted (and only then
/// replaced) this long after the node's taint.
const K8S_TOLERATION: f64 = 300.0;
/// Nomad server `min_heartbeat_ttl` (a small cluster's TTL; the server adds a
/// random stagger of up to one TTL more).
const NOMAD_TTL: f64 = 10.0;
/// Nomad server `heartbeat_grace`: added to the TTL before the node is down
/// and its allocations are lost and replaced.
const NOMAD_GRACE: f64 = 10.0;

fn node_ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 10 + n)
}

fn free_port(ip: Ipv4Addr) -> Result<u16, String> {
    TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port on {ip}: {e}"))
}

/// A port free on every node's address (the three proxies listen on it).
fn port_free_everywhere() -> Result<u16, String> {
    for _ in 0..100 {
        let port = free_port(node_ip(1))?;
        if (1..=NODES).all(|n| TcpListener::bind((node_ip(n), port)).is_ok()) {
            return Ok(port);
        }
    }
    Err("no port free on all three node addresses".into())
}

/// A daemon this bench started: killed with SIGKILL when dropped.
struct Daemon {
    args: Vec<String>,
    program: &'static str,
    log: PathBuf,
    child: Option<Child>,
}

impl Daemon {
    fn spawn(program: &'static str, args: Vec<String>, log: PathBuf) -> Result<Daemon, String> {
        let mut d = Daemon {
            args,
            program,
            log,
            child: None,
        };
        d.start()?;
        Ok(d)
    }

    fn start(&mut self) -> Result<(), String> {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("log file {}: {e}", self.log.display()))?;
        let dir = self.log.parent().unwrap_or(Path::new("."));
        let child = Command::new(self.program)
            .args(&self.args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("start {}: {e}", self.program))?;
        self.child = Some(child);
        Ok(())
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Carries one agent's connections to the control plane and notes when
/// each of its heartbeats passes: the moment a trial's phase is measured
/// from. `GET /nodes` gives `last_seen_secs` in whole seconds only, too
/// coarse for a 1 s heartbeat in quick mode. The agent opens one connection
/// per request and writes each request in one piece, so the first bytes of a
/// connection name its request.
struct HeartbeatTap {
    addr: SocketAddr,
    beats: Arc<Mutex<(u64, Option<Instant>)>>,
}

impl HeartbeatTap {
    fn start(node_id: &str, controlplane: SocketAddr) -> Result<HeartbeatTap, String> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .map_err(|e| format!("heartbeat tap for {node_id}: {e}"))?;
        let addr = listener
            .local_addr()
            .map_err(|e| format!("heartbeat tap for {node_id}: {e}"))?;
        let beats = Arc::new(Mutex::new((0, None)));
        let prefix = format!("POST /nodes/{node_id}/heartbeat").into_bytes();
        let noted = Arc::clone(&beats);
        // Lives as long as the bench process; it holds no daemon or jail.
        std::thread::spawn(move || {
            for agent in listener.incoming().flatten() {
                let (noted, prefix) = (Arc::clone(&noted), prefix.clone());
                std::thread::spawn(move || {
                    let _ = relay(agent, controlplane, &prefix, &noted);
                });
            }
        });
        Ok(HeartbeatTap { addr, beats })
    }

    fn count(&self) -> u64 {
        self.beats.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    fn last(&self) -> Option<Instant> {
        self.beats.lock().unwrap_or_else(|e| e.into_inner()).1
    }
}

/// One connection through a [`HeartbeatTap`], both directions until each
/// side closes.
fn relay(
    mut agent: TcpStream,
    controlplane: SocketAddr,
    prefix: &[u8],
    noted: &Mutex<(u64, Option<Instant>)>,
) -> std::io::Result<()> {
    let mut upstream = TcpStream::connect_timeout(&controlplane, REQUEST_TIMEOUT)?;
    let mut first = [0u8; 4096];
    let n = agent.read(&mut first)?;
    if first[..n].starts_with(prefix) {
        let mut beats = noted.lock().unwrap_or_else(|e| e.into_inner());
        *beats = (beats.0 + 1, Some(Instant::now()));
    }
    upstream.write_all(&first[..n])?;
    let (mut agent_back, mut upstream_back) = (agent.try_clone()?, upstream.try_clone()?);
    let answers = std::thread::spawn(move || {
        let _ = std::io::copy(&mut upstream_back, &mut agent_back);
        let _ = agent_back.shutdown(std::net::Shutdown::Write);
    });
    let _ = std::io::copy(&mut agent, &mut upstream);
    let _ = upstream.shutdown(std::net::Shutdown::Write);
    let _ = answers.join();
    Ok(())
}

struct Node {
    id: String,
    tap: HeartbeatTap,
    daemon: Daemon,
    socket: PathBuf,
    state_dir: PathBuf,
}

impl Node {
    /// Kills every simulated jail the node runs.
    fn kill_jails(&self) {
        let Ok(jails) = SimJails::new(&self.state_dir.join("sim")) else {
            eprintln!(
                "cannot open {}'s jail table; jails may be left running",
                self.id
            );
            return;
        };
        for jail in jails.list().unwrap_or_default() {
            if let Err(e) = jails.remove(&jail.name, &jail.path, Removal::Force) {
                eprintln!("killing {}'s jail {}: {e}", self.id, jail.name);
            }
        }
    }

    fn held(&self) -> Option<Vec<String>> {
        let r = Client::new(Endpoint::Unix(self.socket.clone()))
            .request("GET", "/jails", &[], b"")
            .ok()?;
        let jails: Vec<JailStatus> = serde_json::from_slice(&r.body).ok()?;
        Some(jails.into_iter().map(|j| j.name).collect())
    }
}

/// Timings of the run: the defaults, or the defaults divided by
/// [`QUICK_FACTOR`].
#[derive(Clone, Copy)]
struct Timings {
    heartbeat: Duration,
    dead_after: Duration,
}

impl Timings {
    fn ready_bound(self) -> Duration {
        self.dead_after + 2 * self.heartbeat
    }

    fn traffic_bound(self) -> Duration {
        self.dead_after + 3 * self.heartbeat
    }
}

struct Bench {
    dir: tempfile::TempDir,
    controlplane: Option<Daemon>,
    cp_addr: SocketAddr,
    signer: Option<Signer>,
    nodes: Vec<Node>,
    timings: Timings,
    quick: bool,
}

impl Drop for Bench {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.daemon.kill9();
        }
        self.controlplane.take();
        for node in &self.nodes {
            node.kill_jails();
        }
    }
}

fn wait_until<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> Result<T, String> {
    let start = Instant::now();
    loop {
        if let Some(v) = probe() {
            return Ok(v);
        }
        if start.elapsed() > CONVERGE_DEADLINE {
            return Err(format!("timed out waiting for {what}"));
        }
        std::thread::sleep(POLL);
    }
}

impl Bench {
    fn keelctl(&self, args: &[&str]) -> Result<String, String> {
        let addr = self.cp_addr.to_string();
        let out = Command::new(KEELCTL)
            .args(["--controlplane", &addr, "--key-file"])
            .arg(self.operator_key())
            .args(args)
            .current_dir(self.dir.path())
            .env_remove("KEEL_SOCKET")
            .env_remove("KEEL_CONTROLPLANE")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("run keelctl: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "keelctl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        String::from_utf8(out.stdout).map_err(|e| format!("keelctl output: {e}"))
    }

    fn operator_key(&self) -> PathBuf {
        self.dir.path().join("keel-sim/keys/operator.key")
    }

    /// A signed `GET` straight to the control plane: polled every
    /// [`POLL`], where a keelctl process per poll would
    /// cost more than the precision asked for.
    fn get<T: serde::de::DeserializeOwned>(&mut self, path: &str) -> Option<T> {
        if self.signer.is_none() {
            let key =
                auth::load_key(&self.operator_key(), KeyFilePolicy::for_current_process()).ok()?;
            self.signer = Some(Signer::new(key));
        }
        let headers =
            auth::sign_headers(self.signer.as_ref()?, "GET", path, b"", auth::unix_now()).ok()?;
        let r = Client::new(Endpoint::Tcp(self.cp_addr.to_string()))
            .with_timeout(REQUEST_TIMEOUT)
            .request("GET", path, &headers, b"")
            .ok()?;
        if r.status != 200 {
            return None;
        }
        serde_json::from_slice(&r.body).ok()
    }

    fn service(&mut self) -> Option<ServiceStatus> {
        self.get(&format!("/services/{SERVICE}"))
    }

    fn nodes(&mut self) -> Option<Vec<NodeStatus>> {
        self.get("/nodes")
    }

    fn node(&mut self, id: &str) -> Option<NodeStatus> {
        self.nodes()?.into_iter().find(|n| n.node_id == id)
    }

    /// The moment the next heartbeat of node `i` passed its tap on the way
    /// to the control plane (to within a millisecond).
    fn next_heartbeat(&self, i: usize) -> Result<Instant, String> {
        let tap = &self.nodes[i].tap;
        let seen = tap.count();
        let start = Instant::now();
        loop {
            if tap.count() > seen {
                if let Some(at) = tap.last() {
                    return Ok(at);
                }
            }
            if start.elapsed() > CONVERGE_DEADLINE {
                return Err(format!("no heartbeat of {} seen", self.nodes[i].id));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn start_agent(&mut self, n: u8) -> Result<(), String> {
        let id = format!("n{n}");
        let ip = node_ip(n);
        let sim = self.dir.path().join("keel-sim");
        let state_dir = sim.join(&id);
        let socket = sim.join(format!("{id}.sock"));
        let tap = HeartbeatTap::start(&id, self.cp_addr)?;
        let mut args = vec![
            "--simulate".into(),
            "--controlplane".into(),
            tap.addr.to_string(),
            "--node-id".into(),
            id.clone(),
            "--advertise-addr".into(),
            format!("{ip}:{}", free_port(ip)?),
            "--state-dir".into(),
            state_dir.display().to_string(),
            "--socket".into(),
            socket.display().to_string(),
            "--proxy-listen".into(),
            ip.to_string(),
        ];
        if self.quick {
            args.extend([
                "--heartbeat-interval".into(),
                duration_flag(self.timings.heartbeat),
            ]);
        }
        let log = self.dir.path().join(format!("agentd-{id}.log"));
        let daemon = Daemon::spawn(AGENTD, args, log)?;
        self.nodes.push(Node {
            id,
            tap,
            daemon,
            socket,
            state_dir,
        });
        Ok(())
    }
}

fn duration_flag(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

/// The Service: its replicas run this binary as [`run_replica`].
fn service_yaml(port: u16) -> Result<String, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this bench's own path: {e}"))?;
    Ok(format!(
        "kind: Service\nmetadata: {{name: {SERVICE}}}\nspec:\n  replicas: {REPLICAS}\n  port: {port}\n  template:\n    base: 14.2-RELEASE\n    resources: {{cpu: 0.1}}\n    exec:\n      start: ['{}', replica, '{port}']\n",
        exe.display()
    ))
}

/// `REPLICAS` ready replicas, none on `lost`.
fn whole(s: &ServiceStatus, lost: &str) -> bool {
    s.ready == REPLICAS
        && s.replicas.len() == REPLICAS as usize
        && s.replicas.iter().all(|r| r.ready && r.node != lost)
}

/// What a replica answers: `{name} {address}`.
fn instances(s: &ServiceStatus) -> BTreeSet<String> {
    s.replicas
        .iter()
        .filter_map(|r| Some(format!("{} {}", r.name, r.address?)))
        .collect()
}

/// The workload of every replica: answers each connection on
/// `$KEEL_JAIL_ADDRESS:PORT` with `{name} {address}\n` and closes it.
fn run_replica(port: &str) -> Result<(), String> {
    let port: u16 = port
        .parse()
        .map_err(|e| format!("replica port {port:?}: {e}"))?;
    let var = |name: &str| {
        std::env::var(name).map_err(|e| format!("{name} (set by the simulated jail): {e}"))
    };
    let address: Ipv4Addr = var("KEEL_JAIL_ADDRESS")?
        .parse()
        .map_err(|e| format!("KEEL_JAIL_ADDRESS: {e}"))?;
    let answer = format!("{} {address}\n", var("KEEL_JAIL_NAME")?);
    let listener =
        TcpListener::bind((address, port)).map_err(|e| format!("bind {address}:{port}: {e}"))?;
    // A failed accept, or a client that went away first, needs no answer.
    for mut conn in listener.incoming().flatten() {
        let _ = conn.write_all(answer.as_bytes());
    }
    Ok(())
}

/// One request through the proxy at `addr`: the replica's answer.
fn ask(addr: SocketAddr) -> Result<String, String> {
    let mut conn = TcpStream::connect_timeout(&addr, REQUEST_TIMEOUT)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    conn.set_read_timeout(Some(REQUEST_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)
        .map_err(|e| format!("read from {addr}: {e}"))?;
    match answer.strip_suffix('\n') {
        Some(a) if a.starts_with(SERVICE) => Ok(a.to_string()),
        _ => Err(format!("{addr} answered {answer:?}")),
    }
}

/// A client sending a request through one proxy every [`CLIENT_PACE`],
/// noting when a replica outside `before` first answers. It can be held
/// between two requests (see the module doc).
struct TrafficClient {
    stop: Arc<AtomicBool>,
    hold: Arc<AtomicBool>,
    held: Arc<AtomicBool>,
    served: Arc<AtomicU64>,
    moved_at: Arc<Mutex<Option<Instant>>>,
    thread: std::thread::JoinHandle<Vec<String>>,
}

impl TrafficClient {
    fn start(addr: SocketAddr, before: BTreeSet<String>) -> TrafficClient {
        let stop = Arc::new(AtomicBool::new(false));
        let hold = Arc::new(AtomicBool::new(false));
        let held = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicU64::new(0));
        let moved_at = Arc::new(Mutex::new(None));
        let thread = {
            let (stop, hold, held, served, moved_at) = (
                stop.clone(),
                hold.clone(),
                held.clone(),
                served.clone(),
                moved_at.clone(),
            );
            std::thread::spawn(move || {
                let mut failures = Vec::new();
                let mut next = Instant::now();
                while !stop.load(Ordering::SeqCst) {
                    if hold.load(Ordering::SeqCst) {
                        held.store(true, Ordering::SeqCst);
                        std::thread::yield_now();
                        continue;
                    }
                    held.store(false, Ordering::SeqCst);
                    // Paced, not as fast as possible: the bench shares two
                    // cores with the cluster it measures.
                    std::thread::sleep(next.saturating_duration_since(Instant::now()));
                    next = Instant::now() + CLIENT_PACE;
                    match ask(addr) {
                        Ok(answer) => {
                            served.fetch_add(1, Ordering::Relaxed);
                            if !before.contains(&answer) {
                                let mut moved = moved_at.lock().unwrap_or_else(|e| e.into_inner());
                                moved.get_or_insert_with(Instant::now);
                            }
                        }
                        Err(e) => failures.push(e),
                    }
                }
                failures
            })
        };
        TrafficClient {
            stop,
            hold,
            held,
            served,
            moved_at,
            thread,
        }
    }

    /// Holds the client between two requests; returns once it is held.
    /// Polled every millisecond, not every [`POLL`]: the wait falls between
    /// the heartbeat and the kill, so it would shift the trial's phase.
    fn hold(&self) -> Result<(), String> {
        self.hold.store(true, Ordering::SeqCst);
        let start = Instant::now();
        while !self.held.load(Ordering::SeqCst) {
            if start.elapsed() > REQUEST_TIMEOUT * 2 {
                return Err("the client did not pause between requests".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    fn resume(&self) {
        self.hold.store(false, Ordering::SeqCst);
    }

    fn moved_at(&self) -> Option<Instant> {
        *self.moved_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops the client: (requests served, failures).
    fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        let failures = self
            .thread
            .join()
            .unwrap_or_else(|_| vec!["the client thread panicked".into()]);
        (self.served.load(Ordering::Relaxed), failures)
    }
}

/// One trial's figures, all measured from the kill.
struct Trial {
    victim: String,
    via: String,
    lost: usize,
    phase: Duration,
    dead: Option<Duration>,
    ready: Duration,
    moved: Duration,
    served: u64,
    failures: Vec<String>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn env_number<T: std::str::FromStr>(name: &str) -> Result<Option<T>, String> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map(Some)
            .map_err(|_| format!("{name}={v:?} is not a number")),
        Err(_) => Ok(None),
    }
}

fn run() -> Result<bool, String> {
    if !cfg!(target_os = "linux") {
        return Err("the failover bench needs Linux (three agents on 127.0.0.11-13)".into());
    }
    let quick = std::env::var("KEEL_BENCH_QUICK").is_ok_and(|v| v == "1");
    let trials: usize = env_number("KEEL_BENCH_TRIALS")?.unwrap_or(10).max(1);
    let seed: u64 = match env_number("KEEL_BENCH_SEED")? {
        Some(s) => s,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
    };
    let defaults = Config::default();
    let mut timings = Timings {
        heartbeat: defaults.controlplane.heartbeat_interval.0,
        dead_after: defaults.controlplane.dead_after.0,
    };
    if quick {
        timings.heartbeat /= QUICK_FACTOR;
        timings.dead_after /= QUICK_FACTOR;
    }
    let mut rng = SplitMix64(seed);
    let phases = stratified(trials, &mut rng);

    let dir = tempfile::tempdir().map_err(|e| format!("tempdir: {e}"))?;
    let cp_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)?));
    let mut bench = Bench {
        controlplane: None,
        cp_addr,
        signer: None,
        nodes: Vec::new(),
        timings,
        quick,
        dir,
    };
    let mut cp_args = vec!["--simulate".into(), "--listen".into(), cp_addr.to_string()];
    if quick {
        cp_args.extend([
            "--heartbeat-interval".into(),
            duration_flag(timings.heartbeat),
            "--dead-after".into(),
            duration_flag(timings.dead_after),
        ]);
    }
    bench.controlplane = Some(Daemon::spawn(
        CONTROLPLANE,
        cp_args,
        bench.dir.path().join("controlplane.log"),
    )?);
    let client = Client::new(Endpoint::Tcp(cp_addr.to_string())).with_timeout(START_DEADLINE);
    let start = Instant::now();
    while !client
        .request("GET", "/healthz", &[], b"")
        .is_ok_and(|r| r.status == 200)
    {
        if start.elapsed() > START_DEADLINE {
            return Err("keel-controlplane did not answer /healthz".into());
        }
        std::thread::sleep(POLL);
    }
    for n in 1..=NODES {
        bench.start_agent(n)?;
    }
    let load_before = load_average();
    println!(
        "failover benchmark: keel-controlplane and {NODES} keel-agentd --simulate, {} timings (heartbeat {}s, dead_after {}s), {trials} trials, seed {seed} (KEEL_BENCH_SEED={seed} replays the phases), load average {load_before}",
        if quick {
            "quick (defaults / 5)"
        } else {
            "default"
        },
        timings.heartbeat.as_secs_f64(),
        timings.dead_after.as_secs_f64()
    );
    wait_until("three Alive nodes", || {
        let alive = bench
            .nodes()?
            .iter()
            .filter(|n| n.status == Liveness::Alive)
            .count();
        (alive == usize::from(NODES)).then_some(())
    })?;
    let port = port_free_everywhere()?;
    let file = bench.dir.path().join("web.yaml");
    std::fs::write(&file, service_yaml(port)?).map_err(|e| format!("write web.yaml: {e}"))?;
    bench.keelctl(&["apply", "-f", &file.display().to_string()])?;
    wait_until("3/3 ready", || bench.service().filter(|s| whole(s, "")))?;
    // Every proxy serves all three before the first trial.
    for n in 1..=NODES {
        let addr = SocketAddr::from((node_ip(n), port));
        wait_until(&format!("n{n}'s proxy to serve"), || ask(addr).ok())?;
    }

    let mut results = Vec::new();
    for (trial, phase) in phases.iter().enumerate() {
        let before = wait_until("3/3 ready with addresses", || {
            bench.service().filter(|s| whole(s, "")).map(|s| {
                let holders: Vec<String> = s.replicas.iter().map(|r| r.node.clone()).collect();
                (instances(&s), holders)
            })
        })?;
        let (before, holders) = before;
        // The victim: the next node in turn that holds exactly one replica
        // (a returned node holds none, so another holds two; every trial
        // loses one replica of three, the same scenario), else any holder;
        // the client goes through the node after it.
        let holds = |i: usize| holders.iter().filter(|h| **h == bench.nodes[i].id).count();
        let turn = (0..usize::from(NODES)).map(|k| (trial + k) % usize::from(NODES));
        let victim = turn
            .clone()
            .find(|&i| holds(i) == 1)
            .or_else(|| turn.clone().find(|&i| holds(i) > 0))
            .ok_or("no node holds a replica")?;
        let via = (victim + 1) % usize::from(NODES);
        let id = bench.nodes[victim].id.clone();
        let lost_replicas = holds(victim);
        let proxy = SocketAddr::from((node_ip(u8::try_from(via + 1).unwrap_or(1)), port));
        let client = TrafficClient::start(proxy, before.clone());
        wait_until("the client to be served", || {
            (client.served.load(Ordering::Relaxed) > 0).then_some(())
        })?;

        let offset = timings.heartbeat.mul_f64(*phase);
        let beat = bench.next_heartbeat(victim)?;
        // The phase is the scenario itself: there is no condition to await.
        std::thread::sleep((beat + offset).saturating_duration_since(Instant::now()));
        client.hold()?;
        let lost = Instant::now();
        bench.nodes[victim].daemon.kill9();
        bench.nodes[victim].kill_jails();
        client.resume();
        let phase = lost.duration_since(beat);

        let mut dead_at = None;
        let mut ready_at = None;
        let moved_at = wait_until(&format!("3/3 ready without {id} and traffic moved"), || {
            if dead_at.is_none() && bench.node(&id).is_some_and(|n| n.status == Liveness::Dead) {
                dead_at = Some(lost.elapsed());
            }
            if ready_at.is_none() && bench.service().is_some_and(|s| whole(&s, &id)) {
                ready_at = Some(lost.elapsed());
            }
            ready_at?;
            client.moved_at()
        })?;
        let (served, failures) = client.finish();
        let result = Trial {
            victim: id.clone(),
            via: bench.nodes[via].id.clone(),
            lost: lost_replicas,
            phase,
            dead: dead_at,
            ready: ready_at.unwrap_or_default(),
            moved: moved_at.saturating_duration_since(lost),
            served,
            failures,
        };
        println!(
            "trial {:>2}: kill -9 of {} ({} replica{}) {:.2} s after its heartbeat; Dead after {}, 3/3 ready after {:.1} s, traffic through {}'s proxy moved after {:.1} s; {} of {} requests failed{}",
            trial + 1,
            result.victim,
            result.lost,
            if result.lost == 1 { "" } else { "s" },
            result.phase.as_secs_f64(),
            result
                .dead
                .map_or("(not seen)".into(), |d| format!("{:.1} s", d.as_secs_f64())),
            result.ready.as_secs_f64(),
            result.via,
            result.moved.as_secs_f64(),
            result.failures.len(),
            result.served + result.failures.len() as u64,
            result
                .failures
                .first()
                .map_or(String::new(), |f| format!(" (first: {f})")),
        );
        results.push(result);

        // Bring the node back; fencing removes its stale replicas.
        bench.nodes[victim].daemon.start()?;
        wait_until(&format!("{id} Alive and fenced"), || {
            let fenced = bench.nodes[victim]
                .held()?
                .iter()
                .all(|name| !name.starts_with(SERVICE));
            let alive = bench.node(&id).is_some_and(|n| n.status == Liveness::Alive);
            (fenced && alive).then_some(())
        })?;
    }
    let load_after = load_average();
    Ok(report(&results, timings, quick, &load_before, &load_after))
}

/// Prints the summary and the verdicts; true when every target is met.
fn report(results: &[Trial], timings: Timings, quick: bool, before: &str, after: &str) -> bool {
    let secs = |f: fn(&Trial) -> Duration| -> Vec<f64> {
        results.iter().map(|t| f(t).as_secs_f64()).collect()
    };
    let worst = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let ready = secs(|t| t.ready);
    let moved = secs(|t| t.moved);
    let dead: Vec<f64> = results
        .iter()
        .filter_map(|t| t.dead.map(|d| d.as_secs_f64()))
        .collect();
    let failed: usize = results.iter().map(|t| t.failures.len()).sum();
    let sent: u64 = results
        .iter()
        .map(|t| t.served + t.failures.len() as u64)
        .sum();
    let ready_bound = timings.ready_bound().as_secs_f64();
    let traffic_bound = timings.traffic_bound().as_secs_f64();
    let verdict = |met: bool| if met { "met" } else { "MISSED" };
    let ready_met = worst(&ready) <= ready_bound;
    let traffic_met = worst(&moved) <= traffic_bound;
    let failures_met = failed == 0;

    println!();
    println!(
        "{} trials, load average {before} at the start, {after} at the end",
        results.len()
    );
    println!("| measure (from the kill) | median | worst | target | |\n|---|---:|---:|---|---|");
    println!(
        "| node Dead | {:.1} s | {:.1} s | – | |",
        median(dead.clone()),
        worst(&dead)
    );
    println!(
        "| full replica count (control plane) | {:.1} s | {:.1} s | ≤ dead_after + 2 heartbeats = {ready_bound:.0} s | {} |",
        median(ready.clone()),
        worst(&ready),
        verdict(ready_met)
    );
    println!(
        "| traffic moved (client through a surviving node's proxy) | {:.1} s | {:.1} s | ≤ dead_after + 3 heartbeats = {traffic_bound:.0} s | {} |",
        median(moved.clone()),
        worst(&moved),
        verdict(traffic_met)
    );
    println!(
        "| failed requests | {failed} of {sent} | – | 0 | {} |",
        verdict(failures_met)
    );
    let scale = if quick { f64::from(QUICK_FACTOR) } else { 1.0 };
    let k8s = K8S_GRACE + K8S_TOLERATION;
    let nomad_min = NOMAD_TTL + NOMAD_GRACE;
    let nomad_max = 2.0 * NOMAD_TTL + NOMAD_GRACE;
    let worst_default = worst(&moved) * scale;
    println!();
    println!(
        "anchors, default settings (before the replacement is even placed): Kubernetes evicts a lost node's pods {k8s:.0} s after its last status (node-monitor-grace-period {K8S_GRACE:.0} s + tolerationSeconds {K8S_TOLERATION:.0} s), x{:.0} of Keel's worst traffic-moved figure{}; Nomad marks the node down {nomad_min:.0}–{nomad_max:.0} s after its last heartbeat (heartbeat TTL {NOMAD_TTL:.0}–{:.0} s + heartbeat_grace {NOMAD_GRACE:.0} s), x{:.1}–{:.1}",
        k8s / worst_default.max(f64::EPSILON),
        if quick {
            " (scaled up by 5 from this quick run)"
        } else {
            ""
        },
        2.0 * NOMAD_TTL,
        nomad_min / worst_default.max(f64::EPSILON),
        nomad_max / worst_default.max(f64::EPSILON),
    );
    ready_met && traffic_met && failures_met
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if let [mode, port] = args.as_slice() {
        if mode == "replica" {
            return match run_replica(port) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("failover replica: {e}");
                    ExitCode::FAILURE
                }
            };
        }
    }
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("failover bench: a target was missed (see the table above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("failover bench: {e}");
            ExitCode::FAILURE
        }
    }
}
