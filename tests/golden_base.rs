//! Golden transcripts of `FreeBsdBases` (tests/golden/base_*.txt): every
//! step of a base fetch (list, create, extract, snapshot, destroy a partial
//! dataset) and their failure paths against canned zfs(8) and tar(1) output.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel::common::cmd::{CmdError, RecordingRunner};
use keel::common::config::CommandPaths;
use keel::host::base::{BaseDataset, BaseError, BaseLayout, BaseStore, FreeBsdBases};

use crate::util::golden;

const RELEASE: &str = "14.3-RELEASE";
const TARBALL: &str = "/var/db/keel/agentd/base-downloads/14.3-RELEASE/base.txz";

fn bases(runner: Arc<RecordingRunner>) -> FreeBsdBases<Arc<RecordingRunner>> {
    FreeBsdBases::new(
        runner,
        CommandPaths::default(),
        BaseLayout {
            pool: "zroot".into(),
            bases_dir: "/usr/local/jails/keel-bases".into(),
        },
    )
}

#[test]
fn list_reads_every_base_and_its_snapshot_in_one_call() {
    golden::check("base_list", |runner| {
        let mounted = |r: &str| Some(PathBuf::from(format!("/usr/local/jails/keel-bases/{r}")));
        assert_eq!(
            bases(runner).list(),
            Ok(vec![
                BaseDataset {
                    release: RELEASE.into(),
                    used: 1_245_184,
                    snapshot: true,
                    mountpoint: mounted(RELEASE),
                },
                BaseDataset {
                    release: "15.0-RELEASE".into(),
                    used: 4096,
                    snapshot: false,
                    mountpoint: mounted("15.0-RELEASE"),
                },
            ])
        );
    });
}

#[test]
fn list_without_the_bases_dataset_is_no_bases() {
    golden::check("base_list_missing_root", |runner| {
        assert_eq!(bases(runner).list(), Ok(vec![]));
    });
}

#[test]
fn create_mounts_the_release_under_the_bases_dir() {
    golden::check("base_create", |runner| {
        assert_eq!(
            bases(runner).create(RELEASE),
            Ok(PathBuf::from("/usr/local/jails/keel-bases/14.3-RELEASE"))
        );
    });
}

#[test]
fn extract_unpacks_into_the_mountpoint_keeping_permissions_and_flags() {
    golden::check("base_extract", |runner| {
        assert_eq!(bases(runner).extract(RELEASE, Path::new(TARBALL)), Ok(()));
    });
}

#[test]
fn a_failed_extraction_carries_tar_s_complaint() {
    golden::check("base_extract_fails", |runner| {
        let err = bases(runner)
            .extract(RELEASE, Path::new(TARBALL))
            .expect_err("truncated");
        assert!(
            matches!(&err, BaseError::Command(CmdError::Failed { stderr, .. }) if stderr.contains("Truncated input file")),
            "{err}"
        );
    });
}

#[test]
fn snapshot_takes_keel() {
    golden::check("base_snapshot", |runner| {
        assert_eq!(bases(runner).snapshot(RELEASE), Ok(()));
    });
}

#[test]
fn destroy_partial_destroys_without_recursion() {
    golden::check("base_destroy_partial", |runner| {
        assert_eq!(bases(runner).destroy_partial(RELEASE), Ok(()));
    });
}

#[test]
fn destroy_partial_of_nothing_is_success() {
    golden::check("base_destroy_partial_missing", |runner| {
        assert_eq!(bases(runner).destroy_partial(RELEASE), Ok(()));
    });
}

#[test]
fn destroy_partial_of_a_snapshotted_base_is_refused_by_zfs() {
    golden::check("base_destroy_partial_snapshotted", |runner| {
        let err = bases(runner)
            .destroy_partial(RELEASE)
            .expect_err("has @keel");
        assert!(err.to_string().contains("filesystem has children"), "{err}");
    });
}
