//! Benchmark: the cost of one steady-state reconcile pass against the number of
//! jails, with the FreeBSD host implementations (`FreeBsdJails`, `FreeBsdZfs`,
//! `FreeBsdNet`, `FreeBsdMounts`) over a synthetic [`CommandRunner`].
//!
//! The synthetic runner is a small model of a FreeBSD host: it answers the
//! observation commands (`jls -h name jid path`, `ps -a -x -o jid=`,
//! `zfs list -H -p -o name,used,quota,mountpoint ...`, `mount -p -t nullfs`,
//! `ifconfig -l`) and the one-jail lookups of an apply (`jls -j NAME ...`,
//! `ps -x -o jid= -J JID`, `zfs list ... NAME...`) in the formats of
//! `tests/golden/` for whatever jails, datasets, mounts and interfaces it
//! holds, carries out the provisioning
//! commands the reconciler sends when a jail is applied (zfs clone/create,
//! mkdir, mount -t nullfs, ifconfig epair create/name/addm/up, jail -c, rctl),
//! and counts every process it is asked to spawn.
//!
//! Run with `cargo bench --bench reconcile`. It prints, for N = 100, 500, 1000
//! and 5000 jails with one volume each: processes per steady pass and the
//! median pass time, then the ratios time(5000)/time(500) and
//! time(1000)/time(100). It exits non-zero when the number of processes per
//! steady pass exceeds 6 or differs between two N (a correctness property of
//! the claim "observation is batched"), when a pass is not a no-op, or when
//! the CPU ratio time(5000)/time(500) of a pass exceeds 11 (linear is 10).
//!
//! Then the cost of one apply on a full node: a new jail applied through
//! `Reconciler::apply` on a node already running N = 100 and N = 5000 jails,
//! [`APPLIES`] times per N, the sizes taking turns. It prints per N the
//! median of Keel's own CPU time per apply (the thread's CPU time minus what
//! the synthetic runner spent answering, which a real host spends in other
//! processes), the processes it spawned and the bytes it wrote durably to the
//! state directory (counted by a [`StoreFs`] under the agent's store). It
//! exits non-zero when apply(5000)/apply(100) exceeds 2 for either the CPU
//! time or the bytes: an apply touches one jail, so its cost must not follow
//! the number of jails on the node.
//!
//! Before the timed runs, 100 jails are applied one by one through
//! `Reconciler::apply` on an empty synthetic host, and the host that produced
//! is compared with the pre-seeded one of the same size: the pre-seeded hosts
//! of the timed runs are exactly what the reconciler itself would build.
//!
//! This benchmark must never touch the real host: every command goes to the
//! synthetic runner, and the only files written are the state file and the
//! jail.conf files in a temporary directory.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel::agentd::reconciler::{
    AgentState, AgentStore, Deployed, JailRecord, NodeNetwork, PassReport, Reconciler,
};
use keel::common::backoff::SystemClock;
use keel::common::cmd::{CmdError, CmdOutput, CommandRunner, render_argv};
use keel::common::config::CommandPaths;
use keel::common::spec::{self, Jail};
use keel::common::store::{RealFs, StoreFs};
use keel::common::sync::lock;
use keel::host::iface_names;
use keel::host::jail::FreeBsdJails;
use keel::host::mount::FreeBsdMounts;
use keel::host::net::FreeBsdNet;
use keel::host::zfs::{FreeBsdZfs, ZfsLayout};

/// Jail counts of the timed runs.
const SIZES: [usize; 4] = [100, 500, 1000, 5000];
/// Jails applied through `Reconciler::apply` to check the synthetic host.
const APPLY_CHECK: usize = 100;
/// Largest CPU ratio time(5000)/time(500) of a steady pass (linear: 10).
const MAX_PASS_RATIO: f64 = 11.0;
/// Jail counts of the apply measurement.
const APPLY_SIZES: [usize; 2] = [100, 5000];
/// New jails applied per size in the apply measurement.
const APPLIES: usize = 21;
/// Largest ratio apply(5000)/apply(100), of CPU time and of bytes written.
const MAX_APPLY_RATIO: f64 = 2.0;
/// Most processes a steady pass may spawn.
const MAX_PROCESSES_PER_PASS: u64 = 6;
/// Processes per running jail in `ps` (a jail running /etc/rc has several).
const PROCS_PER_JAIL: usize = 3;
/// Host processes outside any jail (jid 0) in `ps`.
const HOST_PROCS: usize = 60;
const POOL: &str = "zroot";
const BASE: &str = "14.2-RELEASE";
const BRIDGE: &str = "keel0";

type FreeBsdReconciler = Reconciler<
    FreeBsdJails<Arc<SyntheticHost>>,
    FreeBsdZfs<Arc<SyntheticHost>>,
    FreeBsdNet<Arc<SyntheticHost>>,
    FreeBsdMounts<Arc<SyntheticHost>>,
>;

fn layout() -> ZfsLayout {
    ZfsLayout {
        pool: POOL.into(),
        jails_dir: "/usr/local/keel/jails".into(),
        volumes_dir: "/usr/local/keel/volumes".into(),
    }
}

fn node() -> NodeNetwork {
    NodeNetwork {
        bridge: BRIDGE.into(),
        // A /16 so 5000 jails fit; auto-addressing starts at network + 2.
        subnet: "10.20.0.0/16".parse().expect("valid CIDR"),
    }
}

fn jail_name(i: usize) -> String {
    format!("web-{i}")
}

/// The spec of jail `i`: one volume, limits, an exec.stop, no fixed address
/// (auto-addressing gives jail `i` the address network + 2 + i when jails are
/// applied in order).
fn jail_spec(i: usize) -> Jail {
    let yaml = format!(
        "kind: Jail
metadata:
  name: {name}
spec:
  base: {BASE}
  resources:
    cpu: 0.5
    memory: 256M
  exec:
    start: [\"/bin/sh\", \"/etc/rc\"]
    stop: [\"/bin/sh\", \"/etc/rc.shutdown\"]
  env:
    TZ: UTC
  volumes:
    - name: data-{i}
      mountPath: /var/db/data
      size: 1G
",
        name = jail_name(i)
    );
    spec::parse_jail(&yaml).expect("the benchmark's spec is valid")
}

fn address(net: &NodeNetwork, i: usize) -> Ipv4Addr {
    let offset = u32::try_from(i + 2).expect("jail index fits u32");
    Ipv4Addr::from(u32::from(net.subnet.network()) + offset)
}

/// What the synthetic host holds. Equality ignores nothing: it is how the
/// apply check compares a host built by the reconciler with a pre-seeded one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct HostModel {
    /// name -> (jid, path, running)
    jails: BTreeMap<String, (u32, String, bool)>,
    /// name -> (quota, mountpoint)
    datasets: BTreeMap<String, (u64, String)>,
    /// (source, target), in mount order.
    mounts: Vec<(String, String)>,
    /// Interface names, in creation order (as `ifconfig -l` lists them).
    interfaces: Vec<String>,
    /// Bridge members.
    bridge_members: BTreeSet<String>,
    /// Interfaces that are up.
    up: BTreeSet<String>,
    /// Jails with rctl rules.
    limited: BTreeSet<String>,
    next_jid: u32,
    next_epair: u32,
}

impl HostModel {
    /// A host with the pool layout, the base snapshot's dataset and the bridge,
    /// and no jails.
    fn empty() -> HostModel {
        let mut m = HostModel {
            next_jid: 1,
            ..HostModel::default()
        };
        for (name, mountpoint) in [
            (format!("{POOL}/keel"), "none".to_string()),
            (format!("{POOL}/keel/bases"), "none".to_string()),
            (
                format!("{POOL}/keel/bases/{BASE}"),
                format!("/usr/local/keel/bases/{BASE}"),
            ),
            (format!("{POOL}/keel/jails"), "none".to_string()),
            (format!("{POOL}/keel/volumes"), "none".to_string()),
        ] {
            m.datasets.insert(name, (0, mountpoint));
        }
        m.interfaces = ["vtnet0", "lo0", "pflog0", BRIDGE]
            .map(String::from)
            .to_vec();
        m.up.insert(BRIDGE.into());
        m
    }

    /// The host after `n` jails were provisioned in order, as the reconciler
    /// would have done it (checked by [`apply_check`]).
    fn seeded(n: usize) -> HostModel {
        let mut m = HostModel::empty();
        let layout = layout();
        for i in 0..n {
            let name = jail_name(i);
            let root = layout.rootfs_path(&name);
            let volume = format!("data-{i}");
            m.datasets.insert(
                layout.rootfs_dataset(&name),
                (0, root.display().to_string()),
            );
            m.datasets.insert(
                layout.volume_dataset(&volume),
                (1 << 30, layout.volume_path(&volume).display().to_string()),
            );
            m.mounts.push((
                layout.volume_path(&volume).display().to_string(),
                root.join("var/db/data").display().to_string(),
            ));
            // The jail end of the epair moved into the jail's vnet: only the
            // host end is left on the host.
            let (host_if, _) = iface_names(&name);
            m.interfaces.push(host_if.clone());
            m.bridge_members.insert(host_if.clone());
            m.up.insert(host_if);
            m.jails
                .insert(name.clone(), (m.next_jid, root.display().to_string(), true));
            m.next_jid += 1;
            m.next_epair += 1;
            m.limited.insert(name);
        }
        m
    }

    fn jls(&self) -> String {
        let mut out = String::from("name jid path\n");
        for (name, (jid, path, _)) in &self.jails {
            out.push_str(&format!("{name} {jid} {path}\n"));
        }
        out
    }

    fn ps(&self) -> String {
        let mut out = String::new();
        let host = "    0\n".repeat(HOST_PROCS / 2);
        out.push_str(&host);
        for (jid, _, running) in self.jails.values() {
            if *running {
                for _ in 0..PROCS_PER_JAIL {
                    out.push_str(&format!("{jid:>5}\n"));
                }
            }
        }
        out.push_str(&host);
        out
    }

    fn zfs_list(&self) -> String {
        let mut out = String::new();
        for (name, (quota, mountpoint)) in &self.datasets {
            out.push_str(&format!("{name}\t98304\t{quota}\t{mountpoint}\n"));
        }
        out
    }

    fn mount_p(&self) -> String {
        let mut out = String::new();
        for (source, target) in &self.mounts {
            out.push_str(&format!("{source} {target} nullfs\trw\t\t0 0\n"));
        }
        out
    }

    fn ifconfig_l(&self) -> String {
        let mut out = self.interfaces.join(" ");
        out.push('\n');
        out
    }
}

/// Rendered observation outputs, rebuilt only after a change: the timed
/// passes then measure the reconciler and the parsers, not the model.
#[derive(Debug, Default)]
struct Rendered {
    jls: String,
    ps: String,
    zfs: String,
    mount: String,
    ifconfig: String,
}

/// The synthetic FreeBSD host behind every `FreeBsd*` implementation.
#[derive(Debug)]
struct SyntheticHost {
    paths: CommandPaths,
    model: Mutex<HostModel>,
    rendered: Mutex<Option<Rendered>>,
    spawned: AtomicU64,
    /// CPU time (ns) the runner spent answering: the work of the host's
    /// own processes, not Keel's.
    runner_cpu_ns: AtomicU64,
    by_command: Mutex<BTreeMap<String, u64>>,
    unexpected: Mutex<Vec<String>>,
}

fn ok(stdout: impl Into<String>) -> CmdOutput {
    CmdOutput {
        status: 0,
        stdout: stdout.into(),
        stderr: String::new(),
    }
}

fn fail(stderr: impl Into<String>) -> CmdOutput {
    CmdOutput {
        status: 1,
        stdout: String::new(),
        stderr: stderr.into(),
    }
}

impl SyntheticHost {
    fn new(model: HostModel) -> SyntheticHost {
        SyntheticHost {
            paths: CommandPaths::default(),
            model: Mutex::new(model),
            rendered: Mutex::new(None),
            spawned: AtomicU64::new(0),
            runner_cpu_ns: AtomicU64::new(0),
            by_command: Mutex::default(),
            unexpected: Mutex::default(),
        }
    }

    fn spawned(&self) -> u64 {
        self.spawned.load(Ordering::Relaxed)
    }

    fn runner_cpu(&self) -> Duration {
        Duration::from_nanos(self.runner_cpu_ns.load(Ordering::Relaxed))
    }

    /// Per-command counts since the last call, reset.
    fn take_counts(&self) -> BTreeMap<String, u64> {
        std::mem::take(&mut *lock(&self.by_command))
    }

    fn take_unexpected(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.unexpected))
    }

    fn model(&self) -> HostModel {
        lock(&self.model).clone()
    }

    fn observe(&self, pick: impl Fn(&Rendered) -> &String) -> CmdOutput {
        let mut cache = lock(&self.rendered);
        let r = cache.get_or_insert_with(|| {
            let m = lock(&self.model);
            Rendered {
                jls: m.jls(),
                ps: m.ps(),
                zfs: m.zfs_list(),
                mount: m.mount_p(),
                ifconfig: m.ifconfig_l(),
            }
        });
        ok(pick(r).clone())
    }

    fn change(&self, f: impl FnOnce(&mut HostModel) -> CmdOutput) -> CmdOutput {
        *lock(&self.rendered) = None;
        f(&mut lock(&self.model))
    }

    fn answer(&self, argv: &[String]) -> CmdOutput {
        let p = &self.paths;
        let is = |path: &Path| argv.first().map(String::as_str) == path.to_str();
        let args: Vec<&str> = argv.iter().skip(1).map(String::as_str).collect();
        let zfs_list_root = format!("{POOL}/keel");
        match args.as_slice() {
            ["-h", "name", "jid", "path"] if is(&p.jls) => self.observe(|r| &r.jls),
            ["-a", "-x", "-o", "jid="] if is(&p.ps) => self.observe(|r| &r.ps),
            [
                "list",
                "-H",
                "-p",
                "-o",
                "name,used,quota,mountpoint",
                "-t",
                "filesystem",
                "-r",
                root,
            ] if is(&p.zfs) && *root == zfs_list_root => self.observe(|r| &r.zfs),
            ["-p", "-t", "nullfs"] if is(&p.mount) => self.observe(|r| &r.mount),
            ["-j", name, "-h", "name", "jid", "path"] if is(&p.jls) => {
                let m = lock(&self.model);
                match m.jails.get(*name) {
                    Some((jid, path, _)) => ok(format!("name jid path\n{name} {jid} {path}\n")),
                    None => CmdOutput {
                        status: 1,
                        stdout: "name jid path\n".into(),
                        stderr: format!("jls: jail \"{name}\" not found\n"),
                    },
                }
            }
            ["-x", "-o", "jid=", "-J", jid] if is(&p.ps) => {
                let m = lock(&self.model);
                let running = m
                    .jails
                    .values()
                    .any(|(j, _, running)| j.to_string() == *jid && *running);
                if running {
                    ok(format!("{jid:>5}\n").repeat(PROCS_PER_JAIL))
                } else {
                    fail("")
                }
            }
            [
                "list",
                "-H",
                "-p",
                "-o",
                "name,used,quota,mountpoint",
                "-t",
                "filesystem",
                names @ ..,
            ] if is(&p.zfs) && names.first().is_some_and(|n| !n.starts_with('-')) => {
                let m = lock(&self.model);
                let mut out = ok("");
                for name in names {
                    match m.datasets.get(*name) {
                        Some((quota, mountpoint)) => out
                            .stdout
                            .push_str(&format!("{name}\t98304\t{quota}\t{mountpoint}\n")),
                        None => {
                            out.status = 1;
                            out.stderr.push_str(&format!(
                                "cannot open '{name}': dataset does not exist\n"
                            ));
                        }
                    }
                }
                out
            }
            ["-l"] if is(&p.ifconfig) => self.observe(|r| &r.ifconfig),

            ["clone", "-p", "-o", mountpoint, _snapshot, dataset] if is(&p.zfs) => {
                let mp = mountpoint.trim_start_matches("mountpoint=").to_string();
                let ds = dataset.to_string();
                self.change(|m| {
                    m.datasets.insert(ds, (0, mp));
                    ok("")
                })
            }
            ["create", "-p", "-o", mountpoint, "-o", quota, dataset] if is(&p.zfs) => {
                let mp = mountpoint.trim_start_matches("mountpoint=").to_string();
                let q = quota.trim_start_matches("quota=").parse().unwrap_or(0);
                let ds = dataset.to_string();
                self.change(|m| {
                    m.datasets.insert(ds, (q, mp));
                    ok("")
                })
            }
            ["-p", _] if is(&p.mkdir) => ok(""),
            ["-t", "nullfs", source, target] if is(&p.mount) => {
                let entry = (source.to_string(), target.to_string());
                self.change(|m| {
                    m.mounts.push(entry);
                    ok("")
                })
            }
            ["epair", "create"] if is(&p.ifconfig) => self.change(|m| {
                let n = m.next_epair;
                m.next_epair += 1;
                m.interfaces.push(format!("epair{n}a"));
                m.interfaces.push(format!("epair{n}b"));
                ok(format!("epair{n}a\n"))
            }),
            [from, "name", to] if is(&p.ifconfig) => {
                let (from, to) = (from.to_string(), to.to_string());
                self.change(|m| match m.interfaces.iter_mut().find(|i| **i == from) {
                    Some(slot) => {
                        slot.clone_from(&to);
                        ok(format!("{to}\n"))
                    }
                    None => fail(format!("ifconfig: interface {from} does not exist\n")),
                })
            }
            [bridge, "addm", member] if is(&p.ifconfig) && *bridge == BRIDGE => {
                let member = member.to_string();
                self.change(|m| {
                    m.bridge_members.insert(member);
                    ok("")
                })
            }
            [iface, "up"] if is(&p.ifconfig) => {
                let iface = iface.to_string();
                self.change(|m| {
                    m.up.insert(iface);
                    ok("")
                })
            }
            ["-f", _conf, "-c", name] if is(&p.jail) => {
                let name = name.to_string();
                let root = layout().rootfs_path(&name).display().to_string();
                self.change(|m| {
                    let jid = m.next_jid;
                    m.next_jid += 1;
                    // The jail end of the epair moves into the jail's vnet.
                    let (_, jail_if) = iface_names(&name);
                    m.interfaces.retain(|i| *i != jail_if);
                    m.jails.insert(name.clone(), (jid, root, true));
                    ok(format!("{name}: created\n"))
                })
            }
            ["-r", rule] if is(&p.rctl) => {
                let name = rule.trim_start_matches("jail:").to_string();
                self.change(|m| {
                    m.limited.remove(&name);
                    ok("")
                })
            }
            ["-a", rules @ ..] if is(&p.rctl) => {
                let names: BTreeSet<String> = rules
                    .iter()
                    .filter_map(|r| r.split(':').nth(1))
                    .map(String::from)
                    .collect();
                self.change(|m| {
                    m.limited.extend(names);
                    ok("")
                })
            }
            _ => {
                lock(&self.unexpected).push(render_argv(argv));
                fail("synthetic host: command not modelled\n")
            }
        }
    }
}

impl CommandRunner for SyntheticHost {
    fn run(
        &self,
        argv: &[String],
        _stdin: Option<&[u8]>,
        _timeout: Duration,
    ) -> Result<CmdOutput, CmdError> {
        self.spawned.fetch_add(1, Ordering::Relaxed);
        let key = argv
            .iter()
            .take(2)
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(" ");
        *lock(&self.by_command).entry(key).or_insert(0) += 1;
        let start = thread_cpu();
        let out = self.answer(argv);
        let spent = thread_cpu().saturating_sub(start);
        self.runner_cpu_ns.fetch_add(
            u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        Ok(out)
    }
}

fn reconciler(
    host: &Arc<SyntheticHost>,
    dir: &Path,
    store: AgentStore,
    state: Option<AgentState>,
) -> FreeBsdReconciler {
    let paths = CommandPaths::default();
    Reconciler::new(
        FreeBsdJails::new(host.clone(), paths.clone(), dir.join("jails")),
        FreeBsdZfs::new(
            host.clone(),
            paths.clone(),
            layout(),
            3,
            Duration::from_millis(0),
        ),
        FreeBsdNet::new(host.clone(), paths.clone()),
        FreeBsdMounts::new(host.clone(), paths),
        node(),
        store,
        state,
        Box::new(SystemClock),
    )
}

/// The desired state of `n` jails as `n` applies in order would persist it.
fn seeded_state(n: usize) -> AgentState {
    let net = node();
    let mut state = AgentState::default();
    for i in 0..n {
        state.jails.insert(
            jail_name(i),
            JailRecord {
                spec: jail_spec(i),
                address: address(&net, i),
                epoch: None,
                created_unix: 1_700_000_000,
                restarts: 0,
                // What an apply records once the jail is up (see
                // `Deployed`): the steady state the bench measures.
                deployed: Some(Deployed {
                    spec: jail_spec(i).spec,
                    address: address(&net, i),
                    limits: Some(jail_spec(i).spec.resources),
                }),
            },
        );
    }
    state
}

/// Applies [`APPLY_CHECK`] jails through the reconciler on an empty host and
/// checks the result is the pre-seeded host of that size. Returns the
/// processes spawned per apply, or why the check failed.
fn apply_check() -> Result<f64, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let host = Arc::new(SyntheticHost::new(HostModel::empty()));
    let (store, state) = AgentStore::open(dir.path()).map_err(|e| e.to_string())?;
    let mut r = reconciler(&host, dir.path(), store, state);
    for i in 0..APPLY_CHECK {
        let status = r
            .apply(jail_spec(i), None)
            .map_err(|e| format!("apply {}: {e}", jail_name(i)))?;
        if status.address != address(&node(), i) {
            return Err(format!(
                "{} got address {}, expected {}",
                jail_name(i),
                status.address,
                address(&node(), i)
            ));
        }
    }
    let per_apply = host.spawned() as f64 / APPLY_CHECK as f64;
    let unexpected = host.take_unexpected();
    if !unexpected.is_empty() {
        return Err(format!("commands not modelled: {unexpected:?}"));
    }
    let built = host.model();
    let seeded = HostModel::seeded(APPLY_CHECK);
    if built != seeded {
        return Err(format!(
            "the host built by {APPLY_CHECK} applies differs from the pre-seeded one:\nbuilt:  {built:?}\nseeded: {seeded:?}"
        ));
    }
    let mut persisted = r.state().clone();
    for rec in persisted.jails.values_mut() {
        rec.created_unix = 1_700_000_000;
    }
    persisted.backoff = Default::default();
    if persisted != seeded_state(APPLY_CHECK) {
        return Err("the state persisted by the applies differs from the pre-seeded one".into());
    }
    Ok(per_apply)
}

/// CPU time consumed by the calling thread. Wall time on a shared 2-core
/// machine includes time spent preempted by unrelated work; the CPU time of
/// the pass is the figure that load does not inflate.
#[allow(unsafe_code)]
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer to a
    // local; CLOCK_THREAD_CPUTIME_ID exists on every Unix Keel runs on.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// Median, minimum and maximum of some durations.
#[derive(Debug, Clone, Copy)]
struct Spread {
    median: Duration,
    min: Duration,
    max: Duration,
}

fn spread(mut times: Vec<Duration>) -> Spread {
    times.sort();
    Spread {
        median: times[times.len() / 2],
        min: times[0],
        max: times[times.len() - 1],
    }
}

/// Timed steady passes per N. The sizes take turns, one pass each per round,
/// so a burst of unrelated load on the machine hits every N alike instead of
/// skewing the ratios.
const ROUNDS: usize = 21;

/// One N: its synthetic host, its reconciler and what its passes measured.
struct Run {
    n: usize,
    host: Arc<SyntheticHost>,
    reconciler: FreeBsdReconciler,
    /// Holds the state file and the jail.conf files until the run is dropped.
    _dir: tempfile::TempDir,
    adopt_wall: Duration,
    adopt_procs: u64,
    procs_per_pass: Vec<u64>,
    wall: Vec<Duration>,
    cpu: Vec<Duration>,
}

impl Run {
    /// Pre-seeds the state file and the host with `n` running jails, opens the
    /// state as a restarted agent would and runs its first (adoption) pass.
    fn start(n: usize) -> Result<Run, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        {
            let (mut store, _) = AgentStore::open(dir.path()).map_err(|e| e.to_string())?;
            store
                .save_all(&seeded_state(n))
                .map_err(|e| e.to_string())?;
        }
        let (store, state) = AgentStore::open(dir.path()).map_err(|e| e.to_string())?;
        let host = Arc::new(SyntheticHost::new(HostModel::seeded(n)));
        let reconciler = reconciler(&host, dir.path(), store, state);
        let mut run = Run {
            n,
            host,
            reconciler,
            _dir: dir,
            adopt_wall: Duration::ZERO,
            adopt_procs: 0,
            procs_per_pass: Vec::new(),
            wall: Vec::new(),
            cpu: Vec::new(),
        };
        // The first pass of a restarted agent adopts the running jails (one
        // state write for the backoff bookkeeping) and must restart nothing.
        let before = run.host.spawned();
        let start = Instant::now();
        let report = run.reconciler.reconcile();
        run.adopt_wall = start.elapsed();
        run.adopt_procs = run.host.spawned() - before;
        run.check("the adoption pass", &report)?;
        run.host.take_counts();
        Ok(run)
    }

    /// One untimed steady pass then one timed one: the first brings this
    /// N's data back into the caches after the other sizes' passes, so each
    /// size is measured warm, as it would be if it ran alone.
    fn pass(&mut self) -> Result<(), String> {
        let before = self.host.spawned();
        let report = self.reconciler.reconcile();
        self.procs_per_pass.push(self.host.spawned() - before);
        self.check("a warm-up pass", &report)?;
        let before = self.host.spawned();
        let (start, cpu_start) = (Instant::now(), thread_cpu());
        let report = self.reconciler.reconcile();
        self.wall.push(start.elapsed());
        self.cpu.push(thread_cpu().saturating_sub(cpu_start));
        self.procs_per_pass.push(self.host.spawned() - before);
        self.check("a steady pass", &report)
    }

    fn check(&self, what: &str, report: &PassReport) -> Result<(), String> {
        if report.failures.is_empty() && report.restarted.is_empty() {
            return Ok(());
        }
        Err(format!(
            "N={}: {what} was not a no-op: failures {:?}, restarted {:?}, commands not modelled {:?}",
            self.n,
            report.failures.iter().take(3).collect::<Vec<_>>(),
            report.restarted.iter().take(3).collect::<Vec<_>>(),
            self.host.take_unexpected()
        ))
    }

    /// Checks the passes left the host as they found it.
    fn finish(&self) -> Result<(), String> {
        if self.host.model() != HostModel::seeded(self.n) {
            return Err(format!("N={}: steady passes changed the host", self.n));
        }
        Ok(())
    }
}

/// The real file system, counting the bytes written to it.
#[derive(Debug, Clone, Default)]
struct CountingFs(Arc<AtomicU64>);

impl CountingFs {
    fn written(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl StoreFs for CountingFs {
    fn read(&self, path: &Path) -> std::io::Result<Option<Vec<u8>>> {
        RealFs.read(path)
    }
    fn write_temp(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        self.0.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        RealFs.write_temp(path, bytes)
    }
    fn fsync_file(&self, path: &Path) -> std::io::Result<()> {
        RealFs.fsync_file(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        RealFs.rename(from, to)
    }
    fn fsync_dir(&self, dir: &Path) -> std::io::Result<()> {
        RealFs.fsync_dir(dir)
    }
    fn create_dir(&self, dir: &Path) -> std::io::Result<()> {
        RealFs.create_dir(dir)
    }
    fn list(&self, dir: &Path) -> std::io::Result<Vec<String>> {
        RealFs.list(dir)
    }
    fn remove(&self, path: &Path) -> std::io::Result<()> {
        RealFs.remove(path)
    }
}

/// One N of the apply measurement: a node running N jails, adopted by a
/// restarted agent, then given new jails one apply at a time.
struct ApplyRun {
    n: usize,
    host: Arc<SyntheticHost>,
    reconciler: FreeBsdReconciler,
    fs: CountingFs,
    _dir: tempfile::TempDir,
    applied: usize,
    cpu: Vec<Duration>,
    procs: Vec<u64>,
    bytes: Vec<u64>,
}

impl ApplyRun {
    fn start(n: usize) -> Result<ApplyRun, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        {
            let (mut store, _) = AgentStore::open(dir.path()).map_err(|e| e.to_string())?;
            store
                .save_all(&seeded_state(n))
                .map_err(|e| e.to_string())?;
        }
        let fs = CountingFs::default();
        let (store, state) =
            AgentStore::with_fs(dir.path(), fs.clone()).map_err(|e| e.to_string())?;
        let host = Arc::new(SyntheticHost::new(HostModel::seeded(n)));
        let mut reconciler = reconciler(&host, dir.path(), store, state);
        let report = reconciler.reconcile();
        if !report.failures.is_empty() || !report.restarted.is_empty() {
            return Err(format!("N={n}: the adoption pass was not a no-op"));
        }
        Ok(ApplyRun {
            n,
            host,
            reconciler,
            fs,
            _dir: dir,
            applied: 0,
            cpu: Vec::new(),
            procs: Vec::new(),
            bytes: Vec::new(),
        })
    }

    /// Applies the next new jail and records what it cost.
    fn apply(&mut self) -> Result<(), String> {
        let i = self.n + self.applied;
        self.applied += 1;
        let (procs, bytes, runner) = (
            self.host.spawned(),
            self.fs.written(),
            self.host.runner_cpu(),
        );
        let cpu_start = thread_cpu();
        let status = self
            .reconciler
            .apply(jail_spec(i), None)
            .map_err(|e| format!("N={}: apply {}: {e}", self.n, jail_name(i)))?;
        let cpu = thread_cpu().saturating_sub(cpu_start);
        let runner = self.host.runner_cpu().saturating_sub(runner);
        self.cpu.push(cpu.saturating_sub(runner));
        self.procs.push(self.host.spawned() - procs);
        self.bytes.push(self.fs.written() - bytes);
        if status.address != address(&node(), i) {
            return Err(format!(
                "N={}: {} got address {}, expected {}",
                self.n,
                jail_name(i),
                status.address,
                address(&node(), i)
            ));
        }
        let unexpected = self.host.take_unexpected();
        if !unexpected.is_empty() {
            return Err(format!(
                "N={}: commands not modelled: {unexpected:?}",
                self.n
            ));
        }
        Ok(())
    }
}

/// The apply measurement (see the module docs); false when a ratio misses.
fn measure_applies() -> Result<bool, String> {
    let mut runs = APPLY_SIZES
        .iter()
        .map(|n| ApplyRun::start(*n))
        .collect::<Result<Vec<_>, _>>()?;
    for _ in 0..APPLIES {
        for r in &mut runs {
            r.apply()?;
        }
    }
    let median_bytes = |r: &ApplyRun| {
        let mut b = r.bytes.clone();
        b.sort_unstable();
        b[b.len() / 2]
    };
    for r in &runs {
        let cpu = spread(r.cpu.clone());
        println!(
            "apply N={:>5}  keel cpu median {:>7.3} ms (min {:.3}, max {:.3})  procs/apply {}  durable bytes/apply {} (max {})",
            r.n,
            ms(cpu.median),
            ms(cpu.min),
            ms(cpu.max),
            r.procs[r.procs.len() / 2],
            median_bytes(r),
            r.bytes.iter().max().copied().unwrap_or(0)
        );
    }
    let (small, large) = (&runs[0], &runs[runs.len() - 1]);
    let cpu_ratio = spread(large.cpu.clone()).median.as_secs_f64()
        / spread(small.cpu.clone()).median.as_secs_f64();
    let bytes_ratio = median_bytes(large) as f64 / median_bytes(small).max(1) as f64;
    let verdict = |r: f64| {
        if r <= MAX_APPLY_RATIO {
            "met"
        } else {
            "MISSED"
        }
    };
    println!(
        "ratio apply({})/apply({}): keel cpu {cpu_ratio:.2} ({}), durable bytes {bytes_ratio:.2} ({}) (target at most {MAX_APPLY_RATIO})",
        large.n,
        small.n,
        verdict(cpu_ratio),
        verdict(bytes_ratio)
    );
    Ok(cpu_ratio <= MAX_APPLY_RATIO && bytes_ratio <= MAX_APPLY_RATIO)
}

/// [`SIZES`], or the comma-separated list in `KEEL_BENCH_SIZES` (to profile
/// one size, e.g. `KEEL_BENCH_SIZES=5000 perf record ...`).
fn sizes() -> Vec<usize> {
    match std::env::var("KEEL_BENCH_SIZES") {
        Ok(list) => list
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .collect(),
        Err(_) => SIZES.to_vec(),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; nothing here takes arguments.
    println!("reconcile benchmark: FreeBSD host implementations over a synthetic runner");
    println!(
        "each jail: 1 volume (zfs dataset + nullfs mount), epair on {BRIDGE}, rctl limits, {PROCS_PER_JAIL} processes"
    );

    match apply_check() {
        Ok(per_apply) => println!(
            "apply check: {APPLY_CHECK} jails applied through Reconciler::apply built exactly the pre-seeded host ({per_apply:.1} processes per apply)"
        ),
        Err(e) => {
            eprintln!("apply check failed: {e}");
            return ExitCode::FAILURE;
        }
    }

    let mut runs = Vec::new();
    for n in sizes() {
        match Run::start(n) {
            Ok(r) => runs.push(r),
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        }
    }
    for _ in 0..ROUNDS {
        for r in &mut runs {
            if let Err(e) = r.pass() {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        }
    }
    for r in &runs {
        if let Err(e) = r.finish() {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
        let (wall, cpu) = (spread(r.wall.clone()), spread(r.cpu.clone()));
        println!(
            "N={:>5}  procs/pass {}  wall median {:>7.2} ms (min {:.2}, max {:.2})  cpu median {:>7.2} ms (min {:.2}, max {:.2})  adoption pass {:.1} ms, {} procs",
            r.n,
            r.procs_per_pass[0],
            ms(wall.median),
            ms(wall.min),
            ms(wall.max),
            ms(cpu.median),
            ms(cpu.min),
            ms(cpu.max),
            ms(r.adopt_wall),
            r.adopt_procs
        );
    }
    if let Some(r) = runs.last() {
        let passes = r.procs_per_pass.len() as u64;
        let per: Vec<String> = r
            .host
            .take_counts()
            .iter()
            .map(|(cmd, c)| format!("{cmd} x{}", c / passes.max(1)))
            .collect();
        println!(
            "commands per steady pass (N={}, {passes} passes): {}",
            r.n,
            per.join(", ")
        );
    }

    let ratio = |cpu: bool, a: usize, b: usize| {
        let find = |n: usize| {
            runs.iter()
                .find(|r| r.n == n)
                .map(|r| spread(if cpu { r.cpu.clone() } else { r.wall.clone() }).median)
        };
        match (find(a), find(b)) {
            (Some(x), Some(y)) => format!("{:.2}", x.as_secs_f64() / y.as_secs_f64()),
            _ => "n/a".to_string(),
        }
    };
    println!(
        "ratio time(5000)/time(500): wall {}, cpu {} (linear: 10, target at most {MAX_PASS_RATIO})",
        ratio(false, 5000, 500),
        ratio(true, 5000, 500)
    );
    println!(
        "ratio time(1000)/time(100): wall {}, cpu {} (linear: 10)",
        ratio(false, 1000, 100),
        ratio(true, 1000, 100)
    );

    let all: BTreeSet<u64> = runs
        .iter()
        .flat_map(|r| r.procs_per_pass.iter().copied())
        .collect();
    let max = all.iter().max().copied().unwrap_or(0);
    if all.len() != 1 || max > MAX_PROCESSES_PER_PASS {
        eprintln!(
            "FAIL: processes per steady pass {all:?}: must be one constant at most {MAX_PROCESSES_PER_PASS}"
        );
        return ExitCode::FAILURE;
    }
    println!(
        "processes per steady pass: {max}, constant in N (target at most {MAX_PROCESSES_PER_PASS}): met"
    );
    let mut failed = false;
    // The ratio is checked whenever both sizes ran (KEEL_BENCH_SIZES may
    // leave one out, to profile a single size).
    if let Ok(r) = ratio(true, 5000, 500).parse::<f64>() {
        if r > MAX_PASS_RATIO {
            eprintln!(
                "FAIL: cpu ratio time(5000)/time(500) of a pass is {r:.2}, above {MAX_PASS_RATIO}"
            );
            failed = true;
        } else {
            println!(
                "cpu ratio time(5000)/time(500) {r:.2} (target at most {MAX_PASS_RATIO}): met"
            );
        }
    }
    match measure_applies() {
        Ok(true) => {}
        Ok(false) => {
            eprintln!(
                "FAIL: an apply on a node of 5000 jails costs more than {MAX_APPLY_RATIO}x one on a node of 100"
            );
            failed = true;
        }
        Err(e) => {
            eprintln!("apply measurement failed: {e}");
            failed = true;
        }
    }
    if failed {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
