//! nullfs mounts of volume datasets into jail root filesystems.
//!
//! This module mounts and unmounts; it never removes files or directories.
//! Nothing in Keel deletes recursively under a jail root: a destroy that
//! followed a still-mounted nullfs volume is how other jail managers lost data.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::common::cmd::CmdError;

/// One mounted filesystem as `mount -p` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// What is mounted (for nullfs, the source directory).
    pub source: PathBuf,
    /// Where it is mounted.
    pub target: PathBuf,
    /// Filesystem type (`nullfs`, `zfs`, ...).
    pub fstype: String,
    /// Mount options.
    pub options: String,
}

/// A mount operation that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountError {
    /// A command failed or could not run.
    Command(CmdError),
    /// umount refused because the filesystem is in use.
    Busy {
        /// The mount point.
        target: PathBuf,
        /// umount's message.
        stderr: String,
    },
    /// `mount -p` output that does not match the documented format.
    Parse(String),
}

impl fmt::Display for MountError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MountError::Command(e) => write!(f, "{e}"),
            MountError::Busy { target, stderr } => write!(
                f,
                "{} is busy and was not unmounted ({stderr}); stop what uses it and retry",
                target.display()
            ),
            MountError::Parse(why) => write!(f, "could not read `mount -p` output: {why}"),
        }
    }
}

impl std::error::Error for MountError {}

impl From<CmdError> for MountError {
    fn from(e: CmdError) -> Self {
        MountError::Command(e)
    }
}

/// Mounting volumes.
pub trait MountManager: Send {
    /// Every nullfs mount on the host, in one `mount -p -t nullfs`.
    fn list(&self) -> Result<Vec<MountEntry>, MountError>;
    /// Creates `target` if needed (mkdir -p) and nullfs-mounts `source` there.
    fn mount_nullfs(&self, source: &Path, target: &Path) -> Result<(), MountError>;
    /// Unmounts `target`; not mounted is success, in use is [`MountError::Busy`].
    fn unmount(&self, target: &Path) -> Result<(), MountError>;
}
