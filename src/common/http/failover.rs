//! Several addresses of one service, the control planes of a cluster, as
//! one client.
//!
//! Owns choosing the address a request goes to. A request goes to the
//! address that answered last. An address that cannot be connected to was
//! sent nothing, so the request moves on to the next one at once, and the
//! caller sees an error only when no address takes the connection. A
//! transport failure after the request was written (a reset, a read
//! timeout: a control plane killed or frozen mid-request) is the caller's
//! error, since the request may have been acted on and only the caller
//! knows whether it can be repeated; the next request starts from the next
//! address. So a caller sees at most one failed request for each control
//! plane it loses.
//!
//! A standby control plane (one waiting for the leader key) relays requests
//! to the leader; when it knows none it can reach, it answers 503 with
//! [`STANDBY_HEADER`] and does nothing else, so such an answer counts as a
//! connection not taken: the request moves on too. A relayed answer names
//! the leader in [`LEADER_HEADER`]; when that is one of the configured
//! addresses, as written there, the next request goes to it directly, so a
//! client does not stay on a relay.
//!
//! It must never retry a request that reached a daemon which may have
//! acted on it, and looks at no answer but for that header.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::HttpError;
use super::client::{Client, ClientResponse, Endpoint};
use crate::common::config::comma_list;

/// The header of a standby's answer: it did nothing, ask the next one.
pub const STANDBY_HEADER: &str = "Keel-Standby";

/// The header of an answer a standby relayed: the leader's address.
pub const LEADER_HEADER: &str = "Keel-Leader";

/// A client for several endpoints of one service; see the module docs.
#[derive(Debug)]
pub struct Failover {
    clients: Vec<Client>,
    /// Index of the client that answered last.
    preferred: AtomicUsize,
    /// How long to keep asking while standbys answer and no leader does.
    leader_wait: Duration,
}

impl Clone for Failover {
    fn clone(&self) -> Failover {
        Failover {
            clients: self.clients.clone(),
            preferred: AtomicUsize::new(self.preferred.load(Ordering::Relaxed)),
            leader_wait: self.leader_wait,
        }
    }
}

/// What one pass over the endpoints came to.
enum Pass {
    /// An answer, or a failure after the request was sent.
    Done(Result<ClientResponse, HttpError>),
    /// Only standbys answered (and the others took no connection).
    Standby(ClientResponse),
    /// No endpoint took the connection.
    Refused(HttpError),
}

impl Failover {
    /// One endpoint: a plain client with nothing to fail over to.
    pub fn one(endpoint: Endpoint) -> Failover {
        Failover::new(vec![Client::new(endpoint)])
    }

    /// TCP clients for the comma-separated `HOST:PORT` addresses of `list`
    /// (see [`comma_list`]; checking each is the configuration's job).
    pub fn tcp(list: &str) -> Failover {
        Failover::new(
            comma_list(list)
                .into_iter()
                .map(|a| Client::new(Endpoint::Tcp(a)))
                .collect(),
        )
    }

    fn new(clients: Vec<Client>) -> Failover {
        Failover {
            clients,
            preferred: AtomicUsize::new(0),
            leader_wait: Duration::ZERO,
        }
    }

    /// The same endpoints, asking again for up to `wait` while standbys
    /// answer and no control plane leads: a takeover in progress (a
    /// standby's answer means nothing was done, so asking again is safe).
    /// Endpoints that all refuse the connection fail at once.
    pub fn with_leader_wait(mut self, wait: Duration) -> Failover {
        self.leader_wait = wait;
        self
    }

    /// The same endpoints with `timeout` on connecting and on each read and
    /// write.
    pub fn with_timeout(mut self, timeout: Duration) -> Failover {
        self.clients = self
            .clients
            .into_iter()
            .map(|c| c.with_timeout(timeout))
            .collect();
        self
    }

    /// The endpoint the next request goes to first.
    pub fn endpoint(&self) -> &Endpoint {
        &self.clients[self.first()].endpoint
    }

    /// Every endpoint, in the configured order.
    pub fn endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.clients.iter().map(|c| &c.endpoint)
    }

    fn first(&self) -> usize {
        self.preferred.load(Ordering::Relaxed) % self.clients.len().max(1)
    }

    /// Sends one request (see [`Client::request`]) to the preferred
    /// endpoint, or to the next ones in turn while a connection cannot be
    /// made.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<ClientResponse, HttpError> {
        let start = std::time::Instant::now();
        let mut pause = Duration::from_millis(100);
        loop {
            match self.pass(method, path, headers, body) {
                Pass::Done(result) => return result,
                Pass::Refused(e) => return Err(e),
                Pass::Standby(answer) => {
                    if start.elapsed() + pause > self.leader_wait {
                        return Ok(answer);
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    fn pass(&self, method: &str, path: &str, headers: &[(String, String)], body: &[u8]) -> Pass {
        let first = self.first();
        let mut refused = Vec::new();
        let mut standby = None;
        for step in 0..self.clients.len() {
            let at = (first + step) % self.clients.len();
            match self.clients[at].request(method, path, headers, body) {
                Ok(response)
                    if response.status == 503 && response.header(STANDBY_HEADER).is_some() =>
                {
                    standby = Some(response);
                }
                Ok(response) => {
                    let leader = response.header(LEADER_HEADER).and_then(|leader| {
                        self.clients
                            .iter()
                            .position(|c| c.endpoint == Endpoint::Tcp(leader.to_string()))
                    });
                    self.preferred
                        .store(leader.unwrap_or(at), Ordering::Relaxed);
                    return Pass::Done(Ok(response));
                }
                Err(HttpError::Connect { endpoint, source }) => refused.push((endpoint, source)),
                Err(e) => {
                    // It may have been acted on: not repeated here; the next
                    // request tries the next control plane first.
                    self.preferred.store(at + 1, Ordering::Relaxed);
                    return Pass::Done(Err(e));
                }
            }
        }
        // Every one is a standby or down: the standby's answer says more.
        match standby {
            Some(response) => Pass::Standby(response),
            None => Pass::Refused(none_connected(refused)),
        }
    }
}

/// One error for an exchange that reached no endpoint: every endpoint
/// named, with the last one's reason.
fn none_connected(refused: Vec<(String, std::io::Error)>) -> HttpError {
    let names: Vec<&str> = refused.iter().map(|(e, _)| e.as_str()).collect();
    let endpoint = names.join(" or ");
    let source = match refused.into_iter().last() {
        Some((_, source)) => source,
        None => std::io::Error::new(std::io::ErrorKind::NotFound, "no address is configured"),
    };
    HttpError::Connect { endpoint, source }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    /// An address nothing listens on (bound, then closed).
    fn refusing() -> String {
        let l = TcpListener::bind("127.0.0.1:0").expect("binds");
        let addr = l.local_addr().expect("addr").to_string();
        drop(l);
        addr
    }

    /// How a test server answers.
    #[derive(Clone, PartialEq)]
    enum Mode {
        /// 200 with its name as the body.
        Answer,
        /// Closes the connection once the request is read.
        HangUp,
        /// A standby's 503.
        Standby,
        /// 200 with its name, relayed from the leader at this address.
        Relayed(String),
    }

    /// A server answering `n` requests as `mode` says; counts the requests
    /// it read.
    fn server(name: &'static str, mode: Mode, n: usize) -> (String, Arc<AtomicUsize>) {
        let l = TcpListener::bind("127.0.0.1:0").expect("binds");
        let addr = l.local_addr().expect("addr").to_string();
        let seen = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&seen);
        std::thread::spawn(move || {
            for stream in l.incoming().take(n) {
                let Ok(mut s) = stream else { continue };
                let mut buf = [0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => got.extend_from_slice(&buf[..k]),
                    }
                }
                counter.fetch_add(1, Ordering::SeqCst);
                if mode == Mode::Standby {
                    let _ = write!(
                        s,
                        "HTTP/1.1 503 Service Unavailable\r\n{STANDBY_HEADER}: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    );
                } else if let Mode::Relayed(leader) = &mode {
                    let _ = write!(
                        s,
                        "HTTP/1.1 200 OK\r\n{LEADER_HEADER}: {leader}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{name}",
                        name.len()
                    );
                } else if mode == Mode::Answer {
                    let _ = write!(
                        s,
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{name}",
                        name.len()
                    );
                }
            }
        });
        (addr, seen)
    }

    fn get(f: &Failover) -> Result<String, HttpError> {
        f.request("GET", "/version", &[], b"")
            .map(|r| String::from_utf8_lossy(&r.body).into_owned())
    }

    #[test]
    fn a_refused_connection_moves_on_at_once_and_the_answering_one_is_kept() {
        let (live, seen) = server("b", Mode::Answer, 2);
        let f = Failover::tcp(&format!("{},{live}", refusing()));
        assert_eq!(get(&f).expect("the second answers"), "b");
        assert_eq!(f.endpoint(), &Endpoint::Tcp(live.clone()));
        assert_eq!(get(&f).expect("asked first now"), "b");
        assert_eq!(seen.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_request_that_reached_a_daemon_is_not_repeated_but_the_next_goes_elsewhere() {
        let (dying, dying_seen) = server("a", Mode::HangUp, 1);
        let (live, live_seen) = server("b", Mode::Answer, 1);
        let f = Failover::tcp(&format!("{dying},{live}"));
        let e = get(&f).expect_err("the first hung up after reading the request");
        assert!(!matches!(e, HttpError::Connect { .. }), "{e}");
        assert_eq!(live_seen.load(Ordering::SeqCst), 0, "not repeated");
        assert_eq!(get(&f).expect("the next goes to the other"), "b");
        assert_eq!(dying_seen.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_standby_is_passed_over_and_answers_only_when_no_one_leads() {
        let (standby, standby_seen) = server("a", Mode::Standby, 2);
        let (live, _) = server("b", Mode::Answer, 1);
        let f = Failover::tcp(&format!("{standby},{live}"));
        assert_eq!(get(&f).expect("the leader answers"), "b");
        assert_eq!(standby_seen.load(Ordering::SeqCst), 1);
        let alone = Failover::tcp(&format!("{standby},{}", refusing()));
        let answer = alone
            .request("GET", "/nodes", &[], b"")
            .expect("the standby's answer");
        assert_eq!(answer.status, 503);
    }

    #[test]
    fn a_relayed_answer_sends_the_next_request_to_the_leader_it_names() {
        let (live, live_seen) = server("b", Mode::Answer, 1);
        let (relay, relay_seen) = server("b", Mode::Relayed(live.clone()), 1);
        let f = Failover::tcp(&format!("{relay},{live}"));
        assert_eq!(get(&f).expect("relayed"), "b");
        assert_eq!(f.endpoint(), &Endpoint::Tcp(live.clone()));
        assert_eq!(get(&f).expect("straight to the leader"), "b");
        assert_eq!(
            (
                relay_seen.load(Ordering::SeqCst),
                live_seen.load(Ordering::SeqCst)
            ),
            (1, 1)
        );
        // A leader named otherwise than configured changes nothing.
        let (relay, _) = server("b", Mode::Relayed("leader.example:7440".into()), 1);
        let f = Failover::tcp(&format!("{relay},{}", refusing()));
        assert_eq!(get(&f).expect("relayed"), "b");
        assert_eq!(f.endpoint(), &Endpoint::Tcp(relay));
    }

    #[test]
    fn when_none_connects_the_error_names_every_address() {
        let (a, b) = (refusing(), refusing());
        let f = Failover::tcp(&format!("{a},{b}"));
        let e = get(&f).expect_err("nothing listens");
        let text = e.to_string();
        assert!(text.contains(&format!("{a} or {b}")), "{text}");
        assert!(text.contains("is the daemon running"), "{text}");
    }
}
