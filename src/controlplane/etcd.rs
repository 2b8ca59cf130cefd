//! A blocking etcd v3 client for the control plane's threads.
//!
//! [`Etcd`] owns a current-thread tokio runtime, driven by a thread of its
//! own, and one [`etcd_client::Client`] per configured member; it offers the
//! few calls the etcd state backend is built from: a prefix read, a
//! compare-and-write transaction, leases, and a leader key guarded by a
//! lease. Each call blocks the calling thread for at most
//! [`EtcdSettings::timeout`] and answers a typed [`EtcdError`] that says
//! which endpoints, which operation, what etcd answered and what to check.
//!
//! The runtime's thread keeps the connections current between calls (a
//! member's death is seen when it happens, not by the next write sent into
//! the dead connection) and runs the HTTP/2 keepalives; it never renews a
//! lease by itself: a lease lives exactly as long as its holder keeps
//! calling [`Etcd::keep_alive`] in time.
//!
//! A call goes to the member that answered last and, when that member
//! cannot be reached, to the next: reads, lease calls and any request that
//! provably never reached etcd (connection refused, member without a
//! leader). A write that may have reached etcd is not repeated
//! ([`EtcdError::Indeterminate`]).
//!
//! Keys are given and returned relative to [`EtcdSettings::prefix`], so
//! clusters sharing one etcd cannot see each other's keys.
//!
//! It must never:
//! - decide anything: it carries compares and writes, the caller owns what
//!   they mean (placements, leadership, fencing);
//! - repeat a write that may have landed: one whose first attempt applied
//!   but whose answer was lost would then report a failed compare for a
//!   write that happened, and the caller could not tell;
//! - be called from inside a tokio runtime (the proxy's event loops):
//!   blocking there would stall every task of that loop, so such a call is
//!   refused with [`EtcdError::InsideRuntime`];
//! - block longer than its timeout, or panic on anything etcd sends.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare as EtcdCompare, CompareOp, ConnectOptions, DeleteOptions,
    GetOptions, Identity, KvClient, LeaseKeepAliveStream, LeaseKeeper, PutOptions, TlsOptions, Txn,
    TxnOp, TxnOpResponse,
};

/// The configuration keys the settings come from, for messages.
const ENDPOINTS_KEY: &str = "controlplane.etcd_endpoints";
const CA_KEY: &str = "controlplane.etcd_ca";
const CERT_KEY: &str = "controlplane.etcd_cert";
const KEY_KEY: &str = "controlplane.etcd_key";
const PREFIX_KEY: &str = "controlplane.etcd_prefix";
const TIMEOUT_KEY: &str = "controlplane.etcd_timeout";

/// A whole prefix is read in one answer; tonic's default 4 MiB limit would
/// refuse the state of a large cluster, which etcd itself serves fine.
const MAX_RESPONSE: usize = 256 * 1024 * 1024;

/// See where [`Etcd::connect`] uses it.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Where etcd is and how to reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdSettings {
    /// Client URLs of the members, `http://host:port` or `https://host:port`
    /// (all of one scheme).
    pub endpoints: Vec<String>,
    /// CA certificate (PEM) the members' certificates must chain to; needed
    /// for `https://` endpoints (no system roots are consulted).
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM), for members started with client
    /// certificate authentication; needs [`EtcdSettings::key`].
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    pub key: Option<PathBuf>,
    /// Prefix of every key this cluster uses, ending in `/`.
    pub prefix: String,
    /// Bound on each call, connecting included.
    pub timeout: Duration,
}

impl EtcdSettings {
    /// The settings of `controlplane.etcd_*`, when etcd is configured.
    pub fn of(c: &crate::common::config::ControlPlaneConfig) -> Option<EtcdSettings> {
        (!c.etcd_endpoints.is_empty()).then(|| EtcdSettings {
            endpoints: c.etcd_endpoints.clone(),
            ca: c.etcd_ca.clone(),
            cert: c.etcd_cert.clone(),
            key: c.etcd_key.clone(),
            prefix: c.etcd_prefix.clone(),
            timeout: c.etcd_timeout.0,
        })
    }

    /// Checks the settings without touching the network or the files.
    pub fn validate(&self) -> Result<(), EtcdError> {
        let bad =
            |field: &'static str, problem: String| Err(EtcdError::Settings { field, problem });
        if self.endpoints.is_empty() {
            return bad(
                ENDPOINTS_KEY,
                "is empty: list the client URL of every etcd member, e.g. \
                 [\"http://127.0.0.1:2379\"]"
                    .into(),
            );
        }
        let mut tls = None;
        for endpoint in &self.endpoints {
            let https = match parse_endpoint(endpoint) {
                Ok(https) => https,
                Err(why) => return bad(ENDPOINTS_KEY, format!("{endpoint:?}: {why}")),
            };
            match tls {
                Some(t) if t != https => {
                    return bad(
                        ENDPOINTS_KEY,
                        "mixes http:// and https:// URLs: one cluster speaks one of them".into(),
                    );
                }
                _ => tls = Some(https),
            }
        }
        let https = tls == Some(true);
        match (&self.cert, &self.key) {
            (Some(_), None) => {
                return bad(
                    CERT_KEY,
                    format!("is set without {KEY_KEY}: give the client certificate's key too"),
                );
            }
            (None, Some(_)) => {
                return bad(
                    KEY_KEY,
                    format!("is set without {CERT_KEY}: give the certificate of that key too"),
                );
            }
            _ => {}
        }
        for (field, path) in [
            (CA_KEY, &self.ca),
            (CERT_KEY, &self.cert),
            (KEY_KEY, &self.key),
        ] {
            if path.is_some() && !https {
                return bad(
                    field,
                    format!(
                        "is set but {ENDPOINTS_KEY} are http:// URLs: use https:// URLs, or \
                         drop {field}"
                    ),
                );
            }
        }
        if https && self.ca.is_none() {
            return bad(
                CA_KEY,
                format!(
                    "is required with https:// {ENDPOINTS_KEY}: the CA certificate (PEM) the \
                     members' certificates chain to"
                ),
            );
        }
        if self.prefix.is_empty() || !self.prefix.ends_with('/') {
            return bad(
                PREFIX_KEY,
                format!(
                    "{:?} must be non-empty and end in '/', so that no other prefix \
                     starts with it (e.g. \"/keel/\")",
                    self.prefix
                ),
            );
        }
        if self.timeout.is_zero() {
            return bad(
                TIMEOUT_KEY,
                "is zero: every call would time out; a few seconds is usual".into(),
            );
        }
        Ok(())
    }

    fn is_https(&self) -> bool {
        self.endpoints.iter().any(|e| e.starts_with("https://"))
    }
}

/// Whether `endpoint` is `https://` (else `http://`), or why it is neither
/// form `scheme://host:port`.
fn parse_endpoint(endpoint: &str) -> Result<bool, String> {
    let (https, rest) = if let Some(rest) = endpoint.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = endpoint.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err("not http://host:port or https://host:port".into());
    };
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let Some((host, port)) = v6.split_once("]:") else {
            return Err("an IPv6 address is written [address]:port".into());
        };
        (host, port)
    } else {
        let Some((host, port)) = rest.rsplit_once(':') else {
            return Err("no port: etcd's client port is usually 2379".into());
        };
        if host.contains(':') {
            return Err("an IPv6 address is written [address]:port".into());
        }
        (host, port)
    };
    if host.is_empty() || host.contains(['/', '@', '?', '#', ' ']) {
        return Err("not http://host:port or https://host:port (no user, path or query)".into());
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(https),
        _ => Err(format!("port {port:?} is not a number from 1 to 65535")),
    }
}

/// A key as read, relative to the settings' prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    /// The key without the prefix.
    pub key: String,
    /// Its value.
    pub value: Vec<u8>,
    /// Revision of its last write.
    pub mod_revision: i64,
    /// Revision of its creation (it was absent before).
    pub create_revision: i64,
    /// The lease it is attached to, if any.
    pub lease: Option<LeaseId>,
}

/// The answer of [`Etcd::range_prefix`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Range {
    /// The keys under the prefix, in key order.
    pub kvs: Vec<Kv>,
    /// The store's revision the read saw: watch or compare from here.
    pub revision: i64,
}

/// One condition of a transaction, on a key relative to the prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Compare {
    /// The key's last write was at this revision.
    ModRevision {
        /// The key.
        key: String,
        /// Expected mod_revision.
        revision: i64,
    },
    /// The key was created at this revision; 0 means it is absent.
    CreateRevision {
        /// The key.
        key: String,
        /// Expected create_revision.
        revision: i64,
    },
    /// The key holds exactly this value (an absent key matches nothing).
    Value {
        /// The key.
        key: String,
        /// Expected value.
        value: Vec<u8>,
    },
}

impl Compare {
    /// `key`'s mod_revision is `revision`.
    pub fn mod_revision(key: &str, revision: i64) -> Compare {
        Compare::ModRevision {
            key: key.into(),
            revision,
        }
    }

    /// `key`'s create_revision is `revision` (0: absent).
    pub fn create_revision(key: &str, revision: i64) -> Compare {
        Compare::CreateRevision {
            key: key.into(),
            revision,
        }
    }

    /// `key` is absent.
    pub fn absent(key: &str) -> Compare {
        Compare::create_revision(key, 0)
    }

    /// `key` holds `value`.
    pub fn value(key: &str, value: impl Into<Vec<u8>>) -> Compare {
        Compare::Value {
            key: key.into(),
            value: value.into(),
        }
    }
}

/// One write of a transaction, on keys relative to the prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Sets the key, attached to a lease if given (it vanishes with it).
    Put {
        /// The key.
        key: String,
        /// Its new value.
        value: Vec<u8>,
        /// The lease to attach it to.
        lease: Option<LeaseId>,
    },
    /// Removes the key.
    Delete {
        /// The key.
        key: String,
    },
    /// Removes every key starting with the prefix.
    DeletePrefix {
        /// The prefix, relative to the settings' prefix.
        prefix: String,
    },
}

impl Op {
    /// Sets `key`.
    pub fn put(key: &str, value: impl Into<Vec<u8>>) -> Op {
        Op::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
        }
    }

    /// Sets `key` for as long as `lease` lives. A transaction that runs it
    /// after the lease is gone fails as a whole with [`EtcdError::Status`]
    /// code `NotFound`.
    pub fn put_with_lease(key: &str, value: impl Into<Vec<u8>>, lease: LeaseId) -> Op {
        Op::Put {
            key: key.into(),
            value: value.into(),
            lease: Some(lease),
        }
    }

    /// Removes `key`.
    pub fn delete(key: &str) -> Op {
        Op::Delete { key: key.into() }
    }

    /// Removes every key under `prefix`.
    pub fn delete_prefix(prefix: &str) -> Op {
        Op::DeletePrefix {
            prefix: prefix.into(),
        }
    }
}

/// The answer of [`Etcd::txn`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnOutcome {
    /// Every compare held, so the success ops ran (else the failure ops).
    pub succeeded: bool,
    /// The store's revision after the transaction: the mod_revision of every
    /// key it wrote.
    pub revision: i64,
}

/// An etcd lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // etcdctl prints lease ids in hex; so do we, to compare by eye.
        write!(f, "{:x}", self.0)
    }
}

/// A lease as granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Its id.
    pub id: LeaseId,
    /// The TTL etcd granted, which may exceed the one asked for (etcd has a
    /// minimum of about one and a half election timeouts).
    pub ttl: Duration,
}

/// The answer of [`Etcd::try_lead`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lead {
    /// The caller holds the leader key. Guard every decision with
    /// `Compare::create_revision(key, revision)`: once the key is lost and
    /// taken by another, such a transaction fails.
    Held {
        /// The leader key's create_revision.
        revision: i64,
    },
    /// Another holder has the key.
    Other {
        /// Its value (the holder's name).
        holder: String,
        /// The leader key's create_revision.
        revision: i64,
    },
}

/// Why a call failed; the message says what to check.
#[derive(Debug)]
pub enum EtcdError {
    /// A setting is wrong ([`EtcdSettings::validate`]).
    Settings {
        /// The configuration key, e.g. `controlplane.etcd_endpoints`.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A TLS file could not be read.
    TlsFile {
        /// The configuration key naming it.
        field: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The runtime could not be created.
    Runtime(std::io::Error),
    /// Called from inside a tokio runtime, where blocking is not allowed.
    InsideRuntime {
        /// The operation.
        op: &'static str,
    },
    /// No member answered: connections refused, TLS handshakes failed, or
    /// no member with a leader.
    Unavailable {
        /// The operation.
        op: &'static str,
        /// The configured endpoints.
        endpoints: String,
        /// What each member's attempt ended with.
        detail: String,
        /// The endpoints are https:// (the TLS settings may be at fault).
        tls: bool,
    },
    /// A write's connection broke before its answer: it may or may not
    /// have been applied, so it was not repeated on another member.
    Indeterminate {
        /// The operation.
        op: &'static str,
        /// The member it was sent to.
        endpoint: String,
        /// What broke.
        detail: String,
    },
    /// No answer within the timeout (for a write: it may or may not have
    /// been applied).
    Timeout {
        /// The operation.
        op: &'static str,
        /// The configured endpoints.
        endpoints: String,
        /// The timeout.
        after: Duration,
        /// What the members tried before the time ran out ended with.
        earlier: String,
    },
    /// etcd answered with an error status.
    Status {
        /// The operation.
        op: &'static str,
        /// The member that answered.
        endpoint: String,
        /// The gRPC status code.
        code: String,
        /// etcd's message.
        message: String,
    },
    /// The etcd client refused the request before sending it.
    Client {
        /// The operation.
        op: &'static str,
        /// The member it was meant for.
        endpoint: String,
        /// The client's account.
        detail: String,
    },
    /// etcd's answer is not what this module writes (a key outside the
    /// prefix or not UTF-8, a missing header): someone else writes there.
    Unexpected {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
}

impl EtcdError {
    /// True when etcd was not reached or did not answer in time: worth
    /// trying again later, unlike a wrong setting or a refusal.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            EtcdError::Unavailable { .. }
                | EtcdError::Timeout { .. }
                | EtcdError::Indeterminate { .. }
        )
    }
}

impl fmt::Display for EtcdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EtcdError::Settings { field, problem } => write!(f, "{field} {problem}"),
            EtcdError::TlsFile {
                field,
                path,
                source,
            } => write!(
                f,
                "cannot read {} ({field}): {source}; check the path and its permissions",
                path.display()
            ),
            EtcdError::Runtime(e) => write!(f, "cannot start the etcd client's runtime: {e}"),
            EtcdError::InsideRuntime { op } => write!(
                f,
                "etcd {op} was called from inside a tokio runtime, where it would block \
                 every task; call it from a plain thread (this is a bug in keel)"
            ),
            EtcdError::Unavailable {
                op,
                endpoints,
                detail,
                tls,
            } => {
                write!(
                    f,
                    "etcd {op} failed on every member ({detail}); is etcd running at \
                     {endpoints}, with a quorum of its members up? check {ENDPOINTS_KEY}"
                )?;
                if *tls {
                    write!(
                        f,
                        ", and that the members' certificates chain to {CA_KEY} and accept \
                         {CERT_KEY}"
                    )?;
                }
                Ok(())
            }
            EtcdError::Indeterminate {
                op,
                endpoint,
                detail,
            } => write!(
                f,
                "etcd {op} at {endpoint} broke off before its answer ({detail}): it may or \
                 may not have been applied, so it was not repeated; read the state again \
                 before deciding again"
            ),
            EtcdError::Timeout {
                op,
                endpoints,
                after,
                earlier,
            } => {
                write!(
                    f,
                    "etcd {op} got no answer from {endpoints} within {after:?}"
                )?;
                if !earlier.is_empty() {
                    write!(f, " ({earlier})")?;
                }
                write!(
                    f,
                    "; is etcd running at {endpoints}, with a quorum of its members up? \
                     check {ENDPOINTS_KEY} (or raise {TIMEOUT_KEY} if etcd is only slow)"
                )
            }
            EtcdError::Status {
                op,
                endpoint,
                code,
                message,
            } => {
                write!(f, "etcd at {endpoint} refused {op}: {code}: {message}")?;
                match code.as_str() {
                    "PermissionDenied" | "Unauthenticated" => write!(
                        f,
                        "; check that {CERT_KEY} names a user allowed on {PREFIX_KEY}"
                    ),
                    "ResourceExhausted" => write!(
                        f,
                        "; etcd is out of space or over its request size: see its log and \
                         alarms (etcdctl alarm list)"
                    ),
                    _ => Ok(()),
                }
            }
            EtcdError::Client {
                op,
                endpoint,
                detail,
            } => write!(
                f,
                "the etcd client refused to send {op} to {endpoint}: {detail} (a bug in keel: \
                 report it with this message)"
            ),
            EtcdError::Unexpected { op, detail } => write!(
                f,
                "etcd {op} answered something keel does not write ({detail}); is another \
                 program writing under {PREFIX_KEY}?"
            ),
        }
    }
}

impl std::error::Error for EtcdError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            EtcdError::TlsFile { source, .. } | EtcdError::Runtime(source) => Some(source),
            _ => None,
        }
    }
}

/// One configured member: its own connection, so that a dead member only
/// costs the calls that try it (one balanced channel over all of them fails
/// whichever calls it routes to the dead one).
struct Member {
    endpoint: String,
    client: Client,
    kv: KvClient,
}

/// An open keep-alive stream.
struct Keeper {
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
}

/// The thread driving the runtime, and what stops it.
struct Driver {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(driver) = self.driver.take() {
            let _ = driver.stop.send(());
            // The runtime drops on its own thread, outside any async
            // context; its tasks (connections, streams) end with it.
            let _ = driver.thread.join();
        }
    }
}

/// Which failures a call may retry on the next member.
#[derive(Clone, Copy)]
enum Retry {
    /// Any unreachable member: the call is a read, or repeating it does no
    /// harm (a keep-alive, a revoke, a grant whose lease would expire).
    Unreachable,
    /// Only failures that prove the request never reached etcd: a
    /// connection that could not be made, or a member that has no leader
    /// and refused it. A write that may have landed is never repeated.
    NotSent,
}

/// A connected client; see the module docs.
pub struct Etcd {
    /// The runtime's handle; its thread drives it until [`Etcd`] drops.
    handle: tokio::runtime::Handle,
    driver: Option<Driver>,
    members: Vec<Member>,
    /// The member that answered last, tried first: calls stay on one member
    /// while it works.
    current: AtomicUsize,
    prefix: String,
    timeout: Duration,
    /// For messages: the endpoints as configured, comma-separated.
    endpoints: String,
    tls: bool,
    /// Open keep-alive streams by lease: one round trip per renewal instead
    /// of a new stream each time.
    keepers: Mutex<HashMap<LeaseId, Keeper>>,
}

impl fmt::Debug for Etcd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Etcd")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn read_tls(field: &'static str, path: &Path) -> Result<Vec<u8>, EtcdError> {
    std::fs::read(path).map_err(|source| EtcdError::TlsFile {
        field,
        path: path.to_path_buf(),
        source,
    })
}

impl Etcd {
    /// Validates `settings`, reads the TLS files and checks that a quorum
    /// answers a read under the prefix, so that a wrong endpoint list or
    /// certificate fails here rather than at the first decision.
    pub fn connect(settings: &EtcdSettings) -> Result<Etcd, EtcdError> {
        let op = "connect";
        // Blocking on the runtime below would panic inside another one.
        refuse_inside_runtime(op)?;
        settings.validate()?;
        let tls = settings.is_https();
        // Leaves time to try every member within one call's timeout.
        let count = u32::try_from(settings.endpoints.len()).unwrap_or(u32::MAX);
        let connect_timeout = (settings.timeout / count).max(Duration::from_millis(100));
        let mut options = ConnectOptions::new()
            .with_connect_timeout(connect_timeout)
            // HTTP/2 pings on connections with open streams (renewals):
            // a member whose host vanished without closing them is noticed.
            // etcd answers pings more often than every 5 s, or without a
            // stream, by closing the connection, hence the interval and no
            // idle pings.
            .with_keep_alive(KEEPALIVE_INTERVAL, settings.timeout)
            // A member cut off from the others refuses ("no leader") once
            // it notices, instead of holding the call: the next member is
            // tried, and a write refused so is known not to have landed.
            .with_require_leader(true);
        if tls {
            let mut tls = TlsOptions::new();
            if let Some(ca) = &settings.ca {
                tls = tls.ca_certificate(Certificate::from_pem(read_tls(CA_KEY, ca)?));
            }
            if let (Some(cert), Some(key)) = (&settings.cert, &settings.key) {
                tls = tls.identity(Identity::from_pem(
                    read_tls(CERT_KEY, cert)?,
                    read_tls(KEY_KEY, key)?,
                ));
            }
            options = options.with_tls(tls);
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(EtcdError::Runtime)?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("etcd-client".into())
            .spawn(move || {
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })
            .map_err(EtcdError::Runtime)?;
        let driver = Some(Driver { stop, thread });
        let endpoints = settings.endpoints.join(",");
        let mut members = Vec::with_capacity(settings.endpoints.len());
        for endpoint in &settings.endpoints {
            // Connects lazily: nothing goes over the network here.
            let client = handle
                .block_on(Client::connect([endpoint], Some(options.clone())))
                .map_err(|e| EtcdError::Settings {
                    field: ENDPOINTS_KEY,
                    problem: format!("{endpoint:?} is refused by the etcd client: {}", detail(&e)),
                })?;
            members.push(Member {
                endpoint: endpoint.clone(),
                kv: client.kv_client().max_decoding_message_size(MAX_RESPONSE),
                client,
            });
        }
        let etcd = Etcd {
            handle,
            driver,
            members,
            current: AtomicUsize::new(0),
            prefix: settings.prefix.clone(),
            timeout: settings.timeout,
            endpoints,
            tls,
            keepers: Mutex::new(HashMap::new()),
        };
        // A linearizable read needs a quorum behind the member answering.
        let key = etcd.prefix.clone();
        etcd.call(op, Retry::Unreachable, |m| {
            let mut kv = m.kv.clone();
            let key = key.clone();
            async move {
                kv.get(key, Some(GetOptions::new().with_prefix().with_count_only()))
                    .await
            }
        })?;
        Ok(etcd)
    }

    /// Runs `attempt` against one member after another, starting with the
    /// last one that answered, until one answers or `retry` forbids going
    /// on; all within the timeout.
    fn call<T, Fut>(
        &self,
        op: &'static str,
        retry: Retry,
        attempt: impl FnMut(&Member) -> Fut,
    ) -> Result<T, EtcdError>
    where
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        refuse_inside_runtime(op)?;
        let deadline = tokio::time::Instant::now() + self.timeout;
        self.handle
            .block_on(self.failover(op, retry, deadline, attempt))
    }

    /// [`Etcd::call`]'s loop, inside the runtime.
    async fn failover<T, Fut>(
        &self,
        op: &'static str,
        retry: Retry,
        deadline: tokio::time::Instant,
        mut attempt: impl FnMut(&Member) -> Fut,
    ) -> Result<T, EtcdError>
    where
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let n = self.members.len();
        let first = self.current.load(Ordering::Relaxed) % n;
        let mut failures = Vec::new();
        for k in 0..n {
            let i = (first + k) % n;
            let member = &self.members[i];
            let result = match tokio::time::timeout_at(deadline, attempt(member)).await {
                Ok(result) => result,
                Err(_) => return Err(self.timed_out(op, failures)),
            };
            let e = match result {
                Ok(value) => {
                    self.current.store(i, Ordering::Relaxed);
                    return Ok(value);
                }
                Err(e) => e,
            };
            let may_go_on = match retry {
                Retry::Unreachable => unreachable(&e),
                Retry::NotSent => not_sent(&e),
            };
            if may_go_on {
                failures.push(format!("{}: {}", member.endpoint, detail(&e)));
                continue;
            }
            if unreachable(&e) {
                // Retry::NotSent, and it may have reached etcd.
                return Err(EtcdError::Indeterminate {
                    op,
                    endpoint: member.endpoint.clone(),
                    detail: detail(&e),
                });
            }
            return Err(self.refused(op, &member.endpoint, e));
        }
        Err(EtcdError::Unavailable {
            op,
            endpoints: self.endpoints.clone(),
            detail: failures.join("; "),
            tls: self.tls,
        })
    }

    fn timed_out(&self, op: &'static str, failures: Vec<String>) -> EtcdError {
        EtcdError::Timeout {
            op,
            endpoints: self.endpoints.clone(),
            after: self.timeout,
            earlier: failures.join("; "),
        }
    }

    fn refused(&self, op: &'static str, endpoint: &str, e: etcd_client::Error) -> EtcdError {
        match e {
            etcd_client::Error::GRpcStatus(status) => EtcdError::Status {
                op,
                endpoint: endpoint.to_string(),
                code: format!("{:?}", status.code()),
                message: status.message().to_string(),
            },
            other => EtcdError::Client {
                op,
                endpoint: endpoint.to_string(),
                detail: detail(&other),
            },
        }
    }

    fn full(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// Every key under `prefix` (relative to the settings' prefix), read
    /// linearizably, and the revision of that read.
    pub fn range_prefix(&self, prefix: &str) -> Result<Range, EtcdError> {
        let op = "range";
        let full = self.full(prefix);
        let mut resp = self.call(op, Retry::Unreachable, |m| {
            let mut kv = m.kv.clone();
            let full = full.clone();
            async move { kv.get(full, Some(GetOptions::new().with_prefix())).await }
        })?;
        let revision = header_revision(op, resp.header())?;
        let kvs = resp
            .take_kvs()
            .into_iter()
            .map(|kv| {
                let key = self.relative(op, kv.key())?;
                Ok(Kv {
                    key,
                    mod_revision: kv.mod_revision(),
                    create_revision: kv.create_revision(),
                    lease: (kv.lease() != 0).then_some(LeaseId(kv.lease())),
                    value: kv.into_key_value().1,
                })
            })
            .collect::<Result<_, EtcdError>>()?;
        Ok(Range { kvs, revision })
    }

    fn relative(&self, op: &'static str, key: &[u8]) -> Result<String, EtcdError> {
        let key = std::str::from_utf8(key).map_err(|_| EtcdError::Unexpected {
            op,
            detail: format!("a key that is not UTF-8: {}", String::from_utf8_lossy(key)),
        })?;
        key.strip_prefix(&self.prefix)
            .map(str::to_string)
            .ok_or_else(|| EtcdError::Unexpected {
                op,
                detail: format!("key {key:?} is outside the prefix {:?}", self.prefix),
            })
    }

    /// If every compare holds, runs `success`, else `failure`, atomically.
    ///
    /// After [`EtcdError::Indeterminate`] or [`EtcdError::Timeout`] the
    /// transaction may or may not have been applied: read again before
    /// deciding again.
    pub fn txn(
        &self,
        compares: &[Compare],
        success: &[Op],
        failure: &[Op],
    ) -> Result<TxnOutcome, EtcdError> {
        let op = "txn";
        let txn = Txn::new()
            .when(compares.iter().map(|c| self.compare(c)).collect::<Vec<_>>())
            .and_then(success.iter().map(|o| self.op(o)).collect::<Vec<_>>())
            .or_else(failure.iter().map(|o| self.op(o)).collect::<Vec<_>>());
        let resp = self.call(op, Retry::NotSent, |m| {
            let mut kv = m.kv.clone();
            let txn = txn.clone();
            async move { kv.txn(txn).await }
        })?;
        Ok(TxnOutcome {
            succeeded: resp.succeeded(),
            revision: header_revision(op, resp.header())?,
        })
    }

    fn compare(&self, c: &Compare) -> EtcdCompare {
        match c {
            Compare::ModRevision { key, revision } => {
                EtcdCompare::mod_revision(self.full(key), CompareOp::Equal, *revision)
            }
            Compare::CreateRevision { key, revision } => {
                EtcdCompare::create_revision(self.full(key), CompareOp::Equal, *revision)
            }
            Compare::Value { key, value } => {
                EtcdCompare::value(self.full(key), CompareOp::Equal, value.clone())
            }
        }
    }

    fn op(&self, o: &Op) -> TxnOp {
        match o {
            Op::Put { key, value, lease } => TxnOp::put(
                self.full(key),
                value.clone(),
                lease.map(|l| PutOptions::new().with_lease(l.0)),
            ),
            Op::Delete { key } => TxnOp::delete(self.full(key), None),
            Op::DeletePrefix { prefix } => {
                TxnOp::delete(self.full(prefix), Some(DeleteOptions::new().with_prefix()))
            }
        }
    }

    /// Grants a lease of at least `ttl` (whole seconds, rounded up).
    pub fn grant(&self, ttl: Duration) -> Result<Lease, EtcdError> {
        let op = "lease grant";
        let secs = i64::try_from(ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0))
            .unwrap_or(i64::MAX)
            .max(1);
        // Repeating a grant whose answer was lost leaves a lease nobody
        // renews, which expires on its own.
        let resp = self.call(op, Retry::Unreachable, |m| {
            let mut lease = m.client.lease_client();
            async move { lease.grant(secs, None).await }
        })?;
        if resp.ttl() <= 0 {
            return Err(EtcdError::Unexpected {
                op,
                detail: format!("granted TTL {}", resp.ttl()),
            });
        }
        Ok(Lease {
            id: LeaseId(resp.id()),
            ttl: Duration::from_secs(resp.ttl().unsigned_abs()),
        })
    }

    /// Renews `lease`: its TTL as renewed, or `None` when it has expired or
    /// was revoked (its keys are gone).
    pub fn keep_alive(&self, lease: LeaseId) -> Result<Option<Duration>, EtcdError> {
        let op = "lease keep-alive";
        refuse_inside_runtime(op)?;
        // Taken out while in use, so the lock is never held across a call.
        let open = self
            .keepers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&lease);
        let deadline = tokio::time::Instant::now() + self.timeout;
        let renewed = self.handle.block_on(async {
            if let Some(mut open) = open {
                match tokio::time::timeout_at(deadline, renew(&mut open)).await {
                    Err(_) => return Err(self.timed_out(op, Vec::new())),
                    Ok(Ok(Some(ttl))) => return Ok(Some((ttl, open))),
                    Ok(Ok(None)) => return Ok(None),
                    // The stream broke (its member died, say): a new one,
                    // on whichever member answers.
                    Ok(Err(_)) => {}
                }
            }
            self.failover(op, Retry::Unreachable, deadline, |m| {
                let mut client = m.client.lease_client();
                async move {
                    let (keeper, stream) = match client.keep_alive(lease.0).await {
                        Ok(pair) => pair,
                        // etcd-client's own check of the first answer.
                        Err(etcd_client::Error::LeaseKeepAliveError(m))
                            if m.contains("not found") =>
                        {
                            return Ok(None);
                        }
                        Err(e) => return Err(e),
                    };
                    // Opening renewed it already, but its answer was
                    // consumed there: renew once more to learn the TTL.
                    let mut open = Keeper { keeper, stream };
                    Ok(renew(&mut open).await?.map(|ttl| (ttl, open)))
                }
            })
            .await
        })?;
        Ok(renewed.map(|(ttl, open)| {
            self.keepers
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .insert(lease, open);
            ttl
        }))
    }

    /// Ends `lease` now, deleting its keys; a lease already gone is not an
    /// error.
    pub fn revoke(&self, lease: LeaseId) -> Result<(), EtcdError> {
        self.keepers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&lease);
        let revoked = self.call("lease revoke", Retry::Unreachable, |m| {
            let mut client = m.client.lease_client();
            async move { client.revoke(lease.0).await }
        });
        match revoked {
            Ok(_) => Ok(()),
            Err(EtcdError::Status { code, .. }) if code == "NotFound" => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// What remains of `lease`'s TTL, or `None` when it is gone.
    pub fn time_to_live(&self, lease: LeaseId) -> Result<Option<Duration>, EtcdError> {
        let resp = self.call("lease time-to-live", Retry::Unreachable, |m| {
            let mut client = m.client.lease_client();
            async move { client.time_to_live(lease.0, None).await }
        })?;
        // etcd answers TTL -1 for a lease it does not know.
        Ok((resp.ttl() >= 0).then(|| Duration::from_secs(resp.ttl().unsigned_abs())))
    }

    /// Takes the leader key `key` for `holder` under `lease` if nobody holds
    /// it, in one transaction; otherwise says who does. Calling it again
    /// while holding the key answers [`Lead::Held`] with the same revision.
    pub fn try_lead(&self, key: &str, holder: &str, lease: LeaseId) -> Result<Lead, EtcdError> {
        let op = "leader txn";
        let full = self.full(key);
        let txn = Txn::new()
            .when([EtcdCompare::create_revision(
                full.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then([TxnOp::put(
                full.clone(),
                holder,
                Some(PutOptions::new().with_lease(lease.0)),
            )])
            .or_else([TxnOp::get(full, None)]);
        let resp = self.call(op, Retry::NotSent, |m| {
            let mut kv = m.kv.clone();
            let txn = txn.clone();
            async move { kv.txn(txn).await }
        })?;
        let revision = header_revision(op, resp.header())?;
        if resp.succeeded() {
            return Ok(Lead::Held { revision });
        }
        let current = resp.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(mut get) => get.take_kvs().into_iter().next(),
            _ => None,
        });
        let Some(current) = current else {
            return Err(EtcdError::Unexpected {
                op,
                detail: format!("leader key {key:?} exists but its read came back empty"),
            });
        };
        let revision = current.create_revision();
        let mine = current.lease() == lease.0 && current.value() == holder.as_bytes();
        Ok(if mine {
            Lead::Held { revision }
        } else {
            Lead::Other {
                holder: String::from_utf8_lossy(current.value()).into_owned(),
                revision,
            }
        })
    }
}

/// One renewal on an open stream: the TTL, `None` when the lease is gone,
/// an error when the stream broke.
async fn renew(open: &mut Keeper) -> Result<Option<Duration>, etcd_client::Error> {
    open.keeper.keep_alive().await?;
    match open.stream.message().await? {
        Some(resp) if resp.ttl() > 0 => Ok(Some(Duration::from_secs(resp.ttl().unsigned_abs()))),
        Some(_) => Ok(None),
        None => Err(etcd_client::Error::LeaseKeepAliveError(
            "the keep-alive stream ended".into(),
        )),
    }
}

fn header_revision(
    op: &'static str,
    header: Option<&etcd_client::ResponseHeader>,
) -> Result<i64, EtcdError> {
    header
        .map(|h| h.revision())
        .ok_or_else(|| EtcdError::Unexpected {
            op,
            detail: "an answer without a header".into(),
        })
}

fn refuse_inside_runtime(op: &'static str) -> Result<(), EtcdError> {
    match tokio::runtime::Handle::try_current() {
        Ok(_) => Err(EtcdError::InsideRuntime { op }),
        Err(_) => Ok(()),
    }
}

/// The member could not be reached or could not answer (as opposed to
/// etcd refusing the request).
fn unreachable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => matches!(
            status.code(),
            // Cancelled and DeadlineExceeded also come from the transport's
            // own timeouts; Unknown carries "service was not ready".
            tonic::Code::Unavailable
                | tonic::Code::Cancelled
                | tonic::Code::DeadlineExceeded
                | tonic::Code::Unknown
        ),
        etcd_client::Error::TransportError(_)
        | etcd_client::Error::IoError(_)
        | etcd_client::Error::LeaseKeepAliveError(_) => true,
        _ => false,
    }
}

/// The errors under `e`: etcd-client's own error does not expose them.
fn causes(e: &etcd_client::Error) -> Option<&(dyn std::error::Error + 'static)> {
    match e {
        etcd_client::Error::GRpcStatus(status) => std::error::Error::source(status),
        etcd_client::Error::TransportError(t) => std::error::Error::source(t),
        etcd_client::Error::IoError(io) => std::error::Error::source(io),
        _ => None,
    }
}

/// The request provably never reached etcd's state machine: the connection
/// (TCP or TLS) could not be made, or the member had no leader and refused
/// it before proposing anything.
fn not_sent(e: &etcd_client::Error) -> bool {
    if let etcd_client::Error::GRpcStatus(status) = e {
        if status.code() == tonic::Code::Unavailable && status.message().contains("no leader") {
            return true;
        }
    }
    let mut next = causes(e);
    while let Some(err) = next {
        if err.downcast_ref::<tonic::ConnectError>().is_some() {
            return true;
        }
        next = err.source();
    }
    false
}

/// What went wrong, for a person: gRPC's code and message, then the causes
/// under it (tonic's own messages are often just "transport error").
fn detail(e: &etcd_client::Error) -> String {
    let mut text = match e {
        etcd_client::Error::GRpcStatus(status) => {
            format!("{:?}: {}", status.code(), status.message())
        }
        other => other.to_string(),
    };
    let mut next = causes(e);
    while let Some(cause) = next {
        let s = cause.to_string();
        if s != "transport error" && !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        next = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> EtcdSettings {
        EtcdSettings {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            ca: None,
            cert: None,
            key: None,
            prefix: "/keel/".into(),
            timeout: Duration::from_secs(2),
        }
    }

    fn problem(s: &EtcdSettings) -> String {
        s.validate().expect_err("invalid settings").to_string()
    }

    #[test]
    fn plain_and_tls_settings_validate() {
        settings().validate().expect("plain");
        let tls = EtcdSettings {
            endpoints: vec![
                "https://10.0.0.1:2379".into(),
                "https://etcd-2.example.org:2379".into(),
                "https://[fd00::3]:2379".into(),
            ],
            ca: Some("/etc/keel/etcd-ca.pem".into()),
            cert: Some("/etc/keel/etcd.pem".into()),
            key: Some("/etc/keel/etcd.key".into()),
            ..settings()
        };
        tls.validate().expect("tls");
    }

    #[test]
    fn each_bad_setting_names_its_field() {
        let cases: Vec<(EtcdSettings, &str, &str)> = vec![
            (
                EtcdSettings {
                    endpoints: vec![],
                    ..settings()
                },
                "controlplane.etcd_endpoints is empty",
                "http://127.0.0.1:2379",
            ),
            (
                EtcdSettings {
                    endpoints: vec!["127.0.0.1:2379".into()],
                    ..settings()
                },
                "controlplane.etcd_endpoints \"127.0.0.1:2379\"",
                "not http://host:port",
            ),
            (
                EtcdSettings {
                    endpoints: vec!["http://127.0.0.1".into()],
                    ..settings()
                },
                "controlplane.etcd_endpoints \"http://127.0.0.1\"",
                "no port",
            ),
            (
                EtcdSettings {
                    endpoints: vec!["http://127.0.0.1:99999".into()],
                    ..settings()
                },
                "controlplane.etcd_endpoints",
                "port \"99999\" is not a number",
            ),
            (
                EtcdSettings {
                    endpoints: vec!["http://127.0.0.1:2379/v3".into()],
                    ..settings()
                },
                "controlplane.etcd_endpoints",
                "is not a number",
            ),
            (
                EtcdSettings {
                    endpoints: vec!["http://fd00::1:2379".into()],
                    ..settings()
                },
                "controlplane.etcd_endpoints",
                "[address]:port",
            ),
            (
                EtcdSettings {
                    endpoints: vec!["http://user@etcd:2379".into()],
                    ..settings()
                },
                "controlplane.etcd_endpoints",
                "no user, path or query",
            ),
            (
                EtcdSettings {
                    endpoints: vec!["http://a:2379".into(), "https://b:2379".into()],
                    ca: Some("/ca.pem".into()),
                    ..settings()
                },
                "controlplane.etcd_endpoints mixes",
                "one cluster",
            ),
            (
                EtcdSettings {
                    endpoints: vec!["https://a:2379".into()],
                    ca: Some("/ca.pem".into()),
                    cert: Some("/c.pem".into()),
                    ..settings()
                },
                "controlplane.etcd_cert is set without controlplane.etcd_key",
                "key",
            ),
            (
                EtcdSettings {
                    endpoints: vec!["https://a:2379".into()],
                    ca: Some("/ca.pem".into()),
                    key: Some("/c.key".into()),
                    ..settings()
                },
                "controlplane.etcd_key is set without controlplane.etcd_cert",
                "certificate",
            ),
            (
                EtcdSettings {
                    ca: Some("/ca.pem".into()),
                    ..settings()
                },
                "controlplane.etcd_ca is set but controlplane.etcd_endpoints are http://",
                "use https://",
            ),
            (
                EtcdSettings {
                    endpoints: vec!["https://a:2379".into()],
                    ..settings()
                },
                "controlplane.etcd_ca is required with https://",
                "CA certificate",
            ),
            (
                EtcdSettings {
                    prefix: "/keel".into(),
                    ..settings()
                },
                "controlplane.etcd_prefix \"/keel\" must be non-empty and end in '/'",
                "\"/keel/\"",
            ),
            (
                EtcdSettings {
                    prefix: String::new(),
                    ..settings()
                },
                "controlplane.etcd_prefix",
                "end in '/'",
            ),
            (
                EtcdSettings {
                    timeout: Duration::ZERO,
                    ..settings()
                },
                "controlplane.etcd_timeout is zero",
                "a few seconds",
            ),
        ];
        for (s, starts, mentions) in cases {
            let msg = problem(&s);
            assert!(
                msg.starts_with(starts),
                "{msg:?} should start with {starts:?}"
            );
            assert!(
                msg.contains(mentions),
                "{msg:?} should mention {mentions:?}"
            );
        }
    }

    #[test]
    fn unreachable_and_timeout_messages_say_what_to_check() {
        let unavailable = EtcdError::Unavailable {
            op: "txn",
            endpoints: "http://10.0.0.1:2379,http://10.0.0.2:2379".into(),
            detail: "http://10.0.0.1:2379: Unavailable: tcp connect error: Connection refused \
                     (os error 111); http://10.0.0.2:2379: Unavailable: etcdserver: no leader"
                .into(),
            tls: false,
        }
        .to_string();
        for part in [
            "etcd txn failed on every member",
            "etcdserver: no leader",
            "http://10.0.0.1:2379,http://10.0.0.2:2379",
            "Connection refused",
            "is etcd running at",
            "check controlplane.etcd_endpoints",
        ] {
            assert!(unavailable.contains(part), "{unavailable:?} lacks {part:?}");
        }
        assert!(!unavailable.contains("etcd_ca"), "{unavailable:?}");
        let tls = EtcdError::Unavailable {
            op: "connect",
            endpoints: "https://10.0.0.1:2379".into(),
            detail: "invalid peer certificate: UnknownIssuer".into(),
            tls: true,
        }
        .to_string();
        assert!(
            tls.contains("chain to controlplane.etcd_ca") && tls.contains("etcd_cert"),
            "{tls:?}"
        );
        let timeout = EtcdError::Timeout {
            op: "range",
            endpoints: "http://10.0.0.1:2379".into(),
            after: Duration::from_secs(2),
            earlier: String::new(),
        }
        .to_string();
        assert!(
            timeout.contains("etcd range got no answer from http://10.0.0.1:2379 within 2s")
                && timeout.contains("check controlplane.etcd_endpoints")
                && timeout.contains("controlplane.etcd_timeout"),
            "{timeout:?}"
        );
    }

    #[test]
    fn refusals_carry_etcds_status_and_a_hint() {
        let denied = EtcdError::Status {
            op: "txn",
            endpoint: "https://a:2379".into(),
            code: "PermissionDenied".into(),
            message: "etcdserver: permission denied".into(),
        }
        .to_string();
        assert!(
            denied.starts_with("etcd at https://a:2379 refused txn: PermissionDenied: etcdserver: permission denied")
                && denied.contains("controlplane.etcd_cert"),
            "{denied:?}"
        );
        let client = EtcdError::Client {
            op: "txn",
            endpoint: "http://a:2379".into(),
            detail: "invalid arguments: empty key".into(),
        }
        .to_string();
        assert!(
            client.starts_with("the etcd client refused to send txn to http://a:2379")
                && client.contains("a bug in keel"),
            "{client:?}"
        );
        let file = EtcdError::TlsFile {
            field: "controlplane.etcd_ca",
            path: "/nonexistent/ca.pem".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        }
        .to_string();
        assert!(
            file.starts_with("cannot read /nonexistent/ca.pem (controlplane.etcd_ca)"),
            "{file:?}"
        );
    }

    #[test]
    fn connect_reads_the_tls_files_before_any_network() {
        let s = EtcdSettings {
            endpoints: vec!["https://127.0.0.1:1".into()],
            ca: Some("/nonexistent/keel-etcd-ca.pem".into()),
            ..settings()
        };
        match Etcd::connect(&s) {
            Err(EtcdError::TlsFile { field, path, .. }) => {
                assert_eq!(field, "controlplane.etcd_ca");
                assert_eq!(path, PathBuf::from("/nonexistent/keel-etcd-ca.pem"));
            }
            other => panic!("expected a TLS file error, got {other:?}"),
        }
    }

    #[test]
    fn a_call_inside_a_runtime_is_refused_not_blocked() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let err = rt
            .block_on(async { Etcd::connect(&settings()) })
            .expect_err("refused inside a runtime");
        assert!(
            matches!(err, EtcdError::InsideRuntime { op: "connect" }),
            "{err:?}"
        );
    }

    #[test]
    fn only_failures_that_never_reached_etcd_let_a_write_go_to_the_next_member() {
        let status = |s: tonic::Status| etcd_client::Error::GRpcStatus(s);
        let refused = status(tonic::Status::from_error(Box::new(tonic::ConnectError(
            Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
        ))));
        assert!(not_sent(&refused) && unreachable(&refused));
        let no_leader = status(tonic::Status::unavailable("etcdserver: no leader"));
        assert!(not_sent(&no_leader) && unreachable(&no_leader));
        // Broken mid-request or timed out inside etcd: it may have landed.
        for maybe_landed in [
            status(tonic::Status::unavailable(
                "error reading a body from connection",
            )),
            status(tonic::Status::deadline_exceeded(
                "etcdserver: request timed out",
            )),
            status(tonic::Status::cancelled("Timeout expired")),
        ] {
            assert!(!not_sent(&maybe_landed), "{maybe_landed}");
            assert!(unreachable(&maybe_landed), "{maybe_landed}");
        }
        // etcd said no: neither retried nor reported as unreachable.
        let denied = status(tonic::Status::permission_denied(
            "etcdserver: permission denied",
        ));
        assert!(!not_sent(&denied) && !unreachable(&denied));
        assert!(
            detail(&refused).starts_with("Unavailable: ")
                && detail(&refused).contains("connection refused"),
            "{}",
            detail(&refused)
        );
    }

    #[test]
    fn an_interrupted_write_says_to_read_again() {
        let msg = EtcdError::Indeterminate {
            op: "txn",
            endpoint: "http://10.0.0.1:2379".into(),
            detail: "Unavailable: connection reset".into(),
        }
        .to_string();
        assert!(
            msg.starts_with("etcd txn at http://10.0.0.1:2379 broke off before its answer")
                && msg.contains("may or may not have been applied")
                && msg.contains("read the state again"),
            "{msg:?}"
        );
    }

    #[test]
    fn lease_ids_print_as_etcdctl_does() {
        assert_eq!(
            LeaseId(0x694d_7d1b_a2c3_0e0a).to_string(),
            "694d7d1ba2c30e0a"
        );
    }
}
