//! What each jail uses now (CPU time and resident memory), read from the
//! kernel's resource accounting, for the agent's metrics.
//!
//! [`UsageProbe`] is its own seam, apart from [`super::JailRuntime`], because
//! it is driven from its own thread on a slow timer (`agentd::usage`), never
//! from the reconciler's worker: a scrape or a pass must not wait behind
//! thousands of usage reads, nor they behind a stuck `jail -r`.
//!
//! On FreeBSD ([`RctlUsage`]) one `rctl -u jail:A jail:B ...` reads up to
//! [`NAMES_PER_COMMAND`] jails. rctl(8) prints, for each filter in argv order,
//! one `resource=amount` line per resource the kernel accounts
//! (`show_usage` in usr.bin/rctl/rctl.c splits the kernel's comma-separated
//! answer; `rctl_racct_to_sbuf` in sys/kern/kern_rctl.c prints every resource
//! of a jail, `cputime` first), so the lines split into one block per filter
//! where a resource name repeats. `cputime` is whole seconds and `memoryuse`
//! bytes (the kernel divides the microsecond counters by a million). A name
//! with no running jail is not an error: the kernel's `prison_racct_find`
//! creates an empty accounting record for it, so it reads as zeroes. A
//! kernel without RACCT (or with `kern.racct.enable=0`, a boot tunable) makes
//! rctl exit 1 with its fixed message, and an agent inside a jail is refused
//! with EPERM: both are [`UsageError::Unavailable`], which the sampler takes
//! as "no usage on this host while this agent runs".
//!
//! This module never changes anything on the host: it only reads.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::cmd::{CmdError, CommandRunner, render_argv};
use crate::common::config::CommandPaths;
use crate::common::sync::lock;

/// Jails read by one rctl(8) process: few enough that argv stays far below
/// ARG_MAX (a jail name is at most 63 bytes), many enough that a node with
/// thousands of jails needs tens of processes per sample, not thousands.
pub const NAMES_PER_COMMAND: usize = 64;

/// Deadline of one rctl(8) read.
const RCTL_TIMEOUT: Duration = Duration::from_secs(10);

/// One jail's usage at the moment it was read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JailUsage {
    /// CPU time its processes used, user and system, since the jail started.
    pub cpu_seconds: f64,
    /// Resident memory of its processes now.
    pub memory_bytes: u64,
}

/// Why usage could not be read.
#[derive(Debug)]
pub enum UsageError {
    /// The host keeps no per-jail accounting (RACCT absent or disabled), or
    /// the agent may not read it (it runs inside a jail, or not as root);
    /// neither changes while the agent runs. Carries what rctl said.
    Unavailable(String),
    /// The command could not run, timed out or failed.
    Command(CmdError),
    /// rctl(8) exited non-zero for another reason.
    Failed {
        /// The command line.
        command: String,
        /// What it printed on stderr.
        stderr: String,
    },
    /// Its output does not match the documented format.
    Parse {
        /// The command line.
        command: String,
        /// What was wrong.
        reason: String,
    },
}

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UsageError::Unavailable(msg) => write!(
                f,
                "per-jail CPU and memory usage is not available ({msg}); it needs \
                 kern.racct.enable=1 in /boot/loader.conf and a reboot, and keel-agentd \
                 running as root outside any jail"
            ),
            UsageError::Command(e) => write!(f, "{e}"),
            UsageError::Failed { command, stderr } => {
                write!(f, "`{command}` failed: {stderr}")
            }
            UsageError::Parse { command, reason } => {
                write!(f, "could not read the output of `{command}`: {reason}")
            }
        }
    }
}

impl std::error::Error for UsageError {}

impl From<CmdError> for UsageError {
    fn from(e: CmdError) -> Self {
        UsageError::Command(e)
    }
}

/// Reads what jails use. `Sync` so a probe can be shared with the thread
/// that samples.
pub trait UsageProbe: Send + Sync {
    /// The usage of each of `names` that the host can report. A name
    /// missing from the answer has no usage to report (its jail is not
    /// running, or the probe cannot see it).
    fn sample(&self, names: &[String]) -> Result<BTreeMap<String, JailUsage>, UsageError>;
}

/// FreeBSD: rctl(8) `-u`; see the module docs.
pub struct RctlUsage<R> {
    runner: R,
    paths: CommandPaths,
}

impl<R: CommandRunner> RctlUsage<R> {
    /// Runs rctl through `runner` by its absolute path in `paths`.
    pub fn new(runner: R, paths: CommandPaths) -> Self {
        RctlUsage { runner, paths }
    }

    fn read(&self, names: &[String]) -> Result<Vec<(String, JailUsage)>, UsageError> {
        let mut argv = vec![self.paths.rctl.to_string_lossy().into_owned(), "-u".into()];
        argv.extend(names.iter().map(|n| format!("jail:{n}")));
        let out = self.runner.run(&argv, None, RCTL_TIMEOUT)?;
        let command = render_argv(&argv);
        if !out.success() {
            let stderr = out.stderr.trim().to_string();
            // Neither a boot tunable nor a jail's privileges change while
            // the agent runs: asking again would fail the same way.
            if stderr.contains("RACCT/RCTL present, but disabled")
                || stderr.contains("RACCT/RCTL support not present in kernel")
                || stderr.contains("Operation not permitted")
            {
                return Err(UsageError::Unavailable(stderr));
            }
            return Err(UsageError::Failed { command, stderr });
        }
        let blocks = parse_usage(&out.stdout).map_err(|reason| UsageError::Parse {
            command: command.clone(),
            reason,
        })?;
        if blocks.len() != names.len() {
            return Err(UsageError::Parse {
                command,
                reason: format!(
                    "{} jails asked, usage printed for {}",
                    names.len(),
                    blocks.len()
                ),
            });
        }
        blocks
            .into_iter()
            .zip(names)
            .map(|(block, name)| {
                usage_of(&block)
                    .map(|u| (name.clone(), u))
                    .map_err(|reason| UsageError::Parse {
                        command: command.clone(),
                        reason: format!("jail {name}: {reason}"),
                    })
            })
            .collect()
    }
}

impl<R: CommandRunner> UsageProbe for RctlUsage<R> {
    fn sample(&self, names: &[String]) -> Result<BTreeMap<String, JailUsage>, UsageError> {
        let mut usage = BTreeMap::new();
        for chunk in names.chunks(NAMES_PER_COMMAND) {
            usage.extend(self.read(chunk)?);
        }
        Ok(usage)
    }
}

/// Splits rctl's `resource=amount` lines into one block per filter: a block
/// ends where a resource name it already holds appears again.
fn parse_usage(stdout: &str) -> Result<Vec<BTreeMap<String, i64>>, String> {
    let mut blocks: Vec<BTreeMap<String, i64>> = Vec::new();
    let mut current = BTreeMap::new();
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let (resource, amount) = line
            .split_once('=')
            .ok_or_else(|| format!("line {line:?} is not resource=amount"))?;
        let amount: i64 = amount
            .trim()
            .parse()
            .map_err(|_| format!("amount of {resource} is not a number: {line:?}"))?;
        if current.contains_key(resource) {
            blocks.push(std::mem::take(&mut current));
        }
        current.insert(resource.to_string(), amount);
    }
    if !current.is_empty() {
        blocks.push(current);
    }
    Ok(blocks)
}

fn usage_of(block: &BTreeMap<String, i64>) -> Result<JailUsage, String> {
    let get = |resource: &str| {
        block
            .get(resource)
            .copied()
            .ok_or_else(|| format!("no {resource} line"))
            .and_then(|n| u64::try_from(n).map_err(|_| format!("{resource} is negative: {n}")))
    };
    Ok(JailUsage {
        cpu_seconds: get("cputime")? as f64,
        memory_bytes: get("memoryuse")?,
    })
}

/// In-memory usage for tests: what [`FakeUsage::set`] said, for the names
/// asked; can be told to fail.
#[derive(Clone, Default)]
pub struct FakeUsage {
    inner: Arc<Mutex<FakeState>>,
}

#[derive(Default)]
struct FakeState {
    usage: BTreeMap<String, JailUsage>,
    unavailable: bool,
    samples: usize,
}

impl FakeUsage {
    /// A probe that reports nothing until told.
    pub fn new() -> FakeUsage {
        FakeUsage::default()
    }

    /// `name` uses `usage` from now on.
    pub fn set(&self, name: &str, usage: JailUsage) {
        lock(&self.inner).usage.insert(name.to_string(), usage);
    }

    /// Answers like a host without RACCT from now on.
    pub fn set_unavailable(&self) {
        lock(&self.inner).unavailable = true;
    }

    /// How many times [`UsageProbe::sample`] was called.
    pub fn samples(&self) -> usize {
        lock(&self.inner).samples
    }
}

impl UsageProbe for FakeUsage {
    fn sample(&self, names: &[String]) -> Result<BTreeMap<String, JailUsage>, UsageError> {
        let mut s = lock(&self.inner);
        s.samples += 1;
        if s.unavailable {
            return Err(UsageError::Unavailable(
                "rctl: RACCT/RCTL present, but disabled; enable using kern.racct.enable=1 tunable"
                    .into(),
            ));
        }
        Ok(names
            .iter()
            .filter_map(|n| s.usage.get(n).map(|u| (n.clone(), *u)))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_split_where_a_resource_repeats() {
        let out = "cputime=3\nmemoryuse=4096\npcpu=0\ncputime=0\nmemoryuse=0\npcpu=0\n";
        let blocks = parse_usage(out).expect("parses");
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[0]["cputime"], 3);
        assert_eq!(blocks[1]["memoryuse"], 0);
    }

    #[test]
    fn a_line_that_is_not_resource_equals_amount_is_an_error_naming_it() {
        let err = parse_usage("cputime=3\nbogus\n").expect_err("refused");
        assert!(err.contains("\"bogus\""), "{err}");
        let err = parse_usage("cputime=lots\n").expect_err("refused");
        assert!(err.contains("cputime"), "{err}");
    }

    #[test]
    fn a_block_without_memoryuse_is_an_error() {
        let blocks = parse_usage("cputime=1\n").expect("parses");
        assert!(
            usage_of(&blocks[0])
                .expect_err("no memory")
                .contains("memoryuse")
        );
    }

    #[test]
    fn the_fake_reports_only_what_it_was_told_and_can_be_unavailable() {
        let fake = FakeUsage::new();
        let used = JailUsage {
            cpu_seconds: 1.5,
            memory_bytes: 10,
        };
        fake.set("web", used);
        let got = fake
            .sample(&["web".to_string(), "db".to_string()])
            .expect("sample");
        assert_eq!(got.len(), 1);
        assert_eq!(got["web"], used);
        fake.set_unavailable();
        assert!(matches!(
            fake.sample(&["web".to_string()]),
            Err(UsageError::Unavailable(_))
        ));
        assert_eq!(fake.samples(), 2);
    }
}
