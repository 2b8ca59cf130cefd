//! Signed requests: the `Keel-HMAC-SHA256` authorization scheme every TCP
//! listener (control plane, clustered agent) demands, the key files it reads,
//! and the two key roles.
//!
//! This module owns key files (loading with their mode and owner checked,
//! generating new ones), the signature's canonical form, signing, and
//! verification with clock-skew and replay checks. It must never write a
//! secret, or a signature it computed for comparison, into an error, a log
//! line or a `Debug` string; the only place a secret leaves memory is
//! [`write_key_file`]. It does not route: the daemons decide which [`Role`]
//! each route requires. The Unix socket is not signed (file mode and group
//! guard it).
//!
//! # Wire format (for other implementations)
//!
//! A signed request carries one header field:
//!
//! ```text
//! Authorization: Keel-HMAC-SHA256 key=<id>, ts=<unix seconds>, nonce=<32 hex>, sig=<64 hex>
//! ```
//!
//! - The scheme is exactly `Keel-HMAC-SHA256` (case-sensitive), then at least
//!   one space or tab, then the four parameters `key`, `ts`, `nonce` and `sig`
//!   separated by commas, each exactly once, in any order. Spaces and tabs
//!   around a comma are ignored; nothing else is (no quotes, no empty
//!   parameter, no trailing comma, no unknown parameter). The whole value is
//!   at most [`MAX_HEADER_LEN`] bytes. A request with two `Authorization`
//!   fields is refused.
//! - `key`: the key id, 1 to 64 characters from `A-Z a-z 0-9 . _ -`.
//! - `ts`: the signer's clock in Unix seconds, decimal, no sign, no leading zero.
//! - `nonce`: 16 random bytes in lowercase hex, fresh for every request.
//! - `sig`: lowercase hex of HMAC-SHA256(secret, canonical), where the secret is
//!   the 32 bytes of the key file and `canonical` is the UTF-8 string
//!
//! ```text
//! METHOD "\n" PATH_AND_QUERY "\n" TS "\n" NONCE "\n" BODY_SHA256
//! ```
//!
//!   with no trailing newline: `METHOD` as sent (`PUT`); `PATH_AND_QUERY` the
//!   request target exactly as sent, query included (`/jails/web?dry=1`);
//!   `TS` and `NONCE` exactly as in the header; `BODY_SHA256` the lowercase
//!   hex SHA-256 of the body bytes (of the empty string when there is no
//!   body). The `Host` header is not signed. [`canonical_string`] builds it;
//!   docs/security.md has a test vector.
//!
//! # Verification
//!
//! [`Verifier::verify`] checks, in this order: the header parses
//! ([`AuthError::Malformed`]), the key id is known ([`AuthError::UnknownKey`]),
//! the signature matches, compared in constant time
//! ([`AuthError::BadSignature`]), `|now - ts| <= max_skew`
//! ([`AuthError::Stale`]), `ts` is not earlier than the daemon's start
//! ([`AuthError::SignedBeforeStart`], see below), the key's role is the one the route requires
//! ([`AuthError::WrongRole`]), and the `(ts, nonce)` pair was not accepted
//! before ([`AuthError::Replayed`]). The signature comes before every check
//! that could tell an unauthenticated sender something; the nonce is recorded
//! only for a request that passed everything, so forged requests cannot fill
//! the replay cache.
//!
//! The replay cache keys on `(ts, nonce)`: a replay is the same signed header,
//! and changing either value needs the secret. Entries are evicted once their
//! `ts` falls out of the skew window, because such a request is refused as
//! stale anyway. The cache is also capped ([`DEFAULT_NONCE_CAPACITY`]): when
//! full, new requests are refused ([`AuthError::ReplayCacheFull`], a 503)
//! instead of evicting live entries (which would reopen replays) or growing
//! without bound (which lets any key holder exhaust the daemon's memory).
//!
//! The cache lives in memory, so a restarted daemon has forgotten it. What
//! stops a replay across a restart is [`Verifier::with_not_before`]: the
//! daemon, holding its state-directory lock (so the previous process is
//! gone), waits for the next whole second before it listens and refuses any
//! `ts` earlier than that second ([`crate::common::replay_floor::start`]). Every request
//! the previous process accepted carries a `ts` it could check against its
//! own clock. A request dated ahead of the clock (its signer's clock runs
//! fast) could still be dated after the restart, so its `ts` is recorded in
//! the state directory before it is acted on
//! ([`Verifier::with_replay_floor`]) and the next daemon's floor starts
//! above it. docs/security.md (replay) has the
//! whole argument and what a signer whose clock is behind sees.
//!
//! # Keys
//!
//! One key per file, TOML with exactly two string keys:
//!
//! ```toml
//! id = "ops-2026-11"
//! secret = "<64 hex digits: 32 random bytes>"
//! ```
//!
//! The role is not in the file: it is the list the file is named in
//! (`[auth] node_keys` or `operator_keys`). [`load_key`] refuses a file whose
//! mode grants any group or other permission, and one not owned by the owner
//! [`KeyFilePolicy`] expects (root for a daemon running as root, else the
//! current user).

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::common::http::{Request, Response};
use crate::common::refusals::{DEFAULT_SUMMARY_INTERVAL, RefusalLog};
use crate::common::replay_floor::{FloorError, ReplayFloor};
use crate::common::sync::lock;

/// The authorization scheme name.
pub const SCHEME: &str = "Keel-HMAC-SHA256";
/// Largest accepted `Authorization` value; a real one is about 170 bytes.
pub const MAX_HEADER_LEN: usize = 512;
/// Longest key id.
pub const MAX_KEY_ID_LEN: usize = 64;
/// Bytes of a key's secret (HMAC-SHA256's block-size-friendly 256 bits).
pub const SECRET_LEN: usize = 32;
/// Bytes of a request nonce.
pub const NONCE_LEN: usize = 16;
/// Bytes of a signature (SHA-256 output).
pub const SIG_LEN: usize = 32;
/// Default largest accepted difference between a request's `ts` and the clock
/// (`[auth] max_clock_skew`).
pub const DEFAULT_MAX_SKEW: Duration = Duration::from_secs(300);
/// Default bound on remembered nonces. At 1,000 signed requests per second
/// the cache holds about 300,000 entries (300 s window); a million is room for
/// bursts at roughly 40 bytes an entry, about 40 MiB at worst.
pub const DEFAULT_NONCE_CAPACITY: usize = 1_000_000;
/// Largest key file read; a real one is under 200 bytes.
const MAX_KEY_FILE_LEN: u64 = 4096;

type HmacSha256 = Hmac<Sha256>;

/// Which set a key belongs to, and so what its holder may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Agents and the control plane talking to each other: register,
    /// heartbeat, and the control plane's forwarded requests to an agent.
    Node,
    /// `keelctl` talking to the control plane: apply, get and delete.
    Operator,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Node => "node",
            Role::Operator => "operator",
        })
    }
}

/// Everything that can go wrong loading keys, signing or verifying. No
/// variant carries a secret or a computed signature, so every one may be
/// logged and sent back to the client.
#[derive(Debug)]
pub enum AuthError {
    /// The request has no `Authorization` header.
    Missing,
    /// The `Authorization` value (or the request line it signs) does not
    /// follow the scheme.
    Malformed {
        /// What is wrong, in words; never an echo of the value.
        reason: String,
    },
    /// No accepted key has this id.
    UnknownKey {
        /// The id the request named.
        key_id: String,
    },
    /// The signature does not match the request.
    BadSignature {
        /// The id the request named.
        key_id: String,
    },
    /// The timestamp is too far from this host's clock.
    Stale {
        /// The request's timestamp.
        ts: u64,
        /// This host's clock.
        now: u64,
        /// The accepted difference, in seconds.
        max_skew_secs: u64,
    },
    /// The key is valid but its role may not use this route.
    WrongRole {
        /// The key's id.
        key_id: String,
        /// The key's role.
        role: Role,
        /// The role the route requires.
        required: Role,
    },
    /// The request was signed before this daemon started, so an earlier
    /// process may have accepted it already.
    SignedBeforeStart {
        /// The request's timestamp.
        ts: u64,
        /// The first timestamp this daemon accepts: its start, or one past
        /// the highest its predecessor accepted ahead of its clock.
        started: u64,
    },
    /// The request's timestamp, ahead of this host's clock, could not be
    /// recorded for the next daemon (see [`Verifier::with_replay_floor`]);
    /// the request was refused.
    RecordFloor(FloorError),
    /// The same signed request was already accepted.
    Replayed {
        /// The id the request named.
        key_id: String,
    },
    /// The replay cache is full; the request was not checked for replay and
    /// is refused.
    ReplayCacheFull {
        /// The cache's bound.
        capacity: usize,
    },
    /// A key id is not usable (empty, too long, or a character outside the set).
    InvalidKeyId {
        /// The id as given.
        id: String,
    },
    /// A key file could not be opened, read or written.
    KeyFileIo {
        /// The file.
        path: PathBuf,
        /// What was being done: "open", "read", "create", ...
        action: &'static str,
        /// The operating system's reason.
        source: io::Error,
    },
    /// A key file is not a regular file.
    KeyFileNotRegular {
        /// The path.
        path: PathBuf,
    },
    /// A key file grants group or other permissions.
    KeyFileMode {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A key file is owned by someone other than the expected owner.
    KeyFileOwner {
        /// The file.
        path: PathBuf,
        /// Its owner's uid.
        owner: u32,
        /// The uid required.
        expected: u32,
    },
    /// A key file's content is not a Keel key.
    KeyFileFormat {
        /// The file.
        path: PathBuf,
        /// What is wrong; never the secret or the line holding it.
        reason: String,
    },
    /// [`write_key_file`] found something at the path already.
    KeyFileExists {
        /// The path.
        path: PathBuf,
    },
    /// Two accepted keys share an id, so a signature could not say which to use.
    DuplicateKeyId {
        /// The id.
        id: String,
        /// Where the first key came from.
        first: String,
        /// Where the second key came from.
        second: String,
    },
    /// Two accepted keys share a secret: whoever holds one could sign as the
    /// other, e.g. a node key as an operator key.
    SharedSecret {
        /// The first key's id.
        first: String,
        /// The second key's id.
        second: String,
    },
    /// The operating system's random number generator failed.
    Random {
        /// Its reason.
        reason: String,
    },
}

impl AuthError {
    /// The HTTP status a refusal answers with: 401 for a request that is not
    /// authenticated or not allowed, 503 when the replay cache is full (the
    /// request may be fine; retry later), 500 for local key problems.
    pub fn status(&self) -> u16 {
        match self {
            AuthError::Missing
            | AuthError::Malformed { .. }
            | AuthError::UnknownKey { .. }
            | AuthError::BadSignature { .. }
            | AuthError::Stale { .. }
            | AuthError::WrongRole { .. }
            | AuthError::SignedBeforeStart { .. }
            | AuthError::Replayed { .. } => 401,
            AuthError::ReplayCacheFull { .. } | AuthError::RecordFloor(_) => 503,
            _ => 500,
        }
    }
}

impl fmt::Display for AuthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuthError::Missing => write!(
                f,
                "missing Authorization header: requests on this listener must be signed \
                 ({SCHEME}, see docs/security.md)"
            ),
            AuthError::Malformed { reason } => {
                write!(f, "malformed {SCHEME} authorization: {reason}")
            }
            AuthError::UnknownKey { key_id } => write!(
                f,
                "unknown key id {key_id:?}: it is in none of the accepted key files; add \
                 its file to [auth] on the receiving daemon and restart it"
            ),
            AuthError::BadSignature { key_id } => write!(
                f,
                "bad signature for key id {key_id:?}: the request was altered in transit, or \
                 the signer's secret differs from the receiver's file of the same id"
            ),
            AuthError::Stale {
                ts,
                now,
                max_skew_secs,
            } => write!(
                f,
                "stale request: its timestamp {ts} is {} s from this host's clock {now}, more \
                 than the accepted {max_skew_secs} s; check that both clocks are synchronised \
                 (ntpd)",
                ts.abs_diff(*now)
            ),
            AuthError::WrongRole {
                key_id,
                role,
                required,
            } => write!(
                f,
                "key {key_id:?} is a {role} key and this route requires a {required} key"
            ),
            AuthError::SignedBeforeStart { ts, started } => write!(
                f,
                "signed before this daemon started (timestamp {ts}; it accepts {started} and \
                 later); sign a new request (check the clock with NTP if this repeats)"
            ),
            AuthError::RecordFloor(e) => write!(
                f,
                "the request is dated ahead of this host's clock and its timestamp could not \
                 be recorded for replay protection across restarts ({e}); it was not acted \
                 on: retry, check the state directory's disk, and synchronise the clocks (NTP)"
            ),
            AuthError::Replayed { key_id } => write!(
                f,
                "replayed request: this signature (key id {key_id:?}) was already accepted; \
                 every request needs a fresh nonce"
            ),
            AuthError::ReplayCacheFull { capacity } => write!(
                f,
                "too many signed requests in the replay window ({capacity} remembered); \
                 refusing new ones until older ones expire, retry shortly"
            ),
            AuthError::InvalidKeyId { id } => write!(
                f,
                "key id {id:?} is not usable: use 1 to {MAX_KEY_ID_LEN} characters from \
                 A-Z a-z 0-9 . _ - (for example ops-2026-11)"
            ),
            AuthError::KeyFileIo {
                path,
                action,
                source,
            } => write!(f, "cannot {action} key file {}: {source}", path.display()),
            AuthError::KeyFileNotRegular { path } => {
                write!(f, "key file {} is not a regular file", path.display())
            }
            AuthError::KeyFileMode { path, mode } => write!(
                f,
                "key file {} has mode {mode:04o}, which lets other users read it; run \
                 `chmod 0600 {}` (and replace the key if it may have been copied)",
                path.display(),
                path.display()
            ),
            AuthError::KeyFileOwner {
                path,
                owner,
                expected,
            } => write!(
                f,
                "key file {} is owned by uid {owner}, expected uid {expected}{}; run `chown {expected} {}`",
                path.display(),
                if *expected == 0 {
                    " (root)"
                } else {
                    " (the user running this program)"
                },
                path.display()
            ),
            AuthError::KeyFileFormat { path, reason } => write!(
                f,
                "key file {} is not a Keel key: {reason}; it must hold exactly `id = \"...\"` \
                 and `secret = \"<64 hex digits>\"` (create one with `keelctl key generate`)",
                path.display()
            ),
            AuthError::KeyFileExists { path } => write!(
                f,
                "{} already exists; refusing to overwrite a key, choose another path or \
                 remove the old file yourself",
                path.display()
            ),
            AuthError::DuplicateKeyId { id, first, second } => write!(
                f,
                "key id {id:?} appears twice ({first} and {second}); every accepted key needs \
                 its own id (is a file listed twice?)"
            ),
            AuthError::SharedSecret { first, second } => write!(
                f,
                "keys {first:?} and {second:?} have the same secret, so a holder of one could \
                 sign as the other; generate a new key for one of them"
            ),
            AuthError::Random { reason } => write!(
                f,
                "the operating system's random number generator failed: {reason}"
            ),
        }
    }
}

impl std::error::Error for AuthError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AuthError::KeyFileIo { source, .. } => Some(source),
            AuthError::RecordFloor(e) => Some(e),
            _ => None,
        }
    }
}

fn malformed(reason: impl Into<String>) -> AuthError {
    AuthError::Malformed {
        reason: reason.into(),
    }
}

/// A signing key: an id and a 32-byte secret. `Debug` shows the id and the
/// file it came from, never the secret.
#[derive(Clone)]
pub struct Key {
    id: String,
    secret: [u8; SECRET_LEN],
    source: Option<PathBuf>,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key")
            .field("id", &self.id)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl Key {
    /// A key from its parts (tests, and callers holding a secret elsewhere).
    pub fn new(id: &str, secret: [u8; SECRET_LEN]) -> Result<Key, AuthError> {
        check_key_id(id)?;
        Ok(Key {
            id: id.to_string(),
            secret,
            source: None,
        })
    }

    /// The key id sent in the `key=` parameter.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The file the key was loaded from, if any.
    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    fn describe(&self) -> String {
        match &self.source {
            Some(p) => p.display().to_string(),
            None => format!("key {:?}", self.id),
        }
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC accepts a key of any length; a 32-byte one cannot fail.
        match HmacSha256::new_from_slice(&self.secret) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC-SHA256 takes keys of every length"),
        }
    }
}

fn key_id_ok(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_KEY_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn check_key_id(id: &str) -> Result<(), AuthError> {
    if key_id_ok(id) {
        Ok(())
    } else {
        Err(AuthError::InvalidKeyId { id: id.to_string() })
    }
}

/// Whom a key file must belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyFilePolicy {
    /// `true`: the file must be owned by root (uid 0). `false`: it must be
    /// owned by the effective user of this process, so an unprivileged daemon
    /// (simulate mode, tests) or an operator's `keelctl` accepts its own files.
    pub require_root_owner: bool,
}

impl KeyFilePolicy {
    /// What the daemons and keelctl use: root ownership when running as root,
    /// else ownership by the current user. A root daemon therefore refuses a
    /// key file an unprivileged user could have written.
    pub fn for_current_process() -> KeyFilePolicy {
        KeyFilePolicy {
            require_root_owner: effective_uid() == 0,
        }
    }

    fn expected_owner(&self) -> u32 {
        if self.require_root_owner {
            0
        } else {
            effective_uid()
        }
    }
}

/// geteuid(2).
#[allow(unsafe_code)]
fn effective_uid() -> u32 {
    // SAFETY: geteuid takes no arguments, touches no memory of ours and
    // cannot fail (POSIX: "always successful").
    unsafe { libc::geteuid() }
}

/// Reads one key file, refusing it unless it is a regular file with no group
/// or other permission bits (0600 or 0400) owned by the owner `policy`
/// expects. The checks use the opened file's own metadata, so the file that
/// was checked is the file that is read.
pub fn load_key(path: &Path, policy: KeyFilePolicy) -> Result<Key, AuthError> {
    let io_err = |action, source| AuthError::KeyFileIo {
        path: path.to_path_buf(),
        action,
        source,
    };
    let file = File::open(path).map_err(|e| io_err("open", e))?;
    let meta = file.metadata().map_err(|e| io_err("inspect", e))?;
    if !meta.is_file() {
        return Err(AuthError::KeyFileNotRegular {
            path: path.to_path_buf(),
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(AuthError::KeyFileMode {
            path: path.to_path_buf(),
            mode,
        });
    }
    let expected = policy.expected_owner();
    if meta.uid() != expected {
        return Err(AuthError::KeyFileOwner {
            path: path.to_path_buf(),
            owner: meta.uid(),
            expected,
        });
    }
    let mut text = String::new();
    file.take(MAX_KEY_FILE_LEN + 1)
        .read_to_string(&mut text)
        .map_err(|e| io_err("read", e))?;
    let format = |reason: String| AuthError::KeyFileFormat {
        path: path.to_path_buf(),
        reason,
    };
    if text.len() as u64 > MAX_KEY_FILE_LEN {
        return Err(format(format!(
            "it is larger than {MAX_KEY_FILE_LEN} bytes"
        )));
    }
    let mut key = parse_key_file(&text).map_err(format)?;
    key.source = Some(path.to_path_buf());
    Ok(key)
}

/// Parses a key file's text. Errors say which line or field is wrong but
/// never quote the file, whose secret line may be the one at fault.
fn parse_key_file(text: &str) -> Result<Key, String> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| match e.span() {
        Some(span) => {
            let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
            format!("line {line} is not valid TOML")
        }
        None => "it is not valid TOML".to_string(),
    })?;
    if let Some(other) = table.keys().find(|k| *k != "id" && *k != "secret") {
        return Err(format!("unknown field {other:?}"));
    }
    let field = |name: &str| match table.get(name) {
        Some(toml::Value::String(s)) => Ok(s.as_str()),
        Some(_) => Err(format!("`{name}` must be a string")),
        None => Err(format!("`{name}` is missing")),
    };
    let id = field("id")?;
    let secret = field("secret")?;
    if !key_id_ok(id) {
        return Err(format!(
            "id {id:?} must be 1 to {MAX_KEY_ID_LEN} characters from A-Z a-z 0-9 . _ -"
        ));
    }
    let secret = unhex::<SECRET_LEN>(&secret.to_ascii_lowercase())
        .ok_or_else(|| format!("`secret` must be exactly {} hex digits", SECRET_LEN * 2))?;
    Ok(Key {
        id: id.to_string(),
        secret,
        source: None,
    })
}

/// A new key with `id` and a secret from the operating system's random
/// number generator (`keelctl key generate`).
pub fn generate_key(id: &str) -> Result<Key, AuthError> {
    check_key_id(id)?;
    Ok(Key {
        id: id.to_string(),
        secret: random_bytes()?,
        source: None,
    })
}

/// The text of a key file for `key`.
fn key_file_text(key: &Key) -> String {
    format!(
        "# Keel signing key (docs/security.md). Keep it mode 0600; anyone who reads the\n\
         # secret can sign requests as this key's role.\n\
         id = \"{}\"\nsecret = \"{}\"\n",
        key.id,
        hex(&key.secret)
    )
}

/// Writes `key` to a new file at `path` with mode 0600, refusing to replace
/// anything already there (a symlink included). The file is created with its
/// final mode, so it is never readable by others, not even for a moment; if
/// writing fails the partial file is removed. A crash mid-write can leave a
/// truncated file, which [`load_key`] refuses.
pub fn write_key_file(path: &Path, key: &Key) -> Result<(), AuthError> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|source| {
            if source.kind() == io::ErrorKind::AlreadyExists {
                AuthError::KeyFileExists {
                    path: path.to_path_buf(),
                }
            } else {
                AuthError::KeyFileIo {
                    path: path.to_path_buf(),
                    action: "create",
                    source,
                }
            }
        })?;
    let written = file
        .write_all(key_file_text(key).as_bytes())
        .and_then(|()| file.sync_all());
    if let Err(source) = written {
        drop(file);
        // Best effort: the error below is what the user needs to see.
        let _ = std::fs::remove_file(path);
        return Err(AuthError::KeyFileIo {
            path: path.to_path_buf(),
            action: "write",
            source,
        });
    }
    Ok(())
}

/// The keys a verifier accepts, by role. Several keys per role may be valid
/// at once; that is how keys rotate without a failed request.
#[derive(Debug, Clone, Default)]
pub struct Keyring {
    node: Vec<Key>,
    operator: Vec<Key>,
}

impl Keyring {
    /// A keyring from keys in memory. Refuses two keys with the same id or
    /// the same secret, in one role or across both.
    pub fn new(node: Vec<Key>, operator: Vec<Key>) -> Result<Keyring, AuthError> {
        let all: Vec<&Key> = node.iter().chain(operator.iter()).collect();
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                if a.id == b.id {
                    return Err(AuthError::DuplicateKeyId {
                        id: a.id.clone(),
                        first: a.describe(),
                        second: b.describe(),
                    });
                }
                if a.secret == b.secret {
                    return Err(AuthError::SharedSecret {
                        first: a.id.clone(),
                        second: b.id.clone(),
                    });
                }
            }
        }
        Ok(Keyring { node, operator })
    }

    /// Loads every file of `node_paths` as a node key and every file of
    /// `operator_paths` as an operator key, each through [`load_key`].
    pub fn load(
        node_paths: &[PathBuf],
        operator_paths: &[PathBuf],
        policy: KeyFilePolicy,
    ) -> Result<Keyring, AuthError> {
        let load_all = |paths: &[PathBuf]| -> Result<Vec<Key>, AuthError> {
            paths.iter().map(|p| load_key(p, policy)).collect()
        };
        Keyring::new(load_all(node_paths)?, load_all(operator_paths)?)
    }

    /// The key with `id` and its role.
    pub fn find(&self, id: &str) -> Option<(&Key, Role)> {
        let node = self
            .node
            .iter()
            .find(|k| k.id == id)
            .map(|k| (k, Role::Node));
        node.or_else(|| {
            self.operator
                .iter()
                .find(|k| k.id == id)
                .map(|k| (k, Role::Operator))
        })
    }

    /// The ids accepted for `role`, in load order.
    pub fn ids(&self, role: Role) -> Vec<&str> {
        let keys = match role {
            Role::Node => &self.node,
            Role::Operator => &self.operator,
        };
        keys.iter().map(|k| k.id.as_str()).collect()
    }
}

/// A parsed `Authorization` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthHeader {
    /// The key id.
    pub key_id: String,
    /// The signer's Unix time in seconds.
    pub ts: u64,
    /// The request's nonce.
    pub nonce: [u8; NONCE_LEN],
    /// The signature.
    pub sig: [u8; SIG_LEN],
}

impl fmt::Display for AuthHeader {
    /// The header value, exactly as [`parse_authorization`] reads it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{SCHEME} key={}, ts={}, nonce={}, sig={}",
            self.key_id,
            self.ts,
            hex(&self.nonce),
            hex(&self.sig)
        )
    }
}

/// Parses an `Authorization` value by the grammar in the module docs. Pure
/// and total: any input gives a value or [`AuthError::Malformed`], whose
/// reason never quotes the input.
pub fn parse_authorization(value: &str) -> Result<AuthHeader, AuthError> {
    if value.len() > MAX_HEADER_LEN {
        return Err(malformed(format!("longer than {MAX_HEADER_LEN} bytes")));
    }
    let Some(rest) = value.strip_prefix(SCHEME) else {
        return Err(malformed(format!("the scheme must be {SCHEME}")));
    };
    let is_ows = |c: char| c == ' ' || c == '\t';
    if !rest.starts_with(is_ows) {
        return Err(malformed(format!(
            "the scheme must be {SCHEME} followed by a space"
        )));
    }
    let (mut key_id, mut ts, mut nonce, mut sig) = (None, None, None, None);
    for part in rest.split(',') {
        let part = part.trim_matches(is_ows);
        let Some((name, val)) = part.split_once('=') else {
            return Err(malformed(
                "parameters must be name=value separated by commas (key, ts, nonce, sig)",
            ));
        };
        let slot_taken = match name {
            "key" => key_id.replace(val).is_some(),
            "ts" => ts.replace(val).is_some(),
            "nonce" => nonce.replace(val).is_some(),
            "sig" => sig.replace(val).is_some(),
            _ => {
                return Err(malformed(
                    "unknown parameter; only key, ts, nonce and sig are allowed",
                ));
            }
        };
        if slot_taken {
            return Err(malformed(format!("parameter {name} appears twice")));
        }
    }
    fn need<'a>(v: Option<&'a str>, name: &str) -> Result<&'a str, AuthError> {
        v.ok_or_else(|| malformed(format!("parameter {name} is missing")))
    }
    let key_id = need(key_id, "key")?;
    let ts = need(ts, "ts")?;
    let nonce = need(nonce, "nonce")?;
    let sig = need(sig, "sig")?;
    if !key_id_ok(key_id) {
        return Err(malformed(format!(
            "key must be 1 to {MAX_KEY_ID_LEN} characters from A-Z a-z 0-9 . _ -"
        )));
    }
    let ts_ok = !ts.is_empty()
        && ts.bytes().all(|b| b.is_ascii_digit())
        && (ts == "0" || !ts.starts_with('0'));
    let ts =
        ts.parse::<u64>().ok().filter(|_| ts_ok).ok_or_else(|| {
            malformed("ts must be Unix seconds in decimal, without leading zeros")
        })?;
    let nonce = unhex::<NONCE_LEN>(nonce).ok_or_else(|| {
        malformed(format!(
            "nonce must be {} lowercase hex digits",
            NONCE_LEN * 2
        ))
    })?;
    let sig = unhex::<SIG_LEN>(sig)
        .ok_or_else(|| malformed(format!("sig must be {} lowercase hex digits", SIG_LEN * 2)))?;
    Ok(AuthHeader {
        key_id: key_id.to_string(),
        ts,
        nonce,
        sig,
    })
}

/// The string a signature covers (see the module docs):
/// `METHOD\nPATH_AND_QUERY\nTS\nNONCE_HEX\nBODY_SHA256_HEX`.
pub fn canonical_string(
    method: &str,
    path_and_query: &str,
    ts: u64,
    nonce: &[u8; NONCE_LEN],
    body: &[u8],
) -> String {
    format!(
        "{method}\n{path_and_query}\n{ts}\n{}\n{}",
        hex(&nonce[..]),
        hex(&Sha256::digest(body))
    )
}

/// Refuses a method or target that could make the canonical string ambiguous
/// (a newline in either would let two requests share one string). The HTTP
/// server never hands such a request to a handler; this keeps the pure
/// functions safe on their own.
fn check_request_line(method: &str, path_and_query: &str) -> Result<(), AuthError> {
    let method_ok = !method.is_empty() && method.bytes().all(|b| b.is_ascii_alphanumeric());
    if !method_ok {
        return Err(malformed("the method must be letters and digits only"));
    }
    let path_ok = path_and_query.starts_with('/')
        && !path_and_query
            .bytes()
            .any(|b| b.is_ascii_control() || b == b' ' || b >= 0x80);
    if !path_ok {
        return Err(malformed(
            "the request target must start with / and hold no spaces or control characters",
        ));
    }
    Ok(())
}

fn signature(key: &Key, canonical: &str) -> [u8; SIG_LEN] {
    let mut mac = key.mac();
    mac.update(canonical.as_bytes());
    mac.finalize().into_bytes().into()
}

/// Signs requests with one key.
#[derive(Debug, Clone)]
pub struct Signer {
    key: Key,
}

impl Signer {
    /// A signer for `key`.
    pub fn new(key: Key) -> Signer {
        Signer { key }
    }

    /// The id of the key it signs with.
    pub fn key_id(&self) -> &str {
        &self.key.id
    }

    /// The `Authorization` value for one request, with a fresh random nonce.
    /// `path_and_query` is the request target exactly as it will be sent.
    pub fn authorization(
        &self,
        method: &str,
        path_and_query: &str,
        body: &[u8],
        now_unix: u64,
    ) -> Result<String, AuthError> {
        let nonce = random_bytes::<NONCE_LEN>()?;
        self.authorization_with_nonce(method, path_and_query, body, now_unix, nonce)
    }

    /// [`Signer::authorization`] with a given nonce: for test vectors only;
    /// reusing a nonce makes the second request a replay.
    pub fn authorization_with_nonce(
        &self,
        method: &str,
        path_and_query: &str,
        body: &[u8],
        now_unix: u64,
        nonce: [u8; NONCE_LEN],
    ) -> Result<String, AuthError> {
        check_request_line(method, path_and_query)?;
        let canonical = canonical_string(method, path_and_query, now_unix, &nonce, body);
        let header = AuthHeader {
            key_id: self.key.id.clone(),
            ts: now_unix,
            nonce,
            sig: signature(&self.key, &canonical),
        };
        Ok(header.to_string())
    }
}

/// Who signed an accepted request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The key's id (safe to log).
    pub key_id: String,
    /// The key's role.
    pub role: Role,
}

/// Remembered `(ts, nonce)` pairs, grouped by `ts` so expiry drops whole
/// seconds at a time.
#[derive(Debug)]
struct NonceCache {
    by_ts: BTreeMap<u64, HashSet<[u8; NONCE_LEN]>>,
    len: usize,
    capacity: usize,
}

impl NonceCache {
    /// Forgets every entry whose `ts` is older than `oldest`: such requests
    /// are refused as stale before the cache is consulted.
    fn evict_before(&mut self, oldest: u64) {
        let kept = self.by_ts.split_off(&oldest);
        let gone = std::mem::replace(&mut self.by_ts, kept);
        self.len -= gone.values().map(HashSet::len).sum::<usize>();
    }

    /// Records the pair; `Ok(false)` if it was already there.
    fn insert(&mut self, ts: u64, nonce: [u8; NONCE_LEN]) -> Result<bool, AuthError> {
        if self.by_ts.get(&ts).is_some_and(|s| s.contains(&nonce)) {
            return Ok(false);
        }
        if self.len >= self.capacity {
            return Err(AuthError::ReplayCacheFull {
                capacity: self.capacity,
            });
        }
        self.by_ts.entry(ts).or_default().insert(nonce);
        self.len += 1;
        Ok(true)
    }
}

/// Verifies signed requests against a [`Keyring`]; shared by every handler
/// thread of a listener (`&self` methods, state behind locks).
#[derive(Debug)]
pub struct Verifier {
    keyring: RwLock<Arc<Keyring>>,
    max_skew_secs: u64,
    not_before: u64,
    floor: Option<ReplayFloor>,
    seen: Mutex<NonceCache>,
    /// Refused requests, logged in summaries: a client sending unsigned
    /// requests in a loop must not write a line per request.
    refusals: RefusalLog,
}

impl Verifier {
    /// A verifier accepting `keyring`'s keys with timestamps at most
    /// `max_skew` (whole seconds) from the clock, remembering at most
    /// [`DEFAULT_NONCE_CAPACITY`] nonces.
    pub fn new(keyring: Keyring, max_skew: Duration) -> Verifier {
        Verifier {
            keyring: RwLock::new(Arc::new(keyring)),
            max_skew_secs: max_skew.as_secs(),
            not_before: 0,
            floor: None,
            seen: Mutex::new(NonceCache {
                by_ts: BTreeMap::new(),
                len: 0,
                capacity: DEFAULT_NONCE_CAPACITY,
            }),
            refusals: RefusalLog::new(
                "requests refused for a missing or bad signature",
                DEFAULT_SUMMARY_INTERVAL,
            ),
        }
    }

    /// The same verifier with another bound on remembered nonces.
    pub fn with_nonce_capacity(self, capacity: usize) -> Verifier {
        lock(&self.seen).capacity = capacity;
        self
    }

    /// The same verifier refusing every `ts` earlier than `first_second`
    /// (Unix seconds), the daemon's start: see the module docs.
    pub fn with_not_before(mut self, first_second: u64) -> Verifier {
        self.not_before = self.not_before.max(first_second);
        self
    }

    /// The same verifier recording in `floor` (durably, before accepting)
    /// every accepted `ts` ahead of this host's clock, for the next daemon
    /// on this state directory: see the module docs.
    pub fn with_replay_floor(mut self, floor: ReplayFloor) -> Verifier {
        self.floor = Some(floor);
        self
    }

    /// Swaps the accepted keys (a reload during rotation). Requests already
    /// being verified finish with the old set; remembered nonces are kept, so
    /// a reload opens no replay window.
    pub fn replace_keyring(&self, keyring: Keyring) {
        *self.keyring.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keyring);
    }

    /// How many nonces are remembered now.
    pub fn remembered_nonces(&self) -> usize {
        lock(&self.seen).len
    }

    /// Verifies one request (order of checks in the module docs) and, when
    /// it is accepted, remembers its nonce. `authorization` is the header's
    /// value (`None` when absent); `required` the role the route demands.
    pub fn verify(
        &self,
        method: &str,
        path_and_query: &str,
        authorization: Option<&str>,
        body: &[u8],
        now_unix: u64,
        required: Role,
    ) -> Result<Verified, AuthError> {
        let header = parse_authorization(authorization.ok_or(AuthError::Missing)?)?;
        check_request_line(method, path_and_query)?;
        let keyring = Arc::clone(&self.keyring.read().unwrap_or_else(|p| p.into_inner()));
        let Some((key, role)) = keyring.find(&header.key_id) else {
            return Err(AuthError::UnknownKey {
                key_id: header.key_id,
            });
        };
        let canonical = canonical_string(method, path_and_query, header.ts, &header.nonce, body);
        let mut mac = key.mac();
        mac.update(canonical.as_bytes());
        // verify_slice compares in constant time.
        if mac.verify_slice(&header.sig).is_err() {
            return Err(AuthError::BadSignature {
                key_id: header.key_id,
            });
        }
        if header.ts.abs_diff(now_unix) > self.max_skew_secs {
            return Err(AuthError::Stale {
                ts: header.ts,
                now: now_unix,
                max_skew_secs: self.max_skew_secs,
            });
        }
        if header.ts < self.not_before {
            return Err(AuthError::SignedBeforeStart {
                ts: header.ts,
                started: self.not_before,
            });
        }
        if role != required {
            return Err(AuthError::WrongRole {
                key_id: header.key_id,
                role,
                required,
            });
        }
        let mut seen = lock(&self.seen);
        seen.evict_before(now_unix.saturating_sub(self.max_skew_secs));
        if !seen.insert(header.ts, header.nonce)? {
            return Err(AuthError::Replayed {
                key_id: header.key_id,
            });
        }
        drop(seen);
        if header.ts > now_unix
            && let Some(floor) = &self.floor
        {
            floor.raise(header.ts).map_err(AuthError::RecordFloor)?;
        }
        Ok(Verified {
            key_id: header.key_id,
            role,
        })
    }
}

/// Verifies a received request (its target exactly as sent, its single
/// `Authorization` field, its body). A refusal is logged at warning level
/// with the peer address and the reason, never a secret: the first of a
/// period in full, the others counted in a summary line (see
/// [`crate::common::refusals`]).
pub fn verify_request(
    verifier: &Verifier,
    req: &Request,
    required: Role,
    now_unix: u64,
) -> Result<Verified, AuthError> {
    let mut fields = req
        .headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("authorization"));
    let first = fields.next().map(|(_, v)| v.as_str());
    let result = if fields.next().is_some() {
        Err(malformed(
            "the request has more than one Authorization header",
        ))
    } else {
        verifier.verify(
            &req.method,
            &req.raw_path,
            first,
            &req.body,
            now_unix,
            required,
        )
    };
    if let Err(e) = &result {
        verifier.refusals.record(&req.peer, || {
            format!("refused {} {}: {e}", req.method, req.path)
        });
    }
    result
}

/// The response for a refused request: [`AuthError::status`] with the
/// reason as `{"error": ...}` and, on a 401, `WWW-Authenticate: Keel-HMAC-SHA256`.
pub fn refusal(err: &AuthError) -> Response {
    let status = err.status();
    let response = Response::error(status, &err.to_string(), None);
    if status == 401 {
        response.with_header("WWW-Authenticate", SCHEME)
    } else {
        response
    }
}

/// The header fields that sign one outgoing request, for
/// [`crate::common::http::Client::request`] or as the `replace` list of
/// [`crate::common::http::Client::forward`] (which then drops the original
/// signature). `path_and_query` is the target exactly as it will be sent.
pub fn sign_headers(
    signer: &Signer,
    method: &str,
    path_and_query: &str,
    body: &[u8],
    now_unix: u64,
) -> Result<Vec<(String, String)>, AuthError> {
    let value = signer.authorization(method, path_and_query, body, now_unix)?;
    Ok(vec![("Authorization".to_string(), value)])
}

/// This host's clock in Unix seconds (0 if it reads before 1970).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn random_bytes<const N: usize>() -> Result<[u8; N], AuthError> {
    let mut buf = [0u8; N];
    getrandom::fill(&mut buf).map_err(|e| AuthError::Random {
        reason: e.to_string(),
    })?;
    Ok(buf)
}

/// Lowercase hex.
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

/// Exactly `2 * N` lowercase hex digits.
fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let digit = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    };
    let s = s.as_bytes();
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        *o = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// Simulate mode only: creates the key file at `path` with a fresh key named
/// `id` when it does not exist yet (parent directory included, mode 0700), so
/// a simulated cluster starts without setup. An existing file is left alone
/// and checked by [`load_key`] like any other. Production daemons never call
/// this: a missing key there is an error the admin fixes with
/// `keelctl key generate`.
pub fn ensure_key(path: &Path, id: &str) -> Result<(), AuthError> {
    if path.exists() {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| AuthError::KeyFileIo {
                path: dir.to_path_buf(),
                action: "create the directory of",
                source,
            })?;
    }
    match write_key_file(path, &generate_key(id)?) {
        // Another daemon of the same simulated cluster created it first.
        Err(AuthError::KeyFileExists { .. }) => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str, fill: u8) -> Key {
        Key::new(id, [fill; SECRET_LEN]).expect("valid id")
    }

    #[test]
    fn hex_round_trips_and_is_strict() {
        let bytes = [0x00, 0x7f, 0xab, 0xff];
        assert_eq!(hex(&bytes), "007fabff");
        assert_eq!(unhex::<4>("007fabff"), Some(bytes));
        assert_eq!(unhex::<4>("007FABFF"), None);
        assert_eq!(unhex::<4>("007fab"), None);
        assert_eq!(unhex::<4>("007fabfg"), None);
        assert_eq!(unhex::<1>("+f"), None);
    }

    #[test]
    fn key_ids() {
        for good in ["a", "ops-2026-11", "node_1.b", &"x".repeat(64)] {
            assert!(key_id_ok(good), "{good}");
        }
        for bad in ["", "a b", "a,b", "a=b", "é", &"x".repeat(65)] {
            assert!(!key_id_ok(bad), "{bad:?}");
        }
    }

    #[test]
    fn key_file_text_parses_back() {
        let k = key("ops-1", 7);
        let parsed = parse_key_file(&key_file_text(&k)).expect("parses");
        assert_eq!(parsed.id, "ops-1");
        assert_eq!(parsed.secret, k.secret);
    }

    #[test]
    fn key_file_errors_never_quote_the_secret() {
        let secret = "ab".repeat(31) + "zz";
        for text in [
            format!("id = \"a\"\nsecret = \"{secret}\"\n"),
            format!("id = \"a\"\nsecret = {secret}\n"),
            format!("id = \"a\"\nsecret = \"{secret}\nextra = 1\n"),
        ] {
            let err = parse_key_file(&text).expect_err("refused");
            assert!(!err.contains(&secret), "{err}");
            assert!(!err.contains("abab"), "{err}");
        }
        assert_eq!(
            parse_key_file("id = \"a\"\n").expect_err("refused"),
            "`secret` is missing"
        );
        assert!(
            parse_key_file(&format!(
                "id = \"a\"\nsecret = \"{}\"\nrole = \"x\"",
                "0".repeat(64)
            ))
            .expect_err("refused")
            .contains("unknown field")
        );
    }

    #[test]
    fn nonce_cache_evicts_whole_seconds() {
        let mut c = NonceCache {
            by_ts: BTreeMap::new(),
            len: 0,
            capacity: 3,
        };
        assert!(c.insert(10, [1; 16]).expect("room"));
        assert!(c.insert(11, [1; 16]).expect("room"));
        assert!(!c.insert(10, [1; 16]).expect("seen"));
        assert!(c.insert(12, [2; 16]).expect("room"));
        assert!(matches!(
            c.insert(12, [3; 16]),
            Err(AuthError::ReplayCacheFull { capacity: 3 })
        ));
        c.evict_before(11);
        assert_eq!(c.len, 2);
        assert!(c.insert(12, [3; 16]).expect("room again"));
    }

    #[test]
    fn requests_signed_before_the_start_are_refused() {
        let operator = key("ops", 1);
        let keyring = Keyring::new(vec![], vec![operator.clone()]).expect("keyring");
        let verifier = Verifier::new(keyring, DEFAULT_MAX_SKEW).with_not_before(1_000);
        let signer = Signer::new(operator);
        let verify = |ts: u64, nonce: u8| {
            let auth = signer
                .authorization_with_nonce("DELETE", "/jails/web", b"", ts, [nonce; NONCE_LEN])
                .expect("sign");
            verifier.verify(
                "DELETE",
                "/jails/web",
                Some(&auth),
                b"",
                1_005,
                Role::Operator,
            )
        };
        let err = verify(999, 1).expect_err("signed a second before the start");
        assert!(
            matches!(
                err,
                AuthError::SignedBeforeStart {
                    ts: 999,
                    started: 1_000
                }
            ),
            "{err:?}"
        );
        assert_eq!(err.status(), 401);
        let message = err.to_string();
        assert!(
            message.contains("signed before this daemon started"),
            "{message}"
        );
        assert!(message.contains("check the clock with NTP"), "{message}");
        assert!(verify(1_000, 2).is_ok(), "signed in the first second");
        assert!(verify(1_004, 3).is_ok(), "signed after the start");
        assert_eq!(
            verifier.remembered_nonces(),
            2,
            "refusals are not remembered"
        );
    }

    #[test]
    fn a_request_dated_ahead_is_recorded_and_refused_by_the_next_daemon() {
        let dir = tempfile::tempdir().expect("tempdir");
        let operator = key("ops", 1);
        let keyring = || Keyring::new(vec![], vec![operator.clone()]).expect("keyring");
        let signer = Signer::new(operator.clone());
        let auth = |ts: u64, nonce: u8| {
            signer
                .authorization_with_nonce("DELETE", "/jails/web", b"", ts, [nonce; NONCE_LEN])
                .expect("sign")
        };
        let (floor, recorded) = ReplayFloor::open(dir.path()).expect("floor");
        assert_eq!(recorded, 0);
        let first = Verifier::new(keyring(), DEFAULT_MAX_SKEW)
            .with_not_before(1_000)
            .with_replay_floor(floor);
        let verify = |v: &Verifier, auth: &str, now: u64| {
            v.verify("DELETE", "/jails/web", Some(auth), b"", now, Role::Operator)
        };
        // The signer's clock is 60 s ahead; the daemon's is 1_001.
        let ahead = auth(1_061, 1);
        verify(&first, &ahead, 1_001).expect("within the skew");
        verify(&first, &auth(1_001, 2), 1_001).expect("in step");
        drop(first);

        // The next daemon starts at 1_003: the first request's ts is later.
        let (floor, recorded) = ReplayFloor::open(dir.path()).expect("floor");
        assert_eq!(
            recorded, 1_061,
            "only the ts ahead of the clock is recorded"
        );
        let next = Verifier::new(keyring(), DEFAULT_MAX_SKEW)
            .with_not_before(1_003)
            .with_not_before(recorded + 1)
            .with_replay_floor(floor);
        let err = verify(&next, &ahead, 1_010).expect_err("replay after the restart");
        assert!(
            matches!(
                err,
                AuthError::SignedBeforeStart {
                    ts: 1_061,
                    started: 1_062
                }
            ),
            "{err:?}"
        );
        verify(&next, &auth(1_062, 3), 1_010).expect("signed after the floor");
    }

    #[test]
    fn status_codes() {
        assert_eq!(AuthError::Missing.status(), 401);
        assert_eq!(AuthError::ReplayCacheFull { capacity: 1 }.status(), 503);
        assert_eq!(AuthError::KeyFileExists { path: "/x".into() }.status(), 500);
    }
}
