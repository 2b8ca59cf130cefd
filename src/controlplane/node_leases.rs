//! The cluster's record of which nodes are alive, when the state is in
//! etcd: a key `nodes/{id}` per node, under an etcd lease, kept by the
//! leader as it hears heartbeats, and read by the next leader so that its
//! nodes are Alive from its first moment ([`crate::controlplane::registry::Cluster::vouch`])
//! instead of Unknown until each heartbeats again.
//!
//! Leases are shared, not one per node: every quarter of `dead_after` a
//! new lease of `dead_after` and a quarter is granted, and each node heard
//! since it was last written is written again under the newest, in fenced
//! transactions of up to [`MAX_OPS`] puts. Leases are never renewed; when
//! one runs out, the keys of the nodes not heard since go with it. So a
//! node's key outlives its last heartbeat by `dead_after` at least (the
//! lease it was written under was granted at most a quarter before) and by
//! `dead_after` and a half at most, and the cost is one transaction per
//! hundred heartbeats a quarter, however many nodes: at 10,000 nodes that
//! beat every 5 s with `dead_after` 30 s, about 14 small transactions a
//! second.
//!
//! The record is evidence for life, never for death: a key that vanishes
//! means that the leader stopped writing it, which a leader that froze or
//! lost etcd does for every node at once. A node is declared Dead only by
//! the leader that saw its own lease of it run out
//! ([`crate::controlplane::registry`]'s liveness).
//!
//! The worker only hands over what it heard ([`NodeLeases::heard`], a map
//! insert under a lock); the etcd calls run on the thread
//! `keel-node-leases`, so nothing slow stands in front of a heartbeat. It
//! must never decide anything about a node.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::common::wire::Resources;
use crate::controlplane::etcd::{Compare, Etcd, EtcdError, LeaseId, Op};
use crate::controlplane::leader::LEADER_KEY;

/// The prefix of the node keys, relative to the cluster's.
pub const NODES_PREFIX: &str = "nodes/";

/// Most puts in one transaction (etcd's default limit is 128 operations).
pub const MAX_OPS: usize = 100;

/// What a node's key holds: the load it last reported, for the next
/// leader's scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// Resources committed to its jails.
    pub committed: Resources,
    /// Jails it holds.
    pub jails: u32,
}

/// Reads the nodes whose keys live: what an earlier leader heard within
/// its lease. A value that does not parse is left out (the node is then
/// Unknown until it heartbeats, as without the record).
pub fn read(etcd: &Etcd) -> Result<BTreeMap<String, NodeRecord>, EtcdError> {
    let got = etcd.range_prefix(NODES_PREFIX)?;
    Ok(got
        .kvs
        .into_iter()
        .filter_map(|kv| {
            let id = kv.key.strip_prefix(NODES_PREFIX)?.to_string();
            match serde_json::from_slice::<NodeRecord>(&kv.value) {
                Ok(record) => Some((id, record)),
                Err(e) => {
                    log::warn!(
                        "the record of node {id} in etcd does not read ({e}); it counts as Unknown"
                    );
                    None
                }
            }
        })
        .collect())
}

/// Where the worker says whom it heard from. Cheap: it never waits on etcd.
pub trait HeardFrom: Send {
    /// `node` heartbeated, with this load.
    fn heard(&self, node: &str, record: NodeRecord);
}

/// What the worker and the writer thread share.
#[derive(Default)]
struct Shared {
    /// Heard since the writer last took them (latest record wins).
    pending: Mutex<BTreeMap<String, NodeRecord>>,
    /// Set when the term ends: the thread stops at its next turn.
    stop: AtomicBool,
}

/// The leader's writer of node keys for one term; stops when dropped.
pub struct NodeLeases {
    shared: Arc<Shared>,
}

impl NodeLeases {
    /// Starts the writer for the leader whose key was created at `fence`.
    pub fn start(etcd: Arc<Etcd>, fence: i64, dead_after: Duration) -> std::io::Result<NodeLeases> {
        let shared = Arc::new(Shared::default());
        let writer = Writer {
            etcd,
            fence,
            window: dead_after / 4,
            ttl: dead_after + dead_after / 4,
            shared: Arc::clone(&shared),
            bucket: None,
            written: BTreeSet::new(),
        };
        std::thread::Builder::new()
            .name("keel-node-leases".into())
            .spawn(move || writer.run())?;
        Ok(NodeLeases { shared })
    }
}

impl HeardFrom for NodeLeases {
    fn heard(&self, node: &str, record: NodeRecord) {
        self.shared
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string(), record);
    }
}

impl Drop for NodeLeases {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

/// The thread's side; see the module docs.
struct Writer {
    etcd: Arc<Etcd>,
    fence: i64,
    /// How long one lease takes new writes.
    window: Duration,
    /// The leases' TTL.
    ttl: Duration,
    shared: Arc<Shared>,
    /// The newest lease and when it was granted.
    bucket: Option<(LeaseId, Instant)>,
    /// Nodes written under the newest lease.
    written: BTreeSet<String>,
}

impl Writer {
    fn run(mut self) {
        // Often enough that a node heard is on record well within a window.
        let turn = (self.window / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        while !self.shared.stop.load(Ordering::SeqCst) {
            if let Err(e) = self.write_heard() {
                // The next turn tries again; a fenced write means another
                // leads, and this term is about to end.
                log::warn!("the record of live nodes in etcd is not updated: {e}");
            }
            std::thread::sleep(turn);
        }
    }

    /// Writes every node heard since its last write under the newest lease,
    /// granting a new one first when the window of the last has passed.
    fn write_heard(&mut self) -> Result<(), EtcdError> {
        if self
            .bucket
            .is_none_or(|(_, granted)| granted.elapsed() >= self.window)
        {
            let lease = self.etcd.grant(self.ttl)?;
            self.bucket = Some((lease.id, Instant::now()));
            self.written.clear();
        }
        let Some((lease, _)) = self.bucket else {
            return Ok(());
        };
        let heard = std::mem::take(
            &mut *self
                .shared
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        let due: Vec<(String, NodeRecord)> = heard
            .into_iter()
            .filter(|(id, _)| !self.written.contains(id))
            .collect();
        for chunk in due.chunks(MAX_OPS) {
            let ops: Vec<Op> = chunk
                .iter()
                .map(|(id, record)| {
                    let value = serde_json::to_vec(record).unwrap_or_default();
                    Op::put_with_lease(&format!("{NODES_PREFIX}{id}"), value, lease)
                })
                .collect();
            let fence = [Compare::create_revision(LEADER_KEY, self.fence)];
            let outcome = match self.etcd.txn(&fence, &ops, &[]) {
                Ok(outcome) => outcome,
                Err(e) => {
                    // Tried again at the next turn, unless heard anew since.
                    let mut pending = self
                        .shared
                        .pending
                        .lock()
                        .unwrap_or_else(|p| p.into_inner());
                    for (id, record) in due.iter().filter(|(id, _)| !self.written.contains(id)) {
                        pending.entry(id.clone()).or_insert(*record);
                    }
                    return Err(e);
                }
            };
            if !outcome.succeeded {
                log::info!("not writing the record of live nodes: another control plane leads");
                self.shared.stop.store(true, Ordering::SeqCst);
                return Ok(());
            }
            self.written.extend(chunk.iter().map(|(id, _)| id.clone()));
        }
        Ok(())
    }
}
