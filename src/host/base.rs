//! Base datasets: the FreeBSD releases every jail rootfs is cloned from.
//!
//! A base is the dataset `{pool}/keel/bases/{release}`, mounted at
//! `{bases_dir}/{release}`, holding an extracted `base.txz`, and its
//! snapshot `@keel`, which [`crate::host::zfs::ZfsManager::clone_rootfs`]
//! clones. This module owns the four host steps of `keelctl base fetch`:
//! create the dataset, extract a tarball into it, snapshot it, and destroy
//! a dataset whose extraction never finished; plus one listing of every base.
//! Downloading and verifying the tarball is `agentd::bases`' business.
//!
//! The one rule it keeps: a `@keel` snapshot exists only on a base whose
//! extraction finished. The snapshot is the last step, and
//! [`BaseStore::destroy_partial`] destroys without `-r`, so zfs(8) itself
//! refuses to take a base that already has its snapshot (and with it the
//! clones of running jails).
//!
//! Implementations: [`FreeBsdBases`] over zfs(8) and tar(1) (bsdtar),
//! [`FakeBases`] in memory, and `host::sim::SimBases` over directories.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::cmd::{CmdError, CmdOutput, CommandRunner};
use crate::common::config::CommandPaths;
use crate::host::fake::{CallLog, Faults, lock};
use crate::host::zfs::ZFS_TIMEOUT;

/// How long extracting one `base.txz` may take: about 200 MB of xz on a
/// slow disk takes minutes, and a stuck tar must still end.
pub const EXTRACT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The snapshot every jail clone starts from.
pub const BASE_SNAPSHOT: &str = "keel";

/// Where bases live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseLayout {
    /// The pool (e.g. `zroot`).
    pub pool: String,
    /// Parent directory of base mountpoints.
    pub bases_dir: PathBuf,
}

impl BaseLayout {
    /// `{pool}/keel/bases`
    pub fn root(&self) -> String {
        format!("{}/keel/bases", self.pool)
    }
    /// `{pool}/keel/bases/{release}`
    pub fn dataset(&self, release: &str) -> String {
        format!("{}/{release}", self.root())
    }
    /// `{pool}/keel/bases/{release}@keel`
    pub fn snapshot(&self, release: &str) -> String {
        format!("{}@{BASE_SNAPSHOT}", self.dataset(release))
    }
    /// `{bases_dir}/{release}`
    pub fn path(&self, release: &str) -> PathBuf {
        self.bases_dir.join(release)
    }
}

/// One base as the host shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseDataset {
    /// The release (the dataset's last component).
    pub release: String,
    /// Bytes used by the dataset.
    pub used: u64,
    /// True when `@keel` exists: the base is complete and jails can use it.
    pub snapshot: bool,
    /// Where it is mounted; `None` for `none`/`legacy`/`-`.
    pub mountpoint: Option<PathBuf>,
}

/// A base operation that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BaseError {
    /// A command failed or could not run.
    Command(CmdError),
    /// `zfs list` output that does not match the documented format.
    Parse(String),
    /// A simulated step failed on the local filesystem.
    Io {
        /// What was being done.
        action: String,
        /// The path it was done to.
        path: PathBuf,
        /// The operating system's reason.
        reason: String,
    },
}

impl fmt::Display for BaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BaseError::Command(e) => write!(f, "{e}"),
            BaseError::Parse(why) => write!(f, "could not read `zfs list` output: {why}"),
            BaseError::Io {
                action,
                path,
                reason,
            } => write!(f, "could not {action} {}: {reason}", path.display()),
        }
    }
}

impl std::error::Error for BaseError {}

impl From<CmdError> for BaseError {
    fn from(e: CmdError) -> Self {
        BaseError::Command(e)
    }
}

/// The host steps of a base fetch. Every release handed in was checked by
/// `common::spec::validate_base`.
pub trait BaseStore: Send + Sync {
    /// Where bases live.
    fn layout(&self) -> &BaseLayout;
    /// Every base under `{pool}/keel/bases`, in one call; none when the
    /// parent dataset does not exist yet.
    fn list(&self) -> Result<Vec<BaseDataset>, BaseError>;
    /// Creates the release's dataset (and `{pool}/keel/bases` on first use);
    /// returns its mountpoint. An existing dataset is success.
    fn create(&self, release: &str) -> Result<PathBuf, BaseError>;
    /// Extracts `tarball` into the release's mountpoint, keeping modes,
    /// owners and file flags.
    fn extract(&self, release: &str, tarball: &Path) -> Result<(), BaseError>;
    /// Takes `@keel`: from now on jails can be cloned from it.
    fn snapshot(&self, release: &str) -> Result<(), BaseError>;
    /// Destroys a dataset whose extraction did not finish; absent is success.
    /// Refused by the host when the dataset has its snapshot.
    fn destroy_partial(&self, release: &str) -> Result<(), BaseError>;
}

/// [`BaseStore`] on FreeBSD over zfs(8) and tar(1).
#[derive(Debug)]
pub struct FreeBsdBases<R: CommandRunner> {
    runner: R,
    paths: CommandPaths,
    layout: BaseLayout,
}

impl<R: CommandRunner> FreeBsdBases<R> {
    /// Runs zfs(8) and tar(1) through `runner` in `layout`.
    pub fn new(runner: R, paths: CommandPaths, layout: BaseLayout) -> Self {
        FreeBsdBases {
            runner,
            paths,
            layout,
        }
    }

    fn zfs(&self, args: &[&str]) -> Result<CmdOutput, BaseError> {
        let mut argv = vec![self.paths.zfs.to_string_lossy().into_owned()];
        argv.extend(args.iter().map(|a| a.to_string()));
        Ok(self.runner.run(&argv, None, ZFS_TIMEOUT)?.check(&argv)?)
    }
}

const MISSING: &str = "dataset does not exist";

fn missing(e: &BaseError) -> bool {
    matches!(e, BaseError::Command(CmdError::Failed { stderr, .. }) if stderr.contains(MISSING))
}

/// The argv that extracts `tarball` into `dir`: bsdtar detects xz itself,
/// `-p` keeps modes, ACLs and file flags (the default for root, said
/// anyway), `-C` extracts into the base's mountpoint.
pub fn extract_argv(tar: &Path, dir: &Path, tarball: &Path) -> Vec<String> {
    vec![
        tar.to_string_lossy().into_owned(),
        "-C".into(),
        dir.to_string_lossy().into_owned(),
        "-xpf".into(),
        tarball.to_string_lossy().into_owned(),
    ]
}

impl<R: CommandRunner> BaseStore for FreeBsdBases<R> {
    fn layout(&self) -> &BaseLayout {
        &self.layout
    }

    fn list(&self) -> Result<Vec<BaseDataset>, BaseError> {
        let root = self.layout.root();
        let listed = self.zfs(&[
            "list",
            "-H",
            "-p",
            "-o",
            "name,used,mountpoint",
            "-t",
            "filesystem,snapshot",
            "-r",
            &root,
        ]);
        match listed {
            Ok(out) => parse_base_list(&root, &out.stdout).map_err(BaseError::Parse),
            Err(e) if missing(&e) => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    fn create(&self, release: &str) -> Result<PathBuf, BaseError> {
        let path = self.layout.path(release);
        let mountpoint = format!("mountpoint={}", path.display());
        // -p: creates {pool}/keel/bases on first use, exits 0 when it exists.
        self.zfs(&[
            "create",
            "-p",
            "-o",
            &mountpoint,
            &self.layout.dataset(release),
        ])?;
        Ok(path)
    }

    fn extract(&self, release: &str, tarball: &Path) -> Result<(), BaseError> {
        let argv = extract_argv(&self.paths.tar, &self.layout.path(release), tarball);
        self.runner
            .run(&argv, None, EXTRACT_TIMEOUT)?
            .check(&argv)?;
        Ok(())
    }

    fn snapshot(&self, release: &str) -> Result<(), BaseError> {
        self.zfs(&["snapshot", &self.layout.snapshot(release)])
            .map(drop)
    }

    fn destroy_partial(&self, release: &str) -> Result<(), BaseError> {
        match self.zfs(&["destroy", &self.layout.dataset(release)]) {
            Ok(_) => Ok(()),
            Err(e) if missing(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Parses `zfs list -H -p -o name,used,mountpoint -t filesystem,snapshot -r
/// ROOT`: one dataset or snapshot per line, TAB-separated, bytes exact.
/// Only `ROOT/{release}` and `ROOT/{release}@keel` count; the root itself,
/// deeper datasets and other snapshots are not bases.
pub fn parse_base_list(root: &str, stdout: &str) -> Result<Vec<BaseDataset>, String> {
    let mut bases: BTreeMap<String, BaseDataset> = BTreeMap::new();
    let mut snapshots = Vec::new();
    let prefix = format!("{root}/");
    for line in stdout.lines().filter(|l| !l.is_empty()) {
        let fields: Vec<&str> = line.split('\t').collect();
        let [name, used, mountpoint] = fields[..] else {
            return Err(format!(
                "`{line}` has {} TAB-separated fields, expected name, used, mountpoint",
                fields.len()
            ));
        };
        let Some(leaf) = name.strip_prefix(&prefix) else {
            continue;
        };
        if let Some((release, snap)) = leaf.split_once('@') {
            if snap == BASE_SNAPSHOT && !release.contains('/') {
                snapshots.push(release.to_string());
            }
            continue;
        }
        if leaf.contains('/') {
            continue;
        }
        let used = used
            .parse::<u64>()
            .map_err(|_| format!("`{line}`: used `{used}` is not a number of bytes"))?;
        let mountpoint = match mountpoint {
            "none" | "legacy" | "-" | "" => None,
            m => Some(PathBuf::from(m)),
        };
        bases.insert(
            leaf.to_string(),
            BaseDataset {
                release: leaf.to_string(),
                used,
                snapshot: false,
                mountpoint,
            },
        );
    }
    for release in snapshots {
        if let Some(base) = bases.get_mut(&release) {
            base.snapshot = true;
        }
    }
    Ok(bases.into_values().collect())
}

/// In-memory [`BaseStore`] for tests. Every call is logged
/// (`"base.create 14.3-RELEASE"`, `"base.extract 14.3-RELEASE"`,
/// `"base.snapshot …"`, `"base.destroy_partial …"`); [`Faults`] use the
/// method names as operations and the release as target. An extraction
/// records the tarball's size as the base's `used`.
#[derive(Debug, Clone)]
pub struct FakeBases {
    layout: BaseLayout,
    table: Arc<Mutex<BTreeMap<String, BaseDataset>>>,
    log: CallLog,
    faults: Faults,
}

impl FakeBases {
    /// No bases, pool `zroot`, mounted under `/usr/local/jails/keel-bases`.
    pub fn new(log: CallLog, faults: Faults) -> FakeBases {
        FakeBases {
            layout: BaseLayout {
                pool: "zroot".into(),
                bases_dir: "/usr/local/jails/keel-bases".into(),
            },
            table: Arc::default(),
            log,
            faults,
        }
    }

    /// Adds a base as a host that has it would list it.
    pub fn insert(&self, base: BaseDataset) {
        lock(&self.table).insert(base.release.clone(), base);
    }

    fn step(&self, op: &str, release: &str) -> Result<(), BaseError> {
        self.log.push(format!("base.{op} {release}"));
        if self.faults.should_fail(op, release) {
            return Err(BaseError::Command(CmdError::Failed {
                command: format!("fake base.{op} {release}"),
                status: 1,
                stderr: "injected failure".into(),
            }));
        }
        Ok(())
    }
}

impl BaseStore for FakeBases {
    fn layout(&self) -> &BaseLayout {
        &self.layout
    }

    fn list(&self) -> Result<Vec<BaseDataset>, BaseError> {
        if self.faults.should_fail("list", "bases") {
            return Err(BaseError::Parse("injected failure".into()));
        }
        Ok(lock(&self.table).values().cloned().collect())
    }

    fn create(&self, release: &str) -> Result<PathBuf, BaseError> {
        self.step("create", release)?;
        let path = self.layout.path(release);
        lock(&self.table)
            .entry(release.to_string())
            .or_insert_with(|| BaseDataset {
                release: release.to_string(),
                used: 0,
                snapshot: false,
                mountpoint: Some(path.clone()),
            });
        Ok(path)
    }

    fn extract(&self, release: &str, tarball: &Path) -> Result<(), BaseError> {
        self.step("extract", release)?;
        let size = std::fs::metadata(tarball).map(|m| m.len()).unwrap_or(0);
        if let Some(base) = lock(&self.table).get_mut(release) {
            base.used = size;
        }
        Ok(())
    }

    fn snapshot(&self, release: &str) -> Result<(), BaseError> {
        self.step("snapshot", release)?;
        if let Some(base) = lock(&self.table).get_mut(release) {
            base.snapshot = true;
        }
        Ok(())
    }

    fn destroy_partial(&self, release: &str) -> Result<(), BaseError> {
        self.step("destroy_partial", release)?;
        let mut table = lock(&self.table);
        if table.get(release).is_some_and(|b| b.snapshot) {
            return Err(BaseError::Command(CmdError::Failed {
                command: format!("fake zfs destroy {}", self.layout.dataset(release)),
                status: 1,
                stderr: "filesystem has children".into(),
            }));
        }
        table.remove(release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_direct_children_and_their_keel_snapshot_are_bases() {
        let root = "zroot/keel/bases";
        let out = "zroot/keel/bases\t1000\t-\n\
                   zroot/keel/bases/14.3-RELEASE\t900\t/b/14.3-RELEASE\n\
                   zroot/keel/bases/14.3-RELEASE@keel\t0\t-\n\
                   zroot/keel/bases/14.3-RELEASE@other\t0\t-\n\
                   zroot/keel/bases/15.0-RELEASE\t100\t/b/15.0-RELEASE\n\
                   zroot/keel/bases/15.0-RELEASE/child\t10\t/b/x\n";
        let bases = parse_base_list(root, out).expect("parses");
        assert_eq!(
            bases,
            [
                BaseDataset {
                    release: "14.3-RELEASE".into(),
                    used: 900,
                    snapshot: true,
                    mountpoint: Some("/b/14.3-RELEASE".into()),
                },
                BaseDataset {
                    release: "15.0-RELEASE".into(),
                    used: 100,
                    snapshot: false,
                    mountpoint: Some("/b/15.0-RELEASE".into()),
                },
            ]
        );
    }

    #[test]
    fn malformed_lines_are_refused_with_the_line() {
        let err = parse_base_list("zroot/keel/bases", "zroot/keel/bases/x 12\n").expect_err("bad");
        assert!(err.contains("zroot/keel/bases/x 12"), "{err}");
        let err = parse_base_list("zroot/keel/bases", "zroot/keel/bases/x\tmany\t-\n")
            .expect_err("bad number");
        assert!(err.contains("many"), "{err}");
    }

    #[test]
    fn the_fake_refuses_to_destroy_a_snapshotted_base() {
        let bases = FakeBases::new(CallLog::new(), Faults::default());
        bases.create("14.3-RELEASE").expect("create");
        bases.snapshot("14.3-RELEASE").expect("snapshot");
        assert!(bases.destroy_partial("14.3-RELEASE").is_err());
        assert_eq!(bases.list().expect("list").len(), 1);
    }
}
