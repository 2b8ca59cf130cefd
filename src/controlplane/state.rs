//! The control plane's persisted state and the ops that change it.
//!
//! Everything here survives `kill -9`: node records (advertise address,
//! capacity, pod_cidr), placements with their epochs, and (with the services
//! and volumes issues) services, VIPs and volume locations. Liveness does not:
//! after a restart every node is Dead until it heartbeats again, which is the
//! safe reading of silence.
//!
//! State changes only through [`Op`]s, appended to the [`Journal`] before any
//! caller hears "done". Ops set or remove whole entries, never increment, so
//! replaying one twice after a crash is harmless.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::common::cidr::Ipv4Net;
use crate::common::journal::Replay;
use crate::common::wire::Resources;

/// File name stem of the state (`cluster.json` + `cluster.log`).
pub const STATE_NAME: &str = "cluster";

/// What the control plane knows of a registered node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The agent's TCP listener.
    pub advertise: SocketAddr,
    /// Host size reported at registration.
    pub capacity: Resources,
    /// The node's subnet; never changes once given.
    pub pod_cidr: Ipv4Net,
}

/// Where a jail name is placed, and under which epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Node id.
    pub node: String,
    /// Increases every time the placement of this name changes (fencing).
    pub epoch: u64,
}

/// Everything persisted.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterState {
    /// Registered nodes by id.
    pub nodes: BTreeMap<String, NodeRecord>,
    /// Jail name -> placement, shared by named and scheduled routes.
    pub placements: BTreeMap<String, Placement>,
    /// The highest epoch ever handed out; the next placement gets more.
    pub last_epoch: u64,
    /// Services by name, with their VIPs.
    #[serde(default)]
    pub services: BTreeMap<String, ServiceRecord>,
}

/// A replicated service. Its replicas are ordinary placements named
/// `{name}-{index}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceRecord {
    /// The Service document, forwarded untouched to the agents.
    pub document: String,
    /// Desired replicas.
    pub replicas: u32,
    /// Port; immutable.
    pub port: u16,
    /// The template declares volumes (replicas pinned to their nodes).
    pub stateful: bool,
    /// SHA-256 of the template; immutable.
    pub template_digest: String,
    /// Virtual IP from `service_cidr`; never changes.
    pub vip: std::net::Ipv4Addr,
}

/// One change to [`ClusterState`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// A node registered (or re-registered with new details).
    PutNode {
        /// Node id.
        id: String,
        /// Its record.
        record: NodeRecord,
    },
    /// A jail was placed (or re-placed).
    PutPlacement {
        /// Jail name.
        name: String,
        /// Where and under which epoch.
        placement: Placement,
    },
    /// A placement was removed (the jail was deleted).
    RemovePlacement {
        /// Jail name.
        name: String,
    },
    /// A service was created or scaled.
    PutService {
        /// Service name.
        name: String,
        /// Its record.
        record: ServiceRecord,
    },
    /// A service was deleted (its VIP is free again).
    RemoveService {
        /// Service name.
        name: String,
    },
}

impl Replay<Op> for ClusterState {
    fn replay(&mut self, op: &Op) {
        match op {
            Op::PutNode { id, record } => {
                self.nodes.insert(id.clone(), record.clone());
            }
            Op::PutPlacement { name, placement } => {
                self.last_epoch = self.last_epoch.max(placement.epoch);
                self.placements.insert(name.clone(), placement.clone());
            }
            Op::RemovePlacement { name } => {
                self.placements.remove(name);
            }
            Op::PutService { name, record } => {
                self.services.insert(name.clone(), record.clone());
            }
            Op::RemoveService { name } => {
                self.services.remove(name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaying_every_op_twice_gives_the_same_state() {
        let ops = [
            Op::PutNode {
                id: "a".into(),
                record: NodeRecord {
                    advertise: "127.0.0.1:7441".parse().expect("addr"),
                    capacity: Resources {
                        cpu: 4.0,
                        memory: 1 << 30,
                    },
                    pod_cidr: "10.20.7.0/24".parse().expect("cidr"),
                },
            },
            Op::PutPlacement {
                name: "web".into(),
                placement: Placement {
                    node: "a".into(),
                    epoch: 3,
                },
            },
            Op::RemovePlacement { name: "web".into() },
            Op::PutPlacement {
                name: "db".into(),
                placement: Placement {
                    node: "a".into(),
                    epoch: 4,
                },
            },
        ];
        let mut once = ClusterState::default();
        ops.iter().for_each(|op| once.replay(op));
        let mut twice = once.clone();
        ops.iter().for_each(|op| twice.replay(op));
        assert_eq!(once, twice);
        assert_eq!(once.last_epoch, 4);
        assert!(!once.placements.contains_key("web"));
    }
}
