//! Connection floods against a simulated cluster (process tests): 600 idle
//! and 600 slowloris connections (one byte of a request head a second) held
//! open against the control plane, and as many against one agent's TCP
//! listener, for several times the cluster's `dead_after`, re-opening every
//! connection the servers close. Throughout, keelctl answers through the
//! control plane, every node stays Alive with a recent heartbeat, and the
//! flooded agent's Unix socket answers `GET /jails`.
//!
//! The flood comes from ten loopback source addresses (127.0.0.50 to .59),
//! so the per-address share alone cannot explain the result, and then from a
//! single address. A stream of unsigned requests leaves a line or two in the
//! log, not one per request.

use std::io::{self, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use keel::common::http::{Client, Endpoint, read_response};
use keel::common::wire::{Liveness, NodeStatus};
use socket2::{Domain, Socket, Type};

use crate::util::cluster::{Cluster, node_ip};
use crate::util::{poll_until, raise_nofile};

/// Idle connections per flooded server: connected, then silent.
const IDLE: usize = 600;
/// Slowloris connections per flooded server: a byte of a head every second.
const SLOWLORIS: usize = 600;
/// `--dead-after` of [`Cluster::standard`].
const DEAD_AFTER: Duration = Duration::from_secs(2);
/// How long each flood is held: five times `dead_after`, and past the
/// servers' head deadline, so closed connections are re-opened several times.
const HOLD: Duration = Duration::from_secs(10);
/// One pass over every flood connection: reopen, write a byte, notice closes.
const TICK: Duration = Duration::from_secs(1);
/// A flood connect that takes longer is retried on the next tick.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(200);
/// The head a slowloris connection dribbles; it never completes in time.
const SLOW_HEAD: &[u8] = b"GET /jails HTTP/1.1\r\nHost: flood\r\nX-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";

/// What one flood connection does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Idle,
    Slowloris,
}

struct FloodConn {
    kind: Kind,
    source: Ipv4Addr,
    stream: Option<TcpStream>,
    sent: usize,
}

/// What a flood saw, for the assertions.
#[derive(Debug, Default, Clone, Copy)]
struct FloodStats {
    /// Connections the server closed (evicted, past the head deadline, or
    /// refused), each re-opened on the next pass.
    closed_by_server: usize,
    /// Connections open when the flood stopped.
    open_at_end: usize,
}

/// A flood of idle and slowloris connections against one server, on a thread
/// of its own; stopped (and every connection closed) on drop.
struct Flood {
    stop: Arc<AtomicBool>,
    /// Set once every connection was opened once.
    opened: Arc<AtomicBool>,
    thread: Option<JoinHandle<FloodStats>>,
}

impl Flood {
    fn start(target: SocketAddr, sources: &[Ipv4Addr]) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Vec<FloodConn> = (0..IDLE + SLOWLORIS)
            .map(|i| FloodConn {
                kind: if i < IDLE {
                    Kind::Idle
                } else {
                    Kind::Slowloris
                },
                source: sources[i % sources.len()],
                stream: None,
                sent: 0,
            })
            .collect();
        let opened = Arc::new(AtomicBool::new(false));
        let (flag, first_pass) = (Arc::clone(&stop), Arc::clone(&opened));
        let thread = thread::Builder::new()
            .name(format!("flood {target}"))
            .spawn(move || run_flood(target, conns, &flag, &first_pass))
            .expect("spawn the flood thread");
        Flood {
            stop,
            opened,
            thread: Some(thread),
        }
    }

    fn is_at_full_strength(&self) -> bool {
        self.opened.load(Ordering::SeqCst)
    }

    fn finish(mut self) -> FloodStats {
        self.stop.store(true, Ordering::SeqCst);
        let thread = self.thread.take().expect("a running flood");
        thread.join().expect("the flood thread panicked")
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A non-blocking connection to `target` from `source`, or `None` when the
/// server did not accept it in time (retried on the next pass).
fn open(source: Ipv4Addr, target: SocketAddr) -> Option<TcpStream> {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).ok()?;
    socket
        .bind(&SocketAddr::new(IpAddr::V4(source), 0).into())
        .ok()?;
    socket
        .connect_timeout(&target.into(), CONNECT_TIMEOUT)
        .ok()?;
    let stream: TcpStream = socket.into();
    stream.set_nonblocking(true).ok()?;
    Some(stream)
}

/// True while the server keeps `stream` open: nothing to read yet. Whatever
/// the server sent (a 408 or 503) means it is closing the connection.
fn still_open(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 512];
    match stream.read(&mut buf) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => true,
        Err(e) if e.kind() == io::ErrorKind::Interrupted => true,
        Ok(_) | Err(_) => false,
    }
}

fn run_flood(
    target: SocketAddr,
    mut conns: Vec<FloodConn>,
    stop: &AtomicBool,
    opened: &AtomicBool,
) -> FloodStats {
    let mut stats = FloodStats::default();
    while !stop.load(Ordering::SeqCst) {
        let pass_started = Instant::now();
        for conn in &mut conns {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            if let Some(stream) = &mut conn.stream {
                let mut open = still_open(stream);
                if open && conn.kind == Kind::Slowloris {
                    let byte = &SLOW_HEAD[conn.sent % SLOW_HEAD.len()..][..1];
                    open = match stream.write(byte) {
                        Ok(_) => {
                            conn.sent += 1;
                            true
                        }
                        Err(e) => e.kind() == io::ErrorKind::WouldBlock,
                    };
                }
                if !open {
                    stats.closed_by_server += 1;
                    conn.stream = None;
                }
            }
            if conn.stream.is_none() {
                conn.stream = open(conn.source, target);
                conn.sent = 0;
            }
        }
        opened.store(true, Ordering::SeqCst);
        // Paced on purpose (one pass a second), not a timing assumption: the
        // flood must hold its connections, not spin on reconnects.
        let rest = TICK.saturating_sub(pass_started.elapsed());
        let until = Instant::now() + rest;
        while !stop.load(Ordering::SeqCst) && Instant::now() < until {
            thread::sleep(Duration::from_millis(50));
        }
    }
    stats.open_at_end = conns.iter().filter(|c| c.stream.is_some()).count();
    stats
}

/// `keelctl get nodes -o json`, which must answer.
fn nodes(cluster: &Cluster) -> Vec<NodeStatus> {
    let run = cluster.keelctl(&["get", "nodes", "-o", "json"]);
    assert_eq!(
        run.code,
        0,
        "keelctl get nodes under the flood: {run:?}\n{}",
        cluster.logs()
    );
    serde_json::from_str(&run.stdout).expect("get nodes -o json")
}

/// Holds floods against the control plane and node n1's TCP listener from
/// `sources` for [`HOLD`], checking keelctl, liveness and n1's Unix socket
/// all along; returns what the two floods saw.
fn hold_floods(cluster: &Cluster, sources: &[Ipv4Addr]) -> (FloodStats, FloodStats) {
    let agent_tcp = nodes(cluster)
        .into_iter()
        .find(|n| n.node_id == "n1")
        .expect("n1 registered")
        .address;
    let cp_flood = Flood::start(cluster.controlplane_addr(), sources);
    let agent_flood = Flood::start(agent_tcp, sources);
    poll_until("both floods opened every connection once", || {
        cp_flood.is_at_full_strength() && agent_flood.is_at_full_strength()
    });
    let unix = Client::new(Endpoint::Unix(cluster.socket("n1"))).with_timeout(DEAD_AFTER * 5);
    let started = Instant::now();
    let mut checks = 0;
    while started.elapsed() < HOLD {
        for node in nodes(cluster) {
            assert_eq!(
                node.status,
                Liveness::Alive,
                "{} went {} under the flood\n{}",
                node.node_id,
                node.status,
                cluster.logs()
            );
            // Whole seconds: under dead_after means no heartbeat was lost for it.
            let seen = node.last_seen_secs.expect("heard from");
            assert!(
                seen < DEAD_AFTER.as_secs(),
                "{}: last heartbeat {seen} s ago under the flood\n{}",
                node.node_id,
                cluster.logs()
            );
        }
        // Forwarded by the control plane to both agents' TCP listeners, n1's flooded.
        let jails = cluster.keelctl(&["get", "jails"]);
        assert_eq!(
            jails.code, 0,
            "keelctl get jails under the flood: {jails:?}"
        );
        let local = unix
            .request("GET", "/jails", &[], b"")
            .expect("n1's Unix socket answers under the flood");
        assert_eq!(
            local.status,
            200,
            "{}",
            String::from_utf8_lossy(&local.body)
        );
        checks += 1;
    }
    eprintln!("{checks} rounds of checks passed under the floods from {sources:?}");
    assert!(
        checks >= 3,
        "only {checks} rounds of checks ran in {HOLD:?}"
    );
    (cp_flood.finish(), agent_flood.finish())
}

/// Both servers cut the flood (it re-opened connections), yet kept some
/// open: the flood was real and was held.
fn assert_flood_was_held(what: &str, stats: FloodStats) {
    eprintln!("{what}: {stats:?}");
    assert!(
        stats.closed_by_server >= IDLE,
        "{what}: the server closed only {} flood connections: {stats:?}",
        stats.closed_by_server
    );
    assert!(stats.open_at_end > 0, "{what}: {stats:?}");
}

/// Lines a daemon wrote about turning connections away: summaries, never
/// one line per connection.
fn admission_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains("connection") && (l.contains("evicted") || l.contains("closed a")))
        .collect()
}

#[test]
fn floods_of_idle_and_slowloris_connections_change_nothing_for_signed_clients() {
    if !cfg!(target_os = "linux") {
        eprintln!("skipping: needs 127.0.0.50-60 as distinct source addresses (Linux loopback)");
        return;
    }
    // Two floods of 1,200 connections each, plus the cluster's own.
    raise_nofile(8192).expect("RLIMIT_NOFILE");
    let cluster = Cluster::standard(2);
    cluster.wait_for("n1 and n2 Alive", || {
        let nodes = nodes(&cluster);
        (nodes.len() == 2 && nodes.iter().all(|n| n.status == Liveness::Alive)).then_some(())
    });

    let spread: Vec<Ipv4Addr> = (50..60).map(|h| Ipv4Addr::new(127, 0, 0, h)).collect();
    assert!(!spread.contains(&node_ip(1)) && !spread.contains(&node_ip(2)));
    let (cp, agent) = hold_floods(&cluster, &spread);
    assert_flood_was_held("control plane, ten addresses", cp);
    assert_flood_was_held("agent n1, ten addresses", agent);

    let single = [Ipv4Addr::new(127, 0, 0, 60)];
    let (cp, agent) = hold_floods(&cluster, &single);
    assert_flood_was_held("control plane, one address", cp);
    assert_flood_was_held("agent n1, one address", agent);

    // Thousands of connections were turned away in 20 s; the logs hold a
    // few summary lines (at most two per 10 s window), not one per connection.
    let logs = cluster.logs();
    let lines = admission_lines(&logs);
    eprintln!("admission lines in the logs:\n{}", lines.join("\n"));
    assert!(
        lines.len() <= 20,
        "{} admission lines in the logs:\n{logs}",
        lines.len()
    );
}

#[test]
fn a_stream_of_unsigned_requests_is_logged_in_summaries() {
    const UNSIGNED: usize = 300;
    let cluster = Cluster::standard(0);
    let stream = TcpStream::connect(cluster.controlplane_addr()).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    let mut writer = stream.try_clone().expect("clone");
    let mut reader = BufReader::new(stream);
    // One keep-alive connection, one request after the other, as a script
    // with a missing key would send them.
    for _ in 0..UNSIGNED {
        writer
            .write_all(b"GET /nodes HTTP/1.1\r\nHost: cp\r\n\r\n")
            .expect("write");
        let resp = read_response(&mut reader, "the control plane", false).expect("response");
        assert_eq!(resp.status, 401);
    }
    // The first refusal names the request; the other 299 are one count,
    // written by the first refusal after the window (or never, if none).
    let logs = cluster.logs();
    let lines: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("GET /nodes") || l.contains("missing or bad signature"))
        .collect();
    assert!(
        !lines.is_empty() && lines.len() <= 2,
        "{} log lines for {UNSIGNED} unsigned requests:\n{}",
        lines.len(),
        lines.join("\n")
    );
    assert!(lines[0].contains("refused GET /nodes"), "{}", lines[0]);
}
