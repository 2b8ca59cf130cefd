//! One daemon per state directory: an exclusive flock(2) on
//! `{state_dir}/keel.lock`, taken before the daemon reads or writes anything
//! else there and before it binds a listener, and held until the process
//! exits. The file records the holder's pid so the next daemon can say who
//! holds it.
//!
//! Why flock and not the pid in the file: the kernel drops the lock when the
//! last descriptor of the locked open file closes, which happens at any exit,
//! `kill -9` included, so a stale file never blocks a restart and a recycled
//! pid never fakes a live holder. The pid is only for the error message.
//! flock(2) locks belong to the open file, not to the process: a `fork` (the
//! `--daemon` detach) shares the one lock with the child, which keeps it after
//! the parent exits, so the detached daemon calls [`StateDirLock::record_pid`]
//! to put its own pid in the file. The descriptor is close-on-exec, so
//! workloads and host commands the daemon starts never hold the lock.
//!
//! Must never: delete the lock file (a daemon starting meanwhile would lock a
//! new file while the old one is still held), or unlock before the process
//! exits.

use std::fmt;
use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::common::store::{DIR_MODE, FILE_MODE};

/// The lock file's name inside a state directory.
pub const LOCK_FILE: &str = "keel.lock";

/// Why the state directory could not be locked.
#[derive(Debug)]
pub enum LockError {
    /// Another process holds the lock: a daemon already runs on this state
    /// directory.
    Held {
        /// The state directory.
        dir: PathBuf,
        /// The pid the holder recorded, if it had recorded one yet.
        holder: Option<u32>,
    },
    /// The state directory could not be created.
    CreateDir {
        /// The directory.
        dir: PathBuf,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The lock file could not be opened, locked or written.
    File {
        /// The lock file.
        path: PathBuf,
        /// What was being done: "open", "lock", "write the pid to".
        action: &'static str,
        /// The operating system's reason.
        source: io::Error,
    },
}

impl fmt::Display for LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockError::Held { dir, holder } => {
                let who = match holder {
                    Some(pid) => format!("pid {pid}"),
                    None => "a process that has not recorded its pid yet".to_string(),
                };
                write!(
                    f,
                    "the state directory {} is in use by another daemon ({who} holds {}); \
                     stop that daemon first, or give this one its own state directory",
                    dir.display(),
                    dir.join(LOCK_FILE).display()
                )
            }
            LockError::CreateDir { dir, source } => write!(
                f,
                "cannot create the state directory {}: {source}",
                dir.display()
            ),
            LockError::File {
                path,
                action,
                source,
            } => write!(
                f,
                "cannot {action} the lock file {}: {source}; the daemon needs a local file \
                 system that supports flock(2) for its state directory",
                path.display()
            ),
        }
    }
}

impl std::error::Error for LockError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LockError::Held { .. } => None,
            LockError::CreateDir { source, .. } | LockError::File { source, .. } => Some(source),
        }
    }
}

/// The held lock on one state directory; dropping it (or exiting) releases it.
#[derive(Debug)]
pub struct StateDirLock {
    file: File,
    path: PathBuf,
}

impl StateDirLock {
    /// Creates `dir` if needed (mode [`DIR_MODE`]), locks its lock file
    /// without waiting and records this process's pid in it.
    pub fn acquire(dir: &Path) -> Result<StateDirLock, LockError> {
        // An existing directory keeps its mode, as `Store::open` does.
        DirBuilder::new()
            .recursive(true)
            .mode(DIR_MODE)
            .create(dir)
            .map_err(|source| LockError::CreateDir {
                dir: dir.to_path_buf(),
                source,
            })?;
        let path = dir.join(LOCK_FILE);
        let file_error = |action| {
            let path = path.clone();
            move |source| LockError::File {
                path,
                action,
                source,
            }
        };
        // Not truncated on open: until the lock is ours the content is the
        // holder's pid, which a refused daemon reads back.
        let file = open_record(&path).map_err(file_error("open"))?;
        match try_lock_exclusive(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(LockError::Held {
                    dir: dir.to_path_buf(),
                    holder: read_record(&file).ok().and_then(|t| t.trim().parse().ok()),
                });
            }
            Err(e) => return Err(file_error("lock")(e)),
        }
        let mut lock = StateDirLock { file, path };
        lock.record_pid()?;
        Ok(lock)
    }

    /// Writes this process's pid into the lock file, replacing what was
    /// there: after `acquire`, and again in the child after a detach.
    pub fn record_pid(&mut self) -> Result<(), LockError> {
        let pid = format!("{}\n", std::process::id());
        self.file
            .set_len(0)
            .and_then(|()| self.file.seek(SeekFrom::Start(0)))
            .and_then(|_| self.file.write_all(pid.as_bytes()))
            .map_err(|source| LockError::File {
                path: self.path.clone(),
                action: "write the pid to",
                source,
            })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Opens (creating, mode [`FILE_MODE`], never truncating) one of the small
/// files a daemon keeps beside its lock and rewrites in place: the lock file
/// itself and [`crate::common::replay_floor`]'s.
pub fn open_record(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(FILE_MODE)
        .open(path)
}

/// The text of a file opened with [`open_record`] (its first 64 bytes, all a
/// record ever holds), read from the start.
pub fn read_record(file: &File) -> io::Result<String> {
    let mut text = String::new();
    let mut reader = file;
    reader.seek(SeekFrom::Start(0))?;
    reader.take(64).read_to_string(&mut text)?;
    Ok(text)
}

/// flock(2) with `LOCK_EX | LOCK_NB`: `WouldBlock` when another open file
/// holds the lock.
#[allow(unsafe_code)]
fn try_lock_exclusive(file: &File) -> io::Result<()> {
    // SAFETY: flock(2) takes a descriptor and an integer flag and touches no
    // memory of ours; the descriptor is valid for the call because `file`
    // is borrowed for its duration.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_released_on_drop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        let first = StateDirLock::acquire(&state).expect("first lock");
        assert_eq!(
            std::fs::read_to_string(first.path()).expect("lock file"),
            format!("{}\n", std::process::id())
        );
        // A second open file in the same process conflicts like another
        // process would: flock locks belong to the open file.
        let err = StateDirLock::acquire(&state).expect_err("second lock refused");
        match &err {
            LockError::Held { dir, holder } => {
                assert_eq!(dir, &state);
                assert_eq!(*holder, Some(std::process::id()));
            }
            other => panic!("expected Held, got {other:?}"),
        }
        let message = err.to_string();
        assert!(message.contains(&state.display().to_string()), "{message}");
        assert!(
            message.contains(&format!("pid {}", std::process::id())),
            "{message}"
        );
        drop(first);
        let again = StateDirLock::acquire(&state).expect("lock after release");
        assert!(again.path().ends_with(LOCK_FILE));
    }

    #[test]
    fn a_stale_pid_in_an_unlocked_file_does_not_block() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(LOCK_FILE), "999999\n").expect("stale file");
        let lock = StateDirLock::acquire(dir.path()).expect("stale file is no lock");
        assert_eq!(
            std::fs::read_to_string(lock.path()).expect("lock file"),
            format!("{}\n", std::process::id())
        );
    }

    #[test]
    fn a_holder_without_a_pid_is_still_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(LOCK_FILE);
        let holder = File::create(&path).expect("lock file");
        try_lock_exclusive(&holder).expect("lock");
        let err = StateDirLock::acquire(dir.path()).expect_err("held");
        assert!(
            matches!(err, LockError::Held { holder: None, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("not recorded its pid"), "{err}");
    }
}
