//! The peer list a heartbeat answer carries, and its versions.
//!
//! Peer list versions: a heartbeat answer carries every other node, which is
//! what an agent routes by, and at 5,000 nodes heartbeating every 5 s
//! rebuilding and encoding it on every heartbeat cost more than a core. The
//! list changes only when a node's record changes or a node comes alive or
//! dies, so it gets a version ([`Cluster::peers_version`]) and an agent that
//! already holds the current one is answered "unchanged". Deaths are noticed
//! on read like everything else: nodes believed Alive are kept ordered by
//! last heartbeat, so each read pops the ones that have gone silent since
//! without scanning the cluster.
//!
//! A full list is still due on an agent's first heartbeat and after every
//! change, so it must be cheap: each node's peer entry is kept encoded
//! (re-encoded only when that node changes), joined once per version into a
//! [`PeerListJson`] the handler threads share, and spliced into each answer
//! leaving out the asking node. Encoding 5,000 peers per answer on the
//! worker thread took longer than `dead_after` for 5,000 first heartbeats,
//! so nodes died, the version changed, and every node needed the list again.
//!
//! Changes, not lists: after a node joins or dies, the full list per agent
//! made every heartbeat of a 10,000-node cluster carry about 900 KB for one
//! changed entry. So each version bump made for one node is logged (the
//! version and the node id) in a bounded log of recent changes
//! ([`PEER_LOG_LEN`]), and an agent that says it applies changes
//! (`HeartbeatRequest::peer_changes`) and holds a version the log still
//! reaches is answered only the peers changed or gone since. An agent whose
//! version is older than the log, or from another process (versions start
//! at random), an agent that does not apply changes, and every agent after
//! a reset of the whole list (a start, a reload after a failed journal
//! write: the log is emptied) get the full list.
//!
//! This file owns the encoded entries, the version and the change log; it must never decide
//! liveness (that is [`super::liveness`]), only re-encode a node when told
//! that its record or liveness changed.

use std::net::IpAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use super::Cluster;
use super::endpoints::EncodedEndpoints;
use crate::common::wire::{HeartbeatResponse, Peer};

/// Every node's peer entry as JSON for one peer list version, shared with
/// the handler threads; see the module docs.
#[derive(Debug)]
pub struct PeerListJson {
    /// Entries joined by commas, without brackets.
    bytes: Vec<u8>,
    /// Node id and the byte range of its entry, in id order.
    index: Vec<(String, Range<usize>)>,
}

impl PeerListJson {
    /// The JSON array of every entry but `except`'s.
    pub fn array_without(&self, except: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.bytes.len() + 2);
        out.push(b'[');
        match self
            .index
            .binary_search_by(|(id, _)| id.as_str().cmp(except))
        {
            Err(_) => out.extend_from_slice(&self.bytes),
            Ok(i) => {
                let range = &self.index[i].1;
                let (before, after) = (&self.bytes[..range.start], &self.bytes[range.end..]);
                // Drop the entry and the comma that joined it to a neighbour.
                match before.strip_suffix(b",") {
                    Some(before) => {
                        out.extend_from_slice(before);
                        out.extend_from_slice(after);
                    }
                    None => out.extend_from_slice(after.strip_prefix(b",").unwrap_or(after)),
                }
            }
        }
        out.push(b']');
        out
    }
}

/// A heartbeat answer as the worker gives it: the response with its `peers`
/// and `services` left empty, and the peer list and endpoint table to
/// splice in on the handler thread.
#[derive(Debug)]
pub struct HeartbeatAnswer {
    /// `stale`, the peer changes, the versions; `peers` holds only changed
    /// peers and `services` is empty.
    pub response: HeartbeatResponse,
    /// Every node's entry, unless the agent's list is current.
    pub peers: Option<Arc<PeerListJson>>,
    /// The endpoint table, unless the agent holds it; or only the services
    /// changed since the generation it holds (`response.services_changed`).
    pub services: Option<Arc<EncodedEndpoints>>,
}

impl HeartbeatAnswer {
    /// The JSON body for node `node_id`: [`HeartbeatAnswer::response`] with
    /// every peer but the node itself and the endpoint table spliced in.
    pub fn body(&self, node_id: &str) -> Result<Vec<u8>, serde_json::Error> {
        let plain = serde_json::to_vec(&self.response)?;
        if self.peers.is_none() && self.services.is_none() {
            return Ok(plain);
        }
        // `peers`, `stale` and `services` are HeartbeatResponse's first
        // fields, so its encoding starts with them; the lists to send
        // replace them.
        let peers = serde_json::to_vec(&self.response.peers)?;
        let stale = serde_json::to_vec(&self.response.stale)?;
        let services = serde_json::to_vec(&self.response.services)?;
        let head = [
            &br#"{"peers":"#[..],
            &peers,
            br#","stale":"#,
            &stale,
            br#","services":"#,
            &services,
        ]
        .concat();
        let Some(rest) = plain.strip_prefix(head.as_slice()) else {
            return Err(serde::ser::Error::custom(
                "the heartbeat answer does not start with its peers, stale jails and services",
            ));
        };
        let peers = match &self.peers {
            Some(list) => list.array_without(node_id),
            None => peers,
        };
        let services = match &self.services {
            Some(table) => table.json()?,
            None => &services,
        };
        Ok([
            &br#"{"peers":"#[..],
            &peers,
            br#","stale":"#,
            &stale,
            br#","services":"#,
            services,
            rest,
        ]
        .concat())
    }
}

/// Peer list versions stay below 2^53 so any JSON reader holds them exactly.
const PEERS_VERSION_MASK: u64 = (1 << 53) - 1;

/// Changes the peer change log keeps: an agent further behind gets the full
/// list. A few thousand ids is small next to one full list of a large
/// cluster, and covers a heartbeat period of churn.
pub const PEER_LOG_LEN: usize = 4096;

/// The recent peer list changes; see the module docs.
#[derive(Debug, Default)]
pub(super) struct PeerLog {
    /// The version the first entry changed: every version from `base` to
    /// the current one can be answered with changes.
    base: u64,
    /// The node each version after `base` changed, in order: entry `i`
    /// made version `base + 1 + i`.
    changed: std::collections::VecDeque<String>,
}

impl PeerLog {
    /// An empty log at `version`.
    pub(super) fn at(version: u64) -> PeerLog {
        PeerLog {
            base: version,
            changed: std::collections::VecDeque::new(),
        }
    }

    /// The nodes changed since `version`, in change order (with repeats);
    /// `None` when the log does not reach back to it.
    fn since(&self, version: u64) -> Option<impl Iterator<Item = &String>> {
        let skip = version.wrapping_sub(self.base) & PEERS_VERSION_MASK;
        let skip = usize::try_from(skip).ok()?;
        (skip <= self.changed.len()).then(|| self.changed.iter().skip(skip))
    }

    fn push(&mut self, id: &str) {
        if self.changed.len() == PEER_LOG_LEN {
            self.changed.pop_front();
            self.base = (self.base + 1) & PEERS_VERSION_MASK;
        }
        self.changed.push_back(id.to_string());
    }
}

/// The peers changed and gone since a version an agent holds.
#[derive(Debug, Default, PartialEq)]
pub struct PeerChanges {
    /// Added or changed since, as they are now.
    pub changed: Vec<Peer>,
    /// Ids of the peers gone since.
    pub removed: Vec<String>,
}

impl Cluster {
    /// The version of the peer list as of the last read; see the module docs.
    pub fn peers_version(&self) -> u64 {
        self.peers_version
    }

    pub(super) fn bump_peers_version(&mut self) {
        self.peers_version = (self.peers_version + 1) & PEERS_VERSION_MASK;
        self.peer_list = None;
    }

    /// `id`'s record or liveness may have changed: re-encode its entry, and
    /// take a new version when the entry differs. (After a restart every
    /// node's first heartbeat lands here: an unchanged entry must not make
    /// every agent fetch the whole list again.)
    pub(super) fn peer_changed(&mut self, id: &str, now: Instant) {
        let entry = self.encode_peer(id, now);
        if self.entries.get(id) == entry.as_ref() {
            return;
        }
        match entry {
            Some(entry) => self.entries.insert(id.to_string(), entry),
            None => self.entries.remove(id),
        };
        self.bump_peers_version();
        self.peer_log.push(id);
    }

    /// What changed in the peer list since `version`, for node `asking`
    /// (whose own entry is never sent); `None` when the log does not reach
    /// back to `version` and the full list is due.
    pub(super) fn peer_changes_since(&self, version: u64, asking: &str) -> Option<PeerChanges> {
        let ids: std::collections::BTreeSet<&String> = self.peer_log.since(version)?.collect();
        let mut changes = PeerChanges::default();
        for id in ids.into_iter().filter(|id| id.as_str() != asking) {
            match self.entries.get(id) {
                // The entry is what this version's full list carries.
                Some(entry) => changes.changed.push(serde_json::from_slice(entry).ok()?),
                None => changes.removed.push(id.clone()),
            }
        }
        Some(changes)
    }

    /// `id`'s entry; `None` for an unknown node or one without an IPv4
    /// advertise address (nothing can be routed via it).
    pub(super) fn encode_peer(&self, id: &str, now: Instant) -> Option<Vec<u8>> {
        let n = self.state.nodes.get(id)?;
        let IpAddr::V4(address) = n.advertise.ip() else {
            return None;
        };
        let peer = Peer {
            node_id: id.to_string(),
            address,
            pod_cidr: n.pod_cidr.to_string(),
            // An Unknown peer is routed to: withdrawing its route would cut
            // the data plane off on no evidence.
            alive: self.not_dead(id, now),
        };
        // A struct of strings, an address and a bool always encodes.
        serde_json::to_vec(&peer).ok()
    }

    pub(super) fn encode_every_peer(&mut self, now: Instant) {
        self.entries = self
            .state
            .nodes
            .keys()
            .filter_map(|id| Some((id.clone(), self.encode_peer(id, now)?)))
            .collect();
        self.bump_peers_version();
        // Every entry may have changed: no agent's version gets changes.
        self.peer_log = PeerLog::at(self.peers_version);
    }

    /// Every entry joined, for the current version.
    pub(super) fn peer_list(&mut self) -> Arc<PeerListJson> {
        if let Some(list) = &self.peer_list {
            return Arc::clone(list);
        }
        let size = self.entries.values().map(|e| e.len() + 1).sum();
        let mut bytes = Vec::with_capacity(size);
        let mut index = Vec::with_capacity(self.entries.len());
        for (id, entry) in &self.entries {
            if !bytes.is_empty() {
                bytes.push(b',');
            }
            index.push((id.clone(), bytes.len()..bytes.len() + entry.len()));
            bytes.extend_from_slice(entry);
        }
        let list = Arc::new(PeerListJson { bytes, index });
        self.peer_list = Some(Arc::clone(&list));
        list
    }
}

/// A random start for the peer list version, so an agent holding a version
/// from before a restart of the control plane never finds it current by
/// chance. Without randomness the clock serves: restarts are seconds apart.
pub(super) fn first_peers_version() -> u64 {
    let seed = getrandom::u64().unwrap_or_else(|_| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    seed & PEERS_VERSION_MASK
}
