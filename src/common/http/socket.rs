//! The agent's Unix socket: created with its mode and group, replacing the
//! leftover of a crashed agent but never a live agent's socket.
//!
//! Owns the socket file only. It must never remove anything that is not a
//! socket, and never a socket something still answers on.
//!
//! Groups are looked up in `/etc/group` rather than through getgrnam(3): that
//! keeps Keel free of `unsafe`, and on a FreeBSD host (no NSS group sources by
//! default) the file is the group database. A numeric group is taken as a gid.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use super::HttpError;

/// Where group names are resolved.
const GROUP_FILE: &str = "/etc/group";

/// Binds a Unix socket at `path` for a daemon's API.
///
/// Creates the parent directory if needed. An existing socket that accepts a
/// connection belongs to a live daemon: [`HttpError::SocketInUse`]. One that
/// refuses is stale (its daemon died) and is replaced. Anything else at `path`
/// is left alone: [`HttpError::NotASocket`]. The socket then gets `mode`
/// (0660 for the agent) and, when `group` names another group than the one it
/// was created with, that group.
pub fn bind_unix_socket(
    path: &Path,
    mode: u32,
    group: Option<&str>,
) -> Result<UnixListener, HttpError> {
    let step = |action: &'static str| {
        move |source: io::Error| HttpError::Socket {
            path: path.to_path_buf(),
            action,
            source,
        }
    };
    // Resolve first: a typo in the group must not cost the old socket.
    let gid = group.map(resolve_group).transpose()?;
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|source| HttpError::Socket {
            path: parent.to_path_buf(),
            action: "create the socket directory",
            source,
        })?;
    }
    match fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(HttpError::NotASocket {
                path: path.to_path_buf(),
            });
        }
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => {
                return Err(HttpError::SocketInUse {
                    path: path.to_path_buf(),
                });
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                fs::remove_file(path).map_err(step("remove the stale socket"))?;
            }
            Err(e) => return Err(step("check whether a daemon listens on")(e)),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(step("inspect")(e)),
    }
    let listener = UnixListener::bind(path).map_err(step("bind"))?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(step("chmod"))?;
    if let Some(gid) = gid {
        let current = fs::metadata(path).map_err(step("inspect"))?.gid();
        if current != gid {
            std::os::unix::fs::chown(path, None, Some(gid)).map_err(step("chown"))?;
        }
    }
    Ok(listener)
}

fn resolve_group(group: &str) -> Result<u32, HttpError> {
    let unknown = || HttpError::UnknownGroup {
        group: group.to_string(),
    };
    // A missing or unreadable group file just means names cannot be resolved.
    let table = fs::read_to_string(GROUP_FILE).unwrap_or_default();
    group_gid(&table, group)
        .or_else(|| group.parse().ok())
        .ok_or_else(unknown)
}

/// The gid of `name` in a group(5) table (`name:password:gid:members`).
fn group_gid(table: &str, name: &str) -> Option<u32> {
    table
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .find_map(|line| {
            let mut fields = line.split(':');
            let n = fields.next()?;
            let _password = fields.next()?;
            let gid = fields.next()?;
            (n == name).then(|| gid.trim().parse().ok()).flatten()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_names_resolve_from_the_table() {
        let table = "# comment\nwheel:*:0:root\noperator:*:5:root\nkeel:*:1001:alice,bob\nbroken\n";
        assert_eq!(group_gid(table, "wheel"), Some(0));
        assert_eq!(group_gid(table, "keel"), Some(1001));
        assert_eq!(group_gid(table, "kee"), None);
        assert_eq!(group_gid(table, "broken"), None);
        assert_eq!(group_gid(table, "nobody"), None);
    }

    #[test]
    fn unknown_group_is_reported_by_name() {
        let err = resolve_group("no-such-group-keel").expect_err("resolved");
        assert!(err.to_string().contains("\"no-such-group-keel\""), "{err}");
        assert_eq!(resolve_group("4242").ok(), Some(4242));
    }
}
