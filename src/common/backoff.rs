//! Crash-loop backoff, one independent schedule per key (a jail name, an
//! ingress host, the pf anchor).
//!
//! The policy is the seed's: the first retry waits 1 s, each further failure
//! doubles the wait up to a 5 min cap, and a key that stayed up for 60 s since
//! its last start begins again at 1 s. [`Backoff`] only does the bookkeeping:
//! every method takes `now` from the caller, who reads it from an injected
//! [`Clock`] ([`SystemClock`] in the daemons, [`ManualClock`] in tests), so
//! tests step through minutes of backoff without sleeping.
//!
//! Must never: sleep, spawn, read the clock itself, or decide what a failure
//! is. It answers "may I try now?" and "how long until the next try?".
//!
//! Restart bookkeeping survives an agent restart through [`Snapshot`]:
//! `Instant`s cannot be persisted, so a snapshot keeps each key's restart count
//! and current delay, and a restored key may be tried at once (its deadline is
//! the moment of loading) while its next failure continues the doubling.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::common::sync::lock;

/// Wait before the first retry.
pub const INITIAL: Duration = Duration::from_secs(1);
/// The wait never grows beyond this.
pub const CAP: Duration = Duration::from_secs(300);
/// Uptime after which a key counts as healthy again and its wait resets.
pub const STABLE_AFTER: Duration = Duration::from_secs(60);

/// Where "now" comes from. Injected so tests control time.
pub trait Clock: Send + Sync {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// The real monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that only moves when told to. Clones share the same time, so a
/// test keeps one clone and hands another to the code under test.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<Instant>>);

impl ManualClock {
    /// A clock standing at the real current instant.
    pub fn new() -> ManualClock {
        ManualClock(Arc::new(Mutex::new(Instant::now())))
    }

    /// Moves every clone of this clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut now = lock(&self.0);
        *now += by;
    }
}

impl Default for ManualClock {
    fn default() -> ManualClock {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        *lock(&self.0)
    }
}

/// The numbers of a backoff schedule; [`Policy::default`] is
/// [`INITIAL`] / [`CAP`] / [`STABLE_AFTER`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Wait before the first retry; must be non-zero or doubling goes nowhere.
    pub initial: Duration,
    /// Upper bound of the wait; raised to `initial` if smaller.
    pub cap: Duration,
    /// Uptime after which the wait resets.
    pub stable_after: Duration,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            initial: INITIAL,
            cap: CAP,
            stable_after: STABLE_AFTER,
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Entry {
    restarts: u32,
    /// The wait handed out by the last failure; `None` once reset, so the
    /// next failure waits `initial`.
    delay: Option<Duration>,
    next_attempt: Option<Instant>,
    started_at: Option<Instant>,
}

/// Per-key crash-loop backoff. See the module docs for the policy.
///
/// Typical use by a reconciler, per key and pass: if the thing is down and
/// [`Backoff::ready`], try to start it; on success [`Backoff::record_started`],
/// on failure (or when a started thing is found dead) [`Backoff::record_failure`];
/// while it runs, [`Backoff::record_stable_check`].
#[derive(Debug, Clone)]
pub struct Backoff<K: Ord + Clone> {
    policy: Policy,
    entries: BTreeMap<K, Entry>,
}

impl<K: Ord + Clone> Default for Backoff<K> {
    fn default() -> Backoff<K> {
        Backoff::new()
    }
}

impl<K: Ord + Clone> Backoff<K> {
    /// Backoff with the default policy (1 s doubling to 5 min, reset after 60 s).
    pub fn new() -> Backoff<K> {
        Backoff::with_policy(Policy::default())
    }

    /// Backoff with other numbers (tests, the ingress and pf retry loops).
    pub fn with_policy(policy: Policy) -> Backoff<K> {
        let policy = Policy {
            cap: policy.cap.max(policy.initial),
            ..policy
        };
        Backoff {
            policy,
            entries: BTreeMap::new(),
        }
    }

    /// The policy in force.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Records that `key` failed (did not start, or was found dead) at `now`
    /// and returns how long to wait before the next attempt. A key that had
    /// been up for at least `stable_after` since its last start starts over at
    /// `initial`, even if no stable check saw it.
    pub fn record_failure(&mut self, key: &K, now: Instant) -> Duration {
        let policy = self.policy;
        let entry = self.entries.entry(key.clone()).or_default();
        if let Some(started) = entry.started_at.take() {
            if now.saturating_duration_since(started) >= policy.stable_after {
                entry.delay = None;
            }
        }
        let delay = match entry.delay {
            None => policy.initial,
            Some(last) => last.saturating_mul(2).min(policy.cap),
        };
        entry.delay = Some(delay);
        entry.restarts = entry.restarts.saturating_add(1);
        // Only a configured cap of centuries could overflow an Instant; then
        // retrying at once beats panicking the worker.
        entry.next_attempt = Some(now.checked_add(delay).unwrap_or(now));
        delay
    }

    /// True when `key` may be tried at `now`: it never failed, or its wait is
    /// over.
    pub fn ready(&self, key: &K, now: Instant) -> bool {
        self.next_attempt(key).is_none_or(|at| now >= at)
    }

    /// Records that `key` was started (or found running) at `now`; its uptime
    /// counts from here.
    pub fn record_started(&mut self, key: &K, now: Instant) {
        self.entries.entry(key.clone()).or_default().started_at = Some(now);
    }

    /// Resets the wait of `key` when it has been up for at least
    /// `stable_after` since [`Backoff::record_started`]. Returns true when it
    /// did. The restart count is kept: it is history, not schedule.
    pub fn record_stable_check(&mut self, key: &K, now: Instant) -> bool {
        let stable_after = self.policy.stable_after;
        let Some(entry) = self.entries.get_mut(key) else {
            return false;
        };
        let stable = entry
            .started_at
            .is_some_and(|s| now.saturating_duration_since(s) >= stable_after);
        if stable && entry.delay.is_some() {
            entry.delay = None;
            entry.next_attempt = None;
            return true;
        }
        false
    }

    /// Drops everything known about `key` (the jail was deleted).
    pub fn forget(&mut self, key: &K) {
        self.entries.remove(key);
    }

    /// Number of keys with a record (failed, started or restored, and not
    /// forgotten since).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no key has a record.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// How many failures `key` has had since it was first seen or forgotten.
    pub fn restarts(&self, key: &K) -> u32 {
        self.entries.get(key).map_or(0, |e| e.restarts)
    }

    /// When `key` may next be tried; `None` when it may be tried any time.
    pub fn next_attempt(&self, key: &K) -> Option<Instant> {
        self.entries.get(key).and_then(|e| e.next_attempt)
    }

    /// The wait the last failure of `key` handed out; `None` when it has not
    /// failed since it was last reset.
    pub fn current_delay(&self, key: &K) -> Option<Duration> {
        self.entries.get(key).and_then(|e| e.delay)
    }

    /// What to persist: restart count and current wait per key.
    pub fn snapshot(&self) -> Snapshot<K> {
        Snapshot {
            entries: self
                .entries
                .keys()
                .filter_map(|key| self.snapshot_of(key))
                .collect(),
        }
    }

    /// What to persist of `key` alone (its entry of [`Backoff::snapshot`]),
    /// for state kept one record per key; `None` when it has no record.
    pub fn snapshot_of(&self, key: &K) -> Option<SnapshotEntry<K>> {
        self.entries.get(key).map(|e| SnapshotEntry {
            key: key.clone(),
            restarts: e.restarts,
            delay_ms: e
                .delay
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        })
    }

    /// Backoff rebuilt from a [`Snapshot`] loaded at `now`: every key may be
    /// tried at once, its next failure continues doubling from the saved
    /// wait (clamped to the policy's cap), and no key counts as started (the
    /// caller calls [`Backoff::record_started`] for what it finds running).
    pub fn restore(policy: Policy, snapshot: Snapshot<K>, now: Instant) -> Backoff<K> {
        let mut backoff = Backoff::with_policy(policy);
        let cap = backoff.policy.cap;
        for s in snapshot.entries {
            let entry = Entry {
                restarts: s.restarts,
                delay: s.delay_ms.map(|ms| Duration::from_millis(ms).min(cap)),
                next_attempt: s.delay_ms.map(|_| now),
                started_at: None,
            };
            backoff.entries.insert(s.key, entry);
        }
        backoff
    }
}

/// The persistable part of a [`Backoff`] (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot<K> {
    /// One record per known key, in key order.
    pub entries: Vec<SnapshotEntry<K>>,
}

impl<K> Default for Snapshot<K> {
    fn default() -> Snapshot<K> {
        Snapshot {
            entries: Vec::new(),
        }
    }
}

/// One key's persisted backoff state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotEntry<K> {
    /// The key (a jail name, ...).
    pub key: K,
    /// Failures so far.
    pub restarts: u32,
    /// The wait the last failure handed out, in milliseconds; absent when
    /// the key is not backing off.
    pub delay_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn delays_double_from_one_second_to_the_five_minute_cap() {
        let clock = ManualClock::new();
        let mut b = Backoff::new();
        let key = "web".to_string();
        let mut seen = Vec::new();
        for _ in 0..11 {
            let d = b.record_failure(&key, clock.now());
            seen.push(d.as_secs());
            clock.advance(d);
        }
        assert_eq!(seen, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(b.restarts(&key), 11);
    }

    #[test]
    fn not_ready_until_the_delay_has_passed() {
        let clock = ManualClock::new();
        let mut b = Backoff::new();
        assert!(b.ready(&"web", clock.now()), "an unknown key may start");
        b.record_failure(&"web", clock.now());
        b.record_failure(&"web", clock.now());
        assert_eq!(b.next_attempt(&"web"), Some(clock.now() + secs(2)));
        assert!(!b.ready(&"web", clock.now()));
        clock.advance(Duration::from_millis(1999));
        assert!(!b.ready(&"web", clock.now()));
        clock.advance(Duration::from_millis(1));
        assert!(b.ready(&"web", clock.now()));
    }

    #[test]
    fn sixty_seconds_of_uptime_resets_the_delay() {
        let clock = ManualClock::new();
        let mut b = Backoff::new();
        for _ in 0..5 {
            b.record_failure(&"web", clock.now());
        }
        assert_eq!(b.current_delay(&"web"), Some(secs(16)));
        clock.advance(secs(16));
        b.record_started(&"web", clock.now());
        clock.advance(secs(59));
        assert!(!b.record_stable_check(&"web", clock.now()));
        clock.advance(secs(1));
        assert!(b.record_stable_check(&"web", clock.now()));
        assert_eq!(b.current_delay(&"web"), None);
        assert_eq!(b.record_failure(&"web", clock.now()), secs(1));
        assert_eq!(b.restarts(&"web"), 6, "the count is history and is kept");
    }

    #[test]
    fn a_crash_after_sixty_seconds_resets_even_without_a_stable_check() {
        let clock = ManualClock::new();
        let mut b = Backoff::new();
        b.record_failure(&"web", clock.now());
        b.record_failure(&"web", clock.now());
        b.record_started(&"web", clock.now());
        clock.advance(secs(61));
        assert_eq!(b.record_failure(&"web", clock.now()), secs(1));
    }

    #[test]
    fn a_crash_before_sixty_seconds_keeps_doubling() {
        let clock = ManualClock::new();
        let mut b = Backoff::new();
        let mut delays = Vec::new();
        for _ in 0..4 {
            let d = b.record_failure(&"web", clock.now());
            delays.push(d.as_secs());
            clock.advance(d);
            b.record_started(&"web", clock.now());
            clock.advance(secs(59));
            assert!(!b.record_stable_check(&"web", clock.now()));
        }
        assert_eq!(delays, [1, 2, 4, 8]);
    }

    #[test]
    fn keys_are_independent() {
        let clock = ManualClock::new();
        let mut b = Backoff::new();
        for _ in 0..3 {
            b.record_failure(&"a", clock.now());
        }
        assert_eq!(b.record_failure(&"b", clock.now()), secs(1));
        assert_eq!(b.current_delay(&"a"), Some(secs(4)));
        clock.advance(secs(1));
        assert!(b.ready(&"b", clock.now()));
        assert!(!b.ready(&"a", clock.now()));
        b.forget(&"a");
        assert!(b.ready(&"a", clock.now()));
        assert_eq!(b.restarts(&"a"), 0);
        assert_eq!(b.restarts(&"b"), 1);
    }

    #[test]
    fn custom_policy_is_honoured() {
        let clock = ManualClock::new();
        let mut b = Backoff::with_policy(Policy {
            initial: Duration::from_millis(100),
            cap: Duration::from_millis(250),
            stable_after: secs(5),
        });
        let got: Vec<_> = (0..4)
            .map(|_| b.record_failure(&1u8, clock.now()).as_millis())
            .collect();
        assert_eq!(got, [100, 200, 250, 250]);
    }

    #[test]
    fn snapshot_round_trips_through_json_and_resumes_doubling() {
        let clock = ManualClock::new();
        let mut b = Backoff::new();
        for _ in 0..3 {
            b.record_failure(&"web".to_string(), clock.now());
        }
        b.record_failure(&"db".to_string(), clock.now());
        b.record_started(&"db".to_string(), clock.now());
        clock.advance(secs(60));
        b.record_stable_check(&"db".to_string(), clock.now());

        let json = serde_json::to_string(&b.snapshot()).expect("encode");
        let snap: Snapshot<String> = serde_json::from_str(&json).expect("decode");
        assert_eq!(snap, b.snapshot());

        let later = ManualClock::new();
        later.advance(secs(3600));
        let mut r = Backoff::restore(Policy::default(), snap, later.now());
        let web = "web".to_string();
        assert_eq!(r.restarts(&web), 3);
        assert!(
            r.ready(&web, later.now()),
            "deadline is the moment of loading"
        );
        assert_eq!(r.record_failure(&web, later.now()), secs(8));
        let db = "db".to_string();
        assert_eq!(r.restarts(&db), 1);
        assert_eq!(r.record_failure(&db, later.now()), secs(1));
    }

    #[test]
    fn restored_delay_is_clamped_to_the_cap() {
        let snap = Snapshot {
            entries: vec![SnapshotEntry {
                key: "web",
                restarts: 9,
                delay_ms: Some(10_000_000),
            }],
        };
        let now = Instant::now();
        let mut r = Backoff::restore(Policy::default(), snap, now);
        assert_eq!(r.record_failure(&"web", now), CAP);
    }

    #[test]
    fn manual_clock_clones_share_time() {
        let a = ManualClock::new();
        let b = a.clone();
        let t0 = b.now();
        a.advance(secs(7));
        assert_eq!(b.now() - t0, secs(7));
    }

    proptest! {
        /// Whatever the interleaving of failures, starts and uptimes, every
        /// delay lies within [initial, cap], the first failure after a stable
        /// run waits `initial`, and otherwise each delay is the previous one
        /// doubled and capped.
        #[test]
        fn delays_follow_the_policy(steps in proptest::collection::vec((0u64..200, any::<bool>()), 1..40)) {
            let clock = ManualClock::new();
            let mut b = Backoff::new();
            let mut last: Option<Duration> = None;
            for (uptime, check) in steps {
                let d = b.record_failure(&"k", clock.now());
                let want = match last {
                    None => INITIAL,
                    Some(l) => (l * 2).min(CAP),
                };
                prop_assert_eq!(d, want);
                prop_assert!(!b.ready(&"k", clock.now()));
                clock.advance(d);
                prop_assert!(b.ready(&"k", clock.now()));
                b.record_started(&"k", clock.now());
                clock.advance(secs(uptime));
                if check {
                    b.record_stable_check(&"k", clock.now());
                }
                last = if secs(uptime) >= STABLE_AFTER { None } else { Some(d) };
            }
        }
    }
}
