//! Process tests of what both daemons do around their own life: one daemon
//! per state directory, no replay of a signed request across a restart, and
//! a dead or stuck worker seen by the process status and by `/healthz`.
//!
//! Every daemon runs through `util::cluster` (stopped on drop, simulated
//! jails removed), in simulate mode, with faults from `KEEL_SIM_FAULTS`.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel::common::auth::{self, KeyFilePolicy, Signer};
use keel::common::faults::ENV as FAULTS;
use keel::common::http::{Client, ClientResponse, Endpoint};

use crate::util::agent::process_alive;
use crate::util::cluster::{
    AGENTD, CONTROLPLANE, Cluster, Exited, free_port, node_ip, standard_controlplane_args,
};
use crate::util::poll_until;

const TIMEOUT: Duration = Duration::from_secs(20);

fn jail(name: &str) -> String {
    format!(
        "kind: Jail\nmetadata: {{name: {name}}}\nspec:\n  base: 14.2-RELEASE\n  \
         exec: {{start: [/bin/sleep, '300']}}\n"
    )
}

fn over_socket(socket: &Path, method: &str, path: &str, body: &[u8]) -> ClientResponse {
    Client::new(Endpoint::Unix(socket.to_path_buf()))
        .with_timeout(TIMEOUT)
        .request(method, path, &[], body)
        .unwrap_or_else(|e| panic!("{method} {path} on {}: {e}", socket.display()))
}

fn text(r: &ClientResponse) -> String {
    String::from_utf8_lossy(&r.body).into_owned()
}

/// A single-node agent's arguments: its own state dir and socket under
/// `keel-sim/` in the cluster's directory.
fn single_agent_args(cluster: &Cluster, id: &str) -> (Vec<String>, PathBuf, PathBuf) {
    let sim = cluster.dir().join("keel-sim");
    let (state, socket) = (sim.join(id), sim.join(format!("{id}.sock")));
    let args = [
        "--simulate",
        "--state-dir",
        &state.display().to_string(),
        "--socket",
        &socket.display().to_string(),
    ]
    .map(String::from)
    .to_vec();
    (args, state, socket)
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// The daemon exited non-zero and its log says every one of `phrases`.
fn assert_failed_saying(exited: &Exited, phrases: &[&str]) {
    assert!(
        !exited.status.success(),
        "{:?}\n{}",
        exited.status,
        exited.log
    );
    for phrase in phrases {
        assert!(
            exited.log.contains(phrase),
            "no {phrase:?} in:\n{}",
            exited.log
        );
    }
}

fn signer(path: &Path) -> Signer {
    Signer::new(auth::load_key(path, KeyFilePolicy::for_current_process()).expect("a key"))
}

#[test]
fn a_second_agent_on_a_state_dir_in_use_exits_naming_the_pid_and_a_restart_after_kill9_works() {
    let mut cluster = Cluster::new();
    let (args, state, socket) = single_agent_args(&cluster, "a");
    cluster.start_agent("a", &strs(&args));
    let put = over_socket(&socket, "PUT", "/jails/web", jail("web").as_bytes());
    assert_eq!(put.status, 200, "{}", text(&put));
    let first = cluster.agent_pid("a").expect("running");

    // Same state directory, another socket: without the lock this agent
    // would start and overwrite the first one's state.
    let other_socket = cluster.dir().join("keel-sim/b.sock");
    let second = cluster.run_to_exit(
        "second-agent",
        AGENTD,
        &[
            "--simulate",
            "--state-dir",
            &state.display().to_string(),
            "--socket",
            &other_socket.display().to_string(),
        ],
    );
    // The refusal names the state dir and the holder's pid.
    assert_failed_saying(
        &second,
        &[
            &state.display().to_string(),
            &format!("pid {first}"),
            "in use by another daemon",
        ],
    );
    assert!(!other_socket.exists(), "the refused agent bound its socket");
    let jails = over_socket(&socket, "GET", "/jails/web", b"");
    assert_eq!(jails.status, 200, "the first agent keeps serving");

    // kill -9 leaves the lock file and a running jail behind; neither the
    // file nor the workload (which must not inherit the lock) blocks a restart.
    let pids = crate::util::agent::sim_jail_pids(&state);
    cluster.kill9_agent("a");
    assert!(
        state.join("keel.lock").exists(),
        "the lock file stays after kill -9"
    );
    assert!(
        pids.get("web").is_some_and(|&p| process_alive(p)),
        "the jail outlives its agent: {pids:?}"
    );
    cluster.restart_agent("a");
    let after = over_socket(&socket, "GET", "/jails/web", b"");
    assert_eq!(after.status, 200, "{}", text(&after));
    let holder = std::fs::read_to_string(state.join("keel.lock")).expect("lock file");
    let restarted = cluster.agent_pid("a").expect("running");
    assert_eq!(holder.trim(), restarted.to_string());
}

#[test]
fn a_second_controlplane_on_a_state_dir_in_use_exits_naming_the_pid_and_a_restart_after_kill9_works()
 {
    let mut cluster = Cluster::new();
    let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)));
    cluster.start_controlplane(&strs(&standard_controlplane_args(listen)));
    let first = cluster.controlplane_pid().expect("running");

    let other = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)));
    let second = cluster.run_to_exit(
        "second-controlplane",
        CONTROLPLANE,
        &["--simulate", "--listen", &other.to_string()],
    );
    assert_failed_saying(
        &second,
        &[
            "keel-sim/controlplane",
            &format!("pid {first}"),
            "in use by another daemon",
        ],
    );
    let nodes = cluster.keelctl(&["get", "nodes"]);
    assert_eq!(nodes.code, 0, "the first keeps serving: {nodes:?}");

    cluster.kill9_controlplane();
    let lock = cluster.dir().join("keel-sim/controlplane/keel.lock");
    assert!(lock.exists(), "the lock file stays after kill -9");
    cluster.restart_controlplane();
    let nodes = cluster.keelctl(&["get", "nodes"]);
    assert_eq!(
        nodes.code, 0,
        "the restarted control plane serves: {nodes:?}"
    );
    let holder = std::fs::read_to_string(&lock).expect("lock file");
    let restarted = cluster.controlplane_pid().expect("running");
    assert_eq!(holder.trim(), restarted.to_string());
}

/// Sends the same signed bytes every time.
struct Captured {
    endpoint: Endpoint,
    method: &'static str,
    path: String,
    headers: Vec<(String, String)>,
}

impl Captured {
    /// Signed at `ts` by the signer's clock.
    fn sign(
        endpoint: Endpoint,
        signer: &Signer,
        method: &'static str,
        path: &str,
        ts: u64,
    ) -> Captured {
        Captured {
            endpoint,
            method,
            path: path.to_string(),
            headers: auth::sign_headers(signer, method, path, b"", ts).expect("sign"),
        }
    }

    fn send(&self) -> ClientResponse {
        Client::new(self.endpoint.clone())
            .with_timeout(TIMEOUT)
            .request(self.method, &self.path, &self.headers, b"")
            .unwrap_or_else(|e| panic!("{} {}: {e}", self.method, self.path))
    }
}

/// The refusal of a request signed for the daemon's predecessor.
fn assert_signed_before_start(r: &ClientResponse) {
    assert_eq!(r.status, 401, "{}", text(r));
    assert!(
        text(r).contains("signed before this daemon started"),
        "{}",
        text(r)
    );
}

/// Jail `web` is still on the agent behind `socket`.
fn assert_jail_still_there(socket: &Path) {
    let still = over_socket(socket, "GET", "/jails/web", b"");
    assert_eq!(
        still.status,
        200,
        "the jail is still there: {}",
        text(&still)
    );
}

/// A signed DELETE from an operator whose clock is in step, and one from an
/// operator whose clock runs 60 s ahead (accepted: within max_clock_skew).
/// The second is dated after the restart, so only the recorded replay floor
/// refuses it then.
#[test]
fn a_signed_delete_replayed_to_the_controlplane_after_a_restart_gets_401_and_deletes_nothing() {
    let mut cluster = Cluster::standard(1);
    let apply = |cluster: &Cluster| {
        let run = cluster.keelctl_with(&["apply", "-f", "-"], Some(&jail("web")));
        assert_eq!(run.code, 0, "{run:?}\n{}", cluster.logs());
    };
    let operator = signer(&cluster.operator_key());
    let endpoint = Endpoint::Tcp(cluster.controlplane_addr().to_string());
    let now = auth::unix_now();
    let deletes = [
        Captured::sign(endpoint.clone(), &operator, "DELETE", "/jails/web", now),
        Captured::sign(endpoint, &operator, "DELETE", "/jails/web", now + 60),
    ];
    for delete in &deletes {
        apply(&cluster);
        let first = delete.send();
        assert_eq!(first.status, 200, "{}", text(&first));
    }
    apply(&cluster);
    for delete in &deletes {
        let replayed = delete.send();
        assert_eq!(replayed.status, 401, "{}", text(&replayed));
        assert!(
            text(&replayed).contains("replayed request"),
            "{}",
            text(&replayed)
        );
    }

    cluster.kill9_controlplane();
    cluster.restart_controlplane();
    for delete in &deletes {
        assert_signed_before_start(&delete.send());
    }
    assert_jail_still_there(&cluster.socket("n1"));
}

#[test]
fn a_signed_delete_replayed_to_an_agent_after_its_restart_gets_401_and_deletes_nothing() {
    let mut cluster = Cluster::standard(0);
    let ip = node_ip(1);
    let advertise = SocketAddr::from((ip, free_port(ip)));
    let args = cluster.standard_agent_args("n1", advertise, ip);
    cluster.start_agent("n1", &strs(&args));
    let socket = cluster.socket("n1");
    let put = || {
        let r = over_socket(&socket, "PUT", "/jails/web", jail("web").as_bytes());
        assert_eq!(r.status, 200, "{}", text(&r));
    };
    put();
    // What the control plane sends when it forwards a delete: node-signed.
    let delete = Captured::sign(
        Endpoint::Tcp(advertise.to_string()),
        &signer(&cluster.dir().join("keel-sim/keys/node.key")),
        "DELETE",
        "/jails/web",
        auth::unix_now(),
    );
    let first = delete.send();
    assert_eq!(first.status, 200, "{}", text(&first));
    put();
    assert_eq!(delete.send().status, 401, "replayed to the same agent");

    cluster.kill9_agent("n1");
    cluster.restart_agent("n1");
    assert_signed_before_start(&delete.send());
    assert_jail_still_there(&socket);
}

#[test]
fn a_panicking_agent_worker_ends_the_agent_with_the_panic_in_its_log() {
    let mut cluster = Cluster::new();
    let (args, _, socket) = single_agent_args(&cluster, "a");
    cluster.start_agent_with(
        "a",
        &[],
        &[(FAULTS, "agent.worker.apply=panic")],
        &strs(&args),
    );
    // The connection may close before an answer: the process is going away.
    let answer = Client::new(Endpoint::Unix(socket))
        .with_timeout(TIMEOUT)
        .request("PUT", "/jails/web", &[], jail("web").as_bytes());
    if let Ok(r) = &answer {
        assert_eq!(r.status, 503, "{}", text(r));
    }
    assert_failed_saying(
        &cluster.wait_agent_exit("a"),
        &["worker thread keel-worker panicked: fault injected at agent.worker.apply"],
    );
}

#[test]
fn a_panicking_controlplane_worker_ends_the_controlplane_with_the_panic_in_its_log() {
    let mut cluster = Cluster::new();
    let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)));
    cluster.start_controlplane_with(
        &[],
        &[(FAULTS, "controlplane.worker.register=panic")],
        &strs(&standard_controlplane_args(listen)),
    );
    // Its first act is to register.
    cluster.start_standard_agent(1);
    assert_failed_saying(
        &cluster.wait_controlplane_exit(),
        &["worker thread keel-cp-worker panicked: fault injected at controlplane.worker.register"],
    );
}

#[test]
fn healthz_answers_503_while_an_apply_stalls_the_agent_worker_and_ok_after() {
    let mut cluster = Cluster::new();
    let (args, _, socket) = single_agent_args(&cluster, "a");
    cluster.start_agent_with(
        "a",
        &[],
        &[(FAULTS, "sim.zfs.clone=sleep:5s")],
        &strs(&args),
    );
    let healthz = || over_socket(&socket, "GET", "/healthz", b"");
    assert_eq!(healthz().status, 200);
    let apply = {
        let socket = socket.clone();
        std::thread::spawn(move || {
            over_socket(&socket, "PUT", "/jails/web", jail("web").as_bytes())
        })
    };
    let mut stalled = None;
    poll_until(
        "healthz 503 while the apply is stalled in zfs clone",
        || {
            let r = healthz();
            (r.status == 503)
                .then(|| stalled = Some(text(&r)))
                .is_some()
        },
    );
    let stalled = stalled.expect("a 503");
    assert!(
        stalled.contains("keel-agentd's worker has not answered within 2 s"),
        "{stalled}"
    );
    let applied = apply.join().expect("apply thread");
    assert_eq!(applied.status, 200, "{}", text(&applied));
    poll_until("healthz ok once the apply is done", || {
        healthz().status == 200
    });
}
