//! Host-side networking: the `keel0` bridge and its gateway address, one
//! epair(4) per jail, kernel routes to peer nodes' subnets, and /32 service VIP
//! aliases on the bridge.
//!
//! Interface names come from [`crate::host::iface_names`]. The jail side of an
//! epair is configured by jail(8) from the jail's jail.conf (see
//! [`crate::host::jail`]); this module handles the host side, and brings the
//! jail side home before a jail is removed ([`NetManager::reclaim`]): jail(8)
//! gives `vnet.interface` back only when the jail's vnet is destroyed, and a
//! jail that lingers as dying keeps its vnet, and the interface in it, for as
//! long as it lingers. It never
//! touches an interface, route or address Keel did not name: the admin's own
//! network configuration is out of bounds.
//!
//! [`FreeBsdNet`] runs ifconfig(8), route(8) and netstat(1) (formats in
//! `reference/freebsd.md` sections 7 and 8); [`FakeNet`] keeps the same state
//! in memory. Outcomes FreeBSD reports as failures but that mean "already as
//! asked" (route already in table, interface already gone, alias absent) are
//! success, so every mutating call here is idempotent.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::cidr::Ipv4Net;
use crate::common::cmd::{CmdError, CmdOutput, CommandRunner, argv, render_argv};
use crate::common::config::CommandPaths;
use crate::host::fake::{CallLog, Faults, lock};
use crate::host::iface_names;

/// Both ends of a jail's epair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Epair {
    /// Host end, member of the bridge (`kh_...`).
    pub host: String,
    /// Jail end, moved into the jail's vnet (`kj_...`).
    pub jail: String,
}

/// One IPv4 route as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Destination prefix (a host route is a /32).
    pub destination: Ipv4Net,
    /// Gateway address, or `link#N` for connected routes.
    pub gateway: String,
}

/// A networking operation that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetError {
    /// A command failed or could not run.
    Command(CmdError),
    /// Output that does not match the documented format.
    Parse {
        /// The command.
        command: String,
        /// What was wrong.
        reason: String,
    },
}

impl fmt::Display for NetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetError::Command(e) => write!(f, "{e}"),
            NetError::Parse { command, reason } => {
                write!(f, "could not read the output of `{command}`: {reason}")
            }
        }
    }
}

impl std::error::Error for NetError {}

impl From<CmdError> for NetError {
    fn from(e: CmdError) -> Self {
        NetError::Command(e)
    }
}

/// Bridge, epairs, routes and aliases.
pub trait NetManager: Send {
    /// Names of every interface on the host, in one call (`ifconfig -l`).
    fn list_interfaces(&self) -> Result<Vec<String>, NetError>;
    /// Those of `names` that are on the host, in the order of `names`. What
    /// an apply observes (the bridge, its jail's epair): only these names
    /// are kept, so what it holds does not follow the number of interfaces.
    fn find_interfaces(&self, names: &[&str]) -> Result<Vec<String>, NetError>;
    /// Creates the bridge if missing and gives it `gateway` (address/prefix,
    /// e.g. 10.20.3.1/24); idempotent.
    fn ensure_bridge(&self, bridge: &str, gateway: Ipv4Net) -> Result<(), NetError>;
    /// Creates the jail's epair, names both ends, adds the host end to the
    /// bridge and brings it up. Leftovers of a crash with the same names are
    /// destroyed first.
    fn attach(&self, bridge: &str, jail: &str) -> Result<Epair, NetError>;
    /// Destroys the jail's epair (both ends); absent is success.
    fn detach(&self, jail: &str) -> Result<(), NetError>;
    /// Moves the jail side of `jail`'s epair out of the jail's vnet back to
    /// the host (`ifconfig kj_X -vnet JAIL`), so that a jail lingering as
    /// dying after its removal cannot keep it. Nothing to move (the
    /// interface is not in that vnet, or there is no such jail) is success.
    fn reclaim(&self, jail: &str) -> Result<(), NetError>;
    /// The IPv4 routing table, in one call.
    fn list_routes(&self) -> Result<Vec<Route>, NetError>;
    /// Adds a route; already present is success.
    fn add_route(&self, destination: Ipv4Net, gateway: Ipv4Addr) -> Result<(), NetError>;
    /// Deletes a route; absent is success.
    fn delete_route(&self, destination: Ipv4Net) -> Result<(), NetError>;
    /// IPv4 addresses configured on `iface` (gateway and aliases).
    fn list_addresses(&self, iface: &str) -> Result<Vec<Ipv4Addr>, NetError>;
    /// Adds `vip` as a /32 alias on the bridge; present is success.
    fn add_alias(&self, bridge: &str, vip: Ipv4Addr) -> Result<(), NetError>;
    /// Removes the alias; absent is success.
    fn remove_alias(&self, bridge: &str, vip: Ipv4Addr) -> Result<(), NetError>;
}

/// ifconfig(8) changes kernel state in memory and returns at once; a call that
/// takes longer than this means the kernel is wedged.
pub const IFCONFIG_TIMEOUT: Duration = Duration::from_secs(10);
/// route(8) adds or deletes one entry.
pub const ROUTE_TIMEOUT: Duration = Duration::from_secs(10);
/// netstat(1) dumps the whole IPv4 table, which may be large on a router.
pub const NETSTAT_TIMEOUT: Duration = Duration::from_secs(30);

/// [`NetManager`] over ifconfig(8), route(8) and netstat(1).
#[derive(Debug)]
pub struct FreeBsdNet<R> {
    runner: R,
    paths: CommandPaths,
}

impl<R: CommandRunner> FreeBsdNet<R> {
    /// Runs commands through `runner`, by the absolute paths in `paths`.
    pub fn new(runner: R, paths: CommandPaths) -> FreeBsdNet<R> {
        FreeBsdNet { runner, paths }
    }

    /// Runs ifconfig with `args`; the caller reads the status.
    fn ifconfig(&self, args: &[&str]) -> Result<(Vec<String>, CmdOutput), CmdError> {
        let argv = command(&self.paths.ifconfig, args);
        let out = self.runner.run(&argv, None, IFCONFIG_TIMEOUT)?;
        Ok((argv, out))
    }

    /// Runs ifconfig with `args`; any non-zero exit is an error.
    fn ifconfig_ok(&self, args: &[&str]) -> Result<CmdOutput, NetError> {
        let (argv, out) = self.ifconfig(args)?;
        Ok(out.check(&argv)?)
    }

    /// Destroys an interface (for an epair, both ends); already gone is success.
    fn destroy(&self, iface: &str) -> Result<(), NetError> {
        let (argv, out) = self.ifconfig(&[iface, "destroy"])?;
        Ok(tolerate(out, &argv, &["does not exist"])?)
    }

    /// Best-effort removal of what a failed step left behind. Its own failure is
    /// not reported: the caller returns the error that caused the cleanup, which
    /// says more, and a renamed leftover is destroyed by the next `attach`.
    fn discard(&self, iface: &str) {
        let _ = self.destroy(iface);
    }

    /// `ifconfig bridge create`, then renames the new bridge to `bridge`.
    fn create_bridge(&self, bridge: &str) -> Result<(), NetError> {
        let out = self.ifconfig_ok(&["bridge", "create"])?;
        let created = created_name(&out, "ifconfig bridge create")?;
        if let Err(e) = self.ifconfig_ok(&[&created, "name", bridge]) {
            self.discard(&created);
            return Err(e);
        }
        Ok(())
    }

    /// The steps of `attach` after both ends exist and the host end is named.
    fn finish_attach(&self, bridge: &str, peer: &str, epair: &Epair) -> Result<(), NetError> {
        self.ifconfig_ok(&[peer, "name", &epair.jail])?;
        self.ifconfig_ok(&[bridge, "addm", &epair.host])?;
        self.ifconfig_ok(&[&epair.host, "up"])?;
        Ok(())
    }

    fn route(&self, args: &[&str], tolerated: &str) -> Result<(), NetError> {
        let argv = command(&self.paths.route, args);
        let out = self.runner.run(&argv, None, ROUTE_TIMEOUT)?;
        Ok(tolerate(out, &argv, &[tolerated])?)
    }
}

impl<R: CommandRunner> NetManager for FreeBsdNet<R> {
    fn list_interfaces(&self) -> Result<Vec<String>, NetError> {
        let out = self.ifconfig_ok(&["-l"])?;
        Ok(out.stdout.split_whitespace().map(str::to_string).collect())
    }

    /// Still one `ifconfig -l`, searched for each of `names` ([`lists_word`]).
    /// ifconfig(8) can name one interface (`ifconfig IFACE`, exit 1 and
    /// `interface IFACE does not exist` when absent), but that is a process
    /// per name and prints its whole configuration; three processes cost a
    /// real host more than scanning the names of one.
    fn find_interfaces(&self, names: &[&str]) -> Result<Vec<String>, NetError> {
        let out = self.ifconfig_ok(&["-l"])?;
        Ok(names
            .iter()
            .filter(|n| lists_word(&out.stdout, n))
            .map(|n| n.to_string())
            .collect())
    }

    fn ensure_bridge(&self, bridge: &str, gateway: Ipv4Net) -> Result<(), NetError> {
        let has_gateway = if !self.find_interfaces(&[bridge])?.is_empty() {
            self.list_addresses(bridge)?.contains(&gateway.addr())
        } else {
            // A bridge created a moment ago has no address to look for.
            self.create_bridge(bridge)?;
            false
        };
        if !has_gateway {
            self.ifconfig_ok(&[bridge, "inet", &gateway.to_string(), "up"])?;
        }
        Ok(())
    }

    fn attach(&self, bridge: &str, jail: &str) -> Result<Epair, NetError> {
        let (host, jail_end) = iface_names(jail);
        let epair = Epair {
            host,
            jail: jail_end,
        };
        // Either name on the host is the leftover of a crash between create and
        // jail start (or of a failed cleanup); destroying one end removes both.
        let existing = self.find_interfaces(&[&epair.host, &epair.jail])?;
        if let Some(leftover) = existing.first() {
            self.destroy(leftover)?;
        }
        let out = self.ifconfig_ok(&["epair", "create"])?;
        let created = created_name(&out, "ifconfig epair create")?;
        let Some(stem) = created.strip_suffix('a') else {
            self.discard(&created);
            return Err(NetError::Parse {
                command: "ifconfig epair create".into(),
                reason: format!("`{created}` is not the a end of an epair (expected e.g. epair0a)"),
            });
        };
        let peer = format!("{stem}b");
        if let Err(e) = self.ifconfig_ok(&[&created, "name", &epair.host]) {
            self.discard(&created);
            return Err(e);
        }
        if let Err(e) = self.finish_attach(bridge, &peer, &epair) {
            self.discard(&epair.host);
            return Err(e);
        }
        Ok(epair)
    }

    fn detach(&self, jail: &str) -> Result<(), NetError> {
        let (host, _) = iface_names(jail);
        self.destroy(&host)
    }

    /// ifconfig handles `IF -vnet JAIL` without looking IF up on the host
    /// (it lives in the jail's vnet). Nothing to move reads as ENXIO from
    /// the kernel (no such jail, or no such interface in its vnet), which
    /// ifconfig prints as `SIOCSIFRVNET(JID, IF): Device not configured`; a
    /// jail name that cannot be resolved is `jail "NAME" not found`. A vnet
    /// being torn down answers EBUSY, an error: the interface is not back.
    fn reclaim(&self, jail: &str) -> Result<(), NetError> {
        let (_, jail_end) = iface_names(jail);
        let (argv, out) = self.ifconfig(&[&jail_end, "-vnet", jail])?;
        let gone = format!("jail \"{jail}\" not found");
        Ok(tolerate(
            out,
            &argv,
            &["Device not configured", gone.as_str()],
        )?)
    }

    fn list_routes(&self) -> Result<Vec<Route>, NetError> {
        let argv = command(&self.paths.netstat, &["-rn", "-4", "--libxo", "json"]);
        let out = self
            .runner
            .run(&argv, None, NETSTAT_TIMEOUT)?
            .check(&argv)?;
        parse_netstat_routes(&out.stdout).map_err(|reason| NetError::Parse {
            command: render_argv(&argv),
            reason,
        })
    }

    fn add_route(&self, destination: Ipv4Net, gateway: Ipv4Addr) -> Result<(), NetError> {
        let net = destination.trunc().to_string();
        self.route(
            &["-n", "add", "-net", &net, &gateway.to_string()],
            "route already in table",
        )
    }

    fn delete_route(&self, destination: Ipv4Net) -> Result<(), NetError> {
        let net = destination.trunc().to_string();
        self.route(&["-n", "delete", "-net", &net], "not in table")
    }

    fn list_addresses(&self, iface: &str) -> Result<Vec<Ipv4Addr>, NetError> {
        let out = self.ifconfig_ok(&[iface, "inet"])?;
        parse_inet_addresses(&out.stdout).map_err(|reason| NetError::Parse {
            command: format!("ifconfig {iface} inet"),
            reason,
        })
    }

    fn add_alias(&self, bridge: &str, vip: Ipv4Addr) -> Result<(), NetError> {
        // Checked first because re-adding an existing address is not an error
        // on every ifconfig version (ioctl and netlink paths differ); "File
        // exists" is still tolerated in case it appears between the two calls.
        if self.list_addresses(bridge)?.contains(&vip) {
            return Ok(());
        }
        let (argv, out) = self.ifconfig(&[bridge, "inet", &format!("{vip}/32"), "alias"])?;
        Ok(tolerate(out, &argv, &["File exists"])?)
    }

    fn remove_alias(&self, bridge: &str, vip: Ipv4Addr) -> Result<(), NetError> {
        let (argv, out) = self.ifconfig(&[bridge, "inet", &vip.to_string(), "-alias"])?;
        Ok(tolerate(out, &argv, &["Can't assign requested address"])?)
    }
}

/// argv of `program` followed by `args`. Command paths come from keel.toml,
/// which is UTF-8, so the lossy conversion never changes them.
/// True when `word` occurs in `text` delimited by whitespace or the ends:
/// a substring search per name, instead of splitting every name listed.
fn lists_word(text: &str, word: &str) -> bool {
    !word.is_empty()
        && text.match_indices(word).any(|(at, _)| {
            let before = text[..at].chars().next_back();
            let after = text[at + word.len()..].chars().next();
            before.is_none_or(char::is_whitespace) && after.is_none_or(char::is_whitespace)
        })
}

fn command(program: &std::path::Path, args: &[&str]) -> Vec<String> {
    let program = program.to_string_lossy();
    argv(&[&[program.as_ref()], args].concat())
}

/// Success, or a failure whose stdout or stderr contains one of `phrases` (an
/// outcome that already matches what was asked); anything else is the
/// command's error.
fn tolerate(out: CmdOutput, argv: &[String], phrases: &[&str]) -> Result<(), CmdError> {
    let said = |p: &&str| out.stdout.contains(*p) || out.stderr.contains(*p);
    if !out.success() && phrases.iter().any(said) {
        return Ok(());
    }
    out.check(argv).map(|_| ())
}

/// The one interface name a cloning `ifconfig ... create` printed.
fn created_name(out: &CmdOutput, command: &str) -> Result<String, NetError> {
    let words: Vec<&str> = out.stdout.split_whitespace().collect();
    match words.as_slice() {
        [name] => Ok(name.to_string()),
        _ => Err(NetError::Parse {
            command: command.into(),
            reason: format!(
                "expected the new interface's name alone, got `{}`",
                out.stdout.trim()
            ),
        }),
    }
}

/// IPv4 addresses from `ifconfig IFACE inet`: the `\tinet A.B.C.D netmask ...`
/// lines; the interface header and option lines are skipped.
pub fn parse_inet_addresses(text: &str) -> Result<Vec<Ipv4Addr>, String> {
    let mut addrs = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("inet") {
            continue;
        }
        let word = words.next().unwrap_or_default();
        let addr = word
            .parse()
            .map_err(|_| format!("`{word}` in `{}` is not an IPv4 address", line.trim()))?;
        addrs.push(addr);
    }
    Ok(addrs)
}

#[derive(serde::Deserialize)]
struct NetstatDoc {
    statistics: NetstatStatistics,
}

#[derive(serde::Deserialize)]
struct NetstatStatistics {
    #[serde(rename = "route-information")]
    route_information: NetstatRouteInformation,
}

#[derive(serde::Deserialize)]
struct NetstatRouteInformation {
    #[serde(rename = "route-table")]
    route_table: NetstatRouteTable,
}

#[derive(serde::Deserialize)]
struct NetstatRouteTable {
    #[serde(rename = "rt-family", default)]
    rt_family: Vec<NetstatFamily>,
}

#[derive(serde::Deserialize)]
struct NetstatFamily {
    #[serde(rename = "rt-entry", default)]
    rt_entry: Vec<NetstatEntry>,
}

#[derive(serde::Deserialize)]
struct NetstatEntry {
    #[serde(default)]
    destination: String,
    #[serde(default)]
    gateway: String,
}

/// Routes from `netstat -rn -4 --libxo json` (shape in `reference/freebsd.md`
/// section 8). `default` is 0.0.0.0/0 and a bare address a /32 host route.
/// Entries whose destination is not IPv4 (a non-contiguous `&0x...` mask, or
/// another family) are skipped: they can never be one of Keel's routes.
pub fn parse_netstat_routes(json: &str) -> Result<Vec<Route>, String> {
    let doc: NetstatDoc = serde_json::from_str(json)
        .map_err(|e| format!("not the libxo JSON netstat prints: {e}"))?;
    let routes = doc
        .statistics
        .route_information
        .route_table
        .rt_family
        .into_iter()
        .flat_map(|f| f.rt_entry)
        .filter_map(|e| {
            Some(Route {
                destination: parse_destination(&e.destination)?,
                gateway: e.gateway,
            })
        })
        .collect();
    Ok(routes)
}

fn parse_destination(text: &str) -> Option<Ipv4Net> {
    if text == "default" {
        return Ipv4Net::new(Ipv4Addr::UNSPECIFIED, 0).ok();
    }
    if text.contains('/') {
        return text.parse().ok();
    }
    Ipv4Net::new(text.parse().ok()?, 32).ok()
}

/// The error an injected fault produces, shaped like a failed command.
fn injected(op: &str, target: &str) -> NetError {
    NetError::Command(CmdError::Failed {
        command: format!("fake net.{op} {target}"),
        status: 1,
        stderr: "injected failure".into(),
    })
}

/// In-memory [`NetManager`] for tests and `--simulate`.
///
/// Every successful mutating call is logged (`net.ensure_bridge keel0
/// 10.20.3.1/24`, `net.attach web-1`, `net.detach web-1`, `net.add_route
/// 10.1.2.0/24 via 10.0.0.2`, `net.delete_route 10.1.2.0/24`, `net.add_alias
/// keel0 10.96.0.7`, `net.remove_alias keel0 10.96.0.7`). Faults are looked up
/// by method name and target: the bridge for `ensure_bridge` and
/// `list_addresses`, the jail for `attach`/`detach`, the destination prefix
/// for routes, the VIP for aliases, `""` for `list_interfaces`/`list_routes`.
/// Like the kernel, it refuses to attach to or alias on a bridge that does
/// not exist.
///
/// It also knows where a jail side is: on the host, in a live jail's vnet
/// ([`FakeNet::enter_vnet`], what jail(8) does for `vnet.interface`), or
/// stranded in the vnet of a jail that lingers as dying
/// ([`FakeNet::strand`]), where `reclaim` cannot reach it. Only interfaces
/// on the host are listed. `reclaim` is logged at every call
/// (`net.reclaim web-1`), whether or not it had something to move.
#[derive(Debug, Clone, Default)]
pub struct FakeNet {
    state: Arc<Mutex<FakeNetState>>,
    log: CallLog,
    faults: Faults,
}

#[derive(Debug, Default)]
struct FakeNetState {
    interfaces: BTreeSet<String>,
    gateways: BTreeMap<String, Ipv4Net>,
    aliases: BTreeMap<String, BTreeSet<Ipv4Addr>>,
    members: BTreeMap<String, BTreeSet<String>>,
    routes: Vec<Route>,
    /// Interfaces that exist but are not on the host, and where they are.
    away: BTreeMap<String, Away>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Away {
    /// In the vnet of this live jail.
    InJail(String),
    /// In the vnet of a jail that was removed but still lingers as dying.
    Dying,
}

impl FakeNet {
    /// An empty host (no interfaces, no routes) logging to `log`.
    pub fn new(log: CallLog, faults: Faults) -> FakeNet {
        FakeNet {
            state: Arc::default(),
            log,
            faults,
        }
    }

    /// Every interface name on the host, sorted.
    pub fn interfaces(&self) -> Vec<String> {
        let st = lock(&self.state);
        st.interfaces
            .iter()
            .filter(|i| !st.away.contains_key(*i))
            .cloned()
            .collect()
    }

    /// What jail(8) does for `vnet.interface` at creation: the jail side of
    /// `jail`'s epair moves into the jail's vnet and off the host's list.
    pub fn enter_vnet(&self, jail: &str) {
        let (_, jail_end) = iface_names(jail);
        lock(&self.state)
            .away
            .insert(jail_end, Away::InJail(jail.to_string()));
    }

    /// The jail side of `jail`'s epair stays in the vnet of a jail that was
    /// removed but lingers as dying: it is not on the host, and `reclaim`
    /// cannot bring it back (the jail can no longer be named).
    pub fn strand(&self, jail: &str) {
        let (_, jail_end) = iface_names(jail);
        lock(&self.state).away.insert(jail_end, Away::Dying);
    }

    /// Adds an interface as if something outside Keel (or a crash) left it.
    pub fn add_interface(&self, name: &str) {
        lock(&self.state).interfaces.insert(name.to_string());
    }

    /// The routing table, in insertion order.
    pub fn routes(&self) -> Vec<Route> {
        lock(&self.state).routes.clone()
    }

    /// The /32 aliases on `bridge`, sorted.
    pub fn aliases(&self, bridge: &str) -> Vec<Ipv4Addr> {
        lock(&self.state)
            .aliases
            .get(bridge)
            .map(|a| a.iter().copied().collect())
            .unwrap_or_default()
    }

    /// The gateway address `ensure_bridge` gave `bridge`.
    pub fn bridge_address(&self, bridge: &str) -> Option<Ipv4Net> {
        lock(&self.state).gateways.get(bridge).copied()
    }

    /// Interfaces `attach` added to `bridge`, sorted.
    pub fn members(&self, bridge: &str) -> Vec<String> {
        lock(&self.state)
            .members
            .get(bridge)
            .map(|m| m.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn fault(&self, op: &str, target: &str) -> Result<(), NetError> {
        if self.faults.should_fail(op, target) {
            return Err(injected(op, target));
        }
        Ok(())
    }
}

/// The error ifconfig gives for an unknown interface.
fn no_such_interface(iface: &str, args: &str) -> NetError {
    NetError::Command(CmdError::Failed {
        command: format!("fake ifconfig {iface} {args}"),
        status: 1,
        stderr: format!("ifconfig: interface {iface} does not exist"),
    })
}

impl NetManager for FakeNet {
    fn list_interfaces(&self) -> Result<Vec<String>, NetError> {
        self.fault("list_interfaces", "")?;
        Ok(self.interfaces())
    }

    fn find_interfaces(&self, names: &[&str]) -> Result<Vec<String>, NetError> {
        self.fault("find_interfaces", "")?;
        let st = lock(&self.state);
        Ok(names
            .iter()
            .filter(|n| st.interfaces.contains(**n) && !st.away.contains_key(**n))
            .map(|n| n.to_string())
            .collect())
    }

    fn ensure_bridge(&self, bridge: &str, gateway: Ipv4Net) -> Result<(), NetError> {
        self.fault("ensure_bridge", bridge)?;
        let mut st = lock(&self.state);
        st.interfaces.insert(bridge.to_string());
        st.gateways.insert(bridge.to_string(), gateway);
        drop(st);
        self.log
            .push(format!("net.ensure_bridge {bridge} {gateway}"));
        Ok(())
    }

    fn attach(&self, bridge: &str, jail: &str) -> Result<Epair, NetError> {
        self.fault("attach", jail)?;
        let (host, jail_end) = iface_names(jail);
        let mut st = lock(&self.state);
        if !st.interfaces.contains(bridge) {
            return Err(no_such_interface(bridge, &format!("addm {host}")));
        }
        // Leftovers of the same names are destroyed first, wherever they are.
        st.away.remove(&host);
        st.away.remove(&jail_end);
        st.interfaces.insert(host.clone());
        st.interfaces.insert(jail_end.clone());
        st.members
            .entry(bridge.to_string())
            .or_default()
            .insert(host.clone());
        drop(st);
        self.log.push(format!("net.attach {jail}"));
        Ok(Epair {
            host,
            jail: jail_end,
        })
    }

    fn detach(&self, jail: &str) -> Result<(), NetError> {
        self.fault("detach", jail)?;
        let (host, jail_end) = iface_names(jail);
        let mut st = lock(&self.state);
        st.interfaces.remove(&host);
        st.interfaces.remove(&jail_end);
        st.away.remove(&host);
        st.away.remove(&jail_end);
        for members in st.members.values_mut() {
            members.remove(&host);
        }
        drop(st);
        self.log.push(format!("net.detach {jail}"));
        Ok(())
    }

    fn reclaim(&self, jail: &str) -> Result<(), NetError> {
        self.log.push(format!("net.reclaim {jail}"));
        self.fault("reclaim", jail)?;
        let (_, jail_end) = iface_names(jail);
        let mut st = lock(&self.state);
        if st.away.get(&jail_end) == Some(&Away::InJail(jail.to_string())) {
            st.away.remove(&jail_end);
        }
        Ok(())
    }

    fn list_routes(&self) -> Result<Vec<Route>, NetError> {
        self.fault("list_routes", "")?;
        Ok(self.routes())
    }

    fn add_route(&self, destination: Ipv4Net, gateway: Ipv4Addr) -> Result<(), NetError> {
        let destination = destination.trunc();
        self.fault("add_route", &destination.to_string())?;
        let mut st = lock(&self.state);
        // Like route(8): a route to the same prefix is "already in table",
        // whatever its gateway.
        if !st.routes.iter().any(|r| r.destination == destination) {
            st.routes.push(Route {
                destination,
                gateway: gateway.to_string(),
            });
        }
        drop(st);
        self.log
            .push(format!("net.add_route {destination} via {gateway}"));
        Ok(())
    }

    fn delete_route(&self, destination: Ipv4Net) -> Result<(), NetError> {
        let destination = destination.trunc();
        self.fault("delete_route", &destination.to_string())?;
        lock(&self.state)
            .routes
            .retain(|r| r.destination != destination);
        self.log.push(format!("net.delete_route {destination}"));
        Ok(())
    }

    fn list_addresses(&self, iface: &str) -> Result<Vec<Ipv4Addr>, NetError> {
        self.fault("list_addresses", iface)?;
        let st = lock(&self.state);
        if !st.interfaces.contains(iface) {
            return Err(no_such_interface(iface, "inet"));
        }
        let gateway = st.gateways.get(iface).map(|g| g.addr());
        let aliases = st.aliases.get(iface).into_iter().flatten().copied();
        Ok(gateway.into_iter().chain(aliases).collect())
    }

    fn add_alias(&self, bridge: &str, vip: Ipv4Addr) -> Result<(), NetError> {
        self.fault("add_alias", &vip.to_string())?;
        let mut st = lock(&self.state);
        if !st.interfaces.contains(bridge) {
            return Err(no_such_interface(bridge, "inet"));
        }
        st.aliases
            .entry(bridge.to_string())
            .or_default()
            .insert(vip);
        drop(st);
        self.log.push(format!("net.add_alias {bridge} {vip}"));
        Ok(())
    }

    fn remove_alias(&self, bridge: &str, vip: Ipv4Addr) -> Result<(), NetError> {
        self.fault("remove_alias", &vip.to_string())?;
        let mut st = lock(&self.state);
        if !st.interfaces.contains(bridge) {
            return Err(no_such_interface(bridge, &format!("inet {vip} -alias")));
        }
        if let Some(aliases) = st.aliases.get_mut(bridge) {
            aliases.remove(&vip);
        }
        drop(st);
        self.log.push(format!("net.remove_alias {bridge} {vip}"));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("test prefix")
    }

    #[test]
    fn inet_lines_are_read_and_the_rest_skipped() {
        let text = "keel0: flags=1008843<UP,BROADCAST,RUNNING,SIMPLEX,MULTICAST,LOWER_UP> metric 0 mtu 1500\n\
                    \toptions=0\n\
                    \tinet 10.20.3.1 netmask 0xffffff00 broadcast 10.20.3.255\n\
                    \tinet 10.96.0.7 netmask 0xffffffff broadcast 10.96.0.7\n";
        assert_eq!(
            parse_inet_addresses(text),
            Ok(vec![
                Ipv4Addr::new(10, 20, 3, 1),
                Ipv4Addr::new(10, 96, 0, 7)
            ])
        );
        assert_eq!(
            parse_inet_addresses("keel0: flags=0<> metric 0 mtu 1500\n"),
            Ok(vec![])
        );
        assert!(parse_inet_addresses("\tinet 10.20.3 netmask 0xffffff00\n").is_err());
    }

    #[test]
    fn netstat_destinations_cover_default_host_and_prefix() {
        let json = r#"{"statistics": {"route-information": {"route-table": {"rt-family": [
            {"address-family": "Internet", "rt-entry": [
              {"destination": "default", "gateway": "192.168.1.1", "flags": "UGS", "interface-name": "em0"},
              {"destination": "10.1.2.0/24", "gateway": "10.0.0.2", "flags": "UGS", "interface-name": "em0"},
              {"destination": "127.0.0.1", "gateway": "link#2", "flags": "UH", "interface-name": "lo0"},
              {"destination": "10.0.0.0&0xff00ff00", "gateway": "10.0.0.9", "flags": "UGS", "interface-name": "em0"},
              {"destination": "fe80::%lo0/64", "gateway": "link#2", "flags": "U", "interface-name": "lo0"}
            ]}]}}}}"#;
        let routes = parse_netstat_routes(json).expect("parses");
        let dests: Vec<String> = routes.iter().map(|r| r.destination.to_string()).collect();
        assert_eq!(dests, ["0.0.0.0/0", "10.1.2.0/24", "127.0.0.1/32"]);
        assert_eq!(routes[2].gateway, "link#2");
    }

    #[test]
    fn netstat_without_families_is_an_empty_table_and_garbage_an_error() {
        let empty = r#"{"statistics": {"route-information": {"route-table": {}}}}"#;
        assert_eq!(parse_netstat_routes(empty), Ok(vec![]));
        assert!(parse_netstat_routes("Routing tables\n").is_err());
    }

    #[test]
    fn fake_attach_replaces_leftovers_and_detach_removes_both_ends() {
        let log = CallLog::new();
        let fake = FakeNet::new(log.clone(), Faults::default());
        assert!(fake.attach("keel0", "web-1").is_err(), "no bridge yet");
        fake.ensure_bridge("keel0", net("10.20.3.1/24"))
            .expect("bridge");
        fake.add_interface("kh_web-1");
        let epair = fake.attach("keel0", "web-1").expect("attach");
        assert_eq!(epair.host, "kh_web-1");
        assert_eq!(fake.members("keel0"), ["kh_web-1"]);
        assert_eq!(fake.interfaces(), ["keel0", "kh_web-1", "kj_web-1"]);
        fake.detach("web-1").expect("detach");
        fake.detach("web-1").expect("detach is idempotent");
        assert_eq!(fake.interfaces(), ["keel0"]);
        assert_eq!(
            log.entries(),
            [
                "net.ensure_bridge keel0 10.20.3.1/24",
                "net.attach web-1",
                "net.detach web-1",
                "net.detach web-1"
            ]
        );
    }

    #[test]
    fn a_listed_word_is_a_whole_name_only() {
        let text = "em0 lo0 kh_web-10 keel0 kh_web-1\n";
        assert!(lists_word(text, "kh_web-1"));
        assert!(lists_word(text, "em0"));
        assert!(!lists_word(text, "kh_web"));
        assert!(!lists_word(text, "eel0"));
        assert!(!lists_word(text, ""));
    }

    #[test]
    fn fake_find_interfaces_leaves_out_what_is_in_a_vnet_or_absent() {
        let net = FakeNet::new(CallLog::new(), Faults::default());
        net.add_interface("keel0");
        net.attach("keel0", "web-1").expect("attached");
        net.enter_vnet("web-1");
        assert_eq!(
            net.find_interfaces(&["kh_web-1", "kj_web-1", "kh_db-0"])
                .expect("found"),
            ["kh_web-1"]
        );
    }

    #[test]
    fn fake_reclaim_brings_back_a_jail_side_only_from_a_live_jail() {
        let log = CallLog::new();
        let fake = FakeNet::new(log.clone(), Faults::default());
        fake.ensure_bridge("keel0", net("10.20.3.1/24"))
            .expect("bridge");
        fake.attach("keel0", "web-1").expect("attach");
        fake.enter_vnet("web-1");
        assert_eq!(fake.interfaces(), ["keel0", "kh_web-1"]);
        fake.reclaim("web-1").expect("reclaim");
        assert_eq!(fake.interfaces(), ["keel0", "kh_web-1", "kj_web-1"]);
        fake.reclaim("web-1").expect("nothing to move is success");

        fake.strand("web-1");
        fake.reclaim("web-1").expect("a dying jail cannot be named");
        assert_eq!(fake.interfaces(), ["keel0", "kh_web-1"], "still stranded");
        fake.attach("keel0", "web-1").expect("a fresh epair");
        assert_eq!(fake.interfaces(), ["keel0", "kh_web-1", "kj_web-1"]);
        assert_eq!(log.matching("net.reclaim").len(), 3);
    }

    #[test]
    fn fake_routes_and_aliases_are_idempotent() {
        let log = CallLog::new();
        let fake = FakeNet::new(log.clone(), Faults::default());
        fake.ensure_bridge("keel0", net("10.20.3.1/24"))
            .expect("bridge");
        let gw = Ipv4Addr::new(10, 0, 0, 2);
        fake.add_route(net("10.1.2.0/24"), gw).expect("add");
        fake.add_route(net("10.1.2.0/24"), gw).expect("add again");
        assert_eq!(fake.routes().len(), 1);
        assert_eq!(fake.list_routes().expect("list")[0].gateway, "10.0.0.2");
        fake.delete_route(net("10.1.2.0/24")).expect("delete");
        fake.delete_route(net("10.1.2.0/24"))
            .expect("delete absent");
        assert!(fake.routes().is_empty());

        let vip = Ipv4Addr::new(10, 96, 0, 7);
        fake.add_alias("keel0", vip).expect("alias");
        assert_eq!(
            fake.list_addresses("keel0").expect("addresses"),
            [Ipv4Addr::new(10, 20, 3, 1), vip]
        );
        fake.remove_alias("keel0", vip).expect("unalias");
        fake.remove_alias("keel0", vip).expect("unalias absent");
        assert!(fake.aliases("keel0").is_empty());
        assert_eq!(fake.bridge_address("keel0"), Some(net("10.20.3.1/24")));
        assert!(
            log.entries()
                .contains(&"net.add_route 10.1.2.0/24 via 10.0.0.2".to_string())
        );
    }

    #[test]
    fn fake_faults_fail_only_their_target_and_change_nothing() {
        let log = CallLog::new();
        let faults = Faults::default();
        let fake = FakeNet::new(log.clone(), faults.clone());
        fake.ensure_bridge("keel0", net("10.20.3.1/24"))
            .expect("bridge");
        faults.fail_times("attach", Some("web-1"), 1);
        assert!(fake.attach("keel0", "web-2").is_ok());
        let err = fake.attach("keel0", "web-1").expect_err("injected");
        assert!(err.to_string().contains("injected"), "{err}");
        assert!(!fake.interfaces().contains(&"kh_web-1".to_string()));
        assert!(fake.attach("keel0", "web-1").is_ok(), "fault used up");
        assert_eq!(log.matching("net.attach").len(), 2);
    }
}
