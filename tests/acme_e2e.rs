//! Ingress certificates against real peers: Pebble (the ACME test CA) and
//! pebble-challtestsrv (its DNS server) on loopback, with a fake OVH API in the
//! test (all three from `util::acme`) that checks every signature exactly as
//! OVH documents it and forwards TXT records to challtestsrv. The resolver list points at challtestsrv's DNS
//! port, so the propagation wait really queries DNS, and Pebble validates the
//! DNS-01 challenge against the same server.
//!
//! ACME Renewal Information (RFC 9773) runs against the same Pebble through
//! `util::acme::AriFront`, which serves Pebble's directory with a
//! `renewalInfo` URL of its own (Debian's Pebble 2.4 has none) and answers
//! the windows the test sets: the window is fetched for each certificate,
//! decides over the lifetime third, is asked again only after Retry-After
//! (the manager's clock is a test clock), and renews when it opens.
//!
//! Without the pebble binaries the test prints why and passes, unless `CI` is
//! set: there `.ci/run` installs them and their absence is a failure.

use std::fs;
use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use instant_acme::CertificateIdentifier;
use keel::agentd::ingress::acme::{AcmeSettings, CertFiles, RenewReason, RenewalWindow, Validity};
use keel::agentd::ingress::dns::{OvhCredentials, OvhDns};
use keel::agentd::ingress::nginx::{NginxLayout, Site, render};
use keel::agentd::ingress::{CertManager, CertStatus};
use keel::common::auth::{KeyFilePolicy, unix_now};
use keel::common::backoff::{Clock, ManualClock};
use keel::host::beneath::PathBeneath;
use rustls_pki_types::CertificateDer;

use crate::util::acme::{
    ARI_RETRY_AFTER, AriFront, FakeOvh, Peers, assert_chains_to_root, assert_no_challenge_record,
    mode_of, pem_chain, start_fake_ovh, start_peers, write_ovh_credentials,
};
use crate::util::nginx::{
    self, Backend, Nginx, free_port as free_tcp_port, https_client, raw_http,
};
use crate::util::poll_until;

fn manager(
    peers: &Peers,
    ovh: &FakeOvh,
    resolvers: Vec<SocketAddr>,
    timeout: Duration,
) -> CertManager {
    // A clock that stands still: a failed host stays in backoff for the
    // whole test, however slow the machine.
    let clock = Arc::new(ManualClock::new());
    manager_at(peers, ovh, &peers.directory_url, resolvers, timeout, clock)
}

/// [`manager`] with the ACME directory `directory_url` and the clock `clock`.
fn manager_at(
    peers: &Peers,
    ovh: &FakeOvh,
    directory_url: &str,
    resolvers: Vec<SocketAddr>,
    timeout: Duration,
    clock: Arc<dyn Clock>,
) -> CertManager {
    let creds_path = peers.dir.path().join("ovh.toml");
    write_ovh_credentials(&creds_path);
    let policy = KeyFilePolicy {
        require_root_owner: false,
    };
    let creds = OvhCredentials::load(&creds_path, policy).expect("credentials");
    let settings = AcmeSettings {
        directory_url: directory_url.to_string(),
        account_file: peers.dir.path().join("keel").join("acme-account.json"),
        contact: Some("ops@example.com".into()),
        extra_root: Some(peers.ca_pem.clone()),
        resolvers,
        propagation_timeout: timeout,
        key_policy: policy,
    };
    CertManager::start(settings, Box::new(OvhDns::new(&ovh.base, creds)), clock).expect("start")
}

/// Runs `ensure` until the order it started has finished; returns the status after.
fn settle(m: &CertManager, host: &str, dir: &PathBeneath, unix: i64) -> CertStatus {
    poll_until(&format!("the order for {host}"), || !m.issuing(host));
    m.ensure(host, dir, unix).expect("ensure")
}

#[test]
fn certificate_issued_renewed_and_challenges_cleaned() {
    let Some(peers) = start_peers("the ACME end-to-end test") else {
        return;
    };
    let ovh = start_fake_ovh(peers.challtestsrv);
    let certs = PathBeneath::new(peers.dir.path(), "rootfs-certs");
    fs::create_dir(certs.display_path()).expect("cert dir");
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
    assert_eq!(mode_of(&files.key.display_path()), 0o600);
    assert_eq!(mode_of(&files.chain.display_path()), 0o600);
    assert_eq!(
        mode_of(&peers.dir.path().join("keel/acme-account.json")),
        0o600
    );

    // The chain: leaf for the host, signed by the intermediate, signed by
    // Pebble's root as its management API serves it.
    let chain = pem_chain(&files.chain.display_path());
    let root_pem = peers.root_pem();
    assert_eq!(
        assert_chains_to_root(&files.chain.display_path(), host, &root_pem),
        first
    );

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
    let renewed = pem_chain(&files.chain.display_path());
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
    assert!(!CertFiles::new(&certs, lost).chain.display_path().exists());

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

/// Waits for the order running for `host` to end and returns the validity of
/// what it installed.
fn installed_after_order(m: &CertManager, host: &str, files: &CertFiles) -> Validity {
    poll_until(&format!("the order for {host}"), || !m.issuing(host));
    files.installed().unwrap_or_else(|e| {
        panic!(
            "nothing installed ({e}); last error: {:?}",
            m.last_error(host)
        )
    })
}

/// Runs `ensure` at `unix` until the certificate is Valid with `renew_at`
/// (the renewal window's answer arrived); every pass must find it Valid.
fn await_renew_at(m: &CertManager, host: &str, dir: &PathBeneath, unix: i64, renew_at: i64) {
    poll_until(&format!("renew_at {renew_at} for {host}"), || {
        match m.ensure(host, dir, unix).expect("ensure") {
            CertStatus::Valid { renew_at: r, .. } => r == renew_at,
            other => panic!("{other:?}; last error: {:?}", m.last_error(host)),
        }
    });
}

/// The ARI identifier (RFC 9773 section 4.1) of the installed leaf.
fn ari_id(files: &CertFiles) -> String {
    let der = CertificateDer::from(pem_chain(&files.chain.display_path()).remove(0));
    CertificateIdentifier::try_from(&der)
        .expect("ari id")
        .to_string()
}

/// The serial number of the installed leaf.
fn serial(files: &CertFiles) -> Vec<u8> {
    let leaf = pem_chain(&files.chain.display_path()).remove(0);
    let (_, cert) = x509_parser::parse_x509_certificate(&leaf).expect("leaf");
    cert.tbs_certificate.raw_serial().to_vec()
}

#[test]
fn renewal_information_decides_and_renews_when_the_window_opens() {
    let Some(peers) = start_peers("the ACME renewal information test") else {
        return;
    };
    let front = AriFront::start(&peers);
    let ovh = start_fake_ovh(peers.challtestsrv);
    let certs = PathBeneath::new(peers.dir.path(), "rootfs-certs");
    fs::create_dir(certs.display_path()).expect("cert dir");
    let host = "ari.example.com";
    let clock = ManualClock::new();
    let m = manager_at(
        &peers,
        &ovh,
        &front.directory_url,
        vec![peers.dns],
        Duration::from_secs(20),
        Arc::new(clock.clone()),
    );
    let files = CertFiles::new(&certs, host);
    let now = unix_now() as i64;

    // The first certificate: nothing installed, so no window to ask for.
    assert_eq!(
        m.ensure(host, &certs, now).expect("ensure"),
        CertStatus::Issuing {
            not_after: None,
            reason: RenewReason::Missing
        }
    );
    let first = installed_after_order(&m, host, &files);
    assert!(front.requested().is_empty(), "{:?}", front.requested());

    // The CA suggests renewing later than the lifetime third, so only its
    // window can explain the renew_at `ensure` ends with.
    let lifetime = first.not_after - first.not_before;
    let third = first.not_after - lifetime / 3;
    // Keel renews at a moment of the window picked from the certificate
    // (RFC 9773's random time, stable per certificate).
    let window = |start: i64| RenewalWindow {
        start,
        end: start + 3600,
    };
    let w1 = window(first.not_after - lifetime / 6).renew_at(first);
    front.set_window(window(first.not_after - lifetime / 6));
    await_renew_at(&m, host, &certs, now, w1);
    let id1 = ari_id(&files);
    assert_eq!(front.requested(), std::slice::from_ref(&id1));
    // Past the lifetime third the window still decides, and nobody asks
    // again before Retry-After.
    let late = third + 60;
    assert_eq!(
        m.ensure(host, &certs, late).expect("ensure"),
        CertStatus::Valid {
            not_after: first.not_after,
            renew_at: w1
        }
    );
    assert_eq!(front.requested().len(), 1);

    // After Retry-After it is asked again; while that answer is pending the
    // last window keeps deciding (no renewal by the lifetime third).
    let w2 = window(w1 + 3600).renew_at(first);
    front.set_window(window(w1 + 3600));
    front.hold(true);
    clock.advance(ARI_RETRY_AFTER + Duration::from_secs(1));
    let valid_until_w1 = CertStatus::Valid {
        not_after: first.not_after,
        renew_at: w1,
    };
    assert_eq!(
        m.ensure(host, &certs, late).expect("ensure"),
        valid_until_w1
    );
    poll_until("the recheck reaching the front", || {
        front.requested().len() == 2
    });
    assert_eq!(
        m.ensure(host, &certs, late).expect("ensure"),
        valid_until_w1
    );
    front.hold(false);
    await_renew_at(&m, host, &certs, late, w2);
    assert_eq!(front.requested(), [id1.clone(), id1.clone()]);

    // A recheck that fails (the CA answers 404) keeps the last window: a CA
    // briefly in trouble does not make Keel fall back to the lifetime third.
    front.forget_window();
    clock.advance(ARI_RETRY_AFTER + Duration::from_secs(1));
    let valid_until_w2 = CertStatus::Valid {
        not_after: first.not_after,
        renew_at: w2,
    };
    assert_eq!(
        m.ensure(host, &certs, late).expect("ensure"),
        valid_until_w2
    );
    poll_until("the failed recheck taken in", || {
        front.requested().len() == 3 && !m.asking_renewal_info(host)
    });
    assert_eq!(
        m.ensure(host, &certs, late).expect("ensure"),
        valid_until_w2
    );

    // The CA opens the window now, though the certificate is fresh: after
    // Retry-After the next passes ask, and renew for that reason alone.
    front.set_window(window(now - 7200));
    clock.advance(ARI_RETRY_AFTER + Duration::from_secs(1));
    let mut started = None;
    poll_until("the renewal the open window starts", || {
        match m.ensure(host, &certs, now).expect("ensure") {
            CertStatus::Valid { renew_at, .. } if renew_at == w2 => false,
            other => {
                started = Some(other);
                true
            }
        }
    });
    assert_eq!(
        started,
        Some(CertStatus::Issuing {
            not_after: Some(first.not_after),
            reason: RenewReason::AriWindow
        }),
        "last error: {:?}",
        m.last_error(host)
    );
    let old_serial = serial(&files);
    let second = installed_after_order(&m, host, &files);
    assert_ne!(serial(&files), old_serial, "the leaf was not replaced");
    assert_eq!(m.last_error(host), None);
    {
        let st = ovh.state.lock().expect("state");
        assert!(st.rejected.is_empty(), "bad signatures: {:?}", st.rejected);
        assert!(st.records.is_empty(), "left at OVH: {:?}", st.records);
    }
    assert_no_challenge_record(&peers, host);

    // The new certificate gets its own window; the old one's no longer counts.
    let w3_start = second.not_after - (second.not_after - second.not_before) / 6;
    let w3 = window(w3_start).renew_at(second);
    front.set_window(window(w3_start));
    await_renew_at(&m, host, &certs, now, w3);
    let id2 = ari_id(&files);
    assert_ne!(id2, id1);
    assert_eq!(
        front.requested(),
        [id1.clone(), id1.clone(), id1.clone(), id1, id2]
    );
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
        certificate: files.chain.display_path(),
        key: files.key.display_path(),
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
