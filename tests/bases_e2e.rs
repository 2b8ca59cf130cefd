//! `keelctl base fetch` end to end: the real keelctl and a real
//! `keel-agentd --simulate` whose `agent.base_mirror` is a `file://`
//! directory laid out like a FreeBSD mirror (`RELEASE/MANIFEST`,
//! `RELEASE/base.txz`), holding a small base.txz the test builds with the
//! system's tar(1) and xz(1). The simulated host extracts it for real, so
//! "installed" is read as "its files are in the base directory".
//!
//! Covered: a fetch installs the base with its `@keel` snapshot and `get
//! bases` shows it; a second fetch is a no-op (it succeeds with the tarball
//! gone from the mirror); a tarball that does not match its MANIFEST is
//! refused naming the checksum mismatch and leaves no dataset and no
//! download; a jail applied on the fetched base runs. Through the control
//! plane (`--node`, forwarded to the node): a fetch cut short by `kill -9` of
//! the agent in the middle of its extraction (a fault stalls it there) leaves
//! a `Partial` base and never a `@keel` snapshot, and the next fetch destroys
//! and redoes it; without `--node` nothing is sent.

use std::path::{Path, PathBuf};
use std::process::Command;

use std::net::{Ipv4Addr, SocketAddr};

use keel::common::faults::ENV as FAULTS;
use keel::common::wire::{BaseState, BaseStatus, JailStatus, Phase};
use sha2::{Digest, Sha256};

use crate::util::agent::Agent;
use crate::util::cluster::{Cluster, Run, free_port, node_ip, standard_controlplane_args};
use crate::util::poll_until;

fn keelctl(agent: &Agent, args: &[&str], stdin: Option<&str>) -> Run {
    agent.keelctl(args, stdin)
}

fn ok(agent: &Agent, args: &[&str]) -> String {
    let run = keelctl(agent, args, None);
    assert_eq!(run.code, 0, "keelctl {args:?}: {run:?}\n{}", agent.log());
    run.stdout
}

fn bases(agent: &Agent) -> Vec<BaseStatus> {
    let json = ok(agent, &["get", "bases", "-o", "json"]);
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("get bases: {e}\n{json}"))
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A tiny base.txz: `./COPYRIGHT` and `./etc/rc.conf`, xz-compressed.
fn build_base_txz(dir: &Path) -> Vec<u8> {
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("etc")).expect("mkdir");
    std::fs::write(root.join("COPYRIGHT"), "test base\n").expect("write");
    std::fs::write(root.join("etc/rc.conf"), "hostname=\"\"\n").expect("write");
    let tarball = dir.join("base.txz");
    let status = Command::new("tar")
        .arg("-cJf")
        .arg(&tarball)
        .arg("-C")
        .arg(&root)
        .arg(".")
        .status()
        .expect("run tar (needs tar and xz)");
    assert!(status.success(), "tar -cJf failed");
    std::fs::read(&tarball).expect("read tarball")
}

/// `mirror/RELEASE/{base.txz,MANIFEST}`, the MANIFEST in the format of
/// FreeBSD's release build giving `manifest_sum` for base.txz.
fn publish(mirror: &Path, release: &str, tarball: &[u8], manifest_sum: &str) -> PathBuf {
    let dir = mirror.join(release);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("base.txz"), tarball).expect("tarball");
    std::fs::write(
        dir.join("MANIFEST"),
        format!(
            "base-dbg.txz\t{}\t2\tbase-dbg\t\"Base system (Debugging)\"\toff\n\
             base.txz\t{manifest_sum}\t3\tbase\t\"Base system (MANDATORY)\"\ton\n",
            "0".repeat(64)
        ),
    )
    .expect("manifest");
    dir.join("base.txz")
}

#[test]
fn base_fetch_installs_verifies_is_idempotent_and_a_jail_runs_on_it() {
    let work = tempfile::tempdir().expect("tempdir");
    let tarball = build_base_txz(work.path());
    let mirror = work.path().join("mirror");
    let published = publish(&mirror, "14.3-RELEASE", &tarball, &sha256(&tarball));
    publish(
        &mirror,
        "15.0-RELEASE",
        b"not the real base",
        &sha256(&tarball),
    );
    let config = work.path().join("keel.toml");
    std::fs::write(
        &config,
        format!(
            "[agent]\nbase_mirror = \"file://{}\"\nbase_archive = \"\"\n",
            mirror.display()
        ),
    )
    .expect("config");
    let agent = Agent::start(&[
        "--simulate",
        "--reconcile-interval",
        "200ms",
        "-c",
        config.to_str().expect("utf-8 path"),
    ]);
    let base_dir = agent.dir().join("keel-sim/bases/14.3-RELEASE");

    let fetched = ok(&agent, &["base", "fetch", "14.3-RELEASE"]);
    assert_eq!(fetched.trim(), "base/14.3-RELEASE fetched");
    assert_eq!(
        std::fs::read_to_string(base_dir.join("COPYRIGHT")).expect("extracted"),
        "test base\n"
    );
    let listed = bases(&agent);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].release, "14.3-RELEASE");
    assert_eq!(listed[0].state, BaseState::Ready);
    assert!(listed[0].snapshot);
    assert!(listed[0].used.is_some_and(|u| u > 0), "{listed:?}");
    let table = ok(&agent, &["get", "bases"]);
    assert!(
        table.contains("14.3-RELEASE") && table.contains("@keel"),
        "{table}"
    );
    assert!(
        !agent
            .state_dir()
            .join("base-downloads/14.3-RELEASE")
            .exists(),
        "the download is removed once extracted"
    );

    // Present with its snapshot: nothing is downloaded again.
    std::fs::remove_file(&published).expect("unpublish");
    let again = ok(&agent, &["base", "fetch", "14.3-RELEASE"]);
    assert_eq!(again.trim(), "base/14.3-RELEASE already present");

    let refused = keelctl(&agent, &["base", "fetch", "15.0-RELEASE"], None);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused.stderr.contains("checksum mismatch") && refused.stderr.contains(&sha256(&tarball)),
        "{refused:?}"
    );
    assert!(!agent.dir().join("keel-sim/bases/15.0-RELEASE").exists());
    assert!(
        !agent
            .state_dir()
            .join("base-downloads/15.0-RELEASE")
            .exists()
    );
    let failed = bases(&agent)
        .into_iter()
        .find(|b| b.release == "15.0-RELEASE")
        .expect("the failure is shown");
    assert_eq!(failed.state, BaseState::Failed);
    assert!(!failed.snapshot && failed.used.is_none(), "{failed:?}");

    let jail = "kind: Jail\nmetadata: {name: web}\nspec:\n  base: 14.3-RELEASE\n  \
                exec: {start: [/bin/sleep, '300']}\n";
    let applied = keelctl(&agent, &["apply", "-f", "-"], Some(jail));
    assert_eq!(applied.code, 0, "{applied:?}\n{}", agent.log());
    poll_until("jail web runs on the fetched base", || {
        let json = ok(&agent, &["get", "jails", "-o", "json"]);
        let jails: Vec<JailStatus> = serde_json::from_str(&json).expect("jails json");
        jails
            .iter()
            .any(|j| j.name == "web" && j.state == Phase::Running)
    });
}

/// `keel.toml` naming `mirror` (a directory) as the only base mirror.
fn mirror_config(dir: &Path, mirror: &Path) -> PathBuf {
    let config = dir.join("keel.toml");
    std::fs::write(
        &config,
        format!(
            "[agent]\nbase_mirror = \"file://{}\"\nbase_archive = \"\"\n",
            mirror.display()
        ),
    )
    .expect("config");
    config
}

fn cluster_bases(cluster: &Cluster) -> Vec<BaseStatus> {
    let run = cluster.keelctl(&["--node", "n1", "get", "bases", "-o", "json"]);
    assert_eq!(run.code, 0, "{run:?}\n{}", cluster.logs());
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("get bases: {e}\n{run:?}"))
}

#[test]
fn a_fetch_cut_short_through_the_control_plane_is_partial_and_the_next_one_redoes_it() {
    let work = tempfile::tempdir().expect("tempdir");
    let tarball = build_base_txz(work.path());
    let mirror = work.path().join("mirror");
    publish(&mirror, "14.5-RELEASE", &tarball, &sha256(&tarball));
    let config = mirror_config(work.path(), &mirror);

    let mut cluster = Cluster::new();
    let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)));
    let cp_args = standard_controlplane_args(listen);
    cluster.start_controlplane(&cp_args.iter().map(String::as_str).collect::<Vec<_>>());
    let ip = node_ip(1);
    let mut args = cluster.standard_agent_args("n1", SocketAddr::from((ip, free_port(ip))), ip);
    args.extend(["-c".to_string(), config.display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // Long enough to kill the agent inside it; the redo after the restart
    // waits it out once more.
    cluster.start_agent_with("n1", &[], &[(FAULTS, "sim.base.extract=sleep:10s")], &args);
    cluster.wait_for("node n1 registered", || {
        let run = cluster.keelctl(&["get", "nodes"]);
        (run.code == 0 && run.stdout.contains("n1")).then_some(())
    });

    let refused = cluster.keelctl(&["get", "bases"]);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("needs --node"), "{refused:?}");

    let started = cluster.keelctl(&["--node", "n1", "get", "bases"]).stderr;
    assert!(started.contains("No bases found."), "{started}");
    let put =
        keel::common::http::Client::new(keel::common::http::Endpoint::Unix(cluster.socket("n1")))
            .request("PUT", "/bases/14.5-RELEASE", &[], b"")
            .expect("start the fetch on the node");
    assert_eq!(put.status, 202, "{}", String::from_utf8_lossy(&put.body));
    cluster.wait_for("the fetch reaches its extraction", || {
        cluster_bases(&cluster)
            .into_iter()
            .find(|b| b.release == "14.5-RELEASE" && b.state == BaseState::Extracting)
    });
    cluster.kill9_agent("n1");
    cluster.restart_agent("n1");

    let partial = cluster_bases(&cluster);
    assert_eq!(partial.len(), 1, "{partial:?}");
    assert_eq!(partial[0].state, BaseState::Partial, "{partial:?}");
    assert!(!partial[0].snapshot, "never a @keel on a half base");

    let fetched = cluster.keelctl(&["--node", "n1", "base", "fetch", "14.5-RELEASE"]);
    assert_eq!(fetched.code, 0, "{fetched:?}\n{}", cluster.logs());
    assert_eq!(
        fetched.stdout.trim(),
        "base/14.5-RELEASE fetched on node n1"
    );
    assert!(fetched.stderr.contains("Extracting"), "{fetched:?}");
    let ready = cluster_bases(&cluster);
    assert_eq!(ready[0].state, BaseState::Ready, "{ready:?}");
    assert!(ready[0].snapshot);
    assert!(
        cluster
            .agent_log("n1")
            .contains("destroying the partial dataset"),
        "{}",
        cluster.agent_log("n1")
    );
}
