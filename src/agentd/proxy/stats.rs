//! The proxy's per-service counters: connections open and accepted, bytes
//! relayed each way. The event loops bump them with relaxed atomic adds (no
//! lock, nothing awaited); the metrics listener reads them through
//! [`ProxyStats::snapshot`] without asking the proxy's control loop.
//!
//! Owns the counters and the table of them by service name; it never looks
//! at a socket. The control loop adds a service's counters when it opens
//! its listener and forgets them when the service is removed (a counter that
//! starts again from zero is a reset Prometheus expects); connections still
//! relaying for a removed service keep their own reference and update it
//! unseen.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::common::sync::lock;

/// One service's counters.
#[derive(Debug, Default)]
pub struct ServiceCounters {
    /// Client connections relayed to a replica now (kept by the replica's
    /// connection guard, `balance::Open`).
    pub open: AtomicU64,
    /// Client connections accepted since the service was added.
    pub accepted: AtomicU64,
    /// Bytes read from clients and relayed to replicas.
    pub to_replica: AtomicU64,
    /// Bytes read from replicas and relayed to clients.
    pub to_client: AtomicU64,
}

impl ServiceCounters {
    /// Counts a connection accepted.
    pub fn accepted(&self) {
        self.accepted.fetch_add(1, Ordering::Relaxed);
    }
}

/// One service's counters as read at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServiceSample {
    /// See [`ServiceCounters::open`].
    pub open: u64,
    /// See [`ServiceCounters::accepted`].
    pub accepted: u64,
    /// See [`ServiceCounters::to_replica`].
    pub to_replica: u64,
    /// See [`ServiceCounters::to_client`].
    pub to_client: u64,
}

/// Every served service's counters; see the module docs.
#[derive(Debug, Default)]
pub struct ProxyStats {
    services: Mutex<BTreeMap<String, Arc<ServiceCounters>>>,
}

impl ProxyStats {
    /// `service`'s counters, created at zero when it has none (a rebound
    /// service keeps its own).
    pub fn counters(&self, service: &str) -> Arc<ServiceCounters> {
        Arc::clone(lock(&self.services).entry(service.to_string()).or_default())
    }

    /// Forgets a removed service's counters.
    pub fn forget(&self, service: &str) {
        lock(&self.services).remove(service);
    }

    /// Every service's counters now, by name.
    pub fn snapshot(&self) -> Vec<(String, ServiceSample)> {
        lock(&self.services)
            .iter()
            .map(|(name, c)| {
                let sample = ServiceSample {
                    open: c.open.load(Ordering::Relaxed),
                    accepted: c.accepted.load(Ordering::Relaxed),
                    to_replica: c.to_replica.load(Ordering::Relaxed),
                    to_client: c.to_client.load(Ordering::Relaxed),
                };
                (name.clone(), sample)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agentd::proxy::balance::{Backends, EJECT_INITIAL};
    use crate::common::backoff::SystemClock;
    use std::net::{Ipv4Addr, SocketAddrV4};

    #[test]
    fn a_connection_is_open_while_its_replica_guard_lives() {
        let stats = ProxyStats::default();
        let web = stats.counters("web");
        let replica = SocketAddrV4::new(Ipv4Addr::new(10, 20, 0, 2), 80);
        let backends = Backends::with_counters(
            &[replica],
            Arc::new(SystemClock),
            EJECT_INITIAL,
            Arc::clone(&web),
        );
        web.accepted();
        web.accepted();
        let pick = |b: &Backends| b.pick().expect("a replica").iter().next().cloned();
        let first = pick(&backends).expect("first").open();
        let second = pick(&backends).expect("second").open();
        first.counters().to_client.fetch_add(10, Ordering::Relaxed);
        drop(first);
        let sample = stats.snapshot();
        assert_eq!(
            sample,
            [(
                "web".to_string(),
                ServiceSample {
                    open: 1,
                    accepted: 2,
                    to_replica: 0,
                    to_client: 10
                }
            )]
        );
        drop(second);
        assert_eq!(stats.snapshot()[0].1.open, 0);
        assert!(
            Arc::ptr_eq(&web, &stats.counters("web")),
            "kept while served"
        );
        stats.forget("web");
        assert_eq!(stats.snapshot(), []);
    }
}
