//! Nothing slow stands in front of liveness: a host command that takes
//! longer than three leases (a simulated `zfs clone` stalled for 7 s, with
//! the cluster's `dead_after` at 2 s) keeps its node Alive, because the agent
//! heartbeats from the snapshot its worker publishes instead of queueing
//! behind the worker, and the control plane relays the stalled apply on a
//! handler thread, so neither that node's heartbeats nor its neighbour's wait
//! behind the forward. The apply still finishes and its jail runs.

use std::collections::BTreeMap;

use keel::common::faults;
use keel::common::wire::{Liveness, NodeStatus};

use crate::util::cluster::Cluster;

/// Longer than three times the standard cluster's `dead_after` of 2 s.
const STALLED_CLONE: &str = "sim.zfs.clone=sleep:7s";

const JAIL: &str = "kind: Jail\nmetadata: {name: slow}\nspec:\n  base: 14.2-RELEASE\n  \
                    exec: {start: [/bin/sleep, '300']}\n";

/// Every node's liveness from `keelctl get nodes -o json`.
fn liveness(cluster: &Cluster) -> BTreeMap<String, Liveness> {
    let run = cluster.keelctl(&["get", "nodes", "-o", "json"]);
    assert_eq!(run.code, 0, "get nodes: {run:?}\n{}", cluster.logs());
    let nodes: Vec<NodeStatus> = serde_json::from_str(&run.stdout).expect("get nodes -o json");
    nodes.into_iter().map(|n| (n.node_id, n.status)).collect()
}

fn all_alive(nodes: &BTreeMap<String, Liveness>) -> bool {
    ["n1", "n2"]
        .iter()
        .all(|id| nodes.get(*id) == Some(&Liveness::Alive))
}

#[test]
fn a_stalled_zfs_clone_leaves_its_node_and_its_neighbour_alive() {
    let mut cluster = Cluster::standard(0);
    cluster.start_standard_agent_with_env(1, &[(faults::ENV, STALLED_CLONE)]);
    cluster.start_standard_agent(2);
    cluster.wait_for("n1 and n2 Alive", || {
        all_alive(&liveness(&cluster)).then_some(())
    });

    let (applied, observed_during_stall) = std::thread::scope(|scope| {
        let apply =
            scope.spawn(|| cluster.keelctl_with(&["--node", "n1", "apply", "-f", "-"], Some(JAIL)));
        let mut observed_during_stall = 0usize;
        // Until the apply returns, every single observation must be Alive.
        cluster.wait_for("the stalled apply to return", || {
            let stalled = cluster
                .agent_log("n1")
                .contains("fault injected at sim.zfs.clone");
            let nodes = liveness(&cluster);
            assert!(
                all_alive(&nodes),
                "a node left Alive while n1's zfs clone stalled: {nodes:?}\n{}",
                cluster.logs()
            );
            observed_during_stall += usize::from(stalled);
            apply.is_finished().then_some(())
        });
        (
            apply.join().expect("the apply thread"),
            observed_during_stall,
        )
    });
    assert_eq!(applied.code, 0, "apply: {applied:?}\n{}", cluster.logs());
    assert!(applied.stdout.contains("applied on node n1"), "{applied:?}");
    eprintln!(
        "heartbeat path: {observed_during_stall} looks at the nodes while n1's clone stalled, every one Alive"
    );
    assert!(
        observed_during_stall > 0,
        "the liveness was never read while the clone stalled; the fault did not fire?\n{}",
        cluster.logs()
    );

    cluster.wait_for("jail slow Running on n1", || {
        let run = cluster.keelctl(&["get", "jails"]);
        let running = run
            .stdout
            .lines()
            .any(|row| row.starts_with("slow ") && row.contains(" n1 ") && row.contains("Running"));
        running.then_some(())
    });
    assert!(all_alive(&liveness(&cluster)), "{}", cluster.logs());
}
