//! Connection admission for one listener: who gets a connection slot, who
//! loses one, and what each open connection currently counts as.
//!
//! Owns the accounting of open connections (the budget, the unauthenticated
//! share, the per-address share) and the choice of which connection to
//! evict. It must never read or write a socket itself beyond the eviction
//! handle it is given, and never decide whether a signature is valid: the
//! handler does that and the server reports the outcome through
//! [`Ticket::answered`].
//!
//! # The concurrency story
//!
//! Every listener has its own [`Admission`] (so the agent's Unix socket
//! never shares a budget with its TCP listener). The accept loop calls
//! [`Admission::admit`] for each new connection and hands the [`Ticket`] to
//! the connection's thread; the thread reports what the connection became
//! ([`Ticket::claim`], [`Ticket::answered`]) and gives the slot back by
//! dropping the ticket, however it ends. All of it is one short critical
//! section over one table; eviction handles are called after the lock is
//! released.
//!
//! A connection is in one of three stages:
//! - **unauthenticated**: it has not delivered a request yet, or its last
//!   answer was not to a request the handler verified (an unsigned
//!   `/healthz`, a 401). It waits for its next head under the short head
//!   deadline, and it can be evicted;
//! - **claimed**: it delivered a complete request whose head carries the
//!   `Keel-HMAC-SHA256` scheme, and the handler is working on it. It cannot
//!   be evicted, so a signed request under way is never cut; faking the
//!   scheme only buys the time the handler takes to refuse the signature;
//! - **trusted**: its last answer was to a verified request (or the listener
//!   trusts every peer: the Unix socket). It keeps the long idle timeout and
//!   cannot be evicted.
//!
//! The rules, for a listener that does not trust its peers (TCP):
//! - at most `max_connections` are open; at most `max_unauthenticated` of
//!   them are unauthenticated, so claimed and trusted connections always
//!   have `max_connections - max_unauthenticated` slots no flood can take;
//! - at most `max_unauthenticated_per_address` unauthenticated connections
//!   come from one IP address;
//! - a new connection is never refused because unauthenticated ones fill a
//!   share: it evicts the *oldest* unauthenticated connection (the oldest
//!   from its own address when that address is at its share), whose thread
//!   is unblocked by shutdown(2) on a clone of its socket. A flood therefore
//!   churns its own connections, while a legitimate client, whose head
//!   arrives milliseconds after it connects, is claimed long before a flood
//!   could push it to the front of the queue. Only when every open
//!   connection is claimed or trusted is a newcomer answered 503.
//!
//! Evictions and 503s are logged through a [`RefusalLog`], in summaries.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use super::request::Peer;
use crate::common::refusals::{DEFAULT_SUMMARY_INTERVAL, RefusalLog};
use crate::common::sync::lock;

/// Unblocks a connection's thread from outside: shutdown(2) of both
/// directions on a clone of its socket.
pub(crate) type Evictor = Box<dyn Fn() + Send>;

/// The numbers one listener admits connections by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Budget {
    /// Most connections open at once.
    pub max_connections: usize,
    /// Most unauthenticated connections open at once (at least 1).
    pub max_unauthenticated: usize,
    /// Most unauthenticated connections from one IP address (at least 1).
    pub max_unauthenticated_per_address: usize,
    /// Every peer is trusted on arrival (the Unix socket, guarded by its
    /// file mode): only `max_connections` applies, and nothing is evicted.
    pub trusts_every_peer: bool,
}

/// What a connection currently counts as; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    Unauthenticated,
    Claimed,
    Trusted,
    /// Evicted (or never admitted): the slot is gone, the thread should end.
    Evicted,
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Every slot is held by a claimed or trusted connection.
    Full,
}

/// The admission state of one listener.
pub(crate) struct Admission {
    budget: Budget,
    table: Mutex<Table>,
    log: RefusalLog,
}

struct Entry {
    address: Option<IpAddr>,
    peer: Peer,
    stage: Stage,
    evict: Evictor,
}

#[derive(Default)]
struct Table {
    entries: HashMap<u64, Entry>,
    /// Unauthenticated connections, oldest first.
    queue: VecDeque<u64>,
    unauthenticated_per_address: HashMap<IpAddr, usize>,
    next_id: u64,
}

/// A connection evicted to make room, to be unblocked once the lock is released.
struct Victim {
    peer: Peer,
    evict: Evictor,
}

impl Table {
    fn enqueue(&mut self, id: u64, address: Option<IpAddr>) {
        self.queue.push_back(id);
        if let Some(ip) = address {
            *self.unauthenticated_per_address.entry(ip).or_default() += 1;
        }
    }

    fn dequeue(&mut self, id: u64, address: Option<IpAddr>) {
        if let Some(at) = self.queue.iter().position(|&q| q == id) {
            self.queue.remove(at);
            if let Some(ip) = address
                && let Some(n) = self.unauthenticated_per_address.get_mut(&ip)
            {
                *n -= 1;
                if *n == 0 {
                    self.unauthenticated_per_address.remove(&ip);
                }
            }
        }
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        if entry.stage == Stage::Unauthenticated {
            self.dequeue(id, entry.address);
        }
        Some(entry)
    }

    fn unauthenticated_from(&self, address: Option<IpAddr>) -> usize {
        address
            .and_then(|ip| self.unauthenticated_per_address.get(&ip).copied())
            .unwrap_or(0)
    }

    /// The oldest unauthenticated connection other than `except`, from
    /// `address` when given.
    fn oldest(&self, from: Option<IpAddr>, except: Option<u64>) -> Option<u64> {
        self.queue.iter().copied().find(|id| {
            Some(*id) != except
                && (from.is_none() || self.entries.get(id).and_then(|e| e.address) == from)
        })
    }

    fn evict(&mut self, id: u64) -> Option<Victim> {
        self.remove(id).map(|e| Victim {
            peer: e.peer,
            evict: e.evict,
        })
    }

    /// Makes room for one more unauthenticated connection from `address`
    /// (`joining` is that connection when it is already open and only comes
    /// back to the queue). `Err` when only claimed or trusted connections
    /// could make room.
    fn make_room(
        &mut self,
        budget: &Budget,
        address: Option<IpAddr>,
        joining: Option<u64>,
    ) -> Result<Option<Victim>, Refused> {
        let per_address = budget.max_unauthenticated_per_address.max(1);
        if address.is_some() && self.unauthenticated_from(address) >= per_address {
            // The address's own oldest goes; its count is at least 1, so one exists.
            if let Some(id) = self.oldest(address, joining) {
                return Ok(self.evict(id));
            }
        }
        let total_full = joining.is_none() && self.entries.len() >= budget.max_connections;
        if total_full || self.queue.len() >= budget.max_unauthenticated.max(1) {
            return match self.oldest(None, joining) {
                Some(id) => Ok(self.evict(id)),
                None if total_full => Err(Refused::Full),
                None => Ok(None),
            };
        }
        Ok(None)
    }
}

impl Admission {
    /// The admission state of a listener with `budget`.
    pub(crate) fn new(budget: Budget) -> Arc<Admission> {
        Arc::new(Admission {
            budget,
            table: Mutex::new(Table::default()),
            log: RefusalLog::new(
                "connections turned away (evicted before a signed request, refused over \
                 the budget, or closed past the head deadline)",
                DEFAULT_SUMMARY_INTERVAL,
            ),
        })
    }

    /// Admits a new connection from `peer`, evicting the oldest
    /// unauthenticated one if a share is full; `evict` unblocks this
    /// connection's thread if it is evicted in turn.
    pub(crate) fn admit(
        self: &Arc<Admission>,
        peer: Peer,
        evict: Evictor,
    ) -> Result<Ticket, Refused> {
        let address = match peer {
            Peer::Tcp(addr) => Some(addr.ip()),
            Peer::Unix | Peer::Buffer => None,
        };
        let (id, victim) = {
            let mut table = lock(&self.table);
            let victim = if self.budget.trusts_every_peer {
                if table.entries.len() >= self.budget.max_connections {
                    drop(table);
                    self.note(&peer, || {
                        format!(
                            "refused a connection: all {} connections are in use",
                            self.budget.max_connections
                        )
                    });
                    return Err(Refused::Full);
                }
                None
            } else {
                match table.make_room(&self.budget, address, None) {
                    Ok(victim) => victim,
                    Err(refused) => {
                        drop(table);
                        self.note(&peer, || {
                            format!(
                                "refused a connection: all {} connections are busy with \
                                 signed requests",
                                self.budget.max_connections
                            )
                        });
                        return Err(refused);
                    }
                }
            };
            let id = table.next_id;
            table.next_id += 1;
            let stage = if self.budget.trusts_every_peer {
                Stage::Trusted
            } else {
                table.enqueue(id, address);
                Stage::Unauthenticated
            };
            table.entries.insert(
                id,
                Entry {
                    address,
                    peer,
                    stage,
                    evict,
                },
            );
            (id, victim)
        };
        self.unblock(victim);
        Ok(Ticket {
            admission: Arc::clone(self),
            id,
        })
    }

    /// Logs (in summaries) that the connection from `peer` was turned away.
    pub(crate) fn note(&self, peer: &Peer, detail: impl FnOnce() -> String) {
        self.log.record(peer, detail);
    }

    fn unblock(&self, victim: Option<Victim>) {
        if let Some(victim) = victim {
            (victim.evict)();
            self.note(&victim.peer, || {
                format!(
                    "evicted a connection that had sent no signed request, to make room \
                     for a new one ({} unauthenticated connections at most, {} per address)",
                    self.budget.max_unauthenticated, self.budget.max_unauthenticated_per_address
                )
            });
        }
    }

    /// How many connections are open, and how many of them unauthenticated.
    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        let table = lock(&self.table);
        (table.entries.len(), table.queue.len())
    }
}

/// One admitted connection's slot; dropping it gives the slot back.
pub(crate) struct Ticket {
    admission: Arc<Admission>,
    id: u64,
}

impl Ticket {
    /// What the connection counts as now.
    pub(crate) fn stage(&self) -> Stage {
        lock(&self.admission.table)
            .entries
            .get(&self.id)
            .map_or(Stage::Evicted, |e| e.stage)
    }

    /// The connection delivered a complete request claiming a signature:
    /// it may no longer be evicted while it is handled. False when it was
    /// evicted already (the request must then be dropped unanswered).
    pub(crate) fn claim(&self) -> bool {
        let mut table = lock(&self.admission.table);
        let Some(entry) = table.entries.get_mut(&self.id) else {
            return false;
        };
        let (stage, address) = (entry.stage, entry.address);
        if stage == Stage::Unauthenticated {
            entry.stage = Stage::Claimed;
            table.dequeue(self.id, address);
        }
        true
    }

    /// The connection's request was answered; `authenticated` when the
    /// handler verified its signature. A connection that trusts every peer
    /// stays trusted.
    pub(crate) fn answered(&self, authenticated: bool) {
        let admission = &self.admission;
        if admission.budget.trusts_every_peer {
            return;
        }
        let victim = {
            let mut table = lock(&admission.table);
            let Some(entry) = table.entries.get_mut(&self.id) else {
                return;
            };
            let (was, address) = (entry.stage, entry.address);
            match (was, authenticated) {
                (Stage::Unauthenticated, false) => return,
                (_, true) => {
                    entry.stage = Stage::Trusted;
                    if was == Stage::Unauthenticated {
                        table.dequeue(self.id, address);
                    }
                    return;
                }
                (_, false) => {
                    entry.stage = Stage::Unauthenticated;
                    // Never refused: the connection already holds its slot.
                    let victim = table
                        .make_room(&admission.budget, address, Some(self.id))
                        .unwrap_or(None);
                    table.enqueue(self.id, address);
                    victim
                }
            }
        };
        admission.unblock(victim);
    }

    /// Logs (in summaries) that this connection is closed by the server.
    pub(crate) fn note(&self, peer: &Peer, detail: impl FnOnce() -> String) {
        self.admission.note(peer, detail);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // None after an eviction: the slot was given back then.
        let _ = lock(&self.admission.table).remove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    const TCP: Budget = Budget {
        max_connections: 6,
        max_unauthenticated: 4,
        max_unauthenticated_per_address: 2,
        trusts_every_peer: false,
    };

    fn peer(ip: u8, port: u16) -> Peer {
        Peer::Tcp(format!("192.0.2.{ip}:{port}").parse().expect("address"))
    }

    /// Admits a connection whose eviction flag the test can watch.
    fn admit(a: &Arc<Admission>, p: Peer) -> (Result<Ticket, Refused>, Arc<AtomicBool>) {
        let evicted = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&evicted);
        let ticket = a.admit(p, Box::new(move || flag.store(true, Ordering::SeqCst)));
        (ticket, evicted)
    }

    fn admitted(a: &Arc<Admission>, p: Peer) -> (Ticket, Arc<AtomicBool>) {
        let (t, e) = admit(a, p);
        (t.expect("admitted"), e)
    }

    #[test]
    fn a_new_connection_evicts_the_oldest_unauthenticated_one() {
        let a = Admission::new(TCP);
        let conns: Vec<_> = (1..=4).map(|i| admitted(&a, peer(i, 1000))).collect();
        assert_eq!(a.counts(), (4, 4));
        let (newest, newest_evicted) = admitted(&a, peer(9, 1000));
        assert!(
            conns[0].1.load(Ordering::SeqCst),
            "the oldest was not evicted"
        );
        assert!(conns[1..].iter().all(|(_, e)| !e.load(Ordering::SeqCst)));
        assert!(!newest_evicted.load(Ordering::SeqCst));
        assert_eq!(conns[0].0.stage(), Stage::Evicted);
        assert_eq!(newest.stage(), Stage::Unauthenticated);
        assert_eq!(a.counts(), (4, 4));
        // The evicted connection's thread ending later gives nothing back twice.
        drop(conns);
        assert_eq!(a.counts(), (1, 1));
    }

    #[test]
    fn one_address_only_churns_its_own_share() {
        let a = Admission::new(TCP);
        let (_other, other_evicted) = admitted(&a, peer(1, 1));
        let (_first, first_evicted) = admitted(&a, peer(7, 1));
        let (_second, second_evicted) = admitted(&a, peer(7, 2));
        let (_third, third_evicted) = admitted(&a, peer(7, 3));
        assert!(
            first_evicted.load(Ordering::SeqCst),
            "over the per-address share"
        );
        assert!(!second_evicted.load(Ordering::SeqCst));
        assert!(!third_evicted.load(Ordering::SeqCst));
        assert!(
            !other_evicted.load(Ordering::SeqCst),
            "another address paid"
        );
        assert_eq!(a.counts(), (3, 3));
    }

    #[test]
    fn signed_connections_keep_the_reserved_share() {
        let a = Admission::new(TCP);
        // A flood fills the unauthenticated share from many addresses.
        let flood: Vec<_> = (1..=4).map(|i| admitted(&a, peer(i, 1))).collect();
        // Two signed clients arrive and each delivers a signed head that is
        // answered as verified: the first evicts a flood connection, the
        // second finds the room the first left in the share.
        let mut signed = Vec::new();
        for i in 0..2 {
            let (t, evicted) = admitted(&a, peer(50 + i, 1));
            assert!(t.claim());
            t.answered(true);
            assert_eq!(t.stage(), Stage::Trusted);
            assert!(!evicted.load(Ordering::SeqCst));
            signed.push(t);
        }
        let evicted = flood
            .iter()
            .filter(|(_, e)| e.load(Ordering::SeqCst))
            .count();
        assert_eq!(evicted, 1);
        // The flood refills its share, but cannot touch the signed ones.
        let refill: Vec<_> = (10..=13).map(|i| admitted(&a, peer(i, 1))).collect();
        assert_eq!(a.counts(), (6, 4));
        assert!(signed.iter().all(|t| t.stage() == Stage::Trusted));
        drop(refill);
        drop(flood);
        assert_eq!(a.counts(), (2, 0));
    }

    #[test]
    fn only_a_budget_of_signed_connections_refuses() {
        let a = Admission::new(TCP);
        let signed: Vec<_> = (1..=6)
            .map(|i| {
                let (t, _) = admitted(&a, peer(i, 1));
                assert!(t.claim());
                t
            })
            .collect();
        let (refused, _) = admit(&a, peer(99, 1));
        assert_eq!(refused.err(), Some(Refused::Full));
        // A claimed connection answered 401 becomes evictable again.
        signed[0].answered(false);
        assert_eq!(signed[0].stage(), Stage::Unauthenticated);
        let (_newcomer, _) = admitted(&a, peer(98, 1));
        assert_eq!(signed[0].stage(), Stage::Evicted);
    }

    #[test]
    fn an_evicted_connection_cannot_claim() {
        let a = Admission::new(Budget {
            max_unauthenticated: 1,
            ..TCP
        });
        let (old, _) = admitted(&a, peer(1, 1));
        let (_new, _) = admitted(&a, peer(2, 1));
        assert!(
            !old.claim(),
            "an evicted connection's request must be dropped"
        );
    }

    #[test]
    fn the_unix_socket_trusts_its_peers_and_only_counts() {
        let a = Admission::new(Budget {
            max_connections: 2,
            max_unauthenticated: 1,
            max_unauthenticated_per_address: 1,
            trusts_every_peer: true,
        });
        let (one, one_evicted) = admitted(&a, Peer::Unix);
        let (_two, two_evicted) = admitted(&a, Peer::Unix);
        assert_eq!(one.stage(), Stage::Trusted);
        one.answered(false);
        assert_eq!(one.stage(), Stage::Trusted);
        let (refused, _) = admit(&a, Peer::Unix);
        assert_eq!(refused.err(), Some(Refused::Full));
        assert!(!one_evicted.load(Ordering::SeqCst) && !two_evicted.load(Ordering::SeqCst));
        drop(one);
        assert!(admit(&a, Peer::Unix).0.is_ok(), "the slot came back");
    }
}
