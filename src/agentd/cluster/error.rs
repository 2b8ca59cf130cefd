//! [`ClusterError`]: why a step of cluster membership failed (identity, keys,
//! talking to the control plane), with what to do about it. It never carries
//! host errors: those are the worker's, reported as messages.

use std::fmt;

use crate::common::auth::AuthError;
use crate::common::http::HttpError;
use crate::host::capacity::CapacityError;

/// Why a cluster step failed.
#[derive(Debug)]
pub enum ClusterError {
    /// No usable node id: the hostname is not a DNS label.
    NodeId(String),
    /// The host's size could not be read at startup.
    Capacity(CapacityError),
    /// A signing key could not be loaded, or a request could not be signed.
    Keys(AuthError),
    /// The control plane could not be reached or did not answer in time.
    Unreachable(HttpError),
    /// The control plane answered with an unexpected status.
    Status {
        /// The request path.
        path: String,
        /// The status code.
        status: u16,
        /// The error it gave (its `error` field, or the body).
        message: String,
    },
    /// The control plane does not know this node (heartbeat 404): re-register.
    UnknownNode,
    /// The control plane's answer is not the JSON body expected.
    Body {
        /// The request path.
        path: String,
        /// What was wrong.
        reason: String,
    },
}

impl fmt::Display for ClusterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterError::NodeId(why) => write!(f, "{why}"),
            ClusterError::Capacity(e) => write!(
                f,
                "cannot detect this host's CPU count and memory for the scheduler: {e}"
            ),
            ClusterError::Unreachable(e) => write!(f, "control plane unreachable: {e}"),
            ClusterError::Status {
                path,
                status: 401,
                message,
            } => write!(
                f,
                "the control plane refused {path} as unauthenticated (401: {message}); check that agent.key_file holds a key listed in the control plane's auth.node_keys"
            ),
            ClusterError::Status {
                path,
                status,
                message,
            } => write!(
                f,
                "the control plane answered {path} with {status}: {message}"
            ),
            ClusterError::Keys(e) => write!(
                f,
                "{e}; a clustered agent signs with agent.key_file and accepts the keys in auth.node_keys (key files: docs/security.md)"
            ),
            ClusterError::UnknownNode => {
                f.write_str("the control plane does not know this node; registering again")
            }
            ClusterError::Body { path, reason } => {
                write!(
                    f,
                    "the control plane's answer to {path} is not understood: {reason}"
                )
            }
        }
    }
}

impl std::error::Error for ClusterError {}
