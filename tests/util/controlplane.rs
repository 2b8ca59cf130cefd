//! A real `keel-controlplane --simulate` on loopback and in-test fake agents
//! for it, shared by the hostile-input and crash-campaign tests.
//!
//! The control plane runs in a temp dir (its `./keel-sim/` state and keys are
//! private to the test) and is killed on drop. [`FakeAgent`] is an in-test
//! HTTP server that checks the control plane's node signature and answers
//! like keel-agentd would: it validates Jail specs with the agent's own
//! parser, keeps the jails it was told to apply, and drops the ones a
//! heartbeat answer calls stale (fencing).

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel::common::auth::{self, KeyFilePolicy, Keyring, Role, Signer, Verifier};
use keel::common::http::{
    Client, ClientResponse, Endpoint, Request, Response, Server, ServerLimits, ShutdownSignal,
};
use keel::common::names::replica_of;
use keel::common::spec::Document;
use keel::common::wire::{
    EPOCH_HEADER, HeartbeatRequest, HeartbeatResponse, PlacedJail, RegisterRequest,
    RegisterResponse, Resources,
};

/// The control-plane binary under test.
pub const CONTROLPLANE: &str = env!("CARGO_BIN_EXE_keel-controlplane");

/// Bound on starting the daemon and on every request.
const DEADLINE: Duration = Duration::from_secs(20);

/// A port nothing listens on right now (another process could take it
/// before the daemon binds it, which these tests accept).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// A running (or killed, see [`ControlPlane::kill9`]) control plane.
pub struct ControlPlane {
    dir: PathBuf,
    addr: SocketAddr,
    args: Vec<String>,
    child: Option<Child>,
}

impl ControlPlane {
    /// Starts `keel-controlplane --simulate --listen 127.0.0.1:PORT` with
    /// `extra` arguments in `dir` and waits until it accepts connections.
    pub fn start(dir: &Path, extra: &[&str]) -> ControlPlane {
        let port = free_port();
        let mut args: Vec<String> = vec![
            "--simulate".into(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        let mut cp = ControlPlane {
            dir: dir.to_path_buf(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            args,
            child: None,
        };
        cp.launch();
        cp
    }

    /// Its pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its TCP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its state directory (`./keel-sim/controlplane`).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("keel-sim/controlplane")
    }

    /// What it wrote on stderr, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("controlplane.log")).unwrap_or_default()
    }

    /// A signer for the simulated key file `name` (`node.key`, `operator.key`).
    pub fn signer(&self, name: &str) -> Signer {
        let key = auth::load_key(
            &self.dir.join("keel-sim/keys").join(name),
            KeyFilePolicy::for_current_process(),
        )
        .expect("load a simulated key");
        Signer::new(key)
    }

    /// One request, signed by `signer` when there is one.
    pub fn call(
        &self,
        signer: Option<&Signer>,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> Result<ClientResponse, keel::common::http::HttpError> {
        let headers = match signer {
            Some(s) => auth::sign_headers(s, method, path, body, auth::unix_now()).expect("sign"),
            None => Vec::new(),
        };
        Client::new(Endpoint::Tcp(self.addr.to_string()))
            .with_timeout(DEADLINE)
            .request(method, path, &headers, body)
    }

    /// Like [`ControlPlane::call`], panicking with the log if there is no answer.
    pub fn must(
        &self,
        signer: Option<&Signer>,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> ClientResponse {
        self.call(signer, method, path, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\nlog:\n{}", self.log()))
    }

    /// `kill -9`.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and directory.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "kill it before restarting it");
        self.launch();
    }

    fn launch(&mut self) {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.dir.join("controlplane.log"))
            .expect("log file");
        let child = Command::new(CONTROLPLANE)
            .args(&self.args)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn keel-controlplane");
        self.child = Some(child);
        let deadline = Instant::now() + DEADLINE;
        // Serving, not only listening: with etcd a standby listens too (and
        // answers 503) until it holds the leader key.
        let client =
            Client::new(Endpoint::Tcp(self.addr.to_string())).with_timeout(Duration::from_secs(2));
        let serving = || {
            TcpStream::connect(self.addr).is_ok()
                && client
                    .request("GET", "/healthz", &[], b"")
                    .is_ok_and(|r| r.status == 200)
        };
        while !serving() {
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                self.child = None;
                panic!("keel-controlplane exited with {status}:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "keel-controlplane did not listen on {}:\n{}",
                self.addr,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// What a fake agent holds: jail name -> (epoch it was applied under, body).
pub type Held = BTreeMap<String, (Option<u64>, Vec<u8>)>;

/// An in-test agent on loopback; see the module docs.
pub struct FakeAgent {
    /// Its TCP address (what it registers as `advertise_addr`).
    pub addr: SocketAddr,
    held: Arc<Mutex<Held>>,
    requests: Arc<Mutex<usize>>,
    shutdown: ShutdownSignal,
}

/// What an agent checks the control plane's requests with: the node key in
/// `keys_dir` (`keel-sim/keys/node.key`), the default clock skew.
pub fn node_verifier(keys_dir: &Path) -> Verifier {
    let keyring = Keyring::load(
        &[keys_dir.join("node.key")],
        &[],
        KeyFilePolicy::for_current_process(),
    )
    .expect("keyring");
    Verifier::new(keyring, Duration::from_secs(300))
}

impl FakeAgent {
    /// Serves on a free loopback port, accepting the node keys in `keys_dir`
    /// (`node.key`, which the control plane signs forwarded requests with).
    pub fn start(keys_dir: &Path) -> FakeAgent {
        let verifier = node_verifier(keys_dir);
        let held: Arc<Mutex<Held>> = Arc::default();
        let requests: Arc<Mutex<usize>> = Arc::default();
        let (h, r) = (held.clone(), requests.clone());
        let handler = move |req: Request| -> Response {
            if let Err(e) = auth::verify_request(&verifier, &req, Role::Node, auth::unix_now()) {
                return auth::refusal(&e);
            }
            *r.lock().expect("count") += 1;
            let mut held = h.lock().expect("held");
            match (req.method.as_str(), req.segments().as_slice()) {
                ("GET", ["jails"]) => {
                    let names: Vec<&String> = held.keys().collect();
                    Response::json(200, &names)
                }
                ("PUT", ["jails", name]) => {
                    let text = String::from_utf8_lossy(&req.body);
                    // A Jail named `name`, or the Service `name` is a replica
                    // of (the control plane healing a service).
                    let named = |doc: &Document| match doc {
                        Document::Jail(j) => j.metadata.name == *name,
                        Document::Service(s) => replica_of(name)
                            .is_some_and(|(svc, i)| svc == s.metadata.name && i < s.spec.replicas),
                        _ => false,
                    };
                    match keel::common::spec::parse_documents(&text) {
                        Err(e) => Response::error(400, &e.to_string(), None),
                        Ok(docs) if docs.len() != 1 || !named(&docs[0]) => Response::error(
                            400,
                            "not a Jail or Service document for this name",
                            None,
                        ),
                        Ok(_) => {
                            let epoch = req.header(EPOCH_HEADER).and_then(|e| e.parse().ok());
                            held.insert(name.to_string(), (epoch, req.body.clone()));
                            Response::json(200, &serde_json::json!({"name": name}))
                        }
                    }
                }
                ("GET", ["jails", name]) => match held.get(*name) {
                    Some(_) => Response::json(200, &serde_json::json!({"name": name})),
                    None => Response::error(404, "no such jail", None),
                },
                ("DELETE", ["jails", name]) => match held.remove(*name) {
                    Some(_) => Response::json(200, &serde_json::json!({"deleted": name})),
                    None => Response::error(404, "no such jail", None),
                },
                _ => Response::error(404, "no route", None),
            }
        };
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake agent");
        let addr = listener.local_addr().expect("address");
        let shutdown = ShutdownSignal::new();
        Server::new(Arc::new(handler), ServerLimits::default(), shutdown.clone())
            .serve_tcp(listener)
            .expect("serve fake agent");
        FakeAgent {
            addr,
            held,
            requests,
            shutdown,
        }
    }

    /// The jails it holds now.
    pub fn held(&self) -> Held {
        self.held.lock().expect("held").clone()
    }

    /// How many signed requests reached it.
    pub fn requests(&self) -> usize {
        *self.requests.lock().expect("count")
    }

    /// `POST /nodes/register` as node `id`; the pod_cidr on success, else
    /// what went wrong.
    pub fn register(&self, cp: &ControlPlane, node: &Signer, id: &str) -> Result<String, String> {
        let body = serde_json::to_vec(&RegisterRequest {
            node_id: id.into(),
            advertise_addr: self.addr,
            capacity: Resources {
                cpu: 64.0,
                memory: 64 << 30,
            },
        })
        .expect("json");
        let r = cp
            .call(Some(node), "POST", "/nodes/register", &body)
            .map_err(|e| e.to_string())?;
        if r.status != 200 {
            return Err(refused(&r));
        }
        Ok(serde_json::from_slice::<RegisterResponse>(&r.body)
            .expect("register body")
            .pod_cidr)
    }

    /// `POST /nodes/{id}/heartbeat` reporting what it holds, then drops what
    /// the answer calls stale, as keel-agentd's fencing does.
    pub fn heartbeat(
        &self,
        cp: &ControlPlane,
        node: &Signer,
        id: &str,
    ) -> Result<HeartbeatResponse, String> {
        let placed = self
            .held()
            .into_iter()
            .filter_map(|(name, (epoch, _))| {
                Some(PlacedJail {
                    name,
                    epoch: epoch?,
                    running: true,
                    ready: None,
                    address: None,
                })
            })
            .collect();
        let body = serde_json::to_vec(&HeartbeatRequest {
            peer_changes: false,
            endpoints_held: None,
            endpoints_generation: None,
            connections: Vec::new(),
            events_seq: None,
            committed: Resources {
                cpu: 0.0,
                memory: 0,
            },
            jails: 0,
            placed,
            peers_version: None,
            endpoint_changes: false,
        })
        .expect("json");
        let r = cp
            .call(Some(node), "POST", &format!("/nodes/{id}/heartbeat"), &body)
            .map_err(|e| e.to_string())?;
        if r.status != 200 {
            return Err(refused(&r));
        }
        let resp: HeartbeatResponse = serde_json::from_slice(&r.body).expect("heartbeat body");
        let mut held = self.held.lock().expect("held");
        for name in &resp.stale {
            held.remove(name);
        }
        Ok(resp)
    }
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

fn refused(r: &ClientResponse) -> String {
    format!("{}: {}", r.status, String::from_utf8_lossy(&r.body))
}
