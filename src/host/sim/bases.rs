//! Simulated bases: a base is the directory `{bases_dir}/{release}`, its
//! `@keel` snapshot the marker file `{bases_dir}/.{release}@keel`, and the
//! extraction is the system's tar(1) run on the tarball (GNU tar and bsdtar
//! both detect xz themselves), so a simulated base holds the real files.
//!
//! Clones do not read from here: a simulated rootfs stays an empty
//! directory (`SimZfs`), workloads run host binaries. This file only ever
//! writes and deletes below `bases_dir`, never through a symlink.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::zfs::{remove_tree, used_bytes};
use super::{SimError, create_dir, is_plain_name};
use crate::common::cmd::{CommandRunner, SystemRunner};
use crate::host::base::{
    BASE_SNAPSHOT, BaseDataset, BaseError, BaseLayout, BaseStore, EXTRACT_TIMEOUT, extract_argv,
};

/// [`BaseStore`] over directories.
#[derive(Debug, Clone)]
pub struct SimBases {
    layout: BaseLayout,
    tar: PathBuf,
    runner: Arc<SystemRunner>,
}

impl SimBases {
    /// Bases under `layout.bases_dir` (created if missing), extracted with
    /// the tar(1) at `tar`.
    pub fn new(layout: BaseLayout, tar: PathBuf) -> Result<SimBases, SimError> {
        create_dir(&layout.bases_dir)?;
        Ok(SimBases {
            layout,
            tar,
            runner: Arc::new(SystemRunner),
        })
    }

    fn dir(&self, release: &str) -> Result<PathBuf, BaseError> {
        if is_plain_name(release) {
            Ok(self.layout.path(release))
        } else {
            Err(BaseError::Io {
                action: "use the base directory".into(),
                path: self.layout.bases_dir.join(release),
                reason: "not a plain release name".into(),
            })
        }
    }

    fn marker(&self, release: &str) -> PathBuf {
        self.layout
            .bases_dir
            .join(format!(".{release}@{BASE_SNAPSHOT}"))
    }
}

fn io(action: &str, path: &Path, e: std::io::Error) -> BaseError {
    BaseError::Io {
        action: action.into(),
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

impl BaseStore for SimBases {
    fn layout(&self) -> &BaseLayout {
        &self.layout
    }

    fn list(&self) -> Result<Vec<BaseDataset>, BaseError> {
        let dir = &self.layout.bases_dir;
        let entries = std::fs::read_dir(dir).map_err(|e| io("read", dir, e))?;
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let Some(release) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if release.starts_with('.') || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let path = entry.path();
            out.push(BaseDataset {
                snapshot: self.marker(&release).exists(),
                used: used_bytes(&path),
                mountpoint: Some(path),
                release,
            });
        }
        out.sort_by(|a, b| a.release.cmp(&b.release));
        Ok(out)
    }

    fn create(&self, release: &str) -> Result<PathBuf, BaseError> {
        let dir = self.dir(release)?;
        std::fs::create_dir_all(&dir).map_err(|e| io("create", &dir, e))?;
        Ok(dir)
    }

    fn extract(&self, release: &str, tarball: &Path) -> Result<(), BaseError> {
        let dir = self.dir(release)?;
        let argv = extract_argv(&self.tar, &dir, tarball);
        self.runner
            .run(&argv, None, EXTRACT_TIMEOUT)?
            .check(&argv)?;
        crate::common::faults::inject("sim.base.extract");
        Ok(())
    }

    fn snapshot(&self, release: &str) -> Result<(), BaseError> {
        let dir = self.dir(release)?;
        if !dir.is_dir() {
            return Err(BaseError::Io {
                action: "snapshot".into(),
                path: dir,
                reason: "dataset does not exist".into(),
            });
        }
        let marker = self.marker(release);
        std::fs::write(&marker, b"").map_err(|e| io("write", &marker, e))
    }

    fn destroy_partial(&self, release: &str) -> Result<(), BaseError> {
        let dir = self.dir(release)?;
        if self.marker(release).exists() {
            return Err(BaseError::Io {
                action: "destroy".into(),
                path: dir,
                reason: format!("it has its @{BASE_SNAPSHOT} snapshot: it is a complete base"),
            });
        }
        match remove_tree(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("destroy", &dir, e)),
        }
    }
}
