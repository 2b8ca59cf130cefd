//! Moving the cluster's state out of a state directory and into another:
//! `keel-controlplane --export-state PATH` and `--import-state PATH`.
//!
//! The exported form is one JSON document, `{"format": FORMAT, "state":
//! ...}`, holding everything the journal persists (nodes, placements with
//! their epochs, services with their VIPs and revisions, the volume
//! registry, pending deletes); liveness is not state and is not moved. It
//! is how a cluster's state moves to another host, or to another state
//! backend, and back.
//!
//! Both hold the state directory's lock ([`StateDirLock`]) for the whole
//! transfer, so neither runs beside a control plane on that directory: an
//! export is a consistent snapshot, an import cannot be overwritten by a
//! running process. An export never overwrites a file. An import refuses a
//! target that holds any node, placement, service, volume or pending
//! delete, and otherwise writes the state as the journal's snapshot (one
//! atomic replace); it keeps the target's highest epoch if that is higher,
//! so no epoch a node may still hold is handed out again. Nothing here
//! changes the source.
//!
//! With etcd ([`Backend::Etcd`]) the same holds of the cluster's prefix:
//! instead of the lock, a transfer takes the leader key for its duration,
//! so it refuses to run while any control plane leads that cluster, and
//! no control plane can start deciding in the middle of it.

use std::fmt;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::common::journal::JournalError;
use crate::common::lockfile::{LockError, StateDirLock};
use crate::controlplane::commit::{Log, LogError};
use crate::controlplane::etcd::{Etcd, EtcdError, EtcdSettings, Lead};
use crate::controlplane::etcd_state::EtcdLog;
use crate::controlplane::leader::LEADER_KEY;
use crate::controlplane::state::ClusterState;
use crate::controlplane::worker::open_state;

/// Where a cluster's state lives.
#[derive(Debug, Clone, Copy)]
pub enum Backend<'a> {
    /// The journal in a state directory.
    Dir(&'a Path),
    /// A prefix in etcd.
    Etcd(&'a EtcdSettings),
}

impl fmt::Display for Backend<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Dir(dir) => write!(f, "{}", dir.display()),
            Backend::Etcd(s) => write!(f, "etcd {} under {}", s.endpoints.join(","), s.prefix),
        }
    }
}

/// The `format` of an exported state.
pub const FORMAT: &str = "keel-cluster-state/1";

/// Only the format of an exported state, read before the rest.
#[derive(Deserialize)]
struct Header {
    format: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Exported {
    format: String,
    state: ClusterState,
}

/// Why a transfer failed. Nothing was changed on any path but the export's
/// own output file.
#[derive(Debug)]
pub enum TransferError {
    /// The state directory is in use (a control plane runs on it) or
    /// cannot be locked.
    Lock(LockError),
    /// The state directory's journal could not be opened or written.
    State(JournalError),
    /// etcd could not be reached or answered an error.
    Etcd(EtcdError),
    /// The state in etcd could not be read or written.
    EtcdState(LogError),
    /// A control plane leads the cluster in etcd.
    Leading(String),
    /// The export's file already exists.
    Exists(PathBuf),
    /// The file (or stdin/stdout, `None`) could not be read or written.
    Io {
        /// The file.
        path: Option<PathBuf>,
        /// The OS error.
        source: std::io::Error,
    },
    /// The input is not an exported state.
    Parse {
        /// The file (`None`: stdin).
        path: Option<PathBuf>,
        /// What was wrong.
        reason: String,
    },
    /// The target already holds a cluster.
    NotEmpty {
        /// The state directory or etcd prefix.
        dir: String,
        /// What it holds, e.g. `3 nodes, 12 placements`.
        holds: String,
    },
}

fn shown(path: &Option<PathBuf>, stdio: &str) -> String {
    path.as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| stdio.to_string())
}

impl fmt::Display for TransferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransferError::Lock(e) => write!(f, "{e}; stop it before moving its state"),
            TransferError::State(e) => write!(f, "{e}"),
            TransferError::Etcd(e) => write!(f, "{e}"),
            TransferError::EtcdState(e) => write!(f, "{e}"),
            TransferError::Leading(holder) => write!(
                f,
                "{holder} leads this cluster; stop every control plane on it before moving its state"
            ),
            TransferError::Exists(p) => write!(
                f,
                "{} already exists; an export never overwrites a file: remove it or choose another path",
                p.display()
            ),
            TransferError::Io { path, source } => {
                write!(f, "{}: {source}", shown(path, "standard input/output"))
            }
            TransferError::Parse { path, reason } => write!(
                f,
                "{} is not a state written by keel-controlplane --export-state ({reason})",
                shown(path, "standard input")
            ),
            TransferError::NotEmpty { dir, holds } => write!(
                f,
                "{dir} already holds a cluster ({holds}); import only into an empty state directory \
                 or etcd prefix, or move that one aside first"
            ),
        }
    }
}

impl std::error::Error for TransferError {}

/// What a state holds, for messages: `3 nodes, 12 placements, ...`; `None`
/// when it holds nothing.
pub fn holdings(state: &ClusterState) -> Option<String> {
    let parts: Vec<String> = [
        (state.nodes.len(), "node"),
        (state.placements.len(), "placement"),
        (state.services.len(), "service"),
        (state.volumes.len(), "volume"),
        (state.deleting.len(), "pending delete"),
    ]
    .into_iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, what)| format!("{n} {what}{}", if n == 1 { "" } else { "s" }))
    .collect();
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// Runs `f` on the state in etcd while holding the leader key, so that
/// no control plane decides meanwhile; refuses when one leads.
fn with_etcd<T>(
    settings: &EtcdSettings,
    f: impl FnOnce(&mut EtcdLog, ClusterState) -> Result<T, TransferError>,
) -> Result<T, TransferError> {
    let etcd = Arc::new(Etcd::connect(settings).map_err(TransferError::Etcd)?);
    let lease = etcd
        .grant(Duration::from_secs(30))
        .map_err(TransferError::Etcd)?;
    let holder = format!(
        "keel-controlplane (pid {}) moving the state",
        std::process::id()
    );
    let fence = match etcd.try_lead(LEADER_KEY, &holder, lease.id) {
        Ok(Lead::Held { revision }) => revision,
        Ok(Lead::Other { holder, .. }) => {
            let _ = etcd.revoke(lease.id);
            return Err(TransferError::Leading(holder));
        }
        Err(e) => {
            let _ = etcd.revoke(lease.id);
            return Err(TransferError::Etcd(e));
        }
    };
    let outcome = EtcdLog::open(Arc::clone(&etcd), fence)
        .map_err(TransferError::EtcdState)
        .and_then(|(mut log, state)| f(&mut log, state));
    // The key goes with the lease: a control plane may lead at once.
    let _ = etcd.revoke(lease.id);
    outcome
}

/// The state in `from`, read while no control plane runs on it (the lock,
/// or the leader key).
pub fn read(from: Backend<'_>) -> Result<ClusterState, TransferError> {
    match from {
        Backend::Dir(state_dir) => {
            let _lock = StateDirLock::acquire(state_dir).map_err(TransferError::Lock)?;
            Ok(open_state(state_dir).map_err(TransferError::State)?.1)
        }
        Backend::Etcd(settings) => with_etcd(settings, |_, state| Ok(state)),
    }
}

/// Writes the state in `from` to `to` (`None`: stdout); returns what it
/// held.
pub fn export(from: Backend<'_>, to: Option<&Path>) -> Result<String, TransferError> {
    let state = read(from)?;
    let holds = holdings(&state).unwrap_or_else(|| "nothing".into());
    let mut text = serde_json::to_vec_pretty(&Exported {
        format: FORMAT.into(),
        state,
    })
    .map_err(|e| TransferError::Parse {
        path: to.map(Path::to_path_buf),
        reason: e.to_string(),
    })?;
    text.push(b'\n');
    let io = |source| TransferError::Io {
        path: to.map(Path::to_path_buf),
        source,
    };
    match to {
        Some(path) => {
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(path)
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::AlreadyExists => TransferError::Exists(path.to_path_buf()),
                    _ => io(e),
                })?;
            file.write_all(&text)
                .and_then(|()| file.sync_all())
                .map_err(io)?;
        }
        None => {
            let mut out = std::io::stdout().lock();
            out.write_all(&text)
                .and_then(|()| out.flush())
                .map_err(io)?;
        }
    }
    Ok(holds)
}

/// Loads the state in `from` (`None`: stdin) into the empty `to`; returns
/// what it held.
pub fn import(to: Backend<'_>, from: Option<&Path>) -> Result<String, TransferError> {
    let state = read_export(from)?;
    match to {
        Backend::Dir(state_dir) => {
            let _lock = StateDirLock::acquire(state_dir).map_err(TransferError::Lock)?;
            let (mut journal, existing) = open_state(state_dir).map_err(TransferError::State)?;
            let state = into_empty(to, state, &existing)?;
            journal.compact(&state).map_err(TransferError::State)?;
            Ok(holdings(&state).unwrap_or_else(|| "nothing".into()))
        }
        Backend::Etcd(settings) => with_etcd(settings, |log, existing| {
            let state = into_empty(to, state, &existing)?;
            log.compact(&state).map_err(TransferError::EtcdState)?;
            Ok(holdings(&state).unwrap_or_else(|| "nothing".into()))
        }),
    }
}

/// `state`, to be written over `existing`, which must hold nothing; it
/// keeps `existing`'s epoch if higher, so no epoch a node may still hold
/// is handed out again.
fn into_empty(
    to: Backend<'_>,
    mut state: ClusterState,
    existing: &ClusterState,
) -> Result<ClusterState, TransferError> {
    if let Some(holds) = holdings(existing) {
        return Err(TransferError::NotEmpty {
            dir: to.to_string(),
            holds,
        });
    }
    state.last_epoch = state.last_epoch.max(existing.last_epoch);
    Ok(state)
}

/// The state in the export at `from` (`None`: stdin).
fn read_export(from: Option<&Path>) -> Result<ClusterState, TransferError> {
    let path = from.map(Path::to_path_buf);
    let mut text = Vec::new();
    match from {
        Some(p) => std::fs::File::open(p).and_then(|mut f| f.read_to_end(&mut text)),
        None => std::io::stdin().lock().read_to_end(&mut text),
    }
    .map_err(|source| TransferError::Io {
        path: path.clone(),
        source,
    })?;
    // The format first: a state of another format may differ in any field.
    let header: Header = serde_json::from_slice(&text).map_err(|e| TransferError::Parse {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    if header.format != FORMAT {
        return Err(TransferError::Parse {
            path,
            reason: format!("format {:?}, this version reads {FORMAT:?}", header.format),
        });
    }
    let exported: Exported = serde_json::from_slice(&text).map_err(|e| TransferError::Parse {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    Ok(exported.state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controlplane::state::{NodeRecord, Placement};

    fn cluster() -> ClusterState {
        let mut state = ClusterState::default();
        state.nodes.insert(
            "n1".into(),
            NodeRecord {
                advertise: "127.0.0.1:7441".parse().expect("addr"),
                capacity: crate::common::wire::Resources {
                    cpu: 4.0,
                    memory: 1 << 30,
                },
                pod_cidr: "10.32.1.0/24".parse().expect("cidr"),
                cordoned: false,
            },
        );
        state.placements.insert(
            "web".into(),
            Placement {
                node: "n1".into(),
                epoch: 7,
                template: None,
            },
        );
        state.last_epoch = 7;
        state
    }

    fn seed(dir: &Path, state: &ClusterState) {
        let (mut journal, _) = open_state(dir).expect("opens");
        journal.compact(state).expect("written");
    }

    #[test]
    fn an_export_imports_into_an_empty_directory_as_it_was() {
        let (from, to, files) = (
            tempfile::tempdir().expect("tmp"),
            tempfile::tempdir().expect("tmp"),
            tempfile::tempdir().expect("tmp"),
        );
        seed(from.path(), &cluster());
        let file = files.path().join("state.json");
        assert_eq!(
            export(Backend::Dir(from.path()), Some(&file)).expect("exported"),
            "1 node, 1 placement"
        );
        assert_eq!(
            import(Backend::Dir(to.path()), Some(&file)).expect("imported"),
            "1 node, 1 placement"
        );
        let (_, imported) = open_state(to.path()).expect("opens");
        assert_eq!(imported, cluster());
        // The source is unchanged.
        let (_, source) = open_state(from.path()).expect("opens");
        assert_eq!(source, cluster());
    }

    #[test]
    fn an_import_into_a_cluster_is_refused_and_changes_nothing() {
        let (to, files) = (
            tempfile::tempdir().expect("tmp"),
            tempfile::tempdir().expect("tmp"),
        );
        let mut other = cluster();
        other.placements.clear();
        seed(to.path(), &other);
        let file = files.path().join("state.json");
        std::fs::write(
            &file,
            serde_json::to_vec(&Exported {
                format: FORMAT.into(),
                state: cluster(),
            })
            .expect("json"),
        )
        .expect("written");
        let err = import(Backend::Dir(to.path()), Some(&file)).expect_err("refused");
        assert!(
            matches!(&err, TransferError::NotEmpty { holds, .. } if holds == "1 node"),
            "{err}"
        );
        assert!(err.to_string().contains("empty state directory"), "{err}");
        let (_, kept) = open_state(to.path()).expect("opens");
        assert_eq!(kept, other);
    }

    #[test]
    fn an_export_never_overwrites_and_a_foreign_file_is_not_imported() {
        let (dir, files) = (
            tempfile::tempdir().expect("tmp"),
            tempfile::tempdir().expect("tmp"),
        );
        seed(dir.path(), &cluster());
        let file = files.path().join("taken.json");
        std::fs::write(&file, "keep me").expect("written");
        let err = export(Backend::Dir(dir.path()), Some(&file)).expect_err("refused");
        assert!(matches!(err, TransferError::Exists(_)), "{err}");
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "keep me");

        let empty = tempfile::tempdir().expect("tmp");
        let err = import(Backend::Dir(empty.path()), Some(&file)).expect_err("not JSON");
        assert!(err.to_string().contains("--export-state"), "{err}");
        std::fs::write(&file, r#"{"format": "keel-cluster-state/9", "state": {}}"#)
            .expect("written");
        let err = import(Backend::Dir(empty.path()), Some(&file)).expect_err("future format");
        assert!(err.to_string().contains("keel-cluster-state/9"), "{err}");
        let (_, state) = open_state(empty.path()).expect("opens");
        assert_eq!(state, ClusterState::default());
    }

    #[test]
    fn an_import_keeps_the_targets_higher_epoch() {
        let (to, files) = (
            tempfile::tempdir().expect("tmp"),
            tempfile::tempdir().expect("tmp"),
        );
        seed(
            to.path(),
            &ClusterState {
                last_epoch: 50,
                ..ClusterState::default()
            },
        );
        let file = files.path().join("state.json");
        let from = tempfile::tempdir().expect("tmp");
        seed(from.path(), &cluster());
        export(Backend::Dir(from.path()), Some(&file)).expect("exported");
        import(Backend::Dir(to.path()), Some(&file)).expect("imported");
        let (_, state) = open_state(to.path()).expect("opens");
        assert_eq!(state.last_epoch, 50);
        assert_eq!(state.placements["web"].epoch, 7);
    }
}
