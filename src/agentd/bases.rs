//! `keelctl base fetch RELEASE` on the agent: download a release's
//! `base.txz`, verify it against the release's `MANIFEST`, and hand it to the
//! host's [`BaseStore`] to become `{pool}/keel/bases/RELEASE@keel`.
//!
//! A fetch takes minutes, so it never runs on the worker thread, nor on the
//! request's connection thread: [`BaseFetcher::start`] records the fetch and
//! spawns a thread of its own, which posts its progress and its end into the
//! fetcher's table. Nothing here is reconciler state: the host's datasets are
//! the truth about which bases exist (a jail's clone finds them, or says to
//! run the fetch), and the table only remembers what a running or failed
//! fetch has to say. It is lost on restart, which loses nothing: a fetch cut
//! short leaves a dataset without `@keel` (shown `Partial`) or a `.part`
//! download, and the next fetch destroys and redoes both.
//!
//! The order of steps is what keeps a half base from ever looking whole:
//! download into `{cache}/RELEASE/base.txz.part` while hashing it; compare
//! with the MANIFEST's SHA-256 (a mismatch deletes the download and leaves no
//! dataset); destroy any partial dataset; create, extract, and only then
//! snapshot `@keel`. A failed extraction destroys its dataset. A base with
//! its snapshot is never touched again: a second fetch answers at once.
//!
//! Mirrors: `agent.base_mirror`, then `agent.base_archive` when the mirror
//! has no `RELEASE/MANIFEST` (FreeBSD moves end-of-life releases to its
//! archive). `http://`, `https://` (ureq) and `file://` (a local directory
//! laid out like a mirror, which is also how tests serve a tarball) are
//! understood.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::common::sync::lock;
use crate::common::wire::{BaseState, BaseStatus};
use crate::host::base::{BaseDataset, BaseError, BaseStore};

/// The distribution set a base is made of.
pub const BASE_TARBALL: &str = "base.txz";

/// The checksum list every FreeBSD release directory carries.
pub const MANIFEST: &str = "MANIFEST";

/// A MANIFEST larger than this is not one (the real one is under 1 KiB).
const MANIFEST_MAX: u64 = 64 * 1024;

/// Connecting to a mirror, and any one read from it, may take this long; the
/// download as a whole may take as long as it keeps moving.
const MIRROR_TIMEOUT: Duration = Duration::from_secs(60);

/// What a fetch needs besides the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchSettings {
    /// Release directories' parent URLs, tried in order (`agent.base_mirror`,
    /// then `agent.base_archive`).
    pub mirrors: Vec<String>,
    /// Where downloads are kept until they are extracted
    /// (`{state_dir}/base-downloads`).
    pub cache_dir: PathBuf,
}

/// Why a fetch could not start, or a listing could not be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BaseFetchError {
    /// The host could not list its bases.
    Host(BaseError),
    /// The fetch thread could not be started.
    Spawn(String),
}

impl fmt::Display for BaseFetchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BaseFetchError::Host(e) => write!(f, "cannot list the bases: {e}"),
            BaseFetchError::Spawn(e) => write!(f, "cannot start the fetch thread: {e}"),
        }
    }
}

impl std::error::Error for BaseFetchError {}

/// Why one fetch failed; the message ends up in `get bases`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchError {
    /// No mirror has the release's MANIFEST.
    NoSuchRelease {
        /// The release.
        release: String,
        /// Every MANIFEST URL tried, with its answer.
        tried: Vec<String>,
    },
    /// A mirror could not be read.
    Download {
        /// The URL.
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// The MANIFEST has no `base.txz` line, or a malformed one.
    Manifest {
        /// The MANIFEST's URL.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The downloaded `base.txz` is not the one the MANIFEST names.
    ChecksumMismatch {
        /// Where it came from.
        url: String,
        /// The MANIFEST's SHA-256.
        expected: String,
        /// The download's SHA-256.
        actual: String,
    },
    /// The download could not be stored in the cache directory.
    Cache {
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        reason: String,
    },
    /// A host step (create, extract, snapshot, destroy) failed.
    Host(BaseError),
}

impl fmt::Display for FetchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FetchError::NoSuchRelease { release, tried } => write!(
                f,
                "no mirror has release {release} ({}); check the release name (e.g. 14.5-RELEASE) and agent.base_mirror / agent.base_archive in keel.toml",
                tried.join("; ")
            ),
            FetchError::Download { url, reason } => write!(
                f,
                "could not download {url}: {reason}; check the network and agent.base_mirror, then run the fetch again"
            ),
            FetchError::Manifest { url, reason } => write!(
                f,
                "{url} is not a usable MANIFEST: {reason}; the mirror may be broken, try another agent.base_mirror"
            ),
            FetchError::ChecksumMismatch {
                url,
                expected,
                actual,
            } => write!(
                f,
                "checksum mismatch for {url}: MANIFEST says SHA-256 {expected}, the download is {actual}; the download was deleted and nothing was installed: run the fetch again, or use another agent.base_mirror"
            ),
            FetchError::Cache { path, reason } => write!(
                f,
                "could not write {}: {reason}; check the space and permissions of agent.state_dir",
                path.display()
            ),
            FetchError::Host(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for FetchError {}

impl From<BaseError> for FetchError {
    fn from(e: BaseError) -> Self {
        FetchError::Host(e)
    }
}

/// What [`BaseFetcher::start`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Started {
    /// The base is there with its snapshot; nothing was done.
    Present(BaseStatus),
    /// A fetch runs (this call started it, or one was already running).
    Running(BaseStatus),
}

/// What a running or failed fetch has to say.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Progress {
    state: BaseState,
    downloaded: u64,
    total: Option<u64>,
    source: Option<String>,
    error: Option<String>,
}

impl Progress {
    fn running(&self) -> bool {
        matches!(self.state, BaseState::Downloading | BaseState::Extracting)
    }
}

type Table = Arc<Mutex<BTreeMap<String, Progress>>>;

/// Starts fetches and answers what the bases look like; cheap to share
/// between connection threads (`Arc`).
pub struct BaseFetcher {
    store: Arc<dyn BaseStore>,
    settings: Arc<FetchSettings>,
    fetches: Table,
    // Kept so tests can wait for a fetch to end instead of polling.
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl BaseFetcher {
    /// Fetches into `store` with `settings`.
    pub fn new(store: Arc<dyn BaseStore>, settings: FetchSettings) -> BaseFetcher {
        BaseFetcher {
            store,
            settings: Arc::new(settings),
            fetches: Arc::default(),
            threads: Mutex::default(),
        }
    }

    /// Every base the host has, and every release a fetch runs or failed
    /// for, sorted by release.
    pub fn list(&self) -> Result<Vec<BaseStatus>, BaseFetchError> {
        let host = self.store.list().map_err(BaseFetchError::Host)?;
        let fetches = lock(&self.fetches).clone();
        let mut out: BTreeMap<String, BaseStatus> = host
            .iter()
            .map(|b| (b.release.clone(), status(&b.release, Some(b), None)))
            .collect();
        for (release, progress) in &fetches {
            let on_host = host.iter().find(|b| &b.release == release);
            // A fetch that finished is only the host's business now.
            if on_host.is_some_and(|b| b.snapshot) && !progress.running() {
                continue;
            }
            out.insert(release.clone(), status(release, on_host, Some(progress)));
        }
        Ok(out.into_values().collect())
    }

    /// One release, `None` when the host has no such base and no fetch ran.
    pub fn get(&self, release: &str) -> Result<Option<BaseStatus>, BaseFetchError> {
        Ok(self.list()?.into_iter().find(|b| b.release == release))
    }

    /// Makes `release` exist: at once when it is there with its snapshot,
    /// else by a fetch on a thread of its own (joined to a running one).
    /// `release` was checked by `common::spec::validate_base`.
    pub fn start(&self, release: &str) -> Result<Started, BaseFetchError> {
        // The host is asked without the table locked (a zfs list may take a
        // while, and the running fetches post their progress meanwhile); the
        // table is checked again after, so two calls never start two fetches.
        let on_host = self.host_base(release)?;
        let mut fetches = lock(&self.fetches);
        if let Some(p) = fetches.get(release).filter(|p| p.running()) {
            return Ok(Started::Running(status(release, on_host.as_ref(), Some(p))));
        }
        if let Some(base) = on_host.as_ref().filter(|b| b.snapshot) {
            fetches.remove(release);
            return Ok(Started::Present(status(release, Some(base), None)));
        }
        let progress = Progress {
            state: BaseState::Downloading,
            downloaded: 0,
            total: None,
            source: None,
            error: None,
        };
        fetches.insert(release.to_string(), progress.clone());
        let job = FetchJob {
            release: release.to_string(),
            store: self.store.clone(),
            settings: self.settings.clone(),
            fetches: self.fetches.clone(),
        };
        let spawned = std::thread::Builder::new()
            .name(format!("keel-base-{release}"))
            .spawn(move || job.run());
        match spawned {
            Ok(handle) => {
                let mut threads = lock(&self.threads);
                threads.retain(|t| !t.is_finished());
                threads.push(handle);
            }
            Err(e) => {
                fetches.remove(release);
                return Err(BaseFetchError::Spawn(e.to_string()));
            }
        }
        Ok(Started::Running(status(
            release,
            on_host.as_ref(),
            Some(&progress),
        )))
    }

    /// Waits until every fetch started so far has ended.
    #[cfg(test)]
    fn join(&self) {
        let threads = std::mem::take(&mut *lock(&self.threads));
        for t in threads {
            t.join().expect("the fetch thread does not panic");
        }
    }

    fn host_base(&self, release: &str) -> Result<Option<BaseDataset>, BaseFetchError> {
        Ok(self
            .store
            .list()
            .map_err(BaseFetchError::Host)?
            .into_iter()
            .find(|b| b.release == release))
    }
}

fn status(release: &str, host: Option<&BaseDataset>, progress: Option<&Progress>) -> BaseStatus {
    let state = match (progress, host) {
        (Some(p), _) if p.running() || p.state == BaseState::Failed => p.state,
        (_, Some(b)) if b.snapshot => BaseState::Ready,
        (_, Some(_)) => BaseState::Partial,
        (_, None) => BaseState::Failed,
    };
    let running = progress.filter(|p| p.running());
    BaseStatus {
        release: release.to_string(),
        state,
        used: host.map(|b| b.used),
        snapshot: host.is_some_and(|b| b.snapshot),
        downloaded: running.map(|p| p.downloaded),
        total: running.and_then(|p| p.total),
        source: progress.and_then(|p| p.source.clone()),
        error: progress.and_then(|p| p.error.clone()),
    }
}

/// One fetch, on its own thread.
struct FetchJob {
    release: String,
    store: Arc<dyn BaseStore>,
    settings: Arc<FetchSettings>,
    fetches: Table,
}

impl FetchJob {
    fn run(self) {
        let result = self.fetch();
        let mut fetches = lock(&self.fetches);
        match result {
            Ok(()) => {
                log::info!("base {} fetched", self.release);
                fetches.remove(&self.release);
            }
            Err(e) => {
                log::warn!("fetch of base {}: {e}", self.release);
                if let Some(p) = fetches.get_mut(&self.release) {
                    p.state = BaseState::Failed;
                    p.error = Some(e.to_string());
                }
            }
        }
    }

    fn update(&self, change: impl FnOnce(&mut Progress)) {
        if let Some(p) = lock(&self.fetches).get_mut(&self.release) {
            change(p);
        }
    }

    fn fetch(&self) -> Result<(), FetchError> {
        let release = &self.release;
        let (dir_url, expected) = self.manifest()?;
        let url = format!("{dir_url}/{BASE_TARBALL}");
        self.update(|p| p.source = Some(url.clone()));
        let tarball = self.download(&url, &expected)?;

        let on_host = self
            .store
            .list()?
            .into_iter()
            .find(|b| &b.release == release);
        match on_host {
            // Another fetch finished meanwhile (or an admin made it).
            Some(b) if b.snapshot => return remove_cached(&tarball),
            Some(_) => {
                log::info!("base {release}: destroying the partial dataset of an earlier fetch");
                self.store.destroy_partial(release)?;
            }
            None => {}
        }
        self.update(|p| p.state = BaseState::Extracting);
        self.store.create(release)?;
        if let Err(e) = self.store.extract(release, &tarball) {
            if let Err(cleanup) = self.store.destroy_partial(release) {
                log::warn!("base {release}: could not destroy the partial dataset: {cleanup}");
            }
            return Err(e.into());
        }
        self.store.snapshot(release)?;
        remove_cached(&tarball)
    }

    /// The first mirror's release directory that has a MANIFEST, and the
    /// SHA-256 it gives `base.txz`.
    fn manifest(&self) -> Result<(String, String), FetchError> {
        let mut tried = Vec::new();
        for mirror in &self.settings.mirrors {
            let dir = format!("{}/{}", mirror.trim_end_matches('/'), self.release);
            let url = format!("{dir}/{MANIFEST}");
            match open(&url) {
                Ok(source) => {
                    let mut text = String::new();
                    source
                        .reader
                        .take(MANIFEST_MAX)
                        .read_to_string(&mut text)
                        .map_err(|e| FetchError::Download {
                            url: url.clone(),
                            reason: e.to_string(),
                        })?;
                    let sum = manifest_sha256(&text, BASE_TARBALL)
                        .map_err(|reason| FetchError::Manifest { url, reason })?;
                    return Ok((dir, sum));
                }
                Err(Opened::NotFound) => tried.push(format!("{url}: not found")),
                Err(Opened::Failed(reason)) => return Err(FetchError::Download { url, reason }),
            }
        }
        Err(FetchError::NoSuchRelease {
            release: self.release.clone(),
            tried,
        })
    }

    /// Downloads `url` into the cache while hashing it; the file is kept
    /// only when its SHA-256 is `expected`.
    fn download(&self, url: &str, expected: &str) -> Result<PathBuf, FetchError> {
        let dir = self.settings.cache_dir.join(&self.release);
        let cache = |path: &Path, e: std::io::Error| FetchError::Cache {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        std::fs::create_dir_all(&dir).map_err(|e| cache(&dir, e))?;
        let done = dir.join(BASE_TARBALL);
        let part = dir.join(format!("{BASE_TARBALL}.part"));
        let failed = |reason: String| FetchError::Download {
            url: url.to_string(),
            reason,
        };
        let source = match open(url) {
            Ok(s) => s,
            Err(Opened::NotFound) => return Err(failed("not found".into())),
            Err(Opened::Failed(reason)) => return Err(failed(reason)),
        };
        self.update(|p| p.total = source.size);
        let mut reader = source.reader;
        let mut out = File::create(&part).map_err(|e| cache(&part, e))?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 256 * 1024];
        let mut downloaded = 0u64;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let _ = std::fs::remove_file(&part);
                    return Err(failed(e.to_string()));
                }
            };
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(|e| cache(&part, e))?;
            downloaded += n as u64;
            self.update(|p| p.downloaded = downloaded);
        }
        out.sync_all().map_err(|e| cache(&part, e))?;
        drop(out);
        let actual = hex(&hasher.finalize());
        if !actual.eq_ignore_ascii_case(expected) {
            let _ = std::fs::remove_file(&part);
            let _ = std::fs::remove_dir(&dir);
            return Err(FetchError::ChecksumMismatch {
                url: url.to_string(),
                expected: expected.to_string(),
                actual,
            });
        }
        std::fs::rename(&part, &done).map_err(|e| cache(&done, e))?;
        Ok(done)
    }
}

fn remove_cached(tarball: &Path) -> Result<(), FetchError> {
    match std::fs::remove_file(tarball) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => log::warn!("could not remove {}: {e}", tarball.display()),
    }
    if let Some(dir) = tarball.parent() {
        let _ = std::fs::remove_dir(dir);
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 a release MANIFEST gives `file`. The format is the one
/// FreeBSD's release build writes: one TAB-separated line per distribution
/// set, `base.txz  SHA256  FILE-COUNT  base  "Description"  on`.
pub fn manifest_sha256(manifest: &str, file: &str) -> Result<String, String> {
    for line in manifest.lines() {
        let mut fields = line.split('\t');
        if fields.next() != Some(file) {
            continue;
        }
        let sum = fields.next().unwrap_or_default().trim();
        if sum.len() == 64 && sum.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(sum.to_ascii_lowercase());
        }
        return Err(format!(
            "its {file} line has `{sum}` where a SHA-256 (64 hex digits) belongs"
        ));
    }
    Err(format!("it has no {file} line"))
}

/// An opened mirror file.
struct Source {
    reader: Box<dyn Read + Send>,
    size: Option<u64>,
}

enum Opened {
    NotFound,
    Failed(String),
}

/// Opens `url` for reading: `file://` as a local file, `http(s)://`
/// through ureq (a 404 is [`Opened::NotFound`], so the archive is tried).
fn open(url: &str) -> Result<Source, Opened> {
    if let Some(path) = url.strip_prefix("file://") {
        return match File::open(path) {
            Ok(f) => {
                let size = f.metadata().ok().map(|m| m.len());
                Ok(Source {
                    reader: Box::new(f),
                    size,
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Opened::NotFound),
            Err(e) => Err(Opened::Failed(e.to_string())),
        };
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(MIRROR_TIMEOUT))
        .timeout_recv_response(Some(MIRROR_TIMEOUT))
        .timeout_per_read(Some(MIRROR_TIMEOUT))
        .build()
        .into();
    let response = agent
        .get(url)
        .call()
        .map_err(|e| Opened::Failed(e.to_string()))?;
    match response.status().as_u16() {
        200 => {
            let body = response.into_body();
            let size = body.content_length();
            Ok(Source {
                reader: Box::new(body.into_reader()),
                size,
            })
        }
        404 | 410 => Err(Opened::NotFound),
        other => Err(Opened::Failed(format!("the server answered HTTP {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::base::FakeBases;
    use crate::host::fake::{CallLog, Faults};

    const SUM: &str = "0f2a7c5d3b1e4a6f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f7";

    #[test]
    fn the_manifest_gives_the_base_checksum() {
        let manifest = format!(
            "base-dbg.txz\t{}\t10\tbase-dbg\t\"Base system (Debugging)\"\toff\n\
             base.txz\t{SUM}\t32000\tbase\t\"Base system (MANDATORY)\"\ton\n",
            "1".repeat(64)
        );
        assert_eq!(manifest_sha256(&manifest, "base.txz"), Ok(SUM.to_string()));
        assert!(
            manifest_sha256("kernel.txz\tx\n", "base.txz")
                .expect_err("missing")
                .contains("no base.txz line")
        );
        assert!(
            manifest_sha256("base.txz\tnothex\t1\n", "base.txz")
                .expect_err("bad sum")
                .contains("nothex")
        );
    }

    /// A mirror directory with `release/MANIFEST` and `release/base.txz`.
    fn mirror(root: &Path, release: &str, tarball: &[u8], manifest_sum: &str) -> String {
        let dir = root.join("mirror").join(release);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join(BASE_TARBALL), tarball).expect("tarball");
        std::fs::write(
            dir.join(MANIFEST),
            format!("base.txz\t{manifest_sum}\t3\tbase\t\"Base system (MANDATORY)\"\ton\n"),
        )
        .expect("manifest");
        format!("file://{}", root.join("mirror").display())
    }

    fn sha(bytes: &[u8]) -> String {
        hex(&Sha256::digest(bytes))
    }

    fn fetcher(root: &Path, mirrors: Vec<String>, store: &FakeBases) -> BaseFetcher {
        BaseFetcher::new(
            Arc::new(store.clone()),
            FetchSettings {
                mirrors,
                cache_dir: root.join("cache"),
            },
        )
    }

    fn wait_done(f: &BaseFetcher, release: &str) -> BaseStatus {
        f.join();
        f.get(release).expect("lists").expect("known")
    }

    #[test]
    fn a_verified_fetch_creates_extracts_then_snapshots_and_a_second_is_a_no_op() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = CallLog::new();
        let store = FakeBases::new(log.clone(), Faults::default());
        let url = mirror(dir.path(), "14.5-RELEASE", b"tarball", &sha(b"tarball"));
        let f = fetcher(dir.path(), vec![url], &store);
        assert!(matches!(f.start("14.5-RELEASE"), Ok(Started::Running(_))));
        let done = wait_done(&f, "14.5-RELEASE");
        assert_eq!(done.state, BaseState::Ready, "{done:?}");
        assert!(done.snapshot);
        assert_eq!(
            log.entries(),
            [
                "base.create 14.5-RELEASE",
                "base.extract 14.5-RELEASE",
                "base.snapshot 14.5-RELEASE"
            ]
        );
        assert!(matches!(f.start("14.5-RELEASE"), Ok(Started::Present(_))));
        assert_eq!(log.entries().len(), 3, "nothing more ran");
        assert!(!dir.path().join("cache/14.5-RELEASE").exists());
    }

    #[test]
    fn a_checksum_mismatch_leaves_no_dataset_and_no_download() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = CallLog::new();
        let store = FakeBases::new(log.clone(), Faults::default());
        let url = mirror(dir.path(), "14.5-RELEASE", b"corrupted", &sha(b"tarball"));
        let f = fetcher(dir.path(), vec![url], &store);
        f.start("14.5-RELEASE").expect("starts");
        let done = wait_done(&f, "14.5-RELEASE");
        assert_eq!(done.state, BaseState::Failed);
        let error = done.error.expect("says why");
        assert!(error.contains("checksum mismatch"), "{error}");
        assert!(error.contains(&sha(b"tarball")), "{error}");
        assert!(log.entries().is_empty(), "{:?}", log.entries());
        assert!(!dir.path().join("cache/14.5-RELEASE").exists());
    }

    #[test]
    fn a_release_the_mirror_lacks_comes_from_the_archive() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FakeBases::new(CallLog::new(), Faults::default());
        let archive = mirror(dir.path(), "13.2-RELEASE", b"old", &sha(b"old"));
        let empty = format!("file://{}", dir.path().join("empty").display());
        let f = fetcher(dir.path(), vec![empty, archive.clone()], &store);
        f.start("13.2-RELEASE").expect("starts");
        assert_eq!(wait_done(&f, "13.2-RELEASE").state, BaseState::Ready);

        let f = fetcher(dir.path(), vec![archive], &store);
        f.start("12.0-RELEASE").expect("starts");
        let error = wait_done(&f, "12.0-RELEASE").error.expect("fails");
        assert!(
            error.contains("no mirror has release 12.0-RELEASE"),
            "{error}"
        );
    }

    #[test]
    fn a_partial_dataset_is_destroyed_and_redone_and_a_failed_extraction_leaves_none() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = CallLog::new();
        let faults = Faults::default();
        let store = FakeBases::new(log.clone(), faults.clone());
        store.insert(BaseDataset {
            release: "14.5-RELEASE".into(),
            used: 5,
            snapshot: false,
            mountpoint: None,
        });
        let url = mirror(dir.path(), "14.5-RELEASE", b"tarball", &sha(b"tarball"));
        let f = fetcher(dir.path(), vec![url], &store);
        assert_eq!(
            f.get("14.5-RELEASE").expect("lists").map(|s| s.state),
            Some(BaseState::Partial)
        );
        faults.fail_times("extract", Some("14.5-RELEASE"), 1);
        f.start("14.5-RELEASE").expect("starts");
        assert_eq!(wait_done(&f, "14.5-RELEASE").state, BaseState::Failed);
        assert_eq!(
            log.entries(),
            [
                "base.destroy_partial 14.5-RELEASE",
                "base.create 14.5-RELEASE",
                "base.extract 14.5-RELEASE",
                "base.destroy_partial 14.5-RELEASE"
            ]
        );
        assert!(store.list().expect("lists").is_empty());
        f.start("14.5-RELEASE").expect("starts again");
        assert_eq!(wait_done(&f, "14.5-RELEASE").state, BaseState::Ready);
    }

    /// Serves `files` (path -> body) over HTTP/1.1 on loopback for exactly
    /// `requests` connections, 404 for any other path; returns its base URL.
    fn serve(
        files: Vec<(String, Vec<u8>)>,
        requests: usize,
    ) -> (String, std::thread::JoinHandle<Vec<String>>) {
        use std::io::{BufRead, BufReader};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let server = std::thread::spawn(move || {
            let mut asked = Vec::new();
            for _ in 0..requests {
                let (mut conn, _) = listener.accept().expect("accept");
                let mut reader = BufReader::new(conn.try_clone().expect("clone"));
                let mut line = String::new();
                reader.read_line(&mut line).expect("request line");
                let path = line.split(' ').nth(1).unwrap_or_default().to_string();
                loop {
                    let mut header = String::new();
                    reader.read_line(&mut header).expect("header");
                    if header == "\r\n" || header.is_empty() {
                        break;
                    }
                }
                let (status, body) = match files.iter().find(|(p, _)| *p == path) {
                    Some((_, body)) => ("200 OK", body.clone()),
                    None => ("404 Not Found", b"not here".to_vec()),
                };
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                conn.write_all(head.as_bytes()).expect("head");
                conn.write_all(&body).expect("body");
                asked.push(path);
            }
            asked
        });
        (url, server)
    }

    #[test]
    fn over_http_a_404_on_the_mirror_falls_back_to_the_archive() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FakeBases::new(CallLog::new(), Faults::default());
        let tarball = b"an old release".to_vec();
        let manifest = format!(
            "base.txz\t{}\t3\tbase\t\"Base system (MANDATORY)\"\ton\n",
            sha(&tarball)
        );
        let (url, server) = serve(
            vec![
                (
                    "/archive/13.2-RELEASE/MANIFEST".into(),
                    manifest.into_bytes(),
                ),
                ("/archive/13.2-RELEASE/base.txz".into(), tarball.clone()),
            ],
            3,
        );
        let f = fetcher(
            dir.path(),
            vec![format!("{url}/mirror"), format!("{url}/archive/")],
            &store,
        );
        f.start("13.2-RELEASE").expect("starts");
        let done = wait_done(&f, "13.2-RELEASE");
        assert_eq!(done.state, BaseState::Ready, "{done:?}");
        assert_eq!(
            server.join().expect("server"),
            [
                "/mirror/13.2-RELEASE/MANIFEST",
                "/archive/13.2-RELEASE/MANIFEST",
                "/archive/13.2-RELEASE/base.txz"
            ]
        );
        assert_eq!(store.list().expect("lists")[0].used, tarball.len() as u64);
    }
}
