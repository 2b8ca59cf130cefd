//! Running keel-controlplane: load the keys and the persisted cluster, start
//! the worker and the TCP API, reload the keys on SIGHUP (rotation), stop
//! cleanly on SIGTERM or SIGINT.
//!
//! One control plane per state directory: before anything else, `run` locks
//! it ([`crate::common::lockfile`]), and a second control plane on the same
//! directory exits non-zero naming the pid of the first. It then waits for
//! the next whole second before it listens and refuses signed requests dated
//! earlier, or dated up to what the previous process recorded when a signer's
//! clock ran ahead ([`replay_floor::start`]), so a request captured and sent
//! to the previous process cannot be replayed to this one. If the worker thread
//! dies the process exits non-zero with the panic in the log
//! ([`crate::common::supervise`]).
//!
//! With `controlplane.etcd_endpoints` the state is in etcd, shared with the
//! other control planes given the same members ([`super::etcd_state`]),
//! and the process serves in leadership terms: it waits for the leader key
//! ([`super::leader`]), relaying every request to the leader meanwhile
//! ([`super::standby`]);
//! once it leads it reads the state from etcd, exactly as another leader
//! left it, and serves a term (a worker over that state and the API) until
//! a signal stops it or the leadership is lost; then it stands by again.
//! What outlives a term ([`Process`]): the lock, the listener (whose
//! backlog holds connections between the servers of two phases, so none
//! is refused), the keys and the replay cache, the event log and the
//! metrics listener. With the journal there is one term, the process's
//! life; with etcd the state directory holds only the lock, the replay
//! floor, the leader's lease and the events.
//!
//! Stopping the control plane stops nothing else: agents keep running their
//! jails and their last peer and service lists until it is back.

use std::collections::BTreeMap;
use std::fmt;
use std::net::TcpListener;
use std::sync::Arc;

use crate::common::auth::{self, AuthError, KeyFilePolicy, Keyring, Signer, Verifier};
use crate::common::config::StateTransfer;
use crate::common::events::EventLog;
use crate::common::faults;
use crate::common::http::{HttpError, Server, ServerLimits, ShutdownSignal};
use crate::common::lockfile::{LockError, StateDirLock};
use crate::common::logging;
use crate::common::metrics::{self, ListenError};
use crate::common::replay_floor::{self, FloorError};
use crate::common::supervise::{SignalLoop, Stop, WorkerDied};
use crate::controlplane::api::ControlPlaneApi;
use crate::controlplane::cli::Options;
use crate::controlplane::commit::{JournalLog, Log, LogError};
use crate::controlplane::etcd::{Etcd, EtcdError, EtcdSettings};
use crate::controlplane::etcd_state::EtcdLog;
use crate::controlplane::leader::{self, Keeper, Leading};
use crate::controlplane::metrics::{Metered, TermMetrics};
use crate::controlplane::node_leases::{self, NodeLeases, NodeRecord};
use crate::controlplane::registry::Cluster;
use crate::controlplane::standby::{Standby, holder_name};
use crate::controlplane::state::ClusterState;
use crate::controlplane::transfer::{self, TransferError};
use crate::controlplane::worker::{Worker, open_state};

/// Why the control plane could not start or stopped with an error.
#[derive(Debug)]
pub enum RunError {
    /// The state directory is in use by another control plane, or cannot be
    /// locked.
    Lock(LockError),
    /// The worker thread panicked; the control plane stopped.
    Worker(WorkerDied),
    /// The replay floor in the state directory cannot be read.
    ReplayFloor(FloorError),
    /// The persisted state could not be opened.
    State(LogError),
    /// etcd could not be reached, or its settings are wrong.
    Etcd(EtcdError),
    /// `--export-state` or `--import-state` failed.
    Transfer(TransferError),
    /// A key file is missing, unreadable, too permissive or malformed.
    Keys(AuthError),
    /// The listener could not be bound.
    Listen {
        /// The address.
        addr: std::net::SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The listener on `controlplane.metrics_listen` could not be bound.
    Metrics(ListenError),
    /// The HTTP server could not start.
    Http(HttpError),
    /// A thread or the signal handler could not be set up.
    Setup(String),
    /// Detaching with --daemon failed.
    Daemonize(String),
    /// `KEEL_SIM_FAULTS` names a fault that does not exist.
    Faults(String),
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Lock(e) => write!(f, "{e}"),
            RunError::Worker(e) => write!(f, "{e}"),
            RunError::ReplayFloor(e) => write!(f, "{e}"),
            RunError::State(e) => write!(f, "{e}"),
            RunError::Etcd(e) => write!(f, "{e}"),
            RunError::Transfer(e) => write!(f, "{e}"),
            RunError::Keys(e) => write!(f, "{e}"),
            RunError::Listen { addr, source } => write!(
                f,
                "cannot listen on {addr}: {source} (is another keel-controlplane running? set controlplane.listen or --listen)"
            ),
            RunError::Http(e) => write!(f, "{e}"),
            RunError::Metrics(e) => write!(f, "{e}"),
            RunError::Setup(e) => write!(f, "{e}"),
            RunError::Daemonize(e) => write!(f, "cannot detach (--daemon): {e}"),
            RunError::Faults(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for RunError {}

fn load_keys(cfg: &crate::common::config::Config) -> Result<(Keyring, Signer), AuthError> {
    let policy = KeyFilePolicy::for_current_process();
    let keyring = Keyring::load(&cfg.auth.node_keys, &cfg.auth.operator_keys, policy)?;
    let signer = Signer::new(auth::load_key(&cfg.controlplane.key_file, policy)?);
    Ok((keyring, signer))
}

/// Runs the control plane until SIGTERM or SIGINT; SIGHUP reloads the keys.
pub fn run(options: Options) -> Result<(), RunError> {
    let cfg = &options.config;
    let c = &cfg.controlplane;
    if let Some(transfer) = &options.transfer {
        let settings = EtcdSettings::of(c);
        let backend = match &settings {
            Some(s) => transfer::Backend::Etcd(s),
            None => transfer::Backend::Dir(&c.state_dir),
        };
        return transfer_state(backend, transfer);
    }
    // First of all, before detaching so that a refusal reaches the admin's
    // terminal; held until `run` returns, through the fork (module docs of
    // lockfile).
    let mut lock = StateDirLock::acquire(&c.state_dir).map_err(RunError::Lock)?;
    if options.simulate {
        for (path, id) in [
            (&c.key_file, "sim-node"),
            (&cfg.ctl.key_file, "sim-operator"),
        ] {
            auth::ensure_key(path, id).map_err(RunError::Keys)?;
        }
    }
    // Keys and the listener are checked before detaching, so a bad setup is
    // reported on the admin's terminal, not only in syslog.
    let (keyring, mut signer) = load_keys(cfg).map_err(RunError::Keys)?;
    // The previous process on this state directory is gone (we hold the
    // lock); whatever it accepted is dated before this second, or recorded
    // in the floor.
    let (floor, not_before) = replay_floor::start(&c.state_dir).map_err(RunError::ReplayFloor)?;
    let listener = TcpListener::bind(c.listen).map_err(|source| RunError::Listen {
        addr: c.listen,
        source,
    })?;
    let metrics_listener = c
        .metrics_listen
        .map(|addr| metrics::bind("controlplane.metrics_listen", addr))
        .transpose()
        .map_err(RunError::Metrics)?;

    if options.daemon {
        daemonize::Daemonize::new()
            .pid_file(&c.pidfile)
            .working_directory("/")
            .start()
            .map_err(|e| RunError::Daemonize(e.to_string()))?;
        logging::to_syslog("keel-controlplane", cfg.log.level);
        if let Err(e) = lock.record_pid() {
            log::warn!("{e}; a second control plane will name the wrong pid");
        }
    } else {
        logging::to_stderr("keel-controlplane", cfg.log.level);
    }

    if options.simulate {
        for fault in faults::arm_from_env().map_err(RunError::Faults)? {
            log::warn!("test fault armed: {} = {:?}", fault.point, fault.action);
        }
    }
    let setup = |e: std::io::Error| RunError::Setup(e.to_string());
    let mut signals = SignalLoop::new().map_err(setup)?;
    // Its own file, not the journal: events are no part of the cluster
    // model, and losing the last batch's in a crash is acceptable.
    let events = EventLog::open(&c.state_dir, "")
        .map_err(|e| RunError::Setup(format!("the event log: {e}")))?;
    // Written on its own thread: the worker answers heartbeats meanwhile.
    events
        .write_in_background()
        .map_err(|e| RunError::Setup(format!("the event log's writer thread: {e}")))?;
    // One for the process, across leadership terms: a request accepted in
    // one term is a replay in the next.
    let verifier = Arc::new(
        Verifier::new(keyring, cfg.auth.max_clock_skew.0)
            .with_not_before(not_before)
            .with_replay_floor(floor),
    );
    let shutdown = ShutdownSignal::new();
    let metrics = Arc::new(TermMetrics::default());
    let metrics_http = match metrics_listener {
        Some(l) => {
            let local = l.local_addr().map_err(setup)?;
            let thread = metrics::serve(l, Arc::clone(&metrics), shutdown.clone())
                .map_err(RunError::Http)?;
            log::info!("metrics on http://{local}/metrics");
            Some(thread)
        }
        None => None,
    };
    let process = Process {
        options: &options,
        listener,
        events,
        verifier,
        metrics,
    };
    let source = StateSource::connect(c)?;
    let mut ended = Ok(());
    while let Some(term) = source.begin_term(c, &process.listener, &mut signals)? {
        match process.serve(term, &mut signer, &mut signals) {
            Ok(TermEnd::Deposed) => log::info!("standing by: another control plane may lead now"),
            Ok(TermEnd::Stopped) => break,
            Err(e) => {
                ended = Err(e);
                break;
            }
        }
    }
    shutdown.trigger();
    if let Some(t) = metrics_http {
        let _ = t.join();
    }
    drop(lock);
    ended
}

/// What outlives a leadership term: the listener, the keys and the replay
/// cache, the event log and the metrics listener's view.
struct Process<'a> {
    options: &'a Options,
    listener: TcpListener,
    events: EventLog,
    verifier: Arc<Verifier>,
    metrics: Arc<TermMetrics>,
}

/// How a term ended.
enum TermEnd {
    /// SIGTERM or SIGINT: the process stops.
    Stopped,
    /// The leadership was lost: campaign again.
    Deposed,
}

impl Process<'_> {
    /// Serves one term: the worker over `term`'s state, the API on the
    /// listener, until a signal stops the process or the leadership is
    /// lost; then winds the term down (the API server, then the worker).
    /// `signer` is the node key, replaced on SIGHUP for this term and the
    /// next.
    fn serve(
        &self,
        term: Term,
        signer: &mut Signer,
        signals: &mut SignalLoop,
    ) -> Result<TermEnd, RunError> {
        let c = &self.options.config.controlplane;
        let setup = |e: std::io::Error| RunError::Setup(e.to_string());
        let Term {
            log,
            state,
            from,
            keeper,
            alive,
            node_leases,
        } = term;
        log::info!(
            "{} nodes and {} placements loaded from {from}",
            state.nodes.len(),
            state.placements.len(),
        );
        let mut cluster = Cluster::new(state, c.cluster_cidr, c.service_cidr, c.dead_after.0);
        cluster.set_events(self.events.clone());
        let now = std::time::Instant::now();
        for (id, record) in &alive {
            cluster.vouch(id, record.committed, record.jails, now);
        }
        if !alive.is_empty() {
            log::info!("{} nodes alive on the cluster's record", alive.len());
        }
        let mut worker = Worker::new(cluster, log);
        if let Some(leases) = node_leases {
            worker = worker.with_heard(Box::new(leases));
        }
        let (worker, worker_thread) = worker.spawn().map_err(setup)?;
        let watcher = signals.watch(worker_thread).map_err(setup)?;
        let api = Arc::new(ControlPlaneApi::new(
            worker.clone(),
            Arc::clone(&self.verifier),
            signer.clone(),
        ));
        let source = api.metrics_source();
        // Requests are counted around the route table, not in the server
        // core; a deposed leader's answers are a standby's, counted or not.
        let metered = Metered::new(api.clone(), source.requests());
        let deposed = keeper.as_ref().map(Keeper::deposed).unwrap_or_default();
        let stop_http = ShutdownSignal::new();
        let server = Server::new(
            Arc::new(Leading::new(metered, deposed)),
            ServerLimits::default(),
            stop_http.clone(),
        );
        let local = self.listener.local_addr().map_err(setup)?;
        let listener = self.listener.try_clone().map_err(setup)?;
        let http = server.serve_tcp(listener).map_err(RunError::Http)?;
        self.metrics.set(Some(source));
        log::info!("listening on {local}");

        let stop = signals.run(|| {
            // Key rotation without downtime: keel.toml and the key files it
            // names are read again; only the keys change on a reload.
            let reloaded = self
                .options
                .source
                .load()
                .map_err(|e| e.to_string())
                .and_then(|new| load_keys(&new).map_err(|e| e.to_string()));
            match reloaded {
                Ok((keyring, new_signer)) => {
                    log::info!("reloaded keys (signing with {})", new_signer.key_id());
                    api.reload_keys(keyring, new_signer.clone());
                    *signer = new_signer;
                }
                Err(e) => log::error!("key reload failed, keeping the previous keys: {e}"),
            }
        });
        match stop {
            Stop::Signal(signal) => log::info!("stopping on signal {signal}"),
            Stop::WorkerEnded => log::error!("stopping: the worker thread ended"),
            Stop::Woken => log::info!("ending the leadership term"),
        }
        self.metrics.set(None);
        stop_http.trigger();
        worker.shutdown();
        let _ = http.join();
        let worker_end = watcher.join();
        match keeper {
            // Deposed: the keeper's threads let the lease go themselves.
            Some(keeper) if stop != Stop::Woken => keeper.step_down(),
            _ => {}
        }
        worker_end.map_err(RunError::Worker)?;
        Ok(match stop {
            Stop::Woken => TermEnd::Deposed,
            Stop::Signal(_) | Stop::WorkerEnded => TermEnd::Stopped,
        })
    }
}

/// Where the cluster's state lives.
enum StateSource {
    /// The journal in the state directory: one term, the process's life.
    Journal,
    /// etcd, shared with the other control planes: a term per leadership.
    Etcd {
        etcd: Arc<Etcd>,
        settings: EtcdSettings,
    },
}

/// One leadership term: the state to start from, where its changes go,
/// where it was read (for the log), and with etcd the lease being kept,
/// the nodes the cluster's record says are alive, and its writer.
struct Term {
    log: Box<dyn Log>,
    state: ClusterState,
    from: String,
    keeper: Option<Keeper>,
    alive: BTreeMap<String, NodeRecord>,
    node_leases: Option<NodeLeases>,
}

impl StateSource {
    /// The source `c` names; with etcd, the lease a previous process on
    /// this state directory led with is released first.
    fn connect(c: &crate::common::config::ControlPlaneConfig) -> Result<StateSource, RunError> {
        let Some(settings) = EtcdSettings::of(c) else {
            return Ok(StateSource::Journal);
        };
        let etcd = Arc::new(Etcd::connect(&settings).map_err(RunError::Etcd)?);
        leader::release_previous(&etcd, &c.state_dir);
        Ok(StateSource::Etcd { etcd, settings })
    }

    /// The next term: with the journal, the state on disk; with etcd, once
    /// this control plane holds the leader key (a standby relays every
    /// request on `listener` until then); `None` when a signal stopped the
    /// wait.
    fn begin_term(
        &self,
        c: &crate::common::config::ControlPlaneConfig,
        listener: &TcpListener,
        signals: &mut SignalLoop,
    ) -> Result<Option<Term>, RunError> {
        let setup = |e: std::io::Error| RunError::Setup(e.to_string());
        let StateSource::Etcd { etcd, settings } = self else {
            let (journal, state) =
                open_state(&c.state_dir).map_err(|e| RunError::State(LogError::Journal(e)))?;
            let log = JournalLog::new(journal, c.state_dir.clone());
            return Ok(Some(Term {
                log: Box::new(log),
                state,
                from: transfer::Backend::Dir(&c.state_dir).to_string(),
                keeper: None,
                alive: BTreeMap::new(),
                node_leases: None,
            }));
        };
        let holder = holder_name(c.advertised());
        let ttl = leader::lease_ttl(c.dead_after.0);
        let (lead, log, state) = loop {
            let standby_stop = ShutdownSignal::new();
            let relay = Arc::new(Standby::default());
            let standby = Server::new(relay.clone(), ServerLimits::default(), standby_stop.clone())
                .serve_tcp(listener.try_clone().map_err(setup)?)
                .map_err(RunError::Http)?;
            let won = leader::campaign(
                Arc::clone(etcd),
                &holder,
                ttl,
                || signals.stop_requested(),
                |leader| relay.leader_seen(leader),
            );
            standby_stop.trigger();
            let _ = standby.join();
            let Some(lead) = won.map_err(RunError::Etcd)? else {
                log::info!("stopping on a signal while a standby");
                return Ok(None);
            };
            match EtcdLog::open(Arc::clone(etcd), lead.fence) {
                Ok((log, state)) => break (lead, log, state),
                // Lost between the win and the read, or etcd went away:
                // nothing was decided yet, so stand by again.
                Err(e) if stand_by_again(&e) => {
                    log::warn!(
                        "cannot read the cluster state after winning the leader key: {e}; standing by again"
                    );
                    lead.resign();
                }
                Err(e) => return Err(RunError::State(e)),
            }
        };
        if let Err(e) = lead.record(&c.state_dir) {
            // Only a restart gets slower: it waits the lease out.
            log::warn!("the leader lease is not recorded: {e}");
        }
        let alive = node_leases::read(etcd).unwrap_or_else(|e| {
            log::warn!("cannot read the record of live nodes ({e}); every node is Unknown until it heartbeats");
            BTreeMap::new()
        });
        let node_leases =
            NodeLeases::start(Arc::clone(etcd), lead.fence, c.dead_after.0).map_err(setup)?;
        let waker = signals.waker();
        let keeper = lead.keep(move || waker.wake()).map_err(setup)?;
        Ok(Some(Term {
            log: Box::new(log),
            state,
            from: transfer::Backend::Etcd(settings).to_string(),
            keeper: Some(keeper),
            alive,
            node_leases: Some(node_leases),
        }))
    }
}

/// True when a state read that failed right after a won campaign is worth
/// another campaign: the key was lost again, or etcd went out of reach.
fn stand_by_again(e: &LogError) -> bool {
    match e {
        LogError::NotLeader(_) => true,
        LogError::Etcd(inner) => inner.is_unreachable(),
        LogError::Journal(_) | LogError::Corrupt(_) => false,
    }
}

/// `--export-state` / `--import-state`: moves the state and says what moved
/// on stderr (stdout may be the export itself).
fn transfer_state(
    backend: transfer::Backend<'_>,
    transfer: &StateTransfer,
) -> Result<(), RunError> {
    let shown = |p: &Option<std::path::PathBuf>, stdio: &str| {
        p.as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| stdio.into())
    };
    match transfer {
        StateTransfer::Export(to) => {
            let holds = transfer::export(backend, to.as_deref()).map_err(RunError::Transfer)?;
            eprintln!(
                "keel-controlplane: exported {holds} from {backend} to {}",
                shown(to, "standard output")
            );
        }
        StateTransfer::Import(from) => {
            let holds = transfer::import(backend, from.as_deref()).map_err(RunError::Transfer)?;
            eprintln!(
                "keel-controlplane: imported {holds} from {} into {backend}",
                shown(from, "standard input"),
            );
        }
    }
    Ok(())
}
