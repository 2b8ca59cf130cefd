//! Golden transcripts of [`FreeBsdCapacity`]: the exact sysctl(8) argv of
//! every operation and failure path, answered with canned output in the
//! formats of `reference/freebsd.md` section 9.

use std::sync::Arc;

use keel::common::cmd::RecordingRunner;
use keel::common::config::CommandPaths;
use keel::host::capacity::{Capacity, CapacityError, FreeBsdCapacity, HostCapacity, Preflight};

use crate::util::golden;

fn capacity(runner: Arc<RecordingRunner>) -> FreeBsdCapacity<Arc<RecordingRunner>> {
    FreeBsdCapacity::new(runner, CommandPaths::default())
}

#[test]
fn detect_reads_cpus_and_memory_in_one_call() {
    golden::check("capacity_detect", |r| {
        assert_eq!(
            capacity(r).detect().expect("detected"),
            HostCapacity {
                cpus: 8,
                memory_bytes: 17_083_187_200
            }
        );
    });
}

#[test]
fn detect_rejects_unparseable_output() {
    golden::check("capacity_detect_unparseable", |r| {
        let err = capacity(r).detect().expect_err("16G is not bytes");
        assert!(matches!(err, CapacityError::Parse(_)), "{err}");
        assert!(err.to_string().contains("hw.physmem `16G`"), "{err}");
    });
}

#[test]
fn preflight_with_both_features() {
    golden::check("capacity_preflight_ok", |r| {
        assert_eq!(
            capacity(r).preflight().expect("read"),
            Preflight {
                vimage: true,
                racct: true,
                jailed: false
            }
        );
    });
}

#[test]
fn preflight_treats_an_unknown_vimage_oid_as_absent() {
    golden::check("capacity_preflight_no_vimage", |r| {
        assert_eq!(
            capacity(r)
                .preflight()
                .expect("unknown oid is not an error"),
            Preflight {
                vimage: false,
                racct: true,
                jailed: false
            }
        );
    });
}

#[test]
fn preflight_reports_racct_disabled() {
    golden::check("capacity_preflight_racct_disabled", |r| {
        assert_eq!(
            capacity(r).preflight().expect("read"),
            Preflight {
                vimage: true,
                racct: false,
                jailed: false
            }
        );
    });
}

#[test]
fn preflight_sees_an_agent_running_inside_a_jail() {
    golden::check("capacity_preflight_jailed", |r| {
        assert_eq!(
            capacity(r).preflight().expect("read"),
            Preflight {
                vimage: true,
                racct: true,
                jailed: true
            }
        );
    });
}
