//! What the host offers: CPU count and physical memory for the scheduler, the
//! kernel features Keel needs (VIMAGE for VNET jails, RACCT for limits), and
//! whether the agent itself runs inside a jail (nested mode).
//!
//! Read-only: this module never sets a sysctl (`kern.racct.enable` is a boot
//! tunable anyway; the fix is loader.conf and a reboot, which the caller
//! reports). [`FreeBsdCapacity`] runs sysctl(8) (`reference/freebsd.md`
//! section 9); [`FakeCapacity`] returns fixed numbers.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::cmd::{CmdError, CommandRunner, argv, render_argv};
use crate::common::config::CommandPaths;
use crate::host::fake::{Faults, lock};

/// The host's size, detected once at startup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HostCapacity {
    /// `hw.ncpu`
    pub cpus: u32,
    /// `hw.physmem`, bytes.
    pub memory_bytes: u64,
}

/// Kernel features Keel depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preflight {
    /// `kern.features.vimage` is 1: VNET jails work.
    pub vimage: bool,
    /// `kern.racct.enable` is 1: rctl limits work.
    pub racct: bool,
    /// `security.jail.jailed` is 1: this process runs inside a jail, so the
    /// jails it creates are nested (parent's devfs ruleset, no rctl).
    pub jailed: bool,
}

/// A capacity probe that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CapacityError {
    /// A command failed or could not run.
    Command(CmdError),
    /// sysctl output that is not what sysctl(8) documents.
    Parse(String),
}

impl fmt::Display for CapacityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CapacityError::Command(e) => write!(f, "{e}"),
            CapacityError::Parse(why) => write!(f, "could not read sysctl output: {why}"),
        }
    }
}

impl std::error::Error for CapacityError {}

impl From<CmdError> for CapacityError {
    fn from(e: CmdError) -> Self {
        CapacityError::Command(e)
    }
}

/// Host size and kernel features.
pub trait Capacity: Send {
    /// CPU count and physical memory, in one sysctl call.
    fn detect(&self) -> Result<HostCapacity, CapacityError>;
    /// VIMAGE, RACCT and whether we are jailed, in one sysctl call.
    fn preflight(&self) -> Result<Preflight, CapacityError>;
}

/// sysctl(8) reads kernel variables and returns at once.
pub const SYSCTL_TIMEOUT: Duration = Duration::from_secs(5);

/// The OIDs `preflight` reads, in argument order.
const PREFLIGHT_OIDS: [&str; 3] = [
    "kern.features.vimage",
    "kern.racct.enable",
    "security.jail.jailed",
];

/// [`Capacity`] over sysctl(8).
#[derive(Debug)]
pub struct FreeBsdCapacity<R> {
    runner: R,
    paths: CommandPaths,
}

impl<R: CommandRunner> FreeBsdCapacity<R> {
    /// Runs sysctl through `runner`, by the absolute path in `paths`.
    pub fn new(runner: R, paths: CommandPaths) -> FreeBsdCapacity<R> {
        FreeBsdCapacity { runner, paths }
    }

    fn sysctl_argv(&self, oids: &[&str]) -> Vec<String> {
        let sysctl = self.paths.sysctl.to_string_lossy();
        argv(&[&[sysctl.as_ref(), "-n"], oids].concat())
    }
}

impl<R: CommandRunner> Capacity for FreeBsdCapacity<R> {
    fn detect(&self) -> Result<HostCapacity, CapacityError> {
        let argv = self.sysctl_argv(&["hw.ncpu", "hw.physmem"]);
        let out = self.runner.run(&argv, None, SYSCTL_TIMEOUT)?.check(&argv)?;
        parse_capacity(&out.stdout)
            .map_err(|why| CapacityError::Parse(format!("`{}`: {why}", render_argv(&argv))))
    }

    fn preflight(&self) -> Result<Preflight, CapacityError> {
        // Without `-i`: an unknown OID is then named on stderr, which tells
        // which value is missing. With `-i` it would print nothing for it, and
        // a single line of output could belong to either OID.
        let argv = self.sysctl_argv(&PREFLIGHT_OIDS);
        let out = self.runner.run(&argv, None, SYSCTL_TIMEOUT)?;
        let unknown = unknown_oids(&out.stderr).unwrap_or_default();
        // sysctl exits non-zero for missing OIDs and still prints the others:
        // a feature the kernel lacks, not a failure. Anything else on stderr
        // with a failing status is.
        let stdout = if unknown.is_empty() {
            out.check(&argv)?.stdout
        } else {
            out.stdout
        };
        parse_preflight(&stdout, &unknown)
            .map_err(|why| CapacityError::Parse(format!("`{}`: {why}", render_argv(&argv))))
    }
}

/// `hw.ncpu` and `hw.physmem` from `sysctl -n hw.ncpu hw.physmem`: one
/// decimal value per line, in argument order.
pub fn parse_capacity(stdout: &str) -> Result<HostCapacity, String> {
    let lines: Vec<&str> = stdout
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let [cpus, memory] = lines[..] else {
        return Err(format!(
            "expected two lines (hw.ncpu, hw.physmem), got {}",
            lines.len()
        ));
    };
    let cpus: u32 = cpus
        .parse()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("hw.ncpu `{cpus}` is not a positive integer"))?;
    let memory_bytes: u64 = memory
        .parse()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("hw.physmem `{memory}` is not a positive integer"))?;
    Ok(HostCapacity { cpus, memory_bytes })
}

/// The OIDs sysctl reported unknown (`sysctl: unknown oid 'NAME'`), or `None`
/// when stderr says anything else (empty stderr is `Some` of nothing).
fn unknown_oids(stderr: &str) -> Option<Vec<String>> {
    stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let name = l.trim().strip_prefix("sysctl: unknown oid '")?;
            // Newer sysctl may append context after the closing quote.
            name.split_once('\'').map(|(n, _)| n.to_string())
        })
        .collect()
}

/// [`Preflight`] from the stdout of `sysctl -n kern.features.vimage
/// kern.racct.enable security.jail.jailed`, given the OIDs sysctl reported
/// unknown: the known ones
/// print one line each, in order; an unknown one means the feature is absent.
/// (An old sysctl that stops at the first unknown OID prints fewer lines than
/// that, which is reported as a parse error rather than guessed at.)
pub fn parse_preflight(stdout: &str, unknown: &[String]) -> Result<Preflight, String> {
    let known: Vec<&str> = PREFLIGHT_OIDS
        .into_iter()
        .filter(|oid| !unknown.iter().any(|u| u == oid))
        .collect();
    let lines: Vec<&str> = stdout
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    if lines.len() != known.len() {
        return Err(format!(
            "expected one line for each of {}, got {}",
            known.join(", "),
            lines.len()
        ));
    }
    let mut enabled = [false; PREFLIGHT_OIDS.len()];
    for (oid, value) in known.iter().zip(&lines) {
        let on = value
            .parse::<i64>()
            .map_err(|_| format!("{oid} `{value}` is not an integer"))?
            != 0;
        if let Some(i) = PREFLIGHT_OIDS.iter().position(|o| o == oid) {
            enabled[i] = on;
        }
    }
    let [vimage, racct, jailed] = enabled;
    Ok(Preflight {
        vimage,
        racct,
        jailed,
    })
}

/// In-memory [`Capacity`] for tests and `--simulate`: fixed numbers, both
/// kernel features present unless [`FakeCapacity::set_preflight`] says
/// otherwise. Faults are looked up by `detect` and `preflight` (target `""`).
#[derive(Debug, Clone)]
pub struct FakeCapacity {
    state: Arc<Mutex<(HostCapacity, Preflight)>>,
    faults: Faults,
}

impl Default for FakeCapacity {
    /// 4 CPUs and 8 GiB.
    fn default() -> FakeCapacity {
        FakeCapacity::new(4, 8 << 30)
    }
}

impl FakeCapacity {
    /// A host with `cpus` CPUs and `memory_bytes` of memory.
    pub fn new(cpus: u32, memory_bytes: u64) -> FakeCapacity {
        let preflight = Preflight {
            vimage: true,
            racct: true,
            jailed: false,
        };
        FakeCapacity {
            state: Arc::new(Mutex::new((HostCapacity { cpus, memory_bytes }, preflight))),
            faults: Faults::default(),
        }
    }

    /// The same host, failing as `faults` says.
    pub fn with_faults(mut self, faults: Faults) -> FakeCapacity {
        self.faults = faults;
        self
    }

    /// What `preflight` reports from now on.
    pub fn set_preflight(&self, preflight: Preflight) {
        lock(&self.state).1 = preflight;
    }

    fn fault(&self, op: &str) -> Result<(), CapacityError> {
        if self.faults.should_fail(op, "") {
            return Err(CapacityError::Command(CmdError::Failed {
                command: format!("fake capacity.{op}"),
                status: 1,
                stderr: "injected failure".into(),
            }));
        }
        Ok(())
    }
}

impl Capacity for FakeCapacity {
    fn detect(&self) -> Result<HostCapacity, CapacityError> {
        self.fault("detect")?;
        Ok(lock(&self.state).0)
    }

    fn preflight(&self) -> Result<Preflight, CapacityError> {
        self.fault("preflight")?;
        Ok(lock(&self.state).1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn capacity_needs_two_positive_numbers() {
        assert_eq!(
            parse_capacity("8\n17083187200\n"),
            Ok(HostCapacity {
                cpus: 8,
                memory_bytes: 17_083_187_200
            })
        );
        assert!(parse_capacity("8\n").is_err());
        assert!(parse_capacity("0\n17083187200\n").is_err());
        assert!(parse_capacity("8\n16G\n").is_err());
        assert!(parse_capacity("8\n1\n2\n").is_err());
    }

    #[test]
    fn unknown_oids_are_absent_features() {
        let stderr = "sysctl: unknown oid 'kern.features.vimage'\n";
        let unknown = unknown_oids(stderr).expect("only unknown-oid lines");
        assert_eq!(unknown, ["kern.features.vimage"]);
        assert_eq!(
            parse_preflight("1\n0\n", &unknown),
            Ok(Preflight {
                vimage: false,
                racct: true,
                jailed: false
            })
        );
        assert_eq!(unknown_oids(""), Some(vec![]));
        assert_eq!(
            unknown_oids("sysctl: sysctl fmt -1 1024 1: Operation not permitted\n"),
            None
        );
        assert_eq!(
            parse_preflight("1\n0\n1\n", &[]),
            Ok(Preflight {
                vimage: true,
                racct: false,
                jailed: true
            })
        );
        assert!(parse_preflight("1\n1\n", &[]).is_err(), "a line is missing");
        assert!(parse_preflight("yes\n1\n0\n", &[]).is_err());
    }

    proptest! {
        #[test]
        fn sysctl_parsers_never_panic(text in "[0-9a-z' \n:.-]{0,80}") {
            let _ = parse_capacity(&text);
            let unknown = unknown_oids(&text).unwrap_or_default();
            let _ = parse_preflight(&text, &unknown);
        }
    }

    #[test]
    fn fake_reports_its_numbers_and_faults() {
        let faults = Faults::default();
        let fake = FakeCapacity::new(2, 1 << 30).with_faults(faults.clone());
        assert_eq!(fake.detect().expect("detect").cpus, 2);
        assert!(fake.preflight().expect("preflight").racct);
        fake.set_preflight(Preflight {
            vimage: true,
            racct: false,
            jailed: false,
        });
        assert!(!fake.preflight().expect("preflight").racct);
        faults.fail_times("detect", None, 1);
        assert!(fake.detect().is_err());
        assert!(fake.detect().is_ok());
    }
}
