//! Services on a real simulated cluster: one keel-controlplane and three
//! keel-agentd on loopback. Replicas spread, scale 3 -> 5 -> 2, a killed
//! node's replicas are rescheduled by the heartbeat-driven healing, and when
//! the node comes back fencing removes its stale copies so no replica name
//! runs on two nodes.

use std::collections::BTreeMap;

use keel::common::auth::{self, KeyFilePolicy, Signer};
use keel::common::http::{Client, ClientResponse, Endpoint};
use keel::common::wire::{JailStatus, ServiceApply, ServiceStatus};

use crate::util::cluster::Cluster;

const WEB: &str = "kind: Service
metadata: {name: web}
spec:
  replicas: 3
  port: 8080
  template:
    base: 14.2-RELEASE
    resources: {cpu: 0.1}
    exec:
      start: [/bin/sleep, '300']
";

struct Operator {
    client: Client,
    signer: Signer,
}

impl Operator {
    fn new(cluster: &Cluster) -> Operator {
        let key = auth::load_key(
            &cluster.operator_key(),
            KeyFilePolicy::for_current_process(),
        )
        .expect("operator key");
        Operator {
            client: Client::new(Endpoint::Tcp(cluster.controlplane_addr().to_string())),
            signer: Signer::new(key),
        }
    }

    fn call(&self, method: &str, path: &str, body: &[u8]) -> ClientResponse {
        let headers =
            auth::sign_headers(&self.signer, method, path, body, auth::unix_now()).expect("sign");
        self.client
            .request(method, path, &headers, body)
            .expect("control plane answers")
    }

    fn put_service(&self, replicas: u32) -> ClientResponse {
        let body = ServiceApply {
            document: WEB.replace("replicas: 3", &format!("replicas: {replicas}")),
            replicas,
            port: 8080,
            stateful: false,
            template_digest: "template-of-web".into(),
            volumes: Vec::new(),
            policy: Default::default(),
            resources: None,
        };
        self.call(
            "PUT",
            "/services/web",
            &serde_json::to_vec(&body).expect("json"),
        )
    }

    fn service(&self) -> ServiceStatus {
        let r = self.call("GET", "/services/web", b"");
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        serde_json::from_slice(&r.body).expect("service status")
    }
}

/// Replica names running on each node, read from the agents' own sockets.
fn running_on(cluster: &Cluster, nodes: &[&str]) -> BTreeMap<String, Vec<String>> {
    nodes
        .iter()
        .map(|n| {
            let r = Client::new(Endpoint::Unix(cluster.socket(n)))
                .request("GET", "/jails", &[], b"")
                .expect("agent answers");
            let jails: Vec<JailStatus> = serde_json::from_slice(&r.body).expect("jails");
            let names = jails
                .into_iter()
                .filter(|j| j.name.starts_with("web-"))
                .map(|j| j.name)
                .collect();
            (n.to_string(), names)
        })
        .collect()
}

#[test]
fn replicas_spread_scale_heal_and_are_fenced() {
    let mut cluster = Cluster::standard(3);
    let op = Operator::new(&cluster);
    cluster.wait_for("three Alive nodes", || {
        let r = op.call("GET", "/nodes", b"");
        let nodes: Vec<keel::common::wire::NodeStatus> = serde_json::from_slice(&r.body).ok()?;
        let alive = nodes
            .iter()
            .filter(|n| n.status == keel::common::wire::Liveness::Alive)
            .count();
        (alive == 3).then_some(())
    });

    let r = op.put_service(3);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let status = cluster.wait_for("3 ready replicas", || {
        let s = op.service();
        (s.ready == 3).then_some(s)
    });
    let mut nodes: Vec<&str> = status.replicas.iter().map(|r| r.node.as_str()).collect();
    nodes.sort();
    nodes.dedup();
    assert_eq!(nodes.len(), 3, "one replica per node: {status:?}");
    assert!(
        "127.128.0.0/16"
            .parse::<keel::common::cidr::Ipv4Net>()
            .expect("cidr")
            .contains(status.vip)
    );

    // The port is immutable.
    let body = ServiceApply {
        document: WEB.into(),
        replicas: 3,
        port: 9090,
        stateful: false,
        template_digest: "template-of-web".into(),
        volumes: Vec::new(),
        policy: Default::default(),
        resources: None,
    };
    let r = op.call(
        "PUT",
        "/services/web",
        &serde_json::to_vec(&body).expect("json"),
    );
    assert_eq!(r.status, 409);
    assert!(String::from_utf8_lossy(&r.body).contains("spec.port"));

    // Scale 3 -> 5 -> 2.
    assert_eq!(op.put_service(5).status, 200);
    cluster.wait_for("5 ready replicas", || {
        (op.service().ready == 5).then_some(())
    });
    assert_eq!(op.put_service(2).status, 200);
    cluster.wait_for("2 replicas left on the nodes", || {
        let on = running_on(&cluster, &["n1", "n2", "n3"]);
        let total: usize = on.values().map(Vec::len).sum();
        (total == 2 && op.service().ready == 2).then_some(())
    });
    assert_eq!(op.service().vip, status.vip, "the VIP never changes");

    // Kill the node of web-0: after dead_after its replica is placed again
    // elsewhere and the service is back to 2 ready replicas.
    let victim = op
        .service()
        .replicas
        .iter()
        .find(|r| r.name == "web-0")
        .map(|r| r.node.clone())
        .expect("web-0 placed");
    cluster.kill9_agent(&victim);
    let healed = cluster.wait_for("web-0 rescheduled", || {
        let s = op.service();
        let moved = s
            .replicas
            .iter()
            .any(|r| r.name == "web-0" && r.node != victim && r.ready);
        (moved && s.ready == 2).then_some(s)
    });
    assert!(healed.replicas.iter().all(|r| r.node != victim));

    // Bring it back: fencing deletes its stale web-0 within a heartbeat or
    // two, and no replica name is listed by two nodes.
    cluster.restart_agent(&victim);
    let others: Vec<&str> = ["n1", "n2", "n3"]
        .into_iter()
        .filter(|x| *x != victim)
        .collect();
    cluster.wait_for("the stale copy to be fenced", || {
        running_on(&cluster, &[&victim])[&victim]
            .is_empty()
            .then_some(())
    });
    let on = running_on(&cluster, &["n1", "n2", "n3"]);
    let mut names: Vec<&String> = on.values().flatten().collect();
    let listed = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), listed, "a replica runs twice: {on:?}");
    assert!(others.iter().any(|n| on[*n].contains(&"web-0".to_string())));

    // Deleting the service removes its replicas and frees its VIP.
    assert_eq!(op.call("DELETE", "/services/web", b"").status, 200);
    assert_eq!(op.call("GET", "/services/web", b"").status, 404);
    cluster.wait_for("replicas removed", || {
        running_on(&cluster, &["n1", "n2", "n3"])
            .values()
            .all(Vec::is_empty)
            .then_some(())
    });
}
