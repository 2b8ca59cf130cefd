//! The agent's health checker: runs each jail's `spec.health` probe on its
//! own thread (`keel-health`, and one short-lived `keel-health-probe` thread
//! per probe in flight, at most one per jail), never on the worker, and
//! reports readiness changes and restarts to the worker as commands.
//!
//! It reads what to probe from a snapshot the worker publishes after every
//! command ([`Target`]s: the running jails that have a probe, each with the
//! incarnation of its workload), so a worker busy with a 30 s host command
//! delays no probe. A new incarnation (the workload was restarted or
//! replaced) starts from "not ready" again, and every report names the
//! incarnation it is about, so the worker drops a report about a workload
//! that is already gone. It never touches the host itself: exec probes go
//! through [`probe::ExecSeam`].

pub mod probe;
pub mod state;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::agentd::snapshot::Snapshot;
use crate::common::spec::HealthSpec;
use probe::ExecSeam;
use state::{Readiness, Thresholds, Verdict};

/// How often the checker looks for probes that are due and for a newer
/// snapshot; results wake it at once.
const TICK: Duration = Duration::from_millis(100);

/// One running jail with a probe, as the worker published it.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// Jail name.
    pub name: String,
    /// Which start of the workload this is; see the module docs.
    pub incarnation: u64,
    /// The jail's own address, which http and tcp probes connect to.
    pub address: Ipv4Addr,
    /// The jail's `spec.health`.
    pub health: HealthSpec,
}

/// Where the checker's verdicts go (the worker, in the agent).
pub trait Reports: ExecSeam {
    /// Jail `name`'s workload `incarnation` became ready, or stopped being
    /// ready for `reason`.
    fn readiness(&self, name: &str, incarnation: u64, ready: bool, reason: Option<String>);
    /// Jail `name`'s workload `incarnation` failed twice its threshold: restart it.
    fn restart(&self, name: &str, incarnation: u64, reason: String);
}

struct Outcome {
    name: String,
    incarnation: u64,
    result: Result<(), String>,
}

struct Tracked {
    incarnation: u64,
    readiness: Readiness,
    thresholds: Thresholds,
    next_due: Instant,
    in_flight: bool,
}

/// Starts the checker; it ends when the snapshot closes (the worker is gone).
pub fn spawn(
    targets: Snapshot<Vec<Target>>,
    reports: Arc<dyn Reports>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("keel-health".into())
        .spawn(move || run(targets, reports))
}

fn run(targets: Snapshot<Vec<Target>>, reports: Arc<dyn Reports>) {
    let (tx, rx) = mpsc::channel();
    let mut tracked: BTreeMap<String, Tracked> = BTreeMap::new();
    while let Some(list) = targets.latest() {
        let now = Instant::now();
        tracked.retain(|name, _| list.iter().any(|t| &t.name == name));
        for target in list.iter() {
            let entry = tracked
                .entry(target.name.clone())
                .or_insert_with(|| fresh(target, now));
            if entry.incarnation != target.incarnation {
                *entry = fresh(target, now);
            }
            entry.thresholds = Thresholds::from(&target.health);
            if !entry.in_flight && now >= entry.next_due {
                entry.next_due = now + target.health.interval.0;
                entry.in_flight = start_probe(target, &tx, &reports);
            }
        }
        match rx.recv_timeout(TICK) {
            Ok(outcome) => {
                settle(&mut tracked, outcome, reports.as_ref());
                while let Ok(outcome) = rx.try_recv() {
                    settle(&mut tracked, outcome, reports.as_ref());
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            // `tx` lives in this frame: never disconnected.
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

fn fresh(target: &Target, now: Instant) -> Tracked {
    Tracked {
        incarnation: target.incarnation,
        readiness: Readiness::new(now),
        thresholds: Thresholds::from(&target.health),
        next_due: now,
        in_flight: false,
    }
}

/// Runs one probe on a thread of its own, so a slow jail never delays
/// another's probe; false when no thread could be started (retried at the
/// next interval).
fn start_probe(target: &Target, tx: &Sender<Outcome>, reports: &Arc<dyn Reports>) -> bool {
    let name = target.name.clone();
    let target = target.clone();
    let tx = tx.clone();
    let reports = Arc::clone(reports);
    let started = std::thread::Builder::new()
        .name("keel-health-probe".into())
        .spawn(move || {
            let result = match target.health.probe() {
                Some(p) => probe::run(
                    &p,
                    &target.name,
                    target.address,
                    target.health.timeout.0,
                    reports.as_ref(),
                ),
                None => Err("spec.health sets no probe".to_string()),
            };
            let _ = tx.send(Outcome {
                name: target.name,
                incarnation: target.incarnation,
                result,
            });
        });
    match started {
        Ok(_) => true,
        Err(e) => {
            log::warn!("health check of jail {name}: cannot start a thread: {e}");
            false
        }
    }
}

fn settle(tracked: &mut BTreeMap<String, Tracked>, outcome: Outcome, reports: &dyn Reports) {
    let Some(t) = tracked
        .get_mut(&outcome.name)
        .filter(|t| t.incarnation == outcome.incarnation)
    else {
        return;
    };
    t.in_flight = false;
    let passed = outcome.result.is_ok();
    let verdict = t.readiness.record(passed, Instant::now(), t.thresholds);
    let name = &outcome.name;
    match (verdict, outcome.result) {
        (Verdict::Ready, _) => {
            log::info!("jail {name} is ready");
            reports.readiness(name, t.incarnation, true, None);
        }
        (Verdict::NotReady, Err(why)) => {
            log::warn!("jail {name} is not ready: {why}");
            reports.readiness(name, t.incarnation, false, Some(why));
        }
        (Verdict::Restart, Err(why)) => {
            log::warn!("jail {name} failed its health check too often, restarting it: {why}");
            reports.restart(name, t.incarnation, why);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agentd::snapshot;
    use crate::common::config::Interval;
    use crate::common::spec::TcpProbe;
    use std::net::TcpListener;
    use std::sync::Mutex;

    struct Recorder(Mutex<Sender<(String, u64, &'static str)>>);

    impl ExecSeam for Recorder {
        fn exec(&self, _: &str, _: &[String], _: Duration) -> Result<(), String> {
            Err("no exec here".into())
        }
    }

    impl Reports for Recorder {
        fn readiness(&self, name: &str, incarnation: u64, ready: bool, _: Option<String>) {
            let what = if ready { "ready" } else { "not ready" };
            let _ = self
                .0
                .lock()
                .expect("lock")
                .send((name.into(), incarnation, what));
        }
        fn restart(&self, name: &str, incarnation: u64, _: String) {
            let _ = self
                .0
                .lock()
                .expect("lock")
                .send((name.into(), incarnation, "restart"));
        }
    }

    fn target(port: u16, incarnation: u64) -> Target {
        Target {
            name: "web".into(),
            incarnation,
            address: Ipv4Addr::LOCALHOST,
            health: HealthSpec {
                http: None,
                tcp: Some(TcpProbe { port }),
                exec: None,
                interval: Interval(Duration::from_millis(20)),
                timeout: Interval(Duration::from_millis(20)),
                failure_threshold: 2,
                start_period: Interval::default(),
            },
        }
    }

    type Told = mpsc::Receiver<(String, u64, &'static str)>;

    fn next(told: &Told) -> (String, u64, &'static str) {
        told.recv_timeout(Duration::from_secs(30))
            .expect("the checker reports within 30 s")
    }

    #[test]
    fn the_checker_reports_ready_then_not_ready_then_restart_and_ends_with_the_worker() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let (publisher, snapshot) = snapshot::channel(vec![target(port, 1)]);
        let (tx, told) = mpsc::channel();
        let checker = spawn(snapshot, Arc::new(Recorder(Mutex::new(tx)))).expect("spawn");

        assert_eq!(next(&told), ("web".into(), 1, "ready"));
        drop(listener);
        assert_eq!(next(&told), ("web".into(), 1, "not ready"));
        assert_eq!(next(&told), ("web".into(), 1, "restart"));

        // The restarted workload is a new incarnation: not ready until it passes.
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("rebind");
        publisher.publish(vec![target(port, 2)]);
        let mut seen = next(&told);
        while seen.1 == 1 {
            seen = next(&told);
        }
        assert_eq!(seen, ("web".into(), 2, "ready"));
        drop(listener);

        drop(publisher);
        checker
            .join()
            .expect("the checker ends when the snapshot closes");
    }
}
