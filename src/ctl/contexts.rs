//! keelctl's contexts file, `~/.config/keel/config.toml`
//! (`$XDG_CONFIG_HOME/keel/config.toml` when that is set): named places to
//! send requests, each a control plane with its operator key file or one
//! agent's socket, and the one in use, as kubectl keeps them in its
//! kubeconfig:
//!
//! ```toml
//! current-context = "prod"
//!
//! [contexts.prod]
//! controlplane = "cp1.example.org:7400"
//! key_file = "/home/ops/.config/keel/prod.key"
//!
//! [contexts.lab]
//! socket = "/var/run/keel/agentd.sock"
//! ```
//!
//! This module owns the file: where it is, what a valid one holds, and
//! replacing it whole (a temporary file renamed over it, so an interrupted
//! `use-context` leaves the old file, never half of one). It never decides
//! where a request goes; [`super::target`] does, with a context as one of its
//! sources. It never holds a key: a context names the key file.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::common::names::validate_name;

/// The file, below the configuration directory.
const RELATIVE_PATH: &str = "keel/config.toml";

/// The contexts file's path for this user: `$XDG_CONFIG_HOME/keel/config.toml`
/// when that is set and absolute (the XDG rule), else
/// `$HOME/.config/keel/config.toml`; `None` without either.
pub fn default_path(xdg_config_home: Option<&Path>, home: Option<&Path>) -> Option<PathBuf> {
    match (xdg_config_home, home) {
        (Some(xdg), _) if xdg.is_absolute() => Some(xdg.join(RELATIVE_PATH)),
        (_, Some(home)) if home.is_absolute() => Some(home.join(".config").join(RELATIVE_PATH)),
        _ => None,
    }
}

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Contexts {
    /// The context commands use when no flag or variable says otherwise.
    #[serde(
        rename = "current-context",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub current: Option<String>,
    /// Every context, by name.
    #[serde(default)]
    pub contexts: BTreeMap<String, Context>,
}

/// One place requests go: a control plane (with the key file to sign with)
/// or one agent's socket, never both.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Context {
    /// `HOST:PORT` of keel-controlplane.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controlplane: Option<String>,
    /// The operator key file; without one, `$KEEL_KEY_FILE` or
    /// `ctl.key_file` of keel.toml.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// keel-agentd's socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
}

impl Context {
    /// Where it sends requests, for listings: `HOST:PORT` or the socket.
    pub fn server(&self) -> String {
        match (&self.controlplane, &self.socket) {
            (Some(addr), _) => addr.clone(),
            (None, Some(socket)) => socket.display().to_string(),
            (None, None) => String::new(),
        }
    }
}

/// Why the contexts file could not be used; nothing was changed.
#[derive(Debug)]
pub enum ContextsError {
    /// Neither `$XDG_CONFIG_HOME` nor `$HOME` says where the file is.
    NoHome,
    /// The file could not be read, or replaced.
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done: `read`, `create`, `write`, `replace`.
        action: &'static str,
        /// The operating system's reason.
        error: io::Error,
    },
    /// The file is not a valid contexts file.
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the key.
        message: String,
    },
    /// `config current-context` with no current context set.
    NoCurrent {
        /// The file (it may not exist).
        path: PathBuf,
    },
    /// A context of that name is not in the file.
    Unknown {
        /// The file (it may not exist).
        path: PathBuf,
        /// The name asked for.
        name: String,
        /// The names there are.
        known: Vec<String>,
    },
}

impl fmt::Display for ContextsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ContextsError::NoHome => f.write_str(
                "cannot find the contexts file: neither $XDG_CONFIG_HOME nor $HOME is set to an \
                 absolute path",
            ),
            ContextsError::Io {
                path,
                action,
                error,
            } => write!(f, "cannot {action} {}: {error}", path.display()),
            ContextsError::Invalid { path, message } => {
                write!(
                    f,
                    "{} is not a valid contexts file: {message}",
                    path.display()
                )
            }
            ContextsError::NoCurrent { path } => write!(
                f,
                "no current context is set in {}; choose one with `keelctl config use-context NAME`",
                path.display()
            ),
            ContextsError::Unknown { path, name, known } if known.is_empty() => write!(
                f,
                "no context named {name:?}: {} defines none; add one with `keelctl config \
                 set-context {name} --controlplane HOST:PORT --key-file PATH`",
                path.display()
            ),
            ContextsError::Unknown { path, name, known } => write!(
                f,
                "no context named {name:?} in {} (it has {})",
                path.display(),
                known.join(", ")
            ),
        }
    }
}

impl std::error::Error for ContextsError {}

impl Contexts {
    /// Reads the file at `path`; a missing file is an empty one.
    pub fn load(path: &Path) -> Result<Contexts, ContextsError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Contexts::default()),
            Err(error) => {
                return Err(ContextsError::Io {
                    path: path.to_path_buf(),
                    action: "read",
                    error,
                });
            }
        };
        let invalid = |message: String| ContextsError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let contexts: Contexts = toml::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        contexts.check().map_err(invalid)?;
        Ok(contexts)
    }

    /// The context `name`.
    pub fn get(&self, path: &Path, name: &str) -> Result<&Context, ContextsError> {
        self.contexts
            .get(name)
            .ok_or_else(|| ContextsError::Unknown {
                path: path.to_path_buf(),
                name: name.to_string(),
                known: self.contexts.keys().cloned().collect(),
            })
    }

    /// What is wrong with the file, naming the key: every name a DNS label,
    /// every context exactly one of `controlplane` or `socket`, a key file
    /// only with a control plane, and `current-context` one of them.
    pub fn check(&self) -> Result<(), String> {
        for (name, context) in &self.contexts {
            check_name(name).map_err(|why| format!("[contexts.{name}]: {why}"))?;
            context
                .check()
                .map_err(|why| format!("contexts.{name}.{why}"))?;
        }
        if let Some(current) = &self.current
            && !self.contexts.contains_key(current)
        {
            return Err(format!(
                "current-context = {current:?} names no context of the file"
            ));
        }
        Ok(())
    }

    /// Replaces the file at `path` with this one: written to a temporary file
    /// beside it (mode 0600, since it names key files), fsynced, renamed
    /// over it. The directory is made (mode 0700) when missing.
    pub fn save(&self, path: &Path) -> Result<(), ContextsError> {
        let io = |action, error| ContextsError::Io {
            path: path.to_path_buf(),
            action,
            error,
        };
        let text = toml::to_string(self).map_err(|e| ContextsError::Invalid {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        if let Some(dir) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| io("create", e))?;
        }
        let mut tmp_name = path.as_os_str().to_owned();
        tmp_name.push(".tmp");
        let tmp = PathBuf::from(tmp_name);
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut file| {
                file.write_all(text.as_bytes())?;
                file.sync_all()
            });
        if let Err(e) = written {
            // Best effort: the error below is what the user needs to see.
            let _ = std::fs::remove_file(&tmp);
            return Err(io("write", e));
        }
        std::fs::rename(&tmp, path).map_err(|e| io("replace", e))
    }
}

impl Context {
    fn check(&self) -> Result<(), String> {
        match (&self.controlplane, &self.socket) {
            (Some(_), Some(_)) => {
                return Err(
                    "socket: a context is a control plane or an agent's socket, not both".into(),
                );
            }
            (None, None) => return Err("controlplane: missing (or give socket)".into()),
            (None, Some(_)) if self.key_file.is_some() => {
                return Err(
                    "key_file: only a control plane takes requests signed with a key".into(),
                );
            }
            (Some(addr), None) => {
                super::check_controlplane(addr, "controlplane").map_err(|e| e.to_string())?
            }
            (None, Some(_)) => {}
        }
        Ok(())
    }
}

/// A context's name: a DNS label, so it is safe in any message or table.
pub fn check_name(name: &str) -> Result<(), String> {
    validate_name(name).map_err(|why| format!("the context name {name:?} {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("keel-contexts-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn the_path_follows_xdg_then_home() {
        let xdg = Path::new("/x");
        let home = Path::new("/home/ops");
        assert_eq!(
            default_path(Some(xdg), Some(home)),
            Some(PathBuf::from("/x/keel/config.toml"))
        );
        assert_eq!(
            default_path(Some(Path::new("relative")), Some(home)),
            Some(PathBuf::from("/home/ops/.config/keel/config.toml"))
        );
        assert_eq!(default_path(None, None), None);
    }

    #[test]
    fn a_saved_file_loads_back_and_a_missing_one_is_empty() {
        let dir = temp_dir("roundtrip");
        let path = dir.join("keel/config.toml");
        assert_eq!(
            Contexts::load(&path).expect("missing is empty"),
            Contexts::default()
        );
        let mut contexts = Contexts::default();
        contexts.contexts.insert(
            "prod".into(),
            Context {
                controlplane: Some("cp.example.org:7400".into()),
                key_file: Some("/k/prod.key".into()),
                socket: None,
            },
        );
        contexts.contexts.insert(
            "lab".into(),
            Context {
                socket: Some("/var/run/keel/agentd.sock".into()),
                ..Context::default()
            },
        );
        contexts.current = Some("prod".into());
        contexts.save(&path).expect("saved");
        assert_eq!(Contexts::load(&path).expect("loads"), contexts);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn invalid_files_are_refused_naming_the_key() {
        let dir = temp_dir("invalid");
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("config.toml");
        for (text, fragment) in [
            ("[contexts.a]\n", "contexts.a.controlplane: missing"),
            (
                "[contexts.a]\ncontrolplane = \"h:1\"\nsocket = \"/s\"\n",
                "contexts.a.socket",
            ),
            (
                "[contexts.a]\nsocket = \"/s\"\nkey_file = \"/k\"\n",
                "contexts.a.key_file",
            ),
            (
                "[contexts.a]\ncontrolplane = \"nope\"\n",
                "contexts.a.controlplane",
            ),
            ("[contexts.A]\nsocket = \"/s\"\n", "[contexts.A]"),
            ("current-context = \"b\"\n", "current-context"),
            ("[contexts.a]\nsokcet = \"/s\"\n", "sokcet"),
        ] {
            std::fs::write(&path, text).expect("write");
            let err = Contexts::load(&path).expect_err(text);
            assert!(err.to_string().contains(fragment), "{text}: {err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
