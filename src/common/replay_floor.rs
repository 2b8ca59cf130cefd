//! The persisted part of replay protection across restarts:
//! `{state_dir}/replay-floor` holds the highest request timestamp the daemon
//! accepted while that timestamp was still ahead of its own clock.
//!
//! Why: a restarted daemon refuses requests dated before its start
//! ([`crate::common::auth::Verifier::with_not_before`]), which covers every
//! request its predecessor accepted with a `ts` at or behind the
//! predecessor's clock. A signer whose clock runs ahead (up to
//! `max_clock_skew`) produces requests dated after the restart that the
//! predecessor may already have accepted; their `ts` is recorded here before
//! the request is acted on, and the next daemon starts its floor above it.
//! Only a `ts` above the recorded one is written (at most one write a second,
//! and none while every signer's clock is at or behind the daemon's: `ts`
//! has whole-second resolution, so a signer milliseconds ahead writes only
//! when it crosses a second boundary first), and a
//! write is flushed with fsync(2) so it also survives a power loss.
//!
//! [`start`] is the whole restart sequence both daemons run once they hold
//! the lock.
//!
//! Must never: lower the recorded value, or be written by a daemon that does
//! not hold the state directory's lock ([`crate::common::lockfile`]).

use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::lockfile::{open_record, read_record};
use crate::common::sync::lock;

/// The file's name inside a state directory.
pub const FLOOR_FILE: &str = "replay-floor";

/// Digits of the recorded value: fixed width, so every write replaces the
/// whole value with one small write at offset 0.
const WIDTH: usize = 20;

/// Why the floor could not be read or recorded.
#[derive(Debug)]
pub enum FloorError {
    /// The file could not be opened, read, written or flushed.
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        action: &'static str,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The file holds something other than a timestamp.
    Corrupt {
        /// The file.
        path: PathBuf,
    },
}

impl fmt::Display for FloorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FloorError::Io {
                path,
                action,
                source,
            } => write!(f, "cannot {action} {}: {source}", path.display()),
            FloorError::Corrupt { path } => write!(
                f,
                "{} does not hold a Unix timestamp; if the file system was damaged, wait \
                 [auth] max_clock_skew after the previous daemon stopped, then remove the \
                 file and start again (a request signed before that could otherwise be \
                 replayed once)",
                path.display()
            ),
        }
    }
}

impl std::error::Error for FloorError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FloorError::Io { source, .. } => Some(source),
            FloorError::Corrupt { .. } => None,
        }
    }
}

/// For a daemon that holds its state directory's lock (so its predecessor
/// is gone): opens the floor, waits for the next whole second of the wall
/// clock, and returns the floor with the first request timestamp to accept,
/// that second or one past the recorded value. Waiting makes the bound exact:
/// a request signed in the second the predecessor died is dated below it.
pub fn start(dir: &Path) -> Result<(ReplayFloor, u64), FloorError> {
    let (floor, recorded) = ReplayFloor::open(dir)?;
    let started = wait_for_next_second();
    if recorded >= started {
        log::warn!(
            "a signer's clock ran {} s ahead of the previous daemon's: signed requests dated before {} are refused as possibly replayed; synchronise the clocks (NTP)",
            recorded - started + 1,
            recorded + 1
        );
    }
    Ok((floor, started.max(recorded.saturating_add(1))))
}

/// Sleeps until the wall clock enters its next whole second; returns it.
fn wait_for_next_second() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let next = now.as_secs().saturating_add(1);
    std::thread::sleep(Duration::from_secs(next).saturating_sub(now));
    next
}

/// The open floor file and the value it holds.
#[derive(Debug)]
pub struct ReplayFloor {
    path: PathBuf,
    recorded: Mutex<(File, u64)>,
}

impl ReplayFloor {
    /// Opens (creating) the floor file of the state directory `dir`, which
    /// must exist and be locked by this process, and returns it with the
    /// value the previous daemon recorded (0 for a new file).
    pub fn open(dir: &Path) -> Result<(ReplayFloor, u64), FloorError> {
        let path = dir.join(FLOOR_FILE);
        let io_error = |action| {
            let path = path.clone();
            move |source| FloorError::Io {
                path,
                action,
                source,
            }
        };
        let file = open_record(&path).map_err(io_error("open"))?;
        let text = read_record(&file).map_err(io_error("read"))?;
        let recorded = match text.trim() {
            "" => 0,
            digits => digits
                .parse()
                .map_err(|_| FloorError::Corrupt { path: path.clone() })?,
        };
        let floor = ReplayFloor {
            path,
            recorded: Mutex::new((file, recorded)),
        };
        Ok((floor, recorded))
    }

    /// Records `ts` durably unless a value at least as high is recorded.
    /// Returns once the value is on disk.
    pub fn raise(&self, ts: u64) -> Result<(), FloorError> {
        let mut recorded = lock(&self.recorded);
        if ts <= recorded.1 {
            return Ok(());
        }
        let text = format!("{ts:0WIDTH$}\n");
        let io_error = |action| {
            let path = self.path.clone();
            move |source| FloorError::Io {
                path,
                action,
                source,
            }
        };
        recorded
            .0
            .write_all_at(text.as_bytes(), 0)
            .map_err(io_error("write"))?;
        recorded.0.sync_data().map_err(io_error("fsync"))?;
        recorded.1 = ts;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_value_survives_a_reopen_and_never_goes_down() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (floor, recorded) = ReplayFloor::open(dir.path()).expect("new floor");
        assert_eq!(recorded, 0);
        floor.raise(1_700_000_100).expect("raise");
        floor.raise(1_700_000_050).expect("lower is a no-op");
        drop(floor);
        let (floor, recorded) = ReplayFloor::open(dir.path()).expect("reopen");
        assert_eq!(recorded, 1_700_000_100);
        floor.raise(1_700_000_101).expect("raise");
        drop(floor);
        assert_eq!(
            ReplayFloor::open(dir.path()).expect("reopen").1,
            1_700_000_101
        );
    }

    #[test]
    fn start_waits_for_the_next_second_and_starts_above_the_recorded_value() {
        let dir = tempfile::tempdir().expect("tempdir");
        let before = crate::common::auth::unix_now();
        let (floor, first) = start(dir.path()).expect("start");
        assert!(first > before, "{first} after {before}");
        assert!(crate::common::auth::unix_now() >= first);
        let ahead = first + 120;
        floor.raise(ahead).expect("raise");
        drop(floor);
        let (_, first) = start(dir.path()).expect("restart");
        assert_eq!(first, ahead + 1);
    }

    #[test]
    fn a_damaged_file_stops_the_daemon_naming_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(FLOOR_FILE), "garbage\n").expect("write");
        let err = ReplayFloor::open(dir.path()).expect_err("corrupt");
        assert!(matches!(err, FloorError::Corrupt { .. }), "{err:?}");
        assert!(err.to_string().contains(FLOOR_FILE), "{err}");
    }
}
