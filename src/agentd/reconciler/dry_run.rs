//! Dry runs and diffs of one jail: what an apply would change, down to the
//! FreeBSD commands, with nothing changed.
//!
//! [`Reconciler::dry_run`] answers with the object diff against the record
//! the agent holds, what the apply would do ([`DryRunAction`], decided with
//! the same [`identity`] and limits comparisons `converge` uses), and the
//! exact command sequence, produced by the same code path as the apply: a
//! second [`Reconciler`], over the `FreeBsd*` host implementations, applies
//! the spec. What keeps it from changing anything:
//!
//! - Its commands go to a [`ScriptedHost`], never to the machine. The
//!   scripted host is seeded from what the live seams observe (the read-only
//!   batch a pass starts with: jails and whether they run, datasets with
//!   quotas and use, nullfs mounts, interfaces, and whether the spec's base
//!   snapshot exists), so the same code works on FreeBSD and in simulate mode,
//!   where the host has no FreeBSD commands to pass reads through to. Passing
//!   reads through and answering every change with success would not do: a
//!   change's answer is read back (`ifconfig epair create` names the new
//!   interface; `rctl -r` of no rule is an error to tolerate), and the model
//!   answers those as FreeBSD does.
//! - Its jail.conf files live in memory ([`ConfFiles::Memory`]), seeded with
//!   each existing jail's conf (read from `{conf_dir}` when it is there, else
//!   rendered from its record, as simulate mode writes none), so the argv names
//!   the real `{conf_dir}/{name}.conf` and a replace shows `jail -f CONF -r`.
//! - Its state store is in memory ([`AgentStore::in_memory`]), started from a copy
//!   of this reconciler's state: the state file is not written, and this
//!   reconciler is only read (`&self`).
//! - Root seeds ([`Reconciler::seed_root`]) are not copied: they write files,
//!   not commands.
//!
//! It runs on the worker as one command, like an apply: the observation is the
//! pass's batch (the second reconciler's apply then reads its own jail from
//! the scripted host, as a real apply does), and the rest is in memory. Running it off the worker on
//! a published snapshot would need a copy of the seams; one worker command
//! keeps the observation and the record in step without that.
//!
//! Limits, said honestly: the commands are those the apply would run *if the
//! host answers as the model does*. What the batch does not show is modelled
//! as Keel left it: a running jail's epair is on the bridge with its jail side
//! in the jail's vnet, its devfs is mounted, its rctl rules are whatever the
//! record says. Unit numbers the kernel picks (`epair0a`) come from the model,
//! exec.stop is assumed to succeed, and a step the real host would refuse for
//! a reason the batch cannot see (a busy dataset, a full pool) shows up only
//! in the real apply.
//!
//! [`Reconciler::diff`] is the object diff and the decision alone, from the
//! records, with no host command at all.

use std::path::PathBuf;

use serde_json::Value;

use super::{AgentStore, HostError, JailRecord, ReconcileError, Reconciler, identity};
use crate::common::backoff::SystemClock;
use crate::common::config::{CommandPaths, DevfsRuleset};
use crate::common::objdiff;
use crate::common::spec::{Jail, JailSpec};
use crate::common::wire::{DryRunAction, DryRunReport, PlannedCommand};
use crate::host::jail::{ConfFiles, FreeBsdJails, ObservedJail, render_jail_conf};
use crate::host::mount::FreeBsdMounts;
use crate::host::net::FreeBsdNet;
use crate::host::scripted::ScriptedHost;
use crate::host::zfs::FreeBsdZfs;
use crate::host::{JailRuntime, MountManager, NetManager, ZfsManager, iface_names};

/// How the agent's FreeBSD host is set up, for the dry run's copy of it: the
/// command paths and jail.conf directory of keel.toml (the same in simulate
/// mode, whose dry runs show what FreeBSD would run).
#[derive(Debug, Clone, PartialEq)]
pub struct DryRunHost {
    /// `[commands]`.
    pub paths: CommandPaths,
    /// Where the agent keeps each jail's jail.conf (`{state_dir}/jails`).
    pub conf_dir: PathBuf,
    /// `jail.devfs_ruleset`.
    pub devfs: DevfsRuleset,
}

impl Default for DryRunHost {
    fn default() -> Self {
        DryRunHost {
            paths: CommandPaths::default(),
            conf_dir: PathBuf::from("/var/db/keel/agentd/jails"),
            devfs: DevfsRuleset::default(),
        }
    }
}

impl<J, Z, N, M> Reconciler<J, Z, N, M>
where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    /// Sets the host setup dry runs copy (the daemon's keel.toml).
    pub fn set_dry_run_host(&mut self, host: DryRunHost) {
        self.dry_host = host;
    }

    /// The object diff of `jail` against the record held, and what an apply
    /// would do, decided from the records alone (no host command): a
    /// recorded jail is taken to be running, so the decision is never
    /// [`DryRunAction::Start`] here; the dry run looks.
    pub fn diff(&self, jail: &Jail) -> Result<DryRunReport, ReconcileError> {
        let name = jail.metadata.name.clone();
        let address = self.choose_address(&name, jail)?;
        let running = self.state.jails.contains_key(&name).then_some(true);
        let (action, because) = self.decide(&name, jail, address, running);
        Ok(self.report(jail, action, because))
    }

    /// What applying `jail` (with `epoch`, as [`Reconciler::apply`]) would
    /// do, with the FreeBSD commands; changes nothing. See the module docs.
    /// A request the apply would refuse is refused the same way.
    pub fn dry_run(&self, jail: Jail, epoch: Option<u64>) -> Result<DryRunReport, ReconcileError> {
        let name = jail.metadata.name.clone();
        let observe_failed = |error: HostError| ReconcileError::Host {
            jail: name.clone(),
            error,
        };
        let (host, jails) = self.seeded_host(&jail).map_err(observe_failed)?;
        let running = jails.iter().find(|j| j.name == name).map(|j| j.running);
        let confs = ConfFiles::memory();
        self.seed_confs(&confs, &host);
        let host = host.with_conf_files(confs.clone());
        let paths = self.dry_host.paths.clone();
        let mut dry = Reconciler::new(
            FreeBsdJails::new(host.clone(), paths.clone(), &self.dry_host.conf_dir)
                .with_devfs_ruleset(self.dry_host.devfs)
                .with_conf_files(confs),
            FreeBsdZfs::new(
                host.clone(),
                paths.clone(),
                self.zfs.layout().clone(),
                1,
                std::time::Duration::ZERO,
            ),
            FreeBsdNet::new(host.clone(), paths.clone()),
            FreeBsdMounts::new(host.clone(), paths),
            self.node.clone(),
            AgentStore::in_memory(),
            Some(self.state.clone()),
            Box::new(SystemClock),
        );
        let note = match dry.apply(jail.clone(), epoch) {
            Ok(_) => None,
            Err(ReconcileError::Host { error, .. }) => Some(format!(
                "the apply would stop at the last command listed: {error}"
            )),
            Err(ReconcileError::BaseMissing { error, .. }) => Some(format!(
                "the apply would stop at the last command listed: {error}"
            )),
            Err(refused) => return Err(refused),
        };
        let address = dry
            .record(&name)
            .map(|r| r.address)
            .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED);
        let (action, because) = self.decide(&name, &jail, address, running);
        let mut report = self.report(&jail, action, because);
        report.commands = host
            .ran()
            .into_iter()
            .map(|ex| PlannedCommand {
                changes_host: !reads_only(&self.dry_host.paths, &ex.argv),
                argv: ex.argv,
            })
            .collect();
        report.note = note;
        Ok(report)
    }

    fn report(&self, jail: &Jail, action: DryRunAction, because: Vec<String>) -> DryRunReport {
        let name = &jail.metadata.name;
        let held = self
            .state
            .jails
            .get(name)
            .and_then(|r| serde_json::to_value(&r.spec).ok());
        let new = serde_json::to_value(jail).unwrap_or(Value::Null);
        DryRunReport {
            kind: "Jail".into(),
            name: name.clone(),
            node: None,
            changes: objdiff::diff(held.as_ref(), &new),
            action,
            because,
            commands: Vec::new(),
            note: None,
        }
    }

    /// What converge would do with `jail` at `address`: the decision of
    /// `converge` and `keep_running`, from the record of what runs
    /// ([`super::Deployed`]). `running`: whether the jail is on the host and
    /// its workload runs (`None`: not on the host).
    fn decide(
        &self,
        name: &str,
        jail: &Jail,
        address: std::net::Ipv4Addr,
        running: Option<bool>,
    ) -> (DryRunAction, Vec<String>) {
        let Some(rec) = self.state.jails.get(name) else {
            return (DryRunAction::Create, Vec::new());
        };
        let new = &jail.spec;
        if let Some(d) = &rec.deployed {
            let (old_id, old_addr) = identity(name, &d.spec, d.address);
            let (new_id, new_addr) = identity(name, new, address);
            if (&old_id, old_addr) != (&new_id, new_addr) {
                // Wrapped, so the paths read as in the document.
                let spec = |s: &JailSpec| serde_json::json!({ "spec": s });
                let mut because = sections(Some(&spec(&old_id)), &spec(&new_id));
                if old_addr != new_addr {
                    because.push("spec.network.address".into());
                }
                return (DryRunAction::Replace, because);
            }
        }
        match running {
            None => return (DryRunAction::Start, vec!["not on the host".into()]),
            Some(false) => return (DryRunAction::Start, vec!["its workload is gone".into()]),
            Some(true) => {}
        }
        let mut because = Vec::new();
        let limits = rec.deployed.as_ref().and_then(|d| d.limits.as_ref());
        if limits != Some(&new.resources) {
            because.push("spec.resources".to_string());
        }
        let old_sizes: Vec<_> = rec.spec.spec.volumes.iter().map(|v| v.size).collect();
        let new_sizes: Vec<_> = new.volumes.iter().map(|v| v.size).collect();
        if old_sizes != new_sizes {
            because.push("spec.volumes".to_string());
        }
        if !because.is_empty() {
            return (DryRunAction::UpdateInPlace, because);
        }
        let held = serde_json::to_value(&rec.spec).ok();
        let record = sections(
            held.as_ref(),
            &serde_json::to_value(jail).unwrap_or(Value::Null),
        );
        if record.is_empty() {
            (DryRunAction::Nothing, Vec::new())
        } else {
            (DryRunAction::UpdateRecord, record)
        }
    }

    /// A scripted FreeBSD host holding what the live seams observe now, and
    /// the jails they showed.
    fn seeded_host(&self, jail: &Jail) -> Result<(ScriptedHost, Vec<ObservedJail>), HostError> {
        let layout = self.zfs.layout();
        let host = ScriptedHost::new(self.dry_host.paths.clone(), &layout.pool);
        let jails = self.jails.list()?;
        let datasets = self.zfs.list()?;
        for d in &datasets {
            host.seed_dataset(&d.name, d.mountpoint.as_deref(), d.quota, d.used);
        }
        // The snapshot the clone needs; `zfs list -t filesystem` shows no
        // snapshot, and simulate mode lists no base dataset at all.
        let base = layout.base_snapshot(&jail.spec.base);
        if self.zfs.dataset_exists(&base)? {
            if let Some((dataset, _)) = base.split_once('@')
                && !datasets.iter().any(|d| d.name == dataset)
            {
                host.seed_dataset(dataset, None, None, 0);
            }
            host.seed_snapshot(&base);
        }
        for m in self.mounts.list()? {
            host.seed_mount(&m.source, &m.target, &m.fstype);
        }
        let on_host = self.net.list_interfaces()?;
        for j in &jails {
            let root = layout.rootfs_path(&j.name);
            if j.path != root {
                host.seed_jail(&j.name, j.jid, &j.path, j.running);
                continue;
            }
            // As Keel made it: devfs on the root's dev, the jail side of
            // the epair in the jail's vnet, paired with the host side.
            host.seed_dir(&root.join("dev"));
            host.seed_mount(&PathBuf::from("devfs"), &root.join("dev"), "devfs");
            host.seed_jail(&j.name, j.jid, &j.path, j.running);
            let (host_if, jail_if) = iface_names(&j.name);
            if on_host.contains(&host_if) {
                host.seed_interface(&host_if, Some(&jail_if), None);
                host.seed_interface(&jail_if, Some(&host_if), Some(&j.name));
            }
        }
        for name in &on_host {
            host.seed_interface(name, None, None);
        }
        Ok((host, jails))
    }

    /// Each Keel jail's jail.conf, as `jail -f CONF -r` would read it.
    fn seed_confs(&self, confs: &ConfFiles, host: &ScriptedHost) {
        for name in host.jails() {
            let path = self.dry_host.conf_dir.join(format!("{name}.conf"));
            if let Ok(text) = ConfFiles::Disk.read(&path) {
                confs.seed(&path, &text);
            } else if let Some(rec) = self.state.jails.get(&name) {
                let root = self.zfs.layout().rootfs_path(&name);
                let params = self.jail_params(&name, &deployed_record(rec), &root);
                confs.seed(&path, &render_jail_conf(&params, self.dry_host.devfs));
            }
        }
    }
}

/// `rec` as the jail on the host was built: its deployed spec and address.
fn deployed_record(rec: &JailRecord) -> JailRecord {
    let mut built = rec.clone();
    if let Some(d) = &rec.deployed {
        built.spec.spec = d.spec.clone();
        built.address = d.address;
    }
    built
}

/// The distinct sections (`spec.exec`) of the fields that differ.
fn sections(old: Option<&Value>, new: &Value) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for change in objdiff::diff(old, new) {
        let s = objdiff::section(&change.path);
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// True for the commands that only read the host: the observation batch
/// (jls, ps, zfs list/get, mount -p, ifconfig -l), netstat, and sysctl
/// without an assignment. Everything else is a change.
fn reads_only(paths: &CommandPaths, command: &[String]) -> bool {
    let Some((program, args)) = command.split_first() else {
        return false;
    };
    let program = std::path::Path::new(program);
    let first = args.first().map(String::as_str);
    if program == paths.jls || program == paths.ps || program == paths.netstat {
        return true;
    }
    if program == paths.zfs {
        return matches!(first, Some("list" | "get"));
    }
    if program == paths.mount {
        return first == Some("-p");
    }
    if program == paths.ifconfig {
        return first == Some("-l");
    }
    if program == paths.sysctl {
        return args.iter().all(|a| !a.contains('='));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::cmd::argv;

    #[test]
    fn observation_reads_and_everything_else_changes() {
        let paths = CommandPaths::default();
        let reads = [
            argv(&["/usr/sbin/jls", "-h", "name", "jid", "path"]),
            argv(&["/sbin/zfs", "list", "-H"]),
            argv(&["/sbin/mount", "-p", "-t", "nullfs"]),
            argv(&["/sbin/ifconfig", "-l"]),
            argv(&["/sbin/sysctl", "-n", "hw.ncpu"]),
        ];
        for r in &reads {
            assert!(reads_only(&paths, r), "{r:?}");
        }
        let changes = [
            argv(&["/sbin/zfs", "clone", "a@keel", "b"]),
            argv(&["/sbin/mount", "-t", "nullfs", "/a", "/b"]),
            argv(&["/sbin/ifconfig", "epair", "create"]),
            argv(&["/usr/bin/rctl", "-r", "jail:web"]),
            argv(&["/bin/mkdir", "-p", "/x"]),
            argv(&["/sbin/sysctl", "a=1"]),
            Vec::new(),
        ];
        for c in &changes {
            assert!(!reads_only(&paths, c), "{c:?}");
        }
    }
}
