//! Services under traffic on a real simulated cluster: one
//! keel-controlplane and three keel-agentd, a service running
//! `tests/fixtures/versioned.py` with an http health check, and a client
//! sending 25 requests a second through node 1's proxy for the whole
//! scenario (`util::traffic`). Rolling updates, a rollout that never gets
//! ready and its undo, scaling with draining, a replica killed, a node
//! lost, a replica hung: each test asserts that no request failed, or for
//! the hung replica that none failed once it left node 1's rotation.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use keel::common::http::{Client, Endpoint};
use keel::common::wire::ServiceStatus;

use crate::util::agent::{signal, sim_jail_pids};
use crate::util::cluster::{Cluster, node_ip, port_free_on_nodes};
use crate::util::fixture_service;
use crate::util::traffic::{Seen, Traffic};

/// The Service document: `replicas` of `versioned.py` printing `version`,
/// healthy or not, with a fast health check, a short drain and `extra`
/// lines of `spec` (e.g. `update:`).
fn doc(port: u16, replicas: u32, version: &str, healthy: bool, extra: &str) -> String {
    let base = fixture_service(
        "web",
        "versioned.py",
        replicas,
        port,
        &crate::util::require_python3(),
    );
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
    serde_json::from_str(
        &cluster
            .keelctl_ok(&["get", "service", "web", "-o", "json"])
            .stdout,
    )
    .ok()
}

/// A cluster of three Alive nodes serving `replicas` ready replicas of
/// version v1 through node 1's proxy, and the client already sending.
fn serving(replicas: u32, extra: &str) -> (Cluster, u16, Traffic) {
    let cluster = Cluster::standard(3);
    cluster.wait_alive(3);
    let port = port_free_on_nodes(3);
    apply(&cluster, &doc(port, replicas, "v1", true, extra));
    cluster.wait_for("every replica ready", || {
        status(&cluster).filter(|s| s.ready == replicas)
    });
    // Node 1's proxy learns the replicas on its next heartbeat.
    let addrs: Vec<SocketAddr> = status(&cluster)
        .expect("status")
        .replicas
        .iter()
        .filter_map(|r| r.address.map(|a| SocketAddr::from((a, port))))
        .collect();
    cluster.wait_for("node 1's proxy to list every replica", || {
        addrs
            .iter()
            .all(|a| proxy_lists(&cluster, "n1", *a) == Some(true))
            .then_some(())
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
    let run = cluster.keelctl_ok(&["rollout", "status", "service", "web", "--timeout", "2m"]);
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
    let history = cluster
        .keelctl_ok(&["rollout", "history", "service", "web"])
        .stdout;
    let revisions: Vec<&str> = history
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(revisions, ["1", "2"], "{history}");
    let table = cluster.keelctl_ok(&["get", "services"]).stdout;
    assert!(table.contains("UP-TO-DATE"), "{table}");
}

#[test]
fn a_rollout_that_never_gets_ready_stops_and_undo_brings_the_old_template_back() {
    let update = "  update: {maxUnavailable: 1, progressDeadline: 8s}\n";
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

    let run = cluster.keelctl_ok(&["rollout", "undo", "service", "web"]);
    assert!(run.stdout.contains("revision 3"), "{run:?}");
    cluster.keelctl_ok(&["rollout", "status", "service", "web", "--timeout", "2m"]);
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
    let run = cluster.keelctl_ok(&["scale", "service", "web", "--replicas", "5"]);
    assert!(run.stdout.contains("scaled to 5"), "{run:?}");
    let five: BTreeSet<String> = (0..5).map(|i| format!("web-{i} v1")).collect();
    cluster.wait_for("five replicas serving", || {
        let last: BTreeSet<String> = traffic.last(20)?.into_iter().collect();
        (last == five).then_some(())
    });
    cluster.keelctl_ok(&["scale", "service", "web", "--replicas", "2"]);
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

/// Replica `name`'s node, address (with the service port) and workload pid.
fn replica(cluster: &Cluster, name: &str, port: u16) -> (String, SocketAddr, u32) {
    let s = status(cluster).expect("status");
    let r = s
        .replicas
        .iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("{name} is placed: {s:?}"));
    let addr = SocketAddr::from((r.address.expect("an address"), port));
    let pid = sim_jail_pids(&cluster.state_dir(&r.node))
        .get(name)
        .copied()
        .unwrap_or_else(|| panic!("{name}'s workload runs on {}", r.node));
    (r.node.clone(), addr, pid)
}

/// Whether node `node`'s proxy lists `addr` as a replica it sends new
/// connections to (`GET /proxy/replicas` on its socket).
fn proxy_lists(cluster: &Cluster, node: &str, addr: SocketAddr) -> Option<bool> {
    let r = Client::new(Endpoint::Unix(cluster.socket(node)))
        .request("GET", "/proxy/replicas", &[], b"")
        .ok()?;
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&r.body).ok()?;
    Some(rows.iter().any(|row| {
        row["replica"].as_str() == Some(addr.to_string().as_str())
            && row["listed"].as_bool() == Some(true)
            && row["ejected"].as_bool() == Some(false)
    }))
}

/// Waits until the last answers come from exactly `names`.
fn wait_for_answers(cluster: &Cluster, traffic: &Traffic, names: &BTreeSet<String>, what: &str) {
    cluster.wait_for(what, || {
        let last: BTreeSet<String> = traffic.last(names.len() * 4)?.into_iter().collect();
        (last == *names).then_some(())
    });
}

fn v1(replicas: u32) -> BTreeSet<String> {
    (0..replicas).map(|i| format!("web-{i} v1")).collect()
}

#[test]
fn a_replica_killed_with_sigkill_is_restarted_without_a_failed_request() {
    let (cluster, port, traffic) = serving(3, "");
    let (node, _, pid) = replica(&cluster, "web-1", port);
    signal(pid, libc::SIGKILL).expect("kill -9 web-1's workload");
    cluster.wait_for("web-1 running again, in a new process, and ready", || {
        let again = sim_jail_pids(&cluster.state_dir(&node))
            .get("web-1")
            .is_some_and(|p| *p != pid);
        let s = status(&cluster)?;
        (again && s.ready == 3).then_some(())
    });
    wait_for_answers(
        &cluster,
        &traffic,
        &v1(3),
        "all three replicas serving again",
    );
    let seen = traffic.stop();
    assert_no_failure(&seen, &cluster);
}

#[test]
fn a_lost_node_s_replica_is_placed_again_without_a_failed_request() {
    let (mut cluster, port, traffic) = serving(3, "");
    // Not node 1: the client goes through its proxy.
    let (victim, _, _) = replica(&cluster, "web-2", port);
    let victim = if victim == "n1" {
        replica(&cluster, "web-1", port).0
    } else {
        victim
    };
    assert_ne!(victim, "n1");
    cluster.kill9_node(&victim);
    cluster.wait_for("three ready replicas, none on the lost node", || {
        let s = status(&cluster)?;
        let off = s.replicas.iter().all(|r| r.node != victim);
        (s.ready == 3 && off && s.replicas.len() == 3).then_some(())
    });
    wait_for_answers(
        &cluster,
        &traffic,
        &v1(3),
        "all three replicas serving again",
    );
    let seen = traffic.stop();
    assert_no_failure(&seen, &cluster);
}

#[test]
fn a_hung_replica_fails_no_request_once_it_left_the_rotation() {
    let (cluster, port, traffic) = serving(3, "");
    let (_, addr, pid) = replica(&cluster, "web-1", port);
    signal(pid, libc::SIGSTOP).expect("kill -STOP web-1's workload");
    // Its health check times out three times in a row (600 ms), its agent
    // reports it not ready at once, and node 1's proxy drops it: every
    // request started from then on must succeed.
    let mark = cluster.wait_for("web-1 out of node 1's rotation", || {
        (!proxy_lists(&cluster, "n1", addr)?).then(|| traffic.started())
    });
    cluster.wait_for("40 more requests answered", || {
        (traffic.seen().answers.len() + traffic.seen().failures.len() >= mark + 40).then_some(())
    });
    let seen = traffic.stop();
    let late: Vec<_> = seen.failures.iter().filter(|f| f.seq >= mark).collect();
    assert!(
        late.is_empty(),
        "{} requests failed after web-1 left the rotation (request {mark} on): {late:#?}\n{}",
        late.len(),
        cluster.logs()
    );
    eprintln!(
        "hung replica: {} of {mark} requests failed before it left the rotation, none of the {} after",
        seen.failures.len(),
        seen.answers.len() + seen.failures.len() - mark
    );
}

/// `examples/sim-service.yaml`, as the README applies it, serves through a
/// node's proxy once its replicas passed their health check.
#[test]
fn the_simulate_mode_service_example_serves_through_a_proxy() {
    let cluster = Cluster::standard(3);
    cluster.wait_alive(3);
    let example =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/sim-service.yaml");
    cluster.keelctl_ok(&["apply", "-f", &example.display().to_string()]);
    let s = cluster.wait_for("3/3 ready", || {
        let s: ServiceStatus = serde_json::from_str(
            &cluster
                .keelctl_ok(&["get", "service", "hello", "-o", "json"])
                .stdout,
        )
        .ok()?;
        (s.ready == 3).then_some(s)
    });
    assert_eq!(s.port, 8080);
    let proxy = SocketAddr::from((node_ip(1), 8080));
    let page = cluster.wait_for("an answer through node 1's proxy", || {
        crate::util::traffic::get(proxy).ok()
    });
    assert!(page.contains("Directory listing"), "{page}");
}
