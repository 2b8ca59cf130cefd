//! Node membership: registering, heartbeats, `GET /nodes`, cordon and
//! removal of a node that is gone for good.
//!
//! A heartbeat renews the node's lease and answers with the peer list, the
//! service endpoints and the placed jails the node must fence. This file
//! must never fence or move anything itself: the answer only names jails
//! whose placement is recorded elsewhere.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Cluster, HeartbeatAnswer, Refusal, Reported};
use crate::common::cidr::{Ipv4Net, derive_pod_cidr};
use crate::common::wire::{
    EndpointsStamp, EventType, HeartbeatRequest, HeartbeatResponse, Liveness, NodeRemoval,
    NodeStatus, ObjectKind, RegisterRequest, Resources,
};
use crate::controlplane::state::{NodeRecord, Op};

impl Cluster {
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
        live.applied_since_report = 0;
        let reported: BTreeMap<String, Reported> = req
            .placed
            .iter()
            .map(|j| {
                let reported = Reported {
                    running: j.running,
                    // An agent older than health checks: running is ready.
                    ready: j.running && j.ready.unwrap_or(true),
                    address: j.address,
                    epoch: j.epoch,
                };
                (j.name.clone(), reported)
            })
            .collect();
        // Only the replicas whose reports differ concern their services.
        let before = std::mem::replace(&mut live.reported, reported);
        let changed: BTreeSet<String> = {
            let now_reported = &live.reported;
            let gone = before.keys().filter(|n| !now_reported.contains_key(*n));
            let differ = now_reported
                .iter()
                .filter(|(n, r)| before.get(*n) != Some(*r))
                .map(|(n, _)| n);
            gone.chain(differ).cloned().collect()
        };
        live.endpoints_applied = req.endpoints_generation;
        // A node's new events wake the watches waiting on this control
        // plane's ring, which then ask that node for them.
        if req
            .events_seq
            .is_some_and(|seq| live.events_seq.is_none_or(|had| seq > had))
        {
            self.events.poke();
        }
        live.events_seq = req.events_seq;
        live.connections = req
            .connections
            .iter()
            .filter(|c| c.open > 0)
            .map(|c| (c.addr, c.open))
            .collect();
        for name in &changed {
            self.mark_replica(name);
        }
        // After the committed resources, so the node is ranked by them.
        self.heard_from(id, now);
        let stale: Vec<String> = req
            .placed
            .iter()
            .filter(|j| !self.holds(id, &j.name, j.epoch))
            .map(|j| j.name.clone())
            .collect();
        for j in req.placed.iter().filter(|j| stale.contains(&j.name)) {
            if self
                .fenced
                .insert((id.to_string(), j.name.clone(), j.epoch))
            {
                self.events.record(
                    ObjectKind::Jail,
                    &j.name,
                    "Fenced",
                    EventType::Warning,
                    format!(
                        "node {id} holds a copy under epoch {} whose placement moved; the node removes it",
                        j.epoch
                    ),
                    Some(id),
                );
            }
        }
        let unchanged = req.peers_version == Some(self.peers_version);
        let changes = match req.peers_version {
            Some(held) if req.peer_changes && !unchanged => self.peer_changes_since(held, id),
            _ => None,
        };
        let (generation, services) = self.current_endpoints(now);
        let endpoints_unchanged = req.endpoints_held
            == Some(EndpointsStamp {
                origin: self.endpoints_origin(),
                generation,
            });
        let endpoint_changes = match req.endpoints_held {
            Some(held)
                if req.endpoint_changes
                    && !endpoints_unchanged
                    && held.origin == self.endpoints_origin() =>
            {
                self.endpoint_changes_since(held.generation)
                    .map(|c| (held.generation, c))
            }
            _ => None,
        };
        let (services_changed, changed_services, services_removed) = match endpoint_changes {
            Some((since, c)) => (Some(since), Some(Arc::clone(&c.changed)), c.removed.clone()),
            None => (None, None, Vec::new()),
        };
        let full_list = !unchanged && changes.is_none();
        let (peers_changed, changed, removed) = match changes {
            Some(c) => (req.peers_version, c.changed, c.removed),
            None => (None, Vec::new(), Vec::new()),
        };
        Ok(HeartbeatAnswer {
            response: HeartbeatResponse {
                peers: changed,
                stale,
                services: Vec::new(),
                peers_version: Some(self.peers_version),
                peers_unchanged: unchanged,
                endpoints_generation: Some(generation),
                endpoints_origin: Some(self.endpoints_origin()),
                peers_changed,
                peers_removed: removed,
                endpoints_unchanged,
                services_changed,
                services_removed,
            },
            peers: full_list.then(|| self.peer_list()),
            // The whole table, or only what changed since the agent's.
            services: match changed_services {
                Some(changed) => Some(changed),
                None => (!endpoints_unchanged).then_some(services),
            },
        })
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
                    jails: live.known_jails(),
                    last_seen_secs: live
                        .last_heartbeat
                        .map(|t| now.saturating_duration_since(t).as_secs()),
                    cordoned: n.cordoned,
                    events_seq: live.events_seq,
                }
            })
            .collect()
    }

    /// The address of a node that is not Dead (an Unknown one may well be
    /// running): an unknown id is 404, Dead is 503. No network.
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
            Some(Liveness::Alive | Liveness::Unknown) => Ok(self.state.nodes[id].advertise),
        }
    }

    /// The committed resources node `id` reported in an apply's answer
    /// ([`crate::common::wire::COMMITTED_HEADER`]): the node is ranked by
    /// them, and by one more jail, at once instead of at its next heartbeat
    /// (which corrects the count when the apply re-applied a jail it had).
    pub fn note_committed(&mut self, id: &str, committed: Resources) {
        let Some(live) = self.live.get_mut(id) else {
            return;
        };
        live.committed = committed;
        live.applied_since_report = live.applied_since_report.saturating_add(1);
        let ranked = live.rank.is_some();
        self.rank(id, ranked);
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
            // Not heard from since a restart (or a stall) is no evidence the
            // host is gone, and deleting a running node would have fencing
            // remove all its jails when it registers again.
            Some(Liveness::Unknown) => {
                let lease = self
                    .live
                    .get(id)
                    .and_then(|l| l.lease_from)
                    .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
                return Err(Refusal::new(
                    409,
                    format!(
                        "node {id} has not been heard from since this control plane started {} s ago; \
                         it counts as gone only after {} s of silence: retry in {} s",
                        lease.as_secs(),
                        self.dead_after.as_secs(),
                        self.dead_after.saturating_sub(lease).as_secs() + 1
                    ),
                ));
            }
            Some(Liveness::Dead) => {}
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
            if let Some(t) = live.lease_from {
                self.leases.remove(&(t, id.to_string()));
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
}
