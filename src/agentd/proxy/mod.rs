//! The per-node L4 proxy: for every service the
//! control plane lists, a listener on `<vip>:<port>` that relays each
//! accepted connection to one of the service's replicas, round-robin.
//!
//! It owns the listeners, the relayed connections and the threads their
//! event loops run on (off the worker, as docs/architecture.md tells; one
//! per CPU, see below). It never touches the host's
//! configuration: on FreeBSD the agent worker aliases each VIP as a /32 on
//! `keel0` through
//! [`NetManager::add_alias`](crate::host::NetManager::add_alias) *before*
//! calling [`Proxy::update`] (a bind to an address the host does not have
//! fails with `EADDRNOTAVAIL`, reported per service and retried on the next
//! update) and removes the alias after the service vanished. In simulate mode
//! the VIPs come from 127.128.0.0/16, which Linux routes to loopback as a
//! whole, so binding works without any alias.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`Proxy`], the handle: start, update, list, shut down; the control loop |
//! | [`table`] | the pure diff between the services served and a new table |
//! | [`balance`] | one service's replica list, its round-robin cursor, ejections and connection counts |
//! | [`relay`] | one connection: connect with timeout and retries, replay until the first answer, relay with half-close |
//! | [`stats`] | per-service counters (connections open and accepted, bytes each way) the metrics read without asking the control loop |
//!
//! Behaviour:
//! - [`Proxy::update`] is the whole interface to the heartbeat: a new service
//!   gets a listener, a known one has its replica list swapped in place, a
//!   vanished one loses its listener while its established connections keep
//!   relaying. A bind error is reported for that service only and changes
//!   nothing else. When the control plane is unreachable nobody calls
//!   `update`, so the last list keeps serving.
//! - Each accepted connection takes the next replica in rotation, connects
//!   within `connect_timeout` and, when the replica refuses, times out or
//!   resets before its first byte, tries the next ones: at most
//!   [`balance::MAX_ATTEMPTS`] replicas, each once. A replica that failed is
//!   ejected from the rotation for a back-off (1 s doubling to 30 s while it
//!   keeps failing, forgotten on its first success) and only tried when no
//!   ready replica is left. A service with no replica accepts and closes at
//!   once.
//! - A replica dropped from a service's list gets no new connection while its
//!   established ones keep relaying; [`Proxy::loads`] counts them per
//!   replica so that a replica can be stopped once it drained.
//! - The proxy runs `agent.proxy_threads` event loops (default: one per
//!   CPU, at most [`AUTO_THREADS_MAX`]), each a current-thread tokio runtime
//!   on its own thread: the model of HAProxy's threads and nginx's workers.
//!   Every loop has its own listener on each service address
//!   (`SO_REUSEPORT`, `SO_REUSEPORT_LB` on FreeBSD), so the kernel spreads
//!   new connections over the loops and a connection lives on the loop that
//!   accepted it: no work stealing, no cross-thread wake-ups. The rotation
//!   over replicas stays one per service, shared by all loops. Both simpler
//!   designs were measured and lost to HAProxy on new connections per second
//!   (bench/README.md, "proxy"): a single current-thread runtime (0.91x on a
//!   quiet machine, median 0.99x side by side with this design's 1.07x; one
//!   thread cannot use a second CPU), and tokio's work-stealing runtime with
//!   two workers (0.71x–0.98x, and more CPU per connection, spent moving
//!   tasks between threads). Listeners share their port whatever the number
//!   of loops, so the proxy behaves the same on every host; two services of
//!   one proxy on one address are refused by [`Proxy::update`] itself
//!   ([`ProxyError::Taken`]), since the kernel would let them share.
//! - The control loop (service table, updates) runs on the first event loop.
//! - Memory per connection is its task, two sockets and no buffer while idle
//!   (see [`relay`]). That is 1,820 bytes of RSS per idle relayed
//!   connection, measured at 9,900 connections, where HAProxy needs 3,376.
//!
//! Threads: `start`, `update`, `services` and `shutdown` block on the
//! proxy's control loop for their answer, so they are called from ordinary threads
//! (the agent's worker or cluster thread), never from inside an async task.

pub mod balance;
pub mod relay;
pub mod stats;
pub mod table;

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpListener;
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle as TaskHandle;

use crate::common::backoff::SystemClock;
use crate::common::config::AgentConfig;
use crate::common::wire::ServiceEndpoints;

use self::balance::Backends;
pub use self::balance::ReplicaLoad;
use self::stats::{ProxyStats, ServiceCounters};
use self::table::Change;

/// Listen backlog of each service: connections arriving faster than the loop
/// accepts them wait in the kernel instead of being refused (Linux caps it at
/// `net.core.somaxconn`, FreeBSD at `kern.ipc.soacceptqueue`).
pub const LISTEN_BACKLOG: i32 = 4096;

/// Pause after an accept error that is not the client's fault (out of file
/// descriptors or memory): accepting again at once would spin on the same
/// error while the kernel queue holds the connection anyway.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Shortest period of the timer tick [`control`] keeps running.
///
/// Why a tick at all: tokio's timer wakes its driver through an eventfd
/// whenever a new deadline is earlier than the driver's next wake-up, which
/// with no other timer pending is every connect timeout: one `write(2)` and
/// one spurious `epoll_wait` return per connection (measured with strace in
/// the connections-per-second benchmark). A sleep of half the connect
/// timeout keeps a nearer deadline pending at all times, at the cost of a
/// couple of wake-ups a second.
const TIMER_TICK_MIN: Duration = Duration::from_millis(250);

/// Most event loops `agent.proxy_threads = 0` (automatic) starts, whatever
/// the number of CPUs: a node's CPUs belong to its jails, and a loop per CPU
/// beyond this buys nothing a node proxy needs.
pub const AUTO_THREADS_MAX: usize = 8;

/// How the proxy behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyConfig {
    /// Bound on connecting to a replica (`agent.proxy_connect_timeout`).
    pub connect_timeout: Duration,
    /// Number of event loops, at least 1 (`agent.proxy_threads`, resolved by
    /// [`ProxyConfig::from_agent`]).
    pub threads: usize,
    /// Listen on this IP instead of each service's VIP (`agent.proxy_listen`;
    /// tests, on hosts whose loopback answers only 127.0.0.1). Port 0 then picks a free port, which
    /// [`Proxy::services`] reports.
    pub bind_ip_override: Option<Ipv4Addr>,
    /// How long a replica that failed once stays out of the rotation
    /// ([`balance::EJECT_INITIAL`]; doubling from there to
    /// [`balance::EJECT_CAP`]). Not an agent setting: tests shorten or
    /// lengthen it so that what they assert does not depend on timing.
    pub eject_initial: Duration,
}

impl Default for ProxyConfig {
    fn default() -> ProxyConfig {
        ProxyConfig::from_agent(&AgentConfig::default())
    }
}

impl ProxyConfig {
    /// The proxy settings of an agent configuration.
    pub fn from_agent(agent: &AgentConfig) -> ProxyConfig {
        let threads = match agent.proxy_threads {
            0 => std::thread::available_parallelism()
                .map_or(1, usize::from)
                .min(AUTO_THREADS_MAX),
            n => usize::from(n),
        };
        ProxyConfig {
            connect_timeout: agent.proxy_connect_timeout.0,
            threads,
            bind_ip_override: agent.proxy_listen,
            eject_initial: balance::EJECT_INITIAL,
        }
    }
}

/// A service the proxy could not serve, or a proxy that is gone.
#[derive(Debug)]
pub enum ProxyError {
    /// Opening the service's listener failed; the service is not served and
    /// the next update tries again.
    Listen {
        /// Service name.
        service: String,
        /// The address it should listen on.
        addr: SocketAddrV4,
        /// What the kernel said.
        source: io::Error,
    },
    /// Another service of this proxy already listens on the address (with
    /// `agent.proxy_listen` every service shares one IP, so two services with
    /// the same port collide). Listeners share ports across event loops, so
    /// the kernel would not refuse it: without this check the two services
    /// would split each other's connections.
    Taken {
        /// Service name.
        service: String,
        /// The address it should listen on.
        addr: SocketAddrV4,
        /// The service listening there.
        by: String,
    },
    /// The proxy's thread has stopped (it panicked, or was shut down), so no
    /// service is served; restarting the agent restarts it.
    Stopped,
}

impl fmt::Display for ProxyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProxyError::Listen {
                service,
                addr,
                source,
            } => {
                write!(f, "service {service}: cannot listen on {addr}: {source}")?;
                match source.kind() {
                    io::ErrorKind::AddrInUse => write!(
                        f,
                        " (another socket holds {addr}: find it with sockstat -4l or ss -tlnp)"
                    ),
                    io::ErrorKind::AddrNotAvailable => write!(
                        f,
                        " ({} is not configured on this host: the agent aliases it on its bridge; check ifconfig)",
                        addr.ip()
                    ),
                    _ => Ok(()),
                }
            }
            ProxyError::Taken { service, addr, by } => write!(
                f,
                "service {service}: cannot listen on {addr}: service {by} listens there \
                 (agent.proxy_listen puts every service on one IP, so their ports must differ)"
            ),
            ProxyError::Stopped => f.write_str(
                "the service proxy has stopped (see earlier log lines); restart keel-agentd",
            ),
        }
    }
}

impl std::error::Error for ProxyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ProxyError::Listen { source, .. } => Some(source),
            ProxyError::Taken { .. } | ProxyError::Stopped => None,
        }
    }
}

/// One served service as [`Proxy::services`] reports it: name, the address
/// actually listened on, number of replicas.
pub type ServedService = (String, SocketAddrV4, usize);

/// One served service's replicas with their open connections, as
/// [`Proxy::loads`] reports them: the listed replicas, then the dropped ones
/// still draining.
pub type ServiceLoads = (String, Vec<ReplicaLoad>);

/// What the handle asks the control loop.
enum Request {
    Update(Vec<ServiceEndpoints>, std_mpsc::SyncSender<Vec<ProxyError>>),
    Services(std_mpsc::SyncSender<Vec<ServedService>>),
    Loads(std_mpsc::SyncSender<Vec<ServiceLoads>>),
}

/// The running proxy. Dropping it (or [`Proxy::shutdown`]) closes every
/// listener and connection and joins its threads.
pub struct Proxy {
    /// To the control loop, on the first event loop.
    requests: Option<mpsc::UnboundedSender<Request>>,
    /// Dropping one ends that event loop (all but the first, which ends when
    /// `requests` closes).
    stops: Vec<oneshot::Sender<()>>,
    threads: Vec<JoinHandle<()>>,
    stats: Arc<ProxyStats>,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy").finish_non_exhaustive()
    }
}

impl Proxy {
    /// Starts the proxy's threads and event loops, serving nothing yet.
    pub fn start(config: ProxyConfig) -> io::Result<Proxy> {
        // Built field by field so that a failure half-way is cleaned up by
        // `Drop` like a shutdown.
        let mut proxy = Proxy {
            requests: None,
            stops: Vec::new(),
            threads: Vec::new(),
            stats: Arc::new(ProxyStats::default()),
        };
        let stats = Arc::clone(&proxy.stats);
        let tick = timer_tick(config.connect_timeout);
        let mut loops = Vec::with_capacity(config.threads.max(1));
        for i in 1..config.threads.max(1) {
            let runtime = event_loop()?;
            loops.push(runtime.handle().clone());
            let (stop, stopped) = oneshot::channel::<()>();
            proxy.stops.push(stop);
            proxy.threads.push(
                std::thread::Builder::new()
                    .name(format!("keel-proxy-{i}"))
                    .spawn(move || {
                        runtime.block_on(async move {
                            let ticking = tokio::spawn(keep_timer_armed(tick));
                            let _ = stopped.await;
                            ticking.abort();
                        })
                    })?,
            );
        }
        let runtime = event_loop()?;
        loops.insert(0, runtime.handle().clone());
        let (tx, rx) = mpsc::unbounded_channel();
        proxy.requests = Some(tx);
        proxy.threads.push(
            std::thread::Builder::new()
                .name("keel-proxy".into())
                .spawn(move || runtime.block_on(control(config, loops, rx, stats)))?,
        );
        Ok(proxy)
    }

    /// Makes the served services match `services` (the heartbeat's table) and
    /// returns the services that could not be served. Blocks until done: when
    /// it returns, new listeners accept and removed ones are closed.
    pub fn update(&self, services: &[ServiceEndpoints]) -> Vec<ProxyError> {
        let (tx, rx) = std_mpsc::sync_channel(1);
        if !self.ask(Request::Update(services.to_vec(), tx)) {
            return vec![ProxyError::Stopped];
        }
        rx.recv().unwrap_or_else(|_| vec![ProxyError::Stopped])
    }

    /// The services served now, by name: the address listened on and the
    /// number of replicas. Empty when the proxy has stopped.
    pub fn services(&self) -> Vec<ServedService> {
        let (tx, rx) = std_mpsc::sync_channel(1);
        if !self.ask(Request::Services(tx)) {
            return Vec::new();
        }
        rx.recv().unwrap_or_default()
    }

    /// Every served service's replicas with the connections open to each,
    /// whether the table still lists it and whether it is ejected: a replica
    /// the table dropped is reported until its last connection closed, so
    /// whoever stops it can wait until it drained. Empty when the proxy has
    /// stopped. (A removed service's connections are not counted: its
    /// listener and its counts are gone with it.)
    pub fn loads(&self) -> Vec<ServiceLoads> {
        let (tx, rx) = std_mpsc::sync_channel(1);
        if !self.ask(Request::Loads(tx)) {
            return Vec::new();
        }
        rx.recv().unwrap_or_default()
    }

    /// [`Proxy::loads`], waiting at most `wait` for the control loop:
    /// `None` when it did not answer in time (or has stopped), for callers
    /// on the liveness path that must not hang on a stuck loop.
    pub fn loads_within(&self, wait: Duration) -> Option<Vec<ServiceLoads>> {
        let (tx, rx) = std_mpsc::sync_channel(1);
        if !self.ask(Request::Loads(tx)) {
            return None;
        }
        rx.recv_timeout(wait).ok()
    }

    /// The per-service counters, read without asking the control loop.
    pub fn stats(&self) -> Arc<ProxyStats> {
        Arc::clone(&self.stats)
    }

    /// Closes every listener and connection and joins the proxy's threads.
    pub fn shutdown(self) {
        drop(self);
    }

    fn ask(&self, request: Request) -> bool {
        self.requests
            .as_ref()
            .is_some_and(|tx| tx.send(request).is_ok())
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // Closing the channel ends the control loop and dropping the stops
        // ends the other loops; each runtime is dropped on its thread, which
        // drops every task and so closes every socket.
        self.requests = None;
        self.stops.clear();
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                log::error!("proxy: one of its threads panicked");
            }
        }
    }
}

/// A service being served.
struct Served {
    /// The address asked for (`vip:port`, or the override).
    listen: SocketAddrV4,
    /// The address bound (differs from `listen` only for port 0).
    bound: SocketAddrV4,
    backends: Arc<Backends>,
    /// One accept task per event loop, each owning its listener.
    accepts: Vec<TaskHandle<()>>,
}

impl Served {
    /// Closes the listeners, and waits until they are closed so the caller of
    /// `update` can rely on it. Connections are tasks of their own and live on.
    async fn close(self) {
        for accept in &self.accepts {
            accept.abort();
        }
        for accept in self.accepts {
            let _ = accept.await;
        }
    }
}

fn event_loop() -> io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
}

/// Period of [`keep_timer_armed`] for a connect timeout.
fn timer_tick(connect_timeout: Duration) -> Duration {
    (connect_timeout / 2).max(TIMER_TICK_MIN)
}

/// Runs on every event loop, forever (see [`TIMER_TICK_MIN`]).
async fn keep_timer_armed(tick: Duration) {
    loop {
        tokio::time::sleep(tick).await;
    }
}

/// The control loop: the only owner of the service table. `loops` are the
/// handles of every event loop, this one first.
async fn control(
    config: ProxyConfig,
    loops: Vec<Handle>,
    mut requests: mpsc::UnboundedReceiver<Request>,
    stats: Arc<ProxyStats>,
) {
    let ticking = tokio::spawn(keep_timer_armed(timer_tick(config.connect_timeout)));
    let mut served: BTreeMap<String, Served> = BTreeMap::new();
    while let Some(request) = requests.recv().await {
        match request {
            Request::Update(services, reply) => {
                let errors = apply(&config, &loops, &mut served, &stats, &services).await;
                let _ = reply.send(errors);
            }
            Request::Services(reply) => {
                let list = served
                    .iter()
                    .map(|(name, s)| (name.clone(), s.bound, s.backends.len()))
                    .collect();
                let _ = reply.send(list);
            }
            Request::Loads(reply) => {
                let list = served
                    .iter()
                    .map(|(name, s)| (name.clone(), s.backends.loads()))
                    .collect();
                let _ = reply.send(list);
            }
        }
    }
    ticking.abort();
}

async fn apply(
    config: &ProxyConfig,
    loops: &[Handle],
    served: &mut BTreeMap<String, Served>,
    stats: &ProxyStats,
    services: &[ServiceEndpoints],
) -> Vec<ProxyError> {
    let listen_of =
        |s: &ServiceEndpoints| SocketAddrV4::new(config.bind_ip_override.unwrap_or(s.vip), s.port);
    let current = served
        .iter()
        .map(|(name, s)| (name.clone(), s.listen))
        .collect();
    let mut errors = Vec::new();
    for change in table::plan(&current, services, listen_of) {
        match change {
            Change::Remove(name) => {
                stats.forget(&name);
                if let Some(s) = served.remove(&name) {
                    let bound = s.bound;
                    s.close().await;
                    log::info!("proxy: service {name} removed, listener {bound} closed");
                }
            }
            Change::Replace(s) => {
                if let Some(entry) = served.get(&s.name) {
                    if s.unsettled {
                        entry.backends.widen(&s.replicas);
                    } else {
                        entry.backends.replace(&s.replicas);
                    }
                }
            }
            Change::Rebind(s) => {
                if let Some(old) = served.remove(&s.name) {
                    old.close().await;
                }
                let counters = stats.counters(&s.name);
                if let Err(e) = open(config, loops, served, s, listen_of(s), &counters) {
                    errors.push(e);
                }
            }
            Change::Add(s) => {
                let counters = stats.counters(&s.name);
                if let Err(e) = open(config, loops, served, s, listen_of(s), &counters) {
                    errors.push(e);
                }
            }
        }
    }
    errors
}

/// Binds one listener per event loop on the service's address and starts
/// accepting on each. All or nothing: when one bind fails, the listeners
/// already bound are closed before returning.
fn open(
    config: &ProxyConfig,
    loops: &[Handle],
    served: &mut BTreeMap<String, Served>,
    service: &ServiceEndpoints,
    listen: SocketAddrV4,
    counters: &Arc<ServiceCounters>,
) -> Result<(), ProxyError> {
    let err = |source| ProxyError::Listen {
        service: service.name.clone(),
        addr: listen,
        source,
    };
    if listen.port() != 0
        && let Some((by, _)) = served.iter().find(|(_, s)| s.bound == listen)
    {
        return Err(ProxyError::Taken {
            service: service.name.clone(),
            addr: listen,
            by: by.clone(),
        });
    }
    let first = bind(listen).map_err(err)?;
    // Port 0 is resolved by the first bind; the other loops join that port.
    let bound = match first.local_addr().map_err(err)? {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(_) => listen,
    };
    let mut listeners = vec![first];
    for _ in 1..loops.len() {
        listeners.push(bind(bound).map_err(err)?);
    }
    let backends = Arc::new(Backends::with_counters(
        &service.replicas,
        Arc::new(SystemClock),
        config.eject_initial,
        Arc::clone(counters),
    ));
    let mut accepts = Vec::with_capacity(loops.len());
    for (listener, event_loop) in listeners.into_iter().zip(loops) {
        // Registered with the reactor of the loop that will accept on it.
        let _entered = event_loop.enter();
        match TcpListener::from_std(listener) {
            Ok(listener) => accepts.push(event_loop.spawn(accept_loop(
                listener,
                Arc::clone(&backends),
                config.connect_timeout,
            ))),
            Err(e) => {
                for accept in &accepts {
                    accept.abort();
                }
                return Err(err(e));
            }
        }
    }
    log::info!(
        "proxy: service {} listening on {bound} with {} replicas ({} event loops)",
        service.name,
        service.replicas.len(),
        loops.len()
    );
    served.insert(
        service.name.clone(),
        Served {
            listen,
            bound,
            backends,
            accepts,
        },
    );
    Ok(())
}

/// A listening socket on `addr` that one such socket per event loop can
/// join, the kernel spreading new connections over them. The port is shared
/// whatever the number of loops, so the proxy behaves the same on every
/// host; a socket that did not ask to share (another program) still gets
/// `EADDRINUSE`, and [`open`] refuses two services on one address itself.
fn bind(addr: SocketAddrV4) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
    // An agent restarted while connections to a VIP sit in TIME_WAIT must be
    // able to listen on it again at once.
    socket.set_reuse_address(true)?;
    share_port(&socket)?;
    // Accepted sockets inherit TCP_NODELAY from the listener (Linux and
    // FreeBSD alike), which saves a setsockopt per connection; a small
    // response must not wait for Nagle's timer on the client side.
    socket.set_tcp_nodelay(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&SocketAddr::V4(addr).into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

/// FreeBSD's `SO_REUSEPORT` lets several sockets bind but gives every
/// connection to one of them; `SO_REUSEPORT_LB` balances.
#[cfg(target_os = "freebsd")]
fn share_port(socket: &Socket) -> io::Result<()> {
    socket.set_reuse_port_lb(true)
}

/// Linux balances connections over the sockets sharing a port with
/// `SO_REUSEPORT`.
#[cfg(not(target_os = "freebsd"))]
fn share_port(socket: &Socket) -> io::Result<()> {
    socket.set_reuse_port(true)
}

async fn accept_loop(listener: TcpListener, backends: Arc<Backends>, connect_timeout: Duration) {
    loop {
        match listener.accept().await {
            Ok((client, _)) => {
                backends.counters().accepted();
                tokio::spawn(relay::serve(client, Arc::clone(&backends), connect_timeout));
            }
            // The client gave up between SYN and accept: its problem only.
            Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => {}
            Err(e) => {
                log::warn!(
                    "proxy: accepting on {:?} failed: {e}; pausing {} ms",
                    listener.local_addr().ok(),
                    ACCEPT_ERROR_PAUSE.as_millis()
                );
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr_of(listener: &std::net::TcpListener) -> SocketAddrV4 {
        match listener.local_addr().expect("local addr") {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(a) => panic!("bound {a}"),
        }
    }

    /// `relay::serve` no longer sets TCP_NODELAY on the client socket: it
    /// relies on the kernel copying it from the listener.
    #[test]
    fn accepted_sockets_inherit_nodelay_from_the_listener() {
        let listener = bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)).expect("bind");
        listener.set_nonblocking(false).expect("blocking");
        let _client = std::net::TcpStream::connect(addr_of(&listener)).expect("connect");
        let (accepted, _) = listener.accept().expect("accept");
        assert!(accepted.nodelay().expect("getsockopt"));
    }

    #[test]
    fn shared_listeners_join_one_port_and_never_a_foreign_one() {
        let first = bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)).expect("bind");
        let port = addr_of(&first);
        let second = bind(port).expect("a second event loop joins the port");
        assert_eq!(addr_of(&second), port);

        // A socket that did not opt in keeps its port to itself.
        let foreign = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        let taken = match foreign.local_addr().expect("addr") {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(a) => panic!("bound {a}"),
        };
        let err = bind(taken).expect_err("the port is taken");
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
    }

    #[test]
    fn thread_count_comes_from_the_agent_config() {
        let mut agent = AgentConfig {
            proxy_threads: 3,
            ..AgentConfig::default()
        };
        assert_eq!(ProxyConfig::from_agent(&agent).threads, 3);
        agent.proxy_threads = 0;
        let auto = ProxyConfig::from_agent(&agent).threads;
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        assert_eq!(auto, cpus.min(AUTO_THREADS_MAX));
    }
}
