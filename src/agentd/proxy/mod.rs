//! The per-node L4 proxy (issue 5, "Per-node proxy"): for every service the
//! control plane lists, a listener on `<vip>:<port>` that relays each
//! accepted connection to one of the service's replicas, round-robin.
//!
//! It owns the listeners, the relayed connections and the thread their event
//! loop runs on (DESIGN.md section 3: "the L4 proxy runs on its own event
//! loop"). It never touches the host's configuration: on FreeBSD the agent
//! worker aliases each VIP as a /32 on `keel0` through
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
//! | [`balance`] | one service's replica list and its round-robin cursor |
//! | [`relay`] | one connection: connect with timeout and retry, relay with half-close |
//!
//! Behaviour:
//! - [`Proxy::update`] is the whole interface to the heartbeat: a new service
//!   gets a listener, a known one has its replica list swapped in place, a
//!   vanished one loses its listener while its established connections keep
//!   relaying. A bind error is reported for that service only and changes
//!   nothing else. When the control plane is unreachable nobody calls
//!   `update`, so the last list keeps serving.
//! - Each accepted connection takes the next replica in rotation, connects
//!   within `connect_timeout` and, on failure, tries the next replica exactly
//!   once. A service with no replica accepts and closes at once.
//! - One current-thread tokio runtime serves every listener and connection;
//!   nothing blocks it. A two-worker runtime was measured against it on two
//!   CPUs (bench/README.md, "proxy": three runs, medians, HAProxy in the same
//!   runs, load average 7–9). Two workers moved bulk transfers faster
//!   (1.35x HAProxy against 1.17x). They did not accept more new connections
//!   per second: 1.01x against 1.00x there, and 0.71x against 0.88x in a
//!   focused five-round run. They also spent more CPU on each connection
//!   (152 µs against 145 µs; HAProxy 156 µs). So the cheaper runtime stays,
//!   and one thread also bounds the proxy's CPU use on a node whose CPUs
//!   belong to its jails. Neither runtime reached HAProxy's rate of new
//!   connections on that loaded machine (bench/README.md says why).
//! - Memory per connection is its task, two sockets and no buffer while idle
//!   (see [`relay`]). That is 1,820 bytes of RSS per idle relayed
//!   connection, measured at 9,900 connections, where HAProxy needs 3,376.
//!
//! Threads: `start`, `update`, `services` and `shutdown` block on the
//! proxy's thread for their answer, so they are called from ordinary threads
//! (the agent's worker or cluster thread), never from inside an async task.

pub mod balance;
pub mod relay;
pub mod table;

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::mpsc;
use tokio::task::JoinHandle as TaskHandle;

use crate::common::config::AgentConfig;
use crate::common::wire::ServiceEndpoints;

use self::balance::Backends;
use self::table::Change;

/// Listen backlog of each service: connections arriving faster than the loop
/// accepts them wait in the kernel instead of being refused (Linux caps it at
/// `net.core.somaxconn`, FreeBSD at `kern.ipc.soacceptqueue`).
pub const LISTEN_BACKLOG: u32 = 4096;

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

/// How the proxy behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyConfig {
    /// Bound on connecting to a replica (`agent.proxy_connect_timeout`).
    pub connect_timeout: Duration,
    /// Listen on this IP instead of each service's VIP (`agent.proxy_listen`;
    /// tests, on hosts whose loopback answers only 127.0.0.1). Port 0 then picks a free port, which
    /// [`Proxy::services`] reports.
    pub bind_ip_override: Option<Ipv4Addr>,
}

impl Default for ProxyConfig {
    fn default() -> ProxyConfig {
        ProxyConfig::from_agent(&AgentConfig::default())
    }
}

impl ProxyConfig {
    /// The proxy settings of an agent configuration.
    pub fn from_agent(agent: &AgentConfig) -> ProxyConfig {
        ProxyConfig {
            connect_timeout: agent.proxy_connect_timeout.0,
            bind_ip_override: agent.proxy_listen,
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
            ProxyError::Stopped => None,
        }
    }
}

/// One served service as [`Proxy::services`] reports it: name, the address
/// actually listened on, number of replicas.
pub type ServedService = (String, SocketAddrV4, usize);

/// What the handle asks the control loop.
enum Request {
    Update(Vec<ServiceEndpoints>, std_mpsc::SyncSender<Vec<ProxyError>>),
    Services(std_mpsc::SyncSender<Vec<ServedService>>),
}

/// The running proxy. Dropping it (or [`Proxy::shutdown`]) closes every
/// listener and connection and joins its thread.
pub struct Proxy {
    requests: Option<mpsc::UnboundedSender<Request>>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy").finish_non_exhaustive()
    }
}

impl Proxy {
    /// Starts the proxy's thread and event loop, serving nothing yet.
    pub fn start(config: ProxyConfig) -> io::Result<Proxy> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name("keel-proxy".into())
            .spawn(move || runtime.block_on(control(config, rx)))?;
        Ok(Proxy {
            requests: Some(tx),
            thread: Some(thread),
        })
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

    /// Closes every listener and connection and joins the proxy's thread.
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
        // Closing the channel ends the control loop; the runtime is dropped on
        // its thread, which drops every task and so closes every socket.
        self.requests = None;
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            log::error!("proxy: its thread panicked");
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
    accept: TaskHandle<()>,
}

impl Served {
    /// Closes the listener, and waits until it is closed so the caller of
    /// `update` can rely on it. Connections are tasks of their own and live on.
    async fn close(self) {
        self.accept.abort();
        let _ = self.accept.await;
    }
}

/// The control loop: the only owner of the service table.
async fn control(config: ProxyConfig, mut requests: mpsc::UnboundedReceiver<Request>) {
    let tick = (config.connect_timeout / 2).max(TIMER_TICK_MIN);
    let ticking = tokio::spawn(async move {
        loop {
            tokio::time::sleep(tick).await;
        }
    });
    let mut served: BTreeMap<String, Served> = BTreeMap::new();
    while let Some(request) = requests.recv().await {
        match request {
            Request::Update(services, reply) => {
                let errors = apply(&config, &mut served, &services).await;
                let _ = reply.send(errors);
            }
            Request::Services(reply) => {
                let list = served
                    .iter()
                    .map(|(name, s)| (name.clone(), s.bound, s.backends.len()))
                    .collect();
                let _ = reply.send(list);
            }
        }
    }
    ticking.abort();
}

async fn apply(
    config: &ProxyConfig,
    served: &mut BTreeMap<String, Served>,
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
                if let Some(s) = served.remove(&name) {
                    let bound = s.bound;
                    s.close().await;
                    log::info!("proxy: service {name} removed, listener {bound} closed");
                }
            }
            Change::Replace(s) => {
                if let Some(entry) = served.get(&s.name) {
                    entry.backends.replace(&s.replicas);
                }
            }
            Change::Rebind(s) => {
                if let Some(old) = served.remove(&s.name) {
                    old.close().await;
                }
                if let Err(e) = open(config, served, s, listen_of(s)) {
                    errors.push(e);
                }
            }
            Change::Add(s) => {
                if let Err(e) = open(config, served, s, listen_of(s)) {
                    errors.push(e);
                }
            }
        }
    }
    errors
}

/// Binds the service's listener and starts accepting.
fn open(
    config: &ProxyConfig,
    served: &mut BTreeMap<String, Served>,
    service: &ServiceEndpoints,
    listen: SocketAddrV4,
) -> Result<(), ProxyError> {
    let err = |source| ProxyError::Listen {
        service: service.name.clone(),
        addr: listen,
        source,
    };
    let listener = bind(listen).map_err(err)?;
    let bound = match listener.local_addr().map_err(err)? {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(_) => listen,
    };
    let backends = Arc::new(Backends::new(&service.replicas));
    let accept = tokio::spawn(accept_loop(
        listener,
        Arc::clone(&backends),
        config.connect_timeout,
    ));
    log::info!(
        "proxy: service {} listening on {bound} with {} replicas",
        service.name,
        service.replicas.len()
    );
    served.insert(
        service.name.clone(),
        Served {
            listen,
            bound,
            backends,
            accept,
        },
    );
    Ok(())
}

fn bind(addr: SocketAddrV4) -> io::Result<TcpListener> {
    let socket = TcpSocket::new_v4()?;
    // An agent restarted while connections to a VIP sit in TIME_WAIT must be
    // able to listen on it again at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr.into())?;
    socket.listen(LISTEN_BACKLOG)
}

async fn accept_loop(listener: TcpListener, backends: Arc<Backends>, connect_timeout: Duration) {
    loop {
        match listener.accept().await {
            Ok((client, _)) => {
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
