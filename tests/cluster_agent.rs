//! A real `keel-agentd --simulate` in a cluster, against a fake control plane
//! served from the test: it registers with its capacity, adopts the pod_cidr,
//! serves its API on the TCP listener, heartbeats what its jails commit,
//! routes Alive peers, fences a stale placed jail but never a local one, and
//! keeps everything when the control plane goes away. Every request to the
//! control plane is signed with the node key, and the agent's TCP listener
//! refuses anything not signed with one (the Unix socket needs no signature).

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use keel::common::auth::{
    Key, Keyring, Role, Signer, Verifier, generate_key, sign_headers, unix_now, verify_request,
    write_key_file,
};
use keel::common::cidr::Ipv4Net;
use keel::common::http::{
    Client, ClientResponse, Endpoint, Request, Response, Server, ServerLimits, ShutdownSignal,
};
use keel::common::wire::{
    EPOCH_HEADER, HeartbeatRequest, HeartbeatResponse, JailStatus, Peer, RegisterRequest,
    RegisterResponse,
};

/// Bound on every wait: a deadline, not a timing claim.
const DEADLINE: Duration = Duration::from_secs(20);
const POD_CIDR: &str = "127.64.9.0/24";

/// What the fake control plane was sent and answers with.
#[derive(Default)]
struct CpState {
    registrations: Vec<RegisterRequest>,
    heartbeats: Vec<HeartbeatRequest>,
    /// Path of every heartbeat (the node id is in it).
    heartbeat_paths: Vec<String>,
    peers: Vec<Peer>,
    /// When set, the peer list's version: a heartbeat holding it is answered
    /// "unchanged" with no peers, as keel-controlplane does.
    peers_version: Option<u64>,
    stale: Vec<String>,
    /// Requests refused for a missing or bad signature.
    refused: usize,
}

struct FakeControlPlane {
    addr: SocketAddr,
    state: Arc<Mutex<CpState>>,
    shutdown: ShutdownSignal,
    accept: Option<JoinHandle<()>>,
}

impl FakeControlPlane {
    /// A control plane accepting requests signed with `node_key`.
    fn start(node_key: &Key) -> FakeControlPlane {
        let state = Arc::new(Mutex::new(CpState::default()));
        let shared = Arc::clone(&state);
        let keyring = Keyring::new(vec![node_key.clone()], vec![]).expect("keyring");
        let verifier = Verifier::new(keyring, Duration::from_secs(300));
        let handler = move |req: Request| -> Response {
            let mut st = shared.lock().expect("cp state");
            if verify_request(&verifier, &req, Role::Node, unix_now()).is_err() {
                st.refused += 1;
                return Response::error(401, "unsigned", None);
            }
            match (req.method.as_str(), req.segments().as_slice()) {
                ("POST", ["nodes", "register"]) => {
                    let body: RegisterRequest =
                        serde_json::from_slice(&req.body).expect("register body");
                    st.registrations.push(body);
                    Response::json(
                        200,
                        &RegisterResponse {
                            pod_cidr: POD_CIDR.into(),
                        },
                    )
                }
                ("POST", ["nodes", _, "heartbeat"]) => {
                    let body: HeartbeatRequest =
                        serde_json::from_slice(&req.body).expect("heartbeat body");
                    let unchanged =
                        st.peers_version.is_some() && body.peers_version == st.peers_version;
                    st.heartbeats.push(body);
                    st.heartbeat_paths.push(req.path.clone());
                    Response::json(
                        200,
                        &HeartbeatResponse {
                            peers_changed: None,
                            peers_removed: vec![],
                            endpoints_unchanged: false,
                            endpoints_generation: None,
                            endpoints_origin: None,
                            peers: if unchanged { vec![] } else { st.peers.clone() },
                            stale: st.stale.clone(),
                            services: vec![],
                            peers_version: st.peers_version,
                            peers_unchanged: unchanged,
                            services_changed: None,
                            services_removed: Vec::new(),
                        },
                    )
                }
                _ => Response::error(404, "no such route", None),
            }
        };
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake control plane");
        let addr = listener.local_addr().expect("address");
        let shutdown = ShutdownSignal::new();
        let server = Server::new(Arc::new(handler), ServerLimits::default(), shutdown.clone());
        let accept = server.serve_tcp(listener).expect("serve");
        FakeControlPlane {
            addr,
            state,
            shutdown,
            accept: Some(accept),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut CpState) -> T) -> T {
        f(&mut self.state.lock().expect("cp state"))
    }

    fn heartbeat_count(&self) -> usize {
        self.with(|s| s.heartbeats.len())
    }

    /// Closes the listener: from now on the agent cannot connect.
    fn stop(&mut self) {
        self.shutdown.trigger();
        if let Some(t) = self.accept.take() {
            t.join().expect("accept loop");
        }
    }
}

impl Drop for FakeControlPlane {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

/// The agent process; killed on drop together with its simulated jails
/// (they run in process groups of their own and outlive the agent).
struct Agent {
    child: Mutex<Child>,
    dir: tempfile::TempDir,
    tcp: SocketAddr,
}

impl Agent {
    /// An agent in `dir` signing with the key file `key`, which is also the
    /// only node key its TCP listener accepts.
    fn start(controlplane: SocketAddr, dir: tempfile::TempDir, key: &Path) -> Agent {
        let tcp = free_port();
        let config = dir.path().join("keel.toml");
        let key = key.display().to_string();
        std::fs::write(
            &config,
            format!("[agent]\nkey_file = {key:?}\n\n[auth]\nnode_keys = [{key:?}]\n"),
        )
        .expect("write keel.toml");
        let log = std::fs::File::create(dir.path().join("agentd.log")).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_keel-agentd"))
            .args([
                "--simulate",
                "--node-id",
                "n1",
                "--heartbeat-interval",
                "100ms",
            ])
            .arg("--config")
            .arg(&config)
            .arg("--controlplane")
            .arg(controlplane.to_string())
            .arg("--advertise-addr")
            .arg(tcp.to_string())
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn keel-agentd");
        Agent {
            child: Mutex::new(child),
            dir,
            tcp,
        }
    }

    fn sim_dir(&self) -> PathBuf {
        self.dir.path().join("keel-sim/agentd/sim")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agentd.log")).unwrap_or_default()
    }

    fn unix(&self) -> Client {
        Client::new(Endpoint::Unix(self.dir.path().join("keel-sim/agentd.sock")))
            .with_timeout(DEADLINE)
    }

    fn tcp(&self) -> Client {
        Client::new(Endpoint::Tcp(self.tcp.to_string())).with_timeout(DEADLINE)
    }

    /// Routes in the simulated kernel table: destination -> gateway.
    fn routes(&self) -> serde_json::Value {
        std::fs::read_to_string(self.sim_dir().join("sim-net.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .map(|v| v["routes"].clone())
            .unwrap_or_default()
    }

    /// Polls `f` until it gives a value; panics with the agent's log after
    /// [`DEADLINE`].
    fn await_some<T>(&self, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let end = Instant::now() + DEADLINE;
        loop {
            if let Some(v) = f() {
                return v;
            }
            let exited = self.child.lock().expect("child").try_wait().ok().flatten();
            if let Some(code) = exited {
                panic!(
                    "keel-agentd exited ({code}) while waiting for {what}; its log:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < end,
                "timed out waiting for {what}; agent log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(child) = self.child.get_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        kill_sim_jails(&self.sim_dir());
    }
}

/// SIGKILLs the process group of every simulated jail recorded in `dir`.
fn kill_sim_jails(dir: &Path) {
    let Ok(text) = std::fs::read_to_string(dir.join("sim-jails.json")) else {
        return;
    };
    let Ok(table) = serde_json::from_str::<serde_json::Value>(&text) else {
        return;
    };
    let pids = table["jails"]
        .as_object()
        .into_iter()
        .flat_map(|jails| jails.values())
        .filter_map(|j| j["pid"].as_i64())
        .filter_map(|pid| i32::try_from(pid).ok())
        .filter(|pid| *pid > 1);
    for pid in pids {
        kill_group(pid);
    }
}

#[allow(unsafe_code)]
fn kill_group(pgid: i32) {
    // SAFETY: kill(2) takes plain integers and touches no memory of ours; a
    // negative pid addresses the process group the simulated runtime created
    // for this jail (its leader's pid, > 1, so never "every process").
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

/// A port nothing listens on right now (bound, read and released; another
/// process could take it in between, which these tests accept).
fn free_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind :0");
    l.local_addr().expect("address")
}

fn jail_yaml(name: &str, cpu: &str, memory: &str) -> String {
    format!(
        "kind: Jail\nmetadata:\n  name: {name}\nspec:\n  base: 14.2-RELEASE\n  resources:\n    cpu: {cpu}\n    memory: {memory}\n  exec:\n    start: [\"/bin/sleep\", \"300\"]\n"
    )
}

fn status(resp: &ClientResponse) -> JailStatus {
    assert_eq!(resp.status, 200, "{}", String::from_utf8_lossy(&resp.body));
    serde_json::from_slice(&resp.body).expect("jail status")
}

fn get(client: &Client, path: &str) -> Option<ClientResponse> {
    client.request("GET", path, &[], b"").ok()
}

/// Signature headers for one request.
fn signed(signer: &Signer, method: &str, path: &str, body: &[u8]) -> Vec<(String, String)> {
    sign_headers(signer, method, path, body, unix_now()).expect("sign")
}

/// A key written to `dir/ID.key` (mode 0600, ours).
fn key_file(dir: &Path, id: &str) -> (Key, PathBuf) {
    let key = generate_key(id).expect("key");
    let path = dir.join(format!("{id}.key"));
    write_key_file(&path, &key).expect("write key");
    (key, path)
}

#[test]
fn a_clustered_agent_registers_heartbeats_routes_fences_and_survives_the_control_plane() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (node_key, node_key_path) = key_file(dir.path(), "node-1");
    let node = Signer::new(node_key.clone());
    let mut cp = FakeControlPlane::start(&node_key);
    let agent = Agent::start(cp.addr, dir, &node_key_path);
    let pod: Ipv4Net = POD_CIDR.parse().expect("pod cidr");

    // Registration carries the node id, the advertise address and the
    // machine's capacity.
    let reg = agent.await_some("registration", || {
        cp.with(|s| s.registrations.first().cloned())
    });
    assert_eq!(reg.node_id, "n1");
    assert_eq!(reg.advertise_addr, agent.tcp);
    assert!(reg.capacity.cpu >= 1.0, "{:?}", reg.capacity);
    assert!(reg.capacity.memory > 0, "{:?}", reg.capacity);

    // Heartbeats start once the pod_cidr is adopted; the API answers on TCP.
    agent.await_some("a heartbeat", || (cp.heartbeat_count() > 0).then_some(()));
    assert!(
        cp.with(|s| s.heartbeat_paths.iter().all(|p| p == "/nodes/n1/heartbeat")),
        "heartbeats go to the node's own path"
    );
    let health = agent.await_some("the TCP listener", || {
        agent
            .tcp()
            .request(
                "GET",
                "/healthz",
                &signed(&node, "GET", "/healthz", b""),
                b"",
            )
            .ok()
    });
    assert_eq!(health.status, 200);

    // The TCP listener wants a node signature: none, an unknown key, or a
    // replayed header get 401; the Unix socket needs none.
    let unsigned = get(&agent.tcp(), "/jails").expect("answered");
    assert_eq!(unsigned.status, 401);
    let stranger = Signer::new(generate_key("operator-1").expect("key"));
    let foreign = agent
        .tcp()
        .request(
            "GET",
            "/jails",
            &signed(&stranger, "GET", "/jails", b""),
            b"",
        )
        .expect("answered");
    assert_eq!(foreign.status, 401);
    let once = signed(&node, "GET", "/jails", b"");
    assert_eq!(
        agent
            .tcp()
            .request("GET", "/jails", &once, b"")
            .expect("answered")
            .status,
        200
    );
    assert_eq!(
        agent
            .tcp()
            .request("GET", "/jails", &once, b"")
            .expect("answered")
            .status,
        401,
        "a replayed signature is refused"
    );
    assert_eq!(get(&agent.unix(), "/jails").expect("answered").status, 200);

    // A local apply (Unix socket, no epoch) and a placed one (TCP, with the
    // epoch header) both get addresses in the pod_cidr.
    let local = status(
        &agent
            .unix()
            .request(
                "PUT",
                "/jails/local-1",
                &[],
                jail_yaml("local-1", "0.5", "64M").as_bytes(),
            )
            .expect("local apply"),
    );
    assert!(pod.contains(local.address), "{}", local.address);
    assert_eq!(local.epoch, None);
    let body = jail_yaml("placed-1", "1", "128M");
    let mut headers = signed(&node, "PUT", "/jails/placed-1", body.as_bytes());
    headers.push((EPOCH_HEADER.to_string(), "3".to_string()));
    let answer = agent
        .tcp()
        .request("PUT", "/jails/placed-1", &headers, body.as_bytes())
        .expect("placed apply");
    // The answer carries what the node commits now, both jails together,
    // so the control plane can rank it before the next heartbeat.
    assert_eq!(
        answer
            .header(keel::common::wire::COMMITTED_HEADER)
            .and_then(keel::common::wire::parse_committed),
        Some(keel::common::wire::Resources {
            cpu: 1.5,
            memory: 192 << 20
        })
    );
    let placed = status(&answer);
    assert!(pod.contains(placed.address), "{}", placed.address);
    assert_eq!(placed.epoch, Some(3));

    // The next heartbeats report what the two jails commit, and the placed one.
    let hb = agent.await_some("a heartbeat with both jails", || {
        cp.with(|s| s.heartbeats.iter().find(|h| h.jails == 2).cloned())
    });
    assert_eq!(hb.committed.cpu, 1.5);
    assert_eq!(hb.committed.memory, 192 << 20);
    assert_eq!(hb.placed.len(), 1);
    assert_eq!(hb.placed[0].name, "placed-1");
    assert_eq!(hb.placed[0].epoch, 3);

    // An Alive peer is routed via its address; a Dead one is not.
    cp.with(|s| {
        s.peers = vec![
            Peer {
                node_id: "n2".into(),
                address: Ipv4Addr::new(127, 0, 0, 2),
                pod_cidr: "127.64.10.0/24".into(),
                alive: true,
            },
            Peer {
                node_id: "n3".into(),
                address: Ipv4Addr::new(127, 0, 0, 3),
                pod_cidr: "127.64.11.0/24".into(),
                alive: false,
            },
        ]
    });
    agent.await_some("the route to n2", || {
        (agent.routes()["127.64.10.0/24"] == "127.0.0.2").then_some(())
    });
    assert!(agent.routes().get("127.64.11.0/24").is_none());

    // Fencing: both names come back stale; only the placed jail goes.
    cp.with(|s| s.stale = vec!["placed-1".into(), "local-1".into()]);
    agent.await_some("placed-1 fenced", || {
        get(&agent.unix(), "/jails/placed-1").and_then(|r| (r.status == 404).then_some(()))
    });
    let seen = cp.heartbeat_count();
    agent.await_some("two more heartbeats", || {
        (cp.heartbeat_count() >= seen + 2).then_some(())
    });
    let local = get(&agent.unix(), "/jails/local-1").expect("local-1 answered");
    assert_eq!(
        status(&local).name,
        "local-1",
        "a local jail is never fenced"
    );
    cp.with(|s| s.stale.clear());

    // The control plane goes away: the node keeps its jail, routes and API.
    cp.stop();
    agent.await_some("a failed heartbeat in the log", || {
        agent
            .log()
            .contains("keeping every jail and route")
            .then_some(())
    });
    let health = agent
        .tcp()
        .request(
            "GET",
            "/healthz",
            &signed(&node, "GET", "/healthz", b""),
            b"",
        )
        .expect("TCP listener still up");
    assert_eq!(health.status, 200);
    assert_eq!(
        cp.with(|s| s.refused),
        0,
        "every request to the control plane was signed"
    );
    let local = status(&get(&agent.unix(), "/jails/local-1").expect("local-1"));
    assert!(local.state.runs(), "{local:?}");
    assert_eq!(agent.routes()["127.64.10.0/24"], "127.0.0.2");
}

#[test]
fn a_clustered_agent_asks_for_the_peer_list_only_when_it_changed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (node_key, node_key_path) = key_file(dir.path(), "node-1");
    let cp = FakeControlPlane::start(&node_key);
    let n2 = |alive| Peer {
        node_id: "n2".into(),
        address: Ipv4Addr::new(127, 0, 0, 2),
        pod_cidr: "127.64.10.0/24".into(),
        alive,
    };
    cp.with(|s| {
        s.peers = vec![n2(true)];
        s.peers_version = Some(7);
    });
    let agent = Agent::start(cp.addr, dir, &node_key_path);
    agent.await_some("the route to n2", || {
        (agent.routes()["127.64.10.0/24"] == "127.0.0.2").then_some(())
    });
    // From now on every heartbeat holds version 7 and gets "unchanged" with
    // an empty list: the route must stay.
    let seen = agent.await_some("a heartbeat holding version 7", || {
        cp.with(|s| s.heartbeats.iter().position(|h| h.peers_version == Some(7)))
    });
    agent.await_some("two more heartbeats", || {
        (cp.heartbeat_count() >= seen + 3).then_some(())
    });
    assert!(
        cp.with(|s| s.heartbeats.first().map(|h| h.peers_version)) == Some(None),
        "the first heartbeat asks for the full list"
    );
    assert_eq!(agent.routes()["127.64.10.0/24"], "127.0.0.2");
    // A new version is sent in full and routed by.
    cp.with(|s| {
        s.peers = vec![n2(false)];
        s.peers_version = Some(8);
    });
    agent.await_some("the route to the dead n2 withdrawn", || {
        agent.routes().get("127.64.10.0/24").is_none().then_some(())
    });
}

#[test]
fn a_clustered_agent_refuses_a_key_file_others_can_read() {
    use std::os::unix::fs::PermissionsExt;

    let dir = tempfile::tempdir().expect("tempdir");
    let (_, path) = key_file(dir.path(), "node-1");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let agent = Agent::start(free_port(), dir, &path);
    let code = agent.await_some("keel-agentd to refuse to start", || {
        agent.child.lock().expect("child").try_wait().ok().flatten()
    });
    assert!(!code.success());
    let log = agent.log();
    assert!(log.contains("node-1.key"), "{log}");
    assert!(!agent.dir.path().join("keel-sim/agentd.sock").exists());
}
