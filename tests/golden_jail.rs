//! Golden transcripts of `FreeBsdJails` (tests/golden/jail_*.txt): every
//! `JailRuntime` method and its failure paths against canned FreeBSD output,
//! plus an end-to-end check that the quoting of `render_jail_conf` survives
//! both jail.conf(5) and sh(1) parsing.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;

use keel::common::cmd::{CommandRunner, RecordingRunner, SystemRunner, argv};
use keel::common::config::{CommandPaths, DevfsRuleset};
use keel::host::jail::{
    FreeBsdJails, JailError, JailNetwork, JailParams, JailRuntime, Limits, ObservedJail, Removal,
    render_jail_conf,
};

use crate::util::golden;

/// The conf directory of one transcript. Fixed rather than a fresh temporary
/// directory because its path is part of the argv the transcript records.
fn conf_dir(transcript: &str) -> PathBuf {
    PathBuf::from("/tmp/keel-golden").join(transcript)
}

fn jails(runner: Arc<RecordingRunner>, transcript: &str) -> FreeBsdJails<Arc<RecordingRunner>> {
    FreeBsdJails::new(runner, CommandPaths::default(), conf_dir(transcript))
}

fn web() -> JailParams {
    JailParams {
        name: "web-1".into(),
        path: "/usr/local/keel/jails/web-1".into(),
        hostname: "web-1".into(),
        network: Some(JailNetwork {
            interface: "kj_web-1".into(),
            address: Ipv4Addr::new(10, 20, 3, 15),
            prefix_len: 24,
            gateway: Ipv4Addr::new(10, 20, 3, 1),
        }),
        exec_start: argv(&["/usr/local/bin/app", "--port", "8080"]),
        exec_stop: argv(&["/usr/local/bin/app", "stop"]),
        env: BTreeMap::from([("GREETING".to_string(), "hello world".to_string())]),
    }
}

/// Puts the conf a previous create would have left, for the remove transcripts.
fn leave_conf(transcript: &str) -> PathBuf {
    let dir = conf_dir(transcript);
    std::fs::create_dir_all(&dir).expect("conf dir");
    let path = dir.join("web-1.conf");
    std::fs::write(&path, render_jail_conf(&web(), DevfsRuleset::default())).expect("conf written");
    path
}

#[test]
fn create_writes_the_conf_and_creates_from_it() {
    golden::check("jail_create", |runner| {
        jails(runner, "jail_create")
            .create(&web())
            .expect("created");
        let conf = conf_dir("jail_create").join("web-1.conf");
        let text = std::fs::read_to_string(&conf).expect("conf exists");
        assert_eq!(text, render_jail_conf(&web(), DevfsRuleset::default()));
    });
}

#[test]
fn create_by_a_jailed_agent_writes_ruleset_0_for_the_parents() {
    golden::check("jail_create_nested", |runner| {
        jails(runner, "jail_create_nested")
            .with_devfs_ruleset(DevfsRuleset::Inherit)
            .create(&web())
            .expect("created");
        let conf = conf_dir("jail_create_nested").join("web-1.conf");
        let text = std::fs::read_to_string(&conf).expect("conf exists");
        assert!(text.contains("\tdevfs_ruleset = 0;\n"), "{text}");
        assert_eq!(text, render_jail_conf(&web(), DevfsRuleset::Inherit));
    });
}

#[test]
fn create_of_an_existing_jail_is_already_exists() {
    golden::check("jail_create_exists", |runner| {
        let err = jails(runner, "jail_create_exists")
            .create(&web())
            .expect_err("exists");
        assert_eq!(err, JailError::AlreadyExists("web-1".into()));
    });
}

#[test]
fn create_failing_in_exec_start_reports_jails_message() {
    golden::check("jail_create_start_failed", |runner| {
        let err = jails(runner, "jail_create_start_failed")
            .create(&web())
            .expect_err("exec.start failed");
        let msg = err.to_string();
        assert!(msg.contains("jail -f /tmp/keel-golden"), "{msg}");
        assert!(
            msg.contains("/sbin/route add default 10.20.3.1: failed"),
            "{msg}"
        );
    });
}

fn root() -> PathBuf {
    web().path
}

#[test]
fn remove_uses_the_conf_then_deletes_it() {
    let conf = leave_conf("jail_remove");
    golden::check("jail_remove", |runner| {
        jails(runner, "jail_remove")
            .remove("web-1", &root(), Removal::Stop)
            .expect("removed");
    });
    assert!(!conf.exists(), "conf of a removed jail is deleted");
}

#[test]
fn remove_of_a_missing_jail_still_unmounts_its_devfs() {
    let conf = leave_conf("jail_remove_missing");
    golden::check("jail_remove_missing", |runner| {
        jails(runner, "jail_remove_missing")
            .remove("web-1", &root(), Removal::Stop)
            .expect("absent is fine");
    });
    assert!(!conf.exists());
}

/// Without the conf jail(8) knows nothing of mount.devfs: `jail -R` (never
/// plain `jail -r`, which would read /etc/jail.conf), then Keel unmounts the
/// devfs itself, or `zfs destroy` of the root would fail busy.
#[test]
fn remove_without_a_conf_forces_and_unmounts_devfs_itself() {
    let conf = conf_dir("jail_remove_without_conf").join("web-1.conf");
    let _ = std::fs::remove_file(&conf);
    golden::check("jail_remove_without_conf", |runner| {
        jails(runner, "jail_remove_without_conf")
            .remove("web-1", &root(), Removal::Stop)
            .expect("removed");
    });
}

#[test]
fn remove_failing_in_exec_stop_keeps_the_jail_and_its_conf() {
    let conf = leave_conf("jail_remove_stop_failed");
    golden::check("jail_remove_stop_failed", |runner| {
        let err = jails(runner, "jail_remove_stop_failed")
            .remove("web-1", &root(), Removal::Stop)
            .expect_err("exec.stop failed, so the jail is still there");
        assert!(matches!(err, JailError::StopFailed { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("pid file /var/run/app.pid not found"), "{msg}");
    });
    assert!(conf.exists(), "the conf is kept: the jail is still there");
}

/// A crashed workload, or one whose exec.stop failed: `jail -R` runs
/// nothing inside the jail, then the devfs goes and so does the conf.
#[test]
fn forced_remove_runs_no_exec_stop_and_unmounts_devfs() {
    let conf = leave_conf("jail_remove_forced");
    golden::check("jail_remove_forced", |runner| {
        jails(runner, "jail_remove_forced")
            .remove("web-1", &root(), Removal::Force)
            .expect("removed");
    });
    assert!(!conf.exists(), "the conf of a removed jail is deleted");
}

/// Whatever sits at `{root}/dev` when the mount table lists no devfs there
/// (a link the jail's root planted, say) is not unmounted.
#[test]
fn forced_remove_leaves_a_dev_that_is_not_a_listed_devfs_alone() {
    let conf = leave_conf("jail_remove_forced_no_devfs");
    golden::check("jail_remove_forced_no_devfs", |runner| {
        jails(runner, "jail_remove_forced_no_devfs")
            .remove("web-1", &root(), Removal::Force)
            .expect("removed");
    });
    assert!(!conf.exists());
}

/// A busy devfs fails the removal with umount's message (the jail itself is
/// gone: the next attempt finds it missing and tries the unmount again).
#[test]
fn forced_remove_with_a_busy_devfs_fails_with_umounts_message() {
    let conf = leave_conf("jail_remove_devfs_busy");
    golden::check("jail_remove_devfs_busy", |runner| {
        let err = jails(runner, "jail_remove_devfs_busy")
            .remove("web-1", &root(), Removal::Force)
            .expect_err("devfs busy");
        assert!(err.to_string().contains("Device busy"), "{err}");
    });
    assert!(conf.exists(), "kept until the removal finished");
}

#[test]
fn list_reads_jls_and_counts_processes_once() {
    golden::check("jail_list", |runner| {
        let listed = jails(runner, "jail_list").list().expect("lists");
        let jail = |name: &str, jid, path: &str, running| ObservedJail {
            name: name.into(),
            jid,
            path: path.into(),
            running,
            exit_status: None,
        };
        assert_eq!(
            listed,
            [
                jail("web-1", 1, "/usr/local/keel/jails/web-1", true),
                jail("db-0", 2, "/usr/local/keel/jails/db-0", false),
                jail("legacy", 5, "/jails/legacy app", true),
            ]
        );
    });
}

#[test]
fn list_with_no_jails_is_empty() {
    golden::check("jail_list_empty", |runner| {
        assert_eq!(jails(runner, "jail_list_empty").list(), Ok(vec![]));
    });
}

fn observed(name: &str, jid: u32, running: bool) -> ObservedJail {
    ObservedJail {
        name: name.into(),
        jid,
        path: format!("/usr/local/keel/jails/{name}").into(),
        running,
        exit_status: None,
    }
}

#[test]
fn get_reads_one_jail_and_only_its_processes() {
    golden::check("jail_get", |runner| {
        let got = jails(runner, "jail_get").get("web-1").expect("looked up");
        assert_eq!(got, Some(observed("web-1", 3, true)));
    });
}

#[test]
fn get_of_a_jail_with_no_process_left_is_not_running() {
    golden::check("jail_get_crashed", |runner| {
        let got = jails(runner, "jail_get_crashed")
            .get("db-0")
            .expect("looked up");
        assert_eq!(got, Some(observed("db-0", 2, false)));
    });
}

#[test]
fn get_of_a_missing_jail_is_absent_not_an_error() {
    golden::check("jail_get_missing", |runner| {
        assert_eq!(jails(runner, "jail_get_missing").get("web-1"), Ok(None));
    });
}

#[test]
fn get_of_a_dying_jail_is_absent_as_in_the_list() {
    golden::check("jail_get_dying", |runner| {
        assert_eq!(jails(runner, "jail_get_dying").get("web-1"), Ok(None));
    });
}

#[test]
fn get_of_a_jail_removed_before_ps_is_absent() {
    golden::check("jail_get_gone_before_ps", |runner| {
        assert_eq!(
            jails(runner, "jail_get_gone_before_ps").get("web-1"),
            Ok(None)
        );
    });
}

fn limits() -> Limits {
    Limits {
        cpu: Some(1.5),
        memory: Some(512 << 20),
    }
}

#[test]
fn set_limits_replaces_the_rules() {
    golden::check("jail_set_limits", |runner| {
        jails(runner, "jail_set_limits")
            .set_limits("web-1", &limits())
            .expect("set");
    });
}

#[test]
fn set_limits_without_prior_rules() {
    golden::check("jail_set_limits_no_prior_rules", |runner| {
        jails(runner, "jail_set_limits_no_prior_rules")
            .set_limits("web-1", &limits())
            .expect("set");
    });
}

#[test]
fn set_limits_with_racct_disabled_says_how_to_enable_it() {
    golden::check("jail_set_limits_racct_disabled", |runner| {
        let err = jails(runner, "jail_set_limits_racct_disabled")
            .set_limits("web-1", &limits())
            .expect_err("racct is off");
        assert!(matches!(err, JailError::RacctDisabled(_)), "{err}");
        assert!(err.to_string().contains("/boot/loader.conf"), "{err}");
    });
}

#[test]
fn set_limits_refused_to_a_jailed_agent_says_what_to_do() {
    golden::check("jail_set_limits_not_permitted", |runner| {
        let err = jails(runner, "jail_set_limits_not_permitted")
            .set_limits("web-1", &limits())
            .expect_err("jailed root may not use rctl");
        assert!(matches!(err, JailError::RctlNotPermitted { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("rctl -r jail:web-1"), "{msg}");
        assert!(msg.contains("inside a jail"), "{msg}");
        assert!(
            msg.contains("leave resources.cpu and resources.memory out"),
            "{msg}"
        );
    });
}

#[test]
fn clear_limits_refused_to_a_jailed_agent_is_an_error() {
    golden::check("jail_clear_limits_not_permitted", |runner| {
        let err = jails(runner, "jail_clear_limits_not_permitted")
            .clear_limits("web-1")
            .expect_err("jailed root may not use rctl");
        assert!(matches!(err, JailError::RctlNotPermitted { .. }), "{err:?}");
    });
}

#[test]
fn clear_limits_removes_every_rule() {
    golden::check("jail_clear_limits", |runner| {
        jails(runner, "jail_clear_limits")
            .clear_limits("web-1")
            .expect("cleared");
    });
}

#[test]
fn clear_limits_with_no_rules_is_success() {
    golden::check("jail_clear_limits_no_rules", |runner| {
        jails(runner, "jail_clear_limits_no_rules")
            .clear_limits("web-1")
            .expect("nothing to clear");
    });
}

#[test]
fn clear_limits_without_racct_is_success() {
    golden::check("jail_clear_limits_racct_absent", |runner| {
        jails(runner, "jail_clear_limits_racct_absent")
            .clear_limits("web-1")
            .expect("no rule can exist without RACCT");
    });
}

#[test]
fn exec_returns_the_commands_output() {
    golden::check("jail_exec", |runner| {
        let out = jails(runner, "jail_exec")
            .exec("web-1", &argv(&["/usr/local/sbin/nginx", "-t"]))
            .expect("ran");
        assert!(out.success());
        assert!(out.stderr.contains("test is successful"), "{}", out.stderr);
    });
}

#[test]
fn exec_leaves_a_failing_status_to_the_caller() {
    golden::check("jail_exec_failing", |runner| {
        let out = jails(runner, "jail_exec_failing")
            .exec("web-1", &argv(&["/usr/local/sbin/nginx", "-t"]))
            .expect("ran");
        assert_eq!(out.status, 1);
        assert!(out.stderr.contains("[emerg]"), "{}", out.stderr);
    });
}

/// Reads one jail.conf double-quoted string the way jail(8)'s lexer does
/// (backslash takes the next character literally; `$` would start a
/// variable), returning the value and the rest of the line.
fn jail_conf_string(text: &str) -> (String, &str) {
    let body = text.strip_prefix('"').expect("a quoted string");
    let mut value = String::new();
    let mut chars = body.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => value.push(chars.next().expect("escaped character").1),
            '$' => panic!("unescaped $ would be expanded by jail(8): {text}"),
            '"' => return (value, &body[i + 1..]),
            c => value.push(c),
        }
    }
    panic!("unterminated string: {text}")
}

#[test]
fn hostile_values_reach_the_workload_unchanged() {
    let hostile = [
        "it's",
        "\"double\"",
        "$HOME",
        "${path}",
        "a;b",
        "two words",
        r"back\slash",
        "`id`",
        "[a-z]*",
        "~root",
        "#not a comment",
        "new\nline",
        "",
    ];
    let mut params = web();
    params.exec_start = std::iter::once("/usr/local/bin/app".to_string())
        .chain(hostile.iter().map(|s| s.to_string()))
        .collect();
    params.env = BTreeMap::from([("V".to_string(), "$HOME 'x' \"y\" \\z".to_string())]);
    let conf = render_jail_conf(&params, DevfsRuleset::default());
    // The value spans lines (one argument holds a newline): parse from the
    // last `exec.start +=`, the workload, rather than line by line.
    let marker = "exec.start += ";
    let at = conf.rfind(marker).expect("the workload line") + marker.len();
    let (command, rest) = jail_conf_string(&conf[at..]);
    assert!(rest.starts_with(";\n"), "{rest}");
    // Swap daemon(8) for printf(1) so sh(1) shows the argv it would exec.
    let args = command
        .strip_prefix("/usr/sbin/daemon -f -o /var/log/keel-start.log ")
        .expect("the workload runs under daemon(8)");
    let shell = "/bin/sh".to_string();
    let script = format!("printf '<%s>' {args}");
    let out = SystemRunner
        .run(
            &[shell, "-c".to_string(), script],
            None,
            std::time::Duration::from_secs(10),
        )
        .expect("sh runs");
    assert!(out.success(), "{}", out.stderr);
    let expected: String = [
        "/usr/bin/env",
        "V=$HOME 'x' \"y\" \\z",
        "/usr/local/bin/app",
    ]
    .iter()
    .copied()
    .chain(hostile)
    .map(|a| format!("<{a}>"))
    .collect();
    assert_eq!(out.stdout, expected);
}

#[test]
fn an_exec_health_probe_is_one_jexec_and_fails_on_a_non_zero_status() {
    golden::check("jail_exec_health_probe", |runner| {
        let ran = jails(runner, "jail_exec_health_probe")
            .exec("db-0", &argv(&["/usr/local/bin/pg_isready", "-q"]));
        let verdict = keel::agentd::health::probe::exec_outcome(ran);
        assert_eq!(verdict, Err("exited 2".to_string()));
    });
}
