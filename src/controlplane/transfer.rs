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

use std::fmt;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::common::journal::JournalError;
use crate::common::lockfile::{LockError, StateDirLock};
use crate::controlplane::state::ClusterState;
use crate::controlplane::worker::open_state;

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
        /// The state directory.
        dir: PathBuf,
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
                "{} already holds a cluster ({holds}); import only into an empty state directory, \
                 or move that one aside first",
                dir.display()
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

/// Writes the state in `state_dir` to `to` (`None`: stdout); returns what
/// it held.
pub fn export(state_dir: &Path, to: Option<&Path>) -> Result<String, TransferError> {
    let _lock = StateDirLock::acquire(state_dir).map_err(TransferError::Lock)?;
    let (_journal, state) = open_state(state_dir).map_err(TransferError::State)?;
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

/// Loads the state in `from` (`None`: stdin) into the empty `state_dir`;
/// returns what it held.
pub fn import(state_dir: &Path, from: Option<&Path>) -> Result<String, TransferError> {
    let _lock = StateDirLock::acquire(state_dir).map_err(TransferError::Lock)?;
    let (mut journal, existing) = open_state(state_dir).map_err(TransferError::State)?;
    if let Some(holds) = holdings(&existing) {
        return Err(TransferError::NotEmpty {
            dir: state_dir.to_path_buf(),
            holds,
        });
    }
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
    let mut state = exported.state;
    state.last_epoch = state.last_epoch.max(existing.last_epoch);
    let holds = holdings(&state).unwrap_or_else(|| "nothing".into());
    journal.compact(&state).map_err(TransferError::State)?;
    Ok(holds)
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
            export(from.path(), Some(&file)).expect("exported"),
            "1 node, 1 placement"
        );
        assert_eq!(
            import(to.path(), Some(&file)).expect("imported"),
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
        let err = import(to.path(), Some(&file)).expect_err("refused");
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
        let err = export(dir.path(), Some(&file)).expect_err("refused");
        assert!(matches!(err, TransferError::Exists(_)), "{err}");
        assert_eq!(std::fs::read_to_string(&file).expect("read"), "keep me");

        let empty = tempfile::tempdir().expect("tmp");
        let err = import(empty.path(), Some(&file)).expect_err("not JSON");
        assert!(err.to_string().contains("--export-state"), "{err}");
        std::fs::write(&file, r#"{"format": "keel-cluster-state/9", "state": {}}"#)
            .expect("written");
        let err = import(empty.path(), Some(&file)).expect_err("future format");
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
        export(from.path(), Some(&file)).expect("exported");
        import(to.path(), Some(&file)).expect("imported");
        let (_, state) = open_state(to.path()).expect("opens");
        assert_eq!(state.last_epoch, 50);
        assert_eq!(state.placements["web"].epoch, 7);
    }
}
