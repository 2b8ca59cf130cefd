//! Every validation rule, fed a bad document: the error must name the field and
//! the line it is on. Plus the parsing behaviour around them (kinds, documents,
//! round trips, replica derivation).

use super::*;
use crate::common::config::Interval;

const JAIL: &str = r#"kind: Jail
metadata:
  name: web-1
spec:
  base: 14.2-RELEASE
  hostname: web-1
  network:
    address: 10.20.3.15
  resources:
    cpu: 1.5
    memory: 512M
  exec:
    start: ["/bin/sh", "/etc/rc"]
    stop: ["/bin/sh", "/etc/rc.shutdown"]
  env:
    KEY: value
  volumes:
    - name: pgdata
      mountPath: /var/db/postgres
      size: 10G
"#;

const SERVICE: &str = r#"kind: Service
metadata:
  name: web
spec:
  replicas: 3
  port: 8080
  template:
    base: 14.2-RELEASE
    exec:
      start: ["/bin/sh", "/etc/rc"]
    volumes:
      - name: data
        mountPath: /data
"#;

const INGRESS: &str = r#"kind: Ingress
metadata:
  name: web
spec:
  host: www.example.com
  service: web
"#;

/// `base` with its 1-based line `line` replaced by `text` (which may hold
/// several lines, or none).
fn with(base: &str, line: usize, text: &str) -> String {
    let mut lines: Vec<&str> = base.lines().collect();
    lines[line - 1] = text;
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// Asserts `text` is refused for `field` on `line` with a message containing
/// `fragment`, and that the rendered error says so too.
#[track_caller]
fn refused(text: &str, document: usize, field: &str, line: usize, fragment: &str) {
    let err = match parse_documents(text) {
        Ok(docs) => panic!("accepted:\n{text}\n=> {docs:?}"),
        Err(e) => e,
    };
    let shown = err.to_string();
    assert_eq!(err.document, document, "{shown}");
    assert_eq!(err.field, field, "{shown}");
    assert_eq!(err.line, Some(line), "{shown}");
    assert!(err.column.is_some(), "{shown}");
    assert!(err.message.contains(fragment), "{shown} lacks {fragment:?}");
    let head = if field.is_empty() {
        format!("document {document} (line {line}, column ")
    } else {
        format!("document {document}, {field} (line {line}, column ")
    };
    assert!(
        shown.starts_with(&head),
        "{shown} does not start with {head}"
    );
}

#[test]
fn the_bases_are_valid() {
    let docs = parse_documents(&format!("{JAIL}---\n{SERVICE}---\n{INGRESS}")).expect("valid");
    assert_eq!(
        docs.iter()
            .map(|d| (d.kind(), d.name()))
            .collect::<Vec<_>>(),
        [("Jail", "web-1"), ("Service", "web"), ("Ingress", "web")]
    );
    let Document::Jail(j) = &docs[0] else {
        panic!("not a jail")
    };
    assert_eq!(j.spec.resources.memory, Some(512 << 20));
    assert_eq!(j.spec.volumes[0].size, Some(10 << 30));
    assert_eq!(
        j.spec.volumes[0].mount_path,
        std::path::Path::new("/var/db/postgres")
    );
    assert_eq!(j.hostname(), "web-1");
}

#[test]
fn defaults() {
    let j = parse_jail("kind: Jail\nmetadata: {name: a}\nspec: {base: b, exec: {start: [x]}}\n")
        .expect("valid");
    assert_eq!(j.spec.hostname, None);
    assert_eq!(j.hostname(), "a");
    assert_eq!(j.spec.network, NetworkSpec::default());
    assert_eq!(j.spec.resources, Resources::default());
    assert!(j.spec.exec.stop.is_empty() && j.spec.env.is_empty() && j.spec.volumes.is_empty());
    let s = parse_service(
        "kind: Service\nmetadata: {name: a}\nspec: {port: 80, template: {base: b, exec: {start: [x]}}}\n",
    )
    .expect("valid");
    assert_eq!(s.spec.replicas, 1);
}

#[test]
fn unknown_fields_at_every_level() {
    refused(
        &format!("{JAIL}extra: 1\n"),
        1,
        "extra",
        21,
        "unknown field `extra`",
    );
    refused(
        &with(JAIL, 3, "  nmae: web-1"),
        1,
        "metadata.nmae",
        3,
        "unknown field",
    );
    refused(
        &with(JAIL, 6, "  hostnmae: x"),
        1,
        "spec.hostnmae",
        6,
        "unknown field",
    );
    refused(
        &with(JAIL, 8, "    addr: 10.0.0.1"),
        1,
        "spec.network.addr",
        8,
        "unknown field",
    );
    refused(
        &with(JAIL, 10, "    cpus: 1.5"),
        1,
        "spec.resources.cpus",
        10,
        "unknown field",
    );
    refused(
        &with(JAIL, 14, "    stopp: []"),
        1,
        "spec.exec.stopp",
        14,
        "unknown field",
    );
    refused(
        &with(JAIL, 20, "      sizee: 10G"),
        1,
        "spec.volumes[0].sizee",
        20,
        "unknown field",
    );
    refused(
        &with(SERVICE, 8, "    bsae: x"),
        1,
        "spec.template.bsae",
        8,
        "unknown field",
    );
    refused(
        &with(SERVICE, 5, "  replica: 3"),
        1,
        "spec.replica",
        5,
        "unknown field",
    );
    refused(
        &with(INGRESS, 6, "  backend: web"),
        1,
        "spec.backend",
        6,
        "unknown field",
    );
}

#[test]
fn missing_fields_are_named_at_their_parent() {
    refused(
        &with(JAIL, 13, "    # no start"),
        1,
        "spec.exec.start",
        12,
        "missing field `start`",
    );
    refused(
        &with(JAIL, 5, "  # no base"),
        1,
        "spec.base",
        4,
        "missing field `base`",
    );
    refused(
        &with(SERVICE, 6, ""),
        1,
        "spec.port",
        4,
        "missing field `port`",
    );
    refused(
        &with(INGRESS, 5, ""),
        1,
        "spec.host",
        4,
        "missing field `host`",
    );
}

#[test]
fn duplicate_keys() {
    refused(
        &with(JAIL, 16, "    KEY: a\n    KEY: b"),
        1,
        "spec.env.KEY",
        17,
        "twice",
    );
    refused(
        &with(JAIL, 6, "  hostname: a\n  hostname: b"),
        1,
        "spec.hostname",
        7,
        "twice",
    );
}

#[test]
fn kind_is_sniffed_per_document() {
    refused(
        &with(JAIL, 1, "kind: Pod"),
        1,
        "kind",
        1,
        "unknown kind \"Pod\"",
    );
    refused(&with(JAIL, 1, "kind: jail"), 1, "kind", 1, "unknown kind");
    refused(
        &with(JAIL, 1, "kind: [Jail]"),
        1,
        "kind",
        1,
        "must be one of",
    );
    refused(&with(JAIL, 1, "# no kind"), 1, "kind", 2, "missing");
    refused("- a\n- b\n", 1, "", 1, "must be a mapping");
    // A Service's fields under kind: Jail are unknown to a Jail.
    refused(
        &with(SERVICE, 1, "kind: Jail"),
        1,
        "spec.replicas",
        5,
        "unknown field",
    );
}

#[test]
fn errors_name_the_document_and_stream_line() {
    let text = format!("{JAIL}---\n{}", with(INGRESS, 5, "  host: example"));
    refused(&text, 2, "spec.host", 21 + 5, "fully qualified");
    // The first error in document order wins, even over a later syntax error.
    let text = format!("{}---\nkind: [\n", with(JAIL, 3, "  name: Web"));
    refused(&text, 1, "metadata.name", 3, "DNS label");
    let text = format!("{JAIL}---\nkind: [\n");
    let err = parse_documents(&text).expect_err("syntax error");
    assert_eq!((err.document, err.field.as_str()), (2, ""), "{err}");
    assert!(err.line.is_some_and(|l| l >= 22), "{err}");
    assert!(err.message.contains("invalid YAML"), "{err}");
}

#[test]
fn every_error_of_a_file_comes_at_once() {
    // Two rule violations in document 1, an unknown field in document 2
    // (serde stops reading that document there), a valid document 3, and a
    // bad host in document 4: four errors, in document order, each placed.
    let jail = with(&with(JAIL, 5, "  base: \"\""), 10, "    cpu: 0");
    let unknown = with(SERVICE, 5, "  replicaz: 3");
    let ingress = with(INGRESS, 5, "  host: example");
    let text = format!("{jail}---\n{unknown}---\n{JAIL}---\n{ingress}");
    let errors = check_documents(&text).expect_err("four errors");
    let found: Vec<(usize, &str, Option<usize>)> = errors
        .iter()
        .map(|e| (e.document, e.field.as_str(), e.line))
        .collect();
    let (jail_lines, service_lines) = (JAIL.lines().count() + 1, SERVICE.lines().count() + 1);
    assert_eq!(
        found,
        [
            (1, "spec.base", Some(5)),
            (1, "spec.resources.cpu", Some(10)),
            (2, "spec.replicaz", Some(jail_lines + 5)),
            (4, "spec.host", Some(2 * jail_lines + service_lines + 5)),
        ],
        "{errors:?}"
    );
    // The first-error form is the head of the same list.
    assert_eq!(parse_documents(&text).expect_err("refused"), errors[0]);
}

#[test]
fn a_field_reports_its_first_problem_only() {
    // Not a DNS label, so it is not also reported as reserved or as a
    // replica name that would be too long.
    let text = with(SERVICE, 3, "  name: Keel-x");
    let errors = check_documents(&text).expect_err("refused");
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(fields, ["metadata.name"], "{errors:?}");
}

#[test]
fn a_status_section_is_ignored_so_printed_objects_apply_back() {
    let printed = format!("{JAIL}status:\n  state: Running\n  restarts: 3\n");
    assert_eq!(
        parse_documents(&printed).expect("valid"),
        parse_documents(JAIL).expect("valid")
    );
    let printed = format!("{SERVICE}status: {{ready: 1, anything: [1, 2]}}\n");
    assert_eq!(
        parse_documents(&printed).expect("valid"),
        parse_documents(SERVICE).expect("valid")
    );
}

#[test]
fn syntax_errors_have_a_position() {
    let err = parse_documents(&with(JAIL, 5, "  base: [")).expect_err("syntax");
    assert_eq!(err.document, 1);
    assert!(err.line.is_some_and(|l| l >= 5), "{err}");
    assert!(err.to_string().starts_with("document 1 (line "), "{err}");
}

#[test]
fn empty_documents_are_skipped() {
    let docs = parse_documents(&format!("---\n{JAIL}---\n---\n{INGRESS}---\n")).expect("valid");
    assert_eq!(docs.len(), 2);
    assert_eq!(parse_documents("").expect("empty"), []);
    assert_eq!(parse_documents("# nothing\n").expect("empty"), []);
    // The index still counts the empty document, as the author sees it.
    refused(
        &format!("---\n---\n{}", with(INGRESS, 3, "  name: A")),
        2,
        "metadata.name",
        5,
        "DNS",
    );
}

#[test]
fn names_are_dns_labels() {
    refused(
        &with(JAIL, 3, "  name: Web_1"),
        1,
        "metadata.name",
        3,
        "DNS label",
    );
    refused(
        &with(JAIL, 3, "  name: web-"),
        1,
        "metadata.name",
        3,
        "DNS label",
    );
    refused(
        &with(JAIL, 3, "  name: \"\""),
        1,
        "metadata.name",
        3,
        "empty",
    );
    let long = format!("  name: {}", "a".repeat(64));
    refused(&with(JAIL, 3, &long), 1, "metadata.name", 3, "at most 63");
    refused(
        &with(SERVICE, 3, "  name: web.1"),
        1,
        "metadata.name",
        3,
        "DNS label",
    );
    refused(
        &with(INGRESS, 3, "  name: -web"),
        1,
        "metadata.name",
        3,
        "DNS label",
    );
    // YAML reads 12a as a string and 12 as a number; both reach the name rules.
    parse_jail(&with(JAIL, 3, "  name: 12a")).expect("label starting with digits");
}

#[test]
fn base() {
    refused(
        &with(JAIL, 5, "  base: ../etc"),
        1,
        "spec.base",
        5,
        "ZFS dataset",
    );
    refused(
        &with(JAIL, 5, "  base: 14.2 RELEASE"),
        1,
        "spec.base",
        5,
        "letters, digits",
    );
    refused(
        &with(JAIL, 5, "  base: a/b"),
        1,
        "spec.base",
        5,
        "letters, digits",
    );
    let long = format!("  base: {}", "a".repeat(65));
    refused(&with(JAIL, 5, &long), 1, "spec.base", 5, "at most 64");
    refused(
        &with(SERVICE, 8, "    base: \"@x\""),
        1,
        "spec.template.base",
        8,
        "letters",
    );
}

#[test]
fn hostname() {
    refused(
        &with(JAIL, 6, "  hostname: Web_1"),
        1,
        "spec.hostname",
        6,
        "lowercase",
    );
    refused(
        &with(JAIL, 6, "  hostname: web_1"),
        1,
        "spec.hostname",
        6,
        "only lowercase",
    );
    refused(
        &with(JAIL, 6, "  hostname: a..b"),
        1,
        "spec.hostname",
        6,
        "not a DNS label",
    );
    parse_jail(&with(JAIL, 6, "  hostname: db.internal.example")).expect("dotted hostname");
}

#[test]
fn addresses() {
    for (bad, fragment) in [
        ("10.20.3", "invalid IPv4"),
        ("10.20.3.256", "invalid IPv4"),
        ("fe80::1", "invalid IPv4"),
        ("0.0.0.0", "not a host address"),
        ("255.255.255.255", "broadcast"),
        ("224.0.0.1", "multicast"),
        ("240.1.2.3", "reserved"),
    ] {
        let line = format!("    address: {bad}");
        refused(
            &with(JAIL, 8, &line),
            1,
            "spec.network.address",
            8,
            fragment,
        );
    }
    // Simulate mode hands out loopback addresses.
    let j = parse_jail(&with(JAIL, 8, "    address: 127.64.0.2")).expect("loopback");
    assert_eq!(
        j.spec.network.address,
        Some(std::net::Ipv4Addr::new(127, 64, 0, 2))
    );
}

#[test]
fn cpu() {
    for (bad, fragment) in [
        ("0", "greater than 0"),
        ("-1", "greater than 0"),
        (".inf", "finite"),
        (".nan", "finite"),
        ("0.001", "at least 0.01"),
        ("2000", "at most 1024"),
        ("two", "invalid type"),
    ] {
        let line = format!("    cpu: {bad}");
        refused(
            &with(JAIL, 10, &line),
            1,
            "spec.resources.cpu",
            10,
            fragment,
        );
    }
    let j = parse_jail(&with(JAIL, 10, "    cpu: 2")).expect("integer cpu");
    assert_eq!(j.spec.resources.cpu, Some(2.0));
}

#[test]
fn memory_and_size_units() {
    for (bad, fragment) in [
        ("512MB", "K, M, G or T"),
        ("512Mi", "K, M, G or T"),
        ("512m", "K, M, G or T"),
        ("1.5G", "K, M, G or T"),
        ("-1", "negative"),
        ("0", "greater than zero"),
        ("99999999T", "too large"),
    ] {
        let line = format!("    memory: {bad}");
        refused(
            &with(JAIL, 11, &line),
            1,
            "spec.resources.memory",
            11,
            fragment,
        );
        let line = format!("      size: {bad}");
        refused(
            &with(JAIL, 20, &line),
            1,
            "spec.volumes[0].size",
            20,
            fragment,
        );
    }
    let j = parse_jail(&with(JAIL, 11, "    memory: 1048576")).expect("plain bytes");
    assert_eq!(j.spec.resources.memory, Some(1 << 20));
}

#[test]
fn exec_argv() {
    refused(
        &with(JAIL, 13, "    start: []"),
        1,
        "spec.exec.start",
        13,
        "at least the program",
    );
    refused(
        &with(JAIL, 13, "    start: [\"\", x]"),
        1,
        "spec.exec.start[0]",
        13,
        "program",
    );
    refused(
        &with(JAIL, 13, "    start: [\"/bin/sh\", \"a\\0b\"]"),
        1,
        "spec.exec.start[1]",
        13,
        "NUL",
    );
    refused(
        &with(JAIL, 13, "    start: [\"/bin/sh\", \"a\\nb\"]"),
        1,
        "spec.exec.start[1]",
        13,
        "control",
    );
    refused(
        &with(JAIL, 13, "    start: [\"/bin/sh\", \"a\\rb\"]"),
        1,
        "spec.exec.start[1]",
        13,
        "control",
    );
    refused(
        &with(JAIL, 14, "    stop: [\"/bin/sh\", \"a\\tb\"]"),
        1,
        "spec.exec.stop[1]",
        14,
        "control",
    );
    refused(
        &with(JAIL, 14, "    stop: [\"\"]"),
        1,
        "spec.exec.stop[0]",
        14,
        "program",
    );
    refused(
        &with(JAIL, 13, "    start: /bin/sh /etc/rc"),
        1,
        "spec.exec.start",
        13,
        "invalid type",
    );
    let block = "    start:\n      - /bin/sh\n      - \"x\\ny\"";
    refused(
        &with(JAIL, 13, block),
        1,
        "spec.exec.start[1]",
        15,
        "control",
    );
    refused(
        &with(SERVICE, 10, "      start: []"),
        1,
        "spec.template.exec.start",
        10,
        "program",
    );
    parse_jail(&with(JAIL, 14, "    stop: []")).expect("empty stop");
}

#[test]
fn env() {
    refused(
        &with(JAIL, 16, "    1KEY: value"),
        1,
        "spec.env.1KEY",
        16,
        "shell identifiers",
    );
    refused(
        &with(JAIL, 16, "    A-B: value"),
        1,
        "spec.env.A-B",
        16,
        "shell identifiers",
    );
    refused(
        &with(JAIL, 16, "    \"A B\": value"),
        1,
        "spec.env.A B",
        16,
        "shell identifiers",
    );
    refused(
        &with(JAIL, 16, "    \"\": value"),
        1,
        "spec.env.",
        16,
        "shell identifiers",
    );
    refused(
        &with(JAIL, 16, "    KEY: \"a\\0b\""),
        1,
        "spec.env.KEY",
        16,
        "NUL",
    );
    let j = parse_jail(&with(JAIL, 16, "    _K9: \"multi\\nline\"")).expect("newline is fine");
    assert_eq!(j.spec.env["_K9"], "multi\nline");
}

#[test]
fn volumes() {
    refused(
        &with(JAIL, 18, "    - name: PG"),
        1,
        "spec.volumes[0].name",
        18,
        "DNS label",
    );
    for (bad, fragment) in [
        ("var/db", "absolute"),
        ("/", "must not be '/'"),
        ("/a//b", "'//'"),
        ("/a/", "trailing '/'"),
        ("/a/../b", "'..'"),
        ("/a/./b", "'.'"),
        ("/..", "'..'"),
        ("\"/a b\"", "whitespace"),
        ("\"/a\\nb\"", "control"),
    ] {
        let line = format!("      mountPath: {bad}");
        refused(
            &with(JAIL, 19, &line),
            1,
            "spec.volumes[0].mountPath",
            19,
            fragment,
        );
    }
    let dup_name = "      size: 10G\n    - name: pgdata\n      mountPath: /other";
    refused(
        &with(JAIL, 20, dup_name),
        1,
        "spec.volumes[1].name",
        21,
        "duplicate volume name",
    );
    let dup_path = "      size: 10G\n    - name: other\n      mountPath: /var/db/postgres";
    refused(
        &with(JAIL, 20, dup_path),
        1,
        "spec.volumes[1].mountPath",
        22,
        "duplicate mountPath",
    );
    let flow = "  volumes: [{name: a, mountPath: /a}, {name: b, mountPath: b}]";
    let text = format!("{}\n", JAIL.lines().take(16).collect::<Vec<_>>().join("\n"));
    refused(
        &format!("{text}{flow}\n"),
        1,
        "spec.volumes[1].mountPath",
        17,
        "absolute",
    );
}

#[test]
fn service_rules() {
    refused(
        &with(SERVICE, 5, "  replicas: 1001"),
        1,
        "spec.replicas",
        5,
        "between 0 and 1000",
    );
    refused(
        &with(SERVICE, 5, "  replicas: -1"),
        1,
        "spec.replicas",
        5,
        "between 0 and 1000",
    );
    refused(
        &with(SERVICE, 5, "  replicas: many"),
        1,
        "spec.replicas",
        5,
        "invalid type",
    );
    refused(
        &with(SERVICE, 6, "  port: 0"),
        1,
        "spec.port",
        6,
        "between 1 and 65535",
    );
    refused(
        &with(SERVICE, 6, "  port: 65536"),
        1,
        "spec.port",
        6,
        "between 1 and 65535",
    );
    refused(
        &with(SERVICE, 6, "  port: -80"),
        1,
        "spec.port",
        6,
        "between 1 and 65535",
    );
    parse_service(&with(SERVICE, 5, "  replicas: 0")).expect("zero replicas");
    parse_service(&with(SERVICE, 5, "  replicas: 1000")).expect("max replicas");
    let addr = "    base: 14.2-RELEASE\n    network:\n      address: 10.0.0.1";
    refused(
        &with(SERVICE, 8, addr),
        1,
        "spec.template.network.address",
        10,
        "must not be set",
    );
    let rel = "        mountPath: data";
    refused(
        &with(SERVICE, 13, rel),
        1,
        "spec.template.volumes[0].mountPath",
        13,
        "absolute",
    );
}

#[test]
fn derived_names_must_fit() {
    // web-2 is the longest replica name for 3 replicas.
    let name = "a".repeat(61);
    parse_service(&with(SERVICE, 3, &format!("  name: {name}")))
        .map(|_| ())
        .expect_err("volume");
    let no_vol: String = SERVICE.lines().take(10).collect::<Vec<_>>().join("\n") + "\n";
    parse_service(&with(&no_vol, 3, &format!("  name: {name}"))).expect("63 characters fit");
    let name = "a".repeat(62);
    refused(
        &with(&no_vol, 3, &format!("  name: {name}")),
        1,
        "metadata.name",
        3,
        "replica name",
    );
    // 10 replicas: the last is -9, still one digit; 11 make it -10.
    let name = "a".repeat(61);
    let ten = with(
        &with(&no_vol, 3, &format!("  name: {name}")),
        5,
        "  replicas: 10",
    );
    parse_service(&ten).expect("-9 fits");
    refused(
        &with(&ten, 5, "  replicas: 11"),
        1,
        "metadata.name",
        3,
        "replica name",
    );
    let vol = format!("      - name: {}", "v".repeat(58));
    refused(
        &with(SERVICE, 12, &vol),
        1,
        "spec.template.volumes[0].name",
        12,
        "per-replica volume name",
    );
}

#[test]
fn ingress_rules() {
    for (bad, fragment) in [
        ("example", "fully qualified"),
        ("\"*.example.com\"", "wildcard"),
        ("WWW.example.com", "lowercase"),
        ("www.example.com.", "end with '.'"),
        ("\"www example.com\"", "only lowercase"),
        ("\"www.example.com \"", "only lowercase"),
        ("a;b.example.com", "only lowercase"),
        ("a{b.example.com", "only lowercase"),
        ("\"a\\\"b.example.com\"", "only lowercase"),
        ("\"a'b.example.com\"", "only lowercase"),
        ("bücher.example", "punycode"),
        ("10.0.0.1", "IP address"),
        ("a..example.com", "not a DNS label"),
        ("-a.example.com", "not a DNS label"),
    ] {
        let line = format!("  host: {bad}");
        refused(&with(INGRESS, 5, &line), 1, "spec.host", 5, fragment);
    }
    let long = format!("  host: {}.com", vec!["a".repeat(63); 4].join("."));
    refused(&with(INGRESS, 5, &long), 1, "spec.host", 5, "at most 253");
    parse_ingress(&with(INGRESS, 5, "  host: xn--bcher-kva.example")).expect("punycode");
    refused(
        &with(INGRESS, 6, "  service: Web"),
        1,
        "spec.service",
        6,
        "DNS label",
    );
}

#[test]
fn single_kind_parsers() {
    parse_jail(JAIL).expect("jail");
    parse_service(SERVICE).expect("service");
    parse_ingress(INGRESS).expect("ingress");
    let err = parse_jail(SERVICE).expect_err("wrong kind");
    assert_eq!((err.field.as_str(), err.line), ("kind", Some(1)), "{err}");
    assert!(err.message.contains("expected kind: Jail"), "{err}");
    let err = parse_jail(&format!("{JAIL}---\n{JAIL}")).expect_err("two");
    assert_eq!((err.document, err.line), (2, Some(22)), "{err}");
    assert!(err.message.contains("exactly one"), "{err}");
    let err = parse_ingress("").expect_err("none");
    assert!(err.message.contains("no document"), "{err}");
}

#[test]
fn template_to_jail_spec_renames_volumes() {
    let s = parse_service(SERVICE).expect("service");
    assert!(s.spec.template.has_volumes());
    let j = s.spec.template.to_jail_spec("web-2");
    assert_eq!(j.metadata.name, "web-2");
    assert_eq!(j.spec.volumes[0].name, "web-2-data");
    assert_eq!(j.spec.volumes[0].mount_path, std::path::Path::new("/data"));
    assert_eq!(j.spec.base, s.spec.template.base);
    assert_eq!(j.spec.exec, s.spec.template.exec);
    assert_eq!(j.hostname(), "web-2");
    Document::Jail(j)
        .validate()
        .expect("a replica of a valid service is a valid jail");
    let stateless =
        with(SERVICE, 11, "").replace("      - name: data\n        mountPath: /data\n", "");
    assert!(
        !parse_service(&stateless)
            .expect("stateless")
            .spec
            .template
            .has_volumes()
    );
}

#[test]
fn validate_without_text_has_no_position() {
    let mut j = parse_jail(JAIL).expect("jail");
    j.spec.volumes[0].mount_path = "rel".into();
    let err = Document::Jail(j).validate().expect_err("relative");
    assert_eq!(err.field, "spec.volumes[0].mountPath");
    assert_eq!(err.line, None);
    assert!(
        err.to_string()
            .starts_with("document 1, spec.volumes[0].mountPath: must be")
    );
}

#[test]
fn yaml_and_json_round_trip() {
    for text in [JAIL, SERVICE, INGRESS] {
        let docs = parse_documents(text).expect("valid");
        let doc = &docs[0];
        let yaml = doc.to_yaml();
        assert!(
            yaml.starts_with(&format!("kind: {}\n", doc.kind())),
            "{yaml}"
        );
        assert_eq!(
            &parse_documents(&yaml).expect("yaml back")[0],
            doc,
            "{yaml}"
        );
        let json = serde_json::to_string(doc).expect("json");
        assert_eq!(
            &parse_documents(&json).expect("json back")[0],
            doc,
            "{json}"
        );
        assert_eq!(
            &serde_json::from_str::<Document>(&json).expect("derive"),
            doc
        );
    }
    let j = parse_jail(JAIL).expect("jail");
    assert!(j.to_yaml().contains("memory: 536870912"), "{}", j.to_yaml());
    assert_eq!(parse_jail(&j.to_yaml()).expect("back"), j);
}

mod props {
    use super::*;
    use proptest::collection::{btree_map, vec};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn label() -> impl Strategy<Value = String> {
        "[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?"
    }

    fn arg() -> impl Strategy<Value = String> {
        // Printable text including quotes, '$', ':' and '#', which YAML must escape.
        "[ -~é]{1,12}"
    }

    fn jail_spec(with_address: bool) -> impl Strategy<Value = JailSpec> {
        let address = if with_address {
            proptest::option::of((1u8..224, any::<u8>(), any::<u8>(), 1u8..255))
                .prop_map(|o| o.map(|(a, b, c, d)| std::net::Ipv4Addr::new(a, b, c, d)))
                .boxed()
        } else {
            Just(None).boxed()
        };
        (
            "[A-Za-z0-9][A-Za-z0-9._-]{0,20}",
            proptest::option::of(label()),
            address,
            proptest::option::of(1u32..100_000).prop_map(|c| c.map(|c| f64::from(c) / 100.0)),
            proptest::option::of(1u64..u64::MAX),
            (vec(arg(), 1..4), vec(arg(), 0..3)),
            btree_map("[A-Za-z_][A-Za-z0-9_]{0,8}", "[ -~\n]{0,12}", 0..4),
            vec((label(), proptest::option::of(1u64..(1 << 50))), 0..4),
        )
            .prop_map(
                |(base, hostname, address, cpu, memory, (start, stop), env, vols)| {
                    let mut seen = BTreeMap::new();
                    let volumes = vols
                        .into_iter()
                        .filter(|(n, _)| seen.insert(n.clone(), ()).is_none())
                        .enumerate()
                        .map(|(i, (name, size))| VolumeSpec {
                            mount_path: format!("/data/{i}/{name}").into(),
                            name,
                            size,
                        })
                        .collect();
                    JailSpec {
                        base,
                        hostname,
                        network: NetworkSpec { address },
                        resources: Resources { cpu, memory },
                        exec: ExecSpec { start, stop },
                        env,
                        volumes,
                        health: None,
                    }
                },
            )
    }

    fn document() -> impl Strategy<Value = Document> {
        let jail = (label(), jail_spec(true)).prop_map(|(name, spec)| {
            Document::Jail(Jail {
                metadata: Metadata { name },
                spec,
            })
        });
        let service = (label(), 0u32..=1000, 1u16.., jail_spec(false)).prop_map(
            |(name, replicas, port, t)| {
                Document::Service(Service {
                    metadata: Metadata { name },
                    spec: ServiceSpec {
                        replicas,
                        port,
                        template: JailTemplate {
                            base: t.base,
                            hostname: t.hostname,
                            network: t.network,
                            resources: t.resources,
                            exec: t.exec,
                            env: t.env,
                            volumes: t.volumes,
                            health: t.health,
                        },
                        update: UpdateSpec::default(),
                        drain_timeout: Interval::secs(10),
                    },
                })
            },
        );
        let ingress = (label(), vec(label(), 2..4), label()).prop_map(|(name, host, service)| {
            Document::Ingress(Ingress {
                metadata: Metadata { name },
                spec: IngressSpec {
                    host: format!("{}x", host.join(".")),
                    service,
                },
            })
        });
        prop_oneof![jail, service, ingress]
    }

    proptest! {
        #[test]
        fn valid_documents_round_trip(doc in document()) {
            prop_assume!(doc.validate().is_ok());
            let yaml = doc.to_yaml();
            prop_assert_eq!(parse_documents(&yaml).map_err(|e| e.to_string()), Ok(vec![doc.clone()]), "{}", yaml);
            let json = serde_json::to_string(&doc).expect("json");
            prop_assert_eq!(parse_documents(&json).map_err(|e| e.to_string()), Ok(vec![doc]), "{}", json);
        }

        #[test]
        fn parsing_arbitrary_text_never_panics(text in "[ -~\n\t]{0,200}") {
            let _ = parse_documents(&text);
        }
    }
}

#[test]
fn all_digit_names_are_refused_because_jail8_reads_them_as_jids() {
    refused(
        &with(JAIL, 3, "  name: \"123\""),
        1,
        "metadata.name",
        3,
        "jail id",
    );
    assert!(validate_name("web-123").is_ok());
}

#[test]
fn a_program_containing_equals_is_refused() {
    refused(
        &with(JAIL, 13, "    start: [\"A=b\", \"/etc/rc\"]"),
        1,
        "spec.exec.start[0]",
        13,
        "'='",
    );
}

#[test]
fn names_keel_reserves_for_its_own_jails_are_refused() {
    refused(
        "kind: Jail\nmetadata:\n  name: keel-ingress\nspec: {base: b, exec: {start: [x]}}\n",
        1,
        "metadata.name",
        3,
        "reserved for the jails Keel runs itself",
    );
    refused(
        "kind: Service\nmetadata:\n  name: keel-web\nspec: {port: 80, template: {base: b, exec: {start: [x]}}}\n",
        1,
        "metadata.name",
        3,
        "reserved",
    );
    // An Ingress is not a jail: its name is free.
    assert!(
        parse_documents(
            "kind: Ingress\nmetadata: {name: keel-site}\nspec: {host: a.example.org, service: web}\n"
        )
        .is_ok()
    );
}

/// [`JAIL`] with `health:` on line 21 and `block` from line 22 on.
fn with_health(block: &str) -> String {
    format!("{JAIL}  health:\n{block}")
}

#[test]
fn health_parses_with_its_defaults() {
    let j = parse_jail(&with_health("    http: {port: 8080, path: /healthz}\n")).expect("valid");
    let h = j.spec.health.expect("health");
    assert_eq!(
        h.probe(),
        Some(Probe::Http(&HttpProbe {
            port: 8080,
            path: "/healthz".into()
        }))
    );
    assert_eq!(h.interval, Interval::secs(5));
    assert_eq!(h.timeout, Interval::secs(2));
    assert_eq!(h.failure_threshold, 3);
    assert_eq!(h.start_period, Interval::secs(0));

    let j = parse_jail(&with_health(
        "    exec: [/bin/test, -f, /ok]\n    interval: 2s\n    timeout: 500ms\n    \
         failureThreshold: 1\n    startPeriod: 10s\n",
    ))
    .expect("valid");
    let h = j.spec.health.clone().expect("health");
    assert_eq!(
        (h.interval, h.timeout, h.failure_threshold, h.start_period),
        (
            Interval::secs(2),
            Interval(std::time::Duration::from_millis(500)),
            1,
            Interval::secs(10)
        )
    );
    let back = parse_jail(&Document::Jail(j.clone()).to_yaml()).expect("round trip");
    assert_eq!(back, j);
}

#[test]
fn a_service_template_carries_health_to_every_replica() {
    let text = format!("{SERVICE}    health:\n      tcp: {{port: 8080}}\n");
    let s = parse_service(&text).expect("valid");
    let replica = s.spec.template.to_jail_spec("web-2");
    assert_eq!(
        replica.spec.health.and_then(|h| h.tcp),
        Some(TcpProbe { port: 8080 })
    );
    refused(
        &format!("{SERVICE}    health:\n      tcp: {{port: 8080}}\n      interval: 0s\n"),
        1,
        "spec.template.health.interval",
        16,
        "greater than 0s",
    );
}

#[test]
fn every_bad_health_field_is_named_with_its_line() {
    let cases: [(&str, &str, usize, &str); 13] = [
        (
            "    interval: 2s\n",
            "spec.health",
            21,
            "must set one probe",
        ),
        (
            "    http: {port: 80}\n    tcp: {port: 81}\n",
            "spec.health.tcp",
            23,
            "only one probe",
        ),
        (
            "    http: {port: 0}\n",
            "spec.health.http.port",
            22,
            "between 1 and 65535",
        ),
        (
            "    http: {port: 70000}\n",
            "spec.health.http.port",
            22,
            "between 1 and 65535",
        ),
        (
            "    http: {port: 80, path: healthz}\n",
            "spec.health.http.path",
            22,
            "absolute",
        ),
        (
            "    http: {port: 80, path: \"/a b\"}\n",
            "spec.health.http.path",
            22,
            "without spaces",
        ),
        (
            "    tcp: {port: 0}\n",
            "spec.health.tcp.port",
            22,
            "between 1 and 65535",
        ),
        (
            "    exec: []\n",
            "spec.health.exec",
            22,
            "at least the program",
        ),
        (
            "    tcp: {port: 80}\n    interval: 5\n",
            "spec.health.interval",
            23,
            "not a duration",
        ),
        (
            "    tcp: {port: 80}\n    timeout: 0s\n",
            "spec.health.timeout",
            23,
            "greater than 0s",
        ),
        (
            "    tcp: {port: 80}\n    interval: 1s\n    timeout: 2s\n",
            "spec.health.timeout",
            24,
            "not be longer than interval",
        ),
        (
            "    tcp: {port: 80}\n    failureThreshold: 0\n",
            "spec.health.failureThreshold",
            23,
            "between 1 and 100",
        ),
        (
            "    tcp: {port: 80}\n    startPeriod: 2h\n",
            "spec.health.startPeriod",
            23,
            "at most 1h",
        ),
    ];
    for (block, field, line, fragment) in cases {
        refused(&with_health(block), 1, field, line, fragment);
    }
    refused(
        &with_health("    tcp: {port: 80, path: /x}\n"),
        1,
        "spec.health.tcp.path",
        22,
        "unknown field",
    );
}

/// [`SERVICE`] with `block` inserted in its `spec` before the template
/// (line 7 on).
fn with_update(block: &str) -> String {
    SERVICE.replacen("  template:\n", &format!("{block}  template:\n"), 1)
}

#[test]
fn update_and_drain_timeout_have_defaults_and_round_trip() {
    let s = parse_service(SERVICE).expect("valid");
    assert_eq!(
        (s.spec.update, s.spec.drain_timeout),
        (UpdateSpec::default(), Interval::secs(10))
    );
    assert_eq!(
        (
            s.spec.update.max_unavailable,
            s.spec.update.max_surge,
            s.spec.update.progress_deadline
        ),
        (1, 0, Interval::secs(600))
    );
    let text = with_update(
        "  update: {maxUnavailable: 0, maxSurge: 2, progressDeadline: 90s}\n  drainTimeout: 30s\n",
    );
    let s = parse_service(&text).expect("valid");
    assert_eq!(
        (
            s.spec.update.max_unavailable,
            s.spec.update.max_surge,
            s.spec.update.progress_deadline,
            s.spec.drain_timeout
        ),
        (0, 2, Interval::secs(90), Interval::secs(30))
    );
    let back = parse_service(&Document::Service(s.clone()).to_yaml()).expect("round trip");
    assert_eq!(back, s);
}

#[test]
fn every_bad_update_field_is_named_with_its_line() {
    let cases: [(&str, &str, usize, &str); 7] = [
        (
            "  update: {maxUnavailable: 0, maxSurge: 0}\n",
            "spec.update.maxUnavailable",
            7,
            "both 0",
        ),
        (
            "  update: {maxSurge: -1}\n",
            "spec.update.maxSurge",
            7,
            "between 0 and 1000",
        ),
        (
            "  update: {maxUnavailable: 5000}\n",
            "spec.update.maxUnavailable",
            7,
            "out of range",
        ),
        (
            "  update: {progressDeadline: 0s}\n",
            "spec.update.progressDeadline",
            7,
            "greater than 0s",
        ),
        (
            "  update: {progressDeadline: 25h}\n",
            "spec.update.progressDeadline",
            7,
            "at most 24h",
        ),
        (
            "  update: {maxUnavilable: 1}\n",
            "spec.update.maxUnavilable",
            7,
            "unknown field",
        ),
        ("  drainTimeout: 2h\n", "spec.drainTimeout", 7, "at most 1h"),
    ];
    for (block, field, line, fragment) in cases {
        refused(&with_update(block), 1, field, line, fragment);
    }
}
