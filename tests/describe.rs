//! `keelctl describe` as a process, through a simulated cluster: a
//! service, one of its replicas, a node and a volume, each in the layout a
//! kubectl user expects (fields, conditions, the spec as applied).

use crate::util::cluster::Cluster;
use crate::util::service_doc;

#[track_caller]
fn has_lines(text: &str, lines: &[&str]) {
    for line in lines {
        assert!(
            text.lines().any(|l| l.starts_with(line)),
            "no line starting {line:?} in\n{text}"
        );
    }
}

#[test]
fn describe_shows_a_service_its_replica_a_node_and_a_volume() {
    let cluster = Cluster::standard(2);
    cluster.wait_alive(2);
    cluster.keelctl_with(
        &["apply", "-f", "-"],
        Some(&service_doc("web", 2, 7301, "/bin/sleep, '300'")),
    );
    let db = "kind: Jail\nmetadata: {name: db}\nspec:\n  base: 14.2-RELEASE\n  \
              exec: {start: [/bin/sleep, '300']}\n  \
              volumes:\n    - {name: dbdata, mountPath: /data, size: 1M}\n";
    let applied = cluster.keelctl_with(&["apply", "-f", "-"], Some(db));
    assert_eq!(applied.code, 0, "{applied:?}");
    cluster.wait_for("both replicas ready", || {
        let run = cluster.keelctl(&["describe", "service", "web"]);
        (run.code == 0 && run.stdout.contains("2 desired, 2 ready")).then_some(())
    });

    let service = cluster.keelctl_ok(&["describe", "service", "web"]).stdout;
    has_lines(
        &service,
        &[
            "Name:         web",
            "Kind:         Service",
            "VIP:          ",
            "Replicas:     2 desired, 2 ready, 2 up to date",
            "Revision:     1",
            "Conditions:",
            "  Available     True",
            "  NAME    NODE",
            "  web-0   n",
            "  web-1   n",
            "Spec:",
            "  replicas: 2",
            "  template:",
        ],
    );

    // Running once seen up past its first second (Starting before).
    let replica = cluster.wait_for("web-0 Running", || {
        let text = cluster.keelctl_ok(&["describe", "jail", "web-0"]).stdout;
        text.contains("Status:       Running").then_some(text)
    });
    has_lines(
        &replica,
        &[
            "Name:         web-0",
            "Kind:         Jail",
            "Node:         n",
            "Status:       Running",
            "Ready:        True",
            "Epoch:        ",
            "Resources:    cpu 0.1, memory unlimited",
            "Last Error:   <none>",
            "  Running   True",
            "Spec:",
            "  base: 14.2-RELEASE",
            "Events:",
            "  LAST SEEN",
        ],
    );
    assert!(
        replica
            .lines()
            .any(|l| l.contains("Started") && l.contains("jail/web-0")),
        "the replica's own events: {replica}"
    );
    assert!(
        replica.lines().all(|l| !l.contains("jail/web-1")),
        "no other object's: {replica}"
    );

    let db_node = cluster
        .keelctl_ok(&["describe", "jail", "db"])
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("Node:").map(|n| n.trim().to_string()))
        .expect("db's node");
    let node = cluster.keelctl_ok(&["describe", "node", &db_node]).stdout;
    has_lines(
        &node,
        &[
            &format!("Name:         {db_node}"),
            "Kind:         Node",
            "Status:       Alive",
            "Cordoned:     False",
            "  Schedulable   True",
            "Jails:",
            "  db",
        ],
    );

    let volume = cluster.keelctl_ok(&["describe", "volume", "dbdata"]).stdout;
    has_lines(
        &volume,
        &[
            "Name:         dbdata",
            "Kind:         Volume",
            &format!("Node:         {db_node}"),
            "Quota:        1M",
            "Mounted By:   db",
        ],
    );

    let missing = cluster.keelctl(&["describe", "jail", "nope"]);
    assert_eq!(missing.code, 1, "{missing:?}");
    assert!(
        missing
            .stderr
            .starts_with("keelctl: describe jail/nope failed"),
        "{missing:?}"
    );
}
