//! One service's replica list and its round-robin cursor.
//!
//! [`Backends`] is shared between the proxy's control loop (which swaps the
//! list in place when a heartbeat brings a new one) and every connection the
//! service accepts (which reads it once, at accept time). It owns the choice
//! of replica and nothing else: it never opens a socket.
//!
//! The list is an `Arc<[SocketAddrV4]>` behind a mutex held only to clone the
//! `Arc`, so a swap never waits for a connection and a connection never sees a
//! half-written list. The cursor survives swaps: after a scale-up the rotation
//! simply continues over the longer list.

use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::common::sync::lock;

/// The replica list of one service and where its rotation stands.
#[derive(Debug)]
pub struct Backends {
    replicas: Mutex<Arc<[SocketAddrV4]>>,
    next: AtomicUsize,
}

/// The replicas one connection may try, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempts {
    /// The replica whose turn it is.
    pub first: SocketAddrV4,
    /// The next one in rotation, tried once if `first` fails; `None` when the
    /// service has a single replica (retrying it would only double the wait).
    pub retry: Option<SocketAddrV4>,
}

impl Backends {
    /// A rotation over `replicas`, starting at the first.
    pub fn new(replicas: &[SocketAddrV4]) -> Backends {
        Backends {
            replicas: Mutex::new(replicas.into()),
            next: AtomicUsize::new(0),
        }
    }

    /// Replaces the list in place; connections already relaying are not
    /// affected, the next accepted one uses the new list.
    pub fn replace(&self, replicas: &[SocketAddrV4]) {
        *lock(&self.replicas) = replicas.into();
    }

    /// Adds the replicas of `replicas` the list lacks and drops none: for a
    /// table the control plane marked unsettled (it has not yet heard from
    /// every node since it started, so its list may lack replicas that serve).
    pub fn widen(&self, replicas: &[SocketAddrV4]) {
        let mut current = lock(&self.replicas);
        let mut list = current.to_vec();
        for r in replicas {
            if !list.contains(r) {
                list.push(*r);
            }
        }
        *current = list.into();
    }

    /// Number of replicas in the current list.
    pub fn len(&self) -> usize {
        lock(&self.replicas).len()
    }

    /// True when the service has no replica (connections are closed at once).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes the next turn: the replica to connect to and the one to retry
    /// with. `None` when there is no replica.
    pub fn pick(&self) -> Option<Attempts> {
        let list = Arc::clone(&lock(&self.replicas));
        let n = list.len();
        if n == 0 {
            return None;
        }
        // Relaxed: the counter orders nothing but itself; fetch_add alone makes
        // concurrent accepts take distinct turns.
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        Some(Attempts {
            first: list[turn % n],
            retry: (n > 1).then(|| list[(turn + 1) % n]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn addr(last: u8) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::new(127, 65, 0, last), 8080)
    }

    #[test]
    fn turns_go_round_robin_and_the_retry_is_the_next_replica() {
        let b = Backends::new(&[addr(1), addr(2), addr(3)]);
        let picks: Vec<_> = (0..6).map(|_| b.pick().expect("replicas")).collect();
        let firsts: Vec<_> = picks.iter().map(|p| p.first).collect();
        assert_eq!(
            firsts,
            [addr(1), addr(2), addr(3), addr(1), addr(2), addr(3)]
        );
        let retries: Vec<_> = picks.iter().map(|p| p.retry).collect();
        assert_eq!(
            retries,
            [addr(2), addr(3), addr(1), addr(2), addr(3), addr(1)].map(Some)
        );
    }

    #[test]
    fn widening_keeps_every_replica_and_adds_the_new_ones() {
        let b = Backends::new(&[addr(1), addr(2), addr(3)]);
        // A list that names only the replica of the one node heard from yet.
        b.widen(&[addr(2), addr(4)]);
        let firsts: Vec<_> = (0..4).map(|_| b.pick().expect("replicas").first).collect();
        assert_eq!(firsts, [addr(1), addr(2), addr(3), addr(4)]);
        b.replace(&[addr(2)]);
        assert_eq!(b.len(), 1);
    }

    #[test]
    fn empty_list_has_no_turn() {
        let b = Backends::new(&[]);
        assert!(b.is_empty());
        assert_eq!(b.pick(), None);
    }

    #[test]
    fn single_replica_has_no_retry() {
        let b = Backends::new(&[addr(1)]);
        let p = b.pick().expect("one replica");
        assert_eq!(p.first, addr(1));
        assert_eq!(p.retry, None);
    }

    #[test]
    fn replacing_the_list_keeps_the_rotation_going() {
        let b = Backends::new(&[addr(1), addr(2)]);
        assert_eq!(b.pick().map(|p| p.first), Some(addr(1)));
        b.replace(&[addr(1), addr(2), addr(3), addr(4)]);
        assert_eq!(b.len(), 4);
        let firsts: Vec<_> = (0..4).map(|_| b.pick().expect("replicas").first).collect();
        assert_eq!(firsts, [addr(2), addr(3), addr(4), addr(1)]);
        b.replace(&[]);
        assert_eq!(b.pick(), None);
    }
}
