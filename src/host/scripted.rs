//! A scripted FreeBSD host: a [`CommandRunner`] test double that keeps the
//! state a FreeBSD host keeps (jails, interfaces and vnets, datasets and
//! snapshots, mounts, routes, rctl rules, pf anchors, sysctls) and answers the
//! exact argv Keel's `FreeBsd*` implementations run, with the output formats
//! and error texts of the golden transcripts in `tests/golden/`.
//!
//! A golden transcript proves Keel runs the commands it meant to run; this
//! host proves the order makes sense, because it refuses what FreeBSD
//! refuses, with FreeBSD's text:
//! - `zfs clone` of a missing snapshot; `zfs destroy` of a missing dataset,
//!   of a dataset with children without `-r`, or of one with anything mounted
//!   below its mountpoint (a nullfs volume, a jail's devfs), with a nullfs
//!   mount of it elsewhere, or that an existing jail has as its root;
//! - `jail -c` of a name that exists, of an all-digit name, with a missing
//!   path, or with a `vnet.interface` that is not on the host (in another
//!   vnet, or never created); `jail -r`/`-R` of an unknown jail; a failing
//!   `exec.stop` (see [`ScriptedHost::fail_exec_stop`]) keeps the jail;
//! - `ifconfig IF vnet J` of an interface not on the host, `ifconfig IF -vnet
//!   J` of one not in J's vnet, renames onto a taken name, `addm` of a missing
//!   member, `-alias` of an absent address, commands on missing interfaces;
//! - `mount -t nullfs` from or onto a missing directory, `umount` of what is
//!   not mounted or has a mount below it;
//! - `route add` of an existing route, `route delete` of an absent one;
//! - `rctl -r` with no matching rule, and rctl without RACCT.
//!
//! How FreeBSD behaves, as modelled: `jail -f CONF -c` reads the per-jail
//! jail.conf Keel wrote (path, `vnet.interface`, `mount.devfs`, exec.start
//! and exec.stop); it mounts devfs on `PATH/dev`, moves the interface into
//! the new vnet, and runs exec.start, whose daemon(8) workload is the jail's
//! one process. A crashed workload ([`ScriptedHost::crash`]) leaves a
//! `persist` jail with no process: `jls` lists it, `ps -o jid=` shows none.
//! `jail -f CONF -r` runs exec.stop, unmounts devfs and destroys the vnet,
//! which returns its interfaces to the host (or, for a dying jail, later:
//! [`ScriptedHost::linger_on_removal`]); `jail -r NAME` without the conf
//! and `jail -R NAME` skip exec.stop and leave devfs mounted, as jail(8)
//! documents. rctl rules name jails by name and may exist before the jail.
//!
//! A command it does not model is [`CmdError::Unexpected`], so a new
//! FreeBSD operation shows up here instead of silently succeeding.
//!
//! It never runs anything, and reads nothing from the machine but the
//! jail.conf files `jail -f` names ([`ConfFiles`]: on disk, or the map a
//! dry run shares with its `FreeBsdJails`). Besides tests, it is the host a
//! dry run applies to (`agentd::reconciler`'s `dry_run`): seeded with what the
//! real host showed ([`ScriptedHost::seed_jail`] and the other `seed_*`
//! calls), it answers the same FreeBSD commands the apply would run, so the
//! commands it records are the apply's, and nothing real changes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::cidr::Ipv4Net;
use crate::common::cmd::{CmdError, CmdOutput, CommandRunner, Exchange, render_argv};
use crate::common::config::CommandPaths;
use crate::host::fake::lock;
use crate::host::jail::{ConfFiles, JAIL_DAEMON};

/// The scripted host; a cheap `Clone` handle over shared state, so a test
/// keeps one clone to inspect and steer while the `FreeBsd*` seams own others.
#[derive(Debug, Clone)]
pub struct ScriptedHost {
    paths: CommandPaths,
    state: Arc<Mutex<HostState>>,
}

#[derive(Debug, Default)]
struct HostState {
    jails: BTreeMap<String, Jail>,
    last_jid: u32,
    datasets: BTreeMap<String, Dataset>,
    snapshots: BTreeSet<String>,
    /// Directories that exist outside any mounted dataset's own root (made by
    /// mkdir, or part of a base's tree).
    dirs: BTreeSet<PathBuf>,
    /// Mounts other than ZFS's own, in mount order (last is topmost).
    mounts: Vec<Mount>,
    /// Interfaces in creation order.
    interfaces: Vec<Interface>,
    next_epair: u32,
    next_bridge: u32,
    routes: BTreeMap<Ipv4Net, Ipv4Addr>,
    rctl: BTreeMap<String, Vec<String>>,
    racct: bool,
    anchors: BTreeMap<String, String>,
    pf_references_keel: bool,
    stop_fails: BTreeSet<String>,
    /// Jails whose vnet outlives their removal for a while (dying).
    lingering: BTreeSet<String>,
    /// Jails whose last `jail -c` started the workload with no rctl rule.
    started_unlimited: BTreeSet<String>,
    ran: Vec<Exchange>,
    /// Where `jail -f CONF` reads CONF.
    confs: ConfFiles,
}

#[derive(Debug, Clone)]
struct Jail {
    jid: u32,
    path: PathBuf,
    /// Processes running inside (the daemon(8) workload).
    processes: usize,
}

#[derive(Debug, Clone)]
struct Dataset {
    mountpoint: Option<PathBuf>,
    quota: Option<u64>,
    used: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    source: PathBuf,
    target: PathBuf,
    fstype: &'static str,
}

#[derive(Debug, Clone)]
struct Interface {
    name: String,
    /// The jail whose vnet holds it; `None` on the host.
    vnet: Option<String>,
    /// The other end of an epair.
    peer: Option<String>,
    addresses: Vec<(Ipv4Addr, u8)>,
    up: bool,
}

/// Prefix of the vnet of a dying jail; `:` never occurs in a jail name
/// Keel makes (DNS labels), so no live jail's vnet can match it.
const DYING: &str = "dying:";
/// Host processes outside any jail that `ps -a -x -o jid=` always shows.
const HOST_PROCESSES: usize = 3;
/// What a base snapshot holds that Keel relies on: devfs goes on `dev`.
const BASE_DIRS: &[&str] = &["dev", "etc", "var", "var/log", "usr", "usr/local"];

impl ScriptedHost {
    /// A host with the standard interfaces (`em0 lo0 pflog0`), pool `pool`
    /// with `{pool}/keel` (mountpoint none), RACCT enabled, and a pf.conf
    /// that references Keel's anchors. Commands are recognised by `paths`.
    pub fn new(paths: CommandPaths, pool: &str) -> ScriptedHost {
        let mut st = HostState {
            racct: true,
            pf_references_keel: true,
            ..HostState::default()
        };
        for name in ["em0", "lo0", "pflog0"] {
            st.interfaces.push(Interface {
                name: name.into(),
                vnet: None,
                peer: None,
                addresses: Vec::new(),
                up: true,
            });
        }
        st.datasets.insert(
            format!("{pool}/keel"),
            Dataset {
                mountpoint: None,
                quota: None,
                used: 0,
            },
        );
        ScriptedHost {
            paths,
            state: Arc::new(Mutex::new(st)),
        }
    }

    /// Prepares base `dataset` mounted at `mountpoint`, with its `@keel` snapshot.
    pub fn add_base(&self, dataset: &str, mountpoint: &Path) {
        let mut st = lock(&self.state);
        st.create_dataset(dataset, Some(mountpoint.to_path_buf()), None);
        st.snapshots.insert(format!("{dataset}@keel"));
    }

    /// `jail -f CONF` reads CONF from `confs` (on disk by default).
    pub fn with_conf_files(self, confs: ConfFiles) -> ScriptedHost {
        lock(&self.state).confs = confs;
        self
    }

    /// A dataset that exists (replacing one of that name), with its
    /// mountpoint (`None`: not mounted), quota and use.
    pub fn seed_dataset(
        &self,
        name: &str,
        mountpoint: Option<&Path>,
        quota: Option<u64>,
        used: u64,
    ) {
        let mut st = lock(&self.state);
        st.create_dataset(name, mountpoint.map(Path::to_path_buf), quota);
        if let Some(d) = st.datasets.get_mut(name) {
            d.used = used;
        }
    }

    /// A snapshot that exists (`dataset@name`).
    pub fn seed_snapshot(&self, snapshot: &str) {
        lock(&self.state).snapshots.insert(snapshot.to_string());
    }

    /// A nullfs or devfs mount of `source` on `target`; other types are
    /// not modelled and ignored.
    pub fn seed_mount(&self, source: &Path, target: &Path, fstype: &str) {
        let fstype = match fstype {
            "nullfs" => "nullfs",
            "devfs" => "devfs",
            _ => return,
        };
        lock(&self.state).mounts.push(Mount {
            source: source.to_path_buf(),
            target: target.to_path_buf(),
            fstype,
        });
    }

    /// An interface that exists, up, on the host (`vnet` `None`) or in jail
    /// `vnet`'s, paired with `peer` when it is an epair end. A name that
    /// exists already is left as it is.
    pub fn seed_interface(&self, name: &str, peer: Option<&str>, vnet: Option<&str>) {
        let mut st = lock(&self.state);
        if st.interfaces.iter().any(|i| i.name == name) {
            return;
        }
        st.interfaces.push(Interface {
            name: name.to_string(),
            vnet: vnet.map(str::to_string),
            peer: peer.map(str::to_string),
            addresses: Vec::new(),
            up: true,
        });
    }

    /// A jail that exists at `path`, with its workload running or gone.
    pub fn seed_jail(&self, name: &str, jid: u32, path: &Path, running: bool) {
        let mut st = lock(&self.state);
        st.last_jid = st.last_jid.max(jid);
        st.jails.insert(
            name.to_string(),
            Jail {
                jid,
                path: path.to_path_buf(),
                processes: usize::from(running),
            },
        );
    }

    /// A directory that exists (inside a dataset's mountpoint, say a jail
    /// root's `dev`, which a base provides).
    pub fn seed_dir(&self, path: &Path) {
        lock(&self.state).dirs.insert(path.to_path_buf());
    }

    /// The workload of jail `name` exits: the jail stays, with no process.
    pub fn crash(&self, name: &str) {
        if let Some(j) = lock(&self.state).jails.get_mut(name) {
            j.processes = 0;
        }
    }

    /// Makes every later `jail -f CONF -r name` fail in exec.stop (the jail stays).
    pub fn fail_exec_stop(&self, name: &str) {
        lock(&self.state).stop_fails.insert(name.to_string());
    }

    /// Makes the vnet of jail `name` linger after its removal, as a dying
    /// VNET jail's does while sockets drain: its interfaces stay in it, on
    /// no host and in no jail anyone can name (jls and jail_getid skip dying
    /// jails), until [`ScriptedHost::release_dying`]. Reclaiming them with
    /// `ifconfig IF -vnet NAME` before the removal, or destroying the epair
    /// from its host end, gets them back.
    pub fn linger_on_removal(&self, name: &str) {
        lock(&self.state).lingering.insert(name.to_string());
    }

    /// Every dying vnet finally goes: its interfaces return to the host.
    pub fn release_dying(&self) {
        for i in lock(&self.state).interfaces.iter_mut() {
            if i.vnet.as_deref().is_some_and(|v| v.starts_with(DYING)) {
                i.vnet = None;
            }
        }
    }

    /// Simulates a kernel with RACCT disabled (rctl fails as it does then).
    pub fn set_racct_enabled(&self, enabled: bool) {
        lock(&self.state).racct = enabled;
    }

    /// Whether pf.conf references `keel/*` (both anchors at once).
    pub fn set_pf_references_keel(&self, referenced: bool) {
        lock(&self.state).pf_references_keel = referenced;
    }

    /// True when the last `jail -c` of `name` started its workload while no
    /// rctl rule named the jail: exec.start ran unlimited, however briefly.
    pub fn started_without_limits(&self, name: &str) -> bool {
        lock(&self.state).started_unlimited.contains(name)
    }

    /// Names of the jails that exist.
    pub fn jails(&self) -> Vec<String> {
        lock(&self.state).jails.keys().cloned().collect()
    }

    /// The rctl rules in force for jail `name` (e.g. `jail:web:pcpu:deny=100`).
    pub fn rctl_rules(&self, name: &str) -> Vec<String> {
        let key = format!("jail:{name}");
        lock(&self.state)
            .rctl
            .get(&key)
            .cloned()
            .unwrap_or_default()
    }

    /// Every non-ZFS mount as `(fstype, target)`, in mount order.
    pub fn mounts(&self) -> Vec<(String, PathBuf)> {
        lock(&self.state)
            .mounts
            .iter()
            .map(|m| (m.fstype.to_string(), m.target.clone()))
            .collect()
    }

    /// Names of every dataset (not snapshots).
    pub fn datasets(&self) -> Vec<String> {
        lock(&self.state).datasets.keys().cloned().collect()
    }

    /// Interfaces as `(name, vnet)`: `None` on the host, else the jail.
    pub fn interfaces(&self) -> Vec<(String, Option<String>)> {
        lock(&self.state)
            .interfaces
            .iter()
            .map(|i| (i.name.clone(), i.vnet.clone()))
            .collect()
    }

    /// The rules last loaded into pf anchor `anchor`, if any.
    pub fn anchor(&self, anchor: &str) -> Option<String> {
        lock(&self.state).anchors.get(anchor).cloned()
    }

    /// Everything that ran, with the answers given (a transcript).
    pub fn ran(&self) -> Vec<Exchange> {
        lock(&self.state).ran.clone()
    }

    fn answer(
        &self,
        st: &mut HostState,
        argv: &[String],
        stdin: Option<&str>,
    ) -> Option<CmdOutput> {
        let (program, args) = argv.split_first()?;
        let program = Path::new(program);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let p = &self.paths;
        let output = if program == p.jail {
            st.jail(&args)?
        } else if program == p.jls {
            st.jls(&args)?
        } else if program == p.ps {
            st.ps(&args)?
        } else if program == p.jexec {
            st.jexec(&args)?
        } else if program == p.rctl {
            st.rctl(&args)?
        } else if program == p.zfs {
            st.zfs(&args)?
        } else if program == p.mkdir {
            st.mkdir(&args)?
        } else if program == p.mount {
            st.mount(&args)?
        } else if program == p.umount {
            st.umount(&args)?
        } else if program == p.ifconfig {
            st.ifconfig(&args)?
        } else if program == p.route {
            st.route(&args)?
        } else if program == p.netstat {
            st.netstat(&args)?
        } else if program == p.pfctl {
            st.pfctl(&args, stdin)?
        } else if program == p.sysctl {
            st.sysctl(&args)?
        } else {
            return None;
        };
        Some(output)
    }
}

impl CommandRunner for ScriptedHost {
    fn run(
        &self,
        argv: &[String],
        stdin: Option<&[u8]>,
        _timeout: Duration,
    ) -> Result<CmdOutput, CmdError> {
        let stdin = stdin.map(|b| String::from_utf8_lossy(b).into_owned());
        let mut st = lock(&self.state);
        let Some(output) = self.answer(&mut st, argv, stdin.as_deref()) else {
            return Err(CmdError::Unexpected {
                command: render_argv(argv),
                expected: "a command the scripted FreeBSD host models".into(),
            });
        };
        st.ran.push(Exchange {
            argv: argv.to_vec(),
            stdin,
            output: output.clone(),
        });
        Ok(output)
    }
}

fn ok(stdout: impl Into<String>) -> Option<CmdOutput> {
    Some(CmdOutput {
        status: 0,
        stdout: stdout.into(),
        stderr: String::new(),
    })
}

fn fail(stderr: impl Into<String>) -> Option<CmdOutput> {
    Some(CmdOutput {
        status: 1,
        stdout: String::new(),
        stderr: format!("{}\n", stderr.into()),
    })
}

/// route(8) reports its results, failures included, on stdout.
fn fail_stdout(stdout: impl Into<String>) -> Option<CmdOutput> {
    Some(CmdOutput {
        status: 1,
        stdout: format!("{}\n", stdout.into()),
        stderr: String::new(),
    })
}

/// What `jail -f` reads of Keel's per-jail jail.conf.
#[derive(Debug, Default)]
struct Conf {
    path: Option<PathBuf>,
    vnet_interfaces: Vec<String>,
    devfs: bool,
    workload: bool,
    stop: bool,
}

/// Reads the jail.conf(5) subset Keel writes: `key = "value";`, `key +=
/// "value";` and `key;` lines inside one `"name" { ... }` block.
fn read_conf(confs: &ConfFiles, path: &Path) -> Result<Conf, String> {
    let text = confs
        .read(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut conf = Conf::default();
    for line in text.lines().map(str::trim) {
        let Some(line) = line.strip_suffix(';') else {
            continue;
        };
        let (key, value) = match line.split_once(" += ").or_else(|| line.split_once(" = ")) {
            Some((k, v)) => (k.trim(), Some(unquote(v.trim()))),
            None => (line, None),
        };
        match (key, value) {
            ("path", Some(v)) => conf.path = Some(PathBuf::from(v)),
            ("vnet.interface", Some(v)) => conf.vnet_interfaces.push(v),
            ("mount.devfs", None) => conf.devfs = true,
            ("exec.start", Some(v)) if v.starts_with(JAIL_DAEMON) => conf.workload = true,
            ("exec.stop", Some(_)) => conf.stop = true,
            _ => {}
        }
    }
    Ok(conf)
}

fn unquote(value: &str) -> String {
    let inner = value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value);
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            out.extend(chars.next());
        } else {
            out.push(c);
        }
    }
    out
}

fn netmask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix))
    }
}

impl HostState {
    // ---- jail(8), jls(8), ps(1), jexec(8), rctl(8) ----

    fn jail(&mut self, args: &[&str]) -> Option<CmdOutput> {
        match args {
            ["-f", conf, "-c", name] => self.jail_create(Path::new(conf), name),
            ["-f", conf, "-r", name] => self.jail_remove(name, Some(Path::new(conf))),
            ["-r", name] | ["-R", name] => self.jail_remove(name, None),
            _ => None,
        }
    }

    fn jail_create(&mut self, conf_path: &Path, name: &str) -> Option<CmdOutput> {
        let conf = match read_conf(&self.confs, conf_path) {
            Ok(c) => c,
            Err(e) => return fail(format!("jail: {e}")),
        };
        if self.jails.contains_key(name) {
            return fail(format!("jail: \"{name}\" already exists"));
        }
        if !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit()) {
            // kern_jail.c refuses it; jail(8) prints the kernel's message.
            return fail(format!(
                "jail: {name}: name cannot be numeric (unless it is the jid)"
            ));
        }
        let Some(path) = conf.path.clone() else {
            return fail(format!("jail: {name}: path: no value"));
        };
        if !self.dir_exists(&path) {
            return fail(format!(
                "jail: {name}: path {}: No such file or directory",
                path.display()
            ));
        }
        if conf.devfs && !self.dir_exists(&path.join("dev")) {
            return fail(format!(
                "jail: {name}: mount.devfs: {}/dev: No such file or directory",
                path.display()
            ));
        }
        // jail(8) runs `ifconfig IF vnet NAME` for each vnet.interface; the
        // interface must be on the host (not in another jail's vnet).
        for iface in &conf.vnet_interfaces {
            if self.host_iface(iface).is_none() {
                return fail(format!(
                    "ifconfig: interface {iface} does not exist\njail: {name}: /sbin/ifconfig {iface} vnet {name}: failed"
                ));
            }
        }
        self.last_jid += 1;
        let jid = self.last_jid;
        if conf.devfs {
            self.mounts.push(Mount {
                source: PathBuf::from("devfs"),
                target: path.join("dev"),
                fstype: "devfs",
            });
        }
        for iface in &conf.vnet_interfaces {
            if let Some(i) = self.interfaces.iter_mut().find(|i| &i.name == iface) {
                i.vnet = Some(name.to_string());
            }
        }
        let limited = self
            .rctl
            .get(&format!("jail:{name}"))
            .is_some_and(|rules| !rules.is_empty());
        if conf.workload && !limited {
            self.started_unlimited.insert(name.to_string());
        } else {
            self.started_unlimited.remove(name);
        }
        self.jails.insert(
            name.to_string(),
            Jail {
                jid,
                path,
                processes: usize::from(conf.workload),
            },
        );
        ok(format!("{name}: created\n"))
    }

    fn jail_remove(&mut self, name: &str, conf_path: Option<&Path>) -> Option<CmdOutput> {
        let Some(jail) = self.jails.get(name).cloned() else {
            return fail(format!("jail: \"{name}\" not found"));
        };
        // Without the conf file (or with -R) jail(8) knows no exec.stop and
        // no mount.devfs: it only kills the processes and removes the jail.
        let conf = match conf_path {
            Some(p) => match read_conf(&self.confs, p) {
                Ok(c) => Some(c),
                Err(e) => return fail(format!("jail: {e}")),
            },
            None => None,
        };
        if let Some(c) = &conf
            && c.stop
            && self.stop_fails.contains(name)
        {
            return fail(format!("jail: {name}: /bin/sh -c exec.stop: failed"));
        }
        if conf.as_ref().is_some_and(|c| c.devfs) {
            let dev = jail.path.join("dev");
            if let Some(i) = self
                .mounts
                .iter()
                .rposition(|m| m.target == dev && m.fstype == "devfs")
            {
                self.mounts.remove(i);
            }
        }
        // The vnet dies with the jail; its interfaces return to the host,
        // at once or, for a lingering one, when the dying jail goes.
        let home = self
            .lingering
            .contains(name)
            .then(|| format!("{DYING}{}", jail.jid));
        for i in self.interfaces.iter_mut() {
            if i.vnet.as_deref() == Some(name) {
                i.vnet = home.clone();
                i.addresses.clear();
            }
        }
        self.jails.remove(name);
        if conf.is_some() {
            ok(format!("{name}: removed\n"))
        } else {
            ok("")
        }
    }

    fn jls(&self, args: &[&str]) -> Option<CmdOutput> {
        let mut out = String::from("name jid path\n");
        match args {
            ["-h", "name", "jid", "path"] => {
                let mut jails: Vec<(&String, &Jail)> = self.jails.iter().collect();
                jails.sort_by_key(|(_, j)| j.jid);
                for (name, j) in jails {
                    let _ = writeln!(out, "{name} {} {}", j.jid, j.path.display());
                }
                ok(out)
            }
            // jls.c prints the header before it asks for the jail.
            ["-j", name, "-h", "name", "jid", "path"] => match self.jails.get(*name) {
                Some(j) => {
                    let _ = writeln!(out, "{name} {} {}", j.jid, j.path.display());
                    ok(out)
                }
                None => Some(CmdOutput {
                    status: 1,
                    stdout: out,
                    stderr: format!("jls: jail \"{name}\" not found\n"),
                }),
            },
            _ => None,
        }
    }

    fn ps(&self, args: &[&str]) -> Option<CmdOutput> {
        match args {
            ["-a", "-x", "-o", "jid="] => {
                let mut out = "    0\n".repeat(HOST_PROCESSES);
                for j in self.jails.values() {
                    for _ in 0..j.processes {
                        let _ = writeln!(out, "{:>5}", j.jid);
                    }
                }
                ok(out)
            }
            ["-x", "-o", "jid=", "-J", jid] => {
                let Some(j) = self.jails.values().find(|j| j.jid.to_string() == *jid) else {
                    return fail(format!("ps: Invalid jail id: {jid}"));
                };
                // ps.c exits 1, printing nothing, when no process matched.
                if j.processes == 0 {
                    return Some(CmdOutput {
                        status: 1,
                        stdout: String::new(),
                        stderr: String::new(),
                    });
                }
                ok(format!("{:>5}\n", j.jid).repeat(j.processes))
            }
            _ => None,
        }
    }

    fn jexec(&self, args: &[&str]) -> Option<CmdOutput> {
        let (name, command) = args.split_first()?;
        if command.is_empty() {
            return None;
        }
        if !self.jails.contains_key(*name) {
            return fail(format!("jexec: jail \"{name}\" not found"));
        }
        ok("")
    }

    fn rctl(&mut self, args: &[&str]) -> Option<CmdOutput> {
        let (flag, rules) = args.split_first()?;
        if !self.racct {
            return fail(
                "rctl: RACCT/RCTL present, but disabled; enable using kern.racct.enable=1 tunable",
            );
        }
        match (*flag, rules) {
            ("-r", [filter]) => {
                let removed = self.rctl.remove(*filter).is_some_and(|r| !r.is_empty());
                if removed {
                    ok("")
                } else {
                    fail(format!(
                        "rctl: failed to remove rule '{filter}': No such process"
                    ))
                }
            }
            ("-a", rules) if !rules.is_empty() => {
                // subject:subject-id:resource:action=amount (rctl(8) RULE
                // SYNTAX); a jail subject id is a jail name, which need not
                // exist yet.
                for rule in rules.iter() {
                    let parts: Vec<&str> = rule.split(':').collect();
                    let valid = parts.len() == 4
                        && ["jail", "user", "process", "loginclass"].contains(&parts[0])
                        && !parts[1].is_empty()
                        && !parts[2].is_empty()
                        && parts[3]
                            .split_once('=')
                            .is_some_and(|(a, n)| !a.is_empty() && !n.is_empty());
                    if !valid {
                        return fail(format!(
                            "rctl: failed to add rule '{rule}': Invalid argument"
                        ));
                    }
                }
                for rule in rules.iter() {
                    let subject = rule.splitn(3, ':').take(2).collect::<Vec<_>>().join(":");
                    self.rctl.entry(subject).or_default().push(rule.to_string());
                }
                ok("")
            }
            _ => None,
        }
    }

    // ---- zfs(8) ----

    fn create_dataset(&mut self, name: &str, mountpoint: Option<PathBuf>, quota: Option<u64>) {
        // -p: missing parents inherit their parent's mountpoint (none here).
        let mut parent = name;
        while let Some((p, _)) = parent.rsplit_once('/') {
            self.datasets.entry(p.to_string()).or_insert(Dataset {
                mountpoint: None,
                quota: None,
                used: 0,
            });
            parent = p;
        }
        self.datasets.insert(
            name.to_string(),
            Dataset {
                mountpoint,
                quota,
                used: 0,
            },
        );
    }

    fn zfs(&mut self, args: &[&str]) -> Option<CmdOutput> {
        match args {
            [
                "list",
                "-H",
                "-p",
                "-o",
                "name,used,quota,mountpoint",
                "-t",
                "filesystem",
                "-r",
                root,
            ] => self.zfs_list(root),
            [
                "list",
                "-H",
                "-p",
                "-o",
                "name,used,quota,mountpoint",
                "-t",
                "filesystem",
                names @ ..,
            ] if !names.is_empty() && !names[0].starts_with('-') => self.zfs_list_named(names),
            ["list", "-H", "-o", "name", dataset] => {
                if self.datasets.contains_key(*dataset) || self.snapshots.contains(*dataset) {
                    ok(format!("{dataset}\n"))
                } else {
                    missing(dataset)
                }
            }
            ["clone", "-p", "-o", mountpoint, snapshot, dataset] => {
                let mountpoint = mountpoint.strip_prefix("mountpoint=")?;
                if !self.snapshots.contains(*snapshot) {
                    return missing(snapshot);
                }
                if !self.datasets.contains_key(*dataset) {
                    let root = PathBuf::from(mountpoint);
                    self.create_dataset(dataset, Some(root.clone()), None);
                    for d in BASE_DIRS {
                        self.dirs.insert(root.join(d));
                    }
                }
                ok("")
            }
            ["create", "-p", "-o", mountpoint, rest @ ..] => {
                let mountpoint = mountpoint.strip_prefix("mountpoint=")?;
                let (quota, dataset) = match rest {
                    [dataset] => (None, *dataset),
                    ["-o", quota, dataset] => {
                        (Some(quota.strip_prefix("quota=")?.parse().ok()?), *dataset)
                    }
                    _ => return None,
                };
                if !self.datasets.contains_key(dataset) {
                    self.create_dataset(dataset, Some(PathBuf::from(mountpoint)), quota);
                }
                ok("")
            }
            ["set", property, dataset] => {
                let value = property.strip_prefix("quota=")?;
                let used = self.datasets.get(*dataset).map(|d| d.used);
                let Some(used) = used else {
                    return missing(dataset);
                };
                let quota = match value {
                    "none" => None,
                    q => Some(q.parse::<u64>().ok()?),
                };
                if quota.is_some_and(|q| q < used) {
                    return fail(format!(
                        "cannot set property for '{dataset}': size is less than current used or reserved space"
                    ));
                }
                if let Some(d) = self.datasets.get_mut(*dataset) {
                    d.quota = quota;
                }
                ok("")
            }
            ["get", "-H", "-p", "-o", "value", "used", dataset] => {
                match self.datasets.get(*dataset) {
                    Some(d) => ok(format!("{}\n", d.used)),
                    None => missing(dataset),
                }
            }
            ["destroy", "-r", dataset] => self.zfs_destroy(dataset, true),
            ["destroy", dataset] => self.zfs_destroy(dataset, false),
            _ => None,
        }
    }

    fn zfs_list(&self, root: &str) -> Option<CmdOutput> {
        if !self.datasets.contains_key(root) {
            return missing(root);
        }
        let prefix = format!("{root}/");
        let mut out = String::new();
        for (name, d) in &self.datasets {
            if name != root && !name.starts_with(&prefix) {
                continue;
            }
            list_line(&mut out, name, d);
        }
        ok(out)
    }

    /// zfs_for_each: the datasets it could open, sorted by name, and exit 1
    /// with libzfs's message for each name it could not.
    fn zfs_list_named(&self, names: &[&str]) -> Option<CmdOutput> {
        let mut found: Vec<&str> = Vec::new();
        let mut stderr = String::new();
        for name in names {
            if self.datasets.contains_key(*name) {
                found.push(name);
            } else {
                let _ = writeln!(stderr, "cannot open '{name}': dataset does not exist");
            }
        }
        found.sort_unstable();
        found.dedup();
        let mut out = String::new();
        for name in found {
            let d = &self.datasets[name];
            list_line(&mut out, name, d);
        }
        Some(CmdOutput {
            status: i32::from(!stderr.is_empty()),
            stdout: out,
            stderr,
        })
    }

    fn zfs_destroy(&mut self, dataset: &str, recursive: bool) -> Option<CmdOutput> {
        if !self.datasets.contains_key(dataset) {
            return missing(dataset);
        }
        let prefix = format!("{dataset}/");
        let snap_prefix = format!("{dataset}@");
        let children: Vec<String> = self
            .datasets
            .keys()
            .filter(|n| n.starts_with(&prefix))
            .cloned()
            .chain(
                self.snapshots
                    .iter()
                    .filter(|s| s.starts_with(&snap_prefix))
                    .cloned(),
            )
            .collect();
        if !recursive && !children.is_empty() {
            return fail(format!(
                "cannot destroy '{dataset}': filesystem has children\nuse '-r' to destroy the following datasets:\n{}",
                children.join("\n")
            ));
        }
        // zfs unmounts each filesystem first: a mount below its mountpoint, a
        // nullfs mount of it elsewhere, or a jail rooted in it keeps it busy.
        let doomed: Vec<String> = std::iter::once(dataset.to_string())
            .chain(children.iter().filter(|c| !c.contains('@')).cloned())
            .collect();
        for name in &doomed {
            let Some(mp) = self.datasets.get(name).and_then(|d| d.mountpoint.clone()) else {
                continue;
            };
            let busy = self
                .mounts
                .iter()
                .any(|m| m.target.starts_with(&mp) || m.source.starts_with(&mp))
                || self.jails.values().any(|j| j.path.starts_with(&mp));
            if busy {
                return fail(format!(
                    "cannot unmount '{}': pool or dataset is busy",
                    mp.display()
                ));
            }
        }
        for name in &doomed {
            if let Some(mp) = self.datasets.remove(name).and_then(|d| d.mountpoint) {
                self.dirs.retain(|d| !d.starts_with(&mp));
            }
        }
        self.snapshots.retain(|s| !s.starts_with(&snap_prefix));
        ok("")
    }

    // ---- mkdir(1), mount(8), umount(8) ----

    /// A directory exists when made by mkdir or a base, when it is a
    /// mounted dataset's mountpoint, or when something below it exists.
    fn dir_exists(&self, path: &Path) -> bool {
        self.dirs.iter().any(|d| d.starts_with(path))
            || self
                .datasets
                .values()
                .filter_map(|d| d.mountpoint.as_ref())
                .any(|m| m.starts_with(path))
    }

    fn mkdir(&mut self, args: &[&str]) -> Option<CmdOutput> {
        let ["-p", path] = args else { return None };
        self.dirs.insert(PathBuf::from(path));
        ok("")
    }

    fn mount(&mut self, args: &[&str]) -> Option<CmdOutput> {
        match args {
            // The host's own devfs on /dev comes first, as on every FreeBSD
            // host; then the jails' (the format of jail_remove_forced.txt).
            ["-p", "-t", "devfs"] => {
                let mut out = String::from("devfs\t\t\t/dev\t\t\tdevfs\trw,multilabel \t0 0\n");
                for m in self.mounts.iter().filter(|m| m.fstype == "devfs") {
                    let _ = writeln!(
                        out,
                        "devfs\t\t\t{} devfs\trw,multilabel \t0 0",
                        m.target.display()
                    );
                }
                ok(out)
            }
            ["-p", "-t", "nullfs"] => {
                let mut out = String::new();
                for m in self.mounts.iter().filter(|m| m.fstype == "nullfs") {
                    let _ = writeln!(
                        out,
                        "{}\t{}\tnullfs\trw\t\t0 0",
                        m.source.display(),
                        m.target.display()
                    );
                }
                ok(out)
            }
            ["-t", "nullfs", source, target] => {
                for dir in [source, target] {
                    if !self.dir_exists(Path::new(dir)) {
                        return fail(format!("mount_nullfs: {dir}: No such file or directory"));
                    }
                }
                self.mounts.push(Mount {
                    source: PathBuf::from(source),
                    target: PathBuf::from(target),
                    fstype: "nullfs",
                });
                ok("")
            }
            _ => None,
        }
    }

    fn umount(&mut self, args: &[&str]) -> Option<CmdOutput> {
        let [target] = args else { return None };
        let path = Path::new(target);
        let Some(i) = self.mounts.iter().rposition(|m| m.target == path) else {
            let why = if self.dir_exists(path) {
                "not a file system root directory"
            } else {
                "not currently mounted"
            };
            return fail(format!("umount: {target}: {why}"));
        };
        let below = self
            .mounts
            .iter()
            .any(|m| m.target != path && m.target.starts_with(path));
        if below {
            return fail(format!("umount: unmount of {target} failed: Device busy"));
        }
        self.mounts.remove(i);
        ok("")
    }

    // ---- ifconfig(8), route(8), netstat(1) ----

    fn host_iface(&self, name: &str) -> Option<usize> {
        self.interfaces
            .iter()
            .position(|i| i.name == name && i.vnet.is_none())
    }

    fn add_interface(&mut self, name: String, peer: Option<String>) {
        self.interfaces.push(Interface {
            name,
            vnet: None,
            peer,
            addresses: Vec::new(),
            up: false,
        });
    }

    fn ifconfig(&mut self, args: &[&str]) -> Option<CmdOutput> {
        match args {
            ["-l"] => {
                let names: Vec<&str> = self
                    .interfaces
                    .iter()
                    .filter(|i| i.vnet.is_none())
                    .map(|i| i.name.as_str())
                    .collect();
                ok(format!("{}\n", names.join(" ")))
            }
            ["epair", "create"] => {
                let unit = self.next_epair;
                self.next_epair += 1;
                let (a, b) = (format!("epair{unit}a"), format!("epair{unit}b"));
                self.add_interface(a.clone(), Some(b.clone()));
                self.add_interface(b, Some(a.clone()));
                ok(format!("{a}\n"))
            }
            ["bridge", "create"] => {
                let name = format!("bridge{}", self.next_bridge);
                self.next_bridge += 1;
                self.add_interface(name.clone(), None);
                ok(format!("{name}\n"))
            }
            [iface, "-vnet", jail] => self.reclaim_from_vnet(iface, jail),
            [iface, rest @ ..] => {
                let Some(i) = self.host_iface(iface) else {
                    return fail(format!("ifconfig: interface {iface} does not exist"));
                };
                self.ifconfig_on(i, rest)
            }
            _ => None,
        }
    }

    fn ifconfig_on(&mut self, i: usize, args: &[&str]) -> Option<CmdOutput> {
        let iface = self.interfaces[i].name.clone();
        match args {
            ["name", new] => {
                // Names are per vnet: only the host's interfaces clash.
                if self.host_iface(new).is_some() {
                    return fail("ifconfig: ioctl SIOCSIFNAME (set name): File exists");
                }
                let new = new.to_string();
                for other in self.interfaces.iter_mut() {
                    if other.peer.as_deref() == Some(iface.as_str()) {
                        other.peer = Some(new.clone());
                    }
                }
                self.interfaces[i].name = new.clone();
                ok(format!("{new}\n"))
            }
            ["destroy"] => {
                // Destroying either end of an epair destroys both.
                let peer = self.interfaces[i].peer.clone();
                self.interfaces
                    .retain(|x| x.name != iface && Some(&x.name) != peer.as_ref());
                ok("")
            }
            ["up"] => {
                self.interfaces[i].up = true;
                ok("")
            }
            ["addm", member] => {
                if self.host_iface(member).is_none() {
                    return fail(format!(
                        "ifconfig: BRDGADD {member}: No such file or directory"
                    ));
                }
                ok("")
            }
            ["vnet", jail] => {
                if !self.jails.contains_key(*jail) {
                    return fail(format!("ifconfig: jail \"{jail}\" not found"));
                }
                self.interfaces[i].vnet = Some(jail.to_string());
                ok("")
            }
            ["inet"] => ok(self.render_inet(i)),
            ["inet", cidr, "up"] => {
                let net: Ipv4Net = cidr.parse().ok()?;
                let x = &mut self.interfaces[i];
                // Without `alias` the first address is replaced.
                if x.addresses.is_empty() {
                    x.addresses.push((net.addr(), net.prefix_len()));
                } else {
                    x.addresses[0] = (net.addr(), net.prefix_len());
                }
                x.up = true;
                ok("")
            }
            ["inet", cidr, "alias"] => {
                let net: Ipv4Net = cidr.parse().ok()?;
                let x = &mut self.interfaces[i];
                if x.addresses.iter().any(|(a, _)| *a == net.addr()) {
                    return fail("ifconfig: ioctl (SIOCAIFADDR): File exists");
                }
                x.addresses.push((net.addr(), net.prefix_len()));
                ok("")
            }
            ["inet", addr, "-alias"] => {
                let addr: Ipv4Addr = addr.parse().ok()?;
                let x = &mut self.interfaces[i];
                let Some(at) = x.addresses.iter().position(|(a, _)| *a == addr) else {
                    return fail("ifconfig: ioctl (SIOCDIFADDR): Can't assign requested address");
                };
                x.addresses.remove(at);
                ok("")
            }
            _ => None,
        }
    }

    /// `ifconfig IF -vnet JAIL` (setifrvnet in ifconfig.c): the jail must
    /// exist, and the kernel finds IF in that jail's vnet or answers ENXIO.
    fn reclaim_from_vnet(&mut self, iface: &str, jail: &str) -> Option<CmdOutput> {
        let Some(jid) = self.jails.get(jail).map(|j| j.jid) else {
            return fail(format!("ifconfig: jail \"{jail}\" not found"));
        };
        let Some(x) = self
            .interfaces
            .iter_mut()
            .find(|x| x.name == iface && x.vnet.as_deref() == Some(jail))
        else {
            return fail(format!(
                "ifconfig: SIOCSIFRVNET({jid}, {iface}): Device not configured"
            ));
        };
        x.vnet = None;
        x.addresses.clear();
        ok("")
    }

    fn render_inet(&self, i: usize) -> String {
        let x = &self.interfaces[i];
        let flags = if x.up {
            "flags=1008843<UP,BROADCAST,RUNNING,SIMPLEX,MULTICAST,LOWER_UP>"
        } else {
            "flags=1008802<BROADCAST,SIMPLEX,MULTICAST,LOWER_UP>"
        };
        let mut out = format!("{}: {flags} metric 0 mtu 1500\n\toptions=0\n", x.name);
        for (addr, prefix) in &x.addresses {
            let mask = netmask(*prefix);
            let broadcast = Ipv4Addr::from(u32::from(*addr) | !mask);
            let _ = writeln!(
                out,
                "\tinet {addr} netmask {mask:#010x} broadcast {broadcast}"
            );
        }
        out
    }

    fn route(&mut self, args: &[&str]) -> Option<CmdOutput> {
        match args {
            ["-n", "add", "-net", dest, gateway] => {
                let net: Ipv4Net = dest.parse().ok()?;
                let gw: Ipv4Addr = gateway.parse().ok()?;
                let shown = net.addr();
                if self.routes.contains_key(&net) {
                    return fail_stdout(format!(
                        "add net {shown}: gateway {gw} fib 0: route already in table"
                    ));
                }
                self.routes.insert(net, gw);
                ok(format!("add net {shown}: gateway {gw}\n"))
            }
            ["-n", "delete", "-net", dest] => {
                let net: Ipv4Net = dest.parse().ok()?;
                let shown = net.addr();
                if self.routes.remove(&net).is_none() {
                    return fail_stdout(format!("delete net {shown}: not in table"));
                }
                ok(format!("delete net {shown}\n"))
            }
            _ => None,
        }
    }

    fn netstat(&self, args: &[&str]) -> Option<CmdOutput> {
        if args != ["-rn", "-4", "--libxo", "json"] {
            return None;
        }
        let mut entries = vec![(
            "default".to_string(),
            "192.168.1.1".to_string(),
            "UGS",
            "em0".to_string(),
        )];
        for x in self.interfaces.iter().filter(|x| x.vnet.is_none()) {
            for (addr, prefix) in x.addresses.iter().filter(|(_, p)| *p < 32) {
                let net = Ipv4Addr::from(u32::from(*addr) & netmask(*prefix));
                entries.push((
                    format!("{net}/{prefix}"),
                    "link#4".into(),
                    "U",
                    x.name.clone(),
                ));
            }
        }
        for (net, gw) in &self.routes {
            entries.push((net.to_string(), gw.to_string(), "UGS", "em0".into()));
        }
        let rendered: Vec<String> = entries
            .iter()
            .map(|(d, g, f, i)| {
                format!(
                    "{{\"destination\": \"{d}\", \"gateway\": \"{g}\", \"flags\": \"{f}\", \"interface-name\": \"{i}\"}}"
                )
            })
            .collect();
        ok(format!(
            "{{\"statistics\": {{\"route-information\": {{\"route-table\": {{\"rt-family\": [{{\"address-family\": \"Internet\", \"rt-entry\": [\n{}\n]}}]}}}}}}}}\n",
            rendered.join(",\n")
        ))
    }

    // ---- pfctl(8), sysctl(8) ----

    fn pfctl(&mut self, args: &[&str], stdin: Option<&str>) -> Option<CmdOutput> {
        match args {
            ["-a", anchor, "-f", "-"] => {
                self.anchors
                    .insert(anchor.to_string(), stdin.unwrap_or_default().to_string());
                ok("")
            }
            ["-a", anchor, "-F", "all"] => {
                self.anchors.remove(*anchor);
                Some(CmdOutput {
                    status: 0,
                    stdout: String::new(),
                    stderr: "rules cleared\nnat cleared\n0 tables deleted.\n".into(),
                })
            }
            ["-s", "nat"] => ok(if self.pf_references_keel {
                "rdr-anchor \"keel/*\" all\n"
            } else {
                ""
            }),
            ["-s", "rules"] => ok(if self.pf_references_keel {
                "anchor \"keel/*\" all\npass in all flags S/SA keep state\n"
            } else {
                "pass in all flags S/SA keep state\n"
            }),
            _ => None,
        }
    }

    fn sysctl(&self, args: &[&str]) -> Option<CmdOutput> {
        match args {
            ["-n", "hw.ncpu", "hw.physmem"] => ok("8\n17083187200\n"),
            ["-n", "kern.features.vimage", "kern.racct.enable"] => {
                ok(format!("1\n{}\n", u8::from(self.racct)))
            }
            _ => None,
        }
    }
}

/// One line of `zfs list -H -p -o name,used,quota,mountpoint`.
fn list_line(out: &mut String, name: &str, d: &Dataset) {
    let mountpoint = d
        .mountpoint
        .as_ref()
        .map_or_else(|| "none".to_string(), |m| m.display().to_string());
    let _ = writeln!(
        out,
        "{name}\t{}\t{}\t{mountpoint}",
        d.used,
        d.quota.unwrap_or(0)
    );
}

fn missing(dataset: &str) -> Option<CmdOutput> {
    fail(format!("cannot open '{dataset}': dataset does not exist"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::cmd::argv;

    const BASE: &str = "zroot/keel/bases/14.2-RELEASE";
    const ROOT: &str = "/usr/local/keel/jails/web-1";

    fn host() -> ScriptedHost {
        let h = ScriptedHost::new(CommandPaths::default(), "zroot");
        h.add_base(BASE, Path::new("/usr/local/keel/bases/14.2-RELEASE"));
        h
    }

    fn run(h: &ScriptedHost, words: &[&str]) -> CmdOutput {
        h.run(&argv(words), None, Duration::from_secs(1))
            .expect("a modelled command")
    }

    fn refused(h: &ScriptedHost, words: &[&str], text: &str) {
        let out = run(h, words);
        assert_eq!(out.status, 1, "{words:?} should be refused: {out:?}");
        let said = format!("{}{}", out.stdout, out.stderr);
        assert!(
            said.contains(text),
            "{words:?}: expected `{text}` in `{said}`"
        );
    }

    fn clone_rootfs(h: &ScriptedHost) {
        let out = run(
            h,
            &[
                "/sbin/zfs",
                "clone",
                "-p",
                "-o",
                &format!("mountpoint={ROOT}"),
                &format!("{BASE}@keel"),
                "zroot/keel/jails/web-1",
            ],
        );
        assert!(out.success(), "{out:?}");
    }

    fn epair(h: &ScriptedHost) {
        for words in [
            &["/sbin/ifconfig", "epair", "create"][..],
            &["/sbin/ifconfig", "epair0a", "name", "kh_web-1"],
            &["/sbin/ifconfig", "epair0b", "name", "kj_web-1"],
        ] {
            assert!(run(h, words).success(), "{words:?}");
        }
    }

    /// Writes a jail.conf like Keel's and returns its path.
    fn conf(dir: &Path, name: &str, stop: bool) -> String {
        let path = dir.join(format!("{name}.conf"));
        let stop = if stop {
            "\texec.stop = \"/bin/sh /etc/rc.shutdown\";\n"
        } else {
            ""
        };
        std::fs::write(
            &path,
            format!(
                "\"{name}\" {{\n\tpath = \"{ROOT}\";\n\tpersist;\n\tvnet;\n\tvnet.interface = \"kj_web-1\";\n\tmount.devfs;\n\texec.start = \"/usr/sbin/daemon -f -o /var/log/keel-start.log /bin/sleep 300\";\n{stop}}}\n"
            ),
        )
        .expect("conf");
        path.display().to_string()
    }

    fn created(h: &ScriptedHost, dir: &Path) -> String {
        clone_rootfs(h);
        epair(h);
        let conf = conf(dir, "web-1", true);
        let out = run(h, &["/usr/sbin/jail", "-f", &conf, "-c", "web-1"]);
        assert_eq!(out.stdout, "web-1: created\n", "{out:?}");
        conf
    }

    #[test]
    fn a_created_jail_runs_its_workload_in_its_vnet_with_devfs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = host();
        created(&h, dir.path());
        assert_eq!(
            run(&h, &["/usr/sbin/jls", "-h", "name", "jid", "path"]).stdout,
            format!("name jid path\nweb-1 1 {ROOT}\n")
        );
        assert_eq!(
            run(&h, &["/bin/ps", "-a", "-x", "-o", "jid="]).stdout,
            "    0\n    0\n    0\n    1\n"
        );
        assert_eq!(
            run(&h, &["/sbin/ifconfig", "-l"]).stdout,
            "em0 lo0 pflog0 kh_web-1\n"
        );
        assert_eq!(
            h.mounts(),
            [("devfs".to_string(), PathBuf::from(ROOT).join("dev"))]
        );
        h.crash("web-1");
        assert_eq!(
            run(&h, &["/bin/ps", "-a", "-x", "-o", "jid="]).stdout,
            "    0\n    0\n    0\n",
            "a persist jail outlives its workload"
        );
        assert_eq!(h.jails(), ["web-1"]);
    }

    #[test]
    fn removal_with_the_conf_returns_the_interface_and_unmounts_devfs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = host();
        let conf = created(&h, dir.path());
        let out = run(&h, &["/usr/sbin/jail", "-f", &conf, "-r", "web-1"]);
        assert_eq!(out.stdout, "web-1: removed\n");
        assert!(h.mounts().is_empty());
        assert!(h.interfaces().contains(&("kj_web-1".to_string(), None)));
    }

    #[test]
    fn removal_without_the_conf_leaves_devfs_mounted_and_the_rootfs_busy() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = host();
        created(&h, dir.path());
        assert!(run(&h, &["/usr/sbin/jail", "-R", "web-1"]).success());
        assert_eq!(h.mounts().len(), 1, "jail -R knows no mount.devfs");
        refused(
            &h,
            &["/sbin/zfs", "destroy", "-r", "zroot/keel/jails/web-1"],
            &format!("cannot unmount '{ROOT}': pool or dataset is busy"),
        );
        assert!(run(&h, &["/sbin/umount", &format!("{ROOT}/dev")]).success());
        assert!(
            run(
                &h,
                &["/sbin/zfs", "destroy", "-r", "zroot/keel/jails/web-1"]
            )
            .success()
        );
    }

    #[test]
    fn refuses_cloning_a_missing_snapshot() {
        let h = ScriptedHost::new(CommandPaths::default(), "zroot");
        refused(
            &h,
            &[
                "/sbin/zfs",
                "clone",
                "-p",
                "-o",
                "mountpoint=/j/web-1",
                "zroot/keel/bases/14.2-RELEASE@keel",
                "zroot/keel/jails/web-1",
            ],
            "cannot open 'zroot/keel/bases/14.2-RELEASE@keel': dataset does not exist",
        );
    }

    #[test]
    fn refuses_destroying_a_dataset_with_a_volume_mounted_below() {
        let h = host();
        clone_rootfs(&h);
        let volume = "/usr/local/keel/volumes/data";
        assert!(
            run(
                &h,
                &[
                    "/sbin/zfs",
                    "create",
                    "-p",
                    "-o",
                    &format!("mountpoint={volume}"),
                    "zroot/keel/volumes/data"
                ]
            )
            .success()
        );
        let target = format!("{ROOT}/var/db/data");
        assert!(run(&h, &["/bin/mkdir", "-p", &target]).success());
        assert!(run(&h, &["/sbin/mount", "-t", "nullfs", volume, &target]).success());
        refused(
            &h,
            &["/sbin/zfs", "destroy", "-r", "zroot/keel/jails/web-1"],
            "pool or dataset is busy",
        );
        refused(
            &h,
            &["/sbin/zfs", "destroy", "zroot/keel/volumes/data"],
            &format!("cannot unmount '{volume}': pool or dataset is busy"),
        );
    }

    #[test]
    fn refuses_destroying_a_missing_dataset_or_one_with_children_without_r() {
        let h = host();
        refused(
            &h,
            &["/sbin/zfs", "destroy", "-r", "zroot/keel/jails/web-1"],
            "cannot open 'zroot/keel/jails/web-1': dataset does not exist",
        );
        refused(
            &h,
            &["/sbin/zfs", "destroy", BASE],
            "filesystem has children",
        );
    }

    #[test]
    fn refuses_creating_a_jail_that_exists_or_has_an_all_digit_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = host();
        let conf = created(&h, dir.path());
        refused(
            &h,
            &["/usr/sbin/jail", "-f", &conf, "-c", "web-1"],
            "jail: \"web-1\" already exists",
        );
        let digits = conf_named(dir.path(), "123");
        refused(
            &h,
            &["/usr/sbin/jail", "-f", &digits, "-c", "123"],
            "name cannot be numeric",
        );
    }

    fn conf_named(dir: &Path, name: &str) -> String {
        let path = dir.join(format!("{name}.conf"));
        std::fs::write(
            &path,
            format!("\"{name}\" {{\n\tpath = \"{ROOT}\";\n\tpersist;\n}}\n"),
        )
        .expect("conf");
        path.display().to_string()
    }

    #[test]
    fn refuses_creating_a_jail_whose_interface_is_in_another_vnet_or_missing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = host();
        created(&h, dir.path());
        // A second jail naming the same kj_ end: it is in web-1's vnet.
        let path = dir.path().join("web-2.conf");
        std::fs::write(
            &path,
            format!("\"web-2\" {{\n\tpath = \"{ROOT}\";\n\tvnet;\n\tvnet.interface = \"kj_web-1\";\n}}\n"),
        )
        .expect("conf");
        let conf = path.display().to_string();
        refused(
            &h,
            &["/usr/sbin/jail", "-f", &conf, "-c", "web-2"],
            "ifconfig: interface kj_web-1 does not exist",
        );
        refused(
            &h,
            &["/sbin/ifconfig", "kj_web-1", "vnet", "web-1"],
            "interface kj_web-1 does not exist",
        );
        assert_eq!(h.jails(), ["web-1"]);
    }

    #[test]
    fn refuses_creating_a_jail_on_a_missing_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = host();
        epair(&h);
        let conf = conf(dir.path(), "web-1", false);
        refused(
            &h,
            &["/usr/sbin/jail", "-f", &conf, "-c", "web-1"],
            &format!("jail: web-1: path {ROOT}: No such file or directory"),
        );
    }

    #[test]
    fn refuses_removing_an_unknown_jail_and_keeps_one_whose_stop_fails() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = host();
        refused(
            &h,
            &["/usr/sbin/jail", "-r", "web-1"],
            "jail: \"web-1\" not found",
        );
        refused(
            &h,
            &["/usr/sbin/jail", "-R", "web-1"],
            "jail: \"web-1\" not found",
        );
        let conf = created(&h, dir.path());
        h.fail_exec_stop("web-1");
        refused(
            &h,
            &["/usr/sbin/jail", "-f", &conf, "-r", "web-1"],
            "failed",
        );
        assert_eq!(h.jails(), ["web-1"], "a failed exec.stop keeps the jail");
        assert!(run(&h, &["/usr/sbin/jail", "-R", "web-1"]).success());
        assert!(h.jails().is_empty());
    }

    #[test]
    fn reclaims_an_interface_only_from_the_vnet_holding_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = host();
        refused(
            &h,
            &["/sbin/ifconfig", "kj_web-1", "-vnet", "web-1"],
            "ifconfig: jail \"web-1\" not found",
        );
        created(&h, dir.path());
        refused(
            &h,
            &["/sbin/ifconfig", "kh_web-1", "-vnet", "web-1"],
            "SIOCSIFRVNET(1, kh_web-1): Device not configured",
        );
        assert!(run(&h, &["/sbin/ifconfig", "kj_web-1", "-vnet", "web-1"]).success());
        assert!(h.interfaces().contains(&("kj_web-1".to_string(), None)));
    }

    #[test]
    fn a_dying_vnet_keeps_the_jail_end_until_the_epair_is_destroyed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = host();
        let conf = created(&h, dir.path());
        h.linger_on_removal("web-1");
        assert!(run(&h, &["/usr/sbin/jail", "-f", &conf, "-r", "web-1"]).success());
        assert_eq!(
            run(&h, &["/sbin/ifconfig", "-l"]).stdout,
            "em0 lo0 pflog0 kh_web-1\n"
        );
        refused(
            &h,
            &["/sbin/ifconfig", "kj_web-1", "-vnet", "web-1"],
            "jail \"web-1\" not found",
        );
        refused(
            &h,
            &["/usr/sbin/jail", "-f", &conf, "-c", "web-1"],
            "ifconfig: interface kj_web-1 does not exist",
        );
        // Destroying the host end takes the jail end with it, wherever it is.
        assert!(run(&h, &["/sbin/ifconfig", "kh_web-1", "destroy"]).success());
        assert!(!h.interfaces().iter().any(|(n, _)| n == "kj_web-1"));
        assert_eq!(
            run(&h, &["/sbin/ifconfig", "epair", "create"]).stdout,
            "epair1a\n"
        );
        assert!(run(&h, &["/sbin/ifconfig", "epair1a", "name", "kh_web-1"]).success());
        assert!(run(&h, &["/sbin/ifconfig", "epair1b", "name", "kj_web-1"]).success());
        assert!(run(&h, &["/usr/sbin/jail", "-f", &conf, "-c", "web-1"]).success());
    }

    #[test]
    fn reclaiming_before_removal_beats_a_dying_vnet() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = host();
        let conf = created(&h, dir.path());
        h.linger_on_removal("web-1");
        assert!(run(&h, &["/sbin/ifconfig", "kj_web-1", "-vnet", "web-1"]).success());
        assert!(run(&h, &["/usr/sbin/jail", "-f", &conf, "-r", "web-1"]).success());
        assert!(h.interfaces().contains(&("kj_web-1".to_string(), None)));
        assert!(run(&h, &["/usr/sbin/jail", "-f", &conf, "-c", "web-1"]).success());
        h.release_dying();
        assert_eq!(h.jails(), ["web-1"]);
    }

    #[test]
    fn refuses_renaming_onto_a_taken_name_and_commands_on_missing_interfaces() {
        let h = host();
        epair(&h);
        assert_eq!(
            run(&h, &["/sbin/ifconfig", "epair", "create"]).stdout,
            "epair1a\n"
        );
        refused(
            &h,
            &["/sbin/ifconfig", "epair1a", "name", "kh_web-1"],
            "SIOCSIFNAME (set name): File exists",
        );
        refused(
            &h,
            &["/sbin/ifconfig", "keel0", "addm", "kh_web-1"],
            "ifconfig: interface keel0 does not exist",
        );
        assert!(run(&h, &["/sbin/ifconfig", "kh_web-1", "destroy"]).success());
        refused(
            &h,
            &["/sbin/ifconfig", "kj_web-1", "destroy"],
            "interface kj_web-1 does not exist",
        );
    }

    #[test]
    fn refuses_nullfs_onto_a_missing_directory_and_unmounting_what_is_not_mounted() {
        let h = host();
        clone_rootfs(&h);
        let target = format!("{ROOT}/var/db/data");
        refused(
            &h,
            &[
                "/sbin/mount",
                "-t",
                "nullfs",
                "/usr/local/keel/bases/14.2-RELEASE",
                &target,
            ],
            &format!("mount_nullfs: {target}: No such file or directory"),
        );
        refused(&h, &["/sbin/umount", &target], "not currently mounted");
        refused(
            &h,
            &["/sbin/umount", &format!("{ROOT}/var")],
            "not a file system root directory",
        );
    }

    #[test]
    fn refuses_unmounting_below_another_mount() {
        let h = host();
        clone_rootfs(&h);
        let (outer, inner) = (format!("{ROOT}/var"), format!("{ROOT}/var/log"));
        let src = "/usr/local/keel/bases/14.2-RELEASE";
        assert!(run(&h, &["/sbin/mount", "-t", "nullfs", src, &outer]).success());
        assert!(run(&h, &["/sbin/mount", "-t", "nullfs", src, &inner]).success());
        refused(&h, &["/sbin/umount", &outer], "Device busy");
        assert!(run(&h, &["/sbin/umount", &inner]).success());
        assert!(run(&h, &["/sbin/umount", &outer]).success());
    }

    #[test]
    fn refuses_adding_an_existing_route_and_deleting_an_absent_one() {
        let h = host();
        let add = [
            "/sbin/route",
            "-n",
            "add",
            "-net",
            "10.1.2.0/24",
            "10.0.0.2",
        ];
        assert_eq!(run(&h, &add).stdout, "add net 10.1.2.0: gateway 10.0.0.2\n");
        refused(
            &h,
            &add,
            "add net 10.1.2.0: gateway 10.0.0.2 fib 0: route already in table",
        );
        let delete = ["/sbin/route", "-n", "delete", "-net", "10.1.2.0/24"];
        assert!(run(&h, &delete).success());
        refused(&h, &delete, "delete net 10.1.2.0: not in table");
    }

    #[test]
    fn refuses_removing_absent_aliases_and_adding_present_ones() {
        let h = host();
        assert!(run(&h, &["/sbin/ifconfig", "bridge", "create"]).success());
        assert!(run(&h, &["/sbin/ifconfig", "bridge0", "name", "keel0"]).success());
        assert!(
            run(
                &h,
                &["/sbin/ifconfig", "keel0", "inet", "10.20.3.1/24", "up"]
            )
            .success()
        );
        let alias = ["/sbin/ifconfig", "keel0", "inet", "10.96.0.7/32", "alias"];
        assert!(run(&h, &alias).success());
        refused(&h, &alias, "File exists");
        assert_eq!(
            run(&h, &["/sbin/ifconfig", "keel0", "inet"]).stdout,
            "keel0: flags=1008843<UP,BROADCAST,RUNNING,SIMPLEX,MULTICAST,LOWER_UP> metric 0 mtu 1500\n\toptions=0\n\tinet 10.20.3.1 netmask 0xffffff00 broadcast 10.20.3.255\n\tinet 10.96.0.7 netmask 0xffffffff broadcast 10.96.0.7\n"
        );
        let remove = ["/sbin/ifconfig", "keel0", "inet", "10.96.0.7", "-alias"];
        assert!(run(&h, &remove).success());
        refused(&h, &remove, "Can't assign requested address");
    }

    #[test]
    fn rctl_takes_rules_for_a_jail_not_created_yet_and_refuses_removing_none() {
        let h = host();
        refused(
            &h,
            &["/usr/bin/rctl", "-r", "jail:web-1"],
            "No such process",
        );
        assert!(run(&h, &["/usr/bin/rctl", "-a", "jail:web-1:pcpu:deny=150"]).success());
        assert_eq!(h.rctl_rules("web-1"), ["jail:web-1:pcpu:deny=150"]);
        assert!(run(&h, &["/usr/bin/rctl", "-r", "jail:web-1"]).success());
        h.set_racct_enabled(false);
        refused(
            &h,
            &["/usr/bin/rctl", "-r", "jail:web-1"],
            "RACCT/RCTL present, but disabled",
        );
    }

    #[test]
    fn a_workload_started_before_its_rctl_rules_is_noted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let h = host();
        let conf = created(&h, dir.path());
        assert!(h.started_without_limits("web-1"));
        assert!(run(&h, &["/usr/sbin/jail", "-f", &conf, "-r", "web-1"]).success());
        assert!(
            run(
                &h,
                &["/usr/bin/rctl", "-a", "jail:web-1:memoryuse:deny=1024"]
            )
            .success()
        );
        assert!(run(&h, &["/usr/sbin/jail", "-f", &conf, "-c", "web-1"]).success());
        assert!(!h.started_without_limits("web-1"));
    }

    #[test]
    fn unmodelled_commands_are_unexpected() {
        let h = host();
        let err = h
            .run(
                &argv(&["/sbin/zfs", "rollback", BASE]),
                None,
                Duration::from_secs(1),
            )
            .expect_err("not modelled");
        assert!(matches!(err, CmdError::Unexpected { .. }), "{err}");
    }
}
