//! The one error type of spec parsing and validation. It owns the rendering of
//! "document N, field (line L, column C): message"; it never decides what is
//! wrong (that is `validate.rs`) or where (that is `locate.rs`).

use std::fmt;

/// Why a spec was refused: which document, which field, where, and what to fix.
///
/// Rendered as
/// `document 2, spec.volumes[1].mountPath (line 14, column 18): must be an absolute path`.
/// The field is empty for problems with the document as a whole (YAML syntax, a
/// document that is not a mapping); line and column are absent only when the spec
/// did not come from text (see [`super::Document::validate`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecError {
    /// 1-based index of the YAML document in the stream.
    pub document: usize,
    /// Path of the offending field, e.g. `spec.volumes[1].mountPath`.
    pub field: String,
    /// 1-based line of the field's value (or key) in the input.
    pub line: Option<usize>,
    /// 1-based column of the field's value (or key) in the input.
    pub column: Option<usize>,
    /// What is wrong, phrased so the author can fix it.
    pub message: String,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "document {}", self.document)?;
        if !self.field.is_empty() {
            write!(f, ", {}", self.field)?;
        }
        match (self.line, self.column) {
            (Some(line), Some(column)) => write!(f, " (line {line}, column {column})")?,
            (Some(line), None) => write!(f, " (line {line})")?,
            _ => {}
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for SpecError {}

/// A validation failure before it is placed in a document: the field path and
/// the message. `parse.rs` adds the document index and the position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FieldError {
    pub(crate) field: String,
    pub(crate) message: String,
}

impl FieldError {
    pub(crate) fn new(field: impl Into<String>, message: impl Into<String>) -> FieldError {
        FieldError {
            field: field.into(),
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_document_field_and_position() {
        let e = SpecError {
            document: 2,
            field: "spec.volumes[1].mountPath".into(),
            line: Some(14),
            column: Some(18),
            message: "must be an absolute path".into(),
        };
        assert_eq!(
            e.to_string(),
            "document 2, spec.volumes[1].mountPath (line 14, column 18): must be an absolute path"
        );
    }

    #[test]
    fn display_without_field_or_position() {
        let e = SpecError {
            document: 1,
            field: String::new(),
            line: None,
            column: None,
            message: "no documents".into(),
        };
        assert_eq!(e.to_string(), "document 1: no documents");
    }
}
