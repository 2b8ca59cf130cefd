//! Services: replica sets behind VIPs, their endpoints for the proxies,
//! and healing (planned here, carried out by a handler thread).
//!
//! Healing places a missing replica only where the node holding it is known
//! Dead; this file must never move a replica on a guess.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use super::dirty::Marked;
use super::drain::DrainThen;
use super::placements::Pending;
use super::rollout::rollout_status;
use super::{Cluster, Refusal, Target};
use crate::common::cidr::derive_service_vip;
use crate::common::names::{replica_name, replica_of, replica_volume_name, reserved_for_replicas};
use crate::common::wire::{
    EventType, Liveness, ObjectKind, ReplicaStatus, Resources, ServiceApply, ServiceEndpoints,
    ServiceStatus,
};
use crate::controlplane::state::{Op, Placement, ServiceRecord};

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
        /// The template digest planned: when the service's template changed
        /// since, the apply is not sent (the next pass plans it again).
        template: String,
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

impl Cluster {
    /// Creates, scales or updates a service. The port is immutable and so
    /// are the template's volumes (409 naming the field); the VIP is
    /// allocated once and kept. A new template becomes the next revision and
    /// starts a rollout (see `rollout`).
    pub fn put_service(
        &mut self,
        name: &str,
        apply: &ServiceApply,
        now: Instant,
    ) -> Result<Vec<Op>, Refusal> {
        let conflict = |field: &str, what: String| Refusal {
            status: 409,
            message: what,
            field: Some(field.to_string()),
        };
        self.check_service_apply(name, apply)?;
        let record = match self.state.services.get(name) {
            Some(existing) => {
                let mut record = existing.clone();
                record.applied = apply.clone();
                if existing.applied.template_digest != apply.template_digest {
                    record.add_revision(apply.document.clone(), apply.template_digest.clone());
                }
                record
            }
            None => {
                let taken: BTreeSet<Ipv4Addr> =
                    self.state.services.values().map(|s| s.vip).collect();
                let vip = derive_service_vip(name, self.service_cidr, &taken)
                    .map_err(|e| conflict("spec", e.to_string()))?;
                ServiceRecord::first(apply.clone(), vip)
            }
        };
        Ok(self.put_service_record(name, record, now))
    }

    /// What [`Cluster::put_service`] of `apply` would be refused for (a
    /// changed port or volume list, a name taken by jails), changing
    /// nothing; the apply recorded now, `None` for a new service. A diff
    /// asks this before comparing documents.
    pub fn check_service_apply(
        &self,
        name: &str,
        apply: &ServiceApply,
    ) -> Result<Option<ServiceApply>, Refusal> {
        let conflict = |field: &str, what: String| Refusal {
            status: 409,
            message: what,
            field: Some(field.to_string()),
        };
        match self.state.services.get(name) {
            Some(existing) => {
                if existing.applied.port != apply.port {
                    return Err(conflict(
                        "spec.port",
                        format!(
                            "service {name} has port {}; the port is the VIP's identity and cannot change (delete and re-create the service)",
                            existing.applied.port
                        ),
                    ));
                }
                if existing.applied.volumes != apply.volumes {
                    return Err(conflict(
                        "spec.template.volumes",
                        format!(
                            "service {name} has volumes [{}]; a rolling update keeps every replica's volumes, so they cannot change (delete and re-create the service)",
                            existing.applied.volumes.join(", ")
                        ),
                    ));
                }
                Ok(Some(existing.applied.clone()))
            }
            None => {
                self.check_new_service_name(name)?;
                Ok(None)
            }
        }
    }

    /// Records `record` for service `name` unless it is what is recorded;
    /// a new revision starts its rollout's progress clock.
    pub(super) fn put_service_record(
        &mut self,
        name: &str,
        record: ServiceRecord,
        now: Instant,
    ) -> Vec<Op> {
        let previous = self.state.services.get(name);
        if previous == Some(&record) {
            return Vec::new();
        }
        if previous.is_some_and(|p| p.revision != record.revision) {
            self.rollout_started(name, now);
        }
        self.apply(vec![Op::PutService {
            name: name.to_string(),
            record,
        }])
    }

    /// A new service must not take reserved names or the names of jails
    /// that exist: every `{name}-{index}` would be its replica, adopted by
    /// it and deleted with it. Placed jails and applies in flight count.
    fn check_new_service_name(&self, name: &str) -> Result<(), Refusal> {
        if let Some(why) = reserved_for_replicas(name) {
            return Err(Refusal {
                status: 400,
                message: why,
                field: Some("metadata.name".into()),
            });
        }
        let prefix = format!("{name}-");
        let placed = self
            .state
            .placements
            .range(prefix.clone()..)
            .take_while(|(jail, _)| jail.starts_with(&prefix))
            .map(|(jail, p)| (jail, &p.node));
        let in_flight = self
            .pending
            .range(prefix.clone()..)
            .take_while(|(jail, _)| jail.starts_with(&prefix))
            .map(|(jail, p)| (jail, &p.node));
        let taken = placed
            .chain(in_flight)
            .find(|(jail, _)| replica_of(jail).is_some_and(|(s, _)| s == name));
        match taken {
            None => Ok(()),
            Some((jail, node)) => Err(Refusal {
                status: 409,
                message: format!(
                    "jail {jail} exists (on node {node}), and a service {name} would name one of its replicas {jail}; \
                     delete the jail (keelctl delete jail {jail}) or choose another service name"
                ),
                field: Some("metadata.name".into()),
            }),
        }
    }

    /// The document of a service and its template digest, for forwarding
    /// replica applies.
    pub fn service_document(&self, name: &str) -> Option<(String, String)> {
        self.state.services.get(name).map(|s| {
            (
                s.applied.document.clone(),
                s.applied.template_digest.clone(),
            )
        })
    }

    /// Every placed replica of `name` (`{name}-{index}`), with its index.
    pub(super) fn placed_replicas(&self, name: &str) -> Vec<(u32, String, Placement)> {
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
    /// is ready when its node is Alive and reports its workload ready under
    /// the replica's current epoch (a report under an older one is of the
    /// workload a rolling update replaced), and it is not draining. On a
    /// node not heard from since a restart (Unknown, or vouched for by the
    /// cluster's record, which says nothing of its jails) it is
    /// `NodeUnknown`: not ready, since no report vouches for it, but not
    /// gone either.
    pub(super) fn replica_view(&self, name: &str, now: Instant) -> Vec<ReplicaStatus> {
        let record = self.state.services.get(name);
        self.placed_replicas(name)
            .into_iter()
            .map(|(_, replica, p)| {
                let liveness = self
                    .reported_liveness(&p.node, now)
                    .unwrap_or(Liveness::Dead);
                let reported = self
                    .live
                    .get(&p.node)
                    .and_then(|l| l.reported.get(&replica))
                    .filter(|r| r.epoch == p.epoch)
                    .copied();
                let draining = self.draining.contains_key(&replica);
                let (state, ready) = match (liveness, reported) {
                    (Liveness::Dead, _) => ("NodeDead", false),
                    (Liveness::Unknown, _) => ("NodeUnknown", false),
                    // Out of the rotation, still running its connections.
                    (Liveness::Alive, Some(r)) if draining && r.running => ("Draining", false),
                    (Liveness::Alive, None) => ("Pending", false),
                    // Only a ready replica takes traffic: one whose process
                    // runs but whose health check fails is out of rotation.
                    (Liveness::Alive, Some(r)) if r.ready => ("Running", true),
                    (Liveness::Alive, Some(r)) if r.running => ("NotReady", false),
                    (Liveness::Alive, Some(_)) => ("NotRunning", false),
                };
                let address = reported.and_then(|r| r.address);
                ReplicaStatus {
                    name: replica,
                    node: p.node,
                    address,
                    state: state.into(),
                    ready: ready && address.is_some(),
                    revision: record.and_then(|r| r.revision_of(p.template.as_deref())),
                    updated: record.is_some_and(|r| r.is_current(p.template.as_deref())),
                }
            })
            .collect()
    }

    /// `GET /services/{name}`.
    pub fn service_status(&self, name: &str, now: Instant) -> Option<ServiceStatus> {
        let rec = self.state.services.get(name)?;
        let replicas = self.replica_view(name, now);
        let in_range =
            |r: &&ReplicaStatus| replica_of(&r.name).is_some_and(|(_, i)| i < rec.applied.replicas);
        Some(ServiceStatus {
            name: name.to_string(),
            vip: rec.vip,
            port: rec.applied.port,
            desired: rec.applied.replicas,
            ready: replicas.iter().filter(|r| r.ready).count() as u32,
            stateful: rec.applied.stateful,
            revision: rec.revision,
            updated: replicas
                .iter()
                .filter(in_range)
                .filter(|r| r.updated)
                .count() as u32,
            rollout: rec.rollout.as_ref().map(rollout_status),
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
    /// A service with a replica on an Unknown node is marked `unsettled`: its
    /// list lacks replicas that may well serve, so a proxy that routes the
    /// service already keeps the replicas it has (see [`ServiceEndpoints`]).
    pub fn endpoints(&self, now: Instant) -> Vec<ServiceEndpoints> {
        self.state
            .services
            .keys()
            .filter_map(|name| self.service_endpoints(name, now))
            .collect()
    }

    /// Service `name`'s entry of [`Cluster::endpoints`]; `None` when there
    /// is no such service.
    pub(super) fn service_endpoints(&self, name: &str, now: Instant) -> Option<ServiceEndpoints> {
        let rec = self.state.services.get(name)?;
        let view = self.replica_view(name, now);
        Some(ServiceEndpoints {
            name: name.to_string(),
            vip: rec.vip,
            port: rec.applied.port,
            // A retiring service's list empties for good.
            unsettled: !self.retiring.contains(name)
                && view.iter().any(|r| r.state == "NodeUnknown"),
            replicas: view
                .into_iter()
                .filter(|r| r.ready)
                .filter_map(|r| r.address.map(|a| SocketAddrV4::new(a, rec.applied.port)))
                .collect(),
        })
    }

    /// What it takes to bring service `name` to its desired replicas and
    /// its current template, for every service not already being healed (all
    /// services when `only` is `None`). Marks them as healing until
    /// [`Cluster::heal_done`].
    ///
    /// A replica index counts as present when its node is not Dead (Alive,
    /// or Unknown after a restart), or, for a stateful service, placed at
    /// all: a stateful replica on a Dead node is neither replaced nor torn
    /// down; it waits for its node and its data. Missing indices are placed
    /// with the spreading scheduler. Indices at or beyond the desired count
    /// (plus the surge slots of a rollout, see `rollout`) are drained, then
    /// removed. Replicas on an older template are replaced as `rollout`
    /// plans.
    ///
    /// Without `only`, only the services whose inputs changed since their
    /// last plan are planned (see [`super::dirty`]); one that is being
    /// healed is planned again when its heal is over.
    pub fn plan_heal(&mut self, only: Option<&str>, now: Instant) -> Vec<HealAction> {
        let names: Vec<String> = match only {
            Some(n) => vec![n.to_string()],
            None => {
                // A node that died by the clock alone is noticed first: it
                // marks what it concerns.
                self.notice_deaths(now);
                match self.take_heal_marks(now) {
                    Marked::All => self.state.services.keys().cloned().collect(),
                    Marked::Only(names) => names.into_iter().collect(),
                }
            }
        };
        let mut actions = Vec::new();
        // What this plan placed on each node so far (resources, replicas):
        // the nodes report it only once the applies are answered, and a lost
        // node's replicas, planned together, must not all go to the node
        // that had the most headroom when the plan began.
        let mut planned: BTreeMap<String, (Resources, u32)> = BTreeMap::new();
        for name in names {
            if self.healing.contains(&name) || self.retiring.contains(&name) {
                continue;
            }
            let Some(rec) = self.state.services.get(&name).cloned() else {
                continue;
            };
            self.dirty.work.planned += 1;
            // Set where the plan waits on something a later plan decides.
            let mut waits = false;
            let slots = self.replica_slots(&name, &rec, now);
            let placed = self.placed_replicas(&name);
            let mut service_actions = Vec::new();
            for (index, replica, p) in &placed {
                if *index < slots {
                    // Scaled back up while it drained: it serves again.
                    self.cancel_drain(replica, DrainThen::Remove);
                    continue;
                }
                let drain_timeout = Duration::from_millis(rec.applied.policy.drain_timeout_ms);
                if self.drained(replica, p, DrainThen::Remove, drain_timeout, now) {
                    let addr = self.resolve_node(&p.node, now).ok();
                    service_actions.push(HealAction::Remove {
                        service: name.clone(),
                        replica: replica.clone(),
                        node: p.node.clone(),
                        addr,
                    });
                }
            }
            let present =
                |c: &Cluster, p: &Placement| rec.applied.stateful || c.not_dead(&p.node, now);
            let mut occupied: BTreeSet<String> = placed
                .iter()
                .filter(|(i, _, p)| *i < slots && present(self, p))
                .map(|(_, _, p)| p.node.clone())
                .collect();
            for index in 0..slots {
                let replica = replica_name(&name, index);
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
                    .map(|v| replica_volume_name(&replica, v))
                    .collect();
                // A replica whose data is on a node (it ran there before a
                // scale-down) goes back there, or waits while it is Dead.
                let node = match self.volume_home(&replica, &replica_volumes) {
                    Ok(Some((home, _))) => {
                        if self.liveness(&home, now) != Some(Liveness::Alive) {
                            waits = true;
                            continue;
                        }
                        home
                    }
                    Ok(None) => {
                        let avoid: BTreeSet<&str> = occupied.iter().map(String::as_str).collect();
                        let Some(node) = self.heal_pick(&planned, &avoid, now) else {
                            waits = true;
                            break; // no Alive node: the next heartbeat tries again
                        };
                        let entry = planned.entry(node.clone()).or_default();
                        let each = rec.applied.resources.unwrap_or_default().resources();
                        entry.0.cpu += each.cpu;
                        entry.0.memory = entry.0.memory.saturating_add(each.memory);
                        entry.1 += 1;
                        node
                    }
                    Err(_) => {
                        waits = true;
                        continue;
                    }
                };
                let lost = self.state.placements.get(&replica).map(|p| p.node.clone());
                match self.place_replica(&name, &rec, &replica, &node, now) {
                    Some(action) => {
                        let (reason, event_type, message) = match &lost {
                            Some(dead) => (
                                "Rescheduled",
                                EventType::Warning,
                                format!(
                                    "replica {replica} of service {name} was on node {dead}, which is Dead; placed on node {node}"
                                ),
                            ),
                            None => (
                                "Scheduled",
                                EventType::Normal,
                                format!(
                                    "replica {replica} of service {name} placed on node {node}"
                                ),
                            ),
                        };
                        self.events.record(
                            ObjectKind::Jail,
                            &replica,
                            reason,
                            event_type,
                            message,
                            Some(&node),
                        );
                        occupied.insert(node);
                        service_actions.push(action);
                    }
                    None => waits = true,
                }
            }
            service_actions.extend(self.plan_updates(&name, &rec, now));
            // Drains end on time or on other nodes' reports, rollouts on
            // readiness and deadlines: plan such a service on every call.
            let prefix = format!("{name}-");
            waits |= self.progress.contains_key(&name)
                || self
                    .draining
                    .range(prefix.clone()..)
                    .next()
                    .is_some_and(|(r, _)| r.starts_with(&prefix));
            if waits && only.is_none() {
                self.keep_heal_mark(&name);
            }
            if !service_actions.is_empty() {
                self.healing.insert(name);
                actions.extend(service_actions);
            }
        }
        actions
    }

    /// Marks replica `replica` of service `name` in flight to `node` under a
    /// new epoch with the service's current template, and returns the
    /// action that applies it; `None` when the node cannot be reached.
    pub(super) fn place_replica(
        &mut self,
        name: &str,
        rec: &ServiceRecord,
        replica: &str,
        node: &str,
        now: Instant,
    ) -> Option<HealAction> {
        let addr = self.resolve_node(node, now).ok()?;
        let volumes: Vec<String> = rec
            .applied
            .volumes
            .iter()
            .map(|v| replica_volume_name(replica, v))
            .collect();
        let epoch = self.next_epoch();
        self.pending.insert(
            replica.to_string(),
            Pending {
                node: node.to_string(),
                epoch,
                count: 1,
                volumes: volumes.clone(),
                template: Some(rec.applied.template_digest.clone()),
            },
        );
        Some(HealAction::Place {
            service: name.to_string(),
            replica: replica.to_string(),
            target: Target {
                node: node.to_string(),
                addr,
                epoch,
            },
            volumes,
            template: rec.applied.template_digest.clone(),
        })
    }

    /// The heal of these services is over (whatever its outcome).
    pub fn heal_done(&mut self, services: &[String]) {
        for s in services {
            self.healing.remove(s);
            // What it did (or failed to do) is planned on from here.
            self.mark_service(s);
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
        if self.retiring.remove(name) {
            self.mark_service(name);
        }
        let ops = self.apply(vec![Op::RemoveService {
            name: name.to_string(),
        }]);
        Ok((ops, removals))
    }
}
