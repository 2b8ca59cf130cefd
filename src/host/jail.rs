//! Jail lifecycle: create and remove jails from a per-jail jail.conf, observe
//! them all in one pass, apply rctl limits, run commands inside with jexec.
//!
//! Keel writes `{conf_dir}/{name}.conf` and uses `jail -f FILE -c NAME` /
//! `jail -f FILE -r NAME`, never bare `jail -r NAME`: on a jail created from the
//! command line `jail -r` runs no exec.stop and leaves devfs mounted. Jails are
//! created with `persist`, so a jail whose processes all exit stays a jail; a
//! jail with no processes left is a *crashed workload* ([`ObservedJail::running`]
//! is false) and the reconciler restarts it through its backoff.
//!
//! This module never touches ZFS, mounts or host-side networking: the jail
//! side of the network (address and default route inside the jail) is part of
//! the jail.conf it writes, because jail(8) runs it at every start.

use std::collections::BTreeMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use crate::common::cmd::{CmdError, CmdOutput};

/// Everything jail(8) needs to create one jail.
#[derive(Debug, Clone, PartialEq)]
pub struct JailParams {
    /// Jail name (a validated DNS label).
    pub name: String,
    /// Root of the jail's filesystem (its rootfs dataset's mountpoint).
    pub path: PathBuf,
    /// host.hostname
    pub hostname: String,
    /// VNET attachment; `None` only in tests of non-network behaviour.
    pub network: Option<JailNetwork>,
    /// exec.start argv, run inside the jail after the network is up.
    pub exec_start: Vec<String>,
    /// exec.stop argv, run inside the jail on removal (may be empty).
    pub exec_stop: Vec<String>,
    /// Environment for exec.start and exec.stop.
    pub env: BTreeMap<String, String>,
}

/// The jail side of a VNET attachment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailNetwork {
    /// Interface moved into the jail (the `kj_` end of the epair).
    pub interface: String,
    /// The jail's address.
    pub address: Ipv4Addr,
    /// Prefix length of the node subnet (24).
    pub prefix_len: u8,
    /// Default route inside the jail (the bridge's address).
    pub gateway: Ipv4Addr,
}

/// rctl(8) limits for one jail.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    /// Cores (1.5 = 150 % of one core, rctl `pcpu`).
    pub cpu: Option<f64>,
    /// Bytes (rctl `memoryuse`).
    pub memory: Option<u64>,
}

/// One jail as the host reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedJail {
    /// Jail name.
    pub name: String,
    /// Kernel jail id (simulate mode: the workload's pid).
    pub jid: u32,
    /// Root path.
    pub path: PathBuf,
    /// True while at least one process runs inside the jail.
    pub running: bool,
}

/// A jail operation that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JailError {
    /// A command failed or could not run (argv, status and stderr inside).
    Command(CmdError),
    /// `jail -c` refused because a jail with that name already exists.
    AlreadyExists(String),
    /// The per-jail jail.conf could not be written.
    WriteConf {
        /// The file.
        path: PathBuf,
        /// The OS error.
        reason: String,
    },
    /// Output of jls(8) or ps(1) that does not match the documented format.
    Parse {
        /// The command.
        command: String,
        /// What was wrong.
        reason: String,
    },
    /// rctl refused because RACCT is disabled or absent in the kernel.
    RacctDisabled(String),
}

impl fmt::Display for JailError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JailError::Command(e) => write!(f, "{e}"),
            JailError::AlreadyExists(n) => write!(
                f,
                "a jail named {n} already exists on this host and was not created by Keel's conf; remove it with `jail -r {n}` or pick another name"
            ),
            JailError::WriteConf { path, reason } => {
                write!(f, "could not write {}: {reason}", path.display())
            }
            JailError::Parse { command, reason } => {
                write!(f, "could not read the output of `{command}`: {reason}")
            }
            JailError::RacctDisabled(msg) => write!(
                f,
                "{msg}; resource limits need kern.racct.enable=1 in /boot/loader.conf and a reboot"
            ),
        }
    }
}

impl std::error::Error for JailError {}

impl From<CmdError> for JailError {
    fn from(e: CmdError) -> Self {
        JailError::Command(e)
    }
}

/// Creating, removing and observing jails.
pub trait JailRuntime: Send {
    /// Every jail on the host, with whether it still runs processes. One jls(8)
    /// and one ps(1) whatever the number of jails.
    fn list(&self) -> Result<Vec<ObservedJail>, JailError>;
    /// Writes the jail's jail.conf and creates it (which runs exec.start).
    fn create(&self, params: &JailParams) -> Result<(), JailError>;
    /// Removes the jail (exec.stop runs, devfs is unmounted). A jail that does
    /// not exist is success.
    fn remove(&self, name: &str) -> Result<(), JailError>;
    /// Replaces the jail's rctl rules with `limits`.
    fn set_limits(&self, name: &str, limits: &Limits) -> Result<(), JailError>;
    /// Removes every rctl rule of the jail; none present is success.
    fn clear_limits(&self, name: &str) -> Result<(), JailError>;
    /// Runs argv inside the jail with jexec(8); the caller reads the status.
    fn exec(&self, name: &str, argv: &[String]) -> Result<CmdOutput, JailError>;
}
