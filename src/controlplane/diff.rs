//! The object diff of a Service against the one the control plane holds
//! (`POST /services/{name}/diff`).
//!
//! The control plane never parses specs (`common::spec` is not imported
//! here): both documents are read as plain YAML values and compared with
//! [`crate::common::objdiff`], so the paths are the document's own
//! (`spec.template.exec.start`). What the apply would do is decided from the
//! fields keelctl states beside the document, as [`Cluster::put_service`]
//! decides it: a new template digest is a rolling update (its replicas are
//! replaced, each on its node), a new count or rollout policy changes the
//! service in place. A replica's host commands are its node's: this module
//! lists none, and says so.
//!
//! [`Cluster::put_service`]: crate::controlplane::registry::Cluster::put_service

use serde_json::Value;

use crate::common::objdiff;
use crate::common::wire::{DryRunAction, DryRunReport, ServiceApply};

/// The report for service `name`: `apply` against `held` (`None`: no such
/// service yet). An error names the document that is not YAML.
pub fn service_report(
    name: &str,
    held: Option<&ServiceApply>,
    apply: &ServiceApply,
) -> Result<DryRunReport, String> {
    let parse = |which: &str, doc: &str| {
        serde_yaml::from_str::<Value>(doc)
            .map_err(|e| format!("the {which} Service document is not YAML: {e}"))
    };
    let new = parse("new", &apply.document)?;
    let old = held.map(|h| parse("recorded", &h.document)).transpose()?;
    let changes = objdiff::diff(old.as_ref(), &new);
    let mut because: Vec<String> = Vec::new();
    for c in &changes {
        let s = objdiff::section(&c.path);
        if !because.contains(&s) {
            because.push(s);
        }
    }
    let (action, note) = match held {
        None => (DryRunAction::Create, None),
        Some(h) if h.template_digest != apply.template_digest => (
            DryRunAction::Replace,
            Some(
                "a rolling update replaces the replicas one at a time, within spec.update; \
                 each replica's host commands are its node's: dry-run the replica's jail there"
                    .to_string(),
            ),
        ),
        Some(_) if changes.is_empty() => (DryRunAction::Nothing, None),
        Some(_) => (DryRunAction::UpdateInPlace, None),
    };
    Ok(DryRunReport {
        kind: "Service".into(),
        name: name.to_string(),
        node: None,
        changes,
        action,
        because: if action == DryRunAction::Replace {
            vec!["spec.template".into()]
        } else {
            because
        },
        commands: Vec::new(),
        note,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(replicas: u32, start: &str, digest: &str) -> ServiceApply {
        ServiceApply {
            document: format!(
                "kind: Service\nmetadata:\n  name: web\nspec:\n  replicas: {replicas}\n  template:\n    exec:\n      start: [{start}]\n"
            ),
            replicas,
            port: 80,
            stateful: false,
            template_digest: digest.into(),
            volumes: Vec::new(),
            policy: Default::default(),
            resources: None,
        }
    }

    #[test]
    fn a_new_template_is_a_rolling_update_and_a_count_changes_in_place() {
        let held = apply(2, "/bin/a", "d1");
        let report = service_report("web", Some(&held), &apply(2, "/bin/b", "d2")).expect("yaml");
        assert_eq!(report.action, DryRunAction::Replace);
        assert_eq!(report.changes[0].path, "spec.template.exec.start");
        let report = service_report("web", Some(&held), &apply(3, "/bin/a", "d1")).expect("yaml");
        assert_eq!(report.action, DryRunAction::UpdateInPlace);
        assert_eq!(report.because, ["spec.replicas"]);
        let same = service_report("web", Some(&held), &held).expect("yaml");
        assert_eq!(same.action, DryRunAction::Nothing);
        assert!(same.changes.is_empty());
        let new = service_report("web", None, &held).expect("yaml");
        assert_eq!(new.action, DryRunAction::Create);
    }
}
