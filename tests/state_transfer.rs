//! `keel-controlplane --export-state` and `--import-state` on a real
//! simulated cluster: refused beside a running control plane (the state
//! directory's lock); a stopped one's state exported, its directory moved
//! aside and the state imported into a new one; a second import into it
//! refused; the control plane restarted on the imported state knowing the
//! node and the jail's placement.

use std::net::{Ipv4Addr, SocketAddr};

use crate::util::cluster::{CONTROLPLANE, Cluster, free_port, standard_controlplane_args};

#[test]
fn a_stopped_control_planes_state_moves_to_another_directory() {
    let mut cluster = Cluster::new();
    let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)));
    let state = cluster.dir().join("cp-state");
    let state_dir = state.to_str().expect("utf-8").to_string();
    let mut args = standard_controlplane_args(listen);
    args.extend(["--state-dir".to_string(), state_dir.clone()]);
    cluster.start_controlplane(&args.iter().map(String::as_str).collect::<Vec<_>>());
    cluster.start_standard_agent(1);
    cluster.wait_alive(1);
    let spec = "kind: Jail\nmetadata: {name: moved}\nspec:\n  base: 14.2-RELEASE\n  \
                exec: {start: [/bin/sleep, '300']}\n";
    let run = cluster.keelctl_with(&["apply", "-f", "-"], Some(spec));
    assert_eq!(run.code, 0, "{run:?}");

    // Beside the running control plane: refused, nothing written.
    let export = cluster.dir().join("cluster.json");
    let file = export.to_str().expect("utf-8");
    let live = cluster.run_to_exit(
        "export-live",
        CONTROLPLANE,
        &[
            "--simulate",
            "--state-dir",
            &state_dir,
            "--export-state",
            file,
        ],
    );
    assert_eq!(live.status.code(), Some(1), "{}", live.log);
    assert!(
        live.log.contains("stop it before moving its state"),
        "{}",
        live.log
    );
    assert!(!export.exists());

    cluster.stop_controlplane();
    let out = cluster.run_to_exit(
        "export",
        CONTROLPLANE,
        &[
            "--simulate",
            "--state-dir",
            &state_dir,
            "--export-state",
            file,
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", out.log);
    assert!(
        out.log.contains("exported 1 node, 1 placement"),
        "{}",
        out.log
    );

    std::fs::rename(&state, cluster.dir().join("cp-state.old")).expect("moved aside");
    let import = [
        "--simulate",
        "--state-dir",
        &state_dir,
        "--import-state",
        file,
    ];
    let out = cluster.run_to_exit("import", CONTROLPLANE, &import);
    assert_eq!(out.status.code(), Some(0), "{}", out.log);
    let again = cluster.run_to_exit("import-again", CONTROLPLANE, &import);
    assert_eq!(again.status.code(), Some(1), "{}", again.log);
    assert!(
        again
            .log
            .contains("already holds a cluster (1 node, 1 placement)"),
        "{}",
        again.log
    );

    // A control plane on the imported state: the node (back Alive with its
    // next heartbeat) and the placement, so the jail is found where it runs.
    cluster.restart_controlplane();
    cluster.wait_alive(1);
    let got = cluster.keelctl_ok(&["get", "jails", "moved"]);
    assert!(got.stdout.contains("moved"), "{got:?}");
}
