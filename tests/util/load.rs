//! Load-generation plumbing shared by the control plane benchmark
//! (`bench/controlplane.rs`, which includes this file with `#[path]`) and the
//! soak (`tests/soak.rs`): keep-alive HTTP/1.1 clients that send hand-encoded
//! (optionally signed) requests, the pacing of simulated nodes' heartbeats
//! ([`pace`]) and a paced pool of them, in-process simulated agents that
//! accept every `PUT` and `DELETE /jails/{name}` (noting each `PUT`'s
//! placement epoch), readers of a process's CPU time, memory and
//! file descriptors in `/proc` (Linux), and the benchmarks' control plane
//! ([`ControlPlane`], a release `keel-controlplane --simulate` it starts and
//! kills).
//!
//! It measures and reports; it never asserts (its users decide what a
//! failure is) and never signals a process but the control plane it
//! started.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use keel::common::auth::{self, KeyFilePolicy, Signer};
use keel::common::http::{
    ClientResponse, Peer, Request, Response, Server, ServerLimits, ShutdownSignal, read_response,
};
use keel::common::wire::{
    COMMITTED_HEADER, EPOCH_HEADER, HeartbeatRequest, Resources, format_committed,
};

/// Bound on connecting and on each read and write.
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Size every simulated node reports, and what each placed jail commits.
pub const NODE_CPU: f64 = 8.0;
pub const NODE_MEMORY: u64 = 32 << 30;
pub const JAIL_CPU: f64 = 0.25;
pub const JAIL_MEMORY: u64 = 256 << 20;
/// "No peer list held yet" (versions stay below 2^53).
pub const NO_VERSION: u64 = u64::MAX;

/// The id of simulated node `i`.
pub fn node_id(i: usize) -> String {
    format!("node-{i:05}")
}

// ---------------------------------------------------------------- /proc

/// utime + stime of the whole process (every thread, dead ones included),
/// in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may hold spaces: state is 3, utime 14.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / clock_ticks_per_sec())
}

/// sysconf(_SC_CLK_TCK): the unit of utime and stime.
#[allow(unsafe_code)]
pub fn clock_ticks_per_sec() -> f64 {
    // SAFETY: sysconf takes an integer, touches no memory of ours and returns
    // -1 on error, which is handled below.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as f64 } else { 100.0 }
}

/// One field of `/proc/<pid>/status` in KiB (`VmRSS`, `VmHWM`) or a count.
pub fn proc_status(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

pub fn mib(kib: Option<u64>) -> String {
    kib.map_or("n/a".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0))
}

/// How many file descriptors `pid` holds open (entries of `/proc/<pid>/fd`).
pub fn open_fds(pid: u32) -> Option<u64> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    u64::try_from(dir.count()).ok()
}

// ------------------------------------------------------ simulated agents

/// In-process agents: answer `PUT` and `DELETE /jails/{name}` with 200,
/// verify nothing, count both. Each agent keeps the jails it was sent,
/// with the epoch of their last `PUT`, as one node would.
pub struct Agents {
    pub addrs: Vec<SocketAddr>,
    pub puts: Arc<AtomicU64>,
    pub deletes: Arc<AtomicU64>,
    /// The jails of the agent at `addrs[k]` and their epochs (0 when a
    /// `PUT` carried none).
    pub jails: Arc<Vec<Mutex<BTreeMap<String, u64>>>>,
    pub shutdown: ShutdownSignal,
    pub threads: Vec<JoinHandle<()>>,
}

impl Agents {
    /// `count` listeners answering nothing but the status.
    pub fn start(count: usize) -> Result<Agents, String> {
        Agents::spawn(count, false)
    }

    /// Agents for `count` simulated nodes, each with its own address (node
    /// `i` is [`node_addr`]`(i)`, on one of a few listeners): each `PUT`
    /// answer also carries the node's committed resources
    /// (`X-Keel-Committed`, [`JAIL_CPU`] and [`JAIL_MEMORY`] per jail it
    /// holds), as a real agent's does, so the scheduler spreads a burst of
    /// applies.
    pub fn per_node(count: usize) -> Result<Agents, String> {
        Agents::spawn(count, true)
    }

    fn spawn(count: usize, per_node: bool) -> Result<Agents, String> {
        let puts = Arc::new(AtomicU64::new(0));
        let deletes = Arc::new(AtomicU64::new(0));
        // Per node, the listeners take every address: 127.1.x.y reaches
        // them only so (a listener per node is a thread per node, more than
        // a process may have at 10,000). The handler refuses every peer
        // that is not on loopback.
        let (listeners, bind) = if per_node {
            (PER_NODE_LISTENERS, "0.0.0.0:0")
        } else {
            (count, "127.0.0.1:0")
        };
        let mut bound = Vec::new();
        for _ in 0..listeners {
            bound.push(TcpListener::bind(bind).map_err(|e| e.to_string())?);
        }
        let ports: Vec<u16> = bound
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let addrs: Vec<SocketAddr> = if per_node {
            (0..count)
                .map(|i| SocketAddr::new(node_addr(i).into(), ports[i % ports.len()]))
                .collect()
        } else {
            ports
                .iter()
                .map(|p| SocketAddr::from(([127, 0, 0, 1], *p)))
                .collect()
        };
        // The request's Host names the node (or the listener) it was sent to.
        let by_addr: HashMap<String, usize> = addrs
            .iter()
            .enumerate()
            .map(|(k, a)| (a.to_string(), k))
            .collect();
        let jails: Arc<Vec<Mutex<BTreeMap<String, u64>>>> = Arc::new(
            (0..addrs.len())
                .map(|_| Mutex::new(BTreeMap::new()))
                .collect(),
        );
        let (counter, deleted) = (Arc::clone(&puts), Arc::clone(&deletes));
        let held = Arc::clone(&jails);
        let handler = move |req: Request| -> Response {
            if !matches!(&req.peer, Peer::Tcp(a) if a.ip().is_loopback()) {
                return Response::error(403, "simulated agent: loopback only", None);
            }
            let agent = req
                .header("Host")
                .and_then(|h| by_addr.get(h))
                .map(|k| &held[*k]);
            match (req.method.as_str(), req.segments().as_slice()) {
                ("PUT", ["jails", name]) => {
                    counter.fetch_add(1, Ordering::Relaxed);
                    let epoch = req
                        .header(EPOCH_HEADER)
                        .and_then(|e| e.parse().ok())
                        .unwrap_or(0);
                    let held = agent.map(|m| {
                        // A poisoned map is still a map of jails.
                        let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
                        g.insert(name.to_string(), epoch);
                        g.len() as u64
                    });
                    let answer = Response::json(
                        200,
                        &serde_json::json!({ "name": name, "state": "Pending" }),
                    );
                    match held.filter(|_| per_node) {
                        Some(n) => answer.with_header(
                            COMMITTED_HEADER,
                            &format_committed(&Resources {
                                cpu: n as f64 * JAIL_CPU,
                                memory: n * JAIL_MEMORY,
                            }),
                        ),
                        None => answer,
                    }
                }
                ("DELETE", ["jails", name]) => {
                    deleted.fetch_add(1, Ordering::Relaxed);
                    if let Some(m) = agent {
                        m.lock().unwrap_or_else(|p| p.into_inner()).remove(*name);
                    }
                    Response::json(200, &serde_json::json!({ "deleted": name }))
                }
                _ => Response::error(
                    404,
                    "simulated agent: PUT and DELETE /jails/NAME only",
                    None,
                ),
            }
        };
        let shutdown = ShutdownSignal::new();
        let server = Server::new(Arc::new(handler), stand_in_limits(), shutdown.clone());
        let mut threads = Vec::new();
        for listener in bound {
            threads.push(server.serve_tcp(listener).map_err(|e| e.to_string())?);
        }
        Ok(Agents {
            addrs,
            puts,
            deletes,
            jails,
            shutdown,
            threads,
        })
    }
}

/// Listeners [`Agents::per_node`] serves every node from.
pub const PER_NODE_LISTENERS: usize = 8;

/// The loopback address of simulated node `i` of [`Agents::per_node`]
/// (below 65,535 nodes).
pub fn node_addr(i: usize) -> std::net::Ipv4Addr {
    let n = (i + 1) as u32;
    std::net::Ipv4Addr::new(127, 1, (n >> 8) as u8, n as u8)
}

impl Drop for Agents {
    fn drop(&mut self) {
        self.shutdown.trigger();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

// ------------------------------------------------------ keep-alive client

/// One keep-alive connection; reconnects after an error or a `close`.
pub struct KeepAlive {
    pub addr: SocketAddr,
    pub endpoint: String,
    pub conn: Option<BufReader<TcpStream>>,
}

impl KeepAlive {
    pub fn new(addr: SocketAddr) -> KeepAlive {
        KeepAlive {
            addr,
            endpoint: addr.to_string(),
            conn: None,
        }
    }

    pub fn connect(&self) -> Result<BufReader<TcpStream>, String> {
        let s = TcpStream::connect_timeout(&self.addr, IO_TIMEOUT)
            .map_err(|e| format!("connecting to {}: {e}", self.addr))?;
        s.set_nodelay(true)
            .and_then(|()| s.set_read_timeout(Some(IO_TIMEOUT)))
            .and_then(|()| s.set_write_timeout(Some(IO_TIMEOUT)))
            .map_err(|e| e.to_string())?;
        Ok(BufReader::with_capacity(64 * 1024, s))
    }

    /// Sends one encoded request and reads its response.
    pub fn exchange(&mut self, wire: &[u8]) -> Result<ClientResponse, String> {
        let mut conn = match self.conn.take() {
            Some(c) => c,
            None => self.connect()?,
        };
        conn.get_mut()
            .write_all(wire)
            .map_err(|e| format!("sending to {}: {e}", self.endpoint))?;
        let resp = read_response(&mut conn, &self.endpoint, false).map_err(|e| e.to_string())?;
        let closing = resp
            .header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"));
        if !closing {
            self.conn = Some(conn);
        }
        Ok(resp)
    }
}

/// A request on the wire, keep-alive (no `Connection: close`).
pub fn encode(
    method: &str,
    path: &str,
    host: SocketAddr,
    headers: &[(String, String)],
    body: &[u8],
) -> Vec<u8> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\n");
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut wire = head.into_bytes();
    wire.extend_from_slice(body);
    wire
}

/// A request signed with `signer`, JSON or YAML body.
pub fn signed(
    signer: &Signer,
    method: &str,
    path: &str,
    host: SocketAddr,
    content_type: &str,
    body: &[u8],
) -> Result<Vec<u8>, String> {
    let mut headers = auth::sign_headers(signer, method, path, body, auth::unix_now())
        .map_err(|e| e.to_string())?;
    headers.push(("Content-Type".into(), content_type.into()));
    Ok(encode(method, path, host, &headers, body))
}

// ------------------------------------------------------ paced heartbeats

/// What the paced pool sends.
#[derive(Clone, Copy, PartialEq)]
pub enum Paced {
    /// `GET /healthz`, unsigned.
    Healthz,
    /// `POST /nodes/{id}/heartbeat`, signed with the node key.
    Heartbeat,
}

/// One paced request: when it was due, how long until its answer (from the
/// due time), whether it succeeded, whose it was and its answer's body size.
pub struct Sample {
    pub due: Instant,
    pub latency: Duration,
    pub error: Option<String>,
    pub node: usize,
    pub bytes: usize,
}

/// The heartbeat schedule of simulated nodes, for client thread `t` of
/// `threads`: nodes `t, t + threads, ...`, node `i` due at
/// `start + k * period + i * period / nodes`. Sleeps until each is due,
/// then calls `send(i, due)`; returns when `stop` is set.
pub fn pace(
    t: usize,
    threads: usize,
    nodes: usize,
    period: Duration,
    start: Instant,
    stop: &AtomicBool,
    mut send: impl FnMut(usize, Instant),
) {
    let mine: Vec<usize> = (t..nodes).step_by(threads).collect();
    let phase = |i: usize| period.mul_f64(i as f64 / nodes as f64);
    for round in 0u32.. {
        for &i in &mine {
            let due = start + period * round + phase(i);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if stop.load(Ordering::Relaxed) {
                return;
            }
            send(i, due);
        }
    }
}

/// Shared by the paced threads.
pub struct PacedLoad {
    pub kind: Paced,
    pub addr: SocketAddr,
    pub nodes: usize,
    pub signer: Signer,
    /// Jails the bench placed per node, reported as committed.
    pub placed: Arc<Vec<AtomicU64>>,
    /// The peer list version each node last received ([`NO_VERSION`]: none),
    /// sent back as an agent does.
    pub versions: Vec<AtomicU64>,
    /// Every node sends once per period (the agents' default: 5 s).
    pub period: Duration,
    pub start: Instant,
    pub stop: AtomicBool,
}

impl PacedLoad {
    /// Thread `t` of `threads`, paced by [`pace`].
    pub fn run(&self, t: usize, threads: usize) -> Vec<Sample> {
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
                let result = self.request(i).and_then(|wire| conn.exchange(&wire));
                let bytes = result.as_ref().map_or(0, |r| r.body.len());
                let error = match result {
                    Ok(r) if r.status == 200 => self.absorb(i, &r.body).err(),
                    Ok(r) => Some(format!(
                        "{} answered {}: {}",
                        self.what(i),
                        r.status,
                        String::from_utf8_lossy(&r.body)
                    )),
                    Err(e) => Some(format!("{}: {e}", self.what(i))),
                };
                samples.push(Sample {
                    due,
                    latency: due.elapsed(),
                    error,
                    node: i,
                    bytes,
                });
            },
        );
        samples
    }

    /// Keeps the peer list version of a heartbeat answer.
    pub fn absorb(&self, i: usize, body: &[u8]) -> Result<(), String> {
        #[derive(serde::Deserialize)]
        struct Versioned {
            #[serde(default)]
            peers_version: Option<u64>,
        }
        if self.kind == Paced::Heartbeat {
            let v: Versioned = serde_json::from_slice(body)
                .map_err(|e| format!("heartbeat answer of {}: {e}", node_id(i)))?;
            self.versions[i].store(v.peers_version.unwrap_or(NO_VERSION), Ordering::Relaxed);
        }
        Ok(())
    }

    pub fn what(&self, i: usize) -> String {
        match self.kind {
            Paced::Healthz => "GET /healthz".into(),
            Paced::Heartbeat => format!("heartbeat of {}", node_id(i)),
        }
    }

    pub fn request(&self, i: usize) -> Result<Vec<u8>, String> {
        match self.kind {
            Paced::Healthz => Ok(encode("GET", "/healthz", self.addr, &[], b"")),
            Paced::Heartbeat => {
                let jails = self.placed[i].load(Ordering::Relaxed);
                let body = serde_json::to_vec(&HeartbeatRequest {
                    peer_changes: false,
                    endpoints_held: None,
                    endpoints_generation: None,
                    connections: Vec::new(),
                    events_seq: None,
                    committed: Resources {
                        cpu: jails as f64 * JAIL_CPU,
                        memory: jails * JAIL_MEMORY,
                    },
                    jails: u32::try_from(jails).unwrap_or(u32::MAX),
                    placed: Vec::new(),
                    peers_version: match self.versions[i].load(Ordering::Relaxed) {
                        NO_VERSION => None,
                        v => Some(v),
                    },
                    endpoint_changes: false,
                })
                .map_err(|e| e.to_string())?;
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
        }
    }
}

/// A paced load running on its threads until [`Running::finish`].
pub struct Running {
    pub load: Arc<PacedLoad>,
    pub threads: Vec<JoinHandle<Vec<Sample>>>,
}

impl Running {
    pub fn start(load: PacedLoad, clients: usize) -> Running {
        let load = Arc::new(load);
        let threads = (0..clients)
            .map(|t| {
                let load = Arc::clone(&load);
                std::thread::spawn(move || load.run(t, clients))
            })
            .collect();
        Running { load, threads }
    }

    /// Stops the threads and returns every sample.
    pub fn finish(self) -> Vec<Sample> {
        self.load.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for t in self.threads {
            if let Ok(samples) = t.join() {
                all.extend(samples);
            }
        }
        all
    }
}

// ------------------------------------------------------ the control plane

/// How long a benchmark's control plane gets to answer `/healthz`.
pub const CONTROLPLANE_START: Duration = Duration::from_secs(20);

/// A release `keel-controlplane --simulate` under a benchmark, in a
/// temporary directory of its own; killed on drop.
pub struct ControlPlane {
    pub child: Child,
    pub addr: SocketAddr,
    pub dir: tempfile::TempDir,
}

impl ControlPlane {
    /// Starts `binary --simulate --listen ADDR` plus `flags`.
    pub fn start(binary: &Path, flags: &[&str]) -> Result<ControlPlane, String> {
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
            .args(flags)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", binary.display()))?;
        let mut cp = ControlPlane { child, addr, dir };
        let deadline = Instant::now() + CONTROLPLANE_START;
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
                    CONTROLPLANE_START.as_secs(),
                    cp.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn key(&self, file: &str) -> Result<Signer, String> {
        let path: PathBuf = self.dir.path().join("keel-sim/keys").join(file);
        auth::load_key(&path, KeyFilePolicy::for_current_process())
            .map(Signer::new)
            .map_err(|e| e.to_string())
    }

    pub fn log_tail(&self) -> String {
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

/// The admission of an in-process stand-in for agents under load: every
/// connection may be unauthenticated (no signature is checked) and from
/// one address.
pub fn stand_in_limits() -> ServerLimits {
    ServerLimits {
        max_connections: 4096,
        max_unauthenticated: 4096,
        max_unauthenticated_per_address: 4096,
        ..ServerLimits::default()
    }
}
