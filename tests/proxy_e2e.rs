//! The service proxy on a real simulated cluster:
//! one keel-controlplane and three keel-agentd, each agent's proxy on its own
//! loopback address (`--proxy-listen`), a service whose replicas run
//! `tests/fixtures/echo_name.py` (every connection is answered with the
//! replica's name). Requests through each node's proxy reach every replica
//! round-robin; scaling changes what the proxies serve; a lost node's
//! replica is replaced while a client keeps connecting, with zero failed
//! requests; the node's return is fenced.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use keel::common::http::{Client, Endpoint};
use keel::common::wire::{JailStatus, Liveness, NodeStatus, ServiceStatus};

use crate::util::cluster::{Cluster, node_ip};
use crate::util::fixture_service;

const NODES: [&str; 3] = ["n1", "n2", "n3"];

/// Bound on one client request through a proxy.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A port free on every node's address (the three proxies listen on it).
fn port_free_everywhere() -> u16 {
    loop {
        let port = TcpListener::bind((node_ip(1), 0))
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        if NODES.iter().enumerate().all(|(i, _)| {
            let n = u8::try_from(i + 1).expect("three nodes");
            TcpListener::bind((node_ip(n), port)).is_ok()
        }) {
            return port;
        }
    }
}

fn apply(cluster: &Cluster, replicas: u32, port: u16) {
    let run = cluster.keelctl_with(
        &["apply", "-f", "-"],
        Some(&fixture_service(
            "echo",
            "echo_name.py",
            replicas,
            port,
            &crate::util::require_python3(),
        )),
    );
    assert_eq!(run.code, 0, "{run:?}\n{}", cluster.logs());
}

fn status(cluster: &Cluster) -> Option<ServiceStatus> {
    serde_json::from_str(
        &cluster
            .keelctl_ok(&["get", "service", "echo", "-o", "json"])
            .stdout,
    )
    .ok()
}

/// One request through the proxy at `addr`: the name of the replica that
/// answered, or what went wrong.
fn ask(addr: SocketAddr) -> Result<String, String> {
    let mut conn = TcpStream::connect_timeout(&addr, REQUEST_TIMEOUT)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    conn.set_read_timeout(Some(REQUEST_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)
        .map_err(|e| format!("read from {addr}: {e}"))?;
    match answer.strip_suffix('\n') {
        Some(name) if name.starts_with("echo-") => Ok(name.to_string()),
        _ => Err(format!("{addr} answered {answer:?}")),
    }
}

fn proxy(n: u8, port: u16) -> SocketAddr {
    SocketAddr::from((node_ip(n), port))
}

/// Waits until `rounds` full rotations through node `n`'s proxy answer with
/// exactly `want`, each name once per rotation and in the same order every
/// rotation (round-robin over a stable list); returns one rotation.
fn wait_for_rotation(
    cluster: &Cluster,
    n: u8,
    port: u16,
    want: &BTreeSet<String>,
    rounds: usize,
) -> Vec<String> {
    cluster.wait_for(&format!("n{n}'s proxy to rotate over {want:?}"), || {
        let answers: Vec<String> = (0..want.len() * rounds)
            .map(|_| ask(proxy(n, port)))
            .collect::<Result<_, _>>()
            .ok()?;
        let first: Vec<String> = answers[..want.len()].to_vec();
        let round_robin = first.iter().cloned().collect::<BTreeSet<_>>() == *want
            && answers.chunks(want.len()).all(|c| c == first.as_slice());
        round_robin.then_some(first)
    })
}

fn ready_names(s: &ServiceStatus) -> BTreeSet<String> {
    s.replicas
        .iter()
        .filter(|r| r.ready)
        .map(|r| r.name.clone())
        .collect()
}

fn names(range: std::ops::Range<u32>) -> BTreeSet<String> {
    range.map(|i| format!("echo-{i}")).collect()
}

/// Replica names each node's agent holds, read from its own socket (a killed
/// agent holds nothing it can report).
fn held(cluster: &Cluster, node: &str) -> Option<Vec<String>> {
    let r = Client::new(Endpoint::Unix(cluster.socket(node)))
        .request("GET", "/jails", &[], b"")
        .ok()?;
    let jails: Vec<JailStatus> = serde_json::from_slice(&r.body).ok()?;
    Some(
        jails
            .into_iter()
            .filter(|j| j.name.starts_with("echo-"))
            .map(|j| j.name)
            .collect(),
    )
}

/// Sends requests through `addr` one after another until stopped, counting
/// answers and failures (with the first few failures' reasons). It can be
/// held between two requests, so a node is killed with no request in flight
/// on it: a connection already relayed to a replica that dies is lost with
/// any L4 proxy (HAProxy's too); what the proxy must cover is every request
/// that starts after the replica died, by retrying the next replica.
struct SteadyClient {
    stop: Arc<AtomicBool>,
    hold: Arc<AtomicBool>,
    held: Arc<AtomicBool>,
    served: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<Vec<String>>,
}

impl SteadyClient {
    fn start(addr: SocketAddr) -> SteadyClient {
        let stop = Arc::new(AtomicBool::new(false));
        let hold = Arc::new(AtomicBool::new(false));
        let held = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stop, hold, held, served) =
                (stop.clone(), hold.clone(), held.clone(), served.clone());
            std::thread::spawn(move || {
                let mut failures = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    if hold.load(Ordering::SeqCst) {
                        held.store(true, Ordering::SeqCst);
                        std::thread::yield_now();
                        continue;
                    }
                    held.store(false, Ordering::SeqCst);
                    match ask(addr) {
                        Ok(_) => {
                            served.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => failures.push(e),
                    }
                }
                failures
            })
        };
        SteadyClient {
            stop,
            hold,
            held,
            served,
            thread,
        }
    }

    /// Holds the client between two requests; returns once it is held.
    fn hold(&self, cluster: &Cluster) {
        self.hold.store(true, Ordering::SeqCst);
        cluster.wait_for("the client to pause between requests", || {
            self.held.load(Ordering::SeqCst).then_some(())
        });
    }

    fn resume(&self) {
        self.hold.store(false, Ordering::SeqCst);
    }

    /// Stops the client: (requests served, failures).
    fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        let failures = self.thread.join().expect("client thread");
        (self.served.load(Ordering::Relaxed), failures)
    }
}

#[test]
fn requests_to_the_vip_rotate_over_replicas_and_survive_a_lost_node() {
    let mut cluster = Cluster::standard(3);
    wait_three_alive(&cluster);
    let port = port_free_everywhere();

    // Three replicas, one per node; every node's proxy rotates over all three.
    apply(&cluster, 3, port);
    let s = cluster.wait_for("3/3 ready", || status(&cluster).filter(|s| s.ready == 3));
    let placed: BTreeMap<String, String> = s
        .replicas
        .iter()
        .map(|r| (r.name.clone(), r.node.clone()))
        .collect();
    assert_eq!(
        placed.values().collect::<BTreeSet<_>>().len(),
        3,
        "spread: {placed:?}"
    );
    for n in 1..=3 {
        wait_for_rotation(&cluster, n, port, &names(0..3), 3);
    }

    // Scale 3 -> 5 -> 2: the proxies follow the ready replicas.
    apply(&cluster, 5, port);
    cluster.wait_for("5/5 ready", || status(&cluster).filter(|s| s.ready == 5));
    for n in 1..=3 {
        wait_for_rotation(&cluster, n, port, &names(0..5), 2);
    }
    apply(&cluster, 2, port);
    cluster.wait_for("2 replicas left", || {
        status(&cluster).filter(|s| s.replicas.len() == 2 && s.ready == 2)
    });
    for n in 1..=3 {
        wait_for_rotation(&cluster, n, port, &names(0..2), 3);
    }

    // Back to three, then lose the node holding one of them while a client
    // keeps asking through n1's proxy.
    apply(&cluster, 3, port);
    let s = cluster.wait_for("3/3 ready again", || {
        status(&cluster).filter(|s| s.ready == 3)
    });
    wait_for_rotation(&cluster, 1, port, &names(0..3), 2);
    let victim = s
        .replicas
        .iter()
        .find(|r| r.node == "n3")
        .map(|r| r.name.clone())
        .unwrap_or_else(|| panic!("a replica on n3: {s:?}"));
    let client = SteadyClient::start(proxy(1, port));
    cluster.wait_for("the client to be served", || {
        (client.served.load(Ordering::Relaxed) > 0).then_some(())
    });
    // Killed between two requests (see SteadyClient); every request after
    // this must be served.
    client.hold(&cluster);
    let lost = Instant::now();
    cluster.kill9_node("n3");
    client.resume();
    let healed = cluster.wait_for(&format!("{victim} replaced off n3"), || {
        status(&cluster).filter(|s| {
            s.ready == 3
                && s.replicas
                    .iter()
                    .all(|r| r.ready && r.node != "n3" && r.state == "Running")
        })
    });
    let failover = lost.elapsed();
    wait_for_rotation(&cluster, 1, port, &ready_names(&healed), 2);
    let table = Client::new(Endpoint::Unix(cluster.socket("n1")))
        .request("GET", "/proxy", &[], b"")
        .expect("agent answers");
    let table: serde_json::Value = serde_json::from_slice(&table.body).expect("JSON");
    assert_eq!(
        table,
        serde_json::json!([{"name": "echo", "listen": proxy(1, port).to_string(), "replicas": 3}]),
        "n1's proxy table"
    );
    // Per replica: the three listed, none ejected; n3's lost replica, which
    // the table dropped, is not shown once its connections are gone.
    cluster.wait_for(
        "n1's GET /proxy/replicas to list the three replicas",
        || {
            let r = Client::new(Endpoint::Unix(cluster.socket("n1")))
                .request("GET", "/proxy/replicas", &[], b"")
                .ok()?;
            let rows: Vec<serde_json::Value> = serde_json::from_slice(&r.body).ok()?;
            (rows.len() == 3
                && rows.iter().all(|row| {
                    row["service"] == "echo" && row["listed"] == true && row["ejected"] == false
                }))
            .then_some(())
        },
    );
    let (served, failures) = client.finish();
    eprintln!(
        "failover: full replica count {:.2} s after kill -9 of n3 (dead_after 2 s, heartbeats every 200 ms); {served} requests during it",
        failover.as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} of {} requests failed during the failover, first: {:?}\n{}",
        failures.len(),
        served + failures.len() as u64,
        &failures[..failures.len().min(5)],
        cluster.logs()
    );
    assert!(served > 0, "the client was served during the failover");

    // n3 comes back: its agent still records the old replica, which fencing
    // removes; no replica name is held by two nodes afterwards.
    cluster.restart_agent("n3");
    cluster.wait_for("n3's stale replica fenced", || {
        held(&cluster, "n3").filter(Vec::is_empty)
    });
    let mut owners: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for node in NODES {
        for name in held(&cluster, node).expect("agent answers") {
            owners.entry(name).or_default().push(node);
        }
    }
    assert!(
        owners.values().all(|nodes| nodes.len() == 1) && owners.len() == 3,
        "each replica on exactly one node: {owners:?}"
    );
}

fn wait_three_alive(cluster: &Cluster) {
    cluster.wait_alive(3);
}

/// Watches `get nodes` for longer than the cluster's dead_after (2 s),
/// failing at the first node seen Dead after `what`.
fn watch_no_death(cluster: &Cluster, what: &str) {
    let from = Instant::now();
    cluster.wait_for("dead_after to pass with no node Dead", || {
        let nodes: Vec<NodeStatus> =
            serde_json::from_str(&cluster.keelctl_ok(&["get", "nodes", "-o", "json"]).stdout)
                .ok()?;
        assert!(
            nodes.iter().all(|n| n.status != Liveness::Dead),
            "a node died of {what}: {nodes:?}\n{}",
            cluster.logs()
        );
        (from.elapsed() > Duration::from_secs(3)).then_some(())
    });
}

/// Each replica's node, and the pid of its workload on that node.
fn replica_homes(cluster: &Cluster) -> BTreeMap<String, (String, u32)> {
    let mut homes = BTreeMap::new();
    for node in NODES {
        let pids = crate::util::agent::sim_jail_pids(&cluster.state_dir(node));
        for (name, pid) in pids.into_iter().filter(|(n, _)| n.starts_with("echo-")) {
            homes.insert(name, (node.to_string(), pid));
        }
    }
    homes
}

#[test]
fn control_plane_restarts_and_stalls_move_nothing_fence_nothing_and_the_vip_keeps_serving() {
    let mut cluster = Cluster::standard(3);
    wait_three_alive(&cluster);
    let port = port_free_everywhere();
    apply(&cluster, 3, port);
    cluster.wait_for("3/3 ready", || status(&cluster).filter(|s| s.ready == 3));
    for n in 1..=3 {
        wait_for_rotation(&cluster, n, port, &names(0..3), 2);
    }
    let before = replica_homes(&cluster);
    let nodes: BTreeSet<&String> = before.values().map(|(node, _)| node).collect();
    assert_eq!((before.len(), nodes.len()), (3, 3), "spread: {before:?}");

    // Restart the control plane three times, by SIGTERM and by kill -9, while
    // a client keeps asking through n1's proxy. Each time every node is
    // silent to the new process until its next heartbeat: that is no
    // evidence against it, so nothing may move, and nothing may be fenced.
    let client = SteadyClient::start(proxy(1, port));
    cluster.wait_for("the client to be served", || {
        (client.served.load(Ordering::Relaxed) > 0).then_some(())
    });
    for round in 0..3 {
        if round == 1 {
            cluster.kill9_controlplane();
        } else {
            cluster.stop_controlplane();
        }
        cluster.restart_controlplane();
        cluster.wait_for("3/3 ready after the restart", || {
            status(&cluster).filter(|s| s.ready == 3)
        });
        assert_eq!(
            replica_homes(&cluster),
            before,
            "after restart {round}: every replica on its node with the same process\n{}",
            cluster.logs()
        );
    }
    // Longer than dead_after after the last restart, still nothing moved.
    watch_no_death(&cluster, "a restart");
    assert_eq!(replica_homes(&cluster), before, "{}", cluster.logs());

    // A stalled control plane (SIGSTOP for longer than dead_after, as a VM
    // pause or a stuck disk would): the heartbeats it could not handle are
    // no evidence either, so once it runs again every lease starts over.
    let cp = cluster.controlplane_pid().expect("a control plane");
    crate::util::agent::signal(cp, libc::SIGSTOP).expect("SIGSTOP");
    // The stall itself is the scenario: there is no condition to await.
    std::thread::sleep(Duration::from_secs(3));
    crate::util::agent::signal(cp, libc::SIGCONT).expect("SIGCONT");
    watch_no_death(&cluster, "a stall");
    assert_eq!(replica_homes(&cluster), before, "{}", cluster.logs());
    let (served, failures) = client.finish();
    assert!(
        failures.is_empty(),
        "{} of {} requests failed across the restarts, first: {:?}\n{}",
        failures.len(),
        served + failures.len() as u64,
        &failures[..failures.len().min(5)],
        cluster.logs()
    );
    let log = cluster.logs();
    assert!(!log.contains("fenced jail"), "nothing fenced:\n{log}");
}
