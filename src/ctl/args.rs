//! keelctl's command line: the flag and command tables, `--help` rendered from
//! them, and parsing argv (lexopt) into an [`Invocation`].
//!
//! This file owns what a well-formed command line is. It never reads a file,
//! the environment or `keel.toml` and never talks to a daemon: resolving where
//! requests go is `mod.rs`'s job, running a command is `commands.rs`'s.
//!
//! Flags may come before or after the command words (`keelctl -o json get
//! jails` and `keelctl get jails -o json` are the same), kubectl-style.
//! Global flags (where requests go, which `keel.toml`) live in
//! [`GlobalOptions`]; flags a command does not use are refused rather than
//! silently ignored, so a typo cannot change what runs.

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;

use crate::common::events::ObjectRef;
use crate::common::spec;

/// What a flag is, independent of its spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlagId {
    /// `-f, --filename FILE|-`.
    Filename,
    /// `-o, --output FORMAT`.
    Output,
    /// `--socket PATH`.
    Socket,
    /// `-c, --config PATH`.
    Config,
    /// `--controlplane HOST:PORT`.
    ControlPlane,
    /// `--node ID`.
    Node,
    /// `--key-file PATH`.
    KeyFile,
    /// `--id ID` (`key generate`).
    Id,
    /// `--tail N` (`logs`).
    Tail,
    /// `--replicas N` (`scale`).
    Replicas,
    /// `--timeout DURATION` (`rollout status`).
    Timeout,
    /// `--to-revision N` (`rollout undo`).
    ToRevision,
    /// `--yes` (`delete-volume`): no question asked.
    Yes,
    /// `--follow` (`logs`; also `-f` after `logs`).
    Follow,
    /// `--context NAME`: a context of the contexts file for this command.
    Context,
    /// `--client` (`version`): the client's version only.
    Client,
    /// `-h, --help`.
    Help,
    /// `-V, --version`.
    Version,
    /// `--dry-run` (`apply`).
    DryRun,
    /// `--for KIND/NAME` (`get events`).
    For,
    /// `-w, --watch` (`get events`).
    Watch,
}

/// One keelctl flag, as `--help` shows it and the parser recognises it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flag {
    /// What it is.
    pub id: FlagId,
    /// Single-letter form, if any.
    pub short: Option<char>,
    /// Long form without the leading `--`.
    pub long: &'static str,
    /// Placeholder of its value in `--help`, if it takes one.
    pub value: Option<&'static str>,
    /// One line for `--help`.
    pub help: &'static str,
}

/// Every flag keelctl accepts, in `--help` order.
pub const FLAGS: &[Flag] = &[
    Flag {
        id: FlagId::Filename,
        short: Some('f'),
        long: "filename",
        value: Some("FILE"),
        help: "spec file, a directory of .yaml/.yml files, or - for stdin (apply, diff, delete, validate)",
    },
    Flag {
        id: FlagId::Output,
        short: Some('o'),
        long: "output",
        value: Some("FORMAT"),
        help: "table (default), json or yaml (get; diff and apply --dry-run: text or json); wide (get jails)",
    },
    Flag {
        id: FlagId::Socket,
        short: None,
        long: "socket",
        value: Some("PATH"),
        help: "keel-agentd's socket (default $KEEL_SOCKET, else agent.socket of keel.toml)",
    },
    Flag {
        id: FlagId::ControlPlane,
        short: None,
        long: "controlplane",
        value: Some("HOST:PORT,..."),
        help: "use keel-controlplane, or the first of several that answers (default $KEEL_CONTROLPLANE, else ctl.controlplane)",
    },
    Flag {
        id: FlagId::Node,
        short: None,
        long: "node",
        value: Some("ID"),
        help: "with a control plane: this node instead of the scheduler's pick (needed for ingresses)",
    },
    Flag {
        id: FlagId::KeyFile,
        short: None,
        long: "key-file",
        value: Some("PATH"),
        help: "operator key for the control plane (default $KEEL_KEY_FILE, else ctl.key_file)",
    },
    Flag {
        id: FlagId::Context,
        short: None,
        long: "context",
        value: Some("NAME"),
        help: "use this context of ~/.config/keel/config.toml (default its current-context)",
    },
    Flag {
        id: FlagId::Config,
        short: Some('c'),
        long: "config",
        value: Some("PATH"),
        help: "keel.toml to read (default /usr/local/etc/keel.toml, if it exists)",
    },
    Flag {
        id: FlagId::Id,
        short: None,
        long: "id",
        value: Some("ID"),
        help: "id of the new key (key generate; default: PATH's name without .key)",
    },
    Flag {
        id: FlagId::Tail,
        short: None,
        long: "tail",
        value: Some("N"),
        help: "lines of output to show (logs; default 200, at most 10000)",
    },
    Flag {
        id: FlagId::Replicas,
        short: None,
        long: "replicas",
        value: Some("N"),
        help: "the desired replica count (scale)",
    },
    Flag {
        id: FlagId::Timeout,
        short: None,
        long: "timeout",
        value: Some("DURATION"),
        help: "how long to wait, e.g. 90s or 5m (rollout status; default 5m)",
    },
    Flag {
        id: FlagId::ToRevision,
        short: None,
        long: "to-revision",
        value: Some("N"),
        help: "the revision to go back to (rollout undo; default the one before the current)",
    },
    Flag {
        id: FlagId::Follow,
        short: None,
        long: "follow",
        value: None,
        help: "keep printing new lines until interrupted (logs; also -f after logs)",
    },
    Flag {
        id: FlagId::Client,
        short: None,
        long: "client",
        value: None,
        help: "print keelctl's version only, asking no daemon (version)",
    },
    Flag {
        id: FlagId::Yes,
        short: None,
        long: "yes",
        value: None,
        help: "do not ask for confirmation on a terminal (delete-volume)",
    },
    Flag {
        id: FlagId::For,
        short: None,
        long: "for",
        value: Some("KIND/NAME"),
        help: "only the events about this object, e.g. jail/web or node/n1 (get events)",
    },
    Flag {
        id: FlagId::Watch,
        short: Some('w'),
        long: "watch",
        value: None,
        help: "after what there is, print changes as they happen until interrupted (get events, jails, services, nodes)",
    },
    Flag {
        id: FlagId::Help,
        short: Some('h'),
        long: "help",
        value: None,
        help: "print this help and exit",
    },
    Flag {
        id: FlagId::Version,
        short: Some('V'),
        long: "version",
        value: None,
        help: "print the version and exit",
    },
    Flag {
        id: FlagId::DryRun,
        short: None,
        long: "dry-run",
        value: None,
        help: "show the diff, what the apply would do and its FreeBSD commands; change nothing (apply)",
    },
];

/// Every command form, as `--help` shows it: usage, then what it does.
pub const COMMANDS: &[(&str, &str)] = &[
    (
        "apply -f FILE|-",
        "validate every document of FILE (jails, services, ingresses), then apply them in order",
    ),
    (
        "apply --dry-run -f FILE|-",
        "show each object's diff, what the apply would do and the FreeBSD commands; change nothing",
    ),
    (
        "diff -f FILE|-",
        "show each object's diff against what the daemon holds (exit 0 none, 1 some, 2 error)",
    ),
    ("get jails [NAME]", "list the jails, or show one"),
    (
        "get services [NAME]",
        "list the services, or one's replicas (with --controlplane)",
    ),
    (
        "get nodes [NAME]",
        "list the cluster's nodes, or show one (with --controlplane)",
    ),
    (
        "get volumes [NAME]",
        "list the volume datasets, or show one",
    ),
    (
        "get ingresses [NAME]",
        "list the ingresses (of every node, or the --node's), or show one (with --controlplane: of the --node)",
    ),
    (
        "get bases [RELEASE]",
        "list the node's release bases and running fetches, or show one (with --controlplane: of the --node)",
    ),
    (
        "describe jail|service|node|volume|ingress NAME",
        "one object in detail: status, conditions, the spec it was applied with",
    ),
    (
        "get events [--for KIND/NAME] [-w]",
        "what the daemons did and saw, oldest first (with --controlplane: its own and those of every node not Dead)",
    ),
    ("delete jail NAME...", "delete jails by name"),
    (
        "delete service NAME...",
        "delete services and their replicas (with --controlplane)",
    ),
    (
        "delete ingress NAME...",
        "delete ingresses by name (with --controlplane: on the --node)",
    ),
    (
        "logs NAME [--tail N] [-f]",
        "the last lines the jail's workload printed",
    ),
    (
        "cordon NODE...",
        "place nothing new on these nodes; what runs there stays (with --controlplane)",
    ),
    (
        "uncordon NODE...",
        "let the scheduler use these nodes again",
    ),
    (
        "delete node NAME...",
        "forget Dead nodes and what was placed on them (with --controlplane)",
    ),
    (
        "delete-volume NAME [--yes]",
        "destroy a volume dataset and its data (refused while a jail mounts it)",
    ),
    (
        "delete -f FILE|-",
        "delete the jails, services and ingresses of FILE, last one first",
    ),
    (
        "base fetch RELEASE",
        "download, verify and install a FreeBSD release base, waiting until it is ready (with --controlplane: on the --node)",
    ),
    (
        "scale service NAME --replicas N",
        "set a service's replica count; extra replicas drain before they stop (with --controlplane)",
    ),
    (
        "rollout status service NAME [--timeout D]",
        "wait until the service's rollout completes; exit 1 when it stopped or the wait timed out",
    ),
    (
        "rollout history service NAME",
        "the service's template revisions (the last 10)",
    ),
    (
        "rollout undo service NAME [--to-revision N]",
        "roll the service back to an earlier template, as a new revision",
    ),
    ("validate -f FILE|-", "check FILE without sending anything"),
    (
        "key generate [--id ID] PATH",
        "write a new signing key to PATH (mode 0600)",
    ),
    (
        "help [COMMAND]",
        "this help, or COMMAND's usage and the options it takes (also COMMAND --help)",
    ),
    (
        "config get-contexts",
        "list the contexts of ~/.config/keel/config.toml, marking the current one",
    ),
    ("config current-context", "print the current context's name"),
    (
        "config use-context NAME",
        "make NAME the context commands use by default",
    ),
    (
        "config set-context NAME --controlplane HOST:PORT [--key-file PATH]",
        "add or replace a control-plane context",
    ),
    (
        "config set-context NAME --socket PATH",
        "add or replace an agent's context",
    ),
    ("config delete-context NAME", "remove a context"),
    (
        "completion sh|zsh|fish",
        "print a completion script for the shell (sh: FreeBSD's sh and bash)",
    ),
    (
        "version [--client]",
        "keelctl's version and the daemon's (--version: keelctl's only)",
    ),
];

/// The command words (`apply`, `delete-volume`, ...), each once, in
/// [`COMMANDS`] order.
pub fn verbs() -> Vec<&'static str> {
    let mut verbs: Vec<&'static str> = Vec::new();
    for (form, _) in COMMANDS {
        let verb = form.split(' ').next().unwrap_or(form);
        if !verbs.contains(&verb) {
            verbs.push(verb);
        }
    }
    verbs
}

/// `a, b or c` of [`verbs`], for messages naming what exists.
fn verb_list() -> String {
    let verbs = verbs();
    match verbs.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// Whether `verb` takes the flag, for `keelctl help VERB`. The match is
/// exhaustive so a new flag has to be placed here; the parser refusing a
/// flag a command does not use is [`command`]'s job.
fn applies_to(id: FlagId, verb: &str) -> bool {
    match id {
        FlagId::Filename => matches!(verb, "apply" | "delete" | "validate" | "diff"),
        FlagId::Output => matches!(verb, "get" | "diff" | "apply"),
        FlagId::DryRun => verb == "apply",
        FlagId::Id => verb == "key",
        FlagId::Tail => verb == "logs",
        FlagId::Replicas => verb == "scale",
        FlagId::Yes => verb == "delete-volume",
        FlagId::Follow => verb == "logs",
        FlagId::Client => verb == "version",
        FlagId::Timeout | FlagId::ToRevision => verb == "rollout",
        FlagId::Node => matches!(
            verb,
            "apply" | "diff" | "get" | "describe" | "delete" | "logs" | "delete-volume" | "base"
        ),
        // Where requests go: every command that sends one; `config
        // set-context` records them.
        FlagId::Socket | FlagId::ControlPlane | FlagId::KeyFile => {
            !matches!(verb, "validate" | "key" | "help" | "completion")
        }
        FlagId::Config | FlagId::Context => {
            !matches!(verb, "validate" | "key" | "help" | "completion" | "config")
        }
        FlagId::Help => true,
        FlagId::Version => false,
        FlagId::For | FlagId::Watch => verb == "get",
    }
}

/// Where a spec comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// `-f -`.
    Stdin,
    /// `-f FILE`.
    File(PathBuf),
}

/// What `get` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    /// `get jails` (also `get jail`).
    Jails,
    /// `get nodes` (also `get node`): the control plane's members.
    Nodes,
    /// `get services` (also `get service`, `get svc`): the control plane's
    /// replicated services.
    Services,
    /// `get volumes` (also `get volume`, `get vol`): volume datasets.
    Volumes,
    /// `get ingresses` (also `get ingress`, `get ing`): public HTTPS hosts,
    /// each served by one node.
    Ingresses,
    /// `get bases` (also `get base`): a node's release bases and the
    /// fetches running there.
    Bases,
}

/// How `get` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputFormat {
    /// Aligned columns for people.
    #[default]
    Table,
    /// The API's JSON, pretty-printed.
    Json,
    /// The same values as YAML.
    Yaml,
    /// The table with more columns (`get jails`: ADDRESS and EPOCH).
    Wide,
}

impl fmt::Display for OutputFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OutputFormat::Table => "table",
            OutputFormat::Json => "json",
            OutputFormat::Yaml => "yaml",
            OutputFormat::Wide => "wide",
        })
    }
}

/// Flags that say where requests go and how keelctl is configured, whatever
/// the command.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GlobalOptions {
    /// `--socket PATH`.
    pub socket: Option<PathBuf>,
    /// `--config PATH`.
    pub config: Option<PathBuf>,
    /// `--controlplane HOST:PORT`.
    pub controlplane: Option<String>,
    /// `--node ID`, a DNS label (checked when parsed).
    pub node: Option<String>,
    /// `--key-file PATH`.
    pub key_file: Option<PathBuf>,
    /// `--context NAME`, a DNS label (checked when parsed).
    pub context: Option<String>,
}

/// `config ...`: the contexts file (`ctl::contexts`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigCommand {
    /// `config get-contexts`.
    GetContexts,
    /// `config current-context`.
    CurrentContext,
    /// `config use-context NAME`.
    UseContext {
        /// The context.
        name: String,
    },
    /// `config set-context NAME ...`, from `--controlplane`, `--key-file`
    /// and `--socket`.
    SetContext {
        /// The context.
        name: String,
    },
    /// `config delete-context NAME`.
    DeleteContext {
        /// The context.
        name: String,
    },
}

/// A shell `completion` writes a script for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shell {
    /// A POSIX sh script (also `bash`): it registers its completion where
    /// the shell has programmable completion (bash's `complete`) and is
    /// harmless where it has none, as in FreeBSD's sh.
    Sh,
    /// zsh.
    Zsh,
    /// fish.
    Fish,
}

/// A command to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `apply -f FILE|-`.
    Apply {
        /// The spec file.
        input: Input,
    },
    /// `get jails|services|volumes|ingresses|nodes|bases [NAME] [-o FORMAT]`.
    Get {
        /// What to list.
        resource: Resource,
        /// One object instead of all.
        name: Option<String>,
        /// How to print.
        output: OutputFormat,
    },
    /// `get jails|services|nodes [NAME] -w`: the listing, then a row for
    /// each object an event names as it happens.
    Watch {
        /// What to list.
        resource: Resource,
        /// One object instead of all.
        name: Option<String>,
        /// How to print.
        output: OutputFormat,
    },
    /// `delete jail NAME...`.
    DeleteJails {
        /// Jails to delete, in the order given.
        names: Vec<String>,
    },
    /// `delete service NAME...`.
    DeleteServices {
        /// Services to delete, in the order given.
        names: Vec<String>,
    },
    /// `delete ingress NAME...`.
    DeleteIngresses {
        /// Ingresses to delete, in the order given.
        names: Vec<String>,
    },
    /// `logs NAME [--tail N]`: the end of what the jail's workload printed.
    Logs {
        /// The jail.
        name: String,
        /// Lines; `None` for the agent's default.
        tail: Option<usize>,
        /// `-f, --follow`: keep printing new lines.
        follow: bool,
    },
    /// `cordon NAME...` (`cordoned`) or `uncordon NAME...`: nothing new is
    /// placed on those nodes, or again (with a control plane).
    Cordon {
        /// Nodes, in the order given.
        names: Vec<String>,
        /// Cordon (true) or lift it (false).
        cordoned: bool,
    },
    /// `delete node NAME...`: forget Dead nodes (with a control plane).
    DeleteNodes {
        /// Nodes to delete, in the order given.
        names: Vec<String>,
    },
    /// `delete-volume NAME [--yes]`.
    DeleteVolume {
        /// The volume.
        name: String,
        /// `--yes`: do not ask, even on a terminal.
        yes: bool,
    },
    /// `delete -f FILE|-`.
    DeleteFile {
        /// The spec file whose jails, services and ingresses are deleted.
        input: Input,
    },
    /// `validate -f FILE|-`.
    Validate {
        /// The spec file.
        input: Input,
    },
    /// `base fetch RELEASE`: download, verify and install a release base on
    /// one node, waiting until it is ready.
    BaseFetch {
        /// The release (`14.5-RELEASE`).
        release: String,
    },
    /// `scale service NAME --replicas N`.
    Scale {
        /// The service.
        name: String,
        /// The desired count.
        replicas: u32,
    },
    /// `rollout status service NAME [--timeout D]`: waits for the rollout.
    RolloutStatus {
        /// The service.
        name: String,
        /// How long to wait.
        timeout: std::time::Duration,
    },
    /// `rollout history service NAME`.
    RolloutHistory {
        /// The service.
        name: String,
    },
    /// `rollout undo service NAME [--to-revision N]`.
    RolloutUndo {
        /// The service.
        name: String,
        /// The revision to go back to; `None` for the one before the current.
        to: Option<u64>,
    },
    /// `describe jail|service|node|volume|ingress NAME`.
    Describe {
        /// What kind of object.
        resource: Resource,
        /// Its name.
        name: String,
    },
    /// `config ...`.
    Config(ConfigCommand),
    /// `completion sh|zsh|fish`.
    Completion {
        /// The shell.
        shell: Shell,
    },
    /// `version [--client]`.
    Version {
        /// `--client`: no daemon is asked.
        client_only: bool,
    },
    /// `key generate [--id ID] PATH`.
    KeyGenerate {
        /// `--id`; `None` means PATH's file name without `.key`.
        id: Option<String>,
        /// Where the new key file goes (it must not exist).
        path: PathBuf,
    },
    /// `apply --dry-run -f FILE|- [-o text|json]`.
    DryRun {
        /// The spec file.
        input: Input,
        /// Text ([`OutputFormat::Table`]) or JSON.
        output: OutputFormat,
    },
    /// `diff -f FILE|- [-o text|json]`.
    Diff {
        /// The spec file.
        input: Input,
        /// Text ([`OutputFormat::Table`]) or JSON.
        output: OutputFormat,
    },
    /// `get events [--for KIND/NAME] [-w] [-o FORMAT]`.
    GetEvents {
        /// `--for`: only the events about this object.
        object: Option<ObjectRef>,
        /// `-w, --watch`: keep printing new events.
        watch: bool,
        /// How to print.
        output: OutputFormat,
    },
}

/// A parsed command line that runs something.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// Global flags.
    pub global: GlobalOptions,
    /// The command.
    pub command: Command,
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// Run a command.
    Run(Invocation),
    /// `--help` or `help`: print [`help_text`].
    Help,
    /// `COMMAND --help` or `help COMMAND`: print [`command_help`] of this
    /// command word (one of [`verbs`]).
    HelpFor(String),
    /// `--version`: print [`version_text`].
    Version,
}

/// A command line keelctl cannot make sense of; the message says what to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

fn usage(message: impl Into<String>) -> UsageError {
    UsageError(message.into())
}

/// `--help`: usage forms, commands, flags and exit statuses.
pub fn help_text() -> String {
    let mut out = format!(
        "keelctl {}: apply, inspect and delete Keel jails, services and ingresses\n\n\
         Usage: keelctl [OPTIONS] COMMAND\n\nCommands:\n",
        env!("CARGO_PKG_VERSION")
    );
    out.push_str(&command_lines(COMMANDS.iter()));
    out.push_str("\nOptions (before or after the command):\n");
    out.push_str(&flag_lines(FLAGS.iter()));
    out.push_str(
        "\nWhere requests go, first match wins: --socket, --controlplane or --context,\n\
         $KEEL_CONTROLPLANE, $KEEL_SOCKET, the current-context of ~/.config/keel/config.toml,\n\
         ctl.controlplane, agent.socket (keel.toml).\n\
         \nExit status: 0 success, 1 request failed (daemon unreachable or refused) or a \
         listing left out a node it could not reach, 2 usage or validation error; `diff`: \
         0 no difference, 1 some, 2 any error.\n",
    );
    out
}

/// `help VERB`, `VERB --help`: the usage lines of `VERB` from [`COMMANDS`] and
/// the flags it takes; `None` for a word that is not a command.
pub fn command_help(verb: &str) -> Option<String> {
    let forms: Vec<_> = COMMANDS
        .iter()
        .filter(|(form, _)| form.split(' ').next() == Some(verb))
        .collect();
    if forms.is_empty() {
        return None;
    }
    let mut out = String::from("Usage:\n");
    out.push_str(&command_lines(forms.into_iter()));
    out.push_str("\nOptions (before or after the command):\n");
    out.push_str(&flag_lines(FLAGS.iter().filter(|f| applies_to(f.id, verb))));
    out.push_str(
        "\n`keelctl --help` lists every command, where requests go and the exit status.\n",
    );
    Some(out)
}

/// `  FORM  what it does` lines, aligned.
fn command_lines<'a>(forms: impl Iterator<Item = &'a (&'static str, &'static str)>) -> String {
    let forms: Vec<_> = forms.collect();
    let width = forms.iter().map(|(u, _)| u.len()).max().unwrap_or(0);
    forms
        .iter()
        .map(|(form, help)| format!("  {form:width$}  {help}\n"))
        .collect()
}

/// `  -f, --filename FILE  what it is` lines, aligned.
fn flag_lines<'a>(flags: impl Iterator<Item = &'a Flag>) -> String {
    let left = |flag: &Flag| {
        let short = flag.short.map_or("    ".to_string(), |c| format!("-{c}, "));
        let value = flag.value.map_or(String::new(), |v| format!(" {v}"));
        format!("{short}--{}{value}", flag.long)
    };
    let flags: Vec<_> = flags.collect();
    let width = flags.iter().map(|f| left(f).len()).max().unwrap_or(0);
    flags
        .iter()
        .map(|flag| format!("  {:width$}  {}\n", left(flag), flag.help))
        .collect()
}

/// `--version`.
pub fn version_text() -> String {
    format!("keelctl {}\n", env!("CARGO_PKG_VERSION"))
}

/// Flags seen on the command line, before they are checked against the command.
#[derive(Default, PartialEq)]
struct Seen {
    filename: Option<OsString>,
    output: Option<String>,
    id: Option<String>,
    tail: Option<String>,
    replicas: Option<String>,
    timeout: Option<String>,
    to_revision: Option<String>,
    yes: bool,
    follow: bool,
    client: bool,
    dry_run: bool,
    object: Option<String>,
    watch: bool,
    global: GlobalOptions,
}

/// Parses keelctl's arguments (without the program name).
pub fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Parsed, UsageError> {
    use lexopt::prelude::*;
    let lex = |e: lexopt::Error| usage(e.to_string());
    let mut parser = lexopt::Parser::from_args(args);
    let mut seen = Seen::default();
    let mut words: Vec<String> = Vec::new();
    while let Some(arg) = parser.next().map_err(lex)? {
        let flag = match &arg {
            Short(c) => FLAGS.iter().find(|f| f.short == Some(*c)),
            Long(name) => FLAGS.iter().find(|f| f.long == *name),
            Value(word) => {
                let word = word
                    .clone()
                    .into_string()
                    .map_err(|w| usage(format!("argument {w:?} is not valid UTF-8")))?;
                words.push(word);
                continue;
            }
        };
        let Some(flag) = flag else {
            return Err(usage(arg.unexpected().to_string()));
        };
        let twice = || usage(format!("--{} given twice", flag.long));
        match flag.id {
            // `keelctl rollout --help`: that command's help, when the
            // first word is one; the whole help otherwise.
            FlagId::Help => {
                return Ok(match words.first() {
                    Some(verb) if command_help(verb).is_some() => Parsed::HelpFor(verb.clone()),
                    _ => Parsed::Help,
                });
            }
            FlagId::Version => return Ok(Parsed::Version),
            // kubectl's `logs -f`: after `logs`, -f follows (a log has no
            // file to name).
            FlagId::Filename
                if matches!(arg, Short('f'))
                    && words.first().map(String::as_str) == Some("logs") =>
            {
                if std::mem::replace(&mut seen.follow, true) {
                    return Err(usage("--follow given twice"));
                }
            }
            FlagId::Follow => {
                if std::mem::replace(&mut seen.follow, true) {
                    return Err(twice());
                }
            }
            FlagId::Filename => {
                let v = parser.value().map_err(lex)?;
                if seen.filename.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::Output => {
                let v = parser.value().map_err(lex)?.string().map_err(|_| {
                    usage("--output: the format is not valid UTF-8; use table, json or yaml")
                })?;
                if seen.output.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::Socket => {
                let v = PathBuf::from(parser.value().map_err(lex)?);
                if seen.global.socket.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::Config => {
                let v = PathBuf::from(parser.value().map_err(lex)?);
                if seen.global.config.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::KeyFile => {
                let v = PathBuf::from(parser.value().map_err(lex)?);
                if seen.global.key_file.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::ControlPlane => {
                let v = utf8_value(&mut parser, flag)?;
                if seen.global.controlplane.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::Node => {
                let v = utf8_value(&mut parser, flag)?;
                // The id becomes a request path, like a jail name.
                spec::validate_name(&v).map_err(|why| usage(format!("--node {v:?}: {why}")))?;
                if seen.global.node.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::Id => {
                let v = utf8_value(&mut parser, flag)?;
                if seen.id.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::Tail => {
                let v = utf8_value(&mut parser, flag)?;
                if seen.tail.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::Replicas => {
                let v = utf8_value(&mut parser, flag)?;
                if seen.replicas.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::Timeout => {
                let v = utf8_value(&mut parser, flag)?;
                if seen.timeout.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::ToRevision => {
                let v = utf8_value(&mut parser, flag)?;
                if seen.to_revision.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::For => {
                let v = utf8_value(&mut parser, flag)?;
                if seen.object.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::Watch => {
                if std::mem::replace(&mut seen.watch, true) {
                    return Err(twice());
                }
            }
            FlagId::Yes => {
                if std::mem::replace(&mut seen.yes, true) {
                    return Err(twice());
                }
            }
            FlagId::Client => {
                if std::mem::replace(&mut seen.client, true) {
                    return Err(twice());
                }
            }
            FlagId::Context => {
                let v = utf8_value(&mut parser, flag)?;
                crate::ctl::contexts::check_name(&v)
                    .map_err(|why| usage(format!("--context: {why}")))?;
                if seen.global.context.replace(v).is_some() {
                    return Err(twice());
                }
            }
            FlagId::DryRun => {
                if std::mem::replace(&mut seen.dry_run, true) {
                    return Err(twice());
                }
            }
        }
    }
    if let Some(("help", rest)) = words.split_first().map(|(v, r)| (v.as_str(), r)) {
        if seen != Seen::default() {
            return Err(usage("`help` takes no options: keelctl help [COMMAND]"));
        }
        return match rest {
            [] => Ok(Parsed::Help),
            [verb] if command_help(verb).is_some() => Ok(Parsed::HelpFor(verb.clone())),
            [verb] => Err(usage(format!(
                "`help {verb}`: unknown command {verb:?}; use {}",
                verb_list()
            ))),
            [_, word, ..] => Err(usage(format!("unexpected argument {word:?} for `help`"))),
        };
    }
    let command = command(&words, &mut seen)?;
    Ok(Parsed::Run(Invocation {
        global: seen.global,
        command,
    }))
}

/// The `-o` of `diff` and `apply --dry-run`: text (the default) or json.
fn plan_format(output: Option<&str>) -> Result<OutputFormat, UsageError> {
    match output {
        None | Some("text") | Some("table") => Ok(OutputFormat::Table),
        Some("json") => Ok(OutputFormat::Json),
        Some(other) => Err(usage(format!(
            "--output {other:?} is not a format for a diff; use text or json"
        ))),
    }
}

fn utf8_value(parser: &mut lexopt::Parser, flag: &Flag) -> Result<String, UsageError> {
    parser
        .value()
        .map_err(|e| usage(e.to_string()))?
        .into_string()
        .map_err(|v| usage(format!("--{}: {v:?} is not valid UTF-8", flag.long)))
}

/// Refuses `-f` and `--node` for a service command: the control plane
/// knows the service and places its replicas.
fn no_file_or_node(filename: bool, seen: &Seen) -> Result<(), UsageError> {
    if filename {
        return Err(usage(
            "--filename does not apply here: the command names the service",
        ));
    }
    if seen.global.node.is_some() {
        return Err(usage(
            "--node does not apply to services: the control plane places their replicas",
        ));
    }
    Ok(())
}

/// The NAME of `WHAT service NAME`.
fn service_word(what: &str, rest: &[String]) -> Result<String, UsageError> {
    let is_service = |k: &str| matches!(k, "service" | "services" | "svc");
    match rest {
        [kind, ..] if !is_service(kind) => Err(usage(format!(
            "`{what}` works on services: {what} service NAME"
        ))),
        [] | [_] => Err(usage(format!("`{what}` needs service NAME"))),
        [_, name] => object_name("service", name),
        [_, _, word, ..] => Err(usage(format!("unexpected argument {word:?} for `{what}`"))),
    }
}

/// Turns the command words and the flags seen into a [`Command`], refusing
/// flags the command does not use.
fn command(words: &[String], seen: &mut Seen) -> Result<Command, UsageError> {
    let Some((verb, rest)) = words.split_first() else {
        return Err(usage(format!("no command given; use {}", verb_list())));
    };
    let not_for = |flag: &str| usage(format!("{flag} does not apply to `{verb}`"));
    let filename = seen.filename.take();
    let output = seen.output.take();
    let dry_run = std::mem::take(&mut seen.dry_run);
    if dry_run && verb != "apply" {
        return Err(not_for("--dry-run"));
    }
    let shows_plan = dry_run || verb == "diff";
    if output.is_some() && verb != "get" && !shows_plan {
        return Err(if verb == "apply" {
            usage("--output applies to `apply` only with --dry-run")
        } else {
            not_for("--output")
        });
    }
    let tail = match seen.tail.take() {
        Some(_) if verb != "logs" => return Err(not_for("--tail")),
        Some(v) => Some(
            crate::common::wire::parse_tail_query(Some(&format!("tail={v}")))
                .map_err(|why| usage(format!("--tail: {why}")))?,
        ),
        None => None,
    };
    let id = seen.id.take();
    if id.is_some() && verb != "key" {
        return Err(not_for("--id"));
    }
    let replicas = seen.replicas.take();
    if replicas.is_some() && verb != "scale" {
        return Err(not_for("--replicas"));
    }
    let timeout = seen.timeout.take();
    let to_revision = seen.to_revision.take();
    if (timeout.is_some() || to_revision.is_some()) && verb != "rollout" {
        return Err(not_for(if timeout.is_some() {
            "--timeout"
        } else {
            "--to-revision"
        }));
    }
    let follow = std::mem::take(&mut seen.follow);
    if follow && verb != "logs" {
        return Err(not_for("--follow"));
    }
    let yes = std::mem::take(&mut seen.yes);
    if yes && verb != "delete-volume" {
        return Err(not_for("--yes"));
    }
    let client = std::mem::take(&mut seen.client);
    if client && verb != "version" {
        return Err(not_for("--client"));
    }
    let object = seen.object.take();
    let watch = std::mem::take(&mut seen.watch);
    let events = verb == "get"
        && matches!(
            rest.first().map(String::as_str),
            Some("events" | "event" | "ev")
        );
    if !events && object.is_some() {
        return Err(usage("--for applies to `get events` only"));
    }
    let watchable = verb == "get"
        && matches!(
            rest.first().map(|k| resource(k)),
            Some(Ok(Resource::Jails | Resource::Services | Resource::Nodes))
        );
    if !events && !watchable && watch {
        return Err(usage(
            "--watch applies to `get events`, `get jails`, `get services` and `get nodes`",
        ));
    }
    let extra = |word: &String| usage(format!("unexpected argument {word:?} for `{verb}`"));
    let file_only = |filename: Option<OsString>| -> Result<Input, UsageError> {
        if let Some(word) = rest.first() {
            return Err(extra(word));
        }
        match filename {
            Some(f) => Ok(input(f)),
            None => Err(usage(format!("`{verb}` needs -f FILE (or -f - for stdin)"))),
        }
    };
    match verb.as_str() {
        "apply" if dry_run => Ok(Command::DryRun {
            input: file_only(filename)?,
            output: plan_format(output.as_deref())?,
        }),
        "apply" => Ok(Command::Apply {
            input: file_only(filename)?,
        }),
        "diff" => Ok(Command::Diff {
            input: file_only(filename)?,
            output: plan_format(output.as_deref())?,
        }),
        "validate" => Ok(Command::Validate {
            input: file_only(filename)?,
        }),
        "get" => {
            if filename.is_some() {
                return Err(not_for("--filename"));
            }
            let Some((kind, names)) = rest.split_first() else {
                return Err(usage(
                    "`get` needs what to list: get jails [NAME], get services [NAME], get volumes [NAME], get ingresses [NAME], get bases [RELEASE] or get nodes",
                ));
            };
            let output = match output.as_deref() {
                None | Some("table") => OutputFormat::Table,
                Some("json") => OutputFormat::Json,
                Some("yaml") => OutputFormat::Yaml,
                Some("wide") if !events && matches!(resource(kind), Ok(Resource::Jails)) => {
                    OutputFormat::Wide
                }
                Some("wide") => {
                    return Err(usage(
                        "--output wide applies to `get jails` only; use table, json or yaml",
                    ));
                }
                Some(other) => {
                    return Err(usage(format!(
                        "--output {other:?} is not a format; use table, json, yaml or (get jails) wide"
                    )));
                }
            };
            if events {
                if let Some(word) = names.first() {
                    return Err(usage(format!(
                        "unexpected argument {word:?} for `get events`; name the object with --for KIND/NAME"
                    )));
                }
                let object = object
                    .map(|o| ObjectRef::parse(&o).map_err(|why| usage(format!("--for: {why}"))))
                    .transpose()?;
                return Ok(Command::GetEvents {
                    object,
                    watch,
                    output,
                });
            }
            let resource = resource(kind)?;
            if let Some(word) = names.get(1) {
                return Err(extra(word));
            }
            let name = match resource {
                Resource::Jails => names.first().map(|n| object_name("jail", n)).transpose()?,
                Resource::Services => {
                    if seen.global.node.is_some() {
                        return Err(usage(
                            "--node does not apply to services: the control plane places their replicas",
                        ));
                    }
                    names
                        .first()
                        .map(|n| object_name("service", n))
                        .transpose()?
                }
                Resource::Volumes => names
                    .first()
                    .map(|n| object_name("volume", n))
                    .transpose()?,
                Resource::Ingresses => names
                    .first()
                    .map(|n| object_name("ingress", n))
                    .transpose()?,
                Resource::Bases => names.first().map(|n| release_name(n)).transpose()?,
                Resource::Nodes => {
                    if seen.global.node.is_some() {
                        return Err(usage(
                            "--node does not apply to `get nodes`: name the node after it",
                        ));
                    }
                    names.first().map(|n| object_name("node", n)).transpose()?
                }
            };
            if watch {
                return Ok(Command::Watch {
                    resource,
                    name,
                    output,
                });
            }
            Ok(Command::Get {
                resource,
                name,
                output,
            })
        }
        "delete" => match filename {
            Some(f) => match rest.first() {
                Some(word) => Err(usage(format!(
                    "unexpected argument {word:?}: `delete` takes either -f FILE or jail NAME..., not both"
                ))),
                None => Ok(Command::DeleteFile { input: input(f) }),
            },
            None => {
                let Some((kind, names)) = rest.split_first() else {
                    return Err(usage(
                        "`delete` needs jail NAME..., service NAME..., ingress NAME... or -f FILE (or -f - for stdin)",
                    ));
                };
                let resource = resource(kind)?;
                if names.is_empty() {
                    return Err(usage(format!("`delete {kind}` needs at least one NAME")));
                }
                match resource {
                    Resource::Jails => Ok(Command::DeleteJails {
                        names: names
                            .iter()
                            .map(|n| object_name("jail", n))
                            .collect::<Result<_, _>>()?,
                    }),
                    Resource::Services => {
                        if seen.global.node.is_some() {
                            return Err(usage(
                                "--node does not apply to services: the control plane removes every replica",
                            ));
                        }
                        Ok(Command::DeleteServices {
                            names: names
                                .iter()
                                .map(|n| object_name("service", n))
                                .collect::<Result<_, _>>()?,
                        })
                    }
                    Resource::Ingresses => Ok(Command::DeleteIngresses {
                        names: names
                            .iter()
                            .map(|n| object_name("ingress", n))
                            .collect::<Result<_, _>>()?,
                    }),
                    Resource::Nodes => {
                        if seen.global.node.is_some() {
                            return Err(usage(
                                "--node does not apply to `delete node`: name the nodes after it",
                            ));
                        }
                        Ok(Command::DeleteNodes {
                            names: names
                                .iter()
                                .map(|n| object_name("node", n))
                                .collect::<Result<_, _>>()?,
                        })
                    }
                    Resource::Volumes => Err(usage(
                        "volumes are deleted one at a time with `delete-volume NAME`: their data goes with them",
                    )),
                    Resource::Bases => Err(usage(
                        "keelctl does not delete bases: jails are clones of them; `zfs destroy -r` one by hand once no jail uses it",
                    )),
                }
            }
        },
        "logs" => {
            if filename.is_some() {
                return Err(not_for("--filename"));
            }
            match rest {
                [name] => Ok(Command::Logs {
                    name: object_name("jail", name)?,
                    tail,
                    follow,
                }),
                [] => Err(usage("`logs` needs the NAME of the jail")),
                [_, word, ..] => Err(extra(word)),
            }
        }
        "cordon" | "uncordon" => {
            if filename.is_some() {
                return Err(not_for("--filename"));
            }
            if seen.global.node.is_some() {
                return Err(not_for("--node"));
            }
            if rest.is_empty() {
                return Err(usage(format!("`{verb}` needs at least one node NAME")));
            }
            Ok(Command::Cordon {
                names: rest
                    .iter()
                    .map(|n| object_name("node", n))
                    .collect::<Result<_, _>>()?,
                cordoned: verb == "cordon",
            })
        }
        "delete-volume" => {
            if filename.is_some() {
                return Err(not_for("--filename"));
            }
            match rest {
                [name] => Ok(Command::DeleteVolume {
                    name: object_name("volume", name)?,
                    yes,
                }),
                [] => Err(usage("`delete-volume` needs the NAME of the volume")),
                [_, word, ..] => Err(extra(word)),
            }
        }
        "base" => {
            if filename.is_some() {
                return Err(not_for("--filename"));
            }
            match rest {
                [sub, release] if sub == "fetch" => Ok(Command::BaseFetch {
                    release: release_name(release)?,
                }),
                [sub] if sub == "fetch" => Err(usage(
                    "`base fetch` needs the RELEASE to fetch (e.g. 14.5-RELEASE)",
                )),
                [sub, _, word, ..] if sub == "fetch" => Err(extra(word)),
                _ => Err(usage("`base` knows one command: base fetch RELEASE")),
            }
        }
        "scale" => {
            no_file_or_node(filename.is_some(), seen)?;
            let name = service_word(verb, rest)?;
            let Some(replicas) = replicas else {
                return Err(usage("`scale` needs --replicas N"));
            };
            let replicas = replicas.parse::<u32>().map_err(|_| {
                usage(format!(
                    "--replicas {replicas:?}: not a number of replicas; use 0 to {}",
                    spec::MAX_REPLICAS
                ))
            })?;
            if replicas > spec::MAX_REPLICAS {
                return Err(usage(format!(
                    "--replicas {replicas}: at most {}",
                    spec::MAX_REPLICAS
                )));
            }
            Ok(Command::Scale { name, replicas })
        }
        "rollout" => {
            no_file_or_node(filename.is_some(), seen)?;
            let Some((sub, rest)) = rest.split_first() else {
                return Err(usage(
                    "`rollout` needs status, history or undo, e.g. rollout status service web",
                ));
            };
            if !matches!(sub.as_str(), "status" | "history" | "undo") {
                return Err(usage(format!(
                    "`rollout {sub}` is not a command; use rollout status, rollout history or rollout undo"
                )));
            }
            let name = service_word(&format!("rollout {sub}"), rest)?;
            let only = |given: bool, long: &str, for_sub: &str| {
                if given && sub != for_sub {
                    Err(usage(format!("{long} does not apply to `rollout {sub}`")))
                } else {
                    Ok(())
                }
            };
            only(timeout.is_some(), "--timeout", "status")?;
            only(to_revision.is_some(), "--to-revision", "undo")?;
            match sub.as_str() {
                "status" => {
                    let timeout = match timeout {
                        None => std::time::Duration::from_secs(300),
                        Some(t) => {
                            t.parse::<crate::common::config::Interval>()
                                .map_err(|e| usage(format!("--timeout: {e}")))?
                                .0
                        }
                    };
                    Ok(Command::RolloutStatus { name, timeout })
                }
                "history" => Ok(Command::RolloutHistory { name }),
                "undo" => {
                    let to = to_revision
                        .map(|v| {
                            v.parse::<u64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                                usage(format!(
                                    "--to-revision {v:?}: not a revision number (see `rollout history`)"
                                ))
                            })
                        })
                        .transpose()?;
                    Ok(Command::RolloutUndo { name, to })
                }
                _ => unreachable!("checked above"),
            }
        }
        "key" => {
            if filename.is_some() {
                return Err(not_for("--filename"));
            }
            for (given, flag) in [
                (seen.global.node.is_some(), "--node"),
                (seen.global.key_file.is_some(), "--key-file"),
            ] {
                if given {
                    return Err(not_for(flag));
                }
            }
            match rest {
                [sub, path] if sub == "generate" => Ok(Command::KeyGenerate {
                    id,
                    path: PathBuf::from(path),
                }),
                [sub] if sub == "generate" => {
                    Err(usage("`key generate` needs the PATH of the new key file"))
                }
                [sub, _, word, ..] if sub == "generate" => Err(extra(word)),
                _ => Err(usage(
                    "`key` knows one command: key generate [--id ID] PATH",
                )),
            }
        }
        "describe" => {
            if filename.is_some() {
                return Err(not_for("--filename"));
            }
            let (kind, name) = match rest {
                [kind, name] => (kind, name),
                [] | [_] => {
                    return Err(usage(
                        "`describe` needs the kind and NAME, e.g. describe jail web-1",
                    ));
                }
                [_, _, word, ..] => return Err(extra(word)),
            };
            let resource = resource(kind)?;
            let name = match resource {
                Resource::Jails => object_name("jail", name)?,
                Resource::Services => object_name("service", name)?,
                Resource::Nodes => object_name("node", name)?,
                Resource::Volumes => object_name("volume", name)?,
                Resource::Ingresses => object_name("ingress", name)?,
                Resource::Bases => {
                    return Err(usage(
                        "bases are not described: `get bases RELEASE` shows everything known of one",
                    ));
                }
            };
            if matches!(resource, Resource::Services | Resource::Nodes)
                && seen.global.node.is_some()
            {
                return Err(usage(format!(
                    "--node does not apply to `describe {kind}`: the control plane answers for it"
                )));
            }
            Ok(Command::Describe { resource, name })
        }
        "version" => {
            no_file_or_node_for(verb, filename.is_some(), seen)?;
            match rest.first() {
                Some(word) => Err(extra(word)),
                None => Ok(Command::Version {
                    client_only: client,
                }),
            }
        }
        "completion" => {
            no_file_or_node_for(verb, filename.is_some(), seen)?;
            only_words(verb, seen)?;
            let shell = match rest {
                [shell] => match shell.as_str() {
                    "sh" | "bash" => Shell::Sh,
                    "zsh" => Shell::Zsh,
                    "fish" => Shell::Fish,
                    other => {
                        return Err(usage(format!(
                            "`completion {other}`: keelctl writes completion for sh, zsh and fish"
                        )));
                    }
                },
                [] => return Err(usage("`completion` needs the shell: sh, zsh or fish")),
                [_, word, ..] => return Err(extra(word)),
            };
            Ok(Command::Completion { shell })
        }
        "config" => {
            no_file_or_node_for(verb, filename.is_some(), seen)?;
            config_command(rest, seen)
        }
        other => Err(usage(format!(
            "unknown command {other:?}; use {}",
            verb_list()
        ))),
    }
}

/// `config SUB ...`; `set-context` alone takes where requests go.
fn config_command(rest: &[String], seen: &Seen) -> Result<Command, UsageError> {
    let Some((sub, args)) = rest.split_first() else {
        return Err(usage(
            "`config` needs get-contexts, current-context, use-context, set-context or delete-context",
        ));
    };
    let g = &seen.global;
    let target_given = g.controlplane.is_some() || g.socket.is_some() || g.key_file.is_some();
    if sub != "set-context" && target_given {
        return Err(usage(format!(
            "`config {sub}` takes no --controlplane, --socket or --key-file; `config set-context` records them"
        )));
    }
    if g.config.is_some() || g.context.is_some() {
        return Err(usage(
            "`config` commands act on ~/.config/keel/config.toml: --config and --context do not apply",
        ));
    }
    let named = |what: &str| -> Result<String, UsageError> {
        match args {
            [name] => {
                crate::ctl::contexts::check_name(name)
                    .map_err(|why| usage(format!("`config {sub}`: {why}")))?;
                Ok(name.clone())
            }
            [] => Err(usage(format!(
                "`config {sub}` needs the NAME of the context{what}"
            ))),
            [_, word, ..] => Err(usage(format!(
                "unexpected argument {word:?} for `config {sub}`"
            ))),
        }
    };
    let none = || match args.first() {
        Some(word) => Err(usage(format!(
            "unexpected argument {word:?} for `config {sub}`"
        ))),
        None => Ok(()),
    };
    let command = match sub.as_str() {
        "get-contexts" => {
            none()?;
            ConfigCommand::GetContexts
        }
        "current-context" => {
            none()?;
            ConfigCommand::CurrentContext
        }
        "use-context" => ConfigCommand::UseContext { name: named("")? },
        "delete-context" => ConfigCommand::DeleteContext { name: named("")? },
        "set-context" => {
            let name = named(", then --controlplane HOST:PORT [--key-file PATH] or --socket PATH")?;
            match (&g.controlplane, &g.socket) {
                (Some(_), Some(_)) => {
                    return Err(usage(
                        "`config set-context`: a context is --controlplane or --socket, not both",
                    ));
                }
                (None, None) => {
                    return Err(usage(
                        "`config set-context` needs --controlplane HOST:PORT [--key-file PATH] or --socket PATH",
                    ));
                }
                (None, Some(_)) if g.key_file.is_some() => {
                    return Err(usage(
                        "`config set-context`: --key-file goes with --controlplane; an agent's socket takes no key",
                    ));
                }
                _ => {}
            }
            ConfigCommand::SetContext { name }
        }
        other => {
            return Err(usage(format!(
                "`config {other}` is not a command; use get-contexts, current-context, use-context, set-context or delete-context"
            )));
        }
    };
    Ok(Command::Config(command))
}

/// `verb` names no file and no node.
fn no_file_or_node_for(verb: &str, filename: bool, seen: &Seen) -> Result<(), UsageError> {
    for (given, flag) in [
        (filename, "--filename"),
        (seen.global.node.is_some(), "--node"),
    ] {
        if given {
            return Err(usage(format!("{flag} does not apply to `{verb}`")));
        }
    }
    Ok(())
}

/// `verb` takes no flag that says where requests go.
fn only_words(verb: &str, seen: &Seen) -> Result<(), UsageError> {
    let g = &seen.global;
    for (given, flag) in [
        (g.socket.is_some(), "--socket"),
        (g.controlplane.is_some(), "--controlplane"),
        (g.key_file.is_some(), "--key-file"),
        (g.config.is_some(), "--config"),
        (g.context.is_some(), "--context"),
    ] {
        if given {
            return Err(usage(format!("{flag} does not apply to `{verb}`")));
        }
    }
    Ok(())
}

fn input(f: OsString) -> Input {
    if f == "-" {
        Input::Stdin
    } else {
        Input::File(PathBuf::from(f))
    }
}

fn resource(word: &str) -> Result<Resource, UsageError> {
    match word {
        "jails" | "jail" => Ok(Resource::Jails),
        "nodes" | "node" => Ok(Resource::Nodes),
        "services" | "service" | "svc" => Ok(Resource::Services),
        "volumes" | "volume" | "vol" => Ok(Resource::Volumes),
        "ingresses" | "ingress" | "ing" => Ok(Resource::Ingresses),
        "bases" | "base" => Ok(Resource::Bases),
        other => Err(usage(format!(
            "unknown resource {other:?}; keelctl knows jails, services, nodes, volumes, ingresses, bases and events"
        ))),
    }
}

/// A release name, checked here because it becomes a request path and the
/// dataset `{pool}/keel/bases/RELEASE`.
fn release_name(release: &str) -> Result<String, UsageError> {
    spec::validate_base(release)
        .map(|()| release.to_string())
        .map_err(|why| usage(format!("release {release:?}: {why}")))
}

/// The name of a `kind` of object (jail, service, volume, ingress, node),
/// checked here because it becomes a request path: a name that is not a DNS
/// label could never exist, and must not reach the URL.
fn object_name(kind: &str, name: &str) -> Result<String, UsageError> {
    spec::validate_name(name)
        .map(|()| name.to_string())
        .map_err(|why| usage(format!("{kind} name {name:?}: {why}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Parsed, UsageError> {
        parse_args(args.iter().map(OsString::from))
    }

    #[test]
    fn dry_run_and_diff_take_a_file_and_text_or_json() {
        let file = |f: &str| Input::File(PathBuf::from(f));
        assert_eq!(
            run(&["apply", "--dry-run", "-f", "web.yaml"]).command,
            Command::DryRun {
                input: file("web.yaml"),
                output: OutputFormat::Table
            }
        );
        assert_eq!(
            run(&["diff", "-f", "web.yaml", "-o", "json"]).command,
            Command::Diff {
                input: file("web.yaml"),
                output: OutputFormat::Json
            }
        );
        let err = |args: &[&str]| parse(args).expect_err("refused").0;
        assert!(err(&["apply", "-f", "a", "-o", "json"]).contains("only with --dry-run"));
        assert!(err(&["diff", "-f", "a", "-o", "yaml"]).contains("use text or json"));
        assert!(err(&["get", "jails", "--dry-run"]).contains("--dry-run does not apply"));
        assert!(err(&["diff"]).contains("needs -f FILE"));
        assert!(err(&["apply", "--dry-run", "--dry-run", "-f", "a"]).contains("twice"));
    }

    fn run(args: &[&str]) -> Invocation {
        match parse(args) {
            Ok(Parsed::Run(inv)) => inv,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    fn cmd(args: &[&str]) -> Command {
        run(args).command
    }

    fn err(args: &[&str]) -> String {
        match parse(args) {
            Err(e) => e.0,
            Ok(other) => panic!("{args:?} parsed: {other:?}"),
        }
    }

    #[test]
    fn apply_and_validate_read_a_file_or_stdin() {
        assert_eq!(
            cmd(&["apply", "-f", "web.yaml"]),
            Command::Apply {
                input: Input::File("web.yaml".into())
            }
        );
        assert_eq!(
            cmd(&["apply", "--filename=-"]),
            Command::Apply {
                input: Input::Stdin
            }
        );
        assert_eq!(
            cmd(&["-f", "-", "validate"]),
            Command::Validate {
                input: Input::Stdin
            }
        );
        assert!(err(&["apply"]).contains("needs -f FILE"));
        assert!(err(&["apply", "-f", "a", "-f", "b"]).contains("--filename given twice"));
        assert!(err(&["apply", "-f", "a", "extra"]).contains("\"extra\""));
    }

    #[test]
    fn get_takes_a_resource_an_optional_name_and_a_format() {
        assert_eq!(
            cmd(&["get", "jails"]),
            Command::Get {
                resource: Resource::Jails,
                name: None,
                output: OutputFormat::Table
            }
        );
        assert_eq!(
            cmd(&["-o", "json", "get", "jail", "web-1"]),
            Command::Get {
                resource: Resource::Jails,
                name: Some("web-1".into()),
                output: OutputFormat::Json
            }
        );
        assert_eq!(
            cmd(&["get", "jails", "--output=yaml"]),
            Command::Get {
                resource: Resource::Jails,
                name: None,
                output: OutputFormat::Yaml
            }
        );
        assert!(err(&["get"]).contains("get jails"));
        assert!(err(&["get", "disks"]).contains("unknown resource \"disks\""));
        assert!(err(&["get", "jails", "-o", "xml"]).contains("use table, json, yaml"));
        assert!(err(&["get", "nodes", "-o", "wide"]).contains("applies to `get jails` only"));
        assert_eq!(
            cmd(&["get", "jails", "-o", "wide"]),
            Command::Get {
                resource: Resource::Jails,
                name: None,
                output: OutputFormat::Wide,
            }
        );
        assert!(err(&["get", "jails", "a", "b"]).contains("\"b\""));
        assert!(err(&["get", "jails", "-f", "x"]).contains("--filename does not apply"));
    }

    #[test]
    fn names_that_are_not_dns_labels_never_reach_a_request() {
        assert!(err(&["get", "jails", "../healthz"]).contains("jail name \"../healthz\""));
        assert!(err(&["delete", "jail", "Web_1"]).contains("jail name \"Web_1\""));
    }

    #[test]
    fn delete_takes_names_or_a_file_but_not_both() {
        assert_eq!(
            cmd(&["delete", "jail", "a", "b"]),
            Command::DeleteJails {
                names: vec!["a".into(), "b".into()]
            }
        );
        assert_eq!(
            cmd(&["delete", "-f", "x.yaml"]),
            Command::DeleteFile {
                input: Input::File("x.yaml".into())
            }
        );
        assert!(err(&["delete", "jail"]).contains("at least one NAME"));
        assert!(
            err(&["delete"]).contains("jail NAME..., service NAME..., ingress NAME... or -f FILE")
        );
        assert!(err(&["delete", "jail", "a", "-f", "x"]).contains("not both"));
        assert!(err(&["delete", "jail", "a", "-o", "json"]).contains("--output does not apply"));
    }

    #[test]
    fn global_flags_go_anywhere() {
        let inv = run(&["get", "jails", "--socket", "/s.sock", "-c", "/k.toml"]);
        assert_eq!(
            inv.global,
            GlobalOptions {
                socket: Some("/s.sock".into()),
                config: Some("/k.toml".into()),
                ..GlobalOptions::default()
            }
        );
        let inv = run(&["--socket=/t.sock", "get", "jails"]);
        assert_eq!(inv.global.socket, Some("/t.sock".into()));
        assert!(err(&["--socket", "a", "--socket", "b", "get", "jails"]).contains("twice"));
    }

    #[test]
    fn cluster_flags_go_anywhere_and_node_ids_are_labels() {
        let inv = run(&[
            "apply",
            "-f",
            "w.yaml",
            "--controlplane",
            "127.0.0.1:7440",
            "--node=n2",
            "--key-file",
            "/ops.key",
        ]);
        assert_eq!(
            inv.global,
            GlobalOptions {
                controlplane: Some("127.0.0.1:7440".into()),
                node: Some("n2".into()),
                key_file: Some("/ops.key".into()),
                ..GlobalOptions::default()
            }
        );
        assert!(err(&["get", "jails", "--node", "N_1"]).contains("--node \"N_1\""));
        assert!(err(&["get", "jails", "--node", "a", "--node", "b"]).contains("twice"));
    }

    #[test]
    fn get_nodes_takes_a_name_but_no_node() {
        assert_eq!(
            cmd(&["get", "nodes", "-o", "yaml"]),
            Command::Get {
                resource: Resource::Nodes,
                name: None,
                output: OutputFormat::Yaml
            }
        );
        assert_eq!(
            cmd(&["get", "node"]),
            Command::Get {
                resource: Resource::Nodes,
                name: None,
                output: OutputFormat::Table
            }
        );
        assert_eq!(
            cmd(&["get", "node", "n1", "-o", "json"]),
            Command::Get {
                resource: Resource::Nodes,
                name: Some("n1".into()),
                output: OutputFormat::Json
            }
        );
        assert!(err(&["get", "nodes", "N_1"]).contains("node name \"N_1\""));
        assert!(err(&["get", "nodes", "n1", "n2"]).contains("\"n2\""));
        assert!(err(&["get", "nodes", "--node", "n1"]).contains("--node does not apply"));
        assert_eq!(
            cmd(&["delete", "node", "n1", "n2"]),
            Command::DeleteNodes {
                names: vec!["n1".into(), "n2".into()]
            }
        );
        assert!(err(&["delete", "node", "N_1"]).contains("node name \"N_1\""));
        assert_eq!(
            cmd(&["cordon", "n1", "n2"]),
            Command::Cordon {
                names: vec!["n1".into(), "n2".into()],
                cordoned: true
            }
        );
        assert_eq!(
            cmd(&["uncordon", "n1"]),
            Command::Cordon {
                names: vec!["n1".into()],
                cordoned: false
            }
        );
        assert!(err(&["cordon"]).contains("at least one node NAME"));
        assert!(err(&["cordon", "n1", "--node", "n2"]).contains("--node"));
        assert!(err(&["delete", "node", "n1", "--node", "n2"]).contains("--node does not apply"));
    }

    #[test]
    fn volumes_are_listed_shown_and_deleted_one_by_one() {
        assert_eq!(
            cmd(&["get", "volumes"]),
            Command::Get {
                resource: Resource::Volumes,
                name: None,
                output: OutputFormat::Table
            }
        );
        assert_eq!(
            cmd(&["get", "vol", "pgdata", "-o", "json"]),
            Command::Get {
                resource: Resource::Volumes,
                name: Some("pgdata".into()),
                output: OutputFormat::Json
            }
        );
        assert_eq!(
            cmd(&["delete-volume", "pgdata"]),
            Command::DeleteVolume {
                name: "pgdata".into(),
                yes: false
            }
        );
        assert_eq!(
            cmd(&["delete-volume", "--yes", "pgdata"]),
            Command::DeleteVolume {
                name: "pgdata".into(),
                yes: true
            }
        );
        assert!(
            err(&["delete", "jail", "a", "--yes"]).contains("--yes does not apply to `delete`")
        );
        assert!(err(&["delete-volume", "a", "--yes", "--yes"]).contains("twice"));
        assert!(err(&["delete-volume"]).contains("needs the NAME"));
        assert!(err(&["delete-volume", "a", "b"]).contains("\"b\""));
        assert!(err(&["delete-volume", "../x"]).contains("volume name \"../x\""));
        assert!(err(&["delete", "volume", "pg"]).contains("delete-volume NAME"));
    }

    #[test]
    fn services_are_listed_shown_and_deleted_by_label_names() {
        assert_eq!(
            cmd(&["get", "services", "-o", "json"]),
            Command::Get {
                resource: Resource::Services,
                name: None,
                output: OutputFormat::Json
            }
        );
        for word in ["service", "svc"] {
            assert_eq!(
                cmd(&["get", word, "web"]),
                Command::Get {
                    resource: Resource::Services,
                    name: Some("web".into()),
                    output: OutputFormat::Table
                }
            );
        }
        assert_eq!(
            cmd(&["delete", "service", "web", "db"]),
            Command::DeleteServices {
                names: vec!["web".into(), "db".into()]
            }
        );
        assert!(err(&["get", "service", "We_b"]).contains("service name \"We_b\""));
        assert!(err(&["delete", "svc", "../x"]).contains("service name \"../x\""));
        assert!(err(&["delete", "service"]).contains("`delete service` needs at least one NAME"));
        assert!(err(&["get", "services", "--node", "n1"]).contains("--node does not apply"));
        assert!(err(&["delete", "service", "a", "--node", "n1"]).contains("--node does not"));
    }

    #[test]
    fn bases_are_fetched_and_listed_by_release_names() {
        assert_eq!(
            cmd(&["base", "fetch", "14.5-RELEASE"]),
            Command::BaseFetch {
                release: "14.5-RELEASE".into()
            }
        );
        let inv = run(&["get", "base", "14.5-RELEASE", "-o", "json", "--node", "n1"]);
        assert_eq!(
            inv.command,
            Command::Get {
                resource: Resource::Bases,
                name: Some("14.5-RELEASE".into()),
                output: OutputFormat::Json
            }
        );
        assert_eq!(inv.global.node.as_deref(), Some("n1"));
        assert!(err(&["base", "fetch"]).contains("needs the RELEASE"));
        assert!(err(&["base", "fetch", "../etc"]).contains("release \"../etc\""));
        assert!(err(&["base", "fetch", "a", "b"]).contains("\"b\""));
        assert!(err(&["base", "pull", "a"]).contains("base fetch RELEASE"));
        assert!(err(&["base", "fetch", "a", "-f", "x"]).contains("--filename does not apply"));
        assert!(err(&["delete", "base", "a"]).contains("does not delete bases"));
    }

    #[test]
    fn ingresses_are_listed_shown_and_deleted_by_label_names() {
        for word in ["ingresses", "ingress", "ing"] {
            assert_eq!(
                cmd(&["get", word]),
                Command::Get {
                    resource: Resource::Ingresses,
                    name: None,
                    output: OutputFormat::Table
                }
            );
        }
        let inv = run(&["get", "ing", "shop", "-o", "yaml", "--node", "n2"]);
        assert_eq!(
            inv.command,
            Command::Get {
                resource: Resource::Ingresses,
                name: Some("shop".into()),
                output: OutputFormat::Yaml
            }
        );
        assert_eq!(inv.global.node.as_deref(), Some("n2"));
        assert_eq!(
            cmd(&["delete", "ingress", "shop", "blog"]),
            Command::DeleteIngresses {
                names: vec!["shop".into(), "blog".into()]
            }
        );
        assert!(err(&["get", "ingress", "Shop"]).contains("ingress name \"Shop\""));
        assert!(err(&["delete", "ing", "../x"]).contains("ingress name \"../x\""));
        assert!(err(&["delete", "ingress"]).contains("`delete ingress` needs at least one NAME"));
        assert!(err(&["get", "ingresses", "a", "b"]).contains("\"b\""));
        assert!(err(&["delete", "ingress", "a", "-o", "json"]).contains("--output does not apply"));
        assert!(err(&["get", "ingresses", "-f", "x"]).contains("--filename does not apply"));
    }

    #[test]
    fn key_generate_takes_a_path_and_an_optional_id() {
        assert_eq!(
            cmd(&["key", "generate", "keys/node.key"]),
            Command::KeyGenerate {
                id: None,
                path: "keys/node.key".into()
            }
        );
        assert_eq!(
            cmd(&["key", "generate", "--id", "ops-2026-11", "/k/ops.key"]),
            Command::KeyGenerate {
                id: Some("ops-2026-11".into()),
                path: "/k/ops.key".into()
            }
        );
        assert!(err(&["key", "generate"]).contains("needs the PATH"));
        assert!(err(&["key", "generate", "a", "b"]).contains("\"b\""));
        assert!(err(&["key", "rotate", "a"]).contains("key generate [--id ID] PATH"));
        assert!(err(&["key", "generate", "a", "--node", "n1"]).contains("--node does not apply"));
        assert!(err(&["key", "generate", "a", "--key-file", "b"]).contains("--key-file does not"));
        assert!(err(&["get", "jails", "--id", "x"]).contains("--id does not apply"));
    }

    #[test]
    fn help_and_version_win_wherever_they_are() {
        assert_eq!(parse(&["get", "--help"]), Ok(Parsed::HelpFor("get".into())));
        assert_eq!(parse(&["--help", "get"]), Ok(Parsed::Help));
        assert_eq!(parse(&["frobnicate", "--help"]), Ok(Parsed::Help));
        assert_eq!(parse(&["-h"]), Ok(Parsed::Help));
        assert_eq!(parse(&["--version", "apply"]), Ok(Parsed::Version));
        assert_eq!(parse(&["-V"]), Ok(Parsed::Version));
        assert!(err(&["version", "extra"]).contains("\"extra\" for `version`"));
    }

    #[test]
    fn version_asks_the_daemon_unless_client() {
        assert_eq!(cmd(&["version"]), Command::Version { client_only: false });
        assert_eq!(
            cmd(&["version", "--client"]),
            Command::Version { client_only: true }
        );
        let run = run(&["version", "--controlplane", "h:1"]);
        assert_eq!(run.global.controlplane.as_deref(), Some("h:1"));
        assert!(err(&["get", "jails", "--client"]).contains("--client does not apply"));
        assert!(err(&["version", "--node", "n1"]).contains("--node does not apply to `version`"));
    }

    #[test]
    fn config_commands_take_a_context_name_and_set_context_its_target() {
        assert_eq!(
            cmd(&["config", "use-context", "prod"]),
            Command::Config(ConfigCommand::UseContext {
                name: "prod".into()
            })
        );
        assert_eq!(
            cmd(&["config", "get-contexts"]),
            Command::Config(ConfigCommand::GetContexts)
        );
        let set = run(&[
            "config",
            "set-context",
            "prod",
            "--controlplane",
            "cp:7400",
            "--key-file",
            "/k",
        ]);
        assert_eq!(
            set.command,
            Command::Config(ConfigCommand::SetContext {
                name: "prod".into()
            })
        );
        assert!(err(&["config", "use-context"]).contains("needs the NAME"));
        assert!(err(&["config", "use-context", "Prod"]).contains("\"Prod\""));
        assert!(err(&["config", "set-context", "p"]).contains("needs --controlplane"));
        assert!(
            err(&[
                "config",
                "set-context",
                "p",
                "--socket",
                "/s",
                "--key-file",
                "/k"
            ])
            .contains("--key-file goes with --controlplane")
        );
        assert!(
            err(&["config", "use-context", "p", "--controlplane", "h:1"])
                .contains("takes no --controlplane")
        );
        assert!(err(&["config", "frob"]).contains("`config frob` is not a command"));
        assert!(err(&["get", "jails", "--context", "a_b"]).contains("--context"));
        assert_eq!(
            run(&["get", "jails", "--context", "prod"])
                .global
                .context
                .as_deref(),
            Some("prod")
        );
    }

    #[test]
    fn describe_takes_a_kind_and_a_name() {
        assert_eq!(
            cmd(&["describe", "svc", "web"]),
            Command::Describe {
                resource: Resource::Services,
                name: "web".into()
            }
        );
        assert_eq!(
            cmd(&["describe", "jail", "web-1", "--node", "n1"]),
            Command::Describe {
                resource: Resource::Jails,
                name: "web-1".into()
            }
        );
        assert!(err(&["describe", "jail"]).contains("needs the kind and NAME"));
        assert!(err(&["describe", "jail", "Web"]).contains("DNS label"));
        assert!(err(&["describe", "base", "14.2-RELEASE"]).contains("get bases RELEASE"));
        assert!(err(&["describe", "node", "n1", "--node", "n2"]).contains("--node does not apply"));
        assert!(err(&["describe", "jail", "a", "-o", "json"]).contains("--output does not apply"));
    }

    #[test]
    fn completion_names_a_shell() {
        assert_eq!(
            cmd(&["completion", "zsh"]),
            Command::Completion { shell: Shell::Zsh }
        );
        assert_eq!(
            cmd(&["completion", "bash"]),
            Command::Completion { shell: Shell::Sh }
        );
        assert!(err(&["completion"]).contains("needs the shell"));
        assert!(err(&["completion", "csh"]).contains("sh, zsh and fish"));
        assert!(err(&["completion", "sh", "--socket", "/s"]).contains("--socket does not apply"));
    }

    #[test]
    fn help_names_a_command_or_prints_everything() {
        assert_eq!(parse(&["help"]), Ok(Parsed::Help));
        assert_eq!(
            parse(&["help", "rollout"]),
            Ok(Parsed::HelpFor("rollout".into()))
        );
        assert_eq!(
            parse(&["apply", "--help"]),
            Ok(Parsed::HelpFor("apply".into()))
        );
        // Help wins over a command line that would not parse.
        assert_eq!(
            parse(&["scale", "jail", "-h"]),
            Ok(Parsed::HelpFor("scale".into()))
        );
        let e = err(&["help", "frobnicate"]);
        assert!(
            e.starts_with(
                "`help frobnicate`: unknown command \"frobnicate\"; use apply, diff, get"
            ),
            "{e}"
        );
        assert!(err(&["help", "get", "jails"]).contains("\"jails\" for `help`"));
        assert!(err(&["help", "-o", "json"]).contains("`help` takes no options"));
    }

    #[test]
    fn command_help_shows_its_usage_lines_and_only_its_flags() {
        let rollout = command_help("rollout").expect("a command");
        assert!(
            rollout.starts_with("Usage:\n  rollout status service NAME"),
            "{rollout}"
        );
        for form in ["rollout history service NAME", "rollout undo service NAME"] {
            assert!(rollout.contains(&format!("\n  {form} ")), "{rollout}");
        }
        for flag in [
            "--timeout DURATION",
            "--to-revision N",
            "--controlplane",
            "-h, --help",
        ] {
            assert!(rollout.contains(flag), "{flag}: {rollout}");
        }
        for flag in [
            "--filename",
            "--output",
            "--replicas",
            "--tail",
            "--version",
            "get jails",
        ] {
            assert!(!rollout.contains(flag), "{flag}: {rollout}");
        }
        let delete = command_help("delete").expect("a command");
        assert!(delete.contains("\n  delete jail NAME..."), "{delete}");
        assert!(delete.contains("-f, --filename FILE"), "{delete}");
        assert!(
            !delete.contains("delete-volume"),
            "a command of its own: {delete}"
        );
        let validate = command_help("validate").expect("a command");
        assert!(
            !validate.contains("--socket"),
            "validate sends nothing: {validate}"
        );
        assert_eq!(command_help("frobnicate"), None);
        // Every command word has a help, and each flag belongs to at least
        // one command.
        for verb in verbs() {
            assert!(command_help(verb).is_some(), "{verb}");
        }
        for flag in FLAGS.iter().filter(|f| f.id != FlagId::Version) {
            assert!(
                verbs().iter().any(|v| applies_to(flag.id, v)),
                "--{} belongs to no command",
                flag.long
            );
        }
    }

    #[test]
    fn logs_follows_with_f_after_logs_or_follow_anywhere() {
        let follow = |args: &[&str]| match cmd(args) {
            Command::Logs { name, follow, tail } => (name, follow, tail),
            other => panic!("{args:?}: {other:?}"),
        };
        assert_eq!(follow(&["logs", "web"]), ("web".into(), false, None));
        assert_eq!(follow(&["logs", "-f", "web"]), ("web".into(), true, None));
        assert_eq!(
            follow(&["logs", "web", "-f", "--tail", "5"]),
            ("web".into(), true, Some(5))
        );
        assert_eq!(
            follow(&["--follow", "logs", "web"]),
            ("web".into(), true, None)
        );
        assert!(err(&["logs", "web", "-f", "--follow"]).contains("twice"));
        assert!(err(&["get", "jails", "--follow"]).contains("--follow does not apply"));
        // Elsewhere -f is still the file.
        assert_eq!(
            cmd(&["apply", "-f", "logs"]),
            Command::Apply {
                input: Input::File("logs".into())
            }
        );
    }

    #[test]
    fn unknown_commands_and_flags_are_usage_errors() {
        assert!(err(&[]).contains("no command given"));
        assert!(err(&["create"]).contains("unknown command \"create\""));
        assert!(err(&["get", "bases", "--watch"]).contains("--watch"));
        assert!(err(&["apply", "-f"]).contains("-f"));
    }

    #[test]
    fn help_lists_every_flag_and_command() {
        let help = help_text();
        for flag in FLAGS {
            assert!(help.contains(&format!("--{}", flag.long)), "{help}");
            if let Some(c) = flag.short {
                assert!(help.contains(&format!("-{c}, --{}", flag.long)), "{help}");
            }
        }
        for (form, _) in COMMANDS {
            assert!(help.contains(&format!("\n  {form} ")), "{help}");
        }
        assert!(help.contains("Exit status"));
    }

    #[test]
    fn scale_and_rollout_name_a_service_and_check_their_flags() {
        assert_eq!(
            cmd(&["scale", "service", "web", "--replicas", "5"]),
            Command::Scale {
                name: "web".into(),
                replicas: 5
            }
        );
        assert_eq!(
            cmd(&["rollout", "status", "svc", "web", "--timeout", "90s"]),
            Command::RolloutStatus {
                name: "web".into(),
                timeout: std::time::Duration::from_secs(90)
            }
        );
        assert_eq!(
            cmd(&["rollout", "status", "service", "web"]),
            Command::RolloutStatus {
                name: "web".into(),
                timeout: std::time::Duration::from_secs(300)
            }
        );
        assert_eq!(
            cmd(&["rollout", "history", "service", "web"]),
            Command::RolloutHistory { name: "web".into() }
        );
        assert_eq!(
            cmd(&["rollout", "undo", "service", "web", "--to-revision", "2"]),
            Command::RolloutUndo {
                name: "web".into(),
                to: Some(2)
            }
        );
        assert!(err(&["scale", "service", "web"]).contains("--replicas N"));
        assert!(err(&["scale", "service", "web", "--replicas", "-1"]).contains("--replicas"));
        assert!(err(&["scale", "jail", "web", "--replicas", "1"]).contains("works on services"));
        assert!(err(&["scale", "service", "--replicas", "1"]).contains("needs service NAME"));
        assert!(err(&["get", "jails", "--replicas", "1"]).contains("--replicas"));
        assert!(err(&["rollout", "service", "web"]).contains("not a command"));
        assert!(err(&["rollout"]).contains("status, history or undo"));
        assert!(
            err(&["rollout", "history", "service", "web", "--timeout", "1m"])
                .contains("--timeout does not apply to `rollout history`")
        );
        assert!(
            err(&["rollout", "status", "service", "web", "--timeout", "5"]).contains("--timeout")
        );
        assert!(
            err(&["rollout", "undo", "service", "web", "--to-revision", "0"])
                .contains("--to-revision")
        );
        assert!(err(&["rollout", "undo", "service", "web", "--node", "n1"]).contains("--node"));
    }

    #[test]
    fn get_events_takes_for_and_watch_and_nothing_else_does() {
        assert_eq!(
            cmd(&["get", "events", "--for", "node/n1", "-w", "-o", "json"]),
            Command::GetEvents {
                object: Some(ObjectRef {
                    kind: crate::common::wire::ObjectKind::Node,
                    name: "n1".into()
                }),
                watch: true,
                output: OutputFormat::Json,
            }
        );
        assert_eq!(
            cmd(&["get", "ev"]),
            Command::GetEvents {
                object: None,
                watch: false,
                output: OutputFormat::Table,
            }
        );
        assert!(err(&["get", "events", "--for", "web"]).contains("KIND/NAME"));
        assert!(err(&["get", "events", "--for", "pod/web"]).contains("unknown kind"));
        assert!(err(&["get", "events", "web"]).contains("--for KIND/NAME"));
        assert!(err(&["get", "volumes", "-w"]).contains("--watch applies to `get events`"));
        assert_eq!(
            cmd(&["get", "svc", "web", "-w"]),
            Command::Watch {
                resource: Resource::Services,
                name: Some("web".into()),
                output: OutputFormat::Table
            }
        );
        assert!(err(&["logs", "web", "--for", "jail/web"]).contains("--for applies"));
    }

    #[test]
    fn every_flag_in_the_table_parses() {
        for flag in FLAGS {
            let mut args = vec![format!("--{}", flag.long)];
            if flag.value.is_some() {
                args.push(
                    match flag.id {
                        FlagId::Output => "json",
                        FlagId::For => "jail/web",
                        FlagId::Tail | FlagId::Replicas | FlagId::ToRevision => "5",
                        FlagId::Timeout => "90s",
                        _ => "x",
                    }
                    .into(),
                );
            }
            if flag.id == FlagId::Client {
                args.push("version".into());
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                assert!(parse(&args).is_ok(), "{args:?}: {:?}", parse(&args));
                continue;
            }
            if matches!(flag.id, FlagId::Yes | FlagId::Follow) {
                let verb = if flag.id == FlagId::Yes {
                    "delete-volume"
                } else {
                    "logs"
                };
                args.extend([verb.to_string(), "pg".to_string()]);
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                assert!(parse(&args).is_ok(), "{args:?}: {:?}", parse(&args));
                continue;
            }
            if flag.id == FlagId::Filename {
                args.push("validate".into());
            } else if flag.id == FlagId::DryRun {
                args.extend(["apply", "-f", "web.yaml"].map(String::from));
            } else if flag.id == FlagId::Id {
                args.extend(["key".to_string(), "generate".to_string(), "p".to_string()]);
            } else if flag.id == FlagId::Tail {
                args.extend(["logs".to_string(), "web".to_string()]);
            } else if flag.id == FlagId::Replicas {
                args.extend(["scale", "service", "web"].map(String::from));
            } else if flag.id == FlagId::Timeout {
                args.extend(["rollout", "status", "service", "web"].map(String::from));
            } else if flag.id == FlagId::ToRevision {
                args.extend(["rollout", "undo", "service", "web"].map(String::from));
            } else if matches!(flag.id, FlagId::For | FlagId::Watch) {
                args.extend(["get", "events"].map(String::from));
            } else {
                args.extend(["get".to_string(), "jails".to_string()]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            assert!(parse(&args).is_ok(), "{args:?}: {:?}", parse(&args));
        }
    }
}
