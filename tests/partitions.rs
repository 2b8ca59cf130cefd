//! Network partitions: keel-controlplane and three
//! keel-agentd, all `--simulate`, each in a network namespace of its own,
//! joined by veth pairs to a bridge in a fifth namespace. Links are cut and
//! healed with iproute2 by setting the bridge's end of a veth down and up:
//! the namespace behind it keeps its address and route but nothing gets
//! through, as when a cable or a switch port fails (a blackhole, not a
//! refused connection).
//!
//! Nothing here touches the test host's own namespace: the bridge, the veths
//! and the addresses (10.213.0.0/24) exist only inside the namespaces, whose
//! names carry the test process's pid and a counter, so parallel runs and
//! parallel tests never collide. The daemons run through `ip netns exec NS`
//! (argv, no shell; it execs the daemon, so the child is the daemon itself);
//! the test reads each agent's API through its Unix socket, a file, from the
//! test's own namespace, and runs keelctl inside the control plane's
//! namespace ([`Cluster`] runs keelctl behind the control plane's prefix).
//!
//! Namespaces need root: without, the tests say why and pass, but fail
//! under `CI` ([`Namespaces::new`]). On every path (a failed assertion too)
//! the [`Cluster`] stops the daemons and the simulated jails first, then
//! [`Net`] deletes the namespaces, which removes the veths and the bridge
//! with them.
//!
//! Scenarios, each with heartbeats every 200 ms and Dead after 2 s:
//! (a) a node cut off longer than dead_after: its stateless replicas move,
//! it keeps running its jails until the heal, then fencing removes its stale
//! copies and no name runs twice; (b) a stateful replica's node cut off:
//! never replaced, never duplicated; (c) the control plane cut off from
//! everyone: every jail keeps running and every proxy keeps its table; (d) a
//! flapping link. Figures (how long rescheduling and fencing took) are
//! printed, not asserted.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel::common::http::{Client, Endpoint};
use keel::common::wire::{JailStatus, Liveness, NodeStatus, Phase, ServiceStatus};

use crate::util::agent::{process_alive, sim_jail_pids};
use crate::util::cluster::{Cluster, standard_controlplane_args};
use crate::util::netns::{Namespaces, ip};

/// The three agents.
const NODES: [&str; 3] = ["n1", "n2", "n3"];
/// The control plane's namespace member name.
const CP: &str = "cp";
/// Port of the control plane's API and of each agent's TCP listener, in
/// their own namespaces (nothing else listens there).
const CP_PORT: u16 = 7000;
const AGENT_PORT: u16 = 7001;

/// This test's address of a member: the control plane `.1`, node `nK`
/// `.1K`.
fn address(member: &str) -> Ipv4Addr {
    match member.strip_prefix('n').and_then(|k| k.parse::<u8>().ok()) {
        Some(k) => Ipv4Addr::new(10, 213, 0, 10 + k),
        None => Ipv4Addr::new(10, 213, 0, 1),
    }
}

/// The namespaces, veths and bridge of one test ([`Namespaces`] deletes
/// them on drop).
struct Net {
    spaces: Namespaces,
}

impl Net {
    /// The bridge namespace and one namespace per member, each joined to the
    /// bridge by a veth (`eth0` inside, the member's name on the bridge);
    /// `None` when namespaces cannot be made here.
    fn create(test: &str, members: &[&str]) -> Option<Net> {
        let mut spaces = Namespaces::new(test, "keelpart", "br")?;
        let bridge = spaces.name("br");
        let setup = |r: Result<(), String>| r.expect("set up the test's network");
        setup(ip(&["-n", &bridge, "link", "add", "br0", "type", "bridge"]));
        setup(ip(&["-n", &bridge, "link", "set", "br0", "up"]));
        for member in members {
            let ns = spaces.add(member).expect("add a namespace");
            setup(ip(&[
                "-n", &bridge, "link", "add", member, "type", "veth", "peer", "name", "eth0",
                "netns", &ns,
            ]));
            setup(ip(&["-n", &bridge, "link", "set", member, "master", "br0"]));
            setup(ip(&["-n", &bridge, "link", "set", member, "up"]));
            let cidr = format!("{}/24", address(member));
            setup(ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"]));
            setup(ip(&["-n", &ns, "link", "set", "eth0", "up"]));
        }
        Some(Net { spaces })
    }

    /// The command prefix that runs a program in `member`'s namespace.
    fn exec(&self, member: &str) -> Vec<String> {
        self.spaces.exec(member)
    }

    /// Cuts `member` off the bridge.
    fn cut(&self, member: &str) {
        let bridge = self.spaces.name("br");
        ip(&["-n", &bridge, "link", "set", member, "down"]).expect("cut a link");
    }

    /// Joins `member` to the bridge again.
    fn heal(&self, member: &str) {
        let bridge = self.spaces.name("br");
        ip(&["-n", &bridge, "link", "set", member, "up"]).expect("heal a link");
    }
}

/// The control plane and three agents, each in its own namespace. The
/// cluster is declared first so it is dropped first: its daemons stop before
/// their namespaces go.
struct Partitioned {
    cluster: Cluster,
    net: Net,
}

/// A partitioned cluster, or `None` (with the reason printed) when network
/// namespaces cannot be made here; with `CI` set that is a failure.
fn start(test: &str) -> Option<Partitioned> {
    let mut members = vec![CP];
    members.extend(NODES);
    let net = Net::create(test, &members)?;
    let mut cluster = Cluster::new();
    let args = standard_controlplane_args(SocketAddr::from((address(CP), CP_PORT)));
    cluster.start_controlplane_in(&strs(&net.exec(CP)), &strs(&args));
    for id in NODES {
        let args = cluster.standard_agent_args(
            id,
            SocketAddr::from((address(id), AGENT_PORT)),
            address(id),
        );
        cluster.start_agent_in(id, &strs(&net.exec(id)), &strs(&args));
    }
    let p = Partitioned { cluster, net };
    p.cluster.wait_for("three Alive nodes", || {
        let nodes = p.nodes()?;
        (nodes.len() == 3 && nodes.iter().all(|n| n.status == Liveness::Alive)).then_some(())
    });
    Some(p)
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn service_yaml(name: &str, replicas: u32, stateful: bool) -> String {
    let volumes = if stateful {
        "    volumes: [{name: data, mountPath: /data, size: 1G}]\n"
    } else {
        ""
    };
    format!(
        "kind: Service
metadata: {{name: {name}}}
spec:
  replicas: {replicas}
  port: 8080
  template:
    base: 14.2-RELEASE
    resources: {{cpu: 0.1}}
    exec:
      start: [/bin/sleep, '300']
{volumes}"
    )
}

impl Partitioned {
    /// The control plane's nodes, as keelctl in its namespace sees them.
    fn nodes(&self) -> Option<Vec<NodeStatus>> {
        let run = self.cluster.keelctl(&["get", "nodes", "-o", "json"]);
        (run.code == 0)
            .then(|| serde_json::from_str(&run.stdout).ok())
            .flatten()
    }

    fn liveness(&self, id: &str) -> Option<Liveness> {
        self.nodes()?
            .into_iter()
            .find(|n| n.node_id == id)
            .map(|n| n.status)
    }

    fn service(&self, name: &str) -> Option<ServiceStatus> {
        let run = self
            .cluster
            .keelctl(&["get", "service", name, "-o", "json"]);
        (run.code == 0)
            .then(|| serde_json::from_str(&run.stdout).ok())
            .flatten()
    }

    fn apply(&self, yaml: &str) {
        let run = self.cluster.keelctl_with(&["apply", "-f", "-"], Some(yaml));
        assert_eq!(run.code, 0, "{run:?}\n{}", self.cluster.logs());
    }

    /// Applies service `name` and waits until all its replicas are ready,
    /// one per node.
    fn deploy(&self, name: &str, stateful: bool) -> ServiceStatus {
        self.apply(&service_yaml(name, 3, stateful));
        let status = self
            .cluster
            .wait_for(&format!("3 ready {name} replicas"), || {
                self.service(name).filter(|s| s.ready == 3)
            });
        let nodes: BTreeSet<&str> = status.replicas.iter().map(|r| r.node.as_str()).collect();
        assert_eq!(nodes.len(), 3, "one replica per node: {status:?}");
        status
    }

    /// Node `id`'s jails, from its socket.
    fn jails(&self, id: &str) -> Vec<JailStatus> {
        let r = Client::new(Endpoint::Unix(self.cluster.socket(id)))
            .with_timeout(Duration::from_secs(10))
            .request("GET", "/jails", &[], b"")
            .unwrap_or_else(|e| panic!("{id}'s socket: {e}\n{}", self.cluster.logs()));
        assert_eq!(r.status, 200, "{id}: GET /jails");
        serde_json::from_slice(&r.body).expect("a jail list")
    }

    /// Node `id`'s `GET /proxy` table.
    fn proxy(&self, id: &str) -> serde_json::Value {
        let r = Client::new(Endpoint::Unix(self.cluster.socket(id)))
            .with_timeout(Duration::from_secs(10))
            .request("GET", "/proxy", &[], b"")
            .unwrap_or_else(|e| panic!("{id}'s socket: {e}"));
        assert_eq!(r.status, 200, "{id}: GET /proxy");
        serde_json::from_slice(&r.body).expect("a proxy table")
    }

    /// For every jail named `{service}-*` on any node, the nodes holding it.
    fn holders(&self, service: &str) -> BTreeMap<String, Vec<String>> {
        holders_of(&self.cluster, service)
    }

    /// Pids of node `id`'s simulated workloads.
    fn pids(&self, id: &str) -> BTreeMap<String, u32> {
        sim_jail_pids(&self.cluster.state_dir(id))
    }
}

fn holders_of(cluster: &Cluster, service: &str) -> BTreeMap<String, Vec<String>> {
    let prefix = format!("{service}-");
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in NODES {
        let Ok(r) = Client::new(Endpoint::Unix(cluster.socket(id)))
            .with_timeout(Duration::from_secs(10))
            .request("GET", "/jails", &[], b"")
        else {
            continue;
        };
        let jails: Vec<JailStatus> = serde_json::from_slice(&r.body).expect("a jail list");
        for j in jails.into_iter().filter(|j| j.name.starts_with(&prefix)) {
            out.entry(j.name).or_default().push(id.to_string());
        }
    }
    out
}

fn duplicates(holders: &BTreeMap<String, Vec<String>>) -> Vec<(&String, &Vec<String>)> {
    holders
        .iter()
        .filter(|(_, nodes)| nodes.len() > 1)
        .collect()
}

/// The replicas of `status` placed on `node`.
fn placed_on(status: &ServiceStatus, node: &str) -> BTreeSet<String> {
    status
        .replicas
        .iter()
        .filter(|r| r.node == node)
        .map(|r| r.name.clone())
        .collect()
}

/// Every jail in `want` is Running on `id` with the same workload process.
fn assert_still_running(p: &Partitioned, id: &str, want: &BTreeMap<String, u32>, when: &str) {
    let jails = p.jails(id);
    let pids = p.pids(id);
    for (name, pid) in want {
        let jail = jails.iter().find(|j| &j.name == name);
        assert!(
            jail.is_some_and(|j| j.state == Phase::Running),
            "{when}: {id} no longer runs {name}: {jails:?}"
        );
        assert_eq!(
            pids.get(name),
            Some(pid),
            "{when}: {id}'s {name} was restarted or replaced"
        );
        assert!(
            process_alive(*pid),
            "{when}: {id}'s {name} (pid {pid}) died"
        );
    }
}

#[test]
fn a_node_cut_off_longer_than_dead_after_loses_its_stateless_replicas_to_others_then_is_fenced() {
    let Some(p) = start("partition_a") else {
        return;
    };
    let victim = "n2";
    let before = p.deploy("web", false);
    let stale = placed_on(&before, victim);
    assert_eq!(stale.len(), 1, "{before:?}");

    // A jail applied on the node itself, which the control plane never saw.
    let local = "kind: Jail\nmetadata: {name: local}\nspec:\n  base: 14.2-RELEASE\n  exec:\n    start: [/bin/sleep, '300']\n";
    let r = Client::new(Endpoint::Unix(p.cluster.socket(victim)))
        .request("PUT", "/jails/local", &[], local.as_bytes())
        .expect("the agent answers");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let kept = p
        .cluster
        .wait_for("the local jail and the replica to run", || {
            let pids = p.pids(victim);
            let running = p.jails(victim).iter().all(|j| j.state == Phase::Running);
            (running && pids.len() == 2).then_some(pids)
        });

    p.net.cut(victim);
    let cut = Instant::now();
    let moved = p
        .cluster
        .wait_for("the cut node's replica to run elsewhere", || {
            let s = p.service("web")?;
            let ready_elsewhere = s.ready == 3 && placed_on(&s, victim).is_empty();
            (ready_elsewhere && p.liveness(victim) == Some(Liveness::Dead)).then_some(s)
        });
    let rescheduled_after = cut.elapsed();
    let holders = p.holders("web");
    for name in &stale {
        let elsewhere: Vec<&String> = holders[name].iter().filter(|n| *n != victim).collect();
        assert_eq!(
            elsewhere.len(),
            1,
            "{name} runs once elsewhere: {holders:?}"
        );
    }
    assert_eq!(moved.replicas.len(), 3, "{moved:?}");
    // Cut off, the node keeps everything it ran, stale replica included.
    assert_still_running(&p, victim, &kept, "while cut off");

    p.net.heal(victim);
    let healed = Instant::now();
    p.cluster
        .wait_for("the stale replica to be fenced on heal", || {
            let names: BTreeSet<String> = p.jails(victim).into_iter().map(|j| j.name).collect();
            names.is_disjoint(&stale).then_some(())
        });
    let fenced_after = healed.elapsed();
    let holders = p.holders("web");
    assert!(
        duplicates(&holders).is_empty(),
        "a replica runs twice: {holders:?}"
    );
    assert_eq!(holders.len(), 3, "{holders:?}");
    // The local jail has no placement epoch: fencing never touches it.
    let local_pid = BTreeMap::from([("local".to_string(), kept["local"])]);
    assert_still_running(&p, victim, &local_pid, "after the heal");
    p.cluster.wait_for("3 ready replicas after the heal", || {
        (p.service("web")?.ready == 3).then_some(())
    });
    assert!(duplicates(&p.holders("web")).is_empty());
    eprintln!(
        "partition a: replica rescheduled {:.1} s after the cut; stale copy fenced {:.1} s after the heal",
        rescheduled_after.as_secs_f64(),
        fenced_after.as_secs_f64()
    );
}

#[test]
fn a_stateful_replica_s_node_cut_off_is_never_replaced_nor_duplicated() {
    let Some(p) = start("partition_b") else {
        return;
    };
    let victim = "n3";
    let before = p.deploy("db", true);
    assert!(before.stateful, "a template with volumes is stateful");
    let pinned = placed_on(&before, victim);
    assert_eq!(pinned.len(), 1, "{before:?}");
    let name = pinned.first().expect("one").clone();
    let pid = p.cluster.wait_for("the replica's workload", || {
        p.pids(victim).get(&name).copied()
    });

    p.net.cut(victim);
    p.cluster.wait_for("the cut node to be Dead", || {
        (p.liveness(victim) == Some(Liveness::Dead)).then_some(())
    });
    // The other nodes heartbeat every 200 ms and each heartbeat could bring
    // a replacement: watch for five dead_after periods.
    let watch = Instant::now();
    let mut looks = 0;
    while watch.elapsed() < Duration::from_secs(5) {
        let s = p.service("db").expect("the service");
        assert_eq!(
            placed_on(&s, victim),
            pinned,
            "the stateful replica stays placed on its node: {s:?}"
        );
        assert_eq!(s.replicas.len(), 3, "never a fourth replica: {s:?}");
        assert_eq!(
            s.ready, 2,
            "the pinned replica is not ready while cut off: {s:?}"
        );
        let holders = p.holders("db");
        assert_eq!(
            holders[&name],
            vec![victim.to_string()],
            "{name} moved: {holders:?}"
        );
        assert!(duplicates(&holders).is_empty(), "{holders:?}");
        looks += 1;
    }
    assert!(looks > 0);

    p.net.heal(victim);
    p.cluster.wait_for("3 ready replicas after the heal", || {
        (p.service("db")?.ready == 3).then_some(())
    });
    let holders = p.holders("db");
    assert!(duplicates(&holders).is_empty(), "{holders:?}");
    assert_eq!(holders[&name], vec![victim.to_string()]);
    assert_eq!(
        p.pids(victim).get(&name),
        Some(&pid),
        "the replica kept its workload through the partition"
    );
    assert!(process_alive(pid));
    eprintln!("partition b: {looks} looks at the cluster while {victim} was Dead, no replacement");
}

#[test]
fn a_control_plane_cut_off_from_everyone_leaves_every_jail_and_proxy_table_in_place() {
    let Some(p) = start("partition_c") else {
        return;
    };
    p.deploy("web", false);
    let tables: BTreeMap<&str, serde_json::Value> =
        p.cluster
            .wait_for("every proxy to serve web with 3 replicas", || {
                let tables: BTreeMap<&str, serde_json::Value> =
                    NODES.iter().map(|id| (*id, p.proxy(id))).collect();
                tables
                    .values()
                    .all(|t| {
                        t.as_array().is_some_and(|a| {
                            a.len() == 1 && a[0]["name"] == "web" && a[0]["replicas"] == 3
                        })
                    })
                    .then_some(tables)
            });
    let pids: BTreeMap<&str, BTreeMap<String, u32>> =
        NODES.iter().map(|id| (*id, p.pids(id))).collect();
    let warnings = |id: &str| {
        p.cluster
            .agent_log(id)
            .matches("keeping every jail")
            .count()
    };
    let warned_before: BTreeMap<&str, usize> = NODES.iter().map(|id| (*id, warnings(id))).collect();

    p.net.cut(CP);
    let cut = Instant::now();
    // Every agent has seen a heartbeat fail (connect times out: the link is
    // a blackhole) and kept going.
    p.cluster.wait_for("every agent to notice", || {
        NODES
            .iter()
            .all(|id| warnings(id) > warned_before[id])
            .then_some(())
    });
    let noticed_after = cut.elapsed();
    p.cluster
        .wait_for("the control plane to see every node Dead", || {
            let nodes = p.nodes()?;
            nodes
                .iter()
                .all(|n| n.status == Liveness::Dead)
                .then_some(())
        });
    for id in NODES {
        assert_still_running(&p, id, &pids[id], "with the control plane cut off");
        assert_eq!(p.proxy(id), tables[id], "{id} keeps its last proxy table");
    }

    p.net.heal(CP);
    p.cluster.wait_for("3 ready replicas after the heal", || {
        let s = p.service("web")?;
        let nodes = p.nodes()?;
        (s.ready == 3 && nodes.iter().all(|n| n.status == Liveness::Alive)).then_some(())
    });
    p.cluster
        .wait_for("no replica held twice after the heal", || {
            let h = p.holders("web");
            (h.len() == 3 && duplicates(&h).is_empty()).then_some(())
        });
    eprintln!(
        "partition c: every agent noticed the lost control plane {:.1} s after the cut",
        noticed_after.as_secs_f64()
    );
}

/// What the watcher thread saw while a link flapped.
#[derive(Default)]
struct Seen {
    samples: usize,
    /// Names held by two nodes whose links never flapped (must stay empty).
    steady_duplicates: Vec<String>,
    /// Names held by the flapping node and another at once (allowed only
    /// after the control plane declared the flapping node Dead; fenced on
    /// heal).
    flapper_duplicates: usize,
}

#[test]
fn a_flapping_link_never_duplicates_a_replica_among_connected_nodes_and_converges() {
    let Some(p) = start("partition_d") else {
        return;
    };
    let flapper = "n1";
    p.deploy("web", false);
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let holders = holders_of(&p.cluster, "web");
                let mut seen = seen.lock().expect("not poisoned");
                seen.samples += 1;
                for (name, nodes) in duplicates(&holders) {
                    if nodes.iter().filter(|n| *n != flapper).count() > 1 {
                        seen.steady_duplicates.push(format!("{name} on {nodes:?}"));
                    } else {
                        seen.flapper_duplicates += 1;
                    }
                }
            }
        });
        // Faster than dead_after: down and up for 300 ms each, five times.
        for _ in 0..5 {
            p.net.cut(flapper);
            std::thread::sleep(Duration::from_millis(300));
            p.net.heal(flapper);
            std::thread::sleep(Duration::from_millis(300));
        }
        // Slower: down until the node is Dead and its replica runs
        // elsewhere, up until its stale copy is fenced, three times.
        for round in 0..3 {
            p.net.cut(flapper);
            p.cluster
                .wait_for(&format!("round {round}: the replica moved"), || {
                    let s = p.service("web")?;
                    (p.liveness(flapper) == Some(Liveness::Dead)
                        && placed_on(&s, flapper).is_empty()
                        && s.ready == 3)
                        .then_some(())
                });
            p.net.heal(flapper);
            p.cluster.wait_for(&format!("round {round}: fenced"), || {
                let h = holders_of(&p.cluster, "web");
                (p.liveness(flapper) == Some(Liveness::Alive) && duplicates(&h).is_empty())
                    .then_some(())
            });
        }
        stop.store(true, Ordering::Relaxed);
    });
    p.cluster.wait_for("3 ready replicas, each held once", || {
        let s = p.service("web")?;
        let h = p.holders("web");
        (s.ready == 3 && s.replicas.len() == 3 && h.len() == 3 && duplicates(&h).is_empty())
            .then_some(())
    });
    let seen = seen.lock().expect("not poisoned");
    assert!(seen.samples > 0);
    assert!(
        seen.steady_duplicates.is_empty(),
        "a replica ran twice on connected nodes: {:?}",
        seen.steady_duplicates
    );
    eprintln!(
        "partition d: {} samples, {} of a stale copy on {flapper} next to its replacement (before fencing), none among connected nodes",
        seen.samples, seen.flapper_duplicates
    );
}
