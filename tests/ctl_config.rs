//! keelctl's contexts file, `version` and `completion` as a process: contexts
//! made with `config set-context` choose where requests go (an agent's
//! socket, a control plane with its key file), below flags and the
//! environment; `version` names the daemon that answered; the completion
//! scripts are valid for their shells and complete commands and resources.

use std::path::Path;
use std::process::Command;

use crate::util::cluster::{Cluster, KEELCTL, Run, run};

/// keelctl in `dir` with `XDG_CONFIG_HOME=dir/config` (so the contexts file
/// is `dir/config/keel/config.toml`), none of the caller's KEEL_* variables,
/// and `env`.
fn keelctl(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(KEELCTL);
    cmd.args(args)
        .current_dir(dir)
        .env_remove("KEEL_SOCKET")
        .env_remove("KEEL_CONTROLPLANE")
        .env_remove("KEEL_KEY_FILE")
        .env("XDG_CONFIG_HOME", dir.join("config"))
        // No keel.toml of this machine either.
        .envs(env.iter().copied());
    run(cmd, None)
}

#[track_caller]
fn ok(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let run = keelctl(dir, args, env);
    assert_eq!(run.code, 0, "keelctl {args:?}: {run:?}");
    run.stdout
}

#[test]
fn contexts_choose_the_agent_or_the_control_plane_below_flags_and_environment() {
    let cluster = Cluster::standard(1);
    cluster.wait_alive(1);
    let dir = cluster.dir().to_path_buf();
    let socket = cluster.socket("n1");
    let socket = socket.to_str().expect("utf-8");
    let addr = cluster.controlplane_addr().to_string();
    let key = cluster.operator_key();
    let key = key.to_str().expect("utf-8");

    // No file yet: nothing listed, no current context.
    let none = keelctl(&dir, &["config", "get-contexts"], &[]);
    assert_eq!((none.code, none.stdout.as_str()), (0, ""), "{none:?}");
    assert!(none.stderr.starts_with("No contexts found in "), "{none:?}");
    let current = keelctl(&dir, &["config", "current-context"], &[]);
    assert_eq!(current.code, 2, "{current:?}");
    assert!(
        current.stderr.contains("no current context is set"),
        "{current:?}"
    );

    let made = ok(
        &dir,
        &["config", "set-context", "lab", "--socket", socket],
        &[],
    );
    assert!(made.starts_with("Context lab created in "), "{made}");
    ok(
        &dir,
        &[
            "config",
            "set-context",
            "prod",
            "--controlplane",
            &addr,
            "--key-file",
            key,
        ],
        &[],
    );
    let file = dir.join("config/keel/config.toml");
    let text = std::fs::read_to_string(&file).expect("the contexts file");
    assert!(text.contains("[contexts.prod]"), "{text}");

    // An unknown context is refused by name, and nothing changes.
    let unknown = keelctl(&dir, &["config", "use-context", "staging"], &[]);
    assert_eq!(unknown.code, 2, "{unknown:?}");
    assert!(
        unknown.stderr.contains("no context named \"staging\"")
            && unknown.stderr.contains("lab, prod"),
        "{unknown:?}"
    );
    assert_eq!(std::fs::read_to_string(&file).expect("file"), text);

    // The agent's context: requests go to its socket.
    assert_eq!(
        ok(&dir, &["config", "use-context", "lab"], &[]),
        "Switched to context lab.\n"
    );
    assert_eq!(ok(&dir, &["config", "current-context"], &[]), "lab\n");
    let table = ok(&dir, &["config", "get-contexts"], &[]);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("CURRENT   NAME   SERVER"), "{table}");
    assert!(lines[1].starts_with("*         lab    "), "{table}");
    assert!(
        lines[2].starts_with("          prod   127.0.0.1:"),
        "{table}"
    );
    let version = ok(&dir, &["version"], &[]);
    assert_eq!(
        version,
        format!(
            "Client: keelctl {v}\nServer: keel-agentd {v} ({socket})\n",
            v = env!("CARGO_PKG_VERSION")
        )
    );
    // `get nodes` needs a control plane: the current context is an agent.
    let nodes = keelctl(&dir, &["get", "nodes"], &[]);
    assert_eq!(nodes.code, 2, "{nodes:?}");

    // The control plane's context signs with its key file.
    ok(&dir, &["config", "use-context", "prod"], &[]);
    let listed = ok(&dir, &["get", "nodes"], &[]);
    assert!(
        listed.lines().nth(1).is_some_and(|l| l.starts_with("n1 ")),
        "{listed}"
    );
    let version = ok(&dir, &["version"], &[]);
    assert!(
        version.ends_with(&format!(
            "Server: keel-controlplane {} ({addr})\n",
            env!("CARGO_PKG_VERSION")
        )),
        "{version}"
    );

    // Above the current context: --context, the environment, flags.
    let jails = ok(&dir, &["--context", "lab", "get", "jails"], &[]);
    assert_eq!(
        jails, "",
        "the agent's list, no NODE column: nothing placed"
    );
    let by_env = keelctl(&dir, &["get", "nodes"], &[("KEEL_SOCKET", socket)]);
    assert_eq!(
        by_env.code, 2,
        "$KEEL_SOCKET wins over the context: {by_env:?}"
    );
    let both = keelctl(
        &dir,
        &["--context", "lab", "--socket", socket, "get", "jails"],
        &[],
    );
    assert_eq!(both.code, 2, "{both:?}");
    assert!(both.stderr.contains("--socket and --context"), "{both:?}");
    // A context's key file is below $KEEL_KEY_FILE.
    ok(
        &dir,
        &[
            "config",
            "set-context",
            "prod",
            "--controlplane",
            &addr,
            "--key-file",
            "/nonexistent.key",
        ],
        &[],
    );
    let bad_key = keelctl(&dir, &["get", "nodes"], &[]);
    assert_eq!(bad_key.code, 2, "{bad_key:?}");
    assert!(bad_key.stderr.contains("/nonexistent.key"), "{bad_key:?}");
    ok(&dir, &["get", "nodes"], &[("KEEL_KEY_FILE", key)]);

    // Deleting the current context leaves none current.
    let deleted = keelctl(&dir, &["config", "delete-context", "prod"], &[]);
    assert_eq!(deleted.code, 0, "{deleted:?}");
    assert!(deleted.stderr.contains("none is set now"), "{deleted:?}");
    let current = keelctl(&dir, &["config", "current-context"], &[]);
    assert_eq!(current.code, 2, "{current:?}");
}

#[test]
fn a_broken_contexts_file_is_refused_naming_the_key() {
    let tmp = tempdir();
    let dir = tmp.path();
    std::fs::create_dir_all(dir.join("config/keel")).expect("dir");
    std::fs::write(
        dir.join("config/keel/config.toml"),
        "current-context = \"lab\"\n[contexts.lab]\nsocket = \"/s\"\ncontrolplane = \"h:1\"\n",
    )
    .expect("write");
    let run = keelctl(dir, &["get", "jails"], &[]);
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:?}");
    assert!(
        run.stderr
            .contains("is not a valid contexts file: contexts.lab.socket"),
        "{run:?}"
    );
}

#[test]
fn completion_scripts_parse_in_their_shells_and_complete_commands() {
    let tmp = tempdir();
    let dir = tmp.path();
    let sh = ok(dir, &["completion", "sh"], &[]);
    let script = dir.join("keelctl.sh");
    std::fs::write(&script, &sh).expect("write");
    // POSIX sh (dash here, as FreeBSD's sh would) reads and runs it: no
    // arrays, no bash syntax; without `complete` it only defines the
    // function.
    let dash = Command::new("sh")
        .arg("-c")
        .arg(". \"$1\" && command -v _keelctl >/dev/null")
        .arg("sh")
        .arg(&script)
        .output()
        .expect("run sh");
    assert!(dash.status.success(), "{dash:?}");
    // bash registers it and completes.
    let complete = |words: &str| -> String {
        let out = Command::new("bash")
            .arg("-c")
            .arg(format!(
                ". \"$1\"; complete -p keelctl >/dev/null || exit 3; _keelctl {words}; printf '%s\\n' \"${{COMPREPLY[@]}}\""
            ))
            .arg("bash")
            .arg(&script)
            .output()
            .expect("run bash");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).expect("utf-8")
    };
    assert_eq!(complete("keelctl ge keelctl"), "get\n");
    assert_eq!(
        complete("keelctl '' get"),
        "jails\nservices\nnodes\nvolumes\ningresses\nbases\n"
    );
    assert_eq!(complete("keelctl j -o"), "json\n");
    assert_eq!(complete("keelctl '' rollout"), "status\nhistory\nundo\n");
    assert_eq!(complete("keelctl --fol logs"), "--follow\n");
    if let Ok(out) = Command::new("shellcheck")
        .args(["-s", "sh"])
        .arg(&script)
        .output()
    {
        assert!(out.status.success(), "shellcheck: {out:?}");
    } else if std::env::var_os("CI").is_some() {
        panic!("shellcheck is needed in CI");
    }
    let zsh = ok(dir, &["completion", "zsh"], &[]);
    assert!(zsh.starts_with("#compdef keelctl\n"), "{zsh}");
    let fish = ok(dir, &["completion", "fish"], &[]);
    assert!(
        fish.contains("complete -c keelctl -n '__fish_seen_subcommand_from get' -a 'jails services nodes volumes ingresses bases'"),
        "{fish}"
    );
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}
