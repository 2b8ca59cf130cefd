//! The reconciler: makes the host match the desired jails and keeps it so.
//!
//! [`Reconciler`] is generic over the four host seams and never knows whether it
//! drives FreeBSD, the simulated host or in-memory Fakes. Its public API is the
//! seed's: [`Reconciler::new`], [`Reconciler::apply`], [`Reconciler::delete`] and
//! [`Reconciler::reconcile`].
//!
//! - `apply` and `delete` change the desired state, persist that jail's
//!   record ([`records`]: one file per jail, so the write does not grow with
//!   the number of jails) *before* anything is acknowledged, then converge
//!   that one jail so the caller's response reflects the host. An apply
//!   observes only its jail (jls -j and ps -J of it, its datasets by name,
//!   the mounts under its root, the bridge and its epair), not the whole
//!   host, so its cost does not grow with the number of jails on the node;
//!   a delete reads only the mounts under the jail's root. An apply is an
//!   explicit request and does not wait out the jail's backoff delay.
//! - `reconcile` (the 5 s timer) observes the whole host with one call per
//!   subsystem (jls + ps, zfs list, mount -p, ifconfig -l), then converges every
//!   jail from that snapshot: provisions what is missing, restarts crashed
//!   workloads, finishes interrupted deletes and removes Keel jails nobody
//!   wants any more (a jail whose root is `{jails_dir}/{name}`; others are
//!   never touched). A failure is recorded against its jail and the pass goes
//!   on: one broken jail never blocks the others. Every retry of a failed
//!   jail, crashed or never provisioned, waits for its per-jail [`Backoff`]
//!   (1 s doubling to 5 min, reset after 60 s up).
//!
//! Phases (`JailStatus::state`): a workload this agent started is Starting
//! until a pass sees it running at least [`START_SETTLE`] after its start,
//! then Running; where the runtime can tell without a command
//! ([`JailRuntime::exited_at_start`], the simulated host), an apply looks
//! once more right after the start, so one that exited at once is answered
//! as such. A workload found gone is Restarting after a first crash (its
//! delay is the backoff's first) and CrashLoop after repeated ones, with its
//! exit status (when the runtime knows it) as the last exit and the last
//! error. What happens to a jail is also recorded as events
//! ([`Reconciler::set_events`]).
//!
//! A new jail on a base the node does not have (the clone finds no base
//! snapshot) is refused naming `spec.base` and not kept, instead of being
//! recorded and failing every pass.
//!
//! A steady-state pass runs only the observation commands and writes nothing:
//! an agent restarted while its jails run restarts nothing and recreates
//! nothing.
//!
//! Provision order: bridge (only when missing), rootfs clone, volume datasets,
//! volume mounts (before the jail starts, so the workload never sees an empty
//! mount point), epair on the bridge, the root's seed when one is registered
//! ([`Reconciler::seed_root`]: files a system jail's workload needs before it
//! starts), rctl limits (before the jail: rules are bound to the jail's name,
//! so exec.start already runs limited and a refused rule starts nothing; no
//! rctl command at all for a jail that has and had no limits), jail creation
//! (jail.conf sets the address and default route, then runs exec.start).
//! Delete order: remove the jail, clear limits (when it may hold any),
//! destroy the epair, unmount everything under the jail root deepest first,
//! destroy the rootfs. If an unmount fails the delete stops before the rootfs
//! is touched and stays pending. Volume datasets are never destroyed here.
//!
//! Removing a jail (delete, replacement, restart) cannot get stuck: a
//! workload that may still run gets its exec.stop ([`Removal::Stop`]); one
//! the pass saw gone (a crash) gets none, and one whose exec.stop failed
//! (jail(8) then keeps the jail) is forced out after all ([`Removal::Force`],
//! `jail -R`), the failure kept as the jail's last error. Before a forced
//! removal the epair's jail side is reclaimed from the jail's vnet
//! ([`NetManager::reclaim`]), and after a removal on the restart path the
//! epair is made anew when its jail side is not back on the host (a dying
//! jail's vnet can hold it for as long as the jail lingers).
//!
//! Spec changes are driven by [`Deployed`], the persisted record of what the
//! jail on the host was built from, not by the apply that made them: a pass
//! can then finish a change an apply could not (a failed step, an agent crash
//! right after the new spec was persisted). Changed limits are applied in
//! place, and so are changed volume quotas (`zfs set quota`; a quota below
//! what a volume already uses is refused with 409 before anything is
//! recorded); any other change replaces the jail (remove, then the provision order,
//! keeping the rootfs); a volume the new spec dropped is unmounted first; a new
//! base unmounts every volume, destroys the rootfs and clones it again.
//!
//! Must never: destroy a volume dataset, destroy a rootfs with a volume still
//! mounted in it, touch a jail outside Keel's jails directory, or acknowledge
//! an apply or delete that is not on disk.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

pub use crate::agentd::health::Target as HealthTarget;
use crate::common::backoff::{Backoff, Clock, Policy, Snapshot, SnapshotEntry};
use crate::common::cidr::Ipv4Net;
use crate::common::cmd::CmdOutput;
use crate::common::events::EventLog;
use crate::common::spec::{Jail, JailSpec, Resources};
use crate::common::store::StoreError;
use crate::common::wire::ObjectKind;
pub use crate::common::wire::{JailStatus, LastExit, Phase};
use crate::host::jail::{JailError, JailNetwork, JailParams, Limits, ObservedJail, Removal};
use crate::host::mount::MountError;
use crate::host::net::NetError;
use crate::host::zfs::{Dataset, ZfsError};
use crate::host::{JailRuntime, MountManager, NetManager, ZfsManager, iface_names};

mod dry_run;
pub mod records;
pub use dry_run::DryRunHost;
pub use records::AgentStore;
use records::{JailFile, NodeRecord};

/// File name of the single state file earlier agents kept every jail in;
/// [`AgentStore::open`] converts it to one record per jail, once.
pub const STATE_FILE: &str = "agentd.json";

/// The node's own network: the bridge and the subnet jails live in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeNetwork {
    /// Bridge name (`keel0`).
    pub bridge: String,
    /// The node's subnet; its first host address is the bridge's (the gateway).
    pub subnet: Ipv4Net,
}

impl NodeNetwork {
    /// The bridge address: network + 1.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.subnet.network()) + 1)
    }

    fn broadcast(&self) -> Ipv4Addr {
        let host_bits = 32 - u32::from(self.subnet.prefix_len());
        let span = if host_bits >= 32 {
            u32::MAX
        } else {
            (1u32 << host_bits) - 1
        };
        Ipv4Addr::from(u32::from(self.subnet.network()) | span)
    }

    /// True for an address a jail may use: inside the subnet, and neither the
    /// network address, the gateway nor the broadcast address.
    pub fn is_host_address(&self, ip: Ipv4Addr) -> bool {
        self.subnet.contains(ip)
            && ip != self.subnet.network()
            && ip != self.gateway()
            && ip != self.broadcast()
    }
}

/// What is persisted: every desired jail and every delete still in progress.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentState {
    /// Desired jails by name.
    pub jails: BTreeMap<String, JailRecord>,
    /// Jails whose delete was acknowledged but not finished (a crash, or a busy
    /// mount); the last spec tells which volumes to unmount, and carries the
    /// jail's address in `network.address` so no other jail takes it meanwhile.
    pub deleting: BTreeMap<String, Jail>,
    /// Crash-loop backoff per jail, so a restarted agent does not hammer a
    /// workload that was crash-looping before it went down. Each jail's
    /// entry is kept in its record; this holds them all, as on disk (the
    /// reconciler's live backoff runs ahead until the next save).
    #[serde(default)]
    pub backoff: Snapshot<String>,
    /// The subnet the control plane assigned (clustered nodes only); kept so a
    /// restarted node keeps it while the control plane is unreachable.
    #[serde(default)]
    pub node_subnet: Option<Ipv4Net>,
    /// Destinations of the kernel routes Keel added towards peers' subnets,
    /// so a route to a peer that left the cluster can still be withdrawn and
    /// no other route is ever touched.
    #[serde(default)]
    pub cluster_routes: BTreeSet<Ipv4Net>,
    /// Service VIPs Keel aliased on the bridge, so an alias whose service is
    /// gone can be removed and no other address is ever touched.
    #[serde(default)]
    pub service_vips: BTreeSet<Ipv4Addr>,
}

/// One desired jail.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JailRecord {
    /// The spec as applied.
    pub spec: Jail,
    /// The address it was given (explicitly or by auto-addressing); kept across
    /// restarts of the agent.
    pub address: Ipv4Addr,
    /// The control plane's placement epoch; `None` for jails applied locally.
    #[serde(default)]
    pub epoch: Option<u64>,
    /// When the spec was first applied (Unix seconds), for AGE.
    pub created_unix: u64,
    /// How many times the workload was restarted after a crash.
    #[serde(default)]
    pub restarts: u32,
    /// What the agent last built on the host for this jail; `None` until the
    /// first jail was created (or for state written before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployed: Option<Deployed>,
}

/// What the jail on the host was built from. A pass observes only whether a
/// jail exists and runs (jls, ps); rctl rules, the rootfs's base and the spec a
/// running jail was started with are not visible in that batch, so the agent
/// remembers them here. This is what lets a pass finish a spec change an
/// apply could not (a failed `jail -r`, an agent crash between persisting the
/// new spec and replacing the jail), instead of leaving the old jail running.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Deployed {
    /// The spec the jail was created from; `spec.base` is the base its rootfs
    /// was cloned from.
    pub spec: JailSpec,
    /// The address it was created with.
    pub address: Ipv4Addr,
    /// The rctl limits in force for the jail's name: recorded once
    /// `set_limits` succeeded, or when none were wanted and none were there
    /// (no rctl call at all). `None` when not known (state written by an
    /// older agent), which makes the next change run rctl.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<Resources>,
}

/// One jail that failed during a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailFailure {
    /// The jail.
    pub jail: String,
    /// What went wrong, with the command and its stderr.
    pub error: String,
}

/// What a reconcile pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Jails that failed; the others converged.
    pub failures: Vec<JailFailure>,
    /// Workloads restarted after a crash in this pass.
    pub restarted: Vec<String>,
}

/// A host step that failed while converging or deleting one jail.
#[derive(Debug, Clone, PartialEq)]
pub enum HostError {
    /// jail(8), jls, rctl, jexec.
    Jail(JailError),
    /// zfs(8).
    Zfs(ZfsError),
    /// ifconfig, route.
    Net(NetError),
    /// mount, umount.
    Mount(MountError),
    /// The host converged but the state file could not be written.
    Store(String),
    /// Preparing a system jail's root before its start failed
    /// ([`Reconciler::seed_root`]).
    Seed(String),
    /// A volume mount under the jail root could not be unmounted, so the
    /// delete stopped before touching the root filesystem.
    UnmountBlocked {
        /// The mount point still in place.
        target: PathBuf,
        /// Why umount refused.
        reason: MountError,
    },
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostError::Jail(e) => write!(f, "{e}"),
            HostError::Zfs(e) => write!(f, "{e}"),
            HostError::Net(e) => write!(f, "{e}"),
            HostError::Mount(e) => write!(f, "{e}"),
            HostError::Store(e) => write!(f, "{e}"),
            HostError::Seed(e) => write!(f, "preparing the jail's root before its start: {e}"),
            HostError::UnmountBlocked { target, reason } => write!(
                f,
                "delete stopped before destroying the root filesystem: {} is still mounted ({reason})",
                target.display()
            ),
        }
    }
}

impl std::error::Error for HostError {}

impl From<JailError> for HostError {
    fn from(e: JailError) -> Self {
        HostError::Jail(e)
    }
}
impl From<ZfsError> for HostError {
    fn from(e: ZfsError) -> Self {
        HostError::Zfs(e)
    }
}
impl From<NetError> for HostError {
    fn from(e: NetError) -> Self {
        HostError::Net(e)
    }
}
impl From<MountError> for HostError {
    fn from(e: MountError) -> Self {
        HostError::Mount(e)
    }
}

/// Why an apply or delete was refused or did not complete.
#[derive(Debug, Clone, PartialEq)]
pub enum ReconcileError {
    /// The request itself is wrong (HTTP 400); nothing changed.
    Invalid {
        /// The offending field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The request conflicts with another jail (HTTP 409); nothing changed.
    Conflict {
        /// The offending field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// No such jail (HTTP 404).
    NotFound(String),
    /// The state could not be persisted; nothing was acknowledged and the
    /// previous state is kept (HTTP 500).
    Store(String),
    /// The change is recorded, but the host did not converge yet; the agent
    /// keeps retrying with backoff (HTTP 500 with the command and stderr).
    Host {
        /// The jail.
        jail: String,
        /// The failed step.
        error: HostError,
    },
    /// No free address left in the node subnet (HTTP 409).
    AddressesExhausted(Ipv4Net),
    /// A new jail's base is not on this node (its clone found no base
    /// snapshot): refused naming `spec.base` (HTTP 400) and not kept.
    BaseMissing {
        /// The jail.
        jail: String,
        /// Its `spec.base`.
        base: String,
        /// Why the clone failed, with the fetch command to run.
        error: String,
    },
}

impl fmt::Display for ReconcileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReconcileError::Invalid { field, message } => write!(f, "{field}: {message}"),
            ReconcileError::Conflict { field, message } => write!(f, "{field}: {message}"),
            ReconcileError::NotFound(name) => write!(f, "no jail named {name} on this node"),
            ReconcileError::Store(e) => write!(f, "{e}"),
            ReconcileError::Host {
                jail,
                error: HostError::Store(e),
            } => write!(
                f,
                "jail {jail} converged, but its bookkeeping could not be saved (every pass retries): {e}"
            ),
            ReconcileError::Host { jail, error } => write!(
                f,
                "jail {jail} is recorded but not converged yet (the agent keeps retrying): {error}"
            ),
            ReconcileError::AddressesExhausted(net) => write!(
                f,
                "no free address left in the node subnet {net}; delete a jail or use a larger subnet"
            ),
            ReconcileError::BaseMissing { jail, base, error } => write!(
                f,
                "spec.base: base {base} is not on this node, so jail {jail} was not kept: {error}"
            ),
        }
    }
}

impl std::error::Error for ReconcileError {}

impl From<StoreError> for ReconcileError {
    fn from(e: StoreError) -> Self {
        ReconcileError::Store(e.to_string())
    }
}

/// What the reconciler saw on the host at the start of a pass.
#[derive(Debug, Default)]
struct Observation {
    jails: BTreeMap<String, ObservedJail>,
    /// Datasets by name, with their quota and use (volume quotas are
    /// compared against the spec from here, without another command).
    datasets: BTreeMap<String, Dataset>,
    /// Mount points, as a set: every volume of every jail is looked up once
    /// per pass, and a scan of the mount list per lookup made a pass
    /// quadratic in the number of jails (bench/reconcile.rs).
    mounted: BTreeSet<PathBuf>,
    interfaces: BTreeSet<String>,
}

/// Per-jail memory of the last attempt (not persisted: rebuilt by the first pass).
#[derive(Debug, Clone, Default)]
struct Runtime {
    phase: Option<Phase>,
    last_error: Option<String>,
    /// A crash already counted against the backoff (so one crash is counted once).
    crash_counted: bool,
    /// Why the jail's last removal had to be forced (its exec.stop failed);
    /// shown as the last error while nothing newer failed, until a removal
    /// goes through cleanly.
    forced_removal: Option<String>,
    /// Which start of the workload is running (0: none seen yet); the health
    /// checker's reports name it, so one about an older start is dropped.
    incarnation: u64,
    /// The health checker said this incarnation passed its probe (and has
    /// not failed it `failureThreshold` times in a row since).
    probe_passed: bool,
    /// Why the health checker took the jail out of rotation; shown as the
    /// last error while nothing newer failed, until its probe passes again.
    health_failure: Option<String>,
    /// Why the health checker last had the jail restarted; kept as the last
    /// error (after anything newer) so a jail back in rotation still says why
    /// it restarted.
    health_restart: Option<String>,
    /// How the workload last exited (LAST EXIT).
    last_exit: Option<LastExit>,
    /// When this agent last started the workload (`None`: it found it
    /// running), for [`START_SETTLE`].
    started_at: Option<Instant>,
}

/// How long a workload this agent started must have been up when a pass
/// sees it running before it is shown Running rather than Starting: a
/// workload that exits within its first second is never shown Running,
/// whatever the pass timing.
pub const START_SETTLE: std::time::Duration = std::time::Duration::from_secs(1);

/// The reconciler; see the module docs.
pub struct Reconciler<J, Z, N, M> {
    jails: J,
    zfs: Z,
    net: N,
    mounts: M,
    node: NodeNetwork,
    store: AgentStore,
    state: AgentState,
    /// Jails whose bookkeeping (restarts, [`Deployed`]) in `state` is not on
    /// disk yet.
    dirty: BTreeSet<String>,
    backoff: Backoff<String>,
    clock: Box<dyn Clock>,
    runtime: BTreeMap<String, Runtime>,
    /// What system jails need in their root before their workload starts
    /// (see [`Reconciler::seed_root`]); not persisted, registered again by
    /// their owner after a restart.
    seeds: BTreeMap<String, RootSeed>,
    /// The last incarnation handed out (see `Runtime::incarnation`).
    incarnations: u64,
    /// Where what happened to a jail is told ([`Reconciler::set_events`]);
    /// the reconciler records and never learns who reads.
    events: EventLog,
    /// The host setup a dry run copies ([`Reconciler::dry_run`]).
    dry_host: DryRunHost,
}

/// Puts what a jail's workload needs into its root filesystem (the path on
/// the host) before the workload starts; the jail's address is known by
/// then. It must leave what is already there alone: it runs at every
/// provision, restarts included.
pub type RootSeed = Box<dyn Fn(&Path, Ipv4Addr) -> Result<(), String> + Send>;

impl<J, Z, N, M> Reconciler<J, Z, N, M>
where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    /// A reconciler over the given host seams, starting from the persisted
    /// state (`None` for a fresh node). Nothing touches the host until the
    /// first [`Reconciler::reconcile`], apply or delete.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        jails: J,
        zfs: Z,
        net: N,
        mounts: M,
        node: NodeNetwork,
        store: AgentStore,
        initial: Option<AgentState>,
        clock: Box<dyn Clock>,
    ) -> Reconciler<J, Z, N, M> {
        let state = initial.unwrap_or_default();
        let backoff = Backoff::restore(Policy::default(), state.backoff.clone(), clock.now());
        Reconciler {
            jails,
            zfs,
            net,
            mounts,
            node,
            store,
            state,
            dirty: BTreeSet::new(),
            backoff,
            clock,
            runtime: BTreeMap::new(),
            seeds: BTreeMap::new(),
            incarnations: 0,
            events: EventLog::in_memory(""),
            dry_host: DryRunHost::default(),
        }
    }

    /// Records what happens to jails (created, started, exited, restarted,
    /// backing off, failed, deleted) in `events` from now on; until then
    /// they go to a ring nobody reads.
    pub fn set_events(&mut self, events: EventLog) {
        self.events = events;
    }

    /// Where this reconciler records its events.
    pub fn events(&self) -> &EventLog {
        &self.events
    }

    /// Registers `seed` for jail `name` (replacing an earlier one): every
    /// provision of that jail runs it once the root filesystem, volumes and
    /// address are in place and before the jail and its workload start. A
    /// seed that fails fails the provision like any host step (the jail
    /// backs off and is retried). For system jails whose workload refuses to
    /// start without a file only Keel writes, such as the ingress jail's
    /// nginx and its configuration.
    pub fn seed_root(&mut self, name: &str, seed: RootSeed) {
        self.seeds.insert(name.to_string(), seed);
    }

    /// The node network this reconciler provisions into.
    pub fn node(&self) -> &NodeNetwork {
        &self.node
    }

    /// Moves the node to another subnet (the control plane assigned one).
    /// Refused while jails have addresses outside it.
    pub fn set_node_subnet(&mut self, subnet: Ipv4Net) -> Result<(), ReconcileError> {
        let candidate = NodeNetwork {
            bridge: self.node.bridge.clone(),
            subnet,
        };
        if let Some((name, rec)) = self
            .state
            .jails
            .iter()
            .find(|(_, r)| !candidate.is_host_address(r.address))
        {
            return Err(ReconcileError::Conflict {
                field: "pod_cidr".into(),
                message: format!(
                    "jail {name} has address {} outside the assigned subnet {subnet}",
                    rec.address
                ),
            });
        }
        self.node = candidate;
        Ok(())
    }

    /// The persisted state (desired jails and pending deletes).
    pub fn state(&self) -> &AgentState {
        &self.state
    }

    /// Records `jail` as desired (with the control plane's `epoch`, if it placed
    /// it), persists that, then converges it. See the module docs.
    ///
    /// An apply is an explicit request: it tries at once even while the jail
    /// waits out a backoff delay. Re-applying an unchanged spec to a running
    /// jail changes nothing on the host.
    pub fn apply(&mut self, jail: Jail, epoch: Option<u64>) -> Result<JailStatus, ReconcileError> {
        let name = jail.metadata.name.clone();
        // One owner per name: a local apply must not rewrite a jail the
        // control plane placed (a service replica, say), nor the control
        // plane adopt a jail an admin applied here, which its fencing and
        // deletes would then remove.
        match (epoch, self.state.jails.get(&name).map(|p| p.epoch)) {
            (None, Some(Some(placed))) => {
                return Err(ReconcileError::Conflict {
                    field: "metadata.name".into(),
                    message: format!(
                        "jail {name} on this node was placed by the control plane (epoch {placed}); \
                         apply it through the control plane, or delete it there first"
                    ),
                });
            }
            (Some(_), Some(None)) => {
                return Err(ReconcileError::Conflict {
                    field: "metadata.name".into(),
                    message: format!(
                        "a jail named {name} was applied on this node directly (over its Unix socket), \
                         so the control plane cannot take it over; delete it on the node \
                         (keelctl --socket SOCKET delete jail {name}) or choose another name"
                    ),
                });
            }
            _ => {}
        }
        let address = self.choose_address(&name, &jail)?;
        let previous = self.state.jails.get(&name).cloned();
        let record = JailRecord {
            spec: jail,
            address,
            epoch: epoch.or(previous.as_ref().and_then(|p| p.epoch)),
            created_unix: previous
                .as_ref()
                .map(|p| p.created_unix)
                .unwrap_or_else(unix_now),
            restarts: previous.as_ref().map(|p| p.restarts).unwrap_or(0),
            // What runs on the host is unchanged until converge rebuilds it.
            deployed: previous.as_ref().and_then(|p| p.deployed.clone()),
        };
        let changed = previous.as_ref().is_some_and(|p| {
            identity(&name, &p.spec.spec, p.address) != identity(&name, &record.spec.spec, address)
        });
        // Observed before the spec is recorded, so a quota below what a
        // volume already holds is refused with nothing changed, rather than
        // recorded and failing every pass. Only this jail is observed: an
        // apply on a full node must not cost what a pass over it costs.
        let observed = self.observe_jail(&name, &record.spec.spec);
        if let Ok(obs) = &observed {
            self.check_quotas(&record.spec.spec, obs)?;
        }
        let unchanged =
            previous.as_ref() == Some(&record) && !self.state.deleting.contains_key(&name);
        if !unchanged {
            self.commit_jail(&name, Some(record), None)?;
            let what = match (&previous, changed) {
                (None, _) => Some("Created"),
                (Some(_), true) => Some("Updated"),
                (Some(_), false) => None,
            };
            if let Some(reason) = what {
                self.events.normal(
                    ObjectKind::Jail,
                    &name,
                    reason,
                    format!("recorded with address {address}"),
                );
            }
        }
        if changed {
            // A new spec is a new workload: it does not inherit the old
            // one's crash-loop delay.
            self.backoff.forget(&name);
            self.runtime.remove(&name);
        }

        let result = observed
            .and_then(|obs| self.ensure_bridge(&obs).map(|()| obs))
            .and_then(|obs| self.converge(&name, &obs, true));
        let base = spec_base(&self.state, &name);
        let base_missing = |e: &HostError| {
            matches!(e, HostError::Zfs(ZfsError::NotFound(missing))
                if *missing == self.zfs.layout().base_snapshot(&base))
        };
        if let Err(error) = result {
            if previous.is_none() && base_missing(&error) {
                return Err(self.refuse_missing_base(name, base, error));
            }
            self.note_failure(&name, &error);
            return Err(ReconcileError::Host { jail: name, error });
        }
        self.settle_after_start(&name);
        if let Err(e) = self.save_bookkeeping(Some(&name)) {
            return Err(ReconcileError::Host {
                jail: name,
                error: HostError::Store(e.to_string()),
            });
        }
        Ok(self.status_of(&name))
    }

    /// Deletes a jail: persists the intent, then runs the delete order. A
    /// delete that cannot finish (busy mount) stays recorded and is retried by
    /// every pass.
    pub fn delete(&mut self, name: &str) -> Result<(), ReconcileError> {
        let spec = match (self.state.jails.get(name), self.state.deleting.get(name)) {
            (Some(rec), _) => {
                // The pending delete keeps the address reserved: until the
                // teardown finished, the old jail may still hold it.
                let mut spec = rec.spec.clone();
                spec.spec.network.address = Some(rec.address);
                spec
            }
            (None, Some(spec)) => spec.clone(),
            (None, None) => return Err(ReconcileError::NotFound(name.to_string())),
        };
        self.commit_jail(name, None, Some(spec))?;
        self.events.normal(
            ObjectKind::Jail,
            name,
            "Deleting",
            "delete recorded; the jail is being removed".into(),
        );
        let crashed = self
            .runtime
            .get(name)
            .and_then(|r| r.phase)
            .is_some_and(Phase::crashed);
        self.finish_delete(name, crashed).map_err(|error| {
            self.note_failure(name, &error);
            ReconcileError::Host {
                jail: name.to_string(),
                error,
            }
        })
    }

    /// One pass over every jail; see the module docs.
    pub fn reconcile(&mut self) -> PassReport {
        let mut report = PassReport::default();
        let obs = match self.observe() {
            Ok(obs) => obs,
            Err(e) => {
                report.failures.push(JailFailure {
                    jail: "(host)".into(),
                    error: format!("could not observe the host: {e}"),
                });
                return report;
            }
        };
        if let Err(e) = self.ensure_bridge(&obs) {
            report.failures.push(JailFailure {
                jail: "(host)".into(),
                error: e.to_string(),
            });
        }

        let pending: Vec<String> = self.state.deleting.keys().cloned().collect();
        for name in pending {
            let gone = obs.jails.get(&name).is_some_and(|j| !j.running);
            if let Err(e) = self.finish_delete(&name, gone) {
                self.note_failure(&name, &e);
                report.failures.push(JailFailure {
                    jail: name,
                    error: e.to_string(),
                });
            }
        }

        let names: Vec<String> = self.state.jails.keys().cloned().collect();
        for name in names {
            let restarts_before = self.state.jails.get(&name).map(|r| r.restarts);
            if let Err(e) = self.converge(&name, &obs, false) {
                self.note_failure(&name, &e);
                report.failures.push(JailFailure {
                    jail: name.clone(),
                    error: e.to_string(),
                });
            }
            if self.state.jails.get(&name).map(|r| r.restarts) != restarts_before {
                report.restarted.push(name);
            }
        }

        // Jails under Keel's root that nobody wants (their record was lost, or
        // a delete was acknowledged before a crash without being recorded) go
        // through the normal delete order.
        let orphans: Vec<(String, bool)> = obs
            .jails
            .values()
            .filter(|j| self.is_keel_jail(j))
            .filter(|j| {
                !self.state.jails.contains_key(&j.name)
                    && !self.state.deleting.contains_key(&j.name)
            })
            .map(|j| (j.name.clone(), !j.running))
            .collect();
        for (name, gone) in orphans {
            if let Err(e) = self.teardown(&name, &[], gone) {
                report.failures.push(JailFailure {
                    jail: name,
                    error: e.to_string(),
                });
            }
        }

        if let Err(e) = self.save_bookkeeping(None) {
            report.failures.push(JailFailure {
                jail: "(state)".into(),
                error: e.to_string(),
            });
        }
        report
    }

    /// Status of every desired jail (no host commands: the last pass's view).
    pub fn list(&self) -> Vec<JailStatus> {
        let mut out: Vec<JailStatus> = self.state.jails.keys().map(|n| self.status_of(n)).collect();
        for (name, spec) in &self.state.deleting {
            out.push(JailStatus {
                name: name.clone(),
                state: Phase::Deleting,
                address: spec.spec.network.address.unwrap_or(Ipv4Addr::UNSPECIFIED),
                restarts: 0,
                ready: false,
                created_unix: 0,
                last_error: self.runtime.get(name).and_then(|r| r.last_error.clone()),
                retry_in_secs: None,
                epoch: None,
                cpu: spec.spec.resources.cpu,
                memory: spec.spec.resources.memory,
                last_exit: self.runtime.get(name).and_then(|r| r.last_exit),
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Status of one jail, or `None` when it is neither desired nor deleting.
    pub fn get(&self, name: &str) -> Option<JailStatus> {
        self.list().into_iter().find(|s| s.name == name)
    }

    /// The spec desired jail `name` was last applied with.
    pub fn applied(&self, name: &str) -> Option<&Jail> {
        self.state.jails.get(name).map(|rec| &rec.spec)
    }

    /// The end (at most `max_bytes`) of what desired jail `name`'s workload
    /// printed; `None` for a jail nobody applied.
    pub fn workload_log(&self, name: &str, max_bytes: u64) -> Option<Result<Vec<u8>, JailError>> {
        self.state.jails.get(name)?;
        Some(
            self.jails
                .workload_log(name, &self.rootfs_path(name), max_bytes),
        )
    }

    /// The record of one desired jail.
    pub fn record(&self, name: &str) -> Option<&JailRecord> {
        self.state.jails.get(name)
    }

    /// Persists jail `name`'s record as `desired` or `deleting` (neither:
    /// the record is removed) with its current backoff, then makes it the
    /// state. Only that jail's file is written. If the write fails the
    /// in-memory state stays as it was, so nothing unacknowledged is ever
    /// half-applied.
    fn commit_jail(
        &mut self,
        name: &str,
        desired: Option<JailRecord>,
        deleting: Option<Jail>,
    ) -> Result<(), ReconcileError> {
        let file = JailFile {
            desired,
            deleting,
            backoff: self.backoff.snapshot_of(&name.to_string()),
        };
        self.store.save_jail(name, &file)?;
        self.record_saved(name, file);
        Ok(())
    }

    /// Makes `file`, just written, jail `name`'s state.
    fn record_saved(&mut self, name: &str, file: JailFile) {
        match file.desired {
            Some(rec) => self.state.jails.insert(name.to_string(), rec),
            None => self.state.jails.remove(name),
        };
        match file.deleting {
            Some(jail) => self.state.deleting.insert(name.to_string(), jail),
            None => self.state.deleting.remove(name),
        };
        // Entries are in key order: one jail's is found, replaced, added or
        // dropped without rebuilding the others.
        let entries = &mut self.state.backoff.entries;
        match (
            entries.binary_search_by(|e| e.key.as_str().cmp(name)),
            file.backoff,
        ) {
            (Ok(i), Some(entry)) => entries[i] = entry,
            (Ok(i), None) => {
                entries.remove(i);
            }
            (Err(i), Some(entry)) => entries.insert(i, entry),
            (Err(_), None) => {}
        }
        self.dirty.remove(name);
    }

    /// Jail `name`'s backoff entry as its record on disk holds it.
    fn saved_backoff(&self, name: &str) -> Option<&SnapshotEntry<String>> {
        let entries = &self.state.backoff.entries;
        entries
            .binary_search_by(|e| e.key.as_str().cmp(name))
            .ok()
            .map(|i| &entries[i])
    }

    /// Persists the node-wide record `node` and makes it the state.
    fn commit_node(&mut self, node: NodeRecord) -> Result<(), ReconcileError> {
        self.store.save_node(&node)?;
        self.state.node_subnet = node.node_subnet;
        self.state.cluster_routes = node.cluster_routes;
        self.state.service_vips = node.service_vips;
        Ok(())
    }

    fn node_record(&self) -> NodeRecord {
        NodeRecord {
            node_subnet: self.state.node_subnet,
            cluster_routes: self.state.cluster_routes.clone(),
            service_vips: self.state.service_vips.clone(),
        }
    }

    /// Writes the record of every jail (or only of `only`) whose bookkeeping
    /// (restart count, [`Deployed`], backoff) changed; a steady pass writes
    /// nothing. A failed write stays pending, the next pass tries again, and
    /// the other jails are still written; the first failure is returned.
    fn save_bookkeeping(&mut self, only: Option<&str>) -> Result<(), StoreError> {
        let names: Vec<String> = match only {
            Some(name) => vec![name.to_string()],
            None => self
                .state
                .jails
                .keys()
                .chain(self.state.deleting.keys())
                .cloned()
                .collect(),
        };
        let mut first_error = None;
        for name in names {
            let backoff = self.backoff.snapshot_of(&name);
            if !self.dirty.contains(&name) && backoff.as_ref() == self.saved_backoff(&name) {
                continue;
            }
            let file = JailFile {
                desired: self.state.jails.get(&name).cloned(),
                deleting: self.state.deleting.get(&name).cloned(),
                backoff,
            };
            match self.store.save_jail(&name, &file) {
                Ok(()) => self.record_saved(&name, file),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Refuses (409, with the numbers) a declared quota below what an
    /// existing volume already uses: zfs would refuse it too, on every pass.
    fn check_quotas(&self, spec: &JailSpec, obs: &Observation) -> Result<(), ReconcileError> {
        let layout = self.zfs.layout();
        for (i, v) in spec.volumes.iter().enumerate() {
            let Some(quota) = v.size else { continue };
            let dataset = layout.volume_dataset(&v.name);
            if let Some(d) = obs.datasets.get(&dataset)
                && d.used > quota
                && d.quota != Some(quota)
            {
                return Err(ReconcileError::Conflict {
                    field: format!("spec.volumes[{i}].size"),
                    message: format!(
                        "volume {} already uses {} bytes; its quota cannot shrink to {quota} bytes (free space in it first, or ask for at least {} bytes)",
                        v.name, d.used, d.used
                    ),
                });
            }
        }
        Ok(())
    }

    fn choose_address(&self, name: &str, jail: &Jail) -> Result<Ipv4Addr, ReconcileError> {
        // Every address held by another jail, or reserved by a pending
        // delete. An apply runs this: a given or kept address is checked by
        // walking the records, and only a new jail's first free address needs
        // them all, as a sorted list of numbers rather than a map.
        let deleting = self
            .state
            .deleting
            .iter()
            .filter_map(|(n, j)| j.spec.network.address.map(|a| (a, n.as_str())));
        let used = || {
            self.state
                .jails
                .iter()
                .map(|(n, r)| (r.address, n.as_str()))
                .chain(deleting.clone())
                .filter(|(_, n)| *n != name)
        };
        if let Some(addr) = jail.spec.network.address {
            if !self.node.is_host_address(addr) {
                return Err(ReconcileError::Invalid {
                    field: "spec.network.address".into(),
                    message: format!(
                        "{addr} is not a usable address of this node's subnet {} (the network address, {} (the gateway) and the broadcast address are reserved)",
                        self.node.subnet,
                        self.node.gateway()
                    ),
                });
            }
            if let Some((_, other)) = used().find(|(a, _)| *a == addr) {
                return Err(ReconcileError::Conflict {
                    field: "spec.network.address".into(),
                    message: format!("{addr} is already used by jail {other}"),
                });
            }
            return Ok(addr);
        }
        // Auto-addressing keeps what the jail already has, so an address
        // survives re-applies and agent restarts.
        if let Some(rec) = self.state.jails.get(name)
            && self.node.is_host_address(rec.address)
        {
            return Ok(rec.address);
        }
        let mut taken: Vec<u32> = used().map(|(a, _)| u32::from(a)).collect();
        taken.sort_unstable();
        let first = u32::from(self.node.subnet.network());
        let host_bits = 32 - u32::from(self.node.subnet.prefix_len());
        let count = if host_bits >= 32 {
            u32::MAX
        } else {
            1u32 << host_bits
        };
        let mut taken = taken.into_iter().peekable();
        (2..count)
            .map(|i| first + i)
            .find(|ip| {
                while taken.next_if(|t| t < ip).is_some() {}
                taken.peek() != Some(ip) && self.node.is_host_address(Ipv4Addr::from(*ip))
            })
            .map(Ipv4Addr::from)
            .ok_or(ReconcileError::AddressesExhausted(self.node.subnet))
    }

    fn observe(&self) -> Result<Observation, HostError> {
        let jails = self
            .jails
            .list()?
            .into_iter()
            .map(|j| (j.name.clone(), j))
            .collect();
        let datasets = self
            .zfs
            .list()?
            .into_iter()
            .map(|d| (d.name.clone(), d))
            .collect();
        let mounted = self.mounts.list()?.into_iter().map(|m| m.target).collect();
        let interfaces = self.net.list_interfaces()?.into_iter().collect();
        Ok(Observation {
            jails,
            datasets,
            mounted,
            interfaces,
        })
    }

    /// What converging jail `name` to `spec` reads of the host, and nothing
    /// else: the jail itself (jls -j, ps -J), its rootfs and `spec`'s volume
    /// datasets by name (one zfs list), the nullfs mounts under its root and,
    /// of the interfaces, the bridge and its epair's two ends. `converge`
    /// looks nothing else up in an [`Observation`], so it decides as it
    /// would from the whole host's, and the cost does not follow the number
    /// of jails: mount -p and ifconfig -l still print every line, but only
    /// this jail's are kept (see [`MountManager::list_under`],
    /// [`NetManager::find_interfaces`]).
    fn observe_jail(&self, name: &str, spec: &JailSpec) -> Result<Observation, HostError> {
        let layout = self.zfs.layout();
        let jails = self
            .jails
            .get(name)?
            .into_iter()
            .map(|j| (j.name.clone(), j))
            .collect();
        let mut names = vec![layout.rootfs_dataset(name)];
        names.extend(spec.volumes.iter().map(|v| layout.volume_dataset(&v.name)));
        names.sort_unstable();
        names.dedup();
        let datasets = self
            .zfs
            .list_named(&names)?
            .into_iter()
            .map(|d| (d.name.clone(), d))
            .collect();
        let mounted = self
            .mounts
            .list_under(&layout.rootfs_path(name))?
            .into_iter()
            .map(|m| m.target)
            .collect();
        let (host_if, jail_if) = iface_names(name);
        let interfaces = self
            .net
            .find_interfaces(&[&self.node.bridge, &host_if, &jail_if])?
            .into_iter()
            .collect();
        Ok(Observation {
            jails,
            datasets,
            mounted,
            interfaces,
        })
    }

    /// Creates the bridge with the gateway address when `obs` did not see it
    /// (first start, or a host reboot): every epair is attached to it.
    fn ensure_bridge(&self, obs: &Observation) -> Result<(), HostError> {
        if obs.interfaces.contains(&self.node.bridge) {
            return Ok(());
        }
        let gw = Ipv4Net::new(self.node.gateway(), self.node.subnet.prefix_len()).map_err(|e| {
            HostError::Net(NetError::Parse {
                command: "bridge address".into(),
                reason: e.to_string(),
            })
        })?;
        self.net.ensure_bridge(&self.node.bridge, gw)?;
        Ok(())
    }

    fn is_keel_jail(&self, j: &ObservedJail) -> bool {
        j.path == self.zfs.layout().rootfs_path(&j.name)
    }

    /// Brings one desired jail to Running from what `obs` saw; see module docs.
    /// `force` (an apply) skips the wait of the jail's backoff.
    fn converge(&mut self, name: &str, obs: &Observation, force: bool) -> Result<(), HostError> {
        let Some(rec) = self.state.jails.get(name).cloned() else {
            return Ok(());
        };
        let now = self.clock.now();
        let key = name.to_string();
        let phase = self.runtime.get(name).and_then(|r| r.phase);
        let waiting = phase.is_some_and(|p| p == Phase::Failed || p.crashed());
        if !force && waiting && !self.backoff.ready(&key, now) {
            // The last attempt failed, or the workload crashed or was
            // restarted for failing its health check: the next start waits
            // for its delay.
            return Ok(());
        }

        let (host_if, jail_if) = iface_names(name);
        let host_side = obs.interfaces.contains(&host_if);
        // A jail that does not exist holds no interface: both ends of a
        // usable epair are on the host, or it is made again.
        let mut epair_ready = host_side && obs.interfaces.contains(&jail_if);
        let mut stop_failure = None;
        let removes = obs.jails.contains_key(name);
        if let Some(j) = obs.jails.get(name) {
            let current = rec.deployed.as_ref().is_none_or(|d| {
                identity(name, &d.spec, d.address) == identity(name, &rec.spec.spec, rec.address)
            });
            if !current {
                // Built from an older spec (exec, env, hostname, address,
                // volumes or base changed): replace it. Its rootfs and volume
                // datasets stay; provision decides what else must change.
                stop_failure = self.remove_jail(name, !j.running)?;
                epair_ready = self.epair_on_host(name)?;
            } else if j.running && host_side {
                return self.keep_running(name, &rec, obs, now);
            } else {
                // The jail exists but its workload is gone (or its epair
                // vanished): a crash. Count it once, then restart when the
                // backoff allows.
                let counted = self.runtime.get(name).is_some_and(|r| r.crash_counted);
                if !counted {
                    self.note_exit(name, j.running, j.exit_status, now, !force);
                }
                if !force && !self.backoff.ready(&key, now) {
                    return Ok(());
                }
                stop_failure = self.remove_jail(name, !j.running)?;
                if let Some(r) = self.state.jails.get_mut(name) {
                    r.restarts += 1;
                    self.dirty.insert(name.to_string());
                    let restarts = r.restarts;
                    self.events.normal(
                        ObjectKind::Jail,
                        name,
                        "Restarted",
                        format!("restarting the workload (restart {restarts})"),
                    );
                }
                epair_ready = self.epair_on_host(name)?;
            }
        }
        if removes {
            // The jail will run again, but the operator should hear that its
            // last removal skipped exec.stop (and that the next one did not).
            if let Some(stop) = &stop_failure {
                log::warn!("jail {name}: {stop}");
            }
            self.runtime.entry(key).or_default().forced_removal =
                stop_failure.map(|e| e.to_string());
        }
        self.provision(name, &rec, obs, epair_ready)
    }

    /// Removes jail `name` so nothing can keep it: a workload that may still
    /// run gets its exec.stop (`jail -f CONF -r`); one that is gone, or whose
    /// exec.stop failed (jail(8) then keeps the jail), is forced out without
    /// running anything in it. Returns that exec.stop failure, for the
    /// jail's last error.
    fn remove_jail(&self, name: &str, workload_gone: bool) -> Result<Option<JailError>, HostError> {
        let root = self.zfs.layout().rootfs_path(name);
        if !workload_gone {
            match self.jails.remove(name, &root, Removal::Stop) {
                Ok(()) => return Ok(None),
                Err(stop @ JailError::StopFailed { .. }) => {
                    self.force_remove(name, &root)?;
                    return Ok(Some(stop));
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.force_remove(name, &root)?;
        Ok(None)
    }

    /// `jail -R` after taking the epair's jail side back: once removed, a
    /// jail can linger as dying, unnamed, with its vnet and the interface in
    /// it; the next start of the jail could not have it.
    fn force_remove(&self, name: &str, root: &Path) -> Result<(), HostError> {
        self.net.reclaim(name)?;
        self.jails.remove(name, root, Removal::Force)?;
        Ok(())
    }

    /// True when both ends of `name`'s epair are on the host after its jail
    /// was removed (one `ifconfig -l`, only on the restart path). A jail side
    /// still held by a dying jail's vnet is not, and the epair is made anew.
    fn epair_on_host(&self, name: &str) -> Result<bool, HostError> {
        let (host_if, jail_if) = iface_names(name);
        Ok(self.net.find_interfaces(&[&host_if, &jail_if])?.len() == 2)
    }

    /// A jail that runs its current spec: apply limits that changed (or were
    /// never confirmed), and keep the backoff's uptime clock.
    fn keep_running(
        &mut self,
        name: &str,
        rec: &JailRecord,
        obs: &Observation,
        now: Instant,
    ) -> Result<(), HostError> {
        self.sync_quotas(&rec.spec.spec, obs)?;
        let resources = &rec.spec.spec.resources;
        let limits_current = rec
            .deployed
            .as_ref()
            .and_then(|d| d.limits.as_ref())
            .is_some_and(|l| l == resources);
        if !limits_current {
            let applied = rec.deployed.as_ref().and_then(|d| d.limits.as_ref());
            if rctl_needed(applied, resources) {
                self.jails.set_limits(name, &limits_of(&rec.spec))?;
            }
            self.set_deployed(name, rec, Some(resources.clone()));
        }
        let key = name.to_string();
        // Starting is the same workload, now seen running past its start.
        let first_sight = !self
            .runtime
            .get(name)
            .and_then(|r| r.phase)
            .is_some_and(Phase::runs);
        if first_sight {
            self.new_incarnation(name);
        }
        let rt = self.runtime.entry(key.clone()).or_default();
        let settled = rt
            .started_at
            .is_none_or(|t| now.saturating_duration_since(t) >= START_SETTLE);
        let was_starting = rt.phase == Some(Phase::Starting);
        rt.phase = Some(if was_starting && !settled {
            Phase::Starting
        } else {
            Phase::Running
        });
        rt.last_error = None;
        rt.crash_counted = false;
        if was_starting && settled {
            // The state change a watch (`keelctl get jails -w`) shows:
            // every change of a jail's state is an event.
            self.events.normal(
                ObjectKind::Jail,
                name,
                "Running",
                format!(
                    "the workload still runs {} s after its start",
                    START_SETTLE.as_secs()
                ),
            );
        }
        if first_sight {
            // First sight of it running (e.g. after an agent restart): its
            // stable-uptime clock starts now.
            self.backoff.record_started(&key, now);
        }
        self.backoff.record_stable_check(&key, now);
        Ok(())
    }

    /// The provision order for a jail that is not on the host (any more):
    /// rootfs, volume datasets, volume mounts, epair, limits, jail. Steps whose
    /// result `obs` already saw are skipped, so an interrupted provision
    /// simply runs again.
    fn provision(
        &mut self,
        name: &str,
        rec: &JailRecord,
        obs: &Observation,
        epair_ready: bool,
    ) -> Result<(), HostError> {
        let layout = self.zfs.layout().clone();
        let root = layout.rootfs_path(name);
        let spec = &rec.spec.spec;
        let wanted: Vec<PathBuf> = spec
            .volumes
            .iter()
            .map(|v| under_root(&root, &v.mount_path))
            .collect();
        // Paths order component-wise, so everything under `root` follows it.
        let mut mounted: Vec<PathBuf> = obs
            .mounted
            .range(root.clone()..)
            .take_while(|t| t.starts_with(&root))
            .cloned()
            .collect();
        let rootfs_present = obs.datasets.contains_key(&layout.rootfs_dataset(name));
        let rebase = rootfs_present
            && rec
                .deployed
                .as_ref()
                .is_some_and(|d| d.spec.base != spec.base);

        // Before the root changes: a new base means a fresh clone, and zfs
        // destroy must not meet a mounted volume; a volume the new spec
        // dropped or moved must not stay mounted in the rebuilt jail.
        let old: Vec<PathBuf> = rec
            .deployed
            .as_ref()
            .map(|d| {
                d.spec
                    .volumes
                    .iter()
                    .map(|v| under_root(&root, &v.mount_path))
                    .collect()
            })
            .unwrap_or_default();
        let leaving: Vec<PathBuf> = if rebase {
            mounted.clone()
        } else {
            mounted
                .iter()
                .filter(|t| old.contains(t) && !wanted.contains(t))
                .cloned()
                .collect()
        };
        self.unmount_in_order(&leaving, &old)?;
        mounted.retain(|t| !leaving.contains(t));
        if rebase {
            self.zfs.destroy_rootfs(name)?;
        }
        if rebase || !rootfs_present {
            self.zfs.clone_rootfs(&spec.base, name)?;
            if let Some(d) = self
                .state
                .jails
                .get_mut(name)
                .and_then(|r| r.deployed.as_mut())
            {
                d.spec.base = spec.base.clone();
                self.dirty.insert(name.to_string());
            }
        }
        for v in &spec.volumes {
            if !obs.datasets.contains_key(&layout.volume_dataset(&v.name)) {
                self.zfs.create_volume(&v.name, v.size)?;
            }
        }
        self.sync_quotas(spec, obs)?;
        for (v, target) in spec.volumes.iter().zip(&wanted) {
            if !mounted.contains(target) {
                self.mounts
                    .mount_nullfs(&layout.volume_path(&v.name), &root, target)?;
                mounted.push(target.clone());
            }
        }

        if !epair_ready {
            // Replaces whatever is left of an old one (attach destroys it).
            self.net.attach(&self.node.bridge, name)?;
        }
        if let Some(seed) = self.seeds.get(name) {
            seed(&root, rec.address).map_err(HostError::Seed)?;
        }
        // Limits before the jail: rules added for a name apply to the jail
        // created under it from its first process on, so exec.start never
        // runs unlimited, and a refused rule fails the provision before
        // anything started. The record says so before `jail -c` runs: if the
        // start then fails, the rules stay in the kernel and the next attempt
        // knows it must replace them even if the spec dropped its limits.
        let applied = match &rec.deployed {
            None => Some(&NO_LIMITS),
            Some(d) => d.limits.as_ref(),
        };
        if rctl_needed(applied, &spec.resources) {
            self.jails.set_limits(name, &limits_of(&rec.spec))?;
        }
        self.set_deployed(name, rec, Some(spec.resources.clone()));
        let params = self.jail_params(name, rec, &root);
        self.jails.create(&params)?;
        self.events.normal(
            ObjectKind::Jail,
            name,
            "Started",
            format!("started {}", params.exec_start.join(" ")),
        );

        let key = name.to_string();
        let started = self.clock.now();
        self.backoff.record_started(&key, started);
        self.new_incarnation(name);
        let rt = self.runtime.entry(key).or_default();
        rt.started_at = Some(started);
        // Running once a later observation still sees it (`keep_running`):
        // a workload that exits at once is never shown Running.
        rt.phase = Some(Phase::Starting);
        rt.last_error = None;
        rt.crash_counted = false;
        Ok(())
    }

    /// Sets the quota of every declared volume whose dataset `obs` saw with
    /// another one (`zfs set quota`, in place: the data stays). A volume
    /// created in this pass got its quota from `zfs create`. In a steady
    /// pass every quota matches and nothing runs.
    fn sync_quotas(&self, spec: &JailSpec, obs: &Observation) -> Result<(), HostError> {
        let layout = self.zfs.layout();
        for v in &spec.volumes {
            let seen = obs.datasets.get(&layout.volume_dataset(&v.name));
            if seen.is_some_and(|d| d.quota != v.size) {
                self.zfs.set_volume_quota(&v.name, v.size)?;
            }
        }
        Ok(())
    }

    /// Records that the jail on the host now runs `rec` with `limits` applied.
    fn set_deployed(&mut self, name: &str, rec: &JailRecord, limits: Option<Resources>) {
        if let Some(r) = self.state.jails.get_mut(name) {
            r.deployed = Some(Deployed {
                spec: rec.spec.spec.clone(),
                address: rec.address,
                limits,
            });
            self.dirty.insert(name.to_string());
        }
    }

    fn jail_params(&self, name: &str, rec: &JailRecord, root: &Path) -> JailParams {
        let spec = &rec.spec.spec;
        let (_, jail_if) = iface_names(name);
        JailParams {
            name: name.to_string(),
            path: root.to_path_buf(),
            hostname: rec.spec.hostname().to_string(),
            network: Some(JailNetwork {
                interface: jail_if,
                address: rec.address,
                prefix_len: self.node.subnet.prefix_len(),
                gateway: self.node.gateway(),
            }),
            exec_start: spec.exec.start.clone(),
            exec_stop: spec.exec.stop.clone(),
            env: spec.env.clone(),
        }
    }

    /// `workload_gone`: the reconciler knows the jail's workload exited, so
    /// no exec.stop runs.
    fn finish_delete(&mut self, name: &str, workload_gone: bool) -> Result<(), HostError> {
        let volumes: Vec<PathBuf> = self
            .state
            .deleting
            .get(name)
            .map(|s| {
                s.spec
                    .volumes
                    .iter()
                    .map(|v| v.mount_path.clone())
                    .collect()
            })
            .unwrap_or_default();
        self.teardown(name, &volumes, workload_gone)?;
        self.backoff.forget(&name.to_string());
        self.commit_jail(name, None, None)
            .map_err(|e| HostError::Store(e.to_string()))?;
        self.runtime.remove(name);
        self.events.normal(
            ObjectKind::Jail,
            name,
            "Deleted",
            "the jail and its root filesystem are gone".into(),
        );
        Ok(())
    }

    /// The delete order. `volumes` are the declared mount paths (they set the
    /// order); every nullfs mount found under the jail root is unmounted.
    fn teardown(
        &mut self,
        name: &str,
        volumes: &[PathBuf],
        workload_gone: bool,
    ) -> Result<(), HostError> {
        let root = self.zfs.layout().rootfs_path(name);
        if let Some(stop) = self.remove_jail(name, workload_gone)? {
            // The jail's record goes with the delete: the log keeps the word.
            log::warn!("deleting jail {name}: {stop}");
        }
        // A jail whose spec had no limits never got a rule (see `provision`);
        // a jail without a record might have, so it is cleared.
        let may_hold_rules = self
            .state
            .deleting
            .get(name)
            .is_none_or(|j| !j.spec.resources.is_empty());
        if may_hold_rules {
            self.jails.clear_limits(name)?;
        }
        self.net.detach(name)?;
        let mounted: Vec<PathBuf> = self
            .mounts
            .list_under(&root)?
            .into_iter()
            .map(|m| m.target)
            .collect();
        let declared: Vec<PathBuf> = volumes.iter().map(|m| under_root(&root, m)).collect();
        self.unmount_in_order(&mounted, &declared)?;
        self.zfs.destroy_rootfs(name)?;
        Ok(())
    }

    /// Unmounts `targets` (one call per mount, so stacked mounts all go)
    /// deepest first, and among equally deep ones in reverse `declared`
    /// order. Stops at the first that stays mounted.
    fn unmount_in_order(&self, targets: &[PathBuf], declared: &[PathBuf]) -> Result<(), HostError> {
        let mut ordered: Vec<&PathBuf> = targets.iter().collect();
        let rank = |t: &PathBuf| declared.iter().position(|d| d == t);
        ordered.sort_by_key(|t| {
            (
                std::cmp::Reverse(t.components().count()),
                std::cmp::Reverse(rank(t)),
            )
        });
        for target in ordered {
            if let Err(reason) = self.mounts.unmount(target) {
                return Err(HostError::UnmountBlocked {
                    target: target.clone(),
                    reason,
                });
            }
        }
        Ok(())
    }

    /// A new start of `name`'s workload: not ready until its probe passes.
    fn new_incarnation(&mut self, name: &str) {
        self.incarnations += 1;
        let rt = self.runtime.entry(name.to_string()).or_default();
        rt.incarnation = self.incarnations;
        rt.probe_passed = false;
    }

    fn note_failure(&mut self, name: &str, error: &HostError) {
        let now = self.clock.now();
        let key = name.to_string();
        let deleting = self.state.deleting.contains_key(name);
        let rt = self.runtime.entry(key.clone()).or_default();
        rt.last_error = Some(error.to_string());
        rt.phase = Some(if deleting {
            Phase::Deleting
        } else {
            Phase::Failed
        });
        if !deleting {
            self.backoff.record_failure(&key, now);
        }
        self.events
            .warning(ObjectKind::Jail, name, "Failed", error.to_string());
    }

    fn status_of(&self, name: &str) -> JailStatus {
        let rec = &self.state.jails[name];
        let rt = self.runtime.get(name).cloned().unwrap_or_default();
        let now = self.clock.now();
        let retry_in_secs = match rt.phase {
            Some(p) if p == Phase::Failed || p.crashed() => self
                .backoff
                .next_attempt(&name.to_string())
                .map(|at: Instant| at.saturating_duration_since(now).as_secs()),
            _ => None,
        };
        JailStatus {
            name: name.to_string(),
            state: rt.phase.unwrap_or(Phase::Pending),
            address: rec.address,
            restarts: rec.restarts,
            ready: rt.phase.is_some_and(Phase::runs)
                && (rec.spec.spec.health.is_none() || rt.probe_passed),
            created_unix: rec.created_unix,
            last_error: rt
                .last_error
                .or(rt.forced_removal)
                .or(rt.health_failure)
                .or(rt.health_restart),
            retry_in_secs,
            epoch: rec.epoch,
            cpu: rec.spec.spec.resources.cpu,
            memory: rec.spec.spec.resources.memory,
            last_exit: rt.last_exit,
        }
    }

    /// The workload of `name` is gone (it has no process, or, `running`, its
    /// epair vanished): counted once against the backoff, Restarting after
    /// a first crash and CrashLoop after repeated ones, its exit status kept
    /// as LAST EXIT and the last error, and told as events. `waits`: the
    /// restart will wait for the backoff (a pass, not an apply).
    fn note_exit(
        &mut self,
        name: &str,
        running: bool,
        exit_status: Option<i32>,
        now: Instant,
        waits: bool,
    ) {
        let key = name.to_string();
        let delay = self.backoff.record_failure(&key, now);
        let first = delay <= self.backoff.policy().initial;
        let how = match (running, exit_status) {
            (true, _) => "its epair is gone".to_string(),
            (false, Some(status)) => format!("the workload exited with status {status}"),
            (false, None) => "the workload exited (no process is left in the jail)".to_string(),
        };
        let rt = self.runtime.entry(key).or_default();
        rt.crash_counted = true;
        rt.phase = Some(if first {
            Phase::Restarting
        } else {
            Phase::CrashLoop
        });
        rt.last_error = Some(how.clone());
        if !running {
            rt.last_exit = Some(LastExit {
                status: exit_status,
                time_unix: unix_now(),
            });
        }
        self.events.warning(ObjectKind::Jail, name, "Exited", how);
        if waits {
            self.events.warning(
                ObjectKind::Jail,
                name,
                "BackOff",
                format!("back-off {}s before restarting it", delay.as_secs()),
            );
        }
    }

    /// A new jail whose base this node does not have: refused, and not
    /// kept (nothing of it was built, the clone being the first step),
    /// rather than recorded and failing every pass.
    fn refuse_missing_base(
        &mut self,
        name: String,
        base: String,
        error: HostError,
    ) -> ReconcileError {
        if let Err(e) = self.commit_jail(&name, None, None) {
            return e;
        }
        self.backoff.forget(&name);
        self.runtime.remove(&name);
        self.events.warning(
            ObjectKind::Jail,
            &name,
            "Refused",
            format!("base {base} is not on this node; the jail is not kept: {error}"),
        );
        ReconcileError::BaseMissing {
            jail: name,
            base,
            error: error.to_string(),
        }
    }

    /// Right after an apply started `name`'s workload: one more look at it
    /// where the runtime can take one without a host command
    /// ([`JailRuntime::exited_at_start`]), so that one which already exited
    /// is answered as such, not as Starting. Otherwise it stays Starting
    /// until the next pass sees it.
    fn settle_after_start(&mut self, name: &str) {
        if self.runtime.get(name).and_then(|r| r.phase) != Some(Phase::Starting) {
            return;
        }
        if let Some(status) = self.jails.exited_at_start(name) {
            let now = self.clock.now();
            self.note_exit(name, false, status, now, true);
        }
    }
}

/// The limits of a spec without any.
const NO_LIMITS: Resources = Resources {
    cpu: None,
    memory: None,
};

/// Whether taking a jail's rctl rules from `applied` (`None`: not known) to
/// `wanted` needs rctl(8) at all. A jail that had no limits and gets none
/// runs no rctl command: that keeps the common case free of rctl and lets a
/// jailed agent (nested mode), where every rctl call is refused, run jails
/// without limits.
fn rctl_needed(applied: Option<&Resources>, wanted: &Resources) -> bool {
    !wanted.is_empty() || applied.is_none_or(|r| !r.is_empty())
}

fn limits_of(jail: &Jail) -> Limits {
    Limits {
        cpu: jail.spec.resources.cpu,
        memory: jail.spec.resources.memory,
    }
}

/// What a running jail cannot change in place: everything but the rctl
/// limits and volume quotas, with the address and hostname as they take
/// effect (an omitted `network.address` and the same address written out are
/// one jail, and so are an omitted hostname and the jail's name).
fn identity(name: &str, spec: &JailSpec, address: Ipv4Addr) -> (JailSpec, Ipv4Addr) {
    let mut s = spec.clone();
    if s.hostname.as_deref() == Some(name) {
        s.hostname = None;
    }
    s.resources = Resources::default();
    // Probes are read by the health checker, never by the jail: a new one
    // applies to the running workload.
    s.health = None;
    s.network = Default::default();
    for v in &mut s.volumes {
        v.size = None;
    }
    (s, address)
}

/// `root` joined with an absolute mount path (validated: normalised, no `..`).
fn under_root(root: &Path, mount_path: &Path) -> PathBuf {
    root.join(mount_path.strip_prefix("/").unwrap_or(mount_path))
}

/// The `spec.base` of desired jail `name` in `state` (empty when unknown).
fn spec_base(state: &AgentState, name: &str) -> String {
    state
        .jails
        .get(name)
        .map(|r| r.spec.spec.base.clone())
        .unwrap_or_default()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Cluster membership support (`agentd::cluster`): the node subnet the control
/// plane assigns and the peer routes Keel manages, both persisted with the
/// desired jails.
impl<J, Z, N, M> Reconciler<J, Z, N, M>
where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    /// The host networking seam, for the peer-route reconciliation that runs
    /// on the worker thread next to the reconciler.
    pub fn net(&self) -> &N {
        &self.net
    }

    /// Where jail `name`'s root filesystem is mounted (whether or not it
    /// exists yet).
    pub fn rootfs_path(&self, name: &str) -> PathBuf {
        self.zfs.layout().rootfs_path(name)
    }

    /// Runs `argv` inside jail `name` (jexec); the caller reads the status.
    pub fn exec_in(&self, name: &str, argv: &[String]) -> Result<CmdOutput, JailError> {
        self.jails.exec(name, argv)
    }

    /// The ZFS and mount seams, for the volume routes (`agentd::volumes`),
    /// which run on the worker thread and never read the jail records.
    pub fn volume_seams(&self) -> (&Z, &M) {
        (&self.zfs, &self.mounts)
    }

    /// Adopts the subnet the control plane assigned: moves the node to it
    /// (refused while a jail has an address outside it) and persists it, so a
    /// restarted node keeps it. Nothing changes when it fails.
    pub fn adopt_node_subnet(&mut self, subnet: Ipv4Net) -> Result<(), ReconcileError> {
        let subnet = subnet.trunc();
        let previous = self.node.clone();
        if self.node.subnet != subnet {
            self.set_node_subnet(subnet)?;
        }
        if self.state.node_subnet != Some(subnet) {
            let next = NodeRecord {
                node_subnet: Some(subnet),
                ..self.node_record()
            };
            if let Err(e) = self.commit_node(next) {
                self.node = previous;
                return Err(e);
            }
        }
        Ok(())
    }

    /// Gives the bridge the node subnet's first address, creating the bridge
    /// if needed; idempotent (every heartbeat calls it, so an address removed
    /// by hand comes back).
    pub fn ensure_gateway(&self) -> Result<(), NetError> {
        let gateway =
            Ipv4Net::new(self.node.gateway(), self.node.subnet.prefix_len()).map_err(|e| {
                NetError::Parse {
                    command: "bridge address".into(),
                    reason: e.to_string(),
                }
            })?;
        self.net.ensure_bridge(&self.node.bridge, gateway)
    }

    /// Persists the set of peer routes Keel manages now.
    pub fn record_cluster_routes(
        &mut self,
        routes: BTreeSet<Ipv4Net>,
    ) -> Result<(), ReconcileError> {
        if self.state.cluster_routes == routes {
            return Ok(());
        }
        let next = NodeRecord {
            cluster_routes: routes,
            ..self.node_record()
        };
        self.commit_node(next)
    }

    /// Persists the set of service VIPs Keel has aliased now.
    pub fn record_service_vips(&mut self, vips: BTreeSet<Ipv4Addr>) -> Result<(), ReconcileError> {
        if self.state.service_vips == vips {
            return Ok(());
        }
        let next = NodeRecord {
            service_vips: vips,
            ..self.node_record()
        };
        self.commit_node(next)
    }
}

/// Health checks (`agentd::health`): what the checker probes, and what its
/// verdicts change. The checker runs elsewhere; these run on the worker.
impl<J, Z, N, M> Reconciler<J, Z, N, M>
where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    /// The running jails whose spec has `health`, with their incarnations.
    pub fn health_targets(&self) -> Vec<HealthTarget> {
        self.state
            .jails
            .iter()
            .filter_map(|(name, rec)| {
                let rt = self.runtime.get(name)?;
                let health = rec.spec.spec.health.clone()?;
                rt.phase.is_some_and(Phase::runs).then(|| HealthTarget {
                    name: name.clone(),
                    incarnation: rt.incarnation,
                    address: rec.address,
                    health,
                })
            })
            .collect()
    }

    /// Records the checker's verdict about `name`'s workload `incarnation`;
    /// false (nothing changed) when that workload is no longer the one running.
    pub fn set_readiness(
        &mut self,
        name: &str,
        incarnation: u64,
        ready: bool,
        reason: Option<String>,
    ) -> bool {
        let Some(rt) = self.current_incarnation(name, incarnation) else {
            return false;
        };
        let was_ready = rt.probe_passed;
        rt.probe_passed = ready;
        if was_ready && !ready {
            let why = reason
                .clone()
                .unwrap_or_else(|| "its health check failed".into());
            self.events.warning(
                ObjectKind::Jail,
                name,
                "Unhealthy",
                format!("not ready: {why}"),
            );
        }
        let Some(rt) = self.runtime.get_mut(name) else {
            return true;
        };
        rt.health_failure = match (ready, reason) {
            (true, _) => None,
            (false, Some(why)) => Some(format!("not ready: {why}")),
            (false, None) => Some("not ready: its health check failed".into()),
        };
        true
    }

    /// Restarts `name`'s workload `incarnation` after it failed its health
    /// check twice its threshold: the jail is removed now (with its
    /// exec.stop) and started again by a later pass once the crash-loop
    /// backoff allows, like a crashed one; `reason` stays its last error.
    /// `Ok(false)` when that workload is no longer the one running.
    pub fn restart_unhealthy(
        &mut self,
        name: &str,
        incarnation: u64,
        reason: &str,
    ) -> Result<bool, ReconcileError> {
        if self.current_incarnation(name, incarnation).is_none() {
            return Ok(false);
        }
        let stop_failure = match self.remove_jail(name, false) {
            Ok(stop) => stop,
            Err(e) => {
                self.note_failure(name, &e);
                return Err(ReconcileError::Host {
                    jail: name.to_string(),
                    error: e,
                });
            }
        };
        if let Some(r) = self.state.jails.get_mut(name) {
            r.restarts += 1;
            self.dirty.insert(name.to_string());
        }
        self.events.warning(
            ObjectKind::Jail,
            name,
            "Unhealthy",
            format!("stopped for failing its health check, restarts with backoff: {reason}"),
        );
        let now = self.clock.now();
        let key = name.to_string();
        let delay = self.backoff.record_failure(&key, now);
        let first = delay <= self.backoff.policy().initial;
        let rt = self.runtime.entry(key).or_default();
        rt.phase = Some(if first {
            Phase::Restarting
        } else {
            Phase::CrashLoop
        });
        rt.probe_passed = false;
        rt.forced_removal = stop_failure.map(|e| e.to_string());
        rt.health_failure = None;
        rt.health_restart = Some(format!("restarted: its health check failed: {reason}"));
        self.save_bookkeeping(Some(name))?;
        Ok(true)
    }

    fn current_incarnation(&mut self, name: &str, incarnation: u64) -> Option<&mut Runtime> {
        self.runtime
            .get_mut(name)
            .filter(|rt| rt.incarnation == incarnation && rt.phase.is_some_and(Phase::runs))
    }
}
