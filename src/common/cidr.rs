//! IPv4 prefix maths, FNV-1a, and the deterministic derivation of node subnets
//! (pod_cidr) and service virtual IPs.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// 32-bit FNV-1a over `bytes` (offset basis 2166136261, prime 16777619).
pub fn fnv1a32(bytes: &[u8]) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for b in bytes {
        hash ^= u32::from(*b);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash
}

/// An IPv4 prefix such as `10.20.3.0/24`, or an address with its prefix length
/// such as `10.20.3.1/24` (the host bits are kept; see [`Ipv4Net::network`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Net {
    addr: Ipv4Addr,
    prefix: u8,
}

/// Why a prefix did not parse or fit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CidrError {
    /// Not `a.b.c.d/len` with len in 0..=32.
    Parse(String),
}

impl fmt::Display for CidrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CidrError::Parse(s) => write!(
                f,
                "`{s}` is not an IPv4 prefix (expected a.b.c.d/len with len 0-32)"
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
