//! Carrying heartbeat answers out without holding up the next heartbeat: the
//! cluster thread hands each answer (and, after registering, the subnet to
//! adopt) to [`Applier::submit`], which never waits, and the applier's own
//! thread gives it to the worker and then to the service proxy, in today's
//! order: the worker aliases the VIPs before the proxy listens on them.
//!
//! The hand-over is a slot holding one job, latest wins ([`LatestSlot`]).
//! While the worker is busy (a `jail -c` or `zfs` call that takes 30 s), the
//! heartbeats go on every interval and each answer replaces the one still
//! waiting, so when the worker is free it applies the newest answer only;
//! answers are never queued up behind a slow host. A replaced answer loses
//! nothing: every answer carries the whole picture (all peers, all
//! services), so the newest one supersedes the older ones entirely, and a
//! stale name it did not repeat was either no longer reported or no longer
//! stale.
//!
//! Fencing stays safe however late an answer is applied. Its fence list
//! names jails with the epoch the heartbeat reported
//! ([`crate::agentd::cluster::heartbeat::stale_placed`]), and the worker
//! deletes a jail only while it still carries that epoch
//! ([`crate::agentd::routes::apply_heartbeat`]). The control plane
//! gives every placement a new epoch and never reuses one, so "placement
//! (name, epoch) has moved off this node" stays true once it was: if the
//! jail was placed here again meanwhile it has a newer epoch and is kept;
//! if it still has the reported epoch it was stale then and is stale now.
//! Jails applied locally carry no epoch and are never fenced.
//!
//! The proxy is reached through the [`ProxyTable`] the endpoint watcher
//! shares ([`crate::agentd::cluster::watch`]): an answer whose endpoint
//! generation is not newer than the table the proxy already holds (a push
//! overtook it) still has the worker apply its routes, aliases and fences,
//! but leaves the proxy alone.
//!
//! It never talks to the control plane and never touches the host itself.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::agentd::cluster::watch::{ProxyTable, Stamp};
use crate::agentd::worker::{WorkerGone, WorkerHandle};
use crate::common::cidr::Ipv4Net;
use crate::common::sync::lock;
use crate::common::wire::{Peer, PlacedJail, ServiceEndpoints};

/// What the applier is asked to carry out.
#[derive(Debug, Clone, PartialEq)]
pub enum Job {
    /// Adopt the subnet the control plane assigned at registration. An
    /// [`Job::Answer`] replacing it loses nothing: applying an answer adopts
    /// its pod_cidr too.
    AdoptSubnet(Ipv4Net),
    /// Apply a heartbeat answer.
    Answer(Box<Answer>),
}

/// One heartbeat answer, as the worker and the proxy take it.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The node's pod_cidr.
    pub pod_cidr: Ipv4Net,
    /// Every other node.
    pub peers: Vec<Peer>,
    /// Service VIPs to alias on the bridge (empty with `agent.proxy_listen`).
    pub vips: BTreeSet<Ipv4Addr>,
    /// Placed jails the control plane named stale, with the epoch reported.
    pub fence: Vec<PlacedJail>,
    /// The services, for the proxy and (as `VIP:port` by name) the ingress.
    pub services: Vec<ServiceEndpoints>,
    /// The services' endpoint generation, when the control plane numbers them.
    pub stamp: Option<Stamp>,
}

/// A slot holding at most one value between threads: [`LatestSlot::put`]
/// replaces what is there and never waits, [`LatestSlot::take`] waits for a
/// value. Closing it wakes the taker with `None` and drops what is pending.
pub struct LatestSlot<T> {
    state: Mutex<SlotState<T>>,
    filled: Condvar,
}

struct SlotState<T> {
    pending: Option<T>,
    closed: bool,
}

impl<T> Default for LatestSlot<T> {
    fn default() -> Self {
        LatestSlot {
            state: Mutex::new(SlotState {
                pending: None,
                closed: false,
            }),
            filled: Condvar::new(),
        }
    }
}

impl<T> LatestSlot<T> {
    /// Makes `value` the pending one; true when it replaced one nobody took.
    pub fn put(&self, value: T) -> bool {
        let replaced = lock(&self.state).pending.replace(value).is_some();
        self.filled.notify_one();
        replaced
    }

    /// The pending value, waiting until there is one; `None` once closed.
    pub fn take(&self) -> Option<T> {
        let mut state = lock(&self.state);
        loop {
            if state.closed {
                return None;
            }
            if let Some(value) = state.pending.take() {
                return Some(value);
            }
            state = self.filled.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Wakes the taker with `None`, now and from then on.
    pub fn close(&self) {
        let mut state = lock(&self.state);
        state.closed = true;
        state.pending = None;
        drop(state);
        self.filled.notify_all();
    }
}

/// The applier thread and its slot; dropping it closes the slot and waits
/// for the job in progress (at most one worker command) to finish.
pub struct Applier {
    slot: Arc<LatestSlot<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Applier {
    /// Starts the thread that hands jobs to `worker`, then each answer's
    /// services to `proxy`. It ends when the worker is gone or the applier
    /// is dropped.
    pub fn spawn(worker: WorkerHandle, table: Arc<ProxyTable>) -> std::io::Result<Applier> {
        let mut last_problem: Option<String> = None;
        Applier::spawn_with(move |job| {
            let problem = carry_out(&worker, &table, job)?;
            // Once per change, like the heartbeat's own problems.
            if problem != last_problem {
                match &problem {
                    Some(p) => log::warn!("applying the control plane's answer: {p}"),
                    None => log::info!("the control plane's answers apply cleanly again"),
                }
                last_problem = problem;
            }
            Ok(())
        })
    }

    /// An applier running `apply` on every job it takes, until `apply`
    /// answers [`WorkerGone`] or the applier is dropped.
    pub fn spawn_with(
        mut apply: impl FnMut(Job) -> Result<(), WorkerGone> + Send + 'static,
    ) -> std::io::Result<Applier> {
        let slot = Arc::new(LatestSlot::default());
        let taken = Arc::clone(&slot);
        let thread = std::thread::Builder::new()
            .name("keel-cluster-apply".into())
            .spawn(move || {
                while let Some(job) = taken.take() {
                    if apply(job).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Applier {
            slot,
            thread: Some(thread),
        })
    }

    /// Hands `job` over without waiting; it replaces a job not yet taken.
    pub fn submit(&self, job: Job) {
        if self.slot.put(job) {
            log::debug!(
                "the worker is still busy; a newer heartbeat answer replaced the one waiting for it"
            );
        }
    }
}

impl Drop for Applier {
    fn drop(&mut self) {
        self.slot.close();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Runs one job on the worker (and the proxy); `Ok(Some(problems))` when
/// parts of it failed, the rest being done.
fn carry_out(
    worker: &WorkerHandle,
    table: &ProxyTable,
    job: Job,
) -> Result<Option<String>, WorkerGone> {
    match job {
        Job::AdoptSubnet(subnet) => Ok(worker.adopt_subnet(subnet)?.err().map(|e| {
            format!(
                "cannot adopt the node subnet {subnet} the control plane assigned: {e}; jails keep their addresses, retrying on every heartbeat"
            )
        })),
        Job::Answer(answer) => {
            let Answer {
                pod_cidr,
                peers,
                vips,
                fence,
                services,
                stamp,
            } = *answer;
            let backends: BTreeMap<String, SocketAddrV4> = services
                .iter()
                .map(|s| (s.name.clone(), SocketAddrV4::new(s.vip, s.port)))
                .collect();
            let outcome = worker.cluster_update(pod_cidr, peers, vips.clone(), backends, fence)?;
            // After the aliases exist: a listener on a VIP the host does not
            // have yet would fail to bind.
            let mut errors = outcome.errors;
            errors.extend(
                table
                    .from_heartbeat(stamp, vips, &services)
                    .iter()
                    .map(|e| e.to_string()),
            );
            Ok((!errors.is_empty()).then(|| errors.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    fn subnet(third: u8) -> Job {
        Job::AdoptSubnet(Ipv4Net::new(Ipv4Addr::new(10, 20, third, 0), 24).expect("prefix"))
    }

    #[test]
    fn the_slot_hands_over_only_the_newest_value() {
        let slot = LatestSlot::default();
        assert!(!slot.put(1), "nothing was waiting");
        assert!(slot.put(2), "1 was never taken");
        assert!(slot.put(3));
        assert_eq!(slot.take(), Some(3));
        assert!(!slot.put(4), "3 was taken");
        assert_eq!(slot.take(), Some(4));
    }

    #[test]
    fn closing_the_slot_wakes_a_waiting_taker_and_drops_the_pending_value() {
        let slot = Arc::new(LatestSlot::<u32>::default());
        let taker = {
            let slot = Arc::clone(&slot);
            std::thread::spawn(move || slot.take())
        };
        slot.close();
        assert_eq!(taker.join().expect("taker"), None);
        slot.put(7);
        assert_eq!(slot.take(), None, "closed stays closed");
    }

    #[test]
    fn answers_given_while_the_worker_is_busy_collapse_into_the_newest() {
        let (started_tx, started) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let (done_tx, done) = mpsc::channel();
        let applier = Applier::spawn_with(move |job| {
            started_tx.send(job.clone()).expect("test alive");
            // The first job stands for a worker stuck in a 30 s command.
            released.recv().expect("test alive");
            done_tx.send(job).expect("test alive");
            Ok(())
        })
        .expect("applier thread");

        applier.submit(subnet(1));
        assert_eq!(started.recv().expect("first job"), subnet(1));
        // The worker is busy: these never wait, and only the last survives.
        for third in 2..=5 {
            applier.submit(subnet(third));
        }
        release.send(()).expect("applier alive");
        assert_eq!(done.recv().expect("first done"), subnet(1));
        assert_eq!(started.recv().expect("next job"), subnet(5));
        release.send(()).expect("applier alive");
        assert_eq!(done.recv().expect("newest done"), subnet(5));
        drop(applier);
        assert!(
            started.recv().is_err(),
            "2, 3 and 4 were replaced, never applied"
        );
    }

    #[test]
    fn the_applier_stops_when_the_worker_is_gone() {
        let (seen_tx, seen) = mpsc::channel();
        let applier = Applier::spawn_with(move |job| {
            seen_tx.send(job).expect("test alive");
            Err(WorkerGone)
        })
        .expect("applier thread");
        applier.submit(subnet(1));
        assert_eq!(seen.recv().expect("first job"), subnet(1));
        // The thread has ended, dropping its sender: nothing more is applied.
        assert!(seen.recv().is_err());
        applier.submit(subnet(2));
        drop(applier);
    }
}
