//! The agent's route table (keel-agentd(8), API), the same for the Unix socket
//! and the optional TCP listener: jails and their workload's output
//! (`/jails/{name}/log`) and the document they were applied with
//! (`/jails/{name}/document`), what a `PUT /jails/{name}` of the same body
//! would do (`POST /jails/{name}/dry-run`, with the FreeBSD commands, and
//! `POST /jails/{name}/diff`, without; both change nothing: see the
//! reconciler's `dry_run`), events (`GET /events`: read from the ring the
//! reconciler records in, never through the worker, so a watch waits there),
//! volumes (`agentd::volumes`), ingresses, bases
//! (`agentd::bases`: `GET /bases`, `GET /bases/{release}`, and `PUT
//! /bases/{release}`, which starts a fetch and answers 202 at once, or 200
//! when the base is already there), the proxy's table, health and metrics.
//!
//! Handlers run on connection threads and own nothing: they parse and validate
//! the request, hand a command to the worker through [`WorkerHandle`], and turn
//! the answer into JSON. Spec bodies are YAML and are validated here, before the
//! worker ever sees them, so a bad document changes nothing.

use std::net::SocketAddrV4;
use std::sync::Arc;

use serde::Serialize;

use crate::agentd::bases::{BaseFetcher, Started};
use crate::agentd::cluster::watch::ClusterCounters;
use crate::agentd::ingress::controller::IngressApiError;
use crate::agentd::metrics::AgentMetrics;
use crate::agentd::proxy::Proxy;
use crate::agentd::reconciler::{HostError, ReconcileError};
use crate::agentd::usage::UsageBoard;
use crate::agentd::volumes::VolumeError;
use crate::agentd::worker::{WorkerGone, WorkerHandle};
use crate::common::http::{Handler, Request, Response};
use crate::common::metrics::{self, Render, Unavailable};
use crate::common::spec;
use crate::common::supervise::{self, HEALTH_WAIT};
use crate::common::wire::{
    AppliedDocument, COMMITTED_HEADER, EPOCH_HEADER, LOG_BYTES_MAX, VOLUMES_PARAM, VersionInfo,
    format_committed, last_lines, parse_tail_query, parse_volumes_query,
};
use crate::host::zfs::ZfsError;

/// The agent API.
pub struct AgentApi {
    worker: WorkerHandle,
    proxy: Option<Arc<Proxy>>,
    bases: Option<Arc<BaseFetcher>>,
    counters: Option<Arc<ClusterCounters>>,
    usage: UsageBoard,
}

/// One service the node's proxy serves, as `GET /proxy` shows it.
#[derive(Debug, Serialize)]
struct Served<'a> {
    name: &'a str,
    listen: SocketAddrV4,
    replicas: usize,
}

/// One replica as `GET /proxy/replicas` shows it.
#[derive(Debug, Serialize)]
struct ReplicaRow<'a> {
    service: &'a str,
    replica: SocketAddrV4,
    open: usize,
    listed: bool,
    ejected: bool,
}

impl AgentApi {
    /// Routes requests to `worker`.
    pub fn new(worker: WorkerHandle) -> AgentApi {
        AgentApi {
            worker,
            proxy: None,
            bases: None,
            counters: None,
            usage: UsageBoard::new(),
        }
    }

    /// Serves `/bases` from `bases` (the worker is never involved: a fetch
    /// runs on its own thread); without it those routes answer 503.
    pub fn with_bases(mut self, bases: Arc<BaseFetcher>) -> AgentApi {
        self.bases = Some(bases);
        self
    }

    /// `GET /bases`, `GET /bases/{release}`, `PUT /bases/{release}`.
    fn bases_route(&self, method: &str, release: Option<&str>) -> Response {
        let Some(bases) = &self.bases else {
            return Response::error(503, "this agent serves no base fetches", None);
        };
        if let Some(release) = release
            && let Err(why) = spec::validate_base(release)
        {
            return Response::error(400, &format!("release {release:?}: {why}"), None);
        }
        let failed = |e: &dyn std::fmt::Display| Response::error(500, &e.to_string(), None);
        match (method, release) {
            ("GET", None) => match bases.list() {
                Ok(list) => Response::json(200, &list),
                Err(e) => failed(&e),
            },
            ("GET", Some(release)) => match bases.get(release) {
                Ok(Some(status)) => Response::json(200, &status),
                Ok(None) => Response::error(
                    404,
                    &format!(
                        "no base {release} on this node; fetch it with `keelctl base fetch {release}`"
                    ),
                    None,
                ),
                Err(e) => failed(&e),
            },
            ("PUT", Some(release)) => match bases.start(release) {
                Ok(Started::Present(status)) => Response::json(200, &status),
                Ok(Started::Running(status)) => Response::json(202, &status),
                Err(e) => failed(&e),
            },
            (_, None) => method_not_allowed("GET"),
            (_, Some(_)) => method_not_allowed("GET, PUT"),
        }
    }

    /// Answers `GET /proxy` from `proxy` (a clustered node's service proxy);
    /// without one the list is empty.
    pub fn with_proxy(mut self, proxy: Arc<Proxy>) -> AgentApi {
        self.proxy = Some(proxy);
        self
    }

    /// Adds the cluster thread's counters (heartbeats sent, endpoint tables
    /// applied by each path) to `GET /metrics`.
    pub fn with_cluster_counters(mut self, counters: Arc<ClusterCounters>) -> AgentApi {
        self.counters = Some(counters);
        self
    }

    /// Exports each jail's usage from `usage`, the usage sampler's board.
    pub fn with_usage(mut self, usage: UsageBoard) -> AgentApi {
        self.usage = usage;
        self
    }

    /// What both `/metrics` routes render: the worker's snapshots, the usage
    /// sampler's last sample and, on a clustered node, the proxy's and the
    /// cluster thread's counters (read from atomics, never through the
    /// worker).
    pub fn metrics(&self) -> AgentMetrics {
        AgentMetrics::new(self.worker.clone(), self.proxy.as_ref().map(|p| p.stats()))
            .with_cluster(self.counters.clone())
            .with_usage(self.usage.clone())
    }

    /// What the proxy serves now: the services it listens for, where, and
    /// with how many replicas. It keeps the last table while the control
    /// plane is unreachable, so this shows what clients get meanwhile.
    fn proxy_table(&self) -> Response {
        let served = self
            .proxy
            .as_ref()
            .map(|p| p.services())
            .unwrap_or_default();
        let table: Vec<Served> = served
            .iter()
            .map(|(name, listen, replicas)| Served {
                name,
                listen: *listen,
                replicas: *replicas,
            })
            .collect();
        Response::json(200, &table)
    }

    /// Per replica of every served service: open connections, whether the
    /// table still lists it (a dropped one is shown until it drained) and
    /// whether passive health ejected it. Kept apart from `GET /proxy`, which
    /// shows the table alone and so stays the same while traffic flows.
    fn proxy_replicas(&self) -> Response {
        let loads = self.proxy.as_ref().map(|p| p.loads()).unwrap_or_default();
        let rows: Vec<ReplicaRow> = loads
            .iter()
            .flat_map(|(service, replicas)| {
                replicas.iter().map(move |r| ReplicaRow {
                    service,
                    replica: r.addr,
                    open: r.open,
                    listed: r.listed,
                    ejected: r.ejected,
                })
            })
            .collect();
        Response::json(200, &rows)
    }

    /// `GET /jails/{name}/log?tail=N`: the last N lines of what the
    /// workload printed (from at most the last [`LOG_BYTES_MAX`] bytes), as
    /// text.
    fn workload_log(&self, name: &str, req: &Request) -> Result<Response, WorkerGone> {
        let lines = match parse_tail_query(req.query.as_deref()) {
            Ok(n) => n,
            Err(why) => return Ok(Response::error(400, &why, Some("tail"))),
        };
        Ok(match self.worker.log(name, LOG_BYTES_MAX)? {
            None => not_found(name),
            Some(Err(e)) => Response::error(500, &e, None),
            Some(Ok(bytes)) => Response::text(
                200,
                String::from_utf8_lossy(last_lines(&bytes, lines)).into_owned(),
            ),
        })
    }

    fn route(&self, req: &Request) -> Result<Response, WorkerGone> {
        let segments = req.segments();
        let method = req.method.as_str();
        Ok(match (method, segments.as_slice()) {
            ("GET", ["healthz"]) => {
                supervise::healthz_response(self.worker.health(HEALTH_WAIT), "keel-agentd")
            }
            ("GET", ["metrics"]) => match self.metrics().render() {
                Err(Unavailable::Gone(_)) => return Err(WorkerGone),
                rendered => metrics::answer(rendered),
            },
            ("GET", ["version"]) => Response::json(200, &VersionInfo::of("keel-agentd")),
            ("GET", ["jails"]) => Response::json(200, &self.worker.list()?),
            // From the ring, never the worker: a watch waits there.
            ("GET", ["events"]) => self.worker.events().respond(req.query.as_deref()),
            ("GET", ["proxy"]) => self.proxy_table(),
            ("GET", ["proxy", "replicas"]) => self.proxy_replicas(),
            ("GET", ["jails", name, "log"]) => match check_name(name) {
                Err(r) => r,
                Ok(()) => self.workload_log(name, req)?,
            },
            ("GET", ["jails", name, "document"]) => match check_name(name) {
                Err(r) => r,
                Ok(()) => match self.worker.document(name)? {
                    Some(document) => Response::json(200, &AppliedDocument { document }),
                    None => not_found(name),
                },
            },
            ("GET", ["jails", name]) => match check_name(name) {
                Err(r) => r,
                Ok(()) => match self.worker.get(name)? {
                    Some(status) => Response::json(200, &status),
                    None => not_found(name),
                },
            },
            ("POST", ["jails", name, verb @ ("dry-run" | "diff")]) => match check_name(name) {
                Err(r) => r,
                Ok(()) => self.dry_run_jail(name, req, *verb == "diff")?,
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
            ("GET", ["volumes"]) => match self.worker.volumes()? {
                Ok(list) => Response::json(200, &list),
                Err(e) => volume_error(&e),
            },
            ("GET", ["volumes", name]) => match check_volume(name) {
                Err(r) => r,
                Ok(()) => match self.worker.volume(name)? {
                    Ok(v) => Response::json(200, &v),
                    Err(e) => volume_error(&e),
                },
            },
            ("DELETE", ["volumes", name]) => match check_volume(name) {
                Err(r) => r,
                Ok(()) => match self.worker.delete_volume(name)? {
                    Ok(()) => Response::json(200, &Deleted { deleted: name }),
                    Err(e) => volume_error(&e),
                },
            },
            (_, ["bases"]) => self.bases_route(method, None),
            (_, ["bases", release]) => self.bases_route(method, Some(release)),
            ("GET", ["ingresses"]) => Response::json(200, &self.worker.ingresses()?),
            ("GET", ["ingresses", name]) => match check_ingress(name) {
                Err(r) => r,
                Ok(()) => match self.worker.ingress(name)? {
                    Some(status) => Response::json(200, &status),
                    None => ingress_not_found(name),
                },
            },
            ("GET", ["ingresses", name, "document"]) => match check_ingress(name) {
                Err(r) => r,
                Ok(()) => match self.worker.ingress_document(name)? {
                    Some(document) => Response::json(200, &AppliedDocument { document }),
                    None => ingress_not_found(name),
                },
            },
            ("PUT", ["ingresses", name]) => match check_ingress(name) {
                Err(r) => r,
                Ok(()) => self.put_ingress(name, req)?,
            },
            ("DELETE", ["ingresses", name]) => match check_ingress(name) {
                Err(r) => r,
                Ok(()) => match self.worker.delete_ingress(name)? {
                    Ok(true) => Response::json(200, &Deleted { deleted: name }),
                    Ok(false) => ingress_not_found(name),
                    Err(e) => Response::error(500, &e.to_string(), None),
                },
            },
            (_, ["healthz"])
            | (_, ["metrics"])
            | (_, ["version"])
            | (_, ["jails"])
            | (_, ["events"])
            | (_, ["volumes"])
            | (_, ["ingresses"])
            | (_, ["proxy"])
            | (_, ["proxy", "replicas"]) => method_not_allowed("GET"),
            (_, ["ingresses", _]) => method_not_allowed("GET, PUT, DELETE"),
            (_, ["volumes", _]) => method_not_allowed("GET, DELETE"),
            (_, ["jails", _]) => method_not_allowed("GET, PUT, DELETE"),
            (_, ["jails", _, "dry-run" | "diff"]) => method_not_allowed("POST"),
            _ => Response::error(404, &format!("no route for {method} {}", req.path), None),
        })
    }

    fn put_ingress(&self, name: &str, req: &Request) -> Result<Response, WorkerGone> {
        let Ok(text) = std::str::from_utf8(&req.body) else {
            return Ok(Response::error(
                400,
                "the body must be a UTF-8 YAML Ingress spec",
                None,
            ));
        };
        let ingress = match spec::parse_ingress(text) {
            Ok(i) => i,
            Err(e) => return Ok(Response::error(400, &e.to_string(), Some(&e.field))),
        };
        if ingress.metadata.name != name {
            return Ok(Response::error(
                400,
                &format!(
                    "metadata.name is {} but the request is for /ingresses/{name}",
                    ingress.metadata.name
                ),
                Some("metadata.name"),
            ));
        }
        Ok(match self.worker.put_ingress(ingress)? {
            Ok(Some(status)) => Response::json(200, &status),
            Ok(None) => Response::error(
                503,
                "this agent runs no ingress controller (see the [ingress] section of keel.toml)",
                None,
            ),
            Err(e @ IngressApiError::HostTaken { .. }) => {
                Response::error(409, &e.to_string(), Some("spec.host"))
            }
            Err(e) => Response::error(500, &e.to_string(), None),
        })
    }

    /// The jail and epoch of a `PUT /jails/{name}` (or of its dry run),
    /// validated; a 400 naming the field otherwise.
    fn jail_request(name: &str, req: &Request) -> Result<(spec::Jail, Option<u64>), Response> {
        let Ok(text) = std::str::from_utf8(&req.body) else {
            return Err(Response::error(
                400,
                "the body must be a UTF-8 YAML Jail spec",
                None,
            ));
        };
        let jail = jail_for(name, text)?;
        let epoch_given = req.header(EPOCH_HEADER).is_some();
        check_declared_volumes(&jail, req.query.as_deref(), epoch_given)?;
        let epoch = match req.header(EPOCH_HEADER).map(str::parse::<u64>) {
            None => None,
            Some(Ok(e)) => Some(e),
            Some(Err(_)) => {
                return Err(Response::error(
                    400,
                    &format!("{EPOCH_HEADER} must be an unsigned integer"),
                    Some(EPOCH_HEADER),
                ));
            }
        };
        Ok((jail, epoch))
    }

    /// `POST /jails/{name}/dry-run` and `POST /jails/{name}/diff`: what the
    /// same body would do as a `PUT /jails/{name}`, changing nothing.
    fn dry_run_jail(
        &self,
        name: &str,
        req: &Request,
        diff_only: bool,
    ) -> Result<Response, WorkerGone> {
        let (jail, epoch) = match Self::jail_request(name, req) {
            Ok(parsed) => parsed,
            Err(response) => return Ok(response),
        };
        Ok(match self.worker.dry_run(jail, epoch, diff_only)? {
            Ok(report) => Response::json(200, &report),
            Err(e) => error_response(&e),
        })
    }

    fn put_jail(&self, name: &str, req: &Request) -> Result<Response, WorkerGone> {
        let (jail, epoch) = match Self::jail_request(name, req) {
            Ok(parsed) => parsed,
            Err(response) => return Ok(response),
        };
        Ok(match self.worker.apply(jail, epoch)? {
            // Only the control plane (which sends an epoch) ranks nodes by
            // it; a local apply skips the extra pass over every jail.
            Ok(status) if epoch.is_some() => {
                let committed =
                    crate::agentd::cluster::heartbeat::heartbeat_request(&self.worker.list()?)
                        .committed;
                Response::json(200, &status)
                    .with_header(COMMITTED_HEADER, &format_committed(&committed))
            }
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
    // Every error at once, for a client that did not validate first; the
    // first one's field is the answer's `field`.
    let bad = |errors: Vec<spec::SpecError>| {
        let message: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        let field = errors.first().map(|e| e.field.as_str());
        Response::error(400, &message.join("; "), field)
    };
    let mut docs = spec::check_documents(text).map_err(bad)?;
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
            let index = crate::common::names::replica_of(name)
                .filter(|(of, _)| of == svc)
                .map(|(_, i)| i);
            // Any index: the control plane decides how many replicas run
            // (a scale changes the count, not the document it forwards, and
            // a rolling update's surge replicas sit above it).
            match index {
                Some(_) => Ok(service.spec.template.to_jail_spec(name)),
                _ => Err(Response::error(
                    400,
                    &format!(
                        "{name} is not a replica of service {svc} (replicas are {svc}-0, {svc}-1, ...)"
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

/// The control plane learns a jail's volumes from the signed
/// `?volumes=` query keelctl adds (`common::wire::VOLUMES_PARAM`), and pins
/// the jail to the node holding them. The agent, which parsed the spec,
/// confirms that list: one that differs from the declared volumes is refused
/// (400) before anything is recorded, and so is a placement by the control
/// plane (it sends an epoch) that states none while the spec declares some,
/// so the control plane's volume registry never misses a volume this node
/// creates. Local applies over the Unix socket need not state them.
fn check_declared_volumes(
    jail: &spec::Jail,
    query: Option<&str>,
    placed: bool,
) -> Result<(), Response> {
    let bad = |m: String| Response::error(400, &m, Some("spec.volumes"));
    let stated = parse_volumes_query(query).map_err(bad)?;
    let mut declared: Vec<String> = jail.spec.volumes.iter().map(|v| v.name.clone()).collect();
    declared.sort();
    match stated {
        Some(stated) if stated != declared => Err(bad(format!(
            "the request states volumes [{}] but the spec declares [{}]; send the volumes the spec declares in ?{VOLUMES_PARAM}=",
            stated.join(", "),
            declared.join(", ")
        ))),
        None if placed && !declared.is_empty() => Err(bad(format!(
            "the spec declares volumes [{}] but the control plane was not told (no ?{VOLUMES_PARAM}= in the request); use a keelctl of this version",
            declared.join(", ")
        ))),
        _ => Ok(()),
    }
}

impl Handler for AgentApi {
    fn handle(&self, req: Request) -> Response {
        self.route(&req)
            .unwrap_or_else(|e| Response::error(503, &e.to_string(), None))
    }
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

fn check_ingress(name: &str) -> Result<(), Response> {
    spec::validate_name(name)
        .map_err(|why| Response::error(400, &format!("ingress name {name:?}: {why}"), None))
}

fn ingress_not_found(name: &str) -> Response {
    Response::error(404, &format!("no ingress named {name} on this node"), None)
}

fn check_volume(name: &str) -> Result<(), Response> {
    spec::validate_name(name)
        .map_err(|why| Response::error(400, &format!("volume name {name:?}: {why}"), None))
}

fn volume_error(e: &VolumeError) -> Response {
    Response::error(e.status(), &e.to_string(), None)
}

fn not_found(name: &str) -> Response {
    Response::error(404, &format!("no jail named {name} on this node"), None)
}

fn method_not_allowed(allow: &str) -> Response {
    Response::error(405, &format!("method not allowed; use {allow}"), None)
        .with_header("Allow", allow)
}

/// Maps a reconciler error to its status code (400 invalid, 404 unknown, 409
/// conflict, 500 host command failed).
pub fn error_response(e: &ReconcileError) -> Response {
    let message = e.to_string();
    match e {
        ReconcileError::Invalid { field, .. } => Response::error(400, &message, Some(field)),
        ReconcileError::BaseMissing { .. } => Response::error(400, &message, Some("spec.base")),
        ReconcileError::Conflict { field, .. } => Response::error(409, &message, Some(field)),
        ReconcileError::AddressesExhausted(_) => {
            Response::error(409, &message, Some("spec.network.address"))
        }
        ReconcileError::NotFound(_) => Response::error(404, &message, None),
        // Raced past the check in `apply` (the volume grew meanwhile).
        ReconcileError::Host {
            error: HostError::Zfs(ZfsError::QuotaBelowUsed { .. }),
            ..
        } => Response::error(409, &message, Some("spec.volumes")),
        ReconcileError::Store(_) | ReconcileError::Host { .. } => {
            Response::error(500, &message, None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agentd::bases::FetchSettings;
    use crate::agentd::fixtures::fake_reconciler;
    use crate::agentd::worker;
    use crate::common::http::Peer;
    use crate::host::base::FakeBases;
    use crate::host::fake::{CallLog, Faults};
    use crate::host::net::FakeNet;

    fn request(method: &str, path: &str) -> Request {
        Request::for_test(method, path, b"", Peer::Unix)
    }

    fn body(r: &Response) -> String {
        String::from_utf8_lossy(&r.body).into_owned()
    }

    #[test]
    fn base_routes_check_the_release_and_never_ask_the_worker() {
        let dir = tempfile::tempdir().expect("tempdir");
        let net = FakeNet::new(CallLog::new(), Faults::default());
        let (worker, thread) = worker::spawn(fake_reconciler(dir.path(), net)).expect("worker");
        let log = CallLog::new();
        let fetcher = BaseFetcher::new(
            Arc::new(FakeBases::new(log.clone(), Faults::default())),
            FetchSettings {
                mirrors: vec![format!("file://{}", dir.path().join("none").display())],
                cache_dir: dir.path().join("cache"),
            },
        );
        let api = AgentApi::new(worker.clone()).with_bases(Arc::new(fetcher));
        // With the worker gone, the base routes still answer: they never wait for it.
        worker.shutdown();
        thread.join().expect("worker ends");

        let bad = api.handle(request("PUT", "/bases/-rf"));
        assert_eq!(bad.status, 400, "{}", body(&bad));
        assert!(log.entries().is_empty(), "nothing ran: {:?}", log.entries());
        let missing = api.handle(request("GET", "/bases/14.5-RELEASE"));
        assert_eq!(missing.status, 404);
        assert!(
            body(&missing).contains("keelctl base fetch 14.5-RELEASE"),
            "{}",
            body(&missing)
        );
        assert_eq!(api.handle(request("GET", "/bases")).status, 200);
        assert_eq!(
            api.handle(request("PUT", "/bases/14.5-RELEASE")).status,
            202
        );
        assert_eq!(
            api.handle(request("DELETE", "/bases/14.5-RELEASE")).status,
            405
        );
        let without = AgentApi::new(worker).handle(request("GET", "/bases"));
        assert_eq!(without.status, 503);
    }

    #[test]
    fn events_are_served_from_the_ring_even_with_the_worker_gone_and_bad_queries_name_the_parameter()
     {
        let dir = tempfile::tempdir().expect("tempdir");
        let net = FakeNet::new(CallLog::new(), Faults::default());
        let mut reconciler = fake_reconciler(dir.path(), net);
        let events = crate::common::events::EventLog::in_memory("n1");
        reconciler.set_events(events.clone());
        let (worker, thread) = worker::spawn(reconciler).expect("worker");
        let api = AgentApi::new(worker.clone());
        worker.shutdown();
        thread.join().expect("worker ends");
        events.normal(
            crate::common::wire::ObjectKind::Jail,
            "web",
            "Started",
            String::new(),
        );

        let mut get = request("GET", "/events");
        get.query = Some("after=0&for=jail/web".into());
        let answer = api.handle(get);
        assert_eq!(answer.status, 200, "{}", body(&answer));
        let listed: crate::common::wire::EventsAnswer =
            serde_json::from_str(&body(&answer)).expect("an events answer");
        assert_eq!(
            (
                listed.events.len(),
                listed.last_seq,
                listed.events[0].node.as_str()
            ),
            (1, 1, "n1")
        );
        let mut bad = request("GET", "/events");
        bad.query = Some("after=soon".into());
        let refused = api.handle(bad);
        assert_eq!(refused.status, 400);
        assert!(
            body(&refused).contains("\"field\":\"after\""),
            "{}",
            body(&refused)
        );
        assert_eq!(api.handle(request("POST", "/events")).status, 405);
    }
}
