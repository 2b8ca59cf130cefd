//! Placements: where each jail lives, the applies in flight, deletes and
//! the volume registry.
//!
//! Applies in flight: a scheduled apply is resolved here (a read), forwarded by
//! a handler thread, and recorded only when the node answered success. While
//! it is in flight the name is *pending* on its chosen node, so a second apply
//! of the same name resolves to the same node and epoch instead of racing to
//! another one, and a heartbeat from that node does not fence the jail the
//! node has just created but the control plane has not recorded yet.
//!
//! A placement is recorded only after the node answered success; this file
//! must never record one for an apply that did not reach its node.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use super::{Cluster, Refusal, Target};
use crate::common::names::replica_of;
use crate::common::wire::{EventType, HeartbeatRequest, ObjectKind};
use crate::controlplane::state::{Op, Placement};

#[derive(Debug, Clone)]
pub(super) struct Pending {
    pub(super) node: String,
    pub(super) epoch: u64,
    /// Applies of this name in flight (released when the last one ends).
    pub(super) count: u32,
    /// Volumes the applies in flight declare, registered on `node` when one
    /// of them reached it.
    pub(super) volumes: Vec<String>,
    /// For a replica: the template digest it is being applied with,
    /// recorded with the placement.
    pub(super) template: Option<String>,
}

impl Cluster {
    /// True when `node` may keep jail `name` placed under `epoch`: it is the
    /// recorded placement, or an apply of it to that node is in flight.
    pub(super) fn holds(&self, node: &str, name: &str, epoch: u64) -> bool {
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
        let target = self.plan_apply(name, node, volumes, now)?;
        let entry = self.pending.entry(name.to_string()).or_insert(Pending {
            node: target.node.clone(),
            epoch: target.epoch,
            count: 0,
            volumes: Vec::new(),
            template: None,
        });
        entry.count += 1;
        for v in volumes {
            if !entry.volumes.contains(v) {
                entry.volumes.push(v.clone());
            }
        }
        self.mark_replica(name);
        Ok(target)
    }

    /// Where [`Cluster::begin_apply_with_volumes`] would send the apply, and
    /// with which epoch, refused as it would be, but recording nothing: no
    /// placement, no apply in flight, no epoch reserved (a dry run). The
    /// scheduler's pick is the one an apply at `now` would get.
    pub fn plan_apply(
        &mut self,
        name: &str,
        node: Option<&str>,
        volumes: &[String],
        now: Instant,
    ) -> Result<Target, Refusal> {
        if let Some((service, index)) = replica_of(name)
            && self.state.services.contains_key(service)
        {
            return Err(Refusal {
                status: 409,
                message: format!(
                    "jail {name} would take the name of replica {index} of service {service}, which manages it; \
                     choose another jail name (a replica changes through its service: keelctl apply -f the Service)"
                ),
                field: Some("metadata.name".into()),
            });
        }
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
            if !self.not_dead(home, now) {
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
        Ok(Target {
            node: node_id,
            addr,
            epoch,
        })
    }

    /// An epoch no placement has had. Pending applies reserve theirs, so two
    /// in flight never share one.
    pub(super) fn next_epoch(&self) -> u64 {
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
        // Replaced or not, the replica's drain is over: a failed apply is
        // planned again from scratch.
        self.forget_drain(name);
        self.mark_replica(name);
        let mut volumes = Vec::new();
        let mut template = None;
        if let Some(p) = self.pending.get_mut(name) {
            if p.node == target.node {
                volumes = p.volumes.clone();
                template = p.template.clone();
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
        let placement = Placement {
            node: target.node.clone(),
            epoch: target.epoch,
            template,
        };
        let already = self.state.placements.get(name) == Some(&placement);
        // Recording it again also clears a delete mark: the jail was
        // applied after a DELETE that did not finish.
        if !succeeded || (already && !self.state.deleting.contains(name)) {
            return ops;
        }
        // A service replica was told when the heal planned it.
        if placement.template.is_none() && !already {
            self.events.record(
                ObjectKind::Jail,
                name,
                "Scheduled",
                EventType::Normal,
                format!(
                    "placed on node {} (epoch {})",
                    placement.node, placement.epoch
                ),
                Some(&placement.node),
            );
        }
        let mut ops = ops;
        ops.extend(self.apply(vec![Op::PutPlacement {
            name: name.to_string(),
            placement,
        }]));
        ops
    }

    /// The node the registry pins `volumes` to, with the volume that pins
    /// it; 409 when they are on different nodes.
    pub(super) fn volume_home(
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
        if !self.not_dead(node, now) {
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

    /// Removes the placement of `name` on `node` (after the node confirmed the
    /// delete, or said it has no such jail).
    pub fn remove_placement(&mut self, name: &str, node: &str) -> Vec<Op> {
        match self.state.placements.get(name) {
            Some(p) if p.node == node => {
                self.forget_drain(name);
                self.apply(vec![Op::RemovePlacement {
                    name: name.to_string(),
                }])
            }
            _ => Vec::new(),
        }
    }
}
