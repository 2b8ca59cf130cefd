//! The bounded ring of events both daemons keep and serve on `GET /events`:
//! what the agent's reconciler, health checks and ingress controller did,
//! what the control plane decided (a node died, a replica was rescheduled).
//!
//! [`EventLog`] is the sink and the ring at once, cheap to clone: whoever
//! records holds a clone and calls [`EventLog::record`]; it never learns who
//! reads. Readers ([`EventLog::since`], the long poll [`EventLog::wait_newer`])
//! take the ring's lock only to copy what they answer, so a `GET /events`
//! never waits behind the worker, whatever the worker is doing. The ring
//! keeps the last [`CAPACITY`] events; every event gets the next sequence
//! number of its daemon, kept across restarts, so a reader can ask "after N".
//!
//! Every event also goes to the log: Warning events at warn, Normal ones at
//! info, so syslog says when a node went Dead or a workload exited.
//!
//! Persistence: the ring is written to `events.json` in the state directory
//! with [`crate::common::store`] (temp file, fsync, rename), but not per
//! event: the daemon's worker calls [`EventLog::flush`] after each command
//! (the agent) or batch (the control plane), which writes only when events
//! were recorded since the last write. A pass that restarts ten jails costs
//! one fsync, not ten; what a crash can lose is the events of the command it
//! interrupted. Losing those is acceptable where losing a desired jail is not,
//! which is why events are not in the desired-state file.
//!
//! Writing the ring is a whole-file rewrite (about 280 KB at [`CAPACITY`])
//! with two fsyncs; on the control plane's worker, where heartbeats wait
//! behind every batch, a heal's few batches with events each paid it. So a
//! daemon may give the writes a thread of their own
//! ([`EventLog::write_in_background`]): the worker then only asks
//! ([`EventLog::flush_soon`]), and asks that are pending when a write starts
//! are one write. What a crash can lose grows by the write in progress.
//!
//! Must never: block a recorder on a reader, or grow without bound (the ring
//! and the number of waiting long polls are both capped).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::common::http::Response;
use crate::common::store::{Store, StoreError};
use crate::common::sync::lock;
use crate::common::wire::{EVENTS_WAIT, Event, EventType, EventsAnswer, ObjectKind};

/// Most events kept; the oldest go first.
pub const CAPACITY: usize = 1000;

/// The ring's file in a daemon's state directory.
pub const EVENTS_FILE: &str = "events.json";

/// Most long polls waiting at once, as for the endpoint long poll: each
/// holds a handler thread and a connection slot.
pub const MAX_WAITING: usize = 16;

/// The object an event is about: `KIND/NAME`, as `--for` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectRef {
    /// Its kind.
    pub kind: ObjectKind,
    /// Its name.
    pub name: String,
}

impl ObjectRef {
    /// Parses `KIND/NAME` (`jail/web`, `node/n1`).
    pub fn parse(text: &str) -> Result<ObjectRef, String> {
        let kinds = ObjectKind::ALL.map(|k| k.to_string()).join(", ");
        let Some((kind, name)) = text.split_once('/') else {
            return Err(format!(
                "{text:?} is not KIND/NAME (e.g. jail/web); KIND is one of {kinds}"
            ));
        };
        let Some(kind) = ObjectKind::ALL.into_iter().find(|k| k.to_string() == kind) else {
            return Err(format!(
                "unknown kind {kind:?} in {text:?}; use one of {kinds}"
            ));
        };
        crate::common::names::validate_name(name).map_err(|why| format!("{name:?}: {why}"))?;
        Ok(ObjectRef {
            kind,
            name: name.to_string(),
        })
    }

    fn matches(&self, event: &Event) -> bool {
        event.kind == self.kind && event.name == self.name
    }
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.kind, self.name)
    }
}

/// The parameters of `GET /events?after=SEQ&for=KIND/NAME&wait=1`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventQuery {
    /// Only events numbered above this.
    pub after: Option<u64>,
    /// Only events about this object.
    pub object: Option<ObjectRef>,
    /// Wait (up to [`crate::common::wire::EVENTS_WAIT`]) for a newer one.
    pub wait: bool,
    /// Through the control plane (`nodes=n1:40,n2:7`): per node, the
    /// newest of its events the reader has; only newer ones are asked of
    /// it, and a node at that number already is not asked at all.
    pub nodes: std::collections::BTreeMap<String, u64>,
}

impl EventQuery {
    /// Parses a request's query string; the error names the parameter.
    pub fn parse(query: Option<&str>) -> Result<EventQuery, (String, &'static str)> {
        let mut q = EventQuery::default();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            match key {
                "after" => {
                    let seq = value.parse::<u64>().map_err(|_| {
                        (
                            format!(
                                "after must be an event number (a whole number), not {value:?}"
                            ),
                            "after",
                        )
                    })?;
                    q.after = Some(seq);
                }
                "for" => q.object = Some(ObjectRef::parse(value).map_err(|e| (e, "for"))?),
                "nodes" => {
                    for cursor in value.split(',').filter(|c| !c.is_empty()) {
                        let parsed = cursor.split_once(':').and_then(|(node, seq)| {
                            let seq = seq.parse::<u64>().ok()?;
                            crate::common::names::validate_name(node).ok()?;
                            Some((node.to_string(), seq))
                        });
                        let Some((node, seq)) = parsed else {
                            return Err((
                                format!(
                                    "nodes must be NODE:SEQ pairs separated by commas \
                                     (n1:40,n2:7), not {cursor:?}"
                                ),
                                "nodes",
                            ));
                        };
                        q.nodes.insert(node, seq);
                    }
                }
                "wait" => q.wait = value == "1",
                _ => {
                    return Err((
                        format!("unknown parameter {key:?}; use after, for, wait and nodes"),
                        "query",
                    ));
                }
            }
        }
        Ok(q)
    }

    /// The query string that [`EventQuery::parse`] reads back; empty for
    /// none.
    pub fn to_query(&self) -> String {
        let mut parts = Vec::new();
        if let Some(after) = self.after {
            parts.push(format!("after={after}"));
        }
        if let Some(object) = &self.object {
            parts.push(format!("for={object}"));
        }
        if self.wait {
            parts.push("wait=1".to_string());
        }
        if !self.nodes.is_empty() {
            let cursors: Vec<String> = self
                .nodes
                .iter()
                .map(|(node, seq)| format!("{node}:{seq}"))
                .collect();
            parts.push(format!("nodes={}", cursors.join(",")));
        }
        parts.join("&")
    }
}

/// A long poll was refused: [`MAX_WAITING`] are already waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManyWaiting;

impl std::fmt::Display for TooManyWaiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{MAX_WAITING} event watches are already waiting; retry later or ask without wait=1"
        )
    }
}

struct Ring {
    events: VecDeque<Event>,
    last_seq: u64,
    /// `last_seq` when the ring was last written (or read back).
    saved_seq: u64,
    /// Counts [`EventLog::poke`]s: a watch waiting on this ring also ends
    /// when it moves, without an event of this ring's own.
    pokes: u64,
}

struct Shared {
    /// The node an event happens on when its recorder names none.
    node: String,
    ring: Mutex<Ring>,
    changed: Condvar,
    store: Mutex<Option<Store<Vec<Event>>>>,
    waiting: AtomicUsize,
    /// A write is asked of the background writer, when there is one.
    write: Mutex<WriteAsk>,
    write_asked: Condvar,
}

#[derive(Default)]
struct WriteAsk {
    /// The background writer runs.
    writer: bool,
    /// A write is due.
    due: bool,
}

/// How often the background writer checks that its ring still exists.
const WRITER_CHECK: Duration = Duration::from_secs(1);

/// Least time between two background writes (the writer rests this long
/// after each): a burst of batches with events
/// (a thousand nodes registering) is a few writes, not one 280 KB rewrite
/// per batch taking a core from the worker. A crash loses at most this much
/// more of the newest events.
pub const WRITE_EVERY: Duration = Duration::from_millis(250);

/// The ring and its sink; see the module docs.
#[derive(Clone)]
pub struct EventLog {
    shared: Arc<Shared>,
}

impl EventLog {
    /// A ring kept in memory only, whose events happen on `node` unless
    /// their recorder names another.
    pub fn in_memory(node: &str) -> EventLog {
        EventLog::with(node, None, Vec::new())
    }

    /// A ring kept in `dir`/[`EVENTS_FILE`], starting with what is there.
    pub fn open(dir: &Path, node: &str) -> Result<EventLog, StoreError> {
        let (store, saved) = Store::open(dir, EVENTS_FILE)?;
        Ok(EventLog::with(node, Some(store), saved.unwrap_or_default()))
    }

    fn with(node: &str, store: Option<Store<Vec<Event>>>, saved: Vec<Event>) -> EventLog {
        let last_seq = saved.iter().map(|e| e.seq).max().unwrap_or(0);
        let mut events: VecDeque<Event> = saved.into();
        while events.len() > CAPACITY {
            events.pop_front();
        }
        EventLog {
            shared: Arc::new(Shared {
                node: node.to_string(),
                ring: Mutex::new(Ring {
                    events,
                    last_seq,
                    saved_seq: last_seq,
                    pokes: 0,
                }),
                changed: Condvar::new(),
                store: Mutex::new(store),
                waiting: AtomicUsize::new(0),
                write: Mutex::new(WriteAsk::default()),
                write_asked: Condvar::new(),
            }),
        }
    }

    /// A Normal event about `kind`/`name` on this daemon's node.
    pub fn normal(&self, kind: ObjectKind, name: &str, reason: &str, message: String) {
        self.record(kind, name, reason, EventType::Normal, message, None);
    }

    /// A Warning event about `kind`/`name` on this daemon's node.
    pub fn warning(&self, kind: ObjectKind, name: &str, reason: &str, message: String) {
        self.record(kind, name, reason, EventType::Warning, message, None);
    }

    /// Records one event (on `node`, else this daemon's), logs it, and wakes
    /// every waiting watch.
    pub fn record(
        &self,
        kind: ObjectKind,
        name: &str,
        reason: &str,
        event_type: EventType,
        message: String,
        node: Option<&str>,
    ) {
        match event_type {
            EventType::Normal => log::info!("{reason} {kind}/{name}: {message}"),
            EventType::Warning => log::warn!("{reason} {kind}/{name}: {message}"),
        }
        let mut ring = lock(&self.shared.ring);
        ring.last_seq += 1;
        let event = Event {
            seq: ring.last_seq,
            time_unix: crate::common::auth::unix_now(),
            kind,
            name: name.to_string(),
            reason: reason.to_string(),
            message,
            node: node.unwrap_or(&self.shared.node).to_string(),
            event_type,
            source: None,
        };
        ring.events.push_back(event);
        if ring.events.len() > CAPACITY {
            ring.events.pop_front();
        }
        drop(ring);
        self.shared.changed.notify_all();
    }

    /// The newest number handed out.
    pub fn last_seq(&self) -> u64 {
        lock(&self.shared.ring).last_seq
    }

    /// Ends every wait in [`EventLog::wait_newer`] at once, with what the
    /// ring holds (maybe nothing): the control plane's ring is poked when a
    /// node reports new events of its own, which the waiting handlers then
    /// fetch from that node.
    pub fn poke(&self) {
        lock(&self.shared.ring).pokes += 1;
        self.shared.changed.notify_all();
    }

    /// The events numbered above `after` (all kept without it) about
    /// `object` (any without it), oldest first, and the newest number handed
    /// out.
    pub fn since(&self, after: Option<u64>, object: Option<&ObjectRef>) -> (Vec<Event>, u64) {
        let ring = lock(&self.shared.ring);
        (select(&ring, after, object), ring.last_seq)
    }

    /// [`EventLog::since`] as soon as it holds an event: at once when it
    /// does, else when one is recorded, else (empty) once `timeout` passed.
    /// Refused while [`MAX_WAITING`] others wait.
    pub fn wait_newer(
        &self,
        after: u64,
        object: Option<&ObjectRef>,
        timeout: Duration,
    ) -> Result<(Vec<Event>, u64), TooManyWaiting> {
        if self.shared.waiting.fetch_add(1, Ordering::SeqCst) >= MAX_WAITING {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(TooManyWaiting);
        }
        let deadline = Instant::now() + timeout;
        let mut ring = lock(&self.shared.ring);
        let pokes = ring.pokes;
        let answer = loop {
            let found = select(&ring, Some(after), object);
            let left = deadline.saturating_duration_since(Instant::now());
            // Above the newest number, `after` came from a ring since lost
            // (its file was moved aside): the reader needs this one now.
            let poked = ring.pokes != pokes;
            if !found.is_empty() || left.is_zero() || after > ring.last_seq || poked {
                break (found, ring.last_seq);
            }
            ring = self
                .shared
                .changed
                .wait_timeout(ring, left)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        };
        drop(ring);
        self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        Ok(answer)
    }

    /// The answer to `query`: the events it asks for, after a wait when it
    /// asks to wait (see [`EventLog::wait_newer`]).
    pub fn answer(&self, query: &EventQuery) -> Result<EventsAnswer, TooManyWaiting> {
        let object = query.object.as_ref();
        let (events, last_seq) = match (query.wait, query.after) {
            (true, Some(after)) => self.wait_newer(after, object, EVENTS_WAIT)?,
            _ => self.since(query.after, object),
        };
        Ok(EventsAnswer {
            events,
            last_seq,
            unreached: Vec::new(),
            node_seqs: Default::default(),
        })
    }

    /// `GET /events` on this ring alone (the agent's route): 400 naming a
    /// bad parameter, 503 when too many watches wait.
    pub fn respond(&self, query: Option<&str>) -> Response {
        let query = match EventQuery::parse(query) {
            Ok(q) => q,
            Err((why, field)) => return Response::error(400, &why, Some(field)),
        };
        match self.answer(&query) {
            Ok(answer) => Response::json(200, &answer),
            Err(busy) => Response::error(503, &busy.to_string(), None),
        }
    }

    /// Starts the thread that writes the ring from now on when
    /// [`EventLog::flush_soon`] asks; see the module docs. It holds the ring
    /// weakly and ends once every other holder is gone.
    pub fn write_in_background(&self) -> std::io::Result<()> {
        let shared = Arc::downgrade(&self.shared);
        std::thread::Builder::new()
            .name("keel-events".into())
            .spawn(move || write_when_asked(&shared))?;
        lock(&self.shared.write).writer = true;
        Ok(())
    }

    /// [`EventLog::flush`] on the background writer when there is one, else
    /// here and now. A failed background write is logged; the next ask
    /// retries it.
    pub fn flush_soon(&self) -> Result<(), StoreError> {
        let mut ask = lock(&self.shared.write);
        if !ask.writer {
            drop(ask);
            return self.flush();
        }
        ask.due = true;
        drop(ask);
        self.shared.write_asked.notify_one();
        Ok(())
    }

    /// Writes the ring to its file when events were recorded since the last
    /// write (see the module docs); nothing for a ring in memory. On failure
    /// the next flush tries again.
    pub fn flush(&self) -> Result<(), StoreError> {
        let mut store = lock(&self.shared.store);
        let Some(store) = store.as_mut() else {
            return Ok(());
        };
        let (events, last_seq) = {
            let ring = lock(&self.shared.ring);
            if ring.last_seq == ring.saved_seq {
                return Ok(());
            }
            (Vec::from(ring.events.clone()), ring.last_seq)
        };
        store.save(&events)?;
        let mut ring = lock(&self.shared.ring);
        ring.saved_seq = ring.saved_seq.max(last_seq);
        Ok(())
    }
}

/// The background writer's loop; see [`EventLog::write_in_background`].
fn write_when_asked(shared: &std::sync::Weak<Shared>) {
    while let Some(wrote) = serve_one_ask(shared) {
        if wrote {
            // Pacing, not waiting for a condition: the asks made meanwhile
            // are one write once the interval is over.
            std::thread::sleep(WRITE_EVERY);
        }
    }
}

/// Waits (up to [`WRITER_CHECK`]) for an ask and writes the ring for it:
/// whether it wrote, `None` once the ring is gone.
fn serve_one_ask(shared: &std::sync::Weak<Shared>) -> Option<bool> {
    let strong = shared.upgrade()?;
    let log = EventLog { shared: strong };
    let mut ask = lock(&log.shared.write);
    if !ask.due {
        ask = log
            .shared
            .write_asked
            .wait_timeout(ask, WRITER_CHECK)
            .map(|(guard, _)| guard)
            .unwrap_or_else(|p| p.into_inner().0);
    }
    // Asks that came while the last write ran are this one write.
    let due = std::mem::take(&mut ask.due);
    drop(ask);
    if due && let Err(e) = log.flush() {
        log::warn!("events are not saved: {e}");
    }
    Some(due)
}

impl std::fmt::Debug for EventLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ring = lock(&self.shared.ring);
        f.debug_struct("EventLog")
            .field("node", &self.shared.node)
            .field("kept", &ring.events.len())
            .field("last_seq", &ring.last_seq)
            .finish()
    }
}

fn select(ring: &Ring, after: Option<u64>, object: Option<&ObjectRef>) -> Vec<Event> {
    let after = after.unwrap_or(0);
    // Sequence numbers only grow along the ring: start at the first newer one.
    let start = ring.events.partition_point(|e| e.seq <= after);
    ring.events
        .range(start..)
        .filter(|e| object.is_none_or(|o| o.matches(e)))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jail(name: &str) -> ObjectRef {
        ObjectRef {
            kind: ObjectKind::Jail,
            name: name.into(),
        }
    }

    fn reasons(events: &[Event]) -> Vec<&str> {
        events.iter().map(|e| e.reason.as_str()).collect()
    }

    #[test]
    fn the_ring_keeps_the_last_capacity_events_numbered_in_order() {
        let log = EventLog::in_memory("n1");
        for i in 0..CAPACITY + 5 {
            log.normal(ObjectKind::Jail, "web", "Started", format!("start {i}"));
        }
        let (events, last) = log.since(None, None);
        assert_eq!(events.len(), CAPACITY);
        assert_eq!(last, (CAPACITY + 5) as u64);
        assert_eq!(events[0].seq, 6, "the five oldest went");
        assert!(events.windows(2).all(|w| w[1].seq == w[0].seq + 1));
        assert_eq!(events[0].node, "n1");
    }

    #[test]
    fn after_answers_only_newer_events_and_for_only_that_object() {
        let log = EventLog::in_memory("n1");
        log.normal(ObjectKind::Jail, "web", "Created", String::new());
        log.warning(ObjectKind::Jail, "db", "Exited", "status 3".into());
        log.normal(ObjectKind::Jail, "web", "Started", String::new());
        log.normal(ObjectKind::Node, "web", "NodeAlive", String::new());
        assert_eq!(
            reasons(&log.since(Some(1), None).0),
            ["Exited", "Started", "NodeAlive"]
        );
        assert_eq!(
            reasons(&log.since(None, Some(&jail("web"))).0),
            ["Created", "Started"],
            "the node of the same name is another object"
        );
        assert_eq!(reasons(&log.since(Some(4), None).0), Vec::<&str>::new());
    }

    #[test]
    fn a_waiting_watch_gets_the_next_matching_event() {
        let log = EventLog::in_memory("n1");
        log.normal(ObjectKind::Jail, "web", "Created", String::new());
        let reader = {
            let log = log.clone();
            std::thread::spawn(move || {
                log.wait_newer(1, Some(&jail("web")), Duration::from_secs(3600))
            })
        };
        // Not about web: the watch keeps waiting (else it would answer Exited).
        log.warning(ObjectKind::Jail, "db", "Exited", String::new());
        log.normal(ObjectKind::Jail, "web", "Started", String::new());
        let (events, last) = reader.join().expect("reader").expect("admitted");
        assert_eq!((reasons(&events), last), (vec!["Started"], 3));
    }

    #[test]
    fn a_watch_without_news_ends_empty_at_its_timeout() {
        let log = EventLog::in_memory("n1");
        log.normal(ObjectKind::Jail, "web", "Created", String::new());
        let answer = log.wait_newer(1, None, Duration::from_millis(1));
        assert_eq!(answer, Ok((Vec::new(), 1)));
    }

    #[test]
    fn the_ring_survives_a_restart_and_goes_on_numbering() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = EventLog::open(dir.path(), "n1").expect("open");
        log.normal(ObjectKind::Jail, "web", "Created", String::new());
        log.warning(ObjectKind::Jail, "web", "Exited", "status 3".into());
        log.flush().expect("flush");
        drop(log);

        let log = EventLog::open(dir.path(), "n1").expect("reopen");
        let (events, last) = log.since(None, None);
        assert_eq!((reasons(&events), last), (vec!["Created", "Exited"], 2));
        assert_eq!(events[1].message, "status 3");
        log.normal(ObjectKind::Jail, "web", "Started", String::new());
        assert_eq!(log.since(Some(2), None).0[0].seq, 3);
    }

    #[test]
    fn with_a_background_writer_an_ask_is_written_there_and_the_writer_ends_with_the_ring() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = EventLog::open(dir.path(), "n1").expect("open");
        // The writer's part is played here, one ask at a time.
        lock(&log.shared.write).writer = true;
        let writer = Arc::downgrade(&log.shared);
        log.normal(ObjectKind::Jail, "web", "Created", String::new());
        log.normal(ObjectKind::Jail, "web", "Started", String::new());
        log.flush_soon().expect("asked");
        log.flush_soon().expect("asked again");
        assert!(
            !dir.path().join(EVENTS_FILE).exists(),
            "the asker writes nothing itself"
        );
        assert_eq!(serve_one_ask(&writer), Some(true));
        let saved: Vec<Event> = Store::open(dir.path(), EVENTS_FILE)
            .expect("open")
            .1
            .expect("written");
        assert_eq!(
            reasons(&saved),
            ["Created", "Started"],
            "both asks, one write"
        );
        assert!(!lock(&log.shared.write).due, "nothing left to write");
        drop(log);
        assert_eq!(
            serve_one_ask(&writer),
            None,
            "the ring is gone: the writer ends"
        );
    }

    #[test]
    fn a_flush_writes_only_when_something_was_recorded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = EventLog::open(dir.path(), "n1").expect("open");
        log.flush().expect("flush");
        assert!(
            !dir.path().join(EVENTS_FILE).exists(),
            "nothing recorded, nothing written"
        );
        log.normal(ObjectKind::Jail, "web", "Created", String::new());
        log.flush().expect("flush");
        let written = std::fs::metadata(dir.path().join(EVENTS_FILE)).expect("written");
        std::fs::remove_file(dir.path().join(EVENTS_FILE)).expect("remove");
        log.flush().expect("flush");
        assert!(
            !dir.path().join(EVENTS_FILE).exists(),
            "an unchanged ring is not written again (it was {} bytes)",
            written.len()
        );
    }

    #[test]
    fn queries_round_trip_and_bad_ones_name_their_parameter() {
        let q = EventQuery {
            after: Some(7),
            object: Some(jail("web")),
            wait: true,
            nodes: [("n1".to_string(), 40), ("n2".to_string(), 7)].into(),
        };
        assert_eq!(q.to_query(), "after=7&for=jail/web&wait=1&nodes=n1:40,n2:7");
        assert_eq!(EventQuery::parse(Some(&q.to_query())), Ok(q));
        assert_eq!(EventQuery::parse(None), Ok(EventQuery::default()));
        assert_eq!(
            EventQuery::parse(Some("after=x")).map_err(|e| e.1),
            Err("after")
        );
        assert_eq!(
            EventQuery::parse(Some("for=pod/x")).map_err(|e| e.1),
            Err("for")
        );
        assert_eq!(
            EventQuery::parse(Some("for=web")).map_err(|e| e.1),
            Err("for")
        );
        assert_eq!(
            EventQuery::parse(Some("since=1")).map_err(|e| e.1),
            Err("query")
        );
        for bad in ["nodes=n1", "nodes=n1:x", "nodes=N1:3"] {
            assert_eq!(
                EventQuery::parse(Some(bad)).map_err(|e| e.1),
                Err("nodes"),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_poke_ends_a_wait_with_nothing_new() {
        let log = EventLog::in_memory("n1");
        log.normal(ObjectKind::Jail, "web", "Started", "up".into());
        let waiter = {
            let log = log.clone();
            std::thread::spawn(move || log.wait_newer(1, None, Duration::from_secs(3600)))
        };
        // The poke may come before the wait starts; poke until it returns.
        while !waiter.is_finished() {
            log.poke();
            std::thread::yield_now();
        }
        let (events, last) = waiter.join().expect("waiter").expect("not refused");
        assert_eq!((events.len(), last), (0, 1));
    }
}
