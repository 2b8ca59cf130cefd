//! The control plane's persisted state and the ops that change it.
//!
//! Everything here survives `kill -9`: node records (advertise address,
//! capacity, pod_cidr), placements with their epochs, services, VIPs and
//! volume locations. Liveness does not: after a restart every node is
//! Unknown, with a fresh lease, until it heartbeats again; silence is no
//! evidence of death (see `registry::liveness`).
//!
//! State changes only through [`Op`]s, appended to the
//! [`Journal`](crate::common::journal::Journal) before any caller hears
//! "done". Ops set or remove whole entries, never increment, so
//! replaying one twice after a crash is harmless.

use std::collections::{BTreeMap, BTreeSet};
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
    /// Cordoned by the operator (`keelctl cordon`): the scheduler and the
    /// services' healing place nothing new on it; what runs there stays.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cordoned: bool,
}

/// Where a jail name is placed, and under which epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Node id.
    pub node: String,
    /// Increases every time the placement of this name changes (fencing),
    /// and every time a service replica is applied with a new template.
    pub epoch: u64,
    /// For a service replica: the digest of the template it was applied
    /// with (`ServiceApply::template_digest`). `None` for jails, and for
    /// replicas placed before templates could change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
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
    /// The volume registry: volume name -> the node holding its dataset.
    /// Filled when a jail declaring the volume is first placed; a later
    /// apply of any jail declaring it goes to that node. An entry goes only
    /// when the node confirmed the dataset destroyed (or absent).
    #[serde(default)]
    pub volumes: BTreeMap<String, String>,
    /// Placed jails whose DELETE was forwarded to their node and not yet
    /// confirmed. A crash between the node's delete and the removal of the
    /// placement leaves the name here, and the node's next heartbeat that
    /// does not report the jail removes the placement (see
    /// `Cluster::reap_deleted`).
    #[serde(default)]
    pub deleting: BTreeSet<String>,
}

/// A replicated service. Its replicas are ordinary placements named
/// `{name}-{index}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceRecord {
    /// What keelctl stated about the Service (document, replicas, port,
    /// template digest, volumes), as applied; flattened, so the journal
    /// stores the same fields as before this struct was folded.
    #[serde(flatten)]
    pub applied: crate::common::wire::ServiceApply,
    /// Virtual IP from `service_cidr`; never changes.
    pub vip: std::net::Ipv4Addr,
    /// The current template's revision: 1 for the first, one more for every
    /// template change (an undo too, as in Kubernetes).
    #[serde(default = "first_revision")]
    pub revision: u64,
    /// The last [`MAX_REVISIONS`] templates, oldest first, the current one
    /// last. Empty in a journal from before revisions were kept: then the
    /// current template is revision 1 (see [`ServiceRecord::revisions`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<RevisionRecord>,
    /// The last rollout; none until the template first changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutRecord>,
}

/// Template revisions a service keeps (`keelctl rollout history`).
pub const MAX_REVISIONS: usize = 10;

fn first_revision() -> u64 {
    1
}

/// One template a service had: enough to roll back to it without the
/// control plane ever parsing a spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevisionRecord {
    /// Its number.
    pub revision: u64,
    /// When it was recorded (seconds since the epoch).
    pub created_unix: u64,
    /// The Service document that introduced it, as applied.
    pub document: String,
    /// Its template digest.
    pub template_digest: String,
}

/// A rollout: the service's replicas moving to `revision`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutRecord {
    /// The revision rolled out.
    pub revision: u64,
    /// Where it stands.
    pub outcome: RolloutOutcome,
}

/// Where a rollout stands. Persisted so that a restarted control plane
/// neither resumes a stopped rollout nor forgets a finished one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RolloutOutcome {
    /// Replicas are being replaced.
    Progressing,
    /// Every desired replica runs the revision and is ready.
    Complete,
    /// A new replica was not ready within the progress deadline: nothing
    /// more is replaced until the next template change (or an undo).
    Stopped {
        /// Which replica, and what it reported.
        reason: String,
    },
}

impl ServiceRecord {
    /// A new service's record: revision 1, the applied template its history.
    pub fn first(applied: crate::common::wire::ServiceApply, vip: std::net::Ipv4Addr) -> Self {
        let history = vec![RevisionRecord {
            revision: 1,
            created_unix: crate::common::auth::unix_now(),
            document: applied.document.clone(),
            template_digest: applied.template_digest.clone(),
        }];
        ServiceRecord {
            applied,
            vip,
            revision: 1,
            history,
            rollout: None,
        }
    }

    /// The revisions kept, oldest first, the current one last. A record
    /// from before revisions were kept has its current template as its only
    /// revision.
    pub fn revisions(&self) -> Vec<RevisionRecord> {
        if self.history.is_empty() {
            return vec![RevisionRecord {
                revision: self.revision,
                created_unix: 0,
                document: self.applied.document.clone(),
                template_digest: self.applied.template_digest.clone(),
            }];
        }
        self.history.clone()
    }

    /// Whether a replica applied with `template` runs the current one. A
    /// replica placed before templates could change (`None`) runs the
    /// service's first template, the only one there was.
    pub fn is_current(&self, template: Option<&str>) -> bool {
        match template {
            Some(digest) => digest == self.applied.template_digest,
            None => self.revision == 1,
        }
    }

    /// The revision a replica applied with `template` runs, when still kept.
    pub fn revision_of(&self, template: Option<&str>) -> Option<u64> {
        let digest = match template {
            Some(d) => d,
            None => {
                return self
                    .revisions()
                    .first()
                    .map(|r| r.revision)
                    .filter(|r| *r == 1);
            }
        };
        // Newest first: an undo records an older template again.
        self.revisions()
            .iter()
            .rev()
            .find(|r| r.template_digest == digest)
            .map(|r| r.revision)
    }
}

/// One change to [`ClusterState`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// A Dead node deleted by the operator: its record, the placements on
    /// it (with their deleting marks) and the volumes it held are forgotten.
    RemoveNode {
        /// Node id.
        id: String,
    },
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
    /// A DELETE of a placed jail is about to be forwarded to its node.
    MarkDeleting {
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
    /// A volume's dataset is on `node` (a jail declaring it was placed there).
    PutVolume {
        /// Volume name.
        name: String,
        /// Node id.
        node: String,
    },
    /// A volume's dataset was destroyed (or found absent) on its node.
    RemoveVolume {
        /// Volume name.
        name: String,
    },
}

impl Replay<Op> for ClusterState {
    fn replay(&mut self, op: &Op) {
        match op {
            Op::PutNode { id, record } => {
                self.nodes.insert(id.clone(), record.clone());
            }
            Op::RemoveNode { id } => {
                self.nodes.remove(id);
                let placed: Vec<String> = self
                    .placements
                    .iter()
                    .filter(|(_, p)| &p.node == id)
                    .map(|(name, _)| name.clone())
                    .collect();
                for name in placed {
                    self.placements.remove(&name);
                    self.deleting.remove(&name);
                }
                self.volumes.retain(|_, node| node != id);
            }
            Op::PutPlacement { name, placement } => {
                self.last_epoch = self.last_epoch.max(placement.epoch);
                self.placements.insert(name.clone(), placement.clone());
                self.deleting.remove(name);
            }
            Op::RemovePlacement { name } => {
                self.placements.remove(name);
                self.deleting.remove(name);
            }
            Op::MarkDeleting { name } => {
                if self.placements.contains_key(name) {
                    self.deleting.insert(name.clone());
                }
            }
            Op::PutService { name, record } => {
                self.services.insert(name.clone(), record.clone());
            }
            Op::RemoveService { name } => {
                self.services.remove(name);
            }
            Op::PutVolume { name, node } => {
                self.volumes.insert(name.clone(), node.clone());
            }
            Op::RemoveVolume { name } => {
                self.volumes.remove(name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Journals written before `ServiceRecord` held a `ServiceApply` stored
    /// its fields flat; they must still load.
    #[test]
    fn a_service_record_reads_the_flat_journal_form() {
        let flat = r#"{"document":"kind: Service","replicas":3,"port":80,"stateful":false,
            "template_digest":"ab12","vip":"10.96.0.7"}"#;
        let record: ServiceRecord = serde_json::from_str(flat).expect("flat record");
        assert_eq!(
            (record.applied.replicas, record.applied.port, record.vip),
            (3, 80, std::net::Ipv4Addr::new(10, 96, 0, 7))
        );
        assert!(record.applied.volumes.is_empty());
        let back: serde_json::Value = serde_json::to_value(&record).expect("json");
        assert_eq!(back["template_digest"], "ab12", "{back}");
    }

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
                    cordoned: false,
                },
            },
            Op::PutPlacement {
                name: "web".into(),
                placement: Placement {
                    node: "a".into(),
                    epoch: 3,
                    template: None,
                },
            },
            Op::RemovePlacement { name: "web".into() },
            Op::PutVolume {
                name: "pg".into(),
                node: "a".into(),
            },
            Op::PutVolume {
                name: "logs".into(),
                node: "a".into(),
            },
            Op::RemoveVolume {
                name: "logs".into(),
            },
            Op::PutPlacement {
                name: "db".into(),
                placement: Placement {
                    node: "a".into(),
                    epoch: 4,
                    template: Some("ab12".into()),
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
        assert_eq!(
            once.volumes.iter().collect::<Vec<_>>(),
            [(&"pg".to_string(), &"a".to_string())]
        );
    }
}
