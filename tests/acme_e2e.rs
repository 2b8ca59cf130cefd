//! Ingress certificates against real peers: Pebble (the ACME test CA) and
//! pebble-challtestsrv (its DNS server) on loopback, with a fake OVH API in the
//! test that checks every signature exactly as OVH documents it and forwards
//! TXT records to challtestsrv. The resolver list points at challtestsrv's DNS
//! port, so the propagation wait really queries DNS, and Pebble validates the
//! DNS-01 challenge against the same server.
//!
//! Without the pebble binaries the test prints why and passes, unless `CI` is
//! set: there `.ci/run` installs them and their absence is a failure.

use std::collections::BTreeMap;
use std::fs;
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel::agentd::ingress::acme::{AcmeSettings, CertFiles, RenewReason};
use keel::agentd::ingress::dns::{OvhCredentials, OvhDns};
use keel::agentd::ingress::nginx::{NginxLayout, Site, render};
use keel::agentd::ingress::propagation::{Answer, query_txt};
use keel::agentd::ingress::{CertManager, CertStatus};
use keel::common::auth::{KeyFilePolicy, unix_now};
use keel::common::backoff::ManualClock;
use keel::common::http::{
    Client, Endpoint, Request, Response, Server, ServerLimits, ShutdownSignal,
};
use sha1::{Digest, Sha1};

use crate::util::nginx::{
    self, Backend, Nginx, free_port as free_tcp_port, https_client, raw_http,
};
use crate::util::pki::TestCa;
use crate::util::poll_until;

const PEBBLE: &str = "/usr/bin/pebble";
const CHALLTESTSRV: &str = "/usr/bin/pebble-challtestsrv";
const AK: &str = "test-application-key";
const AS: &str = "test-application-secret";
const CK: &str = "test-consumer-key";
/// The fake OVH's clock runs this far ahead of ours: requests only verify if
/// the client derived its timestamps from `/auth/time`.
const OVH_CLOCK_AHEAD: i64 = 3600;

/// A TCP port nobody listens on, whose UDP twin is free too (challtestsrv
/// serves DNS on both).
fn free_port() -> u16 {
    loop {
        let tcp = TcpListener::bind("127.0.0.1:0").expect("bind tcp");
        let port = tcp.local_addr().expect("addr").port();
        if UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Pebble and challtestsrv, killed on drop.
struct Peers {
    children: Vec<Child>,
    dir: tempfile::TempDir,
    directory_url: String,
    management: String,
    ca_pem: PathBuf,
    dns: SocketAddr,
    challtestsrv: SocketAddr,
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

fn start_peers() -> Option<Peers> {
    if !Path::new(PEBBLE).exists() || !Path::new(CHALLTESTSRV).exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{PEBBLE} or {CHALLTESTSRV} is missing under CI: .ci/run must install the Debian \
             package pebble"
        );
        eprintln!("skipping ACME end-to-end test: install the Debian package pebble to run it");
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

/// What the fake OVH API saw and holds.
#[derive(Default)]
struct OvhState {
    /// `METHOD path` of every verified call, in order.
    calls: Vec<String>,
    /// Calls whose signature or timestamp did not verify.
    rejected: Vec<String>,
    /// Record id -> (fqdn, value).
    records: BTreeMap<u64, (String, String)>,
    next_id: u64,
    /// Refuse record creation like an under-privileged consumer key.
    refuse_create: bool,
}

/// The OVH API as the test sees it: `base` is the endpoint URL.
struct FakeOvh {
    state: Arc<Mutex<OvhState>>,
    base: String,
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

fn start_fake_ovh(challtestsrv: SocketAddr) -> FakeOvh {
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

fn manager(
    peers: &Peers,
    ovh: &FakeOvh,
    resolvers: Vec<SocketAddr>,
    timeout: Duration,
) -> CertManager {
    let creds_path = peers.dir.path().join("ovh.toml");
    fs::write(
        &creds_path,
        format!(
            "application_key = \"{AK}\"\napplication_secret = \"{AS}\"\nconsumer_key = \"{CK}\"\n"
        ),
    )
    .expect("write creds");
    fs::set_permissions(&creds_path, fs::Permissions::from_mode(0o600)).expect("chmod");
    let policy = KeyFilePolicy {
        require_root_owner: false,
    };
    let creds = OvhCredentials::load(&creds_path, policy).expect("credentials");
    let settings = AcmeSettings {
        directory_url: peers.directory_url.clone(),
        account_file: peers.dir.path().join("keel").join("acme-account.json"),
        contact: Some("ops@example.com".into()),
        extra_root: Some(peers.ca_pem.clone()),
        resolvers,
        propagation_timeout: timeout,
        key_policy: policy,
    };
    // A clock that stands still: a failed host stays in backoff for the
    // whole test, however slow the machine.
    let clock = Arc::new(ManualClock::new());
    CertManager::start(settings, Box::new(OvhDns::new(&ovh.base, creds)), clock).expect("start")
}

/// Runs `ensure` until the order it started has finished; returns the status after.
fn settle(m: &CertManager, host: &str, dir: &Path, unix: i64) -> CertStatus {
    poll_until(&format!("the order for {host}"), || !m.issuing(host));
    m.ensure(host, dir, unix).expect("ensure")
}

fn pem_chain(path: &Path) -> Vec<Vec<u8>> {
    let text = fs::read(path).expect("chain");
    x509_parser::pem::Pem::iter_from_buffer(&text)
        .map(|p| p.expect("pem").contents)
        .collect()
}

fn assert_no_challenge_record(peers: &Peers, host: &str) {
    let name = format!("_acme-challenge.{host}");
    match query_txt(peers.dns, &name, Duration::from_secs(2)).expect("challtestsrv answers") {
        Answer::Txt(values) => assert!(values.is_empty(), "{name} still has TXT {values:?}"),
        Answer::NoName => {}
        other => panic!("unexpected answer for {name}: {other:?}"),
    }
}

fn mode_of(path: &Path) -> u32 {
    fs::metadata(path).expect("metadata").permissions().mode() & 0o777
}

#[test]
fn certificate_issued_renewed_and_challenges_cleaned() {
    let Some(peers) = start_peers() else { return };
    let ovh = start_fake_ovh(peers.challtestsrv);
    let certs = peers.dir.path().join("rootfs-certs");
    fs::create_dir(&certs).expect("cert dir");
    let host = "www.example.com";
    let m = manager(&peers, &ovh, vec![peers.dns], Duration::from_secs(20));

    // First pass: nothing installed, so an order starts off this thread.
    let now = unix_now() as i64;
    assert_eq!(
        m.ensure(host, &certs, now).expect("ensure"),
        CertStatus::Issuing {
            not_after: None,
            reason: RenewReason::Missing
        }
    );
    let first = match settle(&m, host, &certs, now) {
        CertStatus::Valid { not_after, .. } => not_after,
        other => panic!(
            "not issued: {other:?}; last error: {:?}",
            m.last_error(host)
        ),
    };
    let files = CertFiles::new(&certs, host);
    assert_eq!(mode_of(&files.key), 0o600);
    assert_eq!(mode_of(&files.chain), 0o600);
    assert_eq!(
        mode_of(&peers.dir.path().join("keel/acme-account.json")),
        0o600
    );

    // The chain: leaf for the host, signed by the intermediate, signed by
    // Pebble's root as its management API serves it.
    let chain = pem_chain(&files.chain);
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
    assert_eq!(leaf.validity().not_after.timestamp(), first);
    leaf.verify_signature(Some(inter.public_key()))
        .expect("leaf signed by the intermediate");
    let tls = ureq::tls::TlsConfig::builder()
        .root_certs(ureq::tls::RootCerts::new_with_certs(&[
            ureq::tls::Certificate::from_pem(&fs::read(&peers.ca_pem).expect("ca"))
                .expect("ca pem"),
        ]))
        .build();
    let agent: ureq::Agent = ureq::Agent::config_builder().tls_config(tls).build().into();
    let root_pem = agent
        .get(&format!("{}/roots/0", peers.management))
        .call()
        .expect("pebble root")
        .body_mut()
        .read_to_string()
        .expect("root body");
    let (_, root_der) = x509_parser::pem::parse_x509_pem(root_pem.as_bytes()).expect("root pem");
    let (_, root) = x509_parser::parse_x509_certificate(&root_der.contents).expect("root");
    inter
        .verify_signature(Some(root.public_key()))
        .expect("intermediate signed by Pebble's root");
    assert_eq!(inter.issuer(), root.subject());

    // The challenge record went up through signed OVH calls and came down.
    {
        let st = ovh.state.lock().expect("state");
        assert!(st.rejected.is_empty(), "bad signatures: {:?}", st.rejected);
        assert!(st.records.is_empty(), "left at OVH: {:?}", st.records);
        let tail: Vec<&str> = st.calls.iter().map(String::as_str).skip(1).collect();
        assert_eq!(
            tail,
            [
                "POST /1.0/domain/zone/example.com/record",
                "POST /1.0/domain/zone/example.com/refresh",
                "DELETE /1.0/domain/zone/example.com/record/1",
                "POST /1.0/domain/zone/example.com/refresh",
            ]
        );
    }
    assert_no_challenge_record(&peers, host);

    // Not due now; due when the clock stands near expiry.
    assert!(matches!(
        m.ensure(host, &certs, now).expect("ensure"),
        CertStatus::Valid { .. }
    ));
    let near = first - 60;
    match m.ensure(host, &certs, near).expect("ensure") {
        CertStatus::Issuing {
            not_after: Some(n),
            reason: RenewReason::LifetimeThird | RenewReason::AriWindow,
        } => assert_eq!(n, first),
        other => panic!("renewal not started: {other:?}"),
    }
    assert!(
        matches!(settle(&m, host, &certs, now), CertStatus::Valid { .. }),
        "{:?}",
        m.last_error(host)
    );
    let renewed = pem_chain(&files.chain);
    assert_ne!(renewed[0], chain[0], "the leaf was not replaced");
    assert_eq!(ovh.state.lock().expect("state").records.len(), 0);
    assert_no_challenge_record(&peers, host);

    // Forced failure 1: the resolvers never see the record. It is still
    // deleted, nothing is installed, and the host backs off.
    let silent = UdpSocket::bind("127.0.0.1:0").expect("bind");
    let blind = manager(
        &peers,
        &ovh,
        vec![silent.local_addr().expect("addr")],
        Duration::from_secs(1),
    );
    let lost = "lost.example.com";
    assert!(matches!(
        blind.ensure(lost, &certs, now).expect("ensure"),
        CertStatus::Issuing { .. }
    ));
    match settle(&blind, lost, &certs, now) {
        CertStatus::BackingOff {
            last_error,
            not_after: None,
            ..
        } => {
            assert!(last_error.contains("was not visible"), "{last_error}")
        }
        other => panic!("expected a failure: {other:?}"),
    }
    {
        let st = ovh.state.lock().expect("state");
        assert!(st.records.is_empty(), "left at OVH: {:?}", st.records);
        assert!(
            st.calls.iter().any(|c| c.starts_with("DELETE ")) && st.rejected.is_empty(),
            "{:?}",
            st.calls
        );
    }
    assert_no_challenge_record(&peers, lost);
    assert!(!CertFiles::new(&certs, lost).chain.exists());

    // Forced failure 2: OVH refuses the record; the error says what to fix and
    // the next pass waits for the backoff instead of ordering again.
    ovh.state.lock().expect("state").refuse_create = true;
    let denied = "denied.example.com";
    assert!(matches!(
        m.ensure(denied, &certs, now).expect("ensure"),
        CertStatus::Issuing { .. }
    ));
    match settle(&m, denied, &certs, now) {
        CertStatus::BackingOff {
            last_error,
            retry_in,
            ..
        } => {
            assert!(last_error.contains("HTTP 403"), "{last_error}");
            assert!(last_error.contains("has not been granted"), "{last_error}");
            assert!(retry_in > Duration::ZERO);
        }
        other => panic!("expected a failure: {other:?}"),
    }
    assert!(!m.issuing(denied), "a backing-off host was ordered again");
    assert!(ovh.state.lock().expect("state").records.is_empty());
    // The working host is untouched by the others' failures.
    assert!(matches!(
        m.ensure(host, &certs, now).expect("ensure"),
        CertStatus::Valid { .. }
    ));

    // What was installed is what nginx needs: it serves the host with the
    // renewed chain and key to a client trusting only Pebble's root.
    nginx_serves_the_certificate(peers.dir.path(), host, &files, &root_pem);
}

/// What the backend answers; nginx only relays it.
const BACKEND_BODY: &str = "served by the keel test backend\n";

/// Runs real nginx with the configuration `render` makes for `host` (the
/// issued chain and key, a backend on loopback) and checks it from outside:
/// HTTPS with SNI reaches the backend, port 80 redirects, a name no Ingress
/// serves learns nothing.
fn nginx_serves_the_certificate(dir: &Path, host: &str, files: &CertFiles, root_pem: &str) {
    if !nginx::present("the nginx part of certificate_issued_renewed_and_challenges_cleaned") {
        return;
    }
    let prefix = dir.join("nginx");
    fs::create_dir_all(prefix.join("tmp")).expect("nginx prefix");
    let backend = Backend::start(BACKEND_BODY);
    let layout = NginxLayout::under(&prefix, free_tcp_port(), free_tcp_port());
    let site = Site {
        host: host.into(),
        upstream: backend.addr,
        certificate: files.chain.clone(),
        key: files.key.clone(),
    };
    let (conf, refused) = render(&[site], &layout);
    assert!(refused.is_empty(), "{refused:?}");
    let server = Nginx::start(&prefix, &conf, &[layout.http_port, layout.https_port]);
    let client = https_client(root_pem.as_bytes());

    // HTTPS for the host: its SNI selects its certificate, which verifies
    // against Pebble's root, and the request reaches the backend.
    let url = format!("https://{host}:{}/hello?x=1", layout.https_port);
    let mut answer = client
        .get(&url)
        .call()
        .unwrap_or_else(|e| panic!("GET {url}: {e}\nnginx:\n{}", server.log()));
    assert_eq!(answer.status(), 200, "nginx:\n{}", server.log());
    let body = answer.body_mut().read_to_string().expect("body");
    assert_eq!(body, BACKEND_BODY);
    let head = backend.next_request();
    assert!(head.starts_with("GET /hello?x=1 HTTP/1."), "{head}");
    let headers: Vec<String> = head.lines().skip(1).map(str::to_ascii_lowercase).collect();
    for wanted in [
        "x-forwarded-proto: https".to_string(),
        format!("host: {host}"),
        "x-real-ip: 127.0.0.1".into(),
    ] {
        assert!(headers.contains(&wanted), "{wanted:?} missing from\n{head}");
    }

    // Port 80 only redirects, to the same host and path over HTTPS.
    let answer = raw_http(
        layout.http_port,
        &format!("GET /some/path?q=1 HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
    );
    assert!(answer.starts_with("HTTP/1.1 301 "), "{answer}");
    assert!(
        answer
            .lines()
            .any(|l| l == format!("Location: https://{host}/some/path?q=1")),
        "{answer}"
    );

    // A name no Ingress serves: port 80 closes without answering (444),
    // port 443 refuses the handshake, so no certificate names a host.
    let answer = raw_http(
        layout.http_port,
        "GET / HTTP/1.1\r\nHost: unknown.example.net\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(answer, "", "nginx answered an unknown host");
    let unknown = format!("https://unknown.example.net:{}/", layout.https_port);
    // rustls reports nginx's alert as an I/O error wrapping its own; the
    // alert (unrecognized_name, RFC 6066) is what `ssl_reject_handshake`
    // sends, unlike a certificate the client merely distrusts.
    match client.get(&unknown).call() {
        Err(e) => assert!(
            format!("{e:?}").contains("AlertReceived(UnrecognisedName)"),
            "the handshake failed for another reason: {e:?}"
        ),
        Ok(answer) => panic!("GET {unknown} answered {}", answer.status()),
    }
    assert_eq!(
        backend.pending_request(),
        None,
        "a refused request reached the backend"
    );
}
