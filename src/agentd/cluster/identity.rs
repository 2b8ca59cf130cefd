//! Who this node is to the control plane: its node id (configured, or the
//! first label of the hostname) and its size as the scheduler counts it,
//! both decided once at startup. It never talks to the control plane.

use crate::agentd::cluster::error::ClusterError;
use crate::common::spec;
use crate::common::wire::Resources;
use crate::host::capacity::{Capacity, FakeCapacity};

/// The node id: `agent.node_id` when set, else derived from the hostname
/// (see [`node_id_from_hostname`]).
pub fn node_id(configured: Option<&str>) -> Result<String, ClusterError> {
    if let Some(id) = configured {
        return Ok(id.to_string());
    }
    let host = hostname().map_err(|e| {
        ClusterError::NodeId(format!(
            "cannot read the hostname ({e}); set agent.node_id (or --node-id)"
        ))
    })?;
    node_id_from_hostname(&host)
}

/// The node id a hostname gives: its first label, lowercased
/// (`Web-1.example.org` is `web-1`), which must be a DNS label.
pub fn node_id_from_hostname(host: &str) -> Result<String, ClusterError> {
    let label = host
        .split('.')
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase();
    spec::validate_name(&label).map_err(|why| {
        ClusterError::NodeId(format!(
            "the hostname {host:?} gives no usable node id ({label:?} {why}); set agent.node_id (or --node-id) to a DNS label"
        ))
    })?;
    Ok(label)
}

#[allow(unsafe_code)]
fn hostname() -> std::io::Result<String> {
    // 256 bytes is above HOST_NAME_MAX on FreeBSD (255) and Linux (64).
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is a writable buffer of exactly `buf.len()` bytes, which is
    // the length passed; gethostname(3) writes at most that many bytes into it
    // and nothing else, and `buf` outlives the call.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // A truncated name may lack its NUL; the buffer's end bounds it then.
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// The host's size as the scheduler counts it, detected once at startup.
pub fn detect_capacity(capacity: &impl Capacity) -> Result<Resources, ClusterError> {
    let c = capacity.detect().map_err(ClusterError::Capacity)?;
    Ok(Resources {
        cpu: f64::from(c.cpus),
        memory: c.memory_bytes,
    })
}

/// Capacity for `--simulate`: this machine's CPU count and, where
/// `/proc/meminfo` is readable, its memory; the Fake's defaults otherwise.
pub fn simulated_capacity() -> FakeCapacity {
    let fallback = FakeCapacity::default().detect().ok();
    let cpus = std::thread::available_parallelism()
        .ok()
        .map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX))
        .or(fallback.map(|f| f.cpus));
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| meminfo_total(&text))
        .or(fallback.map(|f| f.memory_bytes));
    match (cpus, memory) {
        (Some(cpus), Some(memory)) => FakeCapacity::new(cpus, memory),
        _ => FakeCapacity::default(),
    }
}

/// `MemTotal` from Linux's `/proc/meminfo` (`MemTotal:  16318412 kB`), in bytes.
pub fn meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_come_from_the_first_hostname_label() {
        assert_eq!(
            node_id_from_hostname("Web-1.example.org").expect("valid"),
            "web-1"
        );
        assert_eq!(node_id_from_hostname("n3").expect("valid"), "n3");
        for bad in ["", "web_1", "-web", "1234"] {
            let err = node_id_from_hostname(bad).expect_err(bad);
            assert!(err.to_string().contains("agent.node_id"), "{err}");
        }
        assert_eq!(node_id(Some("n9")).expect("configured"), "n9");
    }

    #[test]
    fn meminfo_total_is_read_in_bytes() {
        let text = "MemTotal:       16318412 kB\nMemFree:         1234 kB\n";
        assert_eq!(meminfo_total(text), Some(16_318_412 * 1024));
        assert_eq!(meminfo_total("MemFree: 1 kB\n"), None);
        assert_eq!(meminfo_total("MemTotal: lots kB\n"), None);
        let sim = detect_capacity(&simulated_capacity()).expect("fake capacity");
        assert!(sim.cpu >= 1.0 && sim.memory > 0);
    }
}
