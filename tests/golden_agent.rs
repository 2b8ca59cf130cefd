//! Golden transcripts of the whole agent on the FreeBSD implementations
//! (tests/golden/agent_*.txt): a [`Reconciler`] over `FreeBsdJails`,
//! `FreeBsdZfs`, `FreeBsdNet` and `FreeBsdMounts` sharing one recording
//! runner applies a jail with two volumes to an empty host, runs a
//! steady-state pass, then deletes the jail.
//!
//! The three steps share the agent's state directory; each builds its agent
//! from what the previous step persisted, the way a restarted keel-agentd
//! does, so the steady pass is also the "agent restarted while its jail runs"
//! pass.
//!
//! Volumes: a changed `size` on a running jail's volume is one `zfs set
//! quota` after the observation (and a size below what the volume uses is
//! refused after the observation alone); `DELETE /volumes/{name}` reads the
//! datasets and the mounts, then destroys, retrying while busy.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use keel::agentd::reconciler::{NodeNetwork, Phase, Reconciler, STATE_FILE};
use keel::common::backoff::ManualClock;
use keel::common::cmd::RecordingRunner;
use keel::common::config::CommandPaths;
use keel::common::spec::{Jail, parse_jail};
use keel::common::store::Store;
use keel::host::jail::FreeBsdJails;
use keel::host::mount::FreeBsdMounts;
use keel::host::net::FreeBsdNet;
use keel::host::zfs::{FakeZfs, FreeBsdZfs};

use crate::util::golden;

type Runner = Arc<RecordingRunner>;
type FreeBsdAgent =
    Reconciler<FreeBsdJails<Runner>, FreeBsdZfs<Runner>, FreeBsdNet<Runner>, FreeBsdMounts<Runner>>;

/// Where the agent keeps jail.conf files in these transcripts. Fixed because
/// the path is part of the `jail -f` argv they record.
fn conf_dir() -> PathBuf {
    PathBuf::from("/tmp/keel-golden/agent")
}

/// An agent on the FreeBSD implementations, all four over `runner`, starting
/// from what `state_dir` holds.
fn agent(runner: Runner, state_dir: &Path) -> FreeBsdAgent {
    agent_with_confs(runner, state_dir, &conf_dir())
}

/// [`agent`] keeping its jail.conf files in `confs`: each test that reads or
/// writes them has its own directory, as tests run in parallel.
fn agent_with_confs(runner: Runner, state_dir: &Path, confs: &Path) -> FreeBsdAgent {
    let paths = CommandPaths::default();
    let (store, state) = Store::open(state_dir, STATE_FILE).expect("store opens");
    Reconciler::new(
        FreeBsdJails::new(runner.clone(), paths.clone(), confs),
        FreeBsdZfs::new(
            runner.clone(),
            paths.clone(),
            FakeZfs::default_layout(),
            3,
            Duration::ZERO,
        ),
        FreeBsdNet::new(runner.clone(), paths.clone()),
        FreeBsdMounts::new(runner, paths),
        NodeNetwork {
            bridge: "keel0".into(),
            subnet: "10.20.3.0/24".parse().expect("subnet"),
        },
        store,
        state,
        Box::new(ManualClock::new()),
    )
}

fn web() -> Jail {
    parse_jail(
        "kind: Jail\n\
         metadata: {name: web-1}\n\
         spec:\n\
         \x20 base: 14.2-RELEASE\n\
         \x20 resources: {cpu: 1.5, memory: 512M}\n\
         \x20 exec:\n\
         \x20   start: [/usr/local/sbin/nginx, -g, 'daemon off;']\n\
         \x20   stop: [/usr/local/sbin/nginx, -s, quit]\n\
         \x20 volumes:\n\
         \x20   - {name: web-content, mountPath: /usr/local/www, size: 1G}\n\
         \x20   - {name: web-logs, mountPath: /var/log/nginx}\n",
    )
    .expect("valid spec")
}

/// The most processes a steady-state pass may spawn (observation is batched:
/// docs/architecture.md, "Seams to the host"), whatever the number of jails.
const STEADY_PASS_PROCESSES: usize = 6;

#[test]
fn agent_provisions_keeps_and_deletes_a_jail_with_two_volumes() {
    let state = tempfile::tempdir().expect("tempdir");
    // The create writes the conf the delete then uses; start without one.
    // Only this jail's: other tests share the directory, run in parallel, and
    // a delete without its conf is a forced one (`jail -R`).
    let _ = std::fs::remove_file(conf_dir().join("web-1.conf"));

    golden::check("agent_provision", |runner| {
        let mut agent = agent(runner, state.path());
        let status = agent.apply(web(), None).expect("applied");
        assert_eq!(status.state, Phase::Starting);
        assert_eq!(status.address.to_string(), "10.20.3.2");
    });
    let conf = conf_dir().join("web-1.conf");
    let text = std::fs::read_to_string(&conf).expect("jail.conf written");
    assert!(text.contains("10.20.3.2/24"), "{text}");

    golden::check("agent_steady_pass", |runner| {
        let mut agent = agent(runner.clone(), state.path());
        let report = agent.reconcile();
        assert!(
            report.failures.is_empty() && report.restarted.is_empty(),
            "{report:?}"
        );
        assert_eq!(agent.get("web-1").map(|s| s.state), Some(Phase::Running));
        let spawned = runner.ran().len();
        assert!(
            spawned <= STEADY_PASS_PROCESSES,
            "a steady pass spawned {spawned} processes, at most {STEADY_PASS_PROCESSES} allowed"
        );
    });

    golden::check("agent_delete", |runner| {
        let mut agent = agent(runner, state.path());
        agent.delete("web-1").expect("deleted");
        assert!(agent.get("web-1").is_none());
    });
    assert!(!conf.exists(), "the conf of a deleted jail is removed");
    let (_, saved) = Store::<keel::agentd::reconciler::AgentState>::open(state.path(), STATE_FILE)
        .expect("store opens");
    let saved = saved.expect("state saved");
    assert!(saved.jails.is_empty() && saved.deleting.is_empty());
}

/// api-1: no resources, no volumes.
fn api_without_limits() -> Jail {
    parse_jail(
        "kind: Jail\n\
         metadata: {name: api-1}\n\
         spec:\n\
         \x20 base: 14.2-RELEASE\n\
         \x20 exec: {start: [/usr/local/bin/api]}\n",
    )
    .expect("valid spec")
}

/// A jail without limits is provisioned and deleted without one rctl(8)
/// call: the transcripts hold none, and the golden check fails on any
/// command they do not list.
#[test]
fn agent_provisions_and_deletes_a_jail_without_limits_without_rctl() {
    let state = tempfile::tempdir().expect("tempdir");
    let _ = std::fs::remove_file(conf_dir().join("api-1.conf"));
    golden::check("agent_provision_no_limits", |runner| {
        let mut agent = agent(runner, state.path());
        let status = agent.apply(api_without_limits(), None).expect("applied");
        assert_eq!(status.state, Phase::Starting);
    });
    golden::check("agent_delete_no_limits", |runner| {
        let mut agent = agent(runner, state.path());
        agent.delete("api-1").expect("deleted");
    });
}

/// A state directory holding web-1 as an agent leaves it once provisioned
/// and running (built over the Fakes, which run no commands).
fn provisioned_state() -> tempfile::TempDir {
    use keel::host::fake::{CallLog, Faults};
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, state) = Store::open(dir.path(), STATE_FILE).expect("store opens");
    let mut fake = Reconciler::new(
        keel::host::jail::FakeJails::new(CallLog::new(), Faults::default()),
        FakeZfs::with_bases(&["14.2-RELEASE"]),
        keel::host::net::FakeNet::new(CallLog::new(), Faults::default()),
        keel::host::mount::FakeMounts::new(CallLog::new(), Faults::default()),
        NodeNetwork {
            bridge: "keel0".into(),
            subnet: "10.20.3.0/24".parse().expect("subnet"),
        },
        store,
        state,
        Box::new(ManualClock::new()),
    );
    fake.apply(web(), None).expect("applied over the Fakes");
    dir
}

#[test]
fn agent_changes_a_volume_quota_in_place_and_refuses_one_below_used() {
    let state = provisioned_state();
    golden::check("agent_quota_change", |runner| {
        let mut agent = agent(runner, state.path());
        let mut bigger = web();
        bigger.spec.volumes[0].size = Some(2 << 30);
        let status = agent.apply(bigger, None).expect("applied");
        assert_eq!(status.state, Phase::Running);
    });
    golden::check("agent_quota_below_used", |runner| {
        let mut agent = agent(runner, state.path());
        let mut smaller = web();
        smaller.spec.volumes[0].size = Some(512 << 20);
        match agent.apply(smaller, None) {
            Err(keel::agentd::reconciler::ReconcileError::Conflict { message, .. }) => {
                assert!(message.contains("900000000 bytes"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn agent_delete_volume_refuses_a_mounted_one_and_gives_up_on_a_busy_one() {
    use keel::agentd::volumes::{self, VolumeError};
    let paths = CommandPaths::default();
    let seams = |runner: Runner| {
        (
            FreeBsdZfs::new(
                runner.clone(),
                paths.clone(),
                FakeZfs::default_layout(),
                3,
                Duration::ZERO,
            ),
            FreeBsdMounts::new(runner, paths.clone()),
        )
    };
    golden::check("agent_delete_volume_mounted", |runner| {
        let (zfs, mounts) = seams(runner);
        let err = volumes::delete(&zfs, &mounts, "web-content").expect_err("mounted");
        assert_eq!(
            err.to_string(),
            "volume web-content is mounted by jail web-1; delete that jail first"
        );
        assert_eq!(err.status(), 409);
    });
    golden::check("agent_delete_volume_busy", |runner| {
        let (zfs, mounts) = seams(runner);
        let err = volumes::delete(&zfs, &mounts, "web-content").expect_err("busy");
        assert!(
            matches!(
                err,
                VolumeError::Busy(keel::host::zfs::ZfsError::Busy { attempts: 3, .. })
            ),
            "{err:?}"
        );
        assert_eq!(err.status(), 409);
    });
}

/// A conf directory holding the web-1.conf an earlier create left (the
/// runner is scripted, so only its existence matters).
fn confs_with_web_1(name: &str) -> PathBuf {
    let dir = PathBuf::from("/tmp/keel-golden").join(name);
    std::fs::create_dir_all(&dir).expect("conf dir");
    std::fs::write(dir.join("web-1.conf"), "# left by an earlier create\n").expect("conf");
    dir
}

/// web-1's workload crashed (jls lists the jail, ps no process in it): an
/// apply restarts it at once. Nothing runs inside the jail: the epair's jail
/// side is reclaimed from its vnet, `jail -R` removes it, and its devfs is
/// unmounted by Keel; both epair ends are back on the host, so the same
/// epair serves the new jail.
#[test]
fn agent_restarts_a_crashed_jail_without_exec_stop() {
    let state = provisioned_state();
    let confs = confs_with_web_1("agent-crashed");
    golden::check("agent_restart_crashed", |runner| {
        let mut agent = agent_with_confs(runner, state.path(), &confs);
        let status = agent.apply(web(), None).expect("restarted");
        assert_eq!((status.state, status.restarts), (Phase::Starting, 1));
        assert_eq!(status.last_error, None);
    });
}

/// A changed spec replaces the running web-1, but its exec.stop fails and
/// jail(8) keeps the jail: the jail side is reclaimed, `jail -R` forces the
/// jail out and its devfs is unmounted. The jail side is not back on the
/// host (a vnet of an earlier, still dying incarnation holds it), so the
/// epair is made anew. web-1 runs the new spec, with the stop failure as
/// its last error.
#[test]
fn agent_forces_out_a_jail_whose_exec_stop_fails_and_remakes_its_epair() {
    let state = provisioned_state();
    let confs = confs_with_web_1("agent-stop-failed");
    golden::check("agent_replace_stop_failed", |runner| {
        let mut agent = agent_with_confs(runner, state.path(), &confs);
        let mut changed = web();
        changed.spec.env.insert("LEVEL".into(), "debug".into());
        let status = agent.apply(changed, None).expect("replaced");
        assert_eq!(status.state, Phase::Starting);
        let error = status.last_error.expect("the stop failure is reported");
        assert!(error.contains("jail -R web-1"), "{error}");
        assert!(error.contains("nginx -s quit: failed"), "{error}");
    });
}

/// The agent's conf directory lost web-1.conf: the delete never falls
/// through to /etc/jail.conf (`jail -R`), unmounts the devfs itself and
/// then the volumes, so `zfs destroy` of the root does not fail busy.
#[test]
fn agent_deletes_a_jail_whose_conf_is_gone() {
    let state = provisioned_state();
    let confs = PathBuf::from("/tmp/keel-golden/agent-without-conf");
    let _ = std::fs::remove_dir_all(&confs);
    golden::check("agent_delete_without_conf", |runner| {
        let mut agent = agent_with_confs(runner, state.path(), &confs);
        agent.delete("web-1").expect("deleted");
        assert!(agent.get("web-1").is_none());
    });
}
