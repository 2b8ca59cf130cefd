//! The simulated host of `keel-agentd --simulate`: the jail runtime, ZFS and
//! mounts of the host seams done with ordinary processes, directories and
//! symlinks, so the whole agent runs unprivileged on any Unix.
//!
//! - [`SimJails`]: a jail is a child process running `exec.start` in its own
//!   process group, with `KEEL_JAIL_NAME` and `KEEL_JAIL_ADDRESS` in its
//!   environment; the jail table survives an agent restart (even `kill -9`).
//! - [`SimZfs`]: datasets are directories under the layout's `jails_dir` and
//!   `volumes_dir`; there are no base images, so a clone is an empty directory.
//! - [`SimMounts`]: a nullfs mount is a symlink from the target to the source.
//!
//! - [`SimNet`]: the bridge, epairs, routes and aliases as a table on disk.
//! - [`SimBases`]: a base is a directory the system's tar(1) extracts into;
//!   built apart from [`SimHost`], it serves the agent's base fetches.
//!
//! The firewall and capacity come from the in-memory Fakes.
//!
//! State lives in the state directory handed to [`SimHost::new`]:
//! `sim-jails.json`, `sim-mounts.json` (both replaced atomically) and
//! `logs/{jail}.log` (the jail's stdout and stderr).
//!
//! This module must never touch anything outside the state directory and the
//! layout's directories, never signal a process it cannot prove it started,
//! and never delete through a symlink: a destroyed rootfs must leave the data
//! of the volumes that were mounted into it untouched.

mod bases;
mod jails;
mod mounts;
mod net;
mod process;
mod zfs;

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::host::zfs::ZfsLayout;

pub use bases::SimBases;
pub use jails::{SimJails, SimUsage};
pub use mounts::SimMounts;
pub use net::SimNet;
pub use zfs::SimZfs;

/// The simulated host seams that touch the machine: jails, datasets, mounts.
#[derive(Debug)]
pub struct SimHost {
    /// Jails as child processes.
    pub jails: SimJails,
    /// Datasets as directories.
    pub zfs: SimZfs,
    /// nullfs mounts as symlinks.
    pub mounts: SimMounts,
    /// Networking as a table on disk.
    pub net: SimNet,
}

impl SimHost {
    /// Opens (or creates) a simulated host whose state lives in `state_dir`
    /// and whose datasets live under `layout`'s directories. Jails still
    /// running from an earlier agent are found again, not started twice.
    pub fn new(state_dir: &Path, layout: ZfsLayout) -> Result<SimHost, SimError> {
        let mounts = SimMounts::new(state_dir)?;
        let zfs = SimZfs::new(layout, &mounts)?;
        let jails = SimJails::new(state_dir)?;
        let net = SimNet::new(state_dir)?;
        Ok(SimHost {
            jails,
            zfs,
            mounts,
            net,
        })
    }
}

/// The simulated host could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SimError {
    /// A directory of the state dir or the layout could not be created.
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        reason: String,
    },
    /// A state file exists but could not be read or is not what this
    /// version writes.
    ReadState {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::CreateDir { path, reason } => write!(
                f,
                "could not create the simulate-mode directory {}: {reason}; check that its parent exists and is writable",
                path.display()
            ),
            SimError::ReadState { path, reason } => write!(
                f,
                "could not read the simulate-mode state file {}: {reason}; fix it, or stop the simulated jails it lists and remove it",
                path.display()
            ),
        }
    }
}

impl std::error::Error for SimError {}

/// `mkdir -p` with the error naming the directory.
fn create_dir(path: &Path) -> Result<(), SimError> {
    std::fs::create_dir_all(path).map_err(|e| SimError::CreateDir {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// Reads a JSON state file; a missing file is the empty state.
fn read_state<T: DeserializeOwned + Default>(path: &Path) -> Result<T, SimError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(T::default()),
        Err(e) => {
            return Err(SimError::ReadState {
                path: path.to_path_buf(),
                reason: e.to_string(),
            });
        }
    };
    serde_json::from_slice(&bytes).map_err(|e| SimError::ReadState {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// Replaces a JSON state file atomically: a reader (or an agent restarted
/// after `kill -9`) sees the old content or the new one, never half of it.
fn write_state<T: Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    let mut tmp_name = path.as_os_str().to_os_string();
    tmp_name.push(".tmp");
    let tmp = PathBuf::from(tmp_name);
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(&bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    // The rename is durable only once the directory entry is on disk.
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => std::fs::File::open(dir)?.sync_all(),
        _ => Ok(()),
    }
}

/// True when `name` is one plain path component, so joining it to a
/// directory cannot climb out of it. Names are validated DNS labels long
/// before they get here; this is the last line for a path we delete under.
fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\0'])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_files_round_trip_and_missing_is_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.json");
        let empty: Vec<u32> = read_state(&path).expect("missing is empty");
        assert!(empty.is_empty());
        write_state(&path, &vec![1u32, 2]).expect("writes");
        assert_eq!(read_state::<Vec<u32>>(&path), Ok(vec![1, 2]));
        assert!(!dir.path().join("s.json.tmp").exists());
    }

    #[test]
    fn corrupt_state_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.json");
        std::fs::write(&path, "{not json").expect("write");
        let err = read_state::<Vec<u32>>(&path).expect_err("corrupt");
        assert!(err.to_string().contains("s.json"), "{err}");
    }

    #[test]
    fn plain_names_cannot_climb() {
        assert!(is_plain_name("web-1"));
        for bad in ["", ".", "..", "a/b", "../x", "a\0b"] {
            assert!(!is_plain_name(bad), "{bad:?}");
        }
    }
}
