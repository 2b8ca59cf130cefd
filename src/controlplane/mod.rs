//! keel-controlplane: several hosts as one cluster.
//!
//! | module | owns |
//! |---|---|
//! | [`registry`] | nodes and liveness, pod_cidrs, placements, applies in flight |
//! | [`scheduler`] | `pick_node`: a pure ranking of Alive nodes by headroom |
//! | [`state`] | what is persisted, and the ops that change it |
//! | [`worker`] | the one thread owning the registry, and the batches it hands to the journal |
//! | [`commit`] | the journal's writer thread: batches made durable in order, then answered |
//! | [`etcd_state`] | the cluster state in etcd: the journal's batches as keys, every write fenced by the leader key |
//! | [`leader`] | which of several control planes decides: the leader key under a lease, and a deposed leader's fence |
//! | [`node_leases`] | the cluster's record of live nodes in etcd: keys under shared leases, written as heartbeats arrive, read by the next leader |
//! | [`standby`] | what a control plane serves while another leads: requests relayed to the leader |
//! | [`etcd`] | a blocking etcd v3 client: prefix reads, compare-and-write transactions, leases, a lease-guarded leader key |
//! | [`endpoint_board`] | the endpoint table the worker publishes and long polls wait on |
//! | [`api`] | the route table, request signing checks, forwarding to agents |
//! | [`heal`] | carrying out a planned heal, concurrently with a bound per node |
//! | [`metrics`] | Prometheus text, and the per-route request counts around the API |
//! | [`diff`] | a Service's object diff against the one held (`keelctl diff`) |
//! | [`transfer`] | `--export-state` and `--import-state`: the state out of a state directory, and into an empty one |
//! | [`daemon`] | startup and shutdown |
//! | [`cli`] | flags and `--check-config` |
//!
//! It never imports `common::spec` (spec bodies stay opaque here) nor
//! `agentd`: what the two daemons exchange lives in `common::wire`.

pub mod api;
pub mod cli;
pub mod commit;
pub mod daemon;
pub mod diff;
pub mod endpoint_board;
pub mod etcd;
pub mod etcd_state;
pub mod heal;
pub mod leader;
pub mod metrics;
pub mod node_leases;
pub mod registry;
pub mod scheduler;
pub mod standby;
pub mod state;
pub mod transfer;
pub mod worker;

pub use daemon::{RunError, run};
