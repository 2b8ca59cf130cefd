//! Where things are: a pass over the YAML event stream (yaml-rust2, which marks
//! every event) that records, per document, the line and column of every field
//! path (`spec.volumes[1].mountPath`), the document's `kind`, and duplicate keys.
//! It owns positions only; it never interprets values beyond sniffing `kind`.
//!
//! serde_yaml's `Value` carries no positions and its typed errors only cover
//! what serde itself rejects, so semantic validation errors look their field up
//! here. Paths are recorded only down to [`MAX_DEPTH`] so a hostile, deeply
//! nested document cannot make the map quadratic in the input size.

use std::collections::{HashMap, HashSet};

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

use super::error::SpecError;

/// Deepest nesting whose paths are recorded; specs nest at most five levels.
const MAX_DEPTH: usize = 16;

/// A 1-based line and column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pos {
    pub(crate) line: usize,
    pub(crate) column: usize,
}

impl Pos {
    fn of(mark: Marker) -> Pos {
        // yaml-rust2 counts lines from 1 but columns from 0; serde_yaml counts both
        // from 1, and so do editors.
        Pos {
            line: mark.line(),
            column: mark.col() + 1,
        }
    }
}

/// The top-level `kind` of a document as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Kind {
    /// No `kind` key.
    Missing,
    /// A scalar value.
    Scalar(String),
    /// A mapping, sequence or alias.
    NotScalar,
}

/// Positions and facts about one YAML document.
#[derive(Debug, Clone)]
pub(crate) struct DocMap {
    /// 1-based index in the stream.
    pub(crate) index: usize,
    /// The document holds nothing (or only `~`): skipped, like kubectl does.
    pub(crate) empty: bool,
    /// The root node is a mapping.
    pub(crate) root_is_map: bool,
    /// Position of the root node.
    pub(crate) root: Option<Pos>,
    /// The top-level `kind`.
    pub(crate) kind: Kind,
    /// The first key repeated within one mapping: its path and position.
    pub(crate) duplicate: Option<(String, Pos)>,
    values: HashMap<String, Pos>,
    keys: HashMap<String, Pos>,
}

impl DocMap {
    /// An empty map for document `index` (for errors outside any scanned document).
    pub(crate) fn empty_at(index: usize) -> DocMap {
        DocMap {
            index,
            empty: false,
            root_is_map: false,
            root: None,
            kind: Kind::Missing,
            duplicate: None,
            values: HashMap::new(),
            keys: HashMap::new(),
        }
    }

    /// Position of `field`'s value, else its key, else its nearest ancestor's
    /// (a missing field is reported where its parent mapping is).
    pub(crate) fn position(&self, field: &str) -> Option<Pos> {
        let mut path = field;
        loop {
            if let Some(p) = self.values.get(path).or_else(|| self.keys.get(path)) {
                return Some(*p);
            }
            if path.is_empty() {
                return self.root;
            }
            path = parent(path);
        }
    }

    /// True when `field` occurs in the document (as a key or a value).
    pub(crate) fn knows(&self, field: &str) -> bool {
        self.values.contains_key(field) || self.keys.contains_key(field)
    }

    /// Builds a [`SpecError`] for `field` at its recorded position.
    pub(crate) fn error(&self, field: &str, message: impl Into<String>) -> SpecError {
        let pos = self.position(field);
        SpecError {
            document: self.index,
            field: field.to_string(),
            line: pos.map(|p| p.line),
            column: pos.map(|p| p.column),
            message: message.into(),
        }
    }
}

/// `spec.volumes[1].name` -> `spec.volumes[1]` -> `spec.volumes` -> `spec` -> ``.
fn parent(path: &str) -> &str {
    if let Some(stripped) = path.strip_suffix(']') {
        if let Some(i) = stripped.rfind('[') {
            return &path[..i];
        }
    }
    match path.rfind(['.', '[']) {
        Some(i) => &path[..i],
        None => "",
    }
}

/// `parent` + `key` in serde_yaml's path notation (which SpecError shares).
pub(crate) fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_string()
    } else {
        format!("{parent}.{key}")
    }
}

enum FrameKind {
    Map {
        /// The path of the value now being read, once its key has been seen.
        pending: Option<Option<String>>,
        seen: HashSet<String>,
    },
    Seq {
        next: usize,
    },
}

struct Frame {
    /// `None` below [`MAX_DEPTH`]: nothing is recorded there.
    path: Option<String>,
    kind: FrameKind,
    /// This collection is a mapping key (complex key): its end does not finish a
    /// value in the parent.
    is_key: bool,
    /// Record the position of the first child under this path (block
    /// collections have no useful start mark of their own).
    fill: Option<String>,
    start: Pos,
}

struct Scan {
    docs: Vec<DocMap>,
    stack: Vec<Frame>,
}

/// What the new node is, as seen from its parent.
enum Slot {
    Root,
    Key,
    Value(Option<String>),
}

impl Scan {
    fn doc(&mut self) -> Option<&mut DocMap> {
        self.docs.last_mut()
    }

    /// Works out the path of the node that starts now and updates the parent.
    fn slot(&mut self, pos: Pos) -> Slot {
        let depth = self.stack.len();
        let Some(top) = self.stack.last_mut() else {
            return Slot::Root;
        };
        if let Some(fill) = top.fill.take() {
            if let Some(doc) = self.docs.last_mut() {
                doc.values.entry(fill).or_insert(pos);
            }
        }
        match &mut top.kind {
            FrameKind::Map { pending, .. } => match pending.take() {
                Some(path) => Slot::Value(path),
                None => Slot::Key,
            },
            FrameKind::Seq { next } => {
                let i = *next;
                *next += 1;
                Slot::Value(match &top.path {
                    Some(p) if depth < MAX_DEPTH => Some(format!("{p}[{i}]")),
                    _ => None,
                })
            }
        }
    }

    /// A scalar key was read: record it, check for duplicates, remember where
    /// its value goes.
    fn key(&mut self, key: &str, pos: Pos) {
        let depth = self.stack.len();
        let Some(top) = self.stack.last_mut() else {
            return;
        };
        let path = match &top.path {
            Some(p) if depth < MAX_DEPTH => Some(join(p, key)),
            _ => None,
        };
        if let FrameKind::Map { pending, seen } = &mut top.kind {
            let fresh = seen.insert(key.to_string());
            if let (Some(path), Some(doc)) = (&path, self.docs.last_mut()) {
                if !fresh && doc.duplicate.is_none() {
                    doc.duplicate = Some((path.clone(), pos));
                }
                doc.keys.entry(path.clone()).or_insert(pos);
            }
            *pending = Some(path);
        }
    }

    fn value_at(&mut self, path: &Option<String>, pos: Pos) {
        if let (Some(path), Some(doc)) = (path, self.doc()) {
            doc.values.entry(path.clone()).or_insert(pos);
        }
    }

    fn scalar(&mut self, value: &str, pos: Pos) {
        match self.slot(pos) {
            Slot::Root => {
                if let Some(doc) = self.doc() {
                    doc.root = Some(pos);
                    doc.empty = matches!(value, "" | "~" | "null");
                }
            }
            Slot::Key => self.key(value, pos),
            Slot::Value(path) => {
                if self.stack.len() == 1 && path.as_deref() == Some("kind") {
                    if let Some(doc) = self.doc() {
                        doc.kind = Kind::Scalar(value.to_string());
                    }
                }
                self.value_at(&path, pos);
            }
        }
    }

    fn alias(&mut self, pos: Pos) {
        match self.slot(pos) {
            Slot::Root => {
                if let Some(doc) = self.doc() {
                    doc.root = Some(pos);
                }
            }
            Slot::Key => self.key("*alias", pos),
            Slot::Value(path) => {
                self.note_non_scalar_kind(&path);
                self.value_at(&path, pos);
            }
        }
    }

    fn note_non_scalar_kind(&mut self, path: &Option<String>) {
        if self.stack.len() == 1 && path.as_deref() == Some("kind") {
            if let Some(doc) = self.doc() {
                doc.kind = Kind::NotScalar;
            }
        }
    }

    fn start(&mut self, is_map: bool, pos: Pos) {
        let kind = if is_map {
            FrameKind::Map {
                pending: None,
                seen: HashSet::new(),
            }
        } else {
            FrameKind::Seq { next: 0 }
        };
        let (path, is_key, fill) = match self.slot(pos) {
            Slot::Root => {
                if let Some(doc) = self.doc() {
                    doc.root_is_map = is_map;
                }
                (Some(String::new()), false, None)
            }
            // A complex key: serde refuses it; record nothing beneath it.
            Slot::Key => {
                self.key("?", pos);
                (None, true, None)
            }
            Slot::Value(path) => {
                self.note_non_scalar_kind(&path);
                // A mapping value already has its key's position; a sequence
                // element gets the position of its first child.
                let has_key = path
                    .as_ref()
                    .is_some_and(|p| self.docs.last().is_some_and(|d| d.keys.contains_key(p)));
                let fill = if has_key { None } else { path.clone() };
                if let (true, Some(p)) = (has_key, &path) {
                    if let Some(doc) = self.doc() {
                        if let Some(k) = doc.keys.get(p).copied() {
                            doc.values.entry(p.clone()).or_insert(k);
                        }
                    }
                }
                (path, false, fill)
            }
        };
        let fill = if self.stack.is_empty() {
            Some(String::new())
        } else {
            fill
        };
        self.stack.push(Frame {
            path,
            kind,
            is_key,
            fill,
            start: pos,
        });
    }

    fn end(&mut self) {
        let Some(frame) = self.stack.pop() else {
            return;
        };
        if let Some(fill) = frame.fill {
            if let Some(doc) = self.doc() {
                if fill.is_empty() {
                    doc.root.get_or_insert(frame.start);
                }
                doc.values.entry(fill).or_insert(frame.start);
            }
        }
        if frame.is_key {
            // The key is done; its value comes next, at the path `key` set.
            return;
        }
        if self.stack.is_empty() {
            if let Some(doc) = self.doc() {
                if doc.root.is_none() {
                    doc.root = doc.values.get("").copied();
                }
            }
        }
    }
}

impl MarkedEventReceiver for Scan {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        let pos = Pos::of(mark);
        match ev {
            Event::DocumentStart => {
                let index = self.docs.len() + 1;
                self.docs.push(DocMap::empty_at(index));
                self.stack.clear();
            }
            Event::Scalar(value, ..) => self.scalar(&value, pos),
            Event::Alias(_) => self.alias(pos),
            Event::MappingStart(..) => self.start(true, pos),
            Event::SequenceStart(..) => self.start(false, pos),
            Event::MappingEnd | Event::SequenceEnd => self.end(),
            Event::Nothing | Event::StreamStart | Event::StreamEnd | Event::DocumentEnd => {}
        }
    }
}

/// Scans `text`: one [`DocMap`] per document, in order, and the YAML syntax
/// error that stopped the scan, if any (its document index is the document it
/// occurred in, so earlier documents' own errors can still be reported first).
pub(crate) fn scan(text: &str) -> (Vec<DocMap>, Option<SpecError>) {
    let mut scan = Scan {
        docs: Vec::new(),
        stack: Vec::new(),
    };
    let mut parser = Parser::new_from_str(text);
    let error = parser.load(&mut scan, true).err().map(|e| {
        let pos = Pos::of(*e.marker());
        SpecError {
            document: scan.docs.len().max(1),
            field: String::new(),
            line: Some(pos.line),
            column: Some(pos.column),
            message: format!("invalid YAML: {}", e.info()),
        }
    });
    (scan.docs, error)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
kind: Jail
metadata:
  name: web
spec:
  base: 14.2-RELEASE
  exec: {start: [/bin/sh, /etc/rc]}
  volumes:
    - name: data
      mountPath: /data
---
kind: Service
";

    #[test]
    fn records_values_keys_and_kind_per_document() {
        let (docs, err) = scan(TEXT);
        assert!(err.is_none());
        assert_eq!(docs.len(), 2);
        let d = &docs[0];
        assert_eq!(d.kind, Kind::Scalar("Jail".into()));
        assert_eq!(d.position("kind"), Some(Pos { line: 1, column: 7 }));
        assert_eq!(
            d.position("metadata.name"),
            Some(Pos { line: 3, column: 9 })
        );
        assert_eq!(
            d.position("spec.exec.start[1]"),
            Some(Pos {
                line: 6,
                column: 27
            })
        );
        assert_eq!(
            d.position("spec.volumes[0].mountPath"),
            Some(Pos {
                line: 9,
                column: 18
            })
        );
        // A block mapping in a sequence is placed at its first key.
        assert_eq!(
            d.position("spec.volumes[0]"),
            Some(Pos { line: 8, column: 7 })
        );
        // A mapping value is placed at its key.
        assert_eq!(d.position("spec.exec"), Some(Pos { line: 6, column: 3 }));
        // Missing fields fall back to the nearest ancestor.
        assert_eq!(
            d.position("spec.volumes[0].size"),
            d.position("spec.volumes[0]")
        );
        assert_eq!(docs[1].index, 2);
        assert_eq!(docs[1].kind, Kind::Scalar("Service".into()));
    }

    #[test]
    fn parent_walks_up_paths() {
        assert_eq!(parent("spec.volumes[1].name"), "spec.volumes[1]");
        assert_eq!(parent("spec.volumes[1]"), "spec.volumes");
        assert_eq!(parent("spec.volumes"), "spec");
        assert_eq!(parent("spec"), "");
    }

    #[test]
    fn finds_duplicate_keys() {
        let (docs, _) = scan("kind: Jail\nspec:\n  env:\n    A: x\n    A: y\n");
        assert_eq!(
            docs[0].duplicate,
            Some(("spec.env.A".to_string(), Pos { line: 5, column: 5 }))
        );
    }

    #[test]
    fn empty_documents_are_marked() {
        let (docs, _) = scan("---\n---\nkind: Jail\n---\n~\n---\nnull\n");
        let empty: Vec<bool> = docs.iter().map(|d| d.empty).collect();
        assert_eq!(empty, [true, false, true, true]);
    }

    #[test]
    fn syntax_error_names_its_document_and_line() {
        let (docs, err) = scan("kind: Jail\n---\nkind: [\n");
        let err = err.expect("syntax error");
        assert_eq!(docs.len(), 2);
        assert_eq!(err.document, 2);
        assert!(err.line.is_some_and(|l| l >= 3), "{err}");
    }

    #[test]
    fn deep_nesting_records_bounded_paths() {
        let text = format!("a: {}{}", "[".repeat(200), "]".repeat(200));
        let (docs, err) = scan(&text);
        assert!(err.is_none(), "{err:?}");
        assert!(docs[0].values.len() <= MAX_DEPTH + 1);
        // Deeper than the parser allows: an error, not a crash.
        let text = format!("a: {}{}", "[".repeat(100_000), "]".repeat(100_000));
        let (_, err) = scan(&text);
        assert!(err.is_some_and(|e| e.message.contains("recursion limit")));
    }
}
