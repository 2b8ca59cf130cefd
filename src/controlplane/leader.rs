//! Which control plane decides when several share one etcd: the holder of
//! the leader key.
//!
//! Each control plane grants itself a lease and tries to create
//! [`LEADER_KEY`] under it ([`campaign`]); the one that creates it leads,
//! and the key's create revision is the fence every one of its writes
//! compares ([`super::etcd_state`]). The others wait as standbys, renewing
//! their own leases every quarter of the lease and trying for the key
//! every [`STANDBY_TRY`] at most, and relay requests to the leader
//! meanwhile ([`super::standby`]), which `on_leader` tells them of. When the
//! leader's lease runs out (the process died, froze, or lost etcd), etcd
//! deletes the key and a standby creates it anew, at a higher revision.
//!
//! A leader keeps its lease on a thread of its own ([`Leadership::keep`]).
//! Once it cannot be sure it still holds the key (the lease is gone, the
//! key is another's, or no renewal succeeded for half the lease), it is
//! [`Deposed`]: from that instant every request is answered as a standby
//! answers ([`Leading`]), before any of it is read, and the daemon ends
//! the term (stops the worker) and campaigns again, a standby until it
//! wins. Half the lease, because a standby takes the key only once the
//! whole lease has run out: the deposed leader has stopped deciding well
//! before anyone else may start. The data plane does not notice: jails and
//! VIPs live on the nodes. A leader stopped by SIGTERM steps down
//! ([`Keeper::step_down`]): it revokes its lease, and a standby takes over
//! at its next try instead of waiting the lease out.
//!
//! A restart is no takeover: the lease a leader holds its key with is
//! recorded in its state directory ([`LEASE_FILE`]), and the next process
//! on that directory (which holds its lock, so the previous one is gone)
//! revokes it before it campaigns. Without that, a restarted leader would
//! wait out its own old lease as a standby.
//!
//! It must never decide anything about the cluster; it only says who may.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::http::{Handler, Request, Response};
use crate::common::store::{Store, StoreError};
use crate::controlplane::etcd::{Etcd, EtcdError, Lead, Lease, LeaseId};
use crate::controlplane::standby::standby_answer;

/// The lease of the last leader on this state directory.
pub const LEASE_FILE: &str = "leader-lease.json";

/// What [`LEASE_FILE`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct LeaseRecord {
    lease: i64,
}

/// Revokes the lease the previous process on `state_dir` led with, if it
/// recorded one: the key it held (if still held) goes at once. Errors are
/// logged: the campaign then waits the old lease out.
pub fn release_previous(etcd: &Etcd, state_dir: &std::path::Path) {
    match Store::<LeaseRecord>::open(state_dir, LEASE_FILE) {
        Ok((_, Some(record))) => match etcd.revoke(LeaseId(record.lease)) {
            Ok(()) => log::info!(
                "released the leader lease {} of the previous process on this state directory",
                LeaseId(record.lease)
            ),
            Err(e) => log::warn!("cannot release the previous leader lease: {e}"),
        },
        Ok((_, None)) => {}
        Err(e) => log::warn!("cannot read {LEASE_FILE}: {e}"),
    }
}

/// The leader key, relative to the cluster's prefix.
pub const LEADER_KEY: &str = "leader";

/// The lease a control plane holds its key with: half of `dead_after`, so
/// a standby takes over well within the time a node may stay silent, and
/// at least 2 s, about etcd's own minimum.
pub fn lease_ttl(dead_after: Duration) -> Duration {
    (dead_after / 2).max(Duration::from_secs(2))
}

/// The leader key, held.
pub struct Leadership {
    etcd: Arc<Etcd>,
    lease: Lease,
    /// The key's create revision: the fence of every write.
    pub fence: i64,
    holder: String,
    /// When the last grant or renewal of the lease that succeeded was
    /// sent: etcd keeps the lease at least its TTL from then.
    renewed: Instant,
}

/// How often a standby tries for the leader key at most (a quarter of the
/// lease when that is shorter): a key released by a leader that stepped
/// down is taken within it, however long the lease. One small transaction
/// per standby each time.
pub const STANDBY_TRY: Duration = Duration::from_millis(500);

/// Waits until this control plane, named `holder` (see
/// [`super::standby::holder_name`]), holds the leader key with a lease of
/// `ttl`, calling `on_leader` with each new holder it sees meanwhile; `Ok(None)` when `stopping` says
/// so first (SIGTERM while a standby). etcd out of reach is waited out,
/// said in the log when it starts and when it ends; any other
/// error (a refusal: permissions, a TLS setting) ends the wait.
pub fn campaign(
    etcd: Arc<Etcd>,
    holder: &str,
    ttl: Duration,
    mut stopping: impl FnMut() -> bool,
    mut on_leader: impl FnMut(&str),
) -> Result<Option<Leadership>, EtcdError> {
    // The lease and when its last grant or renewal that succeeded was sent.
    let mut lease: Option<(Lease, Instant)> = None;
    let mut seen: Option<String> = None;
    let mut unreachable = false;
    let mut first = true;
    loop {
        if !std::mem::take(&mut first) {
            std::thread::sleep(STANDBY_TRY.min(ttl / 4));
        }
        if stopping() {
            if let Some((lease, _)) = lease {
                let _ = etcd.revoke(lease.id);
            }
            return Ok(None);
        }
        let sent = Instant::now();
        let renewal = match &lease {
            None => etcd.grant(ttl).map(|granted| lease = Some((granted, sent))),
            Some((held, renewed)) if renewed.elapsed() >= ttl / 4 => {
                etcd.keep_alive(held.id).map(|renewed| match renewed {
                    Some(_) => lease = lease.take().map(|(l, _)| (l, sent)),
                    // Expired while etcd was away: a new one at the next try.
                    None => lease = None,
                })
            }
            Some(_) => Ok(()),
        };
        let asked = renewal.and_then(|()| match &lease {
            Some((held, _)) => etcd.try_lead(LEADER_KEY, holder, held.id).map(Some),
            None => Ok(None),
        });
        match asked {
            Ok(answer) => {
                if std::mem::take(&mut unreachable) {
                    log::info!("standby: etcd answers again");
                }
                match (answer, lease) {
                    (Some(Lead::Held { revision }), Some((lease, renewed))) => {
                        log::info!("leading the cluster (leader key at revision {revision})");
                        return Ok(Some(Leadership {
                            etcd,
                            lease,
                            fence: revision,
                            holder: holder.to_string(),
                            renewed,
                        }));
                    }
                    (Some(Lead::Other { holder: other, .. }), _)
                        if seen.as_deref() != Some(other.as_str()) =>
                    {
                        log::info!("standby: {other} leads the cluster");
                        on_leader(&other);
                        seen = Some(other);
                    }
                    _ => {}
                }
            }
            Err(e) if e.is_unreachable() => {
                if !std::mem::replace(&mut unreachable, true) {
                    log::warn!("standby: etcd is out of reach, trying again: {e}");
                }
            }
            Err(e) => return Err(e),
        }
    }
}

impl Leadership {
    /// Records the lease in `state_dir` (see [`release_previous`]).
    pub fn record(&self, state_dir: &std::path::Path) -> Result<(), StoreError> {
        let (mut store, _) = Store::<LeaseRecord>::open(state_dir, LEASE_FILE)?;
        store.save(&LeaseRecord {
            lease: self.lease.id.0,
        })
    }

    /// Gives the key up before the term began: revokes the lease (the
    /// key goes with it) as far as etcd can be reached.
    pub fn resign(self) {
        if let Err(e) = self.etcd.revoke(self.lease.id) {
            log::info!("the lease {} was not revoked: {e}", self.lease.id);
        }
    }

    /// Renews the lease every quarter of it on a thread of its own, and
    /// checks the key is still this process's; a second thread, the
    /// watchdog, deposes this leader once half the lease has passed since
    /// the last renewal that succeeded was sent. The watchdog, not the
    /// renewal, keeps the deadline: an etcd call blocks for up to its own
    /// timeout, longer than the lease may have left, and a leader cut off
    /// from etcd must stop deciding before a standby can take the key, or
    /// agents would go on heartbeating to it while the new leader hears
    /// nothing from them. On the way out, `on_deposed` is called once
    /// (the daemon ends the term).
    pub fn keep(self, on_deposed: impl Fn() + Send + Sync + 'static) -> std::io::Result<Keeper> {
        let deposed = Deposed::default();
        let on_deposed: Arc<dyn Fn() + Send + Sync> = Arc::new(on_deposed);
        let depose = {
            let deposed = deposed.clone();
            move |why: &str| {
                if !deposed.0.swap(true, Ordering::SeqCst) {
                    log::error!(
                        "lost the leadership: {why}; this control plane stops deciding now and stands by"
                    );
                    on_deposed();
                }
            }
        };
        // From the campaign's last renewal, not from now: reading the
        // state took time the lease was already running.
        let renewed = Arc::new(Mutex::new(self.renewed));
        let ttl = self.lease.ttl;
        let keeper = Keeper {
            etcd: Arc::clone(&self.etcd),
            lease: self.lease.id,
            deposed: deposed.clone(),
        };
        let (seen, renewer_depose, over) = (Arc::clone(&renewed), depose.clone(), deposed.clone());
        std::thread::Builder::new()
            .name("keel-leader".into())
            .spawn(move || {
                if let Some(why) = self.renew_until_lost(&seen, &over) {
                    renewer_depose(&why);
                }
                // Whatever the lease still holds goes at once; a lease
                // etcd cannot be asked about runs out on its own.
                if let Err(e) = self.etcd.revoke(self.lease.id) {
                    log::info!("the lease {} was not revoked: {e}", self.lease.id);
                }
            })?;
        std::thread::Builder::new()
            .name("keel-leader-watchdog".into())
            .spawn(move || {
                while !deposed.is_set() {
                    std::thread::sleep(ttl / 8);
                    let last = *renewed.lock().unwrap_or_else(|p| p.into_inner());
                    if last.elapsed() >= ttl / 2 {
                        depose(&format!(
                            "no renewal of its lease succeeded for {:?}, half the lease",
                            last.elapsed()
                        ));
                    }
                }
            })?;
        Ok(keeper)
    }

    /// Renews until the key is certainly lost (answers why) or `over` is
    /// set (answers `None`). Every renewal that succeeds moves `renewed`
    /// to when it was sent.
    fn renew_until_lost(&self, renewed: &Mutex<Instant>, over: &Deposed) -> Option<String> {
        let ttl = self.lease.ttl;
        // The first renewal at once: the state was read since the last one.
        let mut first = true;
        loop {
            if !std::mem::take(&mut first) {
                std::thread::sleep(ttl / 4);
            }
            if over.is_set() {
                return None;
            }
            let sent = Instant::now();
            match self.etcd.keep_alive(self.lease.id) {
                Ok(Some(_)) => {}
                Ok(None) => return Some(format!("its lease {} expired", self.lease.id)),
                Err(e) => {
                    log::warn!("cannot renew the leader lease (retrying): {e}");
                    continue;
                }
            }
            match self.etcd.try_lead(LEADER_KEY, &self.holder, self.lease.id) {
                Ok(Lead::Held { revision }) if revision == self.fence => {
                    *renewed.lock().unwrap_or_else(|p| p.into_inner()) = sent;
                }
                Ok(Lead::Held { revision }) | Ok(Lead::Other { revision, .. }) => {
                    return Some(format!(
                        "the leader key is now the one created at revision {revision}, not {}",
                        self.fence
                    ));
                }
                Err(e) => log::warn!("cannot read the leader key (retrying): {e}"),
            }
        }
    }
}

/// Set once a leader may have been replaced: see the module docs. Clones
/// share it.
#[derive(Debug, Clone, Default)]
pub struct Deposed(Arc<AtomicBool>);

impl Deposed {
    /// True once deposed (or stepped down).
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// The running side of [`Leadership::keep`].
pub struct Keeper {
    etcd: Arc<Etcd>,
    lease: LeaseId,
    deposed: Deposed,
}

impl Keeper {
    /// The flag the API checks before every request.
    pub fn deposed(&self) -> Deposed {
        self.deposed.clone()
    }

    /// Ends a term this process chose to end (SIGTERM): stops renewing and
    /// revokes the lease, so the leader key goes now and a standby takes it
    /// at its next try. Call it once the worker has stopped: nothing may be
    /// decided after the key is gone.
    pub fn step_down(self) {
        if self.deposed.0.swap(true, Ordering::SeqCst) {
            return;
        }
        match self.etcd.revoke(self.lease) {
            Ok(()) => log::info!("stepped down: the leader key is released"),
            Err(e) => log::warn!(
                "stepping down: cannot revoke the leader lease ({e}); a standby takes over once it runs out"
            ),
        }
    }
}

/// The leader's API behind the [`Deposed`] flag: once it is set, every
/// request gets [`standby_answer`] and reaches nothing else, so a deposed
/// leader decides nothing more even before its term has been wound down.
/// A request already inside `inner` finishes: what it wrote was fenced by
/// the leader key's revision, so it either landed while the key was this
/// process's or was refused.
pub struct Leading<H> {
    inner: H,
    deposed: Deposed,
}

impl<H: Handler> Leading<H> {
    /// `inner`, until `deposed` is set.
    pub fn new(inner: H, deposed: Deposed) -> Leading<H> {
        Leading { inner, deposed }
    }
}

impl<H: Handler> Handler for Leading<H> {
    fn handle(&self, req: Request) -> Response {
        if self.deposed.is_set() {
            return standby_answer();
        }
        self.inner.handle(req)
    }

    fn max_body_bytes(&self, method: &str, path: &str) -> Option<usize> {
        self.inner.max_body_bytes(method, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_is_half_of_dead_after_and_at_least_two_seconds() {
        assert_eq!(
            lease_ttl(Duration::from_secs(15)),
            Duration::from_millis(7500)
        );
        assert_eq!(lease_ttl(Duration::from_secs(2)), Duration::from_secs(2));
    }
}
