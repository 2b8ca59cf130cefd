//! What the host offers: CPU count and physical memory for the scheduler, and
//! the kernel features Keel needs (VIMAGE for VNET jails, RACCT for limits).

use std::fmt;

use crate::common::cmd::CmdError;

/// The host's size, detected once at startup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HostCapacity {
    /// `hw.ncpu`
    pub cpus: u32,
    /// `hw.physmem`, bytes.
    pub memory_bytes: u64,
}

/// Kernel features Keel depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preflight {
    /// `kern.features.vimage` is 1: VNET jails work.
    pub vimage: bool,
    /// `kern.racct.enable` is 1: rctl limits work.
    pub racct: bool,
}

/// A capacity probe that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CapacityError {
    /// A command failed or could not run.
    Command(CmdError),
    /// sysctl output that is not what sysctl(8) documents.
    Parse(String),
}

impl fmt::Display for CapacityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CapacityError::Command(e) => write!(f, "{e}"),
            CapacityError::Parse(why) => write!(f, "could not read sysctl output: {why}"),
        }
    }
}

impl std::error::Error for CapacityError {}

impl From<CmdError> for CapacityError {
    fn from(e: CmdError) -> Self {
        CapacityError::Command(e)
    }
}

/// Host size and kernel features.
pub trait Capacity: Send {
    /// CPU count and physical memory, in one sysctl call.
    fn detect(&self) -> Result<HostCapacity, CapacityError>;
    /// VIMAGE and RACCT, in one sysctl call.
    fn preflight(&self) -> Result<Preflight, CapacityError>;
}
