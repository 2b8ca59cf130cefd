//! `keelctl get events` against real daemons: what an agent records about
//! its jails, kept across a `kill -9` and restart, filtered with `--for`;
//! a watch (`-w`) printing an event the daemon's long poll brought; and,
//! through the control plane, a node's death and its replica's reschedule
//! merged with the surviving agent's start of the replacement.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use keel::common::wire::{Event, EventType, ObjectKind};

use crate::util::agent::Agent;
use crate::util::cluster::{Cluster, Run, free_port};
use crate::util::{poll_until, service_doc};

const KEELCTL: &str = env!("CARGO_BIN_EXE_keelctl");

const AGENT_ARGS: &[&str] = &["--simulate", "--reconcile-interval", "200ms"];

fn ok(agent: &Agent, args: &[&str], stdin: Option<&str>) -> String {
    let run = agent.keelctl(args, stdin);
    assert_eq!(run.code, 0, "keelctl {args:?}: {run:?}\n{}", agent.log());
    run.stdout
}

fn sleeper(name: &str) -> String {
    format!(
        "kind: Jail\nmetadata: {{name: {name}}}\nspec:\n  base: 14.2-RELEASE\n  \
         exec: {{start: [/bin/sleep, '300']}}\n"
    )
}

fn events(json: &str) -> Vec<Event> {
    serde_json::from_str(json).unwrap_or_else(|e| panic!("get events -o json: {e}\n{json}"))
}

fn told(events: &[Event], reason: &str, name: &str) -> bool {
    events.iter().any(|e| e.reason == reason && e.name == name)
}

/// A `keelctl get events -w` left running, its stdout in a file; killed
/// when dropped, even when the test fails.
struct Watch {
    child: Child,
    out: std::path::PathBuf,
}

impl Watch {
    fn start(agent: &Agent, dir: &Path) -> Watch {
        Watch::start_with(agent, dir, &["get", "events", "-w"])
    }

    fn start_with(agent: &Agent, dir: &Path, args: &[&str]) -> Watch {
        let mut cmd = Command::new(KEELCTL);
        cmd.args(args)
            .current_dir(agent.dir())
            .env("KEEL_SOCKET", agent.socket());
        Watch::spawn(cmd, dir)
    }

    /// The watch through `cluster`'s control plane.
    fn through(cluster: &Cluster, dir: &Path) -> Watch {
        Watch::through_with(cluster, dir, &["get", "events", "-w"])
    }

    fn through_with(cluster: &Cluster, dir: &Path, args: &[&str]) -> Watch {
        let mut cmd = Command::new(KEELCTL);
        cmd.args(args)
            .arg("--controlplane")
            .arg(cluster.controlplane_addr().to_string())
            .arg("--key-file")
            .arg(cluster.operator_key())
            .current_dir(cluster.dir())
            .env_remove("KEEL_SOCKET");
        Watch::spawn(cmd, dir)
    }

    fn spawn(mut cmd: Command, dir: &Path) -> Watch {
        let out = dir.join("watch.out");
        let file = File::create(&out).expect("watch output file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn keelctl get events -w");
        Watch { child, out }
    }

    fn printed(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn an_agent_tells_a_jail_s_life_filters_by_object_and_keeps_its_events_across_a_restart() {
    let mut agent = Agent::start(AGENT_ARGS);
    ok(&agent, &["apply", "-f", "-"], Some(&sleeper("web")));
    ok(&agent, &["apply", "-f", "-"], Some(&sleeper("db")));

    let all = events(&ok(&agent, &["get", "events", "-o", "json"], None));
    for name in ["web", "db"] {
        assert!(told(&all, "Created", name), "{name}: {all:?}");
        assert!(told(&all, "Started", name), "{name}: {all:?}");
    }
    assert!(
        all.windows(2).all(|w| w[0].seq < w[1].seq),
        "oldest first: {all:?}"
    );
    let only_web = events(&ok(
        &agent,
        &["get", "events", "--for", "jail/web", "-o", "json"],
        None,
    ));
    assert!(!only_web.is_empty());
    assert!(
        only_web
            .iter()
            .all(|e| e.kind == ObjectKind::Jail && e.name == "web"),
        "{only_web:?}"
    );

    let table = ok(&agent, &["get", "events"], None);
    let header = table.lines().next().unwrap_or_default();
    for column in ["LAST SEEN", "TYPE", "REASON", "OBJECT", "NODE", "MESSAGE"] {
        assert!(header.contains(column), "{column}: {table}");
    }
    assert!(
        table
            .lines()
            .any(|l| l.contains("Normal") && l.contains("Started") && l.contains("jail/web")),
        "{table}"
    );

    agent.kill9();
    agent.restart();
    let after = events(&ok(&agent, &["get", "events", "-o", "json"], None));
    assert!(
        all.iter().all(|e| after.contains(e)),
        "every event from before the kill is still served:\nbefore {all:?}\nafter {after:?}"
    );
    ok(&agent, &["apply", "-f", "-"], Some(&sleeper("cache")));
    let newer = events(&ok(&agent, &["get", "events", "-o", "json"], None));
    let cache = newer
        .iter()
        .find(|e| e.name == "cache")
        .expect("an event about cache");
    let last_before = all.iter().map(|e| e.seq).max().unwrap_or(0);
    assert!(
        cache.seq > last_before,
        "numbering goes on after the restart: {cache:?} after {last_before}"
    );

    let bad = agent.keelctl(&["get", "events", "--for", "pod/web"], None);
    assert_eq!(bad.code, 2, "{bad:?}");
    assert!(bad.stderr.contains("--for"), "{bad:?}");
}

#[test]
fn a_watch_prints_an_event_the_daemon_hands_it() {
    let agent = Agent::start(AGENT_ARGS);
    let dir = tempfile::tempdir().expect("tempdir");
    ok(&agent, &["apply", "-f", "-"], Some(&sleeper("first")));
    let watch = Watch::start(&agent, dir.path());
    poll_until("the watch prints the events so far", || {
        watch.printed().contains("jail/first")
    });
    assert!(
        !watch.printed().contains("jail/second"),
        "{}",
        watch.printed()
    );

    ok(&agent, &["apply", "-f", "-"], Some(&sleeper("second")));
    poll_until("the watch prints the new jail's start", || {
        watch
            .printed()
            .lines()
            .any(|l| l.contains("Started") && l.contains("jail/second"))
    });
    let printed = watch.printed();
    assert_eq!(
        printed.matches("LAST SEEN").count(),
        1,
        "headers once: {printed}"
    );
    assert_eq!(
        printed
            .lines()
            .filter(|l| l.contains("Created") && l.contains("jail/first"))
            .count(),
        1,
        "each event once: {printed}"
    );
}

#[test]
fn the_controlplane_merges_a_node_death_the_reschedule_and_the_new_replica_s_start() {
    let mut cluster = Cluster::standard(2);
    cluster.wait_alive(2);
    let port = free_port(std::net::Ipv4Addr::LOCALHOST);
    let doc = service_doc("web", 2, port, "/bin/sleep, '300'");
    let applied = cluster.keelctl_with(&["apply", "-f", "-"], Some(&doc));
    assert_eq!(applied.code, 0, "{applied:?}\n{}", cluster.logs());

    let get = |cluster: &Cluster| -> (Run, Vec<Event>) {
        let run = cluster.keelctl(&["get", "events", "-o", "json"]);
        let listed = events(&run.stdout);
        (run, listed)
    };
    // Both replicas placed and started, each on its node.
    let scheduled = cluster.wait_for("both replicas started", || {
        let (run, listed) = get(&cluster);
        assert_eq!(run.code, 0, "{run:?}");
        let started = |replica: &str| {
            listed.iter().any(|e| {
                e.reason == "Started" && e.name == replica && e.source.as_deref() == Some(&e.node)
            })
        };
        (started("web-0") && started("web-1")).then_some(listed)
    });
    let victim_of = |replica: &str| {
        scheduled
            .iter()
            .find(|e| e.reason == "Scheduled" && e.name == replica)
            .map(|e| e.node.clone())
            .unwrap_or_else(|| panic!("Scheduled {replica}: {scheduled:?}"))
    };
    let victim = victim_of("web-0");
    let survivor = if victim == "n1" { "n2" } else { "n1" };
    assert_eq!(victim_of("web-1"), survivor, "spread: {scheduled:?}");

    cluster.kill9_agent(&victim);
    let seen = cluster.wait_for("NodeDead, Rescheduled and the new start", || {
        let (run, listed) = get(&cluster);
        let dead = listed.iter().any(|e| {
            e.reason == "NodeDead"
                && e.name == victim
                && e.event_type == EventType::Warning
                && e.source.as_deref() == Some("controlplane")
        });
        let moved = listed
            .iter()
            .any(|e| e.reason == "Rescheduled" && e.name == "web-0" && e.node == survivor);
        let started_again = listed.iter().any(|e| {
            e.reason == "Started" && e.name == "web-0" && e.source.as_deref() == Some(survivor)
        });
        (dead && moved && started_again).then_some(run)
    });
    // The Dead node's events are missing, and the listing says so.
    assert_eq!(seen.code, 1, "{seen:?}");
    assert!(seen.stderr.contains(&format!("node {victim}")), "{seen:?}");
    let log = cluster.logs();
    assert!(
        log.contains(&format!("NodeDead node/{victim}")) && log.contains("Rescheduled jail/web-0"),
        "the control plane's log tells the death and the reschedule:\n{log}"
    );

    // The control plane's own events outlive it.
    let before: Vec<Event> = get(&cluster)
        .1
        .into_iter()
        .filter(|e| e.source.as_deref() == Some("controlplane"))
        .collect();
    assert!(before.iter().any(|e| e.reason == "NodeDead"), "{before:?}");
    cluster.restart_controlplane();
    let after = get(&cluster).1;
    for event in &before {
        assert!(after.contains(event), "{event:?} lost in\n{after:?}");
    }
}

#[test]
fn a_watch_through_the_controlplane_prints_a_node_s_new_event_once() {
    let cluster = Cluster::standard(2);
    cluster.wait_alive(2);
    let dir = tempfile::tempdir().expect("tempdir");
    let first = cluster.keelctl_with(
        &["apply", "-f", "-", "--node", "n1"],
        Some(&sleeper("first")),
    );
    assert_eq!(first.code, 0, "{first:?}");
    let watch = Watch::through(&cluster, dir.path());
    poll_until("the watch prints n1's events so far", || {
        watch.printed().contains("jail/first")
    });
    // An event on the other node: its heartbeat reports the new number,
    // which ends the watch's wait on the control plane, which then asks n2
    // for what is new.
    let second = cluster.keelctl_with(
        &["apply", "-f", "-", "--node", "n2"],
        Some(&sleeper("second")),
    );
    assert_eq!(second.code, 0, "{second:?}");
    poll_until("the watch prints n2's start of the new jail", || {
        watch
            .printed()
            .lines()
            .any(|l| l.contains("Started") && l.contains("jail/second") && l.contains("n2"))
    });
    let printed = watch.printed();
    for (reason, jail) in [("Created", "jail/first"), ("Started", "jail/second")] {
        assert_eq!(
            printed
                .lines()
                .filter(|l| l.contains(reason) && l.contains(jail))
                .count(),
            1,
            "{reason} {jail} once: {printed}"
        );
    }
}

#[test]
fn get_jails_w_prints_a_row_for_each_change_and_the_deletion() {
    let agent = Agent::start(AGENT_ARGS);
    let dir = tempfile::tempdir().expect("tempdir");
    ok(&agent, &["apply", "-f", "-"], Some(&sleeper("first")));
    let watch = Watch::start_with(&agent, dir.path(), &["get", "jails", "-w"]);
    poll_until("the listing", || watch.printed().contains("first"));
    assert!(watch.printed().starts_with("NAME "), "{}", watch.printed());

    ok(&agent, &["apply", "-f", "-"], Some(&sleeper("second")));
    poll_until("a row for the new jail, then it runs", || {
        watch
            .printed()
            .lines()
            .any(|l| l.starts_with("second ") && l.contains("Running"))
    });
    ok(&agent, &["delete", "jail", "second"], None);
    poll_until("its deletion", || {
        watch.printed().lines().any(|l| l == "jail/second deleted")
    });
    let printed = watch.printed();
    assert_eq!(printed.matches("NAME ").count(), 1, "one header: {printed}");
}

#[test]
fn get_services_w_through_the_controlplane_follows_a_scale() {
    let cluster = Cluster::standard(2);
    cluster.wait_alive(2);
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port(std::net::Ipv4Addr::LOCALHOST);
    let doc = service_doc("web", 1, port, "/bin/sleep, '300'");
    let applied = cluster.keelctl_with(&["apply", "-f", "-"], Some(&doc));
    assert_eq!(applied.code, 0, "{applied:?}");
    let watch = Watch::through_with(&cluster, dir.path(), &["get", "services", "-w"]);
    poll_until("the listing", || watch.printed().contains("web "));
    let scaled = cluster.keelctl(&["scale", "service", "web", "--replicas", "2"]);
    assert_eq!(scaled.code, 0, "{scaled:?}");
    // A row per change; the last ones show both replicas ready.
    poll_until("a row with 2/2 ready", || {
        watch
            .printed()
            .lines()
            .skip(1)
            .any(|l| l.starts_with("web ") && l.contains("2/2"))
    });
}
