//! Connection draining: a replica leaving the rotation (scaled away,
//! replaced by a rolling update) first stops getting new connections, and
//! only then is stopped or replaced.
//!
//! A draining replica is left out of every endpoint list (see
//! `services::replica_view`), so the proxies stop sending it new
//! connections while the ones they already relay carry on. It is *drained*
//! when the proxies' own counts say its connections are over, or when the
//! service's `drainTimeout` passed, whichever comes first; a replica on a
//! Dead node, which no proxy can reach, is drained at once. Drains live in
//! memory only: after a restart a leaving replica simply drains again.
//!
//! This file decides when a drain is over; it must never stop a replica
//! itself (healing does, once told).

use std::time::{Duration, Instant};

use super::{Cluster, Refusal};
use crate::common::wire::Liveness;
use crate::controlplane::state::Placement;

/// What happens to a replica once drained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainThen {
    /// Deleted: it is beyond the desired count.
    Remove,
    /// Applied again with the service's current template (a rolling update).
    Replace,
}

/// One replica leaving the rotation.
#[derive(Debug, Clone)]
pub(super) struct Drain {
    /// When it is stopped whatever its connections.
    pub(super) deadline: Instant,
    pub(super) then: DrainThen,
}

impl Cluster {
    /// Whether `replica` (placed as `p`) may now be removed or replaced:
    /// starts its drain when it has none, and answers whether it is over.
    pub(super) fn drained(
        &mut self,
        replica: &str,
        p: &Placement,
        then: DrainThen,
        timeout: Duration,
        now: Instant,
    ) -> bool {
        if self.liveness(&p.node, now) == Some(Liveness::Dead) {
            return true;
        }
        let drain = self
            .draining
            .entry(replica.to_string())
            .or_insert_with(|| Drain {
                deadline: now + timeout,
                then,
            });
        drain.then = then;
        let drain = drain.clone();
        if now >= drain.deadline {
            log::info!(
                "replica {replica}: drain timeout ({} ms) reached, stopping it with its connections",
                timeout.as_millis()
            );
            return true;
        }
        self.connections_over(replica, p, &drain, now)
    }

    /// Whether every proxy that could hold a connection to the draining
    /// replica has applied an endpoint list without it and reports none
    /// open. Until the proxies report their counts, nothing is known, so a
    /// drain lasts its whole timeout: absence of a count is not zero.
    fn connections_over(&self, _replica: &str, _p: &Placement, _d: &Drain, _now: Instant) -> bool {
        false
    }

    /// Ends `replica`'s drain of kind `then`, if it has one: it serves again.
    pub(super) fn cancel_drain(&mut self, replica: &str, then: DrainThen) {
        if self.draining.get(replica).is_some_and(|d| d.then == then) {
            self.draining.remove(replica);
        }
    }

    /// Forgets `replica`'s drain: it was removed or replaced.
    pub(super) fn forget_drain(&mut self, replica: &str) {
        self.draining.remove(replica);
    }

    /// `DELETE /services/{name}`, first half: every replica of the service
    /// leaves the rotation and drains; nothing of it is healed or replaced
    /// meanwhile. The record stays until [`Cluster::remove_service`], so a
    /// control plane that stops in between still has the whole service.
    pub fn retire_service(&mut self, name: &str, now: Instant) -> Result<(), Refusal> {
        if !self.state.services.contains_key(name) {
            return Err(Refusal::new(404, format!("no service named {name}")));
        }
        self.retiring.insert(name.to_string());
        self.service_drained(name, now);
        Ok(())
    }

    /// Whether every replica of a retiring service has drained (true once
    /// its drain timeout passed; true for a service that is gone).
    pub fn service_drained(&mut self, name: &str, now: Instant) -> bool {
        let Some(rec) = self.state.services.get(name) else {
            return true;
        };
        let timeout = Duration::from_millis(rec.applied.policy.drain_timeout_ms);
        let mut all = true;
        for (_, replica, p) in self.placed_replicas(name) {
            all &= self.drained(&replica, &p, DrainThen::Remove, timeout, now);
        }
        all
    }

    /// Whether `replica` is draining to be replaced.
    pub(super) fn draining_for(&self, replica: &str, then: DrainThen) -> bool {
        self.draining.get(replica).is_some_and(|d| d.then == then)
    }
}
