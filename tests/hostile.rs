//! Hostile input and access: a table of bad requests against every
//! route of both daemons, each answered with the right 4xx while nothing
//! changes on the host and the daemon keeps serving other clients; the
//! agent's socket mode and group; key files with loose modes.
//!
//! The requests are raw bytes on a socket, so the table can hold what no
//! well-behaved client would send: malformed request lines, NUL bytes,
//! percent-encoded traversal, oversized heads and bodies, a slowloris client
//! trickling a request one byte at a time. Requests that must reach a route
//! on a TCP listener are signed, so they are refused for what they carry and
//! not merely for being unsigned.
//!
//! The agent runs clustered against a small fake control plane served from
//! the test, so its TCP listener (node-signed requests only) is covered as
//! well as its Unix socket. On the agent, "wrong role" is an operator key:
//! agents accept only node keys, so it is an unknown key there (401 either
//! way). The control plane's fake agents are `util::controlplane::FakeAgent`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use keel::common::auth::{self, Key, KeyFilePolicy, Signer, generate_key, write_key_file};
use keel::common::http::{Request, Response, Server, ServerLimits, ShutdownSignal};
use keel::common::wire::{HeartbeatResponse, NodeStatus, RegisterResponse};

use crate::util::agent::{AGENTD, Agent};
use crate::util::controlplane::{CONTROLPLANE, ControlPlane, FakeAgent};

/// Bound on every wait; a deadline, not a timing claim.
const DEADLINE: Duration = Duration::from_secs(30);

/// Where a raw request goes.
#[derive(Clone, Debug)]
enum Ep {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl Ep {
    fn name(&self) -> &'static str {
        match self {
            Ep::Unix(_) => "unix",
            Ep::Tcp(_) => "tcp",
        }
    }
}

/// Writes `bytes` and reads until the server closes; the whole answer.
fn exchange(ep: &Ep, bytes: &[u8]) -> Vec<u8> {
    fn talk<S: Read + Write>(mut s: S, bytes: &[u8]) -> Vec<u8> {
        // The server may refuse and close before it has read everything
        // (413, 431): the write can fail then; the answer is what counts.
        let _ = s.write_all(bytes);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        out
    }
    match ep {
        Ep::Unix(p) => {
            let s = UnixStream::connect(p).expect("connect to the unix socket");
            s.set_read_timeout(Some(DEADLINE)).expect("timeout");
            s.set_write_timeout(Some(DEADLINE)).expect("timeout");
            talk(s, bytes)
        }
        Ep::Tcp(a) => {
            let s = TcpStream::connect(a).expect("connect over tcp");
            s.set_read_timeout(Some(DEADLINE)).expect("timeout");
            s.set_write_timeout(Some(DEADLINE)).expect("timeout");
            talk(s, bytes)
        }
    }
}

/// The status code of a raw response, 0 when there was none.
fn status_of(resp: &[u8]) -> u16 {
    let text = String::from_utf8_lossy(resp);
    text.strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

/// A raw HTTP/1.1 request with `Connection: close` and a Content-Length.
fn raw(method: &str, target: &[u8], headers: &[(String, String)], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(target);
    out.extend_from_slice(b" HTTP/1.1\r\nHost: keel\r\nConnection: close\r\n");
    for (n, v) in headers {
        out.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
    }
    out.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
    out.extend_from_slice(body);
    out
}

/// A request signed by `signer` at `ts` (None: unsigned).
fn signed_at(signer: Option<&Signer>, ts: u64, method: &str, target: &str, body: &[u8]) -> Vec<u8> {
    let headers = match signer {
        Some(s) => auth::sign_headers(s, method, target, body, ts).expect("sign"),
        None => Vec::new(),
    };
    raw(method, target.as_bytes(), &headers, body)
}

fn signed(signer: Option<&Signer>, method: &str, target: &str, body: &[u8]) -> Vec<u8> {
    signed_at(signer, auth::unix_now(), method, target, body)
}

fn jail_yaml(name: &str) -> Vec<u8> {
    format!(
        "kind: Jail\nmetadata:\n  name: {name}\nspec:\n  base: 14.2-RELEASE\n  exec:\n    start: [\"/bin/sleep\", \"300\"]\n"
    )
    .into_bytes()
}

/// Names that are valid YAML scalars but not DNS labels.
fn bad_names() -> Vec<String> {
    vec![
        "Web".into(),
        "a".repeat(64),
        "1234".into(),
        "under_score".into(),
        "web-".into(),
    ]
}

/// One row of a table: what to send where, and the answer it must get.
struct Row {
    label: String,
    ep: Ep,
    /// Sent first and answered with anything but 401 (a replay's original).
    prime: Option<Vec<u8>>,
    request: Vec<u8>,
    status: u16,
    /// A phrase the error body must contain, when the status alone is not
    /// specific enough (the auth refusals are all 401).
    says: Option<&'static str>,
}

fn row(label: impl Into<String>, ep: &Ep, request: Vec<u8>, status: u16) -> Row {
    Row {
        label: label.into(),
        ep: ep.clone(),
        prime: None,
        request,
        status,
        says: None,
    }
}

/// Rows refused by the HTTP layer before any route or signature check, the
/// same on every listener.
fn framing_rows(ep: &Ep) -> Vec<Row> {
    let mut rows = vec![
        row("malformed: garbage", ep, b"GARBAGE\r\n\r\n".to_vec(), 400),
        row(
            "malformed: unknown version",
            ep,
            b"GET /jails HTTP/9.9\r\n\r\n".to_vec(),
            400,
        ),
        row("malformed: no target", ep, b"GET\r\n\r\n".to_vec(), 400),
        row(
            "malformed: a TLS hello",
            ep,
            b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n".to_vec(),
            400,
        ),
        row(
            "malformed: absolute-form target",
            ep,
            raw("GET", b"http://evil/jails", &[], b""),
            400,
        ),
        row(
            "malformed: Content-Length not a number",
            ep,
            b"PUT /jails/web HTTP/1.1\r\nContent-Length: -1\r\n\r\n".to_vec(),
            400,
        ),
        row(
            "chunked body",
            ep,
            b"PUT /jails/web HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
            411,
        ),
        row(
            "oversized header",
            ep,
            raw(
                "GET",
                b"/jails",
                &[("X-Pad".into(), "a".repeat(20 * 1024))],
                b"",
            ),
            431,
        ),
        row(
            "too many header fields",
            ep,
            raw(
                "GET",
                b"/jails",
                &(0..70)
                    .map(|i| (format!("X-F{i}"), "v".to_string()))
                    .collect::<Vec<_>>(),
                b"",
            ),
            431,
        ),
        row(
            "oversized body",
            ep,
            b"PUT /jails/big HTTP/1.1\r\nContent-Length: 2097152\r\n\r\nkind: Jail\n".to_vec(),
            413,
        ),
    ];
    let traversal: [&[u8]; 7] = [
        b"/jails/../jails",
        b"/jails/..",
        b"/jails/%2e%2e",
        b"/jails/%2E%2E/etc",
        b"/jails/..%2f..%2fetc%2fpasswd",
        b"/jails/web%00",
        b"/jails/web\0x",
    ];
    for method in ["GET", "PUT", "DELETE"] {
        for target in traversal {
            rows.push(row(
                format!("traversal {method} {}", String::from_utf8_lossy(target)),
                ep,
                raw(method, target, &[], &jail_yaml("web")),
                400,
            ));
        }
    }
    rows
}

/// The daemon still answers a plain request.
fn serving(ep: &Ep, signer: Option<&Signer>) -> bool {
    status_of(&exchange(ep, &signed(signer, "GET", "/healthz", b""))) == 200
}

/// A slowloris client on `ep`: sends a request head one byte at a time
/// until the server answers and closes. The answer comes back through the
/// join handle; `open` stays true until then.
fn slowloris(ep: &Ep, open: Arc<AtomicBool>, sent: Arc<AtomicUsize>) -> JoinHandle<Vec<u8>> {
    let ep = ep.clone();
    std::thread::spawn(move || {
        let (read, write): (Box<dyn Read + Send>, Box<dyn Write + Send>) = match &ep {
            Ep::Unix(p) => {
                let s = UnixStream::connect(p).expect("connect");
                s.set_read_timeout(Some(DEADLINE)).expect("timeout");
                (Box::new(s.try_clone().expect("clone")), Box::new(s))
            }
            Ep::Tcp(a) => {
                let s = TcpStream::connect(a).expect("connect");
                s.set_read_timeout(Some(DEADLINE)).expect("timeout");
                (Box::new(s.try_clone().expect("clone")), Box::new(s))
            }
        };
        let (stop, stopped) = mpsc::channel::<()>();
        let trickle = {
            let sent = sent.clone();
            std::thread::spawn(move || {
                let mut write = write;
                let head = b"GET /jails HTTP/1.1\r\nHost: keel\r\nX-Slow: ".iter();
                for b in head.chain(std::iter::repeat(&b'z')) {
                    if write.write_all(&[*b]).is_err() {
                        return;
                    }
                    sent.fetch_add(1, Ordering::SeqCst);
                    // The pace of the trickle is the stimulus, not a wait
                    // for a condition: one byte every 50 ms until told to stop.
                    if stopped.recv_timeout(Duration::from_millis(50)).is_ok() {
                        return;
                    }
                }
            })
        };
        let mut read = read;
        let mut answer = Vec::new();
        let _ = read.read_to_end(&mut answer);
        open.store(false, Ordering::SeqCst);
        let _ = stop.send(());
        trickle.join().expect("trickle thread");
        answer
    })
}

/// Polls `cond` until it holds, panicking with `what` after [`DEADLINE`].
fn await_true(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `rows`, checking after each one that the daemon still serves, and
/// counting requests served while the slowloris client is still open.
fn run_rows(
    rows: &[Row],
    health: &Ep,
    health_signer: Option<&Signer>,
    slow_open: &AtomicBool,
) -> usize {
    let mut served_meanwhile = 0;
    for r in rows {
        if let Some(prime) = &r.prime {
            let first = exchange(&r.ep, prime);
            let s = status_of(&first);
            assert!(
                s != 401 && s != 0,
                "{} [{}]: the original request was refused ({s}): {}",
                r.label,
                r.ep.name(),
                String::from_utf8_lossy(&first)
            );
        }
        let answer = exchange(&r.ep, &r.request);
        let text = String::from_utf8_lossy(&answer);
        assert_eq!(
            status_of(&answer),
            r.status,
            "{} [{}]: {text}",
            r.label,
            r.ep.name()
        );
        if let Some(phrase) = r.says {
            assert!(
                text.contains(phrase),
                "{} [{}]: expected {phrase:?} in {text}",
                r.label,
                r.ep.name()
            );
        }
        let before = slow_open.load(Ordering::SeqCst);
        assert!(
            serving(health, health_signer),
            "{} [{}]: the daemon stopped serving",
            r.label,
            r.ep.name()
        );
        if before && slow_open.load(Ordering::SeqCst) {
            served_meanwhile += 1;
        }
    }
    served_meanwhile
}

/// A signed route: a request to it, the key it needs and one of the other
/// role, and a harmless request to the same route (`replay`: target and
/// body) that is sent once, answered, and then replayed.
struct SignedRoute<'a> {
    method: &'a str,
    path: &'a str,
    body: &'a [u8],
    good: &'a Signer,
    wrong: &'a Signer,
    replay: (&'a str, &'a [u8]),
}

/// Signature rows for one route on a TCP listener: unsigned, a bad
/// signature, an unknown key, the wrong role, expired, from the future, an
/// altered body, and a replay of a request that was accepted once.
fn auth_rows(ep: &Ep, route: &SignedRoute) -> Vec<Row> {
    let SignedRoute {
        method,
        path,
        body,
        good,
        wrong,
        replay,
    } = *route;
    let label = |what: &str| format!("{what} {method} {path}");
    let forged = Signer::new(Key::new(good.key_id(), [7; 32]).expect("key"));
    let stranger = Signer::new(generate_key("stranger").expect("key"));
    let now = auth::unix_now();
    let mut altered = auth::sign_headers(good, method, path, b"what was signed", now)
        .map(|h| raw(method, path.as_bytes(), &h, b"what was sent"))
        .expect("sign");
    if body.is_empty() {
        // Without a body to alter, alter the target.
        let h = auth::sign_headers(good, method, "/elsewhere", b"", now).expect("sign");
        altered = raw(method, path.as_bytes(), &h, b"");
    }
    let replayed = signed(Some(good), method, replay.0, replay.1);
    let says = |mut r: Row, phrase| {
        r.says = Some(phrase);
        r
    };
    vec![
        says(
            row(label("unsigned"), ep, signed(None, method, path, body), 401),
            "missing Authorization",
        ),
        says(
            row(
                label("bad signature"),
                ep,
                signed(Some(&forged), method, path, body),
                401,
            ),
            "bad signature",
        ),
        says(
            row(
                label("unknown key"),
                ep,
                signed(Some(&stranger), method, path, body),
                401,
            ),
            "unknown key",
        ),
        row(
            label("wrong role"),
            ep,
            signed(Some(wrong), method, path, body),
            401,
        ),
        says(
            row(
                label("expired"),
                ep,
                signed_at(Some(good), now - 3600, method, path, body),
                401,
            ),
            "stale request",
        ),
        says(
            row(
                label("from the future"),
                ep,
                signed_at(Some(good), now + 3600, method, path, body),
                401,
            ),
            "stale request",
        ),
        says(row(label("altered"), ep, altered, 401), "bad signature"),
        Row {
            prime: Some(replayed.clone()),
            ..says(
                row(label("replayed"), ep, replayed, 401),
                "replayed request",
            )
        },
    ]
}

// ------------------------------------------------------------------ agent

/// A fake control plane that accepts any registration and heartbeat: the
/// agent's own TCP listener is under test here, not its client.
struct AcceptingControlPlane {
    addr: SocketAddr,
    heartbeats: Arc<Mutex<usize>>,
    shutdown: ShutdownSignal,
}

impl AcceptingControlPlane {
    fn start() -> AcceptingControlPlane {
        let heartbeats = Arc::new(Mutex::new(0));
        let count = heartbeats.clone();
        let handler = move |req: Request| -> Response {
            match (req.method.as_str(), req.segments().as_slice()) {
                ("POST", ["nodes", "register"]) => Response::json(
                    200,
                    &RegisterResponse {
                        // The simulated agent's own default subnet, so
                        // joining changes no address.
                        pod_cidr: "127.64.0.0/24".into(),
                    },
                ),
                ("POST", ["nodes", _, "heartbeat"]) => {
                    *count.lock().expect("count") += 1;
                    Response::json(
                        200,
                        &HeartbeatResponse {
                            peers_changed: None,
                            peers_removed: vec![],
                            endpoints_unchanged: false,
                            endpoints_generation: None,
                            endpoints_origin: None,
                            peers: vec![],
                            stale: vec![],
                            services: vec![],
                            peers_version: None,
                            peers_unchanged: false,
                            services_changed: None,
                            services_removed: Vec::new(),
                        },
                    )
                }
                _ => Response::error(404, "no route", None),
            }
        };
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let shutdown = ShutdownSignal::new();
        Server::new(Arc::new(handler), ServerLimits::default(), shutdown.clone())
            .serve_tcp(listener)
            .expect("serve");
        AcceptingControlPlane {
            addr,
            heartbeats,
            shutdown,
        }
    }
}

impl Drop for AcceptingControlPlane {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

/// What "the host" of a simulated agent is: its API's view, its jail
/// directories and its workload processes.
#[derive(Debug, PartialEq)]
struct AgentHost {
    jails: serde_json::Value,
    dirs: Vec<String>,
    pids: std::collections::BTreeMap<String, u32>,
}

fn agent_host(agent: &Agent) -> AgentHost {
    let r = agent.request("GET", "/jails");
    assert_eq!(r.status, 200);
    let mut dirs: Vec<String> = std::fs::read_dir(agent.dir().join("keel-sim/jails"))
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    let pids = agent.jail_pids();
    for (name, pid) in &pids {
        assert!(
            crate::util::agent::process_alive(*pid),
            "{name}'s workload {pid} died"
        );
    }
    AgentHost {
        jails: serde_json::from_slice(&r.body).expect("jails json"),
        dirs,
        pids,
    }
}

#[test]
fn the_agent_refuses_hostile_requests_on_both_listeners_and_changes_nothing() {
    let cp = AcceptingControlPlane::start();
    let tcp_addr = SocketAddr::from(([127, 0, 0, 1], crate::util::controlplane::free_port()));
    let agent = Agent::start(&[
        "--simulate",
        "--node-id",
        "n1",
        "--heartbeat-interval",
        "100ms",
        "--controlplane",
        &cp.addr.to_string(),
        "--advertise-addr",
        &tcp_addr.to_string(),
    ]);
    await_true("the agent's first heartbeat", || {
        *cp.heartbeats.lock().expect("count") > 0
    });
    let node = Signer::new(
        auth::load_key(
            &agent.dir().join("keel-sim/keys/node.key"),
            KeyFilePolicy::for_current_process(),
        )
        .expect("the agent's node key"),
    );
    let operator = Signer::new(generate_key("operator-1").expect("key"));
    let unix = Ep::Unix(agent.socket());
    let tcp = Ep::Tcp(tcp_addr);

    let keep = jail_yaml("keep");
    let applied = exchange(&unix, &raw("PUT", b"/jails/keep", &[], &keep));
    assert_eq!(
        status_of(&applied),
        200,
        "{}",
        String::from_utf8_lossy(&applied)
    );
    assert_eq!(
        status_of(&exchange(
            &tcp,
            &signed(Some(&node), "GET", "/jails/keep", b"")
        )),
        200,
        "a signed request is served on TCP"
    );
    // Past Starting: the state must not move on its own during the attack.
    crate::util::poll_until("keep seen running", || {
        agent_host(&agent).jails[0]["state"] == "Running"
    });
    let before = agent_host(&agent);

    let slow_open = Arc::new(AtomicBool::new(true));
    let slow_sent = Arc::new(AtomicUsize::new(0));
    let slow = slowloris(&unix, slow_open.clone(), slow_sent.clone());
    await_true("the slowloris client to start", || {
        slow_sent.load(Ordering::SeqCst) > 3
    });

    let mut rows = Vec::new();
    for ep in [&unix, &tcp] {
        rows.extend(framing_rows(ep));
        // Route-level rows: signed on TCP so they reach the route.
        let signer = matches!(ep, Ep::Tcp(_)).then_some(&node);
        for name in bad_names() {
            for method in ["GET", "PUT", "DELETE"] {
                rows.push(row(
                    format!("bad name in path {method} {name}"),
                    ep,
                    signed(signer, method, &format!("/jails/{name}"), &jail_yaml(&name)),
                    400,
                ));
            }
            rows.push(row(
                format!("bad metadata.name {name}"),
                ep,
                signed(signer, "PUT", "/jails/fine", &jail_yaml(&name)),
                400,
            ));
        }
        for (label, body) in [
            ("not a spec", b"kind: Jail\n".to_vec()),
            (
                "not UTF-8",
                b"kind: Jail\nmetadata: {name: \xff}\n".to_vec(),
            ),
            ("not YAML", b"{[: \n".to_vec()),
            ("name differs from path", jail_yaml("other")),
        ] {
            rows.push(row(
                label,
                ep,
                signed(signer, "PUT", "/jails/keep", &body),
                400,
            ));
        }
    }
    let route = |method, path, body, replay_path, replay_body| SignedRoute {
        method,
        path,
        body,
        good: &node,
        wrong: &operator,
        replay: (replay_path, replay_body),
    };
    let empty: &[u8] = b"";
    let routes = [
        route("GET", "/healthz", empty, "/healthz", empty),
        route("GET", "/metrics", empty, "/metrics", empty),
        route("GET", "/jails", empty, "/jails", empty),
        route("GET", "/jails/keep", empty, "/jails/keep", empty),
        // Re-applying the same spec changes nothing: a harmless original.
        route("PUT", "/jails/keep", &keep, "/jails/keep", &keep),
        route("DELETE", "/jails/keep", empty, "/jails/absent", empty),
    ];
    for r in &routes {
        rows.extend(auth_rows(&tcp, r));
    }

    let served = run_rows(&rows, &unix, None, &slow_open);
    let answer = slow.join().expect("slowloris thread");
    assert_eq!(
        status_of(&answer),
        408,
        "the slowloris client is cut off: {}",
        String::from_utf8_lossy(&answer)
    );
    assert!(
        served > 0,
        "nobody was served while the slowloris client was open"
    );
    assert_eq!(agent_host(&agent), before, "the host changed");
    assert!(
        !agent.dir().join("keel-sim/jails/absent").exists()
            && !agent.dir().join("keel-sim/jails/fine").exists()
    );
}

// ---------------------------------------------------------- control plane

/// The control plane's view that must not change: nodes (without the age of
/// their last heartbeat) and what the fake agents hold.
fn cp_view(
    cp: &ControlPlane,
    operator: &Signer,
    agents: &[&FakeAgent],
) -> (Vec<NodeStatus>, Vec<Vec<String>>) {
    let r = cp.must(Some(operator), "GET", "/nodes", b"");
    assert_eq!(r.status, 200);
    let mut nodes: Vec<NodeStatus> = serde_json::from_slice(&r.body).expect("nodes");
    for n in &mut nodes {
        n.last_seen_secs = None;
    }
    nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    let held = agents
        .iter()
        .map(|a| a.held().into_keys().collect())
        .collect();
    (nodes, held)
}

#[test]
fn the_control_plane_refuses_hostile_requests_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = ControlPlane::start(dir.path(), &["--dead-after", "1h"]);
    let node = cp.signer("node.key");
    let operator = cp.signer("operator.key");
    let keys = dir.path().join("keel-sim/keys");
    let (a, b) = (FakeAgent::start(&keys), FakeAgent::start(&keys));
    a.register(&cp, &node, "n1").expect("register n1");
    b.register(&cp, &node, "n2").expect("register n2");
    let keep = jail_yaml("keep");
    let r = cp.must(Some(&operator), "PUT", "/jails/keep", &keep);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let holder = r.header("X-Keel-Node").expect("placed").to_string();
    let before = cp_view(&cp, &operator, &[&a, &b]);
    let tcp = Ep::Tcp(cp.addr());

    let slow_open = Arc::new(AtomicBool::new(true));
    let slow_sent = Arc::new(AtomicUsize::new(0));
    let slow = slowloris(&tcp, slow_open.clone(), slow_sent.clone());
    await_true("the slowloris client to start", || {
        slow_sent.load(Ordering::SeqCst) > 3
    });

    let mut rows = framing_rows(&tcp);
    let op = Some(&operator);
    for name in bad_names() {
        for method in ["GET", "PUT", "DELETE"] {
            for path in [
                format!("/jails/{name}"),
                format!("/jails/{name}/log"),
                format!("/nodes/{name}"),
                format!("/nodes/{name}/jails/web"),
                format!("/nodes/n1/jails/{name}"),
                format!("/nodes/{name}/ingresses/shop"),
                format!("/nodes/n1/ingresses/{name}"),
            ] {
                rows.push(row(
                    format!("bad name {method} {path}"),
                    &tcp,
                    signed(op, method, &path, &jail_yaml(&name)),
                    400,
                ));
            }
        }
        rows.push(row(
            format!("bad node id heartbeat {name}"),
            &tcp,
            signed(
                Some(&node),
                "POST",
                &format!("/nodes/{name}/heartbeat"),
                b"{}",
            ),
            400,
        ));
        // The control plane never parses a spec: the agent refuses it,
        // and the refusal comes back untouched, no placement recorded.
        rows.push(row(
            format!("bad metadata.name {name}"),
            &tcp,
            signed(op, "PUT", "/jails/fine", &jail_yaml(&name)),
            400,
        ));
    }
    let register = br#"{"node_id": "Bad_Id", "advertise_addr": "127.0.0.1:1", "capacity": {"cpu": 1.0, "memory": 1}}"#;
    rows.push(row(
        "bad node id in a registration",
        &tcp,
        signed(Some(&node), "POST", "/nodes/register", register),
        400,
    ));
    rows.push(row(
        "registration that is not JSON",
        &tcp,
        signed(Some(&node), "POST", "/nodes/register", b"node_id: n3"),
        400,
    ));

    let (n, o) = (&node, &operator);
    let not_json: &[u8] = b"not json";
    let not_spec: &[u8] = b"kind: Jail\n";
    let ingress: &[u8] =
        b"kind: Ingress\nmetadata: {name: shop}\nspec: {host: shop.example.com, service: web}\n";
    let route = |method, path, body, good, wrong, replay_path, replay_body| SignedRoute {
        method,
        path,
        body,
        good,
        wrong,
        replay: (replay_path, replay_body),
    };
    let empty: &[u8] = b"";
    let routes = [
        route(
            "POST",
            "/nodes/register",
            b"{}",
            n,
            o,
            "/nodes/register",
            not_json,
        ),
        route(
            "POST",
            "/nodes/n1/heartbeat",
            b"{}",
            n,
            o,
            "/nodes/n1/heartbeat",
            not_json,
        ),
        route("GET", "/nodes", empty, o, n, "/nodes", empty),
        // Signed as it should be, n1 (Alive) is refused and n9 unknown:
        // nothing changes either way.
        route("DELETE", "/nodes/n1", empty, o, n, "/nodes/n9", empty),
        route(
            "POST",
            "/nodes/n1/cordon",
            empty,
            o,
            n,
            "/nodes/n9/cordon",
            empty,
        ),
        route("GET", "/metrics", empty, o, n, "/metrics", empty),
        route(
            "GET",
            "/nodes/n1/jails",
            empty,
            o,
            n,
            "/nodes/n1/jails",
            empty,
        ),
        route(
            "PUT",
            "/nodes/n1/jails/keep",
            &keep,
            o,
            n,
            "/nodes/n1/jails/replayed",
            not_spec,
        ),
        route(
            "GET",
            "/nodes/n1/jails/keep",
            empty,
            o,
            n,
            "/nodes/n1/jails/keep",
            empty,
        ),
        route(
            "DELETE",
            "/nodes/n1/jails/keep",
            empty,
            o,
            n,
            "/nodes/n1/jails/absent",
            empty,
        ),
        route(
            "PUT",
            "/jails/keep",
            &keep,
            o,
            n,
            "/jails/replayed",
            not_spec,
        ),
        route("GET", "/jails/keep", empty, o, n, "/jails/keep", empty),
        route("DELETE", "/jails/keep", empty, o, n, "/jails/absent", empty),
        route(
            "GET",
            "/nodes/n1/ingresses",
            empty,
            o,
            n,
            "/nodes/n1/ingresses",
            empty,
        ),
        route(
            "PUT",
            "/nodes/n1/ingresses/shop",
            ingress,
            o,
            n,
            "/nodes/n1/ingresses/replayed",
            not_spec,
        ),
        route(
            "GET",
            "/nodes/n1/ingresses/shop",
            empty,
            o,
            n,
            "/nodes/n1/ingresses/shop",
            empty,
        ),
        route(
            "DELETE",
            "/nodes/n1/ingresses/shop",
            empty,
            o,
            n,
            "/nodes/n1/ingresses/absent",
            empty,
        ),
    ];
    for r in &routes {
        rows.extend(auth_rows(&tcp, r));
    }

    let served = run_rows(&rows, &tcp, None, &slow_open);
    let answer = slow.join().expect("slowloris thread");
    assert_eq!(
        status_of(&answer),
        408,
        "the slowloris client is cut off: {}",
        String::from_utf8_lossy(&answer)
    );
    assert!(
        served > 0,
        "nobody was served while the slowloris client was open"
    );
    assert_eq!(cp_view(&cp, &operator, &[&a, &b]), before, "state changed");
    let held_by = |agent: &FakeAgent| agent.held().contains_key("keep");
    let expected_holder = if holder == "n1" { &a } else { &b };
    assert!(held_by(expected_holder), "keep moved off {holder}");
    for name in ["fine", "replayed", "absent", "big", "web"] {
        let r = cp.must(Some(&operator), "GET", &format!("/jails/{name}"), b"");
        assert_eq!(r.status, 404, "{name} got a placement");
    }
}

// -------------------------------------------------------- files and modes

#[test]
fn the_agent_socket_is_mode_0660_in_the_configured_group() {
    // As root the socket can be given any group; otherwise only our own.
    let probe = tempfile::tempdir().expect("tempdir");
    let me = std::fs::metadata(probe.path()).expect("metadata");
    let group = if me.uid() == 0 && group_gid("daemon").is_some() {
        "daemon".to_string()
    } else {
        me.gid().to_string()
    };
    let gid = group_gid(&group)
        .or_else(|| group.parse().ok())
        .expect("a gid");
    let agent = Agent::start(&["--simulate", "--socket-group", &group]);
    let meta = std::fs::metadata(agent.socket()).expect("socket metadata");
    assert_eq!(meta.mode() & 0o7777, 0o660, "socket mode");
    assert_eq!(meta.gid(), gid, "socket group {group}");
}

/// The gid of `name` in /etc/group.
fn group_gid(name: &str) -> Option<u32> {
    let table = std::fs::read_to_string("/etc/group").ok()?;
    table.lines().find_map(|l| {
        let mut f = l.split(':');
        (f.next() == Some(name))
            .then(|| f.nth(1).and_then(|g| g.parse().ok()))
            .flatten()
    })
}

/// Runs a daemon that must refuse to start; its exit status and stderr.
fn refused_start(program: &str, args: &[&str], dir: &Path) -> (i32, String) {
    let mut child = Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let end = Instant::now() + DEADLINE;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{program} {args:?} kept running with a loose key file");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("read stderr");
    (status.code().unwrap_or(-1), err)
}

/// A key file at `path` with `mode`.
fn loose_key(path: &Path, id: &str, mode: u32) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("keys dir");
    write_key_file(path, &generate_key(id).expect("key")).expect("write key");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

#[test]
fn loose_key_files_stop_both_daemons_from_starting() {
    for mode in [0o644, 0o640, 0o604, 0o660] {
        // The control plane: its own node key, and an operator key.
        for file in ["node.key", "operator.key"] {
            let dir = tempfile::tempdir().expect("tempdir");
            let keys = dir.path().join("keel-sim/keys");
            let path = keys.join(file);
            loose_key(&path, "loose", mode);
            let port = crate::util::controlplane::free_port().to_string();
            let listen = format!("127.0.0.1:{port}");
            let (code, err) = refused_start(
                CONTROLPLANE,
                &["--simulate", "--listen", &listen],
                dir.path(),
            );
            assert_ne!(code, 0, "{file} {mode:o}: {err}");
            assert!(
                err.contains(&path.display().to_string()),
                "{file} {mode:o}: the error names the file: {err}"
            );
        }
        // A clustered agent: its node key.
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("keel-sim/keys/node.key");
        loose_key(&path, "loose", mode);
        let advertise = format!("127.0.0.1:{}", crate::util::controlplane::free_port());
        let (code, err) = refused_start(
            AGENTD,
            &[
                "--simulate",
                "--node-id",
                "n1",
                "--controlplane",
                "127.0.0.1:9",
                "--advertise-addr",
                &advertise,
            ],
            dir.path(),
        );
        assert_ne!(code, 0, "agent {mode:o}: {err}");
        assert!(
            err.contains(&path.display().to_string()),
            "agent {mode:o}: the error names the file: {err}"
        );
        assert!(
            !dir.path().join("keel-sim/agentd.sock").exists(),
            "the agent bound its socket before refusing"
        );
    }
}
