//! Persistent volumes end to end, with the real binaries on
//! loopback in simulate mode (`util::cluster`), where a volume is a
//! directory under the node's state dir and its mount a symlink in the
//! jail's root. Workloads append a line to a file in their volume every time
//! they start, so "the data survived" is read as "the file gained a line
//! instead of starting over".
//!
//! Covered: a jail's data survives jail delete + re-apply and an agent
//! `kill -9` + restart; a re-apply after the placement was deleted lands on
//! the node holding the volume (the volume registry), and fails with 503
//! naming node and volume while that node is Dead; `delete-volume` is refused
//! while mounted, then destroys the dataset and the registry entry; a
//! stateful service scaled 2 -> 1 -> 2 finds its old data, and a replica on
//! a killed node is neither replaced nor counted ready.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use keel::common::wire::{JailStatus, Phase, ServiceStatus, VolumeStatus};
use keel::ctl::output::NodeJail;

use crate::util::cluster::{Cluster, Run};

const DEADLINE: Duration = Duration::from_secs(20);

fn wait_for<T>(cluster: &Cluster, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "timed out waiting for {what}\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn ok(cluster: &Cluster, run: Run, what: &str) -> String {
    assert_eq!(run.code, 0, "{what}: {run:?}\n{}", cluster.logs());
    run.stdout
}

/// A jail whose workload appends `started` to `data/log` in volume `volume`
/// (mounted at /data), then sleeps.
fn db_jail(volume: &str) -> String {
    format!(
        "kind: Jail\nmetadata: {{name: db}}\nspec:\n  base: 14.2-RELEASE\n  \
         exec: {{start: [/bin/sh, -c, 'echo started >> data/log; exec sleep 300']}}\n  \
         volumes:\n    - {{name: {volume}, mountPath: /data, size: 1M}}\n"
    )
}

fn service(replicas: u32) -> String {
    format!(
        "kind: Service\nmetadata: {{name: kv}}\nspec:\n  replicas: {replicas}\n  port: 7000\n  \
         template:\n    base: 14.2-RELEASE\n    \
         exec: {{start: [/bin/sh, -c, 'echo $KEEL_JAIL_NAME >> data/log; exec sleep 300']}}\n    \
         volumes:\n      - {{name: data, mountPath: /data}}\n"
    )
}

/// The lines of `log` in volume `volume` on node `node` (its simulated
/// dataset directory).
fn log_lines(cluster: &Cluster, node: &str, volume: &str) -> Vec<String> {
    let file: PathBuf = cluster
        .state_dir(node)
        .join("volumes")
        .join(volume)
        .join("log");
    std::fs::read_to_string(file)
        .map(|t| t.lines().map(str::to_string).collect())
        .unwrap_or_default()
}

fn wait_lines(cluster: &Cluster, node: &str, volume: &str, n: usize) -> Vec<String> {
    wait_for(cluster, &format!("{n} lines in {volume} on {node}"), || {
        let lines = log_lines(cluster, node, volume);
        (lines.len() >= n).then_some(lines)
    })
}

fn volumes(cluster: &Cluster) -> Vec<VolumeStatus> {
    let out = ok(
        cluster,
        cluster.keelctl(&["get", "volumes", "-o", "json"]),
        "get volumes",
    );
    serde_json::from_str(&out).expect("get volumes -o json")
}

fn applied_node(out: &str) -> String {
    out.split_once(" applied on node ")
        .and_then(|(_, rest)| rest.split_once(' '))
        .map(|(node, _)| node.to_string())
        .unwrap_or_else(|| panic!("no node in {out:?}"))
}

#[test]
fn a_jail_s_volume_keeps_its_data_and_its_node_across_deletes_and_agent_crashes() {
    let mut cluster = Cluster::standard(2);
    // Named onto n2: a scheduled apply alone would pick n1 (equal headroom,
    // smallest id), so landing on n2 later is the registry's doing.
    let out = ok(
        &cluster,
        cluster.keelctl_with(
            &["--node", "n2", "apply", "-f", "-"],
            Some(&db_jail("pgdata")),
        ),
        "apply db on n2",
    );
    assert_eq!(applied_node(&out), "n2");
    assert_eq!(wait_lines(&cluster, "n2", "pgdata", 1), ["started"]);

    let listed = volumes(&cluster);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        (
            listed[0].name.as_str(),
            listed[0].node.as_deref(),
            listed[0].quota,
            listed[0].mounted_by.as_deref()
        ),
        ("pgdata", Some("n2"), Some(1 << 20), Some("db"))
    );
    let table = ok(&cluster, cluster.keelctl(&["get", "volumes"]), "table");
    assert!(table.starts_with("NAME"), "{table}");
    assert!(table.contains("MOUNTED BY"), "{table}");

    let refused = cluster.keelctl(&["delete-volume", "pgdata"]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused
            .stderr
            .contains("volume pgdata is mounted by jail db; delete that jail first"),
        "{refused:?}"
    );

    // Delete the jail (its placement goes), then re-apply it scheduled.
    ok(
        &cluster,
        cluster.keelctl(&["delete", "jail", "db"]),
        "delete db",
    );
    assert_eq!(
        log_lines(&cluster, "n2", "pgdata"),
        ["started"],
        "data kept"
    );
    let out = ok(
        &cluster,
        cluster.keelctl_with(&["apply", "-f", "-"], Some(&db_jail("pgdata"))),
        "re-apply db",
    );
    assert_eq!(applied_node(&out), "n2", "pinned to its volume's node");
    assert_eq!(
        wait_lines(&cluster, "n2", "pgdata", 2),
        ["started", "started"]
    );

    // kill -9 + restart of the agent: the jail keeps running, nothing is
    // recreated, the data is untouched.
    cluster.kill9_agent("n2");
    cluster.restart_agent("n2");
    let jail: JailStatus = wait_for(&cluster, "db reported Running after restart", || {
        let run = cluster.keelctl(&["get", "jail", "db", "-o", "json"]);
        (run.code == 0)
            .then(|| serde_json::from_str::<NodeJail>(&run.stdout).ok())
            .flatten()
            .map(|j| j.status)
            .filter(|s| s.state == Phase::Running)
    });
    assert_eq!(jail.restarts, 0);
    assert_eq!(log_lines(&cluster, "n2", "pgdata"), ["started", "started"]);

    // With its node Dead, the jail is not placed elsewhere with an empty volume.
    ok(
        &cluster,
        cluster.keelctl(&["delete", "jail", "db"]),
        "delete db again",
    );
    cluster.kill9_agent("n2");
    let refused = wait_for(&cluster, "an apply refused with 503", || {
        let run = cluster.keelctl_with(&["apply", "-f", "-"], Some(&db_jail("pgdata")));
        (run.code != 0 && run.stderr.contains("is Dead")).then_some(run)
    });
    assert!(
        refused.stderr.contains("node n2 holds volume pgdata"),
        "{refused:?}"
    );
    assert!(refused.stderr.contains("503"), "{refused:?}");
    assert!(log_lines(&cluster, "n1", "pgdata").is_empty());

    // Back up: delete-volume destroys the dataset, then the registry entry.
    cluster.restart_agent("n2");
    wait_for(&cluster, "delete-volume through n2", || {
        let run = cluster.keelctl(&["delete-volume", "pgdata"]);
        (run.code == 0).then_some(run)
    });
    assert!(
        !cluster
            .state_dir("n2")
            .join("volumes")
            .join("pgdata")
            .exists(),
        "dataset destroyed"
    );
    assert!(volumes(&cluster).is_empty(), "registry entry removed");
    let gone = cluster.keelctl(&["delete-volume", "pgdata"]);
    assert_eq!(gone.code, 1);
    assert!(gone.stderr.contains("no volume named pgdata"), "{gone:?}");
}

fn kv(cluster: &Cluster) -> ServiceStatus {
    let out = ok(
        cluster,
        cluster.keelctl(&["get", "service", "kv", "-o", "json"]),
        "get service kv",
    );
    serde_json::from_str(&out).expect("service json")
}

fn node_of(status: &ServiceStatus, replica: &str) -> String {
    status
        .replicas
        .iter()
        .find(|r| r.name == replica)
        .map(|r| r.node.clone())
        .unwrap_or_else(|| panic!("{replica} not placed: {status:?}"))
}

#[test]
fn a_stateful_service_finds_its_data_after_scaling_and_waits_for_a_dead_node() {
    let mut cluster = Cluster::standard(2);
    let apply = |cluster: &Cluster, replicas: u32| {
        ok(
            cluster,
            cluster.keelctl_with(&["apply", "-f", "-"], Some(&service(replicas))),
            "apply kv",
        )
    };
    apply(&cluster, 2);
    let status = kv(&cluster);
    assert!(status.stateful);
    let node0 = node_of(&status, "kv-0");
    let node1 = node_of(&status, "kv-1");
    assert_ne!(node0, node1, "spread");
    assert_eq!(wait_lines(&cluster, &node1, "kv-1-data", 1), ["kv-1"]);

    apply(&cluster, 1);
    wait_for(&cluster, "kv-1 removed", || {
        kv(&cluster)
            .replicas
            .iter()
            .all(|r| r.name != "kv-1")
            .then_some(())
    });
    assert_eq!(log_lines(&cluster, &node1, "kv-1-data"), ["kv-1"], "kept");

    apply(&cluster, 2);
    assert_eq!(node_of(&kv(&cluster), "kv-1"), node1, "back to its data");
    assert_eq!(
        wait_lines(&cluster, &node1, "kv-1-data", 2),
        ["kv-1", "kv-1"]
    );

    // kv-1's node dies: kv-1 stays placed there, not ready, and is not
    // replaced on the other node.
    cluster.kill9_agent(&node1);
    wait_for(&cluster, "kv-1 NodeDead", || {
        let s = kv(&cluster);
        s.replicas
            .iter()
            .any(|r| r.name == "kv-1" && r.state == "NodeDead" && !r.ready)
            .then_some(())
    });
    // A re-apply plans the heal before answering: the barrier after which a
    // replacement would show.
    apply(&cluster, 2);
    let s = kv(&cluster);
    assert_eq!(node_of(&s, "kv-1"), node1, "{s:?}");
    assert_eq!((s.desired, s.ready), (2, 1), "{s:?}");
    assert_eq!(s.replicas.len(), 2, "{s:?}");
    assert!(
        log_lines(&cluster, &node0, "kv-1-data").is_empty(),
        "no empty kv-1 volume on {node0}"
    );
}
