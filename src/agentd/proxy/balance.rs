//! One service's replica list, its round-robin cursor, which replicas are
//! ejected for failing, and how many connections each replica holds.
//!
//! [`Backends`] is shared between the proxy's control loop (which swaps the
//! list in place when a heartbeat brings a new one) and every connection the
//! service accepts (which picks its replicas once, at accept time, and
//! reports how each attempt went). It owns the choice of replica and nothing
//! else: it never opens a socket and never reads the clock except through
//! its injected [`Clock`].
//!
//! The list is an `Arc<[Arc<Replica>]>` behind a mutex held only to clone the
//! `Arc`, so a swap never waits for a connection and a connection never sees a
//! half-written list. The cursor survives swaps: after a scale-up the rotation
//! simply continues over the longer list.
//!
//! Passive health: a replica that refused a connect, did not answer it in
//! time, or reset before its first byte is ejected for a back-off (1 s,
//! doubling to 30 s while each try after the back-off fails again, forgotten
//! on its first success). [`Backends::pick`] puts the ready replicas first, in
//! rotation order, and fills the remaining attempts with ejected ones, the
//! soonest due first: a service whose replicas all failed is still tried
//! rather than closed. While no replica is ejected, picking takes no lock
//! beyond the list's.
//!
//! Draining: a replica dropped from the list gets no new connection; its
//! established ones keep their [`Open`] guard, and [`Backends::loads`] keeps
//! reporting it until the last one closed, so whoever stops the replica can
//! wait for it to drain.

use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::backoff::{Backoff, Clock, Policy, SystemClock};
use crate::common::sync::lock;

use super::stats::ServiceCounters;

/// Most replicas one connection tries (fewer when the service has fewer):
/// enough to get past a replica that just died and one more, few enough that
/// a client of a service that is down everywhere learns it within a few
/// connect timeouts.
pub const MAX_ATTEMPTS: usize = 3;

/// Ejection of a replica that failed once.
pub const EJECT_INITIAL: Duration = Duration::from_secs(1);

/// Longest ejection, for a replica that keeps failing after each back-off.
pub const EJECT_CAP: Duration = Duration::from_secs(30);

/// One replica and the connections relaying to it now.
#[derive(Debug)]
pub struct Replica {
    addr: SocketAddrV4,
    open: AtomicUsize,
    /// Its service's counters: a connection's [`Open`] reaches them through
    /// its replica, so the connection's own state holds nothing for them.
    counters: Arc<ServiceCounters>,
}

impl Replica {
    /// Where the replica listens.
    pub fn addr(&self) -> SocketAddrV4 {
        self.addr
    }

    /// Counts one connection to this replica until the guard is dropped.
    pub fn open(self: &Arc<Replica>) -> Open {
        // Relaxed: the count orders nothing; readers want a number, not a
        // happens-before edge.
        self.open.fetch_add(1, Ordering::Relaxed);
        self.counters.open.fetch_add(1, Ordering::Relaxed);
        Open(Arc::clone(self))
    }

    fn open_connections(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }
}

/// One connection counted against its replica (see [`Replica::open`]).
#[derive(Debug)]
pub struct Open(Arc<Replica>);

impl Open {
    /// The service's counters (the connection is one of its open ones).
    pub fn counters(&self) -> &ServiceCounters {
        &self.0.counters
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
        self.0.counters.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The replicas one connection may try, in order: at most [`MAX_ATTEMPTS`],
/// each at most once. Held in place (no allocation per connection).
#[derive(Debug, Default)]
pub struct Attempts {
    replicas: [Option<Arc<Replica>>; MAX_ATTEMPTS],
    len: usize,
}

impl Attempts {
    fn push(&mut self, replica: &Arc<Replica>) {
        if self.len < MAX_ATTEMPTS {
            self.replicas[self.len] = Some(Arc::clone(replica));
            self.len += 1;
        }
    }

    fn is_full(&self) -> bool {
        self.len == MAX_ATTEMPTS
    }

    /// The replicas to try, first choice first.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Replica>> {
        self.replicas[..self.len].iter().flatten()
    }

    /// Their addresses, first choice first.
    pub fn addrs(&self) -> Vec<SocketAddrV4> {
        self.iter().map(|r| r.addr).collect()
    }
}

/// One replica as [`Backends::loads`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaLoad {
    /// Where the replica listens.
    pub addr: SocketAddrV4,
    /// Connections relaying to it now.
    pub open: usize,
    /// False once the table dropped it: it only drains.
    pub listed: bool,
    /// True while it is ejected for failing.
    pub ejected: bool,
}

/// The replica list of one service and where its rotation stands.
pub struct Backends {
    replicas: Mutex<Arc<[Arc<Replica>]>>,
    /// Replicas dropped from the list that still had connections then.
    draining: Mutex<Vec<Arc<Replica>>>,
    next: AtomicUsize,
    ejections: Mutex<Backoff<SocketAddrV4>>,
    /// Number of replicas with an ejection record: zero keeps [`Backends::pick`]
    /// off the `ejections` lock.
    failing: AtomicUsize,
    clock: Arc<dyn Clock>,
    /// The service's counters (`super::stats`), reached through the
    /// connection's `Backends` and [`Open`], so a connection's own state
    /// holds no field for them.
    counters: Arc<ServiceCounters>,
}

impl std::fmt::Debug for Backends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backends")
            .field("replicas", &*lock(&self.replicas))
            .finish_non_exhaustive()
    }
}

impl Backends {
    /// A rotation over `replicas`, starting at the first, on the system clock.
    pub fn new(replicas: &[SocketAddrV4]) -> Backends {
        Backends::with_clock(replicas, Arc::new(SystemClock), EJECT_INITIAL)
    }

    /// A rotation whose ejections are timed by `clock` (tests step it) and
    /// start at `eject_initial`.
    pub fn with_clock(
        replicas: &[SocketAddrV4],
        clock: Arc<dyn Clock>,
        eject_initial: Duration,
    ) -> Backends {
        Backends::with_counters(replicas, clock, eject_initial, Arc::default())
    }

    /// [`Backends::with_clock`], counting into `counters` (the service's,
    /// `super::stats`).
    pub fn with_counters(
        replicas: &[SocketAddrV4],
        clock: Arc<dyn Clock>,
        eject_initial: Duration,
        counters: Arc<ServiceCounters>,
    ) -> Backends {
        let list: Vec<Arc<Replica>> = replicas
            .iter()
            .map(|a| new_replica(*a, &counters))
            .collect();
        Backends {
            replicas: Mutex::new(list.into()),
            draining: Mutex::new(Vec::new()),
            next: AtomicUsize::new(0),
            ejections: Mutex::new(Backoff::with_policy(Policy {
                initial: eject_initial,
                // Raised to `eject_initial` when that is longer.
                cap: EJECT_CAP,
                // Never reached: a success forgets the record outright.
                stable_after: Duration::MAX,
            })),
            failing: AtomicUsize::new(0),
            clock,
            counters,
        }
    }

    /// The service's counters.
    pub fn counters(&self) -> &Arc<ServiceCounters> {
        &self.counters
    }

    /// Replaces the list in place; connections already relaying are not
    /// affected, the next accepted one uses the new list. A replica kept by
    /// the new list keeps its ejection and its count.
    pub fn replace(&self, replicas: &[SocketAddrV4]) {
        let mut current = lock(&self.replicas);
        let mut draining = lock(&self.draining);
        let old: Vec<Arc<Replica>> = current.iter().cloned().collect();
        let known = |addr: &SocketAddrV4| {
            old.iter()
                .chain(draining.iter())
                .find(|r| r.addr == *addr)
                .cloned()
        };
        let list: Vec<Arc<Replica>> = replicas
            .iter()
            .map(|a| known(a).unwrap_or_else(|| new_replica(*a, &self.counters)))
            .collect();
        let dropped: Vec<Arc<Replica>> = old
            .into_iter()
            .filter(|r| !replicas.contains(&r.addr))
            .collect();
        // A dropped replica that comes back is a new deployment as far as
        // its health goes: it starts with a clean record.
        let mut ejections = lock(&self.ejections);
        for r in &dropped {
            ejections.forget(&r.addr);
        }
        self.failing.store(ejections.len(), Ordering::Relaxed);
        drop(ejections);
        draining.extend(dropped);
        draining.retain(|r| r.open_connections() > 0 && !replicas.contains(&r.addr));
        *current = list.into();
    }

    /// Adds the replicas of `replicas` the list lacks and drops none: for a
    /// table the control plane marked unsettled (it has not yet heard from
    /// every node since it started, so its list may lack replicas that serve).
    pub fn widen(&self, replicas: &[SocketAddrV4]) {
        let mut list: Vec<SocketAddrV4> = lock(&self.replicas).iter().map(|r| r.addr).collect();
        for r in replicas {
            if !list.contains(r) {
                list.push(*r);
            }
        }
        self.replace(&list);
    }

    /// Number of replicas in the current list.
    pub fn len(&self) -> usize {
        lock(&self.replicas).len()
    }

    /// True when the service has no replica (connections are closed at once).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes the next turn: the replicas to try, in order. `None` when there
    /// is no replica.
    pub fn pick(&self) -> Option<Attempts> {
        let list = Arc::clone(&lock(&self.replicas));
        let n = list.len();
        if n == 0 {
            return None;
        }
        // Relaxed: the counter orders nothing but itself; fetch_add alone makes
        // concurrent accepts take distinct turns.
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let in_turn = (0..n).map(|i| &list[turn.wrapping_add(i) % n]);
        let mut attempts = Attempts::default();
        if self.failing.load(Ordering::Relaxed) == 0 {
            in_turn.for_each(|r| attempts.push(r));
            return Some(attempts);
        }
        let now = self.clock.now();
        let ejections = lock(&self.ejections);
        let mut ejected = Vec::new();
        for r in in_turn {
            match ejections.next_attempt(&r.addr) {
                Some(due) if due > now => ejected.push((due, r)),
                _ => attempts.push(r),
            }
        }
        // Stable sort: replicas due at the same instant stay in turn order.
        ejected.sort_by_key(|(due, _)| *due);
        for (_, r) in ejected {
            if attempts.is_full() {
                break;
            }
            attempts.push(r);
        }
        Some(attempts)
    }

    /// Records that `addr` refused or timed out a connect or reset before its
    /// first byte: it is ejected. A failure while it is already ejected (a
    /// connection picked it before the ejection) changes nothing; a failure
    /// after its back-off ended doubles the back-off.
    pub fn failed(&self, addr: SocketAddrV4) {
        let now = self.clock.now();
        let mut ejections = lock(&self.ejections);
        if ejections.ready(&addr, now) {
            let wait = ejections.record_failure(&addr, now);
            log::info!(
                "proxy: replica {addr} failed; out of rotation for {} ms",
                wait.as_millis()
            );
        }
        self.failing.store(ejections.len(), Ordering::Relaxed);
    }

    /// Records that `addr` answered: its ejection record is forgotten.
    pub fn succeeded(&self, addr: SocketAddrV4) {
        if self.failing.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut ejections = lock(&self.ejections);
        if ejections.next_attempt(&addr).is_some() {
            log::info!("proxy: replica {addr} answers again; back in rotation");
        }
        ejections.forget(&addr);
        self.failing.store(ejections.len(), Ordering::Relaxed);
    }

    /// Every listed replica, then every dropped one still draining, with its
    /// open connections and whether it is ejected now.
    pub fn loads(&self) -> Vec<ReplicaLoad> {
        let list = Arc::clone(&lock(&self.replicas));
        let draining: Vec<Arc<Replica>> = {
            let mut draining = lock(&self.draining);
            draining.retain(|r| r.open_connections() > 0);
            draining.clone()
        };
        let now = self.clock.now();
        let ejections = lock(&self.ejections);
        let load = |r: &Arc<Replica>, listed| ReplicaLoad {
            addr: r.addr,
            open: r.open_connections(),
            listed,
            ejected: ejections.next_attempt(&r.addr).is_some_and(|due| due > now),
        };
        list.iter()
            .map(|r| load(r, true))
            .chain(draining.iter().map(|r| load(r, false)))
            .collect()
    }
}

fn new_replica(addr: SocketAddrV4, counters: &Arc<ServiceCounters>) -> Arc<Replica> {
    Arc::new(Replica {
        addr,
        open: AtomicUsize::new(0),
        counters: Arc::clone(counters),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::backoff::ManualClock;
    use std::net::Ipv4Addr;

    fn addr(last: u8) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::new(127, 65, 0, last), 8080)
    }

    fn on_clock(replicas: &[SocketAddrV4]) -> (Backends, ManualClock) {
        let clock = ManualClock::new();
        (
            Backends::with_clock(replicas, Arc::new(clock.clone()), EJECT_INITIAL),
            clock,
        )
    }

    fn firsts(b: &Backends, turns: usize) -> Vec<SocketAddrV4> {
        (0..turns)
            .map(|_| b.pick().expect("replicas").addrs()[0])
            .collect()
    }

    #[test]
    fn turns_go_round_robin_and_the_retries_are_the_next_replicas() {
        let b = Backends::new(&[addr(1), addr(2), addr(3), addr(4)]);
        let picks: Vec<_> = (0..4)
            .map(|_| b.pick().expect("replicas").addrs())
            .collect();
        assert_eq!(
            picks,
            [
                [addr(1), addr(2), addr(3)],
                [addr(2), addr(3), addr(4)],
                [addr(3), addr(4), addr(1)],
                [addr(4), addr(1), addr(2)],
            ]
        );
    }

    #[test]
    fn attempts_are_bounded_by_the_replica_count() {
        let b = Backends::new(&[addr(1), addr(2)]);
        assert_eq!(b.pick().expect("replicas").addrs(), [addr(1), addr(2)]);
        let single = Backends::new(&[addr(1)]);
        assert_eq!(single.pick().expect("one replica").addrs(), [addr(1)]);
    }

    #[test]
    fn a_failed_replica_is_skipped_until_its_back_off_ends() {
        let (b, clock) = on_clock(&[addr(1), addr(2), addr(3)]);
        b.failed(addr(2));
        // Its turns go to the others; it is still a last resort.
        assert_eq!(
            b.pick().expect("replicas").addrs(),
            [addr(1), addr(3), addr(2)]
        );
        assert_eq!(
            b.pick().expect("replicas").addrs(),
            [addr(3), addr(1), addr(2)]
        );
        assert_eq!(firsts(&b, 3), [addr(3), addr(1), addr(3)]);
        clock.advance(EJECT_INITIAL);
        assert_eq!(firsts(&b, 3), [addr(3), addr(1), addr(2)]);
    }

    #[test]
    fn the_back_off_doubles_while_it_keeps_failing_and_resets_on_success() {
        let (b, clock) = on_clock(&[addr(1), addr(2)]);
        let ejected = |b: &Backends| b.loads().iter().filter(|l| l.ejected).count();
        let mut waits = Vec::new();
        for _ in 0..7 {
            b.failed(addr(1));
            // In-flight connections failing meanwhile do not stretch it.
            b.failed(addr(1));
            let mut waited = Duration::ZERO;
            while ejected(&b) == 1 {
                clock.advance(Duration::from_millis(500));
                waited += Duration::from_millis(500);
            }
            waits.push(waited.as_secs());
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        b.succeeded(addr(1));
        b.failed(addr(1));
        clock.advance(EJECT_INITIAL);
        assert_eq!(ejected(&b), 0, "a success starts the back-off over at 1 s");
    }

    #[test]
    fn when_every_replica_is_ejected_the_soonest_due_is_tried_first() {
        let (b, clock) = on_clock(&[addr(1), addr(2), addr(3), addr(4)]);
        b.failed(addr(3));
        clock.advance(Duration::from_millis(100));
        b.failed(addr(1));
        clock.advance(Duration::from_millis(100));
        b.failed(addr(4));
        clock.advance(Duration::from_millis(100));
        b.failed(addr(2));
        assert_eq!(
            b.pick().expect("replicas").addrs(),
            [addr(3), addr(1), addr(4)]
        );
        assert!(b.loads().iter().all(|l| l.ejected));
    }

    #[test]
    fn a_replica_dropped_from_the_list_drains_and_gets_no_new_turn() {
        let b = Backends::new(&[addr(1), addr(2)]);
        let first = b.pick().expect("replicas");
        let replica = first.iter().next().expect("one");
        assert_eq!(replica.addr(), addr(1));
        let open = replica.open();
        let second = replica.open();
        drop(first);
        b.replace(&[addr(2), addr(3)]);
        assert!(
            (0..6).all(|_| !b.pick().expect("replicas").addrs().contains(&addr(1))),
            "a dropped replica is never tried again"
        );
        let load = |b: &Backends| {
            b.loads()
                .into_iter()
                .map(|l| (l.addr, l.open, l.listed))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            load(&b),
            [(addr(2), 0, true), (addr(3), 0, true), (addr(1), 2, false)]
        );
        drop(open);
        assert_eq!(load(&b)[2], (addr(1), 1, false));
        drop(second);
        assert_eq!(load(&b), [(addr(2), 0, true), (addr(3), 0, true)]);
    }

    #[test]
    fn a_replica_back_in_the_list_keeps_its_count() {
        let b = Backends::new(&[addr(1)]);
        let open = b
            .pick()
            .expect("replica")
            .iter()
            .next()
            .expect("one")
            .open();
        b.replace(&[]);
        b.replace(&[addr(1)]);
        assert_eq!(b.loads()[0].open, 1);
        drop(open);
        assert_eq!(b.loads()[0].open, 0);
    }

    #[test]
    fn a_dropped_replica_forgets_its_ejection() {
        let (b, _clock) = on_clock(&[addr(1), addr(2)]);
        b.failed(addr(1));
        b.replace(&[addr(2)]);
        b.replace(&[addr(1), addr(2)]);
        assert_eq!(b.pick().expect("replicas").addrs(), [addr(1), addr(2)]);
    }

    #[test]
    fn widening_keeps_every_replica_and_adds_the_new_ones() {
        let b = Backends::new(&[addr(1), addr(2), addr(3)]);
        // A list that names only the replica of the one node heard from yet.
        b.widen(&[addr(2), addr(4)]);
        assert_eq!(firsts(&b, 4), [addr(1), addr(2), addr(3), addr(4)]);
        b.replace(&[addr(2)]);
        assert_eq!(b.len(), 1);
    }

    #[test]
    fn empty_list_has_no_turn() {
        let b = Backends::new(&[]);
        assert!(b.is_empty());
        assert!(b.pick().is_none());
    }

    #[test]
    fn replacing_the_list_keeps_the_rotation_going() {
        let b = Backends::new(&[addr(1), addr(2)]);
        assert_eq!(firsts(&b, 1), [addr(1)]);
        b.replace(&[addr(1), addr(2), addr(3), addr(4)]);
        assert_eq!(b.len(), 4);
        assert_eq!(firsts(&b, 4), [addr(2), addr(3), addr(4), addr(1)]);
        b.replace(&[]);
        assert!(b.pick().is_none());
    }
}
