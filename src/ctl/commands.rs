//! Running one parsed keelctl command: read the spec, validate the whole of
//! it, then make the requests in order and print one line per result.
//!
//! The order is the contract: every document is parsed and validated, and
//! every kind checked, before the first request, so a bad file changes
//! nothing; requests then go one at a time and the first failure stops the
//! rest (what was already applied stays applied, and was printed).
//!
//! Services live only on the control plane: a file holding one, or a `get`
//! or `delete` of services, with requests going to an agent stops before
//! anything is sent. Ingresses are bound to a node: through the control
//! plane every ingress command, and every file holding an Ingress, needs
//! `--node`, refused before anything is sent otherwise. Jails, services and
//! ingresses of one file are applied in the file's order, each to its own
//! route.
//!
//! Through the control plane, `get jails` and `get ingresses` are assembled
//! here: the node list, then each Alive node's list, merged by name with the
//! node alongside. A node that is Dead or whose list could not be had is
//! never silently missing: what the others hold is printed, then the command
//! fails with [`CtlError::Incomplete`] naming each such node and why (exit
//! 1). `get volumes` does the same with the entries the control plane marks
//! unreachable.
//!
//! Bases belong to one node, like ingresses: `base fetch` and `get bases`
//! through the control plane need `--node`. `base fetch` asks the node to
//! start the fetch, then follows it with `GET /bases/{release}` (the node
//! answers at once; the download runs there on its own thread), printing
//! the progress on stderr whenever it changes, until the base is Ready (exit
//! 0) or the fetch failed (exit 1 with the node's reason).
//!
//! `apply --dry-run` and `diff` validate the whole file as an apply does,
//! then ask, object by object, what its apply would do (`Api::dry_run_jail`,
//! `Api::diff_service`) and print the answers; nothing is applied. `diff`
//! keeps kubectl's exit codes: [`CtlError::Differs`] (1) when an object
//! differs, and any failure of its own is [`CtlError::DiffFailed`] (2).
//!
//! `delete-volume` asks before anything is sent when stdin is a terminal
//! ([`Env::interactive`]) and `--yes` is not given; a script is never asked.
//! `logs -f` asks the log route again every `LOG_POLL` and prints only the
//! lines that are new (`LogFollower`), as the route does not stream.
//!
//! This file decides what happens and in which order; it never formats (that
//! is `output.rs`), never builds a request path (`api.rs`) and never chooses an
//! exit status (`CtlError::exit_code`).

use std::io::{self, Read, Write};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::auth::{self, KeyFilePolicy, Signer};
use crate::common::events::{EventQuery, ObjectRef};
use crate::common::http::Endpoint;
use crate::common::names::replica_of;
use crate::common::spec::{self, Document, Ingress, Jail, Service};
use crate::common::wire::{BaseState, Event, EventsAnswer, Liveness, ObjectKind, VolumeStatus};

use super::api::ApiError;
use super::api::{Api, Route};
use super::args::{
    Command, ConfigCommand, GlobalOptions, Input, Invocation, OutputFormat, Resource,
};
use super::completion;
use super::contexts::{Context, Contexts, ContextsError};
use super::describe;
use super::output::{NodeJail, OnNode};
use super::{CONTROLPLANE_ENV, CtlError, Env, Remote, Target, Unreached, output, target};

/// stdout as commands use it: a reader that went away (`| head`) silently
/// ends the output without ending the command (an apply half printed must
/// not become an apply half done), and any other write error is kept for
/// [`Out::finish`] to report once the command is over.
pub struct Out<'a> {
    inner: &'a mut dyn Write,
    closed: bool,
    error: Option<io::Error>,
}

impl<'a> Out<'a> {
    /// Wraps `inner` (normally the locked stdout).
    pub fn new(inner: &'a mut dyn Write) -> Out<'a> {
        Out {
            inner,
            closed: false,
            error: None,
        }
    }

    /// Writes `text` as it is.
    pub fn print(&mut self, text: &str) {
        if self.closed || self.error.is_some() {
            return;
        }
        if let Err(e) = self.inner.write_all(text.as_bytes()) {
            self.fail(e);
        }
    }

    /// Writes `text` and a newline.
    pub fn line(&mut self, text: &str) {
        self.print(&format!("{text}\n"));
    }

    /// Flushes now, for output that comes over time (`logs -f`); false once
    /// nothing more can be printed (the reader went away or a write failed,
    /// kept for [`Out::finish`]).
    pub fn flush(&mut self) -> bool {
        if !self.closed && self.error.is_none() {
            if let Err(e) = self.inner.flush() {
                self.fail(e);
            }
        }
        !self.closed && self.error.is_none()
    }

    /// Flushes; the first write error other than a closed pipe, if any.
    pub fn finish(mut self) -> Result<(), io::Error> {
        if !self.closed && self.error.is_none() {
            if let Err(e) = self.inner.flush() {
                self.fail(e);
            }
        }
        self.error.map_or(Ok(()), Err)
    }

    fn fail(&mut self, e: io::Error) {
        if e.kind() == io::ErrorKind::BrokenPipe {
            self.closed = true;
        } else {
            self.error = Some(e);
        }
    }
}

/// Runs `invocation`. Results go to `out`; notes that are not results (an
/// empty list) go to `stderr`.
pub fn execute(
    invocation: &Invocation,
    env: &Env,
    stdin: &mut dyn Read,
    out: &mut Out<'_>,
    stderr: &mut dyn Write,
) -> Result<(), CtlError> {
    let resolve = || connect(&target(&invocation.global, env)?);
    match &invocation.command {
        Command::Watch {
            resource,
            name,
            output: format,
        } => {
            // The listing as `get` prints it, then the changes.
            let listing = Invocation {
                global: invocation.global.clone(),
                command: Command::Get {
                    resource: *resource,
                    name: name.clone(),
                    output: *format,
                },
            };
            execute(&listing, env, stdin, out, stderr)?;
            let api = match resource {
                Resource::Services => controlplane_only(invocation, env, "`get services -w`")?,
                Resource::Nodes => controlplane_only(invocation, env, "`get nodes -w`")?,
                _ => resolve()?,
            };
            watch_objects(&api, *resource, name.as_deref(), *format, out, stderr)?;
        }
        Command::Describe { resource, name } => {
            let description = describe_one(invocation, env, *resource, name)?;
            let events = describe_events(invocation, env, *resource, name, stderr);
            out.print(&description.section("Events", events).render());
        }
        Command::Completion { shell } => out.print(&completion::script(*shell)),
        Command::Config(config) => run_config(config, &invocation.global, env, out, stderr)?,
        Command::Version { client_only } => {
            out.line(&format!("Client: keelctl {}", env!("CARGO_PKG_VERSION")));
            if !client_only {
                let api = resolve()?;
                let server = api.version().map_err(|error| CtlError::Request {
                    action: "version".into(),
                    error,
                })?;
                out.line(&output::server_version_line(&server, &api.endpoint()));
            }
        }
        Command::Validate { input } => {
            let (_, docs) = read_documents(input, stdin, false)?;
            out.line(&output::valid_line(docs.len()));
        }
        Command::KeyGenerate { id, path } => {
            let id = match id {
                Some(id) => id.clone(),
                None => default_key_id(path)?,
            };
            let failed = |error| CtlError::KeyGenerate {
                path: path.clone(),
                error,
            };
            let key = auth::generate_key(&id).map_err(failed)?;
            auth::write_key_file(path, &key).map_err(failed)?;
            out.line(&output::key_written_line(&id, path));
        }
        Command::DryRun {
            input,
            output: format,
        } => {
            plan(invocation, env, input, *format, false, stdin, out)?;
        }
        Command::Diff {
            input,
            output: format,
        } => {
            let (differing, of) = plan(invocation, env, input, *format, true, stdin, out)
                .map_err(|e| CtlError::DiffFailed(Box::new(e)))?;
            if differing > 0 {
                return Err(CtlError::Differs { differing, of });
            }
        }
        Command::Apply { input } => {
            let (source, objects) = read_objects(input, stdin)?;
            let target = target(&invocation.global, env)?;
            services_need_controlplane(&source, &objects, &target)?;
            ingresses_need_node(&source, &objects, &target)?;
            let api = connect(&target)?;
            for object in &objects {
                let failed = |error| CtlError::Request {
                    action: format!("apply {}", object.label()),
                    error,
                };
                match object {
                    Object::Jail(jail) => {
                        let placed = api.apply_jail(jail).map_err(failed)?;
                        out.line(&output::applied_line(
                            &placed.status,
                            placed.node.as_deref(),
                        ));
                    }
                    Object::Service(service) => {
                        let status = api.apply_service(service).map_err(failed)?;
                        out.line(&output::service_applied_line(&status));
                    }
                    Object::Ingress(ingress) => {
                        let status = api.apply_ingress(ingress).map_err(failed)?;
                        out.line(&output::ingress_applied_line(&status, named_node(&api)));
                    }
                }
            }
        }
        Command::Get {
            resource: Resource::Services,
            name,
            output: format,
        } => {
            let api = controlplane_only(invocation, env, "`get services`")?;
            match name {
                None => {
                    let services = api.list_services().map_err(|error| CtlError::Request {
                        action: "get services".into(),
                        error,
                    })?;
                    if *format == OutputFormat::Table && services.is_empty() {
                        let _ = writeln!(stderr, "No services found.");
                    } else {
                        show(out, *format, &services, || output::service_table(&services))?;
                    }
                }
                Some(name) => {
                    let service = api.get_service(name).map_err(|error| CtlError::Request {
                        action: format!("get service/{name}"),
                        error,
                    })?;
                    if *format == OutputFormat::Yaml {
                        let document = api.service_document(name);
                        return show_manifest(out, &format!("service/{name}"), document, &service);
                    }
                    if *format == OutputFormat::Table && service.replicas.is_empty() {
                        let _ = writeln!(
                            stderr,
                            "Service {} has no replicas placed ({}/{} ready).",
                            output::one_line(&service.name),
                            service.ready,
                            service.desired
                        );
                    } else {
                        show(out, *format, &service, || output::replica_table(&service))?;
                    }
                }
            }
        }
        Command::Get {
            resource: Resource::Nodes,
            name,
            output: format,
        } => {
            let api = resolve()?;
            if *api.route() == Route::Agent {
                return Err(CtlError::Usage(format!(
                    "`get nodes` lists a cluster's nodes: give --controlplane HOST:PORT (or set \
                     ${CONTROLPLANE_ENV} or ctl.controlplane)"
                )));
            }
            if let Some(name) = name {
                let node = api.get_node(name).map_err(|error| CtlError::Request {
                    action: format!("get node/{name}"),
                    error,
                })?;
                return show(out, *format, &node, || {
                    output::node_table(std::slice::from_ref(&node))
                });
            }
            let nodes = api.list_nodes().map_err(|error| CtlError::Request {
                action: "get nodes".into(),
                error,
            })?;
            if *format == OutputFormat::Table && nodes.is_empty() {
                let _ = writeln!(stderr, "No nodes found.");
            } else {
                show(out, *format, &nodes, || output::node_table(&nodes))?;
            }
        }
        Command::Get {
            resource: Resource::Jails,
            name: None,
            output: format,
        } => {
            let api = resolve()?;
            let wide = *format == OutputFormat::Wide;
            let failed = |error| CtlError::Request {
                action: "get jails".into(),
                error,
            };
            if *api.route() == Route::Agent {
                let jails = api.list_jails().map_err(failed)?;
                if matches!(format, OutputFormat::Table | OutputFormat::Wide) && jails.is_empty() {
                    // kubectl's convention: the note on stderr, stdout empty.
                    let _ = writeln!(stderr, "No jails found.");
                } else {
                    show(out, *format, &jails, || {
                        output::jail_table(&jails, now_unix(), wide)
                    })?;
                }
            } else {
                let jails = per_node(&api, "jails", Api::list_jails_on)?;
                show_gathered(out, stderr, *format, jails, |listed| {
                    output::cluster_jail_table(listed, now_unix(), wide)
                })?;
            }
        }
        Command::Get {
            resource: Resource::Jails,
            name: Some(name),
            output: format,
        } => {
            let api = resolve()?;
            let wide = *format == OutputFormat::Wide;
            let found = api.get_jail(name).map_err(|error| CtlError::Request {
                action: format!("get jail/{name}"),
                error,
            })?;
            if *format == OutputFormat::Yaml {
                let document = api.jail_document(name);
                return show_manifest(out, &format!("jail/{name}"), document, &found.status);
            }
            if *api.route() == Route::Agent {
                show(out, *format, &found.status, || {
                    output::jail_table(std::slice::from_ref(&found.status), now_unix(), wide)
                })?;
            } else {
                let jail = NodeJail {
                    node: found.node,
                    status: found.status,
                };
                show(out, *format, &jail, || {
                    output::cluster_jail_table(std::slice::from_ref(&jail), now_unix(), wide)
                })?;
            }
        }
        Command::Get {
            resource: Resource::Volumes,
            name,
            output: format,
        } => {
            let api = resolve()?;
            let volumes = match name {
                None => api.list_volumes().map_err(|error| CtlError::Request {
                    action: "get volumes".into(),
                    error,
                })?,
                Some(name) => vec![api.get_volume(name).map_err(|error| CtlError::Request {
                    action: format!("get volume/{name}"),
                    error,
                })?],
            };
            if *format == OutputFormat::Table && volumes.is_empty() {
                let _ = writeln!(stderr, "No volumes found.");
            } else if name.is_some() {
                show(out, *format, &volumes[0], || output::volume_table(&volumes))?;
            } else {
                show(out, *format, &volumes, || output::volume_table(&volumes))?;
                // The control plane lists what its registry places on a node
                // it could not ask, marked unreachable: shown, but not whole.
                let unreached = unreached_volume_nodes(&volumes);
                if !unreached.is_empty() {
                    return Err(CtlError::Incomplete {
                        action: "get volumes".into(),
                        unreached,
                    });
                }
            }
        }
        Command::Get {
            resource: Resource::Ingresses,
            name,
            output: format,
        } => match name {
            None => {
                let api = resolve()?;
                if *api.route() == Route::Agent {
                    let list = api.list_ingresses().map_err(|error| CtlError::Request {
                        action: "get ingresses".into(),
                        error,
                    })?;
                    if *format == OutputFormat::Table && list.is_empty() {
                        let _ = writeln!(stderr, "No ingresses found.");
                    } else {
                        show(out, *format, &list, || output::ingress_table(&list))?;
                    }
                } else {
                    let list = per_node(&api, "ingresses", Api::list_ingresses_on)?;
                    show_gathered(out, stderr, *format, list, output::cluster_ingress_table)?;
                }
            }
            Some(name) => {
                let api = ingress_api(invocation, env, "`get ingress NAME`")?;
                let one = api.get_ingress(name).map_err(|error| CtlError::Request {
                    action: format!("get ingress/{name}"),
                    error,
                })?;
                if *format == OutputFormat::Yaml {
                    let document = api.ingress_document(name);
                    return show_manifest(out, &format!("ingress/{name}"), document, &one);
                }
                show(out, *format, &one, || {
                    output::ingress_table(std::slice::from_ref(&one))
                })?;
            }
        },
        Command::Get {
            resource: Resource::Bases,
            name,
            output: format,
        } => {
            let api = node_api(invocation, env, "`get bases`", BASES_ON_A_NODE)?;
            match name {
                None => {
                    let list = api.list_bases().map_err(|error| CtlError::Request {
                        action: "get bases".into(),
                        error,
                    })?;
                    if *format == OutputFormat::Table && list.is_empty() {
                        let _ = writeln!(stderr, "No bases found.");
                    } else {
                        show(out, *format, &list, || output::base_table(&list))?;
                    }
                }
                Some(release) => {
                    let one = api.get_base(release).map_err(|error| CtlError::Request {
                        action: format!("get base/{release}"),
                        error,
                    })?;
                    show(out, *format, &one, || {
                        output::base_table(std::slice::from_ref(&one))
                    })?;
                }
            }
        }
        Command::GetEvents {
            object,
            watch,
            output: format,
        } => {
            let api = resolve()?;
            get_events(&api, object.clone(), *watch, *format, out, stderr)?;
        }
        Command::BaseFetch { release } => {
            let api = node_api(invocation, env, "`base fetch`", BASES_ON_A_NODE)?;
            fetch_base(&api, release, out, stderr)?;
        }
        Command::DeleteIngresses { names } => {
            let api = ingress_api(invocation, env, "`delete ingress`")?;
            each_name(names, "delete ingress", stderr, |name| {
                delete_ingress(&api, name, out)
            })?;
        }
        Command::DeleteVolume { name, yes } => {
            let api = resolve()?;
            // A volume's data cannot come back: someone at a terminal is
            // asked first. A script (stdin not a terminal) is not, as before.
            if env.interactive
                && !yes
                && !confirmed(&output::delete_volume_prompt(name), stdin, stderr)
            {
                return Err(CtlError::NotConfirmed {
                    action: format!("delete-volume {name}"),
                });
            }
            api.delete_volume(name).map_err(|error| CtlError::Request {
                action: format!("delete volume/{name}"),
                error,
            })?;
            out.line(&output::volume_deleted_line(name));
        }
        Command::DeleteJails { names } => {
            let api = resolve()?;
            each_name(names, "delete jail", stderr, |name| delete(&api, name, out))?;
        }
        Command::Logs { name, tail, follow } => {
            let api = resolve()?;
            let fetch = || {
                api.workload_log(name, *tail)
                    .map_err(|error| CtlError::Request {
                        action: format!("logs jail/{name}"),
                        error,
                    })
            };
            if !follow {
                out.print(&String::from_utf8_lossy(&fetch()?));
                return Ok(());
            }
            // The log route answers the tail and returns; it does not
            // stream. Following is asking again and printing what is new,
            // until interrupted, the reader goes away or a request fails
            // (the jail was deleted).
            let mut follower = LogFollower::default();
            loop {
                for line in follower.new_lines(&fetch()?) {
                    out.print(&line);
                }
                if !out.flush() {
                    return Ok(());
                }
                std::thread::sleep(LOG_POLL);
            }
        }
        Command::Cordon { names, cordoned } => {
            let verb = if *cordoned { "cordon" } else { "uncordon" };
            let api = controlplane_only(invocation, env, &format!("`{verb}`"))?;
            each_name(names, verb, stderr, |id| {
                api.set_cordoned(id, *cordoned)
                    .map_err(|error| CtlError::Request {
                        action: format!("{verb} node/{id}"),
                        error,
                    })?;
                out.line(&output::cordoned_line(id, *cordoned));
                Ok(())
            })?;
        }
        Command::DeleteNodes { names } => {
            let api = controlplane_only(invocation, env, "`delete node`")?;
            each_name(names, "delete node", stderr, |id| {
                let removal = api.delete_node(id).map_err(|error| CtlError::Request {
                    action: format!("delete node/{id}"),
                    error,
                })?;
                out.line(&output::node_deleted_line(&removal));
                Ok(())
            })?;
        }
        Command::Scale { name, replicas } => {
            let api = controlplane_only(invocation, env, "`scale`")?;
            let status = api
                .scale_service(name, *replicas)
                .map_err(|error| CtlError::Request {
                    action: format!("scale service/{name}"),
                    error,
                })?;
            out.line(&output::service_scaled_line(&status));
        }
        Command::RolloutStatus { name, timeout } => {
            let api = controlplane_only(invocation, env, "`rollout status`")?;
            wait_for_rollout(&api, name, *timeout, out)?;
        }
        Command::RolloutHistory { name } => {
            let api = controlplane_only(invocation, env, "`rollout history`")?;
            let revisions = api
                .service_revisions(name)
                .map_err(|error| CtlError::Request {
                    action: format!("rollout history service/{name}"),
                    error,
                })?;
            out.line(&output::revision_table(&revisions));
        }
        Command::RolloutUndo { name, to } => {
            let api = controlplane_only(invocation, env, "`rollout undo`")?;
            let status = api
                .undo_service(name, *to)
                .map_err(|error| CtlError::Request {
                    action: format!("rollout undo service/{name}"),
                    error,
                })?;
            out.line(&output::rolled_back_line(&status));
        }
        Command::DeleteServices { names } => {
            let api = controlplane_only(invocation, env, "`delete service`")?;
            each_name(names, "delete service", stderr, |name| {
                delete_service(&api, name, out)
            })?;
        }
        Command::DeleteFile { input } => {
            let (source, objects) = read_objects(input, stdin)?;
            let target = target(&invocation.global, env)?;
            services_need_controlplane(&source, &objects, &target)?;
            ingresses_need_node(&source, &objects, &target)?;
            let api = connect(&target)?;
            // Reverse order: what was applied last (and may lean on what came
            // before it) goes first.
            for object in objects.iter().rev() {
                match object {
                    Object::Jail(jail) => delete(&api, &jail.metadata.name, out)?,
                    Object::Service(service) => delete_service(&api, &service.metadata.name, out)?,
                    Object::Ingress(ingress) => delete_ingress(&api, &ingress.metadata.name, out)?,
                }
            }
        }
    }
    Ok(())
}

/// The client for `target`; through a control plane this reads the operator
/// key, so a missing or unsafe key file stops the command before anything is
/// sent.
fn connect(target: &Target) -> Result<Api, CtlError> {
    match target {
        Target::Agent(socket) => Ok(Api::new(Endpoint::Unix(socket.clone()))),
        Target::ControlPlane(remote) => {
            let key = auth::load_key(&remote.key_file, KeyFilePolicy::for_current_process())
                .map_err(CtlError::Key)?;
            Ok(Api::controlplane(
                &remote.addr,
                Signer::new(key),
                remote.node.clone(),
            ))
        }
    }
}

/// The client of the control plane, for a command that means nothing to an
/// agent (`what` names it in the message).
fn controlplane_only(invocation: &Invocation, env: &Env, what: &str) -> Result<Api, CtlError> {
    match target(&invocation.global, env)? {
        Target::Agent(socket) => Err(CtlError::NeedsControlPlane {
            what: what.to_string(),
            socket,
        }),
        remote => connect(&remote),
    }
}

/// The client for a command on one Ingress (`what` names it): an agent's
/// own routes, or the control plane's `/nodes/{id}/ingresses` with `--node`.
/// Without `--node` the control plane has nowhere to send it: an Ingress
/// serves on one node's public address. (Listing them all is
/// [`cluster_ingresses`].)
fn ingress_api(invocation: &Invocation, env: &Env, what: &str) -> Result<Api, CtlError> {
    node_api(
        invocation,
        env,
        what,
        "an Ingress lives on one node (its public address, its Service's replicas there)",
    )
}

/// The client for a command on something that lives on one node (`what`
/// names the command, `why` says why it needs a node): the agent's own
/// routes, or the control plane's `/nodes/{id}/...` with `--node`, refused
/// without it before anything is sent.
fn node_api(invocation: &Invocation, env: &Env, what: &str, why: &str) -> Result<Api, CtlError> {
    let target = target(&invocation.global, env)?;
    if let Target::ControlPlane(Remote { node: None, .. }) = &target {
        return Err(CtlError::Usage(format!(
            "{what} through the control plane needs --node ID: {why}; nothing was sent"
        )));
    }
    connect(&target)
}

/// How often `rollout status` asks how the rollout is doing.
const ROLLOUT_POLL: Duration = Duration::from_millis(500);

/// `rollout status service NAME`: prints each change of the rollout's
/// progress until it completes (exit 0), stops or `timeout` passes (exit 1).
fn wait_for_rollout(
    api: &Api,
    name: &str,
    timeout: Duration,
    out: &mut Out<'_>,
) -> Result<(), CtlError> {
    let deadline = std::time::Instant::now() + timeout;
    let mut shown = String::new();
    loop {
        let status = api.get_service(name).map_err(|error| CtlError::Request {
            action: format!("rollout status service/{name}"),
            error,
        })?;
        match output::rollout_progress(&status) {
            output::RolloutProgress::Complete(line) => {
                out.line(&line);
                return Ok(());
            }
            output::RolloutProgress::Stopped(reason) => {
                return Err(CtlError::Rollout {
                    service: name.to_string(),
                    why: format!("stopped: {reason}"),
                });
            }
            output::RolloutProgress::Waiting(line) => {
                if line != shown {
                    out.line(&line);
                    shown = line;
                }
            }
        }
        if std::time::Instant::now() >= deadline {
            return Err(CtlError::Rollout {
                service: name.to_string(),
                why: format!(
                    "not complete after {}: {shown}",
                    crate::common::config::Interval(timeout)
                ),
            });
        }
        std::thread::sleep(ROLLOUT_POLL);
    }
}

/// Why base commands through the control plane need `--node`.
const BASES_ON_A_NODE: &str = "a base is a dataset on one node's pool";

/// How often `base fetch` asks how its fetch is doing.
const BASE_POLL: Duration = Duration::from_millis(500);

/// `base fetch RELEASE`: start (or join) the node's fetch and follow it.
fn fetch_base(
    api: &Api,
    release: &str,
    out: &mut Out<'_>,
    stderr: &mut dyn Write,
) -> Result<(), CtlError> {
    let action = format!("base fetch {release}");
    let failed = |error| CtlError::Request {
        action: action.clone(),
        error,
    };
    let (present, mut status) = api.fetch_base(release).map_err(failed)?;
    let node = named_node(api);
    if present {
        out.line(&output::base_fetched_line(release, node, true));
        return Ok(());
    }
    let mut shown = String::new();
    loop {
        match status.state {
            BaseState::Ready => {
                out.line(&output::base_fetched_line(release, node, false));
                return Ok(());
            }
            BaseState::Failed | BaseState::Partial => {
                return Err(CtlError::BaseFetch {
                    release: release.to_string(),
                    reason: status.error.unwrap_or_else(|| {
                        "the fetch stopped before the base was complete (the agent restarted?); \
                         run the same command again"
                            .into()
                    }),
                });
            }
            BaseState::Downloading | BaseState::Extracting => {
                let line = format!("{} {}", status.state, output::base_progress(&status));
                if line != shown {
                    let _ = writeln!(stderr, "base/{release}: {line}");
                    shown = line;
                }
            }
        }
        std::thread::sleep(BASE_POLL);
        status = api.get_base(release).map_err(failed)?;
    }
}

/// Refuses, before anything is sent, a file with an Ingress when requests
/// go to a control plane without `--node`: there is no scheduled ingress
/// route, the ingress and its backend replicas share a node the operator
/// names.
fn ingresses_need_node(source: &str, objects: &[Object], target: &Target) -> Result<(), CtlError> {
    if !matches!(target, Target::ControlPlane(Remote { node: None, .. })) {
        return Ok(());
    }
    match objects.iter().enumerate().find_map(|(i, o)| match o {
        Object::Ingress(ingress) => Some((i, ingress)),
        _ => None,
    }) {
        None => Ok(()),
        Some((i, ingress)) => Err(CtlError::Usage(format!(
            "{source}: document {} is kind: Ingress ({}), which lives on one node: through the \
             control plane give --node ID (the node running its Service's replicas); nothing was \
             sent",
            i + 1,
            ingress.metadata.name
        ))),
    }
}

/// The node `--node` named, for result lines.
fn named_node(api: &Api) -> Option<&str> {
    match api.route() {
        Route::Node(id) => Some(id),
        _ => None,
    }
}

/// Refuses, before anything is sent, a file with a Service when requests go
/// to an agent (which has no services), or with `--node` (the control plane
/// places replicas itself; a flag for jails and ingresses must not be
/// silently ignored).
fn services_need_controlplane(
    source: &str,
    objects: &[Object],
    target: &Target,
) -> Result<(), CtlError> {
    let Some((i, service)) = objects.iter().enumerate().find_map(|(i, o)| match o {
        Object::Service(s) => Some((i, s)),
        Object::Jail(_) | Object::Ingress(_) => None,
    }) else {
        return Ok(());
    };
    let what = format!(
        "{source}: document {} is kind: Service ({})",
        i + 1,
        service.metadata.name
    );
    match target {
        Target::Agent(socket) => Err(CtlError::NeedsControlPlane {
            what,
            socket: socket.clone(),
        }),
        Target::ControlPlane(remote) if remote.node.is_some() => Err(CtlError::Usage(format!(
            "{what}, whose replicas the control plane places: --node applies to jails and \
             ingresses only; apply services without it (from a file of their own when an \
             ingress in the same file needs --node)"
        ))),
        Target::ControlPlane(_) => Ok(()),
    }
}

/// A named object an agent lists.
trait Named {
    fn name(&self) -> &str;
}

impl Named for crate::common::wire::JailStatus {
    fn name(&self) -> &str {
        &self.name
    }
}

impl Named for crate::common::wire::IngressStatus {
    fn name(&self) -> &str {
        &self.name
    }
}

/// Asks `question` on stderr and reads one line of stdin: true only for `y`
/// or `yes` (any case). End of input, an unreadable stdin or anything else is
/// no.
fn confirmed(question: &str, stdin: &mut dyn Read, stderr: &mut dyn Write) -> bool {
    let _ = write!(stderr, "{question}");
    let _ = stderr.flush();
    // Byte by byte up to the newline: nothing past the answer is consumed,
    // and a line longer than any answer is no.
    let mut answer = Vec::new();
    let mut byte = [0u8];
    while answer.len() <= 8 {
        match stdin.read(&mut byte) {
            Ok(1) if byte[0] == b'\n' => break,
            Ok(1) => answer.push(byte[0]),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return false,
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes")
}

/// How often `logs -f` asks for the log again.
const LOG_POLL: Duration = Duration::from_millis(500);

/// `logs -f` over a route that answers the last lines: each answer is
/// compared with the previous one, and only the lines after their overlap
/// are new. Only whole lines count, so a line the workload is still writing
/// is printed once it ends. The overlap is the longest run of the previous
/// answer's last lines that starts the new one: a log that repeats the same
/// lines can hide new copies of them, more new lines between two polls than
/// the tail holds leave a gap, and a log that was started over (the jail was
/// applied again) is printed from its start.
#[derive(Debug, Default)]
struct LogFollower {
    /// The whole lines of the last answer.
    last: Vec<String>,
}

impl LogFollower {
    /// The whole lines of `body` (the log's tail, as the agent answered it)
    /// not printed yet, each with its newline; remembers `body` for the next.
    fn new_lines(&mut self, body: &[u8]) -> Vec<String> {
        let text = String::from_utf8_lossy(body);
        let lines: Vec<String> = text
            .split_inclusive('\n')
            .filter(|l| l.ends_with('\n'))
            .map(str::to_string)
            .collect();
        let most = self.last.len().min(lines.len());
        let overlap = (0..=most)
            .rev()
            .find(|&k| self.last[self.last.len() - k..] == lines[..k])
            .unwrap_or(0);
        let fresh = lines[overlap..].to_vec();
        self.last = lines;
        fresh
    }
}

/// What a listing over the nodes gathered: the objects of the nodes that
/// answered, sorted by name then node, and the nodes that could not.
struct Gathered<T> {
    what: &'static str,
    listed: Vec<OnNode<T>>,
    unreached: Vec<Unreached>,
}

/// One list per node, merged: `GET /nodes`, then `list_on` for each Alive
/// node (only the named one with `--node`). A node that is Dead, or whose
/// list the control plane could not get (a 5xx: it died between the two
/// requests, it timed out), is left out and named in
/// [`Gathered::unreached`] (`what` says what it lists). Failures of the
/// control plane itself stop the command.
fn per_node<T: Named>(
    api: &Api,
    what: &'static str,
    list_on: fn(&Api, &str) -> Result<Vec<T>, ApiError>,
) -> Result<Gathered<T>, CtlError> {
    let failed = |error| CtlError::Request {
        action: format!("get {what}"),
        error,
    };
    let nodes = api.list_nodes().map_err(failed)?;
    let nodes: Vec<_> = match api.route() {
        Route::Node(id) => {
            let Some(node) = nodes.into_iter().find(|n| &n.node_id == id) else {
                // Let the control plane say it (404 no node named ...).
                list_on(api, id).map_err(failed)?;
                return Ok(Gathered {
                    what,
                    listed: Vec::new(),
                    unreached: Vec::new(),
                });
            };
            vec![node]
        }
        _ => nodes,
    };
    let mut listed = Vec::new();
    let mut unreached = Vec::new();
    for node in nodes {
        let id = output::one_line(&node.node_id);
        if node.status == Liveness::Dead {
            let why = match node.last_seen_secs {
                Some(secs) => format!("is Dead (last heartbeat {secs}s ago)"),
                None => "is Dead (no heartbeat since the control plane started)".into(),
            };
            unreached.push(Unreached { node: id, why });
            continue;
        }
        match list_on(api, &node.node_id) {
            Ok(list) => listed.extend(list.into_iter().map(|status| OnNode {
                node: Some(node.node_id.clone()),
                status,
            })),
            Err(ApiError::Refused { status, body, .. }) if status >= 500 => {
                unreached.push(Unreached {
                    node: id,
                    why: format!(
                        "could not be listed (HTTP {status}: {})",
                        output::one_line(&body.error)
                    ),
                });
            }
            Err(error) => return Err(failed(error)),
        }
    }
    listed.sort_by(|a, b| (a.status.name(), &a.node).cmp(&(b.status.name(), &b.node)));
    Ok(Gathered {
        what,
        listed,
        unreached,
    })
}

/// Prints what `gathered` holds (the table built by `table`, or encoded),
/// then fails with [`CtlError::Incomplete`] when a node was left out. An
/// empty table says `No ... found.` on stderr only when nothing was left
/// out: otherwise it would claim there is nothing.
fn show_gathered<T: serde::Serialize>(
    out: &mut Out<'_>,
    stderr: &mut dyn Write,
    format: OutputFormat,
    gathered: Gathered<T>,
    table: impl FnOnce(&[OnNode<T>]) -> String,
) -> Result<(), CtlError> {
    let Gathered {
        what,
        listed,
        unreached,
    } = gathered;
    if matches!(format, OutputFormat::Table | OutputFormat::Wide) && listed.is_empty() {
        if unreached.is_empty() {
            let _ = writeln!(stderr, "No {what} found.");
        }
    } else {
        show(out, format, &listed, || table(&listed))?;
    }
    if unreached.is_empty() {
        Ok(())
    } else {
        Err(CtlError::Incomplete {
            action: format!("get {what}"),
            unreached,
        })
    }
}

/// The nodes of `volumes` (through the control plane) that could not be
/// asked, each once, with the control plane's reason.
fn unreached_volume_nodes(volumes: &[VolumeStatus]) -> Vec<Unreached> {
    let mut unreached: Vec<Unreached> = Vec::new();
    for v in volumes.iter().filter(|v| v.unreachable) {
        let node = output::one_line(v.node.as_deref().unwrap_or("?"));
        if unreached.iter().any(|u| u.node == node) {
            continue;
        }
        let why = format!(
            "could not be asked ({})",
            output::one_line(v.error.as_deref().unwrap_or("no reason given"))
        );
        unreached.push(Unreached { node, why });
    }
    unreached
}

/// `get events`: the events so far, then with `watch` each newer one as the
/// daemon's long poll answers it (the daemon waits, keelctl never sleeps)
/// until interrupted or stdout goes away. Through the control plane the
/// answer merges its events with every Alive node's; each event is printed
/// once (by its daemon and number), and with `--node` only that node's.
/// Nodes the control plane could not ask make the listing fail as
/// [`CtlError::Incomplete`]; a watch says so on stderr and goes on.
fn get_events(
    api: &Api,
    object: Option<ObjectRef>,
    watch: bool,
    format: OutputFormat,
    out: &mut Out<'_>,
    stderr: &mut dyn Write,
) -> Result<(), CtlError> {
    let failed = |error| CtlError::Request {
        action: "get events".into(),
        error,
    };
    let only_node = match api.route() {
        Route::Node(id) => Some(id.clone()),
        _ => None,
    };
    // The daemon answers only what is newer than the cursor the query
    // carries (its own number, and through the control plane each node's),
    // so nothing is printed twice and keelctl keeps no set of what it saw.
    let fresh = |answer: &EventsAnswer| -> Vec<Event> {
        answer
            .events
            .iter()
            .filter(|e| only_node.as_ref().is_none_or(|n| &e.node == n))
            .cloned()
            .collect()
    };
    let mut query = EventQuery {
        object,
        ..EventQuery::default()
    };
    let mut answer = api.events(&query).map_err(failed)?;
    let first = fresh(&answer);
    let unreached: Vec<Unreached> = answer
        .unreached
        .iter()
        .map(|u| Unreached {
            node: output::one_line(&u.node),
            why: format!("could not be asked ({})", output::one_line(&u.error)),
        })
        .collect();
    if !watch {
        if format == OutputFormat::Table && first.is_empty() {
            if unreached.is_empty() {
                let _ = writeln!(stderr, "No events found.");
            }
        } else {
            show(out, format, &first, || {
                output::event_table(&first, now_unix(), true)
            })?;
        }
        if unreached.is_empty() {
            return Ok(());
        }
        return Err(CtlError::Incomplete {
            action: "get events".into(),
            unreached,
        });
    }
    let mut header = true;
    let mut missing: Vec<String> = Vec::new();
    let mut batch = first;
    loop {
        let now_missing: Vec<String> = answer.unreached.iter().map(|u| u.node.clone()).collect();
        if now_missing != missing {
            for u in &answer.unreached {
                let _ = writeln!(
                    stderr,
                    "keelctl: the events of node {} are missing: {}",
                    output::one_line(&u.node),
                    output::one_line(&u.error)
                );
            }
            missing = now_missing;
        }
        if !batch.is_empty() {
            out.print(&watched_events(&batch, format, header)?);
            header = false;
        }
        if !out.flush() {
            return Ok(());
        }
        query.after = Some(answer.last_seq);
        // A node left out of this answer keeps its cursor.
        query.nodes.append(&mut answer.node_seqs);
        query.wait = true;
        answer = api.events(&query).map_err(failed)?;
        batch = fresh(&answer);
    }
}

/// `get jails|services|nodes -w` after the listing: the daemon's event long
/// poll says which objects changed (an event about a jail, a service or one
/// of its replicas, a node), and each is asked for again and printed as a
/// row of its table, or encoded; one that is gone prints `KIND/NAME
/// deleted`. The daemon does the waiting, keelctl never sleeps. Events are
/// the stream because every change of state the daemons make is one: a
/// start, an exit, a restart, a reschedule, a node's death.
fn watch_objects(
    api: &Api,
    resource: Resource,
    only: Option<&str>,
    format: OutputFormat,
    out: &mut Out<'_>,
    stderr: &mut dyn Write,
) -> Result<(), CtlError> {
    let failed = |error| CtlError::Request {
        action: "watch".into(),
        error,
    };
    // Start from now: the listing already showed the current state.
    let mut answer = api.events(&EventQuery::default()).map_err(failed)?;
    let mut query = EventQuery::default();
    loop {
        if !out.flush() {
            return Ok(());
        }
        query.after = Some(answer.last_seq);
        query.nodes.append(&mut answer.node_seqs);
        query.wait = true;
        answer = api.events(&query).map_err(failed)?;
        let mut changed = std::collections::BTreeSet::new();
        for event in &answer.events {
            let name = match (resource, event.kind) {
                (Resource::Jails, ObjectKind::Jail) => event.name.as_str(),
                (Resource::Services, ObjectKind::Service) => event.name.as_str(),
                (Resource::Services, ObjectKind::Jail) => match replica_of(&event.name) {
                    Some((service, _)) => service,
                    None => continue,
                },
                (Resource::Nodes, ObjectKind::Node) => event.name.as_str(),
                _ => continue,
            };
            if only.is_none_or(|o| o == name) {
                changed.insert(name.to_string());
            }
        }
        for name in changed {
            out.print(&watched_row(api, resource, &name, format, stderr)?);
        }
    }
}

/// One changed object as a watch prints it (see [`watch_objects`]).
fn watched_row(
    api: &Api,
    resource: Resource,
    name: &str,
    format: OutputFormat,
    stderr: &mut dyn Write,
) -> Result<String, CtlError> {
    let gone = |error: &ApiError| matches!(error, ApiError::Refused { status: 404, .. });
    let (kind, found) = match resource {
        Resource::Jails => (
            "jail",
            api.get_jail(name).map(|found| {
                if *api.route() == Route::Agent {
                    encoded_or(format, &found.status, || {
                        output::jail_table(
                            std::slice::from_ref(&found.status),
                            now_unix(),
                            format == OutputFormat::Wide,
                        )
                    })
                } else {
                    let jail = NodeJail {
                        node: found.node,
                        status: found.status,
                    };
                    encoded_or(format, &jail, || {
                        output::cluster_jail_table(
                            std::slice::from_ref(&jail),
                            now_unix(),
                            format == OutputFormat::Wide,
                        )
                    })
                }
            }),
        ),
        Resource::Services => (
            "service",
            api.get_service(name).map(|s| {
                encoded_or(format, &s, || {
                    output::service_table(std::slice::from_ref(&s))
                })
            }),
        ),
        Resource::Nodes => (
            "node",
            api.get_node(name)
                .map(|n| encoded_or(format, &n, || output::node_table(std::slice::from_ref(&n)))),
        ),
        _ => return Ok(String::new()),
    };
    match found {
        Ok(text) => text,
        Err(e) if gone(&e) => Ok(
            if matches!(format, OutputFormat::Table | OutputFormat::Wide) {
                format!("{kind}/{} deleted\n", output::one_line(name))
            } else {
                String::new()
            },
        ),
        // A failed look at one object is said and the watch goes on.
        Err(e) => {
            let _ = writeln!(stderr, "keelctl: get {kind}/{name} failed: {e}");
            Ok(String::new())
        }
    }
}

/// A table's rows without its header line, or `value` encoded.
fn encoded_or<T: serde::Serialize>(
    format: OutputFormat,
    value: &T,
    table: impl FnOnce() -> String,
) -> Result<String, CtlError> {
    match format {
        OutputFormat::Table | OutputFormat::Wide => {
            let text = table();
            Ok(text
                .split_once('\n')
                .map_or(String::new(), |(_, rows)| rows.to_string()))
        }
        _ => output::encode(format, value).map_err(|reason| CtlError::Encode {
            format: format.to_string(),
            reason,
        }),
    }
}

/// What a watch prints for a batch of new events: table rows (under the
/// headers for its first batch), or each event encoded on its own.
fn watched_events(
    events: &[Event],
    format: OutputFormat,
    header: bool,
) -> Result<String, CtlError> {
    if format == OutputFormat::Table {
        return Ok(output::event_table(events, now_unix(), header));
    }
    let mut text = String::new();
    for event in events {
        text.push_str(
            &output::encode(format, event).map_err(|reason| CtlError::Encode {
                format: format.to_string(),
                reason,
            })?,
        );
    }
    Ok(text)
}

/// `key generate PATH` without `--id`: the file's name without `.key`.
fn default_key_id(path: &Path) -> Result<String, CtlError> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let id = name.strip_suffix(".key").unwrap_or(name);
    if id.is_empty() {
        return Err(CtlError::Usage(format!(
            "cannot take a key id from {}; give --id ID",
            path.display()
        )));
    }
    Ok(id.to_string())
}

/// Runs `one` for every name in order, as kubectl does: a name that fails
/// is reported on stderr at once and the others still run; the command then
/// fails as a whole, naming what failed. With one name its own error is the
/// command's.
fn each_name(
    names: &[String],
    action: &str,
    stderr: &mut dyn Write,
    mut one: impl FnMut(&str) -> Result<(), CtlError>,
) -> Result<(), CtlError> {
    let mut failed = Vec::new();
    let mut last = None;
    for name in names {
        if let Err(e) = one(name) {
            if names.len() > 1 {
                super::report(stderr, &e);
            }
            failed.push(name.clone());
            last = Some(e);
        }
    }
    match last {
        None => Ok(()),
        Some(e) if names.len() == 1 => Err(e),
        Some(_) => Err(CtlError::SomeFailed {
            action: action.to_string(),
            failed,
            of: names.len(),
        }),
    }
}

fn delete(api: &Api, name: &str, out: &mut Out<'_>) -> Result<(), CtlError> {
    api.delete_jail(name).map_err(|error| CtlError::Request {
        action: format!("delete jail/{name}"),
        error,
    })?;
    out.line(&output::deleted_line(name));
    Ok(())
}

fn delete_ingress(api: &Api, name: &str, out: &mut Out<'_>) -> Result<(), CtlError> {
    api.delete_ingress(name)
        .map_err(|error| CtlError::Request {
            action: format!("delete ingress/{name}"),
            error,
        })?;
    out.line(&output::ingress_deleted_line(name));
    Ok(())
}

fn delete_service(api: &Api, name: &str, out: &mut Out<'_>) -> Result<(), CtlError> {
    api.delete_service(name)
        .map_err(|error| CtlError::Request {
            action: format!("delete service/{name}"),
            error,
        })?;
    out.line(&output::service_deleted_line(name));
    Ok(())
}

/// Prints `value` as a table (built lazily) or encoded.
fn show<T: serde::Serialize>(
    out: &mut Out<'_>,
    format: OutputFormat,
    value: &T,
    table: impl FnOnce() -> String,
) -> Result<(), CtlError> {
    let text = match format {
        OutputFormat::Table | OutputFormat::Wide => table(),
        _ => output::encode(format, value).map_err(|reason| CtlError::Encode {
            format: format.to_string(),
            reason,
        })?,
    };
    out.print(&text);
    Ok(())
}

/// `describe KIND NAME`: the object's status, and the document it was
/// applied with when the daemon keeps one (a daemon that cannot give it
/// leaves the Spec section out rather than failing the command).
fn describe_one(
    invocation: &Invocation,
    env: &Env,
    resource: Resource,
    name: &str,
) -> Result<describe::Description, CtlError> {
    let failed = |kind: &str| {
        let action = format!("describe {kind}/{name}");
        move |error| CtlError::Request { action, error }
    };
    let now = now_unix();
    Ok(match resource {
        Resource::Jails => {
            let api = connect(&target(&invocation.global, env)?)?;
            let found = api.get_jail(name).map_err(failed("jail"))?;
            let document = api.jail_document(name).ok();
            describe::jail(
                &found.status,
                found.node.as_deref(),
                document.as_deref(),
                now,
            )
        }
        Resource::Services => {
            let api = controlplane_only(invocation, env, "`describe service`")?;
            let status = api.get_service(name).map_err(failed("service"))?;
            let document = api.service_document(name).ok();
            describe::service(&status, document.as_deref())
        }
        Resource::Nodes => {
            let api = controlplane_only(invocation, env, "`describe node`")?;
            let node = api.get_node(name).map_err(failed("node"))?;
            let jails = (node.status == Liveness::Alive)
                .then(|| api.list_jails_on(name).ok())
                .flatten()
                .map(|jails| jails.into_iter().map(|j| j.name).collect::<Vec<_>>());
            describe::node(&node, jails.as_deref())
        }
        Resource::Volumes => {
            let api = connect(&target(&invocation.global, env)?)?;
            describe::volume(&api.get_volume(name).map_err(failed("volume"))?)
        }
        Resource::Ingresses => {
            let api = ingress_api(invocation, env, "`describe ingress NAME`")?;
            let status = api.get_ingress(name).map_err(failed("ingress"))?;
            let document = api.ingress_document(name).ok();
            describe::ingress(&status, named_node(&api), document.as_deref())
        }
        Resource::Bases => {
            return Err(CtlError::Usage(
                "bases are not described: `get bases RELEASE` shows everything known of one".into(),
            ));
        }
    })
}

/// The Events section of `describe`: the last [`DESCRIBE_EVENTS`] events
/// about the object (through the control plane, its own and every node's).
/// Events that cannot be had are said on stderr; the description stands.
fn describe_events(
    invocation: &Invocation,
    env: &Env,
    resource: Resource,
    name: &str,
    stderr: &mut dyn Write,
) -> String {
    let kind = match resource {
        Resource::Jails => ObjectKind::Jail,
        Resource::Services => ObjectKind::Service,
        Resource::Nodes => ObjectKind::Node,
        Resource::Volumes => ObjectKind::Volume,
        Resource::Ingresses => ObjectKind::Ingress,
        Resource::Bases => return String::new(),
    };
    let query = EventQuery {
        object: Some(ObjectRef {
            kind,
            name: name.to_string(),
        }),
        ..EventQuery::default()
    };
    let answer = target(&invocation.global, env)
        .and_then(|t| connect(&t))
        .and_then(|api| {
            api.events(&query).map_err(|error| CtlError::Request {
                action: "get events".into(),
                error,
            })
        });
    match answer {
        Ok(answer) => {
            let skip = answer.events.len().saturating_sub(DESCRIBE_EVENTS);
            output::event_table(&answer.events[skip..], now_unix(), true)
        }
        Err(e) => {
            let _ = writeln!(stderr, "keelctl: the events are missing: {e}");
            String::new()
        }
    }
}

/// How many events `describe` shows, the newest.
const DESCRIBE_EVENTS: usize = 10;

/// `config ...`: reads and replaces the contexts file; sends nothing.
fn run_config(
    command: &ConfigCommand,
    global: &GlobalOptions,
    env: &Env,
    out: &mut Out<'_>,
    stderr: &mut dyn Write,
) -> Result<(), CtlError> {
    let failed = CtlError::Contexts;
    let path = env
        .contexts_file
        .as_deref()
        .ok_or(CtlError::Contexts(ContextsError::NoHome))?;
    let mut file = Contexts::load(path).map_err(failed)?;
    match command {
        ConfigCommand::GetContexts => {
            if file.contexts.is_empty() {
                let _ = writeln!(stderr, "No contexts found in {}.", path.display());
            } else {
                out.print(&output::contexts_table(&file));
            }
        }
        ConfigCommand::CurrentContext => match &file.current {
            Some(name) => out.line(name),
            None => {
                return Err(failed(ContextsError::NoCurrent {
                    path: path.to_path_buf(),
                }));
            }
        },
        ConfigCommand::UseContext { name } => {
            file.get(path, name).map_err(failed)?;
            file.current = Some(name.clone());
            file.save(path).map_err(failed)?;
            out.line(&format!("Switched to context {name}."));
        }
        ConfigCommand::SetContext { name } => {
            let context = Context {
                controlplane: global.controlplane.clone(),
                key_file: global.key_file.clone(),
                socket: global.socket.clone(),
            };
            let replaced = file.contexts.insert(name.clone(), context).is_some();
            file.check().map_err(|message| {
                failed(ContextsError::Invalid {
                    path: path.to_path_buf(),
                    message,
                })
            })?;
            file.save(path).map_err(failed)?;
            let verb = if replaced { "modified" } else { "created" };
            out.line(&format!("Context {name} {verb} in {}.", path.display()));
        }
        ConfigCommand::DeleteContext { name } => {
            file.get(path, name).map_err(failed)?;
            file.contexts.remove(name);
            let was_current = file.current.as_deref() == Some(name.as_str());
            if was_current {
                file.current = None;
            }
            file.save(path).map_err(failed)?;
            out.line(&format!("Deleted context {name} from {}.", path.display()));
            if was_current {
                let _ = writeln!(
                    stderr,
                    "It was the current context: none is set now; choose one with `keelctl config use-context NAME`."
                );
            }
        }
    }
    Ok(())
}

/// Prints one object as `apply` takes it back: its document, then its
/// status (see [`output::manifest_yaml`]).
fn show_manifest(
    out: &mut Out<'_>,
    label: &str,
    document: Result<String, ApiError>,
    status: &impl serde::Serialize,
) -> Result<(), CtlError> {
    let document = document.map_err(|error| CtlError::Request {
        action: format!("get {label}"),
        error,
    })?;
    let text = output::manifest_yaml(&document, status).map_err(|reason| CtlError::Encode {
        format: OutputFormat::Yaml.to_string(),
        reason,
    })?;
    out.print(&text);
    Ok(())
}

fn now_unix() -> u64 {
    // A clock before 1970 shows every age as 0s rather than failing `get`.
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The whole input as text, and its name for messages.
fn read_input(input: &Input, stdin: &mut dyn Read) -> Result<(String, String), CtlError> {
    let (source, read) = match input {
        Input::Stdin => {
            let mut text = String::new();
            (
                "stdin".to_string(),
                stdin.read_to_string(&mut text).map(|_| text),
            )
        }
        Input::File(path) => (path.display().to_string(), std::fs::read_to_string(path)),
    };
    match read {
        Ok(text) => Ok((source, text)),
        Err(error) => Err(CtlError::Read { source, error }),
    }
}

/// Every document `input` holds, all validated before anything is sent:
/// a file's or stdin's, or with a directory (`-f DIR`, as kubectl takes
/// one) those of each `.yaml` and `.yml` file in it, in file-name order, an
/// error naming the file it is in. Subdirectories are not read.
fn read_documents(
    input: &Input,
    stdin: &mut dyn Read,
    would_send: bool,
) -> Result<(String, Vec<Document>), CtlError> {
    let dir = match input {
        Input::File(path) if path.is_dir() => path,
        _ => {
            let (source, text) = read_input(input, stdin)?;
            let docs = parse(&source, &text, would_send)?;
            return Ok((source, docs));
        }
    };
    let source = dir.display().to_string();
    let entries = std::fs::read_dir(dir).map_err(|error| CtlError::Read {
        source: source.clone(),
        error,
    })?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|error| CtlError::Read {
                source: source.clone(),
                error,
            })?
            .path();
        let yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
        if yaml && !path.is_dir() {
            files.push(path);
        }
    }
    files.sort();
    let mut docs = Vec::new();
    for file in files {
        let (file_source, text) = read_input(&Input::File(file), stdin)?;
        docs.extend(parse(&file_source, &text, would_send)?);
    }
    if docs.is_empty() {
        return Err(CtlError::Empty { source });
    }
    Ok((source, docs))
}

/// Every document of `text`, all validated; at least one.
fn parse(source: &str, text: &str, would_send: bool) -> Result<Vec<Document>, CtlError> {
    let docs = spec::check_documents(text).map_err(|errors| CtlError::Invalid {
        source: source.to_string(),
        errors,
        would_send,
    })?;
    if docs.is_empty() {
        return Err(CtlError::Empty {
            source: source.to_string(),
        });
    }
    Ok(docs)
}

/// A document keelctl sends.
enum Object {
    Jail(Jail),
    Service(Service),
    Ingress(Ingress),
}

impl Object {
    /// `jail/NAME`, `service/NAME` or `ingress/NAME`, as messages name it.
    fn label(&self) -> String {
        match self {
            Object::Jail(j) => format!("jail/{}", j.metadata.name),
            Object::Service(s) => format!("service/{}", s.metadata.name),
            Object::Ingress(i) => format!("ingress/{}", i.metadata.name),
        }
    }
}

/// `apply --dry-run` and (`diff_only`) `diff`: asks, for every object of the
/// file in order, what its apply would do, and prints the answers (text, or
/// one JSON list); nothing is applied. Every document is validated first,
/// as for an apply. Ingresses have neither (an Ingress only names a Service
/// to publish), and a Service through the control plane gets its object
/// diff: its replicas' host commands are per node. Returns how many objects
/// differ from what is held, and how many there are.
fn plan(
    invocation: &Invocation,
    env: &Env,
    input: &Input,
    format: OutputFormat,
    diff_only: bool,
    stdin: &mut dyn Read,
    out: &mut Out<'_>,
) -> Result<(usize, usize), CtlError> {
    let (source, objects) = read_objects(input, stdin)?;
    let target = target(&invocation.global, env)?;
    services_need_controlplane(&source, &objects, &target)?;
    if let Some(ingress) = objects.iter().find(|o| matches!(o, Object::Ingress(_))) {
        return Err(CtlError::Usage(format!(
            "{source}: {} is an Ingress, which has no diff or dry run (it names a Service to \
             publish); leave it out of the file; nothing was sent",
            ingress.label()
        )));
    }
    let api = connect(&target)?;
    let mut reports = Vec::new();
    for object in &objects {
        let verb = if diff_only { "diff" } else { "dry run of" };
        let failed = |error| CtlError::Request {
            action: format!("{verb} {}", object.label()),
            error,
        };
        let report = match object {
            Object::Jail(jail) => api.dry_run_jail(jail, diff_only).map_err(failed)?,
            Object::Service(service) => api.diff_service(service).map_err(failed)?,
            Object::Ingress(_) => continue,
        };
        if format == OutputFormat::Table {
            out.print(&output::plan_text(&report, !diff_only));
        }
        reports.push(report);
    }
    if format != OutputFormat::Table {
        show(out, format, &reports, String::new)?;
    }
    let differing = reports.iter().filter(|r| !r.changes.is_empty()).count();
    Ok((differing, reports.len()))
}

/// The documents of `input` in file order, once every one is valid; and the
/// input's name for messages.
fn read_objects(input: &Input, stdin: &mut dyn Read) -> Result<(String, Vec<Object>), CtlError> {
    let (source, docs) = read_documents(input, stdin, true)?;
    let objects = docs
        .into_iter()
        .map(|doc| match doc {
            Document::Jail(jail) => Object::Jail(jail),
            Document::Service(service) => Object::Service(service),
            Document::Ingress(ingress) => Object::Ingress(ingress),
        })
        .collect();
    Ok((source, objects))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &[&str]) -> Vec<String> {
        text.iter().map(|l| format!("{l}\n")).collect()
    }

    #[test]
    fn the_log_follower_prints_each_whole_line_once() {
        let mut f = LogFollower::default();
        assert_eq!(f.new_lines(b"a\nb\nhal"), lines(&["a", "b"]));
        // Nothing new: nothing printed, the unfinished line still held.
        assert_eq!(f.new_lines(b"a\nb\nhal"), lines(&[]));
        assert_eq!(f.new_lines(b"a\nb\nhalf\nc\n"), lines(&["half", "c"]));
        // The tail slid: the old first lines are gone from the answer.
        assert_eq!(f.new_lines(b"c\nd\ne\n"), lines(&["d", "e"]));
        // A repeated line after the overlap is new.
        assert_eq!(f.new_lines(b"d\ne\ne\n"), lines(&["e"]));
        // A log started over shares nothing: printed from its start.
        assert_eq!(f.new_lines(b"fresh\n"), lines(&["fresh"]));
        assert_eq!(f.new_lines(b""), lines(&[]));
        assert_eq!(f.new_lines(b"x\n"), lines(&["x"]));
    }
}
