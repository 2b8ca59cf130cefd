//! keel-agentd, the node agent.
//!
//! | module | owns |
//! |---|---|
//! | [`reconciler`] | desired vs observed state of this host's jails; provision, restart, delete |
//! | [`worker`] | the one thread that owns the reconciler, and the channel to it |
//! | [`snapshot`] | what the worker publishes for readers that must not wait for it (the heartbeat) |
//! | [`api`] | the route table served on the Unix socket (and TCP when clustered) |
//! | [`health`] | `spec.health` probes on threads of their own; readiness and restarts reported to the worker |
//! | [`cluster`] | registration and heartbeats when clustered, off the worker |
//! | [`routes`] | what the worker does with a heartbeat answer: subnet, peer routes, VIP aliases, fencing |
//! | [`bases`] | `keelctl base fetch`: download, verify and install release bases, on threads of their own |
//! | [`volumes`] | `GET/DELETE /volumes`: volume datasets keyed by dataset path, never by jail records |
//! | [`metrics`] | Prometheus text for `GET /metrics` |
//! | [`usage`] | per-jail CPU and memory usage, sampled on a thread of its own for the metrics |
//! | [`proxy`] | the per-node L4 proxy: service VIP listeners relaying to replicas |
//! | [`ingress`] | the nginx ingress jail: its configuration, the pf anchor, certificates (ACME DNS-01 through OVH) |
//! | [`daemon`] | startup, host selection (FreeBSD or simulated), shutdown |
//! | [`cli`] | flags and `--check-config` |
//!
//! It reaches the host only through the `host` traits and never imports
//! `controlplane`: what the two daemons exchange lives in `common::wire`.

pub mod api;
pub mod bases;
pub mod cli;
pub mod cluster;
pub mod daemon;
#[cfg(test)]
mod fixtures;
pub mod health;
pub mod ingress;
pub mod metrics;
pub mod proxy;
pub mod reconciler;
pub mod routes;
pub mod snapshot;
pub mod usage;
pub mod volumes;
pub mod worker;

pub use daemon::{RunError, run};
