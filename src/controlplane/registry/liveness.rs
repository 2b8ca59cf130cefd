//! Liveness: which nodes are Alive, Unknown or Dead, computed on read from
//! the leases this process has observed, and the headroom order the
//! scheduler picks from.
//!
//! Absence of evidence is not death. A node is Dead only when this process
//! saw its lease run out: `dead_after` passed since the lease began without
//! a heartbeat. A lease begins at every heartbeat, and also, for every node
//! whose lease this process has not seen expire, at two moments when silence
//! proves nothing:
//!
//! - the process's start: the persisted records name the nodes, but no
//!   heartbeat has been received yet. Each node is Unknown (not heard from
//!   since the start, lease running) until it heartbeats, and Dead only one
//!   whole `dead_after` later. Nomad resets its heartbeat timers after a
//!   leader election for the same reason.
//! - the end of a stall ([`Cluster::observation_gap`]): the worker heard
//!   nothing for a while (it was paused, or nobody could reach the process),
//!   so the heartbeats that did not arrive are no evidence either.
//!
//! With the state in etcd, a new leader takes over the cluster's record of
//! who is alive ([`Cluster::vouch`]): a node an earlier leader heard within
//! its lease is Alive from the start, with the resources it last reported,
//! rather than Unknown. That is evidence for life only: its lease here still
//! begins at the start, so it too is Dead only one whole `dead_after` of
//! silence later, which this process sees.
//!
//! What each state allows: an Alive node is a scheduling candidate and its
//! replicas are ready when it reports them running. An Unknown node is
//! reached for forwards and routed to by the peers, and its placements count
//! as present (nothing is moved or healed away from it), but it gets nothing
//! new, having reported no headroom. Only Dead permits destructive action:
//! rescheduling its stateless replicas, deleting the node record.
//!
//! Nothing sweeps in the background: running leases are kept ordered by
//! their start, and every read first pops the ones that ran out. This file
//! must never act on a death; it only answers what the process observed.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use super::{Cluster, Live};
use crate::common::wire::{EventType, Liveness, ObjectKind, Resources};
use crate::controlplane::scheduler::Candidate;

/// A node's place in the scheduler's order: most headroom first (NaN where
/// [`crate::controlplane::scheduler::pick_node`]'s `total_cmp` puts it),
/// then fewest jails, so the first ranked node (ties by id) is the one
/// `pick_node` would pick.
#[derive(Debug, Clone, Copy)]
pub(super) struct Rank {
    headroom: f64,
    jails: u32,
}

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
        other
            .headroom
            .total_cmp(&self.headroom)
            .then(self.jails.cmp(&other.jails))
    }
}

impl Cluster {
    /// Pops, from the running leases, those that ran out by `now`: each such
    /// node is Dead from now on, which changes the peer list. Every read
    /// does this first; the worker also does it when it wakes, so a death
    /// is told (its NodeDead event) when it happens, not at the next read.
    pub fn notice_deaths(&mut self, now: Instant) {
        while let Some((t, _)) = self.leases.first() {
            if now.saturating_duration_since(*t) < self.dead_after {
                break;
            }
            if let Some((_, id)) = self.leases.pop_first() {
                if let Some(live) = self.live.get_mut(&id) {
                    live.lease_from = None;
                }
                self.events.record(
                    ObjectKind::Node,
                    &id,
                    "NodeDead",
                    EventType::Warning,
                    format!(
                        "no heartbeat for {}s: the node is Dead; its stateless replicas are placed elsewhere",
                        self.dead_after.as_secs()
                    ),
                    Some(&id),
                );
                self.rank(&id, false);
                self.peer_changed(&id, now);
                self.mark_node(&id);
            }
        }
    }

    /// Records that `id` was heard from at `now`: a new lease.
    pub(super) fn heard_from(&mut self, id: &str, now: Instant) {
        self.notice_deaths(now);
        let before = self.liveness(id, now);
        // A node registering for the first time reads as Dead too.
        let known = self.live.contains_key(id);
        let live = self.live.entry(id.to_string()).or_default();
        live.last_heartbeat = Some(now);
        if let Some(t) = live.lease_from.replace(now) {
            self.leases.remove(&(t, id.to_string()));
        }
        self.leases.insert((now, id.to_string()));
        self.rank(id, true);
        if before != Some(Liveness::Alive) {
            let message = match (before, known) {
                (Some(Liveness::Dead), true) => "heartbeating again after it was Dead",
                _ => "heartbeating",
            };
            self.became_alive(id, message, now);
        }
    }

    /// Takes the cluster's word that `id` is alive, with the `committed`
    /// resources and `jails` it last reported (see the module docs):
    /// Unknown becomes Alive, its lease untouched. Nothing for a node this
    /// process heard from, saw die, or has no record of.
    pub fn vouch(&mut self, id: &str, committed: Resources, jails: u32, now: Instant) {
        if self.liveness(id, now) != Some(Liveness::Unknown) {
            return;
        }
        let Some(live) = self.live.get_mut(id) else {
            return;
        };
        live.vouched = true;
        live.committed = committed;
        live.jails = jails;
        self.rank(id, true);
        self.became_alive(
            id,
            "alive on the cluster's record: the control plane that led before heard it within its lease",
            now,
        );
    }

    /// What every turn to Alive tells: its event, its peers, its services.
    fn became_alive(&mut self, id: &str, message: &str, now: Instant) {
        self.events.record(
            ObjectKind::Node,
            id,
            "NodeAlive",
            EventType::Normal,
            message.to_string(),
            Some(id),
        );
        self.peer_changed(id, now);
        self.mark_node(id);
    }

    /// The resources and jail count `id` reported as this process knows
    /// them, once it heard from it: what the cluster's record of the node
    /// keeps for the next leader ([`Cluster::vouch`]).
    pub fn reported_load(&self, id: &str) -> Option<(Resources, u32)> {
        self.live
            .get(id)
            .filter(|l| l.last_heartbeat.is_some())
            .map(|l| (l.committed, l.known_jails()))
    }

    /// The worker heard nothing between its previous command and `now`,
    /// longer than a heartbeat should take: it was stalled, or nobody could
    /// reach this process. Every lease still running when the silence began
    /// starts again at `now`, so no node dies of heartbeats that could not be
    /// received. Leases already seen to expire stay expired.
    pub fn observation_gap(&mut self, since: Instant, now: Instant) {
        let running: Vec<String> = self
            .leases
            .iter()
            .filter(|(t, _)| since.saturating_duration_since(*t) < self.dead_after)
            .map(|(_, id)| id.clone())
            .collect();
        if running.is_empty() {
            return;
        }
        for id in &running {
            if let Some(live) = self.live.get_mut(id)
                && let Some(t) = live.lease_from.replace(now)
            {
                self.leases.remove(&(t, id.clone()));
                self.leases.insert((now, id.clone()));
            }
        }
        log::warn!(
            "heard nothing for {:.1}s (the worker was stalled or nobody could reach this control plane); {} node leases start again instead of expiring",
            now.saturating_duration_since(since).as_secs_f64(),
            running.len()
        );
    }

    /// How long the worker may hear nothing before [`Cluster::observation_gap`]
    /// applies: half of `dead_after`, which is longer than a heartbeat period
    /// (a third of it by default), so one node heartbeating alone never
    /// looks like a stall.
    pub fn stall_threshold(&self) -> std::time::Duration {
        self.dead_after / 2
    }

    /// Puts `id` in `ranked` under its current headroom and jail count
    /// (`alive`), or takes it out (also while cordoned). Called whenever its
    /// liveness, capacity, committed resources, jails or cordon change.
    pub(super) fn rank(&mut self, id: &str, alive: bool) {
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
            let candidate = Candidate {
                node_id: id,
                capacity,
                committed: live.committed,
                jails: live.known_jails(),
            };
            let rank = Rank {
                headroom: candidate.headroom(),
                jails: candidate.jails,
            };
            live.rank = Some(rank);
            self.ranked.insert((rank, id.to_string()));
        }
    }

    /// The scheduled route's pick at `now`: the same node as
    /// `pick_node(&self.candidates(now))`, found in O(log n).
    pub(super) fn scheduled_pick(&mut self, now: Instant) -> Option<String> {
        self.notice_deaths(now);
        self.ranked.first().map(|(_, id)| id.clone())
    }

    /// A heal's pick for one replica at `now`: the same node as
    /// `pick_node_spread(&with_planned(self.candidates(now), planned), avoid)`
    /// (the nodes this plan already placed on count with what it placed
    /// there; `avoid` holds the service's nodes), found by walking `ranked`
    /// from the best past the nodes planned on or avoided, and re-ranking
    /// only the planned ones. Building and scanning every candidate instead
    /// cost 6 ms per replica at 10,000 nodes: 150 ms of the worker's time,
    /// heartbeats waiting behind it, to replace a dead node's 32 replicas.
    pub(super) fn heal_pick(
        &mut self,
        planned: &BTreeMap<String, (Resources, u32)>,
        avoid: &BTreeSet<&str>,
        now: Instant,
    ) -> Option<String> {
        self.notice_deaths(now);
        self.best_ranked(planned, Some(avoid))
            .or_else(|| self.best_ranked(planned, None))
    }

    /// See [`Cluster::heal_pick`]: the best ranked node not in `avoid`.
    fn best_ranked(
        &self,
        planned: &BTreeMap<String, (Resources, u32)>,
        avoid: Option<&BTreeSet<&str>>,
    ) -> Option<String> {
        let avoided = |id: &str| avoid.is_some_and(|a| a.contains(id));
        // The best node this plan has not placed on ranks as it is.
        let untouched = self
            .ranked
            .iter()
            .find(|(_, id)| !planned.contains_key(id) && !avoided(id))
            .map(|(rank, id)| (*rank, id.as_str()));
        // A node it placed on ranks with what it placed, if it is ranked at
        // all (Alive and not cordoned).
        let touched =
            planned
                .iter()
                .filter(|(id, _)| !avoided(id))
                .filter_map(|(id, (resources, jails))| {
                    let live = self.live.get(id).filter(|l| l.rank.is_some())?;
                    let mut committed = live.committed;
                    committed.cpu += resources.cpu;
                    committed.memory = committed.memory.saturating_add(resources.memory);
                    let candidate = Candidate {
                        node_id: id,
                        capacity: self.state.nodes.get(id)?.capacity,
                        committed,
                        jails: live.known_jails().saturating_add(*jails),
                    };
                    let rank = Rank {
                        headroom: candidate.headroom(),
                        jails: candidate.jails,
                    };
                    Some((rank, id.as_str()))
                });
        // Best rank first, then the smallest id: `pick_node`'s order.
        untouched
            .into_iter()
            .chain(touched)
            .min()
            .map(|(_, id)| id.to_string())
    }

    /// Liveness of `id` at `now`, `None` when unknown; see the module docs.
    pub fn liveness(&self, id: &str, now: Instant) -> Option<Liveness> {
        self.state.nodes.get(id)?;
        let Some(live) = self.live.get(id).filter(|l| self.lease_running(l, now)) else {
            return Some(Liveness::Dead);
        };
        Some(if live.last_heartbeat.is_some() || live.vouched {
            Liveness::Alive
        } else {
            Liveness::Unknown
        })
    }

    /// [`Cluster::liveness`] as far as this process has `id`'s own reports:
    /// a node vouched for but not heard from yet is Unknown here. What the
    /// data plane is told (replica readiness, endpoint tables, rollouts)
    /// goes by this, since the record that vouches carries no report of
    /// its jails.
    pub(super) fn reported_liveness(&self, id: &str, now: Instant) -> Option<Liveness> {
        let heard = self.live.get(id).and_then(|l| l.last_heartbeat).is_some();
        match self.liveness(id, now) {
            Some(Liveness::Alive) if !heard => Some(Liveness::Unknown),
            other => other,
        }
    }

    /// True unless `id` is unknown or this process saw its lease expire:
    /// requests may be sent to it and what it holds stays where it is.
    pub(super) fn not_dead(&self, id: &str, now: Instant) -> bool {
        matches!(
            self.liveness(id, now),
            Some(Liveness::Alive | Liveness::Unknown)
        )
    }

    /// True when `id` heartbeated since this process started, or the
    /// cluster's record vouched for it: what makes a running lease Alive.
    pub(super) fn alive_on_evidence(&self, id: &str) -> bool {
        self.live
            .get(id)
            .is_some_and(|l| l.last_heartbeat.is_some() || l.vouched)
    }

    fn lease_running(&self, live: &Live, now: Instant) -> bool {
        live.lease_from
            .is_some_and(|t| now.saturating_duration_since(t) < self.dead_after)
    }

    /// Alive nodes as scheduler candidates, the definition the ranked
    /// picks ([`Cluster::scheduled_pick`], [`Cluster::heal_pick`]) are
    /// tested against. One ordered walk over the records and the live data
    /// together (same keys, same order).
    #[cfg(test)]
    pub(super) fn candidates(&self, now: Instant) -> Vec<Candidate<'_>> {
        let mut live = self.live.iter().peekable();
        self.state
            .nodes
            .iter()
            .filter_map(|(id, n)| {
                while live.next_if(|(l, _)| *l < id).is_some() {}
                let (_, l) = live.next_if(|(l, _)| *l == id)?;
                let alive = (l.last_heartbeat.is_some() || l.vouched) && self.lease_running(l, now);
                (alive && !n.cordoned).then_some(Candidate {
                    node_id: id,
                    capacity: n.capacity,
                    committed: l.committed,
                    jails: l.known_jails(),
                })
            })
            .collect()
    }
}
