//! Rolling updates: template revisions, the replacement of replicas one
//! budget at a time, the progress deadline, scaling and undo.
//!
//! A template change makes the next revision (the last
//! [`MAX_REVISIONS`](crate::controlplane::state::MAX_REVISIONS) are kept)
//! and starts a rollout to it. Each heal pass then replaces replicas still
//! on an older template, in place: same node, same address, a new epoch
//! and the new document, after the replica drained (see `drain`). The
//! budget is the service's `spec.update`, as Kubernetes reads it:
//!
//! - never fewer than `replicas - maxUnavailable` ready replicas because of
//!   the update: a ready replica is taken out only when the others keep the
//!   count, so the next one waits until the new one is ready;
//! - up to `maxSurge` extra replicas, at indices from `replicas` on, with
//!   the new template, removed once no old replica is left;
//! - a replica that is not ready anyway is replaced first (it costs nothing).
//!
//! Stateful replicas are updated in place one at a time (`maxUnavailable`
//! 1, no surge): a surge replica would have no data. When no new replica
//! became ready for `progressDeadline` the rollout stops: nothing more is
//! replaced, the replicas not yet replaced keep the old template and keep
//! serving, until the next template change or an undo. Progress is what
//! Kubernetes counts for a Deployment: a replica applied with the new
//! template, or one of them becoming ready; so a slow drain or a slow start
//! does not stop a rollout that moves, and one new replica that never gets
//! ready stops it one deadline after it was applied.
//!
//! The progress clock lives in memory: a restarted control plane gives a
//! rollout a full deadline again rather than stopping it on a gap it did not
//! observe. The outcome (Progressing, Complete, Stopped) is persisted.

use std::time::{Duration, Instant};

use super::drain::DrainThen;
use super::services::HealAction;
use super::{Cluster, Refusal};
use crate::common::names::{MAX_NAME_LEN, MAX_REPLICAS, replica_name, replica_of, validate_name};
use crate::common::wire::{EventType, Liveness, ObjectKind, RolloutStatus, ServiceRevision};
use crate::controlplane::state::{
    MAX_REVISIONS, Op, RevisionRecord, RolloutOutcome, RolloutRecord, ServiceRecord,
};

/// The wire form of a persisted rollout.
pub(super) fn rollout_status(r: &RolloutRecord) -> RolloutStatus {
    let (state, reason) = match &r.outcome {
        RolloutOutcome::Progressing => ("Progressing", None),
        RolloutOutcome::Complete => ("Complete", None),
        RolloutOutcome::Stopped { reason } => ("Stopped", Some(reason.clone())),
    };
    RolloutStatus {
        revision: r.revision,
        state: state.into(),
        reason,
    }
}

impl ServiceRecord {
    /// Makes `document` (with template `digest`) the next revision and
    /// starts rolling it out; the oldest revisions beyond the kept number
    /// are forgotten.
    pub fn add_revision(&mut self, document: String, digest: String) {
        let mut history = self.revisions();
        self.revision += 1;
        history.push(RevisionRecord {
            revision: self.revision,
            created_unix: crate::common::auth::unix_now(),
            document,
            template_digest: digest,
        });
        let excess = history.len().saturating_sub(MAX_REVISIONS);
        history.drain(..excess);
        self.history = history;
        self.rollout = Some(RolloutRecord {
            revision: self.revision,
            outcome: RolloutOutcome::Progressing,
        });
    }
}

impl Cluster {
    /// A rollout of `service` started (or restarted its clock) at `now`.
    pub(super) fn rollout_started(&mut self, service: &str, now: Instant) {
        self.progress.insert(service.to_string(), (now, 0));
    }

    /// Starts the progress clock of every rollout in progress at `now` (a
    /// control plane's start).
    pub(super) fn restart_rollout_clocks(&mut self, now: Instant) {
        for name in self.progressing_services() {
            let score = self.rollout_score(&name, now);
            self.progress.insert(name, (now, score));
        }
    }

    /// The services whose rollout is in progress.
    fn progressing_services(&self) -> Vec<String> {
        self.progressing.iter().cloned().collect()
    }

    /// Finds the services whose rollout is in progress from scratch (at
    /// the start, and when the state was reloaded).
    pub(super) fn index_rollouts(&mut self) {
        self.progressing = self
            .state
            .services
            .iter()
            .filter(|(_, r)| progressing(r))
            .map(|(n, _)| n.clone())
            .collect();
    }

    /// Service `name`'s record changed (or is gone): whether its rollout is
    /// in progress now. Scanning every record instead cost a sweep of every
    /// service per heartbeat.
    pub(super) fn note_rollout(&mut self, name: &str) {
        if self.state.services.get(name).is_some_and(progressing) {
            self.progressing.insert(name.to_string());
        } else {
            self.progressing.remove(name);
        }
    }

    /// How far a rollout got: replicas below the desired count on the
    /// current template, plus those of them ready. It grows with every
    /// replica applied and every one that becomes ready (see the module
    /// docs).
    fn rollout_score(&self, name: &str, now: Instant) -> u32 {
        let Some(n) = self.state.services.get(name).map(|r| r.applied.replicas) else {
            return 0;
        };
        self.replica_view(name, now)
            .iter()
            .filter(|r| r.updated && replica_of(&r.name).is_some_and(|(_, i)| i < n))
            .map(|r| 1 + u32::from(r.ready))
            .sum()
    }

    /// Indices a service may have placed now: its desired count, and during
    /// a rollout as many surge slots as `maxSurge` allows while replicas on
    /// an older template remain.
    pub(super) fn replica_slots(&self, name: &str, rec: &ServiceRecord, _now: Instant) -> u32 {
        let n = rec.applied.replicas;
        if rec.applied.stateful || !progressing(rec) {
            return n;
        }
        let outdated = self
            .placed_replicas(name)
            .iter()
            .filter(|(i, _, p)| *i < n && !rec.is_current(p.template.as_deref()))
            .count() as u32;
        n + rec.applied.policy.max_surge.min(outdated)
    }

    /// The replacements the budget allows this pass (see the module docs):
    /// drains started, and applies of replicas whose drain is over.
    pub(super) fn plan_updates(
        &mut self,
        name: &str,
        rec: &ServiceRecord,
        now: Instant,
    ) -> Vec<HealAction> {
        if !progressing(rec) {
            return Vec::new();
        }
        let n = rec.applied.replicas;
        let max_unavailable = if rec.applied.stateful {
            1
        } else {
            rec.applied.policy.max_unavailable
        };
        let min_ready = n.saturating_sub(max_unavailable);
        let drain_timeout = Duration::from_millis(rec.applied.policy.drain_timeout_ms);
        let view = self.replica_view(name, now);
        let mut ready = view.iter().filter(|r| r.ready).count() as u32;
        // Outdated replicas on Alive nodes, not being applied: the ones not
        // ready first, then by index.
        let mut outdated: Vec<(bool, u32, String)> = view
            .iter()
            .filter(|r| !r.updated && !self.pending.contains_key(&r.name))
            .filter(|r| self.reported_liveness(&r.node, now) == Some(Liveness::Alive))
            .filter_map(|r| {
                let (_, index) = replica_of(&r.name)?;
                (index < n).then(|| (r.ready, index, r.name.clone()))
            })
            .collect();
        outdated.sort();
        let mut actions = Vec::new();
        for (was_ready, _, replica) in outdated {
            let Some(p) = self.state.placements.get(&replica).cloned() else {
                continue;
            };
            if !self.draining_for(&replica, DrainThen::Replace) {
                if was_ready && ready <= min_ready {
                    continue;
                }
                if was_ready {
                    ready -= 1;
                }
                self.events.record(
                    ObjectKind::Service,
                    name,
                    "RolloutStep",
                    EventType::Normal,
                    format!(
                        "rolling replica {replica} on node {} to revision {}",
                        p.node, rec.revision
                    ),
                    Some(&p.node),
                );
            }
            if self.drained(&replica, &p, DrainThen::Replace, drain_timeout, now)
                && let Some(action) = self.place_replica(name, rec, &replica, &p.node, now)
            {
                actions.push(action);
            }
        }
        actions
    }

    /// Decides the outcome of every rollout in progress: Complete when every
    /// desired replica runs the current template and is ready and no surge
    /// replica is left; Stopped when it made no progress (see the module
    /// docs) within the progress deadline. Returns the ops recording the
    /// outcomes.
    pub fn advance_rollouts(&mut self, now: Instant) -> Vec<Op> {
        let mut ops = Vec::new();
        for name in self.progressing_services() {
            let Some(mut rec) = self.state.services.get(&name).cloned() else {
                continue;
            };
            let n = rec.applied.replicas;
            let view = self.replica_view(&name, now);
            let in_range = |r: &&crate::common::wire::ReplicaStatus| {
                replica_of(&r.name).is_some_and(|(_, i)| i < n)
            };
            let updated_ready = view
                .iter()
                .filter(in_range)
                .filter(|r| r.updated && r.ready)
                .count() as u32;
            let score = self.rollout_score(&name, now);
            let settled = view.iter().all(|r| r.updated)
                && view.iter().filter(in_range).count() as u32 == n
                && !view
                    .iter()
                    .any(|r| replica_of(&r.name).is_some_and(|(_, i)| i >= n));
            let outcome = if updated_ready == n && settled {
                self.events.normal(
                    ObjectKind::Service,
                    &name,
                    "RolloutComplete",
                    format!("rollout of revision {} complete", rec.revision),
                );
                Some(RolloutOutcome::Complete)
            } else {
                let (since, best) = *self.progress.entry(name.clone()).or_insert((now, score));
                if score > best {
                    self.progress.insert(name.clone(), (now, score));
                    None
                } else {
                    let deadline = Duration::from_millis(rec.applied.policy.progress_deadline_ms);
                    (now.saturating_duration_since(since) > deadline).then(|| {
                        let reason = stop_reason(&view, n, rec.revision, deadline, updated_ready);
                        self.events.warning(
                            ObjectKind::Service,
                            &name,
                            "RolloutStopped",
                            format!("rollout stopped: {reason}"),
                        );
                        RolloutOutcome::Stopped { reason }
                    })
                }
            };
            if let Some(outcome) = outcome {
                self.progress.remove(&name);
                rec.rollout = Some(RolloutRecord {
                    revision: rec.revision,
                    outcome,
                });
                ops.extend(self.put_service_record(&name, rec, now));
            }
        }
        ops
    }

    /// `POST /services/{name}/scale`: the desired count, nothing else.
    pub fn scale_service(
        &mut self,
        name: &str,
        replicas: u32,
        now: Instant,
    ) -> Result<Vec<Op>, Refusal> {
        let Some(mut rec) = self.state.services.get(name).cloned() else {
            return Err(Refusal::new(404, format!("no service named {name}")));
        };
        let field = |message: String| Refusal {
            status: 400,
            message,
            field: Some("replicas".into()),
        };
        if replicas > MAX_REPLICAS {
            return Err(field(format!(
                "{replicas} replicas is out of range: at most {MAX_REPLICAS}"
            )));
        }
        let last = replica_name(name, replicas.saturating_sub(1));
        if validate_name(&last).is_err() {
            return Err(field(format!(
                "replica name {last:?} would be longer than {MAX_NAME_LEN} characters"
            )));
        }
        rec.applied.replicas = replicas;
        Ok(self.put_service_record(name, rec, now))
    }

    /// `POST /services/{name}/undo`: rolls back to revision `to`, or to the
    /// one before the current, as a new revision (the replicas count, port
    /// and update policy stay as they are).
    pub fn undo_service(
        &mut self,
        name: &str,
        to: Option<u64>,
        now: Instant,
    ) -> Result<(u64, Vec<Op>), Refusal> {
        let Some(mut rec) = self.state.services.get(name).cloned() else {
            return Err(Refusal::new(404, format!("no service named {name}")));
        };
        let revisions = rec.revisions();
        let kept = || {
            revisions
                .iter()
                .map(|r| r.revision.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let target = match to {
            Some(n) => revisions
                .iter()
                .find(|r| r.revision == n)
                .ok_or_else(|| Refusal {
                    status: 404,
                    message: format!(
                        "service {name} has no revision {n}; the revisions kept are {}",
                        kept()
                    ),
                    field: Some("to-revision".into()),
                })?,
            None => revisions.iter().rev().nth(1).ok_or_else(|| {
                Refusal::new(
                    409,
                    format!(
                        "service {name} has only revision {}; there is nothing to roll back to",
                        rec.revision
                    ),
                )
            })?,
        };
        if target.template_digest == rec.applied.template_digest {
            return Err(Refusal {
                status: 409,
                message: format!(
                    "revision {} of service {name} has the current template (revision {}); nothing to roll back",
                    target.revision, rec.revision
                ),
                field: to.map(|_| "to-revision".to_string()),
            });
        }
        let (document, digest) = (target.document.clone(), target.template_digest.clone());
        rec.applied.document = document.clone();
        rec.applied.template_digest = digest.clone();
        rec.add_revision(document, digest);
        let revision = rec.revision;
        Ok((revision, self.put_service_record(name, rec, now)))
    }

    /// `GET /services/{name}/revisions`, oldest first.
    pub fn service_revisions(&self, name: &str) -> Option<Vec<ServiceRevision>> {
        let rec = self.state.services.get(name)?;
        Some(
            rec.revisions()
                .into_iter()
                .map(|r| ServiceRevision {
                    current: r.revision == rec.revision,
                    revision: r.revision,
                    created_unix: r.created_unix,
                    template_digest: r.template_digest,
                    document: r.document,
                })
                .collect(),
        )
    }
}

fn progressing(rec: &ServiceRecord) -> bool {
    rec.rollout
        .as_ref()
        .is_some_and(|r| r.revision == rec.revision && r.outcome == RolloutOutcome::Progressing)
}

/// Why a rollout stopped: the first new replica that is not ready, with the
/// state it is in, or the count when none is placed yet.
fn stop_reason(
    view: &[crate::common::wire::ReplicaStatus],
    n: u32,
    revision: u64,
    deadline: Duration,
    updated_ready: u32,
) -> String {
    let deadline = crate::common::config::Interval(deadline);
    match view
        .iter()
        .find(|r| r.updated && !r.ready && replica_of(&r.name).is_some_and(|(_, i)| i < n))
    {
        Some(r) => format!(
            "replica {} of revision {revision} was not ready within the progress deadline ({deadline}); it is {} on node {}",
            r.name, r.state, r.node
        ),
        None => format!(
            "no replica of revision {revision} became ready within the progress deadline ({deadline}); {updated_ready} of {n} are updated and ready"
        ),
    }
}
