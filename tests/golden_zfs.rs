//! Golden transcripts of `FreeBsdZfs` (tests/golden/zfs_*.txt): every
//! `ZfsManager` method and its failure paths against canned zfs(8) output.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keel::common::cmd::RecordingRunner;
use keel::common::config::CommandPaths;
use keel::host::zfs::{Dataset, FakeZfs, FreeBsdZfs, ZfsError, ZfsManager};

use crate::util::golden;

/// Three attempts for busy datasets, no pause: transcripts hold no clock.
fn zfs(runner: Arc<RecordingRunner>) -> FreeBsdZfs<Arc<RecordingRunner>> {
    FreeBsdZfs::new(
        runner,
        CommandPaths::default(),
        FakeZfs::default_layout(),
        3,
        Duration::ZERO,
    )
}

#[test]
fn list_reads_every_dataset_under_the_root_in_one_call() {
    golden::check("zfs_list", |runner| {
        let listed = zfs(runner).list().expect("lists");
        let ds = |name: &str, used, quota, mountpoint: Option<&str>| Dataset {
            name: name.into(),
            used,
            quota,
            mountpoint: mountpoint.map(PathBuf::from),
        };
        assert_eq!(
            listed,
            [
                ds("zroot/keel", 1_589_248, None, None),
                ds("zroot/keel/bases", 1_249_280, None, None),
                ds(
                    "zroot/keel/bases/14.2-RELEASE",
                    1_245_184,
                    None,
                    Some("/usr/local/keel/bases/14.2-RELEASE")
                ),
                ds("zroot/keel/jails", 131_072, None, None),
                ds(
                    "zroot/keel/jails/web-1",
                    98_304,
                    None,
                    Some("/usr/local/keel/jails/web-1")
                ),
                ds("zroot/keel/volumes", 204_800, None, None),
                ds(
                    "zroot/keel/volumes/pgdata",
                    172_032,
                    Some(10_737_418_240),
                    Some("/usr/local/keel/volumes/pgdata")
                ),
            ]
        );
    });
}

#[test]
fn list_named_reads_the_named_datasets_and_leaves_out_the_absent() {
    golden::check("zfs_list_named", |runner| {
        let names = [
            "zroot/keel/jails/web-1",
            "zroot/keel/volumes/web-content",
            "zroot/keel/volumes/web-logs",
        ]
        .map(String::from);
        let listed = zfs(runner).list_named(&names).expect("lists");
        assert_eq!(
            listed,
            [
                Dataset {
                    name: "zroot/keel/jails/web-1".into(),
                    used: 98304,
                    quota: None,
                    mountpoint: Some("/usr/local/keel/jails/web-1".into()),
                },
                Dataset {
                    name: "zroot/keel/volumes/web-content".into(),
                    used: 172032,
                    quota: Some(1 << 30),
                    mountpoint: Some("/usr/local/keel/volumes/web-content".into()),
                },
            ]
        );
    });
}

#[test]
fn list_without_the_root_dataset_says_how_to_create_it() {
    golden::check("zfs_list_missing_root", |runner| {
        let err = zfs(runner).list().expect_err("no root");
        assert_eq!(err, ZfsError::NotFound("zroot/keel".into()));
        assert!(
            err.to_string()
                .contains("zfs create -o mountpoint=none zroot/keel"),
            "{err}"
        );
    });
}

#[test]
fn dataset_exists_yes() {
    golden::check("zfs_dataset_exists", |runner| {
        assert_eq!(
            zfs(runner).dataset_exists("zroot/keel/volumes/pgdata"),
            Ok(true)
        );
    });
}

#[test]
fn dataset_exists_no() {
    golden::check("zfs_dataset_missing", |runner| {
        assert_eq!(
            zfs(runner).dataset_exists("zroot/keel/volumes/pgdata"),
            Ok(false)
        );
    });
}

#[test]
fn clone_rootfs_mounts_under_the_jails_dir() {
    golden::check("zfs_clone", |runner| {
        assert_eq!(
            zfs(runner).clone_rootfs("14.2-RELEASE", "web-1"),
            Ok(PathBuf::from("/usr/local/keel/jails/web-1"))
        );
    });
}

#[test]
fn clone_of_a_missing_base_names_the_snapshot() {
    golden::check("zfs_clone_missing_base", |runner| {
        let err = zfs(runner)
            .clone_rootfs("14.2-RELEASE", "web-1")
            .expect_err("no base");
        assert_eq!(
            err,
            ZfsError::NotFound("zroot/keel/bases/14.2-RELEASE@keel".into())
        );
        assert!(
            err.to_string()
                .contains("fetch the base once with `keelctl base fetch 14.2-RELEASE`"),
            "{err}"
        );
    });
}

#[test]
fn destroy_rootfs_is_recursive() {
    golden::check("zfs_destroy_rootfs", |runner| {
        zfs(runner).destroy_rootfs("web-1").expect("destroyed");
    });
}

#[test]
fn destroy_rootfs_retries_while_busy() {
    golden::check("zfs_destroy_rootfs_busy_then_ok", |runner| {
        zfs(runner)
            .destroy_rootfs("web-1")
            .expect("third attempt works");
    });
}

#[test]
fn destroy_rootfs_busy_through_every_attempt_is_busy() {
    golden::check("zfs_destroy_rootfs_busy_exhausted", |runner| {
        let err = zfs(runner).destroy_rootfs("web-1").expect_err("busy");
        assert_eq!(
            err,
            ZfsError::Busy {
                dataset: "zroot/keel/jails/web-1".into(),
                attempts: 3,
                stderr: "cannot destroy 'zroot/keel/jails/web-1': dataset is busy".into(),
            }
        );
    });
}

#[test]
fn destroy_rootfs_of_a_missing_dataset_is_success() {
    golden::check("zfs_destroy_rootfs_missing", |runner| {
        zfs(runner).destroy_rootfs("web-1").expect("absent is fine");
    });
}

#[test]
fn create_volume_without_quota() {
    golden::check("zfs_create_volume", |runner| {
        assert_eq!(
            zfs(runner).create_volume("pgdata", None),
            Ok(PathBuf::from("/usr/local/keel/volumes/pgdata"))
        );
    });
}

#[test]
fn create_volume_with_quota() {
    golden::check("zfs_create_volume_quota", |runner| {
        assert_eq!(
            zfs(runner).create_volume("pgdata", Some(10 << 30)),
            Ok(PathBuf::from("/usr/local/keel/volumes/pgdata"))
        );
    });
}

#[test]
fn create_volume_that_exists_is_success() {
    golden::check("zfs_create_volume_existing", |runner| {
        assert_eq!(
            zfs(runner).create_volume("pgdata", Some(10 << 30)),
            Ok(PathBuf::from("/usr/local/keel/volumes/pgdata"))
        );
    });
}

#[test]
fn set_volume_quota_in_place() {
    golden::check("zfs_set_volume_quota", |runner| {
        zfs(runner)
            .set_volume_quota("pgdata", Some(20 << 30))
            .expect("set");
    });
}

#[test]
fn set_volume_quota_none_removes_it() {
    golden::check("zfs_set_volume_quota_none", |runner| {
        zfs(runner).set_volume_quota("pgdata", None).expect("set");
    });
}

#[test]
fn set_volume_quota_below_used_reports_both_numbers() {
    golden::check("zfs_set_volume_quota_below_used", |runner| {
        let err = zfs(runner)
            .set_volume_quota("pgdata", Some(1 << 30))
            .expect_err("too small");
        assert_eq!(
            err,
            ZfsError::QuotaBelowUsed {
                dataset: "zroot/keel/volumes/pgdata".into(),
                quota: 1 << 30,
                used: 2_147_614_720,
            }
        );
    });
}

#[test]
fn set_volume_quota_of_a_missing_volume_is_not_found() {
    golden::check("zfs_set_volume_quota_missing", |runner| {
        assert_eq!(
            zfs(runner).set_volume_quota("pgdata", Some(1 << 30)),
            Err(ZfsError::NotFound("zroot/keel/volumes/pgdata".into()))
        );
    });
}

#[test]
fn destroy_volume_is_not_recursive() {
    golden::check("zfs_destroy_volume", |runner| {
        zfs(runner).destroy_volume("pgdata").expect("destroyed");
    });
}

#[test]
fn destroy_volume_busy_through_every_attempt_is_busy() {
    golden::check("zfs_destroy_volume_busy", |runner| {
        let err = zfs(runner).destroy_volume("pgdata").expect_err("busy");
        assert!(matches!(err, ZfsError::Busy { attempts: 3, .. }), "{err}");
    });
}

#[test]
fn destroy_volume_of_a_missing_volume_is_not_found() {
    golden::check("zfs_destroy_volume_missing", |runner| {
        assert_eq!(
            zfs(runner).destroy_volume("pgdata"),
            Err(ZfsError::NotFound("zroot/keel/volumes/pgdata".into()))
        );
    });
}

#[test]
fn destroy_volume_with_snapshots_is_refused() {
    golden::check("zfs_destroy_volume_with_snapshots", |runner| {
        let err = zfs(runner)
            .destroy_volume("pgdata")
            .expect_err("has children");
        assert!(matches!(err, ZfsError::Command(_)), "{err}");
        assert!(err.to_string().contains("use '-r'"), "{err}");
    });
}
