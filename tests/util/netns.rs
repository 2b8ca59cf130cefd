//! Network namespaces for the tests that cut links: made with iproute2
//! (argv, no shell, a timeout on every command), named after the test
//! process's pid and a counter so parallel runs and parallel tests never
//! collide, and deleted when the [`Namespaces`] drops, a failed assertion
//! included (deleting a namespace deletes the veths in it, and their peers
//! wherever those are).
//!
//! Namespaces need root. [`Namespaces::new`] says why when they cannot be
//! made and returns `None`, so the test passes, unless the environment
//! variable `CI` is set: then it fails, so a CI run never passes without
//! the partition tests having run.

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel::common::cmd::{CommandRunner, SystemRunner, argv};

/// iproute2.
pub const IP: &str = "/usr/sbin/ip";
/// Bound on one `ip` command.
const IP_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `ip ARGS`.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let mut full = vec![IP];
    full.extend_from_slice(args);
    let argv = argv(&full);
    SystemRunner
        .run(&argv, None, IP_TIMEOUT)
        .and_then(|out| out.check(&argv))
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The namespaces of one test; see the module docs.
pub struct Namespaces {
    /// `{kind}-{pid}-{counter}`: every name of this test starts with it.
    prefix: String,
    /// A small number unique in this process, for names and subnets.
    pub serial: usize,
    /// Namespaces created so far (deleted in reverse order).
    created: Vec<String>,
}

impl Namespaces {
    /// A set of namespaces holding one named `first`; `None` (the reason
    /// printed) when namespaces cannot be made here.
    pub fn new(test: &str, kind: &str, first: &str) -> Option<Namespaces> {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let serial = COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut spaces = Namespaces {
            prefix: format!("{kind}-{}-{serial}", std::process::id()),
            serial,
            created: Vec::new(),
        };
        match spaces.add(first) {
            Ok(_) => Some(spaces),
            Err(e) => {
                let why = format!(
                    "{test}: network namespaces are unavailable ({e}); the partition tests need root and iproute2"
                );
                assert!(std::env::var_os("CI").is_none(), "{why} (CI is set)");
                eprintln!("skipping {why}");
                None
            }
        }
    }

    /// Adds the namespace of `member`; answers its name.
    pub fn add(&mut self, member: &str) -> Result<String, String> {
        let ns = self.name(member);
        ip(&["netns", "add", &ns])?;
        self.created.push(ns.clone());
        // Loopback is down in a new namespace; simulated jails use it.
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace name of `member`.
    pub fn name(&self, member: &str) -> String {
        format!("{}-{member}", self.prefix)
    }

    /// The command prefix that runs a program in `member`'s namespace
    /// (`ip netns exec` execs it, so the child is the program itself).
    pub fn exec(&self, member: &str) -> Vec<String> {
        vec![IP.into(), "netns".into(), "exec".into(), self.name(member)]
    }

    /// A /29 of 10.214.0.0/16 for [`Namespaces::join_host`], from the pid
    /// and the serial: distinct for parallel tests and, but for a pid
    /// clash modulo 256, for parallel runs.
    pub fn subnet(&self) -> Ipv4Addr {
        let third = u8::try_from(std::process::id() % 256).expect("below 256");
        let fourth = u8::try_from(self.serial % 32 * 8).expect("below 256");
        Ipv4Addr::new(10, 214, third, fourth)
    }

    /// Joins `member`'s namespace to the test host's by a veth pair on the
    /// /29 `subnet` (its last octet a multiple of 8, like
    /// [`Namespaces::subnet`]'s): the host's end gets the subnet's `+1`
    /// and `+3` addresses, the member's the `+2`; answers them. The host
    /// reaches the member from `+1`, its primary address; `+3` is a second
    /// address a test can cut the member off from alone
    /// ([`Namespaces::drop_route`]).
    pub fn join_host(&self, member: &str, subnet: Ipv4Addr) -> Result<HostLink, String> {
        let [a, b, c, base] = subnet.octets();
        let at = |d| Ipv4Addr::new(a, b, c, base + d);
        let link = HostLink {
            host: at(1),
            inside: at(2),
            host_extra: at(3),
        };
        let ns = self.name(member);
        // IFNAMSIZ is 16: "kh" and two numbers fit.
        let host_end = format!("kh{}x{}", std::process::id() % 100_000, self.serial);
        ip(&[
            "link", "add", &host_end, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ])?;
        for addr in [link.host, link.host_extra] {
            ip(&["addr", "add", &format!("{addr}/29"), "dev", &host_end])?;
        }
        ip(&["link", "set", &host_end, "up"])?;
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{}/29", link.inside),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        Ok(link)
    }

    /// Inside `member`'s namespace, packets to `to` go nowhere from now on
    /// (a blackhole route): established connections hang, new ones fail.
    pub fn drop_route(&self, member: &str, to: Ipv4Addr) {
        let ns = self.name(member);
        ip(&["-n", &ns, "route", "add", "blackhole", &format!("{to}/32")]).expect("cut a route");
    }

    /// Undoes [`Namespaces::drop_route`].
    pub fn restore_route(&self, member: &str, to: Ipv4Addr) {
        let ns = self.name(member);
        ip(&["-n", &ns, "route", "del", "blackhole", &format!("{to}/32")])
            .expect("restore a route");
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in self.created.iter().rev() {
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("cleaning up network namespace {ns}: {e}");
            }
        }
    }
}

/// The addresses of [`Namespaces::join_host`].
#[derive(Debug, Clone, Copy)]
pub struct HostLink {
    /// The host's end, primary: what the host's connections come from.
    pub host: Ipv4Addr,
    /// The member's end.
    pub inside: Ipv4Addr,
    /// The host's end, second address.
    pub host_extra: Ipv4Addr,
}
