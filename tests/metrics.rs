//! The metrics listeners on a real simulated cluster: one keel-controlplane
//! and one keel-agentd, each with `--metrics-listen` on a free port, and a
//! one-replica service whose replica runs `tests/fixtures/echo_name.py`.
//! Each daemon is scraped over plain HTTP (no signature): the series the
//! operations guide documents are there, labelled by jail, service, node and
//! route pattern, with one `Content-Type`; one connection through the proxy
//! shows up in its counters; only `GET /metrics` is served; and the body
//! passes `promtool check metrics` (Debian's `prometheus` package, which
//! .ci/run installs; without it the check is skipped, except under CI).
//! The agent's usage sampler reports the replica's CPU time and resident
//! memory (in simulate mode, its process group's, from Linux /proc).
//! And the listener's admission: one host holding as many idle connections
//! as it can open locks out no other scraper.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use keel::common::http::{Client, ClientResponse, Endpoint, ShutdownSignal};
use keel::common::metrics::{self, CONTENT_TYPE, MAX_CONNECTIONS, Render, Unavailable};
use socket2::{Domain, Socket, Type};

use crate::util::cluster::{Cluster, free_port, node_ip, standard_controlplane_args};
use crate::util::fixture_service;

/// Bound on one scrape or one connection through the proxy.
const TIMEOUT: Duration = Duration::from_secs(5);

fn scrape_with(addr: SocketAddr, method: &str, path: &str) -> Option<ClientResponse> {
    Client::new(Endpoint::Tcp(addr.to_string()))
        .with_timeout(TIMEOUT)
        .request(method, path, &[], b"")
        .ok()
}

/// `GET /metrics` on `addr`, unsigned; the body when it answered 200.
fn scrape(addr: SocketAddr) -> Option<String> {
    let r = scrape_with(addr, "GET", "/metrics")?;
    (r.status == 200).then(|| String::from_utf8(r.body).expect("utf-8 exposition"))
}

/// The value of the sample line `series` (name and labels, exactly).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// `promtool` on PATH; missing is a failure under CI, else a notice.
fn promtool() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("promtool"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "promtool is not installed but CI is set: install the Debian package prometheus (.ci/run does)"
        );
        eprintln!("NOTICE: promtool not installed (Debian package prometheus); check skipped");
    }
    found
}

/// Pipes `text` into `promtool check metrics`, failing on any complaint.
fn promtool_check(what: &str, text: &str) {
    let Some(promtool) = promtool() else {
        return;
    };
    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("feed promtool");
    let out = child.wait_with_output().expect("promtool ends");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics on the {what}'s exposition: {said}\n{text}"
    );
}

/// One connection through the proxy at `addr`: what the replica answered.
fn through_proxy(addr: SocketAddr) -> Option<String> {
    let mut conn = TcpStream::connect_timeout(&addr, TIMEOUT).ok()?;
    conn.set_read_timeout(Some(TIMEOUT)).ok()?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer).ok()?;
    answer.starts_with("echo-").then_some(answer)
}

fn content_types(r: &ClientResponse) -> Vec<&str> {
    r.headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.as_str())
        .collect()
}

#[test]
fn both_daemons_serve_documented_checked_metrics_on_a_plain_listener() {
    let Some(python) = crate::util::python3() else {
        panic!("python3 on PATH (the replica's workload; .ci/run installs it)");
    };
    let mut cluster = Cluster::new();
    let cp_listen = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)));
    let cp_metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)));
    let mut args = standard_controlplane_args(cp_listen);
    args.extend(["--metrics-listen".into(), cp_metrics.to_string()]);
    cluster.start_controlplane(&args.iter().map(String::as_str).collect::<Vec<_>>());

    let ip = node_ip(1);
    let agent_metrics = SocketAddr::from((ip, free_port(ip)));
    let mut args = cluster.standard_agent_args("n1", SocketAddr::from((ip, free_port(ip))), ip);
    args.extend([
        "--metrics-listen".into(),
        agent_metrics.to_string(),
        "--usage-interval".into(),
        "200ms".into(),
    ]);
    cluster.start_agent("n1", &args.iter().map(String::as_str).collect::<Vec<_>>());

    let port = free_port(ip);
    let doc = fixture_service("echo", "echo_name.py", 1, port, &python);
    let run = cluster.keelctl_with(&["apply", "-f", "-"], Some(&doc));
    assert_eq!(run.code, 0, "{run:?}\n{}", cluster.logs());

    // The control plane: the node alive, the service ready, requests counted
    // by route pattern (the agent's heartbeats, keelctl's apply).
    let cp_text = cluster.wait_for(
        "the control plane's metrics to show the ready service",
        || {
            let text = scrape(cp_metrics)?;
            let ready = value(&text, "keel_service_ready_replicas{service=\"echo\"}")?;
            (ready == 1.0).then_some(text)
        },
    );
    for (series, want) in [
        ("keel_node_alive{node=\"n1\"}", 1.0),
        ("keel_service_desired_replicas{service=\"echo\"}", 1.0),
        ("keel_nodes{status=\"alive\"}", 1.0),
        ("keel_service_updated_replicas{service=\"echo\"}", 1.0),
    ] {
        assert_eq!(value(&cp_text, series), Some(want), "{series}:\n{cp_text}");
    }
    assert!(
        value(&cp_text, "keel_service_revision{service=\"echo\"}").is_some_and(|r| r >= 1.0),
        "{cp_text}"
    );
    assert!(
        value(&cp_text, "keel_node_committed_cpu_cores{node=\"n1\"}").is_some_and(|c| c > 0.0),
        "{cp_text}"
    );
    let heartbeats = value(
        &cp_text,
        "keel_controlplane_requests_total{route=\"/nodes/{id}/heartbeat\",code=\"2xx\"}",
    );
    assert!(heartbeats.is_some_and(|n| n >= 1.0), "{cp_text}");
    assert!(
        cp_text.contains(
            "keel_controlplane_request_duration_seconds_bucket{route=\"/services/{name}\",le=\"+Inf\"}"
        ),
        "keelctl's apply is counted under its route pattern:\n{cp_text}"
    );
    assert!(
        !cp_text.contains("route=\"/nodes/n1"),
        "no raw path: {cp_text}"
    );

    // The agent: the replica's jail running and ready; one connection through
    // the proxy counted with the bytes the replica sent back.
    let proxy = SocketAddr::from((ip, port));
    let answer = cluster.wait_for("the proxy to reach the replica", || through_proxy(proxy));
    let agent_text = cluster.wait_for("the agent's metrics to count the connection", || {
        let text = scrape(agent_metrics)?;
        let relayed = value(
            &text,
            "keel_proxy_bytes_total{service=\"echo\",direction=\"to_client\"}",
        )?;
        let jail_ready = value(&text, "keel_jail_ready{jail=\"echo-0\"}")?;
        // Ready from its start; Running once seen up past its first second.
        let running = value(&text, "keel_jail_state{jail=\"echo-0\",state=\"Running\"}")?;
        // The usage sampler has seen the running replica: python3 holds
        // resident memory (the simulated host reads it from /proc).
        let memory = value(&text, "keel_jail_memory_bytes{jail=\"echo-0\"}")?;
        (relayed >= answer.len() as f64 && jail_ready == 1.0 && running == 1.0 && memory > 0.0)
            .then_some(text)
    });
    assert!(
        value(&agent_text, "keel_jail_cpu_seconds_total{jail=\"echo-0\"}")
            .is_some_and(|s| s >= 0.0),
        "{agent_text}"
    );
    for (series, want) in [
        ("keel_jail_state{jail=\"echo-0\",state=\"Running\"}", 1.0),
        ("keel_jail_state{jail=\"echo-0\",state=\"CrashLoop\"}", 0.0),
        ("keel_jail_workload_restarts_total{jail=\"echo-0\"}", 0.0),
        ("keel_jail_cpu_request_cores{jail=\"echo-0\"}", 0.1),
        ("keel_jails_desired", 1.0),
    ] {
        assert_eq!(
            value(&agent_text, series),
            Some(want),
            "{series}:\n{agent_text}"
        );
    }
    assert!(
        value(
            &agent_text,
            "keel_proxy_connections_total{service=\"echo\"}"
        )
        .is_some_and(|n| n >= 1.0),
        "{agent_text}"
    );
    assert!(
        value(&agent_text, "keel_reconcile_duration_seconds_count").is_some_and(|n| n >= 1.0),
        "{agent_text}"
    );
    assert!(
        !agent_text.contains("keel_jail_memory_request_bytes{"),
        "the replica requests no memory, so it has no such series:\n{agent_text}"
    );

    // One Content-Type on every /metrics answer, the signed routes included.
    for addr in [cp_metrics, agent_metrics] {
        let r = scrape_with(addr, "GET", "/metrics").expect("scrape");
        assert_eq!(content_types(&r), [CONTENT_TYPE], "{addr}: {:?}", r.headers);
        let post = scrape_with(addr, "POST", "/metrics").expect("answered");
        assert_eq!(
            (post.status, post.header("Allow")),
            (405, Some("GET")),
            "{addr}"
        );
        for path in ["/jails", "/healthz", "/nodes"] {
            let other = scrape_with(addr, "GET", path).expect("answered");
            assert_eq!(other.status, 404, "{addr}{path} is not served");
        }
    }
    let local = Client::new(Endpoint::Unix(cluster.socket("n1")))
        .request("GET", "/metrics", &[], b"")
        .expect("the agent's socket answers");
    assert_eq!(local.status, 200);
    assert_eq!(content_types(&local), [CONTENT_TYPE], "{:?}", local.headers);

    promtool_check("control plane", &cp_text);
    promtool_check("agent", &agent_text);
}

struct Up;

impl Render for Up {
    fn render(&self) -> Result<String, Unavailable> {
        Ok("# HELP keel_up Up.\n# TYPE keel_up gauge\nkeel_up 1\n".into())
    }
}

/// A connection to `to` from the loopback address `from` (Linux answers on
/// all of 127.0.0.0/8).
fn connect_from(from: Ipv4Addr, to: SocketAddr) -> TcpStream {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
    socket
        .bind(&SocketAddr::from((from, 0)).into())
        .expect("bind the source address");
    socket
        .connect_timeout(&to.into(), TIMEOUT)
        .expect("connect");
    socket.into()
}

/// `GET /metrics` over a fresh connection from `from`: the status.
fn get_from(from: Ipv4Addr, to: SocketAddr) -> Option<u16> {
    let mut conn = connect_from(from, to);
    conn.set_read_timeout(Some(TIMEOUT)).ok()?;
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer).ok()?;
    answer.get(9..12)?.parse().ok()
}

#[cfg(target_os = "linux")]
#[test]
fn one_host_holding_every_connection_it_can_locks_out_no_other_scraper() {
    let listener =
        metrics::bind("agent.metrics_listen", "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let shutdown = ShutdownSignal::new();
    let server = metrics::serve(listener, Up, shutdown.clone()).expect("serve");

    // The greedy host opens twice the whole budget and sends nothing.
    let greedy = Ipv4Addr::new(127, 0, 0, 2);
    let held: Vec<TcpStream> = (0..2 * MAX_CONNECTIONS)
        .map(|_| connect_from(greedy, addr))
        .collect();
    // Every other host still gets its answer, and the greedy one too: its
    // newest connection takes the slot of its own oldest.
    for n in 3..3 + MAX_CONNECTIONS as u8 {
        assert_eq!(
            get_from(Ipv4Addr::new(127, 0, 0, n), addr),
            Some(200),
            "127.0.0.{n}"
        );
    }
    assert_eq!(get_from(greedy, addr), Some(200));
    drop(held);
    shutdown.trigger();
    server.join().expect("the accept loop ends");
}
