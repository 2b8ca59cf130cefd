//! The control plane's etcd client against a real etcd cluster (Debian's
//! etcd-server, started by tests/util/etcd.rs): compare-and-write
//! transactions, leases that expire or are kept alive, a leader key held by
//! exactly one client and fencing the one that lost it, a member killed -9,
//! endpoints that do not answer, and TLS with client certificates.
//!
//! Leases are the 2 s minimum etcd grants at its default election timeout,
//! so no test waits much longer than that.

use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use keel::controlplane::etcd::{
    Compare, Etcd, EtcdError, EtcdSettings, Kv, Lead, LeaseId, Op, Range,
};

use crate::util::agent::process_alive;
use crate::util::etcd::EtcdCluster;
use crate::util::pki::TestCa;
use crate::util::poll_until;

/// Bound on every call: generous, as the machine may be busy with builds.
const TIMEOUT: Duration = Duration::from_secs(5);

fn settings(endpoints: Vec<String>) -> EtcdSettings {
    EtcdSettings {
        endpoints,
        ca: None,
        cert: None,
        key: None,
        prefix: "/keel-test/".into(),
        timeout: TIMEOUT,
    }
}

fn connect(cluster: &EtcdCluster) -> Etcd {
    Etcd::connect(&settings(cluster.endpoints())).expect("connect to the test cluster")
}

fn get(etcd: &Etcd, key: &str) -> Option<Kv> {
    let Range { kvs, .. } = etcd.range_prefix(key).expect("range");
    kvs.into_iter().find(|kv| kv.key == key)
}

#[test]
fn a_stale_mod_revision_fails_the_txn_and_writes_nothing() {
    let Some(cluster) = EtcdCluster::start("etcd txn", 3) else {
        return;
    };
    let etcd = connect(&cluster);
    let created = etcd
        .txn(
            &[Compare::absent("placements/web-0")],
            &[Op::put("placements/web-0", "node-a")],
            &[],
        )
        .expect("create");
    assert!(created.succeeded, "the key was absent");
    let moved = etcd
        .txn(
            &[Compare::mod_revision("placements/web-0", created.revision)],
            &[Op::put("placements/web-0", "node-b")],
            &[],
        )
        .expect("move");
    assert!(
        moved.succeeded,
        "the compare named the key's current revision"
    );
    assert!(moved.revision > created.revision);

    // A decision based on the first read: its revision is stale now.
    let stale = etcd
        .txn(
            &[Compare::mod_revision("placements/web-0", created.revision)],
            &[
                Op::put("placements/web-0", "node-c"),
                Op::put("placements/web-1", "node-c"),
            ],
            &[],
        )
        .expect("stale txn answers");
    assert!(!stale.succeeded, "a stale mod_revision must fail the txn");
    assert_eq!(
        stale.revision, moved.revision,
        "a failed txn writes nothing"
    );
    let range = etcd.range_prefix("placements/").expect("range");
    assert_eq!(range.revision, moved.revision);
    assert_eq!(range.kvs.len(), 1, "{:?}", range.kvs);
    let kv = &range.kvs[0];
    assert_eq!(
        (kv.key.as_str(), kv.value.as_slice()),
        ("placements/web-0", b"node-b".as_slice())
    );
    assert_eq!(kv.mod_revision, moved.revision);
    assert_eq!(kv.create_revision, created.revision);
    assert_eq!(kv.lease, None);

    // An absent-key compare on an existing key fails too, and then the
    // failure ops run instead.
    let again = etcd
        .txn(
            &[Compare::absent("placements/web-0")],
            &[Op::put("placements/web-0", "node-d")],
            &[Op::put("conflicts/web-0", "seen")],
        )
        .expect("txn");
    assert!(!again.succeeded);
    assert_eq!(
        get(&etcd, "placements/web-0").expect("kept").value,
        b"node-b"
    );
    assert_eq!(
        get(&etcd, "conflicts/web-0").expect("failure op ran").value,
        b"seen"
    );
}

#[test]
fn value_compares_deletes_and_prefixes() {
    let Some(cluster) = EtcdCluster::start("etcd txn ops", 3) else {
        return;
    };
    let etcd = connect(&cluster);
    let puts: Vec<Op> = ["vips/a", "vips/b", "vips/c", "volumes/x"]
        .iter()
        .map(|k| Op::put(k, "1"))
        .collect();
    assert!(etcd.txn(&[], &puts, &[]).expect("puts").succeeded);

    let wrong = etcd
        .txn(
            &[Compare::value("vips/a", "2")],
            &[Op::delete("vips/a")],
            &[],
        )
        .expect("txn");
    assert!(!wrong.succeeded, "the value is 1, not 2");
    let right = etcd
        .txn(
            &[Compare::value("vips/a", "1")],
            &[Op::delete("vips/a")],
            &[],
        )
        .expect("txn");
    assert!(right.succeeded);
    assert!(get(&etcd, "vips/a").is_none(), "deleted");

    assert!(
        etcd.txn(&[], &[Op::delete_prefix("vips/")], &[])
            .expect("delete prefix")
            .succeeded
    );
    assert!(etcd.range_prefix("vips/").expect("range").kvs.is_empty());
    assert!(
        get(&etcd, "volumes/x").is_some(),
        "outside the deleted prefix"
    );

    // Another cluster's prefix on the same etcd sees none of this one's keys.
    let other = Etcd::connect(&EtcdSettings {
        prefix: "/keel-other/".into(),
        ..settings(cluster.endpoints())
    })
    .expect("connect");
    assert!(other.range_prefix("").expect("range").kvs.is_empty());
    assert!(
        other
            .txn(
                &[Compare::absent("volumes/x")],
                &[Op::put("volumes/x", "2")],
                &[]
            )
            .expect("txn")
            .succeeded,
        "absent under the other prefix"
    );
    assert_eq!(get(&etcd, "volumes/x").expect("kept").value, b"1");
}

#[test]
fn a_lease_not_kept_alive_expires_and_its_keys_vanish() {
    let Some(cluster) = EtcdCluster::start("etcd lease expiry", 3) else {
        return;
    };
    let etcd = connect(&cluster);
    let lease = etcd.grant(Duration::from_secs(1)).expect("grant");
    assert!(lease.ttl >= Duration::from_secs(1), "{lease:?}");
    let put = etcd
        .txn(
            &[],
            &[Op::put_with_lease("nodes/n1", "alive", lease.id)],
            &[],
        )
        .expect("register");
    assert!(put.succeeded);
    assert_eq!(
        get(&etcd, "nodes/n1").expect("registered").lease,
        Some(lease.id)
    );
    let remaining = etcd.time_to_live(lease.id).expect("ttl");
    assert!(remaining.is_some_and(|t| t <= lease.ttl), "{remaining:?}");

    let granted = Instant::now();
    poll_until("the unrenewed lease to expire", || {
        etcd.time_to_live(lease.id).expect("ttl").is_none()
    });
    assert!(
        granted.elapsed() >= lease.ttl - Duration::from_millis(500),
        "expired after {:?}, before its TTL {:?}",
        granted.elapsed(),
        lease.ttl
    );
    assert!(
        get(&etcd, "nodes/n1").is_none(),
        "the lease's key is gone with it"
    );
    assert_eq!(etcd.keep_alive(lease.id).expect("keep-alive answers"), None);
    // Registering under the dead lease is refused whole, not half done.
    match etcd.txn(
        &[],
        &[
            Op::put("nodes/n1-meta", "x"),
            Op::put_with_lease("nodes/n1", "alive", lease.id),
        ],
        &[],
    ) {
        Err(EtcdError::Status { code, .. }) if code == "NotFound" => {}
        other => panic!("a put under an expired lease: {other:?}"),
    }
    assert!(etcd.range_prefix("nodes/").expect("range").kvs.is_empty());
    etcd.revoke(lease.id)
        .expect("revoking a gone lease is not an error");
}

#[test]
fn a_kept_alive_lease_outlives_its_ttl() {
    let Some(cluster) = EtcdCluster::start("etcd lease keep-alive", 3) else {
        return;
    };
    let etcd = connect(&cluster);
    let lease = etcd.grant(Duration::from_secs(2)).expect("grant");
    etcd.txn(
        &[],
        &[Op::put_with_lease("nodes/n1", "alive", lease.id)],
        &[],
    )
    .expect("register");
    let until = Instant::now() + lease.ttl * 2 + Duration::from_secs(1);
    let mut renewals = 0;
    while Instant::now() < until {
        let ttl = etcd.keep_alive(lease.id).expect("keep-alive");
        assert_eq!(ttl, Some(lease.ttl), "renewed to its full TTL");
        renewals += 1;
        // The renewal period itself, not a wait for a condition.
        thread::sleep(lease.ttl / 4);
    }
    assert!(renewals > 4, "{renewals}");
    assert!(etcd.time_to_live(lease.id).expect("ttl").is_some());
    assert!(get(&etcd, "nodes/n1").is_some(), "alive past twice its TTL");

    etcd.revoke(lease.id).expect("revoke");
    assert!(get(&etcd, "nodes/n1").is_none(), "revoking deletes at once");
    assert_eq!(etcd.time_to_live(lease.id).expect("ttl"), None);
}

#[test]
fn one_leader_at_a_time_and_the_old_one_is_fenced() {
    let Some(cluster) = EtcdCluster::start("etcd leadership", 3) else {
        return;
    };
    // Two control planes, each with its own connection and lease.
    let a = connect(&cluster);
    let b = connect(&cluster);
    let lease_a = a.grant(Duration::from_secs(2)).expect("grant a");
    let lease_b = b.grant(Duration::from_secs(2)).expect("grant b");
    let lead_a = a.try_lead("leader", "cp-a", lease_a.id).expect("a tries");
    let lead_b = b.try_lead("leader", "cp-b", lease_b.id).expect("b tries");
    let Lead::Held { revision: rev_a } = lead_a else {
        panic!("the first to try leads: {lead_a:?}");
    };
    assert_eq!(
        lead_b,
        Lead::Other {
            holder: "cp-a".into(),
            revision: rev_a
        }
    );
    assert_eq!(
        a.try_lead("leader", "cp-a", lease_a.id).expect("again"),
        Lead::Held { revision: rev_a },
        "asking again while holding is not losing"
    );
    let fenced = |etcd: &Etcd, rev: i64, value: &str| {
        etcd.txn(
            &[Compare::create_revision("leader", rev)],
            &[Op::put("services/web", value)],
            &[],
        )
        .expect("decision txn")
    };
    assert!(fenced(&a, rev_a, "by a").succeeded, "the leader decides");

    // a stalls (stops renewing); b keeps its lease and tries until it leads.
    let mut lead = Lead::Other {
        holder: String::new(),
        revision: 0,
    };
    poll_until("b to take the leader key once a's lease expired", || {
        assert!(b.keep_alive(lease_b.id).expect("b renews").is_some());
        lead = b.try_lead("leader", "cp-b", lease_b.id).expect("b tries");
        matches!(lead, Lead::Held { .. })
    });
    let Lead::Held { revision: rev_b } = lead else {
        unreachable!("polled until held");
    };
    assert!(
        rev_b > rev_a,
        "the new term's revision {rev_b} exceeds {rev_a}"
    );
    assert_eq!(a.keep_alive(lease_a.id).expect("a renews too late"), None);

    // a wakes up and decides as if it still led: fenced.
    let late = fenced(&a, rev_a, "late by a");
    assert!(
        !late.succeeded,
        "a decision under the old leader revision must fail"
    );
    assert_eq!(get(&a, "services/web").expect("kept").value, b"by a");
    assert_eq!(
        a.try_lead("leader", "cp-a", lease_a.id).expect("a asks"),
        Lead::Other {
            holder: "cp-b".into(),
            revision: rev_b
        }
    );
    assert!(
        fenced(&b, rev_b, "by b").succeeded,
        "the new leader decides"
    );

    // Resigning by revoking hands over at once, without waiting for a TTL.
    b.revoke(lease_b.id).expect("revoke");
    let lease_a2 = a.grant(Duration::from_secs(2)).expect("grant");
    let Lead::Held { revision: rev_a2 } = a.try_lead("leader", "cp-a", lease_a2.id).expect("a")
    else {
        panic!("the key is free after the holder's lease was revoked");
    };
    assert!(rev_a2 > rev_b);
}

/// Several txn/range/keep-alive rounds, each call of which must succeed;
/// except, when `just_killed`, the first write, which may have gone into
/// the dead member's connection before the client saw it close: that one
/// may answer Indeterminate (and nothing else), and is then read back and
/// written again only if it did not land.
fn rounds(etcd: &Etcd, lease: LeaseId, round: &str, just_killed: bool) {
    for i in 0..6 {
        let key = format!("rounds/{round}-{i}");
        let write = || etcd.txn(&[Compare::absent(&key)], &[Op::put(&key, "ok")], &[]);
        match write() {
            Ok(outcome) => assert!(outcome.succeeded, "{key}"),
            Err(e @ EtcdError::Indeterminate { .. }) if just_killed && i == 0 => {
                eprintln!("etcd: the write racing the kill: {e}");
                if get(etcd, &key).is_none() {
                    let again = write().unwrap_or_else(|e| panic!("txn {key} again: {e}"));
                    assert!(again.succeeded, "{key}");
                }
            }
            Err(e) => panic!("txn {key} with a member down: {e}"),
        }
        let range = etcd
            .range_prefix("rounds/")
            .unwrap_or_else(|e| panic!("range with a member down: {e}"));
        assert!(range.kvs.iter().any(|kv| kv.key == key), "{key} readable");
        let ttl = etcd
            .keep_alive(lease)
            .unwrap_or_else(|e| panic!("keep-alive with a member down: {e}"));
        assert!(ttl.is_some(), "the lease lives on");
    }
}

/// `first`'s endpoint, then the others: the client starts on `first`.
fn endpoints_from(cluster: &EtcdCluster, first: usize) -> Vec<String> {
    let mut endpoints = cluster.endpoints();
    endpoints.rotate_left(first);
    endpoints
}

#[test]
fn a_follower_killed_9_costs_nothing_but_a_write_racing_the_kill() {
    let Some(mut cluster) = EtcdCluster::start("etcd follower loss", 3) else {
        return;
    };
    let leader = cluster.wait_leader();
    let victim = (leader + 1) % 3;
    // The client's first member, with a renewal stream open to it: the
    // calls after the kill must move to another member.
    let etcd = Etcd::connect(&settings(endpoints_from(&cluster, victim))).expect("connect");
    // Long enough for every round on a loaded machine: this test is about
    // renewals with a member down, not expiry.
    let lease = etcd.grant(Duration::from_secs(30)).expect("grant");
    etcd.txn(
        &[],
        &[Op::put_with_lease("nodes/n1", "alive", lease.id)],
        &[],
    )
    .expect("register");
    rounds(&etcd, lease.id, "healthy", false);

    cluster.kill(victim);
    let started = Instant::now();
    rounds(&etcd, lease.id, "without-follower", true);
    eprintln!(
        "etcd: 6 rounds after killing a follower took {:?}",
        started.elapsed()
    );
    // A client that starts while its first member is down connects too.
    let late = Etcd::connect(&settings(endpoints_from(&cluster, victim))).expect("connect");
    rounds(&late, lease.id, "new-client", false);

    cluster.restart(victim);
    rounds(&etcd, lease.id, "restarted", false);
    assert!(get(&etcd, "nodes/n1").is_some(), "kept alive throughout");
}

#[test]
fn a_leader_killed_9_stalls_writes_only_until_the_next_election() {
    let Some(mut cluster) = EtcdCluster::start("etcd leader loss", 3) else {
        return;
    };
    let leader = cluster.wait_leader();
    let etcd = Etcd::connect(&settings(endpoints_from(&cluster, leader))).expect("connect");
    let lease = etcd.grant(Duration::from_secs(2)).expect("grant");
    etcd.txn(
        &[],
        &[Op::put_with_lease("nodes/n1", "alive", lease.id)],
        &[],
    )
    .expect("register");
    assert!(etcd.keep_alive(lease.id).expect("renew").is_some());

    let stop = AtomicBool::new(false);
    thread::scope(|s| {
        // The lease's holder renews on its own thread, as a control plane
        // would, while the writes below wait out the election.
        let renewer = s.spawn(|| {
            let mut failed = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match etcd.keep_alive(lease.id) {
                    Ok(Some(_)) => {}
                    Ok(None) => panic!("the lease expired although renewed: {failed:?}"),
                    Err(e) => failed.push(e.to_string()),
                }
                // The renewal period itself, not a wait for a condition.
                thread::sleep(lease.ttl / 4);
            }
            failed
        });

        cluster.kill(leader);
        let killed = Instant::now();
        // Until the others elect a leader a write may fail, but only in
        // ways that say so. Each attempt writes a key of its own, so one
        // that landed unseen would be found below rather than repeated.
        let mut attempts = 0;
        let mut landed = None;
        poll_until("a write after the leader's death", || {
            attempts += 1;
            let key = format!("after-leader/{attempts}");
            match etcd.txn(&[Compare::absent(&key)], &[Op::put(&key, "ok")], &[]) {
                Ok(outcome) => {
                    assert!(outcome.succeeded, "{key} was absent");
                    landed = Some(key);
                    true
                }
                Err(
                    e @ (EtcdError::Timeout { .. }
                    | EtcdError::Indeterminate { .. }
                    | EtcdError::Unavailable { .. }),
                ) => {
                    eprintln!("etcd: write during the election: {e}");
                    false
                }
                Err(e) => panic!("a write during the election failed unexpectedly: {e}"),
            }
        });
        eprintln!(
            "etcd: writes stalled {:?} after killing the leader ({attempts} attempts)",
            killed.elapsed()
        );
        assert_ne!(cluster.wait_leader(), leader);
        let range = etcd.range_prefix("after-leader/").expect("read");
        let landed = landed.expect("a write landed");
        assert!(
            range.kvs.iter().any(|kv| kv.key == landed),
            "{:?}",
            range.kvs
        );
        stop.store(true, Ordering::Relaxed);
        let failed = renewer.join().expect("the renewer");
        eprintln!("etcd: renewals that failed during the election: {failed:?}");
    });
    assert!(
        get(&etcd, "nodes/n1").is_some(),
        "the lease outlived the election"
    );
    rounds(&etcd, lease.id, "new-leader", false);
}

#[test]
fn dead_endpoints_give_an_error_saying_what_to_check() {
    // Ports nobody listens on: refused at once.
    let dead: Vec<String> = (0..3)
        .map(|_| {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind");
            format!("http://{}", l.local_addr().expect("addr"))
        })
        .collect();
    let started = Instant::now();
    let err = Etcd::connect(&EtcdSettings {
        timeout: Duration::from_secs(2),
        ..settings(dead.clone())
    })
    .expect_err("nothing listens there");
    assert!(
        started.elapsed() < Duration::from_secs(2) + Duration::from_secs(1),
        "bounded by the timeout: {:?}",
        started.elapsed()
    );
    assert!(
        matches!(
            err,
            EtcdError::Unavailable { op: "connect", .. } | EtcdError::Timeout { op: "connect", .. }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    for part in [
        "etcd connect",
        dead[0].as_str(),
        dead[2].as_str(),
        "is etcd running at",
        "check controlplane.etcd_endpoints",
    ] {
        assert!(msg.contains(part), "{msg:?} lacks {part:?}");
    }
    eprintln!("etcd: dead endpoints: {msg}");
}

#[test]
fn calls_fail_in_bounded_time_once_every_member_is_gone() {
    let Some(mut cluster) = EtcdCluster::start("etcd all members gone", 3) else {
        return;
    };
    let etcd = Etcd::connect(&EtcdSettings {
        timeout: Duration::from_secs(2),
        ..settings(cluster.endpoints())
    })
    .expect("connect");
    let lease = etcd.grant(Duration::from_secs(2)).expect("grant");
    assert!(etcd.keep_alive(lease.id).expect("renew").is_some());
    for i in 0..3 {
        cluster.kill(i);
    }
    for (what, result) in [
        ("range", etcd.range_prefix("").map(|_| ())),
        ("txn", etcd.txn(&[], &[Op::put("k", "v")], &[]).map(|_| ())),
        ("keep-alive", etcd.keep_alive(lease.id).map(|_| ())),
    ] {
        let started = Instant::now();
        let err = result.expect_err("no member is up");
        assert!(started.elapsed() < Duration::from_secs(3), "{what}");
        let msg = err.to_string();
        assert!(
            msg.contains("check controlplane.etcd_endpoints"),
            "{what}: {msg:?}"
        );
    }
}

#[test]
fn tls_settings_reach_members_requiring_client_certificates() {
    let ca = TestCa::new("keel test CA for etcd");
    let Some(cluster) = EtcdCluster::start_tls("etcd tls", 1, &ca) else {
        return;
    };
    let client = cluster.client_leaf(&ca, "controlplane");
    let tls = EtcdSettings {
        ca: Some(cluster.ca_file()),
        cert: Some(client.cert.clone()),
        key: Some(client.key.clone()),
        ..settings(cluster.endpoints())
    };
    let etcd = Etcd::connect(&tls).expect("connect over TLS with a client certificate");
    assert!(
        etcd.txn(&[Compare::absent("k")], &[Op::put("k", "v")], &[])
            .expect("txn over TLS")
            .succeeded
    );
    assert_eq!(get(&etcd, "k").expect("read over TLS").value, b"v");

    // Without a client certificate the member refuses the handshake.
    let err = Etcd::connect(&EtcdSettings {
        cert: None,
        key: None,
        ..tls.clone()
    })
    .expect_err("client certificate required");
    let msg = err.to_string();
    assert!(
        msg.contains("controlplane.etcd_ca") && msg.contains("controlplane.etcd_cert"),
        "{msg:?}"
    );

    // A CA the members' certificate does not chain to.
    let other = TestCa::new("some other CA");
    let other_ca = cluster.dir.path().join("other-ca.pem");
    std::fs::write(&other_ca, &other.pem).expect("write");
    let err = Etcd::connect(&EtcdSettings {
        ca: Some(other_ca),
        ..tls.clone()
    })
    .expect_err("untrusted server certificate");
    assert!(
        matches!(err, EtcdError::Unavailable { tls: true, .. }),
        "{err:?}"
    );
    eprintln!("etcd: wrong CA: {err}");
}

#[test]
fn a_panicking_test_leaves_no_member_running() {
    let mut pids = Vec::new();
    let mut data = None;
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let Some(cluster) = EtcdCluster::start("etcd cleanup", 3) else {
            return;
        };
        pids = cluster.pids();
        data = Some(cluster.dir.path().to_path_buf());
        panic!("a test failing with its cluster up");
    }));
    let Some(data) = data else {
        return; // etcd is not installed
    };
    assert!(outcome.is_err(), "the closure panicked");
    assert_eq!(pids.len(), 3);
    for pid in pids {
        assert!(!process_alive(pid), "etcd member {pid} outlived the panic");
    }
    assert!(!data.exists(), "{} outlived the panic", data.display());
}

#[test]
fn the_client_is_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Etcd>();
}
