//! What the agent's unit tests share: a reconciler over the Fake host seams,
//! a jail spec, a peer. Test-only; never compiled into the daemon.

use std::net::Ipv4Addr;
use std::path::Path;

use crate::agentd::reconciler::{AgentState, AgentStore, NodeNetwork, Reconciler};
use crate::common::backoff::ManualClock;
use crate::common::cidr::Ipv4Net;
use crate::common::spec;
use crate::common::wire::Peer;
use crate::host::fake::{CallLog, Faults};
use crate::host::jail::FakeJails;
use crate::host::mount::FakeMounts;
use crate::host::net::FakeNet;
use crate::host::zfs::FakeZfs;

/// A reconciler over the Fake host seams.
pub type FakeReconciler = Reconciler<FakeJails, FakeZfs, FakeNet, FakeMounts>;

/// The node subnet of a [`fake_reconciler`] that has none persisted.
pub const DEFAULT_SUBNET: &str = "10.20.0.0/24";

/// A reconciler keeping its state in `dir` (so a second one on the same
/// directory is a restarted agent), over `net` and Fakes that never fail,
/// with base 14.2-RELEASE present.
pub fn fake_reconciler(dir: &Path, net: FakeNet) -> FakeReconciler {
    let log = CallLog::new();
    let (store, state) = AgentStore::open(dir).expect("store");
    let zfs = FakeZfs::new(log.clone(), Faults::default());
    zfs.add_base("14.2-RELEASE");
    let subnet = state
        .as_ref()
        .and_then(|s: &AgentState| s.node_subnet)
        .unwrap_or_else(|| DEFAULT_SUBNET.parse::<Ipv4Net>().expect("prefix"));
    Reconciler::new(
        FakeJails::new(log.clone(), Faults::default()),
        zfs,
        net,
        FakeMounts::new(log, Faults::default()),
        NodeNetwork {
            bridge: "keel0".into(),
            subnet,
        },
        store,
        state,
        Box::new(ManualClock::new()),
    )
}

/// Jail `name` on base 14.2-RELEASE, at `address` when given.
pub fn jail(name: &str, address: Option<&str>) -> spec::Jail {
    let addr = address
        .map(|a| format!("  network:\n    address: {a}\n"))
        .unwrap_or_default();
    spec::parse_jail(&format!(
        "kind: Jail\nmetadata:\n  name: {name}\nspec:\n  base: 14.2-RELEASE\n{addr}  exec:\n    start: [\"/bin/sleep\", \"60\"]\n"
    ))
    .expect("test spec")
}

/// A peer `id` at `address` whose subnet is `cidr`.
pub fn peer(id: &str, address: [u8; 4], cidr: &str, alive: bool) -> Peer {
    Peer {
        node_id: id.into(),
        address: Ipv4Addr::from(address),
        pod_cidr: cidr.into(),
        alive,
    }
}
