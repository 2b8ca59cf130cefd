//! Golden transcripts of [`FreeBsdPf`]: the exact pfctl(8) argv and stdin of
//! every operation and failure path, answered with canned output in the
//! formats of `reference/freebsd.md` section 10.

use std::sync::Arc;

use keel::common::cmd::{CmdError, RecordingRunner};
use keel::common::config::CommandPaths;
use keel::host::pf::{AnchorCheck, Firewall, FreeBsdPf, PfError};

use crate::util::golden;

fn pf(runner: Arc<RecordingRunner>) -> FreeBsdPf<Arc<RecordingRunner>> {
    FreeBsdPf::new(runner, CommandPaths::default())
}

const RULES: &str = "rdr pass on em0 inet proto tcp from any to 203.0.113.10 port 80 -> 10.20.3.5 port 80\n\
                     rdr pass on em0 inet proto tcp from any to 203.0.113.10 port 443 -> 10.20.3.5 port 443\n";

/// The ingress anchor exactly as the agent renders it (public 203.0.113.10 on
/// em0, ingress jail 10.20.3.5).
fn ingress_rules() -> String {
    keel::agentd::ingress::pf::ingress_rules("em0", [203, 0, 113, 10].into(), [10, 20, 3, 5].into())
}

#[test]
fn load_anchor_feeds_the_rules_on_stdin() {
    golden::check("pf_load", |r| {
        pf(r)
            .load_anchor(keel::agentd::ingress::pf::INGRESS_ANCHOR, &ingress_rules())
            .expect("loaded");
    });
}

#[test]
fn load_anchor_syntax_error_carries_pfctls_message() {
    golden::check("pf_load_syntax_error", |r| {
        let rules = "rdr pass on em0 inet proto tcp from any to 203.0.113.10 port 80 -> 10.20.3.5 port 80\n\
                     rdr pass on em0 inet proto tcp to port eighty -> 10.20.3.5\n";
        let err = pf(r)
            .load_anchor("keel/ingress", rules)
            .expect_err("syntax");
        match err {
            PfError::Command(CmdError::Failed { stderr, .. }) => {
                assert!(stderr.contains("stdin:2: syntax error"), "{stderr}");
                assert!(stderr.contains("pf rules not loaded"), "{stderr}");
            }
            other => panic!("expected a failed pfctl, got {other:?}"),
        }
    });
}

#[test]
fn anchors_outside_keel_are_refused_before_anything_runs() {
    // An empty script: running any command would be a mismatch.
    golden::check("pf_refused", |r| {
        let fw = pf(r);
        for anchor in ["", "keel/*", "rdr/web"] {
            assert!(matches!(
                fw.load_anchor(anchor, RULES),
                Err(PfError::NotKeelAnchor(_))
            ));
            assert!(matches!(
                fw.flush_anchor(anchor),
                Err(PfError::NotKeelAnchor(_))
            ));
        }
    });
}

#[test]
fn flush_anchor() {
    golden::check("pf_flush", |r| {
        pf(r).flush_anchor("keel/ingress").expect("flushed");
    });
}

#[test]
fn check_anchors_finds_both_references() {
    golden::check("pf_check_anchors_present", |r| {
        let check = pf(r).check_anchors().expect("checked");
        assert_eq!(
            check,
            AnchorCheck {
                rdr: true,
                filter: true
            }
        );
    });
}

#[test]
fn check_anchors_reports_missing_references() {
    golden::check("pf_check_anchors_absent", |r| {
        let check = pf(r).check_anchors().expect("checked");
        assert_eq!(
            check,
            AnchorCheck {
                rdr: false,
                filter: false
            }
        );
    });
}

#[test]
fn check_anchors_without_pf_is_an_error() {
    golden::check("pf_check_anchors_no_pf", |r| {
        let err = pf(r).check_anchors().expect_err("no /dev/pf");
        assert!(err.to_string().contains("/dev/pf"), "{err}");
    });
}
