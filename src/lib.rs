//! Keel: declarative FreeBSD jails, replicated services behind virtual IPs,
//! persistent ZFS volumes and automatic HTTPS, under one small control plane.
//!
//! # Layout
//!
//! - [`common`]: pieces every binary shares: spec parsing and validation,
//!   `keel.toml`, the HTTP server and client, request signing, CIDR maths,
//!   the crash-safe store, crash-loop backoff, the argv-only command runner
//!   and the JSON bodies the daemons exchange.
//! - [`host`]: everything that touches FreeBSD, one trait per subsystem with a
//!   Fake (tests, any OS) and a FreeBSD implementation over
//!   [`common::cmd::CommandRunner`], plus the simulated host of `--simulate`.
//! - [`agentd`]: the node agent: reconciler, state, API, cluster membership,
//!   service proxy, ingress.
//! - [`controlplane`]: registry, scheduler, placements, services, router, API.
//! - [`ctl`]: the `keelctl` commands and their output.
//!
//! Dependency rules: `controlplane` never imports `common::spec` (spec bodies stay
//! opaque there), `ctl` never imports `host`, and `agentd` and `controlplane` never
//! import each other; what they exchange lives in `common::wire`.

pub mod agentd;
pub mod common;
pub mod controlplane;
pub mod ctl;
pub mod host;
