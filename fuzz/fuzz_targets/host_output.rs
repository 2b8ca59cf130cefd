//! Fuzz target: every parser of FreeBSD command output the agent reads on a
//! real host: `netstat -rn --libxo json`, `ifconfig IFACE inet`, `mount -p`,
//! `sysctl -n` (capacity and preflight), and, through a canned
//! `CommandRunner`, `jls -h name jid path` with `ps -o jid=` and
//! `zfs list -H -p` (those parsers are private; the trait methods that run
//! them are the entry points).
//!
//! The first input byte picks the parser, the rest is the command's stdout.
//! Only "never panics" is checked: these parsers answer `Err` for anything
//! they do not recognise.
#![no_main]

use std::path::PathBuf;
use std::time::Duration;

use keel::common::cmd::{CmdError, CmdOutput, CommandRunner};
use keel::common::config::CommandPaths;
use keel::host::capacity::{parse_capacity, parse_preflight};
use keel::host::jail::{FreeBsdJails, JailRuntime};
use keel::host::mount::parse_mount_p;
use keel::host::net::{parse_inet_addresses, parse_netstat_routes};
use keel::host::zfs::{FreeBsdZfs, ZfsLayout, ZfsManager};
use libfuzzer_sys::fuzz_target;

/// Answers every command with the same stdout and exit status 0.
struct Canned(String);

impl CommandRunner for Canned {
    fn run(&self, _: &[String], _: Option<&[u8]>, _: Duration) -> Result<CmdOutput, CmdError> {
        Ok(CmdOutput {
            status: 0,
            stdout: self.0.clone(),
            stderr: String::new(),
        })
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest).into_owned();
    match which % 7 {
        0 => drop(parse_netstat_routes(&text)),
        1 => drop(parse_inet_addresses(&text)),
        2 => drop(parse_mount_p(&text)),
        3 => drop(parse_capacity(&text)),
        4 => {
            let unknown = vec!["kern.racct.enable".to_string()];
            drop(parse_preflight(&text, &[]));
            drop(parse_preflight(&text, &unknown));
        }
        5 => {
            // jls and ps both get this text; the jls header makes it past
            // the first parser often enough for the fuzzer to find it.
            let jails = FreeBsdJails::new(
                Canned(text),
                CommandPaths::default(),
                PathBuf::from("/nonexistent"),
            );
            drop(jails.list());
        }
        _ => {
            let layout = ZfsLayout {
                pool: "zroot".into(),
                jails_dir: PathBuf::from("/usr/local/keel/jails"),
                volumes_dir: PathBuf::from("/usr/local/keel/volumes"),
            };
            let zfs = FreeBsdZfs::new(
                Canned(text),
                CommandPaths::default(),
                layout,
                1,
                Duration::ZERO,
            );
            drop(zfs.list());
        }
    }
});
