//! `keel.toml`: every key, its default, parsing with line numbers, validation,
//! the `--simulate` defaults, and the command-line plumbing both daemons share
//! (their flags override keys of this file).
//!
//! Loading never validates: [`Config::load`] only turns TOML into typed values
//! (naming the key and line of anything that does not fit), flags are applied on
//! top, and [`Config::validate`] then checks what types cannot express (prefixes
//! that must not overlap, paths that must be absolute, names that reach argv). This
//! module reads the one file it is given and nothing else; it never creates the
//! directories, sockets or keys it names.
//!
//! Durations are strings with a unit: `"500ms"`, `"5s"`, `"1m"`, `"2h"` (see
//! [`Interval`]). Optional strings use `""` for "not set" so that every key can be
//! written down, and [`Config::to_toml`] prints the whole effective configuration in
//! a form [`Config::from_toml_str`] loads back unchanged.

use std::ffi::OsString;
use std::fmt;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::common::cidr::Ipv4Net;
use crate::common::names;
use crate::common::spec::MAX_BASE_LEN;

/// Where the daemons look for their configuration when `--config` is not given.
/// A file missing there means "all defaults"; a missing `--config` file is an error.
pub const DEFAULT_CONFIG_PATH: &str = "/usr/local/etc/keel.toml";

/// Longest Unix socket path the kernel accepts: `sun_path` is 104 bytes on
/// FreeBSD (108 on Linux), including the terminating NUL.
pub const MAX_SOCKET_PATH: usize = 103;

/// Longest network interface name (`IFNAMSIZ` 16, including the NUL).
pub const MAX_IFNAME: usize = 15;

/// Longest `zfs.pool`: the longest name Keel builds from it is a base
/// snapshot `{pool}/keel/bases/{base}@keel` with the longest base, and it
/// must stay a valid ZFS name (a jail's `{pool}/keel/jails/{name}` and a
/// volume's `{pool}/keel/volumes/{name}` are shorter, names being at most
/// [`names::MAX_NAME_LEN`]).
pub const MAX_POOL_LEN: usize =
    names::MAX_DATASET_NAME - "/keel/bases/".len() - MAX_BASE_LEN - "@keel".len();

/// The whole of `keel.toml`. Every section and key is optional in the file; what is
/// missing takes the default documented on its field (and in `etc/keel.toml.sample`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[agent]`: keel-agentd.
    pub agent: AgentConfig,
    /// `[zfs]`: where keel-agentd keeps root filesystems and volumes.
    pub zfs: ZfsConfig,
    /// `[jail]`: how keel-agentd creates jails.
    pub jail: JailConfig,
    /// `[controlplane]`: keel-controlplane.
    pub controlplane: ControlPlaneConfig,
    /// `[auth]`: keys the control plane accepts.
    pub auth: AuthConfig,
    /// `[ctl]`: keelctl.
    pub ctl: CtlConfig,
    /// `[ingress]`: the nginx jail and ACME certificates.
    pub ingress: IngressConfig,
    /// `[commands]`: absolute paths of the FreeBSD programs Keel runs.
    pub commands: CommandPaths,
    /// `[log]`: logging.
    pub log: LogConfig,
}

/// `[agent]`: keel-agentd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Crash-safe state directory. Default `/var/db/keel/agentd`.
    pub state_dir: PathBuf,
    /// The API's Unix socket (mode 0660). Default `/var/run/keel/agentd.sock`.
    pub socket: PathBuf,
    /// Group owning the socket. Default `wheel`.
    pub socket_group: String,
    /// Pid file written with `--daemon`. Default `/var/run/keel_agentd.pid`.
    pub pidfile: PathBuf,
    /// The bridge every jail's epair joins. Default `keel0`.
    pub bridge: String,
    /// This node's jail subnet when not clustered (a clustered node gets one from
    /// the control plane). Default `10.20.0.0/24`.
    #[serde(with = "via_str")]
    pub node_subnet: Ipv4Net,
    /// Period of the reconcile pass. Default `5s`.
    pub reconcile_interval: Interval,
    /// Period of the per-jail usage sample for the metrics (one rctl(8)
    /// `-u` per 64 jails, off the worker). Default `15s`.
    pub usage_interval: Interval,
    /// Control plane `HOST:PORT`, or several separated by commas (the
    /// agent uses one that answers); `""` (None) runs a single node.
    /// Default `""`.
    #[serde(with = "empty_is_none")]
    pub controlplane: Option<String>,
    /// Node id registered with the control plane; `""` (None) uses the hostname.
    /// Default `""`.
    #[serde(with = "empty_is_none")]
    pub node_id: Option<String>,
    /// `IP:PORT` of the agent's TCP listener when clustered; required then.
    /// Default `""`.
    #[serde(with = "empty_is_none")]
    pub advertise_addr: Option<SocketAddr>,
    /// Heartbeat period towards the control plane. Default `5s`.
    pub heartbeat_interval: Interval,
    /// Connect timeout of the service proxy towards a replica. Default `1s`.
    pub proxy_connect_timeout: Interval,
    /// Event loops (threads) of the service proxy; `0` is one per CPU, at
    /// most 8. Default `0`.
    pub proxy_threads: u16,
    /// IP every service listener binds (at the service's port) instead of the
    /// service's VIP, which is then not aliased on the bridge; `""` (None)
    /// aliases each VIP on the bridge and listens there. For several
    /// simulated agents on one host, each with its own loopback address.
    /// Default `""`.
    #[serde(with = "empty_is_none")]
    pub proxy_listen: Option<Ipv4Addr>,
    /// `IP:PORT` of the plain, unauthenticated HTTP listener that serves
    /// only `GET /metrics` (`common::metrics`); `""` (None) opens none.
    /// Default `""`.
    #[serde(with = "empty_is_none")]
    pub metrics_listen: Option<SocketAddr>,
    /// Key the agent signs its control-plane requests with.
    /// Default `/usr/local/etc/keel/node.key`.
    pub key_file: PathBuf,
    /// Where `keelctl base fetch RELEASE` downloads `RELEASE/MANIFEST` and
    /// `RELEASE/base.txz` from: a FreeBSD mirror's releases directory for
    /// this machine (`http://`, `https://` or `file://`).
    /// Default `https://download.freebsd.org/releases/amd64/amd64`.
    pub base_mirror: String,
    /// Where a release the mirror no longer carries (end of life) is looked
    /// for next; `""` (None) looks nowhere else. Default
    /// `http://ftp-archive.freebsd.org/pub/FreeBSD-Archive/old-releases/amd64/amd64`.
    #[serde(with = "empty_is_none")]
    pub base_archive: Option<String>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            state_dir: "/var/db/keel/agentd".into(),
            socket: "/var/run/keel/agentd.sock".into(),
            socket_group: "wheel".into(),
            pidfile: "/var/run/keel_agentd.pid".into(),
            bridge: "keel0".into(),
            node_subnet: net([10, 20, 0, 0], 24),
            reconcile_interval: Interval::secs(5),
            usage_interval: Interval::secs(15),
            controlplane: None,
            node_id: None,
            advertise_addr: None,
            heartbeat_interval: Interval::secs(5),
            proxy_connect_timeout: Interval::secs(1),
            proxy_threads: 0,
            proxy_listen: None,
            metrics_listen: None,
            key_file: "/usr/local/etc/keel/node.key".into(),
            base_mirror: "https://download.freebsd.org/releases/amd64/amd64".into(),
            base_archive: Some(
                "http://ftp-archive.freebsd.org/pub/FreeBSD-Archive/old-releases/amd64/amd64"
                    .into(),
            ),
        }
    }
}

/// `[zfs]`: datasets and mount points.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ZfsConfig {
    /// Pool holding `{pool}/keel/bases`, `/jails` and `/volumes`. Default `zroot`.
    pub pool: String,
    /// Where jail root filesystems are mounted. Default `/usr/local/jails/keel`.
    pub jails_dir: PathBuf,
    /// Where volume datasets are mounted. Default `/usr/local/jails/keel-volumes`.
    pub volumes_dir: PathBuf,
    /// Where base datasets (`keelctl base fetch`) are mounted. Default
    /// `/usr/local/jails/keel-bases`.
    pub bases_dir: PathBuf,
    /// How many times a destroy is retried while the dataset is busy. Default 5.
    pub busy_retries: u32,
    /// Pause between those retries. Default `1s`.
    pub busy_retry_delay: Interval,
}

impl Default for ZfsConfig {
    fn default() -> Self {
        ZfsConfig {
            pool: "zroot".into(),
            jails_dir: "/usr/local/jails/keel".into(),
            volumes_dir: "/usr/local/jails/keel-volumes".into(),
            bases_dir: "/usr/local/jails/keel-bases".into(),
            busy_retries: 5,
            busy_retry_delay: Interval::secs(1),
        }
    }
}

/// `[jail]`: how keel-agentd creates jails.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JailConfig {
    /// devfs(8) ruleset of every jail's `/dev`. Default 4.
    pub devfs_ruleset: DevfsRuleset,
}

/// `devfsrules_jail` in /etc/defaults/devfs.rules, and what jail(8) uses
/// for `mount.devfs` when no ruleset is given.
pub const DEVFSRULES_JAIL: u16 = 4;

/// `jail.devfs_ruleset`: which devices a jail's `/dev` shows.
///
/// A number is a ruleset of devfs.rules(5), written as the jail's
/// `devfs_ruleset`. `"inherit"` is for a keel-agentd that itself runs inside
/// a jail (the single-VM harness): the kernel refuses a nested jail any
/// ruleset but its parent's (kern_jail.c, EPERM) and refuses a devfs mount
/// from inside a jail with another one (devfs_vfsops.c, EPERM), so the
/// jail gets the parent's ruleset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevfsRuleset {
    /// That ruleset number (0, no ruleset at all, is refused by
    /// [`Config::validate`]).
    Number(u16),
    /// The parent jail's ruleset.
    Inherit,
}

impl Default for DevfsRuleset {
    fn default() -> Self {
        DevfsRuleset::Number(DEVFSRULES_JAIL)
    }
}

/// How `inherit` is written in keel.toml.
const INHERIT: &str = "inherit";

impl Serialize for DevfsRuleset {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            DevfsRuleset::Number(n) => s.serialize_u16(*n),
            DevfsRuleset::Inherit => s.serialize_str(INHERIT),
        }
    }
}

impl<'de> Deserialize<'de> for DevfsRuleset {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<DevfsRuleset, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = DevfsRuleset;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    "a devfs ruleset number from 1 to 65535, or \"{INHERIT}\""
                )
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<DevfsRuleset, E> {
                u16::try_from(n).map(DevfsRuleset::Number).map_err(|_| {
                    E::custom(format!(
                        "{n} is not a devfs ruleset number: they go from 1 to 65535"
                    ))
                })
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<DevfsRuleset, E> {
                self.visit_i64(i64::try_from(n).unwrap_or(i64::MAX))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DevfsRuleset, E> {
                if v == INHERIT {
                    return Ok(DevfsRuleset::Inherit);
                }
                Err(E::custom(format!(
                    "`{v}` is not \"{INHERIT}\"; write a ruleset number without quotes"
                )))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// `[controlplane]`: keel-controlplane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ControlPlaneConfig {
    /// TCP address of the API. Default `0.0.0.0:7440`.
    pub listen: SocketAddr,
    /// Crash-safe state directory. Default `/var/db/keel/controlplane`.
    pub state_dir: PathBuf,
    /// Pid file written with `--daemon`. Default `/var/run/keel_controlplane.pid`.
    pub pidfile: PathBuf,
    /// Range every node's /24 is carved from. Default `10.20.0.0/16`.
    #[serde(with = "via_str")]
    pub cluster_cidr: Ipv4Net,
    /// Range service virtual IPs are taken from. Default `10.96.0.0/16`.
    #[serde(with = "via_str")]
    pub service_cidr: Ipv4Net,
    /// Heartbeat period expected from agents. Default `5s`.
    pub heartbeat_interval: Interval,
    /// Silence after which a node counts as dead. Default `15s`.
    pub dead_after: Interval,
    /// `IP:PORT` of the plain, unauthenticated HTTP listener that serves
    /// only `GET /metrics` (`common::metrics`); `""` (None) opens none.
    /// Default `""`.
    #[serde(with = "empty_is_none")]
    pub metrics_listen: Option<SocketAddr>,
    /// Node key the control plane signs the requests it forwards to agents
    /// with (agents accept node keys only). Default `/usr/local/etc/keel/node.key`.
    pub key_file: PathBuf,
    /// `IP:PORT` the other control planes reach this one's API on, to
    /// forward requests to it while it leads (with `etcd_endpoints`); `""`
    /// (None) is `listen`, which must then be a specific address.
    /// Default `""`.
    #[serde(with = "empty_is_none")]
    pub advertise_addr: Option<SocketAddr>,
    /// Client URLs of the etcd members that hold the cluster state, shared
    /// by several control planes (one leads, the others wait as standbys);
    /// empty keeps the state in `state_dir`'s own journal. Default `[]`.
    pub etcd_endpoints: Vec<String>,
    /// CA certificate (PEM) the etcd members' certificates chain to, for
    /// `https://` endpoints; `""` (None) for `http://`. Default `""`.
    #[serde(with = "empty_is_none")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for etcd members that authenticate clients;
    /// `""` (None) sends none. Default `""`.
    #[serde(with = "empty_is_none")]
    pub etcd_cert: Option<PathBuf>,
    /// The client certificate's key (PEM). Default `""`.
    #[serde(with = "empty_is_none")]
    pub etcd_key: Option<PathBuf>,
    /// Prefix of every etcd key of this cluster, so that several clusters
    /// can share one etcd. Default `/keel/`.
    pub etcd_prefix: String,
    /// Bound on each etcd call, connecting included. Default `5s`.
    pub etcd_timeout: Interval,
}

impl ControlPlaneConfig {
    /// The API's address as other control planes reach it:
    /// `advertise_addr`, else `listen`.
    pub fn advertised(&self) -> SocketAddr {
        self.advertise_addr.unwrap_or(self.listen)
    }
}

impl Default for ControlPlaneConfig {
    fn default() -> Self {
        ControlPlaneConfig {
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7440),
            state_dir: "/var/db/keel/controlplane".into(),
            pidfile: "/var/run/keel_controlplane.pid".into(),
            cluster_cidr: net([10, 20, 0, 0], 16),
            service_cidr: net([10, 96, 0, 0], 16),
            heartbeat_interval: Interval::secs(5),
            dead_after: Interval::secs(15),
            metrics_listen: None,
            key_file: "/usr/local/etc/keel/node.key".into(),
            advertise_addr: None,
            etcd_endpoints: Vec::new(),
            etcd_ca: None,
            etcd_cert: None,
            etcd_key: None,
            etcd_prefix: "/keel/".into(),
            etcd_timeout: Interval::secs(5),
        }
    }
}

/// `[auth]`: request signing keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Keys nodes may sign with (several during a rotation).
    /// Default `["/usr/local/etc/keel/node.key"]`.
    pub node_keys: Vec<PathBuf>,
    /// Keys operators (keelctl) may sign with.
    /// Default `["/usr/local/etc/keel/operator.key"]`.
    pub operator_keys: Vec<PathBuf>,
    /// Largest accepted difference between a request's timestamp and the clock.
    /// Default `300s` (printed as `5m`).
    pub max_clock_skew: Interval,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            node_keys: vec!["/usr/local/etc/keel/node.key".into()],
            operator_keys: vec!["/usr/local/etc/keel/operator.key".into()],
            max_clock_skew: Interval::secs(300),
        }
    }
}

/// `[ctl]`: keelctl.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CtlConfig {
    /// Control plane `HOST:PORT`, or several separated by commas;
    /// `""` (None) talks to the local agent's socket. Default `""`.
    #[serde(with = "empty_is_none")]
    pub controlplane: Option<String>,
    /// Key keelctl signs with. Default `/usr/local/etc/keel/operator.key`.
    pub key_file: PathBuf,
}

impl Default for CtlConfig {
    fn default() -> Self {
        CtlConfig {
            controlplane: None,
            key_file: "/usr/local/etc/keel/operator.key".into(),
        }
    }
}

/// DNS providers the ACME DNS-01 challenge can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DnsProvider {
    /// OVHcloud's DNS API.
    Ovh,
}

/// `[ingress]`: the node-wide nginx jail and its certificates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IngressConfig {
    /// Base the nginx jail is cloned from (`{pool}/keel/bases/<base>@keel`);
    /// it must hold the nginx package (`/usr/local/sbin/nginx`), which a bare
    /// release does not. Default `14.5-RELEASE-nginx`.
    pub base: String,
    /// ACME directory URL. Default Let's Encrypt *staging*, so a fresh install
    /// cannot burn the production rate limits.
    pub acme_directory: String,
    /// Contact e-mail given to the ACME server; `""` (None) gives none. Default `""`.
    #[serde(with = "empty_is_none")]
    pub acme_contact: Option<String>,
    /// File holding the ACME account key. Default
    /// `/usr/local/etc/keel/acme-account.json`.
    pub acme_account_key: PathBuf,
    /// PEM file of the one root trusted for the ACME server instead of the
    /// system roots (a private CA; tests use Pebble's); `""` (None) trusts the
    /// system roots. Default `""`.
    #[serde(with = "empty_is_none")]
    pub acme_extra_root: Option<PathBuf>,
    /// DNS-01 provider. Default `ovh`.
    pub dns_provider: DnsProvider,
    /// OVH API endpoint. Default `https://eu.api.ovh.com/1.0`.
    pub ovh_endpoint: String,
    /// File holding the OVH application key, secret and consumer key.
    /// Default `/usr/local/etc/keel/ovh.toml`.
    pub ovh_credentials: PathBuf,
    /// Resolvers asked whether the challenge record has propagated.
    /// Default `["1.1.1.1:53", "8.8.8.8:53"]`.
    pub resolvers: Vec<SocketAddr>,
    /// How long to wait for that propagation. Default `10m`.
    pub propagation_timeout: Interval,
    /// Interface carrying the public address; `""` (None) for none. Default `""`.
    #[serde(with = "empty_is_none")]
    pub public_interface: Option<String>,
    /// Public address nginx listens on; `""` (None) for none. Default `""`.
    #[serde(with = "empty_is_none")]
    pub public_address: Option<IpAddr>,
}

impl Default for IngressConfig {
    fn default() -> Self {
        IngressConfig {
            base: "14.5-RELEASE-nginx".into(),
            acme_directory: "https://acme-staging-v02.api.letsencrypt.org/directory".into(),
            acme_contact: None,
            acme_account_key: "/usr/local/etc/keel/acme-account.json".into(),
            acme_extra_root: None,
            dns_provider: DnsProvider::Ovh,
            ovh_endpoint: "https://eu.api.ovh.com/1.0".into(),
            ovh_credentials: "/usr/local/etc/keel/ovh.toml".into(),
            resolvers: vec![
                SocketAddr::new(IpAddr::V4(Ipv4Addr::new(1, 1, 1, 1)), 53),
                SocketAddr::new(IpAddr::V4(Ipv4Addr::new(8, 8, 8, 8)), 53),
            ],
            propagation_timeout: Interval::secs(600),
            public_interface: None,
            public_address: None,
        }
    }
}

/// How much the daemons log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// Failures only.
    Error,
    /// Failures and anything surprising.
    Warn,
    /// Plus every change made to the host.
    #[default]
    Info,
    /// Plus every command run and every request served.
    Debug,
}

/// `[log]`: logging.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `error`, `warn`, `info` or `debug`. Default `info`.
    pub level: LogLevel,
}

/// A duration written with a unit: `"500ms"`, `"5s"`, `"1m"`, `"2h"` (also `ns`
/// and `us`). A whole number, no spaces, one unit; it prints in the largest unit
/// that represents it exactly, so `"300s"` is printed `"5m"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Interval(pub Duration);

/// A string that is not an [`Interval`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntervalError(String);

impl fmt::Display for IntervalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` is not a duration: write a whole number and a unit (ms, s, m or h), e.g. \"500ms\", \"5s\", \"1m\", \"2h\"",
            self.0
        )
    }
}

impl std::error::Error for IntervalError {}

impl Interval {
    /// `n` seconds.
    pub const fn secs(n: u64) -> Interval {
        Interval(Duration::from_secs(n))
    }
}

impl FromStr for Interval {
    type Err = IntervalError;
    fn from_str(s: &str) -> Result<Interval, IntervalError> {
        let err = || IntervalError(s.to_string());
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = s.split_at(split);
        if digits.is_empty() {
            return Err(err());
        }
        let n: u64 = digits.parse().map_err(|_| err())?;
        let duration = match unit {
            "ns" => Some(Duration::from_nanos(n)),
            "us" => Some(Duration::from_micros(n)),
            "ms" => Some(Duration::from_millis(n)),
            "s" => Some(Duration::from_secs(n)),
            "m" => n.checked_mul(60).map(Duration::from_secs),
            "h" => n.checked_mul(3600).map(Duration::from_secs),
            _ => None,
        };
        duration.map(Interval).ok_or_else(err)
    }
}

impl fmt::Display for Interval {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ns = self.0.as_nanos();
        if ns == 0 {
            return f.write_str("0s");
        }
        const UNITS: [(&str, u128); 5] = [
            ("h", 3_600_000_000_000),
            ("m", 60_000_000_000),
            ("s", 1_000_000_000),
            ("ms", 1_000_000),
            ("us", 1_000),
        ];
        for (unit, per) in UNITS {
            if ns % per == 0 {
                return write!(f, "{}{unit}", ns / per);
            }
        }
        write!(f, "{ns}ns")
    }
}

impl Serialize for Interval {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Interval {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Interval, D::Error> {
        via_str::deserialize(d)
    }
}

/// Serde through `Display`/`FromStr`, for types (such as [`Ipv4Net`]) that are
/// written as one string.
mod via_str {
    use super::*;

    pub fn serialize<T: fmt::Display, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
    where
        T: FromStr,
        T::Err: fmt::Display,
        D: Deserializer<'de>,
    {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Serde for optional values written as a string where `""` means "not set", so
/// that the sample and `--check-config` can show every key.
mod empty_is_none {
    use super::*;

    pub fn serialize<T: Serialize, S: Serializer>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => v.serialize(s),
            None => s.serialize_str(""),
        }
    }

    pub fn deserialize<'de, T, D>(d: D) -> Result<Option<T>, D::Error>
    where
        T: FromStr,
        T::Err: fmt::Display,
        D: Deserializer<'de>,
    {
        let s = String::deserialize(d)?;
        if s.is_empty() {
            return Ok(None);
        }
        s.parse().map(Some).map_err(serde::de::Error::custom)
    }
}

/// A prefix from constant parts; only used for defaults, whose lengths are all
/// <= 32, the one thing `Ipv4Net::new` checks.
fn net(octets: [u8; 4], prefix: u8) -> Ipv4Net {
    Ipv4Net::new(Ipv4Addr::from(octets), prefix).expect("default prefix lengths are <= 32")
}

/// Why a configuration could not be loaded or is not acceptable.
#[derive(Debug)]
pub enum ConfigError {
    /// The file could not be read.
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// The file is not valid TOML, has an unknown key, or a value of the wrong
    /// form (including durations, prefixes and addresses that do not parse).
    Parse {
        /// The file, when loaded from one.
        path: Option<PathBuf>,
        /// 1-based line of the offending text, when known.
        line: Option<usize>,
        /// 1-based column (in characters) of the offending text, when known.
        column: Option<usize>,
        /// `section.key` of the offending text, when it can be told.
        key: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// A key has a well-formed value that Keel cannot use.
    Invalid {
        /// `section.key`, e.g. `controlplane.service_cidr`.
        key: String,
        /// What is wrong and what to do.
        message: String,
    },
}

impl ConfigError {
    /// The `section.key` the error is about, when known.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Read { .. } => None,
            ConfigError::Parse { key, .. } => key.as_deref(),
            ConfigError::Invalid { key, .. } => Some(key),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read { path, source } => {
                write!(
                    f,
                    "cannot read configuration file {}: {source}",
                    path.display()
                )
            }
            ConfigError::Parse {
                path,
                line,
                column,
                key,
                message,
            } => {
                if let Some(path) = path {
                    write!(f, "{}: ", path.display())?;
                }
                match (line, column) {
                    (Some(l), Some(c)) => write!(f, "line {l}, column {c}: ")?,
                    (Some(l), None) => write!(f, "line {l}: ")?,
                    _ => {}
                }
                if let Some(key) = key {
                    write!(f, "{key}: ")?;
                }
                f.write_str(message)
            }
            ConfigError::Invalid { key, message } => write!(f, "{key}: {message}"),
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Read { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Turns a toml error into one naming the line and the `section.key` there.
fn parse_error(src: &str, path: Option<&Path>, err: &toml::de::Error) -> ConfigError {
    let (line, column, key) = match err.span() {
        Some(span) => {
            let before = src.get(..span.start).unwrap_or(src);
            let line = before.matches('\n').count() + 1;
            let line_start = before.rfind('\n').map_or(0, |i| i + 1);
            let column = before[line_start..].chars().count() + 1;
            (Some(line), Some(column), key_at_line(src, line))
        }
        None => (None, None, None),
    };
    ConfigError::Parse {
        path: path.map(Path::to_path_buf),
        line,
        column,
        key,
        message: tidy_message(err.message()),
    }
}

/// toml's message on one line, in keel.toml's vocabulary (keys, not fields).
fn tidy_message(message: &str) -> String {
    let one_line = message.trim().lines().collect::<Vec<_>>().join("; ");
    match one_line.strip_prefix("unknown field") {
        Some(rest) => format!("unknown key{rest}"),
        None => one_line,
    }
}

/// The `section.key` that a 1-based `line` belongs to: the nearest assignment at
/// or above it (a multi-line array continues its key) under the nearest table
/// header above that. toml's errors carry a byte span but no key path.
fn key_at_line(src: &str, line: usize) -> Option<String> {
    let lines: Vec<&str> = src.lines().take(line).collect();
    let mut key: Option<String> = None;
    for text in lines.iter().rev() {
        let text = text.trim();
        if let Some(rest) = text.strip_prefix('[') {
            if rest.starts_with('[') {
                return key;
            }
            let table = rest.split(']').next().unwrap_or("").trim();
            return Some(match key {
                Some(k) => format!("{table}.{k}"),
                None => table.to_string(),
            });
        }
        if key.is_none() {
            if let Some((name, _)) = text.split_once('=') {
                let name = name.trim();
                let bare = |c: char| c.is_ascii_alphanumeric() || "_-.".contains(c);
                if !name.is_empty() && !text.starts_with('#') && name.chars().all(bare) {
                    key = Some(name.to_string());
                }
            }
        }
    }
    key
}

impl Config {
    /// Reads and parses `path` (without validating: see [`Config::validate`]).
    /// A missing file is an error; see [`Config::load_or_default`].
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let src = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&src, Some(path))
    }

    /// Like [`Config::load`], but a file that does not exist means all defaults
    /// (the daemons' behaviour at [`DEFAULT_CONFIG_PATH`]).
    pub fn load_or_default(path: &Path) -> Result<Config, ConfigError> {
        match Config::load(path) {
            Err(ConfigError::Read { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                Ok(Config::default())
            }
            other => other,
        }
    }

    /// Parses TOML text (without validating).
    pub fn from_toml_str(src: &str) -> Result<Config, ConfigError> {
        Config::parse(src, None)
    }

    fn parse(src: &str, path: Option<&Path>) -> Result<Config, ConfigError> {
        toml::from_str(src).map_err(|e| parse_error(src, path, &e))
    }

    /// The effective configuration as TOML that [`Config::from_toml_str`] loads
    /// back to an equal `Config`. Every key is written, defaults included.
    pub fn to_toml(&self) -> String {
        // Only a non-UTF-8 path can fail to render; validate() rejects those, and
        // the daemons always validate before printing.
        toml::to_string(self)
            .unwrap_or_else(|e| format!("# the configuration cannot be printed: {e}\n"))
    }

    /// Sets `key` (`section.name`) from a command-line string, parsed exactly as
    /// the same string would be in the file. Only keys holding a string or an
    /// integer can be set this way.
    pub fn set_key(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            key: key.to_string(),
            message,
        };
        let mut root = toml::Value::try_from(&*self)
            .map_err(|e| invalid(format!("cannot represent the configuration: {e}")))?;
        let slot = key
            .split_once('.')
            .and_then(|(section, name)| root.get_mut(section)?.get_mut(name))
            .ok_or_else(|| invalid("no such key".to_string()))?;
        *slot = match slot {
            toml::Value::String(_) => toml::Value::String(value.to_string()),
            toml::Value::Integer(_) => toml::Value::Integer(
                value
                    .parse()
                    .map_err(|_| invalid(format!("`{value}` is not a whole number")))?,
            ),
            // A list from the command line is comma-separated.
            toml::Value::Array(_) => toml::Value::Array(
                comma_list(value)
                    .into_iter()
                    .map(toml::Value::String)
                    .collect(),
            ),
            _ => return Err(invalid("cannot be set from the command line".to_string())),
        };
        *self = root
            .try_into()
            .map_err(|e: toml::de::Error| invalid(tidy_message(e.message())))?;
        Ok(())
    }

    /// `--simulate`: every key still at its production default and naming a host
    /// path or a FreeBSD-only range moves under `<cwd>/keel-sim` or onto loopback
    /// ranges (127.64.0.0/10 for nodes, 127.128.0.0/16 for VIPs), so the daemons
    /// run unprivileged on any OS. Keys the file or a flag set are kept.
    pub fn apply_simulate_defaults(&mut self, cwd: &Path) {
        fn swap<T: PartialEq>(value: &mut T, production: T, simulated: T) {
            if *value == production {
                *value = simulated;
            }
        }
        let prod = Config::default();
        let sim = cwd.join("keel-sim");
        let a = &mut self.agent;
        swap(&mut a.state_dir, prod.agent.state_dir, sim.join("agentd"));
        swap(&mut a.socket, prod.agent.socket, sim.join("agentd.sock"));
        swap(&mut a.pidfile, prod.agent.pidfile, sim.join("agentd.pid"));
        swap(
            &mut a.node_subnet,
            prod.agent.node_subnet,
            net([127, 64, 0, 0], 24),
        );
        let z = &mut self.zfs;
        swap(&mut z.jails_dir, prod.zfs.jails_dir, sim.join("jails"));
        swap(
            &mut z.volumes_dir,
            prod.zfs.volumes_dir,
            sim.join("volumes"),
        );
        swap(&mut z.bases_dir, prod.zfs.bases_dir, sim.join("bases"));
        let c = &mut self.controlplane;
        swap(
            &mut c.cluster_cidr,
            prod.controlplane.cluster_cidr,
            net([127, 64, 0, 0], 10),
        );
        swap(
            &mut c.service_cidr,
            prod.controlplane.service_cidr,
            net([127, 128, 0, 0], 16),
        );
        swap(
            &mut c.state_dir,
            prod.controlplane.state_dir,
            sim.join("controlplane"),
        );
        swap(
            &mut c.pidfile,
            prod.controlplane.pidfile,
            sim.join("controlplane.pid"),
        );
        // Keys live with the rest of the simulated cluster; the daemons create
        // missing ones in simulate mode (see `common::auth::ensure_sim_key`).
        let keys = sim.join("keys");
        swap(
            &mut c.key_file,
            prod.controlplane.key_file,
            keys.join("node.key"),
        );
        swap(
            &mut self.agent.key_file,
            prod.agent.key_file,
            keys.join("node.key"),
        );
        swap(
            &mut self.ctl.key_file,
            prod.ctl.key_file,
            keys.join("operator.key"),
        );
        swap(
            &mut self.auth.node_keys,
            prod.auth.node_keys,
            vec![keys.join("node.key")],
        );
        swap(
            &mut self.auth.operator_keys,
            prod.auth.operator_keys,
            vec![keys.join("operator.key")],
        );
    }

    /// Checks what the types cannot: absolute UTF-8 paths, durations above zero,
    /// prefixes that are network addresses, large enough and disjoint, names that
    /// reach a command line, and the relations between keys. The first problem is
    /// returned, naming its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let a = &self.agent;
        check_path("agent.state_dir", &a.state_dir)?;
        check_path("agent.socket", &a.socket)?;
        let socket_len = a.socket.as_os_str().len();
        if socket_len > MAX_SOCKET_PATH {
            return Err(invalid(
                "agent.socket",
                format!(
                    "{} is {socket_len} bytes, but a Unix socket path may have at most {MAX_SOCKET_PATH}; choose a shorter path",
                    a.socket.display()
                ),
            ));
        }
        check_name("agent.socket_group", &a.socket_group, 32, "_-")?;
        check_path("agent.pidfile", &a.pidfile)?;
        check_ifname("agent.bridge", &a.bridge, "_")?;
        check_prefix("agent.node_subnet", a.node_subnet, 24)?;
        check_interval("agent.reconcile_interval", a.reconcile_interval)?;
        check_interval("agent.usage_interval", a.usage_interval)?;
        if let Some(cp) = &a.controlplane {
            check_host_ports("agent.controlplane", cp)?;
            if a.advertise_addr.is_none() {
                return Err(invalid(
                    "agent.advertise_addr",
                    "required when agent.controlplane is set: the IP:PORT the control plane reaches this agent on",
                ));
            }
        }
        if let Some(id) = &a.node_id {
            check_dns_label("agent.node_id", id)?;
        }
        check_interval("agent.heartbeat_interval", a.heartbeat_interval)?;
        check_interval("agent.proxy_connect_timeout", a.proxy_connect_timeout)?;
        if a.proxy_threads > 64 {
            return Err(invalid(
                "agent.proxy_threads",
                format!(
                    "{} event loops is more than the 64 allowed; 0 gives one per CPU, at most 8",
                    a.proxy_threads
                ),
            ));
        }
        if let Some(metrics) = a.metrics_listen {
            check_distinct_listener(
                "agent.metrics_listen",
                metrics,
                "agent.advertise_addr",
                a.advertise_addr,
            )?;
        }
        check_path("agent.key_file", &a.key_file)?;
        check_mirror_url("agent.base_mirror", &a.base_mirror)?;
        if let Some(archive) = &a.base_archive {
            check_mirror_url("agent.base_archive", archive)?;
        }

        let z = &self.zfs;
        check_name("zfs.pool", &z.pool, MAX_POOL_LEN, "_-.:")?;
        check_path("zfs.jails_dir", &z.jails_dir)?;
        check_path("zfs.volumes_dir", &z.volumes_dir)?;
        check_path("zfs.bases_dir", &z.bases_dir)?;
        check_interval("zfs.busy_retry_delay", z.busy_retry_delay)?;

        if self.jail.devfs_ruleset == DevfsRuleset::Number(0) {
            return Err(invalid(
                "jail.devfs_ruleset",
                format!(
                    "0 applies no ruleset, so every device of the host would appear in every jail; use {DEVFSRULES_JAIL} (devfsrules_jail), another ruleset of /etc/devfs.rules, or \"{INHERIT}\" when keel-agentd runs inside a jail"
                ),
            ));
        }

        let c = &self.controlplane;
        check_path("controlplane.state_dir", &c.state_dir)?;
        check_path("controlplane.pidfile", &c.pidfile)?;
        check_prefix("controlplane.cluster_cidr", c.cluster_cidr, 24)?;
        check_prefix("controlplane.service_cidr", c.service_cidr, 30)?;
        if overlap(c.cluster_cidr, c.service_cidr) {
            return Err(invalid(
                "controlplane.service_cidr",
                format!(
                    "{} overlaps controlplane.cluster_cidr {}; node subnets and service VIPs need disjoint ranges",
                    c.service_cidr, c.cluster_cidr
                ),
            ));
        }
        if overlap(a.node_subnet, c.service_cidr) {
            return Err(invalid(
                "agent.node_subnet",
                format!(
                    "{} overlaps controlplane.service_cidr {}; jail addresses and service VIPs need disjoint ranges",
                    a.node_subnet, c.service_cidr
                ),
            ));
        }
        if let Some(metrics) = c.metrics_listen {
            check_distinct_listener(
                "controlplane.metrics_listen",
                metrics,
                "controlplane.listen",
                Some(c.listen),
            )?;
        }
        if !c.etcd_endpoints.is_empty() && c.advertised().ip().is_unspecified() {
            return Err(invalid(
                "controlplane.advertise_addr",
                format!(
                    "required when controlplane.listen ({}) is a wildcard and controlplane.etcd_endpoints is set: the IP:PORT the other control planes forward requests to while this one leads",
                    c.listen
                ),
            ));
        }
        check_interval("controlplane.heartbeat_interval", c.heartbeat_interval)?;
        check_interval("controlplane.dead_after", c.dead_after)?;
        if c.dead_after <= c.heartbeat_interval {
            return Err(invalid(
                "controlplane.dead_after",
                format!(
                    "{} must be longer than controlplane.heartbeat_interval {}, or live nodes are declared dead between two heartbeats",
                    c.dead_after, c.heartbeat_interval
                ),
            ));
        }

        check_path("controlplane.key_file", &c.key_file)?;

        let auth = &self.auth;
        for (i, p) in auth.node_keys.iter().enumerate() {
            check_path(&format!("auth.node_keys[{i}]"), p)?;
        }
        for (i, p) in auth.operator_keys.iter().enumerate() {
            check_path(&format!("auth.operator_keys[{i}]"), p)?;
        }
        check_interval("auth.max_clock_skew", auth.max_clock_skew)?;

        if let Some(cp) = &self.ctl.controlplane {
            check_host_ports("ctl.controlplane", cp)?;
        }
        check_path("ctl.key_file", &self.ctl.key_file)?;

        let i = &self.ingress;
        check_name("ingress.base", &i.base, 64, "_-.")?;
        check_url("ingress.acme_directory", &i.acme_directory)?;
        if let Some(contact) = &i.acme_contact {
            let bad = |c: char| c.is_whitespace() || c.is_control() || "\"'<>;,".contains(c);
            if !contact.contains('@') || contact.contains(bad) {
                return Err(invalid(
                    "ingress.acme_contact",
                    format!("`{contact}` is not an e-mail address"),
                ));
            }
        }
        check_path("ingress.acme_account_key", &i.acme_account_key)?;
        if let Some(root) = &i.acme_extra_root {
            check_path("ingress.acme_extra_root", root)?;
        }
        check_url("ingress.ovh_endpoint", &i.ovh_endpoint)?;
        check_path("ingress.ovh_credentials", &i.ovh_credentials)?;
        if i.resolvers.is_empty() {
            return Err(invalid(
                "ingress.resolvers",
                "needs at least one IP:PORT to check DNS propagation with",
            ));
        }
        check_interval("ingress.propagation_timeout", i.propagation_timeout)?;
        if let Some(ifname) = &i.public_interface {
            // VLAN interfaces are named like `igb0.100`.
            check_ifname("ingress.public_interface", ifname, "_.")?;
        }

        for (name, path) in self.commands.entries() {
            check_path(&format!("commands.{name}"), path)?;
        }
        Ok(())
    }
}

fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        message: message.into(),
    }
}

fn check_path(key: &str, path: &Path) -> Result<(), ConfigError> {
    let Some(text) = path.to_str() else {
        return Err(invalid(
            key,
            format!("{} is not valid UTF-8", path.display()),
        ));
    };
    if !path.is_absolute() {
        return Err(invalid(
            key,
            format!("`{text}` is not an absolute path (it must start with /)"),
        ));
    }
    if text.contains('\0') {
        return Err(invalid(key, "contains a NUL byte"));
    }
    Ok(())
}

fn check_interval(key: &str, interval: Interval) -> Result<(), ConfigError> {
    if interval.0.is_zero() {
        return Err(invalid(key, "must be longer than zero"));
    }
    Ok(())
}

/// A network address (host bits clear) with a prefix length of at most `max_len`.
fn check_prefix(key: &str, net: Ipv4Net, max_len: u8) -> Result<(), ConfigError> {
    if net.addr() != net.network() {
        return Err(invalid(
            key,
            format!(
                "{net} has host bits set; write the network address, {}",
                net.trunc()
            ),
        ));
    }
    if net.prefix_len() > max_len {
        return Err(invalid(
            key,
            format!("{net} is too small: use a /{max_len} or a larger range (a shorter prefix)"),
        ));
    }
    Ok(())
}

fn overlap(a: Ipv4Net, b: Ipv4Net) -> bool {
    a.contains(b.network()) || b.contains(a.network())
}

/// Starts with a letter or digit (never `-`, so it cannot pass for an option in an
/// argv), then letters, digits or one of `extra`; at most `max` characters.
fn check_name(key: &str, name: &str, max: usize, extra: &str) -> Result<(), ConfigError> {
    let ok = name.len() <= max
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || extra.contains(c));
    if !ok {
        return Err(invalid(
            key,
            format!(
                "`{name}` is not a valid name: a letter or digit, then letters, digits or `{extra}`, at most {max} characters"
            ),
        ));
    }
    Ok(())
}

/// An interface name: lowercase letter, then lowercase letters, digits or `extra`,
/// at most [`MAX_IFNAME`] characters.
fn check_ifname(key: &str, name: &str, extra: &str) -> Result<(), ConfigError> {
    let ok = name.len() <= MAX_IFNAME
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || extra.contains(c));
    if !ok {
        return Err(invalid(
            key,
            format!(
                "`{name}` is not a valid interface name: a lowercase letter, then lowercase letters, digits or `{extra}`, at most {MAX_IFNAME} characters"
            ),
        ));
    }
    Ok(())
}

fn check_dns_label(key: &str, label: &str) -> Result<(), ConfigError> {
    let ok = !label.is_empty()
        && label.len() <= 63
        && !label.starts_with('-')
        && !label.ends_with('-')
        && label
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !ok {
        return Err(invalid(
            key,
            format!(
                "`{label}` is not a DNS label (lowercase letters, digits and inner `-`, at most 63 characters)"
            ),
        ));
    }
    Ok(())
}

/// A metrics listener (`key`, at `addr`) must not take the port of the
/// daemon's API listener (`api_key`): the second bind would fail at start,
/// or, with an unspecified address on one side, both could not be told apart.
fn check_distinct_listener(
    key: &str,
    addr: SocketAddr,
    api_key: &str,
    api: Option<SocketAddr>,
) -> Result<(), ConfigError> {
    let Some(api) = api else {
        return Ok(());
    };
    let same_ip = addr.ip() == api.ip() || addr.ip().is_unspecified() || api.ip().is_unspecified();
    if addr.port() != 0 && addr.port() == api.port() && same_ip {
        return Err(invalid(
            key,
            format!(
                "{addr} is the address of {api_key} ({api}); the metrics listener needs a port of its own"
            ),
        ));
    }
    Ok(())
}

/// `HOST:PORT` where HOST is a name, an IPv4 address or a bracketed IPv6 address.
/// The items of a comma-separated list (`"cp1:7440, cp2:7440"`, a flag's
/// value for a list key), in order, blanks around each trimmed, empty ones
/// dropped.
pub fn comma_list(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_string)
        .collect()
}

/// `value` is one `HOST:PORT` or several separated by commas (the control
/// planes of one cluster), none twice.
fn check_host_ports(key: &str, value: &str) -> Result<(), ConfigError> {
    let mut seen = std::collections::BTreeSet::new();
    for part in value.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err(invalid(
                key,
                format!(
                    "`{value}` has an empty entry; give HOST:PORT, or several separated by commas"
                ),
            ));
        }
        check_host_port(key, part)?;
        if !seen.insert(part) {
            return Err(invalid(key, format!("`{part}` is given twice")));
        }
    }
    Ok(())
}

fn check_host_port(key: &str, value: &str) -> Result<(), ConfigError> {
    let err = || {
        invalid(
            key,
            format!("`{value}` is not HOST:PORT (e.g. 192.0.2.10:7440 or cp.example.org:7440)"),
        )
    };
    if value.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let (host, port) = value.rsplit_once(':').ok_or_else(err)?;
    let port_ok = matches!(port.parse::<u16>(), Ok(p) if p != 0);
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host
            .split('.')
            .all(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
    if port_ok && host_ok {
        Ok(())
    } else {
        Err(err())
    }
}

/// A base mirror: what [`check_url`] accepts, or a `file://` URL of an
/// absolute directory (a local copy of a mirror, and the tests' tarballs).
fn check_mirror_url(key: &str, url: &str) -> Result<(), ConfigError> {
    match url.strip_prefix("file://") {
        Some(path) if path.starts_with('/') && !path.contains(char::is_control) => Ok(()),
        Some(_) => Err(invalid(
            key,
            format!("`{url}` is not a file:// URL of an absolute directory (file:///srv/mirror)"),
        )),
        None => check_url(key, url),
    }
}

fn check_url(key: &str, url: &str) -> Result<(), ConfigError> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"));
    match rest {
        Some(rest)
            if !rest.is_empty()
                && !rest.contains(|c: char| c.is_whitespace() || c.is_control()) =>
        {
            Ok(())
        }
        _ => Err(invalid(
            key,
            format!("`{url}` is not an http:// or https:// URL"),
        )),
    }
}
/// Absolute paths of the FreeBSD programs Keel runs (`[commands]` in keel.toml).
/// Tests and unusual installs override them; nothing else ever names a program.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CommandPaths {
    /// jail(8)
    pub jail: PathBuf,
    /// jls(8)
    pub jls: PathBuf,
    /// jexec(8)
    pub jexec: PathBuf,
    /// rctl(8)
    pub rctl: PathBuf,
    /// ps(1)
    pub ps: PathBuf,
    /// zfs(8)
    pub zfs: PathBuf,
    /// ifconfig(8)
    pub ifconfig: PathBuf,
    /// route(8)
    pub route: PathBuf,
    /// netstat(1)
    pub netstat: PathBuf,
    /// mount(8)
    pub mount: PathBuf,
    /// umount(8)
    pub umount: PathBuf,
    /// mkdir(1), for mount points
    pub mkdir: PathBuf,
    /// pfctl(8)
    pub pfctl: PathBuf,
    /// sysctl(8)
    pub sysctl: PathBuf,
    /// tar(1) (bsdtar), extracting a base's `base.txz`
    pub tar: PathBuf,
}

impl Default for CommandPaths {
    fn default() -> Self {
        CommandPaths {
            jail: "/usr/sbin/jail".into(),
            jls: "/usr/sbin/jls".into(),
            jexec: "/usr/sbin/jexec".into(),
            rctl: "/usr/bin/rctl".into(),
            ps: "/bin/ps".into(),
            zfs: "/sbin/zfs".into(),
            ifconfig: "/sbin/ifconfig".into(),
            route: "/sbin/route".into(),
            netstat: "/usr/bin/netstat".into(),
            mount: "/sbin/mount".into(),
            umount: "/sbin/umount".into(),
            mkdir: "/bin/mkdir".into(),
            pfctl: "/sbin/pfctl".into(),
            sysctl: "/sbin/sysctl".into(),
            tar: "/usr/bin/tar".into(),
        }
    }
}

impl CommandPaths {
    /// Default paths re-rooted under `prefix` (tests point them at stubs).
    pub fn with_prefix(prefix: &std::path::Path) -> CommandPaths {
        let d = CommandPaths::default();
        let re = |p: &PathBuf| prefix.join(p.strip_prefix("/").unwrap_or(p));
        CommandPaths {
            jail: re(&d.jail),
            jls: re(&d.jls),
            jexec: re(&d.jexec),
            rctl: re(&d.rctl),
            ps: re(&d.ps),
            zfs: re(&d.zfs),
            ifconfig: re(&d.ifconfig),
            route: re(&d.route),
            netstat: re(&d.netstat),
            mount: re(&d.mount),
            umount: re(&d.umount),
            mkdir: re(&d.mkdir),
            pfctl: re(&d.pfctl),
            sysctl: re(&d.sysctl),
            tar: re(&d.tar),
        }
    }
}

impl CommandPaths {
    /// Every program as (`[commands]` key, path), in declaration order.
    pub fn entries(&self) -> [(&'static str, &Path); 15] {
        [
            ("jail", &self.jail),
            ("jls", &self.jls),
            ("jexec", &self.jexec),
            ("rctl", &self.rctl),
            ("ps", &self.ps),
            ("zfs", &self.zfs),
            ("ifconfig", &self.ifconfig),
            ("route", &self.route),
            ("netstat", &self.netstat),
            ("mount", &self.mount),
            ("umount", &self.umount),
            ("mkdir", &self.mkdir),
            ("pfctl", &self.pfctl),
            ("sysctl", &self.sysctl),
            ("tar", &self.tar),
        ]
        .map(|(k, p)| (k, p.as_path()))
    }
}

/// What a daemon flag does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlagAction {
    /// Read the configuration from the flag's PATH instead of [`DEFAULT_CONFIG_PATH`].
    ConfigFile,
    /// Validate, print the effective configuration, exit.
    CheckConfig,
    /// Run on the simulated host ([`Config::apply_simulate_defaults`]).
    Simulate,
    /// Detach and write the pid file.
    Daemon,
    /// Print the help and exit.
    Help,
    /// Print the version and exit.
    Version,
    /// Instead of serving, write the daemon's state to the flag's PATH
    /// (`-` for stdout) and exit.
    ExportState,
    /// Instead of serving, load the daemon's state from the flag's PATH
    /// (`-` for stdin) into an empty state directory and exit.
    ImportState,
    /// Override a `keel.toml` key with the flag's value.
    Set {
        /// `section.key` overridden.
        key: &'static str,
        /// Placeholder shown in the help, e.g. `PATH`.
        value: &'static str,
    },
}

/// One command-line flag of a daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flag {
    /// Single-letter form, if any.
    pub short: Option<char>,
    /// Long form without the leading `--`.
    pub long: &'static str,
    /// What it does.
    pub action: FlagAction,
    /// One line for `--help`.
    pub help: &'static str,
}

impl Flag {
    /// A flag `--long VALUE` that sets the keel.toml `key`.
    pub const fn set(
        long: &'static str,
        key: &'static str,
        value: &'static str,
        help: &'static str,
    ) -> Flag {
        Flag {
            short: None,
            long,
            action: FlagAction::Set { key, value },
            help,
        }
    }

    /// `--config PATH`-style placeholder of the value, if the flag takes one.
    pub fn value_name(&self) -> Option<&'static str> {
        match self.action {
            FlagAction::ConfigFile | FlagAction::ExportState | FlagAction::ImportState => {
                Some("PATH")
            }
            FlagAction::Set { value, .. } => Some(value),
            _ => None,
        }
    }

    /// The `keel.toml` key the flag overrides, if any.
    pub fn key(&self) -> Option<&'static str> {
        match self.action {
            FlagAction::Set { key, .. } => Some(key),
            _ => None,
        }
    }
}

/// `-c/--config PATH`, shared by both daemons.
pub const FLAG_CONFIG: Flag = Flag {
    short: Some('c'),
    long: "config",
    action: FlagAction::ConfigFile,
    help: "configuration file (default /usr/local/etc/keel.toml; if that is missing, all defaults)",
};
/// `--check-config`, shared by both daemons.
pub const FLAG_CHECK_CONFIG: Flag = Flag {
    short: None,
    long: "check-config",
    action: FlagAction::CheckConfig,
    help: "load and validate the configuration, print it as TOML and exit (0 valid, 2 not)",
};
/// `--simulate`, shared by both daemons.
pub const FLAG_SIMULATE: Flag = Flag {
    short: None,
    long: "simulate",
    action: FlagAction::Simulate,
    help: "simulated host: paths under ./keel-sim and loopback ranges for keys left at their defaults",
};
/// `--daemon`, shared by both daemons.
pub const FLAG_DAEMON: Flag = Flag {
    short: None,
    long: "daemon",
    action: FlagAction::Daemon,
    help: "detach from the terminal and write the pid file",
};
/// `--log-level LEVEL`, shared by both daemons.
pub const FLAG_LOG_LEVEL: Flag = Flag {
    short: None,
    long: "log-level",
    action: FlagAction::Set {
        key: "log.level",
        value: "LEVEL",
    },
    help: "error, warn, info or debug",
};
/// `--export-state PATH` (the control plane's).
pub const FLAG_EXPORT_STATE: Flag = Flag {
    short: None,
    long: "export-state",
    action: FlagAction::ExportState,
    help: "write the cluster state to PATH (- for stdout) as one JSON document and exit; the daemon must not be running",
};
/// `--import-state PATH` (the control plane's).
pub const FLAG_IMPORT_STATE: Flag = Flag {
    short: None,
    long: "import-state",
    action: FlagAction::ImportState,
    help: "load a state written by --export-state from PATH (- for stdin) into an empty state directory and exit",
};
/// `-h/--help`, shared by both daemons.
pub const FLAG_HELP: Flag = Flag {
    short: Some('h'),
    long: "help",
    action: FlagAction::Help,
    help: "print this help and exit",
};
/// `-V/--version`, shared by both daemons.
pub const FLAG_VERSION: Flag = Flag {
    short: Some('V'),
    long: "version",
    action: FlagAction::Version,
    help: "print the version and exit",
};

/// A daemon's command line: its name, a one-line description and its flags.
#[derive(Debug, Clone, Copy)]
pub struct Daemon {
    /// Program name, used in messages (`keel-agentd: ...`).
    pub name: &'static str,
    /// One line saying what it is.
    pub about: &'static str,
    /// Every flag it accepts.
    pub flags: &'static [Flag],
    /// Checks of its own on the validated configuration (settings only it
    /// reads, whose rules live in its modules), run wherever
    /// [`Config::validate`] is, `--check-config` included.
    pub check: fn(&Config) -> Result<(), ConfigError>,
}

/// A [`Daemon::check`] with nothing to check.
pub fn no_check(_: &Config) -> Result<(), ConfigError> {
    Ok(())
}

/// A daemon's parsed command line: the configuration with file, `--simulate`
/// defaults and flags applied, and validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonOptions {
    /// The effective, validated configuration.
    pub config: Config,
    /// `--simulate` was given.
    pub simulate: bool,
    /// `--daemon` was given.
    pub daemon: bool,
    /// `--check-config` was given.
    pub check_config: bool,
    /// `--export-state` or `--import-state` was given: move the state, do
    /// not serve.
    pub transfer: Option<StateTransfer>,
    /// How `config` was made, to make it again on SIGHUP.
    pub source: ConfigSource,
}

/// Where a daemon's configuration came from: the file, simulate mode and the
/// flags that override keys. [`ConfigSource::load`] repeats the whole recipe,
/// so a reload (SIGHUP) sees the file's new contents with the same flags.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigSource {
    /// `--config`, or `None` for the default path (missing means defaults).
    pub path: Option<PathBuf>,
    /// `--simulate` was given.
    pub simulate: bool,
    /// The working directory simulate-mode paths are relative to.
    pub cwd: PathBuf,
    /// `(key, value)` of every key-setting flag, in command-line order.
    pub sets: Vec<(&'static str, String)>,
}

impl ConfigSource {
    /// Loads the file again, applies simulate defaults and the flags, and
    /// validates.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let mut config = match &self.path {
            Some(path) => Config::load(path),
            None => Config::load_or_default(Path::new(DEFAULT_CONFIG_PATH)),
        }?;
        if self.simulate {
            config.apply_simulate_defaults(&self.cwd);
        }
        for (key, value) in &self.sets {
            config.set_key(key, value)?;
        }
        config.validate()?;
        Ok(config)
    }
}

/// Why a daemon's command line does not lead to running it. `Help` and `Version`
/// are not failures: they carry the text to print on stdout and exit 0.
#[derive(Debug)]
pub enum CliError {
    /// `--help`: the help text.
    Help(String),
    /// `--version`: the version line.
    Version(String),
    /// An unknown flag, a missing or unexpected value, a stray argument.
    Usage(String),
    /// A flag's value does not fit the key it sets, or the key it set is invalid.
    Flag {
        /// The flag as typed, e.g. `--node-subnet`.
        flag: String,
        /// What is wrong with the key it sets.
        error: Box<ConfigError>,
    },
    /// The configuration file could not be loaded or is invalid.
    Config(Box<ConfigError>),
}

impl CliError {
    /// The process exit status: 0 for help and version, 2 for usage and
    /// configuration errors.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Help(_) | CliError::Version(_) => 0,
            _ => 2,
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Help(text) | CliError::Version(text) => f.write_str(text),
            CliError::Usage(msg) => f.write_str(msg),
            CliError::Flag { flag, error } => write!(f, "{flag}: {error}"),
            CliError::Config(error) => write!(f, "{error}"),
        }
    }
}

impl std::error::Error for CliError {}

/// The `--help` text: usage, then one line per flag with the key it overrides.
pub fn render_help(daemon: &Daemon) -> String {
    let left = |flag: &Flag| {
        let short = flag.short.map_or("    ".to_string(), |c| format!("-{c}, "));
        let value = flag.value_name().map_or(String::new(), |v| format!(" {v}"));
        format!("{short}--{}{value}", flag.long)
    };
    let width = daemon
        .flags
        .iter()
        .map(|f| left(f).len())
        .max()
        .unwrap_or(0);
    let mut out = format!(
        "{} {}: {}\n\nUsage: {} [OPTIONS]\n\nOptions:\n",
        daemon.name,
        env!("CARGO_PKG_VERSION"),
        daemon.about,
        daemon.name
    );
    for flag in daemon.flags {
        let key = flag.key().map_or(String::new(), |k| format!(" [{k}]"));
        out.push_str(&format!("  {:width$}  {}{key}\n", left(flag), flag.help));
    }
    out.push_str(
        "\nFlags override the keel.toml keys shown in brackets.\n\
         Exit status: 0 success, 1 runtime failure, 2 usage or configuration error.\n",
    );
    out
}

/// Parses a daemon's arguments (without the program name), loads the
/// configuration (`--config`, or [`DEFAULT_CONFIG_PATH`] if it exists), applies
/// `--simulate` defaults relative to `cwd`, then the flags, and validates.
pub fn parse_daemon_args(
    daemon: &Daemon,
    args: impl IntoIterator<Item = OsString>,
    cwd: &Path,
) -> Result<DaemonOptions, CliError> {
    use lexopt::prelude::*;
    let usage = |e: lexopt::Error| CliError::Usage(e.to_string());
    let mut parser = lexopt::Parser::from_args(args);
    let mut config_path: Option<PathBuf> = None;
    let mut sets: Vec<(&'static Flag, String)> = Vec::new();
    let (mut simulate, mut daemonize, mut check_config) = (false, false, false);
    let mut transfer: Option<StateTransfer> = None;
    while let Some(arg) = parser.next().map_err(usage)? {
        let found = match arg {
            Short(c) => daemon.flags.iter().find(|f| f.short == Some(c)),
            Long(name) => daemon.flags.iter().find(|f| f.long == name),
            Value(_) => None,
        };
        let Some(flag) = found else {
            return Err(CliError::Usage(arg.unexpected().to_string()));
        };
        let mut value =
            || -> Result<String, CliError> {
                parser.value().map_err(usage)?.string().map_err(|_| {
                    CliError::Usage(format!("--{}: value is not valid UTF-8", flag.long))
                })
            };
        match flag.action {
            FlagAction::Help => return Err(CliError::Help(render_help(daemon))),
            FlagAction::Version => {
                return Err(CliError::Version(format!(
                    "{} {}\n",
                    daemon.name,
                    env!("CARGO_PKG_VERSION")
                )));
            }
            FlagAction::ConfigFile => config_path = Some(PathBuf::from(value()?)),
            FlagAction::CheckConfig => check_config = true,
            FlagAction::Simulate => simulate = true,
            FlagAction::Daemon => daemonize = true,
            FlagAction::Set { .. } => sets.push((flag, value()?)),
            FlagAction::ExportState | FlagAction::ImportState => {
                if transfer.is_some() {
                    return Err(CliError::Usage(
                        "--export-state and --import-state are given once, not together".into(),
                    ));
                }
                let raw = value()?;
                let path = (raw != "-").then(|| cwd.join(&raw));
                transfer = Some(if flag.action == FlagAction::ExportState {
                    StateTransfer::Export(path)
                } else {
                    StateTransfer::Import(path)
                });
            }
        }
    }

    let mut config = match &config_path {
        Some(path) => Config::load(path),
        None => Config::load_or_default(Path::new(DEFAULT_CONFIG_PATH)),
    }
    .map_err(|e| CliError::Config(Box::new(e)))?;
    if simulate {
        config.apply_simulate_defaults(cwd);
    }
    let flag_error = |flag: &Flag, error| CliError::Flag {
        flag: format!("--{}", flag.long),
        error: Box::new(error),
    };
    for (flag, value) in &sets {
        if let Some(key) = flag.key() {
            config
                .set_key(key, value)
                .map_err(|e| flag_error(flag, e))?;
        }
    }
    if let Err(error) = config.validate().and_then(|()| (daemon.check)(&config)) {
        // A bad value that came from a flag is reported against the flag: the
        // key is nowhere in the file.
        let from_flag = sets
            .iter()
            .rev()
            .find(|(flag, _)| flag.key().is_some() && flag.key() == error.key());
        return Err(match from_flag {
            Some((flag, _)) => flag_error(flag, error),
            None => CliError::Config(Box::new(error)),
        });
    }
    let source = ConfigSource {
        path: config_path,
        simulate,
        cwd: cwd.to_path_buf(),
        sets: sets
            .iter()
            .filter_map(|(flag, value)| flag.key().map(|k| (k, value.clone())))
            .collect(),
    };
    Ok(DaemonOptions {
        config,
        simulate,
        daemon: daemonize,
        check_config,
        transfer,
        source,
    })
}

/// Moving a daemon's state out or in instead of serving
/// ([`DaemonOptions::transfer`]); `None` is stdout or stdin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateTransfer {
    /// `--export-state PATH`.
    Export(Option<PathBuf>),
    /// `--import-state PATH`.
    Import(Option<PathBuf>),
}

/// A daemon's whole `main`: parse, then print help, version or the effective
/// configuration, or call `run`. Returns the exit status: 0 success, 1 when `run`
/// fails, 2 for usage and configuration errors.
pub fn daemon_main<E: fmt::Display>(
    daemon: &Daemon,
    run: fn(DaemonOptions) -> Result<(), E>,
) -> i32 {
    let cwd = match std::env::current_dir() {
        Ok(cwd) => cwd,
        Err(e) => {
            eprintln!("{}: cannot read the current directory: {e}", daemon.name);
            return 2;
        }
    };
    let options = match parse_daemon_args(daemon, std::env::args_os().skip(1), &cwd) {
        Ok(options) => options,
        Err(e @ (CliError::Help(_) | CliError::Version(_))) => return print_stdout(&e.to_string()),
        Err(e @ CliError::Usage(_)) => {
            eprintln!("{}: {e}\nTry '{} --help'.", daemon.name, daemon.name);
            return e.exit_code();
        }
        Err(e) => {
            eprintln!("{}: {e}", daemon.name);
            return e.exit_code();
        }
    };
    if options.check_config {
        return print_stdout(&options.config.to_toml());
    }
    match run(options) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{}: {e}", daemon.name);
            1
        }
    }
}

/// Writes `text` on stdout; a closed pipe (`| head`) is not a failure.
fn print_stdout(text: &str) -> i32 {
    let mut out = io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => 0,
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => 0,
        Err(e) => {
            eprintln!("cannot write to stdout: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_err(src: &str) -> ConfigError {
        match Config::from_toml_str(src) {
            Ok(c) => panic!("expected a parse error for {src:?}, got {c:?}"),
            Err(e) => e,
        }
    }

    /// Loads `src`, expecting it to parse but fail validation.
    fn invalid_err(src: &str) -> ConfigError {
        let config = Config::from_toml_str(src).expect("parses");
        match config.validate() {
            Ok(()) => panic!("expected a validation error for {src:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn a_list_is_split_on_commas_and_trimmed() {
        assert_eq!(
            comma_list(" cp1:7440, cp2:7440 ,,cp3:1"),
            ["cp1:7440", "cp2:7440", "cp3:1"]
        );
        assert_eq!(comma_list("cp1:7440"), ["cp1:7440"]);
    }

    #[test]
    fn several_control_planes_separated_by_commas_are_valid() {
        let config = Config::from_toml_str(
            "[agent]\ncontrolplane = \"cp1.example.org:7440, 192.0.2.2:7440\"\n\
             advertise_addr = \"10.0.0.2:7441\"\n[ctl]\ncontrolplane = \"cp1:7440,cp2:7440\"\n",
        )
        .expect("parses");
        config.validate().expect("a list of HOST:PORT is valid");
    }

    #[test]
    fn defaults_are_valid_and_round_trip() {
        let config = Config::default();
        config.validate().expect("defaults validate");
        let text = config.to_toml();
        assert_eq!(Config::from_toml_str(&text).expect("reloads"), config);
        assert_eq!(Config::from_toml_str("").expect("empty file"), config);
    }

    #[test]
    fn simulate_defaults_are_valid_and_move_only_default_keys() {
        let mut config =
            Config::from_toml_str("[agent]\nstate_dir = \"/srv/agent\"\n").expect("parses");
        config.apply_simulate_defaults(Path::new("/home/u"));
        config.validate().expect("simulate defaults validate");
        assert_eq!(config.agent.state_dir, Path::new("/srv/agent"));
        assert_eq!(
            config.agent.socket,
            Path::new("/home/u/keel-sim/agentd.sock")
        );
        assert_eq!(
            config.agent.pidfile,
            Path::new("/home/u/keel-sim/agentd.pid")
        );
        assert_eq!(config.agent.node_subnet.to_string(), "127.64.0.0/24");
        assert_eq!(config.zfs.jails_dir, Path::new("/home/u/keel-sim/jails"));
        assert_eq!(
            config.zfs.volumes_dir,
            Path::new("/home/u/keel-sim/volumes")
        );
        assert_eq!(
            config.controlplane.cluster_cidr.to_string(),
            "127.64.0.0/10"
        );
        assert_eq!(
            config.controlplane.service_cidr.to_string(),
            "127.128.0.0/16"
        );
        assert_eq!(
            config.controlplane.state_dir,
            Path::new("/home/u/keel-sim/controlplane")
        );
        assert_eq!(
            config.controlplane.pidfile,
            Path::new("/home/u/keel-sim/controlplane.pid")
        );
    }

    #[test]
    fn unknown_key_in_every_section_names_key_and_line() {
        let sections = [
            "agent",
            "zfs",
            "jail",
            "controlplane",
            "auth",
            "ctl",
            "ingress",
            "commands",
            "log",
        ];
        for section in sections {
            let src = format!("# comment\n[{section}]\n\nbogus_key = 1\n");
            let err = parse_err(&src);
            let text = err.to_string();
            assert_eq!(
                err.key(),
                Some(format!("{section}.bogus_key").as_str()),
                "{text}"
            );
            assert!(text.contains("line 4"), "{text}");
            assert!(text.contains("unknown key"), "{text}");
        }
        let err = parse_err("[agent]\n\n[bogus]\nx = 1\n");
        assert_eq!(err.key(), Some("bogus"));
        assert!(err.to_string().contains("line 3"), "{err}");
    }

    #[test]
    fn bad_values_name_key_and_line() {
        let cases = [
            (
                "[agent]\nreconcile_interval = \"5\"\n",
                "agent.reconcile_interval",
            ),
            (
                "[zfs]\nbusy_retry_delay = \"1.5s\"\n",
                "zfs.busy_retry_delay",
            ),
            ("[auth]\nmax_clock_skew = 300\n", "auth.max_clock_skew"),
            (
                "[agent]\nnode_subnet = \"10.20.0.0\"\n",
                "agent.node_subnet",
            ),
            (
                "[controlplane]\nservice_cidr = \"10.96.0.0/33\"\n",
                "controlplane.service_cidr",
            ),
            (
                "[controlplane]\nlisten = \"localhost\"\n",
                "controlplane.listen",
            ),
            (
                "[agent]\nadvertise_addr = \"10.0.0.1\"\n",
                "agent.advertise_addr",
            ),
            (
                "[agent]\nproxy_listen = \"10.0.0.1:80\"\n",
                "agent.proxy_listen",
            ),
            (
                "[agent]\nmetrics_listen = \"10.0.0.1\"\n",
                "agent.metrics_listen",
            ),
            (
                "[controlplane]\nmetrics_listen = \"localhost:9740\"\n",
                "controlplane.metrics_listen",
            ),
            ("[agent]\nproxy_threads = -1\n", "agent.proxy_threads"),
            ("[log]\nlevel = \"loud\"\n", "log.level"),
            (
                "[ingress]\ndns_provider = \"route53\"\n",
                "ingress.dns_provider",
            ),
            (
                "[ingress]\nresolvers = [\n  \"1.1.1.1:53\",\n  \"nope\",\n]\n",
                "ingress.resolvers",
            ),
            ("[zfs]\nbusy_retries = -1\n", "zfs.busy_retries"),
            ("[jail]\ndevfs_ruleset = 65536\n", "jail.devfs_ruleset"),
            ("[jail]\ndevfs_ruleset = -4\n", "jail.devfs_ruleset"),
            ("[jail]\ndevfs_ruleset = \"5\"\n", "jail.devfs_ruleset"),
            ("[jail]\ndevfs_ruleset = \"parent\"\n", "jail.devfs_ruleset"),
        ];
        for (src, key) in cases {
            let err = parse_err(src);
            assert_eq!(err.key(), Some(key), "{err}");
            assert!(
                matches!(err, ConfigError::Parse { line: Some(l), .. } if l >= 2),
                "{err}"
            );
        }
    }

    /// `jail.devfs_ruleset`: 4 by default, any ruleset 1..65535, or
    /// `"inherit"`; 0 (no ruleset, every host device in every jail) is
    /// refused with the key and what to write instead.
    #[test]
    fn devfs_ruleset_is_a_number_or_inherit_and_never_0() {
        assert_eq!(
            Config::default().jail.devfs_ruleset,
            DevfsRuleset::Number(4)
        );
        let five = Config::from_toml_str("[jail]\ndevfs_ruleset = 5\n").expect("parses");
        assert_eq!(five.jail.devfs_ruleset, DevfsRuleset::Number(5));
        five.validate().expect("a ruleset number is valid");
        let nested =
            Config::from_toml_str("[jail]\ndevfs_ruleset = \"inherit\"\n").expect("parses");
        assert_eq!(nested.jail.devfs_ruleset, DevfsRuleset::Inherit);
        nested.validate().expect("inherit is valid");
        assert_eq!(
            Config::from_toml_str(&nested.to_toml()).expect("reloads"),
            nested
        );
        let err = invalid_err("[jail]\ndevfs_ruleset = 0\n");
        assert_eq!(err.key(), Some("jail.devfs_ruleset"), "{err}");
        assert!(err.to_string().contains("every device"), "{err}");
        assert!(err.to_string().contains("\"inherit\""), "{err}");
    }

    #[test]
    fn validation_errors_name_the_key() {
        let too_long_pool = format!("[zfs]\npool = \"{}\"\n", "p".repeat(MAX_POOL_LEN + 1));
        let cases = [
            ("[agent]\nstate_dir = \"var/db/keel\"\n", "agent.state_dir"),
            ("[commands]\njail = \"jail\"\n", "commands.jail"),
            ("[commands]\ntar = \"bin/tar\"\n", "commands.tar"),
            (
                "[agent]\nbase_mirror = \"ftp://mirror.example/releases\"\n",
                "agent.base_mirror",
            ),
            (
                "[agent]\nbase_mirror = \"file://relative/dir\"\n",
                "agent.base_mirror",
            ),
            (
                "[agent]\nbase_archive = \"https://\"\n",
                "agent.base_archive",
            ),
            ("[zfs]\nbases_dir = \"keel-bases\"\n", "zfs.bases_dir"),
            (
                "[auth]\nnode_keys = [\"/a.key\", \"b.key\"]\n",
                "auth.node_keys[1]",
            ),
            (
                "[ingress]\nacme_extra_root = \"pebble.pem\"\n",
                "ingress.acme_extra_root",
            ),
            (
                "[agent]\nreconcile_interval = \"0s\"\n",
                "agent.reconcile_interval",
            ),
            ("[agent]\nusage_interval = \"0s\"\n", "agent.usage_interval"),
            (
                "[controlplane]\nservice_cidr = \"10.20.128.0/17\"\n",
                "controlplane.service_cidr",
            ),
            (
                "[controlplane]\ncluster_cidr = \"10.0.0.0/8\"\n",
                "controlplane.service_cidr",
            ),
            (
                "[agent]\nnode_subnet = \"10.96.1.0/24\"\n",
                "agent.node_subnet",
            ),
            (
                "[agent]\nnode_subnet = \"10.20.0.0/25\"\n",
                "agent.node_subnet",
            ),
            (
                "[agent]\nnode_subnet = \"10.20.0.1/24\"\n",
                "agent.node_subnet",
            ),
            (
                "[controlplane]\ndead_after = \"5s\"\n",
                "controlplane.dead_after",
            ),
            ("[agent]\nbridge = \"keelbridge012345\"\n", "agent.bridge"),
            ("[agent]\nbridge = \"Keel0\"\n", "agent.bridge"),
            ("[agent]\nbridge = \"-keel0\"\n", "agent.bridge"),
            ("[zfs]\npool = \"-o\"\n", "zfs.pool"),
            ("[zfs]\npool = \"zroot/x\"\n", "zfs.pool"),
            (&*too_long_pool, "zfs.pool"),
            ("[ingress]\nbase = \"14.2 RELEASE\"\n", "ingress.base"),
            (
                "[agent]\ncontrolplane = \"cp\"\nadvertise_addr = \"10.0.0.2:7441\"\n",
                "agent.controlplane",
            ),
            (
                "[agent]\ncontrolplane = \"cp:7440\"\n",
                "agent.advertise_addr",
            ),
            ("[agent]\nnode_id = \"Node_1\"\n", "agent.node_id"),
            ("[ctl]\ncontrolplane = \"cp:http\"\n", "ctl.controlplane"),
            (
                "[ctl]\ncontrolplane = \"cp1:7440,,cp2:7440\"\n",
                "ctl.controlplane",
            ),
            (
                "[ctl]\ncontrolplane = \"cp1:7440, cp1:7440\"\n",
                "ctl.controlplane",
            ),
            (
                "[agent]\ncontrolplane = \"cp1:7440,cp2\"\nadvertise_addr = \"10.0.0.2:7441\"\n",
                "agent.controlplane",
            ),
            (
                "[ingress]\nacme_directory = \"ftp://x\"\n",
                "ingress.acme_directory",
            ),
            ("[ingress]\nacme_contact = \"me\"\n", "ingress.acme_contact"),
            ("[ingress]\nresolvers = []\n", "ingress.resolvers"),
            ("[agent]\nproxy_threads = 65\n", "agent.proxy_threads"),
            (
                "[agent]\ncontrolplane = \"cp:7440\"\nadvertise_addr = \"10.0.0.2:7441\"\nmetrics_listen = \"0.0.0.0:7441\"\n",
                "agent.metrics_listen",
            ),
            (
                "[controlplane]\nmetrics_listen = \"0.0.0.0:7440\"\n",
                "controlplane.metrics_listen",
            ),
            (
                "[ingress]\npublic_interface = \"em 0\"\n",
                "ingress.public_interface",
            ),
        ];
        for (src, key) in cases {
            let err = invalid_err(src);
            assert_eq!(err.key(), Some(key), "{src}: {err}");
            assert!(err.to_string().starts_with(key), "{err}");
        }
    }

    /// The longest pool still leaves every dataset and snapshot name Keel
    /// builds from it within ZFS's 255 bytes, with the longest base and the
    /// longest jail or volume name.
    #[test]
    fn the_longest_pool_keeps_every_dataset_name_valid_for_zfs() {
        let pool = "p".repeat(MAX_POOL_LEN);
        let mut config = Config::default();
        config.zfs.pool = pool.clone();
        config.validate().expect("the longest pool is valid");
        let base = "b".repeat(MAX_BASE_LEN);
        let name = "n".repeat(names::MAX_NAME_LEN);
        for dataset in [
            format!("{pool}/keel/bases/{base}@keel"),
            format!("{pool}/keel/jails/{name}"),
            format!("{pool}/keel/volumes/{name}"),
        ] {
            assert!(dataset.len() <= names::MAX_DATASET_NAME, "{dataset}");
        }
        assert_eq!(
            format!("{pool}/keel/bases/{base}@keel").len(),
            names::MAX_DATASET_NAME
        );
    }

    #[test]
    fn socket_path_longer_than_sun_path_is_refused() {
        let long = format!("/{}", "s".repeat(MAX_SOCKET_PATH));
        let err = invalid_err(&format!("[agent]\nsocket = \"{long}\"\n"));
        assert_eq!(err.key(), Some("agent.socket"));
        let fits = format!("/{}", "s".repeat(MAX_SOCKET_PATH - 1));
        let config =
            Config::from_toml_str(&format!("[agent]\nsocket = \"{fits}\"\n")).expect("parses");
        config.validate().expect("103 bytes fit");
    }

    #[test]
    fn clustered_agent_and_optional_values_validate() {
        let src = "[agent]\ncontrolplane = \"cp.example.org:7440\"\nadvertise_addr = \"10.0.0.2:7441\"\nnode_id = \"node-1\"\n\
                   [ingress]\npublic_interface = \"igb0.100\"\npublic_address = \"192.0.2.7\"\nacme_contact = \"ops@example.org\"\n\
                   acme_extra_root = \"/etc/pebble.pem\"\n";
        let config = Config::from_toml_str(src).expect("parses");
        config.validate().expect("valid");
        assert_eq!(
            config.agent.controlplane.as_deref(),
            Some("cp.example.org:7440")
        );
        assert_eq!(
            config.ingress.acme_extra_root.as_deref(),
            Some(Path::new("/etc/pebble.pem"))
        );
        assert_eq!(
            Config::from_toml_str(&config.to_toml()).expect("reloads"),
            config
        );
    }

    #[test]
    fn intervals_parse_and_print() {
        for (text, d, printed) in [
            ("500ms", Duration::from_millis(500), "500ms"),
            ("5s", Duration::from_secs(5), "5s"),
            ("1m", Duration::from_secs(60), "1m"),
            ("2h", Duration::from_secs(7200), "2h"),
            ("300s", Duration::from_secs(300), "5m"),
            ("1500ms", Duration::from_millis(1500), "1500ms"),
            ("0s", Duration::ZERO, "0s"),
        ] {
            let i: Interval = text.parse().expect("parses");
            assert_eq!(i.0, d);
            assert_eq!(i.to_string(), printed);
        }
        for bad in [
            "",
            "5",
            "s",
            "5 s",
            "-5s",
            "1.5s",
            "5d",
            "5S",
            "99999999999999999999s",
        ] {
            assert!(bad.parse::<Interval>().is_err(), "{bad:?} parsed");
        }
        assert!(
            "307445734561825861m".parse::<Interval>().is_err(),
            "overflow"
        );
    }

    proptest::proptest! {
        #[test]
        fn interval_display_parses_back(ns in 0u64..u64::MAX) {
            let i = Interval(Duration::from_nanos(ns));
            proptest::prop_assert_eq!(i.to_string().parse::<Interval>(), Ok(i));
        }
    }

    #[test]
    fn set_key_parses_like_the_file() {
        let mut config = Config::default();
        config
            .set_key("agent.state_dir", "/srv/keel")
            .expect("path");
        config
            .set_key("agent.reconcile_interval", "2s")
            .expect("duration");
        config.set_key("zfs.busy_retries", "9").expect("integer");
        config
            .set_key("agent.advertise_addr", "10.0.0.2:7441")
            .expect("addr");
        config.set_key("log.level", "debug").expect("level");
        config
            .set_key(
                "controlplane.etcd_endpoints",
                "http://10.0.0.5:2379, http://10.0.0.6:2379",
            )
            .expect("a list, comma-separated");
        assert_eq!(
            config.controlplane.etcd_endpoints,
            ["http://10.0.0.5:2379", "http://10.0.0.6:2379"]
        );
        assert_eq!(config.agent.state_dir, Path::new("/srv/keel"));
        assert_eq!(config.agent.reconcile_interval, Interval::secs(2));
        assert_eq!(config.zfs.busy_retries, 9);
        assert_eq!(
            config.agent.advertise_addr,
            Some("10.0.0.2:7441".parse().expect("addr"))
        );
        assert_eq!(config.log.level, LogLevel::Debug);
        config
            .set_key("agent.advertise_addr", "")
            .expect("empty unsets");
        assert_eq!(config.agent.advertise_addr, None);

        let before = config.clone();
        for (key, value) in [
            ("agent.nope", "x"),
            ("nope.state_dir", "x"),
            ("state_dir", "x"),
            ("agent.node_subnet", "10.0.0.0"),
            ("zfs.busy_retries", "many"),
            ("auth.max_clock_skew", "soon"),
        ] {
            let err = config.set_key(key, value).expect_err(key);
            assert_eq!(err.key(), Some(key), "{err}");
        }
        assert_eq!(
            config, before,
            "a failed set leaves the configuration alone"
        );
    }

    #[test]
    fn load_reports_the_file_and_missing_default_means_defaults() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("keel.toml");
        assert!(matches!(
            Config::load(&missing),
            Err(ConfigError::Read { .. })
        ));
        assert_eq!(
            Config::load_or_default(&missing).expect("defaults"),
            Config::default()
        );
        std::fs::write(&missing, "[zfs]\npool = 1\n").expect("write");
        let err = Config::load(&missing).expect_err("bad type");
        assert!(
            err.to_string()
                .starts_with(&format!("{}: line 2", missing.display())),
            "{err}"
        );
        assert!(
            Config::load_or_default(&missing).is_err(),
            "only a missing file means defaults"
        );
    }

    #[test]
    fn command_paths_cover_every_program() {
        let paths = CommandPaths::default();
        let table = toml::Value::try_from(&paths).expect("serialises");
        let keys: Vec<&str> = paths.entries().iter().map(|(k, _)| *k).collect();
        let table_keys: Vec<&str> = table
            .as_table()
            .expect("table")
            .keys()
            .map(String::as_str)
            .collect();
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, table_keys);
        let prefixed = CommandPaths::with_prefix(Path::new("/tmp/stubs"));
        assert_eq!(prefixed.jail, Path::new("/tmp/stubs/usr/sbin/jail"));
    }
}
