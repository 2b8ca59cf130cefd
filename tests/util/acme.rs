//! The ACME peers of the certificate tests: Pebble (the ACME test CA) and
//! pebble-challtestsrv (its DNS server) on loopback, and a fake OVH API that
//! checks every signature exactly as OVH documents it and forwards TXT
//! records to challtestsrv's management API. Shared by `acme_e2e` (the
//! certificate manager alone) and `ingress_e2e` (the whole agent).
//!
//! Debian's Pebble (2.4) has no ACME Renewal Information (RFC 9773), so
//! [`AriFront`] adds it: an HTTPS server serving Pebble's directory plus a
//! `renewalInfo` URL of its own, whose windows the test sets.
//!
//! Every peer listens on 127.0.0.1 and writes its log into the test's
//! temporary directory; the processes are killed and the fake server stopped
//! when their handles drop. Nothing here is trusted outside the test.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::Duration;

use keel::agentd::ingress::acme::RenewalWindow;
use keel::agentd::ingress::propagation::{Answer, query_txt};
use keel::common::auth::unix_now;
use keel::common::http::{
    Client, Endpoint, Request, Response, Server, ServerLimits, ShutdownSignal,
};
use keel::ctl::output::utc_datetime;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha1::{Digest, Sha1};

use super::pki::TestCa;
use super::poll_until;

/// The Pebble binaries .ci/run installs (Debian package pebble).
pub const PEBBLE: &str = "/usr/bin/pebble";
/// See [`PEBBLE`].
pub const CHALLTESTSRV: &str = "/usr/bin/pebble-challtestsrv";
/// The OVH application key the fake accepts.
pub const AK: &str = "test-application-key";
/// The OVH application secret the fake verifies signatures with.
pub const AS: &str = "test-application-secret";
/// The OVH consumer key the fake accepts.
pub const CK: &str = "test-consumer-key";
/// The fake OVH's clock runs this far ahead of ours: requests only verify if
/// the client derived its timestamps from `/auth/time`.
const OVH_CLOCK_AHEAD: i64 = 3600;

/// A TCP port nobody listens on, whose UDP twin is free too (challtestsrv
/// serves DNS on both).
pub fn free_port() -> u16 {
    loop {
        let tcp = TcpListener::bind("127.0.0.1:0").expect("bind tcp");
        let port = tcp.local_addr().expect("addr").port();
        if UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Pebble and challtestsrv, killed on drop.
pub struct Peers {
    children: Vec<Child>,
    /// The test's directory: peer logs, Pebble's config and listener
    /// certificate; tests put their own files here too.
    pub dir: tempfile::TempDir,
    /// Pebble's ACME directory URL.
    pub directory_url: String,
    /// Pebble's management API (`/roots/0` serves its root).
    pub management: String,
    /// The CA of Pebble's HTTPS listener (not of the certificates it issues).
    pub ca_pem: PathBuf,
    /// That CA itself, to issue other listeners the ACME client trusts.
    pub ca: TestCa,
    /// challtestsrv's DNS server.
    pub dns: SocketAddr,
    /// challtestsrv's management API.
    pub challtestsrv: SocketAddr,
}

impl Drop for Peers {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn spawn(cmd: &mut Command, log: &Path) -> Child {
    let out = fs::File::create(log).expect("log file");
    let err = out.try_clone().expect("log file");
    cmd.stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawn peer")
}

/// True when the Pebble binaries are installed. Without them the test
/// prints why and passes, unless `CI` is set: there `.ci/run` installs them
/// and their absence is a failure.
pub fn present(test: &str) -> bool {
    if Path::new(PEBBLE).exists() && Path::new(CHALLTESTSRV).exists() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{PEBBLE} or {CHALLTESTSRV} is missing under CI: .ci/run must install the Debian \
         package pebble"
    );
    eprintln!("skipping {test}: install the Debian package pebble to run it");
    false
}

/// Starts challtestsrv and Pebble (validating DNS-01 against challtestsrv)
/// and waits until they listen; `None` when they are not installed (see
/// [`present`]).
pub fn start_peers(test: &str) -> Option<Peers> {
    if !present(test) {
        return None;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    // Pebble's HTTPS listener needs a certificate; Debian ships none, so the
    // test makes a throwaway CA and a leaf for 127.0.0.1.
    let ca = TestCa::new("keel test CA for pebble");
    let listener = ca.leaf(&["127.0.0.1", "localhost"], dir.path(), "pebble-listener");
    let ca_pem = dir.path().join("ca.pem");
    fs::write(&ca_pem, &ca.pem).expect("write ca");

    let (acme, management, dns, chall_mgmt) = (free_port(), free_port(), free_port(), free_port());
    let config = serde_json::json!({
        "pebble": {
            "listenAddress": format!("127.0.0.1:{acme}"),
            "managementListenAddress": format!("127.0.0.1:{management}"),
            "certificate": listener.cert,
            "privateKey": listener.key,
            "httpPort": free_port(),
            "tlsPort": free_port(),
            "ocspResponderURL": "",
            "externalAccountBindingRequired": false
        }
    });
    let config_path = dir.path().join("pebble.json");
    fs::write(&config_path, config.to_string()).expect("write config");

    let mut children = Vec::new();
    children.push(spawn(
        Command::new(CHALLTESTSRV).args([
            "-dns01",
            &format!("127.0.0.1:{dns}"),
            "-management",
            &format!("127.0.0.1:{chall_mgmt}"),
            "-http01",
            "",
            "-https01",
            "",
            "-tlsalpn01",
            "",
        ]),
        &dir.path().join("challtestsrv.log"),
    ));
    children.push(spawn(
        Command::new(PEBBLE)
            .arg("-config")
            .arg(&config_path)
            .args(["-dnsserver", &format!("127.0.0.1:{dns}")])
            .env("PEBBLE_VA_NOSLEEP", "1")
            .env("PEBBLE_WFE_NONCEREJECT", "0")
            // Every order proves its challenge again, so renewal publishes too.
            .env("PEBBLE_AUTHZREUSE", "0"),
        &dir.path().join("pebble.log"),
    ));
    let peers = Peers {
        children,
        directory_url: format!("https://127.0.0.1:{acme}/dir"),
        management: format!("https://127.0.0.1:{management}"),
        ca_pem,
        ca,
        dns: SocketAddr::from(([127, 0, 0, 1], dns)),
        challtestsrv: SocketAddr::from(([127, 0, 0, 1], chall_mgmt)),
        dir,
    };
    for port in [acme, management, chall_mgmt] {
        poll_until(&format!("a peer listening on port {port}"), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
    }
    Some(peers)
}

impl Peers {
    /// The root Pebble signs its intermediates with (PEM), as its management
    /// API serves it (fetched over HTTPS trusting the listener's test CA).
    pub fn root_pem(&self) -> String {
        self.https_client()
            .get(&format!("{}/roots/0", self.management))
            .call()
            .expect("pebble root")
            .body_mut()
            .read_to_string()
            .expect("root body")
    }

    /// An HTTPS client trusting only the listener CA ([`Peers::ca`]).
    fn https_client(&self) -> ureq::Agent {
        let tls = ureq::tls::TlsConfig::builder()
            .root_certs(ureq::tls::RootCerts::new_with_certs(&[
                ureq::tls::Certificate::from_pem(self.ca.pem.as_bytes()).expect("ca pem"),
            ]))
            .build();
        ureq::Agent::config_builder().tls_config(tls).build().into()
    }
}

/// The `Retry-After` (seconds) of every [`AriFront`] answer: the client may
/// ask about a certificate again this long after its last answer.
pub const ARI_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// What the ARI front answers and saw.
#[derive(Default)]
struct AriState {
    /// The suggested window (Unix seconds) for every certificate; `None`
    /// answers 404, as a CA does for a certificate it does not know.
    window: Option<(i64, i64)>,
    /// While set, requests are received but not answered.
    hold: bool,
    /// The certificate identifiers asked about, in order.
    requested: Vec<String>,
    stopped: bool,
}

/// ACME Renewal Information in front of Pebble: `GET /dir` is Pebble's
/// directory (its URLs still lead to Pebble) plus `renewalInfo`, and
/// `GET /renewal-info/{id}` answers the window the test set, with
/// [`ARI_RETRY_AFTER`]. Served over HTTPS on loopback with a leaf of
/// [`Peers::ca`], which the ACME client already trusts; one connection at a
/// time, each closed after its answer (the client asks rarely). Stopped on
/// drop.
pub struct AriFront {
    /// The directory URL to configure as `ingress.acme_directory`.
    pub directory_url: String,
    state: Arc<(Mutex<AriState>, Condvar)>,
    addr: SocketAddr,
    thread: Option<thread::JoinHandle<()>>,
}

impl AriFront {
    /// Starts the front for `peers`' Pebble (whose directory it fetches once).
    pub fn start(peers: &Peers) -> AriFront {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind ari front");
        let addr = listener.local_addr().expect("addr");
        let text = peers
            .https_client()
            .get(&peers.directory_url)
            .call()
            .expect("pebble directory")
            .body_mut()
            .read_to_string()
            .expect("directory body");
        let mut directory: serde_json::Value = serde_json::from_str(&text).expect("directory json");
        assert!(
            directory.get("renewalInfo").is_none(),
            "this Pebble offers ARI itself; the front is not needed"
        );
        directory["renewalInfo"] = format!("https://{addr}/renewal-info").into();
        let leaf = peers
            .ca
            .leaf(&["127.0.0.1"], peers.dir.path(), "ari-front-listener");
        let certs = CertificateDer::pem_file_iter(&leaf.cert)
            .expect("leaf pem")
            .collect::<Result<Vec<_>, _>>()
            .expect("leaf");
        let key = PrivateKeyDer::from_pem_file(&leaf.key).expect("leaf key");
        let mut tls = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("tls versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("tls config");
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tls = Arc::new(tls);
        let state = Arc::new((Mutex::new(AriState::default()), Condvar::new()));
        let shared = Arc::clone(&state);
        let directory = directory.to_string();
        let thread = thread::spawn(move || {
            for stream in listener.incoming() {
                if shared.0.lock().expect("ari state").stopped {
                    return;
                }
                let Ok(stream) = stream else { continue };
                // A client that breaks off only loses its own answer.
                let _ = serve_ari(stream, &tls, &shared, &directory);
            }
        });
        AriFront {
            directory_url: format!("https://{addr}/dir"),
            state,
            addr,
            thread: Some(thread),
        }
    }

    /// Suggests `window` (Unix seconds) from now on.
    pub fn set_window(&self, window: RenewalWindow) {
        self.state.0.lock().expect("ari state").window = Some((window.start, window.end));
    }

    /// Answers 404 from now on, as for a certificate the CA does not know:
    /// to the client, a failed request.
    pub fn forget_window(&self) {
        self.state.0.lock().expect("ari state").window = None;
    }

    /// Holds requests unanswered (`true`) or answers them (`false`).
    pub fn hold(&self, on: bool) {
        let (state, changed) = &*self.state;
        state.lock().expect("ari state").hold = on;
        changed.notify_all();
    }

    /// The certificate identifiers asked about so far, in order.
    pub fn requested(&self) -> Vec<String> {
        self.state.0.lock().expect("ari state").requested.clone()
    }
}

impl Drop for AriFront {
    fn drop(&mut self) {
        let (state, changed) = &*self.state;
        {
            let mut st = state.lock().expect("ari state");
            st.stopped = true;
            st.hold = false;
        }
        changed.notify_all();
        // Wakes the accept loop, which then sees `stopped`.
        let _ = TcpStream::connect(self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One connection of the ARI front: one request, one answer, closed.
fn serve_ari(
    tcp: TcpStream,
    tls: &Arc<rustls::ServerConfig>,
    state: &(Mutex<AriState>, Condvar),
    directory: &str,
) -> std::io::Result<()> {
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    let conn = rustls::ServerConnection::new(Arc::clone(tls)).map_err(std::io::Error::other)?;
    let mut stream = rustls::StreamOwned::new(conn, tcp);
    let mut buf = Vec::new();
    let (method, path) = loop {
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        if let httparse::Status::Complete(_) = req.parse(&buf).map_err(std::io::Error::other)? {
            break (
                req.method.unwrap_or_default().to_string(),
                req.path.unwrap_or_default().to_string(),
            );
        }
    };
    let (status, extra, body) = match (method.as_str(), path.strip_prefix("/renewal-info/")) {
        ("GET", None) if path == "/dir" => ("200 OK", String::new(), directory.to_string()),
        ("GET", Some(id)) => {
            let (lock, changed) = state;
            let mut st = lock.lock().expect("ari state");
            st.requested.push(id.to_string());
            let (st, _) = changed
                .wait_timeout_while(st, super::DEADLINE, |st| st.hold)
                .expect("ari state");
            match st.window {
                Some((start, end)) => (
                    "200 OK",
                    format!("Retry-After: {}\r\n", ARI_RETRY_AFTER.as_secs()),
                    serde_json::json!({
                        "suggestedWindow": {"start": utc_datetime(start), "end": utc_datetime(end)}
                    })
                    .to_string(),
                ),
                None => (
                    "404 Not Found",
                    String::new(),
                    serde_json::json!({"type": "urn:ietf:params:acme:error:malformed",
                                       "detail": "no such certificate"})
                    .to_string(),
                ),
            }
        }
        _ => ("404 Not Found", String::new(), String::new()),
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         {extra}Connection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.conn.send_close_notify();
    stream.flush()
}

/// What the fake OVH API saw and holds.
#[derive(Default)]
pub struct OvhState {
    /// `METHOD path` of every verified call, in order.
    pub calls: Vec<String>,
    /// Calls whose signature or timestamp did not verify.
    pub rejected: Vec<String>,
    /// Record id -> (fqdn, value).
    pub records: BTreeMap<u64, (String, String)>,
    next_id: u64,
    /// Refuse record creation like an under-privileged consumer key.
    pub refuse_create: bool,
}

/// The OVH API as the test sees it: `base` is the endpoint URL.
pub struct FakeOvh {
    /// What it saw and holds.
    pub state: Arc<Mutex<OvhState>>,
    /// The endpoint (`ingress.ovh_endpoint`).
    pub base: String,
    shutdown: ShutdownSignal,
}

impl Drop for FakeOvh {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

fn ovh_now() -> i64 {
    unix_now() as i64 + OVH_CLOCK_AHEAD
}

fn json(status: u16, value: serde_json::Value) -> Response {
    Response::json(status, &value)
}

fn challtestsrv_call(addr: SocketAddr, path: &str, body: serde_json::Value) {
    let r = Client::new(Endpoint::Tcp(addr.to_string()))
        .request("POST", path, &[], body.to_string().as_bytes())
        .expect("challtestsrv answers");
    assert_eq!(r.status, 200, "challtestsrv {path}");
}

/// Starts the fake OVH API on loopback: zones `example.org` and
/// `example.com`, TXT records forwarded to `challtestsrv`'s management API.
pub fn start_fake_ovh(challtestsrv: SocketAddr) -> FakeOvh {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let base = format!("http://{}/1.0", listener.local_addr().expect("addr"));
    let state = Arc::new(Mutex::new(OvhState::default()));
    let shared = Arc::clone(&state);
    let origin = format!("http://{}", listener.local_addr().expect("addr"));
    let handler = move |req: Request| -> Response {
        let mut st = shared.lock().expect("ovh state");
        if req.method == "GET" && req.path == "/1.0/auth/time" {
            return Response::text(200, ovh_now().to_string());
        }
        // The documented check: "$1$" + SHA1_HEX(AS+"+"+CK+"+"+METHOD+"+"+URL+"+"+BODY+"+"+TSTAMP).
        let header = |n: &str| req.header(n).unwrap_or_default().to_string();
        let ts = header("X-Ovh-Timestamp");
        let body = String::from_utf8_lossy(&req.body).into_owned();
        let url = format!("{origin}{}", req.raw_path);
        let signed = format!("{AS}+{CK}+{}+{url}+{body}+{ts}", req.method);
        let expected = format!("$1${:x}", Sha1::digest(signed.as_bytes()));
        let fresh = ts.parse::<i64>().is_ok_and(|t| (t - ovh_now()).abs() <= 5);
        if header("X-Ovh-Application") != AK
            || header("X-Ovh-Consumer") != CK
            || header("X-Ovh-Signature") != expected
            || !fresh
        {
            st.rejected.push(format!("{} {}", req.method, req.path));
            return json(400, serde_json::json!({"message": "Invalid signature"}));
        }
        st.calls.push(format!("{} {}", req.method, req.path));
        let segments: Vec<&str> = req.path.trim_start_matches('/').split('/').collect();
        match (req.method.as_str(), segments.as_slice()) {
            ("GET", ["1.0", "domain", "zone"]) => {
                json(200, serde_json::json!(["example.org", "example.com"]))
            }
            ("POST", ["1.0", "domain", "zone", zone, "record"]) => {
                if st.refuse_create {
                    return json(
                        403,
                        serde_json::json!({"message": "This call has not been granted"}),
                    );
                }
                let v: serde_json::Value = serde_json::from_slice(&req.body).expect("json body");
                assert_eq!(v["fieldType"], "TXT");
                assert!(v["ttl"].is_u64());
                let fqdn = format!("{}.{zone}", v["subDomain"].as_str().expect("subDomain"));
                let value = v["target"].as_str().expect("target").to_string();
                st.next_id += 1;
                let id = st.next_id;
                challtestsrv_call(
                    challtestsrv,
                    "/set-txt",
                    serde_json::json!({"host": format!("{fqdn}."), "value": value}),
                );
                st.records.insert(id, (fqdn, value));
                json(
                    200,
                    serde_json::json!({"id": id, "zone": zone, "fieldType": "TXT"}),
                )
            }
            ("POST", ["1.0", "domain", "zone", _, "refresh"]) => json(200, serde_json::Value::Null),
            ("DELETE", ["1.0", "domain", "zone", _, "record", id]) => {
                let id: u64 = id.parse().expect("numeric id");
                match st.records.remove(&id) {
                    Some((fqdn, _)) => {
                        challtestsrv_call(
                            challtestsrv,
                            "/clear-txt",
                            serde_json::json!({"host": format!("{fqdn}.")}),
                        );
                        json(200, serde_json::Value::Null)
                    }
                    None => json(404, serde_json::json!({"message": "no such record"})),
                }
            }
            _ => json(404, serde_json::json!({"message": "no such route"})),
        }
    };
    let shutdown = ShutdownSignal::new();
    Server::new(Arc::new(handler), ServerLimits::default(), shutdown.clone())
        .serve_tcp(listener)
        .expect("serve");
    FakeOvh {
        state,
        base,
        shutdown,
    }
}

/// Writes the credentials the fake OVH accepts to `path` in the format
/// `ingress.ovh_credentials` reads, with mode 0600 (owned by whoever runs
/// the test: root when the agent checks ownership).
pub fn write_ovh_credentials(path: &Path) {
    fs::write(
        path,
        format!(
            "application_key = \"{AK}\"\napplication_secret = \"{AS}\"\nconsumer_key = \"{CK}\"\n"
        ),
    )
    .expect("write creds");
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).expect("chmod");
}

/// The certificates of a PEM chain file, leaf first, as DER.
pub fn pem_chain(path: &Path) -> Vec<Vec<u8>> {
    let text = fs::read(path).expect("chain");
    x509_parser::pem::Pem::iter_from_buffer(&text)
        .map(|p| p.expect("pem").contents)
        .collect()
}

/// Checks the chain in `path` as a client would: its leaf names `host` and
/// is signed by the next certificate, the intermediate, which is signed by
/// (and issued by the subject of) the root in `root_pem`. Returns the leaf's
/// notAfter, Unix seconds.
pub fn assert_chains_to_root(path: &Path, host: &str, root_pem: &str) -> i64 {
    let chain = pem_chain(path);
    assert!(
        chain.len() >= 2,
        "leaf and intermediate expected, got {}",
        chain.len()
    );
    let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0]).expect("leaf");
    let (_, inter) = x509_parser::parse_x509_certificate(&chain[1]).expect("intermediate");
    let names: Vec<String> = leaf
        .subject_alternative_name()
        .expect("san ext")
        .expect("san")
        .value
        .general_names
        .iter()
        .map(|n| n.to_string())
        .collect();
    assert!(names.iter().any(|n| n.contains(host)), "SANs {names:?}");
    leaf.verify_signature(Some(inter.public_key()))
        .expect("leaf signed by the intermediate");
    let (_, root_der) = x509_parser::pem::parse_x509_pem(root_pem.as_bytes()).expect("root pem");
    let (_, root) = x509_parser::parse_x509_certificate(&root_der.contents).expect("root");
    inter
        .verify_signature(Some(root.public_key()))
        .expect("intermediate signed by Pebble's root");
    assert_eq!(inter.issuer(), root.subject());
    leaf.validity().not_after.timestamp()
}

/// challtestsrv holds no `_acme-challenge` TXT record for `host`.
pub fn assert_no_challenge_record(peers: &Peers, host: &str) {
    let name = format!("_acme-challenge.{host}");
    match query_txt(peers.dns, &name, Duration::from_secs(2)).expect("challtestsrv answers") {
        Answer::Txt(values) => assert!(values.is_empty(), "{name} still has TXT {values:?}"),
        Answer::NoName => {}
        other => panic!("unexpected answer for {name}: {other:?}"),
    }
}

/// The permission bits of `path`.
pub fn mode_of(path: &Path) -> u32 {
    fs::metadata(path).expect("metadata").permissions().mode() & 0o777
}
