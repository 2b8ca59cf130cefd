//! The cluster state kept in etcd: the journal's own format, one key per
//! batch, every write fenced by the leader key.
//!
//! [`EtcdLog`] is the [`Log`] the journal's writer thread
//! ([`super::commit`]) uses when `controlplane.etcd_endpoints` is set. It
//! keeps what the embedded journal keeps, under the cluster's prefix:
//!
//! | key | value |
//! |---|---|
//! | `log/{seq}` | one batch: the JSON array of its ops, `seq` zero-padded so key order is log order |
//! | `snapshot` | `{"id", "parts", "through"}`: the snapshot in force and the last batch it holds |
//! | `snapshot/{id}/{part}` | the snapshot's JSON in parts below etcd's value limit |
//!
//! Why a log of batches and not one key per record: a batch is then one
//! put in one transaction, so it is durable all or none whatever it holds
//! (a node removal touches every placement of the node, which as separate
//! keys would exceed etcd's 128 operations per transaction), and the state
//! is rebuilt by the replay the journal already uses.
//!
//! Fencing: every transaction compares the leader key's create revision
//! with the one this control plane won it at ([`super::leader`]). When
//! another control plane has taken the key since, the compare fails and
//! nothing is written: [`LogError::NotLeader`]. So a control plane that
//! was paused or cut off and still believes it leads can never write over
//! its successor's decisions.
//!
//! It must never write without the fence, nor read the state from
//! anywhere but etcd: memory may run ahead of what etcd holds.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::common::journal::Replay;
use crate::controlplane::commit::{Log, LogError};
use crate::controlplane::etcd::{Compare, Etcd, Kv, Op as EtcdOp};
use crate::controlplane::leader::LEADER_KEY;
use crate::controlplane::state::{ClusterState, Op};

/// Prefix of the batch keys.
const LOG: &str = "log/";
/// The snapshot pointer; its parts are under `snapshot/`.
const SNAPSHOT: &str = "snapshot";
/// Batches after which the next append also snapshots.
pub const COMPACT_AFTER_BATCHES: usize = 1_000;
/// Largest snapshot part: below etcd's default request limit of 1.5 MiB.
const PART_BYTES: usize = 1 << 20;
/// Deletes per transaction when the log is folded into a snapshot: below
/// etcd's default of 128 operations per transaction.
const DELETES_PER_TXN: usize = 100;

/// The snapshot in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Pointer {
    /// Names its parts: `snapshot/{id}/...`.
    id: u64,
    /// How many parts.
    parts: usize,
    /// The last batch it holds; the log goes on after it.
    through: u64,
}

/// The cluster state in etcd; see the module docs.
pub struct EtcdLog {
    etcd: Arc<Etcd>,
    /// The leader key's create revision this control plane holds.
    fence: i64,
    /// The number of the next batch.
    next: u64,
    /// Batches since the snapshot in force.
    since_snapshot: usize,
    /// The snapshot in force, if any.
    pointer: Option<Pointer>,
}

fn log_key(seq: u64) -> String {
    format!("{LOG}{seq:020}")
}

fn part_key(id: u64, part: usize) -> String {
    format!("{SNAPSHOT}/{id:020}/{part:06}")
}

impl EtcdLog {
    /// The state under `etcd`'s prefix, for the leader whose key was
    /// created at `fence`.
    pub fn open(etcd: Arc<Etcd>, fence: i64) -> Result<(EtcdLog, ClusterState), LogError> {
        let mut log = EtcdLog {
            etcd,
            fence,
            next: 1,
            since_snapshot: 0,
            pointer: None,
        };
        let state = log.read()?;
        Ok((log, state))
    }

    fn fenced(&self) -> [Compare; 1] {
        [Compare::create_revision(LEADER_KEY, self.fence)]
    }

    /// A transaction under the fence; a failed compare is
    /// [`LogError::NotLeader`].
    fn write(&self, ops: &[EtcdOp]) -> Result<(), LogError> {
        let outcome = self.etcd.txn(&self.fenced(), ops, &[])?;
        if outcome.succeeded {
            Ok(())
        } else {
            Err(LogError::NotLeader(format!(
                "the leader key {LEADER_KEY:?} is no longer the one created at revision {}",
                self.fence
            )))
        }
    }

    /// Reads the snapshot and the batches after it, and checks the fence.
    fn read(&mut self) -> Result<ClusterState, LogError> {
        let lead = self.etcd.range_prefix(LEADER_KEY)?;
        let held = lead
            .kvs
            .iter()
            .any(|kv| kv.key == LEADER_KEY && kv.create_revision == self.fence);
        if !held {
            return Err(LogError::NotLeader(format!(
                "the leader key {LEADER_KEY:?} is gone or was taken by another control plane"
            )));
        }
        let snapshot = self.etcd.range_prefix(SNAPSHOT)?;
        let mut state = ClusterState::default();
        self.pointer = None;
        if let Some(kv) = snapshot.kvs.iter().find(|kv| kv.key == SNAPSHOT) {
            let pointer: Pointer = serde_json::from_slice(&kv.value)
                .map_err(|e| LogError::Corrupt(format!("key {SNAPSHOT:?}: {e}")))?;
            state = assemble(&pointer, &snapshot.kvs)?;
            self.pointer = Some(pointer);
        }
        let through = self.pointer.map_or(0, |p| p.through);
        let batches = self.etcd.range_prefix(LOG)?;
        let mut last = through;
        self.since_snapshot = 0;
        for kv in &batches.kvs {
            let seq: u64 = kv.key[LOG.len()..]
                .parse()
                .map_err(|_| LogError::Corrupt(format!("key {:?} is not a batch", kv.key)))?;
            if seq <= through {
                // Folded into the snapshot; its delete did not finish.
                continue;
            }
            let ops: Vec<Op> = serde_json::from_slice(&kv.value)
                .map_err(|e| LogError::Corrupt(format!("key {:?}: {e}", kv.key)))?;
            for op in &ops {
                state.replay(op);
            }
            last = seq;
            self.since_snapshot += 1;
        }
        self.next = last + 1;
        Ok(state)
    }
}

/// The snapshot `pointer` names, from its parts among `kvs`.
fn assemble(pointer: &Pointer, kvs: &[Kv]) -> Result<ClusterState, LogError> {
    let mut json = Vec::new();
    for part in 0..pointer.parts {
        let key = part_key(pointer.id, part);
        let kv = kvs
            .iter()
            .find(|kv| kv.key == key)
            .ok_or_else(|| LogError::Corrupt(format!("snapshot part {key:?} is missing")))?;
        json.extend_from_slice(&kv.value);
    }
    serde_json::from_slice(&json)
        .map_err(|e| LogError::Corrupt(format!("snapshot {}: {e}", pointer.id)))
}

impl Log for EtcdLog {
    fn append(&mut self, ops: &[Op]) -> Result<(), LogError> {
        let value = serde_json::to_vec(ops)
            .map_err(|e| LogError::Corrupt(format!("a batch could not be encoded: {e}")))?;
        self.write(&[EtcdOp::put(&log_key(self.next), value)])?;
        self.next += 1;
        self.since_snapshot += 1;
        Ok(())
    }

    fn wants_compaction(&self) -> bool {
        self.since_snapshot >= COMPACT_AFTER_BATCHES
    }

    /// The parts first, each under the fence; then, in one transaction,
    /// the pointer moves to them. A crash before that leaves the old
    /// snapshot and the whole log in force (the new parts are garbage the
    /// next compaction's prefix delete removes); after it, the folded
    /// batches are only deleted, which a crash may leave half done and
    /// [`EtcdLog::open`] skips.
    fn compact(&mut self, state: &ClusterState) -> Result<(), LogError> {
        let json = serde_json::to_vec(state)
            .map_err(|e| LogError::Corrupt(format!("the state could not be encoded: {e}")))?;
        let through = self.next - 1;
        let id = self.pointer.map_or(1, |p| p.id + 1);
        let chunks: Vec<&[u8]> = json.chunks(PART_BYTES).collect();
        // Leftovers of a compaction that crashed before its pointer moved.
        self.write(&[EtcdOp::delete_prefix(&format!("{SNAPSHOT}/{id:020}/"))])?;
        for (i, chunk) in chunks.iter().enumerate() {
            self.write(&[EtcdOp::put(&part_key(id, i), chunk.to_vec())])?;
        }
        let pointer = Pointer {
            id,
            parts: chunks.len(),
            through,
        };
        let encoded = serde_json::to_vec(&pointer)
            .map_err(|e| LogError::Corrupt(format!("the snapshot pointer: {e}")))?;
        let mut moved = vec![EtcdOp::put(SNAPSHOT, encoded)];
        if let Some(old) = self.pointer {
            moved.push(EtcdOp::delete_prefix(&format!(
                "{SNAPSHOT}/{:020}/",
                old.id
            )));
        }
        self.write(&moved)?;
        let first = self.pointer.map_or(1, |p| p.through + 1);
        self.pointer = Some(pointer);
        self.since_snapshot = 0;
        let folded: Vec<EtcdOp> = (first..=through)
            .map(|seq| EtcdOp::delete(&log_key(seq)))
            .collect();
        for deletes in folded.chunks(DELETES_PER_TXN) {
            self.write(deletes)?;
        }
        Ok(())
    }

    fn reopen(&mut self) -> Result<ClusterState, LogError> {
        self.read()
    }
}
