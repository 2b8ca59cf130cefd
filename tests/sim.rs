//! The simulated host of `keel-agentd --simulate`: real processes as jails,
//! directories as datasets, symlinks as nullfs mounts. Every process a test
//! starts is removed by a [`Reaper`] even when the test fails.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use keel::common::cmd::argv;
use keel::host::jail::{JailError, JailNetwork, JailParams, Limits, Removal};
use keel::host::mount::MountError;
use keel::host::sim::{SimHost, SimJails};
use keel::host::zfs::{Dataset, ZfsError, ZfsLayout};
use keel::host::{JailRuntime, MountManager, ZfsManager};

struct Sim {
    dir: tempfile::TempDir,
    host: SimHost,
}

impl Sim {
    fn new() -> Sim {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = SimHost::new(&dir.path().join("state"), layout(dir.path())).expect("opens");
        Sim { dir, host }
    }

    /// A second agent over the same state: what a restart sees.
    fn reopen(&self) -> SimHost {
        SimHost::new(&self.state(), layout(self.dir.path())).expect("reopens")
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn reaper(&self) -> Reaper {
        Reaper(vec![self.host.jails.clone()])
    }

    fn params(&self, name: &str, start: &[&str]) -> JailParams {
        JailParams {
            name: name.into(),
            path: self.host.zfs.layout().rootfs_path(name),
            hostname: name.into(),
            network: None,
            exec_start: argv(start),
            exec_stop: Vec::new(),
            env: BTreeMap::new(),
        }
    }
}

fn layout(root: &Path) -> ZfsLayout {
    ZfsLayout {
        pool: "zroot".into(),
        jails_dir: root.join("jails"),
        volumes_dir: root.join("volumes"),
    }
}

/// Removes every jail of the runtimes it holds when dropped.
struct Reaper(Vec<SimJails>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for jails in &self.0 {
            for jail in jails.list().unwrap_or_default() {
                let _ = jails.remove(&jail.name, &jail.path, Removal::Force);
            }
        }
    }
}

fn wait_for<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A complete line the workload wrote to `file`.
fn wait_for_file(file: &Path) -> String {
    wait_for(&file.display().to_string(), || {
        std::fs::read_to_string(file)
            .ok()
            .filter(|t| t.ends_with('\n'))
    })
}

/// True while `pid` is a live, non-zombie process.
#[cfg(target_os = "linux")]
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next();
        !matches!(state, Some("Z" | "X") | None)
    })
}

const SLEEPER: &str = "exec sleep 30";

#[test]
fn create_runs_exec_start_with_the_jail_environment() {
    let s = Sim::new();
    let _reaper = s.reaper();
    let script = format!("echo \"$KEEL_JAIL_NAME $KEEL_JAIL_ADDRESS $GREETING\" > out; {SLEEPER}");
    let mut web = s.params("web-1", &["/bin/sh", "-c", &script]);
    web.network = Some(JailNetwork {
        interface: "kj_web-1".into(),
        address: Ipv4Addr::new(10, 20, 3, 15),
        prefix_len: 24,
        gateway: Ipv4Addr::new(10, 20, 3, 1),
    });
    web.env.insert("GREETING".into(), "hello".into());
    s.host.jails.create(&web).expect("creates");
    assert_eq!(
        wait_for_file(&web.path.join("out")),
        "web-1 10.20.3.15 hello\n"
    );

    let bare = s.params(
        "bare",
        &[
            "/bin/sh",
            "-c",
            &format!("echo \"[$KEEL_JAIL_ADDRESS]\" > out; {SLEEPER}"),
        ],
    );
    s.host.jails.create(&bare).expect("creates");
    assert_eq!(wait_for_file(&bare.path.join("out")), "[]\n");

    let listed = s.host.jails.list().expect("lists");
    let summary: Vec<(&str, &Path, bool)> = listed
        .iter()
        .map(|j| (j.name.as_str(), j.path.as_path(), j.running))
        .collect();
    assert_eq!(
        summary,
        vec![
            ("bare", bare.path.as_path(), true),
            ("web-1", web.path.as_path(), true)
        ]
    );
    assert_ne!(listed[0].jid, listed[1].jid);
    assert_eq!(
        s.host.jails.create(&web),
        Err(JailError::AlreadyExists("web-1".into()))
    );
    let log = std::fs::read_to_string(s.host.jails.log_path("web-1")).expect("log");
    assert!(log.contains("keel-sim: starting /bin/sh -c"), "{log}");
}

#[test]
fn workload_output_goes_to_the_jail_log() {
    let s = Sim::new();
    let _reaper = s.reaper();
    let p = s.params(
        "web",
        &[
            "/bin/sh",
            "-c",
            &format!("echo to-stdout; echo to-stderr >&2; touch done; {SLEEPER}"),
        ],
    );
    s.host.jails.create(&p).expect("creates");
    wait_for("done", || p.path.join("done").exists().then_some(()));
    let log = std::fs::read_to_string(s.host.jails.log_path("web")).expect("log");
    assert!(
        log.contains("to-stdout\n") && log.contains("to-stderr\n"),
        "{log}"
    );
}

#[test]
fn an_exited_workload_is_a_jail_that_is_not_running() {
    let s = Sim::new();
    let _reaper = s.reaper();
    let p = s.params("crashy", &["/bin/sh", "-c", "exit 3"]);
    s.host.jails.create(&p).expect("creates");
    let listed = wait_for("crashy to stop", || {
        let l = s.host.jails.list().expect("lists");
        (!l[0].running).then_some(l)
    });
    assert_eq!(listed.len(), 1, "the jail persists after its process exits");
    assert_eq!(listed[0].name, "crashy");
    let log = std::fs::read_to_string(s.host.jails.log_path("crashy")).expect("log");
    assert!(
        log.contains("keel-sim: exec.start exited with status 3"),
        "{log}"
    );

    s.host
        .jails
        .remove("crashy", &p.path, Removal::Force)
        .expect("removes");
    assert!(s.host.jails.list().expect("lists").is_empty());
    s.host.jails.create(&p).expect("can be created again");
}

#[test]
fn removing_an_unknown_jail_succeeds() {
    let s = Sim::new();
    let root = Path::new("/nonexistent/ghost");
    assert_eq!(s.host.jails.remove("ghost", root, Removal::Stop), Ok(()));
    assert_eq!(s.host.jails.remove("ghost", root, Removal::Force), Ok(()));
}

#[test]
fn a_jail_without_exec_start_is_refused() {
    let s = Sim::new();
    let err = s
        .host
        .jails
        .create(&s.params("idle", &[]))
        .expect_err("refused");
    assert!(err.to_string().contains("exec.start"), "{err}");
    assert!(s.host.jails.list().expect("lists").is_empty());
}

#[cfg(target_os = "linux")]
#[test]
fn remove_runs_exec_stop_then_stops_the_whole_process_group() {
    let s = Sim::new();
    let _reaper = s.reaper();
    let mut p = s.params(
        "db",
        &[
            "/bin/sh",
            "-c",
            &format!("sleep 30 & echo $! > child.pid; {SLEEPER}"),
        ],
    );
    p.exec_stop = argv(&[
        "/bin/sh",
        "-c",
        "echo \"stopped $KEEL_JAIL_NAME\" > stopped",
    ]);
    s.host.jails.create(&p).expect("creates");
    let child: u32 = wait_for_file(&p.path.join("child.pid"))
        .trim()
        .parse()
        .expect("pid");
    let leader = s.host.jails.list().expect("lists")[0].jid;
    assert!(alive(leader) && alive(child));

    s.host
        .jails
        .remove("db", &p.path, Removal::Stop)
        .expect("removes");
    assert_eq!(
        std::fs::read_to_string(p.path.join("stopped")).expect("exec.stop ran"),
        "stopped db\n"
    );
    assert!(!alive(leader), "the workload was stopped");
    assert!(!alive(child), "its background child was stopped too");
    assert!(s.host.jails.list().expect("lists").is_empty());
}

/// A forced removal (the reconciler's for a crashed workload, or after a
/// failed exec.stop) runs no exec.stop, and still stops what is left.
#[cfg(target_os = "linux")]
#[test]
fn a_forced_remove_runs_no_exec_stop() {
    let s = Sim::new();
    let _reaper = s.reaper();
    let mut p = s.params("db", &["/bin/sh", "-c", SLEEPER]);
    p.exec_stop = argv(&["/bin/sh", "-c", "echo stopped > stopped"]);
    s.host.jails.create(&p).expect("creates");
    let leader = s.host.jails.list().expect("lists")[0].jid;
    s.host
        .jails
        .remove("db", &p.path, Removal::Force)
        .expect("removes");
    assert!(!p.path.join("stopped").exists(), "exec.stop did not run");
    assert!(!alive(leader), "the workload was stopped");
    assert!(s.host.jails.list().expect("lists").is_empty());
}

#[cfg(target_os = "linux")]
#[test]
fn a_workload_ignoring_sigterm_is_killed() {
    let s = Sim::new();
    let _reaper = s.reaper();
    // An ignored signal stays ignored across exec, so sleep ignores SIGTERM.
    let p = s.params(
        "stubborn",
        &[
            "/bin/sh",
            "-c",
            &format!("trap '' TERM; touch ready; {SLEEPER}"),
        ],
    );
    s.host.jails.create(&p).expect("creates");
    wait_for("ready", || p.path.join("ready").exists().then_some(()));
    let pid = s.host.jails.list().expect("lists")[0].jid;
    s.host
        .jails
        .remove("stubborn", &p.path, Removal::Stop)
        .expect("removes");
    assert!(!alive(pid));
    let log = std::fs::read_to_string(s.host.jails.log_path("stubborn")).expect("log");
    assert!(log.contains("sending SIGKILL"), "{log}");
}

#[test]
fn a_restarted_agent_finds_running_jails_and_does_not_start_them_again() {
    let s = Sim::new();
    let mut reaper = s.reaper();
    let p = s.params(
        "web",
        &[
            "/bin/sh",
            "-c",
            &format!("echo started >> starts; {SLEEPER}"),
        ],
    );
    s.host.jails.create(&p).expect("creates");
    let crashy = s.params("crashy", &["/bin/sh", "-c", "touch ran; exit 0"]);
    s.host.jails.create(&crashy).expect("creates");
    wait_for_file(&p.path.join("starts"));
    wait_for("crashy ran", || {
        crashy.path.join("ran").exists().then_some(())
    });
    let before = s.host.jails.list().expect("lists");

    let restarted = s.reopen();
    reaper.0.push(restarted.jails.clone());
    let after = wait_for("crashy's exit to show", || {
        let l = restarted.jails.list().expect("lists");
        (!l[0].running).then_some(l)
    });
    let web = &after[1];
    assert_eq!(
        (web.name.as_str(), web.running, web.jid),
        ("web", true, before[1].jid)
    );
    assert_eq!(
        after[0].name, "crashy",
        "a jail whose process exited stays listed"
    );
    assert_eq!(
        restarted.jails.create(&p),
        Err(JailError::AlreadyExists("web".into()))
    );
    assert_eq!(
        std::fs::read_to_string(p.path.join("starts")).expect("starts"),
        "started\n"
    );

    restarted
        .jails
        .remove("web", &web.path, Removal::Stop)
        .expect("removes a jail it did not spawn");
    #[cfg(target_os = "linux")]
    assert!(!alive(web.jid));
    assert_eq!(restarted.jails.list().expect("lists").len(), 1);
}

#[cfg(target_os = "linux")]
#[test]
fn a_reused_pid_is_neither_running_nor_signalled() {
    let s = Sim::new();
    let _reaper = s.reaper();
    let p = s.params("web", &["/bin/sh", "-c", SLEEPER]);
    s.host.jails.create(&p).expect("creates");
    let pid = s.host.jails.list().expect("lists")[0].jid;

    // Pretend the recorded process started at another time: the pid now
    // names someone else's process.
    let file = s.state().join("sim-jails.json");
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&file).expect("state")).expect("json");
    let start = &mut state["jails"]["web"]["start_time"];
    *start = serde_json::json!(start.as_u64().expect("linux records a start time") + 1);
    std::fs::write(&file, serde_json::to_vec(&state).expect("json")).expect("write");

    let restarted = SimJails::new(&s.state()).expect("opens");
    let listed = restarted.list().expect("lists");
    assert_eq!((listed[0].name.as_str(), listed[0].running), ("web", false));
    restarted
        .remove("web", &p.path, Removal::Stop)
        .expect("forgets the jail");
    assert!(
        alive(pid),
        "a process that is not provably ours is never signalled"
    );
    assert!(restarted.list().expect("lists").is_empty());

    s.host
        .jails
        .remove("web", &p.path, Removal::Stop)
        .expect("the spawning agent still knows it");
    assert!(!alive(pid));
}

#[test]
fn exec_runs_in_the_jail_directory_with_its_environment() {
    let s = Sim::new();
    let _reaper = s.reaper();
    let p = s.params("web", &["/bin/sh", "-c", SLEEPER]);
    s.host.jails.create(&p).expect("creates");
    let out = s
        .host
        .jails
        .exec(
            "web",
            &argv(&["/bin/sh", "-c", "pwd; echo $KEEL_JAIL_NAME; exit 2"]),
        )
        .expect("runs");
    let dir = p.path.canonicalize().expect("canonical");
    assert_eq!(out.stdout, format!("{}\nweb\n", dir.display()));
    assert_eq!(out.status, 2);
    let err = s
        .host
        .jails
        .exec("ghost", &argv(&["/bin/true"]))
        .expect_err("unknown");
    assert!(err.to_string().contains("ghost"), "{err}");
}

#[test]
fn limits_are_recorded_and_survive_a_restart() {
    let s = Sim::new();
    let limits = Limits {
        cpu: Some(1.5),
        memory: Some(512 << 20),
    };
    s.host.jails.set_limits("web", &limits).expect("sets");
    assert_eq!(s.host.jails.limits("web"), Some(limits));
    assert_eq!(s.reopen().jails.limits("web"), Some(limits));
    s.host.jails.clear_limits("web").expect("clears");
    s.host
        .jails
        .clear_limits("web")
        .expect("clearing nothing is fine");
    assert_eq!(s.reopen().jails.limits("web"), None);
}

#[test]
fn volume_data_survives_destroying_the_rootfs_it_was_mounted_in() {
    let s = Sim::new();
    let (zfs, mounts) = (&s.host.zfs, &s.host.mounts);
    let volume = zfs.create_volume("pgdata", Some(1 << 20)).expect("volume");
    std::fs::write(volume.join("before"), "kept").expect("write");
    let rootfs = zfs.clone_rootfs("14.2-RELEASE", "db").expect("rootfs");
    let target = rootfs.join("var/db/postgres");
    mounts
        .mount_nullfs(&volume, &rootfs, &target)
        .expect("mounts");
    std::fs::write(target.join("through-mount"), "also kept").expect("write via mount");

    let busy = zfs
        .destroy_rootfs("db")
        .expect_err("volume still mounted inside");
    assert!(
        matches!(&busy, ZfsError::Busy { dataset, .. } if dataset == "zroot/keel/jails/db"),
        "{busy}"
    );
    let busy = zfs
        .destroy_volume("pgdata")
        .expect_err("volume still mounted");
    assert!(matches!(busy, ZfsError::Busy { .. }), "{busy}");

    mounts.unmount(&target).expect("unmounts");
    assert!(mounts.list().expect("lists").is_empty());
    zfs.destroy_rootfs("db").expect("destroys");
    assert!(!rootfs.exists());
    assert_eq!(
        std::fs::read_to_string(volume.join("before")).expect("kept"),
        "kept"
    );
    assert_eq!(
        std::fs::read_to_string(volume.join("through-mount")).expect("kept"),
        "also kept"
    );
    zfs.destroy_rootfs("db")
        .expect("an absent rootfs is success");
}

#[test]
fn destroying_a_rootfs_never_follows_a_leftover_link() {
    let s = Sim::new();
    let volume = s.host.zfs.create_volume("data", None).expect("volume");
    std::fs::write(volume.join("precious"), "x").expect("write");
    let rootfs = s
        .host
        .zfs
        .clone_rootfs("14.2-RELEASE", "web")
        .expect("rootfs");
    std::fs::create_dir_all(rootfs.join("srv")).expect("mkdir");
    // A link no mount registered (say, from a crash): removal must unlink it,
    // not descend into it.
    std::os::unix::fs::symlink(&volume, rootfs.join("srv/data")).expect("link");
    s.host.zfs.destroy_rootfs("web").expect("destroys");
    assert!(!rootfs.exists());
    assert!(volume.join("precious").exists());
}

#[test]
fn destroying_an_absent_volume_is_not_found() {
    let s = Sim::new();
    assert_eq!(
        s.host.zfs.destroy_volume("nope"),
        Err(ZfsError::NotFound("zroot/keel/volumes/nope".into()))
    );
}

#[test]
fn list_names_datasets_and_counts_their_bytes() {
    let s = Sim::new();
    let zfs = &s.host.zfs;
    let pg = zfs.create_volume("pgdata", Some(10 << 30)).expect("volume");
    std::fs::create_dir_all(pg.join("base/1")).expect("mkdir");
    std::fs::write(pg.join("base/1/heap"), vec![0u8; 1000]).expect("write");
    std::fs::write(pg.join("pg_hba.conf"), vec![0u8; 24]).expect("write");
    let cache = zfs.create_volume("cache", None).expect("volume");
    let web = zfs.clone_rootfs("14.2-RELEASE", "web").expect("rootfs");
    std::fs::write(web.join("index.html"), "0123456789").expect("write");
    s.host
        .mounts
        .mount_nullfs(&pg, &web, &web.join("data"))
        .expect("mounts");

    let listed = zfs.list().expect("lists");
    assert_eq!(
        listed,
        vec![
            Dataset {
                name: "zroot/keel/jails/web".into(),
                used: 10,
                quota: None,
                mountpoint: Some(web.clone()),
            },
            Dataset {
                name: "zroot/keel/volumes/cache".into(),
                used: 0,
                quota: None,
                mountpoint: Some(cache),
            },
            Dataset {
                name: "zroot/keel/volumes/pgdata".into(),
                used: 1024,
                quota: Some(10 << 30),
                mountpoint: Some(pg.clone()),
            },
        ],
        "the mounted volume counts for itself only"
    );

    for (dataset, exists) in [
        ("zroot/keel/jails/web", true),
        ("zroot/keel/jails/db", false),
        ("zroot/keel/volumes/pgdata", true),
        ("zroot/keel/bases/14.2-RELEASE@keel", true),
        ("zroot/keel", true),
        ("tank/keel/jails/web", false),
        ("zroot/keel/jails/../volumes", false),
    ] {
        assert_eq!(zfs.dataset_exists(dataset), Ok(exists), "{dataset}");
    }

    assert_eq!(
        zfs.set_volume_quota("pgdata", Some(100)),
        Err(ZfsError::QuotaBelowUsed {
            dataset: "zroot/keel/volumes/pgdata".into(),
            quota: 100,
            used: 1024,
        })
    );
    zfs.set_volume_quota("pgdata", None).expect("unsets");
    let reopened = s.reopen();
    let quotas: Vec<Option<u64>> = reopened
        .zfs
        .list()
        .expect("lists")
        .iter()
        .map(|d| d.quota)
        .collect();
    assert_eq!(quotas, vec![None, None, None]);
    // As with `zfs clone -p` and `zfs create -p`, creating again is success
    // and changes nothing: the data and the (now unset) quota stay.
    assert_eq!(zfs.clone_rootfs("14.2-RELEASE", "web"), Ok(web.clone()));
    assert_eq!(zfs.create_volume("pgdata", Some(1 << 30)), Ok(pg.clone()));
    assert!(web.join("index.html").is_file() && pg.join("pg_hba.conf").is_file());
    let pg_quota = zfs
        .list()
        .expect("lists")
        .into_iter()
        .find(|d| d.name == "zroot/keel/volumes/pgdata")
        .map(|d| d.quota);
    assert_eq!(pg_quota, Some(None), "an existing volume keeps its quota");
    // Something other than a directory in a dataset's place is refused.
    std::os::unix::fs::symlink(&pg, s.host.zfs.layout().rootfs_path("planted")).expect("link");
    assert!(
        zfs.clone_rootfs("14.2-RELEASE", "planted").is_err(),
        "a link in a rootfs's place is refused"
    );
}

#[test]
fn mounts_survive_a_restart_and_unmount_removes_only_the_link() {
    let s = Sim::new();
    let volume = s.host.zfs.create_volume("data", None).expect("volume");
    std::fs::write(volume.join("file"), "x").expect("write");
    let rootfs = s
        .host
        .zfs
        .clone_rootfs("14.2-RELEASE", "web")
        .expect("rootfs");
    let target = rootfs.join("srv/data");
    std::fs::create_dir_all(&target).expect("an empty mount point");
    s.host
        .mounts
        .mount_nullfs(&volume, &rootfs, &target)
        .expect("mounts");
    s.host
        .mounts
        .mount_nullfs(&volume, &rootfs, &target)
        .expect("mounting again is success");
    assert_eq!(
        std::fs::read_to_string(target.join("file")).expect("visible"),
        "x"
    );

    let restarted = s.reopen();
    let listed = restarted.mounts.list().expect("lists");
    let pairs: Vec<(&Path, &Path, &str)> = listed
        .iter()
        .map(|m| (m.source.as_path(), m.target.as_path(), m.fstype.as_str()))
        .collect();
    assert_eq!(pairs, vec![(volume.as_path(), target.as_path(), "nullfs")]);
    assert!(matches!(
        restarted.zfs.destroy_volume("data"),
        Err(ZfsError::Busy { .. })
    ));

    restarted.mounts.faults().fail_times("unmount", None, 1);
    assert!(matches!(
        restarted.mounts.unmount(&target),
        Err(MountError::Busy { .. })
    ));
    restarted.mounts.unmount(&target).expect("unmounts");
    restarted
        .mounts
        .unmount(&target)
        .expect("not mounted is success");
    assert!(
        std::fs::symlink_metadata(&target).is_err(),
        "the link is gone"
    );
    assert!(volume.join("file").exists(), "the data is not");
    assert!(s.reopen().mounts.list().expect("lists").is_empty());
}

#[test]
fn mounting_over_a_non_empty_directory_is_refused() {
    let s = Sim::new();
    let volume = s.host.zfs.create_volume("data", None).expect("volume");
    let rootfs = s
        .host
        .zfs
        .clone_rootfs("14.2-RELEASE", "web")
        .expect("rootfs");
    let target = rootfs.join("srv");
    std::fs::create_dir_all(&target).expect("mkdir");
    std::fs::write(target.join("existing"), "x").expect("write");
    let err = s
        .host
        .mounts
        .mount_nullfs(&volume, &rootfs, &target)
        .expect_err("refused");
    assert!(err.to_string().contains("not an empty directory"), "{err}");
    assert!(target.join("existing").exists());
    assert!(s.host.mounts.list().expect("lists").is_empty());
}

/// The usage probe sums the jail's whole process group from /proc: CPU time
/// a busy loop spent, resident memory of every member; a removed jail and a
/// name with no jail have no usage.
#[cfg(target_os = "linux")]
#[test]
fn usage_is_the_process_groups_cpu_time_and_resident_memory() {
    use keel::host::usage::UsageProbe;

    let s = Sim::new();
    let _reaper = s.reaper();
    let busy = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; sleep 30 & exec sleep 30";
    let p = s.params("busy", &["/bin/sh", "-c", busy]);
    s.host.jails.create(&p).expect("creates");
    let probe = s.host.jails.usage_probe();
    let names = ["busy".to_string(), "nobody".to_string()];
    let usage = wait_for("the busy loop's CPU time", || {
        let usage = probe.sample(&names).expect("samples");
        usage
            .get("busy")
            .is_some_and(|u| u.cpu_seconds >= 0.05)
            .then_some(usage)
    });
    assert!(usage["busy"].memory_bytes > 0, "{usage:?}");
    assert!(!usage.contains_key("nobody"), "{usage:?}");

    s.host
        .jails
        .remove("busy", &p.path, Removal::Force)
        .expect("removes");
    let after = probe.sample(&names).expect("samples");
    assert!(after.is_empty(), "{after:?}");
}

#[test]
fn get_shows_one_jail_as_list_does_and_a_missing_one_as_absent() {
    let s = Sim::new();
    let _reaper = s.reaper();
    assert_eq!(s.host.jails.get("web"), Ok(None));
    let up = s.params("web", &["/bin/sleep", "300"]);
    s.host.jails.create(&up).expect("creates");
    let crashy = s.params("crashy", &["/bin/sh", "-c", "exit 3"]);
    s.host.jails.create(&crashy).expect("creates");
    let gone = wait_for("crashy to stop", || {
        let j = s.host.jails.get("crashy").expect("looks up")?;
        (!j.running).then_some(j)
    });
    assert_eq!(gone.exit_status, Some(3));
    let web = s.host.jails.get("web").expect("looks up").expect("present");
    assert!(web.running);
    let listed = s.host.jails.list().expect("lists");
    assert!(
        listed.contains(&web) && listed.contains(&gone),
        "{listed:?}"
    );
}

#[test]
fn list_named_shows_only_the_named_datasets_that_exist() {
    let s = Sim::new();
    let zfs = &s.host.zfs;
    let pg = zfs.create_volume("pgdata", Some(10 << 30)).expect("volume");
    std::fs::write(pg.join("heap"), vec![0u8; 100]).expect("write");
    zfs.create_volume("other", None).expect("volume");
    let web = zfs.clone_rootfs("14.2-RELEASE", "web").expect("rootfs");
    let names = [
        "zroot/keel/jails/web",
        "zroot/keel/volumes/pgdata",
        "zroot/keel/volumes/missing",
        "zroot/keel/jails/../volumes",
    ]
    .map(String::from);
    assert_eq!(
        zfs.list_named(&names).expect("lists"),
        vec![
            Dataset {
                name: "zroot/keel/jails/web".into(),
                used: 0,
                quota: None,
                mountpoint: Some(web),
            },
            Dataset {
                name: "zroot/keel/volumes/pgdata".into(),
                used: 100,
                quota: Some(10 << 30),
                mountpoint: Some(pg),
            },
        ]
    );
}

#[test]
fn list_under_shows_only_the_mounts_in_one_root() {
    let s = Sim::new();
    let volume = s.host.zfs.create_volume("data", None).expect("volume");
    let mut roots = Vec::new();
    for jail in ["web", "web-10"] {
        let root = s
            .host
            .zfs
            .clone_rootfs("14.2-RELEASE", jail)
            .expect("rootfs");
        let target = root.join("srv/data");
        std::fs::create_dir_all(&target).expect("mount point");
        s.host
            .mounts
            .mount_nullfs(&volume, &root, &target)
            .expect("mounts");
        roots.push((root, target));
    }
    let (root, target) = &roots[0];
    let under: Vec<PathBuf> = s
        .host
        .mounts
        .list_under(root)
        .expect("lists")
        .into_iter()
        .map(|m| m.target)
        .collect();
    assert_eq!(under, std::slice::from_ref(target));
}
