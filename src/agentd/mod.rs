//! keel-agentd, the node agent: its command line ([`cli`]) and, in the issues to
//! come, the reconciler, the state, the API over the Unix socket (and TCP when
//! clustered), cluster membership, the service proxy and ingress. It reaches the
//! host only through the `host` traits and never imports `controlplane`: what the
//! two daemons exchange lives in `common::wire`.

use std::fmt;

pub mod cli;

/// Why the agent stopped.
#[derive(Debug)]
pub enum RunError {
    /// This build has no agent loop yet (placeholder until the single-node agent
    /// lands).
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

/// Runs the agent with a validated configuration.
pub fn run(_options: cli::Options) -> Result<(), RunError> {
    Err(RunError::NotBuilt)
}
