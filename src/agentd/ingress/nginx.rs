//! The ingress jail's nginx configuration, as a pure function of every
//! applied Ingress together.
//!
//! [`render`] owns the text of `nginx.conf` and nothing else: it never reads
//! a file, never runs nginx and never decides which Ingress is servable (the
//! caller passes only [`Site`]s whose Service VIP is known and whose
//! certificate is installed). Validating with `nginx -t` and reloading happen
//! in the ingress jail, elsewhere.
//!
//! What the configuration does:
//! - one `server` per host on port 443 with that host's certificate, chosen by
//!   SNI, relaying to the backend Service's `VIP:port` (`proxy_pass`), with
//!   the usual forwarding headers;
//! - one `server` on port 80 for every host, which only redirects to HTTPS;
//! - default servers that refuse what names no host: port 80 closes the
//!   connection (444), port 443 rejects the TLS handshake, so a scan of the
//!   public address learns no host name from a certificate.
//!
//! Every host reaching this module passed `spec::validate_host` (a lowercase
//! ASCII FQDN: no whitespace, `;`, braces or quotes can break out of a
//! directive); [`render`] checks it again and refuses anything else rather
//! than trusting the caller.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};

use crate::common::spec::validate_host;

/// One host nginx serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    /// The Ingress's host (its certificate's name).
    pub host: String,
    /// The backend Service's `VIP:port`.
    pub upstream: SocketAddrV4,
    /// Certificate chain (PEM), as nginx inside the jail sees the path.
    pub certificate: PathBuf,
    /// Private key (PEM, mode 0600), as nginx sees the path.
    pub key: PathBuf,
}

/// Where nginx keeps its runtime files and what it listens on. The defaults
/// are those of the ingress jail; tests move everything under a directory of
/// their own and onto free ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NginxLayout {
    /// Pid file.
    pub pid: PathBuf,
    /// Error log.
    pub error_log: PathBuf,
    /// Access log.
    pub access_log: PathBuf,
    /// Directory for nginx's temporary files (request bodies, buffered
    /// upstream responses).
    pub temp_dir: PathBuf,
    /// Port of the redirecting HTTP servers.
    pub http_port: u16,
    /// Port of the TLS servers.
    pub https_port: u16,
    /// Listen on this address only; `None` listens on every address of the
    /// jail (its own VNET stack on FreeBSD). The simulated runtime sets the
    /// jail's address, since its nginx shares the host's stack.
    pub listen: Option<Ipv4Addr>,
}

impl Default for NginxLayout {
    /// The ingress jail's layout (FreeBSD's nginx package paths).
    fn default() -> NginxLayout {
        NginxLayout {
            pid: "/var/run/nginx.pid".into(),
            error_log: "/var/log/nginx/error.log".into(),
            access_log: "/var/log/nginx/access.log".into(),
            temp_dir: "/var/tmp/nginx".into(),
            http_port: 80,
            https_port: 443,
            listen: None,
        }
    }
}

impl NginxLayout {
    /// Everything under `dir`, on the given ports (tests, `nginx -t -p`).
    pub fn under(dir: &Path, http_port: u16, https_port: u16) -> NginxLayout {
        NginxLayout {
            pid: dir.join("nginx.pid"),
            error_log: dir.join("error.log"),
            access_log: dir.join("access.log"),
            temp_dir: dir.join("tmp"),
            http_port,
            https_port,
            listen: None,
        }
    }
}

/// A site [`render`] refused: its host is not a plain FQDN, or a path holds
/// a character that would end the directive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsafeSite {
    /// The host as given.
    pub host: String,
    /// Why.
    pub reason: String,
}

impl std::fmt::Display for UnsafeSite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ingress host {:?} left out of nginx.conf: {}",
            self.host, self.reason
        )
    }
}

impl std::error::Error for UnsafeSite {}

/// The configuration for `sites`, sorted by host so the same set always
/// renders the same bytes (a reload happens only when something changed),
/// plus every site left out and why. Two sites with one host keep the first.
pub fn render(sites: &[Site], layout: &NginxLayout) -> (String, Vec<UnsafeSite>) {
    let mut refused = Vec::new();
    let mut kept: Vec<&Site> = Vec::new();
    for site in sites {
        match check(site) {
            Err(reason) => refused.push(UnsafeSite {
                host: site.host.clone(),
                reason,
            }),
            Ok(()) if kept.iter().any(|k| k.host == site.host) => refused.push(UnsafeSite {
                host: site.host.clone(),
                reason: "another Ingress already serves this host".into(),
            }),
            Ok(()) => kept.push(site),
        }
    }
    kept.sort_by(|a, b| a.host.cmp(&b.host));

    let http = listen_on(layout.listen, layout.http_port);
    let https = listen_on(layout.listen, layout.https_port);
    let mut c = String::new();
    // `writeln!` into a String cannot fail.
    let mut line = |text: &str| {
        let _ = writeln!(c, "{text}");
    };
    line("# Written by keel-agentd from every Ingress applied on this node.");
    line("# Do not edit: it is rewritten whenever an Ingress changes.");
    line("worker_processes 1;");
    line(&format!("pid {};", layout.pid.display()));
    line(&format!("error_log {};", layout.error_log.display()));
    line("events {\n    worker_connections 1024;\n}");
    line("http {");
    line(&format!("    access_log {};", layout.access_log.display()));
    for (directive, sub) in [
        ("client_body_temp_path", "client_body"),
        ("proxy_temp_path", "proxy"),
        ("fastcgi_temp_path", "fastcgi"),
        ("uwsgi_temp_path", "uwsgi"),
        ("scgi_temp_path", "scgi"),
    ] {
        line(&format!(
            "    {directive} {};",
            layout.temp_dir.join(sub).display()
        ));
    }
    line("    server_tokens off;");
    line("    ssl_protocols TLSv1.2 TLSv1.3;");
    line("    ssl_session_cache shared:keel:10m;");
    line("");
    line("    # Names no Ingress serves: close (HTTP) or refuse the handshake (TLS).");
    line("    server {");
    line(&format!("        listen {http} default_server;"));
    line("        server_name _;");
    line("        return 444;");
    line("    }");
    line("    server {");
    line(&format!("        listen {https} ssl default_server;"));
    line("        server_name _;");
    line("        ssl_reject_handshake on;");
    line("    }");
    if !kept.is_empty() {
        let names: Vec<&str> = kept.iter().map(|s| s.host.as_str()).collect();
        line("");
        line("    # Port 80 only sends every served host to HTTPS.");
        line("    server {");
        line(&format!("        listen {http};"));
        line(&format!("        server_name {};", names.join(" ")));
        line("        return 301 https://$host$request_uri;");
        line("    }");
    }
    for site in &kept {
        line("");
        line("    server {");
        line(&format!("        listen {https} ssl;"));
        line(&format!("        server_name {};", site.host));
        line(&format!(
            "        ssl_certificate {};",
            site.certificate.display()
        ));
        line(&format!(
            "        ssl_certificate_key {};",
            site.key.display()
        ));
        line("        location / {");
        line(&format!("            proxy_pass http://{};", site.upstream));
        line("            proxy_set_header Host $host;");
        line("            proxy_set_header X-Real-IP $remote_addr;");
        line("            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;");
        line("            proxy_set_header X-Forwarded-Proto https;");
        line("        }");
        line("    }");
    }
    line("}");
    (c, refused)
}

/// The `listen` argument: `port` alone, or `address:port`.
fn listen_on(address: Option<Ipv4Addr>, port: u16) -> String {
    match address {
        Some(a) => format!("{a}:{port}"),
        None => port.to_string(),
    }
}

/// A site is rendered only when nothing in it can end an nginx directive.
fn check(site: &Site) -> Result<(), String> {
    validate_host(&site.host)?;
    for (what, path) in [("certificate", &site.certificate), ("key", &site.key)] {
        let text = path
            .to_str()
            .ok_or_else(|| format!("the {what} path is not UTF-8"))?;
        if !path.is_absolute() {
            return Err(format!("the {what} path {text:?} is not absolute"));
        }
        if let Some(c) = text.chars().find(|c| {
            c.is_whitespace()
                || c.is_control()
                || matches!(c, ';' | '{' | '}' | '"' | '\'' | '$' | '\\')
        }) {
            return Err(format!("the {what} path {text:?} contains {c:?}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(host: &str, last: u8) -> Site {
        Site {
            host: host.into(),
            upstream: SocketAddrV4::new([10, 96, 0, last].into(), 8080),
            certificate: format!("/certs/{host}/fullchain.pem").into(),
            key: format!("/certs/{host}/key.pem").into(),
        }
    }

    #[test]
    fn no_ingress_renders_only_the_refusing_defaults() {
        let (conf, refused) = render(&[], &NginxLayout::default());
        assert!(refused.is_empty());
        assert!(conf.contains("listen 80 default_server;"));
        assert!(conf.contains("ssl_reject_handshake on;"));
        assert!(!conf.contains("proxy_pass"), "{conf}");
        assert!(!conf.contains("return 301"), "{conf}");
    }

    #[test]
    fn each_host_gets_its_certificate_and_backend_and_a_redirect() {
        let (conf, refused) = render(
            &[site("b.example.org", 2), site("a.example.org", 1)],
            &NginxLayout::default(),
        );
        assert!(refused.is_empty());
        assert!(conf.contains("server_name a.example.org b.example.org;\n        return 301 https://$host$request_uri;"), "{conf}");
        let a = conf.find("server_name a.example.org;").expect("a's server");
        let b = conf.find("server_name b.example.org;").expect("b's server");
        assert!(a < b, "sorted by host");
        let a_block = &conf[a..b];
        assert!(a_block.contains("ssl_certificate /certs/a.example.org/fullchain.pem;"));
        assert!(a_block.contains("ssl_certificate_key /certs/a.example.org/key.pem;"));
        assert!(a_block.contains("proxy_pass http://10.96.0.1:8080;"));
    }

    #[test]
    fn a_listen_address_is_used_by_every_server() {
        let layout = NginxLayout {
            listen: Some(Ipv4Addr::new(127, 64, 0, 2)),
            ..NginxLayout::default()
        };
        let (conf, _) = render(&[site("a.example.org", 1)], &layout);
        let listens: Vec<&str> = conf
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("listen "))
            .collect();
        assert_eq!(
            listens,
            [
                "listen 127.64.0.2:80 default_server;",
                "listen 127.64.0.2:443 ssl default_server;",
                "listen 127.64.0.2:80;",
                "listen 127.64.0.2:443 ssl;",
            ]
        );
    }

    #[test]
    fn the_same_set_renders_the_same_bytes_in_any_order() {
        let layout = NginxLayout::default();
        let one = render(
            &[site("a.example.org", 1), site("b.example.org", 2)],
            &layout,
        );
        let two = render(
            &[site("b.example.org", 2), site("a.example.org", 1)],
            &layout,
        );
        assert_eq!(one, two);
    }

    #[test]
    fn a_site_that_could_break_a_directive_is_left_out_alone() {
        let mut hostile = site("evil.example.org", 3);
        hostile.host = "evil.example.org; include /etc/passwd".into();
        let mut bad_path = site("path.example.org", 4);
        bad_path.key = "/certs/x;y/key.pem".into();
        let dup = site("a.example.org", 9);
        let (conf, refused) = render(
            &[site("a.example.org", 1), hostile, bad_path, dup],
            &NginxLayout::default(),
        );
        let hosts: Vec<&str> = refused.iter().map(|r| r.host.as_str()).collect();
        assert_eq!(
            hosts,
            [
                "evil.example.org; include /etc/passwd",
                "path.example.org",
                "a.example.org"
            ]
        );
        assert!(
            !conf.contains("evil") && !conf.contains("path.example.org"),
            "{conf}"
        );
        assert!(
            conf.contains("proxy_pass http://10.96.0.1:8080;"),
            "the first a.example.org stays"
        );
        assert!(!conf.contains("10.96.0.9"), "{conf}");
    }
}
