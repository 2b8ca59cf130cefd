//! JSON bodies the daemons and keelctl exchange. `agentd`, `controlplane` and
//! `ctl` never import each other; everything they say to one another is here.
//!
//! Field names are part of the API (keelctl `-o json` prints them as they are):
//! add fields, never rename them.

use std::fmt;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// Where a jail stands, as last seen by the reconciler.
///
/// Variants are only ever added. A phase this build does not know (sent by
/// a newer daemon) reads as [`Phase::Unknown`] instead of failing the whole
/// answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Recorded, not provisioned yet.
    Pending,
    /// The workload runs, and was seen running after its start settled (a
    /// pass after the one that started it).
    Running,
    /// The workload exited again after a restart (repeated crashes); waiting
    /// for its backoff delay before restarting.
    CrashLoop,
    /// The last provisioning or restart attempt failed.
    Failed,
    /// A delete is in progress.
    Deleting,
    /// The workload was started and has not been seen running by a later
    /// observation yet: the next pass says Running, or that it exited.
    Starting,
    /// The workload exited once (after running, or at its start); waiting
    /// for the backoff delay before its restart.
    Restarting,
    /// A phase a newer daemon sent that this build does not know.
    #[serde(other)]
    Unknown,
}

impl Phase {
    /// True while the workload was started and not seen gone: Starting or
    /// Running. Such a jail serves (when it has no health check, or passes
    /// it) and counts as running for the control plane.
    pub fn runs(self) -> bool {
        matches!(self, Phase::Running | Phase::Starting)
    }

    /// True while the workload exited and waits for its restart:
    /// Restarting or CrashLoop.
    pub fn crashed(self) -> bool {
        matches!(self, Phase::Restarting | Phase::CrashLoop)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Pending => "Pending",
            Phase::Running => "Running",
            Phase::CrashLoop => "CrashLoop",
            Phase::Failed => "Failed",
            Phase::Deleting => "Deleting",
            Phase::Starting => "Starting",
            Phase::Restarting => "Restarting",
            Phase::Unknown => "Unknown",
        })
    }
}

/// A jail's state for the API: desired and observed together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JailStatus {
    /// Jail name.
    pub name: String,
    /// Phase as last observed.
    pub state: Phase,
    /// The jail's address.
    pub address: Ipv4Addr,
    /// Restarts after crashes and failed health checks.
    pub restarts: u32,
    /// Whether it serves: Running and, when its spec has `health`, its probe
    /// passed since the workload last started and has not failed
    /// `failureThreshold` times in a row since. Absent from older agents.
    #[serde(default)]
    pub ready: bool,
    /// When it was first applied (Unix seconds).
    pub created_unix: u64,
    /// The last error, if the last attempt failed.
    pub last_error: Option<String>,
    /// Seconds until the next restart attempt while in CrashLoop or Failed.
    pub retry_in_secs: Option<u64>,
    /// Placement epoch, for jails the control plane placed.
    pub epoch: Option<u64>,
    /// cpu cores requested.
    pub cpu: Option<f64>,
    /// memory bytes requested.
    pub memory: Option<u64>,
    /// How the workload last exited, when it did since the agent started
    /// (absent from older agents).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<LastExit>,
}

/// How a jail's workload last exited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastExit {
    /// Its exit status, when the host knows it (the simulated host reaps
    /// the workload; a FreeBSD jail only shows it has no process left).
    pub status: Option<i32>,
    /// When the agent saw it gone (Unix seconds).
    pub time_unix: u64,
}

/// The JSON body of every error response (`common::http::Response::error`
/// writes it): what went wrong and, when the error is about one field of the
/// request, that field's path (e.g. `spec.network.address`). keelctl decodes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, phrased for the user.
    pub error: String,
    /// Path of the offending field, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// Header carrying the control plane's placement epoch on a forwarded apply.
pub const EPOCH_HEADER: &str = "X-Keel-Epoch";

/// Size of a node, or what its jails have committed of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    /// CPU cores (capacity: `hw.ncpu`; committed: sum of `spec.resources.cpu`).
    pub cpu: f64,
    /// Bytes (capacity: `hw.physmem`; committed: sum of `spec.resources.memory`).
    pub memory: u64,
}

/// `POST /nodes/register`: an agent joins (or rejoins) the cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// The node's id (a DNS label; default the hostname).
    pub node_id: String,
    /// `IP:PORT` of the agent's TCP listener; the control plane forwards there
    /// and peers route the node's subnet via this IP.
    pub advertise_addr: std::net::SocketAddr,
    /// What the host offers, detected once at agent startup.
    pub capacity: Resources,
}

/// Answer to a registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterResponse {
    /// The node's subnet, the same on every re-registration.
    pub pod_cidr: String,
}

/// A jail the control plane placed on the reporting node, with the epoch it
/// was placed under (fencing: see [`HeartbeatResponse::stale`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedJail {
    /// Jail name.
    pub name: String,
    /// Placement epoch stored with the jail.
    pub epoch: u64,
    /// Whether its workload was running at the agent's last pass.
    pub running: bool,
    /// Whether it is ready ([`JailStatus::ready`]); `None` from an agent
    /// older than health checks, where running means ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<bool>,
    /// The jail's address (the proxy routes a service's traffic to it).
    #[serde(default)]
    pub address: Option<std::net::Ipv4Addr>,
}

/// `POST /nodes/{id}/heartbeat`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeartbeatRequest {
    /// Sum of the resources of every jail the agent tracks.
    pub committed: Resources,
    /// Number of jails the agent tracks.
    pub jails: u32,
    /// Jails the control plane placed here, with their epochs.
    #[serde(default)]
    pub placed: Vec<PlacedJail>,
    /// [`HeartbeatResponse::peers_version`] of the last peer list this agent
    /// received in full: when it is still current the control plane answers
    /// [`HeartbeatResponse::peers_unchanged`] instead of resending every peer
    /// (5,000 peers are about 450 KB of JSON). `None`: always send the list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers_version: Option<u64>,
    /// The endpoint generation ([`EndpointsAnswer::generation`]) of the
    /// service table this node's proxy applied last, when it came from the
    /// control plane that answered the previous heartbeat; `None` before the
    /// first one (or from an agent older than endpoint generations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints_generation: Option<u64>,
    /// Connections this node's proxy has open to each replica (every
    /// replica with at least one, whether the table still lists it or it is
    /// only draining).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub connections: Vec<ReplicaConnections>,
    /// This agent applies peer changes: when the control plane still keeps
    /// the changes since `peers_version`, it answers only those
    /// ([`HeartbeatResponse::peers_changed`]). False (an older agent): the
    /// answer is the whole list or "unchanged", as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub peer_changes: bool,
    /// The endpoint table this agent's heartbeats last received, when it
    /// came from the control plane that answered the previous heartbeat:
    /// while it is current the answer says
    /// [`HeartbeatResponse::endpoints_unchanged`] instead of resending every
    /// service. `None`: always send the table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints_held: Option<EndpointsStamp>,
    /// The newest number of the agent's event ring: the control plane
    /// wakes event watches when it grows and asks only the nodes whose
    /// events a watcher has not seen. `None` from an agent without events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events_seq: Option<u64>,
    /// This agent applies endpoint changes: when the control plane still
    /// keeps the changes since the generation of `endpoints_held`, it
    /// answers only those ([`HeartbeatResponse::services_changed`]).
    /// False (an older agent): the whole table or "unchanged", as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub endpoint_changes: bool,
}

/// One endpoint table's identity: the control-plane process that numbered
/// it and its generation ([`EndpointsAnswer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointsStamp {
    /// [`EndpointsAnswer::origin`].
    pub origin: u64,
    /// [`EndpointsAnswer::generation`].
    pub generation: u64,
}

/// Connections one node's proxy has open to one replica
/// ([`HeartbeatRequest::connections`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaConnections {
    /// The replica's `address:port`.
    pub addr: std::net::SocketAddrV4,
    /// Connections relaying to it now (at least 1).
    pub open: u32,
}

/// Longest wait of `GET /nodes/{id}/endpoints?after=G` for a generation
/// above `G` before the control plane answers the current table; an agent's
/// read timeout on that request must be longer.
pub const ENDPOINTS_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// `GET /nodes/{id}/endpoints?after=G[&origin=O]`: the service table the
/// control plane publishes, with its generation, or (for a poll that named
/// the `origin` of the table it holds) only the changes since `G`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointsAnswer {
    /// Numbers the published tables of one control-plane process: starts at
    /// 1 and grows by one on every change (see [`EndpointsAnswer::origin`]).
    pub generation: u64,
    /// Identifies the control-plane process that numbered `generation`
    /// (random at its start, below 2^53): generations of two processes are
    /// not comparable.
    pub origin: u64,
    /// Every service, as [`HeartbeatResponse::services`] (only the changed
    /// ones with `services_changed`).
    pub services: Vec<ServiceEndpoints>,
    /// Set when the answer carries only the changes since this generation
    /// (the poll's `after`, for a poll that gave the `origin` it holds):
    /// `services` then holds the services added or changed since,
    /// `services_removed` the names of those gone, as
    /// [`HeartbeatResponse::services_changed`]. Both empty: the table of
    /// `after` is still current.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub services_changed: Option<u64>,
    /// Names of the services gone since `services_changed`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services_removed: Vec<String>,
}

/// One cluster member as peers see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    /// Node id.
    pub node_id: String,
    /// The address its subnet is routed via (the advertise address's IP).
    pub address: std::net::Ipv4Addr,
    /// Its subnet.
    pub pod_cidr: String,
    /// Not Dead (Alive, or Unknown after a control-plane restart); a Dead
    /// peer's route is withdrawn.
    pub alive: bool,
}

/// A replicated service as every node's proxy needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceEndpoints {
    /// Service name.
    pub name: String,
    /// Its virtual IP.
    pub vip: std::net::Ipv4Addr,
    /// Its port.
    pub port: u16,
    /// `address:port` of every replica on an Alive node whose workload runs.
    pub replicas: Vec<std::net::SocketAddrV4>,
    /// Some replica is on a node the control plane has not heard from since
    /// it started, so `replicas` may lack ones that serve: a proxy already
    /// routing this service adds these replicas to the ones it has instead of
    /// dropping any. Absent (false) in the JSON when settled.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unsettled: bool,
}

/// Header of an agent's answer to a control-plane `PUT /jails/{name}` (one
/// with an epoch): the node's committed resources after the apply,
/// `CPU MEMORY` (cores, bytes), the same sum a heartbeat reports. The control plane ranks the node by it at once, so a
/// burst of scheduled applies spreads instead of all landing on the node
/// that had the most headroom at the last heartbeat.
pub const COMMITTED_HEADER: &str = "X-Keel-Committed";

/// [`COMMITTED_HEADER`]'s value for `r`.
pub fn format_committed(r: &Resources) -> String {
    format!("{} {}", r.cpu, r.memory)
}

/// Parses [`COMMITTED_HEADER`]; `None` for anything malformed (the
/// heartbeat corrects the ranking anyway).
pub fn parse_committed(value: &str) -> Option<Resources> {
    let (cpu, memory) = value.trim().split_once(' ')?;
    let cpu: f64 = cpu.parse().ok()?;
    let memory: u64 = memory.trim().parse().ok()?;
    (cpu.is_finite() && cpu >= 0.0).then_some(Resources { cpu, memory })
}

/// Answer to a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatResponse {
    /// Every other registered node.
    pub peers: Vec<Peer>,
    /// Placed jails the reporting node holds that are no longer placed on it
    /// (moved while it was Dead, or deleted): the agent deletes them.
    #[serde(default)]
    pub stale: Vec<String>,
    /// Every service, for the node's proxy (only the changed ones with
    /// [`HeartbeatResponse::services_changed`]).
    #[serde(default)]
    pub services: Vec<ServiceEndpoints>,
    /// Identifies the current peer list (any change to a node's record or
    /// liveness gives a new value; a restarted control plane starts from a
    /// random one, below 2^53 so JSON tools read it exactly). `None` from a
    /// control plane that does not version its peer list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers_version: Option<u64>,
    /// True when the request's `peers_version` is current: `peers` is then
    /// empty and the agent keeps the list it has. Never true for a request
    /// without `peers_version`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub peers_unchanged: bool,
    /// The endpoint generation of `services` ([`EndpointsAnswer::generation`]);
    /// `None` from a control plane without endpoint generations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints_generation: Option<u64>,
    /// The control-plane process that numbered `endpoints_generation`
    /// ([`EndpointsAnswer::origin`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints_origin: Option<u64>,
    /// Set when the answer carries only the peer changes since this
    /// version (the request's `peers_version`, for a request with
    /// `peer_changes`): `peers` then holds the peers added or changed since,
    /// `peers_removed` the ids of those gone, and the agent applies them to
    /// the list of that version to get the list of `peers_version`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers_changed: Option<u64>,
    /// Ids of the peers gone since `peers_changed`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peers_removed: Vec<String>,
    /// True when the request's `endpoints_held` is the current table:
    /// `services` is then empty and the agent keeps the table it has.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub endpoints_unchanged: bool,
    /// Set when the answer carries only the endpoint changes since this
    /// generation (that of the request's `endpoints_held`, for a request
    /// with `endpoint_changes`): `services` then holds the services added
    /// or changed since, `services_removed` the names of those gone, and
    /// the agent applies them to the table of that generation to get the
    /// table of `endpoints_generation`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub services_changed: Option<u64>,
    /// Names of the services gone since `services_changed`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services_removed: Vec<String>,
}

/// Liveness of a node, computed on read from its last heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Liveness {
    /// Heartbeated within `dead_after`.
    Alive,
    /// Not heard from since the control plane started (or since it was
    /// stalled), for less than `dead_after`: it keeps what it runs and is
    /// still routed to, but gets nothing new until it heartbeats.
    Unknown,
    /// This control plane saw it stay silent for `dead_after`.
    Dead,
}

impl fmt::Display for Liveness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Liveness::Alive => "Alive",
            Liveness::Unknown => "Unknown",
            Liveness::Dead => "Dead",
        })
    }
}

/// `GET /nodes` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Node id.
    pub node_id: String,
    /// Alive, Unknown or Dead.
    pub status: Liveness,
    /// The agent's advertise address.
    pub address: std::net::SocketAddr,
    /// Its subnet.
    pub pod_cidr: String,
    /// Host size.
    pub capacity: Resources,
    /// What its jails have committed.
    pub committed: Resources,
    /// Jails it holds as far as the control plane knows: what its last
    /// heartbeat reported plus the applies it answered since (what the
    /// scheduler breaks equal headroom with).
    pub jails: u32,
    /// Seconds since its last heartbeat; `None` when not heard from since the
    /// control plane started.
    pub last_seen_secs: Option<u64>,
    /// Cordoned: nothing new is placed on it (`keelctl cordon`).
    #[serde(default)]
    pub cordoned: bool,
    /// The newest event number its last heartbeat reported
    /// ([`HeartbeatRequest::events_seq`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events_seq: Option<u64>,
}

/// `PUT /services/{name}` as keelctl sends it. The control plane never parses
/// specs, so keelctl, which validated the document, states what the control
/// plane needs to know about it; the document itself travels untouched to the
/// agents, which expand the template into each replica's jail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceApply {
    /// The Service document (YAML, `kind: Service`).
    pub document: String,
    /// `spec.replicas`.
    pub replicas: u32,
    /// `spec.port`.
    pub port: u16,
    /// The template declares volumes: replicas are pinned to their nodes.
    pub stateful: bool,
    /// Hex SHA-256 of the template in canonical JSON: the template is
    /// immutable once the service exists, and this is how the control plane
    /// tells a change without reading it.
    pub template_digest: String,
    /// The template's volume names (`spec.template.volumes[].name`); replica
    /// `{service}-{i}` holds `{service}-{i}-{volume}` for each, and the
    /// control plane pins the replica to the node that holds them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<String>,
    /// `spec.update` and `spec.drainTimeout`; the defaults when a keelctl
    /// from before rolling updates sent none.
    #[serde(default)]
    pub policy: RolloutPolicy,
    /// What each replica requests (`spec.template.resources`, an absent
    /// request as 0), so that healing a lost node's replicas can spread
    /// them before their nodes report what they commit. `None` from a
    /// keelctl that did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ReplicaRequest>,
}

/// What one replica of a service requests ([`ServiceApply::resources`]).
/// Whole millicores rather than an `f64`, so the applied record keeps `Eq`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRequest {
    /// CPU, in thousandths of a core.
    pub cpu_millicores: u64,
    /// Memory, in bytes.
    pub memory: u64,
}

impl ReplicaRequest {
    /// As the scheduler counts resources.
    pub fn resources(&self) -> Resources {
        Resources {
            cpu: self.cpu_millicores as f64 / 1000.0,
            memory: self.memory,
        }
    }
}

/// How a Service's template change rolls out (`spec.update`) and how long a
/// replica leaving the rotation drains (`spec.drainTimeout`), in the units
/// the control plane computes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutPolicy {
    /// Replicas that may be not ready because of the update.
    pub max_unavailable: u32,
    /// Replicas that may run above the desired count during the update.
    pub max_surge: u32,
    /// A new replica not ready this long (milliseconds) stops the rollout.
    pub progress_deadline_ms: u64,
    /// A leaving replica keeps its connections at most this long (milliseconds).
    pub drain_timeout_ms: u64,
}

impl Default for RolloutPolicy {
    fn default() -> RolloutPolicy {
        RolloutPolicy {
            max_unavailable: 1,
            max_surge: 0,
            progress_deadline_ms: 600_000,
            drain_timeout_ms: 10_000,
        }
    }
}

/// Where a service's rollout stands, as `GET /services/{name}` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutStatus {
    /// The revision being rolled out (the service's current one).
    pub revision: u64,
    /// `Progressing`, `Complete` or `Stopped`.
    pub state: String,
    /// Why it stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// One template revision of a service (`GET /services/{name}/revisions`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceRevision {
    /// 1 for the service's first template, one more for every change.
    pub revision: u64,
    /// When the control plane recorded it (seconds since the epoch).
    pub created_unix: u64,
    /// [`ServiceApply::template_digest`] of its template.
    pub template_digest: String,
    /// The Service document that introduced it.
    pub document: String,
    /// The service's current template.
    pub current: bool,
}

/// One replica of a service, as `GET /services/{name}` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaStatus {
    /// `{service}-{index}`.
    pub name: String,
    /// Node it is placed on.
    pub node: String,
    /// Its address, once its node reported it.
    pub address: Option<std::net::Ipv4Addr>,
    /// `Running`, `NotReady` (its workload runs but fails its health
    /// check), `NotRunning` (its node reports the workload down), `Pending`
    /// (not reported yet), `NodeUnknown` or `NodeDead`.
    pub state: String,
    /// Counts towards the VIP's replica list (Alive node, ready).
    pub ready: bool,
    /// The template revision it was last applied with, when known (a
    /// replica placed before revisions were kept has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
    /// It runs the service's current template.
    #[serde(default)]
    pub updated: bool,
}

/// A service, as `GET /services` and `GET /services/{name}` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceStatus {
    /// Service name.
    pub name: String,
    /// Virtual IP, fixed for the service's life.
    pub vip: std::net::Ipv4Addr,
    /// Port, fixed for the service's life.
    pub port: u16,
    /// Desired replicas.
    pub desired: u32,
    /// Replicas on Alive nodes whose workload runs.
    pub ready: u32,
    /// Template has volumes: replicas are pinned to their nodes.
    pub stateful: bool,
    /// The current template's revision.
    #[serde(default)]
    pub revision: u64,
    /// Replicas below the desired count that run the current template.
    #[serde(default)]
    pub updated: u32,
    /// The last rollout (none before the template first changed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutStatus>,
    /// Every placed replica.
    pub replicas: Vec<ReplicaStatus>,
}

/// Query parameter of `PUT /jails/{name}` naming the volumes the jail
/// declares, comma-separated (`?volumes=pgdata,logs`). The control plane never
/// parses a spec, so keelctl (which validated it) states the volume names
/// here; the query is part of the signed request target, so it cannot be
/// altered in transit, and the agent refuses a request whose list differs
/// from what the spec declares (see `agentd::api`), so the control plane
/// never records a volume the jail does not hold.
pub const VOLUMES_PARAM: &str = "volumes";

/// The query for `names` (`volumes=a,b`), `None` when there are none. Names
/// are DNS labels (validated specs), so nothing needs escaping.
pub fn volumes_query(names: &[String]) -> Option<String> {
    (!names.is_empty()).then(|| format!("{VOLUMES_PARAM}={}", names.join(",")))
}

/// The volume names of a request's query: `None` when the query has no
/// [`VOLUMES_PARAM`], `Some(empty)` for `volumes=`. Every name must be a DNS
/// label; the parameter may appear once.
pub fn parse_volumes_query(query: Option<&str>) -> Result<Option<Vec<String>>, String> {
    let mut found: Option<Vec<String>> = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let Some(value) = pair
            .strip_prefix(VOLUMES_PARAM)
            .and_then(|r| r.strip_prefix('='))
        else {
            continue;
        };
        if found.is_some() {
            return Err(format!("the query names `{VOLUMES_PARAM}` twice"));
        }
        let mut names = Vec::new();
        for name in value.split(',').filter(|n| !n.is_empty()) {
            crate::common::names::validate_name(name)
                .map_err(|why| format!("volume name {name:?} in the query: {why}"))?;
            if !names.iter().any(|n| n == name) {
                names.push(name.to_string());
            }
        }
        names.sort();
        found = Some(names);
    }
    Ok(found)
}

/// `GET /jails/{name}/log?tail=N`: the last N lines of the workload's
/// output. Without `tail`, this many.
pub const LOG_TAIL_DEFAULT: usize = 200;
/// The most lines one request may ask for.
pub const LOG_TAIL_MAX: usize = 10_000;
/// The most bytes of the end of the output one request reads, whatever the
/// lines.
pub const LOG_BYTES_MAX: u64 = 1 << 20;

/// The `tail` of a log request's query: [`LOG_TAIL_DEFAULT`] when absent,
/// else a number from 1 to [`LOG_TAIL_MAX`].
pub fn parse_tail_query(query: Option<&str>) -> Result<usize, String> {
    let mut tail = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let Some(value) = pair.strip_prefix("tail=") else {
            continue;
        };
        if tail.is_some() {
            return Err("the query names `tail` twice".into());
        }
        match value.parse::<usize>() {
            Ok(n) if (1..=LOG_TAIL_MAX).contains(&n) => tail = Some(n),
            _ => {
                return Err(format!(
                    "tail {value:?} is not a number of lines from 1 to {LOG_TAIL_MAX}"
                ));
            }
        }
    }
    Ok(tail.unwrap_or(LOG_TAIL_DEFAULT))
}

/// The last `lines` lines of `text` (a last line without its newline counts).
pub fn last_lines(text: &[u8], lines: usize) -> &[u8] {
    let body = text.strip_suffix(b"\n").unwrap_or(text);
    let mut seen = 0;
    for (i, b) in body.iter().enumerate().rev() {
        if *b == b'\n' {
            seen += 1;
            if seen == lines {
                return &text[i + 1..];
            }
        }
    }
    text
}

/// A volume dataset, as `GET /volumes` and `GET /volumes/{name}` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeStatus {
    /// Volume name (`{pool}/keel/volumes/{name}`).
    pub name: String,
    /// The dataset; `None` when the node holding it could not be asked.
    pub dataset: Option<String>,
    /// The node that holds it (through the control plane; `None` from an
    /// agent, which speaks only for itself).
    #[serde(default)]
    pub node: Option<String>,
    /// Quota in bytes, `None` when unlimited or unknown.
    pub quota: Option<u64>,
    /// Bytes used, `None` when unknown (its node is Dead or unreachable).
    pub used: Option<u64>,
    /// The jail it is nullfs-mounted into (or the mount point, when that is
    /// not a Keel jail's), `None` when not mounted.
    pub mounted_by: Option<String>,
    /// Why the other fields are unknown (through the control plane only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The control plane could not ask its node (Dead, or no answer): the
    /// entry is the registry's, not the node's (through the control plane
    /// only; `error` says why).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unreachable: bool,
}

/// Where an Ingress stands, as `GET /ingresses` and `GET /ingresses/{name}`
/// show it (never a secret: no key, no credential).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum IngressPhase {
    /// nginx serves the host with a valid certificate.
    Serving,
    /// Waiting for a first certificate (an order is running or queued).
    Issuing,
    /// The last issuance failed; it is retried after a backoff. A previous
    /// certificate, if any, keeps serving.
    BackingOff,
    /// The backend Service is unknown on this node (no VIP yet): the host is
    /// left out of nginx until it appears.
    NoService,
    /// nginx refused the configuration with this host, or it could not be
    /// loaded; the hosts that already worked keep serving.
    Failed,
}

impl fmt::Display for IngressPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IngressPhase::Serving => "Serving",
            IngressPhase::Issuing => "Issuing",
            IngressPhase::BackingOff => "BackingOff",
            IngressPhase::NoService => "NoService",
            IngressPhase::Failed => "Failed",
        })
    }
}

/// An Ingress on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IngressStatus {
    /// The Ingress's name.
    pub name: String,
    /// The public host (the certificate's name).
    pub host: String,
    /// The backend Service.
    pub service: String,
    /// Where it stands.
    pub phase: IngressPhase,
    /// The installed certificate's expiry, Unix seconds; `None` before the
    /// first one.
    pub certificate_expires: Option<i64>,
    /// The last problem (issuance, nginx, unknown Service), for the admin.
    pub last_error: Option<String>,
}

/// What deleting a node forgot, as `DELETE /nodes/{id}` answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRemoval {
    /// The node deleted.
    pub deleted: String,
    /// Jails that were placed on it (service replicas among them are placed
    /// again by the next heartbeat's healing).
    pub jails: Vec<String>,
    /// Volumes registered on it: their data stays on that host, the cluster
    /// no longer pins anything to it.
    pub volumes: Vec<String>,
}

/// Where one base stands on a node (`GET /bases`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BaseState {
    /// Extracted and snapshotted (`@keel`): jails can be cloned from it.
    Ready,
    /// A fetch is downloading (or checking the cached copy of) `base.txz`.
    Downloading,
    /// A fetch is extracting the verified `base.txz` into the dataset.
    Extracting,
    /// The dataset exists without its snapshot: an extraction was cut
    /// short (the agent stopped). The next fetch destroys and redoes it.
    Partial,
    /// The last fetch failed (`error` says why); nothing of it is left
    /// but what `Partial` would show.
    Failed,
}

impl fmt::Display for BaseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BaseState::Ready => "Ready",
            BaseState::Downloading => "Downloading",
            BaseState::Extracting => "Extracting",
            BaseState::Partial => "Partial",
            BaseState::Failed => "Failed",
        })
    }
}

/// One base on a node, as `GET /bases` and `GET /bases/{release}` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseStatus {
    /// The release (`{pool}/keel/bases/{release}`).
    pub release: String,
    /// Where it stands.
    pub state: BaseState,
    /// Bytes its dataset uses, `None` while it has no dataset.
    pub used: Option<u64>,
    /// True when `@keel` exists.
    pub snapshot: bool,
    /// Bytes of `base.txz` downloaded so far (while fetching).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downloaded: Option<u64>,
    /// Size of `base.txz` when the mirror said it (while fetching).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
    /// The URL `base.txz` comes from (while fetching, and after a failure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Why the last fetch failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What an [`Event`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ObjectKind {
    /// A jail (on an agent, or placed by the control plane).
    Jail,
    /// A Service (control plane).
    Service,
    /// A node of the cluster.
    Node,
    /// A volume.
    Volume,
    /// An Ingress.
    Ingress,
}

impl ObjectKind {
    /// Every kind, in the order `--for` lists them.
    pub const ALL: [ObjectKind; 5] = [
        ObjectKind::Jail,
        ObjectKind::Service,
        ObjectKind::Node,
        ObjectKind::Volume,
        ObjectKind::Ingress,
    ];
}

impl fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ObjectKind::Jail => "jail",
            ObjectKind::Service => "service",
            ObjectKind::Node => "node",
            ObjectKind::Volume => "volume",
            ObjectKind::Ingress => "ingress",
        })
    }
}

/// Whether an [`Event`] is routine or needs a look, as kubectl shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventType {
    /// Something went as it should (a start, a placement).
    Normal,
    /// Something went wrong or was lost (an exit, a dead node).
    Warning,
}

impl fmt::Display for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        })
    }
}

/// One thing a daemon did or saw, as `GET /events` answers it
/// (`common::events` keeps them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Numbered by the daemon that recorded it, one up per event, and kept
    /// across its restarts: `GET /events?after=SEQ` answers the newer ones.
    pub seq: u64,
    /// When (Unix seconds).
    pub time_unix: u64,
    /// What it is about.
    pub kind: ObjectKind,
    /// The object's name.
    pub name: String,
    /// A short CamelCase word (Started, Exited, NodeDead, Rescheduled, ...).
    pub reason: String,
    /// For people; an exit names its status when known.
    pub message: String,
    /// The node it happened on or is about; empty when none (a Service).
    pub node: String,
    /// Normal or Warning.
    #[serde(rename = "type")]
    pub event_type: EventType,
    /// Which daemon recorded it: `controlplane`, or the node id of the agent
    /// the control plane had it from; absent in an agent's own answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// A node whose events the control plane could not have.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnreachedNode {
    /// The node id.
    pub node: String,
    /// Why (Dead, or what its agent answered).
    pub error: String,
}

/// The answer of `GET /events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventsAnswer {
    /// The events asked for, oldest first.
    pub events: Vec<Event>,
    /// The newest sequence number the answering daemon handed out: the next
    /// `after` of a watch.
    pub last_seq: u64,
    /// Through the control plane: the nodes whose events are missing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreached: Vec<UnreachedNode>,
    /// Through the control plane: for each node asked, the newest number of
    /// its ring, the `nodes=` cursor of a watch's next request (agents
    /// number their own events, so one `after` cannot cover them).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub node_seqs: std::collections::BTreeMap<String, u64>,
}

/// Longest wait of `GET /events?wait=1` for a newer event before the daemon
/// answers with none; keelctl's read timeout on that request is longer.
pub const EVENTS_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

#[cfg(test)]
mod volume_query_tests {
    use super::*;

    #[test]
    fn log_tails_take_the_last_lines() {
        assert_eq!(parse_tail_query(None), Ok(LOG_TAIL_DEFAULT));
        assert_eq!(parse_tail_query(Some("tail=3")), Ok(3));
        for bad in ["tail=0", "tail=-1", "tail=x", "tail=10001", "tail=1&tail=2"] {
            assert!(parse_tail_query(Some(bad)).is_err(), "{bad}");
        }
        assert!(parse_tail_query(Some("tail=x")).is_err_and(|e| e.contains("tail")));
        let text = b"one\ntwo\nthree\n";
        assert_eq!(last_lines(text, 1), b"three\n");
        assert_eq!(last_lines(text, 2), b"two\nthree\n");
        assert_eq!(last_lines(text, 5), text);
        assert_eq!(last_lines(b"one\ntwo", 1), b"two");
        assert_eq!(last_lines(b"", 3), b"");
    }

    #[test]
    fn committed_resources_round_trip_and_garbage_is_none() {
        let r = Resources {
            cpu: 1.25,
            memory: 536_870_912,
        };
        assert_eq!(parse_committed(&format_committed(&r)), Some(r));
        for bad in ["", "1.5", "x 1", "1 -1", "NaN 1", "-1 1", "inf 1"] {
            assert_eq!(parse_committed(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_volumes_query_round_trips_and_refuses_bad_names() {
        let names = vec!["pg".to_string(), "logs".to_string()];
        let q = volumes_query(&names).expect("some");
        assert_eq!(q, "volumes=pg,logs");
        assert_eq!(
            parse_volumes_query(Some(&q)),
            Ok(Some(vec!["logs".to_string(), "pg".to_string()]))
        );
        assert_eq!(volumes_query(&[]), None);
        assert_eq!(parse_volumes_query(None), Ok(None));
        assert_eq!(parse_volumes_query(Some("dry=1")), Ok(None));
        assert_eq!(parse_volumes_query(Some("volumes=")), Ok(Some(vec![])));
        assert!(parse_volumes_query(Some("volumes=../x")).is_err());
        assert!(parse_volumes_query(Some("volumes=a&volumes=b")).is_err());
    }
}

/// `GET /jails/{name}/document`, `/services/{name}/document` and
/// `/ingresses/{name}/document`: the document the object was last applied
/// with, as YAML, so `keelctl get ... -o yaml` prints something `apply`
/// takes back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedDocument {
    /// A whole `kind: ...` document.
    pub document: String,
}

/// `GET /version` of both daemons: which program answered and its version,
/// for `keelctl version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionInfo {
    /// `keel-agentd` or `keel-controlplane`.
    pub program: String,
    /// The package version it was built from.
    pub version: String,
}

impl VersionInfo {
    /// This build's, for `program`.
    pub fn of(program: &str) -> VersionInfo {
        VersionInfo {
            program: program.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}
/// How one field of an object differs between what the daemon holds and
/// what a dry run or diff was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChangeKind {
    /// Only the new document has it (`+`).
    Added,
    /// Only the held document has it (`-`).
    Removed,
    /// Both have it, with different values (`~`).
    Changed,
}

/// One field that differs; see [`crate::common::objdiff`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FieldChange {
    /// Dotted path, with `[i]` for list items that are objects
    /// (`spec.exec.start`, `spec.volumes[0].size`).
    pub path: String,
    /// Added, removed or changed.
    pub kind: ChangeKind,
    /// The held value (absent when added).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old: Option<serde_json::Value>,
    /// The new value (absent when removed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new: Option<serde_json::Value>,
}

/// What an apply of the object would do, as the reconciler decides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DryRunAction {
    /// Nothing: the spec and the host already match.
    Nothing,
    /// A new object (for a jail: provisioned and started).
    Create,
    /// The jail is recorded but not on the host (or its workload is gone):
    /// it would be provisioned or restarted.
    Start,
    /// The record changes, the running jail is left alone (a new probe).
    UpdateRecord,
    /// Limits (rctl) and/or volume quotas change in place; no restart.
    UpdateInPlace,
    /// The running jail is removed and created again from the new spec.
    Replace,
}

/// One command a dry run recorded, in the order the apply would run it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedCommand {
    /// The exact argv.
    pub argv: Vec<String>,
    /// False for observation (jls, ps, zfs list, mount -p, ifconfig -l, ...):
    /// it reads the host and would change nothing.
    pub changes_host: bool,
}

/// The answer of a dry run (`POST /jails/{name}/dry-run`) or a diff.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DryRunReport {
    /// `Jail` or `Service`.
    pub kind: String,
    /// The object's name.
    pub name: String,
    /// The node that would run it (through the control plane).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Every field that differs from what the daemon holds (all of them
    /// for a new object).
    pub changes: Vec<FieldChange>,
    /// What the apply would do.
    pub action: DryRunAction,
    /// The fields that decide `action` (for a replace, what cannot change
    /// in place).
    #[serde(default)]
    pub because: Vec<String>,
    /// The host commands, in order; empty for a diff.
    #[serde(default)]
    pub commands: Vec<PlannedCommand>,
    /// Where the command sequence stops short: a step the modelled host
    /// refused (the real apply would fail there too), or why no commands
    /// are listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}
#[cfg(test)]
mod phase_tests {
    use super::*;

    #[test]
    fn a_phase_from_a_newer_daemon_reads_as_unknown_and_known_ones_round_trip() {
        let read: Vec<Phase> =
            serde_json::from_str(r#"["Starting","Restarting","Running","Hibernating"]"#)
                .expect("decodes");
        assert_eq!(
            read,
            [
                Phase::Starting,
                Phase::Restarting,
                Phase::Running,
                Phase::Unknown
            ]
        );
        assert_eq!(
            serde_json::to_string(&Phase::Restarting).expect("encodes"),
            r#""Restarting""#
        );
    }
}
