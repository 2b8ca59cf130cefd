//! Integration tests, linked into one binary (`autotests = false`).
//! Each module is one area; `util` holds the shared helpers.

mod acme_e2e;
mod admission;
mod auth;
mod cluster_agent;
mod cluster_e2e;
mod config_cli;
mod controlplane;
mod crash_campaign;
mod ctl;
mod ctl_ingress;
mod ctl_services;
mod golden_agent;
mod golden_capacity;
mod golden_ingress;
mod golden_jail;
mod golden_mount;
mod golden_net;
mod golden_pf;
mod golden_routes;
mod golden_zfs;
mod hostile;
mod http;
mod ingress_e2e;
mod nginx_conf;
mod packaging;
mod partitions;
mod proxy;
mod proxy_e2e;
mod reconciler;
mod services_e2e;
mod sim;
mod soak;
mod spec_examples;
mod util;
mod volumes_e2e;
