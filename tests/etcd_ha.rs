//! Two control planes on a real 3-member etcd (`util::etcd`), three
//! simulated agents and keelctl given both addresses: the leader killed
//! with -9 mid-stream of applies, one etcd member killed, the leader
//! partitioned from etcd (a network namespace), and the leader stopped.
//!
//! What it shows: the standby takes the leader key when the dead leader's
//! lease runs out and serves the state exactly as the leader left it; every
//! apply keelctl saw acknowledged is still placed, on the node it was
//! placed on, and every replica of a 3-replica service stays where it was; keelctl with both addresses waits out the takeover instead
//! of failing (at most one failed call, a request the dying leader had
//! read); nothing is rescheduled; a lost etcd follower changes nothing.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use keel::common::wire::{Liveness, NodeStatus};

use crate::util::cluster::{Cluster, Run, free_port, keelctl_through_at};
use crate::util::etcd::EtcdCluster;

/// Silence after which a node is dead: the lease of the leader key is half
/// of it, so a takeover fits within it.
const DEAD_AFTER: std::time::Duration = std::time::Duration::from_secs(6);

fn address() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)))
}

fn keelctl(cluster: &Cluster, list: &str, args: &[&str], stdin: Option<&str>) -> Run {
    cluster.keelctl_through(list, args, stdin)
}

fn jail(name: &str) -> String {
    format!(
        "kind: Jail\nmetadata: {{name: {name}}}\nspec:\n  base: 14.2-RELEASE\n  \
         resources: {{cpu: 0.1}}\n  exec: {{start: [/bin/sleep, '300']}}\n"
    )
}

/// The node of an acknowledged apply's `jail/NAME applied on node N (...)`.
fn placed_on(out: &str) -> String {
    out.split_once(" applied on node ")
        .and_then(|(_, rest)| rest.split_once(' '))
        .map(|(node, _)| node.to_string())
        .unwrap_or_else(|| panic!("no node in {out:?}"))
}

/// A 3-replica service of sleeping jails.
const WEB: &str = "kind: Service\nmetadata: {name: web}\nspec:\n  replicas: 3\n  port: 8080\n  \
                   template:\n    base: 14.2-RELEASE\n    resources: {cpu: 0.1}\n    \
                   exec: {start: [/bin/sleep, '300']}\n";

fn web_status(cluster: &Cluster, list: &str) -> Option<keel::common::wire::ServiceStatus> {
    let run = keelctl(
        cluster,
        list,
        &["get", "services", "web", "-o", "json"],
        None,
    );
    serde_json::from_str(&run.stdout).ok()
}

/// Replica name -> node.
fn replica_nodes(
    status: &keel::common::wire::ServiceStatus,
) -> std::collections::BTreeMap<String, String> {
    status
        .replicas
        .iter()
        .map(|r| (r.name.clone(), r.node.clone()))
        .collect()
}

fn alive(cluster: &Cluster, list: &str) -> Option<usize> {
    let run = keelctl(cluster, list, &["get", "nodes", "-o", "json"], None);
    let nodes: Vec<NodeStatus> = serde_json::from_str(&run.stdout).ok()?;
    Some(nodes.iter().filter(|n| n.status == Liveness::Alive).count())
}

#[test]
fn a_standby_takes_over_from_a_killed_leader_and_loses_no_acknowledged_apply() {
    let Some(mut etcd) = EtcdCluster::start("etcd_ha", 3) else {
        return;
    };
    let endpoints = etcd.endpoints().join(",");
    let (first, second) = (address(), address());
    assert_ne!(first, second);
    let both = format!("{first},{second}");
    let mut cluster = Cluster::new();
    let args = cluster.etcd_controlplane_args(first, "cp1", &endpoints, DEAD_AFTER);
    cluster.start_controlplane(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let args = cluster.etcd_controlplane_args(second, "cp2", &endpoints, DEAD_AFTER);
    let standby = cluster.start_standby(&args.iter().map(String::as_str).collect::<Vec<_>>());

    for n in 1..=3u8 {
        cluster.start_standard_agent_of(n, &both);
    }
    cluster.wait_for("3 Alive nodes", || {
        (alive(&cluster, &both)? == 3).then_some(())
    });
    // A 3-replica service, all ready before the kill: none may move.
    let applied = keelctl(&cluster, &both, &["apply", "-f", "-"], Some(WEB));
    assert_eq!(applied.code, 0, "{applied:?}\n{}", cluster.logs());
    let replicas_before = cluster.wait_for("3 ready replicas of web", || {
        let s = web_status(&cluster, &both)?;
        (s.replicas.iter().filter(|r| r.ready).count() == 3).then(|| replica_nodes(&s))
    });

    // A stream of applies, each remembered with its node once acknowledged.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let (dir, key) = (cluster.dir().to_path_buf(), cluster.operator_key());
    let acknowledged = std::thread::scope(|scope| {
        let stream = scope.spawn(|| {
            let mut acknowledged = Vec::new();
            let mut failed = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let name = format!("j{i}");
                let apply = ["apply", "-f", "-"];
                let run = keelctl_through_at(&dir, &key, &both, &apply, Some(&jail(&name)));
                if run.code == 0 {
                    acknowledged.push((name, placed_on(&run.stdout)));
                    done.fetch_add(1, Ordering::SeqCst);
                } else {
                    failed.push(run);
                }
                i += 1;
            }
            (acknowledged, failed)
        });
        cluster.wait_for("a few applies before the kill", || {
            (keelctl(&cluster, &both, &["get", "jails", "j2"], None).code == 0).then_some(())
        });
        cluster.kill9_controlplane();
        let killed = std::time::Instant::now();
        cluster.wait_for("the standby to lead", || {
            (cluster.standby_answers(standby)? == 200).then_some(())
        });
        // For the record (bench/README.md), not asserted: a figure of a
        // loaded test machine.
        eprintln!(
            "failover: the standby served {:?} after the kill (lease {:?})",
            killed.elapsed(),
            keel::controlplane::leader::lease_ttl(DEAD_AFTER)
        );
        cluster.wait_for("3 Alive nodes through the new leader", || {
            (alive(&cluster, &both)? == 3).then_some(())
        });
        // Some applies through the new leader too.
        let before = done.load(Ordering::SeqCst);
        cluster.wait_for("three applies through the new leader", || {
            (done.load(Ordering::SeqCst) >= before + 3).then_some(())
        });
        stop.store(true, Ordering::SeqCst);
        let (acknowledged, failed) = stream.join().expect("the apply stream");
        eprintln!(
            "applies over the failover: {} acknowledged, {} failed {failed:?}",
            acknowledged.len(),
            failed.len()
        );
        assert!(
            failed.len() <= 1,
            "keelctl with both addresses failed more than once over the failover: {failed:?}\n{}",
            cluster.logs()
        );
        acknowledged
    });
    assert!(acknowledged.len() >= 3, "{acknowledged:?}");
    let replicas_after = cluster.wait_for("3 ready replicas of web again", || {
        let s = web_status(&cluster, &both)?;
        (s.replicas.iter().filter(|r| r.ready).count() == 3).then(|| replica_nodes(&s))
    });
    assert_eq!(
        replicas_after, replicas_before,
        "no replica moved over the failover"
    );

    // One etcd member lost (a follower: a lost etcd leader stalls writes
    // until etcd elects another) changes nothing visible.
    let leader = etcd.wait_leader();
    etcd.kill((leader + 1) % 3);
    let late = keelctl(&cluster, &both, &["apply", "-f", "-"], Some(&jail("late")));
    assert_eq!(late.code, 0, "{late:?}\n{}", cluster.logs());
    acknowledged_survived(&cluster, &both, &acknowledged);
}

/// Every acknowledged apply is still placed where it was: `keelctl get
/// jails NAME` finds it, and an apply of the same jail again (unchanged,
/// so the placement decides alone) answers the same node.
fn acknowledged_survived(cluster: &Cluster, list: &str, acknowledged: &[(String, String)]) {
    for (name, node) in acknowledged {
        let got = keelctl(cluster, list, &["get", "jails", name], None);
        assert_eq!(
            got.code,
            0,
            "acknowledged {name} is lost: {got:?}\n{}",
            cluster.logs()
        );
        let again = keelctl(cluster, list, &["apply", "-f", "-"], Some(&jail(name)));
        assert_eq!(again.code, 0, "{again:?}");
        assert_eq!(&placed_on(&again.stdout), node, "{name} moved");
    }
}

/// The state in etcd over a compaction, and a writer fenced out: driven
/// through `EtcdLog` itself, since a process test would need a thousand
/// batches to compact.
#[test]
fn the_state_in_etcd_survives_compaction_and_a_replaced_leader_writes_nothing() {
    use keel::controlplane::commit::{Log, LogError};
    use keel::controlplane::etcd::{Etcd, Lead};
    use keel::controlplane::etcd_state::EtcdLog;
    use keel::controlplane::leader::LEADER_KEY;
    use keel::controlplane::state::Op;
    use std::time::Duration;

    let Some(etcd) = EtcdCluster::start("etcd_state", 1) else {
        return;
    };
    let client = Arc::new(Etcd::connect(&etcd.settings("/keel-state-test/")).expect("connects"));
    let lead = |holder: &str| {
        let lease = client.grant(Duration::from_secs(2)).expect("lease");
        match client.try_lead(LEADER_KEY, holder, lease.id).expect("txn") {
            Lead::Held { revision } => (lease, revision),
            other => panic!("{holder} does not lead: {other:?}"),
        }
    };
    let volume = |name: &str| Op::PutVolume {
        name: name.into(),
        node: "n1".into(),
    };
    let (lease, fence) = lead("first");
    let (mut log, state) = EtcdLog::open(Arc::clone(&client), fence).expect("opens");
    assert_eq!(
        state,
        Default::default(),
        "an empty prefix is an empty cluster"
    );
    let mut expected = state;
    for name in ["a", "b", "c"] {
        log.append(&[volume(name)]).expect("appends");
        keel::common::journal::Replay::replay(&mut expected, &volume(name));
    }
    log.compact(&expected).expect("compacts");
    log.append(&[volume("d")])
        .expect("appends after the snapshot");
    keel::common::journal::Replay::replay(&mut expected, &volume("d"));
    let (_, reopened) = EtcdLog::open(Arc::clone(&client), fence).expect("reopens");
    assert_eq!(reopened, expected, "the snapshot and the batch after it");
    let keys: Vec<String> = client
        .range_prefix("log/")
        .expect("range")
        .kvs
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(keys.len(), 1, "the folded batches are gone: {keys:?}");

    // Another takes the key once the first's lease is gone: the first
    // writes nothing more, and says why.
    client.revoke(lease.id).expect("revokes");
    let (_, second_fence) = lead("second");
    assert!(second_fence > fence);
    let refused = log.append(&[volume("late")]).expect_err("fenced");
    assert!(matches!(refused, LogError::NotLeader(_)), "{refused}");
    let (_, seen) = EtcdLog::open(Arc::clone(&client), second_fence).expect("opens");
    assert_eq!(seen, expected, "the fenced batch did not land");
}

/// A journal's state moved into etcd and out again, unchanged; an import
/// into a prefix that holds a cluster, or while a control plane leads it,
/// is refused and changes nothing.
#[test]
fn a_journal_state_moves_into_etcd_and_back() {
    use keel::controlplane::etcd::Etcd;
    use keel::controlplane::leader::LEADER_KEY;
    use keel::controlplane::state::Op;
    use keel::controlplane::transfer::{Backend, TransferError, export, import};
    use keel::controlplane::worker::open_state;
    use std::time::Duration;

    let Some(etcd) = EtcdCluster::start("etcd_transfer", 1) else {
        return;
    };
    let settings = etcd.settings("/keel-transfer-test/");
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut journal, _) = open_state(dir.path()).expect("opens");
    journal
        .append(&[
            Op::PutVolume {
                name: "data".into(),
                node: "n1".into(),
            },
            Op::MarkDeleting { name: "x".into() },
        ])
        .expect("appends");
    drop(journal);
    let out = tempfile::tempdir().expect("tempdir");
    let (first, second) = (
        out.path().join("first.json"),
        out.path().join("second.json"),
    );
    export(Backend::Dir(dir.path()), Some(&first)).expect("exports the journal");
    let held = import(Backend::Etcd(&settings), Some(&first)).expect("imports into etcd");
    assert_eq!(held, "1 volume");
    export(Backend::Etcd(&settings), Some(&second)).expect("exports from etcd");
    assert_eq!(
        std::fs::read_to_string(&first).expect("first"),
        std::fs::read_to_string(&second).expect("second"),
        "the state came back as it went in"
    );
    let again = import(Backend::Etcd(&settings), Some(&first)).expect_err("not empty");
    assert!(matches!(again, TransferError::NotEmpty { .. }), "{again}");

    // A control plane leading the cluster: no transfer runs beside it.
    let client = Etcd::connect(&settings).expect("connects");
    let lease = client.grant(Duration::from_secs(30)).expect("lease");
    client
        .try_lead(LEADER_KEY, "a control plane", lease.id)
        .expect("leads");
    let refused = export(
        Backend::Etcd(&settings),
        Some(&out.path().join("third.json")),
    )
    .expect_err("a control plane leads");
    assert!(matches!(refused, TransferError::Leading(_)), "{refused}");
    assert!(refused.to_string().contains("a control plane"), "{refused}");
}

/// The leader partitioned from etcd, and from etcd alone: it runs in a
/// network namespace of its own, joined to the test host by a veth, and
/// the etcd members take it as clients on a second address of the host's
/// end (`util::netns`), to which a blackhole route inside the namespace
/// then cuts it off. Agents and keelctl still reach it. It stops deciding
/// (every request, a write included, answered 503 as a standby answers)
/// while it still runs, the standby takes over, what the leader
/// acknowledged before the cut is the new leader's, the node is never
/// Dead and its jail never moves. Once the route is back, the old leader
/// waits as a standby, and leads again when the new one is killed.
#[test]
fn a_leader_partitioned_from_etcd_answers_503_while_the_standby_takes_over() {
    use crate::util::netns::Namespaces;
    use keel::common::http::failover::STANDBY_HEADER;
    use keel::common::http::{Client, Endpoint};

    let test = "etcd_partition";
    let Some(spaces) = Namespaces::new(test, "keelha", "cp1") else {
        return;
    };
    let link = spaces
        .join_host("cp1", spaces.subnet())
        .expect("join the control plane's namespace to the host");
    let Some(etcd) = EtcdCluster::start_also_on(test, 3, link.host_extra) else {
        return;
    };
    let first = SocketAddr::from((link.inside, 7000));
    let second = address();
    let both = format!("{first},{second}");
    let mut cluster = Cluster::new();
    let args = cluster.etcd_controlplane_args(
        first,
        "cp1",
        &etcd.endpoints_on(link.host_extra).join(","),
        DEAD_AFTER,
    );
    let exec = spaces.exec("cp1");
    cluster.start_controlplane_in(
        &exec.iter().map(String::as_str).collect::<Vec<_>>(),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let args =
        cluster.etcd_controlplane_args(second, "cp2", &etcd.endpoints().join(","), DEAD_AFTER);
    let standby = cluster.start_standby(&args.iter().map(String::as_str).collect::<Vec<_>>());
    // On the veth's host end: the partitioned control plane forwards
    // applies to it from its namespace.
    let agent = SocketAddr::from((link.host, free_port(link.host)));
    cluster.start_standard_agent_of_at(1, &both, agent);
    cluster.wait_for("n1 Alive", || (alive(&cluster, &both)? == 1).then_some(()));
    let before = keelctl(
        &cluster,
        &both,
        &["apply", "-f", "-"],
        Some(&jail("before")),
    );
    assert_eq!(before.code, 0, "{before:?}\n{}", cluster.logs());
    let node = placed_on(&before.stdout);

    spaces.drop_route("cp1", link.host_extra);
    cluster.wait_for("the standby to lead", || {
        (cluster.standby_answers(standby)? == 200).then_some(())
    });
    // Still running, and refusing: a write from the test host (it needs no
    // signature to be refused) gets a standby's answer.
    let old = Client::new(Endpoint::Tcp(first.to_string())).with_timeout(DEAD_AFTER);
    let refused = old
        .request("PUT", "/jails/probe", &[], b"{}")
        .expect("the partitioned control plane still answers");
    assert_eq!(refused.status, 503, "{}", cluster.controlplane_log());
    assert!(
        refused
            .headers
            .iter()
            .any(|(n, v)| n.eq_ignore_ascii_case(STANDBY_HEADER) && v == "1"),
        "{refused:?}"
    );
    let log = cluster.controlplane_log();
    assert!(log.contains("lost the leadership"), "{log}");
    // keelctl with both addresses, the partitioned one first: moved on.
    let got = keelctl(&cluster, &both, &["get", "jails", "before"], None);
    assert_eq!(
        got.code,
        0,
        "acknowledged before the cut: {got:?}\n{}",
        cluster.logs()
    );
    cluster.wait_for("n1 Alive at the new leader", || {
        (alive(&cluster, &both)? == 1).then_some(())
    });
    let after = keelctl(&cluster, &both, &["apply", "-f", "-"], Some(&jail("after")));
    assert_eq!(
        after.code,
        0,
        "the new leader decides: {after:?}\n{}",
        cluster.logs()
    );

    spaces.restore_route("cp1", link.host_extra);
    cluster.wait_for("the old leader to stand by", || {
        cluster
            .controlplane_log()
            .contains(&format!("standby: {second} (pid"))
            .then_some(())
    });
    assert_eq!(
        old.request("GET", "/healthz", &[], b"")
            .map(|r| r.status)
            .ok(),
        Some(503),
        "a standby while the other leads"
    );
    cluster.kill9_standby(standby);
    cluster.wait_for("the old leader to lead again", || {
        (old.request("GET", "/healthz", &[], b"").ok()?.status == 200).then_some(())
    });
    cluster.wait_for("n1 Alive at the old leader again", || {
        (alive(&cluster, &both)? == 1).then_some(())
    });
    let third = keelctl(&cluster, &both, &["apply", "-f", "-"], Some(&jail("third")));
    assert_eq!(third.code, 0, "{third:?}\n{}", cluster.logs());
    let nodes = keelctl(&cluster, &both, &["get", "nodes", "-o", "json"], None);
    let nodes: Vec<NodeStatus> = serde_json::from_str(&nodes.stdout).expect("nodes as JSON");
    assert!(
        nodes.iter().all(|n| n.status == Liveness::Alive),
        "no node died of the failovers: {nodes:?}"
    );
    let still = keelctl(&cluster, &both, &["get", "jails", "before"], None);
    assert!(
        still.stdout.contains(&node),
        "the jail never moved from {node}: {still:?}"
    );
}

/// A standby relays: an agent and keelctl given only the standby's address
/// are served by the leader through it (the agent registers and
/// heartbeats, keelctl applies and reads), while `/healthz` stays the
/// standby's own; once the leader is killed the same address leads.
#[test]
fn a_standby_relays_every_request_to_the_leader() {
    let Some(etcd) = EtcdCluster::start("etcd_relay", 3) else {
        return;
    };
    let (first, second) = (address(), address());
    let endpoints = etcd.endpoints().join(",");
    let mut cluster = Cluster::new();
    let args = cluster.etcd_controlplane_args(first, "cp1", &endpoints, DEAD_AFTER);
    cluster.start_controlplane(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let args = cluster.etcd_controlplane_args(second, "cp2", &endpoints, DEAD_AFTER);
    let standby = cluster.start_standby(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let only_standby = second.to_string();
    cluster.start_standard_agent_of(1, &only_standby);
    cluster.wait_for("n1 Alive through the standby", || {
        (alive(&cluster, &only_standby)? == 1).then_some(())
    });
    let applied = keelctl(
        &cluster,
        &only_standby,
        &["apply", "-f", "-"],
        Some(&jail("relayed")),
    );
    assert_eq!(applied.code, 0, "{applied:?}\n{}", cluster.logs());
    assert_eq!(
        cluster.standby_answers(standby),
        Some(503),
        "the standby's own health: it does not lead"
    );
    let leader_log = cluster.controlplane_log();
    assert!(
        leader_log.contains("Scheduled jail/relayed"),
        "the leader decided: {leader_log}"
    );

    cluster.kill9_controlplane();
    cluster.wait_for("the standby to lead", || {
        (cluster.standby_answers(standby)? == 200).then_some(())
    });
    cluster.wait_for("n1 Alive at the new leader", || {
        (alive(&cluster, &only_standby)? == 1).then_some(())
    });
    let got = keelctl(&cluster, &only_standby, &["get", "jails", "relayed"], None);
    assert_eq!(got.code, 0, "{got:?}\n{}", cluster.logs());
}

/// The cluster's record of live nodes: the leader keeps `nodes/{id}` under
/// a lease in etcd as heartbeats arrive; a new leader reads it, so a node
/// whose agent is paused (SIGSTOP: no heartbeat can reach the new leader)
/// is Alive there from its first moment instead of Unknown. Evidence for
/// life only: still silent, it is Dead one `dead_after` later, and Alive
/// again once its agent resumes.
#[test]
fn a_new_leader_takes_the_record_of_live_nodes_but_sees_deaths_itself() {
    use crate::util::agent::signal;
    use keel::controlplane::etcd::Etcd;
    use keel::controlplane::node_leases::NODES_PREFIX;

    let Some(etcd) = EtcdCluster::start("etcd_node_leases", 3) else {
        return;
    };
    let (first, second) = (address(), address());
    let endpoints = etcd.endpoints().join(",");
    let both = format!("{first},{second}");
    let mut cluster = Cluster::new();
    let args = cluster.etcd_controlplane_args(first, "cp1", &endpoints, DEAD_AFTER);
    cluster.start_controlplane(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let args = cluster.etcd_controlplane_args(second, "cp2", &endpoints, DEAD_AFTER);
    let standby = cluster.start_standby(&args.iter().map(String::as_str).collect::<Vec<_>>());
    cluster.start_standard_agent_of(1, &both);
    cluster.wait_for("n1 Alive", || (alive(&cluster, &both)? == 1).then_some(()));
    let client = Etcd::connect(&etcd.settings("/keel/")).expect("connects");
    cluster.wait_for("n1 on the record, under a lease", || {
        let got = client.range_prefix(NODES_PREFIX).ok()?;
        let kv = got.kvs.into_iter().find(|kv| kv.key == "nodes/n1")?;
        let ttl = client.time_to_live(kv.lease?).ok()??;
        // dead_after and a quarter at most (whole seconds, rounded up).
        assert!(
            ttl <= DEAD_AFTER + DEAD_AFTER / 4 + std::time::Duration::from_secs(1),
            "{ttl:?}"
        );
        Some(())
    });

    let agent = cluster.agent_pid("n1").expect("n1 runs");
    signal(agent, libc::SIGSTOP).expect("SIGSTOP the agent");
    cluster.kill9_controlplane();
    cluster.wait_for("the standby to lead", || {
        (cluster.standby_answers(standby)? == 200).then_some(())
    });
    let nodes = keelctl(
        &cluster,
        &second.to_string(),
        &["get", "nodes", "-o", "json"],
        None,
    );
    let nodes: Vec<NodeStatus> = serde_json::from_str(&nodes.stdout).expect("nodes as JSON");
    let n1 = nodes.iter().find(|n| n.node_id == "n1").expect("n1 listed");
    let log = cluster.logs();
    assert_eq!(
        n1.status,
        Liveness::Alive,
        "on the record while its agent is paused: {n1:?}\n{log}"
    );
    assert_eq!(n1.last_seen_secs, None, "not heard by the new leader");
    cluster.wait_for("n1 Dead at the new leader, one lease later", || {
        let run = keelctl(
            &cluster,
            &second.to_string(),
            &["get", "nodes", "-o", "json"],
            None,
        );
        let nodes: Vec<NodeStatus> = serde_json::from_str(&run.stdout).ok()?;
        nodes
            .iter()
            .any(|n| n.node_id == "n1" && n.status == Liveness::Dead)
            .then_some(())
    });
    signal(agent, libc::SIGCONT).expect("SIGCONT the agent");
    cluster.wait_for("n1 Alive again", || {
        (alive(&cluster, &both)? == 1).then_some(())
    });
}

/// A leader stopped with SIGTERM steps down: it revokes its lease, so the
/// standby takes over at its next try instead of waiting the lease out.
/// `dead_after` is 240 s here (a lease of 120 s, twice the test's wait):
/// only a released key lets the standby lead within the wait.
#[test]
fn a_leader_stopped_with_sigterm_releases_the_key_at_once() {
    use keel::controlplane::etcd::{Etcd, LeaseId};
    use keel::controlplane::leader::LEASE_FILE;

    let Some(etcd) = EtcdCluster::start("etcd_step_down", 1) else {
        return;
    };
    // A lease of 120 s, twice the test's wait.
    let long = std::time::Duration::from_secs(240);
    let (first, second) = (address(), address());
    let endpoints = etcd.endpoints().join(",");
    let mut cluster = Cluster::new();
    let args = cluster.etcd_controlplane_args(first, "cp1", &endpoints, long);
    cluster.start_controlplane(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let args = cluster.etcd_controlplane_args(second, "cp2", &endpoints, long);
    let standby = cluster.start_standby(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let record = std::fs::read_to_string(cluster.dir().join("cp1").join(LEASE_FILE))
        .expect("the leader recorded its lease");
    let record: serde_json::Value = serde_json::from_str(&record).expect("JSON");
    let lease = LeaseId(record["state"]["lease"].as_i64().expect("a lease id"));

    cluster.stop_controlplane();
    let log = cluster.controlplane_log();
    assert!(log.contains("stepped down"), "{log}");
    let client = Etcd::connect(&etcd.settings("/keel/")).expect("connects");
    assert_eq!(
        client.time_to_live(lease).expect("asks etcd"),
        None,
        "the lease is revoked, not left to run out"
    );
    cluster.wait_for("the standby to lead", || {
        (cluster.standby_answers(standby)? == 200).then_some(())
    });
}

/// Bad etcd settings are a configuration error (status 2) naming the key
/// to fix, both from `--check-config` and at start, before the control
/// plane listens or touches any state; no etcd needs to run.
#[test]
fn bad_etcd_settings_are_refused_at_start_naming_the_key() {
    use crate::util::cluster::CONTROLPLANE;
    let cluster = Cluster::new();
    let listen = address().to_string();
    for (name, flags, key) in [
        (
            "not-a-url",
            vec!["--etcd-endpoints", "etcd1:2379"],
            "controlplane.etcd_endpoints",
        ),
        (
            "cert-without-key",
            vec![
                "--etcd-endpoints",
                "https://127.0.0.1:2379",
                "--etcd-ca",
                "/nonexistent/ca.pem",
                "--etcd-cert",
                "/nonexistent/cert.pem",
            ],
            "controlplane.etcd_cert",
        ),
    ] {
        for check in [false, true] {
            let mut args = vec!["--simulate", "--listen", &listen];
            if check {
                args.push("--check-config");
            }
            args.extend(&flags);
            let out = cluster.run_to_exit(name, CONTROLPLANE, &args);
            assert_eq!(out.status.code(), Some(2), "{name}: {}", out.log);
            assert!(
                out.log.contains(key),
                "{name}: the key is named: {}",
                out.log
            );
        }
    }
}
