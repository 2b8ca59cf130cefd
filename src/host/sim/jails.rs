//! Simulated jails: a jail is its `exec.start` process, spawned without a
//! shell in the jail's directory and in a process group of its own.
//!
//! The jail table (name -> pid, the process's start time, path, exec.stop and
//! environment) is saved atomically to `{state_dir}/sim-jails.json` on every
//! change, so an agent restarted after `kill -9` finds its jails again and
//! does not start them twice. Like a `persist` jail, a jail outlives its
//! process: when exec.start exits the jail is listed with `running: false`
//! until the reconciler removes it (and, through its backoff, recreates it).
//!
//! Differences from real jails, on purpose:
//! - A jail runs while its exec.start process runs: workloads must stay in
//!   the foreground (a daemon that forks and exits looks like a crash).
//! - Limits are recorded, not enforced.
//! - The workload runs as the agent's user, with the agent's environment
//!   plus the jail's, and sees the whole host filesystem.
//!
//! A jail being created is saved as `starting` (name and directory) before
//! its process is spawned and replaced by its record right after, so an
//! agent killed in between leaves no workload nobody knows of: the next
//! [`SimJails::new`] kills every process group leader started for that name
//! in that directory (found through `/proc` on Linux; elsewhere such a
//! process can survive, see [`super::process::orphan_leaders`]). Without
//! this, the restarted agent would start the jail a second time.
//!
//! This file must never signal a process it cannot prove it started. A pid
//! alone is not proof (pids are reused); on Linux the pid's start time from
//! `/proc/<pid>/stat` must match the one recorded at spawn. Elsewhere only the
//! pid is checked, so a jail process that died while no agent ran and whose
//! pid was then reused by another process group leader could be signalled.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::process::{
    Output, POLL, Target, exit_code, group_alive, group_usage, jail_command, orphan_leaders,
    proc_info, run_in, signal,
};
use super::{SimError, create_dir, is_plain_name, read_state, write_state};
use crate::common::cmd::{CmdError, CmdOutput, render_argv};
use crate::host::fake::lock;
use crate::host::jail::{JailError, JailParams, JailRuntime, Limits, ObservedJail, Removal};
use crate::host::usage::{JailUsage, UsageError, UsageProbe};

const STATE_FILE: &str = "sim-jails.json";
/// jail(8)'s default `stop.timeout`.
const EXEC_STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a jail's processes get between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// How long SIGKILL gets to take effect before removal is reported failed.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// Deadline of [`JailRuntime::exec`].
const EXEC_TIMEOUT: Duration = Duration::from_secs(60);

/// What is saved of one jail.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct JailRecord {
    /// The exec.start process, leader of the jail's process group.
    pid: u32,
    /// Its start time (see [`super::process::ProcInfo::start_time`]).
    start_time: Option<u64>,
    path: PathBuf,
    exec_stop: Vec<String>,
    /// The jail's environment, `KEEL_JAIL_*` included.
    env: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct LimitsRecord {
    cpu: Option<f64>,
    memory: Option<u64>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct StateFile {
    jails: BTreeMap<String, JailRecord>,
    limits: BTreeMap<String, LimitsRecord>,
    /// Jails whose process may have been spawned but not recorded: name ->
    /// the jail's directory (see the module docs).
    starting: BTreeMap<String, PathBuf>,
}

#[derive(Debug)]
struct Jail {
    record: JailRecord,
    /// Present when this agent spawned the process and has not reaped it.
    child: Option<Child>,
    /// This agent reaped the process: its pid may now belong to another.
    reaped: bool,
    /// The end of exec.start was written to the jail's log.
    end_logged: bool,
    /// exec.start's exit status, once this agent reaped it.
    exit_status: Option<i32>,
}

#[derive(Debug, Default)]
struct Table {
    jails: BTreeMap<String, Jail>,
    limits: BTreeMap<String, Limits>,
    starting: BTreeMap<String, PathBuf>,
}

/// The state of a jail's exec.start process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leader {
    /// Ours and running.
    Running,
    /// Ours, exited, not reaped yet (by whoever its parent is now).
    Dead,
    /// No process has the pid: only leftovers of our group can hold it.
    Gone,
    /// Another process has the pid now; our group is necessarily empty,
    /// since the kernel does not reuse the id of a live process group.
    Reused,
}

/// The name of jail `name`'s log in the logs directory.
fn log_file_name(name: &str) -> String {
    format!("{name}.log")
}

/// [`JailRuntime`] over child processes. A cheap `Clone` handle over shared
/// state (see the module docs for what differs from real jails).
#[derive(Debug, Clone)]
pub struct SimJails {
    table: Arc<Mutex<Table>>,
    file: PathBuf,
    logs: PathBuf,
}

/// [`UsageProbe`] of the simulated host: what each jail's process group
/// uses (Linux `/proc`; elsewhere nothing is reported). Shares the table of
/// the [`SimJails`] it came from and holds its lock only to copy the pids.
#[derive(Debug, Clone)]
pub struct SimUsage {
    table: Arc<Mutex<Table>>,
}

impl UsageProbe for SimUsage {
    fn sample(&self, names: &[String]) -> Result<BTreeMap<String, JailUsage>, UsageError> {
        let groups: BTreeMap<String, (u32, Option<u64>)> = {
            let table = lock(&self.table);
            names
                .iter()
                .filter_map(|n| {
                    let j = table.jails.get(n)?;
                    Some((n.clone(), (j.record.pid, j.record.start_time)))
                })
                .collect()
        };
        let usage = group_usage(&groups.values().copied().collect());
        Ok(groups
            .into_iter()
            .filter_map(|(name, (pgid, _))| {
                let (cpu_seconds, memory_bytes) = *usage.get(&pgid)?;
                Some((
                    name,
                    JailUsage {
                        cpu_seconds,
                        memory_bytes,
                    },
                ))
            })
            .collect())
    }
}

impl SimJails {
    /// A probe of what these jails use, for the agent's usage sampler.
    pub fn usage_probe(&self) -> SimUsage {
        SimUsage {
            table: Arc::clone(&self.table),
        }
    }

    /// Opens the jail table in `state_dir` (created if missing), finding the
    /// jails an earlier agent started.
    pub fn new(state_dir: &Path) -> Result<SimJails, SimError> {
        let logs = state_dir.join("logs");
        create_dir(&logs)?;
        let file = state_dir.join(STATE_FILE);
        let saved: StateFile = read_state(&file)?;
        let table = Table {
            jails: saved
                .jails
                .into_iter()
                .map(|(name, record)| {
                    let jail = Jail {
                        record,
                        child: None,
                        reaped: false,
                        end_logged: false,
                        exit_status: None,
                    };
                    (name, jail)
                })
                .collect(),
            limits: saved
                .limits
                .into_iter()
                .map(|(name, l)| {
                    let limits = Limits {
                        cpu: l.cpu,
                        memory: l.memory,
                    };
                    (name, limits)
                })
                .collect(),
            starting: BTreeMap::new(),
        };
        let jails = SimJails {
            table: Arc::new(Mutex::new(table)),
            file,
            logs,
        };
        if !saved.starting.is_empty() {
            // An agent died between spawning a jail's process and recording
            // it: that process is nobody's, and the jail is absent.
            for (name, path) in &saved.starting {
                if lock(&jails.table).jails.contains_key(name) {
                    continue;
                }
                for pid in orphan_leaders(name, path) {
                    jails.note(
                        name,
                        &format!("killing unrecorded exec.start (pid {pid}) left by a crash"),
                    );
                    let _ = signal(Target::Group(pid), libc::SIGKILL);
                }
            }
            // Failing to forget them only means looking again next start.
            let _ = jails.save(&lock(&jails.table));
        }
        Ok(jails)
    }

    /// `{state_dir}/logs/{name}.log`: the jail's stdout and stderr, and lines
    /// starting `keel-sim:` saying when exec.start began and ended.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.logs.join(log_file_name(name))
    }

    /// The limits last set for `name` (recorded only, never enforced).
    pub fn limits(&self, name: &str) -> Option<Limits> {
        lock(&self.table).limits.get(name).copied()
    }

    fn save(&self, table: &Table) -> Result<(), JailError> {
        let state = StateFile {
            jails: table
                .jails
                .iter()
                .map(|(n, j)| (n.clone(), j.record.clone()))
                .collect(),
            limits: table
                .limits
                .iter()
                .map(|(n, l)| {
                    let record = LimitsRecord {
                        cpu: l.cpu,
                        memory: l.memory,
                    };
                    (n.clone(), record)
                })
                .collect(),
            starting: table.starting.clone(),
        };
        write_state(&self.file, &state).map_err(|e| JailError::WriteConf {
            path: self.file.clone(),
            reason: e.to_string(),
        })
    }

    fn open_log(&self, name: &str) -> Result<std::fs::File, JailError> {
        let path = self.log_path(name);
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| JailError::WriteConf {
                path,
                reason: e.to_string(),
            })
    }

    /// Appends a `keel-sim:` line to the jail's log. The log is for the
    /// human reading it; failing to write it changes nothing else.
    fn note(&self, name: &str, line: &str) {
        if let Ok(mut log) = self.open_log(name) {
            let _ = writeln!(log, "keel-sim: {line}");
        }
    }

    /// Where the jail's exec.start stands; reaps it when it has exited.
    fn leader(&self, name: &str, jail: &mut Jail) -> Leader {
        if let Some(child) = jail.child.as_mut() {
            match child.try_wait() {
                Ok(None) => return Leader::Running,
                Ok(Some(status)) => {
                    self.note(
                        name,
                        &format!("exec.start exited with status {}", exit_code(status)),
                    );
                    jail.end_logged = true;
                    jail.exit_status = Some(exit_code(status));
                }
                // ECHILD: reaped behind our back; the pid is free either way.
                Err(_) => {}
            }
            jail.child = None;
            jail.reaped = true;
        }
        let leader = match proc_info(jail.record.pid) {
            None => Leader::Gone,
            Some(_) if jail.reaped => Leader::Reused,
            Some(info) if info.start_time != jail.record.start_time => Leader::Reused,
            Some(info) if info.zombie => Leader::Dead,
            Some(_) => Leader::Running,
        };
        if leader != Leader::Running && !jail.end_logged {
            self.note(
                name,
                &format!("exec.start (pid {}) is no longer running", jail.record.pid),
            );
            jail.end_logged = true;
        }
        leader
    }

    /// Runs exec.stop in the jail's directory with its environment, output
    /// to the jail's log. Its failure does not stop the removal: the jail's
    /// processes are signalled next anyway.
    fn run_exec_stop(&self, name: &str, jail: &Jail) {
        let argv = &jail.record.exec_stop;
        let outcome = self.open_log(name).and_then(|log| {
            run_in(
                argv,
                &jail.record.path,
                &jail.record.env,
                Output::Append(log),
                EXEC_STOP_TIMEOUT,
            )
            .map_err(JailError::from)
        });
        match outcome {
            Ok(out) if out.success() => {}
            Ok(out) => self.note(
                name,
                &format!("exec.stop exited with status {}", out.status),
            ),
            Err(e) => self.note(name, &format!("exec.stop failed: {e}")),
        }
    }

    /// SIGTERM to the jail's process group, SIGKILL after [`STOP_GRACE`].
    fn stop_group(&self, name: &str, jail: &mut Jail) -> Result<(), JailError> {
        let pgid = jail.record.pid;
        // ESRCH (nobody left) is the common outcome for a crashed jail.
        let _ = signal(Target::Group(pgid), libc::SIGTERM);
        if wait_group(jail, STOP_GRACE) {
            return Ok(());
        }
        self.note(
            name,
            &format!(
                "processes still running {}s after SIGTERM; sending SIGKILL",
                STOP_GRACE.as_secs()
            ),
        );
        let _ = signal(Target::Group(pgid), libc::SIGKILL);
        if wait_group(jail, KILL_GRACE) {
            return Ok(());
        }
        Err(JailError::Command(CmdError::Failed {
            command: format!("simulated kill -KILL -- -{pgid}"),
            status: 1,
            stderr: format!(
                "processes of jail {name} (process group {pgid}) still run {}s after SIGKILL",
                KILL_GRACE.as_secs()
            ),
        }))
    }
}

/// Waits until no live process is left in the jail's group, reaping the
/// leader if it is our child; false if some remain at the deadline.
fn wait_group(jail: &mut Jail, grace: Duration) -> bool {
    let deadline = Instant::now() + grace;
    loop {
        if !group_alive(jail.record.pid) {
            if let Some(mut child) = jail.child.take() {
                // Not alive means exited: this returns at once and leaves
                // no zombie behind.
                let _ = child.wait();
                jail.reaped = true;
            }
            return true;
        }
        if let Some(child) = jail.child.as_mut() {
            if !matches!(child.try_wait(), Ok(None)) {
                jail.child = None;
                jail.reaped = true;
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

impl JailRuntime for SimJails {
    /// Every jail in the table, running while its exec.start process runs;
    /// `jid` is that process's pid. Exited processes are reaped here.
    fn list(&self) -> Result<Vec<ObservedJail>, JailError> {
        let mut table = lock(&self.table);
        let mut out = Vec::with_capacity(table.jails.len());
        for (name, jail) in table.jails.iter_mut() {
            let running = self.leader(name, jail) == Leader::Running;
            out.push(ObservedJail {
                name: name.clone(),
                jid: jail.record.pid,
                path: jail.record.path.clone(),
                running,
                exit_status: jail.exit_status,
            });
        }
        Ok(out)
    }

    /// The jail `name` from the table, as [`SimJails::list`] shows it.
    fn get(&self, name: &str) -> Result<Option<ObservedJail>, JailError> {
        let mut table = lock(&self.table);
        let Some(jail) = table.jails.get_mut(name) else {
            return Ok(None);
        };
        let running = self.leader(name, jail) == Leader::Running;
        Ok(Some(ObservedJail {
            name: name.to_string(),
            jid: jail.record.pid,
            path: jail.record.path.clone(),
            running,
            exit_status: jail.exit_status,
        }))
    }

    /// Spawns exec.start (see the module docs) with `KEEL_JAIL_NAME` and
    /// `KEEL_JAIL_ADDRESS` (empty without a network) added to the jail's
    /// environment, creating the jail's directory if missing.
    fn create(&self, params: &JailParams) -> Result<(), JailError> {
        let name = &params.name;
        let command = render_argv(&params.exec_start);
        if !is_plain_name(name) {
            return Err(JailError::Command(CmdError::Spawn {
                command,
                reason: format!("invalid jail name {name:?}"),
            }));
        }
        if params.exec_start.is_empty() {
            return Err(JailError::Command(CmdError::Spawn {
                command,
                reason: format!(
                    "jail {name} has no exec.start; simulate mode runs exec.start as the jail's process"
                ),
            }));
        }
        let mut table = lock(&self.table);
        if table.jails.contains_key(name) {
            return Err(JailError::AlreadyExists(name.clone()));
        }
        std::fs::create_dir_all(&params.path).map_err(|e| JailError::WriteConf {
            path: params.path.clone(),
            reason: e.to_string(),
        })?;
        let mut env = params.env.clone();
        env.insert("KEEL_JAIL_NAME".into(), name.clone());
        let address = params
            .network
            .as_ref()
            .map(|n| n.address.to_string())
            .unwrap_or_default();
        env.insert("KEEL_JAIL_ADDRESS".into(), address);

        table.starting.insert(name.clone(), params.path.clone());
        if let Err(e) = self.save(&table) {
            table.starting.remove(name);
            return Err(e);
        }
        self.note(name, &format!("starting {command}"));
        let log = self.open_log(name)?;
        let log_err = log.try_clone().map_err(|e| JailError::WriteConf {
            path: self.log_path(name),
            reason: e.to_string(),
        })?;
        let mut cmd = jail_command(&params.exec_start, &params.path, &env)?;
        let child = cmd
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|e| CmdError::Spawn {
                command: command.clone(),
                reason: e.to_string(),
            })?;
        let pid = child.id();
        // Read right after spawn: the process exists (std returns only after
        // exec succeeded), and nothing else can have this pid while our
        // unreaped child holds it.
        let start_time = proc_info(pid).and_then(|i| i.start_time);
        let jail = Jail {
            record: JailRecord {
                pid,
                start_time,
                path: params.path.clone(),
                exec_stop: params.exec_stop.clone(),
                env,
            },
            child: Some(child),
            reaped: false,
            end_logged: false,
            exit_status: None,
        };
        table.jails.insert(name.clone(), jail);
        table.starting.remove(name);
        if let Err(e) = self.save(&table) {
            // A jail we could not record would be started again after a
            // restart: take it back down.
            if let Some(mut jail) = table.jails.remove(name) {
                let _ = signal(Target::Group(pid), libc::SIGKILL);
                if let Some(mut child) = jail.child.take() {
                    let _ = child.wait();
                }
            }
            return Err(e);
        }
        Ok(())
    }

    /// Runs exec.stop (if any, and only for [`Removal::Stop`]), then stops
    /// every process of the jail's group (SIGTERM, then SIGKILL) unless its
    /// pid now belongs to someone else, and forgets the jail. A failing
    /// exec.stop is noted in the jail's log and the removal goes on, which
    /// is what the FreeBSD host reaches through `jail -R`. Limits stay
    /// recorded, as rctl rules do.
    fn remove(&self, name: &str, _root: &Path, how: Removal) -> Result<(), JailError> {
        let mut table = lock(&self.table);
        let Some(jail) = table.jails.get_mut(name) else {
            return Ok(());
        };
        if how == Removal::Stop && !jail.record.exec_stop.is_empty() {
            self.run_exec_stop(name, jail);
        }
        if self.leader(name, jail) != Leader::Reused {
            self.stop_group(name, jail)?;
        }
        table.jails.remove(name);
        self.note(name, "removed");
        self.save(&table)
    }

    /// Records the limits; nothing enforces them in simulate mode.
    fn set_limits(&self, name: &str, limits: &Limits) -> Result<(), JailError> {
        let mut table = lock(&self.table);
        table.limits.insert(name.to_string(), *limits);
        self.save(&table)
    }

    /// Forgets the recorded limits.
    fn clear_limits(&self, name: &str) -> Result<(), JailError> {
        let mut table = lock(&self.table);
        if table.limits.remove(name).is_some() {
            self.save(&table)?;
        }
        Ok(())
    }

    /// Runs argv in the jail's directory with its environment, capturing
    /// output, killed after a minute. Processes it leaves in the background
    /// are killed when it exits. An unknown jail is an error, as with jexec.
    fn exec(&self, name: &str, argv: &[String]) -> Result<CmdOutput, JailError> {
        let (path, env) = {
            let table = lock(&self.table);
            let Some(jail) = table.jails.get(name) else {
                return Err(JailError::Command(CmdError::Failed {
                    command: format!("simulated jexec {name} {}", render_argv(argv)),
                    status: 1,
                    stderr: format!("jexec: jail \"{name}\" not found"),
                }));
            };
            (jail.record.path.clone(), jail.record.env.clone())
        };
        Ok(run_in(argv, &path, &env, Output::Capture, EXEC_TIMEOUT)?)
    }

    /// The end of [`SimJails::log_path`] (the workload's output and the
    /// `keel-sim:` lines). The simulated workload runs as the agent's own
    /// user and can write there, so it is read like a file in a jail's root,
    /// beneath the logs directory ([`crate::host::beneath`]).
    fn workload_log(&self, name: &str, _root: &Path, max_bytes: u64) -> Result<Vec<u8>, JailError> {
        let file = log_file_name(name);
        crate::host::beneath::read_tail(&self.logs, Path::new(&file), max_bytes).map_err(|e| {
            JailError::Log {
                path: self.log_path(name),
                reason: e.to_string(),
            }
        })
    }

    /// Reaps exec.start when it has exited (the same check as [`list`]
    /// makes, for one jail and without touching the others).
    ///
    /// [`list`]: JailRuntime::list
    fn exited_at_start(&self, name: &str) -> Option<Option<i32>> {
        let mut table = lock(&self.table);
        let jail = table.jails.get_mut(name)?;
        (self.leader(name, jail) != Leader::Running).then_some(jail.exit_status)
    }
}
