//! Crash-safe state that changes often: a snapshot plus an append-only log.
//!
//! [`super::store::Store`] rewrites the whole state on every save, which is
//! right for the agent (a handful of jails, a few writes a minute) and wrong
//! for the control plane, where 50,000 placements at thousands of applies per
//! second would rewrite megabytes per apply. A [`Journal`] keeps the last
//! snapshot in a [`Store`] file and appends each change as one JSON line to
//! `{name}.log`; a batch of changes costs one `write` and one `fsync`, however
//! many callers are waiting on it (group commit). When the log grows past
//! [`COMPACT_AFTER`] entries the state is snapshotted and the log truncated.
//!
//! Crash safety:
//! - a torn last line (the process died mid-append) was never acknowledged,
//!   since acknowledgement waits for the fsync; it is dropped on open;
//! - a crash between writing a new snapshot and truncating the log replays
//!   ops the snapshot already contains, so every op must be idempotent (set
//!   or remove a key, never "increment"); [`Replay`] implementors promise it;
//! - a bad line anywhere but the end, or an unknown format, is a startup error
//!   naming the file, which is kept as it is.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::marker::PhantomData;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::store::{Store, StoreError};

/// Log entries after which the next append also compacts.
pub const COMPACT_AFTER: usize = 20_000;

/// State rebuilt by replaying ops in order. Every op must be idempotent.
pub trait Replay<Op> {
    /// Applies one op.
    fn replay(&mut self, op: &Op);
}

/// Why the journal could not be opened or written.
#[derive(Debug)]
pub enum JournalError {
    /// The snapshot failed (see [`StoreError`]).
    Snapshot(StoreError),
    /// The log could not be opened, read, written or synced.
    Log {
        /// The log file.
        path: PathBuf,
        /// What was being done.
        action: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// A log line that is not the torn tail of a crash.
    Corrupt {
        /// The log file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The parse error.
        reason: String,
    },
}

impl std::fmt::Display for JournalError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JournalError::Snapshot(e) => write!(f, "{e}"),
            JournalError::Log {
                path,
                action,
                source,
            } => write!(f, "cannot {action} {}: {source}", path.display()),
            JournalError::Corrupt { path, line, reason } => write!(
                f,
                "{} line {line} is corrupt ({reason}); the file was kept as it is: inspect it, and move it aside to start from the last snapshot",
                path.display()
            ),
        }
    }
}

impl std::error::Error for JournalError {}

/// A snapshot and its log; see the module docs.
pub struct Journal<S, Op> {
    snapshot: Store<S>,
    log_path: PathBuf,
    log: File,
    entries: usize,
    _op: PhantomData<fn(Op)>,
}

impl<S, Op> Journal<S, Op>
where
    S: Serialize + DeserializeOwned + Default + Replay<Op>,
    Op: Serialize + DeserializeOwned,
{
    /// Opens `{dir}/{name}.json` and `{dir}/{name}.log` and returns the state
    /// they describe (the default state for a new directory).
    pub fn open(dir: &Path, name: &str) -> Result<(Journal<S, Op>, S), JournalError> {
        let (snapshot, state) =
            Store::<S>::open(dir, &format!("{name}.json")).map_err(JournalError::Snapshot)?;
        let mut state = state.unwrap_or_default();
        let log_path = dir.join(format!("{name}.log"));
        let entries = replay_log(&log_path, &mut state)?;
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)
            .map_err(|source| JournalError::Log {
                path: log_path.clone(),
                action: "open",
                source,
            })?;
        Ok((
            Journal {
                snapshot,
                log_path,
                log,
                entries,
                _op: PhantomData,
            },
            state,
        ))
    }

    /// Appends `ops` with one write and one fsync. When this returns `Ok` the
    /// ops survive a crash; on `Err` some may have reached the disk, so the
    /// caller reloads with [`Journal::open`] rather than trusting memory.
    pub fn append(&mut self, ops: &[Op]) -> Result<(), JournalError> {
        if ops.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(ops.len() * 96);
        for op in ops {
            // Serialising plain data structs cannot fail.
            serde_json::to_writer(&mut buf, op).map_err(|e| JournalError::Log {
                path: self.log_path.clone(),
                action: "encode an entry for",
                source: std::io::Error::other(e),
            })?;
            buf.push(b'\n');
        }
        let io = |action: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| JournalError::Log {
                path,
                action,
                source,
            }
        };
        self.log
            .write_all(&buf)
            .map_err(io("append to", &self.log_path))?;
        self.log.sync_data().map_err(io("fsync", &self.log_path))?;
        self.entries += ops.len();
        Ok(())
    }

    /// True when the log is long enough that [`Journal::compact`] is due.
    pub fn wants_compaction(&self) -> bool {
        self.entries >= COMPACT_AFTER
    }

    /// Snapshots `state` (which must include every appended op) and empties
    /// the log.
    pub fn compact(&mut self, state: &S) -> Result<(), JournalError> {
        self.snapshot.save(state).map_err(JournalError::Snapshot)?;
        let io = |action: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| JournalError::Log {
                path,
                action,
                source,
            }
        };
        self.log
            .set_len(0)
            .map_err(io("truncate", &self.log_path))?;
        self.log.sync_all().map_err(io("fsync", &self.log_path))?;
        self.entries = 0;
        Ok(())
    }

    /// Log entries since the last snapshot.
    pub fn entries(&self) -> usize {
        self.entries
    }
}

fn replay_log<S: Replay<Op>, Op: DeserializeOwned>(
    path: &Path,
    state: &mut S,
) -> Result<usize, JournalError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(source) => {
            return Err(JournalError::Log {
                path: path.to_path_buf(),
                action: "open",
                source,
            });
        }
    };
    let lines: Vec<Vec<u8>> = BufReader::new(file)
        .split(b'\n')
        .collect::<Result<_, _>>()
        .map_err(|source| JournalError::Log {
            path: path.to_path_buf(),
            action: "read",
            source,
        })?;
    let last = lines.len().saturating_sub(1);
    let mut applied = 0;
    for (i, line) in lines.iter().enumerate() {
        if line.is_empty() {
            continue;
        }
        match serde_json::from_slice::<Op>(line) {
            Ok(op) => {
                state.replay(&op);
                applied += 1;
            }
            // The tail of a write the crash interrupted: never acknowledged.
            Err(_) if i == last => break,
            Err(e) => {
                return Err(JournalError::Corrupt {
                    path: path.to_path_buf(),
                    line: i + 1,
                    reason: e.to_string(),
                });
            }
        }
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use std::collections::BTreeMap;

    #[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
    struct Kv(BTreeMap<String, u32>);

    #[derive(Debug, Serialize, Deserialize)]
    enum Op {
        Set(String, u32),
        Remove(String),
    }

    impl Replay<Op> for Kv {
        fn replay(&mut self, op: &Op) {
            match op {
                Op::Set(k, v) => {
                    self.0.insert(k.clone(), *v);
                }
                Op::Remove(k) => {
                    self.0.remove(k);
                }
            }
        }
    }

    fn open(dir: &Path) -> (Journal<Kv, Op>, Kv) {
        Journal::open(dir, "state").expect("opens")
    }

    #[test]
    fn appended_ops_survive_reopen_and_compaction() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut j, mut s) = open(dir.path());
        let ops = [
            Op::Set("a".into(), 1),
            Op::Set("b".into(), 2),
            Op::Remove("a".into()),
        ];
        for op in &ops {
            s.replay(op);
        }
        j.append(&ops).expect("append");
        let (_, reopened) = open(dir.path());
        assert_eq!(reopened, s);
        let (mut j, s) = open(dir.path());
        j.compact(&s).expect("compact");
        assert_eq!(j.entries(), 0);
        let (_, after) = open(dir.path());
        assert_eq!(after, s);
    }

    #[test]
    fn a_torn_last_line_is_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut j, _) = open(dir.path());
        j.append(&[Op::Set("a".into(), 1)]).expect("append");
        let mut f = OpenOptions::new()
            .append(true)
            .open(dir.path().join("state.log"))
            .expect("log");
        f.write_all(b"{\"Set\":[\"b\",").expect("torn write");
        let (_, s) = open(dir.path());
        assert_eq!(s.0.get("a"), Some(&1));
        assert_eq!(s.0.get("b"), None);
    }

    #[test]
    fn a_bad_line_in_the_middle_is_an_error_naming_the_file_and_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("state.log"),
            "{\"Set\":[\"a\",1]}\ngarbage\n{\"Set\":[\"b\",2]}\n",
        )
        .expect("write");
        let err = Journal::<Kv, Op>::open(dir.path(), "state")
            .err()
            .expect("refused");
        let shown = err.to_string();
        assert!(shown.contains("state.log line 2"), "{shown}");
        assert!(dir.path().join("state.log").exists());
    }

    #[test]
    fn replaying_after_a_crash_between_snapshot_and_truncate_is_harmless() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut j, mut s) = open(dir.path());
        let ops = [
            Op::Set("a".into(), 1),
            Op::Remove("a".into()),
            Op::Set("b".into(), 3),
        ];
        for op in &ops {
            s.replay(op);
        }
        j.append(&ops).expect("append");
        // Snapshot written, log not truncated: the crash window.
        let (mut snap, _) = Store::<Kv>::open(dir.path(), "state.json").expect("store");
        snap.save(&s).expect("save");
        let (_, again) = open(dir.path());
        assert_eq!(again, s);
    }
}
