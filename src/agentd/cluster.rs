//! The agent's side of cluster membership (DESIGN.md section 6): registering
//! with the control plane, heartbeating, routing peers' subnets and fencing
//! jails whose placement moved away.
//!
//! A thread of its own ([`spawn`]) talks to the control plane, so a slow or
//! unreachable control plane never delays an API request: it registers
//! (retrying with backoff, 1 s doubling to 30 s, while the agent serves
//! locally), then heartbeats every `agent.heartbeat_interval`. Everything that
//! changes the host goes to the worker as a command: adopting the node subnet
//! ([`crate::agentd::worker::Command::AdoptSubnet`]) and applying a heartbeat
//! answer ([`crate::agentd::worker::Command::ClusterUpdate`], which runs
//! [`apply_heartbeat`] on the worker thread). The thread also owns the node's
//! service proxy ([`crate::agentd::proxy`]): once the worker has aliased the
//! answer's VIPs on the bridge, the answer's service table goes to
//! [`Proxy::update`].
//!
//! Rules this module keeps:
//! - A heartbeat that fails changes nothing: the node keeps its jails, its
//!   subnet and its routes until the control plane answers again. A 404 (the
//!   control plane forgot the node) re-registers.
//! - Only routes to peers' subnets are touched: a destination is Keel's when a
//!   peer (Alive or Dead) names it as its pod_cidr, or when Keel added it
//!   earlier (`AgentState::cluster_routes`, so a route to a peer that left the
//!   cluster is still withdrawn). The node's own subnet is never routed away.
//!   [`plan_routes`] is the pure diff, [`sync_routes`] runs it with one route
//!   listing.
//! - Service VIPs are /32 aliases on the bridge, and only those Keel added
//!   (`AgentState::service_vips`) are ever removed ([`sync_vips`]). When the
//!   control plane is unreachable the proxy keeps its last table.
//! - Fencing deletes only jails the control plane placed: a stale name is
//!   deleted when the jail still carries the epoch the agent reported in that
//!   heartbeat. A jail applied over the Unix socket has no epoch and is never
//!   deleted here, whatever the control plane says.
//!
//! Every request to the control plane is signed with the node key
//! (`agent.key_file`), and the agent's TCP listener answers only requests
//! signed with a node key from `auth.node_keys` ([`SignedApi`]); the Unix
//! socket stays unauthenticated (its mode and group guard it). Both key sets
//! are read once at startup ([`load_keys`]): rotating a node key means
//! restarting the agents, which never stops a jail.
//!
//! It never imports `controlplane`: the bodies are `common::wire`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::agentd::api::AgentApi;
use crate::agentd::proxy::Proxy;
use crate::agentd::reconciler::{Phase, Reconciler};
use crate::agentd::worker::{WorkerGone, WorkerHandle};
use crate::common::auth::{
    self, AuthError, KeyFilePolicy, Keyring, Role, Signer, Verifier, sign_headers, unix_now,
};
use crate::common::backoff::{Backoff, Clock, Policy, SystemClock};
use crate::common::cidr::Ipv4Net;
use crate::common::config::Config;
use crate::common::http::{Client, Endpoint, Handler, HttpError, Request, Response};
use crate::common::spec;
use crate::common::wire::{
    HeartbeatRequest, HeartbeatResponse, JailStatus, Peer, PlacedJail, RegisterRequest,
    RegisterResponse, Resources,
};
use crate::host::capacity::{Capacity, CapacityError, FakeCapacity};
use crate::host::net::{NetError, Route};
use crate::host::{JailRuntime, MountManager, NetManager, ZfsManager};

/// Path of the registration request.
pub const REGISTER_PATH: &str = "/nodes/register";

/// Bound on connecting to the control plane and on each read and write: a
/// heartbeat is small, and a control plane slower than this counts as
/// unreachable for that tick.
pub const CONTROLPLANE_TIMEOUT: Duration = Duration::from_secs(10);

/// First wait between failed registrations; doubles up to [`REGISTER_RETRY_CAP`].
pub const REGISTER_RETRY_INITIAL: Duration = Duration::from_secs(1);
/// Longest wait between failed registrations.
pub const REGISTER_RETRY_CAP: Duration = Duration::from_secs(30);

/// Path of this node's heartbeat.
pub fn heartbeat_path(node_id: &str) -> String {
    format!("/nodes/{node_id}/heartbeat")
}

/// Why a cluster step failed.
#[derive(Debug)]
pub enum ClusterError {
    /// No usable node id: the hostname is not a DNS label.
    NodeId(String),
    /// The host's size could not be read at startup.
    Capacity(CapacityError),
    /// A signing key could not be loaded, or a request could not be signed.
    Keys(AuthError),
    /// The control plane could not be reached or did not answer in time.
    Unreachable(HttpError),
    /// The control plane answered with an unexpected status.
    Status {
        /// The request path.
        path: String,
        /// The status code.
        status: u16,
        /// The error it gave (its `error` field, or the body).
        message: String,
    },
    /// The control plane does not know this node (heartbeat 404): re-register.
    UnknownNode,
    /// The control plane's answer is not the JSON body expected.
    Body {
        /// The request path.
        path: String,
        /// What was wrong.
        reason: String,
    },
}

impl fmt::Display for ClusterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterError::NodeId(why) => write!(f, "{why}"),
            ClusterError::Capacity(e) => write!(
                f,
                "cannot detect this host's CPU count and memory for the scheduler: {e}"
            ),
            ClusterError::Unreachable(e) => write!(f, "control plane unreachable: {e}"),
            ClusterError::Status {
                path,
                status: 401,
                message,
            } => write!(
                f,
                "the control plane refused {path} as unauthenticated (401: {message}); check that agent.key_file holds a key listed in the control plane's auth.node_keys"
            ),
            ClusterError::Status {
                path,
                status,
                message,
            } => write!(
                f,
                "the control plane answered {path} with {status}: {message}"
            ),
            ClusterError::Keys(e) => write!(
                f,
                "{e}; a clustered agent signs with agent.key_file and accepts the keys in auth.node_keys (key files: docs/security.md)"
            ),
            ClusterError::UnknownNode => {
                f.write_str("the control plane does not know this node; registering again")
            }
            ClusterError::Body { path, reason } => {
                write!(
                    f,
                    "the control plane's answer to {path} is not understood: {reason}"
                )
            }
        }
    }
}

impl std::error::Error for ClusterError {}

/// The node id: `agent.node_id` when set, else derived from the hostname
/// (see [`node_id_from_hostname`]).
pub fn node_id(configured: Option<&str>) -> Result<String, ClusterError> {
    if let Some(id) = configured {
        return Ok(id.to_string());
    }
    let host = hostname().map_err(|e| {
        ClusterError::NodeId(format!(
            "cannot read the hostname ({e}); set agent.node_id (or --node-id)"
        ))
    })?;
    node_id_from_hostname(&host)
}

/// The node id a hostname gives: its first label, lowercased
/// (`Web-1.example.org` is `web-1`), which must be a DNS label.
pub fn node_id_from_hostname(host: &str) -> Result<String, ClusterError> {
    let label = host
        .split('.')
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase();
    spec::validate_name(&label).map_err(|why| {
        ClusterError::NodeId(format!(
            "the hostname {host:?} gives no usable node id ({label:?} {why}); set agent.node_id (or --node-id) to a DNS label"
        ))
    })?;
    Ok(label)
}

#[allow(unsafe_code)]
fn hostname() -> std::io::Result<String> {
    // 256 bytes is above HOST_NAME_MAX on FreeBSD (255) and Linux (64).
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is a writable buffer of exactly `buf.len()` bytes, which is
    // the length passed; gethostname(3) writes at most that many bytes into it
    // and nothing else, and `buf` outlives the call.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // A truncated name may lack its NUL; the buffer's end bounds it then.
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// The host's size as the scheduler counts it, detected once at startup.
pub fn detect_capacity(capacity: &impl Capacity) -> Result<Resources, ClusterError> {
    let c = capacity.detect().map_err(ClusterError::Capacity)?;
    Ok(Resources {
        cpu: f64::from(c.cpus),
        memory: c.memory_bytes,
    })
}

/// Capacity for `--simulate`: this machine's CPU count and, where
/// `/proc/meminfo` is readable, its memory; the Fake's defaults otherwise.
pub fn simulated_capacity() -> FakeCapacity {
    let fallback = FakeCapacity::default().detect().ok();
    let cpus = std::thread::available_parallelism()
        .ok()
        .map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX))
        .or(fallback.map(|f| f.cpus));
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| meminfo_total(&text))
        .or(fallback.map(|f| f.memory_bytes));
    match (cpus, memory) {
        (Some(cpus), Some(memory)) => FakeCapacity::new(cpus, memory),
        _ => FakeCapacity::default(),
    }
}

/// `MemTotal` from Linux's `/proc/meminfo` (`MemTotal:  16318412 kB`), in bytes.
pub fn meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

/// The heartbeat body from the worker's jail list: committed resources and
/// count of the jails it tracks (a jail being deleted no longer counts), and
/// the jails the control plane placed, with their epochs.
pub fn heartbeat_request(statuses: &[JailStatus]) -> HeartbeatRequest {
    let tracked: Vec<&JailStatus> = statuses
        .iter()
        .filter(|s| s.state != Phase::Deleting)
        .collect();
    let committed = Resources {
        // `+ 0.0`: an empty f64 sum is -0.0, which would print as such.
        cpu: tracked.iter().filter_map(|s| s.cpu).sum::<f64>() + 0.0,
        memory: tracked.iter().filter_map(|s| s.memory).sum(),
    };
    let placed = tracked
        .iter()
        .filter_map(|s| {
            Some(PlacedJail {
                name: s.name.clone(),
                epoch: s.epoch?,
                running: s.state == Phase::Running,
                address: Some(s.address),
            })
        })
        .collect();
    HeartbeatRequest {
        committed,
        jails: u32::try_from(tracked.len()).unwrap_or(u32::MAX),
        placed,
        peers_version: None,
    }
}

/// The last peer list the control plane sent in full, and its version, so a
/// heartbeat can ask for the list only when it changed (see
/// [`HeartbeatRequest::peers_version`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PeerCache {
    held: Option<(u64, Vec<Peer>)>,
}

impl PeerCache {
    /// The version to send with the next heartbeat.
    pub fn version(&self) -> Option<u64> {
        self.held.as_ref().map(|(v, _)| *v)
    }

    /// Takes in a heartbeat answer and returns the peer list to route by, or
    /// `None` when the answer says "unchanged" about a list this cache does
    /// not hold (a confused control plane): routes are then left as they are
    /// and the next heartbeat asks for the full list.
    pub fn absorb(&mut self, resp: &mut HeartbeatResponse) -> Option<Vec<Peer>> {
        let peers = std::mem::take(&mut resp.peers);
        if resp.peers_unchanged {
            return match &self.held {
                Some((v, held)) if Some(*v) == resp.peers_version => Some(held.clone()),
                _ => {
                    self.held = None;
                    None
                }
            };
        }
        self.held = resp.peers_version.map(|v| (v, peers.clone()));
        Some(peers)
    }
}

/// The stale names of a heartbeat answer, each with the epoch the agent
/// reported for it. A name the agent did not report is dropped: the agent
/// cannot know which placement the control plane meant.
pub fn stale_placed(stale: &[String], reported: &[PlacedJail]) -> Vec<PlacedJail> {
    stale
        .iter()
        .filter_map(|name| {
            let found = reported.iter().find(|p| &p.name == name).cloned();
            if found.is_none() {
                log::warn!(
                    "the control plane named jail {name} stale, but this node did not report it as placed; ignoring"
                );
            }
            found
        })
        .collect()
}

/// Kernel route changes that bring the table to the peers' subnets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutePlan {
    /// Routes to delete, first (withdrawn peers, and gateways that changed).
    pub delete: Vec<Ipv4Net>,
    /// Routes to add afterwards: destination via gateway.
    pub add: Vec<(Ipv4Net, Ipv4Addr)>,
}

impl RoutePlan {
    /// True when the table already matches.
    pub fn is_empty(&self) -> bool {
        self.delete.is_empty() && self.add.is_empty()
    }
}

/// The route diff, a pure function: every Alive peer's pod_cidr must route via
/// that peer's address; a route to the pod_cidr of a Dead peer, or to a
/// destination in `managed` (routes Keel added before) that no Alive peer
/// claims, is withdrawn. Routes to any other destination, and anything
/// overlapping the node's own subnet `own`, are left alone. A peer whose
/// pod_cidr does not parse is skipped.
pub fn plan_routes(
    own: Ipv4Net,
    peers: &[Peer],
    current: &[Route],
    managed: &BTreeSet<Ipv4Net>,
) -> RoutePlan {
    let own = own.trunc();
    let mut wanted: BTreeMap<Ipv4Net, Ipv4Addr> = BTreeMap::new();
    let mut ours: BTreeSet<Ipv4Net> = managed.iter().map(Ipv4Net::trunc).collect();
    for peer in peers {
        let Ok(net) = peer.pod_cidr.parse::<Ipv4Net>() else {
            continue;
        };
        let net = net.trunc();
        ours.insert(net);
        if peer.alive {
            wanted.entry(net).or_insert(peer.address);
        }
    }
    ours.retain(|n| !n.overlaps(&own));
    wanted.retain(|n, _| !n.overlaps(&own));

    let present: BTreeMap<Ipv4Net, &str> = current
        .iter()
        .map(|r| (r.destination.trunc(), r.gateway.as_str()))
        .filter(|(d, _)| ours.contains(d))
        .collect();
    let mut plan = RoutePlan::default();
    for (dest, gateway) in &present {
        match wanted.get(dest) {
            Some(want) if want.to_string() == *gateway => {}
            _ => plan.delete.push(*dest),
        }
    }
    for (dest, gateway) in &wanted {
        if present.get(dest).is_none_or(|g| *g != gateway.to_string()) {
            plan.add.push((*dest, *gateway));
        }
    }
    plan
}

/// What [`sync_routes`] did.
#[derive(Debug, Default)]
pub struct RouteSync {
    /// Destinations Keel manages after this sync (persist them).
    pub managed: BTreeSet<Ipv4Net>,
    /// Routes added.
    pub added: Vec<(Ipv4Net, Ipv4Addr)>,
    /// Routes deleted.
    pub deleted: Vec<Ipv4Net>,
    /// Failed steps; the others were done.
    pub errors: Vec<NetError>,
}

/// Reconciles the kernel routes with `peers`: one route listing, then the
/// deletes and adds of [`plan_routes`]. A failed listing changes nothing.
pub fn sync_routes(
    net: &impl NetManager,
    own: Ipv4Net,
    peers: &[Peer],
    managed: &BTreeSet<Ipv4Net>,
) -> RouteSync {
    let current = match net.list_routes() {
        Ok(routes) => routes,
        Err(e) => {
            return RouteSync {
                managed: managed.clone(),
                errors: vec![e],
                ..RouteSync::default()
            };
        }
    };
    let plan = plan_routes(own, peers, &current, managed);
    let mut sync = RouteSync::default();
    let own = own.trunc();
    // Keel's routes afterwards: every Alive peer's subnet (a failed add is
    // retried on the next heartbeat anyway), plus whatever could not be
    // withdrawn, so a later heartbeat still knows it is Keel's.
    sync.managed = peers
        .iter()
        .filter(|p| p.alive)
        .filter_map(|p| p.pod_cidr.parse::<Ipv4Net>().ok())
        .map(|n| n.trunc())
        .filter(|n| !n.overlaps(&own))
        .collect();
    for dest in plan.delete {
        match net.delete_route(dest) {
            Ok(()) => sync.deleted.push(dest),
            Err(e) => {
                sync.managed.insert(dest);
                sync.errors.push(e);
            }
        }
    }
    for (dest, gateway) in plan.add {
        match net.add_route(dest, gateway) {
            Ok(()) => sync.added.push((dest, gateway)),
            Err(e) => sync.errors.push(e),
        }
    }
    sync
}

/// What [`sync_vips`] did.
#[derive(Debug, Default)]
pub struct VipSync {
    /// VIPs Keel has aliased on the bridge after this sync (persist them).
    pub managed: BTreeSet<Ipv4Addr>,
    /// Aliases added.
    pub added: Vec<Ipv4Addr>,
    /// Aliases removed.
    pub removed: Vec<Ipv4Addr>,
    /// Failed steps; the others were done.
    pub errors: Vec<NetError>,
}

/// Aliases every VIP in `wanted` on `bridge` as a /32 and removes the aliases
/// Keel added before (`managed`) whose service is gone, after one listing of
/// the bridge's addresses. An address Keel did not add (the gateway, an
/// admin's alias) is never removed: only `managed` ones are. A failed listing
/// changes nothing; a failed removal stays managed, so the next heartbeat
/// tries again.
pub fn sync_vips(
    net: &impl NetManager,
    bridge: &str,
    wanted: &BTreeSet<Ipv4Addr>,
    managed: &BTreeSet<Ipv4Addr>,
) -> VipSync {
    let present: BTreeSet<Ipv4Addr> = match net.list_addresses(bridge) {
        Ok(addresses) => addresses.into_iter().collect(),
        Err(e) => {
            return VipSync {
                managed: managed.clone(),
                errors: vec![e],
                ..VipSync::default()
            };
        }
    };
    let mut sync = VipSync {
        managed: wanted.clone(),
        ..VipSync::default()
    };
    for vip in managed.difference(wanted).filter(|v| present.contains(v)) {
        match net.remove_alias(bridge, *vip) {
            Ok(()) => sync.removed.push(*vip),
            Err(e) => {
                sync.managed.insert(*vip);
                sync.errors.push(e);
            }
        }
    }
    for vip in wanted.difference(&present) {
        match net.add_alias(bridge, *vip) {
            Ok(()) => sync.added.push(*vip),
            Err(e) => sync.errors.push(e),
        }
    }
    sync
}

/// What applying one heartbeat answer did on the worker.
#[derive(Debug, Default)]
pub struct HeartbeatOutcome {
    /// Jails deleted because their placement moved away.
    pub fenced: Vec<String>,
    /// Problems, as messages for the log (the rest was done).
    pub errors: Vec<String>,
}

/// Applies a heartbeat answer on the worker thread: adopt (again, idempotent)
/// the node's subnet and the bridge address, reconcile peer routes, alias the
/// services' `vips` on the bridge (before the proxy listens on them), and
/// delete the placed jails in `fence` that still carry the reported epoch.
pub fn apply_heartbeat<J, Z, N, M>(
    reconciler: &mut Reconciler<J, Z, N, M>,
    pod_cidr: Ipv4Net,
    peers: &[Peer],
    vips: &BTreeSet<Ipv4Addr>,
    fence: &[PlacedJail],
) -> HeartbeatOutcome
where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    let mut outcome = HeartbeatOutcome::default();
    if let Err(e) = reconciler.adopt_node_subnet(pod_cidr) {
        outcome.errors.push(format!("node subnet {pod_cidr}: {e}"));
    }
    if let Err(e) = reconciler.ensure_gateway() {
        outcome.errors.push(format!(
            "address of bridge {}: {e}",
            reconciler.node().bridge
        ));
    }

    let own = reconciler.node().subnet;
    let managed = reconciler.state().cluster_routes.clone();
    let sync = sync_routes(reconciler.net(), own, peers, &managed);
    for dest in &sync.deleted {
        log::info!("withdrew the route to {dest} (its node is dead or gone)");
    }
    for (dest, gateway) in &sync.added {
        log::info!("routing {dest} via {gateway}");
    }
    outcome
        .errors
        .extend(sync.errors.iter().map(|e| format!("peer routes: {e}")));
    if let Err(e) = reconciler.record_cluster_routes(sync.managed) {
        outcome.errors.push(format!("peer routes: {e}"));
    }

    let bridge = reconciler.node().bridge.clone();
    let managed = reconciler.state().service_vips.clone();
    let aliases = sync_vips(reconciler.net(), &bridge, vips, &managed);
    for vip in &aliases.removed {
        log::info!("removed the alias {vip}/32 from {bridge} (its service is gone)");
    }
    for vip in &aliases.added {
        log::info!("aliased service VIP {vip}/32 on {bridge}");
    }
    outcome
        .errors
        .extend(aliases.errors.iter().map(|e| format!("service VIPs: {e}")));
    if let Err(e) = reconciler.record_service_vips(aliases.managed) {
        outcome.errors.push(format!("service VIPs: {e}"));
    }

    for stale in fence {
        let Some(epoch) = reconciler.record(&stale.name).map(|r| r.epoch) else {
            continue;
        };
        match epoch {
            None => log::warn!(
                "the control plane named jail {} stale, but it was applied locally (no epoch); local jails are never fenced",
                stale.name
            ),
            Some(e) if e != stale.epoch => log::info!(
                "not fencing jail {}: placed again (epoch {e}) since the heartbeat reported epoch {}",
                stale.name,
                stale.epoch
            ),
            Some(_) => match reconciler.delete(&stale.name) {
                Ok(()) => {
                    log::info!(
                        "fenced jail {} (epoch {}): its placement moved off this node",
                        stale.name,
                        stale.epoch
                    );
                    outcome.fenced.push(stale.name.clone());
                }
                Err(e) => outcome
                    .errors
                    .push(format!("fencing jail {}: {e}", stale.name)),
            },
        }
    }
    outcome
}

/// Reads the node's signing key (`agent.key_file`) and the node keys its TCP
/// listener accepts (`auth.node_keys`), refusing files that are not mode
/// 0600 and owned by root (by the current user when not running as root).
pub fn load_keys(cfg: &Config) -> Result<(Signer, Verifier), ClusterError> {
    let (signer, keyring) = load_key_material(cfg)?;
    Ok((signer, Verifier::new(keyring, cfg.auth.max_clock_skew.0)))
}

/// The signing key and the accepted node keys named by `cfg` (startup and
/// SIGHUP both read them through here).
pub fn load_key_material(cfg: &Config) -> Result<(Signer, Keyring), ClusterError> {
    let policy = KeyFilePolicy::for_current_process();
    let key = auth::load_key(&cfg.agent.key_file, policy).map_err(ClusterError::Keys)?;
    let keyring = Keyring::load(&cfg.auth.node_keys, &[], policy).map_err(ClusterError::Keys)?;
    Ok((Signer::new(key), keyring))
}

/// The agent API behind the TCP listener's guard: a request that did not
/// arrive on the Unix socket must be signed with a node key, else it is
/// answered 401 (logged with the peer and the reason) and never reaches a
/// route. The Unix socket and the TCP listener share one handler, so the
/// guard goes by [`Request::peer`], which the server sets to
/// [`crate::common::http::Peer::Unix`]
/// only for the Unix socket.
pub struct SignedApi {
    api: AgentApi,
    verifier: Arc<Verifier>,
}

impl SignedApi {
    /// `api`, guarded by `verifier` on TCP (shared with the daemon, which
    /// replaces its keyring on SIGHUP).
    pub fn new(api: AgentApi, verifier: Arc<Verifier>) -> SignedApi {
        SignedApi { api, verifier }
    }
}

impl Handler for SignedApi {
    fn handle(&self, req: Request) -> Response {
        use crate::common::http::Peer;
        let must_be_signed = match req.peer {
            Peer::Unix => false,
            Peer::Tcp(_) | Peer::Buffer => true,
        };
        if must_be_signed
            && let Err(e) = auth::verify_request(&self.verifier, &req, Role::Node, unix_now())
        {
            return auth::refusal(&e);
        }
        let response = self.api.handle(req);
        if must_be_signed {
            response.authenticated()
        } else {
            response
        }
    }
}

/// What the cluster thread needs to know.
#[derive(Debug, Clone)]
pub struct Membership {
    /// The control plane's `HOST:PORT`.
    pub controlplane: String,
    /// This node's id.
    pub node_id: String,
    /// The agent's TCP listener, as the control plane and peers reach it.
    pub advertise_addr: SocketAddr,
    /// The host's size.
    pub capacity: Resources,
    /// Heartbeat period.
    pub heartbeat_interval: Duration,
    /// Signs every request to the control plane with the node key; replaced
    /// on SIGHUP during a key rotation.
    pub signer: Arc<RwLock<Signer>>,
    /// Alias each service's VIP on the bridge (false with
    /// `agent.proxy_listen`, where the proxy listens elsewhere).
    pub alias_vips: bool,
}

/// The control plane, as the agent talks to it.
pub struct ControlPlane {
    client: Client,
    node_id: String,
    signer: Arc<RwLock<Signer>>,
}

impl ControlPlane {
    /// A client for `controlplane` (`HOST:PORT`) speaking for `node_id`,
    /// signing with `signer`.
    pub fn new(controlplane: &str, node_id: &str, signer: Arc<RwLock<Signer>>) -> ControlPlane {
        ControlPlane {
            client: Client::new(Endpoint::Tcp(controlplane.to_string()))
                .with_timeout(CONTROLPLANE_TIMEOUT),
            node_id: node_id.to_string(),
            signer,
        }
    }

    /// `POST /nodes/register`.
    pub fn register(&self, req: &RegisterRequest) -> Result<RegisterResponse, ClusterError> {
        self.post(REGISTER_PATH, req)
    }

    /// `POST /nodes/{id}/heartbeat`; a 404 is [`ClusterError::UnknownNode`].
    pub fn heartbeat(&self, req: &HeartbeatRequest) -> Result<HeartbeatResponse, ClusterError> {
        match self.post(&heartbeat_path(&self.node_id), req) {
            Err(ClusterError::Status { status: 404, .. }) => Err(ClusterError::UnknownNode),
            other => other,
        }
    }

    fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, ClusterError> {
        let body = serde_json::to_vec(body).map_err(|e| ClusterError::Body {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
        let signed = {
            let signer = self.signer.read().unwrap_or_else(|p| p.into_inner());
            sign_headers(&signer, "POST", path, &body, unix_now())
        };
        let mut headers = signed.map_err(ClusterError::Keys)?;
        headers.push(("Content-Type".to_string(), "application/json".to_string()));
        let resp = self
            .client
            .request("POST", path, &headers, &body)
            .map_err(ClusterError::Unreachable)?;
        if resp.status != 200 {
            return Err(ClusterError::Status {
                path: path.to_string(),
                status: resp.status,
                message: error_message(&resp.body),
            });
        }
        serde_json::from_slice(&resp.body).map_err(|e| ClusterError::Body {
            path: path.to_string(),
            reason: e.to_string(),
        })
    }
}

/// The `error` field of a JSON error body, else the body as text.
fn error_message(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct ErrorBody {
        error: String,
    }
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => e.error,
        Err(_) => String::from_utf8_lossy(body).trim().to_string(),
    }
}

/// Starts the cluster thread: register, then heartbeat until `stop` receives
/// (or is dropped) or the worker is gone. The thread owns `proxy`: each
/// heartbeat answer's services go to it (the API only reads it), and the
/// thread's handle is dropped when the thread ends.
pub fn spawn(
    membership: Membership,
    worker: WorkerHandle,
    proxy: Arc<Proxy>,
    stop: Receiver<()>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("keel-cluster".into())
        .spawn(move || {
            let cp = ControlPlane::new(
                &membership.controlplane,
                &membership.node_id,
                membership.signer.clone(),
            );
            // Err only when the worker is gone: the daemon is stopping.
            let _ = run(&membership, &cp, &worker, &proxy, &stop);
        })
}

/// Waits `delay`; true when the thread must stop.
fn stopped(stop: &Receiver<()>, delay: Duration) -> bool {
    !matches!(stop.recv_timeout(delay), Err(RecvTimeoutError::Timeout))
}

fn run(
    m: &Membership,
    cp: &ControlPlane,
    worker: &WorkerHandle,
    proxy: &Proxy,
    stop: &Receiver<()>,
) -> Result<(), WorkerGone> {
    let clock = SystemClock;
    let mut retry: Backoff<()> = Backoff::with_policy(Policy {
        initial: REGISTER_RETRY_INITIAL,
        cap: REGISTER_RETRY_CAP,
        ..Policy::default()
    });
    let register = RegisterRequest {
        node_id: m.node_id.clone(),
        advertise_addr: m.advertise_addr,
        capacity: m.capacity,
    };
    loop {
        // Register until it works; the agent serves locally meanwhile.
        let pod_cidr = loop {
            let failure = match cp.register(&register) {
                Ok(resp) => match resp.pod_cidr.parse::<Ipv4Net>() {
                    Ok(net) => break net,
                    Err(e) => ClusterError::Body {
                        path: REGISTER_PATH.into(),
                        reason: format!("pod_cidr {:?}: {e}", resp.pod_cidr),
                    },
                },
                Err(e) => e,
            };
            let delay = retry.record_failure(&(), clock.now());
            log::warn!(
                "registering node {} with {}: {failure}; retrying in {}s",
                m.node_id,
                m.controlplane,
                delay.as_secs_f64()
            );
            if stopped(stop, delay) {
                return Ok(());
            }
        };
        retry.forget(&());
        log::info!(
            "registered node {} with {} (pod_cidr {pod_cidr})",
            m.node_id,
            m.controlplane
        );
        if let Err(e) = worker.adopt_subnet(pod_cidr)? {
            log::error!(
                "cannot adopt the node subnet {pod_cidr} the control plane assigned: {e}; jails keep their addresses, retrying on every heartbeat"
            );
        }

        // Heartbeat until the control plane forgets the node.
        let mut last_problem: Option<String> = None;
        let mut peers = PeerCache::default();
        loop {
            let mut request = heartbeat_request(&worker.list()?);
            request.peers_version = peers.version();
            let problem = match cp.heartbeat(&request) {
                Ok(mut resp) => match peers.absorb(&mut resp) {
                    Some(list) => {
                        let fence = stale_placed(&resp.stale, &request.placed);
                        let vips = if m.alias_vips {
                            resp.services.iter().map(|s| s.vip).collect()
                        } else {
                            BTreeSet::new()
                        };
                        let services = resp
                            .services
                            .iter()
                            .map(|s| (s.name.clone(), SocketAddrV4::new(s.vip, s.port)))
                            .collect();
                        let outcome =
                            worker.cluster_update(pod_cidr, list, vips, services, fence)?;
                        // After the aliases exist: a listener on a VIP the
                        // host does not have yet would fail to bind.
                        let mut errors = outcome.errors;
                        errors.extend(proxy.update(&resp.services).iter().map(|e| e.to_string()));
                        (!errors.is_empty()).then(|| errors.join("; "))
                    }
                    None => Some(format!(
                        "{} answered that the peer list is unchanged but sent a version this node does not hold; keeping routes, asking for the full list next time",
                        m.controlplane
                    )),
                },
                Err(ClusterError::UnknownNode) => {
                    log::warn!("{}", ClusterError::UnknownNode);
                    break;
                }
                Err(e) => Some(format!(
                    "heartbeat to {}: {e}; keeping every jail and route as they are",
                    m.controlplane
                )),
            };
            // Once per change, not once per tick: a control plane that is down
            // for an hour must not write 720 identical lines.
            if problem != last_problem {
                match &problem {
                    Some(p) => log::warn!("{p}"),
                    None => log::info!("heartbeats to {} succeed again", m.controlplane),
                }
                last_problem = problem;
            }
            if stopped(stop, m.heartbeat_interval) {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agentd::reconciler::{NodeNetwork, STATE_FILE};
    use crate::common::backoff::ManualClock;
    use crate::common::store::Store;
    use crate::host::fake::{CallLog, Faults};
    use crate::host::jail::FakeJails;
    use crate::host::mount::FakeMounts;
    use crate::host::net::FakeNet;
    use crate::host::zfs::FakeZfs;

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("test prefix")
    }

    fn peer(id: &str, address: [u8; 4], cidr: &str, alive: bool) -> Peer {
        Peer {
            node_id: id.into(),
            address: Ipv4Addr::from(address),
            pod_cidr: cidr.into(),
            alive,
        }
    }

    fn route(dest: &str, gateway: &str) -> Route {
        Route {
            destination: net(dest),
            gateway: gateway.into(),
        }
    }

    const OWN: &str = "10.20.3.0/24";

    #[test]
    fn an_alive_peer_without_a_route_gets_one() {
        let peers = [peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)];
        let current = [route("0.0.0.0/0", "192.168.1.1"), route(OWN, "link#4")];
        let plan = plan_routes(net(OWN), &peers, &current, &BTreeSet::new());
        assert_eq!(plan.delete, []);
        assert_eq!(
            plan.add,
            [(net("10.20.7.0/24"), Ipv4Addr::new(10, 0, 0, 2))]
        );
    }

    #[test]
    fn a_dead_peer_route_is_withdrawn_and_a_missing_one_not_added() {
        let peers = [
            peer("n2", [10, 0, 0, 2], "10.20.7.0/24", false),
            peer("n3", [10, 0, 0, 3], "10.20.9.0/24", false),
        ];
        let current = [route("10.20.7.0/24", "10.0.0.2")];
        let plan = plan_routes(net(OWN), &peers, &current, &BTreeSet::new());
        assert_eq!(plan.delete, [net("10.20.7.0/24")]);
        assert_eq!(plan.add, []);
    }

    #[test]
    fn a_correct_table_needs_nothing() {
        let peers = [peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)];
        let current = [route("10.20.7.0/24", "10.0.0.2")];
        assert!(plan_routes(net(OWN), &peers, &current, &BTreeSet::new()).is_empty());
    }

    #[test]
    fn a_changed_gateway_is_deleted_then_added() {
        let peers = [peer("n2", [10, 0, 0, 12], "10.20.7.0/24", true)];
        let current = [route("10.20.7.0/24", "10.0.0.2")];
        let plan = plan_routes(net(OWN), &peers, &current, &BTreeSet::new());
        assert_eq!(plan.delete, [net("10.20.7.0/24")]);
        assert_eq!(
            plan.add,
            [(net("10.20.7.0/24"), Ipv4Addr::new(10, 0, 0, 12))]
        );
    }

    #[test]
    fn a_vanished_peer_route_is_withdrawn_only_when_keel_added_it() {
        let current = [
            route("10.20.7.0/24", "10.0.0.2"),
            route("172.16.0.0/12", "10.0.0.254"),
        ];
        let managed = BTreeSet::from([net("10.20.7.0/24")]);
        let plan = plan_routes(net(OWN), &[], &current, &managed);
        assert_eq!(plan.delete, [net("10.20.7.0/24")]);
        assert!(
            plan_routes(net(OWN), &[], &current, &BTreeSet::new()).is_empty(),
            "a route nobody claims is the admin's"
        );
    }

    #[test]
    fn the_admins_routes_and_the_own_subnet_are_never_touched() {
        let peers = [
            // A (misconfigured) peer claiming this node's own subnet.
            peer("n2", [10, 0, 0, 2], OWN, true),
            peer("n3", [10, 0, 0, 3], "not-a-cidr", true),
        ];
        let current = [
            route("0.0.0.0/0", "192.168.1.1"),
            route(OWN, "link#4"),
            route("10.20.3.1/32", "link#4"),
            route("10.20.8.0/24", "10.0.0.200"),
        ];
        let managed = BTreeSet::from([net(OWN)]);
        assert!(plan_routes(net(OWN), &peers, &current, &managed).is_empty());
    }

    #[test]
    fn sync_runs_the_plan_and_tracks_what_keel_owns() {
        let log = CallLog::new();
        let faults = Faults::default();
        let fake = FakeNet::new(log.clone(), faults.clone());
        fake.add_route(net("10.20.9.0/24"), Ipv4Addr::new(10, 0, 0, 9))
            .expect("route");
        let peers = [
            peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true),
            peer("n3", [10, 0, 0, 3], "10.20.8.0/24", true),
        ];
        faults.fail_times("add_route", Some("10.20.8.0/24"), 1);
        faults.fail_times("delete_route", Some("10.20.9.0/24"), 1);
        let managed = BTreeSet::from([net("10.20.9.0/24")]);
        let sync = sync_routes(&fake, net(OWN), &peers, &managed);
        assert_eq!(sync.added.len(), 1);
        assert_eq!(sync.errors.len(), 2);
        assert_eq!(
            sync.managed,
            BTreeSet::from([
                net("10.20.7.0/24"),
                net("10.20.8.0/24"),
                net("10.20.9.0/24")
            ]),
            "a failed delete stays Keel's, a failed add is retried from the peer list"
        );
        let again = sync_routes(&fake, net(OWN), &peers, &sync.managed);
        assert!(again.errors.is_empty(), "{:?}", again.errors);
        assert_eq!(again.deleted, [net("10.20.9.0/24")]);
        let mut dests: Vec<Ipv4Net> = fake.routes().iter().map(|r| r.destination).collect();
        dests.sort();
        assert_eq!(dests, [net("10.20.7.0/24"), net("10.20.8.0/24")]);
    }

    #[test]
    fn a_failed_route_listing_changes_nothing() {
        let log = CallLog::new();
        let faults = Faults::default();
        let fake = FakeNet::new(log.clone(), faults.clone());
        faults.fail_times("list_routes", None, 1);
        let managed = BTreeSet::from([net("10.20.9.0/24")]);
        let sync = sync_routes(
            &fake,
            net(OWN),
            &[peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)],
            &managed,
        );
        assert_eq!(sync.errors.len(), 1);
        assert_eq!(sync.managed, managed);
        assert!(log.matching("net.").is_empty());
    }

    #[test]
    fn node_ids_come_from_the_first_hostname_label() {
        assert_eq!(
            node_id_from_hostname("Web-1.example.org").expect("valid"),
            "web-1"
        );
        assert_eq!(node_id_from_hostname("n3").expect("valid"), "n3");
        for bad in ["", "web_1", "-web", "1234"] {
            let err = node_id_from_hostname(bad).expect_err(bad);
            assert!(err.to_string().contains("agent.node_id"), "{err}");
        }
        assert_eq!(node_id(Some("n9")).expect("configured"), "n9");
    }

    #[test]
    fn meminfo_total_is_read_in_bytes() {
        let text = "MemTotal:       16318412 kB\nMemFree:         1234 kB\n";
        assert_eq!(meminfo_total(text), Some(16_318_412 * 1024));
        assert_eq!(meminfo_total("MemFree: 1 kB\n"), None);
        assert_eq!(meminfo_total("MemTotal: lots kB\n"), None);
        let sim = detect_capacity(&simulated_capacity()).expect("fake capacity");
        assert!(sim.cpu >= 1.0 && sim.memory > 0);
    }

    fn status(name: &str, state: Phase, epoch: Option<u64>, cpu: f64, mem: u64) -> JailStatus {
        JailStatus {
            name: name.into(),
            state,
            address: Ipv4Addr::new(10, 20, 3, 2),
            restarts: 0,
            created_unix: 0,
            last_error: None,
            retry_in_secs: None,
            epoch,
            cpu: Some(cpu),
            memory: Some(mem),
        }
    }

    #[test]
    fn heartbeat_sums_tracked_jails_and_reports_placed_ones() {
        let req = heartbeat_request(&[
            status("a", Phase::Running, Some(3), 1.5, 512 << 20),
            status("b", Phase::CrashLoop, None, 0.5, 256 << 20),
            status("c", Phase::Deleting, None, 4.0, 1 << 30),
            status("d", Phase::Failed, Some(7), 1.0, 0),
        ]);
        assert_eq!(req.jails, 3);
        assert_eq!(req.committed.cpu, 3.0);
        assert_eq!(req.committed.memory, 768 << 20);
        let placed: Vec<(&str, u64, bool)> = req
            .placed
            .iter()
            .map(|p| (p.name.as_str(), p.epoch, p.running))
            .collect();
        assert_eq!(placed, [("a", 3, true), ("d", 7, false)]);
        assert!(req.placed.iter().all(|p| p.address.is_some()));
        let fence = stale_placed(&["d".into(), "zz".into()], &req.placed);
        assert_eq!(fence.len(), 1);
        assert_eq!(fence[0].epoch, 7);
    }

    fn answer(peers: Vec<Peer>, version: Option<u64>, unchanged: bool) -> HeartbeatResponse {
        HeartbeatResponse {
            peers,
            stale: Vec::new(),
            services: Vec::new(),
            peers_version: version,
            peers_unchanged: unchanged,
        }
    }

    #[test]
    fn the_peer_cache_keeps_the_last_full_list_for_unchanged_answers() {
        let list = vec![peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)];
        let mut cache = PeerCache::default();
        assert_eq!(
            cache.version(),
            None,
            "the first heartbeat asks for the list"
        );
        let got = cache.absorb(&mut answer(list.clone(), Some(41), false));
        assert_eq!(got.as_ref(), Some(&list));
        assert_eq!(cache.version(), Some(41));
        let got = cache.absorb(&mut answer(Vec::new(), Some(41), true));
        assert_eq!(
            got.as_ref(),
            Some(&list),
            "unchanged: route by the held list"
        );
        let newer = vec![peer("n2", [10, 0, 0, 2], "10.20.7.0/24", false)];
        let got = cache.absorb(&mut answer(newer.clone(), Some(42), false));
        assert_eq!(got.as_ref(), Some(&newer));
        assert_eq!(cache.version(), Some(42));
    }

    #[test]
    fn the_peer_cache_never_routes_by_a_list_it_does_not_hold() {
        let list = vec![peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)];
        let mut cache = PeerCache::default();
        cache.absorb(&mut answer(list, Some(7), false));
        assert_eq!(cache.absorb(&mut answer(Vec::new(), Some(8), true)), None);
        assert_eq!(cache.version(), None, "the next heartbeat asks again");
        // A control plane without versions: every answer is the full list.
        let empty = cache.absorb(&mut answer(Vec::new(), None, false));
        assert_eq!(empty, Some(Vec::new()));
        assert_eq!(cache.version(), None);
    }

    type FakeReconciler = Reconciler<FakeJails, FakeZfs, FakeNet, FakeMounts>;

    fn reconciler(dir: &std::path::Path, net: FakeNet) -> FakeReconciler {
        let log = CallLog::new();
        let (store, state) = Store::open(dir, STATE_FILE).expect("store");
        Reconciler::new(
            FakeJails::new(log.clone(), Faults::default()),
            {
                let zfs = FakeZfs::new(log.clone(), Faults::default());
                zfs.add_base("14.2-RELEASE");
                zfs
            },
            net,
            FakeMounts::new(log, Faults::default()),
            NodeNetwork {
                bridge: "keel0".into(),
                subnet: state
                    .as_ref()
                    .and_then(|s: &crate::agentd::reconciler::AgentState| s.node_subnet)
                    .unwrap_or(net_default()),
            },
            store,
            state,
            Box::new(ManualClock::new()),
        )
    }

    fn net_default() -> Ipv4Net {
        net("10.20.0.0/24")
    }

    fn jail(name: &str, address: Option<&str>) -> spec::Jail {
        let addr = address
            .map(|a| format!("  network:\n    address: {a}\n"))
            .unwrap_or_default();
        spec::parse_jail(&format!(
            "kind: Jail\nmetadata:\n  name: {name}\nspec:\n  base: 14.2-RELEASE\n{addr}  exec:\n    start: [\"/bin/sleep\", \"60\"]\n"
        ))
        .expect("test spec")
    }

    #[test]
    fn fencing_deletes_stale_placed_jails_and_never_local_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake_net = FakeNet::new(CallLog::new(), Faults::default());
        let mut r = reconciler(dir.path(), fake_net);
        let pod = net("10.20.5.0/24");
        r.adopt_node_subnet(pod).expect("adopt");
        r.ensure_gateway().expect("bridge");
        r.apply(jail("placed", None), Some(4)).expect("placed");
        r.apply(jail("moved-back", None), Some(9)).expect("placed");
        r.apply(jail("local", None), None).expect("local");

        let fence = [
            PlacedJail {
                name: "placed".into(),
                epoch: 4,
                running: true,
                address: None,
            },
            // Reported with epoch 8, re-placed here with 9 since.
            PlacedJail {
                name: "moved-back".into(),
                epoch: 8,
                running: true,
                address: None,
            },
            // The control plane cannot fence a local jail, whatever it says.
            PlacedJail {
                name: "local".into(),
                epoch: 1,
                running: true,
                address: None,
            },
        ];
        let outcome = apply_heartbeat(&mut r, pod, &[], &BTreeSet::new(), &fence);
        assert!(outcome.errors.is_empty(), "{:?}", outcome.errors);
        assert_eq!(outcome.fenced, ["placed"]);
        assert!(r.record("placed").is_none());
        assert!(r.record("moved-back").is_some());
        assert!(r.record("local").is_some());
    }

    #[test]
    fn the_assigned_subnet_is_persisted_addresses_follow_it_and_others_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake_net = FakeNet::new(CallLog::new(), Faults::default());
        let pod = net("10.20.5.0/24");
        {
            let mut r = reconciler(dir.path(), fake_net.clone());
            r.adopt_node_subnet(pod).expect("adopt");
            r.ensure_gateway().expect("bridge");
            r.ensure_gateway().expect("bridge");
            assert_eq!(fake_net.bridge_address("keel0"), Some(net("10.20.5.1/24")));
            let status = r.apply(jail("web", None), Some(1)).expect("applied");
            assert!(pod.contains(status.address), "{}", status.address);
            let err = r
                .apply(jail("stray", Some("10.20.0.9")), Some(2))
                .expect_err("outside the pod_cidr");
            assert!(err.to_string().contains("spec.network.address"), "{err}");
            assert!(r.record("stray").is_none(), "refused before provisioning");
        }
        // A restarted node keeps its subnet without the control plane.
        let r = reconciler(dir.path(), fake_net);
        assert_eq!(r.state().node_subnet, Some(pod));
        assert_eq!(r.node().subnet, pod);
    }

    #[test]
    fn a_subnet_that_strands_jails_is_refused_and_nothing_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut r = reconciler(dir.path(), FakeNet::new(CallLog::new(), Faults::default()));
        r.reconcile();
        r.apply(jail("local", None), None).expect("local");
        let err = r
            .adopt_node_subnet(net("10.20.5.0/24"))
            .expect_err("local jail outside");
        assert!(err.to_string().contains("local"), "{err}");
        assert_eq!(r.node().subnet, net_default());
        assert_eq!(r.state().node_subnet, None);
    }

    #[test]
    fn heartbeat_routes_are_persisted_as_keels() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake_net = FakeNet::new(CallLog::new(), Faults::default());
        let mut r = reconciler(dir.path(), fake_net.clone());
        let pod = net("10.20.5.0/24");
        let peers = [peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)];
        let outcome = apply_heartbeat(&mut r, pod, &peers, &BTreeSet::new(), &[]);
        assert!(outcome.errors.is_empty(), "{:?}", outcome.errors);
        assert_eq!(
            r.state().cluster_routes,
            BTreeSet::from([net("10.20.7.0/24")])
        );
        drop(r);
        // The peer left the cluster while the agent was down: the restarted
        // agent still knows the route is Keel's and withdraws it.
        let mut r = reconciler(dir.path(), fake_net.clone());
        apply_heartbeat(&mut r, pod, &[], &BTreeSet::new(), &[]);
        assert!(fake_net.routes().is_empty());
        assert!(r.state().cluster_routes.is_empty());
    }

    fn ip(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 96, 0, last)
    }

    #[test]
    fn vips_are_aliased_and_only_keels_are_removed() {
        let faults = Faults::default();
        let fake = FakeNet::new(CallLog::new(), faults.clone());
        fake.add_interface("keel0");
        fake.add_alias("keel0", ip(99)).expect("the admin's alias");
        let sync = sync_vips(
            &fake,
            "keel0",
            &BTreeSet::from([ip(1), ip(2)]),
            &BTreeSet::new(),
        );
        assert!(sync.errors.is_empty(), "{:?}", sync.errors);
        assert_eq!(sync.added, vec![ip(1), ip(2)]);
        assert_eq!(sync.managed, BTreeSet::from([ip(1), ip(2)]));
        assert_eq!(fake.aliases("keel0"), vec![ip(1), ip(2), ip(99)]);

        // Service 2 is gone; 99 was never Keel's, so it stays.
        let sync = sync_vips(&fake, "keel0", &BTreeSet::from([ip(1)]), &sync.managed);
        assert_eq!(sync.removed, vec![ip(2)]);
        assert!(sync.added.is_empty(), "1 is already there");
        assert_eq!(fake.aliases("keel0"), vec![ip(1), ip(99)]);

        // A removal that fails stays Keel's, to be retried.
        faults.fail("remove_alias", Some("10.96.0.1"));
        let sync = sync_vips(&fake, "keel0", &BTreeSet::new(), &sync.managed);
        assert_eq!(sync.errors.len(), 1);
        assert_eq!(sync.managed, BTreeSet::from([ip(1)]));
        faults.clear();

        // A failed listing changes nothing.
        faults.fail("list_addresses", None);
        let sync = sync_vips(&fake, "keel0", &BTreeSet::from([ip(3)]), &sync.managed);
        assert_eq!(sync.errors.len(), 1);
        assert_eq!(sync.managed, BTreeSet::from([ip(1)]));
        assert_eq!(fake.aliases("keel0"), vec![ip(1), ip(99)]);
    }

    #[test]
    fn heartbeat_vips_are_persisted_so_a_restarted_agent_removes_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake_net = FakeNet::new(CallLog::new(), Faults::default());
        let mut r = reconciler(dir.path(), fake_net.clone());
        let pod = net("10.20.5.0/24");
        let outcome = apply_heartbeat(&mut r, pod, &[], &BTreeSet::from([ip(7)]), &[]);
        assert!(outcome.errors.is_empty(), "{:?}", outcome.errors);
        assert_eq!(fake_net.aliases("keel0"), vec![ip(7)]);
        assert_eq!(r.state().service_vips, BTreeSet::from([ip(7)]));
        drop(r);
        // The service was deleted while the agent was down.
        let mut r = reconciler(dir.path(), fake_net.clone());
        let outcome = apply_heartbeat(&mut r, pod, &[], &BTreeSet::new(), &[]);
        assert!(outcome.errors.is_empty(), "{:?}", outcome.errors);
        assert!(fake_net.aliases("keel0").is_empty());
        assert!(r.state().service_vips.is_empty());
        assert_eq!(
            fake_net.bridge_address("keel0"),
            Some(net("10.20.5.1/24")),
            "the gateway address is never an alias to remove"
        );
    }
}
