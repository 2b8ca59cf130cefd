//! JSON bodies the daemons and keelctl exchange. `agentd`, `controlplane` and
//! `ctl` never import each other; everything they say to one another is here.
//!
//! Field names are part of the API (keelctl `-o json` prints them as they are):
//! add fields, never rename them.

use std::fmt;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// Where a jail stands, as last seen by the reconciler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Recorded, not provisioned yet.
    Pending,
    /// The workload runs.
    Running,
    /// The workload exited; waiting for its backoff delay before restarting.
    CrashLoop,
    /// The last provisioning or restart attempt failed.
    Failed,
    /// A delete is in progress.
    Deleting,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Pending => "Pending",
            Phase::Running => "Running",
            Phase::CrashLoop => "CrashLoop",
            Phase::Failed => "Failed",
            Phase::Deleting => "Deleting",
        })
    }
}

/// A jail's state for the API: desired and observed together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JailStatus {
    /// Jail name.
    pub name: String,
    /// Phase as last observed.
    pub state: Phase,
    /// The jail's address.
    pub address: Ipv4Addr,
    /// Restarts after crashes.
    pub restarts: u32,
    /// When it was first applied (Unix seconds).
    pub created_unix: u64,
    /// The last error, if the last attempt failed.
    pub last_error: Option<String>,
    /// Seconds until the next restart attempt while in CrashLoop or Failed.
    pub retry_in_secs: Option<u64>,
    /// Placement epoch, for jails the control plane placed.
    pub epoch: Option<u64>,
    /// cpu cores requested.
    pub cpu: Option<f64>,
    /// memory bytes requested.
    pub memory: Option<u64>,
}
