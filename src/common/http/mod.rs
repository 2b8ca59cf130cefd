//! The HTTP/1.1 both daemons speak: a small synchronous server over `httparse`
//! and a minimal client, with no async runtime.
//!
//! This module owns framing and hygiene only: reading a request within size and
//! time limits, keep-alive, refusing what it cannot frame safely, and writing
//! responses. It must never know a route, a spec or a signing key: handlers get
//! a complete [`Request`] and return a [`Response`]; routing, authentication and
//! bodies belong to `agentd`, `controlplane` and `ctl`. The server knows the
//! name of the signature scheme only, to tell a connection whose request claims
//! a signature from one that does not; a handler says it verified one with
//! [`Response::authenticated`].
//!
//! - [`server`]: [`Server`] serves an already-bound TCP or Unix listener with a
//!   thread per connection; `admission` gives each listener its own budget
//!   of connections ([`ServerLimits::max_connections`]) with a share
//!   reserved for signed requests.
//! - [`client`]: [`Client`] sends one request per connection to an
//!   [`Endpoint`]; [`Client::forward`] relays an [`OutgoingRequest`] (a
//!   received [`Request`] converted, or one of the daemon's own) to another
//!   daemon with its body untouched (the control plane's byte-for-byte forwarding).
//! - [`failover`]: [`failover::Failover`] sends to whichever of several
//!   endpoints (a cluster's control planes) takes the connection, never
//!   repeating a request that reached one.
//! - [`socket`]: [`bind_unix_socket`] creates the agent's socket with its mode and
//!   group, replacing a stale socket and refusing to steal a live one.
//!
//! What the server accepts, on purpose narrower than HTTP allows:
//! - bodies framed by `Content-Length` only; `Transfer-Encoding` is refused (411)
//!   because no Keel client needs it and two framings invite request smuggling;
//! - request targets in origin form (`/jails/web?x=y`) whose path uses only
//!   unreserved characters, sub-delimiters, `:`, `@` and `/`, with no `.` or `..`
//!   segment. Every route name in Keel is a DNS label, so a path never needs
//!   percent-encoding, and refusing `%` outright closes every encoded-traversal
//!   trick (`%2e%2e`, `%2f`, `%00`) without a decoder to get wrong.
//!   [`Request::path`] is therefore the raw path, already safe to split.
//! - every error the server itself produces has a JSON body `{"error": "..."}`.

mod admission;
pub mod client;
pub mod failover;
pub mod request;
pub mod response;
pub mod server;
pub mod socket;

pub use client::{Client, ClientResponse, Endpoint, OutgoingRequest, read_response};
pub use request::{Peer, Request};
pub use response::Response;
pub use server::{Handler, Server, ServerLimits, ShutdownSignal, parse_request_head};
pub use socket::bind_unix_socket;

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

/// What went wrong binding a socket, starting a server, or talking to a peer.
#[derive(Debug)]
pub enum HttpError {
    /// The client could not connect to the endpoint.
    Connect {
        /// The endpoint, as the user configured it.
        endpoint: String,
        /// The operating system's reason.
        source: io::Error,
    },
    /// Writing the request failed (or timed out).
    Send {
        /// The endpoint the request was for.
        endpoint: String,
        /// The operating system's reason.
        source: io::Error,
    },
    /// Reading the response failed (or timed out).
    Receive {
        /// The endpoint the response was expected from.
        endpoint: String,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The peer answered something that is not a response Keel can frame.
    MalformedResponse {
        /// The endpoint that answered.
        endpoint: String,
        /// What was wrong with it.
        reason: String,
    },
    /// The caller asked to send something that cannot be written as HTTP/1.1
    /// (a method that is not a token, a path or header value with CR/LF, ...).
    InvalidRequest {
        /// What was wrong with it.
        reason: String,
    },
    /// A live server already listens on the Unix socket path.
    SocketInUse {
        /// The socket path.
        path: PathBuf,
    },
    /// Something exists at the socket path that is not a socket.
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// Preparing the Unix socket failed at one step.
    Socket {
        /// The socket path.
        path: PathBuf,
        /// The step that failed: "create the parent directory of", "bind", ...
        action: &'static str,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The socket's group is neither a name in `/etc/group` nor a number.
    UnknownGroup {
        /// The group as configured.
        group: String,
    },
    /// The server could not prepare its listener or start its accept thread.
    Listen {
        /// The listener, as a human would name it.
        listener: String,
        /// The operating system's reason.
        source: io::Error,
    },
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

impl fmt::Display for HttpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HttpError::Connect { endpoint, source } => {
                write!(f, "cannot connect to {endpoint}: {source}; ")?;
                // The only Unix socket in Keel is the agent's, so the hint can name it.
                let unix = endpoint.starts_with('/');
                match (source.kind(), unix) {
                    (io::ErrorKind::PermissionDenied, _) => write!(
                        f,
                        "is your user in the socket's group (the socket is mode 0660)?"
                    ),
                    (_, true) => write!(f, "is keel-agentd running?"),
                    (_, false) => write!(f, "is the daemon running and reachable there?"),
                }
            }
            HttpError::Send { endpoint, source } if is_timeout(source) => {
                write!(f, "timed out sending the request to {endpoint}")
            }
            HttpError::Send { endpoint, source } => {
                write!(f, "sending the request to {endpoint} failed: {source}")
            }
            HttpError::Receive { endpoint, source } if is_timeout(source) => write!(
                f,
                "timed out waiting for the response from {endpoint}; it may be overloaded or stuck"
            ),
            HttpError::Receive { endpoint, source } => {
                write!(f, "reading the response from {endpoint} failed: {source}")
            }
            HttpError::MalformedResponse { endpoint, reason } => {
                write!(f, "{endpoint} sent a malformed HTTP response: {reason}")
            }
            HttpError::InvalidRequest { reason } => {
                write!(f, "cannot send this request: {reason}")
            }
            HttpError::SocketInUse { path } => write!(
                f,
                "another keel-agentd is listening on {}; stop it first",
                path.display()
            ),
            HttpError::NotASocket { path } => write!(
                f,
                "{} exists and is not a socket; refusing to replace it, move it away or \
                 configure another socket path",
                path.display()
            ),
            HttpError::Socket {
                path,
                action,
                source,
            } => write!(f, "cannot {action} {}: {source}", path.display()),
            HttpError::UnknownGroup { group } => write!(
                f,
                "socket group {group:?} is not in /etc/group and is not a numeric gid"
            ),
            HttpError::Listen { listener, source } => {
                write!(f, "cannot serve {listener}: {source}")
            }
        }
    }
}

impl std::error::Error for HttpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HttpError::Connect { source, .. }
            | HttpError::Send { source, .. }
            | HttpError::Receive { source, .. }
            | HttpError::Socket { source, .. }
            | HttpError::Listen { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Headers the framing layer writes itself, or that only mean something to
/// the next hop, on both requests and responses. Any copy supplied by a caller
/// (or relayed from a peer) is dropped, so a message can never carry two
/// framings, a stale connection directive, or an `Expect` the client will not
/// wait for.
pub(crate) fn is_managed_header(name: &str) -> bool {
    [
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "host",
        "expect",
        "te",
        "trailer",
        "upgrade",
    ]
    .iter()
    .any(|m| name.eq_ignore_ascii_case(m))
}

/// An HTTP token (RFC 9110 section 5.6.2): method and header names.
pub(crate) fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// A stream the server and client can drive: TCP or Unix, with timeouts.
pub(crate) trait Conn: Read + Write + Send + 'static {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()>;
    fn shutdown_write(&self);
    /// A handle that shuts both directions of this connection down from
    /// another thread (a clone of the socket), which unblocks a read.
    fn evictor(&self) -> io::Result<admission::Evictor>;
}

impl Conn for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, timeout)
    }
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        TcpStream::set_nonblocking(self, nonblocking)
    }
    fn shutdown_write(&self) {
        // The peer may already be gone; there is nothing left to do then.
        let _ = self.shutdown(Shutdown::Write);
    }
    fn evictor(&self) -> io::Result<admission::Evictor> {
        let clone = self.try_clone()?;
        Ok(Box::new(move || {
            let _ = clone.shutdown(Shutdown::Both);
        }))
    }
}

impl Conn for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_write_timeout(self, timeout)
    }
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        UnixStream::set_nonblocking(self, nonblocking)
    }
    fn shutdown_write(&self) {
        let _ = self.shutdown(Shutdown::Write);
    }
    fn evictor(&self) -> io::Result<admission::Evictor> {
        let clone = self.try_clone()?;
        Ok(Box::new(move || {
            let _ = clone.shutdown(Shutdown::Both);
        }))
    }
}
