//! Which control plane decides when several share one etcd: the holder of
//! the leader key.
//!
//! Each control plane grants itself a lease and tries to create
//! [`LEADER_KEY`] under it ([`campaign`]); the one that creates it leads,
//! and the key's create revision is the fence every one of its writes
//! compares ([`super::etcd_state`]). The others wait as standbys, renewing
//! their own leases and trying again every quarter of the lease, and
//! answer every request with [`standby_answer`] meanwhile. When the
//! leader's lease runs out (the process died, froze, or lost etcd), etcd
//! deletes the key and a standby creates it anew, at a higher revision.
//!
//! A leader keeps its lease on a thread of its own ([`Leadership::keep`]).
//! Once it cannot be sure it still holds the key (the lease is gone, the
//! key is another's, or no renewal succeeded for half the lease), it exits
//! the process: a control plane that may have been replaced must stop
//! deciding at once, and stopping is the one way that cannot fail half
//! way. The data plane does not notice: jails and VIPs live on the nodes.
//! Restarted (rc.d does it), it waits as a standby.
//!
//! A restart is no takeover: the lease a leader holds its key with is
//! recorded in its state directory ([`LEASE_FILE`]), and the next process
//! on that directory (which holds its lock, so the previous one is gone)
//! revokes it before it campaigns. Without that, a restarted leader would
//! wait out its own old lease as a standby.
//!
//! It must never decide anything about the cluster; it only says who may.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::http::Response;
use crate::common::http::failover::STANDBY_HEADER;
use crate::common::store::{Store, StoreError};
use crate::controlplane::etcd::{Etcd, EtcdError, Lead, Lease, LeaseId};

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

/// Exit status of a leader that lost its lease: EX_TEMPFAIL, since a
/// restart (as a standby) is the right answer.
pub const LOST_LEADERSHIP: i32 = 75;

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

/// Waits until this control plane, named `holder` (its API address), holds
/// the leader key with a lease of `ttl`; `Ok(None)` when `stopping` says
/// so first (SIGTERM while a standby).
pub fn campaign(
    etcd: Arc<Etcd>,
    holder: &str,
    ttl: Duration,
    mut stopping: impl FnMut() -> bool,
) -> Result<Option<Leadership>, EtcdError> {
    let mut renewed = Instant::now();
    let mut lease = etcd.grant(ttl)?;
    let mut seen: Option<String> = None;
    loop {
        if stopping() {
            let _ = etcd.revoke(lease.id);
            return Ok(None);
        }
        match etcd.try_lead(LEADER_KEY, holder, lease.id) {
            Ok(Lead::Held { revision }) => {
                log::info!("leading the cluster (leader key at revision {revision})");
                return Ok(Some(Leadership {
                    etcd,
                    lease,
                    fence: revision,
                    holder: holder.to_string(),
                    renewed,
                }));
            }
            Ok(Lead::Other { holder: other, .. }) => {
                if seen.as_deref() != Some(other.as_str()) {
                    log::info!("standby: {other} leads the cluster");
                    seen = Some(other);
                }
            }
            Err(e) => log::warn!("standby: cannot ask etcd for the leader key: {e}"),
        }
        let sent = Instant::now();
        match etcd.keep_alive(lease.id) {
            Ok(Some(_)) => renewed = sent,
            // Expired while etcd was away: a new one for the next try.
            Ok(None) => {
                lease = etcd.grant(ttl)?;
                renewed = sent;
            }
            Err(e) => log::warn!("standby: cannot renew its lease: {e}"),
        }
        std::thread::sleep(ttl / 4);
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

    /// Renews the lease every quarter of it on a thread of its own, and
    /// checks the key is still this process's; a second thread, the
    /// watchdog, exits the process with [`LOST_LEADERSHIP`] once half the
    /// lease has passed since the last renewal that succeeded was sent.
    /// The watchdog, not the renewal, keeps the deadline: an etcd call
    /// blocks for up to its own timeout, longer than the lease may have
    /// left, and a leader cut off from etcd must be gone before a standby
    /// can take the key, or agents would go on heartbeating to it while
    /// the new leader hears nothing from them.
    pub fn keep(self) -> std::io::Result<()> {
        // From the campaign's last renewal, not from now: reading the
        // state took time the lease was already running.
        let renewed = Arc::new(Mutex::new(self.renewed));
        let ttl = self.lease.ttl;
        let seen = Arc::clone(&renewed);
        std::thread::Builder::new()
            .name("keel-leader".into())
            .spawn(move || {
                let why = self.renew_until_lost(&seen);
                lost(&why);
            })?;
        std::thread::Builder::new()
            .name("keel-leader-watchdog".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(ttl / 8);
                    let last = *renewed.lock().unwrap_or_else(|p| p.into_inner());
                    if last.elapsed() >= ttl / 2 {
                        lost(&format!(
                            "no renewal of its lease succeeded for {:?}, half the lease",
                            last.elapsed()
                        ));
                    }
                }
            })?;
        Ok(())
    }

    /// Renews until the key is certainly lost; answers why. Every renewal
    /// that succeeds moves `renewed` to when it was sent.
    fn renew_until_lost(&self, renewed: &Mutex<Instant>) -> String {
        let ttl = self.lease.ttl;
        // The first renewal at once: the state was read since the last one.
        let mut first = true;
        loop {
            if !std::mem::take(&mut first) {
                std::thread::sleep(ttl / 4);
            }
            let sent = Instant::now();
            match self.etcd.keep_alive(self.lease.id) {
                Ok(Some(_)) => {}
                Ok(None) => return format!("its lease {} expired", self.lease.id),
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
                    return format!(
                        "the leader key is now the one created at revision {revision}, not {}",
                        self.fence
                    );
                }
                Err(e) => log::warn!("cannot read the leader key (retrying): {e}"),
            }
        }
    }
}

/// Logs why and exits: see the module docs.
fn lost(why: &str) -> ! {
    log::error!(
        "lost the leadership: {why}; exiting so that this control plane stops deciding at once (restarted, it waits as a standby)"
    );
    std::process::exit(LOST_LEADERSHIP);
}

/// The answer of a standby to every request: 503, with the header that
/// tells agents and keelctl to try the next control plane.
pub fn standby_answer() -> Response {
    Response::error(
        503,
        "this control plane is a standby: another one holds the leader key; send the request there (give keelctl and agents every control plane, --controlplane A,B)",
        None,
    )
    .with_header(STANDBY_HEADER, "1")
}

/// What a standby serves: [`standby_answer`] to everything.
pub struct Standby;

impl crate::common::http::Handler for Standby {
    fn handle(&self, _req: crate::common::http::Request) -> Response {
        standby_answer()
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

    #[test]
    fn a_standby_answer_is_a_503_that_says_so() {
        let r = standby_answer();
        assert_eq!(r.status, 503);
        assert!(
            r.headers
                .iter()
                .any(|(n, v)| n.eq_ignore_ascii_case(STANDBY_HEADER) && v == "1")
        );
    }
}
