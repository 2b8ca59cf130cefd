//! The board the worker pins the endpoint table to, and the API's handler
//! threads read without asking the worker: `GET /nodes/{id}/endpoints`
//! answers from here, and a long poll waits here for the next generation.
//!
//! The worker is the only writer: after each batch of commands and on its
//! tick it asks the registry for a changed table
//! ([`crate::controlplane::registry::Cluster::refresh_endpoints`]) and
//! [`EndpointBoard::publish`]es it, which wakes every waiting poll. The
//! board also holds the registered node ids, so a poll for a node the
//! control plane does not know is refused without a trip to the worker.
//!
//! A reader holds the lock only to clone two `Arc`s, so a thousand waiting
//! polls never slow the worker down. The board never computes anything and
//! never talks to the network; waiting is bounded by the caller's timeout.

use std::collections::BTreeSet;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::common::sync::lock;
use crate::common::wire::ServiceEndpoints;

/// One published table: its generation and its services.
pub type Published = (u64, Arc<Vec<ServiceEndpoints>>);

struct Pinned {
    table: Published,
    nodes: Arc<BTreeSet<String>>,
}

/// See the module docs.
pub struct EndpointBoard {
    /// Identifies the control-plane process that numbers the generations.
    origin: u64,
    pinned: Mutex<Pinned>,
    changed: Condvar,
}

impl EndpointBoard {
    /// A board holding `generation` of `services` (numbered under
    /// `origin`) and the registered `nodes`.
    pub fn new(
        origin: u64,
        generation: u64,
        services: Vec<ServiceEndpoints>,
        nodes: BTreeSet<String>,
    ) -> EndpointBoard {
        EndpointBoard {
            origin,
            pinned: Mutex::new(Pinned {
                table: (generation, Arc::new(services)),
                nodes: Arc::new(nodes),
            }),
            changed: Condvar::new(),
        }
    }

    /// Identifies the process that numbers the generations.
    pub fn origin(&self) -> u64 {
        self.origin
    }

    /// Pins `services` as `generation` and wakes every waiting reader. An
    /// older generation than the one pinned is ignored.
    pub fn publish(&self, generation: u64, services: Vec<ServiceEndpoints>) {
        let mut pinned = lock(&self.pinned);
        if generation <= pinned.table.0 {
            return;
        }
        pinned.table = (generation, Arc::new(services));
        drop(pinned);
        self.changed.notify_all();
    }

    /// Replaces the registered node ids.
    pub fn set_nodes(&self, nodes: BTreeSet<String>) {
        lock(&self.pinned).nodes = Arc::new(nodes);
    }

    /// True when `id` is a registered node.
    pub fn knows(&self, id: &str) -> bool {
        lock(&self.pinned).nodes.contains(id)
    }

    /// The table pinned now.
    pub fn current(&self) -> Published {
        lock(&self.pinned).table.clone()
    }

    /// The pinned table as soon as its generation is above `after`: at once
    /// when it already is, else when the worker publishes one, else the
    /// current one once `timeout` has passed.
    pub fn wait_newer(&self, after: u64, timeout: Duration) -> Published {
        let deadline = Instant::now() + timeout;
        let mut pinned = lock(&self.pinned);
        loop {
            if pinned.table.0 > after {
                return pinned.table.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return pinned.table.clone();
            }
            pinned = self
                .changed
                .wait_timeout(pinned, left)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn table(name: &str) -> Vec<ServiceEndpoints> {
        vec![ServiceEndpoints {
            name: name.into(),
            vip: Ipv4Addr::new(10, 96, 0, 1),
            port: 80,
            replicas: Vec::new(),
            unsettled: false,
        }]
    }

    #[test]
    fn a_newer_generation_is_answered_at_once() {
        let board = EndpointBoard::new(7, 3, table("a"), BTreeSet::new());
        // A timeout no test run reaches: answering at once is the only way out.
        let (generation, services) = board.wait_newer(2, Duration::from_secs(3600));
        assert_eq!((generation, services.as_ref()), (3, &table("a")));
    }

    #[test]
    fn a_waiting_reader_gets_the_next_published_generation() {
        let board = Arc::new(EndpointBoard::new(7, 3, table("a"), BTreeSet::new()));
        let reader = {
            let board = Arc::clone(&board);
            std::thread::spawn(move || board.wait_newer(3, Duration::from_secs(3600)))
        };
        board.publish(4, table("b"));
        let (generation, services) = reader.join().expect("reader");
        assert_eq!((generation, services.as_ref()), (4, &table("b")));
    }

    #[test]
    fn without_a_change_the_wait_ends_with_the_current_table() {
        let board = EndpointBoard::new(7, 3, table("a"), BTreeSet::new());
        let (generation, services) = board.wait_newer(3, Duration::from_millis(1));
        assert_eq!((generation, services.as_ref()), (3, &table("a")));
    }

    #[test]
    fn an_older_generation_never_replaces_a_newer_one() {
        let board = EndpointBoard::new(7, 3, table("a"), BTreeSet::new());
        board.publish(2, table("old"));
        assert_eq!(board.current().0, 3);
        assert_eq!(board.current().1.as_ref(), &table("a"));
    }

    #[test]
    fn the_board_knows_the_registered_nodes() {
        let board = EndpointBoard::new(7, 1, Vec::new(), ["n1".to_string()].into());
        assert!(board.knows("n1") && !board.knows("n2"));
        board.set_nodes(["n2".to_string()].into());
        assert!(!board.knows("n1") && board.knows("n2"));
    }
}
