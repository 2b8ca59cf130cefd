//! Running one parsed keelctl command: read the spec, validate the whole of
//! it, then make the requests in order and print one line per result.
//!
//! The order is the contract: every document is parsed and validated, and
//! every kind checked, before the first request, so a bad file changes
//! nothing; requests then go one at a time and the first failure stops the
//! rest (what was already applied stays applied, and was printed).
//!
//! This file decides what happens and in which order; it never formats (that
//! is `output.rs`), never builds a request path (`api.rs`) and never chooses an
//! exit status (`CtlError::exit_code`).

use std::io::{self, Read, Write};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::common::http::Endpoint;
use crate::common::spec::{self, Document, Jail};

use super::api::Api;
use super::args::{Command, Input, Invocation, OutputFormat, Resource};
use super::{CtlError, Env, agent_socket, output};

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
    let connect = || -> Result<Api, CtlError> {
        Ok(Api::new(Endpoint::Unix(agent_socket(
            &invocation.global,
            env,
        )?)))
    };
    match &invocation.command {
        Command::Validate { input } => {
            let (source, text) = read_input(input, stdin)?;
            let docs = parse(&source, &text, false)?;
            out.line(&output::valid_line(docs.len()));
        }
        Command::Apply { input } => {
            let jails = read_jails(input, stdin)?;
            let api = connect()?;
            for jail in &jails {
                let status = api.apply_jail(jail).map_err(|error| CtlError::Request {
                    action: format!("apply jail/{}", jail.metadata.name),
                    error,
                })?;
                out.line(&output::applied_line(&status));
            }
        }
        Command::Get {
            resource: Resource::Jails,
            name,
            output: format,
        } => {
            let api = connect()?;
            match name {
                None => {
                    let jails = api.list_jails().map_err(|error| CtlError::Request {
                        action: "get jails".into(),
                        error,
                    })?;
                    if *format == OutputFormat::Table && jails.is_empty() {
                        // kubectl's convention: the note on stderr, stdout empty.
                        let _ = writeln!(stderr, "No jails found.");
                    } else {
                        show(out, *format, &jails, || {
                            output::jail_table(&jails, now_unix())
                        })?;
                    }
                }
                Some(name) => {
                    let jail = api.get_jail(name).map_err(|error| CtlError::Request {
                        action: format!("get jail/{name}"),
                        error,
                    })?;
                    show(out, *format, &jail, || {
                        output::jail_table(std::slice::from_ref(&jail), now_unix())
                    })?;
                }
            }
        }
        Command::DeleteJails { names } => {
            let api = connect()?;
            for name in names {
                delete(&api, name, out)?;
            }
        }
        Command::DeleteFile { input } => {
            let jails = read_jails(input, stdin)?;
            let api = connect()?;
            // Reverse order: what was applied last (and may lean on what came
            // before it) goes first.
            for jail in jails.iter().rev() {
                delete(&api, &jail.metadata.name, out)?;
            }
        }
    }
    Ok(())
}

fn delete(api: &Api, name: &str, out: &mut Out<'_>) -> Result<(), CtlError> {
    api.delete_jail(name).map_err(|error| CtlError::Request {
        action: format!("delete jail/{name}"),
        error,
    })?;
    out.line(&output::deleted_line(name));
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
        OutputFormat::Table => table(),
        _ => output::encode(format, value).map_err(|reason| CtlError::Encode {
            format: format.to_string(),
            reason,
        })?,
    };
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

/// Every document of `text`, all validated; at least one.
fn parse(source: &str, text: &str, would_send: bool) -> Result<Vec<Document>, CtlError> {
    let docs = spec::parse_documents(text).map_err(|error| CtlError::Invalid {
        source: source.to_string(),
        error,
        would_send,
    })?;
    if docs.is_empty() {
        return Err(CtlError::Empty {
            source: source.to_string(),
        });
    }
    Ok(docs)
}

/// The jails of `input`, once every document is valid and a Jail.
fn read_jails(input: &Input, stdin: &mut dyn Read) -> Result<Vec<Jail>, CtlError> {
    let (source, text) = read_input(input, stdin)?;
    parse(&source, &text, true)?
        .into_iter()
        .enumerate()
        .map(|(i, doc)| match doc {
            Document::Jail(jail) => Ok(jail),
            other => Err(CtlError::UnsupportedKind {
                source: source.clone(),
                document: i + 1,
                kind: other.kind(),
                name: other.name().to_string(),
            }),
        })
        .collect()
}
