//! `keelctl describe KIND NAME`: one object in the layout kubectl users
//! read without thinking: `Label:  value` lines, then sections (the spec as
//! applied, conditions, replicas, the last events) indented under a title.
//!
//! These are pure functions from what the daemons answered to text, like
//! `output.rs`; fetching is `commands.rs`'s job. Every value from a daemon
//! goes through [`one_line`], so a name cannot forge a line.

use crate::common::wire::{IngressStatus, JailStatus, NodeStatus, ServiceStatus, VolumeStatus};

use super::output::{
    approx_size, cores, format_secs, last_exit_cell, one_line, table, utc_datetime,
};

/// An object being described: fields, then sections.
#[derive(Default)]
pub struct Description {
    fields: Vec<(String, String)>,
    sections: Vec<(String, String)>,
}

impl Description {
    /// `label:  value`.
    pub fn field(mut self, label: &str, value: impl Into<String>) -> Description {
        self.fields.push((label.to_string(), value.into()));
        self
    }

    /// A titled block: `body`'s lines indented by two spaces under `title:`;
    /// `<none>` when it is empty.
    pub fn section(mut self, title: &str, body: impl Into<String>) -> Description {
        self.sections.push((title.to_string(), body.into()));
        self
    }

    /// The text, every line ending with `\n`.
    pub fn render(&self) -> String {
        let width = self
            .fields
            .iter()
            .map(|(l, _)| l.chars().count() + 1)
            .max()
            .unwrap_or(0)
            .max(12);
        let mut out = String::new();
        for (label, value) in &self.fields {
            let label = format!("{label}:");
            out.push_str(format!("{label:width$}  {value}").trim_end());
            out.push('\n');
        }
        for (title, body) in &self.sections {
            out.push_str(title);
            out.push_str(":\n");
            if body.trim().is_empty() {
                out.push_str("  <none>\n");
                continue;
            }
            for line in body.lines() {
                out.push_str(format!("  {line}").trim_end());
                out.push('\n');
            }
        }
        out
    }
}

fn or_none(value: Option<String>) -> String {
    value.unwrap_or_else(|| "<none>".into())
}

/// `2026-12-02T07:30:00Z (5m ago)`.
fn when(unix: u64, now_unix: u64) -> String {
    format!(
        "{} ({} ago)",
        utc_datetime(i64::try_from(unix).unwrap_or(i64::MAX)),
        format_secs(now_unix.saturating_sub(unix))
    )
}

/// The spec part of an applied document: everything under its `spec:` key,
/// as YAML, for the Spec section; the document itself when it has none.
pub fn spec_of(document: &str) -> String {
    let spec = serde_yaml::from_str::<serde_yaml::Value>(document)
        .ok()
        .and_then(|v| v.get("spec").cloned());
    match spec.and_then(|s| serde_yaml::to_string(&s).ok()) {
        Some(text) => text,
        None => document.to_string(),
    }
}

/// `describe jail NAME`; `node` is where it runs (through the control plane).
pub fn jail(
    status: &JailStatus,
    node: Option<&str>,
    document: Option<&str>,
    now_unix: u64,
) -> Description {
    let mut d = Description::default()
        .field("Name", one_line(&status.name))
        .field("Kind", "Jail");
    if let Some(node) = node {
        d = d.field("Node", one_line(node));
    }
    let resources = match (status.cpu, status.memory) {
        (None, None) => "unlimited".to_string(),
        (cpu, memory) => format!(
            "cpu {}, memory {}",
            cpu.map_or_else(|| "unlimited".into(), cores),
            memory.map_or_else(|| "unlimited".into(), approx_size)
        ),
    };
    // Starting runs too: started, not yet seen up past its first second.
    let running = status.state.runs();
    d = d
        .field("Status", status.state.to_string())
        .field("Ready", if status.ready { "True" } else { "False" })
        .field("Address", status.address.to_string())
        .field("Restarts", status.restarts.to_string())
        .field(
            "Last Exit",
            last_exit_cell(status.last_exit.as_ref(), now_unix),
        )
        .field(
            "Retry In",
            status.retry_in_secs.map_or_else(|| "-".into(), format_secs),
        )
        .field(
            "Epoch",
            status.epoch.map_or_else(|| "-".into(), |e| e.to_string()),
        )
        .field("Created", when(status.created_unix, now_unix))
        .field("Resources", resources)
        .field(
            "Last Error",
            or_none(status.last_error.as_deref().map(one_line)),
        );
    let conditions = table(&[
        vec!["TYPE".into(), "STATUS".into()],
        vec!["Running".into(), title_bool(running)],
        vec!["Ready".into(), title_bool(status.ready)],
    ]);
    d = d.section("Conditions", conditions);
    if let Some(document) = document {
        d = d.section("Spec", spec_of(document));
    }
    d
}

fn title_bool(b: bool) -> String {
    if b { "True" } else { "False" }.to_string()
}

/// `describe service NAME`.
pub fn service(status: &ServiceStatus, document: Option<&str>) -> Description {
    let rollout = match &status.rollout {
        None => "-".to_string(),
        Some(r) => match &r.reason {
            Some(why) => format!(
                "revision {} {} ({})",
                r.revision,
                one_line(&r.state),
                one_line(why)
            ),
            None => format!("revision {} {}", r.revision, one_line(&r.state)),
        },
    };
    let mut d = Description::default()
        .field("Name", one_line(&status.name))
        .field("Kind", "Service")
        .field("VIP", format!("{}:{}", status.vip, status.port))
        .field(
            "Replicas",
            format!(
                "{} desired, {} ready, {} up to date",
                status.desired, status.ready, status.updated
            ),
        )
        .field("Revision", status.revision.to_string())
        .field("Rollout", rollout)
        .field("Stateful", title_bool(status.stateful));
    let mut rows = vec![
        ["NAME", "NODE", "ADDRESS", "STATE", "READY", "REVISION"]
            .map(String::from)
            .to_vec(),
    ];
    rows.extend(status.replicas.iter().map(|r| {
        vec![
            one_line(&r.name),
            one_line(&r.node),
            r.address.map_or_else(|| "-".into(), |a| a.to_string()),
            one_line(&r.state),
            title_bool(r.ready),
            r.revision.map_or_else(|| "-".into(), |v| v.to_string()),
        ]
    }));
    let available = status.ready >= status.desired;
    d = d.section(
        "Conditions",
        table(&[
            vec!["TYPE".into(), "STATUS".into()],
            vec!["Available".into(), title_bool(available)],
            vec![
                "Progressing".into(),
                title_bool(
                    status
                        .rollout
                        .as_ref()
                        .is_some_and(|r| r.state == "Progressing"),
                ),
            ],
        ]),
    );
    d = d.section(
        "Replicas",
        if status.replicas.is_empty() {
            String::new()
        } else {
            table(&rows)
        },
    );
    if let Some(document) = document {
        d = d.section("Spec", spec_of(document));
    }
    d
}

/// `describe node NAME`; `jails` are the names its agent lists, when it
/// could be asked.
pub fn node(status: &NodeStatus, jails: Option<&[String]>) -> Description {
    let mut d = Description::default()
        .field("Name", one_line(&status.node_id))
        .field("Kind", "Node")
        .field("Status", status.status.to_string())
        .field("Cordoned", title_bool(status.cordoned))
        .field("Address", status.address.to_string())
        .field("Pod CIDR", one_line(&status.pod_cidr))
        .field(
            "Capacity",
            format!(
                "cpu {}, memory {}",
                cores(status.capacity.cpu),
                approx_size(status.capacity.memory)
            ),
        )
        .field(
            "Committed",
            format!(
                "cpu {}, memory {}",
                cores(status.committed.cpu),
                approx_size(status.committed.memory)
            ),
        )
        .field(
            "Last Seen",
            status
                .last_seen_secs
                .map_or_else(|| "never".into(), |s| format!("{} ago", format_secs(s))),
        );
    d = d.section(
        "Conditions",
        table(&[
            vec!["TYPE".into(), "STATUS".into()],
            vec![
                "Alive".into(),
                title_bool(status.status == crate::common::wire::Liveness::Alive),
            ],
            vec!["Schedulable".into(), title_bool(!status.cordoned)],
        ]),
    );
    let listed = match jails {
        Some(names) => names
            .iter()
            .map(|n| one_line(n))
            .collect::<Vec<_>>()
            .join("\n"),
        None => format!(
            "{} (the node could not be asked for their names)",
            status.jails
        ),
    };
    d.section("Jails", listed)
}

/// `describe volume NAME`.
pub fn volume(status: &VolumeStatus) -> Description {
    let mut d = Description::default()
        .field("Name", one_line(&status.name))
        .field("Kind", "Volume");
    if let Some(node) = &status.node {
        d = d.field("Node", one_line(node));
    }
    d.field("Dataset", or_none(status.dataset.as_deref().map(one_line)))
        .field(
            "Quota",
            status.quota.map_or_else(|| "none".into(), approx_size),
        )
        .field("Used", status.used.map_or_else(|| "?".into(), approx_size))
        .field(
            "Mounted By",
            or_none(status.mounted_by.as_deref().map(one_line)),
        )
        .field("Error", or_none(status.error.as_deref().map(one_line)))
}

/// `describe ingress NAME`.
pub fn ingress(status: &IngressStatus, node: Option<&str>, document: Option<&str>) -> Description {
    let mut d = Description::default()
        .field("Name", one_line(&status.name))
        .field("Kind", "Ingress");
    if let Some(node) = node {
        d = d.field("Node", one_line(node));
    }
    d = d
        .field("Host", one_line(&status.host))
        .field("Service", one_line(&status.service))
        .field("Phase", status.phase.to_string())
        .field(
            "Certificate Expires",
            status
                .certificate_expires
                .map_or_else(|| "-".into(), utc_datetime),
        )
        .field(
            "Last Error",
            or_none(status.last_error.as_deref().map(one_line)),
        );
    if let Some(document) = document {
        d = d.section("Spec", spec_of(document));
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::wire::{IngressPhase, Phase};

    fn web() -> JailStatus {
        JailStatus {
            name: "web-1".into(),
            state: Phase::Running,
            address: "127.64.1.2".parse().expect("ip"),
            restarts: 2,
            ready: false,
            created_unix: 1_000,
            last_error: None,
            retry_in_secs: None,
            epoch: Some(7),
            cpu: Some(0.5),
            memory: Some(512 << 20),
            last_exit: None,
        }
    }

    #[test]
    fn fields_line_up_and_sections_indent_with_none_for_empty() {
        let text = Description::default()
            .field("Name", "x")
            .field("Certificate Expires", "-")
            .section("Events", "")
            .section("Spec", "base: 14.2-RELEASE\nexec:\n  start: [a]\n")
            .render();
        assert_eq!(
            text,
            "Name:                 x\nCertificate Expires:  -\nEvents:\n  <none>\nSpec:\n  base: 14.2-RELEASE\n  exec:\n    start: [a]\n"
        );
    }

    #[test]
    fn a_jail_shows_status_conditions_and_its_spec() {
        let doc = "kind: Jail\nmetadata:\n  name: web-1\nspec:\n  base: 14.2-RELEASE\n";
        let text = jail(&web(), Some("n2"), Some(doc), 1_065).render();
        for line in [
            "Name:         web-1\n",
            "Node:         n2\n",
            "Status:       Running\n",
            "Ready:        False\n",
            "Restarts:     2\n",
            "Epoch:        7\n",
            "Created:      1970-01-01T00:16:40Z (1m ago)\n",
            "Resources:    cpu 0.5, memory 512M\n",
            "Last Error:   <none>\n",
            "Conditions:\n  TYPE      STATUS\n  Running   True\n  Ready     False\n",
            "Spec:\n  base: 14.2-RELEASE\n",
        ] {
            assert!(text.contains(line), "{line:?} in\n{text}");
        }
    }

    #[test]
    fn daemon_text_cannot_forge_lines() {
        let mut status = IngressStatus {
            name: "shop".into(),
            host: "shop.example.com".into(),
            service: "web".into(),
            phase: IngressPhase::BackingOff,
            certificate_expires: None,
            last_error: Some("order failed\nName: forged".into()),
        };
        let text = ingress(&status, Some("n1"), None).render();
        assert!(!text.contains("\nName: forged"), "{text}");
        status.last_error = None;
        assert!(
            ingress(&status, None, None)
                .render()
                .contains("Last Error:           <none>\n")
        );
    }
}
