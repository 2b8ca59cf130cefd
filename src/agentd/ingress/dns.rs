//! DNS-01 challenge records at the DNS provider: the [`DnsProvider`] seam, its
//! in-memory [`FakeDns`] and the one real implementation, [`OvhDns`] (OVH's
//! REST API).
//!
//! It owns publishing one TXT record and deleting it again, and the OVH
//! request signing. It must never decide *when* a record is visible (that is
//! [`super::propagation`], which asks public resolvers, not the provider), never
//! keep a record it published beyond the caller's [`DnsProvider::delete_txt`],
//! and never put a credential into an error, a log line or a `Debug` output.
//!
//! OVH signs every authenticated call (OVH's "First steps with the API"):
//! `X-Ovh-Signature: "$1$" + hex(SHA-1(AS+CK+METHOD+URL+BODY+TIMESTAMP))` where
//! the six parts are joined with `+`, `URL` is the full URL requested, `BODY`
//! the exact bytes sent (empty when none) and `TIMESTAMP` OVH's clock in Unix
//! seconds, which we derive from `GET /auth/time` once and keep as a delta to
//! our own clock (a skewed node clock would otherwise fail every request).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde::Deserialize;
use sha1::{Digest, Sha1};

use super::read_secret_file;
use crate::common::auth::{KeyFilePolicy, unix_now};
use crate::common::config::IngressConfig;
use crate::common::sync::lock;
use crate::host::fake::{CallLog, Faults};

/// The label under which ACME DNS-01 looks for the challenge (RFC 8555 §8.4).
pub const CHALLENGE_LABEL: &str = "_acme-challenge";

/// TTL of the challenge record in seconds: OVH's smallest, so a retried
/// challenge is not hidden behind a cached old value for long.
pub const CHALLENGE_TTL: u32 = 60;

/// How long one OVH API call may take, connect to last byte.
pub const OVH_TIMEOUT: Duration = Duration::from_secs(30);

/// `_acme-challenge.<host>`: the fully qualified name of `host`'s challenge
/// record.
pub fn challenge_name(host: &str) -> String {
    format!("{CHALLENGE_LABEL}.{host}")
}

/// `fqdn` relative to `zone` (`_acme-challenge.www` for
/// `_acme-challenge.www.example.com` in `example.com`), or `None` when `fqdn`
/// is not inside `zone` (a label boundary is required: `badexample.com` is
/// not inside `example.com`). The zone apex itself is `Some("")`.
pub fn relative_name(fqdn: &str, zone: &str) -> Option<String> {
    let fqdn = fqdn.trim_end_matches('.').to_ascii_lowercase();
    let zone = zone.trim_end_matches('.').to_ascii_lowercase();
    if fqdn == zone {
        return Some(String::new());
    }
    fqdn.strip_suffix(&zone)
        .and_then(|head| head.strip_suffix('.'))
        .filter(|head| !head.is_empty())
        .map(str::to_string)
}

/// The zone among `zones` that holds `fqdn`: the longest one it is inside, so
/// a delegated `sub.example.com` zone wins over `example.com`.
pub fn zone_for<'a>(fqdn: &str, zones: &'a [String]) -> Option<&'a str> {
    zones
        .iter()
        .filter(|z| relative_name(fqdn, z).is_some())
        .max_by_key(|z| z.len())
        .map(String::as_str)
}

/// A TXT record a provider published, enough to delete it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxtRecord {
    /// Fully qualified name, `_acme-challenge.<host>`.
    pub fqdn: String,
    /// The provider's zone holding it.
    pub zone: String,
    /// The provider's id of the record.
    pub id: String,
}

/// Publishes and deletes DNS-01 challenge records. Implementations block; the
/// certificate manager calls them on its own thread.
pub trait DnsProvider: Send + Sync {
    /// Publishes a TXT record `value` at `fqdn` and returns its handle. The
    /// record may take a while to be visible; the caller waits for that.
    fn publish_txt(&self, fqdn: &str, value: &str) -> Result<TxtRecord, DnsError>;
    /// Deletes a record [`DnsProvider::publish_txt`] returned.
    fn delete_txt(&self, record: &TxtRecord) -> Result<(), DnsError>;
}

/// What went wrong talking to the DNS provider.
#[derive(Debug)]
pub enum DnsError {
    /// The credentials file could not be read, or is not safe to read
    /// (others may access it, wrong owner).
    Credentials {
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The credentials file is not what [`OvhCredentials::load`] expects.
    CredentialsFormat {
        /// The file.
        path: PathBuf,
        /// Which field or line; never the file's content.
        reason: String,
    },
    /// The provider could not be reached, or its answer could not be read.
    Transport {
        /// `METHOD URL`.
        request: String,
        /// What failed.
        reason: String,
    },
    /// The provider answered with an error status.
    Refused {
        /// `METHOD URL`.
        request: String,
        /// HTTP status.
        status: u16,
        /// The provider's message.
        message: String,
    },
    /// No zone of the provider's account contains the name.
    NoZone {
        /// The name a record was wanted for.
        fqdn: String,
        /// The zones the account has.
        zones: Vec<String>,
    },
    /// An injected failure of [`FakeDns`].
    Injected {
        /// The operation that was told to fail.
        op: String,
    },
}

impl fmt::Display for DnsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DnsError::Credentials { path, reason } => write!(
                f,
                "DNS provider credentials {} (ingress.ovh_credentials): {reason}",
                path.display()
            ),
            DnsError::CredentialsFormat { path, reason } => write!(
                f,
                "DNS provider credentials {}: {reason}; expected TOML with application_key, \
                 application_secret and consumer_key",
                path.display()
            ),
            DnsError::Transport { request, reason } => write!(
                f,
                "{request} failed: {reason}; check the node's outbound HTTPS and \
                 ingress.ovh_endpoint"
            ),
            DnsError::Refused {
                request,
                status,
                message,
            } => {
                write!(f, "{request} was refused with HTTP {status}: {message}")?;
                match status {
                    401 | 403 => write!(
                        f,
                        " (check the keys in ingress.ovh_credentials and that the consumer \
                         key grants GET/POST/DELETE on /domain/zone/*)"
                    ),
                    _ => Ok(()),
                }
            }
            DnsError::NoZone { fqdn, zones } => write!(
                f,
                "no DNS zone of the provider account contains {fqdn} (zones: {}); add the \
                 domain's zone to the account or fix the Ingress host",
                if zones.is_empty() {
                    "none".to_string()
                } else {
                    zones.join(", ")
                }
            ),
            DnsError::Injected { op } => write!(f, "injected failure of {op}"),
        }
    }
}

impl std::error::Error for DnsError {}

/// In-memory provider for tests: records live in a shared table, every call is
/// logged (`dns.publish <fqdn> <value>`, `dns.delete <fqdn> <id>`) and
/// operations `dns.publish` / `dns.delete` can be told to fail through
/// [`Faults`] (target: the fqdn).
#[derive(Debug, Clone, Default)]
pub struct FakeDns {
    records: std::sync::Arc<Mutex<Vec<(TxtRecord, String)>>>,
    next_id: std::sync::Arc<Mutex<u64>>,
    /// Every call, in order.
    pub log: CallLog,
    /// Injected failures.
    pub faults: Faults,
}

impl FakeDns {
    /// An empty provider.
    pub fn new() -> FakeDns {
        FakeDns::default()
    }

    /// The records currently published, as `(fqdn, value)`.
    pub fn records(&self) -> Vec<(String, String)> {
        lock(&self.records)
            .iter()
            .map(|(r, v)| (r.fqdn.clone(), v.clone()))
            .collect()
    }
}

impl DnsProvider for FakeDns {
    fn publish_txt(&self, fqdn: &str, value: &str) -> Result<TxtRecord, DnsError> {
        self.log.push(format!("dns.publish {fqdn} {value}"));
        if self.faults.should_fail("dns.publish", fqdn) {
            return Err(DnsError::Injected {
                op: format!("dns.publish {fqdn}"),
            });
        }
        let id = {
            let mut next = lock(&self.next_id);
            *next += 1;
            next.to_string()
        };
        let record = TxtRecord {
            fqdn: fqdn.to_string(),
            zone: "fake".into(),
            id,
        };
        lock(&self.records).push((record.clone(), value.to_string()));
        Ok(record)
    }

    fn delete_txt(&self, record: &TxtRecord) -> Result<(), DnsError> {
        self.log
            .push(format!("dns.delete {} {}", record.fqdn, record.id));
        if self.faults.should_fail("dns.delete", &record.fqdn) {
            return Err(DnsError::Injected {
                op: format!("dns.delete {}", record.fqdn),
            });
        }
        lock(&self.records).retain(|(r, _)| r != record);
        Ok(())
    }
}

/// OVH API credentials: the application key (AK), application secret (AS) and
/// consumer key (CK). `Debug` shows none of them.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OvhCredentials {
    /// AK, sent in `X-Ovh-Application`.
    pub application_key: String,
    /// AS, only ever part of the signed string.
    pub application_secret: String,
    /// CK, sent in `X-Ovh-Consumer`.
    pub consumer_key: String,
}

impl fmt::Debug for OvhCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OvhCredentials { .. }")
    }
}

impl OvhCredentials {
    /// Reads a TOML file with `application_key`, `application_secret` and
    /// `consumer_key`, refusing it when group or others have any permission on
    /// it (it must be 0600 or 0400) or, for a root daemon, when root does not
    /// own it. Errors never quote the file.
    pub fn load(path: &Path, policy: KeyFilePolicy) -> Result<OvhCredentials, DnsError> {
        let text = read_secret_file(path, policy).map_err(|reason| DnsError::Credentials {
            path: path.to_path_buf(),
            reason,
        })?;
        let creds: OvhCredentials =
            toml::from_str(&text).map_err(|e| DnsError::CredentialsFormat {
                path: path.to_path_buf(),
                reason: match e.span() {
                    Some(span) => format!(
                        "line {} is wrong ({})",
                        text[..span.start.min(text.len())].matches('\n').count() + 1,
                        e.message()
                    ),
                    None => e.message().to_string(),
                },
            })?;
        for (name, value) in [
            ("application_key", &creds.application_key),
            ("application_secret", &creds.application_secret),
            ("consumer_key", &creds.consumer_key),
        ] {
            // They travel in HTTP headers: nothing that could split one.
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(DnsError::CredentialsFormat {
                    path: path.to_path_buf(),
                    reason: format!("`{name}` must be non-empty printable ASCII"),
                });
            }
        }
        Ok(creds)
    }
}

/// OVH's request signature: `"$1$"` followed by the lowercase hex SHA-1 of
/// `secret+consumer_key+method+url+body+timestamp`.
pub fn ovh_signature(
    application_secret: &str,
    consumer_key: &str,
    method: &str,
    url: &str,
    body: &str,
    timestamp: i64,
) -> String {
    let timestamp = timestamp.to_string();
    let signed = [
        application_secret,
        consumer_key,
        method,
        url,
        body,
        timestamp.as_str(),
    ]
    .join("+");
    let digest = Sha1::digest(signed.as_bytes());
    let mut out = String::with_capacity(3 + 40);
    out.push_str("$1$");
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// The OVH DNS provider: `POST /domain/zone/{zone}/record` (TXT), then
/// `POST /domain/zone/{zone}/refresh` so the zone is served with it;
/// `DELETE /domain/zone/{zone}/record/{id}` and a refresh again. The zone is
/// found by listing `GET /domain/zone` and taking the longest one holding the
/// name, so no zone needs configuring.
pub struct OvhDns {
    endpoint: String,
    creds: OvhCredentials,
    agent: ureq::Agent,
    /// OVH's clock minus ours, in seconds; fetched on first use.
    time_delta: Mutex<Option<i64>>,
}

impl fmt::Debug for OvhDns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OvhDns")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct OvhRecord {
    id: u64,
}

impl OvhDns {
    /// A provider talking to `endpoint` (`https://eu.api.ovh.com/1.0`; a
    /// trailing `/` is ignored) with `creds`.
    pub fn new(endpoint: &str, creds: OvhCredentials) -> OvhDns {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            // OVH explains refusals in the body: read it instead of a bare status.
            .http_status_as_error(false)
            .timeout_global(Some(OVH_TIMEOUT))
            .build()
            .into();
        OvhDns {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            creds,
            agent,
            time_delta: Mutex::new(None),
        }
    }

    /// The provider `[ingress]` configures: `ovh_endpoint` with the
    /// credentials read from `ovh_credentials`.
    pub fn from_config(cfg: &IngressConfig, policy: KeyFilePolicy) -> Result<OvhDns, DnsError> {
        let creds = OvhCredentials::load(&cfg.ovh_credentials, policy)?;
        Ok(OvhDns::new(&cfg.ovh_endpoint, creds))
    }

    /// OVH's current time per `GET /auth/time` (unauthenticated) as a delta to
    /// ours, fetched once.
    fn timestamp(&self) -> Result<i64, DnsError> {
        let now = i64::try_from(unix_now()).unwrap_or(i64::MAX);
        if let Some(delta) = *lock(&self.time_delta) {
            return Ok(now.saturating_add(delta));
        }
        let url = format!("{}/auth/time", self.endpoint);
        let request = format!("GET {url}");
        let (status, body) = self.send("GET", &url, None, &request, &[])?;
        if !(200..300).contains(&status) {
            return Err(refused(&request, status, &body));
        }
        let server: i64 = body.trim().parse().map_err(|_| DnsError::Transport {
            request: request.clone(),
            reason: "the answer is not a Unix timestamp".into(),
        })?;
        let delta = server.saturating_sub(now);
        *lock(&self.time_delta) = Some(delta);
        Ok(server)
    }

    /// One signed call; `body` is sent as JSON exactly as signed.
    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<String, DnsError> {
        let url = format!("{}{path}", self.endpoint);
        let request = format!("{method} {url}");
        let body_text = match body {
            Some(v) => v.to_string(),
            None => String::new(),
        };
        let ts = self.timestamp()?;
        let signature = ovh_signature(
            &self.creds.application_secret,
            &self.creds.consumer_key,
            method,
            &url,
            &body_text,
            ts,
        );
        let ts = ts.to_string();
        let headers = [
            ("X-Ovh-Application", self.creds.application_key.as_str()),
            ("X-Ovh-Consumer", self.creds.consumer_key.as_str()),
            ("X-Ovh-Timestamp", ts.as_str()),
            ("X-Ovh-Signature", signature.as_str()),
        ];
        let (status, text) = self.send(
            method,
            &url,
            body.map(|_| body_text.as_str()),
            &request,
            &headers,
        )?;
        if !(200..300).contains(&status) {
            return Err(refused(&request, status, &text));
        }
        Ok(text)
    }

    fn send(
        &self,
        method: &str,
        url: &str,
        body: Option<&str>,
        request: &str,
        headers: &[(&str, &str)],
    ) -> Result<(u16, String), DnsError> {
        let transport = |e: ureq::Error| DnsError::Transport {
            request: request.to_string(),
            reason: e.to_string(),
        };
        let mut builder = ureq::http::Request::builder()
            .method(method)
            .uri(url)
            .header("Accept", "application/json");
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let response = match body {
            Some(b) => {
                let req = builder
                    .header("Content-Type", "application/json; charset=utf-8")
                    .body(b.to_string())
                    .map_err(|e| transport(e.into()))?;
                self.agent.run(req)
            }
            // A bodiless POST (zone refresh) still says Content-Length: 0;
            // without it ureq would announce a chunked body.
            None if method == "POST" => {
                let req = builder
                    .body(String::new())
                    .map_err(|e| transport(e.into()))?;
                self.agent.run(req)
            }
            None => {
                let req = builder.body(()).map_err(|e| transport(e.into()))?;
                self.agent.run(req)
            }
        };
        let mut response = response.map_err(transport)?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .with_config()
            .limit(1024 * 1024)
            .read_to_string()
            .map_err(transport)?;
        Ok((status, text))
    }

    fn zones(&self) -> Result<Vec<String>, DnsError> {
        let text = self.call("GET", "/domain/zone", None)?;
        serde_json::from_str(&text).map_err(|e| DnsError::Transport {
            request: format!("GET {}/domain/zone", self.endpoint),
            reason: format!("unexpected answer: {e}"),
        })
    }
}

fn refused(request: &str, status: u16, body: &str) -> DnsError {
    // OVH answers errors as {"message": "..."}; anything else is shown trimmed.
    let message = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.get("message")
                .and_then(|m| m.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| body.chars().take(200).collect());
    DnsError::Refused {
        request: request.to_string(),
        status,
        message,
    }
}

impl DnsProvider for OvhDns {
    fn publish_txt(&self, fqdn: &str, value: &str) -> Result<TxtRecord, DnsError> {
        let zones = self.zones()?;
        let Some(zone) = zone_for(fqdn, &zones) else {
            return Err(DnsError::NoZone {
                fqdn: fqdn.to_string(),
                zones,
            });
        };
        let sub_domain = relative_name(fqdn, zone).unwrap_or_default();
        let body = serde_json::json!({
            "fieldType": "TXT",
            "subDomain": sub_domain,
            "target": value,
            "ttl": CHALLENGE_TTL,
        });
        let path = format!("/domain/zone/{zone}/record");
        let text = self.call("POST", &path, Some(&body))?;
        let record: OvhRecord = serde_json::from_str(&text).map_err(|e| DnsError::Transport {
            request: format!("POST {}{path}", self.endpoint),
            reason: format!("the answer carries no record id: {e}"),
        })?;
        let record = TxtRecord {
            fqdn: fqdn.to_string(),
            zone: zone.to_string(),
            id: record.id.to_string(),
        };
        if let Err(e) = self.call("POST", &format!("/domain/zone/{zone}/refresh"), None) {
            // Without the refresh OVH does not serve the record: undo it, so a
            // failed publish leaves nothing behind.
            let _ = self.delete_txt(&record);
            return Err(e);
        }
        Ok(record)
    }

    fn delete_txt(&self, record: &TxtRecord) -> Result<(), DnsError> {
        let zone = &record.zone;
        self.call(
            "DELETE",
            &format!("/domain/zone/{zone}/record/{}", record.id),
            None,
        )?;
        self.call("POST", &format!("/domain/zone/{zone}/refresh"), None)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_the_documented_formula() {
        // Computed by hand: printf '%s' \
        //  'AS+CK+POST+https://eu.api.ovh.com/1.0/domain/zone/example.com/record+{"a":1}+1700000000' \
        //  | sha1sum
        let sig = ovh_signature(
            "AS",
            "CK",
            "POST",
            "https://eu.api.ovh.com/1.0/domain/zone/example.com/record",
            "{\"a\":1}",
            1_700_000_000,
        );
        assert_eq!(sig, "$1$3aba93e5081daafb3481bc84d7c66fbb554861ed");
    }

    #[test]
    fn signature_of_a_bodiless_get_keeps_the_empty_field() {
        // printf '%s' 'AS+CK+GET+https://eu.api.ovh.com/1.0/domain/zone++1' | sha1sum
        let sig = ovh_signature(
            "AS",
            "CK",
            "GET",
            "https://eu.api.ovh.com/1.0/domain/zone",
            "",
            1,
        );
        assert_eq!(sig, "$1$3126a13929ef2872469c8d9cb9c724ec273e51b3");
    }

    #[test]
    fn challenge_names_are_relative_to_the_zone() {
        assert_eq!(
            challenge_name("www.example.com"),
            "_acme-challenge.www.example.com"
        );
        assert_eq!(
            relative_name("_acme-challenge.www.example.com", "example.com").as_deref(),
            Some("_acme-challenge.www")
        );
        assert_eq!(
            relative_name("_acme-challenge.example.com", "example.com.").as_deref(),
            Some("_acme-challenge")
        );
        assert_eq!(
            relative_name("example.com", "example.com").as_deref(),
            Some("")
        );
        assert_eq!(
            relative_name("_acme-challenge.badexample.com", "example.com"),
            None
        );
        assert_eq!(relative_name("example.org", "example.com"), None);
        let zones = vec!["example.com".to_string(), "shop.example.com".to_string()];
        assert_eq!(
            zone_for("_acme-challenge.shop.example.com", &zones),
            Some("shop.example.com")
        );
        assert_eq!(
            zone_for("_acme-challenge.www.example.com", &zones),
            Some("example.com")
        );
        assert_eq!(zone_for("_acme-challenge.example.net", &zones), None);
    }

    #[test]
    fn credentials_are_refused_when_others_can_read_them() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ovh.toml");
        std::fs::write(
            &path,
            "application_key = \"ak\"\napplication_secret = \"as\"\nconsumer_key = \"ck\"\n",
        )
        .expect("write");
        let policy = KeyFilePolicy {
            require_root_owner: false,
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let err = OvhCredentials::load(&path, policy).expect_err("0644 accepted");
        assert!(err.to_string().contains("chmod 600"), "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let creds = OvhCredentials::load(&path, policy).expect("0600 refused");
        assert_eq!(creds.application_key, "ak");
        assert_eq!(format!("{creds:?}"), "OvhCredentials { .. }");
        std::fs::write(&path, "application_key = \"ak\"\n").expect("write");
        let err = OvhCredentials::load(&path, policy).expect_err("incomplete accepted");
        assert!(err.to_string().contains("application_secret"), "{err}");
    }

    #[test]
    fn fake_records_publish_and_delete() {
        let dns = FakeDns::new();
        let r = dns
            .publish_txt("_acme-challenge.a.example", "v")
            .expect("publish");
        assert_eq!(
            dns.records(),
            vec![("_acme-challenge.a.example".into(), "v".into())]
        );
        dns.delete_txt(&r).expect("delete");
        assert!(dns.records().is_empty());
        dns.faults.fail("dns.publish", None);
        assert!(dns.publish_txt("_acme-challenge.a.example", "v").is_err());
    }
}
