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
//! Changes, not tables: when a generation is pinned every waiting poll
//! wakes at once, and with 1,000 services the whole table is about 130 KB.
//! So the board logs which services each generation changed
//! ([`BOARD_LOG_LEN`] generations at most), and a poll that says which
//! table it holds (its `origin` as well as `after`) is answered only the
//! entries changed or gone since, as heartbeats are; a poll further behind,
//! holding another process's table, or behind by more than half the table
//! gets the whole table, and so does a poll from an agent that does not
//! apply changes. Each distinct answer to the pinned generation is an
//! [`Answer`] built and encoded once, by the first poll that needs it,
//! outside the lock; the polls that wake together share it.
//!
//! A reader holds the lock only to clone `Arc`s or, for the first poll of
//! each kind after a publish, to pick the changed entries, so a thousand
//! waiting polls never slow the worker down. The board never decides what
//! the table holds and never talks to the network; waiting is bounded by
//! the caller's timeout.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::common::sync::lock;
use crate::common::wire::EndpointsAnswer;
use crate::controlplane::registry::NewGeneration;
use crate::controlplane::registry::endpoints::Table;

/// Generations whose changed services the board keeps: a poll further
/// behind gets the whole table. As the registry's own log.
pub const BOARD_LOG_LEN: usize = crate::controlplane::registry::endpoints::ENDPOINT_LOG_LEN;

/// One answer to the pinned generation, shared by every poll that holds
/// the same table. Built from the shared table and encoded on first use,
/// by a handler thread, never under the board's lock.
#[derive(Debug)]
pub struct Answer {
    generation: u64,
    origin: u64,
    /// The pinned table.
    services: Table,
    /// For changes: the generation they start from and the services
    /// changed since. `None`: the whole table.
    changes: Option<(u64, BTreeSet<String>)>,
    body: OnceLock<Vec<u8>>,
}

impl Answer {
    /// The JSON body, encoded on the first call; only the bytes are kept.
    pub fn body(&self) -> Result<&[u8], serde_json::Error> {
        if let Some(done) = self.body.get() {
            return Ok(done);
        }
        // Two threads may both encode the first time; one result is kept.
        let encoded = serde_json::to_vec(&self.answer())?;
        Ok(self.body.get_or_init(|| encoded))
    }

    /// What it says, built from the shared table.
    pub fn answer(&self) -> EndpointsAnswer {
        let Some((since, names)) = &self.changes else {
            return EndpointsAnswer {
                generation: self.generation,
                origin: self.origin,
                services: self.services.iter().map(|s| s.as_ref().clone()).collect(),
                services_changed: None,
                services_removed: Vec::new(),
            };
        };
        let mut services = Vec::new();
        let mut removed = Vec::new();
        for name in names {
            // The table is in name order, as the registry keeps it.
            match self.services.binary_search_by(|s| s.name.cmp(name)) {
                Ok(i) => services.push(self.services[i].as_ref().clone()),
                Err(_) => removed.push(name.clone()),
            }
        }
        EndpointsAnswer {
            generation: self.generation,
            origin: self.origin,
            services,
            services_changed: Some(*since),
            services_removed: removed,
        }
    }
}

struct Pinned {
    generation: u64,
    /// The table of `generation`, in name order.
    services: Table,
    /// Each pinned generation after `log_base` with the services changed
    /// since the one pinned before it, oldest first.
    log: VecDeque<(u64, BTreeSet<String>)>,
    /// Polls holding this generation or a later one can be answered with
    /// changes.
    log_base: u64,
    /// The answers to `generation` handed out so far, by the generation
    /// the poll held (`None`: the whole table, also filed under each held
    /// generation it answered); emptied by every publish.
    answers: BTreeMap<Option<u64>, Arc<Answer>>,
    nodes: Arc<BTreeSet<String>>,
}

/// See the module docs.
pub struct EndpointBoard {
    /// Identifies the control-plane process that numbers the generations.
    origin: u64,
    pinned: Mutex<Pinned>,
    changed: Condvar,
    /// Answers handed out with changes only, and with the whole table.
    answered_changes: AtomicU64,
    answered_tables: AtomicU64,
}

impl EndpointBoard {
    /// A board holding `generation` of `services` (numbered under
    /// `origin`) and the registered `nodes`.
    pub fn new(
        origin: u64,
        generation: u64,
        services: Table,
        nodes: BTreeSet<String>,
    ) -> EndpointBoard {
        EndpointBoard {
            origin,
            pinned: Mutex::new(Pinned {
                generation,
                services,
                log: VecDeque::new(),
                log_base: generation,
                answers: BTreeMap::new(),
                nodes: Arc::new(nodes),
            }),
            changed: Condvar::new(),
            answered_changes: AtomicU64::new(0),
            answered_tables: AtomicU64::new(0),
        }
    }

    /// Answers handed out so far: with changes only, and with the whole
    /// table (what `GET /metrics` shows).
    pub fn answered(&self) -> (u64, u64) {
        (
            self.answered_changes.load(Ordering::Relaxed),
            self.answered_tables.load(Ordering::Relaxed),
        )
    }

    /// Identifies the process that numbers the generations.
    pub fn origin(&self) -> u64 {
        self.origin
    }

    /// Pins `next` and wakes every waiting reader. An older generation than
    /// the one pinned is ignored.
    pub fn publish(&self, next: NewGeneration) {
        let mut pinned = lock(&self.pinned);
        if next.generation <= pinned.generation {
            return;
        }
        match next.changed {
            // Changes from the generation pinned now: the log goes on.
            Some((since, names)) if since == pinned.generation => {
                pinned.log.push_back((next.generation, names));
                if pinned.log.len() > BOARD_LOG_LEN {
                    if let Some((dropped, _)) = pinned.log.pop_front() {
                        pinned.log_base = dropped;
                    }
                }
            }
            // A gap: polls from before it get the whole table.
            _ => {
                pinned.log.clear();
                pinned.log_base = next.generation;
            }
        }
        pinned.generation = next.generation;
        pinned.services = next.services;
        pinned.answers.clear();
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

    /// The generation pinned now.
    pub fn generation(&self) -> u64 {
        lock(&self.pinned).generation
    }

    /// The answer to a poll that holds generation `held` of the table
    /// numbered by `origin` (`None`: a poll that does not apply changes, or
    /// holds nothing): the changes from `held` to the pinned generation
    /// when the log reaches back and they are at most half the table, else
    /// the whole table.
    pub fn answer(&self, held: Option<(u64, u64)>) -> Arc<Answer> {
        let answer = self.pick_answer(held);
        let counter = match answer.changes {
            Some(_) => &self.answered_changes,
            None => &self.answered_tables,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        answer
    }

    fn pick_answer(&self, held: Option<(u64, u64)>) -> Arc<Answer> {
        let mut pinned = lock(&self.pinned);
        let since = held
            .filter(|(origin, _)| *origin == self.origin)
            .map(|(_, generation)| generation)
            .filter(|g| *g >= pinned.log_base && *g <= pinned.generation);
        if let Some(done) = pinned.answers.get(&since) {
            return Arc::clone(done);
        }
        let changes = since.and_then(|g| {
            let names: BTreeSet<String> = pinned
                .log
                .iter()
                .filter(|(logged, _)| *logged > g)
                .flat_map(|(_, names)| names.iter().cloned())
                .collect();
            (names.len() * 2 <= pinned.services.len().max(1)).then_some((g, names))
        });
        let built = match (changes, pinned.answers.get(&None)) {
            (None, Some(whole)) => Arc::clone(whole),
            (changes, _) => Arc::new(Answer {
                generation: pinned.generation,
                origin: self.origin,
                services: Arc::clone(&pinned.services),
                changes,
                body: OnceLock::new(),
            }),
        };
        if built.changes.is_none() {
            pinned.answers.insert(None, Arc::clone(&built));
        }
        pinned.answers.insert(since, Arc::clone(&built));
        built
    }

    /// Returns as soon as the pinned generation is above `after`: at once
    /// when it already is, else when the worker publishes one, else once
    /// `timeout` has passed.
    pub fn wait_newer(&self, after: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut pinned = lock(&self.pinned);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if pinned.generation > after || left.is_zero() {
                return;
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
    use crate::common::wire::ServiceEndpoints;

    fn service(name: &str, port: u16) -> ServiceEndpoints {
        ServiceEndpoints {
            name: name.into(),
            vip: Ipv4Addr::new(10, 96, 0, 1),
            port,
            replicas: Vec::new(),
            unsettled: false,
        }
    }

    /// `names` on port `port`, in name order, as the registry keeps them.
    fn table(names: &[&str], port: u16) -> Table {
        let mut services: Vec<ServiceEndpoints> = names.iter().map(|n| service(n, port)).collect();
        services.sort_by(|a, b| a.name.cmp(&b.name));
        Arc::new(services.into_iter().map(Arc::new).collect())
    }

    /// The entries of `table`, as an answer carries them.
    fn plain(table: &Table) -> Vec<ServiceEndpoints> {
        table.iter().map(|s| s.as_ref().clone()).collect()
    }

    fn next(generation: u64, services: Table, changed: Option<(u64, &[&str])>) -> NewGeneration {
        NewGeneration {
            generation,
            services,
            changed: changed
                .map(|(since, names)| (since, names.iter().map(|n| n.to_string()).collect())),
        }
    }

    const ORIGIN: u64 = 7;

    fn board(services: Table) -> EndpointBoard {
        EndpointBoard::new(ORIGIN, 3, services, BTreeSet::new())
    }

    #[test]
    fn a_poll_without_a_held_table_gets_the_whole_table() {
        let b = board(table(&["a", "b"], 80));
        let answer = b.answer(None);
        assert_eq!(answer.answer().services, plain(&table(&["a", "b"], 80)));
        assert_eq!(
            (answer.answer().generation, answer.answer().services_changed),
            (3, None)
        );
    }

    #[test]
    fn a_poll_holding_an_older_generation_gets_only_the_changes() {
        let b = board(table(&["a", "b", "c", "d", "e"], 80));
        // Generation 4 changes c; 5 removes e.
        let mut four = table(&["a", "b", "d", "e"], 80).as_ref().clone();
        four.push(Arc::new(service("c", 81)));
        four.sort_by(|x, y| x.name.cmp(&y.name));
        b.publish(next(4, Arc::new(four.clone()), Some((3, &["c"]))));
        four.retain(|s| s.name != "e");
        b.publish(next(5, Arc::new(four), Some((4, &["e"]))));

        assert_eq!(b.answered(), (0, 0));
        let from_three = b.answer(Some((ORIGIN, 3)));
        assert_eq!(b.answered(), (1, 0), "counted as changes");
        let a = from_three.answer();
        assert_eq!((a.generation, a.services_changed), (5, Some(3)));
        assert_eq!(a.services, [service("c", 81)]);
        assert_eq!(a.services_removed, ["e"]);
        let from_four = b.answer(Some((ORIGIN, 4)));
        assert!(from_four.answer().services.is_empty());
        assert_eq!(from_four.answer().services_removed, ["e"]);
        // The table held is the pinned one: nothing changed since.
        let current = b.answer(Some((ORIGIN, 5)));
        assert_eq!(current.answer().services_changed, Some(5));
        assert!(
            current.answer().services.is_empty() && current.answer().services_removed.is_empty()
        );
    }

    #[test]
    fn polls_holding_the_same_table_share_one_answer_until_the_next_publish() {
        let b = board(table(&["a", "b", "c"], 80));
        b.publish(next(4, table(&["a", "b", "c"], 81), None));
        let first = b.answer(None);
        assert!(Arc::ptr_eq(&first, &b.answer(None)));
        assert_eq!(
            first.body().expect("body"),
            serde_json::to_vec(&first.answer()).expect("json")
        );
        b.publish(next(5, table(&["a", "b", "c"], 82), None));
        assert_eq!(b.answer(None).answer().generation, 5);
    }

    #[test]
    fn the_whole_table_when_the_changes_cannot_or_should_not_be_answered() {
        let b = board(table(&["a", "b", "c", "d"], 80));
        b.publish(next(4, table(&["a", "b", "c", "d"], 80), Some((3, &["a"]))));
        assert_eq!(
            b.answer(Some((ORIGIN, 3))).answer().services_changed,
            Some(3)
        );
        let whole = |held| b.answer(Some(held)).answer().services_changed.is_none();
        assert!(whole((ORIGIN, 2)), "older than the log");
        assert!(whole((ORIGIN + 1, 3)), "another process's generation");
        assert!(
            whole((ORIGIN, 9)),
            "a generation not reached: a previous process's"
        );
        // More than half the table changed: the whole table is smaller.
        b.publish(next(
            5,
            table(&["a", "b", "c", "d"], 81),
            Some((4, &["b", "c", "d"])),
        ));
        assert!(whole((ORIGIN, 3)));
        assert_eq!(b.answer(Some((ORIGIN, 4))).answer().services_changed, None);
        // A generation published without its changes starts the log over.
        b.publish(next(6, table(&["a", "b", "c", "d"], 82), None));
        assert!(whole((ORIGIN, 5)));
        assert_eq!(
            b.answer(Some((ORIGIN, 6))).answer().services_changed,
            Some(6)
        );
    }

    #[test]
    fn a_newer_generation_ends_the_wait_at_once() {
        let b = board(table(&["a"], 80));
        // A timeout no test run reaches: returning at once is the only way out.
        b.wait_newer(2, Duration::from_secs(3600));
        assert_eq!(b.generation(), 3);
    }

    #[test]
    fn a_waiting_reader_wakes_for_the_next_published_generation() {
        let b = Arc::new(board(table(&["a"], 80)));
        let reader = {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                b.wait_newer(3, Duration::from_secs(3600));
                b.answer(Some((ORIGIN, 3)))
            })
        };
        b.publish(next(4, table(&["a"], 81), Some((3, &["a"]))));
        let answer = reader.join().expect("reader");
        assert_eq!(answer.answer().services, [service("a", 81)]);
    }

    #[test]
    fn without_a_change_the_wait_ends_at_its_timeout() {
        let b = board(table(&["a"], 80));
        b.wait_newer(3, Duration::from_millis(1));
        assert_eq!(b.generation(), 3);
    }

    #[test]
    fn an_older_generation_never_replaces_a_newer_one() {
        let b = board(table(&["a"], 80));
        b.publish(next(2, table(&["old"], 80), None));
        assert_eq!(b.generation(), 3);
        assert_eq!(b.answer(None).answer().services, plain(&table(&["a"], 80)));
    }

    #[test]
    fn the_board_knows_the_registered_nodes() {
        let b = EndpointBoard::new(7, 1, Arc::default(), ["n1".to_string()].into());
        assert!(b.knows("n1") && !b.knows("n2"));
        b.set_nodes(["n2".to_string()].into());
        assert!(!b.knows("n1") && b.knows("n2"));
    }
}
