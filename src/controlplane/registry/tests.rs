//! Unit tests of the registry: liveness, peers, placements, services.

use super::*;
use crate::common::wire::PlacedJail;
use crate::common::wire::{
    HeartbeatRequest, HeartbeatResponse, Liveness, NodeRemoval, Peer, RegisterRequest,
    ReplicaRequest, RolloutPolicy, ServiceApply,
};
use crate::controlplane::scheduler::{Candidate, pick_node, pick_node_spread};
use proptest::prelude::*;

const DEAD_AFTER: Duration = Duration::from_secs(15);

fn cluster() -> Cluster {
    cluster_from(ClusterState::default())
}

fn cluster_from(state: ClusterState) -> Cluster {
    cluster_from_at(state, Instant::now())
}

/// A control plane over `state`, started at `now`.
fn cluster_from_at(state: ClusterState, now: Instant) -> Cluster {
    Cluster::started_at(
        state,
        "10.20.0.0/16".parse().expect("cidr"),
        "10.96.0.0/16".parse().expect("cidr"),
        DEAD_AFTER,
        now,
    )
}

/// A control plane started again over `c`'s persisted state.
fn restarted(c: &Cluster) -> Cluster {
    cluster_from(c.state().clone())
}

/// [`restarted`] at `now`.
fn restarted_at(c: &Cluster, now: Instant) -> Cluster {
    cluster_from_at(c.state().clone(), now)
}

fn register(c: &mut Cluster, id: &str, port: u16, now: Instant) -> Ipv4Net {
    c.register(
        &RegisterRequest {
            node_id: id.into(),
            advertise_addr: SocketAddr::from(([127, 0, 0, 1], port)),
            capacity: Resources {
                cpu: 4.0,
                memory: 8 << 30,
            },
        },
        now,
    )
    .expect("registers")
    .0
}

fn beat(
    c: &mut Cluster,
    id: &str,
    cpu: f64,
    placed: &[(&str, u64)],
    now: Instant,
) -> HeartbeatResponse {
    c.heartbeat(
        id,
        &HeartbeatRequest {
            endpoints_generation: None,
            connections: Vec::new(),
            events_seq: None,
            committed: Resources { cpu, memory: 0 },
            ..placed_req(placed)
        },
        now,
    )
    .map(|a| decode(&a, id))
    .expect("heartbeat")
}

/// The answer as the agent receives it.
fn decode(answer: &HeartbeatAnswer, id: &str) -> HeartbeatResponse {
    let body = answer.body(id).expect("encodes");
    serde_json::from_slice(&body).expect("a heartbeat response")
}

/// A bare heartbeat from an agent holding peer list `version`.
fn beat_with(c: &mut Cluster, id: &str, version: Option<u64>, now: Instant) -> HeartbeatResponse {
    c.heartbeat(
        id,
        &HeartbeatRequest {
            peer_changes: false,
            endpoints_held: None,
            endpoints_generation: None,
            connections: Vec::new(),
            events_seq: None,
            committed: Resources::default(),
            jails: 0,
            placed: Vec::new(),
            peers_version: version,
            endpoint_changes: false,
        },
        now,
    )
    .map(|a| decode(&a, id))
    .expect("heartbeat")
}

#[test]
fn a_current_peer_list_is_not_resent() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    let full = beat_with(&mut c, "a", None, t0);
    assert_eq!(full.peers.len(), 1);
    assert!(!full.peers_unchanged);
    let version = full.peers_version;
    assert!(version.is_some());
    // Steady heartbeats change nothing, from either node.
    let t1 = t0 + Duration::from_secs(5);
    beat_with(&mut c, "b", version, t1);
    let same = beat_with(&mut c, "a", version, t1);
    assert!(same.peers_unchanged);
    assert!(same.peers.is_empty());
    assert_eq!(same.peers_version, version);
    // An agent without a version always gets the list.
    let old = beat_with(&mut c, "a", None, t1);
    assert_eq!((old.peers.len(), old.peers_unchanged), (1, false));
    // A stale version gets the list and the current version.
    let stale = beat_with(&mut c, "a", version.map(|v| v ^ 1), t1);
    assert_eq!((stale.peers.len(), stale.peers_unchanged), (1, false));
    assert_eq!(stale.peers_version, version);
}

#[test]
fn the_peer_list_version_changes_when_a_node_joins_dies_or_returns() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    let v0 = beat_with(&mut c, "a", None, t0).peers_version;

    register(&mut c, "c", 3, t0);
    let joined = beat_with(&mut c, "a", v0, t0);
    assert!(!joined.peers_unchanged, "c joined");
    assert_eq!(joined.peers.len(), 2);
    let v1 = joined.peers_version;

    // Re-registering with the same record is not a change.
    register(&mut c, "c", 3, t0);
    assert!(beat_with(&mut c, "a", v1, t0).peers_unchanged);

    // b and c keep heartbeating until c falls silent; only a reports after.
    let t1 = t0 + DEAD_AFTER / 2;
    beat_with(&mut c, "b", v1, t1);
    let t2 = t0 + DEAD_AFTER;
    beat_with(&mut c, "b", v1, t2);
    let died = beat_with(&mut c, "a", v1, t2);
    assert!(!died.peers_unchanged, "c died");
    let c_peer = died
        .peers
        .iter()
        .find(|p| p.node_id == "c")
        .expect("c listed");
    assert!(!c_peer.alive);
    let v2 = died.peers_version;
    assert!(beat_with(&mut c, "a", v2, t2).peers_unchanged);

    let back = beat_with(&mut c, "c", v2, t2);
    assert!(!back.peers_unchanged, "c's own return changes the list too");
    let seen = beat_with(&mut c, "a", v2, t2);
    assert!(!seen.peers_unchanged);
    assert!(seen.peers.iter().all(|p| p.alive));
}

#[test]
fn every_node_gets_every_peer_but_itself() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    let alone = c.heartbeat("a", &placed_req(&[]), t0).expect("heartbeat");
    assert!(decode(&alone, "a").peers.is_empty());
    register(&mut c, "b", 2, t0);
    register(&mut c, "c", 3, t0);
    let answer = c.heartbeat("b", &placed_req(&[]), t0).expect("heartbeat");
    let ids = |who: &str| -> Vec<String> {
        decode(&answer, who)
            .peers
            .into_iter()
            .map(|p| p.node_id)
            .collect()
    };
    // First, middle and last entry left out, and nothing for a stranger.
    assert_eq!(ids("a"), ["b", "c"]);
    assert_eq!(ids("b"), ["a", "c"]);
    assert_eq!(ids("c"), ["a", "b"]);
    assert_eq!(ids("zz"), ["a", "b", "c"]);
    let full = decode(&answer, "a");
    assert_eq!(
        full.peers[1],
        Peer {
            node_id: "c".into(),
            address: std::net::Ipv4Addr::LOCALHOST,
            pod_cidr: c.state().nodes["c"].pod_cidr.to_string(),
            alive: true,
        }
    );
    assert_eq!(full.peers_version, Some(c.peers_version()));
}

#[test]
fn a_changed_advertise_address_is_in_the_next_list() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    let v = beat_with(&mut c, "a", None, t0).peers_version;
    c.register(
        &RegisterRequest {
            node_id: "b".into(),
            advertise_addr: SocketAddr::from(([127, 0, 0, 9], 2)),
            capacity: Resources::default(),
        },
        t0,
    )
    .expect("re-registers");
    let resp = beat_with(&mut c, "a", v, t0);
    assert!(!resp.peers_unchanged);
    assert_eq!(resp.peers[0].address, std::net::Ipv4Addr::new(127, 0, 0, 9));
}

#[test]
fn a_restarted_control_plane_does_not_take_an_old_version_for_current() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    let old = beat_with(&mut c, "a", None, t0).peers_version;
    let mut restarted = restarted(&c);
    register(&mut restarted, "a", 1, t0);
    let resp = beat_with(&mut restarted, "a", old, t0);
    assert!(!resp.peers_unchanged);
    assert_eq!(resp.peers.len(), 1);
}

/// A bare heartbeat from an agent that applies peer changes, holding peer
/// list `version` and endpoint table `endpoints`.
fn beat_for_changes(
    c: &mut Cluster,
    id: &str,
    version: Option<u64>,
    endpoints: Option<crate::common::wire::EndpointsStamp>,
    now: Instant,
) -> HeartbeatResponse {
    let req = HeartbeatRequest {
        peer_changes: true,
        endpoints_held: endpoints,
        peers_version: version,
        ..placed_req(&[])
    };
    c.heartbeat(id, &req, now)
        .map(|a| decode(&a, id))
        .expect("heartbeat")
}

fn ids(peers: &[Peer]) -> Vec<&str> {
    peers.iter().map(|p| p.node_id.as_str()).collect()
}

#[test]
fn an_agent_that_applies_changes_gets_only_the_peers_that_changed() {
    let t0 = Instant::now();
    let mut c = cluster();
    for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
        register(&mut c, id, i as u16 + 1, t0);
    }
    let full = beat_for_changes(&mut c, "a", None, None, t0);
    assert_eq!(
        full.peers_changed, None,
        "the first heartbeat gets the list"
    );
    assert_eq!(ids(&full.peers), ["b", "c"]);
    let v0 = full.peers_version;

    register(&mut c, "d", 4, t0);
    let joined = beat_for_changes(&mut c, "a", v0, None, t0);
    assert_eq!(joined.peers_changed, v0);
    assert_eq!(ids(&joined.peers), ["d"], "only the new peer");
    assert!(joined.peers_removed.is_empty() && !joined.peers_unchanged);
    let v1 = joined.peers_version;
    assert_ne!(v1, v0);

    // d dies: a, b and c keep heartbeating.
    let half = t0 + DEAD_AFTER / 2;
    for id in ["a", "b", "c"] {
        assert!(beat_for_changes(&mut c, id, v1, None, half).peers_unchanged);
    }
    let t1 = t0 + DEAD_AFTER;
    let died = beat_for_changes(&mut c, "a", v1, None, t1);
    assert_eq!(died.peers_changed, v1);
    assert_eq!(ids(&died.peers), ["d"]);
    assert!(!died.peers[0].alive);

    // Removed for good: its id is named gone; an agent two versions behind
    // gets the removal too, and d itself is never among a's changes.
    c.remove_node("d", t1).expect("d is Dead");
    let removed = beat_for_changes(&mut c, "a", v1, None, t1);
    assert_eq!(removed.peers_changed, v1);
    assert!(removed.peers.is_empty());
    assert_eq!(removed.peers_removed, ["d"]);
    let current = removed.peers_version;
    assert!(beat_for_changes(&mut c, "a", current, None, t1).peers_unchanged);

    // An agent that does not apply changes still gets the whole list.
    let older = beat_with(&mut c, "a", v0, t1);
    assert_eq!(older.peers_changed, None);
    assert_eq!(ids(&older.peers), ["b", "c"]);
}

#[test]
fn an_agent_behind_the_change_log_or_from_another_process_gets_the_full_list() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    let v0 = beat_for_changes(&mut c, "a", None, None, t0).peers_version;
    // More changes than the log keeps: b's address flips back and forth.
    for i in 0..=peers::PEER_LOG_LEN {
        c.register(
            &RegisterRequest {
                node_id: "b".into(),
                advertise_addr: SocketAddr::from(([127, 0, 0, 2 + (i % 2) as u8], 2)),
                capacity: Resources::default(),
            },
            t0,
        )
        .expect("re-registers");
    }
    let behind = beat_for_changes(&mut c, "a", v0, None, t0);
    assert_eq!(behind.peers_changed, None);
    assert_eq!(ids(&behind.peers), ["b"]);

    let held = behind.peers_version;
    let mut restarted = restarted(&c);
    register(&mut restarted, "a", 1, t0);
    let resp = beat_for_changes(&mut restarted, "a", held, None, t0);
    assert_eq!(resp.peers_changed, None, "a new origin: the full list");
    assert_eq!(ids(&resp.peers), ["b"]);
}

#[test]
fn an_agent_holding_the_current_endpoint_table_is_not_sent_it_again() {
    use crate::common::wire::EndpointsStamp;
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    c.put_service("web", &service(2, 80, "d", false), t0)
        .expect("service");
    let first = beat_for_changes(&mut c, "a", None, None, t0);
    assert!(!first.endpoints_unchanged);
    assert_eq!(first.services.len(), 1);
    let held = EndpointsStamp {
        origin: first.endpoints_origin.expect("origin"),
        generation: first.endpoints_generation.expect("generation"),
    };
    let again = beat_for_changes(&mut c, "a", first.peers_version, Some(held), t0);
    assert!(again.endpoints_unchanged);
    assert!(again.services.is_empty());
    // Another process's stamp, or an older generation: the whole table.
    let other = EndpointsStamp {
        origin: held.origin ^ 1,
        ..held
    };
    let resent = beat_for_changes(&mut c, "a", None, Some(other), t0);
    assert!(!resent.endpoints_unchanged);
    assert_eq!(resent.services.len(), 1);
}

#[test]
fn an_answer_splices_the_peer_list_and_the_shared_endpoint_table_beside_stale_jails() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    c.put_service("web", &service(2, 80, "d", false), t0)
        .expect("service");
    // The full list, a stale jail (placed nowhere) and the table together.
    let req = HeartbeatRequest {
        peer_changes: true,
        ..placed_req(&[("ghost", 7)])
    };
    let first = c.heartbeat("a", &req, t0).expect("heartbeat");
    let resp = decode(&first, "a");
    assert_eq!(ids(&resp.peers), ["b"]);
    assert_eq!(resp.stale, ["ghost"]);
    assert_eq!(resp.services.len(), 1);
    assert_eq!(resp.services[0].name, "web");
    assert!(resp.peers_changed.is_none() && !resp.endpoints_unchanged);

    // Only the changed peer, with the table of the same generation, which
    // every answer shares instead of copying it.
    register(&mut c, "c", 3, t0);
    let req = HeartbeatRequest {
        peer_changes: true,
        peers_version: resp.peers_version,
        ..placed_req(&[])
    };
    let second = c.heartbeat("a", &req, t0).expect("heartbeat");
    let changed = decode(&second, "a");
    assert_eq!(changed.peers_changed, resp.peers_version);
    assert_eq!(ids(&changed.peers), ["c"]);
    assert!(changed.stale.is_empty());
    assert_eq!(changed.services, resp.services);
    assert_eq!(changed.endpoints_generation, resp.endpoints_generation);
    let shared = |a: &HeartbeatAnswer| a.services.clone().expect("the table is sent");
    assert!(Arc::ptr_eq(&shared(&first), &shared(&second)));
}

#[test]
fn an_agent_that_applies_endpoint_changes_gets_only_the_services_that_changed() {
    use crate::common::wire::EndpointsStamp;
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    for name in ["api", "db", "web"] {
        c.put_service(name, &service(1, 80, "d", false), t0)
            .expect("service");
    }
    let beat = |c: &mut Cluster, held: Option<EndpointsStamp>, changes: bool| {
        let req = HeartbeatRequest {
            endpoints_held: held,
            endpoint_changes: changes,
            ..placed_req(&[])
        };
        c.heartbeat("a", &req, t0)
            .map(|a| decode(&a, "a"))
            .expect("heartbeat")
    };
    let stamp = |r: &HeartbeatResponse| {
        r.endpoints_origin
            .zip(r.endpoints_generation)
            .map(|(origin, generation)| EndpointsStamp { origin, generation })
    };
    let first = beat(&mut c, None, true);
    assert_eq!(first.services.len(), 3);
    assert_eq!(first.services_changed, None, "nothing held: the table");
    let held = stamp(&first);

    // db goes: only its name, none of the unchanged entries.
    c.remove_service("db", t0).expect("removed");
    let delta = beat(&mut c, held, true);
    assert_eq!(delta.services_changed, held.map(|s| s.generation));
    assert!(delta.services.is_empty(), "{:?}", delta.services);
    assert_eq!(delta.services_removed, ["db"]);
    assert!(!delta.endpoints_unchanged);
    assert_ne!(stamp(&delta), held);
    // Every agent holding that generation is answered the same changes,
    // encoded once.
    let raw = |c: &mut Cluster| {
        let req = HeartbeatRequest {
            endpoints_held: held,
            endpoint_changes: true,
            ..placed_req(&[])
        };
        c.heartbeat("a", &req, t0).expect("heartbeat")
    };
    let (one, two) = (raw(&mut c), raw(&mut c));
    let shared = |a: &HeartbeatAnswer| a.services.clone().expect("the changes are sent");
    assert!(Arc::ptr_eq(&shared(&one), &shared(&two)));
    // The delta's generation is then current.
    assert!(beat(&mut c, stamp(&delta), true).endpoints_unchanged);

    // An agent that does not apply changes, or holds another process's
    // generation, gets the whole table.
    let older = beat(&mut c, held, false);
    assert_eq!(older.services_changed, None);
    assert_eq!(older.services.len(), 2);
    let other = held.map(|s| EndpointsStamp {
        origin: s.origin ^ 1,
        ..s
    });
    let foreign = beat(&mut c, other, true);
    assert_eq!(foreign.services_changed, None);
    assert_eq!(foreign.services.len(), 2);

    // When most of the table changed, the table itself.
    let before = stamp(&foreign);
    for name in ["api", "web"] {
        c.remove_service(name, t0).expect("removed");
    }
    c.put_service("new", &service(1, 80, "d", false), t0)
        .expect("service");
    let most = beat(&mut c, before, true);
    assert_eq!(most.services_changed, None);
    assert_eq!(ids_of(&most.services), ["new"]);
}

fn ids_of(services: &[crate::common::wire::ServiceEndpoints]) -> Vec<&str> {
    services.iter().map(|s| s.name.as_str()).collect()
}

#[test]
fn liveness_boundaries() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    assert_eq!(
        c.liveness("a", t0 + DEAD_AFTER - Duration::from_millis(1)),
        Some(Liveness::Alive)
    );
    assert_eq!(c.liveness("a", t0 + DEAD_AFTER), Some(Liveness::Dead));
    beat(&mut c, "a", 0.0, &[], t0 + DEAD_AFTER);
    assert_eq!(c.liveness("a", t0 + DEAD_AFTER), Some(Liveness::Alive));
    assert_eq!(c.liveness("nope", t0), None);
}

#[test]
fn pod_cidr_is_stable_across_re_registration_and_restarts() {
    let t0 = Instant::now();
    let mut c = cluster();
    let a = register(&mut c, "a", 1, t0);
    let b = register(&mut c, "b", 2, t0);
    assert_ne!(a, b);
    assert_eq!(register(&mut c, "a", 9, t0), a);
    let mut restarted = restarted(&c);
    assert_eq!(restarted.liveness("a", t0), Some(Liveness::Unknown));
    assert_eq!(register(&mut restarted, "a", 1, t0), a);
}

#[test]
fn a_planned_apply_goes_where_the_apply_would_and_records_nothing() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    beat(&mut c, "a", 3.0, &[], t0);
    let state = c.state().clone();
    let planned = c.plan_apply("web", None, &[], t0).expect("target");
    assert_eq!(c.state(), &state, "no placement, no epoch");
    assert!(c.pending.is_empty(), "no apply in flight");
    let t = c.begin_apply("web", None, t0).expect("target");
    assert_eq!((&planned.node, planned.epoch), (&t.node, t.epoch));
    c.finish_apply("web", &t, true);
    // Sticky: a placed jail is planned on its node, with its epoch.
    let again = c.plan_apply("web", None, &[], t0).expect("sticky");
    assert_eq!(
        (again.node.as_str(), again.epoch),
        (t.node.as_str(), t.epoch)
    );
    let elsewhere = if t.node == "a" { "b" } else { "a" };
    let refused = c.plan_apply("web", Some(elsewhere), &[], t0);
    assert_eq!(refused.map_err(|r| r.status), Err(409));
}

#[test]
fn scheduled_applies_are_sticky_and_recorded_only_on_success() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    beat(&mut c, "a", 3.0, &[], t0);
    let t = c.begin_apply("web", None, t0).expect("target");
    assert_eq!(t.node, "b", "b has more headroom");
    assert!(c.finish_apply("web", &t, false).is_empty());
    assert!(
        c.state().placements.is_empty(),
        "failure leaves no placement"
    );
    let t = c.begin_apply("web", None, t0).expect("target");
    let ops = c.finish_apply("web", &t, true);
    assert_eq!(ops.len(), 1);
    beat(&mut c, "b", 3.5, &[], t0);
    let again = c.begin_apply("web", None, t0).expect("sticky");
    assert_eq!((again.node.as_str(), again.epoch), ("b", t.epoch));
    c.finish_apply("web", &again, true);
}

fn placed_req(placed: &[(&str, u64)]) -> HeartbeatRequest {
    HeartbeatRequest {
        peer_changes: false,
        endpoints_held: None,
        endpoints_generation: None,
        connections: Vec::new(),
        events_seq: None,
        committed: Resources::default(),
        jails: placed.len() as u32,
        placed: placed
            .iter()
            .map(|(n, e)| PlacedJail {
                name: n.to_string(),
                epoch: *e,
                running: true,
                ready: None,
                address: None,
            })
            .collect(),
        peers_version: None,
        endpoint_changes: false,
    }
}

#[test]
fn committed_resources_from_an_apply_rank_the_node_before_its_heartbeat() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 1, t0);
    let first = c.begin_apply("j1", None, t0).expect("target");
    assert_eq!(first.node, "a", "equal headroom: the smallest id");
    c.finish_apply("j1", &first, true);
    // The node's answer says what it commits now; no heartbeat yet.
    let capacity = c.state().nodes["a"].capacity;
    c.note_committed(
        "a",
        Resources {
            cpu: capacity.cpu / 2.0,
            memory: 0,
        },
    );
    let second = c.begin_apply("j2", None, t0).expect("target");
    assert_eq!(
        second.node, "b",
        "a burst spreads: a is ranked by what it reported"
    );
    c.finish_apply("j2", &second, false);
    // An unknown node is ignored.
    c.note_committed("zz", Resources::default());
}

#[test]
fn an_interrupted_delete_is_finished_by_the_next_heartbeat_without_the_jail() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    let t = c.begin_apply("web", None, t0).expect("target");
    c.finish_apply("web", &t, true);
    let ops = c.begin_delete("web", "a");
    assert_eq!(
        ops.len(),
        1,
        "the mark is persisted before the DELETE goes out"
    );
    assert!(c.begin_delete("web", "a").is_empty(), "marked once");
    assert!(c.begin_delete("web", "b").is_empty(), "not placed on b");

    // The node still reports it (its delete failed, or has not run).
    assert!(
        c.reap_deleted("a", &placed_req(&[("web", t.epoch)]))
            .is_empty()
    );
    assert!(c.state().placements.contains_key("web"));
    // A heartbeat from another node says nothing about it.
    assert!(c.reap_deleted("b", &placed_req(&[])).is_empty());
    // An apply in flight keeps it, whatever the heartbeat says.
    let again = c.begin_apply("web", None, t0).expect("sticky");
    assert!(c.reap_deleted("a", &placed_req(&[])).is_empty());
    c.finish_apply("web", &again, false);
    // The node no longer has it: the placement goes (the crash case).
    let ops = c.reap_deleted("a", &placed_req(&[]));
    assert_eq!(ops, vec![Op::RemovePlacement { name: "web".into() }]);
    assert!(c.state().placements.is_empty() && c.state().deleting.is_empty());
}

#[test]
fn a_successful_apply_after_a_failed_delete_clears_the_mark() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    let t = c.begin_apply("web", None, t0).expect("target");
    c.finish_apply("web", &t, true);
    c.begin_delete("web", "a");
    let again = c.begin_apply("web", None, t0).expect("sticky");
    c.finish_apply("web", &again, true);
    assert!(
        c.state().deleting.is_empty(),
        "re-applied: no longer being deleted"
    );
    assert!(
        c.reap_deleted("a", &placed_req(&[])).is_empty(),
        "a heartbeat built before the apply finished cannot remove it"
    );
}

#[test]
fn a_placed_jail_on_a_dead_node_fails_like_the_named_route() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    let t = c.begin_apply("web", None, t0).expect("target");
    c.finish_apply("web", &t, true);
    let later = t0 + DEAD_AFTER;
    assert_eq!(
        c.begin_apply("web", None, later).expect_err("dead").status,
        503
    );
    assert_eq!(
        c.resolve_placed("web", later).expect_err("dead").status,
        503
    );
    assert_eq!(c.resolve_node("a", later).expect_err("dead").status, 503);
    assert_eq!(
        c.resolve_node("zz", later).expect_err("unknown").status,
        404
    );
}

#[test]
fn the_scheduler_sees_only_alive_registered_nodes_with_what_they_reported() {
    let t0 = Instant::now();
    let mut c = cluster();
    for (i, id) in ["a", "b", "c", "d"].into_iter().enumerate() {
        register(&mut c, id, i as u16 + 1, t0);
    }
    let on_disk = c.state().clone();
    register(&mut c, "e", 5, t0);
    // After a failed journal write "e" is gone from the records but the
    // live data still knows it: it must not be picked.
    c.reset(on_disk);
    let t1 = t0 + DEAD_AFTER - Duration::from_secs(1);
    beat(&mut c, "a", 3.0, &[], t1);
    beat(&mut c, "c", 2.0, &[], t1);
    beat(&mut c, "d", 3.5, &[], t1);
    // b is silent and Dead at t2; c has the most headroom of the rest.
    let t2 = t0 + DEAD_AFTER;
    let picked = |c: &Cluster| {
        c.candidates(t2)
            .iter()
            .map(|x| (x.node_id.to_string(), x.committed.cpu))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        picked(&c),
        [("a".into(), 3.0), ("c".into(), 2.0), ("d".into(), 3.5)]
    );
    assert_eq!(c.begin_apply("web", None, t2).expect("placed").node, "c");
}

/// One step of a random cluster history for the ranking property.
#[derive(Debug, Clone)]
enum Step {
    Register { node: u8, cpu: u8, mem: u8 },
    Beat { node: u8, cpu: u8, mem: u8 },
    Wait { secs: u8 },
    Reset,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u8..8, 0u8..5, 0u8..5).prop_map(|(node, cpu, mem)| Step::Register { node, cpu, mem }),
        (0u8..8, 0u8..6, 0u8..6).prop_map(|(node, cpu, mem)| Step::Beat { node, cpu, mem }),
        (0u8..10).prop_map(|secs| Step::Wait { secs }),
        Just(Step::Reset),
    ]
}

/// `candidates` with what a heal plan placed on each added to its committed
/// resources and jails: what [`Cluster::heal_pick`] ranks by.
fn with_planned<'a>(
    mut candidates: Vec<Candidate<'a>>,
    planned: &BTreeMap<String, (Resources, u32)>,
) -> Vec<Candidate<'a>> {
    for c in &mut candidates {
        if let Some((resources, jails)) = planned.get(c.node_id) {
            c.committed.cpu += resources.cpu;
            c.committed.memory = c.committed.memory.saturating_add(resources.memory);
            c.jails = c.jails.saturating_add(*jails);
        }
    }
    candidates
}

proptest! {
    /// The ranked index picks exactly what `pick_node` picks over every
    /// Alive node, and a heal's pick what `pick_node_spread` picks with the
    /// plan's placements counted, through registrations (new capacities),
    /// heartbeats (new commitments, ties included), deaths and resets.
    #[test]
    fn the_ranked_pick_is_pick_node_over_the_candidates(
        steps in proptest::collection::vec(step(), 1..60),
        planned in proptest::collection::vec((0u8..8, 0u8..4, 0u8..3), 0..4),
        avoid in proptest::collection::btree_set(0u8..8, 0..4),
    ) {
        // What a heal plan placed so far, and the service's own nodes.
        let planned: BTreeMap<String, (Resources, u32)> = planned
            .into_iter()
            .map(|(node, cpu, jails)| {
                let placed = Resources { cpu: f64::from(cpu) / 4.0, memory: u64::from(cpu) << 28 };
                (format!("n{node}"), (placed, u32::from(jails)))
            })
            .collect();
        let avoid: Vec<String> = avoid.into_iter().map(|n| format!("n{n}")).collect();
        let avoid: BTreeSet<&str> = avoid.iter().map(String::as_str).collect();
        let mut now = Instant::now();
        let mut c = cluster();
        let mut on_disk = c.state().clone();
        for s in steps {
            match s {
                Step::Register { node, cpu, mem } => {
                    let id = format!("n{node}");
                    c.register(
                        &RegisterRequest {
                            node_id: id,
                            advertise_addr: SocketAddr::from(([127, 0, 0, 1], 1)),
                            capacity: Resources {
                                cpu: f64::from(cpu),
                                memory: u64::from(mem) << 30,
                            },
                        },
                        now,
                    )
                    .expect("registers");
                    if node % 2 == 0 {
                        on_disk = c.state().clone();
                    }
                }
                Step::Beat { node, cpu, mem } => {
                    let req = HeartbeatRequest {
                        peer_changes: false,
                        endpoints_held: None,
                        endpoints_generation: None,
                        connections: Vec::new(),
                        events_seq: None,
                        committed: Resources {
                            cpu: f64::from(cpu) / 2.0,
                            memory: u64::from(mem) << 29,
                        },
                        jails: 0,
                        placed: vec![],
                        peers_version: None,
                        endpoint_changes: false,
                    };
                    let _ = c.heartbeat(&format!("n{node}"), &req, now);
                }
                Step::Wait { secs } => now += Duration::from_secs(u64::from(secs)),
                Step::Reset => c.reset(on_disk.clone()),
            }
            let expected = pick_node(&c.candidates(now)).map(str::to_string);
            prop_assert_eq!(c.scheduled_pick(now), expected);
            let expected =
                pick_node_spread(&with_planned(c.candidates(now), &planned), &avoid)
                    .map(str::to_string);
            prop_assert_eq!(c.heal_pick(&planned, &avoid, now), expected);
        }
    }
}

#[test]
fn no_alive_node_is_503() {
    let mut c = cluster();
    assert_eq!(
        c.begin_apply("web", None, Instant::now())
            .expect_err("none")
            .status,
        503
    );
}

#[test]
fn concurrent_applies_of_one_name_go_to_one_node() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    let first = c.begin_apply("web", None, t0).expect("first");
    beat(&mut c, &first.node, 4.0, &[], t0);
    let second = c.begin_apply("web", None, t0).expect("second");
    assert_eq!(first, second);
    let other = c.begin_apply("db", None, t0).expect("db");
    assert_ne!(other.epoch, first.epoch);
}

#[test]
fn named_applies_conflict_with_a_placement_elsewhere() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    let t = c.begin_apply("web", Some("a"), t0).expect("named");
    c.finish_apply("web", &t, true);
    assert_eq!(
        c.begin_apply("web", Some("b"), t0)
            .expect_err("conflict")
            .status,
        409
    );
    assert_eq!(c.begin_apply("web", None, t0).expect("scheduled").node, "a");
}

#[test]
fn heartbeats_fence_jails_placed_elsewhere_or_deleted_but_not_in_flight_ones() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    let t = c.begin_apply("web", Some("b"), t0).expect("web on b");
    c.finish_apply("web", &t, true);
    let inflight = c.begin_apply("db", Some("a"), t0).expect("db on a");
    let resp = beat(
        &mut c,
        "a",
        0.0,
        &[("web", t.epoch - 1), ("db", inflight.epoch), ("gone", 1)],
        t0,
    );
    assert_eq!(resp.stale, vec!["web".to_string(), "gone".to_string()]);
    assert_eq!(resp.peers.len(), 1);
    assert!(resp.peers[0].alive);
}

#[test]
fn removing_a_placement_needs_the_node_that_holds_it() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    let t = c.begin_apply("web", None, t0).expect("web");
    c.finish_apply("web", &t, true);
    assert!(c.remove_placement("web", "b").is_empty());
    assert_eq!(c.remove_placement("web", "a").len(), 1);
    assert!(c.state().placements.is_empty());
}

fn service(replicas: u32, port: u16, digest: &str, stateful: bool) -> ServiceApply {
    ServiceApply {
        document: "kind: Service".into(),
        replicas,
        port,
        stateful,
        template_digest: digest.into(),
        volumes: if stateful {
            vec!["data".into()]
        } else {
            Vec::new()
        },
        // Drains end at once here; the drain tests set their own timeout.
        policy: RolloutPolicy {
            drain_timeout_ms: 0,
            ..RolloutPolicy::default()
        },
        resources: None,
    }
}

#[test]
fn a_cordoned_node_gets_nothing_new_and_keeps_what_it_runs() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    let before = c.begin_apply("before", None, t0).expect("pick");
    assert_eq!(before.node, "a", "equal headroom: the smallest id");
    c.finish_apply("before", &before, true);
    beat(&mut c, "a", 0.0, &[("before", before.epoch)], t0);

    assert_eq!(
        c.set_cordoned("nope", true, t0)
            .expect_err("unknown")
            .status,
        404
    );
    let ops = c.set_cordoned("a", true, t0).expect("cordon");
    assert!(
        matches!(&ops[..], [Op::PutNode { id, record }] if id == "a" && record.cordoned),
        "{ops:?}"
    );
    assert!(c.set_cordoned("a", true, t0).expect("again").is_empty());
    // The scheduled route and the services' healing skip it...
    assert_eq!(c.begin_apply("x", None, t0).expect("pick").node, "b");
    c.finish_apply(
        "x",
        &Target {
            node: "b".into(),
            ..before.clone()
        },
        false,
    );
    c.put_service("web", &service(2, 80, "d", false), Instant::now())
        .expect("service");
    let placed: Vec<String> = c
        .plan_heal(Some("web"), t0)
        .into_iter()
        .filter_map(|a| match a {
            HealAction::Place { target, .. } => Some(target.node),
            HealAction::Remove { .. } => None,
        })
        .collect();
    assert_eq!(placed, ["b", "b"]);
    // ...but what it runs stays, a named apply still reaches it, and the
    // node list says so.
    assert_eq!(c.resolve_placed("before", t0).expect("placed").node, "a");
    assert_eq!(c.begin_apply("y", Some("a"), t0).expect("named").node, "a");
    let a = c
        .node_statuses(t0)
        .into_iter()
        .find(|n| n.node_id == "a")
        .expect("a");
    assert!(a.cordoned && a.status == Liveness::Alive, "{a:?}");
    // A re-registering agent and a restarted control plane keep it.
    register(&mut c, "a", 1, t0);
    let restarted = restarted(&c);
    assert!(restarted.state().nodes["a"].cordoned);
    assert!(c.state().nodes["a"].cordoned);

    // Uncordoned, it is a candidate again: with more headroom than b, the
    // pick.
    beat(&mut c, "b", 1.0, &[], t0);
    c.set_cordoned("a", false, t0).expect("uncordon");
    assert_eq!(c.begin_apply("z", None, t0).expect("pick").node, "a");
}

#[test]
fn equal_headroom_spreads_by_jails_and_a_heal_spreads_what_it_plans() {
    let t0 = Instant::now();
    let mut c = cluster();
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        register(&mut c, id, i as u16 + 1, t0);
        beat(&mut c, id, 0.0, &[], t0);
    }
    // Jails that request nothing: each answered apply counts on its node
    // until the next heartbeat, so consecutive applies spread.
    let mut picked = Vec::new();
    for name in ["j1", "j2", "j3"] {
        let target = c.begin_apply(name, None, t0).expect("pick");
        c.note_committed(&target.node, Resources::default());
        c.finish_apply(name, &target, true);
        picked.push(target.node);
    }
    picked.sort();
    assert_eq!(picked, ["a", "b", "c"]);

    // One plan of six single-replica services, before any node reports:
    // what the plan placed counts, so they spread two a node instead of
    // all going to the node with the most headroom at its start.
    let mut each = service(1, 80, "d", false);
    each.resources = Some(ReplicaRequest {
        cpu_millicores: 500,
        memory: 0,
    });
    for i in 0..6 {
        c.put_service(&format!("s{i}"), &each, t0).expect("service");
    }
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for action in c.plan_heal(None, t0) {
        if let HealAction::Place { target, .. } = action {
            *per_node.entry(target.node).or_default() += 1;
        }
    }
    assert_eq!(
        per_node.values().copied().collect::<Vec<_>>(),
        [2, 2, 2],
        "{per_node:?}"
    );
}

#[test]
fn only_a_dead_node_is_deleted_and_it_takes_its_placements_and_volumes() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    let pg = vec!["pg".to_string()];
    let db = c
        .begin_apply_with_volumes("db", Some("b"), &pg, t0)
        .expect("placed");
    c.finish_apply("db", &db, true);
    let web = c.begin_apply("web", Some("b"), t0).expect("placed");
    c.finish_apply("web", &web, true);
    let api = c.begin_apply("api", Some("a"), t0).expect("placed");
    c.finish_apply("api", &api, true);
    c.begin_delete("web", "b");

    assert_eq!(c.remove_node("nope", t0).expect_err("unknown").status, 404);
    let alive = c.remove_node("b", t0).expect_err("alive");
    assert_eq!(alive.status, 409);
    assert!(alive.message.contains("node b is Alive"), "{alive}");
    assert!(c.state().nodes.contains_key("b"));

    let later = t0 + DEAD_AFTER + Duration::from_secs(1);
    beat(&mut c, "a", 0.0, &[("api", api.epoch)], later);
    // A control plane that just restarted has heard from nobody: not
    // evidence enough, until dead_after has passed since its start.
    let start = Instant::now();
    let mut restarted = restarted_at(&c, start);
    let soon = restarted
        .remove_node("b", start + Duration::from_secs(1))
        .expect_err("too soon");
    assert_eq!(soon.status, 409);
    assert!(soon.message.contains("not been heard from"), "{soon}");
    assert!(restarted.remove_node("b", start + DEAD_AFTER).is_ok());
    let (ops, removal) = c.remove_node("b", later).expect("dead");
    assert_eq!(ops, [Op::RemoveNode { id: "b".into() }]);
    assert_eq!(
        removal,
        NodeRemoval {
            deleted: "b".into(),
            jails: vec!["db".into(), "web".into()],
            volumes: pg.clone(),
        }
    );
    let st = c.state();
    assert!(!st.nodes.contains_key("b"));
    assert_eq!(st.placements.keys().collect::<Vec<_>>(), ["api"]);
    assert!(st.volumes.is_empty() && st.deleting.is_empty());
    // Gone from every view: the node list, the peers, the scheduler.
    let listed: Vec<String> = c
        .node_statuses(later)
        .into_iter()
        .map(|n| n.node_id)
        .collect();
    assert_eq!(listed, ["a"]);
    assert_eq!(c.resolve_node("b", later).expect_err("gone").status, 404);
    // Its volume pins nothing any more: a jail declaring it goes where the
    // scheduler says (a new, empty volume there).
    let moved = c
        .begin_apply_with_volumes("db", None, &pg, later)
        .expect("scheduled");
    assert_eq!(moved.node, "a");
    c.finish_apply("db", &moved, true);

    // The host comes back: it registers again, and fencing tells it to
    // remove what it still runs from before.
    register(&mut c, "b", 2, later);
    let answer = beat(
        &mut c,
        "b",
        0.0,
        &[("web", web.epoch), ("db", db.epoch)],
        later,
    );
    assert_eq!(answer.stale, ["web", "db"]);
}

#[test]
fn a_declared_volume_pins_every_later_apply_to_its_node() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    let pg = vec!["pg".to_string()];
    let t = c
        .begin_apply_with_volumes("db", Some("b"), &pg, t0)
        .expect("placed");
    let ops = c.finish_apply("db", &t, true);
    assert!(ops.contains(&Op::PutVolume {
        name: "pg".into(),
        node: "b".into()
    }));
    // The jail is deleted; its volume stays on b. `a` has more headroom
    // (b carries load), so the scheduler alone would pick a.
    c.remove_placement("db", "b");
    beat(&mut c, "b", 3.0, &[], t0);
    assert_eq!(c.begin_apply("other", None, t0).expect("pick").node, "a");
    let again = c
        .begin_apply_with_volumes("db2", None, &pg, t0)
        .expect("pinned");
    assert_eq!(again.node, "b", "any jail declaring pg goes to b");
    c.finish_apply("db2", &again, false);
    let named = c
        .begin_apply_with_volumes("db", Some("a"), &pg, t0)
        .expect_err("named elsewhere");
    assert_eq!(named.status, 409);
    assert!(named.message.contains("volume pg is on node b"), "{named}");
    // b dies: no empty pg anywhere else.
    let later = t0 + DEAD_AFTER + Duration::from_secs(1);
    beat(&mut c, "a", 0.0, &[], later);
    let dead = c
        .begin_apply_with_volumes("db", None, &pg, later)
        .expect_err("dead");
    assert_eq!(dead.status, 503);
    assert!(
        dead.message.contains("node b") && dead.message.contains("volume pg"),
        "{dead}"
    );
    assert_eq!(c.resolve_volume("pg", later).expect_err("dead").status, 503);
    assert_eq!(
        c.resolve_volume("nope", later).expect_err("unknown").status,
        404
    );
    // A refused apply (4xx) registers nothing; one that reached the node does.
    let t = c
        .begin_apply_with_volumes("cache", None, &["tmp".to_string()], later)
        .expect("a");
    assert!(c.finish_apply_reached("cache", &t, false, false).is_empty());
    let t = c
        .begin_apply_with_volumes("cache", None, &["tmp".to_string()], later)
        .expect("a");
    assert_eq!(c.finish_apply_reached("cache", &t, false, true).len(), 1);
    assert_eq!(
        c.volume_registry().get("tmp").map(String::as_str),
        Some("a")
    );
    assert!(c.remove_volume("tmp", "b").is_empty(), "only its node");
    assert_eq!(c.remove_volume("tmp", "a").len(), 1);
}

#[test]
fn volumes_on_two_nodes_cannot_be_declared_together() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    for (jail, node, vol) in [("x", "a", "va"), ("y", "b", "vb")] {
        let t = c
            .begin_apply_with_volumes(jail, Some(node), &[vol.to_string()], t0)
            .expect("placed");
        c.finish_apply(jail, &t, true);
    }
    let both = vec!["va".to_string(), "vb".to_string()];
    let err = c
        .begin_apply_with_volumes("z", None, &both, t0)
        .expect_err("split");
    assert_eq!(err.status, 409);
}

#[test]
fn a_stateful_replica_scaled_away_comes_back_to_its_data() {
    let t0 = Instant::now();
    let mut c = cluster();
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        register(&mut c, id, i as u16 + 1, t0);
    }
    c.put_service("db", &service(2, 5432, "t", true), Instant::now())
        .expect("put");
    let plan = c.plan_heal(Some("db"), t0);
    let volumes: Vec<Vec<String>> = plan
        .iter()
        .filter_map(|a| match a {
            HealAction::Place { volumes, .. } => Some(volumes.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        volumes,
        [vec!["db-0-data".to_string()], vec!["db-1-data".to_string()]]
    );
    carry_out(&mut c, plan, t0);
    let home = c.volume_registry()["db-1-data"].clone();
    c.put_service("db", &service(1, 5432, "t", true), Instant::now())
        .expect("down");
    let plan = c.plan_heal(Some("db"), t0);
    carry_out(&mut c, plan, t0);
    assert_eq!(nodes_of(&c, "db").len(), 1);
    // Load everything but db-1's old node, then make that node the
    // fullest: the spreading scheduler would never pick it.
    beat(&mut c, &home, 3.9, &[], t0);
    c.put_service("db", &service(2, 5432, "t", true), Instant::now())
        .expect("up");
    let plan = c.plan_heal(Some("db"), t0);
    match plan.as_slice() {
        [
            HealAction::Place {
                replica, target, ..
            },
        ] => {
            assert_eq!(
                (replica.as_str(), target.node.as_str()),
                ("db-1", home.as_str())
            );
        }
        other => panic!("{other:?}"),
    }
    carry_out(&mut c, plan, t0);
    // Its node dies and the replica is removed by a scale-down and wanted
    // again: it waits for the node instead of going elsewhere.
    c.put_service("db", &service(1, 5432, "t", true), Instant::now())
        .expect("down");
    let plan = c.plan_heal(Some("db"), t0);
    carry_out(&mut c, plan, t0);
    let later = t0 + DEAD_AFTER + Duration::from_secs(1);
    for id in ["a", "b", "c"] {
        if id != home {
            beat(&mut c, id, 0.0, &[], later);
        }
    }
    c.put_service("db", &service(2, 5432, "t", true), Instant::now())
        .expect("up");
    assert!(
        c.plan_heal(Some("db"), later).is_empty(),
        "db-1 waits for {home}"
    );
}

/// Places every planned replica as if its node answered success, and has
/// each node not Dead report its replicas running and ready with an address.
fn carry_out(c: &mut Cluster, actions: Vec<HealAction>, now: Instant) {
    carry_out_with(c, actions, &[], now);
}

fn nodes_of(c: &Cluster, svc: &str) -> Vec<String> {
    c.placed_replicas(svc)
        .into_iter()
        .map(|(_, _, p)| p.node)
        .collect()
}

#[test]
fn services_spread_scale_up_and_down() {
    let t0 = Instant::now();
    let mut c = cluster();
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        register(&mut c, id, i as u16 + 1, t0);
    }
    c.put_service("web", &service(3, 80, "t1", false), Instant::now())
        .expect("put");
    let plan = c.plan_heal(Some("web"), t0);
    assert_eq!(plan.len(), 3);
    carry_out(&mut c, plan, t0);
    let mut nodes = nodes_of(&c, "web");
    nodes.sort();
    assert_eq!(nodes, ["a", "b", "c"], "one replica per node");
    let status = c.service_status("web", t0).expect("status");
    assert_eq!((status.desired, status.ready), (3, 3));
    let endpoints = c.endpoints(t0);
    assert_eq!(endpoints[0].replicas.len(), 3);
    assert_eq!(endpoints[0].vip, status.vip);

    c.put_service("web", &service(5, 80, "t1", false), Instant::now())
        .expect("scale up");
    let plan = c.plan_heal(Some("web"), t0);
    assert_eq!(plan.len(), 2);
    carry_out(&mut c, plan, t0);
    c.put_service("web", &service(2, 80, "t1", false), Instant::now())
        .expect("scale down");
    let plan = c.plan_heal(Some("web"), t0);
    assert_eq!(
        plan.iter()
            .filter(|a| matches!(a, HealAction::Remove { .. }))
            .count(),
        3
    );
    carry_out(&mut c, plan, t0);
    let names: Vec<String> = c
        .placed_replicas("web")
        .into_iter()
        .map(|(_, n, _)| n)
        .collect();
    assert_eq!(names, ["web-0", "web-1"]);
    assert!(c.plan_heal(Some("web"), t0).is_empty(), "converged");
}

#[test]
fn the_port_and_volumes_are_immutable_a_template_change_is_a_revision_and_the_vip_never_changes() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    c.put_service("web", &service(1, 80, "t1", false), Instant::now())
        .expect("put");
    let vip = c.service_status("web", t0).expect("status").vip;
    assert!(
        "10.96.0.0/16"
            .parse::<Ipv4Net>()
            .expect("cidr")
            .contains(vip)
    );
    let e = c
        .put_service("web", &service(1, 81, "t1", false), Instant::now())
        .expect_err("port");
    assert_eq!((e.status, e.field.as_deref()), (409, Some("spec.port")));
    let e = c
        .put_service("web", &service(1, 80, "t1", true), Instant::now())
        .expect_err("volumes");
    assert_eq!(
        (e.status, e.field.as_deref()),
        (409, Some("spec.template.volumes"))
    );
    assert_eq!(c.service_status("web", t0).expect("status").revision, 1);
    c.put_service("web", &service(1, 80, "t2", false), Instant::now())
        .expect("template");
    let status = c.service_status("web", t0).expect("status");
    assert_eq!(status.revision, 2);
    assert_eq!(
        status.rollout.map(|r| (r.revision, r.state)),
        Some((2, "Progressing".to_string()))
    );
    // Scaling is not a revision.
    c.put_service("web", &service(4, 80, "t2", false), Instant::now())
        .expect("scale");
    let status = c.service_status("web", t0).expect("status");
    assert_eq!((status.revision, status.vip), (2, vip));
    c.put_service("db", &service(1, 5432, "t3", false), Instant::now())
        .expect("db");
    assert_ne!(c.service_status("db", t0).expect("status").vip, vip);
}

#[test]
fn vip_exhaustion_is_a_hard_error() {
    let mut c = Cluster::new(
        ClusterState::default(),
        "10.20.0.0/16".parse().expect("cidr"),
        "10.96.0.0/30".parse().expect("cidr"),
        DEAD_AFTER,
    );
    c.put_service("a", &service(1, 80, "t", false), Instant::now())
        .expect("first");
    c.put_service("b", &service(1, 80, "t", false), Instant::now())
        .expect("second");
    assert_eq!(
        c.put_service("c", &service(1, 80, "t", false), Instant::now())
            .expect_err("full")
            .status,
        409
    );
}

#[test]
fn a_dead_node_s_stateless_replica_moves_and_a_stateful_one_waits() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    c.put_service("web", &service(2, 80, "t1", false), Instant::now())
        .expect("web");
    c.put_service("db", &service(2, 5432, "t2", true), Instant::now())
        .expect("db");
    let plan = c.plan_heal(None, t0);
    carry_out(&mut c, plan, t0);
    let web_before = c.state().placements["web-0"].clone();
    // Only `b` keeps heartbeating.
    let later = t0 + DEAD_AFTER;
    beat(&mut c, "b", 0.0, &[], later);
    let dead = if web_before.node == "a" { "a" } else { "b" };
    let plan = c.plan_heal(None, later);
    let moved: Vec<&str> = plan
        .iter()
        .filter_map(|a| match a {
            HealAction::Place { replica, .. } => Some(replica.as_str()),
            _ => None,
        })
        .collect();
    assert!(
        moved.iter().all(|r| r.starts_with("web-")),
        "stateful replicas stay: {moved:?}"
    );
    assert_eq!(moved.len(), 1, "exactly the replica on the dead node moves");
    carry_out(&mut c, plan, later);
    assert!(nodes_of(&c, "web").iter().all(|n| n == "b"));
    assert!(
        nodes_of(&c, "db").contains(&"a".to_string()),
        "pinned to its dead node"
    );
    let db = c.service_status("db", later).expect("db");
    assert_eq!(db.ready, 1, "the pinned replica drops out of the VIP list");
    assert!(db.replicas.iter().any(|r| r.state == "NodeDead"));
    let moved_epoch =
        c.state().placements[&format!("web-{}", if dead == web_before.node { 0 } else { 1 })].epoch;
    assert!(moved_epoch > web_before.epoch || web_before.node != dead);
}

#[test]
fn deleting_a_service_releases_its_vip_and_removes_its_replicas() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    c.put_service("web", &service(2, 80, "t1", false), Instant::now())
        .expect("web");
    let plan = c.plan_heal(None, t0);
    carry_out(&mut c, plan, t0);
    let (_, removals) = c.remove_service("web", t0).expect("remove");
    assert_eq!(removals.len(), 2);
    carry_out(&mut c, removals, t0);
    assert!(c.state().placements.is_empty());
    assert!(c.service_status("web", t0).is_none());
    assert_eq!(c.remove_service("web", t0).expect_err("gone").status, 404);
}

/// The placed replicas `node` would report in a heartbeat, all running.
fn reported_by(c: &Cluster, node: &str) -> HeartbeatRequest {
    let placed = c
        .state()
        .placements
        .iter()
        .filter(|(_, p)| p.node == node)
        .map(|(n, p)| PlacedJail {
            name: n.clone(),
            epoch: p.epoch,
            running: true,
            ready: None,
            address: Some(Ipv4Addr::new(10, 20, 0, 2)),
        })
        .collect();
    HeartbeatRequest {
        peer_changes: false,
        endpoints_held: None,
        endpoints_generation: None,
        connections: Vec::new(),
        events_seq: None,
        committed: Resources::default(),
        jails: 0,
        placed,
        peers_version: None,
        endpoint_changes: false,
    }
}

/// Three nodes running one replica each of a 3-replica `web`.
fn spread_web() -> (Cluster, Instant) {
    let t0 = Instant::now();
    let mut c = cluster();
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        register(&mut c, id, i as u16 + 1, t0);
    }
    c.put_service("web", &service(3, 80, "t1", false), Instant::now())
        .expect("put");
    let plan = c.plan_heal(Some("web"), t0);
    carry_out(&mut c, plan, t0);
    (c, t0)
}

#[test]
fn a_restart_moves_nothing_fences_nothing_and_keeps_every_route() {
    let (c, _) = spread_web();
    let placements = c.state().placements.clone();
    let t1 = Instant::now();
    let mut r = restarted_at(&c, t1);
    for id in ["a", "b", "c"] {
        assert_eq!(r.liveness(id, t1), Some(Liveness::Unknown), "{id}");
    }

    // `a` heartbeats first: nothing of b's or c's is moved or fenced.
    let answer = r.heartbeat("a", &reported_by(&r, "a"), t1).expect("beat");
    let resp = decode(&answer, "a");
    assert!(resp.stale.is_empty(), "nothing of a's is fenced");
    assert!(
        resp.peers.iter().all(|p| p.alive),
        "unknown peers stay routed: {:?}",
        resp.peers
    );
    let web = &resp.services[0];
    assert!(web.unsettled, "b's and c's replicas are not known yet");
    assert_eq!(web.replicas.len(), 1, "only a's replica is vouched for");
    assert!(r.plan_heal(None, t1).is_empty(), "nothing is healed away");
    assert!(r.scheduled_pick(t1).is_some_and(|n| n == "a"));
    let refused = r.remove_node("c", t1).expect_err("unknown is not dead");
    assert_eq!(refused.status, 409);
    assert!(r.resolve_node("b", t1).is_ok(), "forwards still reach b");

    // b and c report in: the table is whole and settled again.
    for id in ["b", "c"] {
        let req = reported_by(&r, id);
        let resp = decode(&r.heartbeat(id, &req, t1).expect("beat"), id);
        assert!(resp.stale.is_empty(), "nothing of {id}'s is fenced");
    }
    let endpoints = r.endpoints(t1);
    assert!(!endpoints[0].unsettled);
    assert_eq!(endpoints[0].replicas.len(), 3);
    assert_eq!(r.state().placements, placements, "no replica moved");
}

#[test]
fn a_node_vouched_for_is_alive_at_once_but_moves_nothing_and_dies_only_one_lease_later() {
    let (c, _) = spread_web();
    let placements = c.state().placements.clone();
    let t1 = Instant::now();
    let mut r = restarted_at(&c, t1);
    let load = Resources {
        cpu: 1.0,
        memory: 1 << 30,
    };
    for id in ["b", "c"] {
        r.vouch(id, load, 1, t1);
        assert_eq!(r.liveness(id, t1), Some(Liveness::Alive), "{id}");
    }
    r.vouch("nobody", load, 1, t1);
    assert_eq!(r.liveness("nobody", t1), None, "no record, no node");
    assert_eq!(r.liveness("a", t1), Some(Liveness::Unknown));
    // Schedulable with the load it last reported; nothing healed or fenced.
    assert!(r.scheduled_pick(t1).is_some_and(|n| n == "b" || n == "c"));
    assert!(r.plan_heal(None, t1).is_empty(), "nothing is healed away");
    let answer = r.heartbeat("a", &reported_by(&r, "a"), t1).expect("beat");
    assert!(decode(&answer, "a").stale.is_empty());
    let endpoints = r.endpoints(t1);
    assert!(
        endpoints[0].unsettled,
        "vouched replicas are not reported ready"
    );
    assert_eq!(r.state().placements, placements, "no replica moved");

    // Silent: Dead one whole lease after the start, as an Unknown node is,
    // not one lease after the earlier leader last heard it.
    let almost = t1 + DEAD_AFTER - Duration::from_millis(1);
    r.heartbeat("b", &reported_by(&r, "b"), almost)
        .expect("beat");
    assert_eq!(r.liveness("c", almost), Some(Liveness::Alive));
    let expired = t1 + DEAD_AFTER;
    r.heartbeat("b", &reported_by(&r, "b"), expired)
        .expect("beat");
    assert_eq!(r.liveness("c", expired), Some(Liveness::Dead));
    // A node seen dead is not vouched back to life.
    r.vouch("c", load, 1, expired);
    assert_eq!(r.liveness("c", expired), Some(Liveness::Dead));
}

#[test]
fn a_node_silent_after_a_restart_dies_one_lease_later_and_its_replica_moves() {
    let (c, _) = spread_web();
    let t1 = Instant::now();
    let mut r = restarted_at(&c, t1);
    let almost = t1 + DEAD_AFTER - Duration::from_millis(1);
    for id in ["a", "b"] {
        let req = reported_by(&r, id);
        r.heartbeat(id, &req, almost).expect("beat");
    }
    assert_eq!(r.liveness("c", almost), Some(Liveness::Unknown));
    assert!(r.plan_heal(None, almost).is_empty());

    let expired = t1 + DEAD_AFTER;
    let req = reported_by(&r, "a");
    let resp = decode(&r.heartbeat("a", &req, expired).expect("beat"), "a");
    assert_eq!(r.liveness("c", expired), Some(Liveness::Dead));
    assert!(
        resp.peers.iter().any(|p| p.node_id == "c" && !p.alive),
        "c's route is withdrawn once it is seen dead"
    );
    let plan = r.plan_heal(None, expired);
    let moved: Vec<&HealAction> = plan
        .iter()
        .filter(|a| matches!(a, HealAction::Place { .. }))
        .collect();
    assert_eq!(moved.len(), 1, "c's replica, and only it: {plan:?}");
}

#[test]
fn a_stall_restarts_the_leases_it_hid_but_not_ones_seen_expired() {
    let t0 = Instant::now();
    let mut c = cluster();
    for (i, id) in ["a", "b", "gone"].iter().enumerate() {
        register(&mut c, id, i as u16 + 1, t0);
    }
    // `gone` is seen dead before the stall.
    let t1 = t0 + DEAD_AFTER;
    beat(&mut c, "a", 0.0, &[], t1);
    beat(&mut c, "b", 0.0, &[], t1);
    assert_eq!(c.liveness("gone", t1), Some(Liveness::Dead));

    // The worker cannot run for twice dead_after; then a's heartbeat comes.
    let resumed = t1 + 2 * DEAD_AFTER;
    c.observation_gap(t1, resumed);
    beat(&mut c, "a", 0.0, &[], resumed);
    assert_eq!(
        c.liveness("b", resumed),
        Some(Liveness::Alive),
        "b's lease restarted"
    );
    assert_eq!(c.liveness("gone", resumed), Some(Liveness::Dead));
    let later = resumed + DEAD_AFTER;
    beat(&mut c, "a", 0.0, &[], later);
    assert_eq!(
        c.liveness("b", later),
        Some(Liveness::Dead),
        "a whole lease after the stall, silence is evidence again"
    );
}

#[test]
fn a_jail_and_a_service_never_claim_one_name() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    let jail = c.begin_apply("svcx-1", None, t0).expect("placed");
    // In flight: already taken.
    let err = c
        .put_service("svcx", &service(2, 80, "t1", false), Instant::now())
        .expect_err("the jail's name is a replica's");
    assert_eq!(
        (err.status, err.field.as_deref()),
        (409, Some("metadata.name"))
    );
    assert!(err.message.contains("jail svcx-1"), "{err}");
    c.finish_apply("svcx-1", &jail, true);
    let err = c
        .put_service("svcx", &service(2, 80, "t1", false), Instant::now())
        .expect_err("placed: still taken");
    assert!(
        err.message.contains("jail svcx-1 exists (on node a)"),
        "{err}"
    );
    // Other names of the same shape are not this service's.
    c.put_service("svcx-1", &service(1, 81, "t2", false), Instant::now())
        .expect("replicas svcx-1-0 collide with nothing");
    c.remove_placement("svcx-1", "a");
    c.put_service("svcx", &service(2, 80, "t1", false), Instant::now())
        .expect("free again");

    for name in ["svcx-0", "svcx-9"] {
        let err = c.begin_apply(name, None, t0).expect_err("a replica's name");
        assert_eq!(err.status, 409);
        assert!(
            err.message.contains("replica") && err.message.contains("service svcx"),
            "{err}"
        );
        assert!(
            c.begin_apply(name, Some("a"), t0).is_err(),
            "named route too"
        );
    }
    assert!(
        c.begin_apply("svcx-01", None, t0).is_ok(),
        "not a canonical index"
    );

    let err = c
        .put_service("keel", &service(1, 82, "t3", false), Instant::now())
        .expect_err("reserved");
    assert_eq!(err.status, 400);
    assert!(err.message.contains("\"keel-0\""), "{err}");
}

#[test]
fn a_replica_that_runs_but_is_not_ready_leaves_the_vip_list() {
    let t0 = Instant::now();
    let mut c = cluster();
    register(&mut c, "a", 1, t0);
    c.put_service("web", &service(1, 80, "t1", false), Instant::now())
        .expect("put");
    let plan = c.plan_heal(Some("web"), t0);
    carry_out(&mut c, plan, t0);
    let epoch = c.state().placements["web-0"].epoch;
    let report = |ready: Option<bool>| HeartbeatRequest {
        peer_changes: false,
        endpoints_held: None,
        endpoints_generation: None,
        connections: Vec::new(),
        events_seq: None,
        committed: Resources::default(),
        jails: 1,
        placed: vec![PlacedJail {
            name: "web-0".into(),
            epoch,
            running: true,
            ready,
            address: Some(Ipv4Addr::new(10, 20, 0, 2)),
        }],
        peers_version: None,
        endpoint_changes: false,
    };
    c.heartbeat("a", &report(Some(false)), t0)
        .expect("heartbeat");
    let status = c.service_status("web", t0).expect("status");
    assert_eq!(status.ready, 0);
    assert_eq!(status.replicas[0].state, "NotReady");
    assert!(c.endpoints(t0)[0].replicas.is_empty(), "no traffic to it");

    c.heartbeat("a", &report(Some(true)), t0)
        .expect("heartbeat");
    assert_eq!(c.endpoints(t0)[0].replicas.len(), 1, "back in rotation");
    c.heartbeat("a", &report(None), t0).expect("heartbeat");
    assert_eq!(
        c.endpoints(t0)[0].replicas.len(),
        1,
        "an agent older than health checks: running is ready"
    );
}

// Rolling updates, scaling and draining.

/// Every node not Dead reports its placed replicas running, ready unless
/// named in `not_ready`, at `now`.
fn beat_all(c: &mut Cluster, not_ready: &[&str], now: Instant) {
    let nodes: Vec<String> = c.state().nodes.keys().cloned().collect();
    for node in nodes {
        if c.liveness(&node, now) == Some(Liveness::Dead) {
            continue;
        }
        let mut req = reported_by(c, &node);
        for j in &mut req.placed {
            j.ready = Some(!not_ready.contains(&j.name.as_str()));
        }
        c.heartbeat(&node, &req, now).expect("heartbeat");
    }
}

/// Carries out `actions` (replicas applied, removals done) with `not_ready`
/// reported not ready afterwards.
fn carry_out_with(c: &mut Cluster, actions: Vec<HealAction>, not_ready: &[&str], now: Instant) {
    let mut services = Vec::new();
    for a in actions {
        match a {
            HealAction::Place {
                service,
                replica,
                target,
                ..
            } => {
                services.push(service);
                c.finish_apply(&replica, &target, true);
            }
            HealAction::Remove {
                service,
                replica,
                node,
                ..
            } => {
                services.push(service);
                c.remove_placement(&replica, &node);
            }
        }
    }
    c.heal_done(&services);
    beat_all(c, not_ready, now);
}

fn placed_names(plan: &[HealAction]) -> Vec<String> {
    plan.iter()
        .filter_map(|a| match a {
            HealAction::Place { replica, .. } => Some(replica.clone()),
            HealAction::Remove { .. } => None,
        })
        .collect()
}

/// Three ready replicas of `web` on template `t1`, one per node.
fn three_ready(t0: Instant) -> Cluster {
    let mut c = cluster();
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        register(&mut c, id, i as u16 + 1, t0);
    }
    c.put_service("web", &service(3, 80, "t1", false), t0)
        .expect("put");
    let plan = c.plan_heal(Some("web"), t0);
    carry_out(&mut c, plan, t0);
    assert_eq!(c.service_status("web", t0).expect("status").ready, 3);
    c
}

#[test]
fn a_rolling_update_replaces_one_replica_at_a_time_in_place() {
    let t0 = Instant::now();
    let mut c = three_ready(t0);
    let before: BTreeMap<String, crate::controlplane::state::Placement> =
        c.state().placements.clone();
    c.put_service("web", &service(3, 80, "t2", false), t0)
        .expect("update");
    let mut replaced = Vec::new();
    for step in 0..3 {
        let plan = c.plan_heal(Some("web"), t0);
        let names = placed_names(&plan);
        assert_eq!(names.len(), 1, "step {step}: one at a time, got {plan:?}");
        for a in &plan {
            if let HealAction::Place {
                replica,
                target,
                template,
                ..
            } = a
            {
                let old = &before[replica];
                assert_eq!(target.node, old.node, "in place");
                assert!(
                    target.epoch > old.epoch,
                    "a new epoch fences the old workload"
                );
                assert_eq!(template, "t2");
            }
        }
        // While applied, and until its node reports it under the new epoch,
        // it is out of the rotation; the other two still serve.
        assert!(c.plan_heal(Some("web"), t0).is_empty(), "healing: {step}");
        let s = c.service_status("web", t0).expect("status");
        assert_eq!(s.ready, 2, "step {step}");
        carry_out(&mut c, plan, t0);
        replaced.extend(names);
        let s = c.service_status("web", t0).expect("status");
        assert_eq!((s.ready, s.updated), (3, step + 1), "step {step}");
    }
    replaced.sort();
    assert_eq!(replaced, ["web-0", "web-1", "web-2"]);
    let ops = c.advance_rollouts(t0);
    assert_eq!(ops.len(), 1, "{ops:?}");
    let s = c.service_status("web", t0).expect("status");
    assert_eq!(s.rollout.map(|r| r.state), Some("Complete".to_string()));
    assert!(c.plan_heal(Some("web"), t0).is_empty(), "converged");
}

#[test]
fn a_report_under_the_old_epoch_does_not_make_a_replaced_replica_ready() {
    let t0 = Instant::now();
    let mut c = three_ready(t0);
    let stale: BTreeMap<String, HeartbeatRequest> = ["a", "b", "c"]
        .iter()
        .map(|n| (n.to_string(), reported_by(&c, n)))
        .collect();
    c.put_service("web", &service(3, 80, "t2", false), t0)
        .expect("update");
    let plan = c.plan_heal(Some("web"), t0);
    let [
        HealAction::Place {
            replica, target, ..
        },
    ] = plan.as_slice()
    else {
        panic!("{plan:?}")
    };
    c.finish_apply(replica, target, true);
    // A heartbeat built before the replacement arrives after it.
    c.heartbeat(&target.node, &stale[&target.node], t0)
        .expect("heartbeat");
    let s = c.service_status("web", t0).expect("status");
    let r = s
        .replicas
        .iter()
        .find(|r| &r.name == replica)
        .expect("replica");
    assert_eq!((r.state.as_str(), r.ready), ("Pending", false));
    assert_eq!(s.ready, 2);
}

#[test]
fn a_new_template_that_never_gets_ready_stops_the_rollout_and_undo_restores_the_old_one() {
    let t0 = Instant::now();
    let mut c = three_ready(t0);
    let mut bad = service(3, 80, "t2", false);
    bad.policy.progress_deadline_ms = 5_000;
    c.put_service("web", &bad, t0).expect("update");
    let plan = c.plan_heal(Some("web"), t0);
    let first = placed_names(&plan);
    assert_eq!(first.len(), 1);
    carry_out_with(&mut c, plan, &[first[0].as_str()], t0);
    // Applied with the new template: that is progress, the deadline runs
    // from here.
    assert!(c.advance_rollouts(t0).is_empty());
    // The budget is spent on the replica that is not ready: nothing else moves.
    let t1 = t0 + Duration::from_secs(3);
    beat_all(&mut c, &[first[0].as_str()], t1);
    assert!(c.plan_heal(Some("web"), t1).is_empty());
    assert!(c.advance_rollouts(t1).is_empty(), "inside the deadline");
    let t2 = t0 + Duration::from_secs(6);
    beat_all(&mut c, &[first[0].as_str()], t2);
    assert_eq!(c.advance_rollouts(t2).len(), 1);
    let s = c.service_status("web", t2).expect("status");
    let rollout = s.rollout.expect("rollout");
    assert_eq!(rollout.state, "Stopped");
    let reason = rollout.reason.expect("reason");
    assert!(
        reason.contains(&first[0]) && reason.contains("NotReady"),
        "{reason}"
    );
    assert_eq!(
        (s.ready, s.updated),
        (2, 1),
        "the old replicas keep serving"
    );
    assert!(
        c.plan_heal(Some("web"), t2).is_empty(),
        "stopped: nothing more"
    );

    // Undo: revision 3 has revision 1's template; the replica that is not
    // ready is replaced first, the others already run it.
    let (revision, _) = c.undo_service("web", None, t2).expect("undo");
    assert_eq!(revision, 3);
    let s = c.service_status("web", t2).expect("status");
    assert_eq!((s.revision, s.updated), (3, 2));
    let plan = c.plan_heal(Some("web"), t2);
    assert_eq!(placed_names(&plan), first);
    carry_out_with(&mut c, plan, &[], t2);
    assert_eq!(c.advance_rollouts(t2).len(), 1);
    let s = c.service_status("web", t2).expect("status");
    assert_eq!(s.rollout.map(|r| r.state), Some("Complete".to_string()));
    assert_eq!((s.ready, s.updated), (3, 3));
    let revisions: Vec<u64> = c
        .service_revisions("web")
        .expect("revisions")
        .iter()
        .map(|r| r.revision)
        .collect();
    assert_eq!(revisions, [1, 2, 3]);
    // Nothing to roll back to that differs: revision 3 is revision 1.
    let e = c.undo_service("web", Some(1), t2).expect_err("same");
    assert_eq!(e.status, 409);
    let e = c.undo_service("web", Some(9), t2).expect_err("unknown");
    assert_eq!((e.status, e.field.as_deref()), (404, Some("to-revision")));
}

#[test]
fn surge_adds_a_new_replica_before_an_old_one_goes_and_removes_it_at_the_end() {
    let t0 = Instant::now();
    let mut c = three_ready(t0);
    let mut surge = service(3, 80, "t2", false);
    surge.policy.max_unavailable = 0;
    surge.policy.max_surge = 1;
    c.put_service("web", &surge, t0).expect("update");
    let plan = c.plan_heal(Some("web"), t0);
    assert_eq!(placed_names(&plan), ["web-3"], "the surge slot first");
    carry_out(&mut c, plan, t0);
    let mut seen = Vec::new();
    for _ in 0..3 {
        let plan = c.plan_heal(Some("web"), t0);
        seen.extend(placed_names(&plan));
        assert!(
            c.service_status("web", t0).expect("status").ready >= 3,
            "never below the desired count"
        );
        carry_out(&mut c, plan, t0);
    }
    seen.sort();
    assert_eq!(seen, ["web-0", "web-1", "web-2"]);
    let plan = c.plan_heal(Some("web"), t0);
    assert!(
        matches!(plan.as_slice(), [HealAction::Remove { replica, .. }] if replica == "web-3"),
        "{plan:?}"
    );
    carry_out(&mut c, plan, t0);
    assert_eq!(c.advance_rollouts(t0).len(), 1);
    assert_eq!(nodes_of(&c, "web").len(), 3);
}

#[test]
fn a_replica_scaled_away_drains_before_it_is_removed() {
    let t0 = Instant::now();
    let mut c = three_ready(t0);
    let mut two = service(2, 80, "t1", false);
    two.policy.drain_timeout_ms = 10_000;
    c.put_service("web", &two, t0).expect("scale down");
    assert!(c.plan_heal(Some("web"), t0).is_empty(), "draining first");
    let s = c.service_status("web", t0).expect("status");
    let web2 = s
        .replicas
        .iter()
        .find(|r| r.name == "web-2")
        .expect("web-2");
    assert_eq!((web2.state.as_str(), web2.ready), ("Draining", false));
    let endpoints = c.endpoints(t0);
    assert_eq!(endpoints[0].replicas.len(), 2, "out of the rotation");
    // Scaled back up while draining: it serves again.
    c.put_service("web", &service(3, 80, "t1", false), t0)
        .expect("up");
    assert!(c.plan_heal(Some("web"), t0).is_empty());
    assert_eq!(c.endpoints(t0)[0].replicas.len(), 3);
    c.put_service("web", &two, t0).expect("down again");
    assert!(c.plan_heal(Some("web"), t0).is_empty());
    let t1 = t0 + Duration::from_secs(10);
    beat_all(&mut c, &[], t1);
    let plan = c.plan_heal(Some("web"), t1);
    assert!(
        matches!(plan.as_slice(), [HealAction::Remove { replica, .. }] if replica == "web-2"),
        "removed after the drain timeout: {plan:?}"
    );
}

#[test]
fn scaling_names_the_count_and_keeps_the_revision() {
    let t0 = Instant::now();
    let mut c = three_ready(t0);
    let e = c.scale_service("nope", 2, t0).expect_err("unknown");
    assert_eq!(e.status, 404);
    let e = c.scale_service("web", 1_000_000, t0).expect_err("too many");
    assert_eq!((e.status, e.field.as_deref()), (400, Some("replicas")));
    assert!(!c.scale_service("web", 5, t0).expect("scale").is_empty());
    let s = c.service_status("web", t0).expect("status");
    assert_eq!((s.desired, s.revision), (5, 1));
    assert_eq!(placed_names(&c.plan_heal(Some("web"), t0)).len(), 2);
}

#[test]
fn revisions_beyond_the_kept_number_are_forgotten() {
    let t0 = Instant::now();
    let mut c = three_ready(t0);
    for i in 2..=13 {
        c.put_service("web", &service(3, 80, &format!("t{i}"), false), t0)
            .expect("update");
    }
    let revisions = c.service_revisions("web").expect("revisions");
    let numbers: Vec<u64> = revisions.iter().map(|r| r.revision).collect();
    assert_eq!(numbers, (4..=13).collect::<Vec<u64>>());
    assert!(revisions.last().is_some_and(|r| r.current));
    assert_eq!(
        c.undo_service("web", Some(2), t0)
            .expect_err("forgotten")
            .status,
        404
    );
}

#[test]
fn a_deleted_service_s_replicas_drain_before_the_record_goes() {
    let t0 = Instant::now();
    let mut c = three_ready(t0);
    let mut slow = service(3, 80, "t1", false);
    slow.policy.drain_timeout_ms = 10_000;
    c.put_service("web", &slow, t0).expect("policy");
    assert_eq!(
        c.retire_service("nope", t0).expect_err("unknown").status,
        404
    );
    c.retire_service("web", t0).expect("retire");
    let endpoints = c.endpoints(t0);
    assert!(
        endpoints[0].replicas.is_empty() && !endpoints[0].unsettled,
        "out of every rotation at once: {endpoints:?}"
    );
    assert!(c.service_status("web", t0).is_some(), "the record stays");
    assert!(!c.service_drained("web", t0));
    // Nothing is healed meanwhile, even a missing replica.
    c.remove_placement("web-0", &c.state().placements["web-0"].node.clone());
    assert!(c.plan_heal(Some("web"), t0).is_empty());
    let t1 = t0 + Duration::from_secs(10);
    beat_all(&mut c, &[], t1);
    assert!(c.service_drained("web", t1));
    let (_, removals) = c.remove_service("web", t1).expect("remove");
    assert_eq!(removals.len(), 2);
    assert!(c.service_drained("web", t1), "gone is drained");
}

/// `spread_web` with every node reporting its replica running, the table
/// refreshed (and handed out) once.
fn settled_web() -> (Cluster, Instant, u64) {
    let (mut c, t0) = spread_web();
    for id in ["a", "b", "c"] {
        let req = reported_by(&c, id);
        c.heartbeat(id, &req, t0).expect("beat");
    }
    let first = c.refresh_endpoints(t0).expect("a first table");
    assert_eq!(first.services[0].replicas.len(), 3, "{first:?}");
    (c, t0, first.generation)
}

#[test]
fn the_endpoint_generation_grows_only_when_the_table_changes() {
    let (mut c, t0, generation) = settled_web();
    assert!(
        generation > 1,
        "placing and reporting replicas changed the table"
    );
    // The same reports again: nothing new to publish.
    for id in ["a", "b", "c"] {
        let req = reported_by(&c, id);
        c.heartbeat(id, &req, t0).expect("beat");
    }
    assert_eq!(c.refresh_endpoints(t0), None);
    assert_eq!(c.endpoints_generation(), generation);

    // b's replica stops being ready: one new generation, carried by the
    // heartbeat answer too.
    let mut req = reported_by(&c, "b");
    req.placed[0].ready = Some(false);
    let resp = decode(&c.heartbeat("b", &req, t0).expect("beat"), "b");
    assert_eq!(resp.endpoints_generation, Some(generation + 1));
    assert_eq!(resp.endpoints_origin, Some(c.endpoints_origin()));
    assert_eq!(resp.services[0].replicas.len(), 2);
    let next = c.refresh_endpoints(t0).expect("the change is published");
    let published: Vec<crate::common::wire::ServiceEndpoints> =
        next.services.iter().map(|s| s.as_ref().clone()).collect();
    assert_eq!(
        (next.generation, published),
        (generation + 1, resp.services)
    );
    assert_eq!(
        next.changed,
        Some((generation, ["web".to_string()].into())),
        "which services changed since the generation handed out before"
    );
    assert_eq!(c.refresh_endpoints(t0), None, "handed out once");
}

#[test]
fn liveness_alone_changes_the_endpoint_generation() {
    let (mut c, t0, generation) = settled_web();
    // a and b keep heartbeating, c goes silent past dead_after.
    let later = t0 + DEAD_AFTER + Duration::from_secs(1);
    for id in ["a", "b"] {
        let req = reported_by(&c, id);
        c.heartbeat(id, &req, later).expect("beat");
    }
    let next = c
        .refresh_endpoints(later)
        .expect("c's death changes the table");
    assert!(next.generation > generation);
    assert_eq!(next.services[0].replicas.len(), 2, "{next:?}");
}

#[test]
fn a_restarted_control_plane_numbers_from_one_under_another_origin() {
    let (c, _, generation) = settled_web();
    let r = restarted(&c);
    assert_eq!(r.endpoints_generation(), 1);
    assert!(generation > 1);
    assert_ne!(r.endpoints_origin(), c.endpoints_origin());
}

#[test]
fn open_connections_sum_what_nodes_not_dead_report() {
    let (mut c, t0, _) = settled_web();
    let replica = SocketAddrV4::new(Ipv4Addr::new(10, 20, 0, 2), 80);
    let other = SocketAddrV4::new(Ipv4Addr::new(10, 20, 0, 3), 80);
    let with_connections = |c: &Cluster, id: &str, open: &[(SocketAddrV4, u32)]| {
        let mut req = reported_by(c, id);
        req.connections = open
            .iter()
            .map(|&(addr, open)| crate::common::wire::ReplicaConnections { addr, open })
            .collect();
        req
    };
    let req = with_connections(&c, "a", &[(replica, 2), (other, 7)]);
    c.heartbeat("a", &req, t0).expect("beat");
    let req = with_connections(&c, "b", &[(replica, 3)]);
    c.heartbeat("b", &req, t0).expect("beat");
    assert_eq!(c.open_connections(replica, t0), 5);
    assert_eq!(c.open_connections(other, t0), 7);
    assert_eq!(
        c.open_connections(SocketAddrV4::new(Ipv4Addr::new(10, 20, 9, 9), 80), t0),
        0
    );
    // A later heartbeat replaces what the node reported.
    let req = with_connections(&c, "b", &[]);
    c.heartbeat("b", &req, t0).expect("beat");
    assert_eq!(c.open_connections(replica, t0), 2);
    // A Dead node's connections no longer count.
    let later = t0 + DEAD_AFTER + Duration::from_secs(1);
    let req = reported_by(&c, "b");
    c.heartbeat("b", &req, later).expect("beat");
    assert_eq!(c.liveness("a", later), Some(Liveness::Dead));
    assert_eq!(c.open_connections(replica, later), 0);
}

#[test]
fn endpoints_are_caught_up_once_every_alive_node_applied_the_generation() {
    let (mut c, t0, generation) = settled_web();
    let applied = |c: &Cluster, id: &str, g: Option<u64>| {
        let mut req = reported_by(c, id);
        req.endpoints_generation = g;
        req
    };
    for (id, g) in [
        ("a", Some(generation)),
        ("b", Some(generation + 1)),
        ("c", None),
    ] {
        let req = applied(&c, id, g);
        c.heartbeat(id, &req, t0).expect("beat");
    }
    assert!(
        !c.endpoints_caught_up(generation, t0),
        "c applied nothing yet"
    );
    let req = applied(&c, "c", Some(generation - 1));
    c.heartbeat("c", &req, t0).expect("beat");
    assert!(!c.endpoints_caught_up(generation, t0), "c is one behind");
    let req = applied(&c, "c", Some(generation));
    c.heartbeat("c", &req, t0).expect("beat");
    assert!(c.endpoints_caught_up(generation, t0));
    assert!(
        !c.endpoints_caught_up(generation + 1, t0),
        "a is behind that one"
    );

    // A node that went silent (Dead) does not hold draining up, nor does one
    // not heard from since a restart (Unknown).
    let later = t0 + DEAD_AFTER + Duration::from_secs(1);
    for id in ["b", "c"] {
        let req = applied(&c, id, Some(generation + 1));
        c.heartbeat(id, &req, later).expect("beat");
    }
    assert_eq!(c.liveness("a", later), Some(Liveness::Dead));
    assert!(c.endpoints_caught_up(generation + 1, later));
    let mut r = restarted_at(&c, later);
    let req = applied(&r, "b", Some(1));
    r.heartbeat("b", &req, later).expect("beat");
    assert_eq!(r.liveness("c", later), Some(Liveness::Unknown));
    assert!(
        r.endpoints_caught_up(1, later),
        "unknown c does not hold it up"
    );
}

/// Every node reports its replicas ready, that its proxy applied
/// `generation`, and `open` connections to `to` (if any).
fn beat_applied(c: &mut Cluster, generation: u64, to: Option<(SocketAddrV4, u32)>, now: Instant) {
    let nodes: Vec<String> = c.state().nodes.keys().cloned().collect();
    for node in nodes {
        let mut req = reported_by(c, &node);
        req.endpoints_generation = Some(generation);
        req.connections = to
            .map(|(addr, open)| vec![crate::common::wire::ReplicaConnections { addr, open }])
            .unwrap_or_default();
        c.heartbeat(&node, &req, now).expect("heartbeat");
    }
}

#[test]
fn a_drain_ends_when_every_proxy_applied_the_table_without_the_replica_and_reports_none_open() {
    let t0 = Instant::now();
    let mut c = three_ready(t0);
    let web2 = c
        .service_status("web", t0)
        .expect("status")
        .replicas
        .iter()
        .find(|r| r.name == "web-2")
        .and_then(|r| r.address)
        .map(|a| SocketAddrV4::new(a, 80))
        .expect("web-2's address");
    let mut two = service(2, 80, "t1", false);
    two.policy.drain_timeout_ms = 60_000;
    c.put_service("web", &two, t0).expect("scale down");
    let before = c.endpoints_generation();
    assert!(c.plan_heal(Some("web"), t0).is_empty(), "draining");
    let without = c.endpoints_generation();
    assert!(
        without > before,
        "the table without web-2 is a new generation"
    );
    // A proxy still on the old table: not over, even with no connection.
    beat_applied(&mut c, before, None, t0);
    assert!(c.plan_heal(Some("web"), t0).is_empty());
    // Every proxy on the new table, one connection still open: not over.
    beat_applied(&mut c, without, Some((web2, 1)), t0);
    assert!(c.plan_heal(Some("web"), t0).is_empty());
    // Closed: removed, long before the drain timeout.
    beat_applied(&mut c, without, None, t0);
    let plan = c.plan_heal(Some("web"), t0);
    assert!(
        matches!(plan.as_slice(), [HealAction::Remove { replica, .. }] if replica == "web-2"),
        "{plan:?}"
    );
}

#[test]
fn stateful_replicas_update_in_place_one_at_a_time_whatever_the_budget() {
    let t0 = Instant::now();
    let mut c = cluster();
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        register(&mut c, id, i as u16 + 1, t0);
    }
    c.put_service("db", &service(3, 5432, "t1", true), t0)
        .expect("put");
    let plan = c.plan_heal(Some("db"), t0);
    carry_out(&mut c, plan, t0);
    let homes: BTreeMap<String, String> = c
        .placed_replicas("db")
        .into_iter()
        .map(|(_, n, p)| (n, p.node))
        .collect();
    let mut wide = service(3, 5432, "t2", true);
    wide.policy.max_unavailable = 3;
    wide.policy.max_surge = 2;
    c.put_service("db", &wide, t0).expect("update");
    for _ in 0..3 {
        let plan = c.plan_heal(Some("db"), t0);
        assert_eq!(
            placed_names(&plan).len(),
            1,
            "one at a time, no surge: {plan:?}"
        );
        for a in &plan {
            if let HealAction::Place {
                replica,
                target,
                volumes,
                ..
            } = a
            {
                assert_eq!(target.node, homes[replica], "it stays with its data");
                assert_eq!(volumes, &[format!("{replica}-data")]);
            }
        }
        carry_out(&mut c, plan, t0);
    }
    assert_eq!(c.advance_rollouts(t0).len(), 1);
    let s = c.service_status("db", t0).expect("status");
    assert_eq!((s.updated, s.ready, s.replicas.len()), (3, 3, 3));
}

#[test]
fn a_restarted_control_plane_keeps_revisions_and_a_stopped_rollout_and_restarts_the_clock() {
    let t0 = Instant::now();
    let mut c = three_ready(t0);
    let mut quick = service(3, 80, "t2", false);
    quick.policy.progress_deadline_ms = 5_000;
    c.put_service("web", &quick, t0).expect("update");
    let plan = c.plan_heal(Some("web"), t0);
    let first = placed_names(&plan);
    carry_out_with(&mut c, plan, &[first[0].as_str()], t0);
    assert!(c.advance_rollouts(t0).is_empty());

    // A restart 4 s in: the deadline is not 1 s away but a whole one again.
    let t1 = t0 + Duration::from_secs(4);
    let mut r = restarted_at(&c, t1);
    beat_all(&mut r, &[first[0].as_str()], t1);
    let t2 = t0 + Duration::from_secs(6);
    beat_all(&mut r, &[first[0].as_str()], t2);
    assert!(r.advance_rollouts(t2).is_empty(), "a fresh deadline");
    let t3 = t1 + Duration::from_secs(6);
    beat_all(&mut r, &[first[0].as_str()], t3);
    assert_eq!(
        r.advance_rollouts(t3).len(),
        1,
        "stopped one deadline after the restart"
    );
    let s = r.service_status("web", t3).expect("status");
    assert_eq!(s.rollout.map(|x| x.state), Some("Stopped".to_string()));

    // Stopped survives the next restart; the revisions too.
    let mut again = restarted_at(&r, t3);
    beat_all(&mut again, &[first[0].as_str()], t3);
    let s = again.service_status("web", t3).expect("status");
    assert_eq!(
        (s.revision, s.rollout.map(|x| x.state)),
        (2, Some("Stopped".to_string()))
    );
    assert!(
        again.plan_heal(Some("web"), t3).is_empty(),
        "nothing resumes"
    );
    assert_eq!(again.service_revisions("web").expect("revisions").len(), 2);
}

/// `web` and `api`, two ready replicas each over nodes a, b and c, every
/// heal carried out and every node's report in: nothing is left to do.
fn settled_pair(t0: Instant) -> Cluster {
    let mut c = cluster();
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        register(&mut c, id, i as u16 + 1, t0);
    }
    for name in ["web", "api"] {
        c.put_service(name, &service(2, 80, "t1", false), t0)
            .expect("put");
    }
    let plan = c.plan_heal(None, t0);
    assert_eq!(plan.len(), 4);
    carry_out(&mut c, plan, t0);
    assert!(c.plan_heal(None, t0).is_empty(), "settled");
    c.refresh_endpoints(t0);
    c
}

/// The heal plans and endpoint entries rebuilt between two calls.
fn work_since(c: &Cluster, before: HealWork) -> (u64, u64) {
    let now = c.heal_work();
    (
        now.planned - before.planned,
        now.endpoints_rebuilt - before.endpoints_rebuilt,
    )
}

#[test]
fn a_heartbeat_that_changes_nothing_plans_and_rebuilds_nothing() {
    let t0 = Instant::now();
    let mut c = settled_pair(t0);
    let before = c.heal_work();
    let t1 = t0 + Duration::from_secs(5);
    beat_all(&mut c, &[], t1);
    assert!(c.plan_heal(None, t1).is_empty());
    assert_eq!(c.refresh_endpoints(t1), None, "no new generation");
    assert_eq!(work_since(&c, before), (0, 0));
}

#[test]
fn a_death_heals_and_rebuilds_only_the_services_with_replicas_there() {
    let t0 = Instant::now();
    let mut c = settled_pair(t0);
    let services_on = |c: &Cluster, node: &str| -> BTreeSet<String> {
        c.state()
            .placements
            .iter()
            .filter(|(_, p)| p.node == node)
            .filter_map(|(name, _)| {
                crate::common::names::replica_of(name).map(|(s, _)| s.to_string())
            })
            .collect()
    };
    let victim = ["a", "b", "c"]
        .into_iter()
        .find(|n| services_on(&c, n).len() == 1)
        .expect("a node with the replicas of one service only");
    let only: Vec<String> = services_on(&c, victim).into_iter().collect();
    // The others heartbeat on; the victim falls silent.
    let beat_others = |c: &mut Cluster, now: Instant| {
        for node in ["a", "b", "c"].into_iter().filter(|n| *n != victim) {
            let req = reported_by(c, node);
            c.heartbeat(node, &req, now).expect("heartbeat");
        }
    };
    beat_others(&mut c, t0 + DEAD_AFTER / 2);
    let before = c.heal_work();
    let t1 = t0 + DEAD_AFTER + Duration::from_secs(1);
    beat_others(&mut c, t1);
    assert_eq!(c.liveness(victim, t1), Some(Liveness::Dead));
    let plan = c.plan_heal(None, t1);
    let healed: BTreeSet<&str> = plan
        .iter()
        .filter_map(|a| match a {
            HealAction::Place { service, .. } => Some(service.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        healed,
        only.iter().map(String::as_str).collect(),
        "{plan:?}"
    );
    c.refresh_endpoints(t1);
    assert_eq!(
        work_since(&c, before),
        (1, 1),
        "{only:?} planned and rebuilt, the other service untouched"
    );
}

#[test]
fn a_readiness_report_heals_and_rebuilds_only_its_service() {
    let t0 = Instant::now();
    let mut c = settled_pair(t0);
    let generation = c.endpoints_generation();
    let before = c.heal_work();
    beat_all(&mut c, &["web-0"], t0);
    assert!(
        c.plan_heal(None, t0).is_empty(),
        "a not-ready replica stays"
    );
    let next = c.refresh_endpoints(t0).expect("a new table");
    assert!(next.generation > generation);
    let web = next.services.iter().find(|s| s.name == "web").expect("web");
    assert_eq!(web.replicas.len(), 1, "web-0 left the rotation");
    assert_eq!(work_since(&c, before), (1, 1), "web only, api untouched");
}

#[test]
fn a_spec_change_heals_its_service() {
    let t0 = Instant::now();
    let mut c = settled_pair(t0);
    let before = c.heal_work();
    c.scale_service("api", 3, t0).expect("scale");
    let plan = c.plan_heal(None, t0);
    assert_eq!(placed_names(&plan), ["api-2"]);
    assert_eq!(work_since(&c, before).0, 1);
}

#[test]
fn a_lost_placement_heals_its_service() {
    let t0 = Instant::now();
    let mut c = settled_pair(t0);
    let before = c.heal_work();
    let node = c.state().placements["web-1"].node.clone();
    assert_eq!(c.remove_placement("web-1", &node).len(), 1);
    let plan = c.plan_heal(None, t0);
    assert_eq!(placed_names(&plan), ["web-1"]);
    assert_eq!(work_since(&c, before).0, 1);
}

#[test]
fn a_node_that_dies_heals_the_services_it_held() {
    let t0 = Instant::now();
    let mut c = settled_pair(t0);
    let lost = c.state().placements["web-0"].node.clone();
    // The others heartbeat on; the dead node is noticed by the clock alone,
    // well before a periodic sweep is due.
    let half = t0 + DEAD_AFTER / 2;
    let later = t0 + DEAD_AFTER;
    for t in [half, later] {
        for id in ["a", "b", "c"].into_iter().filter(|id| *id != lost) {
            beat(&mut c, id, 0.0, &[], t);
        }
    }
    assert!(later < t0 + DEAD_AFTER * dirty::SWEEP_EVERY);
    assert_eq!(c.liveness(&lost, later), Some(Liveness::Dead));
    let plan = c.plan_heal(None, later);
    let moved: Vec<String> = c
        .state()
        .placements
        .iter()
        .filter(|(_, p)| p.node == lost)
        .map(|(n, _)| n.clone())
        .collect();
    let mut placed = placed_names(&plan);
    placed.sort();
    assert_eq!(placed, moved, "every replica on {lost} is replaced");
    assert!(!placed.is_empty());
}

#[test]
fn a_service_waiting_for_a_node_is_planned_again_until_one_comes() {
    let t0 = Instant::now();
    let mut c = cluster();
    c.put_service("web", &service(1, 80, "t1", false), t0)
        .expect("put");
    assert!(c.plan_heal(None, t0).is_empty(), "no node yet");
    assert!(c.plan_heal(None, t0).is_empty());
    register(&mut c, "a", 1, t0);
    assert_eq!(placed_names(&c.plan_heal(None, t0)), ["web-0"]);
}

/// The registry's decisions are events: a placement, a copy fenced (told
/// once however many heartbeats report it), a node seen dead and back.
#[test]
fn decisions_are_recorded_as_events_and_a_fenced_copy_is_told_once() {
    use crate::common::events::EventLog;
    use crate::common::wire::{EventType, ObjectKind};
    let t0 = Instant::now();
    let mut c = cluster_from_at(ClusterState::default(), t0);
    let events = EventLog::in_memory("");
    c.set_events(events.clone());
    register(&mut c, "a", 1, t0);
    register(&mut c, "b", 2, t0);
    beat(&mut c, "a", 0.0, &[], t0);
    beat(&mut c, "b", 0.0, &[], t0);
    let t = c.begin_apply("web", Some("b"), t0).expect("web on b");
    c.finish_apply("web", &t, true);
    for _ in 0..3 {
        beat(&mut c, "a", 0.0, &[("web", t.epoch - 1)], t0);
    }
    let later = t0 + DEAD_AFTER + Duration::from_secs(1);
    beat(&mut c, "a", 0.0, &[], later);
    beat(
        &mut c,
        "b",
        0.0,
        &[("web", t.epoch)],
        later + Duration::from_secs(1),
    );

    let told: Vec<(String, String, EventType)> = events
        .since(None, None)
        .0
        .into_iter()
        .filter(|e| e.reason != "NodeAlive" || e.message.contains("Dead"))
        .map(|e| (e.reason, format!("{}/{}", e.kind, e.name), e.event_type))
        .collect();
    assert_eq!(
        told,
        [
            (
                "Scheduled".to_string(),
                "jail/web".to_string(),
                EventType::Normal
            ),
            ("Fenced".into(), "jail/web".into(), EventType::Warning),
            // Both leases ran out by `later`; each node is back at its beat.
            ("NodeDead".into(), "node/a".into(), EventType::Warning),
            ("NodeDead".into(), "node/b".into(), EventType::Warning),
            ("NodeAlive".into(), "node/a".into(), EventType::Normal),
            ("NodeAlive".into(), "node/b".into(), EventType::Normal),
        ]
    );
    let fenced = events.since(None, None).0;
    let fenced = fenced
        .iter()
        .find(|e| e.reason == "Fenced")
        .expect("fenced");
    assert_eq!((fenced.node.as_str(), fenced.kind), ("a", ObjectKind::Jail));
}
