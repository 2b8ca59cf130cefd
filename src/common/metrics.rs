//! Prometheus metrics both daemons share: the text exposition writer their
//! `/metrics` bodies are built with, and the plain, read-only listener
//! `metrics_listen` opens (`agent.metrics_listen`,
//! `controlplane.metrics_listen`).
//!
//! Owns the exposition format (HELP and TYPE lines, label escaping,
//! histograms, the one `Content-Type`) and the listener's route table and
//! admission limits. It must never know what a daemon measures: each daemon
//! hands [`MetricsHandler`] a [`Render`] that builds its text from what its
//! worker published, so a scrape never waits behind the worker queue for long
//! (the agent reads snapshots; the control plane bounds its wait and answers
//! 503 when the worker is busy).
//!
//! The listener is unauthenticated on purpose (Prometheus does not sign its
//! requests), which is why it is off by default, serves nothing but
//! `GET /metrics`, and should be bound to an internal address, as
//! node_exporter is. Its connections are admitted on a budget of their own
//! ([`listener_limits`]): a few connections in all and two per address, so
//! one host cannot lock out another scraper, and nothing on it competes with
//! the daemon's API listeners.

use std::fmt::{Display, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::common::http::{
    Handler, HttpError, Request, Response, Server, ServerLimits, ShutdownSignal,
};

/// The one `Content-Type` of every `/metrics` answer: the text format,
/// version 0.0.4.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Most connections the metrics listener keeps open at once.
pub const MAX_CONNECTIONS: usize = 8;
/// Most connections the metrics listener keeps open from one IP address: a
/// newcomer over it evicts that address's oldest connection, never another
/// host's.
pub const MAX_CONNECTIONS_PER_ADDRESS: usize = 2;

/// The metrics listener's limits: small requests, short deadlines, and a
/// budget of [`MAX_CONNECTIONS`], at most [`MAX_CONNECTIONS_PER_ADDRESS`]
/// from one address (every connection there is unauthenticated, so the
/// per-address share bounds each host).
pub fn listener_limits() -> ServerLimits {
    ServerLimits {
        max_header_bytes: 8 * 1024,
        max_body_bytes: 0,
        read_timeout: Duration::from_secs(5),
        write_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(30),
        max_connections: MAX_CONNECTIONS,
        max_unauthenticated: MAX_CONNECTIONS,
        max_unauthenticated_per_address: MAX_CONNECTIONS_PER_ADDRESS,
        head_timeout: Duration::from_secs(3),
    }
}

/// Why a daemon could not render its metrics now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unavailable {
    /// The worker did not answer in time (answered 503, the next scrape may
    /// succeed).
    Busy(String),
    /// The worker has stopped; the daemon is about to exit.
    Gone(String),
}

impl Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unavailable::Busy(why) | Unavailable::Gone(why) => f.write_str(why),
        }
    }
}

/// Builds a daemon's exposition text; see the module docs.
pub trait Render: Send + Sync + 'static {
    /// The whole `/metrics` body.
    fn render(&self) -> Result<String, Unavailable>;
}

/// A 200 with `text` and the one metrics `Content-Type`.
pub fn response(text: String) -> Response {
    Response::raw(
        200,
        vec![("Content-Type".into(), CONTENT_TYPE.into())],
        text.into_bytes(),
    )
}

/// The `/metrics` answer for a render: the text, or 503 saying why not.
pub fn answer(rendered: Result<String, Unavailable>) -> Response {
    match rendered {
        Ok(text) => response(text),
        Err(why) => Response::error(503, &why.to_string(), None),
    }
}

/// The metrics listener's route table: `GET /metrics` and nothing else
/// (other paths 404, other methods 405 with `Allow: GET`).
pub struct MetricsHandler<R> {
    render: R,
}

impl<R: Render> MetricsHandler<R> {
    /// Answers `GET /metrics` with `render`.
    pub fn new(render: R) -> MetricsHandler<R> {
        MetricsHandler { render }
    }
}

impl<R: Render> Handler for MetricsHandler<R> {
    fn handle(&self, req: Request) -> Response {
        match (req.method.as_str(), req.segments().as_slice()) {
            ("GET", ["metrics"]) => answer(self.render.render()),
            (_, ["metrics"]) => Response::error(
                405,
                &format!("{} is not allowed on /metrics; use GET", req.method),
                None,
            )
            .with_header("Allow", "GET"),
            _ => Response::error(
                404,
                &format!(
                    "no route for {} {}: this listener serves GET /metrics only",
                    req.method, req.path
                ),
                None,
            ),
        }
    }
}

/// Binds the metrics listener on `addr`; `key` (e.g. `agent.metrics_listen`)
/// names it in the error. A daemon binds before it starts anything, so a
/// taken port leaves nothing behind.
pub fn bind(key: &str, addr: SocketAddr) -> Result<TcpListener, ListenError> {
    TcpListener::bind(addr).map_err(|source| ListenError {
        key: key.to_string(),
        addr,
        source: source.to_string(),
    })
}

/// Serves `render` on `listener` (from [`bind`]) with [`listener_limits`]
/// until `shutdown`; returns the accept loop's thread.
pub fn serve(
    listener: TcpListener,
    render: impl Render,
    shutdown: ShutdownSignal,
) -> Result<JoinHandle<()>, HttpError> {
    let server = Server::new(
        Arc::new(MetricsHandler::new(render)),
        listener_limits(),
        shutdown,
    );
    server.serve_tcp(listener)
}

/// The metrics listener could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenError {
    /// The keel.toml key of the address (`agent.metrics_listen`, ...).
    pub key: String,
    /// The address.
    pub addr: SocketAddr,
    /// The operating system's reason.
    pub source: String,
}

impl Display for ListenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cannot listen on {} {}: {}; it must be an address of this host and a free port",
            self.key, self.addr, self.source
        )
    }
}

impl std::error::Error for ListenError {}

/// What a metric family is, for its `# TYPE` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A value that goes up and down.
    Gauge,
    /// A monotonic count (its name ends in `_total`).
    Counter,
    /// Cumulative buckets, a sum and a count ([`Histogram`]).
    Histogram,
}

/// A label value escaped as the text format requires: `\` as `\\`, `"` as
/// `\"` and a newline as `\n`.
pub fn escape_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// The text exposition, family by family: [`Exposition::family`] writes the
/// HELP and TYPE lines, then [`Exposition::sample`] each sample of it.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    /// An empty exposition.
    pub fn new() -> Exposition {
        Exposition::default()
    }

    /// Starts family `name` of `kind`; `help` is one line of plain text.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) {
        let kind = match kind {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
            Kind::Histogram => "histogram",
        };
        // HELP escapes `\` and newlines; help texts are ours and have neither.
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        // Writing to a String cannot fail.
        let _ = write!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}\n");
    }

    /// One sample of the current family: `name{labels} value`, the label
    /// values escaped.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl Display) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (label, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{label}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }

    /// A whole family with one unlabelled sample.
    pub fn single(&mut self, name: &str, kind: Kind, help: &str, value: impl Display) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }

    /// Appends text already in the exposition format (another part's families).
    pub fn push_text(&mut self, text: &str) {
        self.out.push_str(text);
    }

    /// The text.
    pub fn finish(self) -> String {
        self.out
    }
}

/// A histogram of seconds with fixed upper bounds (cumulative when written).
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket, not cumulative: `counts[i]` fell in
    /// `(bounds[i-1], bounds[i]]`; the last slot is above every bound.
    counts: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Histogram {
    /// An empty histogram with these bucket upper bounds (ascending).
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            count: 0,
            sum: 0.0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, took: Duration) {
        let secs = took.as_secs_f64();
        let slot = self
            .bounds
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[slot] += 1;
        self.count += 1;
        self.sum += secs;
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Writes the `_bucket`, `_sum` and `_count` samples of family `name`
    /// (already started with [`Exposition::family`]), with `labels` on each.
    pub fn write(&self, exp: &mut Exposition, name: &str, labels: &[(&str, &str)]) {
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        let bounds: Vec<String> = self.bounds.iter().map(f64::to_string).collect();
        for (le, count) in bounds.iter().zip(&self.counts) {
            cumulative += count;
            let mut with_le = labels.to_vec();
            with_le.push(("le", le));
            exp.sample(&bucket, &with_le, cumulative);
        }
        let mut with_le = labels.to_vec();
        with_le.push(("le", "+Inf"));
        exp.sample(&bucket, &with_le, self.count);
        exp.sample(&format!("{name}_sum"), labels, self.sum);
        exp.sample(&format!("{name}_count"), labels, self.count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::http::Peer;

    #[test]
    fn label_values_escape_backslash_quote_and_newline() {
        assert_eq!(escape_label("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
        let mut exp = Exposition::new();
        exp.family("keel_x", Kind::Gauge, "X.");
        exp.sample("keel_x", &[("jail", "we\"b"), ("state", "Running")], 1);
        assert_eq!(
            exp.finish(),
            "# HELP keel_x X.\n# TYPE keel_x gauge\nkeel_x{jail=\"we\\\"b\",state=\"Running\"} 1\n"
        );
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_end_with_inf() {
        static BOUNDS: [f64; 2] = [0.01, 1.0];
        let mut h = Histogram::new(&BOUNDS);
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_millis(500));
        h.observe(Duration::from_secs(3));
        let mut exp = Exposition::new();
        h.write(&mut exp, "keel_d_seconds", &[("route", "/x")]);
        let text = exp.finish();
        assert!(
            text.contains("keel_d_seconds_bucket{route=\"/x\",le=\"0.01\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("keel_d_seconds_bucket{route=\"/x\",le=\"1\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("keel_d_seconds_bucket{route=\"/x\",le=\"+Inf\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("keel_d_seconds_count{route=\"/x\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("keel_d_seconds_sum{route=\"/x\"} 3.505\n"),
            "{text}"
        );
    }

    struct Fixed(Result<String, Unavailable>);

    impl Render for Fixed {
        fn render(&self) -> Result<String, Unavailable> {
            self.0.clone()
        }
    }

    fn request(method: &str, path: &str) -> Request {
        Request::for_test(method, path, b"", Peer::Buffer)
    }

    #[test]
    fn the_listener_serves_get_metrics_only_with_one_content_type() {
        let handler = MetricsHandler::new(Fixed(Ok("keel_up 1\n".into())));
        let ok = handler.handle(request("GET", "/metrics"));
        assert_eq!((ok.status, ok.body.as_slice()), (200, &b"keel_up 1\n"[..]));
        let types: Vec<_> = ok
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("content-type"))
            .collect();
        assert_eq!(types.len(), 1, "{:?}", ok.headers);
        assert_eq!(ok.header("Content-Type"), Some(CONTENT_TYPE));

        let post = handler.handle(request("POST", "/metrics"));
        assert_eq!((post.status, post.header("Allow")), (405, Some("GET")));
        assert_eq!(handler.handle(request("GET", "/jails")).status, 404);
        assert_eq!(handler.handle(request("GET", "/healthz")).status, 404);
    }

    #[test]
    fn a_render_that_cannot_answer_is_a_503_saying_why() {
        let handler = MetricsHandler::new(Fixed(Err(Unavailable::Busy("worker busy".into()))));
        let busy = handler.handle(request("GET", "/metrics"));
        assert_eq!(busy.status, 503);
        assert!(String::from_utf8_lossy(&busy.body).contains("worker busy"));
    }
}
