//! The server: an accept loop per listener and a thread per connection.
//!
//! Owns connection lifecycle and request framing: keep-alive, the limits of
//! [`ServerLimits`], timeouts, and the JSON 4xx/5xx answers for requests it will
//! not hand to a handler. It must never block a handler's caller on another
//! connection and must never read a body it has already refused.
//!
//! Threads, not an event loop: these are control APIs with a handful of
//! concurrent clients, so a bounded thread per connection is simpler to reason
//! about than readiness polling. Each listener admits connections under its
//! own budget (so the agent's Unix socket never competes with its TCP
//! listener); `super::admission` says who gets a slot and who loses one:
//! on TCP a connection that has not yet sent a request the handler verified
//! is *unauthenticated*, has a per-address and a total share, and is evicted
//! (oldest first) to make room rather than a newcomer being refused; a
//! connection over the budget is answered 503 by the accept loop itself.
//!
//! Time limits, and why there are four:
//! - `head_timeout` (TCP, unauthenticated connections) bounds the time from
//!   connecting, or from the last answer, to a complete request head, so idle
//!   and slowloris connections give their slot back within seconds (408 when
//!   a partial head was sent, a quiet close otherwise);
//! - `idle_timeout` bounds the wait for the first byte of a request on a
//!   trusted connection (the Unix socket, or a keep-alive TCP connection whose
//!   last request was verified), so an idle keep-alive connection gives its
//!   slot back too;
//! - `read_timeout` bounds the *whole* request from its first byte, not each
//!   read, so a client dribbling one byte at a time (slowloris) is cut off too:
//!   it gets a 408 and the connection is closed;
//! - `write_timeout` bounds each write of the response to a client that stopped
//!   reading.
//!
//! A handler tells the server a request was verified by returning
//! [`Response::authenticated`]; the server itself only looks at whether a
//! head *claims* the `Keel-HMAC-SHA256` scheme, to keep the connection from
//! being evicted while its request is handled.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::admission::{Admission, Budget, Refused, Stage, Ticket};
use super::request::{Peer, split_target};
use super::{Conn, HttpError, Request, Response};
use crate::common::sync::lock;

/// Default bound on a request head (request line and header fields).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 16 * 1024;
/// Default bound on a request body, unless [`Handler::max_body_bytes`] says otherwise.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;
/// Default time allowed for one whole request, from its first byte.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time allowed for each write of a response.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time an idle trusted keep-alive connection is kept open.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default bound on concurrently open connections per listener.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Default bound on unauthenticated connections per TCP listener: three
/// quarters of [`DEFAULT_MAX_CONNECTIONS`], so a quarter stays for signed ones.
pub const DEFAULT_MAX_UNAUTHENTICATED: usize = 192;
/// Default bound on unauthenticated connections from one IP address.
pub const DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS: usize = 32;
/// Default time an unauthenticated TCP connection has to deliver a request
/// head; a real client sends it the moment it is connected.
pub const DEFAULT_HEAD_TIMEOUT: Duration = Duration::from_secs(3);
/// Most header fields in one request; more is answered 431.
pub const MAX_HEADER_FIELDS: usize = 64;

/// How much the server reads per call while collecting a request.
const READ_CHUNK: usize = 8 * 1024;
/// After refusing a request early (413, 431, ...) the server keeps reading and
/// discarding for at most this long and this much before closing: closing a
/// socket with unread input makes the kernel send a reset, which can destroy
/// the error response before the client has read it.
const LINGER_TIME: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 64 * 1024;
/// The authorization scheme of signed requests (`common::auth`); the server
/// only looks for it, so a connection whose request claims it is not evicted
/// while the handler checks it.
pub(crate) const SIGNATURE_SCHEME: &str = "Keel-HMAC-SHA256";
/// Bound on connecting to our own listener to wake its accept loop.
const WAKE_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Size and time limits of a [`Server`]; see the module docs for the timeouts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerLimits {
    /// Largest request head; more is answered 431.
    pub max_header_bytes: usize,
    /// Largest body unless the handler says otherwise; more is answered 413
    /// without reading the body.
    pub max_body_bytes: usize,
    /// Time allowed for one whole request from its first byte; then 408.
    pub read_timeout: Duration,
    /// Time allowed for each write of the response.
    pub write_timeout: Duration,
    /// Time an idle keep-alive connection waits for its next request when it
    /// is trusted (the Unix socket, or its last request was verified); an
    /// unauthenticated one gets [`ServerLimits::head_timeout`] instead.
    pub idle_timeout: Duration,
    /// Most connections open at once on each listener; a newcomer over it
    /// evicts the oldest unauthenticated connection (TCP), or is answered
    /// 503 when there is none.
    pub max_connections: usize,
    /// Most unauthenticated connections open at once on a TCP listener; a
    /// newcomer over it evicts the oldest one.
    pub max_unauthenticated: usize,
    /// Most unauthenticated connections from one IP address on a TCP
    /// listener; a newcomer over it evicts that address's oldest one.
    pub max_unauthenticated_per_address: usize,
    /// Time an unauthenticated TCP connection has, from connecting or from
    /// its last answer, to deliver a complete request head.
    pub head_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> ServerLimits {
        ServerLimits {
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            read_timeout: DEFAULT_READ_TIMEOUT,
            write_timeout: DEFAULT_WRITE_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_unauthenticated: DEFAULT_MAX_UNAUTHENTICATED,
            max_unauthenticated_per_address: DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS,
            head_timeout: DEFAULT_HEAD_TIMEOUT,
        }
    }
}

/// What answers requests: a daemon's route table.
pub trait Handler: Send + Sync + 'static {
    /// Answers one complete request. Runs on the connection's thread; a panic
    /// is caught and answered 500.
    fn handle(&self, req: Request) -> Response;

    /// The body limit for `method path` when a route needs another one than
    /// [`ServerLimits::max_body_bytes`]; asked before the body is read.
    fn max_body_bytes(&self, _method: &str, _path: &str) -> Option<usize> {
        None
    }
}

impl<F> Handler for F
where
    F: Fn(Request) -> Response + Send + Sync + 'static,
{
    fn handle(&self, req: Request) -> Response {
        self(req)
    }
}

/// Tells servers to stop accepting. Cheap to clone; one signal may stop
/// several listeners (the agent's Unix socket and TCP listener).
///
/// Accept loops block in `accept`, so [`ShutdownSignal::trigger`] wakes each
/// one by connecting to its listener. Connections already open finish their
/// current request and are then closed.
#[derive(Debug, Clone, Default)]
pub struct ShutdownSignal {
    inner: Arc<ShutdownInner>,
}

#[derive(Debug, Default)]
struct ShutdownInner {
    stopped: AtomicBool,
    wake: Mutex<Vec<WakeTarget>>,
}

#[derive(Debug, Clone)]
enum WakeTarget {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl ShutdownSignal {
    /// A signal not yet triggered.
    pub fn new() -> ShutdownSignal {
        ShutdownSignal::default()
    }

    /// Stops every server using this signal from accepting; idempotent.
    pub fn trigger(&self) {
        self.inner.stopped.store(true, Ordering::SeqCst);
        let targets = lock(&self.inner.wake).clone();
        for target in targets {
            // Failure means the listener is already gone, which is the goal.
            let _ = match target {
                WakeTarget::Tcp(addr) => {
                    TcpStream::connect_timeout(&addr, WAKE_CONNECT_TIMEOUT).map(drop)
                }
                WakeTarget::Unix(path) => UnixStream::connect(path).map(drop),
            };
        }
    }

    /// True once [`ShutdownSignal::trigger`] was called.
    pub fn is_triggered(&self) -> bool {
        self.inner.stopped.load(Ordering::SeqCst)
    }

    fn register(&self, target: WakeTarget) {
        lock(&self.inner.wake).push(target);
    }
}

/// A server: one handler and one set of limits for every listener it serves;
/// each listener admits connections under its own budget.
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
}

struct Shared {
    handler: Arc<dyn Handler>,
    limits: ServerLimits,
    shutdown: ShutdownSignal,
}

impl Server {
    /// A server answering with `handler` under `limits` until `shutdown`.
    pub fn new(
        handler: Arc<dyn Handler>,
        limits: ServerLimits,
        shutdown: ShutdownSignal,
    ) -> Server {
        Server {
            shared: Arc::new(Shared {
                handler,
                limits,
                shutdown,
            }),
        }
    }

    /// Serves an already-bound TCP listener on a new thread; the handle
    /// finishes once the shutdown signal stops the accept loop.
    pub fn serve_tcp(&self, listener: TcpListener) -> Result<JoinHandle<()>, HttpError> {
        let addr = listener.local_addr().map_err(|source| HttpError::Listen {
            listener: "a TCP listener".into(),
            source,
        })?;
        // An unspecified address accepts on loopback too, which is where we can reach it.
        let wake = match addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => {
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port())
            }
            IpAddr::V6(ip) if ip.is_unspecified() => {
                SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), addr.port())
            }
            _ => addr,
        };
        self.shared.shutdown.register(WakeTarget::Tcp(wake));
        let limits = &self.shared.limits;
        let budget = Budget {
            max_connections: limits.max_connections,
            max_unauthenticated: limits.max_unauthenticated,
            max_unauthenticated_per_address: limits.max_unauthenticated_per_address,
            trusts_every_peer: false,
        };
        self.spawn_accept_loop(format!("TCP {addr}"), budget, move || {
            listener
                .accept()
                .map(|(stream, peer)| (stream, Peer::Tcp(peer)))
        })
    }

    /// Serves an already-bound Unix listener (see [`super::bind_unix_socket`])
    /// on a new thread; the handle finishes once the shutdown signal stops the
    /// accept loop. Peers are [`Peer::Unix`], trusted on arrival (the socket's
    /// mode and group guard it): only [`ServerLimits::max_connections`]
    /// applies, on a budget of the socket's own.
    pub fn serve_unix(&self, listener: UnixListener) -> Result<JoinHandle<()>, HttpError> {
        let path = listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(PathBuf::from));
        let name = match &path {
            Some(p) => format!("Unix socket {}", p.display()),
            None => "an unnamed Unix socket".to_string(),
        };
        // An unnamed socket cannot be woken: it stops at its next connection.
        if let Some(p) = path {
            self.shared.shutdown.register(WakeTarget::Unix(p));
        }
        let budget = Budget {
            max_connections: self.shared.limits.max_connections,
            max_unauthenticated: self.shared.limits.max_connections,
            max_unauthenticated_per_address: self.shared.limits.max_connections,
            trusts_every_peer: true,
        };
        self.spawn_accept_loop(name, budget, move || {
            listener.accept().map(|(stream, _)| (stream, Peer::Unix))
        })
    }

    fn spawn_accept_loop<S, A>(
        &self,
        name: String,
        budget: Budget,
        accept: A,
    ) -> Result<JoinHandle<()>, HttpError>
    where
        S: Conn,
        A: Fn() -> io::Result<(S, Peer)> + Send + 'static,
    {
        let shared = Arc::clone(&self.shared);
        let admission = Admission::new(budget);
        thread::Builder::new()
            .name("keel-http-accept".into())
            .spawn(move || accept_loop(&shared, &admission, accept))
            .map_err(|source| HttpError::Listen {
                listener: name,
                source,
            })
    }
}

fn accept_loop<S, A>(shared: &Arc<Shared>, admission: &Arc<Admission>, accept: A)
where
    S: Conn,
    A: Fn() -> io::Result<(S, Peer)>,
{
    while !shared.shutdown.is_triggered() {
        let (stream, peer) = match accept() {
            Ok(conn) => conn,
            Err(e) => {
                // Out of descriptors or similar: back off instead of spinning;
                // the condition clears as connections close.
                if e.kind() != io::ErrorKind::Interrupted {
                    thread::sleep(Duration::from_millis(50));
                }
                continue;
            }
        };
        if shared.shutdown.is_triggered() {
            break;
        }
        let accepted = Instant::now();
        // Without a handle to unblock it, a connection could not be evicted;
        // the descriptor table is full then, and the client may retry.
        let Ok(evictor) = stream.evictor() else {
            continue;
        };
        let ticket = match admission.admit(peer, evictor) {
            Ok(ticket) => ticket,
            Err(Refused::Full) => {
                refuse_busy(stream);
                continue;
            }
        };
        let shared = Arc::clone(shared);
        let spawned = thread::Builder::new()
            .name("keel-http-conn".into())
            .spawn(move || serve_connection(stream, peer, &ticket, accepted, &shared));
        // A failed spawn drops the closure, its stream and its ticket: the
        // client sees the connection closed and may retry.
        drop(spawned);
    }
}

/// Answers 503 from the accept loop without ever blocking it: the socket is
/// fresh, so the small response fits its send buffer in one non-blocking write.
fn refuse_busy<S: Conn>(mut stream: S) {
    if stream.set_nonblocking(true).is_err() {
        return;
    }
    let resp = Response::error(
        503,
        "too many open connections to this server; retry shortly",
        None,
    );
    let _ = stream.write_all(&resp.to_bytes(true, false, false));
    stream.shutdown_write();
    // Drain what already arrived so the close is not a reset that destroys the 503.
    let mut sink = [0u8; READ_CHUNK];
    while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
}

/// Why reading a request stopped without one.
enum ReadFailure {
    /// The client closed or went idle between requests: close quietly.
    Gone,
    /// An unauthenticated connection did not deliver a head in time
    /// (`partial`: it had sent some of one): close, answering 408 if partial.
    HeadTimeout { partial: bool },
    /// Answer this and close.
    Refuse(u16, String),
}

fn refuse(status: u16, message: impl Into<String>) -> ReadFailure {
    ReadFailure::Refuse(status, message.into())
}

/// A parsed request head, before the body is read.
struct Head {
    method: String,
    target: String,
    http10: bool,
    headers: Vec<(String, String)>,
    len: usize,
}

fn serve_connection<S: Conn>(
    mut stream: S,
    peer: Peer,
    ticket: &Ticket,
    accepted: Instant,
    shared: &Shared,
) {
    let limits = &shared.limits;
    // Accepted sockets may inherit non-blocking mode from the listener (FreeBSD).
    if stream.set_nonblocking(false).is_err()
        || stream
            .set_write_timeout(Some(limits.write_timeout))
            .is_err()
    {
        return;
    }
    let mut buf: Vec<u8> = Vec::new();
    // When the wait for the next request began: connecting, then each answer.
    let mut turn_started = accepted;
    loop {
        let waits = match ticket.stage() {
            Stage::Evicted => return,
            Stage::Trusted | Stage::Claimed => Waits {
                first_byte: Instant::now() + limits.idle_timeout,
                head: None,
            },
            Stage::Unauthenticated => {
                let head = turn_started + limits.head_timeout;
                Waits {
                    first_byte: head,
                    head: Some(head),
                }
            }
        };
        let (req, close, keep_alive_header) = match read_request(
            &mut stream,
            &mut buf,
            peer,
            waits,
            shared,
        ) {
            Ok(r) => r,
            Err(ReadFailure::Gone) => return,
            Err(ReadFailure::HeadTimeout { partial }) => {
                let secs = limits.head_timeout.as_secs_f64();
                ticket.note(&peer, || {
                    format!(
                        "closed a connection that sent {} within {secs} s",
                        if partial {
                            "only part of a request head"
                        } else {
                            "no request"
                        }
                    )
                });
                if partial {
                    let message = format!(
                        "no complete request head within {secs}s; a client must send its request \
                         as soon as the connection is open"
                    );
                    let resp = Response::error(408, &message, None);
                    let _ = stream.write_all(&resp.to_bytes(true, false, false));
                }
                stream.shutdown_write();
                return;
            }
            Err(ReadFailure::Refuse(status, message)) => {
                let resp = Response::error(status, &message, None);
                let _ = stream.write_all(&resp.to_bytes(true, false, false));
                stream.shutdown_write();
                // A timed-out client is not sending; anything else may be
                // mid-upload of what we refused.
                if status != 408 {
                    linger(&mut stream);
                }
                return;
            }
        };
        // An evicted connection's request is dropped unanswered: its slot
        // already went to another connection.
        if claims_signature(&req.headers) && !ticket.claim() {
            return;
        }
        let head_only = req.method == "HEAD";
        let handler = Arc::clone(&shared.handler);
        let resp = catch_unwind(AssertUnwindSafe(|| handler.handle(req))).unwrap_or_else(|_| {
            Response::error(500, "internal error: the request handler panicked", None)
        });
        ticket.answered(resp.is_authenticated());
        let close = close || shared.shutdown.is_triggered();
        if stream
            .write_all(&resp.to_bytes(close, keep_alive_header, head_only))
            .is_err()
            || close
        {
            stream.shutdown_write();
            return;
        }
        turn_started = Instant::now();
    }
}

/// True when a head carries an `Authorization` field of the Keel scheme; the
/// handler decides whether it is valid.
fn claims_signature(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(name, value)| {
        name.eq_ignore_ascii_case("authorization")
            && value
                .split_ascii_whitespace()
                .next()
                .is_some_and(|scheme| scheme == SIGNATURE_SCHEME)
    })
}

/// Reads and discards input for a bounded time and size; see [`LINGER_TIME`].
fn linger<S: Conn>(stream: &mut S) {
    let deadline = Instant::now() + LINGER_TIME;
    let mut drained = 0;
    let mut sink = [0u8; READ_CHUNK];
    while drained < LINGER_BYTES {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => return,
            Ok(n) => drained += n,
        }
    }
}

/// Reads more input into `buf`, waiting at most until `deadline`.
/// `Ok(false)` means the peer closed.
fn fill<S: Conn>(stream: &mut S, buf: &mut Vec<u8>, deadline: Instant) -> io::Result<bool> {
    let mut chunk = [0u8; READ_CHUNK];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut chunk) {
            Ok(0) => return Ok(false),
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                return Ok(true);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// How long [`read_request`] waits.
#[derive(Debug, Clone, Copy)]
struct Waits {
    /// For the first byte of the request; a quiet close after it.
    first_byte: Instant,
    /// For the complete head, when the connection is unauthenticated.
    head: Option<Instant>,
}

/// Reads one request. Returns it with whether to close after answering and
/// whether the answer must say `Connection: keep-alive` (HTTP/1.0).
/// Bytes after the request (a pipelined next one) stay in `buf`.
fn read_request<S: Conn>(
    stream: &mut S,
    buf: &mut Vec<u8>,
    peer: Peer,
    waits: Waits,
    shared: &Shared,
) -> Result<(Request, bool, bool), ReadFailure> {
    let limits = &shared.limits;
    if buf.is_empty() {
        match fill(stream, buf, waits.first_byte) {
            Ok(true) => {}
            Err(e) if timed_out(&e) && waits.head.is_some() => {
                return Err(ReadFailure::HeadTimeout { partial: false });
            }
            Ok(false) | Err(_) => return Err(ReadFailure::Gone),
        }
    }
    let deadline = Instant::now() + limits.read_timeout;
    let timeout_msg = || {
        refuse(
            408,
            format!(
                "the request was not complete within {}s",
                limits.read_timeout.as_secs_f64()
            ),
        )
    };
    let head_deadline = waits.head.map_or(deadline, |h| h.min(deadline));
    let head = loop {
        if let Some(head) = parse_head(buf, limits.max_header_bytes)? {
            break head;
        }
        match fill(stream, buf, head_deadline) {
            Ok(true) => {}
            Ok(false) => return Err(ReadFailure::Gone),
            Err(e) if timed_out(&e) && head_deadline < deadline => {
                return Err(ReadFailure::HeadTimeout { partial: true });
            }
            Err(e) if timed_out(&e) => return Err(timeout_msg()),
            Err(_) => return Err(ReadFailure::Gone),
        }
    };
    let checked = check_head(&head, |method, path| {
        shared
            .handler
            .max_body_bytes(method, path)
            .unwrap_or(limits.max_body_bytes)
    })?;
    let Checked {
        path,
        query,
        content_length,
        close,
        keep_alive_header,
        expects_continue,
    } = checked;
    // Only now, with the body accepted, invite the client to send it.
    if expects_continue
        && content_length > buf.len() - head.len
        && stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").is_err()
    {
        return Err(ReadFailure::Gone);
    }
    let end = head.len + content_length;
    while buf.len() < end {
        match fill(stream, buf, deadline) {
            Ok(true) => {}
            Ok(false) => return Err(ReadFailure::Gone),
            Err(e) if timed_out(&e) => return Err(timeout_msg()),
            Err(_) => return Err(ReadFailure::Gone),
        }
    }
    let body = buf[head.len..end].to_vec();
    buf.drain(..end);
    let req = Request {
        method: head.method,
        path,
        raw_path: head.target,
        query,
        headers: head.headers,
        body,
        peer,
    };
    Ok((req, close, keep_alive_header))
}

/// Parses the head at the start of `buf`: `Ok(None)` when more bytes are needed.
fn parse_head(buf: &[u8], max_header_bytes: usize) -> Result<Option<Head>, ReadFailure> {
    let too_large = || {
        refuse(
            431,
            format!(
                "the request head exceeds {max_header_bytes} bytes or {MAX_HEADER_FIELDS} fields"
            ),
        )
    };
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADER_FIELDS];
    let mut parsed = httparse::Request::new(&mut fields);
    let len = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() > max_header_bytes => return Err(too_large()),
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(too_large()),
        Err(e) => return Err(refuse(400, format!("malformed request: {e}"))),
    };
    if len > max_header_bytes {
        return Err(too_large());
    }
    let (Some(method), Some(target), Some(version)) = (parsed.method, parsed.path, parsed.version)
    else {
        return Err(refuse(400, "malformed request line"));
    };
    let mut headers = Vec::with_capacity(parsed.headers.len());
    for h in parsed.headers.iter() {
        let value = std::str::from_utf8(h.value)
            .map_err(|_| refuse(400, format!("header {} is not valid UTF-8", h.name)))?;
        headers.push((h.name.to_string(), value.trim().to_string()));
    }
    Ok(Some(Head {
        method: method.to_string(),
        target: target.to_string(),
        http10: version == 0,
        headers,
        len,
    }))
}

/// What the checks after parsing decided about a request head.
struct Checked {
    path: String,
    query: Option<String>,
    content_length: usize,
    close: bool,
    keep_alive_header: bool,
    expects_continue: bool,
}

/// The checks every parsed head goes through before its body is read: the
/// target, the framing, the body limit (`max_body` for a method and path),
/// keep-alive and `Expect`.
fn check_head(head: &Head, max_body: impl Fn(&str, &str) -> usize) -> Result<Checked, ReadFailure> {
    let (path, query) = split_target(&head.target).map_err(|m| refuse(400, m))?;
    let content_length = body_length(&head.headers)?;
    let max_body = max_body(&head.method, &path);
    if content_length > max_body {
        return Err(refuse(
            413,
            format!("the body is {content_length} bytes; this route accepts at most {max_body}"),
        ));
    }
    let tokens = connection_tokens(&head.headers);
    let (close, keep_alive_header) = if head.http10 {
        let keep = tokens.iter().any(|t| t == "keep-alive");
        (!keep, keep)
    } else {
        (tokens.iter().any(|t| t == "close"), false)
    };
    let expects_continue = match header(&head.headers, "expect") {
        None => false,
        Some(v) if v.eq_ignore_ascii_case("100-continue") => true,
        Some(v) => return Err(refuse(417, format!("unsupported expectation {v:?}"))),
    };
    Ok(Checked {
        path,
        query,
        content_length,
        close,
        keep_alive_header,
        expects_continue,
    })
}

/// The fuzzing entry point (`fuzz/fuzz_targets/http_request.rs`): frames the
/// first request in `buf` exactly as a connection does, with the same head
/// parser and the same checks, but without a socket, a handler or timeouts.
///
/// `Ok(None)` means `buf` does not yet hold a whole request (a connection
/// would read more); `Err((status, message))` is the 4xx the server would
/// answer before closing; `Ok(Some(request))` is what a handler would get,
/// with `peer` set to [`Peer::Buffer`]. The body limit is
/// `limits.max_body_bytes` for every route.
pub fn parse_request_head(
    buf: &[u8],
    limits: &ServerLimits,
) -> Result<Option<Request>, (u16, String)> {
    let as_pair = |f: ReadFailure| match f {
        ReadFailure::Refuse(status, message) => (status, message),
        ReadFailure::Gone | ReadFailure::HeadTimeout { .. } => {
            (400, "the request was abandoned".to_string())
        }
    };
    let Some(head) = parse_head(buf, limits.max_header_bytes).map_err(as_pair)? else {
        return Ok(None);
    };
    let checked = check_head(&head, |_, _| limits.max_body_bytes).map_err(as_pair)?;
    let Some(end) = head.len.checked_add(checked.content_length) else {
        return Ok(None);
    };
    let Some(body) = buf.get(head.len..end) else {
        return Ok(None);
    };
    Ok(Some(Request {
        method: head.method,
        path: checked.path,
        raw_path: head.target,
        query: checked.query,
        headers: head.headers,
        body: body.to_vec(),
        peer: Peer::Buffer,
    }))
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// The body length from `Content-Length`, refusing every other framing and
/// every ambiguity: two framings are how requests get smuggled past proxies.
fn body_length(headers: &[(String, String)]) -> Result<usize, ReadFailure> {
    if header(headers, "transfer-encoding").is_some() {
        return Err(refuse(
            411,
            "Transfer-Encoding is not supported; send the body with a Content-Length",
        ));
    }
    let mut lengths = headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("content-length"));
    let Some((_, value)) = lengths.next() else {
        return Ok(0);
    };
    if lengths.next().is_some() {
        return Err(refuse(400, "more than one Content-Length header"));
    }
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(refuse(400, format!("invalid Content-Length {value:?}")));
    }
    // Only an absurd number of digits overflows; it is too large either way.
    Ok(value.parse().unwrap_or(usize::MAX))
}

/// The lower-cased tokens of every `Connection` header.
fn connection_tokens(headers: &[(String, String)]) -> Vec<String> {
    headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("connection"))
        .flat_map(|(_, v)| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(value: &str) -> Vec<(String, String)> {
        vec![("Authorization".to_string(), value.to_string())]
    }

    #[test]
    fn the_scheme_looked_for_is_the_one_auth_signs_with() {
        assert_eq!(SIGNATURE_SCHEME, crate::common::auth::SCHEME);
    }

    #[test]
    fn only_the_keel_scheme_claims_a_signature() {
        assert!(claims_signature(&auth("Keel-HMAC-SHA256 key=a, ts=1")));
        assert!(claims_signature(&[(
            "authorization".to_string(),
            "Keel-HMAC-SHA256\tkey=a".to_string()
        )]));
        assert!(!claims_signature(&auth("Basic dXNlcjpwYXNz")));
        assert!(!claims_signature(&auth("keel-hmac-sha256 key=a")));
        assert!(!claims_signature(&auth("Keel-HMAC-SHA256x key=a")));
        assert!(!claims_signature(&auth("")));
        assert!(!claims_signature(&[(
            "X-Authorization".to_string(),
            "Keel-HMAC-SHA256 key=a".to_string()
        )]));
    }
}
