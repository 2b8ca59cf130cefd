//! Ingress (automatic HTTPS): the node-wide
//! nginx jail that publishes Services over HTTPS, and its certificates: every
//! Ingress host gets one from the ACME CA by DNS-01 and keeps it renewed.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`CertManager`], the handle the ingress reconciler calls each pass; [`IngressError`] |
//! | [`controller`] | the applied Ingresses, the ingress jail, loading nginx and the pf anchor, each pass |
//! | [`nginx`] | `nginx.conf` as a pure function of every applied Ingress |
//! | [`pf`] | the `keel/ingress` anchor: public ports 80 and 443 to the ingress jail |
//! | [`dns`] | [`dns::DnsProvider`], its Fake, and OVH's signed API |
//! | [`propagation`] | asking public resolvers until the challenge record is visible |
//! | [`acme`] | one order with instant-acme, the renewal decision, installing key and chain |
//!
//! Threads (docs/architecture.md): [`CertManager::ensure`] never blocks on the
//! network. It looks at the files already installed, decides, and hands the
//! slow part (the whole order: minutes of DNS propagation) to the manager's
//! own `keel-acme` thread, which works one job at a time and posts the outcome
//! back into the shared status the next `ensure` reads. An API request that
//! reads [`CertManager::ensure`] or [`CertManager::last_error`] therefore
//! never waits on ACME either.
//!
//! Failure: a failed issuance backs off per host like a crash loop
//! ([`crate::common::backoff`]: 1 s doubling to 5 min); the installed
//! certificate, if any, stays in place and keeps serving; one host's failure
//! never touches another's files or schedule.
//!
//! Must never: hold a secret in a spec, a log line or an error (credentials
//! and the account key live in mode-0600 files named by `[ingress]`), build
//! nginx or pf configuration (the ingress reconciler does), or run on the
//! agent's worker thread beyond reading a few small files (the certificate
//! part; [`nginx`] and [`pf`] are pure functions the reconciler calls).

pub mod acme;
pub mod controller;
pub mod dns;
pub mod nginx;
pub mod pf;
pub mod propagation;

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use self::acme::{AcmeClient, AcmeSettings, CertFiles, RenewReason, Renewal, RenewalWindow};
use self::dns::{DnsError, DnsProvider};
use self::propagation::PropagationError;
use crate::common::auth::KeyFilePolicy;
use crate::common::backoff::{Backoff, Clock};
use crate::common::sync::lock;
use crate::host::beneath::{BeneathError, PathBeneath};

/// Secret files larger than this are refused unread.
const MAX_SECRET_FILE_LEN: u64 = 64 * 1024;

/// How long a failed renewal-information request waits before the next.
const ARI_RETRY: Duration = Duration::from_secs(3600);

/// What went wrong obtaining or installing a certificate.
#[derive(Debug)]
pub enum IngressError {
    /// The host cannot name certificate files.
    InvalidHost {
        /// The host.
        host: String,
    },
    /// The DNS provider failed (publishing or deleting the challenge record).
    Dns(DnsError),
    /// The challenge record did not become visible in time.
    Propagation(PropagationError),
    /// The ACME account file is unusable.
    AccountFile {
        /// The file (`ingress.acme_account_key`).
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
    /// The ACME server refused or failed a step.
    Acme {
        /// The host being issued, empty for account steps.
        host: String,
        /// The step, e.g. `"creating the order"`.
        step: &'static str,
        /// What instant-acme or the CA said.
        message: String,
    },
    /// The order ended without a certificate.
    OrderFailed {
        /// The host.
        host: String,
        /// What state it ended in.
        detail: String,
    },
    /// The CA's certificate could not be read.
    Certificate {
        /// The host.
        host: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Writing key or chain failed.
    Install {
        /// The file.
        path: PathBuf,
        /// The step.
        action: &'static str,
        /// What the OS said.
        source: io::Error,
    },
    /// Reading or writing key or chain in the ingress jail's root failed, or
    /// was refused (a link or a non-file planted there).
    JailFile(BeneathError),
    /// Issuance failed and deleting its challenge record failed too.
    Cleanup {
        /// Why issuance failed.
        error: Box<IngressError>,
        /// The records left at the provider, and why.
        cleanup: String,
    },
    /// The async runtime could not be built.
    Runtime(String),
    /// The certificate thread is gone (it panicked); restart the agent.
    IssuerStopped,
}

impl fmt::Display for IngressError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IngressError::InvalidHost { host } => {
                write!(f, "{host:?} cannot name certificate files")
            }
            IngressError::Dns(e) => write!(f, "DNS provider: {e}"),
            IngressError::Propagation(e) => write!(f, "DNS propagation: {e}"),
            IngressError::AccountFile { path, reason } => write!(
                f,
                "ACME account file {} (ingress.acme_account_key): {reason}",
                path.display()
            ),
            IngressError::Acme {
                host,
                step,
                message,
            } => {
                if host.is_empty() {
                    write!(f, "ACME: {step} failed: {message}")?;
                } else {
                    write!(f, "ACME, {host}: {step} failed: {message}")?;
                }
                write!(
                    f,
                    " (check ingress.acme_directory and the node's outbound HTTPS)"
                )
            }
            IngressError::OrderFailed { host, detail } => {
                write!(f, "ACME, {host}: no certificate: {detail}")
            }
            IngressError::Certificate { host, reason } => {
                write!(
                    f,
                    "ACME, {host}: unusable certificate from the CA: {reason}"
                )
            }
            IngressError::Install {
                path,
                action,
                source,
            } => write!(
                f,
                "cannot install {}: {action} failed: {source}",
                path.display()
            ),
            IngressError::JailFile(e) => write!(f, "certificate files: {e}"),
            IngressError::Cleanup { error, cleanup } => write!(
                f,
                "{error}; and the challenge record could not be deleted, remove it at the \
                 DNS provider by hand: {cleanup}"
            ),
            IngressError::Runtime(e) => write!(f, "cannot start the ACME runtime: {e}"),
            IngressError::IssuerStopped => write!(
                f,
                "the certificate thread stopped; restart keel-agentd (and report the panic \
                 in its log)"
            ),
        }
    }
}

impl std::error::Error for IngressError {}

impl From<DnsError> for IngressError {
    fn from(e: DnsError) -> IngressError {
        IngressError::Dns(e)
    }
}

impl From<PropagationError> for IngressError {
    fn from(e: PropagationError) -> IngressError {
        IngressError::Propagation(e)
    }
}

/// Reads a secret file after checking, on the opened file itself, that it is
/// a regular file no one but its owner may access (0600 or 0400) and, when
/// `policy` says so, owned by root. The error says what is wrong and the
/// command that fixes it, never the content.
pub(crate) fn read_secret_file(path: &Path, policy: KeyFilePolicy) -> Result<String, String> {
    let file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot inspect: {e}"))?;
    if !meta.is_file() {
        return Err("it is not a regular file".into());
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "it has mode {mode:04o}, which lets other users read it; run chmod 600 {}",
            path.display()
        ));
    }
    if policy.require_root_owner && meta.uid() != 0 {
        return Err(format!(
            "it is owned by uid {}, not root; run chown root {}",
            meta.uid(),
            path.display()
        ));
    }
    let mut text = String::new();
    file.take(MAX_SECRET_FILE_LEN + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read: {e}"))?;
    if text.len() as u64 > MAX_SECRET_FILE_LEN {
        return Err(format!("it is larger than {MAX_SECRET_FILE_LEN} bytes"));
    }
    Ok(text)
}

/// A host's certificate as [`CertManager::ensure`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertStatus {
    /// A valid certificate is installed and not due.
    Valid {
        /// Its notAfter, Unix seconds.
        not_after: i64,
        /// When it becomes due, Unix seconds.
        renew_at: i64,
    },
    /// An order is running on the certificate thread.
    Issuing {
        /// notAfter of the certificate still installed, if any.
        not_after: Option<i64>,
        /// Why it is being (re)issued.
        reason: RenewReason,
    },
    /// The last order failed; the next waits for its backoff.
    BackingOff {
        /// notAfter of the certificate still installed, if any.
        not_after: Option<i64>,
        /// Time left before the next attempt.
        retry_in: Duration,
        /// Why the last order failed.
        last_error: String,
    },
}

/// What the certificate thread knows of the CA's renewal window of a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ari {
    /// Not asked yet (or the certificate changed).
    Unknown,
    /// Asked; ask again at `recheck`.
    Known {
        window: Option<RenewalWindow>,
        not_after: i64,
        recheck: Instant,
    },
    /// A request is queued. The previous answer (window and the `not_after`
    /// of the certificate it was for), if any, keeps deciding until the new
    /// one arrives: falling back to the lifetime third during every recheck
    /// would renew a certificate the CA had said to keep.
    Asking {
        previous: Option<(Option<RenewalWindow>, i64)>,
    },
}

impl Ari {
    /// The window that decides for the installed certificate whose notAfter
    /// is `installed`: the last answer, if it was about that certificate.
    fn window_for(self, installed: Option<i64>) -> Option<RenewalWindow> {
        let (window, not_after) = match self {
            Ari::Known {
                window, not_after, ..
            } => (window, not_after),
            Ari::Asking {
                previous: Some(previous),
            } => previous,
            Ari::Unknown | Ari::Asking { previous: None } => return None,
        };
        window.filter(|_| installed == Some(not_after))
    }

    /// The state once a new request is queued.
    fn asking(self) -> Ari {
        match self {
            Ari::Known {
                window, not_after, ..
            } => Ari::Asking {
                previous: Some((window, not_after)),
            },
            Ari::Asking { previous } => Ari::Asking { previous },
            Ari::Unknown => Ari::Asking { previous: None },
        }
    }
}

#[derive(Debug)]
struct HostState {
    issuing: Option<RenewReason>,
    last_error: Option<String>,
    ari: Ari,
}

#[derive(Debug, Default)]
struct Shared {
    hosts: BTreeMap<String, HostState>,
    backoff: Backoff<String>,
    /// `Some(false)` once the CA is known not to offer renewal information.
    ari_supported: Option<bool>,
}

enum Job {
    Issue {
        host: String,
        files: CertFiles,
    },
    Ari {
        host: String,
        files: CertFiles,
        not_after: i64,
    },
}

/// The certificates of every Ingress host on this node: decides what is due,
/// runs orders on its own thread, installs the results.
pub struct CertManager {
    shared: Arc<Mutex<Shared>>,
    jobs: mpsc::Sender<Job>,
    clock: Arc<dyn Clock>,
}

impl fmt::Debug for CertManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertManager").finish_non_exhaustive()
    }
}

impl CertManager {
    /// Starts the certificate thread. The ACME account is opened (or
    /// registered) there on the first job, so starting never touches the
    /// network; `clock` times the backoff.
    pub fn start(
        settings: AcmeSettings,
        dns: Box<dyn DnsProvider>,
        clock: Arc<dyn Clock>,
    ) -> Result<CertManager, IngressError> {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let (tx, rx) = mpsc::channel();
        let worker = Issuer {
            settings,
            dns,
            client: None,
            shared: Arc::clone(&shared),
            clock: Arc::clone(&clock),
        };
        thread::Builder::new()
            .name("keel-acme".into())
            .spawn(move || worker.run(rx))
            .map_err(|e| IngressError::Runtime(format!("cannot spawn keel-acme: {e}")))?;
        Ok(CertManager {
            shared,
            jobs: tx,
            clock,
        })
    }

    /// One pass for `host`, whose key and chain live in `dir` (the ingress
    /// jail's certificate directory, beneath its root): reads what is installed there (a missing,
    /// unreadable or mismatched pair counts as none, whatever was issued
    /// before), decides with [`acme::renewal_due`] at `unix_now`, and queues an
    /// order when due and the host's backoff allows. Never blocks on the
    /// network.
    pub fn ensure(
        &self,
        host: &str,
        dir: &PathBeneath,
        unix_now: i64,
    ) -> Result<CertStatus, IngressError> {
        if host.is_empty() || host.starts_with('.') || host.contains(['/', '\0']) {
            return Err(IngressError::InvalidHost {
                host: host.to_string(),
            });
        }
        let files = CertFiles::new(dir, host);
        let installed = files.installed().ok();
        let not_after = installed.map(|v| v.not_after);
        let mut shared = lock(&self.shared);
        let ari_supported = shared.ari_supported;
        let state = shared
            .hosts
            .entry(host.to_string())
            .or_insert_with(|| HostState {
                issuing: None,
                last_error: None,
                ari: Ari::Unknown,
            });
        if let Some(reason) = state.issuing {
            return Ok(CertStatus::Issuing { not_after, reason });
        }
        let window = state.ari.window_for(not_after);
        match acme::renewal_due(unix_now, installed, window) {
            Renewal::NotDue { renew_at } => {
                let now = self.clock.now();
                let stale = match state.ari {
                    Ari::Unknown => true,
                    Ari::Known {
                        recheck,
                        not_after: n,
                        ..
                    } => now >= recheck || Some(n) != not_after,
                    Ari::Asking { .. } => false,
                };
                if stale && ari_supported != Some(false) {
                    if let Some(not_after) = not_after {
                        state.ari = state.ari.asking();
                        let job = Job::Ari {
                            host: host.to_string(),
                            files,
                            not_after,
                        };
                        if self.jobs.send(job).is_err() {
                            return Err(IngressError::IssuerStopped);
                        }
                    }
                }
                Ok(CertStatus::Valid {
                    not_after: not_after.unwrap_or(renew_at),
                    renew_at,
                })
            }
            Renewal::Due(reason) => {
                let now = self.clock.now();
                let last_error = state.last_error.clone();
                if !shared.backoff.ready(&host.to_string(), now) {
                    let retry_in = shared
                        .backoff
                        .next_attempt(&host.to_string())
                        .map_or(Duration::ZERO, |at| at.saturating_duration_since(now));
                    return Ok(CertStatus::BackingOff {
                        not_after,
                        retry_in,
                        last_error: last_error.unwrap_or_default(),
                    });
                }
                if let Some(state) = shared.hosts.get_mut(host) {
                    state.issuing = Some(reason);
                }
                let job = Job::Issue {
                    host: host.to_string(),
                    files,
                };
                if self.jobs.send(job).is_err() {
                    return Err(IngressError::IssuerStopped);
                }
                Ok(CertStatus::Issuing { not_after, reason })
            }
        }
    }

    /// The last failure of `host`, or a warning about a challenge record left
    /// at the provider; `None` when its last order went well.
    pub fn last_error(&self, host: &str) -> Option<String> {
        lock(&self.shared)
            .hosts
            .get(host)
            .and_then(|s| s.last_error.clone())
    }

    /// True while a renewal-information request for `host` is queued or
    /// running (its answer not taken in yet).
    pub fn asking_renewal_info(&self, host: &str) -> bool {
        lock(&self.shared)
            .hosts
            .get(host)
            .is_some_and(|s| matches!(s.ari, Ari::Asking { .. }))
    }

    /// True while an order for `host` is queued or running.
    pub fn issuing(&self, host: &str) -> bool {
        lock(&self.shared)
            .hosts
            .get(host)
            .is_some_and(|s| s.issuing.is_some())
    }

    /// Forgets `host` (its Ingress was deleted): status and backoff. Files are
    /// the caller's to remove.
    pub fn forget(&self, host: &str) {
        let mut shared = lock(&self.shared);
        shared.hosts.remove(host);
        shared.backoff.forget(&host.to_string());
    }
}

/// The certificate thread's side.
struct Issuer {
    settings: AcmeSettings,
    dns: Box<dyn DnsProvider>,
    client: Option<AcmeClient>,
    shared: Arc<Mutex<Shared>>,
    clock: Arc<dyn Clock>,
}

impl Issuer {
    fn run(mut self, jobs: mpsc::Receiver<Job>) {
        // Ends when the CertManager (the only sender) is dropped.
        for job in jobs {
            match job {
                Job::Issue { host, files } => self.issue(&host, &files),
                Job::Ari {
                    host,
                    files,
                    not_after,
                } => self.ari(&host, &files, not_after),
            }
        }
    }

    /// The ACME client, opened on first use; a failed open is retried by the
    /// next job.
    fn client<'a>(
        client: &'a mut Option<AcmeClient>,
        settings: &AcmeSettings,
    ) -> Result<&'a AcmeClient, IngressError> {
        if client.is_none() {
            *client = Some(AcmeClient::open(settings.clone())?);
        }
        client.as_ref().ok_or(IngressError::IssuerStopped)
    }

    fn issue(&mut self, host: &str, files: &CertFiles) {
        let result = Self::client(&mut self.client, &self.settings).and_then(|client| {
            let cert = client.issue(host, self.dns.as_ref())?;
            files.install(&cert)?;
            Ok(cert)
        });
        let now = self.clock.now();
        let mut shared = lock(&self.shared);
        let key = host.to_string();
        match result {
            Ok(cert) => {
                log::info!(
                    "ingress {host}: certificate installed in {}, valid until {}",
                    files.chain.display_path().display(),
                    cert.validity.not_after
                );
                shared.backoff.forget(&key);
                if let Some(state) = shared.hosts.get_mut(host) {
                    state.issuing = None;
                    state.last_error = cert.cleanup_error.map(|c| {
                        format!("challenge record left at the DNS provider, remove it: {c}")
                    });
                    state.ari = Ari::Unknown;
                }
            }
            Err(e) => {
                let delay = shared.backoff.record_failure(&key, now);
                log::warn!(
                    "ingress {host}: certificate not obtained: {e}; retrying in {}s",
                    delay.as_secs()
                );
                if let Some(state) = shared.hosts.get_mut(host) {
                    state.issuing = None;
                    state.last_error = Some(e.to_string());
                }
            }
        }
    }

    fn ari(&mut self, host: &str, files: &CertFiles, not_after: i64) {
        let result = files
            .chain
            .read(acme::MAX_PEM_FILE_LEN)
            .map_err(IngressError::JailFile)
            .map(|chain| String::from_utf8_lossy(&chain).into_owned())
            .and_then(|chain| {
                Self::client(&mut self.client, &self.settings)
                    .and_then(|client| client.renewal_window(host, &chain))
            });
        let now = self.clock.now();
        let mut shared = lock(&self.shared);
        let (window, recheck) = match result {
            Ok(Some((window, retry_after))) => {
                shared.ari_supported = Some(true);
                (Some(window), now + retry_after.max(Duration::from_secs(60)))
            }
            Ok(None) => {
                shared.ari_supported = Some(false);
                (None, now + ARI_RETRY)
            }
            Err(e) => {
                // A CA unreachable for a while does not void what it said
                // about this certificate before.
                let previous = shared
                    .hosts
                    .get(host)
                    .and_then(|state| state.ari.window_for(Some(not_after)));
                log::warn!(
                    "ingress {host}: no renewal information from the CA: {e}; {}",
                    if previous.is_some() {
                        "its last window keeps deciding"
                    } else {
                        "renewal falls back to a third of the lifetime"
                    }
                );
                (previous, now + ARI_RETRY)
            }
        };
        if let Some(state) = shared.hosts.get_mut(host) {
            state.ari = Ari::Known {
                window,
                not_after,
                recheck,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: RenewalWindow = RenewalWindow {
        start: 5_000,
        end: 6_000,
    };

    #[test]
    fn the_last_window_keeps_deciding_while_it_is_asked_again() {
        let known = Ari::Known {
            window: Some(WINDOW),
            not_after: 9_000,
            recheck: Instant::now(),
        };
        assert_eq!(known.window_for(Some(9_000)), Some(WINDOW));
        // A recheck is queued: the CA's last word still holds meanwhile, so a
        // certificate past its lifetime third whose window has not opened is
        // not renewed during the recheck.
        let asking = known.asking();
        assert_eq!(asking.window_for(Some(9_000)), Some(WINDOW));
        assert_eq!(
            acme::renewal_due(
                4_000,
                Some(acme::Validity {
                    not_before: 0,
                    not_after: 9_000
                }),
                asking.window_for(Some(9_000))
            ),
            Renewal::NotDue {
                renew_at: WINDOW.renew_at(acme::Validity {
                    not_before: 0,
                    not_after: 9_000
                })
            }
        );
        // Queued twice, it still remembers.
        assert_eq!(asking.asking().window_for(Some(9_000)), Some(WINDOW));
    }

    #[test]
    fn a_window_is_only_for_the_certificate_it_was_asked_for() {
        let known = Ari::Known {
            window: Some(WINDOW),
            not_after: 9_000,
            recheck: Instant::now(),
        };
        // Renewed (another notAfter) or removed: the old answer is void.
        assert_eq!(known.window_for(Some(19_000)), None);
        assert_eq!(known.window_for(None), None);
        assert_eq!(known.asking().window_for(Some(19_000)), None);
        assert_eq!(Ari::Unknown.window_for(Some(9_000)), None);
        assert_eq!(Ari::Unknown.asking().window_for(Some(9_000)), None);
    }
}
