//! nullfs mounts of volume datasets into jail root filesystems.
//!
//! This module mounts and unmounts; it never removes files or directories.
//! Nothing in Keel deletes recursively under a jail root: a destroy that
//! followed a still-mounted nullfs volume is how other jail managers lost data.
//! (`mkdir -p` of a mount point is the one thing it creates.)
//!
//! [`FreeBsdMounts`] runs mount(8), umount(8) and mkdir(1) (formats in
//! `reference/freebsd.md` section 6); [`FakeMounts`] keeps a mount table in
//! memory.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::cmd::{CmdError, CommandRunner, argv};
use crate::common::config::CommandPaths;
use crate::host::fake::{CallLog, Faults, lock};

/// One mounted filesystem as `mount -p` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// What is mounted (for nullfs, the source directory).
    pub source: PathBuf,
    /// Where it is mounted.
    pub target: PathBuf,
    /// Filesystem type (`nullfs`, `zfs`, ...).
    pub fstype: String,
    /// Mount options.
    pub options: String,
}

/// A mount operation that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountError {
    /// A command failed or could not run.
    Command(CmdError),
    /// umount refused because the filesystem is in use.
    Busy {
        /// The mount point.
        target: PathBuf,
        /// umount's message.
        stderr: String,
    },
    /// `mount -p` output that does not match the documented format.
    Parse(String),
    /// A path that is not UTF-8 cannot be passed to a command unchanged.
    NotUtf8(PathBuf),
}

impl fmt::Display for MountError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MountError::Command(e) => write!(f, "{e}"),
            MountError::Busy { target, stderr } => write!(
                f,
                "{} is busy and was not unmounted ({stderr}); stop what uses it and retry",
                target.display()
            ),
            MountError::Parse(why) => write!(f, "could not read `mount -p` output: {why}"),
            MountError::NotUtf8(path) => write!(
                f,
                "{} is not valid UTF-8 and cannot be mounted by Keel; use a UTF-8 path",
                path.display()
            ),
        }
    }
}

impl std::error::Error for MountError {}

impl From<CmdError> for MountError {
    fn from(e: CmdError) -> Self {
        MountError::Command(e)
    }
}

/// Mounting volumes.
pub trait MountManager: Send {
    /// Every nullfs mount on the host, in one `mount -p -t nullfs`.
    fn list(&self) -> Result<Vec<MountEntry>, MountError>;
    /// Creates `target` if needed (mkdir -p) and nullfs-mounts `source` there.
    fn mount_nullfs(&self, source: &Path, target: &Path) -> Result<(), MountError>;
    /// Unmounts `target`; not mounted is success, in use is [`MountError::Busy`].
    fn unmount(&self, target: &Path) -> Result<(), MountError>;
}

/// mount(8) of a nullfs is a kernel call; longer than this means a wedged VFS.
pub const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);
/// umount(8) flushes the filesystem first, which can take a while on a busy disk.
pub const UMOUNT_TIMEOUT: Duration = Duration::from_secs(60);
/// mkdir(1) of a mount point.
pub const MKDIR_TIMEOUT: Duration = Duration::from_secs(10);

/// [`MountManager`] over mount(8), umount(8) and mkdir(1).
#[derive(Debug)]
pub struct FreeBsdMounts<R> {
    runner: R,
    paths: CommandPaths,
}

impl<R: CommandRunner> FreeBsdMounts<R> {
    /// Runs commands through `runner`, by the absolute paths in `paths`.
    pub fn new(runner: R, paths: CommandPaths) -> FreeBsdMounts<R> {
        FreeBsdMounts { runner, paths }
    }
}

impl<R: CommandRunner> MountManager for FreeBsdMounts<R> {
    fn list(&self) -> Result<Vec<MountEntry>, MountError> {
        let argv = argv(&[&*self.paths.mount.to_string_lossy(), "-p", "-t", "nullfs"]);
        let out = self.runner.run(&argv, None, MOUNT_TIMEOUT)?.check(&argv)?;
        parse_mount_p(&out.stdout)
    }

    fn mount_nullfs(&self, source: &Path, target: &Path) -> Result<(), MountError> {
        let (source, target) = (utf8(source)?, utf8(target)?);
        let mkdir = argv(&[&*self.paths.mkdir.to_string_lossy(), "-p", target]);
        self.runner
            .run(&mkdir, None, MKDIR_TIMEOUT)?
            .check(&mkdir)?;
        let mount = argv(&[
            &*self.paths.mount.to_string_lossy(),
            "-t",
            "nullfs",
            source,
            target,
        ]);
        self.runner
            .run(&mount, None, MOUNT_TIMEOUT)?
            .check(&mount)?;
        Ok(())
    }

    fn unmount(&self, target: &Path) -> Result<(), MountError> {
        let argv = argv(&[&*self.paths.umount.to_string_lossy(), utf8(target)?]);
        let out = self.runner.run(&argv, None, UMOUNT_TIMEOUT)?;
        if out.success() {
            return Ok(());
        }
        if out.stderr.contains("Device busy") {
            return Err(MountError::Busy {
                target: target.to_path_buf(),
                stderr: out.stderr.trim().to_string(),
            });
        }
        // Nothing is mounted there: umount(8) says so in one of these ways
        // depending on whether the path exists and is a mount point.
        let not_mounted = [
            "not a file system root directory",
            "not currently mounted",
            "No such file or directory",
        ];
        if not_mounted.iter().any(|m| out.stderr.contains(m)) {
            return Ok(());
        }
        out.check(&argv)?;
        Ok(())
    }
}

fn utf8(path: &Path) -> Result<&str, MountError> {
    path.to_str()
        .ok_or_else(|| MountError::NotUtf8(path.to_path_buf()))
}

/// Entries from `mount -p`: fstab(5)-style lines `device mountpoint fstype
/// options dump pass`, separated by runs of tabs and spaces.
///
/// mount(8) does not escape spaces in paths, so a line with more than six
/// fields cannot be split reliably; it is skipped, which is safe because
/// Keel's own sources and mount points are validated paths without spaces.
/// A line with fewer fields, or a non-numeric dump/pass, is a format error.
pub fn parse_mount_p(text: &str) -> Result<Vec<MountEntry>, MountError> {
    let mut entries = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() > 6 {
            continue;
        }
        let [device, mountpoint, fstype, options, dump, pass] = fields[..] else {
            return Err(MountError::Parse(format!(
                "expected `device mountpoint fstype options dump pass`, got `{}`",
                line.trim()
            )));
        };
        if !dump.bytes().all(|b| b.is_ascii_digit()) || !pass.bytes().all(|b| b.is_ascii_digit()) {
            return Err(MountError::Parse(format!(
                "dump and pass must be numbers in `{}`",
                line.trim()
            )));
        }
        entries.push(MountEntry {
            source: PathBuf::from(device),
            target: PathBuf::from(mountpoint),
            fstype: fstype.to_string(),
            options: options.to_string(),
        });
    }
    Ok(entries)
}

/// In-memory [`MountManager`] for tests and `--simulate`.
///
/// Successful `mount_nullfs` and `unmount` calls are logged
/// (`mount.mount /src -> /dst`, `mount.unmount /dst`). Faults are looked up by
/// method name (`list`, `mount`, `unmount`) and the target path (`""` for
/// `list`); an injected `unmount` fault is [`MountError::Busy`], the failure
/// the reconciler must handle. Like the kernel, mounting twice on one target
/// stacks, and unmounting removes the topmost.
#[derive(Debug, Clone, Default)]
pub struct FakeMounts {
    mounts: Arc<Mutex<Vec<MountEntry>>>,
    log: CallLog,
    faults: Faults,
}

impl FakeMounts {
    /// An empty mount table logging to `log`.
    pub fn new(log: CallLog, faults: Faults) -> FakeMounts {
        FakeMounts {
            mounts: Arc::default(),
            log,
            faults,
        }
    }

    /// The mount table, oldest first.
    pub fn mounts(&self) -> Vec<MountEntry> {
        lock(&self.mounts).clone()
    }

    fn injected(&self, op: &str, target: &str) -> Result<(), MountError> {
        if !self.faults.should_fail(op, target) {
            return Ok(());
        }
        Err(match op {
            "unmount" => MountError::Busy {
                target: PathBuf::from(target),
                stderr: format!("umount: unmount of {target} failed: Device busy"),
            },
            _ => MountError::Command(CmdError::Failed {
                command: format!("fake mount.{op} {target}"),
                status: 1,
                stderr: "injected failure".into(),
            }),
        })
    }
}

impl MountManager for FakeMounts {
    fn list(&self) -> Result<Vec<MountEntry>, MountError> {
        self.injected("list", "")?;
        Ok(self.mounts())
    }

    fn mount_nullfs(&self, source: &Path, target: &Path) -> Result<(), MountError> {
        self.injected("mount", &target.display().to_string())?;
        lock(&self.mounts).push(MountEntry {
            source: source.to_path_buf(),
            target: target.to_path_buf(),
            fstype: "nullfs".into(),
            options: "rw".into(),
        });
        self.log.push(format!(
            "mount.mount {} -> {}",
            source.display(),
            target.display()
        ));
        Ok(())
    }

    fn unmount(&self, target: &Path) -> Result<(), MountError> {
        self.injected("unmount", &target.display().to_string())?;
        let mut mounts = lock(&self.mounts);
        if let Some(i) = mounts.iter().rposition(|m| m.target == target) {
            mounts.remove(i);
        }
        drop(mounts);
        self.log.push(format!("mount.unmount {}", target.display()));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn mount_p_lines_split_on_tabs_and_spaces() {
        let text = "/jails/base\t\t/jails/web1/base\tnullfs\tro\t\t0 0\n\
                    /usr/local/keel/volumes/pg-data /usr/local/jails/pg-0/var/db/postgres nullfs rw 0 0\n";
        let entries = parse_mount_p(text).expect("parses");
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].source, PathBuf::from("/jails/base"));
        assert_eq!(entries[0].target, PathBuf::from("/jails/web1/base"));
        assert_eq!(entries[0].options, "ro");
        assert_eq!(entries[1].fstype, "nullfs");
    }

    #[test]
    fn mount_p_skips_paths_with_spaces_and_rejects_short_lines() {
        let spaced = "/home/a b\t/jails/x\tnullfs\trw\t\t0 0\n";
        assert_eq!(parse_mount_p(spaced).expect("parses"), vec![]);
        assert!(parse_mount_p("/a /b nullfs\n").is_err());
        assert!(parse_mount_p("/a /b nullfs rw x y\n").is_err());
        assert_eq!(parse_mount_p("\n").expect("empty"), vec![]);
    }

    proptest! {
        #[test]
        fn mount_p_parser_never_panics(text in "[ \t\n/a-z0-9,]{0,200}") {
            let _ = parse_mount_p(&text);
        }
    }

    #[test]
    fn fake_stacks_mounts_and_unmounts_the_topmost() {
        let log = CallLog::new();
        let fake = FakeMounts::new(log.clone(), Faults::default());
        fake.mount_nullfs(Path::new("/v/a"), Path::new("/j/data"))
            .expect("mount");
        fake.mount_nullfs(Path::new("/v/b"), Path::new("/j/data"))
            .expect("mount");
        fake.unmount(Path::new("/j/data")).expect("unmount");
        assert_eq!(fake.mounts().len(), 1);
        assert_eq!(fake.list().expect("list")[0].source, PathBuf::from("/v/a"));
        fake.unmount(Path::new("/j/data")).expect("unmount");
        fake.unmount(Path::new("/j/data"))
            .expect("not mounted is success");
        assert!(fake.mounts().is_empty());
        assert_eq!(
            log.entries(),
            [
                "mount.mount /v/a -> /j/data",
                "mount.mount /v/b -> /j/data",
                "mount.unmount /j/data",
                "mount.unmount /j/data",
                "mount.unmount /j/data"
            ]
        );
    }

    #[test]
    fn fake_unmount_fault_is_busy_and_keeps_the_mount() {
        let faults = Faults::default();
        let fake = FakeMounts::new(CallLog::new(), faults.clone());
        fake.mount_nullfs(Path::new("/v/a"), Path::new("/dst"))
            .expect("mount");
        faults.fail("unmount", Some("/dst"));
        let err = fake.unmount(Path::new("/dst")).expect_err("busy");
        assert!(matches!(err, MountError::Busy { .. }), "{err}");
        assert_eq!(fake.mounts().len(), 1);
    }
}
