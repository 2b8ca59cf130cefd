//! The endpoint table as published to the agents' proxies, numbered by
//! generation, and what each node's proxy reports it applied and still
//! relays.
//!
//! Generations: the table every proxy routes by ([`Cluster::endpoints`]) is
//! recomputed after every request that can change it and on the worker's
//! periodic tick (liveness changes with time alone), and
//! [`Cluster::refresh_endpoints`] gives it a new generation only when it
//! differs from the last one published. Generations live in memory only:
//! they start at 1 when the process starts, under a random
//! [`Cluster::endpoints_origin`] that tells one process's numbers from
//! another's, so an agent that held generation 50 of the previous process
//! is not fooled by this one's 3 (the agent's side of that is
//! `agentd::cluster::watch`). An agent or control plane restart simply
//! resyncs: the first heartbeat answer carries the whole table.
//!
//! Each heartbeat also reports which generation its node's proxy applied
//! and the connections it has open to each replica; this file keeps them on
//! the node's record and answers the two questions connection draining
//! asks ([`Cluster::open_connections`], [`Cluster::endpoints_caught_up`]).
//!
//! Only the entries of services whose inputs changed are rebuilt (see
//! [`super::dirty`]): the table is kept by service name as well, and a
//! recomputation with nothing marked costs nothing.
//!
//! A heartbeat answer carries the whole table to every agent that does not
//! hold its generation, so after a change every node is sent it once. With
//! 1,000 services that is about 130 KB per answer; copying the table on the
//! worker thread and encoding it again for every answer put a heartbeat's
//! p99 at 5,000 nodes from 1.5 ms to 50 ms for a period after each change.
//! So each generation's table is shared as [`EncodedEndpoints`], encoded
//! once, by the first answer that needs it, on a handler thread.
//!
//! Changes, not tables: even shared, 130 KB to every node after each change
//! (a death changes the few services with replicas there) is most of a
//! heartbeat's cost for a period. So each generation logs the services it
//! changed ([`ENDPOINT_LOG_LEN`] generations at most), and an agent that
//! applies changes (`HeartbeatRequest::endpoint_changes`) and holds a
//! generation the log still reaches is answered only the entries changed
//! or gone since ([`Cluster::endpoint_changes_since`]). An agent further
//! behind, from another process, or behind by more than half the table
//! gets the whole table.
//!
//! This file must never compute the table itself (that is
//! [`super::services`], through [`Cluster::endpoints`]) nor decide liveness
//! (that is [`super::liveness`]); it only compares, numbers and remembers.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddrV4;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use super::Cluster;
use super::dirty::Marked;
use super::peers::first_peers_version;
use crate::common::wire::{Liveness, ServiceEndpoints};

/// Generations whose changed services the log keeps: an agent further
/// behind gets the whole table. A change is a few names; a period of churn
/// is far fewer generations than this.
pub const ENDPOINT_LOG_LEN: usize = 1024;

/// The endpoint changes since a generation an agent holds: the entries
/// added or changed (shared and encoded once, like a whole table: after a
/// change most agents hold the same generation), and the names of those
/// gone.
#[derive(Debug, Default)]
pub struct EndpointChanges {
    /// The current entries of the services added or changed, in name order.
    pub changed: Arc<EncodedEndpoints>,
    /// The services gone, in name order.
    pub removed: Vec<String>,
}

/// A published table: its entries in name order, each shared between the
/// generations it did not change in. A new generation copies pointers, not
/// entries: copying 1,000 entries on the worker for every generation of a
/// heal was a share of the stall heartbeats waited behind at a death.
pub type Table = Arc<Vec<Arc<ServiceEndpoints>>>;

/// One generation's table, shared with the handler threads, and its JSON
/// array once an answer needed it; see the module docs.
#[derive(Debug, Default)]
pub struct EncodedEndpoints {
    services: Table,
    json: OnceLock<Vec<u8>>,
}

impl EncodedEndpoints {
    fn new(services: Table) -> Arc<EncodedEndpoints> {
        Arc::new(EncodedEndpoints {
            services,
            json: OnceLock::new(),
        })
    }

    /// The table as a JSON array, encoded on the first call.
    pub fn json(&self) -> Result<&[u8], serde_json::Error> {
        if let Some(done) = self.json.get() {
            return Ok(done);
        }
        // Two threads may both encode the first time; one result is kept.
        let entries: Vec<&ServiceEndpoints> = self.services.iter().map(Arc::as_ref).collect();
        let encoded = serde_json::to_vec(&entries)?;
        Ok(self.json.get_or_init(|| encoded))
    }
}

/// A generation [`Cluster::refresh_endpoints`] hands out for the worker to
/// publish: the whole table, and which services changed since the
/// generation handed out before, so long polls can be answered with
/// changes too.
#[derive(Debug, Clone, PartialEq)]
pub struct NewGeneration {
    /// Its number.
    pub generation: u64,
    /// The whole table, in name order.
    pub services: Table,
    /// The generation handed out before and the services changed since;
    /// `None` for the first one, or when the log no longer reaches back.
    pub changed: Option<(u64, BTreeSet<String>)>,
}

/// The table last published and its numbering; see the module docs.
#[derive(Debug, Default)]
pub(super) struct PublishedEndpoints {
    /// The generation of `services`; 1 for the table at the start.
    generation: u64,
    /// Identifies this process's generations.
    origin: u64,
    /// The table of `generation`.
    services: Table,
    /// The same, as heartbeat answers splice it in.
    encoded: Arc<EncodedEndpoints>,
    /// The same entries by service name, the ones a recomputation rebuilds
    /// (see [`super::dirty`]).
    by_name: BTreeMap<String, Arc<ServiceEndpoints>>,
    /// The generation [`Cluster::refresh_endpoints`] last handed out.
    announced: u64,
    /// The generation before the log's first entry: every generation from
    /// it to `generation` can be answered with changes.
    log_base: u64,
    /// The services each generation after `log_base` changed, in order:
    /// entry `i` made generation `log_base + 1 + i`.
    log: VecDeque<Vec<String>>,
    /// The changes to `generation` answered so far, by the generation they
    /// start from; emptied with every new generation.
    changes: BTreeMap<u64, Arc<EndpointChanges>>,
}

impl PublishedEndpoints {
    /// The services changed from generation `held` to the current one;
    /// `None` when the log does not reach back to `held`.
    fn names_changed_since(&self, held: u64) -> Option<BTreeSet<&String>> {
        if held < self.log_base || held > self.generation {
            return None;
        }
        let skip = usize::try_from(held - self.log_base).ok()?;
        Some(self.log.iter().skip(skip).flatten().collect())
    }
}

impl Cluster {
    /// Generation 1: the table at the start (every node Unknown).
    pub(super) fn start_endpoints(&mut self, now: Instant) {
        let services: Table = Arc::new(self.endpoints(now).into_iter().map(Arc::new).collect());
        self.published = PublishedEndpoints {
            generation: 1,
            origin: first_peers_version(),
            by_name: services
                .iter()
                .map(|s| (s.name.clone(), Arc::clone(s)))
                .collect(),
            encoded: EncodedEndpoints::new(Arc::clone(&services)),
            services,
            announced: 0,
            log_base: 1,
            log: VecDeque::new(),
            changes: BTreeMap::new(),
        };
        // Built from scratch just now.
        self.take_endpoint_marks();
    }

    /// Recomputes the entries of the services whose inputs changed (see
    /// [`super::dirty`]); a new generation when the table differs from the
    /// published one. True when it changed.
    pub(super) fn recompute_endpoints(&mut self, now: Instant) -> bool {
        // A node that died by the clock alone marks what it concerns.
        self.notice_deaths(now);
        let Some(marked) = self.take_endpoint_marks() else {
            return false;
        };
        let names: Vec<String> = match marked {
            Marked::All => {
                let mut all: BTreeSet<String> = self.state.services.keys().cloned().collect();
                all.extend(self.published.by_name.keys().cloned());
                all.into_iter().collect()
            }
            Marked::Only(names) => names.into_iter().collect(),
        };
        let mut changed = Vec::new();
        for name in names {
            self.dirty.work.endpoints_rebuilt += 1;
            let entry = self.service_endpoints(&name, now);
            if self.published.by_name.get(&name).map(Arc::as_ref) == entry.as_ref() {
                continue;
            }
            match entry {
                Some(entry) => self.published.by_name.insert(name.clone(), Arc::new(entry)),
                None => self.published.by_name.remove(&name),
            };
            changed.push(name);
        }
        if changed.is_empty() {
            return false;
        }
        let p = &mut self.published;
        p.log.push_back(changed);
        if p.log.len() > ENDPOINT_LOG_LEN {
            p.log.pop_front();
            p.log_base += 1;
        }
        self.published.generation += 1;
        self.published.changes.clear();
        self.published.services = Arc::new(self.published.by_name.values().cloned().collect());
        self.published.encoded = EncodedEndpoints::new(Arc::clone(&self.published.services));
        true
    }

    /// Recomputes the table (see the module docs) and answers it when its
    /// generation was not handed out by an earlier call: the worker
    /// publishes what this answers to the API's board. The table is shared,
    /// not copied.
    pub fn refresh_endpoints(&mut self, now: Instant) -> Option<NewGeneration> {
        self.recompute_endpoints(now);
        let p = &mut self.published;
        if p.generation == p.announced {
            return None;
        }
        let before = p.announced;
        p.announced = p.generation;
        let changed = (before > 0)
            .then(|| p.names_changed_since(before))
            .flatten()
            .map(|names| (before, names.into_iter().cloned().collect()));
        Some(NewGeneration {
            generation: p.generation,
            services: Arc::clone(&p.services),
            changed,
        })
    }

    /// The current table and its generation, recomputed first (a heartbeat
    /// answer carries them).
    pub(super) fn current_endpoints(&mut self, now: Instant) -> (u64, Arc<EncodedEndpoints>) {
        self.recompute_endpoints(now);
        (
            self.published.generation,
            Arc::clone(&self.published.encoded),
        )
    }

    /// The entries changed and gone between generation `held` and the
    /// current one; `None` when the log does not reach back to `held`, or
    /// when more than half the table changed (the whole table, encoded
    /// once per generation, is then cheaper). Call after
    /// [`Cluster::current_endpoints`].
    pub fn endpoint_changes_since(&mut self, held: u64) -> Option<Arc<EndpointChanges>> {
        let p = &mut self.published;
        if held < p.log_base || held >= p.generation {
            return None;
        }
        if let Some(done) = p.changes.get(&held) {
            return Some(Arc::clone(done));
        }
        let names = p.names_changed_since(held)?;
        if names.len() * 2 > p.by_name.len().max(1) {
            return None;
        }
        let mut changed = Vec::new();
        let mut removed = Vec::new();
        for name in names {
            match p.by_name.get(name) {
                Some(entry) => changed.push(Arc::clone(entry)),
                None => removed.push(name.clone()),
            }
        }
        let changes = Arc::new(EndpointChanges {
            changed: EncodedEndpoints::new(Arc::new(changed)),
            removed,
        });
        p.changes.insert(held, Arc::clone(&changes));
        Some(changes)
    }

    /// The table last published and its generation, shared, without
    /// recomputing.
    pub fn published_endpoints(&self) -> (u64, Table) {
        (
            self.published.generation,
            Arc::clone(&self.published.services),
        )
    }

    /// The generation of the table last published, without recomputing.
    pub fn endpoints_generation(&self) -> u64 {
        self.published.generation
    }

    /// Identifies this process's generations; see the module docs.
    pub fn endpoints_origin(&self) -> u64 {
        self.published.origin
    }

    /// Connections to replica `addr` that the proxies of nodes not Dead
    /// reported open in their last heartbeats.
    pub(super) fn open_connections(&self, addr: SocketAddrV4, now: Instant) -> u32 {
        self.live
            .iter()
            .filter(|(id, _)| self.not_dead(id, now))
            .filter_map(|(_, l)| l.connections.get(&addr))
            .fold(0u32, |sum, open| sum.saturating_add(*open))
    }

    /// True when every Alive node's proxy has applied `generation` or a
    /// later one; Unknown and Dead nodes do not hold it up.
    pub(super) fn endpoints_caught_up(&self, generation: u64, now: Instant) -> bool {
        self.live
            .iter()
            .filter(|(id, _)| self.reported_liveness(id, now) == Some(Liveness::Alive))
            .all(|(_, l)| l.endpoints_applied.is_some_and(|g| g >= generation))
    }
}
