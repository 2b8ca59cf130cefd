//! `keelctl`, the command-line client: apply, get, delete and validate jail
//! specs against one node's `keel-agentd` over its Unix socket, or against a
//! cluster through `keel-controlplane` over TCP with every request signed by
//! the operator key; apply, list and delete the cluster's services (control
//! plane only) and a node's ingresses (through the control plane, with
//! `--node`); list the cluster's nodes or show one; generate signing keys.
//!
//! - [`args`]: the flag and command tables, `--help`, parsing argv.
//! - [`commands`]: running one parsed command (read the spec, validate all of
//!   it, then talk to the agent).
//! - [`api`]: the jail, node and service routes as typed calls over
//!   [`crate::common::http::Client`].
//! - [`output`]: the table, ages and result lines, as pure functions.
//!
//! This module owns keelctl's behaviour towards the user: where requests go
//! ([`target`]), what is printed, and the exit status: 0 success, 1 a request
//! failed (daemon unreachable or it refused, a key file not written, a
//! listing through the control plane that left out a node it could not
//! reach, a `delete-volume` the user did not confirm), 2 usage, configuration or validation error. Errors are one line
//! `keelctl: ...` plus, when there is more to say, an indented detail line. A
//! closed stdout (`keelctl get jails | head -1`) is not an error.
//!
//! It must never import `host` or `agentd`: everything it exchanges with the
//! daemons is in [`crate::common::wire`], and specs are validated with
//! [`crate::common::spec`] before anything is sent.

pub mod api;
pub mod args;
pub mod commands;
pub mod completion;
pub mod contexts;
pub mod describe;
pub mod output;

use std::ffi::OsString;
use std::fmt;
use std::io::{self, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};

use crate::common::auth::AuthError;
use crate::common::config::{Config, ConfigError, DEFAULT_CONFIG_PATH};
use crate::common::spec::SpecError;

use self::api::ApiError;
use self::args::{GlobalOptions, Parsed};

/// Environment variable naming the agent's socket, below `--socket` and above
/// `keel.toml`.
pub const SOCKET_ENV: &str = "KEEL_SOCKET";

/// Environment variable naming the control plane (`HOST:PORT`), below
/// `--controlplane` and above `keel.toml`.
pub const CONTROLPLANE_ENV: &str = "KEEL_CONTROLPLANE";

/// Environment variable naming the operator key file, below `--key-file` and
/// above `ctl.key_file` of `keel.toml`.
pub const KEY_FILE_ENV: &str = "KEEL_KEY_FILE";

/// What keelctl reads from its environment, gathered once so commands and
/// tests do not reach for process globals.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Env {
    /// `$KEEL_SOCKET`; empty counts as unset.
    pub socket: Option<OsString>,
    /// `$KEEL_CONTROLPLANE`; empty counts as unset.
    pub controlplane: Option<OsString>,
    /// `$KEEL_KEY_FILE`; empty counts as unset.
    pub key_file: Option<OsString>,
    /// The contexts file ([`contexts::default_path`]); `None` when the
    /// environment names no home for it.
    pub contexts_file: Option<PathBuf>,
    /// Whether stdin is a terminal: someone who can answer a question
    /// (`delete-volume` asks one), rather than a script.
    pub interactive: bool,
}

impl Env {
    /// The process's environment.
    pub fn from_process() -> Env {
        Env {
            socket: std::env::var_os(SOCKET_ENV),
            controlplane: std::env::var_os(CONTROLPLANE_ENV),
            key_file: std::env::var_os(KEY_FILE_ENV),
            contexts_file: contexts::default_path(
                std::env::var_os("XDG_CONFIG_HOME")
                    .as_deref()
                    .map(Path::new),
                std::env::var_os("HOME").as_deref().map(Path::new),
            ),
            interactive: io::stdin().is_terminal(),
        }
    }
}

/// Where keelctl's requests go, resolved by [`target`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One node's keel-agentd over its Unix socket, unsigned (the socket's
    /// mode and group guard it).
    Agent(PathBuf),
    /// keel-controlplane over TCP, every request signed.
    ControlPlane(Remote),
}

/// A control plane and how to talk to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remote {
    /// `HOST:PORT`, or several separated by commas, checked.
    pub addr: String,
    /// The operator key file to sign with (read when a request is made).
    pub key_file: PathBuf,
    /// `--node`: the named route to this node instead of the scheduled one.
    pub node: Option<String>,
}

/// Why a keelctl command failed. Display is the one-line summary;
/// [`CtlError::detail`] is the optional second line.
#[derive(Debug)]
pub enum CtlError {
    /// The command line is wrong.
    Usage(String),
    /// `keel.toml` could not be loaded to find the socket, the control plane
    /// or the key file.
    Config(ConfigError),
    /// The operator key could not be loaded, so nothing was sent.
    Key(AuthError),
    /// The contexts file could not be read or written, or has no such
    /// context; nothing was sent or changed.
    Contexts(contexts::ContextsError),
    /// `key generate` could not create the key file.
    KeyGenerate {
        /// The file asked for.
        path: PathBuf,
        /// Why.
        error: AuthError,
    },
    /// The spec file (or stdin) could not be read.
    Read {
        /// The file as the user named it, or `stdin`.
        source: String,
        /// The operating system's reason.
        error: io::Error,
    },
    /// A document of the spec file is invalid.
    Invalid {
        /// The file as the user named it, or `stdin`.
        source: String,
        /// Every error of the file, in document order, each with its
        /// document, field and line; never empty.
        errors: Vec<SpecError>,
        /// Whether the command would have sent something (apply, delete),
        /// so the message can reassure that nothing was.
        would_send: bool,
    },
    /// The spec file holds no document.
    Empty {
        /// The file as the user named it, or `stdin`.
        source: String,
    },
    /// Services exist only on a control plane, but requests go to an agent;
    /// nothing was sent.
    NeedsControlPlane {
        /// What needed one: a command (`` `get services` ``) or a document.
        what: String,
        /// The agent's socket requests would have gone to.
        socket: PathBuf,
    },
    /// A request to the agent failed.
    Request {
        /// What was being done, e.g. `apply jail/web-1`.
        action: String,
        /// Why it failed.
        error: ApiError,
    },
    /// A listing that fans out over the nodes printed what it could, but
    /// some nodes could not be listed: exit 1 so scripts do not take the
    /// partial list for the whole.
    Incomplete {
        /// What was listed, e.g. `get jails`.
        action: String,
        /// Each node left out, and why.
        unreached: Vec<Unreached>,
    },
    /// The user did not answer yes to a question on the terminal; nothing
    /// was sent.
    NotConfirmed {
        /// What was not done, e.g. `delete-volume pgdata`.
        action: String,
    },
    /// A base fetch ran on the node and failed there.
    BaseFetch {
        /// The release.
        release: String,
        /// The node's reason.
        reason: String,
    },
    /// A command over several names: these failed (each reported already),
    /// the others were done.
    SomeFailed {
        /// The command, e.g. `delete jail`.
        action: String,
        /// The names that failed, in order.
        failed: Vec<String>,
        /// How many names were given.
        of: usize,
    },
    /// `rollout status`: the rollout stopped, or did not complete in time.
    Rollout {
        /// The service.
        service: String,
        /// What happened, with the reason the control plane gave.
        why: String,
    },
    /// An answer could not be encoded for printing.
    Encode {
        /// The format asked for.
        format: String,
        /// The encoder's reason.
        reason: String,
    },
    /// Writing to stdout failed (other than a closed pipe).
    Output(io::Error),
    /// `diff`: objects differ from what the daemon holds (printed already);
    /// exit 1, as kubectl diff.
    Differs {
        /// How many differ.
        differing: usize,
        /// How many the file holds.
        of: usize,
    },
    /// `diff` itself failed (a request, the file): exit 2 whatever the
    /// cause, as kubectl diff, so 1 always means "differs".
    DiffFailed(Box<CtlError>),
}

impl CtlError {
    /// The exit status: 2 for usage, configuration and spec problems (nothing
    /// was attempted), 1 when a request or the output failed.
    pub fn exit_code(&self) -> i32 {
        match self {
            CtlError::Usage(_)
            | CtlError::Config(_)
            | CtlError::Read { .. }
            | CtlError::Invalid { .. }
            | CtlError::Empty { .. }
            | CtlError::NeedsControlPlane { .. }
            | CtlError::Key(_)
            | CtlError::Contexts(_) => 2,
            CtlError::KeyGenerate {
                error: AuthError::InvalidKeyId { .. },
                ..
            } => 2,
            CtlError::Request { .. }
            | CtlError::Incomplete { .. }
            | CtlError::BaseFetch { .. }
            | CtlError::Rollout { .. }
            | CtlError::NotConfirmed { .. }
            | CtlError::SomeFailed { .. }
            | CtlError::KeyGenerate { .. }
            | CtlError::Encode { .. }
            | CtlError::Output(_)
            | CtlError::Differs { .. } => 1,
            CtlError::DiffFailed(_) => 2,
        }
    }

    /// The indented second line, when there is more to say than the summary.
    pub fn detail(&self) -> Option<String> {
        match self {
            CtlError::Usage(_) => Some("try 'keelctl --help'".into()),
            CtlError::Config(_) => Some(format!(
                "--socket PATH or ${SOCKET_ENV} (an agent), or --controlplane HOST:PORT with \
                 --key-file PATH (a cluster) avoid reading keel.toml"
            )),
            CtlError::Key(_) => Some(format!(
                "keelctl signs control-plane requests with --key-file PATH, else \
                 ${KEY_FILE_ENV}, else ctl.key_file of keel.toml; nothing was sent"
            )),
            CtlError::Invalid {
                errors, would_send, ..
            } => {
                // The first error is on the summary line; the others follow,
                // one per line, so a whole file is fixed in one round.
                let mut lines: Vec<String> = errors.iter().skip(1).map(|e| e.to_string()).collect();
                if *would_send {
                    lines.push("nothing was sent".into());
                }
                (!lines.is_empty()).then(|| lines.join("\n  "))
            }
            CtlError::NeedsControlPlane { .. } => Some(format!(
                "give --controlplane HOST:PORT (or set ${CONTROLPLANE_ENV} or ctl.controlplane); \
                 nothing was sent"
            )),
            CtlError::Request { error, .. } => error.detail(),
            CtlError::DiffFailed(e) => e.detail(),
            CtlError::NotConfirmed { .. } => {
                Some("answer y to go ahead, or give --yes to skip the question".into())
            }
            CtlError::Rollout { service, .. } => Some(format!(
                "`keelctl get service {service}` shows each replica; `keelctl rollout undo service \
                 {service}` goes back to the previous template"
            )),
            CtlError::Incomplete { .. } => Some(
                "only what the other nodes answered is complete in the output; `keelctl get \
                 nodes` shows when the node is Alive again, and the same command then exits 0"
                    .into(),
            ),
            _ => None,
        }
    }
}

impl fmt::Display for CtlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CtlError::Usage(message) => f.write_str(message),
            CtlError::Config(e) => write!(f, "cannot load the configuration: {e}"),
            CtlError::Key(e) => write!(f, "cannot load the operator key: {e}"),
            CtlError::Contexts(e) => write!(f, "{e}"),
            CtlError::KeyGenerate { path, error } => {
                write!(f, "cannot generate a key at {}: {error}", path.display())
            }
            CtlError::Read { source, error } => write!(f, "cannot read {source}: {error}"),
            CtlError::Invalid { source, errors, .. } => match errors.as_slice() {
                [] => write!(f, "{source} is invalid"),
                [one] => write!(f, "{source} is invalid: {one}"),
                [first, ..] => write!(f, "{source} is invalid ({} errors): {first}", errors.len()),
            },
            CtlError::Empty { source } => write!(f, "{source} holds no document"),
            CtlError::NeedsControlPlane { what, socket } => write!(
                f,
                "{what}: services live on keel-controlplane, but requests go to the agent's \
                 socket {}",
                socket.display()
            ),
            CtlError::Request { action, error } => write!(f, "{action} failed: {error}"),
            CtlError::Incomplete { action, unreached } => {
                write!(f, "{action} is incomplete: ")?;
                for (i, u) in unreached.iter().enumerate() {
                    let sep = if i == 0 { "" } else { "; " };
                    write!(f, "{sep}node {} {}", u.node, u.why)?;
                }
                Ok(())
            }
            CtlError::NotConfirmed { action } => {
                write!(f, "{action}: not confirmed; nothing was deleted")
            }
            CtlError::BaseFetch { release, reason } => {
                write!(f, "base fetch {release} failed: {reason}")
            }
            CtlError::SomeFailed { action, failed, of } => write!(
                f,
                "{action}: {} of {of} failed ({}); the others were done",
                failed.len(),
                failed.join(", ")
            ),
            CtlError::Rollout { service, why } => {
                write!(f, "rollout of service {service} {why}")
            }
            CtlError::Encode { format, reason } => {
                write!(f, "cannot print the answer as {format}: {reason}")
            }
            CtlError::Output(e) => write!(f, "cannot write to stdout: {e}"),
            CtlError::Differs { differing, of } => {
                write!(
                    f,
                    "diff: {differing} of {of} objects differ from what is applied"
                )
            }
            CtlError::DiffFailed(e) => write!(f, "diff failed: {e}"),
        }
    }
}

impl std::error::Error for CtlError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CtlError::Config(e) => Some(e),
            CtlError::Contexts(e) => Some(e),
            CtlError::Key(e) | CtlError::KeyGenerate { error: e, .. } => Some(e),
            CtlError::Read { error, .. } | CtlError::Output(error) => Some(error),
            CtlError::Invalid { errors, .. } => errors.first().map(|e| e as _),
            CtlError::Request { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// A node a listing through the control plane could not list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreached {
    /// The node's id (made printable).
    pub node: String,
    /// Why, as a phrase after the node's id: `is Dead (last heartbeat 12s
    /// ago)`, `did not answer: ...`.
    pub why: String,
}

/// Where requests go. By level, flags first, then the environment, then the
/// contexts file, then `keel.toml` (`--config PATH`, which must exist, or
/// [`DEFAULT_CONFIG_PATH`], where a missing file means the defaults; read
/// only when needed):
///
/// 1. `--socket PATH`: that agent; `--controlplane HOST:PORT`: that control
///    plane; `--context NAME`: that context (two of them: a usage error);
/// 2. a non-empty `$KEEL_CONTROLPLANE`, then a non-empty `$KEEL_SOCKET`;
/// 3. the contexts file's `current-context` ([`contexts`]);
/// 4. `ctl.controlplane` if set, else the agent at `agent.socket`.
///
/// Through a control plane the key file is `--key-file`, else a non-empty
/// `$KEEL_KEY_FILE`, else the context's `key_file` when a context chose the
/// control plane, else `ctl.key_file`. `--node` and `--key-file` only make
/// sense with a control plane: given for an agent they are usage errors
/// rather than silently ignored. `$KEEL_KEY_FILE` is not: an environment set
/// up for a cluster may still run a command against one agent.
pub fn target(global: &GlobalOptions, env: &Env) -> Result<Target, CtlError> {
    let set = |v: &Option<OsString>| v.clone().filter(|s| !s.is_empty());
    let flags = [
        global.socket.as_ref().map(|_| "--socket"),
        global.controlplane.as_ref().map(|_| "--controlplane"),
        global.context.as_ref().map(|_| "--context"),
    ];
    if let [Some(a), Some(b), _] | [Some(a), _, Some(b)] | [_, Some(a), Some(b)] = flags {
        return Err(CtlError::Usage(format!(
            "{a} and {b} both say where requests go; give one"
        )));
    }
    let named = |name: &str| -> Result<Chosen, CtlError> {
        let path = env
            .contexts_file
            .as_deref()
            .ok_or(CtlError::Contexts(contexts::ContextsError::NoHome))?;
        let file = contexts::Contexts::load(path).map_err(CtlError::Contexts)?;
        Ok(Chosen::context(
            name,
            file.get(path, name).map_err(CtlError::Contexts)?,
        ))
    };
    let mut config = None;
    let chosen = if let Some(socket) = &global.socket {
        Chosen::Agent(socket.clone())
    } else if let Some(addr) = &global.controlplane {
        Chosen::control_plane(addr.clone(), "--controlplane")
    } else if let Some(name) = &global.context {
        named(name)?
    } else if let Some(addr) = set(&env.controlplane) {
        let addr = addr.into_string().map_err(|v| {
            CtlError::Usage(format!("${CONTROLPLANE_ENV} {v:?} is not valid UTF-8"))
        })?;
        Chosen::control_plane(addr, &format!("${CONTROLPLANE_ENV}"))
    } else if let Some(socket) = set(&env.socket) {
        Chosen::Agent(PathBuf::from(socket))
    } else if let Some(name) = current_context(env)? {
        named(&name)?
    } else {
        let loaded = load_config(global)?;
        let chosen = match loaded.ctl.controlplane.clone() {
            None => Chosen::Agent(loaded.agent.socket.clone()),
            Some(addr) => Chosen::control_plane(addr, "ctl.controlplane"),
        };
        config = Some(loaded);
        chosen
    };
    let (addr, source, context_key) = match chosen {
        Chosen::Agent(socket) => return agent(global, socket),
        Chosen::ControlPlane {
            addr,
            source,
            key_file,
        } => (addr, source, key_file),
    };
    check_controlplane(&addr, &source)?;
    let key_file = match (&global.key_file, set(&env.key_file), context_key, config) {
        (Some(path), _, _, _) => path.clone(),
        (None, Some(path), _, _) => PathBuf::from(path),
        (None, None, Some(path), _) => path,
        (None, None, None, Some(config)) => config.ctl.key_file,
        (None, None, None, None) => load_config(global)?.ctl.key_file,
    };
    Ok(Target::ControlPlane(Remote {
        addr,
        key_file,
        node: global.node.clone(),
    }))
}

/// What one level of [`target`] chose, before the checks.
enum Chosen {
    Agent(PathBuf),
    ControlPlane {
        addr: String,
        /// Where the address came from, for messages.
        source: String,
        /// A context's key file.
        key_file: Option<PathBuf>,
    },
}

impl Chosen {
    fn control_plane(addr: String, source: &str) -> Chosen {
        Chosen::ControlPlane {
            addr,
            source: source.to_string(),
            key_file: None,
        }
    }

    fn context(name: &str, context: &contexts::Context) -> Chosen {
        match (&context.controlplane, &context.socket) {
            (None, Some(socket)) => Chosen::Agent(socket.clone()),
            // A loaded file has one or the other; an empty address would
            // be refused naming the context.
            (addr, _) => Chosen::ControlPlane {
                addr: addr.clone().unwrap_or_default(),
                source: format!("context {name}"),
                key_file: context.key_file.clone(),
            },
        }
    }
}

/// The contexts file's `current-context`, if there is a file and it names
/// one.
fn current_context(env: &Env) -> Result<Option<String>, CtlError> {
    let Some(path) = env.contexts_file.as_deref() else {
        return Ok(None);
    };
    let file = contexts::Contexts::load(path).map_err(CtlError::Contexts)?;
    Ok(file.current)
}

fn agent(global: &GlobalOptions, socket: PathBuf) -> Result<Target, CtlError> {
    if global.node.is_some() {
        return Err(CtlError::Usage(format!(
            "--node picks a node through a control plane, but requests go to the agent's \
             socket {}; give --controlplane HOST:PORT (or set ${CONTROLPLANE_ENV})",
            socket.display()
        )));
    }
    if global.key_file.is_some() {
        return Err(CtlError::Usage(format!(
            "--key-file signs requests to a control plane, but requests go to the agent's \
             socket {}, which takes none; give --controlplane HOST:PORT too",
            socket.display()
        )));
    }
    Ok(Target::Agent(socket))
}

fn load_config(global: &GlobalOptions) -> Result<Config, CtlError> {
    match &global.config {
        Some(path) => Config::load(path),
        None => Config::load_or_default(Path::new(DEFAULT_CONFIG_PATH)),
    }
    .map_err(CtlError::Config)
}

/// `addr` is `HOST:PORT` by the rule `keel.toml`'s `ctl.controlplane`
/// follows; `source` names where it came from in the message.
fn check_controlplane(addr: &str, source: &str) -> Result<(), CtlError> {
    let mut probe = Config::default();
    let checked = probe
        .set_key("ctl.controlplane", addr)
        .and_then(|()| probe.validate());
    match checked {
        Ok(()) => Ok(()),
        Err(ConfigError::Invalid { message, .. }) => {
            Err(CtlError::Usage(format!("{source}: {message}")))
        }
        Err(e) => Err(CtlError::Usage(format!("{source}: {e}"))),
    }
}

/// keelctl with explicit arguments (without the program name), environment
/// and streams; returns the exit status.
pub fn run(
    args: impl IntoIterator<Item = OsString>,
    env: &Env,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    let invocation = match args::parse_args(args) {
        Ok(Parsed::Run(invocation)) => invocation,
        Ok(Parsed::Help) => return print_only(stdout, stderr, &args::help_text()),
        Ok(Parsed::HelpFor(verb)) => {
            // The parser only names a command that has a help.
            let text = args::command_help(&verb).unwrap_or_else(args::help_text);
            return print_only(stdout, stderr, &text);
        }
        Ok(Parsed::Version) => return print_only(stdout, stderr, &args::version_text()),
        Err(e) => return report(stderr, &CtlError::Usage(e.0)),
    };
    let mut out = commands::Out::new(stdout);
    let result = commands::execute(&invocation, env, stdin, &mut out, stderr);
    match result.and(out.finish().map_err(CtlError::Output)) {
        Ok(()) => 0,
        Err(e) => report(stderr, &e),
    }
}

/// keelctl's `main`: the process's arguments, environment and streams.
pub fn main() -> i32 {
    run(
        std::env::args_os().skip(1),
        &Env::from_process(),
        &mut io::stdin().lock(),
        &mut io::stdout().lock(),
        &mut io::stderr().lock(),
    )
}

fn print_only(stdout: &mut dyn Write, stderr: &mut dyn Write, text: &str) -> i32 {
    let mut out = commands::Out::new(stdout);
    out.print(text);
    match out.finish() {
        Ok(()) => 0,
        Err(e) => report(stderr, &CtlError::Output(e)),
    }
}

/// Prints `e` as `keelctl: summary` and its detail; returns its exit status.
pub(crate) fn report(stderr: &mut dyn Write, e: &CtlError) -> i32 {
    // Nothing sensible is left to do if stderr itself is gone.
    let _ = writeln!(stderr, "keelctl: {e}");
    if let Some(detail) = e.detail() {
        let _ = writeln!(stderr, "  {detail}");
    }
    e.exit_code()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn global(socket: Option<&str>, config: Option<&Path>) -> GlobalOptions {
        GlobalOptions {
            socket: socket.map(PathBuf::from),
            config: config.map(Path::to_path_buf),
            ..GlobalOptions::default()
        }
    }

    fn env(socket: Option<&str>) -> Env {
        Env {
            socket: socket.map(OsString::from),
            ..Env::default()
        }
    }

    fn agent_socket(global: &GlobalOptions, env: &Env) -> Result<PathBuf, CtlError> {
        match target(global, env)? {
            Target::Agent(socket) => Ok(socket),
            other => panic!("not an agent: {other:?}"),
        }
    }

    #[test]
    fn the_socket_flag_beats_the_environment_which_beats_keel_toml() {
        let dir = tempfile::tempdir().expect("tempdir");
        let toml = dir.path().join("keel.toml");
        std::fs::write(&toml, "[agent]\nsocket = \"/from/toml.sock\"\n").expect("writes");
        let pick =
            |flag, var| agent_socket(&global(flag, Some(&toml)), &env(var)).expect("resolves");
        assert_eq!(
            pick(Some("/flag.sock"), Some("/env.sock")),
            PathBuf::from("/flag.sock")
        );
        assert_eq!(pick(None, Some("/env.sock")), PathBuf::from("/env.sock"));
        assert_eq!(pick(None, Some("")), PathBuf::from("/from/toml.sock"));
        assert_eq!(pick(None, None), PathBuf::from("/from/toml.sock"));
    }

    #[test]
    fn a_missing_explicit_config_is_an_error_but_not_when_the_socket_is_given() {
        let missing = Path::new("/nonexistent/keel.toml");
        let e = agent_socket(&global(None, Some(missing)), &env(None)).expect_err("missing");
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("/nonexistent/keel.toml"), "{e}");
        assert!(agent_socket(&global(Some("/s"), Some(missing)), &env(None)).is_ok());
    }

    fn remote(addr: &str, key_file: &str, node: Option<&str>) -> Target {
        Target::ControlPlane(Remote {
            addr: addr.into(),
            key_file: key_file.into(),
            node: node.map(str::to_string),
        })
    }

    #[test]
    fn a_control_plane_comes_from_the_flag_then_the_environment_then_keel_toml() {
        let dir = tempfile::tempdir().expect("tempdir");
        let toml = dir.path().join("keel.toml");
        std::fs::write(
            &toml,
            "[agent]\nsocket = \"/from/toml.sock\"\n[ctl]\ncontrolplane = \"cp.example.org:7440\"\n\
             key_file = \"/toml/operator.key\"\n",
        )
        .expect("writes");
        let with = |flag: Option<&str>, key: Option<&str>, node: Option<&str>, var: Env| {
            let global = GlobalOptions {
                controlplane: flag.map(str::to_string),
                key_file: key.map(PathBuf::from),
                node: node.map(str::to_string),
                ..global(None, Some(&toml))
            };
            target(&global, &var)
        };
        let both = Env {
            socket: Some("/env.sock".into()),
            controlplane: Some("192.0.2.1:7440".into()),
            ..Env::default()
        };
        assert_eq!(
            with(Some("127.0.0.1:9"), Some("/k"), Some("n1"), both.clone()).expect("flag"),
            remote("127.0.0.1:9", "/k", Some("n1"))
        );
        // The environment's control plane beats its socket; the key comes
        // from keel.toml when --key-file is not given.
        assert_eq!(
            with(None, None, None, both).expect("env"),
            remote("192.0.2.1:7440", "/toml/operator.key", None)
        );
        assert_eq!(
            with(None, None, None, env(Some("/env.sock"))).expect("socket"),
            Target::Agent("/env.sock".into())
        );
        assert_eq!(
            with(None, None, None, env(None)).expect("toml"),
            remote("cp.example.org:7440", "/toml/operator.key", None)
        );
        // --socket wins over the environment's and keel.toml's control plane.
        let socket = GlobalOptions {
            socket: Some("/flag.sock".into()),
            ..global(None, Some(&toml))
        };
        let cp_env = Env {
            socket: None,
            controlplane: Some("192.0.2.1:7440".into()),
            ..Env::default()
        };
        assert_eq!(
            target(&socket, &cp_env).expect("socket flag"),
            Target::Agent("/flag.sock".into())
        );
    }

    #[test]
    fn the_key_file_comes_from_the_flag_then_the_environment_then_keel_toml() {
        let dir = tempfile::tempdir().expect("tempdir");
        let toml = dir.path().join("keel.toml");
        std::fs::write(&toml, "[ctl]\nkey_file = \"/toml/operator.key\"\n").expect("writes");
        let with = |flag: Option<&str>, var: Option<&str>| {
            let global = GlobalOptions {
                controlplane: Some("127.0.0.1:9".into()),
                key_file: flag.map(PathBuf::from),
                ..global(None, Some(&toml))
            };
            let env = Env {
                key_file: var.map(OsString::from),
                ..Env::default()
            };
            target(&global, &env).expect("resolves")
        };
        assert_eq!(
            with(Some("/flag.key"), Some("/env.key")),
            remote("127.0.0.1:9", "/flag.key", None)
        );
        assert_eq!(
            with(None, Some("/env.key")),
            remote("127.0.0.1:9", "/env.key", None)
        );
        assert_eq!(
            with(None, Some("")),
            remote("127.0.0.1:9", "/toml/operator.key", None)
        );
        assert_eq!(
            with(None, None),
            remote("127.0.0.1:9", "/toml/operator.key", None)
        );
        // With the variable set, keel.toml is not read at all: a missing
        // explicit one is no error.
        let global = GlobalOptions {
            controlplane: Some("127.0.0.1:9".into()),
            ..global(None, Some(Path::new("/nonexistent/keel.toml")))
        };
        let env = Env {
            key_file: Some("/env.key".into()),
            ..Env::default()
        };
        assert_eq!(
            target(&global, &env).expect("no keel.toml read"),
            remote("127.0.0.1:9", "/env.key", None)
        );
        // An agent target ignores the variable rather than refusing it.
        let env = Env {
            socket: Some("/s.sock".into()),
            key_file: Some("/env.key".into()),
            ..Env::default()
        };
        assert_eq!(
            target(&GlobalOptions::default(), &env).expect("agent"),
            Target::Agent("/s.sock".into())
        );
    }

    #[test]
    fn node_and_key_file_without_a_control_plane_are_usage_errors() {
        let usage = |global: GlobalOptions| {
            let e = target(&global, &env(Some("/s.sock"))).expect_err("usage error");
            assert_eq!(e.exit_code(), 2, "{e}");
            e.to_string()
        };
        let node = GlobalOptions {
            node: Some("n1".into()),
            ..GlobalOptions::default()
        };
        assert!(usage(node).contains("--node picks a node through a control plane"));
        let key = GlobalOptions {
            key_file: Some("/k".into()),
            ..GlobalOptions::default()
        };
        assert!(usage(key).contains("--key-file signs requests to a control plane"));
        let both = GlobalOptions {
            socket: Some("/s".into()),
            controlplane: Some("127.0.0.1:1".into()),
            ..GlobalOptions::default()
        };
        assert!(usage(both).contains("give one"));
        let bad = GlobalOptions {
            controlplane: Some("no-port".into()),
            ..GlobalOptions::default()
        };
        assert!(usage(bad).starts_with("--controlplane: `no-port` is not HOST:PORT"));
    }

    fn run_with(args: &[&str], stdin: &str) -> (i32, String, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = run(
            args.iter().map(OsString::from),
            &env(Some("/nonexistent/keel-test.sock")),
            &mut stdin.as_bytes(),
            &mut out,
            &mut err,
        );
        let text = |b: Vec<u8>| String::from_utf8(b).expect("utf-8");
        (code, text(out), text(err))
    }

    const JAIL: &str = "kind: Jail\nmetadata: {name: web-1}\nspec:\n  base: 14.2-RELEASE\n  exec: {start: [/bin/sleep, '300']}\n";

    #[test]
    fn validate_counts_documents_and_exits_2_naming_the_field_and_line() {
        let two = format!("{JAIL}---\n{}", JAIL.replace("web-1", "web-2"));
        assert_eq!(
            run_with(&["validate", "-f", "-"], &two),
            (0, "2 documents valid\n".into(), String::new())
        );
        let bad = JAIL.replace("base: 14.2-RELEASE", "base: 14.2-RELEASE\n  colour: blue");
        let (code, out, err) = run_with(&["validate", "-f", "-"], &bad);
        assert_eq!((code, out.as_str()), (2, ""));
        assert!(
            err.starts_with("keelctl: stdin is invalid: document 1, spec"),
            "{err}"
        );
        assert!(err.contains("line 5"), "{err}");
        assert_eq!(
            err.lines().count(),
            1,
            "validate sends nothing, so says nothing of it: {err}"
        );
    }

    #[test]
    fn apply_refuses_a_bad_file_before_reaching_for_the_agent() {
        // The socket does not exist: reaching for it would exit 1, not 2.
        let (code, _, err) = run_with(&["apply", "-f", "-"], "kind: Jail\nmetadata: {name: x}\n");
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("nothing was sent"), "{err}");
        let (code, _, err) = run_with(&["delete", "-f", "-"], "# nothing\n");
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("stdin holds no document"), "{err}");
    }

    #[test]
    fn an_unreachable_agent_exits_1_saying_so() {
        let (code, out, err) = run_with(&["apply", "-f", "-"], JAIL);
        assert_eq!((code, out.as_str()), (1, ""));
        assert!(
            err.starts_with(
                "keelctl: apply jail/web-1 failed: cannot connect to /nonexistent/keel-test.sock"
            ),
            "{err}"
        );
        assert!(err.contains("is keel-agentd running?"), "{err}");
    }

    #[test]
    fn delete_volume_asks_on_a_terminal_unless_yes_and_never_in_a_script() {
        const PROMPT: &str = "Delete volume pg and all its data? [y/N] ";
        // The socket does not exist: going ahead fails to connect, exit 1.
        let went_ahead = "keelctl: delete volume/pg failed: cannot connect to";
        let run_as = |interactive: bool, args: &[&str], stdin: &str| {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let env = Env {
                interactive,
                ..env(Some("/nonexistent/keel-test.sock"))
            };
            let code = run(
                args.iter().map(OsString::from),
                &env,
                &mut stdin.as_bytes(),
                &mut out,
                &mut err,
            );
            assert!(out.is_empty(), "{args:?}");
            (code, String::from_utf8(err).expect("utf-8"))
        };
        for answer in ["n\n", "\n", "", "yess\n", "no\ny\n"] {
            let (code, err) = run_as(true, &["delete-volume", "pg"], answer);
            assert_eq!(code, 1, "{answer:?}: {err}");
            assert_eq!(
                err,
                format!(
                    "{PROMPT}keelctl: delete-volume pg: not confirmed; nothing was deleted\n  \
                     answer y to go ahead, or give --yes to skip the question\n"
                ),
                "{answer:?}"
            );
        }
        for answer in ["y\n", "YES\n", " y \n", "y"] {
            let (code, err) = run_as(true, &["delete-volume", "pg"], answer);
            assert_eq!(code, 1, "{err}");
            assert!(
                err.starts_with(&format!("{PROMPT}{went_ahead}")),
                "{answer:?}: {err}"
            );
        }
        for (interactive, args) in [
            (true, &["delete-volume", "pg", "--yes"][..]),
            (false, &["delete-volume", "pg"]),
        ] {
            let (code, err) = run_as(interactive, args, "n\n");
            assert_eq!(code, 1, "{err}");
            assert!(err.starts_with(went_ahead), "no question: {args:?}: {err}");
        }
    }

    #[test]
    fn an_incomplete_listing_exits_1_naming_every_node_left_out() {
        let e = CtlError::Incomplete {
            action: "get jails".into(),
            unreached: vec![
                Unreached {
                    node: "n2".into(),
                    why: "is Dead (last heartbeat 9s ago)".into(),
                },
                Unreached {
                    node: "n3".into(),
                    why: "could not be listed (HTTP 503: timed out)".into(),
                },
            ],
        };
        assert_eq!(e.exit_code(), 1);
        assert_eq!(
            e.to_string(),
            "get jails is incomplete: node n2 is Dead (last heartbeat 9s ago); node n3 could \
             not be listed (HTTP 503: timed out)"
        );
        assert!(e.detail().is_some_and(|d| d.contains("exits 0")));
    }

    #[test]
    fn usage_errors_exit_2_and_point_at_help() {
        let (code, _, err) = run_with(&["frobnicate"], "");
        assert_eq!(code, 2);
        assert_eq!(
            err,
            "keelctl: unknown command \"frobnicate\"; use apply, diff, get, describe, delete, logs, cordon, uncordon, delete-volume, base, scale, rollout, validate, key, help, config, completion or version\n  try 'keelctl --help'\n"
        );
        let (code, _, err) = run_with(&["apply", "-f", "/nonexistent/web.yaml"], "");
        assert_eq!(code, 2);
        assert!(
            err.starts_with("keelctl: cannot read /nonexistent/web.yaml: "),
            "{err}"
        );
    }

    #[test]
    fn cluster_only_commands_and_flags_need_a_control_plane() {
        let (code, _, err) = run_with(&["get", "nodes"], "");
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("`get nodes` lists a cluster's nodes"), "{err}");
        let (code, _, err) = run_with(&["get", "jails", "--node", "n1"], "");
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("--node picks a node"), "{err}");
    }

    const SERVICE: &str = "kind: Service\nmetadata: {name: web}\nspec:\n  replicas: 1\n  port: 80\n  template:\n    base: 14.2-RELEASE\n    exec: {start: [/bin/true]}\n";

    #[test]
    fn services_without_a_control_plane_stop_before_anything_is_sent() {
        // The socket does not exist: reaching for it would exit 1, not 2.
        for verb in ["apply", "delete"] {
            let (code, out, err) = run_with(&[verb, "-f", "-"], &format!("{JAIL}---\n{SERVICE}"));
            assert_eq!((code, out.as_str()), (2, ""), "{verb}: {err}");
            assert!(
                err.starts_with(
                    "keelctl: stdin: document 2 is kind: Service (web): services live on \
                     keel-controlplane, but requests go to the agent's socket \
                     /nonexistent/keel-test.sock\n"
                ),
                "{err}"
            );
            assert!(err.contains("give --controlplane HOST:PORT"), "{err}");
            assert!(err.contains("nothing was sent"), "{err}");
        }
        for args in [
            &["get", "services"][..],
            &["get", "service", "web"],
            &["delete", "service", "web"],
        ] {
            let (code, _, err) = run_with(args, "");
            assert_eq!(code, 2, "{args:?}: {err}");
            assert!(err.contains("services live on keel-controlplane"), "{err}");
        }
    }

    #[test]
    fn a_service_document_with_node_is_refused_before_anything_is_sent() {
        // No key file exists: reaching for it would fail differently.
        let (code, _, err) = run_with(
            &[
                "--controlplane",
                "127.0.0.1:9",
                "--key-file",
                "/nonexistent/ops.key",
                "--node",
                "n1",
                "apply",
                "-f",
                "-",
            ],
            SERVICE,
        );
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains("--node applies to jails and ingresses only"),
            "{err}"
        );
    }

    const INGRESS: &str =
        "kind: Ingress\nmetadata: {name: www}\nspec:\n  host: www.example.com\n  service: web\n";

    #[test]
    fn ingresses_through_a_control_plane_need_node_before_anything_is_sent() {
        // No key file exists: reaching for it would say so instead.
        let cp = [
            "--controlplane",
            "127.0.0.1:9",
            "--key-file",
            "/nonexistent/ops.key",
        ];
        for verb in ["apply", "delete"] {
            let args: Vec<&str> = cp.iter().copied().chain([verb, "-f", "-"]).collect();
            let (code, out, err) = run_with(&args, &format!("{JAIL}---\n{INGRESS}"));
            assert_eq!((code, out.as_str()), (2, ""), "{verb}: {err}");
            assert!(
                err.starts_with(
                    "keelctl: stdin: document 2 is kind: Ingress (www), which lives on one node: \
                     through the control plane give --node ID"
                ),
                "{verb}: {err}"
            );
            assert!(err.contains("nothing was sent"), "{err}");
        }
        // Listing them all needs no --node (every node's list); one ingress
        // does.
        for (words, what) in [
            (&["get", "ing", "www"][..], "`get ingress NAME`"),
            (&["delete", "ingress", "www"], "`delete ingress`"),
        ] {
            let args: Vec<&str> = cp.iter().chain(words).copied().collect();
            let (code, _, err) = run_with(&args, "");
            assert_eq!(code, 2, "{words:?}: {err}");
            assert!(
                err.starts_with(&format!(
                    "keelctl: {what} through the control plane needs --node ID"
                )),
                "{err}"
            );
        }
        // With --node the check passes and the key file is reached for.
        let args: Vec<&str> = cp
            .iter()
            .copied()
            .chain(["--node", "n1", "apply", "-f", "-"])
            .collect();
        let (code, _, err) = run_with(&args, INGRESS);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("cannot load the operator key"), "{err}");
    }

    #[test]
    fn a_missing_operator_key_stops_before_anything_is_sent() {
        let (code, _, err) = run_with(
            &[
                "get",
                "nodes",
                "--controlplane",
                "127.0.0.1:9",
                "--key-file",
                "/nonexistent/operator.key",
            ],
            "",
        );
        assert_eq!(code, 2, "{err}");
        assert!(
            err.starts_with("keelctl: cannot load the operator key: cannot open key file /nonexistent/operator.key"),
            "{err}"
        );
        assert!(err.contains("nothing was sent"), "{err}");
    }

    #[test]
    fn key_generate_writes_a_0600_key_once_named_after_its_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ops-2026-11.key");
        let path_arg = path.to_str().expect("utf-8");
        let (code, out, err) = run_with(&["key", "generate", path_arg], "");
        assert_eq!((code, err.as_str()), (0, ""));
        assert!(out.starts_with("key ops-2026-11 written to "), "{out}");
        let mode = std::fs::metadata(&path)
            .expect("written")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let key = crate::common::auth::load_key(
            &path,
            crate::common::auth::KeyFilePolicy::for_current_process(),
        )
        .expect("loads back");
        assert_eq!(key.id(), "ops-2026-11");
        let before = std::fs::read(&path).expect("read");
        let (code, _, err) = run_with(&["key", "generate", "--id", "other", path_arg], "");
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("refusing to overwrite"), "{err}");
        assert_eq!(std::fs::read(&path).expect("read"), before, "left alone");
        let other = dir.path().join("x.key");
        let (code, _, err) = run_with(
            &[
                "key",
                "generate",
                "--id",
                "bad id",
                other.to_str().expect("utf-8"),
            ],
            "",
        );
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("key id \"bad id\" is not usable"), "{err}");
        assert!(!other.exists());
    }

    #[test]
    fn help_and_version_print_on_stdout() {
        let (code, out, err) = run_with(&["--help"], "");
        assert_eq!((code, err.as_str()), (0, ""));
        assert!(out.contains("--socket PATH"), "{out}");
        for args in [&["help", "apply"][..], &["apply", "--help"]] {
            let (code, out, err) = run_with(args, "");
            assert_eq!((code, err.as_str()), (0, ""), "{args:?}");
            assert!(out.starts_with("Usage:\n  apply -f FILE|-"), "{out}");
        }
        let (code, out, err) = run_with(&["help", "frobnicate"], "");
        assert_eq!((code, out.as_str()), (2, ""));
        assert!(
            err.starts_with("keelctl: `help frobnicate`: unknown command"),
            "{err}"
        );
        let (code, out, _) = run_with(&["--version"], "");
        assert_eq!(
            (code, out),
            (0, format!("keelctl {}\n", env!("CARGO_PKG_VERSION")))
        );
        let (code, out, _) = run_with(&["version", "--client"], "");
        assert_eq!(
            (code, out),
            (
                0,
                format!("Client: keelctl {}\n", env!("CARGO_PKG_VERSION"))
            )
        );
    }

    /// A stdout whose reader went away.
    struct ClosedPipe;

    impl Write for ClosedPipe {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> io::Result<()> {
            Err(io::ErrorKind::BrokenPipe.into())
        }
    }

    /// A stdout on a full disk.
    struct Full;

    impl Write for Full {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::from_raw_os_error(28))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_stdout_is_not_an_error_but_a_failing_one_is() {
        let mut err = Vec::new();
        let args = || ["validate", "-f", "-"].map(OsString::from);
        let code = run(
            args(),
            &Env::default(),
            &mut JAIL.as_bytes(),
            &mut ClosedPipe,
            &mut err,
        );
        assert_eq!((code, err.len()), (0, 0));
        let code = run(
            args(),
            &Env::default(),
            &mut JAIL.as_bytes(),
            &mut Full,
            &mut err,
        );
        assert_eq!(code, 1);
        assert!(String::from_utf8_lossy(&err).starts_with("keelctl: cannot write to stdout"));
    }
}
