//! What a control plane serves while another one leads: every request
//! relayed to the leader, so that agents and keelctl given any one control
//! plane are served.
//!
//! The leader is the holder the campaign last saw on the leader key
//! ([`Standby::leader_seen`]), named by the address it advertises
//! (`controlplane.advertise_addr`, see [`holder_name`]). A request goes
//! there byte for byte: its signature covers no header a relay changes, and
//! the leader verifies it and keeps its replay cache, so a standby checks
//! nothing and holds no state.
//!
//! When no leader is known (a takeover under way, etcd out of reach) or the
//! leader takes no connection, the request was sent nowhere: the standby
//! answers [`standby_answer`], a 503 with the header that tells agents and
//! keelctl to try the next control plane. A request that reached the leader
//! and got no answer may have been acted on: that is a 502 without the
//! header, which they do not repeat. A relayed answer names the leader in
//! [`LEADER_HEADER`], so a client that knows it by that address goes there
//! directly next time. `GET /healthz` is always this process's own: a
//! standby is not the leader's health.
//!
//! It must never decide or change anything itself.

use std::sync::RwLock;
use std::time::Duration;

use crate::common::http::failover::{LEADER_HEADER, STANDBY_HEADER};
use crate::common::http::{
    Client, Endpoint, Handler, HttpError, OutgoingRequest, Request, Response,
};

/// Bound on a relayed exchange: above the 20 s an endpoint long poll may
/// wait at the leader.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(30);

/// The leader key's value for a control plane whose API the others reach
/// at `api`: the address, then the pid for the log.
pub fn holder_name(api: std::net::SocketAddr) -> String {
    format!("{api} (pid {})", std::process::id())
}

/// The API address in a [`holder_name`].
fn holder_api(holder: &str) -> &str {
    holder.split_once(" (pid ").map_or(holder, |(api, _)| api)
}

/// The answer of a standby that cannot relay: 503, with the header that
/// tells agents and keelctl to try the next control plane.
pub fn standby_answer() -> Response {
    Response::error(
        503,
        "this control plane is a standby and knows no leader it can reach: another one holds the leader key, or a takeover is under way; send the request to another control plane (give keelctl and agents every control plane, --controlplane A,B)",
        None,
    )
    .with_header(STANDBY_HEADER, "1")
}

/// A standby's route table; see the module docs.
#[derive(Default)]
pub struct Standby {
    /// The leader last seen, as a client of its API.
    leader: RwLock<Option<Client>>,
}

impl Standby {
    /// The campaign saw `holder` (a [`holder_name`]) on the leader key.
    pub fn leader_seen(&self, holder: &str) {
        let api = holder_api(holder);
        let mut leader = self.leader.write().unwrap_or_else(|p| p.into_inner());
        if leader.as_ref().map(|c| &c.endpoint) != Some(&Endpoint::Tcp(api.to_string())) {
            *leader =
                Some(Client::new(Endpoint::Tcp(api.to_string())).with_timeout(FORWARD_TIMEOUT));
        }
    }
}

impl Handler for Standby {
    fn handle(&self, req: Request) -> Response {
        if req.method == "GET" && req.path == "/healthz" {
            return standby_answer();
        }
        let leader = self
            .leader
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(leader) = leader else {
            return standby_answer();
        };
        match leader.forward(&OutgoingRequest::from(&req), &req.path, &[]) {
            Ok(answer) => match &leader.endpoint {
                Endpoint::Tcp(api) => answer.with_header(LEADER_HEADER, api),
                Endpoint::Unix(_) => answer,
            },
            Err(HttpError::Connect { .. }) => standby_answer(),
            Err(e) => Response::error(
                502,
                &format!(
                    "this standby relayed the request to the leader, which did not answer: {e}; it may or may not have been acted on: look before sending it again"
                ),
                None,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    fn request(method: &str, path: &str, body: &[u8]) -> Request {
        let peer = crate::common::http::Peer::Tcp(([192, 0, 2, 1], 40000).into());
        Request::for_test(method, path, body, peer)
    }

    #[test]
    fn a_holder_name_gives_back_its_address() {
        let api: std::net::SocketAddr = "192.0.2.10:7440".parse().expect("address");
        assert_eq!(holder_api(&holder_name(api)), "192.0.2.10:7440");
        assert_eq!(holder_api("192.0.2.10:7440"), "192.0.2.10:7440");
    }

    #[test]
    fn without_a_leader_it_answers_a_standby_503() {
        let standby = Standby::default();
        let r = standby.handle(request("PUT", "/jails/web", b"{}"));
        assert_eq!(r.status, 503);
        assert!(
            r.headers
                .iter()
                .any(|(n, v)| n.eq_ignore_ascii_case(STANDBY_HEADER) && v == "1")
        );
    }

    #[test]
    fn a_leader_that_takes_no_connection_is_a_standby_503_not_a_failure() {
        // A port nothing listens on any more.
        let addr = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port");
        let standby = Standby::default();
        standby.leader_seen(&format!("{addr} (pid 1)"));
        let r = standby.handle(request("GET", "/nodes", b""));
        assert_eq!(r.status, 503);
        assert!(r.headers.iter().any(|(n, _)| n == STANDBY_HEADER));
    }

    #[test]
    fn a_request_is_relayed_as_it_came_and_healthz_stays_local() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let leader = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            // The request head and its 2-byte body.
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") || !seen.ends_with(b"{}") {
                let n = conn.read(&mut buf).expect("read");
                assert!(n > 0, "the relay closed early");
                seen.extend_from_slice(&buf[..n]);
            }
            conn.write_all(
                b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
            )
            .expect("answer");
            String::from_utf8_lossy(&seen).into_owned()
        });
        let standby = Standby::default();
        standby.leader_seen(&holder_name(addr));
        assert_eq!(standby.handle(request("GET", "/healthz", b"")).status, 503);
        let mut req = request("PUT", "/jails/web", b"{}");
        req.query = Some("dry_run=1".into());
        req.headers
            .push(("Authorization".into(), "Keel key=op,sig=ab".into()));
        let r = standby.handle(req);
        assert_eq!((r.status, r.body.as_slice()), (201, b"ok".as_slice()));
        assert!(
            r.headers
                .iter()
                .any(|(n, v)| n == LEADER_HEADER && *v == addr.to_string()),
            "{:?}",
            r.headers
        );
        let seen = leader.join().expect("leader thread");
        assert!(
            seen.starts_with("PUT /jails/web?dry_run=1 HTTP/1.1\r\n"),
            "{seen}"
        );
        assert!(
            seen.contains("Authorization: Keel key=op,sig=ab\r\n"),
            "{seen}"
        );
    }
}
