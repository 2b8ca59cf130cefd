//! The pure diff between the services the proxy serves and the table a
//! heartbeat brought: which listeners to open, which to close, whose replica
//! list to swap. It decides; [`super`]'s control loop acts. Nothing here
//! touches a socket.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddrV4;

use crate::common::wire::ServiceEndpoints;

/// What to do with one service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change<'a> {
    /// Unknown so far: open a listener.
    Add(&'a ServiceEndpoints),
    /// Known, same listen address: swap its replica list in place.
    Replace(&'a ServiceEndpoints),
    /// Known but its address changed (deleted and recreated with another VIP
    /// or port between two heartbeats): close the old listener, open a new one.
    Rebind(&'a ServiceEndpoints),
    /// Gone from the table: close its listener (its connections keep relaying).
    Remove(String),
}

/// Diffs `current` (service name -> the address it was asked to listen on)
/// against `desired`. Removals and rebinds come first, so an address one
/// service gives up is free before another service binds it. A name listed
/// twice in `desired` is taken once, at its first occurrence: the control
/// plane keeps names unique, and a duplicate must not close and reopen the
/// listener within one update.
pub fn plan<'a>(
    current: &BTreeMap<String, SocketAddrV4>,
    desired: &'a [ServiceEndpoints],
    listen_of: impl Fn(&ServiceEndpoints) -> SocketAddrV4,
) -> Vec<Change<'a>> {
    let mut seen = BTreeSet::new();
    let desired: Vec<&ServiceEndpoints> = desired
        .iter()
        .filter(|s| seen.insert(s.name.as_str()))
        .collect();
    let mut first = Vec::new();
    let mut then = Vec::new();
    for name in current.keys() {
        if !seen.contains(name.as_str()) {
            first.push(Change::Remove(name.clone()));
        }
    }
    for s in desired {
        match current.get(&s.name) {
            None => then.push(Change::Add(s)),
            Some(listen) if *listen == listen_of(s) => then.push(Change::Replace(s)),
            Some(_) => first.push(Change::Rebind(s)),
        }
    }
    first.extend(then);
    first
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn svc(name: &str, vip_last: u8, port: u16, replicas: usize) -> ServiceEndpoints {
        ServiceEndpoints {
            name: name.into(),
            vip: Ipv4Addr::new(127, 128, 0, vip_last),
            port,
            replicas: (0..replicas)
                .map(|i| SocketAddrV4::new(Ipv4Addr::new(127, 64, 0, i as u8 + 1), 80))
                .collect(),
            unsettled: false,
        }
    }

    fn listen(s: &ServiceEndpoints) -> SocketAddrV4 {
        SocketAddrV4::new(s.vip, s.port)
    }

    fn current(list: &[&ServiceEndpoints]) -> BTreeMap<String, SocketAddrV4> {
        list.iter().map(|s| (s.name.clone(), listen(s))).collect()
    }

    #[test]
    fn new_known_and_vanished_services() {
        let web = svc("web", 1, 80, 2);
        let db = svc("db", 2, 5432, 1);
        let api = svc("api", 3, 8080, 3);
        let now = current(&[&web, &db]);
        let web3 = svc("web", 1, 80, 3);
        let desired = [web3.clone(), api.clone()];
        assert_eq!(
            plan(&now, &desired, listen),
            [
                Change::Remove("db".into()),
                Change::Replace(&desired[0]),
                Change::Add(&desired[1]),
            ]
        );
    }

    #[test]
    fn an_address_change_rebinds_before_anything_is_added() {
        let a = svc("a", 1, 80, 1);
        let now = current(&[&a]);
        // "a" moves to another VIP and "b" takes the address "a" gave up.
        let desired = [svc("b", 1, 80, 1), svc("a", 9, 80, 1)];
        assert_eq!(
            plan(&now, &desired, listen),
            [Change::Rebind(&desired[1]), Change::Add(&desired[0])]
        );
    }

    #[test]
    fn an_empty_table_removes_everything_and_the_same_table_only_replaces() {
        let a = svc("a", 1, 80, 1);
        let b = svc("b", 2, 80, 0);
        let now = current(&[&a, &b]);
        assert_eq!(
            plan(&now, &[], listen),
            [Change::Remove("a".into()), Change::Remove("b".into())]
        );
        let desired = [a.clone(), b.clone()];
        assert_eq!(
            plan(&now, &desired, listen),
            [Change::Replace(&desired[0]), Change::Replace(&desired[1])]
        );
    }

    #[test]
    fn a_duplicate_name_is_taken_once() {
        let desired = [svc("a", 1, 80, 1), svc("a", 2, 81, 1)];
        assert_eq!(
            plan(&BTreeMap::new(), &desired, listen),
            [Change::Add(&desired[0])]
        );
    }

    #[test]
    fn the_listen_address_comes_from_the_caller() {
        // With a bind override every service listens on the override IP; a VIP
        // change that keeps the overridden address is a replace.
        let now: BTreeMap<_, _> =
            [("a".to_string(), SocketAddrV4::new(Ipv4Addr::LOCALHOST, 80))].into();
        let desired = [svc("a", 7, 80, 1)];
        let over = |s: &ServiceEndpoints| SocketAddrV4::new(Ipv4Addr::LOCALHOST, s.port);
        assert_eq!(plan(&now, &desired, over), [Change::Replace(&desired[0])]);
    }
}
