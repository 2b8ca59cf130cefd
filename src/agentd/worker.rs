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

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::agentd::cluster::{self, HeartbeatOutcome};
use crate::agentd::metrics::Metrics;
use crate::agentd::reconciler::{JailStatus, Phase, ReconcileError, Reconciler};
use crate::agentd::volumes::{self, VolumeError};
use crate::common::cidr::Ipv4Net;
use crate::common::spec::Jail;
use crate::common::wire::{Peer, PlacedJail, VolumeStatus};
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
    /// Prometheus text.
    Metrics {
        /// Where the answer goes.
        reply: Sender<String>,
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
    /// Apply a heartbeat answer: see [`cluster::apply_heartbeat`].
    ClusterUpdate {
        /// The node's pod_cidr.
        pod_cidr: Ipv4Net,
        /// Every other node.
        peers: Vec<Peer>,
        /// Service VIPs to alias on the bridge (empty with `agent.proxy_listen`).
        vips: BTreeSet<Ipv4Addr>,
        /// Placed jails the control plane named stale, with the epoch reported.
        fence: Vec<PlacedJail>,
        /// Where the answer goes.
        reply: Sender<HeartbeatOutcome>,
    },
    /// Stop the worker loop.
    Shutdown,
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

    /// See [`Command::List`].
    pub fn list(&self) -> Result<Vec<JailStatus>, WorkerGone> {
        self.ask(|reply| Command::List { reply })
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

    /// See [`Command::Metrics`].
    pub fn metrics(&self) -> Result<String, WorkerGone> {
        self.ask(|reply| Command::Metrics { reply })
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
        fence: Vec<PlacedJail>,
    ) -> Result<HeartbeatOutcome, WorkerGone> {
        self.ask(|reply| Command::ClusterUpdate {
            pod_cidr,
            peers,
            vips,
            fence,
            reply,
        })
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
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("keel-worker".into())
        .spawn(move || run(reconciler, rx))?;
    Ok((WorkerHandle { tx }, handle))
}

fn run<J, Z, N, M>(mut reconciler: Reconciler<J, Z, N, M>, rx: Receiver<Command>)
where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    let mut metrics = Metrics::default();
    pass(&mut reconciler, &mut metrics);
    // Replies go to callers that may have given up (a closed connection); a
    // failed send is theirs to lose, never a reason to stop the worker.
    while let Ok(cmd) = rx.recv() {
        match cmd {
            Command::Apply { jail, epoch, reply } => {
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
            Command::Metrics { reply } => {
                let list = reconciler.list();
                let running = list.iter().filter(|s| s.state == Phase::Running).count();
                let _ = reply.send(metrics.render(reconciler.state().jails.len(), running));
            }
            Command::Reconcile => {
                pass(&mut reconciler, &mut metrics);
            }
            Command::ReconcileNow { reply } => {
                let failures = pass(&mut reconciler, &mut metrics);
                let _ = reply.send(failures);
            }
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
                fence,
                reply,
            } => {
                let outcome =
                    cluster::apply_heartbeat(&mut reconciler, pod_cidr, &peers, &vips, &fence);
                let _ = reply.send(outcome);
            }
            Command::Shutdown => break,
        }
    }
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
