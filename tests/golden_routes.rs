//! Golden transcripts of the agent's peer-route reconciliation
//! ([`routes::sync_routes`]) over [`FreeBsdNet`]: on each heartbeat one
//! netstat(1) listing, then the route(8) deletes and adds that make every
//! Alive peer's pod_cidr route via that peer, and nothing else.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::sync::Arc;

use keel::agentd::routes;
use keel::common::cidr::Ipv4Net;
use keel::common::cmd::RecordingRunner;
use keel::common::config::CommandPaths;
use keel::common::wire::Peer;
use keel::host::net::FreeBsdNet;

use crate::util::golden;

fn net(runner: Arc<RecordingRunner>) -> FreeBsdNet<Arc<RecordingRunner>> {
    FreeBsdNet::new(runner, CommandPaths::default())
}

fn prefix(s: &str) -> Ipv4Net {
    s.parse().expect("test prefix")
}

/// This node's own pod_cidr (its bridge keel0 has 10.20.3.1).
const OWN: &str = "10.20.3.0/24";
const N2_SUBNET: &str = "10.20.7.0/24";

fn n2(address: [u8; 4], alive: bool) -> Peer {
    Peer {
        node_id: "n2".into(),
        address: Ipv4Addr::from(address),
        pod_cidr: N2_SUBNET.into(),
        alive,
    }
}

fn managed() -> BTreeSet<Ipv4Net> {
    BTreeSet::from([prefix(N2_SUBNET)])
}

#[test]
fn a_new_alive_peer_gets_a_route() {
    golden::check("agent_routes_peer_appears", |r| {
        let sync = routes::sync_routes(
            &net(r),
            prefix(OWN),
            &[n2([192, 168, 1, 12], true)],
            &BTreeSet::new(),
        );
        assert!(sync.errors.is_empty(), "{:?}", sync.errors);
        assert_eq!(sync.added.len(), 1);
        assert_eq!(sync.managed, managed());
    });
}

#[test]
fn a_dead_peer_route_is_withdrawn() {
    golden::check("agent_routes_peer_dies", |r| {
        let sync = routes::sync_routes(
            &net(r),
            prefix(OWN),
            &[n2([192, 168, 1, 12], false)],
            &managed(),
        );
        assert!(sync.errors.is_empty(), "{:?}", sync.errors);
        assert_eq!(sync.deleted, [prefix(N2_SUBNET)]);
        assert!(sync.managed.is_empty());
    });
}

#[test]
fn an_unchanged_table_only_lists_routes() {
    golden::check("agent_routes_unchanged", |r| {
        let sync = routes::sync_routes(
            &net(r),
            prefix(OWN),
            &[n2([192, 168, 1, 12], true)],
            &managed(),
        );
        assert!(sync.errors.is_empty(), "{:?}", sync.errors);
        assert!(sync.added.is_empty() && sync.deleted.is_empty());
        assert_eq!(sync.managed, managed());
    });
}

#[test]
fn a_changed_gateway_is_replaced() {
    golden::check("agent_routes_gateway_changed", |r| {
        let sync = routes::sync_routes(
            &net(r),
            prefix(OWN),
            &[n2([192, 168, 1, 22], true)],
            &managed(),
        );
        assert!(sync.errors.is_empty(), "{:?}", sync.errors);
        assert_eq!(
            sync.added,
            [(prefix(N2_SUBNET), Ipv4Addr::new(192, 168, 1, 22))]
        );
    });
}

#[test]
fn a_peer_that_left_loses_the_route_keel_added() {
    golden::check("agent_routes_peer_gone", |r| {
        let sync = routes::sync_routes(&net(r), prefix(OWN), &[], &managed());
        assert!(sync.errors.is_empty(), "{:?}", sync.errors);
        assert_eq!(sync.deleted, [prefix(N2_SUBNET)]);
        assert!(sync.managed.is_empty());
    });
}
