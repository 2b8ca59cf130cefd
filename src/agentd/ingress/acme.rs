//! One certificate from the ACME CA by DNS-01 ([`AcmeClient`], over
//! instant-acme), the renewal decision ([`renewal_due`], pure), and the
//! certificate files of a host in a directory ([`CertFiles`]).
//!
//! It owns the ACME account file, one order from creation to the downloaded
//! chain, and writing key and chain with mode 0600 beneath the ingress
//! jail's root ([`crate::host::beneath`]). It must never leave a
//! challenge TXT record behind (every record [`AcmeClient::issue`] published is
//! deleted before it returns, whatever happened), never run on the agent's
//! worker thread (it blocks for minutes: [`super::CertManager`] runs it on its
//! own), and never write the key where others could read it, not even for a
//! moment.
//!
//! instant-acme is async: the client owns a current-thread tokio runtime and
//! blocks on it. The DNS provider and the propagation wait are blocking calls
//! made from inside that future; nothing else runs on the runtime, so blocking
//! it only pauses our own idle HTTP connections.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use instant_acme::{
    Account, AccountCredentials, AuthorizationStatus, CertificateIdentifier, ChallengeType,
    Identifier, NewAccount, NewOrder, OrderStatus, RetryPolicy,
};
use rustls_pki_types::CertificateDer;

use super::dns::{DnsProvider, TxtRecord, challenge_name};
use super::{IngressError, propagation, read_secret_file};
use crate::common::auth::KeyFilePolicy;
use crate::common::config::IngressConfig;
use crate::host::beneath::PathBeneath;

/// Certificate chains and keys larger than this are refused unread (a chain
/// with its intermediates is a few KiB).
pub const MAX_PEM_FILE_LEN: u64 = 64 * 1024;

/// How long the CA may take to validate the challenge and to issue.
const ORDER_TIMEOUT: Duration = Duration::from_secs(120);

/// Everything [`AcmeClient`] needs, from `[ingress]`.
#[derive(Debug, Clone)]
pub struct AcmeSettings {
    /// The ACME directory URL.
    pub directory_url: String,
    /// The account file (instant-acme's credentials as JSON: id, key, directory).
    pub account_file: PathBuf,
    /// Contact e-mail, if any.
    pub contact: Option<String>,
    /// PEM root that alone is trusted for the ACME server (Pebble, a private
    /// CA); `None` trusts the system roots.
    pub extra_root: Option<PathBuf>,
    /// Resolvers asked for the challenge record.
    pub resolvers: Vec<SocketAddr>,
    /// How long to wait for them.
    pub propagation_timeout: Duration,
    /// Whom the account file must belong to.
    pub key_policy: KeyFilePolicy,
}

impl AcmeSettings {
    /// The settings `[ingress]` gives.
    pub fn from_config(cfg: &IngressConfig, key_policy: KeyFilePolicy) -> AcmeSettings {
        AcmeSettings {
            directory_url: cfg.acme_directory.clone(),
            account_file: cfg.acme_account_key.clone(),
            contact: cfg.acme_contact.clone(),
            extra_root: cfg.acme_extra_root.clone(),
            resolvers: cfg.resolvers.clone(),
            propagation_timeout: cfg.propagation_timeout.0,
            key_policy,
        }
    }
}

/// A certificate's validity, in Unix seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// notBefore.
    pub not_before: i64,
    /// notAfter.
    pub not_after: i64,
}

/// The CA's suggested renewal window (ACME Renewal Information, RFC 9773), in
/// Unix seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenewalWindow {
    /// Renew from here on.
    pub start: i64,
    /// Renew before here.
    pub end: i64,
}

impl RenewalWindow {
    /// The moment in the window to renew `cert` at. RFC 9773 asks clients
    /// to pick a uniformly random time in the window, so that certificates
    /// the CA asks to renew together do not all come back in the same
    /// second; the pick is a hash of the certificate's validity, which spreads
    /// certificates as well, and gives the same answer on every pass and
    /// after a restart. A window that is empty or reversed means its start.
    pub fn renew_at(self, cert: Validity) -> i64 {
        let width = self.end.saturating_sub(self.start);
        if width <= 0 {
            return self.start;
        }
        let mut seed = [0u8; 16];
        seed[..8].copy_from_slice(&cert.not_before.to_be_bytes());
        seed[8..].copy_from_slice(&cert.not_after.to_be_bytes());
        let spread = i64::from(crate::common::cidr::fnv1a32(&seed)) % width;
        self.start + spread
    }
}

/// Why a certificate is (re)issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewReason {
    /// No usable certificate is installed (missing, unreadable, or the key
    /// does not match).
    Missing,
    /// The CA's renewal window has opened.
    AriWindow,
    /// A third or less of the certificate's lifetime remains.
    LifetimeThird,
}

impl RenewReason {
    /// Short words for status output.
    pub fn as_str(self) -> &'static str {
        match self {
            RenewReason::Missing => "no certificate installed",
            RenewReason::AriWindow => "the CA's renewal window opened",
            RenewReason::LifetimeThird => "a third of the lifetime remains",
        }
    }
}

/// The renewal decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// Nothing to do before `renew_at` (Unix seconds).
    NotDue {
        /// When the certificate becomes due.
        renew_at: i64,
    },
    /// Issue now.
    Due(RenewReason),
}

/// Whether the installed certificate must be renewed at `now`: always when
/// none is installed; when the CA gave a renewal window, once
/// [`RenewalWindow::renew_at`] in that window has come; otherwise once a
/// third of its lifetime remains (30 days of a 90-day certificate, 15 of a
/// 45-day one).
pub fn renewal_due(now: i64, installed: Option<Validity>, ari: Option<RenewalWindow>) -> Renewal {
    let Some(v) = installed else {
        return Renewal::Due(RenewReason::Missing);
    };
    let (renew_at, reason) = match ari {
        Some(w) => (w.renew_at(v), RenewReason::AriWindow),
        None => {
            let lifetime = v.not_after.saturating_sub(v.not_before).max(0);
            (
                v.not_after.saturating_sub(lifetime / 3),
                RenewReason::LifetimeThird,
            )
        }
    };
    // An ARI window past expiry is the CA's mistake; expiry still wins.
    if now >= renew_at || now >= v.not_after {
        Renewal::Due(reason)
    } else {
        Renewal::NotDue { renew_at }
    }
}

/// A freshly issued certificate.
#[derive(Debug, Clone)]
pub struct IssuedCert {
    /// The chain, leaf first, PEM.
    pub chain_pem: String,
    /// The leaf's private key, PKCS#8 PEM.
    pub key_pem: String,
    /// The leaf's validity.
    pub validity: Validity,
    /// Deleting a challenge record failed after the certificate was issued:
    /// the record is left at the provider and should be removed by hand.
    pub cleanup_error: Option<String>,
}

/// Where a host's certificate lives in a directory: `<host>.crt` (chain) and
/// `<host>.key`. The directory is in the ingress jail's root, so both are
/// read and written beneath it ([`PathBeneath`]), never by path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    /// The chain, PEM, leaf first.
    pub chain: PathBeneath,
    /// The private key, PEM, mode 0600.
    pub key: PathBeneath,
}

impl CertFiles {
    /// The files of `host` in `dir`. `host` must be a validated Ingress host
    /// (no `/`, not starting with `.`); [`super::CertManager::ensure`] checks.
    pub fn new(dir: &PathBeneath, host: &str) -> CertFiles {
        CertFiles {
            chain: dir.join(format!("{host}.crt")),
            key: dir.join(format!("{host}.key")),
        }
    }

    /// The validity of the installed certificate, or why there is none usable:
    /// a file is missing, unreadable or not a plain file, the chain does not
    /// parse, or the key is not the certificate's.
    pub fn installed(&self) -> Result<Validity, String> {
        let chain = read_pem(&self.chain)?;
        let key = read_pem(&self.key)?;
        let leaf = first_certificate(&chain)?;
        let validity = validity_of(&leaf)?;
        let key = rcgen::KeyPair::from_pem(&key).map_err(|e| {
            format!(
                "{}: not a private key: {e}",
                self.key.display_path().display()
            )
        })?;
        if rcgen::PublicKeyData::subject_public_key_info(&key) != spki_of(&leaf)? {
            return Err(format!(
                "{} is not the key of {}",
                self.key.display_path().display(),
                self.chain.display_path().display()
            ));
        }
        Ok(validity)
    }

    /// Writes key and chain, each through a temporary file created with mode
    /// 0600 and renamed into place (the key first: [`CertFiles::installed`]
    /// refuses the mismatched pair a crash between the two renames leaves).
    pub fn install(&self, cert: &IssuedCert) -> Result<(), IngressError> {
        self.key
            .write(cert.key_pem.as_bytes(), 0o600)
            .map_err(IngressError::JailFile)?;
        self.chain
            .write(cert.chain_pem.as_bytes(), 0o600)
            .map_err(IngressError::JailFile)?;
        Ok(())
    }
}

/// A PEM file of the ingress jail's root as text, at most
/// [`MAX_PEM_FILE_LEN`] bytes.
fn read_pem(file: &PathBeneath) -> Result<String, String> {
    let bytes = file.read(MAX_PEM_FILE_LEN).map_err(|e| e.to_string())?;
    String::from_utf8(bytes).map_err(|_| format!("{} is not text", file.display_path().display()))
}

/// Writes `path` atomically with mode 0600 from its creation on. For host
/// files outside any jail's root (the ACME account); key and chain, which
/// live in the ingress jail's root, are written through [`PathBeneath`].
pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> Result<(), IngressError> {
    let err = |action: &'static str, source| IngressError::Install {
        path: path.to_path_buf(),
        action,
        source,
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    // A leftover from a crash might have any mode: never write into it.
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err("remove stale", e)),
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| err("create", e))?;
    if let Err(e) = file.write_all(bytes).and_then(|()| file.sync_all()) {
        let _ = fs::remove_file(&tmp);
        return Err(err("write", e));
    }
    fs::rename(&tmp, path).map_err(|e| err("rename into place", e))
}

/// The DER of the first certificate in a PEM chain.
pub fn first_certificate(chain_pem: &str) -> Result<Vec<u8>, String> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(chain_pem.as_bytes())
        .map_err(|e| format!("the chain is not PEM: {e}"))?;
    if pem.label != "CERTIFICATE" {
        return Err(format!("the chain starts with a {} block", pem.label));
    }
    Ok(pem.contents)
}

/// notBefore/notAfter of a DER certificate.
pub fn validity_of(der: &[u8]) -> Result<Validity, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("the certificate does not parse: {e}"))?;
    let v = cert.validity();
    Ok(Validity {
        not_before: v.not_before.timestamp(),
        not_after: v.not_after.timestamp(),
    })
}

fn spki_of(der: &[u8]) -> Result<Vec<u8>, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("the certificate does not parse: {e}"))?;
    Ok(cert.tbs_certificate.subject_pki.raw.to_vec())
}

/// The ACME client: one account, orders one at a time.
pub struct AcmeClient {
    rt: tokio::runtime::Runtime,
    account: Account,
    settings: AcmeSettings,
}

impl std::fmt::Debug for AcmeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcmeClient")
            .field("directory", &self.settings.directory_url)
            .finish_non_exhaustive()
    }
}

fn acme_err(step: &'static str, host: &str) -> impl FnOnce(instant_acme::Error) -> IngressError {
    let host = host.to_string();
    move |e| IngressError::Acme {
        host,
        step,
        message: e.to_string(),
    }
}

impl AcmeClient {
    /// Loads the account from `settings.account_file`, or registers a new one
    /// with the CA and saves it there (mode 0600) when the file does not
    /// exist. Talks to the CA: call it off the worker thread.
    pub fn open(settings: AcmeSettings) -> Result<AcmeClient, IngressError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| IngressError::Runtime(e.to_string()))?;
        let path = settings.account_file.clone();
        let account_err = |reason: String| IngressError::AccountFile {
            path: path.clone(),
            reason,
        };
        let builder = match &settings.extra_root {
            Some(root) => Account::builder_with_root(root),
            None => Account::builder(),
        }
        .map_err(|e| IngressError::Acme {
            host: String::new(),
            step: "setting up TLS towards the CA",
            message: e.to_string(),
        })?;
        let account = if path.exists() {
            let text = read_secret_file(&path, settings.key_policy).map_err(account_err)?;
            let creds: AccountCredentials = serde_json::from_str(&text)
                .map_err(|e| account_err(format!("not an ACME account file: {e}")))?;
            // The file names the directory its account lives at; using it with
            // another CA would fail obscurely at the first order.
            let directory = serde_json::to_value(&creds).ok().and_then(|v| {
                v.get("directory")
                    .and_then(|d| d.as_str())
                    .map(String::from)
            });
            if let Some(directory) = directory {
                if directory != settings.directory_url {
                    return Err(account_err(format!(
                        "it holds an account at {directory}, but ingress.acme_directory is {}; \
                         move the file away to register a new account",
                        settings.directory_url
                    )));
                }
            }
            rt.block_on(builder.from_credentials(creds))
                .map_err(acme_err("loading the ACME account", ""))?
        } else {
            let contact = settings.contact.as_ref().map(|c| format!("mailto:{c}"));
            let contacts: Vec<&str> = contact.iter().map(String::as_str).collect();
            let (account, creds) = rt
                .block_on(builder.create(
                    &NewAccount {
                        contact: &contacts,
                        terms_of_service_agreed: true,
                        only_return_existing: false,
                    },
                    settings.directory_url.clone(),
                    None,
                ))
                .map_err(acme_err("registering the ACME account", ""))?;
            let json = serde_json::to_string(&creds)
                .map_err(|e| account_err(format!("cannot serialise: {e}")))?;
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent)
                    .map_err(|e| account_err(format!("cannot create its directory: {e}")))?;
            }
            write_private(&path, json.as_bytes())?;
            account
        };
        Ok(AcmeClient {
            rt,
            account,
            settings,
        })
    }

    /// Obtains a certificate for `host`: creates the order, publishes each
    /// pending DNS-01 challenge through `dns`, waits until every configured
    /// resolver sees it, tells the CA, finalizes with a fresh key and
    /// downloads the chain. Every record published is deleted before this
    /// returns, on success and on failure.
    pub fn issue(&self, host: &str, dns: &dyn DnsProvider) -> Result<IssuedCert, IngressError> {
        let mut published = Vec::new();
        let result = self.rt.block_on(self.order(host, dns, &mut published));
        let mut cleanup = Vec::new();
        for record in &published {
            if let Err(e) = dns.delete_txt(record) {
                cleanup.push(format!("{} (id {}): {e}", record.fqdn, record.id));
            }
        }
        let cleanup = (!cleanup.is_empty()).then(|| cleanup.join("; "));
        match (result, cleanup) {
            (Ok(mut cert), cleanup) => {
                cert.cleanup_error = cleanup;
                Ok(cert)
            }
            (Err(e), None) => Err(e),
            (Err(e), Some(cleanup)) => Err(IngressError::Cleanup {
                error: Box::new(e),
                cleanup,
            }),
        }
    }

    async fn order(
        &self,
        host: &str,
        dns: &dyn DnsProvider,
        published: &mut Vec<TxtRecord>,
    ) -> Result<IssuedCert, IngressError> {
        let identifiers = [Identifier::Dns(host.to_string())];
        let mut order = self
            .account
            .new_order(&NewOrder::new(&identifiers))
            .await
            .map_err(acme_err("creating the order", host))?;
        let mut authorizations = order.authorizations();
        while let Some(authz) = authorizations.next().await {
            let mut authz = authz.map_err(acme_err("fetching the authorization", host))?;
            match authz.status {
                AuthorizationStatus::Pending => {}
                // Reused from an earlier order: nothing to prove.
                AuthorizationStatus::Valid => continue,
                other => {
                    return Err(IngressError::OrderFailed {
                        host: host.to_string(),
                        detail: format!("the authorization is {other:?}"),
                    });
                }
            }
            let mut challenge =
                authz
                    .challenge(ChallengeType::Dns01)
                    .ok_or_else(|| IngressError::OrderFailed {
                        host: host.to_string(),
                        detail: "the CA offers no dns-01 challenge".into(),
                    })?;
            let value = challenge.key_authorization().dns_value();
            let fqdn = challenge_name(host);
            published.push(dns.publish_txt(&fqdn, &value)?);
            propagation::wait_for_txt(
                &self.settings.resolvers,
                &fqdn,
                &value,
                self.settings.propagation_timeout,
            )?;
            challenge
                .set_ready()
                .await
                .map_err(acme_err("marking the challenge ready", host))?;
        }
        let retries = RetryPolicy::new().timeout(ORDER_TIMEOUT);
        let status = order
            .poll_ready(&retries)
            .await
            .map_err(acme_err("waiting for the CA to validate", host))?;
        if status != OrderStatus::Ready {
            return Err(IngressError::OrderFailed {
                host: host.to_string(),
                detail: format!(
                    "the order is {status:?} after the challenge (the CA could not see the \
                     TXT record {}?)",
                    challenge_name(host)
                ),
            });
        }
        let key_pem = order
            .finalize()
            .await
            .map_err(acme_err("finalizing the order", host))?;
        let chain_pem = order
            .poll_certificate(&retries)
            .await
            .map_err(acme_err("downloading the certificate", host))?;
        let leaf = first_certificate(&chain_pem).map_err(|reason| IngressError::Certificate {
            host: host.to_string(),
            reason,
        })?;
        let validity = validity_of(&leaf).map_err(|reason| IngressError::Certificate {
            host: host.to_string(),
            reason,
        })?;
        Ok(IssuedCert {
            chain_pem,
            key_pem,
            validity,
            cleanup_error: None,
        })
    }

    /// The CA's renewal window for the certificate whose chain is `chain_pem`
    /// and how long to wait before asking again; `None` when the CA does not
    /// offer ACME Renewal Information.
    pub fn renewal_window(
        &self,
        host: &str,
        chain_pem: &str,
    ) -> Result<Option<(RenewalWindow, Duration)>, IngressError> {
        let cert_err = |reason| IngressError::Certificate {
            host: host.to_string(),
            reason,
        };
        let der = CertificateDer::from(first_certificate(chain_pem).map_err(cert_err)?);
        let id = CertificateIdentifier::try_from(&der).map_err(cert_err)?;
        match self.rt.block_on(self.account.renewal_info(&id)) {
            Ok((info, retry_after)) => Ok(Some((
                RenewalWindow {
                    start: info.suggested_window.start.unix_timestamp(),
                    end: info.suggested_window.end.unix_timestamp(),
                },
                retry_after,
            ))),
            Err(instant_acme::Error::Unsupported(_)) => Ok(None),
            Err(e) => Err(acme_err("fetching renewal information", host)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86_400;

    fn cert(days: i64) -> Option<Validity> {
        Some(Validity {
            not_before: 0,
            not_after: days * DAY,
        })
    }

    #[test]
    fn a_missing_certificate_is_always_due() {
        assert_eq!(
            renewal_due(0, None, None),
            Renewal::Due(RenewReason::Missing)
        );
        let window = RenewalWindow {
            start: 100 * DAY,
            end: 101 * DAY,
        };
        assert_eq!(
            renewal_due(0, None, Some(window)),
            Renewal::Due(RenewReason::Missing)
        );
    }

    #[test]
    fn without_ari_renewal_starts_when_a_third_remains() {
        // 90 days: due from day 60; 45 days: from day 30.
        assert_eq!(
            renewal_due(60 * DAY - 1, cert(90), None),
            Renewal::NotDue { renew_at: 60 * DAY }
        );
        assert_eq!(
            renewal_due(60 * DAY, cert(90), None),
            Renewal::Due(RenewReason::LifetimeThird)
        );
        assert_eq!(
            renewal_due(30 * DAY, cert(45), None),
            Renewal::Due(RenewReason::LifetimeThird)
        );
        assert!(matches!(
            renewal_due(29 * DAY, cert(45), None),
            Renewal::NotDue { .. }
        ));
    }

    #[test]
    fn the_ca_window_decides_when_offered() {
        let window = RenewalWindow {
            start: 80 * DAY,
            end: 82 * DAY,
        };
        let at = window.renew_at(cert(90).expect("cert"));
        assert!((80 * DAY..82 * DAY).contains(&at), "{at}");
        // Past the lifetime third but before the moment picked in the
        // window: the CA says wait.
        assert_eq!(
            renewal_due(70 * DAY, cert(90), Some(window)),
            Renewal::NotDue { renew_at: at }
        );
        assert_eq!(
            renewal_due(at - 1, cert(90), Some(window)),
            Renewal::NotDue { renew_at: at }
        );
        assert_eq!(
            renewal_due(at, cert(90), Some(window)),
            Renewal::Due(RenewReason::AriWindow)
        );
        // A window opening early (revocation announced) renews early.
        let early = RenewalWindow {
            start: 5 * DAY,
            end: 6 * DAY,
        };
        assert_eq!(
            renewal_due(6 * DAY, cert(90), Some(early)),
            Renewal::Due(RenewReason::AriWindow)
        );
        // A window past expiry never keeps an expired certificate.
        let late = RenewalWindow {
            start: 200 * DAY,
            end: 201 * DAY,
        };
        assert_eq!(
            renewal_due(90 * DAY, cert(90), Some(late)),
            Renewal::Due(RenewReason::AriWindow)
        );
    }

    /// RFC 9773: a random moment in the window, so certificates renewed
    /// together are spread over it; stable for one certificate.
    #[test]
    fn renewals_spread_over_the_window() {
        let window = RenewalWindow {
            start: 1_000,
            end: 1_000 + DAY,
        };
        let picks: std::collections::BTreeSet<i64> = (0..64)
            .map(|i| {
                let v = Validity {
                    not_before: i * 60,
                    not_after: 90 * DAY + i * 60,
                };
                let at = window.renew_at(v);
                assert!((window.start..window.end).contains(&at), "{at}");
                assert_eq!(at, window.renew_at(v), "stable");
                at
            })
            .collect();
        assert!(picks.len() > 60, "{} distinct moments of 64", picks.len());
        let point = RenewalWindow { start: 7, end: 7 };
        assert_eq!(point.renew_at(cert(90).expect("cert")), 7);
    }

    #[test]
    fn install_writes_private_files_and_checks_the_pair() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let files = CertFiles::new(&PathBeneath::new(dir.path(), "certs"), "a.example");
        assert!(files.installed().is_err(), "nothing installed yet");
        let key = rcgen::KeyPair::generate().expect("key");
        let params = rcgen::CertificateParams::new(vec!["a.example".into()]).expect("params");
        let leaf = params.self_signed(&key).expect("cert");
        let issued = IssuedCert {
            chain_pem: leaf.pem(),
            key_pem: key.serialize_pem(),
            validity: validity_of(leaf.der()).expect("validity"),
            cleanup_error: None,
        };
        files.install(&issued).expect("install");
        for path in [files.key.display_path(), files.chain.display_path()] {
            let mode = fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", path.display());
        }
        assert_eq!(files.installed(), Ok(issued.validity));
        // A key that is not the certificate's (a crash between the renames).
        let other = rcgen::KeyPair::generate().expect("key");
        files
            .key
            .write(other.serialize_pem().as_bytes(), 0o600)
            .expect("write");
        let err = files.installed().expect_err("mismatch accepted");
        assert!(err.contains("is not the key of"), "{err}");
    }
}
