//! Running keel-agentd: build the host seams (FreeBSD or simulated), open the
//! state, start the worker, the API (with the base fetcher beside the worker,
//! never on it), the health checker and the reconcile timer, and stop cleanly on SIGTERM or SIGINT.
//!
//! With `agent.controlplane` set the agent also joins a cluster: it serves the
//! same route table on a TCP listener bound to `agent.advertise_addr` and runs
//! the cluster thread ([`crate::agentd::cluster`]). A clustered node starts in
//! the subnet it was last assigned (persisted), so it keeps its addresses
//! while the control plane is unreachable. Without `agent.controlplane` none
//! of this exists and the agent is a single node.
//!
//! One agent per state directory: the first thing `run` does, before reading
//! the state, detaching or binding a socket, is lock it
//! ([`crate::common::lockfile`]); a second agent on the same directory exits
//! non-zero naming the pid of the first. A clustered agent then waits for the
//! next whole second of the wall clock before it listens on TCP and refuses
//! signed requests dated earlier, or dated up to what the previous agent
//! recorded when a signer's clock ran ahead ([`replay_floor::start`]), so
//! nothing signed for the previous process can be replayed to this one.
//!
//! If the worker thread dies the agent exits non-zero with the panic in the
//! log ([`crate::common::supervise`]), so rc or `daemon -r` restarts it.
//!
//! Stopping the agent is not stopping the workloads: on SIGTERM the agent stops
//! accepting requests, finishes the command in progress, removes its socket and
//! exits, and every jail keeps running. The next agent adopts them with a no-op
//! pass.

use std::fmt;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, RwLock};

use crate::agentd::api::AgentApi;
use crate::agentd::bases::{BaseFetcher, FetchSettings};
use crate::agentd::cli::Options;
use crate::agentd::cluster;
use crate::agentd::cluster::error::ClusterError;
use crate::agentd::cluster::identity;
use crate::agentd::cluster::membership::Membership;
use crate::agentd::cluster::signed::{self, SignedApi};
use crate::agentd::health;
use crate::agentd::ingress::CertManager;
use crate::agentd::ingress::acme::AcmeSettings;
use crate::agentd::ingress::controller::{IngressController, IngressSettings};
use crate::agentd::ingress::dns::OvhDns;
use crate::agentd::proxy::{Proxy, ProxyConfig};
use crate::agentd::reconciler::{AgentState, AgentStore, DryRunHost, NodeNetwork, Reconciler};
use crate::agentd::usage::{self, UsageBoard};
use crate::agentd::worker;
use crate::common::auth::KeyFilePolicy;
use crate::common::auth::{Signer, Verifier};
use crate::common::backoff::SystemClock;
use crate::common::cmd::SystemRunner;
use crate::common::config::{Config, ConfigSource, DevfsRuleset};
use crate::common::events::EventLog;
use crate::common::faults;
use crate::common::http::{
    Handler, HttpError, Server, ServerLimits, ShutdownSignal, bind_unix_socket,
};
use crate::common::lockfile::{LockError, StateDirLock};
use crate::common::logging;
use crate::common::metrics::{self, ListenError};
use crate::common::replay_floor::{self, FloorError};
use crate::common::store::StoreError;
use crate::common::supervise::{SignalLoop, Stop, WorkerDied};
use crate::host::base::{BaseLayout, BaseStore, FreeBsdBases};
use crate::host::capacity::{Capacity, FreeBsdCapacity, Preflight};
use crate::host::jail::FreeBsdJails;
use crate::host::mount::FreeBsdMounts;
use crate::host::net::FreeBsdNet;
use crate::host::pf::{FakeFirewall, Firewall, FreeBsdPf};
use crate::host::sim::{SimBases, SimError, SimHost};
use crate::host::usage::{RctlUsage, UsageProbe};
use crate::host::zfs::{FreeBsdZfs, ZfsLayout};
use crate::host::{JailRuntime, MountManager, NetManager, ZfsManager};

/// Mode of the API socket: owner and group read/write, nobody else.
pub const SOCKET_MODE: u32 = 0o660;

/// The socket group in keel.toml's defaults; simulate mode, which runs
/// unprivileged on any OS, leaves the socket in the user's own group instead
/// (Linux has no `wheel` group).
const DEFAULT_SOCKET_GROUP: &str = "wheel";

/// Why the agent could not start or stopped with an error.
#[derive(Debug)]
pub enum RunError {
    /// The state directory is in use by another agent, or cannot be locked.
    Lock(LockError),
    /// The worker thread panicked; the agent stopped.
    Worker(WorkerDied),
    /// The replay floor in the state directory cannot be read.
    ReplayFloor(FloorError),
    /// The state file could not be opened (corrupt, unknown format, I/O).
    Store(StoreError),
    /// The simulated host could not be set up.
    Sim(SimError),
    /// `KEEL_SIM_FAULTS` names a fault that does not exist.
    Faults(String),
    /// The API socket could not be bound.
    Socket(HttpError),
    /// A thread or the signal handler could not be set up.
    Setup(String),
    /// Detaching with --daemon failed.
    Daemonize(String),
    /// Cluster membership could not be prepared (node id, host capacity).
    Cluster(ClusterError),
    /// `jail.devfs_ruleset` does not fit where the agent runs (`inherit` on a
    /// host that is not a jail, where it would hide no device).
    DevfsRuleset(String),
    /// The listener on `agent.metrics_listen` could not be bound.
    Metrics(ListenError),
    /// The TCP listener on `agent.advertise_addr` could not be bound.
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The operating system's reason.
        source: std::io::Error,
    },
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Lock(e) => write!(f, "{e}"),
            RunError::Worker(e) => write!(f, "{e}"),
            RunError::ReplayFloor(e) => write!(f, "{e}"),
            RunError::Store(e) => write!(f, "{e}"),
            RunError::Sim(e) => write!(f, "{e}"),
            RunError::Faults(e) => write!(f, "{e}"),
            RunError::Socket(e) => write!(f, "{e}"),
            RunError::Setup(e) => write!(f, "{e}"),
            RunError::DevfsRuleset(e) => write!(f, "{e}"),
            RunError::Daemonize(e) => write!(f, "cannot detach (--daemon): {e}"),
            RunError::Cluster(e) => write!(f, "{e}"),
            RunError::Metrics(e) => write!(f, "{e}"),
            RunError::Listen { addr, source } => write!(
                f,
                "cannot listen on agent.advertise_addr {addr}: {source}; it must be an address of this host and a free port"
            ),
        }
    }
}

impl std::error::Error for RunError {}

/// Runs the agent until SIGTERM or SIGINT.
pub fn run(options: Options) -> Result<(), RunError> {
    let cfg = options.config;
    let level = cfg.log.level;
    // Before detaching, so that a refusal reaches the admin's terminal; held
    // until `run` returns, through the fork (module docs of lockfile).
    let mut lock = StateDirLock::acquire(&cfg.agent.state_dir).map_err(RunError::Lock)?;
    if options.daemon {
        // Detach before any thread exists: fork keeps only the calling thread.
        daemonize::Daemonize::new()
            .pid_file(&cfg.agent.pidfile)
            .working_directory("/")
            .start()
            .map_err(|e| RunError::Daemonize(e.to_string()))?;
        logging::to_syslog("keel-agentd", level);
        if let Err(e) = lock.record_pid() {
            log::warn!("{e}; a second agent will name the wrong pid");
        }
    } else {
        logging::to_stderr("keel-agentd", level);
    }

    let (store, state): (AgentStore, Option<AgentState>) =
        AgentStore::open(&cfg.agent.state_dir).map_err(RunError::Store)?;
    let (layout, bases_dir) = if options.simulate {
        simulated_layout(&cfg, &options.source.cwd)
    } else {
        let layout = ZfsLayout {
            pool: cfg.zfs.pool.clone(),
            jails_dir: cfg.zfs.jails_dir.clone(),
            volumes_dir: cfg.zfs.volumes_dir.clone(),
        };
        (layout, cfg.zfs.bases_dir.clone())
    };
    let base_layout = BaseLayout {
        pool: cfg.zfs.pool.clone(),
        bases_dir,
    };
    let cluster = membership(&cfg, options.simulate)?;
    let persisted = state.as_ref().and_then(|s| s.node_subnet);
    let node = NodeNetwork {
        bridge: cfg.agent.bridge.clone(),
        subnet: match (&cluster, persisted) {
            (Some(_), Some(assigned)) => assigned,
            _ => cfg.agent.node_subnet,
        },
    };
    let clock = Box::new(SystemClock);

    if options.simulate {
        for fault in faults::arm_from_env().map_err(RunError::Faults)? {
            log::warn!("test fault armed: {} = {:?}", fault.point, fault.action);
        }
        log::info!(
            "simulate mode: jails are processes, datasets are directories under {}",
            cfg.zfs.jails_dir.display()
        );
        let sim = SimHost::new(&cfg.agent.state_dir.join("sim"), layout).map_err(RunError::Sim)?;
        let bases = SimBases::new(base_layout, cfg.commands.tar.clone()).map_err(RunError::Sim)?;
        let bases = base_fetcher(&cfg, Arc::new(bases));
        let usage = Box::new(sim.jails.usage_probe());
        let mut reconciler = Reconciler::new(
            sim.jails, sim.zfs, sim.net, sim.mounts, node, store, state, clock,
        );
        reconciler.set_dry_run_host(dry_run_host(&cfg));
        let group = (cfg.agent.socket_group != DEFAULT_SOCKET_GROUP)
            .then_some(cfg.agent.socket_group.as_str());
        let ingress = ingress_controller(&cfg, true, Box::new(FakeFirewall::default()))?;
        let served = serve(
            reconciler,
            &cfg,
            &options.source,
            group,
            cluster,
            HostServices {
                ingress,
                bases,
                usage,
            },
        );
        drop(lock);
        return served;
    }

    let runner = Arc::new(SystemRunner);
    let kernel = preflight(&FreeBsdCapacity::new(runner.clone(), cfg.commands.clone()));
    if let Some(warning) =
        check_nesting(kernel.as_ref(), cfg.jail.devfs_ruleset).map_err(RunError::DevfsRuleset)?
    {
        log::warn!("{warning}");
    }
    let firewall = FreeBsdPf::new(runner.clone(), cfg.commands.clone());
    check_pf_anchors(&cfg, &firewall);
    let ingress = ingress_controller(&cfg, false, Box::new(firewall))?;
    let bases = base_fetcher(
        &cfg,
        Arc::new(FreeBsdBases::new(
            runner.clone(),
            cfg.commands.clone(),
            base_layout,
        )),
    );
    let mut reconciler = Reconciler::new(
        FreeBsdJails::new(runner.clone(), cfg.commands.clone(), jail_conf_dir(&cfg))
            .with_devfs_ruleset(cfg.jail.devfs_ruleset),
        FreeBsdZfs::new(
            runner.clone(),
            cfg.commands.clone(),
            layout,
            cfg.zfs.busy_retries,
            cfg.zfs.busy_retry_delay.0,
        ),
        FreeBsdNet::new(runner.clone(), cfg.commands.clone()),
        FreeBsdMounts::new(runner.clone(), cfg.commands.clone()),
        node,
        store,
        state,
        clock,
    );
    reconciler.set_dry_run_host(dry_run_host(&cfg));
    let usage = Box::new(RctlUsage::new(runner, cfg.commands.clone()));
    let served = serve(
        reconciler,
        &cfg,
        &options.source,
        Some(cfg.agent.socket_group.as_str()),
        cluster,
        HostServices {
            ingress,
            bases,
            usage,
        },
    );
    drop(lock);
    served
}

/// Where the agent keeps each jail's jail.conf.
fn jail_conf_dir(cfg: &Config) -> PathBuf {
    cfg.agent.state_dir.join("jails")
}

/// The FreeBSD setup a dry run copies; in simulate mode too, where it shows
/// what this keel.toml would run on FreeBSD.
fn dry_run_host(cfg: &Config) -> DryRunHost {
    DryRunHost {
        paths: cfg.commands.clone(),
        conf_dir: jail_conf_dir(cfg),
        devfs: cfg.jail.devfs_ruleset,
    }
}

/// The node's ingress controller. Without OVH credentials it still runs:
/// every Ingress then waits for a certificate and says why.
fn ingress_controller(
    cfg: &Config,
    simulate: bool,
    firewall: Box<dyn Firewall>,
) -> Result<IngressController, RunError> {
    let i = &cfg.ingress;
    let policy = KeyFilePolicy::for_current_process();
    let certs = OvhDns::from_config(i, policy)
        .map_err(|e| format!("no certificate can be issued: {e}"))
        .and_then(|dns| {
            CertManager::start(
                AcmeSettings::from_config(i, policy),
                Box::new(dns),
                Arc::new(SystemClock),
            )
            .map_err(|e| format!("no certificate can be issued: {e}"))
        });
    let public = match (&i.public_interface, i.public_address) {
        (Some(ifname), Some(IpAddr::V4(addr))) => Some((ifname.clone(), addr)),
        (Some(_), Some(IpAddr::V6(addr))) => {
            log::error!(
                "ingress.public_address {addr} is IPv6; pf cannot redirect it to the ingress jail's IPv4 address, so no redirect is loaded"
            );
            None
        }
        _ => None,
    };
    let settings = IngressSettings {
        base: i.base.clone(),
        nginx: if simulate {
            "/usr/sbin/nginx".into()
        } else {
            "/usr/local/sbin/nginx".into()
        },
        public,
        simulate,
    };
    IngressController::open(&cfg.agent.state_dir, settings, firewall, certs)
        .map_err(RunError::Store)
}

/// The node's base fetcher: `agent.base_mirror`, then `agent.base_archive`;
/// downloads wait in `{state_dir}/base-downloads` until they are extracted.
fn base_fetcher(cfg: &Config, store: Arc<dyn BaseStore>) -> Arc<BaseFetcher> {
    let a = &cfg.agent;
    let mirrors = std::iter::once(a.base_mirror.clone())
        .chain(a.base_archive.clone())
        .collect();
    Arc::new(BaseFetcher::new(
        store,
        FetchSettings {
            mirrors,
            cache_dir: a.state_dir.join("base-downloads"),
        },
    ))
}

/// With a public address configured, pf.conf must reference Keel's anchors
/// or the redirect to the ingress jail is loaded but never evaluated.
fn check_pf_anchors(cfg: &Config, firewall: &impl Firewall) {
    if cfg.ingress.public_interface.is_none() {
        return;
    }
    match firewall.check_anchors() {
        Ok(c) if c.rdr && c.filter => {}
        Ok(c) => log::error!(
            "pf.conf does not reference Keel's anchors (rdr-anchor: {}, anchor: {}): add `rdr-anchor \"keel/*\"` in the translation section and `anchor \"keel/*\"` in the filter section, then `service pf reload` (docs/ingress.md)",
            if c.rdr { "present" } else { "missing" },
            if c.filter { "present" } else { "missing" },
        ),
        Err(e) => log::error!("could not check pf's anchors: {e}"),
    }
}

/// Simulate mode's datasets. Several simulated nodes of one cluster usually
/// run in one directory, each with its own `--state-dir`; a replica that moves
/// from one to another must not find (or, when fenced, delete) the other's
/// rootfs, so a node with its own state directory keeps its simulated
/// datasets there unless the config names dataset directories itself.
fn simulated_layout(cfg: &Config, cwd: &std::path::Path) -> (ZfsLayout, std::path::PathBuf) {
    let mut defaults = Config::default();
    defaults.apply_simulate_defaults(cwd);
    let own_state_dir = cfg.agent.state_dir != defaults.agent.state_dir;
    let pick = |configured: &std::path::PathBuf, default: &std::path::PathBuf, leaf: &str| {
        if own_state_dir && configured == default {
            cfg.agent.state_dir.join(leaf)
        } else {
            configured.clone()
        }
    };
    let layout = ZfsLayout {
        pool: cfg.zfs.pool.clone(),
        jails_dir: pick(&cfg.zfs.jails_dir, &defaults.zfs.jails_dir, "jails"),
        volumes_dir: pick(&cfg.zfs.volumes_dir, &defaults.zfs.volumes_dir, "volumes"),
    };
    let bases_dir = pick(&cfg.zfs.bases_dir, &defaults.zfs.bases_dir, "bases");
    (layout, bases_dir)
}

/// SIGHUP: a node-key rotation. keel.toml and the key files it names are read
/// again and the TCP listener's accepted keys and the signing key replaced;
/// nothing else is reloaded. A single node has no keys, so nothing happens.
fn reload_keys(
    source: &ConfigSource,
    verifier: Option<&Verifier>,
    signer: Option<&Arc<RwLock<Signer>>>,
) {
    let (Some(verifier), Some(signer)) = (verifier, signer) else {
        log::info!("SIGHUP: nothing to reload on a node without a control plane");
        return;
    };
    let reloaded = source
        .load()
        .map_err(|e| e.to_string())
        .and_then(|cfg| signed::load_key_material(&cfg).map_err(|e| e.to_string()));
    match reloaded {
        Ok((new_signer, keyring)) => {
            log::info!("reloaded keys (signing with {})", new_signer.key_id());
            verifier.replace_keyring(keyring);
            *signer.write().unwrap_or_else(|p| p.into_inner()) = new_signer;
        }
        Err(e) => log::error!("key reload failed, keeping the previous keys: {e}"),
    }
}

/// In simulate mode only, `KEEL_SIM_ENDPOINT_PUSH=off` leaves the endpoint
/// watcher out, so the heartbeat path can be measured alone (bench/).
const PUSH_SWITCH: &str = "KEEL_SIM_ENDPOINT_PUSH";

/// What the cluster thread needs, when `agent.controlplane` is set: the node
/// id and the host's capacity, detected once here.
fn membership(cfg: &Config, simulate: bool) -> Result<Option<(Membership, Verifier)>, RunError> {
    let a = &cfg.agent;
    let (Some(controlplane), Some(advertise_addr)) = (&a.controlplane, a.advertise_addr) else {
        return Ok(None);
    };
    let node_id = identity::node_id(a.node_id.as_deref()).map_err(RunError::Cluster)?;
    if simulate {
        // A simulated cluster shares keel-sim/keys: whichever daemon starts
        // first creates the node key (see common::auth::ensure_key).
        crate::common::auth::ensure_key(&a.key_file, "sim-node")
            .map_err(|e| RunError::Cluster(ClusterError::Keys(e)))?;
    }
    let (signer, verifier) = signed::load_keys(cfg).map_err(RunError::Cluster)?;
    // The previous agent on this state directory is gone (we hold the lock);
    // whatever it accepted is dated before this second, or recorded in the
    // floor.
    let (floor, not_before) = replay_floor::start(&a.state_dir).map_err(RunError::ReplayFloor)?;
    let verifier = verifier
        .with_not_before(not_before)
        .with_replay_floor(floor);
    let capacity = if simulate {
        identity::detect_capacity(&identity::simulated_capacity())
    } else {
        identity::detect_capacity(&FreeBsdCapacity::new(
            Arc::new(SystemRunner),
            cfg.commands.clone(),
        ))
    }
    .map_err(RunError::Cluster)?;
    let membership = Membership {
        controlplane: controlplane.clone(),
        node_id,
        advertise_addr,
        capacity,
        heartbeat_interval: a.heartbeat_interval.0,
        signer: Arc::new(RwLock::new(signer)),
        alias_vips: a.proxy_listen.is_none(),
        push: !(simulate && std::env::var(PUSH_SWITCH).is_ok_and(|v| v == "off")),
        counters: Arc::default(),
    };
    Ok(Some((membership, verifier)))
}

/// Reports missing kernel features once at startup: the agent still starts
/// (so `keelctl get` works and the admin sees the errors), but says plainly
/// what will fail. `None` when they could not be read.
fn preflight(capacity: &impl Capacity) -> Option<Preflight> {
    match capacity.preflight() {
        Ok(p) => {
            if !p.vimage {
                log::error!(
                    "this kernel has no VIMAGE (kern.features.vimage is not 1): VNET jails cannot be created"
                );
            }
            if !p.racct {
                log::warn!(
                    "kern.racct.enable is 0: resource limits will fail; set kern.racct.enable=1 in /boot/loader.conf and reboot"
                );
            }
            Some(p)
        }
        Err(e) => {
            log::warn!("could not check kernel features: {e}");
            None
        }
    }
}

/// Whether `jail.devfs_ruleset` fits where the agent runs: `Err` refuses to
/// start, `Ok(Some)` is a warning. `inherit` writes ruleset 0, which in a
/// jail means the parent's ruleset but on a host means none (every device
/// in every jail), so it needs `security.jail.jailed` to be 1. A number in a
/// jail works only if it is the parent's own (kern_jail.c refuses any
/// other with EPERM), which the agent cannot read.
fn check_nesting(
    kernel: Option<&Preflight>,
    devfs: DevfsRuleset,
) -> Result<Option<String>, String> {
    let jailed = kernel.map(|p| p.jailed);
    match (devfs, jailed) {
        (DevfsRuleset::Inherit, Some(true)) => Ok(Some(
            "keel-agentd runs inside a jail: its jails get the parent jail's devfs ruleset, and rctl(8) is refused there, so only jails without resources.cpu and resources.memory can start".to_string(),
        )),
        (DevfsRuleset::Inherit, _) => Err(format!(
            "jail.devfs_ruleset = \"inherit\" is only for a keel-agentd that runs inside a jail, but security.jail.jailed is {} here; on a host it would give jails no devfs ruleset at all, so every device of the host would be visible in them: set jail.devfs_ruleset to a ruleset number (4, devfsrules_jail, by default)",
            match jailed {
                Some(_) => "0",
                None => "unknown (the kernel checks above failed)",
            }
        )),
        (DevfsRuleset::Number(n), Some(true)) => Ok(Some(format!(
            "keel-agentd runs inside a jail: the kernel refuses a nested jail any devfs ruleset but its parent's, so every jail -c fails with \"Operation not permitted\" unless jail.devfs_ruleset ({n}) is the parent's; set jail.devfs_ruleset = \"inherit\". rctl(8) is refused there too, so only jails without resources can start"
        ))),
        (DevfsRuleset::Number(_), _) => Ok(None),
    }
}

/// What `serve` runs beside the reconciler, built for the host it runs on
/// (FreeBSD or simulated).
struct HostServices {
    ingress: IngressController,
    bases: Arc<BaseFetcher>,
    usage: Box<dyn UsageProbe>,
}

fn serve<J, Z, N, M>(
    mut reconciler: Reconciler<J, Z, N, M>,
    cfg: &Config,
    source: &ConfigSource,
    group: Option<&str>,
    cluster: Option<(Membership, Verifier)>,
    host: HostServices,
) -> Result<(), RunError>
where
    J: JailRuntime + 'static,
    Z: ZfsManager + 'static,
    N: NetManager + 'static,
    M: MountManager + 'static,
{
    let socket = &cfg.agent.socket;
    // Bound before the socket, so a taken port leaves nothing behind.
    let (membership, verifier) = cluster.unzip();
    // Events name the node they happen on: the cluster's id for it, else
    // what the id would be (a standalone agent's hostname).
    let node = match &membership {
        Some(m) => m.node_id.clone(),
        None => identity::node_id(cfg.agent.node_id.as_deref()).unwrap_or_default(),
    };
    reconciler.set_events(EventLog::open(&cfg.agent.state_dir, &node).map_err(RunError::Store)?);
    let tcp = match &membership {
        Some(m) => {
            Some(
                TcpListener::bind(m.advertise_addr).map_err(|source| RunError::Listen {
                    addr: m.advertise_addr,
                    source,
                })?,
            )
        }
        None => None,
    };
    let metrics_tcp = cfg
        .agent
        .metrics_listen
        .map(|addr| metrics::bind("agent.metrics_listen", addr))
        .transpose()
        .map_err(RunError::Metrics)?;
    let listener = bind_unix_socket(socket, SOCKET_MODE, group).map_err(RunError::Socket)?;
    let setup = |e: std::io::Error| RunError::Setup(e.to_string());
    let mut signals = SignalLoop::new().map_err(setup)?;

    let (worker, worker_thread) =
        worker::spawn_with_ingress(reconciler, Some(host.ingress)).map_err(setup)?;
    let watcher = signals.watch(worker_thread).map_err(setup)?;
    // Off the worker: it reads the targets the worker publishes and ends
    // when the worker does.
    let health_thread =
        health::spawn(worker.health_targets(), Arc::new(worker.clone())).map_err(setup)?;
    let shutdown = ShutdownSignal::new();
    let proxy = membership
        .as_ref()
        .map(|_| Proxy::start(ProxyConfig::from_agent(&cfg.agent)).map(Arc::new))
        .transpose()
        .map_err(setup)?;
    // Off the worker: it reads the jail names the worker publishes.
    let usage = UsageBoard::new();
    let (stop_usage, usage_stop) = mpsc::channel();
    let usage_thread = usage::spawn(
        host.usage,
        worker.clone(),
        usage.clone(),
        cfg.agent.usage_interval.0,
        usage_stop,
    )
    .map_err(setup)?;
    let api = AgentApi::new(worker.clone())
        .with_bases(host.bases)
        .with_usage(usage);
    let api = match &proxy {
        Some(p) => api.with_proxy(p.clone()),
        None => api,
    };
    let api = match &membership {
        Some(m) => api.with_cluster_counters(m.counters.clone()),
        None => api,
    };
    // Off the worker and the proxy's control loop: it reads what they publish.
    let metrics_http = metrics_tcp
        .map(|l| {
            let local = l.local_addr().ok();
            let thread = metrics::serve(l, api.metrics(), shutdown.clone());
            if let (Ok(_), Some(local)) = (&thread, local) {
                log::info!("metrics on http://{local}/metrics");
            }
            thread
        })
        .transpose()
        .map_err(RunError::Socket)?;
    let verifier = verifier.map(Arc::new);
    let signer = membership.as_ref().map(|m| m.signer.clone());
    let handler: Arc<dyn Handler> = match &verifier {
        Some(v) => Arc::new(SignedApi::new(api, v.clone())),
        None => Arc::new(api),
    };
    let server = Server::new(handler, ServerLimits::default(), shutdown.clone());
    let http = server.serve_unix(listener).map_err(RunError::Socket)?;
    let http_tcp = tcp
        .map(|l| server.serve_tcp(l))
        .transpose()
        .map_err(RunError::Socket)?;
    if let Some(m) = &membership {
        log::info!(
            "node {} joins the control plane at {} (capacity {} CPUs, {} bytes); API also on TCP {}",
            m.node_id,
            m.controlplane,
            m.capacity.cpu,
            m.capacity.memory,
            m.advertise_addr
        );
    }
    let cluster_thread = membership
        .zip(proxy)
        .map(|(m, proxy)| cluster::membership::spawn(m, worker.clone(), proxy))
        .transpose()
        .map_err(setup)?;
    let (stop_timer, timer_stop) = mpsc::channel();
    let timer = worker::spawn_timer(worker.clone(), cfg.agent.reconcile_interval.0, timer_stop)
        .map_err(setup)?;
    log::info!(
        "listening on {} (reconcile every {})",
        socket.display(),
        cfg.agent.reconcile_interval
    );

    match signals.run(|| reload_keys(source, verifier.as_deref(), signer.as_ref())) {
        Stop::Signal(signal) => log::info!("stopping on signal {signal}; jails keep running"),
        Stop::WorkerEnded => log::error!("stopping: the worker thread ended; jails keep running"),
        // The agent hands out no waker.
        Stop::Woken => log::info!("stopping; jails keep running"),
    }
    shutdown.trigger();
    drop(stop_timer);
    drop(stop_usage);
    worker.shutdown();
    let _ = http.join();
    if let Some(t) = http_tcp {
        let _ = t.join();
    }
    if let Some(t) = metrics_http {
        let _ = t.join();
    }
    let _ = timer.join();
    // At most one usage read (rctl's timeout) to finish.
    let _ = usage_thread.join();
    // At most one control-plane exchange (CONTROLPLANE_TIMEOUT) to finish.
    if let Some(t) = cluster_thread {
        t.stop();
    }
    let worker_end = watcher.join();
    // At most one probe timeout once the worker is gone.
    let _ = health_thread.join();
    remove_quietly(socket);
    worker_end.map_err(RunError::Worker)
}

fn remove_quietly(path: &Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        log::warn!("could not remove {}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(jailed: bool) -> Preflight {
        Preflight {
            vimage: true,
            racct: true,
            jailed,
        }
    }

    /// `inherit` (ruleset 0 in the conf) is refused unless the kernel says
    /// the agent is jailed; a number inside a jail is a warning that names
    /// the fix; a number on a host is silent.
    #[test]
    fn inherit_needs_a_jailed_agent_and_a_number_in_a_jail_is_warned_about() {
        let host = kernel(false);
        let nested = kernel(true);
        let err = check_nesting(Some(&host), DevfsRuleset::Inherit).expect_err("refused");
        assert!(err.contains("every device of the host"), "{err}");
        let err = check_nesting(None, DevfsRuleset::Inherit).expect_err("unknown");
        assert!(err.contains("unknown"), "{err}");
        assert!(matches!(
            check_nesting(Some(&nested), DevfsRuleset::Inherit),
            Ok(Some(w)) if w.contains("without resources")
        ));
        assert!(matches!(
            check_nesting(Some(&nested), DevfsRuleset::Number(4)),
            Ok(Some(w)) if w.contains("jail.devfs_ruleset = \"inherit\"")
        ));
        assert_eq!(
            check_nesting(Some(&host), DevfsRuleset::Number(4)),
            Ok(None)
        );
        assert_eq!(check_nesting(None, DevfsRuleset::Number(4)), Ok(None));
    }
}
