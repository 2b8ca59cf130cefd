//! Rate-limited warnings for refused requests and connections: the first
//! refusal of a quiet period is logged in full, the rest are counted and
//! summarised, one line per interval.
//!
//! Owns the counting window only. It must never decide what to refuse, and
//! must never write one line per refusal: a flooding client can send
//! thousands of unsigned requests a second, and a log line for each one
//! fills the disk (megabytes a second per connection) and buries the lines an
//! operator needs.
//!
//! There is no timer thread: the summary of a window is written by the first
//! refusal after the window ended, so a flood that stops leaves its last
//! count unwritten until the next refusal. That keeps the type free of
//! threads and clocks of its own; an operator looking at a quiet log is not
//! being flooded.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::common::http::Peer;
use crate::common::sync::lock;

/// How long a window lasts: at most two lines per window (the first
/// refusal and the summary of the others).
pub const DEFAULT_SUMMARY_INTERVAL: Duration = Duration::from_secs(10);
/// Most distinct peers remembered per window; beyond it the count of peers
/// is reported as "at least".
const MAX_PEERS_PER_WINDOW: usize = 4096;

/// Counts refusals of one kind and logs them at warning level in summaries.
#[derive(Debug)]
pub struct RefusalLog {
    /// What is counted, a plural noun phrase for the summary ("requests
    /// refused for a missing or bad signature").
    what: &'static str,
    interval: Duration,
    window: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    /// When the window's first refusal was logged; `None` before any.
    started: Option<Instant>,
    /// Refusals since that first one (which was logged in full).
    counted: u64,
    peers: HashSet<String>,
}

impl RefusalLog {
    /// A log for refusals described by `what` (a plural noun phrase:
    /// "requests refused for a missing or bad signature"), with windows of
    /// `interval`.
    pub fn new(what: &'static str, interval: Duration) -> RefusalLog {
        RefusalLog {
            what,
            interval,
            window: Mutex::new(Window::default()),
        }
    }

    /// Records one refusal of a request or connection from `peer`; `detail`
    /// (what was refused and why) is built only when it is logged.
    pub fn record(&self, peer: &Peer, detail: impl FnOnce() -> String) {
        for line in self.note(Instant::now(), peer, detail) {
            log::warn!("{line}");
        }
    }

    /// The lines to log for a refusal at `now`; [`RefusalLog::record`]
    /// without the logger, so the windowing can be tested.
    fn note(&self, now: Instant, peer: &Peer, detail: impl FnOnce() -> String) -> Vec<String> {
        let mut window = lock(&self.window);
        let peer_key = match peer {
            // Each connection has its own port; the address is the peer.
            Peer::Tcp(addr) => addr.ip().to_string(),
            other => other.to_string(),
        };
        if let Some(started) = window.started
            && now.saturating_duration_since(started) < self.interval
        {
            window.counted += 1;
            if window.peers.len() < MAX_PEERS_PER_WINDOW {
                window.peers.insert(peer_key);
            }
            return Vec::new();
        }
        let mut lines = Vec::new();
        if let Some(started) = window.started
            && window.counted > 0
        {
            let seconds = now.saturating_duration_since(started).as_secs().max(1);
            let peers = window.peers.len();
            let at_least = if peers >= MAX_PEERS_PER_WINDOW {
                "at least "
            } else {
                ""
            };
            lines.push(format!(
                "{} more {} from {at_least}{peers} peer(s) in the last {seconds} s \
                 (logged in summaries: one in full, then a count per {} s)",
                window.counted,
                self.what,
                self.interval.as_secs().max(1)
            ));
        }
        *window = Window {
            started: Some(now),
            counted: 0,
            peers: HashSet::new(),
        };
        lines.push(format!(
            "{} (from {peer}; further {} in the next {} s are counted, not logged one by one)",
            detail(),
            self.what,
            self.interval.as_secs().max(1)
        ));
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(ip: &str, port: u16) -> Peer {
        Peer::Tcp(format!("{ip}:{port}").parse().expect("address"))
    }

    #[test]
    fn a_flood_is_one_line_then_one_summary_per_interval() {
        let log = RefusalLog::new("unsigned requests refused", Duration::from_secs(10));
        let t0 = Instant::now();
        let first = log.note(t0, &tcp("192.0.2.1", 1000), || "refused GET /jails".into());
        assert_eq!(first.len(), 1, "{first:?}");
        assert!(first[0].starts_with("refused GET /jails (from 192.0.2.1:1000;"));
        // A thousand more within the window, from three addresses on many ports.
        for i in 0..1000u16 {
            let ip = ["192.0.2.1", "192.0.2.2", "192.0.2.3"][usize::from(i % 3)];
            let lines = log.note(
                t0 + Duration::from_millis(u64::from(i) * 9),
                &tcp(ip, 2000 + i),
                || unreachable!("a counted refusal builds no detail"),
            );
            assert!(lines.is_empty(), "{lines:?}");
        }
        let next = log.note(t0 + Duration::from_secs(11), &tcp("192.0.2.9", 1), || {
            "refused PUT /jails/web".into()
        });
        assert_eq!(next.len(), 2, "{next:?}");
        assert!(
            next[0]
                .starts_with("1000 more unsigned requests refused from 3 peer(s) in the last 11 s"),
            "{}",
            next[0]
        );
        assert!(next[1].starts_with("refused PUT /jails/web (from 192.0.2.9:1;"));
    }

    #[test]
    fn a_lone_refusal_after_a_quiet_window_has_no_summary() {
        let log = RefusalLog::new("connections", Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(log.note(t0, &Peer::Unix, || "one".into()).len(), 1);
        let later = log.note(t0 + Duration::from_secs(60), &Peer::Unix, || "two".into());
        assert_eq!(later.len(), 1, "{later:?}");
        assert!(later[0].starts_with("two (from unix;"));
    }
}
