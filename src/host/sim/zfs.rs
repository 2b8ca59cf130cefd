//! Simulated ZFS: a dataset is a directory. Rootfs datasets are
//! `{jails_dir}/{jail}`, volumes `{volumes_dir}/{volume}`; quotas are
//! recorded (not enforced) in `{volumes_dir}/.keel-quotas.json`, and `used` is
//! the sum of the regular files' sizes below the directory.
//!
//! There are no base images in simulate mode: a clone is an empty directory
//! (workloads run host binaries), and the base snapshot of every FreeBSD
//! release name "exists" ([`is_release_name`]). A base that names no
//! release (a typo, `99.9-NOPE`) is refused as FreeBSD refuses a base
//! never fetched: [`ZfsError::NotFound`] naming its snapshot.
//!
//! This file never deletes through a symlink and never destroys a directory
//! that a registered simulated mount still points into or out of: that is how
//! a volume's data survives the destruction of the rootfs it was mounted in.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::mounts::MountTable;
use super::{SimError, SimMounts, create_dir, is_plain_name, read_state, write_state};
use crate::common::cmd::CmdError;
use crate::host::fake::lock;
use crate::host::zfs::{Dataset, ZfsError, ZfsLayout, ZfsManager};

const QUOTA_FILE: &str = ".keel-quotas.json";

/// [`ZfsManager`] over directories.
#[derive(Debug)]
pub struct SimZfs {
    layout: ZfsLayout,
    mounts: Arc<Mutex<MountTable>>,
    quota_file: PathBuf,
    quotas: Mutex<BTreeMap<String, u64>>,
}

impl SimZfs {
    /// Opens the datasets under `layout`'s directories (created if missing);
    /// `mounts` is consulted before anything is destroyed.
    pub fn new(layout: ZfsLayout, mounts: &SimMounts) -> Result<SimZfs, SimError> {
        create_dir(&layout.jails_dir)?;
        create_dir(&layout.volumes_dir)?;
        let quota_file = layout.volumes_dir.join(QUOTA_FILE);
        let quotas = read_state(&quota_file)?;
        Ok(SimZfs {
            layout,
            mounts: mounts.table(),
            quota_file,
            quotas: Mutex::new(quotas),
        })
    }

    fn set_quota(&self, volume: &str, quota: Option<u64>) -> Result<(), ZfsError> {
        let mut quotas = lock(&self.quotas);
        let before = quotas.clone();
        match quota {
            Some(q) => quotas.insert(volume.to_string(), q),
            None => quotas.remove(volume),
        };
        if let Err(e) = write_state(&self.quota_file, &*quotas) {
            *quotas = before;
            return Err(failed(
                &format!("zfs set quota {volume}"),
                format!("could not write {}: {e}", self.quota_file.display()),
            ));
        }
        Ok(())
    }

    /// `{jails_dir}/{name}` or `{volumes_dir}/{name}` for a plain name.
    fn dataset_path(&self, dir: &Path, name: &str, dataset: &str) -> Result<PathBuf, ZfsError> {
        if is_plain_name(name) {
            Ok(dir.join(name))
        } else {
            Err(failed(
                &format!("zfs {dataset}"),
                format!("invalid dataset name {dataset:?}"),
            ))
        }
    }

    fn datasets_in(
        &self,
        dir: &Path,
        name: impl Fn(&str) -> String,
        quotas: &BTreeMap<String, u64>,
    ) -> Result<Vec<Dataset>, ZfsError> {
        let entries = std::fs::read_dir(dir)
            .map_err(|e| failed("zfs list", format!("could not read {}: {e}", dir.display())))?;
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let Some(leaf) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            // Dot files are our own sidecars; symlinks and files are not datasets.
            if leaf.starts_with('.') || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let path = entry.path();
            out.push(Dataset {
                name: name(&leaf),
                used: used_bytes(&path),
                quota: quotas.get(&leaf).copied(),
                mountpoint: Some(path),
            });
        }
        Ok(out)
    }
}

/// A simulated command that did not succeed, named after the zfs(8) command
/// it stands for.
fn failed(what: &str, why: String) -> ZfsError {
    ZfsError::Command(CmdError::Failed {
        command: format!("simulated {what}"),
        status: 1,
        stderr: why,
    })
}

fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// True when the dataset's directory is already there (creating it again is
/// success, as `zfs clone -p` and `zfs create -p` make it); anything but a
/// plain directory in its place (a link, a file) is refused, never used.
fn already_created(path: &Path, dataset: &str, what: &str) -> Result<bool, ZfsError> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => Ok(true),
        Ok(_) => Err(failed(
            what,
            format!(
                "cannot create '{dataset}': {} exists and is not a directory",
                path.display()
            ),
        )),
        Err(_) => Ok(false),
    }
}

/// Sum of the sizes of the regular files below `dir`, without following
/// symlinks (a volume linked into a rootfs counts for the volume only).
/// Entries that vanish or cannot be read while walking are skipped: sizes are
/// advisory in simulate mode and a workload may be writing as we count.
pub(super) fn used_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(meta) = std::fs::symlink_metadata(entry.path()) else {
                continue;
            };
            if meta.is_dir() {
                pending.push(entry.path());
            } else if meta.is_file() {
                total += meta.len();
            }
        }
    }
    total
}

/// Removes `path` without following symlinks: a link is unlinked, a
/// directory is removed with everything in it. std's `remove_dir_all` unlinks
/// symlinks it meets rather than descending into them (tested in
/// tests/sim.rs with a volume linked into a rootfs).
pub(super) fn remove_tree(path: &Path) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(path)?;
    if meta.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
}

impl ZfsManager for SimZfs {
    fn layout(&self) -> &ZfsLayout {
        &self.layout
    }

    /// Rootfs and volume datasets (not their parents), sorted by name.
    fn list(&self) -> Result<Vec<Dataset>, ZfsError> {
        let quotas = lock(&self.quotas).clone();
        let mut out = self.datasets_in(
            &self.layout.jails_dir,
            |j| self.layout.rootfs_dataset(j),
            &BTreeMap::new(),
        )?;
        out.extend(self.datasets_in(
            &self.layout.volumes_dir,
            |v| self.layout.volume_dataset(v),
            &quotas,
        )?);
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// The rootfs and volume datasets among `names` whose directory is
    /// there, as [`SimZfs::list`] shows them; anything else is absent.
    fn list_named(&self, names: &[String]) -> Result<Vec<Dataset>, ZfsError> {
        let jails = self.layout.rootfs_dataset("");
        let volumes = self.layout.volume_dataset("");
        let quotas = lock(&self.quotas).clone();
        let mut out = Vec::new();
        for name in names {
            let (path, quota) = if let Some(jail) = name.strip_prefix(&jails) {
                (
                    is_plain_name(jail).then(|| self.layout.rootfs_path(jail)),
                    None,
                )
            } else if let Some(volume) = name.strip_prefix(&volumes) {
                (
                    is_plain_name(volume).then(|| self.layout.volume_path(volume)),
                    quotas.get(volume).copied(),
                )
            } else {
                (None, None)
            };
            // A link or a file in a dataset's place is no dataset, as in `list`.
            let Some(path) =
                path.filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()))
            else {
                continue;
            };
            out.push(Dataset {
                name: name.clone(),
                used: used_bytes(&path),
                quota,
                mountpoint: Some(path),
            });
        }
        Ok(out)
    }

    /// The pool, `{pool}/keel`, its three parents and every base snapshot
    /// exist; rootfs and volume datasets exist while their directory does.
    fn dataset_exists(&self, dataset: &str) -> Result<bool, ZfsError> {
        let pool = &self.layout.pool;
        if dataset == pool.as_str() {
            return Ok(true);
        }
        let Some(rest) = dataset
            .strip_prefix(pool.as_str())
            .and_then(|r| r.strip_prefix("/keel"))
        else {
            return Ok(false);
        };
        let found = match rest {
            "" | "/bases" | "/jails" | "/volumes" => true,
            _ => {
                if let Some(base) = rest.strip_prefix("/bases/") {
                    is_plain_name(base.strip_suffix("@keel").unwrap_or(base))
                } else if let Some(jail) = rest.strip_prefix("/jails/") {
                    is_plain_name(jail) && self.layout.rootfs_path(jail).is_dir()
                } else if let Some(volume) = rest.strip_prefix("/volumes/") {
                    is_plain_name(volume) && self.layout.volume_path(volume).is_dir()
                } else {
                    false
                }
            }
        };
        Ok(found)
    }

    /// Creates an empty `{jails_dir}/{jail}`; `base` must name a FreeBSD
    /// release (see the module docs). An existing rootfs is success, as with
    /// `zfs clone -p`.
    fn clone_rootfs(&self, base: &str, jail: &str) -> Result<PathBuf, ZfsError> {
        crate::common::faults::inject("sim.zfs.clone");
        if !is_release_name(base) {
            return Err(ZfsError::NotFound(self.layout.base_snapshot(base)));
        }
        let dataset = self.layout.rootfs_dataset(jail);
        let path = self.dataset_path(&self.layout.jails_dir, jail, &dataset)?;
        let what = format!("zfs clone {} {dataset}", self.layout.base_snapshot(base));
        if already_created(&path, &dataset, &what)? {
            return Ok(path);
        }
        std::fs::create_dir_all(&path)
            .map_err(|e| failed(&what, format!("could not create {}: {e}", path.display())))?;
        Ok(path)
    }

    /// Removes `{jails_dir}/{jail}`; [`ZfsError::Busy`] while a registered
    /// simulated mount still has its target (or source) inside it.
    fn destroy_rootfs(&self, jail: &str) -> Result<(), ZfsError> {
        let dataset = self.layout.rootfs_dataset(jail);
        let path = self.dataset_path(&self.layout.jails_dir, jail, &dataset)?;
        if !exists(&path) {
            return Ok(());
        }
        // Held while removing, so nothing can be mounted in between.
        let mounts = lock(&self.mounts);
        let inside = mounts
            .target_under(&path)
            .or_else(|| mounts.source_under(&path));
        if let Some(m) = inside {
            return Err(ZfsError::Busy {
                dataset,
                attempts: 1,
                stderr: format!(
                    "{} is still mounted at {}; unmount it first",
                    m.source.display(),
                    m.target.display()
                ),
            });
        }
        remove_tree(&path).map_err(|e| {
            failed(
                &format!("zfs destroy {dataset}"),
                format!("could not remove {}: {e}", path.display()),
            )
        })
    }

    /// Creates `{volumes_dir}/{volume}` and records its quota. An existing
    /// volume is success and keeps its quota, as with `zfs create -p`.
    fn create_volume(&self, volume: &str, quota: Option<u64>) -> Result<PathBuf, ZfsError> {
        let dataset = self.layout.volume_dataset(volume);
        let path = self.dataset_path(&self.layout.volumes_dir, volume, &dataset)?;
        let what = format!("zfs create {dataset}");
        if already_created(&path, &dataset, &what)? {
            return Ok(path);
        }
        std::fs::create_dir_all(&path)
            .map_err(|e| failed(&what, format!("could not create {}: {e}", path.display())))?;
        self.set_quota(volume, quota)?;
        Ok(path)
    }

    /// Records the new quota; one below what the volume uses is refused, as
    /// `zfs set quota` refuses it.
    fn set_volume_quota(&self, volume: &str, quota: Option<u64>) -> Result<(), ZfsError> {
        let dataset = self.layout.volume_dataset(volume);
        let path = self.dataset_path(&self.layout.volumes_dir, volume, &dataset)?;
        if !path.is_dir() {
            return Err(ZfsError::NotFound(dataset));
        }
        if let Some(q) = quota {
            let used = used_bytes(&path);
            if q < used {
                return Err(ZfsError::QuotaBelowUsed {
                    dataset,
                    quota: q,
                    used,
                });
            }
        }
        self.set_quota(volume, quota)
    }

    /// Removes the volume's directory; [`ZfsError::Busy`] while a simulated
    /// mount of it is registered, [`ZfsError::NotFound`] when absent.
    fn destroy_volume(&self, volume: &str) -> Result<(), ZfsError> {
        let dataset = self.layout.volume_dataset(volume);
        let path = self.dataset_path(&self.layout.volumes_dir, volume, &dataset)?;
        if !exists(&path) {
            return Err(ZfsError::NotFound(dataset));
        }
        let mounts = lock(&self.mounts);
        if let Some(m) = mounts.source_under(&path) {
            return Err(ZfsError::Busy {
                dataset,
                attempts: 1,
                stderr: format!("still mounted at {}; unmount it first", m.target.display()),
            });
        }
        remove_tree(&path).map_err(|e| {
            failed(
                &format!("zfs destroy {dataset}"),
                format!("could not remove {}: {e}", path.display()),
            )
        })?;
        drop(mounts);
        self.set_quota(volume, None)
    }
}

/// True for a base named after a FreeBSD release: `MAJOR.MINOR-` then
/// `RELEASE`, `STABLE`, `CURRENT`, `ALPHAn`, `BETAn` or `RCn`, optionally
/// followed by `-` and anything (a patch level `-p3`, or a base Keel
/// derives from the release, such as the ingress jail's `-nginx`).
pub fn is_release_name(base: &str) -> bool {
    let Some((version, rest)) = base.split_once('-') else {
        return false;
    };
    let numbered = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let version_ok = version
        .split_once('.')
        .is_some_and(|(major, minor)| numbered(major) && numbered(minor));
    let branch = rest.split_once('-').map_or(rest, |(branch, _)| branch);
    let branch_ok = matches!(branch, "RELEASE" | "STABLE" | "CURRENT")
        || ["ALPHA", "BETA", "RC"]
            .iter()
            .any(|p| branch.strip_prefix(p).is_some_and(numbered));
    version_ok && branch_ok
}

#[cfg(test)]
mod release_name_tests {
    use super::is_release_name;

    #[test]
    fn release_names_are_recognised_and_typos_are_not() {
        for good in [
            "14.2-RELEASE",
            "13.4-RELEASE-p3",
            "15.0-CURRENT",
            "14.3-STABLE",
            "15.0-BETA2",
            "14.2-RC1",
            "14.5-RELEASE-nginx",
        ] {
            assert!(is_release_name(good), "{good}");
        }
        for bad in [
            "99.9-NOPE",
            "14.2",
            "14-RELEASE",
            "14.2-release",
            "14.2-RC",
            "14.2-NOPE-RELEASE",
            "base",
        ] {
            assert!(!is_release_name(bad), "{bad}");
        }
    }
}
