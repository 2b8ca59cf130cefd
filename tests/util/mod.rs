//! Helpers shared by the integration tests.

#![allow(dead_code)]

pub mod agent;
pub mod cluster;
pub mod controlplane;
pub mod golden;
pub mod load;
