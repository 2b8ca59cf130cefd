//! keel-controlplane as a process on loopback, driven with signed requests:
//! membership, liveness, scheduling, forwarding, persistence across `kill -9`,
//! and refusal of unsigned, forged, stale, replayed and wrong-role requests.
//! The agents here are small in-test HTTP servers that check the control
//! plane's node signature and answer like keel-agentd would.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel::common::auth::{self, KeyFilePolicy, Role, Signer};
use keel::common::http::{
    Client, ClientResponse, Endpoint, Handler, Response, Server, ServerLimits, ShutdownSignal,
};
use keel::common::wire::{
    ENDPOINTS_WAIT, EndpointsAnswer, HeartbeatRequest, HeartbeatResponse, NodeStatus, PlacedJail,
    RegisterRequest, RegisterResponse, Resources, ServiceApply,
};

use crate::util::controlplane::node_verifier;
use crate::util::poll_until;

const DEADLINE: Duration = Duration::from_secs(20);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

struct ControlPlane {
    child: Child,
    dir: PathBuf,
    addr: SocketAddr,
}

impl ControlPlane {
    fn start(dir: &Path, port: u16, dead_after: &str) -> ControlPlane {
        let child = Command::new(env!("CARGO_BIN_EXE_keel-controlplane"))
            .args([
                "--simulate",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--heartbeat-interval",
                "100ms",
                "--dead-after",
                dead_after,
            ])
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn keel-controlplane");
        let cp = ControlPlane {
            child,
            dir: dir.to_path_buf(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        };
        poll_until("the control plane to listen", || {
            std::net::TcpStream::connect(cp.addr).is_ok()
        });
        cp
    }

    fn key(&self, name: &str) -> Signer {
        let key = auth::load_key(
            &self.dir.join("keel-sim/keys").join(name),
            KeyFilePolicy::for_current_process(),
        )
        .expect("key");
        Signer::new(key)
    }

    fn call(
        &self,
        signer: Option<&Signer>,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> ClientResponse {
        let headers = match signer {
            Some(s) => auth::sign_headers(s, method, path, body, auth::unix_now()).expect("sign"),
            None => Vec::new(),
        };
        Client::new(Endpoint::Tcp(self.addr.to_string()))
            .request(method, path, &headers, body)
            .expect("request")
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An in-test agent: verifies the node signature, records what it got and
/// answers 200 with the jail name.
/// Method, path and epoch header of every request an agent accepted.
type Seen = Arc<Mutex<Vec<(String, String, Option<String>)>>>;

struct FakeAgent {
    addr: SocketAddr,
    seen: Seen,
    shutdown: ShutdownSignal,
}

impl FakeAgent {
    fn start(dir: &Path) -> FakeAgent {
        let verifier = node_verifier(&dir.join("keel-sim/keys"));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let handler = move |req: keel::common::http::Request| {
            if let Err(e) = auth::verify_request(&verifier, &req, Role::Node, auth::unix_now()) {
                return auth::refusal(&e);
            }
            log.lock().expect("lock").push((
                req.method.clone(),
                req.path.clone(),
                req.header("X-Keel-Epoch").map(str::to_string),
            ));
            Response::json(200, &serde_json::json!({"path": req.path}))
        };
        let (addr, shutdown) = serve_on_loopback(handler);
        FakeAgent {
            addr,
            seen,
            shutdown,
        }
    }
}

/// Serves `handler` on a free loopback port until the signal is triggered.
fn serve_on_loopback(handler: impl Handler) -> (SocketAddr, ShutdownSignal) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let shutdown = ShutdownSignal::new();
    Server::new(Arc::new(handler), ServerLimits::default(), shutdown.clone())
        .serve_tcp(listener)
        .expect("serve");
    (addr, shutdown)
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("json")
}

fn register(cp: &ControlPlane, node: &Signer, id: &str, addr: SocketAddr, cpu: f64) -> String {
    let body = json(&RegisterRequest {
        node_id: id.into(),
        advertise_addr: addr,
        capacity: Resources {
            cpu,
            memory: 8 << 30,
        },
    });
    let r = cp.call(Some(node), "POST", "/nodes/register", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    serde_json::from_slice::<RegisterResponse>(&r.body)
        .expect("register body")
        .pod_cidr
}

fn heartbeat(cp: &ControlPlane, node: &Signer, id: &str, cpu: f64) -> HeartbeatResponse {
    let body = json(&HeartbeatRequest {
        peer_changes: false,
        endpoints_held: None,
        endpoints_generation: None,
        connections: Vec::new(),
        events_seq: None,
        committed: Resources { cpu, memory: 0 },
        jails: 0,
        placed: vec![],
        peers_version: None,
        endpoint_changes: false,
    });
    let r = cp.call(Some(node), "POST", &format!("/nodes/{id}/heartbeat"), &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    serde_json::from_slice(&r.body).expect("heartbeat body")
}

const JAIL: &[u8] =
    b"kind: Jail\nmetadata: {name: web}\nspec: {base: b, exec: {start: [/bin/sleep, '60']}}\n";

#[test]
fn membership_scheduling_forwarding_and_persistence() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let mut cp = ControlPlane::start(dir.path(), port, "2s");
    let node = cp.key("node.key");
    let operator = cp.key("operator.key");
    let a = FakeAgent::start(dir.path());
    let b = FakeAgent::start(dir.path());

    let cidr_a = register(&cp, &node, "node-a", a.addr, 4.0);
    let cidr_b = register(&cp, &node, "node-b", b.addr, 4.0);
    assert_ne!(cidr_a, cidr_b);
    assert_eq!(
        register(&cp, &node, "node-a", a.addr, 4.0),
        cidr_a,
        "stable pod_cidr"
    );
    let peers = heartbeat(&cp, &node, "node-a", 3.0).peers;
    assert_eq!(peers.len(), 1);
    assert_eq!(peers[0].node_id, "node-b");

    // node-a reported 3 of 4 cores committed: the scheduler picks node-b.
    let r = cp.call(Some(&operator), "PUT", "/jails/web", JAIL);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("X-Keel-Node"), Some("node-b"));
    let seen = b.seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        (seen[0].0.as_str(), seen[0].1.as_str()),
        ("PUT", "/jails/web")
    );
    let epoch = seen[0].2.clone().expect("epoch header");

    // Sticky: node-b filling up does not move the jail.
    heartbeat(&cp, &node, "node-b", 4.0);
    let r = cp.call(Some(&operator), "PUT", "/jails/web", JAIL);
    assert_eq!(r.header("X-Keel-Node"), Some("node-b"));
    assert_eq!(
        b.seen.lock().expect("lock")[1].2.as_deref(),
        Some(epoch.as_str())
    );

    // Named route to the other node conflicts with the placement.
    let r = cp.call(Some(&operator), "PUT", "/nodes/node-a/jails/web", JAIL);
    assert_eq!(r.status, 409);

    // kill -9 and restart: placements and pod_cidrs survive. No node has
    // heartbeated yet, which is no evidence of death: both are Unknown, and a
    // request for a jail placed on one is still forwarded to it.
    cp.kill();
    let cp = ControlPlane::start(dir.path(), port, "2s");
    let nodes: Vec<NodeStatus> =
        serde_json::from_slice(&cp.call(Some(&operator), "GET", "/nodes", b"").body)
            .expect("nodes");
    assert_eq!(nodes.len(), 2);
    assert!(
        nodes
            .iter()
            .all(|n| n.status == keel::common::wire::Liveness::Unknown),
        "{nodes:?}"
    );
    let r = cp.call(Some(&operator), "GET", "/jails/web", b"");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(register(&cp, &node, "node-b", b.addr, 4.0), cidr_b);
    let r = cp.call(Some(&operator), "GET", "/jails/web", b"");
    assert_eq!(r.status, 200);
    assert_eq!(
        b.seen.lock().expect("lock").last().map(|s| s.0.clone()),
        Some("GET".into())
    );

    // Delete removes the placement after the node confirmed.
    let r = cp.call(Some(&operator), "DELETE", "/jails/web", b"");
    assert_eq!(r.status, 200);
    let r = cp.call(Some(&operator), "GET", "/jails/web", b"");
    assert_eq!(r.status, 404);
}

const INGRESS: &[u8] =
    b"kind: Ingress\nmetadata: {name: shop}\nspec: {host: shop.example.com, service: web}\n";

/// Ingresses are node-bound: only the named routes exist, they reach that
/// node and nothing else, and an unknown or Dead node is answered without
/// a network call.
#[test]
fn ingress_routes_forward_to_the_named_node_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = ControlPlane::start(dir.path(), free_port(), "1s");
    let node = cp.key("node.key");
    let operator = cp.key("operator.key");
    let a = FakeAgent::start(dir.path());
    let b = FakeAgent::start(dir.path());
    register(&cp, &node, "node-a", a.addr, 4.0);
    register(&cp, &node, "node-b", b.addr, 4.0);

    for (method, path, body, agent_path) in [
        (
            "PUT",
            "/nodes/node-a/ingresses/shop",
            INGRESS,
            "/ingresses/shop",
        ),
        (
            "GET",
            "/nodes/node-a/ingresses/shop",
            b"".as_slice(),
            "/ingresses/shop",
        ),
        ("GET", "/nodes/node-a/ingresses", b"", "/ingresses"),
        (
            "DELETE",
            "/nodes/node-a/ingresses/shop",
            b"",
            "/ingresses/shop",
        ),
    ] {
        let r = cp.call(Some(&operator), method, path, body);
        assert_eq!(
            r.status,
            200,
            "{method} {path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        // The agent's answer comes back untouched.
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&r.body).expect("json"),
            serde_json::json!({ "path": agent_path })
        );
        let seen = a
            .seen
            .lock()
            .expect("lock")
            .last()
            .cloned()
            .expect("forwarded");
        assert_eq!((seen.0.as_str(), seen.1.as_str()), (method, agent_path));
        assert_eq!(
            seen.2, None,
            "no epoch: the control plane records no ingress"
        );
    }
    assert_eq!(a.seen.lock().expect("lock").len(), 4);
    assert!(
        b.seen.lock().expect("lock").is_empty(),
        "only the named node is asked"
    );

    let refused = |method: &str, path: &str| {
        let r = cp.call(Some(&operator), method, path, b"");
        (r.status, String::from_utf8_lossy(&r.body).into_owned())
    };
    let (status, body) = refused("GET", "/nodes/node-z/ingresses/shop");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("no node named node-z"), "{body}");
    // No scheduled route: the operator names the node.
    let (status, body) = refused("PUT", "/ingresses/shop");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("no route"), "{body}");
    assert_eq!(refused("POST", "/nodes/node-a/ingresses/shop").0, 405);
    assert_eq!(refused("PUT", "/nodes/node-a/ingresses").0, 405);
    assert_eq!(refused("GET", "/nodes/node-a/ingresses/Bad_Name").0, 400);

    // node-b stops heartbeating: Dead after 1s, then refused unsent.
    let start = Instant::now();
    loop {
        heartbeat(&cp, &node, "node-a", 0.0);
        let (status, body) = refused("GET", "/nodes/node-b/ingresses");
        if status == 503 {
            assert!(body.contains("node node-b is Dead"), "{body}");
            break;
        }
        assert_eq!(status, 200, "{body}");
        assert!(start.elapsed() < DEADLINE, "node-b never became Dead");
        std::thread::sleep(Duration::from_millis(50));
    }
    let asked = b.seen.lock().expect("lock").len();
    assert_eq!(refused("DELETE", "/nodes/node-b/ingresses/shop").0, 503);
    assert_eq!(refused("PUT", "/nodes/node-b/ingresses/shop").0, 503);
    assert_eq!(
        b.seen.lock().expect("lock").len(),
        asked,
        "nothing sent to a Dead node"
    );
    assert_eq!(a.seen.lock().expect("lock").len(), 4);
}

#[test]
fn every_route_refuses_bad_signatures_and_wrong_roles() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = ControlPlane::start(dir.path(), free_port(), "2s");
    let node = cp.key("node.key");
    let operator = cp.key("operator.key");
    let forged = Signer::new(auth::generate_key("node").expect("key"));

    let routes: &[(&str, &str, Role)] = &[
        ("POST", "/nodes/register", Role::Node),
        ("POST", "/nodes/n1/heartbeat", Role::Node),
        ("GET", "/nodes/n1/endpoints", Role::Node),
        ("GET", "/nodes", Role::Operator),
        ("GET", "/metrics", Role::Operator),
        ("GET", "/nodes/n1/jails", Role::Operator),
        ("PUT", "/nodes/n1/jails/web", Role::Operator),
        ("GET", "/nodes/n1/jails/web", Role::Operator),
        ("DELETE", "/nodes/n1/jails/web", Role::Operator),
        ("PUT", "/jails/web", Role::Operator),
        ("GET", "/jails/web", Role::Operator),
        ("DELETE", "/jails/web", Role::Operator),
        ("GET", "/nodes/n1/ingresses", Role::Operator),
        ("PUT", "/nodes/n1/ingresses/shop", Role::Operator),
        ("GET", "/nodes/n1/ingresses/shop", Role::Operator),
        ("DELETE", "/nodes/n1/ingresses/shop", Role::Operator),
    ];
    for (method, path, role) in routes {
        let wrong = match role {
            Role::Node => &operator,
            Role::Operator => &node,
        };
        let client = Client::new(Endpoint::Tcp(cp.addr.to_string()));
        let send = |headers: Vec<(String, String)>| {
            client
                .request(method, path, &headers, b"")
                .expect("request")
                .status
        };
        assert_eq!(send(vec![]), 401, "unsigned {method} {path}");
        let forged_h =
            auth::sign_headers(&forged, method, path, b"", auth::unix_now()).expect("sign");
        assert_eq!(send(forged_h), 401, "forged {method} {path}");
        let wrong_h = auth::sign_headers(wrong, method, path, b"", auth::unix_now()).expect("sign");
        assert_eq!(send(wrong_h), 401, "wrong role {method} {path}");
        let stale_h = auth::sign_headers(
            match role {
                Role::Node => &node,
                Role::Operator => &operator,
            },
            method,
            path,
            b"",
            auth::unix_now() - 301,
        )
        .expect("sign");
        assert_eq!(send(stale_h), 401, "stale {method} {path}");
        let good = match role {
            Role::Node => &node,
            Role::Operator => &operator,
        };
        let once = auth::sign_headers(good, method, path, b"", auth::unix_now()).expect("sign");
        let first = send(once.clone());
        assert_ne!(first, 401, "good signature refused on {method} {path}");
        assert_eq!(send(once), 401, "replayed {method} {path}");
    }
    // The one unauthenticated route says nothing but "ok".
    assert_eq!(cp.call(None, "GET", "/healthz", b"").status, 200);
}

/// A stateless service of `replicas` on port 8080, as keelctl would send.
fn service_apply(replicas: u32) -> ServiceApply {
    ServiceApply {
        document: "kind: Service\n".into(),
        replicas,
        port: 8080,
        stateful: false,
        template_digest: "t".into(),
        volumes: Vec::new(),
        policy: Default::default(),
        resources: None,
    }
}

/// A control plane with one registered node, `node-a`, whose applies a
/// fake agent takes, and the node and operator keys.
struct OneNode {
    cp: ControlPlane,
    node: Signer,
    operator: Signer,
    agent: FakeAgent,
}

fn one_node(dir: &Path) -> OneNode {
    let cp = ControlPlane::start(dir, free_port(), "10s");
    let node = cp.key("node.key");
    let operator = cp.key("operator.key");
    let agent = FakeAgent::start(dir);
    register(&cp, &node, "node-a", agent.addr, 4.0);
    OneNode {
        cp,
        node,
        operator,
        agent,
    }
}

/// `GET /nodes/node-a/endpoints{query}` signed with `node`, to send from
/// any thread, with a read timeout below the control plane's wait: only an
/// answer at once, or a wake-up, can answer it.
fn endpoint_poll(
    cp: &ControlPlane,
    node: &Signer,
    query: &str,
) -> impl FnOnce() -> Result<ClientResponse, keel::common::http::HttpError> + Send + 'static {
    let path = format!("/nodes/node-a/endpoints{query}");
    let headers = auth::sign_headers(node, "GET", &path, b"", auth::unix_now()).expect("sign");
    let addr = cp.addr;
    move || {
        Client::new(Endpoint::Tcp(addr.to_string()))
            .with_timeout(ENDPOINTS_WAIT / 2)
            .request("GET", &path, &headers, b"")
    }
}

/// `GET /nodes/{id}/endpoints?after=G` on a real control plane: signed by a
/// node key only, `after` checked, unknown nodes refused like a heartbeat,
/// and a poll waiting on the current generation answered with the next one
/// as soon as a heartbeat changes the table.
#[test]
fn the_endpoint_long_poll_answers_the_next_generation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let OneNode {
        cp,
        node,
        operator,
        agent,
    } = one_node(dir.path());
    heartbeat(&cp, &node, "node-a", 0.0);

    let poll = |id: &str, query: &str| {
        cp.call(
            Some(&node),
            "GET",
            &format!("/nodes/{id}/endpoints{query}"),
            b"",
        )
    };
    assert_eq!(
        cp.call(None, "GET", "/nodes/node-a/endpoints", b"").status,
        401
    );
    for bad in [
        "?after=x",
        "?after=-1",
        "?after=",
        "?after=1&after=2",
        "?since=1",
    ] {
        let r = poll("node-a", bad);
        let body = String::from_utf8_lossy(&r.body);
        assert_eq!(r.status, 400, "{bad}: {body}");
        assert!(
            body.contains("after"),
            "{bad}: the error names after: {body}"
        );
    }
    let unknown = poll("node-z", "?after=1");
    assert_eq!(
        unknown.status,
        404,
        "{}",
        String::from_utf8_lossy(&unknown.body)
    );
    assert!(String::from_utf8_lossy(&unknown.body).contains("register first"));

    // A service with one replica, placed on node-a (the fake agent takes
    // the apply): the table has the service, with no ready replica yet.
    let apply = service_apply(1);
    let r = cp.call(Some(&operator), "PUT", "/services/web", &json(&apply));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let read = |r: &ClientResponse| -> EndpointsAnswer {
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        serde_json::from_slice(&r.body).expect("an endpoints answer")
    };
    let current = read(&poll("node-a", ""));
    assert_eq!(current.services.len(), 1);
    assert!(current.services[0].replicas.is_empty(), "{current:?}");

    // A poll on the current generation waits; a heartbeat reporting the
    // replica ready wakes it with the next generation. Its read timeout is
    // below the control plane's wait, so only the wake-up can answer it.
    let waiting = std::thread::spawn(endpoint_poll(
        &cp,
        &node,
        &format!("?after={}", current.generation),
    ));
    let epoch = {
        let r = cp.call(Some(&operator), "GET", "/services/web", b"");
        let status: keel::common::wire::ServiceStatus =
            serde_json::from_slice(&r.body).expect("service status");
        assert_eq!(status.replicas[0].node, "node-a");
        let r = cp.call(Some(&operator), "GET", "/jails/web-0", b"");
        assert_eq!(r.status, 200, "the replica is placed");
        // The fake agent saw the apply with its epoch.
        let seen = agent.seen.lock().expect("lock").clone();
        seen.iter()
            .find(|(m, p, _)| m == "PUT" && p == "/jails/web-0")
            .and_then(|(_, _, e)| e.as_deref()?.parse::<u64>().ok())
            .expect("the apply carried an epoch")
    };
    let body = json(&HeartbeatRequest {
        peer_changes: false,
        endpoints_held: None,
        committed: Resources::default(),
        jails: 1,
        placed: vec![PlacedJail {
            name: "web-0".into(),
            epoch,
            running: true,
            ready: Some(true),
            address: Some(std::net::Ipv4Addr::new(10, 20, 0, 5)),
        }],
        peers_version: None,
        endpoints_generation: Some(current.generation),
        connections: Vec::new(),
        events_seq: None,
        endpoint_changes: false,
    });
    let r = cp.call(Some(&node), "POST", "/nodes/node-a/heartbeat", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let beat: HeartbeatResponse = serde_json::from_slice(&r.body).expect("heartbeat body");

    let woken = read(
        &waiting
            .join()
            .expect("poller")
            .expect("the waiting poll is answered"),
    );
    assert!(
        woken.generation > current.generation,
        "{woken:?} after {current:?}"
    );
    assert_eq!(woken.origin, current.origin);
    assert_eq!(
        woken.services[0].replicas,
        [std::net::SocketAddrV4::new(
            std::net::Ipv4Addr::new(10, 20, 0, 5),
            8080
        )]
    );
    assert_eq!(
        beat.endpoints_generation,
        Some(woken.generation),
        "the heartbeat carried the same table"
    );
    assert_eq!(beat.services, woken.services);
    // Without `after` the answer is the current table at once, and so it
    // is for a generation above the current one (numbered by a previous
    // control plane): within a read timeout shorter than the wait.
    assert_eq!(read(&poll("node-a", "")).generation, woken.generation);
    let ahead = endpoint_poll(&cp, &node, &format!("?after={}", woken.generation + 1000))()
        .expect("answered at once");
    assert_eq!(read(&ahead).generation, woken.generation);
}

/// A waiting endpoint poll is a signed request under way: a flood of idle
/// unauthenticated connections, more than the listener admits, evicts
/// only its own kind, and the poll is answered when the table changes.
#[test]
fn a_flood_of_idle_connections_never_evicts_a_waiting_endpoint_poll() {
    let dir = tempfile::tempdir().expect("tempdir");
    // `_agent` keeps the fake agent answering until the test ends.
    let OneNode {
        cp,
        node,
        operator,
        agent: _agent,
    } = one_node(dir.path());
    let r = cp.call(Some(&node), "GET", "/nodes/node-a/endpoints", b"");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let current: EndpointsAnswer = serde_json::from_slice(&r.body).expect("endpoints");

    let waiting = std::thread::spawn(endpoint_poll(
        &cp,
        &node,
        &format!("?after={}", current.generation),
    ));
    let polls_waiting = || {
        let r = cp.call(Some(&operator), "GET", "/metrics", b"");
        String::from_utf8_lossy(&r.body).contains("keel_endpoint_polls_waiting 1\n")
    };
    poll_until("the poll to wait on the board", polls_waiting);

    // More idle connections than the whole listener admits (256), all
    // held open: each newcomer evicts the oldest idle one.
    let flood: Vec<std::net::TcpStream> = (0..300)
        .map(|_| std::net::TcpStream::connect(cp.addr).expect("connect"))
        .collect();
    assert!(polls_waiting(), "the poll still waits");

    // A change: the service table gains a service; the poll is answered.
    let apply = service_apply(0);
    let r = cp.call(Some(&operator), "PUT", "/services/web", &json(&apply));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let answer = waiting
        .join()
        .expect("poller")
        .expect("the waiting poll is answered, not cut");
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let woken: EndpointsAnswer = serde_json::from_slice(&answer.body).expect("endpoints");
    assert!(woken.generation > current.generation);
    assert_eq!(woken.services.len(), 1);
    drop(flood);
}

/// An endpoint poll that names the origin of the table it holds is
/// answered only the services changed since, waiting or not; one from
/// another origin, or without `origin`, gets the whole table.
#[test]
fn an_endpoint_poll_holding_a_table_is_answered_only_the_changes() {
    let dir = tempfile::tempdir().expect("tempdir");
    // `_agent` keeps the fake agent answering until the test ends.
    let OneNode {
        cp,
        node,
        operator,
        agent: _agent,
    } = one_node(dir.path());
    let put_service = |name: &str| {
        let apply = service_apply(0);
        let r = cp.call(
            Some(&operator),
            "PUT",
            &format!("/services/{name}"),
            &json(&apply),
        );
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    };
    for name in ["api", "db", "web"] {
        put_service(name);
    }
    let poll = |query: &str| {
        let r = endpoint_poll(&cp, &node, query)().expect("answered");
        assert_eq!(
            r.status,
            200,
            "{query}: {}",
            String::from_utf8_lossy(&r.body)
        );
        serde_json::from_slice::<EndpointsAnswer>(&r.body).expect("an endpoints answer")
    };
    let whole = poll("");
    assert_eq!(whole.services.len(), 3);
    assert_eq!(whole.services_changed, None);

    // A poll holding the current table waits; a new service wakes it with
    // that service alone.
    let held = format!("?after={}&origin={}", whole.generation, whole.origin);
    let waiting = std::thread::scope(|scope| {
        let waiting = scope.spawn(|| poll(&held));
        poll_until("the poll to wait on the board", || {
            let r = cp.call(Some(&operator), "GET", "/metrics", b"");
            String::from_utf8_lossy(&r.body).contains("keel_endpoint_polls_waiting 1\n")
        });
        put_service("cache");
        waiting.join().expect("poller")
    });
    assert!(waiting.generation > whole.generation, "{waiting:?}");
    assert_eq!(waiting.services_changed, Some(whole.generation));
    let names: Vec<&str> = waiting.services.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["cache"], "{waiting:?}");
    assert!(waiting.services_removed.is_empty());

    // Behind already: the changes at once. Another process's table, or a
    // poll that does not apply changes: the whole table at once.
    let behind = poll(&held);
    assert_eq!(
        (behind.generation, behind.services_changed),
        (waiting.generation, Some(whole.generation))
    );
    assert_eq!(behind.services, waiting.services);
    let other = poll(&format!(
        "?after={}&origin={}",
        waiting.generation,
        whole.origin + 1
    ));
    assert_eq!((other.services_changed, other.services.len()), (None, 4));
    let old_agent = poll(&format!("?after={}", whole.generation));
    assert_eq!(
        (old_agent.services_changed, old_agent.services.len()),
        (None, 4)
    );
    let metrics = cp.call(Some(&operator), "GET", "/metrics", b"");
    let metrics = String::from_utf8_lossy(&metrics.body);
    for sample in [
        "keel_endpoint_poll_answers_total{kind=\"changes\"} 2\n",
        "keel_endpoint_poll_answers_total{kind=\"table\"} 3\n",
    ] {
        assert!(metrics.contains(sample), "{sample} in {metrics}");
    }

    // Bad parameters name themselves.
    for (query, field) in [
        ("?origin=7", "origin"),
        ("?after=1&origin=x", "origin"),
        ("?after=1&origin=7&origin=7", "origin"),
    ] {
        let r = cp.call(
            Some(&node),
            "GET",
            &format!("/nodes/node-a/endpoints{query}"),
            b"",
        );
        let body = String::from_utf8_lossy(&r.body);
        assert_eq!(r.status, 400, "{query}: {body}");
        assert!(
            body.contains(field),
            "{query}: the error names {field}: {body}"
        );
    }
}

/// The key rotation procedure of docs/security.md with continuous traffic: add the new key to
/// the accepted set, reload, switch signers, remove the old key, reload; not
/// one request fails.
#[test]
fn key_rotation_under_continuous_traffic_loses_no_request() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = dir.path().join("keys");
    std::fs::create_dir(&keys).expect("keys dir");
    let old = auth::generate_key("ops-old").expect("key");
    let new = auth::generate_key("ops-new").expect("key");
    auth::write_key_file(&keys.join("old.key"), &old).expect("write");
    auth::write_key_file(&keys.join("new.key"), &new).expect("write");
    let conf = dir.path().join("keel.toml");
    let write_conf = |files: &[&str]| {
        let list: Vec<String> = files
            .iter()
            .map(|f| format!("{:?}", keys.join(f).display().to_string()))
            .collect();
        std::fs::write(
            &conf,
            format!("[auth]\noperator_keys = [{}]\n", list.join(", ")),
        )
        .expect("conf");
    };
    write_conf(&["old.key"]);
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_keel-controlplane"))
        .args(["--simulate", "-c"])
        .arg(&conf)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut cp = ControlPlane {
        child,
        dir: dir.path().to_path_buf(),
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    };
    poll_until("the control plane to listen", || {
        std::net::TcpStream::connect(cp.addr).is_ok()
    });

    let use_new = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let traffic = {
        let (use_new, stop, ok, failed) =
            (use_new.clone(), stop.clone(), ok.clone(), failed.clone());
        let (old, new, addr) = (Signer::new(old.clone()), Signer::new(new.clone()), cp.addr);
        std::thread::spawn(move || {
            let client = Client::new(Endpoint::Tcp(addr.to_string()));
            while !stop.load(Ordering::SeqCst) {
                let signer = if use_new.load(Ordering::SeqCst) {
                    &new
                } else {
                    &old
                };
                let h = auth::sign_headers(signer, "GET", "/nodes", b"", auth::unix_now())
                    .expect("sign");
                match client.request("GET", "/nodes", &h, b"") {
                    Ok(r) if r.status == 200 => ok.fetch_add(1, Ordering::SeqCst),
                    _ => failed.fetch_add(1, Ordering::SeqCst),
                };
            }
        })
    };
    let accepted = |key: &auth::Key| {
        let s = Signer::new(key.clone());
        cp.call(Some(&s), "GET", "/nodes", b"").status == 200
    };
    let hup = |cp: &ControlPlane| {
        let status = Command::new("/bin/kill")
            .args(["-HUP", &cp.child.id().to_string()])
            .status()
            .expect("kill -HUP");
        assert!(status.success());
    };
    let wait_for = |what: &str, cond: &dyn Fn() -> bool| {
        let start = Instant::now();
        while !cond() {
            assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    assert!(!accepted(&new));
    write_conf(&["old.key", "new.key"]);
    hup(&cp);
    wait_for("the new key to be accepted", &|| accepted(&new));
    use_new.store(true, Ordering::SeqCst);
    write_conf(&["new.key"]);
    hup(&cp);
    wait_for("the old key to be refused", &|| !accepted(&old));
    stop.store(true, Ordering::SeqCst);
    traffic.join().expect("traffic");
    assert!(ok.load(Ordering::SeqCst) > 0);
    assert_eq!(
        failed.load(Ordering::SeqCst),
        0,
        "requests failed during rotation"
    );
    cp.kill();
}

/// An agent that holds every `PUT /jails/...` until `gather` of them are in
/// flight at once (or [`GATHER_WAIT`] passed), and counts the most it saw.
struct GatheringAgent {
    addr: SocketAddr,
    most: Arc<Mutex<usize>>,
    shutdown: ShutdownSignal,
}

/// Bound on a held request: a heal that never sends `gather` at once still
/// gets its answers, only later, and the test then fails on the count.
const GATHER_WAIT: Duration = Duration::from_secs(10);

impl GatheringAgent {
    fn start(dir: &Path, gather: usize) -> GatheringAgent {
        let verifier = node_verifier(&dir.join("keel-sim/keys"));
        let most = Arc::new(Mutex::new(0usize));
        // (arrived so far, in flight now): request number i is held until
        // its group of `gather`, the one `i / gather` names, has arrived.
        let flight = Arc::new((Mutex::new((0usize, 0usize)), std::sync::Condvar::new()));
        let seen_most = most.clone();
        let handler = move |req: keel::common::http::Request| {
            if let Err(e) = auth::verify_request(&verifier, &req, Role::Node, auth::unix_now()) {
                return auth::refusal(&e);
            }
            if req.method != "PUT" {
                return Response::json(200, &serde_json::json!({}));
            }
            let (counts, changed) = &*flight;
            let mut c = counts.lock().expect("lock");
            let group_end = (c.0 / gather + 1) * gather;
            c.0 += 1;
            c.1 += 1;
            {
                let mut m = seen_most.lock().expect("lock");
                *m = (*m).max(c.1);
            }
            changed.notify_all();
            let (mut c, _) = changed
                .wait_timeout_while(c, GATHER_WAIT, |c| c.0 < group_end)
                .expect("wait");
            c.1 -= 1;
            Response::json(200, &serde_json::json!({"path": req.path}))
        };
        let (addr, shutdown) = serve_on_loopback(handler);
        GatheringAgent {
            addr,
            most,
            shutdown,
        }
    }
}

impl Drop for GatheringAgent {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

/// The replicas of a heal go out together: a node gets up to
/// `heal::PER_NODE` of them at once, never more.
#[test]
fn a_heal_sends_a_node_several_replicas_at_once_within_its_bound() {
    use keel::controlplane::heal::PER_NODE;
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = ControlPlane::start(dir.path(), free_port(), "2s");
    let node = cp.key("node.key");
    let operator = cp.key("operator.key");
    let agent = GatheringAgent::start(dir.path(), PER_NODE);
    register(&cp, &node, "node-a", agent.addr, 64.0);
    heartbeat(&cp, &node, "node-a", 0.0);
    let apply = service_apply(2 * PER_NODE as u32);
    let r = cp.call(Some(&operator), "PUT", "/services/web", &json(&apply));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let most = *agent.most.lock().expect("lock");
    assert_eq!(
        most, PER_NODE,
        "in flight at once to one node: {most} (sequential would be 1)"
    );
    let status: keel::common::wire::ServiceStatus =
        serde_json::from_slice(&cp.call(Some(&operator), "GET", "/services/web", b"").body)
            .expect("status");
    assert_eq!(status.replicas.len(), 2 * PER_NODE, "{status:?}");
}
