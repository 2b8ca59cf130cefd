//! Simulated nullfs: a mount is a symlink at the target pointing to the
//! source, registered in `{state_dir}/sim-mounts.json` so a restarted agent
//! knows its mounts and [`super::SimZfs`] can refuse to destroy what is still
//! mounted.
//!
//! This file creates and removes symlinks only. It never removes a directory
//! with anything in it and never deletes through a link: unmounting leaves the
//! source's data exactly as it was.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::{SimError, create_dir, read_state, write_state};
use crate::common::cmd::CmdError;
use crate::host::fake::{Faults, lock};
use crate::host::mount::{MountEntry, MountError, MountManager, check_mount_point};

const STATE_FILE: &str = "sim-mounts.json";

/// One simulated mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct SimMount {
    pub source: PathBuf,
    pub target: PathBuf,
}

/// The mount table, shared with [`super::SimZfs`].
#[derive(Debug)]
pub(super) struct MountTable {
    file: PathBuf,
    mounts: Vec<SimMount>,
}

impl MountTable {
    /// The first mount whose target is `dir` or lies below it.
    pub fn target_under(&self, dir: &Path) -> Option<&SimMount> {
        self.mounts.iter().find(|m| m.target.starts_with(dir))
    }

    /// The first mount whose source is `dir` or lies below it.
    pub fn source_under(&self, dir: &Path) -> Option<&SimMount> {
        self.mounts.iter().find(|m| m.source.starts_with(dir))
    }

    fn save(&self) -> std::io::Result<()> {
        write_state(&self.file, &self.mounts)
    }
}

/// [`MountManager`] over symlinks. A cheap `Clone` handle over shared state.
///
/// Busy is never reported unless injected: `faults().fail("unmount", ..)`
/// with the target's path (or `None` for any) makes `unmount` report
/// [`MountError::Busy`].
#[derive(Debug, Clone)]
pub struct SimMounts {
    table: Arc<Mutex<MountTable>>,
    faults: Faults,
}

impl SimMounts {
    /// Opens the mount table in `state_dir` (created if missing).
    pub fn new(state_dir: &Path) -> Result<SimMounts, SimError> {
        create_dir(state_dir)?;
        let file = state_dir.join(STATE_FILE);
        let mounts = read_state(&file)?;
        Ok(SimMounts {
            table: Arc::new(Mutex::new(MountTable { file, mounts })),
            faults: Faults::default(),
        })
    }

    /// Failure injection (see the type's docs).
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    pub(super) fn table(&self) -> Arc<Mutex<MountTable>> {
        Arc::clone(&self.table)
    }
}

/// True when `target` is a symlink to exactly `source`.
fn links_to(target: &Path, source: &Path) -> bool {
    std::fs::read_link(target).is_ok_and(|t| t == source)
}

fn mount_failed(source: &Path, target: &Path, why: String) -> MountError {
    MountError::Command(CmdError::Failed {
        command: format!(
            "simulated mount -t nullfs {} {}",
            source.display(),
            target.display()
        ),
        status: 1,
        stderr: why,
    })
}

impl MountManager for SimMounts {
    /// The registered mounts whose symlink is still in place; a link removed
    /// behind the agent's back is forgotten, so the reconciler mounts again.
    fn list(&self) -> Result<Vec<MountEntry>, MountError> {
        let mut table = lock(&self.table);
        let before = table.mounts.len();
        table.mounts.retain(|m| links_to(&m.target, &m.source));
        if table.mounts.len() != before {
            // Forgetting is only bookkeeping: if it cannot be saved now, the
            // next change saves it, and until then the same links are pruned
            // again on every read.
            let _ = table.save();
        }
        Ok(table
            .mounts
            .iter()
            .map(|m| MountEntry {
                source: m.source.clone(),
                target: m.target.clone(),
                fstype: "nullfs".into(),
                options: "rw".into(),
            })
            .collect())
    }

    /// Links `target` to `source`, creating `target`'s parents. An empty
    /// directory at `target` (a mount point) is replaced by the link; anything
    /// else there is refused, because a symlink cannot cover it the way a
    /// real mount would. Mounting the same source again is success; another
    /// source on the same target is refused (simulated mounts do not stack).
    /// The target's parents below `root` must be real directories, as on
    /// FreeBSD (the target itself is this simulation's mount link).
    fn list_under(&self, root: &Path) -> Result<Vec<MountEntry>, MountError> {
        let mut mounts = self.list()?;
        mounts.retain(|m| m.target.starts_with(root));
        Ok(mounts)
    }

    fn mount_nullfs(&self, source: &Path, root: &Path, target: &Path) -> Result<(), MountError> {
        if let Some(parent) = target.parent()
            && parent.starts_with(root)
        {
            check_mount_point(root, parent).map_err(|e| match e {
                MountError::Redirected {
                    component, what, ..
                } => MountError::Redirected {
                    target: target.to_path_buf(),
                    component,
                    what,
                },
                other => other,
            })?;
        } else {
            check_mount_point(root, target)?;
        }
        let mut table = lock(&self.table);
        if !source.is_dir() {
            return Err(mount_failed(
                source,
                target,
                "the source is not a directory".into(),
            ));
        }
        if let Some(existing) = table.mounts.iter().find(|m| m.target == target) {
            if existing.source == source {
                return Ok(());
            }
            return Err(mount_failed(
                source,
                target,
                format!(
                    "{} is already mounted there; simulated mounts do not stack",
                    existing.source.display()
                ),
            ));
        }
        // A link left by an agent killed between linking and saving is adopted.
        if !links_to(target, source) {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| mount_failed(source, target, e.to_string()))?;
            }
            if let Ok(meta) = std::fs::symlink_metadata(target) {
                // remove_dir removes only an empty directory, never contents.
                if !meta.is_dir() || std::fs::remove_dir(target).is_err() {
                    return Err(mount_failed(
                        source,
                        target,
                        "the target exists and is not an empty directory".into(),
                    ));
                }
            }
            std::os::unix::fs::symlink(source, target)
                .map_err(|e| mount_failed(source, target, e.to_string()))?;
        }
        table.mounts.push(SimMount {
            source: source.to_path_buf(),
            target: target.to_path_buf(),
        });
        if let Err(e) = table.save() {
            table.mounts.pop();
            let _ = std::fs::remove_file(target);
            return Err(mount_failed(
                source,
                target,
                format!("could not record the mount: {e}"),
            ));
        }
        Ok(())
    }

    /// Removes the symlink (only the link, never what it points to).
    fn unmount(&self, target: &Path) -> Result<(), MountError> {
        if self
            .faults
            .should_fail("unmount", &target.display().to_string())
        {
            return Err(MountError::Busy {
                target: target.to_path_buf(),
                stderr: "Device busy (injected)".into(),
            });
        }
        let mut table = lock(&self.table);
        let Some(index) = table.mounts.iter().position(|m| m.target == target) else {
            return Ok(());
        };
        let is_link = std::fs::symlink_metadata(target).is_ok_and(|m| m.file_type().is_symlink());
        if is_link {
            // remove_file on a symlink unlinks the link itself.
            std::fs::remove_file(target).map_err(|e| {
                MountError::Command(CmdError::Failed {
                    command: format!("simulated umount {}", target.display()),
                    status: 1,
                    stderr: e.to_string(),
                })
            })?;
        }
        let removed = table.mounts.remove(index);
        if let Err(e) = table.save() {
            table.mounts.insert(index, removed);
            return Err(MountError::Command(CmdError::Failed {
                command: format!("simulated umount {}", target.display()),
                status: 1,
                stderr: format!("could not record the unmount: {e}"),
            }));
        }
        Ok(())
    }
}
