//! What keelctl prints: the jail, node, service, replica, volume and ingress
//! tables, ages and UTC times, the one-line results of
//! apply, delete and key generate, and JSON/YAML encodings, all as pure
//! functions of their inputs (the current time is a parameter) so they are
//! tested without a daemon.
//!
//! This file never writes to a stream, reads the clock or talks to a daemon;
//! `commands.rs` does that and hands the strings out.
//!
//! Conventions, borrowed from kubectl so its users feel at home: columns are
//! left-aligned and separated by three spaces, the last column is not padded,
//! ages use one unit (`45s`, `3m`, `2h`, `5d`), and an empty list prints no
//! table at all (the caller says "No jails found." on stderr, so a script
//! reading stdout sees nothing).

use std::path::Path;

use serde::{Deserialize, Serialize};

use std::collections::BTreeSet;

use crate::common::cmd::render_argv;
use crate::common::wire::{
    BaseStatus, ChangeKind, DryRunAction, DryRunReport, Event, IngressStatus, JailStatus, LastExit,
    NodeRemoval, NodeStatus, ServiceRevision, ServiceStatus, VersionInfo, VolumeStatus,
};

use super::args::OutputFormat;
use super::contexts::Contexts;

/// Spaces between two columns.
const COLUMN_GAP: usize = 3;

/// Column headers of `get jails`; through the control plane NODE follows
/// NAME, and `-o wide` adds [`WIDE_JAIL_COLUMNS`] before LAST ERROR.
pub const JAIL_COLUMNS: [&str; 8] = [
    "NAME",
    "READY",
    "STATUS",
    "RESTARTS",
    "LAST EXIT",
    "RETRY IN",
    "AGE",
    "LAST ERROR",
];

/// What `get jails -o wide` adds.
pub const WIDE_JAIL_COLUMNS: [&str; 2] = ["ADDRESS", "EPOCH"];

/// Column headers of `get nodes`.
pub const NODE_COLUMNS: [&str; 8] = [
    "NAME",
    "STATUS",
    "ADDRESS",
    "POD CIDR",
    "CPU",
    "MEM",
    "JAILS",
    "LAST SEEN",
];

/// Column headers of `get services`.
pub const SERVICE_COLUMNS: [&str; 6] = [
    "NAME",
    "VIP:PORT",
    "READY",
    "UP-TO-DATE",
    "REVISION",
    "NODES",
];

/// Column headers of `get service NAME`: its replicas.
pub const REPLICA_COLUMNS: [&str; 5] = ["NAME", "NODE", "ADDRESS", "STATE", "REVISION"];

/// Columns of `get volumes`.
pub const VOLUME_COLUMNS: [&str; 5] = ["NAME", "NODE", "QUOTA", "USED", "MOUNTED BY"];

/// Columns of `get bases`.
pub const BASE_COLUMNS: [&str; 5] = ["RELEASE", "STATE", "SIZE", "SNAPSHOT", "PROGRESS"];

/// Columns of `get ingresses`.
pub const INGRESS_COLUMNS: [&str; 6] = [
    "NAME",
    "HOST",
    "SERVICE",
    "CERT EXPIRES",
    "STATUS",
    "LAST ERROR",
];

/// Column headers of `get ingresses` through the control plane: NODE follows
/// NAME.
pub const CLUSTER_INGRESS_COLUMNS: [&str; 7] = [
    "NAME",
    "NODE",
    "HOST",
    "SERVICE",
    "CERT EXPIRES",
    "STATUS",
    "LAST ERROR",
];

/// An object as a listing through the control plane shows it: what the
/// node's agent reported, with the node. JSON and YAML put `node` first, then
/// the status's own fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OnNode<T> {
    /// The node's id; absent when the answer did not say (a scheduled
    /// `get jails NAME` whose control plane does not send `X-Keel-Node`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// What the node's agent reported.
    #[serde(flatten)]
    pub status: T,
}

/// A jail as `get jails` shows it through the control plane.
pub type NodeJail = OnNode<JailStatus>;

/// An Ingress as `get ingresses` shows it through the control plane.
pub type NodeIngress = OnNode<IngressStatus>;

/// Aligns `rows` (the first is the header) into columns. Widths count
/// characters, trailing spaces are trimmed, every line ends with `\n`.
pub fn table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut widths = vec![0; columns];
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            line.push_str(cell);
            if i + 1 < row.len() {
                let pad = widths[i] - cell.chars().count() + COLUMN_GAP;
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// How long ago `then_unix` was at `now_unix`, in the largest unit that fits:
/// under a minute in seconds, under an hour in minutes, under a day in hours,
/// then days. A time in the future (clock skew between hosts) is `0s`.
pub fn format_age(then_unix: u64, now_unix: u64) -> String {
    format_secs(now_unix.saturating_sub(then_unix))
}

/// A duration in seconds in the largest unit that fits, as [`format_age`].
pub fn format_secs(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 86_400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// Text from a daemon made safe for one table cell or one line: every run of
/// whitespace or control characters (a multi-line stderr, a stray escape
/// sequence) becomes one space.
pub fn one_line(text: &str) -> String {
    text.split(|c: char| c.is_whitespace() || c.is_control())
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The `get jails` table, or `""` when there is no jail.
pub fn jail_table(jails: &[JailStatus], now_unix: u64, wide: bool) -> String {
    if jails.is_empty() {
        return String::new();
    }
    let mut rows = vec![jail_header(false, wide)];
    rows.extend(jails.iter().map(|j| jail_row(j, None, now_unix, wide)));
    table(&rows)
}

fn jail_header(node: bool, wide: bool) -> Vec<String> {
    let (last, first) = JAIL_COLUMNS.split_last().unwrap_or((&"", &[]));
    let mut header: Vec<String> = Vec::new();
    for (i, h) in first.iter().enumerate() {
        header.push(h.to_string());
        if i == 0 && node {
            header.push("NODE".to_string());
        }
    }
    if wide {
        header.extend(WIDE_JAIL_COLUMNS.iter().map(|h| h.to_string()));
    }
    header.push(last.to_string());
    header
}

/// LAST EXIT: the status and how long ago (`1 (12s ago)`), `?` for a
/// status the host does not report; `-` when it never exited.
pub fn last_exit_cell(exit: Option<&LastExit>, now_unix: u64) -> String {
    match exit {
        None => "-".to_string(),
        Some(e) => format!(
            "{} ({} ago)",
            e.status.map_or("?".to_string(), |s| s.to_string()),
            format_age(e.time_unix, now_unix)
        ),
    }
}

/// The `get jails` table through the control plane (a NODE column, `-` where
/// the node is not known), or `""` when there is no jail.
pub fn cluster_jail_table(jails: &[NodeJail], now_unix: u64, wide: bool) -> String {
    if jails.is_empty() {
        return String::new();
    }
    let mut rows = vec![jail_header(true, wide)];
    rows.extend(jails.iter().map(|j| {
        jail_row(
            &j.status,
            Some(j.node.as_deref().unwrap_or("-")),
            now_unix,
            wide,
        )
    }));
    table(&rows)
}

fn jail_row(j: &JailStatus, node: Option<&str>, now_unix: u64, wide: bool) -> Vec<String> {
    let mut row = vec![one_line(&j.name)];
    row.extend(node.map(one_line));
    row.extend([
        if j.ready { "yes" } else { "no" }.to_string(),
        j.state.to_string(),
        j.restarts.to_string(),
        last_exit_cell(j.last_exit.as_ref(), now_unix),
        j.retry_in_secs.map_or("-".to_string(), format_secs),
        format_age(j.created_unix, now_unix),
    ]);
    if wide {
        row.push(j.address.to_string());
        row.push(j.epoch.map_or("-".to_string(), |e| e.to_string()));
    }
    row.push(j.last_error.as_deref().map(one_line).unwrap_or_default());
    row
}

/// Column headers of `get events`.
pub const EVENT_COLUMNS: [&str; 6] = ["LAST SEEN", "TYPE", "REASON", "OBJECT", "NODE", "MESSAGE"];

/// The `get events` rows, oldest first, under the column headers when
/// `header` (a watch prints them once, above its first rows), or `""`
/// without events. NODE is `-` for an event about no node.
pub fn event_table(events: &[Event], now_unix: u64, header: bool) -> String {
    if events.is_empty() {
        return String::new();
    }
    let mut rows: Vec<Vec<String>> = Vec::new();
    if header {
        rows.push(EVENT_COLUMNS.iter().map(|h| h.to_string()).collect());
    }
    rows.extend(events.iter().map(|e| {
        vec![
            format_age(e.time_unix, now_unix),
            e.event_type.to_string(),
            one_line(&e.reason),
            one_line(&format!("{}/{}", e.kind, e.name)),
            if e.node.is_empty() {
                "-".to_string()
            } else {
                one_line(&e.node)
            },
            one_line(&e.message),
        ]
    }));
    table(&rows)
}

/// The `get nodes` table, or `""` when there is no node. CPU and MEM are
/// `committed/capacity`; LAST SEEN is how long ago the last heartbeat was,
/// `never` for a node not heard from since the control plane started.
pub fn node_table(nodes: &[NodeStatus]) -> String {
    if nodes.is_empty() {
        return String::new();
    }
    let mut rows = vec![NODE_COLUMNS.iter().map(|h| h.to_string()).collect()];
    rows.extend(nodes.iter().map(|n| {
        vec![
            one_line(&n.node_id),
            if n.cordoned {
                format!("{},Cordoned", n.status)
            } else {
                n.status.to_string()
            },
            n.address.to_string(),
            one_line(&n.pod_cidr),
            format!("{}/{}", cores(n.committed.cpu), cores(n.capacity.cpu)),
            format!(
                "{}/{}",
                approx_size(n.committed.memory),
                approx_size(n.capacity.memory)
            ),
            n.jails.to_string(),
            n.last_seen_secs
                .map_or_else(|| "never".to_string(), format_secs),
        ]
    }));
    table(&rows)
}

/// The `get services` table, or `""` when there is no service. NODES is the
/// distinct nodes its replicas are placed on, sorted, `-` when none is.
pub fn service_table(services: &[ServiceStatus]) -> String {
    if services.is_empty() {
        return String::new();
    }
    let mut rows = vec![SERVICE_COLUMNS.iter().map(|h| h.to_string()).collect()];
    rows.extend(services.iter().map(|s| {
        let nodes: BTreeSet<String> = s.replicas.iter().map(|r| one_line(&r.node)).collect();
        let nodes = nodes.into_iter().collect::<Vec<_>>().join(",");
        vec![
            one_line(&s.name),
            format!("{}:{}", s.vip, s.port),
            format!("{}/{}", s.ready, s.desired),
            s.updated.to_string(),
            revision_cell(s),
            if nodes.is_empty() { "-".into() } else { nodes },
        ]
    }));
    table(&rows)
}

/// REVISION of `get services`: the current revision, with the state of its
/// rollout while it is not complete (`2 (Progressing)`, `2 (Stopped)`).
fn revision_cell(s: &ServiceStatus) -> String {
    match &s.rollout {
        Some(r) if r.state != "Complete" => format!("{} ({})", s.revision, one_line(&r.state)),
        _ => s.revision.to_string(),
    }
}

/// The `get service NAME` table: one row per placed replica, ADDRESS `-`
/// until its node reported it; `""` when none is placed.
pub fn replica_table(service: &ServiceStatus) -> String {
    if service.replicas.is_empty() {
        return String::new();
    }
    let mut rows = vec![REPLICA_COLUMNS.iter().map(|h| h.to_string()).collect()];
    rows.extend(service.replicas.iter().map(|r| {
        vec![
            one_line(&r.name),
            one_line(&r.node),
            r.address.map_or_else(|| "-".to_string(), |a| a.to_string()),
            one_line(&r.state),
            r.revision
                .map_or_else(|| "-".to_string(), |v| v.to_string()),
        ]
    }));
    table(&rows)
}

/// The line `apply` prints for one applied service:
/// `service/web applied (VIP 127.128.0.1:8080, 3/3 ready)`.
pub fn service_applied_line(status: &ServiceStatus) -> String {
    format!(
        "service/{} applied (VIP {}:{}, {}/{} ready)",
        one_line(&status.name),
        status.vip,
        status.port,
        status.ready,
        status.desired
    )
}

/// The line `scale` prints: `service/web scaled to 5 (3/5 ready)`.
pub fn service_scaled_line(status: &ServiceStatus) -> String {
    format!(
        "service/{} scaled to {} ({}/{} ready)",
        one_line(&status.name),
        status.desired,
        status.ready,
        status.desired
    )
}

/// The line `rollout undo` prints.
pub fn rolled_back_line(status: &ServiceStatus) -> String {
    format!(
        "service/{} rolled back: revision {} rolls out",
        one_line(&status.name),
        status.revision
    )
}

/// Where a rollout stands, for `rollout status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RolloutProgress {
    /// Every desired replica runs the current revision and is ready.
    Complete(String),
    /// The control plane stopped it, for this reason.
    Stopped(String),
    /// Still going: what to show the operator.
    Waiting(String),
}

/// Reads a service's status the way `kubectl rollout status` reads a
/// Deployment's: complete, stopped, or a line saying what it waits for.
pub fn rollout_progress(s: &ServiceStatus) -> RolloutProgress {
    let name = one_line(&s.name);
    match &s.rollout {
        Some(r) if r.revision == s.revision && r.state == "Stopped" => {
            RolloutProgress::Stopped(one_line(r.reason.as_deref().unwrap_or("no reason given")))
        }
        Some(r) if r.revision == s.revision && r.state != "Complete" => {
            let ready_new = s
                .replicas
                .iter()
                .filter(|x| x.updated && x.ready)
                .count()
                .min(s.desired as usize);
            RolloutProgress::Waiting(format!(
                "Waiting for service {name} to roll out revision {}: {} of {} updated replicas are ready",
                s.revision, ready_new, s.desired
            ))
        }
        // No rollout (the first template) or a complete one: the service is
        // rolled out once its replicas are ready.
        _ if s.ready < s.desired => RolloutProgress::Waiting(format!(
            "Waiting for service {name}: {} of {} replicas are ready",
            s.ready, s.desired
        )),
        _ => RolloutProgress::Complete(format!(
            "service/{name} successfully rolled out (revision {})",
            s.revision
        )),
    }
}

/// The `rollout history` table, oldest first.
pub fn revision_table(revisions: &[ServiceRevision]) -> String {
    let mut rows = vec![vec![
        "REVISION".to_string(),
        "CREATED".to_string(),
        "TEMPLATE".to_string(),
        "CURRENT".to_string(),
    ]];
    rows.extend(revisions.iter().map(|r| {
        vec![
            r.revision.to_string(),
            if r.created_unix == 0 {
                "-".to_string()
            } else {
                utc_datetime(i64::try_from(r.created_unix).unwrap_or(i64::MAX))
            },
            one_line(&r.template_digest.chars().take(12).collect::<String>()),
            if r.current { "*".into() } else { String::new() },
        ]
    }));
    table(&rows).trim_end().to_string()
}

/// The `get volumes` table, or `""` when there is none. NODE is `-` from
/// an agent (it speaks for itself); QUOTA `none` when unlimited; a volume
/// its node could not report on shows `?` and the reason in MOUNTED BY.
pub fn volume_table(volumes: &[VolumeStatus]) -> String {
    if volumes.is_empty() {
        return String::new();
    }
    let mut rows = vec![VOLUME_COLUMNS.iter().map(|h| h.to_string()).collect()];
    rows.extend(volumes.iter().map(|v| {
        let unknown = v.error.is_some();
        vec![
            one_line(&v.name),
            v.node.as_deref().map_or_else(|| "-".into(), one_line),
            match (v.quota, unknown) {
                (_, true) => "?".into(),
                (Some(q), _) => approx_size(q),
                (None, _) => "none".into(),
            },
            v.used.map_or_else(|| "?".into(), approx_size),
            match (&v.error, &v.mounted_by) {
                (Some(e), _) => format!("? ({})", one_line(e)),
                (None, Some(by)) => one_line(by),
                (None, None) => "-".into(),
            },
        ]
    }));
    table(&rows)
}

/// The `get bases` table, or `""` when there is none. SIZE is the
/// dataset's, `-` before it exists; PROGRESS is a running fetch's download
/// (`12.5M/190.2M`), or a failed one's error.
pub fn base_table(bases: &[BaseStatus]) -> String {
    if bases.is_empty() {
        return String::new();
    }
    let mut rows = vec![BASE_COLUMNS.iter().map(|h| h.to_string()).collect()];
    rows.extend(bases.iter().map(|b| {
        vec![
            one_line(&b.release),
            b.state.to_string(),
            b.used.map_or_else(|| "-".into(), approx_size),
            if b.snapshot { "@keel" } else { "-" }.to_string(),
            base_progress(b),
        ]
    }));
    table(&rows)
}

/// A base's PROGRESS cell, also the line `base fetch` prints while it waits.
pub fn base_progress(b: &BaseStatus) -> String {
    match (&b.error, b.downloaded, b.total) {
        (Some(e), _, _) => one_line(e),
        (None, Some(done), Some(total)) => format!("{}/{}", approx_size(done), approx_size(total)),
        (None, Some(done), None) => approx_size(done),
        (None, None, _) => "-".into(),
    }
}

/// `base/RELEASE fetched` (or `… already present`), with the node when one
/// was named.
pub fn base_fetched_line(release: &str, node: Option<&str>, already: bool) -> String {
    let on = node
        .map(|n| format!(" on node {}", one_line(n)))
        .unwrap_or_default();
    if already {
        format!("base/{} already present{on}", one_line(release))
    } else {
        format!("base/{} fetched{on}", one_line(release))
    }
}

/// The `get ingresses` table, or `""` when there is none. CERT EXPIRES is
/// the installed certificate's expiry in UTC, `-` before the first one;
/// LAST ERROR, like the jail table's, is empty when there is none.
pub fn ingress_table(ingresses: &[IngressStatus]) -> String {
    if ingresses.is_empty() {
        return String::new();
    }
    let mut rows = vec![INGRESS_COLUMNS.iter().map(|h| h.to_string()).collect()];
    rows.extend(ingresses.iter().map(|i| ingress_row(i, None)));
    table(&rows)
}

/// The `get ingresses` table through the control plane (a NODE column after
/// NAME), or `""` when there is no ingress.
pub fn cluster_ingress_table(ingresses: &[NodeIngress]) -> String {
    if ingresses.is_empty() {
        return String::new();
    }
    let mut rows = vec![
        CLUSTER_INGRESS_COLUMNS
            .iter()
            .map(|h| h.to_string())
            .collect(),
    ];
    rows.extend(
        ingresses
            .iter()
            .map(|i| ingress_row(&i.status, Some(i.node.as_deref().unwrap_or("-")))),
    );
    table(&rows)
}

fn ingress_row(i: &IngressStatus, node: Option<&str>) -> Vec<String> {
    let mut row = vec![one_line(&i.name)];
    row.extend(node.map(one_line));
    row.extend([
        one_line(&i.host),
        one_line(&i.service),
        i.certificate_expires
            .map_or_else(|| "-".into(), utc_datetime),
        i.phase.to_string(),
        i.last_error.as_deref().map(one_line).unwrap_or_default(),
    ]);
    row
}

/// The line `apply` prints for one applied ingress:
/// `ingress/shop applied (Issuing, shop.example.com -> service web)`, with
/// `on node n2` through the control plane, plus the last error when the
/// agent recorded one.
pub fn ingress_applied_line(status: &IngressStatus, node: Option<&str>) -> String {
    let on = node.map_or(String::new(), |n| format!(" on node {}", one_line(n)));
    let mut line = format!(
        "ingress/{} applied{on} ({}, {} -> service {})",
        one_line(&status.name),
        status.phase,
        one_line(&status.host),
        one_line(&status.service)
    );
    if let Some(e) = &status.last_error {
        line.push_str(&format!(": last error: {}", one_line(e)));
    }
    line
}

/// The line `delete` prints for one deleted ingress.
pub fn ingress_deleted_line(name: &str) -> String {
    format!("ingress/{} deleted", one_line(name))
}

/// Unix seconds as a UTC date-time, `2026-03-01T12:00:00Z` (RFC 3339).
/// Days to a civil date by Howard Hinnant's `civil_from_days`, valid for
/// every `i64` day count a certificate can carry; the crate has no date
/// library of its own and one table cell does not warrant one.
pub fn utc_datetime(unix: i64) -> String {
    let (days, secs) = (unix.div_euclid(86_400), unix.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

/// The question `delete-volume` asks on a terminal, answered on the same line.
pub fn delete_volume_prompt(name: &str) -> String {
    format!("Delete volume {} and all its data? [y/N] ", one_line(name))
}

/// The line `delete-volume` prints.
pub fn volume_deleted_line(name: &str) -> String {
    format!("volume/{} deleted", one_line(name))
}

/// The line `cordon` / `uncordon` prints for one node.
pub fn cordoned_line(id: &str, cordoned: bool) -> String {
    format!(
        "node/{} {}",
        one_line(id),
        if cordoned { "cordoned" } else { "uncordoned" }
    )
}

/// The line `delete node` prints for one deleted node: what the control
/// plane forgot with it.
pub fn node_deleted_line(removal: &NodeRemoval) -> String {
    let list = |names: &[String]| {
        if names.is_empty() {
            "none".to_string()
        } else {
            names
                .iter()
                .map(|n| one_line(n))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    format!(
        "node/{} deleted (forgot jails: {}; volumes: {})",
        one_line(&removal.deleted),
        list(&removal.jails),
        list(&removal.volumes)
    )
}

/// The line `delete` prints for one deleted service.
pub fn service_deleted_line(name: &str) -> String {
    format!("service/{} deleted", one_line(name))
}

/// CPU cores with at most two decimals and no trailing zeros: `2`, `0.5`,
/// `1.25`.
pub fn cores(cpu: f64) -> String {
    let text = format!("{cpu:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text == "-0" {
        "0".into()
    } else {
        text.into()
    }
}

/// Bytes rounded to one decimal in the largest unit (K, M, G, T, powers of
/// 1024 as in specs) that keeps the number at 1 or more, `B` below a
/// kilobyte, so every size of a table carries its unit: `512M`, `1.5G`,
/// `15.6G`, `800B`. Specs use [`crate::common::spec::format_size`], which is
/// exact; a host's memory is rarely a round number, so a table rounds.
pub fn approx_size(bytes: u64) -> String {
    const UNITS: [(&str, u32); 4] = [("T", 40), ("G", 30), ("M", 20), ("K", 10)];
    for (unit, shift) in UNITS {
        let scale = (1u64 << shift) as f64;
        let value = bytes as f64 / scale;
        if value >= 1.0 {
            let text = format!("{value:.1}");
            return format!("{}{unit}", text.trim_end_matches(".0"));
        }
    }
    format!("{bytes}B")
}

/// The line `apply` prints for one applied jail:
/// `jail/web-1 applied (Running, 10.20.0.2)`, or through the control plane
/// `jail/web-1 applied on node n2 (Running, 127.64.1.2)`, plus the last error
/// when the agent recorded one.
pub fn applied_line(status: &JailStatus, node: Option<&str>) -> String {
    let on = node.map_or(String::new(), |n| format!(" on node {}", one_line(n)));
    let mut line = format!(
        "jail/{} applied{on} ({}, {})",
        one_line(&status.name),
        status.state,
        status.address
    );
    if let Some(e) = &status.last_error {
        line.push_str(&format!(": last error: {}", one_line(e)));
    }
    line
}

/// What `diff` and `apply --dry-run` print for one object: a head line
/// (`jail/web-1:`, with the node through the control plane), the changed
/// fields (`+ path: new`, `- path: old`, `~ path: old -> new`, values in
/// JSON), the `would:` line, a note when there is one, and with
/// `commands` the host commands in order, `run` for a change and `read` for
/// an observation, argv quoted as sh(1) would take it.
pub fn plan_text(report: &DryRunReport, commands: bool) -> String {
    let kind = report.kind.to_lowercase();
    let name = one_line(&report.name);
    let on = report
        .node
        .as_deref()
        .map_or(String::new(), |n| format!(" on node {}", one_line(n)));
    let value = |v: &Option<serde_json::Value>| {
        one_line(&v.as_ref().map_or_else(String::new, |v| v.to_string()))
    };
    let mut out = format!("{kind}/{name}{on}:\n");
    for c in &report.changes {
        let path = one_line(&c.path);
        out.push_str(&match c.kind {
            ChangeKind::Added => format!("  + {path}: {}\n", value(&c.new)),
            ChangeKind::Removed => format!("  - {path}: {}\n", value(&c.old)),
            ChangeKind::Changed => {
                format!("  ~ {path}: {} -> {}\n", value(&c.old), value(&c.new))
            }
        });
    }
    let because = report
        .because
        .iter()
        .map(|b| one_line(b))
        .collect::<Vec<_>>()
        .join(", ");
    let why = |text: &str| {
        if because.is_empty() {
            String::new()
        } else {
            format!(" ({because} {text})")
        }
    };
    let would = match report.action {
        DryRunAction::Nothing => format!("leave {kind} {name} as it is (nothing to do)"),
        DryRunAction::Create => format!("create {kind} {name}"),
        DryRunAction::Start => format!("start {kind} {name} ({because})"),
        DryRunAction::UpdateRecord => format!(
            "update the record of {kind} {name}{}; what runs is left alone",
            why("changed")
        ),
        DryRunAction::UpdateInPlace => format!(
            "update {kind} {name} in place{}, no restart",
            why("changed")
        ),
        DryRunAction::Replace => format!("replace {kind} {name}{}", why("changed")),
    };
    out.push_str(&format!("  would: {would}\n"));
    if let Some(note) = &report.note {
        out.push_str(&format!("  note: {}\n", one_line(note)));
    }
    if commands {
        for c in &report.commands {
            let tag = if c.changes_host { "run " } else { "read" };
            out.push_str(&format!("  {tag} {}\n", render_argv(&c.argv)));
        }
    }
    out
}

/// The line `delete` prints for one deleted jail.
pub fn deleted_line(name: &str) -> String {
    format!("jail/{} deleted", one_line(name))
}

/// The line `key generate` prints.
pub fn key_written_line(id: &str, path: &Path) -> String {
    format!(
        "key {id} written to {} (mode 0600); list it in [auth] operator_keys or node_keys of the daemons that should accept it",
        path.display()
    )
}

/// The line `validate` prints: `1 document valid`, `3 documents valid`.
pub fn valid_line(documents: usize) -> String {
    let noun = if documents == 1 {
        "document"
    } else {
        "documents"
    };
    format!("{documents} {noun} valid")
}

/// `value` as pretty JSON or YAML, ending with a newline. `Table` is not an
/// encoding; asking for it is a bug in the caller and answers an error.
pub fn encode(format: OutputFormat, value: &impl Serialize) -> Result<String, String> {
    match format {
        OutputFormat::Json => serde_json::to_string_pretty(value)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string()),
        OutputFormat::Yaml => serde_yaml::to_string(value).map_err(|e| e.to_string()),
        OutputFormat::Table | OutputFormat::Wide => Err("a table is not an encoding".into()),
    }
}

/// The `config get-contexts` table: `*` marks the current context, SERVER
/// is the control plane's `HOST:PORT` or the agent's socket.
pub fn contexts_table(file: &Contexts) -> String {
    let mut rows = vec![
        ["CURRENT", "NAME", "SERVER", "KEY FILE"]
            .iter()
            .map(|h| h.to_string())
            .collect(),
    ];
    rows.extend(file.contexts.iter().map(|(name, context)| {
        vec![
            if file.current.as_deref() == Some(name.as_str()) {
                "*".to_string()
            } else {
                String::new()
            },
            name.clone(),
            one_line(&context.server()),
            context
                .key_file
                .as_ref()
                .map_or_else(|| "-".to_string(), |k| one_line(&k.display().to_string())),
        ]
    }));
    table(&rows)
}

/// `version`'s second line: `Server: keel-agentd 0.1.0 (/var/run/keel/agentd.sock)`.
pub fn server_version_line(server: &VersionInfo, endpoint: &str) -> String {
    format!(
        "Server: {} {} ({})",
        one_line(&server.program),
        one_line(&server.version),
        one_line(endpoint)
    )
}

/// What `get KIND NAME -o yaml` prints: the document the object was applied
/// with, then its `status`, which `apply` ignores, so the output applies
/// back as it is.
pub fn manifest_yaml(document: &str, status: &impl Serialize) -> Result<String, String> {
    let mut object: serde_yaml::Mapping = serde_yaml::from_str(document)
        .map_err(|e| format!("the daemon's document is not a YAML mapping: {e}"))?;
    let status = serde_yaml::to_value(status).map_err(|e| e.to_string())?;
    object.insert("status".into(), status);
    serde_yaml::to_string(&object).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_prints_changes_the_decision_and_the_commands() {
        use crate::common::wire::{FieldChange, PlannedCommand};
        let report = DryRunReport {
            kind: "Jail".into(),
            name: "web-1".into(),
            node: Some("n2".into()),
            changes: vec![
                FieldChange {
                    path: "spec.exec.start".into(),
                    kind: ChangeKind::Changed,
                    old: Some(serde_json::json!(["/bin/a"])),
                    new: Some(serde_json::json!(["/bin/b"])),
                },
                FieldChange {
                    path: "spec.env.A".into(),
                    kind: ChangeKind::Removed,
                    old: Some(serde_json::json!("1")),
                    new: None,
                },
            ],
            action: DryRunAction::Replace,
            because: vec!["spec.exec".into()],
            commands: vec![
                PlannedCommand {
                    argv: vec!["/usr/sbin/jls".into()],
                    changes_host: false,
                },
                PlannedCommand {
                    argv: vec!["/usr/sbin/jail".into(), "-c".into(), "a b".into()],
                    changes_host: true,
                },
            ],
            note: None,
        };
        let expected = "jail/web-1 on node n2:\n\
                        \x20 ~ spec.exec.start: [\"/bin/a\"] -> [\"/bin/b\"]\n\
                        \x20 - spec.env.A: \"1\"\n\
                        \x20 would: replace jail web-1 (spec.exec changed)\n\
                        \x20 read /usr/sbin/jls\n\
                        \x20 run  /usr/sbin/jail -c 'a b'\n";
        assert_eq!(plan_text(&report, true), expected);
        assert!(!plan_text(&report, false).contains("/usr/sbin"));
    }
    use crate::common::wire::{IngressPhase, Liveness, Phase, ReplicaStatus, Resources};

    #[test]
    fn the_event_table_has_its_columns_ages_and_a_dash_for_no_node() {
        use crate::common::wire::{EventType, ObjectKind};
        let event = |seq, kind, name: &str, reason: &str, node: &str, event_type| Event {
            seq,
            time_unix: 1_000 - seq * 30,
            kind,
            name: name.into(),
            reason: reason.into(),
            message: format!("{reason}\nof {name}"),
            node: node.into(),
            event_type,
            source: None,
        };
        let events = [
            event(
                2,
                ObjectKind::Jail,
                "web",
                "Exited",
                "n1",
                EventType::Warning,
            ),
            event(
                1,
                ObjectKind::Service,
                "api",
                "RolloutComplete",
                "",
                EventType::Normal,
            ),
        ];
        assert_eq!(
            event_table(&events, 1_000, true),
            "LAST SEEN   TYPE      REASON            OBJECT        NODE   MESSAGE\n\
             1m          Warning   Exited            jail/web      n1     Exited of web\n\
             30s         Normal    RolloutComplete   service/api   -      RolloutComplete of api\n"
        );
        assert!(!event_table(&events, 1_000, false).contains("LAST SEEN"));
        assert_eq!(event_table(&[], 1_000, true), "");
    }

    fn status(name: &str, state: Phase, addr: [u8; 4], restarts: u32, created: u64) -> JailStatus {
        JailStatus {
            name: name.into(),
            ready: state == Phase::Running,
            state,
            address: addr.into(),
            restarts,
            created_unix: created,
            last_error: None,
            retry_in_secs: None,
            epoch: None,
            cpu: None,
            memory: None,
            last_exit: None,
        }
    }

    #[test]
    fn ages_use_the_largest_unit_that_fits() {
        let now = 100_000_000;
        let cases = [
            (0, "0s"),
            (45, "45s"),
            (59, "59s"),
            (60, "1m"),
            (3 * 60 + 59, "3m"),
            (3599, "59m"),
            (3600, "1h"),
            (2 * 3600 + 1, "2h"),
            (86_399, "23h"),
            (86_400, "1d"),
            (5 * 86_400 + 7, "5d"),
            (400 * 86_400, "400d"),
        ];
        for (ago, want) in cases {
            assert_eq!(format_age(now - ago, now), want, "{ago}s ago");
        }
    }

    #[test]
    fn a_creation_time_in_the_future_is_zero_seconds_old() {
        assert_eq!(format_age(2_000, 1_000), "0s");
    }

    #[test]
    fn the_jail_table_aligns_every_column_to_its_widest_cell() {
        let now = 10_000;
        let mut crashing = status(
            "database-primary",
            Phase::CrashLoop,
            [10, 20, 0, 12],
            12,
            now - 7200,
        );
        crashing.last_error = Some("jail -c failed:\n  exit 1\tbad".into());
        crashing.retry_in_secs = Some(90);
        crashing.epoch = Some(7);
        crashing.last_exit = Some(LastExit {
            status: Some(3),
            time_unix: now - 12,
        });
        let mut gone = status("api", Phase::Restarting, [10, 20, 0, 3], 1, now - 60);
        gone.last_exit = Some(LastExit {
            status: None,
            time_unix: now - 2,
        });
        let jails = [
            status("web-1", Phase::Running, [10, 20, 0, 2], 0, now - 45),
            crashing,
            gone,
        ];
        let want = "\
NAME               READY   STATUS       RESTARTS   LAST EXIT     RETRY IN   AGE   LAST ERROR
web-1              yes     Running      0          -             -          45s
database-primary   no      CrashLoop    12         3 (12s ago)   1m         2h    jail -c failed: exit 1 bad
api                no      Restarting   1          ? (2s ago)    -          1m
";
        assert_eq!(jail_table(&jails, now, false), want);
        let wide = "\
NAME               READY   STATUS       RESTARTS   LAST EXIT     RETRY IN   AGE   ADDRESS      EPOCH   LAST ERROR
web-1              yes     Running      0          -             -          45s   10.20.0.2    -
database-primary   no      CrashLoop    12         3 (12s ago)   1m         2h    10.20.0.12   7       jail -c failed: exit 1 bad
api                no      Restarting   1          ? (2s ago)    -          1m    10.20.0.3    -
";
        assert_eq!(jail_table(&jails, now, true), wide);
    }

    #[test]
    fn columns_line_up_by_characters_not_bytes() {
        let got = table(&[
            vec!["A".into(), "B".into()],
            vec!["é".into(), "x".into()],
            vec!["ab".into(), "y".into()],
        ]);
        assert_eq!(got, "A    B\né    x\nab   y\n");
    }

    #[test]
    fn an_empty_list_prints_no_table() {
        assert_eq!(jail_table(&[], 0, false), "");
    }

    #[test]
    fn result_lines_name_kind_state_and_address() {
        let mut s = status("web-1", Phase::Running, [10, 20, 0, 2], 0, 0);
        assert_eq!(
            applied_line(&s, None),
            "jail/web-1 applied (Running, 10.20.0.2)"
        );
        assert_eq!(
            applied_line(&s, Some("n2")),
            "jail/web-1 applied on node n2 (Running, 10.20.0.2)"
        );
        s.state = Phase::Failed;
        s.last_error = Some("zfs clone failed\n".into());
        assert_eq!(
            applied_line(&s, None),
            "jail/web-1 applied (Failed, 10.20.0.2): last error: zfs clone failed"
        );
        assert_eq!(deleted_line("web-1"), "jail/web-1 deleted");
        assert_eq!(valid_line(1), "1 document valid");
        assert_eq!(valid_line(3), "3 documents valid");
    }

    fn node(
        id: &str,
        status: Liveness,
        committed: (f64, u64),
        last_seen: Option<u64>,
    ) -> NodeStatus {
        NodeStatus {
            node_id: id.into(),
            status,
            address: ([127, 0, 0, 1], 7441).into(),
            pod_cidr: "127.64.3.0/24".into(),
            capacity: Resources {
                cpu: 2.0,
                memory: 16 << 30,
            },
            committed: Resources {
                cpu: committed.0,
                memory: committed.1,
            },
            jails: 2,
            last_seen_secs: last_seen,
            cordoned: false,
            events_seq: None,
        }
    }

    #[test]
    fn the_node_table_shows_used_over_capacity_and_when_each_node_was_heard() {
        let nodes = [
            node("n1", Liveness::Alive, (1.5, 512 << 20), Some(0)),
            node("node-two", Liveness::Dead, (0.25, 0), Some(125)),
            node("n3", Liveness::Dead, (0.0, 3 << 29), None),
        ];
        let want = "\
NAME       STATUS   ADDRESS          POD CIDR        CPU      MEM        JAILS   LAST SEEN
n1         Alive    127.0.0.1:7441   127.64.3.0/24   1.5/2    512M/16G   2       0s
node-two   Dead     127.0.0.1:7441   127.64.3.0/24   0.25/2   0B/16G     2       2m
n3         Dead     127.0.0.1:7441   127.64.3.0/24   0/2      1.5G/16G   2       never
";
        assert_eq!(node_table(&nodes), want);
        assert_eq!(node_table(&[]), "");
    }

    fn replica(name: &str, node: &str, address: Option<[u8; 4]>, state: &str) -> ReplicaStatus {
        ReplicaStatus {
            name: name.into(),
            node: node.into(),
            address: address.map(Into::into),
            state: state.into(),
            ready: state == "Running",
            revision: Some(1),
            updated: true,
        }
    }

    fn web() -> ServiceStatus {
        ServiceStatus {
            name: "web".into(),
            vip: [127, 128, 0, 7].into(),
            port: 8080,
            desired: 3,
            ready: 2,
            stateful: false,
            revision: 1,
            updated: 3,
            rollout: None,
            replicas: vec![
                replica("web-0", "n2", Some([127, 64, 2, 2]), "Running"),
                replica("web-1", "n1", Some([127, 64, 1, 2]), "Running"),
                replica("web-2", "n2", None, "Pending"),
            ],
        }
    }

    #[test]
    fn the_service_table_shows_vip_readiness_and_the_distinct_nodes() {
        let mut empty = web();
        empty.name = "db".into();
        empty.port = 5432;
        empty.desired = 0;
        empty.ready = 0;
        empty.replicas.clear();
        empty.updated = 0;
        let mut rolling = web();
        rolling.name = "api".into();
        rolling.revision = 2;
        rolling.updated = 1;
        rolling.rollout = Some(crate::common::wire::RolloutStatus {
            revision: 2,
            state: "Progressing".into(),
            reason: None,
        });
        let want = "\
NAME   VIP:PORT           READY   UP-TO-DATE   REVISION          NODES
web    127.128.0.7:8080   2/3     3            1                 n1,n2
db     127.128.0.7:5432   0/0     0            1                 -
api    127.128.0.7:8080   2/3     1            2 (Progressing)   n1,n2
";
        assert_eq!(service_table(&[web(), empty.clone(), rolling]), want);
        assert_eq!(service_table(&[]), "");
        assert_eq!(replica_table(&empty), "");
    }

    #[test]
    fn the_replica_table_shows_each_replica_where_it_is() {
        let want = "\
NAME    NODE   ADDRESS      STATE     REVISION
web-0   n2     127.64.2.2   Running   1
web-1   n1     127.64.1.2   Running   1
web-2   n2     -            Pending   1
";
        assert_eq!(replica_table(&web()), want);
        assert_eq!(
            service_applied_line(&web()),
            "service/web applied (VIP 127.128.0.7:8080, 2/3 ready)"
        );
        assert_eq!(service_deleted_line("web"), "service/web deleted");
    }

    #[test]
    fn utc_times_are_rfc_3339_across_leap_days_and_centuries() {
        let cases = [
            (0, "1970-01-01T00:00:00Z"),
            (-1, "1969-12-31T23:59:59Z"),
            (951_782_400, "2000-02-29T00:00:00Z"),
            (1_709_251_199, "2024-02-29T23:59:59Z"),
            (1_772_366_400, "2026-03-01T12:00:00Z"),
            (4_107_542_400, "2100-03-01T00:00:00Z"),
        ];
        for (unix, want) in cases {
            assert_eq!(utc_datetime(unix), want, "{unix}");
        }
    }

    fn ingress(name: &str, phase: IngressPhase, expires: Option<i64>) -> IngressStatus {
        IngressStatus {
            name: name.into(),
            host: format!("{name}.example.com"),
            service: "web".into(),
            phase,
            certificate_expires: expires,
            last_error: None,
        }
    }

    #[test]
    fn the_ingress_table_shows_host_backend_expiry_and_phase() {
        let mut failing = ingress("blog", IngressPhase::BackingOff, None);
        failing.last_error = Some("DNS-01 challenge failed:\n  TXT not seen".into());
        let list = [
            ingress("shop", IngressPhase::Serving, Some(1_772_366_400)),
            failing.clone(),
        ];
        let want = "\
NAME   HOST               SERVICE   CERT EXPIRES           STATUS       LAST ERROR
shop   shop.example.com   web       2026-03-01T12:00:00Z   Serving
blog   blog.example.com   web       -                      BackingOff   DNS-01 challenge failed: TXT not seen
";
        assert_eq!(ingress_table(&list), want);
        assert_eq!(ingress_table(&[]), "");
        assert_eq!(
            ingress_applied_line(&list[0], None),
            "ingress/shop applied (Serving, shop.example.com -> service web)"
        );
        assert_eq!(
            ingress_applied_line(&failing, Some("n2")),
            "ingress/blog applied on node n2 (BackingOff, blog.example.com -> service web): \
             last error: DNS-01 challenge failed: TXT not seen"
        );
        assert_eq!(ingress_deleted_line("shop"), "ingress/shop deleted");
    }

    #[test]
    fn cores_and_sizes_are_short_and_rounded() {
        assert_eq!(cores(2.0), "2");
        assert_eq!(cores(0.5), "0.5");
        assert_eq!(cores(1.0 / 3.0), "0.33");
        assert_eq!(cores(0.0), "0");
        assert_eq!(approx_size(0), "0B");
        assert_eq!(approx_size(800), "800B");
        assert_eq!(approx_size(1536), "1.5K");
        assert_eq!(approx_size(16_734_502_912), "15.6G");
        assert_eq!(approx_size(3 << 40), "3T");
    }

    #[test]
    fn the_cluster_jail_table_adds_the_node_after_the_name() {
        let now = 1_000;
        let jails = [
            NodeJail {
                node: Some("n2".into()),
                status: status("a", Phase::Running, [127, 64, 7, 2], 0, now - 5),
            },
            NodeJail {
                node: None,
                status: status("bb", Phase::Pending, [127, 64, 9, 2], 1, now),
            },
        ];
        let want = "\
NAME   NODE   READY   STATUS    RESTARTS   LAST EXIT   RETRY IN   AGE   LAST ERROR
a      n2     yes     Running   0          -           -          5s
bb     -      no      Pending   1          -           -          0s
";
        assert_eq!(cluster_jail_table(&jails, now, false), want);
        let json = encode(OutputFormat::Json, &jails).expect("json");
        let back: Vec<NodeJail> = serde_json::from_str(&json).expect("parses");
        assert_eq!(back, jails);
        let value: serde_json::Value = serde_json::from_str(&json).expect("parses");
        assert_eq!(value[0]["node"], "n2");
        assert_eq!(value[0]["name"], "a");
        assert!(value[1].get("node").is_none(), "{json}");
    }

    #[test]
    fn json_and_yaml_read_back_to_the_same_status() {
        let jails = vec![status("web-1", Phase::Running, [10, 20, 0, 2], 3, 77)];
        let json = encode(OutputFormat::Json, &jails).expect("json");
        assert!(json.ends_with("}\n]\n"), "{json}");
        let back: Vec<JailStatus> = serde_json::from_str(&json).expect("parses");
        assert_eq!(back, jails);
        let yaml = encode(OutputFormat::Yaml, &jails[0]).expect("yaml");
        let back: JailStatus = serde_yaml::from_str(&yaml).expect("parses");
        assert_eq!(back, jails[0]);
        assert!(encode(OutputFormat::Table, &jails).is_err());
    }
}
