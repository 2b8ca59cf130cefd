//! The object diff of `keelctl diff` and `apply --dry-run`: which fields of a
//! JSON document differ from the one a daemon holds.
//!
//! It compares JSON values (the serde form of a spec), so the control plane
//! can diff documents it never parses as specs, and both daemons print the
//! same paths. Objects are walked key by key (`spec.exec.start`); a list of
//! objects is walked item by item (`spec.volumes[0].size`), so one changed
//! volume names its field; any other list (an argv, say) is one value, as an
//! operator reads it. `null` and an absent key are the same: an omitted
//! optional field and one written out as empty are one spec.
//!
//! Pure functions; never touches the host or any state.

use serde_json::Value;

use crate::common::wire::{ChangeKind, FieldChange};

/// Every field that differs between `old` (`None`: nothing held) and `new`,
/// in document order of the keys (sorted by key, as serde_json keeps them).
pub fn diff(old: Option<&Value>, new: &Value) -> Vec<FieldChange> {
    let mut out = Vec::new();
    walk("", old.unwrap_or(&Value::Null), new, &mut out);
    out
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

fn is_object_list(v: &Value) -> bool {
    matches!(v, Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_object))
}

fn walk(path: &str, old: &Value, new: &Value, out: &mut Vec<FieldChange>) {
    if old == new {
        return;
    }
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            for key in keys {
                let o = a.get(key).unwrap_or(&Value::Null);
                let n = b.get(key).unwrap_or(&Value::Null);
                walk(&join(path, key), o, n, out);
            }
        }
        (Value::Array(a), Value::Array(b)) if is_object_list(old) && is_object_list(new) => {
            for i in 0..a.len().max(b.len()) {
                let o = a.get(i).unwrap_or(&Value::Null);
                let n = b.get(i).unwrap_or(&Value::Null);
                walk(&format!("{path}[{i}]"), o, n, out);
            }
        }
        (Value::Null, Value::Object(b)) => {
            for (key, n) in b {
                walk(&join(path, key), &Value::Null, n, out);
            }
        }
        (Value::Object(a), Value::Null) => {
            for (key, o) in a {
                walk(&join(path, key), o, &Value::Null, out);
            }
        }
        (Value::Null, n) => out.push(FieldChange {
            path: path.to_string(),
            kind: ChangeKind::Added,
            old: None,
            new: Some(n.clone()),
        }),
        (o, Value::Null) => out.push(FieldChange {
            path: path.to_string(),
            kind: ChangeKind::Removed,
            old: Some(o.clone()),
            new: None,
        }),
        (o, n) => out.push(FieldChange {
            path: path.to_string(),
            kind: ChangeKind::Changed,
            old: Some(o.clone()),
            new: Some(n.clone()),
        }),
    }
}

/// The top two levels of a change's path (`spec.exec.start` -> `spec.exec`),
/// for a `would:` line's reason.
pub fn section(path: &str) -> String {
    let head: Vec<&str> = path
        .split('.')
        .take(2)
        .map(|p| p.split('[').next().unwrap_or(p))
        .collect();
    head.join(".")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nested_fields_are_named_by_path() {
        let old = json!({"spec": {"exec": {"start": ["/bin/a"]}, "resources": {"memory": 1}}});
        let new = json!({"spec": {"exec": {"start": ["/bin/b"]}, "resources": {"memory": 1, "cpu": 2.0}}});
        let d = diff(Some(&old), &new);
        assert_eq!(d.len(), 2, "{d:?}");
        assert_eq!(d[0].path, "spec.exec.start");
        assert_eq!(d[0].kind, ChangeKind::Changed);
        assert_eq!(d[1].path, "spec.resources.cpu");
        assert_eq!(d[1].kind, ChangeKind::Added);
    }

    #[test]
    fn same_documents_and_null_versus_absent_differ_in_nothing() {
        let a = json!({"spec": {"hostname": null, "env": {"A": "1"}}});
        let b = json!({"spec": {"env": {"A": "1"}}});
        assert!(diff(Some(&a), &b).is_empty());
        assert!(diff(Some(&b), &b).is_empty());
    }

    #[test]
    fn object_lists_are_compared_item_by_item_and_a_new_object_is_all_added() {
        let old = json!({"v": [{"name": "a", "size": 1}]});
        let new = json!({"v": [{"name": "a", "size": 2}, {"name": "b"}]});
        let paths: Vec<String> = diff(Some(&old), &new).into_iter().map(|c| c.path).collect();
        assert_eq!(paths, ["v[0].size", "v[1].name"]);
        let all = diff(None, &new);
        assert!(all.iter().all(|c| c.kind == ChangeKind::Added));
        // A list that is gone is one removed value.
        assert_eq!(diff(Some(&new), &json!({})).len(), 1);
    }

    #[test]
    fn sections_are_the_first_two_levels() {
        assert_eq!(section("spec.exec.start"), "spec.exec");
        assert_eq!(section("spec.volumes[0].size"), "spec.volumes");
        assert_eq!(section("metadata"), "metadata");
    }
}
