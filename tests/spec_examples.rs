//! Every spec file in examples/ and every complete YAML example in docs/spec.md
//! must parse and validate, and must survive a YAML round trip unchanged, so the
//! documentation can never drift from what Keel accepts.

use std::fs;
use std::path::{Path, PathBuf};

use keel::common::spec::{self, Document};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn example_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(root().join("examples"))
        .expect("examples/ exists")
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    files
}

fn parse_and_round_trip(what: &str, text: &str) -> Vec<Document> {
    let docs = spec::parse_documents(text).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(!docs.is_empty(), "{what} holds no document");
    for doc in &docs {
        let yaml = spec::to_yaml(doc);
        let back = spec::parse_documents(&yaml).unwrap_or_else(|e| panic!("{what}: {e}\n{yaml}"));
        assert_eq!(
            back,
            std::slice::from_ref(doc),
            "{what} changed in a round trip"
        );
    }
    docs
}

#[test]
fn every_example_validates() {
    let files = example_files();
    for file in &files {
        let text = fs::read_to_string(file).expect("readable example");
        parse_and_round_trip(&file.display().to_string(), &text);
    }
    let names: Vec<String> = files
        .iter()
        .filter_map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    for required in [
        "jail.yaml",
        "service.yaml",
        "stateful-service.yaml",
        "ingress.yaml",
        "sim-web.yaml",
        "sim-service.yaml",
    ] {
        assert!(
            names.iter().any(|n| n == required),
            "examples/{required} missing"
        );
    }
}

#[test]
fn examples_are_what_their_names_say() {
    let read = |name: &str| {
        let text = fs::read_to_string(root().join("examples").join(name)).expect("example");
        parse_and_round_trip(name, &text)
    };
    let jail =
        spec::parse_jail(&fs::read_to_string(root().join("examples/jail.yaml")).expect("jail"))
            .expect("jail.yaml is one Jail");
    assert_eq!(jail.spec.base, "14.5-RELEASE");
    assert_eq!(jail.spec.exec.start, ["/bin/sh", "/etc/rc"]);
    match read("service.yaml").as_slice() {
        [Document::Service(s)] => {
            assert_eq!(s.spec.replicas, 3);
            assert!(!s.spec.template.has_volumes());
        }
        other => panic!("service.yaml: {other:?}"),
    }
    match read("stateful-service.yaml").as_slice() {
        [Document::Service(s)] => {
            assert!(s.spec.template.has_volumes());
            let replica = s.spec.template.to_jail_spec("db-1");
            assert_eq!(replica.spec.volumes[0].name, "db-1-pgdata");
        }
        other => panic!("stateful-service.yaml: {other:?}"),
    }
    assert!(matches!(
        read("ingress.yaml").as_slice(),
        [Document::Ingress(_)]
    ));
    match read("sim-web.yaml").as_slice() {
        [Document::Jail(j)] => assert!(
            j.spec
                .exec
                .start
                .iter()
                .any(|a| a.contains("KEEL_JAIL_ADDRESS"))
        ),
        other => panic!("sim-web.yaml: {other:?}"),
    }
    match read("sim-service.yaml").as_slice() {
        [Document::Service(s)] => {
            assert_eq!(s.spec.replicas, 3);
            assert!(s.spec.template.health.is_some(), "probed before it serves");
            assert!(
                s.spec
                    .template
                    .exec
                    .start
                    .iter()
                    .any(|a| a.contains("KEEL_JAIL_ADDRESS"))
            );
        }
        other => panic!("sim-service.yaml: {other:?}"),
    }
}

/// The ```yaml blocks of docs/spec.md that are whole documents (start with
/// `kind:`); fragments showing a single field are skipped.
#[test]
fn reference_examples_validate() {
    let text = fs::read_to_string(root().join("docs/spec.md")).expect("docs/spec.md");
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (n, line) in text.lines().enumerate() {
        match &mut current {
            None if line.trim() == "```yaml" => current = Some((n + 2, String::new())),
            Some((start, body)) if line.trim() == "```" => {
                blocks.push((*start, std::mem::take(body)));
                current = None;
            }
            Some((_, body)) => {
                body.push_str(line);
                body.push('\n');
            }
            None => {}
        }
    }
    let whole: Vec<_> = blocks
        .iter()
        .filter(|(_, b)| b.lines().any(|l| l.starts_with("kind:")))
        .collect();
    assert!(
        whole.len() >= 3,
        "docs/spec.md shows fewer than three whole documents"
    );
    for (line, body) in whole {
        parse_and_round_trip(&format!("docs/spec.md block at line {line}"), body);
    }
}
