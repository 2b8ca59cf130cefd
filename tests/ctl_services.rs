//! keelctl's service commands against a real simulated cluster (one
//! keel-controlplane, three keel-agentd on loopback): apply a 3-replica
//! service, see it ready on three nodes, have a port change refused naming
//! the field, scale it down by applying again, delete it; and a file mixing a
//! jail and a service applied in order and deleted last one first.

use std::collections::BTreeSet;

use keel::common::wire::{Liveness, NodeStatus, ServiceStatus};

use crate::util::cluster::{Cluster, Run};
use crate::util::service_doc;

fn web(replicas: u32, port: u16) -> String {
    service_doc("web", replicas, port, "/bin/sleep, '300'")
}

const MIXED: &str = "kind: Jail
metadata: {name: solo}
spec:
  base: 14.2-RELEASE
  exec: {start: [/bin/sleep, '300']}
---
kind: Service
metadata: {name: api}
spec:
  replicas: 1
  port: 9000
  template:
    base: 14.2-RELEASE
    exec: {start: [/bin/sleep, '300']}
";

fn services(cluster: &Cluster) -> Vec<ServiceStatus> {
    serde_json::from_str(
        &cluster
            .keelctl_ok(&["get", "services", "-o", "json"])
            .stdout,
    )
    .expect("get services -o json is a list of services")
}

fn web_status(cluster: &Cluster) -> Option<ServiceStatus> {
    services(cluster).into_iter().find(|s| s.name == "web")
}

#[test]
fn keelctl_applies_lists_scales_and_deletes_a_service() {
    let cluster = Cluster::standard(3);
    cluster.wait_alive(3);
    let file = cluster.dir().join("web.yaml");
    let file_arg = file.to_str().expect("utf-8 path");

    std::fs::write(&file, web(3, 8080)).expect("write web.yaml");
    let applied = cluster.keelctl_ok(&["apply", "-f", file_arg]);
    assert!(
        applied
            .stdout
            .starts_with("service/web applied (VIP 127.128.")
            && applied.stdout.contains(":8080, ")
            && applied.stdout.ends_with(" ready)\n"),
        "{applied:?}"
    );
    let status = cluster.wait_for("3/3 ready", || {
        web_status(&cluster).filter(|s| s.ready == 3 && s.desired == 3)
    });
    let nodes: BTreeSet<&str> = status.replicas.iter().map(|r| r.node.as_str()).collect();
    assert_eq!(nodes, BTreeSet::from(["n1", "n2", "n3"]), "{status:?}");

    let table = cluster.keelctl_ok(&["get", "services"]).stdout;
    let want = format!(
        "web    {}:8080   3/3     3            1          n1,n2,n3\n",
        status.vip
    );
    assert!(
        table.starts_with("NAME   VIP:PORT") && table.ends_with(&want),
        "{table}"
    );
    let replicas = cluster.keelctl_ok(&["get", "service", "web"]).stdout;
    let lines: Vec<&str> = replicas.lines().collect();
    assert_eq!(lines.len(), 4, "{replicas}");
    assert!(lines[0].starts_with("NAME    NODE   ADDRESS"), "{replicas}");
    for (i, line) in lines[1..].iter().enumerate() {
        assert!(line.starts_with(&format!("web-{i}   n")), "{replicas}");
        assert!(line.ends_with("Running   1"), "{replicas}");
    }
    // In YAML, the service is its document with its status after it, and
    // applying that back is no new revision.
    let printed = cluster
        .keelctl_ok(&["get", "service", "web", "-o", "yaml"])
        .stdout;
    let object: serde_yaml::Value = serde_yaml::from_str(&printed).expect("yaml");
    let one: ServiceStatus =
        serde_yaml::from_value(object["status"].clone()).expect("its status is a service");
    assert_eq!(one.vip, status.vip);
    let printed_file = cluster.dir().join("printed.yaml");
    std::fs::write(&printed_file, &printed).expect("write printed.yaml");
    let printed_arg = printed_file.to_str().expect("utf-8 path");
    cluster.keelctl_ok(&["apply", "-f", printed_arg]);
    let again: ServiceStatus = serde_json::from_str(
        &cluster
            .keelctl_ok(&["get", "service", "web", "-o", "json"])
            .stdout,
    )
    .expect("json");
    assert_eq!(
        again.revision, one.revision,
        "the same template is no new revision"
    );

    // The port is immutable: refused with the field named, exit 1.
    std::fs::write(&file, web(3, 9090)).expect("write web.yaml");
    let refused = cluster.keelctl(&["apply", "-f", file_arg]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused
            .stderr
            .starts_with("keelctl: apply service/web failed: "),
        "{refused:?}"
    );
    assert!(refused.stderr.contains("field spec.port; "), "{refused:?}");
    assert_eq!(refused.stdout, "");

    // Scale down by applying again with replicas: 1.
    std::fs::write(&file, web(1, 8080)).expect("write web.yaml");
    let scaled = cluster.keelctl_ok(&["apply", "-f", file_arg]);
    assert!(scaled.stdout.contains(", 1/1 ready)"), "{scaled:?}");
    cluster.wait_for("one replica left", || {
        web_status(&cluster).filter(|s| s.replicas.len() == 1 && s.ready == 1)
    });
    assert_eq!(web_status(&cluster).map(|s| s.vip), Some(status.vip));

    let deleted = cluster.keelctl_ok(&["delete", "service", "web"]);
    assert_eq!(deleted.stdout, "service/web deleted\n");
    let empty = cluster.keelctl_ok(&["get", "services"]);
    assert_eq!(
        (empty.stdout.as_str(), empty.stderr.as_str()),
        ("", "No services found.\n")
    );
    let gone = cluster.keelctl(&["get", "service", "web"]);
    assert_eq!(gone.code, 1, "{gone:?}");
    assert!(gone.stderr.contains("no service named web"), "{gone:?}");

    // A file of a jail and a service: applied in order, deleted in reverse.
    let mixed = cluster.keelctl_with(&["apply", "-f", "-"], Some(MIXED));
    assert_eq!(mixed.code, 0, "{mixed:?}\n{}", cluster.logs());
    let lines: Vec<&str> = mixed.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{mixed:?}");
    assert!(
        lines[0].starts_with("jail/solo applied on node "),
        "{mixed:?}"
    );
    assert!(
        lines[1].starts_with("service/api applied (VIP "),
        "{mixed:?}"
    );
    let removed = cluster.keelctl_with(&["delete", "-f", "-"], Some(MIXED));
    assert_eq!(removed.code, 0, "{removed:?}\n{}", cluster.logs());
    assert_eq!(removed.stdout, "service/api deleted\njail/solo deleted\n");
    assert!(services(&cluster).is_empty());
}

fn jail_doc(name: &str) -> String {
    format!(
        "kind: Jail\nmetadata: {{name: {name}}}\nspec:\n  base: 14.2-RELEASE\n  exec: {{start: [/bin/sleep, '300']}}\n"
    )
}

/// `keelctl apply -f -` expected to be refused with 409 and a message
/// naming `other`; returns stderr.
fn refused(run: Run, other: &str) -> String {
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr.contains("409") && run.stderr.contains(other),
        "refused naming {other}: {run:?}"
    );
    run.stderr
}

#[test]
fn a_jail_and_a_service_replica_never_share_a_name_in_either_order() {
    let cluster = Cluster::standard(2);
    cluster.wait_for("two Alive nodes", || {
        let nodes: Vec<NodeStatus> =
            serde_json::from_str(&cluster.keelctl_ok(&["get", "nodes", "-o", "json"]).stdout)
                .ok()?;
        (nodes.iter().filter(|n| n.status == Liveness::Alive).count() == 2).then_some(())
    });

    // A jail first: a service that would adopt it as a replica is refused.
    let run = cluster.keelctl_with(&["apply", "-f", "-"], Some(&jail_doc("svcx-1")));
    assert_eq!(run.code, 0, "{run:?}");
    let svcx = service_doc("svcx", 2, 9100, "/bin/sleep, '300'");
    let err = refused(
        cluster.keelctl_with(&["apply", "-f", "-"], Some(&svcx)),
        "jail svcx-1",
    );
    assert!(err.contains("metadata.name"), "{err}");
    assert!(
        services(&cluster).is_empty(),
        "nothing recorded: {:?}",
        services(&cluster)
    );

    // A service first: a jail named like any of its replicas is refused,
    // scheduled or named to a node, and the replica keeps its spec.
    cluster.keelctl_ok(&["delete", "jail", "svcx-1"]);
    let run = cluster.keelctl_with(&["apply", "-f", "-"], Some(&svcx));
    assert_eq!(run.code, 0, "{run:?}");
    cluster.wait_for("2/2 ready", || {
        services(&cluster)
            .into_iter()
            .find(|s| s.name == "svcx" && s.ready == 2)
    });
    for args in [
        &["apply", "-f", "-"][..],
        &["apply", "-f", "-", "--node", "n2"][..],
    ] {
        refused(
            cluster.keelctl_with(args, Some(&jail_doc("svcx-0"))),
            "service svcx",
        );
        // An index beyond the replica count is the service's too (scaling).
        refused(
            cluster.keelctl_with(args, Some(&jail_doc("svcx-7"))),
            "service svcx",
        );
    }

    // On a single agent, over its own socket: the replica the control plane
    // placed there is not rewritten by a local apply.
    let replica = services(&cluster)
        .into_iter()
        .find(|s| s.name == "svcx")
        .and_then(|s| s.replicas.into_iter().find(|r| r.name == "svcx-0"))
        .expect("svcx-0");
    let socket = cluster.socket(&replica.node);
    let local = crate::util::cluster::run(
        {
            let mut cmd = std::process::Command::new(crate::util::cluster::KEELCTL);
            cmd.env("KEEL_SOCKET", &socket)
                .env_remove("KEEL_CONTROLPLANE")
                .args(["apply", "-f", "-"]);
            cmd
        },
        Some(&jail_doc("svcx-0")),
    );
    let err = refused(local, "placed by the control plane");
    assert!(err.contains("metadata.name"), "{err}");

    // The reserved prefix reaches replica names too.
    let keel = service_doc("keel", 1, 9200, "/bin/sleep, '300'");
    let run = cluster.keelctl_with(&["apply", "-f", "-"], Some(&keel));
    assert_eq!(run.code, 2, "invalid input: {run:?}");
    assert!(
        run.stderr.contains("metadata.name (line 2") && run.stderr.contains("\"keel-0\""),
        "{run:?}"
    );
}
