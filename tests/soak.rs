//! The load soak: for a set duration, a real
//! `keel-controlplane --simulate` with three real `keel-agentd --simulate`
//! (the [`Cluster`] of the process tests) and 1,000 simulated nodes besides,
//! under continuous applies and deletes. The daemons' resident memory and
//! open file descriptors must stay under fixed bounds, and no request may
//! fail. `#[ignore]`: run it with `scripts/soak.sh SECONDS`
//! (`KEEL_SOAK_SECS`, default 60).
//!
//! The load, all through the control plane's API, signed as nodes and
//! operators sign:
//! - 1,000 simulated nodes register, then each heartbeats every 5 s (the
//!   agents' default; 200 heartbeats/s), paced and reported as
//!   `bench/controlplane.rs` does (the code is shared: `util::load`), their
//!   advertise addresses on in-process simulated agents that accept every
//!   `PUT` and `DELETE`;
//! - scheduled applies of new jails (`PUT /jails/{name}`, up to 20 a second:
//!   each waits for its answer, so a slow control plane lowers the rate), each
//!   deleted again (`DELETE /jails/{name}`) once 200 newer ones exist; they
//!   land on whichever node the scheduler picks, mostly simulated ones;
//! - applies pinned to the three real agents in turn (`PUT
//!   /nodes/{id}/jails/{name}`, up to 5 a second), each deleted once 15 newer ones
//!   exist: these start and stop real (simulated-runtime) workloads;
//! - the three real agents heartbeat and reconcile every 200 ms, with the
//!   1,003-node peer list.
//!
//! Every 5 s the soak reads `VmRSS` and the number of entries of
//! `/proc/PID/fd` of the control plane and of each agent (Linux only), and
//! prints a line a minute. At the end it deletes what is left, prints the
//! figures and asserts: no request failed (any status outside 2xx, any
//! transport error), every daemon still runs, and the peaks stay under
//! [`BOUNDS`]. The bounds come from short runs on the development VM (debug
//! build), with headroom; docs/reliability.md records them and the runs.

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use keel::common::auth::{self, KeyFilePolicy, Signer};
use keel::common::http::ClientResponse;
use keel::common::wire::{RegisterRequest, Resources};

use crate::util::cluster::{Cluster, free_port};
use crate::util::load::{
    Agents, JAIL_CPU, JAIL_MEMORY, KeepAlive, NO_VERSION, NODE_CPU, NODE_MEMORY, Paced, PacedLoad,
    Running, mib, node_id, open_fds, proc_status, signed,
};

/// Simulated nodes besides the three real agents.
const NODES: usize = 1000;
/// Every simulated node heartbeats this often.
const HEARTBEAT_PERIOD: Duration = Duration::from_secs(5);
/// Threads sending the heartbeats, one keep-alive connection each.
const HEARTBEAT_CLIENTS: usize = 4;
/// In-process simulated agents the simulated nodes advertise.
const FAKE_AGENTS: usize = 4;
/// One scheduled apply per period; live scheduled jails before deleting.
const SCHEDULED_PERIOD: Duration = Duration::from_millis(50);
const SCHEDULED_LIVE: usize = 200;
/// One pinned apply per period; live pinned jails before deleting.
const PINNED_PERIOD: Duration = Duration::from_millis(200);
const PINNED_LIVE: usize = 15;
const REAL_NODES: [&str; 3] = ["n1", "n2", "n3"];
/// How often memory and descriptors are read.
const SAMPLE_PERIOD: Duration = Duration::from_secs(5);

/// Peak bounds: (daemon, VmRSS KiB, open fds). A 70 s run on the
/// development VM (debug build) peaked at 11.7 MiB and 18 fds for the
/// control plane, 13.0 MiB and 16 fds for an agent: about four times that
/// memory, and room for every client connection at once.
const BOUNDS: [(&str, u64, u64); 2] = [
    ("keel-controlplane", 48 * 1024, 64),
    ("keel-agentd", 48 * 1024, 64),
];

/// Requests that failed: how many, and the first few.
struct Failures {
    count: u64,
    first: Vec<String>,
}

static FAILURES: Mutex<Failures> = Mutex::new(Failures {
    count: 0,
    first: Vec::new(),
});

fn fail(what: String) {
    let mut f = FAILURES.lock().unwrap_or_else(|p| p.into_inner());
    f.count += 1;
    if f.first.len() < 5 {
        f.first.push(what);
    }
}

fn jail_yaml(name: &str, resources: bool) -> String {
    let limits = if resources {
        format!("  resources:\n    cpu: {JAIL_CPU}\n    memory: {JAIL_MEMORY}\n")
    } else {
        String::new()
    };
    format!(
        "kind: Jail\nmetadata:\n  name: {name}\nspec:\n  base: 14.2-RELEASE\n{limits}  exec:\n    start: [\"/bin/sleep\", \"3600\"]\n"
    )
}

/// One operator's keep-alive connection to the control plane.
struct Operator {
    conn: KeepAlive,
    addr: SocketAddr,
    signer: Signer,
}

impl Operator {
    /// Sends one signed request; `Some(response)` when it was answered 2xx,
    /// else the failure is recorded.
    fn call(&mut self, method: &str, path: &str, body: &[u8]) -> Option<ClientResponse> {
        let wire = signed(
            &self.signer,
            method,
            path,
            self.addr,
            "application/yaml",
            body,
        )
        .and_then(|w| self.conn.exchange(&w));
        match wire {
            Ok(r) if (200..300).contains(&r.status) => Some(r),
            Ok(r) => {
                fail(format!(
                    "{method} {path}: {} {}",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                ));
                None
            }
            Err(e) => {
                fail(format!("{method} {path}: {e}"));
                None
            }
        }
    }
}

/// Peak and last reading of one daemon.
#[derive(Default, Clone, Copy)]
struct Reading {
    first_rss: u64,
    max_rss: u64,
    last_rss: u64,
    first_fds: u64,
    max_fds: u64,
    last_fds: u64,
}

impl Reading {
    fn take(&mut self, name: &str, pid: Option<u32>) {
        let rss = pid.and_then(|p| proc_status(p, "VmRSS"));
        let fds = pid.and_then(open_fds);
        let (Some(rss), Some(fds)) = (rss, fds) else {
            fail(format!("{name} is not running"));
            return;
        };
        if self.first_rss == 0 {
            (self.first_rss, self.first_fds) = (rss, fds);
        }
        self.max_rss = self.max_rss.max(rss);
        self.max_fds = self.max_fds.max(fds);
        (self.last_rss, self.last_fds) = (rss, fds);
    }

    fn show(&self) -> String {
        format!(
            "VmRSS {} -> {} (peak {}), fds {} -> {} (peak {})",
            mib(Some(self.first_rss)),
            mib(Some(self.last_rss)),
            mib(Some(self.max_rss)),
            self.first_fds,
            self.last_fds,
            self.max_fds
        )
    }
}

/// One stream of applies and deletes.
struct Churn<'a> {
    /// Jail names are `{prefix}-{i}`.
    prefix: &'a str,
    /// One apply per period.
    period: Duration,
    /// Jails kept before the oldest is deleted.
    live: usize,
    /// The apply's path for jail `i` named `name`.
    path_of: &'a dyn Fn(usize, &str) -> String,
    /// Whether the jails ask for cpu and memory.
    resources: bool,
}

/// Applies one new jail per period and deletes the oldest once more than
/// `live` are placed, until `until`, then deletes the rest; returns
/// (applies, deletes).
fn churn(op: &mut Operator, c: &Churn, until: Instant, placed: &[AtomicU64]) -> (u64, u64) {
    let Churn {
        prefix,
        period,
        live,
        path_of,
        resources,
    } = *c;
    let mut held: VecDeque<(String, Option<usize>)> = VecDeque::new();
    let (mut applies, mut deletes) = (0, 0);
    let start = Instant::now();
    let delete = |op: &mut Operator, (name, node): (String, Option<usize>)| {
        if op.call("DELETE", &format!("/jails/{name}"), b"").is_some() {
            if let Some(i) = node {
                placed[i].fetch_sub(1, Ordering::Relaxed);
            }
        }
    };
    for i in 0usize.. {
        let due = start + period * u32::try_from(i).expect("fewer than 2^32 applies");
        // A stream that fell behind its schedule (each apply waits for its
        // answer) stops at the deadline too, rather than catching up.
        if due >= until || Instant::now() >= until {
            break;
        }
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let name = format!("{prefix}-{i}");
        let body = jail_yaml(&name, resources);
        if let Some(r) = op.call("PUT", &path_of(i, &name), body.as_bytes()) {
            applies += 1;
            // Simulated nodes report what was placed on them as committed.
            let node = r
                .header("X-Keel-Node")
                .and_then(|n| n.strip_prefix("node-"))
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|n| *n < placed.len());
            if let Some(n) = node {
                placed[n].fetch_add(1, Ordering::Relaxed);
            }
            held.push_back((name, node));
        }
        if held.len() > live {
            delete(op, held.pop_front().expect("not empty"));
            deletes += 1;
        }
    }
    for j in held.drain(..) {
        delete(op, j);
        deletes += 1;
    }
    (applies, deletes)
}

#[test]
#[ignore = "long: scripts/soak.sh SECONDS"]
fn soak() {
    let secs: u64 = std::env::var("KEEL_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let agents = Agents::start(FAKE_AGENTS).expect("in-process simulated agents");
    let mut cluster = Cluster::new();
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)));
    let listen = addr.to_string();
    cluster.start_controlplane(&["--simulate", "--listen", &listen]);
    for n in 1..=3 {
        cluster.start_standard_agent(n);
    }
    let key = |file: &str| {
        let path = cluster.dir().join("keel-sim/keys").join(file);
        Signer::new(auth::load_key(&path, KeyFilePolicy::for_current_process()).expect("key"))
    };
    let (node_key, operator_key) = (key("node.key"), key("operator.key"));
    println!(
        "soak: {secs} s; {NODES} simulated nodes heartbeating every {} s and 3 keel-agentd (every 200 ms); scheduled applies every {} ms ({SCHEDULED_LIVE} live), pinned to the agents every {} ms ({PINNED_LIVE} live)",
        HEARTBEAT_PERIOD.as_secs(),
        SCHEDULED_PERIOD.as_millis(),
        PINNED_PERIOD.as_millis()
    );

    let mut conn = KeepAlive::new(addr);
    for i in 0..NODES {
        let body = serde_json::to_vec(&RegisterRequest {
            node_id: node_id(i),
            advertise_addr: agents.addrs[i % agents.addrs.len()],
            capacity: Resources {
                cpu: NODE_CPU,
                memory: NODE_MEMORY,
            },
        })
        .expect("json");
        let wire = signed(
            &node_key,
            "POST",
            "/nodes/register",
            addr,
            "application/json",
            &body,
        )
        .expect("sign");
        let r = conn.exchange(&wire).expect("registration answered");
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    let placed: std::sync::Arc<Vec<AtomicU64>> =
        std::sync::Arc::new((0..NODES).map(|_| AtomicU64::new(0)).collect());
    let heartbeats = Running::start(
        PacedLoad {
            kind: Paced::Heartbeat,
            addr,
            nodes: NODES,
            signer: node_key,
            placed: std::sync::Arc::clone(&placed),
            versions: (0..NODES).map(|_| AtomicU64::new(NO_VERSION)).collect(),
            period: HEARTBEAT_PERIOD,
            start: Instant::now(),
            stop: AtomicBool::new(false),
        },
        HEARTBEAT_CLIENTS,
    );

    let start = Instant::now();
    let until = start + Duration::from_secs(secs);
    let operator = || Operator {
        conn: KeepAlive::new(addr),
        addr,
        signer: operator_key.clone(),
    };
    let mut readings = [Reading::default(); 4];
    let names = [
        "keel-controlplane",
        "keel-agentd n1",
        "keel-agentd n2",
        "keel-agentd n3",
    ];
    let pids = [
        cluster.controlplane_pid(),
        cluster.agent_pid("n1"),
        cluster.agent_pid("n2"),
        cluster.agent_pid("n3"),
    ];
    let ((scheduled, pinned), samples) = std::thread::scope(|s| {
        let scheduled = s.spawn(|| {
            let c = Churn {
                prefix: "soak",
                period: SCHEDULED_PERIOD,
                live: SCHEDULED_LIVE,
                path_of: &|_, name| format!("/jails/{name}"),
                resources: true,
            };
            churn(&mut operator(), &c, until, &placed)
        });
        let pinned = s.spawn(|| {
            let c = Churn {
                prefix: "pin",
                period: PINNED_PERIOD,
                live: PINNED_LIVE,
                path_of: &|i, name| format!("/nodes/{}/jails/{name}", REAL_NODES[i % 3]),
                resources: false,
            };
            churn(&mut operator(), &c, until, &placed)
        });
        let mut samples = 0u64;
        let mut next_report = start + Duration::from_secs(60);
        while Instant::now() < until {
            std::thread::sleep(SAMPLE_PERIOD.min(until.saturating_duration_since(Instant::now())));
            for ((r, name), pid) in readings.iter_mut().zip(names).zip(pids) {
                r.take(name, pid);
            }
            samples += 1;
            if Instant::now() >= next_report {
                next_report += Duration::from_secs(60);
                println!(
                    "soak: {:>5} s: control plane {} MiB / {} fds; agents {}",
                    start.elapsed().as_secs(),
                    readings[0].last_rss / 1024,
                    readings[0].last_fds,
                    readings[1..]
                        .iter()
                        .map(|r| format!("{} MiB / {} fds", r.last_rss / 1024, r.last_fds))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
        let joined = (
            scheduled.join().expect("scheduled churn"),
            pinned.join().expect("pinned churn"),
        );
        (joined, samples)
    });
    for ((r, name), pid) in readings.iter_mut().zip(names).zip(pids) {
        r.take(name, pid);
    }
    let hb = heartbeats.finish();
    let hb_failed: Vec<&String> = hb.iter().filter_map(|s| s.error.as_ref()).collect();
    for e in hb_failed.iter().take(3) {
        fail((*e).clone());
    }
    let mut latencies: Vec<Duration> = hb.iter().map(|s| s.latency).collect();
    latencies.sort_unstable();
    let p99 = latencies
        .get(latencies.len().saturating_sub(1) * 99 / 100)
        .copied()
        .unwrap_or_default();
    // Nothing placed is left behind on the real agents.
    let leftover: Vec<String> = REAL_NODES
        .iter()
        .flat_map(|id| {
            let r = keel::common::http::Client::new(keel::common::http::Endpoint::Unix(
                cluster.socket(id),
            ))
            .request("GET", "/jails", &[], b"")
            .expect("agent answers");
            let jails: Vec<keel::common::wire::JailStatus> =
                serde_json::from_slice(&r.body).expect("jails");
            jails.into_iter().map(move |j| format!("{id}/{}", j.name))
        })
        .collect();

    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "soak: {elapsed:.0} s, {samples} samples: {} heartbeats ({:.0}/s, p99 {:.1} ms from their due time, {} failed); scheduled {} applies ({:.1}/s), {} deletes; pinned {} applies ({:.1}/s), {} deletes; in-process agents saw {} PUT, {} DELETE",
        hb.len(),
        hb.len() as f64 / elapsed,
        p99.as_secs_f64() * 1000.0,
        hb_failed.len(),
        scheduled.0,
        scheduled.0 as f64 / secs as f64,
        scheduled.1,
        pinned.0,
        pinned.0 as f64 / secs as f64,
        pinned.1,
        agents.puts.load(Ordering::Relaxed),
        agents.deletes.load(Ordering::Relaxed)
    );
    for (r, name) in readings.iter().zip(names) {
        println!("soak: {name}: {}", r.show());
    }
    let failures = FAILURES.lock().unwrap_or_else(|p| p.into_inner());
    println!("soak: {} failed requests", failures.count);
    assert_eq!(
        failures.count, 0,
        "failed requests, first: {:#?}",
        failures.first
    );
    assert!(
        leftover.is_empty(),
        "jails left on the agents: {leftover:?}"
    );
    assert_eq!(pinned.0, pinned.1, "every pinned jail deleted");
    assert_eq!(scheduled.0, scheduled.1, "every scheduled jail deleted");
    for (r, name) in readings.iter().zip(names) {
        let (_, rss, fds) = BOUNDS
            .iter()
            .find(|(d, _, _)| name.starts_with(d))
            .expect("a bound");
        assert!(
            r.max_rss <= *rss,
            "{name}: peak VmRSS {} above the bound {}",
            mib(Some(r.max_rss)),
            mib(Some(*rss))
        );
        assert!(
            r.max_fds <= *fds,
            "{name}: peak {} open fds above the bound {fds}",
            r.max_fds
        );
    }
}
