//! pf anchors under `keel/`: Keel loads and flushes its own anchors and never
//! touches the admin's main ruleset.
//!
//! Every call names an anchor below `keel/` (checked before anything runs:
//! `pfctl -a '' -F all` would flush the main ruleset). The admin's pf.conf
//! must reference them (`rdr-anchor "keel/*"` and `anchor "keel/*"`), which
//! [`Firewall::check_anchors`] verifies at startup.
//!
//! [`FreeBsdPf`] runs pfctl(8) (formats in `reference/freebsd.md` section 10);
//! [`FakeFirewall`] keeps the anchors' rule text in memory.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::cmd::{CmdError, CommandRunner, argv};
use crate::common::config::CommandPaths;
use crate::host::fake::{CallLog, Faults, lock};

/// Whether pf.conf references Keel's anchors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnchorCheck {
    /// `rdr-anchor "keel/*"` is in the translation rules.
    pub rdr: bool,
    /// `anchor "keel/*"` is in the filter rules.
    pub filter: bool,
}

/// A pf operation that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PfError {
    /// A command failed or could not run (a rules syntax error lands here
    /// with pfctl's message).
    Command(CmdError),
    /// The anchor is not below `keel/`; nothing was run.
    NotKeelAnchor(String),
}

impl fmt::Display for PfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PfError::Command(e) => write!(f, "{e}"),
            PfError::NotKeelAnchor(a) => write!(
                f,
                "refusing to change pf anchor `{a}`: Keel only manages anchors named keel/NAME"
            ),
        }
    }
}

impl std::error::Error for PfError {}

impl From<CmdError> for PfError {
    fn from(e: CmdError) -> Self {
        PfError::Command(e)
    }
}

/// Keel's pf anchors.
pub trait Firewall: Send {
    /// Replaces the rules of `anchor` (e.g. `keel/ingress`) with `rules`.
    fn load_anchor(&self, anchor: &str, rules: &str) -> Result<(), PfError>;
    /// Removes every rule of `anchor`.
    fn flush_anchor(&self, anchor: &str) -> Result<(), PfError>;
    /// Reports whether the main ruleset references `keel/*`.
    fn check_anchors(&self) -> Result<AnchorCheck, PfError>;
}

/// pfctl(8) parses and loads a ruleset; large tables can take a few seconds.
pub const PFCTL_TIMEOUT: Duration = Duration::from_secs(30);

/// `Ok` for `keel/NAME`, else the refusal. One level only: pf.conf's
/// `anchor "keel/*"` evaluates the anchors directly below `keel/`, so rules in
/// `keel/a/b` would load fine and never match anything.
fn keel_anchor(anchor: &str) -> Result<(), PfError> {
    match anchor.strip_prefix("keel/") {
        Some(rest) if !rest.is_empty() && !rest.contains(['/', '*']) => Ok(()),
        _ => Err(PfError::NotKeelAnchor(anchor.to_string())),
    }
}

/// True when `listing` (output of `pfctl -s nat` or `pfctl -s rules`) has a
/// `keyword "keel/*"` line. pfctl prints anchor calls double-quoted and
/// followed by their options (`rdr-anchor "keel/*" all`); single quotes or no
/// quotes are accepted too, so the check does not hinge on pfctl's quoting.
pub fn references_keel(listing: &str, keyword: &str) -> bool {
    listing.lines().any(|line| {
        let mut words = line.split_whitespace();
        words.next() == Some(keyword)
            && words
                .next()
                .map(|w| w.trim_matches(|c| c == '"' || c == '\''))
                == Some("keel/*")
    })
}

/// [`Firewall`] over pfctl(8).
#[derive(Debug)]
pub struct FreeBsdPf<R> {
    runner: R,
    paths: CommandPaths,
}

impl<R: CommandRunner> FreeBsdPf<R> {
    /// Runs commands through `runner`, by the absolute paths in `paths`.
    pub fn new(runner: R, paths: CommandPaths) -> FreeBsdPf<R> {
        FreeBsdPf { runner, paths }
    }

    fn pfctl(&self, args: &[&str], stdin: Option<&str>) -> Result<String, PfError> {
        let pfctl = self.paths.pfctl.to_string_lossy();
        let argv = argv(&[&[pfctl.as_ref()], args].concat());
        let out = self
            .runner
            .run(&argv, stdin.map(str::as_bytes), PFCTL_TIMEOUT)?
            .check(&argv)?;
        Ok(out.stdout)
    }
}

impl<R: CommandRunner> Firewall for FreeBsdPf<R> {
    fn load_anchor(&self, anchor: &str, rules: &str) -> Result<(), PfError> {
        keel_anchor(anchor)?;
        self.pfctl(&["-a", anchor, "-f", "-"], Some(rules))?;
        Ok(())
    }

    fn flush_anchor(&self, anchor: &str) -> Result<(), PfError> {
        keel_anchor(anchor)?;
        self.pfctl(&["-a", anchor, "-F", "all"], None)?;
        Ok(())
    }

    fn check_anchors(&self) -> Result<AnchorCheck, PfError> {
        let nat = self.pfctl(&["-s", "nat"], None)?;
        let rules = self.pfctl(&["-s", "rules"], None)?;
        Ok(AnchorCheck {
            rdr: references_keel(&nat, "rdr-anchor"),
            filter: references_keel(&rules, "anchor"),
        })
    }
}

/// In-memory [`Firewall`] for tests and `--simulate`.
///
/// Successful loads and flushes are logged (`pf.load keel/ingress`,
/// `pf.flush keel/ingress`). Faults are looked up by `load`, `flush` (target:
/// the anchor) and `check_anchors` (target `""`). pf.conf references the
/// anchors until [`FakeFirewall::set_referenced`] says otherwise. A flushed
/// anchor has no rules: [`FakeFirewall::anchor`] returns `None` for it.
#[derive(Debug, Clone)]
pub struct FakeFirewall {
    state: Arc<Mutex<FakePfState>>,
    log: CallLog,
    faults: Faults,
}

#[derive(Debug)]
struct FakePfState {
    anchors: BTreeMap<String, String>,
    referenced: bool,
}

impl Default for FakeFirewall {
    fn default() -> FakeFirewall {
        FakeFirewall::new(CallLog::default(), Faults::default())
    }
}

impl FakeFirewall {
    /// No anchors loaded, pf.conf referencing `keel/*`, logging to `log`.
    pub fn new(log: CallLog, faults: Faults) -> FakeFirewall {
        FakeFirewall {
            state: Arc::new(Mutex::new(FakePfState {
                anchors: BTreeMap::new(),
                referenced: true,
            })),
            log,
            faults,
        }
    }

    /// The rules last loaded into `anchor`, if any.
    pub fn anchor(&self, name: &str) -> Option<String> {
        lock(&self.state).anchors.get(name).cloned()
    }

    /// Whether pf.conf references `keel/*` (both anchors at once).
    pub fn set_referenced(&self, referenced: bool) {
        lock(&self.state).referenced = referenced;
    }

    fn fault(&self, op: &str, target: &str) -> Result<(), PfError> {
        if self.faults.should_fail(op, target) {
            return Err(PfError::Command(CmdError::Failed {
                command: format!("fake pf.{op} {target}"),
                status: 1,
                stderr: "injected failure".into(),
            }));
        }
        Ok(())
    }
}

impl Firewall for FakeFirewall {
    fn load_anchor(&self, anchor: &str, rules: &str) -> Result<(), PfError> {
        keel_anchor(anchor)?;
        self.fault("load", anchor)?;
        lock(&self.state)
            .anchors
            .insert(anchor.to_string(), rules.to_string());
        self.log.push(format!("pf.load {anchor}"));
        Ok(())
    }

    fn flush_anchor(&self, anchor: &str) -> Result<(), PfError> {
        keel_anchor(anchor)?;
        self.fault("flush", anchor)?;
        lock(&self.state).anchors.remove(anchor);
        self.log.push(format!("pf.flush {anchor}"));
        Ok(())
    }

    fn check_anchors(&self) -> Result<AnchorCheck, PfError> {
        self.fault("check_anchors", "")?;
        let referenced = lock(&self.state).referenced;
        Ok(AnchorCheck {
            rdr: referenced,
            filter: referenced,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchor_lines_are_recognised_in_every_quoting() {
        let nat = "nat on em0 inet from 10.20.0.0/16 to any -> (em0) round-robin\n\
                   rdr-anchor \"keel/*\" all\n";
        assert!(references_keel(nat, "rdr-anchor"));
        assert!(references_keel("rdr-anchor 'keel/*' all\n", "rdr-anchor"));
        assert!(references_keel("anchor keel/*\n", "anchor"));
        assert!(
            !references_keel(nat, "anchor"),
            "rdr-anchor is not a filter anchor"
        );
        assert!(!references_keel("anchor \"keel\" all\n", "anchor"));
        assert!(!references_keel("anchor \"bastille/*\" all\n", "anchor"));
        assert!(!references_keel("", "anchor"));
    }

    #[test]
    fn only_keel_anchors_are_accepted() {
        assert!(keel_anchor("keel/ingress").is_ok());
        for bad in [
            "",
            "keel",
            "keel/",
            "keel/*",
            "keel/a/b",
            "bastille/x",
            "/keel/x",
        ] {
            assert!(
                matches!(keel_anchor(bad), Err(PfError::NotKeelAnchor(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn fake_loads_flushes_and_reports_references() {
        let log = CallLog::new();
        let faults = Faults::default();
        let fake = FakeFirewall::new(log.clone(), faults.clone());
        fake.load_anchor(
            "keel/ingress",
            "rdr pass on em0 inet proto tcp to 203.0.113.10 port 80 -> 10.20.3.5 port 80\n",
        )
        .expect("load");
        assert!(
            fake.anchor("keel/ingress")
                .is_some_and(|r| r.contains("rdr pass"))
        );
        fake.flush_anchor("keel/ingress").expect("flush");
        assert_eq!(fake.anchor("keel/ingress"), None);
        assert!(fake.load_anchor("main", "pass all\n").is_err());
        assert_eq!(
            log.entries(),
            ["pf.load keel/ingress", "pf.flush keel/ingress"]
        );

        assert_eq!(
            fake.check_anchors().expect("check"),
            AnchorCheck {
                rdr: true,
                filter: true
            }
        );
        fake.set_referenced(false);
        assert_eq!(
            fake.check_anchors().expect("check"),
            AnchorCheck {
                rdr: false,
                filter: false
            }
        );
        faults.fail("load", Some("keel/ingress"));
        assert!(fake.load_anchor("keel/ingress", "").is_err());
        assert_eq!(fake.anchor("keel/ingress"), None);
    }
}
