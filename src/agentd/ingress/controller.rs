//! The ingress controller: from the Ingresses applied on this node to a
//! running nginx jail, its configuration and the pf anchor.
//!
//! It owns the applied Ingresses (persisted in `{state_dir}/ingresses.json`),
//! what nginx was last loaded with, and whether the `keel/ingress` anchor is
//! loaded. It runs on the agent's worker thread, next to the reconciler, once
//! per reconcile pass and after every Ingress change; it reaches the host only
//! through the reconciler (the ingress jail is provisioned like any other
//! jail), [`crate::host::JailRuntime::exec`] (`nginx -t`,
//! `nginx -s reload` inside the jail), the [`Firewall`] seam and the
//! [`CertManager`], whose slow work runs on its own thread.
//!
//! A pass:
//! 1. No Ingress: the ingress jail is deleted and the anchor flushed.
//! 2. The ingress jail (`keel-ingress`, base `ingress.base`, nginx in the
//!    foreground under daemon(8)) is applied when missing. Its root seed,
//!    registered before the worker's first reconcile pass, refuses a root
//!    without nginx before the jail is created: every Ingress is then Failed
//!    with how to build a base with it, and no jail crash-loops. A jail that
//!    failed so and never started is removed when `ingress.base` changes, so
//!    the new base is cloned afresh.
//! 3. The anchor is loaded once (the same text is not loaded again), retried
//!    with backoff when pfctl fails.
//! 4. Each Ingress whose Service VIP is known asks the [`CertManager`] for its
//!    certificate; a host with an installed certificate (valid, or being
//!    renewed, or whose renewal failed) is served, the others wait.
//! 5. [`render`] over the served hosts. When the text differs from what nginx
//!    runs, it is written next to the live file, checked with `nginx -t`
//!    inside the jail, and only then renamed over the live file and loaded
//!    with `nginx -s reload`. A configuration nginx refuses changes nothing:
//!    the hosts that were added since the last good one are marked Failed
//!    with nginx's message, and the others keep serving.
//!
//! Every file it reads or writes in the jail's root goes through
//! [`crate::host::beneath`] (the jail's processes could plant a link at any
//! moment).
//!
//! Must never: reload nginx with a configuration `nginx -t` did not accept,
//! open anything in the jail's root by path, or let one Ingress's failure
//! touch another.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::agentd::ingress::nginx::{NginxLayout, Site, render};
use crate::agentd::ingress::pf::{INGRESS_ANCHOR, ingress_rules};
use crate::agentd::ingress::{CertManager, CertStatus};
use crate::agentd::reconciler::{Phase, Reconciler};
use crate::common::backoff::Backoff;
use crate::common::events::EventLog;
use crate::common::spec::{ExecSpec, Ingress, Jail, JailSpec, Metadata, NetworkSpec, Resources};
use crate::common::store::{Store, StoreError};
use crate::common::wire::{IngressPhase, IngressStatus, ObjectKind};
use crate::host::beneath::{self, PathBeneath};
use crate::host::pf::Firewall;
use crate::host::{JailRuntime, MountManager, NetManager, ZfsManager};

/// The ingress jail's name; user jails may not take the `keel-` prefix.
pub const INGRESS_JAIL: &str = "keel-ingress";
/// File of the persisted Ingresses, in the agent's state directory.
pub const STATE_FILE: &str = "ingresses.json";
/// Where Keel keeps nginx's configuration and certificates, inside the jail.
pub const CONF_DIR: &str = "/usr/local/etc/keel-ingress";
/// The live configuration nginx runs with.
pub const CONF_FILE: &str = "nginx.conf";
/// The candidate checked with `nginx -t` before it replaces the live one.
pub const NEXT_FILE: &str = "nginx.conf.next";
/// Certificates and keys, under [`CONF_DIR`].
pub const CERT_DIR: &str = "certs";
/// Directories nginx writes to inside the jail ([`NginxLayout`]'s pid file,
/// logs and temporary files).
const NGINX_DIRS: [&str; 3] = ["/var/run", "/var/log/nginx", "/var/tmp/nginx"];
/// Mode of nginx's configuration files (keys and certificates are 0600).
const CONF_MODE: u32 = 0o644;

/// How the ingress jail is built and reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngressSettings {
    /// Base the jail is cloned from (`ingress.base`).
    pub base: String,
    /// nginx, as the jail sees it (`/usr/local/sbin/nginx` from the package).
    pub nginx: PathBuf,
    /// Public interface and IPv4 address pf redirects to the jail, when
    /// configured (`ingress.public_interface`, `ingress.public_address`).
    pub public: Option<(String, Ipv4Addr)>,
    /// The simulated runtime runs the jail's processes on the host, seeing
    /// the host's files: paths given to nginx are then under the jail's root,
    /// and nginx listens on the jail's own address only.
    pub simulate: bool,
}

/// What is persisted: the Ingresses applied on this node, by name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IngressState {
    /// Applied Ingresses.
    pub ingresses: BTreeMap<String, Ingress>,
    /// The hosts of the configuration nginx last accepted and loaded, so a
    /// restarted agent still knows which hosts work when nginx refuses a
    /// new configuration.
    #[serde(default)]
    pub loaded_hosts: BTreeSet<String>,
}

/// Why an Ingress request was refused, or a change could not be saved.
#[derive(Debug)]
pub enum IngressApiError {
    /// Another Ingress already serves this host.
    HostTaken {
        /// The host.
        host: String,
        /// The Ingress that has it.
        by: String,
    },
    /// Saving `ingresses.json` failed; nothing changed.
    Store(StoreError),
}

impl fmt::Display for IngressApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IngressApiError::HostTaken { host, by } => write!(
                f,
                "host {host} is already served by Ingress {by}; delete that one first or choose another host"
            ),
            IngressApiError::Store(e) => write!(f, "could not save the Ingresses: {e}"),
        }
    }
}

impl std::error::Error for IngressApiError {}

/// What the last pass found for one Ingress.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Observed {
    phase: IngressPhase,
    expires: Option<i64>,
    error: Option<String>,
}

/// See the module docs.
pub struct IngressController {
    store: Store<IngressState>,
    state: IngressState,
    settings: IngressSettings,
    firewall: Box<dyn Firewall>,
    certs: Result<CertManager, String>,
    /// Service name -> VIP:port, from the last heartbeat answer.
    services: BTreeMap<String, SocketAddrV4>,
    loaded_anchor: Option<String>,
    anchor_retry: Backoff<()>,
    /// The configuration nginx was last loaded with, and the hosts in it.
    running: Option<(String, BTreeSet<String>)>,
    observed: BTreeMap<String, Observed>,
    /// The reconciler holds the seed writing the jail's first configuration.
    seed_registered: bool,
    /// Problems of the last pass that concern no single Ingress.
    pub problems: Vec<String>,
}

impl fmt::Debug for IngressController {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IngressController")
            .field("ingresses", &self.state.ingresses.keys())
            .finish_non_exhaustive()
    }
}

impl IngressController {
    /// Opens the persisted Ingresses in `state_dir`. `certs` is the
    /// certificate manager, or why there is none (no OVH credentials, say):
    /// every Ingress then waits for a certificate with that reason.
    pub fn open(
        state_dir: &Path,
        settings: IngressSettings,
        firewall: Box<dyn Firewall>,
        certs: Result<CertManager, String>,
    ) -> Result<IngressController, StoreError> {
        let (store, state) = Store::open(state_dir, STATE_FILE)?;
        Ok(IngressController {
            store,
            state: state.unwrap_or_default(),
            settings,
            firewall,
            certs,
            services: BTreeMap::new(),
            loaded_anchor: None,
            anchor_retry: Backoff::new(),
            running: None,
            observed: BTreeMap::new(),
            seed_registered: false,
            problems: Vec::new(),
        })
    }

    /// Records (or replaces) an Ingress; the next pass serves it.
    pub fn put(&mut self, ingress: Ingress) -> Result<(), IngressApiError> {
        let name = &ingress.metadata.name;
        if let Some((by, _)) = self
            .state
            .ingresses
            .iter()
            .find(|(n, i)| *n != name && i.spec.host == ingress.spec.host)
        {
            return Err(IngressApiError::HostTaken {
                host: ingress.spec.host.clone(),
                by: by.clone(),
            });
        }
        let mut next = self.state.clone();
        next.ingresses.insert(name.clone(), ingress);
        self.store.save(&next).map_err(IngressApiError::Store)?;
        self.state = next;
        Ok(())
    }

    /// Forgets an Ingress; false when there was none by that name.
    pub fn delete(&mut self, name: &str) -> Result<bool, IngressApiError> {
        if !self.state.ingresses.contains_key(name) {
            return Ok(false);
        }
        let mut next = self.state.clone();
        next.ingresses.remove(name);
        self.store.save(&next).map_err(IngressApiError::Store)?;
        self.state = next;
        self.observed.remove(name);
        Ok(true)
    }

    /// The service table of the last heartbeat (VIP and port by name).
    pub fn set_services(&mut self, services: BTreeMap<String, SocketAddrV4>) {
        self.services = services;
    }

    /// Every Ingress and where it stands.
    pub fn statuses(&self) -> Vec<IngressStatus> {
        self.state
            .ingresses
            .keys()
            .filter_map(|n| self.status(n))
            .collect()
    }

    /// The Ingress `name` as it was last applied.
    pub fn applied(&self, name: &str) -> Option<&Ingress> {
        self.state.ingresses.get(name)
    }

    /// One Ingress and where it stands (before its first pass: Issuing).
    pub fn status(&self, name: &str) -> Option<IngressStatus> {
        let ingress = self.state.ingresses.get(name)?;
        let observed = self.observed.get(name).cloned().unwrap_or(Observed {
            phase: IngressPhase::Issuing,
            expires: None,
            error: None,
        });
        Some(IngressStatus {
            name: name.to_string(),
            host: ingress.spec.host.clone(),
            service: ingress.spec.service.clone(),
            phase: observed.phase,
            certificate_expires: observed.expires,
            last_error: observed.error,
        })
    }

    /// One pass (see the module docs). `unix_now` is the wall clock for
    /// certificate expiry; `now` the monotonic one for backoff.
    pub fn pass<J, Z, N, M>(
        &mut self,
        reconciler: &mut Reconciler<J, Z, N, M>,
        now: Instant,
        unix_now: i64,
    ) where
        J: JailRuntime,
        Z: ZfsManager,
        N: NetManager,
        M: MountManager,
    {
        self.problems.clear();
        if self.state.ingresses.is_empty() {
            self.tear_down(reconciler);
            return;
        }
        let Some(address) = self.ensure_jail(reconciler) else {
            return;
        };
        self.ensure_anchor(address, now);

        let root = reconciler.rootfs_path(INGRESS_JAIL);
        let seen = |p: &str| self.settings.as_seen_by_nginx(&root, p);
        let cert_files = PathBeneath::new(&root, Path::new(relative(CONF_DIR)).join(CERT_DIR));
        if let Err(e) = beneath::make_dirs(cert_files.root(), cert_files.inside()) {
            self.fail_every_ingress(format!("ingress jail files: {e}"));
            return;
        }
        let cert_dir_nginx = seen(&format!("{CONF_DIR}/{CERT_DIR}"));

        let mut sites = Vec::new();
        let mut observed = BTreeMap::new();
        for (name, ingress) in &self.state.ingresses {
            let host = &ingress.spec.host;
            let Some(upstream) = self.services.get(&ingress.spec.service).copied() else {
                observed.insert(
                    name.clone(),
                    Observed {
                        phase: IngressPhase::NoService,
                        expires: None,
                        error: Some(format!(
                            "service {} is not known on this node yet (no VIP); the host is left out of nginx until it is",
                            ingress.spec.service
                        )),
                    },
                );
                continue;
            };
            let (phase, expires, error) = match &self.certs {
                Err(why) => (IngressPhase::Issuing, None, Some(why.clone())),
                Ok(certs) => match certs.ensure(host, &cert_files, unix_now) {
                    Err(e) => (IngressPhase::BackingOff, None, Some(e.to_string())),
                    Ok(CertStatus::Valid { not_after, .. }) => {
                        (IngressPhase::Serving, Some(not_after), None)
                    }
                    Ok(CertStatus::Issuing { not_after, .. }) => (
                        if not_after.is_some() {
                            IngressPhase::Serving
                        } else {
                            IngressPhase::Issuing
                        },
                        not_after,
                        None,
                    ),
                    Ok(CertStatus::BackingOff {
                        not_after,
                        last_error,
                        ..
                    }) => (
                        if not_after.is_some() {
                            IngressPhase::Serving
                        } else {
                            IngressPhase::BackingOff
                        },
                        not_after,
                        Some(last_error),
                    ),
                },
            };
            if expires.is_some() {
                sites.push(Site {
                    host: host.clone(),
                    upstream,
                    certificate: cert_dir_nginx.join(format!("{host}.crt")),
                    key: cert_dir_nginx.join(format!("{host}.key")),
                });
            }
            observed.insert(
                name.clone(),
                Observed {
                    phase,
                    expires,
                    error,
                },
            );
        }

        let layout = self.settings.layout(&root, address);
        let (conf, refused) = render(&sites, &layout);
        for r in &refused {
            if let Some((name, _)) = self
                .state
                .ingresses
                .iter()
                .find(|(_, i)| i.spec.host == r.host)
            {
                observed.insert(
                    name.clone(),
                    Observed {
                        phase: IngressPhase::Failed,
                        expires: None,
                        error: Some(r.to_string()),
                    },
                );
            }
        }
        let hosts: BTreeSet<String> = sites
            .iter()
            .map(|s| s.host.clone())
            .filter(|h| !refused.iter().any(|r| &r.host == h))
            .collect();
        if self.running.as_ref().is_none_or(|(c, _)| *c != conf) {
            match self.load(reconciler, &root, &conf) {
                Ok(()) => {
                    if self.state.loaded_hosts != hosts {
                        let mut next = self.state.clone();
                        next.loaded_hosts = hosts.clone();
                        match self.store.save(&next) {
                            Ok(()) => self.state = next,
                            Err(e) => self.problems.push(format!("saving the loaded hosts: {e}")),
                        }
                    }
                    self.running = Some((conf, hosts));
                }
                Err(message) => {
                    let good = self.state.loaded_hosts.clone();
                    for (name, ingress) in &self.state.ingresses {
                        if hosts.contains(&ingress.spec.host) && !good.contains(&ingress.spec.host)
                        {
                            observed.insert(
                                name.clone(),
                                Observed {
                                    phase: IngressPhase::Failed,
                                    expires: observed.get(name).and_then(|o| o.expires),
                                    error: Some(message.clone()),
                                },
                            );
                        }
                    }
                    self.problems.push(message);
                }
            }
        }
        self.tell_certificates(reconciler.events(), &observed);
        self.observed = observed;
    }

    /// Records a CertificateIssued event for each Ingress whose certificate
    /// expiry moved (a new certificate is in place), and a
    /// CertificateFailed one for each whose certificate error is new.
    fn tell_certificates(&self, events: &EventLog, observed: &BTreeMap<String, Observed>) {
        for (name, now) in observed {
            let before = self.observed.get(name);
            let host = self
                .state
                .ingresses
                .get(name)
                .map(|i| i.spec.host.as_str())
                .unwrap_or("?");
            if let Some(expires) = now.expires
                && before.and_then(|b| b.expires) != Some(expires)
            {
                events.normal(
                    ObjectKind::Ingress,
                    name,
                    "CertificateIssued",
                    format!(
                        "a certificate for {host} is in place, valid until {expires} (Unix seconds)"
                    ),
                );
            }
            if now.phase == IngressPhase::BackingOff
                && let Some(error) = &now.error
                && before.and_then(|b| b.error.as_ref()) != Some(error)
            {
                events.warning(
                    ObjectKind::Ingress,
                    name,
                    "CertificateFailed",
                    format!("no certificate for {host} yet: {error}"),
                );
            }
        }
    }

    /// Writes `conf` next to the live file, checks it with `nginx -t` in the
    /// jail, then renames it over the live file and reloads nginx.
    fn load<J, Z, N, M>(
        &self,
        reconciler: &Reconciler<J, Z, N, M>,
        root: &Path,
        conf: &str,
    ) -> Result<(), String>
    where
        J: JailRuntime,
        Z: ZfsManager,
        N: NetManager,
        M: MountManager,
    {
        let next = Path::new(CONF_DIR).join(NEXT_FILE);
        let live = Path::new(CONF_DIR).join(CONF_FILE);
        beneath::write(
            root,
            &Path::new(relative(CONF_DIR)).join(NEXT_FILE),
            conf.as_bytes(),
            CONF_MODE,
        )
        .map_err(|e| format!("writing nginx's configuration: {e}"))?;
        let seen_next = self
            .settings
            .as_seen_by_nginx(root, &next.to_string_lossy());
        let seen_live = self
            .settings
            .as_seen_by_nginx(root, &live.to_string_lossy());
        let nginx = self.settings.nginx.to_string_lossy().into_owned();
        let check = [
            nginx.clone(),
            "-t".into(),
            "-c".into(),
            path_arg(&seen_next),
        ];
        let out = reconciler
            .exec_in(INGRESS_JAIL, &check)
            .map_err(|e| format!("nginx -t in {INGRESS_JAIL}: {e}"))?;
        if !out.success() {
            return Err(format!(
                "nginx refused the new configuration, the previous one keeps serving: {}",
                out.stderr.trim()
            ));
        }
        beneath::rename(root, Path::new(relative(CONF_DIR)), NEXT_FILE, CONF_FILE)
            .map_err(|e| format!("installing nginx's configuration: {e}"))?;
        // nginx crashed and waits for its restart: there is no master to
        // signal, and the restart reads the live file.
        if reconciler
            .get(INGRESS_JAIL)
            .is_some_and(|j| j.state.crashed())
        {
            return Ok(());
        }
        let reload = [
            nginx,
            "-c".into(),
            path_arg(&seen_live),
            "-s".into(),
            "reload".into(),
        ];
        let out = reconciler
            .exec_in(INGRESS_JAIL, &reload)
            .map_err(|e| format!("nginx -s reload in {INGRESS_JAIL}: {e}"))?;
        if !out.success() {
            return Err(format!("nginx -s reload failed: {}", out.stderr.trim()));
        }
        Ok(())
    }

    /// The jail spec of the ingress jail: nginx in the foreground with Keel's
    /// configuration.
    fn jail_spec(&self, root: &Path) -> Jail {
        let live = self
            .settings
            .as_seen_by_nginx(root, &format!("{CONF_DIR}/{CONF_FILE}"));
        Jail {
            metadata: Metadata {
                name: INGRESS_JAIL.into(),
            },
            spec: JailSpec {
                base: self.settings.base.clone(),
                exec: ExecSpec {
                    start: vec![
                        self.settings.nginx.to_string_lossy().into_owned(),
                        "-c".into(),
                        path_arg(&live),
                        "-g".into(),
                        "daemon off;".into(),
                    ],
                    stop: Vec::new(),
                },
                hostname: None,
                network: NetworkSpec::default(),
                resources: Resources::default(),
                env: BTreeMap::new(),
                volumes: Vec::new(),
                health: None,
            },
        }
    }

    /// Applies the ingress jail when missing (the reconciler writes a first,
    /// empty configuration into its root before nginx starts); its address.
    fn ensure_jail<J, Z, N, M>(
        &mut self,
        reconciler: &mut Reconciler<J, Z, N, M>,
    ) -> Option<Ipv4Addr>
    where
        J: JailRuntime,
        Z: ZfsManager,
        N: NetManager,
        M: MountManager,
    {
        self.register_seed(reconciler);
        let root = reconciler.rootfs_path(INGRESS_JAIL);
        let spec = self.jail_spec(&root);
        let failed = reconciler
            .get(INGRESS_JAIL)
            .filter(|status| status.state == Phase::Failed);
        if let Some(record) = reconciler.record(INGRESS_JAIL) {
            if record.spec == spec {
                // Provisioning failed (a base without nginx, a missing base)
                // and waits for its retry: there is no nginx to check or
                // reload, and every Ingress says why.
                if let Some(status) = failed {
                    let why = status
                        .last_error
                        .unwrap_or_else(|| "not provisioned".into());
                    self.fail_every_ingress(format!("ingress jail {INGRESS_JAIL}: {why}"));
                    return None;
                }
                return Some(record.address);
            }
            // A jail that never started keeps the root it was first cloned
            // into (only a deployed jail is cloned again for a new base), so
            // the base that replaces one without nginx would never be used:
            // remove the failed jail, root included, and provision it anew.
            if failed.is_some()
                && record.deployed.is_none()
                && let Err(e) = reconciler.delete(INGRESS_JAIL)
            {
                self.fail_every_ingress(format!("removing the failed {INGRESS_JAIL}: {e}"));
                return None;
            }
        }
        match reconciler.apply(spec, None) {
            Ok(status) => {
                // nginx started with the first configuration (default
                // servers only); this pass loads the real one through
                // nginx -t and a reload.
                self.running = None;
                Some(status.address)
            }
            Err(e) => {
                self.fail_every_ingress(format!("ingress jail {INGRESS_JAIL}: {e}"));
                None
            }
        }
    }

    /// Hands the reconciler the ingress jail's seed (the nginx check,
    /// nginx's directories, the first configuration), once. The worker calls
    /// it before its first reconcile pass: a restarted agent's first pass
    /// provisions a recorded ingress jail that is not running, and without
    /// the seed it would start one whose base lacks nginx, or with no
    /// configuration, and crash-loop.
    pub fn register_seed<J, Z, N, M>(&mut self, reconciler: &mut Reconciler<J, Z, N, M>)
    where
        J: JailRuntime,
        Z: ZfsManager,
        N: NetManager,
        M: MountManager,
    {
        if self.seed_registered {
            return;
        }
        // nginx does not start without a configuration, and a fresh root
        // (first Ingress, new base) has none: the reconciler writes the
        // first one between cloning the root and starting the jail.
        let settings = self.settings.clone();
        reconciler.seed_root(
            INGRESS_JAIL,
            Box::new(move |root, address| settings.seed_first_configuration(root, address)),
        );
        self.seed_registered = true;
    }

    /// Marks every Ingress Failed with `message`, which is also the pass's
    /// problem: something all of them need (the jail, its files) is broken.
    fn fail_every_ingress(&mut self, message: String) {
        self.observed = self
            .state
            .ingresses
            .keys()
            .map(|name| {
                let o = Observed {
                    phase: IngressPhase::Failed,
                    expires: None,
                    error: Some(message.clone()),
                };
                (name.clone(), o)
            })
            .collect();
        self.problems.push(message);
    }

    fn ensure_anchor(&mut self, jail: Ipv4Addr, now: Instant) {
        let Some((interface, public)) = &self.settings.public else {
            return;
        };
        let rules = ingress_rules(interface, *public, jail);
        if self.loaded_anchor.as_ref() == Some(&rules) || !self.anchor_retry.ready(&(), now) {
            return;
        }
        match self.firewall.load_anchor(INGRESS_ANCHOR, &rules) {
            Ok(()) => {
                self.loaded_anchor = Some(rules);
                self.anchor_retry.forget(&());
            }
            Err(e) => {
                let delay = self.anchor_retry.record_failure(&(), now);
                self.problems.push(format!(
                    "pf anchor {INGRESS_ANCHOR}: {e}; retrying in {}s",
                    delay.as_secs()
                ));
            }
        }
    }

    fn tear_down<J, Z, N, M>(&mut self, reconciler: &mut Reconciler<J, Z, N, M>)
    where
        J: JailRuntime,
        Z: ZfsManager,
        N: NetManager,
        M: MountManager,
    {
        let had_jail = reconciler.record(INGRESS_JAIL).is_some();
        if had_jail && let Err(e) = reconciler.delete(INGRESS_JAIL) {
            self.problems.push(format!("removing {INGRESS_JAIL}: {e}"));
        }
        // Also when this agent restarted since loading it: the jail's
        // existence says an anchor was (or may have been) loaded.
        if self.loaded_anchor.is_some() || (had_jail && self.settings.public.is_some()) {
            match self.firewall.flush_anchor(INGRESS_ANCHOR) {
                Ok(()) => self.loaded_anchor = None,
                Err(e) => self
                    .problems
                    .push(format!("flushing pf anchor {INGRESS_ANCHOR}: {e}")),
            }
        }
        self.running = None;
        self.observed.clear();
    }
}

impl IngressSettings {
    /// Where nginx keeps its files in the jail `root` (with address
    /// `address`), as nginx opens them.
    fn layout(&self, root: &Path, address: Ipv4Addr) -> NginxLayout {
        let seen = |p: &str| self.as_seen_by_nginx(root, p);
        NginxLayout {
            pid: seen("/var/run/nginx.pid"),
            error_log: seen("/var/log/nginx/error.log"),
            access_log: seen("/var/log/nginx/access.log"),
            temp_dir: seen("/var/tmp/nginx"),
            listen: self.simulate.then_some(address),
            ..NginxLayout::default()
        }
    }

    /// A path inside the jail as nginx opens it: itself on FreeBSD (nginx
    /// runs in the jail), under the jail's root in simulate mode.
    fn as_seen_by_nginx(&self, root: &Path, path: &str) -> PathBuf {
        if self.simulate {
            root.join(relative(path))
        } else {
            PathBuf::from(path)
        }
    }

    /// `Ok` when the jail can run nginx: the package's binary is a regular
    /// file in its root (read beneath the root, a link there is refused),
    /// or, in simulate mode, where the host's processes find it. A base
    /// without it would start a jail whose workload exits at once and
    /// crash-loops forever; refused here, before the jail is created, the
    /// provision fails with a message saying how to build a base that has it.
    fn check_nginx(&self, root: &Path) -> Result<(), String> {
        let found = if self.simulate {
            if self.nginx.is_file() {
                Ok(())
            } else {
                Err("no such file on this host".to_string())
            }
        } else {
            let inside = self.nginx.to_string_lossy();
            match beneath::is_regular_file(root, Path::new(relative(&inside))) {
                Ok(true) => Ok(()),
                Ok(false) => Err("no such file in the jail's root".to_string()),
                Err(e) => Err(e.to_string()),
            }
        };
        found.map_err(|why| {
            format!(
                "ingress base {base} has no {nginx} ({why}): nginx must be in the base. \
                 Build one with it (zfs clone the release's base, pkg -r BASEDIR install -y nginx, \
                 zfs snapshot NAME@keel), set ingress.base to its name and restart keel-agentd \
                 (docs/operations.md, \"A base\")",
                base = self.base,
                nginx = self.nginx.display(),
            )
        })
    }

    /// The first configuration of a fresh ingress jail (default servers
    /// only, refusing every name), written into its root before nginx
    /// starts there unless a configuration is already in place: nginx does
    /// not start without one, and an existing one is the controller's to
    /// replace (checked with `nginx -t` first).
    fn seed_first_configuration(&self, root: &Path, address: Ipv4Addr) -> Result<(), String> {
        self.check_nginx(root)?;
        // nginx's own directories, which the package does not create
        // (nginx makes the temporary ones below them at start, and exits
        // when it cannot): before its start, or its first start would fail.
        for dir in NGINX_DIRS {
            beneath::make_dirs(root, Path::new(relative(dir)))
                .map_err(|e| format!("{dir} in {INGRESS_JAIL}: {e}"))?;
        }
        let live = Path::new(relative(CONF_DIR)).join(CONF_FILE);
        let (empty, _) = render(&[], &self.layout(root, address));
        beneath::write_if_absent(root, &live, empty.as_bytes(), CONF_MODE)
            .map(drop)
            .map_err(|e| format!("first nginx configuration of {INGRESS_JAIL}: {e}"))
    }
}

/// An absolute path inside the jail, relative to its root.
fn relative(path: &str) -> &str {
    path.trim_start_matches('/')
}

fn path_arg(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::sync::Arc;

    use super::*;
    use crate::agentd::ingress::acme::AcmeSettings;
    use crate::agentd::ingress::dns::FakeDns;
    use crate::agentd::reconciler::{NodeNetwork, STATE_FILE as AGENT_STATE};
    use crate::common::auth::KeyFilePolicy;
    use crate::common::backoff::ManualClock;
    use crate::common::cidr::Ipv4Net;
    use crate::common::cmd::CmdOutput;
    use crate::host::fake::{CallLog, Faults};
    use crate::host::jail::FakeJails;
    use crate::host::mount::FakeMounts;
    use crate::host::net::FakeNet;
    use crate::host::pf::FakeFirewall;
    use crate::host::zfs::{FakeZfs, ZfsLayout};

    type FakeReconciler = Reconciler<FakeJails, FakeZfs, FakeNet, FakeMounts>;

    struct World {
        dir: tempfile::TempDir,
        log: CallLog,
        jails: FakeJails,
        firewall: FakeFirewall,
        reconciler: FakeReconciler,
        controller: IngressController,
    }

    const HOST: &str = "web.example.org";
    /// The nginx package's binary, relative to the jail's root.
    const NGINX_IN_ROOT: &str = "usr/local/sbin/nginx";

    /// A reconciler keeping its state in `dir` over Fakes logging to `log`
    /// (a second one on the same `dir` and `jails` is a restarted agent),
    /// with jail roots under `dir/jails` and two bases.
    fn reconciler_in(dir: &Path, log: &CallLog, jails: &FakeJails) -> FakeReconciler {
        let zfs = FakeZfs::with_layout(
            ZfsLayout {
                pool: "zroot".into(),
                jails_dir: dir.join("jails"),
                volumes_dir: dir.join("volumes"),
            },
            log.clone(),
            Faults::default(),
        );
        zfs.add_base("14.2-RELEASE");
        zfs.add_base("14.5-RELEASE-nginx");
        let (store, state) = Store::open(dir, AGENT_STATE).expect("store");
        Reconciler::new(
            jails.clone(),
            zfs,
            FakeNet::new(log.clone(), Faults::default()),
            FakeMounts::new(log.clone(), Faults::default()),
            NodeNetwork {
                bridge: "keel0".into(),
                subnet: "10.20.0.0/24".parse::<Ipv4Net>().expect("net"),
            },
            store,
            state,
            Box::new(ManualClock::new()),
        )
    }

    fn world(with_certs: bool) -> World {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = CallLog::new();
        let jails = FakeJails::new(log.clone(), Faults::default());
        // What `zfs clone` of a base with the nginx package leaves: the
        // ingress jail's root, with nginx in it.
        let nginx = dir
            .path()
            .join("jails")
            .join(INGRESS_JAIL)
            .join(NGINX_IN_ROOT);
        fs::create_dir_all(nginx.parent().expect("sbin")).expect("rootfs");
        fs::write(&nginx, "#!/bin/sh\n").expect("nginx");
        let reconciler = reconciler_in(dir.path(), &log, &jails);
        let firewall = FakeFirewall::new(log.clone(), Faults::default());
        let certs = if with_certs {
            CertManager::start(
                AcmeSettings {
                    directory_url: "https://acme.invalid/directory".into(),
                    account_file: dir.path().join("account.json"),
                    contact: None,
                    extra_root: None,
                    resolvers: Vec::new(),
                    propagation_timeout: std::time::Duration::from_secs(1),
                    key_policy: KeyFilePolicy::for_current_process(),
                },
                Box::new(FakeDns::new()),
                Arc::new(ManualClock::new()),
            )
            .map_err(|e| e.to_string())
        } else {
            Err("no certificate can be issued: /usr/local/etc/keel/ovh.toml is missing".into())
        };
        let controller = IngressController::open(
            dir.path(),
            IngressSettings {
                base: "14.2-RELEASE".into(),
                nginx: "/usr/local/sbin/nginx".into(),
                public: Some(("em0".into(), Ipv4Addr::new(203, 0, 113, 10))),
                simulate: false,
            },
            Box::new(firewall.clone()),
            certs,
        )
        .expect("controller");
        World {
            dir,
            log,
            jails,
            firewall,
            reconciler,
            controller,
        }
    }

    fn ingress(name: &str, host: &str, service: &str) -> Ingress {
        crate::common::spec::parse_ingress(&format!(
            "kind: Ingress\nmetadata: {{name: {name}}}\nspec: {{host: {host}, service: {service}}}\n"
        ))
        .expect("valid ingress")
    }

    impl World {
        fn pass(&mut self) {
            self.controller
                .pass(&mut self.reconciler, Instant::now(), 1_800_000_000);
        }

        fn root(&self) -> PathBuf {
            self.reconciler.rootfs_path(INGRESS_JAIL)
        }

        /// Ingress `web` for [`HOST`], its Service `web` at 10.96.0.7:8080.
        fn web_ingress(&mut self) {
            self.controller
                .put(ingress("web", HOST, "web"))
                .expect("put");
            self.controller.set_services(BTreeMap::from([(
                "web".into(),
                SocketAddrV4::new([10, 96, 0, 7].into(), 8080),
            )]));
        }

        /// A valid certificate for `host` where the controller looks (what
        /// the certificate thread leaves after an issuance).
        fn install_certificate(&self, host: &str) {
            let dir = self.root().join(relative(CONF_DIR)).join(CERT_DIR);
            fs::create_dir_all(&dir).expect("cert dir");
            let key = rcgen::KeyPair::generate().expect("key");
            let params = rcgen::CertificateParams::new(vec![host.into()]).expect("params");
            let leaf = params.self_signed(&key).expect("cert");
            fs::write(dir.join(format!("{host}.crt")), leaf.pem()).expect("chain");
            fs::write(dir.join(format!("{host}.key")), key.serialize_pem()).expect("key");
        }

        fn phase(&self, name: &str) -> IngressPhase {
            self.controller.status(name).expect("status").phase
        }

        fn live_conf(&self) -> Option<String> {
            fs::read_to_string(self.root().join(relative(CONF_DIR)).join(CONF_FILE)).ok()
        }
    }

    /// The ingress jail's name passes the same check as every Jail name
    /// (not all digits, a DNS label, short enough for a dataset name), and
    /// no Jail or Service can take it: its prefix is reserved.
    #[test]
    fn the_ingress_jail_name_is_a_valid_and_reserved_jail_name() {
        assert_eq!(crate::common::names::validate_name(INGRESS_JAIL), Ok(()));
        assert!(INGRESS_JAIL.starts_with(crate::common::names::RESERVED_PREFIX));
    }

    #[test]
    fn the_first_ingress_brings_the_jail_and_the_anchor_the_last_takes_them_away() {
        let mut w = world(false);
        w.controller.put(ingress("web", HOST, "web")).expect("put");
        w.pass();
        assert!(
            w.reconciler.record(INGRESS_JAIL).is_some(),
            "ingress jail applied"
        );
        let address = w.reconciler.record(INGRESS_JAIL).expect("record").address;
        let rules = w.firewall.anchor(INGRESS_ANCHOR).expect("anchor loaded");
        assert!(rules.contains(&format!("-> {address} port 443")), "{rules}");
        assert_eq!(w.phase("web"), IngressPhase::NoService);

        // A second pass loads nothing again.
        let loads = w.log.matching("pf.load_anchor").len();
        w.pass();
        assert_eq!(w.log.matching("pf.load_anchor").len(), loads);

        assert!(w.controller.delete("web").expect("delete"));
        w.pass();
        assert!(w.reconciler.record(INGRESS_JAIL).is_none(), "jail removed");
        assert_eq!(w.firewall.anchor(INGRESS_ANCHOR), None, "anchor flushed");
    }

    /// The base is a bare release: no jail is created (so nothing can
    /// crash-loop), no nginx command runs, and every Ingress is Failed with
    /// a message naming the base, the missing binary and how to build a
    /// base with it; the next pass says the same while the provision waits
    /// for its retry.
    #[test]
    fn a_base_without_nginx_fails_every_ingress_and_never_starts_the_jail() {
        let mut w = world(false);
        fs::remove_file(w.root().join(NGINX_IN_ROOT)).expect("bare release");
        w.web_ingress();
        w.controller
            .put(ingress("api", "api.example.org", "web"))
            .expect("put");
        for pass in 1..=2 {
            w.pass();
            for name in ["web", "api"] {
                let status = w.controller.status(name).expect("status");
                assert_eq!(
                    status.phase,
                    IngressPhase::Failed,
                    "pass {pass}: {status:?}"
                );
                let error = status.last_error.unwrap_or_default();
                for part in [
                    "ingress base 14.2-RELEASE has no /usr/local/sbin/nginx",
                    "pkg -r BASEDIR install -y nginx",
                    "ingress.base",
                ] {
                    assert!(error.contains(part), "pass {pass}, {name}: {error}");
                }
            }
            assert_eq!(
                w.reconciler.get(INGRESS_JAIL).map(|j| j.state),
                Some(Phase::Failed),
                "pass {pass}"
            );
            assert!(w.log.matching("jail.create").is_empty(), "pass {pass}");
            assert!(w.log.matching("jail.exec").is_empty(), "pass {pass}");
        }
        assert!(
            w.live_conf().is_none(),
            "no configuration for an nginx that is not there"
        );
    }

    /// Ingress `web` whose ingress jail failed its first provision: the
    /// base is a bare release, without nginx.
    fn failed_on_a_bare_base() -> World {
        let mut w = world(false);
        fs::remove_file(w.root().join(NGINX_IN_ROOT)).expect("bare release");
        w.web_ingress();
        w.pass();
        assert_eq!(w.phase("web"), IngressPhase::Failed);
        w
    }

    /// keel-agentd restarted while the base still lacks nginx: the worker's
    /// first reconcile pass, which runs before any ingress pass, provisions
    /// the recorded ingress jail, and the seed must already be registered
    /// then, or the jail starts without the check and nginx crash-loops.
    #[test]
    fn a_restarted_agent_never_starts_the_jail_without_the_nginx_check() {
        let w = failed_on_a_bare_base();
        let settings = w.controller.settings.clone();
        let World {
            dir,
            log,
            jails,
            firewall,
            ..
        } = w;

        let reconciler = reconciler_in(dir.path(), &log, &jails);
        let controller = IngressController::open(
            dir.path(),
            settings,
            Box::new(firewall),
            Err("no credentials".into()),
        )
        .expect("controller");
        let (worker, thread) =
            crate::agentd::worker::spawn_with_ingress(reconciler, Some(controller))
                .expect("worker");
        // Answered after the worker's first reconcile and ingress passes.
        worker.list().expect("worker");
        worker.shutdown();
        thread.join().expect("the worker ends cleanly");
        assert!(
            log.matching("jail.create").is_empty(),
            "{:?}",
            log.entries()
        );
    }

    /// After a base without nginx, the admin builds one with it and points
    /// `ingress.base` at it (an agent restart with the new setting): the
    /// failed jail's root, cloned from the bare base, is destroyed and the
    /// new base cloned, and the jail starts.
    #[test]
    fn a_new_base_with_nginx_replaces_the_failed_jail_with_a_fresh_clone() {
        let mut w = failed_on_a_bare_base();

        let services = w.controller.services.clone();
        let mut settings = w.controller.settings.clone();
        settings.base = "14.5-RELEASE-nginx".into();
        w.controller = IngressController::open(
            w.dir.path(),
            settings,
            Box::new(w.firewall.clone()),
            Err("no credentials".into()),
        )
        .expect("restarted controller");
        w.controller.set_services(services);
        // What cloning the new base leaves: its root has nginx.
        fs::write(w.root().join(NGINX_IN_ROOT), "#!/bin/sh\n").expect("nginx");
        let before = w.log.entries().len();
        w.pass();

        let calls = w.log.entries()[before..].to_vec();
        let destroyed = calls
            .iter()
            .position(|c| c == "zfs.destroy_rootfs keel-ingress");
        let cloned = calls
            .iter()
            .position(|c| c == "zfs.clone_rootfs keel-ingress");
        assert!(
            destroyed.is_some() && cloned.is_some() && destroyed < cloned,
            "old root destroyed, then the new base cloned: {calls:?}"
        );
        assert!(
            calls.iter().any(|c| c == "jail.create keel-ingress"),
            "{calls:?}"
        );
        assert_eq!(
            w.reconciler.get(INGRESS_JAIL).map(|j| j.state),
            Some(Phase::Starting)
        );
        assert_eq!(
            w.reconciler
                .record(INGRESS_JAIL)
                .map(|r| r.spec.spec.base.as_str()),
            Some("14.5-RELEASE-nginx")
        );
        assert_ne!(
            w.phase("web"),
            IngressPhase::Failed,
            "{:?}",
            w.controller.problems
        );
    }

    /// A symbolic link in place of nginx (the jail's root user could plant
    /// one on a restart) is refused, never followed.
    #[test]
    fn a_link_in_place_of_nginx_is_refused() {
        let mut w = world(false);
        let nginx = w.root().join(NGINX_IN_ROOT);
        fs::remove_file(&nginx).expect("remove");
        std::os::unix::fs::symlink("/bin/sh", &nginx).expect("link");
        w.web_ingress();
        w.pass();
        let status = w.controller.status("web").expect("status");
        assert_eq!(status.phase, IngressPhase::Failed);
        let error = status.last_error.unwrap_or_default();
        assert!(error.contains("is a symbolic link"), "{error}");
        assert!(w.log.matching("jail.create").is_empty());
    }

    #[test]
    fn without_credentials_an_ingress_waits_and_says_why() {
        let mut w = world(false);
        w.web_ingress();
        w.pass();
        let status = w.controller.status("web").expect("status");
        assert_eq!(status.phase, IngressPhase::Issuing);
        assert!(
            status
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("ovh.toml")),
            "{status:?}"
        );
    }

    #[test]
    fn a_host_with_a_certificate_is_checked_then_reloaded() {
        let mut w = world(true);
        w.web_ingress();
        w.pass(); // creates the jail
        w.install_certificate(HOST);
        w.pass();
        assert_eq!(
            w.phase("web"),
            IngressPhase::Serving,
            "{:?}",
            w.controller.problems
        );
        let conf = w.live_conf().expect("live configuration written");
        assert!(conf.contains("proxy_pass http://10.96.0.7:8080;"), "{conf}");
        let execs = w.log.matching("jail.exec");
        assert!(
            execs
                .iter()
                .any(|e| e.contains("-t -c /usr/local/etc/keel-ingress/nginx.conf.next"))
                && execs.last().is_some_and(|e| e.contains("-s reload")),
            "{execs:?}"
        );
        // Nothing changed: no reload.
        let before = w.log.matching("jail.exec").len();
        w.pass();
        assert_eq!(w.log.matching("jail.exec").len(), before);
        let issued: Vec<_> = w
            .reconciler
            .events()
            .since(None, None)
            .0
            .into_iter()
            .filter(|e| e.reason == "CertificateIssued")
            .collect();
        assert_eq!(issued.len(), 1, "told once, not at every pass: {issued:?}");
        assert_eq!(
            (issued[0].kind, issued[0].name.as_str()),
            (crate::common::wire::ObjectKind::Ingress, "web")
        );
    }

    /// While nginx waits for a crash-loop restart there is no nginx to
    /// reload, and the checked configuration is simply left for the restart
    /// to read.
    #[test]
    fn while_nginx_waits_for_its_restart_the_checked_configuration_is_left_for_it() {
        let mut w = world(true);
        w.web_ingress();
        w.pass(); // creates the jail
        w.jails.crash(INGRESS_JAIL);
        w.reconciler.reconcile();
        assert_eq!(
            w.reconciler.get(INGRESS_JAIL).map(|j| j.state),
            Some(Phase::Restarting)
        );
        let before = w.log.matching("jail.exec").len();
        w.install_certificate(HOST);
        w.pass();
        assert_eq!(
            w.phase("web"),
            IngressPhase::Serving,
            "{:?}",
            w.controller.problems
        );
        assert!(
            w.controller.problems.is_empty(),
            "{:?}",
            w.controller.problems
        );
        let conf = w.live_conf().expect("live configuration written");
        assert!(conf.contains("proxy_pass http://10.96.0.7:8080;"), "{conf}");
        let execs = w.log.matching("jail.exec")[before..].to_vec();
        assert!(
            execs.len() == 1
                && execs[0].contains("-t -c /usr/local/etc/keel-ingress/nginx.conf.next"),
            "checked, never reloaded: {execs:?}"
        );
    }

    #[test]
    fn a_configuration_nginx_refuses_is_never_loaded_and_the_old_one_serves() {
        let mut w = world(true);
        let services = BTreeMap::from([
            ("web".into(), SocketAddrV4::new([10, 96, 0, 7].into(), 8080)),
            ("api".into(), SocketAddrV4::new([10, 96, 0, 8].into(), 9000)),
        ]);
        w.controller.put(ingress("web", HOST, "web")).expect("put");
        w.controller.set_services(services);
        w.pass();
        w.install_certificate(HOST);
        w.pass();
        let good = w.live_conf().expect("first configuration");

        w.controller
            .put(ingress("api", "api.example.org", "api"))
            .expect("put");
        w.install_certificate("api.example.org");
        w.jails.set_exec_output(
            INGRESS_JAIL,
            CmdOutput {
                status: 1,
                stdout: String::new(),
                stderr: "nginx: [emerg] cannot load certificate \"/x\"\nnginx: configuration file test failed\n".into(),
            },
        );
        let reloads = w
            .log
            .matching("jail.exec")
            .iter()
            .filter(|e| e.contains("reload"))
            .count();
        w.pass();
        assert_eq!(
            w.log
                .matching("jail.exec")
                .iter()
                .filter(|e| e.contains("reload"))
                .count(),
            reloads,
            "no reload after a failed nginx -t"
        );
        assert_eq!(
            w.live_conf().as_deref(),
            Some(good.as_str()),
            "live file untouched"
        );
        assert_eq!(w.phase("api"), IngressPhase::Failed);
        assert!(
            w.controller
                .status("api")
                .and_then(|s| s.last_error)
                .is_some_and(|e| e.contains("cannot load certificate")),
        );
        assert_eq!(
            w.phase("web"),
            IngressPhase::Serving,
            "the working host is untouched"
        );
    }

    #[test]
    fn two_ingresses_cannot_share_a_host_and_nothing_is_saved() {
        let mut w = world(false);
        w.controller.put(ingress("web", HOST, "web")).expect("put");
        let err = w
            .controller
            .put(ingress("other", HOST, "api"))
            .expect_err("host taken");
        assert!(
            err.to_string().contains("already served by Ingress web"),
            "{err}"
        );
        assert!(w.controller.status("other").is_none());
        // Persisted: a new controller on the same directory sees one Ingress.
        let (_, state): (Store<IngressState>, Option<IngressState>) =
            Store::open(w.dir.path(), STATE_FILE).expect("store");
        assert_eq!(state.expect("saved").ingresses.len(), 1);
    }

    /// A process in the ingress jail replaces Keel's configuration
    /// directory with a link to a host directory: the pass writes nothing
    /// there (neither nginx.conf nor certificates are read or written
    /// through it) and every Ingress says which component to remove.
    #[test]
    fn a_symbolic_link_in_the_jail_root_is_never_followed() {
        let mut w = world(true);
        w.web_ingress();
        w.pass();
        w.install_certificate(HOST);
        w.pass();
        assert_eq!(w.phase("web"), IngressPhase::Serving);

        let outside = w.dir.path().join("outside");
        fs::create_dir(&outside).expect("outside");
        let conf_dir = w.root().join(relative(CONF_DIR));
        fs::rename(&conf_dir, w.root().join("moved-away")).expect("move");
        std::os::unix::fs::symlink(&outside, &conf_dir).expect("plant a link");
        w.controller
            .put(ingress("second", "second.example.org", "web"))
            .expect("put");
        w.pass();

        let status = w.controller.status("web").expect("status");
        assert_eq!(status.phase, IngressPhase::Failed, "{status:?}");
        let error = status.last_error.unwrap_or_default();
        assert!(
            error.contains(&format!("{} is a symbolic link", conf_dir.display())),
            "{error}"
        );
        assert!(
            fs::read_dir(&outside).expect("outside").next().is_none(),
            "nothing written outside the jail's root"
        );
    }
}
