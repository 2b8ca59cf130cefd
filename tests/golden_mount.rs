//! Golden transcripts of [`FreeBsdMounts`]: the exact mount(8), umount(8) and
//! mkdir(1) argv of every operation and failure path, answered with canned
//! output in the formats of `reference/freebsd.md` section 6.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel::common::cmd::{CmdError, RecordingRunner};
use keel::common::config::CommandPaths;
use keel::host::mount::{FreeBsdMounts, MountEntry, MountError, MountManager};

use crate::util::golden;

fn mounts(runner: Arc<RecordingRunner>) -> FreeBsdMounts<Arc<RecordingRunner>> {
    FreeBsdMounts::new(runner, CommandPaths::default())
}

const VOLUME: &str = "/usr/local/keel/volumes/pg-data";
/// The jail root `TARGET` lies in.
const ROOT: &str = "/usr/local/jails/pg-0";
const TARGET: &str = "/usr/local/jails/pg-0/var/db/postgres";

#[test]
fn list_reads_every_nullfs_mount_once() {
    golden::check("mount_list", |r| {
        let entries = mounts(r).list().expect("listed");
        assert_eq!(
            entries,
            [
                MountEntry {
                    source: PathBuf::from("/jails/base"),
                    target: PathBuf::from("/jails/web1/base"),
                    fstype: "nullfs".into(),
                    options: "ro".into(),
                },
                MountEntry {
                    source: PathBuf::from(VOLUME),
                    target: PathBuf::from(TARGET),
                    fstype: "nullfs".into(),
                    options: "rw".into(),
                },
            ]
        );
    });
}

#[test]
fn list_under_keeps_only_the_mounts_below_one_root() {
    golden::check("mount_list_under", |r| {
        let entries = mounts(r)
            .list_under(Path::new("/usr/local/keel/jails/web-1"))
            .expect("listed");
        let targets: Vec<PathBuf> = entries.into_iter().map(|m| m.target).collect();
        assert_eq!(
            targets,
            [
                PathBuf::from("/usr/local/keel/jails/web-1/usr/local/www"),
                PathBuf::from("/usr/local/keel/jails/web-1/var/log/nginx"),
            ]
        );
    });
}

#[test]
fn list_rejects_malformed_lines() {
    golden::check("mount_list_malformed", |r| {
        let err = mounts(r).list().expect_err("short line");
        assert!(matches!(err, MountError::Parse(_)), "{err}");
        assert!(err.to_string().contains("/jails/web1/base"), "{err}");
    });
}

#[test]
fn mount_nullfs_creates_the_mount_point_first() {
    golden::check("mount_nullfs", |r| {
        mounts(r)
            .mount_nullfs(Path::new(VOLUME), Path::new(ROOT), Path::new(TARGET))
            .expect("mounted");
    });
}

#[test]
fn mount_nullfs_reports_mount_failures() {
    golden::check("mount_nullfs_fails", |r| {
        let err = mounts(r)
            .mount_nullfs(Path::new(VOLUME), Path::new(ROOT), Path::new(TARGET))
            .expect_err("no source");
        assert!(
            matches!(&err, MountError::Command(CmdError::Failed { stderr, .. }) if stderr.contains("No such file")),
            "{err}"
        );
    });
}

#[test]
fn unmount() {
    golden::check("mount_unmount", |r| {
        mounts(r).unmount(Path::new(TARGET)).expect("unmounted");
    });
}

#[test]
fn unmount_busy_is_a_distinct_error() {
    golden::check("mount_unmount_busy", |r| {
        let err = mounts(r).unmount(Path::new(TARGET)).expect_err("busy");
        match err {
            MountError::Busy { target, stderr } => {
                assert_eq!(target, PathBuf::from(TARGET));
                assert!(stderr.contains("Device busy"));
            }
            other => panic!("expected Busy, got {other:?}"),
        }
    });
}

#[test]
fn unmount_of_a_plain_directory_succeeds() {
    golden::check("mount_unmount_not_mounted", |r| {
        mounts(r)
            .unmount(Path::new(TARGET))
            .expect("not mounted is success");
    });
}

#[test]
fn unmount_of_an_unlisted_path_succeeds() {
    golden::check("mount_unmount_not_currently_mounted", |r| {
        mounts(r)
            .unmount(Path::new(TARGET))
            .expect("not mounted is success");
    });
}

#[test]
fn unmount_reports_other_failures() {
    golden::check("mount_unmount_fails", |r| {
        let err = mounts(r).unmount(Path::new(TARGET)).expect_err("refused");
        assert!(
            matches!(&err, MountError::Command(CmdError::Failed { stderr, .. }) if stderr.contains("not permitted")),
            "{err}"
        );
    });
}
