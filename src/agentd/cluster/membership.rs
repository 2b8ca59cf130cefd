//! The cluster thread ([`spawn`]) and its client for the control plane
//! ([`ControlPlane`]): register with backoff, then heartbeat every
//! `agent.heartbeat_interval`, and at once when something the control plane
//! routes by changed.
//!
//! Immediate heartbeats: the thread waits for its next tick on a [`Wake`],
//! not a plain sleep. The worker's jail snapshot pokes it after every
//! publish ([`WorkerHandle::on_jails_published`]); the thread then compares
//! the placed jails the next heartbeat would report (running, ready,
//! address, epoch) with those the last one reported, and sends at once when
//! they differ: a health check that flipped, a replica whose process
//! started or exited. It sends at once too when the agent recorded an event
//! since the last heartbeat, whose `events_seq` tells the control plane to
//! wake the event watches waiting on it. The endpoint watcher ([`super::watch`]) pokes it too
//! when a pushed table needs VIP aliases only the heartbeat path adds.
//! Bursts are coalesced: after the first poke the thread waits
//! [`COALESCE`] for more before it sends, and since this one thread sends
//! every heartbeat, one at a time, there is never more than one in flight.
//! The poke never goes through the worker's queue: it is a flag and a
//! condition variable.
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
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::agentd::cluster::applier::{Answer, Applier, Job};
use crate::agentd::cluster::error::ClusterError;
use crate::agentd::cluster::heartbeat::{
    EndpointCache, PeerCache, connections, heartbeat_request, stale_placed,
};
use crate::agentd::cluster::watch::{self, ClusterCounters, ProxyTable, Stamp};
use crate::agentd::proxy::Proxy;
use crate::agentd::worker::{WorkerGone, WorkerHandle};
use crate::common::auth::{Signer, sign_headers, unix_now};
use crate::common::backoff::{Backoff, Clock, Policy, SystemClock};
use crate::common::cidr::Ipv4Net;
use crate::common::http::failover::Failover;
use crate::common::sync::lock;
use crate::common::wire::{
    EndpointsAnswer, HeartbeatRequest, HeartbeatResponse, PlacedJail, RegisterRequest,
    RegisterResponse, Resources,
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

/// After the first poke of a [`Wake`], how long the cluster thread waits for
/// more before it sends: several flips within a few milliseconds (a
/// reconcile pass restarting three replicas) make one heartbeat.
pub const COALESCE: Duration = Duration::from_millis(10);

/// Longest a heartbeat waits for the proxy's connection counts; the proxy's
/// control loop answers in microseconds unless something is badly wrong.
pub const LOADS_WAIT: Duration = Duration::from_millis(250);

/// Path of this node's heartbeat.
pub fn heartbeat_path(node_id: &str) -> String {
    format!("/nodes/{node_id}/heartbeat")
}

/// Path of this node's endpoint long poll.
pub fn endpoints_path(node_id: &str) -> String {
    format!("/nodes/{node_id}/endpoints")
}

/// What woke the cluster thread; see the module docs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Woken {
    /// The worker published its jail statuses.
    pub published: bool,
    /// The endpoint watcher asked for a heartbeat.
    pub asked: bool,
    /// The daemon is stopping.
    pub stopped: bool,
}

/// The cluster threads' wake-up: pokes from the worker's snapshot and the
/// watcher, and the daemon's stop. Pokes are flags, so any number of them
/// before the thread looks is one wake-up.
#[derive(Debug, Default)]
pub struct Wake {
    state: Mutex<Woken>,
    poked: Condvar,
}

impl Wake {
    fn poke(&self, set: impl FnOnce(&mut Woken)) {
        set(&mut lock(&self.state));
        self.poked.notify_all();
    }

    /// The worker published its jail statuses.
    pub fn published(&self) {
        self.poke(|w| w.published = true);
    }

    /// Asks for a heartbeat now (the watcher).
    pub fn ask(&self) {
        self.poke(|w| w.asked = true);
    }

    /// Stops the cluster threads (at their next wake-up).
    pub fn stop(&self) {
        self.poke(|w| w.stopped = true);
    }

    /// True once [`Wake::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        lock(&self.state).stopped
    }

    /// Waits until poked or `deadline`, and takes the pokes (`stopped`
    /// stays set); all false at the deadline.
    pub fn wait_until(&self, deadline: Instant) -> Woken {
        let mut state = lock(&self.state);
        loop {
            if *state != Woken::default() {
                let woken = *state;
                *state = Woken {
                    stopped: woken.stopped,
                    ..Woken::default()
                };
                return woken;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Woken::default();
            }
            state = self
                .poked
                .wait_timeout(state, left)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Waits `delay` unless stopped first; true when stopped. Pokes other
    /// than the stop are left for [`Wake::wait_until`].
    pub fn sleep(&self, delay: Duration) -> bool {
        let deadline = Instant::now() + delay;
        let mut state = lock(&self.state);
        loop {
            if state.stopped {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self
                .poked
                .wait_timeout(state, left)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

/// What the cluster thread needs to know.
#[derive(Debug, Clone)]
pub struct Membership {
    /// The control plane's `HOST:PORT`, or several separated by commas
    /// (see [`Failover`]).
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
    /// Run the endpoint watcher ([`super::watch`]); only simulate mode
    /// turns it off (`KEEL_SIM_ENDPOINT_PUSH=off`), to measure the
    /// heartbeat path alone.
    pub push: bool,
    /// Heartbeats and tables applied, for `GET /metrics`.
    pub counters: Arc<ClusterCounters>,
}

/// The control plane, as the agent talks to it.
pub struct ControlPlane {
    client: Failover,
    node_id: String,
    signer: Arc<RwLock<Signer>>,
}

impl ControlPlane {
    /// A client for `controlplane` (`HOST:PORT`, or several separated by
    /// commas: requests go to one that takes the connection) speaking for
    /// `node_id`, signing with `signer`.
    pub fn new(controlplane: &str, node_id: &str, signer: Arc<RwLock<Signer>>) -> ControlPlane {
        ControlPlane {
            client: Failover::tcp(controlplane).with_timeout(CONTROLPLANE_TIMEOUT),
            node_id: node_id.to_string(),
            signer,
        }
    }

    /// The same client with `timeout` on connecting and on each read and
    /// write (a long poll waits longer than [`CONTROLPLANE_TIMEOUT`]).
    pub fn with_timeout(mut self, timeout: Duration) -> ControlPlane {
        self.client = self.client.with_timeout(timeout);
        self
    }

    /// `GET /nodes/{id}/endpoints[?after=G[&origin=O]]`: the endpoint
    /// table once its generation is above `after` (or at once), else the
    /// current one after the control plane's wait; with `origin` (the
    /// table held applies changes), only the changes since `after` where
    /// the control plane has them. A 404 is [`ClusterError::UnknownNode`].
    pub fn endpoints(
        &self,
        after: Option<u64>,
        origin: Option<u64>,
    ) -> Result<EndpointsAnswer, ClusterError> {
        let query = after.map(|g| match origin {
            Some(o) => format!("after={g}&origin={o}"),
            None => format!("after={g}"),
        });
        match self.send("GET", &endpoints_path(&self.node_id), query.as_deref(), &[]) {
            Err(ClusterError::Status { status: 404, .. }) => Err(ClusterError::UnknownNode),
            other => other,
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
        self.send("POST", path, None, &body)
    }

    /// Sends a request signed with the node key (the query is signed with
    /// the path) and decodes a 200 answer.
    fn send<R: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        query: Option<&str>,
        body: &[u8],
    ) -> Result<R, ClusterError> {
        let target = match query {
            Some(q) => format!("{path}?{q}"),
            None => path.to_string(),
        };
        let signed = {
            let signer = self.signer.read().unwrap_or_else(|p| p.into_inner());
            sign_headers(&signer, method, &target, body, unix_now())
        };
        let mut headers = signed.map_err(ClusterError::Keys)?;
        if !body.is_empty() {
            headers.push(("Content-Type".to_string(), "application/json".to_string()));
        }
        let resp = self
            .client
            .request(method, &target, &headers, body)
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

/// The running cluster threads: stop them with [`ClusterThreads::stop`].
pub struct ClusterThreads {
    thread: JoinHandle<()>,
    wake: Arc<Wake>,
}

impl ClusterThreads {
    /// Stops the cluster thread and waits for it (at most one heartbeat
    /// exchange, [`CONTROLPLANE_TIMEOUT`]); the endpoint watcher ends at its
    /// next wake-up without being waited for (see [`super::watch`]).
    pub fn stop(self) {
        self.wake.stop();
        let _ = self.thread.join();
    }
}

/// Starts the cluster thread: register, then heartbeat until stopped or the
/// worker is gone, and its [`Applier`], which owns `proxy` through a
/// [`ProxyTable`]: each heartbeat answer's services go to it once the
/// worker has applied the answer (the API only reads it). With
/// [`Membership::push`], the endpoint watcher ([`super::watch`]) starts
/// too once the node is registered, and feeds the same table. The cluster thread and the applier end
/// together; the proxy handle is dropped then.
pub fn spawn(
    membership: Membership,
    worker: WorkerHandle,
    proxy: Arc<Proxy>,
) -> std::io::Result<ClusterThreads> {
    let wake = Arc::new(Wake::default());
    {
        let wake = Arc::clone(&wake);
        worker.on_jails_published(Arc::new(move || wake.published()));
    }
    let table = Arc::new(ProxyTable::new(
        proxy,
        membership.alias_vips,
        Arc::clone(&membership.counters),
    ));
    let applier = Applier::spawn(worker.clone(), Arc::clone(&table))?;
    let cp = || {
        ControlPlane::new(
            &membership.controlplane,
            &membership.node_id,
            membership.signer.clone(),
        )
    };
    // Started once the node is registered: a poll before that is refused.
    let mut watcher = if membership.push {
        Some(cp())
    } else {
        log::warn!(
            "the endpoint watcher is off (KEEL_SIM_ENDPOINT_PUSH=off): only heartbeats update the proxy"
        );
        None
    };
    let cp = cp();
    let threads_wake = Arc::clone(&wake);
    let thread = std::thread::Builder::new()
        .name("keel-cluster".into())
        .spawn(move || {
            let threads = Threads {
                worker: &worker,
                applier: &applier,
                table: &table,
                wake: &wake,
            };
            // Err only when the worker is gone: the daemon is stopping.
            let _ = run(&membership, &cp, &threads, &mut watcher);
            // The watcher ends with us.
            wake.stop();
            // Dropping the applier here waits for the job it is running.
        })?;
    Ok(ClusterThreads {
        thread,
        wake: threads_wake,
    })
}

/// The placed jails a heartbeat reports, as compared to decide whether a
/// change is worth a heartbeat now.
fn reported(request: &HeartbeatRequest) -> &[PlacedJail] {
    &request.placed
}

/// Waits for the next heartbeat: its tick, or a change the control plane
/// routes by (see the module docs), or a new event, which event watches
/// through the control plane wait for. True when the thread must stop.
fn wait_for_next(
    wake: &Wake,
    worker: &WorkerHandle,
    last_sent: &HeartbeatRequest,
    tick: Instant,
) -> Result<bool, WorkerGone> {
    loop {
        let woken = wake.wait_until(tick);
        if woken.stopped {
            return Ok(true);
        }
        if woken == Woken::default() {
            return Ok(false);
        }
        let changed = woken.asked || last_sent.events_seq != Some(worker.events().last_seq()) || {
            let jails = worker.published_jails()?;
            reported(&heartbeat_request(&jails)) != reported(last_sent)
        };
        if changed {
            // Coalesce: what else changes within COALESCE rides along.
            return Ok(wake.sleep(COALESCE));
        }
    }
}

/// What the cluster thread works with besides the control plane.
struct Threads<'a> {
    worker: &'a WorkerHandle,
    applier: &'a Applier,
    table: &'a Arc<ProxyTable>,
    wake: &'a Arc<Wake>,
}

fn run(
    m: &Membership,
    cp: &ControlPlane,
    threads: &Threads<'_>,
    watcher: &mut Option<ControlPlane>,
) -> Result<(), WorkerGone> {
    let Threads {
        worker,
        applier,
        table,
        wake,
    } = *threads;
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
            if wake.sleep(delay) {
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
        if let Some(poller) = watcher.take() {
            // Not joined: see ClusterThreads::stop.
            if let Err(e) = watch::spawn(poller, table, Arc::clone(wake)) {
                log::error!(
                    "cannot start the endpoint watcher ({e}); only heartbeats update the proxy"
                );
            }
        }

        // Heartbeat until the control plane forgets the node.
        let mut last_problem: Option<String> = None;
        let mut peers = PeerCache::default();
        let mut endpoints = EndpointCache::default();
        // The control plane that answered last numbers the generation the
        // heartbeat reports.
        let mut origin: Option<u64> = None;
        loop {
            let mut request = heartbeat_request(&worker.published_jails()?);
            request.peers_version = peers.version();
            request.endpoints_held = endpoints.held();
            request.events_seq = Some(worker.events().last_seq());
            // The counts back a drain's end, so a proxy that does not
            // answer at once claims nothing: no applied generation, and the
            // control plane waits for the next heartbeat or the drain
            // timeout. The heartbeat itself never waits longer than this.
            // The generation is read before the counts, so the counts are
            // never older than the table it claims.
            let applied = table.applied_generation(origin);
            match table.proxy().loads_within(LOADS_WAIT) {
                Some(loads) => {
                    request.endpoints_generation = applied;
                    request.connections = connections(&loads);
                }
                None => log::warn!(
                    "the proxy did not report its connections within {} ms; this heartbeat claims no endpoint table",
                    LOADS_WAIT.as_millis()
                ),
            }
            m.counters.heartbeats.fetch_add(1, Ordering::Relaxed);
            let problem = match cp.heartbeat(&request) {
                Ok(mut resp) => match (peers.absorb(&mut resp), endpoints.absorb(&mut resp)) {
                    (_, false) => Some(format!(
                        "{} answered that the endpoint table is unchanged but named one this node does not hold; keeping routes and the proxy's table, asking for the table next time",
                        m.controlplane
                    )),
                    (Some(list), true) => {
                        let vips = if m.alias_vips {
                            resp.services.iter().map(|s| s.vip).collect()
                        } else {
                            BTreeSet::new()
                        };
                        origin = resp.endpoints_origin;
                        let stamp = resp
                            .endpoints_origin
                            .zip(resp.endpoints_generation)
                            .map(|(origin, generation)| Stamp { origin, generation });
                        applier.submit(Job::Answer(Box::new(Answer {
                            pod_cidr,
                            peers: list,
                            vips,
                            fence: stale_placed(&resp.stale, &request.placed),
                            services: resp.services,
                            stamp,
                        })));
                        None
                    }
                    (None, true) => Some(format!(
                        "{} answered that the peer list is unchanged, or changes to it, but named a version this node does not hold; keeping routes, asking for the full list next time",
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
            let tick = Instant::now() + m.heartbeat_interval;
            if wait_for_next(wake, worker, &request, tick)? {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deadline no test run reaches: only a poke can end the wait.
    fn never() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    #[test]
    fn a_burst_of_pokes_is_one_wake_up() {
        let wake = Wake::default();
        for _ in 0..5 {
            wake.published();
        }
        wake.ask();
        let woken = wake.wait_until(never());
        assert_eq!(
            woken,
            Woken {
                published: true,
                asked: true,
                stopped: false
            }
        );
        // Taken: the next wait ends at its deadline with nothing.
        assert_eq!(wake.wait_until(Instant::now()), Woken::default());
    }

    #[test]
    fn a_poke_from_another_thread_ends_the_wait() {
        let wake = Arc::new(Wake::default());
        let waiter = {
            let wake = Arc::clone(&wake);
            std::thread::spawn(move || wake.wait_until(never()))
        };
        wake.published();
        assert!(waiter.join().expect("waiter").published);
    }

    #[test]
    fn a_stop_ends_every_wait_and_stays() {
        let wake = Wake::default();
        wake.stop();
        assert!(wake.wait_until(never()).stopped);
        assert!(wake.wait_until(never()).stopped, "stopped stays set");
        assert!(wake.sleep(Duration::from_secs(3600)));
        assert!(wake.is_stopped());
    }

    #[test]
    fn a_sleep_leaves_other_pokes_for_the_next_wait() {
        let wake = Wake::default();
        wake.published();
        assert!(!wake.sleep(Duration::from_millis(1)), "not stopped");
        assert!(wake.wait_until(never()).published);
    }
}
