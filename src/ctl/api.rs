//! The jail API as keelctl calls it, on one agent's Unix socket or through
//! keel-controlplane: one method per route, JSON answers
//! decoded into [`crate::common::wire`] types, error bodies into [`ErrorBody`].
//!
//! Through the control plane every request is signed with the operator key
//! over the exact target sent ([`crate::common::auth::sign_headers`]); jail
//! routes are the scheduled `/jails/{name}`, or `/nodes/{id}/jails/{name}`
//! when a node is named; volume routes likewise (`/volumes/{name}`, resolved
//! by the control plane's volume registry, or `/nodes/{id}/volumes/{name}`).
//! Ingresses are bound to a node (its public address, its replicas), so
//! through the control plane they have only the named routes
//! `/nodes/{id}/ingresses/{name}`: `commands.rs` refuses an ingress command
//! without `--node` before calling here. Bases too (`/bases/{release}`,
//! `/nodes/{id}/bases/{release}`). The agent's own routes are the same
//! without a prefix, so one [`Route`] decides every path. Services exist only on the
//! control plane (`/services/{name}`): keelctl describes each one in a
//! [`ServiceApply`] ([`service_apply`]) because the control plane never
//! parses specs.
//!
//! This file owns request paths, signing and the decoding of answers. It never
//! prints, never reads specs or keys from disk and never decides an exit
//! status; it must never import `host`, `agentd` or `controlplane` (everything
//! the daemons say is in `common::wire`).

use std::fmt;
use std::time::Duration;

use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use crate::common::auth::{self, AuthError, Signer};
use crate::common::events::EventQuery;
use crate::common::http::failover::Failover;
use crate::common::http::{ClientResponse, Endpoint, HttpError};
use crate::common::spec::{Ingress, Jail, Service};
use crate::common::wire::{
    AppliedDocument, BaseStatus, DryRunReport, ErrorBody, EventsAnswer, IngressStatus, JailStatus,
    NodeRemoval, NodeStatus, ReplicaRequest, RolloutPolicy, ServiceApply, ServiceRevision,
    ServiceStatus, VersionInfo, VolumeStatus, volumes_query,
};

/// Header the control plane adds to an apply's answer: the node the jail
/// landed on.
pub const NODE_HEADER: &str = "X-Keel-Node";

/// How long keelctl waits for the control plane: longer than the control
/// plane's own 120 s bound on a forwarded apply, so its answer (a 503 naming
/// the node that did not answer) arrives rather than a bare timeout here.
pub const CONTROLPLANE_TIMEOUT: Duration = Duration::from_secs(130);
/// How long keelctl keeps asking while the control planes it was given
/// answer as standbys: longer than a takeover (half of the default 15 s
/// `dead_after` for the old leader's lease to run out, and a quarter of it
/// for a standby's next try).
pub const LEADER_WAIT: Duration = Duration::from_secs(20);

/// Why a call to the agent did not succeed.
#[derive(Debug)]
pub enum ApiError {
    /// The request did not get an answer (cannot connect, timeout, broken
    /// response framing).
    Http(HttpError),
    /// The daemon answered with an error status.
    Refused {
        /// Who answered.
        endpoint: String,
        /// The status code.
        status: u16,
        /// Its error body (or, if it sent none, its body as text).
        body: ErrorBody,
    },
    /// The request could not be signed (the system's random source failed).
    Sign(AuthError),
    /// The daemon answered success with a body keelctl cannot decode.
    BadResponse {
        /// Who answered.
        endpoint: String,
        /// The status code.
        status: u16,
        /// What was wrong with the body.
        reason: String,
    },
}

impl ApiError {
    /// The second line of the message: who answered what, and the field.
    pub fn detail(&self) -> Option<String> {
        match self {
            ApiError::Refused {
                endpoint,
                status,
                body,
            } => Some(match (&body.field, status) {
                (Some(field), _) => format!("field {field}; {endpoint} answered HTTP {status}"),
                (None, 401) => format!(
                    "{endpoint} answered HTTP 401: the control plane must list the operator key \
                     in auth.operator_keys (see docs/security.md)"
                ),
                (None, _) => format!("{endpoint} answered HTTP {status}"),
            }),
            _ => None,
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Http(e) => write!(f, "{e}"),
            ApiError::Sign(e) => write!(f, "cannot sign the request: {e}"),
            ApiError::Refused { body, .. } => f.write_str(&body.error),
            ApiError::BadResponse {
                endpoint,
                status,
                reason,
            } => write!(
                f,
                "{endpoint} answered HTTP {status} with a body keelctl cannot read ({reason}); \
                 are keelctl and the daemon the same version?"
            ),
        }
    }
}

impl std::error::Error for ApiError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ApiError::Http(e) => Some(e),
            ApiError::Sign(e) => Some(e),
            _ => None,
        }
    }
}

/// Which jail routes requests use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// The agent's own `/jails/{name}`.
    Agent,
    /// The control plane's scheduled `/jails/{name}`: it picks the node
    /// (sticky once placed).
    Scheduled,
    /// The control plane's `/nodes/{id}/jails/{name}`.
    Node(String),
}

/// A jail's status and, through the control plane, the node it is on when
/// the answer says so ([`NODE_HEADER`]) or the route named it.
#[derive(Debug, Clone, PartialEq)]
pub struct Located {
    /// What the agent answered.
    pub status: JailStatus,
    /// The node, when known.
    pub node: Option<String>,
}

/// A client of the jail routes of one agent, or of a control plane.
#[derive(Debug, Clone)]
pub struct Api {
    client: Failover,
    signer: Option<Signer>,
    route: Route,
}

impl Api {
    /// Talks to the agent at `endpoint` (its Unix socket), unsigned.
    pub fn new(endpoint: Endpoint) -> Api {
        Api {
            client: Failover::one(endpoint),
            signer: None,
            route: Route::Agent,
        }
    }

    /// Talks to the control plane at `addr` (`HOST:PORT`, or several
    /// separated by commas: the first that takes the connection), signing every
    /// request with `signer`; jail requests go to `node` when given, else to
    /// the scheduled routes.
    pub fn controlplane(addr: &str, signer: Signer, node: Option<String>) -> Api {
        Api {
            client: Failover::tcp(addr)
                .with_timeout(CONTROLPLANE_TIMEOUT)
                .with_leader_wait(LEADER_WAIT),
            signer: Some(signer),
            route: node.map_or(Route::Scheduled, Route::Node),
        }
    }

    /// The routes this client's jail requests use.
    pub fn route(&self) -> &Route {
        &self.route
    }

    /// Where requests go, as messages show it: the socket or `HOST:PORT`.
    pub fn endpoint(&self) -> String {
        self.client.endpoint().to_string()
    }

    /// `GET /version`: the daemon's program and version.
    pub fn version(&self) -> Result<VersionInfo, ApiError> {
        decode(self.call("GET", "/version", &[], b"")?, &self.client)
    }

    /// `PUT` the jail as YAML; the node reconciles it before answering with
    /// its status.
    ///
    /// Through the control plane the declared volume names travel in the
    /// signed target (`?volumes=`, see [`crate::common::wire::VOLUMES_PARAM`]),
    /// so the control plane can place the jail on the node holding them.
    pub fn apply_jail(&self, jail: &Jail) -> Result<Located, ApiError> {
        let mut path = self.jail_path(&jail.metadata.name);
        let names: Vec<String> = jail.spec.volumes.iter().map(|v| v.name.clone()).collect();
        if self.route != Route::Agent
            && let Some(query) = volumes_query(&names)
        {
            path = format!("{path}?{query}");
        }
        let headers = [("Content-Type".to_string(), "application/yaml".to_string())];
        let body = jail.to_yaml();
        self.located(self.call("PUT", &path, &headers, body.as_bytes())?)
    }

    /// What `PUT`ting the jail would do, changing nothing: `POST
    /// .../jails/{name}/dry-run` (object diff, decision and host commands)
    /// or, with `diff_only`, `.../diff` (object diff and decision). Through
    /// the control plane the answer names the node it asked.
    pub fn dry_run_jail(&self, jail: &Jail, diff_only: bool) -> Result<DryRunReport, ApiError> {
        let verb = if diff_only { "diff" } else { "dry-run" };
        let mut path = format!("{}/{verb}", self.jail_path(&jail.metadata.name));
        let names: Vec<String> = jail.spec.volumes.iter().map(|v| v.name.clone()).collect();
        if self.route != Route::Agent
            && let Some(query) = volumes_query(&names)
        {
            path = format!("{path}?{query}");
        }
        let headers = [("Content-Type".to_string(), "application/yaml".to_string())];
        let response = self.call("POST", &path, &headers, jail.to_yaml().as_bytes())?;
        let node = response.header(NODE_HEADER).map(str::to_string);
        let mut report: DryRunReport = decode(response, &self.client)?;
        if report.node.is_none() {
            report.node = node.or_else(|| match &self.route {
                Route::Node(id) => Some(id.clone()),
                _ => None,
            });
        }
        Ok(report)
    }

    /// The object diff of a Service against the one the control plane
    /// holds: `POST /services/{name}/diff` with the body of an apply.
    pub fn diff_service(&self, service: &Service) -> Result<DryRunReport, ApiError> {
        let path = format!("/services/{}/diff", service.metadata.name);
        let body = serde_json::to_vec(&service_apply(service)).unwrap_or_default();
        decode(
            self.call("POST", &path, &json_headers(), &body)?,
            &self.client,
        )
    }

    /// `GET /jails` on an agent. The control plane has no such list; through
    /// it, use [`Api::list_nodes`] and [`Api::list_jails_on`].
    pub fn list_jails(&self) -> Result<Vec<JailStatus>, ApiError> {
        decode(self.call("GET", "/jails", &[], b"")?, &self.client)
    }

    /// `GET /events?QUERY`, on an agent (its own) or the control plane (its
    /// own and every Alive node's, with the nodes it could not ask). A
    /// watch (`wait=1`) may be held up to [`crate::common::wire::EVENTS_WAIT`].
    pub fn events(&self, query: &EventQuery) -> Result<EventsAnswer, ApiError> {
        let query = query.to_query();
        let path = if query.is_empty() {
            "/events".to_string()
        } else {
            format!("/events?{query}")
        };
        decode(self.call("GET", &path, &[], b"")?, &self.client)
    }

    /// `GET /nodes/{id}/jails` on the control plane.
    pub fn list_jails_on(&self, node: &str) -> Result<Vec<JailStatus>, ApiError> {
        let path = format!("/nodes/{node}/jails");
        decode(self.call("GET", &path, &[], b"")?, &self.client)
    }

    /// `GET /nodes` on the control plane: every node, liveness computed when
    /// asked.
    pub fn list_nodes(&self) -> Result<Vec<NodeStatus>, ApiError> {
        decode(self.call("GET", "/nodes", &[], b"")?, &self.client)
    }

    /// One node, picked from `GET /nodes` (the control plane has no route for
    /// one); an unknown id is the 404 the control plane's `/nodes/{id}/...`
    /// routes answer.
    pub fn get_node(&self, id: &str) -> Result<NodeStatus, ApiError> {
        let nodes = self.list_nodes()?;
        nodes
            .into_iter()
            .find(|n| n.node_id == id)
            .ok_or_else(|| ApiError::Refused {
                endpoint: self.client.endpoint().to_string(),
                status: 404,
                body: ErrorBody {
                    error: format!("no node named {id}"),
                    field: None,
                },
            })
    }

    /// One jail; an unknown name is a 404.
    pub fn get_jail(&self, name: &str) -> Result<Located, ApiError> {
        self.located(self.call("GET", &self.jail_path(name), &[], b"")?)
    }

    /// `GET /jails/{name}/log` (`/nodes/{id}/jails/{name}/log` with a node
    /// named): the end of what the jail's workload printed, `tail` lines or
    /// the agent's default.
    pub fn workload_log(&self, name: &str, tail: Option<usize>) -> Result<Vec<u8>, ApiError> {
        let mut path = format!("{}/log", self.jail_path(name));
        if let Some(n) = tail {
            path.push_str(&format!("?tail={n}"));
        }
        Ok(self.call("GET", &path, &[], b"")?.body)
    }

    /// `DELETE` one jail; returns once the node has removed it.
    pub fn delete_jail(&self, name: &str) -> Result<(), ApiError> {
        self.call("DELETE", &self.jail_path(name), &[], b"")
            .map(drop)
    }

    /// `PUT /services/{name}` on the control plane with [`service_apply`];
    /// it answers once the replicas are placed, with the service's status.
    pub fn apply_service(&self, service: &Service) -> Result<ServiceStatus, ApiError> {
        let path = format!("/services/{}", service.metadata.name);
        // Strings, integers and a bool: serde_json cannot fail on them (were it
        // to, the empty body would be refused as invalid JSON, not misread).
        let body = serde_json::to_vec(&service_apply(service)).unwrap_or_default();
        decode(
            self.call("PUT", &path, &json_headers(), &body)?,
            &self.client,
        )
    }

    /// `GET /services` on the control plane.
    pub fn list_services(&self) -> Result<Vec<ServiceStatus>, ApiError> {
        decode(self.call("GET", "/services", &[], b"")?, &self.client)
    }

    /// `GET /services/{name}`; an unknown name is a 404.
    pub fn get_service(&self, name: &str) -> Result<ServiceStatus, ApiError> {
        let path = format!("/services/{name}");
        decode(self.call("GET", &path, &[], b"")?, &self.client)
    }

    /// `POST /services/{name}/scale`.
    pub fn scale_service(&self, name: &str, replicas: u32) -> Result<ServiceStatus, ApiError> {
        let body = serde_json::json!({ "replicas": replicas }).to_string();
        let path = format!("/services/{name}/scale");
        decode(
            self.call("POST", &path, &json_headers(), body.as_bytes())?,
            &self.client,
        )
    }

    /// `POST /services/{name}/undo`, to revision `to` or the one before.
    pub fn undo_service(&self, name: &str, to: Option<u64>) -> Result<ServiceStatus, ApiError> {
        let body = serde_json::json!({ "revision": to }).to_string();
        let path = format!("/services/{name}/undo");
        decode(
            self.call("POST", &path, &json_headers(), body.as_bytes())?,
            &self.client,
        )
    }

    /// `GET /services/{name}/revisions`, oldest first.
    pub fn service_revisions(&self, name: &str) -> Result<Vec<ServiceRevision>, ApiError> {
        let path = format!("/services/{name}/revisions");
        decode(self.call("GET", &path, &[], b"")?, &self.client)
    }

    /// `POST /nodes/{id}/cordon` or `/uncordon`.
    pub fn set_cordoned(&self, id: &str, cordoned: bool) -> Result<(), ApiError> {
        let verb = if cordoned { "cordon" } else { "uncordon" };
        self.call("POST", &format!("/nodes/{id}/{verb}"), &[], b"")
            .map(drop)
    }

    /// `DELETE /nodes/{id}`: the control plane forgets a Dead node, its
    /// placements and its volumes, and says which.
    pub fn delete_node(&self, id: &str) -> Result<NodeRemoval, ApiError> {
        decode(
            self.call("DELETE", &format!("/nodes/{id}"), &[], b"")?,
            &self.client,
        )
    }

    /// `DELETE /services/{name}`: the service, its replicas and its VIP.
    pub fn delete_service(&self, name: &str) -> Result<(), ApiError> {
        self.call("DELETE", &format!("/services/{name}"), &[], b"")
            .map(drop)
    }

    /// `GET /volumes` on an agent, or through the control plane every
    /// volume of the cluster (each with its node); with a node named,
    /// `GET /nodes/{id}/volumes`.
    pub fn list_volumes(&self) -> Result<Vec<VolumeStatus>, ApiError> {
        let path = match &self.route {
            Route::Node(id) => format!("/nodes/{id}/volumes"),
            _ => "/volumes".to_string(),
        };
        let mut list: Vec<VolumeStatus> = decode(self.call("GET", &path, &[], b"")?, &self.client)?;
        if let Route::Node(id) = &self.route {
            for v in &mut list {
                v.node.get_or_insert_with(|| id.clone());
            }
        }
        Ok(list)
    }

    /// One volume; an unknown name is a 404.
    /// Through the control plane its node comes from [`NODE_HEADER`] (or
    /// the named route).
    pub fn get_volume(&self, name: &str) -> Result<VolumeStatus, ApiError> {
        let response = self.call("GET", &self.volume_path(name), &[], b"")?;
        let node = match (response.header(NODE_HEADER), &self.route) {
            (Some(node), _) => Some(node.to_string()),
            (None, Route::Node(id)) => Some(id.clone()),
            (None, _) => None,
        };
        let mut status: VolumeStatus = decode(response, &self.client)?;
        status.node = status.node.or(node);
        Ok(status)
    }

    /// `DELETE` one volume dataset: 409 while a jail mounts it (or zfs keeps
    /// it busy), 404 when absent. Through the control plane its registry
    /// entry goes once the node destroyed it.
    pub fn delete_volume(&self, name: &str) -> Result<(), ApiError> {
        self.call("DELETE", &self.volume_path(name), &[], b"")
            .map(drop)
    }

    /// `PUT` the ingress as YAML; the agent records it and answers with its
    /// status at once (a certificate is issued later, off the request path).
    pub fn apply_ingress(&self, ingress: &Ingress) -> Result<IngressStatus, ApiError> {
        let path = self.ingress_path(Some(&ingress.metadata.name));
        let headers = [("Content-Type".to_string(), "application/yaml".to_string())];
        let body = ingress.to_yaml();
        decode(
            self.call("PUT", &path, &headers, body.as_bytes())?,
            &self.client,
        )
    }

    /// `GET /ingresses` on an agent, `GET /nodes/{id}/ingresses` through the
    /// control plane.
    pub fn list_ingresses(&self) -> Result<Vec<IngressStatus>, ApiError> {
        decode(
            self.call("GET", &self.ingress_path(None), &[], b"")?,
            &self.client,
        )
    }

    /// `GET /nodes/{id}/ingresses` on the control plane.
    pub fn list_ingresses_on(&self, node: &str) -> Result<Vec<IngressStatus>, ApiError> {
        let path = format!("/nodes/{node}/ingresses");
        decode(self.call("GET", &path, &[], b"")?, &self.client)
    }

    /// One ingress; an unknown name is a 404.
    pub fn get_ingress(&self, name: &str) -> Result<IngressStatus, ApiError> {
        decode(
            self.call("GET", &self.ingress_path(Some(name)), &[], b"")?,
            &self.client,
        )
    }

    /// `DELETE` one ingress; its host leaves nginx, and the ingress jail goes
    /// with the last one.
    pub fn delete_ingress(&self, name: &str) -> Result<(), ApiError> {
        self.call("DELETE", &self.ingress_path(Some(name)), &[], b"")
            .map(drop)
    }

    /// The ingress list (`name` None) or one ingress. [`Route::Scheduled`]
    /// has no ingress routes; it maps to the unprefixed path, which the
    /// control plane answers 404, should a caller forget to refuse it first.
    fn ingress_path(&self, name: Option<&str>) -> String {
        let prefix = match &self.route {
            Route::Agent | Route::Scheduled => String::new(),
            Route::Node(id) => format!("/nodes/{id}"),
        };
        match name {
            Some(name) => format!("{prefix}/ingresses/{name}"),
            None => format!("{prefix}/ingresses"),
        }
    }

    /// `PUT /bases/{release}`: starts a fetch on the node, or finds the base
    /// there; true when it was already there (200), false when a fetch runs
    /// (202).
    pub fn fetch_base(&self, release: &str) -> Result<(bool, BaseStatus), ApiError> {
        let response = self.call("PUT", &self.base_path(Some(release)), &[], b"")?;
        let present = response.status == 200;
        Ok((present, decode(response, &self.client)?))
    }

    /// `GET /bases`: the node's bases and running fetches.
    pub fn list_bases(&self) -> Result<Vec<BaseStatus>, ApiError> {
        decode(
            self.call("GET", &self.base_path(None), &[], b"")?,
            &self.client,
        )
    }

    /// One base; unknown is a 404.
    pub fn get_base(&self, release: &str) -> Result<BaseStatus, ApiError> {
        decode(
            self.call("GET", &self.base_path(Some(release)), &[], b"")?,
            &self.client,
        )
    }

    /// Like [`Api::ingress_path`]: bases belong to one node.
    fn base_path(&self, release: Option<&str>) -> String {
        let prefix = match &self.route {
            Route::Agent | Route::Scheduled => String::new(),
            Route::Node(id) => format!("/nodes/{id}"),
        };
        match release {
            Some(release) => format!("{prefix}/bases/{release}"),
            None => format!("{prefix}/bases"),
        }
    }

    fn volume_path(&self, name: &str) -> String {
        match &self.route {
            Route::Agent | Route::Scheduled => format!("/volumes/{name}"),
            Route::Node(id) => format!("/nodes/{id}/volumes/{name}"),
        }
    }

    /// Names reaching here are DNS labels (checked when parsed), so they need
    /// no escaping in a path.
    /// `GET .../jails/{name}/document`: the document the jail was applied
    /// with.
    pub fn jail_document(&self, name: &str) -> Result<String, ApiError> {
        self.document(&format!("{}/document", self.jail_path(name)))
    }

    /// `GET /services/{name}/document`: the service's current document.
    pub fn service_document(&self, name: &str) -> Result<String, ApiError> {
        self.document(&format!("/services/{name}/document"))
    }

    /// `GET .../ingresses/{name}/document`: the document the ingress was
    /// applied with.
    pub fn ingress_document(&self, name: &str) -> Result<String, ApiError> {
        self.document(&format!("{}/document", self.ingress_path(Some(name))))
    }

    fn document(&self, path: &str) -> Result<String, ApiError> {
        let applied: AppliedDocument = decode(self.call("GET", path, &[], b"")?, &self.client)?;
        Ok(applied.document)
    }

    fn jail_path(&self, name: &str) -> String {
        match &self.route {
            Route::Agent | Route::Scheduled => format!("/jails/{name}"),
            Route::Node(id) => format!("/nodes/{id}/jails/{name}"),
        }
    }

    fn located(&self, response: ClientResponse) -> Result<Located, ApiError> {
        let node = match (response.header(NODE_HEADER), &self.route) {
            (Some(node), _) => Some(node.to_string()),
            (None, Route::Node(id)) => Some(id.clone()),
            (None, _) => None,
        };
        Ok(Located {
            status: decode(response, &self.client)?,
            node,
        })
    }

    /// Sends one request, signed when this client has a key; any status
    /// outside 2xx becomes [`ApiError::Refused`].
    fn call(
        &self,
        method: &str,
        path: &str,
        headers: &[(String, String)],
        body: &[u8],
    ) -> Result<ClientResponse, ApiError> {
        let mut headers = headers.to_vec();
        if let Some(signer) = &self.signer {
            headers.extend(
                auth::sign_headers(signer, method, path, body, auth::unix_now())
                    .map_err(ApiError::Sign)?,
            );
        }
        let response = self
            .client
            .request(method, path, &headers, body)
            .map_err(ApiError::Http)?;
        if (200..300).contains(&response.status) {
            return Ok(response);
        }
        Err(ApiError::Refused {
            endpoint: self.client.endpoint().to_string(),
            status: response.status,
            body: error_body(&response.body),
        })
    }
}

/// The error body of a refusal. A body that is not Keel's JSON shape (a
/// proxy's HTML page, a future daemon's format) is shown as text rather than
/// lost.
fn error_body(body: &[u8]) -> ErrorBody {
    serde_json::from_slice(body).unwrap_or_else(|_| {
        let text = super::output::one_line(&String::from_utf8_lossy(body));
        ErrorBody {
            error: if text.is_empty() {
                "(no error message)".into()
            } else {
                text
            },
            field: None,
        }
    })
}

/// What the control plane needs to know of a validated Service: the document
/// itself (for the agents), replicas and port, whether its template has
/// volumes, what each replica requests (for spreading), and
/// [`template_digest`] so it can refuse a template change without parsing
/// the template.
pub fn service_apply(service: &Service) -> ServiceApply {
    ServiceApply {
        document: service.to_yaml(),
        replicas: service.spec.replicas,
        port: service.spec.port,
        stateful: service.spec.template.has_volumes(),
        template_digest: template_digest(service),
        volumes: service
            .spec
            .template
            .volumes
            .iter()
            .map(|v| v.name.clone())
            .collect(),
        policy: RolloutPolicy {
            max_unavailable: service.spec.update.max_unavailable,
            max_surge: service.spec.update.max_surge,
            progress_deadline_ms: millis(service.spec.update.progress_deadline.0),
            drain_timeout_ms: millis(service.spec.drain_timeout.0),
        },
        resources: Some(ReplicaRequest {
            // Specs bound cpu to the host's cores: far inside u64.
            cpu_millicores: (service.spec.template.resources.cpu.unwrap_or(0.0) * 1000.0).round()
                as u64,
            memory: service.spec.template.resources.memory.unwrap_or(0),
        }),
    }
}

/// Whole milliseconds, saturating (specs bound their durations far below).
fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Lowercase hex SHA-256 of the template as serde_json writes the typed
/// value: canonical because it is the parsed template (field order fixed by
/// the type, maps sorted, sizes as byte counts), not the user's text, so
/// reformatting the file or reordering its keys does not change it.
pub fn template_digest(service: &Service) -> String {
    // The template has string keys only and no values serde_json refuses
    // (the same reason `spec::to_yaml` cannot fail); an empty input digest
    // would still differ from every real template's.
    let json = serde_json::to_vec(&service.spec.template).unwrap_or_default();
    format!("{:x}", Sha256::digest(&json))
}

fn json_headers() -> [(String, String); 1] {
    [("Content-Type".to_string(), "application/json".to_string())]
}

fn decode<T: DeserializeOwned>(response: ClientResponse, client: &Failover) -> Result<T, ApiError> {
    serde_json::from_slice(&response.body).map_err(|e| ApiError::BadResponse {
        endpoint: client.endpoint().to_string(),
        status: response.status,
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keel_error_bodies_keep_message_and_field() {
        let body = error_body(br#"{"error":"address taken","field":"spec.network.address"}"#);
        assert_eq!(body.error, "address taken");
        assert_eq!(body.field.as_deref(), Some("spec.network.address"));
        let refused = ApiError::Refused {
            endpoint: "/s.sock".into(),
            status: 409,
            body,
        };
        assert_eq!(refused.to_string(), "address taken");
        assert_eq!(
            refused.detail().as_deref(),
            Some("field spec.network.address; /s.sock answered HTTP 409")
        );
    }

    fn service(start: &str) -> Service {
        let text = format!(
            "kind: Service\nmetadata: {{name: web}}\nspec:\n  replicas: 3\n  port: 8080\n  \
             template:\n    base: 14.2-RELEASE\n    env: {{B: '2', A: '1'}}\n    \
             exec: {{start: [{start}]}}\n"
        );
        crate::common::spec::parse_service(&text).expect("valid service")
    }

    #[test]
    fn equal_templates_have_equal_digests_and_a_changed_start_another() {
        let a = service("/bin/sleep, '300'");
        let same = service("/bin/sleep, '300'");
        let mut scaled = same.clone();
        scaled.spec.replicas = 5;
        let other = service("/bin/sleep, '301'");
        let digest = template_digest(&a);
        assert_eq!(digest.len(), 64, "{digest}");
        assert!(
            digest.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')),
            "{digest}"
        );
        assert_eq!(template_digest(&same), digest);
        assert_eq!(
            template_digest(&scaled),
            digest,
            "replicas are not the template"
        );
        assert_ne!(template_digest(&other), digest);
    }

    #[test]
    fn a_service_apply_states_what_the_control_plane_needs() {
        let mut web = service("/bin/true");
        let body = service_apply(&web);
        assert_eq!((body.replicas, body.port, body.stateful), (3, 8080, false));
        assert_eq!(body.template_digest, template_digest(&web));
        let back = crate::common::spec::parse_service(&body.document).expect("document parses");
        assert_eq!(back, web);
        web.spec
            .template
            .volumes
            .push(crate::common::spec::VolumeSpec {
                name: "data".into(),
                mount_path: "/var/db".into(),
                size: None,
            });
        let stateful = service_apply(&web);
        assert!(stateful.stateful);
        assert_ne!(stateful.template_digest, body.template_digest);
    }

    #[test]
    fn foreign_error_bodies_are_shown_as_one_line_of_text() {
        assert_eq!(
            error_body(b"<h1>Bad\nGateway</h1>\n").error,
            "<h1>Bad Gateway</h1>"
        );
        assert_eq!(error_body(b"").error, "(no error message)");
    }
}
