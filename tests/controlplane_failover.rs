//! Agents and keelctl given several control plane addresses
//! (`--controlplane A,B`): a request goes to the one that takes the
//! connection, and a control plane replaced by a standby on another
//! address loses them nothing. The standby here takes over the same state
//! directory (a control plane moved to another address); the backends that
//! share state between running control planes build on the same client.

use std::net::{Ipv4Addr, SocketAddr};

use keel::common::wire::{Liveness, NodeStatus};

use crate::util::cluster::{Cluster, Run, free_port, standard_controlplane_args};

/// Two distinct free loopback addresses.
fn two_addresses() -> (SocketAddr, SocketAddr) {
    let first = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)));
    loop {
        let second = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)));
        if second != first {
            return (first, second);
        }
    }
}

/// keelctl with `--controlplane LIST`, signed with the operator key.
fn keelctl(cluster: &Cluster, list: &str, args: &[&str], stdin: Option<&str>) -> Run {
    cluster.keelctl_through(list, args, stdin)
}

/// Waits until keelctl through `list` lists `id` Alive.
fn wait_alive(cluster: &Cluster, list: &str, id: &str) {
    cluster.wait_for(&format!("{id} Alive through {list}"), || {
        let run = keelctl(cluster, list, &["get", "nodes", "-o", "json"], None);
        let nodes: Vec<NodeStatus> = serde_json::from_str(&run.stdout).ok()?;
        nodes
            .iter()
            .any(|n| n.node_id == id && n.status == Liveness::Alive)
            .then_some(())
    });
}

fn start(cluster: &mut Cluster, listen: SocketAddr) {
    let args = standard_controlplane_args(listen);
    cluster.start_controlplane(&args.iter().map(String::as_str).collect::<Vec<_>>());
}

#[test]
fn agents_and_keelctl_use_the_control_plane_that_answers_and_follow_a_standby() {
    let (standby, active) = two_addresses();
    let both = format!("{standby},{active}");
    let mut cluster = Cluster::new();
    // Only the second address runs a control plane: the first refuses.
    start(&mut cluster, active);
    cluster.start_standard_agent_of(1, &both);
    wait_alive(&cluster, &both, "n1");

    let jail = "kind: Jail\nmetadata: {name: web}\nspec:\n  base: 14.2-RELEASE\n  \
                exec: {start: [/bin/sleep, '300']}\n";
    let applied = keelctl(&cluster, &both, &["apply", "-f", "-"], Some(jail));
    assert_eq!(applied.code, 0, "{applied:?}\n{}", cluster.logs());
    assert!(applied.stdout.contains("on node n1"), "{}", applied.stdout);

    // The active one dies; a standby on the first address takes over its
    // state. The agent's next heartbeats find it without being told.
    start_standby(&mut cluster, standby);
    wait_alive(&cluster, &both, "n1");
    // The placement the first one acknowledged is the standby's: it finds
    // the jail by name.
    let got = keelctl(&cluster, &both, &["get", "jails", "web"], None);
    assert_eq!(
        got.code,
        0,
        "the apply survived: {got:?}\n{}",
        cluster.logs()
    );
    assert!(got.stdout.contains("web"), "{}", got.stdout);

    // Only the address that answers matters to keelctl: the dead one named
    // alone fails, naming it.
    let alone = keelctl(&cluster, &active.to_string(), &["get", "nodes"], None);
    assert_ne!(alone.code, 0, "{alone:?}");
    assert!(
        alone.stderr.contains(&active.to_string()),
        "{}",
        alone.stderr
    );
}

fn start_standby(cluster: &mut Cluster, listen: SocketAddr) {
    let args = standard_controlplane_args(listen);
    cluster.replace_controlplane(&args.iter().map(String::as_str).collect::<Vec<_>>());
}
