//! The cluster thread ([`spawn`]) and its client for the control plane
//! ([`ControlPlane`]): register with backoff, then heartbeat every
//! `agent.heartbeat_interval`.
//!
//! Nothing slow stands in front of a heartbeat: its body is built from the
//! jail statuses the worker last published
//! ([`WorkerHandle::published_jails`]), never by a command to the worker, and
//! each answer is handed to the [`Applier`] without waiting for it to be
//! applied. The only thing a heartbeat waits for is the control plane
//! itself (bounded by [`CONTROLPLANE_TIMEOUT`]). It never changes the host
//! itself: that is the worker's.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::agentd::cluster::applier::{Answer, Applier, Job};
use crate::agentd::cluster::error::ClusterError;
use crate::agentd::cluster::heartbeat::{PeerCache, heartbeat_request, stale_placed};
use crate::agentd::proxy::Proxy;
use crate::agentd::worker::{WorkerGone, WorkerHandle};
use crate::common::auth::{Signer, sign_headers, unix_now};
use crate::common::backoff::{Backoff, Clock, Policy, SystemClock};
use crate::common::cidr::Ipv4Net;
use crate::common::http::{Client, Endpoint};
use crate::common::wire::{
    HeartbeatRequest, HeartbeatResponse, RegisterRequest, RegisterResponse, Resources,
};

/// Path of the registration request.
pub const REGISTER_PATH: &str = "/nodes/register";

/// Bound on connecting to the control plane and on each read and write: a
/// heartbeat is small, and a control plane slower than this counts as
/// unreachable for that tick.
pub const CONTROLPLANE_TIMEOUT: Duration = Duration::from_secs(10);

/// First wait between failed registrations; doubles up to [`REGISTER_RETRY_CAP`].
pub const REGISTER_RETRY_INITIAL: Duration = Duration::from_secs(1);
/// Longest wait between failed registrations.
pub const REGISTER_RETRY_CAP: Duration = Duration::from_secs(30);

/// Path of this node's heartbeat.
pub fn heartbeat_path(node_id: &str) -> String {
    format!("/nodes/{node_id}/heartbeat")
}

/// What the cluster thread needs to know.
#[derive(Debug, Clone)]
pub struct Membership {
    /// The control plane's `HOST:PORT`.
    pub controlplane: String,
    /// This node's id.
    pub node_id: String,
    /// The agent's TCP listener, as the control plane and peers reach it.
    pub advertise_addr: SocketAddr,
    /// The host's size.
    pub capacity: Resources,
    /// Heartbeat period.
    pub heartbeat_interval: Duration,
    /// Signs every request to the control plane with the node key; replaced
    /// on SIGHUP during a key rotation.
    pub signer: Arc<RwLock<Signer>>,
    /// Alias each service's VIP on the bridge (false with
    /// `agent.proxy_listen`, where the proxy listens elsewhere).
    pub alias_vips: bool,
}

/// The control plane, as the agent talks to it.
pub struct ControlPlane {
    client: Client,
    node_id: String,
    signer: Arc<RwLock<Signer>>,
}

impl ControlPlane {
    /// A client for `controlplane` (`HOST:PORT`) speaking for `node_id`,
    /// signing with `signer`.
    pub fn new(controlplane: &str, node_id: &str, signer: Arc<RwLock<Signer>>) -> ControlPlane {
        ControlPlane {
            client: Client::new(Endpoint::Tcp(controlplane.to_string()))
                .with_timeout(CONTROLPLANE_TIMEOUT),
            node_id: node_id.to_string(),
            signer,
        }
    }

    /// `POST /nodes/register`.
    pub fn register(&self, req: &RegisterRequest) -> Result<RegisterResponse, ClusterError> {
        self.post(REGISTER_PATH, req)
    }

    /// `POST /nodes/{id}/heartbeat`; a 404 is [`ClusterError::UnknownNode`].
    pub fn heartbeat(&self, req: &HeartbeatRequest) -> Result<HeartbeatResponse, ClusterError> {
        match self.post(&heartbeat_path(&self.node_id), req) {
            Err(ClusterError::Status { status: 404, .. }) => Err(ClusterError::UnknownNode),
            other => other,
        }
    }

    fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, ClusterError> {
        let body = serde_json::to_vec(body).map_err(|e| ClusterError::Body {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
        let signed = {
            let signer = self.signer.read().unwrap_or_else(|p| p.into_inner());
            sign_headers(&signer, "POST", path, &body, unix_now())
        };
        let mut headers = signed.map_err(ClusterError::Keys)?;
        headers.push(("Content-Type".to_string(), "application/json".to_string()));
        let resp = self
            .client
            .request("POST", path, &headers, &body)
            .map_err(ClusterError::Unreachable)?;
        if resp.status != 200 {
            return Err(ClusterError::Status {
                path: path.to_string(),
                status: resp.status,
                message: error_message(&resp.body),
            });
        }
        serde_json::from_slice(&resp.body).map_err(|e| ClusterError::Body {
            path: path.to_string(),
            reason: e.to_string(),
        })
    }
}

/// The `error` field of a JSON error body, else the body as text.
fn error_message(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct ErrorBody {
        error: String,
    }
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => e.error,
        Err(_) => String::from_utf8_lossy(body).trim().to_string(),
    }
}

/// Starts the cluster thread: register, then heartbeat until `stop` receives
/// (or is dropped) or the worker is gone, and its [`Applier`], which owns
/// `proxy`: each heartbeat answer's services go to it once the worker has
/// applied the answer (the API only reads it). Both threads end together;
/// the proxy handle is dropped then.
pub fn spawn(
    membership: Membership,
    worker: WorkerHandle,
    proxy: Arc<Proxy>,
    stop: Receiver<()>,
) -> std::io::Result<JoinHandle<()>> {
    let applier = Applier::spawn(worker.clone(), proxy)?;
    std::thread::Builder::new()
        .name("keel-cluster".into())
        .spawn(move || {
            let cp = ControlPlane::new(
                &membership.controlplane,
                &membership.node_id,
                membership.signer.clone(),
            );
            // Err only when the worker is gone: the daemon is stopping.
            let _ = run(&membership, &cp, &worker, &applier, &stop);
            // Dropping the applier here waits for the job it is running.
        })
}

/// Waits `delay`; true when the thread must stop.
fn stopped(stop: &Receiver<()>, delay: Duration) -> bool {
    !matches!(stop.recv_timeout(delay), Err(RecvTimeoutError::Timeout))
}

fn run(
    m: &Membership,
    cp: &ControlPlane,
    worker: &WorkerHandle,
    applier: &Applier,
    stop: &Receiver<()>,
) -> Result<(), WorkerGone> {
    let clock = SystemClock;
    let mut retry: Backoff<()> = Backoff::with_policy(Policy {
        initial: REGISTER_RETRY_INITIAL,
        cap: REGISTER_RETRY_CAP,
        ..Policy::default()
    });
    let register = RegisterRequest {
        node_id: m.node_id.clone(),
        advertise_addr: m.advertise_addr,
        capacity: m.capacity,
    };
    loop {
        // Register until it works; the agent serves locally meanwhile.
        let pod_cidr = loop {
            let failure = match cp.register(&register) {
                Ok(resp) => match resp.pod_cidr.parse::<Ipv4Net>() {
                    Ok(net) => break net,
                    Err(e) => ClusterError::Body {
                        path: REGISTER_PATH.into(),
                        reason: format!("pod_cidr {:?}: {e}", resp.pod_cidr),
                    },
                },
                Err(e) => e,
            };
            let delay = retry.record_failure(&(), clock.now());
            log::warn!(
                "registering node {} with {}: {failure}; retrying in {}s",
                m.node_id,
                m.controlplane,
                delay.as_secs_f64()
            );
            if stopped(stop, delay) {
                return Ok(());
            }
        };
        retry.forget(&());
        log::info!(
            "registered node {} with {} (pod_cidr {pod_cidr})",
            m.node_id,
            m.controlplane
        );
        // The registration renewed the lease: heartbeats start now, whatever
        // the worker is doing.
        applier.submit(Job::AdoptSubnet(pod_cidr));

        // Heartbeat until the control plane forgets the node.
        let mut last_problem: Option<String> = None;
        let mut peers = PeerCache::default();
        loop {
            let mut request = heartbeat_request(&worker.published_jails()?);
            request.peers_version = peers.version();
            let problem = match cp.heartbeat(&request) {
                Ok(mut resp) => match peers.absorb(&mut resp) {
                    Some(list) => {
                        let vips = if m.alias_vips {
                            resp.services.iter().map(|s| s.vip).collect()
                        } else {
                            BTreeSet::new()
                        };
                        applier.submit(Job::Answer(Box::new(Answer {
                            pod_cidr,
                            peers: list,
                            vips,
                            fence: stale_placed(&resp.stale, &request.placed),
                            services: resp.services,
                        })));
                        None
                    }
                    None => Some(format!(
                        "{} answered that the peer list is unchanged but sent a version this node does not hold; keeping routes, asking for the full list next time",
                        m.controlplane
                    )),
                },
                Err(ClusterError::UnknownNode) => {
                    log::warn!("{}", ClusterError::UnknownNode);
                    break;
                }
                Err(e) => Some(format!(
                    "heartbeat to {}: {e}; keeping every jail and route as they are",
                    m.controlplane
                )),
            };
            // Once per change, not once per tick: a control plane that is down
            // for an hour must not write 720 identical lines.
            if problem != last_problem {
                match &problem {
                    Some(p) => log::warn!("{p}"),
                    None => log::info!("heartbeats to {} succeed again", m.controlplane),
                }
                last_problem = problem;
            }
            if stopped(stop, m.heartbeat_interval) {
                return Ok(());
            }
        }
    }
}
