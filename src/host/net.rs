//! Host-side networking: the `keel0` bridge and its gateway address, one
//! epair(4) per jail, kernel routes to peer nodes' subnets, and /32 service VIP
//! aliases on the bridge.
//!
//! Interface names come from [`crate::host::iface_names`]. The jail side of an
//! epair is configured by jail(8) from the jail's jail.conf (see
//! [`crate::host::jail`]); this module only handles the host side.

use std::fmt;
use std::net::Ipv4Addr;

use crate::common::cidr::Ipv4Net;
use crate::common::cmd::CmdError;

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
    /// Creates the bridge if missing and gives it `gateway` (address/prefix,
    /// e.g. 10.20.3.1/24); idempotent.
    fn ensure_bridge(&self, bridge: &str, gateway: Ipv4Net) -> Result<(), NetError>;
    /// Creates the jail's epair, names both ends, adds the host end to the
    /// bridge and brings it up. Leftovers of a crash with the same names are
    /// destroyed first.
    fn attach(&self, bridge: &str, jail: &str) -> Result<Epair, NetError>;
    /// Destroys the jail's epair (both ends); absent is success.
    fn detach(&self, jail: &str) -> Result<(), NetError>;
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
