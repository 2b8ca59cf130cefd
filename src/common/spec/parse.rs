//! From text to validated documents: splits the YAML stream, sniffs each
//! document's `kind`, deserialises it with serde_yaml, validates it, and turns
//! every failure into a [`SpecError`] placed at its field's line and column. It
//! owns the order of the errors (document order, each document's fields in the
//! order the rules check them); the rules themselves live in `validate.rs` and
//! positions in `locate.rs`.

use serde::Deserialize;
use serde::de::IgnoredAny;

use super::error::{FieldError, SpecError};
use super::locate::{self, DocMap, Kind, Pos};
use super::types::{
    Document, Ingress, IngressSpec, Jail, JailSpec, Metadata, Service, ServiceSpec,
};
use super::validate;

/// The kinds, as written in `kind:`.
pub const KINDS: [&str; 3] = ["Jail", "Service", "Ingress"];

/// A parsed, validated document and where its fields are.
pub(crate) struct Located {
    pub(crate) doc: Document,
    pub(crate) map: DocMap,
}

// The top level of each kind exactly as written, `kind` included, so
// deny_unknown_fields covers the top level too and serde_yaml reports errors
// with their positions (an internally tagged enum would buffer the document and
// lose them).
macro_rules! tagged {
    ($name:ident, $spec:ty) => {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct $name {
            #[allow(dead_code)]
            kind: IgnoredAny,
            metadata: Metadata,
            spec: $spec,
            // What `keelctl get NAME -o yaml` prints after the spec, so its
            // output applies back; the daemons own status, so it is dropped.
            #[allow(dead_code)]
            #[serde(default)]
            status: Option<IgnoredAny>,
        }
    };
}
tagged!(TaggedJail, JailSpec);
tagged!(TaggedService, ServiceSpec);
tagged!(TaggedIngress, IngressSpec);

/// Parses and validates every document of `text`; empty documents are skipped.
/// Every problem is returned, in document order: each document's shape error
/// (serde stops at the first), or else all its rule violations, and a YAML
/// syntax error last, since nothing after it can be read.
pub(crate) fn parse_located(text: &str) -> Result<Vec<Located>, Vec<SpecError>> {
    let (maps, scan_error) = locate::scan(text);
    // Documents before a syntax error are still checked first, so errors come
    // out in document order.
    let usable = match &scan_error {
        Some(e) => e.document.saturating_sub(1).min(maps.len()),
        None => maps.len(),
    };
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        if i >= usable {
            if scan_error.is_some() {
                break;
            }
            // serde_yaml reports one null document for an empty stream, which
            // yaml-rust2 does not; anything else here means the parsers disagree.
            match serde_yaml::Value::deserialize(de) {
                Ok(serde_yaml::Value::Null) => continue,
                Ok(_) => {
                    errors.push(SpecError {
                        document: i + 1,
                        field: String::new(),
                        line: None,
                        column: None,
                        message: "the YAML parsers disagree on where this document starts; \
                                  separate documents with a line holding only ---"
                            .into(),
                    });
                }
                Err(e) => errors.push(serde_error(e, &DocMap::empty_at(i + 1))),
            }
            break;
        }
        let map = &maps[i];
        if map.empty {
            continue;
        }
        let doc = match one(de, map) {
            Ok(doc) => doc,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        let problems = validate::document(&doc);
        if problems.is_empty() {
            out.push(Located {
                doc,
                map: map.clone(),
            });
        } else {
            errors.extend(problems.into_iter().map(|e| field_error(e, map)));
        }
    }
    errors.extend(scan_error);
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

fn one(de: serde_yaml::Deserializer<'_>, map: &DocMap) -> Result<Document, SpecError> {
    if let Some((field, pos)) = &map.duplicate {
        return Err(SpecError {
            document: map.index,
            field: field.clone(),
            line: Some(pos.line),
            column: Some(pos.column),
            message: "appears twice in the same mapping; give each key once".into(),
        });
    }
    if !map.root_is_map {
        return Err(map.error(
            "",
            "a document must be a mapping with kind, metadata and spec",
        ));
    }
    let kind = match &map.kind {
        Kind::Missing => {
            return Err(map.error(
                "kind",
                "missing: every document needs kind: Jail, kind: Service or kind: Ingress",
            ));
        }
        Kind::NotScalar => {
            return Err(map.error("kind", "must be one of Jail, Service or Ingress"));
        }
        Kind::Scalar(k) => k.as_str(),
    };
    let doc = match kind {
        "Jail" => TaggedJail::deserialize(de).map(|t| {
            Document::Jail(Jail {
                metadata: t.metadata,
                spec: t.spec,
            })
        }),
        "Service" => TaggedService::deserialize(de).map(|t| {
            Document::Service(Service {
                metadata: t.metadata,
                spec: t.spec,
            })
        }),
        "Ingress" => TaggedIngress::deserialize(de).map(|t| {
            Document::Ingress(Ingress {
                metadata: t.metadata,
                spec: t.spec,
            })
        }),
        other => {
            return Err(map.error(
                "kind",
                format!("unknown kind {other:?}: expected Jail, Service or Ingress"),
            ));
        }
    };
    doc.map_err(|e| serde_error(e, map))
}

fn field_error(e: FieldError, map: &DocMap) -> SpecError {
    map.error(&e.field, e.message)
}

/// Turns a serde_yaml error into a SpecError. serde_yaml renders
/// `<path>: <message> at line L column C`; the path uses the same notation as
/// ours, so it is kept when the document really has that path. Unknown,
/// missing and duplicate field messages name the field, which is appended to
/// the path so the error points at the field itself.
fn serde_error(e: serde_yaml::Error, map: &DocMap) -> SpecError {
    let loc = e.location().map(|l| Pos {
        line: l.line(),
        column: l.column(),
    });
    let mut text = e.to_string();
    if let Some(l) = &e.location() {
        let suffix = format!(" at line {} column {}", l.line(), l.column());
        if let Some(stripped) = text.strip_suffix(&suffix) {
            text = stripped.to_string();
        }
    }
    let (mut path, message) = match text.split_once(": ") {
        Some((p, m)) if map.knows(p) => (p.to_string(), m.to_string()),
        _ => (String::new(), text.clone()),
    };
    let mut pos = loc;
    for prefix in ["unknown field `", "missing field `", "duplicate field `"] {
        if let Some(name) = message
            .strip_prefix(prefix)
            .and_then(|rest| rest.split('`').next())
        {
            if prefix.starts_with("missing") {
                // serde_yaml places it at the mapping's first key; the mapping's
                // own key (`exec:`) is where the author has to add it.
                pos = map.position(&path).or(pos);
            }
            path = locate::join(&path, name);
        }
    }
    let pos = pos.or_else(|| map.position(&path));
    SpecError {
        document: map.index,
        field: path,
        line: pos.map(|p| p.line),
        column: pos.map(|p| p.column),
        message,
    }
}
