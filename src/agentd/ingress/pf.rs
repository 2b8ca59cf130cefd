//! The `keel/ingress` pf anchor: the node's public address, ports 80 and 443,
//! redirected to the ingress jail.
//!
//! [`ingress_rules`] is the anchor's text, a pure function of where the
//! public traffic arrives and where the ingress jail listens. Loading it is
//! [`crate::host::Firewall::load_anchor`]'s (`pfctl -a keel/ingress -f -`,
//! which replaces the anchor whole, so loading the same text twice is a
//! no-op); the ingress reconciler loads it once per node, whatever the number
//! of Ingresses, and retries with backoff. It never touches pf.conf: the
//! admin adds `rdr-anchor "keel/*"` and `anchor "keel/*"` (docs/ingress.md),
//! and the agent checks for them at startup.

use std::net::Ipv4Addr;

/// The anchor's name under `keel/`.
pub const INGRESS_ANCHOR: &str = "keel/ingress";

/// The ports nginx serves in the ingress jail.
pub const INGRESS_PORTS: [u16; 2] = [80, 443];

/// The rules of [`INGRESS_ANCHOR`]: TCP to `public_address` on
/// `public_interface`, ports 80 and 443, redirected to `jail_address` on the
/// same ports. `rdr pass` lets the translated connection through without a
/// filter rule of its own, so an admin's `block in` default does not have to
/// know the jail's address. IPv4 only: jails have IPv4 addresses, and pf's
/// `rdr` does not translate between address families.
pub fn ingress_rules(
    public_interface: &str,
    public_address: Ipv4Addr,
    jail_address: Ipv4Addr,
) -> String {
    let mut rules = String::from("# Written by keel-agentd: public HTTP(S) to the ingress jail.\n");
    for port in INGRESS_PORTS {
        rules.push_str(&format!(
            "rdr pass on {public_interface} inet proto tcp from any to {public_address} port {port} -> {jail_address} port {port}\n"
        ));
    }
    rules
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ports_go_to_the_jail_on_the_same_port() {
        let rules = ingress_rules(
            "em0",
            Ipv4Addr::new(203, 0, 113, 10),
            Ipv4Addr::new(10, 20, 0, 2),
        );
        assert_eq!(
            rules
                .lines()
                .filter(|l| !l.starts_with('#'))
                .collect::<Vec<_>>(),
            [
                "rdr pass on em0 inet proto tcp from any to 203.0.113.10 port 80 -> 10.20.0.2 port 80",
                "rdr pass on em0 inet proto tcp from any to 203.0.113.10 port 443 -> 10.20.0.2 port 443",
            ]
        );
    }
}
