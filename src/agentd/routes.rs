//! Applying a heartbeat answer to the host ([`apply_heartbeat`], run on the
//! worker thread): the node subnet and bridge address, kernel routes to the
//! peers' subnets ([`plan_routes`], the pure diff, and [`sync_routes`]), the
//! services' VIP aliases ([`sync_vips`]) and fencing.
//!
//! Only routes to peers' subnets are touched: a destination is Keel's when a
//! peer (Alive or Dead) names it as its pod_cidr, or when Keel added it
//! earlier (`AgentState::cluster_routes`, so a route to a peer that left the
//! cluster is still withdrawn). The node's own subnet is never routed away.
//! Service VIPs are /32 aliases on the bridge, and only those Keel added
//! (`AgentState::service_vips`) are ever removed. Fencing deletes only jails
//! the control plane placed, and only while they still carry the epoch the
//! heartbeat reported. It never talks to the control plane.
//!
//! Route changes cost one process each, and only per changed peer. route(8)
//! takes one change per invocation (`route add DEST GATEWAY`, `route delete
//! DEST`; it has no batch mode, and `route -n monitor` only watches), so
//! batching on FreeBSD means running it only for what differs: each answer
//! is diffed against one `netstat -rn` listing ([`plan_routes`]), and a peer
//! that joins, dies or moves costs every other node one `route` process,
//! never one per peer. Heartbeat answers carry only the peers that changed
//! (`agentd::cluster::heartbeat::PeerCache` applies them to the list it
//! holds), but the diff still runs on the whole list, so a route an
//! administrator removed by hand is put back on the next answer. A node
//! that joins a cluster of N nodes has N routes to add and runs N `route`
//! processes once; the alternative, writing to a routing socket, would be
//! host code outside the `common::cmd` seam that every FreeBSD command goes
//! through.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use crate::agentd::reconciler::Reconciler;
use crate::common::cidr::Ipv4Net;
use crate::common::wire::{Peer, PlacedJail};
use crate::host::net::{NetError, Route};
use crate::host::{JailRuntime, MountManager, NetManager, ZfsManager};

/// Kernel route changes that bring the table to the peers' subnets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutePlan {
    /// Routes to delete, first (withdrawn peers, and gateways that changed).
    pub delete: Vec<Ipv4Net>,
    /// Routes to add afterwards: destination via gateway.
    pub add: Vec<(Ipv4Net, Ipv4Addr)>,
}

impl RoutePlan {
    /// True when the table already matches.
    pub fn is_empty(&self) -> bool {
        self.delete.is_empty() && self.add.is_empty()
    }
}

/// The route diff, a pure function: every Alive peer's pod_cidr must route via
/// that peer's address; a route to the pod_cidr of a Dead peer, or to a
/// destination in `managed` (routes Keel added before) that no Alive peer
/// claims, is withdrawn. Routes to any other destination, and anything
/// overlapping the node's own subnet `own`, are left alone. A peer whose
/// pod_cidr does not parse is skipped.
pub fn plan_routes(
    own: Ipv4Net,
    peers: &[Peer],
    current: &[Route],
    managed: &BTreeSet<Ipv4Net>,
) -> RoutePlan {
    let own = own.trunc();
    let mut wanted: BTreeMap<Ipv4Net, Ipv4Addr> = BTreeMap::new();
    let mut ours: BTreeSet<Ipv4Net> = managed.iter().map(Ipv4Net::trunc).collect();
    for peer in peers {
        let Ok(net) = peer.pod_cidr.parse::<Ipv4Net>() else {
            continue;
        };
        let net = net.trunc();
        ours.insert(net);
        if peer.alive {
            wanted.entry(net).or_insert(peer.address);
        }
    }
    ours.retain(|n| !n.overlaps(&own));
    wanted.retain(|n, _| !n.overlaps(&own));

    let present: BTreeMap<Ipv4Net, &str> = current
        .iter()
        .map(|r| (r.destination.trunc(), r.gateway.as_str()))
        .filter(|(d, _)| ours.contains(d))
        .collect();
    let mut plan = RoutePlan::default();
    for (dest, gateway) in &present {
        match wanted.get(dest) {
            Some(want) if want.to_string() == *gateway => {}
            _ => plan.delete.push(*dest),
        }
    }
    for (dest, gateway) in &wanted {
        if present.get(dest).is_none_or(|g| *g != gateway.to_string()) {
            plan.add.push((*dest, *gateway));
        }
    }
    plan
}

/// What [`sync_routes`] did.
#[derive(Debug, Default)]
pub struct RouteSync {
    /// Destinations Keel manages after this sync (persist them).
    pub managed: BTreeSet<Ipv4Net>,
    /// Routes added.
    pub added: Vec<(Ipv4Net, Ipv4Addr)>,
    /// Routes deleted.
    pub deleted: Vec<Ipv4Net>,
    /// Failed steps; the others were done.
    pub errors: Vec<NetError>,
}

/// Reconciles the kernel routes with `peers`: one route listing, then the
/// deletes and adds of [`plan_routes`]. A failed listing changes nothing.
pub fn sync_routes(
    net: &impl NetManager,
    own: Ipv4Net,
    peers: &[Peer],
    managed: &BTreeSet<Ipv4Net>,
) -> RouteSync {
    let current = match net.list_routes() {
        Ok(routes) => routes,
        Err(e) => {
            return RouteSync {
                managed: managed.clone(),
                errors: vec![e],
                ..RouteSync::default()
            };
        }
    };
    let plan = plan_routes(own, peers, &current, managed);
    let mut sync = RouteSync::default();
    let own = own.trunc();
    // Keel's routes afterwards: every Alive peer's subnet (a failed add is
    // retried on the next heartbeat anyway), plus whatever could not be
    // withdrawn, so a later heartbeat still knows it is Keel's.
    sync.managed = peers
        .iter()
        .filter(|p| p.alive)
        .filter_map(|p| p.pod_cidr.parse::<Ipv4Net>().ok())
        .map(|n| n.trunc())
        .filter(|n| !n.overlaps(&own))
        .collect();
    for dest in plan.delete {
        match net.delete_route(dest) {
            Ok(()) => sync.deleted.push(dest),
            Err(e) => {
                sync.managed.insert(dest);
                sync.errors.push(e);
            }
        }
    }
    for (dest, gateway) in plan.add {
        match net.add_route(dest, gateway) {
            Ok(()) => sync.added.push((dest, gateway)),
            Err(e) => sync.errors.push(e),
        }
    }
    sync
}

/// What [`sync_vips`] did.
#[derive(Debug, Default)]
pub struct VipSync {
    /// VIPs Keel has aliased on the bridge after this sync (persist them).
    pub managed: BTreeSet<Ipv4Addr>,
    /// Aliases added.
    pub added: Vec<Ipv4Addr>,
    /// Aliases removed.
    pub removed: Vec<Ipv4Addr>,
    /// Failed steps; the others were done.
    pub errors: Vec<NetError>,
}

/// Aliases every VIP in `wanted` on `bridge` as a /32 and removes the aliases
/// Keel added before (`managed`) whose service is gone, after one listing of
/// the bridge's addresses. An address Keel did not add (the gateway, an
/// admin's alias) is never removed: only `managed` ones are. A failed listing
/// changes nothing; a failed removal stays managed, so the next heartbeat
/// tries again.
pub fn sync_vips(
    net: &impl NetManager,
    bridge: &str,
    wanted: &BTreeSet<Ipv4Addr>,
    managed: &BTreeSet<Ipv4Addr>,
) -> VipSync {
    let present: BTreeSet<Ipv4Addr> = match net.list_addresses(bridge) {
        Ok(addresses) => addresses.into_iter().collect(),
        Err(e) => {
            return VipSync {
                managed: managed.clone(),
                errors: vec![e],
                ..VipSync::default()
            };
        }
    };
    let mut sync = VipSync {
        managed: wanted.clone(),
        ..VipSync::default()
    };
    for vip in managed.difference(wanted).filter(|v| present.contains(v)) {
        match net.remove_alias(bridge, *vip) {
            Ok(()) => sync.removed.push(*vip),
            Err(e) => {
                sync.managed.insert(*vip);
                sync.errors.push(e);
            }
        }
    }
    for vip in wanted.difference(&present) {
        match net.add_alias(bridge, *vip) {
            Ok(()) => sync.added.push(*vip),
            Err(e) => sync.errors.push(e),
        }
    }
    sync
}

/// What applying one heartbeat answer did on the worker.
#[derive(Debug, Default)]
pub struct HeartbeatOutcome {
    /// Jails deleted because their placement moved away.
    pub fenced: Vec<String>,
    /// Problems, as messages for the log (the rest was done).
    pub errors: Vec<String>,
}

/// Applies a heartbeat answer on the worker thread: adopt (again, idempotent)
/// the node's subnet and the bridge address, reconcile peer routes, alias the
/// services' `vips` on the bridge (before the proxy listens on them), and
/// delete the placed jails in `fence` that still carry the reported epoch.
pub fn apply_heartbeat<J, Z, N, M>(
    reconciler: &mut Reconciler<J, Z, N, M>,
    pod_cidr: Ipv4Net,
    peers: &[Peer],
    vips: &BTreeSet<Ipv4Addr>,
    fence: &[PlacedJail],
) -> HeartbeatOutcome
where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    let mut outcome = HeartbeatOutcome::default();
    if let Err(e) = reconciler.adopt_node_subnet(pod_cidr) {
        outcome.errors.push(format!("node subnet {pod_cidr}: {e}"));
    }
    if let Err(e) = reconciler.ensure_gateway() {
        outcome.errors.push(format!(
            "address of bridge {}: {e}",
            reconciler.node().bridge
        ));
    }

    let own = reconciler.node().subnet;
    let managed = reconciler.state().cluster_routes.clone();
    let sync = sync_routes(reconciler.net(), own, peers, &managed);
    for dest in &sync.deleted {
        log::info!("withdrew the route to {dest} (its node is dead or gone)");
    }
    for (dest, gateway) in &sync.added {
        log::info!("routing {dest} via {gateway}");
    }
    outcome
        .errors
        .extend(sync.errors.iter().map(|e| format!("peer routes: {e}")));
    if let Err(e) = reconciler.record_cluster_routes(sync.managed) {
        outcome.errors.push(format!("peer routes: {e}"));
    }

    let bridge = reconciler.node().bridge.clone();
    let managed = reconciler.state().service_vips.clone();
    let aliases = sync_vips(reconciler.net(), &bridge, vips, &managed);
    for vip in &aliases.removed {
        log::info!("removed the alias {vip}/32 from {bridge} (its service is gone)");
    }
    for vip in &aliases.added {
        log::info!("aliased service VIP {vip}/32 on {bridge}");
    }
    outcome
        .errors
        .extend(aliases.errors.iter().map(|e| format!("service VIPs: {e}")));
    if let Err(e) = reconciler.record_service_vips(aliases.managed) {
        outcome.errors.push(format!("service VIPs: {e}"));
    }

    for stale in fence {
        let Some(epoch) = reconciler.record(&stale.name).map(|r| r.epoch) else {
            continue;
        };
        match epoch {
            None => log::warn!(
                "the control plane named jail {} stale, but it was applied locally (no epoch); local jails are never fenced",
                stale.name
            ),
            Some(e) if e != stale.epoch => log::info!(
                "not fencing jail {}: placed again (epoch {e}) since the heartbeat reported epoch {}",
                stale.name,
                stale.epoch
            ),
            Some(_) => match reconciler.delete(&stale.name) {
                Ok(()) => {
                    log::info!(
                        "fenced jail {} (epoch {}): its placement moved off this node",
                        stale.name,
                        stale.epoch
                    );
                    outcome.fenced.push(stale.name.clone());
                }
                Err(e) => outcome
                    .errors
                    .push(format!("fencing jail {}: {e}", stale.name)),
            },
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agentd::fixtures::{DEFAULT_SUBNET, fake_reconciler, jail, peer};
    use crate::host::fake::{CallLog, Faults};
    use crate::host::net::FakeNet;

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("test prefix")
    }

    fn route(dest: &str, gateway: &str) -> Route {
        Route {
            destination: net(dest),
            gateway: gateway.into(),
        }
    }

    const OWN: &str = "10.20.3.0/24";

    #[test]
    fn an_alive_peer_without_a_route_gets_one() {
        let peers = [peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)];
        let current = [route("0.0.0.0/0", "192.168.1.1"), route(OWN, "link#4")];
        let plan = plan_routes(net(OWN), &peers, &current, &BTreeSet::new());
        assert_eq!(plan.delete, []);
        assert_eq!(
            plan.add,
            [(net("10.20.7.0/24"), Ipv4Addr::new(10, 0, 0, 2))]
        );
    }

    #[test]
    fn a_dead_peer_route_is_withdrawn_and_a_missing_one_not_added() {
        let peers = [
            peer("n2", [10, 0, 0, 2], "10.20.7.0/24", false),
            peer("n3", [10, 0, 0, 3], "10.20.9.0/24", false),
        ];
        let current = [route("10.20.7.0/24", "10.0.0.2")];
        let plan = plan_routes(net(OWN), &peers, &current, &BTreeSet::new());
        assert_eq!(plan.delete, [net("10.20.7.0/24")]);
        assert_eq!(plan.add, []);
    }

    #[test]
    fn a_correct_table_needs_nothing() {
        let peers = [peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)];
        let current = [route("10.20.7.0/24", "10.0.0.2")];
        assert!(plan_routes(net(OWN), &peers, &current, &BTreeSet::new()).is_empty());
    }

    #[test]
    fn a_changed_gateway_is_deleted_then_added() {
        let peers = [peer("n2", [10, 0, 0, 12], "10.20.7.0/24", true)];
        let current = [route("10.20.7.0/24", "10.0.0.2")];
        let plan = plan_routes(net(OWN), &peers, &current, &BTreeSet::new());
        assert_eq!(plan.delete, [net("10.20.7.0/24")]);
        assert_eq!(
            plan.add,
            [(net("10.20.7.0/24"), Ipv4Addr::new(10, 0, 0, 12))]
        );
    }

    #[test]
    fn a_vanished_peer_route_is_withdrawn_only_when_keel_added_it() {
        let current = [
            route("10.20.7.0/24", "10.0.0.2"),
            route("172.16.0.0/12", "10.0.0.254"),
        ];
        let managed = BTreeSet::from([net("10.20.7.0/24")]);
        let plan = plan_routes(net(OWN), &[], &current, &managed);
        assert_eq!(plan.delete, [net("10.20.7.0/24")]);
        assert!(
            plan_routes(net(OWN), &[], &current, &BTreeSet::new()).is_empty(),
            "a route nobody claims is the admin's"
        );
    }

    #[test]
    fn the_admins_routes_and_the_own_subnet_are_never_touched() {
        let peers = [
            // A (misconfigured) peer claiming this node's own subnet.
            peer("n2", [10, 0, 0, 2], OWN, true),
            peer("n3", [10, 0, 0, 3], "not-a-cidr", true),
        ];
        let current = [
            route("0.0.0.0/0", "192.168.1.1"),
            route(OWN, "link#4"),
            route("10.20.3.1/32", "link#4"),
            route("10.20.8.0/24", "10.0.0.200"),
        ];
        let managed = BTreeSet::from([net(OWN)]);
        assert!(plan_routes(net(OWN), &peers, &current, &managed).is_empty());
    }

    #[test]
    fn sync_runs_the_plan_and_tracks_what_keel_owns() {
        let log = CallLog::new();
        let faults = Faults::default();
        let fake = FakeNet::new(log.clone(), faults.clone());
        fake.add_route(net("10.20.9.0/24"), Ipv4Addr::new(10, 0, 0, 9))
            .expect("route");
        let peers = [
            peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true),
            peer("n3", [10, 0, 0, 3], "10.20.8.0/24", true),
        ];
        faults.fail_times("add_route", Some("10.20.8.0/24"), 1);
        faults.fail_times("delete_route", Some("10.20.9.0/24"), 1);
        let managed = BTreeSet::from([net("10.20.9.0/24")]);
        let sync = sync_routes(&fake, net(OWN), &peers, &managed);
        assert_eq!(sync.added.len(), 1);
        assert_eq!(sync.errors.len(), 2);
        assert_eq!(
            sync.managed,
            BTreeSet::from([
                net("10.20.7.0/24"),
                net("10.20.8.0/24"),
                net("10.20.9.0/24")
            ]),
            "a failed delete stays Keel's, a failed add is retried from the peer list"
        );
        let again = sync_routes(&fake, net(OWN), &peers, &sync.managed);
        assert!(again.errors.is_empty(), "{:?}", again.errors);
        assert_eq!(again.deleted, [net("10.20.9.0/24")]);
        let mut dests: Vec<Ipv4Net> = fake.routes().iter().map(|r| r.destination).collect();
        dests.sort();
        assert_eq!(dests, [net("10.20.7.0/24"), net("10.20.8.0/24")]);
    }

    #[test]
    fn a_failed_route_listing_changes_nothing() {
        let log = CallLog::new();
        let faults = Faults::default();
        let fake = FakeNet::new(log.clone(), faults.clone());
        faults.fail_times("list_routes", None, 1);
        let managed = BTreeSet::from([net("10.20.9.0/24")]);
        let sync = sync_routes(
            &fake,
            net(OWN),
            &[peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)],
            &managed,
        );
        assert_eq!(sync.errors.len(), 1);
        assert_eq!(sync.managed, managed);
        assert!(log.matching("net.").is_empty());
    }

    fn net_default() -> Ipv4Net {
        net(DEFAULT_SUBNET)
    }

    #[test]
    fn fencing_deletes_stale_placed_jails_and_never_local_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake_net = FakeNet::new(CallLog::new(), Faults::default());
        let mut r = fake_reconciler(dir.path(), fake_net);
        let pod = net("10.20.5.0/24");
        r.adopt_node_subnet(pod).expect("adopt");
        r.ensure_gateway().expect("bridge");
        r.apply(jail("placed", None), Some(4)).expect("placed");
        r.apply(jail("moved-back", None), Some(9)).expect("placed");
        r.apply(jail("local", None), None).expect("local");

        let fence = [
            PlacedJail {
                name: "placed".into(),
                epoch: 4,
                running: true,
                ready: None,
                address: None,
            },
            // Reported with epoch 8, re-placed here with 9 since.
            PlacedJail {
                name: "moved-back".into(),
                epoch: 8,
                running: true,
                ready: None,
                address: None,
            },
            // The control plane cannot fence a local jail, whatever it says.
            PlacedJail {
                name: "local".into(),
                epoch: 1,
                running: true,
                ready: None,
                address: None,
            },
        ];
        let outcome = apply_heartbeat(&mut r, pod, &[], &BTreeSet::new(), &fence);
        assert!(outcome.errors.is_empty(), "{:?}", outcome.errors);
        assert_eq!(outcome.fenced, ["placed"]);
        assert!(r.record("placed").is_none());
        assert!(r.record("moved-back").is_some());
        assert!(r.record("local").is_some());
    }

    #[test]
    fn the_assigned_subnet_is_persisted_addresses_follow_it_and_others_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake_net = FakeNet::new(CallLog::new(), Faults::default());
        let pod = net("10.20.5.0/24");
        {
            let mut r = fake_reconciler(dir.path(), fake_net.clone());
            r.adopt_node_subnet(pod).expect("adopt");
            r.ensure_gateway().expect("bridge");
            r.ensure_gateway().expect("bridge");
            assert_eq!(fake_net.bridge_address("keel0"), Some(net("10.20.5.1/24")));
            let status = r.apply(jail("web", None), Some(1)).expect("applied");
            assert!(pod.contains(status.address), "{}", status.address);
            let err = r
                .apply(jail("stray", Some("10.20.0.9")), Some(2))
                .expect_err("outside the pod_cidr");
            assert!(err.to_string().contains("spec.network.address"), "{err}");
            assert!(r.record("stray").is_none(), "refused before provisioning");
        }
        // A restarted node keeps its subnet without the control plane.
        let r = fake_reconciler(dir.path(), fake_net);
        assert_eq!(r.state().node_subnet, Some(pod));
        assert_eq!(r.node().subnet, pod);
    }

    #[test]
    fn a_subnet_that_strands_jails_is_refused_and_nothing_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut r = fake_reconciler(dir.path(), FakeNet::new(CallLog::new(), Faults::default()));
        r.reconcile();
        r.apply(jail("local", None), None).expect("local");
        let err = r
            .adopt_node_subnet(net("10.20.5.0/24"))
            .expect_err("local jail outside");
        assert!(err.to_string().contains("local"), "{err}");
        assert_eq!(r.node().subnet, net_default());
        assert_eq!(r.state().node_subnet, None);
    }

    #[test]
    fn heartbeat_routes_are_persisted_as_keels() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake_net = FakeNet::new(CallLog::new(), Faults::default());
        let mut r = fake_reconciler(dir.path(), fake_net.clone());
        let pod = net("10.20.5.0/24");
        let peers = [peer("n2", [10, 0, 0, 2], "10.20.7.0/24", true)];
        let outcome = apply_heartbeat(&mut r, pod, &peers, &BTreeSet::new(), &[]);
        assert!(outcome.errors.is_empty(), "{:?}", outcome.errors);
        assert_eq!(
            r.state().cluster_routes,
            BTreeSet::from([net("10.20.7.0/24")])
        );
        drop(r);
        // The peer left the cluster while the agent was down: the restarted
        // agent still knows the route is Keel's and withdraws it.
        let mut r = fake_reconciler(dir.path(), fake_net.clone());
        apply_heartbeat(&mut r, pod, &[], &BTreeSet::new(), &[]);
        assert!(fake_net.routes().is_empty());
        assert!(r.state().cluster_routes.is_empty());
    }

    fn ip(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 96, 0, last)
    }

    #[test]
    fn vips_are_aliased_and_only_keels_are_removed() {
        let faults = Faults::default();
        let fake = FakeNet::new(CallLog::new(), faults.clone());
        fake.add_interface("keel0");
        fake.add_alias("keel0", ip(99)).expect("the admin's alias");
        let sync = sync_vips(
            &fake,
            "keel0",
            &BTreeSet::from([ip(1), ip(2)]),
            &BTreeSet::new(),
        );
        assert!(sync.errors.is_empty(), "{:?}", sync.errors);
        assert_eq!(sync.added, vec![ip(1), ip(2)]);
        assert_eq!(sync.managed, BTreeSet::from([ip(1), ip(2)]));
        assert_eq!(fake.aliases("keel0"), vec![ip(1), ip(2), ip(99)]);

        // Service 2 is gone; 99 was never Keel's, so it stays.
        let sync = sync_vips(&fake, "keel0", &BTreeSet::from([ip(1)]), &sync.managed);
        assert_eq!(sync.removed, vec![ip(2)]);
        assert!(sync.added.is_empty(), "1 is already there");
        assert_eq!(fake.aliases("keel0"), vec![ip(1), ip(99)]);

        // A removal that fails stays Keel's, to be retried.
        faults.fail("remove_alias", Some("10.96.0.1"));
        let sync = sync_vips(&fake, "keel0", &BTreeSet::new(), &sync.managed);
        assert_eq!(sync.errors.len(), 1);
        assert_eq!(sync.managed, BTreeSet::from([ip(1)]));
        faults.clear();

        // A failed listing changes nothing.
        faults.fail("list_addresses", None);
        let sync = sync_vips(&fake, "keel0", &BTreeSet::from([ip(3)]), &sync.managed);
        assert_eq!(sync.errors.len(), 1);
        assert_eq!(sync.managed, BTreeSet::from([ip(1)]));
        assert_eq!(fake.aliases("keel0"), vec![ip(1), ip(99)]);
    }

    #[test]
    fn heartbeat_vips_are_persisted_so_a_restarted_agent_removes_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fake_net = FakeNet::new(CallLog::new(), Faults::default());
        let mut r = fake_reconciler(dir.path(), fake_net.clone());
        let pod = net("10.20.5.0/24");
        let outcome = apply_heartbeat(&mut r, pod, &[], &BTreeSet::from([ip(7)]), &[]);
        assert!(outcome.errors.is_empty(), "{:?}", outcome.errors);
        assert_eq!(fake_net.aliases("keel0"), vec![ip(7)]);
        assert_eq!(r.state().service_vips, BTreeSet::from([ip(7)]));
        drop(r);
        // The service was deleted while the agent was down.
        let mut r = fake_reconciler(dir.path(), fake_net.clone());
        let outcome = apply_heartbeat(&mut r, pod, &[], &BTreeSet::new(), &[]);
        assert!(outcome.errors.is_empty(), "{:?}", outcome.errors);
        assert!(fake_net.aliases("keel0").is_empty());
        assert!(r.state().service_vips.is_empty());
        assert_eq!(
            fake_net.bridge_address("keel0"),
            Some(net("10.20.5.1/24")),
            "the gateway address is never an alias to remove"
        );
    }
}
