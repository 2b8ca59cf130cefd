//! The control plane's Prometheus metrics: nodes (liveness, committed
//! resources), services (desired, ready and updated replicas, template
//! revision), and the API's requests
//! by route, status class and latency.
//!
//! Owns [`RequestStats`] and [`Metered`], the wrapper around the API handler
//! that counts each request under its route *pattern*
//! (`/nodes/{id}/heartbeat`, never the raw path, so the number of series is
//! bounded by the route table and not by what clients send), and the render
//! both `/metrics` routes answer with (the signed one on the API and the
//! plain listener of `controlplane.metrics_listen`).
//!
//! It never waits behind the worker for long: nodes and services are asked
//! of the worker with a bound of [`METRICS_WAIT`], and a worker that does not
//! answer in time (a long group commit) makes the scrape a 503, never a
//! hanging connection. Request counts are kept here, off the worker, behind
//! one short lock per request.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::http::{Handler, Request, Response};
use crate::common::metrics::{self, Exposition, Histogram, Kind, Render, Unavailable};
use crate::common::supervise::HEALTH_WAIT;
use crate::common::sync::lock;
use crate::common::wire::{Liveness, NodeStatus, ServiceStatus};
use crate::controlplane::worker::{WorkerGone, WorkerHandle};

/// Longest a scrape waits for the worker's nodes and services.
pub const METRICS_WAIT: Duration = HEALTH_WAIT;

/// Upper bounds of the request latency buckets, in seconds: from a
/// heartbeat's milliseconds to a forwarded apply's `FORWARD_TIMEOUT`.
const LATENCY_BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 120.0,
];

/// The route pattern of a request path, as the API's route table names it;
/// `other` for a path no route has (a 404).
pub fn route_pattern(segments: &[&str]) -> &'static str {
    match segments {
        ["healthz"] => "/healthz",
        ["metrics"] => "/metrics",
        ["version"] => "/version",
        ["nodes"] => "/nodes",
        ["nodes", "register"] => "/nodes/register",
        ["nodes", _] => "/nodes/{id}",
        ["nodes", _, "heartbeat"] => "/nodes/{id}/heartbeat",
        ["nodes", _, "endpoints"] => "/nodes/{id}/endpoints",
        ["nodes", _, "cordon"] => "/nodes/{id}/cordon",
        ["nodes", _, "uncordon"] => "/nodes/{id}/uncordon",
        ["nodes", _, "jails"] => "/nodes/{id}/jails",
        ["nodes", _, "jails", _] => "/nodes/{id}/jails/{name}",
        ["nodes", _, "jails", _, "log"] => "/nodes/{id}/jails/{name}/log",
        ["nodes", _, "jails", _, "document"] => "/nodes/{id}/jails/{name}/document",
        ["nodes", _, "volumes"] => "/nodes/{id}/volumes",
        ["nodes", _, "volumes", _] => "/nodes/{id}/volumes/{name}",
        ["nodes", _, "ingresses"] => "/nodes/{id}/ingresses",
        ["nodes", _, "ingresses", _] => "/nodes/{id}/ingresses/{name}",
        ["nodes", _, "ingresses", _, "document"] => "/nodes/{id}/ingresses/{name}/document",
        ["nodes", _, "bases"] => "/nodes/{id}/bases",
        ["nodes", _, "bases", _] => "/nodes/{id}/bases/{release}",
        ["jails", _] => "/jails/{name}",
        ["jails", _, "log"] => "/jails/{name}/log",
        ["jails", _, "document"] => "/jails/{name}/document",
        ["volumes"] => "/volumes",
        ["volumes", _] => "/volumes/{name}",
        ["services"] => "/services",
        ["services", _] => "/services/{name}",
        ["services", _, "scale"] => "/services/{name}/scale",
        ["services", _, "undo"] => "/services/{name}/undo",
        ["services", _, "revisions"] => "/services/{name}/revisions",
        ["services", _, "document"] => "/services/{name}/document",
        ["jails", _, "dry-run"] => "/jails/{name}/dry-run",
        ["jails", _, "diff"] => "/jails/{name}/diff",
        ["nodes", _, "jails", _, "dry-run"] => "/nodes/{id}/jails/{name}/dry-run",
        ["nodes", _, "jails", _, "diff"] => "/nodes/{id}/jails/{name}/diff",
        ["services", _, "diff"] => "/services/{name}/diff",
        ["events"] => "/events",
        _ => "other",
    }
}

/// `2xx` for 204, and so on.
fn status_class(status: u16) -> &'static str {
    match status / 100 {
        1 => "1xx",
        2 => "2xx",
        3 => "3xx",
        4 => "4xx",
        _ => "5xx",
    }
}

/// One route's counts.
#[derive(Debug, Clone)]
struct RouteStats {
    by_class: BTreeMap<&'static str, u64>,
    latency: Histogram,
}

/// Requests by route pattern: counts by status class and a latency histogram.
#[derive(Debug, Default)]
pub struct RequestStats {
    routes: Mutex<BTreeMap<&'static str, RouteStats>>,
}

impl RequestStats {
    /// Counts one answered request.
    pub fn record(&self, route: &'static str, status: u16, took: Duration) {
        let mut routes = lock(&self.routes);
        let stats = routes.entry(route).or_insert_with(|| RouteStats {
            by_class: BTreeMap::new(),
            latency: Histogram::new(&LATENCY_BUCKETS),
        });
        *stats.by_class.entry(status_class(status)).or_default() += 1;
        stats.latency.observe(took);
    }

    fn write(&self, exp: &mut Exposition) {
        let routes = lock(&self.routes).clone();
        exp.family(
            "keel_controlplane_requests_total",
            Kind::Counter,
            "API requests answered, by route pattern and status class.",
        );
        for (route, stats) in &routes {
            for (class, n) in &stats.by_class {
                exp.sample(
                    "keel_controlplane_requests_total",
                    &[("route", route), ("code", class)],
                    n,
                );
            }
        }
        exp.family(
            "keel_controlplane_request_duration_seconds",
            Kind::Histogram,
            "Time from a complete request to its answer, by route pattern.",
        );
        for (route, stats) in &routes {
            stats.latency.write(
                exp,
                "keel_controlplane_request_duration_seconds",
                &[("route", route)],
            );
        }
    }
}

/// The API handler with every request counted in [`RequestStats`]; see the
/// module docs.
pub struct Metered<H> {
    inner: Arc<H>,
    stats: Arc<RequestStats>,
}

impl<H: Handler> Metered<H> {
    /// Counts what `inner` answers in `stats`.
    pub fn new(inner: Arc<H>, stats: Arc<RequestStats>) -> Metered<H> {
        Metered { inner, stats }
    }
}

impl<H: Handler> Handler for Metered<H> {
    fn handle(&self, req: Request) -> Response {
        let route = route_pattern(&req.segments());
        let started = Instant::now();
        let response = self.inner.handle(req);
        self.stats.record(route, response.status, started.elapsed());
        response
    }

    fn max_body_bytes(&self, method: &str, path: &str) -> Option<usize> {
        self.inner.max_body_bytes(method, path)
    }
}

/// The control plane's exposition from the worker's nodes and services and
/// the request counts.
pub fn render(nodes: &[NodeStatus], services: &[ServiceStatus], requests: &RequestStats) -> String {
    let mut exp = Exposition::new();
    let alive = nodes.iter().filter(|n| n.status == Liveness::Alive).count();
    exp.family(
        "keel_nodes",
        Kind::Gauge,
        "Registered nodes by liveness (dead counts every node not alive).",
    );
    exp.sample("keel_nodes", &[("status", "alive")], alive);
    exp.sample("keel_nodes", &[("status", "dead")], nodes.len() - alive);
    exp.family(
        "keel_node_alive",
        Kind::Gauge,
        "1 while the node's lease runs (Alive), else 0 (Unknown or Dead).",
    );
    for n in nodes {
        let up = u8::from(n.status == Liveness::Alive);
        exp.sample("keel_node_alive", &[("node", &n.node_id)], up);
    }
    exp.family(
        "keel_node_committed_cpu_cores",
        Kind::Gauge,
        "CPU cores the node's jails have requested, as it last reported.",
    );
    for n in nodes {
        exp.sample(
            "keel_node_committed_cpu_cores",
            &[("node", &n.node_id)],
            n.committed.cpu,
        );
    }
    exp.family(
        "keel_node_committed_memory_bytes",
        Kind::Gauge,
        "Memory the node's jails have requested, as it last reported.",
    );
    for n in nodes {
        exp.sample(
            "keel_node_committed_memory_bytes",
            &[("node", &n.node_id)],
            n.committed.memory,
        );
    }
    exp.family(
        "keel_service_desired_replicas",
        Kind::Gauge,
        "Replicas the service asks for.",
    );
    for s in services {
        exp.sample(
            "keel_service_desired_replicas",
            &[("service", &s.name)],
            s.desired,
        );
    }
    exp.family(
        "keel_service_ready_replicas",
        Kind::Gauge,
        "Replicas on Alive nodes whose workload runs and is ready.",
    );
    for s in services {
        exp.sample(
            "keel_service_ready_replicas",
            &[("service", &s.name)],
            s.ready,
        );
    }
    exp.family(
        "keel_service_revision",
        Kind::Gauge,
        "The service's current template revision (it grows with every template change).",
    );
    for s in services {
        exp.sample("keel_service_revision", &[("service", &s.name)], s.revision);
    }
    exp.family(
        "keel_service_updated_replicas",
        Kind::Gauge,
        "Replicas that run the current template revision.",
    );
    for s in services {
        exp.sample(
            "keel_service_updated_replicas",
            &[("service", &s.name)],
            s.updated,
        );
    }
    requests.write(&mut exp);
    exp.finish()
}

/// What both `/metrics` routes render from: the worker, asked with a bound,
/// and the request counts. Cheap to clone.
#[derive(Clone)]
pub struct ControlPlaneMetrics {
    worker: WorkerHandle,
    requests: Arc<RequestStats>,
    /// Endpoint long polls waiting now (the API counts them).
    waiting_polls: Arc<AtomicUsize>,
}

impl ControlPlaneMetrics {
    /// Metrics of `worker`'s cluster, with fresh request counts and the
    /// API's count of waiting endpoint polls.
    pub fn new(worker: WorkerHandle, waiting_polls: Arc<AtomicUsize>) -> ControlPlaneMetrics {
        ControlPlaneMetrics {
            worker,
            requests: Arc::new(RequestStats::default()),
            waiting_polls,
        }
    }

    /// The request counts, for [`Metered`].
    pub fn requests(&self) -> Arc<RequestStats> {
        Arc::clone(&self.requests)
    }

    /// The signed route's answer: the text, a 503 when the worker is busy,
    /// [`WorkerGone`] when it stopped.
    pub fn respond(&self) -> Result<Response, WorkerGone> {
        match self.render() {
            Err(Unavailable::Gone(_)) => Err(WorkerGone),
            other => Ok(metrics::answer(other)),
        }
    }
}

/// What the metrics listener renders for the life of the process: the
/// current leadership term's [`ControlPlaneMetrics`], or, while a standby
/// (no term), only `keel_controlplane_leading 0`, so a standby is scraped
/// as up and says what it is.
#[derive(Default)]
pub struct TermMetrics {
    current: std::sync::RwLock<Option<ControlPlaneMetrics>>,
}

impl TermMetrics {
    /// The term that began (`Some`) or ended (`None`).
    pub fn set(&self, term: Option<ControlPlaneMetrics>) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = term;
    }
}

impl Render for Arc<TermMetrics> {
    fn render(&self) -> Result<String, Unavailable> {
        let current = self
            .current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut text = match &current {
            Some(term) => term.render()?,
            None => String::new(),
        };
        let mut exp = Exposition::new();
        exp.single(
            "keel_controlplane_leading",
            Kind::Gauge,
            "1 while this control plane decides for the cluster (the leader, or the only one), 0 while a standby.",
            u8::from(current.is_some()),
        );
        text.push_str(&exp.finish());
        Ok(text)
    }
}

impl Render for ControlPlaneMetrics {
    fn render(&self) -> Result<String, Unavailable> {
        let (nodes, services) = self.worker.nodes_and_services_within(METRICS_WAIT)?;
        let mut text = render(&nodes, &services, &self.requests);
        // Read off the board and an atomic, never through the worker.
        let mut exp = Exposition::new();
        exp.family(
            "keel_endpoint_polls_waiting",
            Kind::Gauge,
            "Endpoint long polls waiting for a newer generation.",
        );
        exp.sample(
            "keel_endpoint_polls_waiting",
            &[],
            self.waiting_polls.load(Ordering::SeqCst),
        );
        let (changes, tables) = self.worker.endpoint_board().answered();
        exp.family(
            "keel_endpoint_poll_answers_total",
            Kind::Counter,
            "Endpoint long polls answered, by what the answer carried: only the services changed since the table the poll held, or the whole table.",
        );
        exp.sample(
            "keel_endpoint_poll_answers_total",
            &[("kind", "changes")],
            changes,
        );
        exp.sample(
            "keel_endpoint_poll_answers_total",
            &[("kind", "table")],
            tables,
        );
        exp.family(
            "keel_endpoint_generation",
            Kind::Gauge,
            "Generation of the endpoint table published last.",
        );
        exp.sample(
            "keel_endpoint_generation",
            &[],
            self.worker.endpoint_board().generation(),
        );
        text.push_str(&exp.finish());
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::wire::Resources;

    #[test]
    fn a_standby_renders_only_that_it_does_not_lead() {
        let standby = Arc::new(TermMetrics::default());
        let text = standby.render().expect("renders without a term");
        assert!(text.contains("\nkeel_controlplane_leading 0\n"), "{text}");
        assert!(!text.contains("keel_nodes"), "{text}");
    }

    fn node(id: &str, status: Liveness) -> NodeStatus {
        NodeStatus {
            node_id: id.into(),
            status,
            address: "127.0.0.1:7441".parse().expect("addr"),
            pod_cidr: "10.20.1.0/24".into(),
            capacity: Resources {
                cpu: 4.0,
                memory: 1 << 30,
            },
            committed: Resources {
                cpu: 0.5,
                memory: 1 << 20,
            },
            jails: 1,
            last_seen_secs: Some(1),
            cordoned: false,
            events_seq: None,
        }
    }

    #[test]
    fn routes_are_counted_by_pattern_not_by_path() {
        assert_eq!(
            route_pattern(&["nodes", "n1", "heartbeat"]),
            "/nodes/{id}/heartbeat"
        );
        assert_eq!(route_pattern(&["nodes", "register"]), "/nodes/register");
        assert_eq!(route_pattern(&["jails", "x", "log"]), "/jails/{name}/log");
        assert_eq!(route_pattern(&["a", "b", "c", "d", "e", "f"]), "other");

        let stats = RequestStats::default();
        for (id, status) in [("n1", 200), ("n2", 200), ("n3", 404), ("n4", 503)] {
            let route = route_pattern(&["nodes", id, "heartbeat"]);
            stats.record(route, status, Duration::from_millis(2));
        }
        let text = render(&[], &[], &stats);
        let heartbeat = "route=\"/nodes/{id}/heartbeat\"";
        assert!(
            text.contains(&format!(
                "keel_controlplane_requests_total{{{heartbeat},code=\"2xx\"}} 2\n"
            )),
            "{text}"
        );
        assert!(text.contains("code=\"4xx\"} 1\n"), "{text}");
        assert!(text.contains("code=\"5xx\"} 1\n"), "{text}");
        assert!(
            text.contains(&format!(
                "keel_controlplane_request_duration_seconds_count{{{heartbeat}}} 4\n"
            )),
            "{text}"
        );
        assert!(!text.contains("n1"), "no raw path in a label: {text}");
    }

    /// Every route of the API's route table (its module docs) is counted
    /// under its own pattern, so a route added there without one here fails.
    #[test]
    fn every_route_of_the_api_table_has_its_pattern() {
        let table = include_str!("api.rs");
        let mut checked = 0;
        for row in table.lines().filter_map(|l| l.strip_prefix("//! | `")) {
            let first = row.split(" | ").next().expect("a first column");
            // `A`, `B` after the leading backtick: A, ", ", B, "".
            for route in first.split('`').step_by(2) {
                let Some((_, path)) = route.split_once(' ') else {
                    continue;
                };
                // The query is no part of the pattern.
                let path = path.split('?').next().unwrap_or(path);
                let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
                assert_eq!(route_pattern(&segments), path, "{route}");
                checked += 1;
            }
        }
        assert!(checked > 20, "{checked} routes read from the API's table");
    }

    #[test]
    fn nodes_and_services_have_one_series_each() {
        let nodes = [node("n1", Liveness::Alive), node("n2", Liveness::Dead)];
        let text = render(&nodes, &[], &RequestStats::default());
        for line in [
            "keel_nodes{status=\"alive\"} 1\n",
            "keel_nodes{status=\"dead\"} 1\n",
            "keel_node_alive{node=\"n1\"} 1\n",
            "keel_node_alive{node=\"n2\"} 0\n",
            "keel_node_committed_cpu_cores{node=\"n1\"} 0.5\n",
            "keel_node_committed_memory_bytes{node=\"n2\"} 1048576\n",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
    }

    #[test]
    fn a_service_exports_its_revision_and_how_many_replicas_run_it() {
        let web = ServiceStatus {
            name: "web".into(),
            vip: std::net::Ipv4Addr::new(10, 96, 0, 10),
            port: 8080,
            desired: 3,
            ready: 3,
            stateful: false,
            revision: 4,
            updated: 2,
            rollout: None,
            replicas: Vec::new(),
        };
        let text = render(&[], &[web], &RequestStats::default());
        for line in [
            "keel_service_desired_replicas{service=\"web\"} 3\n",
            "keel_service_revision{service=\"web\"} 4\n",
            "keel_service_updated_replicas{service=\"web\"} 2\n",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
    }
}
