//! Semantic rules for specs, run on the typed value after serde has accepted its
//! shape. It owns every constraint that protects what a value later reaches: a
//! command line, a ZFS dataset name, an rctl rule, a jail.conf, an nginx config.
//! It never looks at positions (the caller places the returned field path) and
//! never checks node-local facts such as an address lying inside the node's
//! pod_cidr (the agent knows its subnet; the spec does not).

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use super::error::FieldError;
use super::types::{
    Document, ExecSpec, HealthSpec, Ingress, Jail, JailSpec, Resources, Service, UpdateSpec,
    VolumeSpec,
};
use crate::common::config::Interval;

pub use crate::common::names::MAX_REPLICAS;
/// Most CPU cores a jail may be limited to (rctl pcpu is a percentage of one core).
pub const MAX_CPU: f64 = 1024.0;
/// Smallest CPU limit: rctl pcpu counts whole percent, so 0.01 is 1 %.
pub const MIN_CPU: f64 = 0.01;
/// Longest base name: it is one component of a ZFS dataset name.
pub const MAX_BASE_LEN: usize = 64;
/// Longest mountPath: the jail's root path is prepended and FreeBSD limits a
/// mount point to 1023 bytes.
pub const MAX_MOUNT_PATH_LEN: usize = 512;

pub(crate) const PORT_RANGE: &str = "a port must be between 1 and 65535";
pub(crate) const REPLICAS_RANGE: &str = "replicas must be between 0 and 1000";
/// Most consecutive failures `health.failureThreshold` may wait for: a jail
/// is restarted after twice as many, and a larger number only hides a dead
/// workload for longer.
pub const MAX_FAILURE_THRESHOLD: u32 = 100;
pub(crate) const FAILURE_THRESHOLD_RANGE: &str = "failureThreshold must be between 1 and 100";
/// Longest `health.http.path`: it is one request line, not a document.
pub const MAX_HEALTH_PATH_LEN: usize = 1024;
/// Longest `health.interval`, `timeout` and `startPeriod`, and of a
/// Service's `drainTimeout`.
pub const MAX_HEALTH_PERIOD: Duration = Duration::from_secs(3600);
/// Longest `spec.update.progressDeadline`: a rollout that has not moved in a
/// day is stuck, whatever the workload.
pub const MAX_PROGRESS_DEADLINE: Duration = Duration::from_secs(24 * 3600);

type Check = Result<(), FieldError>;

/// What the rules found wrong with one document. A failed rule is recorded
/// and checking goes on, so an author fixes a whole file in one round; a
/// field keeps only its first problem (a name that is not a label is not
/// also reported as reserved).
#[derive(Default)]
struct Problems(Vec<FieldError>);

impl Problems {
    fn add(&mut self, check: Check) {
        if let Err(e) = check
            && !self.0.iter().any(|seen| seen.field == e.field)
        {
            self.0.push(e);
        }
    }
}

fn at(field: impl Into<String>, result: Result<(), String>) -> Check {
    result.map_err(|m| FieldError::new(field, m))
}

use crate::common::names::label_ok;
pub use crate::common::names::validate_name;

/// Checks a DNS name of at least `min_labels` labels: lowercase ASCII, each
/// label a DNS label, at most 253 characters, no wildcard, no trailing dot.
fn dns_name(name: &str, min_labels: usize) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > 253 {
        return Err(format!(
            "must be at most 253 characters, got {}",
            name.len()
        ));
    }
    if name.contains('*') {
        return Err(format!(
            "wildcards are not supported; name one host (got {name:?})"
        ));
    }
    if let Some(c) = name.chars().find(|c| c.is_ascii_uppercase()) {
        return Err(format!("must be lowercase (found {c:?} in {name:?})"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '.'))
    {
        return Err(format!(
            "may contain only lowercase letters, digits, '-' and '.' (found {c:?} in {name:?}); \
             write internationalised names in punycode (xn--...)"
        ));
    }
    if name.ends_with('.') {
        return Err(format!("must not end with '.' (got {name:?})"));
    }
    let labels: Vec<&str> = name.split('.').collect();
    if let Some(bad) = labels.iter().find(|l| !label_ok(l)) {
        return Err(format!(
            "label {bad:?} of {name:?} is not a DNS label: 1-63 lowercase letters, digits \
             and '-', starting and ending with a letter or digit"
        ));
    }
    if labels.len() < min_labels {
        return Err(format!(
            "must be a fully qualified domain name such as www.example.com (got {name:?})"
        ));
    }
    if min_labels > 1
        && labels
            .last()
            .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(format!(
            "must be a domain name, not an IP address (got {name:?})"
        ));
    }
    Ok(())
}

/// Checks an Ingress host: a lowercase ASCII FQDN of at least two labels, at
/// most 253 characters, no wildcard, no trailing dot; punycode (`xn--`) is fine.
pub fn validate_host(host: &str) -> Result<(), String> {
    dns_name(host, 2)
}

/// Checks a jail hostname: the Ingress host rules, but one label is enough.
pub fn validate_hostname(hostname: &str) -> Result<(), String> {
    dns_name(hostname, 1)
}

/// Checks a base name: `[A-Za-z0-9][A-Za-z0-9._-]*`, at most 64 characters
/// (it becomes `{pool}/keel/bases/<base>`).
pub fn validate_base(base: &str) -> Result<(), String> {
    let ok_first = base
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphanumeric());
    let ok_rest = base
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if base.is_empty() {
        return Err("must not be empty; name a base release such as 14.5-RELEASE".into());
    }
    if base.len() > MAX_BASE_LEN {
        return Err(format!(
            "must be at most {MAX_BASE_LEN} characters, got {}",
            base.len()
        ));
    }
    if !ok_first || !ok_rest {
        return Err(format!(
            "must start with a letter or digit and contain only letters, digits, '.', '_' \
             and '-' (it names the ZFS dataset {{pool}}/keel/bases/<base>); got {base:?}"
        ));
    }
    Ok(())
}

/// Checks a fixed jail address: not unspecified (0.0.0.0/8), broadcast,
/// multicast or reserved (240.0.0.0/4). Loopback is allowed: simulate mode
/// addresses jails from 127.64.0.0/10.
pub fn validate_address(addr: Ipv4Addr) -> Result<(), String> {
    let first = addr.octets()[0];
    if first == 0 {
        return Err(format!("{addr} is not a host address (0.0.0.0/8)"));
    }
    if addr.is_broadcast() {
        return Err(format!("{addr} is the broadcast address"));
    }
    if addr.is_multicast() {
        return Err(format!("{addr} is a multicast address"));
    }
    if first >= 240 {
        return Err(format!("{addr} is in the reserved range 240.0.0.0/4"));
    }
    Ok(())
}

/// Checks a volume mountPath: absolute, normalised (no `//`, no trailing `/`,
/// no `.` or `..` components), not `/`, no whitespace or control characters
/// (mount -p could not report it unambiguously), at most
/// [`MAX_MOUNT_PATH_LEN`] bytes.
pub fn validate_mount_path(path: &Path) -> Result<(), String> {
    let Some(s) = path.to_str() else {
        return Err("must be valid UTF-8".into());
    };
    if s.is_empty() {
        return Err("must not be empty; give an absolute path such as /var/db/data".into());
    }
    if !s.starts_with('/') {
        return Err(format!(
            "must be an absolute path (start with '/'), got {s:?}"
        ));
    }
    if s == "/" {
        return Err("must not be '/': a volume cannot replace the jail's root".into());
    }
    if s.len() > MAX_MOUNT_PATH_LEN {
        return Err(format!(
            "must be at most {MAX_MOUNT_PATH_LEN} bytes, got {}",
            s.len()
        ));
    }
    if let Some(c) = s.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "must not contain whitespace or control characters (found {c:?} in {s:?})"
        ));
    }
    if s.contains("//") {
        return Err(format!("must be normalised: no '//' (got {s:?})"));
    }
    if s.ends_with('/') {
        return Err(format!("must be normalised: no trailing '/' (got {s:?})"));
    }
    if s.split('/').any(|c| c == "." || c == "..") {
        return Err(format!(
            "must not contain '.' or '..' components (got {s:?})"
        ));
    }
    Ok(())
}

fn argv(field: &str, args: &[String], required: bool) -> Check {
    if args.is_empty() {
        if required {
            return Err(FieldError::new(
                field,
                "must name at least the program to run, e.g. [\"/bin/sh\", \"/etc/rc\"]",
            ));
        }
        return Ok(());
    }
    for (i, arg) in args.iter().enumerate() {
        let f = format!("{field}[{i}]");
        if i == 0 && arg.is_empty() {
            return Err(FieldError::new(
                f,
                "must not be empty: it is the program to run",
            ));
        }
        // The jail's exec.start runs the program through env(1) to pass the
        // spec's environment; env reads a first word containing `=` as one
        // more variable, not as the program.
        if i == 0 && arg.contains('=') {
            return Err(FieldError::new(
                f,
                "the program must not contain '='; put variables in spec.env",
            ));
        }
        if let Some(c) = arg.chars().find(|c| c.is_control()) {
            return Err(FieldError::new(
                f,
                format!("must not contain NUL, newline or other control characters (found {c:?})"),
            ));
        }
    }
    Ok(())
}

fn exec(p: &str, e: &ExecSpec, out: &mut Problems) {
    out.add(argv(&format!("{p}.exec.start"), &e.start, true));
    out.add(argv(&format!("{p}.exec.stop"), &e.stop, false));
}

fn shell_identifier(key: &str) -> bool {
    let b = key.as_bytes();
    b.first()
        .is_some_and(|c| c.is_ascii_alphabetic() || *c == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

fn cpu(field: String, cpu: f64) -> Check {
    if !cpu.is_finite() {
        return Err(FieldError::new(field, "must be a finite number of cores"));
    }
    if cpu <= 0.0 {
        return Err(FieldError::new(
            field,
            format!("must be greater than 0, got {cpu}"),
        ));
    }
    if cpu < MIN_CPU {
        return Err(FieldError::new(
            field,
            format!(
                "must be at least {MIN_CPU} (rctl pcpu counts whole percent of a core), got {cpu}"
            ),
        ));
    }
    if cpu > MAX_CPU {
        return Err(FieldError::new(
            field,
            format!("must be at most {MAX_CPU} cores, got {cpu}"),
        ));
    }
    Ok(())
}

fn resources(p: &str, r: &Resources, out: &mut Problems) {
    if let Some(c) = r.cpu {
        out.add(cpu(format!("{p}.resources.cpu"), c));
    }
    if r.memory == Some(0) {
        out.add(Err(FieldError::new(
            format!("{p}.resources.memory"),
            "must be greater than zero; leave memory out for no limit",
        )));
    }
}

fn env(p: &str, key: &str, value: &str) -> Check {
    let f = format!("{p}.env.{key}");
    if !shell_identifier(key) {
        return Err(FieldError::new(
            f,
            format!(
                "environment variable names must be shell identifiers: letters, digits \
                 and '_', not starting with a digit (got {key:?})"
            ),
        ));
    }
    if value.contains('\0') {
        return Err(FieldError::new(f, "must not contain NUL bytes"));
    }
    Ok(())
}

fn volumes(p: &str, vols: &[VolumeSpec], out: &mut Problems) {
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut paths: HashMap<&Path, usize> = HashMap::new();
    for (i, v) in vols.iter().enumerate() {
        let f = format!("{p}.volumes[{i}]");
        out.add(at(format!("{f}.name"), validate_name(&v.name)));
        out.add(at(
            format!("{f}.mountPath"),
            validate_mount_path(&v.mount_path),
        ));
        if v.size == Some(0) {
            out.add(Err(FieldError::new(
                format!("{f}.size"),
                "must be greater than zero; leave size out for no quota",
            )));
        }
        if let Some(j) = names.insert(&v.name, i) {
            out.add(Err(FieldError::new(
                format!("{f}.name"),
                format!("duplicate volume name {:?} (also {p}.volumes[{j}])", v.name),
            )));
        }
        if let Some(j) = paths.insert(&v.mount_path, i) {
            out.add(Err(FieldError::new(
                format!("{f}.mountPath"),
                format!(
                    "duplicate mountPath {:?} (also {p}.volumes[{j}])",
                    v.mount_path.to_string_lossy()
                ),
            )));
        }
    }
}

/// Checks `health.http.path`: absolute, printable ASCII without spaces (it is
/// written into a request line as it stands), at most
/// [`MAX_HEALTH_PATH_LEN`] bytes.
pub fn validate_health_path(path: &str) -> Result<(), String> {
    if !path.starts_with('/') {
        return Err(format!(
            "must be an absolute request path such as /healthz, got {path:?}"
        ));
    }
    if path.len() > MAX_HEALTH_PATH_LEN {
        return Err(format!(
            "must be at most {MAX_HEALTH_PATH_LEN} bytes, got {}",
            path.len()
        ));
    }
    if let Some(c) = path.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "must be printable ASCII without spaces (found {c:?}); percent-encode it"
        ));
    }
    Ok(())
}

fn period(field: String, value: Interval, zero_ok: bool) -> Check {
    if !zero_ok && value.0.is_zero() {
        return Err(FieldError::new(field, "must be greater than 0s, e.g. 5s"));
    }
    if value.0 > MAX_HEALTH_PERIOD {
        return Err(FieldError::new(
            field,
            format!("must be at most 1h, got {value}"),
        ));
    }
    Ok(())
}

fn port(field: String, port: u16) -> Check {
    if port == 0 {
        return Err(FieldError::new(
            field,
            format!("0 is out of range: {PORT_RANGE}"),
        ));
    }
    Ok(())
}

fn one_probe(f: &str, h: &HealthSpec) -> Check {
    let set: Vec<&str> = [
        ("http", h.http.is_some()),
        ("tcp", h.tcp.is_some()),
        ("exec", h.exec.is_some()),
    ]
    .into_iter()
    .filter_map(|(name, set)| set.then_some(name))
    .collect();
    match set.as_slice() {
        [] => Err(FieldError::new(
            f,
            "must set one probe: http: {port, path}, tcp: {port} or exec: [argv]",
        )),
        [_] => Ok(()),
        [_, second, ..] => Err(FieldError::new(
            format!("{f}.{second}"),
            format!(
                "only one probe may be set, got {}; keep one",
                set.join(" and ")
            ),
        )),
    }
}

fn health(p: &str, h: &HealthSpec, out: &mut Problems) {
    let f = format!("{p}.health");
    out.add(one_probe(&f, h));
    if let Some(http) = &h.http {
        out.add(port(format!("{f}.http.port"), http.port));
        out.add(at(
            format!("{f}.http.path"),
            validate_health_path(&http.path),
        ));
    }
    if let Some(tcp) = &h.tcp {
        out.add(port(format!("{f}.tcp.port"), tcp.port));
    }
    if let Some(argv_) = &h.exec {
        out.add(argv(&format!("{f}.exec"), argv_, true));
    }
    let interval = period(format!("{f}.interval"), h.interval, false);
    let timeout = period(format!("{f}.timeout"), h.timeout, false);
    // Comparing them only means something once both are in range.
    let comparable = interval.is_ok() && timeout.is_ok();
    out.add(interval);
    out.add(timeout);
    out.add(period(format!("{f}.startPeriod"), h.start_period, true));
    if comparable && h.timeout > h.interval {
        out.add(Err(FieldError::new(
            format!("{f}.timeout"),
            format!(
                "must not be longer than interval ({}), got {}: a probe must end before the next one",
                h.interval, h.timeout
            ),
        )));
    }
    if h.failure_threshold == 0 {
        out.add(Err(FieldError::new(
            format!("{f}.failureThreshold"),
            format!("0 is out of range: {FAILURE_THRESHOLD_RANGE}"),
        )));
    }
}

/// The rules shared by a Jail's spec and a Service's template; `p` is the path
/// of the spec (`spec` or `spec.template`).
fn jail_body(p: &str, s: &JailSpec, out: &mut Problems) {
    out.add(at(format!("{p}.base"), validate_base(&s.base)));
    if let Some(h) = &s.hostname {
        out.add(at(format!("{p}.hostname"), validate_hostname(h)));
    }
    if let Some(a) = s.network.address {
        out.add(at(format!("{p}.network.address"), validate_address(a)));
    }
    resources(p, &s.resources, out);
    exec(p, &s.exec, out);
    for (k, v) in &s.env {
        out.add(env(p, k, v));
    }
    volumes(p, &s.volumes, out);
    if let Some(h) = &s.health {
        health(p, h, out);
    }
}

use crate::common::names::{MAX_NAME_LEN, RESERVED_PREFIX, replica_name, replica_volume_name};

fn not_reserved(name: &str) -> Result<(), String> {
    if name.starts_with(RESERVED_PREFIX) {
        return Err(format!(
            "{name:?} starts with {RESERVED_PREFIX:?}, which is reserved for the jails Keel runs itself (keel-ingress); choose another name"
        ));
    }
    Ok(())
}

fn jail(j: &Jail, out: &mut Problems) {
    out.add(at("metadata.name", validate_name(&j.metadata.name)));
    out.add(at("metadata.name", not_reserved(&j.metadata.name)));
    jail_body("spec", &j.spec, out);
}

fn service_name(name: &str) -> Check {
    at("metadata.name", validate_name(name))?;
    at("metadata.name", not_reserved(name))?;
    if let Some(why) = crate::common::names::reserved_for_replicas(name) {
        return Err(FieldError::new("metadata.name", why));
    }
    Ok(())
}

fn replicas(n: u32) -> Check {
    if n > MAX_REPLICAS {
        return Err(FieldError::new(
            "spec.replicas",
            format!("{n} is out of range: {REPLICAS_RANGE}"),
        ));
    }
    Ok(())
}

fn service(s: &Service, out: &mut Problems) {
    let name = &s.metadata.name;
    let name_ok = service_name(name);
    let replicas_ok = replicas(s.spec.replicas);
    // The derived names below are only worth checking for a valid name and
    // replica count; otherwise they repeat those two errors.
    let derive = name_ok.is_ok() && replicas_ok.is_ok();
    out.add(name_ok);
    out.add(replicas_ok);
    let spec = &s.spec;
    out.add(port("spec.port".into(), spec.port));
    update(&spec.update, spec.drain_timeout, out);
    let t = &spec.template;
    if t.network.address.is_some() {
        out.add(Err(FieldError::new(
            "spec.template.network.address",
            "must not be set in a Service template: every replica gets its own address \
             from its node's pod_cidr",
        )));
    }
    let as_spec = JailSpec {
        base: t.base.clone(),
        hostname: t.hostname.clone(),
        network: t.network.clone(),
        resources: t.resources.clone(),
        exec: t.exec.clone(),
        env: t.env.clone(),
        volumes: t.volumes.clone(),
        health: t.health.clone(),
    };
    jail_body("spec.template", &as_spec, out);
    if derive {
        derived_names(s, out);
    }
}

/// The longest replica name decides whether every derived name is still a
/// valid jail and dataset name (it always holds a `-`, so it is never all
/// digits; only its length can fail).
fn derived_names(s: &Service, out: &mut Problems) {
    let name = &s.metadata.name;
    let last = replica_name(name, s.spec.replicas.saturating_sub(1));
    if validate_name(&last).is_err() {
        out.add(Err(FieldError::new(
            "metadata.name",
            format!(
                "replica name {last:?} would be longer than {MAX_NAME_LEN} characters; shorten the \
                 service name"
            ),
        )));
        return;
    }
    for (i, v) in s.spec.template.volumes.iter().enumerate() {
        let derived = replica_volume_name(&last, &v.name);
        if validate_name(&v.name).is_ok() && validate_name(&derived).is_err() {
            out.add(Err(FieldError::new(
                format!("spec.template.volumes[{i}].name"),
                format!(
                    "per-replica volume name {derived:?} would be longer than {MAX_NAME_LEN} \
                     characters; shorten the volume or service name"
                ),
            )));
        }
    }
}

/// `spec.update` and `spec.drainTimeout`. Both budgets 0 would let no
/// replica be replaced, so the rollout could never move.
fn update(u: &UpdateSpec, drain_timeout: Interval, out: &mut Problems) {
    if u.max_unavailable == 0 && u.max_surge == 0 {
        out.add(Err(FieldError::new(
            "spec.update.maxUnavailable",
            "maxUnavailable and maxSurge are both 0, so no replica could ever be replaced; \
             allow one replica down (maxUnavailable: 1) or one extra (maxSurge: 1)",
        )));
    }
    for (field, value) in [
        ("spec.update.maxUnavailable", u.max_unavailable),
        ("spec.update.maxSurge", u.max_surge),
    ] {
        if value > MAX_REPLICAS {
            out.add(Err(FieldError::new(
                field,
                format!("{value} is out of range: {REPLICAS_RANGE}"),
            )));
        }
    }
    out.add(progress_deadline(u.progress_deadline));
    if drain_timeout.0 > MAX_HEALTH_PERIOD {
        out.add(Err(FieldError::new(
            "spec.drainTimeout",
            format!("must be at most 1h, got {drain_timeout}"),
        )));
    }
}

fn progress_deadline(deadline: Interval) -> Check {
    if deadline.0.is_zero() {
        return Err(FieldError::new(
            "spec.update.progressDeadline",
            "must be greater than 0s, e.g. 10m",
        ));
    }
    if deadline.0 > MAX_PROGRESS_DEADLINE {
        return Err(FieldError::new(
            "spec.update.progressDeadline",
            format!("must be at most 24h, got {deadline}"),
        ));
    }
    Ok(())
}

fn ingress(i: &Ingress, out: &mut Problems) {
    out.add(at("metadata.name", validate_name(&i.metadata.name)));
    out.add(at("spec.host", validate_host(&i.spec.host)));
    out.add(at("spec.service", validate_name(&i.spec.service)));
}

/// Every problem of one document, in the order the rules check its fields;
/// empty when it is valid.
pub(crate) fn document(d: &Document) -> Vec<FieldError> {
    let mut out = Problems::default();
    match d {
        Document::Jail(j) => jail(j, &mut out),
        Document::Service(s) => service(s, &mut out),
        Document::Ingress(i) => ingress(i, &mut out),
    }
    out.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels() {
        for good in ["a", "web-1", "0a", &"a".repeat(63)] {
            assert_eq!(validate_name(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "Web",
            "a_b",
            "a.b",
            "é",
            "0",
            "123",
            &"a".repeat(64),
        ] {
            assert!(validate_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn hosts_are_lowercase_fqdns() {
        for good in ["www.example.com", "xn--bcher-kva.example", "a.b"] {
            assert_eq!(validate_host(good), Ok(()), "{good}");
        }
        let long = format!("{}.com", vec!["a".repeat(63); 4].join("."));
        for bad in [
            "example",
            "*.example.com",
            "WWW.example.com",
            "www.example.com.",
            "a..b",
            "a b.com",
            "a;b.com",
            "a{b.com",
            "a\"b.com",
            "a'b.com",
            "bücher.example",
            "1.2.3.4",
            "-a.com",
            &long,
        ] {
            assert!(validate_host(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(validate_hostname("web-1"), Ok(()));
        assert!(validate_hostname("web_1").is_err());
    }

    #[test]
    fn addresses() {
        for good in ["10.20.3.15", "127.64.0.2", "192.168.1.1"] {
            assert_eq!(validate_address(good.parse().expect("ip")), Ok(()));
        }
        for bad in [
            "0.0.0.0",
            "0.1.2.3",
            "255.255.255.255",
            "224.0.0.1",
            "240.0.0.1",
        ] {
            assert!(validate_address(bad.parse().expect("ip")).is_err(), "{bad}");
        }
    }

    #[test]
    fn mount_paths() {
        assert_eq!(validate_mount_path(Path::new("/var/db/postgres")), Ok(()));
        for bad in [
            "", "data", "/", "/a//b", "/a/", "/a/./b", "/a/../b", "/..", "/a b", "/a\nb",
        ] {
            assert!(
                validate_mount_path(Path::new(bad)).is_err(),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn bases() {
        assert_eq!(validate_base("14.5-RELEASE"), Ok(()));
        for bad in ["", ".x", "-x", "a/b", "a b", "a@b", &"a".repeat(65)] {
            assert!(validate_base(bad).is_err(), "{bad:?} accepted");
        }
    }
}
