//! Real nginx (`/usr/sbin/nginx`, Debian's nginx-light) for the ingress
//! tests: `nginx -t` on a rendered configuration, nginx running in the
//! foreground in front of a small backend, and an HTTPS client that reaches
//! any host name on loopback with that name as SNI.
//!
//! Everything nginx writes stays under the test's directory (the
//! configuration comes from `NginxLayout::under`). nginx is never started
//! through a shell, and a started nginx is stopped when its handle drops.

use std::fs;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use ureq::unversioned::resolver::{ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{DefaultConnector, NextTimeout};

use super::agent::terminate;
use super::{DEADLINE, poll_until};

/// The nginx binary .ci/run installs.
pub const NGINX: &str = "/usr/sbin/nginx";

/// True when nginx is installed. Without it the test prints why and passes,
/// unless `CI` is set: there `.ci/run` installs nginx-light and its absence
/// is a failure.
pub fn present(test: &str) -> bool {
    if Path::new(NGINX).exists() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{NGINX} is missing under CI: .ci/run must install the Debian package nginx-light"
    );
    eprintln!("skipping {test}: install the Debian package nginx-light ({NGINX}) to run it");
    false
}

/// Writes `conf` to `dir/nginx.conf` and returns its path.
fn write_conf(dir: &Path, conf: &str) -> PathBuf {
    let path = dir.join("nginx.conf");
    fs::write(&path, conf).expect("write nginx.conf");
    path
}

/// The prefix argument: nginx joins relative paths to it as strings, so it
/// ends with a slash.
fn prefix(dir: &Path) -> String {
    format!("{}/", dir.display())
}

/// `nginx -t` on `conf` with `dir` as prefix; nginx's verdict is its exit
/// status, its reasons are on stderr.
pub fn check(dir: &Path, conf: &str) -> Output {
    let file = write_conf(dir, conf);
    Command::new(NGINX)
        .arg("-t")
        .arg("-c")
        .arg(&file)
        .arg("-p")
        .arg(prefix(dir))
        .stdin(Stdio::null())
        .output()
        .expect("run nginx -t")
}

/// A TCP port on loopback nothing listens on right now.
pub fn free_port() -> u16 {
    super::controlplane::free_port()
}

/// nginx in the foreground, stopped on drop.
pub struct Nginx {
    child: Child,
    log: PathBuf,
}

impl Nginx {
    /// Starts nginx on `conf` (prefix `dir`) and waits until every one of
    /// `ports` accepts connections.
    pub fn start(dir: &Path, conf: &str, ports: &[u16]) -> Nginx {
        let file = write_conf(dir, conf);
        let log = dir.join("nginx.out");
        let out = fs::File::create(&log).expect("nginx log");
        let err = out.try_clone().expect("nginx log");
        let child = Command::new(NGINX)
            .arg("-c")
            .arg(&file)
            .arg("-p")
            .arg(prefix(dir))
            .args(["-g", "daemon off;"])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("spawn nginx");
        let mut nginx = Nginx { child, log };
        for &port in ports {
            poll_until(&format!("nginx listening on port {port}"), || {
                if let Ok(Some(status)) = nginx.child.try_wait() {
                    panic!("nginx exited ({status}):\n{}", nginx.log());
                }
                TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok()
            });
        }
        nginx
    }

    /// What nginx printed so far (its error log goes to stderr).
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM, not SIGKILL: the master then stops its worker, which a
        // killed master would leave running with the ports open.
        if terminate(self.child.id()).is_ok() {
            let deadline = Instant::now() + DEADLINE;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A backend on loopback answering every request with `200` and a fixed
/// body, handing each request's head (request line and headers) to the test.
pub struct Backend {
    /// Where it listens.
    pub addr: SocketAddrV4,
    heads: mpsc::Receiver<String>,
    stop: Arc<AtomicBool>,
}

impl Backend {
    /// Starts answering `body`.
    pub fn start(body: &'static str) -> Backend {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind backend");
        let addr = match listener.local_addr().expect("backend addr") {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(a) => panic!("bound {a} on IPv4 loopback"),
        };
        let (tx, heads) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        thread::spawn(move || {
            for conn in listener.incoming() {
                if stopping.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(mut conn) = conn else { continue };
                let _ = conn.set_read_timeout(Some(DEADLINE));
                let head = read_head(&mut conn);
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n{body}",
                    body.len()
                );
                if tx.send(head).is_err() {
                    return;
                }
            }
        });
        Backend { addr, heads, stop }
    }

    /// The head of the next request the backend received.
    pub fn next_request(&self) -> String {
        self.heads
            .recv_timeout(DEADLINE)
            .expect("a request reached the backend")
    }

    /// The head of a request received but not yet taken, if any.
    pub fn pending_request(&self) -> Option<String> {
        self.heads.try_recv().ok()
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag and ends.
        let _ = TcpStream::connect(self.addr);
    }
}

/// Reads up to the blank line ending an HTTP head.
fn read_head(conn: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Sends `request` as is to `127.0.0.1:port` and returns everything the
/// server wrote before closing (empty when it closed without answering).
pub fn raw_http(port: u16, request: &str) -> String {
    raw_http_at(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port), request)
}

/// [`raw_http`] to any address (an ingress jail's, say).
pub fn raw_http_at(addr: SocketAddrV4, request: &str) -> String {
    let mut conn = TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(DEADLINE)).expect("timeout");
    conn.write_all(request.as_bytes()).expect("send request");
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).expect("read answer");
    String::from_utf8_lossy(&answer).into_owned()
}

/// Resolves every host name to one address, keeping the URL's port, so a
/// request for `https://HOST:PORT/` reaches the nginx there with `HOST` as
/// SNI and `Host`.
#[derive(Debug)]
struct Fixed(Ipv4Addr);

impl Resolver for Fixed {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        _config: &ureq::config::Config,
        _timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let mut addrs = self.empty();
        addrs.push(SocketAddr::from((self.0, uri.port_u16().unwrap_or(443))));
        Ok(addrs)
    }
}

/// An HTTPS client trusting only `root_pem`, reaching every host on
/// loopback; statuses are answers, not errors, and redirects are not
/// followed.
pub fn https_client(root_pem: &[u8]) -> ureq::Agent {
    https_client_at(root_pem, Ipv4Addr::LOCALHOST)
}

/// [`https_client`] reaching every host at `ip` (an ingress jail's address).
pub fn https_client_at(root_pem: &[u8], ip: Ipv4Addr) -> ureq::Agent {
    let root = ureq::tls::Certificate::from_pem(root_pem).expect("root pem");
    let tls = ureq::tls::TlsConfig::builder()
        .root_certs(ureq::tls::RootCerts::new_with_certs(&[root]))
        .build();
    let config = ureq::Agent::config_builder()
        .tls_config(tls)
        .http_status_as_error(false)
        .max_redirects(0)
        .timeout_global(Some(DEADLINE))
        .build();
    ureq::Agent::with_parts(config, DefaultConnector::new(), Fixed(ip))
}
