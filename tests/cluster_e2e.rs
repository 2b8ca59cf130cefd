//! A simulated cluster end to end, with the real binaries on loopback: one
//! keel-controlplane and three keel-agentd --simulate (`util::cluster`),
//! driven only through keelctl and observed through what the agents leave on
//! disk (their simulated network table). Heartbeats every 200 ms and
//! `dead_after` 1 s keep it quick; every wait polls a condition with a
//! deadline.
//!
//! Also runs the README's "A simulated cluster on one machine" word for word.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use keel::common::cidr::Ipv4Net;
use keel::common::wire::{Liveness, NodeStatus};
use keel::controlplane::scheduler::{Candidate, pick_node};

use crate::util::cluster::{Cluster, Run, free_port};

fn ok(cluster: &Cluster, run: Run, what: &str) -> String {
    assert_eq!(run.code, 0, "{what}: {run:?}\n{}", cluster.logs());
    run.stdout
}

/// `keelctl get nodes -o json`, by node id.
fn nodes(cluster: &Cluster) -> BTreeMap<String, NodeStatus> {
    let out = ok(
        cluster,
        cluster.keelctl(&["get", "nodes", "-o", "json"]),
        "get nodes",
    );
    let list: Vec<NodeStatus> = serde_json::from_str(&out).expect("get nodes -o json");
    list.into_iter().map(|n| (n.node_id.clone(), n)).collect()
}

fn wait_status(cluster: &Cluster, ids: &[&str], status: Liveness) -> BTreeMap<String, NodeStatus> {
    cluster.wait_for(&format!("{ids:?} {status}"), || {
        let nodes = nodes(cluster);
        ids.iter()
            .all(|id| nodes.get(*id).is_some_and(|n| n.status == status))
            .then_some(nodes)
    })
}

fn jail(name: &str, cpu: f64) -> String {
    format!(
        "kind: Jail\nmetadata: {{name: {name}}}\nspec:\n  base: 14.2-RELEASE\n  \
         resources: {{cpu: {cpu}}}\n  exec: {{start: [/bin/sleep, '300']}}\n"
    )
}

/// `keelctl apply -f -`: the node and the address of the applied line
/// `jail/NAME applied on node N (STATE, ADDR)`.
fn apply(cluster: &Cluster, spec: &str) -> (String, Ipv4Addr) {
    let out = ok(
        cluster,
        cluster.keelctl_with(&["apply", "-f", "-"], Some(spec)),
        "apply",
    );
    let rest = out
        .split_once(" applied on node ")
        .unwrap_or_else(|| panic!("no node in {out:?}"))
        .1;
    let (node, rest) = rest.split_once(" (").expect("node then (state, address)");
    let addr = rest
        .split_once(", ")
        .and_then(|(_, a)| a.split_once(')'))
        .expect("(state, address)")
        .0;
    (node.to_string(), addr.parse().expect("an IPv4 address"))
}

fn candidates(nodes: &BTreeMap<String, NodeStatus>) -> Vec<Candidate<'_>> {
    nodes
        .values()
        .filter(|n| n.status == Liveness::Alive)
        .map(|n| Candidate {
            node_id: &n.node_id,
            capacity: n.capacity,
            committed: n.committed,
            jails: n.jails,
        })
        .collect()
}

fn pod_cidr(node: &NodeStatus) -> Ipv4Net {
    node.pod_cidr.parse().expect("pod_cidr is a CIDR")
}

/// The routes of node `id`'s simulated network table, destination to gateway.
fn routes(cluster: &Cluster, id: &str) -> BTreeMap<String, String> {
    let file = cluster.state_dir(id).join("sim").join("sim-net.json");
    let Ok(text) = std::fs::read_to_string(&file) else {
        return BTreeMap::new();
    };
    let value: serde_json::Value = serde_json::from_str(&text).expect("sim-net.json is JSON");
    value["routes"]
        .as_object()
        .map(|r| {
            r.iter()
                .map(|(dst, gw)| (dst.clone(), gw.as_str().unwrap_or_default().to_string()))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until every Alive node's table routes exactly the other Alive
/// nodes' pod_cidrs via their advertise addresses.
fn wait_routes(cluster: &Cluster, nodes: &BTreeMap<String, NodeStatus>) {
    let alive: Vec<&NodeStatus> = nodes
        .values()
        .filter(|n| n.status == Liveness::Alive)
        .collect();
    for me in &alive {
        let want: BTreeMap<String, String> = alive
            .iter()
            .filter(|peer| peer.node_id != me.node_id)
            .map(|peer| (peer.pod_cidr.clone(), peer.address.ip().to_string()))
            .collect();
        cluster.wait_for(&format!("{}'s routes {want:?}", me.node_id), || {
            (routes(cluster, &me.node_id) == want).then_some(())
        });
    }
}

/// Six cluster scenarios as one story on one cluster: registration and
/// subnets, spreading by headroom, sticky re-apply, routes, a node's death,
/// and a control plane restart.
#[test]
fn a_three_node_simulated_cluster_schedules_routes_fails_over_nothing_and_survives_a_restart() {
    let mut cluster = Cluster::standard(3);

    // 1. Every node registers and is Alive, with distinct pod CIDRs inside
    // the simulated cluster range.
    let before = wait_status(&cluster, &["n1", "n2", "n3"], Liveness::Alive);
    assert_eq!(before.len(), 3, "{before:?}");
    let cluster_cidr: Ipv4Net = "127.64.0.0/10".parse().expect("cidr");
    let cidrs: Vec<Ipv4Net> = before.values().map(pod_cidr).collect();
    for (i, c) in cidrs.iter().enumerate() {
        assert!(
            cluster_cidr.contains(c.network()),
            "{c} outside {cluster_cidr}"
        );
        assert_eq!(c.prefix_len(), 24);
        assert!(cidrs[i + 1..].iter().all(|o| !o.overlaps(c)), "{cidrs:?}");
    }

    // 6. Each node routes the other two nodes' subnets via their addresses.
    wait_routes(&cluster, &before);

    // 2. Applies spread by headroom, one at a time, each after the previous
    // node's heartbeat reported what it committed; pick_node predicts each.
    let mut placed: BTreeMap<String, String> = BTreeMap::new();
    for (name, cpu) in [("j1", 0.5), ("j2", 0.5), ("j3", 0.5), ("j4", 0.25)] {
        let now = nodes(&cluster);
        let predicted = pick_node(&candidates(&now))
            .expect("a candidate")
            .to_string();
        let (node, addr) = apply(&cluster, &jail(name, cpu));
        assert_eq!(node, predicted, "{name}: pick_node over {now:?}");
        // Jails take addresses from their own node's subnet.
        assert!(
            pod_cidr(&now[&node]).contains(addr),
            "{name} at {addr} outside {node}'s {}",
            now[&node].pod_cidr
        );
        let want = now[&node].committed.cpu + cpu;
        cluster.wait_for(&format!("{node} to commit {want} cpu"), || {
            let n = &nodes(&cluster)[&node];
            ((n.committed.cpu - want).abs() < 1e-9).then_some(())
        });
        placed.insert(name.to_string(), node);
    }
    // Equal nodes: the first three land on three different nodes, in id order.
    assert_eq!(
        ["j1", "j2", "j3"].map(|j| placed[j].as_str()),
        ["n1", "n2", "n3"],
        "{placed:?}"
    );

    // 3. A re-apply sticks to the jail's node, though the scheduler would now
    // pick another.
    let now = nodes(&cluster);
    let fresh = pick_node(&candidates(&now)).expect("a candidate");
    assert_ne!(
        fresh, placed["j1"],
        "the test needs j1's node not to be the pick"
    );
    assert_eq!(apply(&cluster, &jail("j1", 0.5)).0, placed["j1"]);

    // The merged list shows every jail on its node. It lists the nodes that
    // are Alive when asked; on a loaded machine a node can miss its
    // dead_after for a moment, so the list is polled until it is whole.
    cluster.wait_for("get jails to list every jail on its node", || {
        let out = ok(
            &cluster,
            cluster.keelctl(&["get", "jails", "-o", "json"]),
            "get jails",
        );
        let listed: Vec<serde_json::Value> = serde_json::from_str(&out).expect("json");
        let seen: BTreeMap<String, String> = listed
            .iter()
            .map(|j| {
                let name = j["name"].as_str().expect("name").to_string();
                (name, j["node"].as_str().expect("node").to_string())
            })
            .collect();
        (seen == placed).then_some(())
    });

    // 4. kill -9 of n3: Dead after dead_after; its jail answers 503 through
    // keelctl for GET and PUT, naming the node; nothing is rescheduled.
    let victim = placed["j3"].clone();
    cluster.kill9_agent(&victim);
    let after = wait_status(&cluster, &[&victim], Liveness::Dead);
    for args in [
        vec!["get", "jails", "j3"],
        vec!["--node", &victim, "get", "jails", "j3"],
    ] {
        let run = cluster.keelctl(&args);
        assert_eq!(run.code, 1, "{args:?}: {run:?}");
        assert!(
            run.stderr.contains(&format!("node {victim} is Dead")) && run.stderr.contains("503"),
            "{args:?}: {}",
            run.stderr
        );
    }
    let run = cluster.keelctl_with(&["apply", "-f", "-"], Some(&jail("j3", 0.5)));
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr.starts_with(&format!(
            "keelctl: apply jail/j3 failed: node {victim} is Dead"
        )),
        "{}",
        run.stderr
    );
    // The list is partial, and says so: the other nodes' jails, the dead
    // node named on stderr, exit 1.
    let run = cluster.keelctl(&["get", "jails"]);
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr.starts_with(&format!(
            "keelctl: get jails is incomplete: node {victim} is Dead"
        )),
        "{}",
        run.stderr
    );
    assert!(
        !run.stdout.lines().any(|l| l.starts_with("j3 ")),
        "j3 was not moved to a live node: {}",
        run.stdout
    );
    for (name, node) in placed.iter().filter(|(_, node)| **node != victim) {
        assert!(
            run.stdout.lines().any(|l| l
                .split_whitespace()
                .take(2)
                .eq([name.as_str(), node.as_str()])),
            "{name} on {node} is listed: {}",
            run.stdout
        );
    }
    for survivor in after.keys().filter(|id| **id != victim) {
        let run = cluster.keelctl(&["--node", survivor, "get", "jails", "j3"]);
        assert_eq!(run.code, 1, "{survivor}: {run:?}");
        assert!(
            run.stderr.contains("HTTP 404"),
            "{survivor}: {}",
            run.stderr
        );
    }

    // 6. The dead node's route is withdrawn on the others.
    wait_routes(&cluster, &after);

    // 5. kill -9 of the control plane and a restart: every placement resolves
    // to the same node, no pod_cidr changes, and the dead node's jail still
    // answers 503.
    cluster.kill9_controlplane();
    cluster.restart_controlplane();
    let alive: Vec<&str> = after
        .keys()
        .filter(|id| **id != victim)
        .map(String::as_str)
        .collect();
    wait_status(&cluster, &alive, Liveness::Alive);
    // The victim is Unknown after the restart, and Dead once this control
    // plane has itself seen it stay silent for dead_after.
    let restarted = wait_status(&cluster, &[&victim], Liveness::Dead);
    for (id, node) in &before {
        assert_eq!(restarted[id].pod_cidr, node.pod_cidr, "{id}'s pod_cidr");
        assert_eq!(restarted[id].address, node.address, "{id}'s address");
    }
    for (name, node) in &placed {
        if *node == victim {
            let run = cluster.keelctl(&["get", "jails", name]);
            assert_eq!(run.code, 1, "{run:?}");
            assert!(
                run.stderr.contains(&format!("node {victim} is Dead")),
                "{run:?}"
            );
        } else {
            let cpu = if name == "j4" { 0.25 } else { 0.5 };
            assert_eq!(&apply(&cluster, &jail(name, cpu)).0, node, "{name}");
        }
    }
}

/// Scenario 7: a well-formed operator key the control plane does not list is
/// refused with its 401 message, and nothing is placed.
/// `keelctl logs` through the control plane: the scheduled route finds the
/// jail's node, `--node` names it; both relay the agent's answer.
#[test]
fn logs_come_through_the_control_plane() {
    let cluster = Cluster::standard(2);
    wait_status(&cluster, &["n1", "n2"], Liveness::Alive);
    let spec = "kind: Jail\nmetadata: {name: talker}\nspec:\n  base: 14.2-RELEASE\n  \
                exec: {start: [/bin/sh, -c, 'echo hello from the jail; exec sleep 300']}\n";
    let (node, _) = apply(&cluster, spec);
    let out = cluster.wait_for("the workload's output", || {
        let run = cluster.keelctl(&["logs", "talker"]);
        (run.code == 0 && run.stdout.contains("hello from the jail")).then_some(run.stdout)
    });
    assert!(out.ends_with("hello from the jail\n"), "{out:?}");
    let named = ok(
        &cluster,
        cluster.keelctl(&["--node", &node, "logs", "talker", "--tail", "1"]),
        "logs --node",
    );
    assert_eq!(named, "hello from the jail\n");
    let unknown = cluster.keelctl(&["logs", "nobody"]);
    assert_eq!(unknown.code, 1, "{unknown:?}");
}

/// `keelctl cordon`: the scheduler places nothing new on the node (what runs
/// there stays), `get nodes` says so, and `uncordon` lifts it.
#[test]
fn a_cordoned_node_gets_no_new_jails_until_uncordoned() {
    let cluster = Cluster::standard(2);
    wait_status(&cluster, &["n1", "n2"], Liveness::Alive);
    let (first, _) = apply(&cluster, &jail("first", 0.1));
    assert_eq!(first, "n1", "equal headroom: the smallest id");

    assert_eq!(
        ok(&cluster, cluster.keelctl(&["cordon", "n1"]), "cordon"),
        "node/n1 cordoned\n"
    );
    let table = ok(&cluster, cluster.keelctl(&["get", "nodes"]), "get nodes");
    assert!(table.contains("Alive,Cordoned"), "{table}");
    assert!(nodes(&cluster)["n1"].cordoned);
    // One node, by name: its row only, or its object.
    let one = ok(
        &cluster,
        cluster.keelctl(&["get", "node", "n1"]),
        "get node n1",
    );
    let rows: Vec<&str> = one.lines().skip(1).collect();
    assert_eq!(rows.len(), 1, "{one}");
    assert!(
        rows[0].starts_with("n1 ") && rows[0].contains("Alive,Cordoned"),
        "{one}"
    );
    let json = ok(
        &cluster,
        cluster.keelctl(&["get", "node", "n2", "-o", "json"]),
        "get node n2 -o json",
    );
    let n2: NodeStatus = serde_json::from_str(&json).expect("one node as JSON");
    assert_eq!((n2.node_id.as_str(), n2.cordoned), ("n2", false));
    let missing = cluster.keelctl(&["get", "node", "n9"]);
    assert_eq!(
        (missing.code, missing.stdout.as_str()),
        (1, ""),
        "{missing:?}"
    );
    assert!(
        missing
            .stderr
            .starts_with("keelctl: get node/n9 failed: no node named n9\n"),
        "{missing:?}"
    );
    assert!(missing.stderr.contains("HTTP 404"), "{missing:?}");
    for name in ["second", "third"] {
        let (node, _) = apply(&cluster, &jail(name, 0.1));
        assert_eq!(node, "n2", "{name} must avoid the cordoned n1");
    }
    let jails = ok(&cluster, cluster.keelctl(&["get", "jails"]), "get jails");
    assert!(jails.contains("first"), "what runs on n1 stays: {jails}");

    assert_eq!(
        ok(&cluster, cluster.keelctl(&["uncordon", "n1"]), "uncordon"),
        "node/n1 uncordoned\n"
    );
    assert!(!nodes(&cluster)["n1"].cordoned);
    let unknown = cluster.keelctl(&["cordon", "n9"]);
    assert_eq!(unknown.code, 1, "{unknown:?}");
    assert!(unknown.stderr.contains("no node named n9"), "{unknown:?}");
}

/// A jail on whichever node `--node` names, with a 1M volume `NAME-data`.
fn jail_with_volume(name: &str) -> String {
    format!(
        "kind: Jail\nmetadata: {{name: {name}}}\nspec:\n  base: 14.2-RELEASE\n  \
         exec: {{start: [/bin/sleep, '300']}}\n  \
         volumes:\n    - {{name: {name}-data, mountPath: /data, size: 1M}}\n"
    )
}

/// `(name, node)` of every object in a `-o json` listing.
fn listed(stdout: &str) -> Vec<(String, String)> {
    let list: Vec<serde_json::Value> = serde_json::from_str(stdout).expect("a JSON list");
    list.iter()
        .map(|o| {
            let field = |f: &str| o[f].as_str().unwrap_or_default().to_string();
            (field("name"), field("node"))
        })
        .collect()
}

/// `here{suffix}` on n1 and `there{suffix}` on n2, as [`listed`] gives them.
fn both(suffix: &str) -> Vec<(String, String)> {
    vec![
        (format!("here{suffix}"), "n1".to_string()),
        (format!("there{suffix}"), "n2".to_string()),
    ]
}

/// Waits until `get RESOURCE -o json` lists [`both`] and exits 0 quietly.
fn wait_whole(cluster: &Cluster, resource: &str, suffix: &str) {
    cluster.wait_for(&format!("get {resource} to list both nodes'"), || {
        let run = cluster.keelctl(&["get", resource, "-o", "json"]);
        (run.code == 0 && run.stderr.is_empty() && listed(&run.stdout) == both(suffix))
            .then_some(())
    });
}

/// Listings through the control plane never pass a partial answer off as
/// the whole: with n2's agent killed and Dead, `get jails` (table and
/// JSON), `get volumes` and `get ingresses` print what n1 holds in their
/// usual format, name n2 and why on stderr, and exit 1 (`--node n2` too);
/// once n2 is back the same commands list everything and exit 0.
#[test]
fn a_listing_with_a_dead_node_prints_the_rest_names_the_node_and_exits_1_until_it_is_back() {
    let mut cluster = Cluster::standard(2);
    wait_status(&cluster, &["n1", "n2"], Liveness::Alive);
    for (node, name) in [("n1", "here"), ("n2", "there")] {
        ok(
            &cluster,
            cluster.keelctl_with(
                &["--node", node, "apply", "-f", "-"],
                Some(&jail_with_volume(name)),
            ),
            "apply",
        );
    }
    wait_whole(&cluster, "jails", "");
    wait_whole(&cluster, "volumes", "-data");

    cluster.kill9_agent("n2");
    wait_status(&cluster, &["n2"], Liveness::Dead);

    let table = cluster.keelctl(&["get", "jails"]);
    assert_eq!(table.code, 1, "{table:?}");
    let rows: Vec<&str> = table.stdout.lines().collect();
    assert_eq!(rows.len(), 2, "a header and n1's jail: {table:?}");
    assert!(rows[0].starts_with("NAME"), "{table:?}");
    assert!(
        rows[1].split_whitespace().take(2).eq(["here", "n1"]),
        "{table:?}"
    );
    assert!(
        table
            .stderr
            .starts_with("keelctl: get jails is incomplete: node n2 is Dead (last heartbeat "),
        "{table:?}"
    );
    assert!(
        table
            .stderr
            .contains("`keelctl get nodes` shows when the node is Alive again"),
        "{table:?}"
    );

    let json = cluster.keelctl(&["get", "jails", "-o", "json"]);
    assert_eq!(json.code, 1, "{json:?}");
    assert_eq!(
        listed(&json.stdout),
        [("here".to_string(), "n1".to_string())]
    );
    assert!(json.stderr.contains("node n2 is Dead"), "{json:?}");

    let named = cluster.keelctl(&["--node", "n2", "get", "jails"]);
    assert_eq!((named.code, named.stdout.as_str()), (1, ""), "{named:?}");
    assert!(named.stderr.contains("node n2 is Dead"), "{named:?}");
    assert!(!named.stderr.contains("No jails found"), "{named:?}");

    // Volumes: n1's as usual, n2's as the registry knows them (unknown
    // size), and the node named.
    let volumes = cluster.keelctl(&["get", "volumes", "-o", "json"]);
    assert_eq!(volumes.code, 1, "{volumes:?}");
    assert_eq!(listed(&volumes.stdout), both("-data"));
    assert!(
        volumes
            .stderr
            .starts_with("keelctl: get volumes is incomplete: node n2 could not be asked ("),
        "{volumes:?}"
    );

    let ingresses = cluster.keelctl(&["get", "ingresses"]);
    assert_eq!(
        (ingresses.code, ingresses.stdout.as_str()),
        (1, ""),
        "{ingresses:?}"
    );
    assert!(
        ingresses
            .stderr
            .starts_with("keelctl: get ingresses is incomplete: node n2 is Dead"),
        "{ingresses:?}"
    );

    cluster.restart_agent("n2");
    wait_status(&cluster, &["n2"], Liveness::Alive);
    wait_whole(&cluster, "jails", "");
    wait_whole(&cluster, "volumes", "-data");
    let table = ok(&cluster, cluster.keelctl(&["get", "jails"]), "get jails");
    assert_eq!(table.lines().count(), 3, "{table}");
    let ingresses = cluster.keelctl(&["get", "ingresses"]);
    assert_eq!(
        (ingresses.code, ingresses.stderr.as_str()),
        (0, "No ingresses found.\n"),
        "{ingresses:?}"
    );
}

/// A host that is gone for good: `keelctl delete node` refuses while it is
/// Alive, and once it is Dead forgets it with what was placed on it, so its
/// jails no longer answer 503 and the node list is whole again.
#[test]
fn a_dead_node_is_deleted_with_keelctl_and_its_jails_forgotten() {
    let mut cluster = Cluster::standard(2);
    wait_status(&cluster, &["n1", "n2"], Liveness::Alive);
    ok(
        &cluster,
        cluster.keelctl_with(
            &["--node", "n2", "apply", "-f", "-"],
            Some(&jail("lost", 0.1)),
        ),
        "apply on n2",
    );

    let refused = cluster.keelctl(&["delete", "node", "n2"]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(refused.stderr.contains("node n2 is Alive"), "{refused:?}");

    cluster.kill9_node("n2");
    wait_status(&cluster, &["n2"], Liveness::Dead);
    let deleted = ok(
        &cluster,
        cluster.keelctl(&["delete", "node", "n2"]),
        "delete node",
    );
    assert_eq!(
        deleted,
        "node/n2 deleted (forgot jails: lost; volumes: none)\n"
    );
    assert_eq!(nodes(&cluster).keys().collect::<Vec<_>>(), ["n1"]);
    let jails = cluster.keelctl(&["get", "jails"]);
    assert_eq!(jails.code, 0, "{jails:?}");
    assert!(!jails.stdout.contains("lost"), "{jails:?}");
    assert!(
        !jails.stderr.contains("n2"),
        "no Dead node to mention: {jails:?}"
    );
    let again = cluster.keelctl(&["delete", "node", "n2"]);
    assert_eq!(again.code, 1, "{again:?}");
    assert!(again.stderr.contains("no node named n2"), "{again:?}");
}

#[test]
fn keelctl_with_an_unknown_operator_key_exits_1_with_the_401_message() {
    let cluster = Cluster::standard(1);
    wait_status(&cluster, &["n1"], Liveness::Alive);
    let key = cluster.dir().join("intruder.key");
    let key = key.to_str().expect("utf-8");
    let run = cluster.keelctl_raw(&["key", "generate", "--id", "intruder", key], &[], None);
    assert_eq!(run.code, 0, "{run:?}");
    let addr = cluster.controlplane_addr().to_string();
    let env = [("KEEL_CONTROLPLANE", addr.as_str())];
    for (args, stdin) in [
        (vec!["--key-file", key, "get", "nodes"], None),
        (
            vec!["--key-file", key, "apply", "-f", "-"],
            Some(jail("j1", 0.5)),
        ),
    ] {
        let run = cluster.keelctl_raw(&args, &env, stdin.as_deref());
        assert_eq!(run.code, 1, "{args:?}: {run:?}");
        assert!(
            run.stderr.contains("unknown key id \"intruder\""),
            "{args:?}: {}",
            run.stderr
        );
        assert!(run.stderr.contains("HTTP 401"), "{}", run.stderr);
        assert!(run.stdout.is_empty(), "{run:?}");
    }
    // The real operator key still works, and saw nothing placed.
    let run = cluster.keelctl(&["get", "jails"]);
    assert_eq!((run.code, run.stdout.as_str()), (0, ""), "{run:?}");
    assert_eq!(run.stderr, "No jails found.\n");
}

/// The README's "A simulated cluster on one machine": its commands in order,
/// as written, in a fresh directory. `$PWD` is that directory; each port
/// the README names is swapped for a free one (tests run in parallel);
/// `curl` is a plain HTTP GET.
#[test]
fn the_readme_simulated_cluster_works_word_for_word() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!(
            "skipped: examples/sim-web.yaml serves HTTP with python3, which is not installed"
        );
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("A simulated cluster on one machine"))
        .expect("README has a simulated cluster section");
    let mut cluster = Cluster::new();
    let dir = cluster.dir().display().to_string();
    // Ports in the README, each to a free one.
    let mut ports: BTreeMap<String, String> = BTreeMap::new();
    for word in section.split(|c: char| c.is_whitespace() || c == '`') {
        if let Some((_, port)) = word.rsplit_once("127.0.0.1:") {
            if !ports.contains_key(port) && port.parse::<u16>().is_ok() {
                let free = free_port(Ipv4Addr::LOCALHOST).to_string();
                ports.insert(port.to_string(), free);
            }
        }
    }
    let localize = |line: &str| {
        let mut line = line.replace("$PWD", &dir);
        for (from, to) in &ports {
            line = line.replace(&format!("127.0.0.1:{from}"), &format!("127.0.0.1:{to}"));
        }
        line
    };
    let commands: Vec<String> = section
        .split("```sh\n")
        .skip(1)
        .filter_map(|block| block.split("```").next())
        .flat_map(str::lines)
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(localize)
        .collect();

    let examples = cluster.dir().join("examples");
    std::fs::create_dir(&examples).expect("mkdir examples");
    for entry in std::fs::read_dir(root.join("examples")).expect("examples/") {
        let entry = entry.expect("dir entry");
        std::fs::copy(entry.path(), examples.join(entry.file_name())).expect("copy example");
    }

    let mut env: Vec<(String, String)> = Vec::new();
    let mut outputs: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut fetched = false;
    for line in &commands {
        assert!(
            !line.contains(['"', '\'', '|', ';', '&']),
            "this test runs simple commands only; teach it: {line}"
        );
        let args =
            |rest: &str| -> Vec<String> { rest.split_whitespace().map(str::to_string).collect() };
        if let Some(rest) = line.strip_prefix("cargo run --release --bin keel-controlplane -- ") {
            let args = args(rest);
            cluster.start_controlplane(&args.iter().map(String::as_str).collect::<Vec<_>>());
        } else if let Some(rest) = line.strip_prefix("cargo run --release --bin keel-agentd -- ") {
            let args = args(rest);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let id = args
                .iter()
                .position(|a| *a == "--node-id")
                .and_then(|i| args.get(i + 1))
                .expect("each agent names its node");
            cluster.start_agent(id, &args);
        } else if let Some(assignment) = line.strip_prefix("export ") {
            let (name, value) = assignment.split_once('=').expect("NAME=VALUE");
            env.push((name.to_string(), value.to_string()));
        } else if let Some(rest) = line.strip_prefix("cargo run --release --bin keelctl -- ") {
            let args = args(rest);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let env: Vec<(&str, &str)> =
                env.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
            // The README lists the nodes first: they may still be registering.
            let run = if args.ends_with(&["get", "nodes"]) {
                cluster.wait_for("three Alive nodes", || {
                    let run = cluster.keelctl_raw(&args, &env, None);
                    (run.code == 0 && run.stdout.matches(" Alive ").count() == 3).then_some(run)
                })
            } else {
                cluster.keelctl_raw(&args, &env, None)
            };
            assert_eq!(run.code, 0, "{line}: {run:?}\n{}", cluster.logs());
            // Outputs by command, without the leading `--flag VALUE` pairs.
            let mut command: &[&str] = &args;
            while command.first().is_some_and(|a| a.starts_with("--")) {
                command = &command[2..];
            }
            let key = command.join(" ");
            outputs.entry(key).or_default().push(run.stdout);
        } else if let Some(url) = line.strip_prefix("curl ") {
            assert!(!http_get(&cluster, url).is_empty(), "{url} answered");
            fetched = true;
        } else {
            panic!("a cluster command this test does not know: {line}");
        }
    }
    assert!(
        fetched,
        "the README fetches the jail's and the service's pages"
    );
    let applied = &outputs["apply -f examples/sim-web.yaml"][0];
    assert!(
        applied.starts_with("jail/sim-web applied on node n1 (Starting, "),
        "{applied}"
    );
    let table = &outputs["get jails"][0];
    assert!(
        table
            .lines()
            .nth(1)
            .is_some_and(|r| r.starts_with("sim-web ")
                && r.contains(" n1 ")
                && (r.contains("Running") || r.contains("Starting"))),
        "{table}"
    );
    assert_eq!(outputs["delete jail sim-web"], ["jail/sim-web deleted\n"]);
    let services = &outputs["get services"][0];
    assert!(
        services
            .lines()
            .nth(1)
            .is_some_and(|r| r.starts_with("hello ") && r.contains("127.128.203.234:8080")),
        "the VIP the README names: {services}"
    );
    assert!(
        outputs["rollout status service hello"][0].contains("successfully rolled out"),
        "{outputs:?}"
    );
    assert_eq!(outputs["delete service hello"], ["service/hello deleted\n"]);
}

/// `GET url` (`http://IP:PORT/...`), retried until the workload listens;
/// returns the body of a 200.
fn http_get(cluster: &Cluster, url: &str) -> String {
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (authority, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(a, p)| (a, format!("/{p}")));
    let addr: SocketAddr = authority.parse().expect("IP:PORT");
    cluster.wait_for(url, || {
        let mut stream = TcpStream::connect(addr).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: {authority}\r\n\r\n").ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let (head, body) = response.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.0 200").then(|| body.to_string())
    })
}
