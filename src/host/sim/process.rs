//! Process plumbing of the simulated jail runtime: who a pid is, whether a
//! process group still has live members, sending signals, and running a
//! helper command (exec.stop, exec) in a jail's directory with a deadline.
//!
//! This file holds the only `unsafe` of the simulated host (one kill(2)
//! call). It must never signal pid 0, 1 or -1: those mean "our own group",
//! init and "every process we may signal".

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::common::cmd::{CmdError, CmdOutput, render_argv};

/// How often a process or group is polled while waiting for it.
pub(super) const POLL: Duration = Duration::from_millis(10);

/// What the kernel says about one pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ProcInfo {
    /// Exited but not yet reaped by its parent.
    pub zombie: bool,
    /// When it started (Linux: `/proc/<pid>/stat` field 22, clock ticks since
    /// boot). Together with the pid it names one process for the life of the
    /// machine; `None` where the OS offers no cheap way to read it.
    pub start_time: Option<u64>,
}

/// The process `pid`, if one exists (zombies included).
#[cfg(target_os = "linux")]
pub(super) fn proc_info(pid: u32) -> Option<ProcInfo> {
    let stat = read_stat(pid)?;
    Some(ProcInfo {
        zombie: stat.zombie,
        start_time: Some(stat.start_time),
    })
}

/// The process `pid`, if one exists. Without /proc there is no start time,
/// so a reused pid cannot be told apart (documented on [`super::SimJails`]).
#[cfg(not(target_os = "linux"))]
pub(super) fn proc_info(pid: u32) -> Option<ProcInfo> {
    signal(Target::Process(pid), 0).ok().map(|()| ProcInfo {
        zombie: false,
        start_time: None,
    })
}

/// True while some process of group `pgid` is alive. Zombies do not count:
/// where init does not reap (some containers), killed orphans stay zombies
/// forever, and they run nothing.
#[cfg(target_os = "linux")]
pub(super) fn group_alive(pgid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return signal(Target::Group(pgid), 0).is_ok();
    };
    entries.flatten().any(|entry| {
        entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
            .and_then(read_stat)
            .is_some_and(|s| s.pgrp == pgid && !s.zombie)
    })
}

/// True while some process of group `pgid` exists.
#[cfg(not(target_os = "linux"))]
pub(super) fn group_alive(pgid: u32) -> bool {
    signal(Target::Group(pgid), 0).is_ok()
}

#[cfg(target_os = "linux")]
struct Stat {
    zombie: bool,
    pgrp: u32,
    start_time: u64,
    /// utime + stime, in clock ticks.
    cpu_ticks: u64,
}

/// Clock ticks per second of `/proc/<pid>/stat`'s times: the kernel's
/// USER_HZ, 100 on every architecture Linux runs Rust on (proc(5) says to
/// ask sysconf(_SC_CLK_TCK), which returns it; that call would be this
/// file's second `unsafe` for a constant).
#[cfg(target_os = "linux")]
const USER_HZ: f64 = 100.0;

/// What the live processes of each group in `groups` use together: CPU
/// seconds (user + system) and resident bytes, the way rctl(8) accounts a
/// jail. `groups` maps a group's id (its leader's pid) to the leader's
/// recorded start time: a group whose id now belongs to a process started
/// at another time is someone else's and left out, as is a group with no
/// live member.
#[cfg(target_os = "linux")]
pub(super) fn group_usage(groups: &BTreeMap<u32, Option<u64>>) -> BTreeMap<u32, (f64, u64)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return BTreeMap::new();
    };
    let mut usage: BTreeMap<u32, (f64, u64)> = BTreeMap::new();
    let mut reused = Vec::new();
    for pid in entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
    {
        let Some(stat) = read_stat(pid) else { continue };
        let Some(started) = groups.get(&stat.pgrp) else {
            continue;
        };
        if stat.zombie {
            continue;
        }
        if pid == stat.pgrp && started.is_some_and(|t| t != stat.start_time) {
            reused.push(pid);
            continue;
        }
        let entry = usage.entry(stat.pgrp).or_default();
        entry.0 += stat.cpu_ticks as f64 / USER_HZ;
        entry.1 += resident_bytes(pid).unwrap_or(0);
    }
    for pgid in reused {
        usage.remove(&pgid);
    }
    usage
}

/// Elsewhere the simulated host reports no usage.
#[cfg(not(target_os = "linux"))]
pub(super) fn group_usage(_groups: &BTreeMap<u32, Option<u64>>) -> BTreeMap<u32, (f64, u64)> {
    BTreeMap::new()
}

/// `VmRSS` of proc(5) `/proc/<pid>/status` (kB), in bytes.
#[cfg(target_os = "linux")]
fn resident_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(target_os = "linux")]
fn read_stat(pid: u32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Parses proc(5) `/proc/<pid>/stat`. The command name (field 2) is in
/// parentheses and may itself contain spaces and parentheses, so fields are
/// counted from the last `)`: field 3 (state) is the first after it.
#[cfg(target_os = "linux")]
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?;
    Some(Stat {
        zombie: *state == "Z" || *state == "X",
        pgrp: fields.get(5 - 3)?.parse().ok()?,
        start_time: fields.get(22 - 3)?.parse().ok()?,
        cpu_ticks: fields.get(14 - 3)?.parse::<u64>().ok()?
            + fields.get(15 - 3)?.parse::<u64>().ok()?,
    })
}

/// Live process group leaders started for jail `name` in `dir`: the
/// `KEEL_JAIL_NAME` of their environment is `name` and their working
/// directory is `dir`. Used only for jails the table says were being started
/// when an agent died, so any such process is an unrecorded leftover.
#[cfg(target_os = "linux")]
pub(super) fn orphan_leaders(name: &str, dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let marker = format!("KEEL_JAIL_NAME={name}");
    // /proc shows the working directory with symlinks resolved.
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .filter(|pid| read_stat(*pid).is_some_and(|s| s.pgrp == *pid && !s.zombie))
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd == dir))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == marker.as_bytes()))
        })
        .collect()
}

/// Without /proc a process's environment and directory cannot be read
/// cheaply, so an unrecorded leftover cannot be found: it keeps running
/// until stopped by hand (documented on [`super::SimJails`]).
#[cfg(not(target_os = "linux"))]
pub(super) fn orphan_leaders(_name: &str, _dir: &Path) -> Vec<u32> {
    Vec::new()
}

/// Whom a signal goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Target {
    /// One process.
    // Linux reads /proc instead of probing with signal 0.
    #[cfg_attr(target_os = "linux", allow(dead_code))]
    Process(u32),
    /// Every process of a process group.
    Group(u32),
}

/// kill(2). Signal 0 only checks that the target exists.
#[allow(unsafe_code)]
pub(super) fn signal(target: Target, sig: libc::c_int) -> std::io::Result<()> {
    let raw = match target {
        Target::Process(pid) => checked_id(pid)?,
        Target::Group(pgid) => -checked_id(pgid)?,
    };
    // SAFETY: kill(2) reads only its two integer arguments and touches no
    // memory of ours. `raw` is never 0, 1, -1 or i32::MIN (checked_id), so
    // this cannot hit our own group, init or every process at once.
    let rc = unsafe { libc::kill(raw, sig) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn checked_id(id: u32) -> std::io::Result<i32> {
    i32::try_from(id)
        .ok()
        .filter(|&i| i > 1)
        .ok_or_else(|| std::io::Error::other(format!("refusing to signal id {id}")))
}

/// The command a simulated jail process runs: argv without a shell, in the
/// jail's directory, with the jail's environment on top of the agent's (so
/// PATH lookups work), stdin closed, in a process group of its own so a
/// Ctrl-C at the agent's terminal does not reach workloads.
pub(super) fn jail_command(
    argv: &[String],
    dir: &Path,
    env: &BTreeMap<String, String>,
) -> Result<Command, CmdError> {
    let Some((program, args)) = argv.split_first() else {
        return Err(CmdError::Spawn {
            command: String::new(),
            reason: "empty argv".into(),
        });
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .current_dir(dir)
        .envs(env)
        .stdin(Stdio::null())
        .process_group(0);
    Ok(cmd)
}

/// Where a helper command's stdout and stderr go.
pub(super) enum Output {
    /// Captured into the returned [`CmdOutput`].
    Capture,
    /// Appended to this file (a jail's log); the output fields stay empty.
    Append(std::fs::File),
}

/// Runs `argv` like [`jail_command`] and waits at most `timeout`; its whole
/// process group is killed when it exits or at the deadline, whichever first. [`crate::common::cmd::SystemRunner`]
/// would be the one runner to use, but it sets neither a working directory
/// nor an environment, and a jail command needs both.
pub(super) fn run_in(
    argv: &[String],
    dir: &Path,
    env: &BTreeMap<String, String>,
    output: Output,
    timeout: Duration,
) -> Result<CmdOutput, CmdError> {
    let command = render_argv(argv);
    let mut cmd = jail_command(argv, dir, env)?;
    match &output {
        Output::Capture => {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        Output::Append(file) => {
            let (out, err) = clone_twice(file).map_err(|e| CmdError::Spawn {
                command: command.clone(),
                reason: e.to_string(),
            })?;
            cmd.stdout(out).stderr(err);
        }
    }
    let mut child = cmd.spawn().map_err(|e| CmdError::Spawn {
        command: command.clone(),
        reason: e.to_string(),
    })?;
    // Each pipe drains on its own thread so a command that fills one while we
    // wait cannot deadlock.
    let out = child.stdout.take().map(drain);
    let err = child.stderr.take().map(drain);
    let status = wait_deadline(&mut child, timeout);
    // Whatever the command left running in its group goes with it: a helper
    // must not outlive its call (nothing would ever stop it), and a leftover
    // holding the pipes open would block the drains forever. ESRCH (nothing
    // left) is the usual outcome.
    let _ = signal(Target::Group(child.id()), libc::SIGKILL);
    let Some(status) = status else {
        let _ = child.wait();
        return Err(CmdError::Timeout {
            command,
            after: timeout,
        });
    };
    Ok(CmdOutput {
        status: exit_code(status),
        stdout: out.map(join).unwrap_or_default(),
        stderr: err.map(join).unwrap_or_default(),
    })
}

/// Waits for `child` until `timeout`; `None` if it is still running then.
pub(super) fn wait_deadline(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            // Already reaped elsewhere: nothing left to wait for.
            Err(_) => return None,
            Ok(None) if Instant::now() >= deadline => return None,
            Ok(None) => std::thread::sleep(POLL),
        }
    }
}

/// A command killed by a signal reports 128 + the signal, as sh(1) does.
pub(super) fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

fn clone_twice(file: &std::fs::File) -> std::io::Result<(std::fs::File, std::fs::File)> {
    Ok((file.try_clone()?, file.try_clone()?))
}

fn drain<R: Read + Send + 'static>(mut pipe: R) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        buf
    })
}

fn join(handle: std::thread::JoinHandle<Vec<u8>>) -> String {
    String::from_utf8_lossy(&handle.join().unwrap_or_default()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_never_reach_special_ids() {
        for id in [0, 1, u32::MAX, 1 << 31] {
            assert!(signal(Target::Process(id), 0).is_err(), "{id}");
            assert!(signal(Target::Group(id), 0).is_err(), "{id}");
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        let line = "4231 (a) b (c)) S 4227 4231 4231 0 -1 4194560 2726 2011691 0 46 1 3 7948 1276 20 0 1 0 45852 5124096 928";
        let stat = parse_stat(line).expect("parses");
        assert_eq!(stat.pgrp, 4231);
        assert_eq!(stat.start_time, 45852);
        assert!(!stat.zombie);
        assert!(parse_stat("12 (x) Z 1 12 12").is_none());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn own_process_is_found_with_a_start_time() {
        let me = proc_info(std::process::id()).expect("we exist");
        assert!(!me.zombie);
        assert!(me.start_time.is_some());
    }

    #[test]
    fn run_in_uses_the_directory_and_environment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let env = BTreeMap::from([("KEEL_T".to_string(), "v".to_string())]);
        // The simulated workload is a script of the test's own; Keel execs it
        // directly, as it does every exec.start.
        let script = dir.path().join("workload");
        std::fs::write(&script, "#!/bin/sh\npwd\necho $KEEL_T\nexit 4\n").expect("script");
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
        let argv = vec![script.display().to_string()];
        let out = run_in(
            &argv,
            dir.path(),
            &env,
            Output::Capture,
            Duration::from_secs(10),
        )
        .expect("runs");
        let canonical = dir.path().canonicalize().expect("canonical");
        assert_eq!(out.stdout, format!("{}\nv\n", canonical.display()));
        assert_eq!(out.status, 4);
    }

    #[test]
    fn run_in_kills_at_the_deadline() {
        let dir = tempfile::tempdir().expect("tempdir");
        let argv = crate::common::cmd::argv(&["/bin/sleep", "30"]);
        let err = run_in(
            &argv,
            dir.path(),
            &BTreeMap::new(),
            Output::Capture,
            Duration::from_millis(50),
        )
        .expect_err("times out");
        assert!(matches!(err, CmdError::Timeout { .. }), "{err}");
    }
}
