//! Shared by all three binaries: specs, configuration, HTTP, CIDR maths, the
//! crash-safe store, the state-directory lock, backoff, logging, request signing and the command runner. Nothing here runs
//! a host command except through [`cmd::CommandRunner`]; the only host state it
//! touches directly is the daemon's own files (state directory, sockets).

pub mod auth;
pub mod backoff;
pub mod cidr;
pub mod cmd;
pub mod config;
pub mod events;
pub mod faults;
pub mod http;
pub mod journal;
pub mod lockfile;
pub mod logging;
pub mod metrics;
pub mod names;
pub mod objdiff;
pub mod refusals;
pub mod replay_floor;
pub mod spec;
pub mod store;
pub mod supervise;
pub mod sync;
pub mod wire;
