//! Benchmark: how long the control plane is gone when its process dies,
//! on etcd (a standby takes over) and on the embedded journal (the process
//! is restarted on its state directory, what rc.d or `daemon -r` does),
//! side by side in one run, as distributions over seeded trials.
//!
//! **etcd failover.** A real 3-member etcd on loopback (Debian's
//! etcd-server, `tests/util/etcd.rs`), two release `keel-controlplane
//! --simulate` on it (`Cluster::etcd_controlplane_args`: the process
//! tests' 200 ms heartbeat interval, `dead_after` the default 15 s), one
//! leading and one standby, and one simulated agent (`n1`, heartbeating
//! every 200 ms, `Cluster::start_standard_agent_of`) given both. The leader
//! key's lease is `max(dead_after / 2, 2 s)` = 7.5 s, granted by etcd as
//! 8 s (leases are whole seconds; `Etcd::grant` rounds up) and renewed
//! every quarter of that, 2 s; the standby tries for the key every
//! `leader::STANDBY_TRY` (500 ms).
//! Per trial:
//!
//! 1. the kill's moment: the trial's phase, a seeded fraction of one lease
//!    period (8 s), after the leader was first seen leading (its renewals
//!    run from about then), whole periods later until there is time for
//!    what follows;
//! 2. a client loop starts one second before it: `keelctl apply` of a new
//!    jail, given both addresses, every 100 ms (the next one at once when a
//!    call took longer), each call's start, end and outcome kept; the kill
//!    waits for its first acknowledged apply;
//! 3. `kill -9` of the leader; measured from the kill: (a) when the
//!    standby's `GET /healthz` first answers 200 (it leads; polled every
//!    20 ms), (b) when an apply of the loop is first acknowledged after it
//!    (one that started before the kill and ends within 50 ms of it is the
//!    dying leader's answer reaching keelctl, not counted), (c) how many of
//!    the loop's calls failed from the kill until then, each failure
//!    printed, and (d) the node: an observer asks `GET /nodes` through both
//!    addresses every 50 ms for the whole run, and the trial's window (from
//!    its kill to the next one's) must hold no Dead answer; the new
//!    leader's own events must hold no `NodeDead` of `n1` from its takeover
//!    until it is killed in turn (or the run ends), which also covers a
//!    death too short for the observer to see. When `n1` is next seen Alive
//!    at the new leader (at once when the record of live nodes vouches for
//!    it, else at its first heartbeat there) is printed too;
//! 4. the killed process is started again on its state directory and
//!    waits as the new standby, so the next trial starts from two.
//!
//! **journal restart (baseline).** One `keel-controlplane --simulate` on
//! its embedded journal, the same timings, one agent (`n2`). Per trial,
//! after the etcd trial of the same number: the same client loop on its
//! one address; once an apply was acknowledged, `kill -9` at the trial's
//! phase of a wall-clock second, and at once the same process again on the
//! same state directory. The second is the period that decides a restart:
//! a daemon waits for the next whole second of the wall clock before it
//! serves (`replay_floor::start`, the replay protection across restarts).
//! Measured from the kill: (a) when its `/healthz` answers 200 (polled
//! every 10 ms by `Cluster::restart_controlplane`), (b) the first
//! acknowledged apply, as above, and the failed calls (for the record: with
//! one address, every call during the restart is refused).
//!
//! The phases are stratified (`util::seeded::stratified`): with N trials,
//! each lies in its own N-th of the period, in shuffled order. The seed is
//! printed; `KEEL_BENCH_SEED` replays the phases.
//!
//! Targets, every trial counting (not a median); the bench exits non-zero
//! when one is missed:
//! - every etcd failover's (b) within `dead_after` (15 s): agents and
//!   keelctl see a takeover as a pause no longer than the silence after
//!   which a node would be declared Dead;
//! - no trial with the node Dead (by the observer or the new leader's
//!   events): a failover must never cost a node;
//! - at most one failed keelctl call per failover: the one the dying leader
//!   had read (keelctl waits out the standbys' 503s itself).
//!
//! Printed as information: medians and worst of each measure, and the ratio
//! of the medians of (b) etcd / journal (no target: the lease, running out
//! 6 to 8 s after the kill, is the floor of the etcd figure).
//!
//! Run with `cargo bench --bench cp_failover` (Linux; etcd installed).
//! `KEEL_BENCH_TRIALS` sets the number of trials (default 10, about 3 min
//! in all); `KEEL_BENCH_QUICK=1` makes it 3 (about a minute), with the same
//! timings. The bench also exits non-zero when a daemon cannot be started
//! or a wait runs out (the test cluster's 30 s bound, with every daemon's
//! log). Every process it started (etcd members, control planes, agents,
//! simulated jails, the loop's keelctl) is stopped on every path, a panic
//! included, by the `Drop` of the test utilities and of the loop.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keel::common::config::Config;
use keel::common::wire::{EventsAnswer, Liveness, NodeStatus};
use keel::controlplane::leader::lease_ttl;

// The process tests' cluster and etcd, whose `Drop`s stop everything.
#[path = "../tests/util/mod.rs"]
mod util;
use util::cluster::{
    Cluster, controlplane_args_dead_after, free_port, keelctl_through_at, operator_call_through_at,
};
use util::etcd::EtcdCluster;
use util::seeded::{SplitMix64, stratified};

/// The client loop's pace.
const PACE: Duration = Duration::from_millis(100);
/// The observer's pace.
const OBSERVE: Duration = Duration::from_millis(50);
/// How long the client loop runs before the kill.
const LEAD_IN: Duration = Duration::from_secs(1);
/// An apply that started before the kill and ended within this after it
/// was answered by the dying process: keelctl only had to exit. The new
/// leader cannot answer that soon (an etcd takeover waits out the lease; a
/// restart starts a process and waits for a heartbeat).
const OLD_ANSWER: Duration = Duration::from_millis(50);
/// The agents' heartbeat interval (`Cluster::standard_agent_args`), for
/// the record.
const HEARTBEAT: Duration = Duration::from_millis(200);
const DEFAULT_TRIALS: usize = 10;
const QUICK_TRIALS: usize = 3;

fn address() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)))
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// A new jail: each acknowledged apply is a placement written to the
/// state (etcd or the journal), not an unchanged one answered from memory.
fn jail(name: &str) -> String {
    format!(
        "kind: Jail\nmetadata: {{name: {name}}}\nspec:\n  base: 14.2-RELEASE\n  \
         exec: {{start: [/bin/sleep, '3600']}}\n"
    )
}

/// One keelctl call of the loop.
#[derive(Debug, Clone)]
struct Call {
    start: Instant,
    end: Instant,
    /// The first line of keelctl's error when it failed.
    failure: Option<String>,
}

/// The client loop: `keelctl apply` of a new jail every [`PACE`], through
/// `list`. Stopped and joined when dropped, so no keelctl outlives a bench
/// that panics.
struct ApplyLoop {
    stop: Arc<AtomicBool>,
    calls: Arc<Mutex<Vec<Call>>>,
    thread: Option<JoinHandle<()>>,
}

impl ApplyLoop {
    fn start(dir: &Path, key: PathBuf, list: &str, prefix: String) -> ApplyLoop {
        let stop = Arc::new(AtomicBool::new(false));
        let calls = Arc::new(Mutex::new(Vec::new()));
        let (dir, list) = (dir.to_path_buf(), list.to_string());
        let thread = {
            let (stop, calls) = (Arc::clone(&stop), Arc::clone(&calls));
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) {
                    let start = Instant::now();
                    let name = format!("{prefix}-{i}");
                    let apply = ["apply", "-f", "-"];
                    let run = keelctl_through_at(&dir, &key, &list, &apply, Some(&jail(&name)));
                    let end = Instant::now();
                    // Without the jail's name, so that equal failures of
                    // different calls print as one, counted.
                    let failure = (run.code != 0).then(|| {
                        let why = run.stderr.lines().next().unwrap_or("(no message)");
                        format!("exit {}: {}", run.code, why.replace(&name, "NAME"))
                    });
                    lock(&calls).push(Call {
                        start,
                        end,
                        failure,
                    });
                    i += 1;
                    // A pace, not a condition: the client applies this often.
                    std::thread::sleep((start + PACE).saturating_duration_since(Instant::now()));
                }
            })
        };
        ApplyLoop {
            stop,
            calls,
            thread: Some(thread),
        }
    }

    fn acknowledged(&self) -> bool {
        lock(&self.calls).iter().any(|c| c.failure.is_none())
    }

    /// When the first apply acknowledged after `kill` ended (see the module
    /// doc for one that started before it).
    fn acknowledged_after(&self, kill: Instant) -> Option<Instant> {
        lock(&self.calls)
            .iter()
            .find(|c| {
                c.failure.is_none()
                    && c.end >= kill
                    && !(c.start < kill && c.end < kill + OLD_ANSWER)
            })
            .map(|c| c.end)
    }

    /// Stops the loop once its call in flight ends: every call it made.
    fn finish(mut self) -> Result<Vec<Call>, String> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread
                .join()
                .map_err(|_| "the apply loop panicked (see above)".to_string())?;
        }
        Ok(std::mem::take(&mut *lock(&self.calls)))
    }
}

impl Drop for ApplyLoop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What one `GET /nodes` through both addresses said of the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// No control plane led (only standbys, or nothing, answered).
    NoLeader,
    /// A leader answered without the node, or with a body that is no list.
    Absent,
    Is(Liveness),
}

impl std::fmt::Display for Seen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Seen::NoLeader => f.write_str("no leader"),
            Seen::Absent => f.write_str("absent"),
            Seen::Is(l) => write!(f, "{l}"),
        }
    }
}

/// Asks the control planes of `list` for node `id` every [`OBSERVE`] for
/// as long as it lives; keeps every change, timed. Stopped when dropped.
struct Observer {
    stop: Arc<AtomicBool>,
    changes: Arc<Mutex<Vec<(Instant, Seen)>>>,
    thread: Option<JoinHandle<()>>,
}

impl Observer {
    fn start(key: PathBuf, list: &str, id: &str) -> Observer {
        let stop = Arc::new(AtomicBool::new(false));
        let changes = Arc::new(Mutex::new(Vec::new()));
        let (list, id) = (list.to_string(), id.to_string());
        let thread = {
            let (stop, changes) = (Arc::clone(&stop), Arc::clone(&changes));
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let asked = Instant::now();
                    let seen = match operator_call_through_at(&key, &list, "GET", "/nodes", b"") {
                        Some(r) if r.status == 200 => {
                            serde_json::from_slice::<Vec<NodeStatus>>(&r.body)
                                .ok()
                                .and_then(|nodes| nodes.into_iter().find(|n| n.node_id == id))
                                .map_or(Seen::Absent, |n| Seen::Is(n.status))
                        }
                        _ => Seen::NoLeader,
                    };
                    let mut changes = lock(&changes);
                    if changes.last().is_none_or(|(_, last)| *last != seen) {
                        changes.push((Instant::now(), seen));
                    }
                    drop(changes);
                    // A pace, not a condition: the observer samples.
                    std::thread::sleep((asked + OBSERVE).saturating_duration_since(Instant::now()));
                }
            })
        };
        Observer {
            stop,
            changes,
            thread: Some(thread),
        }
    }

    /// When the node was first seen Alive again after `kill`: after the
    /// first answer that no leader gave (the old leader's answers end
    /// there), so from the new leader.
    fn alive_again(&self, kill: Instant) -> Option<Instant> {
        let changes = lock(&self.changes);
        let gap = changes
            .iter()
            .position(|(t, s)| *t >= kill && *s == Seen::NoLeader)?;
        changes[gap..]
            .iter()
            .find(|(_, s)| *s == Seen::Is(Liveness::Alive))
            .map(|(t, _)| *t)
    }

    /// What the node was seen as from `from` to `to` (`None`: to now): the
    /// state at `from`, then every change.
    fn seen_between(&self, from: Instant, to: Option<Instant>) -> Vec<Seen> {
        let changes = lock(&self.changes);
        let at_start = changes.iter().rev().find(|(t, _)| *t < from);
        at_start
            .into_iter()
            .chain(
                changes
                    .iter()
                    .filter(|(t, _)| *t >= from && to.is_none_or(|to| *t < to)),
            )
            .map(|(_, s)| *s)
            .collect()
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `NodeDead` events of node `id` the leading control plane of `list`
/// recorded (its own ring, kept across its restarts: compare two counts).
fn node_dead_events(cluster: &Cluster, list: &str, id: &str) -> Result<usize, String> {
    let path = format!("/events?for=node/{id}");
    let r = cluster
        .operator_call_through(list, "GET", &path, b"")
        .ok_or_else(|| format!("GET {path}: no control plane answered"))?;
    if r.status != 200 {
        return Err(format!(
            "GET {path}: {} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        ));
    }
    let answer: EventsAnswer =
        serde_json::from_slice(&r.body).map_err(|e| format!("GET {path}: {e}"))?;
    Ok(answer
        .events
        .iter()
        .filter(|e| {
            e.reason == "NodeDead" && e.name == id && e.source.as_deref() == Some("controlplane")
        })
        .count())
}

/// Which of the etcd cluster's control plane processes: the first one
/// started (`Cluster::start_controlplane`) or a standby, by index. Once
/// killed, the first one comes back as a standby.
#[derive(Debug, Clone, Copy)]
enum Process {
    First,
    Standby(usize),
}

/// The leading control plane on etcd: its process and which of the two
/// argument lists (address and state directory) it runs with.
#[derive(Debug, Clone, Copy)]
struct Leader {
    process: Process,
    args: usize,
}

/// The standby: its index among the cluster's standbys, and its arguments.
#[derive(Debug, Clone, Copy)]
struct Standby {
    index: usize,
    args: usize,
}

/// One etcd failover, measured from the kill.
struct EtcdTrial {
    /// The kill's place in the lease period (from the leader's start).
    phase: Duration,
    leads: Duration,
    applied: Duration,
    failures: Vec<String>,
    failed_before: usize,
    alive_again: Duration,
    /// The node as the observer saw it from this kill to the next.
    seen: Vec<Seen>,
    /// `NodeDead` events the new leader recorded while it led.
    dead_events: usize,
    calls: usize,
}

impl EtcdTrial {
    fn dead(&self) -> bool {
        self.dead_events > 0 || self.seen.contains(&Seen::Is(Liveness::Dead))
    }
}

/// One journal restart, measured from the kill.
struct JournalTrial {
    phase: Duration,
    serves: Duration,
    applied: Duration,
    failures: Vec<String>,
    failed_before: usize,
    calls: usize,
}

/// The failed calls that ended after `kill`, and how many ended failed
/// before it (none should).
fn failures(calls: &[Call], kill: Instant) -> (Vec<String>, usize) {
    let after = calls
        .iter()
        .filter(|c| c.end >= kill)
        .filter_map(|c| c.failure.clone())
        .collect();
    let before = calls
        .iter()
        .filter(|c| c.end < kill && c.failure.is_some())
        .count();
    (after, before)
}

/// The etcd side: the cluster, its two argument lists, who leads.
struct Ha {
    cluster: Cluster,
    args: [Vec<String>; 2],
    both: String,
    leader: Leader,
    standby: Standby,
    /// When the leader was first seen leading.
    led_since: Instant,
    /// Its `NodeDead` events of `n1` then.
    dead_events_then: usize,
}

impl Ha {
    fn kill_leader(&mut self) {
        match self.leader.process {
            Process::First => self.cluster.kill9_controlplane(),
            Process::Standby(i) => self.cluster.kill9_standby(i),
        }
    }
}

/// One etcd trial (see the module doc). Also answers how many `NodeDead`
/// events of `n1` the leader it killed recorded while it led.
fn etcd_trial(
    ha: &mut Ha,
    observer: &Observer,
    trial: usize,
    phase: f64,
    lease: Duration,
) -> Result<(EtcdTrial, Instant, usize), String> {
    let reference = ha.led_since;
    let mut kill_at = reference + lease.mul_f64(phase);
    while kill_at < Instant::now() + LEAD_IN {
        kill_at += lease;
    }
    // The kill's moment is the scenario: there is no condition to await.
    std::thread::sleep((kill_at - LEAD_IN).saturating_duration_since(Instant::now()));
    let tenure_dead =
        node_dead_events(&ha.cluster, &ha.both, "n1")?.saturating_sub(ha.dead_events_then);
    let key = ha.cluster.operator_key();
    let client = ApplyLoop::start(ha.cluster.dir(), key, &ha.both, format!("e{trial}"));
    ha.cluster
        .wait_for("an apply acknowledged before the kill", || {
            client.acknowledged().then_some(())
        });
    while kill_at < Instant::now() {
        kill_at += lease;
    }
    std::thread::sleep(kill_at.saturating_duration_since(Instant::now()));

    let killed = Instant::now();
    ha.kill_leader();
    let survivor = ha.standby.index;
    let led = ha.cluster.wait_for("the standby to lead", || {
        (ha.cluster.standby_answers(survivor)? == 200).then(Instant::now)
    });
    let applied = ha
        .cluster
        .wait_for("an apply acknowledged by the new leader", || {
            client.acknowledged_after(killed)
        });
    let alive = ha.cluster.wait_for("n1 Alive at the new leader", || {
        observer.alive_again(killed)
    });
    let calls = client.finish()?;
    let (failures, failed_before) = failures(&calls, killed);

    // The killed process waits as the next standby; the survivor leads.
    let restarted = ha.cluster.start_standby(&strs(&ha.args[ha.leader.args]));
    let survivor = ha.standby;
    ha.standby = Standby {
        index: restarted,
        args: ha.leader.args,
    };
    ha.leader = Leader {
        process: Process::Standby(survivor.index),
        args: survivor.args,
    };
    ha.led_since = led;
    ha.dead_events_then = node_dead_events(&ha.cluster, &ha.both, "n1")?;

    let since = killed.duration_since(reference).as_secs_f64();
    let result = EtcdTrial {
        phase: Duration::from_secs_f64(since % lease.as_secs_f64()),
        leads: led - killed,
        applied: applied - killed,
        failures,
        failed_before,
        alive_again: alive - killed,
        // Known once the next trial's kill (or the run's end) closes the
        // window.
        seen: Vec::new(),
        dead_events: 0,
        calls: calls.len(),
    };
    Ok((result, killed, tenure_dead))
}

/// One journal restart (see the module doc).
fn journal_trial(
    solo: &mut Cluster,
    addr: &str,
    trial: usize,
    phase: f64,
) -> Result<JournalTrial, String> {
    let client = ApplyLoop::start(solo.dir(), solo.operator_key(), addr, format!("j{trial}"));
    solo.wait_for("an apply acknowledged before the kill", || {
        client.acknowledged().then_some(())
    });
    let wall = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
    };
    let now = wall();
    let at = Duration::from_secs(now.as_secs() + 1) + Duration::from_secs_f64(phase);
    // As above: the moment is the scenario.
    std::thread::sleep(at.saturating_sub(now));
    let killed = Instant::now();
    let phase = Duration::from_nanos(u64::from(wall().subsec_nanos()));
    solo.kill9_controlplane();
    solo.restart_controlplane();
    let serves = killed.elapsed();
    let applied = solo.wait_for("an apply acknowledged after the restart", || {
        client.acknowledged_after(killed)
    });
    let calls = client.finish()?;
    let (failures, failed_before) = failures(&calls, killed);
    Ok(JournalTrial {
        phase,
        serves,
        applied: applied - killed,
        failures,
        failed_before,
        calls: calls.len(),
    })
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn worst(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn env_number<T: std::str::FromStr>(name: &str) -> Result<Option<T>, String> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map(Some)
            .map_err(|_| format!("{name}={v:?} is not a number")),
        Err(_) => Ok(None),
    }
}

fn seen_path(seen: &[Seen]) -> String {
    seen.iter()
        .map(Seen::to_string)
        .collect::<Vec<_>>()
        .join(" > ")
}

/// `F of N calls failed`, the failures before the kill if any (there
/// should be none), then each distinct failure with how often it happened.
fn failed_calls(failures: &[String], calls: usize, failed_before: usize) -> String {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for f in failures {
        match counts.iter_mut().find(|(g, _)| g == f) {
            Some((_, n)) => *n += 1,
            None => counts.push((f, 1)),
        }
    }
    let mut line = format!("{} of {calls} calls failed after the kill", failures.len());
    if failed_before > 0 {
        line.push_str(&format!(", {failed_before} BEFORE it"));
    }
    for (f, n) in counts {
        line.push_str(&format!("\n    {n} x {f}"));
    }
    line
}

fn run() -> Result<bool, String> {
    let quick = std::env::var("KEEL_BENCH_QUICK").is_ok_and(|v| v == "1");
    let default_trials = if quick { QUICK_TRIALS } else { DEFAULT_TRIALS };
    let trials: usize = env_number("KEEL_BENCH_TRIALS")?
        .unwrap_or(default_trials)
        .max(1);
    let seed: u64 = match env_number("KEEL_BENCH_SEED")? {
        Some(s) => s,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
    };
    let dead_after = Config::default().controlplane.dead_after.0;
    // etcd leases are whole seconds: `Etcd::grant` asks for the next one up
    // from `lease_ttl`, and the leader renews every quarter of what it got.
    let asked = lease_ttl(dead_after);
    let lease = Duration::from_secs(asked.as_secs() + u64::from(asked.subsec_nanos() > 0));
    let mut rng = SplitMix64(seed);
    let etcd_phases = stratified(trials, &mut rng);
    let journal_phases = stratified(trials, &mut rng);
    let load_before = load_average();
    println!(
        "cp_failover: {trials} trials{}, seed {seed}, dead_after {dead_after:?}, lease {lease:?} (lease_ttl {asked:?}), heartbeats every {HEARTBEAT:?}, load average {load_before}",
        if quick { " (quick)" } else { "" },
    );

    let etcd = EtcdCluster::start("cp_failover", 3)
        .ok_or("etcd is not installed (Debian package etcd-server)")?;
    let endpoints = etcd.endpoints().join(",");
    let (first, second) = (address(), address());
    if first == second {
        return Err(format!("the same free port twice: {first}"));
    }
    let both = format!("{first},{second}");
    let mut cluster = Cluster::new();
    let args = [
        cluster.etcd_controlplane_args(first, "cp1", &endpoints, dead_after),
        cluster.etcd_controlplane_args(second, "cp2", &endpoints, dead_after),
    ];
    cluster.start_controlplane(&strs(&args[0]));
    let led_since = Instant::now();
    let standby = cluster.start_standby(&strs(&args[1]));
    cluster.start_standard_agent_of(1, &both);
    let mut ha = Ha {
        cluster,
        args,
        both,
        leader: Leader {
            process: Process::First,
            args: 0,
        },
        standby: Standby {
            index: standby,
            args: 1,
        },
        led_since,
        dead_events_then: 0,
    };
    let observer = Observer::start(ha.cluster.operator_key(), &ha.both, "n1");
    ha.cluster.wait_for("n1 Alive on etcd", || {
        observer
            .seen_between(Instant::now(), None)
            .contains(&Seen::Is(Liveness::Alive))
            .then_some(())
    });
    ha.dead_events_then = node_dead_events(&ha.cluster, &ha.both, "n1")?;

    let solo_addr = address();
    let mut solo = Cluster::new();
    solo.start_controlplane(&strs(&controlplane_args_dead_after(solo_addr, dead_after)));
    solo.start_standard_agent(2);
    solo.wait_alive(1);
    let solo_addr = solo_addr.to_string();

    let mut etcd_results: Vec<EtcdTrial> = Vec::new();
    let mut kills: Vec<Instant> = Vec::new();
    let mut journal_results: Vec<JournalTrial> = Vec::new();
    let mut setup_dead = 0;
    for (trial, (&etcd_phase, &journal_phase)) in
        etcd_phases.iter().zip(&journal_phases).enumerate()
    {
        let (result, killed, tenure_dead) =
            etcd_trial(&mut ha, &observer, trial, etcd_phase, lease)?;
        // The killed leader's tenure began with the previous trial's
        // failover (or the start).
        match etcd_results.last_mut() {
            Some(previous) => {
                previous.dead_events = tenure_dead;
                previous.seen =
                    observer.seen_between(*kills.last().expect("a kill per result"), Some(killed));
            }
            None => setup_dead = tenure_dead,
        }
        println!(
            "etcd trial {:>2}: kill -9 of the leader {:.2} s into its lease period; the standby leads after {:.2} s, an apply acknowledged after {:.2} s, n1 Alive at the new leader after {:.2} s; {}",
            trial + 1,
            secs(result.phase),
            secs(result.leads),
            secs(result.applied),
            secs(result.alive_again),
            failed_calls(&result.failures, result.calls, result.failed_before),
        );
        etcd_results.push(result);
        kills.push(killed);

        let j = journal_trial(&mut solo, &solo_addr, trial, journal_phase)?;
        println!(
            "journal trial {:>2}: kill -9 {:.3} s into a wall-clock second and restart at once; /healthz 200 after {:.3} s, an apply acknowledged after {:.3} s; {}",
            trial + 1,
            secs(j.phase),
            secs(j.serves),
            secs(j.applied),
            failed_calls(&j.failures, j.calls, j.failed_before),
        );
        journal_results.push(j);
    }
    // The last window: from the last kill to now, and the last leader's
    // events while it led.
    let last_dead =
        node_dead_events(&ha.cluster, &ha.both, "n1")?.saturating_sub(ha.dead_events_then);
    if let (Some(last), Some(killed)) = (etcd_results.last_mut(), kills.last()) {
        last.dead_events = last_dead;
        last.seen = observer.seen_between(*killed, None);
    }
    let load_after = load_average();
    drop(observer);
    Ok(report(
        &etcd_results,
        &journal_results,
        setup_dead,
        dead_after,
        seed,
        &load_before,
        &load_after,
    ))
}

/// Prints the summary and the verdicts; true when every target is met.
fn report(
    etcd: &[EtcdTrial],
    journal: &[JournalTrial],
    setup_dead: usize,
    dead_after: Duration,
    seed: u64,
    before: &str,
    after: &str,
) -> bool {
    println!();
    for (i, t) in etcd.iter().enumerate() {
        println!(
            "etcd trial {:>2}: n1 seen {} until the next kill; NodeDead events of the new leader: {}",
            i + 1,
            seen_path(&t.seen),
            t.dead_events
        );
    }
    let leads: Vec<f64> = etcd.iter().map(|t| secs(t.leads)).collect();
    let applied: Vec<f64> = etcd.iter().map(|t| secs(t.applied)).collect();
    let alive: Vec<f64> = etcd.iter().map(|t| secs(t.alive_again)).collect();
    let failed: Vec<f64> = etcd.iter().map(|t| t.failures.len() as f64).collect();
    let j_serves: Vec<f64> = journal.iter().map(|t| secs(t.serves)).collect();
    let j_applied: Vec<f64> = journal.iter().map(|t| secs(t.applied)).collect();
    let j_failed: Vec<f64> = journal.iter().map(|t| t.failures.len() as f64).collect();
    let dead_trials = etcd.iter().filter(|t| t.dead()).count();
    let early = etcd
        .iter()
        .filter(|t| t.applied + Duration::from_millis(100) < t.leads)
        .count();

    let bound = secs(dead_after);
    let applied_met = worst(&applied) <= bound;
    let dead_met = dead_trials == 0 && setup_dead == 0;
    let failed_met = worst(&failed) <= 1.0;
    let verdict = |met: bool| if met { "met" } else { "MISSED" };

    println!();
    println!(
        "{} trials each, seed {seed}, load average {before} at the start, {after} at the end",
        etcd.len()
    );
    println!(
        "| measure (from the kill -9) | etcd failover median | worst | journal restart median | worst | target (every etcd trial) | |"
    );
    println!("|---|---:|---:|---:|---:|---|---|");
    println!(
        "| (a) control plane serving (`/healthz` 200) | {:.2} s | {:.2} s | {:.3} s | {:.3} s | – | |",
        median(leads.clone()),
        worst(&leads),
        median(j_serves.clone()),
        worst(&j_serves),
    );
    println!(
        "| (b) keelctl apply acknowledged | {:.2} s | {:.2} s | {:.3} s | {:.3} s | ≤ dead_after = {bound:.0} s | {} |",
        median(applied.clone()),
        worst(&applied),
        median(j_applied.clone()),
        worst(&j_applied),
        verdict(applied_met),
    );
    println!(
        "| (c) failed keelctl calls | {} | {} | {} | {} | ≤ 1 per failover | {} |",
        median(failed.clone()),
        worst(&failed),
        median(j_failed.clone()),
        worst(&j_failed),
        verdict(failed_met),
    );
    println!(
        "| (d) trials with the node Dead | {dead_trials} of {} | – | – | – | 0 | {} |",
        etcd.len(),
        verdict(dead_met),
    );
    println!(
        "| node Alive at the new leader | {:.2} s | {:.2} s | – | – | – | |",
        median(alive.clone()),
        worst(&alive),
    );
    let ratio = median(applied) / median(j_applied).max(f64::EPSILON);
    println!();
    println!(
        "ratio of the medians of (b), etcd failover / journal restart: x{ratio:.1} (no target: the lease is the floor of the etcd figure)"
    );
    if setup_dead > 0 {
        println!(
            "the first leader recorded {setup_dead} NodeDead event(s) of n1 before the first kill"
        );
    }
    if early > 0 {
        println!(
            "{early} etcd trial(s) had an apply acknowledged more than 0.1 s before the standby was seen leading: the dying leader's answer, counted as the new one's?"
        );
    }
    applied_met && dead_met && failed_met
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; nothing here takes arguments.
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("cp_failover bench: a target was missed (see the table above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("cp_failover bench: {e}");
            ExitCode::FAILURE
        }
    }
}
