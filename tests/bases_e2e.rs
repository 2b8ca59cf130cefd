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
//! download; a jail applied on the fetched base runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use keel::common::wire::{BaseState, BaseStatus, JailStatus, Phase};
use sha2::{Digest, Sha256};

use crate::util::agent::Agent;
use crate::util::cluster::{Run, run};
use crate::util::poll_until;

const KEELCTL: &str = env!("CARGO_BIN_EXE_keelctl");

fn keelctl(agent: &Agent, args: &[&str], stdin: Option<&str>) -> Run {
    let mut cmd = Command::new(KEELCTL);
    cmd.args(args)
        .current_dir(agent.dir())
        .env("KEEL_SOCKET", agent.socket());
    run(cmd, stdin)
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

/// `mirror/RELEASE/{base.txz,MANIFEST}`, the MANIFEST in make-manifest.sh's
/// format giving `manifest_sum` for base.txz.
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
        !agent.state_dir().join("bases/14.3-RELEASE").exists(),
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
    assert!(!agent.state_dir().join("bases/15.0-RELEASE").exists());
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
