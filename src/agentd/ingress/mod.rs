//! Ingress (issue 7): the node-wide nginx jail that publishes Services over
//! HTTPS.
//!
//! | file | owns |
//! |---|---|
//! | [`nginx`] | `nginx.conf` as a pure function of every applied Ingress |
//! | [`pf`] | the `keel/ingress` anchor: public ports 80 and 443 to the ingress jail |

pub mod nginx;
pub mod pf;
