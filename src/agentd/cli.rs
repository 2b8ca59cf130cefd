//! keel-agentd's command line: its flag table, each flag tied to the `keel.toml`
//! key it overrides, and `main`. Parsing, loading and validation are shared with
//! keel-controlplane in [`crate::common::config`]; this file only says which flags
//! the agent has. It never touches the host itself.

use std::ffi::OsString;
use std::path::Path;

use crate::common::config::{
    self, CliError, Daemon, FLAG_CHECK_CONFIG, FLAG_CONFIG, FLAG_DAEMON, FLAG_HELP, FLAG_LOG_LEVEL,
    FLAG_SIMULATE, FLAG_VERSION, Flag,
};

/// The agent's parsed command line.
pub use crate::common::config::DaemonOptions as Options;

/// Every flag keel-agentd accepts, in `--help` order.
pub const FLAGS: &[Flag] = &[
    FLAG_CONFIG,
    FLAG_CHECK_CONFIG,
    FLAG_SIMULATE,
    FLAG_DAEMON,
    Flag::set(
        "state-dir",
        "agent.state_dir",
        "PATH",
        "crash-safe state directory",
    ),
    Flag::set("socket", "agent.socket", "PATH", "Unix socket of the API"),
    Flag::set(
        "socket-group",
        "agent.socket_group",
        "GROUP",
        "group owning the API socket",
    ),
    Flag::set(
        "pidfile",
        "agent.pidfile",
        "PATH",
        "pid file written with --daemon",
    ),
    Flag::set(
        "node-subnet",
        "agent.node_subnet",
        "CIDR",
        "jail subnet of this node when not clustered (a /24 or larger)",
    ),
    Flag::set(
        "reconcile-interval",
        "agent.reconcile_interval",
        "DURATION",
        "period of the reconcile pass, e.g. 5s",
    ),
    Flag::set(
        "usage-interval",
        "agent.usage_interval",
        "DURATION",
        "period of the per-jail CPU and memory usage sample, e.g. 15s",
    ),
    Flag::set(
        "controlplane",
        "agent.controlplane",
        "HOST:PORT,...",
        "register with this control plane, or one of several (empty: single node)",
    ),
    Flag::set(
        "node-id",
        "agent.node_id",
        "ID",
        "node id (empty: the hostname)",
    ),
    Flag::set(
        "advertise-addr",
        "agent.advertise_addr",
        "IP:PORT",
        "TCP listener the control plane reaches this agent on",
    ),
    Flag::set(
        "heartbeat-interval",
        "agent.heartbeat_interval",
        "DURATION",
        "heartbeat period towards the control plane",
    ),
    Flag::set(
        "proxy-listen",
        "agent.proxy_listen",
        "IP",
        "service proxy listens here instead of on each VIP (empty: alias the VIPs)",
    ),
    Flag::set(
        "metrics-listen",
        "agent.metrics_listen",
        "IP:PORT",
        "plain HTTP listener serving only GET /metrics (empty: none)",
    ),
    FLAG_LOG_LEVEL,
    FLAG_HELP,
    FLAG_VERSION,
];

/// keel-agentd's name, description and flags.
pub const DAEMON: Daemon = Daemon {
    check: config::no_check,
    name: "keel-agentd",
    about: "the Keel node agent: reconciles this host's jails, volumes, network and ingress",
    flags: FLAGS,
};

/// Parses keel-agentd's arguments (without the program name); see
/// [`config::parse_daemon_args`].
pub fn parse_args(
    args: impl IntoIterator<Item = OsString>,
    cwd: &Path,
) -> Result<Options, CliError> {
    config::parse_daemon_args(&DAEMON, args, cwd)
}

/// keel-agentd's `main`; returns the exit status.
pub fn main() -> i32 {
    config::daemon_main(&DAEMON, super::run)
}
