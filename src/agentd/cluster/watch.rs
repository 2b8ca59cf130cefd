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
//! The watcher holds the whole table it was last sent and polls with its
//! stamp (`after` and `origin`), so the control plane answers only the
//! services changed since ([`WatchedTable`] applies them, as the heartbeat
//! path's `EndpointCache` does); after a change every node would otherwise
//! be sent the whole table again. A control plane that refuses the
//! `origin` parameter (one from before it) is polled for whole tables.
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
use crate::agentd::cluster::heartbeat;
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

/// The whole table the watcher was last sent, kept so that polls can be
/// answered with changes; see the module docs.
#[derive(Debug, Default)]
pub struct WatchedTable {
    held: Option<(Stamp, Vec<ServiceEndpoints>)>,
}

impl WatchedTable {
    /// The stamp to poll with; `None`: ask for the whole table at once.
    pub fn stamp(&self) -> Option<Stamp> {
        self.held.as_ref().map(|(stamp, _)| *stamp)
    }

    /// Forgets the table, so the next poll asks for the whole one.
    pub fn forget(&mut self) {
        self.held = None;
    }

    /// Takes in a poll's answer and returns the whole table it stands for,
    /// with its stamp; `None` when it carries changes to a table this does
    /// not hold (the next poll then asks for the whole table).
    pub fn absorb(&mut self, answer: EndpointsAnswer) -> Option<(Stamp, &[ServiceEndpoints])> {
        let stamp = Stamp {
            origin: answer.origin,
            generation: answer.generation,
        };
        let services = match answer.services_changed {
            None => answer.services,
            Some(since) => {
                let (held, mut services) = self.held.take()?;
                if held.origin != stamp.origin || held.generation != since {
                    return None;
                }
                let removed = &answer.services_removed;
                heartbeat::apply_endpoint_changes(&mut services, answer.services, removed);
                services
            }
        };
        let (stamp, services) = self.held.insert((stamp, services));
        Some((*stamp, services))
    }
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

    /// The watcher's path, with the whole table `services` stamped
    /// `stamp`; see [`Pushed`].
    pub fn push(&self, stamp: Stamp, services: &[ServiceEndpoints]) -> Pushed {
        let mut applied = lock(&self.applied);
        if !is_newer(applied.stamp, Some(stamp)) {
            return Pushed::Old;
        }
        if self.alias_vips && !aliased_already(applied.aliased.as_ref(), services) {
            return Pushed::NeedsAliases;
        }
        let errors = self.proxy.update(services);
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
    // The newest table seen (applied or waiting for its aliases): the next
    // poll asks for a later one. Empty: ask for the whole table at once.
    let mut watched = WatchedTable::default();
    // False once the control plane refused the `origin` parameter.
    let mut changes = true;
    let mut last_problem: Option<String> = None;
    while !wake.is_stopped() {
        let held = watched.stamp();
        let origin = held.filter(|_| changes).map(|s| s.origin);
        let problem = match cp.endpoints(held.map(|s| s.generation), origin) {
            Err(ClusterError::Status { status: 400, .. }) if origin.is_some() => {
                log::info!(
                    "the control plane does not answer endpoint changes (it predates them); polling for whole tables"
                );
                changes = false;
                continue;
            }
            Ok(answer) => {
                let Some(table) = table.upgrade() else {
                    return;
                };
                if held.is_some_and(|s| s.origin != answer.origin) {
                    // A restarted control plane (it answers a generation it
                    // has not reached at once): ask by its own numbers now.
                    log::info!("the control plane restarted; following its endpoint generations");
                }
                retry.forget(&());
                let generation = answer.generation;
                let Some((stamp, services)) = watched.absorb(answer) else {
                    // Changes to a table this watcher no longer holds: the
                    // next poll asks for the whole one.
                    continue;
                };
                match table.push(stamp, services) {
                    Pushed::Applied(errors) if !errors.is_empty() => Some(format!(
                        "applying endpoint generation {generation}: {}",
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
                // A refusal (503: too many polls waiting) keeps the table, so
                // the retry waits its turn instead of taking the table at
                // once and coming straight back.
                if matches!(e, ClusterError::Unreachable(_)) {
                    watched.forget();
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

    fn entry(name: &str, port: u16) -> ServiceEndpoints {
        ServiceEndpoints {
            name: name.into(),
            vip: Ipv4Addr::new(10, 96, 0, 1),
            port,
            replicas: Vec::new(),
            unsettled: false,
        }
    }

    fn answer(
        origin: u64,
        generation: u64,
        services: Vec<ServiceEndpoints>,
        changes: Option<(u64, &[&str])>,
    ) -> EndpointsAnswer {
        EndpointsAnswer {
            generation,
            origin,
            services,
            services_changed: changes.map(|(since, _)| since),
            services_removed: changes
                .map(|(_, gone)| gone.iter().map(|g| g.to_string()).collect())
                .unwrap_or_default(),
        }
    }

    #[test]
    fn the_watched_table_applies_changes_to_the_table_it_holds() {
        let mut watched = WatchedTable::default();
        assert_eq!(watched.stamp(), None, "the first poll asks for the table");
        let whole = vec![entry("a", 80), entry("b", 80), entry("c", 80)];
        let (stamp, services) = watched
            .absorb(answer(7, 3, whole.clone(), None))
            .expect("whole");
        assert_eq!(
            (stamp, services),
            (
                Stamp {
                    origin: 7,
                    generation: 3
                },
                &whole[..]
            )
        );

        // Generation 5 changed b, added d, removed c.
        let changes = answer(
            7,
            5,
            vec![entry("b", 81), entry("d", 80)],
            Some((3, &["c"])),
        );
        let (stamp, services) = watched.absorb(changes).expect("changes to the held table");
        assert_eq!(stamp.generation, 5);
        assert_eq!(services, [entry("a", 80), entry("b", 81), entry("d", 80)]);
        // Nothing changed since (a wait that ended at its timeout).
        let (stamp, services) = watched
            .absorb(answer(7, 5, Vec::new(), Some((5, &[]))))
            .expect("unchanged");
        assert_eq!((stamp.generation, services.len()), (5, 3));
        assert_eq!(
            watched.stamp(),
            Some(Stamp {
                origin: 7,
                generation: 5
            })
        );
    }

    #[test]
    fn changes_to_a_table_not_held_are_refused_and_the_table_asked_for_again() {
        let mut watched = WatchedTable::default();
        assert!(
            watched
                .absorb(answer(7, 5, Vec::new(), Some((3, &[]))))
                .is_none()
        );
        watched
            .absorb(answer(7, 3, vec![entry("a", 80)], None))
            .expect("whole");
        assert!(
            watched
                .absorb(answer(7, 6, Vec::new(), Some((4, &[]))))
                .is_none(),
            "changes from a generation not held"
        );
        assert_eq!(
            watched.stamp(),
            None,
            "the next poll asks for the whole table"
        );
        watched
            .absorb(answer(7, 3, vec![entry("a", 80)], None))
            .expect("whole");
        assert!(
            watched
                .absorb(answer(9, 4, Vec::new(), Some((3, &[]))))
                .is_none(),
            "another control plane's numbers"
        );
        assert_eq!(watched.stamp(), None);
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
