//! The cluster model the worker thread owns: registered nodes and their
//! liveness, placements, services and applies in flight.
//!
//! Every method that changes persisted state returns the [`Op`]s it applied,
//! for the worker to journal before answering. One [`Cluster`] type, its
//! methods grouped by what they own, one file each:
//!
//! - [`liveness`]: Alive, Unknown or Dead, computed on read from the leases
//!   this process observed; the scheduler's order.
//! - [`nodes`]: registration, heartbeats, cordon, removal.
//! - [`peers`]: the versioned peer list a heartbeat answer carries.
//! - [`placements`]: where jails live, applies in flight, the volume registry.
//! - [`services`]: replica sets, endpoints and healing.
//! - [`rollout`]: template revisions, rolling updates, scale and undo.
//! - [`drain`]: replicas leaving the rotation before they are stopped.
//! - [`endpoints`]: the published endpoint table and its generation, and
//!   what each node's proxy applied and still relays.
//! - [`dirty`]: which services' inputs changed, so a heartbeat heals and
//!   rebuilds only those.

pub mod dirty;
pub mod drain;
pub mod endpoints;
pub mod liveness;
pub mod nodes;
pub mod peers;
pub mod placements;
pub mod rollout;
pub mod services;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::cidr::Ipv4Net;
use crate::common::events::EventLog;
use crate::common::wire::Resources;
use crate::controlplane::state::{ClusterState, Op};

pub use dirty::HealWork;
pub use endpoints::NewGeneration;
use endpoints::PublishedEndpoints;
use liveness::Rank;
use peers::first_peers_version;
pub use peers::{HeartbeatAnswer, PeerChanges, PeerListJson};
use placements::Pending;
pub use services::HealAction;

/// One placed jail as its node last reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reported {
    /// Its workload runs.
    running: bool,
    /// It serves (its health check passes, or it has none and runs).
    ready: bool,
    /// Its address.
    address: Option<Ipv4Addr>,
    /// The placement epoch it carried: a report under an older epoch is of
    /// the workload a rolling update has since replaced.
    epoch: u64,
}

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
    /// The last heartbeat (or registration) this process received.
    last_heartbeat: Option<Instant>,
    /// Alive on the cluster's word ([`Cluster::vouch`]): the control plane
    /// that led before heard it within its lease; this one has not yet.
    vouched: bool,
    /// When the node's current lease began: its last heartbeat, or the start
    /// of a grace this process granted (its own start, the end of a stall).
    /// `None` once the lease was seen to expire.
    lease_from: Option<Instant>,
    committed: Resources,
    jails: u32,
    /// Jails applied to it (answered with what it commits) since its last
    /// heartbeat, which reports them in `jails`.
    applied_since_report: u32,
    /// Placed jails as the node last reported them.
    reported: BTreeMap<String, Reported>,
    /// The headroom the node is ranked under in `Cluster::ranked`, while Alive.
    rank: Option<Rank>,
    /// The endpoint generation its proxy applied last, as its last
    /// heartbeat said (see [`endpoints`]).
    endpoints_applied: Option<u64>,
    /// Connections its proxy has open to each replica, as its last
    /// heartbeat said.
    connections: BTreeMap<SocketAddrV4, u32>,
    /// The newest number of its event ring, as its last heartbeat said.
    events_seq: Option<u64>,
}

impl Live {
    /// The jails it holds as far as this process knows: its last report
    /// and the applies answered since.
    fn known_jails(&self) -> u32 {
        self.jails.saturating_add(self.applied_since_report)
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct Cluster {
    state: ClusterState,
    live: BTreeMap<String, Live>,
    pending: BTreeMap<String, Pending>,
    /// Services whose heal is being carried out by a handler thread.
    healing: BTreeSet<String>,
    /// Services being deleted: their replicas drain first (see [`drain`]).
    retiring: BTreeSet<String>,
    /// Replicas leaving the rotation, by name (see [`drain`]).
    draining: BTreeMap<String, drain::Drain>,
    /// Each rollout in progress: when it last made progress, and its
    /// progress then: replicas on the new template plus those of them ready
    /// (see [`rollout`]).
    progress: BTreeMap<String, (Instant, u32)>,
    /// The services whose record says a rollout is in progress, kept as
    /// records change (see [`rollout`]): every heartbeat's heal asks.
    progressing: BTreeSet<String>,
    cluster_cidr: Ipv4Net,
    service_cidr: Ipv4Net,
    dead_after: Duration,
    /// Nodes whose lease was running at the last read, by `lease_from`,
    /// oldest first: Alive and Unknown ones.
    leases: BTreeSet<(Instant, String)>,
    peers_version: u64,
    /// Each node's [`Peer`] entry, encoded.
    entries: BTreeMap<String, Vec<u8>>,
    /// The entries joined, for the current version, once asked for.
    peer_list: Option<Arc<PeerListJson>>,
    /// Which node each recent version changed (see [`peers`]).
    peer_log: peers::PeerLog,
    /// The Alive nodes, most headroom first and ties by id: the
    /// scheduled route's pick is the first one, without visiting 5,000 nodes.
    ranked: BTreeSet<(Rank, String)>,
    /// The endpoint table last published and its generation.
    published: PublishedEndpoints,
    /// Services whose heal or endpoint entry is due (see [`dirty`]).
    dirty: dirty::Dirty,
    /// Where the cluster's decisions are told ([`Cluster::set_events`]).
    events: EventLog,
    /// Stale copies already told as Fenced (node, jail, epoch), so a node
    /// reporting one at every heartbeat until it is gone is told once.
    fenced: BTreeSet<(String, String, u64)>,
}

impl Cluster {
    /// A cluster from persisted state, starting now: every node is Unknown
    /// until it heartbeats, and Dead only if it stays silent for
    /// `dead_after` (see [`liveness`]).
    pub fn new(
        state: ClusterState,
        cluster_cidr: Ipv4Net,
        service_cidr: Ipv4Net,
        dead_after: Duration,
    ) -> Cluster {
        Cluster::started_at(
            state,
            cluster_cidr,
            service_cidr,
            dead_after,
            Instant::now(),
        )
    }

    /// [`Cluster::new`], started at `now` (tests step a synthetic clock).
    pub fn started_at(
        state: ClusterState,
        cluster_cidr: Ipv4Net,
        service_cidr: Ipv4Net,
        dead_after: Duration,
        now: Instant,
    ) -> Cluster {
        let live = state
            .nodes
            .keys()
            .map(|id| {
                let live = Live {
                    lease_from: Some(now),
                    ..Live::default()
                };
                (id.clone(), live)
            })
            .collect();
        let leases = state.nodes.keys().map(|id| (now, id.clone())).collect();
        let mut cluster = Cluster {
            state,
            live,
            pending: BTreeMap::new(),
            healing: BTreeSet::new(),
            draining: BTreeMap::new(),
            retiring: BTreeSet::new(),
            progress: BTreeMap::new(),
            progressing: BTreeSet::new(),
            cluster_cidr,
            service_cidr,
            dead_after,
            leases,
            peers_version: first_peers_version(),
            entries: BTreeMap::new(),
            peer_list: None,
            peer_log: peers::PeerLog::default(),
            ranked: BTreeSet::new(),
            published: PublishedEndpoints::default(),
            dirty: dirty::Dirty::default(),
            events: EventLog::in_memory(""),
            fenced: BTreeSet::new(),
        };
        cluster.encode_every_peer(now);
        cluster.index_rollouts();
        // A rollout in progress gets a whole deadline from this start: the
        // time this process was not running is no evidence against it.
        cluster.restart_rollout_clocks(now);
        cluster.start_endpoints(now);
        cluster
    }

    /// Records the cluster's decisions (node deaths and returns, placements,
    /// reschedules, fencing, rollout steps and outcomes) in `events` from
    /// now on; until then they go to a ring nobody reads.
    pub fn set_events(&mut self, events: EventLog) {
        self.events = events;
    }

    /// Where the cluster records its events.
    pub fn events(&self) -> &EventLog {
        &self.events
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
        let leased: Vec<String> = self.leases.iter().map(|(_, id)| id.clone()).collect();
        for id in leased {
            let rank = self.state.nodes.contains_key(&id) && self.alive_on_evidence(&id);
            self.rank(&id, rank);
        }
        self.healing.clear();
        self.draining.clear();
        self.retiring.clear();
        self.progress.clear();
        self.index_rollouts();
        self.mark_every_service();
    }

    fn apply(&mut self, ops: Vec<Op>) -> Vec<Op> {
        use crate::common::journal::Replay;
        for op in &ops {
            self.state.replay(op);
            self.note_op(op);
        }
        ops
    }
}
