//! nullfs mounts of volume datasets into jail root filesystems.
//!
//! This module mounts and unmounts; it never removes files or directories.
//! Nothing in Keel deletes recursively under a jail root: a destroy that
//! followed a still-mounted nullfs volume is how other jail managers lost data.
//! (`mkdir -p` of a mount point is the one thing it creates.)
//!
//! A mount point lies in a jail's root, which the jail's root user controls:
//! [`check_mount_point`] refuses one that a symbolic link could redirect out
//! of the jail, before anything follows the path. This is a check by path,
//! then mkdir(1) and mount(8) act by path (they take no descriptor, so the
//! openat walk of [`crate::host::beneath`] cannot serve them): it runs before
//! each of the two, and volumes are mounted before the jail starts, so no
//! process of the jail can race it.
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
    /// A component of the mount point inside the jail's root is a symbolic
    /// link or not a directory, so mkdir(1) and mount(8) would follow it,
    /// possibly out of the jail's root and onto the host's tree.
    Redirected {
        /// The mount point asked for.
        target: PathBuf,
        /// The offending component.
        component: PathBuf,
        /// What it is: `a symbolic link`, `not a directory`, or the error
        /// reading it.
        what: String,
    },
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
            MountError::Redirected {
                target,
                component,
                what,
            } => write!(
                f,
                "refusing to mount a volume at {}: {} is {what}, which the jail's own root \
                 user may have placed there to redirect the mount outside the jail; inspect \
                 it, remove it, and the next pass mounts the volume",
                target.display(),
                component.display()
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
    /// The nullfs mounts at or below `root` (one jail's root filesystem),
    /// in mount order. What an apply and a delete observe: mount(8) cannot
    /// be asked for one path, so FreeBSD still lists every nullfs mount and
    /// only the lines naming `root` are parsed ([`parse_mount_p_under`]).
    fn list_under(&self, root: &Path) -> Result<Vec<MountEntry>, MountError>;
    /// Creates `target` if needed (mkdir -p) and nullfs-mounts `source` there.
    /// `target` lies below `root`, the jail's root filesystem, which the
    /// jail's root user controls: a component of `target` below `root` that
    /// is a symbolic link or not a directory is refused
    /// ([`MountError::Redirected`], see [`check_mount_point`]).
    fn mount_nullfs(&self, source: &Path, root: &Path, target: &Path) -> Result<(), MountError>;
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

    fn list_under(&self, root: &Path) -> Result<Vec<MountEntry>, MountError> {
        let argv = argv(&[&*self.paths.mount.to_string_lossy(), "-p", "-t", "nullfs"]);
        let out = self.runner.run(&argv, None, MOUNT_TIMEOUT)?.check(&argv)?;
        parse_mount_p_under(&out.stdout, root)
    }

    fn mount_nullfs(&self, source: &Path, root: &Path, target: &Path) -> Result<(), MountError> {
        // Checked before mkdir(1) follows the path, and again before mount(8)
        // does. Volumes are mounted before the jail is created, so no process
        // of the jail runs between the checks and the mount.
        check_mount_point(root, target)?;
        let (source, target_str) = (utf8(source)?, utf8(target)?);
        let mkdir = argv(&[&*self.paths.mkdir.to_string_lossy(), "-p", target_str]);
        self.runner
            .run(&mkdir, None, MKDIR_TIMEOUT)?
            .check(&mkdir)?;
        check_mount_point(root, target)?;
        let target = target_str;
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

/// Refuses a mount point that something inside the jail could redirect:
/// every component of `target` below `root` that exists must be a directory
/// and not a symbolic link (checked with `lstat`, never followed).
/// Components that do not exist yet are fine: `mkdir -p` creates them as
/// directories. A `target` outside `root` is refused as well.
pub fn check_mount_point(root: &Path, target: &Path) -> Result<(), MountError> {
    crate::host::beneath::directories_below(root, target).map_err(|(component, what)| {
        MountError::Redirected {
            target: target.to_path_buf(),
            component,
            what,
        }
    })
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
    parse_mount_p_where(text, |_| true)
}

/// [`parse_mount_p`] keeping only the mounts at or below `root`. The text is
/// searched for `root` (a substring search, not a split of every line), and
/// only the lines it occurs in are parsed and checked: another jail's lines
/// cost a scan of their bytes, nothing else, and a malformed one is left to
/// the pass's [`parse_mount_p`] to report.
pub fn parse_mount_p_under(text: &str, root: &Path) -> Result<Vec<MountEntry>, MountError> {
    let prefix = root.to_string_lossy();
    let mut entries = Vec::new();
    if prefix.is_empty() {
        return Ok(entries);
    }
    let mut next_line = 0;
    for (at, _) in text.match_indices(&*prefix) {
        if at < next_line {
            // The root again on a line already parsed (as source and target).
            continue;
        }
        let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
        let end = text[at..].find('\n').map_or(text.len(), |i| at + i);
        next_line = end;
        entries.extend(parse_mount_p_where(&text[start..end], |mountpoint| {
            Path::new(mountpoint).starts_with(root)
        })?);
    }
    Ok(entries)
}

fn parse_mount_p_where(
    text: &str,
    keep: impl Fn(&str) -> bool,
) -> Result<Vec<MountEntry>, MountError> {
    let mut entries = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut fields = [""; 6];
        let mut count = 0;
        for field in line.split_whitespace() {
            if let Some(slot) = fields.get_mut(count) {
                *slot = field;
            }
            count += 1;
        }
        if count > 6 {
            continue;
        }
        let [device, mountpoint, fstype, options, dump, pass] = fields;
        if count < 6 {
            return Err(MountError::Parse(format!(
                "expected `device mountpoint fstype options dump pass`, got `{}`",
                line.trim()
            )));
        }
        if !dump.bytes().all(|b| b.is_ascii_digit()) || !pass.bytes().all(|b| b.is_ascii_digit()) {
            return Err(MountError::Parse(format!(
                "dump and pass must be numbers in `{}`",
                line.trim()
            )));
        }
        if !keep(mountpoint) {
            continue;
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

    fn list_under(&self, root: &Path) -> Result<Vec<MountEntry>, MountError> {
        self.injected("list", "")?;
        Ok(lock(&self.mounts)
            .iter()
            .filter(|m| m.target.starts_with(root))
            .cloned()
            .collect())
    }

    fn mount_nullfs(&self, source: &Path, _root: &Path, target: &Path) -> Result<(), MountError> {
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

    #[test]
    fn a_mount_point_redirected_by_a_link_or_a_file_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("jail");
        let outside = dir.path().join("host");
        std::fs::create_dir_all(root.join("var/db")).expect("dirs");
        std::fs::create_dir_all(&outside).expect("dirs");

        // Existing directories, then components still to be created: fine.
        check_mount_point(&root, &root.join("var/db/pg/data")).expect("plain path");

        // A link anywhere below the root, the last component included.
        std::os::unix::fs::symlink(&outside, root.join("srv")).expect("link");
        for target in [root.join("srv"), root.join("srv/data")] {
            match check_mount_point(&root, &target) {
                Err(MountError::Redirected {
                    component, what, ..
                }) => {
                    assert_eq!(
                        (component, what.as_str()),
                        (root.join("srv"), "a symbolic link")
                    );
                }
                other => panic!("{}: {other:?}", target.display()),
            }
        }
        // A file where a directory must be.
        std::fs::write(root.join("var/db/file"), b"").expect("file");
        let err = check_mount_point(&root, &root.join("var/db/file/data")).expect_err("file");
        assert!(err.to_string().contains("not a directory"), "{err}");
        assert!(
            err.to_string()
                .contains("redirect the mount outside the jail"),
            "{err}"
        );
        // Outside the root, or with `..`.
        assert!(check_mount_point(&root, &outside).is_err());
        assert!(check_mount_point(&root, &root.join("var/../srv")).is_err());
    }

    /// The FreeBSD implementation refuses before running anything.
    #[test]
    fn freebsd_mounts_run_nothing_through_a_link() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("jail");
        std::fs::create_dir_all(&root).expect("root");
        std::os::unix::fs::symlink("/", root.join("data")).expect("link");
        let runner = std::sync::Arc::new(crate::common::cmd::RecordingRunner::permissive());
        let mounts = FreeBsdMounts::new(std::sync::Arc::clone(&runner), CommandPaths::default());
        let err = mounts
            .mount_nullfs(
                Path::new("/zroot/keel/volumes/pg"),
                &root,
                &root.join("data"),
            )
            .expect_err("refused");
        assert!(matches!(err, MountError::Redirected { .. }), "{err:?}");
        assert!(runner.ran().is_empty(), "{:?}", runner.ran());
    }
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

    #[test]
    fn mount_p_under_keeps_one_root_and_still_checks_every_line() {
        let text = "/v/a /jails/web/data nullfs rw 0 0\n\
                    /v/b /jails/web-10/data nullfs rw 0 0\n\
                    /v/c /jails/web nullfs rw 0 0\n";
        let root = Path::new("/jails/web");
        let kept: Vec<PathBuf> = parse_mount_p_under(text, root)
            .expect("parses")
            .into_iter()
            .map(|m| m.target)
            .collect();
        assert_eq!(
            kept,
            [
                PathBuf::from("/jails/web/data"),
                PathBuf::from("/jails/web")
            ]
        );
        let broken = "/v/b /jails/web/x nullfs rw 0\n";
        assert!(
            parse_mount_p_under(broken, root).is_err(),
            "a line of the root is checked"
        );
        let elsewhere = "/v/b /jails/other nullfs rw 0\n";
        assert_eq!(parse_mount_p_under(elsewhere, root), Ok(vec![]));
    }

    #[test]
    fn fake_list_under_keeps_only_one_root() {
        let mounts = FakeMounts::new(CallLog::new(), Faults::default());
        for target in ["/jails/web/data", "/jails/web-10/data"] {
            mounts
                .mount_nullfs(Path::new("/v"), Path::new("/jails"), Path::new(target))
                .expect("mounts");
        }
        let under = mounts.list_under(Path::new("/jails/web")).expect("lists");
        assert_eq!(under.len(), 1);
        assert_eq!(under[0].target, PathBuf::from("/jails/web/data"));
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
        fake.mount_nullfs(Path::new("/v/a"), Path::new("/j"), Path::new("/j/data"))
            .expect("mount");
        fake.mount_nullfs(Path::new("/v/b"), Path::new("/j"), Path::new("/j/data"))
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
        fake.mount_nullfs(Path::new("/v/a"), Path::new("/"), Path::new("/dst"))
            .expect("mount");
        faults.fail("unmount", Some("/dst"));
        let err = fake.unmount(Path::new("/dst")).expect_err("busy");
        assert!(matches!(err, MountError::Busy { .. }), "{err}");
        assert_eq!(fake.mounts().len(), 1);
    }
}
