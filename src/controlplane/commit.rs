//! The journal's writer thread: the control plane's pipelined group commit.
//!
//! The worker ([`super::worker`]) applies a batch of commands in memory,
//! hands the batch's ops to this thread with the replies that must wait for
//! them, and goes on with the next batch at once. So a heartbeat queued
//! behind a batch waits for that batch's handling, never for its
//! `fdatasync`, which on a busy disk takes milliseconds (a death at 10,000
//! nodes journals its heal in the batches around it). This thread appends
//! each batch with one write and one sync, in the order it was handed over
//! (every batch already waiting when a write starts shares it: the group
//! commit across batches), and only then sends the batch's replies and pins
//! the batch's endpoint
//! table to the board: nothing a batch decided is acknowledged, or shown to
//! long polls, before it is durable.
//!
//! A failed append: the worker's memory holds changes the disk lacks, and
//! so does every batch handed over after the failed one, since each was
//! built on the one before. From a failed append on, this thread therefore
//! answers every batch with the error and pins nothing, until the worker
//! sees [`Committer::failed`] and asks for [`Committer::reload`]: the
//! journal is reopened and the state on disk, exactly what was
//! acknowledged, is handed back for the worker to take as its own.
//!
//! Compaction: a snapshot may hold only what is durable, and the worker's
//! memory runs ahead of the disk by the batches in flight. So this thread
//! keeps its own copy of the durable state, replaying each batch once it is
//! synced (the replay that opening the journal does), and snapshots that
//! copy; the worker never pauses for a snapshot either.
//!
//! This thread never touches the cluster model and never answers a
//! mutating command before its ops are synced. It blocks the worker only
//! when [`QUEUE`] batches wait for the disk: memory stays bounded when the
//! disk stops.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::thread::JoinHandle;

use crate::common::journal::{Journal, JournalError, Replay};
use crate::controlplane::endpoint_board::EndpointBoard;
use crate::controlplane::etcd::EtcdError;
use crate::controlplane::registry::{NewGeneration, Refusal};
use crate::controlplane::state::{ClusterState, Op, STATE_NAME};

/// Batches handed over and not yet durable before the worker waits.
pub const QUEUE: usize = 64;

/// Most ops written together when several batches wait: well below
/// etcd's default request limit of 1.5 MiB at the ops' few hundred bytes.
const MAX_MERGED_OPS: usize = 2048;

/// A reply held back until its batch's ops are durable.
pub type Deferred = Box<dyn FnOnce(Result<(), Refusal>) + Send>;

/// Where the ops go: the embedded journal ([`JournalLog`]), etcd
/// ([`super::etcd_state::EtcdLog`]), or in the tests a fake that fails on
/// demand.
pub trait Log: Send + 'static {
    /// Appends `ops` durably, all or none.
    fn append(&mut self, ops: &[Op]) -> Result<(), LogError>;
    /// True when [`Log::compact`] is due.
    fn wants_compaction(&self) -> bool;
    /// Snapshots `state`, which holds every op appended, and empties the log.
    fn compact(&mut self, state: &ClusterState) -> Result<(), LogError>;
    /// Reopens the log after a failed append; answers the state it holds.
    fn reopen(&mut self) -> Result<ClusterState, LogError>;
}

/// Why a [`Log`] could not take a batch or answer its state.
#[derive(Debug)]
pub enum LogError {
    /// The embedded journal (see [`JournalError`]).
    Journal(JournalError),
    /// etcd answered an error or could not be reached (see [`EtcdError`]).
    Etcd(EtcdError),
    /// This control plane no longer holds the leader key: another one
    /// decides now, and this one must not write again.
    NotLeader(String),
    /// What etcd holds cannot be read as the cluster's state.
    Corrupt(String),
}

impl std::fmt::Display for LogError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LogError::Journal(e) => write!(f, "{e}"),
            LogError::Etcd(e) => write!(f, "{e}"),
            LogError::NotLeader(why) => write!(
                f,
                "this control plane is no longer the leader ({why}); it stops deciding: send the request to another control plane"
            ),
            LogError::Corrupt(why) => write!(f, "the cluster state in etcd is unreadable: {why}"),
        }
    }
}

impl std::error::Error for LogError {}

impl LogError {
    /// True when the write may have landed all the same (etcd broke off or
    /// timed out after the request left): the change may have been made.
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            LogError::Etcd(EtcdError::Indeterminate { .. } | EtcdError::Timeout { .. })
        )
    }
}

impl From<JournalError> for LogError {
    fn from(e: JournalError) -> LogError {
        LogError::Journal(e)
    }
}

impl From<EtcdError> for LogError {
    fn from(e: EtcdError) -> LogError {
        LogError::Etcd(e)
    }
}

/// The journal in the state directory.
pub struct JournalLog {
    journal: Journal<ClusterState, Op>,
    dir: PathBuf,
}

impl JournalLog {
    /// The journal opened from `dir` (see [`super::worker::open_state`]).
    pub fn new(journal: Journal<ClusterState, Op>, dir: PathBuf) -> JournalLog {
        JournalLog { journal, dir }
    }
}

impl Log for JournalLog {
    fn append(&mut self, ops: &[Op]) -> Result<(), LogError> {
        Ok(self.journal.append(ops)?)
    }

    fn wants_compaction(&self) -> bool {
        self.journal.wants_compaction()
    }

    fn compact(&mut self, state: &ClusterState) -> Result<(), LogError> {
        Ok(self.journal.compact(state)?)
    }

    fn reopen(&mut self) -> Result<ClusterState, LogError> {
        let (journal, state) = Journal::open(&self.dir, STATE_NAME)?;
        self.journal = journal;
        Ok(state)
    }
}

/// What to pin to the board once a batch is durable.
#[derive(Default)]
pub struct Publish {
    /// A changed endpoint table.
    pub endpoints: Option<NewGeneration>,
    /// The registered node ids, when they may have changed.
    pub nodes: Option<BTreeSet<String>>,
}

/// One batch of the worker's: its ops, and what waits for them.
#[derive(Default)]
pub struct Batch {
    /// The ops, in the order they were applied in memory.
    pub ops: Vec<Op>,
    /// Answered once the ops are durable, or with the error.
    pub replies: Vec<Deferred>,
    /// Pinned once the ops are durable; dropped when they are not.
    pub publish: Publish,
}

impl Batch {
    /// True when there is nothing to write, answer or pin.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
            && self.replies.is_empty()
            && self.publish.endpoints.is_none()
            && self.publish.nodes.is_none()
    }
}

/// The writer thread has stopped (it panicked); the worker must stop too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterGone;

enum Message {
    Batch(Batch),
    Reload(Sender<Result<ClusterState, String>>),
}

/// The worker's end of the writer thread.
pub struct Committer {
    tx: SyncSender<Message>,
    failed: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Committer {
    /// Starts the writer over `log`, whose state is `durable`, pinning
    /// to `board`.
    pub fn spawn(
        log: Box<dyn Log>,
        durable: ClusterState,
        board: Arc<EndpointBoard>,
    ) -> std::io::Result<Committer> {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let failed = Arc::new(AtomicBool::new(false));
        let writer = Writer {
            log,
            durable,
            board,
            failure: None,
            failed: Arc::clone(&failed),
        };
        let thread = std::thread::Builder::new()
            .name("keel-cp-journal".into())
            .spawn(move || writer.run(rx))?;
        Ok(Committer { tx, failed, thread })
    }

    /// Hands `batch` over; waits only while [`QUEUE`] batches are not
    /// durable yet.
    pub fn commit(&self, batch: Batch) -> Result<(), WriterGone> {
        self.tx.send(Message::Batch(batch)).map_err(|_| WriterGone)
    }

    /// True from a failed append until a [`Committer::reload`] succeeds.
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// After a failure: waits for the batches handed over before (all
    /// answered with the error), reopens the log and answers the state it
    /// holds. On `Err` the writer stays failed and the worker retries.
    pub fn reload(&self) -> Result<Result<ClusterState, String>, WriterGone> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(Message::Reload(reply))
            .map_err(|_| WriterGone)?;
        rx.recv().map_err(|_| WriterGone)
    }

    /// Makes every batch handed over durable (or answers it with the
    /// error), then stops the thread.
    pub fn stop(self) {
        drop(self.tx);
        if self.thread.join().is_err() {
            log::error!("the journal's writer thread panicked");
        }
    }
}

struct Writer {
    log: Box<dyn Log>,
    /// Every op synced, replayed: what a snapshot may hold.
    durable: ClusterState,
    board: Arc<EndpointBoard>,
    /// Why the first failed append failed, until a reload.
    failure: Option<String>,
    failed: Arc<AtomicBool>,
}

impl Writer {
    fn run(mut self, rx: Receiver<Message>) {
        let mut next = rx.recv().ok();
        while let Some(message) = next.take() {
            match message {
                Message::Batch(batch) => {
                    // Every batch already waiting goes into the same write:
                    // while one write waits for the disk (or for etcd's
                    // quorum), the worker hands over more, and one sync for
                    // all of them is the group commit across batches.
                    let mut batches = vec![batch];
                    let mut ops = batches[0].ops.len();
                    while ops < MAX_MERGED_OPS {
                        match rx.try_recv() {
                            Ok(Message::Batch(b)) => {
                                ops += b.ops.len();
                                batches.push(b);
                            }
                            Ok(other) => {
                                next = Some(other);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    self.write(batches);
                }
                Message::Reload(reply) => {
                    let _ = reply.send(self.reload());
                }
            }
            if next.is_none() {
                next = rx.recv().ok();
            }
        }
    }

    /// Makes `batches` durable with one append, then pins what they
    /// publish and answers them, in order.
    fn write(&mut self, mut batches: Vec<Batch>) {
        let outcome = match &self.failure {
            Some(first) => Err(refusal(format!(
                "the control plane could not persist this change and did not make it: an earlier write failed ({first}); it is reloading its state from disk, retry"
            ))),
            None => {
                let ops: Vec<Op> = batches.iter_mut().flat_map(|b| b.ops.drain(..)).collect();
                self.append(&ops)
            }
        };
        for batch in batches {
            if outcome.is_ok() {
                let Publish { endpoints, nodes } = batch.publish;
                if let Some(nodes) = nodes {
                    self.board.set_nodes(nodes);
                }
                if let Some(next) = endpoints {
                    self.board.publish(next);
                }
            }
            for reply in batch.replies {
                reply(outcome.clone());
            }
        }
    }

    fn append(&mut self, ops: &[Op]) -> Result<(), Refusal> {
        if ops.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.log.append(ops) {
            log::error!("could not persist the cluster state: {e}");
            self.failure = Some(e.to_string());
            self.failed.store(true, Ordering::Release);
            return Err(refusal(if e.outcome_unknown() {
                format!(
                    "the control plane could not confirm this change, which may or may not have been made: {e}; read it back before you retry"
                )
            } else {
                format!("the control plane could not persist this change and did not make it: {e}")
            }));
        }
        for op in ops {
            self.durable.replay(op);
        }
        if self.log.wants_compaction()
            && let Err(e) = self.log.compact(&self.durable)
        {
            // The log still holds everything; compaction retries later.
            log::warn!("state compaction failed: {e}");
        }
        Ok(())
    }

    fn reload(&mut self) -> Result<ClusterState, String> {
        match self.log.reopen() {
            Ok(state) => {
                self.durable = state.clone();
                self.failure = None;
                self.failed.store(false, Ordering::Release);
                Ok(state)
            }
            Err(e) => {
                log::error!("could not reload the cluster state: {e}");
                Err(e.to_string())
            }
        }
    }
}

fn refusal(message: String) -> Refusal {
    Refusal {
        status: 500,
        message,
        field: None,
    }
}

/// A [`Log`] for the tests of this thread and of the worker.
#[cfg(test)]
pub(crate) mod test_log {
    use super::*;
    use std::sync::Mutex;

    /// A journal whose appends can be held at a gate or made to fail, and
    /// whose snapshots are recorded.
    pub(crate) struct TestLog {
        pub(crate) inner: JournalLog,
        /// Told when an append starts, before it waits at the gate.
        pub(crate) entered: Option<Sender<usize>>,
        pub(crate) gate: Option<Receiver<()>>,
        pub(crate) fail_next: Arc<AtomicBool>,
        pub(crate) snapshots: Arc<Mutex<Vec<ClusterState>>>,
    }

    impl Log for TestLog {
        fn append(&mut self, ops: &[Op]) -> Result<(), LogError> {
            if let Some(entered) = &self.entered {
                let _ = entered.send(ops.len());
            }
            if let Some(gate) = &self.gate {
                let _ = gate.recv();
            }
            if self.fail_next.swap(false, Ordering::SeqCst) {
                return Err(LogError::Journal(JournalError::Log {
                    path: PathBuf::from("cluster.log"),
                    action: "fsync",
                    source: std::io::Error::other("injected"),
                }));
            }
            self.inner.append(ops)
        }

        fn wants_compaction(&self) -> bool {
            true
        }

        fn compact(&mut self, state: &ClusterState) -> Result<(), LogError> {
            self.snapshots.lock().expect("lock").push(state.clone());
            self.inner.compact(state)
        }

        fn reopen(&mut self) -> Result<ClusterState, LogError> {
            self.inner.reopen()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_log::TestLog;
    use super::*;
    use std::sync::Mutex;
    use std::sync::mpsc::TryRecvError;

    struct Setup {
        _dir: tempfile::TempDir,
        committer: Committer,
        board: Arc<EndpointBoard>,
        open_gate: Option<Sender<()>>,
        entered: Receiver<usize>,
        fail_next: Arc<AtomicBool>,
        snapshots: Arc<Mutex<Vec<ClusterState>>>,
    }

    fn setup(gated: bool) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, state) = Journal::open(dir.path(), STATE_NAME).expect("opens");
        let (open_gate, gate) = if gated {
            let (tx, rx) = mpsc::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let fail_next = Arc::new(AtomicBool::new(false));
        let snapshots = Arc::new(Mutex::new(Vec::new()));
        let (entered_tx, entered) = mpsc::channel();
        let log = TestLog {
            inner: JournalLog::new(journal, dir.path().to_path_buf()),
            entered: Some(entered_tx),
            gate,
            fail_next: Arc::clone(&fail_next),
            snapshots: Arc::clone(&snapshots),
        };
        let board = Arc::new(EndpointBoard::new(
            1,
            1,
            Arc::new(Vec::new()),
            BTreeSet::new(),
        ));
        let committer = Committer::spawn(Box::new(log), state, Arc::clone(&board)).expect("spawns");
        Setup {
            _dir: dir,
            committer,
            board,
            open_gate,
            entered,
            fail_next,
            snapshots,
        }
    }

    fn volume(name: &str) -> Op {
        Op::PutVolume {
            name: name.to_string(),
            node: "n1".to_string(),
        }
    }

    /// A batch of `ops` whose reply arrives on the returned channel, and
    /// which pins `generation` to the board.
    fn batch(ops: Vec<Op>, generation: u64) -> (Batch, Receiver<Result<(), Refusal>>) {
        let (tx, rx) = mpsc::channel();
        let batch = Batch {
            ops,
            replies: vec![Box::new(move |r| {
                let _ = tx.send(r);
            })],
            publish: Publish {
                endpoints: Some(NewGeneration {
                    generation,
                    services: Arc::new(Vec::new()),
                    changed: None,
                }),
                nodes: Some(BTreeSet::from([format!("node-{generation}")])),
            },
        };
        (batch, rx)
    }

    fn reply(rx: &Receiver<Result<(), Refusal>>) -> Result<(), Refusal> {
        rx.recv().expect("the writer answers every batch")
    }

    #[test]
    fn the_worker_goes_on_while_a_batch_waits_for_the_disk_and_its_reply_waits_for_durability() {
        let mut s = setup(true);
        let (first, first_rx) = batch(vec![volume("a")], 2);
        let (second, second_rx) = batch(vec![volume("b")], 3);
        // Both handed over while the first append is held at the gate.
        s.committer.commit(first).expect("hands over");
        s.committer.commit(second).expect("hands over");
        assert_eq!(first_rx.try_recv(), Err(TryRecvError::Empty));
        assert_eq!(s.board.generation(), 1, "nothing pinned before durable");
        let gate = s.open_gate.take().expect("gated");
        gate.send(()).expect("writer waits");
        assert_eq!(reply(&first_rx), Ok(()));
        gate.send(()).expect("writer waits");
        assert_eq!(reply(&second_rx), Ok(()));
        assert_eq!(s.board.generation(), 3);
        assert!(s.board.knows("node-3"));
        drop(gate);
        s.committer.stop();
        let (_, on_disk) =
            Journal::<ClusterState, Op>::open(s._dir.path(), STATE_NAME).expect("reopens");
        assert_eq!(
            on_disk.volumes.keys().collect::<Vec<_>>(),
            vec!["a", "b"],
            "both batches are on disk"
        );
    }

    #[test]
    fn a_failed_append_fails_every_later_batch_until_the_reload_answers_the_disk() {
        let s = setup(false);
        let (ok, ok_rx) = batch(vec![volume("kept")], 2);
        s.committer.commit(ok).expect("hands over");
        assert_eq!(reply(&ok_rx), Ok(()));

        s.fail_next.store(true, Ordering::SeqCst);
        let (lost, lost_rx) = batch(vec![volume("lost")], 3);
        // Built on the failed one in the worker's memory: fails too,
        // although its own append would have worked.
        let (after, after_rx) = batch(vec![volume("after")], 4);
        s.committer.commit(lost).expect("hands over");
        s.committer.commit(after).expect("hands over");
        let lost = reply(&lost_rx).expect_err("the failed append is refused");
        assert_eq!(lost.status, 500);
        assert!(lost.message.contains("injected"), "{}", lost.message);
        // Refused too, whether it shared the failed write or came after.
        let after = reply(&after_rx).expect_err("a later batch is refused");
        assert_eq!(after.status, 500, "{}", after.message);
        assert!(s.committer.failed());
        assert_eq!(s.board.generation(), 2, "no failed batch is pinned");
        assert!(!s.board.knows("node-4"));

        let state = s.committer.reload().expect("writer runs").expect("reloads");
        assert_eq!(
            state.volumes.keys().collect::<Vec<_>>(),
            vec!["kept"],
            "the disk holds what was acknowledged, nothing refused"
        );
        assert!(!s.committer.failed());
        let (again, again_rx) = batch(vec![volume("again")], 5);
        s.committer.commit(again).expect("hands over");
        assert_eq!(reply(&again_rx), Ok(()));
        assert_eq!(s.board.generation(), 5);
        s.committer.stop();
    }

    #[test]
    fn a_snapshot_holds_only_what_was_synced() {
        let s = setup(false);
        let (ok, ok_rx) = batch(vec![volume("synced")], 2);
        s.committer.commit(ok).expect("hands over");
        assert_eq!(reply(&ok_rx), Ok(()));
        s.fail_next.store(true, Ordering::SeqCst);
        let (lost, lost_rx) = batch(vec![volume("lost")], 3);
        s.committer.commit(lost).expect("hands over");
        assert!(reply(&lost_rx).is_err());
        s.committer.reload().expect("writer runs").expect("reloads");
        let (next, next_rx) = batch(vec![volume("next")], 4);
        s.committer.commit(next).expect("hands over");
        assert_eq!(reply(&next_rx), Ok(()));
        s.committer.stop();
        let snapshots = s.snapshots.lock().expect("lock");
        let held: Vec<Vec<&String>> = snapshots
            .iter()
            .map(|s| s.volumes.keys().collect())
            .collect();
        assert_eq!(
            held,
            vec![vec!["synced"], vec!["next", "synced"]],
            "each snapshot is the synced state at its time"
        );
    }

    #[test]
    fn only_a_write_cut_off_after_it_left_may_have_landed() {
        let cut = LogError::Etcd(EtcdError::Indeterminate {
            op: "txn",
            endpoint: "http://192.0.2.5:2379".into(),
            detail: "connection reset".into(),
        });
        assert!(cut.outcome_unknown());
        assert!(!LogError::NotLeader("taken".into()).outcome_unknown());
        assert!(!LogError::Corrupt("bad".into()).outcome_unknown());
    }

    #[test]
    fn batches_waiting_behind_a_write_share_the_next_one() {
        let mut s = setup(true);
        let gate = s.open_gate.take().expect("gated");
        let (first, first_rx) = batch(vec![volume("a")], 2);
        s.committer.commit(first).expect("hands over");
        assert_eq!(s.entered.recv(), Ok(1), "the first write, alone");
        // Held at the gate: these three wait behind it.
        let waiting: Vec<_> = (0..3)
            .map(|i| {
                let (b, rx) = batch(vec![volume(&format!("w{i}"))], 3 + i);
                s.committer.commit(b).expect("hands over");
                rx
            })
            .collect();
        gate.send(()).expect("the first write");
        assert_eq!(reply(&first_rx), Ok(()));
        // One more pass of the gate serves all three.
        assert_eq!(s.entered.recv(), Ok(3), "one write of the three batches");
        gate.send(()).expect("the shared write");
        for rx in &waiting {
            assert_eq!(reply(rx), Ok(()));
        }
        assert_eq!(s.board.generation(), 5, "each batch's table, in order");
        drop(gate);
        s.committer.stop();
        let snapshots = s.snapshots.lock().expect("lock");
        assert_eq!(snapshots.len(), 2, "two writes for four batches");
    }

    #[test]
    fn stop_makes_every_batch_handed_over_durable_first() {
        let s = setup(false);
        let mut replies = Vec::new();
        for i in 0..10 {
            let (b, rx) = batch(vec![volume(&format!("v{i}"))], 2 + i);
            s.committer.commit(b).expect("hands over");
            replies.push(rx);
        }
        s.committer.stop();
        for rx in &replies {
            assert_eq!(reply(rx), Ok(()));
        }
        let (_, on_disk) =
            Journal::<ClusterState, Op>::open(s._dir.path(), STATE_NAME).expect("reopens");
        assert_eq!(on_disk.volumes.len(), 10);
    }
}
