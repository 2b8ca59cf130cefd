//! Specs: the `kind: Jail`, `kind: Service` and `kind: Ingress` documents users
//! write, their parsing from (multi-document) YAML, their validation, and
//! errors that name the document, the field path and the line:column.
//!
//! This module owns what a valid spec is. It never touches the host and never
//! checks node-local facts (whether a fixed address lies in the node's
//! pod_cidr, whether a base exists): the agent does. Everything a spec can carry
//! into a command line, a ZFS dataset name, a jail.conf or an nginx config is
//! checked here, so code downstream may rely on a parsed spec being safe to use.
//! The field reference for users is `docs/spec.md`.
//!
//! Layout: `types.rs` (the typed form and its serde shape), `quantity.rs`
//! (sizes such as `512M`), `locate.rs` (field positions from the YAML event
//! stream), `validate.rs` (the rules), `parse.rs` (putting it together),
//! `error.rs` ([`SpecError`]).

mod error;
mod locate;
mod parse;
mod quantity;
mod types;
mod validate;

#[cfg(test)]
mod tests;

pub use error::SpecError;
pub use parse::KINDS;
pub use quantity::{format_size, parse_size};
pub use types::{
    Document, ExecSpec, HealthSpec, HttpProbe, Ingress, IngressSpec, Jail, JailSpec, JailTemplate,
    Metadata, NetworkSpec, Probe, Resources, Service, ServiceSpec, TcpProbe, UpdateSpec,
    VolumeSpec,
};
pub use validate::{
    MAX_BASE_LEN, MAX_CPU, MAX_FAILURE_THRESHOLD, MAX_HEALTH_PATH_LEN, MAX_HEALTH_PERIOD,
    MAX_MOUNT_PATH_LEN, MAX_PROGRESS_DEADLINE, MAX_REPLICAS, MIN_CPU, validate_address,
    validate_base, validate_health_path, validate_host, validate_hostname, validate_mount_path,
    validate_name,
};

/// Parses and validates every document in `text` (YAML, several documents
/// separated by `---`; JSON works too). Empty documents are skipped. The first
/// error, in document order, is returned; [`check_documents`] returns them all.
pub fn parse_documents(text: &str) -> Result<Vec<Document>, SpecError> {
    check_documents(text).map_err(first)
}

/// [`parse_documents`], refusing with every error of every document (never
/// an empty list), so the author can fix a whole file in one round: each
/// document's shape error (an unknown or mistyped field stops the reading of
/// that document) or all its rule violations, then a YAML syntax error,
/// which ends what can be read.
pub fn check_documents(text: &str) -> Result<Vec<Document>, Vec<SpecError>> {
    Ok(parse::parse_located(text)?
        .into_iter()
        .map(|l| l.doc)
        .collect())
}

fn first(errors: Vec<SpecError>) -> SpecError {
    errors.into_iter().next().unwrap_or_else(|| SpecError {
        // parse_located never refuses with an empty list.
        document: 1,
        field: String::new(),
        line: None,
        column: None,
        message: "refused without a reason, which is a bug in keel; please report it".into(),
    })
}

/// Parses `text` that must hold exactly one document of kind `want`.
fn parse_one(text: &str, want: &str) -> Result<Document, SpecError> {
    let mut docs = parse::parse_located(text).map_err(first)?;
    if docs.len() > 1 {
        let extra = &docs[1];
        return Err(extra.map.error(
            "",
            format!(
                "expected exactly one kind: {want} document, found {}",
                docs.len()
            ),
        ));
    }
    let Some(one) = docs.pop() else {
        return Err(SpecError {
            document: 1,
            field: String::new(),
            line: None,
            column: None,
            message: format!("no document found: expected one kind: {want} document"),
        });
    };
    if one.doc.kind() != want {
        return Err(one.map.error(
            "kind",
            format!("expected kind: {want} here, found {}", one.doc.kind()),
        ));
    }
    Ok(one.doc)
}

/// Parses and validates exactly one `kind: Jail` document.
pub fn parse_jail(text: &str) -> Result<Jail, SpecError> {
    match parse_one(text, "Jail")? {
        Document::Jail(j) => Ok(j),
        other => Err(kind_mismatch("Jail", &other)),
    }
}

/// Parses and validates exactly one `kind: Service` document.
pub fn parse_service(text: &str) -> Result<Service, SpecError> {
    match parse_one(text, "Service")? {
        Document::Service(s) => Ok(s),
        other => Err(kind_mismatch("Service", &other)),
    }
}

/// Parses and validates exactly one `kind: Ingress` document.
pub fn parse_ingress(text: &str) -> Result<Ingress, SpecError> {
    match parse_one(text, "Ingress")? {
        Document::Ingress(i) => Ok(i),
        other => Err(kind_mismatch("Ingress", &other)),
    }
}

// parse_one already checked the kind; this only keeps the matches total.
fn kind_mismatch(want: &str, got: &Document) -> SpecError {
    SpecError {
        document: 1,
        field: "kind".into(),
        line: None,
        column: None,
        message: format!("expected kind: {want}, found {}", got.kind()),
    }
}

/// Serialises a document as YAML with its `kind`; [`parse_documents`] reads it
/// back to an equal value. Sizes are written as plain byte counts.
pub fn to_yaml(doc: &Document) -> String {
    // The spec types have only string keys, no untagged enums and no byte
    // strings, the cases where serde_yaml's serialiser can fail.
    serde_yaml::to_string(doc).expect("spec documents always serialise to YAML")
}

impl Document {
    /// Validates a document that did not come from text (built in code or read
    /// from Keel's own state). The error carries no line or column.
    pub fn validate(&self) -> Result<(), SpecError> {
        match validate::document(self).into_iter().next() {
            None => Ok(()),
            Some(e) => Err(SpecError {
                document: 1,
                field: e.field,
                line: None,
                column: None,
                message: e.message,
            }),
        }
    }

    /// See [`to_yaml`].
    pub fn to_yaml(&self) -> String {
        to_yaml(self)
    }
}

impl Jail {
    /// This jail as a `kind: Jail` YAML document.
    pub fn to_yaml(&self) -> String {
        to_yaml(&Document::Jail(self.clone()))
    }
}

impl Service {
    /// This service as a `kind: Service` YAML document.
    pub fn to_yaml(&self) -> String {
        to_yaml(&Document::Service(self.clone()))
    }
}

impl Ingress {
    /// This ingress as a `kind: Ingress` YAML document.
    pub fn to_yaml(&self) -> String {
        to_yaml(&Document::Ingress(self.clone()))
    }
}
