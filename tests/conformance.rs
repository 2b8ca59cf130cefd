//! One set of behavioural checks run against the three host implementations,
//! so they cannot drift apart:
//!
//! - **fake**: the in-memory Fakes of `keel::host` (`FakeJails`, `FakeZfs`,
//!   `FakeNet`, `FakeMounts`, `FakeFirewall`);
//! - **sim**: the simulated host of `--simulate` (`keel::host::sim`: real
//!   `/bin/sleep 300` processes as jails, directories as datasets, symlinks
//!   as nullfs mounts; its firewall is the Fake one, as in simulate mode);
//! - **freebsd**: the `FreeBsd*` implementations over the scripted FreeBSD
//!   host (`keel::host::scripted::ScriptedHost`), which keeps a host's state
//!   and refuses what FreeBSD refuses, so a wrong order fails here.
//!
//! Each check is written once, generic over [`Backend`], and instantiated
//! for all three by [`conformance!`]. The checks drive the real
//! `Reconciler` and the `agentd::routes` and `agentd::volumes` functions, and
//! observe the host only through the seam traits (`list`, `list_interfaces`,
//! `list_routes`, ...), plus three hooks per backend: crash a workload, read
//! a jail's rctl limits, read a pf anchor's rules.
//!
//! What a backend cannot do, and is skipped for it only:
//! - the Fake's `FakeZfs` knows nothing of `FakeMounts`, so destroying a
//!   volume dataset that is still mounted succeeds there
//!   ([`Backend::ZFS_SEES_MOUNTS`] is false); the refusal of
//!   `agentd::volumes::delete`, which checks the mount table first, is
//!   checked on all three;
//! - the simulated host has no base images, so cloning a base that was
//!   never prepared succeeds there when it names a FreeBSD release
//!   ([`Backend::HAS_BASES`] is false; a name that is no release is
//!   refused);
//! - the Fake has no process: its crash hook marks the jail not running
//!   (the simulated host's kills the `/bin/sleep` workload).
//!
//! The sim backend removes every jail it started when dropped, so a failing
//! check leaves no `sleep` behind.
//!
//! To add a backend: implement [`Backend`] (build the four seams and the
//! firewall over one host, and the hooks), and add its name to the
//! `conformance!` invocations at the bottom.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel::agentd::reconciler::{NodeNetwork, Phase, Reconciler, STATE_FILE};
use keel::agentd::{routes, volumes};
use keel::common::backoff::ManualClock;
use keel::common::cidr::Ipv4Net;
use keel::common::cmd::{CommandRunner, RecordingRunner};
use keel::common::config::CommandPaths;
use keel::common::names::replica_name;
use keel::common::spec::{Jail, parse_jail, parse_service};
use keel::common::store::Store;
use keel::common::wire::Peer;
use keel::host::fake::{CallLog, Faults};
use keel::host::jail::{FakeJails, FreeBsdJails, ObservedJail, Removal};
use keel::host::mount::{FakeMounts, FreeBsdMounts};
use keel::host::net::{FakeNet, FreeBsdNet};
use keel::host::pf::{FakeFirewall, FreeBsdPf, PfError};
use keel::host::scripted::ScriptedHost;
use keel::host::sim::{SimHost, SimJails};
use keel::host::zfs::{FakeZfs, FreeBsdZfs, ZfsError, ZfsLayout};
use keel::host::{Firewall, JailRuntime, MountManager, NetManager, ZfsManager, iface_names};

use crate::util::poll_until;

const BASE: &str = "14.2-RELEASE";
const SUBNET: &str = "10.20.3.0/24";
const BRIDGE: &str = "keel0";

/// One host implementation: its four reconciler seams and its firewall,
/// built over one host, and the hooks the checks need.
trait Backend: Sized {
    type J: JailRuntime;
    type Z: ZfsManager;
    type N: NetManager;
    type M: MountManager;
    type F: Firewall;
    /// Whether destroying a volume dataset sees the mounts of it.
    const ZFS_SEES_MOUNTS: bool = true;
    /// Whether cloning checks that the base snapshot exists.
    const HAS_BASES: bool = true;

    /// A fresh host with base [`BASE`], keeping whatever it needs on disk
    /// in `dir`, datasets in `layout`.
    fn build(dir: &Path, layout: &ZfsLayout) -> (Self, Self::J, Self::Z, Self::N, Self::M);
    /// Every jail on the host, as the backend's `JailRuntime::list` says.
    fn jails(&self) -> Vec<ObservedJail>;
    /// Makes jail `jail`'s workload exit (the jail stays) and returns once
    /// the host shows it.
    fn crash(&self, jail: &ObservedJail);
    /// True while jail `name` has rctl limits.
    fn has_limits(&self, name: &str) -> bool;
    /// The firewall of this host.
    fn firewall(&self) -> &Self::F;
    /// The rules loaded into pf anchor `anchor`, if any.
    fn anchor_rules(&self, anchor: &str) -> Option<String>;
}

// ---- the three backends ----

struct FakeBackend {
    jails: FakeJails,
    firewall: FakeFirewall,
}

impl Backend for FakeBackend {
    type J = FakeJails;
    type Z = FakeZfs;
    type N = FakeNet;
    type M = FakeMounts;
    type F = FakeFirewall;
    const ZFS_SEES_MOUNTS: bool = false;

    fn build(_dir: &Path, layout: &ZfsLayout) -> (Self, FakeJails, FakeZfs, FakeNet, FakeMounts) {
        let log = CallLog::new();
        let faults = Faults::default();
        let jails = FakeJails::new(log.clone(), faults.clone());
        let zfs = FakeZfs::with_layout(layout.clone(), log.clone(), faults.clone());
        zfs.add_base(BASE);
        let backend = FakeBackend {
            jails: jails.clone(),
            firewall: FakeFirewall::new(log.clone(), faults.clone()),
        };
        let net = FakeNet::new(log.clone(), faults.clone());
        (backend, jails, zfs, net, FakeMounts::new(log, faults))
    }

    fn jails(&self) -> Vec<ObservedJail> {
        self.jails.list().expect("fake jls")
    }

    fn crash(&self, jail: &ObservedJail) {
        self.jails.crash(&jail.name);
    }

    fn has_limits(&self, name: &str) -> bool {
        self.jails.limits(name).is_some()
    }

    fn firewall(&self) -> &FakeFirewall {
        &self.firewall
    }

    fn anchor_rules(&self, anchor: &str) -> Option<String> {
        self.firewall.anchor(anchor)
    }
}

struct SimBackend {
    jails: SimJails,
    firewall: FakeFirewall,
}

impl Drop for SimBackend {
    /// Removes every simulated jail, so no workload outlives a failed check.
    fn drop(&mut self) {
        for jail in self.jails.list().unwrap_or_default() {
            let _ = self.jails.remove(&jail.name, &jail.path, Removal::Force);
        }
    }
}

impl Backend for SimBackend {
    type J = SimJails;
    type Z = keel::host::sim::SimZfs;
    type N = keel::host::sim::SimNet;
    type M = keel::host::sim::SimMounts;
    type F = FakeFirewall;
    const HAS_BASES: bool = false;

    fn build(dir: &Path, layout: &ZfsLayout) -> (Self, Self::J, Self::Z, Self::N, Self::M) {
        let host = SimHost::new(&dir.join("sim-state"), layout.clone()).expect("sim host opens");
        let backend = SimBackend {
            jails: host.jails.clone(),
            firewall: FakeFirewall::default(),
        };
        (backend, host.jails, host.zfs, host.net, host.mounts)
    }

    fn jails(&self) -> Vec<ObservedJail> {
        self.jails.list().expect("sim jls")
    }

    fn crash(&self, jail: &ObservedJail) {
        // The workload is `/bin/sleep` itself (spawned without a shell), and
        // a simulated jail's jid is its pid.
        crate::util::agent::signal(jail.jid, libc::SIGKILL).expect("workload killed");
        poll_until("the killed workload to be seen as crashed", || {
            self.jails()
                .iter()
                .any(|j| j.name == jail.name && !j.running)
        });
    }

    fn has_limits(&self, name: &str) -> bool {
        self.jails.limits(name).is_some()
    }

    fn firewall(&self) -> &FakeFirewall {
        &self.firewall
    }

    fn anchor_rules(&self, anchor: &str) -> Option<String> {
        self.firewall.anchor(anchor)
    }
}

struct FreeBsdBackend {
    host: ScriptedHost,
    conf_dir: PathBuf,
    firewall: FreeBsdPf<ScriptedHost>,
}

impl Backend for FreeBsdBackend {
    type J = FreeBsdJails<ScriptedHost>;
    type Z = FreeBsdZfs<ScriptedHost>;
    type N = FreeBsdNet<ScriptedHost>;
    type M = FreeBsdMounts<ScriptedHost>;
    type F = FreeBsdPf<ScriptedHost>;

    fn build(dir: &Path, layout: &ZfsLayout) -> (Self, Self::J, Self::Z, Self::N, Self::M) {
        let paths = CommandPaths::default();
        let host = ScriptedHost::new(paths.clone(), &layout.pool);
        let base = layout.base_snapshot(BASE);
        let base = base.trim_end_matches("@keel");
        host.add_base(base, &dir.join("bases").join(BASE));
        let conf_dir = dir.join("jail-conf");
        let backend = FreeBsdBackend {
            firewall: FreeBsdPf::new(host.clone(), paths.clone()),
            host: host.clone(),
            conf_dir: conf_dir.clone(),
        };
        (
            backend,
            FreeBsdJails::new(host.clone(), paths.clone(), conf_dir),
            FreeBsdZfs::new(
                host.clone(),
                paths.clone(),
                layout.clone(),
                2,
                Duration::ZERO,
            ),
            FreeBsdNet::new(host.clone(), paths.clone()),
            FreeBsdMounts::new(host, paths),
        )
    }

    fn jails(&self) -> Vec<ObservedJail> {
        FreeBsdJails::new(self.host.clone(), CommandPaths::default(), &self.conf_dir)
            .list()
            .expect("scripted jls")
    }

    fn crash(&self, jail: &ObservedJail) {
        self.host.crash(&jail.name);
    }

    fn has_limits(&self, name: &str) -> bool {
        !self.host.rctl_rules(name).is_empty()
    }

    fn firewall(&self) -> &FreeBsdPf<ScriptedHost> {
        &self.firewall
    }

    fn anchor_rules(&self, anchor: &str) -> Option<String> {
        self.host.anchor(anchor)
    }
}

// ---- the rig: one backend, one reconciler on a manual clock ----

type Agent<B> =
    Reconciler<<B as Backend>::J, <B as Backend>::Z, <B as Backend>::N, <B as Backend>::M>;

struct Rig<B: Backend> {
    agent: Agent<B>,
    clock: ManualClock,
    layout: ZfsLayout,
    // Dropped after the agent: the sim backend removes its jails, then the
    // directory holding their roots goes.
    backend: B,
    _dir: tempfile::TempDir,
}

impl<B: Backend> Rig<B> {
    fn new() -> Rig<B> {
        let dir = tempfile::tempdir().expect("tempdir");
        let layout = ZfsLayout {
            pool: "zroot".into(),
            jails_dir: dir.path().join("jails"),
            volumes_dir: dir.path().join("volumes"),
        };
        let (backend, jails, zfs, net, mounts) = B::build(dir.path(), &layout);
        let (store, state) = Store::open(&dir.path().join("agent"), STATE_FILE).expect("store");
        let clock = ManualClock::new();
        let agent = Reconciler::new(
            jails,
            zfs,
            net,
            mounts,
            NodeNetwork {
                bridge: BRIDGE.into(),
                subnet: SUBNET.parse().expect("subnet"),
            },
            store,
            state,
            Box::new(clock.clone()),
        );
        Rig {
            agent,
            clock,
            layout,
            backend,
            _dir: dir,
        }
    }

    fn observed(&self, name: &str) -> Option<ObservedJail> {
        self.backend.jails().into_iter().find(|j| j.name == name)
    }

    fn phase(&self, name: &str) -> Option<Phase> {
        self.agent.get(name).map(|s| s.state)
    }

    fn datasets(&self) -> Vec<String> {
        let (zfs, _) = self.agent.volume_seams();
        zfs.list()
            .expect("zfs list")
            .into_iter()
            .map(|d| d.name)
            .collect()
    }

    fn mounts_under(&self, name: &str) -> Vec<PathBuf> {
        let root = self.layout.rootfs_path(name);
        let (_, mounts) = self.agent.volume_seams();
        mounts
            .list()
            .expect("mount list")
            .into_iter()
            .map(|m| m.target)
            .filter(|t| t.starts_with(&root))
            .collect()
    }

    fn interfaces(&self) -> Vec<String> {
        self.agent.net().list_interfaces().expect("ifconfig -l")
    }

    /// Asserts nothing of jail `name` is left on the host but its volumes.
    fn assert_gone(&self, name: &str) {
        assert!(self.observed(name).is_none(), "the jail is gone");
        assert!(
            !self.datasets().contains(&self.layout.rootfs_dataset(name)),
            "the rootfs dataset is gone: {:?}",
            self.datasets()
        );
        assert!(self.mounts_under(name).is_empty(), "no mount is left");
        let (host_if, _) = iface_names(name);
        assert!(
            !self.interfaces().contains(&host_if),
            "the epair is gone: {:?}",
            self.interfaces()
        );
        assert!(!self.backend.has_limits(name), "the limits are gone");
    }
}

fn jail_spec(name: &str, extra: &str) -> Jail {
    parse_jail(&format!(
        "kind: Jail\n\
         metadata: {{name: {name}}}\n\
         spec:\n\
         \x20 base: {BASE}\n\
         \x20 resources: {{cpu: 1, memory: 256M}}\n\
         \x20 exec: {{start: [/bin/sleep, '300']}}\n\
         {extra}"
    ))
    .expect("valid jail spec")
}

// ---- the checks ----

/// Apply (create + start), crash, restart, replace on a changed spec, delete.
fn lifecycle<B: Backend>() {
    let mut rig = Rig::<B>::new();
    let status = rig
        .agent
        .apply(jail_spec("web", ""), None)
        .expect("applied");
    assert_eq!(status.state, Phase::Starting);
    let first = rig.observed("web").expect("the jail exists");
    assert!(first.running, "its workload runs");
    assert_eq!(first.path, rig.layout.rootfs_path("web"));
    assert!(rig.datasets().contains(&rig.layout.rootfs_dataset("web")));
    assert!(rig.interfaces().contains(&iface_names("web").0));
    assert!(rig.backend.has_limits("web"), "limits are applied");

    rig.backend.crash(&first);
    let report = rig.agent.reconcile();
    assert!(report.failures.is_empty(), "{report:?}");
    assert!(report.restarted.is_empty(), "the first restart waits 1 s");
    assert_eq!(rig.phase("web"), Some(Phase::Restarting));
    rig.clock.advance(Duration::from_secs(1));
    let report = rig.agent.reconcile();
    assert!(report.failures.is_empty(), "{report:?}");
    assert_eq!(report.restarted, ["web"]);
    let restarted = rig.observed("web").expect("recreated");
    assert!(restarted.running);
    assert_eq!(rig.agent.get("web").map(|s| s.restarts), Some(1));
    assert!(rig.backend.has_limits("web"));

    let changed = jail_spec("web", "\x20 env: {GREETING: hello}\n");
    let status = rig.agent.apply(changed, None).expect("re-applied");
    assert_eq!(status.state, Phase::Starting);
    let replaced = rig.observed("web").expect("replaced");
    assert!(replaced.running);
    assert_ne!(replaced.jid, restarted.jid, "a changed spec is a new jail");
    assert_eq!(rig.backend.jails().len(), 1);

    rig.agent.delete("web").expect("deleted");
    assert!(rig.agent.get("web").is_none());
    rig.assert_gone("web");
}

/// Volumes: created on apply and mounted, outlive the jail, refused while
/// mounted, deleted once unmounted.
fn volumes_outlive_their_jail<B: Backend>() {
    let mut rig = Rig::<B>::new();
    let spec = jail_spec(
        "db",
        "\x20 volumes:\n\
         \x20   - {name: db-data, mountPath: /var/db/data, size: 1G}\n",
    );
    let status = rig.agent.apply(spec, None).expect("applied");
    assert_eq!(status.state, Phase::Starting);
    let dataset = rig.layout.volume_dataset("db-data");
    let (zfs, _) = rig.agent.volume_seams();
    let listed = zfs.list().expect("zfs list");
    let volume = listed
        .iter()
        .find(|d| d.name == dataset)
        .expect("the volume dataset exists");
    assert_eq!(volume.quota, Some(1 << 30));
    let target = rig.layout.rootfs_path("db").join("var/db/data");
    assert_eq!(rig.mounts_under("db"), [target]);

    let (zfs, mounts) = rig.agent.volume_seams();
    let refused = volumes::delete(zfs, mounts, "db-data").expect_err("mounted");
    assert_eq!(refused.status(), 409, "{refused}");
    if B::ZFS_SEES_MOUNTS {
        let busy = zfs
            .destroy_volume("db-data")
            .expect_err("zfs sees the mount");
        assert!(matches!(busy, ZfsError::Busy { .. }), "{busy:?}");
    }
    assert!(rig.datasets().contains(&dataset));

    rig.agent.delete("db").expect("deleted");
    rig.assert_gone("db");
    assert!(
        rig.datasets().contains(&dataset),
        "the volume survives its jail"
    );
    let (zfs, mounts) = rig.agent.volume_seams();
    volumes::delete(zfs, mounts, "db-data").expect("unmounted now");
    assert!(!rig.datasets().contains(&dataset));
}

/// A new volume size is a quota change in place: the jail keeps running
/// (same jid), the volume keeps its data, the quota follows the spec.
fn volume_quota_changes_in_place<B: Backend>() {
    let mut rig = Rig::<B>::new();
    let sized = |size: &str| {
        jail_spec(
            "db",
            &format!(
                "\x20 volumes:\n\x20   - {{name: db-data, mountPath: /var/db/data, size: {size}}}\n"
            ),
        )
    };
    rig.agent.apply(sized("1G"), None).expect("applied");
    let before = rig.observed("db").expect("exists");
    let status = rig.agent.apply(sized("2G"), None).expect("re-applied");
    assert_eq!(status.state, Phase::Starting);
    let after = rig.observed("db").expect("exists");
    assert_eq!(after.jid, before.jid, "not replaced");
    assert!(after.running);
    let dataset = rig.layout.volume_dataset("db-data");
    let (zfs, _) = rig.agent.volume_seams();
    let quota = zfs
        .list()
        .expect("zfs list")
        .into_iter()
        .find(|d| d.name == dataset)
        .and_then(|d| d.quota);
    assert_eq!(quota, Some(2 << 30));
    rig.agent.delete("db").expect("deleted");
    rig.assert_gone("db");
}

/// Creating a rootfs or a volume that exists is success (`zfs clone -p`,
/// `zfs create -p`), so an interrupted provision can run again; an existing
/// volume keeps its quota. A missing base is [`ZfsError::NotFound`] naming
/// the snapshot.
fn dataset_creation_is_idempotent<B: Backend>() {
    let rig = Rig::<B>::new();
    let (zfs, _) = rig.agent.volume_seams();
    let root = zfs.clone_rootfs(BASE, "web").expect("cloned");
    assert_eq!(root, rig.layout.rootfs_path("web"));
    assert_eq!(zfs.clone_rootfs(BASE, "web"), Ok(root), "again is a no-op");
    let volume = zfs
        .create_volume("web-data", Some(1 << 30))
        .expect("created");
    assert_eq!(
        zfs.create_volume("web-data", Some(2 << 30)),
        Ok(volume),
        "again is a no-op"
    );
    let dataset = rig.layout.volume_dataset("web-data");
    let quota = zfs
        .list()
        .expect("zfs list")
        .into_iter()
        .find(|d| d.name == dataset)
        .and_then(|d| d.quota);
    assert_eq!(quota, Some(1 << 30), "an existing volume keeps its quota");
    if B::HAS_BASES {
        let missing = rig.layout.base_snapshot("13.0-RELEASE");
        assert_eq!(
            zfs.clone_rootfs("13.0-RELEASE", "old"),
            Err(ZfsError::NotFound(missing))
        );
    }
}

/// Peer routes through `agentd::routes::sync_routes`: added, idempotent,
/// withdrawn when the peer dies.
fn routes_follow_peers<B: Backend>() {
    let mut rig = Rig::<B>::new();
    assert!(rig.agent.reconcile().failures.is_empty());
    let own: Ipv4Net = SUBNET.parse().expect("subnet");
    let peer_net: Ipv4Net = "10.20.4.0/24".parse().expect("net");
    let mut peer = Peer {
        node_id: "b".into(),
        address: Ipv4Addr::new(192, 168, 1, 12),
        pod_cidr: peer_net.to_string(),
        alive: true,
    };
    let net = rig.agent.net();
    let sync = routes::sync_routes(net, own, std::slice::from_ref(&peer), &BTreeSet::new());
    assert!(sync.errors.is_empty(), "{:?}", sync.errors);
    assert_eq!(sync.added, [(peer_net, peer.address)]);
    let via: Vec<String> = net
        .list_routes()
        .expect("routes")
        .into_iter()
        .filter(|r| r.destination == peer_net)
        .map(|r| r.gateway)
        .collect();
    assert_eq!(via, ["192.168.1.12"]);

    let again = routes::sync_routes(net, own, std::slice::from_ref(&peer), &sync.managed);
    assert!(again.errors.is_empty() && again.added.is_empty() && again.deleted.is_empty());

    peer.alive = false;
    let gone = routes::sync_routes(net, own, std::slice::from_ref(&peer), &again.managed);
    assert!(gone.errors.is_empty(), "{:?}", gone.errors);
    assert_eq!(gone.deleted, [peer_net]);
    assert!(
        !net.list_routes()
            .expect("routes")
            .iter()
            .any(|r| r.destination == peer_net)
    );
}

/// Service VIP aliases through `agentd::routes::sync_vips`: added as /32 on
/// the bridge, idempotent, removed when the service goes; the gateway stays.
fn vip_aliases_follow_services<B: Backend>() {
    let mut rig = Rig::<B>::new();
    assert!(rig.agent.reconcile().failures.is_empty());
    let gateway = Ipv4Addr::new(10, 20, 3, 1);
    let vip = Ipv4Addr::new(10, 96, 0, 7);
    let net = rig.agent.net();
    assert_eq!(net.list_addresses(BRIDGE).expect("addresses"), [gateway]);
    let wanted = BTreeSet::from([vip]);
    let sync = routes::sync_vips(net, BRIDGE, &wanted, &BTreeSet::new());
    assert!(sync.errors.is_empty(), "{:?}", sync.errors);
    assert_eq!(sync.added, [vip]);
    let addresses = net.list_addresses(BRIDGE).expect("addresses");
    assert!(addresses.contains(&vip) && addresses.contains(&gateway));

    let again = routes::sync_vips(net, BRIDGE, &wanted, &sync.managed);
    assert!(again.errors.is_empty() && again.added.is_empty());

    let gone = routes::sync_vips(net, BRIDGE, &BTreeSet::new(), &again.managed);
    assert!(gone.errors.is_empty(), "{:?}", gone.errors);
    assert_eq!(gone.removed, [vip]);
    assert_eq!(net.list_addresses(BRIDGE).expect("addresses"), [gateway]);
}

/// pf: Keel's anchors load, are referenced, flush; others are refused.
fn pf_anchors<B: Backend>() {
    let rig = Rig::<B>::new();
    let pf = rig.backend.firewall();
    let rules =
        "rdr pass on em0 inet proto tcp from any to 203.0.113.10 port 443 -> 10.20.3.5 port 443\n";
    pf.load_anchor("keel/ingress", rules).expect("loads");
    assert_eq!(
        rig.backend.anchor_rules("keel/ingress").as_deref(),
        Some(rules)
    );
    let check = pf.check_anchors().expect("checks");
    assert!(check.rdr && check.filter, "{check:?}");
    pf.flush_anchor("keel/ingress").expect("flushes");
    assert_eq!(rig.backend.anchor_rules("keel/ingress"), None);
    for outside in ["", "main", "keel/a/b", "keel/*"] {
        let err = pf.load_anchor(outside, rules).expect_err("not Keel's");
        assert!(matches!(err, PfError::NotKeelAnchor(_)), "{err:?}");
    }
}

/// Derived names reach every backend as valid jail and dataset names: a
/// service replica, its per-replica volume, the ingress jail. An all-digit
/// name never gets that far.
fn derived_names<B: Backend>() {
    let mut rig = Rig::<B>::new();
    let service = parse_service(&format!(
        "kind: Service\n\
         metadata: {{name: web}}\n\
         spec:\n\
         \x20 replicas: 2\n\
         \x20 port: 8080\n\
         \x20 template:\n\
         \x20   base: {BASE}\n\
         \x20   exec: {{start: [/bin/sleep, '300']}}\n\
         \x20   volumes:\n\
         \x20     - {{name: data, mountPath: /var/db/data}}\n"
    ))
    .expect("valid service");
    let replica = replica_name(&service.metadata.name, 0);
    let jail = service.spec.template.to_jail_spec(&replica);
    assert_eq!(jail.spec.volumes[0].name, "web-0-data");
    let status = rig.agent.apply(jail, None).expect("the replica applies");
    assert_eq!(status.state, Phase::Starting);
    assert!(rig.observed("web-0").is_some_and(|j| j.running));
    assert!(
        rig.datasets()
            .contains(&rig.layout.volume_dataset("web-0-data"))
    );

    let ingress = service.spec.template.to_jail_spec("keel-ingress");
    let status = rig
        .agent
        .apply(ingress, None)
        .expect("the ingress jail applies");
    assert_eq!(status.state, Phase::Starting);
    assert!(rig.observed("keel-ingress").is_some_and(|j| j.running));

    let before = rig.backend.jails().len();
    let digits = parse_jail(&format!(
        "kind: Jail\nmetadata: {{name: '123'}}\nspec:\n  base: {BASE}\n  exec: {{start: [/bin/sleep, '300']}}\n"
    ));
    let err = digits.expect_err("an all-digit name is refused");
    assert!(err.to_string().contains("all-digit"), "{err}");
    assert_eq!(rig.backend.jails().len(), before, "no backend saw it");

    for name in ["web-0", "keel-ingress"] {
        rig.agent.delete(name).expect("deleted");
        rig.assert_gone(name);
    }
}

/// Instantiates each check for each backend as `check::backend`.
macro_rules! conformance {
    ($($check:ident),* $(,)?) => {
        $(
            mod $check {
                #[test]
                fn fake() {
                    super::$check::<super::FakeBackend>();
                }
                #[test]
                fn sim() {
                    super::$check::<super::SimBackend>();
                }
                #[test]
                fn freebsd() {
                    super::$check::<super::FreeBsdBackend>();
                }
            }
        )*
    };
}

conformance!(
    lifecycle,
    volumes_outlive_their_jail,
    volume_quota_changes_in_place,
    dataset_creation_is_idempotent,
    routes_follow_peers,
    vip_aliases_follow_services,
    pf_anchors,
    derived_names,
);

// ---- ordering mistakes: refused by the scripted host, passed by a transcript ----

/// The seams of the FreeBSD implementation over `runner`.
fn freebsd_seams<R: CommandRunner + Clone>(
    runner: R,
    dir: &Path,
    layout: &ZfsLayout,
) -> (
    FreeBsdJails<R>,
    FreeBsdZfs<R>,
    FreeBsdNet<R>,
    FreeBsdMounts<R>,
) {
    let paths = CommandPaths::default();
    (
        FreeBsdJails::new(runner.clone(), paths.clone(), dir.join("jail-conf")),
        FreeBsdZfs::new(
            runner.clone(),
            paths.clone(),
            layout.clone(),
            2,
            Duration::ZERO,
        ),
        FreeBsdNet::new(runner.clone(), paths.clone()),
        FreeBsdMounts::new(runner, paths),
    )
}

fn scripted_layout(dir: &Path) -> (ScriptedHost, ZfsLayout) {
    let layout = ZfsLayout {
        pool: "zroot".into(),
        jails_dir: dir.join("jails"),
        volumes_dir: dir.join("volumes"),
    };
    let host = ScriptedHost::new(CommandPaths::default(), "zroot");
    let base = layout.base_snapshot(BASE);
    host.add_base(
        base.trim_end_matches("@keel"),
        &dir.join("bases").join(BASE),
    );
    (host, layout)
}

/// Destroying a rootfs while a volume is still mounted in it: every command
/// is one a transcript would accept, in the wrong order. FreeBSD (and the
/// scripted host) refuses the destroy; the volume's mount is untouched.
#[test]
fn destroying_a_rootfs_before_unmounting_its_volume_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (host, layout) = scripted_layout(dir.path());
    let (_, zfs, _, mounts) = freebsd_seams(host.clone(), dir.path(), &layout);
    let root = zfs.clone_rootfs(BASE, "db").expect("cloned");
    let source = zfs.create_volume("db-data", None).expect("volume");
    let target = root.join("var/db/data");
    mounts
        .mount_nullfs(&source, &root, &target)
        .expect("mounted");

    let err = zfs.destroy_rootfs("db").expect_err("busy");
    assert!(matches!(err, ZfsError::Busy { .. }), "{err:?}");
    assert!(err.to_string().contains("pool or dataset is busy"), "{err}");
    assert_eq!(host.mounts(), [("nullfs".to_string(), target.clone())]);
    assert!(host.datasets().contains(&layout.rootfs_dataset("db")));

    // The same calls against a transcript-style runner all "succeed".
    let permissive = std::sync::Arc::new(RecordingRunner::permissive());
    let (_, zfs, _, mounts) = freebsd_seams(permissive, dir.path(), &layout);
    let root = zfs.clone_rootfs(BASE, "db").expect("cloned");
    let source = zfs.create_volume("db-data", None).expect("volume");
    mounts
        .mount_nullfs(&source, &root, &root.join("var/db/data"))
        .expect("mounted");
    zfs.destroy_rootfs("db")
        .expect("a transcript passes the wrong order");
}

/// Creating the jail before its epair: jail(8) cannot move a `vnet.interface`
/// that is not on the host, so the creation fails and no jail exists.
#[test]
fn creating_a_jail_before_its_epair_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (host, layout) = scripted_layout(dir.path());
    let (jails, zfs, net, _) = freebsd_seams(host.clone(), dir.path(), &layout);
    net.ensure_bridge(BRIDGE, "10.20.3.1/24".parse().expect("gw"))
        .expect("bridge");
    let root = zfs.clone_rootfs(BASE, "web").expect("cloned");
    let params = keel::host::jail::JailParams {
        name: "web".into(),
        path: root,
        hostname: "web".into(),
        network: Some(keel::host::jail::JailNetwork {
            interface: iface_names("web").1,
            address: Ipv4Addr::new(10, 20, 3, 2),
            prefix_len: 24,
            gateway: Ipv4Addr::new(10, 20, 3, 1),
        }),
        exec_start: vec!["/bin/sleep".into(), "300".into()],
        exec_stop: Vec::new(),
        env: Default::default(),
    };
    let err = jails.create(&params).expect_err("no epair yet");
    assert!(
        err.to_string()
            .contains("ifconfig: interface kj_web does not exist"),
        "{err}"
    );
    assert!(host.jails().is_empty());

    net.attach(BRIDGE, "web").expect("epair");
    jails.create(&params).expect("the right order works");
    assert_eq!(host.jails(), ["web"]);
}

/// A jail removed with `jail -R` (no configuration file, so no
/// `mount.devfs` either) keeps devfs mounted on its root: destroying the
/// rootfs right after is refused until `<root>/dev` is unmounted.
#[test]
fn destroying_a_rootfs_whose_devfs_is_still_mounted_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (host, layout) = scripted_layout(dir.path());
    let (jails, zfs, _, mounts) = freebsd_seams(host.clone(), dir.path(), &layout);
    let root = zfs.clone_rootfs(BASE, "web").expect("cloned");
    let params = keel::host::jail::JailParams {
        name: "web".into(),
        path: root.clone(),
        hostname: "web".into(),
        network: None,
        exec_start: vec!["/bin/sleep".into(), "300".into()],
        exec_stop: Vec::new(),
        env: Default::default(),
    };
    jails.create(&params).expect("created");
    let force = keel::common::cmd::argv(&["/usr/sbin/jail", "-R", "web"]);
    let out = host
        .run(&force, None, Duration::from_secs(1))
        .expect("modelled");
    assert!(out.success(), "{out:?}");
    let err = zfs.destroy_rootfs("web").expect_err("devfs keeps it busy");
    assert!(matches!(err, ZfsError::Busy { .. }), "{err:?}");
    mounts.unmount(&root.join("dev")).expect("devfs unmounted");
    zfs.destroy_rootfs("web").expect("now it goes");
}

/// A restart after a crash while the dying jail's vnet still holds the
/// epair's jail end (the scripted host's `linger_on_removal`): jail(8) cannot
/// move `kj_web` into the new jail, so the restart must either reclaim the
/// interface before removing the jail (`ifconfig kj_web -vnet web`) or
/// re-create the epair when its jail end is missing on the host.
#[test]
fn a_restart_survives_the_dying_jail_keeping_its_interface() {
    let mut rig = Rig::<FreeBsdBackend>::new();
    rig.agent
        .apply(jail_spec("web", ""), None)
        .expect("applied");
    let first = rig.observed("web").expect("exists");
    rig.backend.host.linger_on_removal("web");
    rig.backend.crash(&first);
    assert!(rig.agent.reconcile().failures.is_empty());
    rig.clock.advance(Duration::from_secs(1));
    let report = rig.agent.reconcile();
    assert!(report.failures.is_empty(), "{report:?}");
    assert_eq!(report.restarted, ["web"]);
    assert!(rig.observed("web").is_some_and(|j| j.running));
}

/// A delete whose exec.stop fails: jail(8) keeps the jail when a command
/// fails, so the removal must fall back to `jail -R` plus unmounting the
/// jail's devfs, and the delete must still finish.
#[test]
fn a_delete_whose_exec_stop_fails_still_removes_everything() {
    let mut rig = Rig::<FreeBsdBackend>::new();
    let mut jail = jail_spec("web", "");
    jail.spec.exec.stop = vec!["/bin/sh".into(), "/etc/rc.shutdown".into()];
    rig.agent.apply(jail, None).expect("applied");
    rig.backend.host.fail_exec_stop("web");
    // The delete may report the stop failure; by the next pass it is done.
    let deleted = rig.agent.delete("web");
    let report = rig.agent.reconcile();
    assert!(rig.agent.get("web").is_none(), "{deleted:?} {report:?}");
    rig.assert_gone("web");
}

/// A delete after the jail's conf file was lost (a wiped state directory):
/// `jail -r NAME` then knows no `mount.devfs`, so `<root>/dev` stays mounted
/// and must be unmounted by Keel before `zfs destroy`.
#[test]
fn a_delete_without_the_conf_file_still_removes_the_rootfs() {
    let mut rig = Rig::<FreeBsdBackend>::new();
    rig.agent
        .apply(jail_spec("web", ""), None)
        .expect("applied");
    let conf = rig.backend.conf_dir.join("web.conf");
    std::fs::remove_file(&conf).expect("the conf file is lost");
    let deleted = rig.agent.delete("web");
    let report = rig.agent.reconcile();
    assert!(rig.agent.get("web").is_none(), "{deleted:?} {report:?}");
    rig.assert_gone("web");
}

/// Limits are in force before the workload starts: rctl(8) resolves
/// `jail:NAME` subjects by name, so the rules can be added before `jail -c`,
/// and exec.start never runs unlimited.
#[test]
fn limits_are_in_force_before_the_workload_starts() {
    let mut rig = Rig::<FreeBsdBackend>::new();
    rig.agent
        .apply(jail_spec("web", ""), None)
        .expect("applied");
    assert!(rig.backend.has_limits("web"));
    assert!(
        !rig.backend.host.started_without_limits("web"),
        "exec.start ran before the rctl rules were added"
    );
}

/// A spec without limits makes no rctl(8) call at all (a nested jail's root
/// may not run rctl, and there is nothing to set).
#[test]
fn a_spec_without_limits_makes_no_rctl_call() {
    let mut rig = Rig::<FreeBsdBackend>::new();
    let jail = parse_jail(&format!(
        "kind: Jail\nmetadata: {{name: web}}\nspec:\n  base: {BASE}\n  exec: {{start: [/bin/sleep, '300']}}\n"
    ))
    .expect("valid jail spec");
    rig.agent.apply(jail, None).expect("applied");
    let rctl = CommandPaths::default().rctl.display().to_string();
    let calls: Vec<String> = rig
        .backend
        .host
        .ran()
        .iter()
        .filter(|e| e.argv.first() == Some(&rctl))
        .map(|e| keel::common::cmd::render_argv(&e.argv))
        .collect();
    assert!(calls.is_empty(), "{calls:?}");
}
