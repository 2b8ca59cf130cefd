//! The per-node L4 proxy (`agentd::proxy`) over real sockets on 127.x
//! loopback addresses, with echo backends written here.
//!
//! Each test uses its own 127.91.N.0/24 so tests running in parallel never
//! share an address; services listen on port 0 and the test asks the proxy
//! which port it got.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use keel::agentd::proxy::balance::EJECT_INITIAL;
use keel::agentd::proxy::{LISTEN_BACKLOG, Proxy, ProxyConfig, ProxyError, ReplicaLoad};
use keel::common::wire::ServiceEndpoints;

use crate::util::{poll_until, raise_nofile};

/// Guard against a hang: far above anything a passing test waits, far below
/// the OS connect timeout (about two minutes) a missing bound would fall to.
const HANG: Duration = Duration::from_secs(30);

fn ip(net: u8, host: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 91, net, host)
}

/// An echo server that names itself: it greets every connection with
/// `"{id}\n"`, echoes what it reads, and at end of stream sends
/// `"end {bytes}\n"` before closing (the rest of the response a half-closing
/// client must still receive).
struct Backend {
    addr: SocketAddrV4,
    stop: Arc<AtomicBool>,
    accepts: Option<thread::JoinHandle<()>>,
}

impl Backend {
    fn start(id: &str, ip: Ipv4Addr) -> Backend {
        Backend::start_on(id, SocketAddrV4::new(ip, 0))
    }

    /// A backend on `addr` (a port the proxy already knows, to bring a
    /// replica back).
    fn start_on(id: &str, addr: SocketAddrV4) -> Backend {
        let listener = TcpListener::bind(addr).expect("bind backend");
        let addr = match listener.local_addr().expect("backend addr") {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(_) => unreachable!("bound an IPv4 address"),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let (name, stopping) = (id.to_string(), Arc::clone(&stop));
        let accepts = thread::spawn(move || {
            for conn in listener.incoming() {
                if stopping.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let name = name.clone();
                thread::spawn(move || serve_echo(conn, &name));
            }
        });
        Backend {
            addr,
            stop,
            accepts: Some(accepts),
        }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.accepts.take() {
            let _ = t.join();
        }
    }
}

fn serve_echo(mut conn: TcpStream, id: &str) {
    if conn.write_all(format!("{id}\n").as_bytes()).is_err() {
        return;
    }
    let mut total = 0usize;
    let mut buf = [0u8; 16 * 1024];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                total += n;
                if conn.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(_) => return,
        }
    }
    let _ = conn.write_all(format!("end {total}\n").as_bytes());
}

/// A port nobody listens on: bound, then released.
fn closed_port(ip: Ipv4Addr) -> SocketAddrV4 {
    let l = TcpListener::bind((ip, 0)).expect("bind");
    match l.local_addr().expect("addr") {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(_) => unreachable!(),
    }
}

/// Waits until `addr` refuses connections: the proxy has closed its
/// listener. Waited for, not checked once, because the proxy's `close(2)`
/// does not end the socket while a child forked at that moment by another
/// test of this process still holds a copy of the descriptor (until its
/// `exec` drops the close-on-exec ones): the kernel then completes a
/// handshake into a backlog nobody accepts. A listener the proxy left open
/// never refuses, so the wait still fails.
fn assert_refuses(addr: SocketAddrV4, what: &str) {
    poll_until(
        what,
        || matches!(TcpStream::connect(addr), Err(e) if e.kind() == io::ErrorKind::ConnectionRefused),
    );
}

fn service(name: &str, vip: Ipv4Addr, replicas: &[SocketAddrV4]) -> ServiceEndpoints {
    ServiceEndpoints {
        name: name.into(),
        vip,
        port: 0,
        replicas: replicas.to_vec(),
        unsettled: false,
    }
}

/// A proxy with two event loops, as on any node with two CPUs or more, so
/// every test also covers listeners shared by several loops.
fn start(connect_timeout: Duration) -> Proxy {
    start_with(connect_timeout, 2)
}

fn start_with(connect_timeout: Duration, threads: usize) -> Proxy {
    Proxy::start(ProxyConfig {
        connect_timeout,
        threads,
        bind_ip_override: None,
        eject_initial: EJECT_INITIAL,
    })
    .expect("start proxy")
}

fn update_ok(proxy: &Proxy, services: &[ServiceEndpoints]) {
    let errors = proxy.update(services);
    assert!(errors.is_empty(), "update failed: {errors:?}");
}

/// Where the proxy listens for `name`.
fn listen_addr(proxy: &Proxy, name: &str) -> SocketAddrV4 {
    proxy
        .services()
        .into_iter()
        .find(|(n, _, _)| n == name)
        .map(|(_, addr, _)| addr)
        .unwrap_or_else(|| panic!("service {name} is not served: {:?}", proxy.services()))
}

/// Connects through the proxy and returns the stream and the id of the
/// backend that answered.
fn connect(addr: SocketAddrV4) -> (TcpStream, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the proxy");
    s.set_read_timeout(Some(HANG)).expect("timeout");
    let id = read_line(&mut s);
    (s, id)
}

/// Reads one line byte by byte (unbuffered, so nothing after it is consumed).
fn read_line(s: &mut TcpStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        let n = s.read(&mut b).expect("read a line through the proxy");
        assert_eq!(
            n,
            1,
            "connection closed after {:?}",
            String::from_utf8_lossy(&line)
        );
        if b[0] == b'\n' {
            return String::from_utf8(line).expect("utf-8 line");
        }
        line.push(b[0]);
    }
}

fn assert_echoes(s: &mut TcpStream, msg: &[u8]) {
    s.write_all(msg).expect("write through the proxy");
    let mut back = vec![0u8; msg.len()];
    s.read_exact(&mut back).expect("echo through the proxy");
    assert_eq!(back, msg);
}

#[test]
fn connections_go_round_robin_across_three_backends() {
    let backends: Vec<Backend> = ["a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(i, id)| Backend::start(id, ip(1, i as u8 + 10)))
        .collect();
    let addrs: Vec<_> = backends.iter().map(|b| b.addr).collect();
    // One rotation per service, whichever event loop accepts a connection.
    for (threads, vip) in [(1, ip(1, 1)), (3, ip(1, 2))] {
        let proxy = start_with(Duration::from_secs(1), threads);
        update_ok(&proxy, &[service("rr", vip, &addrs)]);
        let listen = listen_addr(&proxy, "rr");
        let ids: Vec<String> = (0..6)
            .map(|_| {
                let (mut s, id) = connect(listen);
                assert_echoes(&mut s, b"hello");
                id
            })
            .collect();
        assert_eq!(ids, ["a", "b", "c", "a", "b", "c"], "{threads} event loops");
        assert_eq!(proxy.services(), [("rr".to_string(), listen, 3)]);
    }
}

#[test]
fn an_unsettled_table_adds_replicas_and_drops_none() {
    let backends: Vec<Backend> = ["a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(i, id)| Backend::start(id, ip(8, i as u8 + 10)))
        .collect();
    let addrs: Vec<_> = backends.iter().map(|b| b.addr).collect();
    let proxy = start(Duration::from_secs(1));
    update_ok(&proxy, &[service("web", ip(8, 1), &addrs[..2])]);
    let listen = listen_addr(&proxy, "web");
    // A control plane that restarted has heard only from c's node so far.
    let mut unsettled = service("web", ip(8, 1), &addrs[2..]);
    unsettled.unsettled = true;
    update_ok(&proxy, &[unsettled]);
    assert_eq!(proxy.services(), [("web".to_string(), listen, 3)]);
    let mut ids: Vec<String> = (0..3).map(|_| connect(listen).1).collect();
    ids.sort();
    assert_eq!(ids, ["a", "b", "c"], "a and b kept, c added");
    // Settled again, the table is taken as it is.
    update_ok(&proxy, &[service("web", ip(8, 1), &addrs[1..2])]);
    assert_eq!(proxy.services(), [("web".to_string(), listen, 1)]);
}

#[test]
fn a_dead_backend_is_skipped_by_the_retry_without_client_failures() {
    let a = Backend::start("a", ip(2, 10));
    let c = Backend::start("c", ip(2, 12));
    let dead = closed_port(ip(2, 11));
    let proxy = start(Duration::from_secs(1));
    update_ok(
        &proxy,
        &[service("dead", ip(2, 1), &[a.addr, dead, c.addr])],
    );
    let listen = listen_addr(&proxy, "dead");
    let ids: Vec<String> = (0..6)
        .map(|_| {
            let (mut s, id) = connect(listen);
            assert_echoes(&mut s, b"still here");
            id
        })
        .collect();
    // The dead replica's turns go to the next one in rotation.
    assert_eq!(ids, ["a", "c", "c", "a", "c", "c"]);
}

#[test]
fn zero_replicas_accept_and_close_at_once() {
    let proxy = start(Duration::from_secs(1));
    update_ok(&proxy, &[service("empty", ip(3, 1), &[])]);
    let listen = listen_addr(&proxy, "empty");
    for _ in 0..3 {
        let mut s = TcpStream::connect(listen).expect("the listener stays up");
        s.set_read_timeout(Some(HANG)).expect("timeout");
        let mut buf = [0u8; 16];
        assert_eq!(s.read(&mut buf).expect("closed, not reset"), 0);
    }
    assert_eq!(proxy.services(), [("empty".to_string(), listen, 0)]);
}

#[test]
fn hot_swap_keeps_established_connections() {
    let a = Backend::start("a", ip(4, 10));
    let b = Backend::start("b", ip(4, 11));
    let c = Backend::start("c", ip(4, 12));
    let proxy = start(Duration::from_secs(1));
    update_ok(&proxy, &[service("swap", ip(4, 1), &[a.addr, b.addr])]);
    let listen = listen_addr(&proxy, "swap");
    let (mut first, id1) = connect(listen);
    let (mut second, id2) = connect(listen);
    assert_eq!((id1.as_str(), id2.as_str()), ("a", "b"));

    update_ok(&proxy, &[service("swap", ip(4, 1), &[c.addr])]);
    // Same listener, new list...
    assert_eq!(proxy.services(), [("swap".to_string(), listen, 1)]);
    for _ in 0..2 {
        let (mut s, id) = connect(listen);
        assert_eq!(id, "c");
        assert_echoes(&mut s, b"new list");
    }
    // ...and the connections to replicas no longer listed keep relaying.
    assert_echoes(&mut first, b"old list, first");
    assert_echoes(&mut second, b"old list, second");
}

#[test]
fn removing_a_service_closes_its_listener_but_not_its_connections() {
    let a = Backend::start("a", ip(5, 10));
    let proxy = Proxy::start(ProxyConfig {
        connect_timeout: Duration::from_secs(1),
        threads: 2,
        bind_ip_override: Some(ip(5, 2)),
        eject_initial: EJECT_INITIAL,
    })
    .expect("start proxy");
    let keep = service("keep", ip(5, 1), &[a.addr]);
    update_ok(
        &proxy,
        &[service("gone", ip(5, 1), &[a.addr]), keep.clone()],
    );
    let gone_addr = listen_addr(&proxy, "gone");
    assert_eq!(*gone_addr.ip(), ip(5, 2), "the override replaces the VIP");
    let (mut established, _) = connect(gone_addr);

    update_ok(&proxy, &[keep]);
    assert_refuses(gone_addr, "the removed service's listener to close");
    assert_echoes(&mut established, b"relaying on");
    let names: Vec<_> = proxy.services().into_iter().map(|(n, _, _)| n).collect();
    assert_eq!(names, ["keep"]);
    let (mut s, _) = connect(listen_addr(&proxy, "keep"));
    assert_echoes(&mut s, b"other service unaffected");
}

#[test]
fn a_bind_error_is_reported_for_that_service_only() {
    let a = Backend::start("a", ip(6, 10));
    let taken = TcpListener::bind((ip(6, 1), 0)).expect("bind");
    let SocketAddr::V4(taken_addr) = taken.local_addr().expect("addr") else {
        unreachable!()
    };
    let proxy = start(Duration::from_secs(1));
    let clash = ServiceEndpoints {
        port: taken_addr.port(),
        ..service("clash", ip(6, 1), &[a.addr])
    };
    let errors = proxy.update(&[clash.clone(), service("fine", ip(6, 2), &[a.addr])]);
    match errors.as_slice() {
        [ProxyError::Listen { service, addr, .. }] => {
            assert_eq!((service.as_str(), *addr), ("clash", taken_addr));
        }
        other => panic!("expected one listen error for clash, got {other:?}"),
    }
    assert!(errors[0].to_string().contains("clash"), "{}", errors[0]);
    let (mut s, id) = connect(listen_addr(&proxy, "fine"));
    assert_eq!(id, "a");
    assert_echoes(&mut s, b"fine");

    // Once the address is free the next update serves it.
    drop(taken);
    update_ok(&proxy, &[clash, service("fine", ip(6, 2), &[a.addr])]);
    let (mut s, _) = connect(taken_addr);
    assert_echoes(&mut s, b"served now");
}

#[test]
fn half_close_still_delivers_the_rest_of_the_response() {
    let a = Backend::start("a", ip(7, 10));
    let proxy = start(Duration::from_secs(1));
    update_ok(&proxy, &[service("half", ip(7, 1), &[a.addr])]);
    let (mut s, _) = connect(listen_addr(&proxy, "half"));
    // 1 MiB: more than the socket buffers hold, so the relay's backlog and
    // backpressure paths run too.
    let payload: Vec<u8> = (0..1024 * 1024).map(|i| (i % 251) as u8).collect();
    let mut writer = s.try_clone().expect("clone");
    let sent = payload.clone();
    let writing = thread::spawn(move || {
        writer.write_all(&sent).expect("write the request");
        writer.shutdown(Shutdown::Write).expect("half-close");
    });
    let mut back = Vec::new();
    s.read_to_end(&mut back)
        .expect("read until the backend closes");
    writing.join().expect("writer");
    let trailer = format!("end {}\n", payload.len());
    assert!(
        back.ends_with(trailer.as_bytes()),
        "the response after the client's shutdown is missing; got {} bytes ending {:?}",
        back.len(),
        String::from_utf8_lossy(&back[back.len().saturating_sub(32)..])
    );
    assert_eq!(&back[..payload.len()], payload.as_slice());
    assert_eq!(back.len(), payload.len() + trailer.len());
}

/// The other way round: the replica ends its side first and the client
/// keeps sending. The client must see the end while it stays open, and its
/// bytes must still reach the replica.
#[test]
fn a_replica_that_ends_first_still_hears_the_client() {
    let listener = TcpListener::bind((ip(31, 10), 0)).expect("bind replica");
    let replica = match listener.local_addr().expect("replica addr") {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(_) => unreachable!("bound an IPv4 address"),
    };
    let serving = thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        conn.set_read_timeout(Some(HANG)).expect("timeout");
        conn.write_all(b"bye\n").expect("answer");
        conn.shutdown(Shutdown::Write).expect("half-close");
        let mut heard = Vec::new();
        conn.read_to_end(&mut heard)
            .expect("read until the client ends");
        heard
    });
    let proxy = start(Duration::from_secs(1));
    update_ok(&proxy, &[service("first", ip(31, 1), &[replica])]);
    let (mut s, greeting) = connect(listen_addr(&proxy, "first"));
    assert_eq!(greeting, "bye");
    let mut rest = Vec::new();
    s.read_to_end(&mut rest)
        .expect("the replica's end reaches the client");
    assert!(rest.is_empty(), "nothing after the answer: {rest:?}");
    s.write_all(b"still here")
        .expect("write after the replica ended");
    s.shutdown(Shutdown::Write).expect("half-close");
    assert_eq!(serving.join().expect("replica"), b"still here");
}

#[test]
fn a_connect_timeout_moves_on_to_the_next_replica() {
    // A listener whose accept queue is full drops further SYNs, so a connect
    // to it hangs until the proxy's own timeout gives up.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _ctx = rt.enter();
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind(SocketAddr::from((ip(8, 11), 0))).expect("bind");
    let full = socket.listen(0).expect("listen");
    let SocketAddr::V4(full_addr) = full.local_addr().expect("addr") else {
        unreachable!()
    };
    let mut fillers = Vec::new();
    let hangs = (0..16).any(|_| {
        match TcpStream::connect_timeout(&full_addr.into(), Duration::from_millis(200)) {
            Ok(s) => {
                fillers.push(s);
                false
            }
            Err(e) => e.kind() == io::ErrorKind::TimedOut || e.kind() == io::ErrorKind::WouldBlock,
        }
    });
    if !hangs {
        eprintln!("skipping: this kernel completes connects to a full listener");
        return;
    }
    let good = Backend::start("good", ip(8, 12));
    let proxy = start(Duration::from_millis(300));
    update_ok(
        &proxy,
        &[service("slow", ip(8, 1), &[full_addr, good.addr])],
    );
    // Turn 0 is the hanging replica: the request must still succeed, through
    // the retry, well before the HANG read timeout (the OS connect timeout
    // would take about two minutes).
    let (mut s, id) = connect(listen_addr(&proxy, "slow"));
    assert_eq!(id, "good");
    assert_echoes(&mut s, b"after the timeout");
}

/// The many-connections echo side: an event-driven backend (a thread per
/// connection would be 10,000 threads) counting its open connections.
fn start_counting_echo(ip: Ipv4Addr) -> (SocketAddrV4, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // The proxy's backlog, not std's 128: connections arrive faster than one
    // accepting thread takes them, and a full queue drops SYNs, whose
    // retransmission (1 s later) outlasts the proxy's connect timeout and
    // moves those connections to the other backend.
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket
        .bind(&SocketAddr::from((ip, 0)).into())
        .expect("bind");
    socket.listen(LISTEN_BACKLOG).expect("listen");
    let listener: TcpListener = socket.into();
    listener.set_nonblocking(true).expect("nonblocking");
    let SocketAddr::V4(addr) = listener.local_addr().expect("addr") else {
        unreachable!()
    };
    let open = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&open);
    thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            while let Ok((mut conn, _)) = listener.accept().await {
                let counter = Arc::clone(&counter);
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = conn.read(&mut buf).await {
                        if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    counter.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
    });
    (addr, open)
}

#[test]
fn ten_thousand_concurrent_relayed_connections() {
    const WANT: usize = 10_000;
    // Every connection is four descriptors in this process: the client, the
    // proxy's two sockets and the backend's; 1024 spare for the other tests
    // of this binary running meanwhile.
    const SPARE: usize = 1024;
    let limit = raise_nofile((4 * WANT + SPARE) as libc::rlim_t).expect("RLIMIT_NOFILE") as usize;
    // Where the hard limit is too low (a container without CAP_SYS_RESOURCE)
    // run as many as it allows, and say so, rather than nothing.
    let conns = WANT.min(limit.saturating_sub(SPARE) / 4) & !1;
    if conns < 1000 {
        eprintln!("skipping: RLIMIT_NOFILE {limit} allows only {conns} connections");
        return;
    }
    if conns < WANT {
        eprintln!(
            "ten_thousand_concurrent_relayed_connections: RLIMIT_NOFILE is {limit} and cannot be raised to {}, running {conns} connections",
            4 * WANT + SPARE
        );
    }
    let backends: Vec<_> = (0..2).map(|i| start_counting_echo(ip(9, 10 + i))).collect();
    // Thousands of connects in a burst overflow a backend's listen backlog,
    // and a dropped SYN is retried by the kernel after a second: with a 1 s
    // connect timeout the proxy would then (rightly) move that connection
    // to the other backend, and the even split this test checks would
    // depend on the machine's load. A connect that is slow, not refused,
    // must wait here.
    let proxy = start(HANG);
    let addrs: Vec<_> = backends.iter().map(|(a, _)| *a).collect();
    update_ok(&proxy, &[service("many", ip(9, 1), &addrs)]);
    let listen = listen_addr(&proxy, "many");

    let mut clients = Vec::with_capacity(conns);
    for i in 0..conns {
        let s = TcpStream::connect(listen)
            .unwrap_or_else(|e| panic!("connection {i} through the proxy: {e}"));
        s.set_read_timeout(Some(HANG)).expect("timeout");
        clients.push(s);
    }
    // All of them relayed at once: each backend holds its half.
    let deadline = Instant::now() + HANG;
    let open = |b: &(SocketAddrV4, Arc<AtomicUsize>)| b.1.load(Ordering::SeqCst);
    while backends.iter().map(open).sum::<usize>() < conns {
        assert!(
            Instant::now() < deadline,
            "backends hold {:?} connections, expected {conns} in total",
            backends.iter().map(open).collect::<Vec<_>>()
        );
        thread::sleep(Duration::from_millis(20));
    }
    let per_backend: BTreeMap<_, _> = backends.iter().map(|b| (b.0, open(b))).collect();
    assert!(
        per_backend.values().all(|&n| n == conns / 2),
        "round robin splits evenly: {per_backend:?}"
    );
    // Data on a sample, spread over the whole range, while all stay open.
    for (i, s) in clients.iter_mut().enumerate().step_by(97) {
        assert_echoes(s, format!("connection {i:05}").as_bytes());
    }
    drop(clients);
    let deadline = Instant::now() + HANG;
    while backends.iter().map(open).sum::<usize>() > 0 {
        assert!(Instant::now() < deadline, "closing clients closes backends");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn shutdown_closes_listeners() {
    let a = Backend::start("a", ip(10, 10));
    let proxy = start(Duration::from_secs(1));
    update_ok(&proxy, &[service("s", ip(10, 1), &[a.addr])]);
    let listen = listen_addr(&proxy, "s");
    proxy.shutdown();
    assert_refuses(listen, "no listener after shutdown");
}

/// With `agent.proxy_listen` every service listens on one IP, so two
/// services with the same port collide. The listeners share ports across
/// event loops, so the kernel would let both bind and split connections
/// between them: the proxy refuses the second instead, naming the first.
#[test]
fn two_services_on_one_address_are_refused_not_shared() {
    let a = Backend::start("a", ip(11, 10));
    let b = Backend::start("b", ip(11, 11));
    let shared_ip = ip(11, 2);
    let proxy = Proxy::start(ProxyConfig {
        connect_timeout: Duration::from_secs(1),
        threads: 2,
        bind_ip_override: Some(shared_ip),
        eject_initial: EJECT_INITIAL,
    })
    .expect("start proxy");
    let port = TcpListener::bind((shared_ip, 0))
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let first = ServiceEndpoints {
        port,
        ..service("first", ip(11, 1), &[a.addr])
    };
    let second = ServiceEndpoints {
        port,
        ..service("second", ip(11, 3), &[b.addr])
    };
    let errors = proxy.update(&[first, second]);
    match errors.as_slice() {
        [ProxyError::Taken { service, addr, by }] => {
            assert_eq!(
                (service.as_str(), *addr, by.as_str()),
                ("second", SocketAddrV4::new(shared_ip, port), "first")
            );
        }
        other => panic!("expected second refused, got {other:?}"),
    }
    assert!(
        errors[0].to_string().contains("ports must differ"),
        "{}",
        errors[0]
    );
    for _ in 0..6 {
        let (_, id) = connect(SocketAddrV4::new(shared_ip, port));
        assert_eq!(id, "a", "every connection belongs to the first service");
    }
}

/// A replica that accepts every connection and resets it at once, before
/// sending anything (`SO_LINGER` 0, then close): a workload going down, or
/// one whose listener is up before it can serve. Counts what it accepted.
struct Resetter {
    addr: SocketAddrV4,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    accepts: Option<thread::JoinHandle<()>>,
}

impl Resetter {
    fn start(ip: Ipv4Addr) -> Resetter {
        let listener = TcpListener::bind((ip, 0)).expect("bind resetter");
        let SocketAddr::V4(addr) = listener.local_addr().expect("addr") else {
            unreachable!()
        };
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (counter, stopping) = (Arc::clone(&accepted), Arc::clone(&stop));
        let accepts = thread::spawn(move || {
            for conn in listener.incoming() {
                if stopping.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                counter.fetch_add(1, Ordering::SeqCst);
                socket2::SockRef::from(&conn)
                    .set_linger(Some(Duration::ZERO))
                    .expect("SO_LINGER 0");
                drop(conn);
            }
        });
        Resetter {
            addr,
            accepted,
            stop,
            accepts: Some(accepts),
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Resetter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.accepts.take() {
            let _ = t.join();
        }
    }
}

/// A proxy whose replicas stay ejected for `eject_initial` after failing.
fn start_ejecting(eject_initial: Duration) -> Proxy {
    Proxy::start(ProxyConfig {
        connect_timeout: Duration::from_secs(1),
        threads: 2,
        bind_ip_override: None,
        eject_initial,
    })
    .expect("start proxy")
}

/// `(replica, open connections, listed, ejected)` of service `name`.
fn loads(proxy: &Proxy, name: &str) -> Vec<(SocketAddrV4, usize, bool, bool)> {
    proxy
        .loads()
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, l)| {
            l.into_iter()
                .map(
                    |ReplicaLoad {
                         addr,
                         open,
                         listed,
                         ejected,
                     }| (addr, open, listed, ejected),
                )
                .collect()
        })
        .unwrap_or_else(|| panic!("service {name} is not served"))
}

/// Reads what is left until the proxy closes the connection: a client
/// whose connection no replica took sees an empty stream.
fn read_rest(s: &mut TcpStream) -> Vec<u8> {
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    rest
}

#[test]
fn refusing_and_resetting_replicas_are_ejected_and_no_client_connection_fails() {
    let a = Backend::start("a", ip(20, 10));
    let refusing = closed_port(ip(20, 11));
    let resetter = Resetter::start(ip(20, 12));
    let c = Backend::start("c", ip(20, 13));
    // Ejections outlast the test, so which replica gets a turn does not
    // depend on how fast the machine is.
    let proxy = start_ejecting(HANG);
    update_ok(
        &proxy,
        &[service(
            "flaky",
            ip(20, 1),
            &[a.addr, refusing, resetter.addr, c.addr],
        )],
    );
    let listen = listen_addr(&proxy, "flaky");
    let mut ids = Vec::new();
    for i in 0..12 {
        let mut s = TcpStream::connect(listen).expect("connect to the proxy");
        s.set_read_timeout(Some(HANG)).expect("timeout");
        // The request goes out before any answer: the proxy keeps it for the
        // next replica when one resets before its first byte.
        let msg = format!("request {i}");
        s.write_all(msg.as_bytes())
            .expect("write through the proxy");
        ids.push(read_line(&mut s));
        let mut back = vec![0u8; msg.len()];
        s.read_exact(&mut back).expect("echo through the proxy");
        assert_eq!(back, msg.as_bytes());
    }
    // Turn 1 is the refusing replica: it and then the resetter fail, c
    // serves. From then on both are skipped and their turns go to c.
    assert_eq!(
        ids,
        ["a", "c", "c", "c", "a", "c", "c", "c", "a", "c", "c", "c"]
    );
    assert_eq!(resetter.accepted(), 1, "the resetter was tried once");
    let ejected: Vec<_> = loads(&proxy, "flaky")
        .into_iter()
        .map(|(addr, _, _, ejected)| (addr, ejected))
        .collect();
    assert_eq!(
        ejected,
        [
            (a.addr, false),
            (refusing, true),
            (resetter.addr, true),
            (c.addr, false)
        ]
    );
}

#[test]
fn an_ejected_replica_comes_back_once_its_back_off_ended_and_it_serves_again() {
    let a = Backend::start("a", ip(21, 10));
    let down = closed_port(ip(21, 11));
    let proxy = start_ejecting(Duration::from_millis(200));
    update_ok(&proxy, &[service("back", ip(21, 1), &[a.addr, down])]);
    let listen = listen_addr(&proxy, "back");
    // Turn 1 is the replica that is down: it fails, a serves.
    assert_eq!(connect(listen).1, "a");
    assert_eq!(connect(listen).1, "a");
    let b = Backend::start_on("b", down);
    poll_until("the replica back up gets connections again", || {
        let (mut s, id) = connect(listen);
        assert_echoes(&mut s, b"no failure meanwhile");
        id == "b"
    });
    let ejected: Vec<_> = loads(&proxy, "back").iter().map(|l| l.3).collect();
    assert_eq!(ejected, [false, false], "its answer cleared its record");
    drop(b);
}

#[test]
fn a_connection_tries_at_most_three_replicas_and_ejected_ones_last() {
    let dead: Vec<SocketAddrV4> = (0..4).map(|i| closed_port(ip(22, 10 + i))).collect();
    let good = Backend::start("good", ip(22, 20));
    let proxy = start_ejecting(HANG);
    let mut replicas = dead.clone();
    replicas.push(good.addr);
    update_ok(&proxy, &[service("bound", ip(22, 1), &replicas)]);
    let listen = listen_addr(&proxy, "bound");
    // Turn 0 is three dead replicas: the bound stops there, before the good
    // one, and the client's connection is closed.
    let mut s = TcpStream::connect(listen).expect("connect to the proxy");
    s.set_read_timeout(Some(HANG)).expect("timeout");
    assert_eq!(
        read_rest(&mut s),
        b"",
        "no replica answered within the bound"
    );
    // Turn 1 starts at an ejected replica: the ready ones go first, so the
    // fourth dead one and then the good one are tried.
    for _ in 0..5 {
        let (mut s, id) = connect(listen);
        assert_eq!(id, "good");
        assert_echoes(&mut s, b"within the bound");
    }
    let ejected: Vec<bool> = loads(&proxy, "bound").iter().map(|l| l.3).collect();
    assert_eq!(ejected, [true, true, true, true, false]);
}

#[test]
fn when_every_replica_is_ejected_they_are_still_tried() {
    let first = closed_port(ip(23, 10));
    let second = closed_port(ip(23, 11));
    let proxy = start_ejecting(HANG);
    update_ok(&proxy, &[service("all", ip(23, 1), &[first, second])]);
    let listen = listen_addr(&proxy, "all");
    let mut s = TcpStream::connect(listen).expect("connect to the proxy");
    s.set_read_timeout(Some(HANG)).expect("timeout");
    assert_eq!(read_rest(&mut s), b"", "both replicas are down");
    assert!(loads(&proxy, "all").iter().all(|l| l.3), "both ejected");
    // Ejected replicas are a last resort, not a closed door.
    let back = Backend::start_on("back", second);
    let (mut s, id) = connect(listen);
    assert_eq!(id, "back");
    assert_echoes(&mut s, b"tried although ejected");
    drop(back);
}

#[test]
fn a_replica_dropped_from_the_table_drains_its_connections_and_gets_no_new_one() {
    let a = Backend::start("a", ip(24, 10));
    let b = Backend::start("b", ip(24, 11));
    let proxy = start(Duration::from_secs(1));
    update_ok(&proxy, &[service("drain", ip(24, 1), &[a.addr, b.addr])]);
    let listen = listen_addr(&proxy, "drain");
    let (mut established, id) = connect(listen);
    assert_eq!(id, "a");
    assert_eq!(
        loads(&proxy, "drain"),
        [(a.addr, 1, true, false), (b.addr, 0, true, false)]
    );

    update_ok(&proxy, &[service("drain", ip(24, 1), &[b.addr])]);
    let mut new = Vec::new();
    for _ in 0..4 {
        let (mut s, id) = connect(listen);
        assert_eq!(
            id, "b",
            "a replica leaving the table gets no new connection"
        );
        assert_echoes(&mut s, b"new");
        new.push(s);
    }
    assert_echoes(&mut established, b"still relaying");
    assert_eq!(
        loads(&proxy, "drain"),
        [(b.addr, 4, true, false), (a.addr, 1, false, false)],
        "the dropped replica is reported while it drains"
    );

    established
        .shutdown(Shutdown::Write)
        .expect("the client ends its request");
    assert!(read_rest(&mut established).ends_with(b"end 14\n"));
    drop(established);
    drop(new);
    poll_until("the dropped replica drained", || {
        loads(&proxy, "drain") == [(b.addr, 0, true, false)]
    });
}

/// A replica whose first answer is a burst larger than the socket buffers,
/// then its close, reaches the client whole, as does a replica that closes
/// at once without a byte (a clean end, not a failure): the proxy reads the
/// replica's first bytes itself and must forward every one of them.
#[test]
fn a_first_answer_larger_than_the_buffers_and_an_empty_one_arrive_as_sent() {
    let listener = TcpListener::bind(SocketAddrV4::new(ip(30, 10), 0)).expect("bind");
    let addr = match listener.local_addr().expect("addr") {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(_) => unreachable!("bound an IPv4 address"),
    };
    let burst: Vec<u8> = (0..4 * 1024 * 1024).map(|i| (i % 253) as u8).collect();
    let sent = burst.clone();
    // First connection: read the request, answer with the burst, close.
    // Second: read the request, close without a byte.
    let replica = thread::spawn(move || {
        for answer in [Some(sent), None] {
            let (mut conn, _) = listener.accept().expect("accept");
            conn.set_read_timeout(Some(HANG)).expect("timeout");
            let mut request = [0u8; 4];
            conn.read_exact(&mut request).expect("request");
            if let Some(bytes) = answer {
                conn.write_all(&bytes).expect("burst");
            }
        }
    });
    let proxy = start(Duration::from_secs(1));
    update_ok(&proxy, &[service("burst", ip(30, 1), &[addr])]);
    let at = listen_addr(&proxy, "burst");
    for expected in [burst, Vec::new()] {
        let mut s = TcpStream::connect(at).expect("connect to the proxy");
        s.set_read_timeout(Some(HANG)).expect("timeout");
        s.write_all(b"GET\n").expect("request");
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("a clean end of stream");
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "the bytes differ");
    }
    replica.join().expect("replica");
}
