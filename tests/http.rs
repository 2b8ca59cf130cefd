//! The HTTP server and client over real sockets: framing, limits, timeouts,
//! the connection bound, the Unix socket lifecycle and client round trips.
//! Raw-byte tests speak HTTP by hand so they can send what no client would.

use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use keel::common::http::{
    Client, ClientResponse, Endpoint, Handler, HttpError, OutgoingRequest, Request, Response,
    Server, ServerLimits, ShutdownSignal, bind_unix_socket, read_response,
};

use crate::util::poll_until;

/// Bound on every blocking read in these tests: a deadline, not a timing
/// claim. The shared one: a panicking handler's backtrace, symbolized from
/// a debug binary on a loaded CI machine, once took longer than 10 s.
use crate::util::DEADLINE;

/// Echoes the request as JSON and counts the requests that reached it. A
/// request with `X-Verified` is answered as if its signature had been
/// verified ([`Response::authenticated`]), as the daemons' guards do.
fn echo(calls: Arc<AtomicUsize>) -> Arc<dyn Handler> {
    Arc::new(move |req: Request| {
        calls.fetch_add(1, Ordering::SeqCst);
        if req.path == "/panic" {
            panic!("handler bug");
        }
        let resp = Response::json(
            200,
            &serde_json::json!({
                "method": req.method,
                "path": req.path,
                "raw_path": req.raw_path,
                "query": req.query,
                "segments": req.segments(),
                "token": req.header("x-token"),
                "body": String::from_utf8_lossy(&req.body),
                "peer": req.peer.to_string(),
            }),
        )
        .with_header("X-Echo", "yes");
        if req.header("x-verified").is_some() {
            resp.authenticated()
        } else {
            resp
        }
    })
}

struct Running {
    addr: SocketAddr,
    calls: Arc<AtomicUsize>,
    shutdown: ShutdownSignal,
    accept: Option<JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

fn start_tcp(limits: ServerLimits) -> Running {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let calls = Arc::new(AtomicUsize::new(0));
    let shutdown = ShutdownSignal::new();
    let server = Server::new(echo(Arc::clone(&calls)), limits, shutdown.clone());
    let accept = server.serve_tcp(listener).expect("serve");
    Running {
        addr,
        calls,
        shutdown,
        accept: Some(accept),
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(DEADLINE)).expect("timeout");
    s
}

/// Sends `raw` and returns everything the server sent until it closed.
fn exchange(addr: SocketAddr, raw: &[u8]) -> String {
    let mut s = connect(addr);
    s.write_all(raw).expect("write");
    read_until_closed(&mut s)
}

fn read_until_closed(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    s.read_to_end(&mut out)
        .expect("the server closed within the deadline");
    String::from_utf8_lossy(&out).into_owned()
}

fn next_response(reader: &mut BufReader<TcpStream>) -> ClientResponse {
    read_response(reader, "test server", false).expect("response")
}

fn json(r: &ClientResponse) -> serde_json::Value {
    serde_json::from_slice(&r.body).expect("JSON body")
}

/// Polls `f` until it returns `Some`, failing after [`DEADLINE`].
fn await_some<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let until = Instant::now() + DEADLINE;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < until, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn assert_json_error(wire: &str, status: u16) {
    assert!(
        wire.starts_with(&format!("HTTP/1.1 {status} ")),
        "expected {status}, got {wire:?}"
    );
    let body = wire.split_once("\r\n\r\n").expect("head end").1;
    let v: serde_json::Value = serde_json::from_str(body).expect("JSON error body");
    assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{body}");
    assert!(wire.contains("Connection: close\r\n"), "{wire:?}");
}

#[test]
fn keep_alive_serves_two_requests_on_one_connection() {
    let srv = start_tcp(ServerLimits::default());
    let s = connect(srv.addr);
    let mut w = s.try_clone().expect("clone");
    let mut r = BufReader::new(s);
    w.write_all(b"GET /jails/web?x=1 HTTP/1.1\r\nHost: t\r\n\r\n")
        .expect("write");
    let first = next_response(&mut r);
    assert_eq!(first.status, 200);
    assert_eq!(first.header("connection"), None);
    assert_eq!(json(&first)["query"], "x=1");
    assert_eq!(
        json(&first)["segments"],
        serde_json::json!(["jails", "web"])
    );
    w.write_all(b"PUT /jails/db HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello")
        .expect("write");
    let second = next_response(&mut r);
    assert_eq!(json(&second)["method"], "PUT");
    assert_eq!(json(&second)["body"], "hello");
    assert_eq!(second.header("x-echo"), Some("yes"));
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let srv = start_tcp(ServerLimits::default());
    let s = connect(srv.addr);
    let mut w = s.try_clone().expect("clone");
    let mut r = BufReader::new(s);
    w.write_all(
        b"POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nonePOST /b HTTP/1.1\r\nContent-Length: 3\r\n\r\ntwo",
    )
    .expect("write");
    assert_eq!(json(&next_response(&mut r))["body"], "one");
    assert_eq!(json(&next_response(&mut r))["path"], "/b");
}

#[test]
fn connection_close_is_honoured() {
    let srv = start_tcp(ServerLimits::default());
    let wire = exchange(
        srv.addr,
        b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    );
    assert!(wire.starts_with("HTTP/1.1 200 OK\r\n"), "{wire:?}");
    assert!(wire.contains("Connection: close\r\n"), "{wire:?}");
}

#[test]
fn http10_closes_unless_keep_alive_is_asked() {
    let srv = start_tcp(ServerLimits::default());
    let wire = exchange(srv.addr, b"GET /healthz HTTP/1.0\r\n\r\n");
    assert!(wire.contains("Connection: close\r\n"), "{wire:?}");

    let s = connect(srv.addr);
    let mut w = s.try_clone().expect("clone");
    let mut r = BufReader::new(s);
    for _ in 0..2 {
        w.write_all(b"GET /healthz HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
            .expect("write");
        let resp = next_response(&mut r);
        assert_eq!(resp.header("connection"), Some("keep-alive"));
    }
}

#[test]
fn idle_keep_alive_connection_is_closed_quietly() {
    let srv = start_tcp(ServerLimits {
        idle_timeout: Duration::from_millis(100),
        ..ServerLimits::default()
    });
    let s = connect(srv.addr);
    let mut w = s.try_clone().expect("clone");
    let mut r = BufReader::new(s);
    w.write_all(b"GET /a HTTP/1.1\r\n\r\n").expect("write");
    assert_eq!(next_response(&mut r).status, 200);
    let mut rest = String::new();
    r.read_to_string(&mut rest).expect("closed");
    assert_eq!(rest, "", "an idle close sends nothing");
}

#[test]
fn oversized_body_is_refused_without_waiting_for_it() {
    let srv = start_tcp(ServerLimits {
        max_body_bytes: 1024,
        ..ServerLimits::default()
    });
    // Only the head is sent: an answer at all proves the server did not wait
    // for (let alone read) the 2 MiB it was promised.
    let wire = exchange(
        srv.addr,
        b"PUT /jails/web HTTP/1.1\r\nContent-Length: 2097152\r\n\r\n",
    );
    assert_json_error(&wire, 413);
    assert_eq!(srv.calls.load(Ordering::SeqCst), 0);

    let ok = exchange(
        srv.addr,
        format!(
            "PUT /jails/web HTTP/1.1\r\nContent-Length: 1024\r\nConnection: close\r\n\r\n{}",
            "x".repeat(1024)
        )
        .as_bytes(),
    );
    assert!(
        ok.starts_with("HTTP/1.1 200 "),
        "the limit itself is allowed"
    );
}

#[test]
fn route_specific_body_limit_wins() {
    struct Big;
    impl Handler for Big {
        fn handle(&self, req: Request) -> Response {
            Response::text(200, format!("{}", req.body.len()))
        }
        fn max_body_bytes(&self, _method: &str, path: &str) -> Option<usize> {
            (path == "/big").then_some(4096)
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let shutdown = ShutdownSignal::new();
    let limits = ServerLimits {
        max_body_bytes: 10,
        ..ServerLimits::default()
    };
    Server::new(Arc::new(Big), limits, shutdown.clone())
        .serve_tcp(listener)
        .expect("serve");
    let body = "y".repeat(2000);
    let req = |path: &str| {
        format!("POST {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: 2000\r\n\r\n{body}")
    };
    assert!(exchange(addr, req("/big").as_bytes()).ends_with("\r\n\r\n2000"));
    assert_json_error(&exchange(addr, req("/small").as_bytes()), 413);
    shutdown.trigger();
}

#[test]
fn huge_headers_get_431() {
    let srv = start_tcp(ServerLimits::default());
    let raw = format!(
        "GET /a HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(20 * 1024)
    );
    assert_json_error(&exchange(srv.addr, raw.as_bytes()), 431);
    let many: String = (0..100).map(|i| format!("X-{i}: v\r\n")).collect();
    let raw = format!("GET /a HTTP/1.1\r\n{many}\r\n");
    assert_json_error(&exchange(srv.addr, raw.as_bytes()), 431);
    assert_eq!(srv.calls.load(Ordering::SeqCst), 0);
}

#[test]
fn malformed_requests_get_400() {
    let srv = start_tcp(ServerLimits::default());
    for raw in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET /a HTTP/1.1 extra\r\n\r\n",
        b"GET /a HTTP/9.9\r\n\r\n",
        b"GET /a HTTP/1.1\r\nNo Colon Here\r\n\r\n",
        b"PUT /a HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
        b"PUT /a HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        b"PUT /a HTTP/1.1\r\nContent-Length: +3\r\n\r\nabc",
        b"PUT /a HTTP/1.1\r\nContent-Length: three\r\n\r\nabc",
    ] {
        let wire = exchange(srv.addr, raw);
        assert!(
            wire.starts_with("HTTP/1.1 400 "),
            "{:?} got {wire:?}",
            String::from_utf8_lossy(raw)
        );
        assert_json_error(&wire, 400);
    }
    assert_eq!(srv.calls.load(Ordering::SeqCst), 0);
}

#[test]
fn chunked_bodies_are_refused() {
    let srv = start_tcp(ServerLimits::default());
    let wire = exchange(
        srv.addr,
        b"PUT /jails/web HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    );
    assert_json_error(&wire, 411);
    assert!(wire.contains("Content-Length"), "the error says what to do");
    // Both framings at once is the classic smuggling shape.
    let wire = exchange(
        srv.addr,
        b"PUT /x HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\nabc",
    );
    assert_json_error(&wire, 411);
    assert_eq!(srv.calls.load(Ordering::SeqCst), 0);
}

#[test]
fn path_traversal_is_refused() {
    let srv = start_tcp(ServerLimits::default());
    for target in [
        &b"/jails/../x"[..],
        b"/jails/..",
        b"/jails/%2e%2e",
        b"/jails/%2E%2E/etc",
        b"/jails%2fweb",
        b"/jails/web%00",
        b"/jails/web\0",
        b"jails/web",
    ] {
        let mut raw = b"GET ".to_vec();
        raw.extend_from_slice(target);
        raw.extend_from_slice(b" HTTP/1.1\r\n\r\n");
        let wire = exchange(srv.addr, &raw);
        assert!(
            wire.starts_with("HTTP/1.1 400 "),
            "{:?} got {wire:?}",
            String::from_utf8_lossy(target)
        );
    }
    assert_eq!(srv.calls.load(Ordering::SeqCst), 0);
}

#[test]
fn head_responses_have_no_body() {
    let srv = start_tcp(ServerLimits::default());
    let wire = exchange(
        srv.addr,
        b"HEAD /jails HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    let (head, body) = wire.split_once("\r\n\r\n").expect("head");
    assert!(head.contains("Content-Length: "), "{head}");
    assert!(!head.contains("Content-Length: 0"), "{head}");
    assert_eq!(body, "");
}

#[test]
fn expect_continue_is_answered_before_the_body() {
    let srv = start_tcp(ServerLimits::default());
    let s = connect(srv.addr);
    let mut w = s.try_clone().expect("clone");
    let mut r = BufReader::new(s);
    w.write_all(b"PUT /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        .expect("write");
    // The interim response arrives although no body was sent yet.
    let mut interim = [0u8; 25];
    r.read_exact(&mut interim).expect("100 Continue");
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    w.write_all(b"ok").expect("write");
    assert_eq!(json(&next_response(&mut r))["body"], "ok");

    let wire = exchange(srv.addr, b"PUT /a HTTP/1.1\r\nExpect: magic\r\n\r\n");
    assert_json_error(&wire, 417);
}

#[test]
fn handler_panic_is_a_500_and_the_server_lives_on() {
    let srv = start_tcp(ServerLimits::default());
    let wire = exchange(
        srv.addr,
        b"GET /panic HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert!(wire.starts_with("HTTP/1.1 500 "), "{wire:?}");
    let wire = exchange(srv.addr, b"GET /fine HTTP/1.1\r\nConnection: close\r\n\r\n");
    assert!(wire.starts_with("HTTP/1.1 200 "), "{wire:?}");
}

#[test]
fn slow_client_is_cut_off_while_others_are_served() {
    let srv = start_tcp(ServerLimits {
        read_timeout: Duration::from_millis(500),
        ..ServerLimits::default()
    });
    let mut slow = connect(srv.addr);
    slow.write_all(b"PUT /jails/web HTTP/1.1\r\nHost: t\r\nContent-Le")
        .expect("write");
    // Another client is served while the slow one holds its connection.
    let wire = exchange(
        srv.addr,
        b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert!(wire.starts_with("HTTP/1.1 200 "), "{wire:?}");
    let wire = read_until_closed(&mut slow);
    assert_json_error(&wire, 408);
    // The same applies to a body that stops arriving.
    let mut slow = connect(srv.addr);
    slow.write_all(b"PUT /jails/web HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
        .expect("write");
    assert_json_error(&read_until_closed(&mut slow), 408);
    assert_eq!(srv.calls.load(Ordering::SeqCst), 1);
}

/// A keep-alive connection whose request was answered as verified, with its
/// reader; it holds a slot no newcomer can evict.
fn verified_connection(addr: SocketAddr) -> (TcpStream, BufReader<TcpStream>) {
    let held = connect(addr);
    let mut w = held.try_clone().expect("clone");
    let mut r = BufReader::new(held);
    w.write_all(b"GET /a HTTP/1.1\r\nX-Verified: 1\r\n\r\n")
        .expect("write");
    assert_eq!(next_response(&mut r).status, 200);
    (w, r)
}

#[test]
fn connections_over_the_bound_get_503() {
    let srv = start_tcp(ServerLimits {
        max_connections: 1,
        ..ServerLimits::default()
    });
    // Only a verified connection holds its slot against a newcomer.
    let (w, r) = verified_connection(srv.addr);

    let mut extra = connect(srv.addr);
    let wire = read_until_closed(&mut extra);
    assert_json_error(&wire, 503);

    drop(w);
    drop(r);
    // The slot comes back once the server sees the held connection close.
    await_some("a free connection slot", || {
        let wire = exchange(srv.addr, b"GET /a HTTP/1.1\r\nConnection: close\r\n\r\n");
        wire.starts_with("HTTP/1.1 200 ").then_some(())
    });
}

#[test]
fn unauthenticated_connections_get_only_the_head_deadline() {
    let srv = start_tcp(ServerLimits {
        head_timeout: Duration::from_millis(300),
        ..ServerLimits::default()
    });
    let mut idle = connect(srv.addr);
    let mut slowloris = connect(srv.addr);
    slowloris
        .write_all(b"GET /a HTTP/1.1\r\nHost: x")
        .expect("write");
    let (mut verified_w, mut verified_r) = verified_connection(srv.addr);
    // Both are cut long before the 30 s idle and 10 s request timeouts.
    assert_eq!(
        read_until_closed(&mut idle),
        "",
        "an idle connection is closed quietly"
    );
    assert_json_error(&read_until_closed(&mut slowloris), 408);
    // The verified keep-alive connection outlived them: it keeps the idle timeout.
    verified_w
        .write_all(b"GET /b HTTP/1.1\r\n\r\n")
        .expect("write");
    let again = next_response(&mut verified_r);
    assert_eq!(again.status, 200);
    assert_eq!(json(&again)["path"], "/b");
}

#[test]
fn a_flood_of_unauthenticated_connections_cannot_lock_out_a_client() {
    let srv = start_tcp(ServerLimits {
        max_connections: 8,
        max_unauthenticated: 4,
        ..ServerLimits::default()
    });
    // Five times the budget, from this test's one address, all kept open.
    let mut flood: Vec<TcpStream> = (0..40).map(|_| connect(srv.addr)).collect();
    let wire = exchange(srv.addr, b"GET /a HTTP/1.1\r\nConnection: close\r\n\r\n");
    assert!(wire.starts_with("HTTP/1.1 200 "), "{wire:?}");
    // The server made room by evicting the oldest: they were closed without an answer.
    let evicted = flood
        .iter_mut()
        .take(36)
        .map(read_until_closed)
        .filter(String::is_empty)
        .count();
    assert_eq!(evicted, 36);
}

#[test]
fn the_unix_socket_has_a_budget_of_its_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("agentd.sock");
    let unix = bind_unix_socket(&path, 0o660, None).expect("bind");
    let tcp = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = tcp.local_addr().expect("addr");
    let shutdown = ShutdownSignal::new();
    let limits = ServerLimits {
        max_connections: 2,
        ..ServerLimits::default()
    };
    // One server for both listeners, as the agent builds it.
    let server = Server::new(
        echo(Arc::new(AtomicUsize::new(0))),
        limits,
        shutdown.clone(),
    );
    server.serve_tcp(tcp).expect("serve TCP");
    server.serve_unix(unix).expect("serve Unix");
    let _held: Vec<_> = (0..2).map(|_| verified_connection(addr)).collect();
    assert_json_error(&exchange(addr, b"GET /a HTTP/1.1\r\n\r\n"), 503);
    let resp = Client::new(Endpoint::Unix(path))
        .with_timeout(DEADLINE)
        .request("GET", "/jails", &[], b"")
        .expect("the Unix socket answers");
    assert_eq!(resp.status, 200);
    assert_eq!(json(&resp)["peer"], "unix");
    shutdown.trigger();
}

#[test]
fn shutdown_stops_the_accept_loop() {
    let mut srv = start_tcp(ServerLimits::default());
    let accept = srv.accept.take().expect("handle");
    srv.shutdown.trigger();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(accept.join().is_ok()));
    assert_eq!(rx.recv_timeout(DEADLINE), Ok(true));
    // Waited for: a child another test forks at this moment holds a copy of
    // the listening descriptor until its exec (see tests/proxy.rs).
    poll_until("the listener to close", || {
        TcpStream::connect(srv.addr).is_err()
    });
}

#[test]
fn client_round_trip_over_tcp() {
    let srv = start_tcp(ServerLimits::default());
    let client = Client::new(Endpoint::Tcp(srv.addr.to_string())).with_timeout(DEADLINE);
    let resp = client
        .request(
            "PUT",
            "/jails/web?dry=1",
            &[
                ("X-Token".into(), "abc".into()),
                // The client writes framing itself; a caller's copy is dropped.
                ("Content-Length".into(), "999".into()),
            ],
            b"kind: Jail\n",
        )
        .expect("request");
    assert_eq!(resp.status, 200);
    let v = json(&resp);
    assert_eq!(v["body"], "kind: Jail\n");
    assert_eq!(v["token"], "abc");
    assert_eq!(v["raw_path"], "/jails/web?dry=1");
    assert_eq!(
        v["peer"].as_str().map(|p| p.starts_with("127.0.0.1:")),
        Some(true)
    );

    let err = client
        .request("GET", "/a b", &[], b"")
        .expect_err("space in path");
    assert!(matches!(err, HttpError::InvalidRequest { .. }), "{err}");
    let err = client
        .request(
            "GET",
            "/a",
            &[("X-Evil".into(), "a\r\nInjected: 1".into())],
            b"",
        )
        .expect_err("CRLF in header");
    assert!(matches!(err, HttpError::InvalidRequest { .. }), "{err}");
}

#[test]
fn client_round_trip_over_unix_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("run/keel/agentd.sock");
    let listener = bind_unix_socket(&path, 0o660, None).expect("bind");
    let shutdown = ShutdownSignal::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let accept = Server::new(echo(calls), ServerLimits::default(), shutdown.clone())
        .serve_unix(listener)
        .expect("serve");
    let client = Client::new(Endpoint::Unix(path.clone())).with_timeout(DEADLINE);
    let resp = client
        .request("DELETE", "/jails/web", &[], b"")
        .expect("request");
    assert_eq!(resp.status, 200);
    assert_eq!(json(&resp)["peer"], "unix");
    assert_eq!(json(&resp)["method"], "DELETE");

    shutdown.trigger();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(accept.join().is_ok()));
    assert_eq!(rx.recv_timeout(DEADLINE), Ok(true));
}

#[test]
fn forward_relays_method_body_and_answer_unchanged() {
    // The "node": answers 409 with a body of its own.
    let node_listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let node_addr = node_listener.local_addr().expect("addr");
    let shutdown = ShutdownSignal::new();
    let node = move |req: Request| {
        Response::raw(
            409,
            vec![
                ("Content-Type".into(), "application/json".into()),
                (
                    "X-Seen".into(),
                    format!(
                        "{} {} {:?}",
                        req.method,
                        req.raw_path,
                        req.header("x-signature")
                    ),
                ),
            ],
            [b"node says: ".as_slice(), &req.body].concat(),
        )
    };
    Server::new(Arc::new(node), ServerLimits::default(), shutdown.clone())
        .serve_tcp(node_listener)
        .expect("serve node");
    // The "control plane": forwards /nodes/n1/jails/{name} to /jails/{name}.
    let cp_listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let cp_addr = cp_listener.local_addr().expect("addr");
    let cp = move |req: Request| {
        let path = format!("/{}", req.segments()[2..].join("/"));
        Client::new(Endpoint::Tcp(node_addr.to_string()))
            .forward(
                &OutgoingRequest::from(&req),
                &path,
                &[("X-Signature".into(), "node-key".into())],
            )
            .unwrap_or_else(|e| Response::error(503, &e.to_string(), None))
    };
    Server::new(Arc::new(cp), ServerLimits::default(), shutdown.clone())
        .serve_tcp(cp_listener)
        .expect("serve cp");

    let body = b"\x00\xffbinary \r\n body";
    let resp = Client::new(Endpoint::Tcp(cp_addr.to_string()))
        .request(
            "PUT",
            "/nodes/n1/jails/web?force=1",
            &[("X-Signature".into(), "operator-key".into())],
            body,
        )
        .expect("request");
    assert_eq!(resp.status, 409);
    assert_eq!(resp.body, [b"node says: ".as_slice(), body].concat());
    assert_eq!(
        resp.header("x-seen"),
        Some("PUT /jails/web?force=1 Some(\"node-key\")")
    );
    assert_eq!(resp.header("content-type"), Some("application/json"));
    shutdown.trigger();
}

#[test]
fn client_names_the_socket_and_the_daemon_when_nothing_listens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("agentd.sock");
    let err = Client::new(Endpoint::Unix(path.clone()))
        .request("GET", "/jails", &[], b"")
        .expect_err("nothing listens");
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!("cannot connect to {}: ", path.display())),
        "{msg}"
    );
    assert!(msg.ends_with("is keel-agentd running?"), "{msg}");
}

#[test]
fn stale_unix_socket_is_replaced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("agentd.sock");
    drop(UnixListener::bind(&path).expect("bind"));
    assert!(path.exists(), "a crashed daemon leaves its socket behind");
    let listener = bind_unix_socket(&path, 0o660, None).expect("stale socket replaced");
    let shutdown = ShutdownSignal::new();
    Server::new(
        echo(Arc::new(AtomicUsize::new(0))),
        ServerLimits::default(),
        shutdown.clone(),
    )
    .serve_unix(listener)
    .expect("serve");
    let resp = Client::new(Endpoint::Unix(path))
        .with_timeout(DEADLINE)
        .request("GET", "/healthz", &[], b"")
        .expect("the new socket answers");
    assert_eq!(resp.status, 200);
    shutdown.trigger();
}

#[test]
fn live_unix_socket_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("agentd.sock");
    let _live = bind_unix_socket(&path, 0o660, None).expect("first bind");
    let err = bind_unix_socket(&path, 0o660, None).expect_err("second bind");
    assert!(matches!(err, HttpError::SocketInUse { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "another keel-agentd is listening on {}; stop it first",
            path.display()
        )
    );
    assert!(path.exists(), "the live socket was left alone");
}

#[test]
fn non_socket_at_the_path_is_left_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("agentd.sock");
    std::fs::write(&path, "precious").expect("write");
    let err = bind_unix_socket(&path, 0o660, None).expect_err("not a socket");
    assert!(matches!(err, HttpError::NotASocket { .. }), "{err:?}");
    assert_eq!(std::fs::read_to_string(&path).expect("read"), "precious");
}

#[test]
fn socket_gets_its_mode_and_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("agentd.sock");
    let own_gid = std::fs::metadata(dir.path()).expect("meta").gid();
    let _l = bind_unix_socket(&path, 0o660, Some(&own_gid.to_string())).expect("bind");
    let meta = std::fs::metadata(&path).expect("meta");
    assert_eq!(meta.permissions().mode() & 0o7777, 0o660);
    assert_eq!(meta.gid(), own_gid);

    let err = bind_unix_socket(
        &dir.path().join("x.sock"),
        0o660,
        Some("no-such-group-keel"),
    )
    .expect_err("unknown group");
    assert!(matches!(err, HttpError::UnknownGroup { .. }), "{err:?}");
    assert!(
        !dir.path().join("x.sock").exists(),
        "nothing bound on error"
    );

    // Changing to a group we are not in needs root; as root it must happen.
    if meta.uid() == 0 {
        let other = dir.path().join("other.sock");
        let _l = bind_unix_socket(&other, 0o660, Some("4242")).expect("bind as root");
        assert_eq!(std::fs::metadata(&other).expect("meta").gid(), 4242);
    }
}
