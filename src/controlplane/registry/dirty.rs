//! Which services' inputs changed since they were last healed and since
//! their endpoint entries were last built: the dirty sets that let a
//! heartbeat cost what it changed instead of a sweep over every service.
//!
//! With 1,000 nodes and 1,000 services, planning every service's heal and
//! rebuilding every endpoint entry on each heartbeat took 2.7 ms of the
//! worker's time, almost three cores at 1,000 heartbeats/s, to find nothing
//! to do. A service's heal and its endpoint entry depend only on its record
//! (the spec), its placements and applies in flight, its replicas' reports
//! (running, ready, address, epoch), its drains and the liveness of the
//! nodes. So every change to one of those marks the services it concerns:
//!
//! - a persisted op ([`Cluster::note_op`]): a placement or a delete mark
//!   marks its replica's service, a service record its service; a node
//!   record (a registration with new details, a cordon), a node's removal
//!   or a volume's removal marks every service, being rare and able to
//!   unblock any of them;
//! - a node's liveness changing (it comes alive, or dies) marks the
//!   services with replicas placed there: their heal and their endpoints
//!   depend on it. A service short of replicas elsewhere needs no mark for
//!   a return to let it place them: a plan that could not place a replica
//!   keeps its service in the heal set (below). Marking every service
//!   instead made each death a sweep of all of them, on the worker, while
//!   heartbeats waited;
//! - a heartbeat marks the services whose replicas' reports differ from the
//!   node's previous ones, and nothing when they are the same;
//! - an apply beginning or ending, a drain starting or ending, a service
//!   retiring, a heal being over mark their service.
//!
//! [`Cluster::plan_heal`] drains the heal set; a service whose plan is
//! waiting on something time or another node decides (a drain in progress,
//! a rollout, a replica it could not place) stays in it, so it is planned
//! again on the next heartbeat as before. The endpoint set is drained by
//! the endpoint table's recomputation (`super::endpoints`). Every
//! `dead_after` the whole heal set is marked anyway: a full sweep that
//! often bounds what an input this file missed could cost, at a price of
//! one sweep per period instead of one per heartbeat.
//!
//! This file only records what changed and counts the work done; it must
//! never plan a heal or compute an endpoint entry itself.

use std::collections::BTreeSet;
use std::time::Instant;

use super::Cluster;
use crate::common::names::replica_of;
use crate::controlplane::state::Op;

/// How many `dead_after` periods apart the full sweeps are; see the
/// module docs.
pub const SWEEP_EVERY: u32 = 4;

/// Work the dirty sets let through, counted since the start, so tests (and
/// benches) can tell a heartbeat that changed nothing from one that did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HealWork {
    /// Services whose heal was planned.
    pub planned: u64,
    /// Service entries of the endpoint table rebuilt.
    pub endpoints_rebuilt: u64,
}

/// The services to heal and to rebuild the endpoint entry of; see the
/// module docs.
#[derive(Debug, Default)]
pub(super) struct Dirty {
    heal: BTreeSet<String>,
    heal_all: bool,
    endpoints: BTreeSet<String>,
    endpoints_all: bool,
    /// When every service was last swept; `None` before the first plan.
    last_sweep: Option<Instant>,
    pub(super) work: HealWork,
}

/// The services a drain of a dirty set yields.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Marked {
    /// Every service.
    All,
    /// These, by name.
    Only(BTreeSet<String>),
}

impl Cluster {
    /// The work done since the start; see [`HealWork`].
    pub fn heal_work(&self) -> HealWork {
        self.dirty.work
    }

    /// Service `name`'s inputs changed.
    pub(super) fn mark_service(&mut self, name: &str) {
        if !self.dirty.heal_all {
            self.dirty.heal.insert(name.to_string());
        }
        if !self.dirty.endpoints_all {
            self.dirty.endpoints.insert(name.to_string());
        }
    }

    /// Jail `name`'s placement, report or drain changed: its service's, when
    /// it is a replica.
    pub(super) fn mark_replica(&mut self, name: &str) {
        if let Some((service, _)) = replica_of(name) {
            let service = service.to_string();
            self.mark_service(&service);
        }
    }

    /// Node `id` died or came alive: the services with replicas there.
    pub(super) fn mark_node(&mut self, id: &str) {
        let replicas: Vec<String> = self
            .state
            .placements
            .iter()
            .filter(|(_, p)| p.node == id)
            .map(|(name, _)| name.clone())
            .collect();
        for name in &replicas {
            self.mark_replica(name);
        }
    }

    /// Something every service depends on changed.
    pub(super) fn mark_every_service(&mut self) {
        self.dirty.heal_all = true;
        self.dirty.heal.clear();
        self.dirty.endpoints_all = true;
        self.dirty.endpoints.clear();
    }

    /// Marks what persisted op `op` concerns; see the module docs.
    pub(super) fn note_op(&mut self, op: &Op) {
        match op {
            Op::PutPlacement { name, .. }
            | Op::RemovePlacement { name }
            | Op::MarkDeleting { name } => self.mark_replica(name),
            Op::PutService { name, .. } | Op::RemoveService { name } => {
                self.note_rollout(name);
                self.mark_service(name)
            }
            // Comes with its replica's placement.
            Op::PutVolume { .. } => {}
            Op::PutNode { .. } | Op::RemoveNode { .. } | Op::RemoveVolume { .. } => {
                self.mark_every_service()
            }
        }
    }

    /// Takes the services to plan a heal for at `now`.
    pub(super) fn take_heal_marks(&mut self, now: Instant) -> Marked {
        let sweep_due = self
            .dirty
            .last_sweep
            .is_none_or(|t| now.saturating_duration_since(t) >= self.dead_after * SWEEP_EVERY);
        if std::mem::take(&mut self.dirty.heal_all) || sweep_due {
            self.dirty.heal.clear();
            self.dirty.last_sweep = Some(now);
            return Marked::All;
        }
        Marked::Only(std::mem::take(&mut self.dirty.heal))
    }

    /// Service `name` waits on something a later plan decides: plan it
    /// again next time.
    pub(super) fn keep_heal_mark(&mut self, name: &str) {
        if !self.dirty.heal_all {
            self.dirty.heal.insert(name.to_string());
        }
    }

    /// Takes the services whose endpoint entries to rebuild; `None` when
    /// there are none.
    pub(super) fn take_endpoint_marks(&mut self) -> Option<Marked> {
        if std::mem::take(&mut self.dirty.endpoints_all) {
            self.dirty.endpoints.clear();
            return Some(Marked::All);
        }
        if self.dirty.endpoints.is_empty() {
            return None;
        }
        Some(Marked::Only(std::mem::take(&mut self.dirty.endpoints)))
    }
}
