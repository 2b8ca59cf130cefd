//! Rolling updates, scaling and draining on a real simulated cluster: one
//! keel-controlplane and three keel-agentd, a 3-replica service running
//! `tests/fixtures/versioned.py` with an http health check, and a client
//! sending 25 requests a second through node 1's proxy for the whole
//! scenario. Each test asserts that not one request failed.

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;

use keel::common::wire::{Liveness, NodeStatus, ServiceStatus};

use crate::util::cluster::{Cluster, Run, node_ip};
use crate::util::fixture_service;
use crate::util::traffic::{Seen, Traffic};

fn python3() -> PathBuf {
    crate::util::python3().expect("python3 on PATH (the replicas' workload; .ci/run installs it)")
}

fn ok(cluster: &Cluster, args: &[&str]) -> Run {
    let run = cluster.keelctl(args);
    assert_eq!(run.code, 0, "keelctl {args:?}: {run:?}\n{}", cluster.logs());
    run
}

/// A port free on every node's address (every proxy listens on it).
fn port_free_on(nodes: u8) -> u16 {
    loop {
        let port = TcpListener::bind((node_ip(1), 0))
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        if (2..=nodes).all(|n| TcpListener::bind((node_ip(n), port)).is_ok()) {
            return port;
        }
    }
}

/// The Service document: `replicas` of `versioned.py` printing `version`,
/// healthy or not, with a fast health check, a short drain and `extra`
/// lines of `spec` (e.g. `update:`).
fn doc(port: u16, replicas: u32, version: &str, healthy: bool, extra: &str) -> String {
    let base = fixture_service("web", "versioned.py", replicas, port, &python3());
    let (head, template) = base.split_once("  template:\n").expect("a template");
    format!(
        "{head}  drainTimeout: 1s\n{extra}  template:\n{template}    env:\n      VERSION: {version}\n      \
         HEALTHY: \"{}\"\n    health:\n      http: {{port: {port}, path: /healthz}}\n      \
         interval: 200ms\n      timeout: 200ms\n      failureThreshold: 3\n",
        if healthy { "yes" } else { "no" }
    )
}

fn apply(cluster: &Cluster, doc: &str) {
    let run = cluster.keelctl_with(&["apply", "-f", "-"], Some(doc));
    assert_eq!(run.code, 0, "{run:?}\n{}", cluster.logs());
}

fn status(cluster: &Cluster) -> Option<ServiceStatus> {
    serde_json::from_str(&ok(cluster, &["get", "service", "web", "-o", "json"]).stdout).ok()
}

/// A cluster of three Alive nodes serving `replicas` ready replicas of
/// version v1 through node 1's proxy, and the client already sending.
fn serving(replicas: u32, extra: &str) -> (Cluster, u16, Traffic) {
    let cluster = Cluster::standard(3);
    cluster.wait_for("three Alive nodes", || {
        let nodes: Vec<NodeStatus> =
            serde_json::from_str(&ok(&cluster, &["get", "nodes", "-o", "json"]).stdout).ok()?;
        let alive = nodes.iter().filter(|n| n.status == Liveness::Alive).count();
        (alive == 3).then_some(())
    });
    let port = port_free_on(3);
    apply(&cluster, &doc(port, replicas, "v1", true, extra));
    cluster.wait_for("every replica ready", || {
        status(&cluster).filter(|s| s.ready == replicas)
    });
    let traffic = Traffic::start(SocketAddr::from((node_ip(1), port)));
    let names: BTreeSet<String> = (0..replicas).map(|i| format!("web-{i} v1")).collect();
    cluster.wait_for("the proxy to serve every replica", || {
        let last: BTreeSet<String> = traffic.last(replicas as usize * 4)?.into_iter().collect();
        (last == names).then_some(())
    });
    (cluster, port, traffic)
}

fn assert_no_failure(seen: &Seen, cluster: &Cluster) {
    assert!(
        seen.failures.is_empty(),
        "{} of {} requests failed: {:#?}\n{}",
        seen.failures.len(),
        seen.failures.len() + seen.answers.len(),
        seen.failures,
        cluster.logs()
    );
}

#[test]
fn a_rolling_update_moves_every_replica_to_the_new_template_without_a_failed_request() {
    let (cluster, port, traffic) = serving(3, "");
    apply(&cluster, &doc(port, 3, "v2", true, ""));
    let run = ok(
        &cluster,
        &["rollout", "status", "service", "web", "--timeout", "2m"],
    );
    assert!(
        run.stdout.contains("successfully rolled out (revision 2)"),
        "{run:?}"
    );
    let v2: BTreeSet<String> = (0..3).map(|i| format!("web-{i} v2")).collect();
    cluster.wait_for("every answer from the new version", || {
        let last: BTreeSet<String> = traffic.last(12)?.into_iter().collect();
        (last == v2).then_some(())
    });
    let seen = traffic.stop();
    assert_no_failure(&seen, &cluster);
    let s = status(&cluster).expect("status");
    assert_eq!((s.revision, s.updated, s.ready), (2, 3, 3), "{s:?}");
    let history = ok(&cluster, &["rollout", "history", "service", "web"]).stdout;
    let revisions: Vec<&str> = history
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(revisions, ["1", "2"], "{history}");
    let table = ok(&cluster, &["get", "services"]).stdout;
    assert!(table.contains("UP-TO-DATE"), "{table}");
}

#[test]
fn a_rollout_that_never_gets_ready_stops_and_undo_brings_the_old_template_back() {
    let update = "  update: {maxUnavailable: 1, progressDeadline: 3s}\n";
    let (cluster, port, traffic) = serving(3, update);
    apply(&cluster, &doc(port, 3, "v2", false, update));
    let run = cluster.keelctl(&["rollout", "status", "service", "web", "--timeout", "2m"]);
    assert_eq!(run.code, 1, "{run:?}\n{}", cluster.logs());
    assert!(
        run.stderr.contains("stopped") && run.stderr.contains("not ready"),
        "{run:?}"
    );
    // Stopped after the first replica: the other two still run v1 and serve.
    let s = status(&cluster).expect("status");
    assert_eq!((s.revision, s.updated, s.ready), (2, 1, 2), "{s:?}");
    let last: BTreeSet<String> = traffic.last(12).expect("answers").into_iter().collect();
    assert!(
        last.iter().all(|a| a.ends_with(" v1")) && last.len() == 2,
        "only the two old replicas answer: {last:?}"
    );

    let run = ok(&cluster, &["rollout", "undo", "service", "web"]);
    assert!(run.stdout.contains("revision 3"), "{run:?}");
    ok(
        &cluster,
        &["rollout", "status", "service", "web", "--timeout", "2m"],
    );
    let v1: BTreeSet<String> = (0..3).map(|i| format!("web-{i} v1")).collect();
    cluster.wait_for("all three replicas back on v1", || {
        let last: BTreeSet<String> = traffic.last(12)?.into_iter().collect();
        (last == v1).then_some(())
    });
    let seen = traffic.stop();
    assert_no_failure(&seen, &cluster);
    let s = status(&cluster).expect("status");
    assert_eq!((s.revision, s.updated, s.ready), (3, 3, 3), "{s:?}");
}

#[test]
fn scaling_up_and_down_drains_the_replicas_it_stops() {
    let (cluster, _port, traffic) = serving(3, "");
    let run = ok(&cluster, &["scale", "service", "web", "--replicas", "5"]);
    assert!(run.stdout.contains("scaled to 5"), "{run:?}");
    let five: BTreeSet<String> = (0..5).map(|i| format!("web-{i} v1")).collect();
    cluster.wait_for("five replicas serving", || {
        let last: BTreeSet<String> = traffic.last(20)?.into_iter().collect();
        (last == five).then_some(())
    });
    ok(&cluster, &["scale", "service", "web", "--replicas", "2"]);
    let two: BTreeSet<String> = (0..2).map(|i| format!("web-{i} v1")).collect();
    cluster.wait_for("two replicas left", || {
        let s = status(&cluster)?;
        let last: BTreeSet<String> = traffic.last(12)?.into_iter().collect();
        (s.replicas.len() == 2 && last == two).then_some(())
    });
    let seen = traffic.stop();
    assert_no_failure(&seen, &cluster);
    let s = status(&cluster).expect("status");
    assert_eq!((s.desired, s.ready, s.revision), (2, 2, 1), "{s:?}");
}
