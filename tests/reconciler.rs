//! The reconciler over the in-memory Fakes:
//! provision and delete orders, busy unmounts, one broken jail among healthy
//! ones, crash-loop backoff on a manual clock, an agent restarted over running
//! jails, auto-addressing, persistence before acknowledgement, spec changes
//! (in place, replacement, new base) and orphan cleanup.
//!
//! All four Fakes share one [`CallLog`] and one [`Faults`], so the tests read
//! the order of operations across subsystems from one list. The Fakes log
//! only operations that change the host (observation is not logged), so "no
//! new entries" means "nothing was changed".

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel::agentd::reconciler::{
    AgentState, HostError, JailRecord, Phase, ReconcileError, Reconciler, STATE_FILE,
};
use keel::common::backoff::ManualClock;
use keel::common::cidr::Ipv4Net;
use keel::common::spec::{Jail, parse_jail};
use keel::common::store::{FaultyFs, Step, Store};
use keel::host::fake::{CallLog, Faults};
use keel::host::jail::{FakeJails, JailParams, JailRuntime};
use keel::host::mount::FakeMounts;
use keel::host::net::FakeNet;
use keel::host::zfs::{FakeZfs, ZfsManager};
use keel::host::{MountManager, iface_names};

type Agent = Reconciler<FakeJails, FakeZfs, FakeNet, FakeMounts>;

const SUBNET: &str = "10.20.3.0/24";
const JAILS: &str = "/usr/local/keel/jails";
const VOLUMES: &str = "/usr/local/keel/volumes";

/// One simulated host: the Fakes (sharing a log and faults), a manual clock
/// and the agent's state directory. Agents built from it share all of them,
/// as a restarted agent shares the host and the state directory.
struct Host {
    log: CallLog,
    faults: Faults,
    jails: FakeJails,
    zfs: FakeZfs,
    net: FakeNet,
    mounts: FakeMounts,
    clock: ManualClock,
    dir: tempfile::TempDir,
}

impl Host {
    fn new() -> Host {
        let log = CallLog::new();
        let faults = Faults::default();
        let zfs = FakeZfs::new(log.clone(), faults.clone());
        zfs.add_base("14.2-RELEASE");
        zfs.add_base("14.3-RELEASE");
        Host {
            jails: FakeJails::new(log.clone(), faults.clone()),
            net: FakeNet::new(log.clone(), faults.clone()),
            mounts: FakeMounts::new(log.clone(), faults.clone()),
            zfs,
            log,
            faults,
            clock: ManualClock::new(),
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    /// An agent starting from what the state directory holds.
    fn agent(&self) -> Agent {
        self.agent_on(SUBNET)
    }

    fn agent_on(&self, subnet: &str) -> Agent {
        let (store, state) = Store::open(self.dir.path(), STATE_FILE).expect("store opens");
        self.agent_with(store, state, subnet)
    }

    fn agent_with(
        &self,
        store: Store<AgentState>,
        state: Option<AgentState>,
        subnet: &str,
    ) -> Agent {
        Reconciler::new(
            self.jails.clone(),
            self.zfs.clone(),
            self.net.clone(),
            self.mounts.clone(),
            keel::agentd::reconciler::NodeNetwork {
                bridge: "keel0".into(),
                subnet: subnet.parse().expect("subnet"),
            },
            store,
            state,
            Box::new(self.clock.clone()),
        )
    }

    /// What a freshly started agent would load from the state directory.
    fn saved(&self) -> Option<AgentState> {
        Store::<AgentState>::open(self.dir.path(), STATE_FILE)
            .expect("store opens")
            .1
    }

    /// Log entries since the last `take`, and forgets them.
    fn take(&self) -> Vec<String> {
        let entries = self.log.entries();
        self.log.clear();
        entries
    }

    fn mount_targets(&self) -> Vec<PathBuf> {
        self.mounts.mounts().into_iter().map(|m| m.target).collect()
    }

    fn jids(&self) -> Vec<(String, u32)> {
        let mut jids: Vec<(String, u32)> = self
            .jails
            .list()
            .expect("jls")
            .into_iter()
            .map(|j| (j.name, j.jid))
            .collect();
        jids.sort();
        jids
    }
}

/// A minimal valid jail: 14.2-RELEASE, one start command, limits.
fn jail(name: &str) -> Jail {
    parse_jail(&format!(
        "kind: Jail\n\
         metadata: {{name: {name}}}\n\
         spec:\n\
         \x20 base: 14.2-RELEASE\n\
         \x20 resources: {{cpu: 1, memory: 256M}}\n\
         \x20 exec: {{start: [/usr/local/bin/app, --port, '8080']}}\n"
    ))
    .expect("valid jail spec")
}

/// `jail(name)` with volumes `{name}-data` at /var/db/app and `{name}-logs`
/// at /var/db/app/logs (nested: it must be unmounted first).
fn jail_with_volumes(name: &str) -> Jail {
    parse_jail(&format!(
        "kind: Jail\n\
         metadata: {{name: {name}}}\n\
         spec:\n\
         \x20 base: 14.2-RELEASE\n\
         \x20 resources: {{cpu: 1, memory: 256M}}\n\
         \x20 exec: {{start: [/usr/local/bin/app]}}\n\
         \x20 volumes:\n\
         \x20   - {{name: {name}-data, mountPath: /var/db/app, size: 1G}}\n\
         \x20   - {{name: {name}-logs, mountPath: /var/db/app/logs}}\n"
    ))
    .expect("valid jail spec")
}

fn with_address(mut j: Jail, address: &str) -> Jail {
    j.spec.network.address = Some(address.parse().expect("address"));
    j
}

fn ip(s: &str) -> Ipv4Addr {
    s.parse().expect("address")
}

fn root(name: &str) -> String {
    format!("{JAILS}/{name}")
}

fn mount_entry(name: &str, volume: &str, path: &str) -> String {
    format!("mount.mount {VOLUMES}/{volume} -> {}{path}", root(name))
}

// ---------------------------------------------------------------- orders

#[test]
fn provision_runs_clone_volumes_mounts_epair_limits_jail_in_that_order() {
    let host = Host::new();
    let mut agent = host.agent();
    let status = agent.apply(jail_with_volumes("db"), None).expect("applied");
    assert_eq!(status.state, Phase::Starting);
    assert_eq!(
        host.take(),
        [
            // A fresh node has no bridge yet: the apply creates it first.
            "net.ensure_bridge keel0 10.20.3.1/24".to_string(),
            "zfs.clone_rootfs db".into(),
            "zfs.create_volume db-data".into(),
            "zfs.create_volume db-logs".into(),
            mount_entry("db", "db-data", "/var/db/app"),
            mount_entry("db", "db-logs", "/var/db/app/logs"),
            "net.attach db".into(),
            "jail.set_limits db".into(),
            "jail.create db".into(),
        ]
    );
    let params = host.jails.params("db").expect("jail exists");
    assert_eq!(params.path, PathBuf::from(root("db")));
    let net = params.network.expect("vnet");
    assert_eq!(
        (net.address, net.prefix_len, net.gateway),
        (ip("10.20.3.2"), 24, ip("10.20.3.1"))
    );
    assert_eq!(net.interface, iface_names("db").1);
    assert!(host.jails.is_running("db"));
    assert_eq!(
        host.jails.limits("db").map(|l| (l.cpu, l.memory)),
        Some((Some(1.0), Some(256 << 20)))
    );
    let quota = host
        .zfs
        .dataset("zroot/keel/volumes/db-data")
        .and_then(|d| d.quota);
    assert_eq!(quota, Some(1 << 30));
}

/// A seed (what a system jail needs in its root before its workload
/// starts) runs after the root and mounts are in place and before the jail
/// is created, at every provision, restarts included; a failing seed fails
/// that provision, and the jail is not created until a later pass succeeds.
#[test]
fn a_root_seed_runs_after_the_mounts_and_before_the_jail_starts() {
    let host = Host::new();
    let mut agent = host.agent();
    let log = host.log.clone();
    let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let failing = std::sync::Arc::clone(&fail);
    agent.seed_root(
        "db",
        Box::new(move |root: &Path, address: Ipv4Addr| {
            log.push(format!("seed {} {address}", root.display()));
            if failing.load(std::sync::atomic::Ordering::SeqCst) {
                Err("disk full".into())
            } else {
                Ok(())
            }
        }),
    );
    let err = agent
        .apply(jail_with_volumes("db"), None)
        .expect_err("the seed failed");
    assert!(
        err.to_string()
            .contains("preparing the jail's root before its start: disk full"),
        "{err}"
    );
    let ran = host.take();
    assert!(!ran.iter().any(|e| e.starts_with("jail.create")), "{ran:?}");
    assert_eq!(
        ran.last().map(String::as_str),
        Some(format!("seed {} 10.20.3.2", root("db")).as_str()),
        "{ran:?}"
    );

    fail.store(false, std::sync::atomic::Ordering::SeqCst);
    host.clock.advance(Duration::from_secs(60));
    agent.reconcile();
    let ran = host.take();
    let at = |prefix: &str| {
        ran.iter()
            .position(|e| e.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in {ran:?}"))
    };
    assert!(at("seed ") < at("jail.create db"), "{ran:?}");
    assert!(host.jails.is_running("db"));
}

#[test]
fn delete_runs_the_reverse_order_and_never_destroys_a_volume() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail_with_volumes("db"), None).expect("applied");
    host.take();

    agent.delete("db").expect("deleted");
    assert_eq!(
        host.take(),
        [
            "jail.remove db".to_string(),
            "jail.clear_limits db".into(),
            "net.detach db".into(),
            // Deepest first: the logs volume is mounted inside the data volume.
            format!("mount.unmount {}/var/db/app/logs", root("db")),
            format!("mount.unmount {}/var/db/app", root("db")),
            "zfs.destroy_rootfs db".into(),
        ]
    );
    assert!(host.jails.params("db").is_none());
    assert!(host.mount_targets().is_empty());
    let datasets = host.zfs.datasets();
    assert!(!datasets.contains(&"zroot/keel/jails/db".to_string()));
    for volume in ["zroot/keel/volumes/db-data", "zroot/keel/volumes/db-logs"] {
        assert!(datasets.contains(&volume.to_string()), "{volume} kept");
    }
    assert!(agent.state().jails.is_empty() && agent.state().deleting.is_empty());
    assert_eq!(host.saved(), Some(agent.state().clone()));
    assert_eq!(
        agent.delete("db"),
        Err(ReconcileError::NotFound("db".into()))
    );
}

#[test]
fn a_busy_unmount_stops_the_delete_before_the_rootfs_and_a_later_pass_finishes_it() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail_with_volumes("db"), None).expect("applied");
    host.take();
    let busy = format!("{}/var/db/app", root("db"));
    host.faults.fail("unmount", Some(&busy));

    let err = agent.delete("db").expect_err("busy mount");
    let ReconcileError::Host {
        error: HostError::UnmountBlocked { target, .. },
        ..
    } = &err
    else {
        panic!("expected UnmountBlocked, got {err:?}");
    };
    assert_eq!(target, &PathBuf::from(&busy));
    assert!(
        err.to_string().contains(&busy),
        "names the mount point: {err}"
    );
    let log = host.take();
    assert!(!log.iter().any(|e| e.starts_with("zfs.destroy")), "{log:?}");
    assert!(
        host.zfs
            .datasets()
            .contains(&"zroot/keel/jails/db".to_string())
    );
    // Acknowledged and persisted as pending, shown as Deleting.
    assert!(agent.state().deleting.contains_key("db"));
    assert!(!agent.state().jails.contains_key("db"));
    assert_eq!(host.saved().expect("saved").deleting.len(), 1);
    let pending = agent.get("db").expect("listed while deleting");
    assert_eq!(
        (pending.state, pending.address),
        (Phase::Deleting, ip("10.20.3.2"))
    );
    // Its address stays reserved until the teardown is done.
    let other = agent.apply(jail("other"), None).expect("other");
    assert_eq!(other.address, ip("10.20.3.3"));
    host.take();

    // Still busy: the pass reports it and still does not touch the rootfs.
    let report = agent.reconcile();
    assert_eq!(report.failures.len(), 1);
    assert_eq!(report.failures[0].jail, "db");
    assert!(!host.take().iter().any(|e| e.starts_with("zfs.destroy")));

    host.faults.clear();
    let report = agent.reconcile();
    assert!(report.failures.is_empty(), "{report:?}");
    let log = host.take();
    assert_eq!(
        log.last().map(String::as_str),
        Some("zfs.destroy_rootfs db")
    );
    assert!(!log.iter().any(|e| e.starts_with("zfs.destroy_volume")));
    assert!(agent.state().deleting.is_empty());
    assert!(agent.get("db").is_none());
    assert!(host.saved().expect("saved").deleting.is_empty());
    assert!(host.mount_targets().is_empty());
}

// ------------------------------------------------------ failures, backoff

#[test]
fn one_broken_jail_never_blocks_the_others_and_is_retried_after_its_delay() {
    let host = Host::new();
    // Desired state from before a reboot onto an empty host.
    let mut state = AgentState::default();
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        state.jails.insert(
            name.to_string(),
            JailRecord {
                spec: jail(name),
                address: Ipv4Addr::new(10, 20, 3, 2 + i as u8),
                epoch: None,
                created_unix: 0,
                restarts: 0,
                deployed: None,
            },
        );
    }
    let (mut store, _) = Store::open(host.dir.path(), STATE_FILE).expect("store");
    store.save(&state).expect("saved");
    let mut agent = host.agent();
    host.faults.fail("clone_rootfs", Some("a"));

    let report = agent.reconcile();
    let failed: Vec<&str> = report.failures.iter().map(|f| f.jail.as_str()).collect();
    assert_eq!(failed, ["a"]);
    assert!(
        report.failures[0].error.contains("out of space"),
        "{report:?}"
    );
    assert!(host.jails.is_running("b") && host.jails.is_running("c"));
    assert!(host.jails.params("a").is_none());
    let a = agent.get("a").expect("a is still desired");
    assert_eq!(a.state, Phase::Failed);
    assert_eq!(a.retry_in_secs, Some(1));
    assert!(a.last_error.is_some_and(|e| e.contains("zfs clone")));
    host.take();

    // Within its delay a pass leaves it alone (and says nothing new).
    host.faults.clear();
    host.clock.advance(Duration::from_millis(900));
    assert!(agent.reconcile().failures.is_empty());
    assert!(host.take().is_empty());

    host.clock.advance(Duration::from_millis(100));
    let report = agent.reconcile();
    assert!(report.failures.is_empty(), "{report:?}");
    assert_eq!(host.take()[0], "zfs.clone_rootfs a");
    assert!(host.jails.is_running("a"));
    assert_eq!(agent.get("a").map(|s| s.state), Some(Phase::Starting));
}

/// Crashes `web`, then checks: nothing before the backoff `delay`, a restart
/// exactly at it, and the restart counter at `restarts` afterwards.
fn crash_and_expect_restart_after(host: &Host, agent: &mut Agent, delay: Duration, restarts: u32) {
    host.jails.crash("web");
    let report = agent.reconcile();
    assert!(report.restarted.is_empty() && report.failures.is_empty());
    let status = agent.get("web").expect("desired");
    // One crash after a stable run is Restarting; one right after a
    // restart (a longer delay) is a crash loop.
    let crashed = if delay == Duration::from_secs(1) {
        Phase::Restarting
    } else {
        Phase::CrashLoop
    };
    assert_eq!(status.state, crashed);
    assert_eq!(status.retry_in_secs, Some(delay.as_secs()));
    host.clock.advance(delay - Duration::from_millis(1));
    assert!(agent.reconcile().restarted.is_empty());
    assert!(
        host.take().is_empty(),
        "no restart before the {delay:?} delay"
    );
    host.clock.advance(Duration::from_millis(1));
    let report = agent.reconcile();
    assert_eq!(report.restarted, ["web"]);
    // The workload is gone: nothing runs exec.stop, and the jail side of the
    // epair comes home before the jail goes.
    assert_eq!(
        host.take(),
        [
            "net.reclaim web",
            "jail.force_remove web",
            "jail.set_limits web",
            "jail.create web"
        ]
    );
    assert!(host.jails.is_running("web"));
    let status = agent.get("web").expect("desired");
    assert_eq!((status.state, status.restarts), (Phase::Starting, restarts));
    assert_eq!(agent.record("web").map(|r| r.restarts), Some(restarts));
}

#[test]
fn a_crashed_workload_restarts_after_doubling_delays_that_reset_after_a_minute_up() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail("web"), None).expect("applied");
    host.take();
    let secs = Duration::from_secs;

    crash_and_expect_restart_after(&host, &mut agent, secs(1), 1);
    crash_and_expect_restart_after(&host, &mut agent, secs(2), 2);
    crash_and_expect_restart_after(&host, &mut agent, secs(4), 3);
    crash_and_expect_restart_after(&host, &mut agent, secs(8), 4);

    // Up for a minute: a pass sees it stable and the next crash waits 1 s again.
    host.clock.advance(secs(60));
    assert!(agent.reconcile().restarted.is_empty());
    crash_and_expect_restart_after(&host, &mut agent, secs(1), 5);

    // The restart count and the backoff survive an agent restart.
    drop(agent);
    let saved = host.saved().expect("saved");
    assert_eq!(saved.jails["web"].restarts, 5);
    assert!(saved.backoff.entries.iter().any(|e| e.key == "web"));
}

#[test]
fn an_agent_restarted_over_running_jails_changes_nothing() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail_with_volumes("db"), None).expect("db");
    agent.apply(jail("web"), None).expect("web");
    // web crash-looped once before the agent went down.
    host.jails.crash("web");
    agent.reconcile();
    host.clock.advance(Duration::from_secs(1));
    assert_eq!(agent.reconcile().restarted, ["web"]);
    drop(agent);
    let jids = host.jids();
    let mounts = host.mount_targets();
    host.take();

    let mut agent = host.agent();
    let report = agent.reconcile();
    assert!(
        report.failures.is_empty() && report.restarted.is_empty(),
        "{report:?}"
    );
    assert!(host.take().is_empty(), "no host change at all");
    assert_eq!(host.jids(), jids, "no jail was recreated");
    assert_eq!(host.mount_targets(), mounts);
    for (name, address) in [("db", "10.20.3.2"), ("web", "10.20.3.3")] {
        let status = agent.get(name).expect("desired");
        assert_eq!(
            (status.state, status.address),
            (Phase::Running, ip(address))
        );
    }
    assert_eq!(agent.get("web").map(|s| s.restarts), Some(1));
    // A second pass is just as quiet.
    host.clock.advance(Duration::from_secs(5));
    agent.reconcile();
    assert!(host.take().is_empty());
}

// ------------------------------------------------------------ addressing

#[test]
fn auto_addresses_are_the_lowest_free_after_the_gateway_and_survive_a_reopen() {
    let host = Host::new();
    let mut agent = host.agent();
    let a = agent.apply(jail("a"), None).expect("a");
    let b = agent.apply(jail("b"), None).expect("b");
    assert_eq!((a.address, b.address), (ip("10.20.3.2"), ip("10.20.3.3")));
    agent
        .apply(with_address(jail("c"), "10.20.3.4"), None)
        .expect("explicit");
    agent.delete("a").expect("a deleted");
    // .2 is free again and the lowest.
    let d = agent.apply(jail("d"), None).expect("d");
    assert_eq!(d.address, ip("10.20.3.2"));
    let e = agent.apply(jail("e"), None).expect("e");
    assert_eq!(e.address, ip("10.20.3.5"));
    drop(agent);

    let saved = host.saved().expect("saved");
    let addresses: Vec<(&str, Ipv4Addr)> = saved
        .jails
        .iter()
        .map(|(n, r)| (n.as_str(), r.address))
        .collect();
    assert_eq!(
        addresses,
        [
            ("b", ip("10.20.3.3")),
            ("c", ip("10.20.3.4")),
            ("d", ip("10.20.3.2")),
            ("e", ip("10.20.3.5")),
        ]
    );
    // A re-apply after a restart keeps the jail's address, and a new jail
    // does not take one that is recorded.
    let mut agent = host.agent();
    assert_eq!(
        agent.apply(jail("b"), None).expect("b").address,
        ip("10.20.3.3")
    );
    assert_eq!(
        agent.apply(jail("f"), None).expect("f").address,
        ip("10.20.3.6")
    );
    assert_eq!(
        host.jails
            .params("b")
            .and_then(|p| p.network)
            .map(|n| n.address),
        Some(ip("10.20.3.3"))
    );
}

#[test]
fn an_address_outside_the_subnet_or_reserved_is_invalid_and_nothing_is_provisioned() {
    let host = Host::new();
    let mut agent = host.agent();
    for bad in [
        "10.20.4.2",
        "10.20.3.0",
        "10.20.3.1",
        "10.20.3.255",
        "192.168.1.5",
    ] {
        let err = agent
            .apply(with_address(jail("web"), bad), None)
            .expect_err(bad);
        let ReconcileError::Invalid { field, message } = &err else {
            panic!("{bad}: expected Invalid, got {err:?}");
        };
        assert_eq!(field, "spec.network.address");
        assert!(
            message.contains(bad) && message.contains(SUBNET),
            "{message}"
        );
    }
    assert!(host.take().is_empty(), "nothing provisioned");
    assert_eq!(agent.state(), &AgentState::default());
    assert_eq!(host.saved(), None, "nothing persisted");
}

#[test]
fn an_address_used_by_another_jail_is_a_conflict() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail("a"), None).expect("a gets .2");
    host.take();
    let before = agent.state().clone();
    let err = agent
        .apply(with_address(jail("b"), "10.20.3.2"), None)
        .expect_err("taken");
    let ReconcileError::Conflict { field, message } = &err else {
        panic!("expected Conflict, got {err:?}");
    };
    assert_eq!(field, "spec.network.address");
    assert!(message.contains("jail a"), "{message}");
    assert!(host.take().is_empty());
    assert_eq!(agent.state(), &before);
    // The jail that owns it may keep it explicitly.
    agent
        .apply(with_address(jail("a"), "10.20.3.2"), None)
        .expect("own address");
    assert!(
        host.take().is_empty(),
        "same address written out: no change"
    );
}

#[test]
fn a_placed_jail_and_a_local_jail_never_take_each_other_over() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail("replica-0"), Some(4)).expect("placed");
    agent.apply(jail("local"), None).expect("local");
    host.take();
    let before = agent.state().clone();
    for (name, epoch, says) in [
        ("replica-0", None, "placed by the control plane (epoch 4)"),
        ("local", Some(5), "applied on this node directly"),
    ] {
        let err = agent.apply(jail(name), epoch).expect_err("other owner");
        let ReconcileError::Conflict { field, message } = &err else {
            panic!("expected Conflict, got {err:?}");
        };
        assert_eq!(field, "metadata.name");
        assert!(message.contains(says), "{message}");
    }
    assert!(host.take().is_empty(), "nothing ran");
    assert_eq!(agent.state(), &before, "nothing changed");
    agent
        .apply(jail("replica-0"), Some(6))
        .expect("the control plane may place it again");
}

#[test]
fn a_full_subnet_is_addresses_exhausted() {
    let host = Host::new();
    // A /30 holds the network, the gateway, one jail and the broadcast.
    let mut agent = host.agent_on("10.20.3.0/30");
    assert_eq!(
        agent.apply(jail("a"), None).expect("a").address,
        ip("10.20.3.2")
    );
    host.take();
    let err = agent.apply(jail("b"), None).expect_err("full");
    assert_eq!(
        err,
        ReconcileError::AddressesExhausted("10.20.3.0/30".parse::<Ipv4Net>().expect("net"))
    );
    assert!(err.to_string().contains("10.20.3.0/30"));
    assert!(host.take().is_empty());
    assert!(!agent.state().jails.contains_key("b"));
}

// ----------------------------------------------------------- persistence

#[test]
fn an_apply_that_cannot_be_persisted_is_refused_and_changes_nothing() {
    for step in [Step::Write, Step::Fsync, Step::Rename] {
        let host = Host::new();
        let fs = FaultyFs::new();
        let (store, state) =
            Store::with_fs(host.dir.path(), STATE_FILE, fs.clone()).expect("store");
        let mut agent = host.agent_with(store, state, SUBNET);
        agent.apply(jail("a"), None).expect("a");
        let before = agent.state().clone();
        host.take();

        // A new jail, and a change to an existing one.
        let mut changed = jail("a");
        changed.spec.exec.start = vec!["/usr/local/bin/other".into()];
        for spec in [jail("b"), changed] {
            fs.fail_at(step);
            let err = agent.apply(spec, None).expect_err("store fails");
            assert!(matches!(err, ReconcileError::Store(_)), "{step}: {err:?}");
            assert!(host.take().is_empty(), "{step}: nothing provisioned");
            assert_eq!(agent.state(), &before, "{step}: state unchanged");
            assert_eq!(
                host.saved().as_ref(),
                Some(&before),
                "{step}: disk unchanged"
            );
        }
        assert_eq!(
            host.jails.params("a").map(|p| p.exec_start),
            Some(vec![
                "/usr/local/bin/app".to_string(),
                "--port".into(),
                "8080".into()
            ])
        );
    }
}

// ---------------------------------------------------------- spec changes

#[test]
fn re_applying_the_same_spec_changes_nothing() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail_with_volumes("db"), None).expect("applied");
    host.take();
    let jids = host.jids();
    let status = agent.apply(jail_with_volumes("db"), None).expect("again");
    assert_eq!(status.state, Phase::Starting, "not up a second yet");
    host.clock.advance(keel::agentd::reconciler::START_SETTLE);
    let status = agent.apply(jail_with_volumes("db"), None).expect("again");
    assert_eq!(status.state, Phase::Running, "seen running past its start");
    assert!(host.take().is_empty());
    assert_eq!(host.jids(), jids);
}

#[test]
fn changed_resources_are_applied_in_place() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail("web"), None).expect("applied");
    host.take();
    let jids = host.jids();
    let mut bigger = jail("web");
    bigger.spec.resources.cpu = Some(2.0);
    bigger.spec.resources.memory = Some(1 << 30);
    agent.apply(bigger, None).expect("resized");
    assert_eq!(host.take(), ["jail.set_limits web"]);
    assert_eq!(host.jids(), jids, "not restarted");
    assert_eq!(
        host.jails.limits("web").map(|l| (l.cpu, l.memory)),
        Some((Some(2.0), Some(1 << 30)))
    );
}

#[test]
fn changed_limits_that_failed_are_applied_by_a_later_pass() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail("web"), None).expect("applied");
    host.take();
    let mut bigger = jail("web");
    bigger.spec.resources.cpu = Some(2.0);
    host.faults.fail_times("set_limits", Some("web"), 1);
    agent.apply(bigger, None).expect_err("rctl failed");
    assert_eq!(host.jails.limits("web").and_then(|l| l.cpu), Some(1.0));
    host.take();

    host.clock.advance(Duration::from_secs(1));
    let report = agent.reconcile();
    assert!(report.failures.is_empty(), "{report:?}");
    assert_eq!(host.take(), ["jail.set_limits web"]);
    assert_eq!(host.jails.limits("web").and_then(|l| l.cpu), Some(2.0));
    assert_eq!(agent.get("web").map(|s| s.state), Some(Phase::Running));
}

/// rctl(8) refusing the limits (RACCT off, a jailed agent) fails the
/// provision before the jail exists: the workload never runs unlimited, not
/// even for a moment, and a later pass sets the limits and then starts it.
#[test]
fn refused_limits_fail_the_provision_before_anything_starts() {
    let host = Host::new();
    let mut agent = host.agent();
    host.faults.fail_times("set_limits", Some("web"), 1);
    let err = agent.apply(jail("web"), None).expect_err("rctl refused");
    assert!(err.to_string().contains("rctl -a jail:web"), "{err}");
    let ran = host.take();
    assert_eq!(ran.last().map(String::as_str), Some("jail.set_limits web"));
    assert!(!ran.iter().any(|e| e.starts_with("jail.create")), "{ran:?}");
    assert!(host.jails.params("web").is_none(), "nothing was started");
    assert_eq!(agent.get("web").map(|s| s.state), Some(Phase::Failed));

    host.clock.advance(Duration::from_secs(1));
    let report = agent.reconcile();
    assert!(report.failures.is_empty(), "{report:?}");
    assert_eq!(host.take(), ["jail.set_limits web", "jail.create web"]);
    assert!(host.jails.is_running("web"));
    assert_eq!(host.jails.limits("web").and_then(|l| l.cpu), Some(1.0));
}

/// A jail without limits gets no rctl call at all, at creation, restart or
/// delete: rctl is refused in a jailed agent, and such a jail must still
/// run there. Limits added later are set in place, and dropping them again
/// clears the rules once; after that, rctl is left alone again.
#[test]
fn a_jail_without_limits_runs_no_rctl_command_until_it_gets_some() {
    let host = Host::new();
    let mut agent = host.agent();
    let mut plain = jail("web");
    plain.spec.resources = Default::default();
    agent.apply(plain.clone(), None).expect("applied");
    assert_eq!(
        host.take(),
        [
            "net.ensure_bridge keel0 10.20.3.1/24",
            "zfs.clone_rootfs web",
            "net.attach web",
            "jail.create web"
        ]
    );
    host.jails.crash("web");
    assert!(
        agent.reconcile().restarted.is_empty(),
        "the crash is counted"
    );
    host.clock.advance(Duration::from_secs(1));
    assert_eq!(agent.reconcile().restarted, ["web"]);
    assert_eq!(
        host.take(),
        [
            "net.reclaim web",
            "jail.force_remove web",
            "jail.create web"
        ]
    );

    agent.apply(jail("web"), None).expect("limits added");
    assert_eq!(host.take(), ["jail.set_limits web"]);
    agent.apply(plain.clone(), None).expect("limits dropped");
    assert_eq!(host.take(), ["jail.set_limits web"], "the old rules go");
    assert_eq!(host.jails.limits("web"), None);
    agent.apply(plain, None).expect("same again");
    assert!(host.take().is_empty());

    agent.delete("web").expect("deleted");
    let ran = host.take();
    assert!(
        !ran.iter()
            .any(|e| e.starts_with("jail.") && e.contains("limits")),
        "{ran:?}"
    );
    assert_eq!(ran.first().map(String::as_str), Some("jail.remove web"));
}

/// Limits are set before `jail -c`; when the start then fails, the rules
/// stay bound to the name. A spec that then drops its limits must still
/// have them removed before the jail starts, or it would run limited.
#[test]
fn rules_left_by_a_failed_start_are_replaced_when_the_spec_drops_its_limits() {
    let host = Host::new();
    let mut agent = host.agent();
    host.faults.fail_times("create", Some("web"), 1);
    agent
        .apply(jail("web"), None)
        .expect_err("exec.start failed");
    assert_eq!(host.jails.limits("web").and_then(|l| l.cpu), Some(1.0));
    host.take();

    let mut plain = jail("web");
    plain.spec.resources = Default::default();
    agent.apply(plain, None).expect("applied without limits");
    let ran = host.take();
    assert_eq!(
        &ran[ran.len() - 2..],
        ["jail.set_limits web", "jail.create web"],
        "{ran:?}"
    );
    assert_eq!(host.jails.limits("web"), None);
    assert!(host.jails.is_running("web"));
}

#[test]
fn changed_exec_replaces_the_jail_and_keeps_its_rootfs_and_volumes() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail_with_volumes("db"), None).expect("applied");
    host.take();
    let mut changed = jail_with_volumes("db");
    changed.spec.exec.start = vec!["/usr/local/bin/app".into(), "--verbose".into()];
    changed.spec.env.insert("LEVEL".into(), "debug".into());
    agent.apply(changed, None).expect("replaced");
    assert_eq!(
        host.take(),
        ["jail.remove db", "jail.set_limits db", "jail.create db"]
    );
    let params = host.jails.params("db").expect("exists");
    assert_eq!(params.exec_start, ["/usr/local/bin/app", "--verbose"]);
    assert_eq!(params.env.get("LEVEL").map(String::as_str), Some("debug"));
    assert_eq!(host.mount_targets().len(), 2, "volumes stay mounted");
}

#[test]
fn a_replacement_that_failed_is_finished_by_a_later_pass() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail("web"), None).expect("applied");
    host.take();
    let mut changed = jail("web");
    changed.spec.exec.start = vec!["/usr/local/bin/v2".into()];
    host.faults.fail_times("remove", Some("web"), 1);
    let err = agent.apply(changed, None).expect_err("jail -r failed");
    assert!(matches!(err, ReconcileError::Host { .. }), "{err:?}");
    // The new spec is recorded; the old jail still runs.
    assert_eq!(
        host.saved().expect("saved").jails["web"]
            .spec
            .spec
            .exec
            .start,
        ["/usr/local/bin/v2"]
    );
    assert!(host.jails.is_running("web"));
    host.take();

    // A pass replaces it, even after an agent restart.
    drop(agent);
    let mut agent = host.agent();
    let report = agent.reconcile();
    assert!(report.failures.is_empty(), "{report:?}");
    assert_eq!(
        host.take(),
        ["jail.remove web", "jail.set_limits web", "jail.create web"]
    );
    assert_eq!(
        host.jails.params("web").map(|p| p.exec_start),
        Some(vec!["/usr/local/bin/v2".to_string()])
    );
    agent.reconcile();
    assert!(host.take().is_empty(), "then steady");
}

#[test]
fn a_new_base_recreates_the_rootfs_after_unmounting_the_volumes() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail_with_volumes("db"), None).expect("applied");
    host.take();
    let mut rebased = jail_with_volumes("db");
    rebased.spec.base = "14.3-RELEASE".into();
    agent.apply(rebased, None).expect("rebased");
    assert_eq!(
        host.take(),
        [
            "jail.remove db".to_string(),
            format!("mount.unmount {}/var/db/app/logs", root("db")),
            format!("mount.unmount {}/var/db/app", root("db")),
            "zfs.destroy_rootfs db".into(),
            "zfs.clone_rootfs db".into(),
            mount_entry("db", "db-data", "/var/db/app"),
            mount_entry("db", "db-logs", "/var/db/app/logs"),
            "jail.set_limits db".into(),
            "jail.create db".into(),
        ]
    );
    let datasets = host.zfs.datasets();
    for volume in ["zroot/keel/volumes/db-data", "zroot/keel/volumes/db-logs"] {
        assert!(datasets.contains(&volume.to_string()), "{volume} kept");
    }
    assert_eq!(host.mount_targets().len(), 2);
    assert_eq!(
        agent
            .record("db")
            .and_then(|r| r.deployed.as_ref())
            .map(|d| d.spec.base.as_str()),
        Some("14.3-RELEASE")
    );
    agent.reconcile();
    assert!(host.take().is_empty(), "then steady");
}

#[test]
fn a_busy_volume_stops_a_rebase_before_the_rootfs_is_destroyed() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail_with_volumes("db"), None).expect("applied");
    host.take();
    let busy = format!("{}/var/db/app", root("db"));
    host.faults.fail("unmount", Some(&busy));
    let mut rebased = jail_with_volumes("db");
    rebased.spec.base = "14.3-RELEASE".into();
    let err = agent.apply(rebased, None).expect_err("busy");
    assert!(err.to_string().contains(&busy), "{err}");
    assert!(!host.take().iter().any(|e| e.starts_with("zfs.destroy")));

    host.faults.clear();
    host.clock.advance(Duration::from_secs(1));
    let report = agent.reconcile();
    assert!(report.failures.is_empty(), "{report:?}");
    let log = host.take();
    assert!(
        log.contains(&"zfs.destroy_rootfs db".to_string()),
        "{log:?}"
    );
    assert!(host.jails.is_running("db"));
    assert_eq!(host.mount_targets().len(), 2);
}

#[test]
fn a_volume_dropped_from_the_spec_is_unmounted_but_kept() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail_with_volumes("db"), None).expect("applied");
    host.take();
    let mut fewer = jail_with_volumes("db");
    fewer.spec.volumes.truncate(1);
    agent.apply(fewer, None).expect("applied");
    assert_eq!(
        host.take(),
        [
            "jail.remove db".to_string(),
            format!("mount.unmount {}/var/db/app/logs", root("db")),
            "jail.set_limits db".into(),
            "jail.create db".into(),
        ]
    );
    assert_eq!(
        host.mount_targets(),
        [PathBuf::from(format!("{}/var/db/app", root("db")))]
    );
    assert!(
        host.zfs
            .datasets()
            .contains(&"zroot/keel/volumes/db-logs".to_string())
    );
}

// --------------------------------------------------------------- orphans

#[test]
fn a_keel_jail_without_a_record_is_torn_down_and_others_are_left_alone() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail("web"), None).expect("applied");
    let params = |name: &str, path: &str| JailParams {
        name: name.into(),
        path: path.into(),
        hostname: name.into(),
        network: None,
        exec_start: vec!["/bin/sleep".into(), "1000".into()],
        exec_stop: vec![],
        env: Default::default(),
    };
    // A Keel jail whose record was lost, with its rootfs and a volume mount.
    host.zfs
        .clone_rootfs("14.2-RELEASE", "stray")
        .expect("rootfs");
    host.jails
        .create(&params("stray", &root("stray")))
        .expect("stray");
    let stray_mount = PathBuf::from(format!("{}/data", root("stray")));
    host.mounts
        .mount_nullfs(
            &PathBuf::from(format!("{VOLUMES}/shared")),
            Path::new(&root("stray")),
            &stray_mount,
        )
        .expect("mounted");
    // A jail the admin runs by hand, outside Keel's jails directory.
    host.jails
        .create(&params("legacy", "/jails/legacy"))
        .expect("legacy");
    host.take();

    let report = agent.reconcile();
    assert!(report.failures.is_empty(), "{report:?}");
    assert_eq!(
        host.take(),
        [
            "jail.remove stray".to_string(),
            "jail.clear_limits stray".into(),
            "net.detach stray".into(),
            format!("mount.unmount {}", stray_mount.display()),
            "zfs.destroy_rootfs stray".into(),
        ]
    );
    assert!(host.jails.params("stray").is_none());
    assert!(
        !host
            .zfs
            .datasets()
            .contains(&"zroot/keel/jails/stray".to_string())
    );
    assert!(host.jails.is_running("legacy"), "not Keel's: untouched");
    assert!(host.jails.is_running("web"));
}

#[test]
fn a_jail_rooted_outside_the_jails_directory_is_never_torn_down() {
    // The orphan rule keys on the layout, not on the name: a jail named like
    // a Keel jail but rooted elsewhere is never torn down.
    let host = Host::new();
    assert_eq!(host.zfs.layout().jails_dir, PathBuf::from(JAILS));
    let mut agent = host.agent();
    host.jails
        .create(&JailParams {
            name: "web".into(),
            path: "/jails/web".into(),
            hostname: "web".into(),
            network: None,
            exec_start: vec!["/bin/sleep".into()],
            exec_stop: vec![],
            env: Default::default(),
        })
        .expect("created");
    host.take();
    agent.reconcile();
    // The pass only creates the bridge this fresh host lacks.
    assert_eq!(host.take(), ["net.ensure_bridge keel0 10.20.3.1/24"]);
    assert!(host.jails.is_running("web"));
}

// Volumes: quota changes in place, and the volume routes (`agentd::volumes`),
// keyed by dataset path alone.

#[test]
fn a_changed_volume_size_sets_the_quota_in_place_and_a_shrink_below_used_is_409() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail_with_volumes("db"), None).expect("applied");
    host.take();
    let mut bigger = jail_with_volumes("db");
    bigger.spec.volumes[0].size = Some(2 << 30);
    agent.apply(bigger.clone(), None).expect("resized");
    assert_eq!(
        host.take(),
        ["zfs.set_volume_quota db-data"],
        "nothing recreated"
    );
    let data = "zroot/keel/volumes/db-data";
    assert_eq!(host.zfs.dataset(data).and_then(|d| d.quota), Some(2 << 30));
    assert!(agent.reconcile().failures.is_empty());
    assert!(
        host.take().is_empty(),
        "a steady pass leaves the quota alone"
    );

    host.zfs.set_used(data, 1_500_000_000);
    let mut smaller = bigger.clone();
    smaller.spec.volumes[0].size = Some(1 << 30);
    match agent.apply(smaller, None) {
        Err(ReconcileError::Conflict { field, message }) => {
            assert_eq!(field, "spec.volumes[0].size");
            assert!(
                message.contains("1500000000") && message.contains(&(1u64 << 30).to_string()),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(host.take().is_empty(), "nothing changed on the host");
    let saved = host.saved().expect("state");
    assert_eq!(
        saved.jails["db"].spec.spec.volumes[0].size,
        Some(2 << 30),
        "not recorded"
    );
}

#[test]
fn volume_routes_refuse_a_mounted_or_missing_volume_and_delete_an_unmounted_one() {
    use keel::agentd::volumes::{self, VolumeError};
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail_with_volumes("db"), None).expect("applied");
    let list = volumes::list(&host.zfs, &host.mounts).expect("lists");
    let summary: Vec<(String, Option<u64>, Option<String>)> = list
        .iter()
        .map(|v| (v.name.clone(), v.quota, v.mounted_by.clone()))
        .collect();
    assert_eq!(
        summary,
        [
            ("db-data".to_string(), Some(1 << 30), Some("db".to_string())),
            ("db-logs".to_string(), None, Some("db".to_string())),
        ]
    );
    host.take();
    let mounted = volumes::delete(&host.zfs, &host.mounts, "db-data").expect_err("mounted");
    assert_eq!(mounted.status(), 409);
    assert_eq!(
        mounted.to_string(),
        "volume db-data is mounted by jail db; delete that jail first"
    );
    assert!(host.take().is_empty(), "nothing destroyed");

    agent.delete("db").expect("jail deleted");
    host.take();
    host.faults.fail("destroy_volume", Some("db-logs"));
    let busy = volumes::delete(&host.zfs, &host.mounts, "db-logs").expect_err("busy");
    assert!(matches!(busy, VolumeError::Busy(_)), "{busy:?}");
    assert_eq!(busy.status(), 409);
    volumes::delete(&host.zfs, &host.mounts, "db-data").expect("deleted");
    assert_eq!(
        host.take(),
        ["zfs.destroy_volume db-logs", "zfs.destroy_volume db-data"]
    );
    let missing = volumes::get(&host.zfs, &host.mounts, "db-data").expect_err("gone");
    assert_eq!(missing.status(), 404);
    let missing = volumes::delete(&host.zfs, &host.mounts, "db-data").expect_err("gone");
    assert_eq!(missing.status(), 404);
    assert!(host.take().is_empty(), "a missing volume runs no destroy");
}

/// Runs passes a second apart until `name` restarted, and returns what they
/// did to the host.
fn restart_after_crash(host: &Host, agent: &mut Agent, name: &str) -> Vec<String> {
    host.jails.crash(name);
    host.take();
    for _ in 0..10 {
        if agent.reconcile().restarted.iter().any(|r| r == name) {
            return host.take();
        }
        host.clock.advance(Duration::from_secs(1));
    }
    panic!("{name} was not restarted: {:?}", host.take());
}

/// A crash while the jail holds its epair's jail side (jail(8) moved it into
/// the jail's vnet): it is reclaimed before `jail -R`, so the restart reuses
/// the epair.
#[test]
fn a_crashed_jail_gives_its_interface_back_before_it_is_forced_out() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail("web"), None).expect("applied");
    host.net.enter_vnet("web");
    let done = restart_after_crash(&host, &mut agent, "web");
    assert_eq!(
        done,
        [
            "net.reclaim web",
            "jail.force_remove web",
            "jail.set_limits web",
            "jail.create web"
        ]
    );
    assert!(host.jails.is_running("web"));
}

/// The jail side stays in the vnet of a jail that lingers as dying, where
/// nothing can reach it: the host side alone is no epair, so a new one is
/// made (attach destroys the old one) before the jail is created again.
#[test]
fn a_jail_side_stranded_in_a_dying_vnet_gets_a_new_epair() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail("web"), None).expect("applied");
    host.net.strand("web");
    let done = restart_after_crash(&host, &mut agent, "web");
    assert_eq!(
        done,
        [
            "net.reclaim web",
            "jail.force_remove web",
            "net.attach web",
            "jail.set_limits web",
            "jail.create web"
        ]
    );
    let (host_if, jail_if) = iface_names("web");
    assert!(host.net.interfaces().contains(&host_if));
    assert!(host.net.interfaces().contains(&jail_if));

    // The same on a replacement, whose removal (with exec.stop) reclaims
    // nothing first: the check after it finds the jail side missing.
    host.net.strand("web");
    host.take();
    let mut changed = jail("web");
    changed.spec.exec.start = vec!["/usr/local/bin/v2".into()];
    agent.apply(changed, None).expect("replaced");
    assert_eq!(
        host.take(),
        [
            "jail.remove web",
            "net.attach web",
            "jail.set_limits web",
            "jail.create web"
        ]
    );
}

/// exec.stop fails, so jail(8) keeps the jail: the removal is forced (no
/// command runs in the jail), the replacement goes on, and the stop failure
/// stays as the jail's last error while it runs again.
#[test]
fn a_failing_exec_stop_is_forced_through_and_reported() {
    let host = Host::new();
    let mut agent = host.agent();
    let mut stopping = jail("web");
    stopping.spec.exec.stop = vec!["/usr/local/bin/app".into(), "stop".into()];
    agent.apply(stopping.clone(), None).expect("applied");
    host.take();
    host.faults.fail("stop", Some("web"));
    let mut changed = stopping;
    changed.spec.exec.start = vec!["/usr/local/bin/v2".into()];
    let status = agent
        .apply(changed, None)
        .expect("replaced despite exec.stop");
    assert_eq!(
        host.take(),
        [
            "jail.remove web",
            "net.reclaim web",
            "jail.force_remove web",
            "jail.set_limits web",
            "jail.create web"
        ]
    );
    assert_eq!(status.state, Phase::Starting);
    let error = status.last_error.expect("the stop failure is reported");
    assert!(error.contains("jail -R web"), "{error}");
    assert!(error.contains("failed"), "{error}");
    let report = agent.reconcile();
    assert!(report.failures.is_empty(), "{report:?}");
    assert_eq!(
        agent.get("web").and_then(|s| s.last_error),
        Some(error),
        "still shown while the jail runs"
    );

    // A delete gets through the same way and leaves nothing behind.
    agent.delete("web").expect("deleted despite exec.stop");
    let done = host.take();
    assert_eq!(
        done[..3],
        [
            "jail.remove web",
            "net.reclaim web",
            "jail.force_remove web"
        ]
    );
    assert!(host.jails.params("web").is_none());
    assert!(
        done.contains(&"zfs.destroy_rootfs web".to_string()),
        "{done:?}"
    );
    assert!(agent.get("web").is_none());
}

/// Deleting a jail whose workload crashed runs no exec.stop either.
#[test]
fn deleting_a_crashed_jail_runs_no_exec_stop() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail("web"), None).expect("applied");
    host.jails.crash("web");
    agent.reconcile();
    assert_eq!(agent.get("web").map(|s| s.state), Some(Phase::Restarting));
    host.take();
    agent.delete("web").expect("deleted");
    let done = host.take();
    assert_eq!(done[..2], ["net.reclaim web", "jail.force_remove web"]);
    assert!(!done.contains(&"jail.remove web".to_string()), "{done:?}");
}

#[test]
fn a_jail_on_a_base_never_fetched_fails_naming_the_fetch_command() {
    let host = Host::new();
    let mut agent = host.agent();
    let mut spec = jail("web");
    spec.spec.base = "15.0-RELEASE".into();
    let error = match agent.apply(spec, None) {
        Err(e) => e.to_string(),
        Ok(status) => status.last_error.expect("the provision failed"),
    };
    assert!(
        error.contains("`keelctl base fetch 15.0-RELEASE`"),
        "{error}"
    );
    assert!(
        host.take().iter().all(|c| !c.starts_with("jail.create")),
        "no jail is created without its base"
    );
}

/// `jail(name)` with a tcp health check.
fn jail_with_health(name: &str) -> Jail {
    parse_jail(&format!(
        "kind: Jail\n\
         metadata: {{name: {name}}}\n\
         spec:\n\
         \x20 base: 14.2-RELEASE\n\
         \x20 resources: {{cpu: 1, memory: 256M}}\n\
         \x20 exec: {{start: [/usr/local/bin/app, --port, '8080']}}\n\
         \x20 health: {{tcp: {{port: 8080}}}}\n"
    ))
    .expect("valid jail spec")
}

#[test]
fn a_jail_with_health_is_ready_only_after_its_probe_passed_and_restarts_through_the_backoff() {
    let host = Host::new();
    let mut agent = host.agent();
    agent.apply(jail("plain"), None).expect("applied");
    agent.apply(jail_with_health("web"), None).expect("applied");
    assert!(
        agent.get("plain").expect("plain").ready,
        "no health: running is ready"
    );
    let web = agent.get("web").expect("web");
    assert_eq!((web.state, web.ready), (Phase::Starting, false));

    let targets = agent.health_targets();
    assert_eq!(
        targets.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
        ["web"],
        "only jails with a probe are checked"
    );
    let first = targets[0].incarnation;
    assert!(agent.set_readiness("web", first, true, None));
    assert!(agent.get("web").expect("web").ready);
    assert!(
        !agent.set_readiness("web", first + 1, false, None),
        "a verdict about another start of the workload is dropped"
    );
    assert!(agent.get("web").expect("web").ready);
    agent.set_readiness("web", first, false, Some("connection refused".into()));
    let web = agent.get("web").expect("web");
    assert!(!web.ready && web.state == Phase::Starting, "{web:?}");
    assert!(
        web.last_error
            .unwrap_or_default()
            .contains("connection refused")
    );

    host.take();
    assert_eq!(
        agent.restart_unhealthy("web", first, "connection refused"),
        Ok(true)
    );
    assert_eq!(
        host.take(),
        ["jail.remove web"],
        "stopped with its exec.stop"
    );
    let web = agent.get("web").expect("web");
    assert_eq!(
        (web.state, web.restarts, web.ready),
        (Phase::Restarting, 1, false)
    );
    assert_eq!(web.retry_in_secs, Some(1));
    assert!(
        agent.health_targets().is_empty(),
        "nothing to probe while it is down"
    );

    // The crash-loop backoff decides when it starts again.
    host.clock.advance(Duration::from_millis(999));
    agent.reconcile();
    assert!(!host.jails.is_running("web"), "not before the 1 s delay");
    host.clock.advance(Duration::from_millis(1));
    agent.reconcile();
    assert!(host.jails.is_running("web"));
    let web = agent.get("web").expect("web");
    assert_eq!(
        (web.state, web.ready, web.restarts),
        (Phase::Starting, false, 1)
    );
    assert!(
        web.last_error
            .unwrap_or_default()
            .contains("health check failed"),
        "the reason is kept"
    );
    let second = agent.health_targets()[0].incarnation;
    assert_ne!(second, first, "a new start of the workload");
    assert_eq!(
        agent.restart_unhealthy("web", first, "late"),
        Ok(false),
        "a restart asked for the old start is dropped"
    );
    assert!(agent.set_readiness("web", second, true, None));
    assert!(agent.get("web").expect("web").ready);
}

/// A started workload is Starting until a pass sees it up past
/// `START_SETTLE`; its first exit is Restarting with its status, a second
/// one right after the restart CrashLoop; both are told as events.
#[test]
fn an_exited_workload_is_restarting_then_crash_looping_with_its_last_exit() {
    use keel::agentd::reconciler::START_SETTLE;
    let host = Host::new();
    let mut agent = host.agent();
    let events = keel::common::events::EventLog::in_memory("n1");
    agent.set_events(events.clone());
    let status = agent.apply(jail("web"), None).expect("applied");
    assert_eq!((status.state, status.last_exit), (Phase::Starting, None));
    agent.reconcile();
    assert_eq!(agent.get("web").map(|s| s.state), Some(Phase::Starting));
    host.clock.advance(START_SETTLE);
    agent.reconcile();
    assert_eq!(agent.get("web").map(|s| s.state), Some(Phase::Running));

    host.jails.exit("web", 3);
    agent.reconcile();
    let web = agent.get("web").expect("web");
    assert_eq!(web.state, Phase::Restarting, "{web:?}");
    assert_eq!(web.last_exit.and_then(|e| e.status), Some(3));
    assert_eq!(web.retry_in_secs, Some(1));
    assert!(
        web.last_error
            .as_deref()
            .is_some_and(|e| e.contains("exited with status 3")),
        "{web:?}"
    );

    host.clock.advance(Duration::from_secs(1));
    agent.reconcile();
    assert_eq!(agent.get("web").map(|s| s.state), Some(Phase::Starting));
    host.jails.exit("web", 1);
    agent.reconcile();
    let web = agent.get("web").expect("web");
    assert_eq!(
        (
            web.state,
            web.last_exit.and_then(|e| e.status),
            web.retry_in_secs
        ),
        (Phase::CrashLoop, Some(1), Some(2))
    );
    let reasons: Vec<String> = events
        .since(None, None)
        .0
        .into_iter()
        .map(|e| e.reason)
        .collect();
    assert_eq!(
        reasons,
        [
            "Created",
            "Started",
            // It ran past its first second before it exited.
            "Running",
            "Exited",
            "BackOff",
            "Restarted",
            "Started",
            "Exited",
            "BackOff"
        ]
    );
}

// -------------------------------------------------------------- dry runs

/// The argv of every command a dry run lists that changes the host.
fn changing(report: &keel::common::wire::DryRunReport) -> Vec<String> {
    report
        .commands
        .iter()
        .filter(|c| c.changes_host)
        .map(|c| keel::common::cmd::render_argv(&c.argv))
        .collect()
}

#[test]
fn a_dry_run_lists_the_freebsd_commands_and_changes_neither_host_nor_state() {
    use keel::common::wire::DryRunAction;
    let host = Host::new();
    let fs = FaultyFs::new();
    let (store, state) = Store::with_fs(host.dir.path(), STATE_FILE, fs.clone()).expect("store");
    let mut agent = host.agent_with(store, state, SUBNET);
    agent.apply(jail("a"), None).expect("a");
    let before = agent.state().clone();
    host.take();
    let saves = fs.log().len();

    // A new jail: the provision order, on FreeBSD's commands.
    let report = agent
        .dry_run(jail_with_volumes("b"), None)
        .expect("dry run");
    assert_eq!(report.action, DryRunAction::Create);
    let run = changing(&report);
    let first = |word: &str| {
        run.iter()
            .position(|l| l.contains(word))
            .unwrap_or_else(|| panic!("no {word} in {run:#?}"))
    };
    let order = [
        "zfs clone",
        "zfs create",
        "mount -t nullfs",
        "epair create",
        "rctl -a",
        "jail -f",
    ];
    let at: Vec<usize> = order.iter().map(|w| first(w)).collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "{order:?} in {run:#?}");
    assert!(
        run.contains(&format!("/sbin/zfs clone -p -o mountpoint={JAILS}/b zroot/keel/bases/14.2-RELEASE@keel zroot/keel/jails/b")),
        "{run:#?}"
    );

    // A new exec replaces; memory alone is rctl in place; the same spec is nothing.
    let mut exec = jail("a");
    exec.spec.exec.start = vec!["/usr/local/bin/other".into()];
    let report = agent.dry_run(exec, None).expect("dry run");
    assert_eq!(report.action, DryRunAction::Replace);
    assert_eq!(report.because, ["spec.exec"]);
    assert!(run_has(&changing(&report), "/usr/sbin/jail -f", "-r a"));
    let mut memory = jail("a");
    memory.spec.resources.memory = Some(512 << 20);
    let report = agent.dry_run(memory, None).expect("dry run");
    assert_eq!(report.action, DryRunAction::UpdateInPlace);
    assert_eq!(
        changing(&report),
        [
            "/usr/bin/rctl -r jail:a",
            "/usr/bin/rctl -a jail:a:pcpu:deny=100 jail:a:memoryuse:deny=536870912"
        ]
    );
    let report = agent.dry_run(jail("a"), None).expect("dry run");
    assert_eq!(report.action, DryRunAction::Nothing);
    assert!(
        report.changes.is_empty() && changing(&report).is_empty(),
        "{report:?}"
    );

    assert!(host.take().is_empty(), "the Fakes saw no change");
    assert_eq!(agent.state(), &before, "the state is unchanged");
    assert_eq!(fs.log().len(), saves, "the state file was not written");
    assert_eq!(host.saved().as_ref(), Some(&before));
}

fn run_has(run: &[String], start: &str, end: &str) -> bool {
    run.iter().any(|l| l.starts_with(start) && l.ends_with(end))
}

#[test]
fn a_dry_run_refuses_what_the_apply_refuses() {
    let host = Host::new();
    let mut agent = host.agent();
    agent
        .apply(with_address(jail("a"), "10.20.3.7"), None)
        .expect("a");
    host.take();
    for (spec, field) in [
        (with_address(jail("b"), "10.9.9.9"), "spec.network.address"),
        (with_address(jail("b"), "10.20.3.7"), "spec.network.address"),
    ] {
        let err = agent.dry_run(spec.clone(), None).expect_err("refused");
        let applied = agent.apply(spec, None).expect_err("refused");
        assert_eq!(err, applied);
        assert!(
            matches!(&err, ReconcileError::Invalid { field: f, .. } | ReconcileError::Conflict { field: f, .. } if f == field),
            "{err:?}"
        );
    }
    let err = agent
        .dry_run(jail("a"), Some(4))
        .expect_err("owned locally");
    assert!(matches!(err, ReconcileError::Conflict { .. }), "{err:?}");
    assert!(host.take().is_empty());
}
