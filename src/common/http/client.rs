//! The client: one request per connection to a Keel daemon, Unix or TCP.
//!
//! Owns writing a request and framing the response. It must never interpret a
//! body: `keelctl` decodes what it asked for, and the control plane relays
//! node answers through [`Client::forward`] with bodies untouched.
//!
//! One connection per request keeps the client stateless (no pool to go
//! stale while an agent restarts); every request says `Connection: close`.

use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use super::{Conn, HttpError, Request, Response, is_managed_header, is_token};

/// Default bound on connecting, and on each read and write of one exchange.
/// Generous because an apply is reconciled before the agent answers.
pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest response head the client accepts.
pub const MAX_RESPONSE_HEAD_BYTES: usize = 64 * 1024;
/// Largest response body the client accepts (a `GET /jails` of a big node
/// is far below this; anything larger is a broken peer).
pub const MAX_RESPONSE_BODY_BYTES: usize = 64 * 1024 * 1024;
/// Most header fields in one response.
const MAX_RESPONSE_FIELDS: usize = 64;

/// Where a daemon listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A Unix socket path (the agent's local API).
    Unix(PathBuf),
    /// `host:port` over TCP (control plane, or an agent's advertised address).
    Tcp(String),
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// A response as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientResponse {
    /// The status code.
    pub status: u16,
    /// Header fields in the order received.
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

impl ClientResponse {
    /// The first header field named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

impl From<ClientResponse> for Response {
    /// The peer's answer, to relay: status, end-to-end headers and body
    /// unchanged; framing headers are the relaying server's own.
    fn from(r: ClientResponse) -> Response {
        let headers = r
            .headers
            .into_iter()
            .filter(|(n, _)| !is_managed_header(n))
            .collect();
        Response::raw(r.status, headers, r.body)
    }
}

/// A request this process sends, as [`Client::forward`] relays it: method,
/// query, end-to-end headers and body. A different type from a received
/// [`Request`] on purpose: it has no peer, so nothing the daemon builds for
/// itself can pose as something a client sent, and relaying a received
/// request is an explicit conversion ([`OutgoingRequest::from`]) that keeps
/// what goes on the wire and drops who sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingRequest {
    /// The method (`GET`, `PUT`, ...).
    pub method: String,
    /// The query, without `?`, appended to the path it is sent to.
    pub query: Option<String>,
    /// End-to-end header fields; framing headers are written by the client.
    pub headers: Vec<(String, String)>,
    /// The body, sent byte for byte.
    pub body: Vec<u8>,
}

impl OutgoingRequest {
    /// A request of this process's own: no header fields yet.
    pub fn new(method: &str, query: Option<String>, body: &[u8]) -> OutgoingRequest {
        OutgoingRequest {
            method: method.to_string(),
            query,
            headers: Vec::new(),
            body: body.to_vec(),
        }
    }
}

impl From<&Request> for OutgoingRequest {
    /// A received request, to relay: method, query, headers and body as they
    /// arrived; the peer stays behind.
    fn from(req: &Request) -> OutgoingRequest {
        OutgoingRequest {
            method: req.method.clone(),
            query: req.query.clone(),
            headers: req.headers.clone(),
            body: req.body.clone(),
        }
    }
}

/// A client for one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Client {
    /// Where requests go.
    pub endpoint: Endpoint,
    /// Bound on connecting and on each read and write.
    pub timeout: Duration,
}

impl Client {
    /// A client for `endpoint` with [`DEFAULT_CLIENT_TIMEOUT`].
    pub fn new(endpoint: Endpoint) -> Client {
        Client {
            endpoint,
            timeout: DEFAULT_CLIENT_TIMEOUT,
        }
    }

    /// The same client with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Client {
        self.timeout = timeout;
        self
    }

    /// Sends one request and reads its response. `path` is the request target
    /// (query included); `Host`, `Content-Length`, `Connection` and the other
    /// hop-by-hop headers are written by the client and ignored in `headers`.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<ClientResponse, HttpError> {
        let wire = self.encode(method, path, headers, body)?;
        let endpoint = self.endpoint.to_string();
        let mut stream = self.connect()?;
        let io_setup = stream
            .set_read_timeout(Some(self.timeout))
            .and_then(|()| stream.set_write_timeout(Some(self.timeout)));
        if let Err(source) = io_setup {
            return Err(HttpError::Connect { endpoint, source });
        }
        stream
            .write_all(&wire)
            .and_then(|()| stream.flush())
            .map_err(|source| HttpError::Send {
                endpoint: endpoint.clone(),
                source,
            })?;
        let mut reader = BufReader::new(stream);
        read_response(&mut reader, &endpoint, method == "HEAD")
    }

    /// Relays `req` to this client's endpoint at `path` (the node-side path,
    /// e.g. `/jails/web` for `/nodes/n1/jails/web`; the original query is
    /// appended) and returns the answer ready to send back. The method and
    /// body go unchanged, as do end-to-end headers except those named in
    /// `replace`, which are sent instead (e.g. the relaying daemon's own
    /// request signature).
    pub fn forward(
        &self,
        req: &OutgoingRequest,
        path: &str,
        replace: &[(String, String)],
    ) -> Result<Response, HttpError> {
        let target = match &req.query {
            Some(q) => format!("{path}?{q}"),
            None => path.to_string(),
        };
        let mut headers: Vec<(String, String)> = req
            .headers
            .iter()
            .filter(|(n, _)| !replace.iter().any(|(r, _)| r.eq_ignore_ascii_case(n)))
            .cloned()
            .collect();
        headers.extend_from_slice(replace);
        self.request(&req.method, &target, &headers, &req.body)
            .map(Response::from)
    }

    fn encode(
        &self,
        method: &str,
        path: &str,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<Vec<u8>, HttpError> {
        let invalid = |reason: String| HttpError::InvalidRequest { reason };
        if !is_token(method) {
            return Err(invalid(format!("{method:?} is not an HTTP method")));
        }
        if !path.starts_with('/') || path.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err(invalid(format!(
                "{path:?} is not a request path (it must start with / and contain no \
                 spaces or control characters)"
            )));
        }
        let host = match &self.endpoint {
            Endpoint::Unix(_) => "localhost",
            Endpoint::Tcp(addr) => addr.as_str(),
        };
        let mut out = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\n");
        for (name, value) in headers {
            if is_managed_header(name) {
                continue;
            }
            if !is_token(name) || value.contains(['\r', '\n']) {
                return Err(invalid(format!("header {name:?} cannot be sent as given")));
            }
            out.push_str(&format!("{name}: {value}\r\n"));
        }
        out.push_str(&format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        ));
        let mut wire = out.into_bytes();
        wire.extend_from_slice(body);
        Ok(wire)
    }

    fn connect(&self) -> Result<Box<dyn Conn>, HttpError> {
        let endpoint = self.endpoint.to_string();
        match &self.endpoint {
            Endpoint::Unix(path) => UnixStream::connect(path)
                .map(|s| Box::new(s) as Box<dyn Conn>)
                .map_err(|source| HttpError::Connect { endpoint, source }),
            Endpoint::Tcp(addr) => {
                let addrs = addr
                    .to_socket_addrs()
                    .map_err(|source| HttpError::Connect {
                        endpoint: endpoint.clone(),
                        source,
                    })?;
                let mut last = std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "the name resolved to no address",
                );
                for a in addrs {
                    match TcpStream::connect_timeout(&a, self.timeout) {
                        Ok(s) => return Ok(Box::new(s)),
                        Err(e) => last = e,
                    }
                }
                Err(HttpError::Connect {
                    endpoint,
                    source: last,
                })
            }
        }
    }
}

/// Reads exactly one response from `reader`, consuming nothing after it (so a
/// keep-alive stream can be read again). `endpoint` names the peer in errors;
/// `request_was_head` says the response has no body whatever its
/// `Content-Length`. Interim `1xx` responses are skipped. A response without
/// `Content-Length` runs to end of stream; chunked responses are refused
/// (Keel servers never send them).
pub fn read_response(
    reader: &mut impl BufRead,
    endpoint: &str,
    request_was_head: bool,
) -> Result<ClientResponse, HttpError> {
    let malformed = |reason: String| HttpError::MalformedResponse {
        endpoint: endpoint.to_string(),
        reason,
    };
    let receive = |source| HttpError::Receive {
        endpoint: endpoint.to_string(),
        source,
    };
    loop {
        let head = read_head(reader, endpoint)?;
        let mut fields = [httparse::EMPTY_HEADER; MAX_RESPONSE_FIELDS];
        let mut parsed = httparse::Response::new(&mut fields);
        match parsed.parse(&head) {
            Ok(httparse::Status::Complete(_)) => {}
            Ok(httparse::Status::Partial) => return Err(malformed("incomplete head".into())),
            Err(e) => return Err(malformed(e.to_string())),
        }
        let status = parsed.code.unwrap_or(0);
        let headers: Vec<(String, String)> = parsed
            .headers
            .iter()
            .map(|h| {
                (
                    h.name.to_string(),
                    String::from_utf8_lossy(h.value).trim().to_string(),
                )
            })
            .collect();
        if (100..200).contains(&status) {
            continue;
        }
        let find = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        };
        if find("transfer-encoding").is_some() {
            return Err(malformed(
                "Transfer-Encoding responses are not supported".into(),
            ));
        }
        let mut body = Vec::new();
        if !(request_was_head || status == 204 || status == 304) {
            match find("content-length") {
                Some(v) => {
                    let len: usize = v
                        .parse()
                        .map_err(|_| malformed(format!("invalid Content-Length {v:?}")))?;
                    if len > MAX_RESPONSE_BODY_BYTES {
                        return Err(malformed(format!(
                            "the body is {len} bytes, more than the {MAX_RESPONSE_BODY_BYTES} accepted"
                        )));
                    }
                    body.resize(len, 0);
                    reader.read_exact(&mut body).map_err(receive)?;
                }
                None => {
                    let limit = MAX_RESPONSE_BODY_BYTES as u64 + 1;
                    reader.take(limit).read_to_end(&mut body).map_err(receive)?;
                    if body.len() > MAX_RESPONSE_BODY_BYTES {
                        return Err(malformed(format!(
                            "the body exceeds the {MAX_RESPONSE_BODY_BYTES} bytes accepted"
                        )));
                    }
                }
            }
        }
        return Ok(ClientResponse {
            status,
            headers,
            body,
        });
    }
}

/// The bytes of one head, through its blank line, consuming nothing more.
fn read_head(reader: &mut impl BufRead, endpoint: &str) -> Result<Vec<u8>, HttpError> {
    let mut head: Vec<u8> = Vec::new();
    loop {
        let avail = reader.fill_buf().map_err(|source| HttpError::Receive {
            endpoint: endpoint.to_string(),
            source,
        })?;
        if avail.is_empty() {
            return Err(HttpError::MalformedResponse {
                endpoint: endpoint.to_string(),
                reason: if head.is_empty() {
                    "the connection closed without a response".into()
                } else {
                    "the connection closed in the middle of the response head".into()
                },
            });
        }
        let before = head.len();
        head.extend_from_slice(avail);
        let from = before.saturating_sub(3);
        if let Some(pos) = head[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            let end = from + pos + 4;
            head.truncate(end);
            reader.consume(end - before);
            return Ok(head);
        }
        let n = avail.len();
        reader.consume(n);
        if head.len() > MAX_RESPONSE_HEAD_BYTES {
            return Err(HttpError::MalformedResponse {
                endpoint: endpoint.to_string(),
                reason: format!("the head exceeds {MAX_RESPONSE_HEAD_BYTES} bytes"),
            });
        }
    }
}
