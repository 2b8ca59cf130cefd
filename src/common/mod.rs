//! Shared by all three binaries. Nothing here touches the host except through
//! [`cmd::CommandRunner`] and the state directory handed to [`store`].

pub mod backoff;
pub mod cidr;
pub mod cmd;
pub mod config;
pub mod http;
pub mod spec;
pub mod store;
pub mod sync;
