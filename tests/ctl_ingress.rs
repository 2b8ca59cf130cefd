//! keelctl's ingress commands as a process: `apply` of a `kind: Ingress`
//! document, `get ingresses [NAME]` as a table, JSON and YAML, `delete
//! ingress NAME` and `delete -f`, against a stand-in agent speaking the
//! agent's ingress contract (`PUT/GET/DELETE /ingresses/{name}`, `GET
//! /ingresses`, `common::wire::IngressStatus` answers, `{"deleted": name}`,
//! Keel's JSON error body) on a Unix socket; and the same through a real
//! keel-controlplane with `--node`, the stand-in then on TCP checking the
//! control plane's node signature, so the relay is checked byte for byte.
//!
//! The stand-in parses what it gets with the agent's own spec parser and
//! keeps the statuses in memory; the test sets a certificate expiry and an
//! error on it directly, as the agent's issuer would.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use keel::common::auth::{self, Role, Verifier};
use keel::common::http::{Request, Response, Server, ServerLimits, ShutdownSignal};
use keel::common::spec::parse_ingress;
use keel::common::wire::{
    AppliedDocument, IngressPhase, IngressStatus, RegisterRequest, Resources,
};
use keel::ctl::output::NodeIngress;

use crate::util::cluster::{Run, run};
use crate::util::controlplane::{ControlPlane, node_verifier};

const KEELCTL: &str = env!("CARGO_BIN_EXE_keelctl");

const SHOP: &str = "kind: Ingress
metadata: {name: shop}
spec:
  host: shop.example.com
  service: web
";

const BLOG: &str = "kind: Ingress
metadata: {name: blog}
spec:
  host: blog.example.org
  service: api
";

/// One request the stand-in accepted: method, path, Content-Type, body.
type Seen = (String, String, Option<String>, Vec<u8>);

/// An in-test agent serving only the ingress routes.
struct StandIn {
    ingresses: Arc<Mutex<BTreeMap<String, IngressStatus>>>,
    /// Each ingress as it was applied, as the agent's
    /// `GET /ingresses/{name}/document` answers it.
    documents: Arc<Mutex<BTreeMap<String, String>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    shutdown: ShutdownSignal,
}

impl StandIn {
    /// The handler; with a verifier every request must carry the control
    /// plane's node signature.
    fn handler(&self, verifier: Option<Verifier>) -> Arc<dyn keel::common::http::Handler> {
        let (store, seen) = (self.ingresses.clone(), self.seen.clone());
        let documents = self.documents.clone();
        Arc::new(move |req: Request| -> Response {
            if let Some(v) = &verifier
                && let Err(e) = auth::verify_request(v, &req, Role::Node, auth::unix_now())
            {
                return auth::refusal(&e);
            }
            seen.lock().expect("seen").push((
                req.method.clone(),
                req.path.clone(),
                req.header("Content-Type").map(str::to_string),
                req.body.clone(),
            ));
            let mut store = store.lock().expect("store");
            match (req.method.as_str(), req.segments().as_slice()) {
                ("GET", ["ingresses"]) => {
                    Response::json(200, &store.values().cloned().collect::<Vec<_>>())
                }
                ("PUT", ["ingresses", name]) => {
                    match parse_ingress(&String::from_utf8_lossy(&req.body)) {
                        Err(e) => Response::error(400, &e.to_string(), None),
                        Ok(i) if i.metadata.name != *name => {
                            Response::error(400, "metadata.name differs", Some("metadata.name"))
                        }
                        Ok(i) => {
                            documents
                                .lock()
                                .expect("documents")
                                .insert(name.to_string(), i.to_yaml());
                            let status =
                                store
                                    .entry(name.to_string())
                                    .or_insert_with(|| IngressStatus {
                                        name: name.to_string(),
                                        host: String::new(),
                                        service: String::new(),
                                        phase: IngressPhase::Issuing,
                                        certificate_expires: None,
                                        last_error: None,
                                    });
                            status.host = i.spec.host;
                            status.service = i.spec.service;
                            Response::json(200, status)
                        }
                    }
                }
                ("GET", ["ingresses", name, "document"]) => {
                    match documents.lock().expect("documents").get(*name) {
                        Some(document) => Response::json(
                            200,
                            &AppliedDocument {
                                document: document.clone(),
                            },
                        ),
                        None => Response::error(404, &format!("no ingress named {name}"), None),
                    }
                }
                ("GET", ["ingresses", name]) => match store.get(*name) {
                    Some(s) => Response::json(200, s),
                    None => Response::error(404, &format!("no ingress named {name}"), None),
                },
                ("DELETE", ["ingresses", name]) => match store.remove(*name) {
                    Some(_) => Response::json(200, &serde_json::json!({ "deleted": name })),
                    None => Response::error(404, &format!("no ingress named {name}"), None),
                },
                _ => Response::error(404, "no route", None),
            }
        })
    }

    fn new() -> StandIn {
        StandIn {
            ingresses: Arc::default(),
            documents: Arc::default(),
            seen: Arc::default(),
            shutdown: ShutdownSignal::new(),
        }
    }

    /// Serves unsigned requests on the Unix socket `path`.
    fn serve_unix(self, path: &Path) -> StandIn {
        let listener = UnixListener::bind(path).expect("bind the stand-in's socket");
        Server::new(
            self.handler(None),
            ServerLimits::default(),
            self.shutdown.clone(),
        )
        .serve_unix(listener)
        .expect("serve");
        self
    }

    /// Serves on a loopback port, accepting the node key in `keys_dir`.
    fn serve_tcp(self, keys_dir: &Path) -> (StandIn, SocketAddr) {
        let verifier = node_verifier(keys_dir);
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        Server::new(
            self.handler(Some(verifier)),
            ServerLimits::default(),
            self.shutdown.clone(),
        )
        .serve_tcp(listener)
        .expect("serve");
        (self, addr)
    }

    /// What the agent's issuer would record after a first certificate.
    fn serving(&self, name: &str, expires: i64) {
        let mut store = self.ingresses.lock().expect("store");
        let s = store.get_mut(name).expect("applied");
        s.phase = IngressPhase::Serving;
        s.certificate_expires = Some(expires);
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

fn keelctl(args: &[&str], stdin: Option<&str>) -> Run {
    let mut cmd = Command::new(KEELCTL);
    cmd.args(args)
        .env_remove("KEEL_SOCKET")
        .env_remove("KEEL_CONTROLPLANE");
    run(cmd, stdin)
}

fn ok(args: &[&str], stdin: Option<&str>) -> Run {
    let run = keelctl(args, stdin);
    assert_eq!(run.code, 0, "keelctl {args:?}: {run:?}");
    run
}

/// 2027-01-15T08:00:00Z.
const EXPIRES: i64 = 1_800_000_000;

#[test]
fn keelctl_applies_lists_shows_and_deletes_ingresses_on_an_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("agent.sock");
    let agent = StandIn::new().serve_unix(&socket);
    let s = socket.to_str().expect("utf-8 path");
    let file = dir.path().join("ingress.yaml");
    std::fs::write(&file, format!("{SHOP}---\n{BLOG}")).expect("write");
    let f = file.to_str().expect("utf-8 path");

    let applied = ok(&["--socket", s, "apply", "-f", f], None);
    assert_eq!(
        applied.stdout,
        "ingress/shop applied (Issuing, shop.example.com -> service web)\n\
         ingress/blog applied (Issuing, blog.example.org -> service api)\n"
    );
    let seen = agent.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(
        (seen[0].0.as_str(), seen[0].1.as_str()),
        ("PUT", "/ingresses/shop")
    );
    assert_eq!(seen[0].2.as_deref(), Some("application/yaml"));
    assert_eq!(
        parse_ingress(&String::from_utf8_lossy(&seen[0].3)).expect("a kind: Ingress body"),
        parse_ingress(SHOP).expect("valid")
    );

    agent.serving("shop", EXPIRES);
    agent
        .ingresses
        .lock()
        .expect("store")
        .get_mut("blog")
        .expect("applied")
        .last_error = Some("DNS-01: TXT record not seen by 1.1.1.1\nafter 120s".into());
    let table = ok(&["--socket", s, "get", "ingresses"], None).stdout;
    assert_eq!(
        table,
        "NAME   HOST               SERVICE   CERT EXPIRES           STATUS    LAST ERROR\n\
         blog   blog.example.org   api       -                      Issuing   DNS-01: TXT record not seen by 1.1.1.1 after 120s\n\
         shop   shop.example.com   web       2027-01-15T08:00:00Z   Serving\n"
    );
    let one: IngressStatus = serde_json::from_str(
        &ok(&["--socket", s, "get", "ing", "shop", "-o", "json"], None).stdout,
    )
    .expect("get ing shop -o json is one ingress");
    assert_eq!(
        (one.phase, one.certificate_expires, one.host.as_str()),
        (IngressPhase::Serving, Some(EXPIRES), "shop.example.com")
    );
    let all: Vec<IngressStatus> =
        serde_yaml::from_str(&ok(&["--socket", s, "get", "ingress", "-o", "yaml"], None).stdout)
            .expect("get ingress -o yaml is a list");
    assert_eq!(all.len(), 2);

    let missing = keelctl(&["--socket", s, "get", "ingress", "nope"], None);
    assert_eq!(missing.code, 1, "{missing:?}");
    assert!(
        missing
            .stderr
            .starts_with("keelctl: get ingress/nope failed: no ingress named nope\n"),
        "{missing:?}"
    );

    let deleted = ok(&["--socket", s, "delete", "ingress", "blog"], None);
    assert_eq!(deleted.stdout, "ingress/blog deleted\n");
    // The file's documents go last one first: blog is gone already.
    let again = keelctl(
        &["--socket", s, "delete", "-f", "-"],
        Some(&format!("{SHOP}---\n{BLOG}")),
    );
    assert_eq!(again.code, 1, "{again:?}");
    assert!(
        again
            .stderr
            .contains("delete ingress/blog failed: no ingress named blog"),
        "{again:?}"
    );
    let shop_only = ok(&["--socket", s, "delete", "-f", "-"], Some(SHOP));
    assert_eq!(shop_only.stdout, "ingress/shop deleted\n");
    let empty = ok(&["--socket", s, "get", "ingresses"], None);
    assert_eq!(
        (empty.stdout.as_str(), empty.stderr.as_str()),
        ("", "No ingresses found.\n")
    );
}

#[test]
fn keelctl_reaches_a_nodes_ingresses_through_the_control_plane_with_node() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cp = ControlPlane::start(dir.path(), &["--dead-after", "1h"]);
    let keys = dir.path().join("keel-sim/keys");
    let (agent, addr) = StandIn::new().serve_tcp(&keys);
    let body = serde_json::to_vec(&RegisterRequest {
        node_id: "n1".into(),
        advertise_addr: addr,
        capacity: Resources {
            cpu: 4.0,
            memory: 8 << 30,
        },
    })
    .expect("json");
    let r = cp.must(
        Some(&cp.signer("node.key")),
        "POST",
        "/nodes/register",
        &body,
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));

    let cp_addr = cp.addr().to_string();
    let key = keys.join("operator.key");
    let key = key.to_str().expect("utf-8 path");
    let via = |args: &[&str]| -> Vec<String> {
        ["--controlplane", &cp_addr, "--key-file", key]
            .iter()
            .chain(args)
            .map(|a| a.to_string())
            .collect()
    };
    let run = |args: &[&str], stdin: Option<&str>| {
        let args = via(args);
        keelctl(&args.iter().map(String::as_str).collect::<Vec<_>>(), stdin)
    };

    // Without --node nothing is sent.
    let refused = run(&["apply", "-f", "-"], Some(SHOP));
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("give --node ID"), "{refused:?}");
    assert!(agent.seen().is_empty());

    let applied = run(&["--node", "n1", "apply", "-f", "-"], Some(SHOP));
    assert_eq!(applied.code, 0, "{applied:?}\n{}", cp.log());
    assert_eq!(
        applied.stdout,
        "ingress/shop applied on node n1 (Issuing, shop.example.com -> service web)\n"
    );
    let seen = agent.seen();
    assert_eq!(
        (seen[0].0.as_str(), seen[0].1.as_str()),
        ("PUT", "/ingresses/shop")
    );
    // Relayed byte for byte: the body keelctl writes for this document.
    assert_eq!(
        seen[0].3,
        parse_ingress(SHOP).expect("valid").to_yaml().into_bytes()
    );

    agent.serving("shop", EXPIRES);
    // The list needs no --node: every Alive node's, with the node alongside.
    let expected = "NAME   NODE   HOST               SERVICE   CERT EXPIRES           STATUS    LAST ERROR\n\
                    shop   n1     shop.example.com   web       2027-01-15T08:00:00Z   Serving\n";
    for args in [
        &["get", "ingresses"][..],
        &["get", "ingresses", "--node", "n1"],
    ] {
        let table = run(args, None);
        assert_eq!(
            (table.code, table.stdout.as_str()),
            (0, expected),
            "{table:?}"
        );
    }
    let listed: Vec<NodeIngress> =
        serde_json::from_str(&run(&["get", "ingresses", "-o", "json"], None).stdout)
            .expect("json list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        (
            listed[0].node.as_deref(),
            listed[0].status.certificate_expires
        ),
        (Some("n1"), Some(EXPIRES))
    );
    // One ingress is asked of its node: without --node nothing is sent.
    let sent = agent.seen().len();
    let refused = run(&["get", "ingress", "shop"], None);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("needs --node ID"), "{refused:?}");
    assert_eq!(agent.seen().len(), sent);
    let one = run(
        &["get", "ingress", "shop", "--node", "n1", "-o", "json"],
        None,
    );
    let one: IngressStatus = serde_json::from_str(&one.stdout).expect("one ingress");
    assert_eq!(one.certificate_expires, Some(EXPIRES));
    // In YAML: the document as applied, then its status, through the relay.
    let printed = run(
        &["get", "ingress", "shop", "--node", "n1", "-o", "yaml"],
        None,
    );
    assert_eq!(printed.code, 0, "{printed:?}");
    assert_eq!(
        parse_ingress(&printed.stdout).expect("applies back"),
        parse_ingress(SHOP).expect("valid")
    );
    let object: serde_yaml::Value = serde_yaml::from_str(&printed.stdout).expect("yaml");
    let status: IngressStatus =
        serde_yaml::from_value(object["status"].clone()).expect("its status");
    assert_eq!(status, one);

    let unknown = run(&["get", "ingresses", "--node", "n9"], None);
    assert_eq!(unknown.code, 1, "{unknown:?}");
    assert!(unknown.stderr.contains("no node named n9"), "{unknown:?}");

    let deleted = run(&["delete", "ingress", "shop", "--node", "n1"], None);
    assert_eq!(
        (deleted.code, deleted.stdout.as_str()),
        (0, "ingress/shop deleted\n"),
        "{deleted:?}"
    );
    let paths: Vec<(String, String)> = agent.seen().into_iter().map(|s| (s.0, s.1)).collect();
    assert_eq!(
        paths,
        [
            ("PUT", "/ingresses/shop"),
            ("GET", "/ingresses"),
            ("GET", "/ingresses"),
            ("GET", "/ingresses"),
            ("GET", "/ingresses/shop"),
            ("GET", "/ingresses/shop"),
            ("GET", "/ingresses/shop/document"),
            ("DELETE", "/ingresses/shop"),
        ]
        .map(|(m, p)| (m.to_string(), p.to_string()))
    );
}
