//! The reconciler: makes the host match the desired jails and keeps it so.
//!
//! [`Reconciler`] is generic over the four host seams and never knows whether it
//! drives FreeBSD, the simulated host or in-memory Fakes. Its public API is the
//! seed's: [`Reconciler::new`], [`Reconciler::apply`], [`Reconciler::delete`] and
//! [`Reconciler::reconcile`].
//!
//! - `apply` and `delete` change the desired state, persist it with
//!   [`crate::common::store`] *before* anything is acknowledged, then converge
//!   that one jail so the caller's response reflects the host.
//! - `reconcile` (the 5 s timer) observes the whole host with one call per
//!   subsystem (jls + ps, zfs list, mount -p, ifconfig -l), then converges every
//!   jail from that snapshot: provisions what is missing, restarts crashed
//!   workloads through the per-jail [`Backoff`], finishes interrupted deletes and
//!   removes Keel jails nobody wants any more. A failure is recorded against its
//!   jail and the pass goes on: one broken jail never blocks the others.
//!
//! A steady-state pass runs only the observation commands: an agent restarted
//! while its jails run restarts nothing and recreates nothing.
//!
//! Provision order: rootfs clone, volume datasets, volume mounts (before the jail
//! starts, so the workload never sees an empty mount point), epair on the
//! bridge, jail creation (jail.conf sets the address and default route, then runs
//! exec.start), rctl limits. Delete order is the reverse: remove the jail (runs
//! exec.stop), clear limits, destroy the epair, unmount everything under the
//! jail root deepest first, destroy the rootfs. If an unmount fails the delete
//! stops before the rootfs is touched. Volume datasets are never destroyed here.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::common::backoff::{Backoff, Clock, Policy, Snapshot};
use crate::common::cidr::Ipv4Net;
use crate::common::spec::Jail;
use crate::common::store::{Store, StoreError};
pub use crate::common::wire::{JailStatus, Phase};
use crate::host::jail::{JailError, JailNetwork, JailParams, Limits, ObservedJail};
use crate::host::mount::MountError;
use crate::host::net::NetError;
use crate::host::zfs::ZfsError;
use crate::host::{JailRuntime, MountManager, NetManager, ZfsManager, iface_names};

/// File name of the agent's desired state inside its state directory.
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
    /// mount); the last spec tells which volumes to unmount.
    pub deleting: BTreeMap<String, Jail>,
    /// Crash-loop backoff per jail, so a restarted agent does not hammer a
    /// workload that was crash-looping before it went down.
    #[serde(default)]
    pub backoff: Snapshot<String>,
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
}

impl fmt::Display for ReconcileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReconcileError::Invalid { field, message } => write!(f, "{field}: {message}"),
            ReconcileError::Conflict { field, message } => write!(f, "{field}: {message}"),
            ReconcileError::NotFound(name) => write!(f, "no jail named {name} on this node"),
            ReconcileError::Store(e) => write!(f, "{e}"),
            ReconcileError::Host { jail, error } => write!(
                f,
                "jail {jail} is recorded but not converged yet (the agent keeps retrying): {error}"
            ),
            ReconcileError::AddressesExhausted(net) => write!(
                f,
                "no free address left in the node subnet {net}; delete a jail or use a larger subnet"
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
    datasets: BTreeSet<String>,
    /// Mount points, as a set: every volume of every jail is looked up once
    /// per pass, and a scan of the mount list per lookup made a pass
    /// quadratic in the number of jails (bench/reconcile.rs).
    mounted: BTreeSet<PathBuf>,
    interfaces: BTreeSet<String>,
}

impl Observation {
    fn is_mounted(&self, target: &Path) -> bool {
        self.mounted.contains(target)
    }
}

/// Per-jail memory of the last attempt (not persisted: rebuilt by the first pass).
#[derive(Debug, Clone, Default)]
struct Runtime {
    phase: Option<Phase>,
    last_error: Option<String>,
    /// A crash already counted against the backoff (so one crash is counted once).
    crash_counted: bool,
}

/// The reconciler; see the module docs.
pub struct Reconciler<J, Z, N, M> {
    jails: J,
    zfs: Z,
    net: N,
    mounts: M,
    node: NodeNetwork,
    store: Store<AgentState>,
    state: AgentState,
    backoff: Backoff<String>,
    clock: Box<dyn Clock>,
    runtime: BTreeMap<String, Runtime>,
}

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
        store: Store<AgentState>,
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
            backoff,
            clock,
            runtime: BTreeMap::new(),
        }
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
    pub fn apply(&mut self, jail: Jail, epoch: Option<u64>) -> Result<JailStatus, ReconcileError> {
        let name = jail.metadata.name.clone();
        let address = self.choose_address(&name, &jail)?;
        let previous = self.state.jails.get(&name).cloned();
        let replace = previous
            .as_ref()
            .is_some_and(|p| needs_replacement(&p.spec, &jail) || p.address != address);
        let limits_changed = previous
            .as_ref()
            .is_some_and(|p| p.spec.spec.resources != jail.spec.resources);

        let record = JailRecord {
            spec: jail,
            address,
            epoch: epoch.or(previous.as_ref().and_then(|p| p.epoch)),
            created_unix: previous
                .as_ref()
                .map(|p| p.created_unix)
                .unwrap_or_else(unix_now),
            restarts: previous.as_ref().map(|p| p.restarts).unwrap_or(0),
        };
        let mut next = self.state.clone();
        next.deleting.remove(&name);
        next.jails.insert(name.clone(), record);
        self.commit(next)?;

        let result = (|| -> Result<(), HostError> {
            if replace {
                // The old jail runs with the old spec: take its runtime down
                // (volumes and rootfs stay) and let converge build it again.
                self.jails.remove(&name)?;
                self.backoff.forget(&name);
                self.runtime.remove(&name);
            } else if limits_changed {
                let limits = limits_of(&self.state.jails[&name].spec);
                self.jails.set_limits(&name, &limits)?;
            }
            let obs = self.observe()?;
            self.converge(&name, &obs)
        })();
        match result {
            Ok(()) => Ok(self.status_of(&name)),
            Err(error) => {
                self.note_failure(&name, &error);
                Err(ReconcileError::Host { jail: name, error })
            }
        }
    }

    /// Deletes a jail: persists the intent, then runs the delete order. A
    /// delete that cannot finish (busy mount) stays recorded and is retried by
    /// every pass.
    pub fn delete(&mut self, name: &str) -> Result<(), ReconcileError> {
        let spec = match (self.state.jails.get(name), self.state.deleting.get(name)) {
            (Some(rec), _) => rec.spec.clone(),
            (None, Some(spec)) => spec.clone(),
            (None, None) => return Err(ReconcileError::NotFound(name.to_string())),
        };
        let mut next = self.state.clone();
        next.jails.remove(name);
        next.deleting.insert(name.to_string(), spec);
        self.commit(next)?;
        self.finish_delete(name).map_err(|error| {
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
        if !obs.interfaces.contains(&self.node.bridge)
            && let Err(e) = self.ensure_bridge()
        {
            report.failures.push(JailFailure {
                jail: "(host)".into(),
                error: e.to_string(),
            });
        }

        let pending: Vec<String> = self.state.deleting.keys().cloned().collect();
        for name in pending {
            if let Err(e) = self.finish_delete(&name) {
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
            if let Err(e) = self.converge(&name, &obs) {
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
        let orphans: Vec<String> = obs
            .jails
            .values()
            .filter(|j| self.is_keel_jail(j))
            .filter(|j| {
                !self.state.jails.contains_key(&j.name)
                    && !self.state.deleting.contains_key(&j.name)
            })
            .map(|j| j.name.clone())
            .collect();
        for name in orphans {
            if let Err(e) = self.teardown(&name, &[]) {
                report.failures.push(JailFailure {
                    jail: name,
                    error: e.to_string(),
                });
            }
        }

        let snapshot = self.backoff.snapshot();
        if (!report.restarted.is_empty() || snapshot != self.state.backoff)
            && let Err(e) = self.save_bookkeeping(snapshot)
        {
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
                address: Ipv4Addr::UNSPECIFIED,
                restarts: 0,
                created_unix: 0,
                last_error: self.runtime.get(name).and_then(|r| r.last_error.clone()),
                retry_in_secs: None,
                epoch: None,
                cpu: spec.spec.resources.cpu,
                memory: spec.spec.resources.memory,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Status of one jail, or `None` when it is neither desired nor deleting.
    pub fn get(&self, name: &str) -> Option<JailStatus> {
        self.list().into_iter().find(|s| s.name == name)
    }

    /// The record of one desired jail.
    pub fn record(&self, name: &str) -> Option<&JailRecord> {
        self.state.jails.get(name)
    }

    fn commit(&mut self, mut next: AgentState) -> Result<(), ReconcileError> {
        // Persist first: if the write fails the in-memory state stays as it
        // was, so nothing unacknowledged is ever half-applied.
        next.backoff = self.backoff.snapshot();
        self.store.save(&next)?;
        self.state = next;
        Ok(())
    }

    fn save_bookkeeping(&mut self, snapshot: Snapshot<String>) -> Result<(), StoreError> {
        let mut next = self.state.clone();
        next.backoff = snapshot;
        self.store.save(&next)?;
        self.state = next;
        Ok(())
    }

    fn choose_address(&self, name: &str, jail: &Jail) -> Result<Ipv4Addr, ReconcileError> {
        let used: BTreeMap<Ipv4Addr, &str> = self
            .state
            .jails
            .iter()
            .filter(|(n, _)| n.as_str() != name)
            .map(|(n, r)| (r.address, n.as_str()))
            .collect();
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
            if let Some(other) = used.get(&addr) {
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
        let first = u32::from(self.node.subnet.network());
        let host_bits = 32 - u32::from(self.node.subnet.prefix_len());
        let count = if host_bits >= 32 {
            u32::MAX
        } else {
            1u32 << host_bits
        };
        (2..count)
            .map(|i| Ipv4Addr::from(first + i))
            .find(|ip| self.node.is_host_address(*ip) && !used.contains_key(ip))
            .ok_or(ReconcileError::AddressesExhausted(self.node.subnet))
    }

    fn observe(&self) -> Result<Observation, HostError> {
        let jails = self
            .jails
            .list()?
            .into_iter()
            .map(|j| (j.name.clone(), j))
            .collect();
        let datasets = self.zfs.list()?.into_iter().map(|d| d.name).collect();
        let mounted = self.mounts.list()?.into_iter().map(|m| m.target).collect();
        let interfaces = self.net.list_interfaces()?.into_iter().collect();
        Ok(Observation {
            jails,
            datasets,
            mounted,
            interfaces,
        })
    }

    fn ensure_bridge(&self) -> Result<(), HostError> {
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
    fn converge(&mut self, name: &str, obs: &Observation) -> Result<(), HostError> {
        let Some(rec) = self.state.jails.get(name).cloned() else {
            return Ok(());
        };
        let now = self.clock.now();
        let layout = self.zfs.layout().clone();
        let root = layout.rootfs_path(name);
        let spec = &rec.spec.spec;

        if !obs.datasets.contains(&layout.rootfs_dataset(name)) {
            self.zfs.clone_rootfs(&spec.base, name)?;
        }
        for v in &spec.volumes {
            if !obs.datasets.contains(&layout.volume_dataset(&v.name)) {
                self.zfs.create_volume(&v.name, v.size)?;
            }
            let target = under_root(&root, &v.mount_path);
            if !obs.is_mounted(&target) {
                self.mounts
                    .mount_nullfs(&layout.volume_path(&v.name), &target)?;
            }
        }

        let (host_if, _) = iface_names(name);
        let observed = obs.jails.get(name);
        let epair_present = obs.interfaces.contains(&host_if);
        match observed {
            Some(j) if j.running && epair_present => {
                let key = name.to_string();
                let rt = self.runtime.entry(key.clone()).or_default();
                if rt.phase != Some(Phase::Running) {
                    // First sight of it running (e.g. after an agent restart):
                    // its stable-uptime clock starts now.
                    self.backoff.record_started(&key, now);
                }
                self.backoff.record_stable_check(&key, now);
                let rt = self.runtime.entry(key).or_default();
                rt.phase = Some(Phase::Running);
                rt.last_error = None;
                rt.crash_counted = false;
                return Ok(());
            }
            Some(_) => {
                // Exists but its workload is gone (or its epair vanished):
                // a crash. Count it once, then restart when backoff allows.
                let key = name.to_string();
                let rt = self.runtime.entry(key.clone()).or_default();
                if !rt.crash_counted {
                    rt.crash_counted = true;
                    rt.phase = Some(Phase::CrashLoop);
                    self.backoff.record_failure(&key, now);
                }
                if !self.backoff.ready(&key, now) {
                    return Ok(());
                }
                self.jails.remove(name)?;
                if let Some(r) = self.state.jails.get_mut(name) {
                    r.restarts += 1;
                }
            }
            None => {}
        }

        if !epair_present {
            self.net.attach(&self.node.bridge, name)?;
        }
        let params = self.jail_params(name, &rec, &root);
        self.jails.create(&params)?;
        self.jails.set_limits(name, &limits_of(&rec.spec))?;
        self.backoff.record_started(&name.to_string(), now);
        let rt = self.runtime.entry(name.to_string()).or_default();
        rt.phase = Some(Phase::Running);
        rt.last_error = None;
        rt.crash_counted = false;
        Ok(())
    }

    fn jail_params(&self, name: &str, rec: &JailRecord, root: &Path) -> JailParams {
        let spec = &rec.spec.spec;
        let (_, jail_if) = iface_names(name);
        JailParams {
            name: name.to_string(),
            path: root.to_path_buf(),
            hostname: spec.hostname.clone().unwrap_or_else(|| name.to_string()),
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

    fn finish_delete(&mut self, name: &str) -> Result<(), HostError> {
        let spec = self.state.deleting.get(name).cloned();
        let volumes: Vec<PathBuf> = spec
            .map(|s| {
                s.spec
                    .volumes
                    .iter()
                    .map(|v| v.mount_path.clone())
                    .collect()
            })
            .unwrap_or_default();
        self.teardown(name, &volumes)?;
        let mut next = self.state.clone();
        next.deleting.remove(name);
        self.store
            .save(&next)
            .map_err(|e| HostError::Store(e.to_string()))?;
        self.state = next;
        self.backoff.forget(&name.to_string());
        self.runtime.remove(name);
        Ok(())
    }

    /// The delete order. `volumes` are the declared mount paths; any other
    /// mount found under the jail root is unmounted too, deepest first.
    fn teardown(&mut self, name: &str, volumes: &[PathBuf]) -> Result<(), HostError> {
        let root = self.zfs.layout().rootfs_path(name);
        self.jails.remove(name)?;
        self.jails.clear_limits(name)?;
        self.net.detach(name)?;

        let mut targets: Vec<PathBuf> = volumes.iter().map(|m| under_root(&root, m)).collect();
        for m in self.mounts.list()? {
            if m.target.starts_with(&root) && !targets.contains(&m.target) {
                targets.push(m.target);
            }
        }
        // Declared order reversed, then deeper paths before their parents.
        targets.reverse();
        targets.sort_by_key(|t| std::cmp::Reverse(t.components().count()));
        for target in targets {
            if let Err(reason) = self.mounts.unmount(&target) {
                return Err(HostError::UnmountBlocked { target, reason });
            }
        }
        self.zfs.destroy_rootfs(name)?;
        Ok(())
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
    }

    fn status_of(&self, name: &str) -> JailStatus {
        let rec = &self.state.jails[name];
        let rt = self.runtime.get(name).cloned().unwrap_or_default();
        let now = self.clock.now();
        let retry_in_secs = match rt.phase {
            Some(Phase::CrashLoop) | Some(Phase::Failed) => self
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
            created_unix: rec.created_unix,
            last_error: rt.last_error,
            retry_in_secs,
            epoch: rec.epoch,
            cpu: rec.spec.spec.resources.cpu,
            memory: rec.spec.spec.resources.memory,
        }
    }
}

fn limits_of(jail: &Jail) -> Limits {
    Limits {
        cpu: jail.spec.resources.cpu,
        memory: jail.spec.resources.memory,
    }
}

/// A spec change that a running jail cannot absorb in place: anything but
/// resources (which rctl changes live).
fn needs_replacement(old: &Jail, new: &Jail) -> bool {
    let mut a = old.spec.clone();
    let mut b = new.spec.clone();
    a.resources = Default::default();
    b.resources = Default::default();
    a != b
}

/// `root` joined with an absolute mount path (validated: normalised, no `..`).
fn under_root(root: &Path, mount_path: &Path) -> PathBuf {
    root.join(mount_path.strip_prefix("/").unwrap_or(mount_path))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
