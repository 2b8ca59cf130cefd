//! What a heartbeat says and how its answer is read, as pure functions: the
//! request body from the jail statuses ([`heartbeat_request`]), the peer list
//! and endpoint table held between answers ([`PeerCache`], [`EndpointCache`])
//! and the stale names turned into the
//! fence list ([`stale_placed`]), and the proxy's open connections as the
//! heartbeat reports them ([`connections`]). It never touches the host or
//! the network.

use std::collections::BTreeMap;
use std::net::SocketAddrV4;

use crate::agentd::proxy::ServiceLoads;
use crate::agentd::reconciler::Phase;
use crate::common::wire::{
    EndpointsStamp, HeartbeatRequest, HeartbeatResponse, JailStatus, Peer, PlacedJail,
    ReplicaConnections, Resources, ServiceEndpoints,
};

/// The heartbeat body from the worker's jail list: committed resources and
/// count of the jails it tracks (a jail being deleted no longer counts), and
/// the jails the control plane placed, with their epochs.
pub fn heartbeat_request(statuses: &[JailStatus]) -> HeartbeatRequest {
    let tracked: Vec<&JailStatus> = statuses
        .iter()
        .filter(|s| s.state != Phase::Deleting)
        .collect();
    let committed = Resources {
        // `+ 0.0`: an empty f64 sum is -0.0, which would print as such.
        cpu: tracked.iter().filter_map(|s| s.cpu).sum::<f64>() + 0.0,
        memory: tracked.iter().filter_map(|s| s.memory).sum(),
    };
    let placed = tracked
        .iter()
        .filter_map(|s| {
            Some(PlacedJail {
                name: s.name.clone(),
                epoch: s.epoch?,
                running: s.state.runs(),
                ready: Some(s.ready),
                address: Some(s.address),
            })
        })
        .collect();
    HeartbeatRequest {
        committed,
        jails: u32::try_from(tracked.len()).unwrap_or(u32::MAX),
        placed,
        peers_version: None,
        endpoints_generation: None,
        connections: Vec::new(),
        peer_changes: true,
        endpoints_held: None,
        events_seq: None,
        endpoint_changes: true,
    }
}

/// Every replica the proxy has connections open to, listed or only
/// draining, with their number (summed over services, in address order).
pub fn connections(loads: &[ServiceLoads]) -> Vec<ReplicaConnections> {
    let mut open: BTreeMap<SocketAddrV4, u32> = BTreeMap::new();
    for (_, replicas) in loads {
        for r in replicas.iter().filter(|r| r.open > 0) {
            let n = u32::try_from(r.open).unwrap_or(u32::MAX);
            let sum = open.entry(r.addr).or_default();
            *sum = sum.saturating_add(n);
        }
    }
    open.into_iter()
        .map(|(addr, open)| ReplicaConnections { addr, open })
        .collect()
}

/// The peer list as of the last answer, and its version, so a heartbeat can
/// ask only for what changed since (see [`HeartbeatRequest::peers_version`]
/// and [`HeartbeatRequest::peer_changes`]): an answer is the whole list, or
/// "unchanged", or the peers changed and gone since the version held, which
/// this cache applies as a delta.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PeerCache {
    held: Option<(u64, BTreeMap<String, Peer>)>,
}

impl PeerCache {
    /// The version to send with the next heartbeat.
    pub fn version(&self) -> Option<u64> {
        self.held.as_ref().map(|(v, _)| *v)
    }

    /// Takes in a heartbeat answer and returns the peer list to route by, or
    /// `None` when the answer is "unchanged" about, or changes to, a list
    /// this cache does not hold (a confused control plane): routes are then
    /// left as they are and the next heartbeat asks for the full list.
    pub fn absorb(&mut self, resp: &mut HeartbeatResponse) -> Option<Vec<Peer>> {
        let peers = std::mem::take(&mut resp.peers);
        if resp.peers_unchanged {
            return match &self.held {
                Some((v, held)) if Some(*v) == resp.peers_version => {
                    Some(held.values().cloned().collect())
                }
                _ => {
                    self.held = None;
                    None
                }
            };
        }
        if let Some(since) = resp.peers_changed {
            let (Some((v, held)), Some(version)) = (self.held.as_mut(), resp.peers_version) else {
                self.held = None;
                return None;
            };
            if *v != since {
                self.held = None;
                return None;
            }
            for gone in &resp.peers_removed {
                held.remove(gone);
            }
            for peer in peers {
                held.insert(peer.node_id.clone(), peer);
            }
            *v = version;
            return Some(held.values().cloned().collect());
        }
        self.held = resp.peers_version.map(|v| {
            let by_id = peers.iter().map(|p| (p.node_id.clone(), p.clone()));
            (v, by_id.collect())
        });
        Some(peers)
    }
}

/// The endpoint table the last heartbeat answer carried, so the next one
/// can say it holds it ([`HeartbeatRequest::endpoints_held`]) and be
/// answered "unchanged", or only the services changed since (which this
/// cache applies, see [`HeartbeatRequest::endpoint_changes`]), instead of
/// every service again.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EndpointCache {
    held: Option<(EndpointsStamp, Vec<ServiceEndpoints>)>,
}

impl EndpointCache {
    /// What to send as [`HeartbeatRequest::endpoints_held`].
    pub fn held(&self) -> Option<EndpointsStamp> {
        self.held.as_ref().map(|(stamp, _)| *stamp)
    }

    /// Takes in a heartbeat answer and leaves in `resp.services` the table
    /// it stands for: the held one when the answer says it is unchanged,
    /// the held one with the answer's changes applied when it carries
    /// changes. False when it says either of a table this cache does not
    /// hold; the services are then empty, and the next heartbeat asks for
    /// the table.
    pub fn absorb(&mut self, resp: &mut HeartbeatResponse) -> bool {
        let stamp = resp
            .endpoints_origin
            .zip(resp.endpoints_generation)
            .map(|(origin, generation)| EndpointsStamp { origin, generation });
        if let Some(since) = resp.services_changed {
            let held = self.held.take();
            let (Some((had, mut services)), Some(stamp)) = (held, stamp) else {
                resp.services.clear();
                return false;
            };
            if had.origin != stamp.origin || had.generation != since {
                resp.services.clear();
                return false;
            }
            let changed = std::mem::take(&mut resp.services);
            apply_endpoint_changes(&mut services, changed, &resp.services_removed);
            resp.services = services.clone();
            self.held = Some((stamp, services));
            return true;
        }
        if resp.endpoints_unchanged {
            return match &self.held {
                Some((held, services)) if Some(*held) == stamp => {
                    resp.services = services.clone();
                    true
                }
                _ => {
                    self.held = None;
                    false
                }
            };
        }
        self.held = stamp.map(|s| (s, resp.services.clone()));
        true
    }
}

/// Applies endpoint changes (the entries `changed`, the names `removed`)
/// to `services`, a table in name order as the control plane keeps it:
/// what heartbeat answers and endpoint polls with `services_changed` carry.
pub fn apply_endpoint_changes(
    services: &mut Vec<ServiceEndpoints>,
    changed: Vec<ServiceEndpoints>,
    removed: &[String],
) {
    services.retain(|s| !removed.contains(&s.name));
    for entry in changed {
        match services.binary_search_by(|s| s.name.cmp(&entry.name)) {
            Ok(i) => services[i] = entry,
            Err(i) => services.insert(i, entry),
        }
    }
}

/// The stale names of a heartbeat answer, each with the epoch the agent
/// reported for it. A name the agent did not report is dropped: the agent
/// cannot know which placement the control plane meant.
pub fn stale_placed(stale: &[String], reported: &[PlacedJail]) -> Vec<PlacedJail> {
    stale
        .iter()
        .filter_map(|name| {
            let found = reported.iter().find(|p| &p.name == name).cloned();
            if found.is_none() {
                log::warn!(
                    "the control plane named jail {name} stale, but this node did not report it as placed; ignoring"
                );
            }
            found
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::agentd::fixtures::peer;

    fn status(name: &str, state: Phase, epoch: Option<u64>, cpu: f64, mem: u64) -> JailStatus {
        JailStatus {
            ready: state == Phase::Running,
            name: name.into(),
            state,
            address: Ipv4Addr::new(10, 20, 3, 2),
            restarts: 0,
            created_unix: 0,
            last_error: None,
            retry_in_secs: None,
            epoch,
            cpu: Some(cpu),
            memory: Some(mem),
            last_exit: None,
        }
    }

    #[test]
    fn heartbeat_sums_tracked_jails_and_reports_placed_ones() {
        let req = heartbeat_request(&[
            status("a", Phase::Running, Some(3), 1.5, 512 << 20),
            status("b", Phase::CrashLoop, None, 0.5, 256 << 20),
            status("c", Phase::Deleting, None, 4.0, 1 << 30),
            status("d", Phase::Failed, Some(7), 1.0, 0),
        ]);
        assert_eq!(req.jails, 3);
        assert_eq!(req.committed.cpu, 3.0);
        assert_eq!(req.committed.memory, 768 << 20);
        let placed: Vec<(&str, u64, bool)> = req
            .placed
            .iter()
            .map(|p| (p.name.as_str(), p.epoch, p.running))
            .collect();
        assert_eq!(placed, [("a", 3, true), ("d", 7, false)]);
        assert!(req.placed.iter().all(|p| p.address.is_some()));
        let fence = stale_placed(&["d".into(), "zz".into()], &req.placed);
        assert_eq!(fence.len(), 1);
        assert_eq!(fence[0].epoch, 7);
    }

    fn answer(peers: Vec<Peer>, version: Option<u64>, unchanged: bool) -> HeartbeatResponse {
        HeartbeatResponse {
            peers,
            stale: Vec::new(),
            services: Vec::new(),
            peers_version: version,
            peers_unchanged: unchanged,
            endpoints_generation: None,
            endpoints_origin: None,
            peers_changed: None,
            peers_removed: Vec::new(),
            endpoints_unchanged: false,
            services_changed: None,
            services_removed: Vec::new(),
        }
    }

    #[test]
    fn connections_name_every_replica_with_open_ones_listed_or_draining() {
        use crate::agentd::proxy::ReplicaLoad;
        let addr = |last: u8| SocketAddrV4::new(std::net::Ipv4Addr::new(10, 20, 1, last), 80);
        let load = |last: u8, open: usize, listed: bool| ReplicaLoad {
            addr: addr(last),
            open,
            listed,
            ejected: false,
        };
        let loads = vec![
            (
                "web".to_string(),
                vec![load(2, 3, true), load(3, 0, true), load(4, 1, false)],
            ),
            ("api".to_string(), vec![load(2, 2, true)]),
        ];
        assert_eq!(
            connections(&loads),
            [
                ReplicaConnections {
                    addr: addr(2),
                    open: 5
                },
                ReplicaConnections {
                    addr: addr(4),
                    open: 1
                },
            ]
        );
    }

    #[test]
    fn the_peer_cache_keeps_the_last_full_list_for_unchanged_answers() {
        let list = vec![peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)];
        let mut cache = PeerCache::default();
        assert_eq!(
            cache.version(),
            None,
            "the first heartbeat asks for the list"
        );
        let got = cache.absorb(&mut answer(list.clone(), Some(41), false));
        assert_eq!(got.as_ref(), Some(&list));
        assert_eq!(cache.version(), Some(41));
        let got = cache.absorb(&mut answer(Vec::new(), Some(41), true));
        assert_eq!(
            got.as_ref(),
            Some(&list),
            "unchanged: route by the held list"
        );
        let newer = vec![peer("n2", [10, 0, 0, 2], "10.20.7.0/24", false)];
        let got = cache.absorb(&mut answer(newer.clone(), Some(42), false));
        assert_eq!(got.as_ref(), Some(&newer));
        assert_eq!(cache.version(), Some(42));
    }

    #[test]
    fn the_peer_cache_never_routes_by_a_list_it_does_not_hold() {
        let list = vec![peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)];
        let mut cache = PeerCache::default();
        cache.absorb(&mut answer(list, Some(7), false));
        assert_eq!(cache.absorb(&mut answer(Vec::new(), Some(8), true)), None);
        assert_eq!(cache.version(), None, "the next heartbeat asks again");
        // A control plane without versions: every answer is the full list.
        let empty = cache.absorb(&mut answer(Vec::new(), None, false));
        assert_eq!(empty, Some(Vec::new()));
        assert_eq!(cache.version(), None);
    }

    #[test]
    fn the_peer_cache_applies_changes_to_the_list_it_holds() {
        let b = peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true);
        let c = peer("n3", [10, 0, 0, 3], "10.20.8.0/24", true);
        let mut cache = PeerCache::default();
        cache.absorb(&mut answer(vec![b.clone(), c.clone()], Some(7), false));
        let dead_b = peer("n2", [10, 0, 0, 2], "10.20.7.0/24", false);
        let d = peer("n4", [10, 0, 0, 4], "10.20.9.0/24", true);
        let mut delta = answer(vec![d.clone(), dead_b.clone()], Some(9), false);
        delta.peers_changed = Some(7);
        delta.peers_removed = vec!["n3".into()];
        assert_eq!(
            cache.absorb(&mut delta),
            Some(vec![dead_b.clone(), d.clone()])
        );
        assert_eq!(cache.version(), Some(9));
        // Changes to a version this cache does not hold are never applied.
        let mut skipped = answer(vec![c], Some(12), false);
        skipped.peers_changed = Some(10);
        assert_eq!(cache.absorb(&mut skipped), None);
        assert_eq!(
            cache.version(),
            None,
            "the next heartbeat asks for the list"
        );
        let mut orphan = answer(Vec::new(), Some(13), false);
        orphan.peers_changed = Some(12);
        assert_eq!(cache.absorb(&mut orphan), None);
    }

    #[test]
    fn the_endpoint_cache_stands_in_for_an_unchanged_table() {
        let web = ServiceEndpoints {
            name: "web".into(),
            vip: Ipv4Addr::new(10, 96, 0, 1),
            port: 80,
            replicas: Vec::new(),
            unsettled: false,
        };
        let stamped = |generation: u64, services: Vec<ServiceEndpoints>, unchanged: bool| {
            let mut a = answer(Vec::new(), None, false);
            a.endpoints_origin = Some(5);
            a.endpoints_generation = Some(generation);
            a.services = services;
            a.endpoints_unchanged = unchanged;
            a
        };
        let mut cache = EndpointCache::default();
        assert_eq!(cache.held(), None);
        assert!(cache.absorb(&mut stamped(3, vec![web.clone()], false)));
        let held = EndpointsStamp {
            origin: 5,
            generation: 3,
        };
        assert_eq!(cache.held(), Some(held));
        let mut same = stamped(3, Vec::new(), true);
        assert!(cache.absorb(&mut same));
        assert_eq!(same.services, vec![web]);
        // "Unchanged" about a generation it does not hold: nothing to apply.
        let mut confused = stamped(4, Vec::new(), true);
        assert!(!cache.absorb(&mut confused));
        assert_eq!(cache.held(), None);
    }

    #[test]
    fn the_endpoint_cache_applies_changes_to_the_table_it_holds() {
        let entry = |name: &str, last: u8| ServiceEndpoints {
            name: name.into(),
            vip: Ipv4Addr::new(10, 96, 0, last),
            port: 80,
            replicas: vec![SocketAddrV4::new(Ipv4Addr::new(10, 20, 1, last), 80)],
            unsettled: false,
        };
        let stamped = |generation: u64, services: Vec<ServiceEndpoints>| {
            let mut a = answer(Vec::new(), None, false);
            a.endpoints_origin = Some(5);
            a.endpoints_generation = Some(generation);
            a.services = services;
            a
        };
        let mut cache = EndpointCache::default();
        let full = vec![entry("api", 1), entry("db", 2), entry("web", 3)];
        assert!(cache.absorb(&mut stamped(3, full)));
        // Generation 3 to 5: web changed, db went, cache came.
        let mut delta = stamped(5, vec![entry("cache", 4), entry("web", 9)]);
        delta.services_changed = Some(3);
        delta.services_removed = vec!["db".into()];
        assert!(cache.absorb(&mut delta));
        let expected = vec![entry("api", 1), entry("cache", 4), entry("web", 9)];
        assert_eq!(delta.services, expected, "in name order, as the table is");
        assert_eq!(cache.held().map(|s| s.generation), Some(5));
        let mut same = stamped(5, Vec::new());
        same.endpoints_unchanged = true;
        assert!(cache.absorb(&mut same));
        assert_eq!(same.services, expected);
        // Changes since a generation it does not hold: nothing to apply,
        // and the next heartbeat asks for the table.
        let mut behind = stamped(7, vec![entry("web", 1)]);
        behind.services_changed = Some(6);
        assert!(!cache.absorb(&mut behind));
        assert!(behind.services.is_empty());
        assert_eq!(cache.held(), None);
    }
}
