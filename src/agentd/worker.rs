//! The agent's one worker thread and the channel that reaches it.
//!
//! The concurrency story, in one place: the worker thread owns the
//! [`Reconciler`] (and with it the host seams and the state store) and
//! [`Metrics`]. Nothing else ever touches them. HTTP handler threads and the
//! reconcile timer hold a [`WorkerHandle`], a clone of the sending half of an
//! mpsc channel; each request is a [`Command`] carrying its own reply channel,
//! so handlers block only on their own answer and requests are served one at a
//! time in arrival order. A timer tick is just another command, which is why an
//! apply never races a pass.
//!
//! One thing is read without a command: after every command it handles and
//! every pass, the worker publishes its jail statuses and its metrics
//! ([`crate::agentd::snapshot`]), and [`WorkerHandle::published_jails`] and
//! [`WorkerHandle::published_metrics`] read the last ones without waiting for
//! the worker. That is what the heartbeat and `/metrics` are built from, so a
//! host command that takes 30 s delays the commands queued behind it but
//! never the node's liveness or a scrape. The snapshot is at most
//! one command behind (the one in progress), and it closes when the worker
//! thread ends, panicking or not.
//!
//! Events are read without a command too: the reconciler records them in a
//! ring ([`crate::common::events`]) that [`WorkerHandle::events`] reads and
//! `GET /events` watches wait on; the worker writes the ring to its file
//! once after each command that recorded any.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::agentd::health::Reports;
use crate::agentd::health::probe::{ExecSeam, exec_outcome};
use crate::agentd::ingress::controller::{IngressApiError, IngressController};
use crate::agentd::metrics::{Metrics, WorkerMetrics};
use crate::agentd::reconciler::{HealthTarget, JailStatus, ReconcileError, Reconciler};
use crate::agentd::routes::{self, HeartbeatOutcome};
use crate::agentd::snapshot::{self, Publisher, Snapshot};
use crate::agentd::volumes::{self, VolumeError};
use crate::common::cidr::Ipv4Net;
use crate::common::events::EventLog;
use crate::common::spec::{Ingress, Jail};
use crate::common::supervise::{self, WorkerHealth};
use crate::common::wire::{DryRunReport, IngressStatus, Peer, PlacedJail, VolumeStatus};
use crate::host::{JailRuntime, MountManager, NetManager, ZfsManager};

/// What the worker can be asked to do.
pub enum Command {
    /// Apply a jail spec (with the control plane's epoch when it placed it).
    Apply {
        /// The validated spec.
        jail: Box<Jail>,
        /// Placement epoch, `None` for local applies.
        epoch: Option<u64>,
        /// Where the answer goes.
        reply: Sender<Result<JailStatus, ReconcileError>>,
    },
    /// Delete a jail.
    Delete {
        /// Jail name.
        name: String,
        /// Where the answer goes.
        reply: Sender<Result<(), ReconcileError>>,
    },
    /// Status of one jail.
    Get {
        /// Jail name.
        name: String,
        /// Where the answer goes.
        reply: Sender<Option<JailStatus>>,
    },
    /// The document a jail was applied with, as YAML (`None`: no such
    /// jail), for `keelctl get jail NAME -o yaml`.
    Document {
        /// Jail name.
        name: String,
        /// Where the answer goes.
        reply: Sender<Option<String>>,
    },
    /// The end of a jail's workload output (`None`: no such jail).
    Log {
        /// Jail name.
        name: String,
        /// At most this many bytes, the last ones.
        max_bytes: u64,
        /// Where the answer goes.
        reply: Sender<Option<Result<Vec<u8>, String>>>,
    },
    /// Status of every jail.
    List {
        /// Where the answer goes.
        reply: Sender<Vec<JailStatus>>,
    },
    /// `GET /volumes`.
    Volumes {
        /// Where the answer goes.
        reply: Sender<Result<Vec<VolumeStatus>, VolumeError>>,
    },
    /// `GET /volumes/{name}`.
    Volume {
        /// Volume name.
        name: String,
        /// Where the answer goes.
        reply: Sender<Result<VolumeStatus, VolumeError>>,
    },
    /// `DELETE /volumes/{name}`.
    DeleteVolume {
        /// Volume name.
        name: String,
        /// Where the answer goes.
        reply: Sender<Result<(), VolumeError>>,
    },
    /// Run a reconcile pass (the timer's tick).
    Reconcile,
    /// Run a pass and answer when it is done (tests and `keelctl`-driven checks).
    ReconcileNow {
        /// Gets the number of failed jails.
        reply: Sender<usize>,
    },
    /// Move the node to the subnet the control plane assigned (persisted, and
    /// the bridge gets its first address).
    AdoptSubnet {
        /// The node's pod_cidr.
        subnet: Ipv4Net,
        /// Where the answer goes.
        reply: Sender<Result<(), ReconcileError>>,
    },
    /// Apply a heartbeat answer: see [`routes::apply_heartbeat`].
    ClusterUpdate {
        /// The node's pod_cidr.
        pod_cidr: Ipv4Net,
        /// Every other node.
        peers: Vec<Peer>,
        /// Service VIPs to alias on the bridge (empty with `agent.proxy_listen`).
        vips: BTreeSet<Ipv4Addr>,
        /// Every service's `VIP:port` by name (the Ingress backends).
        services: BTreeMap<String, SocketAddrV4>,
        /// Placed jails the control plane named stale, with the epoch reported.
        fence: Vec<PlacedJail>,
        /// Where the answer goes.
        reply: Sender<HeartbeatOutcome>,
    },
    /// An Ingress request (`/ingresses` routes).
    Ingress(IngressCommand),
    /// Answer at once (`/healthz`: the worker is alive and not stuck).
    Health(Sender<()>),
    /// The health checker's verdict on a jail's workload: see
    /// [`Reconciler::set_readiness`].
    Readiness {
        /// Jail name.
        name: String,
        /// The workload start the verdict is about.
        incarnation: u64,
        /// Whether it passes.
        ready: bool,
        /// Why not.
        reason: Option<String>,
    },
    /// The health checker gave up on a jail's workload: see
    /// [`Reconciler::restart_unhealthy`].
    RestartUnhealthy {
        /// Jail name.
        name: String,
        /// The workload start to restart.
        incarnation: u64,
        /// The last probe failure.
        reason: String,
    },
    /// An exec health probe: run argv inside the jail (jexec), answer
    /// whether it exited 0.
    HealthExec {
        /// Jail name.
        name: String,
        /// The probe's argv.
        argv: Vec<String>,
        /// Where the answer goes.
        reply: Sender<Result<(), String>>,
    },
    /// Stop the worker loop.
    Shutdown,
    /// What applying a jail spec would do, changing nothing
    /// ([`Reconciler::dry_run`], or [`Reconciler::diff`] with `diff_only`).
    DryRun {
        /// The validated spec.
        jail: Box<Jail>,
        /// Placement epoch, `None` for local applies.
        epoch: Option<u64>,
        /// The object diff and decision only, no host command.
        diff_only: bool,
        /// Where the answer goes.
        reply: Sender<Result<DryRunReport, ReconcileError>>,
    },
}

/// The `/ingresses` routes' commands.
#[derive(Debug)]
pub enum IngressCommand {
    /// Record an Ingress and run an ingress pass.
    Put {
        /// The validated Ingress.
        ingress: Box<Ingress>,
        /// Its status after the pass.
        reply: Sender<Result<Option<IngressStatus>, IngressApiError>>,
    },
    /// Forget an Ingress and run an ingress pass; false when unknown.
    Delete {
        /// Ingress name.
        name: String,
        /// Where the answer goes.
        reply: Sender<Result<bool, IngressApiError>>,
    },
    /// One Ingress.
    Get {
        /// Ingress name.
        name: String,
        /// Where the answer goes.
        reply: Sender<Option<IngressStatus>>,
    },
    /// Every Ingress.
    List {
        /// Where the answer goes.
        reply: Sender<Vec<IngressStatus>>,
    },
    /// The document an Ingress was applied with, as YAML (`None`: unknown).
    Document {
        /// Ingress name.
        name: String,
        /// Where the answer goes.
        reply: Sender<Option<String>>,
    },
}

/// The worker is gone (it panicked or shut down); the daemon must stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerGone;

impl std::fmt::Display for WorkerGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the agent's worker thread has stopped; restart keel-agentd")
    }
}

impl std::error::Error for WorkerGone {}

/// A cheap, cloneable way to send commands to the worker and wait for answers.
#[derive(Clone)]
pub struct WorkerHandle {
    tx: Sender<Command>,
    jails: Snapshot<Vec<JailStatus>>,
    health_targets: Snapshot<Vec<HealthTarget>>,
    metrics: Snapshot<WorkerMetrics>,
    events: EventLog,
}

impl WorkerHandle {
    /// Sends a command that carries a reply channel and waits for the answer.
    fn ask<T>(&self, make: impl FnOnce(Sender<T>) -> Command) -> Result<T, WorkerGone> {
        let (reply, rx) = mpsc::channel();
        self.tx.send(make(reply)).map_err(|_| WorkerGone)?;
        rx.recv().map_err(|_| WorkerGone)
    }

    /// See [`Command::Apply`].
    pub fn apply(
        &self,
        jail: Jail,
        epoch: Option<u64>,
    ) -> Result<Result<JailStatus, ReconcileError>, WorkerGone> {
        self.ask(|reply| Command::Apply {
            jail: Box::new(jail),
            epoch,
            reply,
        })
    }

    /// See [`Command::DryRun`].
    pub fn dry_run(
        &self,
        jail: Jail,
        epoch: Option<u64>,
        diff_only: bool,
    ) -> Result<Result<DryRunReport, ReconcileError>, WorkerGone> {
        self.ask(|reply| Command::DryRun {
            jail: Box::new(jail),
            epoch,
            diff_only,
            reply,
        })
    }

    /// See [`Command::Delete`].
    pub fn delete(&self, name: &str) -> Result<Result<(), ReconcileError>, WorkerGone> {
        self.ask(|reply| Command::Delete {
            name: name.to_string(),
            reply,
        })
    }

    /// See [`Command::Get`].
    pub fn get(&self, name: &str) -> Result<Option<JailStatus>, WorkerGone> {
        self.ask(|reply| Command::Get {
            name: name.to_string(),
            reply,
        })
    }

    /// See [`Command::Document`].
    pub fn document(&self, name: &str) -> Result<Option<String>, WorkerGone> {
        self.ask(|reply| Command::Document {
            name: name.to_string(),
            reply,
        })
    }

    /// See [`Command::Log`].
    pub fn log(
        &self,
        name: &str,
        max_bytes: u64,
    ) -> Result<Option<Result<Vec<u8>, String>>, WorkerGone> {
        self.ask(|reply| Command::Log {
            name: name.to_string(),
            max_bytes,
            reply,
        })
    }

    /// See [`Command::List`].
    pub fn list(&self) -> Result<Vec<JailStatus>, WorkerGone> {
        self.ask(|reply| Command::List { reply })
    }

    /// The jail statuses the worker published last (after its latest command
    /// or pass), read without waiting for the worker: see the module docs.
    pub fn published_jails(&self) -> Result<Arc<Vec<JailStatus>>, WorkerGone> {
        self.jails.latest().ok_or(WorkerGone)
    }

    /// Calls `watcher` after every later publish of the jail statuses, and
    /// once when the worker is gone ([`Snapshot::on_publish`]): the cluster
    /// thread sends a heartbeat as soon as a placed jail's readiness flips.
    pub fn on_jails_published(&self, watcher: crate::agentd::snapshot::OnPublish) {
        self.jails.on_publish(watcher);
    }

    /// The worker's metrics as it published them last, read without waiting
    /// for the worker (`agentd::metrics`).
    pub fn published_metrics(&self) -> Result<Arc<WorkerMetrics>, WorkerGone> {
        self.metrics.latest().ok_or(WorkerGone)
    }

    /// The ring the reconciler records its events in, read without waiting
    /// for the worker (`GET /events`).
    pub fn events(&self) -> &EventLog {
        &self.events
    }

    /// The running jails with a health probe, as the worker published them
    /// last, for the health checker (`agentd::health`).
    pub fn health_targets(&self) -> Snapshot<Vec<HealthTarget>> {
        self.health_targets.clone()
    }

    /// See [`IngressCommand::Put`]; `Ok(None)` when this agent runs no
    /// ingress controller.
    pub fn put_ingress(
        &self,
        ingress: Ingress,
    ) -> Result<Result<Option<IngressStatus>, IngressApiError>, WorkerGone> {
        self.ask(|reply| {
            Command::Ingress(IngressCommand::Put {
                ingress: Box::new(ingress),
                reply,
            })
        })
    }

    /// See [`IngressCommand::Delete`].
    pub fn delete_ingress(&self, name: &str) -> Result<Result<bool, IngressApiError>, WorkerGone> {
        self.ask(|reply| {
            Command::Ingress(IngressCommand::Delete {
                name: name.to_string(),
                reply,
            })
        })
    }

    /// See [`IngressCommand::Document`].
    pub fn ingress_document(&self, name: &str) -> Result<Option<String>, WorkerGone> {
        self.ask(|reply| {
            Command::Ingress(IngressCommand::Document {
                name: name.to_string(),
                reply,
            })
        })
    }

    /// See [`IngressCommand::Get`].
    pub fn ingress(&self, name: &str) -> Result<Option<IngressStatus>, WorkerGone> {
        self.ask(|reply| {
            Command::Ingress(IngressCommand::Get {
                name: name.to_string(),
                reply,
            })
        })
    }

    /// See [`IngressCommand::List`].
    pub fn ingresses(&self) -> Result<Vec<IngressStatus>, WorkerGone> {
        self.ask(|reply| Command::Ingress(IngressCommand::List { reply }))
    }

    /// See [`Command::Volumes`].
    pub fn volumes(&self) -> Result<Result<Vec<VolumeStatus>, VolumeError>, WorkerGone> {
        self.ask(|reply| Command::Volumes { reply })
    }

    /// See [`Command::Volume`].
    pub fn volume(&self, name: &str) -> Result<Result<VolumeStatus, VolumeError>, WorkerGone> {
        self.ask(|reply| Command::Volume {
            name: name.to_string(),
            reply,
        })
    }

    /// See [`Command::DeleteVolume`].
    pub fn delete_volume(&self, name: &str) -> Result<Result<(), VolumeError>, WorkerGone> {
        self.ask(|reply| Command::DeleteVolume {
            name: name.to_string(),
            reply,
        })
    }

    /// See [`Command::ReconcileNow`].
    pub fn reconcile_now(&self) -> Result<usize, WorkerGone> {
        self.ask(|reply| Command::ReconcileNow { reply })
    }

    /// See [`Command::AdoptSubnet`].
    pub fn adopt_subnet(&self, subnet: Ipv4Net) -> Result<Result<(), ReconcileError>, WorkerGone> {
        self.ask(|reply| Command::AdoptSubnet { subnet, reply })
    }

    /// See [`Command::ClusterUpdate`].
    pub fn cluster_update(
        &self,
        pod_cidr: Ipv4Net,
        peers: Vec<Peer>,
        vips: BTreeSet<Ipv4Addr>,
        services: BTreeMap<String, SocketAddrV4>,
        fence: Vec<PlacedJail>,
    ) -> Result<HeartbeatOutcome, WorkerGone> {
        self.ask(|reply| Command::ClusterUpdate {
            pod_cidr,
            peers,
            vips,
            services,
            fence,
            reply,
        })
    }

    /// See [`Command::Health`]: whether the worker answers within `wait`.
    pub fn health(&self, wait: Duration) -> WorkerHealth {
        let (reply, rx) = mpsc::channel();
        if self.tx.send(Command::Health(reply)).is_err() {
            return WorkerHealth::Gone;
        }
        supervise::await_answer(&rx, wait)
    }

    /// Queues a pass without waiting (the timer).
    pub fn tick(&self) -> Result<(), WorkerGone> {
        self.tx.send(Command::Reconcile).map_err(|_| WorkerGone)
    }

    /// Asks the worker loop to stop after the commands already queued.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

/// Starts the worker thread owning `reconciler`. The first thing it does is a
/// pass, so a restarted agent converges before serving its first request.
pub fn spawn<J, Z, N, M>(
    reconciler: Reconciler<J, Z, N, M>,
) -> std::io::Result<(WorkerHandle, JoinHandle<()>)>
where
    J: JailRuntime + 'static,
    Z: ZfsManager + 'static,
    N: NetManager + 'static,
    M: MountManager + 'static,
{
    spawn_with_ingress(reconciler, None)
}

/// [`spawn`], with the node's ingress controller on the same thread: it runs
/// after every reconcile pass and serves the `/ingresses` commands.
pub fn spawn_with_ingress<J, Z, N, M>(
    reconciler: Reconciler<J, Z, N, M>,
    ingress: Option<IngressController>,
) -> std::io::Result<(WorkerHandle, JoinHandle<()>)>
where
    J: JailRuntime + 'static,
    Z: ZfsManager + 'static,
    N: NetManager + 'static,
    M: MountManager + 'static,
{
    let (tx, rx) = mpsc::channel();
    let (publisher, jails) = snapshot::channel(reconciler.list());
    let (targets_publisher, health_targets) = snapshot::channel(reconciler.health_targets());
    let (metrics_publisher, metrics) = snapshot::channel(WorkerMetrics {
        desired: reconciler.state().jails.len(),
        ..WorkerMetrics::default()
    });
    let events = reconciler.events().clone();
    let published = Published {
        jails: publisher,
        health_targets: targets_publisher,
        metrics: metrics_publisher,
    };
    let handle = std::thread::Builder::new()
        .name("keel-worker".into())
        .spawn(move || run(reconciler, ingress, rx, published))?;
    Ok((
        WorkerHandle {
            tx,
            jails,
            health_targets,
            metrics,
            events,
        },
        handle,
    ))
}

fn run<J, Z, N, M>(
    mut reconciler: Reconciler<J, Z, N, M>,
    mut ingress: Option<IngressController>,
    rx: Receiver<Command>,
    // Dropped with this frame, also when it unwinds: that closes the snapshots.
    published: Published,
) where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    let mut metrics = Metrics::default();
    // Before the first reconcile pass, which may provision a recorded
    // ingress jail: it must not start without the controller's seed.
    if let Some(controller) = ingress.as_mut() {
        controller.register_seed(&mut reconciler);
    }
    pass(&mut reconciler, &mut metrics);
    ingress_pass(&mut ingress, &mut reconciler);
    published.publish(&reconciler, &metrics, ingress.as_ref());
    // Replies go to callers that may have given up (a closed connection); a
    // failed send is theirs to lose, never a reason to stop the worker.
    while let Ok(cmd) = rx.recv() {
        match cmd {
            Command::Apply { jail, epoch, reply } => {
                crate::common::faults::inject("agent.worker.apply");
                let name = jail.metadata.name.clone();
                let result = reconciler.apply(*jail, epoch);
                match &result {
                    Ok(_) => log::info!("applied jail {name}"),
                    Err(e) => {
                        metrics.record_failure();
                        log::warn!("apply of jail {name}: {e}");
                    }
                }
                let _ = reply.send(result);
            }
            Command::Delete { name, reply } => {
                let result = reconciler.delete(&name);
                match &result {
                    Ok(()) => log::info!("deleted jail {name}"),
                    Err(ReconcileError::NotFound(_)) => {}
                    Err(e) => {
                        metrics.record_failure();
                        log::warn!("delete of jail {name}: {e}");
                    }
                }
                let _ = reply.send(result);
            }
            Command::Get { name, reply } => {
                let _ = reply.send(reconciler.get(&name));
            }
            Command::Document { name, reply } => {
                let _ = reply.send(reconciler.applied(&name).map(|jail| jail.to_yaml()));
            }
            Command::Log {
                name,
                max_bytes,
                reply,
            } => {
                let log = reconciler
                    .workload_log(&name, max_bytes)
                    .map(|r| r.map_err(|e| e.to_string()));
                let _ = reply.send(log);
            }
            Command::List { reply } => {
                let _ = reply.send(reconciler.list());
            }
            Command::Volumes { reply } => {
                let (zfs, mounts) = reconciler.volume_seams();
                let _ = reply.send(volumes::list(zfs, mounts));
            }
            Command::Volume { name, reply } => {
                let (zfs, mounts) = reconciler.volume_seams();
                let _ = reply.send(volumes::get(zfs, mounts, &name));
            }
            Command::DeleteVolume { name, reply } => {
                let (zfs, mounts) = reconciler.volume_seams();
                let result = volumes::delete(zfs, mounts, &name);
                match &result {
                    Ok(()) => log::info!("deleted volume {name}"),
                    Err(VolumeError::NotFound { .. }) => {}
                    Err(e) => log::warn!("delete of volume {name}: {e}"),
                }
                let _ = reply.send(result);
            }
            Command::Reconcile => {
                pass(&mut reconciler, &mut metrics);
                ingress_pass(&mut ingress, &mut reconciler);
            }
            Command::ReconcileNow { reply } => {
                let failures = pass(&mut reconciler, &mut metrics);
                ingress_pass(&mut ingress, &mut reconciler);
                let _ = reply.send(failures);
            }
            Command::Ingress(cmd) => ingress_command(cmd, &mut ingress, &mut reconciler),
            Command::AdoptSubnet { subnet, reply } => {
                let result = reconciler.adopt_node_subnet(subnet);
                if result.is_ok() {
                    log::info!("node subnet is {subnet}");
                    // The heartbeat that follows retries a failure here.
                    match reconciler.ensure_gateway() {
                        Ok(()) => log::info!(
                            "{} has {}",
                            reconciler.node().bridge,
                            reconciler.node().gateway()
                        ),
                        Err(e) => log::warn!(
                            "cannot give {} its address {}: {e}",
                            reconciler.node().bridge,
                            reconciler.node().gateway()
                        ),
                    }
                }
                let _ = reply.send(result);
            }
            Command::ClusterUpdate {
                pod_cidr,
                peers,
                vips,
                services,
                fence,
                reply,
            } => {
                let outcome =
                    routes::apply_heartbeat(&mut reconciler, pod_cidr, &peers, &vips, &fence);
                if let Some(ingress) = &mut ingress {
                    ingress.set_services(services);
                }
                let _ = reply.send(outcome);
            }
            Command::Health(reply) => {
                let _ = reply.send(());
            }
            Command::Readiness {
                name,
                incarnation,
                ready,
                reason,
            } => {
                reconciler.set_readiness(&name, incarnation, ready, reason);
            }
            Command::RestartUnhealthy {
                name,
                incarnation,
                reason,
            } => match reconciler.restart_unhealthy(&name, incarnation, &reason) {
                Ok(true) => log::info!("stopped unhealthy jail {name}; it restarts with backoff"),
                Ok(false) => {}
                Err(e) => {
                    metrics.record_failure();
                    log::warn!("restart of unhealthy jail {name}: {e}");
                }
            },
            Command::HealthExec { name, argv, reply } => {
                let _ = reply.send(exec_outcome(reconciler.exec_in(&name, &argv)));
            }
            Command::Shutdown => break,
            Command::DryRun {
                jail,
                epoch,
                diff_only,
                reply,
            } => {
                let _ = reply.send(if diff_only {
                    reconciler.diff(&jail)
                } else {
                    reconciler.dry_run(*jail, epoch)
                });
            }
        }
        // After every command, read-only ones too: cheaper than knowing
        // which ones changed a status (the list is built from memory).
        published.publish(&reconciler, &metrics, ingress.as_ref());
        // One write for all the events of the command, not one per event
        // (common::events); the next command retries a failed one.
        if let Err(e) = reconciler.events().flush() {
            log::warn!("events are not saved: {e}");
        }
    }
}

/// What the worker publishes after every command: the jail statuses (the
/// heartbeat), the health checker's targets and the metrics.
struct Published {
    jails: Publisher<Vec<JailStatus>>,
    health_targets: Publisher<Vec<HealthTarget>>,
    metrics: Publisher<WorkerMetrics>,
}

impl Published {
    fn publish<J, Z, N, M>(
        &self,
        reconciler: &Reconciler<J, Z, N, M>,
        metrics: &Metrics,
        ingress: Option<&IngressController>,
    ) where
        J: JailRuntime,
        Z: ZfsManager,
        N: NetManager,
        M: MountManager,
    {
        self.jails.publish(reconciler.list());
        self.health_targets.publish(reconciler.health_targets());
        let mut certificates = BTreeMap::new();
        for status in ingress.map(IngressController::statuses).unwrap_or_default() {
            if let Some(expires) = status.certificate_expires {
                // Two Ingresses of one host share its certificate; the
                // earlier expiry is the one to watch.
                certificates
                    .entry(status.host)
                    .and_modify(|e: &mut i64| *e = (*e).min(expires))
                    .or_insert(expires);
            }
        }
        self.metrics.publish(WorkerMetrics {
            counters: metrics.clone(),
            desired: reconciler.state().jails.len(),
            certificates,
        });
    }
}

/// The health checker reports to the worker without waiting for it: a
/// verdict is a command like any other, and the snapshot published after it
/// carries the new readiness to the heartbeat.
impl Reports for WorkerHandle {
    fn readiness(&self, name: &str, incarnation: u64, ready: bool, reason: Option<String>) {
        let _ = self.tx.send(Command::Readiness {
            name: name.to_string(),
            incarnation,
            ready,
            reason,
        });
    }

    fn restart(&self, name: &str, incarnation: u64, reason: String) {
        let _ = self.tx.send(Command::RestartUnhealthy {
            name: name.to_string(),
            incarnation,
            reason,
        });
    }
}

/// Exec probes need the jail runtime, which only the worker holds (jexec is
/// a host command like `jail -c`): the probe is a command, and the probe's
/// thread waits for its answer at most `timeout`, so a busy worker makes an
/// exec probe fail, never hang. The worker itself runs jexec with the
/// runtime's own exec timeout.
impl ExecSeam for WorkerHandle {
    fn exec(&self, name: &str, argv: &[String], timeout: Duration) -> Result<(), String> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(Command::HealthExec {
                name: name.to_string(),
                argv: argv.to_vec(),
                reply,
            })
            .map_err(|_| WorkerGone.to_string())?;
        match rx.recv_timeout(timeout) {
            Ok(result) => result,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(format!(
                "no answer within {timeout:?} (the agent's worker was busy or the command hung)"
            )),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(WorkerGone.to_string()),
        }
    }
}

/// One ingress pass, when this agent has an ingress controller.
fn ingress_pass<J, Z, N, M>(
    ingress: &mut Option<IngressController>,
    reconciler: &mut Reconciler<J, Z, N, M>,
) where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    let Some(ingress) = ingress else {
        return;
    };
    ingress.pass(reconciler, Instant::now(), unix_now());
    for problem in &ingress.problems {
        log::warn!("ingress: {problem}");
    }
}

fn ingress_command<J, Z, N, M>(
    cmd: IngressCommand,
    ingress: &mut Option<IngressController>,
    reconciler: &mut Reconciler<J, Z, N, M>,
) where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    match cmd {
        IngressCommand::Put {
            ingress: new,
            reply,
        } => {
            let name = new.metadata.name.clone();
            let result = match ingress.as_mut() {
                None => Ok(None),
                Some(c) => c.put(*new).map(|()| {
                    log::info!("applied ingress {name}");
                    c.pass(reconciler, Instant::now(), unix_now());
                    c.status(&name)
                }),
            };
            let _ = reply.send(result);
        }
        IngressCommand::Delete { name, reply } => {
            let result = match ingress.as_mut() {
                None => Ok(false),
                Some(c) => c.delete(&name).inspect(|&deleted| {
                    if deleted {
                        log::info!("deleted ingress {name}");
                        c.pass(reconciler, Instant::now(), unix_now());
                    }
                }),
            };
            let _ = reply.send(result);
        }
        IngressCommand::Get { name, reply } => {
            let _ = reply.send(ingress.as_ref().and_then(|c| c.status(&name)));
        }
        IngressCommand::List { reply } => {
            let _ = reply.send(ingress.as_ref().map(|c| c.statuses()).unwrap_or_default());
        }
        IngressCommand::Document { name, reply } => {
            let _ = reply.send(
                ingress
                    .as_ref()
                    .and_then(|c| c.applied(&name))
                    .map(|i| i.to_yaml()),
            );
        }
    }
}

/// Seconds since the Unix epoch by the wall clock (certificate expiry).
fn unix_now() -> i64 {
    i64::try_from(crate::common::auth::unix_now()).unwrap_or(i64::MAX)
}

fn pass<J, Z, N, M>(reconciler: &mut Reconciler<J, Z, N, M>, metrics: &mut Metrics) -> usize
where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    let started = Instant::now();
    let report = reconciler.reconcile();
    metrics.record_pass(
        started.elapsed(),
        report.failures.len(),
        report.restarted.len(),
    );
    for name in &report.restarted {
        log::info!("restarted crashed jail {name}");
    }
    for f in &report.failures {
        log::warn!("reconcile {}: {}", f.jail, f.error);
    }
    report.failures.len()
}

/// Starts the reconcile timer: a tick every `interval` until the worker is
/// gone or `stop` receives (or is dropped).
pub fn spawn_timer(
    worker: WorkerHandle,
    interval: Duration,
    stop: Receiver<()>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("keel-timer".into())
        .spawn(move || {
            // recv_timeout doubles as the sleep and the stop signal.
            while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(interval) {
                if worker.tick().is_err() {
                    break;
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agentd::fixtures::{fake_reconciler, jail};
    use crate::host::fake::{CallLog, Faults};
    use crate::host::net::FakeNet;

    fn names(worker: &WorkerHandle) -> Vec<(String, Option<u64>)> {
        let jails = worker.published_jails().expect("the worker runs");
        jails.iter().map(|s| (s.name.clone(), s.epoch)).collect()
    }

    #[test]
    fn the_worker_publishes_its_jails_after_every_command_and_closes_when_it_ends() {
        let dir = tempfile::tempdir().expect("tempdir");
        let net = FakeNet::new(CallLog::new(), Faults::default());
        let (worker, thread) = spawn(fake_reconciler(dir.path(), net)).expect("worker");
        assert_eq!(names(&worker), []);

        worker
            .apply(jail("web", None), Some(3))
            .expect("worker")
            .expect("applied");
        // The worker publishes before it takes its next command, so once a
        // later command is answered the snapshot shows the apply.
        worker.list().expect("worker");
        assert_eq!(names(&worker), [("web".to_string(), Some(3))]);

        worker.delete("web").expect("worker").expect("deleted");
        worker.list().expect("worker");
        assert_eq!(names(&worker), []);

        worker.shutdown();
        thread.join().expect("the worker ends cleanly");
        assert_eq!(
            worker.published_jails().map(|j| j.len()),
            Err(WorkerGone),
            "a stopped worker's last jails are not reported as current"
        );
    }

    #[test]
    fn the_worker_publishes_its_metrics_after_every_command_and_closes_when_it_ends() {
        let dir = tempfile::tempdir().expect("tempdir");
        let net = FakeNet::new(CallLog::new(), Faults::default());
        let (worker, thread) = spawn(fake_reconciler(dir.path(), net)).expect("worker");
        worker
            .apply(jail("web", None), None)
            .expect("worker")
            .expect("applied");
        worker.list().expect("worker");
        let published = worker.published_metrics().expect("the worker runs");
        let jails = worker.published_jails().expect("the worker runs");
        let text = crate::agentd::metrics::render(&published, &jails, &BTreeMap::new(), None);
        assert_eq!(published.desired, 1, "{text}");
        assert!(
            text.contains("keel_reconcile_duration_seconds_count 1\n"),
            "the first pass, and no other: {text}"
        );
        assert!(text.contains("keel_jail_ready{jail=\"web\"}"), "{text}");

        worker.shutdown();
        thread.join().expect("the worker ends cleanly");
        assert_eq!(
            worker.published_metrics().map(|m| m.desired),
            Err(WorkerGone),
            "a stopped worker's metrics are not served as current"
        );
    }
}
