//! The agent's Prometheus metrics, for both `/metrics` routes (the API's and
//! the plain listener of `agent.metrics_listen`): jails (counts, and per jail
//! its state, readiness, restarts and requested resources), reconcile passes
//! (duration histogram, failures, restarts), the service proxy per service
//! (connections open and accepted, bytes relayed each way) and the ingress
//! certificates' expiry per host.
//!
//! [`Metrics`] is owned by the worker thread, which updates it after each
//! pass and command and publishes a copy with the jail count and the
//! certificates' expiry ([`WorkerMetrics`], through `agentd::snapshot`)
//! after every command, as it publishes its jail statuses. [`AgentMetrics`]
//! renders from those snapshots and from the proxy's atomic counters
//! (`proxy::stats`), so a scrape never waits for the worker or the proxy's
//! control loop; it is at most one command behind.
//!
//! CPU and memory, per jail: what its spec requests (the limits rctl(8)
//! enforces; a jail without a request has no such series) and what it uses,
//! from the last sample of the usage sampler (`agentd::usage`: rctl(8) `-u`
//! on FreeBSD, `/proc` in simulate mode on Linux). A host without resource
//! accounting, or a jail the last sample did not see, has no usage series.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::agentd::cluster::watch::ClusterCounters;

use crate::agentd::proxy::stats::{ProxyStats, ServiceSample};
use crate::agentd::usage::UsageBoard;
use crate::agentd::worker::WorkerHandle;
use crate::common::metrics::{Exposition, Histogram, Kind, Render, Unavailable};
use crate::common::wire::{JailStatus, Phase};
use crate::host::usage::JailUsage;

/// Upper bounds of the pass-duration histogram buckets, in seconds.
const PASS_BUCKETS: [f64; 10] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0];

/// Every phase, for `keel_jail_state` (one series per phase and jail).
const PHASES: [Phase; 7] = [
    Phase::Pending,
    Phase::Running,
    Phase::CrashLoop,
    Phase::Failed,
    Phase::Deleting,
    Phase::Starting,
    Phase::Restarting,
];

/// Counters and the pass histogram.
#[derive(Debug, Clone, PartialEq)]
pub struct Metrics {
    passes: Histogram,
    failures_total: u64,
    restarts_total: u64,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            passes: Histogram::new(&PASS_BUCKETS),
            failures_total: 0,
            restarts_total: 0,
        }
    }
}

impl Metrics {
    /// Records one finished pass.
    pub fn record_pass(&mut self, took: Duration, failures: usize, restarts: usize) {
        self.passes.observe(took);
        self.failures_total += failures as u64;
        self.restarts_total += restarts as u64;
    }

    /// Counts a failed apply or delete (outside a pass).
    pub fn record_failure(&mut self) {
        self.failures_total += 1;
    }
}

/// What the worker publishes for the metrics after every command.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerMetrics {
    /// The worker's counters.
    pub counters: Metrics,
    /// Jails recorded (desired).
    pub desired: usize,
    /// Each ingress host's installed certificate expiry (Unix seconds); a
    /// host without a certificate yet is absent.
    pub certificates: BTreeMap<String, i64>,
}

/// The agent's exposition: the worker's part from what it published and
/// `jails` (its published statuses), each jail's usage from `usage` (the
/// last sample), the proxy's from `proxy` when this node runs one (families
/// are left out without it).
pub fn render(
    worker: &WorkerMetrics,
    jails: &[JailStatus],
    usage: &BTreeMap<String, JailUsage>,
    proxy: Option<&[(String, ServiceSample)]>,
) -> String {
    let mut exp = Exposition::new();
    let running = jails.iter().filter(|s| s.state.runs()).count();
    exp.single(
        "keel_jails_desired",
        Kind::Gauge,
        "Jails this agent is asked to run.",
        worker.desired,
    );
    exp.single(
        "keel_jails_running",
        Kind::Gauge,
        "Jails whose workload was running at the last pass.",
        running,
    );
    exp.family(
        "keel_reconcile_duration_seconds",
        Kind::Histogram,
        "Duration of reconcile passes.",
    );
    let c = &worker.counters;
    c.passes
        .write(&mut exp, "keel_reconcile_duration_seconds", &[]);
    exp.single(
        "keel_reconcile_failures_total",
        Kind::Counter,
        "Per-jail failures in passes, applies and deletes.",
        c.failures_total,
    );
    exp.single(
        "keel_jail_restarts_total",
        Kind::Counter,
        "Workloads restarted after a crash, all jails together, since the agent started.",
        c.restarts_total,
    );
    jail_families(&mut exp, jails);
    usage_families(&mut exp, jails, usage);
    if let Some(services) = proxy {
        proxy_families(&mut exp, services);
    }
    exp.family(
        "keel_ingress_certificate_expiry_timestamp_seconds",
        Kind::Gauge,
        "When the certificate installed for the ingress host expires (Unix seconds).",
    );
    for (host, expires) in &worker.certificates {
        exp.sample(
            "keel_ingress_certificate_expiry_timestamp_seconds",
            &[("host", host)],
            expires,
        );
    }
    exp.finish()
}

fn jail_families(exp: &mut Exposition, jails: &[JailStatus]) {
    exp.family(
        "keel_jail_state",
        Kind::Gauge,
        "1 for the jail's current phase, 0 for the others.",
    );
    for j in jails {
        for phase in PHASES {
            let state = phase.to_string();
            let current = u8::from(j.state == phase);
            exp.sample(
                "keel_jail_state",
                &[("jail", &j.name), ("state", &state)],
                current,
            );
        }
    }
    exp.family(
        "keel_jail_ready",
        Kind::Gauge,
        "1 when the jail serves: running and, with a health check, passing it.",
    );
    for j in jails {
        exp.sample("keel_jail_ready", &[("jail", &j.name)], u8::from(j.ready));
    }
    exp.family(
        "keel_jail_workload_restarts_total",
        Kind::Counter,
        "Restarts of the jail's workload after crashes and failed health checks, kept across re-applies and agent restarts.",
    );
    for j in jails {
        exp.sample(
            "keel_jail_workload_restarts_total",
            &[("jail", &j.name)],
            j.restarts,
        );
    }
    exp.family(
        "keel_jail_cpu_request_cores",
        Kind::Gauge,
        "CPU cores the jail's spec requests (its rctl pcpu limit); absent without a request.",
    );
    for j in jails {
        if let Some(cpu) = j.cpu {
            exp.sample("keel_jail_cpu_request_cores", &[("jail", &j.name)], cpu);
        }
    }
    exp.family(
        "keel_jail_memory_request_bytes",
        Kind::Gauge,
        "Memory the jail's spec requests (its rctl memoryuse limit); absent without a request.",
    );
    for j in jails {
        if let Some(bytes) = j.memory {
            exp.sample(
                "keel_jail_memory_request_bytes",
                &[("jail", &j.name)],
                bytes,
            );
        }
    }
}

/// Usage series of the jails in `jails` that the last sample saw (a
/// sample may name a jail deleted since; it is left out).
fn usage_families(exp: &mut Exposition, jails: &[JailStatus], usage: &BTreeMap<String, JailUsage>) {
    let seen: Vec<(&str, &JailUsage)> = jails
        .iter()
        .filter_map(|j| usage.get(&j.name).map(|u| (j.name.as_str(), u)))
        .collect();
    exp.family(
        "keel_jail_cpu_seconds_total",
        Kind::Counter,
        "CPU time (user and system) the jail's processes used since it started, at the last usage sample.",
    );
    for (name, u) in &seen {
        exp.sample(
            "keel_jail_cpu_seconds_total",
            &[("jail", name)],
            u.cpu_seconds,
        );
    }
    exp.family(
        "keel_jail_memory_bytes",
        Kind::Gauge,
        "Resident memory of the jail's processes at the last usage sample.",
    );
    for (name, u) in &seen {
        exp.sample("keel_jail_memory_bytes", &[("jail", name)], u.memory_bytes);
    }
}

fn proxy_families(exp: &mut Exposition, services: &[(String, ServiceSample)]) {
    exp.family(
        "keel_proxy_open_connections",
        Kind::Gauge,
        "Client connections the service proxy relays to a replica now.",
    );
    for (name, s) in services {
        exp.sample("keel_proxy_open_connections", &[("service", name)], s.open);
    }
    exp.family(
        "keel_proxy_connections_total",
        Kind::Counter,
        "Client connections the service proxy accepted.",
    );
    for (name, s) in services {
        exp.sample(
            "keel_proxy_connections_total",
            &[("service", name)],
            s.accepted,
        );
    }
    exp.family(
        "keel_proxy_bytes_total",
        Kind::Counter,
        "Bytes the service proxy relayed, by direction (to_replica: from clients; to_client: from replicas).",
    );
    for (name, s) in services {
        for (direction, n) in [("to_replica", s.to_replica), ("to_client", s.to_client)] {
            exp.sample(
                "keel_proxy_bytes_total",
                &[("service", name), ("direction", direction)],
                n,
            );
        }
    }
}

/// Renders the agent's metrics from the worker's snapshots and the proxy's
/// counters; see the module docs. Cheap to clone.
#[derive(Clone)]
pub struct AgentMetrics {
    worker: WorkerHandle,
    proxy: Option<Arc<ProxyStats>>,
    cluster: Option<Arc<ClusterCounters>>,
    usage: UsageBoard,
}

impl AgentMetrics {
    /// Metrics of `worker` and, on a clustered node, its proxy's `proxy`.
    pub fn new(worker: WorkerHandle, proxy: Option<Arc<ProxyStats>>) -> AgentMetrics {
        AgentMetrics {
            worker,
            proxy,
            cluster: None,
            usage: UsageBoard::new(),
        }
    }

    /// Reads each jail's usage from `usage`, the usage sampler's board.
    pub fn with_usage(mut self, usage: UsageBoard) -> AgentMetrics {
        self.usage = usage;
        self
    }

    /// Adds the cluster thread's counters, when the node is in a cluster.
    pub fn with_cluster(mut self, cluster: Option<Arc<ClusterCounters>>) -> AgentMetrics {
        self.cluster = cluster;
        self
    }
}

impl Render for AgentMetrics {
    fn render(&self) -> Result<String, Unavailable> {
        let gone = |_| {
            Unavailable::Gone(
                "the agent's worker thread has stopped; restart keel-agentd".to_string(),
            )
        };
        let worker = self.worker.published_metrics().map_err(gone)?;
        let jails = self.worker.published_jails().map_err(gone)?;
        let proxy = self.proxy.as_ref().map(|p| p.snapshot());
        let mut text = render(&worker, &jails, &self.usage.snapshot(), proxy.as_deref());
        if let Some(c) = &self.cluster {
            text.push_str(&c.render());
        }
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(name: &str, state: Phase, ready: bool) -> JailStatus {
        JailStatus {
            name: name.into(),
            state,
            address: std::net::Ipv4Addr::new(10, 20, 0, 2),
            restarts: 3,
            ready,
            created_unix: 0,
            last_error: None,
            retry_in_secs: None,
            epoch: None,
            cpu: Some(0.5),
            memory: None,
            last_exit: None,
        }
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut m = Metrics::default();
        m.record_pass(Duration::from_millis(3), 1, 2);
        m.record_pass(Duration::from_millis(700), 0, 0);
        let worker = WorkerMetrics {
            counters: m,
            desired: 4,
            certificates: BTreeMap::new(),
        };
        let jails = [
            status("a", Phase::Running, true),
            status("b", Phase::Running, false),
            status("c", Phase::Running, false),
        ];
        let text = render(&worker, &jails, &BTreeMap::new(), None);
        assert!(text.contains("keel_reconcile_duration_seconds_bucket{le=\"0.001\"} 0"));
        assert!(text.contains("keel_reconcile_duration_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("keel_reconcile_duration_seconds_bucket{le=\"1\"} 2"));
        assert!(text.contains("keel_reconcile_duration_seconds_count 2"));
        assert!(text.contains("keel_jails_desired 4"));
        assert!(text.contains("keel_jails_running 3"));
        assert!(text.contains("keel_reconcile_failures_total 1"));
        assert!(text.contains("keel_jail_restarts_total 2"));
    }

    #[test]
    fn each_jail_has_one_state_set_its_readiness_and_only_the_resources_it_requests() {
        let jails = [
            status("web", Phase::CrashLoop, false),
            status("db", Phase::Running, true),
        ];
        let text = render(&WorkerMetrics::default(), &jails, &BTreeMap::new(), None);
        for line in [
            "keel_jail_state{jail=\"web\",state=\"CrashLoop\"} 1\n",
            "keel_jail_state{jail=\"web\",state=\"Running\"} 0\n",
            "keel_jail_state{jail=\"db\",state=\"Running\"} 1\n",
            "keel_jail_ready{jail=\"db\"} 1\n",
            "keel_jail_ready{jail=\"web\"} 0\n",
            "keel_jail_workload_restarts_total{jail=\"web\"} 3\n",
            "keel_jail_cpu_request_cores{jail=\"web\"} 0.5\n",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
        assert!(
            !text.contains("keel_jail_memory_request_bytes{"),
            "no request, no series: {text}"
        );
        let ones = text
            .lines()
            .filter(|l| l.starts_with("keel_jail_state{jail=\"web\"") && l.ends_with(" 1"))
            .count();
        assert_eq!(ones, 1, "{text}");
        assert!(!text.contains("keel_proxy_"), "no proxy, no proxy families");
    }

    #[test]
    fn usage_is_exported_for_the_jails_the_sample_saw_and_only_those() {
        let jails = [
            status("web", Phase::Running, true),
            status("db", Phase::Running, true),
        ];
        let usage = [
            (
                "web".to_string(),
                JailUsage {
                    cpu_seconds: 12.5,
                    memory_bytes: 8_388_608,
                },
            ),
            (
                "deleted-since".to_string(),
                JailUsage {
                    cpu_seconds: 1.0,
                    memory_bytes: 1,
                },
            ),
        ]
        .into();
        let text = render(&WorkerMetrics::default(), &jails, &usage, None);
        assert!(
            text.contains("keel_jail_cpu_seconds_total{jail=\"web\"} 12.5\n"),
            "{text}"
        );
        assert!(
            text.contains("keel_jail_memory_bytes{jail=\"web\"} 8388608\n"),
            "{text}"
        );
        for family in ["keel_jail_cpu_seconds_total", "keel_jail_memory_bytes"] {
            assert!(
                !text.contains(&format!("{family}{{jail=\"db\"}}")),
                "not sampled, no series: {text}"
            );
        }
        assert!(!text.contains("deleted-since"), "{text}");
        assert!(
            text.contains("# TYPE keel_jail_cpu_seconds_total counter"),
            "{text}"
        );
    }

    #[test]
    fn proxy_and_certificates_are_labelled_by_service_and_host() {
        let worker = WorkerMetrics {
            certificates: [("shop.example.org".to_string(), 1_800_000_000)].into(),
            ..WorkerMetrics::default()
        };
        let services = [(
            "web".to_string(),
            ServiceSample {
                open: 2,
                accepted: 9,
                to_replica: 100,
                to_client: 4000,
            },
        )];
        let text = render(&worker, &[], &BTreeMap::new(), Some(&services));
        for line in [
            "keel_proxy_open_connections{service=\"web\"} 2\n",
            "keel_proxy_connections_total{service=\"web\"} 9\n",
            "keel_proxy_bytes_total{service=\"web\",direction=\"to_replica\"} 100\n",
            "keel_proxy_bytes_total{service=\"web\",direction=\"to_client\"} 4000\n",
            "keel_ingress_certificate_expiry_timestamp_seconds{host=\"shop.example.org\"} 1800000000\n",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
    }
}
