//! Jail lifecycle: create and remove jails from a per-jail jail.conf, observe
//! them all in one pass, apply rctl limits, run commands inside with jexec.
//!
//! Keel writes `{conf_dir}/{name}.conf` and uses `jail -f FILE -c NAME` /
//! `jail -f FILE -r NAME`, never bare `jail -r NAME`: on a jail created from the
//! command line `jail -r` runs no exec.stop and leaves devfs mounted, and
//! without `-f` jail(8) reads /etc/jail.conf, whose block of the same name (an
//! admin's, not Keel's) would then run. Jails are
//! created with `persist`, so a jail whose processes all exit stays a jail; a
//! jail with no processes left is a *crashed workload* ([`ObservedJail::running`]
//! is false) and the reconciler restarts it through its backoff.
//!
//! The workload (`exec.start` of the spec) runs under daemon(8) with its stdio
//! detached: jail(8) waits for every exec.start command to exit, so a
//! foreground server would otherwise hold `jail -c` (and the agent) until it
//! stopped, and a background one would keep our stdout pipe open. When the
//! workload exits, daemon(8) exits with it and the jail has no processes left,
//! which is exactly how a crash is detected.
//!
//! Removal that cannot get stuck ([`Removal`]): jail(8) keeps a jail when
//! any removal command fails, exec.stop included, so a jail whose exec.stop
//! always fails could never be removed through its conf. A jail whose
//! workload is gone, or whose exec.stop failed, or whose conf is lost, is
//! removed with `jail -R NAME`, which reads no configuration and runs no
//! command; the devfs that `mount.devfs` put on `{root}/dev` is then
//! unmounted here, as jail(8) would have, but only when the mount table lists
//! a devfs on exactly that path (the jail's root user controls `{root}/dev`
//! once nothing is mounted there, so the path alone proves nothing).
//!
//! This module never touches ZFS, nullfs mounts or host-side networking (the
//! one mount it handles is the jail's own devfs, above): the jail
//! side of the network (address and default route inside the jail) is part of
//! the jail.conf it writes, because jail(8) runs it at every start. It never
//! hands anything to a shell on the host; the only shell is the one jail(8)
//! runs *inside* the jail for exec.start/exec.stop, and every word reaching it
//! is quoted by [`render_jail_conf`].

use std::collections::BTreeMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::cmd::{CmdError, CmdOutput, CommandRunner, render_argv};
use crate::common::config::{CommandPaths, DevfsRuleset};
use crate::host::beneath;
use crate::host::fake::{CallLog, Faults, lock};
use crate::host::mount::parse_mount_p_under;

/// Everything jail(8) needs to create one jail.
#[derive(Debug, Clone, PartialEq)]
pub struct JailParams {
    /// Jail name (a validated DNS label).
    pub name: String,
    /// Root of the jail's filesystem (its rootfs dataset's mountpoint).
    pub path: PathBuf,
    /// host.hostname
    pub hostname: String,
    /// VNET attachment; `None` only in tests of non-network behaviour.
    pub network: Option<JailNetwork>,
    /// exec.start argv, run inside the jail after the network is up.
    pub exec_start: Vec<String>,
    /// exec.stop argv, run inside the jail on removal (may be empty).
    pub exec_stop: Vec<String>,
    /// Environment for exec.start and exec.stop.
    pub env: BTreeMap<String, String>,
}

/// The jail side of a VNET attachment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailNetwork {
    /// Interface moved into the jail (the `kj_` end of the epair).
    pub interface: String,
    /// The jail's address.
    pub address: Ipv4Addr,
    /// Prefix length of the node subnet (24).
    pub prefix_len: u8,
    /// Default route inside the jail (the bridge's address).
    pub gateway: Ipv4Addr,
}

/// rctl(8) limits for one jail.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    /// Cores (1.5 = 150 % of one core, rctl `pcpu`).
    pub cpu: Option<f64>,
    /// Bytes (rctl `memoryuse`).
    pub memory: Option<u64>,
}

/// One jail as the host reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedJail {
    /// Jail name.
    pub name: String,
    /// Kernel jail id (simulate mode: the workload's pid).
    pub jid: u32,
    /// Root path.
    pub path: PathBuf,
    /// True while at least one process runs inside the jail.
    pub running: bool,
    /// How exec.start exited, when the runtime knows (the simulated host
    /// reaps it); `None` while it runs, and always on FreeBSD, where a jail
    /// whose workload is gone only shows no process.
    pub exit_status: Option<i32>,
}

/// How [`JailRuntime::remove`] takes a jail down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// The workload may still run: exec.stop runs first, through the jail's
    /// conf (`jail -f CONF -r NAME`). When a removal command fails the jail
    /// is kept and [`JailError::StopFailed`] says why; the caller then
    /// decides whether to [`Removal::Force`] it.
    Stop,
    /// Nothing in the jail is worth stopping (its workload is gone, or
    /// exec.stop already failed): `jail -R NAME`, which runs no command and
    /// reads no conf, then the jail's devfs is unmounted.
    Force,
}

/// A jail operation that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JailError {
    /// A command failed or could not run (argv, status and stderr inside).
    Command(CmdError),
    /// `jail -f CONF -r NAME` failed (exec.stop, or another removal step of
    /// the conf) and jail(8) kept the jail; [`Removal::Force`] removes it
    /// without running anything.
    StopFailed {
        /// The jail.
        name: String,
        /// jail(8)'s failure, with exec.stop's own message in its stderr.
        error: CmdError,
    },
    /// `jail -c` refused because a jail with that name already exists.
    AlreadyExists(String),
    /// The per-jail jail.conf could not be written.
    WriteConf {
        /// The file.
        path: PathBuf,
        /// The OS error.
        reason: String,
    },
    /// Output of jls(8) or ps(1) that does not match the documented format.
    Parse {
        /// The command.
        command: String,
        /// What was wrong.
        reason: String,
    },
    /// rctl refused because RACCT is disabled or absent in the kernel.
    RacctDisabled(String),
    /// rctl(8) was refused the privilege to change rules (EPERM): the agent
    /// runs inside a jail, where root may not manage rctl rules, or not as
    /// root. Carries the command and its stderr.
    RctlNotPermitted {
        /// The rctl command line.
        command: String,
        /// What rctl printed.
        stderr: String,
    },
    /// The workload's log could not be read.
    Log {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

impl fmt::Display for JailError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JailError::Command(e) => write!(f, "{e}"),
            JailError::StopFailed { name, error } => write!(
                f,
                "jail {name} could not be stopped through its conf, so jail(8) kept it ({error}); \
                 it is removed with `jail -R {name}` instead, without its exec.stop: check what \
                 exec.stop needs"
            ),
            JailError::AlreadyExists(n) => write!(
                f,
                "a jail named {n} already exists on this host and was not created by Keel's conf; remove it with `jail -r {n}` or pick another name"
            ),
            JailError::WriteConf { path, reason } => {
                write!(f, "could not write {}: {reason}", path.display())
            }
            JailError::Parse { command, reason } => {
                write!(f, "could not read the output of `{command}`: {reason}")
            }
            JailError::RacctDisabled(msg) => write!(
                f,
                "{msg}; resource limits need kern.racct.enable=1 in /boot/loader.conf and a reboot"
            ),
            JailError::Log { path, reason } => write!(
                f,
                "cannot read the workload's output in {}: {reason}",
                path.display()
            ),
            JailError::RctlNotPermitted { command, stderr } => write!(
                f,
                "`{command}` was not permitted ({stderr}): rctl(8) needs root on the host, and root inside a jail (a nested, single-VM setup) never has it; run keel-agentd as root outside any jail, or leave resources.cpu and resources.memory out of the spec, which skips rctl(8) entirely"
            ),
        }
    }
}

impl std::error::Error for JailError {}

impl From<CmdError> for JailError {
    fn from(e: CmdError) -> Self {
        JailError::Command(e)
    }
}

/// Creating, removing and observing jails.
pub trait JailRuntime: Send {
    /// Every jail on the host, with whether it still runs processes. One jls(8)
    /// and one ps(1) whatever the number of jails.
    fn list(&self) -> Result<Vec<ObservedJail>, JailError>;
    /// Jail `name` alone, as [`JailRuntime::list`] would show it, or `None`
    /// when no such jail is on the host (a dying jail included, which the
    /// list does not show either). What an apply observes: its cost does not
    /// follow the number of jails on the host.
    fn get(&self, name: &str) -> Result<Option<ObservedJail>, JailError>;
    /// Writes the jail's jail.conf and creates it (which runs exec.start).
    fn create(&self, params: &JailParams) -> Result<(), JailError>;
    /// Removes jail `name`, whose root filesystem is `root`, as `how` says,
    /// and unmounts its devfs. A jail that does not exist is success (its
    /// devfs is still unmounted), and so is a jail with no conf left, which
    /// is removed as with [`Removal::Force`]: never through /etc/jail.conf.
    fn remove(&self, name: &str, root: &Path, how: Removal) -> Result<(), JailError>;
    /// Replaces the jail's rctl rules with `limits`. The jail need not exist
    /// yet, and the reconciler calls this *before* `create`: rctl(8) names a
    /// jail subject by its name, the kernel keeps rules for a name no jail
    /// has (`prison_racct_find` in kern_jail.c creates the entry), and a jail
    /// created later under that name is attached to the same entry, so its
    /// first process (exec.start) already runs limited.
    fn set_limits(&self, name: &str, limits: &Limits) -> Result<(), JailError>;
    /// Removes every rctl rule of the jail; none present is success.
    fn clear_limits(&self, name: &str) -> Result<(), JailError>;
    /// Runs argv inside the jail with jexec(8); the caller reads the status.
    fn exec(&self, name: &str, argv: &[String]) -> Result<CmdOutput, JailError>;
    /// The end (at most `max_bytes`) of what jail `name`'s workload printed;
    /// `root` is the jail's root filesystem. Empty when it printed nothing
    /// yet. Never follows a symbolic link the jail may have planted.
    fn workload_log(&self, name: &str, root: &Path, max_bytes: u64) -> Result<Vec<u8>, JailError>;
    /// Whether the workload of jail `name`, just created, already exited,
    /// when the runtime can tell without running a command: `Some` with its
    /// exit status (when known). `None` when it runs, or when telling would
    /// take host commands (FreeBSD: the next pass's jls and ps tell).
    fn exited_at_start(&self, name: &str) -> Option<Option<i32>> {
        let _ = name;
        None
    }
}

/// How long `jail -c` and `jail -r` may run: they run exec.start and exec.stop,
/// and removal waits up to stop.timeout (10 s by default) for processes to exit.
pub const CHANGE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long jls(8) and ps(1) may run.
pub const OBSERVE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one rctl(8) call may run.
pub const RCTL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a command run with jexec(8) may run (e.g. `nginx -t`, a reload).
pub const EXEC_TIMEOUT: Duration = Duration::from_secs(60);

/// daemon(8) inside the jail, which detaches the workload (see the module docs).
pub const JAIL_DAEMON: &str = "/usr/sbin/daemon";
/// Where daemon(8) appends the workload's stdout and stderr, inside the jail.
pub const WORKLOAD_LOG: &str = "/var/log/keel-start.log";
/// env(1) inside the jail: exec.clean empties the environment, so the spec's
/// variables are passed explicitly.
pub const JAIL_ENV: &str = "/usr/bin/env";
const JAIL_IFCONFIG: &str = "/sbin/ifconfig";
const JAIL_ROUTE: &str = "/sbin/route";

/// The jail.conf(5) text Keel writes for one jail: VNET with the jail end of
/// its epair, devfs with the ruleset `devfs` (the `jail.devfs_ruleset`
/// setting), `persist`, a clean environment, and an exec.start list that
/// brings up lo0 and the jail's address, adds the default route, then starts
/// the workload under daemon(8) with the spec's environment applied by
/// env(1).
///
/// Two layers of quoting keep every value literal: each argv element is
/// quoted for sh(1) (jail(8) runs exec.* lines through `/bin/sh -c` inside the
/// jail), and the whole line is a jail.conf double-quoted string, where `\`,
/// `"` and `$` are escaped because jail.conf expands `$name` and `${name}`
/// there.
///
/// [`DevfsRuleset::Inherit`] is written as `devfs_ruleset = 0`, not left
/// out: left out, jail(8) still mounts the jail's devfs with
/// `-oruleset=4` (usr.sbin/jail/command.c), which devfs refuses from inside
/// a jail whose own ruleset is another (devfs_vfsops.c: EPERM). With 0, both
/// the kernel (kern_jail.c: a nested jail always gets its parent's ruleset)
/// and devfs (a jailed mount takes the jail's ruleset) use the parent's.
/// On a host that is not a jail, 0 would hide no device at all, which is
/// why the agent refuses `inherit` there.
pub fn render_jail_conf(params: &JailParams, devfs: DevfsRuleset) -> String {
    let mut lines = vec![
        format!("path = {}", conf_string(&params.path.to_string_lossy())),
        format!("host.hostname = {}", conf_string(&params.hostname)),
        "persist".to_string(),
    ];
    let mut start: Vec<Vec<String>> = Vec::new();
    if let Some(net) = &params.network {
        lines.push("vnet".to_string());
        lines.push(format!("vnet.interface = {}", conf_string(&net.interface)));
        // A new VNET has lo0 down; services that bind 127.0.0.1 need it.
        start.push(words(&[JAIL_IFCONFIG, "lo0", "inet", "127.0.0.1/8", "up"]));
        start.push(words(&[
            JAIL_IFCONFIG,
            &net.interface,
            "inet",
            &format!("{}/{}", net.address, net.prefix_len),
            "up",
        ]));
        start.push(words(&[
            JAIL_ROUTE,
            "add",
            "default",
            &net.gateway.to_string(),
        ]));
    }
    lines.push("mount.devfs".to_string());
    let ruleset = match devfs {
        DevfsRuleset::Number(n) => n,
        DevfsRuleset::Inherit => 0,
    };
    lines.push(format!("devfs_ruleset = {ruleset}"));
    lines.push("exec.clean".to_string());
    if !params.exec_start.is_empty() {
        let mut workload = words(&[JAIL_DAEMON, "-f", "-o", WORKLOAD_LOG]);
        workload.extend(with_env(&params.env, &params.exec_start));
        start.push(workload);
    }
    for (i, command) in start.iter().enumerate() {
        let op = if i == 0 { "=" } else { "+=" };
        lines.push(format!(
            "exec.start {op} {}",
            conf_string(&sh_command(command))
        ));
    }
    if !params.exec_stop.is_empty() {
        let stop = with_env(&params.env, &params.exec_stop);
        lines.push(format!("exec.stop = {}", conf_string(&sh_command(&stop))));
    }
    let mut out = String::from(
        "# Written by keel-agentd at every create; used by `jail -f THIS_FILE -c|-r NAME`.\n",
    );
    out.push_str(&format!("{} {{\n", conf_string(&params.name)));
    for line in lines {
        out.push_str(&format!("\t{line};\n"));
    }
    out.push_str("}\n");
    out
}

/// The rctl(8) rules for `limits` on jail `name`, in the order they are added.
/// `pcpu` is percent of one core, rounded up so a limit never ends up below
/// what the spec asked for.
pub fn rctl_rules(name: &str, limits: &Limits) -> Vec<String> {
    let mut rules = Vec::new();
    if let Some(cpu) = limits.cpu {
        rules.push(format!("jail:{name}:pcpu:deny={}", pcpu_percent(cpu)));
    }
    if let Some(bytes) = limits.memory {
        rules.push(format!("jail:{name}:memoryuse:deny={bytes}"));
    }
    rules
}

fn pcpu_percent(cores: f64) -> u64 {
    // In f64, 0.1 * 100.0 is 10.000000000000002 and 0.29 * 100.0 is
    // 28.999999999999996: snap to a millionth of a percent before rounding up
    // so only a real fraction rounds up. Never 0 (a 0 % limit stops the jail).
    let percent = (cores * 100.0 * 1e6).round() / 1e6;
    (percent.ceil() as u64).max(1)
}

fn words(parts: &[&str]) -> Vec<String> {
    crate::common::cmd::argv(parts)
}

fn with_env(env: &BTreeMap<String, String>, argv: &[String]) -> Vec<String> {
    if env.is_empty() {
        return argv.to_vec();
    }
    let mut out = vec![JAIL_ENV.to_string()];
    out.extend(env.iter().map(|(k, v)| format!("{k}={v}")));
    out.extend(argv.iter().cloned());
    out
}

/// One sh(1) command line from argv. Not [`render_argv`]: that one is for
/// people reading transcripts and leaves `[`, `]`, `{`, `}` bare, which sh
/// would glob; here anything but a conservative set is single-quoted, and `=`
/// in the first word too, where sh would take `A=b` for an assignment.
fn sh_command(argv: &[String]) -> String {
    argv.iter()
        .enumerate()
        .map(|(i, w)| sh_word(w, i > 0))
        .collect::<Vec<_>>()
        .join(" ")
}

fn sh_word(word: &str, allow_equals: bool) -> String {
    let plain = !word.is_empty()
        && word.bytes().all(|b| {
            b.is_ascii_alphanumeric() || b"-_./:,+@%".contains(&b) || (allow_equals && b == b'=')
        });
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// A jail.conf(5) double-quoted string: `\`, `"` and `$` escaped, everything
/// else literal (a raw newline is allowed inside the quotes).
fn conf_string(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        if matches!(c, '\\' | '"' | '$') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// Every string of `params` that ends up in the jail.conf; a NUL byte there
/// would silently cut the value short in jail(8), so it is refused.
fn nul_field(params: &JailParams) -> Option<&'static str> {
    let has_nul = |s: &str| s.contains('\0');
    if has_nul(&params.name) || has_nul(&params.hostname) {
        return Some("name or hostname");
    }
    if has_nul(&params.path.to_string_lossy()) {
        return Some("path");
    }
    if params
        .network
        .as_ref()
        .is_some_and(|n| has_nul(&n.interface))
    {
        return Some("network interface");
    }
    if params.exec_start.iter().any(|a| has_nul(a)) {
        return Some("exec.start");
    }
    if params.exec_stop.iter().any(|a| has_nul(a)) {
        return Some("exec.stop");
    }
    if params.env.iter().any(|(k, v)| has_nul(k) || has_nul(v)) {
        return Some("env");
    }
    None
}

/// Parses `jls -h name jid path`: a header line naming the parameters, then
/// one line per jail with the values separated by one space. Without `-q`
/// nothing is quoted, so the path, last, is the rest of the line and may hold
/// spaces; jls quotes with `-q` without escaping inner quotes, which would
/// make it no easier to read back.
fn parse_jls(stdout: &str) -> Result<Vec<(String, u32, PathBuf)>, String> {
    let mut lines = stdout.lines();
    let header = lines.next().ok_or("no header line")?;
    if header.split_whitespace().collect::<Vec<_>>() != ["name", "jid", "path"] {
        return Err(format!("header is `{header}`, expected `name jid path`"));
    }
    let mut jails = Vec::new();
    for line in lines.filter(|l| !l.trim().is_empty()) {
        let mut fields = line.splitn(3, ' ');
        let (Some(name), Some(jid), Some(path)) = (fields.next(), fields.next(), fields.next())
        else {
            return Err(format!("`{line}` does not have a name, a jid and a path"));
        };
        let jid = jid
            .parse()
            .map_err(|_| format!("`{line}`: jid `{jid}` is not a number"))?;
        if name.is_empty() || path.is_empty() {
            return Err(format!("`{line}` has an empty name or path"));
        }
        jails.push((name.to_string(), jid, PathBuf::from(path)));
    }
    Ok(jails)
}

/// Parses `ps -a -x -o jid=` (one jail id per process, no header) into the
/// number of processes per jail id.
fn parse_ps_jids(stdout: &str) -> Result<BTreeMap<u32, usize>, String> {
    let mut counts = BTreeMap::new();
    for line in stdout.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let jid: u32 = line
            .parse()
            .map_err(|_| format!("`{line}` is not a jail id"))?;
        *counts.entry(jid).or_insert(0) += 1;
    }
    Ok(counts)
}

/// jail(8)'s answer for a jail that does not exist (`jail: "NAME" not
/// found`, with or without `-f`, and for `-R`). The quoted name is matched: a failing exec.stop can
/// print sh's own "not found", and then the jail is still there.
fn jail_not_found(out: &CmdOutput, name: &str) -> bool {
    !out.success() && out.stderr.contains(&format!("\"{name}\" not found"))
}

/// jls(8)'s answer for `-j NAME` of a jail it does not show: libjail's
/// message from jail_get(2) (`jail "NAME" not found` from kern_jail.c, or
/// `jail "NAME" is dying`, which a plain `jls` skips too), printed by
/// jls.c's `xo_errx(1, "%s", jail_errmsg)`.
fn jls_absent(out: &CmdOutput, name: &str) -> bool {
    out.status == 1
        && [
            format!("jail \"{name}\" not found"),
            format!("jail \"{name}\" is dying"),
        ]
        .iter()
        .any(|m| out.stderr.contains(m.as_str()))
}

fn racct_message(out: &CmdOutput) -> Option<String> {
    let text = out.stderr.trim();
    (text.contains("RACCT/RCTL present, but disabled")
        || text.contains("RACCT/RCTL support not present in kernel"))
    .then(|| text.to_string())
}

/// rctl(8) warns with strerror(EPERM) when the kernel's priv_check refuses
/// the rule change: jailed root lacks PRIV_RCTL_* (kern_jail.c
/// `prison_priv_check` denies every privilege it does not list).
fn rctl_not_permitted(argv: &[String], out: &CmdOutput) -> Option<JailError> {
    out.stderr
        .contains("Operation not permitted")
        .then(|| JailError::RctlNotPermitted {
            command: render_argv(argv),
            stderr: out.stderr.trim().to_string(),
        })
}

fn program(path: &Path, args: &[&str]) -> Vec<String> {
    let mut argv = vec![path.to_string_lossy().into_owned()];
    argv.extend(args.iter().map(|a| a.to_string()));
    argv
}

/// [`JailRuntime`] on FreeBSD: jail(8), jls(8), ps(1), rctl(8), jexec(8).
#[derive(Debug)]
pub struct FreeBsdJails<R: CommandRunner> {
    runner: R,
    paths: CommandPaths,
    conf_dir: PathBuf,
    devfs: DevfsRuleset,
    confs: ConfFiles,
}

/// Where the per-jail jail.conf files live: on disk (the agent), or in a map
/// (a dry run, whose jail(8) is [`crate::host::scripted`] and reads them from
/// the same map), so a dry run writes no file and its argv still names
/// `{conf_dir}/{name}.conf`, the path the apply would use. Clones share
/// their files.
#[derive(Debug, Clone, Default)]
pub enum ConfFiles {
    /// The real file system.
    #[default]
    Disk,
    /// Files by path, in memory.
    Memory(Arc<Mutex<BTreeMap<PathBuf, String>>>),
}

impl ConfFiles {
    /// An empty in-memory set.
    pub fn memory() -> ConfFiles {
        ConfFiles::Memory(Arc::default())
    }

    /// The text of `path`.
    pub fn read(&self, path: &Path) -> std::io::Result<String> {
        match self {
            ConfFiles::Disk => std::fs::read_to_string(path),
            ConfFiles::Memory(files) => lock(files).get(path).cloned().ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory")
            }),
        }
    }

    /// Whether `path` is a file.
    pub fn exists(&self, path: &Path) -> bool {
        match self {
            ConfFiles::Disk => path.is_file(),
            ConfFiles::Memory(files) => lock(files).contains_key(path),
        }
    }

    /// Writes `text` to `path` in `dir` (created when missing); on disk next
    /// to its final name, then renamed into place, so a crash never leaves a
    /// half-written conf that `jail -r` would choke on.
    fn write(&self, dir: &Path, path: &Path, text: &str) -> std::io::Result<()> {
        match self {
            ConfFiles::Disk => {
                std::fs::create_dir_all(dir)?;
                let tmp = path.with_extension(format!("conf.tmp.{}", std::process::id()));
                std::fs::write(&tmp, text)?;
                std::fs::rename(&tmp, path).inspect_err(|_| {
                    let _ = std::fs::remove_file(&tmp);
                })
            }
            ConfFiles::Memory(files) => {
                lock(files).insert(path.to_path_buf(), text.to_string());
                Ok(())
            }
        }
    }

    /// Removes `path`; one that was never there is fine.
    fn remove(&self, path: &Path) -> std::io::Result<()> {
        match self {
            ConfFiles::Disk => match std::fs::remove_file(path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other,
            },
            ConfFiles::Memory(files) => {
                lock(files).remove(path);
                Ok(())
            }
        }
    }

    /// Puts `text` at `path` (a dry run copies the confs of the jails it
    /// finds); does nothing on disk.
    pub fn seed(&self, path: &Path, text: &str) {
        if let ConfFiles::Memory(files) = self {
            lock(files).insert(path.to_path_buf(), text.to_string());
        }
    }
}

impl<R: CommandRunner> FreeBsdJails<R> {
    /// Runs commands through `runner` by the absolute `paths`, and keeps each
    /// jail's jail.conf in `conf_dir` (created on first use).
    pub fn new(runner: R, paths: CommandPaths, conf_dir: impl Into<PathBuf>) -> Self {
        FreeBsdJails {
            runner,
            paths,
            conf_dir: conf_dir.into(),
            devfs: DevfsRuleset::default(),
            confs: ConfFiles::Disk,
        }
    }

    /// Keeps the jail.conf files in `confs` instead of on disk (a dry run).
    pub fn with_conf_files(mut self, confs: ConfFiles) -> Self {
        self.confs = confs;
        self
    }

    /// The devfs ruleset of every jail created from now on
    /// (`jail.devfs_ruleset`; [`DevfsRuleset::default`] otherwise).
    pub fn with_devfs_ruleset(mut self, devfs: DevfsRuleset) -> Self {
        self.devfs = devfs;
        self
    }

    /// `{conf_dir}/{name}.conf`
    pub fn conf_path(&self, name: &str) -> PathBuf {
        self.conf_dir.join(format!("{name}.conf"))
    }

    fn run(&self, argv: &[String], timeout: Duration) -> Result<CmdOutput, JailError> {
        Ok(self.runner.run(argv, None, timeout)?)
    }

    /// Writes the conf (see [`ConfFiles::write`]).
    fn write_conf(&self, path: &Path, text: &str) -> Result<(), JailError> {
        self.confs
            .write(&self.conf_dir, path, text)
            .map_err(|e| JailError::WriteConf {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })
    }

    /// Unmounts the devfs `mount.devfs` put on `{root}/dev`, as jail(8) does
    /// on removal, when the mount table lists a devfs there; anything else
    /// at that path is left alone. jail(8) checks the same before its own
    /// umount (a devfs mount point, not merely a path), because the
    /// jail's root user controls `{root}/dev` once nothing is mounted on it.
    /// umount(8) looks a listed path up in the mount table before anything
    /// else, so it unmounts that entry rather than following the path.
    fn unmount_devfs(&self, root: &Path) -> Result<(), JailError> {
        // mount(8) records the real path of a mount point: a link in the
        // jails directory (Keel's, not the jail's) resolves there. Only the
        // root is resolved; `dev` below it is the jail's and never followed.
        let real_root = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
        let list = program(&self.paths.mount, &["-p", "-t", "devfs"]);
        let out = self.run(&list, OBSERVE_TIMEOUT)?.check(&list)?;
        // Only the lines naming this root are parsed: every jail has a devfs
        // line, and a delete or replace must not cost what the node holds.
        let mut found = None;
        for dev in [root.join("dev"), real_root.join("dev")] {
            let mounts = parse_mount_p_under(&out.stdout, &dev).map_err(|e| JailError::Parse {
                command: render_argv(&list),
                reason: e.to_string(),
            })?;
            if mounts
                .iter()
                .any(|m| m.fstype == "devfs" && m.target == dev)
            {
                found = Some(dev);
                break;
            }
        }
        let Some(dev) = found else {
            return Ok(());
        };
        let umount = program(&self.paths.umount, &[&dev.to_string_lossy()]);
        self.run(&umount, CHANGE_TIMEOUT)?.check(&umount)?;
        Ok(())
    }

    /// Deletes the conf of a jail that is gone; never there is fine.
    fn forget_conf(&self, conf: &Path) -> Result<(), JailError> {
        self.confs.remove(conf).map_err(|e| JailError::WriteConf {
            path: conf.to_path_buf(),
            reason: format!("the jail is gone but its conf could not be removed: {e}"),
        })
    }

    fn rctl_remove(&self, name: &str) -> Result<(), JailError> {
        let argv = program(&self.paths.rctl, &["-r", &format!("jail:{name}")]);
        let out = self.run(&argv, RCTL_TIMEOUT)?;
        // No rule matched: the kernel says ESRCH. Without RACCT no rule can
        // exist, so there is nothing to remove either.
        if out.success() || out.stderr.contains("No such process") || racct_message(&out).is_some()
        {
            return Ok(());
        }
        if let Some(e) = rctl_not_permitted(&argv, &out) {
            return Err(e);
        }
        out.check(&argv)?;
        Ok(())
    }
}

impl<R: CommandRunner> JailRuntime for FreeBsdJails<R> {
    fn list(&self) -> Result<Vec<ObservedJail>, JailError> {
        let jls = program(&self.paths.jls, &["-h", "name", "jid", "path"]);
        let out = self.run(&jls, OBSERVE_TIMEOUT)?.check(&jls)?;
        let jails = parse_jls(&out.stdout).map_err(|reason| JailError::Parse {
            command: render_argv(&jls),
            reason,
        })?;
        let ps = program(&self.paths.ps, &["-a", "-x", "-o", "jid="]);
        let out = self.run(&ps, OBSERVE_TIMEOUT)?.check(&ps)?;
        let processes = parse_ps_jids(&out.stdout).map_err(|reason| JailError::Parse {
            command: render_argv(&ps),
            reason,
        })?;
        Ok(jails
            .into_iter()
            .map(|(name, jid, path)| ObservedJail {
                running: processes.get(&jid).is_some_and(|n| *n > 0),
                exit_status: None,
                name,
                jid,
                path,
            })
            .collect())
    }

    /// `jls -j NAME -h name jid path`, then the processes of that jid alone
    /// (`ps -x -o jid= -J JID`): two processes, whose output holds one jail.
    /// jls.c prints the header, then fails with libjail's message (the
    /// kernel's `jail "NAME" not found`, or `jail "NAME" is dying`) and exit
    /// status 1; either is "absent". ps.c exits 1 with nothing printed when
    /// no process matched (a crashed workload), and with `Invalid jail id`
    /// when the jail went away since jls (absent too).
    fn get(&self, name: &str) -> Result<Option<ObservedJail>, JailError> {
        let jls = program(&self.paths.jls, &["-j", name, "-h", "name", "jid", "path"]);
        let out = self.run(&jls, OBSERVE_TIMEOUT)?;
        if !out.success() && jls_absent(&out, name) {
            return Ok(None);
        }
        let out = out.check(&jls)?;
        let parse_error = |reason: String| JailError::Parse {
            command: render_argv(&jls),
            reason,
        };
        let mut jails = parse_jls(&out.stdout).map_err(parse_error)?;
        let (found, jid, path) = match (jails.pop(), jails.is_empty()) {
            (Some(j), true) => j,
            (None, _) => return Err(parse_error("no jail line after the header".into())),
            (Some(_), false) => return Err(parse_error("more than one jail listed".into())),
        };
        if found != name {
            return Err(parse_error(format!(
                "listed jail {found}, asked for {name}"
            )));
        }
        let jid_arg = jid.to_string();
        let ps = program(&self.paths.ps, &["-x", "-o", "jid=", "-J", &jid_arg]);
        let out = self.run(&ps, OBSERVE_TIMEOUT)?;
        let nothing_matched =
            out.status == 1 && out.stdout.trim().is_empty() && out.stderr.trim().is_empty();
        let processes = if nothing_matched {
            0
        } else if out.status == 1 && out.stderr.contains("Invalid jail id") {
            return Ok(None);
        } else {
            let out = out.check(&ps)?;
            let counts = parse_ps_jids(&out.stdout).map_err(|reason| JailError::Parse {
                command: render_argv(&ps),
                reason,
            })?;
            counts.get(&jid).copied().unwrap_or(0)
        };
        Ok(Some(ObservedJail {
            name: found,
            jid,
            path,
            running: processes > 0,
            exit_status: None,
        }))
    }

    fn create(&self, params: &JailParams) -> Result<(), JailError> {
        let conf = self.conf_path(&params.name);
        if let Some(field) = nul_field(params) {
            return Err(JailError::WriteConf {
                path: conf,
                reason: format!("the {field} contains a NUL byte"),
            });
        }
        self.write_conf(&conf, &render_jail_conf(params, self.devfs))?;
        let argv = program(
            &self.paths.jail,
            &["-f", &conf.to_string_lossy(), "-c", &params.name],
        );
        let out = self.run(&argv, CHANGE_TIMEOUT)?;
        if !out.success()
            && out
                .stderr
                .contains(&format!("\"{}\" already exists", params.name))
        {
            return Err(JailError::AlreadyExists(params.name.clone()));
        }
        out.check(&argv)?;
        Ok(())
    }

    fn remove(&self, name: &str, root: &Path, how: Removal) -> Result<(), JailError> {
        let conf = self.conf_path(name);
        // Without our conf (lost state directory, jail made by hand) exec.stop
        // cannot run; plain `jail -r NAME` would read /etc/jail.conf instead.
        if how == Removal::Stop && self.confs.exists(&conf) {
            let argv = program(
                &self.paths.jail,
                &["-f", &conf.to_string_lossy(), "-r", name],
            );
            let out = self.run(&argv, CHANGE_TIMEOUT)?;
            let gone = jail_not_found(&out, name);
            match out.check(&argv) {
                // jail(8) unmounted the devfs itself (mount.devfs is in the conf).
                Ok(_) => return self.forget_conf(&conf),
                // Gone already, perhaps without jail(8) ever unmounting its devfs.
                Err(_) if gone => {}
                Err(error) => {
                    return Err(JailError::StopFailed {
                        name: name.to_string(),
                        error,
                    });
                }
            }
        } else {
            let argv = program(&self.paths.jail, &["-R", name]);
            let out = self.run(&argv, CHANGE_TIMEOUT)?;
            if !(out.success() || jail_not_found(&out, name)) {
                out.check(&argv)?;
            }
        }
        self.unmount_devfs(root)?;
        self.forget_conf(&conf)
    }

    fn set_limits(&self, name: &str, limits: &Limits) -> Result<(), JailError> {
        self.rctl_remove(name)?;
        let rules = rctl_rules(name, limits);
        if rules.is_empty() {
            return Ok(());
        }
        let mut argv = program(&self.paths.rctl, &["-a"]);
        argv.extend(rules);
        let out = self.run(&argv, RCTL_TIMEOUT)?;
        if let Some(msg) = racct_message(&out) {
            return Err(JailError::RacctDisabled(msg));
        }
        if let Some(e) = rctl_not_permitted(&argv, &out) {
            return Err(e);
        }
        out.check(&argv)?;
        Ok(())
    }

    fn clear_limits(&self, name: &str) -> Result<(), JailError> {
        self.rctl_remove(name)
    }

    fn exec(&self, name: &str, argv: &[String]) -> Result<CmdOutput, JailError> {
        let mut full = program(&self.paths.jexec, &[name]);
        if argv.is_empty() {
            // jexec with no command starts an interactive shell.
            return Err(JailError::Command(CmdError::Spawn {
                command: render_argv(&full),
                reason: "no command given".to_string(),
            }));
        }
        full.extend(argv.iter().cloned());
        self.run(&full, EXEC_TIMEOUT)
    }

    /// daemon(8) writes the workload's output to [`WORKLOAD_LOG`] inside the
    /// jail; the jail's root user controls that path, so it is resolved
    /// beneath the root ([`crate::host::beneath`]): no link is followed, and
    /// anything but a regular file is refused.
    fn workload_log(&self, _name: &str, root: &Path, max_bytes: u64) -> Result<Vec<u8>, JailError> {
        let inside = Path::new(WORKLOAD_LOG.trim_start_matches('/'));
        beneath::read_tail(root, inside, max_bytes).map_err(|e| JailError::Log {
            path: root.join(inside),
            reason: e.to_string(),
        })
    }
}

/// In-memory [`JailRuntime`] for tests and `--simulate`'s bookkeeping.
///
/// Every call that changes something is logged to the shared [`CallLog`]
/// (`"jail.create web-1"`, `"jail.remove web-1"` for [`Removal::Stop`],
/// which runs exec.stop, `"jail.force_remove web-1"` for [`Removal::Force`],
/// which runs nothing in the jail, `"jail.set_limits web-1"`,
/// `"jail.clear_limits web-1"`, `"jail.exec web-1 /usr/local/sbin/nginx -t"`),
/// failing calls included, so tests can assert on attempts and ordering.
/// [`Faults`] use the method names as operations (`"create"`, `"remove"`,
/// `"set_limits"`, `"clear_limits"`, `"exec"`, with the jail name as target;
/// `"list"` with target `"jails"`) and make the call fail the way the host
/// would; `"stop"` makes the exec.stop of a [`Removal::Stop`] fail, which
/// keeps the jail and answers [`JailError::StopFailed`], as jail(8) does.
/// rctl rules outlive their jail, as they do in the kernel.
#[derive(Debug, Clone, Default)]
pub struct FakeJails {
    state: Arc<Mutex<JailTable>>,
    log: CallLog,
    faults: Faults,
}

#[derive(Debug, Default)]
struct JailTable {
    jails: BTreeMap<String, FakeJail>,
    limits: BTreeMap<String, Limits>,
    exec_outputs: BTreeMap<String, CmdOutput>,
    logs: BTreeMap<String, Vec<u8>>,
    last_jid: u32,
    racct_disabled: bool,
}

#[derive(Debug)]
struct FakeJail {
    params: JailParams,
    jid: u32,
    running: bool,
    exit_status: Option<i32>,
}

impl FakeJails {
    /// An empty host logging to `log` and failing as `faults` say.
    pub fn new(log: CallLog, faults: Faults) -> FakeJails {
        FakeJails {
            state: Arc::default(),
            log,
            faults,
        }
    }

    /// The workload of `name` exits: the jail stays, with no process left.
    pub fn crash(&self, name: &str) {
        if let Some(j) = lock(&self.state).jails.get_mut(name) {
            j.running = false;
        }
    }

    /// [`FakeJails::crash`], the workload exiting with `status` (as the
    /// simulated host reports it).
    pub fn exit(&self, name: &str, status: i32) {
        if let Some(j) = lock(&self.state).jails.get_mut(name) {
            j.running = false;
            j.exit_status = Some(status);
        }
    }

    /// True when `name` exists and its workload runs.
    pub fn is_running(&self, name: &str) -> bool {
        lock(&self.state).jails.get(name).is_some_and(|j| j.running)
    }

    /// What `name` was created with, while it exists.
    pub fn params(&self, name: &str) -> Option<JailParams> {
        lock(&self.state).jails.get(name).map(|j| j.params.clone())
    }

    /// The rctl limits in force for `name`, if any were set and not cleared.
    pub fn limits(&self, name: &str) -> Option<Limits> {
        lock(&self.state).limits.get(name).copied()
    }

    /// What jail `name`'s workload printed, as `workload_log` answers it.
    pub fn set_workload_log(&self, name: &str, log: &[u8]) {
        lock(&self.state)
            .logs
            .insert(name.to_string(), log.to_vec());
    }

    /// Makes every later `exec` in `name` answer `output`.
    pub fn set_exec_output(&self, name: &str, output: CmdOutput) {
        lock(&self.state)
            .exec_outputs
            .insert(name.to_string(), output);
    }

    /// Simulates a kernel with RACCT disabled: `set_limits` with limits fails
    /// with [`JailError::RacctDisabled`], clearing still succeeds.
    pub fn set_racct_enabled(&self, enabled: bool) {
        lock(&self.state).racct_disabled = !enabled;
    }

    fn failed(command: String, stderr: &str) -> JailError {
        JailError::Command(CmdError::Failed {
            command,
            status: 1,
            stderr: stderr.to_string(),
        })
    }
}

impl JailRuntime for FakeJails {
    fn list(&self) -> Result<Vec<ObservedJail>, JailError> {
        if self.faults.should_fail("list", "jails") {
            return Err(FakeJails::failed(
                "jls -h name jid path".into(),
                "jls: injected failure",
            ));
        }
        Ok(lock(&self.state)
            .jails
            .iter()
            .map(|(name, j)| ObservedJail {
                name: name.clone(),
                jid: j.jid,
                path: j.params.path.clone(),
                running: j.running,
                exit_status: j.exit_status,
            })
            .collect())
    }

    fn get(&self, name: &str) -> Result<Option<ObservedJail>, JailError> {
        if self.faults.should_fail("get", name) {
            return Err(FakeJails::failed(
                format!("jls -j {name} -h name jid path"),
                "jls: injected failure",
            ));
        }
        Ok(lock(&self.state).jails.get(name).map(|j| ObservedJail {
            name: name.to_string(),
            jid: j.jid,
            path: j.params.path.clone(),
            running: j.running,
            exit_status: j.exit_status,
        }))
    }

    fn create(&self, params: &JailParams) -> Result<(), JailError> {
        let name = &params.name;
        self.log.push(format!("jail.create {name}"));
        if self.faults.should_fail("create", name) {
            return Err(FakeJails::failed(
                format!("jail -f {name}.conf -c {name}"),
                &format!("jail: {name}: exec.start failed"),
            ));
        }
        let mut st = lock(&self.state);
        if st.jails.contains_key(name) {
            return Err(JailError::AlreadyExists(name.clone()));
        }
        st.last_jid += 1;
        let jail = FakeJail {
            params: params.clone(),
            jid: st.last_jid,
            running: !params.exec_start.is_empty(),
            exit_status: None,
        };
        st.jails.insert(name.clone(), jail);
        Ok(())
    }

    fn remove(&self, name: &str, _root: &Path, how: Removal) -> Result<(), JailError> {
        let (entry, command) = match how {
            Removal::Stop => ("jail.remove", format!("jail -f {name}.conf -r {name}")),
            Removal::Force => ("jail.force_remove", format!("jail -R {name}")),
        };
        self.log.push(format!("{entry} {name}"));
        if self.faults.should_fail("remove", name) {
            return Err(FakeJails::failed(
                command,
                &format!("jail: {name}: jail_remove: Operation not permitted"),
            ));
        }
        let mut st = lock(&self.state);
        let has_stop = st
            .jails
            .get(name)
            .is_some_and(|j| !j.params.exec_stop.is_empty());
        if how == Removal::Stop && has_stop && self.faults.should_fail("stop", name) {
            let stop = render_argv(&st.jails[name].params.exec_stop);
            return Err(JailError::StopFailed {
                name: name.to_string(),
                error: CmdError::Failed {
                    command,
                    status: 1,
                    stderr: format!("jail: {name}: {stop}: failed"),
                },
            });
        }
        st.jails.remove(name);
        Ok(())
    }

    fn set_limits(&self, name: &str, limits: &Limits) -> Result<(), JailError> {
        self.log.push(format!("jail.set_limits {name}"));
        if self.faults.should_fail("set_limits", name) {
            return Err(FakeJails::failed(
                format!("rctl -a jail:{name}"),
                &format!("rctl: failed to add rule 'jail:{name}': Invalid argument"),
            ));
        }
        let mut st = lock(&self.state);
        st.limits.remove(name);
        if rctl_rules(name, limits).is_empty() {
            return Ok(());
        }
        if st.racct_disabled {
            return Err(JailError::RacctDisabled(
                "rctl: RACCT/RCTL present, but disabled; enable using kern.racct.enable=1 tunable"
                    .into(),
            ));
        }
        st.limits.insert(name.to_string(), *limits);
        Ok(())
    }

    fn clear_limits(&self, name: &str) -> Result<(), JailError> {
        self.log.push(format!("jail.clear_limits {name}"));
        if self.faults.should_fail("clear_limits", name) {
            return Err(FakeJails::failed(
                format!("rctl -r jail:{name}"),
                "rctl: failed to remove rule: Operation not permitted",
            ));
        }
        lock(&self.state).limits.remove(name);
        Ok(())
    }

    fn exec(&self, name: &str, argv: &[String]) -> Result<CmdOutput, JailError> {
        self.log
            .push(format!("jail.exec {name} {}", render_argv(argv)));
        if self.faults.should_fail("exec", name) {
            return Ok(CmdOutput {
                status: 1,
                stdout: String::new(),
                stderr: format!("{}: injected failure\n", render_argv(argv)),
            });
        }
        let st = lock(&self.state);
        if !st.jails.contains_key(name) {
            return Ok(CmdOutput {
                status: 1,
                stdout: String::new(),
                stderr: format!("jexec: jail \"{name}\" not found\n"),
            });
        }
        Ok(st.exec_outputs.get(name).cloned().unwrap_or_default())
    }

    fn workload_log(&self, name: &str, _root: &Path, max_bytes: u64) -> Result<Vec<u8>, JailError> {
        let st = lock(&self.state);
        let log = st.logs.get(name).cloned().unwrap_or_default();
        let from = log
            .len()
            .saturating_sub(usize::try_from(max_bytes).unwrap_or(usize::MAX));
        Ok(log[from..].to_vec())
    }

    fn exited_at_start(&self, name: &str) -> Option<Option<i32>> {
        let st = lock(&self.state);
        let j = st.jails.get(name)?;
        (!j.running).then_some(j.exit_status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The workload's output is read from inside the jail's root: never
    /// through a link the jail planted, never from something that is not a
    /// regular file, and nothing runs.
    #[test]
    fn the_workload_log_is_read_without_following_the_jail_s_links() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("web");
        let logs = root.join("var/log");
        std::fs::create_dir_all(&logs).expect("dirs");
        let runner = std::sync::Arc::new(crate::common::cmd::RecordingRunner::permissive());
        let jails = FreeBsdJails::new(
            std::sync::Arc::clone(&runner),
            CommandPaths::default(),
            dir.path().join("conf"),
        );
        assert_eq!(jails.workload_log("web", &root, 64).expect("none yet"), b"");
        std::fs::write(logs.join("keel-start.log"), b"one\ntwo\nthree\n").expect("log");
        assert_eq!(
            jails.workload_log("web", &root, 6).expect("tail"),
            b"three\n"
        );

        let secret = dir.path().join("host-secret");
        std::fs::write(&secret, b"host only").expect("secret");
        std::fs::remove_file(logs.join("keel-start.log")).expect("rm");
        std::os::unix::fs::symlink(&secret, logs.join("keel-start.log")).expect("link");
        let err = jails.workload_log("web", &root, 64).expect_err("a link");
        assert!(matches!(err, JailError::Log { .. }), "{err:?}");

        std::fs::remove_dir_all(root.join("var")).expect("rm");
        std::fs::create_dir(root.join("var")).expect("var");
        std::os::unix::fs::symlink(dir.path(), root.join("var/log")).expect("link");
        let err = jails
            .workload_log("web", &root, 64)
            .expect_err("a linked directory");
        assert!(err.to_string().contains("is a symbolic link"), "{err}");
        assert!(runner.ran().is_empty());
    }

    fn web() -> JailParams {
        JailParams {
            name: "web-1".into(),
            path: "/usr/local/keel/jails/web-1".into(),
            hostname: "web-1".into(),
            network: Some(JailNetwork {
                interface: "kj_web-1".into(),
                address: Ipv4Addr::new(10, 20, 3, 15),
                prefix_len: 24,
                gateway: Ipv4Addr::new(10, 20, 3, 1),
            }),
            exec_start: vec!["/bin/sh".into(), "/etc/rc".into()],
            exec_stop: vec!["/bin/sh".into(), "/etc/rc.shutdown".into()],
            env: BTreeMap::from([("PORT".to_string(), "8080".to_string())]),
        }
    }

    #[test]
    fn conf_has_vnet_devfs_persist_and_the_start_sequence() {
        let expected = r#"# Written by keel-agentd at every create; used by `jail -f THIS_FILE -c|-r NAME`.
"web-1" {
	path = "/usr/local/keel/jails/web-1";
	host.hostname = "web-1";
	persist;
	vnet;
	vnet.interface = "kj_web-1";
	mount.devfs;
	devfs_ruleset = 4;
	exec.clean;
	exec.start = "/sbin/ifconfig lo0 inet 127.0.0.1/8 up";
	exec.start += "/sbin/ifconfig kj_web-1 inet 10.20.3.15/24 up";
	exec.start += "/sbin/route add default 10.20.3.1";
	exec.start += "/usr/sbin/daemon -f -o /var/log/keel-start.log /usr/bin/env PORT=8080 /bin/sh /etc/rc";
	exec.stop = "/usr/bin/env PORT=8080 /bin/sh /etc/rc.shutdown";
}
"#;
        assert_eq!(render_jail_conf(&web(), DevfsRuleset::default()), expected);
    }

    /// The ruleset is the setting's; `inherit` writes 0, which a nested
    /// jail's kernel and devfs read as "the parent's" (see
    /// [`render_jail_conf`]), never an omitted line that jail(8) would turn
    /// into ruleset 4.
    #[test]
    fn conf_carries_the_configured_devfs_ruleset() {
        let five = render_jail_conf(&web(), DevfsRuleset::Number(5));
        assert!(
            five.contains("\tmount.devfs;\n\tdevfs_ruleset = 5;\n"),
            "{five}"
        );
        let nested = render_jail_conf(&web(), DevfsRuleset::Inherit);
        assert!(
            nested.contains("\tmount.devfs;\n\tdevfs_ruleset = 0;\n"),
            "{nested}"
        );
        assert_eq!(nested.matches("devfs_ruleset").count(), 1, "{nested}");
    }

    #[test]
    fn conf_without_network_env_or_stop_has_only_the_workload() {
        let mut p = web();
        p.network = None;
        p.env.clear();
        p.exec_stop.clear();
        let conf = render_jail_conf(&p, DevfsRuleset::default());
        assert!(!conf.contains("vnet"), "{conf}");
        assert!(!conf.contains("exec.stop"), "{conf}");
        assert!(
            conf.contains(
                "\texec.start = \"/usr/sbin/daemon -f -o /var/log/keel-start.log /bin/sh /etc/rc\";\n"
            ),
            "{conf}"
        );
    }

    #[test]
    fn hostile_words_are_quoted_for_sh_and_escaped_for_jail_conf() {
        let mut p = web();
        p.exec_start = vec![
            "/bin/echo".into(),
            "it's".into(),
            "$HOME".into(),
            "a;b c".into(),
            r"back\slash".into(),
            "\"dq\"".into(),
            "[a-z]*".into(),
        ];
        p.env = BTreeMap::from([("X".to_string(), "${path}".to_string())]);
        let conf = render_jail_conf(&p, DevfsRuleset::default());
        let expected = r#"exec.start += "/usr/sbin/daemon -f -o /var/log/keel-start.log /usr/bin/env 'X=\${path}' /bin/echo 'it'\\''s' '\$HOME' 'a;b c' 'back\\slash' '\"dq\"' '[a-z]*'";"#;
        assert!(conf.contains(expected), "{conf}");
    }

    #[test]
    fn an_assignment_lookalike_is_quoted_only_in_command_position() {
        assert_eq!(
            sh_command(&words(&["A=b", "/bin/x", "K=v"])),
            "'A=b' /bin/x K=v"
        );
        assert_eq!(sh_command(&words(&["/bin/x", ""])), "/bin/x ''");
    }

    #[test]
    fn pcpu_rounds_up_real_fractions_only() {
        assert_eq!(pcpu_percent(1.5), 150);
        assert_eq!(pcpu_percent(0.1), 10);
        assert_eq!(pcpu_percent(0.29), 29);
        assert_eq!(pcpu_percent(0.333), 34);
        assert_eq!(pcpu_percent(2.0), 200);
        assert_eq!(pcpu_percent(0.0001), 1);
    }

    #[test]
    fn rctl_rules_cover_only_the_limits_given() {
        let both = Limits {
            cpu: Some(1.5),
            memory: Some(512 << 20),
        };
        assert_eq!(
            rctl_rules("web-1", &both),
            [
                "jail:web-1:pcpu:deny=150",
                "jail:web-1:memoryuse:deny=536870912"
            ]
        );
        let mem = Limits {
            cpu: None,
            memory: Some(1024),
        };
        assert_eq!(rctl_rules("db", &mem), ["jail:db:memoryuse:deny=1024"]);
        assert!(rctl_rules("db", &Limits::default()).is_empty());
    }

    #[test]
    fn jls_output_parses_with_spaces_in_paths() {
        let out = "name jid path\nweb-1 3 /usr/local/keel/jails/web-1\nold 7 /jails/with space\n";
        assert_eq!(
            parse_jls(out),
            Ok(vec![
                ("web-1".into(), 3, "/usr/local/keel/jails/web-1".into()),
                ("old".into(), 7, "/jails/with space".into()),
            ])
        );
        assert_eq!(parse_jls("name jid path\n"), Ok(vec![]));
    }

    #[test]
    fn unexpected_jls_output_is_refused() {
        assert!(parse_jls("").is_err());
        assert!(parse_jls("JID IP Address Hostname Path\n").is_err());
        assert!(parse_jls("name jid path\nweb-1 x /p\n").is_err());
        assert!(parse_jls("name jid path\nweb-1 3\n").is_err());
    }

    #[test]
    fn ps_jids_are_counted_per_jail() {
        let counts = parse_ps_jids("    0\n    0\n    3\n   12\n    3\n").expect("parses");
        assert_eq!(counts, BTreeMap::from([(0, 2), (3, 2), (12, 1)]));
        assert!(parse_ps_jids("  0\n  PID\n").is_err());
    }

    #[test]
    fn fake_tracks_jails_crashes_and_refuses_duplicates() {
        let log = CallLog::new();
        let jails = FakeJails::new(log.clone(), Faults::default());
        jails.create(&web()).expect("created");
        assert!(jails.is_running("web-1"));
        assert_eq!(
            jails.create(&web()),
            Err(JailError::AlreadyExists("web-1".into()))
        );
        jails.crash("web-1");
        let listed = jails.list().expect("lists");
        assert_eq!(listed.len(), 1);
        assert!(!listed[0].running);
        let root = Path::new("/usr/local/keel/jails/web-1");
        jails.remove("web-1", root, Removal::Stop).expect("removed");
        jails
            .remove("web-1", root, Removal::Force)
            .expect("removing a missing jail is fine");
        assert!(jails.params("web-1").is_none());
        assert_eq!(
            log.entries(),
            [
                "jail.create web-1",
                "jail.create web-1",
                "jail.remove web-1",
                "jail.force_remove web-1"
            ]
        );
    }

    #[test]
    fn fake_get_shows_one_jail_as_list_does() {
        let jails = FakeJails::new(CallLog::new(), Faults::default());
        assert_eq!(jails.get("web-1"), Ok(None));
        jails.create(&web()).expect("created");
        jails.crash("web-1");
        let got = jails.get("web-1").expect("looked up").expect("present");
        assert!(!got.running);
        assert_eq!(jails.list().expect("lists"), [got]);
    }

    #[test]
    fn only_jls_not_found_and_dying_for_the_name_asked_are_absent() {
        let out = |status, stderr: &str| CmdOutput {
            status,
            stdout: "name jid path\n".into(),
            stderr: stderr.into(),
        };
        assert!(jls_absent(
            &out(1, "jls: jail \"web-1\" not found\n"),
            "web-1"
        ));
        assert!(jls_absent(
            &out(1, "jls: jail \"web-1\" is dying\n"),
            "web-1"
        ));
        assert!(!jls_absent(
            &out(1, "jls: jail \"web-10\" not found\n"),
            "web-1"
        ));
        assert!(!jls_absent(
            &out(1, "jls: unknown parameter: path\n"),
            "web-1"
        ));
    }

    #[test]
    fn fake_faults_fail_the_named_operation() {
        let faults = Faults::default();
        let jails = FakeJails::new(CallLog::new(), faults.clone());
        faults.fail_times("create", Some("web-1"), 1);
        assert!(matches!(jails.create(&web()), Err(JailError::Command(_))));
        jails.create(&web()).expect("second attempt works");
        faults.fail("list", None);
        assert!(jails.list().is_err());
        faults.fail("exec", Some("web-1"));
        let out = jails.exec("web-1", &words(&["/bin/true"])).expect("runs");
        assert_eq!(out.status, 1);
    }

    /// With a link in the jails directory, mount(8) lists the devfs under
    /// the resolved path: that is the entry unmounted.
    #[test]
    fn the_devfs_is_found_under_the_real_path_of_the_jails_directory() {
        use crate::common::cmd::{Exchange, RecordingRunner};
        let dir = tempfile::tempdir().expect("tempdir");
        let real = dir.path().join("real");
        std::fs::create_dir_all(real.join("web-1/dev")).expect("dirs");
        std::os::unix::fs::symlink(&real, dir.path().join("jails")).expect("link");
        let real_dev = std::fs::canonicalize(&real)
            .expect("real")
            .join("web-1/dev");
        let answer = |stdout: String| CmdOutput {
            status: 0,
            stdout,
            stderr: String::new(),
        };
        let runner = Arc::new(RecordingRunner::new(vec![
            Exchange {
                argv: words(&["/usr/sbin/jail", "-R", "web-1"]),
                stdin: None,
                output: answer(String::new()),
            },
            Exchange {
                argv: words(&["/sbin/mount", "-p", "-t", "devfs"]),
                stdin: None,
                output: answer(format!(
                    "devfs\t\t\t{} devfs\trw,multilabel \t0 0\n",
                    real_dev.display()
                )),
            },
            Exchange {
                argv: words(&["/sbin/umount", &real_dev.to_string_lossy()]),
                stdin: None,
                output: answer(String::new()),
            },
        ]));
        let jails = FreeBsdJails::new(
            Arc::clone(&runner),
            CommandPaths::default(),
            dir.path().join("conf"),
        );
        jails
            .remove("web-1", &dir.path().join("jails/web-1"), Removal::Force)
            .expect("removed");
        runner.verify().expect("the real path was unmounted");
    }

    #[test]
    fn fake_stop_fault_keeps_the_jail_until_it_is_forced() {
        let faults = Faults::default();
        let jails = FakeJails::new(CallLog::new(), faults.clone());
        jails.create(&web()).expect("created");
        faults.fail("stop", Some("web-1"));
        let root = Path::new("/usr/local/keel/jails/web-1");
        let err = jails
            .remove("web-1", root, Removal::Stop)
            .expect_err("exec.stop fails");
        assert!(matches!(err, JailError::StopFailed { .. }), "{err:?}");
        assert!(err.to_string().contains("jail -R web-1"), "{err}");
        assert!(jails.params("web-1").is_some(), "jail(8) keeps the jail");
        jails
            .remove("web-1", root, Removal::Force)
            .expect("forced: no exec.stop runs");
        assert!(jails.params("web-1").is_none());
    }

    #[test]
    fn fake_limits_outlive_the_jail_until_cleared() {
        let jails = FakeJails::default();
        let limits = Limits {
            cpu: Some(1.0),
            memory: None,
        };
        jails.set_limits("web-1", &limits).expect("set");
        jails
            .remove("web-1", Path::new("/j/web-1"), Removal::Force)
            .expect("removed");
        assert_eq!(jails.limits("web-1"), Some(limits));
        jails.clear_limits("web-1").expect("cleared");
        assert_eq!(jails.limits("web-1"), None);
        jails.set_racct_enabled(false);
        assert!(matches!(
            jails.set_limits("web-1", &limits),
            Err(JailError::RacctDisabled(_))
        ));
        jails
            .clear_limits("web-1")
            .expect("nothing to clear without RACCT");
    }

    #[test]
    fn fake_exec_answers_what_it_was_told() {
        let jails = FakeJails::default();
        let nginx = words(&["/usr/local/sbin/nginx", "-t"]);
        assert_eq!(jails.exec("web-1", &nginx).expect("runs").status, 1);
        jails.create(&web()).expect("created");
        assert!(jails.exec("web-1", &nginx).expect("runs").success());
        jails.set_exec_output(
            "web-1",
            CmdOutput {
                status: 1,
                stdout: String::new(),
                stderr: "nginx: [emerg] unknown directive\n".into(),
            },
        );
        assert_eq!(jails.exec("web-1", &nginx).expect("runs").status, 1);
    }
}
