//! Waiting until a DNS-01 challenge record is visible: ask each configured
//! public resolver directly, over UDP, for the TXT records of the challenge
//! name until every one of them answers with the expected value.
//!
//! It owns the DNS query (one question, TXT, recursion desired) and the
//! parsing of the answer. It must never ask the DNS provider's API (a record
//! the provider accepted is not yet one the CA's resolvers can see), never
//! panic on a malformed or hostile answer, and never wait past its deadline.
//!
//! Why a hand-written query rather than a DNS crate: Keel needs exactly one
//! message shape out and the TXT strings of one answer section back, about a
//! hundred lines with every read bounds-checked (and property-tested below to
//! never panic on arbitrary bytes). hickory-proto, the well-kept option, pulls
//! in some fifteen further crates (rand, url, idna, tracing, futures) and its
//! `std` feature tracing-subscriber, for that one message. Limits of the hand
//! version: no TCP fallback (a truncated answer counts as "not yet", an ACME
//! TXT value is 43 bytes), no EDNS, and TXT records anywhere in the answer
//! section count, so a resolver following a CNAME delegation of
//! `_acme-challenge` works.

use std::fmt;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::thread;
use std::time::{Duration, Instant};

/// Wait of one query for its answer.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(2);
/// First pause between two rounds of queries; it doubles up to [`MAX_PAUSE`].
pub const FIRST_PAUSE: Duration = Duration::from_millis(200);
/// Longest pause between two rounds.
pub const MAX_PAUSE: Duration = Duration::from_secs(10);

const TYPE_TXT: u16 = 16;
const CLASS_IN: u16 = 1;

/// Why propagation was not confirmed.
#[derive(Debug)]
pub enum PropagationError {
    /// The name cannot be put in a DNS query.
    BadName {
        /// The name.
        name: String,
    },
    /// The deadline passed before every resolver saw the value.
    Timeout {
        /// The challenge record's name.
        name: String,
        /// How long we waited.
        waited: Duration,
        /// The resolvers that never answered with the value, each with what
        /// it last said.
        missing: Vec<(SocketAddr, String)>,
    },
}

impl fmt::Display for PropagationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PropagationError::BadName { name } => {
                write!(f, "{name:?} is not a valid DNS name for a query")
            }
            PropagationError::Timeout {
                name,
                waited,
                missing,
            } => {
                write!(
                    f,
                    "the TXT record {name} was not visible at every resolver after {}s:",
                    waited.as_secs()
                )?;
                for (resolver, last) in missing {
                    write!(f, " {resolver} ({last});")?;
                }
                write!(
                    f,
                    " check the record at the DNS provider, ingress.resolvers, and raise \
                     ingress.propagation_timeout if the provider is slow"
                )
            }
        }
    }
}

impl std::error::Error for PropagationError {}

/// What one resolver said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The TXT values at the name (each record's strings concatenated).
    Txt(Vec<String>),
    /// No such name (NXDOMAIN).
    NoName,
    /// The answer was truncated; over UDP that means "ask again later".
    Truncated,
    /// The resolver failed (SERVFAIL, REFUSED, ...).
    Rcode(u8),
}

/// Builds the query for the TXT records of `name` with transaction `id`.
pub fn encode_query(id: u16, name: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(18 + name.len());
    out.extend_from_slice(&id.to_be_bytes());
    // Flags: standard query, recursion desired.
    out.extend_from_slice(&[0x01, 0x00]);
    // QDCOUNT 1, ANCOUNT/NSCOUNT/ARCOUNT 0.
    out.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]);
    let name = name.trim_end_matches('.');
    if name.is_empty() || name.len() > 253 {
        return None;
    }
    for label in name.split('.') {
        let len = u8::try_from(label.len())
            .ok()
            .filter(|l| (1..=63).contains(l))?;
        out.push(len);
        out.extend_from_slice(label.as_bytes());
    }
    out.push(0);
    out.extend_from_slice(&TYPE_TXT.to_be_bytes());
    out.extend_from_slice(&CLASS_IN.to_be_bytes());
    Some(out)
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let end = self.pos.checked_add(n)?;
        let out = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(out)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    /// Steps over a (possibly compressed) name; a pointer ends it.
    fn skip_name(&mut self) -> Option<()> {
        loop {
            let len = self.u8()?;
            match len & 0xC0 {
                0xC0 => {
                    self.u8()?;
                    return Some(());
                }
                0x00 if len == 0 => return Some(()),
                0x00 => {
                    self.take(usize::from(len))?;
                }
                // 0x40 and 0x80 are reserved label types.
                _ => return None,
            }
        }
    }
}

/// Parses an answer to the query `id`; `None` when it is not one (wrong id,
/// not a response, malformed).
pub fn parse_answer(id: u16, buf: &[u8]) -> Option<Answer> {
    let mut r = Reader { buf, pos: 0 };
    if r.u16()? != id {
        return None;
    }
    let flags = r.u16()?;
    if flags & 0x8000 == 0 {
        return None;
    }
    let qdcount = r.u16()?;
    let ancount = r.u16()?;
    r.take(4)?;
    if flags & 0x0200 != 0 {
        return Some(Answer::Truncated);
    }
    match (flags & 0x000F) as u8 {
        0 => {}
        3 => return Some(Answer::NoName),
        rcode => return Some(Answer::Rcode(rcode)),
    }
    for _ in 0..qdcount {
        r.skip_name()?;
        r.take(4)?;
    }
    let mut values = Vec::new();
    for _ in 0..ancount {
        r.skip_name()?;
        let rtype = r.u16()?;
        let class = r.u16()?;
        r.take(4)?;
        let rdlen = usize::from(r.u16()?);
        let rdata = r.take(rdlen)?;
        if rtype != TYPE_TXT || class != CLASS_IN {
            continue;
        }
        let mut value = Vec::new();
        let mut txt = Reader { buf: rdata, pos: 0 };
        while txt.pos < rdata.len() {
            let len = usize::from(txt.u8()?);
            value.extend_from_slice(txt.take(len)?);
        }
        values.push(String::from_utf8_lossy(&value).into_owned());
    }
    Some(Answer::Txt(values))
}

/// Asks `resolver` once for the TXT records of `name`, waiting at most
/// `timeout` for the answer. Answers with another id (late answers to an
/// earlier query) are skipped.
pub fn query_txt(resolver: SocketAddr, name: &str, timeout: Duration) -> io::Result<Answer> {
    let mut id = [0u8; 2];
    getrandom::fill(&mut id).map_err(|e| io::Error::other(e.to_string()))?;
    let id = u16::from_be_bytes(id);
    let query = encode_query(id, name)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "invalid DNS name"))?;
    let bind: SocketAddr = if resolver.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        ([0u16; 8], 0).into()
    };
    let socket = UdpSocket::bind(bind)?;
    // connect() makes the kernel drop datagrams from anyone but the resolver.
    socket.connect(resolver)?;
    socket.send(&query)?;
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no answer"));
        }
        socket.set_read_timeout(Some(left))?;
        let n = match socket.recv(&mut buf) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no answer"));
            }
            Err(e) => return Err(e),
        };
        if let Some(answer) = parse_answer(id, &buf[..n]) {
            return Ok(answer);
        }
    }
}

/// Polls every resolver in `resolvers` until each has answered the TXT query
/// for `name` with `value` among its records, pausing between rounds with a
/// doubling backoff; gives up after `timeout`. A resolver that saw the value
/// once is not asked again.
pub fn wait_for_txt(
    resolvers: &[SocketAddr],
    name: &str,
    value: &str,
    timeout: Duration,
) -> Result<(), PropagationError> {
    if encode_query(0, name).is_none() {
        return Err(PropagationError::BadName {
            name: name.to_string(),
        });
    }
    let start = Instant::now();
    let deadline = start + timeout;
    let mut missing: Vec<(SocketAddr, String)> = resolvers
        .iter()
        .map(|r| (*r, "not asked yet".to_string()))
        .collect();
    let mut pause = FIRST_PAUSE;
    loop {
        for (resolver, last) in missing.iter_mut() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            *last = match query_txt(*resolver, name, QUERY_TIMEOUT.min(left)) {
                Ok(Answer::Txt(values)) if values.iter().any(|v| v == value) => String::new(),
                Ok(Answer::Txt(values)) if values.is_empty() => "no TXT record".into(),
                Ok(Answer::Txt(values)) => format!("other values: {}", values.join(", ")),
                Ok(Answer::NoName) => "NXDOMAIN".into(),
                Ok(Answer::Truncated) => "truncated answer".into(),
                Ok(Answer::Rcode(rcode)) => format!("rcode {rcode}"),
                Err(e) => e.to_string(),
            };
        }
        missing.retain(|(_, last)| !last.is_empty());
        if missing.is_empty() {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(PropagationError::Timeout {
                name: name.to_string(),
                waited: start.elapsed(),
                missing,
            });
        }
        // Polling a remote system: nothing to wait on but time.
        thread::sleep(pause.min(left));
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// An answer to `id` for `_acme-challenge.a.example` TXT with the given
    /// records, the owner name compressed to the question.
    fn answer(id: u16, flags: u16, records: &[&[&str]]) -> Vec<u8> {
        let mut q = encode_query(id, "_acme-challenge.a.example").expect("name");
        q[2..4].copy_from_slice(&flags.to_be_bytes());
        q[6..8].copy_from_slice(&(records.len() as u16).to_be_bytes());
        for strings in records {
            q.extend_from_slice(&[0xC0, 12, 0, 16, 0, 1, 0, 0, 0, 60]);
            let rdata: Vec<u8> = strings
                .iter()
                .flat_map(|s| std::iter::once(s.len() as u8).chain(s.bytes()))
                .collect();
            q.extend_from_slice(&(rdata.len() as u16).to_be_bytes());
            q.extend_from_slice(&rdata);
        }
        q
    }

    #[test]
    fn query_is_the_wire_format() {
        let q = encode_query(0xBEEF, "_a.b.").expect("valid");
        assert_eq!(
            q,
            [
                0xBE, 0xEF, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 2, b'_', b'a', 1, b'b', 0, 0, 16, 0, 1
            ]
        );
        assert!(encode_query(1, "a..b").is_none());
        assert!(encode_query(1, &"x".repeat(64)).is_none());
    }

    #[test]
    fn answers_are_parsed() {
        let a = answer(7, 0x8180, &[&["abc"], &["de", "f"]]);
        assert_eq!(
            parse_answer(7, &a),
            Some(Answer::Txt(vec!["abc".into(), "def".into()]))
        );
        assert_eq!(parse_answer(8, &a), None, "other id");
        assert_eq!(
            parse_answer(7, &answer(7, 0x8183, &[])),
            Some(Answer::NoName)
        );
        assert_eq!(
            parse_answer(7, &answer(7, 0x8182, &[])),
            Some(Answer::Rcode(2))
        );
        assert_eq!(
            parse_answer(7, &answer(7, 0x8380, &[])),
            Some(Answer::Truncated)
        );
        assert_eq!(parse_answer(7, &answer(7, 0x0100, &[])), None, "a query");
        let cut = &a[..a.len() - 1];
        assert_eq!(parse_answer(7, cut), None, "truncated datagram");
    }

    #[test]
    fn a_silent_resolver_times_out_naming_it() {
        let silent = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let addr = silent.local_addr().expect("addr");
        let err = wait_for_txt(
            &[addr],
            "_acme-challenge.a.example",
            "v",
            Duration::from_millis(300),
        )
        .expect_err("nothing answers");
        let text = err.to_string();
        assert!(text.contains(&addr.to_string()), "{text}");
        assert!(text.contains("propagation_timeout"), "{text}");
    }

    proptest! {
        #[test]
        fn parsing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = parse_answer(u16::from_be_bytes([bytes.first().copied().unwrap_or(0), bytes.get(1).copied().unwrap_or(0)]), &bytes);
        }
    }
}
