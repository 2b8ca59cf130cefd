//! The typed form of the three spec kinds and their serde shape. It owns field
//! names, defaults and the YAML/JSON round trip; it never validates (a value of
//! these types is only known good once `validate.rs` has passed it) and never
//! looks at positions.
//!
//! Serialisation writes sizes as plain byte integers and leaves out empty
//! optional fields, so what the agent persists or sends parses back to an equal
//! value.

use std::collections::BTreeMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use super::quantity::deserialize_size;
use crate::common::config::Interval;

/// `metadata`: the object's name, a DNS label (see [`super::validate_name`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    /// `[a-z0-9]([a-z0-9-]*[a-z0-9])?`, at most 63 characters.
    pub name: String,
}

/// `kind: Jail`: one jail on one node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Jail {
    /// The jail's name.
    pub metadata: Metadata,
    /// What the jail runs and with what.
    pub spec: JailSpec,
}

impl Jail {
    /// The hostname the jail gets: `spec.hostname`, or the jail's name.
    pub fn hostname(&self) -> &str {
        self.spec.hostname.as_deref().unwrap_or(&self.metadata.name)
    }
}

/// `spec` of a Jail.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JailSpec {
    /// Base release; the root is cloned from `{pool}/keel/bases/<base>@keel`.
    pub base: String,
    /// Hostname inside the jail; defaults to the jail's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Addressing; empty means auto-assigned from the node's pod_cidr.
    #[serde(default, skip_serializing_if = "NetworkSpec::is_empty")]
    pub network: NetworkSpec,
    /// rctl limits; empty means unlimited.
    #[serde(default, skip_serializing_if = "Resources::is_empty")]
    pub resources: Resources,
    /// Start and stop commands.
    pub exec: ExecSpec,
    /// Environment of exec.start and exec.stop.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Persistent volumes mounted into the jail.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeSpec>,
    /// How the agent tells that the workload serves; `None` means the jail
    /// is ready while its process runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthSpec>,
}

/// `spec.health`: one probe (exactly one of `http`, `tcp`, `exec`; validation
/// refuses none or several) and its timing. A jail is ready after its first
/// success, stops being ready after `failureThreshold` consecutive failures,
/// and is restarted after as many more.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthSpec {
    /// `GET path` on the jail's address and `port`; any 2xx or 3xx passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpProbe>,
    /// A TCP connect to the jail's address and `port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<TcpProbe>,
    /// An argv run inside the jail (jexec); exit status 0 passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec: Option<Vec<String>>,
    /// Time between two probes; default 5s.
    #[serde(
        default = "default_health_interval",
        deserialize_with = "deserialize_interval"
    )]
    pub interval: Interval,
    /// How long one probe may take before it counts as failed; default 2s.
    #[serde(
        default = "default_health_timeout",
        deserialize_with = "deserialize_interval"
    )]
    pub timeout: Interval,
    /// Consecutive failures that make the jail not ready; default 3.
    #[serde(
        rename = "failureThreshold",
        default = "default_failure_threshold",
        deserialize_with = "deserialize_failure_threshold"
    )]
    pub failure_threshold: u32,
    /// Failures this soon after the workload started do not count; default 0s.
    #[serde(
        rename = "startPeriod",
        default,
        deserialize_with = "deserialize_interval"
    )]
    pub start_period: Interval,
}

/// The probe kinds of [`HealthSpec`], once validation made sure there is one.
#[derive(Debug, Clone, PartialEq)]
pub enum Probe<'a> {
    /// `health.http`.
    Http(&'a HttpProbe),
    /// `health.tcp`.
    Tcp(&'a TcpProbe),
    /// `health.exec`.
    Exec(&'a [String]),
}

impl HealthSpec {
    /// The one probe set (`http` first when validation was skipped).
    pub fn probe(&self) -> Option<Probe<'_>> {
        if let Some(h) = &self.http {
            return Some(Probe::Http(h));
        }
        if let Some(t) = &self.tcp {
            return Some(Probe::Tcp(t));
        }
        self.exec.as_deref().map(Probe::Exec)
    }
}

/// `health.http`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpProbe {
    /// Port on the jail's address.
    #[serde(deserialize_with = "deserialize_port")]
    pub port: u16,
    /// Absolute request path; default `/`.
    #[serde(default = "root_path")]
    pub path: String,
}

/// `health.tcp`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpProbe {
    /// Port on the jail's address.
    #[serde(deserialize_with = "deserialize_port")]
    pub port: u16,
}

fn default_health_interval() -> Interval {
    Interval::secs(5)
}

fn default_health_timeout() -> Interval {
    Interval::secs(2)
}

fn default_failure_threshold() -> u32 {
    3
}

fn root_path() -> String {
    "/".to_string()
}

/// `spec.network`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// Fixed address inside the node's pod_cidr; `None` means auto-assigned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<Ipv4Addr>,
}

impl NetworkSpec {
    /// True when nothing is set (serialisation leaves the section out).
    pub fn is_empty(&self) -> bool {
        self.address.is_none()
    }
}

/// `spec.resources`: rctl limits.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// CPU cores (1.5 = 150 % of one core), rctl `pcpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
    /// Memory in bytes, rctl `memoryuse`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "deserialize_size"
    )]
    pub memory: Option<u64>,
}

impl Resources {
    /// True when no limit is set (serialisation leaves the section out).
    pub fn is_empty(&self) -> bool {
        self.cpu.is_none() && self.memory.is_none()
    }
}

/// `spec.exec`: argv lists, never shell strings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecSpec {
    /// The jail's main command (jail(8) `exec.start`); at least the program.
    pub start: Vec<String>,
    /// Run when the jail is stopped (jail(8) `exec.stop`); may be empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
}

/// One entry of `spec.volumes`: a ZFS dataset `{pool}/keel/volumes/<name>`
/// nullfs-mounted at `mountPath` inside the jail.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeSpec {
    /// Dataset name, a DNS label.
    pub name: String,
    /// Absolute, normalised path inside the jail (`mountPath` in YAML).
    #[serde(rename = "mountPath", serialize_with = "serialize_path")]
    pub mount_path: PathBuf,
    /// ZFS quota in bytes; `None` means no quota.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "deserialize_size"
    )]
    pub size: Option<u64>,
}

/// `kind: Service`: `replicas` jails from one template behind a virtual IP.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Service {
    /// The service's name; replicas are `<name>-0` .. `<name>-<replicas-1>`.
    pub metadata: Metadata,
    /// Replica count, port and template.
    pub spec: ServiceSpec,
}

/// `spec` of a Service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    /// Number of replicas, 0..=[`super::MAX_REPLICAS`]; defaults to 1.
    #[serde(default = "one_replica", deserialize_with = "deserialize_replicas")]
    pub replicas: u32,
    /// TCP port the VIP listens on and the replicas serve; immutable once created.
    #[serde(deserialize_with = "deserialize_port")]
    pub port: u16,
    /// The spec every replica is made from. A change rolls out replica by
    /// replica under `update`; its volumes cannot change.
    pub template: JailTemplate,
    /// How a template change rolls out.
    #[serde(default, skip_serializing_if = "UpdateSpec::is_default")]
    pub update: UpdateSpec,
    /// How long a replica leaving the rotation (scale down, update, delete)
    /// may keep its open connections before it is stopped; default 10s.
    #[serde(
        rename = "drainTimeout",
        default = "default_drain_timeout",
        deserialize_with = "deserialize_interval",
        skip_serializing_if = "is_default_drain_timeout"
    )]
    pub drain_timeout: Interval,
}

fn one_replica() -> u32 {
    1
}

fn default_drain_timeout() -> Interval {
    Interval::secs(10)
}

fn is_default_drain_timeout(i: &Interval) -> bool {
    *i == default_drain_timeout()
}

/// `spec.update` of a Service: the pace of a rolling update, as a
/// Kubernetes Deployment's `RollingUpdate` strategy states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateSpec {
    /// Replicas that may be not ready because of the update; default 1.
    #[serde(
        rename = "maxUnavailable",
        default = "one_replica",
        deserialize_with = "deserialize_replica_count"
    )]
    pub max_unavailable: u32,
    /// Replicas that may run above `replicas` during the update; default 0.
    #[serde(
        rename = "maxSurge",
        default,
        deserialize_with = "deserialize_replicas"
    )]
    pub max_surge: u32,
    /// A new replica that is not ready this long stops the rollout; the
    /// replicas not yet replaced stay on the old template. Default 10m.
    #[serde(
        rename = "progressDeadline",
        default = "default_progress_deadline",
        deserialize_with = "deserialize_interval"
    )]
    pub progress_deadline: Interval,
}

fn default_progress_deadline() -> Interval {
    Interval::secs(600)
}

impl Default for UpdateSpec {
    fn default() -> UpdateSpec {
        UpdateSpec {
            max_unavailable: 1,
            max_surge: 0,
            progress_deadline: default_progress_deadline(),
        }
    }
}

impl UpdateSpec {
    fn is_default(&self) -> bool {
        *self == UpdateSpec::default()
    }
}

/// `spec.template` of a Service: a Jail spec without `network.address` (each
/// replica is addressed by its node).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JailTemplate {
    /// As [`JailSpec::base`].
    pub base: String,
    /// As [`JailSpec::hostname`]; unset means each replica uses its own name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// As [`JailSpec::network`]; `address` is refused by validation.
    #[serde(default, skip_serializing_if = "NetworkSpec::is_empty")]
    pub network: NetworkSpec,
    /// As [`JailSpec::resources`], per replica.
    #[serde(default, skip_serializing_if = "Resources::is_empty")]
    pub resources: Resources,
    /// As [`JailSpec::exec`].
    pub exec: ExecSpec,
    /// As [`JailSpec::env`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Per-replica volumes: each is renamed `<replica>-<volume>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeSpec>,
    /// As [`JailSpec::health`]: every replica is probed on its own address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthSpec>,
}

impl JailTemplate {
    /// The Jail for one replica: named `replica_name`, every template volume
    /// renamed `{replica_name}-{volume}` so replicas never share data.
    pub fn to_jail_spec(&self, replica_name: &str) -> Jail {
        Jail {
            metadata: Metadata {
                name: replica_name.to_string(),
            },
            spec: JailSpec {
                base: self.base.clone(),
                hostname: self.hostname.clone(),
                network: self.network.clone(),
                resources: self.resources.clone(),
                exec: self.exec.clone(),
                env: self.env.clone(),
                volumes: self
                    .volumes
                    .iter()
                    .map(|v| VolumeSpec {
                        name: crate::common::names::replica_volume_name(replica_name, &v.name),
                        ..v.clone()
                    })
                    .collect(),
                health: self.health.clone(),
            },
        }
    }

    /// True when replicas carry volumes, which pins them to their nodes.
    pub fn has_volumes(&self) -> bool {
        !self.volumes.is_empty()
    }
}

/// `kind: Ingress`: public HTTPS for one host, proxied to a Service's VIP.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ingress {
    /// The ingress's name.
    pub metadata: Metadata,
    /// Host and backend.
    pub spec: IngressSpec,
}

/// `spec` of an Ingress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngressSpec {
    /// One lowercase FQDN, no wildcard; the certificate's name.
    pub host: String,
    /// Backend Service on the same node.
    pub service: String,
}

/// Any spec document; serialises with its `kind` tag.
///
/// The derived `Deserialize` does not validate: use it only for values Keel wrote
/// itself (its state file). Text from users goes through
/// [`super::parse_documents`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind")]
pub enum Document {
    /// `kind: Jail`.
    Jail(Jail),
    /// `kind: Service`.
    Service(Service),
    /// `kind: Ingress`.
    Ingress(Ingress),
}

impl Document {
    /// `"Jail"`, `"Service"` or `"Ingress"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Document::Jail(_) => "Jail",
            Document::Service(_) => "Service",
            Document::Ingress(_) => "Ingress",
        }
    }

    /// `metadata.name`.
    pub fn name(&self) -> &str {
        match self {
            Document::Jail(j) => &j.metadata.name,
            Document::Service(s) => &s.metadata.name,
            Document::Ingress(i) => &i.metadata.name,
        }
    }
}

// Lossy so serialisation cannot fail; validation already refuses non-UTF-8 paths.
fn serialize_path<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&path.to_string_lossy())
}

/// An integer field whose out-of-range message should say the range, not
/// "expected u16". Raised inside the visitor so the error carries the scalar's
/// position.
struct BoundedInt {
    max: u64,
    what: &'static str,
}

impl Visitor<'_> for BoundedInt {
    type Value = u64;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.what)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        if v > self.max {
            return Err(E::custom(format!("{v} is out of range: {}", self.what)));
        }
        Ok(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(E::custom(format!("{v} is out of range: {}", self.what))),
        }
    }
}

fn deserialize_port<'de, D: Deserializer<'de>>(d: D) -> Result<u16, D::Error> {
    let v = d.deserialize_any(BoundedInt {
        max: u64::from(u16::MAX),
        what: super::validate::PORT_RANGE,
    })?;
    u16::try_from(v).map_err(de::Error::custom)
}

/// A duration with a unit (`"5s"`), as keel.toml writes them. Raised inside
/// the visitor, like every scalar error here, so it carries the scalar's
/// position and a bare number is told what to write.
fn deserialize_interval<'de, D: Deserializer<'de>>(d: D) -> Result<Interval, D::Error> {
    struct IntervalVisitor;
    impl Visitor<'_> for IntervalVisitor {
        type Value = Interval;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a duration such as 500ms, 5s or 1m")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Interval, E> {
            v.parse().map_err(E::custom)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Interval, E> {
            self.visit_str(&v.to_string())
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Interval, E> {
            self.visit_str(&v.to_string())
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Interval, E> {
            self.visit_str(&v.to_string())
        }
    }
    d.deserialize_any(IntervalVisitor)
}

fn deserialize_failure_threshold<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let v = d.deserialize_any(BoundedInt {
        max: u64::from(super::validate::MAX_FAILURE_THRESHOLD),
        what: super::validate::FAILURE_THRESHOLD_RANGE,
    })?;
    u32::try_from(v).map_err(de::Error::custom)
}

fn deserialize_replica_count<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let v = d.deserialize_any(BoundedInt {
        max: u64::from(super::validate::MAX_REPLICAS),
        what: "must be a number of replicas between 0 and 1000",
    })?;
    u32::try_from(v).map_err(de::Error::custom)
}

fn deserialize_replicas<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let v = d.deserialize_any(BoundedInt {
        max: u64::from(u32::MAX),
        what: super::validate::REPLICAS_RANGE,
    })?;
    u32::try_from(v).map_err(de::Error::custom)
}
