//! The endpoint watcher: a `keel-endpoints` thread, started by the cluster
//! thread once the node is registered, that long-polls the control plane for the endpoint table
//! (`GET /nodes/{id}/endpoints?after=G`, signed with the node key) and hands
//! each newer one to the node's proxy at once, so a replica that stops
//! being ready elsewhere leaves this proxy's rotation within a round trip
//! instead of up to two heartbeat periods later.
//!
//! Two paths feed the proxy, and [`ProxyTable`] is where they meet: the
//! heartbeat path (the applier thread, after the worker aliased the
//! answer's VIPs) and this watcher. Both carry a table stamped with its
//! generation, and only a strictly newer stamp than the one applied reaches
//! the proxy ([`is_newer`]), so a heartbeat answer that was overtaken by a
//! push never puts an older table back.
//!
//! A control-plane restart numbers generations from 1 again. Every stamp
//! therefore carries the control plane's origin (a random number it picks
//! at start), and a stamp from another origin than the applied one is
//! always taken: the new process's tables supersede the old one's, whatever
//! their numbers. Comparing the raw generation alone would keep a proxy on
//! the old process's generation 50 until the new one reached 51; resetting
//! whenever a heartbeat answer is lower would let a slow answer undo a
//! newer push. A message from the old process that arrives after one from
//! the new (possible only in the instant of the restart) is itself
//! superseded by the next heartbeat or push, which is from the new origin.
//!
//! The watcher never aliases a VIP: that is the worker's, on the heartbeat
//! path. A pushed table that names a VIP the heartbeat path has not aliased
//! yet (a new service) is not applied here; the watcher asks the cluster
//! thread for an immediate heartbeat instead ([`super::membership::Wake`]),
//! whose answer aliases the VIP and then updates the proxy. With
//! `agent.proxy_listen` no VIP is aliased and every newer table is applied
//! directly.
//!
//! On any error (the control plane is down, refuses, or has too many polls
//! waiting) the watcher backs off (1 s doubling to 30 s) and polls again;
//! the heartbeat path goes on alone meanwhile. The thread is not joined at
//! shutdown (a poll may wait [`ENDPOINTS_WAIT`]); it holds the proxy table
//! only weakly, so it never keeps the proxy alive, and it ends at its next
//! wake-up once the table is gone. It never talks to the worker.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::agentd::cluster::error::ClusterError;
use crate::agentd::cluster::membership::{CONTROLPLANE_TIMEOUT, ControlPlane, Wake};
use crate::agentd::proxy::{Proxy, ProxyError};
use crate::common::backoff::{Backoff, Clock, Policy, SystemClock};
use crate::common::sync::lock;
use crate::common::wire::{ENDPOINTS_WAIT, EndpointsAnswer, ServiceEndpoints};

/// First wait after a failed poll; doubles up to [`POLL_RETRY_CAP`].
pub const POLL_RETRY_INITIAL: Duration = Duration::from_secs(1);
/// Longest wait after failed polls.
pub const POLL_RETRY_CAP: Duration = Duration::from_secs(30);

/// Which table a proxy holds: the control-plane process that numbered it
/// and its generation there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// The control plane's origin ([`EndpointsAnswer::origin`]).
    pub origin: u64,
    /// The table's generation under that origin.
    pub generation: u64,
}

/// Whether a table stamped `offered` may replace the one stamped `applied`;
/// see the module docs. A table without a stamp (a control plane without
/// generations) always may, and so does anything when nothing was applied.
pub fn is_newer(applied: Option<Stamp>, offered: Option<Stamp>) -> bool {
    match (applied, offered) {
        (Some(a), Some(o)) => a.origin != o.origin || o.generation > a.generation,
        _ => true,
    }
}

/// Whether every VIP of `services` is among those the heartbeat path had
/// aliased (`None`: it has not applied an answer yet); see the module docs.
pub fn aliased_already(
    aliased: Option<&BTreeSet<Ipv4Addr>>,
    services: &[ServiceEndpoints],
) -> bool {
    services
        .iter()
        .all(|s| aliased.is_some_and(|a| a.contains(&s.vip)))
}

/// Counters the agent's `GET /metrics` shows: heartbeats sent and endpoint
/// tables applied from each path.
#[derive(Debug, Default)]
pub struct ClusterCounters {
    /// Heartbeats sent (answered or not).
    pub heartbeats: AtomicU64,
    /// Tables the heartbeat path applied to the proxy.
    pub heartbeat_tables: AtomicU64,
    /// Tables the watcher applied to the proxy.
    pub pushed_tables: AtomicU64,
}

impl ClusterCounters {
    /// The Prometheus text of the counters.
    pub fn render(&self) -> String {
        format!(
            "# HELP keel_heartbeats_total Heartbeats this agent sent to the control plane.\n\
             # TYPE keel_heartbeats_total counter\n\
             keel_heartbeats_total {}\n\
             # HELP keel_endpoint_tables_applied_total Endpoint tables applied to the proxy, by the path that brought them.\n\
             # TYPE keel_endpoint_tables_applied_total counter\n\
             keel_endpoint_tables_applied_total{{path=\"heartbeat\"}} {}\n\
             keel_endpoint_tables_applied_total{{path=\"push\"}} {}\n",
            self.heartbeats.load(Ordering::Relaxed),
            self.heartbeat_tables.load(Ordering::Relaxed),
            self.pushed_tables.load(Ordering::Relaxed),
        )
    }
}

#[derive(Debug, Default)]
struct Applied {
    /// The stamp of the table the proxy holds.
    stamp: Option<Stamp>,
    /// The VIPs the heartbeat path had the worker alias last; `None` before
    /// its first answer.
    aliased: Option<BTreeSet<Ipv4Addr>>,
}

/// What the proxy was last given, shared by the heartbeat path and the
/// watcher; see the module docs.
pub struct ProxyTable {
    proxy: Arc<Proxy>,
    /// VIPs are aliased on the bridge (false with `agent.proxy_listen`).
    alias_vips: bool,
    /// Held while the proxy is updated, so the check and the update are one.
    applied: Mutex<Applied>,
    /// The applied stamp again, set after each update: what a heartbeat
    /// reads, never waiting for an update in progress.
    reported: Mutex<Option<Stamp>>,
    counters: Arc<ClusterCounters>,
}

/// What [`ProxyTable::push`] did with a table.
#[derive(Debug, PartialEq)]
pub enum Pushed {
    /// The proxy took it (with the services it could not serve).
    Applied(Vec<String>),
    /// It is not newer than what the proxy holds.
    Old,
    /// It names a VIP the heartbeat path has not aliased yet.
    NeedsAliases,
}

impl ProxyTable {
    /// The table in front of `proxy`.
    pub fn new(proxy: Arc<Proxy>, alias_vips: bool, counters: Arc<ClusterCounters>) -> ProxyTable {
        ProxyTable {
            proxy,
            alias_vips,
            applied: Mutex::new(Applied::default()),
            reported: Mutex::new(None),
            counters,
        }
    }

    /// The proxy.
    pub fn proxy(&self) -> &Proxy {
        &self.proxy
    }

    /// The generation applied, when it was numbered by `origin` (the control
    /// plane that answered last); what a heartbeat reports.
    pub fn applied_generation(&self, origin: Option<u64>) -> Option<u64> {
        let stamp = (*lock(&self.reported))?;
        (Some(stamp.origin) == origin).then_some(stamp.generation)
    }

    /// The heartbeat path, once the worker aliased `vips`: the proxy takes
    /// `services` when `stamp` is newer than what it holds.
    pub fn from_heartbeat(
        &self,
        stamp: Option<Stamp>,
        vips: BTreeSet<Ipv4Addr>,
        services: &[ServiceEndpoints],
    ) -> Vec<ProxyError> {
        let mut applied = lock(&self.applied);
        applied.aliased = Some(vips);
        if !is_newer(applied.stamp, stamp) {
            return Vec::new();
        }
        let errors = self.proxy.update(services);
        applied.stamp = stamp;
        *lock(&self.reported) = stamp;
        self.counters
            .heartbeat_tables
            .fetch_add(1, Ordering::Relaxed);
        errors
    }

    /// The watcher's path; see [`Pushed`].
    pub fn push(&self, answer: &EndpointsAnswer) -> Pushed {
        let stamp = Stamp {
            origin: answer.origin,
            generation: answer.generation,
        };
        let mut applied = lock(&self.applied);
        if !is_newer(applied.stamp, Some(stamp)) {
            return Pushed::Old;
        }
        if self.alias_vips && !aliased_already(applied.aliased.as_ref(), &answer.services) {
            return Pushed::NeedsAliases;
        }
        let errors = self.proxy.update(&answer.services);
        applied.stamp = Some(stamp);
        *lock(&self.reported) = Some(stamp);
        self.counters.pushed_tables.fetch_add(1, Ordering::Relaxed);
        Pushed::Applied(errors.iter().map(|e| e.to_string()).collect())
    }
}

/// Starts the watcher for the node `cp` speaks for; see the module docs.
pub fn spawn(
    cp: ControlPlane,
    table: &Arc<ProxyTable>,
    wake: Arc<Wake>,
) -> std::io::Result<JoinHandle<()>> {
    let table = Arc::downgrade(table);
    // A poll waits up to ENDPOINTS_WAIT before the control plane answers.
    let cp = cp.with_timeout(ENDPOINTS_WAIT + CONTROLPLANE_TIMEOUT);
    std::thread::Builder::new()
        .name("keel-endpoints".into())
        .spawn(move || run(&cp, &table, &wake))
}

fn run(cp: &ControlPlane, table: &Weak<ProxyTable>, wake: &Wake) {
    let clock = SystemClock;
    let mut retry: Backoff<()> = Backoff::with_policy(Policy {
        initial: POLL_RETRY_INITIAL,
        cap: POLL_RETRY_CAP,
        ..Policy::default()
    });
    // The newest stamp seen (applied or waiting for its aliases): the next
    // poll asks for a later one. None: ask for the current table at once.
    let mut seen: Option<Stamp> = None;
    let mut last_problem: Option<String> = None;
    while !wake.is_stopped() {
        let problem = match cp.endpoints(seen.map(|s| s.generation)) {
            Ok(answer) => {
                let Some(table) = table.upgrade() else {
                    return;
                };
                let stamp = Stamp {
                    origin: answer.origin,
                    generation: answer.generation,
                };
                if seen.is_some_and(|s| s.origin != stamp.origin) {
                    // A restarted control plane (it answers a generation it
                    // has not reached at once): ask by its own numbers now.
                    log::info!("the control plane restarted; following its endpoint generations");
                }
                seen = Some(stamp);
                retry.forget(&());
                match table.push(&answer) {
                    Pushed::Applied(errors) if !errors.is_empty() => Some(format!(
                        "applying endpoint generation {}: {}",
                        answer.generation,
                        errors.join("; ")
                    )),
                    Pushed::Applied(_) | Pushed::Old => None,
                    Pushed::NeedsAliases => {
                        wake.ask();
                        None
                    }
                }
            }
            Err(e) => {
                // Unreachable: maybe a control plane restarting, whose
                // numbers start over, so ask for its current table first.
                // A refusal (503: too many polls waiting) keeps `seen`, so
                // the retry waits its turn instead of taking the table at
                // once and coming straight back.
                if matches!(e, ClusterError::Unreachable(_)) {
                    seen = None;
                }
                let delay = retry.record_failure(&(), clock.now());
                let problem = format!(
                    "watching the endpoint table: {e}; retrying in {}s, heartbeats carry it meanwhile",
                    delay.as_secs_f64()
                );
                if Some(&problem) != last_problem.as_ref() {
                    log::warn!("{problem}");
                }
                last_problem = Some(problem);
                if wake.sleep(delay) {
                    return;
                }
                continue;
            }
        };
        if problem != last_problem {
            match &problem {
                Some(p) => log::warn!("{p}"),
                None if last_problem.is_some() => {
                    log::info!("the endpoint table is pushed again")
                }
                None => {}
            }
            last_problem = problem;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(origin: u64, generation: u64) -> Option<Stamp> {
        Some(Stamp { origin, generation })
    }

    #[test]
    fn only_a_strictly_newer_generation_of_the_same_control_plane_is_applied() {
        assert!(is_newer(stamp(7, 3), stamp(7, 4)));
        assert!(!is_newer(stamp(7, 3), stamp(7, 3)), "the same table again");
        assert!(!is_newer(stamp(7, 3), stamp(7, 2)), "a late, older answer");
    }

    #[test]
    fn a_restarted_control_plane_is_followed_whatever_its_numbers() {
        assert!(is_newer(stamp(7, 50), stamp(9, 1)));
        assert!(
            is_newer(stamp(9, 1), stamp(7, 50)),
            "origins are not ordered"
        );
    }

    #[test]
    fn a_table_is_pushed_directly_only_when_the_heartbeat_path_aliased_its_vips() {
        let service = |last: u8| ServiceEndpoints {
            name: format!("s{last}"),
            vip: Ipv4Addr::new(10, 96, 0, last),
            port: 80,
            replicas: Vec::new(),
            unsettled: false,
        };
        let aliased: BTreeSet<Ipv4Addr> =
            [Ipv4Addr::new(10, 96, 0, 1), Ipv4Addr::new(10, 96, 0, 2)].into();
        assert!(aliased_already(Some(&aliased), &[service(1), service(2)]));
        assert!(
            aliased_already(Some(&aliased), &[service(1)]),
            "a removed service needs nothing"
        );
        assert!(aliased_already(Some(&aliased), &[]));
        assert!(
            !aliased_already(Some(&aliased), &[service(1), service(3)]),
            "a new VIP"
        );
        assert!(
            !aliased_already(None, &[service(1)]),
            "no heartbeat answer applied yet"
        );
    }

    #[test]
    fn the_first_table_and_unnumbered_tables_are_always_taken() {
        assert!(is_newer(None, stamp(7, 1)));
        assert!(
            is_newer(stamp(7, 3), None),
            "a control plane without generations"
        );
        assert!(is_newer(None, None));
    }
}
