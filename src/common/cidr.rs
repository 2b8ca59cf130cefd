//! IPv4 prefix maths, FNV-1a, and the deterministic derivation of node subnets
//! (pod_cidr) and service virtual IPs.
//!
//! Owns: parsing and printing prefixes (also as serde strings such as
//! `"10.0.0.0/24"`), containment and overlap, host-address enumeration, and the
//! two allocators [`derive_pod_cidr`] and [`derive_service_vip`]. Both allocators
//! are pure functions of their arguments: the same node-id or service name with
//! the same `taken` set always yields the same answer, on every node and across
//! releases, which is why the hash is a hand-rolled FNV-1a pinned by the
//! published test vectors rather than `std`'s randomly seeded hasher.
//!
//! Must never: touch the host or remember anything. Callers own the `taken`
//! sets and persist what was handed out; this module never hands out an address
//! or subnet that is in `taken`, and fails loudly instead of sharing one.

use std::collections::BTreeSet;
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// 32-bit FNV-1a over `bytes` (offset basis 2166136261, prime 16777619).
pub fn fnv1a32(bytes: &[u8]) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for b in bytes {
        hash ^= u32::from(*b);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash
}

/// Prefix length of one node subnet handed out by [`derive_pod_cidr`].
pub const POD_PREFIX: u8 = 24;

/// An IPv4 prefix such as `10.20.3.0/24`, or an address with its prefix length
/// such as `10.20.3.1/24` (the host bits are kept; see [`Ipv4Net::network`]).
///
/// Serialised as its string form (`"10.20.3.0/24"`), exactly as printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Net {
    addr: Ipv4Addr,
    prefix: u8,
}

/// Which allocator ran out of room (for [`CidrError::Exhausted`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    /// The /24 node subnets of `cluster_cidr`.
    NodeSubnets,
    /// The host addresses of `service_cidr` used as service VIPs.
    ServiceVips,
}

/// Why a prefix did not parse or fit, or an allocation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CidrError {
    /// Not `a.b.c.d/len` with len in 0..=32.
    Parse(String),
    /// `cluster_cidr` cannot hold even one node subnet.
    TooSmall {
        /// The range that was offered.
        range: Ipv4Net,
        /// The longest prefix that would do.
        need: u8,
    },
    /// Every slot of the range is taken.
    Exhausted {
        /// What was being allocated.
        pool: Pool,
        /// The range that is full.
        range: Ipv4Net,
        /// How many slots the range has in total.
        size: u64,
    },
}

impl fmt::Display for CidrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CidrError::Parse(s) => write!(
                f,
                "`{s}` is not an IPv4 prefix (expected a.b.c.d/len with len 0-32)"
            ),
            CidrError::TooSmall { range, need } => write!(
                f,
                "cluster_cidr {range} is smaller than one /{need} node subnet; \
                 configure a cluster_cidr of /{need} or shorter (for example a /16)"
            ),
            CidrError::Exhausted {
                pool: Pool::NodeSubnets,
                range,
                size,
            } => write!(
                f,
                "all {size} /{POD_PREFIX} node subnets of cluster_cidr {range} are taken; \
                 remove nodes that are gone for good or configure a larger cluster_cidr"
            ),
            CidrError::Exhausted {
                pool: Pool::ServiceVips,
                range,
                size,
            } => write!(
                f,
                "all {size} addresses of service_cidr {range} are taken by other services; \
                 delete unused services or configure a larger service_cidr"
            ),
        }
    }
}

impl std::error::Error for CidrError {}

impl Ipv4Net {
    /// A prefix from an address and a length (`prefix` <= 32).
    pub fn new(addr: Ipv4Addr, prefix: u8) -> Result<Ipv4Net, CidrError> {
        if prefix > 32 {
            return Err(CidrError::Parse(format!("{addr}/{prefix}")));
        }
        Ok(Ipv4Net { addr, prefix })
    }

    /// The address as given (host bits kept).
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix_len(&self) -> u8 {
        self.prefix
    }

    /// The netmask, e.g. 255.255.255.0 for /24.
    pub fn netmask(&self) -> Ipv4Addr {
        Ipv4Addr::from(mask(self.prefix))
    }

    /// The network address (host bits cleared).
    pub fn network(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) & mask(self.prefix))
    }

    /// The same prefix with host bits cleared.
    pub fn trunc(&self) -> Ipv4Net {
        Ipv4Net {
            addr: self.network(),
            prefix: self.prefix,
        }
    }

    /// True when `ip` lies inside this prefix.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & mask(self.prefix) == u32::from(self.network())
    }

    /// The last address of the prefix (all host bits set).
    pub fn broadcast(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network()) | !mask(self.prefix))
    }

    /// How many addresses the prefix spans, network and broadcast included.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }

    /// True when the two prefixes share at least one address.
    pub fn overlaps(&self, other: &Ipv4Net) -> bool {
        self.contains(other.network()) || other.contains(self.network())
    }

    /// The conventional gateway: the network address + 1 (`10.20.3.1` for
    /// `10.20.3.0/24`). Only meaningful for prefixes up to /30; a /31 or /32
    /// has no room for one and the result then lies outside the prefix.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network()).wrapping_add(1))
    }

    /// How many addresses can be given to hosts: all but the network and
    /// broadcast addresses, except that a /31 (RFC 3021) and a /32 have no
    /// network or broadcast address and use every address.
    pub fn host_count(&self) -> u64 {
        if self.prefix >= 31 {
            self.size()
        } else {
            self.size() - 2
        }
    }

    /// The `n`th host address (0-based, in address order), see
    /// [`Ipv4Net::host_count`]; `None` past the end.
    pub fn nth_host(&self, n: u64) -> Option<Ipv4Addr> {
        if n >= self.host_count() {
            return None;
        }
        let first = u64::from(u32::from(self.network())) + u64::from(self.prefix < 31);
        u32::try_from(first + n).ok().map(Ipv4Addr::from)
    }

    /// Every host address in order (see [`Ipv4Net::host_count`]).
    pub fn hosts(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        (0..self.host_count()).filter_map(|n| self.nth_host(n))
    }
}

/// The lowest address of `subnet` that a jail may get: neither the network
/// address, nor the gateway (network + 1, the bridge's own address), nor the
/// broadcast address, nor anything in `used`. `None` when the subnet is full
/// (a /31 or /32 never has room).
pub fn first_free_host(subnet: Ipv4Net, used: &BTreeSet<Ipv4Addr>) -> Option<Ipv4Addr> {
    if subnet.prefix_len() >= 31 {
        return None;
    }
    let first = u32::from(subnet.network()) + 2;
    let last = u32::from(subnet.broadcast()) - 1;
    // Every miss is an address in `used`, so this loop runs at most
    // `used.len() + 1` times however large the subnet is.
    (first..=last)
        .map(Ipv4Addr::from)
        .find(|ip| !used.contains(ip))
}

/// The node subnet (a /24 of `cluster_cidr`) for `node_id`.
///
/// The slot is `fnv1a32(node_id)` modulo the number of /24s in the range;
/// if that subnet overlaps anything in `taken`, the following /24s are tried
/// in order, wrapping around at the end of the range. The same inputs always
/// give the same subnet. Fails with [`CidrError::TooSmall`] when `cluster_cidr`
/// is longer than /24 and with [`CidrError::Exhausted`] when every /24 in it
/// overlaps something in `taken`.
pub fn derive_pod_cidr(
    node_id: &str,
    cluster_cidr: Ipv4Net,
    taken: &BTreeSet<Ipv4Net>,
) -> Result<Ipv4Net, CidrError> {
    let range = cluster_cidr.trunc();
    if range.prefix_len() > POD_PREFIX {
        return Err(CidrError::TooSmall {
            range: cluster_cidr,
            need: POD_PREFIX,
        });
    }
    let slots = 1u64 << (POD_PREFIX - range.prefix_len());
    let base = u64::from(u32::from(range.network()));
    let slot_net = |slot: u64| Ipv4Net {
        // base + slot * 256 stays within the range, hence within u32.
        addr: Ipv4Addr::from(u32::try_from(base + (slot << 8)).unwrap_or(u32::MAX)),
        prefix: POD_PREFIX,
    };
    let relevant: Vec<Ipv4Net> = taken
        .iter()
        .filter(|t| t.overlaps(&range))
        .copied()
        .collect();

    let mut slot = u64::from(fnv1a32(node_id.as_bytes())) % slots;
    let mut probed = 0u64;
    while probed < slots {
        let candidate = slot_net(slot);
        let Some(blocker) = relevant.iter().find(|t| t.overlaps(&candidate)) else {
            return Ok(candidate);
        };
        // A taken prefix wider than /24 blocks a run of slots; jump over all
        // of them at once. Same answer as probing one by one, but bounded by
        // the size of `taken` rather than the size of the range.
        let end = u64::from(u32::from(blocker.broadcast()).min(u32::from(range.broadcast())));
        let last_blocked = (end - base) >> 8;
        probed += last_blocked - slot + 1;
        slot = (last_blocked + 1) % slots;
    }
    Err(CidrError::Exhausted {
        pool: Pool::NodeSubnets,
        range,
        size: slots,
    })
}

/// The virtual IP for service `name`: a host address of `service_cidr` (see
/// [`Ipv4Net::host_count`]) not in `taken`.
///
/// Starts at host number `fnv1a32(name)` modulo the host count and probes
/// forward one address at a time, wrapping around. Fails with
/// [`CidrError::Exhausted`] when every host address is taken.
pub fn derive_service_vip(
    name: &str,
    service_cidr: Ipv4Net,
    taken: &BTreeSet<Ipv4Addr>,
) -> Result<Ipv4Addr, CidrError> {
    let range = service_cidr.trunc();
    let hosts = range.host_count();
    let exhausted = || CidrError::Exhausted {
        pool: Pool::ServiceVips,
        range,
        size: hosts,
    };
    // Counting first keeps the probe below bounded by `taken.len() + 1`.
    let reserved = |ip: Ipv4Addr| {
        range.prefix_len() < 31 && (ip == range.network() || ip == range.broadcast())
    };
    let taken_here = taken
        .iter()
        .filter(|ip| range.contains(**ip) && !reserved(**ip))
        .count();
    if u64::try_from(taken_here).unwrap_or(u64::MAX) >= hosts {
        return Err(exhausted());
    }
    let start = u64::from(fnv1a32(name.as_bytes())) % hosts;
    (0..hosts)
        .filter_map(|i| range.nth_host((start + i) % hosts))
        .find(|ip| !taken.contains(ip))
        .ok_or_else(exhausted)
}

fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix))
    }
}

impl fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Ipv4Net {
    type Err = CidrError;
    fn from_str(s: &str) -> Result<Ipv4Net, CidrError> {
        let err = || CidrError::Parse(s.to_string());
        let (a, p) = s.split_once('/').ok_or_else(err)?;
        let addr: Ipv4Addr = a.parse().map_err(|_| err())?;
        if p.is_empty() || p.len() > 2 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err());
        }
        let prefix: u8 = p.parse().map_err(|_| err())?;
        Ipv4Net::new(addr, prefix).map_err(|_| err())
    }
}

impl Serialize for Ipv4Net {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Ipv4Net {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Ipv4Net, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("test prefix")
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().expect("test address")
    }

    /// From the FNV reference test suite (test_fnv.c, FNV-1a 32-bit vectors).
    #[test]
    fn fnv1a32_matches_published_vectors() {
        let vectors: &[(&[u8], u32)] = &[
            (b"", 0x811c_9dc5),
            (b"a", 0xe40c_292c),
            (b"b", 0xe70c_2de5),
            (b"c", 0xe60c_2c52),
            (b"d", 0xe10c_2473),
            (b"e", 0xe00c_22e0),
            (b"f", 0xe30c_2799),
            (b"fo", 0x6222_e842),
            (b"foo", 0xa9f3_7ed7),
            (b"foob", 0x3f50_76ef),
            (b"fooba", 0x39aa_a18a),
            (b"foobar", 0xbf9c_f968),
            (b"\0", 0x050c_5d1f),
            (b"a\0", 0x2b24_d044),
            (b"foobar\0", 0x0c1c_9eb8),
        ];
        for (input, want) in vectors {
            assert_eq!(fnv1a32(input), *want, "fnv1a32({input:?})");
        }
    }

    #[test]
    fn parse_and_print_round_trip() {
        assert_eq!(net("10.20.3.1/24").to_string(), "10.20.3.1/24");
        assert_eq!(net("10.20.3.1/24").trunc().to_string(), "10.20.3.0/24");
        for bad in [
            "10.0.0.0",
            "10.0.0.0/33",
            "10.0.0/8",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "x/8",
        ] {
            assert!(bad.parse::<Ipv4Net>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn serde_uses_the_string_form() {
        let n = net("10.0.0.0/24");
        assert_eq!(
            serde_json::to_string(&n).expect("encode"),
            r#""10.0.0.0/24""#
        );
        let back: Ipv4Net = serde_json::from_str(r#""10.0.0.0/24""#).expect("decode");
        assert_eq!(back, n);
        let err = serde_json::from_str::<Ipv4Net>(r#""10.0.0.0/40""#).expect_err("bad prefix");
        assert!(err.to_string().contains("10.0.0.0/40"), "{err}");
    }

    #[test]
    fn prefix_arithmetic() {
        let n = net("10.20.3.77/24");
        assert_eq!(n.network(), ip("10.20.3.0"));
        assert_eq!(n.broadcast(), ip("10.20.3.255"));
        assert_eq!(n.gateway(), ip("10.20.3.1"));
        assert_eq!(n.size(), 256);
        assert_eq!(n.host_count(), 254);
        assert_eq!(n.nth_host(0), Some(ip("10.20.3.1")));
        assert_eq!(n.nth_host(253), Some(ip("10.20.3.254")));
        assert_eq!(n.nth_host(254), None);
        assert_eq!(n.hosts().count(), 254);
        assert_eq!(net("0.0.0.0/0").size(), 1 << 32);
        assert_eq!(net("255.255.255.255/0").nth_host(0), Some(ip("0.0.0.1")));
        let p2p = net("192.0.2.4/31");
        assert_eq!(
            p2p.hosts().collect::<Vec<_>>(),
            [ip("192.0.2.4"), ip("192.0.2.5")]
        );
        let single = net("192.0.2.9/32");
        assert_eq!(single.hosts().collect::<Vec<_>>(), [ip("192.0.2.9")]);
    }

    #[test]
    fn overlap_is_symmetric_and_exact() {
        assert!(net("10.0.0.0/16").overlaps(&net("10.0.3.0/24")));
        assert!(net("10.0.3.0/24").overlaps(&net("10.0.0.0/16")));
        assert!(net("10.0.3.128/25").overlaps(&net("10.0.3.0/24")));
        assert!(!net("10.0.3.0/24").overlaps(&net("10.0.4.0/24")));
        assert!(!net("10.0.3.0/25").overlaps(&net("10.0.3.128/25")));
    }

    #[test]
    fn first_free_host_skips_network_gateway_broadcast_and_used() {
        let subnet = net("10.20.3.0/24");
        assert_eq!(
            first_free_host(subnet, &BTreeSet::new()),
            Some(ip("10.20.3.2"))
        );
        let used: BTreeSet<_> = [ip("10.20.3.2"), ip("10.20.3.3"), ip("10.20.3.5")].into();
        assert_eq!(first_free_host(subnet, &used), Some(ip("10.20.3.4")));
        let all: BTreeSet<_> = (2..=254).map(|i| Ipv4Addr::new(10, 20, 3, i)).collect();
        assert_eq!(first_free_host(subnet, &all), None);
        let tiny = net("10.0.0.0/30");
        assert_eq!(
            first_free_host(tiny, &BTreeSet::new()),
            Some(ip("10.0.0.2"))
        );
        assert_eq!(first_free_host(net("10.0.0.0/31"), &BTreeSet::new()), None);
    }

    #[test]
    fn pod_cidr_starts_at_the_hashed_slot() {
        let cluster = net("10.64.0.0/16");
        let slot = fnv1a32(b"node-a") % 256;
        let want = Ipv4Net::new(Ipv4Addr::new(10, 64, slot as u8, 0), 24).expect("prefix");
        assert_eq!(
            derive_pod_cidr("node-a", cluster, &BTreeSet::new()),
            Ok(want)
        );
        // Pinned: nodes of an existing cluster must keep their subnets across
        // upgrades, so the derivation itself must never change.
        assert_eq!(want, net("10.64.147.0/24"));
    }

    #[test]
    fn pod_cidr_probes_forward_and_wraps() {
        let cluster = net("10.64.0.0/16");
        let first = derive_pod_cidr("node-a", cluster, &BTreeSet::new()).expect("free");
        let taken: BTreeSet<_> = [first].into();
        let second = derive_pod_cidr("node-a", cluster, &taken).expect("free");
        assert_eq!(
            u32::from(second.network()),
            u32::from(first.network()) + 256
        );

        // A taken /23 covering the hashed slot and the next is jumped over whole.
        let wide = Ipv4Net::new(first.network(), 23).expect("prefix").trunc();
        let got = derive_pod_cidr("node-a", cluster, &[wide].into()).expect("free");
        assert!(!got.overlaps(&wide));
        assert_eq!(
            got.network(),
            Ipv4Addr::from(u32::from(wide.broadcast()) + 1)
        );

        // In a /23 there are two slots; taking the hashed one leaves the other.
        let small = net("10.0.0.0/23");
        let a = derive_pod_cidr("n", small, &BTreeSet::new()).expect("free");
        let b = derive_pod_cidr("n", small, &[a].into()).expect("free");
        assert_ne!(a, b);
        assert!(small.overlaps(&b));
    }

    #[test]
    fn pod_cidr_errors_are_actionable() {
        let err =
            derive_pod_cidr("n", net("10.0.0.0/25"), &BTreeSet::new()).expect_err("too small");
        assert!(
            matches!(err, CidrError::TooSmall { need: 24, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("10.0.0.0/25"), "{err}");

        let cluster = net("10.0.0.0/23");
        let full: BTreeSet<_> = [net("10.0.0.0/24"), net("10.0.1.0/24")].into();
        let err = derive_pod_cidr("n", cluster, &full).expect_err("full");
        assert_eq!(
            err,
            CidrError::Exhausted {
                pool: Pool::NodeSubnets,
                range: cluster,
                size: 2
            }
        );
        assert!(err.to_string().contains("larger cluster_cidr"), "{err}");

        // One taken prefix covering the whole range exhausts it too.
        let err = derive_pod_cidr("n", net("10.0.0.0/16"), &[net("10.0.0.0/8")].into());
        assert!(
            matches!(err, Err(CidrError::Exhausted { size: 256, .. })),
            "{err:?}"
        );
    }

    #[test]
    fn service_vip_starts_at_the_hashed_host_and_skips_network_address() {
        let cidr = net("10.96.0.0/24");
        let n = u64::from(fnv1a32(b"web")) % 254;
        let want = cidr.nth_host(n).expect("in range");
        assert_eq!(derive_service_vip("web", cidr, &BTreeSet::new()), Ok(want));
        assert_eq!(
            want,
            ip("10.96.0.240"),
            "pinned: VIPs must not move across upgrades"
        );

        // Probing from the last host wraps to the first host, not the network
        // or broadcast address.
        let tiny = net("10.96.0.0/30");
        let hosts = [ip("10.96.0.1"), ip("10.96.0.2")];
        for name in ["a", "b", "c", "d"] {
            let first = derive_service_vip(name, tiny, &BTreeSet::new()).expect("free");
            let other = derive_service_vip(name, tiny, &[first].into()).expect("free");
            assert!(hosts.contains(&first) && hosts.contains(&other) && first != other);
        }
    }

    #[test]
    fn service_vip_exhaustion_is_a_hard_error() {
        let cidr = net("10.96.0.0/30");
        let taken: BTreeSet<_> = [ip("10.96.0.1"), ip("10.96.0.2")].into();
        let err = derive_service_vip("web", cidr, &taken).expect_err("full");
        assert_eq!(
            err,
            CidrError::Exhausted {
                pool: Pool::ServiceVips,
                range: cidr,
                size: 2
            }
        );
        assert!(
            err.to_string().contains("service_cidr 10.96.0.0/30"),
            "{err}"
        );
        // Addresses outside the range do not count towards exhaustion.
        let outside: BTreeSet<_> = [ip("10.96.0.1"), ip("10.97.0.2")].into();
        assert_eq!(
            derive_service_vip("web", cidr, &outside),
            Ok(ip("10.96.0.2"))
        );
    }

    /// A cluster range of /16 to /24 and a random subset of its /24 slots.
    fn cluster_and_taken() -> impl Strategy<Value = (Ipv4Net, BTreeSet<Ipv4Net>)> {
        (any::<u32>(), 16u8..=24).prop_flat_map(|(addr, prefix)| {
            let range = Ipv4Net::new(Ipv4Addr::from(addr), prefix)
                .expect("prefix")
                .trunc();
            let slots = 1u32 << (24 - prefix);
            proptest::collection::btree_set(0..slots, 0..=slots as usize).prop_map(move |idx| {
                let taken = idx
                    .into_iter()
                    .map(|i| {
                        let a = Ipv4Addr::from(u32::from(range.network()) + (i << 8));
                        Ipv4Net::new(a, 24).expect("prefix")
                    })
                    .collect();
                (range, taken)
            })
        })
    }

    /// A service range of /22 to /32 and a random subset of its addresses.
    fn service_and_taken() -> impl Strategy<Value = (Ipv4Net, BTreeSet<Ipv4Addr>)> {
        (any::<u32>(), 22u8..=32).prop_flat_map(|(addr, prefix)| {
            let range = Ipv4Net::new(Ipv4Addr::from(addr), prefix)
                .expect("prefix")
                .trunc();
            let size = range.size();
            proptest::collection::btree_set(0..size, 0..=size as usize).prop_map(move |idx| {
                let taken = idx
                    .into_iter()
                    .map(|i| Ipv4Addr::from(u32::from(range.network()) + i as u32))
                    .collect();
                (range, taken)
            })
        })
    }

    proptest! {
        #[test]
        fn pod_cidr_is_inside_free_deterministic_and_found_when_any_is_free(
            (range, taken) in cluster_and_taken(),
            node in "[a-z0-9-]{1,20}",
        ) {
            let slots = 1usize << (24 - range.prefix_len());
            let got = derive_pod_cidr(&node, range, &taken);
            prop_assert_eq!(&got, &derive_pod_cidr(&node, range, &taken));
            match got {
                Ok(sub) => {
                    prop_assert_eq!(sub.prefix_len(), 24);
                    prop_assert_eq!(sub, sub.trunc());
                    prop_assert!(range.contains(sub.network()) && range.contains(sub.broadcast()));
                    prop_assert!(taken.iter().all(|t| !t.overlaps(&sub)));
                }
                Err(e) => {
                    prop_assert_eq!(taken.len(), slots, "gave up with a free slot: {}", e);
                }
            }
        }

        #[test]
        fn service_vip_is_inside_free_deterministic_and_found_when_any_is_free(
            (range, taken) in service_and_taken(),
            name in "[a-z0-9-]{1,20}",
        ) {
            let got = derive_service_vip(&name, range, &taken);
            prop_assert_eq!(&got, &derive_service_vip(&name, range, &taken));
            let free_hosts = range.hosts().filter(|h| !taken.contains(h)).count();
            match got {
                Ok(vip) => {
                    prop_assert!(range.contains(vip));
                    prop_assert!(!taken.contains(&vip));
                    if range.prefix_len() < 31 {
                        prop_assert!(vip != range.network() && vip != range.broadcast());
                    }
                }
                Err(e) => prop_assert_eq!(free_hosts, 0, "gave up with a free host: {}", e),
            }
        }

        #[test]
        fn first_free_host_is_the_lowest_allowed(
            (subnet, used) in service_and_taken(),
        ) {
            let reserved = [subnet.network(), subnet.gateway(), subnet.broadcast()];
            let want = subnet
                .hosts()
                .find(|h| !used.contains(h) && !reserved.contains(h));
            let want = if subnet.prefix_len() >= 31 { None } else { want };
            prop_assert_eq!(first_free_host(subnet, &used), want);
        }

        /// Taken prefixes of any length (wider than the range, wider than a
        /// /24, narrower): the jumping probe must agree with probing one /24
        /// at a time.
        #[test]
        fn pod_cidr_agrees_with_one_by_one_probing(
            addr in any::<u32>(),
            prefix in 16u8..=24,
            raw in proptest::collection::vec((any::<u32>(), 14u8..=28), 0..12),
            node in "[a-z0-9-]{1,20}",
        ) {
            let range = Ipv4Net::new(Ipv4Addr::from(addr), prefix).expect("prefix").trunc();
            let taken: BTreeSet<Ipv4Net> = raw
                .into_iter()
                .map(|(off, len)| {
                    let off = off % (range.size() as u32 * 2);
                    let a = u32::from(range.network()).wrapping_add(off);
                    Ipv4Net::new(Ipv4Addr::from(a), len).expect("prefix").trunc()
                })
                .collect();
            let slots = 1u32 << (24 - prefix);
            let start = fnv1a32(node.as_bytes()) % slots;
            let oracle = (0..slots)
                .map(|i| {
                    let slot = (start + i) % slots;
                    let a = Ipv4Addr::from(u32::from(range.network()) + (slot << 8));
                    Ipv4Net::new(a, 24).expect("prefix")
                })
                .find(|c| taken.iter().all(|t| !t.overlaps(c)));
            prop_assert_eq!(derive_pod_cidr(&node, range, &taken).ok(), oracle);
        }

        #[test]
        fn display_parse_round_trip(addr in any::<u32>(), prefix in 0u8..=32) {
            let n = Ipv4Net::new(Ipv4Addr::from(addr), prefix).expect("prefix");
            prop_assert_eq!(n.to_string().parse::<Ipv4Net>(), Ok(n));
        }
    }
}
