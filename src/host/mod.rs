//! Everything that touches FreeBSD, behind one narrow trait per subsystem.
//!
//! | trait | module | FreeBSD commands |
//! |---|---|---|
//! | [`JailRuntime`] | [`jail`] | jail(8), jls(8), jexec(8), rctl(8), ps(1) |
//! | [`ZfsManager`] | [`zfs`] | zfs(8) |
//! | [`NetManager`] | [`net`] | ifconfig(8), route(8), netstat(1) |
//! | [`MountManager`] | [`mount`] | mount(8), mount_nullfs(8), umount(8) |
//! | [`Firewall`] | [`pf`] | pfctl(8) |
//! | [`Capacity`] | [`capacity`] | sysctl(8) |
//! | [`BaseStore`] | [`base`] | zfs(8), tar(1) |
//! | [`UsageProbe`] | [`usage`] | rctl(8) `-u` (read only, off the worker) |
//!
//! Each module holds its trait, its error enum, an in-memory `Fake*` (tests and
//! `--simulate`, any OS; it can be told to fail) and a `FreeBsd*` implementation
//! that runs commands only through [`crate::common::cmd::CommandRunner`], by the
//! absolute paths in [`crate::common::config::CommandPaths`], with a timeout.
//!
//! Rules every implementation keeps:
//! - Observation is batched: each trait offers a `list`-style call that reads
//!   the whole subsystem with one command, so a reconcile pass spawns a constant
//!   number of processes whatever the number of jails. Each also offers a
//!   call for one jail's share ([`JailRuntime::get`], [`ZfsManager::list_named`],
//!   [`MountManager::list_under`], [`NetManager::find_interfaces`]) that an
//!   apply uses: the command is narrowed where FreeBSD can (`jls -j`, `ps -J`,
//!   `zfs list NAME...`), and where it cannot (`mount -p`, `ifconfig -l`) the
//!   other lines are dropped while parsing. An absent jail or dataset is
//!   absent there, never an error.
//! - Names reaching an argv were validated by `common::spec` (DNS labels);
//!   interface names come from [`iface_names`], never from raw input.
//! - Idempotent outcomes FreeBSD reports as errors (route already in table,
//!   no rctl rules, jail not found on removal) are success here.
//! - Whatever Keel itself reads or writes inside a jail's root (which the
//!   jail's root user controls) is resolved with [`beneath`], never by path.
//!
//! [`sim`] is the simulated host of `keel-agentd --simulate`; [`scripted`] is
//! a command runner that keeps a FreeBSD host's state and refuses what
//! FreeBSD refuses: the test double of the `FreeBsd*` implementations, and
//! the host a dry run applies to, seeded with what the real one shows.

pub mod base;
pub mod beneath;
pub mod capacity;
pub mod fake;
pub mod jail;
pub mod mount;
pub mod net;
pub mod pf;
pub mod scripted;
pub mod sim;
pub mod usage;
pub mod zfs;

pub use base::BaseStore;
pub use capacity::Capacity;
pub use jail::JailRuntime;
pub use mount::MountManager;
pub use net::NetManager;
pub use pf::Firewall;
pub use usage::UsageProbe;
pub use zfs::ZfsManager;

/// Host and jail side interface names of one jail's epair(4).
///
/// FreeBSD interface names hold at most 15 characters (IFNAMSIZ 16 with the
/// NUL), while a jail name may have 63. Names of up to 12 characters are used
/// as they are (`kh_web-1` on the host, `kj_web-1` in the jail); longer ones
/// become the first 3 characters, `_`, and the 8 hex digits of the name's
/// 32-bit FNV-1a hash (`kh_pos_1a2b3c4d`). Jail names are DNS labels and never
/// contain `_`, so the two forms cannot collide with each other.
pub fn iface_names(jail: &str) -> (String, String) {
    let stem = if jail.len() <= 12 {
        jail.to_string()
    } else {
        let head: String = jail.chars().take(3).collect();
        format!(
            "{head}_{:08x}",
            crate::common::cidr::fnv1a32(jail.as_bytes())
        )
    };
    (format!("kh_{stem}"), format!("kj_{stem}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_fit_ifnamsiz_for_every_valid_length() {
        for len in 1..=63 {
            let name = "a".repeat(len);
            let (h, j) = iface_names(&name);
            assert!(h.len() <= 15 && j.len() <= 15, "{h} {j}");
            assert_ne!(h, j);
        }
    }

    #[test]
    fn long_names_stay_distinct_and_stable() {
        let a = iface_names("postgres-primary-0");
        let b = iface_names("postgres-primary-1");
        assert_ne!(a, b);
        assert_eq!(a, iface_names("postgres-primary-0"));
        assert_eq!(iface_names("web-1").0, "kh_web-1");
    }
}
