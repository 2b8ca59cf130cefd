//! keel-controlplane: its command line ([`cli`]) and, in the issues to come, the
//! node registry, the scheduler, placements, services and their VIPs, the router
//! to the agents and the API. It never imports `common::spec` (spec bodies stay
//! opaque here) nor `agentd`: what the two daemons exchange lives in
//! `common::wire`.

use std::fmt;

pub mod cli;

/// Why the control plane stopped.
#[derive(Debug)]
pub enum RunError {
    /// This build has no control plane loop yet (placeholder until it lands).
    NotBuilt,
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::NotBuilt => {
                f.write_str("cannot run yet: only --check-config and --help work in this build")
            }
        }
    }
}

impl std::error::Error for RunError {}

/// Runs the control plane with a validated configuration.
pub fn run(_options: cli::Options) -> Result<(), RunError> {
    Err(RunError::NotBuilt)
}
