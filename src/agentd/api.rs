//! The agent's route table (DESIGN.md section 5), the same for the Unix socket
//! and the optional TCP listener.
//!
//! Handlers run on connection threads and own nothing: they parse and validate
//! the request, hand a command to the worker through [`WorkerHandle`], and turn
//! the answer into JSON. Spec bodies are YAML and are validated here, before the
//! worker ever sees them, so a bad document changes nothing.

use serde::Serialize;

use crate::agentd::reconciler::ReconcileError;
use crate::agentd::worker::{WorkerGone, WorkerHandle};
use crate::common::http::{Handler, Request, Response};
use crate::common::spec;
use crate::common::wire::EPOCH_HEADER;

/// The agent API.
pub struct AgentApi {
    worker: WorkerHandle,
}

impl AgentApi {
    /// Routes requests to `worker`.
    pub fn new(worker: WorkerHandle) -> AgentApi {
        AgentApi { worker }
    }

    fn route(&self, req: &Request) -> Result<Response, WorkerGone> {
        let segments = req.segments();
        let method = req.method.as_str();
        Ok(match (method, segments.as_slice()) {
            ("GET", ["healthz"]) => Response::json(200, &Health { status: "ok" }),
            ("GET", ["metrics"]) => Response::text(200, self.worker.metrics()?)
                .with_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8"),
            ("GET", ["jails"]) => Response::json(200, &self.worker.list()?),
            ("GET", ["jails", name]) => match check_name(name) {
                Err(r) => r,
                Ok(()) => match self.worker.get(name)? {
                    Some(status) => Response::json(200, &status),
                    None => not_found(name),
                },
            },
            ("PUT", ["jails", name]) => match check_name(name) {
                Err(r) => r,
                Ok(()) => self.put_jail(name, req)?,
            },
            ("DELETE", ["jails", name]) => match check_name(name) {
                Err(r) => r,
                Ok(()) => match self.worker.delete(name)? {
                    Ok(()) => Response::json(200, &Deleted { deleted: name }),
                    Err(e) => error_response(&e),
                },
            },
            (_, ["healthz"]) | (_, ["metrics"]) | (_, ["jails"]) => method_not_allowed("GET"),
            (_, ["jails", _]) => method_not_allowed("GET, PUT, DELETE"),
            _ => Response::error(404, &format!("no route for {method} {}", req.path), None),
        })
    }

    fn put_jail(&self, name: &str, req: &Request) -> Result<Response, WorkerGone> {
        let Ok(text) = std::str::from_utf8(&req.body) else {
            return Ok(Response::error(
                400,
                "the body must be a UTF-8 YAML Jail spec",
                None,
            ));
        };
        let jail = match jail_for(name, text) {
            Ok(j) => j,
            Err(response) => return Ok(response),
        };
        let epoch = match req.header(EPOCH_HEADER).map(str::parse::<u64>) {
            None => None,
            Some(Ok(e)) => Some(e),
            Some(Err(_)) => {
                return Ok(Response::error(
                    400,
                    &format!("{EPOCH_HEADER} must be an unsigned integer"),
                    Some(EPOCH_HEADER),
                ));
            }
        };
        Ok(match self.worker.apply(jail, epoch)? {
            Ok(status) => Response::json(200, &status),
            Err(e) => error_response(&e),
        })
    }
}

/// The jail a `PUT /jails/{name}` asks for. The body is either a Jail
/// document named `name`, or (from the control plane, placing a replica) the
/// Service document whose replica `name` is: `{service}-{index}` with the
/// index below `spec.replicas`, expanded from the template
/// (`JailTemplate::to_jail_spec`, which also renames the volumes).
fn jail_for(name: &str, text: &str) -> Result<spec::Jail, Response> {
    let bad = |e: spec::SpecError| Response::error(400, &e.to_string(), Some(&e.field));
    let mut docs = spec::parse_documents(text).map_err(bad)?;
    if docs.len() != 1 {
        return Err(Response::error(
            400,
            &format!(
                "the body must hold exactly one document, it holds {}",
                docs.len()
            ),
            None,
        ));
    }
    match docs.remove(0) {
        spec::Document::Jail(jail) if jail.metadata.name == name => Ok(jail),
        spec::Document::Jail(jail) => Err(Response::error(
            400,
            &format!(
                "metadata.name is {} but the request is for /jails/{name}",
                jail.metadata.name
            ),
            Some("metadata.name"),
        )),
        spec::Document::Service(service) => {
            let svc = &service.metadata.name;
            let index = name
                .strip_prefix(svc.as_str())
                .and_then(|rest| rest.strip_prefix('-'))
                .and_then(|i| i.parse::<u32>().ok());
            match index {
                Some(i) if i < service.spec.replicas => {
                    Ok(service.spec.template.to_jail_spec(name))
                }
                _ => Err(Response::error(
                    400,
                    &format!(
                        "{name} is not a replica of service {svc} (replicas are {svc}-0 to {svc}-{})",
                        service.spec.replicas.saturating_sub(1)
                    ),
                    Some("metadata.name"),
                )),
            }
        }
        other => Err(Response::error(
            400,
            &format!(
                "PUT /jails takes a Jail (or a Service replica), not a {}",
                other.kind()
            ),
            Some("kind"),
        )),
    }
}

impl Handler for AgentApi {
    fn handle(&self, req: Request) -> Response {
        self.route(&req)
            .unwrap_or_else(|e| Response::error(503, &e.to_string(), None))
    }
}

#[derive(Serialize)]
struct Health {
    status: &'static str,
}

#[derive(Serialize)]
struct Deleted<'a> {
    deleted: &'a str,
}

fn check_name(name: &str) -> Result<(), Response> {
    spec::validate_name(name).map_err(|why| {
        Response::error(
            400,
            &format!("jail name {name:?}: {why}"),
            Some("metadata.name"),
        )
    })
}

fn not_found(name: &str) -> Response {
    Response::error(404, &format!("no jail named {name} on this node"), None)
}

fn method_not_allowed(allow: &str) -> Response {
    Response::error(405, &format!("method not allowed; use {allow}"), None)
        .with_header("Allow", allow)
}

/// Maps a reconciler error to its status code (DESIGN.md section 5).
pub fn error_response(e: &ReconcileError) -> Response {
    let message = e.to_string();
    match e {
        ReconcileError::Invalid { field, .. } => Response::error(400, &message, Some(field)),
        ReconcileError::Conflict { field, .. } => Response::error(409, &message, Some(field)),
        ReconcileError::AddressesExhausted(_) => {
            Response::error(409, &message, Some("spec.network.address"))
        }
        ReconcileError::NotFound(_) => Response::error(404, &message, None),
        ReconcileError::Store(_) | ReconcileError::Host { .. } => {
            Response::error(500, &message, None)
        }
    }
}
