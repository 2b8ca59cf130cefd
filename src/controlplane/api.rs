//! The control plane's route table, and forwarding to agents.
//!
//! | route | role | what |
//! |---|---|---|
//! | `POST /nodes/register` | node | join; answers the pod_cidr |
//! | `POST /nodes/{id}/heartbeat` | node | lease renewal; answers peers, stale jails and the endpoint table with its generation |
//! | `GET /nodes/{id}/endpoints?after=G[&origin=O]` | node | long poll: the endpoint table once its generation is above `G` (at once without `after`, or when `G` is above the current one, numbered by a previous process), else the current one after [`ENDPOINTS_WAIT`]; with the `origin` of the table held, only the services changed since `G` when the board still has them ([`EndpointBoard`]) |
//! | `GET /nodes` | operator | nodes with liveness computed on read |
//! | `POST /nodes/{id}/cordon`, `POST /nodes/{id}/uncordon` | operator | nothing new is placed on a cordoned node; what runs there stays |
//! | `DELETE /nodes/{id}` | operator | forgets a Dead node, its placements and its volumes ([`Cluster::remove_node`](crate::controlplane::registry::Cluster::remove_node)) |
//! | `GET /nodes/{id}/jails` | operator | forwarded to that node's `GET /jails` |
//! | `PUT/GET/DELETE /nodes/{id}/jails/{name}` | operator | forwarded to that node |
//! | `PUT/GET/DELETE /jails/{name}` | operator | scheduled: sticky placement, recorded after success |
//! | `POST /jails/{name}/dry-run`, `POST /jails/{name}/diff`, `POST /nodes/{id}/jails/{name}/dry-run`, `POST /nodes/{id}/jails/{name}/diff` | operator | forwarded to the node the apply would go to (placement, volume, scheduler's pick), recording nothing; the answer's `X-Keel-Node` names it |
//! | `POST /services/{name}/diff` | operator | the object diff against the service held, refused as its apply would be; no host commands (a replica's are its node's) |
//! | `GET /jails/{name}/log`, `GET /nodes/{id}/jails/{name}/log` | operator | forwarded to the node the jail is placed on (or named) |
//! | `GET /jails/{name}/document`, `GET /nodes/{id}/jails/{name}/document`, `GET /nodes/{id}/ingresses/{name}/document` | operator | the document the object was applied with, forwarded likewise |
//! | `GET /nodes/{id}/volumes`, `GET/DELETE /nodes/{id}/volumes/{name}` | operator | forwarded to that node |
//! | `GET /volumes` | operator | every registered node's volumes, each tagged with its node |
//! | `GET /nodes/{id}/ingresses`, `PUT/GET/DELETE /nodes/{id}/ingresses/{name}` | operator | forwarded to that node |
//! | `GET /nodes/{id}/bases`, `PUT/GET /nodes/{id}/bases/{release}` | operator | forwarded to that node (a `PUT` starts a base fetch there) |
//! | `GET/DELETE /volumes/{name}` | operator | forwarded to the node the volume registry names |
//! | `PUT/GET/DELETE /services/{name}`, `GET /services` | operator | replica sets behind VIPs; a new template rolls out |
//! | `POST /services/{name}/scale`, `POST /services/{name}/undo`, `GET /services/{name}/revisions`, `GET /services/{name}/document` | operator | the desired count; back to an earlier template; the templates kept; the current document |
//! | `GET /events?after=SEQ&for=KIND/NAME&wait=1&nodes=N:SEQ,...` | operator | the control plane's events (numbered by it: `after` applies to them) merged with every node's that is not Dead (those above its `nodes` cursor; a node with none newer is not asked), sorted by time, with the nodes it could not ask; the wait ends on a new event of the control plane or of a node |
//! | `GET /metrics` | operator | Prometheus text |
//! | `GET /version` | operator | the control plane's program and version |
//! | `GET /healthz` | none | liveness of the control plane itself: its worker answers within [`HEALTH_WAIT`], else 503 |
//!
//! Every route but `/healthz` needs a signed request (`common::auth`): a node
//! key for membership, an operator key for the rest, so a leaked node key
//! cannot apply jails and an operator key cannot impersonate a node.
//!
//! The endpoint long poll holds its handler thread and its connection for
//! up to [`ENDPOINTS_WAIT`], one per node, and never asks the worker: it
//! reads the [`EndpointBoard`] the worker publishes to. The server's
//! admission (`common::http::admission`) counts such a connection as
//! *claimed* from the moment its signed head arrived until the answer is
//! written, so it is never evicted and never takes a share of the
//! unauthenticated budget; but every claimed connection holds one of the
//! listener's `max_connections` slots. So that waiting polls can never take
//! the slots heartbeats need, at most [`MAX_WAITING_POLLS`] wait at once;
//! past that a poll is answered 503 at once and its agent retries with
//! backoff, its proxy kept current by heartbeats alone meanwhile.
//!
//! Volume registry (beyond the seed): a jail's volumes must stay with their
//! data, so the control plane remembers `volume -> node` and sends every
//! later apply of a jail declaring the volume there. It learns the volumes
//! without parsing the spec: keelctl, which validated it, names them in the
//! signed request target (`PUT /jails/{name}?volumes=a,b`, see
//! `common::wire::VOLUMES_PARAM`), and the agent, which parses the spec,
//! refuses a list that differs from what the spec declares, so the registry
//! holds exactly what agents create. Replica volumes come from the
//! `ServiceApply` (`{replica}-{volume}`). A header would have served as
//! well but is not covered by the signature; reporting volumes on heartbeats
//! would learn them only after the fact, too late to stop an apply on the
//! wrong node. `DELETE /volumes/{name}` forgets the entry once the node has
//! destroyed the dataset.
//!
//! Ingresses have no scheduled route: an Ingress publishes a Service's
//! replicas on one node's public address, so the operator names the node
//! and the control plane only relays (it records nothing about them).
//!
//! Handlers never parse a spec body: they ask the worker where a request goes
//! (a read, no network), relay it byte for byte to that agent signed with the
//! control plane's node key, relay the agent's answer back untouched, and tell
//! the worker how it went so it can record or forget the placement.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Serialize;

use crate::common::auth::{self, Keyring, Role, Signer, Verifier};
use crate::common::events::EventQuery;
use crate::common::http::server::DEFAULT_MAX_CONNECTIONS;
use crate::common::http::{Client, Endpoint, Handler, OutgoingRequest, Request, Response};
use crate::common::names::validate_name;
use crate::common::supervise::{self, HEALTH_WAIT};
use crate::common::wire::{
    AppliedDocument, COMMITTED_HEADER, ENDPOINTS_WAIT, EPOCH_HEADER, EventsAnswer,
    HeartbeatRequest, Liveness, RegisterRequest, ServiceApply, UnreachedNode, VersionInfo,
    VolumeStatus, parse_committed, parse_volumes_query,
};
use crate::controlplane::endpoint_board::EndpointBoard;
use crate::controlplane::heal::heal;
use crate::controlplane::metrics::ControlPlaneMetrics;
use crate::controlplane::registry::{HealAction, HeartbeatAnswer, Refusal, Target};
use crate::controlplane::worker::{WorkerGone, WorkerHandle};

/// How long a forwarded request may take: an apply runs zfs clone and jail
/// creation on the node, which can take tens of seconds on a busy host.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(120);

/// How often a service delete asks whether its replicas drained.
const DRAIN_POLL: Duration = Duration::from_millis(100);

/// Most agents `GET /events` asks at once.
const EVENT_FAN_OUT: usize = 16;

/// The `source` of the control plane's own events in `GET /events`.
pub const CONTROLPLANE_SOURCE: &str = "controlplane";

/// Most endpoint long polls waiting at once: a quarter of the listener's
/// connections, so heartbeats always find a slot (see the module docs).
pub const MAX_WAITING_POLLS: usize = DEFAULT_MAX_CONNECTIONS / 4;

/// The control plane API.
pub struct ControlPlaneApi {
    worker: WorkerHandle,
    /// Shared with the daemon's next term: its replay cache outlives this.
    verifier: Arc<Verifier>,
    forwarder: Forwarder,
    /// Endpoint long polls waiting now (also read by the metrics).
    waiting_polls: Arc<AtomicUsize>,
    metrics: ControlPlaneMetrics,
}

/// Sends requests to agents, signed with the control plane's node key.
/// Cloneable so heals can run on their own thread.
#[derive(Clone)]
pub struct Forwarder {
    // Replaced on SIGHUP during a key rotation; senders only read it.
    signer: Arc<RwLock<Signer>>,
}

impl ControlPlaneApi {
    /// Routes to `worker`, verifying with `verifier` and signing forwarded
    /// requests with `signer` (a node key).
    pub fn new(worker: WorkerHandle, verifier: Arc<Verifier>, signer: Signer) -> ControlPlaneApi {
        let waiting_polls = Arc::new(AtomicUsize::new(0));
        ControlPlaneApi {
            metrics: ControlPlaneMetrics::new(worker.clone(), Arc::clone(&waiting_polls)),
            worker,
            verifier,
            forwarder: Forwarder {
                signer: Arc::new(RwLock::new(signer)),
            },
            waiting_polls,
        }
    }

    /// What both `/metrics` routes render (the signed one here, and the
    /// plain `controlplane.metrics_listen`), with the request counts
    /// [`crate::controlplane::metrics::Metered`] keeps around this API.
    pub fn metrics_source(&self) -> ControlPlaneMetrics {
        self.metrics.clone()
    }

    /// Swaps in newly loaded keys (SIGHUP): requests in flight finish with the
    /// old ones, the next ones use the new; the replay cache is kept.
    pub fn reload_keys(&self, keyring: Keyring, signer: Signer) {
        self.verifier.replace_keyring(keyring);
        *self
            .forwarder
            .signer
            .write()
            .unwrap_or_else(|p| p.into_inner()) = signer;
    }

    fn route(&self, req: &Request) -> Result<Response, WorkerGone> {
        let segments = req.segments();
        let method = req.method.as_str();
        if let ("GET", ["healthz"]) = (method, segments.as_slice()) {
            let health = self.worker.health(HEALTH_WAIT);
            return Ok(supervise::healthz_response(health, "keel-controlplane"));
        }
        let role = match segments.as_slice() {
            ["nodes", "register"] | ["nodes", _, "heartbeat" | "endpoints"] => Role::Node,
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
        // Verified: the server may keep this connection as a signed client's.
        let response = match (method, segments.as_slice()) {
            ("POST", ["nodes", "register"]) => match parse_json::<RegisterRequest>(req) {
                Err(r) => r,
                Ok(body) => reply(self.worker.register(body)?),
            },
            ("POST", ["nodes", id, "heartbeat"]) => match parse_json::<HeartbeatRequest>(req) {
                Err(r) => r,
                Ok(body) => match self.worker.heartbeat(id, body)? {
                    Err(r) => refused(&r),
                    Ok((answer, heal)) => {
                        heal_in_background(&self.worker, &self.forwarder, heal);
                        heartbeat_response(&answer, id)
                    }
                },
            },
            ("GET", ["nodes", id, "endpoints"]) => self.endpoints(id, req),
            ("GET", ["services"]) => Response::json(200, &self.worker.services()?),
            ("GET", ["services", name]) => match self.worker.service(name)? {
                Some(status) => Response::json(200, &status),
                None => Response::error(404, &format!("no service named {name}"), None),
            },
            ("PUT", ["services", name]) => match parse_json::<ServiceApply>(req) {
                Err(r) => r,
                Ok(body) => {
                    let planned = self.worker.put_service(name, body)?;
                    self.carry_out(name, planned)?
                }
            },
            ("POST", ["services", name, "scale"]) => match parse_json::<ScaleRequest>(req) {
                Err(r) => r,
                Ok(body) => {
                    let planned = self.worker.scale_service(name, body.replicas)?;
                    self.carry_out(name, planned)?
                }
            },
            ("POST", ["services", name, "undo"]) => match parse_json::<UndoRequest>(req) {
                Err(r) => r,
                Ok(body) => {
                    let planned = self.worker.undo_service(name, body.revision)?;
                    self.carry_out(name, planned.map(|(_, heal)| heal))?
                }
            },
            ("GET", ["services", name, "revisions"]) => {
                match self.worker.service_revisions(name)? {
                    Some(list) => Response::json(200, &list),
                    None => Response::error(404, &format!("no service named {name}"), None),
                }
            }
            ("GET", ["services", name, "document"]) => match self.worker.service_document(name)? {
                Some((document, _digest)) => Response::json(200, &AppliedDocument { document }),
                None => Response::error(404, &format!("no service named {name}"), None),
            },
            ("DELETE", ["services", name]) => match self.drain_service(name)? {
                Err(r) => refused(&r),
                Ok(()) => self.delete_service(name)?,
            },
            ("GET", ["version"]) => Response::json(200, &VersionInfo::of("keel-controlplane")),
            ("GET", ["nodes"]) => Response::json(200, &self.worker.nodes()?),
            ("POST", ["nodes", id, verb @ ("cordon" | "uncordon")]) => {
                let cordoned = *verb == "cordon";
                match self.worker.set_cordoned(id, cordoned)? {
                    Err(r) => refused(&r),
                    Ok(()) => Response::json(
                        200,
                        &serde_json::json!({ "node": id, "cordoned": cordoned }),
                    ),
                }
            }
            ("DELETE", ["nodes", id]) => match self.worker.remove_node(id)? {
                Err(r) => refused(&r),
                Ok(removal) => Response::json(200, &removal),
            },
            ("GET", ["metrics"]) => self.metrics()?,
            ("GET", ["events"]) => self.events(req)?,
            ("GET", ["nodes", id, "jails"]) => match self.worker.resolve_node(id)? {
                Err(r) => refused(&r),
                Ok(addr) => self.forwarder.forward(id, addr, req, "/jails", None),
            },
            ("PUT", ["nodes", id, "jails", name]) => self.apply(name, Some(id), req)?,
            ("GET", ["nodes", id, "jails", name]) => match self.worker.resolve_node(id)? {
                Err(r) => refused(&r),
                Ok(addr) => self
                    .forwarder
                    .forward(id, addr, req, &format!("/jails/{name}"), None),
            },
            ("DELETE", ["nodes", id, "jails", name]) => match self.worker.resolve_node(id)? {
                Err(r) => refused(&r),
                Ok(addr) => self.delete(name, id, addr, req)?,
            },
            ("GET", ["nodes", id, "jails", name, part @ ("log" | "document")]) => {
                match self.worker.resolve_node(id)? {
                    Err(r) => refused(&r),
                    Ok(addr) => self.forwarder.forward(
                        id,
                        addr,
                        req,
                        &format!("/jails/{name}/{part}"),
                        None,
                    ),
                }
            }
            ("GET", ["jails", name, part @ ("log" | "document")]) => {
                match self.worker.resolve_placed(name)? {
                    Err(r) => refused(&r),
                    Ok(t) => self
                        .forwarder
                        .forward(&t.node, t.addr, req, &format!("/jails/{name}/{part}"), None)
                        .with_header("X-Keel-Node", &t.node),
                }
            }
            ("PUT", ["jails", name]) => self.apply(name, None, req)?,
            ("POST", ["jails", name, verb @ ("dry-run" | "diff")]) => {
                self.dry_run(name, None, verb, req)?
            }
            ("POST", ["nodes", id, "jails", name, verb @ ("dry-run" | "diff")]) => {
                self.dry_run(name, Some(id), verb, req)?
            }
            ("POST", ["services", name, "diff"]) => match parse_json::<ServiceApply>(req) {
                Err(r) => r,
                Ok(apply) => self.diff_service(name, apply)?,
            },
            ("GET", ["jails", name]) => match self.worker.resolve_placed(name)? {
                Err(r) => refused(&r),
                Ok(t) => self
                    .forwarder
                    .forward(&t.node, t.addr, req, &format!("/jails/{name}"), None)
                    .with_header("X-Keel-Node", &t.node),
            },
            ("DELETE", ["jails", name]) => match self.worker.resolve_placed(name)? {
                Err(r) => refused(&r),
                Ok(t) => self.delete(name, &t.node, t.addr, req)?,
            },
            ("GET", ["volumes"]) => self.list_volumes()?,
            ("GET", ["volumes", name]) => match self.worker.resolve_volume(name)? {
                Err(r) => refused(&r),
                Ok(t) => self
                    .forwarder
                    .forward(&t.node, t.addr, req, &format!("/volumes/{name}"), None)
                    .with_header("X-Keel-Node", &t.node),
            },
            ("DELETE", ["volumes", name]) => match self.worker.resolve_volume(name)? {
                Err(r) => refused(&r),
                Ok(t) => self.delete_volume(name, &t.node, t.addr, req)?,
            },
            ("GET", ["nodes", id, "volumes"]) => match self.worker.resolve_node(id)? {
                Err(r) => refused(&r),
                Ok(addr) => self.forwarder.forward(id, addr, req, "/volumes", None),
            },
            ("GET", ["nodes", id, "volumes", name]) => match self.worker.resolve_node(id)? {
                Err(r) => refused(&r),
                Ok(addr) => {
                    self.forwarder
                        .forward(id, addr, req, &format!("/volumes/{name}"), None)
                }
            },
            ("DELETE", ["nodes", id, "volumes", name]) => match self.worker.resolve_node(id)? {
                Err(r) => refused(&r),
                Ok(addr) => self.delete_volume(name, id, addr, req)?,
            },
            ("GET", ["nodes", id, "ingresses"]) => match self.worker.resolve_node(id)? {
                Err(r) => refused(&r),
                Ok(addr) => self.forwarder.forward(id, addr, req, "/ingresses", None),
            },
            ("PUT" | "GET" | "DELETE", ["nodes", id, "ingresses", name]) => {
                match self.worker.resolve_node(id)? {
                    Err(r) => refused(&r),
                    Ok(addr) => {
                        self.forwarder
                            .forward(id, addr, req, &format!("/ingresses/{name}"), None)
                    }
                }
            }
            ("GET", ["nodes", id, "ingresses", name, "document"]) => {
                match self.worker.resolve_node(id)? {
                    Err(r) => refused(&r),
                    Ok(addr) => self.forwarder.forward(
                        id,
                        addr,
                        req,
                        &format!("/ingresses/{name}/document"),
                        None,
                    ),
                }
            }
            ("GET", ["nodes", id, "bases"]) => match self.worker.resolve_node(id)? {
                Err(r) => refused(&r),
                Ok(addr) => self.forwarder.forward(id, addr, req, "/bases", None),
            },
            ("PUT" | "GET", ["nodes", id, "bases", release]) => {
                match self.worker.resolve_node(id)? {
                    Err(r) => refused(&r),
                    Ok(addr) => {
                        self.forwarder
                            .forward(id, addr, req, &format!("/bases/{release}"), None)
                    }
                }
            }
            (_, ["nodes", _, "bases", _]) => method_not_allowed("GET, PUT"),
            (_, ["volumes"])
            | (_, ["nodes", _, "volumes"])
            | (_, ["nodes", _, "ingresses"])
            | (_, ["nodes", _, "bases"]) => method_not_allowed("GET"),
            (_, ["volumes", _]) | (_, ["nodes", _, "volumes", _]) => {
                method_not_allowed("GET, DELETE")
            }
            (_, ["nodes", "register"]) | (_, ["nodes", _, "heartbeat"]) => {
                method_not_allowed("POST")
            }
            (_, ["nodes", _, "endpoints"]) => method_not_allowed("GET"),
            (_, ["nodes", _]) => method_not_allowed("DELETE"),
            (_, ["nodes", _, "cordon" | "uncordon"]) => method_not_allowed("POST"),
            (_, ["nodes"])
            | (_, ["metrics"])
            | (_, ["version"])
            | (_, ["events"])
            | (_, ["nodes", _, "jails"]) => method_not_allowed("GET"),
            (_, ["jails", _])
            | (_, ["nodes", _, "jails", _])
            | (_, ["nodes", _, "ingresses", _])
            | (_, ["services", _]) => method_not_allowed("GET, PUT, DELETE"),
            (_, ["services"])
            | (_, ["services", _, "revisions" | "document"])
            | (_, ["jails", _, "log" | "document"])
            | (_, ["nodes", _, "jails", _, "log" | "document"])
            | (_, ["nodes", _, "ingresses", _, "document"]) => method_not_allowed("GET"),
            (_, ["services", _, "scale" | "undo"]) => method_not_allowed("POST"),
            _ => Response::error(404, &format!("no route for {method} {}", req.path), None),
        };
        Ok(response.authenticated())
    }

    /// Where a jail request goes: with `begin`, an apply marked in flight
    /// ([`WorkerHandle::begin_apply`]), else only planned
    /// ([`WorkerHandle::plan_apply`], a dry run); the refusal as an answer.
    fn jail_target(
        &self,
        name: &str,
        node: Option<&str>,
        req: &Request,
        begin: bool,
    ) -> Result<Result<Target, Response>, WorkerGone> {
        let volumes = match declared_volumes(req) {
            Ok(v) => v,
            Err(response) => return Ok(Err(response)),
        };
        let target = if begin {
            self.worker.begin_apply(name, node, volumes)?
        } else {
            self.worker.plan_apply(name, node, volumes)?
        };
        Ok(target.map_err(|r| refused(&r)))
    }

    /// A scheduled (`node` = None) or named apply; see the module docs.
    fn apply(&self, name: &str, node: Option<&str>, req: &Request) -> Result<Response, WorkerGone> {
        let target = match self.jail_target(name, node, req, true)? {
            Ok(t) => t,
            Err(response) => return Ok(response),
        };
        let response = self.forwarder.forward(
            &target.node,
            target.addr,
            req,
            &format!("/jails/{name}"),
            Some(target.epoch),
        );
        let succeeded = (200..300).contains(&response.status);
        let reached = !(400..500).contains(&response.status);
        let node_id = target.node.clone();
        if let Some(committed) = response.header(COMMITTED_HEADER).and_then(parse_committed) {
            self.worker.note_committed(&node_id, committed)?;
        }
        match self.worker.finish_apply(name, target, succeeded, reached)? {
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

    /// `POST /jails/{name}/dry-run|diff` (and through `/nodes/{id}`): asks
    /// the node the apply would go to (the placement, the volume's node,
    /// or the scheduler's pick, with the epoch the apply would carry)
    /// what the apply would do, recording nothing; the answer names it.
    fn dry_run(
        &self,
        name: &str,
        node: Option<&str>,
        verb: &str,
        req: &Request,
    ) -> Result<Response, WorkerGone> {
        let target = match self.jail_target(name, node, req, false)? {
            Ok(t) => t,
            Err(response) => return Ok(response),
        };
        let response = self.forwarder.forward(
            &target.node,
            target.addr,
            req,
            &format!("/jails/{name}/{verb}"),
            Some(target.epoch),
        );
        Ok(response.with_header("X-Keel-Node", &target.node))
    }

    /// `POST /services/{name}/diff`: the object diff against the service
    /// held, refused as its apply would be ([`crate::controlplane::diff`]).
    fn diff_service(&self, name: &str, apply: ServiceApply) -> Result<Response, WorkerGone> {
        let held = match self.worker.check_service(name, apply.clone())? {
            Err(r) => return Ok(refused(&r)),
            Ok(held) => held,
        };
        Ok(
            match crate::controlplane::diff::service_report(name, held.as_ref(), &apply) {
                Ok(report) => Response::json(200, &report),
                Err(why) => Response::error(400, &why, Some("document")),
            },
        )
    }

    /// `GET /nodes/{id}/endpoints?after=G[&origin=O]`: see the module
    /// docs. Reads the board only, never the worker.
    fn endpoints(&self, id: &str, req: &Request) -> Response {
        let poll = match parse_poll(req.query.as_deref()) {
            Ok(poll) => poll,
            Err((field, why)) => return Response::error(400, &why, Some(&field)),
        };
        let board: &EndpointBoard = self.worker.endpoint_board();
        if !board.knows(id) {
            // The heartbeat's refusal: the agent re-registers.
            return Response::error(
                404,
                &format!("node {id} is not registered; register first"),
                None,
            );
        }
        if let Some(after) = poll.after {
            // Wait only on the current generation of this process: above
            // it, or from another origin, `after` was numbered by a
            // previous control plane and the agent needs this one's table
            // now; below it, a newer table is there already.
            let current =
                poll.origin.is_none_or(|o| o == board.origin()) && board.generation() == after;
            if current {
                if self.waiting_polls.fetch_add(1, Ordering::SeqCst) >= MAX_WAITING_POLLS {
                    self.waiting_polls.fetch_sub(1, Ordering::SeqCst);
                    return Response::error(
                        503,
                        &format!(
                            "{MAX_WAITING_POLLS} endpoint polls are already waiting; retry later (heartbeats still carry the endpoint table)"
                        ),
                        None,
                    );
                }
                board.wait_newer(after, ENDPOINTS_WAIT);
                self.waiting_polls.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let answer = board.answer(poll.after.zip(poll.origin).map(|(g, o)| (o, g)));
        match answer.body() {
            Ok(body) => Response::raw(
                200,
                vec![("Content-Type".into(), "application/json".into())],
                body.to_vec(),
            ),
            Err(e) => Response::error(500, &format!("cannot encode the endpoint table: {e}"), None),
        }
    }

    /// `DELETE /services/{name}`, first half: takes every replica out of
    /// the rotation and waits until each drained (its connections over, or
    /// the service's drain timeout passed), so deleting a service never cuts
    /// a connection the proxies still relay.
    fn drain_service(&self, name: &str) -> Result<Result<(), Refusal>, WorkerGone> {
        if let Err(r) = self.worker.retire_service(name)? {
            return Ok(Err(r));
        }
        while !self.worker.service_drained(name)? {
            std::thread::sleep(DRAIN_POLL);
        }
        Ok(Ok(()))
    }

    /// `DELETE /services/{name}`, once drained: the record and VIP go, then
    /// the replicas.
    fn delete_service(&self, name: &str) -> Result<Response, WorkerGone> {
        Ok(match self.worker.remove_service(name)? {
            Err(r) => refused(&r),
            Ok(removals) => {
                let failures = heal(&self.worker, &self.forwarder, removals);
                if failures.is_empty() {
                    Response::json(200, &serde_json::json!({ "deleted": name }))
                } else {
                    Response::error(
                        500,
                        &format!(
                            "service {name} is deleted and its VIP released, but some replicas could not be removed yet (their nodes remove them when they come back): {}",
                            failures.join("; ")
                        ),
                        None,
                    )
                }
            }
        })
    }

    /// After a service change was recorded: carries out the first heal
    /// (placements, removals, the first replacements of a rollout) before
    /// answering, so `keelctl apply` returns with the replicas placed; the
    /// rest follows on heartbeats.
    fn carry_out(
        &self,
        name: &str,
        planned: Result<Vec<HealAction>, Refusal>,
    ) -> Result<Response, WorkerGone> {
        let actions = match planned {
            Err(r) => return Ok(refused(&r)),
            Ok(a) => a,
        };
        let failures = heal(&self.worker, &self.forwarder, actions);
        let status = self.worker.service(name)?;
        Ok(match (status, failures.is_empty()) {
            (Some(status), true) => Response::json(200, &status),
            (_, _) => Response::error(
                503,
                &format!(
                    "service {name} is recorded; some replicas are not placed yet and are retried on every heartbeat: {}",
                    failures.join("; ")
                ),
                None,
            ),
        })
    }

    fn delete(
        &self,
        name: &str,
        node: &str,
        addr: SocketAddr,
        req: &Request,
    ) -> Result<Response, WorkerGone> {
        if let Err(r) = self.worker.begin_delete(name, node)? {
            return Ok(refused(&r));
        }
        let response = self
            .forwarder
            .forward(node, addr, req, &format!("/jails/{name}"), None);
        // 404 from the node: the jail is gone there, so is the placement.
        if (200..300).contains(&response.status) || response.status == 404 {
            if let Err(r) = self.worker.remove_placement(name, node)? {
                return Ok(refused(&r));
            }
        }
        Ok(response)
    }

    /// `DELETE /volumes/{name}`: the node destroys the dataset (or answers
    /// 409 while a jail mounts it), then the registry forgets it. A 404 from
    /// the node means the dataset is gone there: the entry goes too.
    fn delete_volume(
        &self,
        name: &str,
        node: &str,
        addr: SocketAddr,
        req: &Request,
    ) -> Result<Response, WorkerGone> {
        let response = self
            .forwarder
            .forward(node, addr, req, &format!("/volumes/{name}"), None);
        if (200..300).contains(&response.status) || response.status == 404 {
            if let Err(r) = self.worker.remove_volume(name, node)? {
                return Ok(refused(&r));
            }
        }
        Ok(response.with_header("X-Keel-Node", node))
    }

    /// `GET /volumes`: asks every node the registry places a volume on for
    /// its `GET /volumes`, one after the other, and tags each answer with
    /// its node. A registered volume whose node is Dead, unreachable or no
    /// longer has it is listed with the reason instead of its numbers.
    fn list_volumes(&self) -> Result<Response, WorkerGone> {
        let mut out: Vec<VolumeStatus> = Vec::new();
        for home in self.worker.volume_homes()? {
            let answer = home.addr.and_then(|addr| {
                let r = self
                    .forwarder
                    .send(&home.node, addr, "GET", "/volumes", b"", None);
                if !(200..300).contains(&r.status) {
                    return Err(format!(
                        "node {} answered HTTP {}: {}",
                        home.node,
                        r.status,
                        String::from_utf8_lossy(&r.body)
                    ));
                }
                serde_json::from_slice::<Vec<VolumeStatus>>(&r.body)
                    .map_err(|e| format!("node {} answered an unreadable list: {e}", home.node))
            });
            match answer {
                Ok(list) => {
                    for v in &home.volumes {
                        if !list.iter().any(|l| &l.name == v) {
                            out.push(unknown_volume(
                                v,
                                &home.node,
                                format!(
                                    "registered on node {}, which has no such dataset",
                                    home.node
                                ),
                                false,
                            ));
                        }
                    }
                    out.extend(list.into_iter().map(|mut l| {
                        l.node = Some(home.node.clone());
                        l
                    }));
                }
                Err(why) => out.extend(
                    home.volumes
                        .iter()
                        .map(|v| unknown_volume(v, &home.node, why.clone(), true)),
                ),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name).then(a.node.cmp(&b.node)));
        Ok(Response::json(200, &out))
    }

    /// `GET /events`: this process's events, after the wait a watch asks
    /// for (on the ring the worker records in, never on the worker; a
    /// heartbeat reporting new events of its node pokes that ring, so the
    /// wait ends for them too), then the events of every node that is not
    /// Dead, asked concurrently ([`EVENT_FAN_OUT`] at a time). Agents
    /// number their events on their own: the `nodes=` cursor says, per node,
    /// the newest the reader has, and a node whose heartbeat reported no
    /// newer one is not asked at all, so a watch costs one request per node
    /// that has something new. The answer's `node_seqs` is the next cursor.
    /// A Dead node, or one whose agent did not answer, is named in
    /// `unreached`.
    fn events(&self, req: &Request) -> Result<Response, WorkerGone> {
        let query = match EventQuery::parse(req.query.as_deref()) {
            Ok(q) => q,
            Err((why, field)) => return Ok(Response::error(400, &why, Some(field))),
        };
        let mut answer = match self.worker.events().answer(&query) {
            Ok(answer) => answer,
            Err(busy) => return Ok(Response::error(503, &busy.to_string(), None)),
        };
        for event in &mut answer.events {
            event.source = Some(CONTROLPLANE_SOURCE.to_string());
        }
        let mut asks = Vec::new();
        for node in self.worker.nodes()? {
            let id = node.node_id;
            if node.status == Liveness::Dead {
                answer.unreached.push(UnreachedNode {
                    node: id,
                    error: "the node is Dead".into(),
                });
                continue;
            }
            let had = query.nodes.get(&id).copied();
            match (had, node.events_seq) {
                // Nothing newer reported: the reader has all of it.
                (Some(had), Some(seq)) if seq == had => {
                    answer.node_seqs.insert(id, had);
                }
                // A number below the reader's: the node's ring was lost,
                // so everything it holds now is new.
                (Some(had), Some(seq)) if seq < had => asks.push((id, node.address, None)),
                (had, _) => asks.push((id, node.address, had)),
            }
        }
        let object = query.object.clone();
        let ask = |(id, addr, after): &(String, SocketAddr, Option<u64>)| {
            let path = match (EventQuery {
                after: *after,
                object: object.clone(),
                ..EventQuery::default()
            })
            .to_query()
            {
                q if q.is_empty() => "/events".to_string(),
                q => format!("/events?{q}"),
            };
            let r = self.forwarder.send(id, *addr, "GET", &path, b"", None);
            if (200..300).contains(&r.status) {
                serde_json::from_slice::<EventsAnswer>(&r.body)
                    .map_err(|e| format!("its agent answered an unreadable list: {e}"))
            } else {
                Err(format!(
                    "its agent answered HTTP {}: {}",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                ))
            }
        };
        for chunk in asks.chunks(EVENT_FAN_OUT) {
            let results: Vec<_> = std::thread::scope(|scope| {
                let running: Vec<_> = chunk.iter().map(|a| scope.spawn(move || ask(a))).collect();
                running
                    .into_iter()
                    .map(|t| {
                        t.join()
                            .unwrap_or_else(|_| Err("asking it panicked".to_string()))
                    })
                    .collect()
            });
            for ((id, _, _), listed) in chunk.iter().zip(results) {
                match listed {
                    Ok(theirs) => {
                        answer.node_seqs.insert(id.clone(), theirs.last_seq);
                        answer.events.extend(theirs.events.into_iter().map(|mut e| {
                            e.source = Some(id.clone());
                            e
                        }));
                    }
                    Err(error) => answer.unreached.push(UnreachedNode {
                        node: id.clone(),
                        error,
                    }),
                }
            }
        }
        answer
            .events
            .sort_by(|a, b| (a.time_unix, &a.source, a.seq).cmp(&(b.time_unix, &b.source, b.seq)));
        Ok(Response::json(200, &answer))
    }

    fn metrics(&self) -> Result<Response, WorkerGone> {
        self.metrics.respond()
    }
}

impl Forwarder {
    /// Sends a request of the control plane's own (a heal) to an agent.
    pub(crate) fn send(
        &self,
        node: &str,
        addr: SocketAddr,
        method: &str,
        path: &str,
        body: &[u8],
        epoch: Option<u64>,
    ) -> Response {
        self.send_with_query(node, addr, method, path, None, body, epoch)
    }

    /// [`Forwarder::send`] with a query (signed with the path).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send_with_query(
        &self,
        node: &str,
        addr: SocketAddr,
        method: &str,
        path: &str,
        query: Option<String>,
        body: &[u8],
        epoch: Option<u64>,
    ) -> Response {
        let req = OutgoingRequest::new(method, query, body);
        self.send_outgoing(node, addr, &req, path, epoch)
    }

    /// Relays the received `req` to the agent at `addr` as `node_path`,
    /// signed with the control plane's node key; the answer comes back
    /// untouched.
    fn forward(
        &self,
        node: &str,
        addr: SocketAddr,
        req: &Request,
        node_path: &str,
        epoch: Option<u64>,
    ) -> Response {
        self.send_outgoing(node, addr, &OutgoingRequest::from(req), node_path, epoch)
    }

    /// Sends `req` to the agent at `addr` as `node_path`, signed with the
    /// control plane's node key; the answer comes back untouched.
    fn send_outgoing(
        &self,
        node: &str,
        addr: SocketAddr,
        req: &OutgoingRequest,
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
}

impl Handler for ControlPlaneApi {
    fn handle(&self, req: Request) -> Response {
        self.route(&req)
            .unwrap_or_else(|e| Response::error(503, &e.to_string(), None))
    }
}

/// A registered volume whose node could not say anything about it.
/// A volume the registry places on `node` but whose status `node` did not
/// give: `why`, and whether that is because it could not be asked.
fn unknown_volume(name: &str, node: &str, why: String, unreachable: bool) -> VolumeStatus {
    VolumeStatus {
        name: name.to_string(),
        dataset: None,
        node: Some(node.to_string()),
        quota: None,
        used: None,
        mounted_by: None,
        error: Some(why),
        unreachable,
    }
}

/// Path segments that are names (node ids, jail, volume and ingress names), checked
/// as DNS labels before anything looks them up.
fn names_in<'a>(segments: &[&'a str]) -> Vec<&'a str> {
    match segments {
        ["nodes", "register"] => vec![],
        ["nodes", id, rest @ ..] => {
            let mut v = vec![*id];
            if let ["jails", name]
            | ["jails", name, "log"]
            | ["volumes", name]
            | ["ingresses", name] = rest
            {
                v.push(name);
            }
            v
        }
        ["jails", name]
        | ["jails", name, "log"]
        | ["services", name]
        | ["services", name, _]
        | ["volumes", name] => {
            vec![*name]
        }
        _ => vec![],
    }
}

/// `POST /services/{name}/scale`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ScaleRequest {
    replicas: u32,
}

/// `POST /services/{name}/undo`: the revision to go back to, else the one
/// before the current.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct UndoRequest {
    #[serde(default)]
    revision: Option<u64>,
}

/// The parameters of `GET /nodes/{id}/endpoints`.
#[derive(Debug, Default, PartialEq)]
struct Poll {
    /// The generation the agent holds; `None`: answer the table at once.
    after: Option<u64>,
    /// The origin of the table it holds: it applies changes.
    origin: Option<u64>,
}

/// The parameters of `GET /nodes/{id}/endpoints`, or the parameter at
/// fault and why.
fn parse_poll(query: Option<&str>) -> Result<Poll, (String, String)> {
    let mut poll = Poll::default();
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let (field, slot, what) = match key {
            "after" => ("after", &mut poll.after, "an endpoint generation"),
            "origin" => ("origin", &mut poll.origin, "a control plane's origin"),
            _ => {
                return Err((
                    key.to_string(),
                    format!(
                        "unknown parameter {key:?}; the parameters are after (an endpoint generation) and origin (the origin of the table held)"
                    ),
                ));
            }
        };
        if slot.is_some() {
            return Err((field.into(), format!("{field} is given twice")));
        }
        let number = value.parse::<u64>().map_err(|_| {
            (
                field.to_string(),
                format!("{field} must be {what} (a whole number), not {value:?}"),
            )
        })?;
        *slot = Some(number);
    }
    if poll.origin.is_some() && poll.after.is_none() {
        return Err((
            "origin".into(),
            "origin names the table held at generation after; give after too".into(),
        ));
    }
    Ok(poll)
}

/// The volumes a jail request declares (`?volumes=`), or the 400.
fn declared_volumes(req: &Request) -> Result<Vec<String>, Response> {
    parse_volumes_query(req.query.as_deref())
        .map(Option::unwrap_or_default)
        .map_err(|why| Response::error(400, &why, Some("spec.volumes")))
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
/// Self-healing rides on heartbeats: the worker plans (no network) in the
/// heartbeat's own visit, a short-lived thread carries the plan out so the
/// heartbeat is answered at once. A service being healed is skipped by
/// later plans until its heal is done, so heals never pile up.
fn heal_in_background(worker: &WorkerHandle, forwarder: &Forwarder, actions: Vec<HealAction>) {
    if actions.is_empty() {
        return;
    }
    let (worker, forwarder) = (worker.clone(), forwarder.clone());
    let spawned = std::thread::Builder::new()
        .name("keel-heal".into())
        .spawn(move || {
            for failure in heal(&worker, &forwarder, actions) {
                log::warn!("self-healing: {failure}");
            }
        });
    if let Err(e) = spawned {
        log::error!("cannot start a heal thread: {e}");
    }
}

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
