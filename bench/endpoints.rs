//! Benchmark: how long a replica's readiness flip takes to reach another
//! node's proxy, with the endpoint push (heartbeat nudge, generation-numbered
//! table, the `keel-endpoints` long poll) and, side by side, with the push
//! turned off (`KEEL_SIM_ENDPOINT_PUSH=off`: the heartbeat path alone).
//!
//! For each of the two modes it starts the release `keel-controlplane
//! --simulate` and two `keel-agentd --simulate` in a temporary directory
//! with the **default** heartbeat interval and `dead_after`, each proxy on
//! its own loopback address, and applies a two-replica service (one replica
//! per node) whose replicas are this bench binary itself (`endpoints replica
//! PORT`: `GET /healthz` answers 200, or 503 between a `GET /fail` and a
//! `GET /heal`) with an http health check every 100 ms. Per trial, with
//! `web-1` the victim and the node holding `web-0` the observer:
//!
//! 1. `GET /fail` on web-1; the bench polls web-1's agent (`GET
//!    /jails/web-1`, every 5 ms) until it says not ready, the flip, and then
//!    the observer's `GET /proxy/replicas` until its proxy no longer lists
//!    web-1: the first figure is the time between the two;
//! 2. `GET /heal`, and the same for web-1 becoming ready and listed again:
//!    the second figure.
//!
//! `failureThreshold` is 20 probes with the push and 70 without, so the
//! replica is restarted (at twice the threshold) only long after the
//! observer's proxy had time to drop it on either path. Figures are from
//! the flip as its own agent reports it, so probe detection is left out;
//! both ends are polled, so each figure is good to about 10 ms.
//!
//! Target: every push figure under 1 s; the bench prints each mode's median
//! and maximum and their ratios, and exits non-zero on a miss (or when a
//! daemon cannot be started or the cluster does not converge within 2
//! minutes). `KEEL_BENCH_TRIALS` sets the trials with the push (default 10),
//! `KEEL_BENCH_BASELINE_TRIALS` without (default 5: each takes up to two
//! heartbeat periods). Run with `cargo bench --bench endpoints`, about 1.5
//! minutes. Every daemon and simulated jail it started is killed on every
//! path (by `Drop`).

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use keel::common::auth::{self, KeyFilePolicy, Signer};
use keel::common::http::{Client, Endpoint};
use keel::common::wire::{JailStatus, Liveness, NodeStatus, ServiceStatus};
use keel::host::JailRuntime;
use keel::host::jail::Removal;
use keel::host::sim::SimJails;

const CONTROLPLANE: &str = env!("CARGO_BIN_EXE_keel-controlplane");
const AGENTD: &str = env!("CARGO_BIN_EXE_keel-agentd");
const KEELCTL: &str = env!("CARGO_BIN_EXE_keelctl");

/// The push must bring every flip to the other proxy within this.
const TARGET: Duration = Duration::from_secs(1);
/// Bound on the cluster converging, and on any one wait.
const CONVERGE_DEADLINE: Duration = Duration::from_secs(120);
/// How often both ends of a flip are polled.
const POLL: Duration = Duration::from_millis(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

fn node_ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 10 + n)
}

fn free_port(ip: Ipv4Addr) -> Result<u16, String> {
    TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port on {ip}: {e}"))
}

/// A port free on both nodes' addresses (both proxies listen on it).
fn port_free_on_both() -> Result<u16, String> {
    for _ in 0..100 {
        let port = free_port(node_ip(1))?;
        if TcpListener::bind((node_ip(2), port)).is_ok() {
            return Ok(port);
        }
    }
    Err("no port free on both node addresses".into())
}

/// A daemon this bench started: killed with SIGKILL when dropped.
struct Daemon(Child);

impl Daemon {
    fn spawn(
        program: &str,
        args: &[String],
        env: &[(&str, &str)],
        log: &Path,
    ) -> Result<Daemon, String> {
        let file = std::fs::File::create(log).map_err(|e| format!("log {}: {e}", log.display()))?;
        Command::new(program)
            .args(args)
            .envs(env.iter().copied())
            .current_dir(log.parent().unwrap_or(Path::new(".")))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .map(Daemon)
            .map_err(|e| format!("start {program}: {e}"))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One cluster: a control plane and two agents; see the module docs.
struct Cluster {
    dir: tempfile::TempDir,
    cp_addr: SocketAddr,
    signer: Option<Signer>,
    /// Agents first, so they are killed before the control plane.
    agents: Vec<(String, PathBuf, Daemon)>,
    _controlplane: Option<Daemon>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let states: Vec<PathBuf> = self
            .agents
            .iter()
            .map(|(id, _, _)| self.dir.path().join("keel-sim").join(id))
            .collect();
        self.agents.clear();
        for state in states {
            let Ok(jails) = SimJails::new(&state.join("sim")) else {
                eprintln!("cannot open {}; jails may be left running", state.display());
                continue;
            };
            for jail in jails.list().unwrap_or_default() {
                if let Err(e) = jails.remove(&jail.name, &jail.path, Removal::Force) {
                    eprintln!("killing jail {}: {e}", jail.name);
                }
            }
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

impl Cluster {
    fn start(push: bool) -> Result<Cluster, String> {
        let dir = tempfile::tempdir().map_err(|e| format!("tempdir: {e}"))?;
        let cp_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)?));
        let controlplane = Daemon::spawn(
            CONTROLPLANE,
            &["--simulate".into(), "--listen".into(), cp_addr.to_string()],
            &[],
            &dir.path().join("controlplane.log"),
        )?;
        let client = Client::new(Endpoint::Tcp(cp_addr.to_string())).with_timeout(REQUEST_TIMEOUT);
        wait_until("keel-controlplane to answer /healthz", || {
            client
                .request("GET", "/healthz", &[], b"")
                .ok()
                .filter(|r| r.status == 200)
        })?;
        let mut cluster = Cluster {
            dir,
            cp_addr,
            signer: None,
            agents: Vec::new(),
            _controlplane: Some(controlplane),
        };
        let env: &[(&str, &str)] = if push {
            &[]
        } else {
            &[("KEEL_SIM_ENDPOINT_PUSH", "off")]
        };
        for n in 1..=2 {
            let (id, ip) = (format!("n{n}"), node_ip(n));
            let sim = cluster.dir.path().join("keel-sim");
            let socket = sim.join(format!("{id}.sock"));
            let args = vec![
                "--simulate".into(),
                "--controlplane".into(),
                cp_addr.to_string(),
                "--node-id".into(),
                id.clone(),
                "--advertise-addr".into(),
                format!("{ip}:{}", free_port(ip)?),
                "--state-dir".into(),
                sim.join(&id).display().to_string(),
                "--socket".into(),
                socket.display().to_string(),
                "--proxy-listen".into(),
                ip.to_string(),
            ];
            let log = cluster.dir.path().join(format!("agentd-{id}.log"));
            let daemon = Daemon::spawn(AGENTD, &args, env, &log)?;
            cluster.agents.push((id, socket, daemon));
        }
        wait_until("two Alive nodes", || {
            let nodes: Vec<NodeStatus> = cluster.get("/nodes")?;
            (nodes.iter().filter(|n| n.status == Liveness::Alive).count() == 2).then_some(())
        })?;
        Ok(cluster)
    }

    fn operator_key(&self) -> PathBuf {
        self.dir.path().join("keel-sim/keys/operator.key")
    }

    /// A signed `GET` to the control plane.
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
        (r.status == 200).then(|| serde_json::from_slice(&r.body).ok())?
    }

    fn apply(&self, doc: &str) -> Result<(), String> {
        let mut child = Command::new(KEELCTL)
            .args(["--controlplane", &self.cp_addr.to_string(), "--key-file"])
            .arg(self.operator_key())
            .args(["apply", "-f", "-"])
            .current_dir(self.dir.path())
            .env_remove("KEEL_SOCKET")
            .env_remove("KEEL_CONTROLPLANE")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("run keelctl: {e}"))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(doc.as_bytes())
                .map_err(|e| format!("keelctl stdin: {e}"))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| format!("keelctl: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "keelctl apply: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(())
    }

    fn socket(&self, node: &str) -> Result<PathBuf, String> {
        self.agents
            .iter()
            .find(|(id, _, _)| id == node)
            .map(|(_, s, _)| s.clone())
            .ok_or_else(|| format!("no agent {node}"))
    }
}

fn agent_get<T: serde::de::DeserializeOwned>(socket: &Path, path: &str) -> Option<T> {
    let r = Client::new(Endpoint::Unix(socket.to_path_buf()))
        .with_timeout(REQUEST_TIMEOUT)
        .request("GET", path, &[], b"")
        .ok()?;
    (r.status == 200).then(|| serde_json::from_slice(&r.body).ok())?
}

#[derive(serde::Deserialize)]
struct Row {
    replica: SocketAddrV4,
    listed: bool,
}

fn listed(socket: &Path, replica: SocketAddrV4) -> Option<bool> {
    let rows: Vec<Row> = agent_get(socket, "/proxy/replicas")?;
    Some(rows.iter().any(|r| r.replica == replica && r.listed))
}

fn ready(socket: &Path, jail: &str) -> Option<bool> {
    agent_get::<JailStatus>(socket, &format!("/jails/{jail}")).map(|j| j.ready)
}

/// `GET path` on the replica itself.
fn tell(replica: SocketAddrV4, path: &str) -> Result<(), String> {
    let r = Client::new(Endpoint::Tcp(replica.to_string()))
        .with_timeout(REQUEST_TIMEOUT)
        .request("GET", path, &[], b"")
        .map_err(|e| format!("{replica}{path}: {e}"))?;
    (r.status == 200)
        .then_some(())
        .ok_or_else(|| format!("{replica}{path}: HTTP {}", r.status))
}

/// One mode's figures: flip to the observer's proxy, both directions.
fn measure(push: bool, trials: usize) -> Result<Vec<f64>, String> {
    let mut cluster = Cluster::start(push)?;
    let port = port_free_on_both()?;
    let exe = std::env::current_exe().map_err(|e| format!("this bench's own path: {e}"))?;
    let threshold = if push { 20 } else { 70 };
    let doc = format!(
        "kind: Service\nmetadata: {{name: web}}\nspec:\n  replicas: 2\n  port: {port}\n  template:\n    base: 14.2-RELEASE\n    resources: {{cpu: 0.1}}\n    exec:\n      start: ['{}', replica, '{port}']\n    health:\n      http: {{port: {port}, path: /healthz}}\n      interval: 100ms\n      timeout: 100ms\n      failureThreshold: {threshold}\n",
        exe.display()
    );
    cluster.apply(&doc)?;
    let status: ServiceStatus = wait_until("2/2 ready", || {
        cluster
            .get::<ServiceStatus>("/services/web")
            .filter(|s| s.ready == 2)
    })?;
    let find = |name: &str| -> Result<(String, SocketAddrV4), String> {
        let r = status
            .replicas
            .iter()
            .find(|r| r.name == name)
            .ok_or_else(|| format!("{name} is not placed"))?;
        let ip = r.address.ok_or_else(|| format!("{name} has no address"))?;
        Ok((r.node.clone(), SocketAddrV4::new(ip, port)))
    };
    let (victim_node, victim) = find("web-1")?;
    let (observer, _) = find("web-0")?;
    if victim_node == observer {
        return Err(format!(
            "both replicas on {observer}; the scheduler should spread them"
        ));
    }
    let (victim_socket, observer_socket) =
        (cluster.socket(&victim_node)?, cluster.socket(&observer)?);
    wait_until("web-1 in the observer's proxy", || {
        listed(&observer_socket, victim).filter(|l| *l)
    })?;
    let mut figures = Vec::new();
    for trial in 1..=trials {
        let mut one = Vec::new();
        for (path, now_ready) in [("/fail", false), ("/heal", true)] {
            tell(victim, path)?;
            wait_until("web-1's readiness to flip", || {
                ready(&victim_socket, "web-1").filter(|r| *r == now_ready)
            })?;
            let flipped = Instant::now();
            wait_until("the observer's proxy to follow", || {
                listed(&observer_socket, victim).filter(|l| *l == now_ready)
            })?;
            one.push(flipped.elapsed().as_secs_f64());
        }
        println!(
            "  {} trial {trial:2}: not ready -> dropped {:6.3} s, ready -> listed {:6.3} s",
            if push { "push    " } else { "baseline" },
            one[0],
            one[1]
        );
        figures.extend(one);
    }
    Ok(figures)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn env_number(name: &str, default: usize) -> Result<usize, String> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| format!("{name}={v:?} is not a number")),
        Err(_) => Ok(default),
    }
}

fn run() -> Result<bool, String> {
    if !cfg!(target_os = "linux") {
        return Err("the endpoints bench needs Linux (two agents on 127.0.0.11-12)".into());
    }
    let trials = env_number("KEEL_BENCH_TRIALS", 10)?.max(1);
    let baseline_trials = env_number("KEEL_BENCH_BASELINE_TRIALS", 5)?.max(1);
    println!(
        "endpoints benchmark: keel-controlplane and 2 keel-agentd --simulate, default timings; {trials} trials with the push, {baseline_trials} without; load average {}",
        load_average()
    );
    let pushed = measure(true, trials)?;
    let baseline = measure(false, baseline_trials)?;
    let (pm, px) = (median(pushed.clone()), max(&pushed));
    let (bm, bx) = (median(baseline.clone()), max(&baseline));
    println!("flip -> other node's proxy, seconds (both directions):");
    println!(
        "  push:     median {pm:.3}, max {px:.3} ({} figures)",
        pushed.len()
    );
    println!(
        "  baseline: median {bm:.3}, max {bx:.3} ({} figures)",
        baseline.len()
    );
    println!(
        "  baseline / push: median {:.0}x, max {:.0}x",
        bm / pm.max(1e-3),
        bx / px.max(1e-3)
    );
    println!("load average after: {}", load_average());
    let met = px < TARGET.as_secs_f64();
    println!(
        "target: every push figure under {} s: {}",
        TARGET.as_secs_f64(),
        if met { "met" } else { "MISSED" }
    );
    Ok(met)
}

/// The replicas' workload: HTTP on `$KEEL_JAIL_ADDRESS:PORT`, `/healthz`
/// 200 (503 between `/fail` and `/heal`), everything else 200.
fn run_replica(port: &str) -> Result<(), String> {
    let port: u16 = port
        .parse()
        .map_err(|e| format!("replica port {port:?}: {e}"))?;
    let address: Ipv4Addr = std::env::var("KEEL_JAIL_ADDRESS")
        .map_err(|e| format!("KEEL_JAIL_ADDRESS (set by the simulated jail): {e}"))?
        .parse()
        .map_err(|e| format!("KEEL_JAIL_ADDRESS: {e}"))?;
    let failing = AtomicBool::new(false);
    let listener =
        TcpListener::bind((address, port)).map_err(|e| format!("bind {address}:{port}: {e}"))?;
    for conn in listener.incoming().flatten() {
        let _ = conn.set_read_timeout(Some(REQUEST_TIMEOUT));
        let mut line = String::new();
        let Ok(mut reader) = conn.try_clone().map(BufReader::new) else {
            continue;
        };
        if reader.read_line(&mut line).is_err() {
            continue;
        }
        // The rest of the head, up to its empty line.
        let mut header = String::new();
        while reader.read_line(&mut header).is_ok_and(|n| n > 2) {
            header.clear();
        }
        let path = line.split_whitespace().nth(1).unwrap_or("/");
        let status = match path {
            "/fail" => {
                failing.store(true, Ordering::SeqCst);
                "200 OK"
            }
            "/heal" => {
                failing.store(false, Ordering::SeqCst);
                "200 OK"
            }
            "/healthz" if failing.load(Ordering::SeqCst) => "503 Service Unavailable",
            _ => "200 OK",
        };
        let mut conn = conn;
        let _ = conn.write_all(
            format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let outcome = match args.get(1).map(String::as_str) {
        Some("replica") => run_replica(args.get(2).map_or("", String::as_str)).map(|()| true),
        // `cargo bench` passes `--bench`.
        _ => run(),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("endpoints bench: {e}");
            ExitCode::FAILURE
        }
    }
}
