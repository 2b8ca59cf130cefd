//! The agent's volume routes: `GET /volumes`, `GET /volumes/{name}` and
//! `DELETE /volumes/{name}`, over the ZFS and mount seams.
//!
//! Volumes are keyed only by their dataset path (`{pool}/keel/volumes/{name}`)
//! and what the host reports: one `zfs list` for datasets, quota and use, one
//! `mount -p` for who mounts them. This module never reads the agent's jail
//! records, so what it says and does depends on the host alone: a volume is
//! "mounted by jail X" when a nullfs mount of its directory sits under
//! `{jails_dir}/X`, whatever any spec declares.
//!
//! Must never: destroy a dataset that is mounted (the delete checks the mount
//! table first and answers [`VolumeError::Mounted`]), destroy anything but
//! the one named volume (zfs destroy without `-r`), or create anything.
//! Provisioning and quota changes belong to the reconciler.

use std::fmt;
use std::path::Path;

use crate::common::wire::VolumeStatus;
use crate::host::mount::MountEntry;
use crate::host::zfs::{ZfsError, ZfsLayout};
use crate::host::{MountManager, ZfsManager};

/// Why a volume request failed.
#[derive(Debug, Clone, PartialEq)]
pub enum VolumeError {
    /// No such volume dataset on this node (HTTP 404).
    NotFound {
        /// The volume.
        volume: String,
        /// Its dataset.
        dataset: String,
    },
    /// Still nullfs-mounted into a jail (HTTP 409); nothing was destroyed.
    Mounted {
        /// The volume.
        volume: String,
        /// The jail (or mount point) holding it.
        by: String,
    },
    /// zfs kept refusing the destroy as busy through every retry (HTTP 409).
    Busy(ZfsError),
    /// zfs or mount failed otherwise (HTTP 500, with the command and stderr).
    Host(String),
}

impl VolumeError {
    /// The HTTP status of this error (keel-agentd(8), API, lists the codes).
    pub fn status(&self) -> u16 {
        match self {
            VolumeError::NotFound { .. } => 404,
            VolumeError::Mounted { .. } | VolumeError::Busy(_) => 409,
            VolumeError::Host(_) => 500,
        }
    }
}

impl fmt::Display for VolumeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VolumeError::NotFound { volume, dataset } => {
                write!(
                    f,
                    "no volume named {volume} on this node ({dataset} does not exist)"
                )
            }
            VolumeError::Mounted { volume, by } => write!(
                f,
                "volume {volume} is mounted by jail {by}; delete that jail first"
            ),
            VolumeError::Busy(e) => write!(f, "volume was not destroyed: {e}"),
            VolumeError::Host(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for VolumeError {}

/// Every volume dataset on this node, by name.
pub fn list<Z: ZfsManager, M: MountManager>(
    zfs: &Z,
    mounts: &M,
) -> Result<Vec<VolumeStatus>, VolumeError> {
    let layout = zfs.layout();
    let prefix = layout.volume_dataset("");
    let datasets = zfs.list().map_err(|e| VolumeError::Host(e.to_string()))?;
    let mounted = mounts
        .list()
        .map_err(|e| VolumeError::Host(e.to_string()))?;
    let mut out: Vec<VolumeStatus> = datasets
        .into_iter()
        .filter_map(|d| {
            let name = d.name.strip_prefix(&prefix)?;
            // Only direct children: a volume's own children are not volumes.
            if name.is_empty() || name.contains('/') {
                return None;
            }
            Some(VolumeStatus {
                name: name.to_string(),
                dataset: Some(d.name.clone()),
                node: None,
                quota: d.quota,
                used: Some(d.used),
                mounted_by: mounted_by(layout, name, &mounted),
                error: None,
                unreachable: false,
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// One volume; [`VolumeError::NotFound`] when its dataset does not exist.
pub fn get<Z: ZfsManager, M: MountManager>(
    zfs: &Z,
    mounts: &M,
    volume: &str,
) -> Result<VolumeStatus, VolumeError> {
    list(zfs, mounts)?
        .into_iter()
        .find(|v| v.name == volume)
        .ok_or_else(|| VolumeError::NotFound {
            volume: volume.to_string(),
            dataset: zfs.layout().volume_dataset(volume),
        })
}

/// Destroys a volume that exists and nothing mounts; see the module docs.
pub fn delete<Z: ZfsManager, M: MountManager>(
    zfs: &Z,
    mounts: &M,
    volume: &str,
) -> Result<(), VolumeError> {
    let status = get(zfs, mounts, volume)?;
    if let Some(by) = status.mounted_by {
        return Err(VolumeError::Mounted {
            volume: volume.to_string(),
            by,
        });
    }
    match zfs.destroy_volume(volume) {
        Ok(()) => Ok(()),
        Err(ZfsError::NotFound(dataset)) => Err(VolumeError::NotFound {
            volume: volume.to_string(),
            dataset,
        }),
        Err(e @ ZfsError::Busy { .. }) => Err(VolumeError::Busy(e)),
        Err(e) => Err(VolumeError::Host(e.to_string())),
    }
}

/// Who mounts `volume`: the jail whose root holds a nullfs mount of the
/// volume's directory, or the mount point itself when it is outside every
/// Keel jail root.
fn mounted_by(layout: &ZfsLayout, volume: &str, mounted: &[MountEntry]) -> Option<String> {
    let source = layout.volume_path(volume);
    let entry = mounted.iter().find(|m| m.source == source)?;
    Some(jail_of(&layout.jails_dir, &entry.target))
}

fn jail_of(jails_dir: &Path, target: &Path) -> String {
    target
        .strip_prefix(jails_dir)
        .ok()
        .and_then(|rest| rest.components().next())
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .unwrap_or_else(|| target.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::{CallLog, Faults};
    use crate::host::mount::FakeMounts;
    use crate::host::zfs::FakeZfs;

    #[test]
    fn the_jail_is_the_first_component_under_the_jails_dir() {
        let dir = Path::new("/usr/local/keel/jails");
        assert_eq!(
            jail_of(dir, Path::new("/usr/local/keel/jails/db-0/var/db")),
            "db-0"
        );
        assert_eq!(jail_of(dir, Path::new("/mnt/elsewhere")), "/mnt/elsewhere");
    }

    #[test]
    fn only_direct_children_of_the_volumes_dataset_are_volumes() {
        let zfs = FakeZfs::new(CallLog::new(), Faults::default());
        let mounts = FakeMounts::new(CallLog::new(), Faults::default());
        zfs.create_volume("pg", Some(4096)).expect("created");
        zfs.add_base("14.2-RELEASE");
        let names: Vec<String> = list(&zfs, &mounts)
            .expect("lists")
            .into_iter()
            .map(|v| v.name)
            .collect();
        assert_eq!(names, ["pg"]);
    }
}
