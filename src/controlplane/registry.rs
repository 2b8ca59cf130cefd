//! The cluster model the worker thread owns: registered nodes and their
//! liveness, placements, and applies in flight.
//!
//! Liveness is computed on read from the last heartbeat (Alive while younger
//! than `dead_after`); nothing sweeps in the background. Every method that
//! changes persisted state returns the [`Op`]s it applied, for the worker to
//! journal before answering.
//!
//! Applies in flight: a scheduled apply is resolved here (a read), forwarded by
//! a handler thread, and recorded only when the node answered success. While
//! it is in flight the name is *pending* on its chosen node, so a second apply
//! of the same name resolves to the same node and epoch instead of racing to
//! another one, and a heartbeat from that node does not fence the jail the
//! node has just created but the control plane has not recorded yet.
//!
//! Peer list versions: a heartbeat answer carries every other node, which is
//! what an agent routes by, and at 5,000 nodes heartbeating every 5 s
//! rebuilding and encoding it on every heartbeat cost more than a core. The
//! list changes only when a node's record changes or a node comes alive or
//! dies, so it gets a version ([`Cluster::peers_version`]) and an agent that
//! already holds the current one is answered "unchanged". Deaths are noticed
//! on read like everything else: nodes believed Alive are kept ordered by
//! last heartbeat, so each read pops the ones that have gone silent since
//! without scanning the cluster.
//!
//! A full list is still due on an agent's first heartbeat and after every
//! change, so it must be cheap: each node's peer entry is kept encoded
//! (re-encoded only when that node changes), joined once per version into a
//! [`PeerListJson`] the handler threads share, and spliced into each answer
//! leaving out the asking node. Encoding 5,000 peers per answer on the
//! worker thread took longer than `dead_after` for 5,000 first heartbeats,
//! so nodes died, the version changed, and every node needed the list again.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::cidr::{Ipv4Net, derive_pod_cidr, derive_service_vip};
use crate::common::wire::{
    HeartbeatRequest, HeartbeatResponse, Liveness, NodeRemoval, NodeStatus, Peer, RegisterRequest,
    ReplicaStatus, Resources, ServiceApply, ServiceEndpoints, ServiceStatus,
};
use crate::controlplane::scheduler::{Candidate, pick_node_spread};
use crate::controlplane::state::{ClusterState, NodeRecord, Op, Placement, ServiceRecord};

/// A request the cluster refuses, with its HTTP status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// 400, 404, 409, 503 ...
    pub status: u16,
    /// One line a human can act on.
    pub message: String,
    /// The offending field, when there is one.
    pub field: Option<String>,
}

impl Refusal {
    fn new(status: u16, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            message: message.into(),
            field: None,
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Where a request for a jail goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Node id.
    pub node: String,
    /// Its agent's TCP listener.
    pub addr: SocketAddr,
    /// The placement epoch to send with an apply.
    pub epoch: u64,
}

#[derive(Debug, Clone, Default)]
struct Live {
    last_heartbeat: Option<Instant>,
    committed: Resources,
    jails: u32,
    /// Placed jails as the node last reported them: running, address.
    reported: BTreeMap<String, (bool, Option<Ipv4Addr>)>,
    /// The headroom the node is ranked under in `Cluster::ranked`, while Alive.
    rank: Option<Rank>,
}

/// A node's headroom as the scheduler orders it: most first, NaN where
/// [`crate::controlplane::scheduler::pick_node`]'s `total_cmp` puts it, so
/// the first ranked node is the one `pick_node` would pick.
#[derive(Debug, Clone, Copy)]
struct Rank(f64);

impl PartialEq for Rank {
    fn eq(&self, other: &Rank) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Rank {}

impl PartialOrd for Rank {
    fn partial_cmp(&self, other: &Rank) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Rank {
    fn cmp(&self, other: &Rank) -> std::cmp::Ordering {
        other.0.total_cmp(&self.0)
    }
}

/// One step of bringing a service to its desired replicas, carried out by a
/// handler thread (forwarding never runs on the worker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealAction {
    /// Apply replica `replica` of `service` on `target` (an apply in flight:
    /// end it with [`Cluster::finish_apply`]).
    Place {
        /// Service name.
        service: String,
        /// `{service}-{index}`.
        replica: String,
        /// Where, with its new epoch.
        target: Target,
        /// The replica's volumes (`{replica}-{volume}`), sent along as
        /// `?volumes=` for the agent to confirm.
        volumes: Vec<String>,
    },
    /// Delete a replica beyond the desired count (or of a deleted service).
    Remove {
        /// Service name.
        service: String,
        /// `{service}-{index}`.
        replica: String,
        /// Node holding it.
        node: String,
        /// Its agent, when the node is Alive; a Dead node's copy is fenced
        /// when it comes back, since its placement is gone.
        addr: Option<SocketAddr>,
    },
}

#[derive(Debug, Clone)]
struct Pending {
    node: String,
    epoch: u64,
    /// Applies of this name in flight (released when the last one ends).
    count: u32,
    /// Volumes the applies in flight declare, registered on `node` when one
    /// of them reached it.
    volumes: Vec<String>,
}

/// See the module docs.
#[derive(Debug)]
pub struct Cluster {
    /// When this control plane started: a node not heard from since is
    /// Dead without evidence until `dead_after` has passed.
    started: Instant,
    state: ClusterState,
    live: BTreeMap<String, Live>,
    pending: BTreeMap<String, Pending>,
    /// Services whose heal is being carried out by a handler thread.
    healing: BTreeSet<String>,
    cluster_cidr: Ipv4Net,
    service_cidr: Ipv4Net,
    dead_after: Duration,
    /// Nodes Alive at the last read, oldest heartbeat first.
    alive: BTreeSet<(Instant, String)>,
    peers_version: u64,
    /// Each node's [`Peer`] entry, encoded.
    entries: BTreeMap<String, Vec<u8>>,
    /// The entries joined, for the current version, once asked for.
    peer_list: Option<Arc<PeerListJson>>,
    /// The nodes in `alive`, most headroom first and ties by id: the
    /// scheduled route's pick is the first one, without visiting 5,000 nodes.
    ranked: BTreeSet<(Rank, String)>,
}

/// Every node's peer entry as JSON for one peer list version, shared with
/// the handler threads; see the module docs.
#[derive(Debug)]
pub struct PeerListJson {
    /// Entries joined by commas, without brackets.
    bytes: Vec<u8>,
    /// Node id and the byte range of its entry, in id order.
    index: Vec<(String, Range<usize>)>,
}

impl PeerListJson {
    /// The JSON array of every entry but `except`'s.
    pub fn array_without(&self, except: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.bytes.len() + 2);
        out.push(b'[');
        match self
            .index
            .binary_search_by(|(id, _)| id.as_str().cmp(except))
        {
            Err(_) => out.extend_from_slice(&self.bytes),
            Ok(i) => {
                let range = &self.index[i].1;
                let (before, after) = (&self.bytes[..range.start], &self.bytes[range.end..]);
                // Drop the entry and the comma that joined it to a neighbour.
                match before.strip_suffix(b",") {
                    Some(before) => {
                        out.extend_from_slice(before);
                        out.extend_from_slice(after);
                    }
                    None => out.extend_from_slice(after.strip_prefix(b",").unwrap_or(after)),
                }
            }
        }
        out.push(b']');
        out
    }
}

/// A heartbeat answer as the worker gives it: the response with its `peers`
/// left empty, and the list to splice in on the handler thread.
#[derive(Debug)]
pub struct HeartbeatAnswer {
    /// `stale`, `services`, the peer list version; `peers` is empty.
    pub response: HeartbeatResponse,
    /// Every node's entry, unless the agent's list is current.
    pub peers: Option<Arc<PeerListJson>>,
}

impl HeartbeatAnswer {
    /// The JSON body for node `node_id`: [`HeartbeatAnswer::response`] with
    /// every peer but the node itself.
    pub fn body(&self, node_id: &str) -> Result<Vec<u8>, serde_json::Error> {
        // `peers` is HeartbeatResponse's first field: empty, it encodes as
        // this prefix, which is replaced by the list.
        const EMPTY: &[u8] = br#"{"peers":[]"#;
        let plain = serde_json::to_vec(&self.response)?;
        let Some(list) = &self.peers else {
            return Ok(plain);
        };
        let Some(rest) = plain.strip_prefix(EMPTY) else {
            return Err(serde::ser::Error::custom(
                "the heartbeat answer does not start with its peer list",
            ));
        };
        let peers = list.array_without(node_id);
        let mut out = Vec::with_capacity(peers.len() + plain.len());
        out.extend_from_slice(br#"{"peers":"#);
        out.extend_from_slice(&peers);
        out.extend_from_slice(rest);
        Ok(out)
    }
}

/// Peer list versions stay below 2^53 so any JSON reader holds them exactly.
const PEERS_VERSION_MASK: u64 = (1 << 53) - 1;

impl Cluster {
    /// A cluster from persisted state: every node Dead until it heartbeats.
    pub fn new(
        state: ClusterState,
        cluster_cidr: Ipv4Net,
        service_cidr: Ipv4Net,
        dead_after: Duration,
    ) -> Cluster {
        let mut cluster = Cluster {
            state,
            live: BTreeMap::new(),
            pending: BTreeMap::new(),
            healing: BTreeSet::new(),
            cluster_cidr,
            service_cidr,
            dead_after,
            alive: BTreeSet::new(),
            peers_version: first_peers_version(),
            entries: BTreeMap::new(),
            peer_list: None,
            ranked: BTreeSet::new(),
            started: Instant::now(),
        };
        cluster.encode_every_peer(cluster.started);
        cluster
    }

    /// The version of the peer list as of the last read; see the module docs.
    pub fn peers_version(&self) -> u64 {
        self.peers_version
    }

    fn bump_peers_version(&mut self) {
        self.peers_version = (self.peers_version + 1) & PEERS_VERSION_MASK;
        self.peer_list = None;
    }

    /// `id`'s record or liveness changed: re-encode its entry, new version.
    fn peer_changed(&mut self, id: &str, now: Instant) {
        match self.encode_peer(id, now) {
            Some(entry) => self.entries.insert(id.to_string(), entry),
            None => self.entries.remove(id),
        };
        self.bump_peers_version();
    }

    /// `id`'s entry; `None` for an unknown node or one without an IPv4
    /// advertise address (nothing can be routed via it).
    fn encode_peer(&self, id: &str, now: Instant) -> Option<Vec<u8>> {
        let n = self.state.nodes.get(id)?;
        let IpAddr::V4(address) = n.advertise.ip() else {
            return None;
        };
        let peer = Peer {
            node_id: id.to_string(),
            address,
            pod_cidr: n.pod_cidr.to_string(),
            alive: self.liveness(id, now) == Some(Liveness::Alive),
        };
        // A struct of strings, an address and a bool always encodes.
        serde_json::to_vec(&peer).ok()
    }

    fn encode_every_peer(&mut self, now: Instant) {
        self.entries = self
            .state
            .nodes
            .keys()
            .filter_map(|id| Some((id.clone(), self.encode_peer(id, now)?)))
            .collect();
        self.bump_peers_version();
    }

    /// Every entry joined, for the current version.
    fn peer_list(&mut self) -> Arc<PeerListJson> {
        if let Some(list) = &self.peer_list {
            return Arc::clone(list);
        }
        let size = self.entries.values().map(|e| e.len() + 1).sum();
        let mut bytes = Vec::with_capacity(size);
        let mut index = Vec::with_capacity(self.entries.len());
        for (id, entry) in &self.entries {
            if !bytes.is_empty() {
                bytes.push(b',');
            }
            index.push((id.clone(), bytes.len()..bytes.len() + entry.len()));
            bytes.extend_from_slice(entry);
        }
        let list = Arc::new(PeerListJson { bytes, index });
        self.peer_list = Some(Arc::clone(&list));
        list
    }

    /// Forgets, from the Alive order, nodes silent for `dead_after` at `now`:
    /// each one changes the peer list.
    fn notice_deaths(&mut self, now: Instant) {
        while let Some((t, _)) = self.alive.first() {
            if now.saturating_duration_since(*t) < self.dead_after {
                break;
            }
            if let Some((_, id)) = self.alive.pop_first() {
                self.rank(&id, false);
                self.peer_changed(&id, now);
            }
        }
    }

    /// Records that `id` was heard from at `now`.
    fn heard_from(&mut self, id: &str, now: Instant) {
        self.notice_deaths(now);
        let live = self.live.entry(id.to_string()).or_default();
        let was_alive = match live.last_heartbeat.replace(now) {
            Some(t) => self.alive.remove(&(t, id.to_string())),
            None => false,
        };
        self.alive.insert((now, id.to_string()));
        self.rank(id, true);
        if !was_alive {
            self.peer_changed(id, now);
        }
    }

    /// Puts `id` in `ranked` under its current headroom (`alive`), or takes
    /// it out (also while cordoned). Called whenever its liveness, capacity,
    /// committed resources or cordon change.
    fn rank(&mut self, id: &str, alive: bool) {
        let capacity = self
            .state
            .nodes
            .get(id)
            .filter(|n| !n.cordoned)
            .map(|n| n.capacity);
        let Some(live) = self.live.get_mut(id) else {
            return;
        };
        if let Some(old) = live.rank.take() {
            self.ranked.remove(&(old, id.to_string()));
        }
        if let (true, Some(capacity)) = (alive, capacity) {
            let headroom = Candidate {
                node_id: id,
                capacity,
                committed: live.committed,
            }
            .headroom();
            live.rank = Some(Rank(headroom));
            self.ranked.insert((Rank(headroom), id.to_string()));
        }
    }

    /// The scheduled route's pick at `now`: the same node as
    /// `pick_node(&self.candidates(now))`, found in O(log n).
    fn scheduled_pick(&mut self, now: Instant) -> Option<String> {
        self.notice_deaths(now);
        self.ranked.first().map(|(_, id)| id.clone())
    }

    /// The persisted part.
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// Replaces the persisted part (after a failed journal write, with what is
    /// on disk); applies in flight are forgotten.
    pub fn reset(&mut self, state: ClusterState) {
        self.state = state;
        self.pending.clear();
        self.encode_every_peer(Instant::now());
        // Nodes the restored records lack must not be picked.
        let alive: Vec<String> = self.alive.iter().map(|(_, id)| id.clone()).collect();
        for id in alive {
            let known = self.state.nodes.contains_key(&id);
            self.rank(&id, known);
        }
        self.healing.clear();
    }

    fn apply(&mut self, ops: Vec<Op>) -> Vec<Op> {
        use crate::common::journal::Replay;
        for op in &ops {
            self.state.replay(op);
        }
        ops
    }

    /// Liveness of `id` at `now`, `None` when unknown.
    pub fn liveness(&self, id: &str, now: Instant) -> Option<Liveness> {
        self.state.nodes.get(id)?;
        let alive = self.live.get(id).is_some_and(|l| self.is_alive(l, now));
        Some(if alive {
            Liveness::Alive
        } else {
            Liveness::Dead
        })
    }

    fn is_alive(&self, live: &Live, now: Instant) -> bool {
        live.last_heartbeat
            .is_some_and(|t| now.saturating_duration_since(t) < self.dead_after)
    }

    /// Registers (or re-registers) a node; its pod_cidr never changes.
    pub fn register(
        &mut self,
        req: &RegisterRequest,
        now: Instant,
    ) -> Result<(Ipv4Net, Vec<Op>), Refusal> {
        crate::common::names::validate_name(&req.node_id).map_err(|why| Refusal {
            status: 400,
            message: format!("node_id {:?}: {why}", req.node_id),
            field: Some("node_id".into()),
        })?;
        if !matches!(req.advertise_addr.ip(), IpAddr::V4(_)) {
            return Err(Refusal {
                status: 400,
                message: "advertise_addr must be an IPv4 address: node subnets are routed via it"
                    .into(),
                field: Some("advertise_addr".into()),
            });
        }
        let pod_cidr = match self.state.nodes.get(&req.node_id) {
            Some(existing) => existing.pod_cidr,
            None => {
                let taken: BTreeSet<Ipv4Net> =
                    self.state.nodes.values().map(|n| n.pod_cidr).collect();
                derive_pod_cidr(&req.node_id, self.cluster_cidr, &taken)
                    .map_err(|e| Refusal::new(503, e.to_string()))?
            }
        };
        let record = NodeRecord {
            advertise: req.advertise_addr,
            capacity: req.capacity,
            pod_cidr,
            // A restarted agent does not undo the operator's cordon.
            cordoned: self
                .state
                .nodes
                .get(&req.node_id)
                .is_some_and(|n| n.cordoned),
        };
        let changed = self.state.nodes.get(&req.node_id) != Some(&record);
        let ops = if changed {
            self.apply(vec![Op::PutNode {
                id: req.node_id.clone(),
                record,
            }])
        } else {
            Vec::new()
        };
        // Registering is talking to us: the node is Alive from now.
        self.heard_from(&req.node_id, now);
        if changed {
            self.peer_changed(&req.node_id, now);
        }
        Ok((pod_cidr, ops))
    }

    /// Records a heartbeat and answers with peers and the placed jails the
    /// node holds that are no longer placed on it.
    pub fn heartbeat(
        &mut self,
        id: &str,
        req: &HeartbeatRequest,
        now: Instant,
    ) -> Result<HeartbeatAnswer, Refusal> {
        if !self.state.nodes.contains_key(id) {
            return Err(Refusal::new(
                404,
                format!("node {id} is not registered; register first"),
            ));
        }
        let live = self.live.entry(id.to_string()).or_default();
        live.committed = req.committed;
        live.jails = req.jails;
        live.reported = req
            .placed
            .iter()
            .map(|j| (j.name.clone(), (j.running, j.address)))
            .collect();
        // After the committed resources, so the node is ranked by them.
        self.heard_from(id, now);
        let stale = req
            .placed
            .iter()
            .filter(|j| !self.holds(id, &j.name, j.epoch))
            .map(|j| j.name.clone())
            .collect();
        let unchanged = req.peers_version == Some(self.peers_version);
        Ok(HeartbeatAnswer {
            response: HeartbeatResponse {
                peers: Vec::new(),
                stale,
                services: self.endpoints(now),
                peers_version: Some(self.peers_version),
                peers_unchanged: unchanged,
            },
            peers: (!unchanged).then(|| self.peer_list()),
        })
    }

    /// True when `node` may keep jail `name` placed under `epoch`: it is the
    /// recorded placement, or an apply of it to that node is in flight.
    fn holds(&self, node: &str, name: &str, epoch: u64) -> bool {
        let placed = self
            .state
            .placements
            .get(name)
            .is_some_and(|p| p.node == node && p.epoch == epoch);
        let pending = self
            .pending
            .get(name)
            .is_some_and(|p| p.node == node && p.epoch == epoch);
        placed || pending
    }

    /// `GET /nodes`.
    pub fn node_statuses(&self, now: Instant) -> Vec<NodeStatus> {
        self.state
            .nodes
            .iter()
            .map(|(id, n)| {
                let live = self.live.get(id).cloned().unwrap_or_default();
                NodeStatus {
                    node_id: id.clone(),
                    status: self.liveness(id, now).unwrap_or(Liveness::Dead),
                    address: n.advertise,
                    pod_cidr: n.pod_cidr.to_string(),
                    capacity: n.capacity,
                    committed: live.committed,
                    jails: live.jails,
                    last_seen_secs: live
                        .last_heartbeat
                        .map(|t| now.saturating_duration_since(t).as_secs()),
                    cordoned: n.cordoned,
                }
            })
            .collect()
    }

    /// The address of an Alive node: unknown is 404, Dead is 503. No network.
    pub fn resolve_node(&self, id: &str, now: Instant) -> Result<SocketAddr, Refusal> {
        match self.liveness(id, now) {
            None => Err(Refusal::new(404, format!("no node named {id}"))),
            Some(Liveness::Dead) => Err(Refusal::new(
                503,
                format!(
                    "node {id} is Dead (no heartbeat for {}s or more); nothing was sent to it",
                    self.dead_after.as_secs()
                ),
            )),
            Some(Liveness::Alive) => Ok(self.state.nodes[id].advertise),
        }
    }

    /// Alive nodes as scheduler candidates. One ordered walk over the
    /// records and the live data together (same keys, same order): looking
    /// each node up instead cost about 2 ms per apply at 5,000 nodes.
    fn candidates(&self, now: Instant) -> Vec<Candidate<'_>> {
        let mut live = self.live.iter().peekable();
        self.state
            .nodes
            .iter()
            .filter_map(|(id, n)| {
                while live.next_if(|(l, _)| *l < id).is_some() {}
                let (_, l) = live.next_if(|(l, _)| *l == id)?;
                (self.is_alive(l, now) && !n.cordoned).then_some(Candidate {
                    node_id: id,
                    capacity: n.capacity,
                    committed: l.committed,
                })
            })
            .collect()
    }

    /// Where jail `name` lives, for GET and DELETE: 404 when not placed.
    pub fn resolve_placed(&self, name: &str, now: Instant) -> Result<Target, Refusal> {
        let Some(p) = self.state.placements.get(name) else {
            return Err(Refusal::new(
                404,
                format!("no jail named {name} is placed in the cluster"),
            ));
        };
        let addr = self.resolve_node(&p.node, now)?;
        Ok(Target {
            node: p.node.clone(),
            addr,
            epoch: p.epoch,
        })
    }

    /// Where an apply of `name` goes: sticky to its placement (failing like a
    /// named route when that node is Dead), else the scheduler's pick. Marks
    /// the apply in flight; [`Cluster::finish_apply`] ends it.
    pub fn begin_apply(
        &mut self,
        name: &str,
        node: Option<&str>,
        now: Instant,
    ) -> Result<Target, Refusal> {
        self.begin_apply_with_volumes(name, node, &[], now)
    }

    /// [`Cluster::begin_apply`] for a jail declaring `volumes`: when the
    /// volume registry knows one of them, the apply goes to the node holding
    /// it, whatever the scheduler would pick; that node being Dead is a 503
    /// naming node and volume (an empty volume elsewhere would silently lose
    /// the data), a placement or a named node elsewhere a 409.
    pub fn begin_apply_with_volumes(
        &mut self,
        name: &str,
        node: Option<&str>,
        volumes: &[String],
        now: Instant,
    ) -> Result<Target, Refusal> {
        let placed = self.state.placements.get(name).cloned();
        let pending = self.pending.get(name).cloned();
        let pin = self.volume_home(name, volumes)?;
        if let Some((home, volume)) = &pin {
            let elsewhere = match (&placed, &pending, node) {
                (Some(p), _, _) if &p.node != home => Some(format!("is placed on node {}", p.node)),
                (None, Some(p), _) if &p.node != home => {
                    Some(format!("is being applied to node {}", p.node))
                }
                (_, _, Some(wanted)) if wanted != home => {
                    Some(format!("was asked for on node {wanted}"))
                }
                _ => None,
            };
            if let Some(elsewhere) = elsewhere {
                return Err(Refusal {
                    status: 409,
                    message: format!(
                        "jail {name} {elsewhere}, but its volume {volume} is on node {home}; apply it to {home} (or delete the volume with `keelctl delete-volume {volume}`)"
                    ),
                    field: Some("spec.volumes".into()),
                });
            }
            if self.liveness(home, now) != Some(Liveness::Alive) {
                return Err(Refusal::new(
                    503,
                    format!(
                        "node {home} holds volume {volume} of jail {name} and is Dead; the jail was not placed elsewhere, where the volume would be empty: bring {home}'s keel-agentd back"
                    ),
                ));
            }
        }
        let (node_id, epoch) = match (placed, pending, node) {
            (Some(p), _, Some(wanted)) if p.node != wanted => {
                return Err(Refusal::new(
                    409,
                    format!(
                        "jail {name} is placed on node {}; delete it there before applying it to {wanted}",
                        p.node
                    ),
                ));
            }
            (Some(p), _, _) => (p.node, p.epoch),
            (None, Some(p), Some(wanted)) if p.node != wanted => {
                return Err(Refusal::new(
                    409,
                    format!("an apply of jail {name} to node {} is in progress", p.node),
                ));
            }
            (None, Some(p), _) => (p.node, p.epoch),
            (None, None, Some(wanted)) => (wanted.to_string(), self.next_epoch()),
            (None, None, None) if pin.is_some() => {
                let home = pin.as_ref().map(|(h, _)| h.clone()).unwrap_or_default();
                (home, self.next_epoch())
            }
            (None, None, None) => {
                let picked = self.scheduled_pick(now).ok_or_else(|| {
                    Refusal::new(
                        503,
                        "no Alive node to place the jail on: start keel-agentd on a node, or wait for one to heartbeat",
                    )
                })?;
                (picked, self.next_epoch())
            }
        };
        let addr = self.resolve_node(&node_id, now)?;
        let entry = self.pending.entry(name.to_string()).or_insert(Pending {
            node: node_id.clone(),
            epoch,
            count: 0,
            volumes: Vec::new(),
        });
        entry.count += 1;
        for v in volumes {
            if !entry.volumes.contains(v) {
                entry.volumes.push(v.clone());
            }
        }
        Ok(Target {
            node: node_id,
            addr,
            epoch,
        })
    }

    /// An epoch no placement has had. Pending applies reserve theirs, so two
    /// in flight never share one.
    fn next_epoch(&self) -> u64 {
        let pending_max = self.pending.values().map(|p| p.epoch).max().unwrap_or(0);
        self.state.last_epoch.max(pending_max) + 1
    }

    /// Ends an apply: records the placement when the node answered success.
    pub fn finish_apply(&mut self, name: &str, target: &Target, succeeded: bool) -> Vec<Op> {
        self.finish_apply_reached(name, target, succeeded, succeeded)
    }

    /// [`Cluster::finish_apply`], also registering the apply's volumes on
    /// the target node when `reached`: the node may have created them, which
    /// it may have done even when it then failed (a 500 after the volume was
    /// created, a timeout). Pinning to a node that holds no dataset is
    /// harmless; missing one that does would let a later apply create an
    /// empty volume elsewhere.
    pub fn finish_apply_reached(
        &mut self,
        name: &str,
        target: &Target,
        succeeded: bool,
        reached: bool,
    ) -> Vec<Op> {
        let mut volumes = Vec::new();
        if let Some(p) = self.pending.get_mut(name) {
            if p.node == target.node {
                volumes = p.volumes.clone();
            }
            p.count = p.count.saturating_sub(1);
            if p.count == 0 {
                self.pending.remove(name);
            }
        }
        let mut ops = Vec::new();
        if reached || succeeded {
            for v in volumes {
                if !self.state.volumes.contains_key(&v) {
                    ops.push(Op::PutVolume {
                        name: v,
                        node: target.node.clone(),
                    });
                }
            }
        }
        let ops = self.apply(ops);
        let already = self.state.placements.get(name)
            == Some(&Placement {
                node: target.node.clone(),
                epoch: target.epoch,
            });
        // Recording it again also clears a delete mark: the jail was
        // applied after a DELETE that did not finish.
        if !succeeded || (already && !self.state.deleting.contains(name)) {
            return ops;
        }
        let mut ops = ops;
        ops.extend(self.apply(vec![Op::PutPlacement {
            name: name.to_string(),
            placement: Placement {
                node: target.node.clone(),
                epoch: target.epoch,
            },
        }]));
        ops
    }

    /// The node the registry pins `volumes` to, with the volume that pins
    /// it; 409 when they are on different nodes.
    fn volume_home(
        &self,
        name: &str,
        volumes: &[String],
    ) -> Result<Option<(String, String)>, Refusal> {
        let mut home: Option<(String, String)> = None;
        for v in volumes {
            let Some(node) = self.state.volumes.get(v) else {
                continue;
            };
            match &home {
                Some((n, first)) if n != node => {
                    return Err(Refusal {
                        status: 409,
                        message: format!(
                            "jail {name} declares volume {first} (on node {n}) and volume {v} (on node {node}); a jail's volumes must be on one node"
                        ),
                        field: Some("spec.volumes".into()),
                    });
                }
                Some(_) => {}
                None => home = Some((node.clone(), v.clone())),
            }
        }
        Ok(home)
    }

    /// The volume registry: volume name -> node.
    pub fn volume_registry(&self) -> &BTreeMap<String, String> {
        &self.state.volumes
    }

    /// Where volume `name` is, for `GET/DELETE /volumes/{name}`: 404 when
    /// the registry does not know it, 503 naming the node when it is Dead.
    pub fn resolve_volume(&self, name: &str, now: Instant) -> Result<Target, Refusal> {
        let Some(node) = self.state.volumes.get(name) else {
            return Err(Refusal::new(
                404,
                format!("no volume named {name} is known to the cluster"),
            ));
        };
        if self.liveness(node, now) != Some(Liveness::Alive) {
            return Err(Refusal::new(
                503,
                format!(
                    "node {node} holds volume {name} and is Dead (no heartbeat for {}s or more); nothing was sent to it",
                    self.dead_after.as_secs()
                ),
            ));
        }
        let addr = self.resolve_node(node, now)?;
        Ok(Target {
            node: node.clone(),
            addr,
            epoch: 0,
        })
    }

    /// Forgets volume `name` on `node`, after the node destroyed it or said
    /// it has no such dataset.
    pub fn remove_volume(&mut self, name: &str, node: &str) -> Vec<Op> {
        match self.state.volumes.get(name) {
            Some(n) if n == node => self.apply(vec![Op::RemoveVolume {
                name: name.to_string(),
            }]),
            _ => Vec::new(),
        }
    }

    /// The committed resources node `id` reported in an apply's answer
    /// ([`crate::common::wire::COMMITTED_HEADER`]): the node is ranked by
    /// them at once instead of at its next heartbeat.
    pub fn note_committed(&mut self, id: &str, committed: Resources) {
        let Some(live) = self.live.get_mut(id) else {
            return;
        };
        live.committed = committed;
        let ranked = live.rank.is_some();
        self.rank(id, ranked);
    }

    /// Marks `name` as being deleted on `node`, before the DELETE is
    /// forwarded (persisted with it, so a crash after the node deleted the
    /// jail is recovered by [`Cluster::reap_deleted`]). Nothing when the
    /// name is not placed on `node`.
    pub fn begin_delete(&mut self, name: &str, node: &str) -> Vec<Op> {
        match self.state.placements.get(name) {
            Some(p) if p.node == node && !self.state.deleting.contains(name) => {
                self.apply(vec![Op::MarkDeleting {
                    name: name.to_string(),
                }])
            }
            _ => Vec::new(),
        }
    }

    /// On a heartbeat from `id`: the placements marked deleting on `id` that
    /// the node no longer reports are removed (their DELETE reached the node
    /// and the control plane stopped before it removed them). An apply in
    /// flight for the name keeps it (its heartbeat may predate the apply),
    /// and a finished apply cleared the mark already.
    pub fn reap_deleted(&mut self, id: &str, req: &HeartbeatRequest) -> Vec<Op> {
        if self.state.deleting.is_empty() {
            return Vec::new();
        }
        let reported: BTreeSet<&str> = req.placed.iter().map(|j| j.name.as_str()).collect();
        let gone: Vec<Op> = self
            .state
            .deleting
            .iter()
            .filter(|name| {
                self.state
                    .placements
                    .get(*name)
                    .is_some_and(|p| p.node == id)
                    && !reported.contains(name.as_str())
                    && !self.pending.contains_key(*name)
            })
            .map(|name| Op::RemovePlacement { name: name.clone() })
            .collect();
        for op in &gone {
            if let Op::RemovePlacement { name } = op {
                log::info!(
                    "placement of {name} on {id} removed: its delete reached the node, which no longer reports it"
                );
            }
        }
        self.apply(gone)
    }

    /// Cordons node `id` (or lifts it): while cordoned, the scheduled route
    /// and the services' healing place nothing new on it. Jails already there
    /// keep running, a named apply (`--node`) still reaches it, and volumes
    /// registered there still pin their jails to it. 404 for an unknown node.
    pub fn set_cordoned(
        &mut self,
        id: &str,
        cordoned: bool,
        now: Instant,
    ) -> Result<Vec<Op>, Refusal> {
        let Some(record) = self.state.nodes.get(id) else {
            return Err(Refusal::new(404, format!("no node named {id}")));
        };
        if record.cordoned == cordoned {
            return Ok(Vec::new());
        }
        let record = NodeRecord {
            cordoned,
            ..record.clone()
        };
        let ops = self.apply(vec![Op::PutNode {
            id: id.to_string(),
            record,
        }]);
        let alive = self.liveness(id, now) == Some(Liveness::Alive);
        self.rank(id, alive);
        Ok(ops)
    }

    /// Deletes node `id`, which must be Dead: its record, its placements and
    /// the volumes registered on it are forgotten in one journaled op, so
    /// plain jails stop answering 503, service replicas are placed again by
    /// the next heartbeat's healing, and jails declaring its volumes may be
    /// placed elsewhere (with new, empty volumes). Should the host come
    /// back, its agent registers again and fencing removes every jail the
    /// control plane had placed there. An Alive node is refused: it would
    /// only register again at its next heartbeat.
    pub fn remove_node(
        &mut self,
        id: &str,
        now: Instant,
    ) -> Result<(Vec<Op>, NodeRemoval), Refusal> {
        match self.liveness(id, now) {
            None => return Err(Refusal::new(404, format!("no node named {id}"))),
            Some(Liveness::Alive) => {
                return Err(Refusal::new(
                    409,
                    format!(
                        "node {id} is Alive: stop its agent (service keel_agentd stop on that host) \
                         and wait until `keelctl get nodes` shows it Dead, then delete it; a running \
                         node would only register again"
                    ),
                ));
            }
            Some(Liveness::Dead) => {}
        }
        // Right after a restart every node is Dead until it heartbeats: that
        // is no evidence the host is gone, and deleting a running node would
        // have fencing remove all its jails when it registers again.
        let heard = self
            .live
            .get(id)
            .is_some_and(|l| l.last_heartbeat.is_some());
        let up = now.saturating_duration_since(self.started);
        if !heard && up < self.dead_after {
            return Err(Refusal::new(
                409,
                format!(
                    "node {id} has not been heard from since this control plane started {} s ago; \
                     it counts as gone only after {} s of silence: retry in {} s",
                    up.as_secs(),
                    self.dead_after.as_secs(),
                    (self.dead_after - up).as_secs() + 1
                ),
            ));
        }
        let removal = NodeRemoval {
            deleted: id.to_string(),
            jails: self
                .state
                .placements
                .iter()
                .filter(|(_, p)| p.node == id)
                .map(|(name, _)| name.clone())
                .collect(),
            volumes: self
                .state
                .volumes
                .iter()
                .filter(|(_, node)| *node == id)
                .map(|(name, _)| name.clone())
                .collect(),
        };
        let ops = self.apply(vec![Op::RemoveNode { id: id.to_string() }]);
        if let Some(live) = self.live.remove(id) {
            if let Some(t) = live.last_heartbeat {
                self.alive.remove(&(t, id.to_string()));
            }
            if let Some(rank) = live.rank {
                self.ranked.remove(&(rank, id.to_string()));
            }
        }
        self.pending.retain(|_, p| p.node != id);
        self.peer_changed(id, now);
        log::info!(
            "node {id} deleted: forgot {} placements and {} volumes",
            removal.jails.len(),
            removal.volumes.len()
        );
        Ok((ops, removal))
    }

    /// Removes the placement of `name` on `node` (after the node confirmed the
    /// delete, or said it has no such jail).
    pub fn remove_placement(&mut self, name: &str, node: &str) -> Vec<Op> {
        match self.state.placements.get(name) {
            Some(p) if p.node == node => self.apply(vec![Op::RemovePlacement {
                name: name.to_string(),
            }]),
            _ => Vec::new(),
        }
    }
}

/// A random start for the peer list version, so an agent holding a version
/// from before a restart of the control plane never finds it current by
/// chance. Without randomness the clock serves: restarts are seconds apart.
fn first_peers_version() -> u64 {
    let seed = getrandom::u64().unwrap_or_else(|_| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    seed & PEERS_VERSION_MASK
}

/// Services: replica sets behind VIPs, healed on heartbeats.
impl Cluster {
    /// Creates or scales a service. Port and template are immutable (409
    /// naming the field); the VIP is allocated once and kept.
    pub fn put_service(&mut self, name: &str, apply: &ServiceApply) -> Result<Vec<Op>, Refusal> {
        let conflict = |field: &str, what: String| Refusal {
            status: 409,
            message: what,
            field: Some(field.to_string()),
        };
        let vip = match self.state.services.get(name) {
            Some(existing) => {
                if existing.applied.port != apply.port {
                    return Err(conflict(
                        "spec.port",
                        format!(
                            "service {name} has port {}; the port cannot change (delete and re-create the service)",
                            existing.applied.port
                        ),
                    ));
                }
                if existing.applied.template_digest != apply.template_digest {
                    return Err(conflict(
                        "spec.template",
                        format!(
                            "service {name} exists with another template; the template cannot change (delete and re-create the service)"
                        ),
                    ));
                }
                existing.vip
            }
            None => {
                let taken: BTreeSet<Ipv4Addr> =
                    self.state.services.values().map(|s| s.vip).collect();
                derive_service_vip(name, self.service_cidr, &taken)
                    .map_err(|e| conflict("spec", e.to_string()))?
            }
        };
        let record = ServiceRecord {
            applied: apply.clone(),
            vip,
        };
        if self.state.services.get(name) == Some(&record) {
            return Ok(Vec::new());
        }
        Ok(self.apply(vec![Op::PutService {
            name: name.to_string(),
            record,
        }]))
    }

    /// The document of a service, for forwarding replica applies.
    pub fn service_document(&self, name: &str) -> Option<String> {
        self.state
            .services
            .get(name)
            .map(|s| s.applied.document.clone())
    }

    /// Every placed replica of `name` (`{name}-{index}`), with its index.
    fn placed_replicas(&self, name: &str) -> Vec<(u32, String, Placement)> {
        let prefix = format!("{name}-");
        self.state
            .placements
            .range(prefix.clone()..)
            .take_while(|(n, _)| n.starts_with(&prefix))
            .filter_map(|(n, p)| {
                let index = n[prefix.len()..].parse::<u32>().ok()?;
                // `web-01` is not replica 1 of `web`; only canonical indices.
                (index.to_string() == n[prefix.len()..]).then(|| (index, n.clone(), p.clone()))
            })
            .collect()
    }

    /// The replica view both `GET /services/{name}` and the heartbeat's
    /// endpoint lists are built from, so the two can never disagree: a replica
    /// is ready when its node is Alive and reports its workload running.
    fn replica_view(&self, name: &str, now: Instant) -> Vec<ReplicaStatus> {
        self.placed_replicas(name)
            .into_iter()
            .map(|(_, replica, p)| {
                let alive = self.liveness(&p.node, now) == Some(Liveness::Alive);
                let reported = self
                    .live
                    .get(&p.node)
                    .and_then(|l| l.reported.get(&replica))
                    .copied();
                let (state, ready) = match (alive, reported) {
                    (false, _) => ("NodeDead", false),
                    (true, None) => ("Pending", false),
                    (true, Some((true, _))) => ("Running", true),
                    (true, Some((false, _))) => ("NotRunning", false),
                };
                ReplicaStatus {
                    name: replica,
                    node: p.node,
                    address: reported.and_then(|(_, a)| a),
                    state: state.into(),
                    ready: ready && reported.and_then(|(_, a)| a).is_some(),
                }
            })
            .collect()
    }

    /// `GET /services/{name}`.
    pub fn service_status(&self, name: &str, now: Instant) -> Option<ServiceStatus> {
        let rec = self.state.services.get(name)?;
        let replicas = self.replica_view(name, now);
        Some(ServiceStatus {
            name: name.to_string(),
            vip: rec.vip,
            port: rec.applied.port,
            desired: rec.applied.replicas,
            ready: replicas.iter().filter(|r| r.ready).count() as u32,
            stateful: rec.applied.stateful,
            replicas,
        })
    }

    /// `GET /services`.
    pub fn service_statuses(&self, now: Instant) -> Vec<ServiceStatus> {
        self.state
            .services
            .keys()
            .filter_map(|n| self.service_status(n, now))
            .collect()
    }

    /// Every service with its ready replicas' `address:port`, for the proxies.
    pub fn endpoints(&self, now: Instant) -> Vec<ServiceEndpoints> {
        self.state
            .services
            .iter()
            .map(|(name, rec)| ServiceEndpoints {
                name: name.clone(),
                vip: rec.vip,
                port: rec.applied.port,
                replicas: self
                    .replica_view(name, now)
                    .into_iter()
                    .filter(|r| r.ready)
                    .filter_map(|r| r.address.map(|a| SocketAddrV4::new(a, rec.applied.port)))
                    .collect(),
            })
            .collect()
    }

    /// What it takes to bring service `name` to its desired replicas, for
    /// every service not already being healed (all services when `only` is
    /// `None`). Marks them as healing until [`Cluster::heal_done`].
    ///
    /// A replica index counts as present when it is placed on an Alive node,
    /// or, for a stateful service, placed at all: a stateful replica on a Dead
    /// node is neither replaced nor torn down; it waits for its node and its
    /// data. Missing indices are placed with the spreading scheduler; indices
    /// at or beyond the desired count are removed.
    pub fn plan_heal(&mut self, only: Option<&str>, now: Instant) -> Vec<HealAction> {
        let names: Vec<String> = match only {
            Some(n) => vec![n.to_string()],
            None => self.state.services.keys().cloned().collect(),
        };
        let mut actions = Vec::new();
        for name in names {
            if self.healing.contains(&name) {
                continue;
            }
            let Some(rec) = self.state.services.get(&name).cloned() else {
                continue;
            };
            let placed = self.placed_replicas(&name);
            let mut service_actions = Vec::new();
            for (index, replica, p) in &placed {
                if *index >= rec.applied.replicas {
                    let addr = self.resolve_node(&p.node, now).ok();
                    service_actions.push(HealAction::Remove {
                        service: name.clone(),
                        replica: replica.clone(),
                        node: p.node.clone(),
                        addr,
                    });
                }
            }
            let present = |c: &Cluster, p: &Placement| {
                rec.applied.stateful || c.liveness(&p.node, now) == Some(Liveness::Alive)
            };
            let mut occupied: BTreeSet<String> = placed
                .iter()
                .filter(|(i, _, p)| *i < rec.applied.replicas && present(self, p))
                .map(|(_, _, p)| p.node.clone())
                .collect();
            for index in 0..rec.applied.replicas {
                let replica = format!("{name}-{index}");
                let ok = self
                    .state
                    .placements
                    .get(&replica)
                    .is_some_and(|p| present(self, p));
                if ok || self.pending.contains_key(&replica) {
                    continue;
                }
                let replica_volumes: Vec<String> = rec
                    .applied
                    .volumes
                    .iter()
                    .map(|v| format!("{replica}-{v}"))
                    .collect();
                // A replica whose data is on a node (it ran there before a
                // scale-down) goes back there, or waits while it is Dead.
                let node = match self.volume_home(&replica, &replica_volumes) {
                    Ok(Some((home, _))) => {
                        if self.liveness(&home, now) != Some(Liveness::Alive) {
                            continue;
                        }
                        home
                    }
                    Ok(None) => {
                        let avoid: BTreeSet<&str> = occupied.iter().map(String::as_str).collect();
                        let Some(node) =
                            pick_node_spread(&self.candidates(now), &avoid).map(str::to_string)
                        else {
                            break; // no Alive node: the next heartbeat tries again
                        };
                        node
                    }
                    Err(_) => continue,
                };
                let Ok(addr) = self.resolve_node(&node, now) else {
                    continue;
                };
                let epoch = self.next_epoch();
                self.pending.insert(
                    replica.clone(),
                    Pending {
                        node: node.clone(),
                        epoch,
                        count: 1,
                        volumes: replica_volumes.clone(),
                    },
                );
                occupied.insert(node.clone());
                service_actions.push(HealAction::Place {
                    service: name.clone(),
                    replica,
                    target: Target { node, addr, epoch },
                    volumes: replica_volumes.clone(),
                });
            }
            if !service_actions.is_empty() {
                self.healing.insert(name);
                actions.extend(service_actions);
            }
        }
        actions
    }

    /// The heal of these services is over (whatever its outcome).
    pub fn heal_done(&mut self, services: &[String]) {
        for s in services {
            self.healing.remove(s);
        }
    }

    /// Deletes a service: its record and VIP go now; its replicas are
    /// returned as removals for the caller to carry out.
    pub fn remove_service(
        &mut self,
        name: &str,
        now: Instant,
    ) -> Result<(Vec<Op>, Vec<HealAction>), Refusal> {
        if !self.state.services.contains_key(name) {
            return Err(Refusal::new(404, format!("no service named {name}")));
        }
        let removals = self
            .placed_replicas(name)
            .into_iter()
            .map(|(_, replica, p)| HealAction::Remove {
                service: name.to_string(),
                addr: self.resolve_node(&p.node, now).ok(),
                replica,
                node: p.node,
            })
            .collect();
        let ops = self.apply(vec![Op::RemoveService {
            name: name.to_string(),
        }]);
        Ok((ops, removals))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::wire::PlacedJail;
    use crate::controlplane::scheduler::pick_node;
    use proptest::prelude::*;

    const DEAD_AFTER: Duration = Duration::from_secs(15);

    fn cluster() -> Cluster {
        cluster_from(ClusterState::default())
    }

    fn cluster_from(state: ClusterState) -> Cluster {
        Cluster::new(
            state,
            "10.20.0.0/16".parse().expect("cidr"),
            "10.96.0.0/16".parse().expect("cidr"),
            DEAD_AFTER,
        )
    }

    /// A control plane started again over `c`'s persisted state.
    fn restarted(c: &Cluster) -> Cluster {
        cluster_from(c.state().clone())
    }

    fn register(c: &mut Cluster, id: &str, port: u16, now: Instant) -> Ipv4Net {
        c.register(
            &RegisterRequest {
                node_id: id.into(),
                advertise_addr: SocketAddr::from(([127, 0, 0, 1], port)),
                capacity: Resources {
                    cpu: 4.0,
                    memory: 8 << 30,
                },
            },
            now,
        )
        .expect("registers")
        .0
    }

    fn beat(
        c: &mut Cluster,
        id: &str,
        cpu: f64,
        placed: &[(&str, u64)],
        now: Instant,
    ) -> HeartbeatResponse {
        c.heartbeat(
            id,
            &HeartbeatRequest {
                committed: Resources { cpu, memory: 0 },
                ..placed_req(placed)
            },
            now,
        )
        .map(|a| decode(&a, id))
        .expect("heartbeat")
    }

    /// The answer as the agent receives it.
    fn decode(answer: &HeartbeatAnswer, id: &str) -> HeartbeatResponse {
        let body = answer.body(id).expect("encodes");
        serde_json::from_slice(&body).expect("a heartbeat response")
    }

    /// A bare heartbeat from an agent holding peer list `version`.
    fn beat_with(
        c: &mut Cluster,
        id: &str,
        version: Option<u64>,
        now: Instant,
    ) -> HeartbeatResponse {
        c.heartbeat(
            id,
            &HeartbeatRequest {
                committed: Resources::default(),
                jails: 0,
                placed: Vec::new(),
                peers_version: version,
            },
            now,
        )
        .map(|a| decode(&a, id))
        .expect("heartbeat")
    }

    #[test]
    fn a_current_peer_list_is_not_resent() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        let full = beat_with(&mut c, "a", None, t0);
        assert_eq!(full.peers.len(), 1);
        assert!(!full.peers_unchanged);
        let version = full.peers_version;
        assert!(version.is_some());
        // Steady heartbeats change nothing, from either node.
        let t1 = t0 + Duration::from_secs(5);
        beat_with(&mut c, "b", version, t1);
        let same = beat_with(&mut c, "a", version, t1);
        assert!(same.peers_unchanged);
        assert!(same.peers.is_empty());
        assert_eq!(same.peers_version, version);
        // An agent without a version always gets the list.
        let old = beat_with(&mut c, "a", None, t1);
        assert_eq!((old.peers.len(), old.peers_unchanged), (1, false));
        // A stale version gets the list and the current version.
        let stale = beat_with(&mut c, "a", version.map(|v| v ^ 1), t1);
        assert_eq!((stale.peers.len(), stale.peers_unchanged), (1, false));
        assert_eq!(stale.peers_version, version);
    }

    #[test]
    fn the_peer_list_version_changes_when_a_node_joins_dies_or_returns() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        let v0 = beat_with(&mut c, "a", None, t0).peers_version;

        register(&mut c, "c", 3, t0);
        let joined = beat_with(&mut c, "a", v0, t0);
        assert!(!joined.peers_unchanged, "c joined");
        assert_eq!(joined.peers.len(), 2);
        let v1 = joined.peers_version;

        // Re-registering with the same record is not a change.
        register(&mut c, "c", 3, t0);
        assert!(beat_with(&mut c, "a", v1, t0).peers_unchanged);

        // b and c keep heartbeating until c falls silent; only a reports after.
        let t1 = t0 + DEAD_AFTER / 2;
        beat_with(&mut c, "b", v1, t1);
        let t2 = t0 + DEAD_AFTER;
        beat_with(&mut c, "b", v1, t2);
        let died = beat_with(&mut c, "a", v1, t2);
        assert!(!died.peers_unchanged, "c died");
        let c_peer = died
            .peers
            .iter()
            .find(|p| p.node_id == "c")
            .expect("c listed");
        assert!(!c_peer.alive);
        let v2 = died.peers_version;
        assert!(beat_with(&mut c, "a", v2, t2).peers_unchanged);

        let back = beat_with(&mut c, "c", v2, t2);
        assert!(!back.peers_unchanged, "c's own return changes the list too");
        let seen = beat_with(&mut c, "a", v2, t2);
        assert!(!seen.peers_unchanged);
        assert!(seen.peers.iter().all(|p| p.alive));
    }

    #[test]
    fn every_node_gets_every_peer_but_itself() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        let alone = c.heartbeat("a", &placed_req(&[]), t0).expect("heartbeat");
        assert!(decode(&alone, "a").peers.is_empty());
        register(&mut c, "b", 2, t0);
        register(&mut c, "c", 3, t0);
        let answer = c.heartbeat("b", &placed_req(&[]), t0).expect("heartbeat");
        let ids = |who: &str| -> Vec<String> {
            decode(&answer, who)
                .peers
                .into_iter()
                .map(|p| p.node_id)
                .collect()
        };
        // First, middle and last entry left out, and nothing for a stranger.
        assert_eq!(ids("a"), ["b", "c"]);
        assert_eq!(ids("b"), ["a", "c"]);
        assert_eq!(ids("c"), ["a", "b"]);
        assert_eq!(ids("zz"), ["a", "b", "c"]);
        let full = decode(&answer, "a");
        assert_eq!(
            full.peers[1],
            Peer {
                node_id: "c".into(),
                address: std::net::Ipv4Addr::LOCALHOST,
                pod_cidr: c.state().nodes["c"].pod_cidr.to_string(),
                alive: true,
            }
        );
        assert_eq!(full.peers_version, Some(c.peers_version()));
    }

    #[test]
    fn a_changed_advertise_address_is_in_the_next_list() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        let v = beat_with(&mut c, "a", None, t0).peers_version;
        c.register(
            &RegisterRequest {
                node_id: "b".into(),
                advertise_addr: SocketAddr::from(([127, 0, 0, 9], 2)),
                capacity: Resources::default(),
            },
            t0,
        )
        .expect("re-registers");
        let resp = beat_with(&mut c, "a", v, t0);
        assert!(!resp.peers_unchanged);
        assert_eq!(resp.peers[0].address, std::net::Ipv4Addr::new(127, 0, 0, 9));
    }

    #[test]
    fn a_restarted_control_plane_does_not_take_an_old_version_for_current() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        let old = beat_with(&mut c, "a", None, t0).peers_version;
        let mut restarted = restarted(&c);
        register(&mut restarted, "a", 1, t0);
        let resp = beat_with(&mut restarted, "a", old, t0);
        assert!(!resp.peers_unchanged);
        assert_eq!(resp.peers.len(), 1);
    }

    #[test]
    fn liveness_boundaries() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        assert_eq!(
            c.liveness("a", t0 + DEAD_AFTER - Duration::from_millis(1)),
            Some(Liveness::Alive)
        );
        assert_eq!(c.liveness("a", t0 + DEAD_AFTER), Some(Liveness::Dead));
        beat(&mut c, "a", 0.0, &[], t0 + DEAD_AFTER);
        assert_eq!(c.liveness("a", t0 + DEAD_AFTER), Some(Liveness::Alive));
        assert_eq!(c.liveness("nope", t0), None);
    }

    #[test]
    fn pod_cidr_is_stable_across_re_registration_and_restarts() {
        let t0 = Instant::now();
        let mut c = cluster();
        let a = register(&mut c, "a", 1, t0);
        let b = register(&mut c, "b", 2, t0);
        assert_ne!(a, b);
        assert_eq!(register(&mut c, "a", 9, t0), a);
        let mut restarted = restarted(&c);
        assert_eq!(restarted.liveness("a", t0), Some(Liveness::Dead));
        assert_eq!(register(&mut restarted, "a", 1, t0), a);
    }

    #[test]
    fn scheduled_applies_are_sticky_and_recorded_only_on_success() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        beat(&mut c, "a", 3.0, &[], t0);
        let t = c.begin_apply("web", None, t0).expect("target");
        assert_eq!(t.node, "b", "b has more headroom");
        assert!(c.finish_apply("web", &t, false).is_empty());
        assert!(
            c.state().placements.is_empty(),
            "failure leaves no placement"
        );
        let t = c.begin_apply("web", None, t0).expect("target");
        let ops = c.finish_apply("web", &t, true);
        assert_eq!(ops.len(), 1);
        beat(&mut c, "b", 3.5, &[], t0);
        let again = c.begin_apply("web", None, t0).expect("sticky");
        assert_eq!((again.node.as_str(), again.epoch), ("b", t.epoch));
        c.finish_apply("web", &again, true);
    }

    fn placed_req(placed: &[(&str, u64)]) -> HeartbeatRequest {
        HeartbeatRequest {
            committed: Resources::default(),
            jails: placed.len() as u32,
            placed: placed
                .iter()
                .map(|(n, e)| PlacedJail {
                    name: n.to_string(),
                    epoch: *e,
                    running: true,
                    address: None,
                })
                .collect(),
            peers_version: None,
        }
    }

    #[test]
    fn committed_resources_from_an_apply_rank_the_node_before_its_heartbeat() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 1, t0);
        let first = c.begin_apply("j1", None, t0).expect("target");
        assert_eq!(first.node, "a", "equal headroom: the smallest id");
        c.finish_apply("j1", &first, true);
        // The node's answer says what it commits now; no heartbeat yet.
        let capacity = c.state().nodes["a"].capacity;
        c.note_committed(
            "a",
            Resources {
                cpu: capacity.cpu / 2.0,
                memory: 0,
            },
        );
        let second = c.begin_apply("j2", None, t0).expect("target");
        assert_eq!(
            second.node, "b",
            "a burst spreads: a is ranked by what it reported"
        );
        c.finish_apply("j2", &second, false);
        // An unknown node is ignored.
        c.note_committed("zz", Resources::default());
    }

    #[test]
    fn an_interrupted_delete_is_finished_by_the_next_heartbeat_without_the_jail() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        let t = c.begin_apply("web", None, t0).expect("target");
        c.finish_apply("web", &t, true);
        let ops = c.begin_delete("web", "a");
        assert_eq!(
            ops.len(),
            1,
            "the mark is persisted before the DELETE goes out"
        );
        assert!(c.begin_delete("web", "a").is_empty(), "marked once");
        assert!(c.begin_delete("web", "b").is_empty(), "not placed on b");

        // The node still reports it (its delete failed, or has not run).
        assert!(
            c.reap_deleted("a", &placed_req(&[("web", t.epoch)]))
                .is_empty()
        );
        assert!(c.state().placements.contains_key("web"));
        // A heartbeat from another node says nothing about it.
        assert!(c.reap_deleted("b", &placed_req(&[])).is_empty());
        // An apply in flight keeps it, whatever the heartbeat says.
        let again = c.begin_apply("web", None, t0).expect("sticky");
        assert!(c.reap_deleted("a", &placed_req(&[])).is_empty());
        c.finish_apply("web", &again, false);
        // The node no longer has it: the placement goes (the crash case).
        let ops = c.reap_deleted("a", &placed_req(&[]));
        assert_eq!(ops, vec![Op::RemovePlacement { name: "web".into() }]);
        assert!(c.state().placements.is_empty() && c.state().deleting.is_empty());
    }

    #[test]
    fn a_successful_apply_after_a_failed_delete_clears_the_mark() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        let t = c.begin_apply("web", None, t0).expect("target");
        c.finish_apply("web", &t, true);
        c.begin_delete("web", "a");
        let again = c.begin_apply("web", None, t0).expect("sticky");
        c.finish_apply("web", &again, true);
        assert!(
            c.state().deleting.is_empty(),
            "re-applied: no longer being deleted"
        );
        assert!(
            c.reap_deleted("a", &placed_req(&[])).is_empty(),
            "a heartbeat built before the apply finished cannot remove it"
        );
    }

    #[test]
    fn a_placed_jail_on_a_dead_node_fails_like_the_named_route() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        let t = c.begin_apply("web", None, t0).expect("target");
        c.finish_apply("web", &t, true);
        let later = t0 + DEAD_AFTER;
        assert_eq!(
            c.begin_apply("web", None, later).expect_err("dead").status,
            503
        );
        assert_eq!(
            c.resolve_placed("web", later).expect_err("dead").status,
            503
        );
        assert_eq!(c.resolve_node("a", later).expect_err("dead").status, 503);
        assert_eq!(
            c.resolve_node("zz", later).expect_err("unknown").status,
            404
        );
    }

    #[test]
    fn the_scheduler_sees_only_alive_registered_nodes_with_what_they_reported() {
        let t0 = Instant::now();
        let mut c = cluster();
        for (i, id) in ["a", "b", "c", "d"].into_iter().enumerate() {
            register(&mut c, id, i as u16 + 1, t0);
        }
        let on_disk = c.state().clone();
        register(&mut c, "e", 5, t0);
        // After a failed journal write "e" is gone from the records but the
        // live data still knows it: it must not be picked.
        c.reset(on_disk);
        let t1 = t0 + DEAD_AFTER - Duration::from_secs(1);
        beat(&mut c, "a", 3.0, &[], t1);
        beat(&mut c, "c", 2.0, &[], t1);
        beat(&mut c, "d", 3.5, &[], t1);
        // b is silent and Dead at t2; c has the most headroom of the rest.
        let t2 = t0 + DEAD_AFTER;
        let picked = |c: &Cluster| {
            c.candidates(t2)
                .iter()
                .map(|x| (x.node_id.to_string(), x.committed.cpu))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            picked(&c),
            [("a".into(), 3.0), ("c".into(), 2.0), ("d".into(), 3.5)]
        );
        assert_eq!(c.begin_apply("web", None, t2).expect("placed").node, "c");
    }

    /// One step of a random cluster history for the ranking property.
    #[derive(Debug, Clone)]
    enum Step {
        Register { node: u8, cpu: u8, mem: u8 },
        Beat { node: u8, cpu: u8, mem: u8 },
        Wait { secs: u8 },
        Reset,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u8..8, 0u8..5, 0u8..5).prop_map(|(node, cpu, mem)| Step::Register { node, cpu, mem }),
            (0u8..8, 0u8..6, 0u8..6).prop_map(|(node, cpu, mem)| Step::Beat { node, cpu, mem }),
            (0u8..10).prop_map(|secs| Step::Wait { secs }),
            Just(Step::Reset),
        ]
    }

    proptest! {
        /// The ranked index picks exactly what `pick_node` picks over every
        /// Alive node, through registrations (new capacities), heartbeats
        /// (new commitments, ties included), deaths and resets.
        #[test]
        fn the_ranked_pick_is_pick_node_over_the_candidates(
            steps in proptest::collection::vec(step(), 1..60),
        ) {
            let mut now = Instant::now();
            let mut c = cluster();
            let mut on_disk = c.state().clone();
            for s in steps {
                match s {
                    Step::Register { node, cpu, mem } => {
                        let id = format!("n{node}");
                        c.register(
                            &RegisterRequest {
                                node_id: id,
                                advertise_addr: SocketAddr::from(([127, 0, 0, 1], 1)),
                                capacity: Resources {
                                    cpu: f64::from(cpu),
                                    memory: u64::from(mem) << 30,
                                },
                            },
                            now,
                        )
                        .expect("registers");
                        if node % 2 == 0 {
                            on_disk = c.state().clone();
                        }
                    }
                    Step::Beat { node, cpu, mem } => {
                        let req = HeartbeatRequest {
                            committed: Resources {
                                cpu: f64::from(cpu) / 2.0,
                                memory: u64::from(mem) << 29,
                            },
                            jails: 0,
                            placed: vec![],
                            peers_version: None,
                        };
                        let _ = c.heartbeat(&format!("n{node}"), &req, now);
                    }
                    Step::Wait { secs } => now += Duration::from_secs(u64::from(secs)),
                    Step::Reset => c.reset(on_disk.clone()),
                }
                let expected = pick_node(&c.candidates(now)).map(str::to_string);
                prop_assert_eq!(c.scheduled_pick(now), expected);
            }
        }
    }

    #[test]
    fn no_alive_node_is_503() {
        let mut c = cluster();
        assert_eq!(
            c.begin_apply("web", None, Instant::now())
                .expect_err("none")
                .status,
            503
        );
    }

    #[test]
    fn concurrent_applies_of_one_name_go_to_one_node() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        let first = c.begin_apply("web", None, t0).expect("first");
        beat(&mut c, &first.node, 4.0, &[], t0);
        let second = c.begin_apply("web", None, t0).expect("second");
        assert_eq!(first, second);
        let other = c.begin_apply("db", None, t0).expect("db");
        assert_ne!(other.epoch, first.epoch);
    }

    #[test]
    fn named_applies_conflict_with_a_placement_elsewhere() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        let t = c.begin_apply("web", Some("a"), t0).expect("named");
        c.finish_apply("web", &t, true);
        assert_eq!(
            c.begin_apply("web", Some("b"), t0)
                .expect_err("conflict")
                .status,
            409
        );
        assert_eq!(c.begin_apply("web", None, t0).expect("scheduled").node, "a");
    }

    #[test]
    fn heartbeats_fence_jails_placed_elsewhere_or_deleted_but_not_in_flight_ones() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        let t = c.begin_apply("web", Some("b"), t0).expect("web on b");
        c.finish_apply("web", &t, true);
        let inflight = c.begin_apply("db", Some("a"), t0).expect("db on a");
        let resp = beat(
            &mut c,
            "a",
            0.0,
            &[("web", t.epoch - 1), ("db", inflight.epoch), ("gone", 1)],
            t0,
        );
        assert_eq!(resp.stale, vec!["web".to_string(), "gone".to_string()]);
        assert_eq!(resp.peers.len(), 1);
        assert!(resp.peers[0].alive);
    }

    #[test]
    fn removing_a_placement_needs_the_node_that_holds_it() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        let t = c.begin_apply("web", None, t0).expect("web");
        c.finish_apply("web", &t, true);
        assert!(c.remove_placement("web", "b").is_empty());
        assert_eq!(c.remove_placement("web", "a").len(), 1);
        assert!(c.state().placements.is_empty());
    }

    fn service(replicas: u32, port: u16, digest: &str, stateful: bool) -> ServiceApply {
        ServiceApply {
            document: "kind: Service".into(),
            replicas,
            port,
            stateful,
            template_digest: digest.into(),
            volumes: if stateful {
                vec!["data".into()]
            } else {
                Vec::new()
            },
        }
    }

    #[test]
    fn a_cordoned_node_gets_nothing_new_and_keeps_what_it_runs() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        let before = c.begin_apply("before", None, t0).expect("pick");
        assert_eq!(before.node, "a", "equal headroom: the smallest id");
        c.finish_apply("before", &before, true);
        beat(&mut c, "a", 0.0, &[("before", before.epoch)], t0);

        assert_eq!(
            c.set_cordoned("nope", true, t0)
                .expect_err("unknown")
                .status,
            404
        );
        let ops = c.set_cordoned("a", true, t0).expect("cordon");
        assert!(
            matches!(&ops[..], [Op::PutNode { id, record }] if id == "a" && record.cordoned),
            "{ops:?}"
        );
        assert!(c.set_cordoned("a", true, t0).expect("again").is_empty());
        // The scheduled route and the services' healing skip it...
        assert_eq!(c.begin_apply("x", None, t0).expect("pick").node, "b");
        c.finish_apply(
            "x",
            &Target {
                node: "b".into(),
                ..before.clone()
            },
            false,
        );
        c.put_service("web", &service(2, 80, "d", false))
            .expect("service");
        let placed: Vec<String> = c
            .plan_heal(Some("web"), t0)
            .into_iter()
            .filter_map(|a| match a {
                HealAction::Place { target, .. } => Some(target.node),
                HealAction::Remove { .. } => None,
            })
            .collect();
        assert_eq!(placed, ["b", "b"]);
        // ...but what it runs stays, a named apply still reaches it, and the
        // node list says so.
        assert_eq!(c.resolve_placed("before", t0).expect("placed").node, "a");
        assert_eq!(c.begin_apply("y", Some("a"), t0).expect("named").node, "a");
        let a = c
            .node_statuses(t0)
            .into_iter()
            .find(|n| n.node_id == "a")
            .expect("a");
        assert!(a.cordoned && a.status == Liveness::Alive, "{a:?}");
        // A re-registering agent and a restarted control plane keep it.
        register(&mut c, "a", 1, t0);
        let restarted = restarted(&c);
        assert!(restarted.state().nodes["a"].cordoned);
        assert!(c.state().nodes["a"].cordoned);

        c.set_cordoned("a", false, t0).expect("uncordon");
        assert_eq!(c.begin_apply("z", None, t0).expect("pick").node, "a");
    }

    #[test]
    fn only_a_dead_node_is_deleted_and_it_takes_its_placements_and_volumes() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        let pg = vec!["pg".to_string()];
        let db = c
            .begin_apply_with_volumes("db", Some("b"), &pg, t0)
            .expect("placed");
        c.finish_apply("db", &db, true);
        let web = c.begin_apply("web", Some("b"), t0).expect("placed");
        c.finish_apply("web", &web, true);
        let api = c.begin_apply("api", Some("a"), t0).expect("placed");
        c.finish_apply("api", &api, true);
        c.begin_delete("web", "b");

        assert_eq!(c.remove_node("nope", t0).expect_err("unknown").status, 404);
        let alive = c.remove_node("b", t0).expect_err("alive");
        assert_eq!(alive.status, 409);
        assert!(alive.message.contains("node b is Alive"), "{alive}");
        assert!(c.state().nodes.contains_key("b"));

        let later = t0 + DEAD_AFTER + Duration::from_secs(1);
        beat(&mut c, "a", 0.0, &[("api", api.epoch)], later);
        // A control plane that just restarted has heard from nobody: not
        // evidence enough, until dead_after has passed since its start.
        let mut restarted = restarted(&c);
        let soon = restarted
            .remove_node("b", restarted.started + Duration::from_secs(1))
            .expect_err("too soon");
        assert_eq!(soon.status, 409);
        assert!(soon.message.contains("not been heard from"), "{soon}");
        assert!(
            restarted
                .remove_node("b", restarted.started + DEAD_AFTER)
                .is_ok()
        );
        let (ops, removal) = c.remove_node("b", later).expect("dead");
        assert_eq!(ops, [Op::RemoveNode { id: "b".into() }]);
        assert_eq!(
            removal,
            NodeRemoval {
                deleted: "b".into(),
                jails: vec!["db".into(), "web".into()],
                volumes: pg.clone(),
            }
        );
        let st = c.state();
        assert!(!st.nodes.contains_key("b"));
        assert_eq!(st.placements.keys().collect::<Vec<_>>(), ["api"]);
        assert!(st.volumes.is_empty() && st.deleting.is_empty());
        // Gone from every view: the node list, the peers, the scheduler.
        let listed: Vec<String> = c
            .node_statuses(later)
            .into_iter()
            .map(|n| n.node_id)
            .collect();
        assert_eq!(listed, ["a"]);
        assert_eq!(c.resolve_node("b", later).expect_err("gone").status, 404);
        // Its volume pins nothing any more: a jail declaring it goes where the
        // scheduler says (a new, empty volume there).
        let moved = c
            .begin_apply_with_volumes("db", None, &pg, later)
            .expect("scheduled");
        assert_eq!(moved.node, "a");
        c.finish_apply("db", &moved, true);

        // The host comes back: it registers again, and fencing tells it to
        // remove what it still runs from before.
        register(&mut c, "b", 2, later);
        let answer = beat(
            &mut c,
            "b",
            0.0,
            &[("web", web.epoch), ("db", db.epoch)],
            later,
        );
        assert_eq!(answer.stale, ["web", "db"]);
    }

    #[test]
    fn a_declared_volume_pins_every_later_apply_to_its_node() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        let pg = vec!["pg".to_string()];
        let t = c
            .begin_apply_with_volumes("db", Some("b"), &pg, t0)
            .expect("placed");
        let ops = c.finish_apply("db", &t, true);
        assert!(ops.contains(&Op::PutVolume {
            name: "pg".into(),
            node: "b".into()
        }));
        // The jail is deleted; its volume stays on b. `a` has more headroom
        // (b carries load), so the scheduler alone would pick a.
        c.remove_placement("db", "b");
        beat(&mut c, "b", 3.0, &[], t0);
        assert_eq!(c.begin_apply("other", None, t0).expect("pick").node, "a");
        let again = c
            .begin_apply_with_volumes("db2", None, &pg, t0)
            .expect("pinned");
        assert_eq!(again.node, "b", "any jail declaring pg goes to b");
        c.finish_apply("db2", &again, false);
        let named = c
            .begin_apply_with_volumes("db", Some("a"), &pg, t0)
            .expect_err("named elsewhere");
        assert_eq!(named.status, 409);
        assert!(named.message.contains("volume pg is on node b"), "{named}");
        // b dies: no empty pg anywhere else.
        let later = t0 + DEAD_AFTER + Duration::from_secs(1);
        beat(&mut c, "a", 0.0, &[], later);
        let dead = c
            .begin_apply_with_volumes("db", None, &pg, later)
            .expect_err("dead");
        assert_eq!(dead.status, 503);
        assert!(
            dead.message.contains("node b") && dead.message.contains("volume pg"),
            "{dead}"
        );
        assert_eq!(c.resolve_volume("pg", later).expect_err("dead").status, 503);
        assert_eq!(
            c.resolve_volume("nope", later).expect_err("unknown").status,
            404
        );
        // A refused apply (4xx) registers nothing; one that reached the node does.
        let t = c
            .begin_apply_with_volumes("cache", None, &["tmp".to_string()], later)
            .expect("a");
        assert!(c.finish_apply_reached("cache", &t, false, false).is_empty());
        let t = c
            .begin_apply_with_volumes("cache", None, &["tmp".to_string()], later)
            .expect("a");
        assert_eq!(c.finish_apply_reached("cache", &t, false, true).len(), 1);
        assert_eq!(
            c.volume_registry().get("tmp").map(String::as_str),
            Some("a")
        );
        assert!(c.remove_volume("tmp", "b").is_empty(), "only its node");
        assert_eq!(c.remove_volume("tmp", "a").len(), 1);
    }

    #[test]
    fn volumes_on_two_nodes_cannot_be_declared_together() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        for (jail, node, vol) in [("x", "a", "va"), ("y", "b", "vb")] {
            let t = c
                .begin_apply_with_volumes(jail, Some(node), &[vol.to_string()], t0)
                .expect("placed");
            c.finish_apply(jail, &t, true);
        }
        let both = vec!["va".to_string(), "vb".to_string()];
        let err = c
            .begin_apply_with_volumes("z", None, &both, t0)
            .expect_err("split");
        assert_eq!(err.status, 409);
    }

    #[test]
    fn a_stateful_replica_scaled_away_comes_back_to_its_data() {
        let t0 = Instant::now();
        let mut c = cluster();
        for (i, id) in ["a", "b", "c"].iter().enumerate() {
            register(&mut c, id, i as u16 + 1, t0);
        }
        c.put_service("db", &service(2, 5432, "t", true))
            .expect("put");
        let plan = c.plan_heal(Some("db"), t0);
        let volumes: Vec<Vec<String>> = plan
            .iter()
            .filter_map(|a| match a {
                HealAction::Place { volumes, .. } => Some(volumes.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(
            volumes,
            [vec!["db-0-data".to_string()], vec!["db-1-data".to_string()]]
        );
        carry_out(&mut c, plan, t0);
        let home = c.volume_registry()["db-1-data"].clone();
        c.put_service("db", &service(1, 5432, "t", true))
            .expect("down");
        let plan = c.plan_heal(Some("db"), t0);
        carry_out(&mut c, plan, t0);
        assert_eq!(nodes_of(&c, "db").len(), 1);
        // Load everything but db-1's old node, then make that node the
        // fullest: the spreading scheduler would never pick it.
        beat(&mut c, &home, 3.9, &[], t0);
        c.put_service("db", &service(2, 5432, "t", true))
            .expect("up");
        let plan = c.plan_heal(Some("db"), t0);
        match plan.as_slice() {
            [
                HealAction::Place {
                    replica, target, ..
                },
            ] => {
                assert_eq!(
                    (replica.as_str(), target.node.as_str()),
                    ("db-1", home.as_str())
                );
            }
            other => panic!("{other:?}"),
        }
        carry_out(&mut c, plan, t0);
        // Its node dies and the replica is removed by a scale-down and wanted
        // again: it waits for the node instead of going elsewhere.
        c.put_service("db", &service(1, 5432, "t", true))
            .expect("down");
        let plan = c.plan_heal(Some("db"), t0);
        carry_out(&mut c, plan, t0);
        let later = t0 + DEAD_AFTER + Duration::from_secs(1);
        for id in ["a", "b", "c"] {
            if id != home {
                beat(&mut c, id, 0.0, &[], later);
            }
        }
        c.put_service("db", &service(2, 5432, "t", true))
            .expect("up");
        assert!(
            c.plan_heal(Some("db"), later).is_empty(),
            "db-1 waits for {home}"
        );
    }

    /// Places every planned replica as if its node answered success, and has
    /// each node report its replicas running with an address.
    fn carry_out(c: &mut Cluster, actions: Vec<HealAction>, now: Instant) {
        let mut services = Vec::new();
        for a in actions {
            match a {
                HealAction::Place {
                    service,
                    replica,
                    target,
                    ..
                } => {
                    services.push(service);
                    c.finish_apply(&replica, &target, true);
                }
                HealAction::Remove {
                    service,
                    replica,
                    node,
                    ..
                } => {
                    services.push(service);
                    c.remove_placement(&replica, &node);
                }
            }
        }
        c.heal_done(&services);
        let nodes: Vec<String> = c.state().nodes.keys().cloned().collect();
        for node in nodes {
            if c.liveness(&node, now) != Some(Liveness::Alive) {
                continue;
            }
            let placed: Vec<PlacedJail> = c
                .state()
                .placements
                .iter()
                .filter(|(_, p)| p.node == node)
                .map(|(n, p)| PlacedJail {
                    name: n.clone(),
                    epoch: p.epoch,
                    running: true,
                    address: Some(Ipv4Addr::new(10, 20, 0, 2)),
                })
                .collect();
            let req = HeartbeatRequest {
                committed: Resources::default(),
                jails: 0,
                placed,
                peers_version: None,
            };
            c.heartbeat(&node, &req, now).expect("heartbeat");
        }
    }

    fn nodes_of(c: &Cluster, svc: &str) -> Vec<String> {
        c.placed_replicas(svc)
            .into_iter()
            .map(|(_, _, p)| p.node)
            .collect()
    }

    #[test]
    fn services_spread_scale_up_and_down() {
        let t0 = Instant::now();
        let mut c = cluster();
        for (i, id) in ["a", "b", "c"].iter().enumerate() {
            register(&mut c, id, i as u16 + 1, t0);
        }
        c.put_service("web", &service(3, 80, "t1", false))
            .expect("put");
        let plan = c.plan_heal(Some("web"), t0);
        assert_eq!(plan.len(), 3);
        carry_out(&mut c, plan, t0);
        let mut nodes = nodes_of(&c, "web");
        nodes.sort();
        assert_eq!(nodes, ["a", "b", "c"], "one replica per node");
        let status = c.service_status("web", t0).expect("status");
        assert_eq!((status.desired, status.ready), (3, 3));
        let endpoints = c.endpoints(t0);
        assert_eq!(endpoints[0].replicas.len(), 3);
        assert_eq!(endpoints[0].vip, status.vip);

        c.put_service("web", &service(5, 80, "t1", false))
            .expect("scale up");
        let plan = c.plan_heal(Some("web"), t0);
        assert_eq!(plan.len(), 2);
        carry_out(&mut c, plan, t0);
        c.put_service("web", &service(2, 80, "t1", false))
            .expect("scale down");
        let plan = c.plan_heal(Some("web"), t0);
        assert_eq!(
            plan.iter()
                .filter(|a| matches!(a, HealAction::Remove { .. }))
                .count(),
            3
        );
        carry_out(&mut c, plan, t0);
        let names: Vec<String> = c
            .placed_replicas("web")
            .into_iter()
            .map(|(_, n, _)| n)
            .collect();
        assert_eq!(names, ["web-0", "web-1"]);
        assert!(c.plan_heal(Some("web"), t0).is_empty(), "converged");
    }

    #[test]
    fn port_and_template_are_immutable_and_the_vip_never_changes() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        c.put_service("web", &service(1, 80, "t1", false))
            .expect("put");
        let vip = c.service_status("web", t0).expect("status").vip;
        assert!(
            "10.96.0.0/16"
                .parse::<Ipv4Net>()
                .expect("cidr")
                .contains(vip)
        );
        let e = c
            .put_service("web", &service(1, 81, "t1", false))
            .expect_err("port");
        assert_eq!((e.status, e.field.as_deref()), (409, Some("spec.port")));
        let e = c
            .put_service("web", &service(1, 80, "t2", false))
            .expect_err("template");
        assert_eq!((e.status, e.field.as_deref()), (409, Some("spec.template")));
        c.put_service("web", &service(4, 80, "t1", false))
            .expect("scale");
        assert_eq!(c.service_status("web", t0).expect("status").vip, vip);
        c.put_service("db", &service(1, 5432, "t3", false))
            .expect("db");
        assert_ne!(c.service_status("db", t0).expect("status").vip, vip);
    }

    #[test]
    fn vip_exhaustion_is_a_hard_error() {
        let mut c = Cluster::new(
            ClusterState::default(),
            "10.20.0.0/16".parse().expect("cidr"),
            "10.96.0.0/30".parse().expect("cidr"),
            DEAD_AFTER,
        );
        c.put_service("a", &service(1, 80, "t", false))
            .expect("first");
        c.put_service("b", &service(1, 80, "t", false))
            .expect("second");
        assert_eq!(
            c.put_service("c", &service(1, 80, "t", false))
                .expect_err("full")
                .status,
            409
        );
    }

    #[test]
    fn a_dead_node_s_stateless_replica_moves_and_a_stateful_one_waits() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        register(&mut c, "b", 2, t0);
        c.put_service("web", &service(2, 80, "t1", false))
            .expect("web");
        c.put_service("db", &service(2, 5432, "t2", true))
            .expect("db");
        let plan = c.plan_heal(None, t0);
        carry_out(&mut c, plan, t0);
        let web_before = c.state().placements["web-0"].clone();
        // Only `b` keeps heartbeating.
        let later = t0 + DEAD_AFTER;
        beat(&mut c, "b", 0.0, &[], later);
        let dead = if web_before.node == "a" { "a" } else { "b" };
        let plan = c.plan_heal(None, later);
        let moved: Vec<&str> = plan
            .iter()
            .filter_map(|a| match a {
                HealAction::Place { replica, .. } => Some(replica.as_str()),
                _ => None,
            })
            .collect();
        assert!(
            moved.iter().all(|r| r.starts_with("web-")),
            "stateful replicas stay: {moved:?}"
        );
        assert_eq!(moved.len(), 1, "exactly the replica on the dead node moves");
        carry_out(&mut c, plan, later);
        assert!(nodes_of(&c, "web").iter().all(|n| n == "b"));
        assert!(
            nodes_of(&c, "db").contains(&"a".to_string()),
            "pinned to its dead node"
        );
        let db = c.service_status("db", later).expect("db");
        assert_eq!(db.ready, 1, "the pinned replica drops out of the VIP list");
        assert!(db.replicas.iter().any(|r| r.state == "NodeDead"));
        let moved_epoch = c.state().placements
            [&format!("web-{}", if dead == web_before.node { 0 } else { 1 })]
            .epoch;
        assert!(moved_epoch > web_before.epoch || web_before.node != dead);
    }

    #[test]
    fn deleting_a_service_releases_its_vip_and_removes_its_replicas() {
        let t0 = Instant::now();
        let mut c = cluster();
        register(&mut c, "a", 1, t0);
        c.put_service("web", &service(2, 80, "t1", false))
            .expect("web");
        let plan = c.plan_heal(None, t0);
        carry_out(&mut c, plan, t0);
        let (_, removals) = c.remove_service("web", t0).expect("remove");
        assert_eq!(removals.len(), 2);
        carry_out(&mut c, removals, t0);
        assert!(c.state().placements.is_empty());
        assert!(c.service_status("web", t0).is_none());
        assert_eq!(c.remove_service("web", t0).expect_err("gone").status, 404);
    }
}
