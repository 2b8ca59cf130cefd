//! Fault injection for the process tests: named points in the daemons where a
//! test can make simulate mode stall or panic, so "a host command hangs for
//! 30 s" and "the worker thread dies" can be shown on the real binaries.
//!
//! Faults are inert unless both hold: the daemon runs with `--simulate`, and
//! the environment variable [`ENV`] names them when it starts. A FreeBSD
//! daemon never reads the variable, so nothing here can change production
//! behaviour. The syntax is a comma-separated list of `POINT=ACTION`:
//!
//! ```text
//! KEEL_SIM_FAULTS=sim.zfs.clone=sleep:30s,agent.worker.apply=panic
//! ```
//!
//! `ACTION` is `sleep:DURATION` (`500ms`, `30s`) or `panic`. A point is a
//! dotted name chosen where [`inject`] is called; the points in use are listed
//! in [`POINTS`], and an unknown point is refused at startup, so a typo in a
//! test fails loudly instead of injecting nothing.
//!
//! Why a process-wide table and not a value passed down: the points sit deep
//! inside seams (a simulated `zfs clone`, one arm of a worker loop) whose
//! signatures must not grow a test-only parameter, and the table is written
//! once, before any thread that reads it starts.

use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable naming the faults.
pub const ENV: &str = "KEEL_SIM_FAULTS";

/// Every point [`inject`] is called with; [`parse`] refuses any other.
pub const POINTS: &[&str] = &[
    // The simulated host's `zfs clone` of a jail's root (every first apply).
    "sim.zfs.clone",
    // The agent's worker, before it applies a jail.
    "agent.worker.apply",
    // The control plane's worker, before it handles a register request.
    "controlplane.worker.register",
    // The simulated host's base extraction, after tar ran and before the
    // fetch may snapshot: a fetch cut short there leaves a partial base.
    "sim.base.extract",
];

/// What happens at a point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Block the calling thread this long.
    Sleep(Duration),
    /// Panic with a message naming the point.
    Panic,
}

/// One configured fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// One of [`POINTS`].
    pub point: String,
    /// What it does.
    pub action: Action,
}

static FAULTS: OnceLock<Vec<Fault>> = OnceLock::new();

/// Parses a [`ENV`] value; the error names the offending entry.
pub fn parse(value: &str) -> Result<Vec<Fault>, String> {
    let mut faults = Vec::new();
    for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (point, action) = entry
            .split_once('=')
            .ok_or_else(|| format!("{ENV}: {entry:?} is not POINT=ACTION"))?;
        if !POINTS.contains(&point) {
            return Err(format!(
                "{ENV}: unknown fault point {point:?}; known points: {}",
                POINTS.join(", ")
            ));
        }
        let action = match action.split_once(':') {
            None if action == "panic" => Action::Panic,
            Some(("sleep", d)) => Action::Sleep(parse_duration(d).ok_or_else(|| {
                format!("{ENV}: {entry:?}: {d:?} is not a duration like 500ms or 30s")
            })?),
            _ => {
                return Err(format!(
                    "{ENV}: {entry:?}: the action must be panic or sleep:DURATION"
                ));
            }
        };
        faults.push(Fault {
            point: point.to_string(),
            action,
        });
    }
    Ok(faults)
}

fn parse_duration(text: &str) -> Option<Duration> {
    if let Some(ms) = text.strip_suffix("ms") {
        return ms.parse().ok().map(Duration::from_millis);
    }
    text.strip_suffix('s')?
        .parse()
        .ok()
        .map(Duration::from_secs)
}

/// Reads [`ENV`] once, at a simulated daemon's start, before its threads
/// exist. Returns the faults armed (for the log); an unset variable arms none.
pub fn arm_from_env() -> Result<Vec<Fault>, String> {
    let faults = match std::env::var(ENV) {
        Ok(value) => parse(&value)?,
        Err(std::env::VarError::NotPresent) => Vec::new(),
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(format!("{ENV} is not valid UTF-8"));
        }
    };
    let _ = FAULTS.set(faults.clone());
    Ok(faults)
}

/// Runs the fault armed at `point`, if any: sleeps, or panics.
pub fn inject(point: &str) {
    debug_assert!(POINTS.contains(&point), "fault point {point} not in POINTS");
    let Some(faults) = FAULTS.get() else {
        return;
    };
    for fault in faults.iter().filter(|f| f.point == point) {
        match fault.action {
            Action::Sleep(d) => {
                log::warn!("fault injected at {point}: sleeping {}s", d.as_secs_f64());
                std::thread::sleep(d);
            }
            Action::Panic => panic!("fault injected at {point}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_points_and_actions() {
        let faults = parse("sim.zfs.clone=sleep:30s, agent.worker.apply=panic").unwrap();
        assert_eq!(
            faults,
            vec![
                Fault {
                    point: "sim.zfs.clone".into(),
                    action: Action::Sleep(Duration::from_secs(30)),
                },
                Fault {
                    point: "agent.worker.apply".into(),
                    action: Action::Panic,
                },
            ]
        );
        assert_eq!(
            parse("sim.zfs.clone=sleep:250ms").unwrap()[0].action,
            Action::Sleep(Duration::from_millis(250))
        );
        assert!(parse("").unwrap().is_empty());
    }

    #[test]
    fn refuses_unknown_points_and_bad_actions() {
        let err = parse("sim.zfs.clnoe=panic").unwrap_err();
        assert!(
            err.contains("unknown fault point \"sim.zfs.clnoe\""),
            "{err}"
        );
        let err = parse("sim.zfs.clone=sleep:soon").unwrap_err();
        assert!(err.contains("not a duration"), "{err}");
        let err = parse("sim.zfs.clone=explode").unwrap_err();
        assert!(err.contains("panic or sleep"), "{err}");
        let err = parse("sim.zfs.clone").unwrap_err();
        assert!(err.contains("POINT=ACTION"), "{err}");
    }
}
