//! A received request, and the checks that turn a parsed request head into one.
//!
//! Owns the request-target rules (see the module docs of [`super`]): what reaches
//! a handler has a path that is safe to split on `/` and compare with route
//! names. It must never decode percent-escapes: refusing them is the rule.
//!
//! Who sent a request is a [`Peer`], set by the server from the listener the
//! connection came in on and never from anything the client wrote: the agent
//! trusts the Unix socket (its file permissions are the guard) and wants a
//! signature from everything else, and that decision is a `match` on the
//! variant, so a new kind of peer cannot be trusted by accident. A request
//! this process *sends* is a different type, [`super::OutgoingRequest`]: it
//! has no peer, and a received request cannot be passed where one is expected.

use std::fmt;
use std::net::SocketAddr;

/// Where a received request came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// The daemon's Unix socket: a local user its file mode and group let in.
    Unix,
    /// A TCP connection from this address.
    Tcp(SocketAddr),
    /// No connection at all: a request framed from a byte buffer by
    /// [`super::parse_request_head`] (the fuzzing entry point). Its own
    /// variant rather than `Unix`, so it can never be mistaken for a trusted
    /// local peer; treat it like TCP.
    Buffer,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Unix => write!(f, "unix"),
            Peer::Tcp(addr) => write!(f, "{addr}"),
            Peer::Buffer => write!(f, "buffer"),
        }
    }
}

/// One complete request: head and body, as handed to a [`super::Handler`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The method as sent (`GET`, `PUT`, ...); methods are case-sensitive.
    pub method: String,
    /// The path without the query, e.g. `/jails/web`. Validated: only
    /// unreserved characters, sub-delimiters, `:`, `@` and `/`, no `.` or `..`
    /// segments, so it needs no decoding.
    pub path: String,
    /// The request target exactly as sent, query included.
    pub raw_path: String,
    /// The query after `?`, undecoded, when there was one.
    pub query: Option<String>,
    /// Header fields in the order received, names as sent.
    pub headers: Vec<(String, String)>,
    /// The body (`Content-Length` bytes; empty when there was none).
    pub body: Vec<u8>,
    /// Who sent it, from the listener it arrived on.
    pub peer: Peer,
}

#[cfg(test)]
impl Request {
    /// A request as a handler gets it, without a query or headers, from
    /// `peer`: for the route tables' unit tests.
    pub(crate) fn for_test(method: &str, path: &str, body: &[u8], peer: Peer) -> Request {
        Request {
            method: method.into(),
            path: path.into(),
            raw_path: path.into(),
            query: None,
            headers: Vec::new(),
            body: body.to_vec(),
            peer,
        }
    }
}

impl Request {
    /// The first header field named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The path's non-empty segments: `/jails/web/` gives `["jails", "web"]`
    /// and `/` gives `[]`, so routes match with or without a trailing slash.
    pub fn segments(&self) -> Vec<&str> {
        self.path.split('/').filter(|s| !s.is_empty()).collect()
    }
}

/// Splits a request target into a validated path and its query, or says in
/// one line why the target is refused (the text of a 400).
pub(crate) fn split_target(target: &str) -> Result<(String, Option<String>), String> {
    if !target.starts_with('/') {
        return Err(format!(
            "request target {target:?} must be a path starting with /, such as /jails/web"
        ));
    }
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q.to_string())),
        None => (target, None),
    };
    if path.contains('%') {
        return Err(
            "percent-encoded paths are refused: Keel route names are DNS labels and never \
             need encoding"
                .to_string(),
        );
    }
    if let Some(bad) = path.chars().find(|c| !is_path_char(*c)) {
        return Err(format!("character {bad:?} is not allowed in a path"));
    }
    if path.split('/').any(|s| s == "." || s == "..") {
        return Err("paths with . or .. segments are refused".to_string());
    }
    if let Some(q) = &query {
        if q.chars().any(|c| c.is_control()) {
            return Err("control characters are not allowed in a query".to_string());
        }
    }
    Ok((path.to_string(), query))
}

/// RFC 3986 `pchar` without `%` (pct-encoded), plus the `/` separator.
fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "-._~!$&'()*+,;=:@/".contains(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_paths_and_queries_split() {
        assert_eq!(
            split_target("/jails/web-1?watch=1"),
            Ok(("/jails/web-1".to_string(), Some("watch=1".to_string())))
        );
        assert_eq!(split_target("/"), Ok(("/".to_string(), None)));
    }

    #[test]
    fn traversal_and_encodings_are_refused() {
        for bad in [
            "/jails/../etc",
            "/jails/..",
            "/./jails",
            "/jails/%2e%2e",
            "/jails/%2E%2E/x",
            "/jails%2fweb",
            "/jails/web%00",
            "/jails/a\\b",
            "/jails/a#b",
            "jails/web",
            "*",
            "http://example.com/jails",
        ] {
            assert!(split_target(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn dots_inside_names_are_fine() {
        assert!(split_target("/ingresses/www.example.com").is_ok());
        assert!(split_target("/x/...").is_ok());
    }

    #[test]
    fn segments_ignore_empty_ones() {
        let req = Request {
            method: "GET".into(),
            path: "/jails/web/".into(),
            raw_path: "/jails/web/".into(),
            query: None,
            headers: vec![("Content-Type".into(), "a".into())],
            body: vec![],
            peer: Peer::Unix,
        };
        assert_eq!(req.segments(), ["jails", "web"]);
        assert_eq!(req.header("content-type"), Some("a"));
        assert_eq!(req.header("host"), None);
    }
}
