//! The control plane's one worker thread, and the channel that reaches it.
//!
//! The worker owns the [`Cluster`] (registry, placements, applies in flight)
//! and the [`Journal`]. HTTP handler threads hold a [`WorkerHandle`] and send
//! [`Command`]s carrying their own reply channels. Forwarding to an agent never
//! happens here: the worker only resolves (a read, no network) and records, so
//! one slow node cannot stall the cluster.
//!
//! Group commit: the worker takes every command already queued (up to
//! [`MAX_BATCH`]), applies them in memory, and hands all their ops to the
//! journal's writer thread ([`super::commit`]), which appends them with one
//! fsync and only then answers the commands that changed something. Under
//! load many applies share one fsync; alone, a request costs one. The worker
//! does not wait for the disk: it goes on with the next batch (heartbeats,
//! reads) while the writer syncs. When a write fails, the writer refuses
//! that batch and every later one, and the worker, at its next wake, takes
//! the state on disk (exactly what was acknowledged) as its own.
//!
//! Endpoints: after every batch that held a request able to change the
//! endpoint table (a heartbeat, a service put or delete, a placement
//! change, a node removal), and at least every quarter of the stall
//! threshold whatever it held (liveness changes with time alone), the worker
//! asks the registry for a changed table
//! ([`Cluster::refresh_endpoints`]) and hands it to the writer with the
//! batch, which pins it, once durable, to the [`EndpointBoard`], where the
//! API's long polls read it without asking this thread.
//!
//! Events: the registry records its decisions in a ring
//! ([`crate::common::events`]) that the API reads through
//! [`WorkerHandle::events`] without asking this thread; the worker writes
//! the ring to its file once per batch that recorded any, and on every wake
//! notices leases that ran out ([`Cluster::notice_deaths`]), so a NodeDead
//! is told when it happens rather than at the next read.
//!
//! Stalls: when this thread could not run for longer than half of
//! `dead_after` (a slow batch, a stopped process), the heartbeats it missed
//! prove nothing, so every lease still running restarts
//! ([`Cluster::observation_gap`]) instead of expiring on the next read.

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::common::events::EventLog;
use crate::common::journal::{Journal, JournalError};
use crate::common::metrics::Unavailable;
use crate::common::supervise::{self, WorkerHealth};
use crate::common::wire::NodeRemoval;
use crate::common::wire::{
    HeartbeatRequest, NodeStatus, RegisterRequest, RegisterResponse, Resources, ServiceApply,
    ServiceRevision, ServiceStatus,
};
#[cfg(doc)]
use crate::controlplane::commit::JournalLog;
use crate::controlplane::commit::{Batch, Committer, Deferred, Log};
use crate::controlplane::endpoint_board::EndpointBoard;
use crate::controlplane::node_leases::{HeardFrom, NodeRecord};
use crate::controlplane::registry::{Cluster, HealAction, HeartbeatAnswer, Refusal, Target};
use crate::controlplane::state::{ClusterState, Op, STATE_NAME};

/// Most commands handled (and journaled) together.
pub const MAX_BATCH: usize = 1024;

type Reply<T> = Sender<Result<T, Refusal>>;

/// What the worker can be asked to do.
pub enum Command {
    /// `POST /nodes/register`.
    Register(RegisterRequest, Reply<RegisterResponse>),
    /// `POST /nodes/{id}/heartbeat`: the answer, and the heal the cluster
    /// needs after it (for every service not already healing), planned in
    /// the same visit: one round trip per heartbeat, not two.
    Heartbeat(
        String,
        HeartbeatRequest,
        Reply<(HeartbeatAnswer, Vec<HealAction>)>,
    ),
    /// `GET /nodes`.
    Nodes(Sender<Vec<NodeStatus>>),
    /// A node's committed resources from an apply's answer (no reply).
    NoteCommitted(String, Resources),
    /// Address of an Alive node (named routes).
    ResolveNode(String, Reply<std::net::SocketAddr>),
    /// Where a placed jail lives (GET, DELETE).
    ResolvePlaced(String, Reply<Target>),
    /// Start an apply of a jail (to `node` for the named route).
    BeginApply {
        /// Jail name.
        name: String,
        /// The named route's node, `None` for the scheduled route.
        node: Option<String>,
        /// The volumes the jail declares (the request's `?volumes=`).
        volumes: Vec<String>,
        /// Where the answer goes.
        reply: Reply<Target>,
    },
    /// End an apply; records the placement when it succeeded.
    FinishApply {
        /// Jail name.
        name: String,
        /// What `BeginApply` answered.
        target: Target,
        /// Whether the node answered 2xx.
        succeeded: bool,
        /// Whether the request may have changed the node (anything but a
        /// 4xx refusal): its volumes are registered there.
        reached: bool,
        /// Answered once the placement is durable.
        reply: Reply<()>,
    },
    /// Mark a placed jail as being deleted, durably, before its DELETE is
    /// forwarded.
    BeginDelete {
        /// Jail name.
        name: String,
        /// The node it is placed on.
        node: String,
        /// Answered once the mark is persisted.
        reply: Reply<()>,
    },
    /// The node confirmed a delete: forget the placement.
    RemovePlacement {
        /// Jail name.
        name: String,
        /// The node that confirmed.
        node: String,
        /// Answered once durable.
        reply: Reply<()>,
    },
    /// `PUT /services/{name}`: create or scale; answers the heal to carry out.
    PutService {
        /// Service name.
        name: String,
        /// What keelctl sent.
        apply: ServiceApply,
        /// Answered once the record is durable.
        reply: Reply<Vec<HealAction>>,
    },
    /// `POST /services/{name}/scale`: answers the heal to carry out.
    ScaleService(String, u32, Reply<Vec<HealAction>>),
    /// `POST /services/{name}/undo`: answers the new revision and the heal.
    UndoService(String, Option<u64>, Reply<(u64, Vec<HealAction>)>),
    /// `GET /services/{name}/revisions`.
    ServiceRevisions(String, Sender<Option<Vec<ServiceRevision>>>),
    /// `DELETE /services/{name}`, first: its replicas leave the rotation.
    RetireService(String, Reply<()>),
    /// Whether a retiring service's replicas have drained.
    ServiceDrained(String, Sender<bool>),
    /// `DELETE /services/{name}`, once drained: answers the replicas to remove.
    RemoveService(String, Reply<Vec<HealAction>>),
    /// `DELETE /nodes/{id}`: forget a Dead node and what was placed on it.
    RemoveNode(String, Reply<NodeRemoval>),
    /// `POST /nodes/{id}/cordon` (true) or `/uncordon` (false).
    SetCordoned(String, bool, Reply<()>),
    /// `GET /services/{name}`.
    Service(String, Sender<Option<ServiceStatus>>),
    /// `GET /services`.
    Services(Sender<Vec<ServiceStatus>>),
    /// The service document and its template digest, to forward with a
    /// replica apply.
    ServiceDocument(String, Sender<Option<(String, String)>>),
    /// Where a volume is (`GET/DELETE /volumes/{name}`).
    ResolveVolume(String, Reply<Target>),
    /// The node destroyed a volume (or has none of that name): forget it.
    RemoveVolume {
        /// Volume name.
        name: String,
        /// The node that answered.
        node: String,
        /// Answered once durable.
        reply: Reply<()>,
    },
    /// The volume registry grouped by node, with each node's address when
    /// Alive (`GET /volumes`).
    VolumeHomes(Sender<Vec<VolumeHome>>),
    /// A heal is over.
    HealDone(Vec<String>),
    /// Answer at once (`/healthz`: the worker is alive and not stuck).
    Health(Sender<()>),
    /// Stop the loop.
    Shutdown,
    /// Where an apply of a jail would go, recording nothing (a dry run):
    /// see [`Cluster::plan_apply`].
    PlanApply {
        /// Jail name.
        name: String,
        /// The named route's node, `None` for the scheduled route.
        node: Option<String>,
        /// The volumes the jail declares (the request's `?volumes=`).
        volumes: Vec<String>,
        /// Where the answer goes.
        reply: Reply<Target>,
    },
    /// What a service apply would be refused for, and the apply held:
    /// see [`Cluster::check_service_apply`].
    CheckService(String, Box<ServiceApply>, Reply<Option<ServiceApply>>),
}

/// The worker thread has stopped; the daemon must stop too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerGone;

impl std::fmt::Display for WorkerGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the control plane's worker thread has stopped; restart keel-controlplane")
    }
}

impl std::error::Error for WorkerGone {}

/// Cloneable access to the worker.
#[derive(Clone)]
pub struct WorkerHandle {
    tx: Sender<Command>,
    board: Arc<EndpointBoard>,
    events: EventLog,
}

impl WorkerHandle {
    /// The ring the registry records its decisions in, read without asking
    /// the worker (`GET /events`).
    pub fn events(&self) -> &EventLog {
        &self.events
    }

    /// The endpoint table the worker publishes, read without asking it.
    pub fn endpoint_board(&self) -> &Arc<EndpointBoard> {
        &self.board
    }

    fn ask<T>(
        &self,
        make: impl FnOnce(Reply<T>) -> Command,
    ) -> Result<Result<T, Refusal>, WorkerGone> {
        let (reply, rx) = mpsc::channel();
        self.tx.send(make(reply)).map_err(|_| WorkerGone)?;
        rx.recv().map_err(|_| WorkerGone)
    }

    /// See [`Command::Register`].
    pub fn register(
        &self,
        req: RegisterRequest,
    ) -> Result<Result<RegisterResponse, Refusal>, WorkerGone> {
        self.ask(|r| Command::Register(req, r))
    }

    /// See [`Command::Heartbeat`].
    pub fn heartbeat(
        &self,
        id: &str,
        req: HeartbeatRequest,
    ) -> Result<Result<(HeartbeatAnswer, Vec<HealAction>), Refusal>, WorkerGone> {
        self.ask(|r| Command::Heartbeat(id.to_string(), req, r))
    }

    /// See [`Command::Nodes`].
    pub fn nodes(&self) -> Result<Vec<NodeStatus>, WorkerGone> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(Command::Nodes(reply))
            .map_err(|_| WorkerGone)?;
        rx.recv().map_err(|_| WorkerGone)
    }

    /// See [`Command::ResolveNode`].
    pub fn resolve_node(
        &self,
        id: &str,
    ) -> Result<Result<std::net::SocketAddr, Refusal>, WorkerGone> {
        self.ask(|r| Command::ResolveNode(id.to_string(), r))
    }

    /// See [`Command::ResolvePlaced`].
    pub fn resolve_placed(&self, name: &str) -> Result<Result<Target, Refusal>, WorkerGone> {
        self.ask(|r| Command::ResolvePlaced(name.to_string(), r))
    }

    /// See [`Command::BeginApply`].
    pub fn begin_apply(
        &self,
        name: &str,
        node: Option<&str>,
        volumes: Vec<String>,
    ) -> Result<Result<Target, Refusal>, WorkerGone> {
        self.ask(|reply| Command::BeginApply {
            name: name.to_string(),
            node: node.map(str::to_string),
            volumes,
            reply,
        })
    }

    /// See [`Command::PlanApply`].
    pub fn plan_apply(
        &self,
        name: &str,
        node: Option<&str>,
        volumes: Vec<String>,
    ) -> Result<Result<Target, Refusal>, WorkerGone> {
        self.ask(|reply| Command::PlanApply {
            name: name.to_string(),
            node: node.map(str::to_string),
            volumes,
            reply,
        })
    }

    /// See [`Command::CheckService`].
    pub fn check_service(
        &self,
        name: &str,
        apply: ServiceApply,
    ) -> Result<Result<Option<ServiceApply>, Refusal>, WorkerGone> {
        self.ask(|reply| Command::CheckService(name.to_string(), Box::new(apply), reply))
    }

    /// See [`Command::FinishApply`].
    pub fn finish_apply(
        &self,
        name: &str,
        target: Target,
        succeeded: bool,
        reached: bool,
    ) -> Result<Result<(), Refusal>, WorkerGone> {
        self.ask(|reply| Command::FinishApply {
            name: name.to_string(),
            target,
            succeeded,
            reached,
            reply,
        })
    }

    /// See [`Command::NoteCommitted`]; does not wait.
    pub fn note_committed(&self, node: &str, committed: Resources) -> Result<(), WorkerGone> {
        self.tx
            .send(Command::NoteCommitted(node.to_string(), committed))
            .map_err(|_| WorkerGone)
    }

    /// See [`Command::ResolveVolume`].
    pub fn resolve_volume(&self, name: &str) -> Result<Result<Target, Refusal>, WorkerGone> {
        self.ask(|r| Command::ResolveVolume(name.to_string(), r))
    }

    /// See [`Command::RemoveVolume`].
    pub fn remove_volume(&self, name: &str, node: &str) -> Result<Result<(), Refusal>, WorkerGone> {
        self.ask(|reply| Command::RemoveVolume {
            name: name.to_string(),
            node: node.to_string(),
            reply,
        })
    }

    /// See [`Command::VolumeHomes`].
    pub fn volume_homes(&self) -> Result<Vec<VolumeHome>, WorkerGone> {
        self.get(Command::VolumeHomes)
    }

    /// See [`Command::BeginDelete`].
    pub fn begin_delete(&self, name: &str, node: &str) -> Result<Result<(), Refusal>, WorkerGone> {
        self.ask(|reply| Command::BeginDelete {
            name: name.to_string(),
            node: node.to_string(),
            reply,
        })
    }

    /// See [`Command::RemovePlacement`].
    pub fn remove_placement(
        &self,
        name: &str,
        node: &str,
    ) -> Result<Result<(), Refusal>, WorkerGone> {
        self.ask(|reply| Command::RemovePlacement {
            name: name.to_string(),
            node: node.to_string(),
            reply,
        })
    }

    /// See [`Command::PutService`].
    pub fn put_service(
        &self,
        name: &str,
        apply: ServiceApply,
    ) -> Result<Result<Vec<HealAction>, Refusal>, WorkerGone> {
        self.ask(|reply| Command::PutService {
            name: name.to_string(),
            apply,
            reply,
        })
    }

    /// See [`Command::ScaleService`].
    pub fn scale_service(
        &self,
        name: &str,
        replicas: u32,
    ) -> Result<Result<Vec<HealAction>, Refusal>, WorkerGone> {
        self.ask(|r| Command::ScaleService(name.to_string(), replicas, r))
    }

    /// See [`Command::UndoService`].
    pub fn undo_service(
        &self,
        name: &str,
        to: Option<u64>,
    ) -> Result<Result<(u64, Vec<HealAction>), Refusal>, WorkerGone> {
        self.ask(|r| Command::UndoService(name.to_string(), to, r))
    }

    /// See [`Command::ServiceRevisions`].
    pub fn service_revisions(
        &self,
        name: &str,
    ) -> Result<Option<Vec<ServiceRevision>>, WorkerGone> {
        self.get(|r| Command::ServiceRevisions(name.to_string(), r))
    }

    /// See [`Command::RetireService`].
    pub fn retire_service(&self, name: &str) -> Result<Result<(), Refusal>, WorkerGone> {
        self.ask(|r| Command::RetireService(name.to_string(), r))
    }

    /// See [`Command::ServiceDrained`].
    pub fn service_drained(&self, name: &str) -> Result<bool, WorkerGone> {
        self.get(|r| Command::ServiceDrained(name.to_string(), r))
    }

    /// See [`Command::RemoveService`].
    pub fn remove_service(
        &self,
        name: &str,
    ) -> Result<Result<Vec<HealAction>, Refusal>, WorkerGone> {
        self.ask(|r| Command::RemoveService(name.to_string(), r))
    }

    /// See [`Command::SetCordoned`].
    pub fn set_cordoned(
        &self,
        id: &str,
        cordoned: bool,
    ) -> Result<Result<(), Refusal>, WorkerGone> {
        self.ask(|r| Command::SetCordoned(id.to_string(), cordoned, r))
    }

    /// See [`Command::RemoveNode`].
    pub fn remove_node(&self, id: &str) -> Result<Result<NodeRemoval, Refusal>, WorkerGone> {
        self.ask(|r| Command::RemoveNode(id.to_string(), r))
    }

    fn get<T>(&self, make: impl FnOnce(Sender<T>) -> Command) -> Result<T, WorkerGone> {
        let (reply, rx) = mpsc::channel();
        self.tx.send(make(reply)).map_err(|_| WorkerGone)?;
        rx.recv().map_err(|_| WorkerGone)
    }

    /// See [`Command::Service`].
    pub fn service(&self, name: &str) -> Result<Option<ServiceStatus>, WorkerGone> {
        self.get(|r| Command::Service(name.to_string(), r))
    }

    /// See [`Command::Services`].
    pub fn services(&self) -> Result<Vec<ServiceStatus>, WorkerGone> {
        self.get(Command::Services)
    }

    /// See [`Command::ServiceDocument`].
    pub fn service_document(&self, name: &str) -> Result<Option<(String, String)>, WorkerGone> {
        self.get(|r| Command::ServiceDocument(name.to_string(), r))
    }

    /// See [`Command::HealDone`].
    pub fn heal_done(&self, services: Vec<String>) {
        let _ = self.tx.send(Command::HealDone(services));
    }

    /// [`Command::Nodes`] and [`Command::Services`], both queued at once and
    /// waited for at most `wait` in all: the metrics must not wait behind a
    /// long batch. A late answer goes to a closed channel, which the worker
    /// ignores.
    pub fn nodes_and_services_within(
        &self,
        wait: Duration,
    ) -> Result<(Vec<NodeStatus>, Vec<ServiceStatus>), Unavailable> {
        let gone = || Unavailable::Gone(WorkerGone.to_string());
        let (nodes_reply, nodes) = mpsc::channel();
        let (services_reply, services) = mpsc::channel();
        self.tx
            .send(Command::Nodes(nodes_reply))
            .map_err(|_| gone())?;
        self.tx
            .send(Command::Services(services_reply))
            .map_err(|_| gone())?;
        let deadline = Instant::now() + wait;
        let busy = || {
            Unavailable::Busy(format!(
                "keel-controlplane's worker has not answered within {} s (a long batch or a slow journal write); retry the scrape",
                wait.as_secs_f64()
            ))
        };
        let left = || deadline.saturating_duration_since(Instant::now());
        let fail = |e| match e {
            mpsc::RecvTimeoutError::Timeout => busy(),
            mpsc::RecvTimeoutError::Disconnected => gone(),
        };
        let nodes = nodes.recv_timeout(left()).map_err(fail)?;
        let services = services.recv_timeout(left()).map_err(fail)?;
        Ok((nodes, services))
    }

    /// See [`Command::Health`]: whether the worker answers within `wait`.
    pub fn health(&self, wait: std::time::Duration) -> WorkerHealth {
        let (reply, rx) = mpsc::channel();
        if self.tx.send(Command::Health(reply)).is_err() {
            return WorkerHealth::Gone;
        }
        supervise::await_answer(&rx, wait)
    }

    /// Asks the loop to stop after what is queued.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

/// The registered volumes of one node, for `GET /volumes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeHome {
    /// Node id.
    pub node: String,
    /// Its agent when Alive, else why it cannot be asked.
    pub addr: Result<std::net::SocketAddr, String>,
    /// Volume names the registry places on it.
    pub volumes: Vec<String>,
}

/// The worker's owned state.
pub struct Worker {
    cluster: Cluster,
    log: Box<dyn Log>,
    heard: Option<Box<dyn HeardFrom>>,
}

impl Worker {
    /// A worker over `cluster`, whose state `log` holds (the journal
    /// opened with [`open_state`], in a [`JournalLog`], or etcd).
    pub fn new(cluster: Cluster, log: Box<dyn Log>) -> Worker {
        Worker {
            cluster,
            log,
            heard: None,
        }
    }

    /// Tells `heard` of every node heard from, with its load (the record of
    /// live nodes in etcd, [`crate::controlplane::node_leases`]).
    pub fn with_heard(mut self, heard: Box<dyn HeardFrom>) -> Worker {
        self.heard = Some(heard);
        self
    }

    /// Starts the worker thread (and the journal's writer thread).
    pub fn spawn(mut self) -> std::io::Result<(WorkerHandle, JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel();
        let now = Instant::now();
        // Handed out now, so the first refresh after a batch starts from it.
        self.cluster.refresh_endpoints(now);
        let (generation, services) = self.cluster.published_endpoints();
        let board = Arc::new(EndpointBoard::new(
            self.cluster.endpoints_origin(),
            generation,
            services,
            node_ids(&self.cluster),
        ));
        let events = self.cluster.events().clone();
        let Worker {
            cluster,
            log,
            heard,
        } = self;
        let durable = cluster.state().clone();
        let committer = Committer::spawn(log, durable, Arc::clone(&board))?;
        let running = Running {
            cluster,
            committer,
            heard,
        };
        let handle = std::thread::Builder::new()
            .name("keel-cp-worker".into())
            .spawn(move || running.run(rx))?;
        Ok((WorkerHandle { tx, board, events }, handle))
    }
}

fn node_ids(cluster: &Cluster) -> std::collections::BTreeSet<String> {
    cluster.state().nodes.keys().cloned().collect()
}

/// The worker thread's state: the cluster, and the writer that makes its
/// changes durable.
struct Running {
    cluster: Cluster,
    committer: Committer,
    heard: Option<Box<dyn HeardFrom>>,
}

impl Running {
    fn run(mut self, rx: Receiver<Command>) {
        // Stall detection: the loop wakes at least every quarter of the
        // stall threshold, idle or not, so when more than the threshold has
        // passed since it last woke, this thread could not run (a batch took
        // that long, the process was stopped or starved): the heartbeats it
        // did not handle meanwhile are no evidence against any node.
        let threshold = self.cluster.stall_threshold();
        let mut previous = Instant::now();
        let mut refreshed = previous;
        loop {
            let received = rx.recv_timeout(threshold / 4);
            let now = Instant::now();
            if now.saturating_duration_since(previous) > threshold {
                self.cluster.observation_gap(previous, now);
            }
            previous = now;
            let reloaded = self.committer.failed() && self.reload();
            self.cluster.notice_deaths(now);
            let first = match received {
                Ok(cmd) => Some(cmd),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            let mut batch = Batch::default();
            let mut stop = false;
            let mut endpoints_may_change = reloaded;
            let mut nodes_may_change = reloaded;
            let mut commands: Vec<Command> = first.into_iter().collect();
            while !commands.is_empty() && commands.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(cmd) => commands.push(cmd),
                    Err(_) => break,
                }
            }
            for cmd in commands {
                if matches!(cmd, Command::Shutdown) {
                    stop = true;
                } else {
                    endpoints_may_change |= changes_endpoints(&cmd);
                    nodes_may_change |=
                        matches!(cmd, Command::Register(..) | Command::RemoveNode(..));
                    self.handle(cmd, &mut batch.ops, &mut batch.replies);
                }
            }
            let now = Instant::now();
            if endpoints_may_change || now.saturating_duration_since(refreshed) >= threshold / 4 {
                batch.publish.endpoints = self.cluster.refresh_endpoints(now);
                refreshed = now;
            }
            if nodes_may_change {
                batch.publish.nodes = Some(node_ids(&self.cluster));
            }
            if !batch.is_empty() && self.committer.commit(batch).is_err() {
                log::error!("the journal's writer thread has stopped; the control plane stops");
                break;
            }
            self.flush_events();
            if stop {
                break;
            }
        }
        // Every acknowledged change on disk, and the last events written,
        // before the daemon exits (not left to the writer threads).
        self.committer.stop();
        if let Err(e) = self.cluster.events().flush() {
            log::warn!("events are not saved: {e}");
        }
    }

    /// One write for the events of a batch, not one per event, on the
    /// events' own writer where the daemon started one (`common::events`):
    /// heartbeats never wait for it. The next batch retries a failed one.
    fn flush_events(&self) {
        if let Err(e) = self.cluster.events().flush_soon() {
            log::warn!("events are not saved: {e}");
        }
    }

    /// Hands `id`'s load to the record of live nodes, if there is one and
    /// `id` was heard (a refused heartbeat is not).
    fn tell_heard(&self, id: &str) {
        if let (Some(heard), Some((committed, jails))) =
            (&self.heard, self.cluster.reported_load(id))
        {
            heard.heard(id, NodeRecord { committed, jails });
        }
    }

    /// After a failed write: memory holds changes the disk lacks, so take
    /// the disk's word. True when the state was replaced; on failure the
    /// next wake tries again, and the writer refuses every change meanwhile.
    fn reload(&mut self) -> bool {
        match self.committer.reload() {
            Ok(Ok(state)) => {
                self.cluster.reset(state);
                true
            }
            Ok(Err(e)) => {
                log::error!("could not reload the cluster state: {e}; retrying");
                false
            }
            Err(_) => false,
        }
    }

    /// Answers a service change with the heal it calls for, once its ops
    /// are durable; a refusal at once.
    fn answer_with_heal(
        &mut self,
        name: &str,
        changed: Result<Vec<Op>, Refusal>,
        ops: &mut Vec<Op>,
        deferred: &mut Vec<Deferred>,
        now: Instant,
        reply: Reply<Vec<HealAction>>,
    ) {
        match changed {
            Ok(new_ops) => {
                ops.extend(new_ops);
                let heal = self.cluster.plan_heal(Some(name), now);
                deferred.push(Box::new(move |r| {
                    let _ = reply.send(r.map(|()| heal));
                }));
            }
            Err(refusal) => {
                let _ = reply.send(Err(refusal));
            }
        }
    }

    fn handle(&mut self, cmd: Command, ops: &mut Vec<Op>, deferred: &mut Vec<Deferred>) {
        let now = Instant::now();
        if matches!(cmd, Command::Register(..)) {
            crate::common::faults::inject("controlplane.worker.register");
        }
        // Replies to callers who gave up (closed connection) are dropped.
        match cmd {
            Command::Register(req, reply) => match self.cluster.register(&req, now) {
                Ok((pod_cidr, new_ops)) => {
                    if !new_ops.is_empty() {
                        log::info!("node {} registered with pod_cidr {pod_cidr}", req.node_id);
                    }
                    ops.extend(new_ops);
                    let body = RegisterResponse {
                        pod_cidr: pod_cidr.to_string(),
                    };
                    deferred.push(Box::new(move |r| {
                        let _ = reply.send(r.map(|()| body));
                    }));
                }
                Err(refusal) => {
                    let _ = reply.send(Err(refusal));
                }
            },
            Command::Heartbeat(id, req, reply) => {
                let answer = self.cluster.heartbeat(&id, &req, now).map(|answer| {
                    // Persisted with the batch; a failed append reloads the
                    // state from disk and the next heartbeat tries again.
                    ops.extend(self.cluster.reap_deleted(&id, &req));
                    ops.extend(self.cluster.advance_rollouts(now));
                    (answer, self.cluster.plan_heal(None, now))
                });
                self.tell_heard(&id);
                let _ = reply.send(answer);
            }
            Command::NoteCommitted(id, committed) => self.cluster.note_committed(&id, committed),
            Command::Nodes(reply) => {
                let _ = reply.send(self.cluster.node_statuses(now));
            }
            Command::ResolveNode(id, reply) => {
                let _ = reply.send(self.cluster.resolve_node(&id, now));
            }
            Command::ResolvePlaced(name, reply) => {
                let _ = reply.send(self.cluster.resolve_placed(&name, now));
            }
            Command::BeginApply {
                name,
                node,
                volumes,
                reply,
            } => {
                let _ = reply.send(self.cluster.begin_apply_with_volumes(
                    &name,
                    node.as_deref(),
                    &volumes,
                    now,
                ));
            }
            Command::FinishApply {
                name,
                target,
                succeeded,
                reached,
                reply,
            } => {
                ops.extend(
                    self.cluster
                        .finish_apply_reached(&name, &target, succeeded, reached),
                );
                deferred.push(Box::new(move |r| {
                    let _ = reply.send(r);
                }));
            }
            Command::BeginDelete { name, node, reply } => {
                ops.extend(self.cluster.begin_delete(&name, &node));
                deferred.push(Box::new(move |r| {
                    let _ = reply.send(r);
                }));
            }
            Command::RemovePlacement { name, node, reply } => {
                ops.extend(self.cluster.remove_placement(&name, &node));
                deferred.push(Box::new(move |r| {
                    let _ = reply.send(r);
                }));
            }
            Command::PutService { name, apply, reply } => {
                let changed = self.cluster.put_service(&name, &apply, now);
                self.answer_with_heal(&name, changed, ops, deferred, now, reply);
            }
            Command::ScaleService(name, replicas, reply) => {
                let changed = self.cluster.scale_service(&name, replicas, now);
                self.answer_with_heal(&name, changed, ops, deferred, now, reply);
            }
            Command::UndoService(name, to, reply) => {
                match self.cluster.undo_service(&name, to, now) {
                    Ok((revision, new_ops)) => {
                        ops.extend(new_ops);
                        let heal = self.cluster.plan_heal(Some(&name), now);
                        deferred.push(Box::new(move |r| {
                            let _ = reply.send(r.map(|()| (revision, heal)));
                        }));
                    }
                    Err(refusal) => {
                        let _ = reply.send(Err(refusal));
                    }
                }
            }
            Command::RetireService(name, reply) => {
                let _ = reply.send(self.cluster.retire_service(&name, now));
            }
            Command::ServiceDrained(name, reply) => {
                let _ = reply.send(self.cluster.service_drained(&name, now));
            }
            Command::ServiceRevisions(name, reply) => {
                let _ = reply.send(self.cluster.service_revisions(&name));
            }
            Command::SetCordoned(id, cordoned, reply) => {
                match self.cluster.set_cordoned(&id, cordoned, now) {
                    Ok(new_ops) => {
                        ops.extend(new_ops);
                        deferred.push(Box::new(move |r| {
                            let _ = reply.send(r);
                        }));
                    }
                    Err(refusal) => {
                        let _ = reply.send(Err(refusal));
                    }
                }
            }
            Command::RemoveNode(id, reply) => match self.cluster.remove_node(&id, now) {
                Ok((new_ops, removal)) => {
                    ops.extend(new_ops);
                    deferred.push(Box::new(move |r| {
                        let _ = reply.send(r.map(|()| removal));
                    }));
                }
                Err(refusal) => {
                    let _ = reply.send(Err(refusal));
                }
            },
            Command::RemoveService(name, reply) => match self.cluster.remove_service(&name, now) {
                Ok((new_ops, removals)) => {
                    ops.extend(new_ops);
                    deferred.push(Box::new(move |r| {
                        let _ = reply.send(r.map(|()| removals));
                    }));
                }
                Err(refusal) => {
                    let _ = reply.send(Err(refusal));
                }
            },
            Command::Service(name, reply) => {
                let _ = reply.send(self.cluster.service_status(&name, now));
            }
            Command::Services(reply) => {
                let _ = reply.send(self.cluster.service_statuses(now));
            }
            Command::ServiceDocument(name, reply) => {
                let _ = reply.send(self.cluster.service_document(&name));
            }
            Command::HealDone(services) => self.cluster.heal_done(&services),
            Command::ResolveVolume(name, reply) => {
                let _ = reply.send(self.cluster.resolve_volume(&name, now));
            }
            Command::RemoveVolume { name, node, reply } => {
                ops.extend(self.cluster.remove_volume(&name, &node));
                deferred.push(Box::new(move |r| {
                    let _ = reply.send(r);
                }));
            }
            Command::VolumeHomes(reply) => {
                let mut homes: Vec<VolumeHome> = Vec::new();
                for (volume, node) in self.cluster.volume_registry() {
                    match homes.iter_mut().find(|h| &h.node == node) {
                        Some(h) => h.volumes.push(volume.clone()),
                        None => homes.push(VolumeHome {
                            node: node.clone(),
                            addr: self.cluster.resolve_node(node, now).map_err(|r| r.message),
                            volumes: vec![volume.clone()],
                        }),
                    }
                }
                let _ = reply.send(homes);
            }
            Command::Health(reply) => {
                let _ = reply.send(());
            }
            Command::Shutdown => {}
            Command::PlanApply {
                name,
                node,
                volumes,
                reply,
            } => {
                let _ = reply.send(
                    self.cluster
                        .plan_apply(&name, node.as_deref(), &volumes, now),
                );
            }
            Command::CheckService(name, apply, reply) => {
                let _ = reply.send(self.cluster.check_service_apply(&name, &apply));
            }
        }
    }
}

/// True for the commands that can change the endpoint table: what nodes
/// report, services, placements and node records.
fn changes_endpoints(cmd: &Command) -> bool {
    matches!(
        cmd,
        Command::Register(..)
            | Command::Heartbeat(..)
            | Command::FinishApply { .. }
            | Command::BeginDelete { .. }
            | Command::RemovePlacement { .. }
            | Command::PutService { .. }
            | Command::RemoveService(..)
            | Command::RemoveNode(..)
    )
}

/// Opens the journal in `state_dir`.
pub fn open_state(
    state_dir: &std::path::Path,
) -> Result<(Journal<ClusterState, Op>, ClusterState), JournalError> {
    Journal::open(state_dir, STATE_NAME)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controlplane::commit::JournalLog;
    use crate::controlplane::commit::test_log::TestLog;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn register(handle: &WorkerHandle, id: &str) -> Result<RegisterResponse, Refusal> {
        handle
            .register(RegisterRequest {
                node_id: id.into(),
                advertise_addr: std::net::SocketAddr::from(([127, 0, 0, 1], 7000)),
                capacity: Resources::default(),
            })
            .expect("the worker runs")
    }

    #[test]
    fn after_a_failed_write_the_worker_takes_the_state_on_disk_and_goes_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, state) = open_state(dir.path()).expect("opens");
        let fail_next = Arc::new(AtomicBool::new(false));
        let log = TestLog {
            inner: JournalLog::new(journal, dir.path().to_path_buf()),
            entered: None,
            gate: None,
            fail_next: Arc::clone(&fail_next),
            snapshots: Arc::new(Mutex::new(Vec::new())),
        };
        let cluster = Cluster::new(
            state,
            "10.20.0.0/16".parse().expect("cidr"),
            "10.96.0.0/16".parse().expect("cidr"),
            Duration::from_secs(15),
        );
        let (handle, thread) = Worker::new(cluster, Box::new(log)).spawn().expect("spawns");
        register(&handle, "a").expect("registers");
        fail_next.store(true, Ordering::SeqCst);
        let refused = register(&handle, "b").expect_err("the write fails");
        assert_eq!(refused.status, 500);
        assert!(
            refused.message.contains("did not make it"),
            "{}",
            refused.message
        );
        // The worker reloads before it handles the next command.
        register(&handle, "c").expect("registers after the reload");
        let ids = |nodes: Vec<NodeStatus>| nodes.into_iter().map(|n| n.node_id).collect::<Vec<_>>();
        assert_eq!(ids(handle.nodes().expect("answers")), ["a", "c"]);
        assert!(!handle.endpoint_board().knows("b"));
        assert!(handle.endpoint_board().knows("c"));
        handle.shutdown();
        thread.join().expect("the worker stops");
        let (_, on_disk) = open_state(dir.path()).expect("reopens");
        assert_eq!(on_disk.nodes.keys().collect::<Vec<_>>(), ["a", "c"]);
    }
}
