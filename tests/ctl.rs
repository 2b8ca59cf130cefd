//! The real `keelctl` driving the real `keel-agentd --simulate`:
//! apply, get, delete, validation that sends nothing, multi-document order, a
//! crash loop with backoff, `logs` and `logs -f`, `kill -9` of the agent and its restart, and the
//! README quick start word for word. Workloads are ordinary commands
//! (`/bin/sleep`), so nothing beyond a Unix base system is needed; only the
//! quick start, whose example serves HTTP with python3, is skipped without it.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use keel::common::cidr::Ipv4Net;
use keel::common::spec;
use keel::common::wire::{JailStatus, Phase};

use crate::util::agent::{Agent, process_alive};
use crate::util::cluster::{Run, run};

const KEELCTL: &str = env!("CARGO_BIN_EXE_keelctl");

/// A timer pass every 200 ms keeps crash detection and backoff quick.
const AGENT_ARGS: &[&str] = &["--simulate", "--reconcile-interval", "200ms"];

/// Runs keelctl against `agent` (socket from `$KEEL_SOCKET`, as the README
/// does it) in the agent's directory, with `stdin` if given.
fn keelctl_in(agent: &Agent, cwd: &Path, args: &[&str], stdin: Option<&str>) -> Run {
    let mut cmd = Command::new(KEELCTL);
    cmd.args(args)
        .current_dir(cwd)
        .env("KEEL_SOCKET", agent.socket());
    run(cmd, stdin)
}

fn keelctl(agent: &Agent, args: &[&str]) -> Run {
    keelctl_in(agent, agent.dir(), args, None)
}

/// keelctl that must succeed.
fn ok(agent: &Agent, args: &[&str]) -> String {
    let run = keelctl(agent, args);
    assert_eq!(
        run.code,
        0,
        "keelctl {args:?}: {run:?}\nagent log:\n{}",
        agent.log()
    );
    run.stdout
}

fn list(agent: &Agent) -> Vec<JailStatus> {
    let json = ok(agent, &["get", "jails", "-o", "json"]);
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("get jails -o json: {e}\n{json}"))
}

fn by_name(agent: &Agent) -> BTreeMap<String, JailStatus> {
    list(agent)
        .into_iter()
        .map(|j| (j.name.clone(), j))
        .collect()
}

/// A Jail document running `start` (YAML flow list items, already quoted).
fn jail(name: &str, start: &str) -> String {
    format!(
        "kind: Jail\nmetadata:\n  name: {name}\nspec:\n  base: 14.2-RELEASE\n  exec:\n    start: [{start}]\n"
    )
}

fn sleeper(name: &str) -> String {
    jail(name, "/bin/sleep, '300'")
}

fn write(agent: &Agent, file: &str, text: &str) -> String {
    std::fs::write(agent.dir().join(file), text).expect("write spec");
    file.to_string()
}

fn sim_subnet() -> Ipv4Net {
    "127.64.0.0/24".parse().expect("cidr")
}

fn wait_for<T>(what: &str, agent: &Agent, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}\nagent log:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn apply_get_and_delete_a_jail() {
    let agent = Agent::start(AGENT_ARGS);
    let file = write(&agent, "web.yaml", &sleeper("web-1"));

    let out = ok(&agent, &["apply", "-f", &file]);
    // Started, not yet seen running by a later pass.
    assert_eq!(out, "jail/web-1 applied (Starting, 127.64.0.2)\n");
    wait_for("web-1 seen running", &agent, || {
        (by_name(&agent)["web-1"].state == Phase::Running).then_some(())
    });

    // The table: header, one row, columns aligned under their headers.
    let table = ok(&agent, &["get", "jails", "-o", "wide"]);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 2, "{table}");
    let header = lines[0];
    assert!(header.starts_with("NAME"), "{table}");
    let row = lines[1];
    for (column, cell) in [
        ("NAME", "web-1"),
        ("READY", "yes"),
        ("STATUS", "Running"),
        ("RESTARTS", "0"),
        ("LAST EXIT", "-"),
        ("RETRY IN", "-"),
        ("ADDRESS", "127.64.0.2"),
        ("EPOCH", "-"),
    ] {
        let at = header.find(column).expect("column header");
        assert!(
            row[at..].starts_with(cell),
            "{cell} under {column}:\n{table}"
        );
    }
    let age = row[header.find("AGE").expect("AGE column")..]
        .split_whitespace()
        .next()
        .unwrap_or_default();
    assert!(age.ends_with('s') || age.ends_with('m'), "{table}");

    let jails = list(&agent);
    assert_eq!(jails.len(), 1, "{jails:?}");
    let web = &jails[0];
    assert_eq!(
        (web.name.as_str(), web.state, web.restarts),
        ("web-1", Phase::Running, 0)
    );
    assert!(sim_subnet().contains(web.address), "{web:?}");
    assert_eq!(web.last_error, None);

    // One jail: an object, in JSON and YAML alike.
    let one: JailStatus =
        serde_json::from_str(&ok(&agent, &["get", "jails", "web-1", "-o", "json"])).expect("json");
    assert_eq!(&one, web);
    // In YAML, one jail is the object as applied with its status after it,
    // which applies back as it is and changes nothing.
    let printed = ok(&agent, &["get", "jail", "web-1", "-o", "yaml"]);
    let object: serde_yaml::Value = serde_yaml::from_str(&printed).expect("yaml");
    assert_eq!(object["kind"].as_str(), Some("Jail"), "{printed}");
    let status: JailStatus = serde_yaml::from_value(object["status"].clone()).expect("status");
    assert_eq!(&status, web);
    assert_eq!(
        spec::parse_jail(&printed).expect("the printed object is a valid spec"),
        spec::parse_jail(&sleeper("web-1")).expect("valid")
    );

    let pid = agent.jail_pids()["web-1"];
    assert!(process_alive(pid), "the workload runs");
    let file = write(&agent, "printed.yaml", &printed);
    ok(&agent, &["apply", "-f", &file]);
    assert_eq!(
        agent.jail_pids()["web-1"],
        pid,
        "applying it back restarted nothing"
    );

    let missing = keelctl(&agent, &["get", "jails", "nope"]);
    assert_eq!(missing.code, 1, "{missing:?}");
    assert!(
        missing
            .stderr
            .starts_with("keelctl: get jail/nope failed: no jail named nope"),
        "{missing:?}"
    );
    assert!(missing.stderr.contains("answered HTTP 404"), "{missing:?}");

    assert_eq!(
        ok(&agent, &["delete", "jail", "web-1"]),
        "jail/web-1 deleted\n"
    );
    let after = keelctl(&agent, &["get", "jails"]);
    assert_eq!(
        (after.code, after.stdout.as_str(), after.stderr.as_str()),
        (0, "", "No jails found.\n")
    );
    assert_eq!(ok(&agent, &["get", "jails", "-o", "json"]).trim(), "[]");
    assert!(
        !process_alive(pid),
        "the workload {pid} was stopped with its jail"
    );
}

#[test]
fn an_invalid_file_exits_2_naming_field_and_line_and_sends_nothing() {
    let agent = Agent::start(AGENT_ARGS);
    let bad = sleeper("web-1").replace(
        "  base: 14.2-RELEASE\n",
        "  base: 14.2-RELEASE\n  resources: {memory: 12X}\n",
    );
    let file = write(&agent, "bad.yaml", &bad);
    let run = keelctl(&agent, &["apply", "-f", &file]);
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:?}");
    let first = run.stderr.lines().next().unwrap_or_default();
    assert!(
        first
            .starts_with("keelctl: bad.yaml is invalid: document 1, spec.resources.memory (line 6"),
        "{run:?}"
    );
    assert!(run.stderr.contains("nothing was sent"), "{run:?}");

    let validate = keelctl(&agent, &["validate", "-f", &file]);
    assert_eq!(validate.code, 2, "{validate:?}");
    assert!(
        validate.stderr.contains("spec.resources.memory (line 6"),
        "{validate:?}"
    );

    // Two mistakes in one document and one in the next are reported
    // together, the first on the summary line and each other on its own.
    let second = sleeper("web-2").replace("web-2", "Web-2");
    let three = format!(
        "{}---\n{second}",
        sleeper("web-1").replace(
            "  base: 14.2-RELEASE\n",
            "  base: 14.2 RELEASE\n  resources: {cpu: 0}\n"
        )
    );
    let file = write(&agent, "three.yaml", &three);
    let run = keelctl(&agent, &["apply", "-f", &file]);
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:?}");
    let lines: Vec<&str> = run.stderr.lines().collect();
    assert!(
        lines[0].starts_with("keelctl: three.yaml is invalid (3 errors): document 1, spec.base"),
        "{run:?}"
    );
    assert!(
        lines[1].starts_with("  document 1, spec.resources.cpu"),
        "{run:?}"
    );
    assert!(
        lines[2].starts_with("  document 2, metadata.name"),
        "{run:?}"
    );
    assert_eq!(lines[3], "  nothing was sent", "{run:?}");

    assert_eq!(list(&agent), Vec::new(), "the agent got nothing");
}

#[test]
fn a_multi_document_file_applies_in_order_and_one_bad_document_applies_nothing() {
    let agent = Agent::start(AGENT_ARGS);
    // Names out of alphabetical order: the agent gives the lowest free address
    // to whichever comes first, so addresses reveal the order of the applies.
    let docs = [sleeper("charlie"), sleeper("alpha"), sleeper("bravo")].join("---\n");

    let mut broken = docs.clone();
    broken.push_str("---\n");
    broken.push_str(&jail("delta", ""));
    let file = write(&agent, "broken.yaml", &broken);
    let run = keelctl(&agent, &["apply", "-f", &file]);
    assert_eq!(run.code, 2, "{run:?}");
    assert!(
        run.stderr.contains("document 4, spec.exec.start"),
        "{run:?}"
    );
    assert_eq!(list(&agent), Vec::new(), "nothing applied");

    let valid = keelctl(&agent, &["validate", "-f", "-"]);
    assert_eq!(valid.code, 2, "empty stdin holds no document: {valid:?}");
    let valid = keelctl_in(&agent, agent.dir(), &["validate", "-f", "-"], Some(&docs));
    assert_eq!(
        (valid.code, valid.stdout.as_str()),
        (0, "3 documents valid\n"),
        "{valid:?}"
    );

    let out = keelctl_in(&agent, agent.dir(), &["apply", "-f", "-"], Some(&docs));
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.stdout,
        "jail/charlie applied (Starting, 127.64.0.2)\n\
         jail/alpha applied (Starting, 127.64.0.3)\n\
         jail/bravo applied (Starting, 127.64.0.4)\n"
    );

    let file = write(&agent, "three.yaml", &docs);
    assert_eq!(
        ok(&agent, &["delete", "-f", &file]),
        "jail/bravo deleted\njail/alpha deleted\njail/charlie deleted\n"
    );
    assert_eq!(list(&agent), Vec::new());
}

/// A workload that exits at once: never shown Running, neither by apply's
/// line nor by any `get` afterwards; its first crash is Restarting with
/// LAST EXIT 3, the later ones CrashLoop with RETRY IN; the delay grows.
#[test]
fn a_workload_that_exits_is_never_running_and_restarts_with_growing_backoff() {
    let agent = Agent::start(AGENT_ARGS);
    let file = write(
        &agent,
        "crash.yaml",
        &jail("crash", "/bin/sh, -c, 'exit 3'"),
    );
    let applied = ok(&agent, &["apply", "-f", &file]);
    assert!(
        applied.starts_with("jail/crash applied (Starting, ")
            || applied.starts_with("jail/crash applied (Restarting, "),
        "{applied}"
    );

    // Per restart count, the longest wait until the next restart seen.
    let mut longest_wait: BTreeMap<u32, u64> = BTreeMap::new();
    let mut last_restarts = 0;
    let mut seen_restarting = None;
    wait_for("two restarts and the crash after them", &agent, || {
        let status = by_name(&agent).remove("crash").expect("crash is listed");
        assert!(
            matches!(
                status.state,
                Phase::Starting | Phase::Restarting | Phase::CrashLoop
            ),
            "an exited workload is never Running: {status:?}"
        );
        assert!(
            status.restarts >= last_restarts,
            "restarts never go down: {status:?}"
        );
        last_restarts = status.restarts;
        if status.state == Phase::Restarting {
            assert_eq!(status.restarts, 0, "only the first crash: {status:?}");
            seen_restarting = Some(status.clone());
        }
        if status.state == Phase::CrashLoop {
            let wait = longest_wait.entry(status.restarts).or_default();
            *wait = (*wait).max(
                status
                    .retry_in_secs
                    .expect("a crash loop says when it retries"),
            );
        }
        (status.restarts >= 2 && status.state == Phase::CrashLoop).then_some(())
    });
    let first = seen_restarting.expect("the first crash was seen as Restarting");
    assert_eq!(first.last_exit.and_then(|e| e.status), Some(3), "{first:?}");
    assert!(first.retry_in_secs.is_some(), "{first:?}");
    assert!(
        first
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("exited with status 3")),
        "{first:?}"
    );
    // The delay doubles from 1 s: 2 s after the first restart, 4 s after
    // the second, so the wait seen after it is longer.
    let second = longest_wait.get(&1).copied().unwrap_or(0);
    let third = longest_wait[&2];
    assert!(third > second, "backoff grows: {longest_wait:?}");

    let table = ok(&agent, &["get", "jails"]);
    let header = table.lines().next().unwrap_or_default();
    let row = table.lines().nth(1).unwrap_or_default();
    let cell = |column: &str| &row[header.find(column).expect(column)..];
    assert!(cell("STATUS").starts_with("CrashLoop"), "{table}");
    assert!(cell("LAST EXIT").starts_with("3 ("), "{table}");
    assert!(!cell("RETRY IN").starts_with('-'), "{table}");
    let events = ok(&agent, &["get", "events", "--for", "jail/crash"]);
    assert!(
        events
            .lines()
            .any(|l| l.contains("Exited") && l.contains("exited with status 3")),
        "{events}"
    );
    assert!(events.contains("BackOff"), "{events}");
}

#[test]
fn a_killed_agent_restarts_with_every_applied_jail_and_restarts_no_workload() {
    let mut agent = Agent::start(AGENT_ARGS);
    let docs = [sleeper("web-1"), sleeper("web-2"), sleeper("db")].join("---\n");
    let file = write(&agent, "app.yaml", &docs);
    ok(&agent, &["apply", "-f", &file]);
    let before = wait_for("every jail seen running", &agent, || {
        let jails = by_name(&agent);
        jails
            .values()
            .all(|j| j.state == Phase::Running)
            .then_some(jails)
    });
    let pids = agent.jail_pids();
    assert_eq!(pids.len(), 3, "{pids:?}");

    agent.kill9();
    let down = keelctl(&agent, &["get", "jails"]);
    assert_eq!(down.code, 1, "{down:?}");
    assert!(down.stderr.contains("is keel-agentd running?"), "{down:?}");
    for (name, pid) in &pids {
        assert!(process_alive(*pid), "{name} outlives its agent");
    }

    agent.restart();
    // Two timer passes of the new agent have looked at every jail.
    wait_for("two reconcile passes", &agent, || {
        (agent.reconcile_passes() >= 2).then_some(())
    });
    let after = by_name(&agent);
    assert_eq!(
        after, before,
        "same jails, addresses, states and restart counts"
    );
    assert_eq!(agent.jail_pids(), pids, "no workload was started again");
    for (name, pid) in &pids {
        assert!(process_alive(*pid), "{name} still runs as {pid}");
    }

    // The restarted agent keeps working.
    let more = write(&agent, "more.yaml", &sleeper("cache"));
    assert_eq!(
        ok(&agent, &["apply", "-f", &more]),
        "jail/cache applied (Starting, 127.64.0.5)\n"
    );
}

#[test]
fn the_socket_flag_overrides_the_environment() {
    let agent = Agent::start(AGENT_ARGS);
    let socket = agent.socket();
    let socket = socket.to_str().expect("utf-8 path");
    let run = Command::new(KEELCTL)
        .args(["--socket", socket, "get", "jails", "-o", "json"])
        .env("KEEL_SOCKET", "/nonexistent/agentd.sock")
        .output()
        .expect("keelctl runs");
    assert!(run.status.success(), "{run:?}");
    assert_eq!(String::from_utf8_lossy(&run.stdout).trim(), "[]");
}

/// The README's quick start: its commands in order, as written, against a
/// fresh agent. `export` and `$PWD` are the only shell it uses; `curl` is
/// replaced by a plain HTTP GET.
#[test]
fn the_readme_quick_start_works_word_for_word() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!(
            "skipped: examples/sim-web.yaml serves HTTP with python3, which is not installed"
        );
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("Quick start"))
        .expect("README has a Quick start section");
    let commands: Vec<&str> = section
        .split("```sh\n")
        .skip(1)
        .filter_map(|block| block.split("```").next())
        .flat_map(str::lines)
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();

    let (first, rest) = commands.split_first().expect("commands");
    let agent_args: Vec<&str> = first
        .strip_prefix("cargo run --release --bin keel-agentd -- ")
        .unwrap_or_else(|| panic!("the first command starts the agent: {first}"))
        .split_whitespace()
        .collect();
    let agent = Agent::start(&agent_args);
    // "From a checkout": the example files, at the same relative paths.
    let examples = agent.dir().join("examples");
    std::fs::create_dir(&examples).expect("mkdir examples");
    for entry in std::fs::read_dir(root.join("examples")).expect("examples/") {
        let entry = entry.expect("dir entry");
        std::fs::copy(entry.path(), examples.join(entry.file_name())).expect("copy example");
    }

    let (mut keelctl_runs, mut fetched, mut exported) = (Vec::new(), false, false);
    for line in rest {
        assert!(
            !line.contains(['"', '\'', '|', ';', '&']),
            "this test runs simple commands only; teach it: {line}"
        );
        if let Some(assignment) = line.strip_prefix("export KEEL_SOCKET=") {
            let dir = agent.dir().to_str().expect("utf-8 temp dir");
            assert_eq!(
                Path::new(&assignment.replace("$PWD", dir)),
                agent.socket(),
                "the README's KEEL_SOCKET is where the agent listens"
            );
            exported = true;
        } else if let Some(args) = line.strip_prefix("cargo run --release --bin keelctl -- ") {
            let args: Vec<&str> = args.split_whitespace().collect();
            let run = keelctl_in(&agent, agent.dir(), &args, None);
            assert_eq!(run.code, 0, "{line}: {run:?}\nagent log:\n{}", agent.log());
            keelctl_runs.push((args.join(" "), run.stdout));
        } else if let Some(url) = line.strip_prefix("curl ") {
            let body = http_get(&agent, url);
            assert!(!body.is_empty(), "{url} answered");
            fetched = true;
        } else {
            panic!("a quick start command this test does not know: {line}");
        }
    }
    assert!(
        exported && fetched,
        "the quick start sets KEEL_SOCKET and fetches a page"
    );
    let outputs: BTreeMap<String, String> = keelctl_runs.into_iter().collect();
    assert_eq!(
        outputs
            .get("apply -f examples/sim-web.yaml")
            .map(String::as_str),
        Some("jail/sim-web applied (Starting, 127.64.0.2)\n")
    );
    let table = outputs
        .get("get jails")
        .expect("the quick start lists the jails");
    assert!(
        table.lines().nth(1).is_some_and(
            |r| r.starts_with("sim-web") && (r.contains("Running") || r.contains("Starting"))
        ),
        "{table}"
    );
    assert_eq!(
        outputs.get("delete jail sim-web").map(String::as_str),
        Some("jail/sim-web deleted\n")
    );
    assert!(
        agent.jail_pids().is_empty(),
        "the quick start cleans up after itself"
    );
}

/// `GET url` (`http://IP:PORT/...`), retried until the workload listens;
/// returns the body of a 200.
fn http_get(agent: &Agent, url: &str) -> String {
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (authority, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(a, p)| (a, format!("/{p}")));
    let (ip, port) = authority.split_once(':').expect("IP:PORT");
    let addr = (
        ip.parse::<Ipv4Addr>().expect("an IPv4 address"),
        port.parse::<u16>().expect("a port"),
    );
    wait_for(url, agent, || {
        let mut stream = TcpStream::connect(addr).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: {authority}\r\n\r\n").ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let (head, body) = response.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.0 200").then(|| body.to_string())
    })
}

/// SIGHUP is a reload request (keys, when clustered), never a way to stop
/// the agent: rc.d and newsyslog-style tooling send it freely.
#[test]
fn sighup_does_not_stop_the_agent() {
    let agent = Agent::start(&["--simulate"]);
    let pid = agent.pid().expect("running");
    let status = std::process::Command::new("/bin/kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .expect("kill -HUP");
    assert!(status.success());
    // The signal is handled on the agent's signal thread; a request after it
    // must still be answered, and the process must still be this one.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !agent.log().contains("SIGHUP") {
        assert!(
            std::time::Instant::now() < deadline,
            "SIGHUP not handled:\n{}",
            agent.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(agent.request("GET", "/healthz").status, 200);
    assert_eq!(agent.pid(), Some(pid));
}

/// The ingress controller on a real simulated agent: the first Ingress brings
/// the `keel-ingress` jail running the host's nginx (its configuration
/// written, checked and loaded by the agent), the Ingress waits for a
/// certificate and says why (no OVH credentials here), and deleting the last
/// Ingress removes the jail. nginx listens on the jail's own loopback
/// address, ports 80 and 443, so this needs root and nginx.
#[test]
fn an_ingress_brings_the_nginx_jail_and_its_deletion_takes_it_away() {
    let nginx = Path::new("/usr/sbin/nginx");
    let root = keel::common::auth::KeyFilePolicy::for_current_process().require_root_owner;
    if !nginx.is_file() || !root {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run this test as root with nginx-light installed"
        );
        eprintln!("skipped: needs root and /usr/sbin/nginx (nginx-light)");
        return;
    }
    let agent = Agent::start(AGENT_ARGS);
    let file = write(
        &agent,
        "site.yaml",
        "kind: Ingress\nmetadata: {name: site}\nspec: {host: www.example.org, service: web}\n",
    );
    let out = ok(&agent, &["apply", "-f", &file]);
    assert!(out.starts_with("ingress/site applied ("), "{out}");

    let ingress = wait_for("the ingress jail running nginx", &agent, || {
        by_name(&agent)
            .remove("keel-ingress")
            .filter(|j| j.state == keel::agentd::reconciler::Phase::Running)
    });
    // nginx found its first configuration in the fresh root: it started
    // once, without crashing for want of one.
    assert_eq!(ingress.restarts, 0, "{ingress:?}\n{}", agent.log());
    let statuses: Vec<keel::common::wire::IngressStatus> =
        serde_json::from_str(&ok(&agent, &["get", "ingresses", "-o", "json"])).expect("json");
    assert_eq!(statuses.len(), 1, "{statuses:?}");
    let status = &statuses[0];
    // Single node: no Service VIP, so the host waits for its backend.
    assert_eq!(
        status.phase,
        keel::common::wire::IngressPhase::NoService,
        "{status:?}"
    );
    // nginx runs with the configuration the agent wrote: it listens on the
    // jail's address (the default servers, which refuse unknown names).
    wait_for(
        "nginx listening on the ingress jail's address",
        &agent,
        || {
            std::net::TcpStream::connect((ingress.address, 443))
                .ok()
                .map(|_| ())
        },
    );
    let conf = std::fs::read_to_string(
        agent
            .dir()
            .join("keel-sim/jails/keel-ingress/usr/local/etc/keel-ingress/nginx.conf"),
    );
    assert!(
        conf.as_deref().is_ok_and(|c| c.contains(&format!(
            "listen {}:443 ssl default_server;",
            ingress.address
        ))),
        "{conf:?}"
    );

    ok(&agent, &["delete", "ingress", "site"]);
    wait_for("the ingress jail removed", &agent, || {
        (!by_name(&agent).contains_key("keel-ingress")).then_some(())
    });
}

/// Bad Ingress requests to the agent: each gets a 4xx naming the field, and
/// nothing is recorded.
#[test]
fn bad_ingress_requests_are_refused_and_change_nothing() {
    let agent = Agent::start(AGENT_ARGS);
    let client =
        keel::common::http::Client::new(keel::common::http::Endpoint::Unix(agent.socket()));
    let put = |path: &str, body: &str| {
        client
            .request("PUT", path, &[], body.as_bytes())
            .expect("agent answers")
    };
    let doc = |name: &str, host: &str| {
        format!(
            "kind: Ingress\nmetadata: {{name: {name}}}\nspec: {{host: '{host}', service: web}}\n"
        )
    };
    for (path, body, status, fragment) in [
        (
            "/ingresses/site",
            doc("other", "a.example.org"),
            400,
            "metadata.name",
        ),
        (
            "/ingresses/site",
            doc("site", "a.example.org; include /etc/passwd"),
            400,
            "spec.host",
        ),
        (
            "/ingresses/site",
            doc("site", "*.example.org"),
            400,
            "wildcards",
        ),
        (
            "/ingresses/site",
            "kind: Jail\nmetadata: {name: site}\nspec: {base: b, exec: {start: [x]}}\n".to_string(),
            400,
            "Ingress",
        ),
        (
            "/ingresses/Bad_Name",
            doc("site", "a.example.org"),
            400,
            "ingress name",
        ),
    ] {
        let r = put(path, &body);
        let text = String::from_utf8_lossy(&r.body);
        assert_eq!(r.status, status, "{path} {body:?}: {text}");
        assert!(text.contains(fragment), "{path} {body:?}: {text}");
    }
    assert_eq!(ok(&agent, &["get", "ingresses", "-o", "json"]).trim(), "[]");

    // Two Ingresses for one host: the second is refused, the first stays.
    assert_eq!(
        put("/ingresses/site", &doc("site", "a.example.org")).status,
        200
    );
    let r = put("/ingresses/copy", &doc("copy", "a.example.org"));
    assert_eq!(r.status, 409, "{}", String::from_utf8_lossy(&r.body));
    assert!(String::from_utf8_lossy(&r.body).contains("already served by Ingress site"));
    let statuses: Vec<keel::common::wire::IngressStatus> =
        serde_json::from_str(&ok(&agent, &["get", "ingresses", "-o", "json"])).expect("json");
    assert_eq!(statuses.len(), 1, "{statuses:?}");
    ok(&agent, &["delete", "ingress", "site"]);
}

/// A jail's own root user may replace a directory on a volume's mount path
/// with a symbolic link pointing anywhere on the host, then wait for the
/// volume to be mounted again (after a host reboot, or a crash of the
/// workload as here). The agent refuses that mount, says why in the jail's
/// status, and creates nothing where the link points.
#[test]
fn a_volume_mount_redirected_by_a_link_inside_the_jail_is_refused() {
    let agent = Agent::start(AGENT_ARGS);
    let file = write(
        &agent,
        "db.yaml",
        "kind: Jail\nmetadata: {name: db}\nspec:\n  base: 14.2-RELEASE\n  \
         exec: {start: [/bin/sleep, '300']}\n  \
         volumes:\n    - {name: dbdata, mountPath: /srv/data, size: 1M}\n",
    );
    ok(&agent, &["apply", "-f", &file]);
    let pid = wait_for("db running", &agent, || {
        agent
            .jail_pids()
            .get("db")
            .copied()
            .filter(|_| by_name(&agent)["db"].state == Phase::Running)
    });

    // What the jail's root could do from inside: its /srv becomes a link
    // to a host directory (the simulated mount is itself a link, removed
    // first, as a reboot would unmount it).
    let root = agent.dir().join("keel-sim/jails/db");
    let host_dir = agent.dir().join("host-side");
    std::fs::create_dir(&host_dir).expect("host dir");
    std::fs::remove_file(root.join("srv/data")).expect("the simulated mount");
    std::fs::remove_dir(root.join("srv")).expect("srv");
    std::os::unix::fs::symlink(&host_dir, root.join("srv")).expect("plant the link");
    let killed = Command::new("/bin/kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());

    let error = wait_for("the refused mount in the jail's status", &agent, || {
        by_name(&agent)["db"]
            .last_error
            .clone()
            .filter(|e| e.contains("refusing to mount"))
    });
    assert!(error.contains("is a symbolic link"), "{error}");
    assert!(
        error.contains(&root.join("srv").display().to_string()),
        "{error}"
    );
    assert_ne!(by_name(&agent)["db"].state, Phase::Running);
    assert_eq!(
        std::fs::read_dir(&host_dir).expect("host dir").count(),
        0,
        "nothing may be created through the link"
    );
}

/// A child process killed when dropped, so a failing assertion does not
/// leave it running.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `keelctl logs -f`: the route answers the tail and returns, so keelctl
/// asks again and prints only what is new: every line once, in order, while
/// the workload keeps writing.
#[test]
fn logs_follow_prints_each_new_line_once_while_the_workload_writes() {
    let agent = Agent::start(AGENT_ARGS);
    let file = write(
        &agent,
        "ticker.yaml",
        &jail(
            "ticker",
            "/bin/sh, -c, 'i=0; while [ $i -lt 40 ]; do echo tick-$i; i=$((i+1)); sleep 0.1; done; exec sleep 300'",
        ),
    );
    ok(&agent, &["apply", "-f", &file]);
    let child = Command::new(KEELCTL)
        .args(["logs", "ticker", "-f"])
        .current_dir(agent.dir())
        .env("KEEL_SOCKET", agent.socket())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn keelctl logs -f");
    let mut child = Killed(child);
    let mut stdout = child.0.stdout.take().expect("piped");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let reader = {
        let seen = seen.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                seen.lock().expect("lock").push_str(&text);
            }
        })
    };
    let text = |seen: &std::sync::Mutex<String>| seen.lock().expect("lock").clone();
    crate::util::poll_until("the workload's 40th line through logs -f", || {
        text(&seen).contains("tick-39\n")
    });
    assert!(
        child.0.try_wait().expect("try_wait").is_none(),
        "logs -f keeps running"
    );
    // The simulator's own `keel-sim: starting ...` line comes first.
    let printed = text(&seen);
    let ticks: Vec<&str> = printed.lines().filter(|l| l.starts_with("tick-")).collect();
    let expected: Vec<String> = (0..40).map(|i| format!("tick-{i}")).collect();
    assert_eq!(ticks, expected, "each line once, in order: {printed}");
    assert_eq!(printed.lines().count(), 41, "{printed}");
    drop(child);
    reader.join().expect("reader");
}

/// `keelctl logs`: the last lines the workload printed, `--tail` of them;
/// an unknown jail is 404 and a bad `--tail` a usage error.
#[test]
fn logs_show_the_end_of_what_the_workload_printed() {
    let agent = Agent::start(AGENT_ARGS);
    let file = write(
        &agent,
        "talker.yaml",
        &jail(
            "talker",
            "/bin/sh, -c, 'echo one; echo two; echo three; exec sleep 300'",
        ),
    );
    ok(&agent, &["apply", "-f", &file]);
    let all = wait_for("the workload's output", &agent, || {
        let out = ok(&agent, &["logs", "talker"]);
        out.contains("three").then_some(out)
    });
    assert!(all.contains("one\ntwo\nthree\n"), "{all}");
    assert_eq!(
        ok(&agent, &["logs", "talker", "--tail", "2"]),
        "two\nthree\n"
    );

    let unknown = keelctl(&agent, &["logs", "nobody"]);
    assert_eq!(unknown.code, 1, "{unknown:?}");
    assert!(unknown.stderr.contains("nobody"), "{unknown:?}");
    let bad = keelctl(&agent, &["logs", "talker", "--tail", "0"]);
    assert_eq!(bad.code, 2, "{bad:?}");
    assert!(bad.stderr.contains("--tail"), "{bad:?}");
    // The agent checks the query itself (other clients than keelctl).
    for query in ["tail=x", "tail=0", "tail=10001", "tail=1&tail=2"] {
        let r = agent.request("GET", &format!("/jails/talker/log?{query}"));
        assert_eq!(
            r.status,
            400,
            "{query}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert!(String::from_utf8_lossy(&r.body).contains("tail"), "{query}");
    }
}

/// kubectl's habit: `delete jail a nope b` deletes a and b, reports nope,
/// and exits 1 naming it.
#[test]
fn deleting_several_jails_goes_past_a_missing_one_and_exits_1() {
    let agent = Agent::start(AGENT_ARGS);
    let file = write(
        &agent,
        "two.yaml",
        &format!("{}---\n{}", sleeper("a"), sleeper("b")),
    );
    ok(&agent, &["apply", "-f", &file]);
    let run = keelctl(&agent, &["delete", "jail", "a", "nope", "b"]);
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(run.stdout, "jail/a deleted\njail/b deleted\n", "{run:?}");
    let lines: Vec<&str> = run.stderr.lines().collect();
    assert!(
        lines[0].starts_with("keelctl: delete jail/nope failed: no jail named nope"),
        "{run:?}"
    );
    assert_eq!(
        lines.last().copied(),
        Some("keelctl: delete jail: 1 of 3 failed (nope); the others were done"),
        "{run:?}"
    );
    assert!(list(&agent).is_empty(), "both deleted");
}

/// `apply -f DIR` takes every `.yaml` and `.yml` file of the directory in
/// file-name order, validating all of them before sending anything.
#[test]
fn apply_takes_a_directory_of_specs_in_file_name_order() {
    let agent = Agent::start(AGENT_ARGS);
    let dir = agent.dir().join("specs");
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::write(dir.join("20-b.yml"), sleeper("b")).expect("write");
    std::fs::write(dir.join("10-a.yaml"), sleeper("a")).expect("write");
    std::fs::write(dir.join("notes.txt"), "not a spec").expect("write");
    std::fs::create_dir(dir.join("sub.yaml")).expect("a directory named like a spec");
    let dir_arg = dir.display().to_string();
    let out = ok(&agent, &["apply", "-f", &dir_arg]);
    let applied: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(applied, ["jail/a", "jail/b"], "{out}");

    // One bad file: nothing of the directory is sent, and the file is named.
    std::fs::write(dir.join("30-bad.yaml"), "kind: Jail\nmetadata: {name: c}\n").expect("write");
    let run = keelctl(&agent, &["apply", "-f", &dir_arg]);
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("30-bad.yaml is invalid"), "{run:?}");
    assert_eq!(list(&agent).len(), 2, "c was not applied");

    let empty = agent.dir().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    let run = keelctl(&agent, &["apply", "-f", &empty.display().to_string()]);
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("holds no document"), "{run:?}");
}

/// A typo in `base` is refused as a base the node does not have, naming
/// `spec.base`, and nothing is kept (the simulated host knows release
/// names, as a FreeBSD host knows the bases it fetched).
#[test]
fn a_base_that_names_no_release_is_refused_naming_spec_base() {
    let agent = Agent::start(AGENT_ARGS);
    let doc = "kind: Jail\nmetadata: {name: typo}\nspec:\n  base: 99.9-NOPE\n  \
               exec: {start: [/bin/sleep, '300']}\n";
    let file = write(&agent, "typo.yaml", doc);
    let run = keelctl(&agent, &["apply", "-f", &file]);
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains("spec.base"), "{run:?}");
    assert!(run.stderr.contains("99.9-NOPE"), "{run:?}");
    assert!(run.stderr.contains("keelctl base fetch"), "{run:?}");
    assert_eq!(list(&agent), Vec::new(), "nothing kept");
}
