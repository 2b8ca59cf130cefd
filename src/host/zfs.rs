//! ZFS datasets: jail root filesystems cloned from a base snapshot, and
//! quota-scoped volume datasets that outlive every jail.
//!
//! Layout under the configured pool:
//! - `{pool}/keel/bases/{base}@keel`: base snapshots `keelctl base fetch`
//!   installs (`host::base`), or the admin prepares;
//! - `{pool}/keel/jails/{jail}`: a jail's rootfs, mounted at `{jails_dir}/{jail}`;
//! - `{pool}/keel/volumes/{volume}`: a volume, mounted at `{volumes_dir}/{volume}`.
//!
//! The admin prepares `{pool}/keel` once (`zfs create -o mountpoint=none
//! {pool}/keel`) and the base snapshots; `list` refuses to go on without the
//! root and says how to create it. `jails` and `volumes` are created on first
//! use (`zfs clone -p`, `zfs create -p`).
//!
//! Creation is idempotent: an existing rootfs or volume is success (with `-p`
//! zfs(8) itself exits 0 when the target exists), so a provisioning step that
//! ran before a crash can simply run again. An existing volume keeps its quota;
//! [`ZfsManager::set_volume_quota`] changes it.
//!
//! This module never destroys a volume as a side effect of anything else: only
//! [`ZfsManager::destroy_volume`] does, and the reconciler calls it only for an
//! explicit volume delete. Volumes are destroyed without `-r`, so a volume
//! with snapshots or children is refused rather than taken with them.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::cmd::{CmdError, CmdOutput, CommandRunner};
use crate::common::config::CommandPaths;
use crate::host::fake::{CallLog, Faults, lock};

/// Where Keel's datasets live and where they are mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZfsLayout {
    /// The pool (e.g. `zroot`).
    pub pool: String,
    /// Parent directory of jail root filesystems.
    pub jails_dir: PathBuf,
    /// Parent directory of volume mountpoints.
    pub volumes_dir: PathBuf,
}

impl ZfsLayout {
    /// `{pool}/keel/bases/{base}@keel`
    pub fn base_snapshot(&self, base: &str) -> String {
        format!("{}/keel/bases/{base}@keel", self.pool)
    }
    /// `{pool}/keel/jails/{jail}`
    pub fn rootfs_dataset(&self, jail: &str) -> String {
        format!("{}/keel/jails/{jail}", self.pool)
    }
    /// `{pool}/keel/volumes/{volume}`
    pub fn volume_dataset(&self, volume: &str) -> String {
        format!("{}/keel/volumes/{volume}", self.pool)
    }
    /// `{jails_dir}/{jail}`
    pub fn rootfs_path(&self, jail: &str) -> PathBuf {
        self.jails_dir.join(jail)
    }
    /// `{volumes_dir}/{volume}`
    pub fn volume_path(&self, volume: &str) -> PathBuf {
        self.volumes_dir.join(volume)
    }
}

/// One dataset as `zfs list` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dataset {
    /// Full dataset name.
    pub name: String,
    /// Bytes used (`used`).
    pub used: u64,
    /// Quota in bytes; `None` when unset (zfs reports 0).
    pub quota: Option<u64>,
    /// Mountpoint; `None` for `none`/`legacy`/`-`.
    pub mountpoint: Option<PathBuf>,
}

/// A ZFS operation that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ZfsError {
    /// A command failed or could not run.
    Command(CmdError),
    /// The dataset stayed busy through every retry (mounted or in use).
    Busy {
        /// The dataset.
        dataset: String,
        /// How many attempts were made.
        attempts: u32,
        /// The last stderr.
        stderr: String,
    },
    /// The dataset (or a clone's base snapshot) does not exist.
    NotFound(String),
    /// A quota below what the dataset already uses.
    QuotaBelowUsed {
        /// The dataset.
        dataset: String,
        /// Requested quota in bytes.
        quota: u64,
        /// Bytes in use.
        used: u64,
    },
    /// `zfs list` output that does not match the documented format.
    Parse(String),
}

impl fmt::Display for ZfsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZfsError::Command(e) => write!(f, "{e}"),
            ZfsError::Busy {
                dataset,
                attempts,
                stderr,
            } => write!(
                f,
                "{dataset} is still busy after {attempts} attempts ({stderr}); something still uses it"
            ),
            ZfsError::NotFound(d) => match d.split_once('@') {
                Some((dataset, _)) => {
                    let release = dataset.rsplit('/').next().unwrap_or(dataset);
                    write!(
                        f,
                        "base snapshot {d} does not exist; fetch the base once with `keelctl base fetch {release}` (or prepare it by hand: `zfs create -p -o mountpoint=/some/dir {dataset}`, extract the release's base.txz into /some/dir, then `zfs snapshot {d}`)"
                    )
                }
                None if d.ends_with("/keel") && d.matches('/').count() == 1 => write!(
                    f,
                    "dataset {d} does not exist; Keel keeps all its datasets under it: create it once with `zfs create -o mountpoint=none {d}`"
                ),
                None => write!(f, "dataset {d} does not exist"),
            },
            ZfsError::QuotaBelowUsed {
                dataset,
                quota,
                used,
            } => write!(
                f,
                "cannot set the quota of {dataset} to {quota} bytes: it already uses {used} bytes"
            ),
            ZfsError::Parse(why) => write!(f, "could not read `zfs list` output: {why}"),
        }
    }
}

impl std::error::Error for ZfsError {}

impl From<CmdError> for ZfsError {
    fn from(e: CmdError) -> Self {
        ZfsError::Command(e)
    }
}

/// Root filesystems and volumes.
pub trait ZfsManager: Send {
    /// The dataset layout this manager works in.
    fn layout(&self) -> &ZfsLayout;
    /// Every dataset under `{pool}/keel`, in one `zfs list`.
    fn list(&self) -> Result<Vec<Dataset>, ZfsError>;
    /// The filesystems among `names` that exist, as [`ZfsManager::list`]
    /// shows them (in any order); an absent one is left out, not an error.
    /// What an apply observes: one `zfs list` naming its jail's datasets, so
    /// its cost does not follow the number of datasets on the pool.
    fn list_named(&self, names: &[String]) -> Result<Vec<Dataset>, ZfsError>;
    /// True when `dataset` exists.
    fn dataset_exists(&self, dataset: &str) -> Result<bool, ZfsError>;
    /// Clones the base snapshot into the jail's rootfs; returns its mountpoint.
    /// A missing base snapshot is [`ZfsError::NotFound`] naming it.
    fn clone_rootfs(&self, base: &str, jail: &str) -> Result<PathBuf, ZfsError>;
    /// Destroys the jail's rootfs, retrying while busy; [`ZfsError::Busy`] when
    /// retries run out. An absent dataset is success.
    fn destroy_rootfs(&self, jail: &str) -> Result<(), ZfsError>;
    /// Creates a volume dataset with an optional quota; returns its mountpoint.
    fn create_volume(&self, volume: &str, quota: Option<u64>) -> Result<PathBuf, ZfsError>;
    /// Changes a volume's quota in place (`zfs set quota`).
    fn set_volume_quota(&self, volume: &str, quota: Option<u64>) -> Result<(), ZfsError>;
    /// Destroys a volume, retrying while busy; [`ZfsError::Busy`] when retries
    /// run out, [`ZfsError::NotFound`] when absent.
    fn destroy_volume(&self, volume: &str) -> Result<(), ZfsError>;
}

/// How long one zfs(8) call may run: destroying or mounting a dataset on a
/// loaded pool can take a while.
pub const ZFS_TIMEOUT: Duration = Duration::from_secs(60);

/// How a destroy retries while ZFS reports the dataset busy (a process still
/// has a file open or a mount below it is going away).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusyRetry {
    /// Attempts in all (at least 1).
    pub attempts: u32,
    /// Pause between two attempts.
    pub delay: Duration,
}

/// [`ZfsManager`] on FreeBSD over zfs(8).
#[derive(Debug)]
pub struct FreeBsdZfs<R: CommandRunner> {
    runner: R,
    paths: CommandPaths,
    layout: ZfsLayout,
    busy: BusyRetry,
    timeout: Duration,
}

impl<R: CommandRunner> FreeBsdZfs<R> {
    /// Runs zfs(8) through `runner` in `layout`; a busy destroy is tried
    /// `attempts` times in all, `delay` apart.
    pub fn new(
        runner: R,
        paths: CommandPaths,
        layout: ZfsLayout,
        attempts: u32,
        delay: Duration,
    ) -> Self {
        FreeBsdZfs {
            runner,
            paths,
            layout,
            busy: BusyRetry {
                attempts: attempts.max(1),
                delay,
            },
            timeout: ZFS_TIMEOUT,
        }
    }

    fn zfs(&self, args: &[&str]) -> Vec<String> {
        let mut argv = vec![self.paths.zfs.to_string_lossy().into_owned()];
        argv.extend(args.iter().map(|a| a.to_string()));
        argv
    }

    fn run(&self, argv: &[String]) -> Result<CmdOutput, ZfsError> {
        Ok(self.runner.run(argv, None, self.timeout)?)
    }

    /// Destroys `dataset`, retrying while busy; `Ok(false)` when it was absent.
    fn destroy(&self, dataset: &str, recursive: bool) -> Result<bool, ZfsError> {
        let argv = if recursive {
            self.zfs(&["destroy", "-r", dataset])
        } else {
            self.zfs(&["destroy", dataset])
        };
        let mut last = String::new();
        for attempt in 1..=self.busy.attempts {
            match self.run(&argv)?.check(&argv) {
                Ok(_) => return Ok(true),
                Err(e) if says(&e, MISSING) => return Ok(false),
                // Both "cannot unmount '…': pool or dataset is busy" and
                // "cannot destroy '…': dataset is busy".
                Err(e) if says(&e, "dataset is busy") => last = detail(&e),
                Err(e) => return Err(e.into()),
            }
            if attempt < self.busy.attempts && !self.busy.delay.is_zero() {
                std::thread::sleep(self.busy.delay);
            }
        }
        Err(ZfsError::Busy {
            dataset: dataset.to_string(),
            attempts: self.busy.attempts,
            stderr: last,
        })
    }

    fn used(&self, dataset: &str) -> Result<u64, ZfsError> {
        let argv = self.zfs(&["get", "-H", "-p", "-o", "value", "used", dataset]);
        let out = self.run(&argv)?.check(&argv)?;
        let value = out.stdout.trim();
        value
            .parse()
            .map_err(|_| ZfsError::Parse(format!("`used` of {dataset} is `{value}`, not a number")))
    }
}

const MISSING: &str = "dataset does not exist";

/// The `zfs list` both observations run, before `-r ROOT` or the names: the
/// fields [`parse_zfs_list`] reads, without header, in exact bytes.
const LIST_FILESYSTEMS: [&str; 7] = [
    "list",
    "-H",
    "-p",
    "-o",
    "name,used,quota,mountpoint",
    "-t",
    "filesystem",
];

fn says(e: &CmdError, text: &str) -> bool {
    matches!(e, CmdError::Failed { stderr, .. } if stderr.contains(text))
}

fn detail(e: &CmdError) -> String {
    match e {
        CmdError::Failed { stderr, .. } => stderr.clone(),
        other => other.to_string(),
    }
}

/// Parses `zfs list -H -p -o name,used,quota,mountpoint`: one dataset per
/// line, fields separated by one TAB, numbers in bytes, quota 0 when unset.
fn parse_zfs_list(stdout: &str) -> Result<Vec<Dataset>, String> {
    let mut out = Vec::new();
    for line in stdout.lines().filter(|l| !l.is_empty()) {
        let fields: Vec<&str> = line.split('\t').collect();
        let [name, used, quota, mountpoint] = fields[..] else {
            return Err(format!(
                "`{line}` has {} TAB-separated fields, expected name, used, quota, mountpoint",
                fields.len()
            ));
        };
        let number = |what: &str, v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("`{line}`: {what} `{v}` is not a number of bytes"))
        };
        let used = number("used", used)?;
        let quota = match quota {
            "-" | "none" => None,
            q => Some(number("quota", q)?).filter(|q| *q != 0),
        };
        let mountpoint = match mountpoint {
            "none" | "legacy" | "-" | "" => None,
            m => Some(PathBuf::from(m)),
        };
        out.push(Dataset {
            name: name.to_string(),
            used,
            quota,
            mountpoint,
        });
    }
    Ok(out)
}

fn mountpoint_option(path: &Path) -> String {
    format!("mountpoint={}", path.display())
}

impl<R: CommandRunner> ZfsManager for FreeBsdZfs<R> {
    fn layout(&self) -> &ZfsLayout {
        &self.layout
    }

    fn list(&self) -> Result<Vec<Dataset>, ZfsError> {
        let root = format!("{}/keel", self.layout.pool);
        let argv = self.zfs(&[LIST_FILESYSTEMS.as_slice(), &["-r", &root]].concat());
        match self.run(&argv)?.check(&argv) {
            Ok(out) => parse_zfs_list(&out.stdout).map_err(ZfsError::Parse),
            Err(e) if says(&e, MISSING) => Err(ZfsError::NotFound(root)),
            Err(e) => Err(e.into()),
        }
    }

    /// `zfs list -H -p -o name,used,quota,mountpoint -t filesystem NAME...`:
    /// the rootfs and the volumes of one jail live under different parents
    /// (`jails/`, `volumes/`), so `-r` of one dataset cannot hold them all,
    /// while zfs(8) takes several names. zfs_main.c's `zfs_for_each` opens
    /// each name, lists those it could and exits 1 when one could not, after
    /// libzfs printed `cannot open 'NAME': dataset does not exist`: such an
    /// exit is success with that name absent; any other message is an error.
    fn list_named(&self, names: &[String]) -> Result<Vec<Dataset>, ZfsError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let mut args = LIST_FILESYSTEMS.to_vec();
        args.extend(names.iter().map(String::as_str));
        let argv = self.zfs(&args);
        let out = self.run(&argv)?;
        let only_absent = out.status == 1
            && !out.stderr.trim().is_empty()
            && out
                .stderr
                .lines()
                .filter(|l| !l.trim().is_empty())
                .all(|l| {
                    names
                        .iter()
                        .any(|n| l.trim() == format!("cannot open '{n}': {MISSING}"))
                });
        let out = if only_absent { out } else { out.check(&argv)? };
        parse_zfs_list(&out.stdout).map_err(ZfsError::Parse)
    }

    fn dataset_exists(&self, dataset: &str) -> Result<bool, ZfsError> {
        let argv = self.zfs(&["list", "-H", "-o", "name", dataset]);
        match self.run(&argv)?.check(&argv) {
            Ok(_) => Ok(true),
            Err(e) if says(&e, MISSING) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    fn clone_rootfs(&self, base: &str, jail: &str) -> Result<PathBuf, ZfsError> {
        let snapshot = self.layout.base_snapshot(base);
        let path = self.layout.rootfs_path(jail);
        let argv = self.zfs(&[
            "clone",
            "-p",
            "-o",
            &mountpoint_option(&path),
            &snapshot,
            &self.layout.rootfs_dataset(jail),
        ]);
        match self.run(&argv)?.check(&argv) {
            Ok(_) => Ok(path),
            // zfs opens the snapshot first, so this is the base that is missing.
            Err(e) if says(&e, MISSING) => Err(ZfsError::NotFound(snapshot)),
            Err(e) => Err(e.into()),
        }
    }

    fn destroy_rootfs(&self, jail: &str) -> Result<(), ZfsError> {
        self.destroy(&self.layout.rootfs_dataset(jail), true)
            .map(|_| ())
    }

    fn create_volume(&self, volume: &str, quota: Option<u64>) -> Result<PathBuf, ZfsError> {
        let path = self.layout.volume_path(volume);
        let mountpoint = mountpoint_option(&path);
        let quota = quota.map(|q| format!("quota={q}"));
        let dataset = self.layout.volume_dataset(volume);
        let mut args = vec!["create", "-p", "-o", &mountpoint];
        if let Some(q) = &quota {
            args.extend(["-o", q]);
        }
        args.push(&dataset);
        let argv = self.zfs(&args);
        // With -p an existing target is exit 0: creating again is a no-op.
        self.run(&argv)?.check(&argv)?;
        Ok(path)
    }

    fn set_volume_quota(&self, volume: &str, quota: Option<u64>) -> Result<(), ZfsError> {
        let dataset = self.layout.volume_dataset(volume);
        let value = quota.map_or_else(|| "none".to_string(), |q| q.to_string());
        let argv = self.zfs(&["set", &format!("quota={value}"), &dataset]);
        match self.run(&argv)?.check(&argv) {
            Ok(_) => Ok(()),
            Err(e) if says(&e, MISSING) => Err(ZfsError::NotFound(dataset)),
            Err(e) if says(&e, "size is less than current used or reserved space") => {
                let used = self.used(&dataset)?;
                Err(ZfsError::QuotaBelowUsed {
                    dataset,
                    quota: quota.unwrap_or(0),
                    used,
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    fn destroy_volume(&self, volume: &str) -> Result<(), ZfsError> {
        let dataset = self.layout.volume_dataset(volume);
        if self.destroy(&dataset, false)? {
            Ok(())
        } else {
            Err(ZfsError::NotFound(dataset))
        }
    }
}

/// In-memory [`ZfsManager`] for tests and `--simulate`.
///
/// It starts with `{pool}/keel` and whatever bases were added; cloning a base
/// that was not added fails with [`ZfsError::NotFound`], as on a host where
/// the admin never prepared it. Every call that changes something is logged
/// (`"zfs.clone_rootfs web-1"`, `"zfs.destroy_rootfs web-1"`,
/// `"zfs.create_volume data"`, `"zfs.set_volume_quota data"`,
/// `"zfs.destroy_volume data"`), failing calls included. [`Faults`] use the
/// method names as operations with the jail or volume name as target
/// (`"list"` with target `"zfs"`, `"dataset_exists"` with the dataset); an
/// injected `destroy_rootfs` or `destroy_volume` failure is
/// [`ZfsError::Busy`], the others a failed zfs command.
#[derive(Debug, Clone)]
pub struct FakeZfs {
    layout: ZfsLayout,
    state: Arc<Mutex<ZfsTable>>,
    log: CallLog,
    faults: Faults,
}

#[derive(Debug)]
struct ZfsTable {
    pool: String,
    datasets: BTreeMap<String, Dataset>,
    bases: BTreeSet<String>,
}

impl Default for FakeZfs {
    fn default() -> Self {
        FakeZfs::new(CallLog::default(), Faults::default())
    }
}

impl FakeZfs {
    /// The layout of [`FakeZfs::new`]: pool `zroot`, jails under
    /// `/usr/local/keel/jails`, volumes under `/usr/local/keel/volumes`.
    pub fn default_layout() -> ZfsLayout {
        ZfsLayout {
            pool: "zroot".into(),
            jails_dir: "/usr/local/keel/jails".into(),
            volumes_dir: "/usr/local/keel/volumes".into(),
        }
    }

    /// A pool with [`FakeZfs::default_layout`] and no bases.
    pub fn new(log: CallLog, faults: Faults) -> FakeZfs {
        FakeZfs::with_layout(FakeZfs::default_layout(), log, faults)
    }

    /// A pool with `layout` and no bases.
    pub fn with_layout(layout: ZfsLayout, log: CallLog, faults: Faults) -> FakeZfs {
        let mut table = ZfsTable {
            pool: layout.pool.clone(),
            datasets: BTreeMap::new(),
            bases: BTreeSet::new(),
        };
        table.add(&format!("{}/keel", layout.pool), None);
        FakeZfs {
            layout,
            state: Arc::new(Mutex::new(table)),
            log,
            faults,
        }
    }

    /// A default pool (own log and faults) with `bases` prepared.
    pub fn with_bases(bases: &[&str]) -> FakeZfs {
        let zfs = FakeZfs::default();
        for b in bases {
            zfs.add_base(b);
        }
        zfs
    }

    /// Prepares base `base`: its dataset and its `@keel` snapshot.
    pub fn add_base(&self, base: &str) {
        let snapshot = self.layout.base_snapshot(base);
        let dataset = snapshot.trim_end_matches("@keel").to_string();
        let mut st = lock(&self.state);
        st.add(&dataset, None);
        st.bases.insert(snapshot);
    }

    /// Names of every dataset (not snapshots), sorted.
    pub fn datasets(&self) -> Vec<String> {
        lock(&self.state).datasets.keys().cloned().collect()
    }

    /// One dataset as `list` would report it.
    pub fn dataset(&self, name: &str) -> Option<Dataset> {
        lock(&self.state).datasets.get(name).cloned()
    }

    /// Pretends `dataset` holds `bytes` of data (for quota checks).
    pub fn set_used(&self, dataset: &str, bytes: u64) {
        if let Some(d) = lock(&self.state).datasets.get_mut(dataset) {
            d.used = bytes;
        }
    }

    fn failed(command: String, stderr: &str) -> ZfsError {
        ZfsError::Command(CmdError::Failed {
            command,
            status: 1,
            stderr: stderr.to_string(),
        })
    }

    fn busy(dataset: &str, mountpoint: &Path) -> ZfsError {
        ZfsError::Busy {
            dataset: dataset.to_string(),
            attempts: 1,
            stderr: format!(
                "cannot unmount '{}': pool or dataset is busy",
                mountpoint.display()
            ),
        }
    }
}

impl ZfsTable {
    /// Adds `name` and, like `-p`, any missing parent under the pool.
    fn add(&mut self, name: &str, dataset: Option<Dataset>) {
        let mut parent = name;
        while let Some((up, _)) = parent.rsplit_once('/') {
            self.datasets.entry(up.to_string()).or_insert(Dataset {
                name: up.to_string(),
                used: 0,
                quota: None,
                mountpoint: None,
            });
            parent = up;
        }
        // The pool's own dataset is not under {pool}/keel; keep the listing to it.
        self.datasets.remove(&self.pool);
        self.datasets.insert(
            name.to_string(),
            dataset.unwrap_or(Dataset {
                name: name.to_string(),
                used: 0,
                quota: None,
                mountpoint: None,
            }),
        );
    }
}

impl ZfsManager for FakeZfs {
    fn layout(&self) -> &ZfsLayout {
        &self.layout
    }

    fn list(&self) -> Result<Vec<Dataset>, ZfsError> {
        if self.faults.should_fail("list", "zfs") {
            return Err(FakeZfs::failed(
                "zfs list".into(),
                "internal error: injected failure",
            ));
        }
        Ok(lock(&self.state).datasets.values().cloned().collect())
    }

    fn list_named(&self, names: &[String]) -> Result<Vec<Dataset>, ZfsError> {
        if self.faults.should_fail("list_named", "zfs") {
            return Err(FakeZfs::failed(
                format!("zfs list {}", names.join(" ")),
                "internal error: injected failure",
            ));
        }
        let st = lock(&self.state);
        Ok(names
            .iter()
            .filter_map(|n| st.datasets.get(n).cloned())
            .collect())
    }

    fn dataset_exists(&self, dataset: &str) -> Result<bool, ZfsError> {
        if self.faults.should_fail("dataset_exists", dataset) {
            return Err(FakeZfs::failed(
                format!("zfs list -H -o name {dataset}"),
                "internal error: injected failure",
            ));
        }
        let st = lock(&self.state);
        Ok(st.datasets.contains_key(dataset) || st.bases.contains(dataset))
    }

    fn clone_rootfs(&self, base: &str, jail: &str) -> Result<PathBuf, ZfsError> {
        self.log.push(format!("zfs.clone_rootfs {jail}"));
        let mut st = lock(&self.state);
        let snapshot = self.layout.base_snapshot(base);
        let dataset = self.layout.rootfs_dataset(jail);
        let path = self.layout.rootfs_path(jail);
        if self.faults.should_fail("clone_rootfs", jail) {
            return Err(FakeZfs::failed(
                format!("zfs clone -p {snapshot} {dataset}"),
                &format!("cannot create '{dataset}': out of space"),
            ));
        }
        if !st.bases.contains(&snapshot) {
            return Err(ZfsError::NotFound(snapshot));
        }
        if !st.datasets.contains_key(&dataset) {
            let ds = Dataset {
                name: dataset.clone(),
                used: 0,
                quota: None,
                mountpoint: Some(path.clone()),
            };
            st.add(&dataset, Some(ds));
        }
        Ok(path)
    }

    fn destroy_rootfs(&self, jail: &str) -> Result<(), ZfsError> {
        self.log.push(format!("zfs.destroy_rootfs {jail}"));
        let mut st = lock(&self.state);
        let dataset = self.layout.rootfs_dataset(jail);
        if self.faults.should_fail("destroy_rootfs", jail) {
            return Err(FakeZfs::busy(&dataset, &self.layout.rootfs_path(jail)));
        }
        st.datasets.remove(&dataset);
        Ok(())
    }

    fn create_volume(&self, volume: &str, quota: Option<u64>) -> Result<PathBuf, ZfsError> {
        self.log.push(format!("zfs.create_volume {volume}"));
        let mut st = lock(&self.state);
        let dataset = self.layout.volume_dataset(volume);
        let path = self.layout.volume_path(volume);
        if self.faults.should_fail("create_volume", volume) {
            return Err(FakeZfs::failed(
                format!("zfs create -p {dataset}"),
                &format!("cannot create '{dataset}': out of space"),
            ));
        }
        if !st.datasets.contains_key(&dataset) {
            let ds = Dataset {
                name: dataset.clone(),
                used: 0,
                quota,
                mountpoint: Some(path.clone()),
            };
            st.add(&dataset, Some(ds));
        }
        Ok(path)
    }

    fn set_volume_quota(&self, volume: &str, quota: Option<u64>) -> Result<(), ZfsError> {
        self.log.push(format!("zfs.set_volume_quota {volume}"));
        let mut st = lock(&self.state);
        let dataset = self.layout.volume_dataset(volume);
        if self.faults.should_fail("set_volume_quota", volume) {
            return Err(FakeZfs::failed(
                format!("zfs set quota {dataset}"),
                "internal error: injected failure",
            ));
        }
        let Some(ds) = st.datasets.get_mut(&dataset) else {
            return Err(ZfsError::NotFound(dataset));
        };
        if let Some(q) = quota.filter(|q| *q < ds.used) {
            return Err(ZfsError::QuotaBelowUsed {
                dataset,
                quota: q,
                used: ds.used,
            });
        }
        ds.quota = quota;
        Ok(())
    }

    fn destroy_volume(&self, volume: &str) -> Result<(), ZfsError> {
        self.log.push(format!("zfs.destroy_volume {volume}"));
        let mut st = lock(&self.state);
        let dataset = self.layout.volume_dataset(volume);
        if !st.datasets.contains_key(&dataset) {
            return Err(ZfsError::NotFound(dataset));
        }
        if self.faults.should_fail("destroy_volume", volume) {
            return Err(FakeZfs::busy(&dataset, &self.layout.volume_path(volume)));
        }
        st.datasets.remove(&dataset);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zfs_list_parses_quota_and_mountpoint_forms() {
        let out = "zroot/keel\t196608\t0\tnone\nzroot/keel/volumes/pg\t98304\t10737418240\t/usr/local/keel/volumes/pg\nzroot/keel/x\t1\t-\tlegacy\n";
        let ds = parse_zfs_list(out).expect("parses");
        assert_eq!(ds.len(), 3);
        assert_eq!(
            (ds[0].used, ds[0].quota, &ds[0].mountpoint),
            (196608, None, &None)
        );
        assert_eq!(ds[1].quota, Some(10 << 30));
        assert_eq!(
            ds[1].mountpoint.as_deref(),
            Some(Path::new("/usr/local/keel/volumes/pg"))
        );
        assert_eq!((ds[2].quota, &ds[2].mountpoint), (None, &None));
    }

    #[test]
    fn zfs_list_refuses_other_formats() {
        // The default table (no -H) separates with spaces.
        assert!(parse_zfs_list("NAME   USED  AVAIL  REFER  MOUNTPOINT\n").is_err());
        assert!(parse_zfs_list("zroot/keel\t12K\t0\tnone\n").is_err());
        assert!(parse_zfs_list("zroot/keel\t1\t0\n").is_err());
    }

    #[test]
    fn not_found_says_how_to_prepare_what_is_missing() {
        let root = ZfsError::NotFound("zroot/keel".into()).to_string();
        assert!(
            root.contains("zfs create -o mountpoint=none zroot/keel"),
            "{root}"
        );
        let base = ZfsError::NotFound("zroot/keel/bases/14.2-RELEASE@keel".into()).to_string();
        assert!(
            base.contains("zfs snapshot zroot/keel/bases/14.2-RELEASE@keel"),
            "{base}"
        );
        assert!(base.contains("`keelctl base fetch 14.2-RELEASE`"), "{base}");
        let vol = ZfsError::NotFound("zroot/keel/volumes/keel".into()).to_string();
        assert_eq!(vol, "dataset zroot/keel/volumes/keel does not exist");
    }

    #[test]
    fn fake_clones_only_prepared_bases_and_is_idempotent() {
        let log = CallLog::new();
        let zfs = FakeZfs::new(log.clone(), Faults::default());
        assert_eq!(
            zfs.clone_rootfs("14.2-RELEASE", "web-1"),
            Err(ZfsError::NotFound(
                "zroot/keel/bases/14.2-RELEASE@keel".into()
            ))
        );
        zfs.add_base("14.2-RELEASE");
        let path = zfs.clone_rootfs("14.2-RELEASE", "web-1").expect("clones");
        assert_eq!(path, PathBuf::from("/usr/local/keel/jails/web-1"));
        assert_eq!(zfs.clone_rootfs("14.2-RELEASE", "web-1"), Ok(path));
        assert!(
            zfs.dataset_exists("zroot/keel/jails/web-1")
                .expect("answers")
        );
        assert!(
            zfs.dataset_exists("zroot/keel/bases/14.2-RELEASE@keel")
                .expect("answers")
        );
        zfs.destroy_rootfs("web-1").expect("destroyed");
        zfs.destroy_rootfs("web-1").expect("absent is fine");
        assert!(
            !zfs.datasets()
                .contains(&"zroot/keel/jails/web-1".to_string())
        );
        assert_eq!(
            log.entries(),
            [
                "zfs.clone_rootfs web-1",
                "zfs.clone_rootfs web-1",
                "zfs.clone_rootfs web-1",
                "zfs.destroy_rootfs web-1",
                "zfs.destroy_rootfs web-1"
            ]
        );
    }

    #[test]
    fn fake_volumes_keep_quota_rules() {
        let zfs = FakeZfs::with_bases(&["14.2-RELEASE"]);
        zfs.create_volume("pg", Some(1000)).expect("created");
        zfs.create_volume("pg", Some(5)).expect("exists is fine");
        let ds = "zroot/keel/volumes/pg";
        assert_eq!(zfs.dataset(ds).and_then(|d| d.quota), Some(1000));
        zfs.set_used(ds, 600);
        assert_eq!(
            zfs.set_volume_quota("pg", Some(500)),
            Err(ZfsError::QuotaBelowUsed {
                dataset: ds.into(),
                quota: 500,
                used: 600
            })
        );
        zfs.set_volume_quota("pg", None).expect("unlimited");
        assert_eq!(zfs.dataset(ds).and_then(|d| d.quota), None);
        assert_eq!(
            zfs.set_volume_quota("nope", None),
            Err(ZfsError::NotFound("zroot/keel/volumes/nope".into()))
        );
        zfs.destroy_volume("pg").expect("destroyed");
        assert_eq!(zfs.destroy_volume("pg"), Err(ZfsError::NotFound(ds.into())));
    }

    #[test]
    fn fake_destroy_faults_are_busy() {
        let faults = Faults::default();
        let zfs = FakeZfs::new(CallLog::new(), faults.clone());
        zfs.add_base("b");
        zfs.clone_rootfs("b", "web-1").expect("clones");
        zfs.create_volume("pg", None).expect("created");
        faults.fail("destroy_rootfs", Some("web-1"));
        faults.fail("destroy_volume", None);
        assert!(matches!(
            zfs.destroy_rootfs("web-1"),
            Err(ZfsError::Busy { .. })
        ));
        assert!(matches!(
            zfs.destroy_volume("pg"),
            Err(ZfsError::Busy { .. })
        ));
        assert!(
            zfs.datasets()
                .contains(&"zroot/keel/jails/web-1".to_string())
        );
        faults.fail("list", None);
        assert!(zfs.list().is_err());
    }

    #[test]
    fn fake_list_holds_the_root_bases_and_what_was_created() {
        let zfs = FakeZfs::with_bases(&["14.2-RELEASE"]);
        zfs.clone_rootfs("14.2-RELEASE", "web-1").expect("clones");
        let names: Vec<String> = zfs
            .list()
            .expect("lists")
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(
            names,
            [
                "zroot/keel",
                "zroot/keel/bases",
                "zroot/keel/bases/14.2-RELEASE",
                "zroot/keel/jails",
                "zroot/keel/jails/web-1"
            ]
        );
    }

    #[test]
    fn fake_list_named_leaves_out_the_absent() {
        let zfs = FakeZfs::with_bases(&["14.2-RELEASE"]);
        zfs.create_volume("data", Some(1 << 30)).expect("volume");
        let names = ["zroot/keel/volumes/data", "zroot/keel/jails/web-1"].map(String::from);
        let listed = zfs.list_named(&names).expect("lists");
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(listed[0].name, "zroot/keel/volumes/data");
        assert_eq!(listed[0].quota, Some(1 << 30));
    }
}
