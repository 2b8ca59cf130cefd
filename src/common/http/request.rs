//! A received request, and the checks that turn a parsed request head into one.
//!
//! Owns the request-target rules (see the module docs of [`super`]): what reaches
//! a handler has a path that is safe to split on `/` and compare with route
//! names. It must never decode percent-escapes: refusing them is the rule.

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
    /// `"unix"` for the Unix socket, else the peer's `ip:port`.
    pub peer: String,
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
            peer: "unix".into(),
        };
        assert_eq!(req.segments(), ["jails", "web"]);
        assert_eq!(req.header("content-type"), Some("a"));
        assert_eq!(req.header("host"), None);
    }
}
