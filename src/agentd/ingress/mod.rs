//! Ingress (issue 7): the node-wide nginx jail that publishes Services over
//! HTTPS.
//!
//! | file | owns |
//! |---|---|
//! | [`nginx`] | `nginx.conf` as a pure function of every applied Ingress |

pub mod nginx;
