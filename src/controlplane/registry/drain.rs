//! Connection draining: a replica leaving the rotation (scaled away,
//! replaced by a rolling update) first stops getting new connections, and
//! only then is stopped or replaced.
//!
//! A draining replica is left out of every endpoint list (see
//! `services::replica_view`), so the proxies stop sending it new
//! connections while the ones they already relay carry on. It is *drained*
//! when the proxies' own counts say its connections are over (every Alive
//! node's heartbeat reports it applied a table without the replica, and
//! none reports a connection open to it: see `endpoints`), or when the
//! service's `drainTimeout` passed, whichever comes first; a replica on a
//! Dead node, which no proxy can reach, is drained at once. Drains live in
//! memory only: after a restart a leaving replica simply drains again.
//!
//! This file decides when a drain is over; it must never stop a replica
//! itself (healing does, once told).

use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use super::{Cluster, Refusal};
use crate::common::names::replica_of;
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
    /// The first endpoint generation without it: once every Alive node's
    /// proxy applied it, no proxy sends it a new connection.
    pub(super) generation: u64,
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
        if !self.draining.contains_key(replica) {
            // Out of the table from this generation on (a replica that was
            // not in it leaves it unchanged, and the current one will do).
            self.mark_replica(replica);
            self.draining.insert(
                replica.to_string(),
                Drain {
                    deadline: now + timeout,
                    generation: 0,
                    then,
                },
            );
            self.recompute_endpoints(now);
            let generation = self.endpoints_generation();
            if let Some(d) = self.draining.get_mut(replica) {
                d.generation = generation;
            }
        }
        let Some(drain) = self.draining.get_mut(replica) else {
            return false;
        };
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
    /// replica has applied an endpoint table without it and reports none
    /// open to it. A node that has not reported since does not count as
    /// zero: until every Alive node's heartbeat says it applied the
    /// drain's generation, the drain goes on (absence of a count is not
    /// zero). A replica never reported with an address was in no table.
    fn connections_over(&self, replica: &str, p: &Placement, d: &Drain, now: Instant) -> bool {
        let address = self
            .live
            .get(&p.node)
            .and_then(|l| l.reported.get(replica))
            .and_then(|r| r.address);
        let port = replica_of(replica)
            .and_then(|(service, _)| self.state.services.get(service))
            .map(|s| s.applied.port);
        let (Some(address), Some(port)) = (address, port) else {
            return true;
        };
        self.endpoints_caught_up(d.generation, now)
            && self.open_connections(SocketAddrV4::new(address, port), now) == 0
    }

    /// Ends `replica`'s drain of kind `then`, if it has one: it serves again.
    pub(super) fn cancel_drain(&mut self, replica: &str, then: DrainThen) {
        if self.draining.get(replica).is_some_and(|d| d.then == then) {
            self.draining.remove(replica);
            self.mark_replica(replica);
        }
    }

    /// Forgets `replica`'s drain: it was removed or replaced.
    pub(super) fn forget_drain(&mut self, replica: &str) {
        if self.draining.remove(replica).is_some() {
            self.mark_replica(replica);
        }
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
        self.mark_service(name);
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
