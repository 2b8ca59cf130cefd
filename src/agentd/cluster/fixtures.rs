//! Values the cluster modules' unit tests share. Test-only; never compiled
//! into the daemon.

use std::net::Ipv4Addr;

use crate::common::wire::Peer;

/// A peer `id` at `address` whose subnet is `cidr`.
pub fn peer(id: &str, address: [u8; 4], cidr: &str, alive: bool) -> Peer {
    Peer {
        node_id: id.into(),
        address: Ipv4Addr::from(address),
        pod_cidr: cidr.into(),
        alive,
    }
}
