//! The agent's desired state on disk: one record file per jail, so an
//! apply, a delete or a jail's bookkeeping writes that jail's record and
//! nothing else, whatever the number of jails on the node.
//!
//! Layout of the state directory:
//! - `records/{name}.json`: one [`JailFile`] per jail that is desired or
//!   being deleted, with its crash-loop backoff; written by a
//!   [`RecordStore`] (temp file, fsync, rename, directory fsync), removed
//!   when the jail's delete finished;
//! - `node.json`: the node-wide part ([`NodeRecord`]: the subnet the control
//!   plane assigned, Keel's peer routes and service VIPs), a [`Store`] file.
//!
//! Migration: an agent whose directory still holds the single state file of
//! earlier agents ([`super::STATE_FILE`], every jail in one document) reads
//! it at start and converts it: every record is written, records the file
//! does not name are removed, `node.json` is written, and only then is the
//! old file renamed to `agentd.json.migrated` (never read again; kept for
//! the operator). The rename is the commit point: a crash before it leaves
//! the old file in place and the next start converts it again from the
//! start; a crash after it leaves the new layout complete.
//!
//! Must never: write another jail's record on a jail's behalf, remove a
//! record whose jail is still desired or deleting, or start over an
//! unreadable record or old state file (the error names the file, as
//! [`Store`] does).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{AgentState, JailRecord, STATE_FILE};
use crate::common::backoff::{Snapshot, SnapshotEntry};
use crate::common::cidr::Ipv4Net;
use crate::common::spec::Jail;
use crate::common::store::{MemoryFs, RealFs, RecordStore, Step, Store, StoreError, StoreFs};

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

/// The node-wide file in the state directory.
pub const NODE_FILE: &str = "node.json";
/// The directory of jail records inside the state directory (beside
/// `jails/`, where the jail.conf files are).
pub const JAILS_DIR: &str = "records";
/// What the old single state file is renamed to once converted.
pub const MIGRATED_FILE: &str = "agentd.json.migrated";

/// The node-wide part of [`AgentState`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// See [`AgentState::node_subnet`].
    #[serde(default)]
    pub node_subnet: Option<Ipv4Net>,
    /// See [`AgentState::cluster_routes`].
    #[serde(default)]
    pub cluster_routes: BTreeSet<Ipv4Net>,
    /// See [`AgentState::service_vips`].
    #[serde(default)]
    pub service_vips: BTreeSet<Ipv4Addr>,
}

impl NodeRecord {
    fn of(state: &AgentState) -> NodeRecord {
        NodeRecord {
            node_subnet: state.node_subnet,
            cluster_routes: state.cluster_routes.clone(),
            service_vips: state.service_vips.clone(),
        }
    }
}

/// One jail's record file: the jail as desired, or its pending delete, and
/// its crash-loop backoff. A jail is never both desired and deleting.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JailFile {
    /// The desired jail ([`AgentState::jails`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired: Option<JailRecord>,
    /// The delete in progress ([`AgentState::deleting`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deleting: Option<Jail>,
    /// The jail's entry of [`AgentState::backoff`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<SnapshotEntry<String>>,
}

impl JailFile {
    /// True when the file says nothing: the jail's record is removed.
    pub fn is_empty(&self) -> bool {
        self.desired.is_none() && self.deleting.is_none()
    }
}

/// The agent's state directory in the layout of the module docs.
pub struct AgentStore {
    dir: PathBuf,
    node: Store<NodeRecord>,
    jails: RecordStore<JailFile>,
}

impl std::fmt::Debug for AgentStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentStore")
            .field("dir", &self.dir)
            .finish()
    }
}

impl AgentStore {
    /// Opens the state directory `dir` on the real file system (creating it,
    /// mode 0700), converting an old single state file first. Returns the
    /// store and the saved state, `None` when nothing was saved yet.
    pub fn open(dir: &Path) -> Result<(AgentStore, Option<AgentState>), StoreError> {
        AgentStore::with_fs(dir, RealFs)
    }

    /// [`AgentStore::open`] over another [`StoreFs`] (tests).
    pub fn with_fs(
        dir: &Path,
        fs: impl StoreFs + Clone + 'static,
    ) -> Result<(AgentStore, Option<AgentState>), StoreError> {
        let (legacy, old) = Store::<AgentState>::with_fs(dir, STATE_FILE, fs.clone())?;
        drop(legacy);
        let jails_dir = dir.join(JAILS_DIR);
        let (jails, records) = RecordStore::with_fs(&jails_dir, Box::new(fs.clone()))?;
        let (node, node_record) = Store::<NodeRecord>::with_fs(dir, NODE_FILE, fs.clone())?;
        let mut store = AgentStore {
            dir: dir.to_path_buf(),
            node,
            jails,
        };
        if let Some(old) = old {
            store.migrate(&old, &records, &fs)?;
            return Ok((store, Some(old)));
        }
        // Saved before: the record directory exists (even empty, once every
        // jail was deleted), or the node record does.
        if !store.jails.exists() && node_record.is_none() {
            return Ok((store, None));
        }
        Ok((
            store,
            Some(assemble(node_record.unwrap_or_default(), records)),
        ))
    }

    /// A store over a fresh [`MemoryFs`]: nothing is created or read on
    /// disk (a dry run's).
    pub fn in_memory() -> AgentStore {
        let dir = PathBuf::from("/nonexistent-in-memory");
        let fs = MemoryFs::default();
        let open = || -> Result<AgentStore, StoreError> {
            let (node, _) = Store::with_fs(&dir, NODE_FILE, fs.clone())?;
            let (jails, _) = RecordStore::with_fs(&dir.join(JAILS_DIR), Box::new(fs.clone()))?;
            Ok(AgentStore {
                dir: dir.clone(),
                node,
                jails,
            })
        };
        // MemoryFs fails nothing, and the names are constants.
        open().unwrap_or_else(|e| unreachable!("an in-memory store cannot fail: {e}"))
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file holding jail `name`'s record.
    pub fn jail_path(&self, name: &str) -> PathBuf {
        self.jails.path_of(name)
    }

    /// Writes jail `name`'s record, or removes it when `file` is empty.
    pub fn save_jail(&mut self, name: &str, file: &JailFile) -> Result<(), StoreError> {
        if file.is_empty() {
            self.jails.remove(name)
        } else {
            self.jails.save(name, file)
        }
    }

    /// Writes the node-wide record.
    pub fn save_node(&mut self, node: &NodeRecord) -> Result<(), StoreError> {
        self.node.save(node)
    }

    /// Writes every record of `state` and the node record (seeding a state
    /// directory; the migration). Records of jails `state` does not hold are
    /// left as they are.
    pub fn save_all(&mut self, state: &AgentState) -> Result<(), StoreError> {
        for (name, file) in split(state) {
            self.jails.save(&name, &file)?;
        }
        self.node.save(&NodeRecord::of(state))
    }

    /// Converts the old single file (see the module docs): `found` are the
    /// records already in `records/`, from an earlier interrupted conversion.
    fn migrate(
        &mut self,
        old: &AgentState,
        found: &BTreeMap<String, JailFile>,
        fs: &impl StoreFs,
    ) -> Result<(), StoreError> {
        let files = split(old);
        for stale in found.keys().filter(|k| !files.contains_key(*k)) {
            self.jails.remove(stale)?;
        }
        self.save_all(old)?;
        let from = self.dir.join(STATE_FILE);
        let to = self.dir.join(MIGRATED_FILE);
        let fail = |step: Step, target: &Path| {
            let path = from.clone();
            let target = target.to_path_buf();
            move |source| StoreError::Save {
                path,
                step,
                target,
                source,
            }
        };
        fs.rename(&from, &to).map_err(fail(Step::Rename, &to))?;
        fs.fsync_dir(&self.dir)
            .map_err(fail(Step::FsyncDir, &self.dir))?;
        log::info!(
            "converted {} to one record per jail in {} ({} records); the old file is kept as {}",
            from.display(),
            self.dir.join(JAILS_DIR).display(),
            files.len(),
            to.display()
        );
        Ok(())
    }
}

/// `state`'s jail records, by jail name.
fn split(state: &AgentState) -> BTreeMap<String, JailFile> {
    let mut files: BTreeMap<String, JailFile> = BTreeMap::new();
    for (name, rec) in &state.jails {
        files.entry(name.clone()).or_default().desired = Some(rec.clone());
    }
    for (name, jail) in &state.deleting {
        files.entry(name.clone()).or_default().deleting = Some(jail.clone());
    }
    for entry in &state.backoff.entries {
        if let Some(file) = files.get_mut(&entry.key) {
            file.backoff = Some(entry.clone());
        }
    }
    files
}

/// The state the records and the node record say.
fn assemble(node: NodeRecord, records: BTreeMap<String, JailFile>) -> AgentState {
    let mut state = AgentState {
        node_subnet: node.node_subnet,
        cluster_routes: node.cluster_routes,
        service_vips: node.service_vips,
        ..AgentState::default()
    };
    let mut entries = Vec::new();
    for (name, file) in records {
        if let Some(mut entry) = file.backoff {
            entry.key = name.clone();
            entries.push(entry);
        }
        if let Some(rec) = file.desired {
            state.jails.insert(name.clone(), rec);
        }
        if let Some(jail) = file.deleting {
            state.deleting.insert(name, jail);
        }
    }
    state.backoff = Snapshot { entries };
    state
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agentd::fixtures::jail;
    use crate::common::store::FaultyFs;

    /// What an agent of the single-file layout had saved: two jails (one
    /// crash-looping), a pending delete, and node-wide state.
    fn old_state() -> AgentState {
        let record = |name: &str, last: u8| JailRecord {
            spec: jail(name, None),
            address: Ipv4Addr::new(10, 20, 0, last),
            epoch: Some(7),
            created_unix: 1_700_000_000,
            restarts: 2,
            deployed: None,
        };
        let mut state = AgentState::default();
        state.jails.insert("web".into(), record("web", 2));
        state.jails.insert("db".into(), record("db", 3));
        state
            .deleting
            .insert("old".into(), jail("old", Some("10.20.0.4")));
        state.backoff = Snapshot {
            entries: vec![SnapshotEntry {
                key: "web".into(),
                restarts: 2,
                delay_ms: Some(4000),
            }],
        };
        state.node_subnet = Some("10.20.0.0/24".parse().expect("subnet"));
        state.cluster_routes = ["10.20.1.0/24".parse().expect("route")].into();
        state.service_vips = [Ipv4Addr::new(10, 96, 0, 1)].into();
        state
    }

    fn write_old_file(dir: &Path, state: &AgentState) {
        let (mut store, _) = Store::<AgentState>::open(dir, STATE_FILE).expect("old store");
        store.save(state).expect("old save");
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    #[test]
    fn a_fresh_directory_holds_no_state_and_opening_writes_nothing() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (_, state) = AgentStore::open(tmp.path()).expect("open");
        assert_eq!(state, None);
        assert!(entries(tmp.path()).is_empty(), "{:?}", entries(tmp.path()));
    }

    #[test]
    fn the_old_single_file_is_converted_once_to_one_record_per_jail() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let old = old_state();
        write_old_file(tmp.path(), &old);
        let original = std::fs::read(tmp.path().join(STATE_FILE)).expect("read");

        let (_, state) = AgentStore::open(tmp.path()).expect("open converts");
        assert_eq!(state.as_ref(), Some(&old));
        assert_eq!(
            entries(tmp.path()),
            [MIGRATED_FILE, NODE_FILE, JAILS_DIR],
            "the old file is kept aside, never read again"
        );
        assert_eq!(
            std::fs::read(tmp.path().join(MIGRATED_FILE)).expect("read"),
            original
        );
        assert_eq!(
            entries(&tmp.path().join(JAILS_DIR)),
            ["db.json", "old.json", "web.json"]
        );

        // A restart reads the records, and the same state.
        let fs = FaultyFs::new();
        let (_, again) = AgentStore::with_fs(tmp.path(), fs.clone()).expect("reopen");
        assert_eq!(again, Some(old));
        assert!(
            fs.log().is_empty(),
            "nothing converted twice: {:?}",
            fs.log()
        );
    }

    /// A crash at any step of the conversion leaves the old file in place;
    /// the next start converts it again and ends with exactly its state,
    /// whatever an earlier attempt left in `records/`.
    /// A directory with the old file, where an earlier, interrupted
    /// conversion left a record the old file does not name.
    fn prepared(old: &AgentState) -> tempfile::TempDir {
        let tmp = tempfile::tempdir().expect("tempdir");
        write_old_file(tmp.path(), old);
        let dir = tmp.path().join(JAILS_DIR);
        let (mut stale, _) =
            RecordStore::<JailFile>::with_fs(&dir, Box::new(RealFs)).expect("records");
        let file = JailFile {
            deleting: Some(jail("ghost", None)),
            ..JailFile::default()
        };
        stale.save("ghost", &file).expect("stale record");
        tmp
    }

    #[test]
    fn a_conversion_interrupted_at_any_step_is_done_again_at_the_next_start() {
        let old = old_state();
        // Every operation of a whole conversion, by step: the crash is
        // injected at each of them in turn.
        let log = {
            let tmp = prepared(&old);
            let fs = FaultyFs::new();
            AgentStore::with_fs(tmp.path(), fs.clone()).expect("convert");
            fs.log()
        };
        let count = |step: Step| {
            log.iter()
                .filter(|l| match step {
                    Step::Write => l.starts_with("write "),
                    Step::Fsync => l.starts_with("fsync ") && l.ends_with(".tmp"),
                    Step::FsyncDir => l.starts_with("fsync ") && !l.ends_with(".tmp"),
                    Step::Rename => l.starts_with("rename "),
                    Step::Remove => l.starts_with("remove "),
                })
                .count()
        };
        let cases: Vec<(Step, usize)> = Step::ALL
            .into_iter()
            .chain([Step::Remove])
            .flat_map(|step| (0..count(step)).map(move |i| (step, i)))
            .collect();
        assert!(cases.contains(&(Step::Remove, 0)), "{cases:?}");
        assert!(cases.len() > 10, "{cases:?}");

        for (step, skip) in cases {
            let tmp = prepared(&old);
            let fs = FaultyFs::new();
            fs.stop_at_nth(step, skip);
            let crashed = AgentStore::with_fs(tmp.path(), fs.clone());
            let committed = step == Step::FsyncDir && crashed.is_err() && {
                // Only the last directory fsync follows the commit point.
                !tmp.path().join(STATE_FILE).exists()
            };
            if !committed {
                assert!(crashed.is_err(), "{step:?} #{skip}: the crash was injected");
                assert!(
                    tmp.path().join(STATE_FILE).exists(),
                    "{step:?} #{skip}: the old file stays until the end"
                );
            }
            let (_, state) = AgentStore::open(tmp.path()).expect("the next start");
            assert_eq!(state.as_ref(), Some(&old), "{step:?} #{skip}");
            assert!(!tmp.path().join(STATE_FILE).exists(), "{step:?} #{skip}");
            assert_eq!(
                entries(&tmp.path().join(JAILS_DIR)),
                ["db.json", "old.json", "web.json"],
                "{step:?} #{skip}: no stale record survives"
            );
        }
    }

    #[test]
    fn a_corrupt_old_file_stops_the_start_and_is_kept() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join(STATE_FILE);
        std::fs::write(&path, b"{\"format\": 1, \"state\": {\"jails\": ").expect("write");
        let err = AgentStore::open(tmp.path()).expect_err("corrupt");
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err:?}");
        assert!(path.exists());
        assert!(!tmp.path().join(JAILS_DIR).exists());
    }

    #[test]
    fn a_jail_save_writes_its_record_alone_and_an_empty_one_removes_it() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = AgentStore::open(tmp.path()).expect("open");
        store.save_all(&old_state()).expect("seed");
        let fs = FaultyFs::new();
        let (mut store, _) = AgentStore::with_fs(tmp.path(), fs.clone()).expect("reopen");
        let file = JailFile {
            desired: old_state().jails.get("web").cloned(),
            ..JailFile::default()
        };
        store.save_jail("web", &file).expect("save");
        let touched: Vec<String> = fs.log();
        assert!(
            touched
                .iter()
                .all(|l| !l.contains("db.json") && !l.contains("old.json")),
            "{touched:?}"
        );
        store
            .save_jail("old", &JailFile::default())
            .expect("remove");
        let (_, state) = AgentStore::open(tmp.path()).expect("reopen");
        let state = state.expect("saved");
        assert!(state.deleting.is_empty());
        assert_eq!(state.jails.len(), 2);
        assert!(state.backoff.entries.is_empty(), "web's entry was replaced");
    }
}
