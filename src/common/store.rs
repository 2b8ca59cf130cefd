//! The crash-safe state file: one JSON document per daemon in its state
//! directory (`/var/db/keel/agentd/`, `/var/db/keel/controlplane/`).
//!
//! On disk: `{"format": 1, "state": ...}`. A save writes `.<name>.tmp` beside
//! the file, fsyncs it, renames it over the file and fsyncs the directory, so
//! at every instant the file holds either the whole old state or the whole
//! new one. A temp file left by a crash is never read and is overwritten by
//! the next save.
//!
//! Must never: replace, rename away or "repair" a state file it cannot read.
//! A corrupt file or one of an unknown format stops the daemon with an error
//! naming the file; the operator inspects it and moves it aside. Starting
//! fresh over existing state would forget jails, volumes and placements.
//!
//! File system access goes through [`StoreFs`] so tests can stop a save at
//! any step ([`FaultyFs`]) and check what a restart would find.

use std::fmt;
use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::marker::PhantomData;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::common::sync::lock;

/// The on-disk format this build writes and the only one it reads.
pub const FORMAT: u64 = 1;

/// Mode of a state directory Keel creates: the state names every jail and
/// may carry keys, so only the daemon's user may look.
pub const DIR_MODE: u32 = 0o700;

/// Mode of the state file.
pub const FILE_MODE: u32 = 0o600;

/// One step of a save, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// Create or truncate the temp file and write the whole document.
    Write,
    /// fsync(2) the temp file.
    Fsync,
    /// rename(2) the temp file over the state file.
    Rename,
    /// fsync(2) the directory so the rename itself is durable.
    FsyncDir,
}

impl Step {
    /// Every step, in order.
    pub const ALL: [Step; 4] = [Step::Write, Step::Fsync, Step::Rename, Step::FsyncDir];
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::Write => "writing the temp file",
            Step::Fsync => "fsync of the temp file",
            Step::Rename => "renaming the temp file over the state file",
            Step::FsyncDir => "fsync of the state directory",
        })
    }
}

/// The file system operations a [`Store`] needs; [`RealFs`] in the daemons.
pub trait StoreFs: Send {
    /// The whole file, or `None` when it does not exist.
    fn read(&self, path: &Path) -> io::Result<Option<Vec<u8>>>;
    /// Creates or truncates `path` (mode [`FILE_MODE`]) and writes `bytes`.
    fn write_temp(&self, path: &Path, bytes: &[u8]) -> io::Result<()>;
    /// Flushes `path`'s data to stable storage.
    fn fsync_file(&self, path: &Path) -> io::Result<()>;
    /// Atomically replaces `to` with `from`.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Flushes the directory `dir` (its entries) to stable storage.
    fn fsync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// The real file system.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealFs;

impl StoreFs for RealFs {
    fn read(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        match std::fs::read(path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn write_temp(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(FILE_MODE)
            .open(path)?;
        file.write_all(bytes)
    }

    fn fsync_file(&self, path: &Path) -> io::Result<()> {
        // fsync flushes the file, not the descriptor, so a fresh descriptor
        // is as good as the one that wrote.
        OpenOptions::new().write(true).open(path)?.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn fsync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

/// A file system that lives in memory and never touches the disk: the
/// store of a dry run (`agentd::reconciler`), which must run the same saves
/// as an apply and leave the real state file byte for byte as it was. Clones
/// share their files.
#[derive(Debug, Clone, Default)]
pub struct MemoryFs(Arc<Mutex<std::collections::BTreeMap<PathBuf, Vec<u8>>>>);

impl StoreFs for MemoryFs {
    fn read(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        Ok(lock(&self.0).get(path).cloned())
    }

    fn write_temp(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        lock(&self.0).insert(path.to_path_buf(), bytes.to_vec());
        Ok(())
    }

    fn fsync_file(&self, _path: &Path) -> io::Result<()> {
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut files = lock(&self.0);
        let bytes = files.remove(from).ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, format!("{}", from.display()))
        })?;
        files.insert(to.to_path_buf(), bytes);
        Ok(())
    }

    fn fsync_dir(&self, _dir: &Path) -> io::Result<()> {
        Ok(())
    }
}

/// A [`RealFs`] that can be told to fail a step, for crash tests. Clones
/// share their settings and log.
///
/// A failed step does nothing (a failed [`Step::Write`] leaves half the
/// document in the temp file, like a crash mid-write), and with
/// [`FaultyFs::stop_at`] every later step fails too, like a process that died
/// there.
#[derive(Debug, Clone, Default)]
pub struct FaultyFs(Arc<Mutex<FaultState>>);

#[derive(Debug, Default)]
struct FaultState {
    fail_at: Option<Step>,
    stop: bool,
    stopped: bool,
    log: Vec<String>,
}

impl FaultyFs {
    /// A file system that fails nothing until told to.
    pub fn new() -> FaultyFs {
        FaultyFs::default()
    }

    /// The next time `step` runs it fails; later steps run normally.
    pub fn fail_at(&self, step: Step) {
        let mut s = lock(&self.0);
        s.fail_at = Some(step);
        s.stop = false;
    }

    /// `step` and everything after it fails, as if the process died there.
    pub fn stop_at(&self, step: Step) {
        let mut s = lock(&self.0);
        s.fail_at = Some(step);
        s.stop = true;
    }

    /// Removes injected faults.
    pub fn clear(&self) {
        let mut s = lock(&self.0);
        s.fail_at = None;
        s.stop = false;
        s.stopped = false;
    }

    /// Operations run so far, e.g. `"rename /d/.s.json.tmp /d/s.json"`;
    /// failed ones end in `" (failed)"`.
    pub fn log(&self) -> Vec<String> {
        lock(&self.0).log.clone()
    }

    /// Logs the operation and says whether to fail it.
    fn check(&self, step: Step, what: String) -> io::Result<()> {
        let mut s = lock(&self.0);
        let fail = s.stopped || s.fail_at == Some(step);
        if s.fail_at == Some(step) {
            s.fail_at = None;
            s.stopped = s.stop;
        }
        if fail {
            s.log.push(format!("{what} (failed)"));
            return Err(io::Error::other(format!("injected fault at {step}")));
        }
        s.log.push(what);
        Ok(())
    }
}

impl StoreFs for FaultyFs {
    fn read(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        RealFs.read(path)
    }

    fn write_temp(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let result = self.check(Step::Write, format!("write {}", path.display()));
        if result.is_err() {
            // A torn write: the part that made it before the crash.
            RealFs.write_temp(path, &bytes[..bytes.len() / 2])?;
            return result;
        }
        RealFs.write_temp(path, bytes)
    }

    fn fsync_file(&self, path: &Path) -> io::Result<()> {
        self.check(Step::Fsync, format!("fsync {}", path.display()))?;
        RealFs.fsync_file(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let what = format!("rename {} {}", from.display(), to.display());
        self.check(Step::Rename, what)?;
        RealFs.rename(from, to)
    }

    fn fsync_dir(&self, dir: &Path) -> io::Result<()> {
        self.check(Step::FsyncDir, format!("fsync {}", dir.display()))?;
        RealFs.fsync_dir(dir)
    }
}

/// Why the state could not be loaded or saved.
#[derive(Debug)]
pub enum StoreError {
    /// The file name is not a plain name inside the directory.
    BadName {
        /// The name given.
        name: String,
    },
    /// The state directory could not be created.
    CreateDir {
        /// The directory.
        dir: PathBuf,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The state file exists but could not be read.
    Read {
        /// The state file.
        path: PathBuf,
        /// The operating system's reason.
        source: io::Error,
    },
    /// The state file is not a readable document of the expected shape.
    Corrupt {
        /// The state file, left as it was.
        path: PathBuf,
        /// What the JSON parser said.
        reason: String,
    },
    /// The state file has a `format` this build does not know.
    UnknownFormat {
        /// The state file, left as it was.
        path: PathBuf,
        /// The format found.
        found: u64,
    },
    /// The state could not be turned into JSON (a bug in the state type).
    Encode {
        /// The state file.
        path: PathBuf,
        /// What serde_json said.
        reason: String,
    },
    /// A save failed part-way; the previous state is still on disk.
    Save {
        /// The state file.
        path: PathBuf,
        /// The step that failed.
        step: Step,
        /// The file or directory that step worked on.
        target: PathBuf,
        /// The operating system's reason.
        source: io::Error,
    },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::BadName { name } => write!(
                f,
                "state file name `{name}` must be a plain file name without `/` (a bug in the caller)"
            ),
            StoreError::CreateDir { dir, source } => write!(
                f,
                "cannot create state directory {}: {source}; create it (mode 0700, owned by \
                 the daemon's user) or fix the permissions of its parent",
                dir.display()
            ),
            StoreError::Read { path, source } => write!(
                f,
                "cannot read state file {}: {source}; check its permissions and ownership",
                path.display()
            ),
            StoreError::Corrupt { path, reason } => write!(
                f,
                "state file {} is corrupt ({reason}); it was left untouched: inspect it, \
                 then restore it from a backup or move it aside after inspection to start fresh",
                path.display()
            ),
            StoreError::UnknownFormat { path, found } => write!(
                f,
                "state file {} has format {found}, but this keel reads only format {FORMAT}; \
                 it was left untouched: it was probably written by another keel version, so \
                 run that version, or move it aside after inspection to start fresh",
                path.display()
            ),
            StoreError::Encode { path, reason } => write!(
                f,
                "cannot encode the state for {}: {reason}; this is a bug in keel, please report it",
                path.display()
            ),
            StoreError::Save {
                path,
                step,
                target,
                source,
            } => write!(
                f,
                "saving state file {} failed at {step} ({}): {source}; the previous state is \
                 still in place; check free space and permissions of the state directory",
                path.display(),
                target.display()
            ),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::CreateDir { source, .. }
            | StoreError::Read { source, .. }
            | StoreError::Save { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Just the version, read before the state so an unknown format is reported
/// as such rather than as a shape mismatch.
#[derive(Deserialize)]
struct Header {
    format: u64,
}

#[derive(Deserialize)]
struct Document<T> {
    state: T,
}

#[derive(Serialize)]
struct DocumentRef<'a, T> {
    format: u64,
    state: &'a T,
}

/// One JSON state file holding a `T`. See the module docs.
pub struct Store<T> {
    dir: PathBuf,
    path: PathBuf,
    tmp: PathBuf,
    fs: Box<dyn StoreFs>,
    // fn() -> T: the store holds no T, so it is Send whatever T is.
    _state: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for Store<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

impl<T: Serialize + DeserializeOwned> Store<T> {
    /// Opens `dir/file_name` on the real file system, creating `dir` (mode
    /// 0700) if missing. Returns the store and the saved state, `None` when
    /// nothing was saved yet.
    pub fn open(dir: &Path, file_name: &str) -> Result<(Store<T>, Option<T>), StoreError> {
        Store::with_fs(dir, file_name, RealFs)
    }

    /// [`Store::open`] over another [`StoreFs`] (tests).
    pub fn with_fs(
        dir: &Path,
        file_name: &str,
        fs: impl StoreFs + 'static,
    ) -> Result<(Store<T>, Option<T>), StoreError> {
        let plain = !file_name.is_empty()
            && file_name != "."
            && file_name != ".."
            && !file_name.contains('/')
            && !file_name.contains('\0');
        if !plain {
            return Err(StoreError::BadName {
                name: file_name.to_string(),
            });
        }
        // An existing directory keeps its mode: the operator may have chosen
        // a group for backups.
        DirBuilder::new()
            .recursive(true)
            .mode(DIR_MODE)
            .create(dir)
            .map_err(|source| StoreError::CreateDir {
                dir: dir.to_path_buf(),
                source,
            })?;
        let store = Store {
            dir: dir.to_path_buf(),
            path: dir.join(file_name),
            tmp: dir.join(format!(".{file_name}.tmp")),
            fs: Box::new(fs),
            _state: PhantomData,
        };
        let state = store.load()?;
        Ok((store, state))
    }

    /// A store named `file_name` over a fresh [`MemoryFs`]: nothing is
    /// created or read on disk, and every save stays in memory.
    pub fn in_memory(file_name: &str) -> Store<T> {
        let dir = PathBuf::from("/nonexistent-in-memory");
        Store {
            path: dir.join(file_name),
            tmp: dir.join(format!(".{file_name}.tmp")),
            dir,
            fs: Box::new(MemoryFs::default()),
            _state: PhantomData,
        }
    }

    /// The state file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn load(&self) -> Result<Option<T>, StoreError> {
        let bytes = match self.fs.read(&self.path) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Ok(None),
            Err(source) => {
                return Err(StoreError::Read {
                    path: self.path.clone(),
                    source,
                });
            }
        };
        let corrupt = |e: serde_json::Error| StoreError::Corrupt {
            path: self.path.clone(),
            reason: e.to_string(),
        };
        let header: Header = serde_json::from_slice(&bytes).map_err(corrupt)?;
        if header.format != FORMAT {
            return Err(StoreError::UnknownFormat {
                path: self.path.clone(),
                found: header.format,
            });
        }
        let doc: Document<T> = serde_json::from_slice(&bytes).map_err(corrupt)?;
        Ok(Some(doc.state))
    }

    /// Replaces the saved state with `value`, durably. On error the previous
    /// state is what a restart reads, except after a failed
    /// [`Step::FsyncDir`], when the new state is in place but a power cut
    /// could still undo it.
    pub fn save(&mut self, value: &T) -> Result<(), StoreError> {
        let doc = DocumentRef {
            format: FORMAT,
            state: value,
        };
        let mut bytes = serde_json::to_vec_pretty(&doc).map_err(|e| StoreError::Encode {
            path: self.path.clone(),
            reason: e.to_string(),
        })?;
        bytes.push(b'\n');
        let fail = |step: Step, target: &Path| {
            let path = self.path.clone();
            let target = target.to_path_buf();
            move |source| StoreError::Save {
                path,
                step,
                target,
                source,
            }
        };
        self.fs
            .write_temp(&self.tmp, &bytes)
            .map_err(fail(Step::Write, &self.tmp))?;
        self.fs
            .fsync_file(&self.tmp)
            .map_err(fail(Step::Fsync, &self.tmp))?;
        self.fs
            .rename(&self.tmp, &self.path)
            .map_err(fail(Step::Rename, &self.path))?;
        self.fs
            .fsync_dir(&self.dir)
            .map_err(fail(Step::FsyncDir, &self.dir))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use std::os::unix::fs::PermissionsExt;

    type State = BTreeMap<String, u32>;

    fn state(pairs: &[(&str, u32)]) -> State {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    fn reopen(dir: &Path) -> Option<State> {
        let (_, got) = Store::<State>::open(dir, "state.json").expect("reopen");
        got
    }

    #[test]
    fn round_trip_and_overwrite() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (mut store, first) = Store::<State>::open(tmp.path(), "state.json").expect("open");
        assert_eq!(first, None);
        store.save(&state(&[("web", 1)])).expect("save");
        assert_eq!(reopen(tmp.path()), Some(state(&[("web", 1)])));
        store.save(&state(&[("db", 2)])).expect("save");
        assert_eq!(reopen(tmp.path()), Some(state(&[("db", 2)])));

        let text = std::fs::read_to_string(tmp.path().join("state.json")).expect("read");
        let doc: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(doc, serde_json::json!({"format": 1, "state": {"db": 2}}));
        assert!(!tmp.path().join(".state.json.tmp").exists());
    }

    #[test]
    fn save_runs_write_fsync_rename_fsync_dir_in_order() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let fs = FaultyFs::new();
        let (mut store, _) =
            Store::<State>::with_fs(tmp.path(), "s.json", fs.clone()).expect("open");
        store.save(&state(&[("a", 1)])).expect("save");
        let d = tmp.path().display();
        assert_eq!(
            fs.log(),
            [
                format!("write {d}/.s.json.tmp"),
                format!("fsync {d}/.s.json.tmp"),
                format!("rename {d}/.s.json.tmp {d}/s.json"),
                format!("fsync {d}"),
            ]
        );
    }

    #[test]
    fn creates_missing_dir_0700_and_file_0600() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("var/db/keel/agentd");
        let (mut store, _) = Store::<State>::open(&dir, "state.json").expect("open");
        store.save(&state(&[("a", 1)])).expect("save");
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("state.json")), 0o600);
    }

    #[test]
    fn unknown_format_is_an_error_and_the_file_is_kept() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join("state.json");
        let original = br#"{"format": 2, "state": {"web": 1}}"#;
        std::fs::write(&path, original).expect("write");
        let err = Store::<State>::open(tmp.path(), "state.json").expect_err("format 2");
        assert!(
            matches!(err, StoreError::UnknownFormat { found: 2, .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains("move it aside"), "{msg}");
        assert_eq!(std::fs::read(&path).expect("read"), original);
    }

    #[test]
    fn corrupt_file_is_an_error_naming_it_and_is_kept() {
        let cases: &[&[u8]] = &[
            b"{\"format\": 1, \"state\": {\"web\": ",
            b"",
            b"\xff\xfe garbage",
            br#"{"state": {"web": 1}}"#,
            br#"{"format": 1, "state": {"web": "one"}}"#,
            br#"{"format": 1}"#,
        ];
        for original in cases {
            let tmp = tempfile::tempdir().expect("tempdir");
            let path = tmp.path().join("state.json");
            std::fs::write(&path, original).expect("write");
            let err = Store::<State>::open(tmp.path(), "state.json").expect_err("corrupt");
            assert!(matches!(err, StoreError::Corrupt { .. }), "{err:?}");
            let msg = err.to_string();
            assert!(msg.contains(&path.display().to_string()), "{msg}");
            assert!(msg.contains("left untouched"), "{msg}");
            assert_eq!(std::fs::read(&path).expect("read"), *original);
            let names: Vec<_> = std::fs::read_dir(tmp.path())
                .expect("ls")
                .map(|e| e.expect("entry").file_name())
                .collect();
            assert_eq!(names, ["state.json"], "nothing renamed or added");
        }
    }

    #[test]
    fn failed_save_names_step_and_file() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let fs = FaultyFs::new();
        let (mut store, _) =
            Store::<State>::with_fs(tmp.path(), "state.json", fs.clone()).expect("open");
        fs.fail_at(Step::Rename);
        let err = store.save(&state(&[("a", 1)])).expect_err("rename fails");
        assert!(
            matches!(
                err,
                StoreError::Save {
                    step: Step::Rename,
                    ..
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("renaming the temp file"), "{msg}");
        assert!(
            msg.contains(&tmp.path().join("state.json").display().to_string()),
            "{msg}"
        );
        // fail_at is one-shot: the next save goes through.
        store.save(&state(&[("a", 2)])).expect("save");
        assert_eq!(reopen(tmp.path()), Some(state(&[("a", 2)])));
    }

    /// The store's promise: a store write interrupted at each step leaves
    /// either the old or the new state readable, never neither.
    #[test]
    fn interrupted_write_leaves_old_or_new_state_at_every_step() {
        let old = state(&[("web", 1), ("db", 7)]);
        let new = state(&[("web", 2)]);
        for step in Step::ALL {
            for had_old in [true, false] {
                let tmp = tempfile::tempdir().expect("tempdir");
                if had_old {
                    let (mut s, _) = Store::<State>::open(tmp.path(), "state.json").expect("open");
                    s.save(&old).expect("save old");
                }
                let fs = FaultyFs::new();
                let (mut store, _) =
                    Store::<State>::with_fs(tmp.path(), "state.json", fs.clone()).expect("open");
                fs.stop_at(step);
                let err = store.save(&new).expect_err("the process died here");
                assert!(matches!(err, StoreError::Save { step: s, .. } if s == step));
                drop(store);

                let got = reopen(tmp.path());
                let before = had_old.then(|| old.clone());
                // The rename is the commit point.
                let want = if step == Step::FsyncDir {
                    Some(new.clone())
                } else {
                    before
                };
                assert_eq!(got, want, "stopped at {step:?}, had old state: {had_old}");

                // The leftover temp file does not block the next save.
                let (mut store, _) =
                    Store::<State>::open(tmp.path(), "state.json").expect("reopen");
                store.save(&new).expect("save after crash");
                assert_eq!(reopen(tmp.path()), Some(new.clone()));
            }
        }
    }

    #[test]
    fn leftover_temp_file_is_ignored() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = Store::<State>::open(tmp.path(), "state.json").expect("open");
        store.save(&state(&[("a", 1)])).expect("save");
        std::fs::write(tmp.path().join(".state.json.tmp"), b"{\"format\": 1, \"sta")
            .expect("write");
        assert_eq!(reopen(tmp.path()), Some(state(&[("a", 1)])));
    }

    #[test]
    fn bad_file_names_are_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        for name in ["", ".", "..", "a/b", "/etc/passwd"] {
            let err = Store::<State>::open(tmp.path(), name).expect_err(name);
            assert!(matches!(err, StoreError::BadName { .. }), "{name}: {err:?}");
        }
    }

    #[test]
    fn uncreatable_dir_is_reported() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let file = tmp.path().join("plain-file");
        std::fs::write(&file, b"").expect("write");
        let err = Store::<State>::open(&file.join("sub"), "s.json").expect_err("not a dir");
        assert!(matches!(err, StoreError::CreateDir { .. }), "{err:?}");
        assert!(err.to_string().contains("plain-file/sub"), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Any sequence of saves, some of them dying at some step: a restart
        /// always reads the last committed state (committed = renamed).
        #[test]
        fn restart_reads_the_last_committed_state(
            ops in proptest::collection::vec((any::<u32>(), proptest::option::of(0usize..4)), 1..8),
        ) {
            let tmp = tempfile::tempdir().expect("tempdir");
            let mut committed: Option<State> = None;
            for (value, fault) in ops {
                let fs = FaultyFs::new();
                let (mut store, loaded) =
                    Store::<State>::with_fs(tmp.path(), "state.json", fs.clone()).expect("open");
                prop_assert_eq!(&loaded, &committed);
                let next = state(&[("v", value)]);
                if let Some(i) = fault {
                    fs.stop_at(Step::ALL[i]);
                }
                let result = store.save(&next);
                prop_assert_eq!(result.is_ok(), fault.is_none());
                if fault.is_none_or(|i| Step::ALL[i] == Step::FsyncDir) {
                    committed = Some(next);
                }
            }
            prop_assert_eq!(reopen(tmp.path()), committed);
        }
    }
}
