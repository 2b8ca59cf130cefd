//! One jail's readiness as a pure state machine over probe outcomes: ready
//! after the first success, not ready after `failureThreshold` consecutive
//! failures, restarted after as many more; failures inside `startPeriod` do
//! not count. It owns only that arithmetic: it never probes, never reads a
//! clock (the caller passes the instant) and never talks to the worker.

use std::time::{Duration, Instant};

use crate::common::spec::HealthSpec;

/// What one outcome changed, for the caller to pass on to the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Readiness stays as it was.
    Unchanged,
    /// The jail became ready (its first success, or the first after it lost it).
    Ready,
    /// `failureThreshold` consecutive failures: take it out of the rotation.
    NotReady,
    /// Twice `failureThreshold` consecutive failures: restart it.
    Restart,
}

/// The timing that decides a verdict, copied out of a [`HealthSpec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// Consecutive failures that end readiness; twice as many restart.
    pub failures: u32,
    /// Failures this soon after the workload started are ignored.
    pub start_period: Duration,
}

impl From<&HealthSpec> for Thresholds {
    fn from(h: &HealthSpec) -> Thresholds {
        Thresholds {
            failures: h.failure_threshold.max(1),
            start_period: h.start_period.0,
        }
    }
}

/// One incarnation of one jail's workload, from when it was first seen
/// running; a restarted workload starts a new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    ready: bool,
    consecutive_failures: u32,
    started: Instant,
}

impl Readiness {
    /// A workload seen running since `started`: not ready until a probe passes.
    pub fn new(started: Instant) -> Readiness {
        Readiness {
            ready: false,
            consecutive_failures: 0,
            started,
        }
    }

    /// Whether the last verdict left the jail ready.
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// Consecutive failures counted so far.
    pub fn failures(&self) -> u32 {
        self.consecutive_failures
    }

    /// Takes in one probe outcome observed at `at`.
    pub fn record(&mut self, passed: bool, at: Instant, limits: Thresholds) -> Verdict {
        if passed {
            self.consecutive_failures = 0;
            if self.ready {
                return Verdict::Unchanged;
            }
            self.ready = true;
            return Verdict::Ready;
        }
        if at.saturating_duration_since(self.started) < limits.start_period {
            return Verdict::Unchanged;
        }
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        if self.consecutive_failures >= limits.failures.saturating_mul(2) {
            // The restart makes a new incarnation; counting starts over so a
            // caller that keeps this one does not restart it at every probe.
            self.consecutive_failures = 0;
            self.ready = false;
            return Verdict::Restart;
        }
        if self.ready && self.consecutive_failures >= limits.failures {
            self.ready = false;
            return Verdict::NotReady;
        }
        Verdict::Unchanged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THREE: Thresholds = Thresholds {
        failures: 3,
        start_period: Duration::ZERO,
    };

    fn run(r: &mut Readiness, outcomes: &[bool], at: Instant, t: Thresholds) -> Vec<Verdict> {
        outcomes.iter().map(|&p| r.record(p, at, t)).collect()
    }

    #[test]
    fn ready_after_the_first_success_and_not_before() {
        let now = Instant::now();
        let mut r = Readiness::new(now);
        assert!(!r.is_ready());
        assert_eq!(
            run(&mut r, &[true, true], now, THREE),
            [Verdict::Ready, Verdict::Unchanged]
        );
        assert!(r.is_ready());
    }

    #[test]
    fn not_ready_after_threshold_consecutive_failures() {
        let now = Instant::now();
        let mut r = Readiness::new(now);
        r.record(true, now, THREE);
        assert_eq!(
            run(&mut r, &[false, false, true, false, false], now, THREE),
            [Verdict::Unchanged; 5],
            "a success in between resets the count"
        );
        assert!(r.is_ready());
        assert_eq!(r.record(false, now, THREE), Verdict::NotReady);
        assert!(!r.is_ready());
        assert_eq!(
            r.record(true, now, THREE),
            Verdict::Ready,
            "it can come back"
        );
    }

    #[test]
    fn restarted_after_twice_the_threshold() {
        let now = Instant::now();
        let mut r = Readiness::new(now);
        r.record(true, now, THREE);
        assert_eq!(
            run(&mut r, &[false; 6], now, THREE),
            [
                Verdict::Unchanged,
                Verdict::Unchanged,
                Verdict::NotReady,
                Verdict::Unchanged,
                Verdict::Unchanged,
                Verdict::Restart
            ]
        );
        assert_eq!((r.is_ready(), r.failures()), (false, 0));
    }

    #[test]
    fn a_workload_that_never_passes_is_restarted_too() {
        let now = Instant::now();
        let mut r = Readiness::new(now);
        let verdicts = run(&mut r, &[false; 6], now, THREE);
        assert_eq!(verdicts[..5], [Verdict::Unchanged; 5]);
        assert_eq!(verdicts[5], Verdict::Restart);
    }

    #[test]
    fn failures_inside_the_start_period_do_not_count() {
        let started = Instant::now();
        let t = Thresholds {
            failures: 1,
            start_period: Duration::from_secs(10),
        };
        let mut r = Readiness::new(started);
        let inside = started + Duration::from_secs(9);
        assert_eq!(run(&mut r, &[false; 5], inside, t), [Verdict::Unchanged; 5]);
        assert_eq!(r.failures(), 0);
        let after = started + Duration::from_secs(10);
        assert_eq!(r.record(false, after, t), Verdict::Unchanged);
        assert_eq!(r.record(false, after, t), Verdict::Restart);
        let mut r = Readiness::new(started);
        assert_eq!(
            r.record(true, inside, t),
            Verdict::Ready,
            "a success counts at once"
        );
    }
}
