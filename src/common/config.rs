//! `keel.toml`: every key, its default, and validation.

use std::path::PathBuf;

/// Absolute paths of the FreeBSD programs Keel runs (`[commands]` in keel.toml).
/// Tests and unusual installs override them; nothing else ever names a program.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CommandPaths {
    /// jail(8)
    pub jail: PathBuf,
    /// jls(8)
    pub jls: PathBuf,
    /// jexec(8)
    pub jexec: PathBuf,
    /// rctl(8)
    pub rctl: PathBuf,
    /// ps(1)
    pub ps: PathBuf,
    /// zfs(8)
    pub zfs: PathBuf,
    /// ifconfig(8)
    pub ifconfig: PathBuf,
    /// route(8)
    pub route: PathBuf,
    /// netstat(1)
    pub netstat: PathBuf,
    /// mount(8)
    pub mount: PathBuf,
    /// umount(8)
    pub umount: PathBuf,
    /// mkdir(1), for mount points
    pub mkdir: PathBuf,
    /// pfctl(8)
    pub pfctl: PathBuf,
    /// sysctl(8)
    pub sysctl: PathBuf,
}

impl Default for CommandPaths {
    fn default() -> Self {
        CommandPaths {
            jail: "/usr/sbin/jail".into(),
            jls: "/usr/sbin/jls".into(),
            jexec: "/usr/sbin/jexec".into(),
            rctl: "/usr/bin/rctl".into(),
            ps: "/bin/ps".into(),
            zfs: "/sbin/zfs".into(),
            ifconfig: "/sbin/ifconfig".into(),
            route: "/sbin/route".into(),
            netstat: "/usr/bin/netstat".into(),
            mount: "/sbin/mount".into(),
            umount: "/sbin/umount".into(),
            mkdir: "/bin/mkdir".into(),
            pfctl: "/sbin/pfctl".into(),
            sysctl: "/sbin/sysctl".into(),
        }
    }
}

impl CommandPaths {
    /// Default paths re-rooted under `prefix` (tests point them at stubs).
    pub fn with_prefix(prefix: &std::path::Path) -> CommandPaths {
        let d = CommandPaths::default();
        let re = |p: &PathBuf| prefix.join(p.strip_prefix("/").unwrap_or(p));
        CommandPaths {
            jail: re(&d.jail),
            jls: re(&d.jls),
            jexec: re(&d.jexec),
            rctl: re(&d.rctl),
            ps: re(&d.ps),
            zfs: re(&d.zfs),
            ifconfig: re(&d.ifconfig),
            route: re(&d.route),
            netstat: re(&d.netstat),
            mount: re(&d.mount),
            umount: re(&d.umount),
            mkdir: re(&d.mkdir),
            pfctl: re(&d.pfctl),
            sysctl: re(&d.sysctl),
        }
    }
}
