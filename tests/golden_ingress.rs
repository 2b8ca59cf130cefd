//! Golden transcripts of the ingress controller on the FreeBSD
//! implementations (tests/golden/ingress_*.txt): the pf anchor load, `nginx
//! -t` in the jail followed by the reload, an `nginx -t` failure after which
//! nothing is reloaded, and the removal of the ingress jail with the last
//! Ingress (and the anchor flushed).
//!
//! The ingress jail is provisioned beforehand over the Fakes (its provision
//! is the reconciler's, recorded in agent_provision.txt); each step then
//! builds a controller and a reconciler on the FreeBSD implementations from
//! the persisted state, as a restarted keel-agentd does. Certificates are
//! installed by hand where the certificate thread would leave them.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::agentd::ingress::CertManager;
use keel::agentd::ingress::acme::AcmeSettings;
use keel::agentd::ingress::controller::{
    CERT_DIR, CONF_DIR, INGRESS_JAIL, IngressController, IngressSettings,
};
use keel::agentd::ingress::dns::FakeDns;
use keel::agentd::reconciler::{AgentStore, NodeNetwork, Reconciler};
use keel::common::auth::KeyFilePolicy;
use keel::common::backoff::ManualClock;
use keel::common::cmd::RecordingRunner;
use keel::common::config::CommandPaths;
use keel::common::spec::parse_ingress;
use keel::common::wire::IngressPhase;
use keel::host::fake::{CallLog, Faults};
use keel::host::jail::{FakeJails, FreeBsdJails, JailRuntime};
use keel::host::mount::{FakeMounts, FreeBsdMounts, MountManager};
use keel::host::net::{FakeNet, FreeBsdNet, NetManager};
use keel::host::pf::{FakeFirewall, Firewall, FreeBsdPf};
use keel::host::zfs::{FakeZfs, FreeBsdZfs, ZfsLayout, ZfsManager};

use crate::util::golden;

/// Fixed, because the paths are part of the recorded argv.
fn base() -> PathBuf {
    PathBuf::from("/tmp/keel-golden/ingress")
}

fn layout() -> ZfsLayout {
    ZfsLayout {
        pool: "zroot".into(),
        jails_dir: base().join("jails"),
        volumes_dir: base().join("volumes"),
    }
}

fn node() -> NodeNetwork {
    NodeNetwork {
        bridge: "keel0".into(),
        subnet: "10.20.3.0/24".parse().expect("subnet"),
    }
}

fn settings() -> IngressSettings {
    IngressSettings {
        base: "14.2-RELEASE".into(),
        nginx: "/usr/local/sbin/nginx".into(),
        public: Some(("em0".into(), Ipv4Addr::new(203, 0, 113, 10))),
        simulate: false,
    }
}

fn certs(state: &Path) -> Result<CertManager, String> {
    CertManager::start(
        AcmeSettings {
            directory_url: "https://acme.invalid/directory".into(),
            account_file: state.join("account.json"),
            contact: None,
            extra_root: None,
            resolvers: Vec::new(),
            propagation_timeout: Duration::from_secs(1),
            key_policy: KeyFilePolicy::for_current_process(),
        },
        Box::new(FakeDns::new()),
        Arc::new(ManualClock::new()),
    )
    .map_err(|e| e.to_string())
}

fn reconciler<J, Z, N, M>(state: &Path, j: J, z: Z, n: N, m: M) -> Reconciler<J, Z, N, M>
where
    J: JailRuntime,
    Z: ZfsManager,
    N: NetManager,
    M: MountManager,
{
    let (store, saved) = AgentStore::open(state).expect("store");
    Reconciler::new(
        j,
        z,
        n,
        m,
        node(),
        store,
        saved,
        Box::new(ManualClock::new()),
    )
}

/// One controller pass on the FreeBSD implementations over `runner`.
fn freebsd_pass(
    runner: Arc<RecordingRunner>,
    state: &Path,
    change: impl FnOnce(&mut IngressController),
) -> IngressController {
    let paths = CommandPaths::default();
    let mut r = reconciler(
        state,
        FreeBsdJails::new(runner.clone(), paths.clone(), base().join("conf")),
        FreeBsdZfs::new(runner.clone(), paths.clone(), layout(), 3, Duration::ZERO),
        FreeBsdNet::new(runner.clone(), paths.clone()),
        FreeBsdMounts::new(runner.clone(), paths.clone()),
    );
    let firewall: Box<dyn Firewall> = Box::new(FreeBsdPf::new(runner, paths));
    let mut c = IngressController::open(state, settings(), firewall, certs(state)).expect("open");
    c.set_services(BTreeMap::from([
        ("web".into(), SocketAddrV4::new([10, 96, 0, 7].into(), 8080)),
        ("api".into(), SocketAddrV4::new([10, 96, 0, 8].into(), 9000)),
    ]));
    change(&mut c);
    c.pass(&mut r, Instant::now(), 1_800_000_000);
    c
}

fn install_certificate(host: &str) {
    let dir = base()
        .join("jails")
        .join(INGRESS_JAIL)
        .join(CONF_DIR.trim_start_matches('/'))
        .join(CERT_DIR);
    std::fs::create_dir_all(&dir).expect("cert dir");
    let key = rcgen::KeyPair::generate().expect("key");
    let leaf = rcgen::CertificateParams::new(vec![host.into()])
        .expect("params")
        .self_signed(&key)
        .expect("cert");
    std::fs::write(dir.join(format!("{host}.crt")), leaf.pem()).expect("chain");
    std::fs::write(dir.join(format!("{host}.key")), key.serialize_pem()).expect("key");
}

fn ingress(name: &str, host: &str, service: &str) -> keel::common::spec::Ingress {
    parse_ingress(&format!(
        "kind: Ingress\nmetadata: {{name: {name}}}\nspec: {{host: {host}, service: {service}}}\n"
    ))
    .expect("valid")
}

#[test]
fn ingress_anchor_check_reload_refusal_and_removal() {
    let state = tempfile::tempdir().expect("tempdir");
    let _ = std::fs::remove_dir_all(base());
    // What `zfs clone` of a base with the nginx package leaves.
    let sbin = base()
        .join("jails")
        .join(INGRESS_JAIL)
        .join("usr/local/sbin");
    std::fs::create_dir_all(&sbin).expect("rootfs");
    std::fs::write(sbin.join("nginx"), "#!/bin/sh\n").expect("nginx");

    // The ingress jail and the first Ingress, over the Fakes.
    {
        let log = CallLog::new();
        let zfs = FakeZfs::with_layout(layout(), log.clone(), Faults::default());
        zfs.add_base("14.2-RELEASE");
        let mut r = reconciler(
            state.path(),
            FakeJails::new(log.clone(), Faults::default()),
            zfs,
            FakeNet::new(log.clone(), Faults::default()),
            FakeMounts::new(log.clone(), Faults::default()),
        );
        let firewall = FakeFirewall::new(log, Faults::default());
        let mut c = IngressController::open(
            state.path(),
            settings(),
            Box::new(firewall),
            certs(state.path()),
        )
        .expect("open");
        c.put(ingress("web", "www.example.org", "web"))
            .expect("put");
        c.pass(&mut r, Instant::now(), 1_800_000_000);
        assert!(r.record(INGRESS_JAIL).is_some());
    }
    install_certificate("www.example.org");

    golden::check("ingress_reload", |runner| {
        let c = freebsd_pass(runner, state.path(), |_| {});
        let web = c.status("web").expect("status");
        assert_eq!(web.phase, IngressPhase::Serving, "{web:?} {:?}", c.problems);
    });

    install_certificate("api.example.org");
    golden::check("ingress_nginx_refused", |runner| {
        let c = freebsd_pass(runner, state.path(), |c| {
            c.put(ingress("api", "api.example.org", "api"))
                .expect("put");
        });
        let api = c.status("api").expect("status");
        assert_eq!(api.phase, IngressPhase::Failed, "{api:?}");
        assert!(
            api.last_error
                .as_deref()
                .is_some_and(|e| e.contains("cannot load certificate")),
            "{api:?}"
        );
        assert_eq!(
            c.status("web").map(|s| s.phase),
            Some(IngressPhase::Serving)
        );
    });

    golden::check("ingress_jail_removed", |runner| {
        let c = freebsd_pass(runner.clone(), state.path(), |c| {
            assert!(c.delete("web").expect("delete"));
            assert!(c.delete("api").expect("delete"));
        });
        assert!(c.problems.is_empty(), "{:?}", c.problems);
        assert!(
            runner
                .ran()
                .iter()
                .any(|e| e.argv.iter().any(|a| a == "-F"))
        );
    });
    let _ = std::fs::remove_dir_all(base());
}
