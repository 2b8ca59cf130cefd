//! A real etcd cluster on loopback for the etcd client's process tests:
//! N members of Debian's etcd (package etcd-server), each with its own
//! ports and data directory in the test's temporary directory, optionally
//! serving clients over TLS with client certificate authentication.
//!
//! Health is read from each member's plain-HTTP metrics listener
//! (`/health`, true once the member has a leader and a quorum answers), so
//! it needs no client certificate even when clients must present one.
//!
//! Every member still running is killed (SIGKILL) and reaped when the
//! [`EtcdCluster`] drops, a panicking test included; a panicking test also
//! gets the tail of each member's log on stderr.

use std::fs;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use keel::common::http::{Client, Endpoint};

use super::pki::{Leaf, TestCa};
use super::poll_until;

/// The etcd binary .ci/run installs (Debian package etcd-server).
pub const ETCD: &str = "/usr/bin/etcd";

/// True when etcd is installed. Without it the test prints why and passes,
/// unless `CI` is set: there `.ci/run` installs it and its absence is a
/// failure.
pub fn present(test: &str) -> bool {
    if Path::new(ETCD).exists() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{ETCD} is missing under CI: .ci/run must install the Debian package etcd-server"
    );
    eprintln!("skipping {test}: install the Debian package etcd-server to run it");
    false
}

/// `n` distinct ports nothing listens on right now (all bound at once, so
/// they differ; another process could take one before etcd binds it, which
/// these tests accept).
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("addr").port())
        .collect()
}

/// A member's Prometheus text. Asked in HTTP/1.0, since etcd answers
/// /metrics chunked otherwise, which keel's HTTP client refuses.
fn metrics(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    Some(text)
}

/// TLS for the members' client listeners: a server leaf for 127.0.0.1 and
/// the CA that signs the clients' certificates.
struct ServerTls {
    leaf: Leaf,
    ca_file: PathBuf,
}

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    metrics_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// A running etcd cluster; see the module docs.
pub struct EtcdCluster {
    members: Vec<Member>,
    initial_cluster: String,
    token: String,
    tls: Option<ServerTls>,
    /// A second address the members' client listeners bind.
    also_on: Option<Ipv4Addr>,
    /// Data directories, logs and certificates; removed after the members
    /// are killed (fields drop after [`Drop::drop`] runs).
    pub dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `members` members over plain HTTP and waits until every one is
    /// healthy; `None` when etcd is not installed (see [`present`]).
    pub fn start(test: &str, members: usize) -> Option<EtcdCluster> {
        present(test).then(|| EtcdCluster::launch(members, None, None))
    }

    /// Like [`EtcdCluster::start`], but the members also take clients on
    /// `addr`, an address of the test host other than loopback (a veth's,
    /// reachable from a network namespace): see [`EtcdCluster::endpoints_on`].
    pub fn start_also_on(test: &str, members: usize, addr: Ipv4Addr) -> Option<EtcdCluster> {
        present(test).then(|| EtcdCluster::launch(members, None, Some(addr)))
    }

    /// Like [`EtcdCluster::start`], but clients must speak TLS to the
    /// members, trusting `ca`, and present a certificate `ca` signed.
    pub fn start_tls(test: &str, members: usize, ca: &TestCa) -> Option<EtcdCluster> {
        present(test).then(|| EtcdCluster::launch(members, Some(ca), None))
    }

    fn launch(n: usize, ca: Option<&TestCa>, also_on: Option<Ipv4Addr>) -> EtcdCluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let tls = ca.map(|ca| {
            let ca_file = dir.path().join("ca.pem");
            fs::write(&ca_file, &ca.pem).expect("write ca");
            ServerTls {
                leaf: ca.leaf(&["127.0.0.1", "localhost"], dir.path(), "etcd-server"),
                ca_file,
            }
        });
        let ports = free_ports(3 * n);
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: ports[3 * i],
                peer_port: ports[3 * i + 1],
                metrics_port: ports[3 * i + 2],
                data_dir: dir.path().join(format!("m{i}.etcd")),
                log: dir.path().join(format!("m{i}.log")),
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        // Unique per cluster, so members of two tests' clusters never join
        // each other even if a port was reused.
        let token = format!(
            "keel-test-{}-{}",
            std::process::id(),
            dir.path().display().to_string().replace('/', "-")
        );
        let mut cluster = EtcdCluster {
            members,
            initial_cluster,
            token,
            tls,
            also_on,
            dir,
        };
        // Each member waits for the others to elect a leader: start all of
        // them before waiting on any.
        for i in 0..n {
            cluster.spawn(i);
        }
        for i in 0..n {
            cluster.wait_healthy(i);
        }
        cluster
    }

    fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    fn spawn(&mut self, i: usize) {
        let scheme = self.scheme();
        let m = &self.members[i];
        assert!(m.child.is_none(), "member {i} is already running");
        let client_url = format!("{scheme}://127.0.0.1:{}", m.client_port);
        let listen_urls = match self.also_on {
            Some(addr) => format!("{client_url},{scheme}://{addr}:{}", m.client_port),
            None => client_url.clone(),
        };
        let peer_url = format!("http://127.0.0.1:{}", m.peer_port);
        let mut cmd = Command::new(ETCD);
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .args(["--listen-client-urls", &listen_urls])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args([
                "--listen-metrics-urls",
                &format!("http://127.0.0.1:{}", m.metrics_port),
            ])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &self.token])
            .args(["--logger", "zap", "--log-outputs", "stderr"]);
        if let Some(tls) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&tls.leaf.cert)
                .arg("--key-file")
                .arg(&tls.leaf.key)
                .arg("--trusted-ca-file")
                .arg(&tls.ca_file)
                .arg("--client-cert-auth");
        }
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .expect("member log");
        let err = log.try_clone().expect("member log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .expect("spawn etcd");
        self.members[i].child = Some(child);
    }

    fn wait_healthy(&self, i: usize) {
        let m = &self.members[i];
        let client = Client::new(Endpoint::Tcp(format!("127.0.0.1:{}", m.metrics_port)))
            .with_timeout(Duration::from_secs(2));
        poll_until(&format!("etcd member {} healthy", m.name), || {
            client
                .request("GET", "/health", &[], b"")
                .is_ok_and(|r| r.status == 200 && String::from_utf8_lossy(&r.body).contains("true"))
        });
    }

    /// The member that is raft leader now, as its own metrics say; `None`
    /// while there is none (an election).
    pub fn leader(&self) -> Option<usize> {
        (0..self.members.len()).find(|&i| {
            let m = &self.members[i];
            m.child.is_some()
                && metrics(m.metrics_port)
                    .is_some_and(|text| text.lines().any(|l| l == "etcd_server_is_leader 1"))
        })
    }

    /// The leader once there is one (see [`EtcdCluster::leader`]).
    pub fn wait_leader(&self) -> usize {
        let mut leader = None;
        poll_until("an etcd leader", || {
            leader = self.leader();
            leader.is_some()
        });
        leader.expect("polled until some")
    }

    /// Client URLs of every member, running or not, in member order.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Client URLs of every member on the address of
    /// [`EtcdCluster::start_also_on`].
    pub fn endpoints_on(&self, addr: Ipv4Addr) -> Vec<String> {
        assert_eq!(self.also_on, Some(addr), "the members listen on {addr}");
        self.members
            .iter()
            .map(|m| format!("{}://{addr}:{}", self.scheme(), m.client_port))
            .collect()
    }

    /// Client settings for every member under `prefix`, plain HTTP, with a
    /// bound of 5 s on each call (the machine may be busy with builds).
    pub fn settings(&self, prefix: &str) -> keel::controlplane::etcd::EtcdSettings {
        keel::controlplane::etcd::EtcdSettings {
            endpoints: self.endpoints(),
            ca: None,
            cert: None,
            key: None,
            prefix: prefix.into(),
            timeout: Duration::from_secs(5),
        }
    }

    /// Member `i`'s client URL.
    pub fn endpoint(&self, i: usize) -> String {
        format!(
            "{}://127.0.0.1:{}",
            self.scheme(),
            self.members[i].client_port
        )
    }

    /// SIGKILLs member `i` and reaps it.
    pub fn kill(&mut self, i: usize) {
        let mut child = self.members[i]
            .child
            .take()
            .unwrap_or_else(|| panic!("member {i} is not running"));
        child.kill().expect("SIGKILL etcd");
        child.wait().expect("reap etcd");
    }

    /// Starts member `i` again on its data directory and waits until it is
    /// healthy (back in the cluster).
    pub fn restart(&mut self, i: usize) {
        self.spawn(i);
        self.wait_healthy(i);
    }

    /// A client certificate for [`EtcdCluster::start_tls`]'s members, signed
    /// by `ca`, written into the cluster's directory.
    pub fn client_leaf(&self, ca: &TestCa, stem: &str) -> Leaf {
        ca.leaf(&["keel-controlplane"], self.dir.path(), stem)
    }

    /// Process ids of the members running now.
    pub fn pids(&self) -> Vec<u32> {
        self.members
            .iter()
            .filter_map(|m| m.child.as_ref().map(Child::id))
            .collect()
    }

    /// The CA file the members were given (TLS clusters only).
    pub fn ca_file(&self) -> PathBuf {
        self.tls.as_ref().expect("a TLS cluster").ca_file.clone()
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut child) = m.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if std::thread::panicking() {
            for m in &self.members {
                let log = fs::read_to_string(&m.log).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                let tail = lines[lines.len().saturating_sub(20)..].join("\n");
                eprintln!("--- etcd member {} log (last 20 lines) ---\n{tail}", m.name);
            }
        }
    }
}
