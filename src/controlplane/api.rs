//! The control plane's route table, and forwarding to agents.
//!
//! | route | role | what |
//! |---|---|---|
//! | `POST /nodes/register` | node | join; answers the pod_cidr |
//! | `POST /nodes/{id}/heartbeat` | node | lease renewal; answers peers and stale jails |
//! | `GET /nodes` | operator | nodes with liveness computed on read |
//! | `GET /nodes/{id}/jails` | operator | forwarded to that node's `GET /jails` |
//! | `PUT/GET/DELETE /nodes/{id}/jails/{name}` | operator | forwarded to that node |
//! | `PUT/GET/DELETE /jails/{name}` | operator | scheduled: sticky placement, recorded after success |
//! | `GET /metrics` | operator | Prometheus text |
//! | `GET /healthz` | none | liveness of the control plane itself, nothing else |
//!
//! Every route but `/healthz` needs a signed request (`common::auth`): a node
//! key for membership, an operator key for the rest, so a leaked node key
//! cannot apply jails and an operator key cannot impersonate a node.
//!
//! Handlers never parse a spec body: they ask the worker where a request goes
//! (a read, no network), relay it byte for byte to that agent signed with the
//! control plane's node key, relay the agent's answer back untouched, and tell
//! the worker how it went so it can record or forget the placement.

use std::net::SocketAddr;
use std::sync::RwLock;
use std::time::Duration;

use serde::Serialize;

use crate::common::auth::{self, Keyring, Role, Signer, Verifier};
use crate::common::http::{Client, Endpoint, Handler, Request, Response};
use crate::common::names::validate_name;
use crate::common::wire::{EPOCH_HEADER, HeartbeatRequest, Liveness, RegisterRequest};
use crate::controlplane::registry::{HeartbeatAnswer, Refusal, Target};
use crate::controlplane::worker::{WorkerGone, WorkerHandle};

/// How long a forwarded request may take: an apply runs zfs clone and jail
/// creation on the node, which can take tens of seconds on a busy host.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(120);

/// The control plane API.
pub struct ControlPlaneApi {
    worker: WorkerHandle,
    verifier: Verifier,
    // Replaced on SIGHUP during a key rotation; handlers only read it.
    signer: RwLock<Signer>,
}

impl ControlPlaneApi {
    /// Routes to `worker`, verifying with `verifier` and signing forwarded
    /// requests with `signer` (a node key).
    pub fn new(worker: WorkerHandle, verifier: Verifier, signer: Signer) -> ControlPlaneApi {
        ControlPlaneApi {
            worker,
            verifier,
            signer: RwLock::new(signer),
        }
    }

    /// Swaps in newly loaded keys (SIGHUP): requests in flight finish with the
    /// old ones, the next ones use the new; the replay cache is kept.
    pub fn reload_keys(&self, keyring: Keyring, signer: Signer) {
        self.verifier.replace_keyring(keyring);
        *self.signer.write().unwrap_or_else(|p| p.into_inner()) = signer;
    }

    fn route(&self, req: &Request) -> Result<Response, WorkerGone> {
        let segments = req.segments();
        let method = req.method.as_str();
        if let ("GET", ["healthz"]) = (method, segments.as_slice()) {
            return Ok(Response::json(200, &Health { status: "ok" }));
        }
        let role = match segments.as_slice() {
            ["nodes", "register"] | ["nodes", _, "heartbeat"] => Role::Node,
            _ => Role::Operator,
        };
        if let Err(e) = auth::verify_request(&self.verifier, req, role, auth::unix_now()) {
            return Ok(auth::refusal(&e));
        }
        for name in names_in(&segments) {
            if let Err(why) = validate_name(name) {
                return Ok(Response::error(400, &format!("{name:?}: {why}"), None));
            }
        }
        Ok(match (method, segments.as_slice()) {
            ("POST", ["nodes", "register"]) => match parse_json::<RegisterRequest>(req) {
                Err(r) => r,
                Ok(body) => reply(self.worker.register(body)?),
            },
            ("POST", ["nodes", id, "heartbeat"]) => match parse_json::<HeartbeatRequest>(req) {
                Err(r) => r,
                Ok(body) => match self.worker.heartbeat(id, body)? {
                    Err(r) => refused(&r),
                    Ok(answer) => heartbeat_response(&answer, id),
                },
            },
            ("GET", ["nodes"]) => Response::json(200, &self.worker.nodes()?),
            ("GET", ["metrics"]) => self.metrics()?,
            ("GET", ["nodes", id, "jails"]) => match self.worker.resolve_node(id)? {
                Err(r) => refused(&r),
                Ok(addr) => self.forward(id, addr, req, "/jails", None),
            },
            ("PUT", ["nodes", id, "jails", name]) => self.apply(name, Some(id), req)?,
            ("GET", ["nodes", id, "jails", name]) => match self.worker.resolve_node(id)? {
                Err(r) => refused(&r),
                Ok(addr) => self.forward(id, addr, req, &format!("/jails/{name}"), None),
            },
            ("DELETE", ["nodes", id, "jails", name]) => match self.worker.resolve_node(id)? {
                Err(r) => refused(&r),
                Ok(addr) => self.delete(name, id, addr, req)?,
            },
            ("PUT", ["jails", name]) => self.apply(name, None, req)?,
            ("GET", ["jails", name]) => match self.worker.resolve_placed(name)? {
                Err(r) => refused(&r),
                Ok(t) => self.forward(&t.node, t.addr, req, &format!("/jails/{name}"), None),
            },
            ("DELETE", ["jails", name]) => match self.worker.resolve_placed(name)? {
                Err(r) => refused(&r),
                Ok(t) => self.delete(name, &t.node, t.addr, req)?,
            },
            (_, ["nodes", "register"]) | (_, ["nodes", _, "heartbeat"]) => {
                method_not_allowed("POST")
            }
            (_, ["nodes"]) | (_, ["metrics"]) | (_, ["nodes", _, "jails"]) => {
                method_not_allowed("GET")
            }
            (_, ["jails", _]) | (_, ["nodes", _, "jails", _]) => {
                method_not_allowed("GET, PUT, DELETE")
            }
            _ => Response::error(404, &format!("no route for {method} {}", req.path), None),
        })
    }

    /// A scheduled (`node` = None) or named apply; see the module docs.
    fn apply(&self, name: &str, node: Option<&str>, req: &Request) -> Result<Response, WorkerGone> {
        let target: Target = match self.worker.begin_apply(name, node)? {
            Err(r) => return Ok(refused(&r)),
            Ok(t) => t,
        };
        let response = self.forward(
            &target.node,
            target.addr,
            req,
            &format!("/jails/{name}"),
            Some(target.epoch),
        );
        let succeeded = (200..300).contains(&response.status);
        let node_id = target.node.clone();
        match self.worker.finish_apply(name, target, succeeded)? {
            Ok(()) => Ok(response.with_header("X-Keel-Node", &node_id)),
            Err(r) => Ok(Response::error(
                500,
                &format!(
                    "jail {name} was applied on node {node_id} but its placement could not be recorded ({r}); apply it again"
                ),
                None,
            )),
        }
    }

    fn delete(
        &self,
        name: &str,
        node: &str,
        addr: SocketAddr,
        req: &Request,
    ) -> Result<Response, WorkerGone> {
        let response = self.forward(node, addr, req, &format!("/jails/{name}"), None);
        // 404 from the node: the jail is gone there, so is the placement.
        if (200..300).contains(&response.status) || response.status == 404 {
            if let Err(r) = self.worker.remove_placement(name, node)? {
                return Ok(refused(&r));
            }
        }
        Ok(response)
    }

    /// Relays `req` to the agent at `addr` as `node_path`, signed with the
    /// control plane's node key; the answer comes back untouched.
    fn forward(
        &self,
        node: &str,
        addr: SocketAddr,
        req: &Request,
        node_path: &str,
        epoch: Option<u64>,
    ) -> Response {
        let target = match &req.query {
            Some(q) => format!("{node_path}?{q}"),
            None => node_path.to_string(),
        };
        let signed = {
            let signer = self.signer.read().unwrap_or_else(|p| p.into_inner());
            auth::sign_headers(&signer, &req.method, &target, &req.body, auth::unix_now())
        };
        let mut headers = match signed {
            Ok(h) => h,
            Err(e) => {
                return Response::error(
                    500,
                    &format!("cannot sign the forwarded request: {e}"),
                    None,
                );
            }
        };
        if let Some(epoch) = epoch {
            headers.push((EPOCH_HEADER.to_string(), epoch.to_string()));
        }
        let client = Client::new(Endpoint::Tcp(addr.to_string())).with_timeout(FORWARD_TIMEOUT);
        match client.forward(req, node_path, &headers) {
            Ok(response) => response,
            Err(e) => Response::error(
                503,
                &format!("node {node} at {addr} did not answer: {e}"),
                None,
            ),
        }
    }

    fn metrics(&self) -> Result<Response, WorkerGone> {
        let nodes = self.worker.nodes()?;
        let alive = nodes.iter().filter(|n| n.status == Liveness::Alive).count();
        let text = format!(
            "# HELP keel_nodes Registered nodes by liveness.\n\
             # TYPE keel_nodes gauge\n\
             keel_nodes{{status=\"alive\"}} {alive}\n\
             keel_nodes{{status=\"dead\"}} {}\n",
            nodes.len() - alive
        );
        Ok(Response::text(200, text)
            .with_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8"))
    }
}

impl Handler for ControlPlaneApi {
    fn handle(&self, req: Request) -> Response {
        self.route(&req)
            .unwrap_or_else(|e| Response::error(503, &e.to_string(), None))
    }
}

/// Path segments that are names (node ids, jail names), checked as DNS
/// labels before anything looks them up.
fn names_in<'a>(segments: &[&'a str]) -> Vec<&'a str> {
    match segments {
        ["nodes", "register"] => vec![],
        ["nodes", id, rest @ ..] => {
            let mut v = vec![*id];
            if let ["jails", name] = rest {
                v.push(name);
            }
            v
        }
        ["jails", name] => vec![*name],
        _ => vec![],
    }
}

#[derive(Serialize)]
struct Health {
    status: &'static str,
}

fn parse_json<T: serde::de::DeserializeOwned>(req: &Request) -> Result<T, Response> {
    serde_json::from_slice(&req.body)
        .map_err(|e| Response::error(400, &format!("invalid JSON body: {e}"), None))
}

fn reply<T: Serialize>(result: Result<T, Refusal>) -> Response {
    match result {
        Ok(body) => Response::json(200, &body),
        Err(r) => refused(&r),
    }
}

/// The peer list is spliced in here, on the handler thread, not on the worker.
fn heartbeat_response(answer: &HeartbeatAnswer, node_id: &str) -> Response {
    match answer.body(node_id) {
        Ok(body) => Response::raw(
            200,
            vec![("Content-Type".into(), "application/json".into())],
            body,
        ),
        Err(e) => Response::error(
            500,
            &format!("cannot encode the heartbeat answer: {e}"),
            None,
        ),
    }
}

fn refused(r: &Refusal) -> Response {
    Response::error(r.status, &r.message, r.field.as_deref())
}

fn method_not_allowed(allow: &str) -> Response {
    Response::error(405, &format!("method not allowed; use {allow}"), None)
        .with_header("Allow", allow)
}
