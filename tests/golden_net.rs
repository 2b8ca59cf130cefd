//! Golden transcripts of [`FreeBsdNet`]: the exact ifconfig(8), route(8) and
//! netstat(1) argv of every operation and failure path, answered with canned
//! output in the formats of `reference/freebsd.md` sections 7 and 8.

use std::net::Ipv4Addr;
use std::sync::Arc;

use keel::common::cidr::Ipv4Net;
use keel::common::cmd::{CmdError, RecordingRunner};
use keel::common::config::CommandPaths;
use keel::host::net::{Epair, FreeBsdNet, NetError, NetManager};

use crate::util::golden;

fn net(runner: Arc<RecordingRunner>) -> FreeBsdNet<Arc<RecordingRunner>> {
    FreeBsdNet::new(runner, CommandPaths::default())
}

fn prefix(s: &str) -> Ipv4Net {
    s.parse().expect("test prefix")
}

const GATEWAY: &str = "10.20.3.1/24";
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 7);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

fn web_1() -> Epair {
    Epair {
        host: "kh_web-1".into(),
        jail: "kj_web-1".into(),
    }
}

/// The failed command's stderr (or stdout) from a `NetError::Command`.
fn failure(err: NetError) -> String {
    match err {
        NetError::Command(CmdError::Failed { stderr, .. }) => stderr,
        other => panic!("expected a failed command, got {other:?}"),
    }
}

#[test]
fn list_interfaces() {
    golden::check("net_list_interfaces", |r| {
        let names = net(r).list_interfaces().expect("listed");
        assert_eq!(names, ["em0", "lo0", "pflog0", "keel0", "kh_web-1"]);
    });
}

#[test]
fn find_interfaces_keeps_only_the_names_asked_for() {
    golden::check("net_find_interfaces", |r| {
        let found = net(r)
            .find_interfaces(&["keel0", "kh_web-1", "kj_web-1"])
            .expect("listed");
        assert_eq!(found, ["keel0", "kh_web-1"]);
    });
}

#[test]
fn ensure_bridge_creates_a_missing_bridge() {
    golden::check("net_ensure_bridge_missing", |r| {
        net(r)
            .ensure_bridge("keel0", prefix(GATEWAY))
            .expect("created");
    });
}

#[test]
fn ensure_bridge_leaves_a_configured_bridge_alone() {
    golden::check("net_ensure_bridge_present", |r| {
        net(r)
            .ensure_bridge("keel0", prefix(GATEWAY))
            .expect("present");
    });
}

#[test]
fn ensure_bridge_adds_a_missing_gateway_address() {
    golden::check("net_ensure_bridge_without_address", |r| {
        net(r)
            .ensure_bridge("keel0", prefix(GATEWAY))
            .expect("addressed");
    });
}

#[test]
fn ensure_bridge_destroys_the_new_bridge_when_the_rename_fails() {
    golden::check("net_ensure_bridge_rename_fails", |r| {
        let err = net(r)
            .ensure_bridge("keel0", prefix(GATEWAY))
            .expect_err("rename fails");
        assert!(failure(err).contains("File exists"));
    });
}

#[test]
fn attach_creates_names_and_bridges_an_epair() {
    golden::check("net_attach", |r| {
        assert_eq!(net(r).attach("keel0", "web-1").expect("attached"), web_1());
    });
}

#[test]
fn attach_destroys_crash_leftovers_first() {
    golden::check("net_attach_leftovers", |r| {
        assert_eq!(net(r).attach("keel0", "web-1").expect("attached"), web_1());
    });
}

#[test]
fn attach_failing_midway_leaves_no_epair() {
    golden::check("net_attach_fails_midway", |r| {
        let err = net(r).attach("keel0", "web-1").expect_err("no bridge");
        let message = err.to_string();
        assert!(message.contains("addm kh_web-1"), "{message}");
        assert!(failure(err).contains("keel0 does not exist"));
    });
}

#[test]
fn attach_failing_to_rename_destroys_the_unnamed_epair() {
    golden::check("net_attach_rename_fails", |r| {
        let err = net(r).attach("keel0", "web-1").expect_err("rename fails");
        assert!(failure(err).contains("SIOCSIFNAME"));
    });
}

#[test]
fn detach_destroys_the_host_end() {
    golden::check("net_detach", |r| {
        net(r).detach("web-1").expect("detached");
    });
}

#[test]
fn detach_of_a_missing_epair_succeeds() {
    golden::check("net_detach_missing", |r| {
        net(r).detach("web-1").expect("already gone is success");
    });
}

#[test]
fn reclaim_moves_the_jail_side_back_to_the_host() {
    golden::check("net_reclaim", |r| {
        net(r).reclaim("web-1").expect("reclaimed");
    });
}

#[test]
fn reclaim_with_nothing_in_the_jail_s_vnet_succeeds() {
    golden::check("net_reclaim_nothing_to_move", |r| {
        net(r).reclaim("web-1").expect("nothing to move");
    });
}

#[test]
fn reclaim_from_a_jail_that_is_gone_succeeds() {
    golden::check("net_reclaim_no_jail", |r| {
        net(r).reclaim("web-1").expect("no jail to move from");
    });
}

#[test]
fn reclaim_from_a_vnet_shutting_down_is_an_error() {
    golden::check("net_reclaim_vnet_shutting_down", |r| {
        let err = net(r).reclaim("web-1").expect_err("EBUSY");
        assert!(failure(err).contains("Device busy"));
    });
}

#[test]
fn list_routes_reads_the_whole_table_once() {
    golden::check("net_list_routes", |r| {
        let routes = net(r).list_routes().expect("listed");
        let got: Vec<(String, String)> = routes
            .iter()
            .map(|r| (r.destination.to_string(), r.gateway.clone()))
            .collect();
        let want = [
            ("0.0.0.0/0", "192.168.1.1"),
            ("10.1.2.0/24", "10.0.0.2"),
            ("10.20.3.0/24", "link#4"),
            ("10.20.3.1/32", "link#4"),
            ("127.0.0.1/32", "link#2"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(d, g)| (d.to_string(), g.to_string()))
            .collect();
        assert_eq!(got, want);
    });
}

#[test]
fn add_route() {
    golden::check("net_add_route", |r| {
        net(r)
            .add_route(prefix("10.1.2.0/24"), PEER)
            .expect("added");
    });
}

#[test]
fn add_route_already_in_table_succeeds() {
    golden::check("net_add_route_exists", |r| {
        net(r)
            .add_route(prefix("10.1.2.0/24"), PEER)
            .expect("already in table is success");
    });
}

#[test]
fn add_route_reports_other_failures() {
    golden::check("net_add_route_fails", |r| {
        let err = net(r)
            .add_route(prefix("10.1.2.0/24"), PEER)
            .expect_err("unreachable");
        assert!(failure(err).contains("Network is unreachable"));
    });
}

#[test]
fn delete_route() {
    golden::check("net_delete_route", |r| {
        net(r).delete_route(prefix("10.1.2.0/24")).expect("deleted");
    });
}

#[test]
fn delete_route_not_in_table_succeeds() {
    golden::check("net_delete_route_missing", |r| {
        net(r)
            .delete_route(prefix("10.1.2.0/24"))
            .expect("absent is success");
    });
}

#[test]
fn list_addresses() {
    golden::check("net_list_addresses", |r| {
        let addrs = net(r).list_addresses("keel0").expect("listed");
        assert_eq!(addrs, [Ipv4Addr::new(10, 20, 3, 1), VIP]);
    });
}

#[test]
fn list_addresses_of_a_missing_interface_fails() {
    golden::check("net_list_addresses_missing", |r| {
        let err = net(r)
            .list_addresses("keel9")
            .expect_err("no such interface");
        assert!(failure(err).contains("keel9 does not exist"));
    });
}

#[test]
fn add_alias() {
    golden::check("net_add_alias", |r| {
        net(r).add_alias("keel0", VIP).expect("added");
    });
}

#[test]
fn add_alias_already_present_changes_nothing() {
    golden::check("net_add_alias_present", |r| {
        net(r).add_alias("keel0", VIP).expect("present is success");
    });
}

#[test]
fn remove_alias() {
    golden::check("net_remove_alias", |r| {
        net(r).remove_alias("keel0", VIP).expect("removed");
    });
}

#[test]
fn remove_absent_alias_succeeds() {
    golden::check("net_remove_alias_absent", |r| {
        net(r)
            .remove_alias("keel0", VIP)
            .expect("absent is success");
    });
}
