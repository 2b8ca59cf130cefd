//! An Ingress through the whole agent: Pebble,
//! pebble-challtestsrv and the fake OVH API of `util::acme`, a real
//! keel-controlplane and one simulated keel-agentd whose keel.toml
//! `[ingress]` section points at them, a Service whose replicas run
//! `tests/fixtures/http_name.py`, and an Ingress applied with keelctl through
//! the control plane.
//!
//! The agent obtains the certificate (DNS-01 through the fake OVH, the
//! propagation checked against challtestsrv's DNS), installs it in the
//! keel-ingress jail's root, loads nginx, and a client trusting only
//! Pebble's root fetches `https://HOST/` from the jail's address with HOST as
//! SNI: the answer is a replica's name, so the request went nginx -> the
//! agent's service proxy on the Service VIP -> a replica. Port 80 redirects;
//! the status shows no secret; deleting the Ingress removes the jail.
//!
//! The agent's proxy listens on the real VIPs (no `--proxy-listen`): nginx's
//! `proxy_pass` names the VIP, which Linux routes to loopback like all of
//! 127.0.0.0/8. nginx binds ports 80 and 443, so the test needs root; it
//! also needs nginx, Pebble and python3. Without them it prints why and
//! passes, unless `CI` is set.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::Instant;

use keel::agentd::ingress::acme::CertFiles;
use keel::agentd::ingress::controller::{CERT_DIR, CONF_DIR, CONF_FILE, INGRESS_JAIL};
use keel::agentd::reconciler::Phase;
use keel::common::auth::KeyFilePolicy;
use keel::common::http::{Client, Endpoint};
use keel::common::wire::{IngressPhase, IngressStatus, JailStatus, ServiceStatus};
use keel::host::beneath::PathBeneath;

use crate::util::acme::{
    AK, AS, CK, FakeOvh, Peers, assert_chains_to_root, assert_no_challenge_record, mode_of,
    start_fake_ovh, start_peers, write_ovh_credentials,
};
use crate::util::cluster::{Cluster, free_port, node_ip};
use crate::util::nginx::{self, https_client_at, raw_http_at};
use crate::util::{DEADLINE, fixture_service, python3};

const NODE: &str = "n1";
const HOST: &str = "shop.example.com";

fn apply(cluster: &Cluster, args: &[&str], doc: &str) {
    let mut all = vec!["apply", "-f", "-"];
    all.extend_from_slice(args);
    let run = cluster.keelctl_with(&all, Some(doc));
    assert_eq!(run.code, 0, "apply {doc}: {run:?}\n{}", cluster.logs());
}

/// Polls `probe` until it returns `Some`, for up to [`DEADLINE`] (issuing a
/// certificate takes longer than the cluster's own convergence bound);
/// panics with `what`, the last thing `probe` saw and every daemon's log.
fn wait_long<T>(
    cluster: &Cluster,
    what: &str,
    mut probe: impl FnMut(&mut String) -> Option<T>,
) -> T {
    let deadline = Instant::now() + DEADLINE;
    let mut last = String::new();
    loop {
        if let Some(v) = probe(&mut last) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; last seen: {last}\n{}",
            cluster.logs()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// keel.toml of the agent: `[ingress]` towards the test's peers.
fn agent_config(dir: &Path, peers: &Peers, ovh: &FakeOvh) -> PathBuf {
    let credentials = dir.join("ovh.toml");
    write_ovh_credentials(&credentials);
    let text = format!(
        "[ingress]
acme_directory = \"{directory}\"
acme_contact = \"ops@example.com\"
acme_account_key = \"{account}\"
acme_extra_root = \"{root}\"
ovh_endpoint = \"{endpoint}\"
ovh_credentials = \"{credentials}\"
resolvers = [\"{dns}\"]
propagation_timeout = \"20s\"
",
        directory = peers.directory_url,
        account = dir.join("acme-account.json").display(),
        root = peers.ca_pem.display(),
        endpoint = ovh.base,
        credentials = credentials.display(),
        dns = peers.dns,
    );
    let path = dir.join("keel.toml");
    std::fs::write(&path, text).expect("write keel.toml");
    path
}

/// Starts agent `n1` of [`Cluster::standard`] with `config`, its service
/// proxy on each Service's VIP (the standard `--proxy-listen` left out).
fn start_agent(cluster: &mut Cluster, config: &Path) {
    let ip = node_ip(1);
    let mut args = cluster.standard_agent_args(NODE, SocketAddr::from((ip, free_port(ip))), ip);
    let at = args
        .iter()
        .position(|a| a == "--proxy-listen")
        .expect("the standard agent sets --proxy-listen");
    args.drain(at..at + 2);
    args.extend(["--config".to_string(), config.display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    cluster.start_agent(NODE, &args);
}

const SHOP: &str = "kind: Ingress
metadata: {name: shop}
spec: {host: shop.example.com, service: web}
";

/// The node's jails as keelctl lists them through the control plane (the
/// ingress jail among them, though the control plane did not place it).
fn jails(cluster: &Cluster) -> Vec<JailStatus> {
    let out = cluster
        .keelctl_ok(&["get", "jails", "--node", NODE, "-o", "json"])
        .stdout;
    serde_json::from_str(&out).expect("jail list")
}

fn ingresses(cluster: &Cluster) -> Vec<IngressStatus> {
    let out = cluster
        .keelctl_ok(&["get", "ingresses", "--node", NODE, "-o", "json"])
        .stdout;
    serde_json::from_str(&out).expect("ingress list")
}

#[test]
fn an_ingress_through_the_agent_serves_https_with_an_issued_certificate() {
    let root = KeyFilePolicy::for_current_process().require_root_owner;
    let python = python3();
    if !root || python.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run this test as root with python3 installed"
        );
        eprintln!(
            "skipping the ingress end-to-end test: needs root (nginx binds 80 and 443) and python3"
        );
        return;
    }
    let python = python.expect("checked");
    if !nginx::present("the ingress end-to-end test") {
        return;
    }
    let Some(peers) = start_peers("the ingress end-to-end test") else {
        return;
    };
    let ovh = start_fake_ovh(peers.challtestsrv);
    let root_pem = peers.root_pem();

    let mut cluster = Cluster::standard(0);
    let config = agent_config(peers.dir.path(), &peers, &ovh);
    start_agent(&mut cluster, &config);

    // The backend: two replicas answering HTTP with their names.
    let port = free_port(Ipv4Addr::LOCALHOST);
    apply(
        &cluster,
        &[],
        &fixture_service("web", "http_name.py", 2, port, &python),
    );
    let service: ServiceStatus = cluster.wait_for("both replicas of web ready", || {
        let out = cluster.keelctl(&["get", "service", "web", "-o", "json"]);
        let s: ServiceStatus = serde_json::from_str(&out.stdout).ok()?;
        (s.ready == 2).then_some(s)
    });
    let replicas: BTreeSet<String> = service.replicas.iter().map(|r| r.name.clone()).collect();

    // The Ingress, on the node, through the control plane.
    apply(&cluster, &["--node", NODE], SHOP);
    let status = wait_long(&cluster, "the Ingress serving with a certificate", |last| {
        let list = ingresses(&cluster);
        *last = format!("{list:?}");
        match list.as_slice() {
            [s] if s.phase == IngressPhase::Serving && s.certificate_expires.is_some() => {
                Some(s.clone())
            }
            _ => None,
        }
    });
    assert_eq!(
        (
            status.name.as_str(),
            status.host.as_str(),
            status.service.as_str()
        ),
        ("shop", HOST, "web")
    );
    assert_eq!(status.last_error, None, "{status:?}");

    // The installed files: in the ingress jail's root, the chain naming the
    // host and chaining to Pebble's root, the key readable by root alone.
    let jail_root = cluster.state_dir(NODE).join("jails").join(INGRESS_JAIL);
    let cert_dir = PathBeneath::new(
        &jail_root,
        Path::new(CONF_DIR.trim_start_matches('/')).join(CERT_DIR),
    );
    let files = CertFiles::new(&cert_dir, HOST);
    assert_eq!(
        Some(assert_chains_to_root(
            &files.chain.display_path(),
            HOST,
            &root_pem
        )),
        status.certificate_expires,
        "the status shows the installed certificate's expiry"
    );
    assert_eq!(mode_of(&files.key.display_path()), 0o600);
    assert_eq!(mode_of(&files.chain.display_path()), 0o600);
    assert_eq!(mode_of(&peers.dir.path().join("acme-account.json")), 0o600);
    // nginx relays to the Service's VIP, not to a replica.
    let conf = std::fs::read_to_string(
        jail_root
            .join(CONF_DIR.trim_start_matches('/'))
            .join(CONF_FILE),
    )
    .expect("nginx.conf in the ingress jail");
    let upstream = SocketAddrV4::new(service.vip, service.port);
    assert!(
        conf.contains(&format!("proxy_pass http://{upstream}")),
        "no proxy_pass to {upstream} in\n{conf}"
    );

    // The challenge record is gone, everywhere; every OVH call verified.
    assert_no_challenge_record(&peers, HOST);
    {
        let st = ovh.state.lock().expect("ovh state");
        assert!(st.rejected.is_empty(), "bad signatures: {:?}", st.rejected);
        assert!(st.records.is_empty(), "left at OVH: {:?}", st.records);
        assert!(
            st.calls.iter().any(|c| c.starts_with("DELETE ")),
            "{:?}",
            st.calls
        );
    }

    // What the API shows of the Ingress, from the agent and through the
    // control plane: no credential, no key, no ACME endpoint.
    let from_agent = Client::new(Endpoint::Unix(cluster.socket(NODE)))
        .request("GET", "/ingresses/shop", &[], b"")
        .expect("the agent answers");
    assert_eq!(from_agent.status, 200);
    let from_agent = String::from_utf8(from_agent.body).expect("utf-8");
    let from_cp = cluster
        .keelctl_ok(&["get", "ingress", "shop", "--node", NODE, "-o", "json"])
        .stdout;
    for shown in [&from_agent, &from_cp] {
        assert!(shown.contains(HOST), "{shown}");
        for secret in [AK, AS, CK, "PRIVATE KEY", &peers.directory_url, &ovh.base] {
            assert!(!shown.contains(secret), "{secret:?} shown in {shown}");
        }
    }

    // HTTPS from outside: the jail's address, SNI and Host = HOST, trusting
    // only Pebble's root. nginx may still be switching to the configuration
    // with the host when the status says Serving (a reload is asynchronous),
    // so the first answers are awaited; then every answer is a replica's
    // name, and both replicas answer in turn.
    // The jail runs once nginx has started in it (the status may lag a
    // pass behind on a loaded machine).
    let address = wait_long(&cluster, "the ingress jail running", |last| {
        let all = jails(&cluster);
        *last = format!("{all:?}");
        all.into_iter()
            .find(|j| j.name == INGRESS_JAIL && j.state == Phase::Running)
            .map(|j| j.address)
    });
    let client = https_client_at(root_pem.as_bytes(), address);
    let url = format!("https://{HOST}/");
    let mut served = BTreeSet::new();
    wait_long(&cluster, "both replicas answering through nginx", |last| {
        match client.get(&url).call() {
            Ok(mut answer) => {
                let body = answer.body_mut().read_to_string().expect("body");
                assert_eq!(answer.status(), 200, "GET {url}: {body}");
                let name = body.strip_suffix('\n').unwrap_or(&body).to_string();
                assert!(replicas.contains(&name), "GET {url} answered {body:?}");
                served.insert(name);
            }
            Err(e) => *last = format!("GET {url}: {e}"),
        }
        (served == replicas).then_some(())
    });

    // Port 80 only redirects to HTTPS. An old nginx worker may still be
    // taking connections with the previous configuration, which closes them
    // unanswered (444); anything else is a wrong answer.
    let http = SocketAddrV4::new(address, 80);
    let request = format!("GET /a/path?q=1 HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n");
    let answer = wait_long(&cluster, "port 80 redirecting", |last| {
        let answer = raw_http_at(http, &request);
        *last = format!("{answer:?}");
        (!answer.is_empty()).then_some(answer)
    });
    assert!(answer.starts_with("HTTP/1.1 301 "), "{answer}");
    assert!(
        answer
            .lines()
            .any(|l| l == format!("Location: https://{HOST}/a/path?q=1")),
        "{answer}"
    );

    // Deleting the Ingress, the node's last, takes the jail away.
    cluster.keelctl_ok(&["delete", "ingress", "shop", "--node", NODE]);
    cluster.wait_for("the ingress jail removed", || {
        (!jails(&cluster).iter().any(|j| j.name == INGRESS_JAIL)).then_some(())
    });
    assert_eq!(ingresses(&cluster), Vec::new());
}
