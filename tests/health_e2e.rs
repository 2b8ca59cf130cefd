//! Health checks on a real simulated cluster: one keel-controlplane and two
//! keel-agentd, each with its service proxy on its own loopback address, and
//! a service whose two replicas run `tests/fixtures/health_name.py` with an
//! http health check on `/healthz`. One replica's health endpoint is made to
//! fail while its process keeps serving: it leaves the rotation (the
//! service's ready count drops, the proxy stops sending to it, `get jails`
//! says it is not ready), is restarted by its agent later (a new process,
//! healthy again) and comes back.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use keel::common::http::{Client, Endpoint};
use keel::common::wire::{JailStatus, ServiceStatus};

use crate::util::cluster::{Cluster, node_ip, port_free_on_nodes};
use crate::util::fixture_service;
use crate::util::traffic::Traffic;

/// Bound on one request (to a proxy or to a replica).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// `GET path` on `addr`: the status code and the body.
fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut conn = TcpStream::connect_timeout(&addr, REQUEST_TIMEOUT)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    conn.set_read_timeout(Some(REQUEST_TIMEOUT))
        .map_err(|e| e.to_string())?;
    conn.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .map_err(|e| format!("send to {addr}: {e}"))?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)
        .map_err(|e| format!("read from {addr}: {e}"))?;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{addr} answered {answer:?}"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("{addr} answered {head:?}"))?;
    Ok((code, body.trim_end().to_string()))
}

fn status(cluster: &Cluster) -> Option<ServiceStatus> {
    serde_json::from_str(
        &cluster
            .keelctl_ok(&["get", "service", "web", "-o", "json"])
            .stdout,
    )
    .ok()
}

/// The names `rounds * 2` requests through node 1's proxy were answered by,
/// or `None` if one failed.
fn served_through_proxy(port: u16, rounds: usize) -> Option<BTreeSet<String>> {
    (0..rounds * 2)
        .map(|_| get(SocketAddr::from((node_ip(1), port)), "/").ok())
        .map(|r| r.filter(|(code, _)| *code == 200).map(|(_, name)| name))
        .collect()
}

/// Jail `name` as the agent of `node` reports it.
fn jail_on(cluster: &Cluster, node: &str, name: &str) -> Option<JailStatus> {
    let r = Client::new(Endpoint::Unix(cluster.socket(node)))
        .request("GET", &format!("/jails/{name}"), &[], b"")
        .ok()?;
    serde_json::from_slice(&r.body).ok()
}

#[test]
fn a_replica_whose_health_check_fails_leaves_the_rotation_and_is_restarted() {
    let cluster = Cluster::standard(2);
    cluster.wait_alive(2);
    let port = port_free_on_nodes(2);
    let doc = format!(
        "{}    health:\n      http: {{port: {port}, path: /healthz}}\n      interval: 300ms\n      \
         timeout: 300ms\n      failureThreshold: 5\n",
        fixture_service(
            "web",
            "health_name.py",
            2,
            port,
            &crate::util::require_python3()
        )
    );
    let run = cluster.keelctl_with(&["apply", "-f", "-"], Some(&doc));
    assert_eq!(run.code, 0, "{run:?}\n{}", cluster.logs());

    let both: BTreeSet<String> = ["web-0", "web-1"].map(String::from).into();
    let s = cluster.wait_for("2/2 ready", || status(&cluster).filter(|s| s.ready == 2));
    cluster.wait_for("the proxy to serve both replicas", || {
        served_through_proxy(port, 3).filter(|names| *names == both)
    });
    // A client through node 1's proxy for the whole scenario: the failing
    // replica still serves, so nothing may fail.
    let traffic = Traffic::start(SocketAddr::from((node_ip(1), port)));

    let victim = s
        .replicas
        .iter()
        .find(|r| r.name == "web-1")
        .expect("web-1 is placed");
    let victim_addr = SocketAddr::from((victim.address.expect("web-1 has an address"), port));
    let victim_node = victim.node.clone();
    let before = jail_on(&cluster, &victim_node, "web-1").expect("web-1's status");
    assert!(before.ready, "{before:?}");

    // Its health endpoint fails from now on; the process keeps serving.
    assert_eq!(get(victim_addr, "/fail").map(|r| r.0), Ok(200));
    assert_eq!(get(victim_addr, "/healthz").map(|r| r.0), Ok(503));
    assert_eq!(
        get(victim_addr, "/"),
        Ok((200, "web-1".to_string())),
        "the process still serves"
    );

    let not_ready = cluster.wait_for("web-1's agent to say it is not ready", || {
        jail_on(&cluster, &victim_node, "web-1").filter(|j| !j.ready)
    });
    // Five failures out, five more before the restart: the process is the
    // same one, still serving, only out of rotation.
    assert_eq!(not_ready.restarts, before.restarts, "{not_ready:?}");
    assert_eq!(get(victim_addr, "/"), Ok((200, "web-1".to_string())));
    let s = cluster.wait_for("web-1 out of the ready count", || {
        status(&cluster).filter(|s| s.ready == 1)
    });
    assert!(
        s.replicas.iter().any(|r| r.name == "web-0" && r.ready),
        "{s:?}"
    );
    let only_web0: BTreeSet<String> = ["web-0".to_string()].into();
    cluster.wait_for("the proxy to send only to web-0", || {
        served_through_proxy(port, 3).filter(|names| *names == only_web0)
    });

    // Later its agent restarts it: a new process, healthy again, back in
    // the rotation; the reason is its last error.
    let restarted = cluster.wait_for("web-1 restarted by its agent", || {
        jail_on(&cluster, &victim_node, "web-1").filter(|j| j.restarts > before.restarts)
    });
    cluster.wait_for("2/2 ready again", || {
        status(&cluster).filter(|s| s.ready == 2)
    });
    let back = jail_on(&cluster, &victim_node, "web-1").expect("web-1's status");
    let reason = back.last_error.clone().unwrap_or_default();
    assert!(
        back.ready && back.restarts == restarted.restarts && reason.contains("health check"),
        "ready again, and it still says why it restarted: {back:?}"
    );
    cluster.wait_for("the proxy to serve both replicas again", || {
        served_through_proxy(port, 3).filter(|names| *names == both)
    });
    assert_eq!(get(victim_addr, "/healthz").map(|r| r.0), Ok(200));
    let seen = traffic.stop();
    assert!(
        seen.failures.is_empty() && seen.answers.len() > 20,
        "{} of {} requests failed: {:#?}",
        seen.failures.len(),
        seen.failures.len() + seen.answers.len(),
        seen.failures
    );
    let table = cluster.keelctl_ok(&["get", "jails"]).stdout;
    assert!(
        table.lines().next().is_some_and(|h| h.contains("READY")),
        "{table}"
    );
}
