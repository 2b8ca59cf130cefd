//! Responses: what handlers build, and how the server writes one on the wire.
//!
//! Owns the JSON error body shape `{"error": "...", "field": "..."}` every Keel
//! error uses. It must never write framing headers a handler supplied
//! (`Content-Length`, `Connection`, ...): the writer derives them, so a relayed
//! response cannot smuggle a second framing.

use serde::Serialize;

use super::is_managed_header;

/// A response a handler returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// End-to-end header fields; framing headers are written by the server and
    /// any copy here is ignored.
    pub headers: Vec<(String, String)>,
    /// The body; `Content-Length` is its length.
    pub body: Vec<u8>,
    /// The handler verified the request's signature ([`Response::authenticated`]);
    /// never written on the wire.
    authenticated: bool,
}

/// The JSON body of every error response.
#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
}

impl Response {
    /// `value` as JSON with `Content-Type: application/json`. A value that
    /// cannot be serialised (a map with non-string keys) is a bug in the
    /// caller; it becomes a 500 naming the serde error rather than a panic.
    pub fn json(status: u16, value: &impl Serialize) -> Response {
        match serde_json::to_vec(value) {
            Ok(body) => Response::raw(
                status,
                vec![("Content-Type".into(), "application/json".into())],
                body,
            ),
            Err(e) => Response::error(
                500,
                &format!("cannot encode the response as JSON: {e}"),
                None,
            ),
        }
    }

    /// Plain UTF-8 text.
    pub fn text(status: u16, text: impl Into<String>) -> Response {
        Response::raw(
            status,
            vec![("Content-Type".into(), "text/plain; charset=utf-8".into())],
            text.into().into_bytes(),
        )
    }

    /// `{"error": message}`, with `"field"` (e.g. `spec.network.address`) when
    /// the error is about one field of the request.
    pub fn error(status: u16, message: &str, field: Option<&str>) -> Response {
        Response::json(
            status,
            &ErrorBody {
                error: message,
                field,
            },
        )
    }

    /// Status, headers and body exactly as given (for relaying a peer's answer).
    pub fn raw(status: u16, headers: Vec<(String, String)>, body: Vec<u8>) -> Response {
        Response {
            status,
            headers,
            body,
            authenticated: false,
        }
    }

    /// The same response, marked as the answer to a request whose signature
    /// the handler verified. The server then treats the connection as a
    /// signed client's: it keeps the long idle timeout and cannot be evicted
    /// by unauthenticated newcomers. Nothing of it goes on the wire.
    pub fn authenticated(mut self) -> Response {
        self.authenticated = true;
        self
    }

    /// True when [`Response::authenticated`] marked this response.
    pub fn is_authenticated(&self) -> bool {
        self.authenticated
    }

    /// Adds one header field (e.g. a Prometheus `Content-Type`).
    pub fn with_header(mut self, name: &str, value: &str) -> Response {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// The first header field named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The bytes on the wire. `keep_alive_header` adds `Connection: keep-alive`
    /// (an HTTP/1.0 client that asked for it), `close` adds `Connection: close`;
    /// `head` leaves the body out while keeping its `Content-Length`. Header
    /// values with CR or LF are dropped so a handler cannot split the response.
    pub(crate) fn to_bytes(&self, close: bool, keep_alive_header: bool, head: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(128 + self.body.len());
        out.extend_from_slice(
            format!("HTTP/1.1 {} {}\r\n", self.status, reason(self.status)).as_bytes(),
        );
        for (name, value) in &self.headers {
            if is_managed_header(name) || !super::is_token(name) || value.contains(['\r', '\n']) {
                continue;
            }
            out.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
        }
        // RFC 9110 section 8.6: no Content-Length (and no body) on 1xx and 204.
        let bodiless = self.status < 200 || self.status == 204;
        if !bodiless {
            out.extend_from_slice(format!("Content-Length: {}\r\n", self.body.len()).as_bytes());
        }
        if close {
            out.extend_from_slice(b"Connection: close\r\n");
        } else if keep_alive_header {
            out.extend_from_slice(b"Connection: keep-alive\r\n");
        }
        out.extend_from_slice(b"\r\n");
        if !head && !bodiless && self.status != 304 {
            out.extend_from_slice(&self.body);
        }
        out
    }
}

/// The reason phrase for the statuses Keel uses; clients must not depend on it.
fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        417 => "Expectation Failed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_names_the_field_only_when_given() {
        let r = Response::error(400, "bad address", Some("spec.network.address"));
        assert_eq!(
            String::from_utf8_lossy(&r.body),
            r#"{"error":"bad address","field":"spec.network.address"}"#
        );
        let r = Response::error(404, "no jail web", None);
        assert_eq!(
            String::from_utf8_lossy(&r.body),
            r#"{"error":"no jail web"}"#
        );
        assert_eq!(r.header("content-type"), Some("application/json"));
    }

    #[test]
    fn writer_owns_framing_headers() {
        let r = Response::raw(
            200,
            vec![
                ("Content-Length".into(), "999".into()),
                ("Transfer-Encoding".into(), "chunked".into()),
                ("X-Split".into(), "a\r\nSet-Cookie: x".into()),
                ("X-Keel".into(), "1".into()),
            ],
            b"hi".to_vec(),
        );
        let wire = String::from_utf8(r.to_bytes(true, false, false)).expect("utf-8");
        assert_eq!(
            wire,
            "HTTP/1.1 200 OK\r\nX-Keel: 1\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi"
        );
        let head = String::from_utf8(r.to_bytes(false, true, true)).expect("utf-8");
        assert!(head.ends_with("Content-Length: 2\r\nConnection: keep-alive\r\n\r\n"));
        let none = Response::raw(204, vec![], b"ignored".to_vec());
        let wire = String::from_utf8(none.to_bytes(false, false, false)).expect("utf-8");
        assert_eq!(wire, "HTTP/1.1 204 No Content\r\n\r\n");
    }
}
