//! Prometheus text exposition for `GET /metrics`: jails desired and running,
//! the reconcile pass duration histogram, failures and restarts.
//!
//! Owned by the worker thread (it is updated after each pass), so it needs no
//! locking; the API asks the worker for a rendered copy.

use std::fmt::Write;
use std::time::Duration;

/// Upper bounds of the pass-duration histogram buckets, in seconds.
const PASS_BUCKETS: [f64; 10] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0];

/// Counters and the pass histogram.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    bucket_counts: [u64; PASS_BUCKETS.len()],
    pass_count: u64,
    pass_sum: f64,
    failures_total: u64,
    restarts_total: u64,
}

impl Metrics {
    /// Records one finished pass.
    pub fn record_pass(&mut self, took: Duration, failures: usize, restarts: usize) {
        let secs = took.as_secs_f64();
        for (i, bound) in PASS_BUCKETS.iter().enumerate() {
            if secs <= *bound {
                self.bucket_counts[i] += 1;
            }
        }
        self.pass_count += 1;
        self.pass_sum += secs;
        self.failures_total += failures as u64;
        self.restarts_total += restarts as u64;
    }

    /// Counts a failed apply or delete (outside a pass).
    pub fn record_failure(&mut self) {
        self.failures_total += 1;
    }

    /// The exposition text, with the current jail counts.
    pub fn render(&self, desired: usize, running: usize) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = write!(
            out,
            "# HELP keel_jails_desired Jails this agent is asked to run.\n\
             # TYPE keel_jails_desired gauge\n\
             keel_jails_desired {desired}\n\
             # HELP keel_jails_running Jails whose workload was running at the last pass.\n\
             # TYPE keel_jails_running gauge\n\
             keel_jails_running {running}\n\
             # HELP keel_reconcile_duration_seconds Duration of reconcile passes.\n\
             # TYPE keel_reconcile_duration_seconds histogram\n"
        );
        for (bound, count) in PASS_BUCKETS.iter().zip(self.bucket_counts) {
            let _ = writeln!(
                out,
                "keel_reconcile_duration_seconds_bucket{{le=\"{bound}\"}} {count}"
            );
        }
        let _ = write!(
            out,
            "keel_reconcile_duration_seconds_bucket{{le=\"+Inf\"}} {n}\n\
             keel_reconcile_duration_seconds_sum {sum}\n\
             keel_reconcile_duration_seconds_count {n}\n\
             # HELP keel_reconcile_failures_total Per-jail failures in passes, applies and deletes.\n\
             # TYPE keel_reconcile_failures_total counter\n\
             keel_reconcile_failures_total {failures}\n\
             # HELP keel_jail_restarts_total Workloads restarted after a crash.\n\
             # TYPE keel_jail_restarts_total counter\n\
             keel_jail_restarts_total {restarts}\n",
            n = self.pass_count,
            sum = self.pass_sum,
            failures = self.failures_total,
            restarts = self.restarts_total,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut m = Metrics::default();
        m.record_pass(Duration::from_millis(3), 1, 2);
        m.record_pass(Duration::from_millis(700), 0, 0);
        let text = m.render(4, 3);
        assert!(text.contains("keel_reconcile_duration_seconds_bucket{le=\"0.001\"} 0"));
        assert!(text.contains("keel_reconcile_duration_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("keel_reconcile_duration_seconds_bucket{le=\"1\"} 2"));
        assert!(text.contains("keel_reconcile_duration_seconds_count 2"));
        assert!(text.contains("keel_jails_desired 4"));
        assert!(text.contains("keel_jails_running 3"));
        assert!(text.contains("keel_reconcile_failures_total 1"));
        assert!(text.contains("keel_jail_restarts_total 2"));
    }
}
