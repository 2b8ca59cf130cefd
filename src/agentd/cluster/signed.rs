//! The agent's side of request signing: the keys it signs with and accepts
//! ([`load_keys`], read at startup and on SIGHUP), and [`SignedApi`], the
//! guard in front of the agent API that refuses unsigned TCP requests. It
//! never decides anything about a route: a request it lets through goes to
//! the API untouched.

use std::sync::Arc;

use crate::agentd::api::AgentApi;
use crate::agentd::cluster::error::ClusterError;
use crate::common::auth::{self, KeyFilePolicy, Keyring, Role, Signer, Verifier, unix_now};
use crate::common::config::Config;
use crate::common::http::{Handler, Peer, Request, Response};

/// Reads the node's signing key (`agent.key_file`) and the node keys its TCP
/// listener accepts (`auth.node_keys`), refusing files that are not mode
/// 0600 and owned by root (by the current user when not running as root).
pub fn load_keys(cfg: &Config) -> Result<(Signer, Verifier), ClusterError> {
    let (signer, keyring) = load_key_material(cfg)?;
    Ok((signer, Verifier::new(keyring, cfg.auth.max_clock_skew.0)))
}

/// The signing key and the accepted node keys named by `cfg` (startup and
/// SIGHUP both read them through here).
pub fn load_key_material(cfg: &Config) -> Result<(Signer, Keyring), ClusterError> {
    let policy = KeyFilePolicy::for_current_process();
    let key = auth::load_key(&cfg.agent.key_file, policy).map_err(ClusterError::Keys)?;
    let keyring = Keyring::load(&cfg.auth.node_keys, &[], policy).map_err(ClusterError::Keys)?;
    Ok((Signer::new(key), keyring))
}

/// The agent API behind the TCP listener's guard: a request that did not
/// arrive on the Unix socket must be signed with a node key, else it is
/// answered 401 (logged with the peer and the reason) and never reaches a
/// route. The Unix socket and the TCP listener share one handler, so the
/// guard goes by [`Request::peer`], which the server sets to
/// [`Peer::Unix`] only for the Unix socket.
pub struct SignedApi {
    api: AgentApi,
    verifier: Arc<Verifier>,
}

impl SignedApi {
    /// `api`, guarded by `verifier` on TCP (shared with the daemon, which
    /// replaces its keyring on SIGHUP).
    pub fn new(api: AgentApi, verifier: Arc<Verifier>) -> SignedApi {
        SignedApi { api, verifier }
    }
}

impl Handler for SignedApi {
    fn handle(&self, req: Request) -> Response {
        let must_be_signed = match req.peer {
            Peer::Unix => false,
            Peer::Tcp(_) | Peer::Buffer => true,
        };
        if must_be_signed
            && let Err(e) = auth::verify_request(&self.verifier, &req, Role::Node, unix_now())
        {
            return auth::refusal(&e);
        }
        let response = self.api.handle(req);
        if must_be_signed {
            response.authenticated()
        } else {
            response
        }
    }
}
