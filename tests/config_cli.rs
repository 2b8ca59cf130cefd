//! keel.toml and the daemons' command lines, through the real binaries:
//! `--check-config`, `--help`, flags overriding keys, and the exit statuses.
//! Also pins `etc/keel.toml.sample` to the built-in defaults.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use keel::common::config::{Config, Daemon, FlagAction};

const AGENTD: &str = env!("CARGO_BIN_EXE_keel-agentd");
const CONTROLPLANE: &str = env!("CARGO_BIN_EXE_keel-controlplane");

fn sample_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("etc/keel.toml.sample")
}

/// Runs `bin` with `args` in `cwd`.
fn run_in(bin: &str, cwd: &Path, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("spawn daemon binary")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A temporary directory holding `keel.toml` with `contents`.
fn config_file(contents: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("keel.toml");
    std::fs::write(&path, contents).expect("write keel.toml");
    (dir, path)
}

/// `--check-config -c FILE ARGS...`, expecting exit 0; the printed configuration.
fn check_config(bin: &str, contents: &str, args: &[&str]) -> Config {
    let (dir, path) = config_file(contents);
    let mut all = vec!["--check-config", "-c", path.to_str().expect("utf-8 path")];
    all.extend_from_slice(args);
    let out = run_in(bin, dir.path(), &all);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    Config::from_toml_str(&stdout(&out)).expect("--check-config prints loadable TOML")
}

/// `--check-config -c FILE ARGS...`, expecting exit 2; stderr.
fn check_config_fails(bin: &str, contents: &str, args: &[&str]) -> String {
    let (dir, path) = config_file(contents);
    let mut all = vec!["--check-config", "-c", path.to_str().expect("utf-8 path")];
    all.extend_from_slice(args);
    let out = run_in(bin, dir.path(), &all);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    assert!(out.stdout.is_empty(), "nothing printed on failure");
    stderr(&out)
}

/// Every `section.key` of a TOML document.
fn keys(toml_text: &str) -> BTreeSet<String> {
    let table: toml::Table = toml_text.parse().expect("TOML");
    let mut keys = BTreeSet::new();
    for (section, value) in &table {
        let inner = value.as_table().expect("only tables at the top level");
        for key in inner.keys() {
            keys.insert(format!("{section}.{key}"));
        }
    }
    keys
}

#[test]
fn sample_equals_defaults_and_lists_every_key_with_a_comment() {
    let sample = sample_path();
    let config = Config::load(&sample).expect("the sample loads with the real loader");
    assert_eq!(
        config,
        Config::default(),
        "etc/keel.toml.sample drifted from the defaults"
    );
    let text = std::fs::read_to_string(&sample).expect("read sample");
    assert_eq!(
        keys(&text),
        keys(&Config::default().to_toml()),
        "the sample must show every key"
    );
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let is_key = line.contains(" = ") && !line.starts_with('#');
        if is_key {
            let above = i.checked_sub(1).map(|j| lines[j]).unwrap_or("");
            assert!(above.starts_with("# "), "no comment above `{line}`");
        }
    }
}

#[test]
fn check_config_prints_the_effective_configuration_on_both_daemons() {
    let sample = sample_path();
    for bin in [AGENTD, CONTROLPLANE] {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = run_in(
            bin,
            dir.path(),
            &[
                "--check-config",
                "--config",
                sample.to_str().expect("utf-8"),
            ],
        );
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let printed = Config::from_toml_str(&stdout(&out)).expect("reloadable");
        assert_eq!(printed, Config::default());
    }
}

/// A valid value, different from the default, for each key a flag can set.
fn example_value(key: &str) -> &'static str {
    match key {
        "agent.state_dir" => "/srv/keel/agentd",
        "agent.socket" => "/srv/keel/agentd.sock",
        "agent.socket_group" => "keel",
        "agent.pidfile" => "/srv/keel/agentd.pid",
        "agent.node_subnet" => "10.20.7.0/24",
        "agent.reconcile_interval" => "750ms",
        "agent.usage_interval" => "1m",
        "agent.controlplane" => "cp.example.org:7440",
        "agent.node_id" => "node-7",
        "agent.advertise_addr" => "192.0.2.7:7441",
        "agent.heartbeat_interval" => "2s",
        "agent.proxy_listen" => "127.0.0.7",
        "agent.metrics_listen" => "127.0.0.7:9741",
        "controlplane.listen" => "127.0.0.1:17440",
        "controlplane.state_dir" => "/srv/keel/controlplane",
        "controlplane.pidfile" => "/srv/keel/controlplane.pid",
        "controlplane.cluster_cidr" => "10.32.0.0/12",
        "controlplane.service_cidr" => "10.128.0.0/16",
        "controlplane.heartbeat_interval" => "2s",
        "controlplane.dead_after" => "1m",
        "controlplane.metrics_listen" => "127.0.0.1:9740",
        "controlplane.advertise_addr" => "192.0.2.10:7440",
        "controlplane.etcd_endpoints" => "https://192.0.2.5:2379",
        "controlplane.etcd_ca" => "/srv/keel/etcd-ca.pem",
        "controlplane.etcd_cert" => "/srv/keel/etcd.pem",
        "controlplane.etcd_key" => "/srv/keel/etcd.key",
        "log.level" => "debug",
        other => panic!("add an example value for the flag setting {other}"),
    }
}

/// The value at `key` in the printed configuration.
fn printed_value(config: &Config, key: &str) -> String {
    let (section, name) = key.split_once('.').expect("section.key");
    let table = toml::Value::try_from(config).expect("serialises");
    match &table[section][name] {
        toml::Value::String(s) => s.clone(),
        // As a flag gives a list: comma-separated.
        toml::Value::Array(items) => items
            .iter()
            .map(|i| i.as_str().map_or_else(|| i.to_string(), str::to_string))
            .collect::<Vec<_>>()
            .join(","),
        other => other.to_string(),
    }
}

fn flags_override_keys(bin: &str, daemon: &Daemon) {
    let mut args: Vec<String> = Vec::new();
    let mut expected = Vec::new();
    for flag in daemon.flags {
        if let FlagAction::Set { key, .. } = flag.action {
            args.push(format!("--{}", flag.long));
            args.push(example_value(key).to_string());
            expected.push((key, example_value(key)));
        }
    }
    // The file sets every one of those keys to something else: flags win.
    let mut file = String::from(
        "[agent]\nstate_dir = \"/from/file\"\n[controlplane]\nstate_dir = \"/from/file\"\n",
    );
    file.push_str("[log]\nlevel = \"error\"\n");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let config = check_config(bin, &file, &args);
    for (key, value) in expected {
        assert_eq!(printed_value(&config, key), value, "{key}");
    }
}

#[test]
fn agentd_flags_override_keys() {
    flags_override_keys(AGENTD, &keel::agentd::cli::DAEMON);
}

#[test]
fn controlplane_flags_override_keys() {
    flags_override_keys(CONTROLPLANE, &keel::controlplane::cli::DAEMON);
}

#[test]
fn help_lists_every_flag_with_the_key_it_overrides() {
    for (bin, daemon) in [
        (AGENTD, keel::agentd::cli::DAEMON),
        (CONTROLPLANE, keel::controlplane::cli::DAEMON),
    ] {
        let out = run_in(bin, Path::new("/"), &["--help"]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let help = stdout(&out);
        for flag in daemon.flags {
            let long = format!("--{}", flag.long);
            let line = help
                .lines()
                .find(|l| l.split_whitespace().any(|w| w == long))
                .unwrap_or_else(|| panic!("{} --help does not list {long}:\n{help}", daemon.name));
            assert!(
                line.contains(flag.help),
                "{long}: no description in `{line}`"
            );
            if let Some(c) = flag.short {
                assert!(
                    line.contains(&format!("-{c}, ")),
                    "{long}: no -{c} in `{line}`"
                );
            }
            if let Some(key) = flag.key() {
                assert!(
                    line.contains(&format!("[{key}]")),
                    "{long}: no key in `{line}`"
                );
            }
        }
        let short = run_in(bin, Path::new("/"), &["-h"]);
        assert_eq!(stdout(&short), help);
        let version = run_in(bin, Path::new("/"), &["--version"]);
        assert_eq!(version.status.code(), Some(0));
        assert_eq!(
            stdout(&version),
            format!("{} {}\n", daemon.name, env!("CARGO_PKG_VERSION"))
        );
    }
}

#[test]
fn bad_flags_exit_2_naming_the_flag() {
    let cases: [(&str, &[&str], &str); 6] = [
        (AGENTD, &["--bogus"], "--bogus"),
        (AGENTD, &["--state-dir"], "--state-dir"),
        (AGENTD, &["--simulate=yes"], "--simulate"),
        (AGENTD, &["stray"], "stray"),
        // keel-controlplane has no agent flags.
        (
            CONTROLPLANE,
            &["--node-subnet", "10.0.0.0/24"],
            "--node-subnet",
        ),
        (CONTROLPLANE, &["-x"], "-x"),
    ];
    for (bin, args, named) in cases {
        let out = run_in(bin, Path::new("/"), args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = stderr(&out);
        assert!(err.contains(named), "{args:?}: {err}");
        assert!(err.contains("--help"), "{args:?} points at --help: {err}");
    }
}

#[test]
fn bad_flag_values_exit_2_naming_flag_and_key() {
    let cases: [(&str, &[&str], &str); 9] = [
        (AGENTD, &["--node-subnet", "10.20.0.0"], "agent.node_subnet"),
        (
            AGENTD,
            &["--metrics-listen", "127.0.0.1"],
            "agent.metrics_listen",
        ),
        (
            AGENTD,
            &["--metrics-listen", "localhost:9741"],
            "agent.metrics_listen",
        ),
        (
            CONTROLPLANE,
            &["--metrics-listen", "0.0.0.0:7440"],
            "controlplane.metrics_listen",
        ),
        (
            AGENTD,
            &["--node-subnet", "10.20.0.0/25"],
            "agent.node_subnet",
        ),
        (
            AGENTD,
            &["--reconcile-interval", "5"],
            "agent.reconcile_interval",
        ),
        (AGENTD, &["--state-dir", "relative/dir"], "agent.state_dir"),
        (
            CONTROLPLANE,
            &["--service-cidr", "10.20.0.0/24"],
            "controlplane.service_cidr",
        ),
        (
            CONTROLPLANE,
            &["--dead-after", "5s"],
            "controlplane.dead_after",
        ),
    ];
    for (bin, args, key) in cases {
        let err = check_config_fails(bin, "", args);
        assert!(err.contains(args[0]), "{args:?}: {err}");
        assert!(err.contains(key), "{args:?}: {err}");
        let name = Path::new(bin).file_name().expect("name").to_string_lossy();
        assert!(err.starts_with(&format!("{name}: ")), "{err}");
    }
}

#[test]
fn bad_files_exit_2_naming_key_and_line() {
    let cases = [
        (
            "[agent]\nstate_dir = \"/x\"\nsurprise = 1\n",
            "agent.surprise",
            Some("line 3"),
        ),
        (
            "[controlplane]\ncluster_cidr = \"10.20.0.0/16\"\nservice_cidr = \"10.20.0.0/24\"\n",
            "controlplane.service_cidr",
            None,
        ),
        (
            "[zfs]\nbusy_retry_delay = \"soon\"\n",
            "zfs.busy_retry_delay",
            Some("line 2"),
        ),
        ("[commands]\nzfs = \"zfs\"\n", "commands.zfs", None),
    ];
    for bin in [AGENTD, CONTROLPLANE] {
        for (file, key, line) in cases {
            let err = check_config_fails(bin, file, &[]);
            assert!(err.contains(key), "{err}");
            if let Some(line) = line {
                assert!(err.contains(line), "{err}");
            }
        }
    }
}

#[test]
fn missing_explicit_config_file_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("absent.toml");
    let out = run_in(
        AGENTD,
        dir.path(),
        &["--check-config", "-c", missing.to_str().expect("utf-8")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(&missing.display().to_string()),
        "{}",
        stderr(&out)
    );
}

#[test]
fn simulate_moves_default_paths_under_the_working_directory() {
    let config = {
        let (dir, path) = config_file("[zfs]\njails_dir = \"/srv/jails\"\n");
        let out = run_in(
            AGENTD,
            dir.path(),
            &[
                "--simulate",
                "--check-config",
                "-c",
                path.to_str().expect("utf-8"),
                "--socket",
                "/tmp/a.sock",
            ],
        );
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let cwd = dir.path().canonicalize().expect("canonical cwd");
        let config = Config::from_toml_str(&stdout(&out)).expect("reloadable");
        assert_eq!(config.agent.state_dir, cwd.join("keel-sim/agentd"));
        assert_eq!(config.zfs.volumes_dir, cwd.join("keel-sim/volumes"));
        config
    };
    assert_eq!(
        config.zfs.jails_dir,
        Path::new("/srv/jails"),
        "file keys are kept"
    );
    assert_eq!(config.agent.socket, Path::new("/tmp/a.sock"), "flags win");
    assert_eq!(
        config.controlplane.cluster_cidr.to_string(),
        "127.64.0.0/10"
    );
    assert_eq!(
        config.controlplane.service_cidr.to_string(),
        "127.128.0.0/16"
    );
}
