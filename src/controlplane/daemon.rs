//! Running keel-controlplane: load the keys and the persisted cluster, start
//! the worker and the TCP API, stop cleanly on SIGTERM or SIGINT.
//!
//! Stopping the control plane stops nothing else: agents keep running their
//! jails and their last peer and service lists until it is back.

use std::fmt;
use std::net::TcpListener;
use std::sync::Arc;

use crate::common::auth::{self, AuthError, KeyFilePolicy, Keyring, Signer, Verifier};
use crate::common::http::{HttpError, Server, ServerLimits, ShutdownSignal};
use crate::common::journal::JournalError;
use crate::common::logging;
use crate::controlplane::api::ControlPlaneApi;
use crate::controlplane::cli::Options;
use crate::controlplane::registry::Cluster;
use crate::controlplane::worker::{Worker, open_state};

/// Why the control plane could not start or stopped with an error.
#[derive(Debug)]
pub enum RunError {
    /// The persisted state could not be opened.
    State(JournalError),
    /// A key file is missing, unreadable, too permissive or malformed.
    Keys(AuthError),
    /// The listener could not be bound.
    Listen {
        /// The address.
        addr: std::net::SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The HTTP server could not start.
    Http(HttpError),
    /// A thread or the signal handler could not be set up.
    Setup(String),
    /// Detaching with --daemon failed.
    Daemonize(String),
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::State(e) => write!(f, "{e}"),
            RunError::Keys(e) => write!(f, "{e}"),
            RunError::Listen { addr, source } => write!(
                f,
                "cannot listen on {addr}: {source} (is another keel-controlplane running? set controlplane.listen or --listen)"
            ),
            RunError::Http(e) => write!(f, "{e}"),
            RunError::Setup(e) => write!(f, "{e}"),
            RunError::Daemonize(e) => write!(f, "cannot detach (--daemon): {e}"),
        }
    }
}

impl std::error::Error for RunError {}

/// Runs the control plane until SIGTERM or SIGINT.
pub fn run(options: Options) -> Result<(), RunError> {
    let cfg = options.config;
    let c = &cfg.controlplane;
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
    let policy = KeyFilePolicy::for_current_process();
    let keyring = Keyring::load(&cfg.auth.node_keys, &cfg.auth.operator_keys, policy)
        .map_err(RunError::Keys)?;
    let signer = Signer::new(auth::load_key(&c.key_file, policy).map_err(RunError::Keys)?);
    let listener = TcpListener::bind(c.listen).map_err(|source| RunError::Listen {
        addr: c.listen,
        source,
    })?;

    if options.daemon {
        daemonize::Daemonize::new()
            .pid_file(&c.pidfile)
            .working_directory("/")
            .start()
            .map_err(|e| RunError::Daemonize(e.to_string()))?;
        logging::to_syslog("keel-controlplane", cfg.log.level);
    } else {
        logging::to_stderr("keel-controlplane", cfg.log.level);
    }

    let (journal, state) = open_state(&c.state_dir).map_err(RunError::State)?;
    log::info!(
        "{} nodes and {} placements loaded from {}",
        state.nodes.len(),
        state.placements.len(),
        c.state_dir.display()
    );
    let cluster = Cluster::new(state, c.cluster_cidr, c.dead_after.0);
    let setup = |e: std::io::Error| RunError::Setup(e.to_string());
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .map_err(setup)?;
    let (worker, worker_thread) = Worker::new(cluster, journal, c.state_dir.clone())
        .spawn()
        .map_err(setup)?;
    let verifier = Verifier::new(keyring, cfg.auth.max_clock_skew.0);
    let shutdown = ShutdownSignal::new();
    let server = Server::new(
        Arc::new(ControlPlaneApi::new(worker.clone(), verifier, signer)),
        ServerLimits::default(),
        shutdown.clone(),
    );
    let local = listener.local_addr().map_err(setup)?;
    let http = server.serve_tcp(listener).map_err(RunError::Http)?;
    log::info!("listening on {local}");

    let signal = signals.forever().next();
    log::info!("stopping on signal {}", signal.unwrap_or_default());
    shutdown.trigger();
    worker.shutdown();
    let _ = http.join();
    let _ = worker_thread.join();
    Ok(())
}
