//! keel-controlplane's command line: its flag table, each flag tied to the
//! `keel.toml` key it overrides, and `main`. Parsing, loading and validation are
//! shared with keel-agentd in [`crate::common::config`]; this file only says which
//! flags the control plane has. It never touches the host itself.

use std::ffi::OsString;
use std::path::Path;

use crate::common::config::{
    self, CliError, Daemon, FLAG_CHECK_CONFIG, FLAG_CONFIG, FLAG_DAEMON, FLAG_EXPORT_STATE,
    FLAG_HELP, FLAG_IMPORT_STATE, FLAG_LOG_LEVEL, FLAG_SIMULATE, FLAG_VERSION, Flag,
};

use crate::controlplane::etcd::{EtcdError, EtcdSettings};

/// The control plane's parsed command line.
pub use crate::common::config::DaemonOptions as Options;

/// Every flag keel-controlplane accepts, in `--help` order.
pub const FLAGS: &[Flag] = &[
    FLAG_CONFIG,
    FLAG_CHECK_CONFIG,
    FLAG_SIMULATE,
    FLAG_DAEMON,
    Flag::set(
        "listen",
        "controlplane.listen",
        "IP:PORT",
        "TCP address of the API",
    ),
    Flag::set(
        "advertise-addr",
        "controlplane.advertise_addr",
        "IP:PORT",
        "address other control planes forward to while this one leads",
    ),
    Flag::set(
        "state-dir",
        "controlplane.state_dir",
        "PATH",
        "crash-safe state directory",
    ),
    Flag::set(
        "pidfile",
        "controlplane.pidfile",
        "PATH",
        "pid file written with --daemon",
    ),
    Flag::set(
        "cluster-cidr",
        "controlplane.cluster_cidr",
        "CIDR",
        "range every node's /24 is carved from",
    ),
    Flag::set(
        "service-cidr",
        "controlplane.service_cidr",
        "CIDR",
        "range service VIPs are taken from (disjoint from the cluster range)",
    ),
    Flag::set(
        "heartbeat-interval",
        "controlplane.heartbeat_interval",
        "DURATION",
        "heartbeat period expected from agents",
    ),
    Flag::set(
        "dead-after",
        "controlplane.dead_after",
        "DURATION",
        "silence after which a node is dead (longer than the heartbeat)",
    ),
    Flag::set(
        "metrics-listen",
        "controlplane.metrics_listen",
        "IP:PORT",
        "plain HTTP listener serving only GET /metrics (empty: none)",
    ),
    Flag::set(
        "etcd-endpoints",
        "controlplane.etcd_endpoints",
        "URL,...",
        "keep the state in these etcd members, shared with other control planes (empty: the journal)",
    ),
    Flag::set(
        "etcd-ca",
        "controlplane.etcd_ca",
        "PATH",
        "CA certificate of the etcd members (https:// endpoints)",
    ),
    Flag::set(
        "etcd-cert",
        "controlplane.etcd_cert",
        "PATH",
        "client certificate for etcd",
    ),
    Flag::set(
        "etcd-key",
        "controlplane.etcd_key",
        "PATH",
        "the client certificate's key",
    ),
    FLAG_EXPORT_STATE,
    FLAG_IMPORT_STATE,
    FLAG_LOG_LEVEL,
    FLAG_HELP,
    FLAG_VERSION,
];

/// keel-controlplane's name, description and flags.
pub const DAEMON: Daemon = Daemon {
    check: check_etcd,
    name: "keel-controlplane",
    about: "the Keel control plane: node registry, scheduler, services and their VIPs",
    flags: FLAGS,
};

/// The etcd settings, when given, as the etcd client will take them
/// ([`EtcdSettings::validate`]): an endpoint that is no URL or a
/// certificate without its key is a configuration error, found by
/// `--check-config` and before the daemon starts.
fn check_etcd(config: &config::Config) -> Result<(), config::ConfigError> {
    match EtcdSettings::of(&config.controlplane).map(|s| s.validate()) {
        Some(Err(EtcdError::Settings { field, problem })) => Err(config::ConfigError::Invalid {
            key: field.to_string(),
            message: problem,
        }),
        _ => Ok(()),
    }
}

/// Parses keel-controlplane's arguments (without the program name); see
/// [`config::parse_daemon_args`].
pub fn parse_args(
    args: impl IntoIterator<Item = OsString>,
    cwd: &Path,
) -> Result<Options, CliError> {
    config::parse_daemon_args(&DAEMON, args, cwd)
}

/// keel-controlplane's `main`; returns the exit status.
pub fn main() -> i32 {
    config::daemon_main(&DAEMON, super::run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::config::StateTransfer;

    fn parse(args: &[&str]) -> Result<Options, CliError> {
        parse_args(args.iter().map(OsString::from), Path::new("/srv/keel-test"))
    }

    #[test]
    fn export_and_import_take_a_path_relative_to_the_cwd_or_dash() {
        let export = parse(&["--simulate", "--export-state", "out.json"]).expect("parses");
        assert_eq!(
            export.transfer,
            Some(StateTransfer::Export(Some(
                "/srv/keel-test/out.json".into()
            )))
        );
        let import = parse(&["--simulate", "--import-state", "-"]).expect("parses");
        assert_eq!(import.transfer, Some(StateTransfer::Import(None)));
        assert_eq!(parse(&["--simulate"]).expect("parses").transfer, None);
    }

    #[test]
    fn export_and_import_together_or_without_a_path_are_usage_errors() {
        let both = parse(&["--export-state", "a", "--import-state", "b"]).expect_err("refused");
        assert!(
            matches!(&both, CliError::Usage(m) if m.contains("--import-state")),
            "{both}"
        );
        let bare = parse(&["--export-state"]).expect_err("refused");
        assert!(matches!(bare, CliError::Usage(_)), "{bare}");
    }
}
