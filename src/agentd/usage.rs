//! The usage sampler: what each jail uses (CPU seconds, resident memory),
//! read every `agent.usage_interval` on a thread of its own and kept for
//! `/metrics`.
//!
//! The sampler reads the jail names the worker publishes (never a command
//! on the worker's queue) and asks the host's [`UsageProbe`] for all of them
//! at once; on FreeBSD that is one `rctl -u` per 64 jails, so a node with
//! thousands of jails spends tens of processes per interval, none of them
//! on the worker or in front of a heartbeat or a health check. A scrape
//! reads the last sample from [`UsageBoard`] and never waits for a read.
//!
//! A sample replaces the previous one whole: a jail that is gone, or that
//! the probe could not see, loses its series rather than keeping a stale
//! value. A failed read clears the board and is logged when the error
//! changes, not on every interval. A host without resource accounting
//! (RACCT absent or disabled, a boot-time setting) is logged once and not
//! asked again: the metrics then carry no usage series, only what each
//! spec requests.

use std::collections::BTreeMap;
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::agentd::worker::WorkerHandle;
use crate::common::sync::lock;
use crate::host::usage::{JailUsage, UsageError, UsageProbe};

/// The last sample, shared between the sampler and the metrics. Cheap to
/// clone.
#[derive(Clone, Default)]
pub struct UsageBoard {
    last: Arc<Mutex<BTreeMap<String, JailUsage>>>,
}

impl UsageBoard {
    /// An empty board: no usage known.
    pub fn new() -> UsageBoard {
        UsageBoard::default()
    }

    /// What the last sample read, by jail name.
    pub fn snapshot(&self) -> BTreeMap<String, JailUsage> {
        lock(&self.last).clone()
    }

    fn replace(&self, sample: BTreeMap<String, JailUsage>) {
        *lock(&self.last) = sample;
    }
}

/// What one round found, for the loop's logging.
#[derive(Debug, PartialEq)]
enum Round {
    /// Sampled (or nothing to sample).
    Read,
    /// The read failed with this message.
    Failed(String),
    /// The host keeps no accounting; stop asking.
    Unavailable(String),
    /// The worker is gone; the agent is stopping.
    WorkerGone,
}

/// One sample of every jail the worker published into `board`.
fn sample_once(probe: &dyn UsageProbe, worker: &WorkerHandle, board: &UsageBoard) -> Round {
    let Ok(jails) = worker.published_jails() else {
        return Round::WorkerGone;
    };
    let names: Vec<String> = jails
        .iter()
        .filter(|j| j.state.runs())
        .map(|j| j.name.clone())
        .collect();
    if names.is_empty() {
        board.replace(BTreeMap::new());
        return Round::Read;
    }
    match probe.sample(&names) {
        Ok(sample) => {
            board.replace(sample);
            Round::Read
        }
        Err(e @ UsageError::Unavailable(_)) => {
            board.replace(BTreeMap::new());
            Round::Unavailable(e.to_string())
        }
        Err(e) => {
            board.replace(BTreeMap::new());
            Round::Failed(e.to_string())
        }
    }
}

/// Starts the sampler: a sample at once, then one every `interval`, until
/// `stop` receives (or is dropped) or the worker is gone.
pub fn spawn(
    probe: Box<dyn UsageProbe>,
    worker: WorkerHandle,
    board: UsageBoard,
    interval: Duration,
    stop: Receiver<()>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("keel-usage".into())
        .spawn(move || {
            let mut last_error: Option<String> = None;
            loop {
                match sample_once(probe.as_ref(), &worker, &board) {
                    Round::Read => {
                        if last_error.take().is_some() {
                            log::info!("per-jail usage is read again");
                        }
                    }
                    Round::Failed(e) => {
                        if last_error.as_deref() != Some(e.as_str()) {
                            log::warn!("could not read per-jail usage: {e}");
                            last_error = Some(e);
                        }
                    }
                    Round::Unavailable(e) => {
                        log::info!("{e}; /metrics exports what each jail requests only");
                        return;
                    }
                    Round::WorkerGone => return,
                }
                // recv_timeout doubles as the sleep and the stop signal.
                if !matches!(
                    stop.recv_timeout(interval),
                    Err(mpsc::RecvTimeoutError::Timeout)
                ) {
                    return;
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agentd::fixtures::{fake_reconciler, jail};
    use crate::agentd::worker;
    use crate::host::fake::{CallLog, Faults};
    use crate::host::net::FakeNet;
    use crate::host::usage::FakeUsage;

    fn used(cpu: f64, memory: u64) -> JailUsage {
        JailUsage {
            cpu_seconds: cpu,
            memory_bytes: memory,
        }
    }

    #[test]
    fn a_sample_holds_the_running_jails_the_probe_sees_and_replaces_the_last() {
        let dir = tempfile::tempdir().expect("tempdir");
        let net = FakeNet::new(CallLog::new(), Faults::default());
        let (worker, _thread) = worker::spawn(fake_reconciler(dir.path(), net)).expect("worker");
        worker
            .apply(jail("web", None), None)
            .expect("worker")
            .expect("applied");
        // The worker publishes its statuses after answering a command and
        // before taking the next: once a later command is answered, the
        // apply's publication is there.
        worker.list().expect("worker");
        let probe = FakeUsage::new();
        probe.set("web", used(2.5, 4096));
        probe.set("gone", used(9.0, 1));
        let board = UsageBoard::new();
        board.replace([("stale".to_string(), used(1.0, 1))].into());

        assert_eq!(sample_once(&probe, &worker, &board), Round::Read);
        assert_eq!(
            board.snapshot(),
            [("web".to_string(), used(2.5, 4096))].into()
        );

        probe.set_unavailable();
        assert!(matches!(
            sample_once(&probe, &worker, &board),
            Round::Unavailable(msg) if msg.contains("kern.racct.enable=1")
        ));
        assert!(board.snapshot().is_empty(), "no stale usage");
        worker.shutdown();
    }

    #[test]
    fn nothing_running_asks_the_probe_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let net = FakeNet::new(CallLog::new(), Faults::default());
        let (worker, _thread) = worker::spawn(fake_reconciler(dir.path(), net)).expect("worker");
        let probe = FakeUsage::new();
        assert_eq!(
            sample_once(&probe, &worker, &UsageBoard::new()),
            Round::Read
        );
        assert_eq!(probe.samples(), 0);
        worker.shutdown();
    }

    #[test]
    fn the_sampler_ends_when_told_to() {
        let dir = tempfile::tempdir().expect("tempdir");
        let net = FakeNet::new(CallLog::new(), Faults::default());
        let (worker, _thread) = worker::spawn(fake_reconciler(dir.path(), net)).expect("worker");
        let (stop, stopped) = mpsc::channel();
        let thread = spawn(
            Box::new(FakeUsage::new()),
            worker.clone(),
            UsageBoard::new(),
            Duration::from_secs(3600),
            stopped,
        )
        .expect("spawn");
        drop(stop);
        thread.join().expect("the sampler ended");
        worker.shutdown();
    }
}
