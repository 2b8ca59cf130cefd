//! Carrying out a heal the worker planned: replica applies forwarded with the
//! service document and their new epoch, removals forwarded as deletes.
//!
//! The actions go out concurrently: a node that held 1,000 replicas must not
//! have its replacements sent one PUT at a time. At most [`PER_NODE`]
//! requests are in flight to any one node (an agent serves an apply on its
//! worker thread, so more would only queue there and hold connections), and
//! at most [`MAX_THREADS`] in all. Each outcome is reported to the worker as
//! it comes back; the worker takes the reports that arrive together in one
//! batch, so their placements reach the journal in one group commit.
//!
//! This file never plans: what to apply where, and under which epoch, is the
//! registry's decision (`registry::services`, `registry::rollout`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Condvar, Mutex};

use crate::common::sync::lock;
use crate::common::wire::{COMMITTED_HEADER, parse_committed, volumes_query};
use crate::controlplane::api::Forwarder;
use crate::controlplane::registry::HealAction;
use crate::controlplane::worker::WorkerHandle;

/// Requests in flight to one node at most.
pub const PER_NODE: usize = 4;

/// Threads carrying out one heal at most.
pub const MAX_THREADS: usize = 32;

/// Carries out `actions` (see the module docs) and returns what failed, one
/// line each; every service they touch is reported done to the worker once
/// all are over.
pub fn heal(worker: &WorkerHandle, forwarder: &Forwarder, actions: Vec<HealAction>) -> Vec<String> {
    let mut services: Vec<String> = Vec::new();
    for a in &actions {
        let service = match a {
            HealAction::Place { service, .. } | HealAction::Remove { service, .. } => service,
        };
        if !services.contains(service) {
            services.push(service.clone());
        }
    }
    let threads = actions.len().min(MAX_THREADS);
    let queue = Queue {
        state: Mutex::new(QueueState {
            waiting: actions.into(),
            in_flight: BTreeMap::new(),
        }),
        changed: Condvar::new(),
    };
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                while let Some(action) = queue.next() {
                    let node = node_of(&action).to_string();
                    if let Err(failure) = carry_out(worker, forwarder, action) {
                        lock(&failures).push(failure);
                    }
                    queue.done(&node);
                }
            });
        }
    });
    worker.heal_done(services);
    failures.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// The actions not started yet, and the requests in flight per node.
struct Queue {
    state: Mutex<QueueState>,
    changed: Condvar,
}

struct QueueState {
    waiting: VecDeque<HealAction>,
    in_flight: BTreeMap<String, usize>,
}

impl Queue {
    /// The first waiting action whose node has room, waiting for room when
    /// every waiting action's node is full; `None` once nothing waits.
    fn next(&self) -> Option<HealAction> {
        let mut state = lock(&self.state);
        loop {
            if state.waiting.is_empty() {
                return None;
            }
            let free = state
                .waiting
                .iter()
                .position(|a| state.in_flight.get(node_of(a)).copied().unwrap_or(0) < PER_NODE);
            if let Some(action) = free.and_then(|i| state.waiting.remove(i)) {
                *state
                    .in_flight
                    .entry(node_of(&action).to_string())
                    .or_default() += 1;
                return Some(action);
            }
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// A request to `node` is over.
    fn done(&self, node: &str) {
        let mut state = lock(&self.state);
        if let Some(n) = state.in_flight.get_mut(node) {
            *n = n.saturating_sub(1);
        }
        drop(state);
        self.changed.notify_all();
    }
}

fn node_of(action: &HealAction) -> &str {
    match action {
        HealAction::Place { target, .. } => &target.node,
        HealAction::Remove { node, .. } => node,
    }
}

/// One action: the request to its node, then its outcome to the worker.
fn carry_out(
    worker: &WorkerHandle,
    forwarder: &Forwarder,
    action: HealAction,
) -> Result<(), String> {
    match action {
        HealAction::Place {
            service,
            replica,
            target,
            volumes,
            template,
        } => {
            let mut reached = false;
            let outcome = match worker.service_document(&service) {
                Ok(Some((_, digest))) if digest != template => Err(
                    "the service's template changed meanwhile; the next heal applies the new one"
                        .to_string(),
                ),
                Ok(Some((doc, _))) => {
                    let path = format!("/jails/{replica}");
                    let r = forwarder.send_with_query(
                        &target.node,
                        target.addr,
                        "PUT",
                        &path,
                        volumes_query(&volumes),
                        doc.as_bytes(),
                        Some(target.epoch),
                    );
                    reached = !(400..500).contains(&r.status);
                    if let Some(c) = r.header(COMMITTED_HEADER).and_then(parse_committed) {
                        let _ = worker.note_committed(&target.node, c);
                    }
                    (200..300)
                        .contains(&r.status)
                        .then_some(())
                        .ok_or_else(|| String::from_utf8_lossy(&r.body).into_owned())
                }
                Ok(None) => Err("the service was deleted meanwhile".into()),
                Err(e) => Err(e.to_string()),
            };
            let node = target.node.clone();
            let _ = worker.finish_apply(&replica, target, outcome.is_ok(), reached);
            outcome.map_err(|e| format!("{replica} on {node}: {e}"))
        }
        HealAction::Remove {
            replica,
            node,
            addr,
            ..
        } => {
            if let Some(addr) = addr {
                let r = forwarder.send(
                    &node,
                    addr,
                    "DELETE",
                    &format!("/jails/{replica}"),
                    b"",
                    None,
                );
                if !(200..300).contains(&r.status) && r.status != 404 {
                    return Err(format!(
                        "{replica} on {node}: {}",
                        String::from_utf8_lossy(&r.body)
                    ));
                }
            }
            let _ = worker.remove_placement(&replica, &node);
            Ok(())
        }
    }
}
