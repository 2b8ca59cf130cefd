//! Simulated networking: the bridge, epairs, routes and VIP aliases of a
//! simulated node, recorded in `sim-net.json` so that an agent restarted
//! while its jails run finds their epairs where it left them (an in-memory
//! table would forget them and make every running jail look broken).
//!
//! Nothing here touches the machine's real interfaces: simulated jails and
//! VIPs live on loopback (127.0.0.0/8 on Linux), which needs no setup.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::{SimError, read_state, write_state};
use crate::common::cidr::Ipv4Net;
use crate::common::cmd::CmdError;
use crate::common::sync::lock;
use crate::host::iface_names;
use crate::host::net::{Epair, NetError, NetManager, Route};

const STATE_FILE: &str = "sim-net.json";

#[derive(Debug, Default, Serialize, Deserialize)]
struct NetState {
    interfaces: BTreeSet<String>,
    addresses: BTreeMap<String, BTreeSet<Ipv4Addr>>,
    routes: BTreeMap<Ipv4Net, Ipv4Addr>,
}

/// [`NetManager`] for simulate mode; see the module docs.
#[derive(Debug, Clone)]
pub struct SimNet {
    path: PathBuf,
    state: Arc<Mutex<NetState>>,
}

impl SimNet {
    /// Opens (or starts) the simulated network table in `state_dir`.
    pub fn new(state_dir: &Path) -> Result<SimNet, SimError> {
        let path = state_dir.join(STATE_FILE);
        let state = read_state(&path)?;
        Ok(SimNet {
            path,
            state: Arc::new(Mutex::new(state)),
        })
    }

    fn change(&self, f: impl FnOnce(&mut NetState)) -> Result<(), NetError> {
        let mut st = lock(&self.state);
        f(&mut st);
        write_state(&self.path, &*st).map_err(|e| {
            NetError::Command(CmdError::Failed {
                command: format!("simulated network: write {}", self.path.display()),
                status: 1,
                stderr: e.to_string(),
            })
        })
    }
}

impl NetManager for SimNet {
    fn list_interfaces(&self) -> Result<Vec<String>, NetError> {
        Ok(lock(&self.state).interfaces.iter().cloned().collect())
    }

    fn find_interfaces(&self, names: &[&str]) -> Result<Vec<String>, NetError> {
        let st = lock(&self.state);
        Ok(names
            .iter()
            .filter(|n| st.interfaces.contains(**n))
            .map(|n| n.to_string())
            .collect())
    }

    fn ensure_bridge(&self, bridge: &str, gateway: Ipv4Net) -> Result<(), NetError> {
        self.change(|st| {
            st.interfaces.insert(bridge.to_string());
            st.addresses
                .entry(bridge.to_string())
                .or_default()
                .insert(gateway.addr());
        })
    }

    /// Records both ends: a simulated jail has no vnet, so its side stays
    /// on the host, where the reconciler looks for it before a start.
    fn attach(&self, _bridge: &str, jail: &str) -> Result<Epair, NetError> {
        let (host, jail_side) = iface_names(jail);
        self.change(|st| {
            st.interfaces.insert(host.clone());
            st.interfaces.insert(jail_side.clone());
        })?;
        Ok(Epair {
            host,
            jail: jail_side,
        })
    }

    fn detach(&self, jail: &str) -> Result<(), NetError> {
        let (host, jail_side) = iface_names(jail);
        self.change(|st| {
            st.interfaces.remove(&host);
            st.interfaces.remove(&jail_side);
        })
    }

    /// Nothing to move: a simulated jail side never leaves the host.
    fn reclaim(&self, _jail: &str) -> Result<(), NetError> {
        Ok(())
    }

    fn list_routes(&self) -> Result<Vec<Route>, NetError> {
        Ok(lock(&self.state)
            .routes
            .iter()
            .map(|(destination, gw)| Route {
                destination: *destination,
                gateway: gw.to_string(),
            })
            .collect())
    }

    fn add_route(&self, destination: Ipv4Net, gateway: Ipv4Addr) -> Result<(), NetError> {
        self.change(|st| {
            st.routes.entry(destination).or_insert(gateway);
        })
    }

    fn delete_route(&self, destination: Ipv4Net) -> Result<(), NetError> {
        self.change(|st| {
            st.routes.remove(&destination);
        })
    }

    fn list_addresses(&self, iface: &str) -> Result<Vec<Ipv4Addr>, NetError> {
        Ok(lock(&self.state)
            .addresses
            .get(iface)
            .map(|a| a.iter().copied().collect())
            .unwrap_or_default())
    }

    fn add_alias(&self, bridge: &str, vip: Ipv4Addr) -> Result<(), NetError> {
        self.change(|st| {
            st.addresses
                .entry(bridge.to_string())
                .or_default()
                .insert(vip);
        })
    }

    fn remove_alias(&self, bridge: &str, vip: Ipv4Addr) -> Result<(), NetError> {
        self.change(|st| {
            if let Some(a) = st.addresses.get_mut(bridge) {
                a.remove(&vip);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epairs_survive_a_restart_of_the_agent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let net = SimNet::new(dir.path()).expect("opens");
        let epair = net.attach("keel0", "web-1").expect("attach");
        let again = SimNet::new(dir.path()).expect("reopens");
        assert!(again.list_interfaces().expect("list").contains(&epair.host));
        again.detach("web-1").expect("detach");
        assert!(
            SimNet::new(dir.path())
                .expect("reopens")
                .list_interfaces()
                .expect("list")
                .is_empty()
        );
    }

    #[test]
    fn find_interfaces_keeps_the_names_on_the_host_in_the_order_asked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let net = SimNet::new(dir.path()).expect("opens");
        net.ensure_bridge("keel0", "10.20.3.1/24".parse().expect("net"))
            .expect("bridge");
        net.attach("keel0", "web-1").expect("attached");
        assert_eq!(
            net.find_interfaces(&["kj_web-1", "kh_db-0", "keel0"])
                .expect("found"),
            ["kj_web-1", "keel0"]
        );
    }
}
