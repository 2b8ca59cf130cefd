//! Files the agent reads and writes inside a directory tree that someone
//! else controls: a jail's root filesystem, whose root user may replace any
//! directory in it by a symbolic link (or a file, or a FIFO) at any moment.
//!
//! It owns resolving a path beneath such a root without a check-then-act
//! window: [`Dir::root`] opens the root, and every further step is an
//! openat(2) of one component relative to the descriptor of the directory
//! before it, with `O_NOFOLLOW|O_DIRECTORY`. What the kernel opened is what
//! is used; nothing is looked up a second time by path, so a directory
//! swapped for a link after its parent was opened is either refused (the
//! walk had not reached it) or irrelevant (the walk holds the old one, still
//! inside the root). Final files are opened `O_NOFOLLOW|O_NONBLOCK` (a FIFO
//! cannot hang the reader) and checked on the opened descriptor to be
//! regular files; writes go to a fresh temporary name created
//! `O_CREAT|O_EXCL|O_NOFOLLOW` with mode 0600, set to the caller's mode on the
//! descriptor (fchmod), synced, and renamed (renameat(2), which replaces a
//! link and never follows it) or hard-linked (linkat(2), for "only if absent")
//! into place inside the same directory descriptor. `..`, `.`, absolute
//! paths, symbolic links and non-directories are refused with a
//! [`BeneathError`] naming the component.
//!
//! FreeBSD's `O_RESOLVE_BENEATH` and Linux's openat2(2) `RESOLVE_BENEATH`
//! would do the walk in the kernel; the portable component walk gives the
//! same guarantee for the paths Keel uses (a handful of fixed, short paths),
//! so one implementation serves the FreeBSD host and the simulated one.
//!
//! Must never: follow a symbolic link below the root, look a path up twice
//! (check, then use), write into a file that existed before the write, or
//! block on anything but a regular file.
//!
//! One caller cannot use a descriptor: a volume's mount point, which
//! mkdir(8) and mount(8) take as a path. [`directories_below`] checks that
//! path with `lstat` instead, and the mount code runs it before mkdir(8) and
//! again before mount(8); the window between the second check and mount(8)
//! stays, and is closed by the order of operations, not by this module:
//! volumes are mounted before the jail is created, so no process of that
//! jail runs between the check and the mount.

use std::ffi::{CString, OsStr};
use std::fmt;
use std::fs::{File, Permissions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// Mode of the directories [`Create::Missing`] makes.
pub const DIR_MODE: libc::mode_t = 0o755;

/// Suffix of the temporary name a write goes through before it is renamed.
pub const TEMP_SUFFIX: &str = ".keel-tmp";

/// What went wrong resolving, reading or writing beneath a root. `path` is
/// always the root joined with the components up to the offending one.
#[derive(Debug)]
pub enum BeneathError {
    /// The path asked for is not plain names below the root (`..`, `.`, an
    /// absolute path, an empty name): a bug in the caller, never the jail's.
    NotPlain {
        /// The root.
        root: PathBuf,
        /// The path as asked.
        path: PathBuf,
    },
    /// A component is a symbolic link.
    SymbolicLink {
        /// The component.
        path: PathBuf,
    },
    /// A component that must be a directory is something else.
    NotADirectory {
        /// The component.
        path: PathBuf,
    },
    /// The final file is not a regular file (a FIFO, a device, a directory).
    NotARegularFile {
        /// The file.
        path: PathBuf,
    },
    /// A component does not exist (and was not to be created).
    Missing {
        /// The first missing component.
        path: PathBuf,
    },
    /// The file is larger than the caller accepts.
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit in bytes.
        limit: u64,
    },
    /// A system call failed for another reason.
    Io {
        /// The component or file.
        path: PathBuf,
        /// What was being done (`"open"`, `"create"`, `"rename into place"`).
        action: &'static str,
        /// What the OS said.
        source: io::Error,
    },
}

impl BeneathError {
    /// True when the path (or one of its directories) does not exist.
    pub fn is_missing(&self) -> bool {
        matches!(self, BeneathError::Missing { .. })
    }
}

impl fmt::Display for BeneathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const REMEDY: &str = "Keel never follows one inside a jail's root; remove or rename it \
                              (inside the jail, or on the host under the jail's root)";
        match self {
            BeneathError::NotPlain { root, path } => write!(
                f,
                "refusing {} below {}: only plain names are resolved beneath a root (no `..`, \
                 `.` or absolute path); this is a bug in keel-agentd, please report it",
                path.display(),
                root.display()
            ),
            BeneathError::SymbolicLink { path } => {
                write!(f, "{} is a symbolic link: {REMEDY}", path.display())
            }
            BeneathError::NotADirectory { path } => write!(
                f,
                "{} is not a directory (a file of that name is in the way): {REMEDY}",
                path.display()
            ),
            BeneathError::NotARegularFile { path } => write!(
                f,
                "{} is not a regular file (a FIFO, device or directory): {REMEDY}",
                path.display()
            ),
            BeneathError::Missing { path } => write!(f, "{} does not exist", path.display()),
            BeneathError::TooLarge { path, limit } => write!(
                f,
                "{} is larger than {limit} bytes, more than Keel ever writes there; remove it",
                path.display()
            ),
            BeneathError::Io {
                path,
                action,
                source,
            } => write!(f, "{} failed on {}: {source}", action, path.display()),
        }
    }
}

impl std::error::Error for BeneathError {}

/// Whether [`Dir::open`] creates missing directories.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Create {
    /// A missing component is [`BeneathError::Missing`].
    Never,
    /// A missing component is created with [`DIR_MODE`] (then opened like
    /// any other: a link planted between the two is still refused).
    Missing,
}

/// Whether a write may replace a file already at the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replace {
    Always,
    Never,
}

/// An open directory beneath a root: every operation is relative to its
/// descriptor, whatever happens to the path it was reached by.
#[derive(Debug)]
pub struct Dir {
    file: File,
    path: PathBuf,
}

impl Dir {
    /// Opens `root` itself. The root's own path belongs to the host (a
    /// dataset's mount point under `jails_dir`, the agent's state directory),
    /// so it is opened as given; only what lies below it is the jail's.
    pub fn root(root: &Path) -> Result<Dir, BeneathError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(root)
            .map_err(|source| match source.kind() {
                io::ErrorKind::NotFound => BeneathError::Missing {
                    path: root.to_path_buf(),
                },
                _ => BeneathError::Io {
                    path: root.to_path_buf(),
                    action: "open",
                    source,
                },
            })?;
        Ok(Dir {
            file,
            path: root.to_path_buf(),
        })
    }

    /// The path this directory was reached by, for messages only.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory `relative` (plain names) below this one, one component
    /// at a time, creating missing ones when `create` says so.
    pub fn open(&self, relative: &Path, create: Create) -> Result<Dir, BeneathError> {
        let names = plain_names(&self.path, relative)?;
        let mut at: Option<Dir> = None;
        for name in names {
            let next = at.as_ref().unwrap_or(self).child_dir(name, create)?;
            at = Some(next);
        }
        match at {
            Some(dir) => Ok(dir),
            None => self.duplicate(),
        }
    }

    /// The last `max_bytes` of file `name` here (empty when it does not
    /// exist). Never blocks: a FIFO or device is refused.
    pub fn read_tail(&self, name: &str, max_bytes: u64) -> Result<Vec<u8>, BeneathError> {
        let mut file = match self.open_regular(name) {
            Ok((file, _)) => file,
            Err(e) if e.is_missing() => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let io = |action| {
            move |source| BeneathError::Io {
                path: self.path.join(name),
                action,
                source,
            }
        };
        let len = file.metadata().map_err(io("stat"))?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(max_bytes)))
            .map_err(io("seek"))?;
        let mut tail = Vec::new();
        file.take(max_bytes)
            .read_to_end(&mut tail)
            .map_err(io("read"))?;
        Ok(tail)
    }

    /// The whole of file `name` here, refused unread when it is larger than
    /// `limit` bytes.
    pub fn read(&self, name: &str, limit: u64) -> Result<Vec<u8>, BeneathError> {
        let (file, path) = self.open_regular(name)?;
        let mut bytes = Vec::new();
        file.take(limit.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(|source| BeneathError::Io {
                path: path.clone(),
                action: "read",
                source,
            })?;
        if bytes.len() as u64 > limit {
            return Err(BeneathError::TooLarge { path, limit });
        }
        Ok(bytes)
    }

    /// Writes file `name` here with exactly `mode`, replacing whatever was at
    /// the name (a link is replaced, never followed). A reader sees the old
    /// contents or the new, never a part.
    pub fn write(&self, name: &str, contents: &[u8], mode: u32) -> Result<(), BeneathError> {
        self.write_through_temp(name, contents, mode, Replace::Always)
            .map(drop)
    }

    /// Writes file `name` here like [`Dir::write`], but only when nothing is
    /// at the name; false (and nothing changed) when something is.
    pub fn write_if_absent(
        &self,
        name: &str,
        contents: &[u8],
        mode: u32,
    ) -> Result<bool, BeneathError> {
        self.write_through_temp(name, contents, mode, Replace::Never)
    }

    /// Renames `from` to `to`, both in this directory (renameat(2): a link at
    /// either name is renamed or replaced itself, never followed).
    pub fn rename(&self, from: &str, to: &str) -> Result<(), BeneathError> {
        let (from_c, to_c) = (self.name(from)?, self.name(to)?);
        sys::renameat(&self.file, &from_c, &to_c).map_err(|source| BeneathError::Io {
            path: self.path.join(to),
            action: "rename into place",
            source,
        })?;
        self.sync()
    }

    fn write_through_temp(
        &self,
        name: &str,
        contents: &[u8],
        mode: u32,
        replace: Replace,
    ) -> Result<bool, BeneathError> {
        let target = self.name(name)?;
        let temp_name = format!("{name}{TEMP_SUFFIX}");
        let temp = self.name(&temp_name)?;
        let temp_path = self.path.join(&temp_name);
        let io = |action, path: &Path| {
            let path = path.to_path_buf();
            move |source| BeneathError::Io {
                path,
                action,
                source,
            }
        };
        // A leftover of a crash may have any mode or be a link: never
        // reuse it. unlinkat removes a link itself.
        match sys::unlinkat(&self.file, &temp) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("remove a stale temporary", &temp_path)(e)),
        }
        // 0600 from creation on: a key is never readable by others, not even
        // before the fchmod below sets the caller's mode.
        let fd = sys::openat(
            &self.file,
            &temp,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
            0o600,
        )
        .map_err(io("create", &temp_path))?;
        let mut file = File::from(fd);
        let written = file
            .set_permissions(Permissions::from_mode(mode))
            .map_err(io("chmod", &temp_path))
            .and_then(|()| file.write_all(contents).map_err(io("write", &temp_path)))
            .and_then(|()| file.sync_all().map_err(io("fsync", &temp_path)));
        let placed = written.and_then(|()| match replace {
            Replace::Always => sys::renameat(&self.file, &temp, &target)
                .map(|()| true)
                .map_err(io("rename into place", &self.path.join(name))),
            Replace::Never => match sys::linkat(&self.file, &temp, &target) {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
                Err(e) => Err(io("link into place", &self.path.join(name))(e)),
            },
        });
        if !matches!((replace, &placed), (Replace::Always, Ok(_))) {
            // Renamed: the temporary name is gone already. Otherwise it is
            // ours to remove; failing to is harmless (the next write removes
            // it first).
            let _ = sys::unlinkat(&self.file, &temp);
        }
        let placed = placed?;
        self.sync()?;
        Ok(placed)
    }

    /// The directory `name` inside this one, created first when missing and
    /// `create` allows.
    fn child_dir(&self, name: &OsStr, create: Create) -> Result<Dir, BeneathError> {
        let c_name = c_name(&self.path, name)?;
        let path = self.path.join(name);
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
        let opened = match sys::openat(&self.file, &c_name, flags, 0) {
            Err(e) if e.kind() == io::ErrorKind::NotFound && create == Create::Missing => {
                match sys::mkdirat(&self.file, &c_name, DIR_MODE) {
                    Ok(()) => {}
                    // Someone made it meanwhile: the open below judges it.
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(source) => {
                        return Err(BeneathError::Io {
                            path,
                            action: "create directory",
                            source,
                        });
                    }
                }
                sys::openat(&self.file, &c_name, flags, 0)
            }
            other => other,
        };
        match opened {
            Ok(fd) => Ok(Dir {
                file: File::from(fd),
                path,
            }),
            Err(e) => Err(self.refusal(&c_name, path, "open directory", e, true)),
        }
    }

    /// File `name` here, opened for reading without following a link and
    /// without blocking, and checked to be a regular file.
    fn open_regular(&self, name: &str) -> Result<(File, PathBuf), BeneathError> {
        let c_name = self.name(name)?;
        let path = self.path.join(name);
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
        let file = match sys::openat(&self.file, &c_name, flags, 0) {
            Ok(fd) => File::from(fd),
            Err(e) => return Err(self.refusal(&c_name, path, "open", e, false)),
        };
        let meta = file.metadata().map_err(|source| BeneathError::Io {
            path: path.clone(),
            action: "stat",
            source,
        })?;
        if !meta.is_file() {
            return Err(BeneathError::NotARegularFile { path });
        }
        Ok((file, path))
    }

    /// Why opening `name` here failed with `error`. The refusal itself came
    /// from the kernel (ELOOP on Linux, EMLINK on FreeBSD for a link,
    /// ENOTDIR for a file); this only picks the words, from an lstat of the
    /// entry relative to this directory.
    fn refusal(
        &self,
        name: &CString,
        path: PathBuf,
        action: &'static str,
        error: io::Error,
        want_dir: bool,
    ) -> BeneathError {
        if error.kind() == io::ErrorKind::NotFound {
            return BeneathError::Missing { path };
        }
        match sys::entry_type(&self.file, name) {
            Ok(libc::S_IFLNK) => BeneathError::SymbolicLink { path },
            Ok(kind) if want_dir && kind != libc::S_IFDIR => BeneathError::NotADirectory { path },
            _ => BeneathError::Io {
                path,
                action,
                source: error,
            },
        }
    }

    /// `name` as one plain component for a system call.
    fn name(&self, name: &str) -> Result<CString, BeneathError> {
        let plain = plain_names(&self.path, Path::new(name))?;
        if plain.len() != 1 {
            return Err(BeneathError::NotPlain {
                root: self.path.clone(),
                path: PathBuf::from(name),
            });
        }
        c_name(&self.path, OsStr::new(name))
    }

    fn duplicate(&self) -> Result<Dir, BeneathError> {
        let file = self.file.try_clone().map_err(|source| BeneathError::Io {
            path: self.path.clone(),
            action: "duplicate descriptor",
            source,
        })?;
        Ok(Dir {
            file,
            path: self.path.clone(),
        })
    }

    /// Makes a rename or link in this directory durable.
    fn sync(&self) -> Result<(), BeneathError> {
        self.file.sync_all().map_err(|source| BeneathError::Io {
            path: self.path.clone(),
            action: "fsync directory",
            source,
        })
    }
}

/// The components of `relative`, each a plain name; anything else refused.
fn plain_names<'a>(base: &Path, relative: &'a Path) -> Result<Vec<&'a OsStr>, BeneathError> {
    let refused = || BeneathError::NotPlain {
        root: base.to_path_buf(),
        path: relative.to_path_buf(),
    };
    // `Path::components` drops `.` in the middle and trailing `/`: look at
    // the raw bytes too so `a/./b` and `a//b` are refused, not normalised.
    let bytes = relative.as_os_str().as_bytes();
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    if bytes
        .split(|b| *b == b'/')
        .any(|part| part.is_empty() || part == b"." || part == b"..")
    {
        return Err(refused());
    }
    relative
        .components()
        .map(|c| match c {
            Component::Normal(name) => Ok(name),
            _ => Err(refused()),
        })
        .collect()
}

fn c_name(base: &Path, name: &OsStr) -> Result<CString, BeneathError> {
    CString::new(name.as_bytes()).map_err(|_| BeneathError::NotPlain {
        root: base.to_path_buf(),
        path: PathBuf::from(name),
    })
}

/// A path beneath a root, kept as the pair and resolved afresh at every use
/// (holding a descriptor across uses would pin the jail's filesystem, and
/// the jail may be recreated in between). For handing a location to another
/// thread or storing it; [`Dir`] is the resolved form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathBeneath {
    root: PathBuf,
    inside: PathBuf,
}

impl PathBeneath {
    /// `inside` (plain names, checked at use) beneath `root`.
    pub fn new(root: impl Into<PathBuf>, inside: impl Into<PathBuf>) -> PathBeneath {
        PathBeneath {
            root: root.into(),
            inside: inside.into(),
        }
    }

    /// The root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The path below the root.
    pub fn inside(&self) -> &Path {
        &self.inside
    }

    /// `name` inside this path.
    pub fn join(&self, name: impl AsRef<Path>) -> PathBeneath {
        PathBeneath {
            root: self.root.clone(),
            inside: self.inside.join(name),
        }
    }

    /// Root and path joined, for messages (and tests); never to open.
    pub fn display_path(&self) -> PathBuf {
        self.root.join(&self.inside)
    }

    /// [`read`] of this file.
    pub fn read(&self, limit: u64) -> Result<Vec<u8>, BeneathError> {
        read(&self.root, &self.inside, limit)
    }

    /// [`write()`] of this file.
    pub fn write(&self, contents: &[u8], mode: u32) -> Result<(), BeneathError> {
        write(&self.root, &self.inside, contents, mode)
    }
}

/// The last `max_bytes` of `file` (plain names) beneath `root`; empty when
/// it, or a directory on the way, does not exist yet.
pub fn read_tail(root: &Path, file: &Path, max_bytes: u64) -> Result<Vec<u8>, BeneathError> {
    let (dir, name) = split(root, file)?;
    match Dir::root(root).and_then(|r| r.open(dir, Create::Never)) {
        Ok(dir) => dir.read_tail(name, max_bytes),
        Err(e) if e.is_missing() => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Whether `file` (plain names) beneath `root` is a regular file: `false`
/// when it, or a directory on the way, does not exist; a symbolic link, a
/// FIFO or a directory there is the error naming it.
pub fn is_regular_file(root: &Path, file: &Path) -> Result<bool, BeneathError> {
    let (dir, name) = split(root, file)?;
    let opened = Dir::root(root)
        .and_then(|r| r.open(dir, Create::Never))
        .and_then(|d| d.open_regular(name).map(drop));
    match opened {
        Ok(()) => Ok(true),
        Err(e) if e.is_missing() => Ok(false),
        Err(e) => Err(e),
    }
}

/// The whole of `file` (plain names) beneath `root`, at most `limit` bytes.
pub fn read(root: &Path, file: &Path, limit: u64) -> Result<Vec<u8>, BeneathError> {
    let (dir, name) = split(root, file)?;
    Dir::root(root)?.open(dir, Create::Never)?.read(name, limit)
}

/// Creates directory `dir` (plain names) beneath `root` and every missing
/// directory on the way.
pub fn make_dirs(root: &Path, dir: &Path) -> Result<(), BeneathError> {
    Dir::root(root)?.open(dir, Create::Missing).map(drop)
}

/// Writes `file` (plain names) beneath `root` with `mode`, creating missing
/// directories; see [`Dir::write`].
pub fn write(root: &Path, file: &Path, contents: &[u8], mode: u32) -> Result<(), BeneathError> {
    let (dir, name) = split(root, file)?;
    Dir::root(root)?
        .open(dir, Create::Missing)?
        .write(name, contents, mode)
}

/// Writes `file` beneath `root` like [`write()`], only when nothing is there
/// yet; false when something was.
pub fn write_if_absent(
    root: &Path,
    file: &Path,
    contents: &[u8],
    mode: u32,
) -> Result<bool, BeneathError> {
    let (dir, name) = split(root, file)?;
    Dir::root(root)?
        .open(dir, Create::Missing)?
        .write_if_absent(name, contents, mode)
}

/// Renames `from` to `to` inside directory `dir` (plain names) beneath
/// `root`; see [`Dir::rename`].
pub fn rename(root: &Path, dir: &Path, from: &str, to: &str) -> Result<(), BeneathError> {
    Dir::root(root)?.open(dir, Create::Never)?.rename(from, to)
}

/// `file` as its directory and its name, both checked plain.
fn split<'a>(root: &Path, file: &'a Path) -> Result<(&'a Path, &'a str), BeneathError> {
    plain_names(root, file)?;
    let refused = || BeneathError::NotPlain {
        root: root.to_path_buf(),
        path: file.to_path_buf(),
    };
    let name = file
        .file_name()
        .and_then(OsStr::to_str)
        .ok_or_else(refused)?;
    Ok((file.parent().unwrap_or(Path::new("")), name))
}

/// Checks, for a tool that takes a path (mkdir(8), mount(8)), that every
/// component of `dir` below `root` that exists is a directory and not a
/// symbolic link, with `lstat`, never following one; components that do not
/// exist yet are fine. On refusal: the offending component and what it is
/// (`a symbolic link`, `not a directory`, or the error reading it). A `dir`
/// outside `root` is refused too.
///
/// This is a check, then the tool acts: the caller must make sure nothing in
/// the jail runs in between (see the module docs). Everything Keel itself
/// opens goes through [`Dir`] instead.
pub fn directories_below(root: &Path, dir: &Path) -> Result<(), (PathBuf, String)> {
    let Ok(inside) = dir.strip_prefix(root) else {
        return Err((
            dir.to_path_buf(),
            format!("outside the jail's root {}", root.display()),
        ));
    };
    let mut path = root.to_path_buf();
    for part in inside.components() {
        if !matches!(part, Component::Normal(_)) {
            return Err((path, "not a plain path component".into()));
        }
        path.push(part);
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_symlink() => {
                return Err((path, "a symbolic link".into()));
            }
            Ok(meta) if !meta.is_dir() => return Err((path, "not a directory".into())),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err((path, format!("unreadable ({e})"))),
        }
    }
    Ok(())
}

/// The *at(2) calls std does not offer. Each takes a directory descriptor
/// this module holds and one NUL-terminated name; they touch no memory of
/// ours beyond reading the name (and, for fstatat, filling one `stat`).
mod sys {
    use super::*;

    fn check(rc: libc::c_int) -> io::Result<()> {
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// openat(2), always with `O_CLOEXEC`.
    #[allow(unsafe_code)]
    pub(super) fn openat(
        dir: &File,
        name: &CString,
        flags: libc::c_int,
        mode: libc::c_uint,
    ) -> io::Result<OwnedFd> {
        // SAFETY: `name` is a valid NUL-terminated string that outlives the
        // call and `dir` an open descriptor; the returned descriptor is new
        // and owned by nobody else, so OwnedFd may take it.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                name.as_ptr(),
                flags | libc::O_CLOEXEC,
                mode,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: see above: `fd` is a fresh descriptor we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// mkdirat(2).
    #[allow(unsafe_code)]
    pub(super) fn mkdirat(dir: &File, name: &CString, mode: libc::mode_t) -> io::Result<()> {
        // SAFETY: valid descriptor and NUL-terminated name, read only.
        check(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) })
    }

    /// renameat(2) within one directory.
    #[allow(unsafe_code)]
    pub(super) fn renameat(dir: &File, from: &CString, to: &CString) -> io::Result<()> {
        let fd = dir.as_raw_fd();
        // SAFETY: valid descriptor and NUL-terminated names, read only.
        check(unsafe { libc::renameat(fd, from.as_ptr(), fd, to.as_ptr()) })
    }

    /// linkat(2) within one directory, without AT_SYMLINK_FOLLOW: fails
    /// with EEXIST when anything, a dangling link included, is at `to`.
    #[allow(unsafe_code)]
    pub(super) fn linkat(dir: &File, from: &CString, to: &CString) -> io::Result<()> {
        let fd = dir.as_raw_fd();
        // SAFETY: valid descriptor and NUL-terminated names, read only.
        check(unsafe { libc::linkat(fd, from.as_ptr(), fd, to.as_ptr(), 0) })
    }

    /// unlinkat(2) of a non-directory (a link is removed, not followed).
    #[allow(unsafe_code)]
    pub(super) fn unlinkat(dir: &File, name: &CString) -> io::Result<()> {
        // SAFETY: valid descriptor and NUL-terminated name, read only.
        check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) })
    }

    /// The file type bits (`S_IFLNK`, `S_IFDIR`, ...) of entry `name`, not
    /// following a link (fstatat(2) with AT_SYMLINK_NOFOLLOW).
    #[allow(unsafe_code)]
    pub(super) fn entry_type(dir: &File, name: &CString) -> io::Result<libc::mode_t> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
        // SAFETY: `st` is a writable `stat` the call fills; descriptor and
        // name as above.
        check(unsafe {
            libc::fstatat(
                dir.as_raw_fd(),
                name.as_ptr(),
                st.as_mut_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })?;
        // SAFETY: fstatat returned 0, so it filled `st` (it started zeroed,
        // which is a valid `stat` anyway).
        let st = unsafe { st.assume_init() };
        Ok(st.st_mode & libc::S_IFMT)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    /// A root with `etc/conf` in it, and a directory outside it.
    struct Tree {
        _dir: tempfile::TempDir,
        root: PathBuf,
        outside: PathBuf,
    }

    fn tree() -> Tree {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join("etc/conf")).expect("dirs");
        std::fs::create_dir(&outside).expect("outside");
        Tree {
            _dir: dir,
            root,
            outside,
        }
    }

    impl Tree {
        fn outside_is_empty(&self) -> bool {
            std::fs::read_dir(&self.outside)
                .expect("outside")
                .next()
                .is_none()
        }

        /// Replaces `etc/conf` with a link to the outside directory, the
        /// real one moved to `etc/conf-old`.
        fn swap_conf_for_a_link(&self) {
            let conf = self.root.join("etc/conf");
            std::fs::rename(&conf, self.root.join("etc/conf-old")).expect("move");
            symlink(&self.outside, &conf).expect("link");
        }
    }

    #[allow(unsafe_code)]
    fn mkfifo(path: &Path) {
        let c = CString::new(path.as_os_str().as_bytes()).expect("no NUL");
        // SAFETY: a valid NUL-terminated path, read only.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
    }

    fn mode_of(path: &Path) -> u32 {
        std::fs::symlink_metadata(path)
            .expect("meta")
            .permissions()
            .mode()
            & 0o7777
    }

    #[test]
    fn files_are_written_with_the_callers_mode_and_read_back() {
        let t = tree();
        write(&t.root, Path::new("etc/conf/key"), b"secret", 0o600).expect("key");
        write(&t.root, Path::new("new/dirs/nginx.conf"), b"conf", 0o644).expect("conf");
        assert_eq!(mode_of(&t.root.join("etc/conf/key")), 0o600);
        assert_eq!(mode_of(&t.root.join("new/dirs/nginx.conf")), 0o644);
        assert_eq!(mode_of(&t.root.join("new/dirs")), 0o755);
        assert_eq!(
            read(&t.root, Path::new("etc/conf/key"), 64).expect("read"),
            b"secret"
        );
        write(&t.root, Path::new("etc/conf/key"), b"rotated", 0o600).expect("again");
        assert_eq!(
            read(&t.root, Path::new("etc/conf/key"), 64).expect("read"),
            b"rotated"
        );
        assert!(
            !t.root.join(format!("etc/conf/key{TEMP_SUFFIX}")).exists(),
            "no temporary left"
        );
        let err = read(&t.root, Path::new("etc/conf/key"), 3).expect_err("over the limit");
        assert!(matches!(err, BeneathError::TooLarge { .. }), "{err}");
    }

    #[test]
    fn a_link_to_outside_on_the_way_is_refused_naming_it() {
        let t = tree();
        symlink(&t.outside, t.root.join("etc/linked")).expect("link");
        std::fs::write(t.outside.join("host-secret"), b"host only").expect("secret");
        let linked = t.root.join("etc/linked");
        for err in [
            read(&t.root, Path::new("etc/linked/host-secret"), 64).expect_err("read"),
            read_tail(&t.root, Path::new("etc/linked/host-secret"), 64).expect_err("tail"),
            write(&t.root, Path::new("etc/linked/file"), b"x", 0o644).expect_err("write"),
            make_dirs(&t.root, Path::new("etc/linked/sub")).expect_err("mkdir"),
        ] {
            assert!(
                matches!(&err, BeneathError::SymbolicLink { path } if *path == linked),
                "{err:?}"
            );
            assert!(err.to_string().contains("is a symbolic link"), "{err}");
        }
        assert_eq!(
            std::fs::read_dir(&t.outside).expect("outside").count(),
            1,
            "nothing written outside"
        );
    }

    #[test]
    fn a_link_as_the_final_file_is_never_followed() {
        let t = tree();
        let secret = t.outside.join("host-secret");
        std::fs::write(&secret, b"host only").expect("secret");
        symlink(&secret, t.root.join("etc/conf/key")).expect("link");
        let err = read(&t.root, Path::new("etc/conf/key"), 64).expect_err("read");
        assert!(matches!(err, BeneathError::SymbolicLink { .. }), "{err:?}");
        // A write replaces the link itself; the host file is untouched.
        write(&t.root, Path::new("etc/conf/key"), b"mine", 0o600).expect("write");
        assert_eq!(std::fs::read(&secret).expect("secret"), b"host only");
        assert!(
            !std::fs::symlink_metadata(t.root.join("etc/conf/key"))
                .expect("meta")
                .file_type()
                .is_symlink()
        );
        // A dangling link at the name: "only if absent" leaves it, and does
        // not create its target outside.
        symlink(t.outside.join("made"), t.root.join("etc/conf/seed")).expect("link");
        let wrote =
            write_if_absent(&t.root, Path::new("etc/conf/seed"), b"x", 0o644).expect("seed");
        assert!(!wrote);
        assert!(!t.outside.join("made").exists());
        // A stale temporary planted as a link is removed, not written through.
        symlink(
            t.outside.join("via-temp"),
            t.root.join(format!("etc/conf/next{TEMP_SUFFIX}")),
        )
        .expect("link");
        write(&t.root, Path::new("etc/conf/next"), b"conf", 0o644).expect("write");
        assert!(!t.outside.join("via-temp").exists());
    }

    #[test]
    fn a_file_or_fifo_where_a_directory_belongs_is_refused() {
        let t = tree();
        std::fs::write(t.root.join("etc/plain"), b"").expect("file");
        mkfifo(&t.root.join("etc/pipe"));
        for name in ["plain", "pipe"] {
            let err = write(&t.root, &Path::new("etc").join(name).join("f"), b"x", 0o644)
                .expect_err("not a directory");
            assert!(
                matches!(&err, BeneathError::NotADirectory { path } if path.ends_with(name)),
                "{err:?}"
            );
        }
    }

    #[test]
    fn a_fifo_or_directory_as_the_final_file_is_refused_without_blocking() {
        let t = tree();
        mkfifo(&t.root.join("etc/conf/key"));
        // Opening a FIFO for reading would wait for a writer forever; the
        // test finishing at all shows it did not.
        for err in [
            read(&t.root, Path::new("etc/conf/key"), 64).expect_err("read"),
            read_tail(&t.root, Path::new("etc/conf/key"), 64).expect_err("tail"),
            read(&t.root, Path::new("etc/conf"), 64).expect_err("a directory"),
        ] {
            assert!(
                matches!(err, BeneathError::NotARegularFile { .. }),
                "{err:?}"
            );
        }
    }

    /// The ingress jail's nginx check: a regular file is there, a missing
    /// file or directory on the way is "not there", and a link (to a host
    /// file that does exist), a FIFO or a directory is an error naming it.
    #[test]
    fn is_regular_file_tells_missing_from_refused() {
        let t = tree();
        std::fs::write(t.root.join("etc/conf/nginx"), b"\x7fELF").expect("file");
        assert!(matches!(
            is_regular_file(&t.root, Path::new("etc/conf/nginx")),
            Ok(true)
        ));
        assert!(matches!(
            is_regular_file(&t.root, Path::new("etc/conf/absent")),
            Ok(false)
        ));
        assert!(matches!(
            is_regular_file(&t.root, Path::new("usr/local/sbin/nginx")),
            Ok(false)
        ));

        std::fs::write(t.outside.join("nginx"), b"host").expect("host file");
        symlink(t.outside.join("nginx"), t.root.join("etc/conf/linked")).expect("link");
        assert!(matches!(
            is_regular_file(&t.root, Path::new("etc/conf/linked")),
            Err(BeneathError::SymbolicLink { .. })
        ));
        mkfifo(&t.root.join("etc/conf/fifo"));
        assert!(matches!(
            is_regular_file(&t.root, Path::new("etc/conf/fifo")),
            Err(BeneathError::NotARegularFile { .. })
        ));
        assert!(matches!(
            is_regular_file(&t.root, Path::new("etc/conf")),
            Err(BeneathError::NotARegularFile { .. })
        ));
    }

    #[test]
    fn only_plain_names_are_resolved() {
        let t = tree();
        for bad in [
            "../outside/x",
            "/etc/passwd",
            "etc/./conf/x",
            "etc//conf/x",
            "etc/conf/",
        ] {
            let err = write(&t.root, Path::new(bad), b"x", 0o644).expect_err(bad);
            assert!(
                matches!(err, BeneathError::NotPlain { .. }),
                "{bad}: {err:?}"
            );
        }
        let dir = Dir::root(&t.root).expect("root");
        for bad in ["..", ".", "a/b", ""] {
            let err = dir.write(bad, b"x", 0o644).expect_err(bad);
            assert!(
                matches!(err, BeneathError::NotPlain { .. }),
                "{bad:?}: {err:?}"
            );
        }
        assert!(t.outside_is_empty());
    }

    #[test]
    fn a_missing_log_reads_empty_and_a_present_one_by_its_tail() {
        let t = tree();
        let log = Path::new("var/log/keel-start.log");
        assert_eq!(read_tail(&t.root, log, 64).expect("no dir yet"), b"");
        std::fs::create_dir_all(t.root.join("var/log")).expect("dirs");
        assert_eq!(read_tail(&t.root, log, 64).expect("no file yet"), b"");
        std::fs::write(t.root.join(log), b"one\ntwo\nthree\n").expect("log");
        assert_eq!(read_tail(&t.root, log, 6).expect("tail"), b"three\n");
        let err = read(&t.root, Path::new("var/log/other"), 64).expect_err("missing");
        assert!(err.is_missing(), "{err:?}");
    }

    /// The window a by-path check leaves: the directory is swapped for a
    /// link after its parent was opened. The walk opens it relative to the
    /// parent's descriptor with O_NOFOLLOW, so it meets the link and refuses.
    #[test]
    fn a_directory_swapped_for_a_link_after_its_parent_was_opened_is_refused() {
        let t = tree();
        let etc = Dir::root(&t.root)
            .and_then(|r| r.open(Path::new("etc"), Create::Never))
            .expect("etc");
        t.swap_conf_for_a_link();
        let err = etc
            .open(Path::new("conf"), Create::Missing)
            .and_then(|conf| conf.write("nginx.conf", b"x", 0o644))
            .expect_err("went through the link");
        assert!(
            matches!(&err, BeneathError::SymbolicLink { path } if *path == t.root.join("etc/conf")),
            "{err:?}"
        );
        assert!(t.outside_is_empty());
    }

    /// The same swap once the directory itself is open: every later write,
    /// rename and read goes to the directory that was opened (now
    /// `etc/conf-old`, still inside the root), never through the link.
    #[test]
    fn a_directory_swapped_for_a_link_after_it_was_opened_keeps_writes_inside() {
        let t = tree();
        let conf = Dir::root(&t.root)
            .and_then(|r| r.open(Path::new("etc/conf"), Create::Never))
            .expect("conf");
        t.swap_conf_for_a_link();
        conf.write("nginx.conf.next", b"conf", 0o644)
            .expect("write");
        conf.rename("nginx.conf.next", "nginx.conf")
            .expect("rename");
        assert!(conf.write_if_absent("seed", b"s", 0o644).expect("seed"));
        conf.write("key", b"k", 0o600).expect("key");
        assert_eq!(conf.read("nginx.conf", 64).expect("read"), b"conf");
        assert!(t.outside_is_empty(), "nothing went through the link");
        let old = t.root.join("etc/conf-old");
        assert_eq!(
            std::fs::read(old.join("nginx.conf")).expect("inside"),
            b"conf"
        );
        assert_eq!(mode_of(&old.join("key")), 0o600);
    }

    #[test]
    fn the_mount_point_check_refuses_links_and_files_by_path() {
        let t = tree();
        symlink(&t.outside, t.root.join("etc/linked")).expect("link");
        let (component, what) =
            directories_below(&t.root, &t.root.join("etc/linked/db")).expect_err("link");
        assert_eq!(component, t.root.join("etc/linked"));
        assert_eq!(what, "a symbolic link");
        assert!(directories_below(&t.root, &t.root.join("etc/conf/not/yet")).is_ok());
        assert!(directories_below(&t.root, &t.outside).is_err());
    }
}
