//! A simulated cluster for process tests: one real `keel-controlplane
//! --simulate` and any number of real `keel-agentd --simulate` on loopback,
//! all started in one temp dir (so they share `./keel-sim/keys`, where the
//! control plane creates the node and operator keys), plus `keelctl` run
//! against it with the operator key.
//!
//! Each agent gets its own `--state-dir` (`./keel-sim/{id}`, which also holds
//! its simulated datasets: a jail's rootfs is `keel-sim/{id}/jails/{name}`)
//! and `--socket` (`./keel-sim/{id}.sock`).
//!
//! Any daemon can be started behind a command prefix (`Cluster::start_controlplane_in`,
//! `Cluster::start_agent_in`), e.g. `ip netns exec NS`, which execs the
//! daemon in network namespace NS (tests/partitions.rs). keelctl runs behind
//! the control plane's prefix, so it reaches the control plane from where
//! the control plane runs. `Cluster::start_controlplane_with` and
//! `Cluster::start_agent_with` add environment variables (`KEEL_SIM_FAULTS`),
//! and `Cluster::run_to_exit` runs a daemon that is expected to stop by
//! itself (refused at startup), failing the test if it keeps running.
//!
//! On drop every daemon still running is stopped (SIGTERM, then SIGKILL), and
//! only then every agent's simulated jails are removed through the simulated
//! host's own [`SimJails`], which signals each workload's process group after
//! proving it is the one that was started, as `util::agent` does. Agents
//! killed with [`Cluster::kill9_agent`] leave their jails running until then,
//! as a crashed agent would.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use keel::common::auth::{self, KeyFilePolicy, Signer};
use keel::common::http::failover::Failover;
use keel::common::http::{Client, ClientResponse, Endpoint};
use keel::common::wire::{Liveness, NodeStatus};
use keel::host::JailRuntime;
use keel::host::jail::Removal;
use keel::host::sim::SimJails;

use super::agent::terminate;

/// The binaries under test.
pub const CONTROLPLANE: &str = env!("CARGO_BIN_EXE_keel-controlplane");
/// See [`CONTROLPLANE`].
pub const AGENTD: &str = env!("CARGO_BIN_EXE_keel-agentd");
/// See [`CONTROLPLANE`].
pub const KEELCTL: &str = env!("CARGO_BIN_EXE_keelctl");

/// How long a daemon gets to start, or to stop after SIGTERM.
const STARTUP: Duration = Duration::from_secs(20);
/// How long [`Cluster::wait_for`] polls: heartbeats and reconcile passes run
/// every 200 ms in [`Cluster::standard`], so this is generous on a loaded
/// machine.
const CONVERGE: Duration = Duration::from_secs(30);
const STOP: Duration = Duration::from_secs(10);

/// How a daemon that exited by itself ended.
#[derive(Debug)]
pub struct Exited {
    /// Its exit status.
    pub status: ExitStatus,
    /// Everything it wrote on stdout and stderr.
    pub log: String,
}

/// What one keelctl run did.
#[derive(Debug)]
pub struct Run {
    /// Exit status.
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// A free TCP port on `ip` (bound and released; the daemon binds it next).
pub fn free_port(ip: Ipv4Addr) -> u16 {
    TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// A port free on the addresses of nodes 1 to `nodes` (every node's proxy
/// listens on a service's port).
pub fn port_free_on_nodes(nodes: u8) -> u16 {
    loop {
        let port = free_port(node_ip(1));
        if (2..=nodes).all(|n| TcpListener::bind((node_ip(n), port)).is_ok()) {
            return port;
        }
    }
}

/// Loopback address number `n` (1-based) for a node: distinct addresses on
/// Linux, where all of 127.0.0.0/8 answers, so routes name distinct
/// gateways; 127.0.0.1 elsewhere.
pub fn node_ip(n: u8) -> Ipv4Addr {
    if cfg!(target_os = "linux") {
        Ipv4Addr::new(127, 0, 0, 10 + n)
    } else {
        Ipv4Addr::LOCALHOST
    }
}

struct Daemon {
    /// Run before `program` (empty: `program` itself), e.g. `ip netns exec NS`.
    prefix: Vec<String>,
    program: &'static str,
    args: Vec<String>,
    /// Extra environment, e.g. `KEEL_SIM_FAULTS`.
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
}

impl Daemon {
    fn spawn(&mut self, dir: &Path) {
        // One process per daemon: a restart of one still running stops it
        // first, or the old one outlives the test, bound to its port.
        self.stop();
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let child = prefixed(&self.prefix, self.program)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone log handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.program));
        self.child = Some(child);
    }

    /// Polls `ready` until it holds; panics with the log if the daemon exits
    /// or the deadline passes.
    fn wait(&mut self, what: &str, mut ready: impl FnMut() -> bool) {
        let deadline = Instant::now() + STARTUP;
        while !ready() {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                panic!(
                    "{what} exited with {status} while starting:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{what} did not answer within {STARTUP:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the daemon to exit on its own; panics with `what` and the
    /// log (after stopping it) if it still runs after [`STARTUP`].
    fn wait_exit(&mut self, what: &str) -> ExitStatus {
        let deadline = Instant::now() + STARTUP;
        loop {
            let child = self.child.as_mut().expect("a running daemon");
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return status;
            }
            if Instant::now() >= deadline {
                self.stop();
                panic!("{what} still runs after {STARTUP:?}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL");
            child.wait().expect("reap");
        }
    }

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

struct Node {
    daemon: Daemon,
    socket: PathBuf,
    state_dir: PathBuf,
}

/// A control plane and its agents in one temp dir; see the module docs.
pub struct Cluster {
    dir: tempfile::TempDir,
    controlplane: Option<(Daemon, SocketAddr)>,
    /// Further control planes sharing the first one's state through etcd.
    standbys: Vec<(Daemon, SocketAddr)>,
    nodes: BTreeMap<String, Node>,
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster::new()
    }
}

impl Cluster {
    /// An empty cluster directory; start daemons with
    /// [`Cluster::start_controlplane`] and [`Cluster::start_agent`].
    pub fn new() -> Cluster {
        Cluster {
            dir: tempfile::tempdir().expect("tempdir"),
            controlplane: None,
            standbys: Vec::new(),
            nodes: BTreeMap::new(),
        }
    }

    /// The control plane of the process tests: `--listen` on a free port,
    /// heartbeats every 200 ms, Dead after 2 s; then `agents` agents `n1`,
    /// `n2`, ... on [`node_ip`] addresses, each with its own state dir and
    /// socket, heartbeating and reconciling every 200 ms, its service proxy
    /// listening on its [`node_ip`] (`--proxy-listen`).
    pub fn standard(agents: u8) -> Cluster {
        let mut cluster = Cluster::new();
        let port = free_port(Ipv4Addr::LOCALHOST);
        let args = standard_controlplane_args(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
        cluster.start_controlplane(&args.iter().map(String::as_str).collect::<Vec<_>>());
        for n in 1..=agents {
            cluster.start_standard_agent(n);
        }
        cluster
    }

    /// Starts agent `n{n}` of [`Cluster::standard`].
    pub fn start_standard_agent(&mut self, n: u8) {
        self.start_standard_agent_with_env(n, &[]);
    }

    /// [`Cluster::start_standard_agent`] with `env` added to the agent's
    /// environment (kept for [`Cluster::restart_agent`]), e.g.
    /// `KEEL_SIM_FAULTS` to stall one of its host commands.
    pub fn start_standard_agent_with_env(&mut self, n: u8, env: &[(&str, &str)]) {
        let ip = node_ip(n);
        let id = format!("n{n}");
        let args = self.standard_agent_args(&id, SocketAddr::from((ip, free_port(ip))), ip);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.start_agent_with(&id, &[], env, &args);
    }

    /// Starts agent `n{n}` of [`Cluster::standard`] given the control planes
    /// of `list` (`A,B`) instead of the one this cluster started.
    pub fn start_standard_agent_of(&mut self, n: u8, list: &str) {
        let ip = node_ip(n);
        self.start_standard_agent_of_at(n, list, SocketAddr::from((ip, free_port(ip))));
    }

    /// [`Cluster::start_standard_agent_of`] with the agent's API on
    /// `advertise` (one a control plane in a network namespace reaches).
    pub fn start_standard_agent_of_at(&mut self, n: u8, list: &str, advertise: SocketAddr) {
        let id = format!("n{n}");
        let mut args = self.standard_agent_args(&id, advertise, node_ip(n));
        let at = args
            .iter()
            .position(|a| a == "--controlplane")
            .expect("the standard agent names its control plane");
        args[at + 1] = list.to_string();
        self.start_agent(&id, &args.iter().map(String::as_str).collect::<Vec<_>>());
    }

    /// The arguments of agent `id` of [`Cluster::standard`]: its own state dir
    /// and socket in the cluster's directory, heartbeats and reconcile passes
    /// every 200 ms, its TCP listener on `advertise`, its service proxy on
    /// `proxy_ip` (several proxies on one host each need their own address).
    pub fn standard_agent_args(
        &self,
        id: &str,
        advertise: SocketAddr,
        proxy_ip: Ipv4Addr,
    ) -> Vec<String> {
        let sim = self.dir().join("keel-sim");
        vec![
            "--simulate".to_string(),
            "--controlplane".into(),
            self.controlplane_addr().to_string(),
            "--node-id".into(),
            id.to_string(),
            "--advertise-addr".into(),
            advertise.to_string(),
            "--state-dir".into(),
            sim.join(id).display().to_string(),
            "--socket".into(),
            sim.join(format!("{id}.sock")).display().to_string(),
            "--heartbeat-interval".into(),
            "200ms".into(),
            "--reconcile-interval".into(),
            "200ms".into(),
            "--proxy-listen".into(),
            proxy_ip.to_string(),
        ]
    }

    /// `keelctl args` against this cluster, which must exit 0 (else the
    /// test fails with the run and every daemon's log).
    pub fn keelctl_ok(&self, args: &[&str]) -> Run {
        let run = self.keelctl(args);
        assert_eq!(run.code, 0, "keelctl {args:?}: {run:?}\n{}", self.logs());
        run
    }

    /// Waits until `n` nodes are Alive.
    pub fn wait_alive(&self, n: usize) {
        self.wait_for(&format!("{n} Alive nodes"), || {
            let nodes: Vec<NodeStatus> =
                serde_json::from_str(&self.keelctl_ok(&["get", "nodes", "-o", "json"]).stdout)
                    .ok()?;
            let alive = nodes.iter().filter(|n| n.status == Liveness::Alive).count();
            (alive == n).then_some(())
        });
    }

    /// The directory every daemon runs in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Starts keel-controlplane with `args` (which must include `--simulate`
    /// and `--listen IP:PORT`) and waits until it answers `GET /healthz`.
    pub fn start_controlplane(&mut self, args: &[&str]) {
        self.start_controlplane_in(&[], args);
    }

    /// [`Cluster::start_controlplane`] behind `prefix` (see the module docs).
    /// With a prefix, readiness is `keelctl get nodes` behind the same prefix,
    /// since the test's own namespace may not reach the control plane.
    pub fn start_controlplane_in(&mut self, prefix: &[&str], args: &[&str]) {
        self.start_controlplane_with(prefix, &[], args);
    }

    /// [`Cluster::start_controlplane_in`] with extra environment variables.
    pub fn start_controlplane_with(
        &mut self,
        prefix: &[&str],
        env: &[(&str, &str)],
        args: &[&str],
    ) {
        assert!(self.controlplane.is_none(), "one control plane");
        let listen = flag_value(args, "--listen").expect("--listen IP:PORT");
        let addr: SocketAddr = listen.parse().expect("--listen is IP:PORT");
        let daemon = Daemon {
            prefix: prefix.iter().map(|a| a.to_string()).collect(),
            program: CONTROLPLANE,
            args: args.iter().map(|a| a.to_string()).collect(),
            env: owned_env(env),
            log: self.dir().join("controlplane.log"),
            child: None,
        };
        self.controlplane = Some((daemon, addr));
        self.launch_controlplane();
    }

    fn launch_controlplane(&mut self) {
        let dir = self.dir.path().to_path_buf();
        let key = self.operator_key();
        let (daemon, addr) = self.controlplane.as_mut().expect("a control plane");
        let client = Client::new(Endpoint::Tcp(addr.to_string())).with_timeout(STOP);
        let prefix = daemon.prefix.clone();
        let (addr_text, key_text) = (addr.to_string(), key.display().to_string());
        let get_nodes = [
            "--controlplane",
            addr_text.as_str(),
            "--key-file",
            key_text.as_str(),
            "get",
            "nodes",
        ];
        daemon.spawn(&dir);
        daemon.wait("keel-controlplane", || {
            if prefix.is_empty() {
                client
                    .request("GET", "/healthz", &[], b"")
                    .is_ok_and(|r| r.status == 200)
            } else {
                key.exists() && keelctl_in(&dir, &prefix, &get_nodes, &[], None).code == 0
            }
        });
    }

    /// Starts keel-agentd as node `id` with `args` (which must include
    /// `--simulate`, `--state-dir` and `--socket`) and waits until it answers
    /// on its socket.
    pub fn start_agent(&mut self, id: &str, args: &[&str]) {
        self.start_agent_in(id, &[], args);
    }

    /// [`Cluster::start_agent`] behind `prefix` (see the module docs); the
    /// agent's socket is a file, so it answers the test from any namespace.
    pub fn start_agent_in(&mut self, id: &str, prefix: &[&str], args: &[&str]) {
        self.start_agent_with(id, prefix, &[], args);
    }

    /// [`Cluster::start_agent_in`] with extra environment variables.
    pub fn start_agent_with(
        &mut self,
        id: &str,
        prefix: &[&str],
        env: &[(&str, &str)],
        args: &[&str],
    ) {
        let path = |flag| PathBuf::from(flag_value(args, flag).expect("state dir and socket"));
        let socket = path("--socket");
        let mut daemon = Daemon {
            prefix: prefix.iter().map(|a| a.to_string()).collect(),
            program: AGENTD,
            args: args.iter().map(|a| a.to_string()).collect(),
            env: owned_env(env),
            log: self.dir().join(format!("{id}.log")),
            child: None,
        };
        daemon.spawn(self.dir());
        let client = Client::new(Endpoint::Unix(socket.clone())).with_timeout(STOP);
        daemon.wait(&format!("keel-agentd {id}"), || {
            client
                .request("GET", "/healthz", &[], b"")
                .is_ok_and(|r| r.status == 200)
        });
        let node = Node {
            daemon,
            socket,
            state_dir: path("--state-dir"),
        };
        assert!(
            self.nodes.insert(id.to_string(), node).is_none(),
            "{id} twice"
        );
    }

    /// Runs a daemon (`program`, [`AGENTD`] or [`CONTROLPLANE`]) with `args`
    /// in the cluster's directory that is expected to exit by itself, e.g.
    /// refused at startup; its output goes to `{name}.log`. Panics (after
    /// stopping it) if it is still running after the startup deadline.
    pub fn run_to_exit(&self, name: &str, program: &'static str, args: &[&str]) -> Exited {
        let mut daemon = Daemon {
            prefix: Vec::new(),
            program,
            args: args.iter().map(|a| a.to_string()).collect(),
            env: Vec::new(),
            log: self.dir().join(format!("{name}.log")),
            child: None,
        };
        daemon.spawn(self.dir());
        let status = daemon.wait_exit(name);
        Exited {
            status,
            log: daemon.log(),
        }
    }

    /// Waits until node `id`'s agent exits by itself (a test made it fail);
    /// its exit status and log.
    pub fn wait_agent_exit(&mut self, id: &str) -> Exited {
        let daemon = &mut self.nodes.get_mut(id).expect("a node").daemon;
        let status = daemon.wait_exit(&format!("keel-agentd {id}"));
        Exited {
            status,
            log: daemon.log(),
        }
    }

    /// Waits until the control plane exits by itself; its status and log.
    pub fn wait_controlplane_exit(&mut self) -> Exited {
        let (daemon, _) = self.controlplane.as_mut().expect("a control plane");
        let status = daemon.wait_exit("keel-controlplane");
        Exited {
            status,
            log: daemon.log(),
        }
    }

    /// The control plane's `IP:PORT`.
    pub fn controlplane_addr(&self) -> SocketAddr {
        self.controlplane.as_ref().expect("a control plane").1
    }

    /// The operator key the simulated control plane created and accepts.
    pub fn operator_key(&self) -> PathBuf {
        self.dir().join("keel-sim/keys/operator.key")
    }

    /// A request to the control plane signed with [`Cluster::operator_key`];
    /// `None` when it does not answer.
    pub fn operator_call(&self, method: &str, path: &str, body: &[u8]) -> Option<ClientResponse> {
        let headers = operator_headers(&self.operator_key(), method, path, body);
        Client::new(Endpoint::Tcp(self.controlplane_addr().to_string()))
            .request(method, path, &headers, body)
            .ok()
    }

    /// [`Cluster::operator_call`] to the control planes of `list` (`A,B`);
    /// see [`operator_call_through_at`].
    pub fn operator_call_through(
        &self,
        list: &str,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> Option<ClientResponse> {
        operator_call_through_at(&self.operator_key(), list, method, path, body)
    }

    /// The arguments of a control plane of [`standard_controlplane_args`]
    /// on `listen`, Dead after `dead_after`, with its own state directory
    /// `name` in the cluster's directory, keeping the state in the etcd
    /// members of `etcd` (`URL,URL`): several of them share one cluster,
    /// one leading.
    pub fn etcd_controlplane_args(
        &self,
        listen: SocketAddr,
        name: &str,
        etcd: &str,
        dead_after: Duration,
    ) -> Vec<String> {
        let mut args = controlplane_args_dead_after(listen, dead_after);
        args.extend([
            "--state-dir".into(),
            self.dir().join(name).display().to_string(),
            "--etcd-endpoints".into(),
            etcd.to_string(),
        ]);
        args
    }

    /// Node `id`'s state directory.
    pub fn state_dir(&self, id: &str) -> PathBuf {
        self.nodes[id].state_dir.clone()
    }

    /// Node `id`'s API socket.
    pub fn socket(&self, id: &str) -> PathBuf {
        self.nodes[id].socket.clone()
    }

    /// `kill -9` of node `id`'s agent: its jails keep running.
    pub fn kill9_agent(&mut self, id: &str) {
        self.nodes.get_mut(id).expect("a node").daemon.kill9();
    }

    /// Loses node `id`: `kill -9` of its agent, then of every jail it runs
    /// (each workload's process group, through the simulated host). Its
    /// records stay, as on a host that lost power; [`Cluster::restart_agent`]
    /// brings it back.
    pub fn kill9_node(&mut self, id: &str) {
        self.kill9_agent(id);
        let jails = SimJails::new(&self.nodes[id].state_dir.join("sim")).expect("jail table");
        for jail in jails.list().expect("list jails") {
            jails
                .remove(&jail.name, &jail.path, Removal::Force)
                .expect("kill the jail's workload");
        }
    }

    /// Starts node `id`'s agent again with the same arguments (after
    /// [`Cluster::kill9_agent`]); its jails were left running.
    pub fn restart_agent(&mut self, id: &str) {
        let dir = self.dir().to_path_buf();
        let node = self.nodes.get_mut(id).expect("a node");
        node.daemon.spawn(&dir);
        let client = Client::new(Endpoint::Unix(node.socket.clone())).with_timeout(STOP);
        node.daemon.wait(&format!("keel-agentd {id}"), || {
            client
                .request("GET", "/healthz", &[], b"")
                .is_ok_and(|r| r.status == 200)
        });
    }

    /// `kill -9` of the control plane.
    pub fn kill9_controlplane(&mut self) {
        self.controlplane
            .as_mut()
            .expect("a control plane")
            .0
            .kill9();
    }

    /// `kill -TERM` of the control plane, waiting until it has exited.
    pub fn stop_controlplane(&mut self) {
        self.controlplane
            .as_mut()
            .expect("a control plane")
            .0
            .stop();
    }

    /// Starts the control plane again with the same arguments and directory.
    pub fn restart_controlplane(&mut self) {
        self.launch_controlplane();
    }

    /// Starts another keel-controlplane with `args` (`--simulate`,
    /// `--listen`, its own `--state-dir` and the first one's etcd), and
    /// waits until it answers as a standby; answers its index for
    /// [`Cluster::kill9_standby`] and [`Cluster::standby_answers`].
    pub fn start_standby(&mut self, args: &[&str]) -> usize {
        let listen = flag_value(args, "--listen").expect("--listen IP:PORT");
        let addr: SocketAddr = listen.parse().expect("--listen is IP:PORT");
        let i = self.standbys.len();
        let mut daemon = Daemon {
            prefix: Vec::new(),
            program: CONTROLPLANE,
            args: args.iter().map(|a| a.to_string()).collect(),
            env: Vec::new(),
            log: self.dir().join(format!("controlplane-standby-{i}.log")),
            child: None,
        };
        daemon.spawn(self.dir.path());
        let client = Client::new(Endpoint::Tcp(addr.to_string())).with_timeout(STOP);
        daemon.wait("keel-controlplane (standby)", || {
            client
                .request("GET", "/healthz", &[], b"")
                .is_ok_and(|r| r.status == 503 && r.header("Keel-Standby").is_some())
        });
        self.standbys.push((daemon, addr));
        i
    }

    /// The status `GET /healthz` of standby `i` answers, if it answers.
    pub fn standby_answers(&self, i: usize) -> Option<u16> {
        let client = Client::new(Endpoint::Tcp(self.standbys[i].1.to_string())).with_timeout(STOP);
        client
            .request("GET", "/healthz", &[], b"")
            .ok()
            .map(|r| r.status)
    }

    /// `kill -9` of standby `i` (which may lead by now).
    pub fn kill9_standby(&mut self, i: usize) {
        self.standbys[i].0.kill9();
    }

    /// `kill -9` of the control plane, then another started with `args` in
    /// the same directory (so over the same state), e.g. on another
    /// address: a control plane replaced by a standby.
    pub fn replace_controlplane(&mut self, args: &[&str]) {
        if let Some((mut old, _)) = self.controlplane.take() {
            old.kill9();
        }
        self.start_controlplane(args);
    }

    /// Polls `probe` every 20 ms until it returns `Some`, or panics naming
    /// `what`, with every daemon's log.
    pub fn wait_for<T>(&self, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
        let start = Instant::now();
        loop {
            if let Some(v) = probe() {
                return v;
            }
            assert!(
                start.elapsed() < CONVERGE,
                "timed out waiting for {what}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The control plane's pid, while it runs.
    pub fn controlplane_pid(&self) -> Option<u32> {
        let (cp, _) = self.controlplane.as_ref()?;
        cp.child.as_ref().map(Child::id)
    }

    /// Node `id`'s agent's pid, while it runs.
    pub fn agent_pid(&self, id: &str) -> Option<u32> {
        self.nodes[id].daemon.child.as_ref().map(Child::id)
    }

    /// What node `id`'s agent wrote on stderr so far.
    pub fn agent_log(&self, id: &str) -> String {
        self.nodes[id].daemon.log()
    }

    /// The control plane's log so far.
    pub fn controlplane_log(&self) -> String {
        self.controlplane.as_ref().expect("a control plane").0.log()
    }

    /// Every daemon's log, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        if let Some((cp, _)) = &self.controlplane {
            out.push_str(&format!("--- keel-controlplane\n{}", cp.log()));
        }
        for (i, (cp, _)) in self.standbys.iter().enumerate() {
            out.push_str(&format!("--- keel-controlplane standby {i}\n{}", cp.log()));
        }
        for (id, node) in &self.nodes {
            out.push_str(&format!("--- keel-agentd {id}\n{}", node.daemon.log()));
        }
        out
    }

    /// keelctl through the control planes of `list` (`A,B`) instead of the
    /// one this cluster started, signed with the operator key.
    pub fn keelctl_through(&self, list: &str, args: &[&str], stdin: Option<&str>) -> Run {
        keelctl_through_at(self.dir(), &self.operator_key(), list, args, stdin)
    }

    /// keelctl through the control plane, signed with the operator key.
    pub fn keelctl(&self, args: &[&str]) -> Run {
        self.keelctl_with(args, None)
    }

    /// [`Cluster::keelctl`] with `stdin` (for `apply -f -`).
    pub fn keelctl_with(&self, args: &[&str], stdin: Option<&str>) -> Run {
        let addr = self.controlplane_addr().to_string();
        let key = self.operator_key();
        let mut all = vec!["--controlplane", &addr, "--key-file"];
        all.push(key.to_str().expect("utf-8 path"));
        all.extend_from_slice(args);
        self.keelctl_raw(&all, &[], stdin)
    }

    /// keelctl with exactly `args` and `env`, in the cluster's directory,
    /// with `stdin` if given (none of the caller's KEEL_* variables leak in).
    pub fn keelctl_raw(&self, args: &[&str], env: &[(&str, &str)], stdin: Option<&str>) -> Run {
        let prefix = match &self.controlplane {
            Some((cp, _)) => cp.prefix.as_slice(),
            None => &[],
        };
        keelctl_in(self.dir(), prefix, args, env, stdin)
    }
}

/// The control plane's arguments in [`Cluster::standard`]: simulated,
/// listening on `listen`, heartbeats every 200 ms, Dead after 2 s (ten
/// missed heartbeats: a loaded CI machine can stall an agent for a second).
pub fn standard_controlplane_args(listen: SocketAddr) -> Vec<String> {
    [
        "--simulate",
        "--listen",
        &listen.to_string(),
        "--heartbeat-interval",
        "200ms",
        "--dead-after",
        "2s",
    ]
    .map(String::from)
    .to_vec()
}

/// [`standard_controlplane_args`] with nodes Dead after `dead_after`
/// instead of 2 s.
pub fn controlplane_args_dead_after(listen: SocketAddr, dead_after: Duration) -> Vec<String> {
    let mut args = standard_controlplane_args(listen);
    let at = args
        .iter()
        .position(|a| a == "--dead-after")
        .expect("standard arguments set --dead-after");
    args[at + 1] = format!("{}ms", dead_after.as_millis());
    args
}

/// The `Authorization` header of a request signed with the operator key
/// `key`.
fn operator_headers(key: &Path, method: &str, path: &str, body: &[u8]) -> Vec<(String, String)> {
    let key = auth::load_key(key, KeyFilePolicy::for_current_process()).expect("the operator key");
    auth::sign_headers(&Signer::new(key), method, path, body, auth::unix_now()).expect("sign")
}

/// A request signed with the operator key `key` to the control planes of
/// `list` (`A,B`) as keelctl sends it (to the one that takes the
/// connection and is no standby), but asking once: a standby's 503 when
/// no control plane leads, `None` when none answers. For a thread that
/// cannot borrow the cluster while the test changes it.
pub fn operator_call_through_at(
    key: &Path,
    list: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> Option<ClientResponse> {
    let headers = operator_headers(key, method, path, body);
    Failover::tcp(list)
        .with_timeout(STOP)
        .request(method, path, &headers, body)
        .ok()
}

/// keelctl through the control planes of `list` (`A,B`), signed with
/// `key`, in `dir` (a [`Cluster::dir`]): for a thread that cannot borrow
/// the cluster while the test changes it.
pub fn keelctl_through_at(
    dir: &Path,
    key: &Path,
    list: &str,
    args: &[&str],
    stdin: Option<&str>,
) -> Run {
    let mut all = vec![
        "--controlplane",
        list,
        "--key-file",
        key.to_str().expect("utf-8 path"),
    ];
    all.extend_from_slice(args);
    keelctl_in(dir, &[], &all, &[], stdin)
}

/// keelctl behind `prefix` (see [`prefixed`]) in `dir`; see
/// [`Cluster::keelctl_raw`].
fn keelctl_in(
    dir: &Path,
    prefix: &[String],
    args: &[&str],
    env: &[(&str, &str)],
    stdin: Option<&str>,
) -> Run {
    let mut cmd = prefixed(prefix, KEELCTL);
    cmd.args(args)
        .current_dir(dir)
        .env_remove("KEEL_SOCKET")
        .env_remove("KEEL_CONTROLPLANE")
        .envs(env.iter().copied());
    run(cmd, stdin)
}

/// Runs `cmd` (a keelctl with its arguments, directory and environment set)
/// to the end, feeding it `stdin` if given, and captures what it printed.
pub fn run(mut cmd: Command, stdin: Option<&str>) -> Run {
    use std::io::Write;
    // The user's own contexts file (~/.config/keel/config.toml) must not
    // choose where a test's requests go: unless the test names one, keelctl
    // looks for it where there is none.
    if !cmd.get_envs().any(|(k, _)| k == "XDG_CONFIG_HOME") {
        cmd.env("XDG_CONFIG_HOME", "/nonexistent/keel-tests");
    }
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn keelctl");
    if let Some(text) = stdin {
        let mut pipe = child.stdin.take().expect("stdin pipe");
        pipe.write_all(text.as_bytes()).expect("write stdin");
    }
    let out = child.wait_with_output().expect("keelctl runs");
    Run {
        code: out.status.code().expect("keelctl exited, not killed"),
        stdout: String::from_utf8(out.stdout).expect("utf-8 stdout"),
        stderr: String::from_utf8(out.stderr).expect("utf-8 stderr"),
    }
}

/// `program`, or `prefix` with `program` as its next argument.
fn prefixed(prefix: &[String], program: &str) -> Command {
    match prefix.split_first() {
        None => Command::new(program),
        Some((first, rest)) => {
            let mut cmd = Command::new(first);
            cmd.args(rest).arg(program);
            cmd
        }
    }
}

fn owned_env(env: &[(&str, &str)]) -> Vec<(String, String)> {
    env.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn flag_value<'a>(args: &[&'a str], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| *a == flag)
        .and_then(|i| args.get(i + 1).copied())
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in self.nodes.values_mut() {
            node.daemon.stop();
        }
        if let Some((cp, _)) = self.controlplane.as_mut() {
            cp.stop();
        }
        for (cp, _) in &mut self.standbys {
            cp.stop();
        }
        // Only now, with no agent left to start one, are the jail tables final.
        for (id, node) in &self.nodes {
            let Ok(jails) = SimJails::new(&node.state_dir.join("sim")) else {
                eprintln!("cannot open {id}'s simulated jail table; jails may be left running");
                continue;
            };
            for jail in jails.list().unwrap_or_default() {
                if let Err(e) = jails.remove(&jail.name, &jail.path, Removal::Force) {
                    eprintln!("cleaning up {id}'s simulated jail {}: {e}", jail.name);
                }
            }
        }
    }
}
