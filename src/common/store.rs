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
//! [`RecordStore`] is the same promise for state kept as one record per
//! key, one file per record in a directory of its own (the agent's jails,
//! `agentd::reconciler::records`): a save writes only its record, so its cost
//! does not grow with the number of records. Each record file is written
//! exactly as a state file (temp file, fsync, rename, directory fsync), so a
//! crash at any step leaves that record old or new, never torn, and never
//! touches another record. A removal unlinks the file and fsyncs the
//! directory. Why files and not a journal (`common::journal`): the agent has
//! one worker thread, so its writes never overlap and group commit would
//! have nothing to group; a record file needs no compaction and no replay,
//! a restart reads exactly what the last save wrote, and an operator can
//! read or back up one jail's record on its own. The price is one directory
//! entry per record, which a start reads once.
//!
//! File system access goes through [`StoreFs`] so tests can stop a save at
//! any step ([`FaultyFs`]) and check what a restart would find.

use std::collections::BTreeMap;
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
    /// unlink(2) a record file ([`RecordStore::remove`]; followed by
    /// [`Step::FsyncDir`]).
    Remove,
}

impl Step {
    /// Every step of a save, in order.
    pub const ALL: [Step; 4] = [Step::Write, Step::Fsync, Step::Rename, Step::FsyncDir];
    /// Every step of a record's removal, in order.
    pub const REMOVAL: [Step; 2] = [Step::Remove, Step::FsyncDir];
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::Write => "writing the temp file",
            Step::Fsync => "fsync of the temp file",
            Step::Rename => "renaming the temp file over the state file",
            Step::FsyncDir => "fsync of the state directory",
            Step::Remove => "removing the record file",
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
    /// Creates `dir` and its missing parents (mode [`DIR_MODE`]); an
    /// existing directory keeps its mode.
    fn create_dir(&self, dir: &Path) -> io::Result<()>;
    /// The names of the entries of `dir` (files and directories alike).
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Removes the file `path`; one that does not exist is not an error.
    fn remove(&self, path: &Path) -> io::Result<()>;
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

    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        // An existing directory keeps its mode: the operator may have chosen
        // a group for backups.
        DirBuilder::new().recursive(true).mode(DIR_MODE).create(dir)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        Ok(names)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// A file system that lives in memory and never touches the disk: the
/// store of a dry run (`agentd::reconciler`), which must run the same saves
/// as an apply and leave the real state file byte for byte as it was. Clones
/// share their files.
#[derive(Debug, Clone, Default)]
pub struct MemoryFs(Arc<Mutex<BTreeMap<PathBuf, Vec<u8>>>>);

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

    fn create_dir(&self, _dir: &Path) -> io::Result<()> {
        Ok(())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        Ok(lock(&self.0)
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .collect())
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        lock(&self.0).remove(path);
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
    /// Runs of `fail_at` to let through before it fails.
    skip: usize,
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
        s.skip = 0;
        s.stop = false;
    }

    /// `step` and everything after it fails, as if the process died there.
    pub fn stop_at(&self, step: Step) {
        self.stop_at_nth(step, 0);
    }

    /// Like [`FaultyFs::stop_at`], at the run of `step` after `skip` runs
    /// of it went through (a crash part-way through several saves).
    pub fn stop_at_nth(&self, step: Step, skip: usize) {
        let mut s = lock(&self.0);
        s.fail_at = Some(step);
        s.skip = skip;
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
        if s.fail_at == Some(step) && s.skip > 0 {
            s.skip -= 1;
            s.log.push(what);
            return Ok(());
        }
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

    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        RealFs.create_dir(dir)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        RealFs.list(dir)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        self.check(Step::Remove, format!("remove {}", path.display()))?;
        RealFs.remove(path)
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
        if !is_plain_name(file_name) {
            return Err(StoreError::BadName {
                name: file_name.to_string(),
            });
        }
        fs.create_dir(dir).map_err(|source| StoreError::CreateDir {
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
        read_document(self.fs.as_ref(), &self.path)
    }

    /// Replaces the saved state with `value`, durably. On error the previous
    /// state is what a restart reads, except after a failed
    /// [`Step::FsyncDir`], when the new state is in place but a power cut
    /// could still undo it.
    pub fn save(&mut self, value: &T) -> Result<(), StoreError> {
        let bytes = encode_document(&self.path, value)?;
        write_durably(self.fs.as_ref(), &self.dir, &self.tmp, &self.path, &bytes)
    }
}

/// True for a name that is one plain entry of a directory.
fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

/// The state of the document at `path`, `None` when there is none.
fn read_document<T: DeserializeOwned>(
    fs: &dyn StoreFs,
    path: &Path,
) -> Result<Option<T>, StoreError> {
    let bytes = match fs.read(path) {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return Ok(None),
        Err(source) => {
            return Err(StoreError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let corrupt = |e: serde_json::Error| StoreError::Corrupt {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let header: Header = serde_json::from_slice(&bytes).map_err(corrupt)?;
    if header.format != FORMAT {
        return Err(StoreError::UnknownFormat {
            path: path.to_path_buf(),
            found: header.format,
        });
    }
    let doc: Document<T> = serde_json::from_slice(&bytes).map_err(corrupt)?;
    Ok(Some(doc.state))
}

/// `value` as the document a save writes to `path`.
fn encode_document<T: Serialize>(path: &Path, value: &T) -> Result<Vec<u8>, StoreError> {
    let doc = DocumentRef {
        format: FORMAT,
        state: value,
    };
    let mut bytes = serde_json::to_vec_pretty(&doc).map_err(|e| StoreError::Encode {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// The save protocol of the module docs: `bytes` into `tmp`, fsync, rename
/// over `path`, fsync of `dir`.
fn write_durably(
    fs: &dyn StoreFs,
    dir: &Path,
    tmp: &Path,
    path: &Path,
    bytes: &[u8],
) -> Result<(), StoreError> {
    let fail = |step: Step, target: &Path| {
        let path = path.to_path_buf();
        let target = target.to_path_buf();
        move |source| StoreError::Save {
            path,
            step,
            target,
            source,
        }
    };
    fs.write_temp(tmp, bytes).map_err(fail(Step::Write, tmp))?;
    fs.fsync_file(tmp).map_err(fail(Step::Fsync, tmp))?;
    fs.rename(tmp, path).map_err(fail(Step::Rename, path))?;
    fs.fsync_dir(dir).map_err(fail(Step::FsyncDir, dir))?;
    Ok(())
}

/// Suffix of a record file: `{key}.json`.
const RECORD_SUFFIX: &str = ".json";

/// One record per key, each in its own file `{dir}/{key}.json` written as a
/// state file is. See the module docs.
pub struct RecordStore<T> {
    dir: PathBuf,
    /// The directory exists (see [`RecordStore::ensure_dir`]).
    exists: bool,
    fs: Box<dyn StoreFs>,
    // fn() -> T: the store holds no T, so it is Send whatever T is.
    _record: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for RecordStore<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordStore")
            .field("dir", &self.dir)
            .finish()
    }
}

impl<T: Serialize + DeserializeOwned> RecordStore<T> {
    /// Opens the record directory `dir` over `fs` and reads every record in
    /// it; a missing directory holds none and is created by the first save.
    /// A temp file left by a crash (`.{key}.json.tmp`) is never read; any
    /// other entry that is not `{key}.json` is not Keel's and is left alone.
    /// One unreadable record fails the open, naming its file, and nothing is
    /// changed.
    pub fn with_fs(
        dir: &Path,
        fs: Box<dyn StoreFs>,
    ) -> Result<(RecordStore<T>, BTreeMap<String, T>), StoreError> {
        let names = match fs.list(dir) {
            Ok(names) => Some(names),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(StoreError::Read {
                    path: dir.to_path_buf(),
                    source,
                });
            }
        };
        let store = RecordStore {
            dir: dir.to_path_buf(),
            exists: names.is_some(),
            fs,
            _record: PhantomData,
        };
        let mut records = BTreeMap::new();
        for name in names.unwrap_or_default() {
            let Some(key) = name.strip_suffix(RECORD_SUFFIX) else {
                continue;
            };
            if key.is_empty() || key.starts_with('.') {
                continue;
            }
            if let Some(record) = read_document(store.fs.as_ref(), &store.dir.join(&name))? {
                records.insert(key.to_string(), record);
            }
        }
        Ok((store, records))
    }

    /// True once the directory exists (it was there at open, or a save
    /// created it).
    pub fn exists(&self) -> bool {
        self.exists
    }

    /// Creates the directory before its first record, and makes its entry
    /// in the parent durable: a record in a directory a power cut could
    /// undo would not be on disk.
    fn ensure_dir(&mut self) -> Result<(), StoreError> {
        if self.exists {
            return Ok(());
        }
        let create_failed = |source| StoreError::CreateDir {
            dir: self.dir.clone(),
            source,
        };
        self.fs.create_dir(&self.dir).map_err(create_failed)?;
        if let Some(parent) = self.dir.parent() {
            self.fs.fsync_dir(parent).map_err(create_failed)?;
        }
        self.exists = true;
        Ok(())
    }

    /// The record directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file holding `key`'s record.
    pub fn path_of(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}{RECORD_SUFFIX}"))
    }

    /// Replaces `key`'s record with `value`, durably, writing nothing else.
    /// On error the previous record is what a restart reads, except after a
    /// failed [`Step::FsyncDir`] (see [`Store::save`]).
    pub fn save(&mut self, key: &str, value: &T) -> Result<(), StoreError> {
        let path = self.checked_path(key)?;
        self.ensure_dir()?;
        let tmp = self.dir.join(format!(".{key}{RECORD_SUFFIX}.tmp"));
        let bytes = encode_document(&path, value)?;
        write_durably(self.fs.as_ref(), &self.dir, &tmp, &path, &bytes)
    }

    /// Removes `key`'s record, durably; a key without one is not an error.
    /// On error the record may still be what a restart reads.
    pub fn remove(&mut self, key: &str) -> Result<(), StoreError> {
        let path = self.checked_path(key)?;
        let fail = |step: Step, target: &Path| {
            let path = path.clone();
            let target = target.to_path_buf();
            move |source| StoreError::Save {
                path,
                step,
                target,
                source,
            }
        };
        self.fs.remove(&path).map_err(fail(Step::Remove, &path))?;
        self.fs
            .fsync_dir(&self.dir)
            .map_err(fail(Step::FsyncDir, &self.dir))?;
        Ok(())
    }

    fn checked_path(&self, key: &str) -> Result<PathBuf, StoreError> {
        if !is_plain_name(key) || key.starts_with('.') {
            return Err(StoreError::BadName {
                name: key.to_string(),
            });
        }
        Ok(self.path_of(key))
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

    type Records = BTreeMap<String, State>;

    fn reopen_records(dir: &Path) -> Records {
        let (_, got) = RecordStore::<State>::with_fs(dir, Box::new(RealFs)).expect("reopen");
        got
    }

    fn seeded_records(dir: &Path) -> Records {
        let (mut store, _) = RecordStore::<State>::with_fs(dir, Box::new(RealFs)).expect("open");
        let records: Records = [("web", 1), ("db", 2), ("cache", 3)]
            .iter()
            .map(|(k, v)| (k.to_string(), state(&[("v", *v)])))
            .collect();
        for (k, v) in &records {
            store.save(k, v).expect("seed");
        }
        records
    }

    #[test]
    fn a_record_save_writes_only_its_own_file() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("records");
        let mut want = seeded_records(&dir);
        let fs = FaultyFs::new();
        let (mut store, got) =
            RecordStore::<State>::with_fs(&dir, Box::new(fs.clone())).expect("open");
        assert_eq!(got, want);
        store.save("db", &state(&[("v", 9)])).expect("save");
        let d = dir.display();
        assert_eq!(
            fs.log(),
            [
                format!("write {d}/.db.json.tmp"),
                format!("fsync {d}/.db.json.tmp"),
                format!("rename {d}/.db.json.tmp {d}/db.json"),
                format!("fsync {d}"),
            ]
        );
        want.insert("db".into(), state(&[("v", 9)]));
        assert_eq!(reopen_records(&dir), want);
        store.remove("web").expect("remove");
        want.remove("web");
        assert_eq!(reopen_records(&dir), want);
        assert!(!dir.join("web.json").exists());
        // Removing what is not there is done already.
        store.remove("web").expect("remove again");
    }

    #[test]
    fn the_first_record_creates_the_directory_and_makes_it_durable() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("records");
        let fs = FaultyFs::new();
        let (mut store, got) =
            RecordStore::<State>::with_fs(&dir, Box::new(fs.clone())).expect("open");
        assert!(got.is_empty());
        assert!(!store.exists() && !dir.exists(), "opening creates nothing");
        store.save("web", &state(&[("v", 1)])).expect("save");
        assert!(store.exists());
        let mode = std::fs::metadata(&dir).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        assert_eq!(fs.log()[0], format!("fsync {}", tmp.path().display()));
    }

    /// The record store's promise: a save or a removal interrupted at each
    /// step leaves that record old or new (or gone), never torn, and every
    /// other record as it was.
    #[test]
    fn an_interrupted_record_write_leaves_old_or_new_and_the_others_intact() {
        let new = state(&[("v", 42)]);
        let saves = Step::ALL.into_iter().map(|step| (step, false));
        let removals = Step::REMOVAL.into_iter().map(|step| (step, true));
        for (step, removal) in saves.chain(removals) {
            let tmp = tempfile::tempdir().expect("tempdir");
            let dir = tmp.path().join("records");
            let old = seeded_records(&dir);
            let fs = FaultyFs::new();
            let (mut store, _) =
                RecordStore::<State>::with_fs(&dir, Box::new(fs.clone())).expect("open");
            fs.stop_at(step);
            let result = if removal {
                store.remove("db")
            } else {
                store.save("db", &new)
            };
            let err = result.expect_err("the process died here");
            assert!(matches!(err, StoreError::Save { step: s, .. } if s == step));
            drop(store);

            let got = reopen_records(&dir);
            let mut want = old.clone();
            // The rename (the unlink) is the commit point.
            if step == Step::FsyncDir {
                if removal {
                    want.remove("db");
                } else {
                    want.insert("db".into(), new.clone());
                }
            }
            assert_eq!(got, want, "stopped at {step:?}, removal: {removal}");

            // A leftover temp file does not block the next save.
            let (mut store, _) =
                RecordStore::<State>::with_fs(&dir, Box::new(RealFs)).expect("reopen");
            store.save("db", &new).expect("save after crash");
            want.insert("db".into(), new.clone());
            assert_eq!(reopen_records(&dir), want);
        }
    }

    #[test]
    fn a_corrupt_record_is_an_error_naming_it_and_is_kept() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("records");
        seeded_records(&dir);
        let path = dir.join("db.json");
        let torn = b"{\"format\": 1, \"state\": {\"v\": ";
        std::fs::write(&path, torn).expect("write");
        let err = RecordStore::<State>::with_fs(&dir, Box::new(RealFs)).expect_err("corrupt");
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
        assert_eq!(std::fs::read(&path).expect("read"), torn);
    }

    #[test]
    fn temp_files_and_foreign_entries_are_not_records() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("records");
        let want = seeded_records(&dir);
        std::fs::write(dir.join(".db.json.tmp"), b"{\"format\": 1, \"sta").expect("write");
        std::fs::write(dir.join("README"), b"not a record").expect("write");
        assert_eq!(reopen_records(&dir), want);
    }

    #[test]
    fn record_keys_that_are_not_plain_names_are_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (mut store, _) =
            RecordStore::<State>::with_fs(tmp.path(), Box::new(RealFs)).expect("open");
        for key in ["", ".", "..", "a/b", "../x", ".hidden"] {
            let err = store.save(key, &state(&[])).expect_err(key);
            assert!(matches!(err, StoreError::BadName { .. }), "{key}: {err:?}");
            let err = store.remove(key).expect_err(key);
            assert!(matches!(err, StoreError::BadName { .. }), "{key}: {err:?}");
        }
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
