//! Endpoint push on a real simulated cluster: one keel-controlplane and two
//! keel-agentd whose heartbeat period is an hour, so no periodic heartbeat
//! happens during the test, and a two-replica service (one replica per node)
//! running `tests/fixtures/health_name.py` with an http health check.
//!
//! One replica's health endpoint is made to fail. Its agent heartbeats at
//! once (the flip nudges it), the control plane publishes a new endpoint
//! generation, and the other node's endpoint watcher applies it: that
//! node's proxy drops the replica while its own heartbeat count has not
//! moved, so the change cannot have come by its heartbeat. The same count
//! on the failing replica's node has moved (its tick is an hour away: only
//! the nudge can have sent it). Causality, not timing, is asserted.

use std::collections::BTreeSet;
use std::net::{SocketAddr, SocketAddrV4};

use keel::common::http::{Client, Endpoint};
use keel::common::wire::{EventsAnswer, NodeStatus, ServiceStatus};
use serde::Deserialize;

use crate::util::cluster::{
    Cluster, free_port, node_ip, port_free_on_nodes, standard_controlplane_args,
};
use crate::util::{fixture_service, service_doc};

/// No periodic heartbeat within a test run.
const HEARTBEAT: &str = "1h";

/// A control plane and agents `n1`, `n2` as in [`Cluster::standard`], but
/// heartbeating every [`HEARTBEAT`] (and Dead only after twice that).
fn slow_heartbeat_cluster() -> Cluster {
    let mut cluster = Cluster::new();
    let listen = SocketAddr::from((
        std::net::Ipv4Addr::LOCALHOST,
        free_port(std::net::Ipv4Addr::LOCALHOST),
    ));
    let mut args = standard_controlplane_args(listen);
    set_flag(&mut args, "--heartbeat-interval", HEARTBEAT);
    set_flag(&mut args, "--dead-after", "2h");
    cluster.start_controlplane(&args.iter().map(String::as_str).collect::<Vec<_>>());
    for n in 1..=2 {
        let ip = node_ip(n);
        let id = format!("n{n}");
        let mut args = cluster.standard_agent_args(&id, SocketAddr::from((ip, free_port(ip))), ip);
        set_flag(&mut args, "--heartbeat-interval", HEARTBEAT);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cluster.start_agent(&id, &args);
    }
    cluster
}

fn set_flag(args: &mut [String], flag: &str, value: &str) {
    let at = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("{flag} in {args:?}"));
    args[at + 1] = value.to_string();
}

fn agent(cluster: &Cluster, node: &str, path: &str) -> Option<Vec<u8>> {
    let r = Client::new(Endpoint::Unix(cluster.socket(node)))
        .request("GET", path, &[], b"")
        .ok()?;
    (r.status == 200).then_some(r.body)
}

/// A counter of the agent's `GET /metrics` (the full sample name).
fn counter(cluster: &Cluster, node: &str, sample: &str) -> u64 {
    let text = agent(cluster, node, "/metrics").expect("metrics");
    String::from_utf8_lossy(&text)
        .lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{sample} in {}", String::from_utf8_lossy(&text)))
}

/// A counter of the control plane's `GET /metrics` (the full sample name).
fn controlplane_counter(cluster: &Cluster, sample: &str) -> u64 {
    let answer = cluster
        .operator_call("GET", "/metrics", b"")
        .expect("metrics");
    let text = String::from_utf8_lossy(&answer.body);
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{sample} in {text}"))
}

const POLL_CHANGES: &str = "keel_endpoint_poll_answers_total{kind=\"changes\"}";
const HEARTBEATS: &str = "keel_heartbeats_total";
const PUSHED: &str = "keel_endpoint_tables_applied_total{path=\"push\"}";

#[derive(Debug, Deserialize)]
struct Row {
    replica: SocketAddrV4,
    listed: bool,
}

/// The replicas `node`'s proxy lists now.
fn listed(cluster: &Cluster, node: &str) -> Option<BTreeSet<SocketAddrV4>> {
    let rows: Vec<Row> = serde_json::from_slice(&agent(cluster, node, "/proxy/replicas")?).ok()?;
    Some(
        rows.into_iter()
            .filter(|r| r.listed)
            .map(|r| r.replica)
            .collect(),
    )
}

fn status(cluster: &Cluster) -> Option<ServiceStatus> {
    serde_json::from_str(
        &cluster
            .keelctl_ok(&["get", "service", "web", "-o", "json"])
            .stdout,
    )
    .ok()
}

#[test]
fn a_readiness_flip_reaches_the_other_proxy_without_its_heartbeat() {
    let cluster = slow_heartbeat_cluster();
    cluster.wait_alive(2);
    let port = port_free_on_nodes(2);
    // Failing for 10 probes (2 s) before the restart: the window in which
    // the replica is out of rotation and its process still the same.
    let doc = format!(
        "{}    health:\n      http: {{port: {port}, path: /healthz}}\n      interval: 200ms\n      \
         timeout: 200ms\n      failureThreshold: 10\n",
        fixture_service(
            "web",
            "health_name.py",
            2,
            port,
            &crate::util::require_python3()
        )
    );
    // Two more services without replicas, so that web's change is a third
    // of the table and the watchers are sent that change alone.
    let spares: String = ["spare-a", "spare-b"]
        .iter()
        .map(|name| format!("---\n{}", service_doc(name, 0, port, "/usr/bin/true")))
        .collect();
    let run = cluster.keelctl_with(&["apply", "-f", "-"], Some(&format!("{doc}{spares}")));
    assert_eq!(run.code, 0, "{run:?}\n{}", cluster.logs());

    // Both replicas ready and in both proxies: the tables got there by
    // nudged heartbeats and pushes alone, the periodic tick being an hour.
    let s = cluster.wait_for("2/2 ready", || status(&cluster).filter(|s| s.ready == 2));
    let addr = |name: &str| {
        let r = s.replicas.iter().find(|r| r.name == name).expect("placed");
        (
            r.node.clone(),
            SocketAddrV4::new(r.address.expect("address"), port),
        )
    };
    let (victim_node, victim) = addr("web-1");
    let (observer, other) = addr("web-0");
    assert_ne!(victim_node, observer, "one replica per node: {s:?}");
    let both: BTreeSet<SocketAddrV4> = [victim, other].into();
    for node in ["n1", "n2"] {
        cluster.wait_for("the proxy to list both replicas", || {
            listed(&cluster, node).filter(|l| *l == both)
        });
    }
    // Both workloads settled (Running, not Starting): settling is an event,
    // and a new event sends a heartbeat at once, which is not the path
    // under test.
    cluster.wait_for("both replicas Running", || {
        let run = cluster.keelctl(&["get", "jails", "-o", "json"]);
        let jails: Vec<serde_json::Value> = serde_json::from_str(&run.stdout).ok()?;
        let running = jails.iter().filter(|j| j["state"] == "Running").count();
        (running == 2).then_some(())
    });
    // And the heartbeat each settling sent is done: the control plane has
    // seen every node's newest event, so no heartbeat nudged by one is
    // still on its way when the counts below are read.
    for node in ["n1", "n2"] {
        cluster.wait_for(
            "the control plane to have seen the node's newest event",
            || {
                let events: EventsAnswer =
                    serde_json::from_slice(&agent(&cluster, node, "/events")?).ok()?;
                let nodes: Vec<NodeStatus> = serde_json::from_str(
                    &cluster.keelctl_ok(&["get", "nodes", "-o", "json"]).stdout,
                )
                .ok()?;
                let seen = nodes.iter().find(|n| n.node_id == node)?.events_seq?;
                (seen >= events.last_seq).then_some(())
            },
        );
    }
    let changes_answered = controlplane_counter(&cluster, POLL_CHANGES);
    let observer_beats = counter(&cluster, &observer, HEARTBEATS);
    let observer_pushes = counter(&cluster, &observer, PUSHED);
    let victim_beats = counter(&cluster, &victim_node, HEARTBEATS);

    // web-1's health endpoint fails from now on.
    let answer = Client::new(Endpoint::Tcp(SocketAddr::V4(victim).to_string()))
        .request("GET", "/fail", &[], b"")
        .expect("web-1 answers");
    assert_eq!(answer.status, 200);

    let only_other: BTreeSet<SocketAddrV4> = [other].into();
    cluster.wait_for("the observer's proxy to drop web-1", || {
        listed(&cluster, &observer).filter(|l| *l == only_other)
    });
    assert_eq!(
        counter(&cluster, &observer, HEARTBEATS),
        observer_beats,
        "the observer sent no heartbeat: the change came by the push"
    );
    assert!(
        counter(&cluster, &observer, PUSHED) > observer_pushes,
        "the watcher applied it"
    );
    assert!(
        controlplane_counter(&cluster, POLL_CHANGES) > changes_answered,
        "it was sent as changes to the table the watcher held"
    );
    assert!(
        counter(&cluster, &victim_node, HEARTBEATS) > victim_beats,
        "the flip sent a heartbeat from web-1's node before its tick"
    );
}
