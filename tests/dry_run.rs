//! `keelctl apply --dry-run` and `keelctl diff` against a real
//! `keel-agentd --simulate`, and through a simulated cluster's control plane:
//! the FreeBSD commands an apply would run, listed while nothing changes (no
//! jail process, no dataset directory, no jail.conf, the state file byte
//! for byte, `get jails` as before). `on_freebsd` runs the FreeBSD seams over
//! the scripted host and checks that a dry run lists exactly the commands
//! the apply then runs.

use std::path::Path;
use std::process::Command;

use keel::common::cmd::{Transcript, render_argv};
use keel::common::wire::{DryRunAction, DryRunReport};

use crate::util::agent::Agent;
use crate::util::cluster::{Cluster, Run, port_free_on_nodes, run};
use crate::util::service_doc;

const KEELCTL: &str = env!("CARGO_BIN_EXE_keelctl");

fn keelctl(agent: &Agent, args: &[&str]) -> Run {
    let mut cmd = Command::new(KEELCTL);
    cmd.args(args)
        .current_dir(agent.dir())
        .env("KEEL_SOCKET", agent.socket());
    run(cmd, None)
}

/// keelctl that must exit `code`.
fn exits(agent: &Agent, code: i32, args: &[&str]) -> String {
    let run = keelctl(agent, args);
    assert_eq!(
        run.code,
        code,
        "keelctl {args:?}: {run:?}\nagent log:\n{}",
        agent.log()
    );
    run.stdout
}

fn write(agent: &Agent, file: &str, text: &str) -> String {
    std::fs::write(agent.dir().join(file), text).expect("write spec");
    file.to_string()
}

/// web-1 as tests/golden/agent_provision.txt has it, minus one volume and
/// the cpu limit.
fn web(start: &str, memory: &str) -> String {
    format!(
        "kind: Jail\nmetadata:\n  name: web-1\nspec:\n  base: 14.2-RELEASE\n  exec:\n    start: [{start}]\n  resources:\n    memory: {memory}\n  volumes:\n    - name: web-content\n      mountPath: /usr/local/www\n      size: 1G\n"
    )
}

fn other() -> String {
    "kind: Jail\nmetadata:\n  name: other\nspec:\n  base: 14.2-RELEASE\n  exec:\n    start: [/bin/sleep, '300']\n".into()
}

/// What must not move during a dry run.
#[derive(Debug, PartialEq)]
struct Host {
    /// node.json, then every jail record file, byte for byte.
    state_files: Vec<(String, Option<Vec<u8>>)>,
    jails: String,
    pids: std::collections::BTreeMap<String, u32>,
    jail_dirs: Vec<String>,
    confs: Vec<String>,
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn state_files(state_dir: &Path) -> Vec<(String, Option<Vec<u8>>)> {
    let records = state_dir.join("records");
    std::iter::once(("node.json".to_string(), state_dir.join("node.json")))
        .chain(
            entries(&records)
                .into_iter()
                .map(|name| (name.clone(), records.join(name))),
        )
        .map(|(name, path)| (name, std::fs::read(path).ok()))
        .collect()
}

fn host(agent: &Agent) -> Host {
    Host {
        state_files: state_files(&agent.state_dir()),
        jails: exits(agent, 0, &["get", "jails", "-o", "json"]),
        pids: agent.jail_pids(),
        jail_dirs: entries(&agent.dir().join("keel-sim/jails")),
        confs: entries(&agent.state_dir().join("jails")),
    }
}

/// The golden line of `program` in `golden`, with the golden host's
/// directories replaced by the simulated agent's.
fn golden_line(agent: &Agent, golden: &str, program: &str, verb: &str) -> String {
    let text = std::fs::read_to_string(format!("tests/golden/{golden}.txt")).expect("golden");
    let transcript = Transcript::parse(&text).expect("transcript");
    let argv = transcript
        .exchanges
        .iter()
        .map(|e| &e.argv)
        .find(|a| a[0] == program && a.iter().any(|w| w == verb))
        .unwrap_or_else(|| panic!("no {program} {verb} in {golden}"));
    let sim = agent.dir().join("keel-sim");
    render_argv(argv)
        .replace(
            "/usr/local/keel/jails",
            &sim.join("jails").to_string_lossy(),
        )
        .replace(
            "/tmp/keel-golden/agent",
            &sim.join("agentd/jails").to_string_lossy(),
        )
}

fn changes(stdout: &str) -> Vec<&str> {
    stdout.lines().filter(|l| l.starts_with("  run ")).collect()
}

#[test]
fn a_new_jail_lists_the_provision_commands_and_changes_nothing() {
    let agent = Agent::start(&["--simulate"]);
    let file = write(&agent, "other.yaml", &other());
    exits(&agent, 0, &["apply", "-f", &file]);
    let file = write(&agent, "web.yaml", &web("/bin/sleep, '300'", "512M"));
    let before = host(&agent);

    let out = exits(&agent, 0, &["apply", "--dry-run", "-f", &file]);
    assert!(out.starts_with("jail/web-1:\n"), "{out}");
    assert!(
        out.contains("\n  + spec.exec.start: [\"/bin/sleep\",\"300\"]\n"),
        "{out}"
    );
    assert!(out.contains("\n  would: create jail web-1\n"), "{out}");
    let run = changes(&out);
    for (golden, program, verb) in [
        ("agent_provision", "/sbin/zfs", "clone"),
        ("agent_provision", "/usr/sbin/jail", "-c"),
    ] {
        let line = format!("  run  {}", golden_line(&agent, golden, program, verb));
        assert!(run.contains(&line.as_str()), "{line}\nnot in\n{out}");
    }
    // The provision order: rootfs, volume, mount, epair, limits, jail.
    let position = |word: &str| {
        run.iter()
            .position(|l| l.contains(word))
            .unwrap_or_else(|| panic!("no {word} in\n{out}"))
    };
    let order = [
        "zfs clone",
        "zfs create",
        "mount -t nullfs",
        "epair create",
        "rctl -a jail:web-1:memoryuse:deny=536870912",
        "jail -f",
    ];
    let positions: Vec<usize> = order.iter().map(|w| position(w)).collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "{order:?} in\n{out}"
    );
    assert!(
        out.contains("  read /usr/sbin/jls -j web-1 -h name jid path\n"),
        "the observation is listed as reads: {out}"
    );
    assert!(
        !out.contains("  read /usr/sbin/jls -h name jid path\n"),
        "the apply observes its own jail, not every jail: {out}"
    );

    assert_eq!(
        host(&agent),
        before,
        "a dry run changed the host or the state"
    );
    assert!(
        !agent.dir().join("keel-sim/volumes/web-content").exists(),
        "no volume directory"
    );

    // The structured form says the same.
    let json = exits(
        &agent,
        0,
        &["apply", "--dry-run", "-f", &file, "-o", "json"],
    );
    let reports: Vec<DryRunReport> = serde_json::from_str(&json).expect("json");
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].action, DryRunAction::Create);
    assert!(
        reports[0]
            .commands
            .iter()
            .any(|c| c.changes_host && c.argv[..2] == ["/sbin/zfs", "clone"]),
        "{json}"
    );
    assert_eq!(host(&agent), before);
}

#[test]
fn changes_to_a_running_jail_say_replace_update_in_place_or_nothing() {
    let agent = Agent::start(&["--simulate"]);
    let file = write(&agent, "web.yaml", &web("/bin/sleep, '300'", "512M"));
    exits(&agent, 0, &["apply", "-f", &file]);
    let before = host(&agent);

    let exec = write(&agent, "exec.yaml", &web("/bin/sleep, '301'", "512M"));
    let out = exits(&agent, 0, &["apply", "--dry-run", "-f", &exec]);
    assert!(
        out.contains(
            "\n  ~ spec.exec.start: [\"/bin/sleep\",\"300\"] -> [\"/bin/sleep\",\"301\"]\n"
        ),
        "{out}"
    );
    assert!(
        out.contains("\n  would: replace jail web-1 (spec.exec changed)\n"),
        "{out}"
    );
    let conf = agent.state_dir().join("jails/web-1.conf");
    let run = changes(&out);
    let remove = format!("  run  /usr/sbin/jail -f {} -r web-1", conf.display());
    let create = format!("  run  /usr/sbin/jail -f {} -c web-1", conf.display());
    let at = |line: &str| run.iter().position(|l| *l == line);
    assert!(
        matches!((at(&remove), at(&create)), (Some(r), Some(c)) if r < c),
        "{remove} then {create} in\n{out}"
    );
    assert_eq!(host(&agent), before);

    let memory = write(&agent, "memory.yaml", &web("/bin/sleep, '300'", "256M"));
    let out = exits(&agent, 0, &["apply", "--dry-run", "-f", &memory]);
    assert!(
        out.contains(
            "\n  would: update jail web-1 in place (spec.resources changed), no restart\n"
        ),
        "{out}"
    );
    assert_eq!(
        changes(&out),
        [
            "  run  /usr/bin/rctl -r jail:web-1",
            "  run  /usr/bin/rctl -a jail:web-1:memoryuse:deny=268435456",
        ],
        "{out}"
    );
    assert_eq!(host(&agent), before);

    let out = exits(&agent, 0, &["apply", "--dry-run", "-f", &file]);
    assert!(
        out.contains("\n  would: leave jail web-1 as it is (nothing to do)\n"),
        "{out}"
    );
    assert!(
        changes(&out).is_empty(),
        "no command that changes the host: {out}"
    );
    assert!(out.contains("  read "), "the observation still runs: {out}");
    assert_eq!(host(&agent), before);
}

#[test]
fn diff_exits_0_for_the_same_spec_1_for_a_change_and_2_for_an_invalid_file() {
    let agent = Agent::start(&["--simulate"]);
    let file = write(&agent, "web.yaml", &web("/bin/sleep, '300'", "512M"));
    // Nothing held yet: everything is added.
    let out = exits(&agent, 1, &["diff", "-f", &file]);
    assert!(out.contains("  + metadata.name: \"web-1\"\n"), "{out}");
    exits(&agent, 0, &["apply", "-f", &file]);
    let before = host(&agent);

    let out = exits(&agent, 0, &["diff", "-f", &file]);
    assert_eq!(
        out,
        "jail/web-1:\n  would: leave jail web-1 as it is (nothing to do)\n"
    );

    let changed = write(&agent, "changed.yaml", &web("/bin/sleep, '301'", "256M"));
    let out = exits(&agent, 1, &["diff", "-f", &changed]);
    assert_eq!(
        out,
        "jail/web-1:\n\
         \x20 ~ spec.exec.start: [\"/bin/sleep\",\"300\"] -> [\"/bin/sleep\",\"301\"]\n\
         \x20 ~ spec.resources.memory: 536870912 -> 268435456\n\
         \x20 would: replace jail web-1 (spec.exec changed)\n"
    );
    let json = exits(&agent, 1, &["diff", "-f", &changed, "-o", "json"]);
    let reports: Vec<DryRunReport> = serde_json::from_str(&json).expect("json");
    let paths: Vec<&str> = reports[0].changes.iter().map(|c| c.path.as_str()).collect();
    assert_eq!(paths, ["spec.exec.start", "spec.resources.memory"]);
    assert!(
        reports[0].commands.is_empty(),
        "a diff runs no host command"
    );

    let invalid = write(&agent, "bad.yaml", &web("/bin/sleep, '300'", "lots"));
    let refused = keelctl(&agent, &["diff", "-f", &invalid]);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(
        refused.stderr.contains("spec.resources.memory"),
        "{refused:?}"
    );

    // The routes themselves refuse a bad body as the apply does: 400 naming
    // the field.
    let client =
        keel::common::http::Client::new(keel::common::http::Endpoint::Unix(agent.socket()));
    for verb in ["dry-run", "diff"] {
        let body =
            "kind: Jail\nmetadata: {name: web-1}\nspec: {base: 14.2-RELEASE, exec: {start: []}}\n";
        let answer = client
            .request(
                "POST",
                &format!("/jails/web-1/{verb}"),
                &[],
                body.as_bytes(),
            )
            .expect("the agent answers");
        assert_eq!(
            answer.status,
            400,
            "{verb}: {:?}",
            String::from_utf8_lossy(&answer.body)
        );
        assert!(
            String::from_utf8_lossy(&answer.body).contains("spec.exec.start"),
            "{verb}: {:?}",
            String::from_utf8_lossy(&answer.body)
        );
    }

    // An unreachable agent is an error too, never "differs".
    let mut cmd = Command::new(KEELCTL);
    cmd.args(["diff", "-f", &file])
        .current_dir(agent.dir())
        .env("KEEL_SOCKET", agent.dir().join("nobody.sock"));
    let unreached = run(cmd, None);
    assert_eq!(unreached.code, 2, "{unreached:?}");

    assert_eq!(host(&agent), before);
}

/// keelctl through `cluster` that must exit `code`.
fn cluster_exits(cluster: &Cluster, code: i32, args: &[&str]) -> String {
    let run = cluster.keelctl(args);
    assert_eq!(
        run.code,
        code,
        "keelctl {args:?}: {run:?}\n{}",
        cluster.logs()
    );
    run.stdout
}

fn placed_jails(cluster: &Cluster) -> String {
    cluster_exits(cluster, 0, &["get", "jails", "-o", "json"])
}

#[test]
fn through_the_control_plane_a_dry_run_names_the_node_and_records_no_placement() {
    let cluster = Cluster::standard(2);
    cluster.wait_alive(2);
    let file = cluster.dir().join("web.yaml");
    std::fs::write(&file, web("/bin/sleep, '300'", "64M")).expect("write spec");
    let file = file.to_str().expect("utf-8 path");
    let before = placed_jails(&cluster);
    let journal = || {
        let dir = cluster.dir().join("keel-sim/controlplane");
        ["cluster.json", "cluster.log"].map(|f| std::fs::read(dir.join(f)).ok())
    };
    let journal_before = journal();

    let out = cluster_exits(&cluster, 0, &["apply", "--dry-run", "-f", file]);
    let node = out
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("jail/web-1 on node "))
        .and_then(|l| l.strip_suffix(':'))
        .unwrap_or_else(|| panic!("no node named in\n{out}"))
        .to_string();
    assert!(["n1", "n2"].contains(&node.as_str()), "{out}");
    assert!(out.contains("\n  would: create jail web-1\n"), "{out}");
    assert!(
        out.contains("  run  /sbin/zfs clone -p -o mountpoint="),
        "{out}"
    );
    assert!(out.contains(" -c web-1\n"), "{out}");
    assert_eq!(placed_jails(&cluster), before, "a dry run placed nothing");
    assert_eq!(journal(), journal_before, "no journal entry");
    assert!(
        journal_before.iter().any(Option::is_some),
        "the journal is where it was looked for"
    );
    assert_eq!(
        cluster_exits(&cluster, 1, &["diff", "-f", file])
            .lines()
            .next(),
        out.lines().next()
    );

    // The jail goes where the dry run said, and a later dry run asks that node.
    let applied = cluster_exits(&cluster, 0, &["apply", "-f", file]);
    assert!(applied.contains(&format!("on node {node}")), "{applied}");
    let after = placed_jails(&cluster);
    let changed = cluster.dir().join("changed.yaml");
    std::fs::write(&changed, web("/bin/sleep, '301'", "64M")).expect("write spec");
    let changed = changed.to_str().expect("utf-8 path");
    let out = cluster_exits(&cluster, 0, &["apply", "--dry-run", "-f", changed]);
    assert!(
        out.starts_with(&format!("jail/web-1 on node {node}:\n")),
        "{out}"
    );
    assert!(
        out.contains("\n  would: replace jail web-1 (spec.exec changed)\n"),
        "{out}"
    );
    assert_eq!(
        cluster_exits(&cluster, 0, &["diff", "-f", file])
            .lines()
            .count(),
        2
    );
    // Through the node's own route: the same node, or refused as the apply
    // is (its volume is on the other node).
    let named = cluster_exits(
        &cluster,
        0,
        &["--node", &node, "apply", "--dry-run", "-f", changed],
    );
    assert_eq!(named, out);
    let other = if node == "n1" { "n2" } else { "n1" };
    let refused = cluster.keelctl(&["--node", other, "diff", "-f", changed]);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("answered HTTP 409"), "{refused:?}");
    assert_eq!(placed_jails(&cluster), after);
}

#[test]
fn a_service_through_the_control_plane_gets_its_object_diff() {
    let cluster = Cluster::standard(1);
    cluster.wait_alive(1);
    let port = port_free_on_nodes(1);
    let file = cluster.dir().join("svc.yaml");
    std::fs::write(&file, service_doc("hello", 1, port, "/bin/sleep, '300'")).expect("write");
    let file = file.to_str().expect("utf-8 path");
    let out = cluster_exits(&cluster, 1, &["diff", "-f", file]);
    assert!(out.contains("\n  would: create service hello\n"), "{out}");
    cluster_exits(&cluster, 0, &["apply", "-f", file]);
    assert_eq!(
        cluster_exits(&cluster, 0, &["diff", "-f", file]),
        "service/hello:\n  would: leave service hello as it is (nothing to do)\n"
    );
    std::fs::write(
        cluster.dir().join("svc2.yaml"),
        service_doc("hello", 2, port, "/bin/sleep, '301'"),
    )
    .expect("write");
    let out = cluster_exits(&cluster, 1, &["diff", "-f", "svc2.yaml"]);
    assert!(out.contains("\n  ~ spec.replicas: 1 -> 2\n"), "{out}");
    assert!(out.contains("\n  ~ spec.template.exec.start: "), "{out}");
    assert!(
        out.contains("\n  would: replace service hello (spec.template changed)\n"),
        "{out}"
    );
    assert!(
        out.contains("\n  note: a rolling update replaces the replicas"),
        "{out}"
    );
    // The same is what --dry-run says of a service: its object diff.
    let dry = cluster_exits(&cluster, 0, &["apply", "--dry-run", "-f", "svc2.yaml"]);
    assert_eq!(dry, out);
    let replicas: serde_json::Value = serde_json::from_str(&cluster_exits(
        &cluster,
        0,
        &["get", "service", "hello", "-o", "json"],
    ))
    .expect("json");
    assert_eq!(
        replicas["desired"], 1,
        "the diff changed nothing: {replicas}"
    );
}

// ---- on a FreeBSD host: the scripted one stands in for the kernel ----

mod on_freebsd {
    use std::path::Path;
    use std::time::Duration;

    use keel::agentd::reconciler::AgentStore;
    use keel::agentd::reconciler::{DryRunHost, NodeNetwork, Reconciler};
    use keel::common::backoff::SystemClock;
    use keel::common::cmd::render_argv;
    use keel::common::config::CommandPaths;
    use keel::common::spec::{Jail, parse_jail};
    use keel::common::wire::DryRunAction;
    use keel::host::jail::FreeBsdJails;
    use keel::host::mount::FreeBsdMounts;
    use keel::host::net::FreeBsdNet;
    use keel::host::scripted::ScriptedHost;
    use keel::host::zfs::{FreeBsdZfs, ZfsLayout};

    type Agent = Reconciler<
        FreeBsdJails<ScriptedHost>,
        FreeBsdZfs<ScriptedHost>,
        FreeBsdNet<ScriptedHost>,
        FreeBsdMounts<ScriptedHost>,
    >;

    /// An agent over FreeBSD's seams on `host`, its confs and state in `dir`.
    fn agent(host: &ScriptedHost, dir: &Path) -> Agent {
        let layout = ZfsLayout {
            pool: "zroot".into(),
            jails_dir: dir.join("jails"),
            volumes_dir: dir.join("volumes"),
        };
        host.add_base(
            "zroot/keel/bases/14.2-RELEASE",
            &dir.join("bases/14.2-RELEASE"),
        );
        let paths = CommandPaths::default();
        let conf_dir = dir.join("jail-conf");
        let (store, state) = AgentStore::open(&dir.join("state")).expect("store");
        let mut agent = Reconciler::new(
            FreeBsdJails::new(host.clone(), paths.clone(), &conf_dir),
            FreeBsdZfs::new(host.clone(), paths.clone(), layout, 1, Duration::ZERO),
            FreeBsdNet::new(host.clone(), paths.clone()),
            FreeBsdMounts::new(host.clone(), paths.clone()),
            NodeNetwork {
                bridge: "keel0".into(),
                subnet: "10.20.3.0/24".parse().expect("subnet"),
            },
            store,
            state,
            Box::new(SystemClock),
        );
        agent.set_dry_run_host(DryRunHost {
            paths,
            conf_dir,
            devfs: Default::default(),
        });
        agent
    }

    fn web(start: &str, memory: &str) -> Jail {
        parse_jail(&super::web(start, memory)).expect("valid spec")
    }

    /// The commands `host` ran since `from` that change it.
    fn changes_since(host: &ScriptedHost, from: usize) -> Vec<String> {
        let paths = CommandPaths::default();
        host.ran()[from..]
            .iter()
            .map(|e| &e.argv)
            .filter(|a| {
                let program = Path::new(&a[0]);
                let first = a.get(1).map(String::as_str);
                let reads = program == paths.jls
                    || program == paths.ps
                    || (program == paths.zfs && first == Some("list"))
                    || (program == paths.mount && first == Some("-p"))
                    || (program == paths.ifconfig && first == Some("-l"));
                !reads
            })
            .map(|a| render_argv(a))
            .collect()
    }

    /// The dry run lists exactly the changes the apply then makes, and
    /// makes none itself: for a new jail, a new exec, a new memory limit, a
    /// new volume quota, a new probe, the same spec, and a crashed workload.
    #[test]
    fn the_dry_run_lists_exactly_what_the_apply_then_runs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = ScriptedHost::new(CommandPaths::default(), "zroot");
        let mut agent = agent(&host, dir.path());
        let mut quota = web("/bin/sleep, '301'", "256M");
        quota.spec.volumes[0].size = Some(2 << 30);
        let mut probe = quota.clone();
        probe.spec.health = parse_jail(
            "kind: Jail\nmetadata: {name: x}\nspec:\n  base: b\n  exec: {start: [/bin/x]}\n  health: {tcp: {port: 80}}\n",
        )
        .expect("valid spec")
        .spec
        .health;
        let steps: [(&str, Jail, DryRunAction); 6] = [
            (
                "new",
                web("/bin/sleep, '300'", "512M"),
                DryRunAction::Create,
            ),
            (
                "exec",
                web("/bin/sleep, '301'", "512M"),
                DryRunAction::Replace,
            ),
            (
                "memory",
                web("/bin/sleep, '301'", "256M"),
                DryRunAction::UpdateInPlace,
            ),
            ("quota", quota, DryRunAction::UpdateInPlace),
            ("probe", probe.clone(), DryRunAction::UpdateRecord),
            ("same", probe, DryRunAction::Nothing),
        ];
        for (what, spec, action) in steps {
            let before = host.ran().len();
            let report = agent.dry_run(spec.clone(), None).expect("dry run");
            assert_eq!(report.action, action, "{what}: {report:?}");
            assert!(
                changes_since(&host, before).is_empty(),
                "{what}: the dry run changed the host: {:?}",
                changes_since(&host, before)
            );
            let planned: Vec<String> = report
                .commands
                .iter()
                .filter(|c| c.changes_host)
                .map(|c| render_argv(&c.argv))
                .collect();
            match what {
                "quota" => assert_eq!(
                    planned,
                    ["/sbin/zfs set quota=2147483648 zroot/keel/volumes/web-content"]
                ),
                "probe" | "same" => assert!(planned.is_empty(), "{what}: {planned:?}"),
                _ => {}
            }
            let from = host.ran().len();
            agent.apply(spec, None).expect("apply");
            assert_eq!(planned, changes_since(&host, from), "{what}");
        }

        host.crash("web-1");
        let spec = agent.record("web-1").expect("recorded").spec.clone();
        let report = agent.dry_run(spec.clone(), None).expect("dry run");
        assert_eq!(report.action, DryRunAction::Start, "{report:?}");
        let planned: Vec<String> = report
            .commands
            .iter()
            .filter(|c| c.changes_host)
            .map(|c| render_argv(&c.argv))
            .collect();
        assert!(
            planned.iter().any(|c| c == "/usr/sbin/jail -R web-1"),
            "{planned:#?}"
        );
        let from = host.ran().len();
        agent.apply(spec, None).expect("apply");
        assert_eq!(planned, changes_since(&host, from), "crashed");
    }

    /// A step the host would refuse ends the list, with a note that says
    /// why; the apply then fails at the same command.
    #[test]
    fn a_refused_step_ends_the_list_with_a_note() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = ScriptedHost::new(CommandPaths::default(), "zroot");
        let mut agent = agent(&host, dir.path());
        let mut spec = web("/bin/sleep, '300'", "512M");
        spec.spec.base = "13.0-RELEASE".into();
        let report = agent.dry_run(spec.clone(), None).expect("dry run");
        let note = report.note.clone().expect("a note");
        assert!(note.contains("13.0-RELEASE@keel"), "{note}");
        let last = report.commands.last().expect("commands");
        assert_eq!(last.argv[..2], ["/sbin/zfs", "clone"], "{report:?}");
        let error = agent.apply(spec, None).expect_err("no such base");
        assert!(error.to_string().contains("13.0-RELEASE@keel"), "{error}");
    }
}
