//! ZFS datasets: jail root filesystems cloned from a base snapshot, and
//! quota-scoped volume datasets that outlive every jail.
//!
//! Layout under the configured pool:
//! - `{pool}/keel/bases/{base}@keel`: base snapshots the admin prepares;
//! - `{pool}/keel/jails/{jail}`: a jail's rootfs, mounted at `{jails_dir}/{jail}`;
//! - `{pool}/keel/volumes/{volume}`: a volume, mounted at `{volumes_dir}/{volume}`.
//!
//! This module never destroys a volume as a side effect of anything else: only
//! [`ZfsManager::destroy_volume`] does, and the reconciler calls it only for an
//! explicit volume delete.

use std::fmt;
use std::path::PathBuf;

use crate::common::cmd::CmdError;

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
            ZfsError::NotFound(d) => write!(f, "dataset {d} does not exist"),
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
